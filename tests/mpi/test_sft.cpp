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
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/data/packing.h"
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/context_parallel.h"
#include "shardtrain/parallel/expert_parallel.h"
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
  // A mixture of experts: the load-balancing loss (sequence scope) summed where the mesh counts it,
  // / the global batch's sequences, and every block's routed slots per expert summed over the ranks
  // (StageRunner::take_expert_counts, the trainer's reduction).
  double aux = 0, z = 0;  // ... and the router z-loss the same way (weight kZ)
  std::vector<double> counts;
};

constexpr double kZ = 0.01;  // the router z-loss's weight in the MoE steps (--router-z-loss-coef)

// Where a step's parameters come from: init_params(11), or every parameter of this rank's units
// set whole from a host tensor by name (ShardedState::set_param).
using ParamLoader = std::function<std::vector<double>(const std::string& name)>;

// One step at mesh `d` over `comm` (P = d.pp stages of schedule `kind`), micro-batch 1: global
// batch `index` of `G` packed rows of `T` tokens.
Step run_step(st::Comm& comm, const st::MeshDims& d, st::PipelineKind kind, const st::ModelConfig& mc,
              const st::TokenDataset& data, int T = kT, int G = kG, int64_t index = 1,
              const ParamLoader& load = nullptr) {
  const st::Mesh mesh(comm, st::testing::g_runtime->topo(), d, 0);
  st::TrainConfig tc;
  tc.seq_len = T;
  tc.global_batch = G;
  tc.micro_batch = 1;
  tc.seed = 3;
  const int per_rank = G / mesh.dp_size(), m = per_rank;
  std::string why;
  st::PipelineOptions po;
  po.kind = kind;
  po.chunks_per_rank = kind == st::PipelineKind::Interleaved ? 2 : 1;
  const st::PipelineLayout pl = st::resolve_pipeline(mc, d.pp, po, m, &why);
  EXPECT_EQ(why, "");
  auto be = st::make_cpu_backend<double>();
  // Under EP the experts are units of this rank's EP index over its expert shard group, in a
  // pipeline of their own (as parallelize lays them out).
  const int ep_rank = mesh.layout().ep_index(mesh.rank());
  const st::RankUnits ru = st::pipeline_rank_units(mc, pl, mesh.coord().pp, 1, 0, d.ep, ep_rank);
  st::ShardedState<double> f(*be, mesh.world(), st::ShardPlan::build(ru.units, d.fsdp(), d.ep > 1 ? d.fsdp() / d.ep : 0),
                             &mesh.shard_data(), mesh.replica_data(), mesh.expert_shard_data());
  f.init_params(11);
  if (load)
    for (const auto& up : f.plan().units)
      for (const auto& p : up.params) {
        std::vector<double> v = load(p.spec.name);
        if (p.spec.tp.split == st::TpSplit::Rows && p.spec.tp.degree > 1) {  // an EP slice of the experts
          const int64_t per = p.spec.numel() / p.spec.shape[0];
          v = std::vector<double>(v.begin() + p.spec.tp.offset * per, v.begin() + (p.spec.tp.offset + p.spec.shape[0]) * per);
        }
        f.set_param(p.spec.name, v);
      }
  f.zero_grads();
  std::vector<std::unique_ptr<st::UnitPipeline<double>>> lanes;
  for (int g = 0; g < f.num_groups(); ++g)
    lanes.push_back(std::make_unique<st::UnitPipeline<double>>(*be, std::make_unique<st::IdentityCodec<double>>(f, g)));
  std::unique_ptr<st::UnitSource<double>> source = st::group_sources(std::move(lanes), f.plan());
  st::UnitSource<double>& units = *source;
  std::unique_ptr<st::StageLink<double>> link;
  if (d.pp > 1) link = std::make_unique<st::StageLink<double>>(*mesh.pp_data(), pl, *be, false);
  std::unique_ptr<st::CpAttention<double>> cp;
  if (d.cp > 1)
    cp = std::make_unique<st::CpAttention<double>>(*mesh.cp_data(), *be, st::CpComm::Ring, st::kCpGatherBytes,
                                                   mesh.cp_host());
  std::unique_ptr<st::EpGroup<double>> ep;
  if (d.ep > 1) ep = std::make_unique<st::EpGroup<double>>(*mesh.ep_host(), *mesh.ep_data());
  st::ModelOptions mo;
  mo.mask = st::AttentionMask::Document;
  st::LlamaModel<double> model(mc, *be, mo, nullptr, cp.get(), ep.get());
  auto packed = std::make_shared<const st::PackedBatches>(
      data, st::PackOptions{T, st::PackMode::BestFit, st::MaxLengthPolicy::Truncate, st::TrainOn::Assistant}, tc.seed,
      G);
  st::StageRunner<double> runner(mesh, *be, model, units, ru, pl, link.get(), st::batch_reader(packed), T, per_rank,
                                 1);
  Step s;
  s.targets = packed->batch_targets(st::Split::Train, index);
  // Trainer::train_step's scale (the reduce-scatter means over dp x cp), unrounded in float64.
  const double scale = st::mean_loss_grad_scale(static_cast<double>(G) * T, static_cast<double>(s.targets),
                                                static_cast<double>(per_rank) * T / d.cp);
  // The trainer's weight of the load-balancing loss: coef / this rank's sequences (the reduce-scatter
  // divides by the dp x cp ranks; the runner multiplies by cp).
  if (mc.is_moe()) runner.set_aux_scale(mc.router_aux_loss_coef / per_rank, kZ / per_rank);
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
  if (mc.is_moe()) {
    double aux[2] = {mesh.counts_loss() ? runner.take_aux_sum() : 0.0, mesh.counts_loss() ? runner.take_z_sum() : 0.0};
    comm.all_reduce(aux, 2, st::ReduceOp::Sum);
    s.aux = aux[0] / G;
    s.z = aux[1] / G;
    for (const auto& v : runner.take_expert_counts())
      for (int64_t n : v) s.counts.push_back(mesh.counts_block_stats() ? static_cast<double>(n) : 0.0);
    comm.all_reduce(s.counts.data(), s.counts.size(), st::ReduceOp::Sum);
  }
  s.grads = st::testing::whole_grads(f);
  if (d.ep > 1)  // the experts' slices, whole: the EP group's in EP index order (the canonical [E, ...])
    for (auto& [name, g] : s.grads) {
      if (name.find(".mlp.experts.") == std::string::npos) continue;
      std::vector<double> all(g.size() * static_cast<size_t>(d.ep));
      mesh.ep_host()->all_gather(g.data(), all.data(), g.size());
      g = std::move(all);
    }
  return s;
}

