// CPU backend: OpenBLAS for GEMM, plain loops for everything else. The per-element math comes from
// ops_math.h, shared with the CUDA kernels. Loops are written so the compiler can vectorize them;
// reductions accumulate in double where a long sum would otherwise lose precision.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "shardtrain/backend.h"
#include "shardtrain/ops_math.h"

namespace shardtrain {
namespace {

template <typename T> class CpuBackend final : public Backend<T> {
 public:
  const char* name() const override { return "cpu"; }

  T* alloc(size_t n) override {
    size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    return static_cast<T*>(p);
  }
  void free(T* p) override { std::free(p); }
  void zero(T* p, size_t n) override { std::memset(p, 0, n * sizeof(T)); }
  void copy(T* d, const T* s, size_t n) override { if (n) std::memmove(d, s, n * sizeof(T)); }
  void to_host(T* h, const T* s, size_t n) override { copy(h, s, n); }
  void from_host(T* d, const T* h, size_t n) override { copy(d, h, n); }

  void gemm(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
            T* C, int ldc) override {
    if (M == 0 || N == 0) return;
    auto TA = ta ? CblasTrans : CblasNoTrans;
    auto TB = tb ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>)
      cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    else
      cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }

  void gemm_strided_batched(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, int64_t sa,
                            const T* B, int ldb, int64_t sb, T beta, T* C, int ldc, int64_t sc, int batch) override {
    for (int i = 0; i < batch; ++i) gemm(ta, tb, M, N, K, alpha, A + i * sa, lda, B + i * sb, ldb, beta, C + i * sc, ldc);
  }

  void axpy(size_t n, T alpha, const T* x, T* y) override {
    for (size_t i = 0; i < n; ++i) y[i] += alpha * x[i];
  }
  void scale(size_t n, T alpha, T* x) override {
    for (size_t i = 0; i < n; ++i) x[i] *= alpha;
  }
  double sum_squares(const T* x, size_t n) override {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
    return s;
  }

