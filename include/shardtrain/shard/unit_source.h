// UnitSource<C> (shard layer): the interface through which the model asks for a unit's gathered
// parameters and hands back its gradient; it sees no communicator.
#pragma once

#include <string>

#include "shardtrain/shard/comm_queue.h"  // CommTimes

namespace shardtrain {

// How long a unit source keeps what a pass gathers, and when it reduce-scatters gradients (option
// '--pp-reshard', used with --pp > 1; otherwise PerUse):
//   PerUse  (--pp-reshard per-microbatch; the default of every source and of every run without a
//           pipeline): each gather all-gathers the unit again (prefetch aside) and each
//           reduce_scatter_grad reduce-scatters that micro-batch's gradient; under a pipeline
//           schedule of m micro-batches a unit is gathered and reduced about m times a step.
//   PerPass (--pp-reshard per-step): inside a pass a unit is all-gathered the first time it is asked
//           for and stays gathered until end_pass; each micro-batch's gradient is added into a
//           full-unit accumulator of the unit, and end_pass reduce-scatters each accumulator once.
//           One all-gather and one reduce-scatter per unit and pass, for the memory of every unit
//           unsharded plus its accumulated gradient (UnitPipeline says how much). Outside a pass
//           it behaves as PerUse.
enum class Reshard { PerUse, PerPass };

// What the model needs from the sharding layer, in its compute type C: a unit's parameters,
// gathered in full; a zeroed full-unit gradient buffer; and the reduce-scatter of that buffer into
// this rank's gradient shard. UnitPipeline<C> is the one implementation: UnitPipeline<T> with the
// IdentityCodec for plain fp32 (or fp64) training, UnitPipeline<bf16> with the Bf16Codec over an
// fp32 state for mixed precision.
template <typename C> class UnitSource {
 public:
  virtual ~UnitSource() = default;
  // Collective: all-gathers unit u and returns it (padded_numel elements; parameter p at
  // + slot.offset). Valid until the next gather (the model may rely on no more; under
  // Reshard::PerPass inside a pass it stays valid until end_pass).
  virtual const C* gather(int u) = 0;
  // Zeroes and returns the full-unit gradient buffer for unit u (padded_numel elements), which the
  // model writes this micro-batch's gradient of u into (adding or storing: it starts at zero)
  // before handing it to reduce_scatter_grad(u). Under Reshard::PerPass too (a scratch buffer: the
  // model stores into parts of it, the split backward's block_weight copies the norm weights'
  // gradients, so the pass's accumulator is not handed out; see reduce_scatter_grad).
  virtual C* full_grad(int u) = 0;
  // Collective: reduce-scatters the full-unit gradient buffer of unit u, divides by the world
  // size (mean over ranks) and adds the result into this rank's gradient shard. Under hybrid
  // sharding the reduce-scattered slabs are first summed over the replica groups (a nonblocking
  // all-reduce per slab, submit_reduce_slabs in codec.cpp), so the mean is still over all W ranks.
  // May return before it is done (overlap): the gradient shards are complete after end_pass().
  // Under Reshard::PerPass inside a pass: adds the buffer into u's accumulator (zeroed at the
  // pass's first reduce_scatter_grad of u) and communicates nothing; end_pass() reduce-scatters
  // each accumulator once with the same mean, so the gradient shards receive the same sum (up to
  // the order of the additions: accumulate-then-reduce instead of reduce-then-accumulate).
  virtual void reduce_scatter_grad(int u) = 0;

  // For the training loop, never the model. A pass is a run of gathers between
  // begin_pass and end_pass (a training step's micro-batches, an evaluation). The sharding layer
  // records the order in which a pass labelled `label` gathers units and, in the next pass with
  // that label, gathers ahead along it (prefetch). end_pass() waits for every collective in flight
  // (after it the gradient shards hold every reduce-scatter); parameters may change only outside a
  // pass. Gathers outside a pass are never prefetched. Under Reshard::PerPass end_pass() first
  // reduce-scatters the accumulated gradients, then drops what the pass gathered.
  virtual void begin_pass(const std::string& label) { (void)label; }
  virtual void end_pass() {}
  virtual Reshard reshard() const { return Reshard::PerUse; }
  // How many units this source keeps gathered (and gradient buffers out) at once, each of another
  // unit group (UnitSpec::group): 1 for a UnitPipeline, one per group for GroupedUnits. The model
  // under expert parallelism needs 2 (an MoE block's unit and its experts' unit) and refuses less.
  virtual int gathered_groups() const { return 1; }
  // Accumulated time of this source's collectives (zero for sources without any).
  virtual CommTimes comm_times() const { return {}; }
};

}  // namespace shardtrain
