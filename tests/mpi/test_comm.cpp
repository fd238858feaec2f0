// Multi-rank tests of the runtime layer's Comm collectives (all-gather, reduce-scatter, all-reduce,
// broadcast, zero counts) and error agreement (all_ok, agree), against values computed here from
// each rank's known inputs. Run under mpirun at 1, 2, 3 and 4 ranks; every test passes at each size.
//
// Every rank makes the same collective calls in the same order whatever its local results, so
// checks after a collective are EXPECT_* (never an ASSERT_* that could return early on one rank).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/runtime/runtime.h"
#include "rank_test.h"

using shardtrain::testing::count_diff;

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

}  // namespace

// Fixtures: Comm (collectives) and AllOk (error agreement); library names are written st::...
class Comm : public st::testing::RankTest {};
class AllOk : public st::testing::RankTest {};

// ---------------------------------------------------------------------------------------------
// Comm collectives

template <typename T> void check_all_gather() {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  // And two and a bit slabs (runtime.h: the MPI Comm gathers kCollectiveSlab bytes of all ranks at
  // a time and unpacks them; values below 2^24 stay exact in float).
  const size_t slab = st::Comm::kCollectiveSlab / sizeof(T) / static_cast<size_t>(W);
  for (size_t n : {size_t{1}, size_t{5}, 2 * slab + 3}) {
    std::vector<T> send(n), recv(n * static_cast<size_t>(W), T(-1));
    for (size_t i = 0; i < n; ++i) send[i] = static_cast<T>(100 * r + static_cast<int>(i)) + T(0.5);
    c.all_gather(send.data(), recv.data(), n);
    int64_t bad = 0;
    for (int q = 0; q < W; ++q)
      for (size_t i = 0; i < n; ++i)
        if (recv[static_cast<size_t>(q) * n + i] != static_cast<T>(100 * q + static_cast<int>(i)) + T(0.5)) ++bad;
    EXPECT_EQ(bad, 0) << "all_gather n=" << n;

    // In place: send is this rank's block of recv.
    std::vector<T> inplace(n * static_cast<size_t>(W), T(-7));
    for (size_t i = 0; i < n; ++i) inplace[static_cast<size_t>(r) * n + i] = send[i];
    c.all_gather(inplace.data() + static_cast<size_t>(r) * n, inplace.data(), n);
    EXPECT_EQ(count_diff(inplace, recv), 0) << "in-place all_gather n=" << n;
  }
}

template <typename T> void check_reduce_scatter() {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  // Two and a bit slabs (runtime.h: the MPI Comm packs and reduce-scatters kCollectiveSlab bytes
  // of all ranks at a time; the last slab is short).
  const size_t slab = st::Comm::kCollectiveSlab / sizeof(T) / static_cast<size_t>(W);
  for (size_t n : {size_t{1}, size_t{4}, 2 * slab + 3}) {
    // send[b*n + i] on rank q = (q+1)*1000 + 10*b + i%97 + 0.25: dyadic, so every summation order is exact.
    std::vector<T> send(n * static_cast<size_t>(W)), recv(n, T(-1));
    for (int b = 0; b < W; ++b)
      for (size_t i = 0; i < n; ++i)
        send[static_cast<size_t>(b) * n + i] = static_cast<T>((r + 1) * 1000 + 10 * b + static_cast<int>(i % 97)) + T(0.25);
    c.reduce_scatter_sum(send.data(), recv.data(), n);
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      double want = 0;
      for (int q = 0; q < W; ++q) want += (q + 1) * 1000.0 + 10.0 * r + static_cast<double>(i % 97) + 0.25;
      if (recv[i] != static_cast<T>(want) && wrong++ < 5)
        ADD_FAILURE() << "reduce_scatter_sum n=" << n << " i=" << i << ": " << recv[i] << " != " << want;
    }
    EXPECT_EQ(wrong, 0u) << "reduce_scatter_sum n=" << n;
  }
}

