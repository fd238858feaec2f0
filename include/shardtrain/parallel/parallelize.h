// shardtrain's parallel layer: what each dimension of the mesh does to a run, applied from outside
// the model (the model sees parameters through UnitSource and collectives through the ops it is
// given; it never touches a communicator or the mesh).
//
// resolve_parallel resolves a run's plan before anything is allocated (the batch geometry, the
// pipeline's stages, the schedules: ParallelPlan); parallelize() then builds, from the mesh, that
// plan, the model config and the backends, everything a run needs for its layout — the sharded
// state, the unit source, each dimension's operations for the model, the checkpoint layout — and
// keeps the plan (ParallelRun::plan). The trainer makes these two calls and never asks which
// dimensions are on:
//   dp_shard (FSDP) and dp_replicate (HSDP): the ShardedState over the shard group (its replica
//        communicator under hybrid sharding) and the UnitPipeline that gathers units and
//        reduce-scatters their gradients (shard layer);
//   tp: every unit holds this rank's TP slices (llama_units(c, tp, tp_rank)), the model's
//        TensorParallelOps is the TP group's (TpGroup), replicated parameters' gradients are summed
//        over the group, and checkpoints store the canonical rows (TpCheckpointLayout, io);
//   cp: FSDP shards over dp_shard x cp; the model's ContextParallelOps is a CpAttention on the
//        mesh's CP communicator (--cp-comm ring | allgather); every rank of a CP group reads the
//        same batch rows and gives the model its head-tail rows of each sequence (SequenceSplit,
//        below); the memory plan (cp_memory) and checkpoints know it;
//   pp:  resolve_parallel resolves the stages and the schedules with the batch geometry (one
//        ParallelPlan); every rank holds its stage's units (pipeline_rank_units), a StageLink
//        moves activations between the stages, StageRunner runs the schedule's actions
//        (pipeline.h, stage_runner.h), and the memory plan asks layout_memory (below).
//
// Layer: between io and train. It uses runtime, backend, shard, model, data (StageRunner's
// micro-batches) and io; train uses it; runtime, backend, shard, model, data and io never include it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/parallel/schedule.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"
#include "shardtrain/parallel/context_parallel.h"
#include "shardtrain/parallel/expert_parallel.h"
#include "shardtrain/parallel/geometry.h"  // CpComm
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/model/model.h"  // AttentionKind, TokenLayout
#include "shardtrain/shard/shard.h"
#include "shardtrain/parallel/tensor_parallel.h"

