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

// Every kernel loads stored elements with math::ld into the arithmetic type A (float for bf16),
// computes in A and stores once with math::st<T>. For float and double both are the identity, so
// those loops compile to what they would be without the indirection.
template <typename T> class CpuBackend final : public Backend<T> {
 public:
  using S = typename Backend<T>::S;
  using A = math::Acc<T>;
  const char* name() const override { return "cpu"; }

  T* alloc(size_t n) override { return static_cast<T*>(aligned_zeroed(n * sizeof(T))); }
  void free(T* p) override { std::free(p); }
  void zero(T* p, size_t n) override { std::memset(p, 0, n * sizeof(T)); }
  void copy(T* d, const T* s, size_t n) override { if (n) std::memmove(d, s, n * sizeof(T)); }
  void to_host(T* h, const T* s, size_t n) override { copy(h, s, n); }
  void from_host(T* d, const T* h, size_t n) override { copy(d, h, n); }
  int32_t* alloc_ids(size_t n) override { return static_cast<int32_t*>(aligned_zeroed(n * sizeof(int32_t))); }
  void free_ids(int32_t* p) override { std::free(p); }
  void ids_from_host(int32_t* d, const int32_t* h, size_t n) override { if (n) std::memmove(d, h, n * sizeof(int32_t)); }
  void synchronize() override {}

  void from_f32(T* d, const float* s, size_t n) override {
    for (size_t i = 0; i < n; ++i) d[i] = math::st<T>(static_cast<A>(s[i]));
  }
  void add_to_f32(float* d, float alpha, const T* s, size_t n) override {
    for (size_t i = 0; i < n; ++i) d[i] += alpha * static_cast<float>(math::ld(s[i]));
  }

  void gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb, S beta,
            T* C, int ldc) override {
    if (M == 0 || N == 0) return;
    auto TA = ta ? CblasTrans : CblasNoTrans;
    auto TB = tb ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>) {
      cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
    } else if constexpr (std::is_same_v<T, double>) {
      cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
    } else {
      // bf16: widen the operands to float, sgemm (fp32 accumulation, as cuBLAS with
      // CUBLAS_COMPUTE_32F), round the result once.
      const int ra = ta ? K : M, ca = ta ? M : K, rb = tb ? N : K, cb = tb ? K : N;
      widen(fa_, Am, ra, ca, lda);
      widen(fb_, B, rb, cb, ldb);
      if (beta != 0.0f) widen(fc_, C, M, N, ldc);
      else fc_.assign(static_cast<size_t>(M) * N, 0.0f);
      cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, fa_.data(), ca, fb_.data(), cb, beta, fc_.data(), N);
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) C[static_cast<size_t>(i) * ldc + j] = math::st<T>(fc_[static_cast<size_t>(i) * N + j]);
    }
  }

  void gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, int64_t sa,
                            const T* B, int ldb, int64_t sb, S beta, T* C, int ldc, int64_t sc, int batch) override {
    for (int i = 0; i < batch; ++i) gemm(ta, tb, M, N, K, alpha, Am + i * sa, lda, B + i * sb, ldb, beta, C + i * sc, ldc);
  }

  void axpy(size_t n, S alpha, const T* x, T* y) override {
    for (size_t i = 0; i < n; ++i) y[i] = math::st<T>(math::ld(y[i]) + alpha * math::ld(x[i]));
  }
  void scale(size_t n, S alpha, T* x) override {
    for (size_t i = 0; i < n; ++i) x[i] = math::st<T>(alpha * math::ld(x[i]));
  }
  double sum_squares(const T* x, size_t n) override {
    double s = 0;
    for (size_t i = 0; i < n; ++i) {
      double v = static_cast<double>(math::ld(x[i]));
      s += v * v;
    }
    return s;
  }

  void embedding_forward(T* out, const int32_t* tok, const T* table, int N, int C) override {
    for (int i = 0; i < N; ++i) std::memcpy(out + static_cast<size_t>(i) * C, table + static_cast<size_t>(tok[i]) * C, C * sizeof(T));
  }
  void embedding_backward(T* dtable, const int32_t* tok, const T* dout, int N, int C) override {
    if constexpr (!std::is_same_v<T, A>) {  // bf16: sum each token's rows in float, round once
      order_.resize(static_cast<size_t>(N));
      for (int i = 0; i < N; ++i) order_[static_cast<size_t>(i)] = i;
      std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) { return tok[a] < tok[b]; });
      row_.resize(static_cast<size_t>(C));
      for (size_t g = 0; g < order_.size();) {
        const int32_t t = tok[order_[g]];
        T* row = dtable + static_cast<size_t>(t) * C;
        for (int c = 0; c < C; ++c) row_[static_cast<size_t>(c)] = math::ld(row[c]);
        for (; g < order_.size() && tok[order_[g]] == t; ++g) {
          const T* d = dout + static_cast<size_t>(order_[g]) * C;
          for (int c = 0; c < C; ++c) row_[static_cast<size_t>(c)] += math::ld(d[c]);
        }
        for (int c = 0; c < C; ++c) row[c] = math::st<T>(row_[static_cast<size_t>(c)]);
      }
      return;
    }
    for (int i = 0; i < N; ++i) {
      T* row = dtable + static_cast<size_t>(tok[i]) * C;
      const T* d = dout + static_cast<size_t>(i) * C;
      for (int c = 0; c < C; ++c) row[c] = math::st<T>(math::ld(row[c]) + math::ld(d[c]));
    }
  }

  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) override {
    for (int i = 0; i < N; ++i) {
      const T* xi = x + static_cast<size_t>(i) * C;
      T* oi = out + static_cast<size_t>(i) * C;
      A ss = 0;
      for (int c = 0; c < C; ++c) ss += math::ld(xi[c]) * math::ld(xi[c]);
      A r = math::rmsnorm_rstd(ss, C, eps);
      for (int c = 0; c < C; ++c) oi[c] = math::st<T>(math::ld(xi[c]) * r * math::ld(w[c]));
      rstd[i] = math::st<T>(r);
    }
  }
  // y = x r w, r = (mean(x^2)+eps)^-1/2.  dx = r (w*dy) - x r^3 / C * sum(w*dy*x).
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) override {
    if constexpr (!std::is_same_v<T, A>) dwacc_.assign(static_cast<size_t>(C), A(0));
    for (int i = 0; i < N; ++i) {
      const T* xi = x + static_cast<size_t>(i) * C;
      const T* di = dout + static_cast<size_t>(i) * C;
      T* dxi = dx + static_cast<size_t>(i) * C;
      A r = math::ld(rstd[i]);
      A dot = 0;
      for (int c = 0; c < C; ++c) dot += math::ld(w[c]) * math::ld(di[c]) * math::ld(xi[c]);
      A k = math::rmsnorm_k(dot, r, C);
      for (int c = 0; c < C; ++c) {
        dxi[c] = math::st<T>(math::ld(dxi[c]) + math::rmsnorm_dx(r, math::ld(w[c]), math::ld(di[c]), k, math::ld(xi[c])));
        if constexpr (std::is_same_v<T, A>) dw[c] += di[c] * xi[c] * r;
        else dwacc_[c] += math::ld(di[c]) * math::ld(xi[c]) * r;
      }
    }
    if constexpr (!std::is_same_v<T, A>)  // bf16: sum the rows in float, round once
      for (int c = 0; c < C; ++c) dw[c] = math::st<T>(math::ld(dw[c]) + dwacc_[c]);
  }

  void rope_forward(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD) override {
    rope_apply(x, cs, sn, B, T_, H, HD, false);
  }
  void rope_backward(T* dx, const T* cs, const T* sn, int B, int T_, int H, int HD) override {
    rope_apply(dx, cs, sn, B, T_, H, HD, true);
  }

  void softmax_causal_forward(T* att, int R, int T_, S scale) override {
    row_.resize(static_cast<size_t>(T_));
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < T_; ++t) {
        T* row = att + (static_cast<size_t>(r) * T_ + t) * T_;
        A* e = std::is_same_v<T, A> ? reinterpret_cast<A*>(row) : row_.data();  // in place for float/double
        A mx = math::ld(row[0]) * scale;
        for (int s = 1; s <= t; ++s) mx = math::ld(row[s]) * scale > mx ? math::ld(row[s]) * scale : mx;
        for (int s = 0; s <= t; ++s) e[s] = math::st_exp(math::ld(row[s]) * scale - mx);  // vectorized
        A sum = 0;
        for (int s = 0; s <= t; ++s) sum += e[s];
        A inv = A(1) / sum;
        for (int s = 0; s <= t; ++s) row[s] = math::st<T>(e[s] * inv);
        for (int s = t + 1; s < T_; ++s) row[s] = math::st<T>(A(0));
      }
    }
  }
  // p = softmax(scale*z): dz = scale * p * (dp - sum(p*dp)).
  void softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) override {
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < T_; ++t) {
        size_t o = (static_cast<size_t>(r) * T_ + t) * T_;
        T* d = datt + o;
        const T* p = att + o;
        A dot = 0;
        for (int s = 0; s <= t; ++s) dot += math::ld(p[s]) * math::ld(d[s]);
        for (int s = 0; s <= t; ++s) d[s] = math::st<T>(math::softmax_grad(math::ld(p[s]), math::ld(d[s]), dot, scale));
        for (int s = t + 1; s < T_; ++s) d[s] = math::st<T>(A(0));
      }
    }
  }

  void swiglu_forward(T* h, const T* g, const T* u, size_t n) override {
    for (size_t i = 0; i < n; ++i) h[i] = math::st<T>(math::swiglu(math::ld(g[i]), math::ld(u[i])));
  }
  void swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) override {
    for (size_t i = 0; i < n; ++i) {
      A a, b;
      math::swiglu_backward(math::ld(g[i]), math::ld(u[i]), math::ld(dh[i]), &a, &b);
      dg[i] = math::st<T>(a);
      du[i] = math::st<T>(b);
    }
  }

  double cross_entropy(T* dlogits, const T* logits, const int32_t* tgt, int N, int V, S grad_scale) override {
    double total = 0;
    const bool inplace = std::is_same_v<T, A> && dlogits != nullptr;
    if (!inplace) row_.resize(static_cast<size_t>(V));
    for (int i = 0; i < N; ++i) {
      const T* l = logits + static_cast<size_t>(i) * V;
      A* e = inplace ? reinterpret_cast<A*>(dlogits + static_cast<size_t>(i) * V) : row_.data();  // may alias l
      A mx = math::ld(l[0]);
      for (int v = 1; v < V; ++v) mx = math::ld(l[v]) > mx ? math::ld(l[v]) : mx;
      const A lt = math::ld(l[tgt[i]]);  // read before e overwrites it
      for (int v = 0; v < V; ++v) e[v] = math::st_exp(math::ld(l[v]) - mx);  // vectorized
      A sum = 0;
      for (int v = 0; v < V; ++v) sum += e[v];
      total += static_cast<double>(mx + std::log(sum) - lt);
      if (dlogits) {
        T* d = dlogits + static_cast<size_t>(i) * V;
        const A k = grad_scale / sum, et = e[tgt[i]];  // e may be d: keep the target's value
        for (int v = 0; v < V; ++v) d[v] = math::st<T>(e[v] * k);
        d[tgt[i]] = math::st<T>(et * k - grad_scale);
      }
    }
    return total;
  }

  void adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S gs, int64_t step) override {
    A bc1 = A(1) - static_cast<A>(std::pow(static_cast<double>(b1), static_cast<double>(step)));
    A bc2 = A(1) - static_cast<A>(std::pow(static_cast<double>(b2), static_cast<double>(step)));
    for (size_t i = 0; i < n; ++i) {
      A pv = math::ld(p[i]), mv = math::ld(m[i]), vv = math::ld(v[i]);
      math::adamw(&pv, &mv, &vv, math::ld(g[i]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
      p[i] = math::st<T>(pv);
      m[i] = math::st<T>(mv);
      v[i] = math::st<T>(vv);
    }
  }

 private:
  std::vector<A> row_;     // one row of exponentials (cross_entropy without in-place dlogits, bf16 softmax)
  std::vector<A> dwacc_;   // bf16 rmsnorm_backward: dw summed over rows in float
  std::vector<int> order_; // bf16 embedding_backward: positions grouped by token
  std::vector<float> fa_, fb_, fc_;  // bf16 GEMM operands widened to float

  static void* aligned_zeroed(size_t bytes) {
    bytes = std::max<size_t>(64, ((bytes + 63) / 64) * 64);
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    return p;
  }
  // Packs a rows x cols block with row stride ld into dst (row stride cols), as float.
  static void widen(std::vector<float>& dst, const T* src, int rows, int cols, int ld) {
    dst.resize(static_cast<size_t>(rows) * cols);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j)
        dst[static_cast<size_t>(i) * cols + j] = static_cast<float>(math::ld(src[static_cast<size_t>(i) * ld + j]));
  }
  static void rope_apply(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
    int half = HD / 2;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T_; ++t) {
        const T* c = cs + static_cast<size_t>(t) * half;
        const T* s = sn + static_cast<size_t>(t) * half;
        for (int h = 0; h < H; ++h) {
          T* v = x + ((static_cast<size_t>(b) * T_ + t) * H + h) * HD;
          for (int j = 0; j < half; ++j) {
            A o1, o2;
            if (backward) math::rope_rotate_backward(math::ld(v[j]), math::ld(v[j + half]), math::ld(c[j]), math::ld(s[j]), &o1, &o2);
            else math::rope_rotate(math::ld(v[j]), math::ld(v[j + half]), math::ld(c[j]), math::ld(s[j]), &o1, &o2);
            v[j] = math::st<T>(o1);
            v[j + half] = math::st<T>(o2);
          }
        }
      }
  }
};

}  // namespace

template <typename T> std::unique_ptr<Backend<T>> make_cpu_backend() { return std::make_unique<CpuBackend<T>>(); }
template std::unique_ptr<Backend<float>> make_cpu_backend<float>();
template std::unique_ptr<Backend<double>> make_cpu_backend<double>();
template std::unique_ptr<Backend<bf16>> make_cpu_backend<bf16>();

void set_blas_threads(int n) {
  if (n > 0) openblas_set_num_threads(n);
}

}  // namespace shardtrain
