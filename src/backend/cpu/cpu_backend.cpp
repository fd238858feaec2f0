// CPU backend: OpenBLAS for GEMM, plain loops for everything else. The per-element math comes from
// ops_math.h, shared with the CUDA kernels. Loops are written so the compiler can vectorize them;
// reductions accumulate in double where a long sum would otherwise lose precision.
//
// Threads inside a rank (OpenMP, count set by set_cpu_threads). Every kernel splits its work into
// pieces whose boundaries depend only on the shapes, never on the thread count, and every sum is
// taken in one fixed order, so results are bitwise the same with 1, 2 or 64 threads:
//  - GEMM: C is cut into fixed tiles (gemm_tiles), each computed by one single-threaded sgemm call
//    (PyTorch's intra-op parallelism does the same with its own kernels); batched GEMMs run whole
//    batch entries side by side. OpenBLAS itself runs single-threaded.
//  - Row-wise kernels (RMSNorm, softmax, cross-entropy, RoPE, embedding) split rows; elementwise
//    kernels split ranges. Column sums (RMSNorm's dw, the embedding gradient) split columns and sum
//    the rows of each column in order; sum_squares and the loss add fixed-size partials in order.
//  - Flash attention (flash_attention.h): independent work items, (b, h, query tile) for the
//    forward and the dQ pass, (b, kv head, key tile) for the dK/dV pass, each computed by one
//    thread with single-threaded GEMMs on its tiles in a fixed order. Block attention at global
//    positions: the same items over the key (query) tiles of the block, masked tile pairs skipped;
//    thread 0 (the calling thread) polls the progress hook between its tiles.
#include <cblas.h>
#include <omp.h>
#include <time.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/flash_attention.h"
#include "shardtrain/backend/ops_math.h"

namespace shardtrain {
namespace {

// Work below this many elements (or multiply-adds for GEMM tiles) runs on the calling thread: an
// OpenMP fork/join costs about a microsecond, as much as a few thousand flops.
constexpr size_t kGrain = 16384;
constexpr size_t kSumChunk = 4096;  // sum_squares partials: fixed length, summed in order

// Denormals (|x| < 1.2e-38 in float) are flushed to zero on the backend's threads: MXCSR's FTZ
// (results) and DAZ (inputs) bits. A denormal operand costs a ~100-cycle microcode assist per
// instruction on x86; they arise from softmax/sigmoid tails, tiny AdamW moments, and even from
// code GCC generates for fast_expf's clamped branch (SwiGLU ran 10x slower on normal inputs).
// TensorFlow flushes on its CPU threads too; results differ only where a value is below 1.2e-38.
// MXCSR is per thread: set on the calling thread and on every thread of the OpenMP pool.
// Also sets OpenBLAS to one thread: the backend calls it from its own threads, one call per tile
// (a threaded OpenBLAS inside them would oversubscribe the cores). Run by every backend's
// constructor and by set_cpu_threads, so every mode (train, export, generate, tests) gets both.
void prepare_threads() {
  openblas_set_num_threads(1);
#if defined(__SSE__)
  auto set = [] { _mm_setcsr(_mm_getcsr() | 0x8040); };  // FTZ (bit 15) | DAZ (bit 6)
  set();
#pragma omp parallel
  set();
#endif
}

// Runs fn(begin, end) over [0, n) in pieces of `grain` on the rank's threads, or once on the calling
// thread when there is a single piece or a single thread. Only for work whose result does not
// depend on how [0, n) is cut (each index written by exactly one piece).
template <typename F> void par_ranges(size_t n, size_t grain, F&& fn) {
  if (n == 0) return;
  const size_t pieces = (n + grain - 1) / grain;
  if (pieces <= 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    fn(size_t(0), n);
    return;
  }
#pragma omp parallel for schedule(static)
  for (size_t p = 0; p < pieces; ++p) fn(p * grain, std::min(n, (p + 1) * grain));
}

// Runs fn(i) for every i in [0, n) on the rank's threads, one item at a time (dynamic schedule: items
// may differ in cost). Only for items that write disjoint outputs.
template <typename F> void par_items(size_t n, F&& fn) {
  if (n == 0) return;
  if (n == 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < n; ++i) fn(i);
}

// par_items, with poll() on the calling thread after each item it runs (the master thread of the
// region; the calling thread itself when the items run serially) and, in a region, once more when
// the master ran out of items (it may run none under the dynamic schedule) while the others may
// still work: the progress registry between attention tiles. Items are distributed as par_items
// does and write disjoint outputs, so the results do not change.
template <typename F, typename P> void par_items_polled(size_t n, F&& fn, P&& poll) {
  if (n == 0) return;
  if (n == 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    for (size_t i = 0; i < n; ++i) {
      fn(i);
      poll();
    }
    return;
  }
#pragma omp parallel
  {
    const bool master = omp_get_thread_num() == 0;
#pragma omp for schedule(dynamic, 1) nowait
    for (size_t i = 0; i < n; ++i) {
      fn(i);
      if (master) poll();
    }
    if (master) poll();
  }
}

// Grain (in rows) so that a piece of rows of `row_cost` elements each is about kGrain elements.
inline size_t row_grain(size_t row_cost) { return std::max<size_t>(1, kGrain / std::max<size_t>(1, row_cost)); }

// Fixed GEMM tiling: C[M, N] is cut into mt x nt tiles; tile (i, j) holds rows [i*M/mt, (i+1)*M/mt)
// and columns [j*N/nt, (j+1)*N/nt). The cut depends on (M, N, K) only, so each element of C comes
// from the same sgemm call, in the same order of K, whatever the thread count. The tile count is a
// power of two (even work for 2, 4, 8... threads).
// Cost of a cut: each tile packs its own panels, so op(B)'s K x n panel is packed once per row of
// tiles and op(A)'s m x K panel once per column of tiles: the extra packing is about 8/m + 8/n of
// the tile's GEMM time (measured with OpenBLAS's SkylakeX kernels: 96-row tiles cost 14%; 24-row
// tiles of a 1536 x 1376 x 512 GEMM made it 1.6x slower). So tiles keep >= 64 rows and columns,
// the longer side is halved first, and there are at most 16 tiles of >= 2^22 multiply-adds each
// (32 tiles cost 7% more than 16 on the GEMM-bound bench config at 1 and at 2 threads).
struct GemmTiles {
  int mt, nt;
};
inline GemmTiles gemm_tiles(int M, int N, int K) {
  constexpr double kMinTileMacs = 1 << 22;  // ~30 us of one AVX-512 core
  constexpr int kMaxTiles = 16, kMinSide = 64;
  const double macs = static_cast<double>(M) * N * K;
  int tiles = 1;
  while (tiles < kMaxTiles && macs / (2 * tiles) >= kMinTileMacs) tiles *= 2;
  int mt = 1, nt = 1;
  while (mt * nt < tiles) {
    const bool m_ok = M / (2 * mt) >= kMinSide, n_ok = N / (2 * nt) >= kMinSide;
    if (m_ok && (!n_ok || M / mt >= N / nt)) mt *= 2;
    else if (n_ok) nt *= 2;
    else break;
  }
  return {mt, nt};
}

// Every kernel loads stored elements with math::ld into the arithmetic type A (float for bf16),
// computes in A and stores once with math::st<T>. For float and double both are the identity, so
// those loops compile to what they would be without the indirection.
template <typename T> class CpuBackend final : public Backend<T> {
 public:
  using S = typename Backend<T>::S;
  using A = math::Acc<T>;
  CpuBackend() { prepare_threads(); }
  const char* name() const override { return "cpu"; }
  bool host_kernels() const override { return true; }
  ProgressRegistry* progress() override { return &progress_; }

  T* alloc(size_t n) override { return static_cast<T*>(aligned_zeroed(n * sizeof(T))); }
  void free(T* p) override { std::free(p); }
  void zero(T* p, size_t n) override {
    par_ranges(n, 16 * kGrain, [&](size_t b, size_t e) { std::memset(p + b, 0, (e - b) * sizeof(T)); });
  }
  void copy(T* d, const T* s, size_t n) override {
    if (n == 0 || d == s) return;
    if (d + n <= s || s + n <= d)  // disjoint: pieces may run side by side
      par_ranges(n, 16 * kGrain, [&](size_t b, size_t e) { std::memcpy(d + b, s + b, (e - b) * sizeof(T)); });
    else
      std::memmove(d, s, n * sizeof(T));
  }
  void to_host(T* h, const T* s, size_t n) override { copy(h, s, n); }
  void from_host(T* d, const T* h, size_t n) override { copy(d, h, n); }
  int32_t* alloc_ids(size_t n) override { return static_cast<int32_t*>(aligned_zeroed(n * sizeof(int32_t))); }
  void free_ids(int32_t* p) override { std::free(p); }
  void ids_from_host(int32_t* d, const int32_t* h, size_t n) override { if (n) std::memmove(d, h, n * sizeof(int32_t)); }
  S* alloc_acc(size_t n) override { return static_cast<S*>(aligned_zeroed(n * sizeof(S))); }
  void free_acc(S* p) override { std::free(p); }
  void copy_2d(T* d, size_t ldd, const T* s, size_t lds, size_t rows, size_t cols) override {
    if (rows == 0 || cols == 0) return;
    par_ranges(rows, std::max<size_t>(1, 16 * kGrain / cols), [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) std::memcpy(d + i * ldd, s + i * lds, cols * sizeof(T));
    });
  }
  void zero_acc(S* p, size_t n) override {
    par_ranges(n, 16 * kGrain, [&](size_t b, size_t e) { std::memset(p + b, 0, (e - b) * sizeof(S)); });
  }
  void synchronize() override {}

