// shardtrain pipeline parallelism (issue 42): the room of the mesh's pp dimension. What a pipeline
// rank holds (its chunks of blocks and their units) and how activations and their gradients travel
// between the ranks of a PP group (Mesh::pp_data: one rank per stage, equal in every other
// coordinate). The order of the work is the schedule's (pipeline_schedule.h); the trainer runs it
// (src/train/trainer.cpp run_action) and never asks whether pp > 1: one stage is the layout with
// one chunk over [0, L), whose units are the whole model's and which sends nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/backend.h"
#include "shardtrain/config.h"
#include "shardtrain/model.h"
#include "shardtrain/pipeline_schedule.h"
#include "shardtrain/runtime.h"
#include "shardtrain/unit_source.h"  // Reshard

namespace shardtrain {

// Options '--pp-schedule', '--pp-virtual', '--pp-layers', '--pp-reshard' (TrainConfig::pp). The number of stages is
// the mesh's (MeshDims::pp, option '--pp').
struct PipelineOptions {
  PipelineKind kind = PipelineKind::OneFOneB;
  int chunks_per_rank = 1;   // v (interleaved only)
  std::vector<int> layers;   // blocks per chunk by hand (S = p v numbers); empty: pipeline_split's even split
  // '--pp-reshard': per-step (PerPass: a stage gathers each unit once per step and reduce-scatters
  // its gradient once) or per-microbatch (PerUse). Used with p > 1 only (parallelize).
  Reshard reshard = Reshard::PerPass;
};

// A run's pipeline: p ranks (stages), v chunks per rank, the S + 1 chunk boundaries over the L
// blocks (pipeline_split; chunk c on pipeline rank c mod p, model.h BlockRange).
struct PipelineLayout {
  PipelineKind kind = PipelineKind::OneFOneB;
  int ranks = 1, chunks_per_rank = 1;
  std::vector<int> bounds;  // S + 1 numbers, bounds[0] = 0, bounds[S] = L
  int chunks() const { return ranks * chunks_per_rank; }
  // The chunks pipeline rank r holds, in model order: r, r + p, ..., r + (v-1) p.
  std::vector<int> rank_chunks(int r) const;
  int rank_of(int chunk) const { return chunk % ranks; }
  // The schedule of one optimizer step over m micro-batches (backward = false: evaluation's
  // forwards). One stage (ranks == 1): gradient accumulation (schedule.h), today's loop, exactly.
  std::unique_ptr<Schedule> schedule(int microbatches, bool backward = true) const;
};

// The layout of `pp` stages for model `mc` and options `o`, checked: "" in *why, or *why says what
// is refused, naming the options and numbers: more chunks than blocks, '--pp-layers' not P x V
// numbers or not summing to L (pipeline_split), '--pp-virtual' or '--pp-schedule interleaved'
// without the other, and the schedule's rule on the micro-batches per step (`microbatches`; 0: not
// checked) (pipeline_schedule_problem). pp == 1 ignores the schedule options: one chunk [0, L).
PipelineLayout resolve_pipeline(const ModelConfig& mc, int pp, const PipelineOptions& o, int microbatches,
                                std::string* why);

// The units pipeline rank `r` holds, and, per chunk of it (rank_chunks order), the chunk's
// BlockRange mapped into them: the chunks' llama_stage_units (TP rank tp_rank's slices of tp)
// concatenated in model order. The tied embedding (unit 0) lives on both the first and the last
// chunk's rank. One stage: llama_units and the identity map, exactly the whole model's plan.
struct RankUnits {
  std::vector<UnitSpec> units;
  std::vector<BlockRange> ranges;  // per chunk of the rank
  int embedding = -1;              // index of model unit 0 in `units`, -1 when not held
  // True when this rank holds the tied embedding as the last chunk's LM head but not as the first
  // chunk's embedding (p > 1): its gradient is summed with the first stage's, and its elements are
  // counted in the gradient norm and saved by the first stage only.
  bool tied_copy = false;
};
RankUnits pipeline_rank_units(const ModelConfig& mc, const PipelineLayout& pl, int r, int tp = 1, int tp_rank = 0);

// Activations between the stages of one PP group, on its Comm (Mesh::pp_data: the backend's
// buffers). Chunk c's forward output goes to chunk c + 1's rank, its input gradient to chunk c - 1's.
// Tags name (chunk, direction); messages of one tag arrive in the order sent (MPI's non-overtaking
// rule), and every schedule sends and receives each chunk's micro-batches in increasing order.
// A send returns at once: the buffer belongs to the link until flush() or until the link is done
// with it (done_sending(ptr) false while a send of that buffer is in flight).
// Counts its transfers for CommDim::Pp: calls (sends and receives), bytes sent, issued time (from
// start to observed completion), exposed time (the compute thread waiting in recv / flush).
template <typename C> class StageLink {
 public:
  // comm: the PP group (comm.world_size() == pl.ranks, comm.rank() = this rank's stage).
  StageLink(Comm& comm, const PipelineLayout& pl);
  ~StageLink();
  // Chunk c's input (c > 0): n elements from chunk c - 1's rank into `recv` (backend memory); blocks
  // until they arrived.
  void recv_input(int chunk, C* recv, size_t n);
  // d(loss)/d(chunk c's output) (c < S - 1), from chunk c + 1's rank; blocks.
  void recv_output_grad(int chunk, C* recv, size_t n);
  // Chunk c's output to chunk c + 1's rank; nonblocking.
  void send_output(int chunk, const C* send, size_t n);
  // d(loss)/d(chunk c's input) to chunk c - 1's rank; nonblocking.
  void send_input_grad(int chunk, const C* send, size_t n);
  // True when no send of a buffer starting at `p` is in flight (tests the sends: drives MPI).
  bool done_sending(const C* p);
  // Waits for every send in flight (the end of a step: every buffer is free again).
  void flush();
  // Accumulated since construction: calls, bytes, issued and exposed seconds.
  int64_t calls() const { return calls_; }
  double bytes() const { return bytes_; }
  double issued_s() const { return issued_s_; }
  double exposed_s() const { return exposed_s_; }

 private:
  struct Send;
  void recv(int peer, int tag, C* buf, size_t n);
  void send(int peer, int tag, const C* buf, size_t n);
  void reap(bool wait);
  Comm& comm_;
  PipelineLayout pl_;
  std::vector<std::unique_ptr<Send>> sends_;
  int64_t calls_ = 0;
  double bytes_ = 0, issued_s_ = 0, exposed_s_ = 0;
};

// Tied embeddings under PP (Megatron-LM's embedding group): the first and the last stage of a PP
// group (comm: Mesh::pp_data) each hold unit 0 with the same shard plan; after a step's backward
// each adds the other's `n` gradient shard elements (backend memory of `be`) to its own, so both
// hold the sum, bitwise the same (a + b = b + a), and AdamW keeps both copies identical. Collective
// over those two ranks; a no-op on every other stage and with one stage. Returns the bytes sent.
template <typename T> double sum_tied_grads(Comm& comm, Backend<T>& be, T* grad, size_t n);

}  // namespace shardtrain
