// CPU backend: attention. The exact causal softmax (softmax_causal_*, the reference path of
// llama_attention.cpp's attention_forward / attention_backward), FlashAttention-2 forward and backward
// (flash_attention_*) and block attention at global positions (attention_block_*, attention_merge*,
// attention_row_dot: context parallelism's pieces), with the tile helpers they share. The algorithm,
// the tiling and the per-row math are in include/shardtrain/backend/flash_attention.h (the softmax's
// in ops_math.h); the work items and threading are described in cpu_backend.h.
#include <cblas.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_backend.h"

namespace shardtrain::cpu {
namespace {

// The process's CPU seconds while alive, added to `acc` (BlockAttentionStats::cpu_s).
struct ProcessCpuTimer {
  double& acc;
  double t0 = now();
  explicit ProcessCpuTimer(double& a) : acc(a) {}
  ~ProcessCpuTimer() { acc += now() - t0; }
  ProcessCpuTimer(const ProcessCpuTimer&) = delete;
  ProcessCpuTimer& operator=(const ProcessCpuTimer&) = delete;
  static double now() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
};

}  // namespace

// Per-thread scratch of the flash attention work items (tiles in S).
template <typename T> struct CpuBackend<T>::FlashScratch {
  std::vector<S> q, k, v, dy, s, dp, acc, acc2, m, l;
};
// The nr query rows r0.. of head h of sequence b as S tiles (Q and, with dy, dY), their offset qo
// into q / dy ([B, T, NH, HD]) and so into lse / dsum ([B, NH, T]); w.acc, w.s (and w.dp with
// dy) sized for a query tile.
template <typename T> struct CpuBackend<T>::QueryTile {
  const S* Q = nullptr;
  const S* dY = nullptr;
  int lQ = 0, ldY = 0;
  size_t qo = 0, so = 0;
};
// The nc key and value rows at offset ko (row stride ldk) as S tiles.
template <typename T> struct CpuBackend<T>::KeyTile {
  const S* K = nullptr;
  const S* V = nullptr;
  int lK = 0, lV = 0;
};
// Positions (and documents, or none) of the n tokens t0.. of sequence b of a block ([B, T]) and
// their flash::tile_range.
template <typename T> struct CpuBackend<T>::PosTile {
  const int32_t* P;
  const int32_t* D;
  flash::TileRange range;
};

template <typename T>
void CpuBackend<T>::softmax_causal_forward(T* att, int R, int T_, S scale) {
  const size_t rows = static_cast<size_t>(R) * T_;
  par_ranges(rows, row_grain(T_), [&](size_t rb, size_t re) {
    std::vector<A> tmp(std::is_same_v<T, A> ? 0 : static_cast<size_t>(T_));
    for (size_t rr = rb; rr < re; ++rr) {
      const int t = static_cast<int>(rr % T_);
      T* row = att + rr * T_;
      A* e = std::is_same_v<T, A> ? reinterpret_cast<A*>(row) : tmp.data();  // in place for float/double
      A mx = math::ld(row[0]) * scale;
      for (int s = 1; s <= t; ++s) mx = math::ld(row[s]) * scale > mx ? math::ld(row[s]) * scale : mx;
      for (int s = 0; s <= t; ++s) e[s] = math::st_exp(math::ld(row[s]) * scale - mx);  // vectorized
      A sum = 0;
      for (int s = 0; s <= t; ++s) sum += e[s];
      A inv = A(1) / sum;
      for (int s = 0; s <= t; ++s) row[s] = math::st<T>(e[s] * inv);
      for (int s = t + 1; s < T_; ++s) row[s] = math::st<T>(A(0));
    }
  });
}
// As softmax_causal_forward, keys of other documents masked too (the diagonal always stays).
template <typename T>
void CpuBackend<T>::softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S scale) {
  const size_t rows = static_cast<size_t>(B) * NH * T_;
  par_ranges(rows, row_grain(T_), [&](size_t rb, size_t re) {
    std::vector<A> e(static_cast<size_t>(T_));
    for (size_t rr = rb; rr < re; ++rr) {
      const int t = static_cast<int>(rr % T_);
      const int32_t* db = doc + (rr / T_ / NH) * T_;
      T* row = att + rr * T_;
      A mx = math::ld(row[t]) * scale;
      for (int s = 0; s <= t; ++s)
        if (db[s] == db[t]) mx = math::ld(row[s]) * scale > mx ? math::ld(row[s]) * scale : mx;
      A sum = 0;
      for (int s = 0; s <= t; ++s) {
        e[s] = db[s] == db[t] ? math::st_exp(math::ld(row[s]) * scale - mx) : A(0);
        sum += e[s];
      }
      A inv = A(1) / sum;
      for (int s = 0; s <= t; ++s) row[s] = math::st<T>(e[s] * inv);
      for (int s = t + 1; s < T_; ++s) row[s] = math::st<T>(A(0));
    }
  });
}
// p = softmax(scale*z): dz = scale * p * (dp - sum(p*dp)).
template <typename T>
void CpuBackend<T>::softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) {
  const size_t rows = static_cast<size_t>(R) * T_;
  par_ranges(rows, row_grain(T_), [&](size_t rb, size_t re) {
    for (size_t rr = rb; rr < re; ++rr) {
      const int t = static_cast<int>(rr % T_);
      T* d = datt + rr * T_;
      const T* p = att + rr * T_;
      A dot = 0;
      for (int s = 0; s <= t; ++s) dot += math::ld(p[s]) * math::ld(d[s]);
      for (int s = 0; s <= t; ++s) d[s] = math::st<T>(math::softmax_grad(math::ld(p[s]), math::ld(d[s]), dot, scale));
      for (int s = t + 1; s < T_; ++s) d[s] = math::st<T>(A(0));
    }
  });
}

