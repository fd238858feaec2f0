// In-process tests of the two CommQueue lanes (shard.h), on fake Comms whose requests complete
// when the test says so: no MPI traffic, no second rank. What each lane promises:
//   HostCommQueue:   jobs in submission order, parts in order, done(i) after part i completed;
//                    inline (overlap off) completes the job at submit; Poll advances at poll();
//                    Wait makes no MPI call (no test) at poll(); a waiter drives the head itself.
//   StreamCommQueue: every part enqueued at submit with no compute-stream wait between jobs; one
//                    wait per job, when it is waited for; a job with shared_buffers first finishes
//                    the queued ones that use them; overlap off finishes each job at submit.
// The pipeline over an emulated NCCL Comm (one wait per unit and direction, all-gathers and
// reduce-scatters on different streams) is Fsdp.StreamLaneOneWaitPerUnitAndSeparateStreams in
// tests/mpi/test_fsdp.cpp.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard.h"

namespace st = shardtrain;

namespace {

// One rank; start_all_reduce_sum hands out request k (k = 0, 1, ... in start order), which
// completes once the test opened the gate past k (or, host lane, when it is waited for, as
// MPI_Wait would). Every test() is counted: on the host lane it stands for an MPI_Test. With
// `stream` it claims to be stream-ordered (the NCCL lane) and logs starts and compute-stream waits.
class GatedComm final : public st::Comm {
 public:
  explicit GatedComm(bool stream) : stream_(stream) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void barrier() override {}
  void set_collective_timeout(double) override {}
  void watch_begin(const char*) override {}
  void watch_end() override {}
  void* mpi_handle() const override { return nullptr; }
  bool asynchronous() const override { return true; }
  bool stream_ordered() const override { return stream_; }
  void all_gather_impl(const void*, void*, size_t, DType) override { throw std::logic_error("blocking call"); }
  void reduce_scatter_sum_impl(const void*, void*, size_t, DType) override { throw std::logic_error("blocking call"); }
  void all_reduce_impl(void*, size_t, DType, st::ReduceOp) override { throw std::logic_error("blocking call"); }
  void broadcast_impl(void*, size_t, DType, int) override { throw std::logic_error("blocking call"); }
  std::unique_ptr<Request> start_all_reduce_sum_impl(void*, size_t, DType) override {
    auto r = std::make_unique<Req>();
    r->c = this;
    r->k = started++;
    if (stream_) log.push_back("start " + std::to_string(r->k));
    return r;
  }
  std::atomic<int> started{0}, tests{0}, waits{0}, open{0};
  std::vector<std::string> log;  // stream lane only (compute thread)

  // Point-to-point with itself (the only rank), unlike the collectives on real buffers: sends and
  // receives of one tag match in start order; a transfer completes when matched (the send's
  // bytes are read then). Waiting for an unmatched one would hang a real Comm: here it throws.
  std::unique_ptr<Request> start_send_impl(const void* s, size_t n, DType t, int, int tag) override {
    auto done = std::make_shared<bool>(false);
    sends_.push_back(Xfer{tag, const_cast<void*>(s), n * dtype_size(t), done});
    match();
    return std::make_unique<P2pReq>(done);
  }
  std::unique_ptr<Request> start_recv_impl(void* r, size_t n, DType t, int, int tag) override {
    auto done = std::make_shared<bool>(false);
    recvs_.push_back(Xfer{tag, r, n * dtype_size(t), done});
    match();
    return std::make_unique<P2pReq>(done);
  }

 private:
  struct Xfer {
    int tag;
    void* buf;
    size_t bytes;
    std::shared_ptr<bool> done;
  };
  struct P2pReq final : Request {
    explicit P2pReq(std::shared_ptr<bool> d) : done(std::move(d)) {}
    std::shared_ptr<bool> done;
    bool test() override { return *done; }
    void wait() override {
      if (!*done) throw std::logic_error("GatedComm: waiting for an unmatched transfer");
    }
  };
  void match() {
    for (size_t i = 0; i < recvs_.size(); ++i)
      for (size_t j = 0; j < sends_.size(); ++j)
        if (sends_[j].tag == recvs_[i].tag) {
          if (sends_[j].bytes != recvs_[i].bytes) throw std::logic_error("GatedComm: send and receive sizes differ");
          if (sends_[j].bytes) std::memcpy(recvs_[i].buf, sends_[j].buf, sends_[j].bytes);
          *sends_[j].done = *recvs_[i].done = true;
          sends_.erase(sends_.begin() + static_cast<std::ptrdiff_t>(j));
          recvs_.erase(recvs_.begin() + static_cast<std::ptrdiff_t>(i));
          return match();
        }
  }
  std::vector<Xfer> sends_, recvs_;  // started, not yet matched (start order)

