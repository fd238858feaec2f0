// RMSNorm, forward and backward (dw by column sums over row chunks, then the chunks in order): the
// members of CudaBackend<T> (cuda_backend.h) that norm.cu defines, with their kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

// One block per row: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps), sum of squares in float.
// V elements per load (cuda_common.cuh, "16-byte vector access"; V divides C); the second pass
// reads the row again (from L1/L2).
template <typename T, int V>
__global__ void rmsnorm_forward_kernel(T* out, T* rstd, const T* x, const T* w, int N, int C, float eps) {
  const int P = C / V;
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const T* xi = x + static_cast<size_t>(i) * C;
    T* oi = out + static_cast<size_t>(i) * C;
    float ss = 0;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      const Pack<T, V> xv = ld_pack<V>(xi + p * V);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float v = math::ld(xv.v[k]);
        ss += v * v;
      }
    }
    ss = block_reduce(ss, SumOp{});
    const float r = math::rmsnorm_rstd(ss, C, eps);
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      const Pack<T, V> xv = ld_pack<V>(xi + p * V), wv = ld_pack<V>(w + p * V);
      Pack<T, V> ov;
#pragma unroll
      for (int k = 0; k < V; ++k) ov.v[k] = math::st<T>(math::ld(xv.v[k]) * r * math::ld(wv.v[k]));
      st_pack<V>(oi + p * V, ov);
    }
    if (threadIdx.x == 0) rstd[i] = math::st<T>(r);
  }
}

// One block per row: dx += r w dy - x r^3/C sum(w dy x). V as rmsnorm_forward_kernel's.
template <typename T, int V>
__global__ void rmsnorm_backward_dx_kernel(T* dx, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) {
  const int P = C / V;
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const size_t o = static_cast<size_t>(i) * C;
    const float r = math::ld(rstd[i]);
    float dot = 0;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      const Pack<T, V> wv = ld_pack<V>(w + p * V), dv = ld_pack<V>(dout + o + p * V), xv = ld_pack<V>(x + o + p * V);
#pragma unroll
      for (int k = 0; k < V; ++k) dot += math::ld(wv.v[k]) * math::ld(dv.v[k]) * math::ld(xv.v[k]);
    }
    dot = block_reduce(dot, SumOp{});
    const float kk = math::rmsnorm_k(dot, r, C);
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      const Pack<T, V> wv = ld_pack<V>(w + p * V), dv = ld_pack<V>(dout + o + p * V), xv = ld_pack<V>(x + o + p * V);
      Pack<T, V> gv = ld_pack<V>(dx + o + p * V);
#pragma unroll
      for (int k = 0; k < V; ++k)
        gv.v[k] = math::st<T>(math::ld(gv.v[k]) +
                              math::rmsnorm_dx(r, math::ld(wv.v[k]), math::ld(dv.v[k]), kk, math::ld(xv.v[k])));
      st_pack<V>(dx + o + p * V, gv);
    }
  }
}

// dw partial sums: thread per column c (coalesced), block row blockIdx.y covers rows
// [y*rows_per_chunk, (y+1)*rows_per_chunk): partial[y, c] = sum dout[i,c] x[i,c] rstd[i].
template <typename T>
__global__ void rmsnorm_backward_dw_partial_kernel(float* partial, const T* dout, const T* x, const T* rstd, int N,
                                                   int C, int rows_per_chunk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int r0 = blockIdx.y * rows_per_chunk;
  const int r1 = min(N, r0 + rows_per_chunk);
  float acc = 0;
  for (int i = r0; i < r1; ++i) {
    const size_t o = static_cast<size_t>(i) * C + c;
    acc += math::ld(dout[o]) * math::ld(x[o]) * math::ld(rstd[i]);
  }
  partial[static_cast<size_t>(blockIdx.y) * C + c] = acc;
}

// dw[c] += sum over chunks of partial[k, c], chunks in order.
template <typename T> __global__ void rmsnorm_backward_dw_finish_kernel(T* dw, const float* partial, int nchunks, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float acc = math::ld(dw[c]);
  for (int k = 0; k < nchunks; ++k) acc += partial[static_cast<size_t>(k) * C + c];
  dw[c] = math::st<T>(acc);
}

}  // namespace

namespace cuda_detail {

template <typename T>
void CudaBackend<T>::rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) {
  if (N <= 0 || C <= 0) return;
  constexpr int V = kVec<T>;
  if (C % V == 0 && vec_ok({out, x, w}))
    rmsnorm_forward_kernel<T, V><<<grid_rows(N), row_threads(C, V), 0, stream_>>>(out, rstd, x, w, N, C, eps);
  else rmsnorm_forward_kernel<T, 1><<<grid_rows(N), kBlock, 0, stream_>>>(out, rstd, x, w, N, C, eps);
  ST_LAUNCHED("rmsnorm_forward_kernel");
}
template <typename T>
void CudaBackend<T>::rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N,
                                      int C) {
  if (N <= 0 || C <= 0) return;
  // dw first (it reads dout only), so that dx may even alias dout. dw: column sums over row
  // chunks (at most 256 chunks of >= 32 rows), then the chunks in order.
  const int rows_per_chunk = std::max(32, (N + 255) / 256);
  const int nchunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  float* partial = static_cast<float*>(scratch(sizeof(float) * static_cast<size_t>(nchunks) * C));
  const unsigned col_blocks = static_cast<unsigned>((C + kBlock - 1) / kBlock);
  rmsnorm_backward_dw_partial_kernel<T><<<dim3(col_blocks, static_cast<unsigned>(nchunks)), kBlock, 0, stream_>>>(
      partial, dout, x, rstd, N, C, rows_per_chunk);
  ST_LAUNCHED("rmsnorm_backward_dw_partial_kernel");
  rmsnorm_backward_dw_finish_kernel<T><<<col_blocks, kBlock, 0, stream_>>>(dw, partial, nchunks, C);
  ST_LAUNCHED("rmsnorm_backward_dw_finish_kernel");
  constexpr int V = kVec<T>;
  if (C % V == 0 && vec_ok({dx, dout, x, w}))
    rmsnorm_backward_dx_kernel<T, V><<<grid_rows(N), row_threads(C, V), 0, stream_>>>(dx, dout, x, w, rstd, N, C);
  else rmsnorm_backward_dx_kernel<T, 1><<<grid_rows(N), kBlock, 0, stream_>>>(dx, dout, x, w, rstd, N, C);
  ST_LAUNCHED("rmsnorm_backward_dx_kernel");
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template void CudaBackend<T>::rmsnorm_forward(T*, T*, const T*, const T*, int, int, math::Acc<T>); \
  template void CudaBackend<T>::rmsnorm_backward(T*, T*, const T*, const T*, const T*, const T*, int, int);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
