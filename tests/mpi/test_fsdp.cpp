// Multi-rank tests of the FSDP engine (the runtime collectives and error agreement are in
// test_comm.cpp). Run under mpirun at 1, 2, 3 and 4 ranks; every test passes at each size.
//
// Rules that keep these tests from hanging: every rank makes the same collective calls in the
// same order whatever its local results, so checks after a collective are EXPECT_* (never an
// ASSERT_* that could return early on one rank only). gtest prints on rank 0 only, so the fixture
// all-reduces "did this rank fail" after each test and rank 0 reports failures of other ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard.h"
#include "../test_env.h"
#include "counting_backend.h"
#include "rank_test.h"

using shardtrain::testing::count_diff;

namespace st = shardtrain;
using st::bf16;

namespace {

st::Comm& world() { return st::testing::comm(); }

using st::testing::CountingBackend;

st::ParamSpec pspec(std::string name, std::vector<int64_t> shape, st::Init init, double stdev = 0.02) {
  st::ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.init = init;
  p.init_std = stdev;
  p.weight_decay = init == st::Init::Normal;
  return p;
}

// Units with sizes that do not divide by 2, 3 or 4, units with fewer elements than ranks, and
// parameters that straddle shard boundaries.
std::vector<st::UnitSpec> test_units() {
  using st::Init;
  return {
      {"model.embed_tokens", {pspec("model.embed_tokens.weight", {5, 7}, Init::Normal, 0.02)}},
      {"model.layers.0",
       {pspec("model.layers.0.input_layernorm.weight", {13}, Init::Ones),
        pspec("model.layers.0.self_attn.q_proj.weight", {5, 7}, Init::Normal, 0.05),
        pspec("model.layers.0.self_attn.q_proj.bias", {2}, Init::Zeros),
        pspec("model.layers.0.mlp.up_proj.weight", {3, 3}, Init::Normal, 1.5)}},
      {"model.norm", {pspec("model.norm.weight", {2}, Init::Ones)}},
      {"scalar", {pspec("scalar.x", {1}, Init::Normal, 0.7)}},
      {"norm6", {pspec("model.layers.1.post_attention_layernorm.weight", {6}, Init::Ones)}},
  };
}

// The value init_params must give element i of parameter p, independent of the world size.
template <typename T> T expected_init(uint64_t seed, const st::ParamSpec& p, int64_t i) {
  switch (p.init) {
    case st::Init::Ones: return T(1);
    case st::Init::Zeros: return T(0);
    case st::Init::Normal:
      return static_cast<T>(st::counter_normal(seed, st::fnv1a64(p.name), static_cast<uint64_t>(i)) * p.init_std);
  }
  return T(0);
}

template <typename T> std::vector<T> expected_param(uint64_t seed, const st::ParamSpec& p) {
  std::vector<T> v(static_cast<size_t>(p.numel()));
  for (int64_t i = 0; i < p.numel(); ++i) v[static_cast<size_t>(i)] = expected_init<T>(seed, p, i);
  return v;
}

template <typename T> std::vector<T> host_copy(st::Backend<T>& be, const T* dev, int64_t n) {
  std::vector<T> h(static_cast<size_t>(n));
  if (n > 0) be.to_host(h.data(), dev, h.size());
  return h;
}

// Rank-dependent gradient value for element i of unit u in round k.
double grad_value(int rank, int u, int64_t i, int round) {
  return std::sin(0.37 * static_cast<double>(i) + 1.3 * rank + 0.11 * u + 2.0 * round) + 0.25 * rank - 0.1 * round;
}

bool near(double got, double want, double rel = 1e-12) {
  return std::fabs(got - want) <= rel * (1.0 + std::fabs(want));
}

}  // namespace

// Fixture: the suite is called Fsdp; names from the library are written st::... to avoid clashing
// with st::Fsdp<T>.
class Fsdp : public st::testing::RankTest {};

// ---------------------------------------------------------------------------------------------
// FSDP engine

namespace {
struct Engine {
  std::unique_ptr<st::Backend<double>> be = st::make_cpu_backend<double>();
  st::Fsdp<double> fsdp;
  Engine() : fsdp(*be, world(), st::ShardPlan::build(test_units(), world().world_size())) {}
};
}  // namespace

TEST_F(Fsdp, PlanMatchesCommAndRejectsWrongWorld) {
  Engine e;
  EXPECT_EQ(e.fsdp.plan().world_size, world().world_size());
  EXPECT_EQ(e.fsdp.num_units(), static_cast<int>(test_units().size()));
  auto wrong = st::ShardPlan::build(test_units(), world().world_size() + 1);
  EXPECT_THROW([&] { st::Fsdp<double> tmp(*e.be, world(), wrong); }(), std::invalid_argument);
}

TEST_F(Fsdp, InitParamsMatchesWorldSizeOne) {
  Engine e;
  const int r = world().rank();
  for (uint64_t seed : {uint64_t{1234}, uint64_t{0xdeadbeefcafeULL}}) {
    e.fsdp.init_params(seed);
    for (const auto& up : e.fsdp.plan().units) {
      for (const auto& slot : up.params) {
        std::vector<double> got = e.fsdp.gather_param(slot.spec.name);
        std::vector<double> want = expected_param<double>(seed, slot.spec);
        EXPECT_EQ(got.size(), want.size()) << slot.spec.name;
        EXPECT_EQ(count_diff(got, want), 0) << slot.spec.name << " seed " << seed;
      }
    }
    // This rank's shards hold exactly its slice of the flat buffer, then zero padding.
    for (int u = 0; u < e.fsdp.num_units(); ++u) {
      const auto& up = e.fsdp.plan().units[static_cast<size_t>(u)];
      const auto& rs = up.ranks[static_cast<size_t>(r)];
      std::vector<double> flat;
      for (const auto& slot : up.params) {
        auto t = expected_param<double>(seed, slot.spec);
        flat.insert(flat.end(), t.begin(), t.end());
      }
      std::vector<double> want(static_cast<size_t>(up.shard_size), 0.0);
      for (int64_t k = 0; k < rs.valid; ++k) want[static_cast<size_t>(k)] = flat[static_cast<size_t>(rs.start + k)];
      EXPECT_EQ(count_diff(host_copy(*e.be, e.fsdp.param_shard(u), up.shard_size), want), 0) << up.name;
    }
  }
  // Different seeds give different Normal parameters.
  e.fsdp.init_params(1);
  auto a = e.fsdp.gather_param("model.embed_tokens.weight");
  e.fsdp.init_params(2);
  auto b = e.fsdp.gather_param("model.embed_tokens.weight");
  EXPECT_GT(count_diff(a, b), 30);
}

TEST_F(Fsdp, InitParamsFloat) {
  auto be = st::make_cpu_backend<float>();
  st::Fsdp<float> f(*be, world(), st::ShardPlan::build(test_units(), world().world_size()));
  f.init_params(99);
  for (const auto& up : f.plan().units)
    for (const auto& slot : up.params)
      EXPECT_EQ(count_diff(f.gather_param(slot.spec.name), expected_param<float>(99, slot.spec)), 0) << slot.spec.name;
}

