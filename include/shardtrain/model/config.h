// shardtrain model configuration: Llama-architecture hyper-parameters, built-in presets, parsing of
// a Hugging Face `config.json` (LlamaForCausalLM), validation, canonical JSON, and the rank-0
// resolve-then-broadcast protocol that keeps every rank on the same config.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

class InputDir;  // files.h

class Comm;

// A special token id that config.json leaves out (or sets to null).
inline constexpr int kUnsetTokenId = -1;

// RoPE frequency scaling (config.json's rope_scaling / rope_parameters). rope_type "default" is
// plain RoPE (the other fields unused); "llama3" is Llama 3.1's scaling (rope_inv_freqs). Field
// names follow transformers' rope_parameters.
struct RopeScaling {
  std::string rope_type = "default";  // "default" | "llama3"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position_embeddings = 0;
  bool is_llama3() const { return rope_type == "llama3"; }
  bool operator==(const RopeScaling&) const = default;
};

// Field names and meanings follow transformers' LlamaConfig
// (https://huggingface.co/docs/transformers/model_doc/llama#transformers.LlamaConfig).
// Every member has one row in the field table of src/model/config.cpp (model_config_fields()):
// config.json parsing, validation, canonical JSON (hence hashing, the broadcast and the checkpoint's
// `model_config` attribute), the exported config.json and the checkpoint's architecture comparison
// all iterate that table. Adding a field = the member here + its row there; the unit test
// ConfigFields.TableCoversEveryMember fails while a member has no row.
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
  RopeScaling rope_scaling;        // "default": none
  // config.json's head_dim; 0 = hidden_size / num_attention_heads. Use head_dim() for the value.
  int head_dim_override = 0;
  double initializer_range = 0.02;  // std of the normal init of matrices
  std::string hidden_act = "silu";
  bool tie_word_embeddings = true;
  // Special token ids. A config.json may leave them out (then they are unset, not LlamaConfig's
  // defaults 1 and 2): training and `--mode import --data` fill unset ids from the token file,
  // export from the checkpoint's record of its token file (reconcile_special_ids).
  //   bos_token_id: the id every sequence starts with (`--mode generate` feeds BOS + prompt);
  //     kUnsetTokenId (-1) when unset.
  //   eos_token_ids: every id that ends a sequence; generation stops on any of them. config.json's
  //     eos_token_id is one integer or a list (Llama 3.x: [128001, 128008, 128009]), kept as given;
  //     the first is the primary EOS (the tokenizer's "</s>", generation's pad id). Empty when unset.
  // The small presets use the byte-level tokenizer's 256 and 257 (data.h); the published-model
  // presets (llama-1b, tinyllama-1.1b, llama-8b, llama-70b) their tokenizers' ids.
  int bos_token_id = 256;
  std::vector<int> eos_token_ids = {257};

  // The architecture beside Llama (issue 56): config.json's "architectures" entry, one of
  // kArchitectures. "LlamaForCausalLM" (also what MistralForCausalLM reads as) is the dense Llama;
  // "Qwen3ForCausalLM" is Llama with qk_norm; "MixtralForCausalLM" and "Qwen3MoeForCausalLM" have
  // mixture-of-experts (MoE) MLPs. The rows below are written to the canonical JSON only when they
  // differ from these defaults, so a dense Llama's canonical JSON (and its hash, checkpoints and
  // export) is what it was before they existed.
  std::string architecture = "LlamaForCausalLM";
  // Qwen3: RMSNorm over each head's query and key (weights q_norm, k_norm [HD], eps rms_norm_eps)
  // after the projection, before RoPE (transformers' Qwen3Attention). Implied by the architecture.
  bool qk_norm = false;
  // MoE (MixtralForCausalLM: every layer; Qwen3MoeForCausalLM: the layers is_moe_layer names). E
  // experts, each a SwiGLU of inner size moe_intermediate_size; a router (linear C -> E, no bias)
  // scores them with a softmax, each token goes to its top num_experts_per_tok (k) and the k
  // weights are renormalized to sum 1 when norm_topk_prob (Mixtral: always). config.json keys:
  // Mixtral num_local_experts (the experts' inner size is its intermediate_size), Qwen3-MoE
  // num_experts, moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers
  // (Qwen3-MoE's dense layers use intermediate_size); both num_experts_per_tok and
  // router_aux_loss_coef (the weight of the load-balancing loss; transformers adds it only with
  // output_router_logits). num_experts 0: dense, and the other MoE fields keep their defaults.
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.0;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;

  // Per-head size HD: head_dim_override when set, else hidden_size / num_attention_heads. The query
  // projection is [NH*HD, C], which need not equal C (Llama-3-style configs may say so).
  int head_dim() const { return head_dim_override > 0 ? head_dim_override : hidden_size / num_attention_heads; }
  int kv_dim() const { return head_dim() * num_key_value_heads; }
  // Total parameter count (elements), tied head counted once; every expert counted.
  int64_t num_params() const;
  // Parameters one token uses: num_params() with num_experts_per_tok experts of each MoE layer in
  // place of all num_experts (the router counted whole). Equal to num_params() for a dense model.
  int64_t num_active_params() const;
  bool is_moe() const { return num_experts > 0; }
  // Whether block l's MLP is the MoE block (transformers' Qwen3MoeDecoderLayer): num_experts > 0,
  // l not in mlp_only_layers, and (l + 1) % decoder_sparse_step == 0.
  bool is_moe_layer(int l) const;
  // How many blocks is_moe_layer holds for (computed without a loop over the layers).
  int64_t num_moe_layers() const;
  bool has_bos() const { return bos_token_id != kUnsetTokenId; }
  // The primary EOS (first of eos_token_ids), or kUnsetTokenId.
  int primary_eos() const { return eos_token_ids.empty() ? kUnsetTokenId : eos_token_ids.front(); }
  // True iff `id` is one of eos_token_ids.
  bool is_eos(int64_t id) const;
  // Member-wise equality (the tests' oracle for the field table; canonical_json equality is the
  // program's: it also equates a head_dim given equal to the derived value).
  bool operator==(const ModelConfig&) const = default;
};

