// Device-buffer collectives (include/shardtrain/backend/cuda.h): NcclComm, one rank per GPU through NCCL,
// and StagedComm, which copies device buffers to host memory and runs the host (MPI) Comm on them,
// for several ranks sharing one GPU (NCCL refuses two ranks on one device).
//
// The blocking collectives of both run on the CudaContext's stream, which orders them after the
// backend's kernels, and synchronize that stream before returning: on return the result is in the
// device buffer, as an MPI collective's is in the host buffer. NcclComm's start_* calls are
// stream-ordered instead (Comm::stream_ordered, runtime.h): NCCL on a communication
// stream of its own, ordered against the compute stream with CUDA events, and no host wait until
// synchronize(). mpi.h is deliberately not included; everything MPI goes through the host Comm.
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <cstddef>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../backend/cuda/cuda_check.h"
#include "../backend/cuda/plugin_abi.h"
#include "shardtrain/backend/cuda.h"

namespace shardtrain {
namespace {

using DType = Comm::DType;

using cuda_detail::check_cuda;

std::string nccl_error(ncclResult_t r, const char* call, ncclComm_t comm) {
  std::string m = std::string(call) + " failed: " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);  // may describe an earlier asynchronous error
  if (last && *last) m += std::string(" (") + last + ")";
  return m;
}
inline void check_nccl(ncclResult_t r, const char* call, ncclComm_t comm) {
  if (r != ncclSuccess) throw std::runtime_error(nccl_error(r, call, comm));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::I64: return ncclInt64;
    case DType::U64: return ncclUint64;
    case DType::I8: return ncclInt8;  // char
    case DType::BF16: return ncclBfloat16;
  }
  throw std::logic_error("NcclComm: unknown element type");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  throw std::logic_error("NcclComm: unknown reduction");
}

std::string host_name() {
  char b[256] = {};
  if (gethostname(b, sizeof b - 1) != 0) return "?";
  return b;
}

// ------------------------------------------------------------------------------------------------
// What both device Comms share: collectives on device buffers ordered on the context stream;
// ranks, barrier, watchdog and MPI handle from the host Comm, which must outlive this.

class DeviceComm : public Comm {
 public:
  DeviceComm(Comm& host, cudaStream_t stream, const char* name) : host_(host), stream_(stream), name_(name) {}
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  int rank() const override { return host_.rank(); }
  int world_size() const override { return host_.world_size(); }
  void barrier() override {
    // Device work of this rank first, so that "after the barrier" includes its GPU work.
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", name_);
    host_.barrier();
  }
  void set_collective_timeout(double seconds) override { host_.set_collective_timeout(seconds); }
  void watch_begin(const char* what) override { host_.watch_begin(what); }
  void watch_end() override { host_.watch_end(); }
  void* mpi_handle() const override { return host_.mpi_handle(); }

 protected:
  Comm& host_;
  cudaStream_t stream_;

 private:
  const char* name_;  // for messages: "NcclComm::barrier"
};

// ------------------------------------------------------------------------------------------------
// NCCL

// A CUDA event shared by the request that waits on it and the comm's timing lists.
using Event = std::shared_ptr<CUevent_st>;

