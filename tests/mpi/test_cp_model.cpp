// The Llama model under context parallelism (model.h, LlamaModel given ContextParallelOps; issue
// 41): CP groups of g consecutive ranks (g = 2 and 4 where they divide the world) run CpAttention
// (Ring and AllGather) and each rank gives the model its head-tail rows of B sequences (cp_rows:
// tokens, targets, the rows' global positions and, with the document mask, their document ids).
// The reference is the same model without CP on each rank alone, on the whole sequences, with the
// same weights. Asserted:
//   - the group's summed loss equals the whole-sequence loss, and the group's summed parameter
//     gradients (the CP ranks hold the same parameters and see different tokens: the FSDP
//     reduce-scatter over dp_shard x cp sums them) equal the whole-sequence gradients, element by
//     element: float64 within 1e-12 relative (of max |g| over the unit), fp32 within 1e-5;
//   - the summed gradient against central finite differences of the group's summed loss (float64,
//     CP 2 and 4, ring causal and allgather document; first, middle and last element of every
//     parameter, perturbed on every rank of the group at once);
//   - causal, and the document mask (positions restarting per document, from document_layout);
//     recompute None and Full (Full reruns the CP attention forward in backward);
//   - the refusals: no positions under CP, cp x Tl past max_position_embeddings, exact attention;
//   - the model allocates what activation_bytes(..., cp) counts (the memory plan's activations):
//     beside the same rows without CP, the RoPE tables of cp x Tl positions and, causal, the
//     layout's ids (positions are required under CP).
// Each rank compares its own sums; checks are EXPECT_* only (every rank makes every collective).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "counting_backend.h"
#include "rank_test.h"
#include "shardtrain/parallel/context_parallel.h"
#include "shardtrain/data/data.h"
#include "shardtrain/model/model.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard.h"
#include "shardtrain/shard/unit_pipeline.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class CpModel : public st::testing::RankTest {};

// 4 heads over 2 KV heads (GQA), two blocks, V = 37; T = 16 splits into 2 x 4 chunks of 2.
// qk_norm: Qwen3's per-head q/k norm (before RoPE at the global positions). moe: Qwen3-MoE (with
// q/k norm): block 0 a mixture of 8 experts (top 2), block 1 dense.
st::ModelConfig config(bool qk_norm = false, bool moe = false) {
  st::ModelConfig c;
  c.name = "cp-model";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  c.tie_word_embeddings = false;
  c.rope_theta = 10000.0;
  if (qk_norm) {
    c.architecture = "Qwen3ForCausalLM";
    c.qk_norm = true;
  }
  if (moe) {
    c.architecture = "Qwen3MoeForCausalLM";
    c.qk_norm = true;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 12;
    c.router_aux_loss_coef = 0.05;
    c.mlp_only_layers = {1};
  }
  return c;
}
constexpr int kB = 2, kT = 16;
constexpr int32_t kEos = 5;

// Spread parameters (as test_tensor_parallel's): values large enough to exercise the nonlinearities.
template <typename T> void spread(st::ShardedState<T>& f, uint64_t seed) {
  for (int u = 0; u < f.num_units(); ++u)
    for (const auto& slot : f.plan().units[static_cast<size_t>(u)].params)
      for (int64_t e = 0; e < slot.numel; ++e) {
        const uint64_t h = (seed * 0x9E3779B97F4A7C15ull) ^
                           (std::hash<std::string>{}(slot.spec.name) + static_cast<uint64_t>(e) * 0xBF58476D1CE4E5B9ull);
        const double r = static_cast<double>(h % 100003) / 100003.0 - 0.5;
        f.param_shard(u)[slot.offset + e] = static_cast<T>(slot.spec.init == st::Init::Ones ? 1.0 + 0.4 * r : 0.6 * r);
      }
}

struct Result {
  double loss = 0;
  double aux = 0;  // MoE: the load-balancing loss (per sequence, pooled over the CP group)
  std::vector<std::vector<double>> grads;  // per unit, the whole unit (one shard rank)
};