namespace shardtrain {

// The run's layout as a checkpoint records it (train.h train_config_json's world_size,
// shard_group_size and tp; the format's TP tables).
struct SavedLayout {
  int world_size = 1;        // the ranks whose rows the file holds (its plan's world size)
  int shard_group_size = 1;  // the saving run's shard group, dp_shard x cp (== world_size but under hybrid sharding)
  int tp = 1;
  // The saving run's mesh (tp, cp, dp_shard, dp_replicate) and, tp > 1, format version 4's tables;
  // cp > 1 makes the file version 5 (io, checkpoint.h).
  TpRecord tp_record;
};

// How a run's state maps to what its checkpoints store. The trainer saves and restores through
// this alone, at every layout. Collective calls are made by every rank of the world, in the same
// order.
class CheckpointLayout {
 public:
  virtual ~CheckpointLayout() = default;
  // Whether this rank's rows go into the file (CheckpointOptions::write_shards).
  virtual bool writes_shards() const = 0;
  // Collective over the world. The tensors a save writes for `live` (this rank's sharded tensors,
  // train.h checkpoint_tensors): `live` itself, or rows this layout owns (owns_saved_rows).
  virtual ShardedTensors for_save(Comm& world, const ShardedTensors& live) = 0;
  // True when for_save returns host rows that this layout owns and that stay unchanged until the
  // next for_save (which the trainer calls only after the previous save's write): a snapshot may
  // borrow them, even for a background write.
  virtual bool owns_saved_rows() const = 0;
  // Restore: load_checkpoint fills load_target(live) (live itself, or this layout's rows for the
  // same tensor names), then finish_load (collective over the world) moves them into `live`.
  virtual ShardedTensors load_target(const ShardedTensors& live) = 0;
  virtual void finish_load(Comm& world, const ShardedTensors& live) = 0;
  virtual const SavedLayout& saved_layout() const = 0;
};

// The mesh's dimensions that communicate in a step, in the order the step log lists them.
enum class CommDim { Fsdp, Tp, Cp, Pp, Ep };

// One dimension's communication, accumulated since the run started (or, as a difference, over an
// interval).
struct DimComm {
  int64_t calls = 0;     // collectives (or transfers) started
  double bytes = 0;      // bytes this rank sent (ring algorithms: docs/scaling.md, bytes_per_step)
  double issued_s = 0;   // time in flight, summed over calls
  double exposed_s = 0;  // time the compute thread waited for them (blocking calls: all of issued_s)
};

// Every dimension's communication in one structure: what the step log, the metrics and TensorBoard
// read. FSDP's comes from the unit pipeline's queues (CommTimes), TP's from its group (TpCommStats),
// CP's from its attention (CpCommStats: ring shifts or collectives, their bytes, time in flight and
// the part the compute thread waited); PP's from its StageLink (pipeline.h), zero with one stage;
// EP's from its group (EpCommStats: the MoE blocks' all-to-alls and counts exchanges).
struct CommStats {
  static constexpr int kDims = 5;
  std::array<DimComm, kDims> dim;
  DimComm& operator[](CommDim d) { return dim[static_cast<size_t>(d)]; }
  const DimComm& operator[](CommDim d) const { return dim[static_cast<size_t>(d)]; }
  static const char* name(CommDim d);  // "fsdp", "tp", "cp", "pp", "ep" (the metrics' prefixes)
  double exposed_s() const;            // summed over the dimensions
  CommStats& operator+=(const CommStats& b);
  CommStats operator-(const CommStats& b) const;
};

// A training run's plan, resolved once before anything is allocated (resolve_parallel): the batch
// geometry, the pipeline's stages and the schedules that StageRunner (stage_runner.h) runs. With one
// stage the pipeline is one chunk [0, L) and the schedules are gradient accumulation: the trainer
// never asks which. Copyable (the schedules are immutable and shared); parallelize() keeps it in
// ParallelRun::plan, the run's only copy.
struct ParallelPlan {
  BatchGeometry geometry;   // resolve_geometry's: identical on every rank
  PipelineLayout pipeline;  // the stages (resolve_pipeline); empty bounds: one stage, set by parallelize
  // An optimizer step's actions over geometry.accum micro-batches (PipelineLayout::schedule), and an
  // evaluation batch's (the same micro-batches' forwards). nullptr where the plan was not resolved
  // (tests that lay a run out without training it).
  std::shared_ptr<const Schedule> schedule, eval_schedule;
};

// Collective over mesh.world(). The plan of a training run on `mesh` with these options, checked in
// this order, each refusal thrown as CollectiveError (origin 0, the same message on every rank):
// training_refusal (what the mesh cannot train with this attention), resolve_geometry's refusal,
// resolve_pipeline's (pp = mesh.dims().pp, over geometry.accum micro-batches), then
// check_pipeline_transfers (pipeline.h: grouped transfers on a stream-ordered Comm). The lines the
// run logs about it (check_pipeline_transfers' "pipeline: transfers grouped ...") are appended to
// *notes.
ParallelPlan resolve_parallel(const Mesh& mesh, const ModelConfig& mc, const BatchOptions& batch,
                              const PipelineOptions& pp, AttentionKind attention, std::vector<std::string>* notes);

struct ParallelOptions {
  OverlapConfig overlap;     // --overlap, --prefetch, --comm-progress (shard.h)
  bool reduce_bf16 = false;  // --reduce-dtype bf16 (mixed precision only)
  bool checkpoints = false;  // the run saves, resumes or initializes from a checkpoint
  CpComm cp_comm = CpComm::Ring;  // --cp-comm: how a CP group (cp > 1) moves K/V
  ParallelPlan plan{};            // resolve_parallel's; default: one stage (bounds set by parallelize), no schedules
  // --pp-reshard (TrainConfig::pp.reshard): the unit pipeline's Reshard when plan.pipeline.ranks > 1;
  // one stage is always Reshard::PerUse (gradient accumulation as before pipelines).
  Reshard pp_reshard = Reshard::PerUse;
};

// Everything a run holds for its layout, in compute type C (float; bf16 over fp32 master shards).
// Members are destroyed in reverse order: the checkpoint layout and the unit pipeline before the
// state they read.
template <typename C> struct ParallelRun {
  std::unique_ptr<ShardedState<float>> state;  // fp32 master shards and gradient shards
  std::unique_ptr<TpGroup<C>> tp;              // tp > 1: the TP group's collectives; else nullptr
  std::unique_ptr<CpAttention<C>> cp;          // cp > 1: the CP group's attention; else nullptr
  std::unique_ptr<EpGroup<C>> ep;              // ep > 1: the EP group's all-to-alls; else nullptr
  ParallelPlan plan;  // options.plan: the geometry, the stages (one stage: one chunk [0, L)), the schedules
  RankUnits stage;                             // this rank's chunks and their units (pipeline_rank_units)
  std::unique_ptr<StageLink<C>> pp;            // pp > 1: activations between the stages; else nullptr
  std::unique_ptr<UnitSource<C>> units;        // the model's UnitSource over `state` (a UnitPipeline; under
                                               // EP a GroupedUnits: the expert units in a pipeline of their own)
  OverlapConfig overlap;                       // the unit pipelines' (--comm-progress thread may fall back to poll)
  std::unique_ptr<CheckpointLayout> checkpoint;  // nullptr without checkpoints (options.checkpoints)
  // The model's TensorParallelOps (nullptr: no TP) and ContextParallelOps (nullptr: no CP); valid
  // while this lives.
  TensorParallelOps<C>* tp_ops() const { return tp.get(); }
  ContextParallelOps<C>* cp_ops() const { return cp.get(); }
  ExpertParallelOps<C>* ep_ops() const { return ep.get(); }  // nullptr: no EP
  // After the backward of a step: gradients of parameters every rank of a group holds whole (TP's
  // RMSNorm weights) summed over the group; the tied embedding's gradient summed between the first
  // and the last pipeline stage (sum_tied_grads). No-op where no dimension replicates a parameter.
  void finish_grads();
  // The unit whose gradient elements this rank leaves out of the gradient norm, -1 for none: the
  // last stage's copy of the tied embedding (the first stage counts it).
  int unit_not_in_norm() const { return stage.tied_copy ? stage.embedding : -1; }
  // Every dimension's communication since the run started. (With CP: CpAttention::stats, which also
  // takes the backend's block-attention tile counters: take the step's counts before this.)
  CommStats comm_stats() const;
};

// The rows of a micro-batch one rank gives the model (LlamaModel::forward): every rank of a CP group
// reads the same B whole sequences of T tokens (Mesh::dp_index excludes cp) and keeps its head-tail
// rows of each (context_parallel.h cp_rows for its CP coordinate): tokens, targets, and the layout
// the model needs under CP — each row's global position (the whole sequence's layout position when
// given, e.g. restarting per document, else the row's index in its sequence) and, when given, its
// document id and its padding flag (TokenLayout::real). The layout is computed on the whole sequence first (document_layout needs the
// tokens before the row), then picked. Without CP (cp = 1) take() returns its inputs unchanged:
// rows() = T, the pointers as given (bitwise the run without CP).
class SequenceSplit {
 public:
  // T: the sequence length; std::invalid_argument when T does not split over the mesh's cp
  // (cp_split_problem; resolve_geometry refuses it first).
  SequenceSplit(const Mesh& mesh, int T);
  int rows() const { return Tl_; }  // T / cp: each sequence's rows a rank holds
  // tokens, targets: host [B, T] (targets may be nullptr: then targets() is nullptr); whole: the
  // whole sequences' layout (host [B, T] arrays or nullptr). Returns the layout of the rows kept
  // (under CP always with positions), valid until the next take(); tokens() and targets() are the
  // rows kept [B, rows()], valid as long.
  TokenLayout take(const int32_t* tokens, const int32_t* targets, const TokenLayout& whole, int B);
  const int32_t* tokens() const { return tok_; }
  const int32_t* targets() const { return tgt_; }

