// SwiGLU, forward and backward (elementwise, math::swiglu; 16-byte packs where aligned): the members of CudaBackend<T>
// (cuda_backend.h) that swiglu.cu defines, with their kernels.
#include <cuda_runtime.h>

#include <cstddef>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

// V elements per step (cuda_common.cuh, "16-byte vector access"); the tail one by one.
template <typename T, int V> __global__ void swiglu_forward_kernel(T* h, const T* g, const T* u, size_t n) {
  const size_t np = n / V;
  for (size_t p = gtid(); p < np; p += gstride()) {
    const Pack<T, V> gv = ld_pack<V>(g + p * V), uv = ld_pack<V>(u + p * V);
    Pack<T, V> hv;
#pragma unroll
    for (int k = 0; k < V; ++k) hv.v[k] = math::st<T>(math::swiglu(math::ld(gv.v[k]), math::ld(uv.v[k])));
    st_pack<V>(h + p * V, hv);
  }
  for (size_t i = np * V + gtid(); i < n; i += gstride()) h[i] = math::st<T>(math::swiglu(math::ld(g[i]), math::ld(u[i])));
}

template <typename T, int V>
__global__ void swiglu_backward_kernel(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) {
  const size_t np = n / V;
  for (size_t p = gtid(); p < np; p += gstride()) {
    const Pack<T, V> gv = ld_pack<V>(g + p * V), uv = ld_pack<V>(u + p * V), hv = ld_pack<V>(dh + p * V);
    Pack<T, V> a, b;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float x, y;
      math::swiglu_backward(math::ld(gv.v[k]), math::ld(uv.v[k]), math::ld(hv.v[k]), &x, &y);
      a.v[k] = math::st<T>(x);
      b.v[k] = math::st<T>(y);
    }
    st_pack<V>(dg + p * V, a);
    st_pack<V>(du + p * V, b);
  }
  for (size_t i = np * V + gtid(); i < n; i += gstride()) {
    float a, b;
    math::swiglu_backward(math::ld(g[i]), math::ld(u[i]), math::ld(dh[i]), &a, &b);
    dg[i] = math::st<T>(a);
    du[i] = math::st<T>(b);
  }
}

}  // namespace

namespace cuda_detail {

template <typename T>
void CudaBackend<T>::swiglu_forward(T* h, const T* gate, const T* up, size_t n) {
  if (!n) return;
  constexpr int V = kVec<T>;
  if (vec_ok({h, gate, up})) swiglu_forward_kernel<T, V><<<grid_for(n / V + 1, kBlock), kBlock, 0, stream_>>>(h, gate, up, n);
  else swiglu_forward_kernel<T, 1><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(h, gate, up, n);
  ST_LAUNCHED("swiglu_forward_kernel");
}
template <typename T>
void CudaBackend<T>::swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up, size_t n) {
  if (!n) return;
  constexpr int V = kVec<T>;
  if (vec_ok({dgate, dup, dh, gate, up}))
    swiglu_backward_kernel<T, V><<<grid_for(n / V + 1, kBlock), kBlock, 0, stream_>>>(dgate, dup, dh, gate, up, n);
  else swiglu_backward_kernel<T, 1><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(dgate, dup, dh, gate, up, n);
  ST_LAUNCHED("swiglu_backward_kernel");
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template void CudaBackend<T>::swiglu_forward(T*, const T*, const T*, size_t); \
  template void CudaBackend<T>::swiglu_backward(T*, T*, const T*, const T*, const T*, size_t);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
