// CPU backend: AdamW (the update math is math::adamw of include/shardtrain/backend/ops_math.h),
// the gradient norm's sum of squares (sum_squares: fixed chunks added in order), and the
// elementwise axpy (gradient sums, residual adds) and scale; ranges side by side. The class and its
// threading rules are in cpu_backend.h.
#include <algorithm>
#include <cmath>

#include "cpu_backend.h"

namespace shardtrain::cpu {
namespace {

constexpr size_t kSumChunk = 4096;  // sum_squares partials: fixed length, summed in order

}  // namespace

template <typename T> void CpuBackend<T>::axpy(size_t n, S alpha, const T* x, T* y) {
  par_ranges(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) y[i] = math::st<T>(math::ld(y[i]) + alpha * math::ld(x[i]));
  });
}

template <typename T> void CpuBackend<T>::scale(size_t n, S alpha, T* x) {
  par_ranges(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) x[i] = math::st<T>(alpha * math::ld(x[i]));
  });
}
// Partial sums over fixed chunks of kSumChunk elements, added in chunk order.
template <typename T> double CpuBackend<T>::sum_squares(const T* x, size_t n) {
  const size_t chunks = (n + kSumChunk - 1) / kSumChunk;
  part_.assign(chunks, 0.0);
  par_ranges(chunks, row_grain(kSumChunk), [&](size_t cb, size_t ce) {
    for (size_t c = cb; c < ce; ++c) {
      double s = 0;
      for (size_t i = c * kSumChunk, e = std::min(n, (c + 1) * kSumChunk); i < e; ++i) {
        const double v = static_cast<double>(math::ld(x[i]));
        s += v * v;
      }
      part_[c] = s;
    }
  });
  double s = 0;
  for (double p : part_) s += p;
  return s;
}

template <typename T>
void CpuBackend<T>::adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S gs, int64_t step) {
  A bc1 = A(1) - static_cast<A>(std::pow(static_cast<double>(b1), static_cast<double>(step)));
  A bc2 = A(1) - static_cast<A>(std::pow(static_cast<double>(b2), static_cast<double>(step)));
  par_ranges(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      A pv = math::ld(p[i]), mv = math::ld(m[i]), vv = math::ld(v[i]);
      math::adamw(&pv, &mv, &vv, math::ld(g[i]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
      p[i] = math::st<T>(pv);
      m[i] = math::st<T>(mv);
      v[i] = math::st<T>(vv);
    }
  });
}

#define ST_CPU_OPTIMIZER(T)                                                                                          \
  template void CpuBackend<T>::axpy(size_t, CpuBackend<T>::S, const T*, T*);                                       \
  template void CpuBackend<T>::scale(size_t, CpuBackend<T>::S, T*);                                                \
  template double CpuBackend<T>::sum_squares(const T*, size_t);                                                    \
  template void CpuBackend<T>::adamw(T*, T*, T*, const T*, size_t, CpuBackend<T>::S, CpuBackend<T>::S,             \
                                     CpuBackend<T>::S, CpuBackend<T>::S, CpuBackend<T>::S, CpuBackend<T>::S,       \
                                     int64_t);
ST_CPU_OPTIMIZER(float)
ST_CPU_OPTIMIZER(double)
ST_CPU_OPTIMIZER(bf16)
#undef ST_CPU_OPTIMIZER

}  // namespace shardtrain::cpu
