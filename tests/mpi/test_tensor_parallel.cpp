// Tensor parallelism (model.h, --tp) in float64 under mpirun: at TP N = the world size (2 or 4),
// each rank's gradients of its TP slices (column-parallel q/k/v/gate/up, row-parallel o/down, the
// vocabulary-parallel embedding and LM head, tied and untied, the vocabulary padded) against
// central finite differences of the loss, which every rank of the group computes in full; the
// replicated RMSNorm weights (perturbed on every rank at once) against their gradient summed over
// the group (ShardedState::sum_replicated_grads). And the loss and every gradient element against
// the same model without TP, computed on each rank alone from the canonical tensors.
//
// Every rank makes the same collective calls in the same order; checks are EXPECT_* only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "rank_test.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/parallel/tensor_parallel.h"
#include "shardtrain/model/model.h"
#include "shardtrain/runtime/runtime.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class TensorParallel : public st::testing::RankTest {};

// V = 37 is not a multiple of 2 or 4 (padding rows on the last TP rank); 4 heads, 2 KV heads (GQA),
// I = 24: every degree up to 2 divides them, and 4 divides all but the KV heads (so N = 4 uses
// 4 KV heads).
// qk_norm: Qwen3's per-head q/k norm (replicated weights [HD] over each rank's heads).
st::ModelConfig config(bool tied, int N, bool qk_norm = false) {
  st::ModelConfig c;
  c.name = "tp-gradcheck";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = N > 2 ? 4 : 2;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = tied;
  c.rope_theta = 10000.0;
  if (qk_norm) {
    c.architecture = "Qwen3ForCausalLM";
    c.qk_norm = true;
  }
  return c;
}

constexpr double kH = 1e-5;       // finite-difference step
constexpr double kRelTol = 1e-6;  // relative bound ...
constexpr double kAbsTol = 1e-9;  // ... or absolute bound

// Spreads the parameters (as test_gradcheck's spread_params): Normal init at 0.02 gives tiny,
// near-linear gradients; larger values exercise the nonlinearities. Canonical-index based, so every
// TP rank's slice gets the values the same element has without TP.
void spread(st::ShardedState<double>& f, uint64_t seed) {
  for (int u = 0; u < f.num_units(); ++u)
    for (const auto& slot : f.plan().units[static_cast<size_t>(u)].params)
      for (int64_t e = 0; e < slot.numel; ++e) {
        const int64_t ci = slot.spec.canonical_index(e);
        double& p = f.param_shard(u)[slot.offset + e];
        if (ci < 0) { p = 0; continue; }
        const uint64_t h = (seed * 0x9E3779B97F4A7C15ull) ^ (std::hash<std::string>{}(slot.spec.name) + static_cast<uint64_t>(ci) * 0xBF58476D1CE4E5B9ull);
        const double r = static_cast<double>(h % 100003) / 100003.0 - 0.5;  // [-0.5, 0.5)
        p = slot.spec.init == st::Init::Ones ? 1.0 + 0.4 * r : 0.6 * r;
      }
}

struct Run {
  double loss = 0;
  std::vector<std::vector<double>> grads;  // per unit, the shard (= the TP-local unit; one shard rank)
};

