// Cross-entropy over the vocabulary, whole rows (cross_entropy, cross_entropy_sum) and
// vocabulary-parallel (vocab_ce_max, vocab_ce_sum, vocab_ce_finish), the rows' losses summed on
// the device in double: the members of CudaBackend<T> (cuda_backend.h) that loss.cu defines, with
// their kernels.
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

// One block per row: loss[i] = max + log(sum exp(l - max)) - l[target] (in float, as the CPU),
// and, when dlogits != nullptr, dlogits = (softmax - onehot) * grad_scale; a negative target
// (kNoTarget) gives loss 0 and a zero row. dlogits may alias
// logits: every read of the row (the target logit included) happens before the barrier of the
// second block_reduce, and the last pass reads and writes the same element in the same thread.
template <typename T>
__global__ void cross_entropy_kernel(T* dlogits, const T* logits, const int32_t* tgt, int N, int V, float grad_scale,
                                     double* loss) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const T* l = logits + static_cast<size_t>(i) * V;
    const int target = tgt[i];
    if (target < 0) {  // no target (kNoTarget): no loss, a zero gradient row (the branch is the block's)
      if (threadIdx.x == 0) loss[i] = 0.0;
      if (dlogits)
        for (int v = threadIdx.x; v < V; v += blockDim.x) dlogits[static_cast<size_t>(i) * V + v] = math::st<T>(0.0f);
      continue;
    }
    const float lt = math::ld(l[target]);  // read before any thread overwrites the row
    float mx = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) mx = MaxOp{}(mx, math::ld(l[v]));
    mx = block_reduce(mx, MaxOp{});
    float sum = 0;
    for (int v = threadIdx.x; v < V; v += blockDim.x) sum += math::st_exp(math::ld(l[v]) - mx);
    sum = block_reduce(sum, SumOp{});
    if (threadIdx.x == 0) loss[i] = static_cast<double>(mx + logf(sum) - lt);
    if (dlogits) {
      T* e = dlogits + static_cast<size_t>(i) * V;
      const float k = grad_scale / sum;
      for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float p = math::st_exp(math::ld(l[v]) - mx) * k;
        if (v == target) p -= grad_scale;
        e[v] = math::st<T>(p);
      }
    }
    __syncthreads();  // next row: nothing pending on this one (block_reduce also syncs)
  }
}

// Vocabulary-parallel cross-entropy (backend.h), one block per row, as cross_entropy_kernel; the
// per-row and per-element math is ops_math.h's (math::group_max, math::vocab_ce_grad), the CPU's.
template <typename T> __global__ void vocab_ce_max_kernel(const T* logits, int N, int Vl, int valid, float* mx) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const T* l = logits + static_cast<size_t>(i) * Vl;
    float m = -INFINITY;
    for (int v = threadIdx.x; v < valid; v += blockDim.x) m = MaxOp{}(m, math::ld(l[v]));
    m = block_reduce(m, MaxOp{});
    if (threadIdx.x == 0) mx[i] = m;
    __syncthreads();
  }
}
template <typename T>
__global__ void vocab_ce_sum_kernel(const T* logits, const int32_t* tgt, int N, int Vl, int valid, int v0,
                                    const float* maxes, int G, float* st) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const T* l = logits + static_cast<size_t>(i) * Vl;
    const float m = math::group_max<float>(maxes, G, N, static_cast<size_t>(i));
    float sum = 0;
    for (int v = threadIdx.x; v < valid; v += blockDim.x) sum += math::st_exp(math::ld(l[v]) - m);
    sum = block_reduce(sum, SumOp{});
    if (threadIdx.x == 0) {
      const int t = tgt[i] - v0;
      st[2 * static_cast<size_t>(i)] = sum;
      st[2 * static_cast<size_t>(i) + 1] = t >= 0 && t < valid ? math::ld(l[t]) : 0.0f;
    }
    __syncthreads();
  }
}
// Each element is read and written by the same thread (dlogits may alias logits).
template <typename T>
__global__ void vocab_ce_finish_kernel(T* dlogits, const T* logits, const int32_t* tgt, int N, int Vl, int valid,
                                       int v0, const float* maxes, int G, const float* st, float grad_scale,
                                       double* loss) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    if (tgt[i] < 0) {  // no target (kNoTarget): no loss, a zero gradient row
      if (threadIdx.x == 0) loss[i] = 0.0;
      if (dlogits)
        for (int v = threadIdx.x; v < Vl; v += blockDim.x) dlogits[static_cast<size_t>(i) * Vl + v] = math::st<T>(0.0f);
      continue;
    }
    const float m = math::group_max<float>(maxes, G, N, static_cast<size_t>(i)), sum = st[2 * static_cast<size_t>(i)];
    if (threadIdx.x == 0) loss[i] = static_cast<double>(m + logf(sum) - st[2 * static_cast<size_t>(i) + 1]);
    if (!dlogits) continue;
    const T* l = logits + static_cast<size_t>(i) * Vl;
    T* d = dlogits + static_cast<size_t>(i) * Vl;
    const float k = grad_scale / sum;
    const int t = tgt[i] - v0;
    for (int v = threadIdx.x; v < Vl; v += blockDim.x) {
      d[v] = math::st<T>(v < valid ? math::vocab_ce_grad<float>(math::ld(l[v]), m, k, v == t, grad_scale) : 0.0f);
    }
  }
}

}  // namespace

