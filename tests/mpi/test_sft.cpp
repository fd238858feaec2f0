// Supervised fine-tuning on packed example data (issue 55) in float64 at the world size mpirun
// gives: one optimizer step of the trainer's own path (StageRunner reading PackedBatches through
// batch_reader, the gradient scale of Trainer::train_step: the mean over the global batch's target
// tokens) at W = 1 (every rank alone, on a communicator of its own) and at dp W, cp 2 x dp W/2 and
// pp 2 x dp W/2 (1F1B and zero-bubble): the loss (summed where the mesh counts it, divided by the
// global target count) and every parameter's gradient within 1e-12 relative of W = 1. The examples
// have very different lengths and target counts, so micro-batches hold very different numbers of
// targets: the mean of the per-micro-batch means differs from the global mean (checked), which is
// the gradient-accumulation bug transformers fixed in PR #34191. 1 rank: W = 1 only; odd W: no
// cp 2 / pp 2.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/data/packing.h"
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/context_parallel.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/parallel/stage_runner.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/shard/shard.h"
#include "shardtrain/train/train.h"
#include "../test_env.h"
#include "../token_files.h"
#include "pipeline_test_model.h"

namespace st = shardtrain;

namespace {

constexpr int kT = 32, kG = 12;  // seq_len, global batch (rows: divisible by 1, 2, 3, 4 and 6 ranks)

// 70 examples of 2 to 80 tokens (some longer than kT: truncated), each a conversation of context
// runs and assistant runs ending in an end-of-turn token, written by this rank (the same bytes on
// every rank).
std::string sft_file() {
  st::testing::V3 v;
  v.vocab = 258;
  v.eos = 257;
  v.e_val = 6;
  for (size_t e = 0; e < 70; ++e) {
    const uint64_t len = 2 + (e * e * 7 + e * 13) % 79;
    v.starts.push_back(v.toks.size());
    for (uint64_t i = 0, turn = 0; i < len; ++turn) {
      const uint64_t ctx = 1 + (e * 5 + turn * 3) % 9, ans = 1 + (e * 3 + turn) % 6;
      for (uint64_t k = 0; k < ctx && i < len; ++k, ++i) v.roles.push_back(0);
      for (uint64_t k = 0; k < ans && i < len; ++k, ++i) v.roles.push_back(k + 1 == ans ? 2 : 1);
    }
    for (uint64_t k = 0; k < len; ++k) v.toks.push_back(static_cast<uint32_t>((e * 41 + k * 17 + 3) % 257));
  }
  const std::string dir = "/tmp/shardtrain-sft-" + std::to_string(getppid()) + "-" + std::to_string(st::testing::comm().rank());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/sft.tok", std::ios::binary) << st::testing::v3_file(v);
  return dir + "/sft.tok";
}

struct Step {
  std::map<std::string, std::vector<double>> grads;
  double loss = 0;  // summed where the mesh counts it, over the world, / targets
  int64_t targets = 0;
};

// One step at mesh `d` over `comm` (P = d.pp stages of schedule `kind`), micro-batch 1.
Step run_step(st::Comm& comm, const st::MeshDims& d, st::PipelineKind kind, const st::ModelConfig& mc,
              const st::TokenDataset& data) {
  const st::Mesh mesh(comm, st::testing::g_runtime->topo(), d, 0);
  st::TrainConfig tc;
  tc.seq_len = kT;
  tc.global_batch = kG;
  tc.micro_batch = 1;
  tc.seed = 3;
  const int per_rank = kG / mesh.dp_size(), m = per_rank;
  std::string why;
  st::PipelineOptions po;
  po.kind = kind;
  const st::PipelineLayout pl = st::resolve_pipeline(mc, d.pp, po, m, &why);
  EXPECT_EQ(why, "");
  auto be = st::make_cpu_backend<double>();
  const st::RankUnits ru = st::pipeline_rank_units(mc, pl, mesh.coord().pp);
  st::ShardedState<double> f(*be, mesh, st::ShardPlan::build(ru.units, d.fsdp()));
  f.init_params(11);
  f.zero_grads();
  st::UnitPipeline<double> units(*be, std::make_unique<st::IdentityCodec<double>>(f));
  std::unique_ptr<st::StageLink<double>> link;
  if (d.pp > 1) link = std::make_unique<st::StageLink<double>>(*mesh.pp_data(), pl, *be, false);
  std::unique_ptr<st::CpAttention<double>> cp;
  if (d.cp > 1) cp = std::make_unique<st::CpAttention<double>>(*mesh.cp_data(), *be, st::CpComm::Ring);
  st::ModelOptions mo;
  mo.mask = st::AttentionMask::Document;
  st::LlamaModel<double> model(mc, *be, mo, nullptr, cp.get());
  auto packed = std::make_shared<const st::PackedBatches>(
      data, st::PackOptions{kT, st::PackMode::BestFit, st::MaxLengthPolicy::Truncate, st::TrainOn::Assistant}, tc.seed,
      kG);
  st::StageRunner<double> runner(mesh, *be, model, units, ru, pl, link.get(), st::batch_reader(packed), kT, per_rank,
                                 1);
  Step s;
  const int64_t index = 1;  // the second global batch
  s.targets = packed->batch_targets(st::Split::Train, index);
  // Trainer::train_step's scale (the reduce-scatter means over dp x cp), unrounded in float64.
  const double scale = st::mean_loss_grad_scale(static_cast<double>(kG) * kT, static_cast<double>(s.targets),
                                                static_cast<double>(per_rank) * kT / d.cp);
  units.begin_pass("train");
  runner.begin(st::Split::Train, index);
  double loss = runner.run(*pl.schedule(m), scale);
  runner.end();
  units.end_pass();
  if (d.pp > 1 && ru.embedding >= 0 && mc.tie_word_embeddings)
    st::sum_tied_grads(*mesh.pp_data(), *be, f.grad_shard(ru.embedding),
                       static_cast<size_t>(f.plan().units[static_cast<size_t>(ru.embedding)].shard_size));
  if (!mesh.counts_loss()) loss = 0;
  comm.all_reduce(&loss, 1, st::ReduceOp::Sum);
  s.loss = loss / static_cast<double>(s.targets);
  s.grads = st::testing::whole_grads(f);
  return s;
}


}  // namespace

