// CPU backend: RMSNorm, forward (rows side by side) and backward (dx by rows, dw by column ranges
// with the rows added in order). The per-row math (rmsnorm_rstd, rmsnorm_k, rmsnorm_dx) is in
// include/shardtrain/backend/ops_math.h; the class and its threading rules are in cpu_backend.h.
#include <type_traits>
#include <vector>

#include "cpu_backend.h"

namespace shardtrain::cpu {

template <typename T>
void CpuBackend<T>::rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) {
  par_ranges(static_cast<size_t>(N), row_grain(C), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const T* xi = x + i * C;
      T* oi = out + i * C;
      A ss = 0;
      for (int c = 0; c < C; ++c) ss += math::ld(xi[c]) * math::ld(xi[c]);
      A r = math::rmsnorm_rstd(ss, C, eps);
      for (int c = 0; c < C; ++c) oi[c] = math::st<T>(math::ld(xi[c]) * r * math::ld(w[c]));
      rstd[i] = math::st<T>(r);
    }
  });
}
// y = x r w, r = (mean(x^2)+eps)^-1/2.  dx = r (w*dy) - x r^3 / C * sum(w*dy*x).
// dx: rows side by side. dw: column ranges side by side, rows added in order.
template <typename T>
void CpuBackend<T>::rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N,
                                     int C) {
  par_ranges(static_cast<size_t>(N), row_grain(C), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const T* xi = x + i * C;
      const T* di = dout + i * C;
      T* dxi = dx + i * C;
      A r = math::ld(rstd[i]);
      A dot = 0;
      for (int c = 0; c < C; ++c) dot += math::ld(w[c]) * math::ld(di[c]) * math::ld(xi[c]);
      A k = math::rmsnorm_k(dot, r, C);
      for (int c = 0; c < C; ++c)
        dxi[c] = math::st<T>(math::ld(dxi[c]) + math::rmsnorm_dx(r, math::ld(w[c]), math::ld(di[c]), k, math::ld(xi[c])));
    }
  });
  par_ranges(static_cast<size_t>(C), col_grain(N), [&](size_t cb, size_t ce) {
    const size_t nc = ce - cb;
    // float/double: dw[c] += row terms, in row order. bf16: the rows' sum in float, added once.
    std::vector<A> acc(nc, A(0));
    if constexpr (std::is_same_v<T, A>)
      for (size_t c = 0; c < nc; ++c) acc[c] = dw[cb + c];
    for (int i = 0; i < N; ++i) {
      const T* xi = x + static_cast<size_t>(i) * C + cb;
      const T* di = dout + static_cast<size_t>(i) * C + cb;
      const A r = math::ld(rstd[i]);
      if constexpr (std::is_same_v<T, A>)
        for (size_t c = 0; c < nc; ++c) acc[c] += di[c] * xi[c] * r;
      else
        for (size_t c = 0; c < nc; ++c) acc[c] += math::ld(di[c]) * math::ld(xi[c]) * r;
    }
    for (size_t c = 0; c < nc; ++c)
      dw[cb + c] = std::is_same_v<T, A> ? math::st<T>(acc[c]) : math::st<T>(math::ld(dw[cb + c]) + acc[c]);
  });
}

#define ST_CPU_NORM(T)                                                                                               \
  template void CpuBackend<T>::rmsnorm_forward(T*, T*, const T*, const T*, int, int, CpuBackend<T>::S);            \
  template void CpuBackend<T>::rmsnorm_backward(T*, T*, const T*, const T*, const T*, const T*, int, int);
ST_CPU_NORM(float)
ST_CPU_NORM(double)
ST_CPU_NORM(bf16)
#undef ST_CPU_NORM

}  // namespace shardtrain::cpu
