// Multi-rank tests of Comm's point-to-point transfers (runtime.h: start_send, start_recv,
// start_ring_shift, ring_shift, start_group, start_all_to_all_v) on the MPI Comm, and of the progress registry (progress.h) driving
// them from inside the CPU backend's GEMMs and attention. Values are checked against each rank's
// known inputs: block i of rank q is value(q, i), so rank r's ring-shift result must be
// value(left(r), i), computed here from the group layout. Run under mpirun at 1..4 ranks (make
// test) and at 5 and 6 ranks (tests/e2e/test_p2p.sh); every group size 1..W is tested at W ranks
// (groups of consecutive ranks through MpiComm::split). The watchdog tests are DISABLED_ here and
// run by tests/e2e/test_p2p.sh, which checks how the job ends.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/runtime/progress.h"
#include "shardtrain/runtime/runtime.h"
#include "rank_test.h"

namespace st = shardtrain;
using shardtrain::testing::count_diff;

namespace {

st::Comm& world() { return st::testing::comm(); }

// Exact in float, double, int64 and bf16 for the ranges used (integers below 256 for bf16).
template <typename T> T value(int world_rank, size_t i) {
  if constexpr (std::is_same_v<T, st::bf16>) return st::math::f32_to_bf16(static_cast<float>(world_rank * 37 + static_cast<int>(i % 29)));
  else return static_cast<T>(1000 * world_rank + static_cast<int64_t>(i % 997)) + static_cast<T>(std::is_integral_v<T> ? 0 : 0.5);
}
template <typename T> bool same(T a, T b) {
  if constexpr (std::is_same_v<T, st::bf16>) return a.bits == b.bits;
  else return a == b;
}

// Groups of g consecutive world ranks (the last one may be smaller): this rank's group, its left
// neighbour in the group (world rank).
struct Group {
  int base, size, rank;
  int left_world() const { return base + (rank + size - 1) % size; }
};
Group group_of(int r, int W, int g) {
  Group x;
  x.base = r / g * g;
  x.size = std::min(g, W - x.base);
  x.rank = r - x.base;
  return x;
}

template <typename T> void check_ring(st::Comm& c, const Group& gr, size_t n, bool nonblocking) {
  const int r = world().rank();
  std::vector<T> send(n), recv(n, value<T>(99, 7));
  for (size_t i = 0; i < n; ++i) send[i] = value<T>(r, i);
  if (nonblocking) {
    auto q = c.start_ring_shift(send.data(), recv.data(), n);
    while (!q->test()) {
    }
    q->wait();  // after test() returned true: returns at once
  } else {
    c.ring_shift(send.data(), recv.data(), n);
  }
  int64_t bad = 0;
  for (size_t i = 0; i < n; ++i)
    if (!same(recv[i], value<T>(gr.left_world(), i))) ++bad;
  EXPECT_EQ(bad, 0) << "group size " << gr.size << " n=" << n << (nonblocking ? " start_ring_shift" : " ring_shift");
}

}  // namespace

class P2p : public st::testing::RankTest {};

// Every group size g = 1..W: each rank receives its left neighbour's block, for four element
// types, blocking and nonblocking, small (eager) and large (rendezvous: 3 MB) blocks, count 0.
TEST_F(P2p, RingShiftEveryGroupSize) {
  const int W = world().world_size(), r = world().rank();
  for (int g = 1; g <= W; ++g) {
    const Group gr = group_of(r, W, g);
    st::MpiComm c = st::MpiComm::split(world(), gr.base, r);
    ASSERT_EQ(c.world_size(), gr.size);  // same on every rank of the group; all groups agree on g
    ASSERT_EQ(c.rank(), gr.rank);
    for (bool nb : {false, true}) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{1000}}) {
        check_ring<float>(c, gr, n, nb);
        check_ring<int64_t>(c, gr, n, nb);
        check_ring<st::bf16>(c, gr, n, nb);
      }
      check_ring<double>(c, gr, size_t{3} << 17, nb);
    }
  }
}