 private:
  int T_ = 0, Tl_ = 0;
  std::vector<int32_t> rows_;                 // cp_rows of this rank (empty without CP)
  std::vector<int32_t> tok_l_, tgt_l_, pos_l_, doc_l_, real_l_;
  const int32_t* tok_ = nullptr;
  const int32_t* tgt_ = nullptr;
};

// The plan of the units one rank of the mesh `d` holds: TP rank `tp_rank`'s slices of every unit
// (llama_units(mc, d.tp, tp_rank)), sharded over its FSDP shard group (d.fsdp() = dp_shard x cp
// ranks). parallelize() builds the state from it; the memory plan sizes it.
// With a pipeline (pl.ranks > 1): pipeline rank pp_rank's units only (pipeline_rank_units).
// Under EP (d.ep > 1) EP rank ep_rank's expert units too, over the expert shard group (fsdp / ep ranks).
ShardPlan rank_unit_plan(const ModelConfig& mc, const MeshDims& d, int tp_rank = 0, const PipelineLayout* pl = nullptr,
                         int pp_rank = 0, int ep_rank = 0);

// How the mesh divides a parameter, in the memory plan's words: "G" (FSDP), "G ranks of a shard
// group" (hybrid sharding), "(TP N x G), norms replicated over TP" (tensor parallelism), "G; the
// experts 1/N per EP index over G/N ranks" (expert parallelism); G =
// dp_shard x cp, written "D x C" with cp > 1.
std::string sharding_words(const MeshDims& d);

// Host memory the checkpoint layout of a run on mesh `d` keeps for its saves (with checkpoints):
// TP's canonical rows, every saved tensor's rows of a world-size plan, made once and borrowed by
// every save; none (elements 0) where saves snapshot the live shards. The memory plan multiplies
// `elements` by the tensors a save writes.
struct LayoutRows {
  int64_t elements = 0;  // per tensor
  std::string name;      // the memory plan's line
};
LayoutRows checkpoint_layout_rows(const ModelConfig& mc, const MeshDims& d);

// What a training run cannot do yet on mesh `d`: "" or the refusal, the same on every rank (today
// "": every mesh resolve_mesh_dims accepts trains; a dimension that exists in the mesh before the
// model runs it refuses here, so that a run never computes wrong numbers). resolve_parallel refuses
// with it first, before anything is allocated; --mode plan refuses with it too.
// With cp > 1 and '--attention exact' the refusal (CP runs the tiled block kernels only).
std::string training_refusal(const MeshDims& d, AttentionKind attention);

// Context parallelism in the memory plan (memory_plan.h), per rank, for micro-batches of B
// sequences of T tokens on mesh `d` (elem_bytes: the compute type's). With cp = C, r = B x T / C
// rows held, KV' = (NKV / tp) x HD and Q' = (NH / tp) x HD the widths of a TP rank's K/V and Q:
//   rows      T / C: each sequence's rows a rank holds; every activation buffer is the model's
//             for T / C tokens (activation_bytes(mc, options, B, T / C, ...)), so activations
//             fall as 1 / C (CP attention is blockwise: no [T, T] probabilities);
// and the scratch of the CP attention (CpAttention, context_parallel.h: kept between calls, so the
// forward's and the backward's add up), with 4-byte lse / dsum (S) and int32 positions and
// document ids:
//   ring      elem_bytes x (12 x r x KV' + r x Q') + 4 x 2 x r x NH/tp + 4 x 4 x r: K and V
//             arriving, double-buffered (4 blocks of r x KV'); the backward's dK and dV of the
//             visiting block and the partial sums arriving, double-buffered (8); the merge's y;
//             lse and dsum; positions and document ids, 2 buffers each;
//   allgather elem_bytes x 4 x T x KV' + 4 x r x NH/tp + 4 x 2 x T: one sequence at a time, the
//             gathered K and V of all T rows and, in the backward, their gathered gradients before
//             the reduce-scatter; dsum; the sequence's positions and document ids.
// cp = 1: rows = T, no CP scratch (kv_bytes 0), and the words of the plan as before CP. When
// CpAttention's buffers change, this changes with them (a test compares the two once the model
// runs CP).
struct CpMemory {
  int rows = 0;             // T / C
  std::string rows_words;   // "B x T tokens", or "B x T / C = B x rows tokens of each sequence (CP C)"
  int64_t kv_bytes = 0;     // the CP attention's scratch (0: none)
  std::string kv_name, kv_detail;  // the memory plan's line
  // allgather over MPI (host Comm): Open MPI's MPI_Ireduce_scatter_block (libnbc,
  // ompi/mca/coll/libnbc/nbc_ireduce_scatter_block.c) reduces the whole input to the group's first
  // rank along a binomial tree; each receiving rank touches one temporary of the whole input per
  // round it receives in, up to two (alternating): the first rank min(2, ceil(log2 cp)) of them.
  // For dK and dV of one chunk, started together: n x 2 x T x hk x HD x elem_bytes (0 for ring).
  int64_t mpi_reduce_scatter_bytes = 0;
};
CpMemory cp_memory(const ModelConfig& mc, const MeshDims& d, CpComm method, int B, int T, size_t elem_bytes);

// "1,234,567": the memory plan's counts.
std::string with_commas(int64_t v);

// One line of a rank's memory plan (memory_plan.h MemoryPlan).
struct MemoryLine {
  std::string name;    // e.g. "AdamW m and v shards"
  int64_t bytes = 0;   // per rank
  std::string detail;  // how it is computed, e.g. "2 x 4 B x 31,457,280 elements"
  // Host memory in a GPU rank's (device) plan: listed, not counted in total() (the checkpoint
  // snapshot's pinned host memory).
  bool host = false;
};

// What the mesh's tp, cp and pp make of one rank's memory plan (memory_plan.h, which adds the
// shards, the FSDP buffers, the checkpoint's rows and the process around it): the units the rank
// holds, its activations and the buffers of the dimensions' communication. Every rank of a pipeline
// stage has the same (shards differ by at most one element per unit).
struct LayoutMemoryInput {
  ModelConfig model;
  ModelOptions options;   // recompute, attention, mask, loss chunk (train.h model_options)
  MeshDims dims;          // the run's mesh
  // The stages (ranks == dims.pp; one stage: the whole model), the pipeline rank planned and the
  // micro-batches of an optimizer step (BatchGeometry::accum: the schedule's m).
  PipelineLayout pipeline;
  int pp_rank = 0;
  int microbatches = 1;
  Reshard pp_reshard = Reshard::PerPass;  // --pp-reshard (pipeline.ranks > 1 only)
  CpComm cp_comm = CpComm::Ring;          // --cp-comm (cp > 1 only)
  int micro_batch = 1, seq_len = 1;       // B sequences of T tokens per micro-batch
  size_t elem_bytes = 4;                  // the compute type's: 2 (bf16) or 4
  bool cuda = false;                      // a GPU rank's plan (the host Comm's MPI buffers are not in it)
};
// The plan's parts, in the order the plan lists them (each list may be empty):
struct LayoutMemory {
  ShardPlan plan;  // the units this rank shards: rank_unit_plan(model, dims, 0, &pipeline, pp_rank)
  // The parameters they hold, whole, as the shard lines say it: "N" (the model's), or with a
  // pipeline "N of stage s of P: blocks [b, e) + embedding ...;".
  std::string params_words;
  // The stage in a plan's title, "" with one stage: " of pipeline stage s of P" (training's start-up
  // report), ", pipeline stage s of P (SCHEDULE[ v V], m micro-batches per step)" (--mode plan's).
  std::string stage_of, stage_schedule;
  // activation_bytes (model.h) for the rows this rank holds: B x T / cp (cp_memory's rows), 1 / tp
  // of them under sequence parallelism; its `recompute` is the plan's recomputed-activations line.
  ActivationBytes activations;
  // Expert parallelism (one stage): the bytes more that the worst routing imbalance grows the
  // expert rows to (activation_bytes' worst case less the balanced figure counted above), and its
  // words; 0 and "" otherwise.
  int64_t ep_worst_extra = 0;
  std::string ep_worst_words;
  // After the FSDP buffers: with a pipeline under --pp-reshard per-step, the stage's units gathered
  // and their gradient accumulators through the step.
  std::vector<MemoryLine> held;
  // After the FSDP collectives' MPI buffers: the TP collectives' (CPU, tp > 1).
  std::vector<MemoryLine> comm;
  // The activations kept for backward: the whole model's, or with a pipeline the contexts in flight
  // (pipeline_contexts, each its chunk's context_bytes) and under zero-bubble their deferred
  // weight-gradient inputs; then CP's K/V scratch and the CPU's MPI reduce-scatter buffers (cp_memory).
  std::vector<MemoryLine> kept;
  // After the recomputed activations: the block scratch and the head (one stage), or the model's
  // shared scratch, StageLink's receive and send buffers and the tied embedding's gradient receive
  // buffer (a pipeline).
  std::vector<MemoryLine> scratch;
};
// std::invalid_argument when pipeline.ranks is not dims.pp or pp_rank is outside it; model.h's for a
// bad recompute, attention or loss chunk.
LayoutMemory layout_memory(const LayoutMemoryInput& in);

// Builds the run's layout. Collective only through what it constructs (none of it communicates
// at construction). Throws std::bad_alloc (allocation; the trainer agrees on it),
// std::invalid_argument when the mesh does not fit the model (resolve_geometry refuses this first).
// `be16`: the bf16 backend, required when C is bf16.
template <typename C>
ParallelRun<C> parallelize(const Mesh& mesh, const ModelConfig& mc, Backend<float>& be, Backend<bf16>* be16,
                           const ParallelOptions& o);

}  // namespace shardtrain
