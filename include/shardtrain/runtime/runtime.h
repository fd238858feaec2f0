// shardtrain runtime layer: MPI bootstrap, the collective interface (Comm), and collective
// error agreement. Everything above this layer talks to other ranks only through Comm. The run's
// communicators are made and owned by the device mesh (mesh.h); the device-buffer Comms (NCCL,
// host-staged) are declared in cuda.h and implemented in src/runtime/cuda_comm.cu (CUDA plugin).
//
// What this is not: a general MPI wrapper. It exposes exactly the four collectives FSDP needs
// (all-gather, reduce-scatter, all-reduce, broadcast) plus barrier, on equal-sized per-rank
// blocks, which is what a padded shard plan guarantees, and nonblocking point-to-point transfers
// with a ring shift (context-parallel rings, pipeline stages).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardtrain {

// Error raised after all ranks agreed that something failed. Every rank throws the same message,
// so every rank exits non-zero with it; `origin_rank` is the lowest rank that reported the failure.
class CollectiveError : public std::runtime_error {
 public:
  CollectiveError(int origin, const std::string& msg) : std::runtime_error(msg), origin_rank(origin) {}
  int origin_rank;
};

// Reduction operator for all_reduce.
enum class ReduceOp { Sum, Max, Min };

// The collective interface. All calls are collective over the communicator: every rank must call
// them in the same order with the same `count`. Buffers are host memory for the MPI implementation
// (MpiComm) and device memory for the device Comms (cuda.h: NCCL, host-staged). `count` is in
// elements, not bytes.
//
// Supported element types: float, double, int64_t, uint64_t and char, for every call; bf16 for
// all_gather, reduce_scatter_sum and broadcast (mixed-precision gathers and gradients).
class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // all_gather: rank i's `count` elements of `send` land at recv + i*count on every rank.
  // recv holds world_size*count elements. count == 0 is allowed (nothing moves, still collective).
  // In place is allowed when send == recv + rank*count. The MPI Comm runs it in slabs of at most
  // kCollectiveSlab bytes over all ranks, unpacked into the W blocks, so that MPI's temporaries are
  // bounded by kCollectiveSlab (Open MPI's default algorithm for a world size that is not a power
  // of two allocates a temporary of the whole receive buffer on ranks other than 0).
  template <typename T> void all_gather(const T* send, T* recv, size_t count);

  // reduce_scatter (sum): `send` holds world_size*count elements on every rank; block i (elements
  // [i*count, (i+1)*count)) summed over all ranks lands in rank i's `recv` (count elements).
  // The MPI Comm runs it in slabs of at most kCollectiveSlab bytes over all ranks (each slab
  // packed from the W blocks): MPI libraries allocate a temporary of the whole send buffer (Open
  // MPI's default for few ranks reduces into rank 0 and scatters: rank 0 held one more copy of the
  // largest unit), which slabs bound to kCollectiveSlab.
  template <typename T> void reduce_scatter_sum(const T* send, T* recv, size_t count);
  static constexpr size_t kCollectiveSlab = size_t{16} << 20;  // bytes per slab, all ranks' blocks

  // all_reduce in place: every rank ends with op over all ranks' `buf`, element-wise.
  template <typename T> void all_reduce(T* buf, size_t count, ReduceOp op);

  // broadcast: root's `count` elements of `buf` are copied to `buf` on every rank.
  template <typename T> void broadcast(T* buf, size_t count, int root);

  virtual void barrier() = 0;

  // Collective watchdog: a collective still unfinished after `seconds` (0: never) means a peer is
  // dead or stuck; this rank then prints which collective and for how long, and exits with
  // kExitCollectiveTimeout, which makes mpirun / srun end the whole job.
  virtual void set_collective_timeout(double seconds) = 0;
  // Marks a section made of collectives this class does not see (parallel HDF5 I/O) for the
  // watchdog: it fires when the section makes no progress (no Comm collective completes) for the
  // timeout. Use through CommWatch. Sections nest.
  virtual void watch_begin(const char* what) = 0;
  virtual void watch_end() = 0;

  // The MPI communicator (an MPI_Comm, as void*) spanning the same ranks, for host-side parallel
  // I/O (MPI-IO under HDF5). Every Comm implementation has one, NCCL's included.
  virtual void* mpi_handle() const = 0;

  // Convenience: broadcast a string of any length from root (length first, then bytes).
  std::string broadcast_string(const std::string& s, int root);

  // ---- Nonblocking collectives (overlap of communication with compute) ----------------------
  // The blocking calls above complete on return. The start_* calls below may return while the
  // collective is still in flight; they hand back a Request, and the collective's buffers belong
  // to it until Request::wait() returned (or test() returned true): the caller must not write
  // `send` nor read `recv` before. Same rules as the blocking calls otherwise: every rank starts
  // the same collectives in the same order on one Comm (nonblocking collectives on one
  // communicator match in start order, MPI 4.0 section 6.12), counts in elements, same types.
  // Several may be in flight at once on one Comm. No slabs: one MPI call over the whole count
  // (callers bound the count; FSDP reduce-scatters one slab per call).
  class Request {
   public:
    virtual ~Request() = default;
    // Does not block; true once the collective completed. Drives MPI progress (MPI_Test).
    virtual bool test() = 0;
    // Blocks until the collective completed; then its results are visible to host code (MPI).
    // Stream-ordered Comms: returns at once, the compute stream ordered after the collective.
    virtual void wait() = 0;
  };
  template <typename T> std::unique_ptr<Request> start_all_gather(const T* send, T* recv, size_t count);
  template <typename T> std::unique_ptr<Request> start_reduce_scatter_sum(const T* send, T* recv, size_t count);
  // In place: buf (count elements) becomes the sum over ranks (float and double; not bf16). The
  // buffer belongs to the Request until it completed. Hybrid sharding's replica sum (MPI_Iallreduce).
  template <typename T> std::unique_ptr<Request> start_all_reduce_sum(T* buf, size_t count);

  // ---- Point-to-point (context parallelism's ring, pipeline stages) ----------------------------
  // start_send: `count` elements of `send` go to rank `peer` of this Comm (a rank of this group,
  // not of the world); start_recv: `count` elements from rank `peer` land in `recv`. Both are
  // nonblocking and return a Request that owns the buffer until its wait() returned or its test()
  // returned true: the caller must not write `send` nor read `recv` before. The Request must not
  // outlive the Comm; one destroyed before it completed waits for it (watched, as below).
  // Matching: a send to q with tag t matches q's receive from this rank with tag t, and sends and
  // receives between one pair of ranks with one tag match in start order (MPI's non-overtaking
  // rule, MPI 4.0 section 3.5). Both sides pass the same count and element type. peer == rank()
  // is allowed. Tags: 0 <= tag < kP2pTagLimit (kRingShiftTag is the ring shift's own).
  // Stream-ordered Comms (NCCL) have no tags: the k-th send to q matches q's k-th receive from
  // this rank, and transfers started one after another run one after another on the Comm's
  // communication stream, ordered with its collectives (a send that waits for its receiver blocks
  // what was started after it). So portable callers start matching sends and receives in the same
  // order on both sides, never two sends towards each other before their receives (an exchange
  // is start_ring_shift, one NCCL group), and use tags as on MPI.
  // Progress: MPI advances the transfer inside MPI calls only (Request::test, a ProgressRegistry
  // member of the compute backend, progress.h). Stream-ordered Comms: as their start_* above.
  // Errors: std::invalid_argument for a peer outside [0, world_size()) or a bad tag, before
  // anything started (this rank only: callers agree on arguments beforehand); std::logic_error on
  // a Comm without point-to-point (the base class's default); a failed MPI or NCCL call:
  // std::runtime_error. Watchdog: a Request's wait() (and a destroyed Request's wait) is watched
  // like a collective: a peer that died or never starts its side ends every waiting rank with the
  // watchdog's message and kExitCollectiveTimeout after the collective timeout.
  template <typename T> std::unique_ptr<Request> start_send(const T* send, size_t count, int peer, int tag);
  template <typename T> std::unique_ptr<Request> start_recv(T* recv, size_t count, int peer, int tag);
  // Ring shift, collective over this Comm: rank r sends `count` elements of `send` to rank
  // (r+1) mod W and receives rank (r-1) mod W's into `recv`, so that afterwards rank r's recv is
  // its left neighbour's send (W = 1: its own). Every rank starts the same ring shifts, same count,
  // in the same order (they match in start order, tag kRingShiftTag); send and recv must not
  // overlap. One Request owns both buffers (receive posted first, then the send). ring_shift is
  // start_ring_shift followed by wait().
  template <typename T> std::unique_ptr<Request> start_ring_shift(const T* send, T* recv, size_t count);
  template <typename T> void ring_shift(const T* send, T* recv, size_t count);
  // Grouped point-to-point (pipeline stages on stream-ordered Comms): the transfers of `ops`, all
  // of element type T, started together under one Request, which completes when every one did and
  // owns every buffer until then (as start_send / start_recv's). Matching, tags and errors as
  // start_send / start_recv's (check_p2p on each op before anything started). NCCL: one group
  // (ncclGroupStart ... ncclGroupEnd) on the communication stream; its transfers progress
  // independently (the NCCL user guide, "Point-to-point communication"), so a group holding a send
  // to q and a receive from q matches q's group holding the receive and the send, and neither
  // rank's send waits behind its own receive; transfers of one direction with one peer run in the
  // order given. Elsewhere: every receive started, then every send, as the ring shift's default.
  // An empty group is a Request that is already complete.
  struct P2pOp {
    bool recv = false;    // true: receive into buf; false: send from buf
    void* buf = nullptr;  // count elements of the group's type (sends only read it)
    size_t count = 0;
    int peer = 0;
    int tag = 0;
  };
  template <typename T> std::unique_ptr<Request> start_group(const std::vector<P2pOp>& ops);
  static constexpr int kP2pTagLimit = 32767;          // MPI guarantees tags up to 32767 (MPI_TAG_UB)
  static constexpr int kRingShiftTag = kP2pTagLimit;  // reserved for the ring shift
  static constexpr int kAllToAllTag = kP2pTagLimit - 1;  // reserved for start_all_to_all_v

  // ---- All-to-all with per-rank counts (expert parallelism's dispatch and combine) -------------
  // Collective over this Comm, MPI_Alltoallv's shape with the blocks packed in rank order: rank r
  // sends send_counts[q] elements to rank q (block q of `send`, starting at the sum of
  // send_counts[0..q)) and receives recv_counts[p] elements from rank p into block p of `recv`
  // (likewise packed). Rank r's recv_counts[p] must equal rank p's send_counts[r]
  // (exchange_counts gives them). Built on start_group with the reserved tag kAllToAllTag, so it
  // runs wherever grouped point-to-point does: MPI's nonblocking sends and receives, one NCCL
  // group (how NCCL's all-to-all is written), the host-staged device Comm; peers are visited from
  // this rank onwards (r, r+1, ...), the block for this rank is a transfer to itself, empty
  // blocks are not sent. OwnBlock::Keep: the block for this rank is neither sent nor received
  // (block rank() of `recv` is left as it was; the caller places its own rows, and may read
  // block rank() of `send` and write block rank() of `recv` while the others travel), the other
  // blocks keep their places. The Request owns the rest of both buffers until it completed;
  // successive all-to-alls on one Comm match in start order. std::invalid_argument (before
  // anything started) when a counts vector does not have world_size() entries.
  enum class OwnBlock { Move, Keep };
  template <typename T>
  std::unique_ptr<Request> start_all_to_all_v(const T* send, const std::vector<size_t>& send_counts, T* recv,
                                              const std::vector<size_t>& recv_counts, OwnBlock own = OwnBlock::Move);
  // Collective, blocking, host memory: returns recv_counts with recv_counts[p] = rank p's
  // send_counts[rank()] (one all-gather of the W x W counts). std::invalid_argument when
  // send_counts does not have world_size() entries; std::logic_error on a stream-ordered Comm
  // (NCCL), whose collectives take device memory: exchange the counts on its host Comm.
  std::vector<size_t> exchange_counts(const std::vector<size_t>& send_counts);
  // Throws std::invalid_argument unless 0 <= peer < world_size() and 0 <= tag < kP2pTagLimit.
  void check_p2p(int peer, int tag, const char* what) const;
  // True when the start_* calls return before completion (MpiComm: MPI_Iallgather,
  // MPI_Ireduce_scatter_block; NcclComm: stream-ordered, below). False: they complete on return,
  // like the blocking calls (the host-staged device Comm).
  virtual bool asynchronous() const { return false; }
  // Stream-ordered device Comms (NcclComm, cuda.h make_nccl_comm). start_* enqueue the collective on the
  // Comm's own communication stream, after everything already enqueued on the compute stream (a
  // CUDA event: inputs written, earlier readers of the output done), and return at once. Their
  // Request::wait() does not block the host: it makes the compute stream wait for the collective
  // (cudaStreamWaitEvent), so device work enqueued after wait() sees the result; host code sees it
  // after synchronize(). test() asks whether the collective finished (cudaEventQuery). Callers
  // must start every collective of such a Comm in program order, never depending on test(), so
  // that every rank enqueues the same NCCL calls in the same order. The blocking calls above stay
  // blocking and are ordered after every started collective.
  virtual bool stream_ordered() const { return false; }
  // Blocks the host until every collective started on this Comm and on the Comms duplicate()
  // made from it, and the compute stream's work before this call, completed; a watched wait (the
  // collective watchdog covers it). Rethrows a failure the device reported. No-op for Comms whose
  // Requests complete on the host.
  virtual void synchronize() {}
  // Stream-ordered Comms: seconds the communication streams (this Comm's and its duplicates')
  // spent in started collectives (issued_s) and seconds the compute stream waited for them in
  // Request::wait() (exposed_s), measured with CUDA events and accumulated up to the last
  // synchronize(); zero elsewhere.
  struct DeviceTimes {
    double issued_s = 0, exposed_s = 0;
    int64_t collectives = 0;
  };
  virtual DeviceTimes device_times() const { return {}; }
  // Collective. A new Comm over the same ranks on a duplicated communicator (its collectives
  // never match this one's), or nullptr where the implementation has none. MpiComm: MPI_Comm_dup.
  // NcclComm: ncclCommSplit, with a communication stream of its own (the compute stream is
  // shared); it must not outlive this Comm, whose synchronize() covers it, and collectives of the
  // two must be started in the same order on every rank (NCCL kernels of two communicators can
  // otherwise wait on each other). FSDP runs its gathers and its reduce-scatters each on one, so
  // that the two streams of collectives, started at different times on different ranks, cannot
  // cross, and on NCCL a prefetch does not queue behind a reduce-scatter.
  virtual std::unique_ptr<Comm> duplicate() { return nullptr; }

  // Type-erased entry points behind the templates above; public so that adapters (the NCCL and
  // host-staged device Comms) can forward to a host Comm. BF16 supports all_gather, broadcast
  // and reduce_scatter_sum (summed in float, rounded once per pairwise step), not all_reduce.
  enum class DType { F32, F64, I64, U64, I8, BF16 };
  template <typename T> static DType dtype_of();
  static size_t dtype_size(DType t);
  virtual void all_gather_impl(const void* send, void* recv, size_t count, DType t) = 0;
  virtual void reduce_scatter_sum_impl(const void* send, void* recv, size_t count, DType t) = 0;
  virtual void all_reduce_impl(void* buf, size_t count, DType t, ReduceOp op) = 0;
  virtual void broadcast_impl(void* buf, size_t count, DType t, int root) = 0;
  // Default: the blocking call, and a Request that is already complete.
  virtual std::unique_ptr<Request> start_all_gather_impl(const void* send, void* recv, size_t count, DType t);
  virtual std::unique_ptr<Request> start_reduce_scatter_sum_impl(const void* send, void* recv, size_t count, DType t);
  virtual std::unique_ptr<Request> start_all_reduce_sum_impl(void* buf, size_t count, DType t);
  // Point-to-point. send/recv default: std::logic_error (no point-to-point). The ring shift's
  // default: start_recv_impl from the left neighbour, then start_send_impl to the right one, both
  // with kRingShiftTag, under one Request (waits for both). tag may be kRingShiftTag here.
  virtual std::unique_ptr<Request> start_send_impl(const void* send, size_t count, DType t, int peer, int tag);
  virtual std::unique_ptr<Request> start_recv_impl(void* recv, size_t count, DType t, int peer, int tag);
  virtual std::unique_ptr<Request> start_ring_shift_impl(const void* send, void* recv, size_t count, DType t);
  // Default: start_recv_impl for each receive, then start_send_impl for each send, one Request.
  virtual std::unique_ptr<Request> start_group_impl(const std::vector<P2pOp>& ops, DType t);
};