  struct Req final : Request {
    GatedComm* c = nullptr;
    int k = 0;
    bool test() override {
      ++c->tests;
      return c->open.load() > k;
    }
    void wait() override {
      ++c->waits;
      if (c->stream_) c->log.push_back("wait " + std::to_string(k));
      int o = c->open.load();
      while (o <= k && !c->open.compare_exchange_weak(o, k + 1)) {
      }
    }
  };
  bool stream_;
};

double g_buf = 0;  // the fake ignores buffers

// A job of `parts` parts whose done(i) appends "done <name>.<i>" to `log` (on the host lane done
// may run on a communication thread: the tests read log only after wait()).
st::CommQueue::Job job(int parts, const std::string& name, std::vector<std::string>* log, bool shared = false) {
  return {parts, [](st::Comm& c, int) { return c.start_all_reduce_sum(&g_buf, 1); },
          [=](int i) { log->push_back("done " + name + "." + std::to_string(i)); }, shared};
}

TEST(CommQueue, MakeChoosesTheLaneOnceFromTheComm) {
  GatedComm host(false), dev(true);
  EXPECT_FALSE(st::CommQueue::make(host, host, true, st::CommProgress::Poll, {}, "test")->stream_lane());
  EXPECT_TRUE(st::CommQueue::make(dev, dev, true, st::CommProgress::Poll, {}, "test")->stream_lane());
  EXPECT_THROW(st::CommQueue::make(host, host, true, st::CommProgress::Poll, {}, "test")->submit(job(0, "x", nullptr)),
               std::logic_error);
}

TEST(CommQueue, HostLaneInlineCompletesEachJobAtSubmit) {
  GatedComm c(false);
  std::vector<std::string> log;
  st::HostCommQueue q(c, c, false, st::CommProgress::Poll, {}, "test");
  EXPECT_FALSE(q.background());
  q.submit(job(3, "a", &log));
  EXPECT_EQ(log, (std::vector<std::string>{"done a.0", "done a.1", "done a.2"}));
  EXPECT_EQ(c.waits.load(), 3);
  EXPECT_EQ(q.times().collectives, 3);
}

TEST(CommQueue, HostLanePollAdvancesAtPollWaitDoesNot) {
  for (st::CommProgress prog : {st::CommProgress::Poll, st::CommProgress::Wait}) {
    SCOPED_TRACE(st::comm_progress_name(prog));
    GatedComm c(false);
    std::vector<std::string> log;
    st::HostCommQueue q(c, c, true, prog, {}, "test");
    const auto a = q.submit(job(2, "a", &log));
    const auto b = q.submit(job(1, "b", &log));
    EXPECT_EQ(c.started.load(), 1) << "one job at a time: only a's first part is started";
    const int tests = c.tests.load();
    q.poll();
    if (prog == st::CommProgress::Poll) EXPECT_GT(c.tests.load(), tests) << "poll tests the head";
    else EXPECT_EQ(c.tests.load(), tests) << "Wait: no MPI call at a unit boundary";
    c.open = 100;  // everything completes
    q.poll();
    if (prog == st::CommProgress::Poll) {
      EXPECT_EQ(log, (std::vector<std::string>{"done a.0", "done a.1", "done b.0"})) << "poll finished them";
    } else {
      EXPECT_TRUE(log.empty()) << "Wait: nothing advanced outside submit and wait";
    }
    q.wait(a);
    EXPECT_GE(log.size(), 2u);
    q.wait(b);
    EXPECT_EQ(log, (std::vector<std::string>{"done a.0", "done a.1", "done b.0"}));
    EXPECT_EQ(c.started.load(), 3);
  }
}

TEST(CommQueue, HostLaneWaiterDrivesTheHead) {
  for (st::CommProgress prog : {st::CommProgress::Poll, st::CommProgress::Wait, st::CommProgress::Thread}) {
    SCOPED_TRACE(st::comm_progress_name(prog));
    GatedComm c(false);
    std::vector<std::string> log;
    st::HostCommQueue q(c, c, true, prog, {}, "test");
    for (int j = 0; j < 3; ++j) q.submit(job(2, std::string(1, static_cast<char>('a' + j)), &log));
    q.wait_all();  // the gate never opens: only the waiter's own Request::wait completes parts
    EXPECT_EQ(log, (std::vector<std::string>{"done a.0", "done a.1", "done b.0", "done b.1", "done c.0", "done c.1"}));
    EXPECT_EQ(c.started.load(), 6);
  }
}

TEST(CommQueue, StreamLaneOneWaitPerJobWhenWaitedFor) {
  GatedComm c(true);
  std::vector<std::string> log;
  st::StreamCommQueue q(c, c, true, "test");
  const auto a = q.submit(job(1, "a", &log));
  const auto b = q.submit(job(1, "b", &log));
  EXPECT_EQ(c.log, (std::vector<std::string>{"start 0", "start 1"})) << "enqueued at submit, no wait between";
  EXPECT_EQ(c.waits.load(), 0);
  EXPECT_TRUE(log.empty());
  q.wait(b);
  EXPECT_EQ(c.log, (std::vector<std::string>{"start 0", "start 1", "wait 0", "wait 1"}));
  EXPECT_EQ(log, (std::vector<std::string>{"done a.0", "done b.0"}));
  q.wait(a);  // done already: no second wait
  EXPECT_EQ(c.waits.load(), 2);
  EXPECT_EQ(c.tests.load(), 0) << "the stream lane never tests";
}

TEST(CommQueue, StreamLaneSharedBuffersFinishTheEarlierJobFirst) {
  GatedComm c(true);
  std::vector<std::string> log;
  st::StreamCommQueue q(c, c, true, "test");
  q.submit(job(1, "g", &log, false));
  q.submit(job(1, "r1", &log, true));
  q.submit(job(1, "x", &log, false));  // own buffers: nothing finished for it
  EXPECT_EQ(c.waits.load(), 0);
  q.submit(job(1, "r2", &log, true));  // reuses r1's buffers: r1 (and the jobs before it) finish first
  EXPECT_EQ(c.log, (std::vector<std::string>{"start 0", "start 1", "start 2", "wait 0", "wait 1", "start 3"}));
  EXPECT_EQ(log, (std::vector<std::string>{"done g.0", "done r1.0"}));
  q.wait_all();
  EXPECT_EQ(log, (std::vector<std::string>{"done g.0", "done r1.0", "done x.0", "done r2.0"}));
  EXPECT_EQ(c.waits.load(), 4) << "one compute-stream wait per job";
}

TEST(CommQueue, StreamLaneOverlapOffWaitsAtSubmitAndChainedPartsWaitBetween) {
  GatedComm c(true);
  std::vector<std::string> log;
  st::StreamCommQueue off(c, c, false, "test");
  off.submit(job(1, "a", &log));
  EXPECT_EQ(c.log, (std::vector<std::string>{"start 0", "wait 0"}));
  EXPECT_EQ(log, (std::vector<std::string>{"done a.0"}));
  // A job of two parts (hybrid sharding: the replica sum reads what done(0) made): one wait
  // between them, the second when waited for.
  c.log.clear();
  log.clear();
  st::StreamCommQueue on(c, c, true, "test");
  const auto t = on.submit(job(2, "h", &log, true));
  EXPECT_EQ(c.log, (std::vector<std::string>{"start 1", "wait 1", "start 2"}));
  on.wait(t);
  EXPECT_EQ(log, (std::vector<std::string>{"done h.0", "done h.1"}));
}

}  // namespace

