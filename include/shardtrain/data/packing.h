// shardtrain data layer: supervised fine-tuning batches from example data (token format version 3,
// docs/data-format.md "Version 3"; issue 55). The examples of a stream are packed into rows of
// seq_len positions, each example whole in one row; each row carries its tokens, its targets (-1
// where the loss does not count), and the document id and position of every token, so that a row
// trained under the document mask (model.h AttentionMask::Document) gives each example the losses it
// would have alone. The global batches are rows of a seeded permutation of the packed rows, a new
// one per epoch: the data position is a function of the step, as for plain data (fill_batch).
//
// Targets. Position p of a row holds token x_p; its target is x_{p+1}, the next token of the same
// example, when that token counts under --train-on (assistant: role class Assistant or EndOfTurn;
// all: every token), else -1 (kNoTarget). So target flag t of an example (token t counts) is the loss
// term that predicts token t from its prefix: Hugging Face's labels with -100 on the others, before
// the shift. An example's first token is never a target; its last position has none (the next
// token belongs to another example, or is padding).
//
// Packing (PackMode::BestFit): best-fit decreasing, deterministic from the stream and the options:
// examples sorted by length, longest first (ties: stream order); each goes into the open row with
// the least room that still holds it (ties: the row opened first), else a new row. Rows are
// numbered in the order they were opened; a row's examples lie in the order they were placed.
// PackMode::None: each example its own row, in stream order. The rest of a row is padding: token
// `pad` (the tokenizer's pad id, else its EOS, else 0), no target, a document of its own after the
// row's examples, positions 0, 1, ... (padding attends only to padding).
//
// Examples longer than seq_len: MaxLengthPolicy::Truncate keeps the first seq_len tokens, Drop
// leaves them out. An example with no target (after truncation) is left out. Both are counted.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shardtrain/backend/ops_math.h"  // kNoTarget: a position whose target does not count
#include "shardtrain/data/data.h"

namespace shardtrain {

enum class TrainOn { Assistant, All };          // --train-on assistant | all (alias: completion = assistant)
enum class PackMode { BestFit, None };          // --pack best-fit | none
enum class MaxLengthPolicy { Truncate, Drop };  // --max-length-policy truncate | drop

// Parse the options' spellings; std::invalid_argument naming the option otherwise.
TrainOn parse_train_on(const std::string& s);
PackMode parse_pack_mode(const std::string& s);
MaxLengthPolicy parse_max_length_policy(const std::string& s);
const char* train_on_name(TrainOn t);
const char* pack_mode_name(PackMode p);
const char* max_length_policy_name(MaxLengthPolicy m);

struct PackOptions {
  int seq_len = 64;
  PackMode pack = PackMode::BestFit;
  MaxLengthPolicy max_length = MaxLengthPolicy::Truncate;
  TrainOn train_on = TrainOn::Assistant;
};

// What packing a stream did (all counts of examples unless named otherwise).
struct PackStats {
  uint64_t examples = 0;           // in the stream
  uint64_t packed = 0;             // in the rows
  uint64_t truncated = 0;          // longer than seq_len, cut (Truncate; counted in packed)
  uint64_t dropped_long = 0;       // longer than seq_len, left out (Drop)
  uint64_t dropped_no_target = 0;  // no target token (after truncation), left out
  uint64_t tokens = 0;             // tokens in the rows (padding not counted)
  uint64_t targets = 0;            // target tokens in the rows
  int64_t rows = 0;
};

// The packed rows of one stream of an example dataset. Immutable after construction; rows are
// read with fill_row. Borrows `ds` (which must outlive it).
class PackedExamples {
 public:
  // Reads the stream's example starts and (TrainOn::Assistant) its role classes once. Throws
  // std::invalid_argument when ds has no examples (has_examples() false) or seq_len < 2.
  PackedExamples(const TokenDataset& ds, Split s, const PackOptions& o);
  const PackStats& stats() const { return st_; }
  int64_t rows() const { return st_.rows; }
  int seq_len() const { return o_.seq_len; }
  int32_t row_targets(int64_t r) const { return row_targets_.at(static_cast<size_t>(r)); }
  // Row r into [seq_len] arrays: tokens, targets (kNoTarget where none), doc (0, 1, ... per example,
  // the padding's after them), pos (0 at each example's first token) and, when given, real (1 for
  // an example's token, 0 for padding: model.h TokenLayout::real). Throws std::out_of_range for r
  // outside [0, rows()).
  void fill_row(int64_t r, int32_t* tokens, int32_t* targets, int32_t* doc, int32_t* pos,
                int32_t* real = nullptr) const;

 private:
  const TokenDataset& ds_;
  Split split_;
  PackOptions o_;
  int32_t pad_ = 0;
  PackStats st_;
  std::vector<uint64_t> ex_start_;   // stream offset of each packed example's first token
  std::vector<int32_t> ex_len_;      // its length in the row (after truncation)
  std::vector<int64_t> row_begin_;   // row r holds packed examples row_ex_[row_begin_[r] .. row_begin_[r+1])
  std::vector<uint32_t> row_ex_;     // indices into ex_start_ / ex_len_
  std::vector<int32_t> row_targets_;
};

// The global batches of an example dataset: global batch `index` of split s is rows
// [index G, (index + 1) G) of the stream's rows in epoch order, wrapping into the next epoch:
// sequence i of it is row j = index G + i of the concatenation of epochs, epoch e = j / R, and the
// row taken is perm_e[j mod R] (R = rows). Training: perm_e is a Fisher-Yates shuffle of [0, R)
// drawn from splitmix64(seed, e) (data.h's fill_batch uses the same mixer), or with shuffle false
// the identity (the rows in packing order: with PackMode::None, the examples in file order, as a
// sequential sampler reads them); validation: the identity (every evaluation reads the same rows).
// Thread-safe (a small cache of permutations).
class PackedBatches {
 public:
  PackedBatches(const TokenDataset& ds, const PackOptions& o, uint64_t seed, int global_batch, bool shuffle = true);
  const PackedExamples& stream(Split s) const { return s == Split::Train ? train_ : val_; }
  // Sequences [first, first + count) of global batch `index`, as fill_row writes them ([count, T]
  // row-major each; real: when given).
  void fill(Split s, int64_t index, int first, int count, int32_t* tokens, int32_t* targets, int32_t* doc,
            int32_t* pos, int32_t* real = nullptr) const;
  // The target tokens of global batch `index` (all G sequences): what its mean loss divides by.
  int64_t batch_targets(Split s, int64_t index) const;
  // The epoch global batch `index` of the training split ends in (0-based), and the rows per epoch.
  int64_t epoch_of(int64_t index) const;

 private:
  int64_t row_of(Split s, int64_t j) const;  // row of sequence j of the concatenated epochs
  PackedExamples train_, val_;
  uint64_t seed_;
  int G_, T_;
  bool shuffle_;
  mutable std::mutex mu_;
  mutable std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> perms_;  // epoch -> permutation (last two)
};

}  // namespace shardtrain
