// Model config: presets, Hugging Face config.json parsing, validation, canonical JSON, broadcast.
#include "shardtrain/model/config.h"
#include "shardtrain/runtime/files.h"
#include "shardtrain/runtime/json_input.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <climits>
#include <cstdint>

#include "shardtrain/runtime/runtime.h"

namespace shardtrain {
using json = nlohmann::json;

namespace {
// How many l in [0, num_hidden_layers) is_moe_layer(l) holds for, without a loop over the layers (a
// crafted num_hidden_layers may be 2^31): every decoder_sparse_step-th, less the mlp_only_layers
// among them.
int64_t count_moe_layers(const ModelConfig& c) {
  if (c.num_experts <= 0 || c.decoder_sparse_step <= 0 || c.num_hidden_layers <= 0) return 0;
  int64_t n = c.num_hidden_layers / c.decoder_sparse_step;
  std::vector<int> dense = c.mlp_only_layers;
  std::sort(dense.begin(), dense.end());
  dense.erase(std::unique(dense.begin(), dense.end()), dense.end());
  for (int l : dense) n -= l >= 0 && l < c.num_hidden_layers && (static_cast<int64_t>(l) + 1) % c.decoder_sparse_step == 0;
  return n;
}

// Parameters of the model with `experts` experts of each MoE layer counted (num_experts: all of
// them; num_experts_per_tok: what one token uses), in 128 bits, saturated: a config from a file may
// hold any int sizes (validate refuses them).
int64_t count_params(const ModelConfig& c, int64_t experts) {
  __extension__ using i128 = __int128;
  const i128 C = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, E = c.num_experts;
  const i128 q = static_cast<i128>(c.num_attention_heads) * c.head_dim(), kv = c.kv_dim();
  const i128 attention = 2 * C + C * q + 2 * C * kv + q * C + (c.qk_norm ? 2 * static_cast<i128>(c.head_dim()) : 0);
  // MoE layers: every decoder_sparse_step-th, less the mlp_only_layers among them (counted without
  // a loop over the layers: a crafted num_hidden_layers may be 2^31).
  const i128 L = std::max(c.num_hidden_layers, 0), moe = count_moe_layers(c);
  const i128 n = V * C + C + (c.tie_word_embeddings ? 0 : V * C) + L * attention + (L - moe) * 3 * C * I +
                 moe * (C * E + experts * 3 * C * c.moe_intermediate_size);
  return n > INT64_MAX ? INT64_MAX : static_cast<int64_t>(n);
}
}  // namespace

int64_t ModelConfig::num_params() const { return count_params(*this, num_experts); }
int64_t ModelConfig::num_active_params() const { return count_params(*this, num_experts_per_tok); }

int64_t ModelConfig::num_moe_layers() const { return count_moe_layers(*this); }

bool ModelConfig::is_moe_layer(int l) const {
  return num_experts > 0 && decoder_sparse_step > 0 && (static_cast<int64_t>(l) + 1) % decoder_sparse_step == 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) == mlp_only_layers.end();
}

std::vector<double> rope_inv_freqs(const ModelConfig& c) {
  const int HD = c.head_dim(), half = HD / 2;
  std::vector<double> f(static_cast<size_t>(std::max(half, 0)));
  const RopeScaling& r = c.rope_scaling;
  const double pi = 3.14159265358979323846;
  for (int j = 0; j < half; ++j) {
    const double base = 1.0 / std::pow(c.rope_theta, static_cast<double>(2 * j) / static_cast<double>(HD));
    double v = base;
    if (r.is_llama3()) {
      const double old_len = r.original_max_position_embeddings;
      const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
      const double wavelen = 2 * pi / base;
      if (wavelen > low_wavelen) {
        v = base / r.factor;
      } else if (!(wavelen < high_wavelen)) {  // medium: interpolate
        const double s = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        v = (1 - s) * base / r.factor + s * base;
      }
    }
    f[static_cast<size_t>(j)] = v;
  }
  return f;
}

bool ModelConfig::is_eos(int64_t id) const {
  return std::find(eos_token_ids.begin(), eos_token_ids.end(), id) != eos_token_ids.end();
}

