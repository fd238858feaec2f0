// Activation checkpointing and the chunked LM head / loss, at the world size mpirun gives (1-4):
//  - gradients with --activation-checkpointing selective and full are bitwise identical to none,
//    in fp32 and in bf16 mixed precision, tiled and exact attention, tied and untied heads;
//  - a chunked loss is within 1e-6 of the unchunked one (loss and every gradient element);
//  - the model allocates exactly activation_bytes() (the memory plan's activations).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <stdexcept>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/train/memory_plan.h"
#include "shardtrain/model/model.h"
#include "shardtrain/shard/shard.h"
#include "counting_backend.h"
#include "../test_env.h"

namespace st = shardtrain;
using st::bf16;

namespace {

// qk_norm: Qwen3's per-head q/k norm (its kept q, k and rstd; recomputed under Full). moe: Qwen3-MoE
// blocks (8 experts, top 2) but block 1, which is dense (mlp_only_layers).
st::ModelConfig cfg(bool tied, bool qk_norm = false, bool moe = false) {
  st::ModelConfig c;
  c.name = "recompute-test";
  c.vocab_size = 67;  // not a multiple of anything: uneven shards, odd loss chunks
  c.hidden_size = 48;
  c.intermediate_size = 80;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;  // GQA
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = tied;
  c.bos_token_id = 0;
  c.eos_token_ids = {1};
  if (qk_norm) {
    c.architecture = "Qwen3ForCausalLM";
    c.qk_norm = true;
  }
  if (moe) {
    c.architecture = "Qwen3MoeForCausalLM";
    c.qk_norm = true;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 24;
    c.router_aux_loss_coef = 0.01;
    c.mlp_only_layers = {1};
  }
  return c;
}

constexpr int kB = 2, kT = 37;

void batch(std::vector<int32_t>& tok, std::vector<int32_t>& tgt, int V, int rank) {
  std::mt19937 g(100 + rank);  // each rank its own micro-batch, as in training
  std::uniform_int_distribution<int> d(0, V - 1);
  tok.resize(kB * kT);
  tgt.resize(kB * kT);
  for (auto& t : tok) t = d(g);
  for (auto& t : tgt) t = d(g);
}

// One training forward + backward of micro-batch `rank` from fresh gradients; returns the loss and
// the gradient shards (fp32).
struct Result {
  double loss = 0;
  std::vector<std::vector<float>> grads;
};

template <typename C>
Result run(const st::ModelConfig& mc, const st::ModelOptions& mo, bool bf16_reduce = false) {
  st::Comm& comm = st::testing::comm();
  auto be = st::make_cpu_backend<float>();
  st::ShardedState<float> f(*be, comm, st::ShardPlan::build(st::llama_units(mc), comm.world_size()));
  f.init_params(77);
  f.zero_grads();
  std::vector<int32_t> tok, tgt;
  batch(tok, tgt, mc.vocab_size, comm.rank());
  Result r;
  if constexpr (std::is_same_v<C, bf16>) {
    auto b16 = st::make_cpu_backend<bf16>();
    st::MixedPrecisionUnits mp(f, *b16, bf16_reduce);
    st::LlamaModel<bf16> m(mc, *b16, mo);
    m.forward(mp, tok.data(), kB, kT);
    r.loss = m.head_backward(mp, tgt.data(), 1.0f / (kB * kT));
    m.set_aux_grad_scale(static_cast<float>(mc.router_aux_loss_coef));  // MoE: the load-balancing loss's gradient too
    m.backward(mp);
  } else {
    st::UnitPipeline<float> units(*be, std::make_unique<st::IdentityCodec<float>>(f));
    st::LlamaModel<float> m(mc, *be, mo);
    m.forward(units, tok.data(), kB, kT);
    r.loss = m.head_backward(units, tgt.data(), 1.0f / (kB * kT));
    m.set_aux_grad_scale(static_cast<float>(mc.router_aux_loss_coef));
    m.backward(units);
  }
  for (int u = 0; u < f.num_units(); ++u) {
    const auto S = static_cast<size_t>(f.plan().units[u].shard_size);
    r.grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + S);
  }
  return r;
}

