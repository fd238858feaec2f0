// The FSDP collectives' queues (comm_queue.h): the host lane and the stream lane.
#include "shardtrain/shard/comm_queue.h"
#include <chrono>
#include <stdexcept>

namespace shardtrain {

// ---- CommQueue --------------------------------------------------------------------------------

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

CommProgress parse_comm_progress(const std::string& s) {
  if (s == "thread") return CommProgress::Thread;
  if (s == "poll") return CommProgress::Poll;
  if (s == "wait") return CommProgress::Wait;
  throw std::invalid_argument("option '--comm-progress' must be thread, poll or wait, got '" + s + "'");
}
const char* comm_progress_name(CommProgress p) {
  switch (p) {
    case CommProgress::Thread: return "thread";
    case CommProgress::Poll: return "poll";
    case CommProgress::Wait: return "wait";
  }
  return "?";
}

std::unique_ptr<CommQueue> CommQueue::make(Comm& lane, Comm& watch, bool background, CommProgress progress,
                                            std::function<void()> prepare_thread, const char* what) {
  if (lane.stream_ordered()) return std::make_unique<StreamCommQueue>(lane, watch, background, what);
  return std::make_unique<HostCommQueue>(lane, watch, background, progress, std::move(prepare_thread), what);
}

// ---- HostCommQueue ----

HostCommQueue::HostCommQueue(Comm& lane, Comm& watch, bool background, CommProgress progress,
                             std::function<void()> prepare_thread, const char* what)
    : lane_(lane), watch_(watch), what_(what), background_(background && lane.asynchronous()), progress_(progress) {
  if (!background_ || progress_ != CommProgress::Thread) return;
  thread_ = std::thread([this, prep = std::move(prepare_thread)] {
    if (prep) prep();
    std::unique_lock<std::mutex> lk(mu_);
    int nap_us = kPollMinUs;
    for (;;) {
      cv_work_.wait(lk, [&] { return quit_ || !jobs_.empty(); });
      if (jobs_.empty()) break;  // quit_ and nothing left
      try {
        bool moved = false;
        while (advance_locked()) moved = true;
        // Back off while nothing completes: each MPI_Test runs Open MPI's whole progress loop, and
        // on a machine with no spare core these wake-ups are taken from the compute threads.
        nap_us = moved ? kPollMinUs : std::min(2 * nap_us, kPollMaxUs);
      } catch (...) {
        error_ = std::current_exception();
        jobs_.clear();
        completed_ = last_;
        cv_done_.notify_all();
        continue;
      }
      if (!jobs_.empty()) {  // in flight: test again shortly (MPI_Test drives Open MPI's progress)
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(nap_us));
        lk.lock();
      }
    }
  });
}

HostCommQueue::~HostCommQueue() {
  try {
    wait_all();
  } catch (...) {  // an error was reported to the waiter already, or nobody waits any more
  }
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      quit_ = true;
    }
    cv_work_.notify_all();
    thread_.join();
  }
}

// One step of the head job: start its current part, or test it and, when complete, consume it.
bool HostCommQueue::advance_locked() {
  if (jobs_.empty()) return false;
  Active& a = jobs_.front();
  if (!a.req) {
    if (a.part == 0) a.t0 = now_s();
    a.req = a.job.start(lane_, a.part);
    ++times_.collectives;
  }
  if (!a.req->test()) return false;
  a.req.reset();
  if (a.job.done) a.job.done(a.part);
  if (++a.part == a.job.parts) {
    times_.issued_s += now_s() - a.t0;
    completed_ = a.ticket;
    jobs_.pop_front();
    cv_done_.notify_all();
  }
  return true;
}

void HostCommQueue::run_inline(Job& job) {
  const double t0 = now_s();
  for (int i = 0; i < job.parts; ++i) {
    auto r = job.start(lane_, i);
    ++times_.collectives;
    r->wait();
    if (job.done) job.done(i);
  }
  const double dt = now_s() - t0;
  times_.issued_s += dt;
  times_.exposed_s += dt;
}

CommQueue::Ticket HostCommQueue::submit(Job job) {
  if (job.parts <= 0) throw std::logic_error("CommQueue::submit: a job needs at least one part");
  std::unique_lock<std::mutex> lk(mu_);
  const Ticket t = ++last_;
  ++times_.jobs;
  if (!background_) {
    lk.unlock();
    CommWatch w(watch_, what_);
    run_inline(job);
    lk.lock();
    completed_ = t;
    return t;
  }
  Active a;
  a.job = std::move(job);
  a.ticket = t;
  jobs_.push_back(std::move(a));
  if (thread_.joinable()) {
    cv_work_.notify_one();
  } else {
    while (advance_locked()) {  // start it now if the lane is idle (and finish whatever is done)
    }
  }
  return t;
}