// Sends and receives between every pair (self included): two tags, received in the reverse
// order of sending (tags decide the match), and two messages of one tag (they match in start
// order). All requests started first, then waited for in an arbitrary order.
TEST_F(P2p, SendRecvMatchesByTagAndOrder) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const size_t n = 5000;
  auto msg = [&](int from, int to, int k) {
    std::vector<double> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = 1e6 * from + 1e4 * to + 100.0 * k + static_cast<double>(i % 100);
    return v;
  };
  std::vector<std::vector<double>> out, in;
  std::vector<std::unique_ptr<st::Comm::Request>> reqs;
  out.reserve(3 * static_cast<size_t>(W));
  in.reserve(3 * static_cast<size_t>(W));
  for (int q = 0; q < W; ++q) {  // receives: tag 2 first, then tag 1 twice
    in.emplace_back(n, -1.0);
    reqs.push_back(c.start_recv(in.back().data(), n, q, 2));
    in.emplace_back(n, -1.0);
    reqs.push_back(c.start_recv(in.back().data(), n, q, 1));
    in.emplace_back(n, -1.0);
    reqs.push_back(c.start_recv(in.back().data(), n, q, 1));
  }
  for (int q = 0; q < W; ++q) {  // sends: k = 0 (tag 1), k = 1 (tag 1), k = 2 (tag 2)
    for (int k = 0; k < 3; ++k) {
      out.push_back(msg(r, q, k));
      reqs.push_back(c.start_send(out.back().data(), n, q, k < 2 ? 1 : 2));
    }
  }
  for (size_t i = reqs.size(); i-- > 0;) reqs[i]->wait();
  for (int q = 0; q < W; ++q) {
    const size_t b = 3 * static_cast<size_t>(q);
    EXPECT_EQ(count_diff(in[b], msg(q, r, 2)), 0) << "tag 2 from " << q;
    EXPECT_EQ(count_diff(in[b + 1], msg(q, r, 0)), 0) << "first tag-1 message from " << q;
    EXPECT_EQ(count_diff(in[b + 2], msg(q, r, 1)), 0) << "second tag-1 message from " << q;
  }
}

// start_group: every rank one group, its sends listed before its receives, two messages of one
// tag to and from every rank (self included): they match in start order, and nothing waits for
// anything else (the group's transfers progress together). An empty group is complete at once.
TEST_F(P2p, GroupOfSendsAndReceivesMatchesInStartOrder) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const size_t n = 3000;
  auto msg = [&](int from, int to, int k) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(1000 * from + 100 * to + 10 * k) + static_cast<float>(i % 7);
    return v;
  };
  std::vector<std::vector<float>> out, in;
  std::vector<st::Comm::P2pOp> ops;
  for (int q = 0; q < W; ++q)
    for (int k = 0; k < 2; ++k) out.push_back(msg(r, q, k));
  in.assign(2 * static_cast<size_t>(W), std::vector<float>(n, -1.0f));
  for (int q = 0; q < W; ++q)
    for (int k = 0; k < 2; ++k)
      ops.push_back({false, out[static_cast<size_t>(2 * q + k)].data(), n, q, 7});
  for (int q = 0; q < W; ++q)
    for (int k = 0; k < 2; ++k)
      ops.push_back({true, in[static_cast<size_t>(2 * q + k)].data(), n, q, 7});
  c.start_group<float>(ops)->wait();
  for (int q = 0; q < W; ++q)
    for (int k = 0; k < 2; ++k)
      EXPECT_EQ(in[static_cast<size_t>(2 * q + k)], msg(q, r, k)) << "message " << k << " from rank " << q;
  auto empty = c.start_group<float>({});
  EXPECT_TRUE(empty->test());
  // A bad peer in a group is refused before anything starts (on every rank alike).
  float x = 0;
  EXPECT_THROW(c.start_group<float>({{true, &x, 1, 0, 7}, {false, &x, 1, W, 7}}), std::invalid_argument);
}

