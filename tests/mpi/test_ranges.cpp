// The model over ranges of blocks with per-micro-batch contexts (model.h BlockRange, Context), at
// the world size mpirun gives (1-4), fp32 on the CPU backend, FSDP through UnitPipeline:
//  - ranges [0, a), [a, b), [b, L) chained (forward through each, the head on the last, backward
//    back through each, each backward fed the next range's input gradient) give the whole model's
//    loss and every gradient element bitwise, tied and untied, under each activation-checkpointing
//    mode (exact attention too), for splits with one block per range and with an empty range;
//  - a pipeline's two stages, each with a plan of only its units (llama_stage_units, addressed
//    through the unit map): two micro-batches' forwards through both stages before either
//    backward (1F1B's order) give the gradients of running them one at a time, bitwise; untied,
//    those are also the whole model's (the gradients of two micro-batches accumulated).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/model/model.h"
#include "shardtrain/shard/shard.h"
#include "../test_env.h"

namespace st = shardtrain;

namespace {

st::ModelConfig cfg(bool tied) {
  st::ModelConfig c;
  c.name = "ranges-test";
  c.vocab_size = 67;
  c.hidden_size = 48;
  c.intermediate_size = 80;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;  // GQA
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = tied;
  c.bos_token_id = 0;
  c.eos_token_ids = {1};
  return c;
}

constexpr int kB = 2, kT = 19;
constexpr float kScale = 1.0f / (kB * kT);

struct Batch {
  std::vector<int32_t> tok, tgt;
};
Batch batch(int V, int rank, int m) {
  std::mt19937 g(static_cast<uint32_t>(300 + 10 * rank + m));  // each rank and micro-batch its own
  std::uniform_int_distribution<int> d(0, V - 1);
  Batch b;
  for (int i = 0; i < kB * kT; ++i) {
    b.tok.push_back(d(g));
    b.tgt.push_back(d(g));
  }
  return b;
}

// Loss sum and gradient shards, by parameter name (this rank's part of each unit's shard is
// compared element by element, as the plans of the stages and the whole model lay units out alike).
struct Result {
  double loss = 0;
  std::vector<std::string> units;
  std::vector<std::vector<float>> grads;
};
void add_grads(Result& r, st::ShardedState<float>& f) {
  for (int u = 0; u < f.num_units(); ++u) {
    const auto n = static_cast<size_t>(f.plan().units[u].shard_size);
    r.units.push_back(f.plan().units[u].name);
    r.grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + n);
  }
}

size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return a.size() + b.size();
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

// Every unit of `want` is in `got` under the same name with the same bytes; the loss too.
void expect_bitwise(const Result& want, const Result& got, const std::string& what) {
  EXPECT_EQ(std::memcmp(&want.loss, &got.loss, sizeof(double)), 0) << what << ": loss " << want.loss << " vs " << got.loss;
  double norm = 0;
  for (size_t u = 0; u < want.units.size(); ++u) {
    for (float x : want.grads[u]) norm += double(x) * x;
    size_t k = 0;
    while (k < got.units.size() && got.units[k] != want.units[u]) ++k;
    ASSERT_LT(k, got.units.size()) << what << ": no unit " << want.units[u];
    EXPECT_EQ(differing(want.grads[u], got.grads[k]), 0u) << what << ": unit " << want.units[u] << " differs";
  }
  EXPECT_GT(norm, 0.0) << what << ": a zero gradient proves nothing";
}

std::unique_ptr<st::ShardedState<float>> state(st::Backend<float>& be, std::vector<st::UnitSpec> units) {
  st::Comm& comm = st::testing::comm();
  auto f = std::make_unique<st::ShardedState<float>>(be, comm, st::ShardPlan::build(std::move(units), comm.world_size()));
  f->init_params(77);  // values depend on (seed, name, index) only: every plan holds the same weights
  f->zero_grads();
  return f;
}
std::unique_ptr<st::UnitPipeline<float>> pipeline(st::Backend<float>& be, st::ShardedState<float>& f) {
  return std::make_unique<st::UnitPipeline<float>>(be, std::make_unique<st::IdentityCodec<float>>(f));
}

// The whole model, micro-batches 0..n-1 one after the other (gradients accumulated).
Result whole(const st::ModelConfig& mc, const st::ModelOptions& mo, int n) {
  auto be = st::make_cpu_backend<float>();
  auto f = state(*be, st::llama_units(mc));
  auto units = pipeline(*be, *f);
  st::LlamaModel<float> m(mc, *be, mo);
  Result r;
  for (int k = 0; k < n; ++k) {
    const Batch b = batch(mc.vocab_size, st::testing::comm().rank(), k);
    m.forward(*units, b.tok.data(), kB, kT);
    r.loss += m.head_backward(*units, b.tgt.data(), kScale);
    m.backward(*units);
  }
  add_grads(r, *f);
  return r;
}

