// Block attention at global positions (attention_block_forward / _merge / _row_dot /
// _block_backward, flash_attention.h "Block attention") and RoPE at per-token positions
// (rope_forward_at / rope_backward_at) of the CPU backend.
//
// Block attention: every sequence of T tokens cut into 2..8 blocks of random sizes (1 row up to
// several tiles), every query block against every key block, merged, then the backward of every
// block pair accumulated (block_attention_run.h). References, on the same stored inputs:
//   - no documents: the whole-sequence tiled path (flash_attention_*) and the exact path
//     (attention_forward / _backward); y, lse, dq, dk, dv. float64 within 1e-12, fp32 within 1e-5
//     (max |a - b| / max |b|).
//   - random document boundaries: the exact path with the same document mask (attention_forward's
//     doc), itself checked against a float64 loop; same tolerances.
//   - skipped tile pairs: with global positions and contiguous documents the count must equal a
//     brute-force count of tile pairs in which no (query, key) pair is visible (and be > 0 where
//     the shape has any).
//   - positions that restart per document (with document ids) give bitwise the results of global
//     positions (the masks are the same).
//   - GQA with NH = 4 and NKV = 4, 2, 1.
// Bitwise the same with 1, 2 and 3 threads; the progress hook is polled between tiles.
// Exact path: one document for every token gives bitwise the causal-only result (doc = nullptr).
// RoPE at positions: a slice, a head-tail pair of chunks and per-document restarts, forward and
// backward, float, double and bf16, bitwise the corresponding rows of rope_forward on whole
// sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "block_attention_run.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/flash_attention.h"
#include "shardtrain/model/model.h"

