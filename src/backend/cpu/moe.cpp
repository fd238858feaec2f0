// CPU backend: mixture-of-experts routing (softmax + top-k per token and its backward, the
// load-balancing loss's probability sums) and the dispatch / combine permutations. The per-token
// math is include/shardtrain/backend/moe_math.h (shared with the CUDA kernels); the class and its
// threading rules are in cpu_backend.h. Rows are split over threads; every sum runs in one fixed
// order (a token's k slots in slot order, a group's rows in row order).
#include <algorithm>
#include <cstring>
#include <vector>

#include "shardtrain/backend/moe_math.h"
#include "cpu_backend.h"

namespace shardtrain::cpu {

template <typename T>
void CpuBackend<T>::moe_route(S* probs, int32_t* experts, S* weights, const T* logits, int N, int E, int k,
                              bool renorm, S* lse) {
  par_ranges(static_cast<size_t>(N), row_grain(static_cast<size_t>(E) * k), [&](size_t b, size_t e) {
    std::vector<S> z(static_cast<size_t>(E));
    for (size_t t = b; t < e; ++t) {
      for (int i = 0; i < E; ++i) z[static_cast<size_t>(i)] = math::ld(logits[t * E + i]);
      if (lse) lse[t] = math::moe_logsumexp(z.data(), E);
      math::moe_route(z.data(), E, k, renorm, probs + t * E, experts + t * k, weights + t * k);
    }
  });
}

template <typename T>
void CpuBackend<T>::moe_route_backward(T* dlogits, const S* probs, const int32_t* experts, const S* weights,
                                       const S* dweights, const S* aux_dprob, int group_rows, int N, int E, int k,
                                       bool renorm, const S* lse, const S* z_dlse) {
  par_ranges(static_cast<size_t>(N), row_grain(static_cast<size_t>(E) * 4), [&](size_t b, size_t e) {
    std::vector<S> dz(static_cast<size_t>(E));
    for (size_t t = b; t < e; ++t) {
      const S* g = aux_dprob ? aux_dprob + (t / static_cast<size_t>(group_rows)) * E : nullptr;
      math::moe_route_backward(probs + t * E, experts + t * k, weights + t * k, dweights + t * k, g, E, k, renorm,
                               dz.data());
      if (z_dlse)
        math::moe_z_dlogits(probs + t * E, lse[t], E, z_dlse[t / static_cast<size_t>(group_rows)], dz.data());
      for (int i = 0; i < E; ++i) dlogits[t * E + i] = math::st<T>(dz[static_cast<size_t>(i)]);
    }
  });
}

template <typename T>
void CpuBackend<T>::moe_prob_sums(S* psum, const S* probs, int group_rows, int N, int E) {
  const size_t G = (static_cast<size_t>(N) + group_rows - 1) / static_cast<size_t>(group_rows);
  par_ranges(G, 1, [&](size_t b, size_t e) {
    for (size_t g = b; g < e; ++g) {
      S* out = psum + g * E;
      const size_t t1 = std::min(static_cast<size_t>(N), (g + 1) * group_rows);
      for (size_t t = g * group_rows; t < t1; ++t)
        for (int i = 0; i < E; ++i) out[i] += probs[t * E + i];
    }
  });
}

template <typename T> void CpuBackend<T>::moe_z_sums(S* zsum, const S* lse, int group_rows, int N) {
  const size_t G = (static_cast<size_t>(N) + group_rows - 1) / static_cast<size_t>(group_rows);
  for (size_t g = 0; g < G; ++g) {
    const size_t t1 = std::min(static_cast<size_t>(N), (g + 1) * group_rows);
    for (size_t t = g * group_rows; t < t1; ++t) zsum[g] += lse[t] * lse[t];
  }
}

template <typename T> void CpuBackend<T>::gather_rows(T* out, const T* in, const int32_t* idx, int n, int C) {
  par_ranges(static_cast<size_t>(n), row_grain(static_cast<size_t>(C)), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) std::memcpy(out + i * C, in + static_cast<size_t>(idx[i]) * C, C * sizeof(T));
  });
}

