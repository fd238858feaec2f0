// StageRunner (parallel layer, the room of the mesh's pp dimension with pipeline.h): runs a
// schedule's actions (schedule.h, pipeline_schedule.h) on this rank's model chunks: the
// micro-batches' rows (read through the caller's MicroBatchReader, split over CP), one model Context
// per micro-batch and chunk in flight, and the activations to and from the neighbouring stages
// (StageLink, pipeline.h). The trainer's step and evaluate() (train.h) hand it every action of this
// rank and never ask how many stages there are: with one stage the schedule is gradient
// accumulation over one chunk [0, L), whose calls are the model's whole-model ones on its own
// context (bitwise the loop before pipelines).
#pragma once

#include <cstdint>
#include <array>
#include <functional>
#include <map>
#include <string>
#include <memory>
#include <vector>

#include "shardtrain/data/data.h"
#include "shardtrain/runtime/mesh.h"
#include <nlohmann/json_fwd.hpp>
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/parallelize.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/parallel/schedule.h"

namespace shardtrain {

// Where a runner's micro-batches come from (the training layer's data and attention mask: train.h
// batch_reader). Fills `tokens` and `targets` (host [count, T] row-major, T the runner's seq_len)
// with sequences [first, first + count) of global batch `index` of `split` (data.h fill_batch) and
// returns their layout for the model (TokenLayout: positions and document ids of the whole
// sequences, or none), which stays valid until the next call.
using MicroBatchReader =
    std::function<TokenLayout(Split split, int64_t index, int first, int count, int32_t* tokens, int32_t* targets)>;

template <typename C> class StageRunner {
 public:
  // Borrows everything but `read` (all must outlive the runner). seq_len: T, the tokens of a
  // sequence; per_rank: sequences per rank per step (global batch / dp); micro_batch: sequences per
  // micro-batch (B); the micro-batch count is per_rank / micro_batch. stage: ParallelRun::stage (its
  // ranges are this rank's chunks, in PipelineLayout::rank_chunks order); link: nullptr with one
  // stage; be: the model's backend. Throws std::invalid_argument when T does not split over the
  // mesh's cp (SequenceSplit).
  StageRunner(const Mesh& mesh, Backend<C>& be, LlamaModel<C>& model, UnitSource<C>& f, const RankUnits& stage,
              const PipelineLayout& pl, StageLink<C>* link, MicroBatchReader read, int seq_len, int per_rank,
              int micro_batch);
  // Allocates now what the first step would allocate, so that memory runs out at set-up: with one
  // stage the model's activations for a micro-batch (LlamaModel::reserve); a pipeline's contexts are
  // made by their first forward (nothing here). Throws std::bad_alloc.
  void reserve();
  // Where the micro-batches come from: `split`'s batch `index` (the training step, or the
  // evaluation's batch number). Call before the actions of a step or of an evaluation batch.
  void begin(Split split, int64_t index);
  // Runs this rank's actions of `schedule` (those of its pipeline coordinate), in order. Training:
  // grad_scale > 0 (the loss gradient's scale, head_backward, in the model's scalar type S: a
  // float model rounds it to float, a float64 one keeps it exact); evaluation: Forward actions only,
  // grad_scale 0. Returns the loss sum (nats) this rank computed: the last chunk's Backward in
  // training, its Forward in evaluation; else 0. Collective as the model calls are (the unit
  // source's group) and, with a pipeline, point-to-point with the neighbouring stages: the receive
  // of the next action that needs one in each direction is posted before the current action runs
  // (two buffers per direction), so it arrives during the current action's compute; with a grouped
  // link (stream-ordered Comms, pipeline.h) at the boundary before its action, grouped with the
  // finished action's send (pipeline_p2p_groups says which groups, in which order).
  double run(const Schedule& schedule, double grad_scale);
  // Mixture-of-experts models: the weights of the load-balancing loss and of the router z-loss in
  // the gradient of each training micro-batch (LlamaModel::set_aux_grad_scale; the trainer's coef /
  // this rank's sequences or micro-batches; times cp, below), and since the last take: the sum of
  // the micro-batches' load-balancing losses (LlamaModel::moe_aux_loss; the z-losses the same way,
  // take_z_sum; under CP every rank of the group holds the
  // group's value and adds 1 / cp of it; under PP the last stage, its statistics having come with
  // the activations and the gradient's weights going back with theirs: LlamaModel::aux_stats) and,
  // per block, the slots this rank's rows routed to each expert (every MoE block has E entries on
  // every rank, 0 for a block on another stage; empty for a dense block; all empty for a dense model).
  void set_aux_scale(double s, double z = 0) {
    aux_scale_ = s;
    z_scale_ = z;
  }
  double take_aux_sum();
  double take_z_sum();
  std::vector<std::vector<int64_t>> take_expert_counts();
  // After the last action of a step or evaluation batch: waits for the sends in flight; every
  // context is free again.
  void end();

  // The pipeline bubble since the last report (training steps only; issue 42, item 7). Collective
  // over mesh.world() when there is a pipeline; with one stage returns "" and does nothing (no
  // collective: the same on every rank). For the stages of the PP group of world rank 0:
  //   measured   each stage's idle fraction of the step's span (the longest stage's time from its
  //              first action to its end(), summed over the steps; every stage starts a step
  //              together, after the previous step's all-reduce): its waits for activations or their
  //              gradients (StageLink's exposed time) plus the time it finished before the longest;
  //   simulated  simulate() (pipeline_schedule.h) of `schedule` with each chunk's measured mean
  //              Forward, Backward, BackwardInput and BackwardWeight times (waits excluded);
  //   ideal      the schedule's formula (PipelineSchedule::ideal_bubble) with the chunks' mean times.
  // Writes pp_bubble (per stage, measured), pp_bubble_max (the largest stage's: the number TensorBoard
  // shows, arrays being metrics-file only), pp_bubble_simulated (per stage), pp_bubble_ideal and
  // pp_action_ms ({"forward", "backward", "backward_input", "backward_weight"}: per chunk, ms) into
  // *rec, and returns the step line's part " | pp bubble a, b (simulated c, d; ideal e)".
  std::string bubble_report(const Schedule& schedule, nlohmann::json* rec);

 private:
  struct MicroBatch {
    bool loaded = false;
    std::vector<int32_t> tok, tgt, pos, doc, real;
    TokenLayout layout;
  };
  MicroBatch& load(int m);
  double run_timed(const Action& a, double grad_scale);
  double run_action(const Action& a, double grad_scale);
  int local_chunk(int chunk) const;           // index into stage_.ranges
  typename LlamaModel<C>::Context& context(int m, int chunk);  // the one of (m, chunk), made on first use
  void release(int m, int chunk);

  const Mesh& mesh_;
  Backend<C>& be_;
  LlamaModel<C>& model_;
  UnitSource<C>& f_;
  const RankUnits& stage_;
  const PipelineLayout& pl_;
  StageLink<C>* link_;
  MicroBatchReader read_;
  int per_rank_, mb_;
  SequenceSplit split_;
  Split which_ = Split::Train;
  int64_t index_ = 0;
  std::vector<MicroBatch> batches_;
  std::vector<int32_t> tok_, tgt_;  // read_'s whole sequences
  // Contexts of (micro-batch, chunk) in flight, and free ones per local chunk for reuse.
  std::map<std::pair<int, int>, typename LlamaModel<C>::Context> live_;
  std::vector<std::vector<typename LlamaModel<C>::Context>> free_;
  Buffer<C> in_[2], grad_in_[2];  // received activations / output gradients [R, C], two each (one posted ahead)
  C* recv_buf_ = nullptr;         // where the running action's receive lands
  // Grouped link: this rank's actions of the last schedule run and its slots' starts (P2pOrder).
  std::vector<Action> slot_acts_;
  std::vector<size_t> slot_starts_;
  size_t rows_elems_ = 0;   // R x C: a micro-batch's activation rows of this rank
  size_t fwd_elems_ = 0, bwd_elems_ = 0;  // a message: the rows, then (MoE) the statistics' tail
  size_t tail_doubles_ = 0;                // that tail's doubles, both directions padded to one size
  std::vector<double> padded(std::vector<double> tail) const;  // a tail resized to tail_doubles_
  std::vector<double> read_tail(const C* buf, size_t doubles);  // the doubles after a message's rows
  void add_expert_counts(const typename LlamaModel<C>::Context* ctx);  // nullptr: the model's own
  void moe_losses(typename LlamaModel<C>::Context* ctx);               // ... the MoE losses' value and weights
  bool whole_ = false;      // one chunk over the whole model: the model's own context
  double aux_scale_ = 0, aux_sum_ = 0;  // MoE: set_aux_scale, take_aux_sum
  double z_scale_ = 0, z_sum_ = 0;      // ... the router z-loss's, take_z_sum
  std::vector<std::vector<int64_t>> expert_counts_;  // MoE: per block, slots per expert since take
  // Training actions since the last bubble_report: per local chunk, the seconds and counts of
  // Forward, Backward, BackwardInput, BackwardWeight (waits for the link excluded); the wall time
  // between begin() and end() and the link's exposed time in it.
  bool timing_ = false;
  std::vector<std::array<double, 8>> chunk_times_;
  double loop_s_ = 0, wait_s_ = 0, t_begin_ = 0, wait_begin_ = 0;
};

}  // namespace shardtrain
