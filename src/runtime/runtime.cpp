// MPI implementation of the runtime layer: bootstrap, MpiComm collectives, error agreement.
#include "shardtrain/runtime/runtime.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <csignal>
#include <thread>
#include <cstdio>
#include <iostream>
#include <unistd.h>

namespace shardtrain {
namespace {

MPI_Comm as_mpi(void* c) { return reinterpret_cast<MPI_Comm>(c); }

MPI_Datatype mpi_type(Comm::DType t) {
  switch (t) {
    case Comm::DType::F32: return MPI_FLOAT;
    case Comm::DType::F64: return MPI_DOUBLE;
    case Comm::DType::I64: return MPI_INT64_T;
    case Comm::DType::U64: return MPI_UINT64_T;
    case Comm::DType::BF16: return MPI_UINT16_T;  // bf16 bits
    case Comm::DType::I8: break;
  }
  return MPI_CHAR;
}

// MPI has no bfloat16: sums of bf16 (carried as MPI_UINT16_T) go through this user-defined op,
// which adds in float and rounds once per call, as NCCL's ncclBfloat16 sum does per step.
extern "C" void bf16_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const bf16* a = static_cast<const bf16*>(in);
  bf16* b = static_cast<bf16*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = math::f32_to_bf16(math::bf16_to_f32(a[i]) + math::bf16_to_f32(b[i]));
}
MPI_Op bf16_sum() {
  static MPI_Op op = [] {
    MPI_Op o;
    MPI_Op_create(bf16_sum_op, 1, &o);
    return o;
  }();
  return op;
}

void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char buf[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, buf, &len);
    throw std::runtime_error(std::string(what) + " failed: " + std::string(buf, len));
  }
}

// MPI counts are int; collectives on more than INT_MAX elements are split by callers of FSDP
// (a unit shard of >2^31 elements is out of scope), so refuse loudly instead of truncating.
int to_count(size_t n, const char* what) {
  if (n > static_cast<size_t>(INT_MAX)) throw std::runtime_error(std::string(what) + ": count exceeds INT_MAX");
  return static_cast<int>(n);
}

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
}
int stop_signal() { return g_stop_signal.load(); }
void end_on_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

// A thread that wakes every 0.5 s and checks how long the current collective has been running.
struct MpiComm::Watchdog {
  std::atomic<int64_t> since{0};        // last progress of the section in flight (ns), 0 if none
  int depth = 0;                        // nesting of sections (main thread only)
  std::atomic<const char*> what{""};
  std::atomic<int64_t> timeout_ns{0};
  std::atomic<bool> quit{false};
  std::thread thread;
  Watchdog(int rank, int world) {
    thread = std::thread([this, rank, world] {
      while (!quit.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        int64_t t0 = since.load(), lim = timeout_ns.load();
        if (t0 != 0 && lim > 0 && now_ns() - t0 > lim) {
          char b[256];
          std::snprintf(b, sizeof b,
                        "collective %s has not completed after %.0f s: another rank is dead or stuck; "
                        "ending the job (option '--collective-timeout')",
                        what.load(), static_cast<double>(now_ns() - t0) / 1e9);
          log_error(rank, world, b);
          std::_Exit(kExitCollectiveTimeout);
        }
      }
    });
  }
  ~Watchdog() {
    quit.store(true);
    thread.join();
  }
};

// A collective in flight. Inside an outer section (CommWatch), finishing it counts as progress:
// the outer section's clock restarts.
class MpiComm::Guard {
 public:
  Guard(Watchdog* w, const char* what) : w_(w) {
    if (w_) {
      prev_ = w_->what.load();
      w_->what.store(what);
      w_->since.store(now_ns());
      ++w_->depth;
    }
  }
  ~Guard() {
    if (w_) {
      --w_->depth;
      w_->what.store(prev_);
      w_->since.store(w_->depth > 0 ? now_ns() : 0);
    }
  }

 private:
  Watchdog* w_;
  const char* prev_ = "";
};

