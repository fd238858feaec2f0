// Attention: the exact causal softmax (softmax_causal_*, with documents: softmax_causal_doc_forward),
// flash attention (flash_attention.h: the tiled kernels; for bf16 cuDNN's fused SDPA when allowed,
// cudnn_attention.h) and block attention at global positions (the block_* kernels, the merge, the
// row dot; for bf16 cuDNN's SDPA on the pair's pieces, attention_pieces.h): the members of
// CudaBackend<T> (cuda_backend.h) that attention.cu defines, with their kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "shardtrain/backend/attention_pieces.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/flash_attention.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"
#include "cudnn_attention.h"
#include "flash_tiles.cuh"

namespace shardtrain {
namespace {

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
  else if (T_ <= cuda_detail::kWarpRowMax) f(std::integral_constant<int, cuda_detail::kWarpRowMax / 32>{});
  else return false;
  return true;
}

// ---- flash attention (include/shardtrain/backend/flash_attention.h) -----------------------------------
// The causal tiled kernels: each is one call of a loop of flash_tiles.cuh (which describes their
// decomposition and shared memory) with the causal mask.

// Forward: y and lse, one block per (query tile, head, sequence).
template <typename T>
__global__ void __launch_bounds__(kBr) flash_forward_kernel(T* y, float* lse, const T* q, const T* k, const T* v,
                                                            int T_, int NH, int NKV, int HD, float scale) {
  attention_forward_tile<CausalQueryMask>({}, y, lse, q, k, v, T_, T_, NH, NKV, HD, scale, nullptr);
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

// Backward pass 1: dq of one query tile (block) and row (thread).
template <typename T>
__global__ void __launch_bounds__(kBr) flash_backward_dq_kernel(T* dq, const T* dy, const T* q, const T* k, const T* v,
                                                                const float* lse, const float* dsum, int T_, int NH,
                                                                int NKV, int HD, float scale) {
  attention_dq_tile<CausalQueryMask>({}, dq, dy, q, k, v, lse, dsum, T_, T_, NH, NKV, HD, scale, nullptr);
}

// Backward pass 2: dk, dv of one key tile (block) and key row (thread), over the G query heads of
// the group and the query tiles from the diagonal on.
template <typename T>
__global__ void __launch_bounds__(kBc) flash_backward_dkv_kernel(T* dk, T* dv, const T* dy, const T* q, const T* k,
                                                                 const T* v, const float* lse, const float* dsum,
                                                                 int T_, int NH, int NKV, int HD, float scale) {
  attention_dkv_tile<CausalKeyMask>({}, dk, dv, dy, q, k, v, lse, dsum, T_, T_, NH, NKV, HD, scale);
}

// ---- block attention at global positions (flash_attention.h, "Block attention") ----------------
// The loops of flash_tiles.cuh with the block's masks (BlockQueryMask, BlockKeyMask): positions (and
// documents) of the query tile and of each key tile staged in shared memory, the tile pair
// classified by flash::tile_pair_masked from them (the same decision in every thread of the block,
// so a masked pair is skipped by the whole block), visible() per pair; rows with no key get y = 0,
// lse = -inf; the backward adds (+=) into dq, dk, dv. Skipped pairs: thread 0 of each forward / dQ
// block adds its count to *skipped (one atomicAdd per block).
template <typename T>
__global__ void __launch_bounds__(kBr) block_forward_kernel(T* y, float* lse, const T* q, const T* k, const T* v,
                                                            const int32_t* qp, const int32_t* kp, const int32_t* qdoc,
                                                            const int32_t* kdoc, int Tq, int Tk, int NH, int NKV,
                                                            int HD, float scale, unsigned long long* skipped) {
  attention_forward_tile<BlockQueryMask>({qp, kp, qdoc, kdoc}, y, lse, q, k, v, Tq, Tk, NH, NKV, HD, scale, skipped);
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
  attention_dq_tile<BlockQueryMask>({qp, kp, qdoc, kdoc}, dq, dy, q, k, v, lse, dsum, Tq, Tk, NH, NKV, HD, scale,
                                    skipped);
}

template <typename T>
__global__ void __launch_bounds__(kBc) block_backward_dkv_kernel(T* dk, T* dv, const T* dy, const T* q, const T* k,
                                                                 const T* v, const float* lse, const float* dsum,
                                                                 const int32_t* qp, const int32_t* kp,
                                                                 const int32_t* qdoc, const int32_t* kdoc, int Tq,
                                                                 int Tk, int NH, int NKV, int HD, float scale) {
  attention_dkv_tile<BlockKeyMask>({qp, kp, qdoc, kdoc}, dk, dv, dy, q, k, v, lse, dsum, Tq, Tk, NH, NKV, HD, scale);
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

// p[0 .. n) = value (block attention's rows that see no key: lse = -inf).
template <typename S> __global__ void fill_kernel(S* p, S value, size_t n) {
  for (size_t i = gtid(); i < n; i += gstride()) p[i] = value;
}

}  // namespace

namespace cuda_detail {

template <typename T>
void CudaBackend<T>::softmax_causal_forward(T* att, int R, int T_, S scale) {
  const size_t rows = static_cast<size_t>(R) * T_;
  if (R <= 0 || T_ <= 0) return;
  const bool warp_rows = with_warp_row(T_, [&](auto k) {
    softmax_causal_forward_warp_kernel<T, decltype(k)::value>
        <<<grid_for(rows * 32, kBlock), kBlock, 0, stream_>>>(att, rows, T_, scale);
  });
  if (!warp_rows) softmax_causal_forward_kernel<T><<<grid_rows(rows), kBlock, 0, stream_>>>(att, rows, T_, scale);
  ST_LAUNCHED("softmax_causal_forward_kernel (warp or block per row)");
}
template <typename T>
void CudaBackend<T>::softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) {
  const size_t rows = static_cast<size_t>(R) * T_;
  if (R <= 0 || T_ <= 0) return;
  // One block per row at every length: on the H200 a warp-per-row version of this kernel (p and
  // datt in registers) took 7.35 ms per llama-125m step against this one's 6.46 (docs/benchmarks.md).
  softmax_causal_backward_kernel<T><<<grid_rows(rows), kBlock, 0, stream_>>>(datt, att, rows, T_, scale);
  ST_LAUNCHED("softmax_causal_backward_kernel");
}

template <typename T>
void CudaBackend<T>::softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S scale) {
  const size_t rows = static_cast<size_t>(B) * NH * T_;
  if (B <= 0 || NH <= 0 || T_ <= 0) return;
  softmax_causal_doc_forward_kernel<T><<<grid_rows(rows), kBlock, 0, stream_>>>(att, doc, rows, NH, T_, scale);
  ST_LAUNCHED("softmax_causal_doc_forward_kernel");
}

// bf16: cuDNN's fused SDPA when SHARDTRAIN_CUDNN_ATTENTION allows it and cuDNN takes the shape
// (cudnn_attention.h), else the tiled kernels below; float: always the tiled kernels.
template <typename T>
void CudaBackend<T>::flash_attention_forward(T* y, S* lse, const T* q, const T* k, const T* v, int B, int T_, int NH,
                                             int NKV, int HD, S scale) {
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
template <typename T>
void CudaBackend<T>::flash_attention_backward(T* dq, T* dk, T* dv, S* dsum, const T* dy, const T* q, const T* k,
                                              const T* v, const T* y, const S* lse, int B, int T_, int NH, int NKV,
                                              int HD, S scale) {
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
template <typename T>
void CudaBackend<T>::attention_block_forward(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp,
                                             const int32_t* kp, const int32_t* qd, const int32_t* kd, int B, int Tq,
                                             int Tk, int NH, int NKV, int HD, S scale) {
  if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
  // bf16: cuDNN's fused SDPA on the pieces of the pair (block_plan), when allowed; with documents only
  // under SHARDTRAIN_CUDNN_ATTENTION=require (cudnn_for_blocks).
  if (std::is_same_v<T, bf16> && cudnn_for_blocks(qd, kd) && Tk > 0 && use_cudnn([&](std::string* why) {
        return block_forward_cudnn(y, lse, q, k, v, qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, scale, why);
      })) {
    block_pairs_ += int64_t{B} * NH * flash::num_tiles(Tq, kBr) * flash::num_tiles(Tk, kBc);
    return;
  }
  const size_t smem = sizeof(float) * static_cast<size_t>(2 * kBc + kBr) * HD;
  allow_smem(block_forward_kernel<T>, smem, HD);
  const dim3 grid(static_cast<unsigned>(flash::num_tiles(Tq, kBr)), static_cast<unsigned>(NH), static_cast<unsigned>(B));
  block_forward_kernel<T><<<grid, kBr, smem, stream_>>>(y, lse, q, k, v, qp, kp, qd, kd, Tq, std::max(Tk, 0), NH, NKV,
                                                        HD, scale, skip_counter());
  ST_LAUNCHED("block_forward_kernel");
  block_pairs_ += int64_t{B} * NH * flash::num_tiles(Tq, kBr) * (Tk > 0 ? flash::num_tiles(Tk, kBc) : 0);
}
template <typename T>
void CudaBackend<T>::attention_merge(T* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) {
  const size_t rows = static_cast<size_t>(B) * NH * Tq;
  if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
  block_merge_kernel<T, T><<<grid_for(rows, kBlock), kBlock, 0, stream_>>>(y, lse, yp, lsep, Tq, NH, HD, rows);
  ST_LAUNCHED("block_merge_kernel");
}
template <typename T>
void CudaBackend<T>::attention_merge_acc(S* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) {
  const size_t rows = static_cast<size_t>(B) * NH * Tq;
  if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
  block_merge_kernel<S, T><<<grid_for(rows, kBlock), kBlock, 0, stream_>>>(y, lse, yp, lsep, Tq, NH, HD, rows);
  ST_LAUNCHED("block_merge_kernel (attention_merge_acc)");
}
template <typename T>
void CudaBackend<T>::attention_row_dot(S* dsum, const T* dy, const T* y, int B, int Tq, int NH, int HD) {
  const size_t rows = static_cast<size_t>(B) * NH * Tq;
  if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
  flash_dsum_kernel<T><<<grid_for(rows, kBlock), kBlock, 0, stream_>>>(dsum, dy, y, Tq, NH, HD, rows);
  ST_LAUNCHED("flash_dsum_kernel (attention_row_dot)");
}
template <typename T>
void CudaBackend<T>::attention_block_backward(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v,
                                              const T* y, const S* lse, const S* dsum, const int32_t* qp, const int32_t* kp,
                                              const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH,
                                              int NKV, int HD, S scale) {
  if (B <= 0 || Tq <= 0 || Tk <= 0 || NH <= 0 || HD <= 0) return;
  if (std::is_same_v<T, bf16> && cudnn_for_blocks(qd, kd) && y && use_cudnn([&](std::string* why) {
        return block_backward_cudnn(dq, dk, dv, dy, q, k, v, y, lse, qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, scale,
                                    why);
      })) {
    block_pairs_ += int64_t{B} * NH * flash::num_tiles(Tq, kBr) * flash::num_tiles(Tk, kBc);
    return;
  }
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
template <typename T>
typename Backend<T>::BlockAttentionStats CudaBackend<T>::take_block_attention_stats() {
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
  st.skipped += block_skipped_;
  block_skipped_ = 0;
  return st;
}

template <typename T>
CudnnAttention& CudaBackend<T>::cudnn() {
  if (!cudnn_) cudnn_ = std::make_unique<CudnnAttention>(stream_);
  return *cudnn_;
}

// Runs `try_cudnn(&why)` unless SHARDTRAIN_CUDNN_ATTENTION is off; true if cuDNN ran. When cuDNN
// cannot: "require" throws the reason, "auto" prints it once and returns false (tiled kernels).
template <typename T>
template <typename F>
bool CudaBackend<T>::use_cudnn(F&& try_cudnn) {
  const CudnnUse use = cudnn_attention_use();
  if (use == CudnnUse::Off) return false;
  std::string why;
  if (try_cudnn(&why)) return true;
  if (use == CudnnUse::Require)
    throw std::runtime_error("SHARDTRAIN_CUDNN_ATTENTION=require: " + why);
  note_once("cuDNN attention unavailable, using the tiled kernels: " + why);
  return false;
}

// Lets `kernel` use `bytes` of dynamic shared memory; beyond the device's limit (head dimension too
// large) a runtime_error. A block may use 48 KiB of shared memory, static and dynamic together,
// unless the kernel opts in to more (CUDA C++ Programming Guide, "Shared Memory"; the opt-in sets
// the dynamic part). The block_* kernels add 1 KiB of static arrays to the flash kernels' dynamic
// tiles: 48 KiB of tiles at head dim 64 made 49 KiB, and their launch failed (cudaErrorInvalidValue,
// first run on an H200, 2026-12-04) until the static part was counted here. A kernel's static size
// is asked once (static_smem_), not at every launch.
template <typename T>
template <typename K>
void CudaBackend<T>::allow_smem(K* kernel, size_t bytes, int HD) {
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

// ---- block attention through cuDNN (bf16) ----
// Which block pairs try cuDNN: without documents always (context parallelism's ring: a few pieces of
// fixed shapes); with documents only when SHARDTRAIN_CUDNN_ATTENTION=require. Packed documents give
// each step pieces of new lengths, each a cuDNN graph to build (milliseconds to seconds), and a host
// wait per layer: the tiled kernels are the default until a GPU run has measured that.
template <typename T> bool CudaBackend<T>::cudnn_for_blocks(const int32_t* qd, const int32_t* kd) const {
  if (!qd != !kd) return false;
  return !qd || cudnn_attention_use() == CudnnUse::Require;
}

// A block pair of more pieces than this keeps the tiled kernels: each piece is a call, and with
// many short documents each shape a new cuDNN graph (CudnnAttention keeps at most 256).
constexpr size_t kMaxBlockPieces = 16;

// The positions (and documents) are read back to the host (a wait for the queued work; context
// parallelism's block pairs are long enough that this costs little beside them) and cut into
// pieces: one plan for all B sequences when they share positions and documents, else one per
// sequence (packed documents differ between rows). Every piece's graph is prepared before any runs.
// *masked: the tile pairs the tiled kernels would have skipped (flash::tile_pair_masked, per
// sequence and head), so that the statistics read the same.
template <typename T>
bool CudaBackend<T>::block_plan(const int32_t* qp, const int32_t* kp, const int32_t* qd, const int32_t* kd,
                                const S* lse, int B, int Tq, int Tk, int NH, int NKV, int HD, S scale, bool backward,
                                std::vector<BlockGroup>* groups, int64_t* masked, std::string* why) {
  const size_t nq = static_cast<size_t>(B) * Tq, nk = static_cast<size_t>(B) * Tk;
  std::vector<int32_t> hq(nq), hk(nk), hqd(qd ? nq : 0), hkd(kd ? nk : 0);
  ST_CUDA(cudaMemcpyAsync(hq.data(), qp, nq * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  ST_CUDA(cudaMemcpyAsync(hk.data(), kp, nk * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  if (qd) ST_CUDA(cudaMemcpyAsync(hqd.data(), qd, nq * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  if (kd) ST_CUDA(cudaMemcpyAsync(hkd.data(), kd, nk * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));
  const bool shared = attn::same_rows(hq.data(), B, Tq) && attn::same_rows(hk.data(), B, Tk) &&
                      (!qd || (attn::same_rows(hqd.data(), B, Tq) && attn::same_rows(hkd.data(), B, Tk)));
  groups->clear();
  int64_t m = 0;
  for (int b0 = 0; b0 < (shared ? 1 : B); ++b0) {
    const int32_t* pq = hq.data() + static_cast<size_t>(b0) * Tq;
    const int32_t* pk = hk.data() + static_cast<size_t>(b0) * Tk;
    const int32_t* dq0 = qd ? hqd.data() + static_cast<size_t>(b0) * Tq : nullptr;
    const int32_t* dk0 = kd ? hkd.data() + static_cast<size_t>(b0) * Tk : nullptr;
    BlockGroup grp{b0, shared ? B : 1, attn::plan(attn::runs_of(pq, Tq, dq0), attn::runs_of(pk, Tk, dk0)), {}};
    if (grp.pieces.size() > kMaxBlockPieces) {  // many short documents: small calls of new shapes each
      *why = "block attention: more than " + std::to_string(kMaxBlockPieces) + " pieces in one block pair (many "
             "short documents)";
      return false;
    }
    for (const attn::Piece& p : grp.pieces) {
      // The alignment every head's and sequence's lse rows share, in (y, lse) and in a 16-byte aligned
      // scratch at the same row: the first row's address, the row offset, the head stride Tq and the
      // sequence stride NH Tq (in S), whichever is least aligned.
      const uintptr_t at = reinterpret_cast<uintptr_t>(lse + static_cast<size_t>(b0) * NH * Tq + p.q0) |
                           (static_cast<uintptr_t>(p.q0) * sizeof(S)) |
                           (NH > 1 ? static_cast<uintptr_t>(Tq) * sizeof(S) : 0) |
                           (grp.nb > 1 ? static_cast<uintptr_t>(NH) * Tq * sizeof(S) : 0);
      const int sa = at % 16 == 0 ? 16 : at % 8 == 0 ? 8 : 4;
      grp.stats_align.push_back(sa);
      if (!cudnn().prepare_piece(backward, grp.nb, Tq, Tk, p.nq, p.nk, p.causal, sa, NH, NKV, HD, scale, why))
        return false;
    }
    int64_t mb = 0;
    for (int t0 = 0; t0 < Tq; t0 += kBr) {
      const flash::TileRange qr = flash::tile_range(pq + t0, dq0 ? dq0 + t0 : nullptr, std::min(kBr, Tq - t0));
      for (int s0 = 0; s0 < Tk; s0 += kBc)
        mb += flash::tile_pair_masked(
                  qr, flash::tile_range(pk + s0, dk0 ? dk0 + s0 : nullptr, std::min(kBc, Tk - s0)))
                  ? 1
                  : 0;
    }
    m += mb * grp.nb;
    groups->push_back(std::move(grp));
  }
  *masked = m * NH;
  return true;
}

// Forward, per group of sequences: the pieces in layers of disjoint query rows (attn::layers); the
// first layer is written into (y, lse), each later one into scratch and merged (attention_merge) as
// the ring merges blocks. Rows a layer does not cover get y = 0, lse = -inf first (no key of the
// pair: the tiled kernel's result too).
template <typename T>
bool CudaBackend<T>::block_forward_cudnn(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp,
                                         const int32_t* kp, const int32_t* qd, const int32_t* kd, int B, int Tq,
                                         int Tk, int NH, int NKV, int HD, S scale, std::string* why) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return false;
  } else {
    std::vector<BlockGroup> groups;
    int64_t masked = 0;
    if (!block_plan(qp, kp, qd, kd, lse, B, Tq, Tk, NH, NKV, HD, scale, false, &groups, &masked, why)) return false;
    const size_t rq = static_cast<size_t>(NH) * HD, rk = static_cast<size_t>(NKV) * HD;
    for (const BlockGroup& grp : groups) {
      const size_t b0 = static_cast<size_t>(grp.b0);
      T* yg = y + b0 * Tq * rq;
      S* lg = lse + b0 * NH * Tq;
      const T *qg = q + b0 * Tq * rq, *kg = k + b0 * Tk * rk, *vg = v + b0 * Tk * rk;
      const size_t nq = static_cast<size_t>(grp.nb) * Tq * rq, ns = static_cast<size_t>(grp.nb) * NH * Tq;
      const std::vector<std::vector<int>> L = attn::layers(grp.pieces);
      T* yt = nullptr;
      S* lt = nullptr;
      if (L.size() > 1) {
        const size_t ybytes = (nq * sizeof(T) + 255) / 256 * 256;
        char* sc = static_cast<char*>(scratch(ybytes + ns * sizeof(S)));
        yt = reinterpret_cast<T*>(sc);
        lt = reinterpret_cast<S*>(sc + ybytes);
      }
      for (size_t i = 0; i < std::max<size_t>(L.size(), 1); ++i) {
        T* yo = i == 0 ? yg : yt;
        S* lo = i == 0 ? lg : lt;
        if (L.empty() || attn::rows_covered(grp.pieces, L[i]) < Tq) {
          zero(yo, nq);
          fill_kernel<S><<<grid_for(ns, kBlock), kBlock, 0, stream_>>>(lo, S(-INFINITY), ns);
          ST_LAUNCHED("fill_kernel (block attention lse)");
        }
        if (L.empty()) break;
        for (int j : L[i]) {
          const attn::Piece& p = grp.pieces[static_cast<size_t>(j)];
          if (!cudnn().piece_forward(yo + p.q0 * rq, lo + p.q0, qg + p.q0 * rq, kg + p.k0 * rk, vg + p.k0 * rk, grp.nb,
                                     Tq, Tk, p.nq, p.nk, p.causal, grp.stats_align[static_cast<size_t>(j)], NH, NKV,
                                     HD, scale, why))
            throw std::logic_error("block attention: cuDNN refused a piece it had prepared: " + *why);
        }
        if (i > 0) attention_merge(yg, lg, yt, lt, grp.nb, Tq, NH, HD);
      }
    }
    block_skipped_ += masked;
    return true;
  }
}

// Backward: cuDNN writes (=) a piece's dq, dk, dv rows into scratch from dy, the MERGED y and lse
// (it computes D = rowsum(dy o y) itself); they are added into dq, dk, dv sequence by sequence.
template <typename T>
bool CudaBackend<T>::block_backward_cudnn(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v,
                                          const T* y, const S* lse, const int32_t* qp, const int32_t* kp,
                                          const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH,
                                          int NKV, int HD, S scale, std::string* why) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return false;
  } else {
    std::vector<BlockGroup> groups;
    int64_t masked = 0;
    if (!block_plan(qp, kp, qd, kd, lse, B, Tq, Tk, NH, NKV, HD, scale, true, &groups, &masked, why)) return false;
    const size_t rq = static_cast<size_t>(NH) * HD, rk = static_cast<size_t>(NKV) * HD;
    const size_t nq = static_cast<size_t>(B) * Tq * rq, nk = static_cast<size_t>(B) * Tk * rk;
    const size_t aq = (nq * sizeof(T) + 255) / 256 * 256, ak = (nk * sizeof(T) + 255) / 256 * 256;
    char* sc = static_cast<char*>(scratch(aq + 2 * ak));
    T* dqs = reinterpret_cast<T*>(sc);
    T* dks = reinterpret_cast<T*>(sc + aq);
    T* dvs = reinterpret_cast<T*>(sc + aq + ak);
    bool ran = false;
    for (const BlockGroup& grp : groups)
      for (size_t i = 0; i < grp.pieces.size(); ++i) {
        const attn::Piece& p = grp.pieces[i];
        // Sequence grp.b0's row p.q0 (key row p.k0) in every [B*T, width] array.
        const size_t oq = (static_cast<size_t>(grp.b0) * Tq + p.q0) * rq,
                     ok = (static_cast<size_t>(grp.b0) * Tk + p.k0) * rk;
        const S* lp = lse + static_cast<size_t>(grp.b0) * NH * Tq + p.q0;
        if (!cudnn().piece_backward(dqs + oq, dks + ok, dvs + ok, dy + oq, q + oq, k + ok, v + ok, y + oq, lp, grp.nb,
                                    Tq, Tk, p.nq, p.nk, p.causal, grp.stats_align[i], NH, NKV, HD, scale, why))
          throw std::logic_error("block attention: cuDNN refused a piece it had prepared: " + *why);
        ran = true;
        for (int b = 0; b < grp.nb; ++b) {
          const size_t bq = static_cast<size_t>(b) * Tq * rq + oq, bk = static_cast<size_t>(b) * Tk * rk + ok;
          axpy(static_cast<size_t>(p.nq) * rq, S(1), dqs + bq, dq + bq);
          axpy(static_cast<size_t>(p.nk) * rk, S(1), dks + bk, dk + bk);
          axpy(static_cast<size_t>(p.nk) * rk, S(1), dvs + bk, dv + bk);
        }
      }
    if (ran && !cudnn_->deterministic())
      note_once("cuDNN attention: non-deterministic backward (not offered here, or SHARDTRAIN_CUDNN_DETERMINISTIC=0): "
                "runs may differ in the last bits");
    block_skipped_ += masked;
    return true;
  }
}

template <typename T>
unsigned long long* CudaBackend<T>::skip_counter() {
  if (!skip_) skip_ = static_cast<unsigned long long*>(alloc_bytes(sizeof(unsigned long long)));
  return skip_;
}

// This file's members of CudaBackend<T>, for both storage types.
#define ST_INSTANTIATE(T) \
  template void CudaBackend<T>::softmax_causal_forward(T*, int, int, math::Acc<T>); \
  template void CudaBackend<T>::softmax_causal_backward(T*, const T*, int, int, math::Acc<T>); \
  template void CudaBackend<T>::softmax_causal_doc_forward(T*, const int32_t*, int, int, int, math::Acc<T>); \
  template void CudaBackend<T>::flash_attention_forward(T*, math::Acc<T>*, const T*, const T*, const T*, int, int, \
                                                        int, int, int, math::Acc<T>); \
  template void CudaBackend<T>::flash_attention_backward(T*, T*, T*, math::Acc<T>*, const T*, const T*, const T*, \
                                                         const T*, const T*, const math::Acc<T>*, int, int, int, \
                                                         int, int, math::Acc<T>); \
  template void CudaBackend<T>::attention_block_forward(T*, math::Acc<T>*, const T*, const T*, const T*, \
                                                        const int32_t*, const int32_t*, const int32_t*, \
                                                        const int32_t*, int, int, int, int, int, int, math::Acc<T>); \
  template void CudaBackend<T>::attention_merge(T*, math::Acc<T>*, const T*, const math::Acc<T>*, int, int, int, \
                                                int); \
  template void CudaBackend<T>::attention_merge_acc(math::Acc<T>*, math::Acc<T>*, const T*, const math::Acc<T>*, \
                                                    int, int, int, int); \
  template void CudaBackend<T>::attention_row_dot(math::Acc<T>*, const T*, const T*, int, int, int, int); \
  template void CudaBackend<T>::attention_block_backward(T*, T*, T*, const T*, const T*, const T*, const T*, \
                                                         const T*, const math::Acc<T>*, const math::Acc<T>*, const int32_t*, \
                                                         const int32_t*, const int32_t*, const int32_t*, int, int, \
                                                         int, int, int, int, math::Acc<T>); \
  template typename Backend<T>::BlockAttentionStats CudaBackend<T>::take_block_attention_stats();
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
