// ContextParallelOps<C> (shard layer, beside TensorParallelOps): the interface through which the
// model runs self-attention when context parallelism splits every sequence over a CP group. The
// implementation on the CP group's communicator, CpAttention (ring or all-gather of K/V), is the
// parallel layer's (context_parallel.h), which the model never includes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shardtrain/backend/bf16.h"  // math::Acc

namespace shardtrain {

// ---- Context parallelism ------------------------------------------------------------------------
//
// What the model needs from context parallelism (Ring Attention, Liu et al. 2023; Llama 3's
// all-gather of K/V, its paper section 3.3.2), in its compute type C: attention of this rank's query
// rows against the keys of the whole sequence, most of which other ranks of the CP group of size()
// ranks hold. Every rank of the group makes the same calls in the same order with the same sizes
// (the calls communicate). Buffers are backend memory (the Backend<C> the implementation was made
// with: host memory on the CPU).
//
// The split (context_parallel.h: cp_rows, cp_positions): each of the B sequences of the micro-batch
// (T tokens) is cut into 2·cp chunks of T/(2·cp) tokens; rank r holds chunks r and 2·cp−1−r, in that
// order, Tl = T/cp rows per sequence ("head-tail", so that every rank has the same causal work).
// The implementation reads only the positions and document ids, never the chunk arithmetic: any
// assignment of rows to ranks works if every rank holds Tl rows of each sequence and the positions
// say which (the head-tail split is what balances the work).
//
// Shapes and layout (row-major, GQA as Backend::flash_attention_forward: query head h reads
// key/value head h / (NH/NKV), NH a multiple of NKV):
//   q, y, dq, dy  [B, Tl, NH*HD]   (this rank's rows of every sequence, after RoPE)
//   k, v, dk, dv  [B, Tl, NKV*HD]
//   lse           [B, NH, Tl]      arithmetic type S (float for float and bf16, double for double),
//                                  as the tiled path's: lse = log sum_{visible s} exp(scale q_t.k_s)
//   pos           [B, Tl]  int32, backend memory (Backend::alloc_ids): every row's position in its
//                          sequence (global; positions that restart per document are allowed)
//   doc           [B, Tl]  int32, backend memory, document ids, or nullptr (causal only)
// Query t sees key s iff pos[s] <= pos[t] and (doc given) doc[t] == doc[s] (flash_attention.h,
// "Block attention at global positions"): the same attention as the whole sequence's, every row
// seeing at least its own key. scale multiplies the scores (1/sqrt(HD) in the model).
// Errors: std::invalid_argument for sizes out of range (before anything is sent; every rank passes
// the same sizes, so every rank throws); a failed transfer as the communicator reports it (a dead
// peer: its collective watchdog ends the rank).
template <typename C> class ContextParallelOps {
 public:
  using S = math::Acc<C>;
  virtual ~ContextParallelOps() = default;
  virtual int size() const = 0;  // cp, the CP degree
  virtual int rank() const = 0;  // this rank's index in the CP group, in [0, cp)
  // Writes (=) y and lse of this rank's rows: attention over the keys of every rank of the group.
  // Inputs are not modified; outputs must not alias inputs.
  virtual void forward(C* y, S* lse, const C* q, const C* k, const C* v, const int32_t* pos, const int32_t* doc,
                       int B, int Tl, int NH, int NKV, int HD, S scale) = 0;
  // Backward (FlashAttention-2's Algorithm 2 per block pair, with the MERGED y and lse of forward):
  // given dy, writes (=) dq of this rank's rows and dk, dv of THIS rank's keys and values, summed
  // over the queries of every rank (the contributions of other ranks' queries come back to the
  // owner). Same inputs as forward, plus y, lse from it. Outputs must not alias inputs.
  virtual void backward(C* dq, C* dk, C* dv, const C* dy, const C* q, const C* k, const C* v, const C* y,
                        const S* lse, const int32_t* pos, const int32_t* doc, int B, int Tl, int NH, int NKV,
                        int HD, S scale) = 0;
  // Sums n doubles of host memory in place over the group: statistics of whole sequences that each
  // rank holds a part of (a mixture-of-experts model's load-balancing counts and probability sums
  // per sequence, model.h). Collective; n the same on every rank.
  virtual void sum_host(double* buf, size_t n) = 0;
};

}  // namespace shardtrain