void MpiComm::watch_begin(const char* what) {
  if (!wd_) return;
  w_stack_.push_back(std::make_unique<Guard>(wd_, what));
}
void MpiComm::watch_end() {
  if (!w_stack_.empty()) w_stack_.pop_back();
}

void MpiComm::set_collective_timeout(double seconds) {
  // The message names the job's rank (MPI_COMM_WORLD), not this communicator's: a sub-group's
  // (shard, replica, TP group) rank numbers repeat across its groups.
  int wr = 0, ws = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  MPI_Comm_size(MPI_COMM_WORLD, &ws);
  if (!wd_) wd_ = new Watchdog(wr, ws);
  wd_->timeout_ns.store(static_cast<int64_t>(seconds * 1e9));
}

MpiComm MpiComm::world() {
  MpiComm c;
  MPI_Comm dup;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup");
  c.comm_ = reinterpret_cast<void*>(dup);
  c.owned_ = true;
  MPI_Comm_rank(dup, &c.rank_);
  MPI_Comm_size(dup, &c.size_);
  return c;
}

MpiComm MpiComm::split(const Comm& parent, int color, int key) {
  MpiComm c;
  MPI_Comm sub;
  check_mpi(MPI_Comm_split(as_mpi(parent.mpi_handle()), color, key, &sub), "MPI_Comm_split");
  c.comm_ = reinterpret_cast<void*>(sub);
  c.owned_ = true;
  MPI_Comm_rank(sub, &c.rank_);
  MPI_Comm_size(sub, &c.size_);
  return c;
}

MpiComm::MpiComm(MpiComm&& o) noexcept
    : comm_(o.comm_), owned_(o.owned_), rank_(o.rank_), size_(o.size_), wd_(o.wd_), w_stack_(std::move(o.w_stack_)) {
  o.owned_ = false;
  o.comm_ = nullptr;
  o.wd_ = nullptr;
}

MpiComm::~MpiComm() {
  w_stack_.clear();  // guards refer to wd_
  delete wd_;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && !finalized) {
    MPI_Comm c = as_mpi(comm_);
    MPI_Comm_free(&c);
  }
}

void MpiComm::barrier() {
  Guard g(wd_, "barrier");
  check_mpi(MPI_Barrier(as_mpi(comm_)), "MPI_Barrier");
}

void MpiComm::all_gather_impl(const void* send, void* recv, size_t count, DType t) {
  MPI_Datatype dt = mpi_type(t);
  Guard g(wd_, "all_gather");
  const size_t es = dtype_size(t), W = static_cast<size_t>(size_);
  const size_t slab = std::max<size_t>(1, kCollectiveSlab / es / W);  // elements per rank's block
  if (count <= slab) {
    int n = to_count(count, "all_gather");
    const void* s = send;
    if (send == static_cast<char*>(recv) + static_cast<size_t>(rank_) * count * es) s = MPI_IN_PLACE;
    check_mpi(MPI_Allgather(s, n, dt, recv, n, dt, as_mpi(comm_)), "MPI_Allgather");
    return;
  }
  slab_.resize(slab * W * es);
  const char* s = static_cast<const char*>(send);
  char* r = static_cast<char*>(recv);
  for (size_t a = 0; a < count; a += slab) {  // gather [W, n] packed, then unpack into the W blocks
    const size_t n = std::min(slab, count - a);
    check_mpi(MPI_Allgather(s + a * es, to_count(n, "all_gather"), dt, slab_.data(), to_count(n, "all_gather"), dt,
                            as_mpi(comm_)),
              "MPI_Allgather");
    for (size_t q = 0; q < W; ++q) std::memcpy(r + (q * count + a) * es, slab_.data() + q * n * es, n * es);
  }
}