namespace {
ModelConfig make(const std::string& name, int V, int C, int I, int L, int NH, int NKV, int maxpos, bool tied) {
  ModelConfig c;
  c.name = name;
  c.vocab_size = V;
  c.hidden_size = C;
  c.intermediate_size = I;
  c.num_hidden_layers = L;
  c.num_attention_heads = NH;
  c.num_key_value_heads = NKV;
  c.max_position_embeddings = maxpos;
  c.tie_word_embeddings = tied;
  return c;
}

// Published models, numbers from their config.json on the Hugging Face Hub.
ModelConfig published(const std::string& name, int V, int C, int I, int L, int NH, int NKV, int maxpos, bool tied,
                      double theta, double eps, int bos, int eos, RopeScaling rs = {}) {
  ModelConfig c = make(name, V, C, I, L, NH, NKV, maxpos, tied);
  c.rope_theta = theta;
  c.rms_norm_eps = eps;
  c.bos_token_id = bos;
  c.eos_token_ids = {eos};
  c.rope_scaling = rs;
  return c;
}
RopeScaling llama3_rope(double factor) {
  RopeScaling r;
  r.rope_type = "llama3";
  r.factor = factor;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_position_embeddings = 8192;
  return r;
}

// A published MoE model: `c` with E experts of width moe_I, top k, renormalized, aux coefficient
// `coef` (the hub's config.json).
ModelConfig with_experts(ModelConfig c, const char* arch, int E, int k, int moe_I, double coef) {
  c.architecture = arch;
  c.qk_norm = std::string(arch) == "Qwen3MoeForCausalLM";
  c.num_experts = E;
  c.num_experts_per_tok = k;
  c.moe_intermediate_size = moe_I;
  c.norm_topk_prob = true;
  c.router_aux_loss_coef = coef;
  return c;
}
ModelConfig with_head_dim(ModelConfig c, int HD) {
  c.head_dim_override = HD;
  return c;
}

const std::map<std::string, ModelConfig>& presets() {
  static const std::map<std::string, ModelConfig> p = {
      // Tests: small, GQA 4:2.
      {"tiny", make("tiny", 258, 32, 64, 2, 4, 2, 64, true)},
      // Tests: every unit size is uneven over 3 ranks and over 4 ranks (C = 50, V = 263, I = 37);
      // GQA 5:1.
      {"test-uneven", make("test-uneven", 263, 50, 37, 2, 5, 1, 64, true)},
      // Tests of tensor parallelism (--tp 2, 3, 4, 6 divide the 24 heads, the 12 KV heads (GQA 2:1)
      // and I = 72; V = 263 is padded at every TP degree), tied and untied.
      {"test-tp", make("test-tp", 263, 96, 72, 2, 24, 12, 64, true)},
      {"test-tp-untied", make("test-tp-untied", 263, 96, 72, 2, 24, 12, 64, false)},
      // make demo and the tinyshakespeare benchmark: ~0.85M parameters.
      {"demo", make("demo", 258, 128, 384, 4, 4, 4, 256, true)},
      // GPU-scale configs for the benchmarks (docs/benchmarks.md), GPT-2-small / -medium sized.
      {"llama-125m", make("llama-125m", 32000, 768, 2048, 12, 12, 12, 2048, true)},
      {"llama-350m", make("llama-350m", 32000, 1024, 2816, 24, 16, 16, 2048, true)},
      // Billion-parameter models, shaped as published (weights can come from --mode import):
      // meta-llama/Llama-3.2-1B config.json: 1,235,814,400 parameters (tied head).
      {"llama-1b", published("llama-1b", 128256, 2048, 8192, 16, 32, 8, 131072, true, 500000.0, 1e-5, 128000, 128001,
                             llama3_rope(32.0))},
      // TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json: 1,100,048,384 parameters.
      {"tinyllama-1.1b", published("tinyllama-1.1b", 32000, 2048, 5632, 22, 32, 4, 2048, false, 10000.0, 1e-5, 1, 2)},
      // meta-llama/Llama-3.1-8B config.json: 8,030,261,248 parameters.
      {"llama-8b", published("llama-8b", 128256, 4096, 14336, 32, 32, 8, 131072, false, 500000.0, 1e-5, 128000, 128001,
                             llama3_rope(8.0))},
      // meta-llama/Llama-3.1-70B config.json: 70,553,706,496 parameters (issue 31's tensor-parallel
      // plans; weights from --mode import).
      {"llama-70b", published("llama-70b", 128256, 8192, 28672, 80, 64, 8, 131072, false, 500000.0, 1e-5, 128000, 128001,
                              llama3_rope(8.0))},
      // meta-llama/Llama-3.1-405B config.json: 405,853,388,800 parameters (issue 42's pipeline plans).
      {"llama-405b", published("llama-405b", 128256, 16384, 53248, 126, 128, 8, 131072, false, 500000.0, 1e-5, 128000,
                               128001, llama3_rope(8.0))},
      // Tests: tiny's shape with a Mixtral mixture of 8 experts (top 2; Mixtral's experts are
      // intermediate_size wide) in both blocks; --ep 2, 4 and 8 divide its experts.
      {"tiny-moe", with_experts(make("tiny-moe", 258, 32, 64, 2, 4, 2, 64, true), "MixtralForCausalLM", 8, 2, 64, 0.02)},
      // Mixture-of-experts (issue 56): parameter counts from transformers 5.24 on the meta device.
      // mistralai/Mixtral-8x7B-v0.1 config.json.
      // (MixtralConfig's router_aux_loss_coef default is 0.001; the hub's config.json says 0.02.)
      {"mixtral-8x7b", with_experts(published("mixtral-8x7b", 32000, 4096, 14336, 32, 32, 8, 32768, false, 1e6, 1e-5,
                                              1, 2),
                                    "MixtralForCausalLM", 8, 2, 14336, 0.02)},
      // Qwen/Qwen3-30B-A3B config.json (head_dim 128: q_proj is [4096, 2048]).
      {"qwen3-30b-a3b", with_experts(with_head_dim(published("qwen3-30b-a3b", 151936, 2048, 6144, 48, 32, 4, 40960,
                                                             false, 1e6, 1e-6, 151643, 151645),
                                                   128),
                                     "Qwen3MoeForCausalLM", 128, 8, 768, 0.001)},
  };
  return p;
}

// source "" = the canonical JSON (from_canonical_json), which only a damaged file gets wrong.
[[noreturn]] void bad(const std::string& source, const std::string& what) {
  if (source.empty()) throw std::invalid_argument("canonical model config is malformed: " + what);
  throw std::invalid_argument("Invalid model config " + source + ": " + what);
}

// Reads key as T, strictly: an int must be a JSON integer in int range (no floats, no booleans),
// a double any JSON number, a bool a JSON boolean, a string a JSON string. Messages name the key
// as `shown` when given (e.g. "rope_parameters.factor").
template <typename T>
T get_or(const json& j, const char* lookup, T dflt, const std::string& source, const std::string& shown = "") {
  if (!j.contains(lookup) || j[lookup].is_null()) return dflt;
  const std::string name = shown.empty() ? std::string(lookup) : shown;
  const char* key = name.c_str();
  const json& v = j[lookup];
  if constexpr (std::is_same_v<T, int>) {
    if (!v.is_number_integer())
      bad(source, std::string("key '") + key + "' must be an integer, got " + v.dump());
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX)
                               : (v.get<int64_t>() > INT32_MAX || v.get<int64_t>() < INT32_MIN))
      bad(source, std::string("key '") + key + "' = " + v.dump() + " is out of range");
    return static_cast<int>(v.get<int64_t>());
  } else if constexpr (std::is_same_v<T, double>) {
    if (!v.is_number()) bad(source, std::string("key '") + key + "' must be a number, got " + v.dump());
    return v.get<double>();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) bad(source, std::string("key '") + key + "' must be true or false, got " + v.dump());
    return v.get<bool>();
  } else {
    if (!v.is_string()) bad(source, std::string("key '") + key + "' must be a string, got " + v.dump());
    return v.get<std::string>();
  }
}

// A special id as config.json has it: absent or null -> kUnsetTokenId, else a non-negative int.
int parse_token_id(const json& j, const char* key, const std::string& source) {
  int id = get_or<int>(j, key, kUnsetTokenId, source);
  if (j.contains(key) && !j[key].is_null() && id < 0)
    bad(source, std::string("key '") + key + "' = " + std::to_string(id) + " is outside the vocabulary (ids are >= 0)");
  return id;
}

// eos_token_id: absent or null -> {}, an integer -> {id}, a non-empty list of integers -> the list.
std::vector<int> parse_eos_ids(const json& j, const std::string& source) {
  const char* key = "eos_token_id";
  if (!j.contains(key) || j[key].is_null()) return {};
  const json& v = j[key];
  if (!v.is_array()) return {parse_token_id(j, key, source)};
  if (v.empty()) bad(source, "key 'eos_token_id' is an empty list; give one id, a list of ids, or leave the key out");
  std::vector<int> ids;
  for (const json& e : v) {
    if (!e.is_number_integer())
      bad(source, "key 'eos_token_id' must be an integer or a list of integers, got " + v.dump() + " (element " +
                      e.dump() + ")");
    ids.push_back(parse_token_id(json{{key, e}}, key, source));
  }
  return ids;
}

void check_llama3_rope(const RopeScaling& r, const std::string& key, const std::string& source);

