// Shard plan construction and the FSDP engine (gather / reduce-scatter per unit).
#include "shardtrain/shard.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <set>
#include <stdexcept>

namespace shardtrain {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

const ParamSlot& UnitPlan::param(const std::string& n) const {
  for (auto& p : params)
    if (p.spec.name == n) return p;
  throw std::out_of_range("unit '" + name + "' has no parameter '" + n + "'");
}

ShardPlan ShardPlan::build(const std::vector<UnitSpec>& units, int world) {
  if (world < 1) throw std::invalid_argument("ShardPlan: world size must be >= 1, got " + std::to_string(world));
  ShardPlan plan;
  plan.world_size = world;
  std::set<std::string> seen;
  for (const auto& us : units) {
    if (us.params.empty()) throw std::invalid_argument("ShardPlan: unit '" + us.name + "' has no parameters");
    UnitPlan up;
    up.name = us.name;
    int64_t off = 0;
    for (const auto& ps : us.params) {
      if (!seen.insert(ps.name).second) throw std::invalid_argument("ShardPlan: duplicate parameter '" + ps.name + "'");
      for (auto d : ps.shape)
        if (d <= 0) throw std::invalid_argument("ShardPlan: parameter '" + ps.name + "' has a non-positive dimension");
      ParamSlot slot{ps, off, ps.numel()};
      off += slot.numel;
      up.params.push_back(slot);
    }
    up.numel = off;
    up.shard_size = std::max<int64_t>(1, (off + world - 1) / world);
    up.padded_numel = up.shard_size * world;
    for (int r = 0; r < world; ++r) {
      RankShard rs;
      rs.start = r * up.shard_size;
      rs.valid = std::clamp<int64_t>(up.numel - rs.start, 0, up.shard_size);
      rs.padding = up.shard_size - rs.valid;
      up.ranks.push_back(rs);
    }
    plan.units.push_back(std::move(up));
  }
  return plan;
}

int64_t ShardPlan::max_padded_numel() const {
  int64_t m = 0;
  for (const UnitPlan& u : units) m = std::max(m, u.padded_numel);
  return m;
}

int64_t ShardPlan::max_shard_size() const {
  int64_t m = 0;
  for (const UnitPlan& u : units) m = std::max(m, u.shard_size);
  return m;
}

int64_t ShardPlan::total_numel() const {
  int64_t n = 0;
  for (auto& u : units) n += u.numel;
  return n;
}

int ShardPlan::unit_index(const std::string& name) const {
  for (size_t i = 0; i < units.size(); ++i)
    if (units[i].name == name) return static_cast<int>(i);
  return -1;
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

double counter_normal(uint64_t seed, uint64_t key, uint64_t i) {
  uint64_t a = splitmix64(seed ^ splitmix64(key ^ splitmix64(2 * i)));
  uint64_t b = splitmix64(seed ^ splitmix64(key ^ splitmix64(2 * i + 1)));
  double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;          // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

template <typename T>
Fsdp<T>::Fsdp(Backend<T>& be, Comm& comm, ShardPlan plan, Comm* data_comm, bool full_buffers, Comm* replica_comm)
    : be_(be), comm_(comm), dcomm_(data_comm ? data_comm : &comm), rcomm_(replica_comm), plan_(std::move(plan)) {
  if (plan_.world_size != dcomm_->world_size())
    throw std::invalid_argument("Fsdp: plan built for " + std::to_string(plan_.world_size) + " ranks, comm has " +
                                std::to_string(dcomm_->world_size()));
  for (auto& u : plan_.units) {
    params_.emplace_back(be_, static_cast<size_t>(u.shard_size));
    grads_.emplace_back(be_, static_cast<size_t>(u.shard_size));
  }
  if (!full_buffers) return;
  const size_t max_padded = static_cast<size_t>(plan_.max_padded_numel());
  gather_buf_ = Buffer<T>(be_, max_padded);
  grad_buf_ = Buffer<T>(be_, max_padded);
  const size_t max_shard = static_cast<size_t>(plan_.max_shard_size()), W = static_cast<size_t>(plan_.world_size);
  slab_ = reduce_slab(plan_, kReduceSlab);
  scatter_tmp_ = Buffer<T>(be_, slab_);
  if (max_shard > slab_) pack_ = Buffer<T>(be_, slab_ * W);
}

template <typename T> void Fsdp<T>::init_params(uint64_t seed) {
  int r = plan_rank();
  constexpr int64_t kPiece = int64_t{1} << 20;  // host staging of at most 1M elements, not a whole shard
  std::vector<T> host;
  for (size_t u = 0; u < plan_.units.size(); ++u) {
    const UnitPlan& up = plan_.units[u];
    const RankShard& rs = up.ranks[r];
    for (int64_t p0 = 0; p0 < up.shard_size; p0 += kPiece) {  // shard elements [p0, p1)
      const int64_t p1 = std::min(up.shard_size, p0 + kPiece);
      host.assign(static_cast<size_t>(p1 - p0), T(0));
      for (const auto& slot : up.params) {
        const int64_t lo = std::max({slot.offset, rs.start + p0}),
                      hi = std::min({slot.offset + slot.numel, rs.start + rs.valid, rs.start + p1});
        const uint64_t key = fnv1a64(slot.spec.name);
        for (int64_t e = lo; e < hi; ++e) {
          T v = 0;
          switch (slot.spec.init) {
            case Init::Ones: v = 1; break;
            case Init::Zeros: v = 0; break;
            case Init::Normal:
              v = static_cast<T>(slot.spec.init_std * counter_normal(seed, key, static_cast<uint64_t>(e - slot.offset)));
              break;
          }
          host[static_cast<size_t>(e - rs.start - p0)] = v;
        }
      }
      be_.from_host(params_[u].data() + p0, host.data(), host.size());
    }
  }
  gathered_ = -1;
}

template <typename T> void Fsdp<T>::zero_grads() {
  for (size_t u = 0; u < grads_.size(); ++u) be_.zero(grads_[u].data(), grads_[u].size());
}

size_t reduce_slab(const ShardPlan& plan, size_t slab_elements) {
  const size_t max_shard = static_cast<size_t>(plan.max_shard_size()), W = static_cast<size_t>(plan.world_size);
  return std::min(max_shard, std::max<size_t>(1, slab_elements / W));
}

namespace {
// The one slab loop of both gradient paths. `full` is a full-unit buffer laid out [W, S] (rank r's
// block at r*S). With S <= slab it is reduce-scattered as it is; else a slab of n <= slab elements
// of every block at a time: stage(packed + r*n, full + r*S + a, n) fills the packed [W, n] buffer
// (a copy, or a widening to fp32), which is reduce-scattered. add(a, n, out) consumes each summed
// piece [a, a+n) of this rank's shard.
template <typename F, typename P, typename Stage, typename Add>
void reduce_scatter_slabs(Comm& comm, const F* full, size_t S, size_t W, size_t slab, P* packed, P* out, Stage stage,
                          Add add) {
  if constexpr (std::is_same_v<F, P>) {
    if (S <= slab) {
      comm.reduce_scatter_sum(full, out, S);
      add(size_t{0}, S, out);
      return;
    }
  }
  for (size_t a = 0; a < S; a += slab) {
    const size_t n = std::min(slab, S - a);
    for (size_t r = 0; r < W; ++r) stage(packed + r * n, full + r * S + a, n);
    comm.reduce_scatter_sum(packed, out, n);
    add(a, n, out);
  }
}

// Hybrid sharding: sums a reduce-scattered gradient slab (n elements of this shard rank's
// gradient, already summed over its shard group) in place over the replica groups, so that it
// holds the sum over all W ranks. Nothing to do with one group (replica == nullptr). The callers
// then divide by W. The one place where gradients cross replica groups.
template <typename T> void replica_sum(Comm* replica, T* slab, size_t n) {
  if (replica) replica->all_reduce(slab, n, ReduceOp::Sum);
}
}  // namespace

template <typename T> const T* Fsdp<T>::gather(int u) {
  const UnitPlan& up = plan_.units[u];
  dcomm_->all_gather(params_[u].data(), gather_buf_.data(), static_cast<size_t>(up.shard_size));
  gathered_ = u;
  return gather_buf_.data();
}

template <typename T> T* Fsdp<T>::full_grad(int u) {
  be_.zero(grad_buf_.data(), static_cast<size_t>(plan_.units[u].padded_numel));
  return grad_buf_.data();
}

template <typename T> void Fsdp<T>::reduce_scatter_grad(int u) {
  // G: ranks of the shard group (blocks of the buffer); the mean is over all G * R ranks.
  const size_t S = static_cast<size_t>(plan_.units[u].shard_size), G = static_cast<size_t>(plan_.world_size);
  const T inv_w = T(1) / static_cast<T>(G * static_cast<size_t>(replicas()));
  reduce_scatter_slabs(
      *dcomm_, grad_buf_.data(), S, G, slab_, pack_.data(), scatter_tmp_.data(),
      [&](T* d, const T* src, size_t n) { be_.copy(d, src, n); },
      [&](size_t a, size_t n, T* sum) {
        replica_sum(rcomm_, sum, n);
        be_.axpy(n, inv_w, sum, grads_[u].data() + a);
      });
}

template <typename T> std::vector<T> Fsdp<T>::gather_param(const std::string& name) {
  for (size_t u = 0; u < plan_.units.size(); ++u)
    for (auto& slot : plan_.units[u].params)
      if (slot.spec.name == name) {
        const T* full = gather(static_cast<int>(u));
        std::vector<T> out(static_cast<size_t>(slot.numel));
        be_.to_host(out.data(), full + slot.offset, out.size());
        return out;
      }
  throw std::out_of_range("no parameter named '" + name + "'");
}

template <typename T> void Fsdp<T>::set_param(const std::string& name, const std::vector<T>& full) {
  int r = plan_rank();
  for (size_t u = 0; u < plan_.units.size(); ++u)
    for (auto& slot : plan_.units[u].params)
      if (slot.spec.name == name) {
        if (static_cast<int64_t>(full.size()) != slot.numel)
          throw std::invalid_argument("set_param '" + name + "': expected " + std::to_string(slot.numel) +
                                      " elements, got " + std::to_string(full.size()));
        const RankShard& rs = plan_.units[u].ranks[r];
        int64_t lo = std::max(slot.offset, rs.start), hi = std::min(slot.offset + slot.numel, rs.start + rs.valid);
        if (hi > lo)
          be_.from_host(params_[u].data() + (lo - rs.start), full.data() + (lo - slot.offset),
                        static_cast<size_t>(hi - lo));
        gathered_ = -1;
        return;
      }
  throw std::out_of_range("no parameter named '" + name + "'");
}

template <typename T> double Fsdp<T>::local_grad_sumsq() {
  int r = plan_rank();
  double s = 0;
  for (size_t u = 0; u < plan_.units.size(); ++u)
    s += be_.sum_squares(grads_[u].data(), static_cast<size_t>(plan_.units[u].ranks[r].valid));
  return s;
}

MixedPrecisionUnits::MixedPrecisionUnits(Fsdp<float>& master, Backend<bf16>& be, bool reduce_bf16,
                                         size_t widen_slab)
    : m_(master), be_(be), reduce_bf16_(reduce_bf16) {
  const size_t max_padded = static_cast<size_t>(m_.plan().max_padded_numel());
  const size_t max_shard = static_cast<size_t>(m_.plan().max_shard_size());
  shard_ = Buffer<bf16>(be_, max_shard);
  gather_ = Buffer<bf16>(be_, max_padded);
  grad_ = Buffer<bf16>(be_, max_padded);
  if (reduce_bf16_) {
    scatter_ = Buffer<bf16>(be_, max_shard);
  } else {
    slab_ = reduce_slab(m_.plan(), widen_slab);
    grad32_ = Buffer<float>(m_.backend(), slab_ * static_cast<size_t>(m_.plan().world_size));
    scatter32_ = Buffer<float>(m_.backend(), slab_);
  }
  if (reduce_bf16_ && m_.replica_comm()) replica32_ = Buffer<float>(m_.backend(), max_shard);
}

const bf16* MixedPrecisionUnits::gather(int u) {
  const size_t S = static_cast<size_t>(m_.plan().units[u].shard_size);
  be_.from_f32(shard_.data(), m_.param_shard(u), S);
  m_.data_comm().all_gather(shard_.data(), gather_.data(), S);
  return gather_.data();
}

bf16* MixedPrecisionUnits::full_grad(int u) {
  be_.zero(grad_.data(), static_cast<size_t>(m_.plan().units[u].padded_numel));
  return grad_.data();
}

void MixedPrecisionUnits::reduce_scatter_grad(int u) {
  // G: ranks of the shard group (blocks of the buffer); the mean is over all G * R ranks.
  const size_t S = static_cast<size_t>(m_.plan().units[u].shard_size), G = static_cast<size_t>(m_.plan().world_size);
  const float inv_w = 1.0f / static_cast<float>(G * static_cast<size_t>(m_.replicas()));
  float* shard = m_.grad_shard(u);
  Backend<float>& b32 = m_.backend();
  Comm* rc = m_.replica_comm();
  if (reduce_bf16_)  // in bf16, the whole shard at once (scatter_ is shard-sized)
    reduce_scatter_slabs(
        m_.data_comm(), grad_.data(), S, G, S, static_cast<bf16*>(nullptr), scatter_.data(),
        [](bf16*, const bf16*, size_t) {},
        [&](size_t a, size_t n, const bf16* sum) {
          if (!rc) return be_.add_to_f32(shard + a, inv_w, sum, n);
          float* w = replica32_.data();  // HSDP: the group's bf16 sum widened, summed over replicas in fp32
          b32.zero(w, n);
          be_.add_to_f32(w, 1.0f, sum, n);
          replica_sum(rc, w, n);
          b32.axpy(n, inv_w, w, shard + a);
        });
  else  // widened to fp32 a slab at a time: [G, n] of at most slab_ * G floats
    reduce_scatter_slabs(
        m_.data_comm(), grad_.data(), S, G, slab_, grad32_.data(), scatter32_.data(),
        [&](float* d, const bf16* src, size_t n) {
          b32.zero(d, n);
          be_.add_to_f32(d, 1.0f, src, n);
        },
        [&](size_t a, size_t n, float* sum) {
          replica_sum(rc, sum, n);
          b32.axpy(n, inv_w, sum, shard + a);
        });
}

template class Fsdp<float>;
template class Fsdp<double>;

}  // namespace shardtrain
