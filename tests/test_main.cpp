// GoogleTest main for shardtrain's test binaries: starts MPI (a Runtime), keeps gtest's printer
// on rank 0 only, and makes the process exit code reflect failures on this rank.
#include <gtest/gtest.h>

#include "test_env.h"

namespace shardtrain::testing {
Runtime* g_runtime = nullptr;
}

int main(int argc, char** argv) {
  shardtrain::Runtime rt(&argc, &argv);
  shardtrain::testing::g_runtime = &rt;
  ::testing::InitGoogleTest(&argc, argv);
  if (rt.topo().rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  if (rc != 0 && rt.topo().rank != 0) std::fprintf(stderr, "rank %d: tests failed\n", rt.topo().rank);
  return rc;
}