// Comm over an MPI communicator with host buffers. The communicator is duplicated, so shardtrain's
// traffic never mixes with the caller's.
class MpiComm final : public Comm {
 public:
  // `mpi_comm` is an MPI_Comm passed as its integer/pointer handle value (keeps mpi.h out of
  // this header). Use MpiComm::world() for MPI_COMM_WORLD.
  static MpiComm world();
  // Collective over `parent` (MPI_Comm_split of its MPI communicator): the ranks of `parent` that
  // pass the same `color` form one new MpiComm, ranked by `key` (ties by parent rank). The mesh
  // (mesh.h) builds its shard and replica groups this way. Throws std::runtime_error if MPI fails.
  static MpiComm split(const Comm& parent, int color, int key);
  ~MpiComm() override;
  MpiComm(MpiComm&&) noexcept;
  MpiComm(const MpiComm&) = delete;
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  void barrier() override;
  void* mpi_handle() const override { return comm_; }
  void set_collective_timeout(double seconds) override;
  void watch_begin(const char* what) override;
  void watch_end() override;

 private:
  MpiComm() = default;
  void all_gather_impl(const void*, void*, size_t, DType) override;
  void reduce_scatter_sum_impl(const void*, void*, size_t, DType) override;
  void all_reduce_impl(void*, size_t, DType, ReduceOp) override;
  void broadcast_impl(void*, size_t, DType, int) override;
  std::unique_ptr<Request> start_all_gather_impl(const void*, void*, size_t, DType) override;
  std::unique_ptr<Request> start_reduce_scatter_sum_impl(const void*, void*, size_t, DType) override;
  std::unique_ptr<Request> start_all_reduce_sum_impl(void*, size_t, DType) override;
  std::unique_ptr<Request> start_send_impl(const void*, size_t, DType, int, int) override;  // MPI_Isend
  std::unique_ptr<Request> start_recv_impl(void*, size_t, DType, int, int) override;        // MPI_Irecv
  class P2pRequest;  // watched wait