// Ranges [0, a), [a, b), [b, L) chained on the whole model's plan (identity unit map).
Result chained(const st::ModelConfig& mc, const st::ModelOptions& mo, int a, int b) {
  auto be = st::make_cpu_backend<float>();
  auto f = state(*be, st::llama_units(mc));
  auto units = pipeline(*be, *f);
  st::LlamaModel<float> m(mc, *be, mo);
  using Ctx = st::LlamaModel<float>::Context;
  const int L = mc.num_hidden_layers;
  Ctx c0(st::BlockRange{0, a, {}}), c1(st::BlockRange{a, b, {}}), c2(st::BlockRange{b, L, {}});
  const Batch bt = batch(mc.vocab_size, st::testing::comm().rank(), 0);
  m.forward(*units, c0, bt.tok.data(), nullptr, kB, kT);
  m.forward(*units, c1, nullptr, c0.output(), kB, kT);
  m.forward(*units, c2, nullptr, c1.output(), kB, kT);
  Result r;
  r.loss = m.head_backward(*units, c2, bt.tgt.data(), kScale);
  m.backward(*units, c2, nullptr);
  m.backward(*units, c1, c2.input_grad());
  m.backward(*units, c0, c1.input_grad());
  add_grads(r, *f);
  return r;
}

std::string name(const st::ModelOptions& mo, bool tied) {
  return std::string(st::recompute_name(mo.recompute)) + ", " + st::attention_name(mo.attention) +
         (tied ? ", tied" : ", untied");
}

}  // namespace

TEST(Ranges, ChainedEqualsWholeBitwise) {
  for (bool tied : {true, false})
    for (st::Recompute r : {st::Recompute::None, st::Recompute::Selective, st::Recompute::Full})
      for (st::AttentionKind att : {st::AttentionKind::Tiled, st::AttentionKind::Exact}) {
        const st::ModelConfig mc = cfg(tied);
        const st::ModelOptions mo{r, att, 0};
        const Result w = whole(mc, mo, 1);
        // [0,1) [1,2) [2,3): a block each; [0,1) [1,1) [1,3) and [0,2) [2,2) [2,3): an empty range in
        // the middle (its output is its input, its input gradient its output's). (A range that starts
        // at 0 has the embedding and one that ends at L the head, so 1 <= a <= b <= L-1.)
        for (auto [a, b] : {std::pair{1, 2}, std::pair{1, 1}, std::pair{2, 2}})
          expect_bitwise(w, chained(mc, mo, a, b),
                         name(mo, tied) + ", ranges [0," + std::to_string(a) + ") [" + std::to_string(a) + "," +
                             std::to_string(b) + ") [" + std::to_string(b) + ",3)");
      }
}

namespace {

// Two pipeline stages [0, a) and [a, L), each with a plan of only its units, two micro-batches.
// one_f_one_b: F0 F1 through both stages, then B0, B1 (each through stage 1, then stage 0);
// else F0 B0 F1 B1. Returns both stages' gradients (stage 0's units, then stage 1's) and the loss.
Result stages(const st::ModelConfig& mc, const st::ModelOptions& mo, int a, bool one_f_one_b) {
  auto be = st::make_cpu_backend<float>();
  const int L = mc.num_hidden_layers;
  auto f0 = state(*be, st::llama_stage_units(mc, 0, a));
  auto f1 = state(*be, st::llama_stage_units(mc, a, L));
  auto u0 = pipeline(*be, *f0);
  auto u1 = pipeline(*be, *f1);
  st::LlamaModel<float> m0(mc, *be, mo), m1(mc, *be, mo);  // one model per stage, as on two ranks
  using Ctx = st::LlamaModel<float>::Context;
  std::vector<Ctx> c0, c1;  // per micro-batch
  std::vector<Batch> bt;
  for (int k = 0; k < 2; ++k) {
    c0.emplace_back(st::llama_stage_range(mc, 0, a));
    c1.emplace_back(st::llama_stage_range(mc, a, L));
    bt.push_back(batch(mc.vocab_size, st::testing::comm().rank(), k));
  }
  Result r;
  auto fwd = [&](int k) {
    m0.forward(*u0, c0[k], bt[k].tok.data(), nullptr, kB, kT);
    m1.forward(*u1, c1[k], nullptr, c0[k].output(), kB, kT);
  };
  auto bwd = [&](int k) {
    r.loss += m1.head_backward(*u1, c1[k], bt[k].tgt.data(), kScale);
    m1.backward(*u1, c1[k], nullptr);
    m0.backward(*u0, c0[k], c1[k].input_grad());
  };
  if (one_f_one_b) {
    fwd(0);
    fwd(1);
    bwd(0);
    bwd(1);
  } else {
    fwd(0);
    bwd(0);
    fwd(1);
    bwd(1);
  }
  add_grads(r, *f0);
  add_grads(r, *f1);
  return r;
}

// Stage results hold the tied embedding twice (lookup on stage 0, head on stage 1): compare by
// position, not by name.
void expect_same_order(const Result& want, const Result& got, const std::string& what) {
  EXPECT_EQ(std::memcmp(&want.loss, &got.loss, sizeof(double)), 0) << what << ": loss " << want.loss << " vs " << got.loss;
  ASSERT_EQ(want.units, got.units) << what;
  double norm = 0;
  for (size_t u = 0; u < want.grads.size(); ++u) {
    for (float x : want.grads[u]) norm += double(x) * x;
    EXPECT_EQ(differing(want.grads[u], got.grads[u]), 0u) << what << ": unit " << want.units[u] << " differs";
  }
  EXPECT_GT(norm, 0.0) << what;
}

}  // namespace

