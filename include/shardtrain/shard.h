// shardtrain sharding layer: the shard plan (units, flat layout, per-rank start / valid / padding),
// the sharded state (each rank's parameter and gradient shards), and the FSDP (ZeRO-3) unit
// pipeline that gathers a unit for compute and reduce-scatters its gradient through a codec (the
// dtype a unit travels in), on CommQueues (a host lane for MPI, a stream lane for NCCL).
//
// Layout (the same idea as llm.c's single flat parameter buffer, one per unit):
//   A unit's parameters are concatenated, in declaration order, into one flat buffer of `numel`
//   elements. It is padded with zeros to `padded_numel` = S * W where S = ceil(numel / W) (at
//   least 1) and W is the world size. Rank r owns flat elements [r*S, (r+1)*S): its shard. Of
//   those, `valid` = clamp(numel - r*S, 0, S) are real parameters and `padding` = S - valid are
//   zeros. A rank whose shard is all padding (valid = 0, e.g. 2 elements over 4 ranks) still
//   takes part in every all-gather and reduce-scatter of that unit.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardtrain/backend.h"
#include "shardtrain/mesh.h"
#include "shardtrain/runtime.h"

namespace shardtrain {

// How a parameter is initialized.
enum class Init { Normal, Ones, Zeros };

// Which part of a canonical tensor a tensor-parallel rank holds (Megatron-LM's split; model.h
// llama_units). The canonical tensor is 2-D [rows, cols] row-major (1-D tensors are only ever
// replicated). With degree N, rank t of the TP group holds:
//   Rows (column-parallel q/k/v/gate/up, vocabulary-parallel embedding and LM head): rows
//     [offset, offset + local rows) of the canonical tensor; rows at or past `rows` (the canonical
//     row count) are padding (the vocabulary padded to a multiple of N): zero, never trained.
//   Cols (row-parallel o/down): columns [offset, offset + local cols).
//   Replicated: all of it, on every rank of the group (RMSNorm weights): their gradients are
//     summed over the group (ShardedState::sum_replicated_grads) and they count once in the
//     gradient norm.
// degree 1 (the default): the whole canonical tensor, as without tensor parallelism.
enum class TpSplit { None, Rows, Cols, Replicated };
struct TpSlice {
  TpSplit split = TpSplit::None;
  int degree = 1;       // N, the TP group's size
  int64_t rows = 0;     // canonical rows (Rows: unpadded; the local rows may reach past them)
  int64_t cols = 0;     // canonical columns
  int64_t offset = 0;   // first canonical row (Rows) or column (Cols) held here
};

struct ParamSpec {
  std::string name;             // canonical (Hugging Face) name, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;   // row-major, e.g. {intermediate_size, hidden_size}: this rank's slice under TP
  bool weight_decay = true;     // AdamW decay applies (false for norm weights)
  Init init = Init::Normal;
  double init_std = 0.02;       // for Init::Normal
  TpSlice tp{};                 // the slice of the canonical tensor `shape` is (default: all of it)
  int64_t numel() const;
  // The canonical flat index of local element e (row-major in `shape`), or -1 for vocabulary
  // padding (a Rows slice's rows past tp.rows). Without TP: e.
  int64_t canonical_index(int64_t e) const;
  // Replicated over a TP group of more than one rank.
  bool tp_replicated() const { return tp.split == TpSplit::Replicated && tp.degree > 1; }
};

struct UnitSpec {
  std::string name;             // e.g. "model.layers.0"
  std::vector<ParamSpec> params;
};

// One parameter's place in its unit's flat buffer.
struct ParamSlot {
  ParamSpec spec;
  int64_t offset = 0;  // first flat element
  int64_t numel = 0;
};

// One rank's shard of one unit. Elements are flat indices into the unit's buffer.
struct RankShard {
  int64_t start = 0;    // r * shard_size
  int64_t valid = 0;    // real parameters in the shard (0 .. shard_size)
  int64_t padding = 0;  // shard_size - valid
};

struct UnitPlan {
  std::string name;
  std::vector<ParamSlot> params;
  int64_t numel = 0;         // real elements
  int64_t shard_size = 0;    // S, elements per rank (>= 1)
  int64_t padded_numel = 0;  // S * world
  std::vector<RankShard> ranks;  // size world
  const ParamSlot& param(const std::string& name) const;  // throws std::out_of_range naming it
};

struct ShardPlan {
  int world_size = 1;
  std::vector<UnitPlan> units;
  // Builds the plan for `world` ranks. Throws std::invalid_argument on world < 1, an empty unit,
  // a non-positive dimension, or a duplicate parameter name.
  static ShardPlan build(const std::vector<UnitSpec>& units, int world);
  int64_t total_numel() const;  // sum of real elements over units
  int64_t max_padded_numel() const;  // largest UnitPlan::padded_numel: size of a full-unit buffer
  int64_t max_shard_size() const;    // largest UnitPlan::shard_size: size of a shard-sized buffer
  int unit_index(const std::string& name) const;  // -1 if absent
};

// Shard elements per reduce-scatter call when `slab_elements` elements of all ranks' blocks are
// reduced at a time: min(largest shard, max(1, slab_elements / W)). On the stream lane
// (stream_lane: the data Comm is stream-ordered, NCCL; see CommQueue) the largest shard: one
// collective per unit, so that no compute-stream wait sits between slabs; its result buffer is then
// a whole shard, and mixed precision's fp32 widening a whole unit (the memory plan shows it). The
// FSDP engine's and mixed precision's buffers are sized by it, and so is the memory plan.
size_t reduce_slab(const ShardPlan& plan, size_t slab_elements, bool stream_lane = false);

// ---- Overlap of communication with compute ---------------------------------------------------------
//
// How the host lane's nonblocking collectives advance while the rank computes (the stream lane,
// below, needs no host progress). Open MPI progresses a nonblocking collective only inside MPI
// calls, so something must make them (docs/architecture.md, "Overlap", has the measurements
// behind the default):
//   Poll:   (default) the compute thread calls MPI_Test after every GEMM tile and between
//           attention tiles (the backend's progress registry, Backend::progress) and at every unit
//           boundary (UnitPipeline's gather, full_grad, reduce_scatter_grad);
//   Thread: a communication thread starts, tests (MPI_Test, then a nap of 20 us doubling to 1 ms
//           while nothing completes) and finishes the collectives in flight (needs
//           MPI_THREAD_MULTIPLE; without it, Poll is used);
//   Wait:   no tests between: MPI is entered only where a job is submitted (its first collective
//           starts when the queue is idle; the jobs ahead of it advance) and where one is waited
//           for (the waiter drives both queues of its pipeline, so that no rank blocks while its
//           peers wait for a collective it has not started).
enum class CommProgress { Thread, Poll, Wait };
// "thread" | "poll" | "wait"; throws std::invalid_argument naming option '--comm-progress'.
CommProgress parse_comm_progress(const std::string& s);
const char* comm_progress_name(CommProgress p);

struct OverlapConfig {
  bool on = true;     // --overlap on|off. Off: each collective is waited for as soon as it is started
                      // (same MPI calls, same arithmetic: the bitwise reference), nothing prefetched.
  int prefetch = 1;   // --prefetch N: all-gathers in flight ahead of the unit being computed (>= 0)
  CommProgress progress = CommProgress::Poll;  // --comm-progress (why poll is the default: docs/architecture.md)
};

// Where a rank's time on FSDP collectives went, accumulated since construction (seconds).
struct CommTimes {
  double issued_s = 0;   // sum over collectives of (completion - start): communication in flight
  double exposed_s = 0;  // time the compute thread waited for a collective (blocked in wait)
  int64_t collectives = 0;  // MPI calls started (a reduce-scatter in slabs counts one per slab)
  int64_t jobs = 0;         // jobs submitted (one per unit all-gather or reduce-scatter), counted at once
  // Bytes this rank sends in ring algorithms (docs/scaling.md, bytes_per_step): an all-gather or
  // reduce-scatter of a unit with shard size S over n ranks (n - 1) * S * e, hybrid sharding's
  // replica all-reduce 2 (R - 1) / R * S * e; e the element size the unit travels in. Counted by
  // UnitPipeline when a job is submitted.
  double gather_bytes = 0, reduce_bytes = 0;
};

// A queue of FSDP collectives on one communicator (one queue for all-gathers, one for
// reduce-scatters): jobs in submission order, each a chain of `parts` collectives. start(comm, i)
// starts part i on the queue's Comm (staging its input first if it needs to) and returns its
// Request; done(i) consumes part i's result (e.g. adds a reduce-scattered piece into the gradient
// shard). Every rank submits the same jobs in the same order, so every rank starts the same
// collectives in the same order on each communicator, although the two queues of a pipeline
// advance independently of each other.
//
// Two lanes, chosen once by make() from the Comm:
//   HostCommQueue   (Comm::stream_ordered() false: MpiComm, the host-staged device Comm): the
//                   host completes collectives. Inline (overlap off, or a Comm whose collectives
//                   complete on return): submit() runs the job to completion. Background: parts
//                   advance as CommProgress says (poll, thread, wait), one job at a time.
//   StreamCommQueue (Comm::stream_ordered(): NCCL): the device completes collectives. submit()
//                   enqueues every part at once on the Comm's communication stream, in program
//                   order (never from a thread, never depending on a test), so every rank enqueues
//                   the same NCCL calls in the same order; the host never blocks. wait() orders the
//                   compute stream after the job (one Request::wait, the job's only compute-stream
//                   wait when it has one part) and runs its done(). Overlap off: submit() does that
//                   at once.
// Buffer ownership: a part's input belongs to the collective from start(i) until its Request
// completed (host lane) or until wait() ordered the compute stream after it (stream lane); its
// result is the caller's from done(i) on. Buffers shared between jobs are stated on the job
// (Job::shared_buffers), never inferred. Errors: a failed start or MPI call throws from submit,
// poll or wait on the compute thread; a communication thread's error is rethrown by the next wait.
// Threads: submit, wait and poll from one (compute) thread; on the host lane start and done may run
// on the communication thread, so they must only touch memory the compute thread leaves alone until
// wait() returned.
class CommQueue {
 public:
  using Ticket = uint64_t;  // 1, 2, ... in submission order; 0 = nothing
  struct Job {
    int parts = 1;
    std::function<std::unique_ptr<Comm::Request>(Comm&, int)> start;
    std::function<void(int)> done;  // may be empty
    // True when the job's parts write buffers that other jobs of this queue with shared_buffers
    // also use, and its done() reads them (the reduce-scatter's staging and result slabs): such a
    // job starts only after the previous such job's done() ran. The host lane runs jobs one at a
    // time, which gives that; the stream lane orders the compute stream after the earlier job and
    // runs its done() before enqueuing this one. False: the job's buffers are its own (a gather
    // into its own slot; the caller orders reuse by waiting for the ticket).
    bool shared_buffers = false;
  };
  // The lane for `lane`: StreamCommQueue when lane.stream_ordered(), else HostCommQueue.
  // `background`: overlap on (collectives run while the rank computes; else each job completes
  // at submit); `watch`: the Comm whose collective watchdog (--collective-timeout) covers waits;
  // `prepare_thread` runs first on a communication thread (CPU backend:
  // prepare_cpu_helper_thread); `what` names the queue in watchdog messages ("FSDP all-gather").
  static std::unique_ptr<CommQueue> make(Comm& lane, Comm& watch, bool background, CommProgress progress,
                                         std::function<void()> prepare_thread, const char* what);
  virtual ~CommQueue() = default;  // derived destructors wait for the jobs in flight
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;
  // Throws std::logic_error for parts <= 0.
  virtual Ticket submit(Job job) = 0;
  // Job t and every job before it completed (t = 0: returns at once): host lane, their results
  // are in host-visible memory and their done() ran; stream lane, the compute stream is ordered
  // after them and their done() was enqueued. Rethrows an error of the communication thread (a
  // failed MPI call) as std::runtime_error.
  virtual void wait(Ticket t) = 0;
  void wait_all() { wait(last_); }
  // Host lane with Poll progress: advances the jobs in flight without blocking (compute thread).
  // A no-op otherwise.
  virtual void poll() {}
  // The other queue of the same pipeline (host lane without a thread: wait() drives it instead of
  // blocking in MPI_Wait, see HostCommQueue::wait in shard.cpp). nullptr: none. No-op on the stream lane.
  virtual void set_sibling(CommQueue* q) { (void)q; }
  // Collectives run while the rank computes (overlap on, on an asynchronous Comm).
  virtual bool background() const = 0;
  virtual bool stream_lane() const = 0;
  // Host-measured times (the stream lane's host only enqueues: issued_s and exposed_s stay near
  // zero; UnitPipeline reads the device's own, Comm::device_times).
  virtual CommTimes times() const = 0;

