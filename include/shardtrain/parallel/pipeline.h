// shardtrain pipeline parallelism (issue 42): the room of the mesh's pp dimension. What a pipeline
// rank holds (its chunks of blocks and their units) and how activations and their gradients travel
// between the ranks of a PP group (Mesh::pp_data: one rank per stage, equal in every other
// coordinate). The order of the work is the schedule's (pipeline_schedule.h); StageRunner runs it
// (stage_runner.h) and the trainer never asks whether pp > 1: one stage is the layout with one chunk
// over [0, L), whose units are the whole model's and which sends nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/model/config.h"
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/pipeline_schedule.h"
#include "shardtrain/runtime/progress.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/unit_source.h"  // Reshard

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
// checked) (pipeline_schedule_problem). pp == 1: one chunk [0, L); '--pp-schedule' is ignored,
// '--pp-layers' and '--pp-virtual' > 1 are refused.
PipelineLayout resolve_pipeline(const ModelConfig& mc, int pp, const PipelineOptions& o, int microbatches,
                                std::string* why);

// The contexts a pipeline rank's StageRunner (stage_runner.h) holds, per chunk of the rank
// (PipelineLayout::rank_chunks order), over one training step of `microbatches` micro-batches: for
// each chunk the most of its micro-batches between their Forward and the end of their backward
// (Backward, or BackwardWeight when the schedule splits it), walking the rank's actions in order.
// The memory plan counts them (parallelize.h layout_memory). The runner pools contexts per
// chunk and reuses a free one, so this is what it allocates. `peak` (optional): simulate()'s
// PipelineTimeline::peak_in_flight of the rank, the most micro-batch chunks in flight at once (with
// one chunk per rank the same number; interleaved: at most the sum). One stage: {1}.
std::vector<int> pipeline_contexts(const PipelineLayout& pl, int pp_rank, int microbatches, int* peak = nullptr);

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
  // True on the first and the last stage of a pipeline (p > 1) when the embedding is tied: this
  // rank's unit `embedding` takes part in the tied sum (StageLink::sum_tied).
  bool tied = false;
};
// ep > 1: EP rank ep_rank's expert units of the chunks' MoE blocks too (llama_units), after each chunk's other units.
RankUnits pipeline_rank_units(const ModelConfig& mc, const PipelineLayout& pl, int r, int tp = 1, int tp_rank = 0,
                              int ep = 1, int ep_rank = 0);

// ---- Stream-ordered Comms (NCCL) ------------------------------------------------------------
// On MPI the link posts each receive ahead and starts each send at once: Open MPI matches by tag
// and progresses them in any order. A stream-ordered Comm (Comm::stream_ordered: NCCL) runs a
// rank's transfers one after another on its communication stream and matches them in start order
// per pair of ranks, without tags; a receive posted ahead then waits at the head of that stream for
// a send its peer queued behind its own receive ahead, and both stages wait forever. There the link
// runs grouped (StageLink's `grouped`): nothing is received ahead; at each action boundary the
// finished action's send and the next action's receive start as one group (Comm::start_group: one
// NCCL group, whose transfers progress independently), as Megatron-LM pairs send_forward with
// recv_backward in its 1F1B loop, here for any schedule; a send whose next action receives nothing
// is a group alone; the first action's receive is a group alone. One tag for every transfer, so that
// MPI matches as NCCL does (in start order), and the grouped order runs on MPI too (the tests).
//
// One transfer of a group, as pipeline rank r sees it.
struct P2pTransfer {
  bool recv = false;   // r receives it (else r sends it)
  int peer = 0;        // the other side's pipeline rank
  int chunk = 0;       // the sending chunk: whose output (grad false) or input gradient (grad true)
  bool grad = false;   // d(loss)/d(activations), travelling down the pipeline (else activations, up)
  int microbatch = 0;  // the micro-batch it belongs to (pipeline_p2p_groups only: StageLink's log has 0)
  bool operator==(const P2pTransfer&) const = default;
};
using P2pGroups = std::vector<std::vector<P2pTransfer>>;  // a rank's groups, in start order

// What action `a` receives before it runs and sends after it (at most one transfer each; the peer
// from `pl`): a Forward of chunk c > 0 receives chunk c - 1's output and, c < S - 1, sends its own;
// a Backward or BackwardInput of c < S - 1 receives chunk c + 1's input gradient and, c > 0, sends its
// own; BackwardWeight moves nothing. False when there is none. StageRunner and pipeline_p2p_groups
// both ask these.
bool action_receive(const Action& a, const PipelineLayout& pl, P2pTransfer* t);
bool action_send(const Action& a, const PipelineLayout& pl, P2pTransfer* t);