TEST_F(Fsdp, GatherPlacesParamsAtOffsetsWithZeroPadding) {
  Engine e;
  const uint64_t seed = 77;
  e.fsdp.init_params(seed);
  // Gather every unit twice, in different orders: the buffer holds the latest unit only.
  std::vector<int> order;
  for (int u = 0; u < e.fsdp.num_units(); ++u) order.push_back(u);
  for (int u = e.fsdp.num_units() - 1; u >= 0; --u) order.push_back(u);
  for (int u : order) {
    const auto& up = e.fsdp.plan().units[static_cast<size_t>(u)];
    const double* full = e.fsdp.gather(u);
    std::vector<double> h = host_copy(*e.be, full, up.padded_numel);
    for (const auto& slot : up.params) {
      std::vector<double> part(h.begin() + slot.offset, h.begin() + slot.offset + slot.numel);
      EXPECT_EQ(count_diff(part, expected_param<double>(seed, slot.spec)), 0) << up.name << " / " << slot.spec.name;
    }
    int64_t nonzero = 0;
    for (int64_t i = up.numel; i < up.padded_numel; ++i)
      if (h[static_cast<size_t>(i)] != 0.0) ++nonzero;
    EXPECT_EQ(nonzero, 0) << "padding of gathered unit " << up.name;
  }
}

// Prefetch (issue 15): the second pass with a label gathers ahead along the order the first one
// recorded (more all-gathers are started than asked for, before they are asked for), a pass that
// leaves the recorded order still gets the right parameters, and asynchronous reduce-scatters land
// in the gradient shards by end_pass with the values of the waiting engine, bitwise.
TEST_F(Fsdp, PrefetchFollowsRecordedOrderAndStaysCorrect) {
  auto be = st::make_cpu_backend<double>();
  const int W = world().world_size(), r = world().rank();
  for (st::CommProgress prog : {st::CommProgress::Thread, st::CommProgress::Poll, st::CommProgress::Wait}) {
    SCOPED_TRACE(st::comm_progress_name(prog));
    st::Fsdp<double> ref(*be, world(), st::ShardPlan::build(test_units(), W));
    st::Fsdp<double> f(*be, world(), st::ShardPlan::build(test_units(), W), nullptr, nullptr,
                        st::OverlapConfig{true, 2, prog});
    ref.init_params(31);
    f.init_params(31);
    const int U = f.num_units();
    auto check_unit = [&](int u, const double* full) {
      const auto& up = f.plan().units[static_cast<size_t>(u)];
      std::vector<double> h = host_copy(*be, full, up.padded_numel);
      for (const auto& slot : up.params) {
        std::vector<double> part(h.begin() + slot.offset, h.begin() + slot.offset + slot.numel);
        EXPECT_EQ(count_diff(part, expected_param<double>(31, slot.spec)), 0) << up.name;
      }
    };
    // Order of a "step": forward 0..U-1, backward U-2..1 with a gradient per unit.
    std::vector<int> order;
    for (int u = 0; u < U; ++u) order.push_back(u);
    for (int u = U - 2; u >= 1; --u) order.push_back(u);
    auto step = [&](st::UnitPipeline<double>& src, bool deviate, int round) {
      src.begin_pass("train");
      for (size_t i = 0; i < order.size(); ++i) {
        const int u = deviate && i == 2 ? U - 1 : order[i];  // leaves the recorded order at position 2
        const int64_t before = src.comm_times().jobs;
        const double* full = src.gather(u);
        check_unit(u, full);
        if (&src == &f && round == 1 && !deviate && i + 2 < order.size()) {
          // Units i+1 and i+2 are in flight or done as well (prefetch 2), started no later than now.
          EXPECT_EQ(src.comm_times().jobs - before, i == 0 ? 3 : 1) << "position " << i;
        }
        if (i >= static_cast<size_t>(U)) {  // backward: a gradient for this unit
          const auto& up = f.plan().units[static_cast<size_t>(u)];
          double* g = src.full_grad(u);
          std::vector<double> host(static_cast<size_t>(up.numel));
          for (int64_t k = 0; k < up.numel; ++k) host[static_cast<size_t>(k)] = grad_value(r, u, k, round);
          be->from_host(g, host.data(), host.size());
          src.reduce_scatter_grad(u);
        }
      }
      src.end_pass();
    };
    for (int round = 0; round < 3; ++round) {
      ref.zero_grads();
      f.zero_grads();
      step(ref, round == 2, round);
      step(f, round == 2, round);
      for (int u = 0; u < U; ++u) {
        const auto& up = f.plan().units[static_cast<size_t>(u)];
        EXPECT_EQ(count_diff(host_copy(*be, f.grad_shard(u), up.shard_size), host_copy(*be, ref.grad_shard(u), up.shard_size)), 0)
            << up.name << " round " << round;
      }
    }
    // The timing is accounted.
    const st::CommTimes t = f.comm_times();
    EXPECT_GT(t.collectives, 0);
    EXPECT_GE(t.issued_s, 0.0);
    EXPECT_GE(t.exposed_s, 0.0);
  }
}

// A stream-ordered Comm (Comm::stream_ordered, as NcclComm) emulated on the host, for the CPU
// tests of the CommQueue / UnitPipeline path that GPUs take: start_* snapshot the input (what the
// communication stream would read after the compute stream's event) and queue the collective;
// with lazy == true it runs only when a Request::wait(), synchronize() or blocking call orders it
// (the slowest device: a read of the output before wait() sees stale data), with lazy == false at
// once (the fastest). Collectives run in start order, as on one stream. duplicate() makes another
// such Comm on a duplicate of the host Comm: another stream (ncclCommSplit's), whose collectives
// this one's synchronize() covers. Each stream counts what was started on it and the
// compute-stream waits (the first Request::wait of each request, as NcclComm's).
class EmulatedStreamComm final : public st::Comm {
 public:
  struct StreamStats {
    int64_t all_gathers = 0, reduce_scatters = 0, waits = 0;
  };
  EmulatedStreamComm(st::Comm& host, bool lazy) : host_(host), lazy_(lazy) {}
  ~EmulatedStreamComm() override {
    if (parent_) std::erase(parent_->children_, this);
  }
  std::unique_ptr<st::Comm> duplicate() override {
    auto dup = host_.duplicate();
    st::Comm& h = *dup;
    auto c = std::make_unique<EmulatedStreamComm>(h, lazy_);
    c->own_host_ = std::move(dup);
    c->parent_ = this;
    c->stats_ = stats_;
    c->id_ = stats_->size();
    stats_->emplace_back();
    children_.push_back(c.get());
    return c;
  }
  // Per stream: [0] this Comm, then its duplicates in creation order.
  const std::vector<StreamStats>& streams() const { return *stats_; }
  int rank() const override { return host_.rank(); }
  int world_size() const override { return host_.world_size(); }
  void barrier() override { host_.barrier(); }
  void set_collective_timeout(double s) override { host_.set_collective_timeout(s); }
  void watch_begin(const char* w) override { host_.watch_begin(w); }
  void watch_end() override { host_.watch_end(); }
  void* mpi_handle() const override { return host_.mpi_handle(); }
  bool asynchronous() const override { return true; }
  bool stream_ordered() const override { return true; }
  void synchronize() override {
    for (EmulatedStreamComm* c : children_) c->flush(c->ops_.size());
    flush(ops_.size());
    ++syncs;
  }
  void all_gather_impl(const void* s, void* r, size_t n, DType t) override { flush(ops_.size()), host_.all_gather_impl(s, r, n, t); }
  void reduce_scatter_sum_impl(const void* s, void* r, size_t n, DType t) override {
    flush(ops_.size());
    host_.reduce_scatter_sum_impl(s, r, n, t);
  }
  void all_reduce_impl(void* b, size_t n, DType t, st::ReduceOp op) override { flush(ops_.size()), host_.all_reduce_impl(b, n, t, op); }
  void broadcast_impl(void* b, size_t n, DType t, int root) override { flush(ops_.size()), host_.broadcast_impl(b, n, t, root); }
  std::unique_ptr<Request> start_all_gather_impl(const void* s, void* r, size_t n, DType t) override {
    return start(false, s, r, n, t, n * dtype_size(t));
  }
  std::unique_ptr<Request> start_reduce_scatter_sum_impl(const void* s, void* r, size_t n, DType t) override {
    return start(true, s, r, n, t, n * static_cast<size_t>(world_size()) * dtype_size(t));
  }
  // Point-to-point: everything started before runs first (one stream), then the host Comm's
  // nonblocking transfer, whose Request this returns (the fastest device).
  std::unique_ptr<Request> start_send_impl(const void* s, size_t n, DType t, int peer, int tag) override {
    flush(ops_.size());
    return host_.start_send_impl(s, n, t, peer, tag);
  }
  std::unique_ptr<Request> start_recv_impl(void* r, size_t n, DType t, int peer, int tag) override {
    flush(ops_.size());
    return host_.start_recv_impl(r, n, t, peer, tag);
  }
  int syncs = 0;

