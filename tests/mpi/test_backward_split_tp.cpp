// LlamaModel's split backward (model.h backward_input / backward_weight) under tensor parallelism
// with sequence parallelism, TP N = the world size (2): the kept rows are the all-gathered ones
// and the embedding's weight half all-gathers the residual gradient. Two ranges [0, 1), [1, 2), two
// micro-batches in flight, the weight halves in the other micro-batch order: every rank's gradient
// shards and input gradients bitwise (memcmp) those of backward made in that order, float,
// Recompute None and Full, tied and untied heads.
//
// And under context parallelism (CP N = the world size, ring attention): backward_input runs the
// CP attention backward (collective over the CP group) into the kept d(q), d(k), d(v); the same
// bitwise comparison, double, Recompute None and Full, causal.
//
// Every rank makes the same collective calls in the same order; checks are EXPECT_* only.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "rank_test.h"
#include "shardtrain/parallel/context_parallel.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/model/model.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/parallel/tensor_parallel.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class BackwardSplitTp : public st::testing::RankTest {};

// As test_tensor_parallel.cpp's: V = 37 pads the last TP rank's vocabulary rows; N = 4 uses 4 KV heads.
st::ModelConfig config(bool tied, int N) {
  st::ModelConfig c;
  c.name = "tp-split";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = N > 2 ? 4 : 2;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = tied;
  return c;
}

template <typename T> struct Result {
  std::vector<std::vector<T>> grads, input_grads;
};

template <typename T> Result<T> run(bool tied, st::Recompute rc, bool split) {
  st::Comm& c = world();
  const int N = c.world_size();
  const st::ModelConfig cfg = config(tied, N);
  const st::Mesh mesh(c, st::testing::g_runtime->topo(), st::MeshDims{1, 1, 1, N}, 0);
  auto be = st::make_cpu_backend<T>();
  st::Fsdp<T> f(*be, c, st::ShardPlan::build(st::llama_units(cfg, N, mesh.coord().tp), 1), &mesh.shard_data(), nullptr);
  f.init_params(31);
  st::TpGroup<T> tp(*mesh.tp_data());
  st::LlamaModel<T> m(cfg, *be, st::ModelOptions{rc, st::AttentionKind::Tiled, 0}, &tp);
  using Ctx = typename st::LlamaModel<T>::Context;
  const int B = 2, T_ = 8;  // 16 tokens, 16 / N residual rows per rank
  const size_t rows = static_cast<size_t>(B) * T_ / static_cast<size_t>(N) * static_cast<size_t>(cfg.hidden_size);
  std::vector<int32_t> tok[2], tgt[2];
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i < B * T_; ++i) {
      tok[k].push_back((7 * i + 3 + 11 * k) % cfg.vocab_size);
      tgt[k].push_back((5 * i + 36 + 3 * k) % cfg.vocab_size);  // includes id 36, the last row
    }
  Ctx c0[2] = {Ctx(st::BlockRange{0, 1, {}}), Ctx(st::BlockRange{0, 1, {}})};
  Ctx c1[2] = {Ctx(st::BlockRange{1, 2, {}}), Ctx(st::BlockRange{1, 2, {}})};
  f.zero_grads();
  for (int k = 0; k < 2; ++k) {
    m.forward(f, c0[k], tok[k].data(), nullptr, B, T_);
    m.forward(f, c1[k], nullptr, c0[k].output(), B, T_);
  }
  for (int k = 0; k < 2; ++k) m.head_backward(f, c1[k], tgt[k].data(), T(1) / T(B * T_));
  Result<T> r;
  auto keep = [&](int k) {
    std::vector<T> g(rows);
    be->to_host(g.data(), c1[k].input_grad(), rows);
    r.input_grads.push_back(std::move(g));
  };
  if (split) {
    for (int k = 0; k < 2; ++k) {
      m.backward_input(f, c1[k], nullptr);
      m.backward_input(f, c0[k], c1[k].input_grad());
    }
    for (int k = 1; k >= 0; --k) {
      m.backward_weight(f, c1[k]);
      m.backward_weight(f, c0[k]);
    }
    keep(0);
    keep(1);
  } else {
    for (int k = 1; k >= 0; --k) {
      m.backward(f, c1[k], nullptr);
      m.backward(f, c0[k], c1[k].input_grad());
    }
    keep(0);
    keep(1);
  }
  f.end_pass();
  for (int u = 0; u < f.num_units(); ++u)
    r.grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + f.plan().units[static_cast<size_t>(u)].shard_size);
  return r;
}

