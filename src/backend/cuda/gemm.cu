// GEMMs on cuBLAS (CUBLAS_COMPUTE_32F: float accumulation, no TF32; K == 0 scales C as BLAS does)
// and the precision conversions between the storage type and float (from_f32, add_to_f32): the
// members of CudaBackend<T> (cuda_backend.h) that gemm.cu defines, with their kernels.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

// C[i*ldc + j] = beta * C (0 when beta == 0, as BLAS: C is not read), i < M, j < N. For K == 0 GEMMs.
template <typename T> __global__ void scale_matrix_kernel(T* C, int M, int N, int ldc, float beta) {
  const size_t n = static_cast<size_t>(M) * N;
  for (size_t idx = gtid(); idx < n; idx += gstride()) {
    size_t i = idx / N, j = idx % N;
    T* c = C + i * ldc + j;
    *c = math::st<T>(beta == 0.0f ? 0.0f : beta * math::ld(*c));
  }
}

// V elements per step where the pointers allow (cuda_common.cuh, "16-byte vector access"): V =
// kVec<T>, so a bf16 step reads 32 bytes of floats (two 16-byte loads) and writes 16.
template <typename T, int V> __global__ void from_f32_kernel(T* dst, const float* src, size_t n) {
  const size_t np = n / V;
  for (size_t p = gtid(); p < np; p += gstride()) {
    const Pack<float, V> sv = ld_pack<V>(src + p * V);
    Pack<T, V> dv;
#pragma unroll
    for (int k = 0; k < V; ++k) dv.v[k] = math::st<T>(sv.v[k]);
    st_pack<V>(dst + p * V, dv);
  }
  for (size_t i = np * V + gtid(); i < n; i += gstride()) dst[i] = math::st<T>(src[i]);
}

template <typename T, int V> __global__ void add_to_f32_kernel(float* dst, float alpha, const T* src, size_t n) {
  const size_t np = n / V;
  for (size_t p = gtid(); p < np; p += gstride()) {
    const Pack<T, V> sv = ld_pack<V>(src + p * V);
    Pack<float, V> dv = ld_pack<V>(dst + p * V);
#pragma unroll
    for (int k = 0; k < V; ++k) dv.v[k] += alpha * math::ld(sv.v[k]);
    st_pack<V>(dst + p * V, dv);
  }
  for (size_t i = np * V + gtid(); i < n; i += gstride()) dst[i] += alpha * math::ld(src[i]);
}

}  // namespace

namespace cuda_detail {

// ---- precision conversion ----
template <typename T>
void CudaBackend<T>::from_f32(T* dst, const float* src, size_t n) {
  if (!n) return;
  constexpr int V = kVec<T>;
  if (vec_ok({dst, src})) from_f32_kernel<T, V><<<grid_for(n / V + 1, kBlock), kBlock, 0, stream_>>>(dst, src, n);
  else from_f32_kernel<T, 1><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(dst, src, n);
  ST_LAUNCHED("from_f32_kernel");
}
template <typename T>
void CudaBackend<T>::add_to_f32(float* dst, float alpha, const T* src, size_t n) {
  if (!n) return;
  constexpr int V = kVec<T>;
  if (vec_ok({dst, src})) add_to_f32_kernel<T, V><<<grid_for(n / V + 1, kBlock), kBlock, 0, stream_>>>(dst, alpha, src, n);
  else add_to_f32_kernel<T, 1><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(dst, alpha, src, n);
  ST_LAUNCHED("add_to_f32_kernel");
}

// ---- GEMM ----
// Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T: swap the operands.
template <typename T>
void CudaBackend<T>::gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, const T* B, int ldb,
                          S beta, T* C, int ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_c(C, M, N, ldc, beta);
    return;
  }
  const float al = alpha, be = beta;
  ST_CUBLAS(cublasGemmEx(handle_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &al, B,
                         cuda_type<T>(), ldb, A, cuda_type<T>(), lda, &be, C, cuda_type<T>(), ldc, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
}
template <typename T>
void CudaBackend<T>::gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda,
                                          int64_t sa, const T* B, int ldb, int64_t sb, S beta, T* C, int ldc,
                                          int64_t sc, int batch) {
  if (M == 0 || N == 0 || batch <= 0) return;
  if (K == 0) {
    for (int i = 0; i < batch; ++i) scale_c(C + i * sc, M, N, ldc, beta);
    return;
  }
  const float al = alpha, be = beta;
  ST_CUBLAS(cublasGemmStridedBatchedEx(handle_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M,
                                       K, &al, B, cuda_type<T>(), ldb, static_cast<long long>(sb), A, cuda_type<T>(),
                                       lda, static_cast<long long>(sa), &be, C, cuda_type<T>(), ldc,
                                       static_cast<long long>(sc), batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

template <typename T>
void CudaBackend<T>::scale_c(T* C, int M, int N, int ldc, float beta) {
  if (beta == 1.0f) return;
  scale_matrix_kernel<T><<<grid_for(static_cast<size_t>(M) * N, kBlock), kBlock, 0, stream_>>>(C, M, N, ldc, beta);
  ST_LAUNCHED("scale_matrix_kernel");
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template void CudaBackend<T>::from_f32(T*, const float*, size_t); \
  template void CudaBackend<T>::add_to_f32(float*, float, const T*, size_t); \
  template void CudaBackend<T>::gemm(bool, bool, int, int, int, math::Acc<T>, const T*, int, const T*, int, \
                                     math::Acc<T>, T*, int); \
  template void CudaBackend<T>::gemm_strided_batched(bool, bool, int, int, int, math::Acc<T>, const T*, int, \
                                                     int64_t, const T*, int, int64_t, math::Acc<T>, T*, int, \
                                                     int64_t, int);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