 public:
  bool asynchronous() const override { return true; }
  std::unique_ptr<Comm> duplicate() override;

 private:
  std::vector<char> slab_;  // all_gather, reduce_scatter: one packed slab (<= kCollectiveSlab bytes)
  void* comm_ = nullptr;  // MPI_Comm, stored opaquely
  bool owned_ = false;
  int rank_ = 0, size_ = 1;
  struct Watchdog;
  Watchdog* wd_ = nullptr;
  class Guard;  // marks one collective as in flight for the watchdog
  std::vector<std::unique_ptr<Guard>> w_stack_;  // open CommWatch sections
};

// Exit status of a run stopped by SIGTERM or SIGUSR1 after saving a checkpoint (EX_TEMPFAIL):
// "preempted, resume me". Job scripts requeue on it.
inline constexpr int kExitPreempted = 75;
// Exit status of a rank whose collective watchdog fired (a peer died or hangs).
inline constexpr int kExitCollectiveTimeout = 70;

// Installs handlers for SIGTERM and SIGUSR1 (Slurm's --signal=USR1@T and scancel/preemption) that
// only record the signal; the training loop polls stop_signal() once per step.
void install_stop_handlers();
// The recorded signal number, 0 if none.
int stop_signal();
// For the modes that do not train (prepare, tokenizer, plan, inspect, export, import, generate):
// SIGTERM and SIGINT take their default action again (the process ends at once), replacing
// install_stop_handlers' recording handler, whose SA_RESTART would have a blocked system call
// restart and the signal wait for a poll that only the training loop makes. SIGINT is reset even
// where the launcher left it ignored (a background job of a non-interactive shell).
void end_on_stop_signals();