 private:
  struct Op {
    bool reduce;
    std::vector<char> in;
    void* out;
    size_t count;
    DType t;
  };
  struct Req final : Request {
    EmulatedStreamComm* c;
    size_t index;
    bool waited = false;
    bool test() override { return c->done_ > index; }
    void wait() override {
      if (!waited) ++(*c->stats_)[c->id_].waits;
      waited = true;
      c->flush(index + 1);
    }
  };
  std::unique_ptr<Request> start(bool reduce, const void* s, void* r, size_t n, DType t, size_t bytes) {
    ++(reduce ? (*stats_)[id_].reduce_scatters : (*stats_)[id_].all_gathers);
    const char* p = static_cast<const char*>(s);
    ops_.push_back(Op{reduce, std::vector<char>(p, p + bytes), r, n, t});
    auto q = std::make_unique<Req>();
    q->c = this;
    q->index = ops_.size() - 1;
    if (!lazy_) flush(ops_.size());
    return q;
  }
  void flush(size_t upto) {
    for (; done_ < upto; ++done_) {
      Op& o = ops_[done_];
      // The nonblocking MPI calls, as the reference pipeline makes them (Open MPI's blocking
      // reduce-scatter adds in another order: bf16 sums could differ in the last bit at W = 4).
      if (o.reduce) host_.start_reduce_scatter_sum_impl(o.in.data(), o.out, o.count, o.t)->wait();
      else host_.start_all_gather_impl(o.in.data(), o.out, o.count, o.t)->wait();
      std::vector<char>().swap(o.in);
    }
  }
  st::Comm& host_;
  bool lazy_;
  std::vector<Op> ops_;
  size_t done_ = 0;
  std::unique_ptr<st::Comm> own_host_;  // a duplicate's host Comm
  EmulatedStreamComm* parent_ = nullptr;
  std::vector<EmulatedStreamComm*> children_;
  std::shared_ptr<std::vector<StreamStats>> stats_ = std::make_shared<std::vector<StreamStats>>(1);
  size_t id_ = 0;
};

// Point-to-point on the emulated stream Comm (lazy and eager): a ring shift started after an
// all-gather that is still queued runs after it (one stream: the all-gather's result is there
// before anything was waited for) and delivers the left neighbour's block.
TEST_F(Fsdp, EmulatedStreamCommRingShiftFollowsQueuedCollectives) {
  const int W = world().world_size(), r = world().rank();
  for (bool lazy : {true, false}) {
    EmulatedStreamComm dev(world(), lazy);
    std::vector<double> gin(3, r + 0.5), gout(3 * static_cast<size_t>(W), -1.0), want_g(gout.size());
    for (int q = 0; q < W; ++q)
      for (int i = 0; i < 3; ++i) want_g[static_cast<size_t>(3 * q + i)] = q + 0.5;
    auto ag = dev.start_all_gather(gin.data(), gout.data(), 3);
    std::vector<double> send(1000), recv(1000, -1.0), want(1000);
    for (int i = 0; i < 1000; ++i) {
      send[static_cast<size_t>(i)] = 1000.0 * r + i;
      want[static_cast<size_t>(i)] = 1000.0 * ((r + W - 1) % W) + i;
    }
    auto q = dev.start_ring_shift(send.data(), recv.data(), recv.size());
    EXPECT_EQ(count_diff(gout, want_g), 0) << (lazy ? "lazy" : "eager") << ": the queued all-gather ran first";
    q->wait();
    ag->wait();
    EXPECT_EQ(count_diff(recv, want), 0) << (lazy ? "lazy" : "eager");
  }
}