// FlashAttention-2 forward (flash_attention.h). Work items (b, h, query tile), the longest (last
// query tiles, most key tiles) first. Per key tile: scores = Q K^T (one GEMM), the online softmax
// row by row, acc = alpha acc + P V (rows scaled, then one GEMM with beta = 1).
template <typename T>
void CpuBackend<T>::flash_attention_forward(T* y, S* lse, const T* q, const T* k, const T* v, int B, int T_, int NH,
                                            int NKV, int HD, S scale) {
  if (B <= 0 || T_ <= 0 || NH <= 0 || HD <= 0) return;
  const int G = NH / NKV, nq = flash::num_tiles(T_, flash::kBr), ldk = NKV * HD;
  const size_t BH = static_cast<size_t>(B) * NH;
  par_items_polled(BH * nq, [&](size_t it) {
    const int i = nq - 1 - static_cast<int>(it / BH), b = static_cast<int>(it % BH) / NH, h = static_cast<int>(it % BH) % NH;
    const int r0 = i * flash::kBr, nr = std::min(flash::kBr, T_ - r0);
    FlashScratch& w = flash_scratch();
    const QueryTile qt = query_tile(w, q, nullptr, b, h, T_, NH, HD, r0, nr);
    start_query_tile(w, nr, HD, false);
    const int jend = (r0 + nr - 1) / flash::kBc;
    for (int j = 0; j <= jend; ++j) {
      const int c0 = j * flash::kBc, nc = std::min(flash::kBc, r0 + nr - c0);
      const size_t ko = (static_cast<size_t>(b) * T_ + c0) * ldk + static_cast<size_t>(h / G) * HD;
      forward_pair(w, qt.Q, qt.lQ, key_tile(w, k, v, ko, ldk, nc, HD), nr, nc, HD, scale, [r0, c0](int r) {
        const int last = r0 + r - c0;  // keys c <= last are visible
        return [last](int c) { return c <= last; };
      });
    }
    finish_query_tile(w, y, lse, b, h, T_, NH, HD, r0, nr, false);
  }, [this] { poll_progress(); });
}

