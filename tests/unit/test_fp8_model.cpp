// ModelOptions::fp8 (issue 57 item 3) on the CPU, through the backend's fp8 emulation
// (fp8_linear_emulated): one forward + backward of a small dense model, float storage (bf16 runs
// through MixedPrecisionUnits over an fp32 Fsdp, not set up here; the emulation's bf16 path is
// test_fp8.cpp's).
//   - The switch is wired: the loss with fp8 differs from the run without (bitwise), by less than
//     kLossRel relative; the gradients differ by less than kGradRel (relative L2 over all shards).
//   - Which GEMMs went through linear_fp8, counted by a forwarding backend (tests/mpi/
//     counting_backend.h): exactly the 7 projections of every block (q, k, v, o, gate, up, down),
//     each in its three roles with its own shape; no plain gemm of a block projection is left, and
//     the LM head's GEMMs (every one has the vocabulary as a dimension) are plain gemm calls.
//     Without fp8: no linear_fp8 call, and exactly those 21 x L GEMMs more.
//   - An MoE config with fp8 is refused by the constructor; a double backend refuses linear_fp8.
//   - The memory plan's "fp8 GEMM scratch" line (memory_plan.cpp) against arithmetic written here:
//     llama-125m at 4 x 1024 tokens, TP 1 and 2; fp8_cuda_scratch_bytes of a padded shape.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "../mpi/counting_backend.h"
#include "../test_env.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/fp8.h"
#include "shardtrain/model/config.h"
#include "shardtrain/model/model.h"
#include "shardtrain/shard/shard.h"
#include "shardtrain/train/memory_plan.h"

namespace shardtrain {
namespace {

// GQA (4 query heads over 2 KV heads), untied head, vocabulary 61 (no block dimension equals it),
// every projection a different shape: Q = 32, KV = 16, C = 32, I = 48.
ModelConfig fp8_config() {
  ModelConfig c;
  c.name = "fp8-model";
  c.vocab_size = 61;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = false;
  return c;
}

constexpr int kB = 2, kT = 24;
// Bounds (generous against what the run prints; see the report line): fp8's
// per-element errors (2^-4 relative for E4M3, 2^-3 for E5M2) average out in the products and the
// loss, which sits near ln(61) ~ 4.1 at initialization.
constexpr double kLossRel = 0.05;
constexpr double kGradRel = 0.25;

template <typename T> struct Run {
  double loss = 0;
  std::vector<double> grads;  // every gradient shard, concatenated
  std::vector<typename testing::CountingBackend<T>::Gemm> gemms, fp8s;
};

template <typename T> Run<T> run(bool fp8) {
  const ModelConfig cfg = fp8_config();
  testing::CountingBackend<T> be;
  be.record_gemms = true;
  Fsdp<T> f(be, testing::comm(), ShardPlan::build(llama_units(cfg), 1));
  f.init_params(4242);
  ModelOptions o;
  o.fp8 = fp8;
  LlamaModel<T> m(cfg, be, o);
  std::mt19937 g(11);
  std::vector<int32_t> tokens, targets;
  for (int i = 0; i < kB * kT; ++i) {
    tokens.push_back(static_cast<int32_t>(g() % static_cast<uint32_t>(cfg.vocab_size)));
    targets.push_back(static_cast<int32_t>(g() % static_cast<uint32_t>(cfg.vocab_size)));
  }
  f.zero_grads();
  Run<T> r;
  m.forward(f, tokens.data(), kB, kT);
  r.loss = m.head_backward(f, targets.data(), typename Backend<T>::S(1) / typename Backend<T>::S(kB * kT));
  m.backward(f);
  for (int u = 0; u < f.num_units(); ++u)
    for (int64_t i = 0; i < f.plan().units[static_cast<size_t>(u)].shard_size; ++i)
      r.grads.push_back(static_cast<double>(math::ld(f.grad_shard(u)[i])));
  r.gemms = be.gemms;
  r.fp8s = be.fp8s;
  return r;
}

using Shape = std::tuple<int, int, int, int>;  // role, M, N, K

// The blocks' projections as linear() takes them: role, M = B*T, N outputs, K inputs; 7 per role
// per block (q, k, v, o, gate, up, down), counted.
std::map<Shape, int> block_projections(const ModelConfig& c) {
  const int BT = kB * kT, C = c.hidden_size, I = c.intermediate_size, HD = C / c.num_attention_heads;
  const int Q = c.num_attention_heads * HD, KV = c.num_key_value_heads * HD, L = c.num_hidden_layers;
  std::map<Shape, int> want;
  for (int role = 0; role < 3; ++role)
    for (auto [n, k] : {std::pair{Q, C}, {KV, C}, {KV, C}, {C, Q}, {I, C}, {I, C}, {C, I}})
      want[{role, BT, n, k}] += L;
  return want;
}

// linear()'s role and shape of a plain gemm call (linear() makes Forward gemm(F, T, M, N, K),
// InputGrad gemm(F, F, M, K, N), WeightGrad gemm(T, F, N, K, M)); role -1 for any other call.
template <typename G> Shape as_linear(const G& c) {
  if (!c.ta && c.tb) return {0, c.M, c.N, c.K};
  if (!c.ta && !c.tb) return {1, c.M, c.K, c.N};
  if (c.ta && !c.tb) return {2, c.K, c.M, c.N};
  return {-1, c.M, c.N, c.K};
}

template <typename T> void check_fp8_model(const char* what) {
  const ModelConfig cfg = fp8_config();
  const Run<T> ref = run<T>(false), q = run<T>(true);
  // (a) the switch changes the result, within the bounds.
  const double loss_rel = std::fabs(q.loss - ref.loss) / std::fabs(ref.loss);
  double dn = 0, rn = 0;
  ASSERT_EQ(q.grads.size(), ref.grads.size());
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    dn += (q.grads[i] - ref.grads[i]) * (q.grads[i] - ref.grads[i]);
    rn += ref.grads[i] * ref.grads[i];
  }
  const double grad_rel = std::sqrt(dn / rn);
  std::printf("[ Fp8Model ] %s: loss %.6f (fp8) vs %.6f, relative difference %.3e (bound %.2g); gradients' "
              "relative L2 difference %.3e (bound %.2g)\n",
              what, q.loss, ref.loss, loss_rel, kLossRel, grad_rel, kGradRel);
  EXPECT_NE(q.loss, ref.loss) << what << ": fp8 on gives the same loss: the switch is not wired";
  EXPECT_LT(loss_rel, kLossRel) << what;
  EXPECT_GT(grad_rel, 0.0) << what;
  EXPECT_LT(grad_rel, kGradRel) << what;

