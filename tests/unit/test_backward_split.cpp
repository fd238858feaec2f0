// LlamaModel's backward split for zero-bubble pipeline schedules (model.h backward_input /
// backward_weight), against the unsplit backward as the reference:
//   - backward_input then backward_weight leave bitwise (memcmp) the gradient shards and the
//     ctx.input_grad() that backward leaves: float and double, Recompute None / Selective / Full,
//     tiled and exact attention, tied and untied heads, the whole model as one range and as three
//     ranges [0, 1), [1, 2), [2, 3) (a first, a middle and a last stage), two micro-batches in flight
//     with their weight halves in the other order (m1's before m0's), compared with backward calls
//     made in that same order; two training steps reuse the contexts; and with the document mask;
//     bf16 (with a UnitSource that logs every full-unit gradient it is handed, compared bitwise);
//   - the UnitSource calls: backward_input gathers the blocks' units as backward does and touches no
//     gradient; backward_weight gathers nothing and makes backward's full_grad / reduce_scatter_grad
//     pairs in backward's order;
//   - out-of-order calls throw std::logic_error;
//   - a context allocates for its deferred weight gradients exactly deferred_weight_bytes (counted
//     allocations), once: reused by the next micro-batch, reallocated for another micro-batch size.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../mpi/counting_backend.h"
#include "../test_env.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/model/config.h"
#include "shardtrain/model/model.h"
#include "shardtrain/shard/shard.h"