// FlashAttention-2 backward, two deterministic passes (flash_attention.h). Pass 1: items
// (b, h, query tile), dQ += dS K per key tile. Pass 2: items (b, kv head, key tile), over the G
// query heads of the group and the query tiles from the diagonal on: dV += P^T dY, dK += dS^T Q.
template <typename T>
void CpuBackend<T>::flash_attention_backward(T* dq, T* dk, T* dv, S* dsum, const T* dy, const T* q, const T* k,
                                             const T* v, const T* y, const S* lse, int B, int T_, int NH, int NKV,
                                             int HD, S scale) {
  if (B <= 0 || T_ <= 0 || NH <= 0 || HD <= 0) return;
  const int G = NH / NKV, nq = flash::num_tiles(T_, flash::kBr), nk = flash::num_tiles(T_, flash::kBc);
  const int ldq = NH * HD, ldk = NKV * HD;
  const size_t BH = static_cast<size_t>(B) * NH, BKV = static_cast<size_t>(B) * NKV;
  // D = rowsum(dY o Y), rows (b, h, t).
  par_ranges(BH * T_, row_grain(HD), [&](size_t rb, size_t re) {
    for (size_t rr = rb; rr < re; ++rr) {
      const size_t bh = rr / T_, t = rr % T_, b = bh / NH, h = bh % NH;
      const size_t o = (b * T_ + t) * ldq + h * HD;
      dsum[rr] = flash::row_dot(dy + o, y + o, HD);
    }
  });
  // P and dS of a (query tile, key tile) pair, in place: s (in: Q K^T, out: P), dp (in: dY V^T,
  // out: dS). Row r is query r0 + r, column c key c0 + c.
  auto p_ds = [&](S* s, S* dp, int nr, int nc, int r0, int c0, const S* L, const S* D) {
    for (int r = 0; r < nr; ++r) {
      S* sr = s + static_cast<size_t>(r) * nc;
      S* dr = dp + static_cast<size_t>(r) * nc;
      const int last = r0 + r - c0;
      const S lr = L[r], Dr = D[r];
      for (int c = 0; c < nc; ++c) sr[c] = c <= last ? flash::prob_from_lse(flash::score(sr[c], scale), lr) : S(0);
      for (int c = 0; c < nc; ++c) dr[c] = c <= last ? flash::dscore(sr[c], dr[c], Dr, scale) : S(0);
    }
  };
  // Pass 1: dQ.
  par_items_polled(BH * nq, [&](size_t it) {
    const int i = nq - 1 - static_cast<int>(it / BH), b = static_cast<int>(it % BH) / NH, h = static_cast<int>(it % BH) % NH;
    const int r0 = i * flash::kBr, nr = std::min(flash::kBr, T_ - r0);
    FlashScratch& w = flash_scratch();
    const size_t qo = (static_cast<size_t>(b) * T_ + r0) * ldq + static_cast<size_t>(h) * HD;
    const size_t so = (static_cast<size_t>(b) * NH + h) * T_ + r0;
    int lQ, ldY, lK, lV;
    const S* Q = tile_s(q + qo, ldq, nr, HD, w.q, &lQ);
    const S* dY = tile_s(dy + qo, ldq, nr, HD, w.dy, &ldY);
    w.acc.assign(static_cast<size_t>(nr) * HD, S(0));
    w.s.resize(static_cast<size_t>(nr) * flash::kBc);
    w.dp.resize(static_cast<size_t>(nr) * flash::kBc);
    const int jend = (r0 + nr - 1) / flash::kBc;
    for (int j = 0; j <= jend; ++j) {
      const int c0 = j * flash::kBc, nc = std::min(flash::kBc, r0 + nr - c0);
      const size_t ko = (static_cast<size_t>(b) * T_ + c0) * ldk + static_cast<size_t>(h / G) * HD;
      const S* K = tile_s(k + ko, ldk, nc, HD, w.k, &lK);
      const S* V = tile_s(v + ko, ldk, nc, HD, w.v, &lV);
      gemm_s(false, true, nr, nc, HD, S(1), Q, lQ, K, lK, S(0), w.s.data(), nc);
      gemm_s(false, true, nr, nc, HD, S(1), dY, ldY, V, lV, S(0), w.dp.data(), nc);
      p_ds(w.s.data(), w.dp.data(), nr, nc, r0, c0, lse + so, dsum + so);
      gemm_s(false, false, nr, HD, nc, S(1), w.dp.data(), nc, K, lK, S(1), w.acc.data(), HD);
    }
    store_tile(dq + qo, ldq, nr, HD, w.acc.data());
  }, [this] { poll_progress(); });
  // Pass 2: dK, dV.
  par_items_polled(BKV * nk, [&](size_t it) {
    const int j = static_cast<int>(it / BKV), b = static_cast<int>(it % BKV) / NKV, kvh = static_cast<int>(it % BKV) % NKV;
    const int c0 = j * flash::kBc, nc = std::min(flash::kBc, T_ - c0);
    FlashScratch& w = flash_scratch();
    const size_t ko = (static_cast<size_t>(b) * T_ + c0) * ldk + static_cast<size_t>(kvh) * HD;
    int lQ, ldY, lK, lV;
    const S* K = tile_s(k + ko, ldk, nc, HD, w.k, &lK);
    const S* V = tile_s(v + ko, ldk, nc, HD, w.v, &lV);
    w.acc.assign(static_cast<size_t>(nc) * HD, S(0));   // dK
    w.acc2.assign(static_cast<size_t>(nc) * HD, S(0));  // dV
    w.s.resize(static_cast<size_t>(flash::kBr) * nc);
    w.dp.resize(static_cast<size_t>(flash::kBr) * nc);
    for (int g = 0; g < G; ++g) {
      const int h = kvh * G + g;
      for (int i = c0 / flash::kBr; i < nq; ++i) {
        const int r0 = i * flash::kBr, nr = std::min(flash::kBr, T_ - r0);
        const size_t qo = (static_cast<size_t>(b) * T_ + r0) * ldq + static_cast<size_t>(h) * HD;
        const size_t so = (static_cast<size_t>(b) * NH + h) * T_ + r0;
        const S* Q = tile_s(q + qo, ldq, nr, HD, w.q, &lQ);
        const S* dY = tile_s(dy + qo, ldq, nr, HD, w.dy, &ldY);
        gemm_s(false, true, nr, nc, HD, S(1), Q, lQ, K, lK, S(0), w.s.data(), nc);
        gemm_s(false, true, nr, nc, HD, S(1), dY, ldY, V, lV, S(0), w.dp.data(), nc);
        p_ds(w.s.data(), w.dp.data(), nr, nc, r0, c0, lse + so, dsum + so);
        gemm_s(true, false, nc, HD, nr, S(1), w.s.data(), nc, dY, ldY, S(1), w.acc2.data(), HD);
        gemm_s(true, false, nc, HD, nr, S(1), w.dp.data(), nc, Q, lQ, S(1), w.acc.data(), HD);
      }
    }
    store_tile(dk + ko, ldk, nc, HD, w.acc.data());
    store_tile(dv + ko, ldk, nc, HD, w.acc2.data());
  }, [this] { poll_progress(); });
}