class NcclComm final : public DeviceComm {
 public:
  NcclComm(Comm& host, ncclComm_t comm, cudaStream_t stream)
      : DeviceComm(host, stream, "NcclComm::barrier"), comm_(comm) {
    check_cuda(cudaStreamCreateWithFlags(&cstream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
               "NcclComm communication stream");
  }

  // ncclCommDestroy flushes outstanding work and, in current NCCL, may wait on peers; it is
  // watched like a collective so that a dead peer cannot hang shutdown forever. While an exception
  // unwinds the stack the job is failing (possibly on this rank only, so peers may never come to
  // destroy their side): ncclCommAbort then frees local resources without waiting for anyone.
  // Neither throws.
  ~NcclComm() override {
    if (parent_) std::erase(parent_->children_, this);
    for (NcclComm* c : children_) c->parent_ = nullptr;
    end_comm();
    marks_.clear();  // the events, before their stream
    waits_.clear();
    last_.reset();
    if (cstream_) (void)cudaStreamDestroy(cstream_);
  }

  // NCCL recognizes the in-place all-gather by exactly this address relation
  // (sendbuff == recvbuff + rank*sendcount), which is also the Comm contract's.
  void all_gather_impl(const void* send, void* recv, size_t count, DType t) override {
    if (count == 0) return;  // every rank sees the same count, so every rank skips it
    run("nccl all_gather", "ncclAllGather",
        [&] { return ncclAllGather(send, recv, count, nccl_type(t), comm_, stream_); });
  }
  void reduce_scatter_sum_impl(const void* send, void* recv, size_t count, DType t) override {
    if (count == 0) return;
    run("nccl reduce_scatter", "ncclReduceScatter",
        [&] { return ncclReduceScatter(send, recv, count, nccl_type(t), ncclSum, comm_, stream_); });
  }
  void all_reduce_impl(void* buf, size_t count, DType t, ReduceOp op) override {
    if (count == 0) return;
    run("nccl all_reduce", "ncclAllReduce",
        [&] { return ncclAllReduce(buf, buf, count, nccl_type(t), nccl_op(op), comm_, stream_); });
  }
  void broadcast_impl(void* buf, size_t count, DType t, int root) override {
    if (count == 0) return;
    run("nccl broadcast", "ncclBroadcast",
        [&] { return ncclBroadcast(buf, buf, count, nccl_type(t), root, comm_, stream_); });
  }

  // ---- stream-ordered collectives (Comm::stream_ordered) --------------------------------------
  bool asynchronous() const override { return true; }
  bool stream_ordered() const override { return true; }
  std::unique_ptr<Request> start_all_gather_impl(const void* send, void* recv, size_t count, DType t) override {
    return start("ncclAllGather", count,
                 [&](cudaStream_t s) { return ncclAllGather(send, recv, count, nccl_type(t), comm_, s); });
  }
  std::unique_ptr<Request> start_reduce_scatter_sum_impl(const void* send, void* recv, size_t count,
                                                         DType t) override {
    return start("ncclReduceScatter", count, [&](cudaStream_t s) {
      return ncclReduceScatter(send, recv, count, nccl_type(t), ncclSum, comm_, s);
    });
  }
  // Point-to-point, stream-ordered like start_* above (runtime.h): on the communication stream
  // after the compute stream's work so far, one NCCL group each (ncclSend / ncclRecv; the ring
  // shift's send and receive in one group, so that no rank's send waits behind its own receive).
  // NCCL has no tags: transfers match in start order per pair of ranks.
  std::unique_ptr<Request> start_send_impl(const void* send, size_t count, DType t, int peer, int) override {
    return start("ncclSend", count, [&](cudaStream_t s) {
      return grouped([&] { return ncclSend(send, count, nccl_type(t), peer, comm_, s); });
    });
  }
  std::unique_ptr<Request> start_recv_impl(void* recv, size_t count, DType t, int peer, int) override {
    return start("ncclRecv", count, [&](cudaStream_t s) {
      return grouped([&] { return ncclRecv(recv, count, nccl_type(t), peer, comm_, s); });
    });
  }
  std::unique_ptr<Request> start_ring_shift_impl(const void* send, void* recv, size_t count, DType t) override {
    const int W = world_size(), r = rank();
    return start("nccl ring_shift", count, [&](cudaStream_t s) {
      return grouped([&] {
        const ncclResult_t a = ncclRecv(recv, count, nccl_type(t), (r + W - 1) % W, comm_, s);
        return a != ncclSuccess ? a : ncclSend(send, count, nccl_type(t), (r + 1) % W, comm_, s);
      });
    });
  }

  // One NCCL group of every transfer (start_group): they progress together on the communication
  // stream, so that a send and a receive between two stages never wait for each other. Transfers of
  // no elements are left out (both sides see the same counts).
  std::unique_ptr<Request> start_group_impl(const std::vector<P2pOp>& ops, DType t) override {
    size_t total = 0;
    for (const P2pOp& o : ops) total += o.count;
    return start("nccl group (send/receive)", total, [&](cudaStream_t s) {
      return grouped([&] {
        for (const P2pOp& o : ops) {
          if (o.count == 0) continue;
          const ncclResult_t r = o.recv ? ncclRecv(o.buf, o.count, nccl_type(t), o.peer, comm_, s)
                                        : ncclSend(o.buf, o.count, nccl_type(t), o.peer, comm_, s);
          if (r != ncclSuccess) return r;
        }
        return ncclSuccess;
      });
    });
  }

  // Covers the Comms duplicate() made from this one: their streams are waited for too, and their
  // device times are added to this one's.
  void synchronize() override {
    bool any = static_cast<bool>(last_);
    for (const NcclComm* c : children_) any = any || static_cast<bool>(c->last_);
    if (!any) return;
    {
      CommWatch w(host_, "nccl synchronize (overlapped collectives)");
      for (NcclComm* c : children_)
        check_cuda(cudaStreamSynchronize(c->cstream_), "cudaStreamSynchronize", "NcclComm::synchronize");
      check_cuda(cudaStreamSynchronize(cstream_), "cudaStreamSynchronize", "NcclComm::synchronize");
      check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", "NcclComm::synchronize");
    }
    for (NcclComm* c : children_) c->drain(times_);
    drain(times_);
  }
  DeviceTimes device_times() const override { return times_; }

  // Collective over this communicator's ranks: a NcclComm on a communicator of its own
  // (ncclCommSplit, NCCL >= 2.18: the same ranks, in the same order) with its own communication
  // stream, on the same compute stream and host Comm. Its collectives never match this one's and
  // may run at the same time; callers enqueue collectives of the two in the same order on every
  // rank (NCCL kernels of different communicators can otherwise wait on each other forever). It
  // must not outlive this Comm, whose synchronize() covers it. A failure on any rank is agreed
  // (all_ok over the host Comm): CollectiveError on every rank. Older NCCL: nullptr (the caller
  // shares this Comm and its stream).
  std::unique_ptr<Comm> duplicate() override {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    ncclComm_t child = nullptr;
    bool ok = true;
    std::string msg;
    {
      CommWatch w(host_, "ncclCommSplit");
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 1;
      const ncclResult_t r = ncclCommSplit(comm_, 0, rank(), &child, &config);
      if (r != ncclSuccess) {
        ok = false;
        msg = "NCCL communicator split failed: " + nccl_error(r, "ncclCommSplit", comm_);
        if (child) (void)ncclCommAbort(child);
        child = nullptr;
      }
    }
    try {
      all_ok(host_, ok, msg);
    } catch (...) {
      if (child) (void)ncclCommAbort(child);
      throw;
    }
    std::unique_ptr<NcclComm> c;
    try {
      c = std::make_unique<NcclComm>(host_, child, stream_);
    } catch (...) {
      (void)ncclCommAbort(child);
      throw;
    }
    c->parent_ = this;
    children_.push_back(c.get());
    return c;
#else
    return nullptr;
#endif
  }

 private:
  // Waits on `e` from the compute stream (Request::wait), between two timing events.
  class StreamRequest final : public Request {
   public:
    StreamRequest(NcclComm* c, Event done) : c_(c), done_(std::move(done)) {}
    bool test() override {
      const cudaError_t e = cudaEventQuery(done_.get());
      if (e == cudaErrorNotReady) return false;
      check_cuda(e, "cudaEventQuery", "NcclComm request");
      return true;
    }
    void wait() override {
      if (waited_) return;
      waited_ = true;
      Event a = c_->event(), b = c_->event();
      check_cuda(cudaEventRecord(a.get(), c_->stream_), "cudaEventRecord", "NcclComm request wait");
      check_cuda(cudaStreamWaitEvent(c_->stream_, done_.get(), 0), "cudaStreamWaitEvent", "NcclComm request wait");
      check_cuda(cudaEventRecord(b.get(), c_->stream_), "cudaEventRecord", "NcclComm request wait");
      c_->waits_.emplace_back(std::move(a), std::move(b));
    }

   private:
    NcclComm* c_;
    Event done_;
    bool waited_ = false;
  };

  // ncclGroupStart, the calls, ncclGroupEnd (also after a failed call: the group is closed).
  template <typename Calls> static ncclResult_t grouped(Calls&& calls) {
    const ncclResult_t g = ncclGroupStart();
    if (g != ncclSuccess) return g;
    const ncclResult_t r = calls();
    const ncclResult_t e = ncclGroupEnd();
    return r != ncclSuccess ? r : e;
  }

  Event event() {
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreate(&e), "cudaEventCreate", "NcclComm");
    return Event(e, [](CUevent_st* p) { (void)cudaEventDestroy(p); });
  }