TEST(Sft, Float64LossAndGradientsOfPackedExamplesEqualW1AtEveryLayout) {
  st::Comm& c = st::testing::comm();
  const int W = c.world_size();
  const st::ModelConfig mc = st::testing::pipeline_test_config(false, "sft-test");
  const st::TokenDataset data(sft_file());
  st::MpiComm self = st::MpiComm::split(c, c.rank(), 0);
  const Step ref = run_step(self, st::MeshDims{1, 1, 1, 1, 1}, st::PipelineKind::OneFOneB, mc, data);
  ASSERT_GT(ref.targets, kG);
  ASSERT_LT(ref.targets, int64_t{kG} * kT);  // prompts and padding are not targets
  struct Case {
    const char* what;
    st::MeshDims d;
    st::PipelineKind k;
  };
  std::vector<Case> cases = {{"dp W", st::MeshDims{1, W, 1, 1, 1}, st::PipelineKind::OneFOneB}};
  if (W % 2 == 0) {
    cases.push_back({"cp 2 x dp W/2", st::MeshDims{1, W / 2, 2, 1, 1}, st::PipelineKind::OneFOneB});
    cases.push_back({"pp 2 x dp W/2 1f1b", st::MeshDims{1, W / 2, 1, 1, 2}, st::PipelineKind::OneFOneB});
    cases.push_back({"pp 2 x dp W/2 zero-bubble", st::MeshDims{1, W / 2, 1, 1, 2}, st::PipelineKind::ZeroBubble});
  }
  int64_t checked = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    const Step s = run_step(c, k.d, k.k, mc, data);
    EXPECT_EQ(s.targets, ref.targets);
    EXPECT_NEAR(s.loss, ref.loss, 1e-12 * ref.loss);
    checked += st::testing::expect_same_grads(s.grads, ref.grads);
  }
  c.all_reduce(&checked, 1, st::ReduceOp::Sum);
  EXPECT_GT(checked, 0);
}

// The global mean is not the mean of the micro-batches' means: the packed rows of a global batch
// hold very different target counts (the test above would catch a trainer that averaged per
// micro-batch). Per-row losses of the W = 1 model, float64, rows read as the trainer reads them.
TEST(Sft, GlobalMeanDiffersFromTheMeanOfMicroBatchMeans) {
  st::Comm& c = st::testing::comm();
  const st::ModelConfig mc = st::testing::pipeline_test_config(false, "sft-test");
  const st::TokenDataset data(sft_file());
  st::MpiComm self = st::MpiComm::split(c, c.rank(), 0);
  const st::Mesh mesh(self, st::testing::g_runtime->topo(), st::MeshDims{1, 1, 1, 1, 1}, 0);
  auto be = st::make_cpu_backend<double>();
  st::ShardedState<double> f(*be, mesh, st::ShardPlan::build(st::llama_units(mc), 1));
  f.init_params(11);
  st::UnitPipeline<double> units(*be, std::make_unique<st::IdentityCodec<double>>(f));
  st::ModelOptions mo;
  mo.mask = st::AttentionMask::Document;
  st::LlamaModel<double> model(mc, *be, mo);
  const st::PackedBatches pb(
      data, st::PackOptions{kT, st::PackMode::BestFit, st::MaxLengthPolicy::Truncate, st::TrainOn::Assistant}, 3, kG);
  std::vector<int32_t> tok(kT), tgt(kT), doc(kT), pos(kT);
  double sum = 0, mean_of_means = 0;
  int64_t n = 0, fewest = kT, most = 0;
  for (int i = 0; i < kG; ++i) {
    pb.fill(st::Split::Train, 1, i, 1, tok.data(), tgt.data(), doc.data(), pos.data());
    int64_t t = 0;
    for (int32_t x : tgt) t += x != st::kNoTarget;
    model.forward(units, tok.data(), 1, kT, st::TokenLayout{pos.data(), doc.data()});
    const double l = model.loss(units, tgt.data());
    sum += l;
    n += t;
    mean_of_means += l / static_cast<double>(t) / kG;
    fewest = std::min(fewest, t);
    most = std::max(most, t);
  }
  EXPECT_EQ(n, pb.batch_targets(st::Split::Train, 1));
  EXPECT_GE(most, 3 * fewest) << "the micro-batches' target counts should differ widely";
  const double global = sum / static_cast<double>(n);
  EXPECT_GT(std::abs(mean_of_means - global), 1e-3 * global)
      << "global mean " << global << ", mean of micro-batch means " << mean_of_means;
}
