// Model config special ids: config.json forms (absent, integer, list), the canonical JSON contract
// (integer / array of >= 2 / null, older checkpoints' integers), and reconciling with a token file.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"

using namespace shardtrain;
using json = nlohmann::json;

namespace {
std::string cfg(const std::string& ids) {
  return R"({"vocab_size": 300, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
             "num_attention_heads": 4)" + ids + "}";
}
ModelConfig parsed(const std::string& ids) {
  ModelConfig c = parse_hf_config(cfg(ids), "'cfg.json'");
  validate(c, "'cfg.json'");
  return c;
}
std::string refusal(const std::string& ids) {
  try {
    parsed(ids);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
const DataSpecialIds kTok{"token file 't.tok'", 258, 256, 257};
}  // namespace

TEST(Config, AbsentIdsAreUnsetNotLlamaDefaults) {
  ModelConfig c = parsed("");
  EXPECT_FALSE(c.has_bos());
  EXPECT_TRUE(c.eos_token_ids.empty());
  json j = json::parse(canonical_json(c));
  EXPECT_TRUE(j["bos_token_id"].is_null());
  EXPECT_TRUE(j["eos_token_id"].is_null());
  json hf = json::parse(to_hf_json(c));
  EXPECT_TRUE(hf["bos_token_id"].is_null());  // not absent: transformers would put 1 and 2 there
  EXPECT_TRUE(hf["eos_token_id"].is_null());
  EXPECT_EQ(canonical_json(from_canonical_json(canonical_json(c))), canonical_json(c));
  EXPECT_EQ(canonical_json(parsed(R"(, "bos_token_id": null, "eos_token_id": null)")), canonical_json(c));
}

TEST(Config, EosListKeptAsList) {
  ModelConfig c = parsed(R"(, "bos_token_id": 256, "eos_token_id": [257, 10, 299])");
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{257, 10, 299}));
  EXPECT_EQ(c.primary_eos(), 257);
  EXPECT_TRUE(c.is_eos(10) && c.is_eos(299) && !c.is_eos(256));
  EXPECT_EQ(json::parse(canonical_json(c))["eos_token_id"], json::parse("[257,10,299]"));
  EXPECT_EQ(json::parse(to_hf_json(c))["eos_token_id"], json::parse("[257,10,299]"));
  EXPECT_EQ(canonical_json(from_canonical_json(canonical_json(c))), canonical_json(c));
  // One id, as an integer or a one-element list, is written as an integer.
  ModelConfig one = parsed(R"(, "eos_token_id": [257])");
  EXPECT_EQ(json::parse(canonical_json(one))["eos_token_id"], json(257));
  EXPECT_EQ(canonical_json(one), canonical_json(parsed(R"(, "eos_token_id": 257)")));
}

TEST(Config, ReadsOlderCanonicalJson) {
  ModelConfig c = preset("tiny");
  json old = json::parse(canonical_json(c));
  old["bos_token_id"] = 256;  // what every earlier version wrote: two integers
  old["eos_token_id"] = 257;
  ModelConfig back = from_canonical_json(old.dump());
  EXPECT_EQ(back.bos_token_id, 256);
  EXPECT_EQ(back.eos_token_ids, std::vector<int>{257});
  EXPECT_EQ(canonical_json(back), old.dump());
}

TEST(Config, BadIdsRefusedNamingTheKey) {
  EXPECT_NE(refusal(R"(, "eos_token_id": [257, "x"])").find("key 'eos_token_id' must be an integer or a list"),
            std::string::npos);
  EXPECT_NE(refusal(R"(, "eos_token_id": [257, 1.5])").find("key 'eos_token_id'"), std::string::npos);
  EXPECT_NE(refusal(R"(, "eos_token_id": [257, 300])").find("key 'eos_token_id' = [257,300]: id 300 is outside the vocabulary"),
            std::string::npos);
  EXPECT_NE(refusal(R"(, "eos_token_id": [])").find("key 'eos_token_id' is an empty list"), std::string::npos);
  EXPECT_NE(refusal(R"(, "eos_token_id": [257, -1])").find("key 'eos_token_id' = -1 is outside"), std::string::npos);
  EXPECT_NE(refusal(R"(, "bos_token_id": -1)").find("key 'bos_token_id' = -1 is outside"), std::string::npos);
  EXPECT_NE(refusal(R"(, "bos_token_id": 300)").find("key 'bos_token_id' = 300 is outside the vocabulary"),
            std::string::npos);
  EXPECT_NE(refusal(R"(, "bos_token_id": "1")").find("key 'bos_token_id' must be an integer"), std::string::npos);
}

