// Device identity for placement checks (cuda.h: cuda_device_uuid; the plugin's device_uuid), and
// what kind of memory a pointer is (cuda_memory_kind). Kept apart from the backend: they need no
// CudaContext.
#include <cuda_runtime.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "plugin_abi.h"
#include "shardtrain/backend/cuda.h"

namespace shardtrain {

std::string cuda_impl::device_uuid(int device) {
  cudaDeviceProp prop{};
  cuda_detail::check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", ST_CUDA_HERE);
  std::string s = "GPU-";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    s += hex;
  }
  return s;
}

std::string cuda_impl::memory_kind(const void* p) {
  cudaPointerAttributes a{};
  cuda_detail::check_cuda(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes", ST_CUDA_HERE);
  switch (a.type) {
    case cudaMemoryTypeDevice: return "device";
    case cudaMemoryTypeHost: return "pinned host";
    case cudaMemoryTypeManaged: return "managed";
    default: return "host";  // cudaMemoryTypeUnregistered: pageable
  }
}

}  // namespace shardtrain
