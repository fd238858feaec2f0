// Mixture-of-experts routing (softmax + top-k per token and its backward, the load-balancing
// loss's probability sums) and the dispatch / combine permutations: the members of CudaBackend<T>
// (cuda_backend.h) that moe.cu defines, with their kernels. The per-token math is
// include/shardtrain/backend/moe_math.h, the CPU backend's too. Every sum runs in one fixed order
// (a token's k slots in slot order, a group's rows in row order, a dot product by block_reduce), so
// results do not depend on scheduling.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/moe_math.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

// One thread per token: widen its logits into z [N, E] (scratch), then moe_route.
template <typename T>
__global__ void moe_route_kernel(float* probs, int32_t* experts, float* weights, float* z, const T* logits, int N,
                                 int E, int k, bool renorm, float* lse) {
  for (size_t t = gtid(); t < static_cast<size_t>(N); t += gstride()) {
    float* zt = z + t * E;
    for (int i = 0; i < E; ++i) zt[i] = math::ld(logits[t * E + i]);
    if (lse) lse[t] = math::moe_logsumexp(zt, E);
    math::moe_route(zt, E, k, renorm, probs + t * E, experts + t * k, weights + t * k);
  }
}

// One thread per token: moe_route_backward into dz [N, E] (scratch), rounded into dlogits.
template <typename T>
__global__ void moe_route_backward_kernel(T* dlogits, float* dz, const float* probs, const int32_t* experts,
                                          const float* weights, const float* dweights, const float* aux_dprob,
                                          int group_rows, int N, int E, int k, bool renorm, const float* lse,
                                          const float* z_dlse) {
  for (size_t t = gtid(); t < static_cast<size_t>(N); t += gstride()) {
    const float* g = aux_dprob ? aux_dprob + (t / static_cast<size_t>(group_rows)) * E : nullptr;
    float* d = dz + t * E;
    math::moe_route_backward(probs + t * E, experts + t * k, weights + t * k, dweights + t * k, g, E, k, renorm, d);
    if (z_dlse) math::moe_z_dlogits(probs + t * E, lse[t], E, z_dlse[t / static_cast<size_t>(group_rows)], d);
    for (int i = 0; i < E; ++i) dlogits[t * E + i] = math::st<T>(d[i]);
  }
}

// One thread per (group, expert): its rows added in order.
__global__ void moe_prob_sums_kernel(float* psum, const float* probs, int group_rows, int N, int E, int G) {
  for (size_t i = gtid(); i < static_cast<size_t>(G) * E; i += gstride()) {
    const size_t g = i / E, e = i % E;
    const size_t t1 = min(static_cast<size_t>(N), (g + 1) * group_rows);
    float s = psum[i];
    for (size_t t = g * group_rows; t < t1; ++t) s += probs[t * E + e];
    psum[i] = s;
  }
}

// One thread per group: its rows' lse^2 added in order.
__global__ void moe_z_sums_kernel(float* zsum, const float* lse, int group_rows, int N, int G) {
  for (size_t g = gtid(); g < static_cast<size_t>(G); g += gstride()) {
    const size_t t1 = min(static_cast<size_t>(N), (g + 1) * group_rows);
    float s = zsum[g];
    for (size_t t = g * group_rows; t < t1; ++t) s += lse[t] * lse[t];
    zsum[g] = s;
  }
}

template <typename T> __global__ void gather_rows_kernel(T* out, const T* in, const int32_t* idx, int n, int C) {
  for (size_t i = gtid(); i < static_cast<size_t>(n) * C; i += gstride()) {
    const size_t r = i / C, c = i % C;
    out[i] = in[static_cast<size_t>(idx[r]) * C + c];
  }
}

// One thread per output element: its k slots in order.
template <typename T>
__global__ void moe_combine_kernel(T* out, const T* base, const T* ye, const int32_t* pos, const float* w, int N, int k,
                                   int C) {
  for (size_t i = gtid(); i < static_cast<size_t>(N) * C; i += gstride()) {
    const size_t t = i / C, c = i % C;
    float acc = 0;
    for (int j = 0; j < k; ++j)
      acc += (w ? w[t * k + j] : 1.0f) * math::ld(ye[static_cast<size_t>(pos[t * k + j]) * C + c]);
    out[i] = math::st<T>(base ? math::ld(base[i]) + acc : acc);
  }
}

// One block per slot (t, j): dye's row, and the dot product by block_reduce.
template <typename T>
__global__ void moe_combine_backward_kernel(T* dye, float* dw, const T* dout, const T* ye, const int32_t* pos,
                                            const float* w, int N, int k, int C) {
  for (size_t s = blockIdx.x; s < static_cast<size_t>(N) * k; s += gridDim.x) {
    const size_t t = s / k, r = static_cast<size_t>(pos[s]);
    const float ws = w[s];
    float dot = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float d = math::ld(dout[t * C + c]);
      dot += d * math::ld(ye[r * C + c]);
      dye[r * C + c] = math::st<T>(ws * d);
    }
    dot = block_reduce(dot, SumOp{});
    if (threadIdx.x == 0) dw[s] = dot;
  }
}

}  // namespace

