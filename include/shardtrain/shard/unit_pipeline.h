// UnitPipeline<C> (shard layer): the model's UnitSource over a sharded state through a codec (gather
// buffers, prefetch, gradient buffers, two CommQueues); Fsdp<T> and MixedPrecisionUnits, its
// compositions for tools and tests.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/shard/codec.h"
#include "shardtrain/shard/comm_queue.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/shard/sharded_state.h"
#include "shardtrain/shard/unit_source.h"

namespace shardtrain {

// ---- The unit pipeline ----------------------------------------------------------------------------
//
// The UnitSource<C> over a sharded state, through a codec: gather buffers (1 + prefetch with
// overlap on, else 1) and full-unit gradient buffers (2 with overlap on: one is reduce-scattered
// while the next unit's gradient fills the other), all sized for the largest unit (both are
// needed at once for the tied LM head, so per-unit sizing would not lower the peak); two
// CommQueues on their own duplicated communicators (all-gathers; reduce-scatters); and the
// recorded order of each pass (prefetch, see UnitSource::begin_pass). Construction is collective
// over the codec's data_comm (and replica_comm): it duplicates them.
// Streams (stream lane, NCCL): the all-gather and the reduce-scatter Comms are duplicates of the
// data Comm (ncclCommSplit), each with its own communication stream, so a prefetch never queues
// behind a reduce-scatter; both are enqueued from the compute thread in program order, the same
// on every rank (NCCL needs that across communicators too). end_pass() synchronizes the data Comm
// once, which covers its duplicates (Comm::synchronize).
// Host progress (--comm-progress poll, on a host-kernel backend): the pipeline joins `be`'s
// progress registry (Backend::progress, progress.h) with its poll for its lifetime.
//
// Reshard::PerPass (unit_source.h; '--pp-reshard per-step' under a pipeline): inside a pass,
//   gather(u)  the first time: all-gathered into u's own kept buffer (padded_numel elements of C),
//              which stays valid until end_pass; afterwards returned as it is. Prefetch (overlap
//              on, prefetch k): along the order in which the last pass of the same label first
//              gathered its units, up to k units gathered ahead of the ones asked for; the codec's
//              staging (bf16: a shard rounded for the gather) is 1 + k buffers used in turn.
//   full_grad  a zeroed scratch buffer, as PerUse (the model stores into parts of it, see
//              UnitSource::full_grad).
//   reduce_scatter_grad(u)  adds the scratch into u's accumulator (padded_numel elements of
//              grad_accum_t<C>: C, or fp32 for bf16, see Bf16Codec) on the compute stream; the
//              pass's first one of u zeroes it first. No communication.
//   end_pass   reduce-scatters each accumulator once (in the order of their first
//              reduce_scatter_grad; the codec's issue_reduce_acc: the same mean over W ranks as
//              PerUse), waits, and forgets what was gathered. The kept buffers and accumulators are
//              allocated at first use (a unit's first gather, its first gradient) and kept for the
//              pipeline's lifetime, so every step reuses them (no allocation per step).
//   Memory, for the units U of this rank (a pipeline stage's chunks; the whole model without one),
//   in bytes, e = sizeof(C), a = sizeof(grad_accum_t<C>) (bf16: e = 2, a = 4; fp32: 4, 4):
//     sum over u in U of padded_numel(u) x (e + a)             the kept units and accumulators
//     + max_padded x e x (1 + ngrads)                           one gather buffer (gathers outside
//                                                               a pass) and the scratch (ngrads: 2
//                                                               with overlap on, else 1)
//     + the codec's staging: bf16, (1 + prefetch with overlap on, else 1) x max_shard x 2
//   instead of PerUse's max_padded x e x (nslots + ngrads) (+ its staging); the reduce buffers of
//   the codec are the same in both. Accumulators of units that get no gradient (an evaluation
//   pass) are not allocated.
template <typename C> class UnitPipeline : public UnitSource<C> {
 public:
  // `be`: the compute backend (the buffers' and the hook's). The state behind `codec` must outlive
  // the pipeline. `ov`: prefetch and asynchronous reduce-scatter; the default waits for every
  // collective at once (tools, tests); training passes --overlap / --prefetch / --comm-progress.
  // Throws std::invalid_argument (negative prefetch), std::bad_alloc.
  // `reshard`: PerUse (today's, the default) or PerPass (see above), for every pass.
  UnitPipeline(Backend<C>& be, std::unique_ptr<UnitCodec<C>> codec,
               const OverlapConfig& ov = OverlapConfig{false, 0, CommProgress::Wait},
               Reshard reshard = Reshard::PerUse);
  ~UnitPipeline() override;  // waits for everything in flight, then stops the threads
  UnitPipeline(const UnitPipeline&) = delete;
  UnitPipeline& operator=(const UnitPipeline&) = delete;

  const C* gather(int u) override;
  C* full_grad(int u) override;
  void reduce_scatter_grad(int u) override;
  void begin_pass(const std::string& label) override;
  void end_pass() override;
  CommTimes comm_times() const override;
  Reshard reshard() const override { return reshard_; }
  const OverlapConfig& overlap() const { return ov_; }
  size_t units() const { return plan_.units.size(); }  // its codec's plan's

 private:
  struct Slot {
    Buffer<C> buf;
    int unit = -1;
    int64_t pos = -1;  // position in the pass this buffer was gathered for
    CommQueue::Ticket ticket = 0;
  };
  struct GradBuf {
    Buffer<C> buf;
    int unit = -1;
    CommQueue::Ticket ticket = 0;  // its reduce-scatter
  };
  using Acc = grad_accum_t<C>;
  struct Kept {  // Reshard::PerPass: unit u's gathered copy and gradient accumulator
    Buffer<C> param;
    Buffer<Acc> grad;
    CommQueue::Ticket ticket = 0;  // its gather
    bool gathered = false;         // issued this pass
    bool asked = false;            // asked for (gather) this pass
    bool accumulated = false;      // its accumulator holds this pass's gradient
  };
  int num_slots() const { return static_cast<int>(slots_.size()); }
  int free_slot(int64_t pos) const;
  bool keeping() const { return reshard_ == Reshard::PerPass && in_pass_; }
  const C* gather_kept(int u);
  void issue_kept(int u);
  void reduce_kept();
  void count_gather(int u);
  void count_reduce(int u);
  void poll_all();
  static void poll_hook(void* self);
  Backend<C>& be_;
  std::unique_ptr<UnitCodec<C>> codec_;  // destroyed after the queues (their jobs use its buffers)
  const ShardPlan& plan_;
  OverlapConfig ov_;
  std::unique_ptr<Comm> ag_comm_, rs_comm_, rep_comm_;
  Comm* rep_ = nullptr;           // the replica lane of reduce-scatter jobs (own duplicate), nullptr: one group
  Comm* ordered_lane_ = nullptr;  // the data Comm when it is stream-ordered (NCCL): end_pass synchronizes it
  std::unique_ptr<CommQueue> agq_, rsq_;
  std::vector<Slot> slots_;
  std::vector<GradBuf> grads_;
  double gather_bytes_ = 0, reduce_bytes_ = 0;  // CommTimes' bytes, counted at submission
  int64_t unit_gathers_ = 0, unit_reduces_ = 0;  // CommTimes' counts
  Reshard reshard_ = Reshard::PerUse;
  std::vector<Kept> kept_;                     // per unit (PerPass)
  std::vector<int> first_, accumulated_;       // this pass: units in the order first gathered, first accumulated
  std::vector<CommQueue::Ticket> staging_;     // per codec staging buffer: the last kept gather through it
  int staging_next_ = 0;
  size_t trace_next_ = 0;                      // PerPass prefetch: next position in *trace_
  int ahead_ = 0;                              // PerPass prefetch: units gathered, not yet asked for
  int current_ = -1, gnext_ = 0, gcur_ = -1;
  int64_t pos_ = 0;
  bool in_pass_ = false, follow_ = false;
  ProgressRegistry::Member progress_member_;  // in be_'s progress registry (host progress, poll)
  std::string label_;
  std::vector<int> rec_;
  std::map<std::string, std::vector<int>> traces_;
  const std::vector<int>* trace_ = nullptr;
};

// Units in groups (ShardedState: expert units under expert parallelism, docs/moe.md): one
// UnitPipeline per group of the state's units, each over a codec of its group (UnitCodec's
// `group`), so each group has its own gather and gradient buffers and its own queues on its own
// group's comm. Unit indices are the state's. gather(u) is valid until the next gather of a unit of
// the same group (a block's unit stays gathered while its experts' unit is); one full_grad of each
// group may be outstanding at once. A pass begins and ends in every group, in group order; the
// collectives of the groups are on different communicators, issued in the same program order on
// every rank. comm_times() sums the groups'.
template <typename C> class GroupedUnits final : public UnitSource<C> {
 public:
  // lanes[g]: group g's pipeline (its codec over group g of the state whose plan is `plan`), one per
  // group. Throws std::invalid_argument when a lane's unit count is not its group's.
  GroupedUnits(std::vector<std::unique_ptr<UnitPipeline<C>>> lanes, const ShardPlan& plan);
  const C* gather(int u) override { return lane(u).gather(local_[static_cast<size_t>(u)]); }
  C* full_grad(int u) override { return lane(u).full_grad(local_[static_cast<size_t>(u)]); }
  void reduce_scatter_grad(int u) override { lane(u).reduce_scatter_grad(local_[static_cast<size_t>(u)]); }
  void begin_pass(const std::string& label) override;
  void end_pass() override;
  CommTimes comm_times() const override;
  Reshard reshard() const override { return lanes_.front()->reshard(); }
  int gathered_groups() const override { return static_cast<int>(lanes_.size()); }

 private:
  UnitPipeline<C>& lane(int u);
  std::vector<std::unique_ptr<UnitPipeline<C>>> lanes_;
  std::vector<int> group_, local_;  // per state unit: its group and its index in the group's plan
};

// Plain-precision FSDP in one object (tools and tests): a ShardedState<T> and, over it, a
// UnitPipeline<T> with the IdentityCodec. Construction is collective over data_comm.
template <typename T> class Fsdp final : public ShardedState<T>, public UnitPipeline<T> {
 public:
  static constexpr size_t kReduceSlab = IdentityCodec<T>::kReduceSlab;
  // As ShardedState's and UnitPipeline's constructors; throws as they do.
  Fsdp(Backend<T>& be, Comm& comm, ShardPlan plan, Comm* data_comm = nullptr, Comm* replica_comm = nullptr,
       const OverlapConfig& ov = OverlapConfig{false, 0, CommProgress::Wait}, Reshard reshard = Reshard::PerUse)
      : ShardedState<T>(be, comm, std::move(plan), data_comm, replica_comm),
        UnitPipeline<T>(be, std::make_unique<IdentityCodec<T>>(*this), ov, reshard) {}
  Fsdp(Backend<T>& be, const Mesh& mesh, ShardPlan plan, const OverlapConfig& ov, Reshard reshard = Reshard::PerUse)
      : Fsdp(be, mesh.world(), std::move(plan), &mesh.shard_data(), mesh.replica_data(), ov, reshard) {}
};

// Mixed-precision FSDP's unit source: a UnitPipeline<bf16> with the Bf16Codec over the fp32 state
// `master` (see Bf16Codec). `be` must run on the same device as master.backend(); both must
// outlive it. Construction is collective over master's data_comm.
class MixedPrecisionUnits final : public UnitPipeline<bf16> {
 public:
  static constexpr size_t kWidenSlab = Bf16Codec::kWidenSlab;
  MixedPrecisionUnits(ShardedState<float>& master, Backend<bf16>& be, bool reduce_bf16, size_t widen_slab = kWidenSlab,
                      const OverlapConfig& ov = OverlapConfig{false, 0, CommProgress::Wait},
                      Reshard reshard = Reshard::PerUse)
      : UnitPipeline<bf16>(be, std::make_unique<Bf16Codec>(master, be, reduce_bf16, widen_slab), ov, reshard) {}
};

// The model's UnitSource over one pipeline per unit group of `plan` (lanes[g]: group g's): the
// pipeline itself when there is one group, else GroupedUnits over them (its errors).
template <typename C>
std::unique_ptr<UnitSource<C>> group_sources(std::vector<std::unique_ptr<UnitPipeline<C>>> lanes, const ShardPlan& plan) {
  if (lanes.size() == 1) return std::move(lanes.front());
  return std::make_unique<GroupedUnits<C>>(std::move(lanes), plan);
}

}  // namespace shardtrain
