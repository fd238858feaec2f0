// Device placement: which GPU a rank uses and how its data collectives run. Pure logic, no CUDA
// calls, so that it is unit tested on machines without a GPU (tests/unit/test_device_plan.cpp);
// and the device queries' test hook.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "shardtrain/backend/cuda.h"

namespace shardtrain {

// The test hook SHARDTRAIN_FAKE_CUDA_DEVICES (cuda.h), read here only.
int cuda_device_count(std::string* why) {
  if (const char* fake = std::getenv("SHARDTRAIN_FAKE_CUDA_DEVICES")) return std::atoi(fake);
  return cuda_runtime_device_count(why);
}
std::string cuda_device_uuid(int device) {
  if (std::getenv("SHARDTRAIN_FAKE_CUDA_DEVICES")) return "fake-GPU-" + std::to_string(device);
  return cuda_runtime_device_uuid(device);
}

DevicePlan plan_devices(const std::string& device, const std::string& gpu_comm, int local_rank, int local_size,
                        int devices, bool built, const std::string& host) {
  if (device != "auto" && device != "cpu" && device != "cuda")
    throw std::invalid_argument("option '--device': unknown value '" + device + "' (expected auto, cpu or cuda)");
  if (gpu_comm != "nccl" && gpu_comm != "mpi")
    throw std::invalid_argument("option '--gpu-comm': unknown value '" + gpu_comm + "' (expected nccl or mpi)");
  DevicePlan p;
  if (device == "cpu" || (device == "auto" && (!built || devices == 0))) {
    p.summary = device == "cpu" ? "cpu (--device cpu)"
                                : std::string("cpu (--device auto: ") +
                                      (built ? "no CUDA device visible on " + host : "this build has no CUDA backend") +
                                      ")";
    return p;
  }
  if (!built)
    throw std::invalid_argument("option '--device cuda': this shardtrain was built without CUDA (no nvcc at build "
                                "time, or make CUDA=0); rebuild with the CUDA toolkit, or use '--device cpu'");
  if (devices <= 0)
    throw std::invalid_argument("option '--device cuda': no CUDA device visible on node " + host +
                                " (check the driver, CUDA_VISIBLE_DEVICES, and the job's --gpus-per-task); or use "
                                "'--device cpu'");
  (void)local_size;
  p.cuda = true;
  p.gpu = local_rank % devices;
  p.nccl = gpu_comm == "nccl";
  p.summary = "cuda (" + std::to_string(devices) + " device" + (devices == 1 ? "" : "s") + " on node " + host + ", " +
              (p.nccl ? "NCCL collectives" : "MPI collectives on host copies (--gpu-comm mpi)") + ")";
  return p;
}

void check_gpu_sharing(const DevicePlan& p, int ranks_on_gpu, int local_size, int devices, const std::string& host) {
  if (!p.cuda || !p.nccl || ranks_on_gpu <= 1) return;
  throw std::invalid_argument(
      std::to_string(local_size) + " ranks run on node " + host + " but it has only " + std::to_string(devices) +
      " visible CUDA device" + (devices == 1 ? "" : "s") + " (" + std::to_string(ranks_on_gpu) +
      " ranks on GPU " + std::to_string(p.gpu) +
      "): NCCL refuses two ranks on one GPU. Start one rank per GPU (srun --gpus-per-task=1, mpirun -np <GPUs>), "
      "or pass '--gpu-comm mpi' to share GPUs with collectives through MPI on host copies");
}

}  // namespace shardtrain
