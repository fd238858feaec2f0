// Device identity for placement checks (cuda.h: cuda_device_uuid). Kept apart from the backend:
// it is called before any CudaContext exists.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "shardtrain/cuda.h"

namespace shardtrain {

std::string cuda_device_uuid(int device) {
  if (std::getenv("SHARDTRAIN_FAKE_CUDA_DEVICES")) return "fake-GPU-" + std::to_string(device);
  cudaDeviceProp prop{};
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error("cudaGetDeviceProperties(" + std::to_string(device) + ") failed: " + cudaGetErrorString(e));
  }
  std::string s = "GPU-";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    s += hex;
  }
  return s;
}

}  // namespace shardtrain
