// Tiled causal attention: the FlashAttention-2 algorithm (Tri Dao 2023, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning", Algorithms 1 and 2), the one
// description that the CPU backend (src/backend/cpu/attention.cpp) and the CUDA backend
// (src/backend/cuda/attention.cu, flash_tiles.cuh) both implement. The [T, T] probability matrix is
// never stored: the forward keeps only the per-row
// log-sum-exp, and the backward recomputes the probabilities tile by tile from it.
//
// Shapes and layout (as the exact path attention_forward / attention_backward in
// src/model/llama_attention.cpp):
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
//
// ---- Block attention at global positions (context-parallel pieces of one attention) ----------
// One query block (Tq rows) against one key block (Tk rows) of the same sequences, each token
// carrying its global position and optionally a document id (int32, [B, Tq] / [B, Tk], one per
// token, backend memory). Query t sees key s when
//     kpos[s] <= qpos[t]  and, where document ids are given,  qdoc[t] == kdoc[s]   (visible)
// Masks come from the positions, never from tile or block indices, so blocks may be any slices of
// the sequence (a head-tail pair, positions that restart per document). A pair of tiles (query
// tile of kBr rows, key tile of kBc rows) is classified from the tiles' ranges (tile_range):
//     fully masked   kpos_min > qpos_max, or the document ranges do not overlap
//                    (kdoc_max < qdoc_min or kdoc_min > qdoc_max)     -> skipped, counted
//     otherwise      every pair tested with visible() (fully visible tiles test true everywhere)
// With positions increasing along the sequence, document ids non-decreasing (contiguous
// documents) and tiles that are contiguous runs of the sequence, the range test is exact: a pair is
// skipped iff no (query, key) in it is visible. Elsewhere (positions restarting per document, a
// tile spanning a head-tail seam) it may visit a fully masked pair, never skip a visible one.
//
// Forward: the loop of Algorithm 1 over all key tiles of the block (masked tiles skipped), ending
// with block_finish: rows that saw no key get y = 0 and lse = -inf. The block's y is normalised
// and lse = log sum_{visible s} exp(x[t, s]) over the block's keys.
// Merge (the online-softmax rule, as Ring Attention, Liu et al. 2023, combines blocks; arithmetic
// in S): for partial results (y_a, lse_a) and (y_b, lse_b) of disjoint key sets,
//     m = max(lse_a, lse_b);  w_a = exp(lse_a - m), w_b = exp(lse_b - m)
//     y = (w_a y_a + w_b y_b) / (w_a + w_b);  lse = m + log(w_a + w_b)
// and m = -inf (neither part saw a key) keeps y = 0, lse = -inf (merge_weights). Merged over every
// key block, y and lse are those of attention over all keys.
// Backward (FlashAttention-2's Algorithm 2 at one block pair): given the MERGED y (through
// D_t = dy_t . y_t, row_dot) and the MERGED lse, p = exp(x - lse) is the final probability of the
// pair, so dP, dS and the contributions ds k_s to dq_t, p dy_t to dv_s and ds q_t to dk_s of this
// block pair are exactly the terms of the whole-sequence backward that involve its keys: summing
// (+=) them over key blocks (dq) and query blocks (dk, dv) gives the whole gradients. The same two
// deterministic passes as above, with visible() for the mask and masked tile pairs skipped.
#pragma once

#include <cmath>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/ops_math.h"

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

// ---- block attention (see the header comment) -------------------------------------------------
// Query t sees key s (positions; document ids, or 0 and 0 where none are given).
ST_HD bool visible(int qpos, int kpos, int qdoc, int kdoc) { return kpos <= qpos && qdoc == kdoc; }
// Position and document ranges of n >= 1 tokens (doc == nullptr: documents [0, 0]).
struct TileRange {
  int pos_min, pos_max, doc_min, doc_max;
};
ST_HD TileRange tile_range(const int* pos, const int* doc, int n) {
  TileRange r{pos[0], pos[0], doc ? doc[0] : 0, doc ? doc[0] : 0};
  for (int i = 1; i < n; ++i) {
    r.pos_min = pos[i] < r.pos_min ? pos[i] : r.pos_min;
    r.pos_max = pos[i] > r.pos_max ? pos[i] : r.pos_max;
    if (doc) {
      r.doc_min = doc[i] < r.doc_min ? doc[i] : r.doc_min;
      r.doc_max = doc[i] > r.doc_max ? doc[i] : r.doc_max;
    }
  }
  return r;
}
// True when no query of tile q can see a key of tile k (the pair is skipped).
ST_HD bool tile_pair_masked(const TileRange& q, const TileRange& k) {
  return k.pos_min > q.pos_max || k.doc_max < q.doc_min || k.doc_min > q.doc_max;
}
// End of a block's forward row: y = acc * block_finish_inv(l), lse = block_finish_lse(m, l); a row
// that saw no key (l = 0) gets y = 0 and lse = -inf.
template <typename S> ST_HD S block_finish_inv(S l) { return l > S(0) ? finish_inv(l) : S(0); }
template <typename S> ST_HD S block_finish_lse(S m, S l) { return l > S(0) ? finish_lse(m, l) : S(-INFINITY); }
// Merge of two partial results: y = wa * y_a + wb * y_b, lse = *lse_out (weights already divided by
// w_a + w_b). Both -inf: wa = wb = 0, lse = -inf.
template <typename S> ST_HD void merge_weights(S lse_a, S lse_b, S* wa, S* wb, S* lse_out) {
  const S m = lse_a > lse_b ? lse_a : lse_b;
  if (m == S(-INFINITY)) {
    *wa = S(0);
    *wb = S(0);
    *lse_out = S(-INFINITY);
    return;
  }
  const S ea = lse_a == S(-INFINITY) ? S(0) : math::st_exp(lse_a - m);
  const S eb = lse_b == S(-INFINITY) ? S(0) : math::st_exp(lse_b - m), sum = ea + eb, inv = S(1) / sum;
  *wa = ea * inv;
  *wb = eb * inv;
  *lse_out = m + st_log(sum);
}
// One row of the merge: y[d] = wa y[d] + wb y_part[d] (weights from merge_weights), in S, stored as
// Y. Y = T (attention_merge: y rounded to the compute type at every merge) or Y = S
// (attention_merge_acc: y kept in the arithmetic type, rounded once by its caller).
template <typename Y, typename T, typename S> ST_HD void merge_row(Y* y, const T* y_part, S wa, S wb, int HD) {
  for (int d = 0; d < HD; ++d) y[d] = math::st<Y>(wa * math::ld(y[d]) + wb * math::ld(y_part[d]));
}

}  // namespace shardtrain::flash