// Fatal signals (SIGSEGV, SIGBUS, SIGFPE, SIGILL; src/runtime/fatal_signal.cpp): the faulting
// thread's backtrace on stderr with the rank, the signal and the fault address, then death by the
// same signal. install_fatal_signal_handlers() runs first in main(), before MPI_Init (the rank then
// comes from OMPI_COMM_WORLD_RANK, PMIX_RANK or SLURM_PROCID; Open MPI keeps a handler installed
// before MPI_Init instead of its own); fatal_signal_mpi_ready() after it: the real rank and world
// size, the handlers checked (re-installed if a library replaced them). Test hook:
// SHARDTRAIN_TEST_FATAL_SIGNAL=WHAT[:RANK][:pre] (docs/errors.md).
void install_fatal_signal_handlers();
void fatal_signal_mpi_ready(int rank, int world);

// RAII section for the collective watchdog (see Comm::watch_begin).
class CommWatch {
 public:
  CommWatch(Comm& c, const char* what) : c_(c) { c_.watch_begin(what); }
  ~CommWatch() { c_.watch_end(); }
  CommWatch(const CommWatch&) = delete;

 private:
  Comm& c_;
};

// Process placement, read once at start-up.
struct Topology {
  int rank = 0;        // global rank
  int world_size = 1;  // number of ranks
  int local_rank = 0;  // rank among the ranks on this node (MPI_COMM_TYPE_SHARED split)
  int local_size = 1;  // ranks on this node
  int nodes = 1;       // number of nodes: distinct shared-memory groups over the job
  int node_id = 0;     // lowest global rank on this rank's node (names the node)
  int min_local_size = 1, max_local_size = 1;  // fewest / most ranks on any node
  // Test hook: SHARDTRAIN_TEST_RANKS_PER_NODE=k emulates nodes of k consecutive ranks (the last
  // one may hold fewer) on one host, in place of the shared-memory split; > 0 when in effect.
  int emulated_ranks_per_node = 0;
  std::string host;    // processor name
};

