// Device placement (plan_devices): which GPU a rank binds and which collective path it uses, and
// the refusals that must come before any device is touched. Pure logic: runs without a GPU.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "shardtrain/model/config.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/train/train.h"

namespace st = shardtrain;

namespace {
std::string error_of(const std::string& dev, const std::string& comm, int lr, int ls, int n, bool built) {
  try {
    st::plan_devices(dev, comm, lr, ls, n, built, "node7");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(DevicePlan, AutoPicksCudaOnlyWhenBuiltAndVisible) {
  EXPECT_FALSE(st::plan_devices("auto", "nccl", 0, 1, 0, true, "n").cuda);
  EXPECT_FALSE(st::plan_devices("auto", "nccl", 0, 1, 4, false, "n").cuda);
  auto p = st::plan_devices("auto", "nccl", 3, 4, 4, true, "n");
  EXPECT_TRUE(p.cuda);
  EXPECT_EQ(p.gpu, 3);
  EXPECT_TRUE(p.nccl);
  EXPECT_FALSE(st::plan_devices("cpu", "nccl", 0, 1, 8, true, "n").cuda);
}

TEST(DevicePlan, LocalRankSelectsTheGpu) {
  for (int lr = 0; lr < 8; ++lr) EXPECT_EQ(st::plan_devices("cuda", "nccl", lr, 8, 8, true, "n").gpu, lr);
  // Shared GPUs (--gpu-comm mpi): 4 ranks on 2 GPUs use 0, 1, 0, 1.
  for (int lr = 0; lr < 4; ++lr) {
    auto p = st::plan_devices("cuda", "mpi", lr, 4, 2, true, "n");
    EXPECT_EQ(p.gpu, lr % 2);
    EXPECT_FALSE(p.nccl);
  }
}

namespace {
std::string sharing_error(const std::string& comm, int ranks_on_gpu, int local_size, int devices) {
  auto p = st::plan_devices("cuda", comm, 0, local_size, devices, true, "node7");
  try {
    st::check_gpu_sharing(p, ranks_on_gpu, local_size, devices, "node7");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(DevicePlan, MoreRanksThanGpusNeedsTheSharedPath) {
  // 4 ranks, 2 GPUs: ranks 0 and 2 share GPU 0.
  std::string e = sharing_error("nccl", 2, 4, 2);
  EXPECT_NE(e.find("4 ranks run on node node7 but it has only 2 visible CUDA devices (2 ranks on GPU 0)"),
            std::string::npos) << e;
  EXPECT_NE(e.find("NCCL refuses two ranks on one GPU"), std::string::npos) << e;
  EXPECT_NE(e.find("'--gpu-comm mpi'"), std::string::npos) << e;
  EXPECT_EQ(sharing_error("mpi", 2, 4, 2), "");  // the shared-GPU path is selected
  // Slurm --gpus-per-task=1: 4 ranks each see 1 device, but different physical GPUs (by UUID).
  EXPECT_EQ(sharing_error("nccl", 1, 4, 1), "");
  // CPU runs never share a GPU.
  EXPECT_NO_THROW(st::check_gpu_sharing(st::plan_devices("cpu", "nccl", 0, 4, 1, true, "n"), 4, 4, 1, "n"));
}

TEST(DevicePlan, RefusalsNameTheOption) {
  EXPECT_NE(error_of("cuda", "nccl", 0, 1, 0, true).find("option '--device cuda': no CUDA device visible on node node7"),
            std::string::npos);
  EXPECT_NE(error_of("cuda", "nccl", 0, 1, 4, false).find("built without CUDA"), std::string::npos);
  EXPECT_NE(error_of("tpu", "nccl", 0, 1, 1, true).find("option '--device': unknown value 'tpu'"), std::string::npos);
  EXPECT_NE(error_of("cuda", "gloo", 0, 1, 1, true).find("option '--gpu-comm': unknown value 'gloo'"),
            std::string::npos);
}