namespace shardtrain {
namespace {

// Small, but with GQA (4 query heads over 2 KV heads), T = 40 over more than one attention tile,
// and a vocabulary that is not a multiple of anything.
// qk_norm: Qwen3's per-head q/k norm (its weight gradients are deferred too).
ModelConfig split_config(bool tied, bool qk_norm = false) {
  ModelConfig c;
  c.name = "backward-split";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = tied;
  if (qk_norm) {
    c.architecture = "Qwen3ForCausalLM";
    c.qk_norm = true;
  }
  return c;
}

constexpr int kB = 2, kT = 40;

struct MicroBatch {
  std::vector<int32_t> tokens, targets;
};
MicroBatch micro_batch(uint32_t seed, int V) {
  std::mt19937 g(seed);
  MicroBatch m;
  for (int i = 0; i < kB * kT; ++i) {
    m.tokens.push_back(static_cast<int32_t>(g() % static_cast<uint32_t>(V)));
    m.targets.push_back(static_cast<int32_t>(g() % static_cast<uint32_t>(V)));
  }
  return m;
}

// A UnitSource that forwards to another and records every call: "g3" gather of unit 3, "z3"
// full_grad, "r3" reduce_scatter_grad.
template <typename T> struct Recording : UnitSource<T> {
  explicit Recording(UnitSource<T>& in) : inner(in) {}
  UnitSource<T>& inner;
  std::vector<std::string> calls;
  const T* gather(int u) override {
    calls.push_back("g" + std::to_string(u));
    return inner.gather(u);
  }
  T* full_grad(int u) override {
    calls.push_back("z" + std::to_string(u));
    return inner.full_grad(u);
  }
  void reduce_scatter_grad(int u) override {
    calls.push_back("r" + std::to_string(u));
    inner.reduce_scatter_grad(u);
  }
  std::vector<std::string> take() { return std::exchange(calls, {}); }
};

// What a run leaves: every gradient shard, every range's input gradient after its backward (begin
// > 0), the loss.
template <typename T> struct Result {
  std::vector<std::vector<T>> grads;
  std::vector<std::vector<T>> input_grads;
  double loss = 0;
};

// Two training steps of two micro-batches each over the ranges `cuts` (blocks [cuts[s], cuts[s+1])
// per stage, one UnitSource over the whole model), every forward before any backward (as a pipeline
// stage holds several micro-batches). split: each range's backward is backward_input, and the
// weight halves run after all input halves of the step, micro-batch m1's before m0's. Not split:
// backward, with the same order of gradient accumulation: the head steps in micro-batch order, then
// the ranges' backwards of m1, then those of m0.
// docs: every row holds two documents, of 15 and 25 tokens (the document mask's block kernels).
template <typename T>
Result<T> run(const ModelConfig& cfg, const ModelOptions& o, const std::vector<int>& cuts, bool split,
              bool docs = false) {
  std::vector<int32_t> pos, doc;
  for (int b = 0; b < kB; ++b)
    for (int t = 0; t < kT; ++t) {
      pos.push_back(t < 15 ? t : t - 15);
      doc.push_back(t < 15 ? 0 : 1);
    }
  const TokenLayout lay = docs ? TokenLayout{pos.data(), doc.data()} : TokenLayout{};
  auto be = make_cpu_backend<T>();
  Fsdp<T> f(*be, testing::comm(), ShardPlan::build(llama_units(cfg), 1));
  f.init_params(777);
  LlamaModel<T> m(cfg, *be, o);
  using Ctx = typename LlamaModel<T>::Context;
  const int S = static_cast<int>(cuts.size()) - 1;
  std::vector<Ctx> ctx[2];
  for (auto& c : ctx)
    for (int s = 0; s < S; ++s) c.emplace_back(BlockRange{cuts[static_cast<size_t>(s)], cuts[static_cast<size_t>(s) + 1], {}});
  Result<T> r;
  f.zero_grads();
  const size_t n = static_cast<size_t>(kB) * kT * static_cast<size_t>(cfg.hidden_size);
  for (int step = 0; step < 2; ++step) {
    const MicroBatch mb[2] = {micro_batch(100 + 2 * static_cast<uint32_t>(step), cfg.vocab_size),
                              micro_batch(101 + 2 * static_cast<uint32_t>(step), cfg.vocab_size)};
    for (int k = 0; k < 2; ++k)
      for (int s = 0; s < S; ++s)
        m.forward(f, ctx[k][static_cast<size_t>(s)], mb[k].tokens.data(),
                  s > 0 ? ctx[k][static_cast<size_t>(s) - 1].output() : nullptr, kB, kT, lay);
    for (int k = 0; k < 2; ++k) r.loss += m.head_backward(f, ctx[k].back(), mb[k].targets.data(), T(1) / T(kB * kT));
    auto keep_input_grads = [&](int k) {
      for (int s = S - 1; s >= 1; --s) {
        std::vector<T> g(n);
        be->to_host(g.data(), ctx[k][static_cast<size_t>(s)].input_grad(), n);
        r.input_grads.push_back(std::move(g));
      }
    };
    if (split) {
      for (int k = 0; k < 2; ++k) {
        for (int s = S - 1; s >= 0; --s)
          m.backward_input(f, ctx[k][static_cast<size_t>(s)],
                           s + 1 < S ? ctx[k][static_cast<size_t>(s) + 1].input_grad() : nullptr);
        keep_input_grads(k);
      }
      for (int k = 1; k >= 0; --k)
        for (int s = S - 1; s >= 0; --s) m.backward_weight(f, ctx[k][static_cast<size_t>(s)]);
      // backward_weight leaves the input gradients as they were: they are compared again below.
      for (int k = 0; k < 2; ++k) keep_input_grads(k);
    } else {
      std::vector<std::vector<T>> got[2];
      for (int k = 1; k >= 0; --k) {
        for (int s = S - 1; s >= 0; --s)
          m.backward(f, ctx[k][static_cast<size_t>(s)], s + 1 < S ? ctx[k][static_cast<size_t>(s) + 1].input_grad() : nullptr);
        const size_t before = r.input_grads.size();
        keep_input_grads(k);
        got[k].assign(r.input_grads.begin() + static_cast<std::ptrdiff_t>(before), r.input_grads.end());
        r.input_grads.resize(before);
      }
      for (int rep = 0; rep < 2; ++rep)  // in the split's order: m0, m1, and both again
        for (int k = 0; k < 2; ++k) r.input_grads.insert(r.input_grads.end(), got[k].begin(), got[k].end());
    }
  }
  for (int u = 0; u < f.num_units(); ++u)
    r.grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + f.plan().units[u].shard_size);
  return r;
}

template <typename T> bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename T> void expect_split_bitwise(bool qk_norm = false) {
  const std::vector<std::vector<int>> partitions = {{0, 3}, {0, 1, 2, 3}};
  int cases = 0;
  for (bool tied : {false, true})
    for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full})
      for (AttentionKind at : {AttentionKind::Tiled, AttentionKind::Exact})
        for (const auto& cuts : partitions) {
          const ModelConfig cfg = split_config(tied, qk_norm);
          const ModelOptions o{rc, at, 0};
          const std::string what = std::string(qk_norm ? "q/k norm, " : "") + (tied ? "tied" : "untied") + ", " +
                                   recompute_name(rc) + ", " +
                                   attention_name(at) + ", " + std::to_string(cuts.size() - 1) + " range(s)";
          const Result<T> want = run<T>(cfg, o, cuts, false), got = run<T>(cfg, o, cuts, true);
          EXPECT_EQ(got.loss, want.loss) << what;
          ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
          for (size_t u = 0; u < want.grads.size(); ++u) {
            EXPECT_TRUE(same_bits(got.grads[u], want.grads[u])) << what << ": unit " << u;
            bool nonzero = false;
            for (T v : want.grads[u]) nonzero = nonzero || v != T(0);
            EXPECT_TRUE(nonzero) << what << ": unit " << u << " has no gradient (the comparison would be empty)";
          }
          ASSERT_EQ(got.input_grads.size(), want.input_grads.size()) << what;
          for (size_t i = 0; i < want.input_grads.size(); ++i)
            EXPECT_TRUE(same_bits(got.input_grads[i], want.input_grads[i])) << what << ": input gradient " << i;
          ++cases;
        }
  EXPECT_EQ(cases, 24);
}

