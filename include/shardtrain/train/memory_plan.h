// shardtrain memory plan: the bytes one rank holds while training, by what they are for, from the
// model config, the batch geometry, the world size, the precision and the recompute mode. Printed
// by `--mode plan` (no launch needed) and at the start of every training run; checked against the
// measured peak (CPU: VmHWM of each rank, tests/bench/memory.py; GPU: peak device memory,
// tests/gpu/run.sh stage 5b).
//
// Accounting (ZeRO-3; Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
// Trillion Parameter Models", section 3: 16 bytes per parameter for mixed-precision Adam, here
// fp32 master + fp32 gradient + two fp32 moments = 16 bytes, divided by the world size):
//   parameter, gradient, AdamW m and v shards   4 + 4 + 4 + 4 bytes x shard elements (1/W; 1/G, the
//                                              shard group size (dp_shard x cp), with hybrid sharding)
//   FSDP buffers                               full-unit gather buffers (1 + prefetch with overlap on)
//                                              and gradient buffers (2 with overlap on) sized for the
//                                              largest unit, a shard-sized scatter buffer (+ the
//                                              bf16 copies of mixed precision), not divided by W
//   activations                                activation_bytes() of the model (model.h) for the rows a
//                                              rank holds: B x T / cp (context parallelism: each
//                                              sequence's T / cp rows; cp_memory, parallelize.h)
//   pipeline parallelism (--pp P > 1)          a pipeline rank's plan is its stage's (pipeline.h):
//                                              parameter, gradient and AdamW shards and the FSDP
//                                              buffers of its chunks' units only (rank_unit_plan with
//                                              the layout; the tied embedding on the first and last
//                                              stage); activations = the contexts StageRunner holds
//                                              (stage_runner.h: one per micro-batch and chunk in flight,
//                                              pooled per chunk and reused), each context_bytes (model.h:
//                                              its chunk's blocks, the embedding's ids on chunk 0, the
//                                              final norm's buffers and targets on chunk S - 1), under
//                                              zero-bubble + deferred_weight_bytes each (a context keeps
//                                              them once used); + the model's shared scratch
//                                              (activation_bytes - context_bytes of [0, L)); + the two
//                                              [R, C] receive buffers (input, output gradient); + on the
//                                              first and last stage with tied embeddings the 4 B x
//                                              shard receive buffer of the tied gradient's sum
//                                              (sum_tied_grads). Contexts per chunk: pipeline_contexts
//                                              (pipeline.h); the lines: layout_memory (parallelize.h).
//   CP K/V buffers (cp > 1)                    the CP attention's scratch: ring about 12 x (B x T / cp)
//                                              x NKV/tp x HD x elem bytes, allgather about 4 x T x
//                                              NKV/tp x HD x elem bytes (one sequence at a time); the
//                                              exact formula and why: cp_memory, parallelize.h
//   fp8 GEMM scratch (--precision fp8)         the largest of the blocks' projection GEMMs'
//                                              linear_fp8 scratch (fp8.h fp8_cuda_scratch_bytes: both
//                                              operands' fp8 copies, transposed where cuBLASLt's TN
//                                              layout needs them, and the 32 MiB cuBLASLt workspace),
//                                              rows B x T / cp, widths / tp; reused by every GEMM
//   token data                                 a token file held in memory (training maps its files: not counted)
//   runtime                                    the process before any of the above: libraries,
//                                              MPI, thread stacks (measured, see plan_memory)
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shardtrain/model/config.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/parallelize.h"  // MemoryLine, layout_memory
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/runtime/process_stats.h"  // current_rss_bytes, peak_rss_bytes (the plan's callers use them)
#include "shardtrain/train/train.h"