  void from_f32(T* d, const float* s, size_t n) override {
    par_ranges(n, kGrain, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) d[i] = math::st<T>(static_cast<A>(s[i]));
    });
  }
  void add_to_f32(float* d, float alpha, const T* s, size_t n) override {
    par_ranges(n, kGrain, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) d[i] += alpha * static_cast<float>(math::ld(s[i]));
    });
  }

  void gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb, S beta,
            T* C, int ldc) override {
    if (M == 0 || N == 0) return;
    if constexpr (!std::is_same_v<T, A>) {  // bf16: one widened sgemm on the calling thread (tests only)
      gemm_bf16(ta, tb, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
    } else {
      const GemmTiles g = gemm_tiles(M, N, K);
      const int tiles = g.mt * g.nt;
      auto tile = [&](int t) {
        const int ti = t / g.nt, tj = t % g.nt;
        const int i0 = static_cast<int>(static_cast<int64_t>(ti) * M / g.mt);
        const int j0 = static_cast<int>(static_cast<int64_t>(tj) * N / g.nt);
        const int m = static_cast<int>(static_cast<int64_t>(ti + 1) * M / g.mt) - i0;
        const int n = static_cast<int>(static_cast<int64_t>(tj + 1) * N / g.nt) - j0;
        const T* a = ta ? Am + i0 : Am + static_cast<size_t>(i0) * lda;  // rows i0.. of op(A)
        const T* b = tb ? B + static_cast<size_t>(j0) * ldb : B + j0;    // columns j0.. of op(B)
        gemm1(ta, tb, m, n, K, alpha, a, lda, b, ldb, beta, C + static_cast<size_t>(i0) * ldc + j0, ldc);
      };
      if (tiles == 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
        for (int t = 0; t < tiles; ++t) {
          tile(t);
          if (!omp_in_parallel()) poll_progress();
        }
      } else {
#pragma omp parallel for schedule(dynamic, 1)
        for (int t = 0; t < tiles; ++t) tile(t);
        poll_progress();
      }
    }
  }

  // Batch entries run side by side, each one single-threaded GEMM call (entries write distinct C).
  void gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, int64_t sa,
                            const T* B, int ldb, int64_t sb, S beta, T* C, int ldc, int64_t sc, int batch) override {
    if constexpr (!std::is_same_v<T, A>) {
      for (int i = 0; i < batch; ++i)
        gemm_bf16(ta, tb, M, N, K, alpha, Am + i * sa, lda, B + i * sb, ldb, beta, C + i * sc, ldc);
    } else {
      const double macs = static_cast<double>(M) * N * K * batch;
      auto one = [&](int i) { gemm1(ta, tb, M, N, K, alpha, Am + i * sa, lda, B + i * sb, ldb, beta, C + i * sc, ldc); };
      if (batch == 1 || macs < kGrain * 16.0 || omp_get_max_threads() == 1 || omp_in_parallel()) {
        for (int i = 0; i < batch; ++i) one(i);
      } else {
#pragma omp parallel for schedule(dynamic, 1)
        for (int i = 0; i < batch; ++i) one(i);
      }
    }
  }

  void axpy(size_t n, S alpha, const T* x, T* y) override {
    par_ranges(n, kGrain, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) y[i] = math::st<T>(math::ld(y[i]) + alpha * math::ld(x[i]));
    });
  }
  void scale(size_t n, S alpha, T* x) override {
    par_ranges(n, kGrain, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) x[i] = math::st<T>(alpha * math::ld(x[i]));
    });
  }
  // Partial sums over fixed chunks of kSumChunk elements, added in chunk order.
  double sum_squares(const T* x, size_t n) override {
    const size_t chunks = (n + kSumChunk - 1) / kSumChunk;
    part_.assign(chunks, 0.0);
    par_ranges(chunks, row_grain(kSumChunk), [&](size_t cb, size_t ce) {
      for (size_t c = cb; c < ce; ++c) {
        double s = 0;
        for (size_t i = c * kSumChunk, e = std::min(n, (c + 1) * kSumChunk); i < e; ++i) {
          const double v = static_cast<double>(math::ld(x[i]));
          s += v * v;
        }
        part_[c] = s;
      }
    });
    double s = 0;
    for (double p : part_) s += p;
    return s;
  }

  void embedding_forward(T* out, const int32_t* tok, const T* table, int N, int C) override {
    par_ranges(static_cast<size_t>(N), row_grain(C), [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i)
        if (tok[i] < 0)
          std::memset(out + i * C, 0, C * sizeof(T));
        else
          std::memcpy(out + i * C, table + static_cast<size_t>(tok[i]) * C, C * sizeof(T));
    });
  }
  // Column ranges side by side; within a column, positions are added in order 0..N-1.
  void embedding_backward(T* dtable, const int32_t* tok, const T* dout, int N, int C) override {
    if constexpr (!std::is_same_v<T, A>) {  // bf16: sum each token's rows in float, round once
      order_.resize(static_cast<size_t>(N));
      for (int i = 0; i < N; ++i) order_[static_cast<size_t>(i)] = i;
      std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) { return tok[a] < tok[b]; });
      row_.resize(static_cast<size_t>(C));
      for (size_t g = 0; g < order_.size();) {
        const int32_t t = tok[order_[g]];
        if (t < 0) {  // another rank's rows (vocabulary-parallel embedding): sorted first, skipped
          ++g;
          continue;
        }
        T* row = dtable + static_cast<size_t>(t) * C;
        for (int c = 0; c < C; ++c) row_[static_cast<size_t>(c)] = math::ld(row[c]);
        for (; g < order_.size() && tok[order_[g]] == t; ++g) {
          const T* d = dout + static_cast<size_t>(order_[g]) * C;
          for (int c = 0; c < C; ++c) row_[static_cast<size_t>(c)] += math::ld(d[c]);
        }
        for (int c = 0; c < C; ++c) row[c] = math::st<T>(row_[static_cast<size_t>(c)]);
      }
    } else {
      par_ranges(static_cast<size_t>(C), col_grain(N), [&](size_t cb, size_t ce) {
        for (int i = 0; i < N; ++i) {
          if (tok[i] < 0) continue;  // another rank's rows (vocabulary-parallel embedding)
          T* row = dtable + static_cast<size_t>(tok[i]) * C;
          const T* d = dout + static_cast<size_t>(i) * C;
          for (size_t c = cb; c < ce; ++c) row[c] += d[c];
        }
      });
    }
  }

  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) override {
    par_ranges(static_cast<size_t>(N), row_grain(C), [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const T* xi = x + i * C;
        T* oi = out + i * C;
        A ss = 0;
        for (int c = 0; c < C; ++c) ss += math::ld(xi[c]) * math::ld(xi[c]);
        A r = math::rmsnorm_rstd(ss, C, eps);
        for (int c = 0; c < C; ++c) oi[c] = math::st<T>(math::ld(xi[c]) * r * math::ld(w[c]));
        rstd[i] = math::st<T>(r);
      }
    });
  }
  // y = x r w, r = (mean(x^2)+eps)^-1/2.  dx = r (w*dy) - x r^3 / C * sum(w*dy*x).
  // dx: rows side by side. dw: column ranges side by side, rows added in order.
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) override {
    par_ranges(static_cast<size_t>(N), row_grain(C), [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const T* xi = x + i * C;
        const T* di = dout + i * C;
        T* dxi = dx + i * C;
        A r = math::ld(rstd[i]);
        A dot = 0;
        for (int c = 0; c < C; ++c) dot += math::ld(w[c]) * math::ld(di[c]) * math::ld(xi[c]);
        A k = math::rmsnorm_k(dot, r, C);
        for (int c = 0; c < C; ++c)
          dxi[c] = math::st<T>(math::ld(dxi[c]) + math::rmsnorm_dx(r, math::ld(w[c]), math::ld(di[c]), k, math::ld(xi[c])));
      }
    });
    par_ranges(static_cast<size_t>(C), col_grain(N), [&](size_t cb, size_t ce) {
      const size_t nc = ce - cb;
      // float/double: dw[c] += row terms, in row order. bf16: the rows' sum in float, added once.
      std::vector<A> acc(nc, A(0));
      if constexpr (std::is_same_v<T, A>)
        for (size_t c = 0; c < nc; ++c) acc[c] = dw[cb + c];
      for (int i = 0; i < N; ++i) {
        const T* xi = x + static_cast<size_t>(i) * C + cb;
        const T* di = dout + static_cast<size_t>(i) * C + cb;
        const A r = math::ld(rstd[i]);
        if constexpr (std::is_same_v<T, A>)
          for (size_t c = 0; c < nc; ++c) acc[c] += di[c] * xi[c] * r;
        else
          for (size_t c = 0; c < nc; ++c) acc[c] += math::ld(di[c]) * math::ld(xi[c]) * r;
      }
      for (size_t c = 0; c < nc; ++c)
        dw[cb + c] = std::is_same_v<T, A> ? math::st<T>(acc[c]) : math::st<T>(math::ld(dw[cb + c]) + acc[c]);
    });
  }

  void rope_forward(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD) override {
    rope_apply(x, cs, sn, B, T_, H, HD, false);
  }
  void rope_backward(T* dx, const T* cs, const T* sn, int B, int T_, int H, int HD) override {
    rope_apply(dx, cs, sn, B, T_, H, HD, true);
  }

  void rope_forward_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD) override {
    rope_apply_at(x, cs, sn, pos, N, H, HD, false);
  }
  void rope_backward_at(T* dx, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD) override {
    rope_apply_at(dx, cs, sn, pos, N, H, HD, true);
  }

  void softmax_causal_forward(T* att, int R, int T_, S scale) override {
    const size_t rows = static_cast<size_t>(R) * T_;
    par_ranges(rows, row_grain(T_), [&](size_t rb, size_t re) {
      std::vector<A> tmp(std::is_same_v<T, A> ? 0 : static_cast<size_t>(T_));
      for (size_t rr = rb; rr < re; ++rr) {
        const int t = static_cast<int>(rr % T_);
        T* row = att + rr * T_;
        A* e = std::is_same_v<T, A> ? reinterpret_cast<A*>(row) : tmp.data();  // in place for float/double
        A mx = math::ld(row[0]) * scale;
        for (int s = 1; s <= t; ++s) mx = math::ld(row[s]) * scale > mx ? math::ld(row[s]) * scale : mx;
        for (int s = 0; s <= t; ++s) e[s] = math::st_exp(math::ld(row[s]) * scale - mx);  // vectorized
        A sum = 0;
        for (int s = 0; s <= t; ++s) sum += e[s];
        A inv = A(1) / sum;
        for (int s = 0; s <= t; ++s) row[s] = math::st<T>(e[s] * inv);
        for (int s = t + 1; s < T_; ++s) row[s] = math::st<T>(A(0));
      }
    });
  }
  // As softmax_causal_forward, keys of other documents masked too (the diagonal always stays).
  void softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S scale) override {
    const size_t rows = static_cast<size_t>(B) * NH * T_;
    par_ranges(rows, row_grain(T_), [&](size_t rb, size_t re) {
      std::vector<A> e(static_cast<size_t>(T_));
      for (size_t rr = rb; rr < re; ++rr) {
        const int t = static_cast<int>(rr % T_);
        const int32_t* db = doc + (rr / T_ / NH) * T_;
        T* row = att + rr * T_;
        A mx = math::ld(row[t]) * scale;
        for (int s = 0; s <= t; ++s)
          if (db[s] == db[t]) mx = math::ld(row[s]) * scale > mx ? math::ld(row[s]) * scale : mx;
        A sum = 0;
        for (int s = 0; s <= t; ++s) {
          e[s] = db[s] == db[t] ? math::st_exp(math::ld(row[s]) * scale - mx) : A(0);
          sum += e[s];
        }
        A inv = A(1) / sum;
        for (int s = 0; s <= t; ++s) row[s] = math::st<T>(e[s] * inv);
        for (int s = t + 1; s < T_; ++s) row[s] = math::st<T>(A(0));
      }
    });
  }
  // p = softmax(scale*z): dz = scale * p * (dp - sum(p*dp)).
  void softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) override {
    const size_t rows = static_cast<size_t>(R) * T_;
    par_ranges(rows, row_grain(T_), [&](size_t rb, size_t re) {
      for (size_t rr = rb; rr < re; ++rr) {
        const int t = static_cast<int>(rr % T_);
        T* d = datt + rr * T_;
        const T* p = att + rr * T_;
        A dot = 0;
        for (int s = 0; s <= t; ++s) dot += math::ld(p[s]) * math::ld(d[s]);
        for (int s = 0; s <= t; ++s) d[s] = math::st<T>(math::softmax_grad(math::ld(p[s]), math::ld(d[s]), dot, scale));
        for (int s = t + 1; s < T_; ++s) d[s] = math::st<T>(A(0));
      }
    });
  }

  // FlashAttention-2 forward (flash_attention.h). Work items (b, h, query tile), the longest (last
  // query tiles, most key tiles) first. Per key tile: scores = Q K^T (one GEMM), the online softmax
  // row by row, acc = alpha acc + P V (rows scaled, then one GEMM with beta = 1).
  void flash_attention_forward(T* y, S* lse, const T* q, const T* k, const T* v, int B, int T_, int NH, int NKV,
                               int HD, S scale) override {
    if (B <= 0 || T_ <= 0 || NH <= 0 || HD <= 0) return;
    const int G = NH / NKV, nq = flash::num_tiles(T_, flash::kBr), ldk = NKV * HD;
    const size_t BH = static_cast<size_t>(B) * NH;
    par_items_polled(BH * nq, [&](size_t it) {
      const int i = nq - 1 - static_cast<int>(it / BH), b = static_cast<int>(it % BH) / NH, h = static_cast<int>(it % BH) % NH;
      const int r0 = i * flash::kBr, nr = std::min(flash::kBr, T_ - r0);
      FlashScratch& w = flash_scratch();
      const QueryTile qt = query_tile(w, q, nullptr, b, h, T_, NH, HD, r0, nr);
      start_query_tile(w, nr, HD, false);
      const int jend = (r0 + nr - 1) / flash::kBc;
      for (int j = 0; j <= jend; ++j) {
        const int c0 = j * flash::kBc, nc = std::min(flash::kBc, r0 + nr - c0);
        const size_t ko = (static_cast<size_t>(b) * T_ + c0) * ldk + static_cast<size_t>(h / G) * HD;
        forward_pair(w, qt.Q, qt.lQ, key_tile(w, k, v, ko, ldk, nc, HD), nr, nc, HD, scale, [r0, c0](int r) {
          const int last = r0 + r - c0;  // keys c <= last are visible
          return [last](int c) { return c <= last; };
        });
      }
      finish_query_tile(w, y, lse, b, h, T_, NH, HD, r0, nr, false);
    }, [this] { poll_progress(); });
  }

  // FlashAttention-2 backward, two deterministic passes (flash_attention.h). Pass 1: items
  // (b, h, query tile), dQ += dS K per key tile. Pass 2: items (b, kv head, key tile), over the G
  // query heads of the group and the query tiles from the diagonal on: dV += P^T dY, dK += dS^T Q.
  void flash_attention_backward(T* dq, T* dk, T* dv, S* dsum, const T* dy, const T* q, const T* k, const T* v,
                                const T* y, const S* lse, int B, int T_, int NH, int NKV, int HD, S scale) override {
    if (B <= 0 || T_ <= 0 || NH <= 0 || HD <= 0) return;
    const int G = NH / NKV, nq = flash::num_tiles(T_, flash::kBr), nk = flash::num_tiles(T_, flash::kBc);
    const int ldq = NH * HD, ldk = NKV * HD;
    const size_t BH = static_cast<size_t>(B) * NH, BKV = static_cast<size_t>(B) * NKV;
    // D = rowsum(dY o Y), rows (b, h, t).
    par_ranges(BH * T_, row_grain(HD), [&](size_t rb, size_t re) {
      for (size_t rr = rb; rr < re; ++rr) {
        const size_t bh = rr / T_, t = rr % T_, b = bh / NH, h = bh % NH;
        const size_t o = (b * T_ + t) * ldq + h * HD;
        dsum[rr] = flash::row_dot(dy + o, y + o, HD);
      }
    });
    // P and dS of a (query tile, key tile) pair, in place: s (in: Q K^T, out: P), dp (in: dY V^T,
    // out: dS). Row r is query r0 + r, column c key c0 + c.
    auto p_ds = [&](S* s, S* dp, int nr, int nc, int r0, int c0, const S* L, const S* D) {
      for (int r = 0; r < nr; ++r) {
        S* sr = s + static_cast<size_t>(r) * nc;
        S* dr = dp + static_cast<size_t>(r) * nc;
        const int last = r0 + r - c0;
        const S lr = L[r], Dr = D[r];
        for (int c = 0; c < nc; ++c) sr[c] = c <= last ? flash::prob_from_lse(flash::score(sr[c], scale), lr) : S(0);
        for (int c = 0; c < nc; ++c) dr[c] = c <= last ? flash::dscore(sr[c], dr[c], Dr, scale) : S(0);
      }
    };
    // Pass 1: dQ.
    par_items_polled(BH * nq, [&](size_t it) {
      const int i = nq - 1 - static_cast<int>(it / BH), b = static_cast<int>(it % BH) / NH, h = static_cast<int>(it % BH) % NH;
      const int r0 = i * flash::kBr, nr = std::min(flash::kBr, T_ - r0);
      FlashScratch& w = flash_scratch();
      const size_t qo = (static_cast<size_t>(b) * T_ + r0) * ldq + static_cast<size_t>(h) * HD;
      const size_t so = (static_cast<size_t>(b) * NH + h) * T_ + r0;
      int lQ, ldY, lK, lV;
      const S* Q = tile_s(q + qo, ldq, nr, HD, w.q, &lQ);
      const S* dY = tile_s(dy + qo, ldq, nr, HD, w.dy, &ldY);
      w.acc.assign(static_cast<size_t>(nr) * HD, S(0));
      w.s.resize(static_cast<size_t>(nr) * flash::kBc);
      w.dp.resize(static_cast<size_t>(nr) * flash::kBc);
      const int jend = (r0 + nr - 1) / flash::kBc;
      for (int j = 0; j <= jend; ++j) {
        const int c0 = j * flash::kBc, nc = std::min(flash::kBc, r0 + nr - c0);
        const size_t ko = (static_cast<size_t>(b) * T_ + c0) * ldk + static_cast<size_t>(h / G) * HD;
        const S* K = tile_s(k + ko, ldk, nc, HD, w.k, &lK);
        const S* V = tile_s(v + ko, ldk, nc, HD, w.v, &lV);
        gemm_s(false, true, nr, nc, HD, S(1), Q, lQ, K, lK, S(0), w.s.data(), nc);
        gemm_s(false, true, nr, nc, HD, S(1), dY, ldY, V, lV, S(0), w.dp.data(), nc);
        p_ds(w.s.data(), w.dp.data(), nr, nc, r0, c0, lse + so, dsum + so);
        gemm_s(false, false, nr, HD, nc, S(1), w.dp.data(), nc, K, lK, S(1), w.acc.data(), HD);
      }
      store_tile(dq + qo, ldq, nr, HD, w.acc.data());
    }, [this] { poll_progress(); });
    // Pass 2: dK, dV.
    par_items_polled(BKV * nk, [&](size_t it) {
      const int j = static_cast<int>(it / BKV), b = static_cast<int>(it % BKV) / NKV, kvh = static_cast<int>(it % BKV) % NKV;
      const int c0 = j * flash::kBc, nc = std::min(flash::kBc, T_ - c0);
      FlashScratch& w = flash_scratch();
      const size_t ko = (static_cast<size_t>(b) * T_ + c0) * ldk + static_cast<size_t>(kvh) * HD;
      int lQ, ldY, lK, lV;
      const S* K = tile_s(k + ko, ldk, nc, HD, w.k, &lK);
      const S* V = tile_s(v + ko, ldk, nc, HD, w.v, &lV);
      w.acc.assign(static_cast<size_t>(nc) * HD, S(0));   // dK
      w.acc2.assign(static_cast<size_t>(nc) * HD, S(0));  // dV
      w.s.resize(static_cast<size_t>(flash::kBr) * nc);
      w.dp.resize(static_cast<size_t>(flash::kBr) * nc);
      for (int g = 0; g < G; ++g) {
        const int h = kvh * G + g;
        for (int i = c0 / flash::kBr; i < nq; ++i) {
          const int r0 = i * flash::kBr, nr = std::min(flash::kBr, T_ - r0);
          const size_t qo = (static_cast<size_t>(b) * T_ + r0) * ldq + static_cast<size_t>(h) * HD;
          const size_t so = (static_cast<size_t>(b) * NH + h) * T_ + r0;
          const S* Q = tile_s(q + qo, ldq, nr, HD, w.q, &lQ);
          const S* dY = tile_s(dy + qo, ldq, nr, HD, w.dy, &ldY);
          gemm_s(false, true, nr, nc, HD, S(1), Q, lQ, K, lK, S(0), w.s.data(), nc);
          gemm_s(false, true, nr, nc, HD, S(1), dY, ldY, V, lV, S(0), w.dp.data(), nc);
          p_ds(w.s.data(), w.dp.data(), nr, nc, r0, c0, lse + so, dsum + so);
          gemm_s(true, false, nc, HD, nr, S(1), w.s.data(), nc, dY, ldY, S(1), w.acc2.data(), HD);
          gemm_s(true, false, nc, HD, nr, S(1), w.dp.data(), nc, Q, lQ, S(1), w.acc.data(), HD);
        }
      }
      store_tile(dk + ko, ldk, nc, HD, w.acc.data());
      store_tile(dv + ko, ldk, nc, HD, w.acc2.data());
    }, [this] { poll_progress(); });
  }

  // Block attention at global positions (flash_attention.h, "Block attention"): the loops of the
  // two functions above over every key tile of the block, with visible() for the mask and fully
  // masked tile pairs skipped. Between key tiles the calling thread polls the progress hook.
  // The process's CPU seconds while alive, added to `acc` (BlockAttentionStats::cpu_s).
  struct ProcessCpuTimer {
    double& acc;
    double t0 = now();
    explicit ProcessCpuTimer(double& a) : acc(a) {}
    ~ProcessCpuTimer() { acc += now() - t0; }
    ProcessCpuTimer(const ProcessCpuTimer&) = delete;
    ProcessCpuTimer& operator=(const ProcessCpuTimer&) = delete;
    static double now() {
      timespec ts{};
      clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
      return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
    }
  };

  void attention_block_forward(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp, const int32_t* kp,
                               const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                               S scale) override {
    const ProcessCpuTimer timer(block_cpu_s_);
    if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
    auto pair = [&](FlashScratch& w, const QueryTile& qt, const KeyTile& kt, int nr, int nc, const PosTile& pq,
                    const PosTile& pk) { forward_pair(w, qt.Q, qt.lQ, kt, nr, nc, HD, scale, block_row_vis(pq, pk)); };
    block_query_pass(q, nullptr, k, v, qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, pair,
                     [&](FlashScratch& w, const QueryTile&, int b, int h, int r0, int nr) {
      finish_query_tile(w, y, lse, b, h, Tq, NH, HD, r0, nr, true);
    });
  }

  void attention_merge(T* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) override {
    merge_rows(y, lse, yp, lsep, B, Tq, NH, HD);
  }
  void attention_merge_acc(S* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) override {
    merge_rows(y, lse, yp, lsep, B, Tq, NH, HD);
  }
  // y: T (attention_merge) or S (attention_merge_acc).
  template <typename Y> void merge_rows(Y* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) {
    const size_t rows = static_cast<size_t>(B) * NH * Tq;
    par_ranges(rows, row_grain(HD), [&](size_t rb, size_t re) {
      for (size_t rr = rb; rr < re; ++rr) {
        const size_t bh = rr / Tq, t = rr % Tq, b = bh / NH, h = bh % NH;
        const size_t o = (b * Tq + t) * NH * HD + h * HD;
        S wa, wb, l;
        flash::merge_weights(lse[rr], lsep[rr], &wa, &wb, &l);
        flash::merge_row(y + o, yp + o, wa, wb, HD);
        lse[rr] = l;
      }
    });
  }

  void attention_row_dot(S* dsum, const T* dy, const T* y, int B, int Tq, int NH, int HD) override {
    const size_t rows = static_cast<size_t>(B) * NH * Tq;
    par_ranges(rows, row_grain(HD), [&](size_t rb, size_t re) {
      for (size_t rr = rb; rr < re; ++rr) {
        const size_t bh = rr / Tq, t = rr % Tq, b = bh / NH, h = bh % NH;
        const size_t o = (b * Tq + t) * NH * HD + h * HD;
        dsum[rr] = flash::row_dot(dy + o, y + o, HD);
      }
    });
  }

  void attention_block_backward(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v, const S* lse,
                                const S* dsum, const int32_t* qp, const int32_t* kp, const int32_t* qd,
                                const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD, S scale) override {
    const ProcessCpuTimer timer(block_cpu_s_);
    if (B <= 0 || Tq <= 0 || Tk <= 0 || NH <= 0 || HD <= 0) return;
    const int G = NH / NKV, nk = flash::num_tiles(Tk, flash::kBc);
    const int ldq = NH * HD, ldk = NKV * HD;
    const size_t BKV = static_cast<size_t>(B) * NKV;
    // P and dS of a tile pair in place (as flash_attention_backward's), masked by positions.
    auto p_ds = [&](S* s, S* dp, int nr, int nc, const PosTile& pq, const PosTile& pk, const S* L, const S* D) {
      for (int r = 0; r < nr; ++r) {
        S* sr = s + static_cast<size_t>(r) * nc;
        S* dr = dp + static_cast<size_t>(r) * nc;
        const int qpr = pq.P[r], qdr = pq.D ? pq.D[r] : 0;
        const S lr = L[r], Dr = D[r];
        for (int c = 0; c < nc; ++c) {
          const bool ok = flash::visible(qpr, pk.P[c], qdr, pk.D ? pk.D[c] : 0);
          sr[c] = ok ? flash::prob_from_lse(flash::score(sr[c], scale), lr) : S(0);
          dr[c] = ok ? flash::dscore(sr[c], dr[c], Dr, scale) : S(0);
        }
      }
    };
    auto add_tile = [](T* dst, int ld, int rows, int hd, const S* src) {
      for (int r = 0; r < rows; ++r)
        for (int d = 0; d < hd; ++d) {
          T& o = dst[static_cast<size_t>(r) * ld + d];
          o = math::st<T>(math::ld(o) + src[static_cast<size_t>(r) * hd + d]);
        }
    };
    // Pass 1: dQ += dS K over the key tiles of the block.
    auto pair = [&](FlashScratch& w, const QueryTile& qt, const KeyTile& kt, int nr, int nc, const PosTile& pq,
                    const PosTile& pk) {
      backward_pair(w, qt, kt, nr, nc, HD, true, [&](S* s, S* dp) { p_ds(s, dp, nr, nc, pq, pk, lse + qt.so, dsum + qt.so); });
    };
    block_query_pass(q, dy, k, v, qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, pair,
                     [&](FlashScratch& w, const QueryTile& qt, int, int, int, int nr) {
      add_tile(dq + qt.qo, ldq, nr, HD, w.acc.data());
    });
    // Pass 2: dK += dS^T Q, dV += P^T dY over the G query heads and the query tiles of the block.
    par_items_polled(BKV * nk, [&](size_t it) {
      const int j = static_cast<int>(it / BKV), b = static_cast<int>(it % BKV) / NKV, kvh = static_cast<int>(it % BKV) % NKV;
      const int c0 = j * flash::kBc, nc = std::min(flash::kBc, Tk - c0);
      const PosTile pk = pos_tile(kp, kd, b, Tk, c0, nc);
      FlashScratch& w = flash_scratch();
      const size_t ko = (static_cast<size_t>(b) * Tk + c0) * ldk + static_cast<size_t>(kvh) * HD;
      const KeyTile kt = start_key_tile(w, k, v, ko, ldk, nc, HD);
      for (int g = 0; g < G; ++g) {
        const int h = kvh * G + g;
        // Masked pairs are counted in pass 1.
        walk_unmasked_tiles(qp, qd, b, Tq, flash::kBr, pk.range, false, [&](int r0, int nr, const PosTile& pq) {
          const QueryTile qt = query_tile(w, q, dy, b, h, Tq, NH, HD, r0, nr);
          backward_pair(w, qt, kt, nr, nc, HD, false, [&](S* s, S* dp) {
            p_ds(s, dp, nr, nc, pq, pk, lse + qt.so, dsum + qt.so);
          });
        });
      }
      add_tile(dk + ko, ldk, nc, HD, w.acc.data());
      add_tile(dv + ko, ldk, nc, HD, w.acc2.data());
    }, [this] { poll_progress(); });
  }

  typename Backend<T>::BlockAttentionStats take_block_attention_stats() override {
    typename Backend<T>::BlockAttentionStats st;
    st.tile_pairs = block_pairs_;
    st.skipped = block_skipped_;
    st.cpu_s = block_cpu_s_;
    block_pairs_ = block_skipped_ = 0;
    block_cpu_s_ = 0;
    return st;
  }

  void swiglu_forward(T* h, const T* g, const T* u, size_t n) override {
    par_ranges(n, kGrain, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) h[i] = math::st<T>(math::swiglu(math::ld(g[i]), math::ld(u[i])));
    });
  }
  void swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) override {
    par_ranges(n, kGrain, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        A a, c;
        math::swiglu_backward(math::ld(g[i]), math::ld(u[i]), math::ld(dh[i]), &a, &c);
        dg[i] = math::st<T>(a);
        du[i] = math::st<T>(c);
      }
    });
  }

  // Rows side by side; the per-row losses are added in row order.
  double cross_entropy(T* dlogits, const T* logits, const int32_t* tgt, int N, int V, S grad_scale) override {
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
    double total = 0;
    for (double p : part_) total += p;
    return total;
  }

  // Vocabulary-parallel cross-entropy (backend.h): rows side by side, each as cross_entropy.
  void vocab_ce_max(const T* logits, int N, int Vl, int valid, S* mx) override {
    par_ranges(static_cast<size_t>(N), row_grain(static_cast<size_t>(valid)), [&](size_t rb, size_t re) {
      for (size_t i = rb; i < re; ++i) {
        const T* l = logits + i * Vl;
        A m = -std::numeric_limits<A>::infinity();
        for (int v = 0; v < valid; ++v) m = math::ld(l[v]) > m ? math::ld(l[v]) : m;
        mx[i] = m;
      }
    });
  }
  void vocab_ce_sum(const T* logits, const int32_t* tgt, int N, int Vl, int valid, int v0, const S* maxes, int G,
                    S* st) override {
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
  void vocab_ce_finish(T* dlogits, const T* logits, const int32_t* tgt, int N, int Vl, int valid, int v0,
                       const S* maxes, int G, const S* st, S grad_scale) override {
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
    double total = 0;
    for (double p : part_) total += p;
    this->add_loss_sum(total);
  }

  void adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S gs, int64_t step) override {
    A bc1 = A(1) - static_cast<A>(std::pow(static_cast<double>(b1), static_cast<double>(step)));
    A bc2 = A(1) - static_cast<A>(std::pow(static_cast<double>(b2), static_cast<double>(step)));
    par_ranges(n, kGrain, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        A pv = math::ld(p[i]), mv = math::ld(m[i]), vv = math::ld(v[i]);
        math::adamw(&pv, &mv, &vv, math::ld(g[i]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
        p[i] = math::st<T>(pv);
        m[i] = math::st<T>(mv);
        v[i] = math::st<T>(vv);
      }
    });
  }

 private:
  // progress()'s registry. poll_progress() is the one call kernels make between their tiles: on
  // the calling thread outside a parallel region, on the master thread (the calling thread) inside
  // one, nowhere else (the registry also ignores any thread but its members' one).
  ProgressRegistry progress_;
  int64_t block_pairs_ = 0, block_skipped_ = 0;  // take_block_attention_stats
  double block_cpu_s_ = 0;
  void poll_progress() {
    if (progress_.size() == 0) return;
    if (omp_in_parallel() && omp_get_thread_num() != 0) return;
    progress_.poll();
  }

  std::vector<A> row_;     // bf16 embedding_backward: one row summed in float
  std::vector<double> part_;  // sum_squares / cross_entropy partial sums, added in order
  std::vector<int> order_; // bf16 embedding_backward: positions grouped by token
  std::vector<float> fa_, fb_, fc_;  // bf16 GEMM operands widened to float

  // Columns per piece for a column-parallel sum over N rows of C columns: ~kGrain elements, at
  // least 16 columns (one cache line of floats, so pieces never share a line).
  static size_t col_grain(int N) {
    return std::max<size_t>(16, kGrain / std::max<size_t>(1, static_cast<size_t>(N)));
  }

  // One single-threaded BLAS call (float or double).
  static void gemm1(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb, S beta,
                    T* C, int ldc) {
    auto TA = ta ? CblasTrans : CblasNoTrans;
    auto TB = tb ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>) cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
    else if constexpr (std::is_same_v<T, double>) cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
  }
  // bf16: widen the operands to float, sgemm (fp32 accumulation, as cuBLAS with CUBLAS_COMPUTE_32F),
  // round the result once. Blocks of kWiden rows / columns / depth at a time, so the float copies are
  // at most 3 x kWiden^2 floats (3 MiB), not whole operands (an LM head's [V, C] weight and
  // [tokens, V] logits were 250 MiB for llama-125m; the memory plan does not count them).
  static constexpr int kWiden = 512;
  void gemm_bf16(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb, S beta,
                 T* C, int ldc) {
    if (M == 0 || N == 0) return;
    auto a_at = [&](int i, int k) { return ta ? Am + static_cast<size_t>(k) * lda + i : Am + static_cast<size_t>(i) * lda + k; };
    auto b_at = [&](int k, int j) { return tb ? B + static_cast<size_t>(j) * ldb + k : B + static_cast<size_t>(k) * ldb + j; };
    for (int i0 = 0; i0 < M; i0 += kWiden)
      for (int j0 = 0; j0 < N; j0 += kWiden) {
        const int m = std::min(kWiden, M - i0), n = std::min(kWiden, N - j0);
        T* Ct = C + static_cast<size_t>(i0) * ldc + j0;
        if (beta != 0.0f) widen(fc_, Ct, m, n, ldc);
        else fc_.assign(static_cast<size_t>(m) * n, 0.0f);
        float b = beta;
        for (int k0 = 0; k0 < K; k0 += kWiden) {  // fp32 accumulation over depth blocks
          const int d = std::min(kWiden, K - k0);
          // Stored blocks as op() sees them: A block rows [i0, i0+m) x depth [k0, k0+d) etc.
          if (ta) widen(fa_, a_at(i0, k0), d, m, lda); else widen(fa_, a_at(i0, k0), m, d, lda);
          if (tb) widen(fb_, b_at(k0, j0), n, d, ldb); else widen(fb_, b_at(k0, j0), d, n, ldb);
          cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, d, alpha,
                      fa_.data(), ta ? m : d, fb_.data(), tb ? d : n, b, fc_.data(), n);
          b = 1.0f;
        }
        if (K == 0 && beta != 1.0f)
          for (float& x : fc_) x *= beta;
        for (int i = 0; i < m; ++i)
          for (int j = 0; j < n; ++j) Ct[static_cast<size_t>(i) * ldc + j] = math::st<T>(fc_[static_cast<size_t>(i) * n + j]);
      }
  }

  // Per-thread scratch of the flash attention work items (tiles in S).
  struct FlashScratch {
    std::vector<S> q, k, v, dy, s, dp, acc, acc2, m, l;
  };
  static FlashScratch& flash_scratch() {
    thread_local FlashScratch w;
    return w;
  }
  // A rows x HD block of a T matrix with row stride ld, as S: the block itself for float/double
  // (*ld_out = ld), converted into buf for bf16 (*ld_out = HD).
  static const S* tile_s(const T* src, int ld, int rows, int HD, std::vector<S>& buf, int* ld_out) {
    if constexpr (std::is_same_v<T, S>) {
      (void)rows, (void)HD, (void)buf;
      *ld_out = ld;
      return src;
    } else {
      buf.resize(static_cast<size_t>(rows) * HD);
      for (int r = 0; r < rows; ++r)
        for (int d = 0; d < HD; ++d)
          buf[static_cast<size_t>(r) * HD + d] = math::ld(src[static_cast<size_t>(r) * ld + d]);
      *ld_out = HD;
      return buf.data();
    }
  }
  // The nr query rows r0.. of head h of sequence b as S tiles (Q and, with dy, dY), their offset qo
  // into q / dy ([B, T, NH, HD]) and so into lse / dsum ([B, NH, T]); w.acc, w.s (and w.dp with
  // dy) sized for a query tile.
  struct QueryTile {
    const S* Q = nullptr;
    const S* dY = nullptr;
    int lQ = 0, ldY = 0;
    size_t qo = 0, so = 0;
  };
  static QueryTile query_tile(FlashScratch& w, const T* q, const T* dy, int b, int h, int T_, int NH, int HD, int r0,
                              int nr) {
    QueryTile t;
    const int ldq = NH * HD;
    t.qo = (static_cast<size_t>(b) * T_ + r0) * ldq + static_cast<size_t>(h) * HD;
    t.so = (static_cast<size_t>(b) * NH + h) * T_ + r0;
    t.Q = tile_s(q + t.qo, ldq, nr, HD, w.q, &t.lQ);
    if (dy) t.dY = tile_s(dy + t.qo, ldq, nr, HD, w.dy, &t.ldY);
    return t;
  }
  static void start_query_tile(FlashScratch& w, int nr, int HD, bool backward) {
    w.acc.assign(static_cast<size_t>(nr) * HD, S(0));
    if (!backward) {
      w.m.assign(static_cast<size_t>(nr), -INFINITY);
      w.l.assign(static_cast<size_t>(nr), S(0));
    }
    w.s.resize(static_cast<size_t>(nr) * flash::kBc);
    if (backward) w.dp.resize(static_cast<size_t>(nr) * flash::kBc);
  }
  // The nc key and value rows at offset ko (row stride ldk) as S tiles.
  struct KeyTile {
    const S* K = nullptr;
    const S* V = nullptr;
    int lK = 0, lV = 0;
  };
  static KeyTile key_tile(FlashScratch& w, const T* k, const T* v, size_t ko, int ldk, int nc, int HD) {
    KeyTile t;
    t.K = tile_s(k + ko, ldk, nc, HD, w.k, &t.lK);
    t.V = tile_s(v + ko, ldk, nc, HD, w.v, &t.lV);
    return t;
  }
  // key_tile for the dK/dV pass, with w.acc (dK), w.acc2 (dV), w.s, w.dp sized for a key tile.
  static KeyTile start_key_tile(FlashScratch& w, const T* k, const T* v, size_t ko, int ldk, int nc, int HD) {
    const KeyTile kt = key_tile(w, k, v, ko, ldk, nc, HD);
    w.acc.assign(static_cast<size_t>(nc) * HD, S(0));   // dK
    w.acc2.assign(static_cast<size_t>(nc) * HD, S(0));  // dV
    w.s.resize(static_cast<size_t>(flash::kBr) * nc);
    w.dp.resize(static_cast<size_t>(flash::kBr) * nc);
    return kt;
  }
  // The forward of one (query tile, key tile) pair: scores = Q K^T (one GEMM), the online softmax
  // row by row with row_vis(r) telling which keys c row r sees, acc = alpha acc + P V (rows scaled,
  // then one GEMM with beta = 1).
  template <typename RowVis>
  static void forward_pair(FlashScratch& w, const S* Q, int lQ, const KeyTile& kt, int nr, int nc, int HD, S scale,
                           RowVis&& row_vis) {
    gemm_s(false, true, nr, nc, HD, S(1), Q, lQ, kt.K, kt.lK, S(0), w.s.data(), nc);
    for (int r = 0; r < nr; ++r) {
      S* x = w.s.data() + static_cast<size_t>(r) * nc;
      const auto vis = row_vis(r);
      S mx = -INFINITY;
      for (int c = 0; c < nc; ++c) {
        x[c] = vis(c) ? flash::score(x[c], scale) : S(-INFINITY);
        mx = x[c] > mx ? x[c] : mx;
      }
      const S m_new = flash::online_max(w.m[r], mx), alpha = flash::online_rescale(w.m[r], m_new);
      S sum = 0;
      for (int c = 0; c < nc; ++c) x[c] = vis(c) ? flash::prob(x[c], m_new) : S(0);  // vectorized
      for (int c = 0; c < nc; ++c) sum += x[c];
      w.l[r] = alpha * w.l[r] + sum;
      w.m[r] = m_new;
      S* a = w.acc.data() + static_cast<size_t>(r) * HD;
      for (int d = 0; d < HD; ++d) a[d] *= alpha;
    }
    gemm_s(false, false, nr, HD, nc, S(1), w.s.data(), nc, kt.V, kt.lV, S(1), w.acc.data(), HD);
  }
  // The backward of one tile pair: s = Q K^T, dp = dY V^T, p_ds(s, dp) turning them into P and dS
  // in place, then with dq: dQ (w.acc) += dS K, else dV (w.acc2) += P^T dY, dK (w.acc) += dS^T Q.
  template <typename PDs>
  static void backward_pair(FlashScratch& w, const QueryTile& qt, const KeyTile& kt, int nr, int nc, int HD, bool dq,
                            PDs&& p_ds) {
    gemm_s(false, true, nr, nc, HD, S(1), qt.Q, qt.lQ, kt.K, kt.lK, S(0), w.s.data(), nc);
    gemm_s(false, true, nr, nc, HD, S(1), qt.dY, qt.ldY, kt.V, kt.lV, S(0), w.dp.data(), nc);
    p_ds(w.s.data(), w.dp.data());
    if (dq) {
      gemm_s(false, false, nr, HD, nc, S(1), w.dp.data(), nc, kt.K, kt.lK, S(1), w.acc.data(), HD);
    } else {
      gemm_s(true, false, nc, HD, nr, S(1), w.s.data(), nc, qt.dY, qt.ldY, S(1), w.acc2.data(), HD);
      gemm_s(true, false, nc, HD, nr, S(1), w.dp.data(), nc, qt.Q, qt.lQ, S(1), w.acc.data(), HD);
    }
  }
  // Positions (and documents, or none) of the n tokens t0.. of sequence b of a block ([B, T]) and
  // their flash::tile_range.
  struct PosTile {
    const int32_t* P;
    const int32_t* D;
    flash::TileRange range;
  };
  static PosTile pos_tile(const int32_t* pos, const int32_t* doc, int b, int T_, int t0, int n) {
    const int32_t* P = pos + static_cast<size_t>(b) * T_ + t0;
    const int32_t* D = doc ? doc + static_cast<size_t>(b) * T_ + t0 : nullptr;
    return {P, D, flash::tile_range(P, D, n)};
  }
  // flash::visible of query row r of qt for the keys of kt, as forward_pair's row_vis.
  static auto block_row_vis(const PosTile& qt, const PosTile& kt) {
    return [&qt, &kt](int r) {
      const int qpr = qt.P[r], qdr = qt.D ? qt.D[r] : 0;
      return [&kt, qpr, qdr](int c) { return flash::visible(qpr, kt.P[c], qdr, kt.D ? kt.D[c] : 0); };
    };
  }
  // The tiles (of size tile) of the T_ tokens of sequence b of a block that are not fully masked
  // against other (a query tile's range when the walked tiles are keys, a key tile's when they are
  // queries): f(t0, n, tile) for each, then a poll of the progress registry. Returns the count of
  // masked tiles skipped.
  template <typename F>
  int64_t walk_unmasked_tiles(const int32_t* pos, const int32_t* doc, int b, int T_, int tile,
                              const flash::TileRange& other, bool keys, F&& f) {
    int64_t skip = 0;
    const int n_tiles = T_ > 0 ? flash::num_tiles(T_, tile) : 0;
    for (int j = 0; j < n_tiles; ++j) {
      const int t0 = j * tile, n = std::min(tile, T_ - t0);
      const PosTile pt = pos_tile(pos, doc, b, T_, t0, n);
      if (keys ? flash::tile_pair_masked(other, pt.range) : flash::tile_pair_masked(pt.range, other)) {
        ++skip;
        continue;
      }
      f(t0, n, pt);
      poll_progress();
    }
    return skip;
  }
  // The (b, h, query tile) work items of a block: the forward, or with dy the dQ pass. Per item the
  // query tile qt (positions pq; Q, and dY with dy), pair(w, qt, key tile, nr, nc, pq, pk) for each
  // key tile not fully masked against it (walk_unmasked_tiles: a poll after each), then
  // done(w, qt, b, h, r0, nr). Adds the item's tile pairs and skipped pairs to block_pairs_,
  // block_skipped_.
  template <typename Pair, typename Done>
  void block_query_pass(const T* q, const T* dy, const T* k, const T* v, const int32_t* qp, const int32_t* kp,
                        const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                        Pair&& pair, Done&& done) {
    const int G = NH / NKV, nq = flash::num_tiles(Tq, flash::kBr), nk = Tk > 0 ? flash::num_tiles(Tk, flash::kBc) : 0;
    const int ldk = NKV * HD;
    const size_t BH = static_cast<size_t>(B) * NH;
    std::atomic<int64_t> skipped{0};
    par_items_polled(BH * nq, [&](size_t it) {
      const int i = static_cast<int>(it / BH), b = static_cast<int>(it % BH) / NH, h = static_cast<int>(it % BH) % NH;
      const int r0 = i * flash::kBr, nr = std::min(flash::kBr, Tq - r0);
      const PosTile pq = pos_tile(qp, qd, b, Tq, r0, nr);
      FlashScratch& w = flash_scratch();
      const QueryTile qt = query_tile(w, q, dy, b, h, Tq, NH, HD, r0, nr);
      start_query_tile(w, nr, HD, dy != nullptr);
      skipped += walk_unmasked_tiles(kp, kd, b, Tk, flash::kBc, pq.range, true, [&](int c0, int nc, const PosTile& pk) {
        const size_t ko = (static_cast<size_t>(b) * Tk + c0) * ldk + static_cast<size_t>(h / G) * HD;
        pair(w, qt, key_tile(w, k, v, ko, ldk, nc, HD), nr, nc, pq, pk);
      });
      done(w, qt, b, h, r0, nr);
    }, [this] { poll_progress(); });
    block_pairs_ += static_cast<int64_t>(BH) * nq * nk;
    block_skipped_ += skipped.load();
  }
  // The end of a forward query tile (rows r0.. of head h of sequence b): y = acc * finish_inv(l),
  // lse = finish_lse(m, l); with block, block_finish_inv / block_finish_lse (rows with no key).
  static void finish_query_tile(const FlashScratch& w, T* y, S* lse, int b, int h, int T_, int NH, int HD, int r0,
                                int nr, bool block) {
    const int ldq = NH * HD;
    for (int r = 0; r < nr; ++r) {
      const S inv = block ? flash::block_finish_inv(w.l[r]) : flash::finish_inv(w.l[r]);
      T* yr = y + (static_cast<size_t>(b) * T_ + r0 + r) * ldq + static_cast<size_t>(h) * HD;
      const S* a = w.acc.data() + static_cast<size_t>(r) * HD;
      for (int d = 0; d < HD; ++d) yr[d] = math::st<T>(a[d] * inv);
      lse[(static_cast<size_t>(b) * NH + h) * T_ + r0 + r] =
          block ? flash::block_finish_lse(w.m[r], w.l[r]) : flash::finish_lse(w.m[r], w.l[r]);
    }
  }
  // dst (rows x HD, row stride ld) = src (rows x HD, contiguous), rounded to T.
  static void store_tile(T* dst, int ld, int rows, int HD, const S* src) {
    for (int r = 0; r < rows; ++r)
      for (int d = 0; d < HD; ++d)
        dst[static_cast<size_t>(r) * ld + d] = math::st<T>(src[static_cast<size_t>(r) * HD + d]);
  }
  // One single-threaded BLAS call in S (sgemm for float and bf16, dgemm for double).
  static void gemm_s(bool ta, bool tb, int M, int N, int K, S alpha, const S* Am, int lda, const S* B, int ldb,
                     S beta, S* C, int ldc) {
    auto TA = ta ? CblasTrans : CblasNoTrans;
    auto TB = tb ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<S, float>) cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
    else cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
  }

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
  // x [N, H, HD] rotated in place, row bt at RoPE table row row_pos(bt) (cs, sn [*, HD / 2]).
  template <typename RowPos>
  static void rope_rows(T* x, const T* cs, const T* sn, size_t N, RowPos&& row_pos, int H, int HD, bool backward) {
    const int half = HD / 2;
    par_ranges(N, row_grain(static_cast<size_t>(H) * HD), [&](size_t rb, size_t re) {
      for (size_t bt = rb; bt < re; ++bt) {
        const size_t t = row_pos(bt);
        const T* c = cs + t * half;
        const T* s = sn + t * half;
        for (int h = 0; h < H; ++h) {
          T* v = x + (bt * H + h) * HD;
          for (int j = 0; j < half; ++j) {
            A o1, o2;
            if (backward) math::rope_rotate_backward(math::ld(v[j]), math::ld(v[j + half]), math::ld(c[j]), math::ld(s[j]), &o1, &o2);
            else math::rope_rotate(math::ld(v[j]), math::ld(v[j + half]), math::ld(c[j]), math::ld(s[j]), &o1, &o2);
            v[j] = math::st<T>(o1);
            v[j + half] = math::st<T>(o2);
          }
        }
      }
    });
  }
  // rope_apply with row i at table row pos[i] (the same per-pair math).
  static void rope_apply_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward) {
    rope_rows(x, cs, sn, static_cast<size_t>(N), [pos](size_t bt) { return static_cast<size_t>(pos[bt]); }, H, HD,
              backward);
  }
  static void rope_apply(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
    rope_rows(x, cs, sn, static_cast<size_t>(B) * T_, [T_](size_t bt) { return bt % static_cast<size_t>(T_); }, H, HD,
              backward);
  }
};

}  // namespace

template <typename T> std::unique_ptr<Backend<T>> make_cpu_backend() { return std::make_unique<CpuBackend<T>>(); }
template std::unique_ptr<Backend<float>> make_cpu_backend<float>();
template std::unique_ptr<Backend<double>> make_cpu_backend<double>();
template std::unique_ptr<Backend<bf16>> make_cpu_backend<bf16>();

std::pair<int, int> cpu_gemm_tiles(int M, int N, int K) {
  const GemmTiles g = gemm_tiles(M, N, K);
  return {g.mt, g.nt};
}

void prepare_cpu_helper_thread() {
  omp_set_num_threads(1);
#if defined(__SSE__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ, as prepare_threads()
#endif
}

void set_cpu_threads(int n) {
  if (n <= 0) return;
  omp_set_num_threads(n);
  prepare_threads();  // the threads a new pool size starts get FTZ/DAZ too
}

int cpu_threads() { return omp_get_max_threads(); }

}  // namespace shardtrain
