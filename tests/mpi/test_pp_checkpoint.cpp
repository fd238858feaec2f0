// Checkpoints of pipeline-parallel meshes (docs/checkpoint-format.md, "Version 6"), through the
// parallel layer's own state and checkpoint layout (parallelize.h: each stage's ShardRowsLayout or
// TpCanonicalLayout over the stage's ranks), no training: every element of the parameters and both
// AdamW moments is set to a value that depends only on its canonical place (tensor, model unit,
// canonical index), saved at (pp 2 x dp 2), (pp 2 x tp 2) and (pp 2 interleaved, 2 chunks per
// stage), and loaded at other meshes of 4 and 2 ranks: pp 1, pp 4, pp 2 x tp 2, hybrid sharding
// under pp, ...; every element must come back bitwise, padding as zeros, the last stage's tied
// copy of the embedding included. A last stage whose copy differs is refused at save, on every
// rank, and nothing is written. tests/e2e/test_pp_checkpoint.sh reads the kept files with h5py
// and exports them (SHARDTRAIN_TEST_PP_CHECKPOINT_OUT).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "layout_rank.h"
#include "rank_test.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/parallelize.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/runtime/runtime.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class PpCheckpoint : public st::testing::TempDirTest {};

// 4 blocks (pp 4 holds one each), 4 heads, 2 KV heads (TP 2 divides them), a tied embedding (the
// last stage holds a copy), vocabulary 37 (padding rows at TP 2).
st::ModelConfig config() {
  st::ModelConfig c;
  c.name = "pp-checkpoint";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = true;
  c.rope_theta = 10000.0;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  return c;
}

const char* kTrainConfig =
    "{\"seq_len\":6,\"global_batch\":2,\"micro_batch\":2,\"steps\":1,\"warmup\":0,\"seed\":7,\"lr\":1,\"min_lr\":1,"
    "\"beta1\":0.9,\"beta2\":0.99,\"eps\":1e-8,\"weight_decay\":0,\"clip\":0,\"precision\":\"fp32\"}";

using layout_test::Rank;
using layout_test::value;
using layout_test::visit;

void keep(st::Comm& c, const std::string& file) {
  if (const char* out = std::getenv("SHARDTRAIN_TEST_PP_CHECKPOINT_OUT"); out && *out && c.rank() == 0)
    std::filesystem::copy_file(file, std::string(out) + "/" + std::filesystem::path(file).filename().string(),
                               std::filesystem::copy_options::overwrite_existing);
}

// Saves a run at `saved` to `file` through its checkpoint layout; `spoil`: the last stage's tied copy
// of the embedding gets one element changed first (the save must refuse it).
void save_at(st::Comm& c, const st::MeshDims& saved, const st::ModelConfig& cfg, st::Backend<float>& be,
             const std::string& file, int virt = 1, bool spoil = false) {
  const st::ShardPlan canon = st::ShardPlan::build(st::llama_units(cfg), 1);
  Rank a(c, saved, cfg, be, virt);
  visit(a.tensors(be), canon, true);
  if (spoil && a.run.stage.tied_copy && a.run.state->plan_rank() == 0)
    a.run.state->param_shard(a.run.stage.embedding)[0] += 1.0f;
  layout_test::save_rank(c, a, cfg, be, file, kTrainConfig);
  keep(c, file);
}

int64_t load_at(st::Comm& c, const st::MeshDims& d, const st::ModelConfig& cfg, st::Backend<float>& be,
                const std::string& file) {
  const st::ShardPlan canon = st::ShardPlan::build(st::llama_units(cfg), 1);
  Rank b(c, d, cfg, be);
  return layout_test::load_rank(c, b, cfg, be, file, canon);
}

std::string words(const st::MeshDims& d) {
  return "(pp " + std::to_string(d.pp) + ", dp_replicate " + std::to_string(d.dp_replicate) + ", dp_shard " +
         std::to_string(d.dp_shard) + ", cp " + std::to_string(d.cp) + ", tp " + std::to_string(d.tp) + ")";
}

// MeshDims{R, D, C, N, P}.
void check_reshards(st::Comm& c, const st::ModelConfig& cfg, st::Backend<float>& be, const std::string& file) {
  const int r = c.rank();
  for (const st::MeshDims& d :
       std::vector<st::MeshDims>{{1, 4, 1, 1, 1}, {1, 1, 1, 1, 4}, {1, 2, 1, 1, 2}, {1, 1, 1, 2, 2}, {2, 1, 1, 1, 2},
                                 {1, 1, 2, 1, 2}, {1, 2, 1, 2, 1}, {1, 2, 2, 1, 1}}) {
    SCOPED_TRACE("load at 4 ranks " + words(d));
    EXPECT_EQ(load_at(c, d, cfg, be, file), 0);
  }
  st::MpiComm half = st::MpiComm::split(c, r / 2, r);
  for (const st::MeshDims& d : std::vector<st::MeshDims>{{1, 1, 1, 1, 2}, {1, 2, 1, 1, 1}, {1, 1, 1, 2, 1}}) {
    SCOPED_TRACE("load at 2 ranks " + words(d));
    EXPECT_EQ(load_at(half, d, cfg, be, file), 0);
  }
  c.barrier();
}