// CP N = the world size over one sequence-split micro-batch pair; FSDP over this rank alone (the
// CP ranks' gradients are partial sums: compared per rank).
Result<double> run_cp(st::Recompute rc, bool split) {
  st::Comm& c = world();
  const int N = c.world_size();
  const st::ModelConfig cfg = config(false, 2);
  auto be = st::make_cpu_backend<double>();
  st::MpiComm self = st::MpiComm::split(c, c.rank(), 0);
  st::CpAttention<double> cp(c, *be, st::CpComm::Ring);
  st::Fsdp<double> f(*be, self, st::ShardPlan::build(st::llama_units(cfg), 1), &self, nullptr);
  f.init_params(31);
  st::LlamaModel<double> m(cfg, *be, st::ModelOptions{rc, st::AttentionKind::Tiled, 0}, nullptr, &cp);
  using Ctx = st::LlamaModel<double>::Context;
  const int B = 2, T = 16, Tl = T / N;
  const std::vector<int32_t> rows = st::cp_rows(T, N, c.rank());
  std::vector<int32_t> tok[2], tgt[2], pos;
  for (int b = 0; b < B; ++b)
    for (int32_t t : rows) pos.push_back(t);
  for (int k = 0; k < 2; ++k)
    for (int b = 0; b < B; ++b)
      for (int32_t t : rows) {
        const int i = b * T + t;
        tok[k].push_back((7 * i + 3 + 11 * k) % cfg.vocab_size);
        tgt[k].push_back((5 * i + 36 + 3 * k) % cfg.vocab_size);
      }
  const st::TokenLayout lay{pos.data(), nullptr};
  Ctx c0[2] = {Ctx(st::BlockRange{0, 1, {}}), Ctx(st::BlockRange{0, 1, {}})};
  Ctx c1[2] = {Ctx(st::BlockRange{1, 2, {}}), Ctx(st::BlockRange{1, 2, {}})};
  f.zero_grads();
  for (int k = 0; k < 2; ++k) {
    m.forward(f, c0[k], tok[k].data(), nullptr, B, Tl, lay);
    m.forward(f, c1[k], nullptr, c0[k].output(), B, Tl, lay);
  }
  for (int k = 0; k < 2; ++k) m.head_backward(f, c1[k], tgt[k].data(), 1.0 / (B * T));
  if (split) {
    for (int k = 0; k < 2; ++k) {
      m.backward_input(f, c1[k], nullptr);
      m.backward_input(f, c0[k], c1[k].input_grad());
    }
    for (int k = 1; k >= 0; --k) {
      m.backward_weight(f, c1[k]);
      m.backward_weight(f, c0[k]);
    }
  } else {
    for (int k = 1; k >= 0; --k) {
      m.backward(f, c1[k], nullptr);
      m.backward(f, c0[k], c1[k].input_grad());
    }
  }
  f.end_pass();
  Result<double> r;
  const size_t n = static_cast<size_t>(B) * Tl * static_cast<size_t>(cfg.hidden_size);
  for (int k = 0; k < 2; ++k) {
    std::vector<double> g(n);
    be->to_host(g.data(), c1[k].input_grad(), n);
    r.input_grads.push_back(std::move(g));
  }
  for (int u = 0; u < f.num_units(); ++u)
    r.grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + f.plan().units[static_cast<size_t>(u)].shard_size);
  return r;
}

template <typename T> bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
// How many elements of the vectors are nonzero (so that an equal comparison is not of nothing).
template <typename T> int64_t nonzero(const std::vector<std::vector<T>>& v) {
  int64_t n = 0;
  for (const auto& x : v)
    for (T e : x) n += e != T(0);
  return n;
}

template <typename T> void check_all(const char* type) {
  for (bool tied : {false, true})
    for (st::Recompute rc : {st::Recompute::None, st::Recompute::Full}) {
      const std::string what = std::string(type) + ", " + (tied ? "tied" : "untied") + ", " + st::recompute_name(rc);
      const Result<T> want = run<T>(tied, rc, false), got = run<T>(tied, rc, true);
      EXPECT_GT(nonzero(want.grads), 1000) << what;
      EXPECT_GT(nonzero(want.input_grads), 100) << what;
      EXPECT_EQ(got.grads.size(), want.grads.size()) << what;
      for (size_t u = 0; u < want.grads.size() && u < got.grads.size(); ++u)
        EXPECT_TRUE(same_bits(got.grads[u], want.grads[u]))
            << what << ": unit " << u << ", " << st::testing::count_diff(got.grads[u], want.grads[u]) << " elements differ";
      for (size_t i = 0; i < want.input_grads.size(); ++i)
        EXPECT_TRUE(same_bits(got.input_grads[i], want.input_grads[i])) << what << ": input gradient " << i;
    }
}

TEST_F(BackwardSplitTp, BitwiseAsBackward) {
  const int W = world().world_size();
  if (W != 2) GTEST_SKIP() << "TP N = the world size = 2 (N = 4 runs the same code: make test's time)";
  check_all<float>("float");  // double: the same code (test_backward_split.cpp runs both at one rank)
}

}  // namespace

namespace {

TEST_F(BackwardSplitTp, ContextParallelBitwiseAsBackward) {
  const int W = world().world_size();
  if (W != 2 && W != 4) GTEST_SKIP() << "CP N = the world size, N = 2 or 4";
  for (st::Recompute rc : {st::Recompute::None, st::Recompute::Full}) {
    const std::string what = std::string("cp, ") + st::recompute_name(rc);
    const Result<double> want = run_cp(rc, false), got = run_cp(rc, true);
    EXPECT_GT(nonzero(want.grads), 1000) << what;
    EXPECT_GT(nonzero(want.input_grads), 100) << what;
    EXPECT_EQ(got.grads.size(), want.grads.size()) << what;
    for (size_t u = 0; u < want.grads.size() && u < got.grads.size(); ++u)
      EXPECT_TRUE(same_bits(got.grads[u], want.grads[u]))
          << what << ": unit " << u << ", " << st::testing::count_diff(got.grads[u], want.grads[u]) << " elements differ";
    for (size_t i = 0; i < want.input_grads.size(); ++i)
      EXPECT_TRUE(same_bits(got.input_grads[i], want.input_grads[i])) << what << ": input gradient " << i;
  }
}

}  // namespace