namespace shardtrain {
namespace {

struct Case {
  int B, T, NH, NKV, HD;
  std::string str() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
           " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD);
  }
  size_t nq() const { return static_cast<size_t>(B) * T * NH * HD; }
  size_t nk() const { return static_cast<size_t>(B) * T * NKV * HD; }
  size_t ns() const { return static_cast<size_t>(B) * NH * T; }
};

struct Data {
  std::vector<float> q, k, v, dy;
  std::vector<int32_t> pos, doc, pos_restart;  // [B*T]
  std::vector<int> cuts;
};

// q, k ~ N(0, 1.5^2), v, dy ~ N(0, 1); 2..8 blocks with random cuts; documents (with_doc) of random
// lengths 1..T/2 per sequence, ids increasing from a random start.
Data make_data(const Case& c, uint32_t seed, bool with_doc) {
  std::mt19937 g(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  auto fill = [&](size_t count, double sd) {
    std::vector<float> x(count);
    for (auto& e : x) e = static_cast<float>(sd * n(g));
    return x;
  };
  Data d;
  d.q = fill(c.nq(), 1.5);
  d.k = fill(c.nk(), 1.5);
  d.v = fill(c.nk(), 1.0);
  d.dy = fill(c.nq(), 1.0);
  const int nb = std::min(c.T, 2 + static_cast<int>(g() % 7));
  std::vector<int> inner;
  for (int t = 1; t < c.T; ++t) inner.push_back(t);
  std::shuffle(inner.begin(), inner.end(), g);
  d.cuts.assign(inner.begin(), inner.begin() + (nb - 1));
  d.cuts.push_back(0);
  d.cuts.push_back(c.T);
  std::sort(d.cuts.begin(), d.cuts.end());
  for (int b = 0; b < c.B; ++b) {
    int id = static_cast<int>(g() % 5), start = 0, left = 1 + static_cast<int>(g() % std::max(1, c.T / 2));
    for (int t = 0; t < c.T; ++t) {
      if (left == 0) {
        ++id;
        start = t;
        left = 1 + static_cast<int>(g() % std::max(1, c.T / 2));
      }
      --left;
      d.pos.push_back(t);
      d.doc.push_back(id);
      d.pos_restart.push_back(t - start);
    }
  }
  if (!with_doc) d.doc.clear();
  return d;
}

template <typename T> std::vector<T> conv(const std::vector<float>& x) {
  std::vector<T> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = math::st<T>(static_cast<math::Acc<T>>(x[i]));
  return r;
}
template <typename T> std::vector<double> wide(const std::vector<T>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(math::ld(x[i]));
  return r;
}
template <typename T> Buffer<T> upload(Backend<T>& be, const std::vector<T>& h) {
  Buffer<T> b(be, h.size());
  be.from_host(b.data(), h.data(), h.size());
  return b;
}
template <typename T> std::vector<double> download(Backend<T>& be, const Buffer<T>& b) {
  std::vector<T> h(b.size());
  be.to_host(h.data(), b.data(), h.size());
  return wide(h);
}

struct Out {
  std::vector<double> y, lse, dq, dk, dv;
};

template <typename T> Out run_flash(Backend<T>& be, const Case& c, const Data& d) {
  using S = typename Backend<T>::S;
  Buffer<T> q = upload(be, conv<T>(d.q)), k = upload(be, conv<T>(d.k)), v = upload(be, conv<T>(d.v)),
            dy = upload(be, conv<T>(d.dy)), y(be, c.nq()), dq(be, c.nq()), dk(be, c.nk()), dv(be, c.nk());
  AccBuffer<T> lse(be, c.ns()), dsum(be, c.ns());
  const S scale = S(1) / std::sqrt(static_cast<S>(c.HD));
  be.flash_attention_forward(y.data(), lse.data(), q.data(), k.data(), v.data(), c.B, c.T, c.NH, c.NKV, c.HD, scale);
  be.flash_attention_backward(dq.data(), dk.data(), dv.data(), dsum.data(), dy.data(), q.data(), k.data(), v.data(),
                              y.data(), lse.data(), c.B, c.T, c.NH, c.NKV, c.HD, scale);
  return Out{download(be, y), std::vector<double>(lse.data(), lse.data() + c.ns()), download(be, dq), download(be, dk),
             download(be, dv)};
}

// The exact path, with the document mask when d.doc is not empty.
template <typename T> Out run_exact(Backend<T>& be, const Case& c, const Data& d, bool use_doc) {
  Buffer<T> q = upload(be, conv<T>(d.q)), k = upload(be, conv<T>(d.k)), v = upload(be, conv<T>(d.v)),
            dy = upload(be, conv<T>(d.dy)), y(be, c.nq()), dq(be, c.nq()), dk(be, c.nk()), dv(be, c.nk());
  const size_t natt = c.ns() * static_cast<size_t>(c.T);
  Buffer<T> att(be, natt), datt(be, natt);
  IdBuffer<T> doc(be, static_cast<size_t>(c.B) * c.T);
  if (use_doc) be.ids_from_host(doc.data(), d.doc.data(), d.doc.size());
  attention_forward(be, q.data(), k.data(), v.data(), att.data(), y.data(), c.B, c.T, c.NH, c.NKV, c.HD,
                    use_doc ? doc.data() : nullptr);
  attention_backward(be, q.data(), k.data(), v.data(), att.data(), dy.data(), datt.data(), dq.data(), dk.data(),
                     dv.data(), c.B, c.T, c.NH, c.NKV, c.HD);
  return Out{download(be, y), {}, download(be, dq), download(be, dk), download(be, dv)};
}

// y of masked attention in float64 loops (query t sees key s <= t of its own document).
std::vector<double> naive_y(const Case& c, const Data& d) {
  std::vector<double> y(c.nq());
  const int G = c.NH / c.NKV, ldq = c.NH * c.HD, ldk = c.NKV * c.HD;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.HD));
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.NH; ++h)
      for (int t = 0; t < c.T; ++t) {
        const size_t qo = (static_cast<size_t>(b) * c.T + t) * ldq + static_cast<size_t>(h) * c.HD;
        std::vector<double> x(static_cast<size_t>(t) + 1, -INFINITY);
        double mx = -INFINITY;
        for (int s = 0; s <= t; ++s) {
          if (d.doc[static_cast<size_t>(b) * c.T + s] != d.doc[static_cast<size_t>(b) * c.T + t]) continue;
          const size_t ko = (static_cast<size_t>(b) * c.T + s) * ldk + static_cast<size_t>(h / G) * c.HD;
          double dot = 0;
          for (int e = 0; e < c.HD; ++e) dot += static_cast<double>(d.q[qo + e]) * static_cast<double>(d.k[ko + e]);
          x[static_cast<size_t>(s)] = scale * dot;
          mx = std::max(mx, scale * dot);
        }
        double sum = 0;
        for (int s = 0; s <= t; ++s) sum += x[static_cast<size_t>(s)] == -INFINITY ? 0.0 : std::exp(x[static_cast<size_t>(s)] - mx);
        for (int s = 0; s <= t; ++s) {
          if (x[static_cast<size_t>(s)] == -INFINITY) continue;
          const double p = std::exp(x[static_cast<size_t>(s)] - mx) / sum;
          const size_t vo = (static_cast<size_t>(b) * c.T + s) * ldk + static_cast<size_t>(h / G) * c.HD;
          for (int e = 0; e < c.HD; ++e) y[qo + e] += p * static_cast<double>(d.v[vo + e]);
        }
      }
  return y;
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  return den > 0 ? num / den : num;
}
double lse_err(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) e = std::max(e, std::fabs(a[i] - b[i]) / std::max(1.0, std::fabs(b[i])));
  return e;
}