// Block attention at global positions (flash_attention.h, "Block attention"): the loops of the
// two functions above over every key tile of the block, with visible() for the mask and fully
// masked tile pairs skipped. Between key tiles the calling thread polls the progress hook.
template <typename T>
void CpuBackend<T>::attention_block_forward(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp,
                                            const int32_t* kp, const int32_t* qd, const int32_t* kd, int B, int Tq,
                                            int Tk, int NH, int NKV, int HD, S scale) {
  const ProcessCpuTimer timer(block_cpu_s_);
  if (B <= 0 || Tq <= 0 || NH <= 0 || HD <= 0) return;
  auto pair = [&](FlashScratch& w, const QueryTile& qt, const KeyTile& kt, int nr, int nc, const PosTile& pq,
                  const PosTile& pk) { forward_pair(w, qt.Q, qt.lQ, kt, nr, nc, HD, scale, block_row_vis(pq, pk)); };
  block_query_pass(q, nullptr, k, v, qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, pair,
                   [&](FlashScratch& w, const QueryTile&, int b, int h, int r0, int nr) {
    finish_query_tile(w, y, lse, b, h, Tq, NH, HD, r0, nr, true);
  });
}

template <typename T>
void CpuBackend<T>::attention_merge(T* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) {
  merge_rows(y, lse, yp, lsep, B, Tq, NH, HD);
}
template <typename T>
void CpuBackend<T>::attention_merge_acc(S* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) {
  merge_rows(y, lse, yp, lsep, B, Tq, NH, HD);
}
// y: T (attention_merge) or S (attention_merge_acc).
template <typename T>
template <typename Y>
void CpuBackend<T>::merge_rows(Y* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) {
  const size_t rows = static_cast<size_t>(B) * NH * Tq;
  par_ranges(rows, row_grain(HD), [&](size_t rb, size_t re) {
    for (size_t rr = rb; rr < re; ++rr) {
      const size_t bh = rr / Tq, t = rr % Tq, b = bh / NH, h = bh % NH;
      const size_t o = (b * Tq + t) * NH * HD + h * HD;
      S wa, wb, l;
      flash::merge_weights(lse[rr], lsep[rr], &wa, &wb, &l);
      flash::merge_row(y + o, yp + o, wa, wb, HD);
      lse[rr] = l;
    }
  });
}

template <typename T>
void CpuBackend<T>::attention_row_dot(S* dsum, const T* dy, const T* y, int B, int Tq, int NH, int HD) {
  const size_t rows = static_cast<size_t>(B) * NH * Tq;
  par_ranges(rows, row_grain(HD), [&](size_t rb, size_t re) {
    for (size_t rr = rb; rr < re; ++rr) {
      const size_t bh = rr / Tq, t = rr % Tq, b = bh / NH, h = bh % NH;
      const size_t o = (b * Tq + t) * NH * HD + h * HD;
      dsum[rr] = flash::row_dot(dy + o, y + o, HD);
    }
  });
}

