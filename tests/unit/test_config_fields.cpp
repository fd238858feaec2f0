// The ModelConfig field table (config.cpp, model_config_fields()): every member has a row, and
// every row round-trips canonical JSON -> ModelConfig -> canonical JSON and config.json ->
// ModelConfig -> config.json. The oracle is ModelConfig's member-wise operator==, which knows
// nothing of the table: a row that is missing, or that reads into the wrong member, fails here.
#include <gtest/gtest.h>

#include <cstddef>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"

using namespace shardtrain;
using json = nlohmann::json;

namespace {
// Counts an aggregate's members: the most initializers T{...} accepts. AnyValue converts to any
// member type; a member that is itself an aggregate (RopeScaling) takes one AnyValue whole.
struct AnyValue {
  template <typename T> operator T() const;
};
template <typename T, typename... A> constexpr size_t member_count() {
  if constexpr (requires { T{A{}..., AnyValue{}}; }) return member_count<T, A..., AnyValue>();
  else return sizeof...(A);
}

// A value of each key other than tiny's, written as the canonical JSON writes it. Adding a field to
// the table needs a line here too (EveryRowRoundTrips checks the key sets are equal).
const std::map<std::string, json>& examples() {
  static const std::map<std::string, json> m = {
      {"name", "other"},
      {"vocab_size", 300},
      {"hidden_size", 64},
      {"intermediate_size", 96},
      {"num_hidden_layers", 3},
      {"num_attention_heads", 8},
      {"num_key_value_heads", 1},
      {"max_position_embeddings", 128},
      {"rms_norm_eps", 1e-6},
      {"rope_theta", 500000.0},
      {"rope_scaling", json::parse(R"({"factor":8.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
                                       "original_max_position_embeddings":8192,"rope_type":"llama3"})")},
      {"head_dim", 16},
      {"initializer_range", 0.01},
      {"hidden_act", "gelu"},
      {"tie_word_embeddings", false},
      {"bos_token_id", nullptr},
      {"eos_token_id", json::array({257, 10})},
      // Issue 56's rows (by_architecture): values other than moe_base()'s.
      {"architecture", "Qwen3ForCausalLM"},
      {"qk_norm", true},  // on tiny
      {"num_experts", 16},
      {"num_experts_per_tok", 3},
      {"moe_intermediate_size", 40},
      {"norm_topk_prob", true},
      {"router_aux_loss_coef", 0.01},
      {"decoder_sparse_step", 2},
      {"mlp_only_layers", json::array({0})},
  };
  return m;
}

// A tiny Qwen3-MoE (config.json has a key for each MoE row): the base of the by_architecture rows.
ModelConfig moe_base() {
  ModelConfig c = preset("tiny");
  c.architecture = "Qwen3MoeForCausalLM";
  c.qk_norm = true;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 24;
  c.router_aux_loss_coef = 0.001;
  return c;
}
}  // namespace

TEST(ConfigFields, TableCoversEveryMember) {
  EXPECT_EQ(member_count<ModelConfig>(), model_config_fields().size())
      << "a ModelConfig member has no row in config.cpp's field table (or a row has no member)";
  std::set<std::string> keys;
  for (const ModelConfigField& f : model_config_fields()) EXPECT_TRUE(keys.insert(f.key).second) << f.key;
  // A dense Llama's canonical JSON has every row but issue 56's (written only when not default, so
  // it is what it was before them); an MoE model's has those too where they are not the default.
  json canon = json::parse(canonical_json(preset("tiny")));
  size_t dense_rows = 0;
  for (const ModelConfigField& f : model_config_fields()) {
    dense_rows += !f.by_architecture;
    EXPECT_EQ(canon.contains(f.key), !f.by_architecture) << f.key;
  }
  EXPECT_EQ(canon.size(), dense_rows);
  for (auto& [k, v] : canon.items()) EXPECT_TRUE(keys.count(k)) << k;
  json moe = json::parse(canonical_json(moe_base()));
  for (const char* k : {"architecture", "qk_norm", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "router_aux_loss_coef"})
    EXPECT_TRUE(moe.contains(k)) << k;
  for (const char* k : {"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}) EXPECT_FALSE(moe.contains(k)) << k;
}

TEST(ConfigFields, EveryRowRoundTrips) {
  std::set<std::string> table, ex;
  for (const ModelConfigField& f : model_config_fields()) table.insert(f.key);
  for (auto& [k, v] : examples()) ex.insert(k);
  EXPECT_EQ(table, ex) << "every row of the field table needs an example value here";
  for (const ModelConfigField& f : model_config_fields()) {
    SCOPED_TRACE(f.key);
    const ModelConfig base = f.by_architecture && std::string(f.key) != "qk_norm" ? moe_base() : preset("tiny");
    json j = json::parse(canonical_json(base));
    ASSERT_TRUE(j.contains(f.key) || f.by_architecture);
    ASSERT_NE(j.contains(f.key) ? j[f.key] : json(), examples().at(f.key));
    j[f.key] = examples().at(f.key);
    // canonical JSON -> ModelConfig -> canonical JSON: the value survives, and changed a member.
    const ModelConfig c = from_canonical_json(j.dump());
    EXPECT_EQ(canonical_json(c), j.dump());
    EXPECT_FALSE(c == base) << "the row's value reached no member";
    EXPECT_TRUE(from_canonical_json(canonical_json(c)) == c);
    // The architecture and the q/k norm it implies change together: ArchitecturesRoundTrip.
    if (std::string(f.key) == "architecture" || std::string(f.key) == "qk_norm") continue;
    // config.json -> ModelConfig -> config.json: the same config (name is shardtrain's own label).
    ModelConfig h = parse_hf_config(to_hf_json(c), "'export'");
    if (!f.by_architecture) {
      EXPECT_EQ(f.in_hf_config, json::parse(to_hf_json(c)).contains(f.key));
    }
    if (!f.in_hf_config) {
      EXPECT_EQ(h.name, "custom");
    }
    h.name = c.name;
    EXPECT_TRUE(h == c) << canonical_json(h) << " vs " << canonical_json(c);
    EXPECT_EQ(to_hf_json(h), to_hf_json(c));
  }
}

TEST(ConfigFields, CanonicalKeysAreRequiredUnlessOlderVersionsLackedThem) {
  std::set<std::string> optional = {"head_dim", "rope_scaling"};  // older checkpoints: no such keys
  for (const ModelConfigField& f : model_config_fields())
    if (f.by_architecture) optional.insert(f.key);  // written only when not the default
  for (const ModelConfigField& f : model_config_fields()) {
    SCOPED_TRACE(f.key);
    json j = json::parse(canonical_json(preset("llama-1b")));
    j.erase(f.key);
    if (optional.count(f.key)) {
      EXPECT_NO_THROW(from_canonical_json(j.dump()));
      continue;
    }
    try {
      from_canonical_json(j.dump());
      ADD_FAILURE() << "accepted without the key";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), std::string("canonical model config is malformed: key '") + f.key + "' is missing");
    }
  }
  // Strict types: an integer field given as a string is refused naming the key.
  json j = json::parse(canonical_json(preset("tiny")));
  j["hidden_size"] = "32";
  EXPECT_THROW(
      {
        try {
          from_canonical_json(j.dump());
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("key 'hidden_size' must be an integer"), std::string::npos) << e.what();
          throw;
        }
      },
      std::invalid_argument);
}

