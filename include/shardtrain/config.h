// shardtrain model configuration: Llama-architecture hyper-parameters, built-in presets, parsing of
// a Hugging Face `config.json` (LlamaForCausalLM), validation, canonical JSON, and the rank-0
// resolve-then-broadcast protocol that keeps every rank on the same config.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

class Comm;

// Field names and meanings follow transformers' LlamaConfig
// (https://huggingface.co/docs/transformers/model_doc/llama#transformers.LlamaConfig).
struct ModelConfig {
  std::string name = "custom";     // preset name, or "custom" for a config.json
  int vocab_size = 258;            // rows of the embedding / LM head
  int hidden_size = 128;           // C
  int intermediate_size = 384;     // SwiGLU inner size
  int num_hidden_layers = 4;       // L
  int num_attention_heads = 4;     // NH
  int num_key_value_heads = 4;     // NKV (GQA when < NH)
  int max_position_embeddings = 256;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double initializer_range = 0.02;  // std of the normal init of matrices
  std::string hidden_act = "silu";
  bool tie_word_embeddings = true;
  int bos_token_id = 256;
  int eos_token_id = 257;

  int head_dim() const { return hidden_size / num_attention_heads; }
  int kv_dim() const { return head_dim() * num_key_value_heads; }
  // Total parameter count (elements), tied head counted once.
  int64_t num_params() const;
};

// Names of the built-in presets, e.g. "tiny", "demo", "llama-125m".
std::vector<std::string> preset_names();
// Returns the preset; throws std::invalid_argument naming the preset and listing the known ones.
ModelConfig preset(const std::string& name);

// Parses a Hugging Face config.json (text). Accepts "architectures" absent or containing
// "LlamaForCausalLM"; refuses others, rope_scaling, attention/mlp biases, and head_dim other than
// hidden_size / num_attention_heads. Throws std::invalid_argument naming `source` and the key.
ModelConfig parse_hf_config(const std::string& json_text, const std::string& source);

// Checks the invariants the model relies on; throws std::invalid_argument naming `source` and
// the offending key: positive sizes, NH divides C, NKV divides NH, even head_dim (RoPE pairs),
// hidden_act == "silu", bos/eos inside the vocabulary, eps > 0, theta > 0.
void validate(const ModelConfig& c, const std::string& source);

// Canonical JSON: keys sorted, no whitespace, every field present. Two configs are equal iff their
// canonical JSON strings are equal. to_hf_json adds the keys transformers expects.
std::string canonical_json(const ModelConfig& c);
ModelConfig from_canonical_json(const std::string& s);  // throws std::invalid_argument
std::string to_hf_json(const ModelConfig& c, const std::string& torch_dtype = "float32");

// Collective. Rank 0 alone resolves the model config from `spec` — a preset name, or a path to a
// config.json (anything ending in ".json") — and validates it; it then broadcasts the canonical
// JSON, every rank parses it, and all ranks check (via an FNV-1a hash all-reduce) that they hold
// byte-identical configs. If rank 0 fails, every rank throws CollectiveError with rank 0's message.
ModelConfig resolve_model_config(Comm& comm, const std::string& spec);

}  // namespace shardtrain