// One RoPE settings object, config.json's `key` ("rope_scaling" of transformers 4.x or
// "rope_parameters" of 5.x): its type (rope_type, or the older "type"; `dflt_type` when neither),
// its rope_theta when it has one, and the llama3 parameters. Refuses other types naming the key.
void parse_rope_object(const json& o, const std::string& key, const std::string& dflt_type, int max_pos,
                       double& theta, RopeScaling& rs, const std::string& source) {
  if (!o.is_object()) bad(source, "key '" + key + "' must be an object or null, got " + o.dump());
  const char* type_key = o.contains("rope_type") ? "rope_type" : "type";
  if (dflt_type.empty() && (!o.contains(type_key) || o[type_key].is_null()))
    bad(source, "key '" + key + "' has no 'rope_type' (or 'type'); only \"default\" and \"llama3\" RoPE are supported");
  rs = RopeScaling{};
  rs.rope_type = get_or<std::string>(o, type_key, dflt_type, source, key + "." + type_key);
  if (rs.rope_type != "default" && rs.rope_type != "llama3")
    bad(source, "key '" + key + "." + type_key + "' is \"" + rs.rope_type +
                    "\"; only \"default\" and \"llama3\" RoPE are supported");
  theta = get_or<double>(o, "rope_theta", theta, source, key + ".rope_theta");
  const double prf = get_or<double>(o, "partial_rotary_factor", 1.0, source, key + ".partial_rotary_factor");
  if (prf != 1.0) bad(source, "key '" + key + ".partial_rotary_factor' = " + o["partial_rotary_factor"].dump() +
                                  " is not supported (RoPE over the whole head only)");
  if (!rs.is_llama3()) {
    rs = RopeScaling{};
    return;
  }
  for (const char* k : {"factor", "low_freq_factor", "high_freq_factor"})
    if (!o.contains(k) || o[k].is_null()) bad(source, "key '" + key + "." + k + "' is missing (rope_type \"llama3\")");
  rs.factor = get_or<double>(o, "factor", 1.0, source, key + ".factor");
  rs.low_freq_factor = get_or<double>(o, "low_freq_factor", 1.0, source, key + ".low_freq_factor");
  rs.high_freq_factor = get_or<double>(o, "high_freq_factor", 4.0, source, key + ".high_freq_factor");
  // transformers >= 5 falls back to max_position_embeddings (standardize_rope_params).
  rs.original_max_position_embeddings =
      get_or<int>(o, "original_max_position_embeddings", max_pos, source, key + ".original_max_position_embeddings");
  check_llama3_rope(rs, key, source);  // here, before validate(), so that the message names `key`
}

json rope_scaling_json(const RopeScaling& r) {
  if (!r.is_llama3()) return nullptr;
  return json{{"rope_type", r.rope_type},
              {"factor", r.factor},
              {"low_freq_factor", r.low_freq_factor},
              {"high_freq_factor", r.high_freq_factor},
              {"original_max_position_embeddings", r.original_max_position_embeddings}};
}

json bos_json(const ModelConfig& c) { return c.has_bos() ? json(c.bos_token_id) : json(nullptr); }
json eos_json(const ModelConfig& c) {
  if (c.eos_token_ids.empty()) return nullptr;
  if (c.eos_token_ids.size() == 1) return c.eos_token_ids.front();
  return c.eos_token_ids;
}
std::string eos_str(const ModelConfig& c) { return eos_json(c).dump(); }

// ---- the field table ----------------------------------------------------------------------------
// One row per ModelConfig member: its key, how config.json and the canonical JSON give it, how it
// is written, and its own checks. parse_hf_config, validate, canonical_json, from_canonical_json,
// to_hf_json and (through model_config_fields) architecture_differences iterate these rows and
// name no field themselves. Rows are visited in order: a row may read the fields of rows above it
// (num_key_value_heads defaults to num_attention_heads; head_dim's checks need the sizes).
struct Field {
  ModelConfigField info;
  std::function<json(const ModelConfig&)> get;  // the canonical (and config.json) value
  // Sets the member from the key's value `v` (present; null where the field has an unset or default
  // meaning, an error otherwise), strictly; errors name `source` and the key ("" = canonical JSON).
  std::function<void(ModelConfig&, const json& v, const std::string& source)> set;
  // config.json: required (the key must be present; null reads as 0), or what absence / null means.
  bool hf_required = false;
  std::function<void(ModelConfig&)> hf_absent;
  // config.json: reads the row from the whole object instead of from its key (RoPE's two forms).
  std::function<void(ModelConfig&, const json& j, const std::string& source)> hf_read;
  // Canonical JSON: true for keys that older versions did not write (absent: the member's default).
  bool canonical_optional = false;
  // Canonical JSON and config.json: the key is written only when the value differs from a default
  // ModelConfig's (the rows of issue 56, so that a dense Llama's JSON is what it was before them).
  bool omit_default = false;
  // config.json: writes the row (keys that depend on the architecture) instead of key = get(c).
  std::function<void(const ModelConfig&, json& j)> hf_write;
  std::function<void(const ModelConfig&, const std::string& source)> check;  // validate(); may be empty
};

using Check = std::function<void(const ModelConfig&, const std::string&)>;

// A plain member read with get_or's strict typing; config.json's default `hf_default`.
template <typename V>
Field scalar(const char* key, V ModelConfig::*m, V hf_default, Check check = {}, bool architecture = true) {
  Field f;
  f.info = {key, true, architecture, false};
  f.get = [m](const ModelConfig& c) { return json(c.*m); };
  f.set = [m, key](ModelConfig& c, const json& v, const std::string& source) {
    if (v.is_null()) bad(source, std::string("key '") + key + "' must not be null");
    c.*m = get_or<V>(json{{key, v}}, key, V{}, source);
  };
  f.hf_absent = [m, hf_default](ModelConfig& c) { c.*m = hf_default; };
  f.check = std::move(check);
  return f;
}
// A size config.json must give (vocab_size, ...): required there, positive.
Field size(const char* key, int ModelConfig::*m, bool hf_required) {
  Field f = scalar<int>(key, m, 0, [m, key](const ModelConfig& c, const std::string& source) {
    if (c.*m <= 0) bad(source, std::string("key '") + key + "' must be positive, got " + std::to_string(c.*m));
  });
  f.hf_required = hf_required;
  return f;
}
Check positive_real(const char* key, double ModelConfig::*m) {
  return [m, key](const ModelConfig& c, const std::string& source) {
    if (!(c.*m > 0)) bad(source, std::string("key '") + key + "' must be > 0");
  };
}

// head_dim as given: equal to the derived hidden_size / num_attention_heads it is kept as "not
// given" (the same model), so head_dim_override stays 0.
void set_head_dim(ModelConfig& c, const json& v, const std::string& source) {
  if (v.is_null()) {
    c.head_dim_override = 0;
    return;
  }
  const int hd = get_or<int>(json{{"head_dim", v}}, "head_dim", 0, source);
  if (hd <= 0) bad(source, "key 'head_dim' must be positive, got " + std::to_string(hd));
  const bool derived = c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0 &&
                       hd == c.hidden_size / c.num_attention_heads;
  c.head_dim_override = derived ? 0 : hd;
}