// Tile pairs the blocks of run_blocks visit (forward + backward), and how many hold no visible
// (query, key) pair, by brute force over the pairs.
std::pair<int64_t, int64_t> expected_tiles(const Case& c, const Data& d, const std::vector<int32_t>& pos) {
  int64_t pairs = 0, masked = 0;
  const int nb = static_cast<int>(d.cuts.size()) - 1;
  for (int a = 0; a < nb; ++a)
    for (int kb = 0; kb < nb; ++kb) {
      const int qa = d.cuts[static_cast<size_t>(a)], qn = d.cuts[static_cast<size_t>(a) + 1] - qa;
      const int ka = d.cuts[static_cast<size_t>(kb)], kn = d.cuts[static_cast<size_t>(kb) + 1] - ka;
      const int nq = flash::num_tiles(qn, flash::kBr), nk = flash::num_tiles(kn, flash::kBc);
      pairs += int64_t{c.B} * c.NH * nq * nk;
      for (int b = 0; b < c.B; ++b)
        for (int i = 0; i < nq; ++i)
          for (int j = 0; j < nk; ++j) {
            bool any = false;
            for (int r = i * flash::kBr; r < std::min(qn, (i + 1) * flash::kBr) && !any; ++r)
              for (int s = j * flash::kBc; s < std::min(kn, (j + 1) * flash::kBc) && !any; ++s) {
                const size_t t = static_cast<size_t>(b) * c.T + qa + r, u = static_cast<size_t>(b) * c.T + ka + s;
                any = pos[u] <= pos[t] && (d.doc.empty() || d.doc[t] == d.doc[u]);
              }
            if (!any) masked += c.NH;
          }
    }
  return {2 * pairs, 2 * masked};
}

template <typename T>
blocktest::BlockResult<T> run_blocks(Backend<T>& be, const Case& c, const Data& d, const std::vector<int32_t>& pos) {
  return blocktest::run_blocks<T>(be, c.B, c.T, c.NH, c.NKV, c.HD, conv<T>(d.q), conv<T>(d.k), conv<T>(d.v),
                                  conv<T>(d.dy), pos, d.doc, d.cuts);
}

std::string cuts_str(const std::vector<int>& cuts) {
  std::string s;
  for (size_t i = 0; i < cuts.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(cuts[i]);
  }
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (int nkv : {4, 2, 1}) {
    v.push_back({2, 300, 4, nkv, 32});
    v.push_back({1, 37, 4, nkv, 16});
  }
  v.push_back({1, 520, 2, 1, 24});
  return v;
}

