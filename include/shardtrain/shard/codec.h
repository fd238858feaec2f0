// Unit codecs (shard layer): how one unit travels in the compute type C between a ShardedState and
// the unit pipeline: IdentityCodec (C = T) and Bf16Codec (bf16 over an fp32 state).
#pragma once

#include <cstddef>

#include "shardtrain/backend/backend.h"
#include "shardtrain/shard/comm_queue.h"
#include "shardtrain/shard/sharded_state.h"

namespace shardtrain {

// The element type a pass's gradient accumulator has for compute type C (UnitPipeline under
// Reshard::PerPass): C itself, but fp32 for bf16 (see Bf16Codec).
template <typename C> struct GradAccum { using type = C; };
template <> struct GradAccum<bf16> { using type = float; };
template <typename C> using grad_accum_t = typename GradAccum<C>::type;

// ---- Codecs: how one unit travels in the compute type C -------------------------------------------
//
// A codec turns a state's parameter shard of unit u into the compute type C for the all-gather,
// and a full-unit gradient in C (laid out [W, S]: rank r's block at r*S) into the mean added to
// the state's gradient shard: reduce-scattered over data_comm, summed over the replica groups
// under hybrid sharding (the pipeline's `replica` lane, nullptr with one group) and divided by
// W = G * R. Each issue_* submits one CommQueue job and returns its ticket. Buffers: a gather
// writes only `dst` (the pipeline owns it and orders its reuse by the ticket); per-slot staging is
// the codec's, one per gather buffer (reserve); reduce-scatter staging is shared between the
// reduce jobs of one queue (Job::shared_buffers). Two codecs today: IdentityCodec (C = T) and
// Bf16Codec (bf16 over an fp32 state); float8 would be a third.
// Unit groups (sharded_state.h): a codec serves one group of the state's units, `group` (0 by
// default: a state without groups has only it): plan() is the group's plan (unit u: the group's
// u-th unit), data_comm() the group's, and the mean still divides by the state's W = G * R
// (ShardedState::mean_divisor), not by the group's ranks.
template <typename C> class UnitCodec {
 public:
  virtual ~UnitCodec() = default;
  virtual const ShardPlan& plan() const = 0;
  virtual Comm& world() = 0;         // the state's comm (control, watchdog)
  virtual Comm& data_comm() = 0;     // the state's data_comm
  virtual Comm* replica_comm() = 0;  // the state's replica_comm (nullptr: one group)
  // Allocates per-gather-buffer staging for `slots` buffers. Throws std::bad_alloc.
  virtual void reserve(int slots) = 0;
  virtual CommQueue::Ticket issue_gather(CommQueue& q, int u, C* dst, int slot) = 0;
  virtual CommQueue::Ticket issue_reduce(CommQueue& q, int u, const C* full, Comm* replica) = 0;
  // A pass's gradient accumulator (UnitPipeline under Reshard::PerPass): full-unit buffers of
  // Acc = grad_accum_t<C> on acc_backend(); accumulate() adds a micro-batch's full-unit gradient
  // into one (acc[i] += g[i], on the compute backend's stream, before it returns to the caller's
  // program order); issue_reduce_acc() is issue_reduce() of an accumulator: the same mean over the
  // W ranks added into the gradient shard. `scratch` is a full-unit C buffer the codec may stage
  // into (the pipeline does not reuse it before the ticket completes).
  using Acc = grad_accum_t<C>;
  virtual Backend<Acc>& acc_backend() = 0;
  virtual void accumulate(Acc* acc, const C* g, size_t n) = 0;
  virtual CommQueue::Ticket issue_reduce_acc(CommQueue& q, int u, const Acc* acc, C* scratch, Comm* replica) = 0;
  // Bytes per element of the reduce-scatter and of the replica all-reduce (hybrid sharding).
  virtual size_t reduce_elem_bytes() const = 0;
  virtual size_t replica_elem_bytes() const = 0;
};

// C = T: the shard is all-gathered as it is; the gradient is reduce-scattered kReduceSlab
// elements (all ranks' blocks together) at a time on the host lane, packed from the full-unit
// buffer, so the result buffer is 1/W of that, not a whole shard of the largest unit (for a
// 128k-vocabulary embedding at W = 2 that shard is 500 MiB); on the stream lane (data_comm
// stream-ordered) one reduce-scatter per unit into a shard-sized result buffer (reduce_slab).
template <typename T> class IdentityCodec final : public UnitCodec<T> {
 public:
  static constexpr size_t kReduceSlab = size_t{1} << 22;
  // `state` must outlive the codec. Throws std::bad_alloc.
  explicit IdentityCodec(ShardedState<T>& state, int group = 0);
  const ShardPlan& plan() const override { return s_.group_plan(g_); }
  Comm& world() override { return s_.comm(); }
  Comm& data_comm() override { return s_.data_comm(g_); }
  Comm* replica_comm() override { return s_.replica_comm(); }
  void reserve(int) override {}
  CommQueue::Ticket issue_gather(CommQueue& q, int u, T* dst, int slot) override;
  CommQueue::Ticket issue_reduce(CommQueue& q, int u, const T* full, Comm* replica) override;
  // The accumulator is a T buffer (Acc = T): added with axpy(1), reduced as issue_reduce reduces.
  Backend<T>& acc_backend() override { return s_.backend(); }
  void accumulate(T* acc, const T* g, size_t n) override { s_.backend().axpy(n, 1, g, acc); }
  CommQueue::Ticket issue_reduce_acc(CommQueue& q, int u, const T* acc, T*, Comm* replica) override {
    return issue_reduce(q, u, acc, replica);
  }
  size_t reduce_elem_bytes() const override { return sizeof(T); }
  size_t replica_elem_bytes() const override { return sizeof(T); }

 private:
  ShardedState<T>& s_;
  int g_;                         // the state's unit group this codec serves
  int unit(int u) const { return s_.group_units(g_)[static_cast<size_t>(u)]; }  // the state's index
  Buffer<T> scatter_tmp_, pack_;  // reduce-scatter of one slab: [slab_] result, [W, slab_] packed input
  size_t slab_ = 0;               // shard elements per reduce-scatter call
};

// Mixed precision (Micikevicius et al. 2018; PyTorch FSDP's MixedPrecision(param_dtype=bf16,
// reduce_dtype=fp32 or bf16)) over an fp32 state that keeps the master shards, gradient shards
// and, in AdamW, the optimizer state in fp32:
//   gather:  this rank's fp32 shard is rounded to bf16 (in the gather buffer's own staging), then
//            the bf16 shards are all-gathered (half the bytes of an fp32 gather);
//   reduce:  with reduce_bf16 == false the bf16 gradient is widened to fp32 and reduce-scattered
//            in fp32, one slab of at most widen_slab elements (over all ranks) at a time, so no
//            fp32 copy of a whole unit exists (for a 128k vocabulary embedding that copy would be
//            4 bytes x V x C); on the stream lane (NCCL) the whole unit at once instead (one
//            collective per unit: that fp32 copy exists, see reduce_slab). Else reduce-scattered
//            in bf16 (half the bytes), one collective per unit. The mean is added into the fp32
//            gradient shard; under hybrid sharding the replica sum runs in fp32.
//   accumulate (Reshard::PerPass): a pass's accumulator is fp32 (4 bytes per element of every
//            unit, twice a bf16 one): each micro-batch's bf16 gradient is widened and added in
//            fp32, so m micro-batches are summed with fp32 rounding, as the per-micro-batch path
//            sums their reduced means into the fp32 gradient shard; a bf16 accumulator would round
//            every partial sum to 8 bits (its error grows with m). Its reduce: in fp32, straight
//            from the accumulator (slabs on the host lane as above, a copy instead of a widening);
//            with reduce_bf16 the sum is rounded to bf16 once (into the pipeline's scratch) and
//            reduce-scattered in bf16 as above.
// `be` must run on the same device as state.backend().
class Bf16Codec final : public UnitCodec<bf16> {
 public:
  static constexpr size_t kWidenSlab = size_t{1} << 22;  // fp32 elements (16 MiB) per widened slab
  // `state` and `be` must outlive the codec. widen_slab: fp32 elements per widened slab (tests make
  // it small to cut units into many slabs); unused on the stream lane. Throws std::bad_alloc.
  Bf16Codec(ShardedState<float>& state, Backend<bf16>& be, bool reduce_bf16, size_t widen_slab = kWidenSlab,
            int group = 0);
  const ShardPlan& plan() const override { return m_.group_plan(g_); }
  Comm& world() override { return m_.comm(); }
  Comm& data_comm() override { return m_.data_comm(g_); }
  Comm* replica_comm() override { return m_.replica_comm(); }
  void reserve(int slots) override;
  CommQueue::Ticket issue_gather(CommQueue& q, int u, bf16* dst, int slot) override;
  CommQueue::Ticket issue_reduce(CommQueue& q, int u, const bf16* full, Comm* replica) override;
  Backend<float>& acc_backend() override { return m_.backend(); }
  void accumulate(float* acc, const bf16* g, size_t n) override { be_.add_to_f32(acc, 1.0f, g, n); }
  CommQueue::Ticket issue_reduce_acc(CommQueue& q, int u, const float* acc, bf16* scratch, Comm* replica) override;
  size_t reduce_elem_bytes() const override { return reduce_bf16_ ? 2 : 4; }
  size_t replica_elem_bytes() const override { return 4; }  // summed in fp32 either way

 private:
  ShardedState<float>& m_;
  Backend<bf16>& be_;
  bool reduce_bf16_;
  int g_;  // the state's unit group this codec serves
  int unit(int u) const { return m_.group_units(g_)[static_cast<size_t>(u)]; }  // the state's index
  std::vector<Buffer<bf16>> shard_;  // per gather buffer: this rank's shard rounded to bf16
  Buffer<bf16> scatter_;
  Buffer<float> grad32_, scatter32_;  // [W, slab_] and [slab_]: the fp32 reduce-scatter of one slab
  Buffer<float> replica32_;           // HSDP with bf16 reduce: a shard widened to fp32 for the replica sum
  size_t slab_ = 0;                   // shard elements per fp32 reduce-scatter
};

}  // namespace shardtrain
