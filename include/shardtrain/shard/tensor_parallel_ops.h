// TensorParallelOps<C> (shard layer, beside UnitSource): the interface through which the model
// calls its tensor-parallel collectives. The implementation on the mesh's TP communicator, TpGroup,
// is the parallel layer's (tensor_parallel.h), which the model never includes.
#pragma once

#include <cstddef>

#include "shardtrain/backend/bf16.h"  // math::Acc

namespace shardtrain {

// ---- Tensor parallelism -------------------------------------------------------------------------
//
// What the model needs from tensor parallelism (Megatron-LM, Shoeybi et al. 2019, with sequence
// parallelism, Korthikanti et al. 2022), in its compute type C: the few collectives of its TP group
// of size() ranks. The model calls them (model.h says where); the parallel layer implements them on
// the mesh's TP communicator (TpGroup, tensor_parallel.h), as UnitSource implements the FSDP ones. Every rank of
// the group makes the same calls in the same order with the same counts. Buffers are backend
// memory. Sequence-parallel layout: a "rows" buffer [N * n, C] holds the N ranks' blocks of n rows,
// rank r's at rows [r * n, (r + 1) * n).
template <typename C> class TensorParallelOps {
 public:
  using S = math::Acc<C>;
  virtual ~TensorParallelOps() = default;
  virtual int size() const = 0;  // N, the TP degree
  virtual int rank() const = 0;  // this rank's index in the group, in [0, N)
  // local (count elements) of every rank, concatenated in rank order into full (N * count).
  virtual void all_gather(const C* local, C* full, size_t count) = 0;
  // full (N * count elements) summed over the group; block r (elements [r * count, (r + 1) * count))
  // lands in rank r's local (count elements).
  virtual void reduce_scatter_sum(const C* full, C* local, size_t count) = 0;
  // The same two for the S scalars of the vocabulary-parallel cross-entropy (all-gather of the row
  // maxima, all-reduce of the sums; backend.h vocab_ce_*).
  virtual void all_gather_acc(const S* local, S* full, size_t count) = 0;
  virtual void all_reduce_sum_acc(S* buf, size_t count) = 0;
};

}  // namespace shardtrain