// Where the groups start. A rank's actions fall into slots; before a slot's first action the sends
// of the slot before and the receives of the slot's actions start as one group; after the last
// slot its sends start alone. PerAction: a slot per action (Megatron-LM's 1F1B pairing:
// send_forward_recv_backward, send_backward_recv_forward). PerPair: a Forward followed by a
// Backward (or BackwardInput) is one slot (Megatron-LM's interleaved loop,
// send_forward_backward_recv_forward_backward); every other action a slot of its own.
enum class P2pOrder { PerAction, PerPair };
const char* p2p_order_name(P2pOrder o);
// The first action of each slot of `acts` (one rank's actions, in order), increasing.
std::vector<size_t> p2p_slot_starts(const std::vector<Action>& acts, P2pOrder order);
// The groups pipeline rank r starts, in order, running its actions of `schedule` grouped in `order`
// (StageRunner with a grouped StageLink starts exactly these, tests/mpi/test_pipeline.cpp).
P2pGroups pipeline_p2p_groups(const Schedule& schedule, const PipelineLayout& pl, int r,
                              P2pOrder order = P2pOrder::PerAction);
// The order a grouped link runs `schedule` in: PerAction when every rank's groups run
// (p2p_groups_problem, over all ranks: the same answer on every rank), else PerPair when they do
// (interleaved schedules, whose chunks wrap from the last rank to the first), else *why says that
// neither runs (the caller refuses the run).
P2pOrder pipeline_p2p_order(const Schedule& schedule, const PipelineLayout& pl, std::string* why);

// Runs every pipeline rank's groups (per_rank[r], as pipeline_p2p_groups gives them) on a model of a
// stream-ordered Comm: a rank's groups one after another (the head group runs; the next starts when
// every transfer of the head completed); the k-th send from r to q matches q's k-th receive from r;
// a transfer completes when its match is in the head group of the peer and the transfers of the same
// direction with the same peer before it in its group completed (NCCL's rule; the others progress
// independently). Returns "" when every group completes; otherwise what is wrong: a send and its
// matching receive that disagree on what travels (chunk, direction or micro-batch: NCCL would
// deliver the wrong rows), transfers left unmatched, or a deadlock (naming each stuck rank's group).
std::string p2p_groups_problem(const std::vector<P2pGroups>& per_rank);

// Whether the stages' transfers on `pp` (the PP group's data Comm) run grouped: pp.stream_ordered()
// (NCCL), or the test hook SHARDTRAIN_TEST_PP_GROUPED=1 in the ranks' environment (the NCCL order
// over MPI, docs/errors.md).
bool pipeline_grouped(const Comm& pp);

// Collective over `world`. For a pipeline (pl.ranks > 1) whose transfers run grouped on `pp`
// (pipeline_grouped): the orders of the training and evaluation schedules over `microbatches`
// (pipeline_p2p_order), returned as the line the run logs ("pipeline: transfers grouped ..."); "" when
// not grouped. Throws CollectiveError on every rank when the ranks disagree on grouping (the test
// hook set on some ranks only: they would match nothing) or when no order runs a schedule (NCCL:
// "...; pass '--gpu-comm mpi'").
std::string check_pipeline_transfers(Comm& world, const Comm& pp, const PipelineLayout& pl, int microbatches);

// Activations between the stages of one PP group, on its Comm (Mesh::pp_data: the backend's
// buffers). Chunk c's forward output goes to chunk c + 1's rank, its input gradient to chunk c - 1's.
// Tags name (chunk, direction); messages of one tag arrive in the order sent (MPI's non-overtaking
// rule), and every schedule sends and receives each chunk's micro-batches in increasing order, so
// receives posted ahead in that order match. A send copies its rows into a send buffer of the link
// (a pool, one [R, C] buffer per send in flight, reused once its send completed) and returns at
// once: the caller's buffer is free again, so a model context is released when the schedule says,
// whatever the network does. Receives may be posted ahead (post_recv) and waited for later
// (wait_recv). While anything is in flight the link is a member of the backend's progress
// registry (progress.h): the host backend's GEMM tiles and attention tiles test its transfers, so a
// send or receive advances during the next action's compute (Open MPI moves data only inside MPI
// calls). Counts its transfers for CommDim::Pp: calls (sends and receives), bytes sent, issued time
// (from start to observed completion), exposed time (the compute thread waiting in wait_recv or flush);
// on stream-ordered Comms the Comm's device times, read at flush().
// Grouped (stream-ordered Comms, above): send() and post_recv() only hold their transfer (send()
// copies first); issue() starts every held transfer as one group; wait_recv() of a held receive
// issues first. The caller (StageRunner) posts and issues at the slots' starts (P2pOrder).
// Elements of C that hold the bytes of n doubles (sizeof(C) divides 8 for float, bf16 and double).
template <typename C> constexpr size_t tail_elems(size_t n) { return n * sizeof(double) / sizeof(C); }