void run_tp_gradcheck(bool tied, int loss_chunk, bool qk_norm = false) {
  st::Comm& c = world();
  const int N = c.world_size();
  const st::ModelConfig cfg = config(tied, N, qk_norm);
  const st::Mesh mesh(c, st::testing::g_runtime->topo(), st::MeshDims{1, 1, 1, N}, 0);
  const int t = mesh.coord().tp;
  auto be = st::make_cpu_backend<double>();
  st::Fsdp<double> f(*be, c, st::ShardPlan::build(st::llama_units(cfg, N, t), 1), &mesh.shard_data(), nullptr);
  st::TpGroup<double> tp(*mesh.tp_data());
  spread(f, 11);
  st::ModelOptions o;
  o.loss_chunk = loss_chunk;
  st::LlamaModel<double> m(cfg, *be, o, &tp);
  const int B = 2, T = 6;  // 12 tokens: 12 / N rows per rank
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int i = 0; i < B * T; ++i) {
    tok[static_cast<size_t>(i)] = (7 * i + 3) % cfg.vocab_size;
    tgt[static_cast<size_t>(i)] = (5 * i + 36) % cfg.vocab_size;  // includes id 36, the last row
  }
  auto eval = [&] {
    m.forward(f, tok.data(), B, T);
    return m.loss(f, tgt.data());
  };
  Run r;
  f.zero_grads();
  m.forward(f, tok.data(), B, T);
  r.loss = m.head_backward(f, tgt.data(), 1.0);
  m.backward(f);
  f.end_pass();
  f.sum_replicated_grads([&](double* g, size_t n) { tp.all_reduce_sum_acc(g, n); });
  for (int u = 0; u < f.num_units(); ++u)
    r.grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + f.plan().units[static_cast<size_t>(u)].shard_size);

  // 1. Against the model without TP on this rank alone (canonical tensors, the same values).
  st::ShardPlan full_plan = st::ShardPlan::build(st::llama_units(cfg), 1);
  // A one-rank communicator of this rank (the self group): the whole model, no collectives with others.
  st::MpiComm self = st::MpiComm::split(c, c.rank(), 0);
  st::Fsdp<double> g(*be, self, full_plan, &self, nullptr);
  spread(g, 11);
  st::LlamaModel<double> m1(cfg, *be, o);
  g.zero_grads();
  m1.forward(g, tok.data(), B, T);
  const double loss1 = m1.head_backward(g, tgt.data(), 1.0);
  m1.backward(g);
  g.end_pass();
  EXPECT_NEAR(r.loss, loss1, 1e-12 * loss1) << "TP " << N << " loss vs no TP";
  double worst = 0;
  for (int u = 0; u < f.num_units(); ++u) {
    const st::UnitPlan& up = f.plan().units[static_cast<size_t>(u)];
    const st::UnitPlan& fu = full_plan.units[static_cast<size_t>(u)];
    for (const auto& slot : up.params) {
      const st::ParamSlot& whole = fu.param(slot.spec.name);
      for (int64_t e = 0; e < slot.numel; ++e) {
        const int64_t ci = slot.spec.canonical_index(e);
        const double a = r.grads[static_cast<size_t>(u)][static_cast<size_t>(slot.offset + e)];
        if (ci < 0) {  // vocabulary padding: never trained
          EXPECT_EQ(a, 0.0) << slot.spec.name << " padding row element " << e;
          continue;
        }
        const double b = g.grad_shard(u)[whole.offset + ci];
        worst = std::max(worst, std::fabs(a - b));
        EXPECT_NEAR(a, b, 1e-12 + 1e-10 * std::fabs(b)) << slot.spec.name << "[" << ci << "]";
      }
    }
  }

  // 2. Central finite differences. Rank q perturbs its own slice's elements while the others keep
  // theirs (a replicated norm weight: every rank perturbs it); all ranks evaluate the loss.
  int checked = 0, fails = 0;
  double max_rel = 0;
  for (int owner = 0; owner < N; ++owner)
    for (int u = 0; u < f.num_units(); ++u)
      for (const auto& slot : f.plan().units[static_cast<size_t>(u)].params) {
        const bool repl = slot.spec.tp_replicated();
        if (repl && owner > 0) continue;  // checked once, on all ranks together
        // Three elements of the slice: first, middle, last (the same indices on every rank).
        for (int64_t e : {int64_t{0}, slot.numel / 2, slot.numel - 1}) {
          double* p = f.param_shard(u) + slot.offset + e;
          const bool mine = repl || owner == t;
          const double old = *p;
          if (mine) *p = old + kH;
          const double lp = eval();
          if (mine) *p = old - kH;
          const double lm = eval();
          if (mine) *p = old;
          if (!(owner == t)) continue;  // the owner (rank 0 for replicated) compares
          const double fd = (lp - lm) / (2 * kH);
          const double a = r.grads[static_cast<size_t>(u)][static_cast<size_t>(slot.offset + e)];
          const double abs_err = std::fabs(a - fd), rel = abs_err / std::max(1e-8, std::fabs(a) + std::fabs(fd));
          if (std::fabs(a) + std::fabs(fd) > 1e-6) max_rel = std::max(max_rel, rel);
          ++checked;
          if (!(rel < kRelTol || abs_err < kAbsTol)) {
            ++fails;
            ADD_FAILURE() << slot.spec.name << " (TP rank " << t << ")[" << e << "] analytic " << a << " numeric " << fd;
          }
        }
      }
  std::printf("[ TP GradCheck ] N = %d, %s head%s, rank %d: %d elements vs finite differences (max rel err %.2e), "
              "every gradient element vs no TP (max abs diff %.2e)\n",
              N, tied ? "tied" : "untied", qk_norm ? ", q/k norm" : "", t, checked, max_rel, worst);
  EXPECT_GT(checked, 0);
  EXPECT_EQ(fails, 0);
}