TEST(Config, ReconcileFillsUnsetIdsWithNotes) {
  ModelConfig c = parsed("");
  auto notes = reconcile_special_ids(c, "model config 'cfg.json'", kTok);
  EXPECT_EQ(c.bos_token_id, 256);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{257});
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_EQ(notes[0], "note: model config 'cfg.json' has no bos_token_id; using 256, the bos_id of token file 't.tok'");
  // Agreeing ids (an eos list containing the data's eos included) are left as they are, silently.
  ModelConfig l = parsed(R"(, "bos_token_id": 256, "eos_token_id": [10, 257])");
  EXPECT_TRUE(reconcile_special_ids(l, "model config 'cfg.json'", kTok).empty());
  EXPECT_EQ(l.eos_token_ids, (std::vector<int>{10, 257}));
}

TEST(Config, ReconcileDataWithoutBosLeavesBosAlone) {
  // GPT-2-style data (documents separated by EOS only, bos_id none): bos_token_id is neither
  // filled nor checked; the eos still is.
  const DataSpecialIds gpt2{"token file 'g.tok'", 258, -1, 257};
  ModelConfig unset = parsed("");
  auto notes = reconcile_special_ids(unset, "model config 'cfg.json'", gpt2);
  EXPECT_FALSE(unset.has_bos());
  EXPECT_EQ(unset.eos_token_ids, std::vector<int>{257});
  EXPECT_EQ(notes.size(), 1u);
  ModelConfig set = parsed(R"(, "bos_token_id": 257, "eos_token_id": 257)");
  EXPECT_TRUE(reconcile_special_ids(set, "model config 'cfg.json'", gpt2).empty());
  EXPECT_EQ(set.bos_token_id, 257);
}

