// Private to the Hugging Face code (src/io/hf*.cpp): a checkpoint's model, loaded for export
// (hf.cpp) and generation (hf_generate.cpp).
#pragma once

#include <memory>
#include <string>

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
  std::unique_ptr<Backend<float>> be;
  std::unique_ptr<Fsdp<float>> f;
};

// Collective. Loads checkpoint `ckpt`'s model (read_checkpoint_info, load_checkpoint; a CPU
// backend, the parameters sharded over comm's ranks); then makes its special ids agree with the
// token file the checkpoint records (fills unset ones with a note, refuses a conflict on every
// rank). Errors: those of read_checkpoint_info and load_checkpoint; a model config or data record
// that does not parse or validate is a CollectiveError on every rank.
Loaded load_model(Comm& comm, const std::string& ckpt);

}  // namespace shardtrain::hf