TEST_F(TensorParallel, GradientsMatchFiniteDifferencesAndNoTpTied) {
  const int W = world().world_size();
  if (W != 2 && W != 4) GTEST_SKIP() << "TP N = the world size, N = 2 or 4";
  run_tp_gradcheck(true, 5);  // loss chunks of 5 of the 12 tokens: 5, 5, 2
}

TEST_F(TensorParallel, GradientsMatchFiniteDifferencesAndNoTpUntied) {
  const int W = world().world_size();
  if (W != 2 && W != 4) GTEST_SKIP() << "TP N = the world size, N = 2 or 4";
  run_tp_gradcheck(false, 0);
}

TEST_F(TensorParallel, GradientsMatchFiniteDifferencesAndNoTpQkNorm) {
  const int W = world().world_size();
  if (W != 2 && W != 4) GTEST_SKIP() << "TP N = the world size, N = 2 or 4";
  run_tp_gradcheck(false, 0, true);
}

// ---- Checkpoints: the canonical layout (checkpoint.h TpCheckpointLayout) -----------------------

namespace st_ckpt {

class TpCheckpoint : public st::testing::TempDirTest {};

// The value tensor k holds at canonical element i of unit u (exactly representable).
float value(size_t k, size_t u, int64_t i) { return static_cast<float>(1000000 * k + 10000 * u + i % 9973) + 0.25f; }

// A rank's shards of every tensor for mesh `dims` (host memory; the CPU backend is host memory).
struct State {
  std::vector<st::ShardPlan> plans;  // per TP rank
  std::vector<std::vector<std::vector<float>>> rows;  // [tensor][unit] shard
  int t = 0;
  State(const st::ModelConfig& cfg, const st::MeshLayout& L, int rank) {
    const st::MeshDims d = L.dims();
    for (int q = 0; q < d.tp; ++q) plans.push_back(st::ShardPlan::build(st::llama_units(cfg, d.tp, q), d.dp_shard));
    t = L.coord(rank).tp;
    rows.assign(3, {});
    for (auto& r : rows)
      for (const auto& up : plans[static_cast<size_t>(t)].units) r.emplace_back(static_cast<size_t>(up.shard_size), -1.0f);
  }
  st::ShardedTensors view(st::Backend<float>& be, int shard_rank) {
    st::ShardedTensors v;
    v.plan = &plans[static_cast<size_t>(t)];
    v.plan_rank = shard_rank;
    v.backend = &be;
    for (size_t k = 0; k < 3; ++k) {
      st::ShardedTensor s{st::checkpoint_tensor_names()[k], {}};
      for (auto& r : rows[k]) s.shards.push_back(r.data());
      v.tensors.push_back(std::move(s));
    }
    return v;
  }
  // Sets (fill) or counts the elements that differ from (check) value() at their canonical index;
  // padding (vocabulary rows, a shard's tail) must be 0.
  int64_t visit(const st::ShardPlan& canon, int shard_rank, bool fill) {
    int64_t bad = 0;
    const st::ShardPlan& p = plans[static_cast<size_t>(t)];
    for (size_t u = 0; u < p.units.size(); ++u) {
      const st::UnitPlan& up = p.units[u];
      const st::RankShard& rs = up.ranks[static_cast<size_t>(shard_rank)];
      for (size_t k = 0; k < 3; ++k) {
        std::vector<float>& r = rows[k][u];
        for (int64_t e = 0; e < up.shard_size; ++e) {
          float want = 0.0f;
          const int64_t flat = rs.start + e;
          if (e < rs.valid)
            for (const auto& slot : up.params)
              if (flat >= slot.offset && flat < slot.offset + slot.numel) {
                const int64_t ci = slot.spec.canonical_index(flat - slot.offset);
                if (ci >= 0) want = value(k, u, canon.units[u].param(slot.spec.name).offset + ci);
              }
          if (fill) r[static_cast<size_t>(e)] = want;
          else if (r[static_cast<size_t>(e)] != want) ++bad;
        }
      }
    }
    return bad;
  }
};

// Saved at (tp 2, dp_shard W/2) through a real file; loaded at every other layout of the same
// world (tp 1, tp 4, hybrid with TP) and at W - 1 and 1 ranks. Every element of the parameters
// and both AdamW moments equal.
TEST_F(TpCheckpoint, ReshardsParametersAndMomentsElementForElement) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  if (W != 2 && W != 4) GTEST_SKIP() << "W = 2 or 4";
  const st::ModelConfig cfg = config(false, 4);  // untied, 4 heads, 4 KV heads, V 37 (padding at tp 2, 4)
  const st::ShardPlan canon = st::ShardPlan::build(st::llama_units(cfg), W);
  auto be = st::make_cpu_backend<float>();
  const st::MeshLayout saved_at(st::MeshDims{1, W / 2, 1, 2});
  State s(cfg, saved_at, r);
  s.visit(canon, saved_at.coord(r).dp_shard, true);
  st::TpCheckpointLayout out(saved_at, r, s.plans, canon, st::checkpoint_tensor_names());
  out.to_canonical(c, s.view(*be, saved_at.coord(r).dp_shard));
  // The canonical rows: row r of every unit, value() at every valid element.
  int64_t bad = 0;
  st::ShardedTensors cv = out.canonical();
  for (size_t u = 0; u < canon.units.size(); ++u)
    for (size_t k = 0; k < 3; ++k) {
      const st::RankShard& rs = canon.units[u].ranks[static_cast<size_t>(r)];
      for (int64_t e = 0; e < canon.units[u].shard_size; ++e)
        if (cv.tensors[k].shards[u][e] != (e < rs.valid ? value(k, u, rs.start + e) : 0.0f)) ++bad;
    }
  EXPECT_EQ(bad, 0) << "canonical rows after to_canonical";
  st::TrainState state;
  state.step = 0;
  state.seed = 7;
  const std::string file = path("tp.h5");
  st::write_checkpoint_file(c, file, st::take_checkpoint_snapshot(cv, cfg, "{\"seq_len\":6,\"global_batch\":2,\"micro_batch\":2,\"steps\":1,\"warmup\":0,\"seed\":7,\"lr\":1,\"min_lr\":1,\"beta1\":0.9,\"beta2\":0.99,\"eps\":1e-8,\"weight_decay\":0,\"clip\":0,\"precision\":\"fp32\"}", state));
  std::vector<st::MeshDims> layouts = {{1, W, 1, 1}, {1, W / 2, 1, 2}};
  if (W == 4) layouts.push_back({1, 1, 1, 4}), layouts.push_back({2, 1, 1, 2});
  for (const st::MeshDims& d : layouts) {
    SCOPED_TRACE("load at dp_replicate " + std::to_string(d.dp_replicate) + ", dp_shard " + std::to_string(d.dp_shard) +
                 ", tp " + std::to_string(d.tp));
    const st::MeshLayout L(d);
    State got(cfg, L, r);
    st::TpCheckpointLayout in(L, r, got.plans, canon, st::checkpoint_tensor_names());
    st::load_checkpoint(c, file, in.canonical(), cfg);
    in.from_canonical(c, got.view(*be, L.coord(r).dp_shard));
    EXPECT_EQ(got.visit(canon, L.coord(r).dp_shard, false), 0);
  }
  // Other world sizes: W - 1 ranks (at W = 4: TP 1 x FSDP 3, the resume) and 1 rank
  // (each rank alone), on sub-communicators; the ranks left out wait.
  for (int n : {W - 1, 1}) {
    SCOPED_TRACE("load at world size " + std::to_string(n) + ", tp 1");
    st::MpiComm sub = st::MpiComm::split(c, n == 1 ? r : (r < n ? 0 : 1), r);
    if (n == 1 || r < n) {
      const st::MeshLayout L(st::MeshDims{1, n, 1, 1});
      const int sr = sub.rank();
      State got(cfg, L, sr);
      st::TpCheckpointLayout in(L, sr, got.plans, st::ShardPlan::build(st::llama_units(cfg), n),
                                st::checkpoint_tensor_names());
      st::load_checkpoint(sub, file, in.canonical(), cfg);
      in.from_canonical(sub, got.view(*be, sr));
      EXPECT_EQ(got.visit(st::ShardPlan::build(st::llama_units(cfg), n), sr, false), 0);
    }
    c.barrier();
  }
}

}  // namespace st_ckpt

}  // namespace
