// The optimizer's and the gradient norm's operations: AdamW, axpy, scale, and sums of squares
// (block partials in double, then sum_doubles: cuda_backend.cu): the members of CudaBackend<T>
// (cuda_backend.h) that optimizer.cu defines, with their kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

// V elements per step where the pointers allow (cuda_common.cuh, "16-byte vector access").
template <typename T, int V> __global__ void axpy_kernel(size_t n, float alpha, const T* x, T* y) {
  const size_t np = n / V;
  for (size_t p = gtid(); p < np; p += gstride()) {
    const Pack<T, V> xv = ld_pack<V>(x + p * V);
    Pack<T, V> yv = ld_pack<V>(y + p * V);
#pragma unroll
    for (int k = 0; k < V; ++k) yv.v[k] = math::st<T>(math::ld(yv.v[k]) + alpha * math::ld(xv.v[k]));
    st_pack<V>(y + p * V, yv);
  }
  for (size_t i = np * V + gtid(); i < n; i += gstride()) y[i] = math::st<T>(math::ld(y[i]) + alpha * math::ld(x[i]));
}

template <typename T, int V> __global__ void scale_kernel(size_t n, float alpha, T* x) {
  const size_t np = n / V;
  for (size_t p = gtid(); p < np; p += gstride()) {
    Pack<T, V> xv = ld_pack<V>(x + p * V);
#pragma unroll
    for (int k = 0; k < V; ++k) xv.v[k] = math::st<T>(math::ld(xv.v[k]) * alpha);
    st_pack<V>(x + p * V, xv);
  }
  for (size_t i = np * V + gtid(); i < n; i += gstride()) x[i] = math::st<T>(math::ld(x[i]) * alpha);
}