// The W = 1 model (init_params(11), the document mask) and the packed rows (seed 3, global batch
// kG) run_step uses, for calling the model directly on rows as the trainer reads them.
struct OneRank {
  OneRank(st::Comm& self, const st::ModelConfig& mc, const st::TokenDataset& data)
      : mesh(self, st::testing::g_runtime->topo(), st::MeshDims{1, 1, 1, 1, 1}, 0),
        f(*be, mesh, st::ShardPlan::build(st::llama_units(mc), 1)),
        units(*be, std::make_unique<st::IdentityCodec<double>>(f)),
        model(mc, *be, [] {
          st::ModelOptions mo;
          mo.mask = st::AttentionMask::Document;
          return mo;
        }()),
        pb(data, st::PackOptions{kT, st::PackMode::BestFit, st::MaxLengthPolicy::Truncate, st::TrainOn::Assistant}, 3,
           kG) {
    f.init_params(11);
  }
  std::unique_ptr<st::Backend<double>> be = st::make_cpu_backend<double>();
  st::Mesh mesh;
  st::ShardedState<double> f;
  st::UnitPipeline<double> units;
  st::LlamaModel<double> model;
  st::PackedBatches pb;
};

// The little-endian float64 file `path` whole (its size a multiple of 8, at most 1 GiB).
std::vector<double> read_f64(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error("cannot open " + path);
  const auto n = static_cast<std::streamoff>(in.tellg());
  if (n % 8 != 0 || n > (std::streamoff{1} << 30)) throw std::runtime_error(path + ": not a float64 array");
  std::vector<double> v(static_cast<size_t>(n / 8));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), n);
  if (!in) throw std::runtime_error("cannot read " + path);
  return v;
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
  OneRank one(self, mc, data);
  st::LlamaModel<double>& model = one.model;
  st::UnitPipeline<double>& units = one.units;
  const st::PackedBatches& pb = one.pb;
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