template <typename T> void check_blocks(bool with_doc, double tol) {
  auto be = make_cpu_backend<T>();
  uint32_t seed = with_doc ? 100 : 1;
  for (const Case& c : cases())
    for (int rep = 0; rep < 2; ++rep) {
      const Data d = make_data(c, seed++, with_doc);
      const auto r = run_blocks<T>(*be, c, d, d.pos);
      const Out e = run_exact<T>(*be, c, d, with_doc);
      const std::string what = c.str() + " cuts=" + cuts_str(d.cuts) + (with_doc ? " docs" : "");
      const double ey = rel(r.y, e.y), eq = rel(r.dq, e.dq), ek = rel(r.dk, e.dk), ev = rel(r.dv, e.dv);
      std::printf("[ block ] %s vs exact: y %.2e dq %.2e dk %.2e dv %.2e", what.c_str(), ey, eq, ek, ev);
      EXPECT_LE(ey, tol) << what;
      EXPECT_LE(eq, tol) << what;
      EXPECT_LE(ek, tol) << what;
      EXPECT_LE(ev, tol) << what;
      if (!with_doc) {
        const Out f = run_flash<T>(*be, c, d);
        const double fy = rel(r.y, f.y), fq = rel(r.dq, f.dq), fk = rel(r.dk, f.dk), fv = rel(r.dv, f.dv),
                     fl = lse_err(r.lse, f.lse);
        std::printf("; vs tiled: y %.2e lse %.2e dq %.2e dk %.2e dv %.2e", fy, fl, fq, fk, fv);
        EXPECT_LE(fy, tol) << what;
        EXPECT_LE(fl, tol) << what;
        EXPECT_LE(fq, tol) << what;
        EXPECT_LE(fk, tol) << what;
        EXPECT_LE(fv, tol) << what;
      }
      const auto [pairs, masked] = expected_tiles(c, d, d.pos);
      std::printf("; tile pairs %lld skipped %lld (brute force %lld)\n", static_cast<long long>(r.tile_pairs),
                  static_cast<long long>(r.skipped), static_cast<long long>(masked));
      EXPECT_EQ(r.tile_pairs, pairs) << what;
      EXPECT_EQ(r.skipped, masked) << what;
      EXPECT_GT(r.skipped, 0) << what;  // a query block before a key block is fully masked
      if (with_doc) {
        // Positions restarting per document: the same masks, so the same bits (tiles the range
        // test no longer skips contribute exact zeros).
        const auto rr = run_blocks<T>(*be, c, d, d.pos_restart);
        EXPECT_TRUE(rr.y == r.y && rr.dq == r.dq && rr.dk == r.dk && rr.dv == r.dv && rr.lse == r.lse) << what;
        EXPECT_LE(rr.skipped, r.skipped) << what;
        const auto [p2, m2] = expected_tiles(c, d, d.pos_restart);
        EXPECT_LE(rr.skipped, m2) << what;
        (void)p2;
      }
    }
}

TEST(BlockAttention, Float64EqualsWholeSequence) { check_blocks<double>(false, 1e-12); }
TEST(BlockAttention, Fp32EqualsWholeSequence) { check_blocks<float>(false, 1e-5); }
TEST(BlockAttention, Float64DocumentsEqualMaskedExactPath) { check_blocks<double>(true, 1e-12); }
TEST(BlockAttention, Fp32DocumentsEqualMaskedExactPath) { check_blocks<float>(true, 1e-5); }

// The exact path's document mask against float64 loops, and one document = no mask, bitwise.
TEST(BlockAttention, ExactPathDocumentMask) {
  auto bd = make_cpu_backend<double>();
  auto bf = make_cpu_backend<float>();
  uint32_t seed = 7;
  for (const Case& c : {Case{2, 70, 4, 2, 16}, Case{1, 130, 2, 1, 32}}) {
    Data d = make_data(c, seed++, true);
    const double e = rel(run_exact<double>(*bd, c, d, true).y, naive_y(c, d));
    std::printf("[ block ] exact path with documents vs float64 loops %s: y %.2e\n", c.str().c_str(), e);
    EXPECT_LE(e, 1e-12) << c.str();
    std::fill(d.doc.begin(), d.doc.end(), 3);
    const Out one = run_exact<float>(*bf, c, d, true), none = run_exact<float>(*bf, c, d, false);
    EXPECT_TRUE(one.y == none.y && one.dq == none.dq && one.dk == none.dk && one.dv == none.dv) << c.str();
  }
}