  // Enqueues one collective on the communication stream after everything enqueued so far on the
  // compute stream, between two timing events, and returns without waiting. Only the enqueue is
  // watched; the wait is synchronize()'s (or a later blocking call's).
  template <typename Launch> std::unique_ptr<Request> start(const char* call, size_t count, Launch&& launch) {
    Event ready = event(), t0 = event(), t1 = event();
    check_cuda(cudaEventRecord(ready.get(), stream_), "cudaEventRecord", call);
    check_cuda(cudaStreamWaitEvent(cstream_, ready.get(), 0), "cudaStreamWaitEvent", call);
    check_cuda(cudaEventRecord(t0.get(), cstream_), "cudaEventRecord", call);
    if (count > 0) {  // every rank sees the same count, so every rank skips it
      CommWatch w(host_, call);
      check_nccl(launch(cstream_), call, comm_);
    }
    check_cuda(cudaEventRecord(t1.get(), cstream_), "cudaEventRecord", call);
    marks_.emplace_back(t0, t1);
    last_ = t1;
    return std::make_unique<StreamRequest>(this, std::move(t1));
  }

  // After a stream synchronize: a failure NCCL reported, then the started collectives' and the
  // waits' device times, added into `t`.
  void drain(DeviceTimes& t) {
    if (!last_) return;
    check_async("NcclComm::synchronize");
    auto add = [](std::vector<std::pair<Event, Event>>& v, double& acc) {
      for (auto& [a, b] : v) {
        float ms = 0;
        check_cuda(cudaEventElapsedTime(&ms, a.get(), b.get()), "cudaEventElapsedTime", "NcclComm::synchronize");
        acc += 1e-3 * ms;
      }
      v.clear();
    };
    t.collectives += static_cast<int64_t>(marks_.size());
    add(marks_, t.issued_s);
    add(waits_, t.exposed_s);
    last_.reset();
  }