// The GPU's overlap path on the CPU: over a stream-ordered data Comm (emulated, lazy and eager),
// the pipeline enqueues every collective at submit and orders instead of waiting; gathered units,
// gradient shards (fp64; mixed precision with fp32 and bf16 reduce) equal the waiting engine's
// bitwise, over three passes with prefetch 1 and 2, and end_pass synchronizes the lane once.
TEST_F(Fsdp, StreamOrderedLaneMatchesWaitingEngine) {
  auto be = st::make_cpu_backend<double>();
  auto be32 = st::make_cpu_backend<float>();
  auto be16 = st::make_cpu_backend<bf16>();
  const int W = world().world_size(), r = world().rank();
  for (bool lazy : {true, false})
    for (int prefetch : {1, 2}) {
      SCOPED_TRACE(std::string(lazy ? "lazy" : "eager") + " stream, prefetch " + std::to_string(prefetch));
      EmulatedStreamComm dev(world(), lazy);
      const st::OverlapConfig ov{true, prefetch, st::CommProgress::Poll};
      st::Fsdp<double> ref(*be, world(), st::ShardPlan::build(test_units(), W));
      st::Fsdp<double> f(*be, world(), st::ShardPlan::build(test_units(), W), &dev, nullptr, ov);
      ref.init_params(41);
      f.init_params(41);
      const int U = f.num_units();
      std::vector<int> order;
      for (int u = 0; u < U; ++u) order.push_back(u);
      for (int u = U - 1; u >= 0; --u) order.push_back(u);
      for (int round = 0; round < 3; ++round) {
        ref.zero_grads();
        f.zero_grads();
        const int syncs = dev.syncs;
        for (st::UnitPipeline<double>* src : {static_cast<st::UnitPipeline<double>*>(&ref), static_cast<st::UnitPipeline<double>*>(&f)}) {
          src->begin_pass("train");
          for (size_t i = 0; i < order.size(); ++i) {
            const int u = order[i];
            const auto& up = f.plan().units[static_cast<size_t>(u)];
            std::vector<double> h = host_copy(*be, src->gather(u), up.padded_numel);
            for (const auto& slot : up.params) {
              std::vector<double> part(h.begin() + slot.offset, h.begin() + slot.offset + slot.numel);
              EXPECT_EQ(count_diff(part, expected_param<double>(41, slot.spec)), 0) << up.name << " position " << i;
            }
            if (i < static_cast<size_t>(U)) continue;
            std::vector<double> g(static_cast<size_t>(up.padded_numel), 0.0);
            for (int64_t k = 0; k < up.numel; ++k) g[static_cast<size_t>(k)] = grad_value(r, u, k, round);
            be->from_host(src->full_grad(u), g.data(), g.size());
            src->reduce_scatter_grad(u);
          }
          src->end_pass();
        }
        EXPECT_EQ(dev.syncs, syncs + 1) << "one synchronize per pass";
        for (int u = 0; u < U; ++u) {
          const auto& up = f.plan().units[static_cast<size_t>(u)];
          EXPECT_EQ(count_diff(host_copy(*be, f.grad_shard(u), up.shard_size), host_copy(*be, ref.grad_shard(u), up.shard_size)), 0)
              << up.name << " round " << round;
        }
      }
      for (bool reduce_bf16 : {false, true}) {  // mixed precision, slabs of 7 elements per rank: many parts
        st::ShardedState<float> m_ref(*be32, world(), st::ShardPlan::build(test_units(), W), nullptr);
        st::ShardedState<float> m_dev(*be32, world(), st::ShardPlan::build(test_units(), W), &dev);
        st::MixedPrecisionUnits a(m_ref, *be16, reduce_bf16, size_t{7} * W);
        st::MixedPrecisionUnits b(m_dev, *be16, reduce_bf16, size_t{7} * W, ov);
        m_ref.init_params(43);
        m_dev.init_params(43);
        m_ref.zero_grads();
        m_dev.zero_grads();
        for (st::MixedPrecisionUnits* src : {&a, &b})
          for (int pass = 0; pass < 2; ++pass) {
            src->begin_pass("train");
            for (size_t i = 0; i < order.size(); ++i) {
              const int u = order[i];
              const auto& up = m_ref.plan().units[static_cast<size_t>(u)];
              std::vector<bf16> h = host_copy(*be16, src->gather(u), up.padded_numel);
              for (const auto& slot : up.params) {
                std::vector<float> want = expected_param<float>(43, slot.spec);
                int64_t bad = 0;
                for (int64_t k = 0; k < slot.numel; ++k)
                  bad += st::math::bf16_to_f32(h[static_cast<size_t>(slot.offset + k)]) != st::math::bf16_to_f32(st::math::f32_to_bf16(want[static_cast<size_t>(k)]));
                EXPECT_EQ(bad, 0) << up.name << " / " << slot.spec.name << " position " << i;
              }
              if (i < static_cast<size_t>(U)) continue;
              std::vector<bf16> g(static_cast<size_t>(up.padded_numel), st::math::f32_to_bf16(0.0f));
              for (int64_t k = 0; k < up.numel; ++k) g[static_cast<size_t>(k)] = st::math::f32_to_bf16(static_cast<float>(grad_value(r, u, k, pass)));
              be16->from_host(src->full_grad(u), g.data(), g.size());
              src->reduce_scatter_grad(u);
            }
            src->end_pass();
          }
        for (int u = 0; u < U; ++u) {
          const auto& up = m_ref.plan().units[static_cast<size_t>(u)];
          EXPECT_EQ(count_diff(host_copy(*be32, m_dev.grad_shard(u), up.shard_size),
                               host_copy(*be32, m_ref.grad_shard(u), up.shard_size)),
                    0)
              << up.name << (reduce_bf16 ? " (bf16 reduce)" : " (fp32 reduce)");
        }
      }
    }
}

// Two passes (forward 0..U-1, backward U-1..0 with a gradient per unit) of `src`; returns the
// number of reduce_scatter_grad calls.
template <typename C>
int64_t two_passes(st::UnitPipeline<C>& src, const st::ShardPlan& plan, st::Backend<C>& be, int rank) {
  const int U = static_cast<int>(plan.units.size());
  int64_t reduces = 0;
  for (int pass = 0; pass < 2; ++pass) {
    src.begin_pass("train");
    for (int i = 0; i < 2 * U; ++i) {
      const int u = i < U ? i : 2 * U - 1 - i;
      const auto& up = plan.units[static_cast<size_t>(u)];
      src.gather(u);
      if (i < U) continue;
      auto to_c = [](double v) {
        if constexpr (std::is_same_v<C, bf16>) return st::math::f32_to_bf16(static_cast<float>(v));
        else return static_cast<C>(v);
      };
      std::vector<C> g(static_cast<size_t>(up.padded_numel), to_c(0.0));
      for (int64_t k = 0; k < up.numel; ++k) g[static_cast<size_t>(k)] = to_c(grad_value(rank, u, k, pass));
      be.from_host(src.full_grad(u), g.data(), g.size());
      src.reduce_scatter_grad(u);
      ++reduces;
    }
    src.end_pass();
  }
  return reduces;
}

// The stream lane's waits and streams (issue 28): over an emulated NCCL Comm the pipeline's
// all-gathers and reduce-scatters go to two different duplicated streams (none to the data Comm's
// own), each unit's reduce-scatter is one collective with exactly one compute-stream wait, and
// each all-gather one collective with at most one; in fp64, and in mixed precision with widening
// slabs of 7 elements per rank (which the host lane cuts into many parts, each waited for). A
// stream lane that went back to waiting for every slab fails here.
TEST_F(Fsdp, StreamLaneOneWaitPerUnitAndSeparateStreams) {
  auto be = st::make_cpu_backend<double>();
  auto be32 = st::make_cpu_backend<float>();
  auto be16 = st::make_cpu_backend<bf16>();
  const int W = world().world_size(), r = world().rank();
  for (bool lazy : {true, false})
    for (bool mixed : {false, true}) {
      SCOPED_TRACE(std::string(lazy ? "lazy" : "eager") + (mixed ? " stream, mixed precision" : " stream, fp64"));
      EmulatedStreamComm dev(world(), lazy);
      const st::OverlapConfig ov{true, 1, st::CommProgress::Poll};
      int64_t reduces = 0, jobs = 0;
      if (mixed) {
        st::ShardedState<float> m(*be32, world(), st::ShardPlan::build(test_units(), W), &dev);
        st::MixedPrecisionUnits mp(m, *be16, false, size_t{7} * W, ov);
        m.init_params(47);
        reduces = two_passes<bf16>(mp, m.plan(), *be16, r);
        jobs = mp.comm_times().jobs;
      } else {
        st::Fsdp<double> f(*be, world(), st::ShardPlan::build(test_units(), W), &dev, nullptr, ov);
        f.init_params(47);
        reduces = two_passes<double>(f, f.plan(), *be, r);
        jobs = f.comm_times().jobs;
      }
      const auto& s = dev.streams();
      ASSERT_EQ(s.size(), 3u) << "the data Comm and two duplicates (all-gathers, reduce-scatters)";
      EXPECT_EQ(s[0].all_gathers + s[0].reduce_scatters, 0) << "nothing on the data Comm's own stream";
      const size_t ag = s[1].all_gathers > 0 ? 1 : 2, rs = 3 - ag;
      EXPECT_GT(s[ag].all_gathers, 0);
      EXPECT_EQ(s[ag].reduce_scatters, 0) << "all-gathers and reduce-scatters on different streams";
      EXPECT_EQ(s[rs].all_gathers, 0) << "all-gathers and reduce-scatters on different streams";
      EXPECT_EQ(s[rs].reduce_scatters, reduces) << "one reduce-scatter per unit";
      EXPECT_EQ(s[rs].waits, reduces) << "one compute-stream wait per unit's reduce-scatter";
      EXPECT_EQ(s[ag].all_gathers, jobs - reduces) << "one all-gather per unit";
      EXPECT_LE(s[ag].waits, s[ag].all_gathers) << "at most one compute-stream wait per unit's all-gather";
    }
}

