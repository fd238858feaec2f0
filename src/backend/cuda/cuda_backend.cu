// CUDA backend: cuBLAS for the GEMMs, hand-written kernels for everything else, all ordered on the
// CudaContext's stream. The per-element math comes from ops_math.h / bf16.h (shared with the CPU
// backend, whose tests cover it); the kernels only decide the parallel decomposition.
//
// Storage T is float or bf16; every kernel loads with math::ld (-> float), computes in float
// (math::Acc<T>) and stores once with math::st<T>. Reductions whose result reaches the host
// (sum_squares, cross_entropy) accumulate in double. Every reduction is deterministic (fixed
// tree order, no atomics), so a run repeats bit for bit on the same GPU.
//
// Launch shapes: elementwise ops are grid-stride loops (kBlock threads, at most kMaxGrid blocks);
// row reductions (rmsnorm, softmax, cross_entropy, embedding rows) use one block per row,
// grid-striding over rows when there are more rows than kMaxGrid.
#include <cublas_v2.h>
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/backend/flash_attention.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_check.h"
#include "cudnn_attention.h"
#include "plugin_abi.h"

namespace shardtrain {
namespace {

using cuda_detail::check_cuda;

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

#define ST_CUDA(call) check_cuda((call), #call, ST_CUDA_HERE)
#define ST_CUBLAS(call) check_cublas((call), #call, ST_CUDA_HERE)
#define ST_CUDA_ALLOC(call) check_alloc((call), #call, ST_CUDA_HERE)
#define ST_LAUNCHED(kernel) check_cuda(cudaGetLastError(), "launch of " kernel, ST_CUDA_HERE)

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
inline unsigned grid_rows(size_t rows) { return static_cast<unsigned>(std::min<size_t>(std::max<size_t>(rows, 1), kMaxGrid)); }

__device__ __forceinline__ size_t gtid() { return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ size_t gstride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

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

// ---- kernels ----------------------------------------------------------------------------------

// C[i*ldc + j] = beta * C (0 when beta == 0, as BLAS: C is not read), i < M, j < N. For K == 0 GEMMs.
template <typename T> __global__ void scale_matrix_kernel(T* C, int M, int N, int ldc, float beta) {
  const size_t n = static_cast<size_t>(M) * N;
  for (size_t idx = gtid(); idx < n; idx += gstride()) {
    size_t i = idx / N, j = idx % N;
    T* c = C + i * ldc + j;
    *c = math::st<T>(beta == 0.0f ? 0.0f : beta * math::ld(*c));
  }
}

template <typename T> __global__ void axpy_kernel(size_t n, float alpha, const T* x, T* y) {
  for (size_t i = gtid(); i < n; i += gstride()) y[i] = math::st<T>(math::ld(y[i]) + alpha * math::ld(x[i]));
}

template <typename T> __global__ void scale_kernel(size_t n, float alpha, T* x) {
  for (size_t i = gtid(); i < n; i += gstride()) x[i] = math::st<T>(math::ld(x[i]) * alpha);
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

// out[0] = sum of in[0..n) in double (accumulate: out[0] += that sum). One block.
__global__ void sum_doubles_kernel(const double* in, size_t n, double* out, bool accumulate = false) {
  double s = 0;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
  s = block_reduce(s, SumOp{});
  if (threadIdx.x == 0) out[0] = accumulate ? out[0] + s : s;
}

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

// One block per row: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps), sum of squares in float.
template <typename T>
__global__ void rmsnorm_forward_kernel(T* out, T* rstd, const T* x, const T* w, int N, int C, float eps) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const T* xi = x + static_cast<size_t>(i) * C;
    T* oi = out + static_cast<size_t>(i) * C;
    float ss = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float v = math::ld(xi[c]);
      ss += v * v;
    }
    ss = block_reduce(ss, SumOp{});
    const float r = math::rmsnorm_rstd(ss, C, eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) oi[c] = math::st<T>(math::ld(xi[c]) * r * math::ld(w[c]));
    if (threadIdx.x == 0) rstd[i] = math::st<T>(r);
  }
}

// One block per row: dx += r w dy - x r^3/C sum(w dy x).
template <typename T>
__global__ void rmsnorm_backward_dx_kernel(T* dx, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const size_t o = static_cast<size_t>(i) * C;
    const float r = math::ld(rstd[i]);
    float dot = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dot += math::ld(w[c]) * math::ld(dout[o + c]) * math::ld(x[o + c]);
    dot = block_reduce(dot, SumOp{});
    const float k = math::rmsnorm_k(dot, r, C);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float wc = math::ld(w[c]), dc = math::ld(dout[o + c]), xc = math::ld(x[o + c]);
      dx[o + c] = math::st<T>(math::ld(dx[o + c]) + math::rmsnorm_dx(r, wc, dc, k, xc));
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

// Thread per rotated pair (row b*T+t, head h, j < HD/2): x[j], x[j+HD/2] rotated by position t.
template <typename T>
__global__ void rope_kernel(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
  const int half = HD / 2;
  const size_t pairs = static_cast<size_t>(B) * T_ * H * half;
  for (size_t idx = gtid(); idx < pairs; idx += gstride()) {
    const size_t j = idx % half;
    const size_t rest = idx / half;  // (b*T + t)*H + h
    const size_t t = (rest / H) % T_;
    T* v = x + rest * HD;
    const float c = math::ld(cs[t * half + j]), s = math::ld(sn[t * half + j]);
    const float x1 = math::ld(v[j]), x2 = math::ld(v[j + half]);
    float o1, o2;
    if (backward) math::rope_rotate_backward(x1, x2, c, s, &o1, &o2);
    else math::rope_rotate(x1, x2, c, s, &o1, &o2);
    v[j] = math::st<T>(o1);
    v[j + half] = math::st<T>(o2);
  }
}

// One block per row, for rows longer than kWarpRowMax (rows = R*T_, row r has t = r % T_): softmax
// of scale*att over s <= t, zeros above the diagonal. The exponentials are recomputed in the last
// pass rather than stored, so the row is rounded to T once. __fmul_rn keeps scale*x from being
// fused into the subtraction, so the maximum's exponent is exactly 0, as on the CPU.
template <typename T> __global__ void softmax_causal_forward_kernel(T* att, size_t rows, int T_, float scale) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* row = att + r * T_;
    const int t = static_cast<int>(r % T_);
    float mx = -INFINITY;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) mx = MaxOp{}(mx, __fmul_rn(math::ld(row[s]), scale));
    mx = block_reduce(mx, MaxOp{});
    float sum = 0;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) sum += math::st_exp(__fmul_rn(math::ld(row[s]), scale) - mx);
    sum = block_reduce(sum, SumOp{});  // (its barrier also ends every read of the row above)
    const float inv = 1.0f / sum;
    for (int s = threadIdx.x; s < T_; s += blockDim.x)
      row[s] = math::st<T>(s <= t ? math::st_exp(__fmul_rn(math::ld(row[s]), scale) - mx) * inv : 0.0f);
  }
}

// Rows of up to 32*K elements (T_ <= kWarpRowMax): one warp per row, the row held in registers
// (element s = lane + 32*k), so it is read once and written once, with no block barrier. Same math
// as the block kernel above. On an H200 (docs/benchmarks.md), llama-125m at T = 1024: 13.85 ms per
// step plus evaluation batch, against the block kernel's 17.18.
template <typename T, int K>
__global__ void softmax_causal_forward_warp_kernel(T* att, size_t rows, int T_, float scale) {
  const int lane = threadIdx.x & 31;
  const size_t warps = blockDim.x >> 5;
  for (size_t r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += static_cast<size_t>(gridDim.x) * warps) {
    T* row = att + r * T_;
    const int t = static_cast<int>(r % T_);
    float v[K];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int s = lane + 32 * k;
      v[k] = s <= t ? __fmul_rn(math::ld(row[s]), scale) : -INFINITY;
      mx = MaxOp{}(mx, v[k]);
    }
    mx = warp_reduce(mx, MaxOp{});
    float sum = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      v[k] = lane + 32 * k <= t ? math::st_exp(v[k] - mx) : 0.0f;
      sum += v[k];
    }
    const float inv = 1.0f / warp_reduce(sum, SumOp{});
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int s = lane + 32 * k;
      if (s < T_) row[s] = math::st<T>(v[k] * inv);
    }
  }
}

// One block per row: datt = scale * p * (datt - sum(p * datt)) for s <= t, 0 above.
template <typename T> __global__ void softmax_causal_backward_kernel(T* datt, const T* att, size_t rows, int T_, float scale) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* d = datt + r * T_;
    const T* p = att + r * T_;
    const int t = static_cast<int>(r % T_);
    float dot = 0;
    for (int s = threadIdx.x; s <= t; s += blockDim.x) dot += math::ld(p[s]) * math::ld(d[s]);
    dot = block_reduce(dot, SumOp{});
    for (int s = threadIdx.x; s < T_; s += blockDim.x)
      d[s] = math::st<T>(s <= t ? math::softmax_grad(math::ld(p[s]), math::ld(d[s]), dot, scale) : 0.0f);
  }
}