template <typename T>
void CpuBackend<T>::attention_block_backward(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v,
                                             const T* /*y: dsum is read instead*/, const S* lse, const S* dsum,
                                             const int32_t* qp, const int32_t* kp, const int32_t* qd,
                                             const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                                             S scale) {
  const ProcessCpuTimer timer(block_cpu_s_);
  if (B <= 0 || Tq <= 0 || Tk <= 0 || NH <= 0 || HD <= 0) return;
  const int G = NH / NKV, nk = flash::num_tiles(Tk, flash::kBc);
  const int ldq = NH * HD, ldk = NKV * HD;
  const size_t BKV = static_cast<size_t>(B) * NKV;
  // P and dS of a tile pair in place (as flash_attention_backward's), masked by positions.
  auto p_ds = [&](S* s, S* dp, int nr, int nc, const PosTile& pq, const PosTile& pk, const S* L, const S* D) {
    for (int r = 0; r < nr; ++r) {
      S* sr = s + static_cast<size_t>(r) * nc;
      S* dr = dp + static_cast<size_t>(r) * nc;
      const int qpr = pq.P[r], qdr = pq.D ? pq.D[r] : 0;
      const S lr = L[r], Dr = D[r];
      for (int c = 0; c < nc; ++c) {
        const bool ok = flash::visible(qpr, pk.P[c], qdr, pk.D ? pk.D[c] : 0);
        sr[c] = ok ? flash::prob_from_lse(flash::score(sr[c], scale), lr) : S(0);
        dr[c] = ok ? flash::dscore(sr[c], dr[c], Dr, scale) : S(0);
      }
    }
  };
  auto add_tile = [](T* dst, int ld, int rows, int hd, const S* src) {
    for (int r = 0; r < rows; ++r)
      for (int d = 0; d < hd; ++d) {
        T& o = dst[static_cast<size_t>(r) * ld + d];
        o = math::st<T>(math::ld(o) + src[static_cast<size_t>(r) * hd + d]);
      }
  };
  // Pass 1: dQ += dS K over the key tiles of the block.
  auto pair = [&](FlashScratch& w, const QueryTile& qt, const KeyTile& kt, int nr, int nc, const PosTile& pq,
                  const PosTile& pk) {
    backward_pair(w, qt, kt, nr, nc, HD, true, [&](S* s, S* dp) { p_ds(s, dp, nr, nc, pq, pk, lse + qt.so, dsum + qt.so); });
  };
  block_query_pass(q, dy, k, v, qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, pair,
                   [&](FlashScratch& w, const QueryTile& qt, int, int, int, int nr) {
    add_tile(dq + qt.qo, ldq, nr, HD, w.acc.data());
  });
  // Pass 2: dK += dS^T Q, dV += P^T dY over the G query heads and the query tiles of the block.
  par_items_polled(BKV * nk, [&](size_t it) {
    const int j = static_cast<int>(it / BKV), b = static_cast<int>(it % BKV) / NKV, kvh = static_cast<int>(it % BKV) % NKV;
    const int c0 = j * flash::kBc, nc = std::min(flash::kBc, Tk - c0);
    const PosTile pk = pos_tile(kp, kd, b, Tk, c0, nc);
    FlashScratch& w = flash_scratch();
    const size_t ko = (static_cast<size_t>(b) * Tk + c0) * ldk + static_cast<size_t>(kvh) * HD;
    const KeyTile kt = start_key_tile(w, k, v, ko, ldk, nc, HD);
    for (int g = 0; g < G; ++g) {
      const int h = kvh * G + g;
      // Masked pairs are counted in pass 1.
      walk_unmasked_tiles(qp, qd, b, Tq, flash::kBr, pk.range, false, [&](int r0, int nr, const PosTile& pq) {
        const QueryTile qt = query_tile(w, q, dy, b, h, Tq, NH, HD, r0, nr);
        backward_pair(w, qt, kt, nr, nc, HD, false, [&](S* s, S* dp) {
          p_ds(s, dp, nr, nc, pq, pk, lse + qt.so, dsum + qt.so);
        });
      });
    }
    add_tile(dk + ko, ldk, nc, HD, w.acc.data());
    add_tile(dv + ko, ldk, nc, HD, w.acc2.data());
  }, [this] { poll_progress(); });
}

template <typename T>
typename Backend<T>::BlockAttentionStats CpuBackend<T>::take_block_attention_stats() {
  typename Backend<T>::BlockAttentionStats st;
  st.tile_pairs = block_pairs_;
  st.skipped = block_skipped_;
  st.cpu_s = block_cpu_s_;
  block_pairs_ = block_skipped_ = 0;
  block_cpu_s_ = 0;
  return st;
}

template <typename T>
auto CpuBackend<T>::flash_scratch() -> FlashScratch& {
  thread_local FlashScratch w;
  return w;
}

// A rows x HD block of a T matrix with row stride ld, as S: the block itself for float/double
// (*ld_out = ld), converted into buf for bf16 (*ld_out = HD).
template <typename T>
auto CpuBackend<T>::tile_s(const T* src, int ld, int rows, int HD, std::vector<S>& buf, int* ld_out) -> const S* {
  if constexpr (std::is_same_v<T, S>) {
    (void)rows, (void)HD, (void)buf;
    *ld_out = ld;
    return src;
  } else {
    buf.resize(static_cast<size_t>(rows) * HD);
    for (int r = 0; r < rows; ++r)
      for (int d = 0; d < HD; ++d)
        buf[static_cast<size_t>(r) * HD + d] = math::ld(src[static_cast<size_t>(r) * ld + d]);
    *ld_out = HD;
    return buf.data();
  }
}