// Bitwise: compares the bytes, so -0.0 vs 0.0 or two NaNs with other payloads would count.
void expect_bitwise(const Result& a, const Result& b, const std::string& what) {
  EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof(double)), 0) << what << ": loss " << a.loss << " vs " << b.loss;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  size_t differ = 0, n = 0;
  for (size_t u = 0; u < a.grads.size(); ++u) {
    n += a.grads[u].size();
    for (size_t i = 0; i < a.grads[u].size(); ++i)
      differ += std::memcmp(&a.grads[u][i], &b.grads[u][i], sizeof(float)) != 0;
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << n << " gradient elements differ";
}

template <typename C> void recompute_is_bitwise(bool tied, st::AttentionKind att, bool qk_norm = false, bool moe = false) {
  const st::ModelConfig mc = cfg(tied, qk_norm, moe);
  const Result none = run<C>(mc, {st::Recompute::None, att, 0});
  double norm = 0;
  for (auto& g : none.grads)
    for (float x : g) norm += double(x) * x;
  EXPECT_GT(norm, 0.0) << "the gradient must not be zero (else the comparison proves nothing)";
  for (st::Recompute r : {st::Recompute::Selective, st::Recompute::Full})
    expect_bitwise(none, run<C>(mc, {r, att, 0}),
                   std::string(st::recompute_name(r)) + " vs none, " + st::attention_name(att) +
                       (tied ? ", tied" : ", untied") + (std::is_same_v<C, bf16> ? ", bf16" : ", fp32"));
}

}  // namespace

TEST(Recompute, Fp32BitwiseIdenticalTiledTied) { recompute_is_bitwise<float>(true, st::AttentionKind::Tiled); }
TEST(Recompute, Fp32BitwiseIdenticalTiledUntied) { recompute_is_bitwise<float>(false, st::AttentionKind::Tiled); }
TEST(Recompute, Fp32BitwiseIdenticalExact) { recompute_is_bitwise<float>(false, st::AttentionKind::Exact); }
TEST(Recompute, Fp32BitwiseIdenticalQkNorm) { recompute_is_bitwise<float>(false, st::AttentionKind::Tiled, true); }
TEST(Recompute, Bf16BitwiseIdenticalQkNormExact) { recompute_is_bitwise<bf16>(true, st::AttentionKind::Exact, true); }
TEST(Recompute, Fp32BitwiseIdenticalMoe) { recompute_is_bitwise<float>(false, st::AttentionKind::Tiled, false, true); }
TEST(Recompute, Bf16BitwiseIdenticalMoeExact) { recompute_is_bitwise<bf16>(true, st::AttentionKind::Exact, false, true); }
TEST(Recompute, Bf16BitwiseIdenticalTiled) { recompute_is_bitwise<bf16>(true, st::AttentionKind::Tiled); }
TEST(Recompute, Bf16BitwiseIdenticalExactUntied) { recompute_is_bitwise<bf16>(false, st::AttentionKind::Exact); }