// Unit boundaries and GEMM tiles (Poll only: Wait makes no MPI call there, Thread has its own).
void HostCommQueue::poll() {
  if (progress_ == CommProgress::Poll) drive();
}

void HostCommQueue::drive() {
  if (!background_ || thread_.joinable()) return;
  std::lock_guard<std::mutex> lk(mu_);
  while (advance_locked()) {
  }
}

void HostCommQueue::set_sibling(CommQueue* q) {
  sibling_ = dynamic_cast<HostCommQueue*>(q);
  if (q && !sibling_) throw std::logic_error("HostCommQueue::set_sibling: the sibling is on the stream lane");
}

void HostCommQueue::wait(Ticket t) {
  std::unique_lock<std::mutex> lk(mu_);
  if (completed_ >= t && !error_) return;
  const double t0 = now_s();
  {
    // The waiter drives the head job itself, in every progress mode (with a thread too: it would
    // only notice completion after its next nap); the thread blocks on the lock meanwhile.
    CommWatch w(watch_, what_);
    while (completed_ < t && !error_) {
      if (advance_locked() || jobs_.empty()) continue;
      if (sibling_ && !thread_.joinable()) {
        // Keep the other queue moving too: a part it has not started may be what the peers we
        // wait for are waiting on (their next slab, the replica sum), so blocking in MPI_Wait here
        // could close a cycle of waits across the two communicators. Yield like Open MPI does
        // when oversubscribed.
        sibling_->drive();
        std::this_thread::yield();
      } else {
        jobs_.front().req->wait();  // blocks in MPI_Wait: nothing else to do meanwhile
      }
    }
  }
  times_.exposed_s += now_s() - t0;
  if (error_) {
    std::exception_ptr e = error_;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      throw std::runtime_error(std::string("FSDP communication thread: ") + x.what());
    }
  }
}

CommTimes HostCommQueue::times() const {
  std::lock_guard<std::mutex> lk(mu_);
  return times_;
}

// ---- StreamCommQueue ----

StreamCommQueue::StreamCommQueue(Comm& lane, Comm& watch, bool background, const char* what)
    : lane_(lane), watch_(watch), what_(what), background_(background) {}

StreamCommQueue::~StreamCommQueue() {
  try {
    wait_all();
  } catch (...) {  // a device error was reported already, or nobody waits any more
  }
}

// Every part is enqueued now, in program order (the same on every rank). A job with shared
// buffers first finishes the queued jobs that use them (their done reads them). The last part
// stays in flight: its compute-stream wait and done come when the ticket is waited for.
CommQueue::Ticket StreamCommQueue::submit(Job job) {
  if (job.parts <= 0) throw std::logic_error("CommQueue::submit: a job needs at least one part");
  const Ticket t = ++last_;
  ++times_.jobs;
  {
    CommWatch w(watch_, what_);
    if (job.shared_buffers)
      while (shared_in_flight_ > 0) finish_head();
    Active a;
    a.job = std::move(job);
    a.ticket = t;
    for (int i = 0;; ++i) {
      a.last = a.job.start(lane_, i);
      ++times_.collectives;
      if (i + 1 == a.job.parts) break;
      a.last->wait();  // part i + 1 reads what done(i) makes (hybrid sharding's replica sum)
      if (a.job.done) a.job.done(i);
    }
    shared_in_flight_ += a.job.shared_buffers ? 1 : 0;
    jobs_.push_back(std::move(a));
  }
  if (!background_) wait(t);  // overlap off: the same calls, each waited for at once
  return t;
}

void StreamCommQueue::finish_head() {
  Active& a = jobs_.front();
  a.last->wait();
  a.last.reset();
  if (a.job.done) a.job.done(a.job.parts - 1);
  completed_ = a.ticket;
  shared_in_flight_ -= a.job.shared_buffers ? 1 : 0;
  jobs_.pop_front();
}

void StreamCommQueue::wait(Ticket t) {
  if (completed_ >= t) return;
  CommWatch w(watch_, what_);
  while (completed_ < t) finish_head();
}

}  // namespace shardtrain