void MpiComm::reduce_scatter_sum_impl(const void* send, void* recv, size_t count, DType t) {
  Guard g(wd_, "reduce_scatter");
  const size_t es = dtype_size(t), W = static_cast<size_t>(size_);
  const size_t slab = std::max<size_t>(1, kCollectiveSlab / es / W);  // elements per rank's block
  MPI_Op op = t == DType::BF16 ? bf16_sum() : MPI_SUM;
  if (count <= slab) {
    check_mpi(MPI_Reduce_scatter_block(send, recv, to_count(count, "reduce_scatter"), mpi_type(t), op, as_mpi(comm_)),
              "MPI_Reduce_scatter_block");
    return;
  }
  slab_.resize(slab * W * es);
  const char* s = static_cast<const char*>(send);
  for (size_t a = 0; a < count; a += slab) {  // pack [W, n] from the W blocks, reduce-scatter it
    const size_t n = std::min(slab, count - a);
    for (size_t r = 0; r < W; ++r) std::memcpy(slab_.data() + r * n * es, s + (r * count + a) * es, n * es);
    check_mpi(MPI_Reduce_scatter_block(slab_.data(), static_cast<char*>(recv) + a * es, to_count(n, "reduce_scatter"),
                                       mpi_type(t), op, as_mpi(comm_)),
              "MPI_Reduce_scatter_block");
  }
}

void MpiComm::all_reduce_impl(void* buf, size_t count, DType t, ReduceOp op) {
  Guard g(wd_, "all_reduce");
  MPI_Op mop = op == ReduceOp::Sum ? MPI_SUM : op == ReduceOp::Max ? MPI_MAX : MPI_MIN;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, buf, to_count(count, "all_reduce"), mpi_type(t), mop,
                          as_mpi(comm_)),
            "MPI_Allreduce");
}

void MpiComm::broadcast_impl(void* buf, size_t count, DType t, int root) {
  Guard g(wd_, "broadcast");
  check_mpi(MPI_Bcast(buf, to_count(count, "broadcast"), mpi_type(t), root, as_mpi(comm_)),
            "MPI_Bcast");
}

namespace {
// A collective that completed before it was returned (the default start_* of Comm).
class DoneRequest final : public Comm::Request {
 public:
  bool test() override { return true; }
  void wait() override {}
};
// Comm::Request::test of one MPI request: MPI_Test once unless *done, which it sets on completion.
bool test_mpi_request(MPI_Request* r, bool* done) {
  if (!*done) {
    int flag = 0;
    check_mpi(MPI_Test(r, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    *done = flag != 0;
  }
  return *done;
}
class MpiRequest final : public Comm::Request {
 public:
  MPI_Request r = MPI_REQUEST_NULL;
  bool done = false;
  bool test() override { return test_mpi_request(&r, &done); }
  void wait() override {
    if (!done) check_mpi(MPI_Wait(&r, MPI_STATUS_IGNORE), "MPI_Wait");
    done = true;
  }
  ~MpiRequest() override {
    if (!done && r != MPI_REQUEST_NULL) MPI_Wait(&r, MPI_STATUS_IGNORE);  // never leave a request behind
  }
};
int g_thread_level = 0;
}  // namespace

bool mpi_thread_multiple() { return g_thread_level >= MPI_THREAD_MULTIPLE; }

std::unique_ptr<Comm::Request> Comm::start_all_gather_impl(const void* send, void* recv, size_t count, DType t) {
  all_gather_impl(send, recv, count, t);
  return std::make_unique<DoneRequest>();
}
std::unique_ptr<Comm::Request> Comm::start_reduce_scatter_sum_impl(const void* send, void* recv, size_t count,
                                                                   DType t) {
  reduce_scatter_sum_impl(send, recv, count, t);
  return std::make_unique<DoneRequest>();
}

std::unique_ptr<Comm::Request> Comm::start_all_reduce_sum_impl(void* buf, size_t count, DType t) {
  all_reduce_impl(buf, count, t, ReduceOp::Sum);
  return std::make_unique<DoneRequest>();
}

std::unique_ptr<Comm::Request> MpiComm::start_all_gather_impl(const void* send, void* recv, size_t count, DType t) {
  auto q = std::make_unique<MpiRequest>();
  const int n = to_count(count, "all_gather");
  check_mpi(MPI_Iallgather(send, n, mpi_type(t), recv, n, mpi_type(t), as_mpi(comm_), &q->r), "MPI_Iallgather");
  return q;
}
std::unique_ptr<Comm::Request> MpiComm::start_reduce_scatter_sum_impl(const void* send, void* recv, size_t count,
                                                                      DType t) {
  auto q = std::make_unique<MpiRequest>();
  check_mpi(MPI_Ireduce_scatter_block(send, recv, to_count(count, "reduce_scatter"), mpi_type(t),
                                      t == DType::BF16 ? bf16_sum() : MPI_SUM, as_mpi(comm_), &q->r),
            "MPI_Ireduce_scatter_block");
  return q;
}
std::unique_ptr<Comm::Request> MpiComm::start_all_reduce_sum_impl(void* buf, size_t count, DType t) {
  if (t == DType::BF16) throw std::invalid_argument("MpiComm::start_all_reduce_sum: bf16 is not supported");
  auto q = std::make_unique<MpiRequest>();
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buf, to_count(count, "all_reduce"), mpi_type(t), MPI_SUM, as_mpi(comm_), &q->r),
            "MPI_Iallreduce");
  return q;
}
// ---- Point-to-point --------------------------------------------------------------------------