TEST_F(Fsdp, SetParamRoundTrips) {
  Engine e;
  const uint64_t seed = 5;
  e.fsdp.init_params(seed);
  // Overwrite every other parameter with distinct values (same on every rank, as the API requires).
  std::map<std::string, std::vector<double>> now;
  int k = 0;
  for (const auto& up : e.fsdp.plan().units)
    for (const auto& slot : up.params) {
      std::vector<double> v = expected_param<double>(seed, slot.spec);
      if (k++ % 2 == 0) {
        for (size_t i = 0; i < v.size(); ++i) v[i] = 1000.0 * k + static_cast<double>(i) + 1.0 / 3.0;
        e.fsdp.set_param(slot.spec.name, v);
      }
      now[slot.spec.name] = v;
    }
  for (const auto& up : e.fsdp.plan().units)
    for (const auto& slot : up.params)
      EXPECT_EQ(count_diff(e.fsdp.gather_param(slot.spec.name), now[slot.spec.name]), 0) << slot.spec.name;
  // And the whole unit, padding included.
  for (int u = 0; u < e.fsdp.num_units(); ++u) {
    const auto& up = e.fsdp.plan().units[static_cast<size_t>(u)];
    std::vector<double> h = host_copy(*e.be, e.fsdp.gather(u), up.padded_numel);
    std::vector<double> want(static_cast<size_t>(up.padded_numel), 0.0);
    for (const auto& slot : up.params)
      std::copy(now[slot.spec.name].begin(), now[slot.spec.name].end(), want.begin() + slot.offset);
    EXPECT_EQ(count_diff(h, want), 0) << up.name;
  }
  // Local errors (no collective involved): wrong size, unknown names.
  EXPECT_THROW(e.fsdp.set_param("model.norm.weight", std::vector<double>(3, 1.0)), std::invalid_argument);
  EXPECT_THROW(e.fsdp.set_param("model.nope", std::vector<double>(2, 1.0)), std::out_of_range);
  EXPECT_THROW(e.fsdp.gather_param("model.nope"), std::out_of_range);
  // Still in step and unchanged after the rejected calls.
  EXPECT_EQ(count_diff(e.fsdp.gather_param("model.norm.weight"), now["model.norm.weight"]), 0);
}

TEST_F(Fsdp, ReduceScatterGradMeanAccumulatesAndSumsq) {
  Engine e;
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const auto& plan = e.fsdp.plan();
  const int U = e.fsdp.num_units();
  e.fsdp.zero_grads();

  // Independent expected mean gradient, accumulated over rounds: mean[u][i] = sum_k (1/W) sum_q g.
  std::vector<std::vector<double>> mean(static_cast<size_t>(U));
  for (int u = 0; u < U; ++u) mean[static_cast<size_t>(u)].assign(static_cast<size_t>(plan.units[static_cast<size_t>(u)].numel), 0.0);

  for (int round = 0; round < 2; ++round) {
    for (int u = 0; u < U; ++u) {
      const auto& up = plan.units[static_cast<size_t>(u)];
      double* g = e.fsdp.full_grad(u);
      // full_grad zeroes the whole padded buffer (it still holds the last unit's values).
      std::vector<double> before = host_copy(*e.be, static_cast<const double*>(g), up.padded_numel);
      EXPECT_EQ(count_diff(before, std::vector<double>(before.size(), 0.0)), 0) << "full_grad not zeroed";
      std::vector<double> host(static_cast<size_t>(up.numel));
      for (int64_t i = 0; i < up.numel; ++i) host[static_cast<size_t>(i)] = grad_value(r, u, i, round);
      e.be->from_host(g, host.data(), host.size());
      e.fsdp.reduce_scatter_grad(u);
      for (int64_t i = 0; i < up.numel; ++i) {
        double s = 0;
        for (int q = 0; q < W; ++q) s += grad_value(q, u, i, round);
        mean[static_cast<size_t>(u)][static_cast<size_t>(i)] += s / W;
      }
    }
    // Every shard: the accumulated mean on [start, start+valid), zero padding.
    for (int u = 0; u < U; ++u) {
      const auto& up = plan.units[static_cast<size_t>(u)];
      const auto& rs = up.ranks[static_cast<size_t>(r)];
      std::vector<double> h = host_copy(*e.be, static_cast<const double*>(e.fsdp.grad_shard(u)), up.shard_size);
      int64_t bad = 0, bad_pad = 0;
      double worst = 0;
      for (int64_t k = 0; k < rs.valid; ++k) {
        double want = mean[static_cast<size_t>(u)][static_cast<size_t>(rs.start + k)];
        if (!near(h[static_cast<size_t>(k)], want)) {
          ++bad;
          worst = std::max(worst, std::fabs(h[static_cast<size_t>(k)] - want));
        }
      }
      for (int64_t k = rs.valid; k < up.shard_size; ++k)
        if (h[static_cast<size_t>(k)] != 0.0) ++bad_pad;
      EXPECT_EQ(bad, 0) << up.name << " round " << round << " worst abs error " << worst;
      EXPECT_EQ(bad_pad, 0) << up.name << " round " << round << " gradient padding not zero";
    }
  }

  // Global squared norm of the mean gradient.
  double sumsq = e.fsdp.local_grad_sumsq();
  c.all_reduce(&sumsq, 1, st::ReduceOp::Sum);
  double want = 0;
  for (const auto& m : mean)
    for (double v : m) want += v * v;
  EXPECT_TRUE(near(sumsq, want)) << "sum of local_grad_sumsq " << sumsq << " vs " << want;

  // zero_grads clears everything.
  e.fsdp.zero_grads();
  double z = e.fsdp.local_grad_sumsq();
  c.all_reduce(&z, 1, st::ReduceOp::Sum);
  EXPECT_EQ(z, 0.0);
}

