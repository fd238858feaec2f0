// The tiled attention loops of the CUDA backend (flash_attention.h), written once over a mask:
// attention_forward_tile (forward), attention_dq_tile (backward pass 1) and attention_dkv_tile
// (backward pass 2). attention.cu instantiates each with the causal mask (the flash_* kernels) and
// with the block mask at global positions (the block_* kernels); each kernel is one call. Private
// to src/backend/cuda/ (device code, internal linkage: see cuda_common.cuh).
//
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
// floats; above 48 KiB the kernel is opted in to the device's larger limit. The block mask adds
// 1 KiB of static shared memory (the tiles' positions and documents).
//
// Machine code: each kernel compiles to the same instructions as when it was written out on its
// own (SASS compared for sm_80 and sm_90). nvcc's optimizer is sensitive to the shape of the code
// it inlines, hence a few rules the masks keep: no bool data members and no bool-returning hook
// that branches (a mask's bool flows through as an 8-bit value, adding instructions); a hook that
// stages and then sets members computes into locals first; the block mask's shared arrays are
// namespace-scope (not pointers in the mask); the loop bounds are int-valued hooks.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/flash_attention.h"
#include "shardtrain/backend/ops_math.h"

namespace shardtrain {
namespace {  // device code: internal linkage, as cuda_common.cuh

using flash::kBc;
using flash::kBr;

// Stages key rows [c0, c0 + nc) of k and v (offset ko = row c0, head's column; row stride ldk) in
// sK and sV as float, [kBc][HD], zero past nc; thread r of the block's kBr loads every kBr-th element.
template <typename T>
__device__ __forceinline__ void stage_kv_tile(float* sK, float* sV, const T* k, const T* v, size_t ko, int ldk, int nc,
                                              int HD, int r) {
  for (int e = r; e < kBc * HD; e += kBr) {
    const int c = e / HD, d = e % HD;
    sK[e] = c < nc ? math::ld(k[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
    sV[e] = c < nc ? math::ld(v[ko + static_cast<size_t>(c) * ldk + d]) : 0.0f;
  }
}

// ---- masks ------------------------------------------------------------------------------------
// A query mask serves the forward and dQ loops (thread r owns query row t = r0 + r of the block's
// query tile), a key mask the dK/dV loop (thread c owns key row key = c0 + c of the block's key
// tile). A loop makes its mask from the kernel's Mask::Args and calls, in this order:
//   rows(Tq, r0, t) / cols(Tk, c0, key)   the block's query / key tile (arithmetic only)
//   begin(...)       once, before the loop (every thread; may stage and __syncthreads)
//   last_key_tile() / first_query_tile(c0)   the tiles the loop visits, in order
//   skip_key_tile(...) / skip_query_tile(...)   per tile, after the barrier that ends the previous
//                    one (every thread; the same answer in the whole block): true skips the pair
//   in_tile(...) && visible(...)   per (query, key) pair of a visited tile: in_tile says the pair
//                    exists (row and column inside the data), visible is asked only then
//   visible_again(c, c0, ok)   the forward's second use of pair c's visibility ok
//   finish_inv(l), finish_lse(m, l)   the end of a forward row
// kAdd: the gradients are added to (+=) rather than written (=).

// Causal (flash_attention.h): query t sees key s iff s <= t; the key tiles up to the one holding
// the query tile's last row (the diagonal), none skipped; dq written.
struct CausalQueryMask {
  struct Args {};
  static constexpr bool kAdd = false;
  int t = 0, last_row = 0;  // this thread's query row; the query tile's last row
  __device__ __forceinline__ explicit CausalQueryMask(Args) {}
  __device__ __forceinline__ void rows(int Tq, int r0, int t_) {
    t = t_;
    last_row = min(Tq, r0 + kBr) - 1;
  }
  __device__ __forceinline__ void begin(int /*b*/, int /*Tq*/, int /*Tk*/, int /*r0*/, int /*r*/, bool /*row_ok*/) {}
  __device__ __forceinline__ int last_key_tile() const { return last_row / kBc; }
  __device__ __forceinline__ int key_tile_rows(int c0, int /*Tk*/) const { return min(kBc, last_row + 1 - c0); }
  __device__ __forceinline__ bool skip_key_tile(int /*b*/, int /*Tk*/, int /*c0*/, int /*nc*/, int /*r*/) const {
    return false;
  }
  __device__ __forceinline__ bool in_tile(int /*c*/, int /*nc*/, bool /*row_ok*/) const { return true; }
  __device__ __forceinline__ bool visible(int c, int c0) const { return c <= t - c0; }
  __device__ __forceinline__ bool visible_again(int c, int c0, bool /*ok*/) const { return c <= t - c0; }
  __device__ __forceinline__ float finish_inv(float l) const { return flash::finish_inv(l); }
  __device__ __forceinline__ float finish_lse(float m, float l) const { return flash::finish_lse(m, l); }
};

// Causal, dK/dV: the query tiles from the one holding the key tile's first key (the diagonal) on,
// none skipped; query r0 + rr sees this thread's key iff key <= r0 + rr; dk, dv written.
struct CausalKeyMask {
  struct Args {};
  static constexpr bool kAdd = false;
  int key = 0;  // this thread's key row
  __device__ __forceinline__ explicit CausalKeyMask(Args) {}
  __device__ __forceinline__ void cols(int /*Tk*/, int /*c0*/, int key_) { key = key_; }
  __device__ __forceinline__ void begin(int /*b*/, int /*Tk*/, int /*c0*/, int /*c*/, bool /*key_ok*/) {}
  __device__ __forceinline__ int first_query_tile(int c0) const { return c0 / kBr; }
  __device__ __forceinline__ bool skip_query_tile(int /*b*/, int /*Tq*/, int /*r0*/, int /*nr*/, int /*c*/) const {
    return false;
  }
  __device__ __forceinline__ bool in_tile(int rr, int nr, bool /*key_ok*/) const { return rr < nr; }
  __device__ __forceinline__ bool visible(int rr, int r0) const { return key <= r0 + rr; }
};

// Block attention (flash_attention.h, "Block attention"): the positions, and the document ids where
// given, of the query block (qp, qdoc: [B, Tq]) and of the key block (kp, kdoc: [B, Tk]); qdoc and
// kdoc are both nullptr or neither.
struct BlockArgs {
  const int32_t *qp, *kp, *qdoc, *kdoc;
};
// The block masks' tiles of positions and documents (0 without documents), staged from BlockArgs:
// the query tile's (kBr) and the key tile's (kBc). Each kernel that uses them has its own.
__shared__ int sQP[kBr], sQD[kBr], sKP[kBc], sKD[kBc];

// Block attention, forward and dQ: every key tile of the block, a tile pair skipped when
// flash::tile_pair_masked (the loop counts it), flash::visible per pair; a row that saw no key ends
// with y = 0, lse = -inf; dq added.
struct BlockQueryMask {
  using Args = BlockArgs;
  static constexpr bool kAdd = true;
  BlockArgs a;
  flash::TileRange qrange{};  // the query tile's positions and documents
  int nr = 0, my_p = 0, my_d = 0, nk = 0;  // query tile rows; this thread's position, document; key tiles
  __device__ __forceinline__ explicit BlockQueryMask(const BlockArgs& args) : a(args) {}
  __device__ __forceinline__ void rows(int Tq, int r0, int /*t*/) { nr = min(kBr, Tq - r0); }
  __device__ __forceinline__ void begin(int b, int Tq, int Tk, int r0, int r, bool row_ok) {
    const int32_t *qp = a.qp, *qdoc = a.qdoc;
    const int n = nr;
    for (int e = r; e < n; e += blockDim.x) {
      sQP[e] = qp[static_cast<size_t>(b) * Tq + r0 + e];
      sQD[e] = qdoc ? qdoc[static_cast<size_t>(b) * Tq + r0 + e] : 0;
    }
    __syncthreads();
    const flash::TileRange range = flash::tile_range(sQP, qdoc ? sQD : nullptr, n);
    const int p = row_ok ? sQP[r] : 0, d = row_ok ? sQD[r] : 0;
    qrange = range;
    my_p = p;
    my_d = d;
    nk = flash::num_tiles(Tk, kBc);
  }
  __device__ __forceinline__ int last_key_tile() const { return nk - 1; }
  __device__ __forceinline__ int key_tile_rows(int c0, int Tk) const { return min(kBc, Tk - c0); }
  __device__ __forceinline__ bool skip_key_tile(int b, int Tk, int c0, int nc, int r) const {
    const int32_t *kp = a.kp, *kdoc = a.kdoc;
    for (int e = r; e < nc; e += blockDim.x) {
      sKP[e] = kp[static_cast<size_t>(b) * Tk + c0 + e];
      sKD[e] = kdoc ? kdoc[static_cast<size_t>(b) * Tk + c0 + e] : 0;
    }
    __syncthreads();
    return flash::tile_pair_masked(qrange, flash::tile_range(sKP, kdoc ? sKD : nullptr, nc));
  }
  __device__ __forceinline__ bool in_tile(int c, int nc, bool row_ok) const { return row_ok && c < nc; }
  __device__ __forceinline__ bool visible(int c, int /*c0*/) const {
    return flash::visible(my_p, sKP[c], my_d, sKD[c]);
  }
  __device__ __forceinline__ bool visible_again(int /*c*/, int /*c0*/, bool ok) const { return ok; }
  __device__ __forceinline__ float finish_inv(float l) const { return flash::block_finish_inv(l); }
  __device__ __forceinline__ float finish_lse(float m, float l) const { return flash::block_finish_lse(m, l); }
};

// Block attention, dK/dV: every query tile of the block, a pair skipped when flash::tile_pair_masked
// (not counted: the forward counts it), flash::visible per pair; dk, dv added.
struct BlockKeyMask {
  using Args = BlockArgs;
  static constexpr bool kAdd = true;
  BlockArgs a;
  flash::TileRange krange{};  // the key tile's positions and documents
  int nc = 0, my_p = 0, my_d = 0;  // key tile rows; this thread's key position and document
  __device__ __forceinline__ explicit BlockKeyMask(const BlockArgs& args) : a(args) {}
  __device__ __forceinline__ void cols(int Tk, int c0, int /*key*/) { nc = min(kBc, Tk - c0); }
  __device__ __forceinline__ void begin(int b, int Tk, int c0, int c, bool key_ok) {
    const int32_t *kp = a.kp, *kdoc = a.kdoc;
    const int n = nc;
    for (int e = c; e < n; e += blockDim.x) {
      sKP[e] = kp[static_cast<size_t>(b) * Tk + c0 + e];
      sKD[e] = kdoc ? kdoc[static_cast<size_t>(b) * Tk + c0 + e] : 0;
    }
    __syncthreads();
    const flash::TileRange range = flash::tile_range(sKP, kdoc ? sKD : nullptr, n);
    const int p = key_ok ? sKP[c] : 0, d = key_ok ? sKD[c] : 0;
    krange = range;
    my_p = p;
    my_d = d;
  }
  __device__ __forceinline__ int first_query_tile(int /*c0*/) const { return 0; }
  __device__ __forceinline__ bool skip_query_tile(int b, int Tq, int r0, int nr, int c) const {
    const int32_t *qp = a.qp, *qdoc = a.qdoc;
    for (int e = c; e < nr; e += blockDim.x) {
      sQP[e] = qp[static_cast<size_t>(b) * Tq + r0 + e];
      sQD[e] = qdoc ? qdoc[static_cast<size_t>(b) * Tq + r0 + e] : 0;
    }
    __syncthreads();
    return flash::tile_pair_masked(flash::tile_range(sQP, qdoc ? sQD : nullptr, nr), krange);
  }
  __device__ __forceinline__ bool in_tile(int rr, int nr, bool key_ok) const { return key_ok && rr < nr; }
  __device__ __forceinline__ bool visible(int rr, int /*r0*/) const {
    return flash::visible(sQP[rr], my_p, sQD[rr], my_d);
  }
};

// ---- the loops --------------------------------------------------------------------------------

// Forward (Algorithm 1) of one query tile under Mask: block (i, h, b), thread r owns row r0 + r;
// y and lse of the tile's rows (Tq query rows and Tk key rows per sequence). skipped: where the
// block adds the number of key tiles Mask skipped (thread 0, one atomicAdd; never for the causal).
template <typename Mask, typename T>
__device__ __forceinline__ void attention_forward_tile(typename Mask::Args margs, T* y, float* lse, const T* q,
                                                       const T* k, const T* v, int Tq, int Tk, int NH, int NKV, int HD,
                                                       float scale, unsigned long long* skipped) {
  extern __shared__ float smem[];
  float* sK = smem;              // [kBc][HD]
  float* sV = sK + kBc * HD;     // [kBc][HD]
  float* sAcc = sV + kBc * HD;   // [HD][kBr]
  Mask mask(margs);
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, r = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD;
  const int r0 = i * kBr, t = r0 + r;
  mask.rows(Tq, r0, t);
  const bool row_ok = t < Tq;
  const T* qr = q + (static_cast<size_t>(b) * Tq + (row_ok ? t : r0)) * ldq + static_cast<size_t>(h) * HD;
  mask.begin(b, Tq, Tk, r0, r, row_ok);
  for (int d = 0; d < HD; ++d) sAcc[d * kBr + r] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  unsigned long long skip = 0;  // key tiles skipped
  for (int j = 0; j <= mask.last_key_tile(); ++j) {
    const int c0 = j * kBc, nc = mask.key_tile_rows(c0, Tk);
    const size_t ko = (static_cast<size_t>(b) * Tk + c0) * ldk + static_cast<size_t>(h / G) * HD;
    __syncthreads();  // every thread is done with the previous tile
    if (mask.skip_key_tile(b, Tk, c0, nc, r)) {
      ++skip;
      continue;
    }
    stage_kv_tile(sK, sV, k, v, ko, ldk, nc, HD, r);
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
      ok[c] = mask.in_tile(c, nc, row_ok) && mask.visible(c, c0);
      x[c] = ok[c] ? flash::score(x[c], scale) : -INFINITY;
      mx = x[c] > mx ? x[c] : mx;
    }
    const float m_new = flash::online_max(m, mx), alpha = flash::online_rescale(m, m_new);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kBc; ++c) {
      x[c] = mask.visible_again(c, c0, ok[c]) ? flash::prob(x[c], m_new) : 0.0f;
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
  const float inv = mask.finish_inv(l);
  T* yr = y + (static_cast<size_t>(b) * Tq + t) * ldq + static_cast<size_t>(h) * HD;
  for (int d = 0; d < HD; ++d) yr[d] = math::st<T>(sAcc[d * kBr + r] * inv);
  lse[(static_cast<size_t>(b) * NH + h) * Tq + t] = mask.finish_lse(m, l);
}

// Backward pass 1 under Mask: dq of one query tile (block) and row (thread), from the forward's lse
// and dsum (flash_attention.h); skipped as in attention_forward_tile.
template <typename Mask, typename T>
__device__ __forceinline__ void attention_dq_tile(typename Mask::Args margs, T* dq, const T* dy, const T* q, const T* k,
                                                  const T* v, const float* lse, const float* dsum, int Tq, int Tk,
                                                  int NH, int NKV, int HD, float scale, unsigned long long* skipped) {
  extern __shared__ float smem[];
  float* sK = smem;              // [kBc][HD]
  float* sV = sK + kBc * HD;     // [kBc][HD]
  float* sAcc = sV + kBc * HD;   // [HD][kBr]
  Mask mask(margs);
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, r = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD;
  const int r0 = i * kBr, t = r0 + r;
  mask.rows(Tq, r0, t);
  const bool row_ok = t < Tq;
  const size_t qo = (static_cast<size_t>(b) * Tq + (row_ok ? t : r0)) * ldq + static_cast<size_t>(h) * HD;
  const size_t so = (static_cast<size_t>(b) * NH + h) * Tq + (row_ok ? t : r0);
  const float L = lse[so], D = dsum[so];
  mask.begin(b, Tq, Tk, r0, r, row_ok);
  for (int d = 0; d < HD; ++d) sAcc[d * kBr + r] = 0.0f;
  unsigned long long skip = 0;  // key tiles skipped
  for (int j = 0; j <= mask.last_key_tile(); ++j) {
    const int c0 = j * kBc, nc = mask.key_tile_rows(c0, Tk);
    const size_t ko = (static_cast<size_t>(b) * Tk + c0) * ldk + static_cast<size_t>(h / G) * HD;
    __syncthreads();
    if (mask.skip_key_tile(b, Tk, c0, nc, r)) {
      ++skip;
      continue;
    }
    stage_kv_tile(sK, sV, k, v, ko, ldk, nc, HD, r);
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
      const bool ok = mask.in_tile(c, nc, row_ok) && mask.visible(c, c0);
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
  for (int d = 0; d < HD; ++d) {
    if constexpr (Mask::kAdd) dq[qo + d] = math::st<T>(math::ld(dq[qo + d]) + sAcc[d * kBr + r]);
    else dq[qo + d] = math::st<T>(sAcc[d * kBr + r]);
  }
}

// Backward pass 2 under Mask: dk, dv of one key tile (block (j, kvh, b)) and key row (thread c),
// over the G query heads of the group and the query tiles that Mask visits.
template <typename Mask, typename T>
__device__ __forceinline__ void attention_dkv_tile(typename Mask::Args margs, T* dk, T* dv, const T* dy, const T* q,
                                                   const T* k, const T* v, const float* lse, const float* dsum, int Tq,
                                                   int Tk, int NH, int NKV, int HD, float scale) {
  extern __shared__ float smem[];
  float* sQ = smem;                // [kBr][HD]
  float* sG = sQ + kBr * HD;       // [kBr][HD]  (dY)
  float* sdK = sG + kBr * HD;      // [HD][kBc]
  float* sdV = sdK + HD * kBc;     // [HD][kBc]
  float* sL = sdV + HD * kBc;      // [kBr]
  float* sD = sL + kBr;            // [kBr]
  Mask mask(margs);
  const int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, c = threadIdx.x;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD, nq = flash::num_tiles(Tq, kBr);
  const int c0 = j * kBc, key = c0 + c;
  mask.cols(Tk, c0, key);
  const bool key_ok = key < Tk;
  const size_t ko = (static_cast<size_t>(b) * Tk + (key_ok ? key : c0)) * ldk + static_cast<size_t>(kvh) * HD;
  mask.begin(b, Tk, c0, c, key_ok);
  for (int d = 0; d < HD; ++d) sdK[d * kBc + c] = sdV[d * kBc + c] = 0.0f;
  for (int g = 0; g < G; ++g) {
    const int h = kvh * G + g;
    for (int i = mask.first_query_tile(c0); i < nq; ++i) {
      const int r0 = i * kBr, nr = min(kBr, Tq - r0);
      const size_t qo = (static_cast<size_t>(b) * Tq + r0) * ldq + static_cast<size_t>(h) * HD;
      const size_t so = (static_cast<size_t>(b) * NH + h) * Tq + r0;
      __syncthreads();
      if (mask.skip_query_tile(b, Tq, r0, nr, c)) continue;
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
        const bool ok = mask.in_tile(rr, nr, key_ok) && mask.visible(rr, r0);
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
    if constexpr (Mask::kAdd) {
      dk[ko + d] = math::st<T>(math::ld(dk[ko + d]) + sdK[d * kBc + c]);
      dv[ko + d] = math::st<T>(math::ld(dv[ko + d]) + sdV[d * kBc + c]);
    } else {
      dk[ko + d] = math::st<T>(sdK[d * kBc + c]);
      dv[ko + d] = math::st<T>(sdV[d * kBc + c]);
    }
  }
}

}  // namespace
}  // namespace shardtrain