// One micro-batch forward + head_backward (scale 1: gradients of the loss SUM) + backward; an MoE
// model's load-balancing loss with weight coef in the gradient (each CP rank's part of it: the group
// sums them).
template <typename T>
Result run(st::LlamaModel<T>& m, st::Fsdp<T>& f, const std::vector<int32_t>& tok, const std::vector<int32_t>& tgt,
           int B, int T_, const st::TokenLayout& lay) {
  Result r;
  f.zero_grads();
  m.forward(f, tok.data(), B, T_, lay);
  r.loss = m.head_backward(f, tgt.data(), 1);
  if (m.config().is_moe()) {
    r.aux = m.moe_aux_loss();
    m.set_aux_grad_scale(static_cast<typename st::LlamaModel<T>::S>(m.config().router_aux_loss_coef));
  }
  m.backward(f);
  f.end_pass();
  for (int u = 0; u < f.num_units(); ++u) {
    const T* g = f.grad_shard(u);
    r.grads.emplace_back(g, g + f.plan().units[static_cast<size_t>(u)].shard_size);
  }
  return r;
}

template <typename T>
void check(st::CpComm method, bool document, st::Recompute rc, double tol, bool fd = false, bool qk_norm = false,
           bool moe = false) {
  const int W = world().world_size();
  const st::ModelConfig cfg = config(qk_norm, moe);
  auto be = st::make_cpu_backend<T>();
  st::MpiComm self = st::MpiComm::split(world(), world().rank(), 0);
  // The batch, the same on every rank: random tokens with EOS (document ends) at random places.
  std::mt19937 gen(41);
  std::vector<int32_t> tok(kB * kT), tgt(kB * kT), doc(kB * kT), pos(kB * kT);
  for (auto& t : tok) t = static_cast<int32_t>(gen() % 37);
  for (auto& t : tgt) t = static_cast<int32_t>(gen() % 37);
  tok[3] = tok[9] = tok[10] = tok[kT + 6] = kEos;  // documents of 4, 6, 1, 5 | 7, 9 tokens
  st::document_layout(tok.data(), kB, kT, kT, kEos, doc.data(), pos.data());
  st::ModelOptions o;
  o.recompute = rc;
  o.mask = document ? st::AttentionMask::Document : st::AttentionMask::Causal;
  const st::TokenLayout whole_lay = document ? st::TokenLayout{pos.data(), doc.data()} : st::TokenLayout{};

  st::Fsdp<T> ref_f(*be, self, st::ShardPlan::build(st::llama_units(cfg), 1), &self, nullptr);
  spread(ref_f, 7);
  st::LlamaModel<T> ref_m(cfg, *be, o);
  const Result ref = run(ref_m, ref_f, tok, tgt, kB, kT, whole_lay);

  for (int g : {2, 4}) {
    if (W % g != 0) continue;
    st::MpiComm grp = st::MpiComm::split(world(), world().rank() / g, world().rank());
    const int r = grp.rank(), Tl = kT / g;
    st::CpAttention<T> cp(grp, *be, method);
    st::Fsdp<T> f(*be, self, st::ShardPlan::build(st::llama_units(cfg), 1), &self, nullptr);
    spread(f, 7);
    st::LlamaModel<T> m(cfg, *be, o, nullptr, &cp);
    // This rank's rows of every sequence: tokens, targets, global positions (restarting per
    // document under the document mask) and document ids.
    const std::vector<int32_t> rows = st::cp_rows(kT, g, r);
    std::vector<int32_t> ltok, ltgt, lpos, ldoc;
    for (int b = 0; b < kB; ++b)
      for (int32_t t : rows) {
        const size_t i = static_cast<size_t>(b * kT + t);
        ltok.push_back(tok[i]);
        ltgt.push_back(tgt[i]);
        lpos.push_back(document ? pos[i] : t);
        ldoc.push_back(doc[i]);
      }
    const st::TokenLayout lay{lpos.data(), document ? ldoc.data() : nullptr};
    Result got = run(m, f, ltok, ltgt, kB, Tl, lay);
    grp.all_reduce(&got.loss, 1, st::ReduceOp::Sum);
    for (auto& u : got.grads) grp.all_reduce(u.data(), u.size(), st::ReduceOp::Sum);
    const std::string what = std::string(st::cp_comm_name(method)) + (document ? " document" : " causal") +
                             " recompute " + st::recompute_name(rc) + " cp " + std::to_string(g) +
                             (qk_norm ? " q/k norm" : "") + (moe ? " MoE" : "");
    EXPECT_NEAR(got.loss, ref.loss, tol * std::fabs(ref.loss)) << what;
    if (moe) {  // every CP rank holds the sequences' load-balancing loss, from the group's summed counts
      EXPECT_GT(ref.aux, 0.0);
      EXPECT_NEAR(got.aux, ref.aux, tol * ref.aux) << what << ": the load-balancing loss";
    }
    double worst = 0;
    for (size_t u = 0; u < ref.grads.size(); ++u) {
      double mx = 0, d = 0;
      for (size_t e = 0; e < ref.grads[u].size(); ++e) {
        mx = std::max(mx, std::fabs(ref.grads[u][e]));
        d = std::max(d, std::fabs(got.grads[u][e] - ref.grads[u][e]));
      }
      ASSERT_GT(mx, 0.0) << what << " unit " << u << ": a gradient that is all zero checks nothing";
      worst = std::max(worst, d / mx);
      EXPECT_LE(d / mx, tol) << what << " unit " << u;
    }
    if (world().rank() == 0)
      std::printf("[ CP model ] %s: loss %.15g vs %.15g (rel %.1e), worst unit gradient rel diff %.1e\n", what.c_str(),
                  got.loss, ref.loss, std::fabs(got.loss - ref.loss) / std::fabs(ref.loss), worst);
    if (!fd) continue;
    // Central differences of the group's loss sum (every rank perturbs the same element of its
    // whole copy, then the group sums its ranks' losses).
    const double h = 1e-5;
    auto group_loss = [&] {
      m.forward(f, ltok.data(), kB, Tl, lay);
      double l = m.loss(f, ltgt.data());
      grp.all_reduce(&l, 1, st::ReduceOp::Sum);
      return l;
    };
    int checked = 0;
    double max_rel = 0;
    // Three elements of every parameter at 2 ranks; at 4 (oversubscribed on make test's cores, each
    // forward a chain of ring steps) the middle one, to keep make test's time.
    const bool few = world().world_size() > 2;
    for (int u = 0; u < f.num_units(); ++u)
      for (const auto& slot : f.plan().units[static_cast<size_t>(u)].params)
        for (int64_t e : few ? std::vector<int64_t>{slot.numel / 2}
                             : std::vector<int64_t>{0, slot.numel / 2, slot.numel - 1}) {
          T* p = f.param_shard(u) + slot.offset + e;
          const T old = *p;
          *p = old + h;
          const double lp = group_loss();
          *p = old - h;
          const double lm = group_loss();
          *p = old;
          const double num = (lp - lm) / (2 * h), a = got.grads[static_cast<size_t>(u)][static_cast<size_t>(slot.offset + e)];
          const double err = std::fabs(a - num), rel = err / std::max(1e-8, std::fabs(a) + std::fabs(num));
          if (std::fabs(a) + std::fabs(num) > 1e-6) max_rel = std::max(max_rel, rel);
          ++checked;
          EXPECT_TRUE(rel < 1e-6 || err < 1e-9) << what << " " << slot.spec.name << "[" << e << "] analytic " << a
                                                 << " numeric " << num;
        }
    EXPECT_GT(checked, 0);
    if (world().rank() == 0)
      std::printf("[ CP model ] %s: %d elements vs central differences, max rel err %.1e\n", what.c_str(), checked,
                  max_rel);
  }
}

