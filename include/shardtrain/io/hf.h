// shardtrain <-> Hugging Face: export a checkpoint as a transformers-loadable LlamaForCausalLM
// directory, import such a directory as a step-0 checkpoint, and sample text from a checkpoint.
//
// Export layout (what AutoModelForCausalLM / AutoTokenizer / pipeline / apply_chat_template read):
//   config.json, generation_config.json, model.safetensors | model-0000i-of-0000n.safetensors +
//   model.safetensors.index.json, and the tokenizer: the model's own files as the checkpoint
//   records them (tokenizer.model / tokenizer.json, tokenizer_config.json, special_tokens_map.json,
//   chat_template.jinja), or tokenizer.json (+ tokenizer_config.json, special_tokens_map.json) when
//   the model's tokenizer is byte-level (see export_hf).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/runtime/runtime.h"
#include "shardtrain/io/safetensors.h"

namespace shardtrain {

struct ExportOptions {
  std::string checkpoint;               // HDF5 checkpoint to export (any saving world size)
  std::string out_dir;                  // created if missing; files in it are overwritten
  DType dtype = DType::F32;             // fp32 master weights rounded to nearest even for bf16/fp16
  uint64_t max_shard_bytes = 5000000000;  // a file holds at most this many data bytes (one tensor may exceed)
};

// Parses "5GB", "500MB", "10KB", "123" (bytes; decimal units as transformers' max_shard_size).
// Throws std::invalid_argument naming option '--max-shard-size'.
uint64_t parse_size(const std::string& s);

// Collective (runs at any world size, 1 included). Loads the checkpoint's parameters sharded over
// the current ranks, gathers one output file's tensors at a time, and rank 0 writes each file
// (under a temporary name, then renamed). Tied heads write model.embed_tokens.weight only.
// Special ids: checked against the token file the checkpoint records (CheckpointInfo::data_info;
// a conflict is refused naming both values), unset ones filled from it with a note; still unset,
// config.json and generation_config.json say null (with a note). An eos list is written as a list.
// generation_config.json's eos_token_id is the model's eos ids (primary first), then the
// checkpoint's end-of-turn ids (TokenizerInfo::end_of_turn_ids), then the eos ids of the
// generation_config.json the tokenizer record carries, each once (one id: an integer); a carried
// file is rewritten with its other keys kept (keys sorted), bos_token_id set to config.json's and
// pad_token_id kept when it names an id (else the primary eos). config.json keeps the model's own
// eos ids: transformers' generate reads generation_config.json alone when it exists.
// The model's own tokenizer files (and chat_template.jinja) are written byte for byte as recorded.
// The byte-level tokenizer files are written only when the model's tokenizer is byte-level: the
// recorded token file says "byte-level" (or none is recorded), and "<s>" / "</s>" (bos and the
// primary eos) are ids >= 256, apart from the bytes. Otherwise no tokenizer files are written
// (earlier ones in out_dir are removed, a chat_template.jinja too) and a note says why.
// Throws CollectiveError on every rank naming the file on any failure: also for an end-of-turn id
// outside the model's vocabulary or a recorded generation_config.json that data.h's
// check_carried_file refuses.
void export_hf(Comm& comm, const ExportOptions& o);

// Collective. Reads a Hugging Face Llama-family directory (config.json; model.safetensors or
// model.safetensors.index.json with its shards; F32/BF16/F16) and writes a step-0 shardtrain
// checkpoint to `out_path` (AdamW moments zero). Names may carry the wrapper prefixes `module.`,
// `_orig_mod.` and `_fsdp_wrapped_module.` (stripped); `rotary_emb.inv_freq` buffers are ignored.
// Special ids are kept as config.json has them (absent stays unset, an eos list stays a list).
// The tokenizer files found (tokenizer.model or tokenizer.json, tokenizer_config.json,
// special_tokens_map.json) and, with them, chat_template.jinja and generation_config.json go to the
// checkpoint's group /tokenizer, each read inside the directory within its size limit; the last
// two must pass data.h's check_carried_file against config.json's vocab_size (else refused naming
// the file). Without tokenizer.model or tokenizer.json nothing of them is kept.
// With `data_path` (a token file, `--data`) they are checked against and filled from its header as
// training does (config.h reconcile_special_ids): a conflict is refused naming both values.
// `train_config` is the checkpoint's train_config attribute (train.h train_config_json; its seed is
// recorded as the data seed too).
// Refuses, naming architecture, file or tensor: unsupported architectures, missing or unexpected
// tensors, shape mismatches, an index naming a missing file, bad safetensors headers.
void import_hf(Comm& comm, const std::string& hf_dir, const std::string& out_path, const std::string& train_config,
               const std::string& data_path = "");

// Strips known wrapper prefixes from a tensor name: every `module.`, `_orig_mod.` and
// `_fsdp_wrapped_module.` path component, wherever it appears.
std::string canonical_tensor_name(const std::string& name);

struct GenerateOptions {
  std::string checkpoint;
  std::string prompt = "";
  int max_new_tokens = 200;
  double temperature = 0.8;  // 0: greedy
  int top_k = 40;            // 0: no top-k filtering
  uint64_t seed = 1337;
  std::string dump_logits;   // if set: raw float32 logits [T, V] of BOS + prompt written here
  // If set: comma-separated token ids fed after BOS in place of the prompt's UTF-8 bytes (any id of
  // the vocabulary, e.g. above 65535; the output still decodes bytes only).
  std::string prompt_ids;
  bool print_ids = false;    // also log "generate: prompt ids: ..." and "generate: new ids: ..."
};

// Collective. Samples max_new_tokens tokens after BOS + prompt (context cropped to
// max_position_embeddings) and returns the generated text (rank 0 prints it); stops early at any
// id of the eos_token_id export writes to generation_config.json (the model's eos ids, the
// end-of-turn ids of its chat data, a carried generation_config.json's). Sampling happens on rank 0 and each token is broadcast, so every rank
// runs the same forwards. The prompt is encoded with the checkpoint's tokenizer (group
// /tokenizer): SentencePiece through libsentencepiece, else byte-level (UTF-8 bytes); a
// tokenizer.json model (no C++ library for it here) needs --prompt-ids and returns ids, not text.
// The exported tokenizer gives the same ids for a prompt. Special ids are checked and filled as
// export does; with no bos_token_id it throws CollectiveError naming the key.
std::string generate(Comm& comm, const GenerateOptions& o);

}  // namespace shardtrain