namespace shardtrain {

struct MemoryPlanInput {
  ModelConfig model;
  TrainConfig train;          // seq_len, micro_batch (resolved: > 0), recompute, attention, loss_chunk
  int world_size = 1;
  Precision precision = Precision::FP32;
  bool reduce_bf16 = false;
  bool cuda = false;          // plan device memory of a GPU rank (else CPU memory)
  uint64_t data_tokens = 0;   // tokens held in each rank's memory; 0: none (training memory-maps its token files)
  uint32_t token_bytes = 4;   // bytes per token held in memory
  int64_t runtime_bytes = 0;  // the process before allocation (CPU: VmRSS now; GPU: CUDA context etc.)
  // --overlap / --prefetch: 1 + prefetch gather buffers and 2 gradient buffers when on (UnitPipeline).
  OverlapConfig overlap{};
  // The run's mesh (mesh.h): what a rank holds of the model (parallelize.h rank_unit_plan: its TP
  // slices sharded over its shard group, dp_shard x cp ranks), what its checkpoint layout keeps,
  // its activations (with sequence parallelism under TP: activation_bytes(..., tp); under CP the
  // T / cp rows of each sequence and the K/V buffers of train.cp_comm). Unset: plain FSDP over
  // world_size.
  std::optional<MeshDims> mesh{};
  // The data collectives are stream-ordered (NCCL: --device cuda --gpu-comm nccl): one
  // reduce-scatter per unit (CommQueue's stream lane), whose result buffer is a whole shard and
  // whose fp32 widening (mixed precision, fp32 reduce) a whole unit, instead of slabs.
  bool stream_lane = false;
  // Pipeline parallelism: the run's stages (resolve_pipeline; ranks must equal mesh->pp, 1: none),
  // this rank's pipeline coordinate (the stage planned) and the micro-batches per optimizer step of
  // a data-parallel rank (BatchGeometry::accum: the schedule's m).
  PipelineLayout pipeline{};
  int pp_rank = 0;
  int microbatches = 1;
};

struct MemoryPlan {
  std::vector<MemoryLine> lines;  // MemoryLine: parallelize.h
  // The stage planned, for the plan's title ("" with one stage; parallelize.h LayoutMemory):
  // " of pipeline stage s of P" (training's start-up report), ", pipeline stage s of P (SCHEDULE,
  // m micro-batches per step)" (--mode plan).
  std::string stage_of, stage_schedule;
  int64_t total() const;  // the lines' bytes, host lines excepted
  // Expert parallelism: the bytes the worst routing imbalance adds to total() (the expert rows grow
  // to it) and its words; 0 otherwise (LayoutMemory::ep_worst_extra).
  int64_t worst_extra = 0;
  std::string worst_words;
  // A table for the log: one line per item, MiB and detail, then the total (and, worst_extra > 0,
  // the total at the worst routing imbalance).
  std::string format(const std::string& title) const;
};

// The plan for one rank; every rank's of a pipeline stage is the same (shards differ by at most one
// element per unit; the largest is counted). The mesh's dimensions' part is the parallel layer's
// (parallelize.h layout_memory). std::invalid_argument when in.pipeline.ranks is not the mesh's pp
// or pp_rank is outside it. Throws std::invalid_argument naming the option for a bad
// --activation-checkpointing / --attention / --loss-chunk.
MemoryPlan plan_memory(const MemoryPlanInput& in);

// Every pipeline stage's plan (in.pp_rank = 0 .. in.pipeline.ranks - 1): one plan without a pipeline.
std::vector<MemoryPlan> plan_stages(MemoryPlanInput in);
// The plans' tables (MemoryPlan::format), one after another, each under title(plan), joined by
// newlines: what training logs at start-up and --mode plan prints.
std::string format_plans(const std::vector<MemoryPlan>& plans,
                         const std::function<std::string(const MemoryPlan&)>& title);

// The runtime floor of a GPU rank when it cannot be measured (planning without a GPU): CUDA context,
// cuBLAS workspace, NCCL buffers. 1 GiB, an estimate (CUDA 12 context ~500 MiB on H100-class
// GPUs, NCCL ~200-400 MiB per communicator depending on channels).
inline constexpr int64_t kGpuRuntimeEstimate = int64_t{1} << 30;

// The largest micro-batch (sequences per rank) in [1, max_micro_batch] whose plan fits in
// `device_bytes`, or 0 if none does.
int largest_fitting_micro_batch(MemoryPlanInput in, int64_t device_bytes, int max_micro_batch = 1024);

}  // namespace shardtrain