std::vector<size_t> Comm::exchange_counts(const std::vector<size_t>& send_counts) {
  const size_t W = static_cast<size_t>(world_size());
  if (send_counts.size() != W)
    throw std::invalid_argument("Comm::exchange_counts: " + std::to_string(send_counts.size()) + " counts for " +
                                std::to_string(W) + " ranks");
  if (stream_ordered())
    throw std::logic_error("Comm::exchange_counts on a stream-ordered Comm (device memory): use its host Comm");
  std::vector<uint64_t> mine(send_counts.begin(), send_counts.end()), all(W * W);
  all_gather(mine.data(), all.data(), W);
  std::vector<size_t> recv(W);
  for (size_t p = 0; p < W; ++p) recv[p] = static_cast<size_t>(all[p * W + static_cast<size_t>(rank())]);
  return recv;
}

void Comm::check_p2p(int peer, int tag, const char* what) const {
  if (peer < 0 || peer >= world_size())
    throw std::invalid_argument(std::string(what) + ": peer " + std::to_string(peer) + " is not a rank of this group (0.." +
                                std::to_string(world_size() - 1) + ")");
  if (tag < 0 || tag >= kP2pTagLimit)
    throw std::invalid_argument(std::string(what) + ": tag " + std::to_string(tag) + " is outside [0, " +
                                std::to_string(kP2pTagLimit) + ")");
}

std::unique_ptr<Comm::Request> Comm::start_send_impl(const void*, size_t, DType, int, int) {
  throw std::logic_error("this Comm has no point-to-point transfers (start_send)");
}
std::unique_ptr<Comm::Request> Comm::start_recv_impl(void*, size_t, DType, int, int) {
  throw std::logic_error("this Comm has no point-to-point transfers (start_recv)");
}

namespace {
// The transfers of a group: complete when every one is.
class GroupRequest final : public Comm::Request {
 public:
  explicit GroupRequest(std::vector<std::unique_ptr<Comm::Request>> r) : r_(std::move(r)) {}
  bool test() override {
    bool all = true;
    for (auto& q : r_) all = q->test() && all;  // test every one: each call drives progress
    return all;
  }
  void wait() override {
    for (auto& q : r_) q->wait();
  }

 private:
  std::vector<std::unique_ptr<Comm::Request>> r_;
};
}  // namespace

std::unique_ptr<Comm::Request> Comm::start_ring_shift_impl(const void* send, void* recv, size_t count, DType t) {
  const int W = world_size(), r = rank();
  auto in = start_recv_impl(recv, count, t, (r + W - 1) % W, kRingShiftTag);
  std::vector<std::unique_ptr<Request>> both;
  both.push_back(std::move(in));
  both.push_back(start_send_impl(send, count, t, (r + 1) % W, kRingShiftTag));
  return std::make_unique<GroupRequest>(std::move(both));
}