// All-to-all with per-rank counts (start_all_to_all_v, exchange_counts) in every group of g
// consecutive ranks, g = 1..W: rank p sends count(p, q) elements to rank q, some counts zero (the
// self-block too), element i of block (p -> q) being msg(p, q, i); every rank checks each block it
// received against the sender's values, and the counts exchange_counts gave it. Three rounds on one
// Comm back to back (they match in start order), in float and bf16 (the activations EP moves);
// then three with OwnBlock::Keep, where this rank's own block of recv must keep what it held
// (nothing sent to itself) and every other block still arrives at its place.
template <typename T> void check_all_to_all(st::Comm& c, const Group& gr) {
  const int W = c.world_size(), r = c.rank();
  for (int round = 0; round < 6; ++round) {
    const st::Comm::OwnBlock own = round < 3 ? st::Comm::OwnBlock::Move : st::Comm::OwnBlock::Keep;
    auto count = [&](int p, int q) { return static_cast<size_t>((p * 7 + q * 3 + round * 5) % 6 * 211); };
    auto msg = [&](int p, int q, size_t i) {
      return value<T>(gr.base + p, static_cast<size_t>(q * 5 + round) + i % 200);
    };
    std::vector<size_t> send_counts(W), want_recv(W);
    std::vector<T> send;
    for (int q = 0; q < W; ++q) {
      send_counts[q] = count(r, q);
      want_recv[q] = count(q, r);
      for (size_t i = 0; i < send_counts[q]; ++i) send.push_back(msg(r, q, i));
    }
    const std::vector<size_t> recv_counts = c.exchange_counts(send_counts);
    EXPECT_EQ(recv_counts, want_recv) << "group size " << gr.size;
    size_t total = 0;
    for (size_t n : recv_counts) total += n;
    std::vector<T> recv(total, value<T>(99, 3));
    c.start_all_to_all_v(send.data(), send_counts, recv.data(), recv_counts, own)->wait();
    int64_t bad = 0, kept = 0;
    size_t at = 0;
    for (int p = 0; p < W; ++p)
      for (size_t i = 0; i < recv_counts[p]; ++i, ++at) {
        if (own == st::Comm::OwnBlock::Keep && p == r) kept += same(recv[at], value<T>(99, 3));
        else bad += !same(recv[at], msg(p, r, i));
      }
    EXPECT_EQ(bad, 0) << "group size " << gr.size << ", round " << round;
    if (own == st::Comm::OwnBlock::Keep) {
      EXPECT_EQ(kept, static_cast<int64_t>(recv_counts[r])) << "own block overwritten, group size " << gr.size;
    }
  }
}

TEST_F(P2p, AllToAllVMovesEveryBlockToItsRank) {
  const int W = world().world_size(), r = world().rank();
  for (int g = 1; g <= W; ++g) {
    const Group gr = group_of(r, W, g);
    st::MpiComm sub = st::MpiComm::split(world(), gr.base, gr.rank);
    check_all_to_all<float>(sub, gr);
    check_all_to_all<st::bf16>(sub, gr);
  }
  // Counts of the wrong length are refused before anything starts (every rank alike).
  st::Comm& c = world();
  std::vector<size_t> short_counts(static_cast<size_t>(W) + 1, 0);
  float x = 0;
  EXPECT_THROW(c.exchange_counts(short_counts), std::invalid_argument);
  EXPECT_THROW(c.start_all_to_all_v(&x, short_counts, &x, std::vector<size_t>(W, 0)), std::invalid_argument);
  // All counts zero: nothing moves, the Request is complete.
  EXPECT_TRUE(c.start_all_to_all_v(&x, std::vector<size_t>(W, 0), &x, std::vector<size_t>(W, 0))->test());
}