// RoPE in config.json: transformers 4.x writes top-level rope_theta and rope_scaling (null or
// {rope_type or type, ...}); transformers >= 5 writes rope_parameters {rope_type, rope_theta, ...}.
// Both may be present (shardtrain's export writes both): then they must say the same. Sets
// rope_scaling and, from rope_parameters, rope_theta (read by its own row above).
void hf_read_rope(ModelConfig& c, const json& j, const std::string& source) {
  if (get_or<double>(j, "partial_rotary_factor", 1.0, source) != 1.0)
    bad(source, "key 'partial_rotary_factor' = " + j["partial_rotary_factor"].dump() + " is not supported");
  const bool has_rs = j.contains("rope_scaling") && !j["rope_scaling"].is_null();
  const bool has_rp = j.contains("rope_parameters") && !j["rope_parameters"].is_null();
  double theta_rs = c.rope_theta, theta_rp = c.rope_theta;
  RopeScaling rs, rp;
  if (has_rs) parse_rope_object(j["rope_scaling"], "rope_scaling", "", c.max_position_embeddings, theta_rs, rs, source);
  if (has_rp) parse_rope_object(j["rope_parameters"], "rope_parameters", "default", c.max_position_embeddings, theta_rp, rp, source);
  if (has_rs && has_rp && (theta_rs != theta_rp || rope_scaling_json(rs) != rope_scaling_json(rp)))
    bad(source, "keys 'rope_scaling' " + json{{"rope_theta", theta_rs}, {"rope_scaling", rope_scaling_json(rs)}}.dump() +
                    " and 'rope_parameters' " + json{{"rope_theta", theta_rp}, {"rope_scaling", rope_scaling_json(rp)}}.dump() +
                    " disagree");
  c.rope_theta = has_rp ? theta_rp : theta_rs;
  c.rope_scaling = has_rp ? rp : rs;
}
// The canonical form: null, or {"factor", "high_freq_factor", "low_freq_factor",
// "original_max_position_embeddings", "rope_type"}, every key required.
void set_rope_scaling(ModelConfig& c, const json& v, const std::string& source) {
  c.rope_scaling = RopeScaling{};
  if (v.is_null()) return;
  if (!v.is_object()) bad(source, "key 'rope_scaling' must be an object or null, got " + v.dump());
  for (const char* k : {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
    if (!v.contains(k)) bad(source, std::string("key 'rope_scaling.") + k + "' is missing");
  RopeScaling& r = c.rope_scaling;
  r.rope_type = get_or<std::string>(v, "rope_type", "", source, "rope_scaling.rope_type");
  r.factor = get_or<double>(v, "factor", 0.0, source, "rope_scaling.factor");
  r.low_freq_factor = get_or<double>(v, "low_freq_factor", 0.0, source, "rope_scaling.low_freq_factor");
  r.high_freq_factor = get_or<double>(v, "high_freq_factor", 0.0, source, "rope_scaling.high_freq_factor");
  r.original_max_position_embeddings =
      get_or<int>(v, "original_max_position_embeddings", 0, source, "rope_scaling.original_max_position_embeddings");
}
// The llama3 parameters' ranges, messages naming config.json's `key` ("rope_scaling" or
// "rope_parameters"): the form the user wrote is the one named.
void check_llama3_rope(const RopeScaling& r, const std::string& key, const std::string& source) {
  if (!(r.factor >= 1)) bad(source, "key '" + key + ".factor' must be >= 1, got " + json(r.factor).dump());
  if (!(r.low_freq_factor > 0)) bad(source, "key '" + key + ".low_freq_factor' must be > 0, got " + json(r.low_freq_factor).dump());
  if (!(r.high_freq_factor > r.low_freq_factor))
    bad(source, "key '" + key + ".high_freq_factor' (" + json(r.high_freq_factor).dump() +
                    ") must be greater than low_freq_factor (" + json(r.low_freq_factor).dump() + ")");
  if (r.original_max_position_embeddings <= 0)
    bad(source, "key '" + key + ".original_max_position_embeddings' must be positive, got " +
                    std::to_string(r.original_max_position_embeddings));
}
void check_rope_scaling(const ModelConfig& c, const std::string& source) {
  const RopeScaling& r = c.rope_scaling;
  if (r.rope_type != "default" && r.rope_type != "llama3")
    bad(source, "rope type \"" + r.rope_type + "\" is not supported (\"default\" or \"llama3\")");
  if (r.is_llama3()) check_llama3_rope(r, "rope_scaling", source);
}
void check_head_dim(const ModelConfig& c, const std::string& source) {
  if (c.head_dim_override < 0) bad(source, "key 'head_dim' must be positive, got " + std::to_string(c.head_dim_override));
  if (c.head_dim_override == 0 && c.hidden_size % c.num_attention_heads != 0)
    bad(source, "num_attention_heads (" + std::to_string(c.num_attention_heads) + ") does not divide hidden_size (" +
                    std::to_string(c.hidden_size) + ") and config.json gives no head_dim");
  if (c.head_dim() <= 0) bad(source, "head_dim = hidden_size / num_attention_heads = 0; it must be positive");
  if (c.head_dim() % 2 != 0)
    bad(source, (c.head_dim_override > 0 ? "key 'head_dim' = " : "head_dim = hidden_size / num_attention_heads = ") +
                    std::to_string(c.head_dim()) + " is odd; RoPE needs pairs");
}

// ---- architectures beside Llama (issue 56) -------------------------------------------------------
// config.json's "model_type" of each architecture (transformers' config classes).
const char* model_type_of(const std::string& arch) {
  if (arch == "Qwen3ForCausalLM") return "qwen3";
  if (arch == "MixtralForCausalLM") return "mixtral";
  if (arch == "Qwen3MoeForCausalLM") return "qwen3_moe";
  return "llama";
}
bool is_qwen3(const std::string& arch) { return arch == "Qwen3ForCausalLM" || arch == "Qwen3MoeForCausalLM"; }
bool is_moe_arch(const std::string& arch) { return arch == "MixtralForCausalLM" || arch == "Qwen3MoeForCausalLM"; }
std::string known_architectures() {
  std::string k;
  for (const char* a : kArchitectures) k += std::string(k.empty() ? "" : ", ") + a;
  return k + " (and MistralForCausalLM, read as a Llama)";
}

void check_architecture(const ModelConfig& c, const std::string& source) {
  for (const char* a : kArchitectures)
    if (c.architecture == a) return;
  bad(source, "architecture \"" + c.architecture + "\" is not supported; expected one of " + known_architectures());
}

// "architectures" (the first supported entry; Mistral is a Llama while its sliding window does not
// cut the context, checked in parse_hf_config) and "model_type", which must agree; neither: Llama.
// Qwen2 has q/k/v biases, which this model does not have: refused by name.
void hf_read_architecture(ModelConfig& c, const json& j, const std::string& source) {
  const bool has_mt = j.contains("model_type") && j["model_type"].is_string();
  const std::string mt = has_mt ? j["model_type"].get<std::string>() : "";
  std::string arch;
  if (j.contains("architectures") && !j["architectures"].is_null()) {
    const json& as = j["architectures"];
    // The first supported entry, or the first whose model_type is the file's (a list naming two).
    std::string first;
    if (as.is_array() || as.is_string())  // a bare string, as one entry (read so before issue 56)
      for (const json& a : as.is_string() ? json::array({as}) : as) {
        if (!a.is_string()) continue;
        std::string n = a.get<std::string>();
        if (n == "MistralForCausalLM") n = "LlamaForCausalLM";
        if (std::find_if(std::begin(kArchitectures), std::end(kArchitectures), [&](const char* k) { return n == k; }) ==
            std::end(kArchitectures))
          continue;
        if (first.empty()) first = n;
        if (arch.empty() && has_mt && (mt == model_type_of(n) || (mt == "mistral" && n == "LlamaForCausalLM"))) arch = n;
      }
    if (arch.empty()) arch = first;
    if (arch.empty()) {
      const std::string extra = as.dump().find("Qwen2") != std::string::npos
                                    ? " (Qwen2 has q/k/v projection biases, e.g. tensor "
                                      "'model.layers.0.self_attn.q_proj.bias', which shardtrain's Llama does not have)"
                                    : "";
      bad(source, "architecture " + as.dump() + " is not supported; expected one of " + known_architectures() + extra);
    }
  } else if (has_mt) {
    for (const char* k : kArchitectures)
      if (mt == model_type_of(k)) arch = k;
    if (mt == "mistral") arch = "LlamaForCausalLM";
  }
  if (arch.empty()) arch = "LlamaForCausalLM";
  const std::string want = model_type_of(arch);
  if (has_mt && mt != want && !(arch == "LlamaForCausalLM" && mt == "mistral"))
    bad(source, "key 'model_type' is \"" + mt + "\", expected \"" + want + "\"" +
                    (arch == "LlamaForCausalLM" ? " or \"mistral\"" : "") + " for " + arch);
  c.architecture = arch;
}


// mlp_only_layers: a JSON array of integers (null or absent: none).
std::vector<int> parse_int_list(const json& v, const char* key, const std::string& source) {
  std::vector<int> out;
  if (v.is_null()) return out;
  if (!v.is_array()) bad(source, std::string("key '") + key + "' must be a list of integers, got " + v.dump());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = std::string(key) + "[" + std::to_string(i) + "]";
    if (v[i].is_null()) bad(source, "key '" + at + "' must be an integer, got null");
    out.push_back(get_or<int>(json{{key, v[i]}}, key, 0, source, at));
  }
  return out;
}

// A row of the MoE fields. config.json key per MoE architecture (nullptr: the architecture implies
// the value, `mixtral` / `qwen` below), with transformers' default where the key is absent
// (MixtralConfig, Qwen3MoeConfig); a dense architecture leaves the member at its default and must
// hold it (checked), whatever keys its config.json has.
template <typename V>
Field moe_row(const char* key, V ModelConfig::*m, const char* mixtral_key, V mixtral, const char* qwen_key, V qwen,
              Check check) {
  Field f;
  f.info = {key, false, true, false};
  f.info.by_architecture = true;
  f.get = [m](const ModelConfig& c) { return json(c.*m); };
  f.set = [m, key](ModelConfig& c, const json& v, const std::string& source) {
    if constexpr (std::is_same_v<V, std::vector<int>>) {
      c.*m = parse_int_list(v, key, source);
    } else {
      if (v.is_null()) bad(source, std::string("key '") + key + "' must not be null");
      c.*m = get_or<V>(json{{key, v}}, key, V{}, source);
    }
  };
  f.hf_read = [m, mixtral_key, mixtral, qwen_key, qwen](ModelConfig& c, const json& j, const std::string& source) {
    const bool mx = c.architecture == "MixtralForCausalLM", qw = c.architecture == "Qwen3MoeForCausalLM";
    if (!mx && !qw) return;
    const char* k = mx ? mixtral_key : qwen_key;
    const V d = mx ? mixtral : qwen;
    if (!k) {
      c.*m = d;
    } else if (j.contains(k) && j[k].is_null() && !std::is_same_v<V, std::vector<int>>) {
      bad(source, std::string("key '") + k + "' must not be null");  // transformers would not run with None either
    } else if constexpr (std::is_same_v<V, std::vector<int>>) {
      c.*m = j.contains(k) ? parse_int_list(j[k], k, source) : d;  // null: none (Qwen3MoeConfig)
    } else {
      c.*m = get_or<V>(j, k, d, source);
    }
  };
  f.hf_write = [m, mixtral_key, qwen_key](const ModelConfig& c, json& j) {
    const char* k = c.architecture == "MixtralForCausalLM" ? mixtral_key
                    : c.architecture == "Qwen3MoeForCausalLM" ? qwen_key : nullptr;
    if (k) j[k] = c.*m;
  };
  f.canonical_optional = f.omit_default = true;
  f.check = [m, key, check](const ModelConfig& c, const std::string& source) {
    if (!is_moe_arch(c.architecture)) {
      static const ModelConfig dflt;
      if (c.*m != dflt.*m)
        bad(source, std::string("key '") + key + "' = " + json(c.*m).dump() +
                        " applies to the mixture-of-experts architectures (MixtralForCausalLM, Qwen3MoeForCausalLM), "
                        "not " + c.architecture);
      return;
    }
    if (check) check(c, source);
  };
  return f;
}

void add_architecture_rows(std::vector<Field>& t) {
  {  // Qwen3's q/k norm: implied by the architecture
    Field f = scalar<bool>("qk_norm", &ModelConfig::qk_norm, false);
    f.info.in_hf_config = false;
    f.info.by_architecture = true;
    f.hf_read = [](ModelConfig& c, const json&, const std::string&) { c.qk_norm = is_qwen3(c.architecture); };
    f.hf_write = [](const ModelConfig&, json&) {};
    f.canonical_optional = f.omit_default = true;
    f.check = [](const ModelConfig& c, const std::string& source) {
      if (c.qk_norm != is_qwen3(c.architecture))
        bad(source, std::string("key 'qk_norm' = ") + (c.qk_norm ? "true" : "false") + " does not match architecture " +
                        c.architecture + " (Qwen3's have it, the others not)");
    };
    t.push_back(f);
  }
  const auto str = [](auto v) { return json(v).dump(); };
  {  // Both configs map num_experts onto num_local_experts (transformers' attribute_map): the hub's
     // Qwen3-MoE says num_experts, transformers 5 writes num_local_experts; either key, or both agreeing
    Field f = moe_row<int>("num_experts", &ModelConfig::num_experts, "num_local_experts", 8, "num_experts", 128,
                           [str](const ModelConfig& c, const std::string& source) {
                             if (c.num_experts <= 0)
                               bad(source, "the number of experts (num_local_experts / num_experts) must be positive, "
                                           "got " + str(c.num_experts));
                           });
    f.hf_read = [read = f.hf_read, str](ModelConfig& c, const json& j, const std::string& source) {
      read(c, j, source);  // the architecture's own key, or its default
      if (!is_moe_arch(c.architecture)) return;
      for (const char* k : {"num_local_experts", "num_experts"})
        if (j.contains(k) && j[k].is_null()) bad(source, std::string("key '") + k + "' must not be null");
      const bool local = j.contains("num_local_experts"), plain = j.contains("num_experts");
      if (!local || !plain) {
        if (local || plain) c.num_experts = get_or<int>(j, local ? "num_local_experts" : "num_experts", 0, source);
        return;
      }
      const int a = get_or<int>(j, "num_local_experts", 0, source), b = get_or<int>(j, "num_experts", 0, source);
      if (a != b)
        bad(source, "keys 'num_experts' (" + str(b) + ") and 'num_local_experts' (" + str(a) + ") disagree");
      c.num_experts = a;
    };
    t.push_back(f);
  }
  t.push_back(moe_row<int>("num_experts_per_tok", &ModelConfig::num_experts_per_tok, "num_experts_per_tok", 2,
                           "num_experts_per_tok", 8, [str](const ModelConfig& c, const std::string& source) {
                             if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.num_experts)
                               bad(source, "key 'num_experts_per_tok' = " + str(c.num_experts_per_tok) +
                                               " must be between 1 and the number of experts (" + str(c.num_experts) + ")");
                           }));
  {  // Mixtral's experts are intermediate_size wide (no key of their own)
    Field f = moe_row<int>("moe_intermediate_size", &ModelConfig::moe_intermediate_size, nullptr, 0,
                           "moe_intermediate_size", 768, [str](const ModelConfig& c, const std::string& source) {
                             if (c.moe_intermediate_size <= 0)
                               bad(source, "key 'moe_intermediate_size' must be positive, got " +
                                               str(c.moe_intermediate_size));
                             if (c.architecture == "MixtralForCausalLM" && c.moe_intermediate_size != c.intermediate_size)
                               bad(source, "MixtralForCausalLM's experts are intermediate_size (" +
                                               str(c.intermediate_size) + ") wide, not moe_intermediate_size " +
                                               str(c.moe_intermediate_size));
                           });
    f.hf_read = [read = f.hf_read](ModelConfig& c, const json& j, const std::string& source) {
      read(c, j, source);
      if (c.architecture == "MixtralForCausalLM") c.moe_intermediate_size = c.intermediate_size;
    };
    t.push_back(f);
  }
  t.push_back(moe_row<bool>("norm_topk_prob", &ModelConfig::norm_topk_prob, nullptr, true, "norm_topk_prob", false,
                            [](const ModelConfig& c, const std::string& source) {
                              if (c.architecture == "MixtralForCausalLM" && !c.norm_topk_prob)
                                bad(source, "MixtralForCausalLM always renormalizes its top-k weights "
                                            "(norm_topk_prob must be true)");
                            }));
  t.push_back(moe_row<double>("router_aux_loss_coef", &ModelConfig::router_aux_loss_coef, "router_aux_loss_coef",
                              0.001, "router_aux_loss_coef", 0.001, [](const ModelConfig& c, const std::string& source) {
                                if (!(c.router_aux_loss_coef >= 0 && std::isfinite(c.router_aux_loss_coef)))
                                  bad(source, "key 'router_aux_loss_coef' must be a finite number >= 0");
                              }));
  // The load-balancing loss's weight is a training setting: it does not change what the weights mean,
  // so a fine-tune or resume may change it (architecture_differences leaves it out).
  t.back().info.architecture = false;
  t.push_back(moe_row<int>("decoder_sparse_step", &ModelConfig::decoder_sparse_step, nullptr, 1, "decoder_sparse_step",
                           1, [str](const ModelConfig& c, const std::string& source) {
                             if (c.decoder_sparse_step <= 0)
                               bad(source, "key 'decoder_sparse_step' must be positive, got " + str(c.decoder_sparse_step));
                             if (c.architecture == "MixtralForCausalLM" && c.decoder_sparse_step != 1)
                               bad(source, "MixtralForCausalLM has experts on every layer (decoder_sparse_step 1)");
                           }));
  t.push_back(moe_row<std::vector<int>>(
      "mlp_only_layers", &ModelConfig::mlp_only_layers, nullptr, {}, "mlp_only_layers", {},
      [str](const ModelConfig& c, const std::string& source) {
        // (Messages name one layer and the list's length: a crafted list may hold a million.)
        std::vector<int> v = c.mlp_only_layers;
        std::sort(v.begin(), v.end());
        const std::string list = "key 'mlp_only_layers' (" + str(v.size()) + (v.size() == 1 ? " layer)" : " layers)");
        for (size_t i = 0; i < v.size(); ++i)
          if (v[i] < 0 || v[i] >= c.num_hidden_layers || (i > 0 && v[i] == v[i - 1]))
            bad(source, list + ": layer " + str(v[i]) +
                            (i > 0 && v[i] == v[i - 1] ? " is listed twice"
                                                       : " is not in [0, num_hidden_layers) = [0, " +
                                                             str(c.num_hidden_layers) + ")"));
        if (c.architecture == "MixtralForCausalLM" && !v.empty())
          bad(source, "MixtralForCausalLM has experts on every layer (no mlp_only_layers)");
        if (count_moe_layers(c) == 0)
          bad(source, "no layer has experts (decoder_sparse_step " + str(c.decoder_sparse_step) + ", " + list + ", " +
                          str(c.num_hidden_layers) + " layers)");
      }));
}