 protected:
  CommQueue() = default;
  Ticket last_ = 0;  // the last ticket handed out
};

// The host lane (see CommQueue). Jobs run one at a time: the head job's parts are started, tested
// and consumed in order; the next job starts when the head completed.
class HostCommQueue final : public CommQueue {
 public:
  HostCommQueue(Comm& lane, Comm& watch, bool background, CommProgress progress, std::function<void()> prepare_thread,
                const char* what);
  ~HostCommQueue() override;  // waits for the jobs in flight, then stops the thread
  Ticket submit(Job job) override;
  void wait(Ticket t) override;
  void poll() override;
  void set_sibling(CommQueue* q) override;
  bool background() const override { return background_; }
  bool stream_lane() const override { return false; }
  CommTimes times() const override;
  // The communication thread tests the head request, then naps kPollMinUs, doubling the nap (up
  // to kPollMaxUs) while no part completes: microseconds.
  static constexpr int kPollMinUs = 20, kPollMaxUs = 1000;

 private:
  struct Active {
    Job job;
    Ticket ticket = 0;
    int part = 0;
    std::unique_ptr<Comm::Request> req;
    double t0 = 0;
  };
  bool advance_locked();  // starts / tests / finishes the head; true if it completed a part
  void drive();           // advances without blocking (a sibling's waiter; any progress mode)
  void run_inline(Job& job);
  Comm& lane_;
  Comm& watch_;
  const char* what_;
  bool background_;
  HostCommQueue* sibling_ = nullptr;
  CommProgress progress_;
  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<Active> jobs_;
  Ticket completed_ = 0;
  bool quit_ = false;
  std::exception_ptr error_;
  CommTimes times_;
  std::thread thread_;
};

// The stream lane (see CommQueue): compute thread only, no host progress and no thread. Parts of
// one job are enqueued back to back; a part after the first waits for the one before on the
// compute stream only because its start reads what done() made of it (hybrid sharding's replica
// sum after the reduce-scatter): the pipeline gives this lane one collective per unit and
// direction (UnitPipeline and its codecs), so each unit's collective has exactly one
// compute-stream wait, when its ticket is waited for (or when a later job with shared_buffers
// needs its buffers).
class StreamCommQueue final : public CommQueue {
 public:
  StreamCommQueue(Comm& lane, Comm& watch, bool background, const char* what);
  ~StreamCommQueue() override;  // orders the compute stream after the jobs in flight
  Ticket submit(Job job) override;
  void wait(Ticket t) override;
  bool background() const override { return background_; }
  bool stream_lane() const override { return true; }
  CommTimes times() const override { return times_; }

