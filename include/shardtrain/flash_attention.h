// Tiled causal attention: the FlashAttention-2 algorithm (Tri Dao 2023, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning", Algorithms 1 and 2), the one
// description that the CPU backend (cpu_backend.cpp) and the CUDA backend (cuda_backend.cu) both
// implement. The [T, T] probability matrix is never stored: the forward keeps only the per-row
// log-sum-exp, and the backward recomputes the probabilities tile by tile from it.
//
// Shapes and layout (as the exact path attention_forward / attention_backward in llama.cpp):
//   q, y, dq, dy  [B*T, NH*HD]   (row b*T + t, query head h at columns [h*HD, (h+1)*HD))
//   k, v, dk, dv  [B*T, NKV*HD]  query head h reads key/value head h / G, G = NH / NKV
//   lse, dsum     [B, NH, T]     (arithmetic type S: float for float and bf16 storage)
// Causal: query t sees keys s <= t. Scores x[t, s] = scale * (q_t . k_s), scale = 1/sqrt(HD).
// Tiles: query rows in tiles of kBr, key rows in tiles of kBc (last tiles may be partial).
//
// Forward (Algorithm 1), for every (b, h, query tile i) independently, rows t in the tile:
//   m_t = -inf, l_t = 0, acc_t = 0                          (running max, running sum, [HD] acc)
//   for key tiles j = 0 .. the tile holding the tile's last row (the diagonal):
//     x[t, s] = scale * q_t . k_s  for s in tile j, s <= t   (masked entries drop out: p = 0)
//     m_new = max(m_t, max_s x[t, s]);  alpha = exp(m_t - m_new)           (online_max/rescale)
//     p[t, s] = exp(x[t, s] - m_new);  l_t = alpha l_t + sum_s p[t, s]     (prob)
//     acc_t = alpha acc_t + sum_s p[t, s] v_s;  m_t = m_new
//   y_t = acc_t / l_t;  lse_t = m_t + log l_t                              (finish_*)
// Every row's first key tile holds key 0 <= t, so m_t is finite after the first tile.
//
// Backward (Algorithm 2, but deterministic without atomics: dQ and dK/dV in two passes, each output
// row owned by one work item; P is recomputed in both):
//   D_t = dy_t . y_t  (= rowsum(dP o P), the softmax-backward dot)         (row_dot) -> dsum
//   pass 1, for every (b, h, query tile i), rows t: dq_t = 0;
//     for key tiles j = 0 .. diagonal, s in tile j, s <= t:
//       p = exp(x[t, s] - lse_t)  (prob_from_lse);  dp = dy_t . v_s;
//       ds = scale p (dp - D_t)  (dscore);  dq_t += ds k_s
//   pass 2, for every (b, key/value head j, key tile c), rows s: dk_s = dv_s = 0;
//     for the G query heads h = j*G + g of the group, g = 0 .. G-1, in order, and
//     for query tiles i from the one holding the tile's first key (the diagonal) to the last,
//     t in tile i, t >= s:  p, dp, ds as in pass 1;  dv_s += p dy_t;  dk_s += ds q_t
// dq, dk, dv are written (=). Pass 2 recomputes the scores and dP that pass 1 computed (7 tile
// products per (query tile, key tile) pair instead of FlashAttention-2's 5, which adds dQ with
// atomics); in exchange each result is produced by one work item in a fixed order, so it is
// bitwise reproducible (on the CPU at any thread count).
//
// The per-row math below is ST_HD (host and device) and used by both backends, so the CPU tests
// (float, double) cover the arithmetic the GPU kernels run. exp is math::st_exp: fast_expf in
// float, as the exact causal softmax, so the two attention paths agree to rounding.
#pragma once

#include <cmath>

#include "shardtrain/bf16.h"
#include "shardtrain/ops_math.h"

namespace shardtrain::flash {

constexpr int kBr = 64;  // query rows per tile
constexpr int kBc = 64;  // key rows per tile

// Number of tiles of `tile` rows covering n rows.
ST_HD int num_tiles(int n, int tile) { return (n + tile - 1) / tile; }

// a * b rounded on its own (never fused into a following add by nvcc; g++ -std=c++20 does not
// contract), so a score is the same value wherever it is formed.
ST_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ST_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
ST_HD float st_log(float x) { return logf(x); }
ST_HD double st_log(double x) { return log(x); }

// Scaled score of one (query, key) pair, given the dot product q_t . k_s.
template <typename S> ST_HD S score(S dot, S scale) { return mul_rn(dot, scale); }

// Online softmax: the new running max after a tile whose largest (unmasked) score is tile_max.
template <typename S> ST_HD S online_max(S m, S tile_max) { return tile_max > m ? tile_max : m; }
// Factor the running sum and accumulator are multiplied by when the max moves from m to m_new
// (0 before the first tile, m = -inf: nothing is accumulated yet).
template <typename S> ST_HD S online_rescale(S m, S m_new) { return m == -INFINITY ? S(0) : math::st_exp(m - m_new); }
// Unnormalized probability of score x under running max m (forward).
template <typename S> ST_HD S prob(S x, S m) { return math::st_exp(x - m); }
// Normalization at the end of the forward: y = acc * finish_inv(l), lse = finish_lse(m, l).
template <typename S> ST_HD S finish_inv(S l) { return S(1) / l; }
template <typename S> ST_HD S finish_lse(S m, S l) { return m + st_log(l); }
// Probability recomputed in the backward from the forward's log-sum-exp.
template <typename S> ST_HD S prob_from_lse(S x, S lse) { return math::st_exp(x - lse); }
// Gradient of the unscaled dot q_t . k_s: ds = scale * p * (dp - D) (math::softmax_grad).
template <typename S> ST_HD S dscore(S p, S dp, S D, S scale) { return math::softmax_grad(p, dp, D, scale); }
// D_t = sum_d dy[d] * y[d] over one row of HD stored elements, in order, in Acc<T>.
template <typename T> ST_HD math::Acc<T> row_dot(const T* dy, const T* y, int HD) {
  math::Acc<T> s = 0;
  for (int d = 0; d < HD; ++d) s += math::ld(dy[d]) * math::ld(y[d]);
  return s;
}

}  // namespace shardtrain::flash
