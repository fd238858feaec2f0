// Mixture-of-experts models (issue 56) against transformers: tiny MixtralForCausalLM and
// Qwen3MoeForCausalLM (8 experts, top 2; Qwen3-MoE with q/k norm, a dense block by mlp_only_layers
// and no renormalization) made by transformers with random weights (tests/e2e/moe_check.py, run by
// tests/e2e/test_moe.sh, which sets SHARDTRAIN_TEST_MOE_TORCH). Their weights are loaded by
// transformers' in-memory names, which are shardtrain's canonical ones (the fused experts included);
// every rank runs the whole model alone (W = 1) in fp32 and compares:
//   - the logits of a batch of 3 x 24 tokens with transformers' fp32 logits, within 1e-5;
//   - the mean next-token cross-entropy, the load-balancing loss and their sum ce + coef x aux with
//     model(tokens, labels=tokens, output_router_logits=True)'s, within 1e-6: aux scope MicroBatch
//     on the same rows as transformers' forward call (load_balancing_loss_func pools every MoE
//     block's rows of it), and scope Sequence on a batch of one sequence, where the two coincide.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/model/config.h"
#include "shardtrain/model/model.h"
#include "shardtrain/shard/shard.h"
#include "../test_env.h"

namespace st = shardtrain;

namespace {

template <typename E> std::vector<E> read_array(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error("cannot open " + path);
  const auto n = static_cast<std::streamoff>(in.tellg());
  if (n % static_cast<std::streamoff>(sizeof(E)) != 0 || n > (std::streamoff{1} << 30))
    throw std::runtime_error(path + ": not an array of " + std::to_string(sizeof(E)) + "-byte elements");
  std::vector<E> v(static_cast<size_t>(n) / sizeof(E));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), n);
  if (!in) throw std::runtime_error("cannot read " + path);
  return v;
}

struct Losses {
  double ce = 0, aux = 0, total = 0;
};
Losses read_losses(const std::string& path) {
  Losses l;
  std::ifstream(path) >> l.ce >> l.aux >> l.total;
  return l;
}

// shardtrain's losses of `tokens` (rows of T): the mean next-token cross-entropy (targets: the next
// token, none for a row's last), the load-balancing loss of the scope and ce + coef x aux.
Losses our_losses(st::LlamaModel<float>& m, st::UnitSource<float>& f, const std::vector<int32_t>& tokens, int T,
                  double coef) {
  const int B = static_cast<int>(tokens.size()) / T;
  std::vector<int32_t> targets(tokens.size());
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      targets[static_cast<size_t>(b * T + t)] = t + 1 < T ? tokens[static_cast<size_t>(b * T + t + 1)] : st::kNoTarget;
  m.forward(f, tokens.data(), B, T);
  Losses l;
  l.ce = m.loss(f, targets.data()) / (static_cast<double>(B) * (T - 1));
  l.aux = m.moe_aux_loss();
  l.total = l.ce + coef * l.aux;
  return l;
}

void expect_losses(const Losses& got, const Losses& want, const std::string& what) {
  EXPECT_NEAR(got.ce, want.ce, 1e-6) << what << ": cross-entropy";
  EXPECT_NEAR(got.aux, want.aux, 1e-6) << what << ": load-balancing loss";
  EXPECT_NEAR(got.total, want.total, 1e-6) << what << ": ce + coef x aux";
  std::printf("[ MoE vs transformers ] %s: ce %.9f (%.1e), aux %.9f (%.1e), loss %.9f (%.1e)\n", what.c_str(), got.ce,
              std::fabs(got.ce - want.ce), got.aux, std::fabs(got.aux - want.aux), got.total,
              std::fabs(got.total - want.total));
}

}  // namespace

TEST(Moe, DISABLED_LogitsAndLossEqualTransformers) {
  const char* env = std::getenv("SHARDTRAIN_TEST_MOE_TORCH");
  ASSERT_NE(env, nullptr) << "run by tests/e2e/test_moe.sh, which sets SHARDTRAIN_TEST_MOE_TORCH";
  st::Comm& c = st::testing::comm();
  st::MpiComm self = st::MpiComm::split(c, c.rank(), 0);
  for (const char* name : {"mixtral", "qwen3_moe"}) {
    SCOPED_TRACE(name);
    const std::string dir = std::string(env) + "/" + name;
    std::ifstream cf(dir + "/config.json");
    const std::string text((std::istreambuf_iterator<char>(cf)), std::istreambuf_iterator<char>());
    const st::ModelConfig mc = st::parse_hf_config(text, dir + "/config.json");
    ASSERT_TRUE(mc.is_moe());
    auto be = st::make_cpu_backend<float>();
    st::Fsdp<float> f(*be, self, st::ShardPlan::build(st::llama_units(mc), 1), &self, nullptr);
    int params = 0, files = 0;
    for (const st::UnitPlan& u : f.plan().units)
      for (const st::ParamSlot& p : u.params) {
        f.set_param(p.spec.name, read_array<float>(dir + "/params/" + p.spec.name + ".f32"));
        ++params;
      }
    for (const auto& e : std::filesystem::directory_iterator(dir + "/params")) files += e.path().extension() == ".f32";
    EXPECT_EQ(params, files) << "every parameter of transformers' model has a place in shardtrain's";

    const std::vector<int32_t> tokens = read_array<int32_t>(dir + "/tokens.i32");
    const int T = 24, B = static_cast<int>(tokens.size()) / T;
    st::ModelOptions mb;
    mb.aux_scope = st::MoeAuxScope::MicroBatch;
    st::LlamaModel<float> m(mc, *be, mb);
    m.forward(f, tokens.data(), B, T);
    m.head_logits(f);
    const std::vector<float> logits = m.logits(), want = read_array<float>(dir + "/logits.f32");
    ASSERT_EQ(logits.size(), want.size());
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(double(logits[i]) - want[i]));
    EXPECT_LE(worst, 1e-5) << "max |logit difference|";
    std::printf("[ MoE vs transformers ] %s: %zu fp32 logits of %d x %d tokens, max abs difference %.2e\n", name,
                want.size(), B, T, worst);
    for (int l = 0; l < mc.num_hidden_layers; ++l)
      if (mc.is_moe_layer(l)) {
        int64_t sum = 0;
        for (int64_t n : m.expert_counts(l)) sum += n;
        EXPECT_EQ(sum, int64_t{mc.num_experts_per_tok} * B * T) << "block " << l;
      }

    const double coef = mc.router_aux_loss_coef;
    expect_losses(our_losses(m, f, tokens, T, coef), read_losses(dir + "/loss.txt"),
                  std::string(name) + ", aux per micro-batch, " + std::to_string(B) + " rows");
    st::ModelOptions seq;
    seq.aux_scope = st::MoeAuxScope::Sequence;
    st::LlamaModel<float> ms(mc, *be, seq);
    const std::vector<int32_t> one = read_array<int32_t>(dir + "/tokens1.i32");
    expect_losses(our_losses(ms, f, one, T, coef), read_losses(dir + "/loss1.txt"),
                  std::string(name) + ", aux per sequence, 1 row");
    // Per sequence on the 3-row batch: the sum of the rows' own losses, not the pooled one.
    const Losses pooled = our_losses(m, f, tokens, T, coef), rows = our_losses(ms, f, tokens, T, coef);
    EXPECT_GT(std::fabs(rows.aux / B - pooled.aux), 1e-6) << "the two scopes should differ on several rows";
  }
}