TEST_F(CpModel, Float64RingAndAllGatherCausalAndDocumentEqualWholeSequence) {
  if (world().world_size() % 2 != 0) GTEST_SKIP() << "CP groups of 2 or 4 ranks";
  for (st::CpComm m : {st::CpComm::Ring, st::CpComm::AllGather})
    for (bool doc : {false, true}) check<double>(m, doc, st::Recompute::None, 1e-12);
  check<double>(st::CpComm::Ring, true, st::Recompute::Full, 1e-12);
  check<double>(st::CpComm::AllGather, false, st::Recompute::Selective, 1e-12);
  check<double>(st::CpComm::Ring, true, st::Recompute::None, 1e-12, false, true);  // Qwen3's q/k norm
  // Qwen3-MoE: the aux loss's counts and probability sums pooled over the CP group
  check<double>(st::CpComm::Ring, false, st::Recompute::None, 1e-12, false, true, true);
  check<double>(st::CpComm::AllGather, true, st::Recompute::Full, 1e-12, false, true, true);
}

TEST_F(CpModel, Float64GradientsMatchCentralDifferences) {
  if (world().world_size() % 2 != 0) GTEST_SKIP() << "CP groups of 2 or 4 ranks";
  check<double>(st::CpComm::Ring, false, st::Recompute::None, 1e-12, true);
  check<double>(st::CpComm::AllGather, true, st::Recompute::None, 1e-12, true);
}

