// The unit codecs (codec.h): the identity codec and the bf16 codec, over one slab job
// (submit_reduce_slabs) for both gradient paths.
#include "shardtrain/shard/codec.h"
#include <algorithm>
#include <stdexcept>
#include <type_traits>

namespace shardtrain {

// ---- IdentityCodec ---------------------------------------------------------------------------------

template <typename T> IdentityCodec<T>::IdentityCodec(ShardedState<T>& state, int group) : s_(state), g_(group) {
  if (g_ < 0 || g_ >= s_.num_groups()) throw std::invalid_argument("IdentityCodec: no unit group " + std::to_string(g_));
  const ShardPlan& plan = s_.group_plan(g_);
  const size_t max_shard = static_cast<size_t>(plan.max_shard_size()), W = static_cast<size_t>(plan.world_size);
  slab_ = reduce_slab(plan, kReduceSlab, s_.data_comm(g_).stream_ordered());
  scatter_tmp_ = Buffer<T>(s_.backend(), slab_);
  if (max_shard > slab_) pack_ = Buffer<T>(s_.backend(), slab_ * W);
}

template <typename T> CommQueue::Ticket IdentityCodec<T>::issue_gather(CommQueue& q, int u, T* dst, int) {
  const size_t S = static_cast<size_t>(plan().units[static_cast<size_t>(u)].shard_size);
  const T* src = s_.param_shard(unit(u));
  // dst is its own gather buffer (the pipeline waits for its ticket before reusing it): no shared buffers.
  return q.submit({1, [=](Comm& c, int) { return c.start_all_gather(src, dst, S); }, {}, false});
}

// The one slab job of both gradient paths. `full` is a full-unit buffer laid out [W, S] (rank r's
// block at r*S). With `direct` (S <= slab, same element type) it is reduce-scattered as it is, in
// one part; else one slab of n <= slab elements of every block per part: stage(packed + r*n,
// full + r*S + a, n) fills the packed [W, n] buffer (a copy, or a widening to fp32; MPI libraries
// allocate a temporary of the whole send buffer, slabs bound it), which is reduce-scattered into
// `out`. add(a, n, out) consumes each summed piece [a, a+n) of this rank's shard, in slab order.
//
// Hybrid sharding (rc != nullptr): after each slab's reduce-scatter comes a part of its own on the
// replica communicator rc: prep(a, n, out) readies rbuf (n elements of R: `out` itself, or `out`
// widened to fp32), a nonblocking all-reduce sums rbuf over the replica groups, and radd(a, n,
// rbuf) consumes it in place of add. Nothing in a job blocks: a blocking replica all-reduce inside
// a polled step let ranks wait on each other across the two communicators (a deadlock).
template <typename F, typename P, typename R, typename Stage, typename Add, typename Prep, typename RAdd>
CommQueue::Ticket submit_reduce_slabs(CommQueue& q, const F* full, size_t S, size_t W, size_t slab, bool direct,
                                      P* packed, P* out, Stage stage, Add add, Comm* rc, R* rbuf, Prep prep,
                                      RAdd radd) {
  const size_t step = direct ? S : slab;
  const int per = rc ? 2 : 1;  // parts per slab
  const int parts = static_cast<int>((S + step - 1) / step) * per;
  auto piece = [=](int i) {
    const size_t a = static_cast<size_t>(i / per) * step;
    return std::pair<size_t, size_t>(a, std::min(step, S - a));
  };
  return q.submit({parts,
                   [=](Comm& c, int i) -> std::unique_ptr<Comm::Request> {
                     const auto [a, n] = piece(i);
                     if (rc && i % 2 == 1) {
                       prep(a, n, out);
                       return rc->start_all_reduce_sum(rbuf, n);
                     }
                     if (direct) {
                       if constexpr (std::is_same_v<F, P>) return c.start_reduce_scatter_sum(full, out, S);
                       else throw std::logic_error("submit_reduce_slabs: direct needs one element type");
                     }
                     for (size_t r = 0; r < W; ++r) stage(packed + r * n, full + r * S + a, n);
                     return c.start_reduce_scatter_sum(static_cast<const P*>(packed), out, n);
                   },
                   [=](int i) {
                     const auto [a, n] = piece(i);
                     if (!rc) add(a, n, out);
                     else if (i % 2 == 1) radd(a, n, rbuf);
                   },
                   true});  // packed, out and rbuf serve every reduce-scatter job of the queue
}

// Summed over the replica groups (HSDP), divided by W = G * R and added into the gradient shard.
template <typename T>
CommQueue::Ticket IdentityCodec<T>::issue_reduce(CommQueue& q, int u, const T* full, Comm* replica) {
  // G: ranks of the unit's group (blocks of the buffer); the mean is over all W = G * R ranks of the
  // shard groups (an expert unit's group is a part of them: mean_divisor).
  const size_t S = static_cast<size_t>(plan().units[static_cast<size_t>(u)].shard_size),
               G = static_cast<size_t>(plan().world_size);
  const T inv_w = T(1) / static_cast<T>(static_cast<size_t>(s_.mean_divisor()));
  T* shard = s_.grad_shard(unit(u));
  Backend<T>* be = &s_.backend();
  auto add = [=](size_t a, size_t n, const T* sum) { be->axpy(n, inv_w, sum, shard + a); };
  return submit_reduce_slabs(
      q, full, S, G, slab_, S <= slab_, pack_.data(), scatter_tmp_.data(),
      [=](T* d, const T* src, size_t n) { be->copy(d, src, n); }, add, replica, scatter_tmp_.data(),
      [](size_t, size_t, const T*) {}, add);
}

Bf16Codec::Bf16Codec(ShardedState<float>& master, Backend<bf16>& be, bool reduce_bf16, size_t widen_slab, int group)
    : m_(master), be_(be), reduce_bf16_(reduce_bf16), g_(group) {
  if (g_ < 0 || g_ >= m_.num_groups()) throw std::invalid_argument("Bf16Codec: no unit group " + std::to_string(g_));
  const size_t max_shard = static_cast<size_t>(plan().max_shard_size());
  if (reduce_bf16_) {
    scatter_ = Buffer<bf16>(be_, max_shard);
  } else {
    slab_ = reduce_slab(plan(), widen_slab, data_comm().stream_ordered());
    grad32_ = Buffer<float>(m_.backend(), slab_ * static_cast<size_t>(plan().world_size));
    scatter32_ = Buffer<float>(m_.backend(), slab_);
  }
  if (reduce_bf16_ && m_.replica_comm()) replica32_ = Buffer<float>(m_.backend(), max_shard);
}

void Bf16Codec::reserve(int slots) {
  const size_t max_shard = static_cast<size_t>(plan().max_shard_size());
  while (static_cast<int>(shard_.size()) < slots) shard_.emplace_back(be_, max_shard);
}

// This rank's fp32 shard is rounded to bf16 (in the slot's own staging buffer, at once: the master
// shard does not change within a pass), then the bf16 shards are all-gathered.
CommQueue::Ticket Bf16Codec::issue_gather(CommQueue& q, int u, bf16* dst, int slot) {
  const size_t S = static_cast<size_t>(plan().units[static_cast<size_t>(u)].shard_size);
  bf16* stage = shard_[static_cast<size_t>(slot)].data();
  be_.from_f32(stage, m_.param_shard(unit(u)), S);
  return q.submit(
      {1, [=](Comm& c, int) { return c.start_all_gather(static_cast<const bf16*>(stage), dst, S); }, {}, false});
}

// bf16 reduce: the whole shard at once (scatter_ is shard-sized), the mean added into the fp32
// gradient shard. fp32 reduce: widened to fp32 a slab at a time ([W, n] of at most slab_ * W floats),
// so no fp32 copy of a whole unit exists (stream lane: slab_ is the largest shard, one part).
// Hybrid sharding: the group's sum is summed over the replica groups in fp32 (a bf16 group sum is
// widened into replica32_ first) before the mean over W = G * R is added.
CommQueue::Ticket Bf16Codec::issue_reduce(CommQueue& q, int u, const bf16* full, Comm* replica) {
  // G: ranks of the unit's group (blocks of the buffer); the mean is over all W = G * R ranks.
  const size_t S = static_cast<size_t>(plan().units[static_cast<size_t>(u)].shard_size),
               G = static_cast<size_t>(plan().world_size);
  const float inv_w = 1.0f / static_cast<float>(static_cast<size_t>(m_.mean_divisor()));
  float* shard = m_.grad_shard(unit(u));
  Backend<bf16>* be = &be_;
  Backend<float>* b32 = &m_.backend();
  Comm* rc = replica;
  auto add32 = [=](size_t a, size_t n, const float* sum) { b32->axpy(n, inv_w, sum, shard + a); };
  if (reduce_bf16_) {
    float* w = replica32_.data();  // jobs run one at a time (FIFO): one buffer serves them all
    return submit_reduce_slabs(
        q, full, S, G, S, true, static_cast<bf16*>(nullptr), scatter_.data(), [](bf16*, const bf16*, size_t) {},
        [=](size_t a, size_t n, const bf16* sum) { be->add_to_f32(shard + a, inv_w, sum, n); }, rc, w,
        [=](size_t, size_t n, const bf16* sum) {  // the group's bf16 sum, widened for the fp32 replica sum
          b32->zero(w, n);
          be->add_to_f32(w, 1.0f, sum, n);
        },
        add32);
  }
  return submit_reduce_slabs(
      q, full, S, G, slab_, false, grad32_.data(), scatter32_.data(),
      [=](float* d, const bf16* src, size_t n) {
        b32->zero(d, n);
        be->add_to_f32(d, 1.0f, src, n);
      },
      add32, rc, scatter32_.data(), [](size_t, size_t, const float*) {}, add32);
}

// A pass's fp32 accumulator (Reshard::PerPass). reduce_bf16: rounded to bf16 once, into `scratch`
// (full-unit, the pipeline's), then issue_reduce's bf16 path. fp32: reduce-scattered from the
// accumulator as it is when a shard fits a slab (the stream lane always), else a slab at a time
// packed into grad32_ (a copy: no widening), the mean added into the fp32 gradient shard as
// issue_reduce adds it.
CommQueue::Ticket Bf16Codec::issue_reduce_acc(CommQueue& q, int u, const float* acc, bf16* scratch, Comm* replica) {
  const UnitPlan& up = plan().units[static_cast<size_t>(u)];
  if (reduce_bf16_) {
    be_.from_f32(scratch, acc, static_cast<size_t>(up.padded_numel));
    return issue_reduce(q, u, scratch, replica);
  }
  const size_t S = static_cast<size_t>(up.shard_size), G = static_cast<size_t>(plan().world_size);
  const float inv_w = 1.0f / static_cast<float>(static_cast<size_t>(m_.mean_divisor()));
  float* shard = m_.grad_shard(unit(u));
  Backend<float>* b32 = &m_.backend();
  auto add32 = [=](size_t a, size_t n, const float* sum) { b32->axpy(n, inv_w, sum, shard + a); };
  return submit_reduce_slabs(
      q, acc, S, G, slab_, S <= slab_, grad32_.data(), scatter32_.data(),
      [=](float* d, const float* src, size_t n) { b32->copy(d, src, n); }, add32, replica, scatter32_.data(),
      [](size_t, size_t, const float*) {}, add32);
}

template class IdentityCodec<float>;
template class IdentityCodec<double>;

}  // namespace shardtrain