TEST(Config, ReconcileRefusesConflicts) {
  auto why = [](const std::string& ids, DataSpecialIds d = kTok) {
    ModelConfig c = parsed(ids);
    try {
      reconcile_special_ids(c, "model config 'cfg.json'", d);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(why(R"(, "bos_token_id": 1)"),
            "model config 'cfg.json' has bos_token_id 1, but token file 't.tok' has bos_id 256: they must agree");
  EXPECT_EQ(why(R"(, "eos_token_id": 2)"),
            "model config 'cfg.json' has eos_token_id 2, but token file 't.tok' has eos_id 257: they must agree");
  EXPECT_EQ(why(R"(, "eos_token_id": [1, 2])"),
            "model config 'cfg.json' has eos_token_id [1,2], but token file 't.tok' has eos_id 257, which is not in "
            "the list: they must agree");
  EXPECT_NE(why("", DataSpecialIds{"token file 't.tok'", 301, 256, 257}).find("has vocab_size 301, more than"),
            std::string::npos);
  EXPECT_NE(why("", DataSpecialIds{"token file 't.tok'", 258, 256, 300}).find("eos_id 300 of token file 't.tok' is outside"),
            std::string::npos);
}

// ---- head_dim, RoPE scaling, published presets ----------------------------------------------
namespace {
const std::string kBase = R"("vocab_size": 128256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64)";
ModelConfig hf(const std::string& extra) {
  ModelConfig c = parse_hf_config("{" + kBase + extra + "}", "'cfg.json'");
  validate(c, "'cfg.json'");
  return c;
}
std::string hf_refusal(const std::string& extra) {
  try {
    hf(extra);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
const std::string kLlama3 = R"("factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
  "original_max_position_embeddings": 16)";
}  // namespace

TEST(Config, ExplicitHeadDim) {
  ModelConfig c = hf(R"(, "head_dim": 24)");
  EXPECT_EQ(c.head_dim(), 24);
  EXPECT_EQ(c.kv_dim(), 48);
  // q_proj [NH*HD, C] = [96, 64], k/v [48, 64], o_proj [64, 96]; embedding and head (untied).
  const int64_t C = 64, Q = 96, KV = 48, I = 96, V = 128256;
  EXPECT_EQ(c.num_params(), 2 * V * C + C + (2 * C + C * Q + 2 * C * KV + Q * C + 3 * C * I));
  EXPECT_EQ(json::parse(canonical_json(c))["head_dim"], json(24));
  EXPECT_EQ(json::parse(to_hf_json(c))["head_dim"], json(24));
  EXPECT_EQ(canonical_json(from_canonical_json(canonical_json(c))), canonical_json(c));
  EXPECT_EQ(from_canonical_json(canonical_json(c)).head_dim(), 24);
  // Given equal to hidden_size / num_attention_heads, absent, or null: the same config.
  EXPECT_EQ(canonical_json(hf(R"(, "head_dim": 16)")), canonical_json(hf("")));
  EXPECT_EQ(canonical_json(hf(R"(, "head_dim": null)")), canonical_json(hf("")));
  EXPECT_EQ(hf("").head_dim(), 16);
  // NH need not divide C when head_dim is given (hidden 50, 4 heads of 8).
  ModelConfig odd = parse_hf_config(R"({"vocab_size": 300, "hidden_size": 50, "intermediate_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 8})", "'x.json'");
  EXPECT_NO_THROW(validate(odd, "'x.json'"));
  EXPECT_NE(hf_refusal(R"(, "head_dim": 25)").find("key 'head_dim' = 25 is odd; RoPE needs pairs"), std::string::npos);
  EXPECT_NE(hf_refusal(R"(, "head_dim": 0)").find("'cfg.json': key 'head_dim' must be positive"), std::string::npos);
  EXPECT_NE(hf_refusal(R"(, "head_dim": -2)").find("key 'head_dim' must be positive"), std::string::npos);
}

TEST(Config, OlderCanonicalJsonHasNoHeadDimNorRopeScaling) {
  ModelConfig c = preset("tiny");
  json old = json::parse(canonical_json(c));
  old.erase("head_dim");
  old.erase("rope_scaling");
  ModelConfig back = from_canonical_json(old.dump());
  EXPECT_EQ(back.head_dim(), c.hidden_size / c.num_attention_heads);
  EXPECT_FALSE(back.rope_scaling.is_llama3());
  EXPECT_EQ(canonical_json(back), canonical_json(c));
  // A checkpoint of an older version holds such JSON: it matches the same model (resume, export).
  EXPECT_TRUE(architecture_differences(old.dump(), canonical_json(c)).empty());
  ModelConfig other = c;
  other.head_dim_override = 4;
  const auto diff = architecture_differences(old.dump(), canonical_json(other));
  ASSERT_EQ(diff.size(), 1u);
  EXPECT_EQ(diff[0], "head_dim: checkpoint has 8, requested 4");
  other = c;
  other.rope_scaling.rope_type = "llama3";
  other.rope_scaling.original_max_position_embeddings = 16;
  EXPECT_EQ(architecture_differences(old.dump(), canonical_json(other)).size(), 1u);
}

TEST(Config, Llama3RopeFromEveryConfigForm) {
  const ModelConfig v4 = hf(R"(, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", )" + kLlama3 + "}");
  const ModelConfig v4type = hf(R"(, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", )" + kLlama3 + "}");
  const ModelConfig v5 = hf(R"(, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, )" + kLlama3 + "}");
  const ModelConfig both = hf(R"(, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", )" + kLlama3 +
                              R"(}, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, )" + kLlama3 + "}");
  EXPECT_TRUE(v4.rope_scaling.is_llama3());
  EXPECT_EQ(v4.rope_theta, 500000.0);
  EXPECT_EQ(v4.rope_scaling.factor, 8.0);
  EXPECT_EQ(v4.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(v4.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(v4.rope_scaling.original_max_position_embeddings, 16);
  for (const ModelConfig* x : {&v4type, &v5, &both}) EXPECT_EQ(canonical_json(*x), canonical_json(v4));
  EXPECT_EQ(canonical_json(from_canonical_json(canonical_json(v4))), canonical_json(v4));
  json cj = json::parse(canonical_json(v4));
  EXPECT_EQ(cj["rope_scaling"], json::parse(R"({"rope_type": "llama3", )" + kLlama3 + "}"));
  // Default RoPE through rope_parameters: theta taken, no scaling; same as the top-level key.
  const ModelConfig d5 = hf(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0})");
  EXPECT_FALSE(d5.rope_scaling.is_llama3());
  EXPECT_EQ(canonical_json(d5), canonical_json(hf(R"(, "rope_theta": 20000.0, "rope_scaling": null)")));
  EXPECT_TRUE(json::parse(canonical_json(d5))["rope_scaling"].is_null());
  // The HF config written on export reads back to the same config.
  for (const ModelConfig* x : {&v4, &d5}) {
    ModelConfig r = parse_hf_config(to_hf_json(*x), "'export'");
    r.name = x->name;
    EXPECT_EQ(canonical_json(r), canonical_json(*x));
  }
  json h = json::parse(to_hf_json(v4));
  EXPECT_EQ(h["rope_parameters"], json::parse(R"({"rope_type": "llama3", "rope_theta": 500000.0, )" + kLlama3 + "}"));
  EXPECT_EQ(h["rope_scaling"], json::parse(R"({"rope_type": "llama3", )" + kLlama3 + "}"));
  EXPECT_EQ(h["rope_theta"], json(500000.0));
  json h5 = json::parse(to_hf_json(d5));
  EXPECT_EQ(h5["rope_parameters"], json::parse(R"({"rope_type": "default", "rope_theta": 20000.0})"));
  EXPECT_TRUE(h5["rope_scaling"].is_null());
}

