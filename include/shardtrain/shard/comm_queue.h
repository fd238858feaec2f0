// The FSDP collectives' queues (shard layer): CommQueue and its two lanes, HostCommQueue (MPI and
// the host-staged Comm) and StreamCommQueue (NCCL), with how the host lane progresses
// (CommProgress, OverlapConfig) and what a rank's collectives cost (CommTimes).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardtrain/runtime/runtime.h"

namespace shardtrain {

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
  // Unit all-gathers and unit reduce-scatters issued (prefetches included), counted at submission
  // by UnitPipeline: per pass about units x micro-batches under Reshard::PerUse, at most one each
  // per unit under Reshard::PerPass.
  int64_t unit_gathers = 0, unit_reduces = 0;
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
  // blocking in MPI_Wait, see HostCommQueue::wait in comm_queue.cpp). nullptr: none. No-op on the stream lane.
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

}  // namespace shardtrain
