// Checkpoints of expert-parallel meshes (docs/checkpoint-format.md, "Version 7"), through the
// parallel layer's own state and checkpoint layout (parallelize.h: EpCanonicalLayout), no
// training. Under --ep N the experts of each MoE block are a unit of their own (EP index e's
// E / N experts, sharded over the expert shard group); the file holds the canonical rows of the
// shard group, the experts inside their block's unit, as a run without EP holds them. Every element
// of the parameters and both AdamW moments is set to a value that depends only on its canonical
// place (tensor, canonical unit, canonical index), saved at ep 2 and ep 4 over 4 ranks, with hybrid
// sharding, with CP and with PP, and loaded at every other of those meshes, at ep 1 and at 2 ranks:
// every element must come back bitwise, padding as zeros. The file's metadata (version 7, attribute
// `mesh`, the canonical units with one row per rank of the shard group) is read back by the
// program's own reader.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "layout_rank.h"
#include "rank_test.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/parallelize.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/runtime/runtime.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class EpCheckpoint : public st::testing::TempDirTest {};

// Qwen3-MoE style: 8 experts, an MoE block, a dense one (mlp_only_layers), an MoE block; shards that
// do not divide evenly (the expert units' 2 x 8 x 16 x 12 / N elements over 4 / N ranks do, the
// blocks' do not).
st::ModelConfig config() {
  st::ModelConfig c;
  c.name = "ep-checkpoint";
  c.architecture = "Qwen3MoeForCausalLM";
  c.qk_norm = true;
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 20;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 6;
  c.mlp_only_layers = {1};
  c.tie_word_embeddings = false;
  c.rope_theta = 10000.0;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  return c;
}

const char* kTrainConfig =
    "{\"seq_len\":6,\"global_batch\":4,\"micro_batch\":1,\"steps\":1,\"warmup\":0,\"seed\":7,\"lr\":1,\"min_lr\":1,"
    "\"beta1\":0.9,\"beta2\":0.99,\"eps\":1e-8,\"weight_decay\":0,\"clip\":0,\"precision\":\"fp32\"}";

using layout_test::Rank;
using layout_test::visit;

st::MeshDims mesh(int R, int D, int C, int P, int ep) {
  st::MeshDims d{R, D, C, 1, P};
  d.ep = ep;
  return d;
}

std::string words(const st::MeshDims& d) {
  return "(pp " + std::to_string(d.pp) + ", dp_replicate " + std::to_string(d.dp_replicate) + ", dp_shard " +
         std::to_string(d.dp_shard) + ", cp " + std::to_string(d.cp) + ", ep " + std::to_string(d.ep) + ")";
}

void save_at(st::Comm& c, const st::MeshDims& saved, const st::ModelConfig& cfg, st::Backend<float>& be,
             const std::string& file) {
  const st::ShardPlan canon = st::ShardPlan::build(st::llama_units(cfg), 1);
  Rank a(c, saved, cfg, be);
  visit(a.tensors(be), canon, true);
  layout_test::save_rank(c, a, cfg, be, file, kTrainConfig);
}

int64_t load_at(st::Comm& c, const st::MeshDims& d, const st::ModelConfig& cfg, st::Backend<float>& be,
                const std::string& file) {
  const st::ShardPlan canon = st::ShardPlan::build(st::llama_units(cfg), 1);
  Rank b(c, d, cfg, be);  // parameters start at the init's values, the moments at -3: all overwritten
  return layout_test::load_rank(c, b, cfg, be, file, canon);
}

TEST_F(EpCheckpoint, CanonicalRowsOfEveryEpLayoutReshardBitwise) {
  st::Comm& c = world();
  if (c.world_size() != 4) GTEST_SKIP() << "W = 4";
  const int r = c.rank();
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<float>();
  const std::vector<st::MeshDims> meshes = {mesh(1, 4, 1, 1, 2), mesh(1, 4, 1, 1, 4), mesh(2, 2, 1, 1, 2),
                                            mesh(1, 2, 2, 1, 2), mesh(1, 2, 2, 1, 4), mesh(1, 2, 1, 2, 2),
                                            mesh(1, 4, 1, 1, 1)};
  for (size_t i = 0; i + 1 < meshes.size(); ++i) {  // every EP mesh saves (the last is ep 1)
    const st::MeshDims& s = meshes[i];
    SCOPED_TRACE("saved at 4 ranks " + words(s));
    const std::string file = path("ep" + std::to_string(i) + ".h5");
    save_at(c, s, cfg, *be, file);
    const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
    EXPECT_EQ(info.format_version, 7);
    EXPECT_EQ(info.ep, s.ep);
    EXPECT_EQ(info.pp, s.pp);
    EXPECT_EQ(info.world_size, s.fsdp());  // the shard group's canonical rows (one stage's under PP)
    EXPECT_EQ(info.units.size(), static_cast<size_t>(cfg.num_hidden_layers) + 2);  // the experts inside their blocks
    for (const auto& u : info.units) EXPECT_EQ(u.ranks.size(), static_cast<size_t>(s.fsdp())) << u.name;
    for (const st::MeshDims& d : meshes) {
      SCOPED_TRACE("loaded at 4 ranks " + words(d));
      EXPECT_EQ(load_at(c, d, cfg, *be, file), 0);
    }
    st::MpiComm half = st::MpiComm::split(c, r / 2, r);  // 2 ranks: ep 2, ep 1, and pp 2 without EP
    for (const st::MeshDims& d : {mesh(1, 2, 1, 1, 2), mesh(1, 2, 1, 1, 1), mesh(1, 1, 1, 2, 1)}) {
      SCOPED_TRACE("loaded at 2 ranks " + words(d));
      EXPECT_EQ(load_at(half, d, cfg, *be, file), 0);
    }
    c.barrier();
  }
}

}  // namespace
