// CPU backend: rotary position embedding (RoPE), forward and backward, at positions 0..T-1 of each
// sequence or at given positions (the _at variants); rows side by side. The per-pair rotation
// (rope_rotate, rope_rotate_backward) is in include/shardtrain/backend/ops_math.h; the class and
// its threading rules are in cpu_backend.h.
#include "cpu_backend.h"

namespace shardtrain::cpu {

template <typename T>
void CpuBackend<T>::rope_forward(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD) {
  rope_apply(x, cs, sn, B, T_, H, HD, false);
}
template <typename T>
void CpuBackend<T>::rope_backward(T* dx, const T* cs, const T* sn, int B, int T_, int H, int HD) {
  rope_apply(dx, cs, sn, B, T_, H, HD, true);
}

template <typename T>
void CpuBackend<T>::rope_forward_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD) {
  rope_apply_at(x, cs, sn, pos, N, H, HD, false);
}
template <typename T>
void CpuBackend<T>::rope_backward_at(T* dx, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD) {
  rope_apply_at(dx, cs, sn, pos, N, H, HD, true);
}

// x [N, H, HD] rotated in place, row bt at RoPE table row row_pos(bt) (cs, sn [*, HD / 2]).
template <typename T>
template <typename RowPos>
void CpuBackend<T>::rope_rows(T* x, const T* cs, const T* sn, size_t N, RowPos&& row_pos, int H, int HD,
                              bool backward) {
  const int half = HD / 2;
  par_ranges(N, row_grain(static_cast<size_t>(H) * HD), [&](size_t rb, size_t re) {
    for (size_t bt = rb; bt < re; ++bt) {
      const size_t t = row_pos(bt);
      const T* c = cs + t * half;
      const T* s = sn + t * half;
      for (int h = 0; h < H; ++h) {
        T* v = x + (bt * H + h) * HD;
        for (int j = 0; j < half; ++j) {
          A o1, o2;
          if (backward) math::rope_rotate_backward(math::ld(v[j]), math::ld(v[j + half]), math::ld(c[j]), math::ld(s[j]), &o1, &o2);
          else math::rope_rotate(math::ld(v[j]), math::ld(v[j + half]), math::ld(c[j]), math::ld(s[j]), &o1, &o2);
          v[j] = math::st<T>(o1);
          v[j + half] = math::st<T>(o2);
        }
      }
    }
  });
}
// rope_apply with row i at table row pos[i] (the same per-pair math).
template <typename T>
void CpuBackend<T>::rope_apply_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD,
                                  bool backward) {
  rope_rows(x, cs, sn, static_cast<size_t>(N), [pos](size_t bt) { return static_cast<size_t>(pos[bt]); }, H, HD,
            backward);
}
template <typename T>
void CpuBackend<T>::rope_apply(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
  rope_rows(x, cs, sn, static_cast<size_t>(B) * T_, [T_](size_t bt) { return bt % static_cast<size_t>(T_); }, H, HD,
            backward);
}

#define ST_CPU_ROPE(T)                                                                                               \
  template void CpuBackend<T>::rope_forward(T*, const T*, const T*, int, int, int, int);                           \
  template void CpuBackend<T>::rope_backward(T*, const T*, const T*, int, int, int, int);                          \
  template void CpuBackend<T>::rope_forward_at(T*, const T*, const T*, const int32_t*, int, int, int);             \
  template void CpuBackend<T>::rope_backward_at(T*, const T*, const T*, const int32_t*, int, int, int);
ST_CPU_ROPE(float)
ST_CPU_ROPE(double)
ST_CPU_ROPE(bf16)
#undef ST_CPU_ROPE

}  // namespace shardtrain::cpu