// Chunks of 1, 5, 13 and 64 tokens (74 tokens per rank: 64 leaves a short last chunk) against one
// chunk of all tokens: loss and gradients within 1e-6 relative (summation order differs only).
TEST(Recompute, ChunkedLossMatchesUnchunked) {
  for (bool tied : {true, false}) {
    const st::ModelConfig mc = cfg(tied);
    const Result whole = run<float>(mc, {st::Recompute::None, st::AttentionKind::Tiled, kB * kT});
    for (int chunk : {1, 5, 13, 64}) {
      const Result c = run<float>(mc, {st::Recompute::None, st::AttentionKind::Tiled, chunk});
      EXPECT_NEAR(c.loss, whole.loss, 1e-6 * std::abs(whole.loss)) << "chunk " << chunk;
      for (size_t u = 0; u < whole.grads.size(); ++u) {
        float mx = 0, err = 0;
        for (size_t i = 0; i < whole.grads[u].size(); ++i) {
          mx = std::max(mx, std::abs(whole.grads[u][i]));
          err = std::max(err, std::abs(c.grads[u][i] - whole.grads[u][i]));
        }
        EXPECT_LE(err, 1e-6f * mx) << "unit " << u << ", chunk " << chunk << (tied ? ", tied" : ", untied")
                                   << ": max |diff| " << err << " of max |grad| " << mx;
      }
    }
  }
}

// An EP group's size for the allocations (reserve() sends nothing).
class EpSizeOnly final : public st::ExpertParallelOps<float> {
 public:
  explicit EpSizeOnly(int n) : n_(n) {}
  int size() const override { return n_; }
  int rank() const override { return 0; }
  std::vector<int64_t> all_gather_counts(const std::vector<int64_t>&) override {
    throw std::logic_error("not called by reserve()");
  }
  std::unique_ptr<st::ExpertTransfer> start_all_to_all(const float*, const std::vector<size_t>&, float*,
                                                       const std::vector<size_t>&, size_t) override {
    throw std::logic_error("not called by reserve()");
  }

 private:
  int n_;
};

// The memory plan's activation bytes are what the model allocates, in every mode (MoE also under
// expert parallelism, whose expert rows are allocated for balanced routing and grow with the
// imbalance: Moe.ExpertRowsGrowToTheWorstCase).
TEST(Recompute, ActivationBytesMatchAllocations) {
  for (bool tied : {true, false})
    for (st::Recompute r : {st::Recompute::None, st::Recompute::Selective, st::Recompute::Full})
      for (st::AttentionKind a : {st::AttentionKind::Tiled, st::AttentionKind::Exact})
        for (int chunk : {0, 10}) {
          // q/k norm: the untied, whole-loss cases; MoE: the tied, chunked ones
          const st::ModelConfig mc = cfg(tied, !tied && chunk == 0, tied && chunk == 10);
          const st::ModelOptions mo{r, a, chunk};
          st::testing::CountingBackend<float> be;
          {
            st::LlamaModel<float> m(mc, be, mo);
            m.reserve(kB, kT);
            const int64_t want = st::activation_bytes(mc, mo, kB, kT, sizeof(float), sizeof(float)).total();
            EXPECT_EQ(static_cast<int64_t>(be.live_bytes()), want)
                << st::recompute_name(r) << ", " << st::attention_name(a) << ", chunk " << chunk;
          }
          EXPECT_EQ(be.live_bytes(), 0u);
          if (!mc.is_moe()) continue;
          for (int ep : {2, 4}) {
            EpSizeOnly ops(ep);
            {
              st::LlamaModel<float> m(mc, be, mo, nullptr, nullptr, &ops);
              m.reserve(kB, kT);
              // Allocated for balanced routing (the plan's figure): the kept expert rows as without EP.
              const int64_t want =
                  st::activation_bytes(mc, mo, kB, kT, sizeof(float), sizeof(float), 1, 1, ep, true).total();
              EXPECT_EQ(static_cast<int64_t>(be.live_bytes()), want)
                  << st::recompute_name(r) << ", " << st::attention_name(a) << ", chunk " << chunk << ", ep " << ep;
              EXPECT_GT(want, st::activation_bytes(mc, mo, kB, kT, sizeof(float), sizeof(float)).total());
              EXPECT_EQ(st::activation_bytes(mc, mo, kB, kT, sizeof(float), sizeof(float), 1, 1, ep, true).per_layer,
                        st::activation_bytes(mc, mo, kB, kT, sizeof(float), sizeof(float)).per_layer);
              // The worst case (every slot of the group on one rank's experts) is more.
              EXPECT_GT(st::activation_bytes(mc, mo, kB, kT, sizeof(float), sizeof(float), 1, 1, ep).total(), want);
            }
            EXPECT_EQ(be.live_bytes(), 0u);
          }
        }
  // And the modes order as documented: full < selective < none.
  const st::ModelConfig mc = cfg(true);
  auto bytes = [&](st::Recompute r) {
    return st::activation_bytes(mc, {r, st::AttentionKind::Tiled, 0}, 4, 64, 4, 4).total();
  };
  EXPECT_LT(bytes(st::Recompute::Full), bytes(st::Recompute::Selective));
  EXPECT_LT(bytes(st::Recompute::Selective), bytes(st::Recompute::None));
}