  void embedding_forward(T* out, const int32_t* tok, const T* table, int N, int C) override {
    for (int i = 0; i < N; ++i) std::memcpy(out + static_cast<size_t>(i) * C, table + static_cast<size_t>(tok[i]) * C, C * sizeof(T));
  }
  void embedding_backward(T* dtable, const int32_t* tok, const T* dout, int N, int C) override {
    for (int i = 0; i < N; ++i) {
      T* row = dtable + static_cast<size_t>(tok[i]) * C;
      const T* d = dout + static_cast<size_t>(i) * C;
      for (int c = 0; c < C; ++c) row[c] += d[c];
    }
  }

  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, T eps) override {
    for (int i = 0; i < N; ++i) {
      const T* xi = x + static_cast<size_t>(i) * C;
      T* oi = out + static_cast<size_t>(i) * C;
      T ss = 0;
      for (int c = 0; c < C; ++c) ss += xi[c] * xi[c];
      T r = T(1) / math::st_sqrt(ss / C + eps);
      for (int c = 0; c < C; ++c) oi[c] = xi[c] * r * w[c];
      rstd[i] = r;
    }
  }
  // y = x r w, r = (mean(x^2)+eps)^-1/2.  dx = r (w*dy) - x r^3 / C * sum(w*dy*x).
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) override {
    for (int i = 0; i < N; ++i) {
      const T* xi = x + static_cast<size_t>(i) * C;
      const T* di = dout + static_cast<size_t>(i) * C;
      T* dxi = dx + static_cast<size_t>(i) * C;
      T r = rstd[i];
      T dot = 0;
      for (int c = 0; c < C; ++c) dot += w[c] * di[c] * xi[c];
      T k = dot * r * r * r / C;
      for (int c = 0; c < C; ++c) {
        dxi[c] += r * w[c] * di[c] - k * xi[c];
        dw[c] += di[c] * xi[c] * r;
      }
    }
  }

  void rope_forward(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD) override {
    rope_apply(x, cs, sn, B, T_, H, HD, false);
  }
  void rope_backward(T* dx, const T* cs, const T* sn, int B, int T_, int H, int HD) override {
    rope_apply(dx, cs, sn, B, T_, H, HD, true);
  }

  void softmax_causal_forward(T* att, int R, int T_, T scale) override {
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < T_; ++t) {
        T* row = att + (static_cast<size_t>(r) * T_ + t) * T_;
        T mx = row[0] * scale;
        for (int s = 1; s <= t; ++s) mx = row[s] * scale > mx ? row[s] * scale : mx;
        for (int s = 0; s <= t; ++s) row[s] = math::st_exp(row[s] * scale - mx);  // vectorized
        T sum = 0;
        for (int s = 0; s <= t; ++s) sum += row[s];
        T inv = T(1) / sum;
        for (int s = 0; s <= t; ++s) row[s] *= inv;
        for (int s = t + 1; s < T_; ++s) row[s] = 0;
      }
    }
  }
  // p = softmax(scale*z): dz = scale * p * (dp - sum(p*dp)).
  void softmax_causal_backward(T* datt, const T* att, int R, int T_, T scale) override {
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < T_; ++t) {
        size_t o = (static_cast<size_t>(r) * T_ + t) * T_;
        T* d = datt + o;
        const T* p = att + o;
        T dot = 0;
        for (int s = 0; s <= t; ++s) dot += p[s] * d[s];
        for (int s = 0; s <= t; ++s) d[s] = scale * p[s] * (d[s] - dot);
        for (int s = t + 1; s < T_; ++s) d[s] = 0;
      }
    }
  }

  void swiglu_forward(T* h, const T* g, const T* u, size_t n) override {
    for (size_t i = 0; i < n; ++i) h[i] = math::swiglu(g[i], u[i]);
  }
  void swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) override {
    for (size_t i = 0; i < n; ++i) math::swiglu_backward(g[i], u[i], dh[i], &dg[i], &du[i]);
  }

  double cross_entropy(T* dlogits, const T* logits, const int32_t* tgt, int N, int V, T grad_scale) override {
    double total = 0;
    if (!dlogits) scratch_.resize(static_cast<size_t>(V));
    for (int i = 0; i < N; ++i) {
      const T* l = logits + static_cast<size_t>(i) * V;
      T* e = dlogits ? dlogits + static_cast<size_t>(i) * V : scratch_.data();  // may alias l
      T mx = l[0];
      for (int v = 1; v < V; ++v) mx = l[v] > mx ? l[v] : mx;
      const T lt = l[tgt[i]];  // read before e overwrites it
      for (int v = 0; v < V; ++v) e[v] = math::st_exp(l[v] - mx);  // vectorized
      T sum = 0;
      for (int v = 0; v < V; ++v) sum += e[v];
      total += static_cast<double>(mx + std::log(sum) - lt);
      if (dlogits) {
        const T k = grad_scale / sum;
        for (int v = 0; v < V; ++v) e[v] *= k;
        e[tgt[i]] -= grad_scale;
      }
    }
    return total;
  }

  void adamw(T* p, T* m, T* v, const T* g, size_t n, T lr, T b1, T b2, T eps, T wd, T gs, int64_t step) override {
    T bc1 = T(1) - static_cast<T>(std::pow(static_cast<double>(b1), static_cast<double>(step)));
    T bc2 = T(1) - static_cast<T>(std::pow(static_cast<double>(b2), static_cast<double>(step)));
    for (size_t i = 0; i < n; ++i) math::adamw(&p[i], &m[i], &v[i], g[i] * gs, lr, b1, b2, eps, wd, bc1, bc2);
  }

 private:
  std::vector<T> scratch_;  // one row of exponentials for cross_entropy without dlogits
  static void rope_apply(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
    int half = HD / 2;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T_; ++t) {
        const T* c = cs + static_cast<size_t>(t) * half;
        const T* s = sn + static_cast<size_t>(t) * half;
        for (int h = 0; h < H; ++h) {
          T* v = x + ((static_cast<size_t>(b) * T_ + t) * H + h) * HD;
          for (int j = 0; j < half; ++j) {
            T o1, o2;
            if (backward) math::rope_rotate_backward(v[j], v[j + half], c[j], s[j], &o1, &o2);
            else math::rope_rotate(v[j], v[j + half], c[j], s[j], &o1, &o2);
            v[j] = o1;
            v[j + half] = o2;
          }
        }
      }
  }
};

}  // namespace

template <typename T> std::unique_ptr<Backend<T>> make_cpu_backend() { return std::make_unique<CpuBackend<T>>(); }
template std::unique_ptr<Backend<float>> make_cpu_backend<float>();
template std::unique_ptr<Backend<double>> make_cpu_backend<double>();

void set_blas_threads(int n) {
  if (n > 0) openblas_set_num_threads(n);
}

}  // namespace shardtrain