const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> t;
    // name: shardtrain's label (a preset's name, "custom" for a config.json); not in config.json.
    t.push_back(scalar<std::string>("name", &ModelConfig::name, "custom", {}, false));
    t.back().info.in_hf_config = false;
    {  // first: the rows below read their config.json defaults by architecture
      Field f = scalar<std::string>("architecture", &ModelConfig::architecture, "LlamaForCausalLM", check_architecture);
      f.info.in_hf_config = false;  // config.json: "architectures" and "model_type"
      f.info.by_architecture = true;
      f.hf_read = hf_read_architecture;
      f.hf_write = [](const ModelConfig&, json&) {};  // to_hf_json writes both keys itself
      f.canonical_optional = f.omit_default = true;
      t.push_back(f);
    }
    t.push_back(size("vocab_size", &ModelConfig::vocab_size, true));
    t.push_back(size("hidden_size", &ModelConfig::hidden_size, true));
    t.push_back(size("intermediate_size", &ModelConfig::intermediate_size, true));
    t.push_back(size("num_hidden_layers", &ModelConfig::num_hidden_layers, true));
    t.push_back(size("num_attention_heads", &ModelConfig::num_attention_heads, true));
    t.push_back(size("num_key_value_heads", &ModelConfig::num_key_value_heads, false));
    t.back().hf_absent = [](ModelConfig& c) {  // LlamaConfig: plain MHA; the others' defaults
      c.num_key_value_heads = c.architecture == "MixtralForCausalLM"    ? 8
                              : c.architecture == "Qwen3MoeForCausalLM" ? 4
                              : c.architecture == "Qwen3ForCausalLM"    ? 32
                                                                        : c.num_attention_heads;
    };
    t.back().check = [check = t.back().check](const ModelConfig& c, const std::string& source) {
      check(c, source);
      if (c.num_attention_heads % c.num_key_value_heads != 0)
        bad(source, "num_key_value_heads (" + std::to_string(c.num_key_value_heads) +
                        ") does not divide num_attention_heads (" + std::to_string(c.num_attention_heads) + ")");
    };
    t.push_back(size("max_position_embeddings", &ModelConfig::max_position_embeddings, false));
    t.back().hf_absent = [](ModelConfig& c) {  // LlamaConfig 2048, MixtralConfig 4096 * 32, Qwen3's 32768
      c.max_position_embeddings = c.architecture == "MixtralForCausalLM" ? 131072 : is_qwen3(c.architecture) ? 32768 : 2048;
    };
    t.push_back(scalar<double>("rms_norm_eps", &ModelConfig::rms_norm_eps, 1e-6,
                               positive_real("rms_norm_eps", &ModelConfig::rms_norm_eps)));
    t.back().hf_absent = [](ModelConfig& c) { c.rms_norm_eps = c.architecture == "MixtralForCausalLM" ? 1e-5 : 1e-6; };
    t.push_back(scalar<double>("rope_theta", &ModelConfig::rope_theta, 10000.0,
                               positive_real("rope_theta", &ModelConfig::rope_theta)));
    t.back().hf_absent = [](ModelConfig& c) {  // MixtralConfig's default_theta
      c.rope_theta = c.architecture == "MixtralForCausalLM" ? 1e6 : 10000.0;
    };
    {
      Field f;
      f.info = {"rope_scaling", true, true, false};
      f.get = [](const ModelConfig& c) { return rope_scaling_json(c.rope_scaling); };
      f.set = set_rope_scaling;
      f.hf_read = hf_read_rope;
      f.canonical_optional = true;  // older versions: no scaling
      f.check = check_rope_scaling;
      t.push_back(f);
    }
    {  // the effective head_dim() is written; head_dim_override holds a given non-derived value
      Field f;
      f.info = {"head_dim", true, true, false};
      f.get = [](const ModelConfig& c) { return json(c.head_dim()); };
      f.set = set_head_dim;
      f.hf_absent = [](ModelConfig& c) {  // Qwen3Config's default 128; the others derive it
        c.head_dim_override = 0;
        if (c.architecture == "Qwen3ForCausalLM") set_head_dim(c, json(128), "");
      };
      f.canonical_optional = true;  // older versions: hidden_size / num_attention_heads
      f.check = check_head_dim;
      t.push_back(f);
    }
    t.push_back(scalar<double>("initializer_range", &ModelConfig::initializer_range, 0.02,
                               positive_real("initializer_range", &ModelConfig::initializer_range), false));
    t.push_back(scalar<std::string>("hidden_act", &ModelConfig::hidden_act, "silu",
                                    [](const ModelConfig& c, const std::string& source) {
                                      if (c.hidden_act != "silu")
                                        bad(source, "key 'hidden_act' is \"" + c.hidden_act +
                                                        "\"; only \"silu\" (SwiGLU) is supported");
                                    }));
    t.push_back(scalar<bool>("tie_word_embeddings", &ModelConfig::tie_word_embeddings, false));  // LlamaConfig default
    const std::string vocab = " is outside the vocabulary (vocab_size ";
    {
      Field f;
      f.info = {"bos_token_id", true, true, true};
      f.get = bos_json;
      f.set = [](ModelConfig& c, const json& v, const std::string& source) {
        c.bos_token_id = parse_token_id(json{{"bos_token_id", v}}, "bos_token_id", source);
      };
      f.hf_absent = [](ModelConfig& c) { c.bos_token_id = kUnsetTokenId; };
      f.check = [vocab](const ModelConfig& c, const std::string& source) {
        if (c.bos_token_id != kUnsetTokenId && (c.bos_token_id < 0 || c.bos_token_id >= c.vocab_size))
          bad(source, "key 'bos_token_id' = " + std::to_string(c.bos_token_id) + vocab + std::to_string(c.vocab_size) + ")");
      };
      t.push_back(f);
    }
    {
      Field f;
      f.info = {"eos_token_id", true, true, true};
      f.get = eos_json;
      f.set = [](ModelConfig& c, const json& v, const std::string& source) {
        c.eos_token_ids = parse_eos_ids(json{{"eos_token_id", v}}, source);
      };
      f.hf_absent = [](ModelConfig& c) { c.eos_token_ids.clear(); };
      f.check = [vocab](const ModelConfig& c, const std::string& source) {
        const std::string v = vocab + std::to_string(c.vocab_size) + ")";
        for (int id : c.eos_token_ids)
          if (id < 0 || id >= c.vocab_size)
            bad(source, "key 'eos_token_id' = " + eos_str(c) +
                            (c.eos_token_ids.size() > 1 ? ": id " + std::to_string(id) + v : v));
      };
      t.push_back(f);
    }
    add_architecture_rows(t);
    return t;
  }();
  return table;
}
}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> n;
  for (auto& [k, v] : presets()) n.push_back(k);
  return n;
}