std::unique_ptr<Comm::Request> Comm::start_group_impl(const std::vector<P2pOp>& ops, DType t) {
  std::vector<std::unique_ptr<Request>> r;
  for (const P2pOp& o : ops)
    if (o.recv) r.push_back(start_recv_impl(o.buf, o.count, t, o.peer, o.tag));
  for (const P2pOp& o : ops)
    if (!o.recv) r.push_back(start_send_impl(o.buf, o.count, t, o.peer, o.tag));
  return std::make_unique<GroupRequest>(std::move(r));
}

// One MPI_Isend or MPI_Irecv. Its waits (wait(), and the destructor's when it never completed) are
// watched collectives of the Comm's watchdog.
class MpiComm::P2pRequest final : public Comm::Request {
 public:
  P2pRequest(Watchdog* wd, const char* what) : wd_(wd), what_(what) {}
  MPI_Request r = MPI_REQUEST_NULL;
  bool test() override { return test_mpi_request(&r, &done_); }
  void wait() override {
    if (done_) return;
    Guard g(wd_, what_);
    check_mpi(MPI_Wait(&r, MPI_STATUS_IGNORE), "MPI_Wait");
    done_ = true;
  }
  ~P2pRequest() override {
    if (!done_ && r != MPI_REQUEST_NULL) {
      Guard g(wd_, what_);
      MPI_Wait(&r, MPI_STATUS_IGNORE);
    }
  }

 private:
  Watchdog* wd_;
  const char* what_;
  bool done_ = false;
};

// The watchdog's name of a point-to-point transfer: the collective its tag reserves, else send / receive.
static const char* p2p_name(int tag, bool recv) {
  if (tag == Comm::kRingShiftTag) return recv ? "ring_shift (receive)" : "ring_shift (send)";
  if (tag == Comm::kAllToAllTag) return recv ? "all_to_all_v (receive; expert parallelism's dispatch or combine)"
                                             : "all_to_all_v (send; expert parallelism's dispatch or combine)";
  return recv ? "receive" : "send";
}

std::unique_ptr<Comm::Request> MpiComm::start_send_impl(const void* send, size_t count, DType t, int peer, int tag) {
  auto q = std::make_unique<P2pRequest>(wd_, p2p_name(tag, false));
  check_mpi(MPI_Isend(send, to_count(count, "send"), mpi_type(t), peer, tag, as_mpi(comm_), &q->r), "MPI_Isend");
  return q;
}
std::unique_ptr<Comm::Request> MpiComm::start_recv_impl(void* recv, size_t count, DType t, int peer, int tag) {
  auto q = std::make_unique<P2pRequest>(wd_, p2p_name(tag, true));
  check_mpi(MPI_Irecv(recv, to_count(count, "receive"), mpi_type(t), peer, tag, as_mpi(comm_), &q->r), "MPI_Irecv");
  return q;
}

std::unique_ptr<Comm> MpiComm::duplicate() {
  auto c = std::unique_ptr<MpiComm>(new MpiComm());
  MPI_Comm dup;
  check_mpi(MPI_Comm_dup(as_mpi(comm_), &dup), "MPI_Comm_dup");
  c->comm_ = reinterpret_cast<void*>(dup);
  c->owned_ = true;
  c->rank_ = rank_;
  c->size_ = size_;
  return c;
}

size_t Comm::dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: case DType::I64: case DType::U64: return 8;
    case DType::BF16: return 2;
    default: return 1;
  }
}

std::string Comm::broadcast_string(const std::string& s, int root) {
  int64_t len = static_cast<int64_t>(s.size());
  broadcast(&len, 1, root);
  std::string out = rank() == root ? s : std::string(static_cast<size_t>(len), '\0');
  if (len > 0) broadcast(out.data(), static_cast<size_t>(len), root);
  return out;
}