 private:
  struct Active {
    Job job;
    Ticket ticket = 0;
    std::unique_ptr<Comm::Request> last;  // the last part's request
  };
  void finish_head();  // orders the compute stream after the head's last part, runs its done
  Comm& lane_;
  Comm& watch_;
  const char* what_;
  bool background_;
  std::deque<Active> jobs_;
  Ticket completed_ = 0;
  int shared_in_flight_ = 0;  // queued jobs with shared_buffers
  CommTimes times_;
};

// What the model needs from the sharding layer, in its compute type C: a unit's parameters,
// gathered in full; a zeroed full-unit gradient buffer; and the reduce-scatter of that buffer into
// this rank's gradient shard. UnitPipeline<C> is the one implementation: UnitPipeline<T> with the
// IdentityCodec for plain fp32 (or fp64) training, UnitPipeline<bf16> with the Bf16Codec over an
// fp32 state for mixed precision.
template <typename C> class UnitSource {
 public:
  virtual ~UnitSource() = default;
  // Collective: all-gathers unit u and returns it (padded_numel elements; parameter p at
  // + slot.offset). Valid until the next gather.
  virtual const C* gather(int u) = 0;
  // Zeroes and returns the full-unit gradient buffer for unit u (padded_numel elements).
  virtual C* full_grad(int u) = 0;
  // Collective: reduce-scatters the full-unit gradient buffer of unit u, divides by the world
  // size (mean over ranks) and adds the result into this rank's gradient shard. Under hybrid
  // sharding the reduce-scattered slabs are first summed over the replica groups (a nonblocking
  // all-reduce per slab, submit_reduce_slabs in shard.cpp), so the mean is still over all W ranks.
  // May return before it is done (overlap): the gradient shards are complete after end_pass().
  virtual void reduce_scatter_grad(int u) = 0;

  // For the training loop, never the model. A pass is a run of gathers between
  // begin_pass and end_pass (a training step's micro-batches, an evaluation). The sharding layer
  // records the order in which a pass labelled `label` gathers units and, in the next pass with
  // that label, gathers ahead along it (prefetch). end_pass() waits for every collective in flight
  // (after it the gradient shards hold every reduce-scatter); parameters may change only outside a
  // pass. Gathers outside a pass are never prefetched.
  virtual void begin_pass(const std::string& label) { (void)label; }
  virtual void end_pass() {}
  // Accumulated time of this source's collectives (zero for sources without any).
  virtual CommTimes comm_times() const { return {}; }
};

// ---- Tensor parallelism -------------------------------------------------------------------------
//
// What the model needs from tensor parallelism (Megatron-LM, Shoeybi et al. 2019, with sequence
// parallelism, Korthikanti et al. 2022), in its compute type C: the few collectives of its TP group
// of size() ranks. The model calls them (model.h says where); the parallel layer implements them on
// the mesh's TP communicator (TpGroup below), as UnitSource implements the FSDP ones. Every rank of
// the group makes the same calls in the same order with the same counts. Buffers are backend
// memory. Sequence-parallel layout: a "rows" buffer [N * n, C] holds the N ranks' blocks of n rows,
// rank r's at rows [r * n, (r + 1) * n).
template <typename C> class TensorParallelOps {
 public:
  using S = math::Acc<C>;
  virtual ~TensorParallelOps() = default;
  virtual int size() const = 0;  // N, the TP degree
  virtual int rank() const = 0;  // this rank's index in the group, in [0, N)
  // local (count elements) of every rank, concatenated in rank order into full (N * count).
  virtual void all_gather(const C* local, C* full, size_t count) = 0;
  // full (N * count elements) summed over the group; block r (elements [r * count, (r + 1) * count))
  // lands in rank r's local (count elements).
  virtual void reduce_scatter_sum(const C* full, C* local, size_t count) = 0;
  // The same two for the S scalars of the vocabulary-parallel cross-entropy (all-gather of the row
  // maxima, all-reduce of the sums; backend.h vocab_ce_*).
  virtual void all_gather_acc(const S* local, S* full, size_t count) = 0;
  virtual void all_reduce_sum_acc(S* buf, size_t count) = 0;
};

// Where a rank's TP collectives went (seconds, bytes), accumulated since construction. The TP
// collectives are blocking (the compute waits for each), so issued and exposed time are the same
// wall time. Bytes are those one rank sends in a ring algorithm, the measure of docs/scaling.md:
// an all-gather or reduce-scatter of `count` elements per rank sends (N - 1) * count elements, an
// all-reduce of `count` elements 2 * (N - 1) / N * count.
struct TpCommStats {
  double seconds = 0;
  int64_t all_gathers = 0, reduce_scatters = 0, all_reduces = 0;  // calls
  double all_gather_bytes = 0, reduce_scatter_bytes = 0, all_reduce_bytes = 0;
  double bytes() const { return all_gather_bytes + reduce_scatter_bytes + all_reduce_bytes; }
};

// TensorParallelOps on a communicator of the TP group (Mesh::tp_data(): MPI on the CPU, NCCL or
// the host-staged device Comm on GPUs). On a stream-ordered Comm (NCCL, on its own stream) each
// call is started and waited for at once, which orders the compute stream after it without
// blocking the host; elsewhere the calls are blocking. `comm` must outlive this.
template <typename C> class TpGroup final : public TensorParallelOps<C> {
 public:
  using S = math::Acc<C>;
  explicit TpGroup(Comm& comm) : comm_(comm) {}
  int size() const override { return comm_.world_size(); }
  int rank() const override { return comm_.rank(); }
  void all_gather(const C* local, C* full, size_t count) override;
  void reduce_scatter_sum(const C* full, C* local, size_t count) override;
  void all_gather_acc(const S* local, S* full, size_t count) override;
  void all_reduce_sum_acc(S* buf, size_t count) override;
  const TpCommStats& stats() const { return stats_; }

 private:
  template <typename E> void gather(const E* local, E* full, size_t count);
  template <typename F> void timed(F&& call);  // runs call, adding its wall time to stats_.seconds
  Comm& comm_;
  TpCommStats stats_;
};

// ---- The sharded state ----------------------------------------------------------------------------
//
// For this rank, each unit's parameter shard and gradient shard (O(P / W) memory) in the master
// type T, with their plan: what AdamW updates and checkpoints save. No full-unit buffer and no
// collective pipeline (those are UnitPipeline's). Collective calls (gather_param) must be made by
// every rank in the same order.
//
// Three communicators: `comm` carries host-memory control traffic (loss, norms, checkpoint
// tables); `data_comm` moves the backend's buffers (gathers, reduce-scatters): the same MPI Comm on
// the CPU, NCCL (or MPI on host copies) on GPUs.
//
// Hybrid sharding (HSDP; PyTorch FSDP2 / torchtitan HSDP, ZeRO++ hpZ): the plan is built for the
// G ranks of a shard group, data_comm spans that group (G consecutive ranks), and `replica_comm`
// (nullptr with one group) joins the ranks of equal shard rank in the R = W / G groups. Gradients
// are reduce-scattered within the group, summed over replica_comm and divided by W = G * R (see
// UnitCodec). Every replica then holds and updates identical shards. `comm` stays the whole world.
template <typename T> class ShardedState {
 public:
  // Throws std::invalid_argument if the plan's world size differs from data_comm's (comm's when
  // data_comm is nullptr; the shard group's with hybrid sharding), std::bad_alloc.
  ShardedState(Backend<T>& be, Comm& comm, ShardPlan plan, Comm* data_comm = nullptr, Comm* replica_comm = nullptr);
  // The communicators from the run's mesh (mesh.h): comm = mesh.world(), data_comm =
  // mesh.shard_data(), replica_comm = mesh.replica_data(). `plan` must be built for the shard group
  // (mesh.dims().dp_shard ranks). The mesh must outlive the state. Throws as the constructor above.
  ShardedState(Backend<T>& be, const Mesh& mesh, ShardPlan plan)
      : ShardedState(be, mesh.world(), std::move(plan), &mesh.shard_data(), mesh.replica_data()) {}
  ShardedState(const ShardedState&) = delete;
  ShardedState& operator=(const ShardedState&) = delete;
  virtual ~ShardedState() = default;

  const ShardPlan& plan() const { return plan_; }
  Backend<T>& backend() { return be_; }
  Comm& comm() { return comm_; }
  Comm& data_comm() { return *dcomm_; }
  int num_units() const { return static_cast<int>(plan_.units.size()); }
  // This rank's row in the plan (its rank in the shard group; = comm().rank() without HSDP), the
  // replica communicator (nullptr: one group) and the number of replica groups R (the gradient
  // mean divides by G * R). Which replica writes checkpoints and counts in the gradient norm is
  // the mesh's answer (Mesh::writes_checkpoint, Mesh::counts_in_norm).
  int plan_rank() const { return dcomm_->rank(); }
  Comm* replica_comm() { return rcomm_; }
  int replicas() const { return rcomm_ ? rcomm_->world_size() : 1; }

  // This rank's shard of unit u: shard_size elements (valid ones first, then zero padding).
  T* param_shard(int u) { return params_[u].data(); }
  T* grad_shard(int u) { return grads_[u].data(); }

  // Fills every parameter shard deterministically from `seed`: element i of parameter p gets a
  // value that depends only on (seed, p's name, i), so the model is the same at any world size.
  // Under tensor parallelism i is the canonical index (ParamSpec::canonical_index): each TP rank's
  // slice holds exactly the values of the same elements without TP (padding rows: zero).
  void init_params(uint64_t seed);
  // Zeroes every gradient shard.
  void zero_grads();

  // Collective over data_comm: the whole parameter `name`, gathered (one all-gather of its unit
  // into a temporary full-unit buffer), copied to host (numel elements). Throws std::out_of_range
  // for an unknown name, std::bad_alloc.
  std::vector<T> gather_param(const std::string& name);
  // Overwrites this rank's part of parameter `name` from the full host tensor `full` (numel
  // elements). Not collective. Throws std::out_of_range, std::invalid_argument (wrong size).
  void set_param(const std::string& name, const std::vector<T>& full);

  // Sum of squares of this rank's valid gradient elements (padding excluded), in double. With
  // include_replicated false, the elements of TP-replicated parameters (ParamSpec::tp_replicated)
  // are left out: every TP rank but the group's first holds a copy of them, and the norm counts
  // each element once (Mesh::counts_replicated_in_norm).
  double local_grad_sumsq(bool include_replicated = true);
  // Collective over the TP group (every rank of it holds the same plan): sums this rank's gradient
  // shard elements of TP-replicated parameters over the group, in place, each range by
  // `sum(pointer, count)` (TpGroup::all_reduce_sum_acc, which counts the traffic).
  // Under sequence parallelism each TP rank computed the RMSNorm weights' gradient from its own
  // tokens, so the sum is the gradient (Korthikanti et al. 2022, section 4.2.2). No-op when no
  // parameter is replicated.
  void sum_replicated_grads(const std::function<void(T*, size_t)>& sum);

 private:
  Backend<T>& be_;
  Comm& comm_;
  Comm* dcomm_;
  Comm* rcomm_;  // HSDP replica communicator, nullptr with one group
  ShardPlan plan_;
  std::vector<Buffer<T>> params_, grads_;
};

// ---- Codecs: how one unit travels in the compute type C -------------------------------------------
//
// A codec turns a state's parameter shard of unit u into the compute type C for the all-gather,
// and a full-unit gradient in C (laid out [W, S]: rank r's block at r*S) into the mean added to
// the state's gradient shard: reduce-scattered over data_comm, summed over the replica groups
// under hybrid sharding (the pipeline's `replica` lane, nullptr with one group) and divided by
// W = G * R. Each issue_* submits one CommQueue job and returns its ticket. Buffers: a gather
// writes only `dst` (the pipeline owns it and orders its reuse by the ticket); per-slot staging is
// the codec's, one per gather buffer (reserve); reduce-scatter staging is shared between the
// reduce jobs of one queue (Job::shared_buffers). Two codecs today: IdentityCodec (C = T) and
// Bf16Codec (bf16 over an fp32 state); float8 would be a third.
template <typename C> class UnitCodec {
 public:
  virtual ~UnitCodec() = default;
  virtual const ShardPlan& plan() const = 0;
  virtual Comm& world() = 0;         // the state's comm (control, watchdog)
  virtual Comm& data_comm() = 0;     // the state's data_comm
  virtual Comm* replica_comm() = 0;  // the state's replica_comm (nullptr: one group)
  // Allocates per-gather-buffer staging for `slots` buffers. Throws std::bad_alloc.
  virtual void reserve(int slots) = 0;
  virtual CommQueue::Ticket issue_gather(CommQueue& q, int u, C* dst, int slot) = 0;
  virtual CommQueue::Ticket issue_reduce(CommQueue& q, int u, const C* full, Comm* replica) = 0;
  // Bytes per element of the reduce-scatter and of the replica all-reduce (hybrid sharding).
  virtual size_t reduce_elem_bytes() const = 0;
  virtual size_t replica_elem_bytes() const = 0;
};

// C = T: the shard is all-gathered as it is; the gradient is reduce-scattered kReduceSlab
// elements (all ranks' blocks together) at a time on the host lane, packed from the full-unit
// buffer, so the result buffer is 1/W of that, not a whole shard of the largest unit (for a
// 128k-vocabulary embedding at W = 2 that shard is 500 MiB); on the stream lane (data_comm
// stream-ordered) one reduce-scatter per unit into a shard-sized result buffer (reduce_slab).
template <typename T> class IdentityCodec final : public UnitCodec<T> {
 public:
  static constexpr size_t kReduceSlab = size_t{1} << 22;
  // `state` must outlive the codec. Throws std::bad_alloc.
  explicit IdentityCodec(ShardedState<T>& state);
  const ShardPlan& plan() const override { return s_.plan(); }
  Comm& world() override { return s_.comm(); }
  Comm& data_comm() override { return s_.data_comm(); }
  Comm* replica_comm() override { return s_.replica_comm(); }
  void reserve(int) override {}
  CommQueue::Ticket issue_gather(CommQueue& q, int u, T* dst, int slot) override;
  CommQueue::Ticket issue_reduce(CommQueue& q, int u, const T* full, Comm* replica) override;
  size_t reduce_elem_bytes() const override { return sizeof(T); }
  size_t replica_elem_bytes() const override { return sizeof(T); }

 private:
  ShardedState<T>& s_;
  Buffer<T> scatter_tmp_, pack_;  // reduce-scatter of one slab: [slab_] result, [W, slab_] packed input
  size_t slab_ = 0;               // shard elements per reduce-scatter call
};

// Mixed precision (Micikevicius et al. 2018; PyTorch FSDP's MixedPrecision(param_dtype=bf16,
// reduce_dtype=fp32 or bf16)) over an fp32 state that keeps the master shards, gradient shards
// and, in AdamW, the optimizer state in fp32:
//   gather:  this rank's fp32 shard is rounded to bf16 (in the gather buffer's own staging), then
//            the bf16 shards are all-gathered (half the bytes of an fp32 gather);
//   reduce:  with reduce_bf16 == false the bf16 gradient is widened to fp32 and reduce-scattered
//            in fp32, one slab of at most widen_slab elements (over all ranks) at a time, so no
//            fp32 copy of a whole unit exists (for a 128k vocabulary embedding that copy would be
//            4 bytes x V x C); on the stream lane (NCCL) the whole unit at once instead (one
//            collective per unit: that fp32 copy exists, see reduce_slab). Else reduce-scattered
//            in bf16 (half the bytes), one collective per unit. The mean is added into the fp32
//            gradient shard; under hybrid sharding the replica sum runs in fp32.
// `be` must run on the same device as state.backend().
class Bf16Codec final : public UnitCodec<bf16> {
 public:
  static constexpr size_t kWidenSlab = size_t{1} << 22;  // fp32 elements (16 MiB) per widened slab
  // `state` and `be` must outlive the codec. widen_slab: fp32 elements per widened slab (tests make
  // it small to cut units into many slabs); unused on the stream lane. Throws std::bad_alloc.
  Bf16Codec(ShardedState<float>& state, Backend<bf16>& be, bool reduce_bf16, size_t widen_slab = kWidenSlab);
  const ShardPlan& plan() const override { return m_.plan(); }
  Comm& world() override { return m_.comm(); }
  Comm& data_comm() override { return m_.data_comm(); }
  Comm* replica_comm() override { return m_.replica_comm(); }
  void reserve(int slots) override;
  CommQueue::Ticket issue_gather(CommQueue& q, int u, bf16* dst, int slot) override;
  CommQueue::Ticket issue_reduce(CommQueue& q, int u, const bf16* full, Comm* replica) override;
  size_t reduce_elem_bytes() const override { return reduce_bf16_ ? 2 : 4; }
  size_t replica_elem_bytes() const override { return 4; }  // summed in fp32 either way

