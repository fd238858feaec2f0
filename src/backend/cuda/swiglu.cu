// SwiGLU, forward and backward (elementwise, math::swiglu): the members of CudaBackend<T>
// (cuda_backend.h) that swiglu.cu defines, with their kernels.
#include <cuda_runtime.h>

#include <cstddef>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

template <typename T> __global__ void swiglu_forward_kernel(T* h, const T* g, const T* u, size_t n) {
  for (size_t i = gtid(); i < n; i += gstride()) h[i] = math::st<T>(math::swiglu(math::ld(g[i]), math::ld(u[i])));
}

template <typename T>
__global__ void swiglu_backward_kernel(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) {
  for (size_t i = gtid(); i < n; i += gstride()) {
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
  swiglu_forward_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(h, gate, up, n);
  ST_LAUNCHED("swiglu_forward_kernel");
}
template <typename T>
void CudaBackend<T>::swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up, size_t n) {
  if (!n) return;
  swiglu_backward_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(dgate, dup, dh, gate, up, n);
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