// A mixture of experts through the trainer's path (StageRunner on packed example data, whose rows
// end in padding), with the load-balancing loss and the router z-loss (weight kZ) in the gradient:
// both losses (sequence scope) of W = 1 equal, within 1e-12, the means over the rows of the model's
// own losses on each row's real tokens alone (no padding: the padding's routing stays out,
// TokenLayout::real, and under the causal mask the real tokens route as unpadded). And the same step at dp W, cp 2 x dp W/2, pp 2 x dp W/2 (1F1B and interleaved: the
// statistics travel with the activations, the aux gradient's weights back with theirs), pp 2 x cp 2
// (GPipe) and pp 2 x dp 2 with ep 2 (W 4): loss, aux, every gradient within 1e-12 relative of
// W = 1, tokens per expert equal.
TEST(Sft, MoeLoadBalancingLossOfPaddedRowsIsExactAtEveryLayout) {
  st::Comm& c = st::testing::comm();
  const int W = c.world_size();
  st::ModelConfig mc = st::testing::pipeline_test_config(false, "sft-moe-test");
  mc.architecture = "Qwen3MoeForCausalLM";
  mc.qk_norm = true;
  mc.num_hidden_layers = 4;
  mc.num_experts = 4;
  mc.num_experts_per_tok = 2;
  mc.moe_intermediate_size = 16;
  mc.router_aux_loss_coef = 0.05;
  mc.mlp_only_layers = {1};
  const st::TokenDataset data(sft_file());
  st::MpiComm self = st::MpiComm::split(c, c.rank(), 0);
  const Step ref = run_step(self, st::MeshDims{1, 1, 1, 1, 1}, st::PipelineKind::OneFOneB, mc, data);
  ASSERT_GT(ref.aux, 0.0);
  ASSERT_GT(ref.z, 0.0);
  // The reference: every row's real tokens alone through the model, as the runner reads them.
  {
    OneRank one(self, mc, data);
    st::LlamaModel<double>& model = one.model;
    st::UnitPipeline<double>& units = one.units;
    const st::PackedBatches& pb = one.pb;
    std::vector<int32_t> tok(kT), tgt(kT), doc(kT), pos(kT), real(kT);
    double aux = 0, z = 0;
    int padded = 0;
    int64_t real_tokens = 0;
    for (int i = 0; i < kG; ++i) {
      pb.fill(st::Split::Train, 1, i, 1, tok.data(), tgt.data(), doc.data(), pos.data(), real.data());
      int n = 0;
      while (n < kT && real[static_cast<size_t>(n)] != 0) ++n;
      for (int t = n; t < kT; ++t) ASSERT_EQ(real[static_cast<size_t>(t)], 0) << "row " << i << ": padding at the end";
      padded += n < kT;
      real_tokens += n;
      model.forward(units, tok.data(), 1, n, st::TokenLayout{pos.data(), doc.data()});
      aux += model.moe_aux_loss();
      z += model.moe_z_loss();
    }
    ASSERT_GE(padded, 2) << "rows with padding: the test needs some";
    EXPECT_NEAR(ref.aux, aux / kG, 1e-12 * ref.aux) << "the runner's aux against each row's real tokens alone";
    EXPECT_NEAR(ref.z, z / kG, 1e-12 * ref.z) << "the runner's z-loss against each row's real tokens alone";
    // Tokens per expert: every MoE block's sum is k x the real tokens (padding left out).
    const size_t E = static_cast<size_t>(mc.num_experts);
    ASSERT_EQ(ref.counts.size(), static_cast<size_t>(mc.num_moe_layers()) * E);
    for (size_t b = 0; b < ref.counts.size(); b += E) {
      double sum = 0;
      for (size_t e = 0; e < E; ++e) sum += ref.counts[b + e];
      EXPECT_EQ(sum, static_cast<double>(mc.num_experts_per_tok * real_tokens)) << "MoE block " << b / E;
    }
    if (c.rank() == 0)
      std::printf("[ SFT MoE ] W 1 aux %.15g, z %.15g; rows' real tokens alone %.15g, %.15g (%d of %d rows padded)\n",
                  ref.aux, ref.z, aux / kG, z / kG, padded, kG);
  }
  struct Case {
    const char* what;
    st::MeshDims d;
    st::PipelineKind k = st::PipelineKind::OneFOneB;
  };
  std::vector<Case> cases = {{"dp W", st::MeshDims{1, W, 1, 1, 1}}};
  if (W % 2 == 0) {
    cases.push_back({"cp 2 x dp W/2", st::MeshDims{1, W / 2, 2, 1, 1}});
    cases.push_back({"pp 2 x dp W/2", st::MeshDims{1, W / 2, 1, 1, 2}});
    cases.push_back({"pp 2 x dp W/2 interleaved (2 chunks per rank)", st::MeshDims{1, W / 2, 1, 1, 2},
                     st::PipelineKind::Interleaved});
  }
  if (W == 4) {
    cases.push_back({"pp 2 x cp 2 gpipe", st::MeshDims{1, 1, 2, 1, 2}, st::PipelineKind::GPipe});
    st::MeshDims e{1, 2, 1, 1, 2};
    e.ep = 2;
    cases.push_back({"pp 2 x dp 2, ep 2", e});
  }
  int64_t checked = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    const Step s = run_step(c, k.d, k.k, mc, data);
    EXPECT_NEAR(s.loss, ref.loss, 1e-12 * ref.loss);
    EXPECT_NEAR(s.aux, ref.aux, 1e-12 * ref.aux);
    EXPECT_NEAR(s.z, ref.z, 1e-12 * ref.z);
    EXPECT_EQ(s.counts, ref.counts) << "tokens per expert";
    checked += st::testing::expect_same_grads(s.grads, ref.grads);
    if (c.rank() == 0)
      std::printf("[ SFT MoE ] %s: loss %.15g vs %.15g, aux %.15g vs %.15g, z %.15g vs %.15g\n", k.what, s.loss, ref.loss,
                  s.aux, ref.aux, s.z, ref.z);
  }
  c.all_reduce(&checked, 1, st::ReduceOp::Sum);
  EXPECT_GT(checked, 0);
}