  // A NCCL or network failure detected while kernels ran.
  void check_async(const char* call) {
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError", comm_);
    if (async != ncclSuccess && async != ncclInProgress) throw std::runtime_error(nccl_error(async, call, comm_));
  }

  // See ~NcclComm: flushes outstanding work and, in current NCCL, may wait on peers; it is
  // watched like a collective so that a dead peer cannot hang shutdown forever. While an exception
  // unwinds the stack the job is failing (possibly on this rank only, so peers may never come to
  // destroy their side): ncclCommAbort then frees local resources without waiting for anyone.
  // Never throws.
  void end_comm() noexcept {
    if (!comm_) return;
    if (std::uncaught_exceptions() > 0) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
      return;
    }
    try {
      CommWatch w(host_, "ncclCommDestroy");
      (void)ncclCommDestroy(comm_);
    } catch (...) {  // watch_begin could only fail to allocate; do not let it escape a destructor
      (void)ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }

  // Enqueues one NCCL collective on the stream and waits for it. The whole of it (enqueue and
  // wait: a dead peer shows as a wait that never ends) is a watched section of the host Comm, so
  // the host watchdog ends the job when it makes no progress for the collective timeout. After
  // the stream-ordered collectives started before it (same communicator: same order everywhere).
  template <typename Launch> void run(const char* watch, const char* call, Launch&& launch) {
    CommWatch w(host_, watch);
    if (last_) check_cuda(cudaStreamWaitEvent(stream_, last_.get(), 0), "cudaStreamWaitEvent", call);
    check_nccl(launch(), call, comm_);
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", call);
    // A network or peer failure NCCL detected while the kernels ran (they may still complete).
    check_async(call);
  }

  ncclComm_t comm_;
  cudaStream_t cstream_ = nullptr;                  // the communication stream of start_*
  std::vector<std::pair<Event, Event>> marks_;      // each started collective: start, end (cstream_)
  std::vector<std::pair<Event, Event>> waits_;      // each Request::wait: before, after (stream_)
  Event last_;                                      // end of the last started collective; null after synchronize
  DeviceTimes times_;
  NcclComm* parent_ = nullptr;         // the Comm this one was duplicated from (its synchronize covers this)
  std::vector<NcclComm*> children_;    // live duplicates of this one
};

// ------------------------------------------------------------------------------------------------
// Host-staged