template <typename T>
auto CpuBackend<T>::query_tile(FlashScratch& w, const T* q, const T* dy, int b, int h, int T_, int NH, int HD, int r0,
                               int nr) -> QueryTile {
  QueryTile t;
  const int ldq = NH * HD;
  t.qo = (static_cast<size_t>(b) * T_ + r0) * ldq + static_cast<size_t>(h) * HD;
  t.so = (static_cast<size_t>(b) * NH + h) * T_ + r0;
  t.Q = tile_s(q + t.qo, ldq, nr, HD, w.q, &t.lQ);
  if (dy) t.dY = tile_s(dy + t.qo, ldq, nr, HD, w.dy, &t.ldY);
  return t;
}

template <typename T>
void CpuBackend<T>::start_query_tile(FlashScratch& w, int nr, int HD, bool backward) {
  w.acc.assign(static_cast<size_t>(nr) * HD, S(0));
  if (!backward) {
    w.m.assign(static_cast<size_t>(nr), -INFINITY);
    w.l.assign(static_cast<size_t>(nr), S(0));
  }
  w.s.resize(static_cast<size_t>(nr) * flash::kBc);
  if (backward) w.dp.resize(static_cast<size_t>(nr) * flash::kBc);
}

template <typename T>
auto CpuBackend<T>::key_tile(FlashScratch& w, const T* k, const T* v, size_t ko, int ldk, int nc, int HD) -> KeyTile {
  KeyTile t;
  t.K = tile_s(k + ko, ldk, nc, HD, w.k, &t.lK);
  t.V = tile_s(v + ko, ldk, nc, HD, w.v, &t.lV);
  return t;
}

// key_tile for the dK/dV pass, with w.acc (dK), w.acc2 (dV), w.s, w.dp sized for a key tile.
template <typename T>
auto CpuBackend<T>::start_key_tile(FlashScratch& w, const T* k, const T* v, size_t ko, int ldk, int nc, int HD)
    -> KeyTile {
  const KeyTile kt = key_tile(w, k, v, ko, ldk, nc, HD);
  w.acc.assign(static_cast<size_t>(nc) * HD, S(0));   // dK
  w.acc2.assign(static_cast<size_t>(nc) * HD, S(0));  // dV
  w.s.resize(static_cast<size_t>(flash::kBr) * nc);
  w.dp.resize(static_cast<size_t>(flash::kBr) * nc);
  return kt;
}

// The forward of one (query tile, key tile) pair: scores = Q K^T (one GEMM), the online softmax
// row by row with row_vis(r) telling which keys c row r sees, acc = alpha acc + P V (rows scaled,
// then one GEMM with beta = 1).
template <typename T>
template <typename RowVis>
void CpuBackend<T>::forward_pair(FlashScratch& w, const S* Q, int lQ, const KeyTile& kt, int nr, int nc, int HD,
                                 S scale, RowVis&& row_vis) {
  gemm_s(false, true, nr, nc, HD, S(1), Q, lQ, kt.K, kt.lK, S(0), w.s.data(), nc);
  for (int r = 0; r < nr; ++r) {
    S* x = w.s.data() + static_cast<size_t>(r) * nc;
    const auto vis = row_vis(r);
    S mx = -INFINITY;
    for (int c = 0; c < nc; ++c) {
      x[c] = vis(c) ? flash::score(x[c], scale) : S(-INFINITY);
      mx = x[c] > mx ? x[c] : mx;
    }
    const S m_new = flash::online_max(w.m[r], mx), alpha = flash::online_rescale(w.m[r], m_new);
    S sum = 0;
    for (int c = 0; c < nc; ++c) x[c] = vis(c) ? flash::prob(x[c], m_new) : S(0);  // vectorized
    for (int c = 0; c < nc; ++c) sum += x[c];
    w.l[r] = alpha * w.l[r] + sum;
    w.m[r] = m_new;
    S* a = w.acc.data() + static_cast<size_t>(r) * HD;
    for (int d = 0; d < HD; ++d) a[d] *= alpha;
  }
  gemm_s(false, false, nr, HD, nc, S(1), w.s.data(), nc, kt.V, kt.lV, S(1), w.acc.data(), HD);
}

// The backward of one tile pair: s = Q K^T, dp = dY V^T, p_ds(s, dp) turning them into P and dS
// in place, then with dq: dQ (w.acc) += dS K, else dV (w.acc2) += P^T dY, dK (w.acc) += dS^T Q.
template <typename T>
template <typename PDs>
void CpuBackend<T>::backward_pair(FlashScratch& w, const QueryTile& qt, const KeyTile& kt, int nr, int nc, int HD,
                                  bool dq, PDs&& p_ds) {
  gemm_s(false, true, nr, nc, HD, S(1), qt.Q, qt.lQ, kt.K, kt.lK, S(0), w.s.data(), nc);
  gemm_s(false, true, nr, nc, HD, S(1), qt.dY, qt.ldY, kt.V, kt.lV, S(0), w.dp.data(), nc);
  p_ds(w.s.data(), w.dp.data());
  if (dq) {
    gemm_s(false, false, nr, HD, nc, S(1), w.dp.data(), nc, kt.K, kt.lK, S(1), w.acc.data(), HD);
  } else {
    gemm_s(true, false, nc, HD, nr, S(1), w.s.data(), nc, qt.dY, qt.ldY, S(1), w.acc2.data(), HD);
    gemm_s(true, false, nc, HD, nr, S(1), w.dp.data(), nc, qt.Q, qt.lQ, S(1), w.acc.data(), HD);
  }
}