TEST_F(Fsdp, ReduceScatterGradLeavesOtherUnitsAlone) {
  Engine e;
  const int r = world().rank();
  e.fsdp.zero_grads();
  const int u = 1;  // model.layers.0
  double* g = e.fsdp.full_grad(u);
  const auto& up = e.fsdp.plan().units[static_cast<size_t>(u)];
  std::vector<double> host(static_cast<size_t>(up.numel), 1.0 + r);
  e.be->from_host(g, host.data(), host.size());
  e.fsdp.reduce_scatter_grad(u);
  const double mean = (world().world_size() + 1) / 2.0;  // mean of 1..W
  for (int v = 0; v < e.fsdp.num_units(); ++v) {
    const auto& vp = e.fsdp.plan().units[static_cast<size_t>(v)];
    const auto& rs = vp.ranks[static_cast<size_t>(r)];
    auto h = host_copy(*e.be, static_cast<const double*>(e.fsdp.grad_shard(v)), vp.shard_size);
    for (int64_t k = 0; k < vp.shard_size; ++k) {
      double want = (v == u && k < rs.valid) ? mean : 0.0;
      EXPECT_TRUE(near(h[static_cast<size_t>(k)], want)) << vp.name << " k=" << k << " got " << h[static_cast<size_t>(k)];
    }
  }
}

TEST_F(Fsdp, MemoryIsShardSized) {
  const int W = world().world_size();
  // A bigger model: 6 units of 1001..1006 elements plus the test units.
  auto units = test_units();
  for (int k = 0; k < 6; ++k)
    units.push_back({"big." + std::to_string(k), {pspec("big." + std::to_string(k) + ".w", {7, 143 + k}, st::Init::Normal)}});
  st::ShardPlan plan = st::ShardPlan::build(units, W);

  int64_t sum_shard = 0, max_padded = 0, max_shard = 0, total = 0;
  for (const auto& up : plan.units) {
    EXPECT_EQ(up.shard_size, std::max<int64_t>(1, (up.numel + W - 1) / W)) << up.name;
    EXPECT_LT(up.shard_size * W - up.numel, W) << up.name;
    sum_shard += up.shard_size;
    max_padded = std::max(max_padded, up.padded_numel);
    max_shard = std::max(max_shard, up.shard_size);
    total += up.numel;
  }
  // O(P / W): the shards of all units hold at most P/W + one element per unit.
  EXPECT_LE(sum_shard * W, total + W * static_cast<int64_t>(plan.units.size()));
  EXPECT_EQ(plan.max_padded_numel(), max_padded);
  EXPECT_EQ(plan.max_shard_size(), max_shard);

  CountingBackend<double> be;
  {
    st::Fsdp<double> f(be, world(), plan);
    // Each parameter and gradient shard is exactly one allocation of shard_size elements.
    for (int u = 0; u < f.num_units(); ++u) {
      const auto& up = f.plan().units[static_cast<size_t>(u)];
      auto pit = be.live.find(f.param_shard(u));
      auto git = be.live.find(f.grad_shard(u));
      EXPECT_TRUE(pit != be.live.end() && pit->second == static_cast<size_t>(up.shard_size)) << up.name;
      EXPECT_TRUE(git != be.live.end() && git->second == static_cast<size_t>(up.shard_size)) << up.name;
      EXPECT_NE(f.param_shard(u), f.grad_shard(u));
    }
    // Everything the engine holds: 2 * sum(S_u) for shards, plus the documented full-unit gather
    // and gradient buffers (largest unit) and a shard-sized scratch buffer.
    const size_t held = be.live_elements();
    EXPECT_EQ(held, static_cast<size_t>(2 * sum_shard + 2 * max_padded + max_shard));
    EXPECT_LE(held, static_cast<size_t>(2 * (total / W + static_cast<int64_t>(plan.units.size())) + 3 * max_padded));
    // Using the engine allocates nothing more.
    f.init_params(3);
    f.zero_grads();
    for (int u = 0; u < f.num_units(); ++u) {
      f.gather(u);
      f.full_grad(u);
      f.reduce_scatter_grad(u);
    }
    (void)f.gather_param("big.3.w");
    EXPECT_EQ(be.live_elements(), held);
  }
  EXPECT_TRUE(be.live.empty()) << "Fsdp leaked " << be.live.size() << " buffers";
  EXPECT_EQ(be.allocs, be.frees);
}

// ---------------------------------------------------------------------------------------------
// bf16 collectives and mixed precision (MixedPrecisionUnits over an fp32 Fsdp)

namespace {
bf16 b16(float f) { return st::math::f32_to_bf16(f); }
float f32(bf16 h) { return st::math::bf16_to_f32(h); }
}  // namespace

TEST_F(Fsdp, CommBf16AllGatherAndReduceScatter) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const size_t n = 5;
  std::vector<bf16> send(n), recv(n * W);
  for (size_t i = 0; i < n; ++i) send[i] = b16(static_cast<float>(r) + 0.125f * static_cast<float>(i));
  c.all_gather(send.data(), recv.data(), n);
  for (int q = 0; q < W; ++q)
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[q * n + i].bits, b16(static_cast<float>(q) + 0.125f * static_cast<float>(i)).bits);
  // Reduce-scatter sum: values chosen so that every partial sum is exact in bf16 (small dyadic
  // numbers), so any summation order gives the float sum exactly; then values that need rounding,
  // where the result must be within one bf16 rounding per addition of the float64 sum.
  std::vector<bf16> rs(n * W), out(n);
  for (int b = 0; b < W; ++b)
    for (size_t i = 0; i < n; ++i) rs[b * n + i] = b16(static_cast<float>(r + 1) * 0.5f + static_cast<float>(i + b));
  c.reduce_scatter_sum(rs.data(), out.data(), n);
  for (size_t i = 0; i < n; ++i) {
    float want = 0;
    for (int q = 0; q < W; ++q) want += static_cast<float>(q + 1) * 0.5f + static_cast<float>(i + r);
    ASSERT_EQ(f32(out[i]), want) << "element " << i;
  }
  for (int b = 0; b < W; ++b)
    for (size_t i = 0; i < n; ++i) rs[b * n + i] = b16(std::sin(1.7f * static_cast<float>(r + 3 * b) + static_cast<float>(i)));
  c.reduce_scatter_sum(rs.data(), out.data(), n);
  for (size_t i = 0; i < n; ++i) {
    double want = 0, mag = 0;
    for (int q = 0; q < W; ++q) {
      double v = f32(b16(std::sin(1.7f * static_cast<float>(q + 3 * r) + static_cast<float>(i))));
      want += v;
      mag += std::fabs(v);
    }
    EXPECT_NEAR(f32(out[i]), want, mag * W * 0.5 / 128) << "element " << i;  // W roundings of 2^-8 relative
  }
}