TEST(BackwardSplit, BitwiseAsBackwardFloat) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  expect_split_bitwise<float>();
}
TEST(BackwardSplit, BitwiseAsBackwardDouble) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  expect_split_bitwise<double>();
}
// Qwen3's q/k norm: its weight gradients (the Deferred's dnorm [2C + 2HD]) and d(q), d(k) before it.
TEST(BackwardSplit, BitwiseAsBackwardQkNorm) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  expect_split_bitwise<float>(true);
}

// With the document mask (its block attention kernels, RoPE at the layout's positions).
TEST(BackwardSplit, BitwiseAsBackwardWithDocuments) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  for (Recompute rc : {Recompute::None, Recompute::Full})
    for (AttentionKind at : {AttentionKind::Tiled, AttentionKind::Exact}) {
      const ModelConfig cfg = split_config(false);
      const ModelOptions o{rc, at, 0, AttentionMask::Document};
      const std::string what = std::string(recompute_name(rc)) + ", " + attention_name(at);
      const std::vector<int> cuts = {0, 1, 2, 3};
      const Result<double> want = run<double>(cfg, o, cuts, false, true), got = run<double>(cfg, o, cuts, true, true);
      const Result<double> causal = run<double>(cfg, o, cuts, false, false);
      EXPECT_NE(want.loss, causal.loss) << what << ": the documents change the loss (the mask is in effect)";
      EXPECT_EQ(got.loss, want.loss) << what;
      ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
      for (size_t u = 0; u < want.grads.size(); ++u)
        EXPECT_TRUE(same_bits(got.grads[u], want.grads[u])) << what << ": unit " << u;
      ASSERT_EQ(got.input_grads.size(), want.input_grads.size()) << what;
      for (size_t i = 0; i < want.input_grads.size(); ++i)
        EXPECT_TRUE(same_bits(got.input_grads[i], want.input_grads[i])) << what << ": input gradient " << i;
    }
}

// bf16 storage (fp32 math) with a UnitSource of its own: parameters N(0, 0.1^2) (norms 1 + that),
// and a log of every full-unit gradient reduce_scatter_grad is given (what FSDP would sum). The two
// halves hand over bitwise backward's buffers, in backward's order.
struct LoggingUnits final : UnitSource<bf16> {
  Backend<bf16>& be;
  ShardPlan plan;
  std::vector<Buffer<bf16>> params, grads;
  std::vector<std::pair<int, std::vector<bf16>>> sent;
  LoggingUnits(Backend<bf16>& b, const ModelConfig& c) : be(b), plan(ShardPlan::build(llama_units(c), 1)) {
    std::mt19937 g(17);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (const UnitPlan& u : plan.units) {
      std::vector<bf16> h(static_cast<size_t>(u.padded_numel), math::f32_to_bf16(0.0f));
      for (const auto& slot : u.params)
        for (int64_t i = 0; i < slot.numel; ++i)
          h[static_cast<size_t>(slot.offset + i)] = math::f32_to_bf16((slot.spec.init == Init::Ones ? 1.0f : 0.0f) + nd(g));
      params.emplace_back(be, h.size());
      be.from_host(params.back().data(), h.data(), h.size());
      grads.emplace_back(be, h.size());
    }
  }
  const bf16* gather(int u) override { return params[static_cast<size_t>(u)].data(); }
  bf16* full_grad(int u) override {
    Buffer<bf16>& g = grads[static_cast<size_t>(u)];
    be.zero(g.data(), g.size());
    return g.data();
  }
  void reduce_scatter_grad(int u) override {
    const Buffer<bf16>& g = grads[static_cast<size_t>(u)];
    std::vector<bf16> h(g.size());
    be.to_host(h.data(), g.data(), h.size());
    sent.emplace_back(u, std::move(h));
  }
};

