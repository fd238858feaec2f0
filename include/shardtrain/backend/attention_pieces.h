// Block attention at global positions cut into pieces that fused attention kernels take (issue 57,
// item 2): context parallelism's block pairs (Backend::attention_block_forward / _backward: query t
// sees key s iff k_pos[s] <= q_pos[t] and, with documents, q_doc[t] == k_doc[s]) are, per pair of
// runs of consecutive positions in one document, either fully visible, fully masked, or a causal
// square at some offset. cuDNN's SDPA takes the
// first (no mask) and a top-left causal mask (query row t sees key row u iff u <= t); this header
// finds the rectangles of rows and keys that are one or the other and cover exactly the visible
// pairs, so that the CUDA backend runs one fused call per piece (src/backend/cuda/attention.cu) and
// merges the pieces of the same query rows as the ring merges blocks. Host code, header-only: the
// CUDA plugin and the unit tests (tests/unit/test_attention_pieces.cpp) both compile it.
//
// Positions (and document ids) of a block: one sequence's, [T] int32 (host memory). One plan serves
// the B sequences of a block when they share them (same_rows: context parallelism's head-tail split
// gives every sequence the same chunks); else the CUDA backend plans each sequence apart. With
// documents a run also ends where the document changes, so a block of many short documents becomes
// many small pieces.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardtrain::attn {

// Rows [row0, row0 + n) of a block hold positions pos0, pos0 + 1, ..., pos0 + n - 1, all of
// document doc (0 without documents).
struct Run {
  int row0 = 0, n = 0, pos0 = 0, doc = 0;
};

// The maximal runs of consecutive positions of p [T] within one document of doc [T] (nullptr: one
// document), in row order (T = 0: none).
inline std::vector<Run> runs_of(const int32_t* p, int T, const int32_t* doc = nullptr) {
  std::vector<Run> r;
  for (int t = 0; t < T; ++t) {
    const int d = doc ? doc[t] : 0;
    if (!r.empty() && p[t] == r.back().pos0 + r.back().n && d == r.back().doc) ++r.back().n;
    else r.push_back({t, 1, p[t], d});
  }
  return r;
}

// True when each of the B sequences of p [B, T] has the positions of the first.
inline bool same_rows(const int32_t* p, int B, int T) {
  for (int b = 1; b < B; ++b)
    for (int t = 0; t < T; ++t)
      if (p[static_cast<int64_t>(b) * T + t] != p[t]) return false;
  return true;
}

// Query rows [q0, q0 + nq) against key rows [k0, k0 + nk) of a block pair: causal == false, every
// query sees every key; causal == true, query row q0 + t sees key row k0 + u iff u <= t (the
// diagonal at the top-left corner; plan() makes nk <= nq, so the last nq - nk rows see every key).
struct Piece {
  int q0 = 0, nq = 0, k0 = 0, nk = 0;
  bool causal = false;
};

// The pieces of query run q against key run k (none when their documents differ; else visibility
// k.pos0 + u <= q.pos0 + t, d = q.pos0 - k.pos0): all keys visible to all rows when d >= k.n - 1; none when d + q.n - 1 < 0; else for
// d >= 0 the keys before d in full and the keys [d, min(k.n, d + q.n)) causal against every row,
// and for d < 0 rows [-d, q.n) causal against keys [0, min(k.n, q.n + d)) (rows before -d see no
// key of this run). Appends to out.
inline void run_pieces(const Run& q, const Run& k, std::vector<Piece>& out) {
  if (q.doc != k.doc) return;
  const int64_t d = int64_t{q.pos0} - k.pos0;
  if (d >= k.n - 1) {
    out.push_back({q.row0, q.n, k.row0, k.n, false});
  } else if (d + q.n - 1 < 0) {
    return;
  } else if (d >= 0) {
    const int di = static_cast<int>(d);
    if (di > 0) out.push_back({q.row0, q.n, k.row0, di, false});
    out.push_back({q.row0, q.n, k.row0 + di, std::min(k.n - di, q.n), true});
  } else {
    const int skip = static_cast<int>(-d);
    out.push_back({q.row0 + skip, q.n - skip, k.row0, std::min(k.n, q.n - skip), true});
  }
}

// Every run pair's pieces, then full pieces joined where one continues another: the same query
// rows and the next key rows, or the same key rows and the next query rows (fewer, larger calls;
// a head-tail pair of context parallelism is then one or two pieces per query chunk).
inline std::vector<Piece> plan(const std::vector<Run>& q, const std::vector<Run>& k) {
  std::vector<Piece> p;
  for (const Run& a : q)
    for (const Run& b : k) run_pieces(a, b, p);
  for (bool joined = true; joined;) {
    joined = false;
    for (size_t i = 0; i < p.size() && !joined; ++i)
      for (size_t j = 0; j < p.size() && !joined; ++j) {
        Piece &a = p[i], &b = p[j];
        if (i == j || a.causal || b.causal) continue;
        if (a.q0 == b.q0 && a.nq == b.nq && b.k0 == a.k0 + a.nk) a.nk += b.nk, joined = true;
        else if (a.k0 == b.k0 && a.nk == b.nk && b.q0 == a.q0 + a.nq) a.nq += b.nq, joined = true;
        if (joined) p.erase(p.begin() + static_cast<std::ptrdiff_t>(j));
      }
  }
  return p;
}

// The pieces in layers whose query rows do not overlap (each piece in the first layer it fits), so
// that a layer is one set of fused calls writing disjoint rows of one (y, lse), and the layers are
// merged as blocks are (Backend::attention_merge). Returns, per layer, indices into pieces.
inline std::vector<std::vector<int>> layers(const std::vector<Piece>& pieces) {
  std::vector<std::vector<int>> L;
  for (int i = 0; i < static_cast<int>(pieces.size()); ++i) {
    const Piece& a = pieces[static_cast<size_t>(i)];
    bool placed = false;
    for (auto& layer : L) {
      bool overlap = false;
      for (int j : layer) {
        const Piece& b = pieces[static_cast<size_t>(j)];
        overlap = overlap || (a.q0 < b.q0 + b.nq && b.q0 < a.q0 + a.nq);
      }
      if (!overlap) {
        layer.push_back(i);
        placed = true;
        break;
      }
    }
    if (!placed) L.push_back({i});
  }
  return L;
}

// Query rows a layer's pieces cover (their rows are disjoint: the sum of their nq).
inline int rows_covered(const std::vector<Piece>& pieces, const std::vector<int>& layer) {
  int n = 0;
  for (int i : layer) n += pieces[static_cast<size_t>(i)].nq;
  return n;
}

}  // namespace shardtrain::attn
