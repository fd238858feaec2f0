// CPU backend: the class's construction (thread preparation: FTZ/DAZ, OpenBLAS at one thread), its
// buffers (alloc, zero, copies: plain host memory), make_cpu_backend and the thread-count
// functions of backend.h. The class, the files that define its other methods, and the threading
// rules all of them follow are described in cpu_backend.h; the per-element math of the kernels
// lives in include/shardtrain/backend/ops_math.h and flash_attention.h.
#include "cpu_backend.h"

#include <cblas.h>
#include <omp.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/mman.h>

namespace shardtrain {
namespace cpu {
namespace {

// Denormals (|x| < 1.2e-38 in float) are flushed to zero on the backend's threads: MXCSR's FTZ
// (results) and DAZ (inputs) bits. A denormal operand costs a ~100-cycle microcode assist per
// instruction on x86; they arise from softmax/sigmoid tails, tiny AdamW moments, and even from
// code GCC generates for fast_expf's clamped branch (SwiGLU ran 10x slower on normal inputs).
// TensorFlow flushes on its CPU threads too; results differ only where a value is below 1.2e-38.
// MXCSR is per thread: set on the calling thread and on every thread of the OpenMP pool.
// Also sets OpenBLAS to one thread: the backend calls it from its own threads, one call per tile
// (a threaded OpenBLAS inside them would oversubscribe the cores). Run by every backend's
// constructor and by set_cpu_threads, so every mode (train, export, generate, tests) gets both.
void prepare_threads() {
  openblas_set_num_threads(1);
#if defined(__SSE__)
  auto set = [] { _mm_setcsr(_mm_getcsr() | 0x8040); };  // FTZ (bit 15) | DAZ (bit 6)
  set();
#pragma omp parallel
  set();
#endif
}

}  // namespace

template <typename T> CpuBackend<T>::CpuBackend() { prepare_threads(); }

template <typename T> T* CpuBackend<T>::alloc(size_t n) { return static_cast<T*>(aligned_zeroed(n * sizeof(T))); }
template <typename T> void CpuBackend<T>::free(T* p) { aligned_free(p); }
template <typename T> void CpuBackend<T>::zero(T* p, size_t n) {
  par_ranges(n, 16 * kGrain, [&](size_t b, size_t e) { std::memset(p + b, 0, (e - b) * sizeof(T)); });
}
template <typename T> void CpuBackend<T>::copy(T* d, const T* s, size_t n) {
  if (n == 0 || d == s) return;
  if (d + n <= s || s + n <= d)  // disjoint: pieces may run side by side
    par_ranges(n, 16 * kGrain, [&](size_t b, size_t e) { std::memcpy(d + b, s + b, (e - b) * sizeof(T)); });
  else
    std::memmove(d, s, n * sizeof(T));
}
template <typename T> void CpuBackend<T>::to_host(T* h, const T* s, size_t n) { copy(h, s, n); }
template <typename T> void CpuBackend<T>::from_host(T* d, const T* h, size_t n) { copy(d, h, n); }
template <typename T> int32_t* CpuBackend<T>::alloc_ids(size_t n) {
  return static_cast<int32_t*>(aligned_zeroed(n * sizeof(int32_t)));
}
template <typename T> void CpuBackend<T>::free_ids(int32_t* p) { aligned_free(p); }
template <typename T> void CpuBackend<T>::ids_from_host(int32_t* d, const int32_t* h, size_t n) {
  if (n) std::memmove(d, h, n * sizeof(int32_t));
}
template <typename T> auto CpuBackend<T>::alloc_acc(size_t n) -> S* {
  return static_cast<S*>(aligned_zeroed(n * sizeof(S)));
}
template <typename T> void CpuBackend<T>::free_acc(S* p) { aligned_free(p); }
template <typename T> void CpuBackend<T>::copy_2d(T* d, size_t ldd, const T* s, size_t lds, size_t rows, size_t cols) {
  if (rows == 0 || cols == 0) return;
  par_ranges(rows, std::max<size_t>(1, 16 * kGrain / cols), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) std::memcpy(d + i * ldd, s + i * lds, cols * sizeof(T));
  });
}
template <typename T> void CpuBackend<T>::zero_acc(S* p, size_t n) {
  par_ranges(n, 16 * kGrain, [&](size_t b, size_t e) { std::memset(p + b, 0, (e - b) * sizeof(S)); });
}

// Buffers of 1 MiB or more are mapped pages of their own (mmap), returned to the system when
// freed; smaller ones come from malloc. Freeing a large malloc'ed block would raise glibc's
// dynamic mmap threshold to its size, after which blocks up to that size come from the heap, whose
// holes stay resident: a buffer replaced by a larger one (expert parallelism's grow-only expert
// rows) then kept the process's peak memory tens of MiB above the plan (docs/moe.md). A 64-byte
// header before each buffer records how it was obtained.
namespace {
constexpr size_t kAllocHeader = 64, kMapFrom = size_t{1} << 20;
constexpr uint64_t kAllocMagic = 0x7368617264616c63ULL;  // "shardalc"
struct AllocHeader {
  uint64_t magic, bytes, mapped;
};
}  // namespace

template <typename T> void* CpuBackend<T>::aligned_zeroed(size_t bytes) {
  bytes = std::max<size_t>(64, ((bytes + 63) / 64) * 64);
  const size_t total = bytes + kAllocHeader;
  const bool mapped = total >= kMapFrom;
  char* base = nullptr;
  if (mapped) {
    void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    base = static_cast<char*>(m);
  } else {
    base = static_cast<char*>(std::aligned_alloc(64, total));
    if (!base) throw std::bad_alloc();
  }
  const AllocHeader h{kAllocMagic, bytes, mapped ? 1u : 0u};
  std::memcpy(base, &h, sizeof h);
  std::memset(base + kAllocHeader, 0, bytes);  // touched: resident, as the memory plan counts it
  return base + kAllocHeader;
}

template <typename T> void CpuBackend<T>::aligned_free(void* p) {
  if (!p) return;
  char* base = static_cast<char*>(p) - kAllocHeader;
  AllocHeader h;
  std::memcpy(&h, base, sizeof h);
  if (h.magic != kAllocMagic) std::abort();  // not this backend's buffer: memory is corrupt
  if (h.mapped)
    munmap(base, h.bytes + kAllocHeader);
  else
    std::free(base);
}

// The class for the three element types: the members defined so far (this file's and the header's
// inline ones) and the vtable; the other files instantiate their methods.
template class CpuBackend<float>;
template class CpuBackend<double>;
template class CpuBackend<bf16>;

}  // namespace cpu

template <typename T> std::unique_ptr<Backend<T>> make_cpu_backend() { return std::make_unique<cpu::CpuBackend<T>>(); }
template std::unique_ptr<Backend<float>> make_cpu_backend<float>();
template std::unique_ptr<Backend<double>> make_cpu_backend<double>();
template std::unique_ptr<Backend<bf16>> make_cpu_backend<bf16>();

void prepare_cpu_helper_thread() {
  omp_set_num_threads(1);
#if defined(__SSE__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ, as prepare_threads()
#endif
}

void set_cpu_threads(int n) {
  if (n <= 0) return;
  omp_set_num_threads(n);
  cpu::prepare_threads();  // the threads a new pool size starts get FTZ/DAZ too
}

int cpu_threads() { return omp_get_max_threads(); }

}  // namespace shardtrain
