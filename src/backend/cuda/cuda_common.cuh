// What the CUDA backend's translation units share (cuda_backend.cu and its operation files,
// cuda_backend.h): cuBLAS / allocation error checks and their macros, the launch shapes, and the
// device helpers of every kernel (grid-stride indices, warp and block reductions). Private to
// src/backend/cuda/.
//
// Storage T is float or bf16; every kernel loads with math::ld (-> float), computes in float
// (math::Acc<T>) and stores once with math::st<T>. Reductions whose result reaches the host
// (sum_squares, cross_entropy) accumulate in double. Every reduction is deterministic (fixed
// tree order, no atomics), so a run repeats bit for bit on the same GPU.
//
// Launch shapes: elementwise ops are grid-stride loops (kBlock threads, at most kMaxGrid blocks);
// row reductions (rmsnorm, softmax, cross_entropy, embedding rows) use one block per row,
// grid-striding over rows when there are more rows than kMaxGrid.
//
// The plugin is built without relocatable device code (no -rdc): a kernel is launched from the
// translation unit that defines it, and every unit compiles its own copy of the device helpers
// below (internal linkage, as when they were one file).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_check.h"

namespace shardtrain::cuda_detail {

static_assert(sizeof(bf16) == sizeof(__nv_bfloat16) && alignof(bf16) == alignof(__nv_bfloat16),
              "bf16 must be layout-compatible with __nv_bfloat16 (cuBLAS CUDA_R_16BF)");

// ---- error checking ---------------------------------------------------------------------------

inline void check_cublas(cublasStatus_t s, const char* what, const char* where) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("cuBLAS error: ") + what + " failed (" + where + "): " + cublasGetStatusName(s) +
                           " (" + cublasGetStatusString(s) + ")");
}
// cudaMalloc: out of memory is std::bad_alloc (the trainer reports it as such), the rest runtime_error.
inline void check_alloc(cudaError_t e, const char* what, const char* where) {
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw std::bad_alloc();
  }
  check_cuda(e, what, where);
}

// ---- launch shapes ----------------------------------------------------------------------------

constexpr int kBlock = 256;           // elementwise and most row kernels
constexpr int kRowBlockLarge = 1024;  // cross_entropy rows (V up to ~128K)
constexpr unsigned kMaxGrid = 65535;  // grid-stride loops beyond this
constexpr int kReduceBlocks = 1024;   // first pass of sum_squares
constexpr int kWarpRowMax = 2048;     // causal softmax rows up to this: one warp per row (64 floats per lane)

inline unsigned grid_for(size_t n, int block) {
  size_t g = (n + static_cast<size_t>(block) - 1) / static_cast<size_t>(block);
  return static_cast<unsigned>(std::min<size_t>(std::max<size_t>(g, 1), kMaxGrid));
}
// Threads per row of a row kernel that takes V elements per load: one pack each, up to kBlock
// (a multiple of 32, as block_reduce needs).
inline int row_threads(int C, int V) { return std::min(kBlock, std::max(32, (C / V + 31) / 32 * 32)); }
inline unsigned grid_rows(size_t rows) { return static_cast<unsigned>(std::min<size_t>(std::max<size_t>(rows, 1), kMaxGrid)); }

// ---- 16-byte vector access ----------------------------------------------------------------------
// The memory-bound kernels move V = 16 / sizeof(T) elements per load and store (4 floats or 8 bf16:
// one 128-bit instruction; 2-byte loads per thread reach about a quarter of a device copy's
// bandwidth, docs/benchmarks.md "GPU, 2026-12-04"). A kernel templated on V runs packs of V
// elements, then the tail (< V elements) one by one; V = 1 is the scalar kernel. The host takes
// V = kVec<T> only when every pointer the kernel vectorizes is 16-byte aligned (vec_ok), and row
// kernels also need V to divide the row length; otherwise V = 1, so any offset into a buffer works.
template <typename T> constexpr int kVec = static_cast<int>(16 / sizeof(T));

inline bool vec_ok(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// cuBLAS's name of storage type T.
template <typename T> constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
  else return CUDA_R_16BF;
}

}  // namespace shardtrain::cuda_detail

#define ST_CUDA(call) ::shardtrain::cuda_detail::check_cuda((call), #call, ST_CUDA_HERE)
#define ST_CUBLAS(call) ::shardtrain::cuda_detail::check_cublas((call), #call, ST_CUDA_HERE)
#define ST_CUDA_ALLOC(call) ::shardtrain::cuda_detail::check_alloc((call), #call, ST_CUDA_HERE)
#define ST_LAUNCHED(kernel) ::shardtrain::cuda_detail::check_cuda(cudaGetLastError(), "launch of " kernel, ST_CUDA_HERE)

namespace shardtrain {
namespace {  // device code: each translation unit its own copy (no -rdc)

__device__ __forceinline__ size_t gtid() { return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ size_t gstride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

// V elements of T, aligned to min(16, V sizeof(T)) bytes: ld_pack / st_pack are one 128-bit access
// when V sizeof(T) = 16 (two when a V-float pack of a bf16 kernel is 32 bytes).
template <typename T, int V> struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) Pack {
  T v[V];
};
template <int V, typename T> __device__ __forceinline__ Pack<T, V> ld_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}
template <int V, typename T> __device__ __forceinline__ void st_pack(T* p, const Pack<T, V>& x) {
  *reinterpret_cast<Pack<T, V>*>(p) = x;
}

// ---- block reductions -------------------------------------------------------------------------
// blockDim.x must be a multiple of 32 (all our launches are). Every thread gets the result; the
// combination order is fixed (warp butterfly, then warps in order), so results are deterministic.

struct SumOp {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
struct MaxOp {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return b > a ? b : a; }
};

// Every lane of the (fully active) warp gets the result, combined in a fixed butterfly order.
template <typename A, typename Op> __device__ __forceinline__ A warp_reduce(A v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename A, typename Op> __device__ A block_reduce(A v, Op op) {
  __shared__ A partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // a previous block_reduce may still be reading `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  A r = partial[0];
  for (int w = 1; w < nwarps; ++w) r = op(r, partial[w]);
  return r;
}

}  // namespace
}  // namespace shardtrain