ModelConfig preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string known;
    for (auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown model preset '" + name + "' (known: " + known +
                                "; or give a path to a config.json)");
  }
  return it->second;
}

ModelConfig parse_hf_config(const std::string& text, const std::string& source) {
  json j;
  try {
    j = read_json(text, json_limits::kConfig);
  } catch (const JsonError& e) {
    bad(source, e.what());
  }
  if (!j.is_object()) bad(source, "top level is not a JSON object");
  if (get_or<bool>(j, "attention_bias", false, source)) bad(source, "key 'attention_bias' = true is not supported");
  if (get_or<bool>(j, "mlp_bias", false, source)) bad(source, "key 'mlp_bias' = true is not supported");
  ModelConfig c;
  for (const Field& f : fields())
    if (f.hf_required && !j.contains(f.info.key)) bad(source, std::string("required key '") + f.info.key + "' is missing");
  for (const Field& f : fields()) {
    const char* k = f.info.key;
    if (f.hf_read) f.hf_read(c, j, source);
    else if (!f.info.in_hf_config) continue;  // "name" keeps its default, "custom"
    else if (!j.contains(k) || j[k].is_null()) f.hf_absent(c);
    else f.set(c, j[k], source);
  }
  // Sliding-window attention is not supported: refused where transformers would use it. Its Qwen3
  // configs switch it with use_sliding_window (default false); Mistral's and Mixtral's use
  // sliding_window whenever it is set (and a Llama's config.json with one is taken for a Mistral).
  const bool window = is_qwen3(c.architecture) ? get_or<bool>(j, "use_sliding_window", false, source) : true;
  if (window && j.contains("sliding_window") && !j["sliding_window"].is_null() &&
      j["sliding_window"].is_number_integer() && j["sliding_window"].get<int64_t>() < c.max_position_embeddings)
    bad(source, "key 'sliding_window' = " + j["sliding_window"].dump() +
                    " is smaller than max_position_embeddings: sliding-window attention is not supported");
  // Mixtral's router jitter (multiplicative noise on the expert input in training).
  if (c.architecture == "MixtralForCausalLM" && get_or<double>(j, "router_jitter_noise", 0.0, source) != 0.0)
    bad(source, "key 'router_jitter_noise' = " + j["router_jitter_noise"].dump() +
                    " is not supported (the router's scores are used as computed)");
  return c;
}