// A growable host buffer: page-locked (cudaMallocHost: faster copies, and cudaMemcpyAsync really
// is asynchronous) when the driver grants it, else ordinary memory (correct, slower). Contents are
// not kept when it grows.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { release(); }

  // At least n bytes (nullptr when n == 0 and nothing was ever needed).
  char* get(size_t n) {
    if (n <= cap_) return data_;
    release();
    void* p = nullptr;
    if (cudaMallocHost(&p, n) == cudaSuccess) {
      data_ = static_cast<char*>(p);
      pinned_ = true;
    } else {
      // Page-locked memory is limited (ulimit -l, several ranks per node): fall back. Reset the
      // runtime's last-error state so that a later cudaGetLastError (kernel launch checks) does
      // not report this allocation failure as theirs.
      (void)cudaGetLastError();
      plain_ = std::make_unique_for_overwrite<char[]>(n);
      data_ = plain_.get();
      pinned_ = false;
    }
    cap_ = n;
    return data_;
  }

 private:
  void release() noexcept {
    if (pinned_ && data_) (void)cudaFreeHost(data_);
    plain_.reset();
    data_ = nullptr;
    cap_ = 0;
    pinned_ = false;
  }
  char* data_ = nullptr;
  size_t cap_ = 0;
  bool pinned_ = false;
  std::unique_ptr<char[]> plain_;
};

class StagedComm final : public DeviceComm {
 public:
  StagedComm(Comm& host, cudaStream_t stream) : DeviceComm(host, stream, "StagedComm::barrier") {}

  // The device send block goes to its own place in the host receive buffer, and the host
  // all-gather runs in place there. Reading `send` works for the in-place call too (send ==
  // recv + rank*count: it is that block), and it is read completely before recv is written.
  void all_gather_impl(const void* send, void* recv, size_t count, DType t) override {
    const size_t bytes = count * dtype_size(t);
    const size_t world = static_cast<size_t>(host_.world_size());
    char* h = all_.get(world * bytes);
    char* mine = h + static_cast<size_t>(host_.rank()) * bytes;
    to_host(mine, send, bytes, "all_gather");
    host_.all_gather_impl(mine, h, count, t);
    to_device(recv, h, world * bytes, "all_gather");
  }
  void reduce_scatter_sum_impl(const void* send, void* recv, size_t count, DType t) override {
    const size_t bytes = count * dtype_size(t);
    const size_t world = static_cast<size_t>(host_.world_size());
    char* hs = all_.get(world * bytes);
    char* hr = part_.get(bytes);
    to_host(hs, send, world * bytes, "reduce_scatter");
    host_.reduce_scatter_sum_impl(hs, hr, count, t);
    to_device(recv, hr, bytes, "reduce_scatter");
  }
  void all_reduce_impl(void* buf, size_t count, DType t, ReduceOp op) override {
    const size_t bytes = count * dtype_size(t);
    char* h = all_.get(bytes);
    to_host(h, buf, bytes, "all_reduce");
    host_.all_reduce_impl(h, count, t, op);
    to_device(buf, h, bytes, "all_reduce");
  }
  void broadcast_impl(void* buf, size_t count, DType t, int root) override {
    const size_t bytes = count * dtype_size(t);
    const bool is_root = host_.rank() == root;
    char* h = all_.get(bytes);
    if (is_root) to_host(h, buf, bytes, "broadcast");
    host_.broadcast_impl(h, count, t, root);
    if (!is_root) to_device(buf, h, bytes, "broadcast");  // the root's buffer already holds it
  }

