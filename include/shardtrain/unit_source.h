// UnitSource<C> (shard layer): the interface through which the model asks for a unit's gathered
// parameters and hands back its gradient; it sees no communicator.
#pragma once

#include <string>

#include "shardtrain/comm_queue.h"  // CommTimes

namespace shardtrain {

// What the model needs from the sharding layer, in its compute type C: a unit's parameters,
// gathered in full; a zeroed full-unit gradient buffer; and the reduce-scatter of that buffer into
// this rank's gradient shard. UnitPipeline<C> is the one implementation: UnitPipeline<T> with the
// IdentityCodec for plain fp32 (or fp64) training, UnitPipeline<bf16> with the Bf16Codec over an
// fp32 state for mixed precision.
template <typename C> class UnitSource {
 public:
  virtual ~UnitSource() = default;
  // Collective: all-gathers unit u and returns it (padded_numel elements; parameter p at
  // + slot.offset). Valid until the next gather.
  virtual const C* gather(int u) = 0;
  // Zeroes and returns the full-unit gradient buffer for unit u (padded_numel elements).
  virtual C* full_grad(int u) = 0;
  // Collective: reduce-scatters the full-unit gradient buffer of unit u, divides by the world
  // size (mean over ranks) and adds the result into this rank's gradient shard. Under hybrid
  // sharding the reduce-scattered slabs are first summed over the replica groups (a nonblocking
  // all-reduce per slab, submit_reduce_slabs in codec.cpp), so the mean is still over all W ranks.
  // May return before it is done (overlap): the gradient shards are complete after end_pass().
  virtual void reduce_scatter_grad(int u) = 0;

  // For the training loop, never the model. A pass is a run of gathers between
  // begin_pass and end_pass (a training step's micro-batches, an evaluation). The sharding layer
  // records the order in which a pass labelled `label` gathers units and, in the next pass with
  // that label, gathers ahead along it (prefetch). end_pass() waits for every collective in flight
  // (after it the gradient shards hold every reduce-scatter); parameters may change only outside a
  // pass. Gathers outside a pass are never prefetched.
  virtual void begin_pass(const std::string& label) { (void)label; }
  virtual void end_pass() {}
  // Accumulated time of this source's collectives (zero for sources without any).
  virtual CommTimes comm_times() const { return {}; }
};

}  // namespace shardtrain