// Calls f(std::integral_constant<int, K>) with the smallest power-of-two K with 32*K >= T_, if
// T_ <= kWarpRowMax; returns whether it did.
template <typename F> bool with_warp_row(int T_, F&& f) {
  if (T_ <= 32) f(std::integral_constant<int, 1>{});
  else if (T_ <= 64) f(std::integral_constant<int, 2>{});
  else if (T_ <= 128) f(std::integral_constant<int, 4>{});
  else if (T_ <= 256) f(std::integral_constant<int, 8>{});
  else if (T_ <= 512) f(std::integral_constant<int, 16>{});
  else if (T_ <= 1024) f(std::integral_constant<int, 32>{});
  else if (T_ <= kWarpRowMax) f(std::integral_constant<int, kWarpRowMax / 32>{});
  else return false;
  return true;
}

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

// One block per row: loss[i] = max + log(sum exp(l - max)) - l[target] (in float, as the CPU),
// and, when dlogits != nullptr, dlogits = (softmax - onehot) * grad_scale. dlogits may alias
// logits: every read of the row (the target logit included) happens before the barrier of the
// second block_reduce, and the last pass reads and writes the same element in the same thread.
template <typename T>
__global__ void cross_entropy_kernel(T* dlogits, const T* logits, const int32_t* tgt, int N, int V, float grad_scale,
                                     double* loss) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const T* l = logits + static_cast<size_t>(i) * V;
    const int target = tgt[i];
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