// What the rest of the program may know of one row of the field table (config.cpp): its key and
// how it compares between a checkpoint and a requested config.
struct ModelConfigField {
  const char* key;     // canonical JSON key, and config.json key where in_hf_config
  bool in_hf_config;   // read from and written to config.json (false: "name", shardtrain's label)
  bool architecture;   // false: a label that does not change what the weights mean (name, initializer_range)
  bool unset_matches;  // a null (unset) value on either side matches anything (the special token ids)
  // config.json's key and presence depend on the architecture (issue 56's rows: the MoE sizes under
  // Mixtral's or Qwen3-MoE's names, or implied by the architecture); the canonical JSON writes the
  // key only when the value differs from a default ModelConfig's.
  bool by_architecture = false;
};
// The rows, in the order parsing and validation visit them (sizes before what depends on them).
const std::vector<ModelConfigField>& model_config_fields();

// RoPE inverse frequency of each pair j in [0, head_dim()/2), in double:
//   base_j = rope_theta^(-2j / head_dim)
// and with rope_scaling.rope_type "llama3" (transformers' modeling_rope_utils.py,
// _compute_llama3_parameters; Meta's llama3 apply_scaling), with wavelen_j = 2*pi / base_j,
// low = original_max_position_embeddings / low_freq_factor, high = original_max / high_freq_factor:
//   wavelen_j < high                  -> base_j                   (high frequencies kept)
//   wavelen_j > low                   -> base_j / factor          (low frequencies scaled)
//   otherwise, s = (original_max / wavelen_j - low_freq_factor) / (high_freq_factor - low_freq_factor):
//                                     -> (1 - s) * base_j / factor + s * base_j
// The attention factor is 1 (cos/sin are not rescaled). rope_tables (model.h) turns these into
// the cos/sin tables.
std::vector<double> rope_inv_freqs(const ModelConfig& c);

// The architectures ModelConfig::architecture may name.
inline constexpr const char* kArchitectures[] = {"LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
                                                 "Qwen3MoeForCausalLM"};


// Names of the built-in presets, e.g. "tiny", "demo", "llama-125m", "llama-1b".
std::vector<std::string> preset_names();
// Returns the preset; throws std::invalid_argument naming the preset and listing the known ones.
ModelConfig preset(const std::string& name);

// Parses a Hugging Face config.json (text). Accepts "architectures" absent (then "model_type", or
// Llama) or containing one of kArchitectures or "MistralForCausalLM" (read as a Llama; the first
// supported entry counts), with a matching "model_type"; refuses others (naming Qwen2's biases),
// attention/mlp biases, a sliding window shorter than max_position_embeddings (unless
// use_sliding_window is false) and a non-zero router_jitter_noise. The MoE keys are read under
// each architecture's names with transformers' defaults (MixtralConfig, Qwen3MoeConfig). head_dim: absent or null =
// hidden_size / num_attention_heads. RoPE: top-level rope_theta with transformers 4.x's
// rope_scaling (null, or {"rope_type" or "type": "llama3", factor, low_freq_factor,
// high_freq_factor, original_max_position_embeddings}), or transformers 5.x's rope_parameters
// ({"rope_type": "default" | "llama3", "rope_theta", ...}); any other rope type (linear, dynamic,
// yarn, longrope, ...) is refused naming the key. bos_token_id: absent or null = unset, else a non-negative
// integer; eos_token_id: absent or null = unset, a non-negative integer, or a non-empty list of
// them. Throws std::invalid_argument naming `source` and the key.
ModelConfig parse_hf_config(const std::string& json_text, const std::string& source);