TEST(Ranges, TwoMicroBatchesInFlightOneFOneB) {
  for (bool tied : {true, false})
    for (st::Recompute r : {st::Recompute::None, st::Recompute::Full}) {
      const st::ModelConfig mc = cfg(tied);
      const st::ModelOptions mo{r, st::AttentionKind::Tiled, 0};
      const Result seq = stages(mc, mo, 2, false), pipe = stages(mc, mo, 2, true);
      expect_same_order(seq, pipe, "1F1B vs one at a time, " + name(mo, tied));
      if (!tied) expect_bitwise(whole(mc, mo, 2), pipe, "1F1B stages vs the whole model, " + name(mo, tied));
      // The stage plans hold only their units: stage 0 the embedding and blocks 0-1, stage 1 block 2
      // and the head (and the embedding again when tied).
      const size_t want_units = tied ? 3 + 3 : 3 + 2;
      EXPECT_EQ(pipe.units.size(), want_units);
    }
}

// The range API refuses, before any collective, what it cannot run: a range outside the model, a
// unit map of the wrong size, a range from block 0 without tokens or from a later block without its
// input, a backward before the head or without the output gradient; and a stage's map refuses a
// unit the stage does not hold.
TEST(Ranges, RefusesBadRangesAndMissingInputs) {
  const st::ModelConfig mc = cfg(false);
  auto be = st::make_cpu_backend<float>();
  auto f = state(*be, st::llama_units(mc));
  auto units = pipeline(*be, *f);
  st::LlamaModel<float> m(mc, *be, {});
  using Ctx = st::LlamaModel<float>::Context;
  const Batch bt = batch(mc.vocab_size, st::testing::comm().rank(), 0);
  Ctx past(st::BlockRange{2, 4, {}}), backwards(st::BlockRange{2, 1, {}}), short_map(st::BlockRange{0, 3, {0, 1}});
  EXPECT_THROW(m.forward(*units, past, nullptr, f->param_shard(0), kB, kT), std::invalid_argument);
  EXPECT_THROW(m.forward(*units, backwards, bt.tok.data(), nullptr, kB, kT), std::invalid_argument);
  EXPECT_THROW(m.forward(*units, short_map, bt.tok.data(), nullptr, kB, kT), std::invalid_argument);
  Ctx first(st::BlockRange{0, 1, {}}), rest(st::BlockRange{1, 3, {}});
  EXPECT_THROW(m.forward(*units, first, nullptr, nullptr, kB, kT), std::invalid_argument);
  EXPECT_THROW(m.forward(*units, rest, nullptr, nullptr, kB, kT), std::invalid_argument);
  EXPECT_THROW(m.backward(*units, first, nullptr), std::logic_error);  // no forward yet
  m.forward(*units, first, bt.tok.data(), nullptr, kB, kT);
  EXPECT_THROW(m.head_backward(*units, first, bt.tgt.data(), kScale), std::logic_error);  // no head in [0, 1)
  EXPECT_THROW(m.backward(*units, first, nullptr), std::invalid_argument);                // output_grad missing
  m.forward(*units, rest, nullptr, first.output(), kB, kT);
  EXPECT_THROW(m.backward(*units, rest, nullptr), std::logic_error);  // before head_backward
  const st::BlockRange stage = st::llama_stage_range(mc, 1, 3);
  EXPECT_EQ(stage.units, (std::vector<int>{-1, -1, 0, 1, 2}));
  EXPECT_THROW((void)stage.unit(0), std::logic_error);
  EXPECT_THROW(st::llama_stage_range(mc, 2, 4), std::invalid_argument);
}