// Run by tests/e2e/test_sft.sh only (part 1, at 2 ranks): shardtrain's float64 step on every
// training conversation of a chat file, packed into rows of 1024 under the document mask, against
// transformers' LlamaForCausalLM in float64 on each conversation unpadded (sft_check.py, which
// writes SHARDTRAIN_TEST_SFT_TORCH=DIR: config.json, tokens.tok, params/<name>.f64 (the weights),
// grads/<name>.f64 (autograd's gradient of the loss), loss.txt (the loss, the target count)).
// At W = 1 and at dp W, cp 2 x dp W/2, pp 2 x dp W/2 (where the rows divide): the loss within
// 1e-12 relative, the target count equal, every parameter's gradient within 1e-13 of its largest
// reference element (two float64 computations summing in different orders), every parameter of
// transformers' model compared.
TEST(Sft, DISABLED_Float64StepEqualsTransformers) {
  const char* env = std::getenv("SHARDTRAIN_TEST_SFT_TORCH");
  ASSERT_NE(env, nullptr) << "run by tests/e2e/test_sft.sh, which sets SHARDTRAIN_TEST_SFT_TORCH";
  const std::string dir = env;
  st::Comm& c = st::testing::comm();
  const int W = c.world_size();
  std::ifstream cf(dir + "/config.json");
  const std::string cfg((std::istreambuf_iterator<char>(cf)), std::istreambuf_iterator<char>());
  const st::ModelConfig mc = st::parse_hf_config(cfg, dir + "/config.json");
  const st::TokenDataset data(dir + "/tokens.tok");
  constexpr int T = 1024;
  const st::PackOptions po{T, st::PackMode::BestFit, st::MaxLengthPolicy::Truncate, st::TrainOn::Assistant};
  const int G = static_cast<int>(st::PackedExamples(data, st::Split::Train, po).rows());
  double want_loss = 0;
  int64_t want_targets = 0;
  std::ifstream(dir + "/loss.txt") >> want_loss >> want_targets;
  ASSERT_GT(want_targets, 0) << dir << "/loss.txt";
  const ParamLoader load = [&](const std::string& name) { return read_f64(dir + "/params/" + name + ".f64"); };
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/grads")) files += e.path().extension() == ".f64";

  struct Case {
    std::string what;
    st::MeshDims d;
  };
  std::vector<Case> cases = {{"W = 1", st::MeshDims{1, 1, 1, 1, 1}}};
  if (G % W == 0) cases.push_back({"dp " + std::to_string(W), st::MeshDims{1, W, 1, 1, 1}});
  if (W % 2 == 0 && G % (W / 2) == 0) {
    cases.push_back({"cp 2 x dp " + std::to_string(W / 2), st::MeshDims{1, W / 2, 2, 1, 1}});
    cases.push_back({"pp 2 x dp " + std::to_string(W / 2), st::MeshDims{1, W / 2, 1, 1, 2}});
  }
  st::MpiComm self = st::MpiComm::split(c, c.rank(), 0);
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    const bool alone = k.d.pp * k.d.dp_shard * k.d.cp == 1;
    const Step s = run_step(alone ? self : c, k.d, st::PipelineKind::OneFOneB, mc, data, T, G, 0, load);
    EXPECT_EQ(s.targets, want_targets);
    EXPECT_NEAR(s.loss, want_loss, 1e-12 * want_loss) << "shardtrain " << s.loss << ", transformers " << want_loss;
    double worst = 0;
    std::string worst_name;
    int n = 0;
    for (const auto& [name, g] : s.grads) {
      const std::vector<double> ref = read_f64(dir + "/grads/" + name + ".f64");
      ASSERT_EQ(g.size(), ref.size()) << name;
      double diff = 0, scale = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        diff = std::max(diff, std::abs(g[i] - ref[i]));
        scale = std::max(scale, std::abs(ref[i]));
      }
      ASSERT_GT(scale, 0.0) << name;
      EXPECT_LE(diff, 1e-13 * scale) << name << ": worst difference " << diff << " of " << scale;
      if (diff / scale > worst) worst = diff / scale, worst_name = name;
      ++n;
    }
    if (k.d.pp == 1) {
      EXPECT_EQ(n, files) << "parameters compared, of transformers' " << files;
    }
    if (c.rank() == 0)
      std::printf("[ info ] float64 vs transformers, %s: %d packed rows of %d, %lld targets, loss %.12f (rel diff %.1e), "
                  "gradients of %d parameters within %.1e of each one's largest element (worst %s)\n",
                  k.what.c_str(), G, T, static_cast<long long>(s.targets), s.loss,
                  std::abs(s.loss - want_loss) / want_loss, n, worst, worst_name.c_str());
  }
}