TEST(BackwardSplit, BitwiseAsBackwardBf16) {
  for (bool tied : {false, true})
    for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full})
      for (AttentionKind at : {AttentionKind::Tiled, AttentionKind::Exact}) {
        const ModelConfig cfg = split_config(tied);
        const std::string what = std::string(tied ? "tied" : "untied") + ", " + recompute_name(rc) + ", " +
                                 attention_name(at);
        std::vector<std::pair<int, std::vector<bf16>>> logs[2];
        std::vector<std::vector<bf16>> input_grads[2];
        for (int split = 0; split < 2; ++split) {
          auto be = make_cpu_backend<bf16>();
          LoggingUnits f(*be, cfg);
          LlamaModel<bf16> m(cfg, *be, ModelOptions{rc, at, 0});
          using Ctx = LlamaModel<bf16>::Context;
          std::vector<Ctx> ctx[2];
          for (auto& c : ctx)
            for (int s = 0; s < 3; ++s) c.emplace_back(BlockRange{s, s + 1, {}});
          const MicroBatch mb[2] = {micro_batch(200, cfg.vocab_size), micro_batch(201, cfg.vocab_size)};
          for (int k = 0; k < 2; ++k)
            for (size_t s = 0; s < 3; ++s)
              m.forward(f, ctx[k][s], mb[k].tokens.data(), s > 0 ? ctx[k][s - 1].output() : nullptr, kB, kT);
          for (int k = 0; k < 2; ++k) m.head_backward(f, ctx[k][2], mb[k].targets.data(), 1.0f / (kB * kT));
          for (int k = 1; k >= 0; --k)  // m1 first, then m0 (input halves of both first when split)
            for (int s = 2; s >= 0; --s) {
              const bf16* og = s < 2 ? ctx[k][static_cast<size_t>(s) + 1].input_grad() : nullptr;
              if (split) m.backward_input(f, ctx[k][static_cast<size_t>(s)], og);
              else m.backward(f, ctx[k][static_cast<size_t>(s)], og);
            }
          if (split)
            for (int k = 1; k >= 0; --k)
              for (int s = 2; s >= 0; --s) m.backward_weight(f, ctx[k][static_cast<size_t>(s)]);
          const size_t n = static_cast<size_t>(kB) * kT * static_cast<size_t>(cfg.hidden_size);
          for (int k = 0; k < 2; ++k)
            for (size_t s = 1; s < 3; ++s) {
              std::vector<bf16> g(n);
              be->to_host(g.data(), ctx[k][s].input_grad(), n);
              input_grads[split].push_back(std::move(g));
            }
          logs[split] = std::move(f.sent);
        }
        ASSERT_EQ(logs[1].size(), logs[0].size()) << what;
        EXPECT_EQ(logs[0].size(), 2u * (cfg.tie_word_embeddings ? 6 : 5)) << what;  // per micro-batch: head(s), 3 blocks, embedding
        int64_t nonzero = 0;
        for (const auto& [u, g] : logs[0])
          for (bf16 v : g) nonzero += (v.bits & 0x7fff) != 0;
        EXPECT_GT(nonzero, 10000) << what << ": the gradients compared are not (mostly) zeros";
        for (size_t i = 0; i < logs[0].size(); ++i) {
          EXPECT_EQ(logs[1][i].first, logs[0][i].first) << what << ": reduce-scatter " << i;
          EXPECT_TRUE(same_bits(logs[1][i].second, logs[0][i].second)) << what << ": reduce-scatter " << i << " (unit "
                                                                        << logs[0][i].first << ")";
        }
        for (size_t i = 0; i < input_grads[0].size(); ++i)
          EXPECT_TRUE(same_bits(input_grads[1][i], input_grads[0][i])) << what << ": input gradient " << i;
      }
}

