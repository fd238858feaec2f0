// Model configs of the architectures beside Llama (issue 56): Mixtral and Qwen3-MoE config.json as
// transformers 5.24 writes them and as the hub has them, the MoE presets' parameter counts against
// transformers on the meta device, the refusals, and the build's refusal to run what it has no
// layers for yet.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"
#include "shardtrain/model/model.h"

using namespace shardtrain;
using json = nlohmann::json;

namespace {
// What MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
// num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, max_position_embeddings=64)
// .save_pretrained writes (transformers 5.24), keys in its order.
const char* kMixtral = R"({"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "dtype": "float32", "eos_token_id": 2, "head_dim": null, "hidden_act": "silu", "hidden_size": 16,
  "initializer_range": 0.02, "intermediate_size": 24, "max_position_embeddings": 64, "model_type": "mixtral",
  "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
  "num_local_experts": 4, "output_router_logits": false, "pad_token_id": null, "rms_norm_eps": 1e-05,
  "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "router_aux_loss_coef": 0.001,
  "router_jitter_noise": 0.0, "sliding_window": null, "tie_word_embeddings": false, "transformers_version": "5.24.0",
  "use_cache": true, "vocab_size": 64})";
// Qwen3MoeConfig(..., head_dim=8, moe_intermediate_size=24, intermediate_size=40, num_experts=4)
// .save_pretrained (transformers 5.24: num_experts written as num_local_experts).
const char* kQwen3Moe = R"({"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": null, "decoder_sparse_step": 1, "dtype": "float32",
  "eos_token_id": null, "head_dim": 8, "hidden_act": "silu", "hidden_size": 16, "initializer_range": 0.02,
  "intermediate_size": 40, "max_position_embeddings": 64, "mlp_only_layers": [], "model_type": "qwen3_moe",
  "moe_intermediate_size": 24, "norm_topk_prob": false, "num_attention_heads": 4, "num_experts_per_tok": 2,
  "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": false,
  "pad_token_id": null, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "router_aux_loss_coef": 0.001, "sliding_window": null, "tie_word_embeddings": false,
  "transformers_version": "5.24.0", "use_cache": true, "use_sliding_window": false, "vocab_size": 64})";

ModelConfig parsed(const std::string& text) {
  ModelConfig c = parse_hf_config(text, "'cfg.json'");
  validate(c, "'cfg.json'");
  return c;
}
// `base` with its keys replaced by `edits` (null removes a key); the message it is refused with.
std::string refusal(const char* base, const json& edits) {
  json j = json::parse(base);
  for (auto& [k, v] : edits.items()) {
    if (v.is_null()) j.erase(k);
    else j[k] = v;
  }
  try {
    parsed(j.dump());
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
// A valid Qwen3-MoE config (canonical JSON writes its MoE rows).
ModelConfig moe_like() { return parsed(kQwen3Moe); }
}  // namespace

TEST(ConfigMoe, MixtralAsTransformersWritesIt) {
  const ModelConfig c = parsed(kMixtral);
  EXPECT_EQ(c.architecture, "MixtralForCausalLM");
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 24);  // the experts are intermediate_size wide
  EXPECT_TRUE(c.norm_topk_prob);           // Mixtral always renormalizes
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.tie_word_embeddings);
  for (int l = 0; l < 2; ++l) EXPECT_TRUE(c.is_moe_layer(l));
  // transformers' MixtralForCausalLM(config).num_parameters(): embed 1024, per layer norms 32,
  // attention 16*16*2 + 16*8*2 = 768, router 64, experts 4*3*16*24 = 4608; norm 16; head 1024.
  EXPECT_EQ(c.num_params(), 1024 + 2 * (32 + 768 + 64 + 4608) + 16 + 1024);
  EXPECT_EQ(c.num_active_params(), 1024 + 2 * (32 + 768 + 64 + 2 * 3 * 16 * 24) + 16 + 1024);
  // Defaults where keys are absent: MixtralConfig's.
  json j = json::parse(kMixtral);
  for (const char* k : {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"}) j.erase(k);
  const ModelConfig d = parsed(j.dump());
  EXPECT_EQ(d.num_experts, 8);
  EXPECT_EQ(d.num_experts_per_tok, 2);
  EXPECT_EQ(d.router_aux_loss_coef, 0.001);
}

TEST(ConfigMoe, Qwen3MoeAsTransformersWritesItAndAsTheHubHasIt) {
  const ModelConfig c = parsed(kQwen3Moe);
  EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.moe_intermediate_size, 24);
  EXPECT_EQ(c.intermediate_size, 40);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  // The hub's key (num_experts) reads the same; both given must agree.
  json hub = json::parse(kQwen3Moe);
  hub.erase("num_local_experts");
  hub["num_experts"] = 4;
  EXPECT_TRUE(parsed(hub.dump()) == c);
  EXPECT_NE(refusal(kQwen3Moe, {{"num_experts", 6}}).find("keys 'num_experts' (6) and 'num_local_experts' (4) disagree"),
            std::string::npos);
  // Mixtral likewise (transformers maps num_experts onto num_local_experts for both).
  json mx = json::parse(kMixtral);
  mx.erase("num_local_experts");
  mx["num_experts"] = 4;
  EXPECT_EQ(parsed(mx.dump()).num_experts, 4);
  // A dense layer (mlp_only_layers) and a sparse step: layer l has experts iff (l + 1) % step == 0
  // and l is not listed (transformers' Qwen3MoeDecoderLayer).
  json j = json::parse(kQwen3Moe);
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  const ModelConfig s = parsed(j.dump());
  const bool want[6] = {false, true, false, false, false, true};
  for (int l = 0; l < 6; ++l) EXPECT_EQ(s.is_moe_layer(l), want[l]) << l;
  // Per layer: norms 32, attention 16*32*2 + 16*16*2 + q/k norms 16 = 1552; MoE 64 + 4*3*16*24,
  // dense 3*16*40.
  const int64_t attn = 32 + 1552, moe = 64 + 4 * 3 * 16 * 24, active = 64 + 2 * 3 * 16 * 24, dense = 3 * 16 * 40;
  EXPECT_EQ(s.num_params(), 1024 + 6 * attn + 2 * moe + 4 * dense + 16 + 1024);
  EXPECT_EQ(s.num_active_params(), 1024 + 6 * attn + 2 * active + 4 * dense + 16 + 1024);
}

