// CUDA runtime error checks shared by the .cu sources (backend, device query, device Comms).
// Private to src/: not part of the public headers.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace shardtrain::cuda_detail {

// Throws std::runtime_error "CUDA error: WHAT failed (WHERE): <reason> (<name>)". WHERE says where
// the call was made: "file:line" (ST_CUDA) or the operation it belongs to (e.g. a collective).
// Clears a non-sticky error first, so that later calls do not report it again.
[[noreturn]] inline void throw_cuda(cudaError_t e, const char* what, const char* where) {
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("CUDA error: ") + what + " failed (" + where + "): " + cudaGetErrorString(e) +
                           " (" + cudaGetErrorName(e) + ")");
}
inline void check_cuda(cudaError_t e, const char* what, const char* where) {
  if (e != cudaSuccess) throw_cuda(e, what, where);
}

}  // namespace shardtrain::cuda_detail

#define ST_CUDA_STR2(x) #x
#define ST_CUDA_STR(x) ST_CUDA_STR2(x)
// The location of the call, as a string literal: "src/backend/cuda/cuda_backend.cu:123".
#define ST_CUDA_HERE __FILE__ ":" ST_CUDA_STR(__LINE__)