Runtime::Runtime(int* argc, char*** argv) {
  int provided = 0;
  // MULTIPLE: the FSDP progress thread (--comm-progress thread) tests nonblocking collectives
  // while the main thread runs others; mpi_thread_multiple() says whether MPI granted it.
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  g_thread_level = provided;
  MPI_Comm_rank(MPI_COMM_WORLD, &topo_.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &topo_.world_size);
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, topo_.rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &topo_.local_rank);
  MPI_Comm_size(local, &topo_.local_size);
  topo_.node_id = topo_.rank;
  MPI_Allreduce(MPI_IN_PLACE, &topo_.node_id, 1, MPI_INT, MPI_MIN, local);
  MPI_Comm_free(&local);
  // Test hook (docs/parallelism.md, "Hybrid sharding"): emulate nodes of k consecutive ranks on one host.
  if (const char* e = std::getenv("SHARDTRAIN_TEST_RANKS_PER_NODE")) {
    const int k = std::atoi(e);
    if (k > 0) {
      topo_.emulated_ranks_per_node = k;
      topo_.node_id = topo_.rank / k * k;
      topo_.local_rank = topo_.rank - topo_.node_id;
      topo_.local_size = std::min(k, topo_.world_size - topo_.node_id);
    }
  }
  int agg[3] = {topo_.local_rank == 0 ? 1 : 0, topo_.local_size, -topo_.local_size};
  MPI_Allreduce(MPI_IN_PLACE, agg, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, agg + 1, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  topo_.nodes = agg[0];
  topo_.max_local_size = agg[1];
  topo_.min_local_size = -agg[2];
  char name[MPI_MAX_PROCESSOR_NAME];
  int len = 0;
  MPI_Get_processor_name(name, &len);
  topo_.host.assign(name, len);
  // Errors from MPI calls come back as return codes (turned into exceptions by check_mpi), not
  // as an immediate abort, so the caller can report them.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  comm_ = new MpiComm(MpiComm::world());
}

Runtime::~Runtime() {
  delete comm_;
  MPI_Finalize();
}

void Runtime::abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); std::abort(); }

void all_ok(Comm& comm, bool ok, const std::string& message) {
  // One all-reduce answers both "did anyone fail" and "who is the lowest failing rank":
  // each rank contributes its rank if it failed, else INT64_MAX; MIN gives the lowest failure.
  int64_t code = ok ? INT64_MAX : static_cast<int64_t>(comm.rank());
  comm.all_reduce(&code, 1, ReduceOp::Min);
  if (code == INT64_MAX) return;
  int origin = static_cast<int>(code);
  std::string msg = comm.broadcast_string(message, origin);
  if (origin != 0) msg = "rank " + std::to_string(origin) + ": " + msg;
  throw CollectiveError(origin, msg);
}

bool same_on_all_ranks(Comm& comm, uint64_t value) {
  uint64_t h[2] = {value, ~value};
  comm.all_reduce(h, 2, ReduceOp::Max);
  return h[0] == value && h[1] == ~value;
}

std::vector<int> ranks_differing_from_root(Comm& comm, uint64_t value) {
  std::vector<uint64_t> all(static_cast<size_t>(comm.world_size()));
  comm.all_gather(&value, all.data(), 1);
  std::vector<int> odd;
  for (int r = 0; r < comm.world_size(); ++r)
    if (all[static_cast<size_t>(r)] != all[0]) odd.push_back(r);
  return odd;
}

std::string int_ranges(const std::vector<int>& v, const std::string& sep) {
  std::string o;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!o.empty()) o += sep;
    o += std::to_string(v[i]);
    if (j > i) {
      o += '-';
      o += std::to_string(v[j]);
    }
    i = j + 1;
  }
  return o;
}

std::string rank_list(const std::vector<int>& r) { return (r.size() == 1 ? "rank " : "ranks ") + int_ranges(r, ", "); }

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

void log_info(const Comm& comm, const std::string& line) {
  if (comm.rank() == 0) {
    std::cout << line << std::endl;
  }
}

void log_error(int rank, int world, const std::string& line) {
  // One write(2) per line, so lines from several ranks sharing a terminal do not interleave.
  std::string s = "shardtrain: error [rank " + std::to_string(rank) + "/" + std::to_string(world) + "]: " + line + "\n";
  std::fflush(stderr);
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(2, s.data() + off, s.size() - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
}

}  // namespace shardtrain