 private:
  ShardedState<float>& m_;
  Backend<bf16>& be_;
  bool reduce_bf16_;
  std::vector<Buffer<bf16>> shard_;  // per gather buffer: this rank's shard rounded to bf16
  Buffer<bf16> scatter_;
  Buffer<float> grad32_, scatter32_;  // [W, slab_] and [slab_]: the fp32 reduce-scatter of one slab
  Buffer<float> replica32_;           // HSDP with bf16 reduce: a shard widened to fp32 for the replica sum
  size_t slab_ = 0;                   // shard elements per fp32 reduce-scatter
};

// ---- The unit pipeline ----------------------------------------------------------------------------
//
// The UnitSource<C> over a sharded state, through a codec: gather buffers (1 + prefetch with
// overlap on, else 1) and full-unit gradient buffers (2 with overlap on: one is reduce-scattered
// while the next unit's gradient fills the other), all sized for the largest unit (both are
// needed at once for the tied LM head, so per-unit sizing would not lower the peak); two
// CommQueues on their own duplicated communicators (all-gathers; reduce-scatters); and the
// recorded order of each pass (prefetch, see UnitSource::begin_pass). Construction is collective
// over the codec's data_comm (and replica_comm): it duplicates them.
// Streams (stream lane, NCCL): the all-gather and the reduce-scatter Comms are duplicates of the
// data Comm (ncclCommSplit), each with its own communication stream, so a prefetch never queues
// behind a reduce-scatter; both are enqueued from the compute thread in program order, the same
// on every rank (NCCL needs that across communicators too). end_pass() synchronizes the data Comm
// once, which covers its duplicates (Comm::synchronize).
// Host progress (--comm-progress poll, on a host-kernel backend): the pipeline joins `be`'s
// progress registry (Backend::progress, progress.h) with its poll for its lifetime.
template <typename C> class UnitPipeline : public UnitSource<C> {
 public:
  // `be`: the compute backend (the buffers' and the hook's). The state behind `codec` must outlive
  // the pipeline. `ov`: prefetch and asynchronous reduce-scatter; the default waits for every
  // collective at once (tools, tests); training passes --overlap / --prefetch / --comm-progress.
  // Throws std::invalid_argument (negative prefetch), std::bad_alloc.
  UnitPipeline(Backend<C>& be, std::unique_ptr<UnitCodec<C>> codec,
               const OverlapConfig& ov = OverlapConfig{false, 0, CommProgress::Wait});
  ~UnitPipeline() override;  // waits for everything in flight, then stops the threads
  UnitPipeline(const UnitPipeline&) = delete;
  UnitPipeline& operator=(const UnitPipeline&) = delete;

  const C* gather(int u) override;
  C* full_grad(int u) override;
  void reduce_scatter_grad(int u) override;
  void begin_pass(const std::string& label) override;
  void end_pass() override;
  CommTimes comm_times() const override;
  const OverlapConfig& overlap() const { return ov_; }

 private:
  struct Slot {
    Buffer<C> buf;
    int unit = -1;
    int64_t pos = -1;  // position in the pass this buffer was gathered for
    CommQueue::Ticket ticket = 0;
  };
  struct GradBuf {
    Buffer<C> buf;
    int unit = -1;
    CommQueue::Ticket ticket = 0;  // its reduce-scatter
  };
  int num_slots() const { return static_cast<int>(slots_.size()); }
  int free_slot(int64_t pos) const;
  void poll_all();
  static void poll_hook(void* self);
  Backend<C>& be_;
  std::unique_ptr<UnitCodec<C>> codec_;  // destroyed after the queues (their jobs use its buffers)
  const ShardPlan& plan_;
  OverlapConfig ov_;
  std::unique_ptr<Comm> ag_comm_, rs_comm_, rep_comm_;
  Comm* rep_ = nullptr;           // the replica lane of reduce-scatter jobs (own duplicate), nullptr: one group
  Comm* ordered_lane_ = nullptr;  // the data Comm when it is stream-ordered (NCCL): end_pass synchronizes it
  std::unique_ptr<CommQueue> agq_, rsq_;
  std::vector<Slot> slots_;
  std::vector<GradBuf> grads_;
  double gather_bytes_ = 0, reduce_bytes_ = 0;  // CommTimes' bytes, counted at submission
  int current_ = -1, gnext_ = 0, gcur_ = -1;
  int64_t pos_ = 0;
  bool in_pass_ = false, follow_ = false;
  ProgressRegistry::Member progress_member_;  // in be_'s progress registry (host progress, poll)
  std::string label_;
  std::vector<int> rec_;
  std::map<std::string, std::vector<int>> traces_;
  const std::vector<int>* trace_ = nullptr;
};

// Plain-precision FSDP in one object (tools and tests): a ShardedState<T> and, over it, a
// UnitPipeline<T> with the IdentityCodec. Construction is collective over data_comm.
template <typename T> class Fsdp final : public ShardedState<T>, public UnitPipeline<T> {
 public:
  static constexpr size_t kReduceSlab = IdentityCodec<T>::kReduceSlab;
  // As ShardedState's and UnitPipeline's constructors; throws as they do.
  Fsdp(Backend<T>& be, Comm& comm, ShardPlan plan, Comm* data_comm = nullptr, Comm* replica_comm = nullptr,
       const OverlapConfig& ov = OverlapConfig{false, 0, CommProgress::Wait})
      : ShardedState<T>(be, comm, std::move(plan), data_comm, replica_comm),
        UnitPipeline<T>(be, std::make_unique<IdentityCodec<T>>(*this), ov) {}
  Fsdp(Backend<T>& be, const Mesh& mesh, ShardPlan plan, const OverlapConfig& ov)
      : Fsdp(be, mesh.world(), std::move(plan), &mesh.shard_data(), mesh.replica_data(), ov) {}
};

// Mixed-precision FSDP's unit source: a UnitPipeline<bf16> with the Bf16Codec over the fp32 state
// `master` (see Bf16Codec). `be` must run on the same device as master.backend(); both must
// outlive it. Construction is collective over master's data_comm.
class MixedPrecisionUnits final : public UnitPipeline<bf16> {
 public:
  static constexpr size_t kWidenSlab = Bf16Codec::kWidenSlab;
  MixedPrecisionUnits(ShardedState<float>& master, Backend<bf16>& be, bool reduce_bf16, size_t widen_slab = kWidenSlab,
                      const OverlapConfig& ov = OverlapConfig{false, 0, CommProgress::Wait})
      : UnitPipeline<bf16>(be, std::make_unique<Bf16Codec>(master, be, reduce_bf16, widen_slab), ov) {}
};

// Deterministic standard normal for counter `i` of stream (seed, key): SplitMix64 + Box-Muller.
double counter_normal(uint64_t seed, uint64_t key, uint64_t i);

}  // namespace shardtrain