// A block pair with no visible key: y = 0, lse = -inf; merging it changes nothing, bitwise.
TEST(BlockAttention, EmptyBlockAndMergeIdentity) {
  auto be = make_cpu_backend<float>();
  const Case c{1, 20, 2, 1, 8};
  const Data d = make_data(c, 3, false);
  const int n = 10;  // queries 0..9 against keys 10..19: all masked
  std::vector<int32_t> qp(n), kp(n);
  for (int i = 0; i < n; ++i) qp[i] = i, kp[i] = n + i;
  Buffer<float> q = upload(*be, std::vector<float>(d.q.begin(), d.q.begin() + n * 2 * 8)),
                k = upload(*be, std::vector<float>(d.k.begin(), d.k.begin() + n * 8)), v = upload(*be, std::vector<float>(d.v.begin(), d.v.begin() + n * 8)),
                y(*be, n * 2 * 8), y2(*be, n * 2 * 8);
  AccBuffer<float> lse(*be, 2 * n), lse2(*be, 2 * n);
  IdBuffer<float> bqp(*be, n), bkp(*be, n);
  be->ids_from_host(bqp.data(), qp.data(), n);
  be->ids_from_host(bkp.data(), kp.data(), n);
  (void)be->take_block_attention_stats();
  be->attention_block_forward(y2.data(), lse2.data(), q.data(), k.data(), v.data(), bqp.data(), bkp.data(), nullptr,
                              nullptr, 1, n, n, 2, 1, 8, 0.35f);
  const auto st = be->take_block_attention_stats();
  EXPECT_EQ(st.tile_pairs, 2);
  EXPECT_EQ(st.skipped, 2);
  for (int i = 0; i < 2 * n; ++i) EXPECT_EQ(lse2.data()[i], -INFINITY);
  for (size_t i = 0; i < y2.size(); ++i) EXPECT_EQ(y2.data()[i], 0.0f);
  // Keys 0..9 (the causal diagonal block), then merge with the empty part.
  be->attention_block_forward(y.data(), lse.data(), q.data(), k.data(), v.data(), bqp.data(), bqp.data(), nullptr,
                              nullptr, 1, n, n, 2, 1, 8, 0.35f);
  const std::vector<float> y0(y.data(), y.data() + y.size()), l0(lse.data(), lse.data() + lse.size());
  be->attention_merge(y.data(), lse.data(), y2.data(), lse2.data(), 1, n, 2, 8);
  EXPECT_TRUE(std::equal(y0.begin(), y0.end(), y.data()));
  EXPECT_TRUE(std::equal(l0.begin(), l0.end(), lse.data()));
  // Both empty: stays y = 0, lse = -inf.
  be->attention_merge(y2.data(), lse2.data(), y2.data(), lse2.data(), 1, n, 2, 8);
  for (int i = 0; i < 2 * n; ++i) EXPECT_EQ(lse2.data()[i], -INFINITY);
  for (size_t i = 0; i < y2.size(); ++i) EXPECT_EQ(y2.data()[i], 0.0f);
}

// The CPU backend polls its progress registry between block-attention tiles on the calling thread.
TEST(BlockAttention, PollsProgressHook) {
  auto be = make_cpu_backend<float>();
  const Case c{1, 200, 2, 2, 16};
  const Data d = make_data(c, 11, false);
  int calls = 0;
  ProgressRegistry::Member m = be->progress()->join([](void* a) { ++*static_cast<int*>(a); }, &calls);
  const auto r = run_blocks<float>(*be, c, d, d.pos);
  m.reset();
  EXPECT_GT(calls, 0);
  EXPECT_GT(r.tile_pairs, r.skipped);
}

// Bitwise the same results with 1, 2 and 3 threads (work items are cut by shape, summed in order).
TEST(BlockAttention, BitwiseAcrossThreadCounts) {
  auto be = make_cpu_backend<float>();
  const Case c{2, 200, 4, 2, 32};
  const Data d = make_data(c, 21, true);
  const int saved = cpu_threads();
  set_cpu_threads(1);
  const auto ref = run_blocks<float>(*be, c, d, d.pos);
  for (int t : {2, 3}) {
    set_cpu_threads(t);
    const auto r = run_blocks<float>(*be, c, d, d.pos);
    EXPECT_TRUE(r.y == ref.y && r.lse == ref.lse && r.dq == ref.dq && r.dk == ref.dk && r.dv == ref.dv) << t;
    EXPECT_EQ(r.skipped, ref.skipped) << t;
  }
  set_cpu_threads(saved);
}

// ---- RoPE at per-token positions ---------------------------------------------------------------