// The memory plan adds up what training allocates on this rank: Fsdp shards and buffers, AdamW
// moments, mixed-precision buffers and the model's activations (counted by the backends), at this
// world size, fp32 and bf16 (both reduce dtypes). Token data and the runtime floor are left out
// here (data_tokens = 0, runtime_bytes = 0), and so are the MPI collective buffers (host memory
// of MpiComm and the MPI library); the benchmark compares all of them with VmHWM.
TEST(MemoryPlan, MatchesCountedAllocations) {
  st::Comm& comm = st::testing::comm();
  const int W = comm.world_size();
  struct Case { st::Precision p; bool rbf16; st::Recompute r; };
  for (const Case& k : {Case{st::Precision::FP32, false, st::Recompute::None},
                        Case{st::Precision::FP32, false, st::Recompute::Full},
                        Case{st::Precision::BF16, false, st::Recompute::Selective},
                        Case{st::Precision::BF16, true, st::Recompute::Full}})
   for (const st::OverlapConfig ov : {st::OverlapConfig{false, 0, st::CommProgress::Wait},
                                      st::OverlapConfig{true, 2, st::CommProgress::Wait}}) {
    SCOPED_TRACE(ov.on ? "overlap on, prefetch 2" : "overlap off");
    const st::ModelConfig mc = cfg(false);
    st::TrainConfig tc;
    tc.seq_len = kT;
    tc.micro_batch = kB;
    tc.recompute = k.r;
    const st::MemoryPlan plan = st::plan_memory({mc, tc, W, k.p, k.rbf16, false, 0, 4, 0, ov});
    int64_t backend_bytes = plan.total();  // all but the MPI library's and MpiComm's host buffers
    for (auto& l : plan.lines)
      if (l.name == "MPI collective buffers") backend_bytes -= l.bytes;
    st::testing::CountingBackend<float> be;
    st::testing::CountingBackend<bf16> be16;
    {
      const bool mixed = k.p == st::Precision::BF16;
      st::ShardedState<float> f(be, comm, st::ShardPlan::build(st::llama_units(mc), W));
      st::AdamW<float> opt(f, tc);
      std::unique_ptr<st::MixedPrecisionUnits> mp;
      std::unique_ptr<st::UnitPipeline<float>> p32;
      if (!mixed) p32 = std::make_unique<st::UnitPipeline<float>>(be, std::make_unique<st::IdentityCodec<float>>(f), ov);
      if (mixed) {
        mp = std::make_unique<st::MixedPrecisionUnits>(f, be16, k.rbf16, st::MixedPrecisionUnits::kWidenSlab, ov);
        st::LlamaModel<bf16> m(mc, be16, st::model_options(tc));
        m.reserve(kB, kT);
        EXPECT_EQ(static_cast<int64_t>(be.live_bytes() + be16.live_bytes()), backend_bytes);
      } else {
        st::LlamaModel<float> m(mc, be, st::model_options(tc));
        m.reserve(kB, kT);
        EXPECT_EQ(static_cast<int64_t>(be.live_bytes()), backend_bytes);
      }
    }
    if (::testing::Test::HasFailure()) std::printf("%s\n", plan.format("plan that did not match").c_str());
  }
}