// The thread support level MPI granted at start-up (Runtime asks for MPI_THREAD_MULTIPLE, which a
// progress thread needs to call MPI_Test while the main thread calls other collectives).
bool mpi_thread_multiple();

// RAII MPI start-up and shut-down. Construct once in main(); calls MPI_Init_thread and, on
// destruction, MPI_Finalize. Computes the Topology (local rank through a shared-memory split).
class Runtime {
 public:
  Runtime(int* argc, char*** argv);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  const Topology& topo() const { return topo_; }
  Comm& comm() { return *comm_; }
  // Terminates every rank of the job (MPI_Abort). Only for unrecoverable, non-agreed failures.
  [[noreturn]] static void abort(int code);

 private:
  Topology topo_;
  MpiComm* comm_ = nullptr;
};

// Error agreement, to be called before any collective whose arguments depend on local success.
// Every rank passes whether its local step succeeded and, if not, why. If every rank succeeded this
// returns. Otherwise every rank throws CollectiveError carrying the message of the lowest failing
// rank R, prefixed with "rank R: " when R != 0. Cost: one all-reduce of one int64 on success,
// plus a broadcast of the message on failure.
void all_ok(Comm& comm, bool ok, const std::string& message);

// Runs `fn` and agrees on its outcome: any std::exception it throws on any rank becomes a
// CollectiveError on every rank (see all_ok). Returns normally on every rank iff fn succeeded on
// every rank. `fn` must not itself call collectives.
template <typename Fn> void agree(Comm& comm, Fn&& fn) {
  std::string msg;
  bool ok = true;
  try {
    fn();
  } catch (const std::exception& e) {
    ok = false;
    msg = e.what();
  }
  all_ok(comm, ok, msg);
}

