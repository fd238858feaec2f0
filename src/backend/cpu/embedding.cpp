// CPU backend: the token embedding, forward (row copies; a negative token, another rank's row of a
// vocabulary-parallel embedding, gives zeros) and backward (rows added into the table's gradient,
// column ranges side by side, positions in order). Loads and stores are math::ld / math::st of
// include/shardtrain/backend/ops_math.h; the class and its threading rules are in cpu_backend.h.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cpu_backend.h"

namespace shardtrain::cpu {

template <typename T> void CpuBackend<T>::embedding_forward(T* out, const int32_t* tok, const T* table, int N, int C) {
  par_ranges(static_cast<size_t>(N), row_grain(C), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i)
      if (tok[i] < 0)
        std::memset(out + i * C, 0, C * sizeof(T));
      else
        std::memcpy(out + i * C, table + static_cast<size_t>(tok[i]) * C, C * sizeof(T));
  });
}
// Column ranges side by side; within a column, positions are added in order 0..N-1.
template <typename T>
void CpuBackend<T>::embedding_backward(T* dtable, const int32_t* tok, const T* dout, int N, int C) {
  if constexpr (!std::is_same_v<T, A>) {  // bf16: sum each token's rows in float, round once
    order_.resize(static_cast<size_t>(N));
    for (int i = 0; i < N; ++i) order_[static_cast<size_t>(i)] = i;
    std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) { return tok[a] < tok[b]; });
    row_.resize(static_cast<size_t>(C));
    for (size_t g = 0; g < order_.size();) {
      const int32_t t = tok[order_[g]];
      if (t < 0) {  // another rank's rows (vocabulary-parallel embedding): sorted first, skipped
        ++g;
        continue;
      }
      T* row = dtable + static_cast<size_t>(t) * C;
      for (int c = 0; c < C; ++c) row_[static_cast<size_t>(c)] = math::ld(row[c]);
      for (; g < order_.size() && tok[order_[g]] == t; ++g) {
        const T* d = dout + static_cast<size_t>(order_[g]) * C;
        for (int c = 0; c < C; ++c) row_[static_cast<size_t>(c)] += math::ld(d[c]);
      }
      for (int c = 0; c < C; ++c) row[c] = math::st<T>(row_[static_cast<size_t>(c)]);
    }
  } else {
    par_ranges(static_cast<size_t>(C), col_grain(N), [&](size_t cb, size_t ce) {
      for (int i = 0; i < N; ++i) {
        if (tok[i] < 0) continue;  // another rank's rows (vocabulary-parallel embedding)
        T* row = dtable + static_cast<size_t>(tok[i]) * C;
        const T* d = dout + static_cast<size_t>(i) * C;
        for (size_t c = cb; c < ce; ++c) row[c] += d[c];
      }
    });
  }
}

#define ST_CPU_EMBEDDING(T)                                                                                          \
  template void CpuBackend<T>::embedding_forward(T*, const int32_t*, const T*, int, int);                          \
  template void CpuBackend<T>::embedding_backward(T*, const int32_t*, const T*, int, int);
ST_CPU_EMBEDDING(float)
ST_CPU_EMBEDDING(double)
ST_CPU_EMBEDDING(bf16)
#undef ST_CPU_EMBEDDING

}  // namespace shardtrain::cpu