TEST(ConfigFields, LabelsAndSpecialIdsCompareAsTheTableSays) {
  const ModelConfig a = preset("tiny");
  for (const ModelConfigField& f : model_config_fields()) {
    SCOPED_TRACE(f.key);
    json j = json::parse(canonical_json(a));
    j[f.key] = examples().at(f.key);
    const auto diff = architecture_differences(canonical_json(a), j.dump());
    // A label never counts; a special id set to null (unset) matches; every other change counts.
    const bool counts = f.architecture && !(f.unset_matches && j[f.key].is_null());
    EXPECT_EQ(!diff.empty(), counts);
  }
}

// Each architecture through config.json and back (to_hf_json -> parse_hf_config): the same config,
// the architecture's own keys (Mixtral: num_local_experts, its experts intermediate_size wide and
// no Qwen keys; Qwen3-MoE: num_experts, moe_intermediate_size, ...), and a dense Llama's
// config.json without any of them.
TEST(ConfigFields, ArchitecturesRoundTrip) {
  ModelConfig qwen3 = preset("tiny");
  qwen3.architecture = "Qwen3ForCausalLM";
  qwen3.qk_norm = true;
  ModelConfig mixtral = preset("tiny");
  mixtral.architecture = "MixtralForCausalLM";
  mixtral.num_experts = 4;
  mixtral.num_experts_per_tok = 2;
  mixtral.moe_intermediate_size = mixtral.intermediate_size;
  mixtral.norm_topk_prob = true;
  mixtral.router_aux_loss_coef = 0.02;
  ModelConfig qmoe = moe_base();
  qmoe.mlp_only_layers = {1};
  qmoe.norm_topk_prob = true;
  for (const ModelConfig& c : {preset("tiny"), qwen3, mixtral, qmoe}) {
    SCOPED_TRACE(c.architecture);
    EXPECT_NO_THROW(validate(c, "test"));
    const json hf = json::parse(to_hf_json(c));
    EXPECT_EQ(hf["architectures"], json::array({c.architecture}));
    ModelConfig h = parse_hf_config(hf.dump(), "'export'");
    h.name = c.name;
    EXPECT_TRUE(h == c) << canonical_json(h) << " vs " << canonical_json(c);
    EXPECT_TRUE(from_canonical_json(canonical_json(c)) == c);
    const bool is_mixtral = c.architecture == "MixtralForCausalLM", is_qmoe = c.architecture == "Qwen3MoeForCausalLM";
    EXPECT_EQ(hf.contains("num_local_experts"), is_mixtral);
    EXPECT_EQ(hf.contains("num_experts"), is_qmoe);
    EXPECT_EQ(hf.contains("moe_intermediate_size"), is_qmoe);
    EXPECT_EQ(hf.contains("num_experts_per_tok"), is_mixtral || is_qmoe);
    EXPECT_EQ(hf.contains("mlp_bias"), c.architecture == "LlamaForCausalLM");
    for (const char* k : {"architecture", "qk_norm"}) EXPECT_FALSE(hf.contains(k)) << k;
  }
  // A dense Llama's config.json and canonical JSON are the ones from before issue 56's rows.
  const json llama = json::parse(to_hf_json(preset("tiny")));
  EXPECT_EQ(llama["model_type"], "llama");
  for (const ModelConfigField& f : model_config_fields())
    if (f.by_architecture) {
      EXPECT_FALSE(llama.contains(f.key)) << f.key;
    }
}