// Checks the invariants the model relies on (each field's own checks in table order, then the
// whole model's sizes); throws std::invalid_argument naming `source` and the offending key: positive sizes, NH divides C (unless head_dim is given), NKV divides NH,
// positive even head_dim (RoPE pairs), llama3 rope parameters (factor >= 1, 0 < low_freq_factor <
// high_freq_factor, original_max_position_embeddings > 0),
// hidden_act == "silu", bos and every eos id inside the vocabulary when set (unset is fine),
// eps > 0, theta > 0.
void validate(const ModelConfig& c, const std::string& source);

// Canonical JSON: keys sorted, no whitespace, every field present. Two configs are equal iff their
// canonical JSON strings are equal. "bos_token_id" is an integer or null (unset); "eos_token_id" is
// an integer (one id), an array of >= 2 integers (a list), or null (unset). from_canonical_json
// also reads what older versions wrote (both ids integers; no "head_dim": hidden_size /
// num_attention_heads; no "rope_scaling": none); a one-element array reads as that id.
// "head_dim" is the effective head_dim(); "rope_scaling" is null or {"factor", "high_freq_factor",
// "low_freq_factor", "original_max_position_embeddings", "rope_type": "llama3"}.
// to_hf_json adds the keys transformers expects and writes the ids the same way (a list as a list,
// unset as null, so that transformers does not substitute LlamaConfig's defaults 1 and 2). RoPE is
// written for both readers: transformers 5.x's "rope_parameters" {"rope_type", "rope_theta", ...}
// (what LlamaConfig.to_dict() writes) and 4.x's top-level "rope_theta" with "rope_scaling" (null,
// or the llama3 parameters); 5.x prefers rope_scaling when set, and reads both without warnings.
std::string canonical_json(const ModelConfig& c);
// from_canonical_json reads strictly (an integer field must be a JSON integer, ...) and throws
// std::invalid_argument "canonical model config is malformed: ..." naming the key.
ModelConfig from_canonical_json(const std::string& s);
std::string to_hf_json(const ModelConfig& c, const std::string& torch_dtype = "float32");
// FNV-1a 64 of canonical_json(c): what ranks compare to agree on a config.
uint64_t model_config_hash(const ModelConfig& c);

// The vocabulary and special ids of the data a model is trained on: a token file's header
// (data.h, docs/data-format.md), or the checkpoint's record of it (CheckpointInfo::data_info).
struct DataSpecialIds {
  std::string source;       // names it in messages, e.g. "token file 'corpus.tok'"
  int64_t vocab_size = 0;   // ids in the data are < vocab_size
  int64_t bos_id = -1;      // the id each document starts with; -1: documents have no BOS
  int64_t eos_id = -1;      // the id each document ends with
};

// Makes `c` agree with the data it is (or was) trained on. Refuses, throwing
// std::invalid_argument naming `config_source` (e.g. "model config 'cfg.json'"), d.source and both
// values: data vocab_size above c.vocab_size; a set bos_token_id other than d.bos_id; a set
// eos_token_id that does not contain d.eos_id (one id: differs; a list: d.eos_id not among them).
// d.bos_id < 0 (data framed without BOS, as GPT-2's) leaves bos_token_id as it is.
// Fills an unset id from the data (the eos as a single id) and returns one "note: ..." line per
// filled id (empty: nothing filled). The data's ids must lie inside c's vocabulary to be filled.
std::vector<std::string> reconcile_special_ids(ModelConfig& c, const std::string& config_source,
                                               const DataSpecialIds& d);

// Collective. reconcile_special_ids on every rank, agreed (a refusal becomes a CollectiveError with
// the same message on every rank); rank 0 logs the notes; then every rank checks it holds the same
// config (FNV-1a hash), since each rank read the data itself: CollectiveError if not.
void take_special_ids_from_data(Comm& comm, ModelConfig& c, const std::string& config_source,
                                const DataSpecialIds& d);

// Collective. Rank 0 alone resolves the model config from `spec` — a preset name, or a path to a
// config.json (anything ending in ".json") — and validates it; it then broadcasts the canonical
// JSON, every rank parses it, and all ranks check (via an FNV-1a hash all-reduce) that they hold
// byte-identical configs. If rank 0 fails, every rank throws CollectiveError with rank 0's message.
// A config file must be a regular file (no FIFO or device; files.h InputFile) of at most
// kMaxConfigBytes. With `dir` given (rank 0's is used), `spec` is a file name inside that open
// directory (a Hugging Face directory from strangers), opened by InputDir::open_inside (files.h):
// the directory's other files, read through the same InputDir, come from the same directory.
inline constexpr uint64_t kMaxConfigBytes = 64ull << 20;
ModelConfig resolve_model_config(Comm& comm, const std::string& spec, const InputDir* dir = nullptr);

}  // namespace shardtrain
