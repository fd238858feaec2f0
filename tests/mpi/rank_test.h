// A GoogleTest fixture for multi-rank tests: each test runs under a trace naming the rank, and after
// it every rank learns which ranks failed (one all-reduce), so that rank 0, the only one gtest
// prints on, reports the failures of the others. Every test using it must make the same
// collective calls on every rank (checks after a collective are EXPECT_*, never ASSERT_*).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "../test_env.h"

namespace shardtrain::testing {

// Counts elements that differ (exactly), so a failure reports one line instead of thousands.
template <typename T> int64_t count_diff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return -1;
  int64_t d = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) ++d;
  return d;
}


class RankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rank_trace_ = std::make_unique<::testing::ScopedTrace>(
        __FILE__, __LINE__, "rank " + std::to_string(comm().rank()) + " of " + std::to_string(comm().world_size()));
  }
  void TearDown() override {
    rank_trace_.reset();
    Comm& c = comm();
    // Bit r set when rank r failed (world sizes here are far below 63).
    int64_t mask = ::testing::Test::HasFailure() ? (int64_t{1} << c.rank()) : 0;
    c.all_reduce(&mask, 1, ReduceOp::Sum);
    if (c.rank() == 0) {
      std::string who;
      for (int r = 1; r < c.world_size(); ++r)
        if (mask & (int64_t{1} << r)) {
          who += ' ';
          who += std::to_string(r);
        }
      if (!who.empty()) ADD_FAILURE() << "this test failed on rank(s):" << who << " (their output is not printed)";
    }
  }

 private:
  std::unique_ptr<::testing::ScopedTrace> rank_trace_;
};

// A RankTest with a fresh directory that every rank sees (rank 0 makes it under /tmp, the name is
// broadcast), removed after the test, once every rank is done with it.
class TempDirTest : public RankTest {
 protected:
  void SetUp() override {
    RankTest::SetUp();
    std::string d;
    if (comm().rank() == 0) {
      char tmpl[] = "/tmp/shardtrain-test.XXXXXX";
      d = mkdtemp(tmpl) ? tmpl : "";
    }
    dir_ = comm().broadcast_string(d, 0);
  }
  void TearDown() override {
    comm().barrier();
    if (comm().rank() == 0 && !dir_.empty()) std::filesystem::remove_all(dir_);
    RankTest::TearDown();
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

}  // namespace shardtrain::testing
