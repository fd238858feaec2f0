// The progress registry (progress.h) and its use by the CPU backend's kernels (backend.h,
// Backend::progress): members run in join order at every poll, leave when their Member goes (also
// from inside a poll), a poll re-entered from a member does nothing, a poll on another thread does
// nothing and a join there is refused; the CPU backend polls after GEMM tiles and between flash
// attention tiles, at one thread and at several, with results bitwise those without members.
// The multi-rank tests (a transfer advanced during GEMMs and attention) are in tests/mpi/test_p2p.cpp.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/runtime/progress.h"

namespace st = shardtrain;

namespace {

struct Log {
  std::vector<std::string> calls;
};
struct Named {
  Log* log;
  std::string name;
  static void fn(void* p) {
    auto* n = static_cast<Named*>(p);
    n->log->calls.push_back(n->name);
  }
};

}  // namespace

TEST(ProgressRegistry, PollsMembersInJoinOrderUntilTheyLeave) {
  st::ProgressRegistry reg;
  Log log;
  Named a{&log, "a"}, b{&log, "b"};
  reg.poll();  // no members: nothing
  EXPECT_TRUE(log.calls.empty());
  auto ma = reg.join(&Named::fn, &a);
  {
    auto mb = reg.join(&Named::fn, &b);
    EXPECT_EQ(reg.size(), 2u);
    reg.poll();
    EXPECT_EQ(log.calls, (std::vector<std::string>{"a", "b"}));
  }
  EXPECT_EQ(reg.size(), 1u);
  reg.poll();
  EXPECT_EQ(log.calls, (std::vector<std::string>{"a", "b", "a"}));
  st::ProgressRegistry::Member moved = std::move(ma);
  EXPECT_FALSE(ma.joined());
  EXPECT_TRUE(moved.joined());
  moved.reset();
  moved.reset();  // idempotent
  EXPECT_EQ(reg.size(), 0u);
  reg.poll();
  EXPECT_EQ(log.calls.size(), 3u);
  EXPECT_THROW((void)reg.join(nullptr, nullptr), std::invalid_argument);
}

namespace {
// Leaves (its own membership and another's) and re-enters poll() from inside its function.
struct Tricky {
  st::ProgressRegistry* reg;
  st::ProgressRegistry::Member self, other;
  int calls = 0;
  static void fn(void* p) {
    auto* t = static_cast<Tricky*>(p);
    ++t->calls;
    t->reg->poll();  // re-entered: nothing
    t->other.reset();
    t->self.reset();
  }
};
}  // namespace

TEST(ProgressRegistry, LeaveAndReentryDuringPoll) {
  st::ProgressRegistry reg;
  Log log;
  Named later{&log, "later"};
  Tricky t{&reg, {}, {}};
  t.self = reg.join(&Tricky::fn, &t);
  t.other = reg.join(&Named::fn, &later);
  reg.poll();
  EXPECT_EQ(t.calls, 1) << "not re-entered";
  EXPECT_TRUE(log.calls.empty()) << "a member that left during the poll is not called";
  EXPECT_EQ(reg.size(), 0u);
  reg.poll();
  EXPECT_EQ(t.calls, 1);
}

TEST(ProgressRegistry, OtherThreadsNeitherPollNorJoin) {
  st::ProgressRegistry reg;
  Log log;
  Named a{&log, "a"};
  auto m = reg.join(&Named::fn, &a);
  bool threw = false;
  std::thread th([&] {
    reg.poll();
    try {
      (void)reg.join(&Named::fn, &a);
    } catch (const std::logic_error&) {
      threw = true;
    }
  });
  th.join();
  EXPECT_TRUE(log.calls.empty()) << "a poll on another thread calls nothing";
  EXPECT_TRUE(threw);
  reg.poll();
  EXPECT_EQ(log.calls.size(), 1u);
}

namespace {
std::vector<float> pattern(size_t n, double seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(std::sin(seed + 0.37 * static_cast<double>(i)));
  return v;
}
struct Counter {
  int n = 0;
  static void fn(void* p) { ++static_cast<Counter*>(p)->n; }
};
}  // namespace