// The calls each half makes on the UnitSource, for the last range [1, 3) of L = 3 and the first
// range [0, 1), against those of backward.
TEST(BackwardSplit, UnitSourceCalls) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  const ModelConfig cfg = split_config(false);
  auto be = make_cpu_backend<double>();
  Fsdp<double> fsdp(*be, testing::comm(), ShardPlan::build(llama_units(cfg), 1));
  fsdp.init_params(5);
  Recording<double> f(fsdp);
  LlamaModel<double> m(cfg, *be, ModelOptions{Recompute::Full, AttentionKind::Tiled, 0});
  using Ctx = LlamaModel<double>::Context;
  const MicroBatch mb = micro_batch(9, cfg.vocab_size);
  Ctx a(BlockRange{0, 1, {}}), b(BlockRange{1, 3, {}});
  for (bool split : {false, true}) {
    m.forward(f, a, mb.tokens.data(), nullptr, kB, kT);
    m.forward(f, b, nullptr, a.output(), kB, kT);
    m.head_backward(f, b, mb.targets.data(), 1.0);
    f.take();
    if (!split) {
      m.backward(f, b, nullptr);
      // Full recompute: backward's gradient comes after the block's gather and recomputation.
      EXPECT_EQ(f.take(), (std::vector<std::string>{"g3", "z3", "r3", "g2", "z2", "r2"}));
      m.backward(f, a, b.input_grad());
      EXPECT_EQ(f.take(), (std::vector<std::string>{"g1", "z1", "r1", "z0", "r0"}));
    } else {
      m.backward_input(f, b, nullptr);
      EXPECT_EQ(f.take(), (std::vector<std::string>{"g3", "g2"}));
      m.backward_input(f, a, b.input_grad());
      EXPECT_EQ(f.take(), (std::vector<std::string>{"g1"}));
      m.backward_weight(f, b);
      EXPECT_EQ(f.take(), (std::vector<std::string>{"z3", "r3", "z2", "r2"}));
      m.backward_weight(f, a);
      EXPECT_EQ(f.take(), (std::vector<std::string>{"z1", "r1", "z0", "r0"}));
    }
  }
}

TEST(BackwardSplit, OutOfOrderCallsAreRefused) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  const ModelConfig cfg = split_config(true);
  auto be = make_cpu_backend<double>();
  Fsdp<double> f(*be, testing::comm(), ShardPlan::build(llama_units(cfg), 1));
  f.init_params(5);
  LlamaModel<double> m(cfg, *be);
  using Ctx = LlamaModel<double>::Context;
  const MicroBatch mb = micro_batch(9, cfg.vocab_size);
  Ctx a(BlockRange{0, 3, {}}), b(BlockRange{1, 2, {}});
  std::vector<double> og(static_cast<size_t>(kB) * kT * static_cast<size_t>(cfg.hidden_size), 0.01);

  EXPECT_THROW(m.backward_weight(f, a), std::logic_error);  // nothing ran
  m.forward(f, a, mb.tokens.data(), nullptr, kB, kT);
  EXPECT_THROW(m.backward_input(f, a, nullptr), std::logic_error);  // before head_backward
  EXPECT_THROW(m.backward_weight(f, a), std::logic_error);          // before backward_input
  m.head_backward(f, a, mb.targets.data(), 1.0);
  EXPECT_THROW(m.backward_weight(f, a), std::logic_error);
  EXPECT_FALSE(a.weight_pending());
  m.backward_input(f, a, nullptr);
  EXPECT_TRUE(a.weight_pending());
  EXPECT_THROW(m.backward_input(f, a, nullptr), std::logic_error);  // twice
  EXPECT_THROW(m.backward(f, a, nullptr), std::logic_error);
  EXPECT_THROW(m.head_backward(f, a, mb.targets.data(), 1.0), std::logic_error);
  EXPECT_THROW(m.loss(f, a, mb.targets.data()), std::logic_error);
  EXPECT_THROW(m.forward(f, a, mb.tokens.data(), nullptr, kB, kT), std::logic_error);  // W pending
  EXPECT_TRUE(a.weight_pending()) << "a refused call changes nothing";
  m.backward_weight(f, a);
  EXPECT_FALSE(a.weight_pending());
  EXPECT_THROW(m.backward_weight(f, a), std::logic_error);  // twice
  m.forward(f, a, mb.tokens.data(), nullptr, kB, kT);        // the context is free again

  // A middle range: output_grad is required, as for backward.
  m.forward(f, b, nullptr, a.output(), kB, kT);
  EXPECT_THROW(m.backward_input(f, b, nullptr), std::invalid_argument);
  m.backward_input(f, b, og.data());
  // A forward of another micro-batch size on another context: b's kept rows no longer fit the
  // model's sizes.
  Ctx c(BlockRange{0, 3, {}});
  m.forward(f, c, mb.tokens.data(), nullptr, 1, kT);
  EXPECT_THROW(m.backward_weight(f, b), std::logic_error);
}

