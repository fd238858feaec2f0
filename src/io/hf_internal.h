// Private to the Hugging Face code (src/io/hf*.cpp): a checkpoint's model, loaded for export
// (hf.cpp) and generation (hf_generate.cpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardtrain/backend/backend.h"
#include "shardtrain/io/train_state.h"
#include "shardtrain/model/config.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/unit_pipeline.h"

namespace shardtrain::hf {

struct Loaded {  // a checkpoint's model, sharded over the current ranks
  ModelConfig mc;                 // special ids filled from the checkpoint's token file record
  bool has_data = false;          // the checkpoint records the token file it was trained on
  std::string data_tokenizer;     // that token file's tokenizer name, e.g. "byte-level"
  TokenizerInfo tokenizer = no_tokenizer();  // group /tokenizer of the checkpoint (kind "": none)
  // The generation_config.json the tokenizer record carries, parsed (null: none), and the ids
  // generation stops at: the model's eos ids (the primary one first), then the tokenizer's
  // end-of-turn ids, then that file's eos_token_id, each once. Export writes them as
  // generation_config.json's eos_token_id; --mode generate stops at them.
  nlohmann::json generation_config;
  std::vector<int> generation_eos;
  std::unique_ptr<Backend<float>> be;
  std::unique_ptr<Fsdp<float>> f;
};

// Collective. Loads checkpoint `ckpt`'s model (read_checkpoint_info, load_checkpoint; a CPU
// backend, the parameters sharded over comm's ranks); then makes its special ids agree with the
// token file the checkpoint records (fills unset ones with a note, refuses a conflict on every
// rank), and sets generation_config / generation_eos. Errors: those of read_checkpoint_info and
// load_checkpoint; a model config or data record that does not parse or validate, an end-of-turn
// id outside the model's vocabulary or a recorded generation_config.json that data.h's
// check_carried_file refuses is a CollectiveError on every rank.
Loaded load_model(Comm& comm, const std::string& ckpt);

}  // namespace shardtrain::hf