// partial[blockIdx.x] = sum of squares (double) of this block's grid-stride share of x.
template <typename T> __global__ void sum_squares_kernel(const T* x, size_t n, double* partial) {
  double s = 0;
  for (size_t i = gtid(); i < n; i += gstride()) {
    double v = static_cast<double>(math::ld(x[i]));
    s += v * v;
  }
  s = block_reduce(s, SumOp{});
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

template <typename T, int V>
__global__ void adamw_kernel(T* p, T* m, T* v, const T* g, size_t n, float lr, float b1, float b2, float eps, float wd,
                             float gs, float bc1, float bc2) {
  const size_t np = n / V;
  for (size_t q = gtid(); q < np; q += gstride()) {
    const size_t i = q * V;
    Pack<T, V> pp = ld_pack<V>(p + i), mp = ld_pack<V>(m + i), vp = ld_pack<V>(v + i);
    const Pack<T, V> gp = ld_pack<V>(g + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float pv = math::ld(pp.v[k]), mv = math::ld(mp.v[k]), vv = math::ld(vp.v[k]);
      math::adamw(&pv, &mv, &vv, math::ld(gp.v[k]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
      pp.v[k] = math::st<T>(pv);
      mp.v[k] = math::st<T>(mv);
      vp.v[k] = math::st<T>(vv);
    }
    st_pack<V>(p + i, pp);
    st_pack<V>(m + i, mp);
    st_pack<V>(v + i, vp);
  }
  for (size_t i = np * V + gtid(); i < n; i += gstride()) {
    float pv = math::ld(p[i]), mv = math::ld(m[i]), vv = math::ld(v[i]);
    math::adamw(&pv, &mv, &vv, math::ld(g[i]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
    p[i] = math::st<T>(pv);
    m[i] = math::st<T>(mv);
    v[i] = math::st<T>(vv);
  }
}

}  // namespace

namespace cuda_detail {

template <typename T>
void CudaBackend<T>::axpy(size_t n, S alpha, const T* x, T* y) {
  if (!n) return;
  constexpr int V = kVec<T>;
  if (vec_ok({x, y})) axpy_kernel<T, V><<<grid_for(n / V + 1, kBlock), kBlock, 0, stream_>>>(n, alpha, x, y);
  else axpy_kernel<T, 1><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(n, alpha, x, y);
  ST_LAUNCHED("axpy_kernel");
}
template <typename T>
void CudaBackend<T>::scale(size_t n, S alpha, T* x) {
  if (!n) return;
  constexpr int V = kVec<T>;
  if (vec_ok({x})) scale_kernel<T, V><<<grid_for(n / V + 1, kBlock), kBlock, 0, stream_>>>(n, alpha, x);
  else scale_kernel<T, 1><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(n, alpha, x);
  ST_LAUNCHED("scale_kernel");
}
template <typename T>
double CudaBackend<T>::sum_squares(const T* x, size_t n) {
  if (!n) return 0.0;
  const unsigned blocks = std::min<unsigned>(grid_for(n, kBlock), kReduceBlocks);
  double* part = static_cast<double*>(scratch(sizeof(double) * (blocks + 1)));
  sum_squares_kernel<T><<<blocks, kBlock, 0, stream_>>>(x, n, part + 1);
  ST_LAUNCHED("sum_squares_kernel");
  return sum_to_host(part + 1, blocks, part);
}
// Each array reduced as sum_squares does (block partials, then one block sums them into its
// slot), every sum copied back in one transfer, added on the host in order: one wait.
template <typename T>
double CudaBackend<T>::sum_squares_many(const T* const* x, const size_t* n, size_t k) {
  if (k == 0) return 0.0;
  double* sums = static_cast<double*>(scratch(sizeof(double) * k * (kReduceBlocks + 1)));
  double* part = sums + k;
  for (size_t i = 0; i < k; ++i) {
    double* pi = part + i * kReduceBlocks;
    if (!n[i]) {
      ST_CUDA(cudaMemsetAsync(sums + i, 0, sizeof(double), stream_));
      continue;
    }
    const unsigned blocks = std::min<unsigned>(grid_for(n[i], kBlock), kReduceBlocks);
    sum_squares_kernel<T><<<blocks, kBlock, 0, stream_>>>(x[i], n[i], pi);
    ST_LAUNCHED("sum_squares_kernel");
    sum_doubles(pi, blocks, sums + i, false);
  }
  std::vector<double> h(k);
  ST_CUDA(cudaMemcpyAsync(h.data(), sums, sizeof(double) * k, cudaMemcpyDeviceToHost, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));
  double s = 0;
  for (double v : h) s += v;
  return s;
}

template <typename T>
void CudaBackend<T>::adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S grad_scale,
                           int64_t step) {
  if (!n) return;
  // Bias corrections as the CPU backend: pow in double, then rounded to S.
  const S bc1 = S(1) - static_cast<S>(std::pow(static_cast<double>(b1), static_cast<double>(step)));
  const S bc2 = S(1) - static_cast<S>(std::pow(static_cast<double>(b2), static_cast<double>(step)));
  constexpr int V = kVec<T>;
  if (vec_ok({p, m, v, g}))
    adamw_kernel<T, V><<<grid_for(n / V + 1, kBlock), kBlock, 0, stream_>>>(p, m, v, g, n, lr, b1, b2, eps, wd,
                                                                          grad_scale, bc1, bc2);
  else
    adamw_kernel<T, 1><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(p, m, v, g, n, lr, b1, b2, eps, wd, grad_scale,
                                                                  bc1, bc2);
  ST_LAUNCHED("adamw_kernel");
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template void CudaBackend<T>::axpy(size_t, math::Acc<T>, const T*, T*); \
  template void CudaBackend<T>::scale(size_t, math::Acc<T>, T*); \
  template double CudaBackend<T>::sum_squares(const T*, size_t); \
  template double CudaBackend<T>::sum_squares_many(const T* const*, const size_t*, size_t); \
  template void CudaBackend<T>::adamw(T*, T*, T*, const T*, size_t, math::Acc<T>, math::Acc<T>, math::Acc<T>, \
                                      math::Acc<T>, math::Acc<T>, math::Acc<T>, int64_t);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