// Bad peers and tags are refused before anything starts (every rank alike, so nothing is left
// unmatched).
TEST_F(P2p, RejectsBadPeerAndTag) {
  st::Comm& c = world();
  const int W = c.world_size();
  double x = 0;
  EXPECT_THROW(c.start_send(&x, 1, W, 0), std::invalid_argument);
  EXPECT_THROW(c.start_recv(&x, 1, -1, 0), std::invalid_argument);
  EXPECT_THROW(c.start_send(&x, 1, 0, -1), std::invalid_argument);
  EXPECT_THROW(c.start_recv(&x, 1, 0, st::Comm::kRingShiftTag), std::invalid_argument);
}

namespace {

// A progress-registry member that tests one Request at every poll and counts the polls.
struct Watcher {
  st::Comm::Request* req = nullptr;
  int polls = 0, polls_to_done = -1;
  static void poll(void* self) {
    auto* w = static_cast<Watcher*>(self);
    ++w->polls;
    if (w->polls_to_done < 0 && w->req->test()) w->polls_to_done = w->polls;
  }
};

std::vector<double> pattern(size_t n, double seed) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(seed + 0.37 * static_cast<double>(i));
  return v;
}

}  // namespace

// The ring shift overlapped with GEMMs: started before them, advanced only by the backend's
// polls of its progress registry (no other MPI call until it completed), so it completes during
// the GEMMs; the GEMM results are bitwise those of the same GEMMs with no member; the block is
// the left neighbour's. 4 MB blocks (rendezvous: Open MPI moves them only inside MPI calls). The
// GEMMs repeat until the member saw completion (at most 400: a bound, not a wait).
TEST_F(P2p, RingShiftAdvancesDuringGemm) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  auto be = st::make_cpu_backend<double>();
  ASSERT_NE(be->progress(), nullptr);
  const int M = 256, N = 256, K = 256;
  std::vector<double> A = pattern(static_cast<size_t>(M) * K, 1), B = pattern(static_cast<size_t>(K) * N, 2);
  std::vector<double> ref(static_cast<size_t>(M) * N), C(ref.size());
  be->gemm(false, false, M, N, K, 1.0, A.data(), K, B.data(), N, 0.0, ref.data(), N);
  const size_t n = size_t{1} << 19;
  std::vector<double> send(n), recv(n, -1.0);
  for (size_t i = 0; i < n; ++i) send[i] = value<double>(r, i);
  c.barrier();
  auto q = c.start_ring_shift(send.data(), recv.data(), n);
  Watcher w{q.get()};
  int gemms = 0;
  int64_t diff = 0;
  {
    st::ProgressRegistry::Member m = be->progress()->join(&Watcher::poll, &w);
    while (w.polls_to_done < 0 && gemms < 400) {
      std::fill(C.begin(), C.end(), 0.0);
      be->gemm(false, false, M, N, K, 1.0, A.data(), K, B.data(), N, 0.0, C.data(), N);
      diff += count_diff(C, ref);
      ++gemms;
    }
  }
  EXPECT_EQ(be->progress()->size(), 0u) << "the member left";
  EXPECT_GT(w.polls, 0) << "the GEMMs polled the registry";
  EXPECT_GT(w.polls_to_done, 0) << "the transfer completed during the GEMMs (" << gemms << " GEMMs, " << w.polls << " polls)";
  EXPECT_EQ(diff, 0) << "polling changed GEMM results";
  q->wait();
  int64_t bad = 0;
  for (size_t i = 0; i < n; ++i)
    if (recv[i] != value<double>((r + W - 1) % W, i)) ++bad;
  EXPECT_EQ(bad, 0);
  if (r == 0) std::printf("[ info ] ring shift of 4 MB at W=%d: complete after %d GEMMs, %d polls\n", W, gemms, w.polls);
}