TEST(Config, OtherRopeTypesRefusedNamingTheKey) {
  for (const char* t : {"linear", "dynamic", "yarn", "longrope"}) {
    const std::string s(t);
    EXPECT_NE(hf_refusal(R"(, "rope_scaling": {"rope_type": ")" + s + R"(", "factor": 2.0})")
                  .find("Invalid model config 'cfg.json': key 'rope_scaling.rope_type' is \"" + s +
                        "\"; only \"default\" and \"llama3\" RoPE are supported"),
              std::string::npos)
        << t;
    EXPECT_NE(hf_refusal(R"(, "rope_scaling": {"type": ")" + s + R"(", "factor": 2.0})")
                  .find("key 'rope_scaling.type' is \"" + s + "\""),
              std::string::npos)
        << t;
    EXPECT_NE(hf_refusal(R"(, "rope_parameters": {"rope_type": ")" + s + R"(", "rope_theta": 1e4, "factor": 2.0})")
                  .find("'cfg.json': key 'rope_parameters.rope_type' is \"" + s + "\""),
              std::string::npos)
        << t;
  }
  EXPECT_NE(hf_refusal(R"(, "rope_scaling": {"factor": 2.0})").find("key 'rope_scaling' has no 'rope_type'"),
            std::string::npos);
  EXPECT_NE(hf_refusal(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0})")
                .find("key 'rope_scaling.low_freq_factor' is missing"),
            std::string::npos);
  EXPECT_NE(hf_refusal(R"(, "rope_scaling": {"rope_type": "llama3", )" + kLlama3 +
                       R"(}, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0})")
                .find("disagree"),
            std::string::npos);
  EXPECT_NE(hf_refusal(R"(, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 1.0})")
                .find("high_freq_factor"),
            std::string::npos);
  EXPECT_NE(hf_refusal(R"(, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5})")
                .find("key 'rope_parameters.partial_rotary_factor' = 0.5 is not supported"),
            std::string::npos);
}

// rope_inv_freqs against the rule of transformers' _compute_llama3_parameters, written out plainly
// here in double (the e2e test test_llama3_shapes.sh compares with transformers itself).
TEST(Config, RopeInvFreqsLlama3) {
  ModelConfig c = preset("llama-8b");  // head_dim 128, theta 500000, factor 8, 1 / 4, 8192
  const std::vector<double> got = rope_inv_freqs(c);
  ASSERT_EQ(got.size(), 64u);
  int low = 0, high = 0, mid = 0;
  for (int j = 0; j < 64; ++j) {
    const double f = std::pow(500000.0, -(2.0 * j) / 128.0), wl = 2 * 3.141592653589793 / f;
    double want;
    if (wl < 8192.0 / 4.0) {
      want = f, ++high;
    } else if (wl > 8192.0 / 1.0) {
      want = f / 8.0, ++low;
    } else {
      const double s = (8192.0 / wl - 1.0) / (4.0 - 1.0);
      want = (1 - s) * f / 8.0 + s * f, ++mid;
    }
    EXPECT_NEAR(got[j], want, 1e-15 * want) << "pair " << j;
  }
  EXPECT_GT(low, 0);
  EXPECT_GT(mid, 0);
  EXPECT_GT(high, 0);
  // transformers 5.24 itself (ROPE_INIT_FUNCTIONS["llama3"] for Llama-3.1-8B's config), computed
  // once: it works in float32, hence the tolerance. Pairs 29-34 are the interpolated ones.
  for (auto [j, hf] : std::initializer_list<std::pair<int, double>>{
           {0, 1.0}, {20, 0.016560440883040428}, {28, 0.0032114461064338684}, {29, 0.0021665706299245358},
           {32, 0.0005248460220173001}, {34, 0.0001785077911335975}, {35, 9.556212171446532e-05},
           {40, 3.428102354519069e-05}, {63, 3.068925877869333e-07}})
    EXPECT_NEAR(got[j], hf, 2e-6 * hf) << "pair " << j;
  // Without scaling: theta^(-2j/HD) exactly as before (1 / pow).
  c.rope_scaling = RopeScaling{};
  const std::vector<double> plain = rope_inv_freqs(c);
  for (int j = 0; j < 64; ++j) EXPECT_EQ(plain[j], 1.0 / std::pow(500000.0, static_cast<double>(2 * j) / 128.0));
  // head_dim given: HD/2 pairs of that head_dim.
  ModelConfig e = hf(R"(, "head_dim": 24)");
  EXPECT_EQ(rope_inv_freqs(e).size(), 12u);
}