  // (b) every block projection went through linear_fp8, with its shape, and nothing else did.
  const std::map<Shape, int> want = block_projections(cfg);
  std::map<Shape, int> got;
  for (const auto& c : q.fp8s) got[{c.kind, c.M, c.N, c.K}]++;
  EXPECT_EQ(got, want) << what << ": the linear_fp8 calls are not the blocks' 21 x L projections";
  EXPECT_EQ(q.fp8s.size(), size_t{21} * static_cast<size_t>(cfg.num_hidden_layers)) << what;
  EXPECT_TRUE(ref.fp8s.empty()) << what << ": linear_fp8 called with fp8 off";
  // With fp8 on, every remaining plain gemm is the LM head's (the vocabulary is one of its
  // dimensions), and there is at least one of each role.
  int head_roles[3] = {0, 0, 0};
  for (const auto& c : q.gemms) {
    const auto [role, M, N, K] = as_linear(c);
    EXPECT_TRUE(M == cfg.vocab_size || N == cfg.vocab_size || K == cfg.vocab_size)
        << what << ": a plain gemm (" << c.ta << c.tb << " " << c.M << "x" << c.N << "x" << c.K
        << ") with fp8 on that is not the LM head's";
    if (role >= 0 && N == cfg.vocab_size) head_roles[role]++;
  }
  for (int r = 0; r < 3; ++r) EXPECT_GT(head_roles[r], 0) << what << ": no LM-head gemm of role " << r;
  // Without fp8 the same head GEMMs plus exactly the projections, as plain gemm calls.
  std::map<Shape, int> plain;
  for (const auto& c : ref.gemms) plain[as_linear(c)]++;
  for (const auto& c : q.gemms) plain[as_linear(c)]--;
  std::erase_if(plain, [](const auto& kv) { return kv.second == 0; });
  EXPECT_EQ(plain, want) << what << ": the fp8-off run's extra gemm calls are not the blocks' projections";
}

TEST(Fp8Model, BlockProjectionsRunInFp8Float) { check_fp8_model<float>("float"); }

TEST(Fp8Model, MoeIsRefused) {
  auto be = make_cpu_backend<float>();
  ModelOptions o;
  o.fp8 = true;
  try {
    LlamaModel<float> m(preset("tiny-moe"), *be, o);
    ADD_FAILURE() << "an MoE model with fp8 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--precision fp8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("mixture-of-experts"), std::string::npos) << e.what();
  }
  o.fp8 = false;
  EXPECT_NO_THROW(LlamaModel<float>(preset("tiny-moe"), *be, o));
}

TEST(Fp8Model, BackendsWithoutFp8Refuse) {
  // The CPU backend in double has no emulation: it throws rather than running unquantized.
  auto be = make_cpu_backend<double>();
  std::vector<double> a(4, 1.0), b(4, 1.0), out(4, 0.0);
  EXPECT_THROW(be->linear_fp8(math::Fp8Gemm::Forward, 2, 2, 2, a.data(), b.data(), out.data(), false),
               std::logic_error);
}

int64_t plan_line(const MemoryPlan& p, const std::string& name) {
  for (const MemoryLine& l : p.lines)
    if (l.name == name) return l.bytes;
  return -1;
}

TEST(Fp8Plan, ScratchIsTheLargestProjectionsCopiesAndWorkspace) {
  const ModelConfig mc = preset("llama-125m");  // C 768, I 2048, 12 heads of 64: every width a multiple of 16
  ASSERT_EQ(mc.hidden_size, 768);
  ASSERT_EQ(mc.intermediate_size, 2048);
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    MemoryPlanInput in;
    in.model = mc;
    in.train.seq_len = 1024;
    in.train.micro_batch = 4;
    in.train.recompute = Recompute::None;
    in.world_size = 2;
    in.precision = Precision::BF16;
    in.cuda = true;
    in.mesh = MeshDims{1, 2 / tp, 1, tp};
    const MemoryPlan off = plan_memory(in);
    EXPECT_EQ(plan_line(off, "fp8 GEMM scratch"), -1);
    in.train.fp8 = true;
    const MemoryPlan on = plan_memory(in);
    // The largest is a weight gradient of gate/up (or down): dy^T [I/tp, BT] and x^T [C, BT] in fp8,
    // 1 byte each: (I/tp + C) x BT; + 256 B of scales, 2 KiB of amax partials, 32 MiB workspace.
    // (Forward of down: BT x I/tp + C x I/tp, smaller at BT = 4096.)
    const int64_t BT = 4 * 1024, C = 768, I = 2048 / tp;
    const int64_t want = 256 + 2048 + (I + C) * BT + (int64_t{32} << 20);
    EXPECT_EQ(plan_line(on, "fp8 GEMM scratch"), want);
    EXPECT_EQ(on.total() - off.total(), want);
    std::printf("[ Fp8Plan ] llama-125m, 4 x 1024 tokens, tp %d: fp8 GEMM scratch %lld bytes (%.1f MiB)\n", tp,
                static_cast<long long>(want), static_cast<double>(want) / (1 << 20));
  }
  // A padded shape (Forward, M 37, N 50, K 23): kp 32, mp 64, np 48, and the fp32 output 64 x 48.
  EXPECT_EQ(fp8_cuda_scratch_bytes(math::Fp8Gemm::Forward, 37, 50, 23, true),
            256 + 2048 + 1536 + 2048 + 12288 + (int64_t{32} << 20));
  // The same shape aligned but with an unaligned output pointer would also pad; an aligned one not.
  EXPECT_EQ(fp8_cuda_scratch_bytes(math::Fp8Gemm::WeightGrad, 64, 32, 48, true), 256 + 2048 + 2048 + 3072 + (int64_t{32} << 20));
  EXPECT_EQ(fp8_cuda_scratch_bytes(math::Fp8Gemm::WeightGrad, 64, 32, 48, false),
            256 + 2048 + 2048 + 3072 + 6144 + (int64_t{32} << 20));
}

}  // namespace
}  // namespace shardtrain
