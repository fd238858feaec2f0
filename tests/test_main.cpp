// GoogleTest main for shardtrain's test binaries: starts MPI (a Runtime), keeps gtest's printer
// on rank 0 only, and makes the process exit code reflect failures on this rank.
#include <gtest/gtest.h>

#include "shardtrain/backend/blas_select.h"

#include "test_env.h"

namespace shardtrain::testing {
Runtime* g_runtime = nullptr;
}

int main(int argc, char** argv) {
  // The tests' GEMMs run on the kernel set shardtrain itself would use (may re-execute, as there).
  const shardtrain::BlasSelection& blas = shardtrain::select_blas_kernels(argv);
  shardtrain::Runtime rt(&argc, &argv);
  shardtrain::testing::g_runtime = &rt;
  if (rt.topo().rank == 0) {
    std::fprintf(stderr, "BLAS: %s with %s kernels (%s)\n", blas.library.c_str(), blas.corename.c_str(), blas.how.c_str());
    for (auto& l : blas.notes) std::fprintf(stderr, "note: %s\n", l.c_str());
    for (auto& l : blas.warnings) std::fprintf(stderr, "warning: %s\n", l.c_str());
  }
  if (!blas.usable) {
    std::fprintf(stderr, "rank %d: error: %s\n", rt.topo().rank, blas.error.c_str());
    return 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (rt.topo().rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  if (rc != 0 && rt.topo().rank != 0) std::fprintf(stderr, "rank %d: tests failed\n", rt.topo().rank);
  return rc;
}
