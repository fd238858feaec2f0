// CPU backend: the loss of the LM head: cross-entropy over the logits (softmax, loss and its
// gradient in one pass per row) and its vocabulary-parallel form (vocab_ce_max / _sum / _finish,
// backend.h); rows side by side, the per-row losses added in row order. The per-element math
// (st_exp, group_max, vocab_ce_grad) is in include/shardtrain/backend/ops_math.h; the class and
// its threading rules are in cpu_backend.h. A row whose target is negative (kNoTarget) adds 0 and
// gets a zero gradient: it runs through the same loop as the others (with target 0) and is
// cleared after it, so that the loop is the one from before targets could be missing: a branch in
// it changed the compiler's code for bf16 rows, and with it their roundings (tests/bench/bitwise_ab.sh
// cp2-bf16-w2: grad norm 4.3647286 -> 4.3647583 at step 2).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_backend.h"

namespace shardtrain::cpu {

namespace {
// The targets with every negative one replaced by 0 (into `fixed`), or `tgt` itself when none is.
const int32_t* targets_or_zero(const int32_t* tgt, int N, std::vector<int32_t>& fixed) {
  if (std::none_of(tgt, tgt + N, [](int32_t t) { return t < 0; })) return tgt;
  fixed.assign(tgt, tgt + N);
  for (int32_t& t : fixed) t = t < 0 ? 0 : t;
  return fixed.data();
}
// Rows of `targets` without a target: part[i] = 0 and, with d, row i of d [N, cols] zero.
template <typename T>
void clear_no_target_rows(const int32_t* targets, int N, int cols, std::vector<double>& part, T* d) {
  for (int i = 0; i < N; ++i) {
    if (targets[i] >= 0) continue;
    part[static_cast<size_t>(i)] = 0.0;
    if (d) std::fill(d + static_cast<size_t>(i) * cols, d + static_cast<size_t>(i + 1) * cols, T{});
  }
}
}  // namespace

// Rows side by side; the per-row losses are added in row order.
template <typename T>
double CpuBackend<T>::cross_entropy(T* dlogits, const T* logits, const int32_t* targets, int N, int V, S grad_scale) {
  std::vector<int32_t> fixed;
  const int32_t* tgt = targets_or_zero(targets, N, fixed);
  const bool inplace = std::is_same_v<T, A> && dlogits != nullptr;
  part_.assign(static_cast<size_t>(N), 0.0);
  par_ranges(static_cast<size_t>(N), row_grain(V), [&](size_t rb, size_t re) {
    std::vector<A> tmp(inplace ? 0 : static_cast<size_t>(V));
    for (size_t i = rb; i < re; ++i) {
      const T* l = logits + i * V;
      A* e = inplace ? reinterpret_cast<A*>(dlogits + i * V) : tmp.data();  // may alias l
      A mx = math::ld(l[0]);
      for (int v = 1; v < V; ++v) mx = math::ld(l[v]) > mx ? math::ld(l[v]) : mx;
      const A lt = math::ld(l[tgt[i]]);  // read before e overwrites it
      for (int v = 0; v < V; ++v) e[v] = math::st_exp(math::ld(l[v]) - mx);  // vectorized
      A sum = 0;
      for (int v = 0; v < V; ++v) sum += e[v];
      part_[i] = static_cast<double>(mx + std::log(sum) - lt);
      if (dlogits) {
        T* d = dlogits + i * V;
        const A k = grad_scale / sum, et = e[tgt[i]];  // e may be d: keep the target's value
        for (int v = 0; v < V; ++v) d[v] = math::st<T>(e[v] * k);
        d[tgt[i]] = math::st<T>(et * k - grad_scale);
      }
    }
  });
  if (tgt != targets) clear_no_target_rows(targets, N, V, part_, dlogits);
  double total = 0;
  for (double p : part_) total += p;
  return total;
}

// Vocabulary-parallel cross-entropy (backend.h): rows side by side, each as cross_entropy.
template <typename T> void CpuBackend<T>::vocab_ce_max(const T* logits, int N, int Vl, int valid, S* mx) {
  par_ranges(static_cast<size_t>(N), row_grain(static_cast<size_t>(valid)), [&](size_t rb, size_t re) {
    for (size_t i = rb; i < re; ++i) {
      const T* l = logits + i * Vl;
      A m = -std::numeric_limits<A>::infinity();
      for (int v = 0; v < valid; ++v) m = math::ld(l[v]) > m ? math::ld(l[v]) : m;
      mx[i] = m;
    }
  });
}
template <typename T>
void CpuBackend<T>::vocab_ce_sum(const T* logits, const int32_t* tgt, int N, int Vl, int valid, int v0,
                                 const S* maxes, int G, S* st) {
  par_ranges(static_cast<size_t>(N), row_grain(static_cast<size_t>(valid)), [&](size_t rb, size_t re) {
    for (size_t i = rb; i < re; ++i) {
      const T* l = logits + i * Vl;
      const A m = math::group_max<A>(maxes, G, N, i);
      A sum = 0;
      for (int v = 0; v < valid; ++v) sum += math::st_exp(math::ld(l[v]) - m);
      const int t = tgt[i] - v0;
      st[2 * i] = sum;
      st[2 * i + 1] = t >= 0 && t < valid ? math::ld(l[t]) : A(0);
    }
  });
}
template <typename T>
void CpuBackend<T>::vocab_ce_finish(T* dlogits, const T* logits, const int32_t* tgt, int N, int Vl, int valid, int v0,
                                    const S* maxes, int G, const S* st, S grad_scale) {
  // (A row without a target: no column is its target, its values are computed and cleared after.)
  part_.assign(static_cast<size_t>(N), 0.0);
  par_ranges(static_cast<size_t>(N), row_grain(static_cast<size_t>(Vl)), [&](size_t rb, size_t re) {
    for (size_t i = rb; i < re; ++i) {
      const A m = math::group_max<A>(maxes, G, N, i), sum = st[2 * i];
      part_[i] = static_cast<double>(m + std::log(sum) - st[2 * i + 1]);
      if (!dlogits) continue;
      const T* l = logits + i * Vl;
      T* d = dlogits + i * Vl;  // may be l: each element read before it is written
      const A k = grad_scale / sum;
      const int t = tgt[i] - v0;
      for (int v = 0; v < valid; ++v) d[v] = math::st<T>(math::vocab_ce_grad<A>(math::ld(l[v]), m, k, v == t, grad_scale));
      for (int v = valid; v < Vl; ++v) d[v] = math::st<T>(A(0));
    }
  });
  if (std::any_of(tgt, tgt + N, [](int32_t t) { return t < 0; })) clear_no_target_rows(tgt, N, Vl, part_, dlogits);
  double total = 0;
  for (double p : part_) total += p;
  this->add_loss_sum(total);
}

#define ST_CPU_LOSS(T)                                                                                               \
  template double CpuBackend<T>::cross_entropy(T*, const T*, const int32_t*, int, int, CpuBackend<T>::S);          \
  template void CpuBackend<T>::vocab_ce_max(const T*, int, int, int, CpuBackend<T>::S*);                           \
  template void CpuBackend<T>::vocab_ce_sum(const T*, const int32_t*, int, int, int, int, const CpuBackend<T>::S*, \
                                            int, CpuBackend<T>::S*);                                               \
  template void CpuBackend<T>::vocab_ce_finish(T*, const T*, const int32_t*, int, int, int, int,                   \
                                               const CpuBackend<T>::S*, int, const CpuBackend<T>::S*,             \
                                               CpuBackend<T>::S);
ST_CPU_LOSS(float)
ST_CPU_LOSS(double)
ST_CPU_LOSS(bf16)
#undef ST_CPU_LOSS

}  // namespace shardtrain::cpu