template <typename T> void check_rope_at() {
  using A = math::Acc<T>;
  auto be = make_cpu_backend<T>();
  const int Tn = 150, H = 3, HD = 16, half = HD / 2, row = H * HD;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int j = 0; j < half; ++j) inv[static_cast<size_t>(j)] = std::pow(10000.0, -2.0 * j / HD);
  std::vector<A> cs_a, sn_a;
  if constexpr (std::is_same_v<A, double>) rope_tables<double>(cs_a, sn_a, Tn, inv);
  else rope_tables<float>(cs_a, sn_a, Tn, inv);
  std::vector<T> cs(cs_a.size()), sn(sn_a.size());
  for (size_t i = 0; i < cs.size(); ++i) cs[i] = math::st<T>(cs_a[i]), sn[i] = math::st<T>(sn_a[i]);
  std::mt19937 g(5);
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<T> x(static_cast<size_t>(Tn) * row);
  for (auto& e : x) e = math::st<T>(static_cast<A>(n(g)));
  for (bool backward : {false, true}) {
    auto apply = [&](std::vector<T> buf, int rows) {  // whole sequence(s) of `rows` rows from position 0
      if (backward) be->rope_backward(buf.data(), cs.data(), sn.data(), 1, rows, H, HD);
      else be->rope_forward(buf.data(), cs.data(), sn.data(), 1, rows, H, HD);
      return buf;
    };
    auto apply_at = [&](std::vector<T> buf, const std::vector<int32_t>& pos) {
      if (backward) be->rope_backward_at(buf.data(), cs.data(), sn.data(), pos.data(), static_cast<int>(pos.size()), H, HD);
      else be->rope_forward_at(buf.data(), cs.data(), sn.data(), pos.data(), static_cast<int>(pos.size()), H, HD);
      return buf;
    };
    auto rows_of = [&](const std::vector<T>& src, const std::vector<int32_t>& idx) {
      std::vector<T> out;
      for (int i : idx) out.insert(out.end(), src.begin() + static_cast<size_t>(i) * row, src.begin() + static_cast<size_t>(i + 1) * row);
      return out;
    };
    auto bits_eq = [](const std::vector<T>& a, const std::vector<T>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
    };
    const std::vector<T> whole = apply(x, Tn);
    // A slice [40, 97).
    std::vector<int32_t> slice;
    for (int t = 40; t < 97; ++t) slice.push_back(t);
    EXPECT_TRUE(bits_eq(apply_at(rows_of(x, slice), slice), rows_of(whole, slice))) << "slice";
    // A head-tail pair of chunks: [20, 35) and [115, 130) (chunk 1 and chunk 8 of 10), one buffer.
    std::vector<int32_t> ht;
    for (int t = 20; t < 35; ++t) ht.push_back(t);
    for (int t = 115; t < 130; ++t) ht.push_back(t);
    EXPECT_TRUE(bits_eq(apply_at(rows_of(x, ht), ht), rows_of(whole, ht))) << "head-tail";
    // Restarts per document: documents [0, 33), [33, 34), [34, 100), [100, 150), positions from 0 in
    // each; each document's rows equal a whole-sequence RoPE of that document alone.
    const std::vector<int> starts = {0, 33, 34, 100, Tn};
    std::vector<int32_t> pos;
    std::vector<T> want;
    for (size_t dd = 0; dd + 1 < starts.size(); ++dd) {
      std::vector<int32_t> idx;
      for (int t = starts[dd]; t < starts[dd + 1]; ++t) idx.push_back(t), pos.push_back(t - starts[dd]);
      const std::vector<T> doc_rows = apply(rows_of(x, idx), starts[dd + 1] - starts[dd]);
      want.insert(want.end(), doc_rows.begin(), doc_rows.end());
    }
    EXPECT_TRUE(bits_eq(apply_at(x, pos), want)) << "restarts";
  }
}
TEST(RopeAtPositions, FloatBitwiseTableRows) { check_rope_at<float>(); }
TEST(RopeAtPositions, DoubleBitwiseTableRows) { check_rope_at<double>(); }
TEST(RopeAtPositions, Bf16BitwiseTableRows) { check_rope_at<bf16>(); }

}  // namespace
}  // namespace shardtrain