// The same with flash attention forward and backward as the compute: polls between attention
// tiles advance a transfer started before them; outputs bitwise those without a member.
TEST_F(P2p, RingShiftAdvancesDuringAttention) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  auto be = st::make_cpu_backend<float>();
  const int Bn = 1, T = 256, NH = 4, NKV = 2, HD = 32;
  const size_t nq = static_cast<size_t>(Bn) * T * NH * HD, nk = static_cast<size_t>(Bn) * T * NKV * HD,
               ns = static_cast<size_t>(Bn) * NH * T;
  auto f = [](const std::vector<double>& d) { return std::vector<float>(d.begin(), d.end()); };
  const std::vector<float> qv = f(pattern(nq, 3)), kv = f(pattern(nk, 4)), vv = f(pattern(nk, 5)), dy = f(pattern(nq, 6));
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  struct Out {
    std::vector<float> y, lse, dq, dk, dv, dsum;
  };
  auto run = [&](Out& o) {
    o.y.assign(nq, 0);
    o.lse.assign(ns, 0);
    o.dq.assign(nq, 0);
    o.dk.assign(nk, 0);
    o.dv.assign(nk, 0);
    o.dsum.assign(ns, 0);
    be->flash_attention_forward(o.y.data(), o.lse.data(), qv.data(), kv.data(), vv.data(), Bn, T, NH, NKV, HD, scale);
    be->flash_attention_backward(o.dq.data(), o.dk.data(), o.dv.data(), o.dsum.data(), dy.data(), qv.data(), kv.data(),
                                 vv.data(), o.y.data(), o.lse.data(), Bn, T, NH, NKV, HD, scale);
  };
  Out ref, got;
  run(ref);
  const size_t n = size_t{1} << 19;
  std::vector<double> send(n), recv(n, -1.0);
  for (size_t i = 0; i < n; ++i) send[i] = value<double>(r, i);
  c.barrier();
  auto q = c.start_ring_shift(send.data(), recv.data(), n);
  Watcher w{q.get()};
  int runs = 0;
  int64_t diff = 0;
  {
    st::ProgressRegistry::Member m = be->progress()->join(&Watcher::poll, &w);
    while (w.polls_to_done < 0 && runs < 200) {
      run(got);
      diff += count_diff(got.y, ref.y) + count_diff(got.lse, ref.lse) + count_diff(got.dq, ref.dq) +
              count_diff(got.dk, ref.dk) + count_diff(got.dv, ref.dv) + count_diff(got.dsum, ref.dsum);
      ++runs;
    }
  }
  EXPECT_GT(w.polls, 0) << "attention polled the registry";
  EXPECT_GT(w.polls_to_done, 0) << "the transfer completed during attention (" << runs << " runs, " << w.polls << " polls)";
  EXPECT_EQ(diff, 0) << "polling changed attention results";
  q->wait();
  int64_t bad = 0;
  for (size_t i = 0; i < n; ++i)
    if (recv[i] != value<double>((r + W - 1) % W, i)) ++bad;
  EXPECT_EQ(bad, 0);
  if (r == 0) std::printf("[ info ] ring shift of 4 MB at W=%d: complete after %d attention passes, %d polls\n", W, runs, w.polls);
}

// Run by tests/e2e/test_p2p.sh only (it checks the exit status and the messages): the last rank
// never starts its side of a ring shift. SHARDTRAIN_TEST_P2P_PEER=silent: it waits instead on a
// receive nobody sends (alive, stuck); =stopped: it stops itself (SIGSTOP: a hung process). The
// other ranks run the ring shift and a barrier. With a 3 s collective timeout, every waiting rank's
// watchdog must end it (exit 70 with the watchdog's message).
TEST_F(P2p, DISABLED_DeadPeerEndsEveryRankUnderWatchdog) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const char* mode = std::getenv("SHARDTRAIN_TEST_P2P_PEER");
  ASSERT_NE(mode, nullptr);
  c.set_collective_timeout(3);
  c.barrier();
  std::vector<double> send(64, 1.0), recv(64);
  if (r == W - 1) {
    if (std::string(mode) == "stopped") std::raise(SIGSTOP);
    c.start_recv(recv.data(), 64, 0, 12345)->wait();  // never sent
  } else {
    c.ring_shift(send.data(), recv.data(), 64);
    c.barrier();
  }
  ADD_FAILURE() << "rank " << r << " got past a transfer whose peer never started its side";
}