template <typename T> void check_all_reduce() {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const size_t n = 9;
  auto val = [](int q, size_t i) { return static_cast<T>(((q * 7 + static_cast<int>(i) * 3) % 11) - 5) + T(0.5); };
  for (st::ReduceOp op : {st::ReduceOp::Sum, st::ReduceOp::Max, st::ReduceOp::Min}) {
    std::vector<T> buf(n);
    for (size_t i = 0; i < n; ++i) buf[i] = val(r, i);
    c.all_reduce(buf.data(), n, op);
    for (size_t i = 0; i < n; ++i) {
      T want = val(0, i);
      for (int q = 1; q < W; ++q) {
        T v = val(q, i);
        want = op == st::ReduceOp::Sum ? want + v : op == st::ReduceOp::Max ? std::max(want, v) : std::min(want, v);
      }
      EXPECT_EQ(buf[i], want) << "all_reduce op " << static_cast<int>(op) << " i=" << i;
    }
  }
}

template <typename T> void check_broadcast() {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const size_t n = 6;
  for (int root = 0; root < W; ++root) {
    std::vector<T> buf(n);
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(r * 10 + static_cast<int>(i)) + T(0.125);
    c.broadcast(buf.data(), n, root);
    for (size_t i = 0; i < n; ++i)
      EXPECT_EQ(buf[i], static_cast<T>(root * 10 + static_cast<int>(i)) + T(0.125)) << "broadcast root " << root;
  }
}

TEST_F(Comm, AllGather) {
  check_all_gather<float>();
  check_all_gather<double>();
}

TEST_F(Comm, ReduceScatterSum) {
  check_reduce_scatter<float>();
  check_reduce_scatter<double>();
}

TEST_F(Comm, AllReduce) {
  check_all_reduce<float>();
  check_all_reduce<double>();
  // Integer types are supported by all_reduce too.
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  int64_t i64[3] = {r, -r, int64_t{1} << 40};
  c.all_reduce(i64, 1, st::ReduceOp::Max);
  c.all_reduce(i64 + 1, 1, st::ReduceOp::Min);
  c.all_reduce(i64 + 2, 1, st::ReduceOp::Sum);
  EXPECT_EQ(i64[0], W - 1);
  EXPECT_EQ(i64[1], -(W - 1));
  EXPECT_EQ(i64[2], static_cast<int64_t>(W) << 40);
  uint64_t u64 = static_cast<uint64_t>(r) + 1;
  c.all_reduce(&u64, 1, st::ReduceOp::Sum);
  EXPECT_EQ(u64, static_cast<uint64_t>(W) * static_cast<uint64_t>(W + 1) / 2);
}

TEST_F(Comm, Broadcast) {
  check_broadcast<float>();
  check_broadcast<double>();
  st::Comm& c = world();
  for (int root = 0; root < c.world_size(); ++root) {
    char ch[2] = {static_cast<char>('a' + c.rank()), 'z'};
    c.broadcast(ch, 2, root);
    EXPECT_EQ(ch[0], static_cast<char>('a' + root));
  }
}

TEST_F(Comm, BroadcastString) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  for (int root = 0; root < W; ++root) {
    // Each rank passes its own string of a different length; only root's survives.
    std::string mine = "rank " + std::to_string(r) + ":" + std::string(static_cast<size_t>(3 + 17 * r), 'x');
    std::string want = "rank " + std::to_string(root) + ":" + std::string(static_cast<size_t>(3 + 17 * root), 'x');
    EXPECT_EQ(c.broadcast_string(mine, root), want) << "root " << root;
    // Empty from root, non-empty elsewhere.
    EXPECT_EQ(c.broadcast_string(r == root ? std::string() : mine, root), "") << "root " << root;
    // Embedded NUL bytes and a long string.
    std::string bin = std::string("a\0b", 3) + std::string(5000, static_cast<char>('0' + root));
    EXPECT_EQ(c.broadcast_string(r == root ? bin : std::string("?"), root), bin) << "root " << root;
  }
}

