// Block attention driven the way context parallelism uses it (shared by tests/unit and tests/gpu):
// the T rows of every sequence cut into blocks at `cuts`, every query block run against every key
// block (attention_block_forward) and merged in key-block order (attention_merge); then D from the
// merged y (attention_row_dot) and attention_block_backward for every (query block, key block)
// pair, accumulating into per-block dq, dk, dv. Results are scattered back to the whole-sequence
// layout, so they compare row for row with flash_attention_* or the exact path.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"

namespace shardtrain::blocktest {

template <typename T> struct BlockResult {
  std::vector<double> y, lse, dq, dk, dv;  // whole-sequence layout ([B*T, ...], lse [B, NH, T])
  int64_t tile_pairs = 0, skipped = 0;     // take_block_attention_stats after the run
};

// q, dy [B*T, NH*HD]; k, v [B*T, NKV*HD]; pos, doc [B*T] (doc empty: no documents); cuts: block
// starts 0 = c_0 < c_1 < ... < c_n = T.
template <typename T>
BlockResult<T> run_blocks(Backend<T>& be, int B, int T_, int NH, int NKV, int HD, const std::vector<T>& q,
                          const std::vector<T>& k, const std::vector<T>& v, const std::vector<T>& dy,
                          const std::vector<int32_t>& pos, const std::vector<int32_t>& doc,
                          const std::vector<int>& cuts) {
  using S = typename Backend<T>::S;
  const int nb = static_cast<int>(cuts.size()) - 1, ldq = NH * HD, ldk = NKV * HD;
  const S scale = S(1) / std::sqrt(static_cast<S>(HD));
  struct Blk {
    int t0, n;
    Buffer<T> q, k, v, dy, y, ytmp, dq, dk, dv;
    AccBuffer<T> lse, ltmp, dsum;
    IdBuffer<T> pos, doc;
  };
  std::vector<Blk> blk(static_cast<size_t>(nb));
  auto gather = [&](const auto& src, int ld, int t0, int n) {
    std::vector<std::decay_t<decltype(src[0])>> out(static_cast<size_t>(B) * n * ld);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < ld; ++c)
          out[(static_cast<size_t>(b) * n + t) * ld + c] = src[(static_cast<size_t>(b) * T_ + t0 + t) * ld + c];
    return out;
  };
  for (int a = 0; a < nb; ++a) {
    Blk& x = blk[static_cast<size_t>(a)];
    x.t0 = cuts[static_cast<size_t>(a)];
    x.n = cuts[static_cast<size_t>(a) + 1] - x.t0;
    const size_t nq = static_cast<size_t>(B) * x.n * ldq, nk = static_cast<size_t>(B) * x.n * ldk,
                 ns = static_cast<size_t>(B) * NH * x.n, nt = static_cast<size_t>(B) * x.n;
    auto up = [&](Buffer<T>& buf, const std::vector<T>& h) {
      buf = Buffer<T>(be, h.size());
      be.from_host(buf.data(), h.data(), h.size());
    };
    up(x.q, gather(q, ldq, x.t0, x.n));
    up(x.k, gather(k, ldk, x.t0, x.n));
    up(x.v, gather(v, ldk, x.t0, x.n));
    up(x.dy, gather(dy, ldq, x.t0, x.n));
    x.y = Buffer<T>(be, nq);
    x.ytmp = Buffer<T>(be, nq);
    x.dq = Buffer<T>(be, nq);
    x.dk = Buffer<T>(be, nk);
    x.dv = Buffer<T>(be, nk);
    x.lse = AccBuffer<T>(be, ns);
    x.ltmp = AccBuffer<T>(be, ns);
    x.dsum = AccBuffer<T>(be, ns);
    x.pos = IdBuffer<T>(be, nt);
    const std::vector<int32_t> hp = gather(pos, 1, x.t0, x.n);
    be.ids_from_host(x.pos.data(), hp.data(), nt);
    if (!doc.empty()) {
      x.doc = IdBuffer<T>(be, nt);
      const std::vector<int32_t> hd = gather(doc, 1, x.t0, x.n);
      be.ids_from_host(x.doc.data(), hd.data(), nt);
    }
  }
  (void)be.take_block_attention_stats();
  auto dptr = [&](Blk& x) { return doc.empty() ? nullptr : x.doc.data(); };
  for (Blk& a : blk)
    for (int kb = 0; kb < nb; ++kb) {
      Blk& c = blk[static_cast<size_t>(kb)];
      const bool first = kb == 0;
      be.attention_block_forward(first ? a.y.data() : a.ytmp.data(), first ? a.lse.data() : a.ltmp.data(), a.q.data(),
                                 c.k.data(), c.v.data(), a.pos.data(), c.pos.data(), dptr(a), dptr(c), B, a.n, c.n, NH,
                                 NKV, HD, scale);
      if (!first) be.attention_merge(a.y.data(), a.lse.data(), a.ytmp.data(), a.ltmp.data(), B, a.n, NH, HD);
    }
  for (Blk& a : blk) be.attention_row_dot(a.dsum.data(), a.dy.data(), a.y.data(), B, a.n, NH, HD);
  for (Blk& a : blk)
    for (Blk& c : blk)
      be.attention_block_backward(a.dq.data(), c.dk.data(), c.dv.data(), a.dy.data(), a.q.data(), c.k.data(),
                                  c.v.data(), a.y.data(), a.lse.data(), a.dsum.data(), a.pos.data(), c.pos.data(),
                                  dptr(a), dptr(c), B, a.n, c.n, NH, NKV, HD, scale);
  const typename Backend<T>::BlockAttentionStats st = be.take_block_attention_stats();
  BlockResult<T> r;
  r.tile_pairs = st.tile_pairs;
  r.skipped = st.skipped;
  r.y.resize(static_cast<size_t>(B) * T_ * ldq);
  r.dq.resize(r.y.size());
  r.dk.resize(static_cast<size_t>(B) * T_ * ldk);
  r.dv.resize(r.dk.size());
  r.lse.resize(static_cast<size_t>(B) * NH * T_);
  auto scatter = [&](std::vector<double>& dst, const Buffer<T>& src, int ld, int t0, int n) {
    std::vector<T> h(src.size());
    be.to_host(h.data(), src.data(), h.size());
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < ld; ++c)
          dst[(static_cast<size_t>(b) * T_ + t0 + t) * ld + c] =
              static_cast<double>(math::ld(h[(static_cast<size_t>(b) * n + t) * ld + c]));
  };
  for (Blk& a : blk) {
    scatter(r.y, a.y, ldq, a.t0, a.n);
    scatter(r.dq, a.dq, ldq, a.t0, a.n);
    scatter(r.dk, a.dk, ldk, a.t0, a.n);
    scatter(r.dv, a.dv, ldk, a.t0, a.n);
    // lse: S scalars moved as the same bytes through to_host (sizeof(S) is a multiple of sizeof(T)).
    std::vector<S> hl(a.lse.size());
    static_assert(sizeof(S) % sizeof(T) == 0);
    be.to_host(reinterpret_cast<T*>(hl.data()), reinterpret_cast<const T*>(a.lse.data()),
               hl.size() * (sizeof(S) / sizeof(T)));
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < a.n; ++t)
          r.lse[(static_cast<size_t>(b) * NH + h) * T_ + a.t0 + t] =
              static_cast<double>(hl[(static_cast<size_t>(b) * NH + h) * a.n + t]);
  }
  return r;
}

}  // namespace shardtrain::blocktest
