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
#include "shardtrain/mesh.h"
#include "shardtrain/model.h"
#include "shardtrain/runtime.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class TensorParallel : public st::testing::RankTest {};

// V = 37 is not a multiple of 2 or 4 (padding rows on the last TP rank); 4 heads, 2 KV heads (GQA),
// I = 24: every degree up to 2 divides them, and 4 divides all but the KV heads (so N = 4 uses
// 4 KV heads).
st::ModelConfig config(bool tied, int N) {
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

void run_tp_gradcheck(bool tied, int loss_chunk) {
  st::Comm& c = world();
  const int N = c.world_size();
  const st::ModelConfig cfg = config(tied, N);
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
  f.sum_replicated_grads(*mesh.tp_data());
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
  std::printf("[ TP GradCheck ] N = %d, %s head, rank %d: %d elements vs finite differences (max rel err %.2e), "
              "every gradient element vs no TP (max abs diff %.2e)\n",
              N, tied ? "tied" : "untied", t, checked, max_rel, worst);
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

}  // namespace
