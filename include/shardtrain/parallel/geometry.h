// shardtrain batch geometry: how one optimizer step's global batch is laid out over the mesh,
// resolved once from the options and the mesh's dimensions. Training (resolve_parallel,
// parallelize.h) and `--mode plan` both call resolve_geometry, so a plan is never made for a run
// that training would refuse, and each dimension's divisibility rule is written here alone.
// (`--mode plan` with `--micro-batch` and no `--global-batch` plans for global batch = micro-batch
// x dp: memory depends on the micro-batch.)
//
// Units: sequences (rows of T = seq_len tokens) and tokens. Terms as Megatron and torchtitan use them:
//   global batch  sequences per optimizer step over the whole mesh (--global-batch)
//   dp            data-parallel ranks reading different rows: dp_replicate x dp_shard (ranks that
//                 differ only in cp or tp read the same rows)
//   per_rank      sequences a data-parallel rank reads per step: global_batch / dp
//   micro_batch   sequences per forward/backward (--micro-batch; 0 = per_rank, no accumulation)
//   accum         micro-batches per step (gradient accumulation): per_rank / micro_batch
// Each dimension's share of a micro-batch's tokens:
//   cp            context parallelism splits every sequence over the CP group (head-tail: 2·cp
//                 chunks of T / (2·cp) tokens, CP rank r holding chunks r and 2·cp−1−r), so T must
//                 divide by 2·cp: cp_tokens = micro_batch x T / cp rows per CP rank.
//   tp            sequence parallelism splits the rows a rank holds evenly over the TP group:
//                 tp_tokens = micro_batch x T / cp / tp rows of activations per TP rank.
// The loss is the mean over every target token of the global batch (global_batch x T, counted
// before any split; never a mean of per-rank means). A rank's gradients are scaled by
// 1 / rank_tokens, rank_tokens = per_rank x T / cp: the target tokens it holds per step (its own
// rows; a TP group's ranks hold the same tokens). The reduce-scatter over the FSDP shard group
// (dp_shard x cp ranks) and the replica all-reduce divide the sum by dp x cp, so each token's
// gradient enters with weight (1 / rank_tokens) / (dp x cp) = 1 / (global_batch x T): the global
// mean, equal to the non-CP run's. The step's loss sums the token losses of every rank that
// counts it (Mesh::counts_loss: every CP rank, a TP group's first) and divides by global_batch x T.
// The max_position_embeddings check applies to T, the sequence's global length.
//
// Layer: parallel (between io and train). Pure: no communicator, no I/O; the same inputs give the
// same result (and the same refusal message) on every rank.
#pragma once

#include <cstdint>
#include <string>

#include "shardtrain/model/config.h"
#include "shardtrain/runtime/mesh.h"

namespace shardtrain {

// How the ranks of a CP group move K/V (option '--cp-comm'; the attention room, context_parallel.h):
// Ring: K/V blocks travel around the group, one exchange per step overlapped with that step's
// block attention, dK/dV travel back in the backward. AllGather: the group all-gathers K/V before
// attention (Llama 3) and reduce-scatters dK/dV after it.
enum class CpComm { Ring, AllGather };
// Parses "ring" / "allgather"; throws std::invalid_argument naming option '--cp-comm'.
CpComm parse_cp_comm(const std::string& s);
const char* cp_comm_name(CpComm c);  // "ring", "allgather": the option's spelling

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
  // Target tokens a rank holds per step: per_rank x T / cp (the gradient scale's denominator; the
  // header's comment says why this gives the global mean).
  int64_t rank_tokens() const { return int64_t{per_rank} * seq_len / dims.cp; }
  // Rows a CP rank holds of a micro-batch: micro_batch x T / cp (T / cp of every sequence).
  int64_t cp_tokens() const { return micro_tokens() / dims.cp; }
  // Activation rows a TP rank holds of a micro-batch under sequence parallelism: cp_tokens / tp.
  int64_t tp_tokens() const { return cp_tokens() / dims.tp; }
};

// The geometry, or `refusal` (non-empty) naming the option, the numbers and the rule it breaks.
struct GeometryResult {
  BatchGeometry geometry;
  std::string refusal;
  bool ok() const { return refusal.empty(); }
};

// Rules, in this order (the first that fails is the refusal):
//   T >= 1 and T <= the model's max_position_embeddings (T: the global length, whatever cp);
//   2·cp divides T (the head-tail split);
//   dp divides the global batch; micro_batch divides global_batch / dp;
//   tp divides the model's attention heads, key/value heads and intermediate size
//   (check_tensor_parallel, model.h) and the rows a rank holds of a micro-batch, cp_tokens
//   (sequence parallelism).
GeometryResult resolve_geometry(const BatchOptions& o, const MeshDims& dims, const ModelConfig& mc);

}  // namespace shardtrain