// The CPU backend polls its registry after GEMM tiles (each tile at one thread: 16 tiles for a
// 1024^3 GEMM, gemm_tiles in cpu/gemm.cpp; once after the parallel tiles at several) and between
// flash attention work items (forward and backward), and the results are bitwise equal to the
// same calls without members.
TEST(ProgressRegistry, CpuBackendPollsInGemmAndAttentionBitwise) {
  auto be = st::make_cpu_backend<float>();
  ASSERT_NE(be->progress(), nullptr);
  const int threads0 = omp_get_max_threads();
  const int M = 1024, N = 1024, K = 1024;
  const std::vector<float> A = pattern(static_cast<size_t>(M) * K, 1), B = pattern(static_cast<size_t>(K) * N, 2);
  const int Bn = 2, T = 200, NH = 4, NKV = 2, HD = 16;
  const size_t nq = static_cast<size_t>(Bn) * T * NH * HD, nk = static_cast<size_t>(Bn) * T * NKV * HD,
               ns = static_cast<size_t>(Bn) * NH * T;
  const std::vector<float> q = pattern(nq, 3), k = pattern(nk, 4), v = pattern(nk, 5), dy = pattern(nq, 6);
  const float scale = 0.25f;
  auto run = [&](std::vector<std::vector<float>>& o) {
    o.assign(7, {});
    o[0].assign(static_cast<size_t>(M) * N, 0);
    be->gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, o[0].data(), N);
    o[1].assign(nq, 0);
    o[2].assign(ns, 0);
    be->flash_attention_forward(o[1].data(), o[2].data(), q.data(), k.data(), v.data(), Bn, T, NH, NKV, HD, scale);
    o[3].assign(nq, 0);
    o[4].assign(nk, 0);
    o[5].assign(nk, 0);
    o[6].assign(ns, 0);
    be->flash_attention_backward(o[3].data(), o[4].data(), o[5].data(), o[6].data(), dy.data(), q.data(), k.data(),
                                 v.data(), o[1].data(), o[2].data(), Bn, T, NH, NKV, HD, scale);
  };
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    std::vector<std::vector<float>> ref, got;
    run(ref);
    Counter gemm, attn;
    {
      auto m = be->progress()->join(&Counter::fn, &gemm);
      std::vector<float> c(static_cast<size_t>(M) * N, 0);
      be->gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, c.data(), N);
    }
    {
      auto m = be->progress()->join(&Counter::fn, &attn);
      std::vector<float> y(nq), lse(ns);
      be->flash_attention_forward(y.data(), lse.data(), q.data(), k.data(), v.data(), Bn, T, NH, NKV, HD, scale);
    }
    if (threads == 1) {
      EXPECT_EQ(gemm.n, 16) << "one poll per GEMM tile at one thread";
      EXPECT_EQ(attn.n, Bn * NH * 4) << "one poll per (b, h, query tile) item at one thread";
    } else {
      EXPECT_GE(gemm.n, 1) << "a poll after the parallel tiles";
      EXPECT_GE(attn.n, 1) << "polls between attention tiles on the master thread";
    }
    Counter all;
    auto m = be->progress()->join(&Counter::fn, &all);
    run(got);
    // One thread: the counts are exact, so the backward's polls show in the difference. Two threads:
    // how many items the master thread runs depends on the load (dynamic schedule), so only what is
    // certain: each parallel kernel polls at least once when its master runs out of items (GEMM,
    // forward, the backward's two passes).
    if (threads == 1) EXPECT_GT(all.n, gemm.n + attn.n) << "the backward polls too";
    else EXPECT_GE(all.n, 4) << "GEMM, forward and both backward passes each poll";
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_EQ(std::memcmp(ref[i].data(), got[i].data(), ref[i].size() * sizeof(float)), 0) << "output " << i;
  }
  omp_set_num_threads(threads0);
}
