// Model config special ids: config.json forms (absent, integer, list), the canonical JSON contract
// (integer / array of >= 2 / null, older checkpoints' integers), and reconciling with a token file.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "shardtrain/config.h"

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