// The hub's Mixtral-8x7B-v0.1 and Qwen3-30B-A3B: counts of transformers 5.24 on the meta device
// (MixtralForCausalLM / Qwen3MoeForCausalLM(config), sum of numel() over parameters(); active =
// that with num_experts_per_tok experts per layer, as the model cards' 12.9B and 3.3B).
TEST(ConfigMoe, PublishedPresets) {
  const ModelConfig m = preset("mixtral-8x7b");
  EXPECT_NO_THROW(validate(m, "mixtral-8x7b"));
  EXPECT_EQ(m.num_params(), 46'702'792'704);
  EXPECT_EQ(m.num_active_params(), 12'879'925'248);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.num_experts_per_tok, 2);
  const ModelConfig q = preset("qwen3-30b-a3b");
  EXPECT_NO_THROW(validate(q, "qwen3-30b-a3b"));
  EXPECT_EQ(q.num_params(), 30'532'122'624);
  EXPECT_EQ(q.num_active_params(), 3'353'032'704);
  EXPECT_EQ(q.head_dim(), 128);
  EXPECT_TRUE(q.qk_norm);
  // A dense model: the two counts are one.
  EXPECT_EQ(preset("llama-1b").num_active_params(), preset("llama-1b").num_params());
}

TEST(ConfigMoe, BadMoeConfigsRefusedNamingTheKey) {
  EXPECT_NE(refusal(kMixtral, {{"num_experts_per_tok", 5}}).find(
                "key 'num_experts_per_tok' = 5 must be between 1 and the number of experts (4)"),
            std::string::npos);
  EXPECT_NE(refusal(kMixtral, {{"num_experts_per_tok", 0}}).find("key 'num_experts_per_tok' = 0"), std::string::npos);
  EXPECT_NE(refusal(kMixtral, {{"num_local_experts", 0}}).find("number of experts"), std::string::npos);
  EXPECT_NE(refusal(kMixtral, {{"router_jitter_noise", 0.01}}).find("key 'router_jitter_noise' = 0.01"),
            std::string::npos);
  EXPECT_NE(refusal(kMixtral, {{"model_type", "qwen3_moe"}}).find("key 'model_type' is \"qwen3_moe\", expected \"mixtral\""),
            std::string::npos);
  EXPECT_NE(refusal(kMixtral, {{"router_aux_loss_coef", -1}}).find("key 'router_aux_loss_coef'"), std::string::npos);
  EXPECT_NE(refusal(kQwen3Moe, {{"mlp_only_layers", {0, 0}}}).find("key 'mlp_only_layers' (2 layers): layer 0 is listed twice"), std::string::npos);
  EXPECT_NE(refusal(kQwen3Moe, {{"mlp_only_layers", {2}}}).find("layer 2 is not in [0, num_hidden_layers)"),
            std::string::npos);
  EXPECT_NE(refusal(kQwen3Moe, {{"mlp_only_layers", {0, 1}}}).find("no layer has experts"), std::string::npos);
  EXPECT_NE(refusal(kQwen3Moe, {{"decoder_sparse_step", 0}}).find("key 'decoder_sparse_step' must be positive"),
            std::string::npos);
  EXPECT_NE(refusal(kQwen3Moe, {{"use_sliding_window", true}, {"sliding_window", 32}}).find("sliding-window"),
            std::string::npos);
  EXPECT_NE(refusal(kQwen3Moe, {{"moe_intermediate_size", 0}}).find("key 'moe_intermediate_size' must be positive"),
            std::string::npos);
  EXPECT_NE(refusal(kMixtral, {{"architectures", {"DeepseekV3ForCausalLM"}}})
                .find("architecture [\"DeepseekV3ForCausalLM\"] is not supported; expected one of LlamaForCausalLM, "
                      "Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM"),
            std::string::npos);
  // "architectures" as a bare string is one entry.
  json bare = json::parse(kMixtral);
  bare["architectures"] = "MixtralForCausalLM";
  EXPECT_TRUE(parsed(bare.dump()) == parsed(kMixtral));
  // A Llama's config.json with MoE keys reads as the dense Llama transformers makes of it.
  json llama = json::parse(kMixtral);
  llama["architectures"] = {"LlamaForCausalLM"};
  llama["model_type"] = "llama";
  EXPECT_FALSE(parsed(llama.dump()).is_moe());
  // A canonical config (a checkpoint's) with experts on a dense architecture is refused.
  ModelConfig bad = preset("tiny");
  bad.num_experts = 4;
  try {
    validate(bad, "'ck.h5'");
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("key 'num_experts' = 4 applies to the mixture-of-experts architectures"),
              std::string::npos)
        << e.what();
  }
}

// The model's units (llama_units) hold exactly the parameters the config counts: the published
// MoE shapes (the experts fused per block, the router, Qwen3-MoE's q/k norms; Qwen3-MoE with a dense
// block by mlp_only_layers), and a dense Qwen3.
TEST(ConfigMoe, UnitsHoldEveryParameterTheConfigCounts) {
  auto total = [](const ModelConfig& c) {
    int64_t n = 0;
    for (const UnitSpec& u : llama_units(c))
      for (const ParamSpec& p : u.params) n += p.numel();
    return n;
  };
  for (const char* n : {"mixtral-8x7b", "qwen3-30b-a3b", "llama-1b"}) EXPECT_EQ(total(preset(n)), preset(n).num_params()) << n;
  ModelConfig q = preset("qwen3-30b-a3b");
  q.num_hidden_layers = 4;
  q.mlp_only_layers = {2};
  EXPECT_EQ(total(q), q.num_params());
  const std::vector<UnitSpec> u = llama_units(q);
  EXPECT_EQ(u[3].params.back().name, "model.layers.2.mlp.down_proj.weight") << "block 2 is dense";
  EXPECT_EQ(u[2].params.back().name, "model.layers.1.mlp.experts.down_proj");
  EXPECT_EQ(u[2].params.back().shape, (std::vector<int64_t>{128, 2048, 768}));
  ModelConfig d = preset("tiny");
  d.architecture = "Qwen3ForCausalLM";
  d.qk_norm = true;
  EXPECT_EQ(total(d), d.num_params());
}

// From helper-22's attempts to break the reading (each a case that was wrong):
TEST(ConfigMoe, WhatStrangersConfigsMeanToTransformers) {
  // Mistral ignores use_sliding_window: its window still cuts the context, so it is refused; a
  // Qwen3 window is off unless use_sliding_window says true (Qwen3Config's default false).
  json mistral = json::parse(kMixtral);
  mistral["architectures"] = {"MistralForCausalLM"};
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = 4;
  mistral["use_sliding_window"] = false;
  EXPECT_NE(refusal(mistral.dump().c_str(), json::object()).find("sliding-window attention is not supported"),
            std::string::npos);
  json qwen = json::parse(kQwen3Moe);
  qwen.erase("use_sliding_window");
  qwen["sliding_window"] = 4;
  EXPECT_EQ(refusal(qwen.dump().c_str(), json::object()), "");
  qwen["use_sliding_window"] = true;
  EXPECT_NE(refusal(qwen.dump().c_str(), json::object()).find("sliding-window"), std::string::npos);
  // A null inside mlp_only_layers is not layer 0; a null MoE value is not its default.
  EXPECT_NE(refusal(kQwen3Moe, {{"mlp_only_layers", {nullptr, 1}}}).find("key 'mlp_only_layers[0]' must be an integer, got null"),
            std::string::npos);
  EXPECT_NE(refusal(kQwen3Moe, {{"mlp_only_layers", {json::array({4})}}}).find("key 'mlp_only_layers[0]' must be an integer"),
            std::string::npos);
  json nulls = json::parse(kQwen3Moe);
  nulls["num_experts_per_tok"] = nullptr;
  EXPECT_NE(refusal(nulls.dump().c_str(), json::object()).find("key 'num_experts_per_tok' must not be null"),
            std::string::npos);
  nulls = json::parse(kQwen3Moe);
  nulls["num_local_experts"] = nullptr;
  EXPECT_NE(refusal(nulls.dump().c_str(), json::object()).find("key 'num_local_experts' must not be null"),
            std::string::npos);
  // Keys transformers' Llama ignores do not refuse a Llama (as before issue 56).
  json llama = json::parse(kMixtral);
  llama["architectures"] = {"LlamaForCausalLM"};
  llama["model_type"] = "llama";
  llama["router_jitter_noise"] = 0.1;
  llama["use_sliding_window"] = "yes";
  EXPECT_EQ(refusal(llama.dump().c_str(), json::object()), "");
  // Two architectures listed: the one of the file's model_type.
  llama["architectures"] = {"Qwen3ForCausalLM", "LlamaForCausalLM"};
  EXPECT_EQ(parsed(llama.dump()).architecture, "LlamaForCausalLM");
  // Absent keys take the architecture's transformers defaults (MixtralConfig: rope_theta 1e6,
  // rms_norm_eps 1e-5, max_position_embeddings 131072, 8 KV heads; Qwen3Config: head_dim 128).
  json bare = json::parse(kMixtral);
  for (const char* k : {"rope_parameters", "rms_norm_eps", "max_position_embeddings", "num_key_value_heads"}) bare.erase(k);
  const ModelConfig m = parse_hf_config(bare.dump(), "'cfg.json'");
  EXPECT_EQ(m.rope_theta, 1e6);
  EXPECT_EQ(m.rms_norm_eps, 1e-5);
  EXPECT_EQ(m.max_position_embeddings, 131072);
  EXPECT_EQ(m.num_key_value_heads, 8);
  const ModelConfig q3 = parse_hf_config(R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 16,
      "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2})",
                                         "'q.json'");
  EXPECT_EQ(q3.head_dim(), 128);
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_EQ(q3.max_position_embeddings, 32768);
}

// A checkpoint's canonical config with a key this version does not know is refused, not read as
// the model without it (a newer version's field, or an edit); resume compares it as a difference.
TEST(ConfigMoe, UnknownCanonicalKeysAreRefused) {
  json j = json::parse(canonical_json(preset("tiny")));
  j["num_local_experts"] = 8;
  try {
    from_canonical_json(j.dump());
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("key 'num_local_experts' is not a model config field of this version"),
              std::string::npos)
        << e.what();
  }
  const std::vector<std::string> d = architecture_differences(j.dump(), canonical_json(preset("tiny")));
  ASSERT_FALSE(d.empty());
  EXPECT_NE(d.front().find("checkpoint: canonical model config is malformed: key 'num_local_experts'"), std::string::npos)
      << d.front();
  // A null where a value is required differs too (resume used to read it as absent).
  json n = json::parse(canonical_json(moe_like()));
  n["qk_norm"] = nullptr;
  EXPECT_FALSE(architecture_differences(n.dump(), canonical_json(moe_like())).empty());
  // Long values are shortened in the message.
  json big = json::parse(canonical_json(moe_like()));
  big["mlp_only_layers"] = std::vector<int>(5000, 0);
  for (const std::string& s : architecture_differences(big.dump(), canonical_json(moe_like())))
    EXPECT_LT(s.size(), 700u) << s.substr(0, 200);
}