TEST_F(CpModel, Float32RingAndAllGatherCausalAndDocumentEqualWholeSequence) {
  if (world().world_size() % 2 != 0) GTEST_SKIP() << "CP groups of 2 or 4 ranks";
  for (st::CpComm m : {st::CpComm::Ring, st::CpComm::AllGather})
    for (bool doc : {false, true}) check<float>(m, doc, st::Recompute::None, 1e-5);
}

TEST_F(CpModel, RefusesMissingPositionsLongSequencesAndExactAttention) {
  if (world().world_size() % 2 != 0) GTEST_SKIP() << "CP groups of 2 ranks";
  const st::ModelConfig cfg = config();
  auto be = st::make_cpu_backend<double>();
  st::MpiComm self = st::MpiComm::split(world(), world().rank(), 0);
  st::MpiComm grp = st::MpiComm::split(world(), world().rank() / 2, world().rank());
  st::CpAttention<double> cp(grp, *be, st::CpComm::Ring);
  st::Fsdp<double> f(*be, self, st::ShardPlan::build(st::llama_units(cfg), 1), &self, nullptr);
  st::LlamaModel<double> m(cfg, *be, {}, nullptr, &cp);
  std::vector<int32_t> tok(24, 1), pos(24, 0);
  // No positions: refused before any collective, on every rank.
  EXPECT_THROW(m.forward(f, tok.data(), 1, 8, {}), std::invalid_argument);
  // 2 x 24 = 48 > max_position_embeddings 32 (24 rows alone would pass).
  try {
    m.forward(f, tok.data(), 1, 24, {pos.data(), nullptr});
    ADD_FAILURE() << "48 global positions accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("48"), std::string::npos) << e.what();
  }
  // A position past the global length 16 of 2 x 8 rows; 15 is inside.
  pos[0] = 16;
  EXPECT_THROW(m.forward(f, tok.data(), 1, 8, {pos.data(), nullptr}), std::invalid_argument);
  st::ModelOptions ex;
  ex.attention = st::AttentionKind::Exact;
  EXPECT_THROW(st::LlamaModel<double>(cfg, *be, ex, nullptr, &cp), std::invalid_argument);
}

// Only what reserve() reads of the CP group (its size); reserve communicates nothing.
class SizeOnly final : public st::ContextParallelOps<float> {
 public:
  explicit SizeOnly(int n) : n_(n) {}
  int size() const override { return n_; }
  int rank() const override { return 0; }
  void forward(float*, float*, const float*, const float*, const float*, const int32_t*, const int32_t*, int, int, int,
               int, int, float) override {
    throw std::logic_error("not called by reserve()");
  }
  void backward(float*, float*, float*, const float*, const float*, const float*, const float*, const float*,
                const float*, const int32_t*, const int32_t*, int, int, int, int, int, float) override {
    throw std::logic_error("not called by reserve()");
  }
  void sum_host(double*, size_t) override { throw std::logic_error("not called by reserve()"); }

 private:
  int n_;
};

TEST_F(CpModel, AllocatesWhatActivationBytesCounts) {
  const st::ModelConfig cfg = config();
  const int B = 3, Tl = 8, HD = cfg.head_dim();
  for (int n : {2, 4})
    for (st::Recompute rc : {st::Recompute::None, st::Recompute::Full})
      for (st::AttentionMask mask : {st::AttentionMask::Causal, st::AttentionMask::Document}) {
        st::ModelOptions o;
        o.recompute = rc;
        o.mask = mask;
        SizeOnly cp(n);
        st::testing::CountingBackend<float> be;
        {
          st::LlamaModel<float> m(cfg, be, o, nullptr, &cp);
          m.reserve(B, Tl);
          EXPECT_EQ(static_cast<int64_t>(be.live_bytes()), st::activation_bytes(cfg, o, B, Tl, 4, 4, 1, n).total())
              << "cp " << n << " " << st::recompute_name(rc) << " " << st::attention_mask_name(mask);
        }
        // Against the same rows without CP: cos and sin tables of (n - 1) x Tl more positions; with
        // the causal mask, positions, documents and row indices (three int32 per token).
        const int64_t extra = int64_t{2} * 4 * (n - 1) * Tl * (HD / 2) +
                              (mask == st::AttentionMask::Causal ? int64_t{3} * 4 * B * Tl : 0);
        EXPECT_EQ(st::activation_bytes(cfg, o, B, Tl, 4, 4, 1, n).total() - st::activation_bytes(cfg, o, B, Tl, 4, 4).total(),
                  extra);
      }
}

}  // namespace