// The fake's point-to-point (GatedComm above), the one rank with itself: the ring shift hands a
// rank its own block (W = 1), sends and receives of one tag match in start order, tags apart.
TEST(CommQueue, GatedCommPointToPointWithItself) {
  GatedComm c(false);
  const std::vector<double> a{1.5, 2.5, 3.5}, b{-1, -2, -3};
  std::vector<double> r(3, 0);
  c.ring_shift(a.data(), r.data(), 3);
  EXPECT_EQ(r, a);
  std::vector<double> r1(3, 0), r2(3, 0), r3(3, 0);
  auto q1 = c.start_recv(r1.data(), 3, 0, 7);
  EXPECT_FALSE(q1->test());
  EXPECT_THROW(q1->wait(), std::logic_error);
  auto q2 = c.start_recv(r2.data(), 3, 0, 8);
  auto s1 = c.start_send(b.data(), 3, 0, 8);  // tag 8: the second receive
  auto s2 = c.start_send(a.data(), 3, 0, 7);
  auto s3 = c.start_send(b.data(), 3, 0, 7);  // a second tag-7 message: the next tag-7 receive
  auto q3 = c.start_recv(r3.data(), 3, 0, 7);
  for (auto* q : {q1.get(), q2.get(), q3.get(), s1.get(), s2.get(), s3.get()}) EXPECT_TRUE(q->test());
  EXPECT_EQ(r1, a);
  EXPECT_EQ(r2, b);
  EXPECT_EQ(r3, b);
  EXPECT_THROW(c.start_send(a.data(), 3, 1, 0), std::invalid_argument);
}