void validate(const ModelConfig& c, const std::string& source) {
  for (const Field& f : fields())
    if (f.check) f.check(c, source);
  // The whole model's sizes.
  if (c.num_params() > (int64_t{1} << 40)) bad(source, "the model has more than 2^40 parameters");
  if (static_cast<int64_t>(c.vocab_size) * c.hidden_size > INT32_MAX ||
      static_cast<int64_t>(c.intermediate_size) * c.hidden_size > INT32_MAX ||
      static_cast<int64_t>(c.num_attention_heads) * c.head_dim() * c.hidden_size > INT32_MAX ||
      static_cast<int64_t>(c.moe_intermediate_size) * c.hidden_size > INT32_MAX ||
      static_cast<int64_t>(c.num_experts) * c.hidden_size > INT32_MAX)
    bad(source, "a weight matrix has more than 2^31 elements (vocab_size, intermediate_size, moe_intermediate_size, "
                "the number of experts or num_attention_heads x head_dim, x hidden_size)");
}


const std::vector<ModelConfigField>& model_config_fields() {
  static const std::vector<ModelConfigField> v = [] {
    std::vector<ModelConfigField> r;
    for (const Field& f : fields()) r.push_back(f.info);
    return r;
  }();
  return v;
}

std::string canonical_json(const ModelConfig& c) {
  json j = json::object();
  static const ModelConfig dflt;
  for (const Field& f : fields())
    if (!f.omit_default || f.get(c) != f.get(dflt)) j[f.info.key] = f.get(c);
  return j.dump();  // nlohmann::json objects are std::map-backed: keys come out sorted
}

