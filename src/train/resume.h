// What a resumed (or --init-from) run checks against its checkpoint and how it continues the files
// of the run it resumes. Private to the training layer (trainer_setup.cpp); every function is called on
// every rank with the same arguments unless it says otherwise.
#pragma once

#include <string>

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/train/train.h"

namespace shardtrain {

// Compares the run's settings with the checkpoint's train_config, key by key. A change of one of
// resume_checked_settings() not named by --accept-change is refused on every rank (CollectiveError
// naming the settings and the flag to pass); accepted ones are logged, with the learning rate the
// next step gets under the old and the new schedule when the schedule changed. micro_batch and
// precision may change (like the world size, they do not change what is trained) and are logged.
void check_resume_settings(Comm& comm, const CheckpointInfo& info, const TrainConfig& tc);

// Rank 0 only, not collective: before a resumed run (or a start-over) appends to its metrics file,
// keeps the rows of steps <= `step` and moves the others to "<path>.discarded". Returns a note for
// the log, or "" when nothing moved. Throws std::runtime_error naming the file.
std::string continue_metrics(const std::string& path, int64_t step);

// The tokenizer the run's checkpoints record: `data`'s, or `ckpt`'s (from the checkpoint at
// `ckpt_path`) where the data names none; when both name the same tokenizer of their own, `ckpt`'s
// with the data's other files, the data's chat_template.jinja, and the end-of-turn ids of both.
// Throws CollectiveError naming both files when both have a tokenizer of their own that is not the
// same; logs a note when the kind changes.
TokenizerInfo pick_tokenizer(Comm& comm, const TokenizerInfo& ckpt, const std::string& ckpt_path,
                             const TokenizerInfo& data, const std::string& data_path);

}  // namespace shardtrain