// The bf16 view gathers exactly the rounded fp32 master parameters, and its gradient reduce-scatter
// (fp32 or bf16) adds the rank mean into the fp32 gradient shard like Fsdp<float> does.
TEST_F(Fsdp, MixedPrecisionGatherAndReduceScatter) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  auto be32 = st::make_cpu_backend<float>();
  auto be16 = st::make_cpu_backend<bf16>();
  for (bool reduce_bf16 : {false, true}) {
    st::Fsdp<float> ref(*be32, c, st::ShardPlan::build(test_units(), W));
    st::ShardedState<float> master(*be32, c, st::ShardPlan::build(test_units(), W));
    ref.init_params(11);
    master.init_params(11);
    st::MixedPrecisionUnits mixed(master, *be16, reduce_bf16);
    for (int u = 0; u < ref.num_units(); ++u) {
      const st::UnitPlan& up = ref.plan().units[u];
      std::vector<float> full = host_copy(*be32, ref.gather(u), up.padded_numel);
      std::vector<bf16> half = host_copy(*be16, mixed.gather(u), up.padded_numel);
      for (int64_t i = 0; i < up.padded_numel; ++i)
        ASSERT_EQ(half[i].bits, b16(full[i]).bits) << "unit " << u << " element " << i;
      // Gradients: bf16-representable values, so fp32 and bf16 buffers start equal.
      std::vector<float> g32(up.padded_numel);
      std::vector<bf16> g16(up.padded_numel);
      for (int64_t i = 0; i < up.padded_numel; ++i) {
        g16[i] = b16(static_cast<float>(grad_value(r, u, i, 0)));
        g32[i] = f32(g16[i]);
      }
      be32->from_host(ref.full_grad(u), g32.data(), g32.size());
      ref.reduce_scatter_grad(u);
      be16->from_host(mixed.full_grad(u), g16.data(), g16.size());
      mixed.reduce_scatter_grad(u);
      std::vector<float> want = host_copy(*be32, ref.grad_shard(u), up.shard_size);
      std::vector<float> got = host_copy(*be32, master.grad_shard(u), up.shard_size);
      for (int64_t i = 0; i < up.shard_size; ++i) {
        // fp32 reduce: the same fp32 sum (order may differ: 1e-6); bf16 reduce: bf16 roundings.
        double tol = reduce_bf16 ? 2.0 * W / 256 : 1e-6;
        EXPECT_NEAR(got[i], want[i], tol * (1 + std::fabs(want[i]))) << "unit " << u << " shard element " << i
                                                                    << (reduce_bf16 ? " (bf16 reduce)" : "");
      }
    }
  }
}

// Hybrid sharding: for every shard group size G < W dividing W, a plan over G ranks with the shard
// group as data communicator and the replica group as replica communicator gathers the same units
// as plain FSDP, and its gradient shard is the mean over all W ranks (not G), in fp64, fp32 and
// mixed precision (fp32 and bf16 reduce). Summing local_grad_sumsq over replica group 0 alone
// counts every element once. The same with overlap on (the replica all-reduce then runs inside the
// asynchronous reduce-scatter job: on the communication thread, or polled), after end_pass().
TEST_F(Fsdp, HybridShardingMeanOverAllRanks) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  auto be64 = st::make_cpu_backend<double>();
  auto be32 = st::make_cpu_backend<float>();
  auto be16 = st::make_cpu_backend<bf16>();
  for (const st::OverlapConfig ov : {st::OverlapConfig{false, 0, st::CommProgress::Wait},
                                     st::OverlapConfig{true, 1, st::CommProgress::Thread},
                                     st::OverlapConfig{true, 1, st::CommProgress::Poll}})
  for (int G = 1; G < W; ++G) {
    if (W % G != 0) continue;
    SCOPED_TRACE("G = " + std::to_string(G) + ", overlap " + (ov.on ? "on, progress " : "off, ") +
                 st::comm_progress_name(ov.progress));
    st::MpiComm group = st::MpiComm::split(c, r / G, r), replica = st::MpiComm::split(c, r % G, r);
    EXPECT_EQ(group.world_size(), G);
    EXPECT_EQ(group.rank(), r % G);
    EXPECT_EQ(replica.world_size(), W / G);
    EXPECT_EQ(replica.rank(), r / G);
    st::Fsdp<double> f(*be64, c, st::ShardPlan::build(test_units(), G), &group, &replica, ov);
    EXPECT_EQ(f.plan_rank(), r % G);
    EXPECT_EQ(st::MeshLayout(st::MeshDims{W / G, G, 1, 1}).coord(r).dp_replicate, r / G);
    EXPECT_EQ(f.replicas(), W / G);
    f.init_params(5);
    f.zero_grads();
    double sumsq = 0;  // expected squared norm of the mean gradient
    for (int u = 0; u < f.num_units(); ++u) {
      const st::UnitPlan& up = f.plan().units[u];
      std::vector<double> full = host_copy(*be64, f.gather(u), up.padded_numel);
      for (const auto& slot : up.params) {
        std::vector<double> want = expected_param<double>(5, slot.spec);
        for (int64_t i = 0; i < slot.numel; ++i)
          EXPECT_EQ(full[static_cast<size_t>(slot.offset + i)], want[static_cast<size_t>(i)]) << slot.spec.name;
      }
      std::vector<double> g(static_cast<size_t>(up.padded_numel), 0.0);
      for (int64_t i = 0; i < up.numel; ++i) g[static_cast<size_t>(i)] = grad_value(r, u, i, 0);
      be64->from_host(f.full_grad(u), g.data(), g.size());
      f.reduce_scatter_grad(u);
      f.end_pass();  // overlap: the reduce-scatter (and replica sum) may still be in flight
      std::vector<double> got = host_copy(*be64, f.grad_shard(u), up.shard_size);
      const st::RankShard& rs = up.ranks[static_cast<size_t>(r % G)];
      for (int64_t k = 0; k < up.shard_size; ++k) {
        double want = 0;
        if (k < rs.valid)
          for (int q = 0; q < W; ++q) want += grad_value(q, u, rs.start + k, 0) / W;
        EXPECT_TRUE(near(got[static_cast<size_t>(k)], want, 1e-12)) << up.name << " element " << k << ": " << got[k]
                                                                    << " vs " << want;
      }
      for (int64_t i = 0; i < up.numel; ++i) {
        double m = 0;
        for (int q = 0; q < W; ++q) m += grad_value(q, u, i, 0) / W;
        sumsq += m * m;
      }
    }
    double norm = st::MeshLayout(st::MeshDims{W / G, G, 1, 1}).counts_in_norm(r) ? f.local_grad_sumsq() : 0.0;
    c.all_reduce(&norm, 1, st::ReduceOp::Sum);
    EXPECT_TRUE(near(norm, sumsq, 1e-10)) << norm << " vs " << sumsq;

    for (bool reduce_bf16 : {false, true}) {  // mixed precision over an fp32 master with replicas
      st::ShardedState<float> master(*be32, c, st::ShardPlan::build(test_units(), G), &group, &replica);
      st::MixedPrecisionUnits mixed(master, *be16, reduce_bf16, st::MixedPrecisionUnits::kWidenSlab, ov);
      master.zero_grads();
      for (int u = 0; u < master.num_units(); ++u) {
        const st::UnitPlan& up = master.plan().units[u];
        std::vector<bf16> g16(static_cast<size_t>(up.padded_numel), b16(0.0f));
        for (int64_t i = 0; i < up.numel; ++i) g16[static_cast<size_t>(i)] = b16(static_cast<float>(grad_value(r, u, i, 0)));
        be16->from_host(mixed.full_grad(u), g16.data(), g16.size());
        mixed.reduce_scatter_grad(u);
        mixed.end_pass();
        std::vector<float> got = host_copy(*be32, master.grad_shard(u), up.shard_size);
        const st::RankShard& rs = up.ranks[static_cast<size_t>(r % G)];
        for (int64_t k = 0; k < rs.valid; ++k) {
          double want = 0;
          for (int q = 0; q < W; ++q) want += f32(b16(static_cast<float>(grad_value(q, u, rs.start + k, 0)))) / W;
          const double tol = reduce_bf16 ? 2.0 * W / 256 : 1e-6;
          EXPECT_NEAR(got[static_cast<size_t>(k)], want, tol * (1 + std::fabs(want)))
              << up.name << " element " << k << (reduce_bf16 ? " (bf16 reduce)" : "");
        }
      }
    }
  }
}