TEST_F(Comm, ZeroCount) {
  st::Comm& c = world();
  const int W = c.world_size();
  for (int rep = 0; rep < 2; ++rep) {
    // Distinct non-null buffers with sentinels: nothing may be written.
    std::vector<double> send(1, 3.0), recv(static_cast<size_t>(W), -1.0);
    c.all_gather(send.data(), recv.data(), 0);
    c.reduce_scatter_sum(recv.data(), send.data(), 0);
    EXPECT_EQ(send[0], 3.0);
    for (double v : recv) EXPECT_EQ(v, -1.0);
    std::vector<float> fs(1, 3.0f), fr(static_cast<size_t>(W), -1.0f);
    c.all_gather(fs.data(), fr.data(), 0);
    c.reduce_scatter_sum(fr.data(), fs.data(), 0);
    EXPECT_EQ(fs[0], 3.0f);
    for (float v : fr) EXPECT_EQ(v, -1.0f);
    // Empty vectors (null data pointers) too.
    std::vector<double> e0, e1;
    c.all_gather(e0.data(), e1.data(), 0);
    c.reduce_scatter_sum(e0.data(), e1.data(), 0);
  }
  // The communicator is still in step afterwards.
  double x = 1.0;
  c.all_reduce(&x, 1, st::ReduceOp::Sum);
  EXPECT_EQ(x, static_cast<double>(W));
}

// ---------------------------------------------------------------------------------------------
// Error agreement

namespace {
// Calls all_ok and returns the CollectiveError it threw (or reports that it did not throw).
struct AllOkOutcome {
  bool threw = false, other_exception = false;
  int origin = -1;
  std::string what;
};
AllOkOutcome run_all_ok(bool ok, const std::string& msg) {
  AllOkOutcome o;
  try {
    st::all_ok(world(), ok, msg);
  } catch (const st::CollectiveError& e) {
    o.threw = true;
    o.origin = e.origin_rank;
    o.what = e.what();
  } catch (...) {
    o.other_exception = true;
  }
  return o;
}
std::string fail_msg(int rank) { return "disk full on node-" + std::to_string(rank) + " (code 28)"; }
bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

// Every rank checks that the comm is still in step after an agreement round.
void expect_in_step() {
  st::Comm& c = world();
  int64_t x = 1;
  c.all_reduce(&x, 1, st::ReduceOp::Sum);
  EXPECT_EQ(x, c.world_size()) << "communicator out of step after all_ok";
}
}  // namespace

TEST_F(AllOk, AllSucceed) {
  for (int rep = 0; rep < 3; ++rep) {
    AllOkOutcome o = run_all_ok(true, "unused message " + std::to_string(world().rank()));
    EXPECT_FALSE(o.threw) << o.what;
    EXPECT_FALSE(o.other_exception);
  }
  expect_in_step();
}

TEST_F(AllOk, LastRankFails) {
  const int W = world().world_size(), r = world().rank(), last = W - 1;
  AllOkOutcome o = run_all_ok(r != last, r == last ? fail_msg(r) : "not a failure " + std::to_string(r));
  EXPECT_TRUE(o.threw) << "every rank must throw CollectiveError";
  EXPECT_FALSE(o.other_exception);
  EXPECT_EQ(o.origin, last);
  EXPECT_TRUE(contains(o.what, fail_msg(last))) << o.what;
  EXPECT_FALSE(contains(o.what, "not a failure")) << o.what;
  if (last != 0) {
    EXPECT_TRUE(contains(o.what, "rank " + std::to_string(last) + ":")) << o.what;
  } else {
    EXPECT_EQ(o.what, fail_msg(0)) << "a single failure on rank 0 is not prefixed";
  }
  expect_in_step();
  // A later all-success round returns normally: nothing was left behind.
  AllOkOutcome again = run_all_ok(true, "");
  EXPECT_FALSE(again.threw) << again.what;
}

