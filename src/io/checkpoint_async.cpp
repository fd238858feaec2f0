// Asynchronous checkpoint saves (checkpoint.h, AsyncCheckpointWriter): one writer thread per rank
// runs save_checkpoint on a snapshot, on a duplicated world communicator of its own, while the
// training thread goes on. The write itself (write_checkpoint_file, publish_checkpoint) is the
// synchronous path's, unchanged: this file only moves it onto the thread.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include "shardtrain/io/checkpoint.h"

namespace shardtrain {

int64_t checkpoint_write_delay_ms() {
  const char* v = std::getenv("SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS");
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long long ms = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && ms > 0) ? static_cast<int64_t>(ms) : 0;
}

namespace {

// The writer thread runs at nice 19 (setpriority on its thread id; lowering one's own priority
// needs no privilege): against training's threads it gets ~1.5% of a contended core (CFS/EEVDF
// weight 15 against 1024), so where training fills every core (a CPU run with one rank per core)
// the write runs mostly in training's gaps; on a rank with a spare core nothing changes. Not
// SCHED_IDLE, which the first version used: a SCHED_IDLE thread gets nothing while any other
// process on the node wants the CPU, niced builds included, and a save that training then waited
// for outlasted the collective watchdog on a loaded machine (docs/benchmarks.md, "Checkpoint writes
// past the page cache": also the step-time comparison of the two, equal within noise). Neither can
// be undone without privilege (RLIMIT_NICE), so saves that training waits for do not run on this
// thread at all (AsyncCheckpointWriter::start, `foreground`).
//
// And it may run on any CPU the kernel lets it, not only its rank's: mpirun and srun bind each rank
// to its core(s) and threads inherit the binding, which put the writer on the one core its rank's
// training keeps busy while a core beside it idled (a background write at W = 1 on 2 cores ran at
// 259 MB/s against 1,211 MB/s for the same write with training stopped). sched_setaffinity with
// every CPU is cut down by the kernel to the thread's cpuset, so under Slurm's task/cgroup (the
// usual setup) the writer stays inside the job's allocation. A limit set only as an affinity mask
// (taskset, task/affinity without cgroups) is not visible to it and is widened: at nice 19 the
// writer then takes little from whatever else runs there. Best effort: the binding stays where the
// call fails.
void place_writer_thread() {
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
  const long n = ::sysconf(_SC_NPROCESSORS_CONF);
  if (n <= 0) return;
  cpu_set_t* set = CPU_ALLOC(static_cast<int>(n));
  if (!set) return;
  const size_t bytes = CPU_ALLOC_SIZE(static_cast<int>(n));
  CPU_ZERO_S(bytes, set);
  for (long c = 0; c < n; ++c) CPU_SET_S(static_cast<size_t>(c), bytes, set);
  (void)::sched_setaffinity(0, bytes, set);
  CPU_FREE(set);
}

// CPUs in the calling thread's affinity mask; -1 if it cannot be read.
int thread_cpu_count() {
  const long n = ::sysconf(_SC_NPROCESSORS_CONF);
  if (n <= 0) return -1;
  cpu_set_t* set = CPU_ALLOC(static_cast<int>(n));
  if (!set) return -1;
  const size_t bytes = CPU_ALLOC_SIZE(static_cast<int>(n));
  const int c = ::sched_getaffinity(0, bytes, set) == 0 ? CPU_COUNT_S(bytes, set) : -1;
  CPU_FREE(set);
  return c;
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

void AsyncCheckpointWriter::run(CheckpointSnapshot snap, CheckpointOptions co, std::shared_ptr<SnapshotBuffer> copy_into,
                                bool background) {
  using Clock = std::chrono::steady_clock;
  Result r;
  r.step = snap.state.step;
  const int64_t delay_ms = async_ ? checkpoint_write_delay_ms() : 0;  // the test hook: every save of an async writer
  if (copy_into) {
    // The live rows into the buffer, before anything else and before the priority drops: training
    // waits for this at its next optimizer update (wait_copied). The test delay's first quarter
    // comes before it, so that the tests' isolation checks see a copy that would be too late
    // without that wait.
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms / 4));
    const auto tc = Clock::now();
    for (size_t k = 0; k < snap.tensors.size(); ++k) {
      CheckpointSnapshot::Tensor& t = snap.tensors[k];
      for (size_t u = 0; u < t.view.size(); ++u) {
        float* dst = copy_into->rows(k, u);
        std::memcpy(dst, t.view[u], 4 * static_cast<size_t>(copy_into->shard_size(u)));
        t.view[u] = dst;
      }
    }
    snap.buffer = copy_into;
    r.copy_s = std::chrono::duration<double>(Clock::now() - tc).count();
    {
      std::lock_guard<std::mutex> lk(copy_mu_);
      copy_pending_ = false;
    }
    copy_cv_.notify_all();
  }
  r.bytes = snap.bytes();
  if (background) place_writer_thread();
  r.cpus = thread_cpu_count();
  try {
    if (delay_ms > 0) {
      const int64_t before = delay_ms / 2 - (copy_into ? delay_ms / 4 : 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(before));  // before the write ...
      co.test_delay_before_publish_ms = delay_ms - delay_ms / 2;       // ... and before the publish
      r.delay_s = static_cast<double>(delay_ms) / 1e3;
    }
    const auto t0 = Clock::now();
    r.path = save_checkpoint(async_ ? *comm_ : world_, snap, co);  // the writer's communicator, on either thread
    r.write_s = std::chrono::duration<double>(Clock::now() - t0).count() -
                static_cast<double>(co.test_delay_before_publish_ms) / 1e3;  // the delay is not the write's
    r.sched_policy = ::sched_getscheduler(0);
    r.nice = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
    result_ = std::move(r);
    state_.store(1, std::memory_order_release);
  } catch (...) {
    error_ = std::current_exception();
    state_.store(2, std::memory_order_release);
  }
}

void AsyncCheckpointWriter::start(CheckpointSnapshot&& snap, const CheckpointOptions& co,
                                  std::shared_ptr<SnapshotBuffer> copy_into, bool foreground) {
  if (in_flight_) throw std::logic_error("AsyncCheckpointWriter::start: a save is still in flight");
  if (thread_.joinable()) thread_.join();
  if (copy_into) {
    bool fits = async_ && !foreground && copy_into->fits(snap.plan, snap.tensors.size());
    for (auto& t : snap.tensors) fits = fits && t.view.size() == snap.plan.units.size();
    if (!fits)
      throw std::invalid_argument("AsyncCheckpointWriter::start: copy_into needs an asynchronous writer, a borrowed "
                                  "snapshot and a buffer of its plan's units and shard sizes");
  }
  state_.store(0);
  error_ = nullptr;
  result_ = Result{};
  in_flight_ = true;
  if (!async_ || foreground) {  // on the calling thread, at its priority: training waits for it anyway
    run(std::move(snap), co, nullptr, false);
    if (state_.load() == 2) {
      in_flight_ = false;
      std::rethrow_exception(error_);
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lk(copy_mu_);
    copy_pending_ = copy_into != nullptr;
  }
  try {
    thread_ = std::thread([this, s = std::move(snap), co, copy_into]() mutable { run(std::move(s), co, copy_into, true); });
  } catch (...) {
    std::lock_guard<std::mutex> lk(copy_mu_);
    copy_pending_ = false;
    in_flight_ = false;
    throw;
  }
}

double AsyncCheckpointWriter::wait_copied() {
  std::unique_lock<std::mutex> lk(copy_mu_);
  if (!copy_pending_) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  copy_cv_.wait(lk, [&] { return !copy_pending_; });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
