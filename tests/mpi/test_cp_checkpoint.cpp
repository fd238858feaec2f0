// Checkpoints of context-parallel meshes (docs/checkpoint-format.md, "Version 5"), through the
// parallel layer's own state and checkpoint layout (parallelize.h: ShardRowsLayout over dp_shard x
// cp, TpCanonicalLayout with cp), no training: every element of the parameters and both AdamW
// moments is set to a value that depends only on its canonical place (tensor, unit, canonical
// index), saved at (dp_shard 2 x cp 2) and at (cp 2 x tp 2), and loaded at other meshes of 4 and
// of 2 ranks: (cp 1, dp 2), (cp 1, tp 2), (cp 4), hybrid sharding with cp, ...; every element
// must come back bitwise, padding as zeros. The file's metadata (version 5, attribute `mesh`, the
// shard tables' rows) is read back by the program's own reader here and by h5py in
// tests/e2e/test_cp_layout.sh (which sets SHARDTRAIN_TEST_CP_CHECKPOINT_OUT to keep the files).
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
#include "shardtrain/runtime/runtime.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class CpCheckpoint : public st::testing::TempDirTest {};

// 4 heads, 2 KV heads (TP 2 divides them), an untied head, vocabulary 37 (padding rows at TP 2).
st::ModelConfig config() {
  st::ModelConfig c;
  c.name = "cp-checkpoint";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = false;
  c.rope_theta = 10000.0;
  c.bos_token_id = 1;  // inside the vocabulary: the files pass --mode inspect's checks too
  c.eos_token_ids = {2};
  return c;
}

const char* kTrainConfig =
    "{\"seq_len\":6,\"global_batch\":2,\"micro_batch\":2,\"steps\":1,\"warmup\":0,\"seed\":7,\"lr\":1,\"min_lr\":1,"
    "\"beta1\":0.9,\"beta2\":0.99,\"eps\":1e-8,\"weight_decay\":0,\"clip\":0,\"precision\":\"fp32\"}";

using layout_test::Rank;
using layout_test::value;
using layout_test::visit;

// Saves a run at `saved` (4 ranks) to `file` through its checkpoint layout.
void save_at(st::Comm& c, const st::MeshDims& saved, const st::ModelConfig& cfg, st::Backend<float>& be,
             const std::string& file) {
  const st::ShardPlan canon = st::ShardPlan::build(st::llama_units(cfg), 1);
  Rank a(c, saved, cfg, be);
  visit(a.tensors(be), canon, true);
  layout_test::save_rank(c, a, cfg, be, file, kTrainConfig);
  if (const char* out = std::getenv("SHARDTRAIN_TEST_CP_CHECKPOINT_OUT"); out && *out && c.rank() == 0)
    std::filesystem::copy_file(file, std::string(out) + "/" + std::filesystem::path(file).filename().string(),
                               std::filesystem::copy_options::overwrite_existing);
}

// Loads `file` at mesh `d` over `c` and counts the elements that differ from value().
int64_t load_at(st::Comm& c, const st::MeshDims& d, const st::ModelConfig& cfg, st::Backend<float>& be,
                const std::string& file) {
  const st::ShardPlan canon = st::ShardPlan::build(st::llama_units(cfg), 1);
  Rank b(c, d, cfg, be);  // parameters start at the init's values, the moments at -3: all overwritten
  return layout_test::load_rank(c, b, cfg, be, file, canon);
}

std::string words(const st::MeshDims& d) {
  return "(dp_replicate " + std::to_string(d.dp_replicate) + ", dp_shard " + std::to_string(d.dp_shard) + ", cp " +
         std::to_string(d.cp) + ", tp " + std::to_string(d.tp) + ")";
}

