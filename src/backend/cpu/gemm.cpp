// CPU backend: GEMM (C cut into fixed tiles, one single-threaded OpenBLAS call each; batched GEMMs
// one call per batch entry; bf16 widened to float) and the fp32 <-> T conversions of mixed
// precision (from_f32, add_to_f32). The per-element conversions are math::ld / math::st of
// include/shardtrain/backend/ops_math.h; the class and its threading rules are in cpu_backend.h.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpu_backend.h"
#include "shardtrain/backend/fp8.h"

namespace shardtrain {
namespace cpu {
namespace {

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

}  // namespace

template <typename T> void CpuBackend<T>::from_f32(T* d, const float* s, size_t n) {
  par_ranges(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) d[i] = math::st<T>(static_cast<A>(s[i]));
  });
}
template <typename T> void CpuBackend<T>::add_to_f32(float* d, float alpha, const T* s, size_t n) {
  par_ranges(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) d[i] += alpha * static_cast<float>(math::ld(s[i]));
  });
}

template <typename T>
void CpuBackend<T>::gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb,
                         S beta, T* C, int ldc) {
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
template <typename T>
void CpuBackend<T>::gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda,
                                         int64_t sa, const T* B, int ldb, int64_t sb, S beta, T* C, int ldc,
                                         int64_t sc, int batch) {
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

// One single-threaded BLAS call (float or double).
template <typename T>
void CpuBackend<T>::gemm1(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb,
                          S beta, T* C, int ldc) {
  auto TA = ta ? CblasTrans : CblasNoTrans;
  auto TB = tb ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>) cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
  else if constexpr (std::is_same_v<T, double>) cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
}
// bf16: widen the operands to float, sgemm (fp32 accumulation, as cuBLAS with CUBLAS_COMPUTE_32F),
// round the result once. Blocks of kWiden rows / columns / depth at a time, so the float copies are
// at most 3 x kWiden^2 floats (3 MiB), not whole operands (an LM head's [V, C] weight and
// [tokens, V] logits were 250 MiB for llama-125m; the memory plan does not count them).
template <typename T>
void CpuBackend<T>::gemm_bf16(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B,
                              int ldb, S beta, T* C, int ldc) {
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

// Packs a rows x cols block with row stride ld into dst (row stride cols), as float.
template <typename T> void CpuBackend<T>::widen(std::vector<float>& dst, const T* src, int rows, int cols, int ld) {
  dst.resize(static_cast<size_t>(rows) * cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j)
      dst[static_cast<size_t>(i) * cols + j] = static_cast<float>(math::ld(src[static_cast<size_t>(i) * ld + j]));
}

template <typename T>
void CpuBackend<T>::linear_fp8(math::Fp8Gemm role, int M, int N, int K, const T* a, const T* b, T* out,
                               bool accumulate) {
  if constexpr (std::is_same_v<T, double>) {
    (void)role, (void)M, (void)N, (void)K, (void)a, (void)b, (void)out, (void)accumulate;
    throw std::logic_error("the cpu backend's float8 linear GEMM (linear_fp8) emulates float and bf16 storage only, "
                           "not double");
  } else {
    fp8_linear_emulated<T>(role, M, N, K, a, b, out, accumulate);
  }
}

#define ST_CPU_GEMM(T)                                                                                               \
  template void CpuBackend<T>::from_f32(T*, const float*, size_t);                                                 \
  template void CpuBackend<T>::add_to_f32(float*, float, const T*, size_t);                                        \
  template void CpuBackend<T>::gemm(bool, bool, int, int, int, CpuBackend<T>::S, const T*, int, const T*, int,     \
                                    CpuBackend<T>::S, T*, int);                                                    \
  template void CpuBackend<T>::gemm_strided_batched(bool, bool, int, int, int, CpuBackend<T>::S, const T*, int,    \
                                                    int64_t, const T*, int, int64_t, CpuBackend<T>::S, T*, int,    \
                                                    int64_t, int);                                 \
  template void CpuBackend<T>::linear_fp8(math::Fp8Gemm, int, int, int, const T*, const T*, T*, bool);
ST_CPU_GEMM(float)
ST_CPU_GEMM(double)
ST_CPU_GEMM(bf16)
#undef ST_CPU_GEMM

}  // namespace cpu

std::pair<int, int> cpu_gemm_tiles(int M, int N, int K) {
  const cpu::GemmTiles g = cpu::gemm_tiles(M, N, K);
  return {g.mt, g.nt};
}

}  // namespace shardtrain
