// The memory plan of a pipeline rank (memory_plan.h, issue 42 item 7), checked against numbers
// computed here independently:
//   - the stages' parameter shards add up to the model's parameters (plus the tied embedding's
//     copy on the last stage), each stage holding only its chunks' units;
//   - the contexts a rank holds per chunk (pipeline_contexts) are, for 1F1B, min(p - r, m) (the
//     schedule's warm-up plus one, Narayanan et al. 2021, figure 3), for GPipe m, and for every
//     one-chunk schedule simulate()'s peak_in_flight; interleaved pools per chunk, at least the peak;
//   - the activations line is contexts x context_bytes of each chunk, and zero-bubble adds
//     contexts x deferred_weight_bytes of the chunk's blocks;
//   - context_bytes is what the model allocates for a context (counted by a CountingBackend) and
//     the formula of model.h written out.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../mpi/counting_backend.h"
#include "../test_env.h"
#include "shardtrain/model/config.h"
#include "shardtrain/train/memory_plan.h"
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/parallel/pipeline_schedule.h"
#include "shardtrain/shard/shard.h"

namespace shardtrain {
namespace {

int64_t line_starting(const MemoryPlan& p, const std::string& prefix) {
  for (const MemoryLine& l : p.lines)
    if (l.name.rfind(prefix, 0) == 0) return l.bytes;
  return -1;
}

PipelineLayout layout(const ModelConfig& mc, int pp, PipelineKind k, int v, int m) {
  std::string why;
  PipelineOptions o;
  o.kind = k;
  o.chunks_per_rank = v;
  PipelineLayout pl = resolve_pipeline(mc, pp, o, m, &why);
  EXPECT_EQ(why, "");
  return pl;
}

// Plain pipeline, one rank per stage, bf16 on a GPU (no runtime or MPI lines).
MemoryPlanInput input(const ModelConfig& mc, int pp, PipelineKind k, int v, int m, int stage) {
  MemoryPlanInput in;
  in.model = mc;
  in.train.seq_len = 1024;
  in.train.micro_batch = 1;
  in.world_size = pp;
  in.precision = Precision::BF16;
  in.cuda = true;
  in.mesh = MeshDims{1, 1, 1, 1};
  in.mesh->pp = pp;
  in.pipeline = layout(mc, pp, k, v, m);
  in.pp_rank = stage;
  in.microbatches = m;
  return in;
}

TEST(PpPlan, StageParameterShardsAddUpToTheModel) {
  for (const char* name : {"llama-8b", "llama-1b"}) {  // untied, tied
    const ModelConfig mc = preset(name);
    for (int pp : {2, 4, 8}) {
      int64_t sum = 0;
      for (int s = 0; s < pp; ++s) {
        const MemoryPlan p = plan_memory(input(mc, pp, PipelineKind::OneFOneB, 1, 2 * pp, s));
        const int64_t b = line_starting(p, "fp32 parameter shards");
        ASSERT_GT(b, 0);
        EXPECT_EQ(b % 4, 0);
        sum += b / 4;  // one rank per stage: the shard is the stage's whole units
        EXPECT_EQ(line_starting(p, "fp32 gradient shards"), b);
        EXPECT_EQ(line_starting(p, "AdamW m and v shards"), 2 * b);
      }
      // Tied: the last stage holds the embedding again, for its LM head.
      const int64_t tied_copy = mc.tie_word_embeddings ? int64_t{mc.vocab_size} * mc.hidden_size : 0;
      EXPECT_EQ(sum, mc.num_params() + tied_copy) << name << " pp " << pp;
    }
  }
}

TEST(PpPlan, ContextsPerScheduleAgainstSimulate) {
  const ModelConfig mc = preset("llama-8b");  // 32 blocks
  for (int p : {2, 4, 8})
    for (int m : {1, 3, 8, 16}) {
      for (PipelineKind k : {PipelineKind::GPipe, PipelineKind::OneFOneB, PipelineKind::ZeroBubble}) {
        const PipelineLayout pl = layout(mc, p, k, 1, m);
        const PipelineTimeline t = simulate(*pl.schedule(m), {ActionTimes{}});
        ASSERT_EQ(t.error, "");
        for (int r = 0; r < p; ++r) {
          int peak = -1;
          const std::vector<int> c = pipeline_contexts(pl, r, m, &peak);
          ASSERT_EQ(c.size(), 1u);
          EXPECT_EQ(peak, t.peak_in_flight[static_cast<size_t>(r)]);
          EXPECT_EQ(c[0], peak) << "one chunk per rank: its pool is the rank's peak";
          if (k == PipelineKind::GPipe) {
            EXPECT_EQ(c[0], m) << "all forwards before any backward";
          }
          if (k == PipelineKind::OneFOneB) {
            EXPECT_EQ(c[0], std::min(p - r, m)) << "p " << p << " m " << m << " r " << r;
          }
        }
      }
      if (m % p) continue;
      const PipelineLayout il = layout(mc, p, PipelineKind::Interleaved, 2, m);
      const PipelineTimeline t = simulate(*il.schedule(m), {ActionTimes{}});
      for (int r = 0; r < p; ++r) {
        int peak = -1;
        const std::vector<int> c = pipeline_contexts(il, r, m, &peak);
        ASSERT_EQ(c.size(), 2u);
        EXPECT_EQ(peak, t.peak_in_flight[static_cast<size_t>(r)]);
        EXPECT_GE(c[0] + c[1], peak) << "pools per chunk hold at least the peak at once";
        EXPECT_LE(c[0] + c[1], 2 * m);
      }
    }
}

TEST(PpPlan, ActivationsAreContextsTimesContextBytesAndZeroBubbleAddsDeferred) {
  const ModelConfig mc = preset("llama-8b");
  const int p = 4, m = 8;
  for (int s = 0; s < p; ++s) {
    const MemoryPlanInput in = input(mc, p, PipelineKind::OneFOneB, 1, m, s);
    const int b = in.pipeline.bounds[static_cast<size_t>(s)], e = in.pipeline.bounds[static_cast<size_t>(s) + 1];
    const int64_t ctx = context_bytes(mc, model_options(in.train), 1, 1024, 2, b, e);
    const MemoryPlan one = plan_memory(in);
    EXPECT_EQ(line_starting(one, "activations: " + std::to_string(p - s) +
                                     (p - s == 1 ? " micro-batch chunk" : " micro-batch chunks") + " in flight (1f1b"),
              (p - s) * ctx);
    EXPECT_EQ(line_starting(one, "deferred weight-gradient inputs"), -1);
    // Four [R, C] bf16 receive buffers and two send buffers: R = 1 x 1024 rows, C = 4096.
    EXPECT_EQ(line_starting(one, "pipeline receive and send buffers"), 6 * 2 * 1024 * 4096);
    MemoryPlanInput zin = input(mc, p, PipelineKind::ZeroBubble, 1, m, s);
    const MemoryPlan zb = plan_memory(zin);
    const int held = pipeline_contexts(zin.pipeline, s, m)[0];
    EXPECT_EQ(line_starting(zb, "deferred weight-gradient inputs"),
              held * deferred_weight_bytes(mc, model_options(zin.train), 1, 1024, 2, e - b));
    // Everything else is 1F1B's: the same units, scratch and buffers.
    EXPECT_EQ(zb.total() - line_starting(zb, "deferred weight-gradient inputs") - held * ctx,
              one.total() - (p - s) * ctx);
  }
}

// context_bytes is what the model allocates for a context, and model.h's formula written out.
TEST(PpPlan, ContextBytesMatchAllocations) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  ModelConfig c;
  c.name = "pp-plan";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = true;
  const int B = 2, T = 40, BT = B * T, C = 16, I = 24, Q = 16, KV = 8;  // HD 4: 4 heads, 2 KV heads
  for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    const ModelOptions o{rc, AttentionKind::Tiled, 0};
    // Per block, tiled attention (model.h activation_bytes' parts, fp32): x; unless Full, 2 rstd +
    // q + 2 kv + y + x1 + 2 gate/up + lse (B x NH x T, fp32); None also h.
    const int64_t rest = 4 * (2 * BT + BT * Q + 2 * BT * KV + BT * Q + BT * C + 2 * BT * I) + 4 * (B * 4 * T);
    const int64_t block = 4 * BT * C + (rc != Recompute::Full ? rest : 0) + (rc == Recompute::None ? 4 * BT * I : 0);
    const int64_t ends = 4 * 2 * BT * C;  // output and residual gradient
    EXPECT_EQ(context_bytes(c, o, B, T, 4, 0, 2), 2 * block + ends + 4 * BT) << "token ids";
    EXPECT_EQ(context_bytes(c, o, B, T, 4, 2, 4), 2 * block + ends + 4 * (BT * C + BT) + 4 * BT)
        << "final norm output and rstd, target ids";
    EXPECT_EQ(context_bytes(c, o, B, T, 4, 1, 3), 2 * block + ends);
    testing::CountingBackend<float> be;
    Fsdp<float> f(be, testing::comm(), ShardPlan::build(llama_units(c), 1));
    f.init_params(3);
    {
      LlamaModel<float> model(c, be, o);
      using Ctx = LlamaModel<float>::Context;
      std::vector<int32_t> tok(static_cast<size_t>(BT));
      for (int i = 0; i < BT; ++i) tok[static_cast<size_t>(i)] = i % c.vocab_size;
      Ctx a(BlockRange{0, 2, {}}), b(BlockRange{2, 4, {}}), a2(BlockRange{0, 2, {}}), b2(BlockRange{2, 4, {}});
      model.forward(f, a, tok.data(), nullptr, B, T);  // the model's shared scratch is allocated here too
      model.forward(f, b, nullptr, a.output(), B, T);
      const int64_t before = static_cast<int64_t>(be.live_bytes());
      model.forward(f, a2, tok.data(), nullptr, B, T);
      const int64_t mid = static_cast<int64_t>(be.live_bytes());
      model.forward(f, b2, nullptr, a2.output(), B, T);
      EXPECT_EQ(mid - before, context_bytes(c, o, B, T, 4, 0, 2)) << recompute_name(rc);
      EXPECT_EQ(static_cast<int64_t>(be.live_bytes()) - mid, context_bytes(c, o, B, T, 4, 2, 4)) << recompute_name(rc);
    }
  }
}

}  // namespace
}  // namespace shardtrain