ModelConfig from_canonical_json(const std::string& s) {
  json j;
  try {
    j = read_json(s, json_limits::kConfig);
  } catch (const JsonError& e) {
    bad("", e.what());
  }
  if (!j.is_object()) bad("", "not a JSON object");
  ModelConfig c;
  try {
    // A key no row knows (a newer version's field, or an edit) is refused, never dropped: the model
    // it describes may not be the one this version would build.
    for (auto& [k, v] : j.items())
      if (std::none_of(fields().begin(), fields().end(), [&](const Field& f) { return k == f.info.key; }))
        bad("", "key '" + (k.size() > 64 ? k.substr(0, 64) + "..." : k) + "' is not a model config field of this version");
    for (const Field& f : fields()) {
      const char* k = f.info.key;
      if (j.contains(k)) f.set(c, j[k], "");
      else if (!f.canonical_optional) bad("", std::string("key '") + k + "' is missing");
    }
  } catch (const json::exception& e) {
    bad("", e.what());
  }
  return c;
}

std::string to_hf_json(const ModelConfig& c, const std::string& torch_dtype) {
  json rope_parameters = {{"rope_type", c.rope_scaling.rope_type}, {"rope_theta", c.rope_theta}};
  if (c.rope_scaling.is_llama3()) rope_parameters.update(rope_scaling_json(c.rope_scaling));
  json j = {{"architectures", {c.architecture}},
            {"model_type", model_type_of(c.architecture)},
            {"rope_parameters", rope_parameters},  // transformers 5.x; rope_theta and rope_scaling for 4.x
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"mlp_bias", false},
            {"pretraining_tp", 1},
            {"use_cache", true},
            {"torch_dtype", torch_dtype},  // transformers < 4.56 reads this key
            {"dtype", torch_dtype}};       // transformers >= 4.56 reads this one
  // The fields, as in the canonical JSON (special ids: a list as a list, unset as null, so that
  // transformers does not substitute LlamaConfig's defaults 1 and 2).
  static const ModelConfig dflt;
  for (const Field& f : fields()) {
    if (f.hf_write) f.hf_write(c, j);
    else if (f.info.in_hf_config && (!f.omit_default || f.get(c) != f.get(dflt))) j[f.info.key] = f.get(c);
  }
  if (c.architecture != "LlamaForCausalLM")  // Llama's own keys (transformers' other configs do not have them)
    for (const char* k : {"mlp_bias", "pretraining_tp"}) j.erase(k);
  return j.dump(2);
}

uint64_t model_config_hash(const ModelConfig& c) { return fnv1a64(canonical_json(c)); }

std::vector<std::string> reconcile_special_ids(ModelConfig& c, const std::string& config_source,
                                               const DataSpecialIds& d) {
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  if (d.vocab_size > c.vocab_size)
    fail(d.source + " has vocab_size " + std::to_string(d.vocab_size) + ", more than the vocab_size " +
         std::to_string(c.vocab_size) + " of " + config_source);
  std::vector<std::string> notes;
  auto fill = [&](const char* key, const char* data_key, int64_t id) {
    if (id < 0 || id >= c.vocab_size)
      fail(config_source + " has no " + key + ", and the " + data_key + " " + std::to_string(id) + " of " + d.source +
           " is outside the model's vocabulary (vocab_size " + std::to_string(c.vocab_size) + ")");
    notes.push_back("note: " + config_source + " has no " + key + "; using " + std::to_string(id) + ", the " +
                    data_key + " of " + d.source);
    return static_cast<int>(id);
  };
  if (d.bos_id < 0) {
    // Data without BOS (GPT-2-style framing: documents separated by EOS only): nothing to check or fill.
  } else if (!c.has_bos()) {
    c.bos_token_id = fill("bos_token_id", "bos_id", d.bos_id);
  } else if (c.bos_token_id != d.bos_id)
    fail(config_source + " has bos_token_id " + std::to_string(c.bos_token_id) + ", but " + d.source + " has bos_id " +
         std::to_string(d.bos_id) + ": they must agree");
  if (c.eos_token_ids.empty()) c.eos_token_ids = {fill("eos_token_id", "eos_id", d.eos_id)};
  else if (!c.is_eos(d.eos_id))
    fail(config_source + " has eos_token_id " + eos_str(c) + ", but " + d.source + " has eos_id " +
         std::to_string(d.eos_id) + (c.eos_token_ids.size() > 1 ? ", which is not in the list" : "") +
         ": they must agree");
  return notes;
}

void take_special_ids_from_data(Comm& comm, ModelConfig& c, const std::string& config_source,
                                const DataSpecialIds& d) {
  std::vector<std::string> notes;
  agree(comm, [&] { notes = reconcile_special_ids(c, config_source, d); });
  for (auto& n : notes) log_info(comm, n);
  if (!same_on_all_ranks(comm, model_config_hash(c)))
    throw CollectiveError(0, "ranks disagree on the model config after taking the special ids of " + d.source +
                                 " (does every rank read the same file?)");
}

ModelConfig resolve_model_config(Comm& comm, const std::string& spec, const InputDir* dir) {
  std::string canon;
  std::string err;
  if (comm.rank() == 0) {
    try {
      ModelConfig c;
      bool is_file = spec.size() > 5 && spec.substr(spec.size() - 5) == ".json";
      if (is_file) {
        const std::string path = !dir ? spec : (std::filesystem::path(dir->path()) / spec).string();
        if (!dir ? !path_exists(path) : !dir->has(spec, "Hugging Face directory '" + dir->path() + "'"))
          throw std::invalid_argument("cannot open model config file '" + path + "': no such file");
        // Read through one checked descriptor: a regular file (never a FIFO's endless wait), and
        // for a file of `dir`, the file actually opened lies inside that open directory.
        const std::string text = !dir ? InputFile::open(path, "model config file").read_all(kMaxConfigBytes)
                                      : dir->open_inside(spec, "Hugging Face directory '" + dir->path() + "'")
                                            .read_all(kMaxConfigBytes);
        c = parse_hf_config(text, "'" + path + "'");
        validate(c, "'" + path + "'");
      } else {
        c = preset(spec);
        validate(c, "preset '" + spec + "'");
      }
      canon = canonical_json(c);
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  // Only rank 0 can fail here; all_ok makes every rank throw rank 0's message.
  all_ok(comm, err.empty(), err);
  canon = comm.broadcast_string(canon, 0);
  ModelConfig c;
  std::string local_err;
  try {
    c = from_canonical_json(canon);
    if (canonical_json(c) != canon) throw std::runtime_error("canonical JSON does not round-trip on this rank");
  } catch (const std::exception& e) {
    local_err = e.what();
  }
  all_ok(comm, local_err.empty(), local_err);
  if (!same_on_all_ranks(comm, model_config_hash(c))) throw CollectiveError(0, "ranks disagree on the model config (hash mismatch after broadcast)");
  return c;
}

}  // namespace shardtrain
