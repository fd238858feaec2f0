// Where a run stands besides its tensors (TrainState), with its batch history (BatchSegment) and its
// loss-spike statistics (SpikeStats): the record a checkpoint stores (io, checkpoint.h) and the
// trainer keeps (train, train.h). A header of its own so that both include it without io's
// checkpoint machinery; it uses the data layer's TokenizerInfo only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/data/data.h"

namespace shardtrain {

// A TokenizerInfo that records no tokenizer (kind ""): nothing to write, nothing known.
inline TokenizerInfo no_tokenizer() {
  TokenizerInfo t;
  t.kind.clear();
  return t;
}

// One stretch of a run with constant batch geometry and seed: optimizer steps
// [from_step, next segment's from_step) each consumed global_batch x seq_len tokens of the batches
// (seed, k). A resume that accepts a changed --global-batch, --seq-len or --seed starts a segment.
struct BatchSegment {
  int64_t from_step = 0;
  int global_batch = 0;  // sequences per optimizer step
  int seq_len = 0;       // tokens per sequence
  uint64_t seed = 0;     // data order (and, for segment 0, the init)
};

// The loss-spike statistics of a run (--skip-spikes; train.h check_spike): the loss and gradient
// norm of the last kSpikeWindow steps whose values entered the window, oldest first, and the skip
// counters. Kept (and checkpointed, root attribute `spike_stats`) with or without --skip-spikes, so
// that a resumed run decides exactly as the uninterrupted one.
inline constexpr int kSpikeWindow = 128;
struct SpikeStats {
  std::vector<double> loss, grad_norm;  // the window: equal lengths, at most kSpikeWindow
  int64_t skipped_in_a_row = 0;  // updates skipped as spikes in a row, up to the last step
  int64_t skipped_updates = 0;   // updates skipped by the run so far (spikes and non-finite steps)
};

// Where a run stands, besides its tensors. The data position is `step` itself: batch k of the
// train split is a pure function of (seed, k) (see data.h), and so is the init.
struct TrainState {
  int64_t step = 0;         // optimizer steps completed
  int64_t tokens_seen = 0;  // training tokens consumed, cumulative over the segments
  uint64_t seed = 0;        // seed of the data stream from `step` on (the last segment's)
  int saved_world_size = 0; // world size the checkpoint was written at (0: not loaded)
  std::vector<BatchSegment> segments;  // the run's batch history, oldest first; empty: none (import)
  std::string data_info = "null";      // JSON of the token file trained on (see CheckpointInfo::data_info)
  // The tokenizer of the data trained on (or of the imported model): written to group /tokenizer
  // when tokenizer.kind is not empty, so that export can give the model its tokenizer.
  TokenizerInfo tokenizer = no_tokenizer();
  SpikeStats spikes;  // the loss-spike statistics (empty: a fresh run, or a file older than version 3)
  // The layout of the run holding this state, recorded in train_config (train_config_json) when
  // world_size > 0: world size W and shard group size G. Not read back by load_checkpoint.
  int world_size = 0, shard_group_size = 0;
};

// Tokens consumed by `step` optimizer steps under `segments` (sum over segments of steps x
// global_batch x seq_len). Throws std::invalid_argument if the segments are not ordered, do not
// start at step 0, or start beyond `step`.
int64_t tokens_of(const std::vector<BatchSegment>& segments, int64_t step);

}  // namespace shardtrain