template <typename T>
void CpuBackend<T>::moe_combine(T* out, const T* base, const T* ye, const int32_t* pos, const S* w, int N, int k,
                                int C) {
  par_ranges(static_cast<size_t>(N), row_grain(static_cast<size_t>(C) * k), [&](size_t b, size_t e) {
    std::vector<A> acc(static_cast<size_t>(C));
    for (size_t t = b; t < e; ++t) {
      for (int c = 0; c < C; ++c) acc[static_cast<size_t>(c)] = A(0);
      for (int j = 0; j < k; ++j) {
        const A wj = w ? A(w[t * k + j]) : A(1);
        const T* y = ye + static_cast<size_t>(pos[t * k + j]) * C;
        for (int c = 0; c < C; ++c) acc[static_cast<size_t>(c)] += wj * math::ld(y[c]);
      }
      for (int c = 0; c < C; ++c) {
        const A v = base ? math::ld(base[t * C + c]) + acc[static_cast<size_t>(c)] : acc[static_cast<size_t>(c)];
        out[t * C + c] = math::st<T>(v);
      }
    }
  });
}

template <typename T>
void CpuBackend<T>::moe_combine_backward(T* dye, S* dw, const T* dout, const T* ye, const int32_t* pos, const S* w,
                                         int N, int k, int C) {
  par_ranges(static_cast<size_t>(N), row_grain(static_cast<size_t>(C) * k * 2), [&](size_t b, size_t e) {
    for (size_t t = b; t < e; ++t)
      for (int j = 0; j < k; ++j) {
        const size_t r = static_cast<size_t>(pos[t * k + j]);
        const A wj = A(w[t * k + j]);
        const T* d = dout + t * C;
        const T* y = ye + r * C;
        T* dy = dye + r * C;
        A dot = A(0);
        for (int c = 0; c < C; ++c) {
          dot += math::ld(d[c]) * math::ld(y[c]);
          dy[c] = math::st<T>(wj * math::ld(d[c]));
        }
        dw[t * k + j] = static_cast<S>(dot);
      }
  });
}

template <typename T> void CpuBackend<T>::ids_to_host(int32_t* h, const int32_t* s, size_t n) {
  if (n) std::memmove(h, s, n * sizeof(int32_t));
}
template <typename T> void CpuBackend<T>::acc_to_host(S* h, const S* s, size_t n) {
  if (n) std::memmove(h, s, n * sizeof(S));
}
template <typename T> void CpuBackend<T>::acc_from_host(S* d, const S* h, size_t n) {
  if (n) std::memmove(d, h, n * sizeof(S));
}

#define ST_CPU_MOE(T)                                                                                                  \
  template void CpuBackend<T>::moe_route(CpuBackend<T>::S*, int32_t*, CpuBackend<T>::S*, const T*, int, int, int, bool, \
                                         CpuBackend<T>::S*);                                                           \
  template void CpuBackend<T>::moe_route_backward(T*, const CpuBackend<T>::S*, const int32_t*, const CpuBackend<T>::S*, \
                                                  const CpuBackend<T>::S*, const CpuBackend<T>::S*, int, int, int, int,  \
                                                  bool, const CpuBackend<T>::S*, const CpuBackend<T>::S*);               \
  template void CpuBackend<T>::moe_prob_sums(CpuBackend<T>::S*, const CpuBackend<T>::S*, int, int, int);               \
  template void CpuBackend<T>::moe_z_sums(CpuBackend<T>::S*, const CpuBackend<T>::S*, int, int);                       \
  template void CpuBackend<T>::gather_rows(T*, const T*, const int32_t*, int, int);                                     \
  template void CpuBackend<T>::moe_combine(T*, const T*, const T*, const int32_t*, const CpuBackend<T>::S*, int, int,  \
                                           int);                                                                        \
  template void CpuBackend<T>::moe_combine_backward(T*, CpuBackend<T>::S*, const T*, const T*, const int32_t*,         \
                                                    const CpuBackend<T>::S*, int, int, int);                            \
  template void CpuBackend<T>::ids_to_host(int32_t*, const int32_t*, size_t);                                           \
  template void CpuBackend<T>::acc_to_host(CpuBackend<T>::S*, const CpuBackend<T>::S*, size_t);                         \
  template void CpuBackend<T>::acc_from_host(CpuBackend<T>::S*, const CpuBackend<T>::S*, size_t);
ST_CPU_MOE(float)
ST_CPU_MOE(double)
ST_CPU_MOE(bf16)
#undef ST_CPU_MOE

}  // namespace shardtrain::cpu
