// CPU backend: SwiGLU, h = silu(g) * u, forward and backward, elementwise over ranges side by side.
// The per-element math (swiglu, swiglu_backward) is in include/shardtrain/backend/ops_math.h; the
// class and its threading rules are in cpu_backend.h.
#include "cpu_backend.h"

namespace shardtrain::cpu {

template <typename T> void CpuBackend<T>::swiglu_forward(T* h, const T* g, const T* u, size_t n) {
  par_ranges(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) h[i] = math::st<T>(math::swiglu(math::ld(g[i]), math::ld(u[i])));
  });
}
template <typename T>
void CpuBackend<T>::swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) {
  par_ranges(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      A a, c;
      math::swiglu_backward(math::ld(g[i]), math::ld(u[i]), math::ld(dh[i]), &a, &c);
      dg[i] = math::st<T>(a);
      du[i] = math::st<T>(c);
    }
  });
}

#define ST_CPU_SWIGLU(T)                                                                                             \
  template void CpuBackend<T>::swiglu_forward(T*, const T*, const T*, size_t);                                     \
  template void CpuBackend<T>::swiglu_backward(T*, T*, const T*, const T*, const T*, size_t);
ST_CPU_SWIGLU(float)
ST_CPU_SWIGLU(double)
ST_CPU_SWIGLU(bf16)
#undef ST_CPU_SWIGLU

}  // namespace shardtrain::cpu