template <typename T>
__global__ void adamw_kernel(T* p, T* m, T* v, const T* g, size_t n, float lr, float b1, float b2, float eps, float wd,
                             float gs, float bc1, float bc2) {
  for (size_t i = gtid(); i < n; i += gstride()) {
    float pv = math::ld(p[i]), mv = math::ld(m[i]), vv = math::ld(v[i]);
    math::adamw(&pv, &mv, &vv, math::ld(g[i]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
    p[i] = math::st<T>(pv);
    m[i] = math::st<T>(mv);
    v[i] = math::st<T>(vv);
  }
}

template <typename T> __global__ void from_f32_kernel(T* dst, const float* src, size_t n) {
  for (size_t i = gtid(); i < n; i += gstride()) dst[i] = math::st<T>(src[i]);
}

template <typename T> __global__ void add_to_f32_kernel(float* dst, float alpha, const T* src, size_t n) {
  for (size_t i = gtid(); i < n; i += gstride()) dst[i] += alpha * math::ld(src[i]);
}

// ---- flash attention (include/shardtrain/backend/flash_attention.h) -----------------------------------
// The loops of flash_attention.h with its tile sizes and per-row math. One thread per owned row:
//  - forward and dQ pass: one block of kBr threads per (query tile, head, sequence); thread r owns
//    query row r0 + r, holds its kBc scores (and dP) in registers (unrolled loops) and its [HD]
//    accumulator in shared memory, transposed ([HD][kBr]: thread r reads column r, conflict-free).
//    The key and value tiles are staged in shared memory as float, [kBc][HD], zero past the last
//    key; every thread of the block reads the same element at a time (broadcast).
//  - dK/dV pass: one block of kBc threads per (key tile, kv head, sequence); thread c owns key row
//    c0 + c (its k and v rows read from global memory), the query and dY tiles are staged.
// Sums run in a fixed order per thread (no atomics): deterministic. Shared memory per block:
// forward and dQ (2 kBc + kBr) HD floats (48 KiB at HD = 64), dK/dV (2 kBr + 2 kBc) HD + 2 kBr
// floats; above 48 KiB the kernel is opted in to the device's larger limit.
using flash::kBc;
using flash::kBr;

template <typename T>
__global__ void __launch_bounds__(kBr) flash_forward_kernel(T* y, float* lse, const T* q, const T* k, const T* v,
                                                            int T_, int NH, int NKV, int HD, float scale) {
  extern __shared__ float smem[];
  float* sK = smem;              // [kBc][HD]
  float* sV = sK + kBc * HD;     // [kBc][HD]
  float* sAcc = sV + kBc * HD;   // [HD][kBr]
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, r = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD;
  const int r0 = i * kBr, t = r0 + r, last_row = min(T_, r0 + kBr) - 1;
  const bool row_ok = t < T_;
  const T* qr = q + (static_cast<size_t>(b) * T_ + (row_ok ? t : r0)) * ldq + static_cast<size_t>(h) * HD;
  for (int d = 0; d < HD; ++d) sAcc[d * kBr + r] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int j = 0; j <= last_row / kBc; ++j) {
    const int c0 = j * kBc, nc = min(kBc, last_row + 1 - c0);
    const size_t ko = (static_cast<size_t>(b) * T_ + c0) * ldk + static_cast<size_t>(h / G) * HD;
    __syncthreads();  // every thread is done with the previous tile
    for (int e = r; e < kBc * HD; e += kBr) {
      const int c = e / HD, d = e % HD;
      sK[e] = c < nc ? math::ld(k[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
      sV[e] = c < nc ? math::ld(v[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
    }
    __syncthreads();
    float x[kBc];
#pragma unroll
    for (int c = 0; c < kBc; ++c) x[c] = 0.0f;
    for (int d = 0; d < HD; ++d) {
      const float qd = math::ld(qr[d]);
#pragma unroll
      for (int c = 0; c < kBc; ++c) x[c] += qd * sK[c * HD + d];
    }
    const int last = t - c0;  // keys c <= last are visible
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < kBc; ++c) {
      x[c] = c <= last ? flash::score(x[c], scale) : -INFINITY;
      mx = x[c] > mx ? x[c] : mx;
    }
    const float m_new = flash::online_max(m, mx), alpha = flash::online_rescale(m, m_new);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kBc; ++c) {
      x[c] = c <= last ? flash::prob(x[c], m_new) : 0.0f;
      sum += x[c];
    }
    l = alpha * l + sum;
    m = m_new;
    for (int d = 0; d < HD; ++d) {
      float a = sAcc[d * kBr + r] * alpha;
#pragma unroll
      for (int c = 0; c < kBc; ++c) a += x[c] * sV[c * HD + d];
      sAcc[d * kBr + r] = a;
    }
  }
  if (!row_ok) return;
  const float inv = flash::finish_inv(l);
  T* yr = y + (static_cast<size_t>(b) * T_ + t) * ldq + static_cast<size_t>(h) * HD;
  for (int d = 0; d < HD; ++d) yr[d] = math::st<T>(sAcc[d * kBr + r] * inv);
  lse[(static_cast<size_t>(b) * NH + h) * T_ + t] = flash::finish_lse(m, l);
}

// dsum[(b*NH + h)*T + t] = dy_t . y_t (head h), one thread per row.
template <typename T>
__global__ void flash_dsum_kernel(float* dsum, const T* dy, const T* y, int T_, int NH, int HD, size_t rows) {
  for (size_t rr = gtid(); rr < rows; rr += gstride()) {
    const size_t bh = rr / T_, t = rr % T_, b = bh / NH, h = bh % NH;
    const size_t o = (b * T_ + t) * static_cast<size_t>(NH) * HD + h * HD;
    dsum[rr] = flash::row_dot(dy + o, y + o, HD);
  }
}

// Pass 1: dq of one query tile (block) and row (thread).
template <typename T>
__global__ void __launch_bounds__(kBr) flash_backward_dq_kernel(T* dq, const T* dy, const T* q, const T* k, const T* v,
                                                                const float* lse, const float* dsum, int T_, int NH,
                                                                int NKV, int HD, float scale) {
  extern __shared__ float smem[];
  float* sK = smem;              // [kBc][HD]
  float* sV = sK + kBc * HD;     // [kBc][HD]
  float* sAcc = sV + kBc * HD;   // [HD][kBr]
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, r = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD;
  const int r0 = i * kBr, t = r0 + r, last_row = min(T_, r0 + kBr) - 1;
  const bool row_ok = t < T_;
  const size_t qo = (static_cast<size_t>(b) * T_ + (row_ok ? t : r0)) * ldq + static_cast<size_t>(h) * HD;
  const size_t so = (static_cast<size_t>(b) * NH + h) * T_ + (row_ok ? t : r0);
  const float L = lse[so], D = dsum[so];
  for (int d = 0; d < HD; ++d) sAcc[d * kBr + r] = 0.0f;
  for (int j = 0; j <= last_row / kBc; ++j) {
    const int c0 = j * kBc, nc = min(kBc, last_row + 1 - c0);
    const size_t ko = (static_cast<size_t>(b) * T_ + c0) * ldk + static_cast<size_t>(h / G) * HD;
    __syncthreads();
    for (int e = r; e < kBc * HD; e += kBr) {
      const int c = e / HD, d = e % HD;
      sK[e] = c < nc ? math::ld(k[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
      sV[e] = c < nc ? math::ld(v[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
    }
    __syncthreads();
    float x[kBc], dp[kBc];
#pragma unroll
    for (int c = 0; c < kBc; ++c) x[c] = dp[c] = 0.0f;
    for (int d = 0; d < HD; ++d) {
      const float qd = math::ld(q[qo + d]), gd = math::ld(dy[qo + d]);
#pragma unroll
      for (int c = 0; c < kBc; ++c) {
        x[c] += qd * sK[c * HD + d];
        dp[c] += gd * sV[c * HD + d];
      }
    }
    const int last = t - c0;
#pragma unroll
    for (int c = 0; c < kBc; ++c) {
      const float p = c <= last ? flash::prob_from_lse(flash::score(x[c], scale), L) : 0.0f;
      x[c] = c <= last ? flash::dscore(p, dp[c], D, scale) : 0.0f;  // dS
    }
    for (int d = 0; d < HD; ++d) {
      float a = sAcc[d * kBr + r];
#pragma unroll
      for (int c = 0; c < kBc; ++c) a += x[c] * sK[c * HD + d];
      sAcc[d * kBr + r] = a;
    }
  }
  if (!row_ok) return;
  for (int d = 0; d < HD; ++d) dq[qo + d] = math::st<T>(sAcc[d * kBr + r]);
}

// Pass 2: dk, dv of one key tile (block) and key row (thread), over the G query heads of the group
// and the query tiles from the diagonal on.
template <typename T>
__global__ void __launch_bounds__(kBc) flash_backward_dkv_kernel(T* dk, T* dv, const T* dy, const T* q, const T* k,
                                                                 const T* v, const float* lse, const float* dsum,
                                                                 int T_, int NH, int NKV, int HD, float scale) {
  extern __shared__ float smem[];
  float* sQ = smem;                // [kBr][HD]
  float* sG = sQ + kBr * HD;       // [kBr][HD]  (dY)
  float* sdK = sG + kBr * HD;      // [HD][kBc]
  float* sdV = sdK + HD * kBc;     // [HD][kBc]
  float* sL = sdV + HD * kBc;      // [kBr]
  float* sD = sL + kBr;            // [kBr]
  const int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, c = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD, nq = flash::num_tiles(T_, kBr);
  const int c0 = j * kBc, key = c0 + c;
  const bool key_ok = key < T_;
  const size_t ko = (static_cast<size_t>(b) * T_ + (key_ok ? key : c0)) * ldk + static_cast<size_t>(kvh) * HD;
  for (int d = 0; d < HD; ++d) sdK[d * kBc + c] = sdV[d * kBc + c] = 0.0f;
  for (int g = 0; g < G; ++g) {
    const int h = kvh * G + g;
    for (int i = c0 / kBr; i < nq; ++i) {
      const int r0 = i * kBr, nr = min(kBr, T_ - r0);
      const size_t qo = (static_cast<size_t>(b) * T_ + r0) * ldq + static_cast<size_t>(h) * HD;
      const size_t so = (static_cast<size_t>(b) * NH + h) * T_ + r0;
      __syncthreads();
      for (int e = c; e < kBr * HD; e += kBc) {
        const int rr = e / HD, d = e % HD;
        sQ[e] = rr < nr ? math::ld(q[qo + static_cast<size_t>(rr) * ldq + d]) : 0.0f;
        sG[e] = rr < nr ? math::ld(dy[qo + static_cast<size_t>(rr) * ldq + d]) : 0.0f;
      }
      for (int rr = c; rr < kBr; rr += kBc) {
        sL[rr] = rr < nr ? lse[so + rr] : 0.0f;
        sD[rr] = rr < nr ? dsum[so + rr] : 0.0f;
      }
      __syncthreads();
      float x[kBr], dp[kBr];
#pragma unroll
      for (int rr = 0; rr < kBr; ++rr) x[rr] = dp[rr] = 0.0f;
      for (int d = 0; d < HD; ++d) {
        const float kd = math::ld(k[ko + d]), vd = math::ld(v[ko + d]);
#pragma unroll
        for (int rr = 0; rr < kBr; ++rr) {
          x[rr] += sQ[rr * HD + d] * kd;
          dp[rr] += sG[rr * HD + d] * vd;
        }
      }
#pragma unroll
      for (int rr = 0; rr < kBr; ++rr) {
        const bool ok = rr < nr && key <= r0 + rr;
        const float p = ok ? flash::prob_from_lse(flash::score(x[rr], scale), sL[rr]) : 0.0f;
        dp[rr] = ok ? flash::dscore(p, dp[rr], sD[rr], scale) : 0.0f;  // dS
        x[rr] = p;
      }
      for (int d = 0; d < HD; ++d) {
        float av = sdV[d * kBc + c], ak = sdK[d * kBc + c];
#pragma unroll
        for (int rr = 0; rr < kBr; ++rr) {
          av += x[rr] * sG[rr * HD + d];
          ak += dp[rr] * sQ[rr * HD + d];
        }
        sdV[d * kBc + c] = av;
        sdK[d * kBc + c] = ak;
      }
    }
  }
  if (!key_ok) return;
  for (int d = 0; d < HD; ++d) {
    dk[ko + d] = math::st<T>(sdK[d * kBc + c]);
    dv[ko + d] = math::st<T>(sdV[d * kBc + c]);
  }
}

// ---- block attention at global positions (flash_attention.h, "Block attention") ----------------
// The three kernels above with the block's masks: positions (and documents) of the query tile and
// of each key tile staged in shared memory, the tile pair classified by flash::tile_pair_masked
// from them (the same decision in every thread of the block, so a masked pair is skipped by the
// whole block), visible() per pair; rows with no key get y = 0, lse = -inf; the backward adds
// (+=) into dq, dk, dv. Skipped pairs: thread 0 of each forward / dQ block adds its count to
// *skipped (one atomicAdd per block).
template <typename T>
__global__ void __launch_bounds__(kBr) block_forward_kernel(T* y, float* lse, const T* q, const T* k, const T* v,
                                                            const int32_t* qp, const int32_t* kp, const int32_t* qdoc,
                                                            const int32_t* kdoc, int Tq, int Tk, int NH, int NKV,
                                                            int HD, float scale, unsigned long long* skipped) {
  extern __shared__ float smem[];
  float* sK = smem;              // [kBc][HD]
  float* sV = sK + kBc * HD;     // [kBc][HD]
  float* sAcc = sV + kBc * HD;   // [HD][kBr]
  __shared__ int sQP[kBr], sQD[kBr], sKP[kBc], sKD[kBc];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, r = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD;
  const int r0 = i * kBr, t = r0 + r, nr = min(kBr, Tq - r0);
  const bool row_ok = t < Tq;
  const T* qr = q + (static_cast<size_t>(b) * Tq + (row_ok ? t : r0)) * ldq + static_cast<size_t>(h) * HD;
  for (int e = r; e < nr; e += blockDim.x) {
    sQP[e] = qp[static_cast<size_t>(b) * Tq + r0 + e];
    sQD[e] = qdoc ? qdoc[static_cast<size_t>(b) * Tq + r0 + e] : 0;
  }
  __syncthreads();
  const flash::TileRange qrange = flash::tile_range(sQP, qdoc ? sQD : nullptr, nr);
  const int my_p = row_ok ? sQP[r] : 0, my_d = row_ok ? sQD[r] : 0;
  for (int d = 0; d < HD; ++d) sAcc[d * kBr + r] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  unsigned long long skip = 0;
  const int nk = flash::num_tiles(Tk, kBc);
  for (int j = 0; j < nk; ++j) {
    const int c0 = j * kBc, nc = min(kBc, Tk - c0);
    const size_t ko = (static_cast<size_t>(b) * Tk + c0) * ldk + static_cast<size_t>(h / G) * HD;
    __syncthreads();  // every thread is done with the previous tile
    for (int e = r; e < nc; e += blockDim.x) {
      sKP[e] = kp[static_cast<size_t>(b) * Tk + c0 + e];
      sKD[e] = kdoc ? kdoc[static_cast<size_t>(b) * Tk + c0 + e] : 0;
    }
    __syncthreads();
    if (flash::tile_pair_masked(qrange, flash::tile_range(sKP, kdoc ? sKD : nullptr, nc))) {
      ++skip;
      continue;
    }
    for (int e = r; e < kBc * HD; e += kBr) {
      const int c = e / HD, d = e % HD;
      sK[e] = c < nc ? math::ld(k[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
      sV[e] = c < nc ? math::ld(v[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
    }
    __syncthreads();
    float x[kBc];
#pragma unroll
    for (int c = 0; c < kBc; ++c) x[c] = 0.0f;
    for (int d = 0; d < HD; ++d) {
      const float qd = math::ld(qr[d]);
#pragma unroll
      for (int c = 0; c < kBc; ++c) x[c] += qd * sK[c * HD + d];
    }
    float mx = -INFINITY;
    bool ok[kBc];
#pragma unroll
    for (int c = 0; c < kBc; ++c) {
      ok[c] = row_ok && c < nc && flash::visible(my_p, sKP[c], my_d, sKD[c]);
      x[c] = ok[c] ? flash::score(x[c], scale) : -INFINITY;
      mx = x[c] > mx ? x[c] : mx;
    }
    const float m_new = flash::online_max(m, mx), alpha = flash::online_rescale(m, m_new);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kBc; ++c) {
      x[c] = ok[c] ? flash::prob(x[c], m_new) : 0.0f;
      sum += x[c];
    }
    l = alpha * l + sum;
    m = m_new;
    for (int d = 0; d < HD; ++d) {
      float a = sAcc[d * kBr + r] * alpha;
#pragma unroll
      for (int c = 0; c < kBc; ++c) a += x[c] * sV[c * HD + d];
      sAcc[d * kBr + r] = a;
    }
  }
  if (r == 0 && skip) atomicAdd(skipped, skip);
  if (!row_ok) return;
  const float inv = flash::block_finish_inv(l);
  T* yr = y + (static_cast<size_t>(b) * Tq + t) * ldq + static_cast<size_t>(h) * HD;
  for (int d = 0; d < HD; ++d) yr[d] = math::st<T>(sAcc[d * kBr + r] * inv);
  lse[(static_cast<size_t>(b) * NH + h) * Tq + t] = flash::block_finish_lse(m, l);
}

// Online-softmax merge (flash::merge_weights, flash::merge_row), one thread per row (b, h, t); y in
// T (attention_merge) or float (attention_merge_acc).
template <typename Y, typename T>
__global__ void block_merge_kernel(Y* y, float* lse, const T* yp, const float* lsep, int Tq, int NH, int HD,
                                   size_t rows) {
  for (size_t rr = gtid(); rr < rows; rr += gstride()) {
    const size_t bh = rr / Tq, t = rr % Tq, b = bh / NH, h = bh % NH;
    const size_t o = (b * Tq + t) * static_cast<size_t>(NH) * HD + h * HD;
    float wa, wb, l;
    flash::merge_weights(lse[rr], lsep[rr], &wa, &wb, &l);
    flash::merge_row(y + o, yp + o, wa, wb, HD);
    lse[rr] = l;
  }
}

template <typename T>
__global__ void __launch_bounds__(kBr) block_backward_dq_kernel(T* dq, const T* dy, const T* q, const T* k, const T* v,
                                                                const float* lse, const float* dsum, const int32_t* qp,
                                                                const int32_t* kp, const int32_t* qdoc,
                                                                const int32_t* kdoc, int Tq, int Tk, int NH, int NKV,
                                                                int HD, float scale, unsigned long long* skipped) {
  extern __shared__ float smem[];
  float* sK = smem;              // [kBc][HD]
  float* sV = sK + kBc * HD;     // [kBc][HD]
  float* sAcc = sV + kBc * HD;   // [HD][kBr]
  __shared__ int sQP[kBr], sQD[kBr], sKP[kBc], sKD[kBc];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, r = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD;
  const int r0 = i * kBr, t = r0 + r, nr = min(kBr, Tq - r0);
  const bool row_ok = t < Tq;
  const size_t qo = (static_cast<size_t>(b) * Tq + (row_ok ? t : r0)) * ldq + static_cast<size_t>(h) * HD;
  const size_t so = (static_cast<size_t>(b) * NH + h) * Tq + (row_ok ? t : r0);
  const float L = lse[so], D = dsum[so];
  for (int e = r; e < nr; e += blockDim.x) {
    sQP[e] = qp[static_cast<size_t>(b) * Tq + r0 + e];
    sQD[e] = qdoc ? qdoc[static_cast<size_t>(b) * Tq + r0 + e] : 0;
  }
  __syncthreads();
  const flash::TileRange qrange = flash::tile_range(sQP, qdoc ? sQD : nullptr, nr);
  const int my_p = row_ok ? sQP[r] : 0, my_d = row_ok ? sQD[r] : 0;
  for (int d = 0; d < HD; ++d) sAcc[d * kBr + r] = 0.0f;
  unsigned long long skip = 0;
  const int nk = flash::num_tiles(Tk, kBc);
  for (int j = 0; j < nk; ++j) {
    const int c0 = j * kBc, nc = min(kBc, Tk - c0);
    const size_t ko = (static_cast<size_t>(b) * Tk + c0) * ldk + static_cast<size_t>(h / G) * HD;
    __syncthreads();
    for (int e = r; e < nc; e += blockDim.x) {
      sKP[e] = kp[static_cast<size_t>(b) * Tk + c0 + e];
      sKD[e] = kdoc ? kdoc[static_cast<size_t>(b) * Tk + c0 + e] : 0;
    }
    __syncthreads();
    if (flash::tile_pair_masked(qrange, flash::tile_range(sKP, kdoc ? sKD : nullptr, nc))) {
      ++skip;
      continue;
    }
    for (int e = r; e < kBc * HD; e += kBr) {
      const int c = e / HD, d = e % HD;
      sK[e] = c < nc ? math::ld(k[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
      sV[e] = c < nc ? math::ld(v[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
    }
    __syncthreads();
    float x[kBc], dp[kBc];
#pragma unroll
    for (int c = 0; c < kBc; ++c) x[c] = dp[c] = 0.0f;
    for (int d = 0; d < HD; ++d) {
      const float qd = math::ld(q[qo + d]), gd = math::ld(dy[qo + d]);
#pragma unroll
      for (int c = 0; c < kBc; ++c) {
        x[c] += qd * sK[c * HD + d];
        dp[c] += gd * sV[c * HD + d];
      }
    }
#pragma unroll
    for (int c = 0; c < kBc; ++c) {
      const bool ok = row_ok && c < nc && flash::visible(my_p, sKP[c], my_d, sKD[c]);
      const float p = ok ? flash::prob_from_lse(flash::score(x[c], scale), L) : 0.0f;
      x[c] = ok ? flash::dscore(p, dp[c], D, scale) : 0.0f;  // dS
    }
    for (int d = 0; d < HD; ++d) {
      float a = sAcc[d * kBr + r];
#pragma unroll
      for (int c = 0; c < kBc; ++c) a += x[c] * sK[c * HD + d];
      sAcc[d * kBr + r] = a;
    }
  }
  if (r == 0 && skip) atomicAdd(skipped, skip);
  if (!row_ok) return;
  for (int d = 0; d < HD; ++d) dq[qo + d] = math::st<T>(math::ld(dq[qo + d]) + sAcc[d * kBr + r]);
}

template <typename T>
__global__ void __launch_bounds__(kBc) block_backward_dkv_kernel(T* dk, T* dv, const T* dy, const T* q, const T* k,
                                                                 const T* v, const float* lse, const float* dsum,
                                                                 const int32_t* qp, const int32_t* kp,
                                                                 const int32_t* qdoc, const int32_t* kdoc, int Tq,
                                                                 int Tk, int NH, int NKV, int HD, float scale) {
  extern __shared__ float smem[];
  float* sQ = smem;                // [kBr][HD]
  float* sG = sQ + kBr * HD;       // [kBr][HD]  (dY)
  float* sdK = sG + kBr * HD;      // [HD][kBc]
  float* sdV = sdK + HD * kBc;     // [HD][kBc]
  float* sL = sdV + HD * kBc;      // [kBr]
  float* sD = sL + kBr;            // [kBr]
  __shared__ int sQP[kBr], sQD[kBr], sKP[kBc], sKD[kBc];
  const int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, c = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD, nq = flash::num_tiles(Tq, kBr);
  const int c0 = j * kBc, key = c0 + c, nc = min(kBc, Tk - c0);
  const bool key_ok = key < Tk;
  const size_t ko = (static_cast<size_t>(b) * Tk + (key_ok ? key : c0)) * ldk + static_cast<size_t>(kvh) * HD;
  for (int e = c; e < nc; e += blockDim.x) {
    sKP[e] = kp[static_cast<size_t>(b) * Tk + c0 + e];
    sKD[e] = kdoc ? kdoc[static_cast<size_t>(b) * Tk + c0 + e] : 0;
  }
  __syncthreads();
  const flash::TileRange krange = flash::tile_range(sKP, kdoc ? sKD : nullptr, nc);
  const int my_p = key_ok ? sKP[c] : 0, my_d = key_ok ? sKD[c] : 0;
  for (int d = 0; d < HD; ++d) sdK[d * kBc + c] = sdV[d * kBc + c] = 0.0f;
  for (int g = 0; g < G; ++g) {
    const int h = kvh * G + g;
    for (int i = 0; i < nq; ++i) {
      const int r0 = i * kBr, nr = min(kBr, Tq - r0);
      const size_t qo = (static_cast<size_t>(b) * Tq + r0) * ldq + static_cast<size_t>(h) * HD;
      const size_t so = (static_cast<size_t>(b) * NH + h) * Tq + r0;
      __syncthreads();
      for (int e = c; e < nr; e += blockDim.x) {
        sQP[e] = qp[static_cast<size_t>(b) * Tq + r0 + e];
        sQD[e] = qdoc ? qdoc[static_cast<size_t>(b) * Tq + r0 + e] : 0;
      }
      __syncthreads();
      if (flash::tile_pair_masked(flash::tile_range(sQP, qdoc ? sQD : nullptr, nr), krange)) continue;
      for (int e = c; e < kBr * HD; e += kBc) {
        const int rr = e / HD, d = e % HD;
        sQ[e] = rr < nr ? math::ld(q[qo + static_cast<size_t>(rr) * ldq + d]) : 0.0f;
        sG[e] = rr < nr ? math::ld(dy[qo + static_cast<size_t>(rr) * ldq + d]) : 0.0f;
      }
      for (int rr = c; rr < kBr; rr += kBc) {
        sL[rr] = rr < nr ? lse[so + rr] : 0.0f;
        sD[rr] = rr < nr ? dsum[so + rr] : 0.0f;
      }
      __syncthreads();
      float x[kBr], dp[kBr];
#pragma unroll
      for (int rr = 0; rr < kBr; ++rr) x[rr] = dp[rr] = 0.0f;
      for (int d = 0; d < HD; ++d) {
        const float kd = math::ld(k[ko + d]), vd = math::ld(v[ko + d]);
#pragma unroll
        for (int rr = 0; rr < kBr; ++rr) {
          x[rr] += sQ[rr * HD + d] * kd;
          dp[rr] += sG[rr * HD + d] * vd;
        }
      }
#pragma unroll
      for (int rr = 0; rr < kBr; ++rr) {
        const bool ok = key_ok && rr < nr && flash::visible(sQP[rr], my_p, sQD[rr], my_d);
        const float p = ok ? flash::prob_from_lse(flash::score(x[rr], scale), sL[rr]) : 0.0f;
        dp[rr] = ok ? flash::dscore(p, dp[rr], sD[rr], scale) : 0.0f;  // dS
        x[rr] = p;
      }
      for (int d = 0; d < HD; ++d) {
        float av = sdV[d * kBc + c], ak = sdK[d * kBc + c];
#pragma unroll
        for (int rr = 0; rr < kBr; ++rr) {
          av += x[rr] * sG[rr * HD + d];
          ak += dp[rr] * sQ[rr * HD + d];
        }
        sdV[d * kBc + c] = av;
        sdK[d * kBc + c] = ak;
      }
    }
  }
  if (!key_ok) return;
  for (int d = 0; d < HD; ++d) {
    dk[ko + d] = math::st<T>(math::ld(dk[ko + d]) + sdK[d * kBc + c]);
    dv[ko + d] = math::st<T>(math::ld(dv[ko + d]) + sdV[d * kBc + c]);
  }
}

// softmax_causal_forward_kernel with keys of other documents masked (doc [B, T], matrix r / T_ of
// rows r belongs to sequence r / T_ / NH). The diagonal is always visible, so sum >= 1.
template <typename T>
__global__ void softmax_causal_doc_forward_kernel(T* att, const int32_t* doc, size_t rows, int NH, int T_, float scale) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* row = att + r * T_;
    const int t = static_cast<int>(r % T_);
    const int32_t* db = doc + (r / T_ / NH) * T_;
    const int dt = db[t];
    float mx = -INFINITY;
    for (int s = threadIdx.x; s <= t; s += blockDim.x)
      if (db[s] == dt) mx = MaxOp{}(mx, __fmul_rn(math::ld(row[s]), scale));
    mx = block_reduce(mx, MaxOp{});
    float sum = 0;
    for (int s = threadIdx.x; s <= t; s += blockDim.x)
      if (db[s] == dt) sum += math::st_exp(__fmul_rn(math::ld(row[s]), scale) - mx);
    sum = block_reduce(sum, SumOp{});
    const float inv = 1.0f / sum;
    for (int s = threadIdx.x; s < T_; s += blockDim.x)
      row[s] = math::st<T>(s <= t && db[s] == dt ? math::st_exp(__fmul_rn(math::ld(row[s]), scale) - mx) * inv : 0.0f);
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
    T* v = x + rest * HD;
    const float c = math::ld(cs[t * half + j]), s = math::ld(sn[t * half + j]);
    const float x1 = math::ld(v[j]), x2 = math::ld(v[j + half]);
    float o1, o2;
    if (backward) math::rope_rotate_backward(x1, x2, c, s, &o1, &o2);
    else math::rope_rotate(x1, x2, c, s, &o1, &o2);
    v[j] = math::st<T>(o1);
    v[j + half] = math::st<T>(o2);
  }
}

// ---- context ----------------------------------------------------------------------------------

class CudaContextImpl final : public CudaContext {
 public:
  explicit CudaContextImpl(int dev) : device_(dev) {}
  ~CudaContextImpl() override {
    if (handle_) (void)cublasDestroy(handle_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  CudaContextImpl(const CudaContextImpl&) = delete;
  CudaContextImpl& operator=(const CudaContextImpl&) = delete;

  void init() {
    ST_CUDA(cudaSetDevice(device_));
    cudaDeviceProp prop{};
    ST_CUDA(cudaGetDeviceProperties(&prop, device_));
    name_ = prop.name;
    ST_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ST_CUBLAS(cublasCreate(&handle_));
    ST_CUBLAS(cublasSetStream(handle_, stream_));
    ST_CUBLAS(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
    // Math mode stays CUBLAS_DEFAULT_MATH: no TF32 (the GEMMs ask for CUBLAS_COMPUTE_32F).
  }

  int device() const override { return device_; }
  std::string device_name() const override { return name_; }
  void* stream() const override { return static_cast<void*>(stream_); }
  void* cublas() const override { return static_cast<void*>(handle_); }
  size_t free_bytes() const override {
    size_t free_b = 0, total_b = 0;
    ST_CUDA(cudaMemGetInfo(&free_b, &total_b));
    return free_b;
  }

 private:
  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
};

// ---- backend ----------------------------------------------------------------------------------

template <typename T> constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
  else return CUDA_R_16BF;
}

template <typename T> class CudaBackend final : public Backend<T> {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>, "CUDA backend: T = float or bf16");

 public:
  using S = math::Acc<T>;

  explicit CudaBackend(CudaContext& ctx)
      : stream_(static_cast<cudaStream_t>(ctx.stream())), handle_(static_cast<cublasHandle_t>(ctx.cublas())) {}
  ~CudaBackend() override {
    release(scratch_);
    release(loss_sum_);
    release(skip_);
    if (copy_stream_) {
      (void)cudaStreamSynchronize(copy_stream_);
      (void)cudaStreamDestroy(copy_stream_);
    }
    if (compute_done_) (void)cudaEventDestroy(compute_done_);
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const char* name() const override { return "cuda"; }

  // ---- memory ----
  T* alloc(size_t n) override { return static_cast<T*>(alloc_bytes(n * sizeof(T))); }
  void free(T* p) override { release(p); }
  void zero(T* p, size_t n) override {
    if (n) ST_CUDA(cudaMemsetAsync(p, 0, n * sizeof(T), stream_));
  }
  void copy(T* dst, const T* src, size_t n) override {
    if (n && dst != src) ST_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToDevice, stream_));
  }
  void to_host(T* host, const T* src, size_t n) override {
    if (!n) return;
    ST_CUDA(cudaMemcpyAsync(host, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    ST_CUDA(cudaStreamSynchronize(stream_));
  }
  void from_host(T* dst, const T* host, size_t n) override {
    if (!n) return;
    ST_CUDA(cudaMemcpyAsync(dst, host, n * sizeof(T), cudaMemcpyHostToDevice, stream_));
    ST_CUDA(cudaStreamSynchronize(stream_));  // the host buffer may be freed right after
  }
  int32_t* alloc_ids(size_t n) override { return static_cast<int32_t*>(alloc_bytes(n * sizeof(int32_t))); }
  void free_ids(int32_t* p) override { release(p); }
  void ids_from_host(int32_t* dst, const int32_t* host, size_t n) override {
    if (!n) return;
    ST_CUDA(cudaMemcpyAsync(dst, host, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    ST_CUDA(cudaStreamSynchronize(stream_));
  }
  S* alloc_acc(size_t n) override { return static_cast<S*>(alloc_bytes(n * sizeof(S))); }
  void free_acc(S* p) override { release(p); }
  void copy_2d(T* dst, size_t ldd, const T* src, size_t lds, size_t rows, size_t cols) override {
    if (rows && cols)
      ST_CUDA(cudaMemcpy2DAsync(dst, ldd * sizeof(T), src, lds * sizeof(T), cols * sizeof(T), rows,
                                cudaMemcpyDeviceToDevice, stream_));
  }
  void zero_acc(S* p, size_t n) override {
    if (n) ST_CUDA(cudaMemsetAsync(p, 0, n * sizeof(S), stream_));
  }
  void synchronize() override { ST_CUDA(cudaStreamSynchronize(stream_)); }

  // ---- staging to the host: pinned memory, the copy stream ----
  void* alloc_pinned_host(size_t bytes) override {
    void* p = nullptr;
    ST_CUDA_ALLOC(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault));
    return p;
  }
  void free_pinned_host(void* p) noexcept override {
    if (!p) return;
    cudaError_t e = copy_stream_ ? cudaStreamSynchronize(copy_stream_) : cudaSuccess;  // copies into p
    cudaError_t f = cudaFreeHost(p);
    if (e == cudaSuccess) e = f;
    if (e != cudaSuccess) warn_free(e);
  }
  // The copy stream (non-blocking: no implicit order with the legacy default stream) waits for an
  // event recorded on the compute stream now, so the copy reads what every call queued so far
  // wrote, and the compute stream goes on without waiting for the copy.
  void to_host_async(T* host, const T* src, size_t n) override {
    if (n == 0) return;
    if (!copy_stream_) {
      ST_CUDA(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
      ST_CUDA(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
    }
    ST_CUDA(cudaEventRecord(compute_done_, stream_));
    ST_CUDA(cudaStreamWaitEvent(copy_stream_, compute_done_, 0));
    ST_CUDA(cudaMemcpyAsync(host, src, n * sizeof(T), cudaMemcpyDeviceToHost, copy_stream_));
  }
  void wait_host_copies() override {
    if (copy_stream_) ST_CUDA(cudaStreamSynchronize(copy_stream_));
  }

  // ---- precision conversion ----
  void from_f32(T* dst, const float* src, size_t n) override {
    if (!n) return;
    from_f32_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(dst, src, n);
    ST_LAUNCHED("from_f32_kernel");
  }
  void add_to_f32(float* dst, float alpha, const T* src, size_t n) override {
    if (!n) return;
    add_to_f32_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(dst, alpha, src, n);
    ST_LAUNCHED("add_to_f32_kernel");
  }

  // ---- GEMM ----
  // Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T: swap the operands.
  void gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, const T* B, int ldb, S beta, T* C,
            int ldc) override {
    if (M == 0 || N == 0) return;
    if (K == 0) {
      scale_c(C, M, N, ldc, beta);
      return;
    }
    const float al = alpha, be = beta;
    ST_CUBLAS(cublasGemmEx(handle_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &al, B,
                           cuda_type<T>(), ldb, A, cuda_type<T>(), lda, &be, C, cuda_type<T>(), ldc, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT));
  }
  void gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, int64_t sa,
                            const T* B, int ldb, int64_t sb, S beta, T* C, int ldc, int64_t sc, int batch) override {
    if (M == 0 || N == 0 || batch <= 0) return;
    if (K == 0) {
      for (int i = 0; i < batch; ++i) scale_c(C + i * sc, M, N, ldc, beta);
      return;
    }
    const float al = alpha, be = beta;
    ST_CUBLAS(cublasGemmStridedBatchedEx(handle_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M,
                                         K, &al, B, cuda_type<T>(), ldb, static_cast<long long>(sb), A, cuda_type<T>(),
                                         lda, static_cast<long long>(sa), &be, C, cuda_type<T>(), ldc,
                                         static_cast<long long>(sc), batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  // ---- elementwise / reductions ----
  void axpy(size_t n, S alpha, const T* x, T* y) override {
    if (!n) return;
    axpy_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(n, alpha, x, y);
    ST_LAUNCHED("axpy_kernel");
  }
  void scale(size_t n, S alpha, T* x) override {
    if (!n) return;
    scale_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(n, alpha, x);
    ST_LAUNCHED("scale_kernel");
  }
  double sum_squares(const T* x, size_t n) override {
    if (!n) return 0.0;
    const unsigned blocks = std::min<unsigned>(grid_for(n, kBlock), kReduceBlocks);
    double* part = static_cast<double*>(scratch(sizeof(double) * (blocks + 1)));
    sum_squares_kernel<T><<<blocks, kBlock, 0, stream_>>>(x, n, part + 1);
    ST_LAUNCHED("sum_squares_kernel");
    return sum_to_host(part + 1, blocks, part);
  }
  // Each array reduced as sum_squares does (block partials, then one block sums them into its
  // slot), every sum copied back in one transfer, added on the host in order: one wait.
  double sum_squares_many(const T* const* x, const size_t* n, size_t k) override {
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
      sum_doubles_kernel<<<1, kRowBlockLarge, 0, stream_>>>(pi, blocks, sums + i);
      ST_LAUNCHED("sum_doubles_kernel");
    }
    std::vector<double> h(k);
    ST_CUDA(cudaMemcpyAsync(h.data(), sums, sizeof(double) * k, cudaMemcpyDeviceToHost, stream_));
    ST_CUDA(cudaStreamSynchronize(stream_));
    double s = 0;
    for (double v : h) s += v;
    return s;
  }

  void embedding_forward(T* out, const int32_t* tokens, const T* table, int N, int C) override {
    if (N <= 0 || C <= 0) return;
    embedding_forward_kernel<T><<<grid_rows(N), kBlock, 0, stream_>>>(out, tokens, table, N, C);
    ST_LAUNCHED("embedding_forward_kernel");
  }
  void embedding_backward(T* dtable, const int32_t* tokens, const T* dout, int N, int C) override {
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

  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) override {
    if (N <= 0 || C <= 0) return;
    rmsnorm_forward_kernel<T><<<grid_rows(N), kBlock, 0, stream_>>>(out, rstd, x, w, N, C, eps);
    ST_LAUNCHED("rmsnorm_forward_kernel");
  }
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) override {
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
    rmsnorm_backward_dx_kernel<T><<<grid_rows(N), kBlock, 0, stream_>>>(dx, dout, x, w, rstd, N, C);
    ST_LAUNCHED("rmsnorm_backward_dx_kernel");
  }

  void rope_forward(T* x, const T* cos, const T* sin, int B, int T_, int H, int HD) override {
    rope(x, cos, sin, B, T_, H, HD, false);
  }
  void rope_backward(T* dx, const T* cos, const T* sin, int B, int T_, int H, int HD) override {
    rope(dx, cos, sin, B, T_, H, HD, true);
  }

  void softmax_causal_forward(T* att, int R, int T_, S scale) override {
    const size_t rows = static_cast<size_t>(R) * T_;
    if (R <= 0 || T_ <= 0) return;
    const bool warp_rows = with_warp_row(T_, [&](auto k) {
      softmax_causal_forward_warp_kernel<T, decltype(k)::value>
          <<<grid_for(rows * 32, kBlock), kBlock, 0, stream_>>>(att, rows, T_, scale);
    });
    if (!warp_rows) softmax_causal_forward_kernel<T><<<grid_rows(rows), kBlock, 0, stream_>>>(att, rows, T_, scale);
    ST_LAUNCHED("softmax_causal_forward_kernel (warp or block per row)");
  }
  void softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) override {
    const size_t rows = static_cast<size_t>(R) * T_;
    if (R <= 0 || T_ <= 0) return;
    // One block per row at every length: on the H200 a warp-per-row version of this kernel (p and
    // datt in registers) took 7.35 ms per llama-125m step against this one's 6.46 (docs/benchmarks.md).
    softmax_causal_backward_kernel<T><<<grid_rows(rows), kBlock, 0, stream_>>>(datt, att, rows, T_, scale);
    ST_LAUNCHED("softmax_causal_backward_kernel");
  }

  // bf16: cuDNN's fused SDPA when SHARDTRAIN_CUDNN_ATTENTION allows it and cuDNN takes the shape
  // (cudnn_attention.h), else the tiled kernels below; float: always the tiled kernels.
  void flash_attention_forward(T* y, S* lse, const T* q, const T* k, const T* v, int B, int T_, int NH, int NKV,
                               int HD, S scale) override {
    if (B <= 0 || T_ <= 0 || NH <= 0 || HD <= 0) return;
    if constexpr (std::is_same_v<T, bf16>) {
      if (use_cudnn([&](std::string* why) {
            return cudnn().forward(y, lse, q, k, v, B, T_, NH, NKV, HD, scale, why);
          }))
        return;
    }
    const size_t smem = sizeof(float) * static_cast<size_t>(2 * kBc + kBr) * HD;
    allow_smem(flash_forward_kernel<T>, smem, HD);
    const dim3 grid(static_cast<unsigned>(flash::num_tiles(T_, kBr)), static_cast<unsigned>(NH), static_cast<unsigned>(B));
    flash_forward_kernel<T><<<grid, kBr, smem, stream_>>>(y, lse, q, k, v, T_, NH, NKV, HD, scale);
    ST_LAUNCHED("flash_forward_kernel");
  }
  void flash_attention_backward(T* dq, T* dk, T* dv, S* dsum, const T* dy, const T* q, const T* k, const T* v,
                                const T* y, const S* lse, int B, int T_, int NH, int NKV, int HD, S scale) override {
    if (B <= 0 || T_ <= 0 || NH <= 0 || HD <= 0) return;
    if constexpr (std::is_same_v<T, bf16>) {
      if (use_cudnn([&](std::string* why) {
            return cudnn().backward(dq, dk, dv, dy, q, k, v, y, lse, B, T_, NH, NKV, HD, scale, why);
          })) {
        if (!cudnn_->deterministic()) note_once("cuDNN attention: non-deterministic backward (not offered here, or "
                                                "SHARDTRAIN_CUDNN_DETERMINISTIC=0): runs may differ in the last bits");
        return;
      }
    }
    const size_t rows = static_cast<size_t>(B) * NH * T_;
    flash_dsum_kernel<T><<<grid_for(rows, kBlock), kBlock, 0, stream_>>>(dsum, dy, y, T_, NH, HD, rows);
    ST_LAUNCHED("flash_dsum_kernel");
    const size_t smem_q = sizeof(float) * static_cast<size_t>(2 * kBc + kBr) * HD;
    allow_smem(flash_backward_dq_kernel<T>, smem_q, HD);
    const dim3 grid_q(static_cast<unsigned>(flash::num_tiles(T_, kBr)), static_cast<unsigned>(NH), static_cast<unsigned>(B));
    flash_backward_dq_kernel<T><<<grid_q, kBr, smem_q, stream_>>>(dq, dy, q, k, v, lse, dsum, T_, NH, NKV, HD, scale);
    ST_LAUNCHED("flash_backward_dq_kernel");
    const size_t smem_kv = sizeof(float) * (static_cast<size_t>(2 * kBr + 2 * kBc) * HD + 2 * kBr);
    allow_smem(flash_backward_dkv_kernel<T>, smem_kv, HD);
    const dim3 grid_kv(static_cast<unsigned>(flash::num_tiles(T_, kBc)), static_cast<unsigned>(NKV), static_cast<unsigned>(B));
    flash_backward_dkv_kernel<T><<<grid_kv, kBc, smem_kv, stream_>>>(dk, dv, dy, q, k, v, lse, dsum, T_, NH, NKV, HD,
                                                                     scale);
    ST_LAUNCHED("flash_backward_dkv_kernel");
  }

  // ---- block attention (the block_* kernels) ----
  void attention_block_forward(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp, const int32_t* kp,
                               const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                               S scale) override {
    if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
    const size_t smem = sizeof(float) * static_cast<size_t>(2 * kBc + kBr) * HD;
    allow_smem(block_forward_kernel<T>, smem, HD);
    const dim3 grid(static_cast<unsigned>(flash::num_tiles(Tq, kBr)), static_cast<unsigned>(NH), static_cast<unsigned>(B));
    block_forward_kernel<T><<<grid, kBr, smem, stream_>>>(y, lse, q, k, v, qp, kp, qd, kd, Tq, std::max(Tk, 0), NH, NKV,
                                                          HD, scale, skip_counter());
    ST_LAUNCHED("block_forward_kernel");
    block_pairs_ += int64_t{B} * NH * flash::num_tiles(Tq, kBr) * (Tk > 0 ? flash::num_tiles(Tk, kBc) : 0);
  }
  void attention_merge(T* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) override {
    const size_t rows = static_cast<size_t>(B) * NH * Tq;
    if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
    block_merge_kernel<T, T><<<grid_for(rows, kBlock), kBlock, 0, stream_>>>(y, lse, yp, lsep, Tq, NH, HD, rows);
    ST_LAUNCHED("block_merge_kernel");
  }
  void attention_merge_acc(S* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) override {
    const size_t rows = static_cast<size_t>(B) * NH * Tq;
    if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
    block_merge_kernel<S, T><<<grid_for(rows, kBlock), kBlock, 0, stream_>>>(y, lse, yp, lsep, Tq, NH, HD, rows);
    ST_LAUNCHED("block_merge_kernel (attention_merge_acc)");
  }
  void attention_row_dot(S* dsum, const T* dy, const T* y, int B, int Tq, int NH, int HD) override {
    const size_t rows = static_cast<size_t>(B) * NH * Tq;
    if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
    flash_dsum_kernel<T><<<grid_for(rows, kBlock), kBlock, 0, stream_>>>(dsum, dy, y, Tq, NH, HD, rows);
    ST_LAUNCHED("flash_dsum_kernel (attention_row_dot)");
  }
  void attention_block_backward(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v, const S* lse,
                                const S* dsum, const int32_t* qp, const int32_t* kp, const int32_t* qd,
                                const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD, S scale) override {
    if (B <= 0 || Tq <= 0 || Tk <= 0 || NH <= 0 || HD <= 0) return;
    const size_t smem_q = sizeof(float) * static_cast<size_t>(2 * kBc + kBr) * HD;
    allow_smem(block_backward_dq_kernel<T>, smem_q, HD);
    const dim3 grid_q(static_cast<unsigned>(flash::num_tiles(Tq, kBr)), static_cast<unsigned>(NH), static_cast<unsigned>(B));
    block_backward_dq_kernel<T><<<grid_q, kBr, smem_q, stream_>>>(dq, dy, q, k, v, lse, dsum, qp, kp, qd, kd, Tq, Tk,
                                                                  NH, NKV, HD, scale, skip_counter());
    ST_LAUNCHED("block_backward_dq_kernel");
    const size_t smem_kv = sizeof(float) * (static_cast<size_t>(2 * kBr + 2 * kBc) * HD + 2 * kBr);
    allow_smem(block_backward_dkv_kernel<T>, smem_kv, HD);
    const dim3 grid_kv(static_cast<unsigned>(flash::num_tiles(Tk, kBc)), static_cast<unsigned>(NKV), static_cast<unsigned>(B));
    block_backward_dkv_kernel<T><<<grid_kv, kBc, smem_kv, stream_>>>(dk, dv, dy, q, k, v, lse, dsum, qp, kp, qd, kd,
                                                                     Tq, Tk, NH, NKV, HD, scale);
    ST_LAUNCHED("block_backward_dkv_kernel");
    block_pairs_ += int64_t{B} * NH * flash::num_tiles(Tq, kBr) * flash::num_tiles(Tk, kBc);
  }
  typename Backend<T>::BlockAttentionStats take_block_attention_stats() override {
    typename Backend<T>::BlockAttentionStats st;
    st.tile_pairs = block_pairs_;
    block_pairs_ = 0;
    if (skip_) {
      unsigned long long h = 0;
      ST_CUDA(cudaMemcpyAsync(&h, skip_, sizeof(h), cudaMemcpyDeviceToHost, stream_));
      ST_CUDA(cudaMemsetAsync(skip_, 0, sizeof(h), stream_));
      ST_CUDA(cudaStreamSynchronize(stream_));
      st.skipped = static_cast<int64_t>(h);
    }
    return st;
  }
  void softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S scale) override {
    const size_t rows = static_cast<size_t>(B) * NH * T_;
    if (B <= 0 || NH <= 0 || T_ <= 0) return;
    softmax_causal_doc_forward_kernel<T><<<grid_rows(rows), kBlock, 0, stream_>>>(att, doc, rows, NH, T_, scale);
    ST_LAUNCHED("softmax_causal_doc_forward_kernel");
  }
  void rope_forward_at(T* x, const T* cos, const T* sin, const int32_t* pos, int N, int H, int HD) override {
    rope_at(x, cos, sin, pos, N, H, HD, false);
  }
  void rope_backward_at(T* dx, const T* cos, const T* sin, const int32_t* pos, int N, int H, int HD) override {
    rope_at(dx, cos, sin, pos, N, H, HD, true);
  }

  void swiglu_forward(T* h, const T* gate, const T* up, size_t n) override {
    if (!n) return;
    swiglu_forward_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(h, gate, up, n);
    ST_LAUNCHED("swiglu_forward_kernel");
  }
  void swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up, size_t n) override {
    if (!n) return;
    swiglu_backward_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(dgate, dup, dh, gate, up, n);
    ST_LAUNCHED("swiglu_backward_kernel");
  }

  double cross_entropy(T* dlogits, const T* logits, const int32_t* targets, int N, int V, S grad_scale) override {
    if (N <= 0 || V <= 0) return 0.0;
    double* buf = static_cast<double*>(scratch(sizeof(double) * (static_cast<size_t>(N) + 1)));
    cross_entropy_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(dlogits, logits, targets, N, V, grad_scale,
                                                                          buf + 1);
    ST_LAUNCHED("cross_entropy_kernel");
    return sum_to_host(buf + 1, static_cast<size_t>(N), buf);
  }
  // The rows' losses summed on the device and added to loss_sum_ there: no host wait per chunk.
  void cross_entropy_sum(T* dlogits, const T* logits, const int32_t* targets, int N, int V, S grad_scale) override {
    if (N <= 0 || V <= 0) return;
    if (!loss_sum_) loss_sum_ = static_cast<double*>(alloc_bytes(sizeof(double)));  // zeroed
    double* buf = static_cast<double*>(scratch(sizeof(double) * static_cast<size_t>(N)));
    cross_entropy_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(dlogits, logits, targets, N, V, grad_scale,
                                                                          buf);
    ST_LAUNCHED("cross_entropy_kernel");
    sum_doubles_kernel<<<1, kRowBlockLarge, 0, stream_>>>(buf, static_cast<size_t>(N), loss_sum_, true);
    ST_LAUNCHED("sum_doubles_kernel (loss sum)");
  }
  double take_loss_sum() override {
    if (!loss_sum_) return 0.0;
    double h = 0;
    ST_CUDA(cudaMemcpyAsync(&h, loss_sum_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
    ST_CUDA(cudaMemsetAsync(loss_sum_, 0, sizeof(double), stream_));
    ST_CUDA(cudaStreamSynchronize(stream_));
    return h;
  }

  void vocab_ce_max(const T* logits, int N, int Vl, int valid, S* mx) override {
    if (N <= 0) return;
    vocab_ce_max_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(logits, N, Vl, valid, mx);
    ST_LAUNCHED("vocab_ce_max_kernel");
  }
  void vocab_ce_sum(const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0, const S* maxes, int G,
                    S* st) override {
    if (N <= 0) return;
    vocab_ce_sum_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(logits, targets, N, Vl, valid, v0, maxes, G, st);
    ST_LAUNCHED("vocab_ce_sum_kernel");
  }
  // The rows' losses summed on the device into loss_sum_, as cross_entropy_sum.
  void vocab_ce_finish(T* dlogits, const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0,
                       const S* maxes, int G, const S* st, S grad_scale) override {
    if (N <= 0) return;
    if (!loss_sum_) loss_sum_ = static_cast<double*>(alloc_bytes(sizeof(double)));  // zeroed
    double* buf = static_cast<double*>(scratch(sizeof(double) * static_cast<size_t>(N)));
    vocab_ce_finish_kernel<T><<<grid_rows(N), kRowBlockLarge, 0, stream_>>>(dlogits, logits, targets, N, Vl, valid, v0,
                                                                            maxes, G, st, grad_scale, buf);
    ST_LAUNCHED("vocab_ce_finish_kernel");
    sum_doubles_kernel<<<1, kRowBlockLarge, 0, stream_>>>(buf, static_cast<size_t>(N), loss_sum_, true);
    ST_LAUNCHED("sum_doubles_kernel (loss sum)");
  }

  void adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S grad_scale,
             int64_t step) override {
    if (!n) return;
    // Bias corrections as the CPU backend: pow in double, then rounded to S.
    const S bc1 = S(1) - static_cast<S>(std::pow(static_cast<double>(b1), static_cast<double>(step)));
    const S bc2 = S(1) - static_cast<S>(std::pow(static_cast<double>(b2), static_cast<double>(step)));
    adamw_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream_>>>(p, m, v, g, n, lr, b1, b2, eps, wd, grad_scale, bc1,
                                                                 bc2);
    ST_LAUNCHED("adamw_kernel");
  }

 private:
  cudaStream_t stream_;
  cublasHandle_t handle_;
  void* scratch_ = nullptr;  // reduction scratch, stream-ordered reuse across calls
  size_t scratch_bytes_ = 0;
  double* loss_sum_ = nullptr;  // cross_entropy_sum's device double
  unsigned long long* skip_ = nullptr;  // block attention: skipped tile pairs (device counter)
  int64_t block_pairs_ = 0;             // block attention: tile pairs launched (host count)
  std::unordered_map<const void*, size_t> static_smem_;  // allow_smem: each kernel's static shared memory
  cudaStream_t copy_stream_ = nullptr;  // to_host_async's, made at its first call
  cudaEvent_t compute_done_ = nullptr;  // recorded on stream_, waited for by copy_stream_
  bool warned_free_ = false;
  std::unique_ptr<cuda_detail::CudnnAttention> cudnn_;  // created at the first bf16 attention call
  std::set<std::string> noted_;                         // notes already printed

  cuda_detail::CudnnAttention& cudnn() {
    if (!cudnn_) cudnn_ = std::make_unique<cuda_detail::CudnnAttention>(stream_);
    return *cudnn_;
  }
  // Runs `try_cudnn(&why)` unless SHARDTRAIN_CUDNN_ATTENTION is off; true if cuDNN ran. When cuDNN
  // cannot: "require" throws the reason, "auto" prints it once and returns false (tiled kernels).
  template <typename F> bool use_cudnn(F&& try_cudnn) {
    const cuda_detail::CudnnUse use = cuda_detail::cudnn_attention_use();
    if (use == cuda_detail::CudnnUse::Off) return false;
    std::string why;
    if (try_cudnn(&why)) return true;
    if (use == cuda_detail::CudnnUse::Require)
      throw std::runtime_error("SHARDTRAIN_CUDNN_ATTENTION=require: " + why);
    note_once("cuDNN attention unavailable, using the tiled kernels: " + why);
    return false;
  }
  void note_once(const std::string& msg) {
    if (noted_.insert(msg).second) std::fprintf(stderr, "shardtrain: note: %s\n", msg.c_str());
  }

  // cudaMalloc + zero on the stream; synchronized so the memory is zero for any later user,
  // whatever stream it runs on.
  void* alloc_bytes(size_t bytes) {
    if (bytes == 0) bytes = 1;
    void* p = nullptr;
    ST_CUDA_ALLOC(cudaMalloc(&p, bytes));
    try {
      ST_CUDA(cudaMemsetAsync(p, 0, bytes, stream_));
      ST_CUDA(cudaStreamSynchronize(stream_));
    } catch (...) {
      (void)cudaFree(p);
      throw;
    }
    return p;
  }
  // Frees after the queued work that may use p has finished. Never throws (it runs in destructors
  // of Buffer); a failure is printed once per backend (a sticky device error is reported by the
  // next checked call anyway).
  void release(void* p) noexcept {
    if (!p) return;
    cudaError_t e = cudaStreamSynchronize(stream_);
    cudaError_t f = cudaFree(p);
    if (e == cudaSuccess) e = f;
    if (e != cudaSuccess) warn_free(e);
  }
  void warn_free(cudaError_t e) noexcept {
    (void)cudaGetLastError();
    if (!warned_free_) {
      warned_free_ = true;
      std::fprintf(stderr, "shardtrain: warning: CUDA free failed: %s\n", cudaGetErrorString(e));
    }
  }
  void* scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      release(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      size_t want = std::max<size_t>(bytes, 1 << 16);
      scratch_ = alloc_bytes(want);
      scratch_bytes_ = want;
    }
    return scratch_;
  }
  // Sums in[0..n) (device doubles) into *out (device) and returns it on the host.
  double sum_to_host(const double* in, size_t n, double* out) {
    sum_doubles_kernel<<<1, kRowBlockLarge, 0, stream_>>>(in, n, out);
    ST_LAUNCHED("sum_doubles_kernel");
    double h = 0;
    ST_CUDA(cudaMemcpyAsync(&h, out, sizeof(double), cudaMemcpyDeviceToHost, stream_));
    ST_CUDA(cudaStreamSynchronize(stream_));
    return h;
  }
  // Lets `kernel` use `bytes` of dynamic shared memory; beyond the device's limit (head dimension too
  // large) a runtime_error. A block may use 48 KiB of shared memory, static and dynamic together,
  // unless the kernel opts in to more (CUDA C++ Programming Guide, "Shared Memory"; the opt-in sets
  // the dynamic part). The block_* kernels add 1 KiB of static arrays to the flash kernels' dynamic
  // tiles: 48 KiB of tiles at head dim 64 made 49 KiB, and their launch failed (cudaErrorInvalidValue,
  // first run on an H200, 2026-12-04) until the static part was counted here. A kernel's static size
  // is asked once (static_smem_), not at every launch.
  template <typename K> void allow_smem(K* kernel, size_t bytes, int HD) {
    auto it = static_smem_.find(reinterpret_cast<const void*>(kernel));
    if (it == static_smem_.end()) {
      cudaFuncAttributes fa{};
      ST_CUDA(cudaFuncGetAttributes(&fa, kernel));
      it = static_smem_.emplace(reinterpret_cast<const void*>(kernel), fa.sharedSizeBytes).first;
    }
    const size_t static_bytes = it->second, total = bytes + static_bytes;
    if (total <= 48 * 1024) return;
    int dev = 0, limit = 0;
    ST_CUDA(cudaGetDevice(&dev));
    ST_CUDA(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (total > static_cast<size_t>(limit))
      throw std::runtime_error("flash attention: head dim " + std::to_string(HD) + " needs " + std::to_string(total) +
                               " bytes of shared memory per block (" + std::to_string(static_bytes) +
                               " static), the device allows " + std::to_string(limit));
    ST_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  void scale_c(T* C, int M, int N, int ldc, float beta) {
    if (beta == 1.0f) return;
    scale_matrix_kernel<T><<<grid_for(static_cast<size_t>(M) * N, kBlock), kBlock, 0, stream_>>>(C, M, N, ldc, beta);
    ST_LAUNCHED("scale_matrix_kernel");
  }
  void rope_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward) {
    const size_t pairs = static_cast<size_t>(N) * H * (HD / 2);
    if (N <= 0 || H <= 0 || HD < 2) return;
    rope_at_kernel<T><<<grid_for(pairs, kBlock), kBlock, 0, stream_>>>(x, cs, sn, pos, N, H, HD, backward);
    ST_LAUNCHED("rope_at_kernel");
  }
  // The device counter of skipped block-attention tile pairs (allocated zeroed on first use).
  unsigned long long* skip_counter() {
    if (!skip_) skip_ = static_cast<unsigned long long*>(alloc_bytes(sizeof(unsigned long long)));
    return skip_;
  }
  void rope(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
    const size_t pairs = static_cast<size_t>(B) * T_ * H * (HD / 2);
    if (B <= 0 || T_ <= 0 || H <= 0 || HD < 2) return;
    rope_kernel<T><<<grid_for(pairs, kBlock), kBlock, 0, stream_>>>(x, cs, sn, B, T_, H, HD, backward);
    ST_LAUNCHED("rope_kernel");
  }
};

}  // namespace

// ---- entry points (the plugin's table, plugin.cu) ---------------------------------------------

namespace cuda_impl {

int device_count(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = cudaGetErrorString(e);
    return 0;
  }
  if (n == 0 && why) *why = "cudaGetDeviceCount found no CUDA device";
  return n;
}

std::unique_ptr<CudaContext> create_context(int device) {
  auto ctx = std::make_unique<CudaContextImpl>(device);
  try {
    ctx->init();
  } catch (const std::exception& e) {
    throw std::runtime_error("CUDA device " + std::to_string(device) + ": " + e.what());
  }
  return ctx;
}

template <typename T> std::unique_ptr<Backend<T>> make_backend(CudaContext& ctx) {
  return std::make_unique<CudaBackend<T>>(ctx);
}
template std::unique_ptr<Backend<float>> make_backend<float>(CudaContext&);
template std::unique_ptr<Backend<bf16>> make_backend<bf16>(CudaContext&);

}  // namespace cuda_impl
}  // namespace shardtrain