// The fp32 reduce-scatter of mixed precision widens a slab at a time: with slabs of a few elements
// (every unit cut into many, the last one short) the gradient shards equal those of one slab per
// unit (each element is the same sum over ranks; 1e-6 allows MPI to pick another summation order
// for other message sizes).
TEST(MemoryPlan, Bf16WidenedInSlabsMatchesWhole) {
  const st::ModelConfig mc = cfg(true);
  st::Comm& comm = st::testing::comm();
  std::vector<std::vector<float>> g[2];
  for (int k = 0; k < 2; ++k) {
    auto be = st::make_cpu_backend<float>();
    auto b16 = st::make_cpu_backend<bf16>();
    st::ShardedState<float> f(*be, comm, st::ShardPlan::build(st::llama_units(mc), comm.world_size()));
    f.init_params(5);
    f.zero_grads();
    st::MixedPrecisionUnits mp(f, *b16, false, k == 0 ? size_t{1} << 30 : size_t{7} * comm.world_size());
    std::vector<int32_t> tok, tgt;
    batch(tok, tgt, mc.vocab_size, comm.rank());
    st::LlamaModel<bf16> m(mc, *b16);
    m.forward(mp, tok.data(), kB, kT);
    m.head_backward(mp, tgt.data(), 1.0f / (kB * kT));
    m.backward(mp);
    for (int u = 0; u < f.num_units(); ++u)
      g[k].emplace_back(f.grad_shard(u), f.grad_shard(u) + f.plan().units[u].shard_size);
  }
  for (size_t u = 0; u < g[0].size(); ++u) {
    float mx = 0, err = 0;
    for (size_t i = 0; i < g[0][u].size(); ++i) {
      mx = std::max(mx, std::abs(g[0][u][i]));
      err = std::max(err, std::abs(g[1][u][i] - g[0][u][i]));
    }
    EXPECT_GT(mx, 0.0f) << "unit " << u;
    EXPECT_LE(err, 1e-6f * mx) << "unit " << u;
  }
}

// Fsdp reduce-scatters a large unit a slab at a time (kReduceSlab elements over all ranks, packed
// from the full-unit buffer): a unit of a bit more than two slabs gets every element's exact mean
// (dyadic values: every summation order is exact), padding included.
TEST(MemoryPlan, FsdpReduceScatterInSlabsIsExact) {
  st::Comm& comm = st::testing::comm();
  const int W = comm.world_size(), r = comm.rank();
  const int64_t numel = 2 * static_cast<int64_t>(st::Fsdp<float>::kReduceSlab) + 5;
  std::vector<st::UnitSpec> units{{"big", {st::ParamSpec{"big.weight", {numel}, true, st::Init::Zeros, 0.0}}}};
  auto be = st::make_cpu_backend<float>();
  st::Fsdp<float> f(*be, comm, st::ShardPlan::build(units, W));
  f.zero_grads();
  const st::UnitPlan& up = f.plan().units[0];
  float* g = f.full_grad(0);
  auto val = [](int q, int64_t i) { return static_cast<float>((q + 1) * 64 + i % 97) + 0.5f; };
  for (int64_t i = 0; i < up.padded_numel; ++i) g[i] = val(r, i);
  f.reduce_scatter_grad(0);
  const int64_t S = up.shard_size;
  size_t wrong = 0;
  for (int64_t j = 0; j < S; ++j) {
    double want = 0;
    for (int q = 0; q < W; ++q) want += val(q, r * S + j);
    const float mean = static_cast<float>(want) * (1.0f / static_cast<float>(W));  // the engine's arithmetic
    if (f.grad_shard(0)[j] != mean && wrong++ < 5)
      ADD_FAILURE() << "element " << j << ": " << f.grad_shard(0)[j] << " != " << mean;
  }
  EXPECT_EQ(wrong, 0u);
}
