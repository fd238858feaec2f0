// The CUDA backend's core: the CudaContext (device, stream, cuBLAS handle), CudaBackend<T>'s
// construction, memory and transfers, the copy stream of to_host_async, the reduction scratch and
// the device sum of doubles that the loss and the gradient norm end with, and the plugin's entry
// points (plugin.cu). The operations are in the files that cuda_backend.h lists.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/cuda.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"
#include "plugin_abi.h"

namespace shardtrain {
namespace {

// out[0] = sum of in[0..n) in double (accumulate: out[0] += that sum). One block.
__global__ void sum_doubles_kernel(const double* in, size_t n, double* out, bool accumulate = false) {
  double s = 0;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
  s = block_reduce(s, SumOp{});
  if (threadIdx.x == 0) out[0] = accumulate ? out[0] + s : s;
}

// ---- context ----------------------------------------------------------------------------------

class CudaContextImpl final : public CudaContext {
 public:
  explicit CudaContextImpl(int dev) : device_(dev) {}
  ~CudaContextImpl() override {
    if (handle_) (void)cublasDestroy(handle_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  CudaContextImpl(const CudaContextImpl&) = delete;
  CudaContextImpl& operator=(const CudaContextImpl&) = delete;

  void init() {
    ST_CUDA(cudaSetDevice(device_));
    cudaDeviceProp prop{};
    ST_CUDA(cudaGetDeviceProperties(&prop, device_));
    name_ = prop.name;
    ST_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ST_CUBLAS(cublasCreate(&handle_));
    ST_CUBLAS(cublasSetStream(handle_, stream_));
    ST_CUBLAS(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
    // Math mode stays CUBLAS_DEFAULT_MATH: no TF32 (the GEMMs ask for CUBLAS_COMPUTE_32F).
  }

  int device() const override { return device_; }
  std::string device_name() const override { return name_; }
  void* stream() const override { return static_cast<void*>(stream_); }
  void* cublas() const override { return static_cast<void*>(handle_); }
  size_t free_bytes() const override {
    size_t free_b = 0, total_b = 0;
    ST_CUDA(cudaMemGetInfo(&free_b, &total_b));
    return free_b;
  }

 private:
  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace

namespace cuda_detail {

template <typename T>
CudaBackend<T>::CudaBackend(CudaContext& ctx)
    : stream_(static_cast<cudaStream_t>(ctx.stream())), handle_(static_cast<cublasHandle_t>(ctx.cublas())) {}
template <typename T>
CudaBackend<T>::~CudaBackend() {
  release(scratch_);
  release(loss_sum_);
  release(skip_);
  if (copy_stream_) {
    (void)cudaStreamSynchronize(copy_stream_);
    (void)cudaStreamDestroy(copy_stream_);
  }
  if (compute_done_) (void)cudaEventDestroy(compute_done_);
  if (lt_) (void)cublasLtDestroy(lt_);
}

// ---- memory ----
template <typename T>
T* CudaBackend<T>::alloc(size_t n) { return static_cast<T*>(alloc_bytes(n * sizeof(T))); }
template <typename T>
void CudaBackend<T>::free(T* p) { release(p); }
template <typename T>
void CudaBackend<T>::zero(T* p, size_t n) {
  if (n) ST_CUDA(cudaMemsetAsync(p, 0, n * sizeof(T), stream_));
}
template <typename T>
void CudaBackend<T>::copy(T* dst, const T* src, size_t n) {
  if (n && dst != src) ST_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToDevice, stream_));
}
template <typename T>
void CudaBackend<T>::to_host(T* host, const T* src, size_t n) {
  if (!n) return;
  ST_CUDA(cudaMemcpyAsync(host, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));
}
template <typename T>
void CudaBackend<T>::from_host(T* dst, const T* host, size_t n) {
  if (!n) return;
  ST_CUDA(cudaMemcpyAsync(dst, host, n * sizeof(T), cudaMemcpyHostToDevice, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));  // the host buffer may be freed right after
}
template <typename T>
int32_t* CudaBackend<T>::alloc_ids(size_t n) { return static_cast<int32_t*>(alloc_bytes(n * sizeof(int32_t))); }
template <typename T>
void CudaBackend<T>::free_ids(int32_t* p) { release(p); }
template <typename T>
void CudaBackend<T>::ids_from_host(int32_t* dst, const int32_t* host, size_t n) {
  if (!n) return;
  ST_CUDA(cudaMemcpyAsync(dst, host, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));
}
template <typename T>
typename CudaBackend<T>::S* CudaBackend<T>::alloc_acc(size_t n) { return static_cast<S*>(alloc_bytes(n * sizeof(S))); }
template <typename T>
void CudaBackend<T>::free_acc(S* p) { release(p); }
template <typename T>
void CudaBackend<T>::copy_2d(T* dst, size_t ldd, const T* src, size_t lds, size_t rows, size_t cols) {
  if (rows && cols)
    ST_CUDA(cudaMemcpy2DAsync(dst, ldd * sizeof(T), src, lds * sizeof(T), cols * sizeof(T), rows,
                              cudaMemcpyDeviceToDevice, stream_));
}
template <typename T>
void CudaBackend<T>::zero_acc(S* p, size_t n) {
  if (n) ST_CUDA(cudaMemsetAsync(p, 0, n * sizeof(S), stream_));
}
template <typename T>
void CudaBackend<T>::synchronize() { ST_CUDA(cudaStreamSynchronize(stream_)); }

// ---- staging to the host: pinned memory, the copy stream ----
template <typename T>
void* CudaBackend<T>::alloc_pinned_host(size_t bytes) {
  void* p = nullptr;
  ST_CUDA_ALLOC(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault));
  return p;
}
template <typename T>
void CudaBackend<T>::free_pinned_host(void* p) noexcept {
  if (!p) return;
  cudaError_t e = copy_stream_ ? cudaStreamSynchronize(copy_stream_) : cudaSuccess;  // copies into p
  cudaError_t f = cudaFreeHost(p);
  if (e == cudaSuccess) e = f;
  if (e != cudaSuccess) warn_free(e);
}
// The copy stream (non-blocking: no implicit order with the legacy default stream) waits for an
// event recorded on the compute stream now, so the copy reads what every call queued so far
// wrote, and the compute stream goes on without waiting for the copy.
template <typename T>
void CudaBackend<T>::to_host_async(T* host, const T* src, size_t n) {
  if (n == 0) return;
  if (!copy_stream_) {
    ST_CUDA(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    ST_CUDA(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
  }
  ST_CUDA(cudaEventRecord(compute_done_, stream_));
  ST_CUDA(cudaStreamWaitEvent(copy_stream_, compute_done_, 0));
  ST_CUDA(cudaMemcpyAsync(host, src, n * sizeof(T), cudaMemcpyDeviceToHost, copy_stream_));
}
template <typename T>
void CudaBackend<T>::wait_host_copies() {
  if (copy_stream_) ST_CUDA(cudaStreamSynchronize(copy_stream_));
}

template <typename T>
void CudaBackend<T>::note_once(const std::string& msg) {
  // At most 8 distinct notes per backend (reasons may name shapes, and block attention meets many).
  constexpr size_t kMaxNotes = 8;
  if (noted_.size() > kMaxNotes || !noted_.insert(msg).second) return;
  if (noted_.size() > kMaxNotes) std::fprintf(stderr, "shardtrain: note: further notes of this backend are not shown\n");
  else std::fprintf(stderr, "shardtrain: note: %s\n", msg.c_str());
}

template <typename T>
void* CudaBackend<T>::alloc_bytes(size_t bytes) {
  if (bytes == 0) bytes = 1;
  void* p = nullptr;
  ST_CUDA_ALLOC(cudaMalloc(&p, bytes));
  try {
    ST_CUDA(cudaMemsetAsync(p, 0, bytes, stream_));
    ST_CUDA(cudaStreamSynchronize(stream_));
  } catch (...) {
    (void)cudaFree(p);
    throw;
  }
  return p;
}
template <typename T>
void CudaBackend<T>::release(void* p) noexcept {
  if (!p) return;
  cudaError_t e = cudaStreamSynchronize(stream_);
  cudaError_t f = cudaFree(p);
  if (e == cudaSuccess) e = f;
  if (e != cudaSuccess) warn_free(e);
}
template <typename T>
void CudaBackend<T>::warn_free(cudaError_t e) noexcept {
  (void)cudaGetLastError();
  if (!warned_free_) {
    warned_free_ = true;
    std::fprintf(stderr, "shardtrain: warning: CUDA free failed: %s\n", cudaGetErrorString(e));
  }
}
template <typename T>
void* CudaBackend<T>::scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    release(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    size_t want = std::max<size_t>(bytes, 1 << 16);
    scratch_ = alloc_bytes(want);
    scratch_bytes_ = want;
  }
  return scratch_;
}

template <typename T>
void CudaBackend<T>::sum_doubles(const double* in, size_t n, double* out, bool accumulate) {
  sum_doubles_kernel<<<1, kRowBlockLarge, 0, stream_>>>(in, n, out, accumulate);
  ST_LAUNCHED("sum_doubles_kernel");
}
template <typename T>
double CudaBackend<T>::sum_to_host(const double* in, size_t n, double* out) {
  sum_doubles_kernel<<<1, kRowBlockLarge, 0, stream_>>>(in, n, out);
  ST_LAUNCHED("sum_doubles_kernel");
  double h = 0;
  ST_CUDA(cudaMemcpyAsync(&h, out, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  ST_CUDA(cudaStreamSynchronize(stream_));
  return h;
}

// The members defined here, for both storage types; each operation file instantiates its own. Not
// `template class CudaBackend<T>`: nvcc's front end takes that for a second instantiation of every
// member where the files are compiled as one translation unit (the Makefile's unity groups).
#define ST_INSTANTIATE(T) \
  template CudaBackend<T>::CudaBackend(CudaContext&); \
  template CudaBackend<T>::~CudaBackend(); \
  template T* CudaBackend<T>::alloc(size_t); \
  template void CudaBackend<T>::free(T*); \
  template void CudaBackend<T>::zero(T*, size_t); \
  template void CudaBackend<T>::copy(T*, const T*, size_t); \
  template void CudaBackend<T>::to_host(T*, const T*, size_t); \
  template void CudaBackend<T>::from_host(T*, const T*, size_t); \
  template int32_t* CudaBackend<T>::alloc_ids(size_t); \
  template void CudaBackend<T>::free_ids(int32_t*); \
  template void CudaBackend<T>::ids_from_host(int32_t*, const int32_t*, size_t); \
  template typename CudaBackend<T>::S* CudaBackend<T>::alloc_acc(size_t); \
  template void CudaBackend<T>::free_acc(typename CudaBackend<T>::S*); \
  template void CudaBackend<T>::copy_2d(T*, size_t, const T*, size_t, size_t, size_t); \
  template void CudaBackend<T>::zero_acc(typename CudaBackend<T>::S*, size_t); \
  template void CudaBackend<T>::synchronize(); \
  template void* CudaBackend<T>::alloc_pinned_host(size_t); \
  template void CudaBackend<T>::free_pinned_host(void*) noexcept; \
  template void CudaBackend<T>::to_host_async(T*, const T*, size_t); \
  template void CudaBackend<T>::wait_host_copies(); \
  template void CudaBackend<T>::note_once(const std::string&); \
  template void* CudaBackend<T>::alloc_bytes(size_t); \
  template void CudaBackend<T>::release(void*) noexcept; \
  template void CudaBackend<T>::warn_free(cudaError_t) noexcept; \
  template void* CudaBackend<T>::scratch(size_t); \
  template void CudaBackend<T>::sum_doubles(const double*, size_t, double*, bool); \
  template double CudaBackend<T>::sum_to_host(const double*, size_t, double*);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail

// ---- entry points (the plugin's table, plugin.cu) ---------------------------------------------

namespace cuda_impl {

int device_count(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = cudaGetErrorString(e);
    return 0;
  }
  if (n == 0 && why) *why = "cudaGetDeviceCount found no CUDA device";
  return n;
}

std::unique_ptr<CudaContext> create_context(int device) {
  auto ctx = std::make_unique<CudaContextImpl>(device);
  try {
    ctx->init();
  } catch (const std::exception& e) {
    throw std::runtime_error("CUDA device " + std::to_string(device) + ": " + e.what());
  }
  return ctx;
}

template <typename T> std::unique_ptr<Backend<T>> make_backend(CudaContext& ctx) {
  return std::make_unique<cuda_detail::CudaBackend<T>>(ctx);
}
template std::unique_ptr<Backend<float>> make_backend<float>(CudaContext&);
template std::unique_ptr<Backend<bf16>> make_backend<bf16>(CudaContext&);

}  // namespace cuda_impl
}  // namespace shardtrain
