// Token embedding: the row gather of the forward and the deterministic scatter-add of the backward
// (positions sorted by token with cub's radix sort): the members of CudaBackend<T> (cuda_backend.h)
// that embedding.cu defines, with their kernels.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

// One block per row i: out[i, :] = table[tok[i], :] (exact copy of the stored bits).
template <typename T> __global__ void embedding_forward_kernel(T* out, const int32_t* tok, const T* table, int N, int C) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    T* dst = out + static_cast<size_t>(i) * C;
    if (tok[i] < 0) {  // another rank's rows (vocabulary-parallel embedding): a zero row
      for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = math::st<T>(0.0f);
      continue;
    }
    const T* src = table + static_cast<size_t>(tok[i]) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = src[c];
  }
}

// dtable[tok[i], :] += dout[i, :], deterministic and without atomics, O(N * C) work: `order` is the
// positions 0..N-1 stably sorted by token (cub::DeviceRadixSort over (token, position) pairs) and
// `sorted` their tokens, so each token's positions form one run, in ascending order. The block of
// sorted index k works only if k starts a run; it adds the run's dout rows to the table row in
// that order, one float accumulator per column: for float storage exactly the CPU backend's
// sequence of additions. (The previous kernel found runs by scanning every earlier position,
// O(N^2) in N = B*T.)
template <typename T>
__global__ void embedding_backward_kernel(T* dtable, const int32_t* sorted, const int32_t* order, const T* dout, int N,
                                          int C) {
  for (int k = blockIdx.x; k < N; k += gridDim.x) {
    const int t = sorted[k];
    if (t < 0) continue;                         // another rank's rows (vocabulary-parallel embedding)
    if (k > 0 && sorted[k - 1] == t) continue;  // not the start of a run
    int end = k + 1;
    while (end < N && sorted[end] == t) ++end;
    T* row = dtable + static_cast<size_t>(t) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float acc = math::ld(row[c]);
      for (int j = k; j < end; ++j) acc += math::ld(dout[static_cast<size_t>(order[j]) * C + c]);
      row[c] = math::st<T>(acc);
    }
  }
}

__global__ void iota_kernel(int32_t* out, int n) {
  for (size_t i = gtid(); i < static_cast<size_t>(n); i += gstride()) out[i] = static_cast<int32_t>(i);
}

}  // namespace

namespace cuda_detail {

template <typename T>
void CudaBackend<T>::embedding_forward(T* out, const int32_t* tokens, const T* table, int N, int C) {
  if (N <= 0 || C <= 0) return;
  embedding_forward_kernel<T><<<grid_rows(N), kBlock, 0, stream_>>>(out, tokens, table, N, C);
  ST_LAUNCHED("embedding_forward_kernel");
}
template <typename T>
void CudaBackend<T>::embedding_backward(T* dtable, const int32_t* tokens, const T* dout, int N, int C) {
  if (N <= 0 || C <= 0) return;
  // Scratch: positions, sorted tokens, sorted positions (N int32 each, 256-byte aligned), then
  // cub's temporary storage.
  const size_t ids = (static_cast<size_t>(N) * sizeof(int32_t) + 255) / 256 * 256;
  size_t temp = 0;
  ST_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, temp, tokens, static_cast<int32_t*>(nullptr),
                                          static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), N, 0,
                                          32, stream_));
  char* base = static_cast<char*>(scratch(3 * ids + temp));
  int32_t* pos = reinterpret_cast<int32_t*>(base);
  int32_t* sorted = reinterpret_cast<int32_t*>(base + ids);
  int32_t* order = reinterpret_cast<int32_t*>(base + 2 * ids);
  iota_kernel<<<grid_for(static_cast<size_t>(N), kBlock), kBlock, 0, stream_>>>(pos, N);
  ST_LAUNCHED("iota_kernel");
  ST_CUDA(cub::DeviceRadixSort::SortPairs(base + 3 * ids, temp, tokens, sorted, pos, order, N, 0, 32, stream_));
  embedding_backward_kernel<T><<<grid_rows(N), kBlock, 0, stream_>>>(dtable, sorted, order, dout, N, C);
  ST_LAUNCHED("embedding_backward_kernel");
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template void CudaBackend<T>::embedding_forward(T*, const int32_t*, const T*, int, int); \
  template void CudaBackend<T>::embedding_backward(T*, const int32_t*, const T*, int, int);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