TEST_F(AllOk, EachSingleRankFails) {
  const int W = world().world_size(), r = world().rank();
  for (int f = 0; f < W; ++f) {
    AllOkOutcome o = run_all_ok(r != f, r == f ? fail_msg(r) : "");
    EXPECT_TRUE(o.threw) << "failing rank " << f;
    EXPECT_EQ(o.origin, f);
    EXPECT_TRUE(contains(o.what, fail_msg(f))) << o.what;
    if (f != 0) {
      EXPECT_TRUE(contains(o.what, "rank " + std::to_string(f) + ":")) << o.what;
    }
  }
  expect_in_step();
}

TEST_F(AllOk, TwoRanksFailLowestWins) {
  const int W = world().world_size(), r = world().rank();
  if (W < 2) GTEST_SKIP() << "needs two ranks";
  const int lo = W - 2, hi = W - 1;
  const bool fails = r == lo || r == hi;
  AllOkOutcome o = run_all_ok(!fails, fails ? fail_msg(r) : "");
  EXPECT_TRUE(o.threw);
  EXPECT_FALSE(o.other_exception);
  EXPECT_EQ(o.origin, lo);
  EXPECT_TRUE(contains(o.what, fail_msg(lo))) << o.what;
  EXPECT_FALSE(contains(o.what, fail_msg(hi))) << o.what;
  if (lo != 0) {
    EXPECT_TRUE(contains(o.what, "rank " + std::to_string(lo) + ":")) << o.what;
  }
  expect_in_step();
}

TEST_F(AllOk, AllRanksFail) {
  const int W = world().world_size(), r = world().rank();
  AllOkOutcome o = run_all_ok(false, fail_msg(r));
  EXPECT_TRUE(o.threw);
  EXPECT_EQ(o.origin, 0);
  EXPECT_TRUE(contains(o.what, fail_msg(0))) << o.what;
  for (int q = 1; q < W; ++q) EXPECT_FALSE(contains(o.what, fail_msg(q))) << o.what;
  expect_in_step();
}

// runtime.h: the message is rank R's, "prefixed with "rank R: " when R != 0". So when rank 0 is
// among several failing ranks, every rank gets rank 0's message exactly, unprefixed.
TEST_F(AllOk, MultipleFailuresIncludingRankZero) {
  const int W = world().world_size(), r = world().rank();
  if (W < 2) GTEST_SKIP() << "needs two ranks";
  const bool fails = r == 0 || r == W - 1;
  AllOkOutcome o = run_all_ok(!fails, fails ? fail_msg(r) : "");
  EXPECT_TRUE(o.threw);
  EXPECT_FALSE(o.other_exception);
  EXPECT_EQ(o.origin, 0);
  EXPECT_EQ(o.what, fail_msg(0));
  expect_in_step();
}

TEST_F(AllOk, AgreeTurnsOneRankExceptionIntoCollectiveErrorEverywhere) {
  const int W = world().world_size(), r = world().rank();
  for (int f = 0; f < W; ++f) {
    bool ran = false, threw = false;
    std::string what;
    int origin = -1;
    try {
      st::agree(world(), [&] {
        ran = true;
        if (r == f) throw std::runtime_error("cannot open checkpoint shard " + std::to_string(f));
      });
    } catch (const st::CollectiveError& e) {
      threw = true;
      what = e.what();
      origin = e.origin_rank;
    } catch (...) {
      ADD_FAILURE() << "agree threw something other than CollectiveError";
    }
    EXPECT_TRUE(ran);
    EXPECT_TRUE(threw) << "failing rank " << f;
    EXPECT_EQ(origin, f);
    EXPECT_TRUE(contains(what, "cannot open checkpoint shard " + std::to_string(f))) << what;
    if (f != 0) {
      EXPECT_TRUE(contains(what, "rank " + std::to_string(f) + ":")) << what;
    }
  }
  // Success everywhere: returns normally and ran fn on every rank.
  int calls = 0;
  EXPECT_NO_THROW(st::agree(world(), [&] { ++calls; }));
  EXPECT_EQ(calls, 1);
  expect_in_step();
}