template <typename C> class StageLink {
 public:
  // comm: the PP group (comm.world_size() == pl.ranks, comm.rank() = this rank's stage); be: the
  // backend of the activations (the send buffers' memory and copies); its progress registry is
  // joined while transfers are in flight (device backends have none). grouped: the order of a
  // stream-ordered Comm (above); pipeline_grouped(comm) by default; true on a host Comm runs that
  // order over MPI (tests).
  StageLink(Comm& comm, const PipelineLayout& pl, Backend<C>& be) : StageLink(comm, pl, be, pipeline_grouped(comm)) {}
  StageLink(Comm& comm, const PipelineLayout& pl, Backend<C>& be, bool grouped);
  ~StageLink();
  StageLink(const StageLink&) = delete;
  StageLink& operator=(const StageLink&) = delete;
  // Posts the receive of chunk c's input (grad false: n elements from chunk c - 1's rank) or of
  // d(loss)/d(chunk c's output) (grad true: from chunk c + 1's rank) into `recv` (backend memory),
  // which belongs to the link until wait_recv of it returned.
  void post_recv(int chunk, bool grad, C* recv, size_t n);
  // Waits for the oldest posted receive of (chunk, grad), which must be into `recv` (std::logic_error
  // otherwise); posts it first when none is posted.
  void wait_recv(int chunk, bool grad, C* recv, size_t n);
  // Chunk c's output to chunk c + 1's rank (grad false), or d(loss)/d(chunk c's input) to chunk
  // c - 1's rank (grad true): copied into a send buffer, then sent; nonblocking. Throws
  // std::bad_alloc when a new send buffer does not fit. tail: host doubles sent after the n
  // elements in the same message, their bytes as tail_elems<C>(tail.size()) elements (a mixture of
  // experts' load-balancing statistics, StageRunner); the receive's n counts them too.
  void send(int chunk, bool grad, const C* send, size_t n, const std::vector<double>& tail = {});
  // Grouped: starts the transfers held since the last group as one group (no-op when none, and
  // when not grouped).
  void issue();
  // Waits for every send in flight (the end of a step; grouped: issue() first). Receives must have
  // been waited for. Stream-ordered Comms: synchronize()s the Comm (the host waits for the step's
  // transfers; the Comm's timing events are drained), whose device times become the link's issued
  // and exposed seconds.
  void flush();
  bool grouped() const { return grouped_; }
  // Tests: from now on the link keeps the groups it starts (grouped only; P2pTransfer's microbatch 0).
  void keep_groups() { log_groups_ = grouped_; }
  const P2pGroups& groups() const { return log_; }
  // The tied embedding's gradient shard (n elements of `grad`, backend memory of `be`) summed
  // between the first and the last stage (sum_tied_grads), counted with this link's transfers.
  // Collective over those two stages; a no-op on the others.
  void sum_tied(Backend<float>& be, float* grad, size_t n);
  // Send buffers allocated (the most sends that were in flight at once), each of the largest n sent.
  size_t send_buffers() const { return pool_.size(); }
  // Accumulated since construction: calls, bytes, issued and exposed seconds.
  int64_t calls() const { return calls_; }
  double bytes() const { return bytes_; }
  double issued_s() const { return issued_s_; }
  double exposed_s() const { return exposed_s_; }

 private:
  struct Xfer;
  static void poll(void* self);
  void test_all();
  void update_membership();
  Comm& comm_;
  PipelineLayout pl_;
  Backend<C>& be_;
  ProgressRegistry* reg_;
  ProgressRegistry::Member member_;
  std::unique_ptr<Xfer> hold(int chunk, bool grad, const C* buf, size_t n);
  bool grouped_ = false, log_groups_ = false;
  bool device_timed_ = false;  // stream-ordered Comm: times from its device_times() at flush()
  Comm::DeviceTimes device_;   // ... as last read
  P2pGroups log_;
  std::vector<std::unique_ptr<Xfer>> held_, held_recvs_;  // grouped: not started yet (sends copied)
  std::vector<std::unique_ptr<Xfer>> sends_, recvs_;
  std::vector<Buffer<C>> pool_;  // send buffers; a buffer is free when no send in sends_ uses it
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
