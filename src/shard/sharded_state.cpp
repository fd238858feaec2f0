// This rank's parameter and gradient shards (sharded_state.h): init, gather / set of one parameter,
// the gradient norm's local sum, the replicated gradients' sum.
#include "shardtrain/shard/sharded_state.h"

#include <cmath>
#include <stdexcept>

#include "shardtrain/backend/ops_math.h"  // math::splitmix64

namespace shardtrain {

using math::splitmix64;

double counter_normal(uint64_t seed, uint64_t key, uint64_t i) {
  uint64_t a = splitmix64(seed ^ splitmix64(key ^ splitmix64(2 * i)));
  uint64_t b = splitmix64(seed ^ splitmix64(key ^ splitmix64(2 * i + 1)));
  double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;          // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

template <typename T>
ShardedState<T>::ShardedState(Backend<T>& be, Comm& comm, ShardPlan plan, Comm* data_comm, Comm* replica_comm,
                              Comm* expert_comm)
    : be_(be), comm_(comm), dcomm_(data_comm ? data_comm : &comm), rcomm_(replica_comm), ecomm_(expert_comm),
      plan_(std::move(plan)) {
  if (plan_.world_size != dcomm_->world_size())
    throw std::invalid_argument("ShardedState: plan built for " + std::to_string(plan_.world_size) +
                                " ranks, comm has " + std::to_string(dcomm_->world_size()));
  if (plan_.grouped() && (!ecomm_ || ecomm_->world_size() != plan_.expert_world_size))
    throw std::invalid_argument("ShardedState: plan's expert units built for " +
                                std::to_string(plan_.expert_world_size) + " ranks, expert comm has " +
                                (ecomm_ ? std::to_string(ecomm_->world_size()) : std::string("none")));
  for (int g = 0; g < num_groups(); ++g) gplan_[g] = plan_.group_plan(g, &gunits_[g]);
  for (auto& u : plan_.units) {
    params_.emplace_back(be_, static_cast<size_t>(u.shard_size));
    grads_.emplace_back(be_, static_cast<size_t>(u.shard_size));
  }
}

template <typename T> void ShardedState<T>::init_params(uint64_t seed) {
  constexpr int64_t kPiece = int64_t{1} << 20;  // host staging of at most 1M elements, not a whole shard
  std::vector<T> host;
  for (size_t u = 0; u < plan_.units.size(); ++u) {
    const UnitPlan& up = plan_.units[u];
    const RankShard& rs = up.ranks[static_cast<size_t>(unit_rank(static_cast<int>(u)))];
    for (int64_t p0 = 0; p0 < up.shard_size; p0 += kPiece) {  // shard elements [p0, p1)
      const int64_t p1 = std::min(up.shard_size, p0 + kPiece);
      host.assign(static_cast<size_t>(p1 - p0), T(0));
      for (const auto& slot : up.params) {
        const int64_t lo = std::max({slot.offset, rs.start + p0}),
                      hi = std::min({slot.offset + slot.numel, rs.start + rs.valid, rs.start + p1});
        const uint64_t key = fnv1a64(slot.spec.name);
        // Each element's value depends only on (seed, name, canonical index): threads change no bit.
        // Serial, this loop was most of a GPU run's start (llama-1b: about 40 s of 1.2e9 draws).
#pragma omp parallel for schedule(static) if (hi - lo > 65536)
        for (int64_t e = lo; e < hi; ++e) {
          T v = 0;
          switch (slot.spec.init) {
            case Init::Ones: v = 1; break;
            case Init::Zeros: v = 0; break;
            case Init::Normal: {
              const int64_t ci = slot.spec.canonical_index(e - slot.offset);  // -1: vocabulary padding
              v = ci < 0 ? T(0) : static_cast<T>(slot.spec.init_std * counter_normal(seed, key, static_cast<uint64_t>(ci)));
              break;
            }
          }
          host[static_cast<size_t>(e - rs.start - p0)] = v;
        }
      }
      be_.from_host(params_[u].data() + p0, host.data(), host.size());
    }
  }
}

template <typename T> void ShardedState<T>::zero_grads() {
  for (size_t u = 0; u < grads_.size(); ++u) be_.zero(grads_[u].data(), grads_[u].size());
}

template <typename T> std::vector<T> ShardedState<T>::gather_param(const std::string& name) {
  for (size_t u = 0; u < plan_.units.size(); ++u)
    for (auto& slot : plan_.units[u].params)
      if (slot.spec.name == name) {
        const UnitPlan& up = plan_.units[u];
        Buffer<T> full(be_, static_cast<size_t>(up.padded_numel));
        data_comm(up.group).all_gather(static_cast<const T*>(params_[u].data()), full.data(), static_cast<size_t>(up.shard_size));
        std::vector<T> out(static_cast<size_t>(slot.numel));
        be_.to_host(out.data(), full.data() + slot.offset, out.size());
        return out;
      }
  throw std::out_of_range("no parameter named '" + name + "'");
}

template <typename T> void ShardedState<T>::set_param(const std::string& name, const std::vector<T>& full) {
  for (size_t u = 0; u < plan_.units.size(); ++u)
    for (auto& slot : plan_.units[u].params)
      if (slot.spec.name == name) {
        if (static_cast<int64_t>(full.size()) != slot.numel)
          throw std::invalid_argument("set_param '" + name + "': expected " + std::to_string(slot.numel) +
                                      " elements, got " + std::to_string(full.size()));
        const RankShard& rs = plan_.units[u].ranks[static_cast<size_t>(unit_rank(static_cast<int>(u)))];
        int64_t lo = std::max(slot.offset, rs.start), hi = std::min(slot.offset + slot.numel, rs.start + rs.valid);
        if (hi > lo)
          be_.from_host(params_[u].data() + (lo - rs.start), full.data() + (lo - slot.offset),
                        static_cast<size_t>(hi - lo));
        return;
      }
  throw std::out_of_range("no parameter named '" + name + "'");
}

namespace {
// The shard-local ranges [begin, end) of unit plan `up`'s TP-replicated parameters in rank r's shard.
std::vector<std::pair<int64_t, int64_t>> replicated_ranges(const UnitPlan& up, int r) {
  std::vector<std::pair<int64_t, int64_t>> v;
  const RankShard& rs = up.ranks[static_cast<size_t>(r)];
  for (const ParamSlot& slot : up.params) {
    if (!slot.spec.tp_replicated()) continue;
    const int64_t lo = std::max(slot.offset, rs.start), hi = std::min(slot.offset + slot.numel, rs.start + rs.valid);
    if (lo < hi) v.emplace_back(lo - rs.start, hi - rs.start);
  }
  return v;
}
}  // namespace

template <typename T> double ShardedState<T>::local_grad_sumsq(bool include_replicated, int skip_unit) {
  std::vector<const T*> x;
  std::vector<size_t> n;
  for (size_t u = 0; u < plan_.units.size(); ++u) {
    if (static_cast<int>(u) == skip_unit) continue;
    const int r = unit_rank(static_cast<int>(u));
    const int64_t valid = plan_.units[u].ranks[r].valid;
    if (include_replicated) {  // the shard's valid elements in one piece (without TP: always)
      x.push_back(grads_[u].data());
      n.push_back(static_cast<size_t>(valid));
      continue;
    }
    int64_t at = 0;  // the valid elements between the replicated ranges
    for (auto [b, e] : replicated_ranges(plan_.units[u], r)) {
      if (b > at) { x.push_back(grads_[u].data() + at); n.push_back(static_cast<size_t>(b - at)); }
      at = e;
    }
    if (valid > at) { x.push_back(grads_[u].data() + at); n.push_back(static_cast<size_t>(valid - at)); }
  }
  return be_.sum_squares_many(x.data(), n.data(), x.size());
}

template <typename T> void ShardedState<T>::sum_replicated_grads(const std::function<void(T*, size_t)>& sum) {
  for (size_t u = 0; u < plan_.units.size(); ++u)
    for (auto [b, e] : replicated_ranges(plan_.units[u], unit_rank(static_cast<int>(u)))) sum(grads_[u].data() + b, static_cast<size_t>(e - b));
}

template class ShardedState<float>;
template class ShardedState<double>;

}  // namespace shardtrain
