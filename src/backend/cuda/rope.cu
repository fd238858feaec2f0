// Rotary position embeddings, at positions 0..T-1 of each sequence (rope_forward / rope_backward) or
// at given positions (rope_forward_at / rope_backward_at): the members of CudaBackend<T>
// (cuda_backend.h) that rope.cu defines, with their kernels.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

// Pair j of one head's row v (v[j], v[j + half]) rotated by a table row (cs, sn: cos and sin of
// that position, half entries); the per-element math is ops_math.h's, as on the CPU.
template <typename T>
__device__ __forceinline__ void rotate_pair(T* v, const T* cs, const T* sn, size_t j, int half, bool backward) {
  const float c = math::ld(cs[j]), s = math::ld(sn[j]);
  const float x1 = math::ld(v[j]), x2 = math::ld(v[j + half]);
  float o1, o2;
  if (backward) math::rope_rotate_backward(x1, x2, c, s, &o1, &o2);
  else math::rope_rotate(x1, x2, c, s, &o1, &o2);
  v[j] = math::st<T>(o1);
  v[j + half] = math::st<T>(o2);
}

// Thread per rotated pair (row b*T+t, head h, j < HD/2): x[j], x[j+HD/2] rotated by position t.
template <typename T>
__global__ void rope_kernel(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
  const int half = HD / 2;
  const size_t pairs = static_cast<size_t>(B) * T_ * H * half;
  for (size_t idx = gtid(); idx < pairs; idx += gstride()) {
    const size_t j = idx % half;
    const size_t rest = idx / half;  // (b*T + t)*H + h
    const size_t t = (rest / H) % T_;
    rotate_pair(x + rest * HD, cs + t * half, sn + t * half, j, half, backward);
  }
}

// rope_kernel with row i (of N rows of H heads) at table row pos[i].
template <typename T>
__global__ void rope_at_kernel(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward) {
  const int half = HD / 2;
  const size_t pairs = static_cast<size_t>(N) * H * half;
  for (size_t idx = gtid(); idx < pairs; idx += gstride()) {
    const size_t j = idx % half;
    const size_t rest = idx / half;  // i*H + h
    const size_t t = static_cast<size_t>(pos[rest / H]);
    rotate_pair(x + rest * HD, cs + t * half, sn + t * half, j, half, backward);
  }
}

}  // namespace

namespace cuda_detail {

template <typename T>
void CudaBackend<T>::rope_forward(T* x, const T* cos, const T* sin, int B, int T_, int H, int HD) {
  rope(x, cos, sin, B, T_, H, HD, false);
}
template <typename T>
void CudaBackend<T>::rope_backward(T* dx, const T* cos, const T* sin, int B, int T_, int H, int HD) {
  rope(dx, cos, sin, B, T_, H, HD, true);
}

template <typename T>
void CudaBackend<T>::rope_forward_at(T* x, const T* cos, const T* sin, const int32_t* pos, int N, int H, int HD) {
  rope_at(x, cos, sin, pos, N, H, HD, false);
}
template <typename T>
void CudaBackend<T>::rope_backward_at(T* dx, const T* cos, const T* sin, const int32_t* pos, int N, int H, int HD) {
  rope_at(dx, cos, sin, pos, N, H, HD, true);
}

template <typename T>
void CudaBackend<T>::rope(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
  const size_t pairs = static_cast<size_t>(B) * T_ * H * (HD / 2);
  if (B <= 0 || T_ <= 0 || H <= 0 || HD < 2) return;
  rope_kernel<T><<<grid_for(pairs, kBlock), kBlock, 0, stream_>>>(x, cs, sn, B, T_, H, HD, backward);
  ST_LAUNCHED("rope_kernel");
}

template <typename T>
void CudaBackend<T>::rope_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward) {
  const size_t pairs = static_cast<size_t>(N) * H * (HD / 2);
  if (N <= 0 || H <= 0 || HD < 2) return;
  rope_at_kernel<T><<<grid_for(pairs, kBlock), kBlock, 0, stream_>>>(x, cs, sn, pos, N, H, HD, backward);
  ST_LAUNCHED("rope_at_kernel");
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template void CudaBackend<T>::rope_forward(T*, const T*, const T*, int, int, int, int); \
  template void CudaBackend<T>::rope_backward(T*, const T*, const T*, int, int, int, int); \
  template void CudaBackend<T>::rope_forward_at(T*, const T*, const T*, const int32_t*, int, int, int); \
  template void CudaBackend<T>::rope_backward_at(T*, const T*, const T*, const int32_t*, int, int, int);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