// make test runs these once, from tests/e2e/test_pp_checkpoint.sh, which sets
// SHARDTRAIN_TEST_PP_CHECKPOINT_OUT and keeps their files: without it they skip (run_all.sh's mpi-np4).
std::string not_here(const st::Comm& c) {
  if (c.world_size() != 4) return "W = 4";
  const char* out = std::getenv("SHARDTRAIN_TEST_PP_CHECKPOINT_OUT");
  if (!out || !*out) return "run by tests/e2e/test_pp_checkpoint.sh (SHARDTRAIN_TEST_PP_CHECKPOINT_OUT=DIR runs them here)";
  return "";
}

TEST_F(PpCheckpoint, StagesOfShardGroupsReshardBitwise) {
  st::Comm& c = world();
  if (const std::string why = not_here(c); !why.empty()) GTEST_SKIP() << why;
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<float>();
  const std::string file = path("pp2_dp2.h5");
  save_at(c, st::MeshDims{1, 2, 1, 1, 2}, cfg, *be, file);
  const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
  EXPECT_EQ(info.format_version, 6);
  EXPECT_EQ(info.world_size, 2);  // one stage's shard group
  EXPECT_EQ(info.pp, 2);
  EXPECT_EQ(info.pp_virtual, 1);
  EXPECT_EQ(info.pp_bounds, (std::vector<int>{0, 2, 4}));
  ASSERT_EQ(info.units.size(), 6u);  // the embedding once, 4 blocks, the norm
  const std::vector<int> stages = {0, 0, 0, 1, 1, 1};
  for (size_t u = 0; u < info.units.size(); ++u) EXPECT_EQ(info.units[u].stage, stages[u]) << info.units[u].name;
  EXPECT_EQ(st::saved_layout_words(info), "pp 2 (1f1b) x world size 2 per stage: cp 1 x dp_shard 2");
  check_reshards(c, cfg, *be, file);
}

TEST_F(PpCheckpoint, StagesOfCanonicalTpRowsReshardBitwise) {
  st::Comm& c = world();
  if (const std::string why = not_here(c); !why.empty()) GTEST_SKIP() << why;
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<float>();
  const std::string file = path("pp2_tp2.h5");
  save_at(c, st::MeshDims{1, 1, 1, 2, 2}, cfg, *be, file);
  const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
  EXPECT_EQ(info.format_version, 6);
  EXPECT_EQ(info.world_size, 2);  // one stage's canonical rows
  EXPECT_EQ(info.tp, 2);
  EXPECT_EQ(info.pp, 2);
  for (const auto& u : info.units) EXPECT_EQ(u.tp.shards.size(), 1u) << u.name;
  check_reshards(c, cfg, *be, file);
}

TEST_F(PpCheckpoint, InterleavedChunksAndWholeModelFiles) {
  st::Comm& c = world();
  if (const std::string why = not_here(c); !why.empty()) GTEST_SKIP() << why;
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<float>();
  const std::string file = path("pp2v2_dp2.h5");
  save_at(c, st::MeshDims{1, 2, 1, 1, 2}, cfg, *be, file, /*virt=*/2);
  const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
  EXPECT_EQ(info.pp_virtual, 2);
  EXPECT_EQ(info.pp_schedule, "interleaved");
  const std::vector<int> stages = {0, 0, 1, 0, 1, 1};  // chunks [0,1) [1,2) [2,3) [3,4) on stages 0 1 0 1
  for (size_t u = 0; u < info.units.size(); ++u) EXPECT_EQ(info.units[u].stage, stages[u]) << info.units[u].name;
  EXPECT_EQ(load_at(c, st::MeshDims{1, 4, 1, 1, 1}, cfg, *be, file), 0);
  EXPECT_EQ(load_at(c, st::MeshDims{1, 1, 1, 1, 4}, cfg, *be, file), 0);
  // A file of one stage (version 3) of the same values loads at pp 2 and pp 4.
  const std::string v3 = path("pp1_dp4.h5");
  save_at(c, st::MeshDims{1, 4, 1, 1, 1}, cfg, *be, v3);
  EXPECT_EQ(st::read_checkpoint_info(c, v3).format_version, 3);
  EXPECT_EQ(load_at(c, st::MeshDims{1, 2, 1, 1, 2}, cfg, *be, v3), 0);
  EXPECT_EQ(load_at(c, st::MeshDims{1, 1, 1, 1, 4}, cfg, *be, v3), 0);
}

// The last stage's copy of the tied embedding differs from the first stage's: every rank throws
// the same error at save, and neither the file nor anything else is left.
TEST_F(PpCheckpoint, DifferingTiedCopyIsNotSaved) {
  st::Comm& c = world();
  if (const std::string why = not_here(c); !why.empty()) GTEST_SKIP() << why;
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<float>();
  const std::string file = path("spoiled.h5");
  std::string msg;
  try {
    save_at(c, st::MeshDims{1, 2, 1, 1, 2}, cfg, *be, file, 1, /*spoil=*/true);
  } catch (const st::CollectiveError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("the last pipeline stage's copy of the tied embedding differs from the first stage's (unit "
                     "'model.embed_tokens', params of shard rank 0"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("not published"), std::string::npos) << msg;
  c.barrier();
  EXPECT_FALSE(std::filesystem::exists(file));
}

}  // namespace