// Parameter counts of the published models (model cards / safetensors index totals), checked
// independently with transformers: LlamaForCausalLM(config) on the meta device, sum of numel()
// over parameters() (a tied head counted once). Arithmetic for Llama-3.2-1B:
// 128256*2048 + 16*(2*2048 + 2*2048*2048 + 2*2048*512 + 3*2048*8192) + 2048 = 1,235,814,400.
TEST(Config, PublishedPresets) {
  struct Want {
    const char* name;
    int64_t params;
    int V, C, I, L, NH, NKV, maxpos, bos, eos;
    bool tied;
    double theta, factor;
  };
  for (const Want& w : {Want{"llama-1b", 1'235'814'400, 128256, 2048, 8192, 16, 32, 8, 131072, 128000, 128001, true,
                             500000.0, 32.0},
                        Want{"tinyllama-1.1b", 1'100'048'384, 32000, 2048, 5632, 22, 32, 4, 2048, 1, 2, false, 10000.0,
                             0.0},
                        Want{"llama-8b", 8'030'261'248, 128256, 4096, 14336, 32, 32, 8, 131072, 128000, 128001, false,
                             500000.0, 8.0},
                        // transformers 4.x, LlamaForCausalLM on the meta device: 70,553,706,496
                        Want{"llama-70b", 70'553'706'496, 128256, 8192, 28672, 80, 64, 8, 131072, 128000, 128001, false,
                             500000.0, 8.0},
                        // transformers 5.24 on the meta device: 405,853,388,800
                        Want{"llama-405b", 405'853'388'800, 128256, 16384, 53248, 126, 128, 8, 131072, 128000, 128001,
                             false, 500000.0, 8.0}}) {
    const ModelConfig c = preset(w.name);
    EXPECT_NO_THROW(validate(c, w.name));
    EXPECT_EQ(c.num_params(), w.params) << w.name;
    EXPECT_EQ(c.vocab_size, w.V) << w.name;
    EXPECT_EQ(c.hidden_size, w.C) << w.name;
    EXPECT_EQ(c.intermediate_size, w.I) << w.name;
    EXPECT_EQ(c.num_hidden_layers, w.L) << w.name;
    EXPECT_EQ(c.num_attention_heads, w.NH) << w.name;
    EXPECT_EQ(c.num_key_value_heads, w.NKV) << w.name;
    EXPECT_EQ(c.head_dim(), w.C / w.NH) << w.name;
    EXPECT_EQ(c.max_position_embeddings, w.maxpos) << w.name;
    EXPECT_EQ(c.bos_token_id, w.bos) << w.name;
    EXPECT_EQ(c.eos_token_ids, std::vector<int>{w.eos}) << w.name;
    EXPECT_EQ(c.tie_word_embeddings, w.tied) << w.name;
    EXPECT_EQ(c.rope_theta, w.theta) << w.name;
    EXPECT_EQ(c.rms_norm_eps, 1e-5) << w.name;
    EXPECT_EQ(c.rope_scaling.is_llama3(), w.factor > 0) << w.name;
    if (w.factor > 0) {
      EXPECT_EQ(c.rope_scaling.factor, w.factor) << w.name;
      EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0) << w.name;
      EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0) << w.name;
      EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192) << w.name;
    }
  }
}