// Unit groups (expert parallelism, docs/moe.md): with ep = N, the units of group 1 hold N-th slices
// of [E, 3, 5] tensors (experts [e E/N, (e+1) E/N) for EP index e = r % N, described as a Rows
// slice of degree N) and are sharded over the W / N ranks with that EP index (the mesh's expert
// shard group at dp_shard = W: shard indices e + k N); the other units over all W ranks. Through
// GroupedUnits (one pipeline per group), at every N dividing W and with overlap off and on:
//  - init_params gives each expert slice the canonical tensor's values (layout-independent);
//  - the block's gathered buffer stays valid while the expert unit is gathered (separate lanes);
//  - an expert unit's gradient is summed over its group and divided by W, not by W / N (the mean
//    over the same global tokens as every other gradient; the EP gradient-norm bug divides by the
//    group's size);
//  - the squared gradient norm summed over all ranks counts every element once.
TEST_F(Fsdp, ExpertUnitsShardOverTheirGroupAndAverageOverAllRanks) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  auto be64 = st::make_cpu_backend<double>();
  for (const st::OverlapConfig ov : {st::OverlapConfig{false, 0, st::CommProgress::Wait},
                                     st::OverlapConfig{true, 1, st::CommProgress::Thread}})
    for (int N = 1; N <= W; ++N) {
      if (W % N != 0) continue;
      SCOPED_TRACE("ep " + std::to_string(N) + ", overlap " + (ov.on ? "on" : "off"));
      const int e = r % N, E = 2 * N, El = E / N;
      std::vector<int> same;  // the mesh's expert shard group at dp_shard = W: the ranks of r's EP index
      for (int q = e; q < W; q += N) same.push_back(q);
      EXPECT_EQ(st::MeshLayout(st::MeshDims{1, W, 1, 1, 1, N}).expert_shard_group(r), same);
      st::MpiComm experts = st::MpiComm::split(c, e, r);
      EXPECT_EQ(experts.rank(), r / N);
      std::vector<st::UnitSpec> units = test_units();
      for (const char* name : {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}) {
        st::ParamSpec p = pspec(name, {El, 3, 5}, st::Init::Normal, 0.3);
        if (N > 1) p.tp = st::TpSlice{st::TpSplit::Rows, N, E, 15, static_cast<int64_t>(e) * El};
        units.push_back(st::UnitSpec{std::string(name) + ".unit", {p}, 1});
      }
      const st::ShardPlan plan = st::ShardPlan::build(units, W, W / N);
      st::ShardedState<double> state(*be64, c, plan, nullptr, nullptr, &experts);
      EXPECT_EQ(state.num_groups(), 2);
      EXPECT_EQ(state.mean_divisor(), W);
      std::vector<std::unique_ptr<st::UnitPipeline<double>>> lanes;
      for (int g = 0; g < 2; ++g)
        lanes.push_back(std::make_unique<st::UnitPipeline<double>>(
            *be64, std::make_unique<st::IdentityCodec<double>>(state, g), ov));
      st::GroupedUnits<double> src(std::move(lanes), state.plan());
      state.init_params(11);
      state.zero_grads();
      const int u0 = 1, nu = state.num_units();
      src.begin_pass("test");
      const double* block = src.gather(u0);  // must survive the expert units' gathers
      const std::vector<double> block_before = host_copy(*be64, block, plan.units[u0].padded_numel);
      for (int u : state.group_units(1)) src.gather(u);
      EXPECT_EQ(count_diff(host_copy(*be64, block, plan.units[u0].padded_numel), block_before), 0)
          << "the block's gathered unit changed while the expert units were gathered";
      double sumsq = 0;
      for (int u = 0; u < nu; ++u) {
        const st::UnitPlan& up = plan.units[static_cast<size_t>(u)];
        const int G = plan.group_size(up.group), row = up.group == 0 ? r : r / N;
        EXPECT_EQ(state.unit_rank(u), row) << up.name;
        EXPECT_EQ(up.ranks.size(), static_cast<size_t>(G)) << up.name;
        {
          const std::vector<double> full = host_copy(*be64, src.gather(u), up.padded_numel);
          for (const auto& slot : up.params)
            for (int64_t i = 0; i < slot.numel; ++i) {  // the canonical element this slice holds
              const int64_t ci = up.group == 1 ? static_cast<int64_t>(e) * El * 15 + i : i;
              EXPECT_EQ(full[static_cast<size_t>(slot.offset + i)], expected_init<double>(11, slot.spec, ci))
                  << slot.spec.name << " element " << i;
            }
        }
        // Rank q's gradient of local element i; the ranks of this unit's group share its elements.
        std::vector<double> g(static_cast<size_t>(up.padded_numel), 0.0);
        for (int64_t i = 0; i < up.numel; ++i) g[static_cast<size_t>(i)] = grad_value(r, u, i, 0);
        be64->from_host(src.full_grad(u), g.data(), g.size());
        src.reduce_scatter_grad(u);
      }
      src.end_pass();
      for (int u = 0; u < nu; ++u) {
        const st::UnitPlan& up = plan.units[static_cast<size_t>(u)];
        const int row = up.group == 0 ? r : r / N;
        std::vector<int> peers;  // the ranks that hold this rank's elements of u
        for (int q = 0; q < W; ++q)
          if (up.group == 0 || q % N == e) peers.push_back(q);
        const std::vector<double> got = host_copy(*be64, state.grad_shard(u), up.shard_size);
        const st::RankShard& rs = up.ranks[static_cast<size_t>(row)];
        for (int64_t k = 0; k < rs.valid; ++k) {
          double want = 0;
          for (int q : peers) want += grad_value(q, u, rs.start + k, 0) / W;
          EXPECT_TRUE(near(got[static_cast<size_t>(k)], want, 1e-12))
              << up.name << " element " << k << ": " << got[static_cast<size_t>(k)] << " vs " << want;
        }
        // The norm: group-0 elements once; each EP index's slice of a group-1 unit once.
        for (int ei = 0; ei < (up.group == 1 ? N : 1); ++ei)
          for (int64_t i = 0; i < up.numel; ++i) {
            double m = 0;
            for (int q = 0; q < W; ++q)
              if (up.group == 0 || q % N == ei) m += grad_value(q, u, i, 0) / W;
            sumsq += m * m;
          }
      }
      double norm = state.local_grad_sumsq();
      c.all_reduce(&norm, 1, st::ReduceOp::Sum);
      EXPECT_TRUE(near(norm, sumsq, 1e-10)) << norm << " vs " << sumsq;
    }
}