// 64-bit FNV-1a hash of a byte string (http://www.isthe.com/chongo/tech/comp/fnv/). Used to check
// that all ranks hold identical canonical configs.
uint64_t fnv1a64(const std::string& s);

// Collective. True on every rank iff every rank passed the same `value` (e.g. an fnv1a64 hash):
// one all-reduce of {value, ~value} with Max (max of ~value is ~min of value).
bool same_on_all_ranks(Comm& comm, uint64_t value);

// Collective. The ranks whose `value` (e.g. a digest of a file they read) differs from rank 0's,
// in increasing order; empty when every rank passed rank 0's value. One all-gather of a uint64.
std::vector<int> ranks_differing_from_root(Comm& comm, uint64_t value);

// A sorted list of integers with runs shortened: {0, 3, 5, 6, 7} -> "0" sep "3" sep "5-7".
std::string int_ranges(const std::vector<int>& v, const std::string& sep);
// "rank 2", "ranks 1-2", "ranks 0, 3, 5-7": a sorted list of ranks for messages.
std::string rank_list(const std::vector<int>& ranks);

// Logging: rank 0 prints informational lines; every rank prints errors.
void log_info(const Comm& comm, const std::string& line);  // stdout, rank 0 only
void log_error(int rank, int world, const std::string& line);  // stderr, any rank

}  // namespace shardtrain

#include "shardtrain/runtime/runtime_inl.h"