 private:
  // Copies on the context stream (ordered after the kernels that produced the data) and waits.
  void to_host(void* dst, const void* src, size_t bytes, const char* what) {
    if (bytes == 0) return;
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync device to host",
               what);
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", what);
  }
  // Waits too: the host buffer is reused by the next call, and the caller may use the result at once.
  void to_device(void* dst, const void* src, size_t bytes, const char* what) {
    if (bytes == 0) return;
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync host to device",
               what);
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", what);
  }

  // Point-to-point through host memory: the send copies the device block into a host buffer that
  // its Request owns and starts the host Comm's send; the receive starts the host receive into such
  // a buffer and copies it to the device when it completed (test() true or wait(), which then waits
  // for the copy). Nonblocking like the host Comm's; the ring shift is the base class's (a
  // receive, then a send, one Request). Tags are the host Comm's.
  std::unique_ptr<Request> start_send_impl(const void* send, size_t count, DType t, int peer, int tag) override {
    const size_t bytes = count * dtype_size(t);
    auto q = std::make_unique<StagedRequest>(bytes, nullptr, stream_);
    to_host(q->host(), send, bytes, "send");
    q->inner = host_.start_send_impl(q->host(), count, t, peer, tag);
    return q;
  }
  std::unique_ptr<Request> start_recv_impl(void* recv, size_t count, DType t, int peer, int tag) override {
    const size_t bytes = count * dtype_size(t);
    auto q = std::make_unique<StagedRequest>(bytes, recv, stream_);
    q->inner = host_.start_recv_impl(q->host(), count, t, peer, tag);
    return q;
  }

 private:
  class StagedRequest final : public Request {
   public:
    StagedRequest(size_t bytes, void* device_recv, cudaStream_t s)
        : buf_(std::make_unique_for_overwrite<char[]>(bytes > 0 ? bytes : 1)), bytes_(bytes), dev_(device_recv), s_(s) {}
    ~StagedRequest() override { inner.reset(); }  // the host transfer ends before its buffer goes
    char* host() { return buf_.get(); }
    bool test() override {
      if (done_) return true;
      if (!inner->test()) return false;
      finish();
      return true;
    }
    void wait() override {
      if (done_) return;
      inner->wait();
      finish();
    }
    std::unique_ptr<Request> inner;  // the host transfer (its destructor waits for it)

   private:
    void finish() {
      done_ = true;
      if (!dev_ || bytes_ == 0) return;
      check_cuda(cudaMemcpyAsync(dev_, buf_.get(), bytes_, cudaMemcpyHostToDevice, s_), "cudaMemcpyAsync host to device",
                 "receive");
      check_cuda(cudaStreamSynchronize(s_), "cudaStreamSynchronize", "receive");
    }
    std::unique_ptr<char[]> buf_;
    size_t bytes_;
    void* dev_;
    cudaStream_t s_;
    bool done_ = false;
  };

  HostBuffer all_;   // world*count elements (all_gather result, reduce_scatter input), or count
  HostBuffer part_;  // count elements (reduce_scatter result)
};

}  // namespace

// Collective over `host`. Order: rank 0 makes the id; all ranks agree that it did (all_ok) before
// anyone waits for it in the broadcast; then each rank initializes NCCL on its device and all
// ranks agree on the outcome.
//
// ncclCommInitRank* is itself collective (NCCL's own bootstrap over TCP): a rank that fails early
// can leave its peers blocked inside it, never reaching the all_ok below. That is accepted: the
// init runs as a watched section of `host`, so a collective timeout (if already set) ends the job,
// and otherwise the launcher does. We init through ncclCommInitRankConfig with blocking = 1, so
// the call returns only once the communicator is usable (or failed), and on failure abort the
// half-made communicator, which also closes its bootstrap sockets so that peers waiting on this
// rank tend to fail too rather than wait.
std::unique_ptr<Comm> cuda_impl::make_nccl_comm(Comm& host, CudaContext& ctx) {
  const int rank = host.rank(), world = host.world_size(), device = ctx.device();
  const std::string where = "NCCL init failed on " + host_name() + " device " + std::to_string(device) + ": ";

  ncclUniqueId id{};
  bool ok = true;
  std::string msg;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      ok = false;
      msg = where + nccl_error(r, "ncclGetUniqueId", nullptr);
    }
  }
  all_ok(host, ok, msg);
  static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES, "ncclUniqueId is its bytes");
  host.broadcast<char>(reinterpret_cast<char*>(&id), sizeof id, 0);

  ncclComm_t comm = nullptr;
  {
    CommWatch w(host, "ncclCommInitRank");
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess) {
      ok = false;
      msg = where + "cudaSetDevice failed: " + cudaGetErrorString(ce);
    } else {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 1;
      ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
      if (r != ncclSuccess) {
        ok = false;
        msg = where + nccl_error(r, "ncclCommInitRankConfig", comm);
        if (comm) (void)ncclCommAbort(comm);  // blocking init may hand back a failed communicator
        comm = nullptr;
      }
    }
  }
  try {
    all_ok(host, ok, msg);
  } catch (...) {
    if (comm) (void)ncclCommAbort(comm);  // another rank failed: ours cannot be used
    throw;
  }
  try {
    return std::make_unique<NcclComm>(host, comm, static_cast<cudaStream_t>(ctx.stream()));
  } catch (...) {
    (void)ncclCommAbort(comm);
    throw;
  }
}

std::unique_ptr<Comm> cuda_impl::make_staged_comm(Comm& host, CudaContext& ctx) {
  return std::make_unique<StagedComm>(host, static_cast<cudaStream_t>(ctx.stream()));
}

}  // namespace shardtrain