namespace cuda_detail {

template <typename T>
double CudaBackend<T>::cross_entropy(T* dlogits, const T* logits, const int32_t* targets, int N, int V, S grad_scale) {
  if (N <= 0 || V <= 0) return 0.0;
  double* buf = static_cast<double*>(scratch(sizeof(double) * (static_cast<size_t>(N) + 1)));
  cross_entropy_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(dlogits, logits, targets, N, V, grad_scale,
                                                                        buf + 1);
  ST_LAUNCHED("cross_entropy_kernel");
  return sum_to_host(buf + 1, static_cast<size_t>(N), buf);
}
// The rows' losses summed on the device and added to loss_sum_ there: no host wait per chunk.
template <typename T>
void CudaBackend<T>::cross_entropy_sum(T* dlogits, const T* logits, const int32_t* targets, int N, int V,
                                       S grad_scale) {
  if (N <= 0 || V <= 0) return;
  if (!loss_sum_) loss_sum_ = static_cast<double*>(alloc_bytes(sizeof(double)));  // zeroed
  double* buf = static_cast<double*>(scratch(sizeof(double) * static_cast<size_t>(N)));
  cross_entropy_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(dlogits, logits, targets, N, V, grad_scale,
                                                                        buf);
  ST_LAUNCHED("cross_entropy_kernel");
  sum_doubles(buf, static_cast<size_t>(N), loss_sum_, true);
}
template <typename T>
double CudaBackend<T>::take_loss_sum() {
  if (!loss_sum_) return 0.0;
  double h = 0;
  ST_CUDA(cudaMemcpyAsync(&h, loss_sum_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  ST_CUDA(cudaMemsetAsync(loss_sum_, 0, sizeof(double), stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));
  return h;
}

template <typename T>
void CudaBackend<T>::vocab_ce_max(const T* logits, int N, int Vl, int valid, S* mx) {
  if (N <= 0) return;
  vocab_ce_max_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(logits, N, Vl, valid, mx);
  ST_LAUNCHED("vocab_ce_max_kernel");
}
template <typename T>
void CudaBackend<T>::vocab_ce_sum(const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0,
                                  const S* maxes, int G, S* st) {
  if (N <= 0) return;
  vocab_ce_sum_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(logits, targets, N, Vl, valid, v0, maxes, G, st);
  ST_LAUNCHED("vocab_ce_sum_kernel");
}
// The rows' losses summed on the device into loss_sum_, as cross_entropy_sum.
template <typename T>
void CudaBackend<T>::vocab_ce_finish(T* dlogits, const T* logits, const int32_t* targets, int N, int Vl, int valid,
                                     int v0, const S* maxes, int G, const S* st, S grad_scale) {
  if (N <= 0) return;
  if (!loss_sum_) loss_sum_ = static_cast<double*>(alloc_bytes(sizeof(double)));  // zeroed
  double* buf = static_cast<double*>(scratch(sizeof(double) * static_cast<size_t>(N)));
  vocab_ce_finish_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(dlogits, logits, targets, N, Vl, valid, v0,
                                                                          maxes, G, st, grad_scale, buf);
  ST_LAUNCHED("vocab_ce_finish_kernel");
  sum_doubles(buf, static_cast<size_t>(N), loss_sum_, true);
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template double CudaBackend<T>::cross_entropy(T*, const T*, const int32_t*, int, int, math::Acc<T>); \
  template void CudaBackend<T>::cross_entropy_sum(T*, const T*, const int32_t*, int, int, math::Acc<T>); \
  template double CudaBackend<T>::take_loss_sum(); \
  template void CudaBackend<T>::vocab_ce_max(const T*, int, int, int, math::Acc<T>*); \
  template void CudaBackend<T>::vocab_ce_sum(const T*, const int32_t*, int, int, int, int, const math::Acc<T>*, int, \
                                             math::Acc<T>*); \
  template void CudaBackend<T>::vocab_ce_finish(T*, const T*, const int32_t*, int, int, int, int, \
                                                const math::Acc<T>*, int, const math::Acc<T>*, math::Acc<T>);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