template <typename T>
auto CpuBackend<T>::pos_tile(const int32_t* pos, const int32_t* doc, int b, int T_, int t0, int n) -> PosTile {
  const int32_t* P = pos + static_cast<size_t>(b) * T_ + t0;
  const int32_t* D = doc ? doc + static_cast<size_t>(b) * T_ + t0 : nullptr;
  return {P, D, flash::tile_range(P, D, n)};
}

// flash::visible of query row r of qt for the keys of kt, as forward_pair's row_vis.
template <typename T>
auto CpuBackend<T>::block_row_vis(const PosTile& qt, const PosTile& kt) {
  return [&qt, &kt](int r) {
    const int qpr = qt.P[r], qdr = qt.D ? qt.D[r] : 0;
    return [&kt, qpr, qdr](int c) { return flash::visible(qpr, kt.P[c], qdr, kt.D ? kt.D[c] : 0); };
  };
}

// The tiles (of size tile) of the T_ tokens of sequence b of a block that are not fully masked
// against other (a query tile's range when the walked tiles are keys, a key tile's when they are
// queries): f(t0, n, tile) for each, then a poll of the progress registry. Returns the count of
// masked tiles skipped.
template <typename T>
template <typename F>
int64_t CpuBackend<T>::walk_unmasked_tiles(const int32_t* pos, const int32_t* doc, int b, int T_, int tile,
                                           const flash::TileRange& other, bool keys, F&& f) {
  int64_t skip = 0;
  const int n_tiles = T_ > 0 ? flash::num_tiles(T_, tile) : 0;
  for (int j = 0; j < n_tiles; ++j) {
    const int t0 = j * tile, n = std::min(tile, T_ - t0);
    const PosTile pt = pos_tile(pos, doc, b, T_, t0, n);
    if (keys ? flash::tile_pair_masked(other, pt.range) : flash::tile_pair_masked(pt.range, other)) {
      ++skip;
      continue;
    }
    f(t0, n, pt);
    poll_progress();
  }
  return skip;
}

// The (b, h, query tile) work items of a block: the forward, or with dy the dQ pass. Per item the
// query tile qt (positions pq; Q, and dY with dy), pair(w, qt, key tile, nr, nc, pq, pk) for each
// key tile not fully masked against it (walk_unmasked_tiles: a poll after each), then
// done(w, qt, b, h, r0, nr). Adds the item's tile pairs and skipped pairs to block_pairs_,
// block_skipped_.
template <typename T>
template <typename Pair, typename Done>
void CpuBackend<T>::block_query_pass(const T* q, const T* dy, const T* k, const T* v, const int32_t* qp,
                                     const int32_t* kp, const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk,
                                     int NH, int NKV, int HD, Pair&& pair, Done&& done) {
  const int G = NH / NKV, nq = flash::num_tiles(Tq, flash::kBr), nk = Tk > 0 ? flash::num_tiles(Tk, flash::kBc) : 0;
  const int ldk = NKV * HD;
  const size_t BH = static_cast<size_t>(B) * NH;
  std::atomic<int64_t> skipped{0};
  par_items_polled(BH * nq, [&](size_t it) {
    const int i = static_cast<int>(it / BH), b = static_cast<int>(it % BH) / NH, h = static_cast<int>(it % BH) % NH;
    const int r0 = i * flash::kBr, nr = std::min(flash::kBr, Tq - r0);
    const PosTile pq = pos_tile(qp, qd, b, Tq, r0, nr);
    FlashScratch& w = flash_scratch();
    const QueryTile qt = query_tile(w, q, dy, b, h, Tq, NH, HD, r0, nr);
    start_query_tile(w, nr, HD, dy != nullptr);
    skipped += walk_unmasked_tiles(kp, kd, b, Tk, flash::kBc, pq.range, true, [&](int c0, int nc, const PosTile& pk) {
      const size_t ko = (static_cast<size_t>(b) * Tk + c0) * ldk + static_cast<size_t>(h / G) * HD;
      pair(w, qt, key_tile(w, k, v, ko, ldk, nc, HD), nr, nc, pq, pk);
    });
    done(w, qt, b, h, r0, nr);
  }, [this] { poll_progress(); });
  block_pairs_ += static_cast<int64_t>(BH) * nq * nk;
  block_skipped_ += skipped.load();
}

