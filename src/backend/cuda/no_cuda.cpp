// Stand-ins for the CUDA layer in builds without nvcc (see include/shardtrain/cuda.h and the
// Makefile): the binary links and runs on the CPU, and asking for CUDA fails with a clear message.
#include <stdexcept>

#include "shardtrain/cuda.h"

namespace shardtrain {
namespace {
[[noreturn]] void no_cuda() {
  throw std::runtime_error("built without CUDA: this shardtrain was compiled on a machine without nvcc; rebuild with "
                           "the CUDA toolkit installed, or use '--device cpu'");
}
}  // namespace

bool cuda_built() { return false; }
int cuda_runtime_device_count(std::string* why) {
  if (why) *why = "built without CUDA";
  return 0;
}
std::string cuda_runtime_device_uuid(int) { no_cuda(); }
std::unique_ptr<CudaContext> CudaContext::create(int) { no_cuda(); }
template <typename T> std::unique_ptr<Backend<T>> make_cuda_backend(CudaContext&) { no_cuda(); }
template std::unique_ptr<Backend<float>> make_cuda_backend<float>(CudaContext&);
template std::unique_ptr<Backend<bf16>> make_cuda_backend<bf16>(CudaContext&);
std::unique_ptr<Comm> make_nccl_comm(Comm&, CudaContext&) { no_cuda(); }
std::unique_ptr<Comm> make_staged_comm(Comm&, CudaContext&) { no_cuda(); }

}  // namespace shardtrain
