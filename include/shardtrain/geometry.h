// shardtrain batch geometry: how one optimizer step's global batch is laid out over the mesh,
// resolved once from the options and the mesh's dimensions. Training (Trainer) and `--mode plan`
// both call resolve_geometry, so a plan is never made for a run that training would refuse, and
// each dimension's divisibility rule is written here alone. (`--mode plan` with `--micro-batch` and
// no `--global-batch` plans for global batch = micro-batch x dp: memory depends on the micro-batch.)
//
// Units: sequences (rows of T = seq_len tokens) and tokens. Terms as Megatron and torchtitan use them:
//   global batch  sequences per optimizer step over the whole mesh (--global-batch)
//   dp            data-parallel ranks reading different rows: dp_replicate x dp_shard (ranks that
//                 differ only in cp or tp read the same rows)
//   per_rank      sequences a data-parallel rank reads per step: global_batch / dp
//   micro_batch   sequences per forward/backward (--micro-batch; 0 = per_rank, no accumulation)
//   accum         micro-batches per step (gradient accumulation): per_rank / micro_batch
// Each dimension's share of a micro-batch's tokens:
//   tp            sequence parallelism splits the micro-batch's micro_batch x T tokens evenly over the
//                 TP group: tp_tokens = micro_batch x T / tp rows of activations per TP rank.
// The loss is the mean over every target token of the global batch; a rank's gradients are scaled
// by 1 / rank_tokens (its share of that mean; the data-parallel reduction sums the shares).
//
// Layer: parallel (between io and train). Pure: no communicator, no I/O; the same inputs give the
// same result (and the same refusal message) on every rank.
#pragma once

#include <cstdint>
#include <string>

#include "shardtrain/config.h"
#include "shardtrain/mesh.h"

namespace shardtrain {

// The options that shape the batch (TrainConfig's fields of the same names).
struct BatchOptions {
  int64_t global_batch = 0;  // --global-batch (64-bit: --mode plan passes micro-batch x dp)
  int micro_batch = 0;   // --micro-batch; 0 = the whole per-rank batch
  int seq_len = 0;       // --seq-len (T: a sequence's global length)
};

struct BatchGeometry {
  MeshDims dims;
  int seq_len = 0;      // T
  int dp = 1;           // dims.dp()
  int per_rank = 0;     // global_batch / dp
  int micro_batch = 0;  // sequences per micro-batch
  int accum = 0;        // micro-batches per step
  int64_t micro_tokens() const { return int64_t{micro_batch} * seq_len; }
  // Target tokens a data-parallel rank contributes per step (the gradient scale's denominator).
  int64_t rank_tokens() const { return int64_t{per_rank} * seq_len; }
  // Activation rows a TP rank holds of a micro-batch under sequence parallelism.
  int64_t tp_tokens() const { return micro_tokens() / dims.tp; }
};

// The geometry, or `refusal` (non-empty) naming the option, the numbers and the rule it breaks.
struct GeometryResult {
  BatchGeometry geometry;
  std::string refusal;
  bool ok() const { return refusal.empty(); }
};

// Rules, in this order (the first that fails is the refusal):
//   T >= 1 and T <= the model's max_position_embeddings;
//   dp divides the global batch; micro_batch divides global_batch / dp;
//   tp divides the model's attention heads, key/value heads and intermediate size
//   (check_tensor_parallel, model.h) and the micro-batch's tokens (sequence parallelism).
GeometryResult resolve_geometry(const BatchOptions& o, const MeshDims& dims, const ModelConfig& mc);

}  // namespace shardtrain