namespace cuda_detail {

template <typename T>
void CudaBackend<T>::moe_route(S* probs, int32_t* experts, S* weights, const T* logits, int N, int E, int k,
                               bool renorm, S* lse) {
  if (N <= 0) return;
  float* z = static_cast<float*>(scratch(sizeof(float) * static_cast<size_t>(N) * E));
  moe_route_kernel<T><<<grid_for(static_cast<size_t>(N), kBlock), kBlock, 0, stream_>>>(probs, experts, weights, z,
                                                                                        logits, N, E, k, renorm, lse);
  ST_LAUNCHED("moe_route_kernel");
}
template <typename T>
void CudaBackend<T>::moe_route_backward(T* dlogits, const S* probs, const int32_t* experts, const S* weights,
                                        const S* dweights, const S* aux_dprob, int group_rows, int N, int E, int k,
                                        bool renorm, const S* lse, const S* z_dlse) {
  if (N <= 0) return;
  float* dz = static_cast<float*>(scratch(sizeof(float) * static_cast<size_t>(N) * E));
  moe_route_backward_kernel<T><<<grid_for(static_cast<size_t>(N), kBlock), kBlock, 0, stream_>>>(
      dlogits, dz, probs, experts, weights, dweights, aux_dprob, group_rows, N, E, k, renorm, lse, z_dlse);
  ST_LAUNCHED("moe_route_backward_kernel");
}
template <typename T> void CudaBackend<T>::moe_prob_sums(S* psum, const S* probs, int group_rows, int N, int E) {
  if (N <= 0) return;
  const int G = (N + group_rows - 1) / group_rows;
  moe_prob_sums_kernel<<<grid_for(static_cast<size_t>(G) * E, kBlock), kBlock, 0, stream_>>>(psum, probs, group_rows,
                                                                                             N, E, G);
  ST_LAUNCHED("moe_prob_sums_kernel");
}
template <typename T> void CudaBackend<T>::moe_z_sums(S* zsum, const S* lse, int group_rows, int N) {
  if (N <= 0) return;
  const int G = (N + group_rows - 1) / group_rows;
  moe_z_sums_kernel<<<grid_for(static_cast<size_t>(G), kBlock), kBlock, 0, stream_>>>(zsum, lse, group_rows, N, G);
  ST_LAUNCHED("moe_z_sums_kernel");
}
template <typename T> void CudaBackend<T>::gather_rows(T* out, const T* in, const int32_t* idx, int n, int C) {
  if (n <= 0 || C <= 0) return;
  gather_rows_kernel<T><<<grid_for(static_cast<size_t>(n) * C, kBlock), kBlock, 0, stream_>>>(out, in, idx, n, C);
  ST_LAUNCHED("gather_rows_kernel");
}
template <typename T>
void CudaBackend<T>::moe_combine(T* out, const T* base, const T* ye, const int32_t* pos, const S* w, int N, int k,
                                 int C) {
  if (N <= 0 || C <= 0) return;
  moe_combine_kernel<T><<<grid_for(static_cast<size_t>(N) * C, kBlock), kBlock, 0, stream_>>>(out, base, ye, pos, w, N,
                                                                                             k, C);
  ST_LAUNCHED("moe_combine_kernel");
}
template <typename T>
void CudaBackend<T>::moe_combine_backward(T* dye, S* dw, const T* dout, const T* ye, const int32_t* pos, const S* w,
                                          int N, int k, int C) {
  if (N <= 0 || k <= 0) return;
  moe_combine_backward_kernel<T><<<grid_rows(static_cast<size_t>(N) * k), kBlock, 0, stream_>>>(dye, dw, dout, ye, pos,
                                                                                               w, N, k, C);
  ST_LAUNCHED("moe_combine_backward_kernel");
}
template <typename T> void CudaBackend<T>::ids_to_host(int32_t* host, const int32_t* src, size_t n) {
  if (!n) return;
  ST_CUDA(cudaMemcpyAsync(host, src, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));
}
template <typename T> void CudaBackend<T>::acc_to_host(S* host, const S* src, size_t n) {
  if (!n) return;
  ST_CUDA(cudaMemcpyAsync(host, src, n * sizeof(S), cudaMemcpyDeviceToHost, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));
}
template <typename T> void CudaBackend<T>::acc_from_host(S* dst, const S* host, size_t n) {
  if (!n) return;
  ST_CUDA(cudaMemcpyAsync(dst, host, n * sizeof(S), cudaMemcpyHostToDevice, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));  // the host buffer may be freed right after
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T)                                                                                          \
  template void CudaBackend<T>::moe_route(float*, int32_t*, float*, const T*, int, int, int, bool, float*);        \
  template void CudaBackend<T>::moe_route_backward(T*, const float*, const int32_t*, const float*, const float*,  \
                                                   const float*, int, int, int, int, bool, const float*,          \
                                                   const float*);                                                 \
  template void CudaBackend<T>::moe_prob_sums(float*, const float*, int, int, int);                                \
  template void CudaBackend<T>::moe_z_sums(float*, const float*, int, int);                                        \
  template void CudaBackend<T>::gather_rows(T*, const T*, const int32_t*, int, int);                               \
  template void CudaBackend<T>::moe_combine(T*, const T*, const T*, const int32_t*, const float*, int, int, int);  \
  template void CudaBackend<T>::moe_combine_backward(T*, float*, const T*, const T*, const int32_t*, const float*, \
                                                     int, int, int);                                               \
  template void CudaBackend<T>::ids_to_host(int32_t*, const int32_t*, size_t);                                     \
  template void CudaBackend<T>::acc_to_host(float*, const float*, size_t);                                         \
  template void CudaBackend<T>::acc_from_host(float*, const float*, size_t);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
