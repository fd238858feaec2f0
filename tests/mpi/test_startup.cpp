// Multi-rank tests of the start-up collectives: plan_threads (affinity masks -> threads per rank)
// and blas_report (every rank's OpenBLAS kernel set). Every rank makes the same collective calls;
// checks are EXPECT_* (see test_fsdp.cpp for the rules).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/backend/blas_select.h"
#include "shardtrain/runtime/cpu_affinity.h"
#include "shardtrain/runtime/runtime.h"
#include "../test_env.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class Startup : public ::testing::Test {
 protected:
  void TearDown() override {
    st::Comm& c = world();
    int64_t mask = ::testing::Test::HasFailure() ? (int64_t{1} << c.rank()) : 0;
    c.all_reduce(&mask, 1, st::ReduceOp::Sum);
    if (c.rank() == 0 && (mask & ~int64_t{1}))
      ADD_FAILURE() << "this test failed on another rank (mask " << mask << "; its output is not printed)";
  }
};

}  // namespace

TEST_F(Startup, ThreadPlanIsTheSameStoryOnEveryRank) {
  st::Comm& c = world();
  const st::ThreadPlan p = st::plan_threads(c, st::testing::g_runtime->topo().host, 0);
  EXPECT_GE(p.threads, 1);
  EXPECT_FALSE(p.binding.empty());
  EXPECT_TRUE(p.warnings.empty());  // --threads 0 never warns
  // The summary is made from the gathered masks: identical on every rank.
  EXPECT_TRUE(st::same_on_all_ranks(c, st::fnv1a64(p.binding + "|" + p.per_rank))) << p.binding;
  // The threads of all ranks on this (single) node never exceed its cores, unless every rank
  // already has just 1.
  int64_t total = p.threads, ones = p.threads == 1;
  c.all_reduce(&total, 1, st::ReduceOp::Sum);
  c.all_reduce(&ones, 1, st::ReduceOp::Sum);
  if (ones != c.world_size()) {
    EXPECT_LE(total, st::count_cores(st::affinity_cpus()) * int64_t{c.world_size()});
  }
  // An explicit count is obeyed.
  EXPECT_EQ(st::plan_threads(c, st::testing::g_runtime->topo().host, 3).threads, 3);
}

TEST_F(Startup, BlasReportNamesEveryRanksKernels) {
  st::Comm& c = world();
  std::vector<std::string> lines;
  const std::string text = st::blas_report(c, &lines);
  EXPECT_NE(text.find(st::blas_selection().corename + " kernels"), std::string::npos) << text;
  EXPECT_NE(text.find("OpenBLAS"), std::string::npos) << text;
  EXPECT_EQ(text.find(" use "), std::string::npos) << "ranks of one node differ: " << text;
  EXPECT_TRUE(st::same_on_all_ranks(c, st::fnv1a64(text))) << text;
}