// The context allocates for its deferred weight gradients exactly deferred_weight_bytes, and
// that number is the per-block sum model.h gives, written out here.
TEST(BackwardSplit, DeferredBytesMatchAllocations) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  for (bool qk : {false, true})
  for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full})
    for (AttentionKind at : {AttentionKind::Tiled, AttentionKind::Exact}) {
      const ModelConfig cfg = split_config(false, qk);
      const ModelOptions o{rc, at, 0};
      const std::string what = std::string(recompute_name(rc)) + ", " + attention_name(at) + (qk ? ", q/k norm" : "");
      testing::CountingBackend<float> be;
      Fsdp<float> f(be, testing::comm(), ShardPlan::build(llama_units(cfg), 1));
      f.init_params(3);
      {
        LlamaModel<float> m(cfg, be, o);
        using Ctx = LlamaModel<float>::Context;
        Ctx a(BlockRange{0, 1, {}}), b(BlockRange{1, 3, {}});
        auto step = [&](int B) {
          const MicroBatch mb = micro_batch(4, cfg.vocab_size);
          m.forward(f, a, mb.tokens.data(), nullptr, B, kT);
          m.forward(f, b, nullptr, a.output(), B, kT);
          m.head_backward(f, b, mb.targets.data(), 1.0f);
          const int64_t before = static_cast<int64_t>(be.live_bytes());
          m.backward_input(f, b, nullptr);
          const int64_t grown = static_cast<int64_t>(be.live_bytes()) - before;
          m.backward_input(f, a, b.input_grad());
          m.backward_weight(f, b);
          m.backward_weight(f, a);
          return grown;
        };
        const int64_t want2 = deferred_weight_bytes(cfg, o, kB, kT, sizeof(float), 2);
        const int64_t BT = kB * kT, C = 16, I = 24, Q = 16, KV = 8;  // split_config: HD 4, 4 heads, 2 KV heads
        const int64_t per_block = 4 * BT * C + 2 * BT * I + BT * Q + 2 * BT * KV + 2 * C + (qk ? 2 * 4 : 0) +
                                  (rc != Recompute::None ? BT * I : 0) + (rc == Recompute::Full ? BT * Q : 0);
        EXPECT_EQ(want2, 2 * 4 * per_block) << what;
        EXPECT_EQ(deferred_weight_bytes(cfg, o, kB, kT, sizeof(double), 1), 8 * per_block) << what;
        EXPECT_EQ(b.deferred_bytes(), 0) << what;
        EXPECT_EQ(step(kB), want2) << what << ": the first backward_input allocates";
        EXPECT_EQ(b.deferred_bytes(), want2) << what;
        EXPECT_EQ(a.deferred_bytes(), deferred_weight_bytes(cfg, o, kB, kT, sizeof(float), 1)) << what;
        EXPECT_EQ(step(kB), 0) << what << ": the next micro-batch reuses them";
        step(1);  // another micro-batch size: sized for it
        EXPECT_EQ(b.deferred_bytes(), deferred_weight_bytes(cfg, o, 1, kT, sizeof(float), 2)) << what;
      }
    }
}

}  // namespace
}  // namespace shardtrain