void check_reshards(st::Comm& c, const st::ModelConfig& cfg, st::Backend<float>& be, const std::string& file) {
  const int r = c.rank();
  for (const st::MeshDims& d : std::vector<st::MeshDims>{{1, 1, 4, 1}, {1, 2, 1, 2}, {1, 4, 1, 1}, {2, 1, 2, 1},
                                                          {1, 2, 2, 1}, {1, 1, 2, 2}, {2, 2, 1, 1}}) {
    SCOPED_TRACE("load at 4 ranks " + words(d));
    EXPECT_EQ(load_at(c, d, cfg, be, file), 0);
  }
  // 2 ranks (each half of the world its own job): (cp 1, dp 2), (cp 1, tp 2), (cp 2).
  st::MpiComm half = st::MpiComm::split(c, r / 2, r);
  for (const st::MeshDims& d : std::vector<st::MeshDims>{{1, 2, 1, 1}, {1, 1, 1, 2}, {1, 1, 2, 1}}) {
    SCOPED_TRACE("load at 2 ranks " + words(d));
    EXPECT_EQ(load_at(half, d, cfg, be, file), 0);
  }
  c.barrier();
}

// Saved at dp_shard 2 x cp 2 (the shard group's 4 rows, ShardRowsLayout): version 5, attribute
// `mesh`, world_size 4 (the FSDP shard group dp_shard x cp), no TP record; loads everywhere.
TEST_F(CpCheckpoint, ShardGroupOverDpShardAndCpReshardsBitwise) {
  st::Comm& c = world();
  if (c.world_size() != 4) GTEST_SKIP() << "W = 4";
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<float>();
  const std::string file = path("cp2_dp2.h5");
  save_at(c, st::MeshDims{1, 2, 2, 1}, cfg, *be, file);
  const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
  EXPECT_EQ(info.format_version, 5);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.cp, 2);
  EXPECT_EQ(info.tp, 1);
  EXPECT_EQ(info.tp_dp_shard, 2);
  EXPECT_EQ(info.tp_dp_replicate, 1);
  EXPECT_EQ(st::saved_layout_words(info), "world size 4: cp 2 x dp_shard 2");
  for (const auto& u : info.units) EXPECT_EQ(u.ranks.size(), 4u) << u.name;  // shard table: dp_shard x cp rows
  check_reshards(c, cfg, *be, file);
}

// Saved at cp 2 x tp 2 (canonical rows of the world, TpCanonicalLayout): version 5 with the TP
// record, its tp_shard_table over dp_shard x cp = 2 rows; loads everywhere.
TEST_F(CpCheckpoint, CanonicalRowsOfCpAndTpReshardBitwise) {
  st::Comm& c = world();
  if (c.world_size() != 4) GTEST_SKIP() << "W = 4";
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<float>();
  const std::string file = path("cp2_tp2.h5");
  save_at(c, st::MeshDims{1, 1, 2, 2}, cfg, *be, file);
  const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
  EXPECT_EQ(info.format_version, 5);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.cp, 2);
  EXPECT_EQ(info.tp, 2);
  EXPECT_EQ(info.tp_dp_shard, 1);
  EXPECT_EQ(st::saved_layout_words(info), "world size 4: tp 2 x cp 2 x dp_shard 1 x dp_replicate 1");
  for (const auto& u : info.units) {
    EXPECT_EQ(u.ranks.size(), 4u) << u.name;     // canonical rows: one per world rank
    EXPECT_EQ(u.tp.shards.size(), 2u) << u.name;  // the TP-local buffer over dp_shard x cp
  }
  check_reshards(c, cfg, *be, file);
}

// Files without cp keep their versions (3; 4 with TP) and read with cp = 1.
TEST_F(CpCheckpoint, FilesWithoutCpKeepTheirVersion) {
  st::Comm& c = world();
  if (c.world_size() != 4) GTEST_SKIP() << "W = 4";
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<float>();
  for (auto [d, version] : {std::pair{st::MeshDims{1, 4, 1, 1}, 3}, std::pair{st::MeshDims{1, 2, 1, 2}, 4}}) {
    SCOPED_TRACE("saved at " + words(d));
    const std::string file = path("v" + std::to_string(version) + ".h5");
    save_at(c, d, cfg, *be, file);
    const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
    EXPECT_EQ(info.format_version, version);
    EXPECT_EQ(info.cp, 1);
    EXPECT_EQ(load_at(c, st::MeshDims{1, 2, 2, 1}, cfg, *be, file), 0);  // and loads at cp 2
  }
}

}  // namespace