// The end of a forward query tile (rows r0.. of head h of sequence b): y = acc * finish_inv(l),
// lse = finish_lse(m, l); with block, block_finish_inv / block_finish_lse (rows with no key).
template <typename T>
void CpuBackend<T>::finish_query_tile(const FlashScratch& w, T* y, S* lse, int b, int h, int T_, int NH, int HD,
                                      int r0, int nr, bool block) {
  const int ldq = NH * HD;
  for (int r = 0; r < nr; ++r) {
    const S inv = block ? flash::block_finish_inv(w.l[r]) : flash::finish_inv(w.l[r]);
    T* yr = y + (static_cast<size_t>(b) * T_ + r0 + r) * ldq + static_cast<size_t>(h) * HD;
    const S* a = w.acc.data() + static_cast<size_t>(r) * HD;
    for (int d = 0; d < HD; ++d) yr[d] = math::st<T>(a[d] * inv);
    lse[(static_cast<size_t>(b) * NH + h) * T_ + r0 + r] =
        block ? flash::block_finish_lse(w.m[r], w.l[r]) : flash::finish_lse(w.m[r], w.l[r]);
  }
}

// dst (rows x HD, row stride ld) = src (rows x HD, contiguous), rounded to T.
template <typename T>
void CpuBackend<T>::store_tile(T* dst, int ld, int rows, int HD, const S* src) {
  for (int r = 0; r < rows; ++r)
    for (int d = 0; d < HD; ++d)
      dst[static_cast<size_t>(r) * ld + d] = math::st<T>(src[static_cast<size_t>(r) * HD + d]);
}

// One single-threaded BLAS call in S (sgemm for float and bf16, dgemm for double).
template <typename T>
void CpuBackend<T>::gemm_s(bool ta, bool tb, int M, int N, int K, S alpha, const S* Am, int lda, const S* B, int ldb,
                           S beta, S* C, int ldc) {
  auto TA = ta ? CblasTrans : CblasNoTrans;
  auto TB = tb ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<S, float>) cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
  else cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, alpha, Am, lda, B, ldb, beta, C, ldc);
}

#define ST_CPU_ATTENTION(T)                                                                                          \
  template void CpuBackend<T>::softmax_causal_forward(T*, int, int, CpuBackend<T>::S);                             \
  template void CpuBackend<T>::softmax_causal_doc_forward(T*, const int32_t*, int, int, int, CpuBackend<T>::S);    \
  template void CpuBackend<T>::softmax_causal_backward(T*, const T*, int, int, CpuBackend<T>::S);                  \
  template void CpuBackend<T>::flash_attention_forward(T*, CpuBackend<T>::S*, const T*, const T*, const T*, int,   \
                                                       int, int, int, int, CpuBackend<T>::S);                      \
  template void CpuBackend<T>::flash_attention_backward(T*, T*, T*, CpuBackend<T>::S*, const T*, const T*,        \
                                                        const T*, const T*, const T*, const CpuBackend<T>::S*,    \
                                                        int, int, int, int, int, CpuBackend<T>::S);                \
  template void CpuBackend<T>::attention_block_forward(T*, CpuBackend<T>::S*, const T*, const T*, const T*,        \
                                                       const int32_t*, const int32_t*, const int32_t*,             \
                                                       const int32_t*, int, int, int, int, int, int,               \
                                                       CpuBackend<T>::S);                                          \
  template void CpuBackend<T>::attention_merge(T*, CpuBackend<T>::S*, const T*, const CpuBackend<T>::S*, int, int, \
                                               int, int);                                                          \
  template void CpuBackend<T>::attention_merge_acc(CpuBackend<T>::S*, CpuBackend<T>::S*, const T*,                 \
                                                   const CpuBackend<T>::S*, int, int, int, int);                   \
  template void CpuBackend<T>::attention_row_dot(CpuBackend<T>::S*, const T*, const T*, int, int, int, int);       \
  template void CpuBackend<T>::attention_block_backward(T*, T*, T*, const T*, const T*, const T*, const T*,        \
                                                        const T*, const CpuBackend<T>::S*, const CpuBackend<T>::S*,          \
                                                        const int32_t*, const int32_t*, const int32_t*,            \
                                                        const int32_t*, int, int, int, int, int, int,              \
                                                        CpuBackend<T>::S);                                         \
  template Backend<T>::BlockAttentionStats CpuBackend<T>::take_block_attention_stats();
ST_CPU_ATTENTION(float)
ST_CPU_ATTENTION(double)
ST_CPU_ATTENTION(bf16)
#undef ST_CPU_ATTENTION

}  // namespace shardtrain::cpu
