// Asynchronous checkpoint saves (checkpoint.h, AsyncCheckpointWriter): one writer thread per rank
// runs save_checkpoint on a snapshot, on a duplicated world communicator of its own, while the
// training thread goes on. The write itself (write_checkpoint_file, publish_checkpoint) is the
// synchronous path's, unchanged: this file only moves it onto the thread.
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include "shardtrain/checkpoint.h"

namespace shardtrain {

int64_t checkpoint_write_delay_ms() {
  const char* v = std::getenv("SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS");
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long long ms = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && ms > 0) ? static_cast<int64_t>(ms) : 0;
}

namespace {

// The writer thread yields its core to training: SCHED_IDLE (Linux, sched(7): runs only when no
// other thread of normal policy wants the CPU; needs no privilege to lower), else nice 19. Applies
// to the calling thread only (sched_setscheduler / setpriority with the thread's id). On a rank
// with a spare core nothing changes; where training fills every core (a CPU run with one rank per
// core), the write runs in training's gaps (its communication waits) instead of taking time
// slices from the step. docs/benchmarks.md ("Asynchronous checkpoint saves") measures both.
void lower_writer_priority() {
  sched_param sp{};
  sp.sched_priority = 0;
  if (::sched_setscheduler(0, SCHED_IDLE, &sp) != 0)
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
}

}  // namespace

AsyncCheckpointWriter::AsyncCheckpointWriter(Comm& world, bool async, double collective_timeout) : world_(world) {
  if (!async) return;
  if (!mpi_thread_multiple()) {
    note_ = "note: checkpoint saves are synchronous ('--checkpoint-async on' needs MPI_THREAD_MULTIPLE, which this MPI "
            "library did not grant): training waits for each write";
    return;
  }
  comm_ = world.duplicate();  // collective: every rank duplicates (MpiComm: MPI_Comm_dup)
  if (!comm_) {
    note_ = "note: checkpoint saves are synchronous (the world communicator cannot be duplicated for a writer thread)";
    return;
  }
  comm_->set_collective_timeout(collective_timeout);
  async_ = true;
}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  if (thread_.joinable()) thread_.join();
}

bool AsyncCheckpointWriter::failed() const { return in_flight_ && state_.load(std::memory_order_acquire) == 2; }

void AsyncCheckpointWriter::run(CheckpointSnapshot snap, CheckpointOptions co) {
  using Clock = std::chrono::steady_clock;
  Result r;
  r.step = snap.state.step;
  r.bytes = snap.bytes();
  if (async_) lower_writer_priority();
  try {
    if (const int64_t ms = checkpoint_write_delay_ms(); ms > 0 && async_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms / 2));  // before the write ...
      co.test_delay_before_publish_ms = ms - ms / 2;                    // ... and before the publish
      r.delay_s = static_cast<double>(ms) / 1e3;
    }
    const auto t0 = Clock::now();
    r.path = save_checkpoint(async_ ? *comm_ : world_, snap, co);
    r.write_s = std::chrono::duration<double>(Clock::now() - t0).count() -
                static_cast<double>(co.test_delay_before_publish_ms) / 1e3;  // the delay is not the write's
    r.sched_policy = ::sched_getscheduler(0);
    result_ = std::move(r);
    state_.store(1, std::memory_order_release);
  } catch (...) {
    error_ = std::current_exception();
    state_.store(2, std::memory_order_release);
  }
}

void AsyncCheckpointWriter::start(CheckpointSnapshot&& snap, const CheckpointOptions& co) {
  if (in_flight_) throw std::logic_error("AsyncCheckpointWriter::start: a save is still in flight");
  if (thread_.joinable()) thread_.join();
  state_.store(0);
  error_ = nullptr;
  result_ = Result{};
  in_flight_ = true;
  if (!async_) {  // synchronous: the save on the calling thread, on the world communicator
    run(std::move(snap), co);
    if (state_.load() == 2) {
      in_flight_ = false;
      std::rethrow_exception(error_);
    }
    return;
  }
  thread_ = std::thread([this, s = std::move(snap), co]() mutable { run(std::move(s), co); });
}

bool AsyncCheckpointWriter::poll(Result* out) {
  if (!in_flight_ || state_.load(std::memory_order_acquire) != 1) return false;
  if (thread_.joinable()) thread_.join();
  in_flight_ = false;
  if (out) *out = result_;
  return true;
}

bool AsyncCheckpointWriter::wait(Result* out) {
  if (!in_flight_) return false;
  if (thread_.joinable()) thread_.join();
  in_flight_ = false;
  if (state_.load() == 2) std::rethrow_exception(error_);
  if (out) *out = result_;
  return true;
}

}  // namespace shardtrain
