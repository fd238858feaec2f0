// Rotary position embeddings, at positions 0..T-1 of each sequence (rope_forward / rope_backward) or
// at given positions (rope_forward_at / rope_backward_at), and on queries and keys in one launch (rope_qk): the members of CudaBackend<T>
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

// Pairs j .. j+V-1 of one head's row v (v[j], v[j + half]) rotated by a table row (cs, sn: cos and
// sin of that position, half entries); the per-element math is ops_math.h's, as on the CPU. V > 1
// loads V elements at once (cuda_common.cuh, "16-byte vector access"; V divides half).
template <int V, typename T>
__device__ __forceinline__ void rotate_pairs(T* v, const T* cs, const T* sn, size_t j, int half, bool backward) {
  const Pack<T, V> c = ld_pack<V>(cs + j), s = ld_pack<V>(sn + j), a = ld_pack<V>(v + j), b = ld_pack<V>(v + j + half);
  Pack<T, V> oa, ob;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const float ck = math::ld(c.v[k]), sk = math::ld(s.v[k]), x1 = math::ld(a.v[k]), x2 = math::ld(b.v[k]);
    float o1, o2;
    if (backward) math::rope_rotate_backward(x1, x2, ck, sk, &o1, &o2);
    else math::rope_rotate(x1, x2, ck, sk, &o1, &o2);
    oa.v[k] = math::st<T>(o1);
    ob.v[k] = math::st<T>(o2);
  }
  st_pack<V>(v + j, oa);
  st_pack<V>(v + j + half, ob);
}

// Thread per V rotated pairs (row b*T+t, head h, j < HD/2): x[j], x[j+HD/2] rotated by position t.
template <typename T, int V>
__global__ void rope_kernel(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
  const int half = HD / 2, per = half / V;
  const size_t packs = static_cast<size_t>(B) * T_ * H * per;
  for (size_t idx = gtid(); idx < packs; idx += gstride()) {
    const size_t j = (idx % per) * V;
    const size_t rest = idx / per;  // (b*T + t)*H + h
    const size_t t = (rest / H) % T_;
    rotate_pairs<V>(x + rest * HD, cs + t * half, sn + t * half, j, half, backward);
  }
}

// rope_kernel with row i (of N rows of H heads) at table row pos[i].
template <typename T, int V>
__global__ void rope_at_kernel(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward) {
  const int half = HD / 2, per = half / V;
  const size_t packs = static_cast<size_t>(N) * H * per;
  for (size_t idx = gtid(); idx < packs; idx += gstride()) {
    const size_t j = (idx % per) * V;
    const size_t rest = idx / per;  // i*H + h
    const size_t t = static_cast<size_t>(pos[rest / H]);
    rotate_pairs<V>(x + rest * HD, cs + t * half, sn + t * half, j, half, backward);
  }
}

// rope_kernel and rope_at_kernel over the queries' and the keys' heads in one launch: thread per V
// pairs of one head of one row, heads [0, Hq) of q then [0, Hk) of k; row i at table row pos[i], or
// i % T_ without pos. The same rotate_pairs as the two calls, so bitwise their result.
template <typename T, int V>
__global__ void rope_qk_kernel(T* q, int Hq, T* k, int Hk, const T* cs, const T* sn, const int32_t* pos, int N, int T_,
                               int HD, bool backward) {
  const int half = HD / 2, per = half / V, H = Hq + Hk;
  const size_t packs = static_cast<size_t>(N) * H * per;
  for (size_t idx = gtid(); idx < packs; idx += gstride()) {
    const size_t j = (idx % per) * V;
    const size_t rest = idx / per;  // i*(Hq + Hk) + h
    const size_t i = rest / H, h = rest % H;
    const size_t t = pos ? static_cast<size_t>(pos[i]) : i % static_cast<size_t>(T_);
    T* row = h < static_cast<size_t>(Hq) ? q + (i * Hq + h) * HD : k + (i * Hk + (h - Hq)) * HD;
    rotate_pairs<V>(row, cs + t * half, sn + t * half, j, half, backward);
  }
}

}  // namespace

namespace cuda_detail {

template <typename T>
void CudaBackend<T>::rope_qk(T* q, int Hq, T* k, int Hk, const T* cs, const T* sn, const int32_t* pos, int B, int T_,
                             int HD, bool backward) {
  const int N = B * T_;
  if (N <= 0 || Hq + Hk <= 0 || HD < 2) return;
  const size_t pairs = static_cast<size_t>(N) * (Hq + Hk) * (HD / 2);
  constexpr int V = kVec<T>;
  if ((HD / 2) % V == 0 && vec_ok({q, k, cs, sn}))
    rope_qk_kernel<T, V><<<grid_for(pairs / V, kBlock), kBlock, 0, stream_>>>(q, Hq, k, Hk, cs, sn, pos, N, T_, HD,
                                                                             backward);
  else
    rope_qk_kernel<T, 1><<<grid_for(pairs, kBlock), kBlock, 0, stream_>>>(q, Hq, k, Hk, cs, sn, pos, N, T_, HD,
                                                                         backward);
  ST_LAUNCHED("rope_qk_kernel");
}

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
  constexpr int V = kVec<T>;
  if ((HD / 2) % V == 0 && vec_ok({x, cs, sn}))
    rope_kernel<T, V><<<grid_for(pairs / V, kBlock), kBlock, 0, stream_>>>(x, cs, sn, B, T_, H, HD, backward);
  else rope_kernel<T, 1><<<grid_for(pairs, kBlock), kBlock, 0, stream_>>>(x, cs, sn, B, T_, H, HD, backward);
  ST_LAUNCHED("rope_kernel");
}

template <typename T>
void CudaBackend<T>::rope_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward) {
  const size_t pairs = static_cast<size_t>(N) * H * (HD / 2);
  if (N <= 0 || H <= 0 || HD < 2) return;
  constexpr int V = kVec<T>;
  if ((HD / 2) % V == 0 && vec_ok({x, cs, sn}))
    rope_at_kernel<T, V><<<grid_for(pairs / V, kBlock), kBlock, 0, stream_>>>(x, cs, sn, pos, N, H, HD, backward);
  else rope_at_kernel<T, 1><<<grid_for(pairs, kBlock), kBlock, 0, stream_>>>(x, cs, sn, pos, N, H, HD, backward);
  ST_LAUNCHED("rope_at_kernel");
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template void CudaBackend<T>::rope_forward(T*, const T*, const T*, int, int, int, int); \
  template void CudaBackend<T>::rope_backward(T*, const T*, const T*, int, int, int, int); \
  template void CudaBackend<T>::rope_forward_at(T*, const T*, const T*, const int32_t*, int, int, int); \
  template void CudaBackend<T>::rope_backward_at(T*, const T*, const T*, const int32_t*, int, int, int); \
  template void CudaBackend<T>::rope_qk(T*, int, T*, int, const T*, const T*, const int32_t*, int, int, int, bool);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
