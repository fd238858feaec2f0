// Multi-rank tests of context-parallel attention (context_parallel.h: CpAttention, both CpComm
// methods) on MPI sub-communicators. Every CP group size g dividing the world (W = 1..4 under
// make test: g = 1, 2, 3, 4) runs in groups of g consecutive ranks. Each rank holds its head-tail
// rows (cp_rows) of B random sequences; its y, lse, and dq, dk, dv of its rows after the backward
// with a random dy must equal the corresponding rows of the whole sequences' attention computed
// here by float64 loops (causal, or causal within documents of random lengths): float64 within
// 1e-12, fp32 within 1e-5 (max |a - b| / max |b| over the rank's rows; lse: |a - b| / max(1, |b|)),
// bf16 storage within 5e-2 (of the whole sequence's max |b|; see the test).
// Also: the tile pairs the kernels computed and skipped equal the count of the kernels' tile rule
// over the blocks each method visits (block_tile_pairs), > 0 skipped, and equal work on every
// rank of a head-tail group; the ring's K/V shifts complete during the block attention (advanced
// by the backend's progress polls, no other MPI call in between); bad sizes are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "counting_backend.h"
#include "rank_test.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/parallel/context_parallel.h"
#include "shardtrain/runtime/runtime.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

struct Shape {
  int B, T, NH, NKV, HD;
  int ldq() const { return NH * HD; }
  int ldk() const { return NKV * HD; }
  std::string str() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
           " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD);
  }
};

// Whole sequences, the same on every rank (same seed). Values already rounded to the compute type.
struct Whole {
  std::vector<double> q, k, v, dy;
  std::vector<int32_t> doc;  // [B, T], empty: causal only
};

// x as the compute type T stores it (bf16: rounded to nearest even), widened back.
template <typename T> T to_t(double x) { return st::math::st<T>(static_cast<st::math::Acc<T>>(x)); }
template <typename T> double rounded(double x) { return static_cast<double>(st::math::ld(to_t<T>(x))); }

template <typename T> Whole make_whole(const Shape& s, uint32_t seed, bool with_doc) {
  std::mt19937 g(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  auto fill = [&](size_t count, double sd) {
    std::vector<double> x(count);
    for (auto& e : x) e = rounded<T>(sd * n(g));
    return x;
  };
  Whole w;
  const size_t bt = static_cast<size_t>(s.B) * s.T;
  w.q = fill(bt * s.ldq(), 1.5);
  w.k = fill(bt * s.ldk(), 1.5);
  w.v = fill(bt * s.ldk(), 1.0);
  w.dy = fill(bt * s.ldq(), 1.0);
  if (with_doc)
    for (int b = 0; b < s.B; ++b) {
      int id = static_cast<int>(g() % 5), left = 1 + static_cast<int>(g() % static_cast<uint32_t>(std::max(1, s.T / 2)));
      for (int t = 0; t < s.T; ++t) {
        if (left == 0) {
          ++id;
          left = 1 + static_cast<int>(g() % static_cast<uint32_t>(std::max(1, s.T / 2)));
        }
        --left;
        w.doc.push_back(id);
      }
    }
  return w;
}

struct Ref {
  std::vector<double> y, lse, dq, dk, dv;  // whole-sequence layout; lse [B, NH, T]
};

// Attention over whole sequences and its backward in float64 loops: query t sees key s iff s <= t
// and (documents) doc[s] == doc[t]; p = softmax of scale q_t.k_s over the visible keys;
// dP = dy_t . v_s, D_t = sum_s p dP, dS = p (dP - D_t), dq_t = scale sum_s dS k_s,
// dk_s = scale sum_t dS q_t, dv_s = sum_t p dy_t.
Ref reference(const Shape& s, const Whole& w) {
  Ref r;
  const size_t nq = static_cast<size_t>(s.B) * s.T * s.ldq(), nk = static_cast<size_t>(s.B) * s.T * s.ldk();
  r.y.assign(nq, 0);
  r.dq.assign(nq, 0);
  r.dk.assign(nk, 0);
  r.dv.assign(nk, 0);
  r.lse.assign(static_cast<size_t>(s.B) * s.NH * s.T, 0);
  const int G = s.NH / s.NKV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.HD));
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.NH; ++h)
      for (int t = 0; t < s.T; ++t) {
        const size_t qo = (static_cast<size_t>(b) * s.T + t) * s.ldq() + static_cast<size_t>(h) * s.HD;
        auto ko = [&](int u) { return (static_cast<size_t>(b) * s.T + u) * s.ldk() + static_cast<size_t>(h / G) * s.HD; };
        auto vis = [&](int u) { return w.doc.empty() || w.doc[static_cast<size_t>(b) * s.T + u] == w.doc[static_cast<size_t>(b) * s.T + t]; };
        std::vector<double> x(static_cast<size_t>(t) + 1, 0.0);
        double mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {
          if (!vis(u)) continue;
          double dot = 0;
          for (int e = 0; e < s.HD; ++e) dot += w.q[qo + e] * w.k[ko(u) + e];
          x[static_cast<size_t>(u)] = scale * dot;
          mx = std::max(mx, scale * dot);
        }
        double sum = 0;
        for (int u = 0; u <= t; ++u)
          if (vis(u)) sum += std::exp(x[static_cast<size_t>(u)] - mx);
        const double lse = mx + std::log(sum);
        r.lse[(static_cast<size_t>(b) * s.NH + h) * s.T + t] = lse;
        std::vector<double> p(static_cast<size_t>(t) + 1, 0.0), dp(p.size(), 0.0);
        double D = 0;
        for (int u = 0; u <= t; ++u) {
          if (!vis(u)) continue;
          p[static_cast<size_t>(u)] = std::exp(x[static_cast<size_t>(u)] - lse);
          for (int e = 0; e < s.HD; ++e) {
            r.y[qo + e] += p[static_cast<size_t>(u)] * w.v[ko(u) + e];
            dp[static_cast<size_t>(u)] += w.dy[qo + e] * w.v[ko(u) + e];
          }
          D += p[static_cast<size_t>(u)] * dp[static_cast<size_t>(u)];
        }
        for (int u = 0; u <= t; ++u) {
          if (!vis(u)) continue;
          const double pu = p[static_cast<size_t>(u)], ds = pu * (dp[static_cast<size_t>(u)] - D);
          for (int e = 0; e < s.HD; ++e) {
            r.dq[qo + e] += scale * ds * w.k[ko(u) + e];
            r.dk[ko(u) + e] += scale * ds * w.q[qo + e];
            r.dv[ko(u) + e] += pu * w.dy[qo + e];
          }
        }
      }
  return r;
}

// This rank's rows ([B, Tl, ld]) of a whole-sequence buffer ([B, T, ld]).
template <typename E> std::vector<E> take_rows(const std::vector<E>& x, int B, int T, int ld, const std::vector<int32_t>& rows) {
  std::vector<E> out;
  for (int b = 0; b < B; ++b)
    for (int32_t t : rows)
      for (int c = 0; c < ld; ++c) out.push_back(x[(static_cast<size_t>(b) * T + t) * ld + c]);
  return out;
}
// lse rows: [B, NH, T] -> [B, NH, Tl].
std::vector<double> take_lse(const std::vector<double>& x, int B, int NH, int T, const std::vector<int32_t>& rows) {
  std::vector<double> out;
  for (int bh = 0; bh < B * NH; ++bh)
    for (int32_t t : rows) out.push_back(x[static_cast<size_t>(bh) * T + t]);
  return out;
}

// max |a - b| / max(|b|, floor): floor = 0 for the rank's rows alone; bf16 passes the whole
// sequence's max (a rank of few rows has a small max, and bf16's rounding is relative to the values
// the whole attention works with).
double rel(const std::vector<double>& a, const std::vector<double>& b, double floor = 0) {
  double num = 0, den = floor;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  return a.size() != b.size() ? INFINITY : (den > 0 ? num / den : num);
}
double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::fabs(e));
  return m;
}
double lse_err(const std::vector<double>& a, const std::vector<double>& b) {
  double e = a.size() == b.size() ? 0.0 : INFINITY;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) e = std::max(e, std::fabs(a[i] - b[i]) / std::max(1.0, std::fabs(b[i])));
  return e;
}

// Results of one rank, widened to double.
struct Local {
  std::vector<double> y, lse, dq, dk, dv;
};

// Runs CpAttention (forward, then backward with dy) on this rank's rows of `w`, with AllGather's
// bound gather_bytes. On a CountingBackend, *scratch = the elements of T that CpAttention held
// after the backward (its scratch: live elements then, less those before it was made).
template <typename T>
Local run_cp(st::Comm& c, st::Backend<T>& be, st::CpComm m, const Shape& s, const Whole& w, st::CpCommStats* stats,
             size_t gather_bytes = st::kCpGatherBytes, size_t* scratch = nullptr) {
  using S = st::math::Acc<T>;
  const int g = c.world_size(), Tl = s.T / g;
  const std::vector<int32_t> rows = st::cp_rows(s.T, g, c.rank());
  const std::vector<int32_t> pos = st::cp_positions(s.B, s.T, g, c.rank());
  auto up = [&](const std::vector<double>& x, int ld) {
    const std::vector<double> l = take_rows(x, s.B, s.T, ld, rows);
    std::vector<T> h(l.size());
    for (size_t i = 0; i < l.size(); ++i) h[i] = to_t<T>(l[i]);
    st::Buffer<T> buf(be, h.size());
    be.from_host(buf.data(), h.data(), h.size());
    return buf;
  };
  st::Buffer<T> q = up(w.q, s.ldq()), k = up(w.k, s.ldk()), v = up(w.v, s.ldk()), dy = up(w.dy, s.ldq());
  const size_t nq = static_cast<size_t>(s.B) * Tl * s.ldq(), nk = static_cast<size_t>(s.B) * Tl * s.ldk();
  st::Buffer<T> y(be, nq), dq(be, nq), dk(be, nk), dv(be, nk);
  st::AccBuffer<T> lse(be, static_cast<size_t>(s.B) * s.NH * Tl);
  st::IdBuffer<T> bpos(be, pos.size()), bdoc(be, pos.size());
  be.ids_from_host(bpos.data(), pos.data(), pos.size());
  if (!w.doc.empty()) {
    const std::vector<int32_t> d = take_rows(w.doc, s.B, s.T, 1, rows);
    be.ids_from_host(bdoc.data(), d.data(), d.size());
  }
  const int32_t* docp = w.doc.empty() ? nullptr : bdoc.data();
  auto* counting = dynamic_cast<st::testing::CountingBackend<T>*>(&be);
  const size_t live0 = counting ? counting->live_elements() : 0;
  st::CpAttention<T> cp(c, be, m, gather_bytes);
  const S scale = S(1) / std::sqrt(static_cast<S>(s.HD));
  cp.forward(y.data(), lse.data(), q.data(), k.data(), v.data(), bpos.data(), docp, s.B, Tl, s.NH, s.NKV, s.HD, scale);
  cp.backward(dq.data(), dk.data(), dv.data(), dy.data(), q.data(), k.data(), v.data(), y.data(), lse.data(), bpos.data(),
              docp, s.B, Tl, s.NH, s.NKV, s.HD, scale);
  if (stats) *stats = cp.stats();
  if (scratch) *scratch = counting ? counting->live_elements() - live0 : 0;
  auto down = [&](const st::Buffer<T>& b) {
    std::vector<T> h(b.size());
    be.to_host(h.data(), b.data(), h.size());
    std::vector<double> out(h.size());
    for (size_t i = 0; i < h.size(); ++i) out[i] = static_cast<double>(st::math::ld(h[i]));
    return out;
  };
  Local r{down(y), std::vector<double>(lse.data(), lse.data() + lse.size()), down(dq), down(dk), down(dv)};
  return r;
}

// Groups of g consecutive world ranks (g divides W).
st::MpiComm group_comm(int g) { return st::MpiComm::split(world(), world().rank() / g, world().rank()); }

template <typename T> void check_against_loops(double tol) {
  const int W = world().world_size();
  auto be = st::make_cpu_backend<T>();
  int runs = 0;
  for (int g = 1; g <= W; ++g) {
    if (W % g) continue;
    st::MpiComm c = group_comm(g);
    for (int T_ : {16, 48, 64}) {
      if (T_ % (2 * g)) continue;
      for (int nkv : {4, 2, 1})
        for (bool with_doc : {false, true}) {
          const Shape s{2, T_, 4, nkv, 8};
          // Same data on every rank of the group (seed from the case, not the rank).
          const Whole w = make_whole<T>(s, static_cast<uint32_t>(1000 * T_ + 10 * nkv + with_doc), with_doc);
          const Ref ref = reference(s, w);
          const std::vector<int32_t> rows = st::cp_rows(T_, g, c.rank());
          const std::vector<double> ry = take_rows(ref.y, s.B, s.T, s.ldq(), rows), rq = take_rows(ref.dq, s.B, s.T, s.ldq(), rows),
                                    rk = take_rows(ref.dk, s.B, s.T, s.ldk(), rows), rv = take_rows(ref.dv, s.B, s.T, s.ldk(), rows),
                                    rl = take_lse(ref.lse, s.B, s.NH, s.T, rows);
          for (st::CpComm m : {st::CpComm::Ring, st::CpComm::AllGather}) {
            const Local l = run_cp<T>(c, *be, m, s, w, nullptr);
            auto fl = [&](const std::vector<double>& whole) { return std::is_same_v<T, st::bf16> ? max_abs(whole) : 0.0; };
            const double ey = rel(l.y, ry, fl(ref.y)), el = lse_err(l.lse, rl), eq = rel(l.dq, rq, fl(ref.dq)),
                         ek = rel(l.dk, rk, fl(ref.dk)), ev = rel(l.dv, rv, fl(ref.dv));
            const std::string what = "cp " + std::to_string(g) + " rank " + std::to_string(c.rank()) + " " +
                                     st::cp_comm_name(m) + " " + s.str() + (with_doc ? " documents" : " causal");
            EXPECT_LE(ey, tol) << what;
            EXPECT_LE(el, tol) << what;
            EXPECT_LE(eq, tol) << what;
            EXPECT_LE(ek, tol) << what;
            EXPECT_LE(ev, tol) << what;
            if ((world().rank() == W - 1 && nkv == 1 && T_ == 48) || std::max({ey, el, eq, ek, ev}) > tol / 4)
              std::printf("[ cp ] %s: y %.1e lse %.1e dq %.1e dk %.1e dv %.1e\n", what.c_str(), ey, el, eq, ek, ev);
            ++runs;
          }
        }
    }
  }
  EXPECT_GT(runs, 0);
}

}  // namespace

// One OpenMP thread per rank (results do not depend on it: the CPU backend is bitwise the same at
// every thread count): make test runs up to 4 ranks on as few as 2 cores, where the many small
// parallel regions of these shapes would otherwise spin in oversubscribed barriers.
class ContextParallel : public st::testing::RankTest {
 protected:
  void SetUp() override {
    RankTest::SetUp();
    saved_threads_ = st::cpu_threads();
    st::set_cpu_threads(1);
  }
  void TearDown() override {
    st::set_cpu_threads(saved_threads_);
    RankTest::TearDown();
  }
  int saved_threads_ = 1;
};

TEST_F(ContextParallel, Float64EqualsWholeSequenceLoops) { check_against_loops<double>(1e-12); }
TEST_F(ContextParallel, Fp32EqualsWholeSequenceLoops) { check_against_loops<float>(1e-5); }
// bf16 storage, fp32 arithmetic: every stored output is rounded to bf16, the ring's block parts of
// y before their merge (in fp32, attention_merge_acc; y rounded once at the end) and its travelling
// dK/dV partial sums after every step; y's error reaches dq and dk through D = rowsum(dy o y). Measured
// against the whole sequence's largest value (rel's floor): one rounding (cp 1, all-gather) gives
// about 4e-3, the ring under 1.25e-2 at every cp (the cases over tol / 4 print; none does; before y
// was merged in fp32, dq at cp 4, 16 tokens reached 2.2e-2): bound 5e-2, which a wrong block, mask
// or merge (errors of order 1) still fails.
TEST_F(ContextParallel, Bf16EqualsWholeSequenceLoops) { check_against_loops<st::bf16>(5e-2); }

// bf16 y against the float64 whole-sequence loops, beside the cp = 1 bf16 tiled path
// (flash_attention_forward over the whole sequences) on the same inputs: context parallelism must
// not cost accuracy. Both round y to bf16 once: the ring merges its cp parts in an fp32
// accumulator (attention_merge_acc) and rounds once at the end; the all-gather attends to all keys
// in one call. Each block's part is rounded too before its merge, so the ring's error is up to
// about sqrt(2) of the cp = 1 path's in RMS (two roundings) and up to 2x in max (half an ulp
// each). Error measures over the whole group's rows: RMS (sqrt of the summed squares / the
// reference's) and max |a - b| / max |b|. Bound: RMS <= 1.5x the cp = 1 path's, max <= 2x.
// Measured (ring / cp 1): RMS 1.24 at cp 2, 1.32 at cp 4; max 1.40, 1.64 (all-gather: 1.00).
// Merging in bf16 (y rounded at each of the cp - 1 merges, the code before attention_merge_acc)
// gave the same at cp 2 (one merge) and RMS 1.53, max 2.95 at cp 4: this test fails it.
TEST_F(ContextParallel, Bf16ErrorNoWorseThanWholeSequenceTiled) {
  using T = st::bf16;
  using S = float;
  const int W = world().world_size();
  auto be = st::make_cpu_backend<T>();
  int runs = 0;
  for (int g : {2, 4}) {
    if (W % g) continue;
    st::MpiComm c = group_comm(g);
    const Shape s{2, 512, 4, 2, 32};
    const Whole w = make_whole<T>(s, 4242u + static_cast<uint32_t>(g), false);
    const Ref ref = reference(s, w);
    // cp = 1: the whole sequences through the tiled path.
    auto up = [&](const std::vector<double>& x) {
      std::vector<T> h(x.size());
      for (size_t i = 0; i < x.size(); ++i) h[i] = to_t<T>(x[i]);
      st::Buffer<T> b(*be, h.size());
      be->from_host(b.data(), h.data(), h.size());
      return b;
    };
    st::Buffer<T> q = up(w.q), k = up(w.k), v = up(w.v), y(*be, w.q.size());
    st::AccBuffer<T> lse(*be, static_cast<size_t>(s.B) * s.NH * s.T);
    be->flash_attention_forward(y.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.NH, s.NKV, s.HD,
                                S(1) / std::sqrt(static_cast<S>(s.HD)));
    std::vector<T> yh(y.size());
    be->to_host(yh.data(), y.data(), yh.size());
    const std::vector<int32_t> rows = st::cp_rows(s.T, g, c.rank());
    std::vector<double> y1;
    for (T e : yh) y1.push_back(static_cast<double>(st::math::ld(e)));
    y1 = take_rows(y1, s.B, s.T, s.ldq(), rows);
    const std::vector<double> ry = take_rows(ref.y, s.B, s.T, s.ldq(), rows);
    // [sum (a-b)^2, sum b^2] over the group (Sum) and [max |a-b|, max |b|] (Max).
    auto errs = [&](const std::vector<double>& a) {
      double sq[2] = {0, 0}, mx[2] = {0, 0};
      for (size_t i = 0; i < a.size(); ++i) {
        const double d = a[i] - ry[i];
        sq[0] += d * d, sq[1] += ry[i] * ry[i];
        mx[0] = std::max(mx[0], std::fabs(d)), mx[1] = std::max(mx[1], std::fabs(ry[i]));
      }
      c.all_reduce(sq, 2, st::ReduceOp::Sum);
      c.all_reduce(mx, 2, st::ReduceOp::Max);
      return std::pair<double, double>{std::sqrt(sq[0] / sq[1]), mx[0] / mx[1]};
    };
    const auto [rms1, max1] = errs(y1);
    EXPECT_GT(rms1, 1e-4) << "the cp = 1 bf16 path shows no rounding: the comparison would prove nothing";
    for (st::CpComm m : {st::CpComm::Ring, st::CpComm::AllGather}) {
      const Local l = run_cp<T>(c, *be, m, s, w, nullptr);
      const auto [rms, mx] = errs(l.y);
      const std::string what = "cp " + std::to_string(g) + " " + st::cp_comm_name(m) + " " + s.str();
      EXPECT_LE(rms, 1.5 * rms1) << what;
      EXPECT_LE(mx, 2.0 * max1) << what;
      if (world().rank() == 0)
        std::printf("[ cp ] bf16 y error %s: RMS %.3e (cp 1 tiled %.3e, ratio %.2f), max %.3e (cp 1 %.3e, ratio %.2f)\n",
                    what.c_str(), rms, rms1, rms / rms1, mx, max1, mx / max1);
      ++runs;
    }
  }
  if (W % 2 == 0) {
    EXPECT_GT(runs, 0);
  }
}

// AllGather in chunks of hk KV heads: the bound gather_bytes set to exactly hk heads' chunked
// scratch, (4·cp + 4 + 3·G)·Tl·hk·HD·8 bytes (gathered K, V, dK, dV plus the packed rows), for
// hk = 1, 2, 3 of NKV = 8 (3: a last chunk of 2 heads), or all 8 heads in one chunk where their
// unchunked 4·cp·Tl·8·HD·8 bytes fit that bound (hk = 3 at cp 1). Each: y, lse, dq, dk, dv bitwise
// equal to one chunk of every head (the unchunked path), within 1e-12 of the float64
// whole-sequence loops, the same bytes sent; and the scratch CpAttention holds (counted by a
// CountingBackend) is exactly the header's list (cp_gather_scratch_bytes) and within the bound.
TEST_F(ContextParallel, AllGatherChunkedPerKvHeadEqualsUnchunkedWithinBound) {
  const int W = world().world_size();
  st::testing::CountingBackend<double> be;
  st::MpiComm c = group_comm(W);
  const Shape s{2, 48, 16, 8, 8};  // G = 2 query heads per KV head; T = 48 splits at cp 1, 2, 3, 4
  const int Tl = s.T / W, Tk = s.T, G = s.NH / s.NKV;
  const std::vector<int32_t> rows = st::cp_rows(s.T, W, c.rank());
  const size_t unchunked = static_cast<size_t>(4) * Tk * s.NKV * s.HD * sizeof(double);
  for (bool with_doc : {false, true}) {
    const Whole w = make_whole<double>(s, 999u + with_doc, with_doc);
    const Ref ref = reference(s, w);
    st::CpCommStats st_all, st_hk;
    size_t scratch_all = 0, scratch_hk = 0;
    const Local all = run_cp<double>(c, be, st::CpComm::AllGather, s, w, &st_all, SIZE_MAX, &scratch_all);
    EXPECT_EQ(scratch_all * sizeof(double), unchunked) << "unchunked: K, V, dK, dV gathered";
    EXPECT_EQ(st::cp_gather_scratch_bytes(W, Tl, s.NH, s.NKV, s.HD, sizeof(double), SIZE_MAX),
              static_cast<int64_t>(unchunked));
    for (int want : {1, 2, 3}) {
      const size_t bound = static_cast<size_t>(4 * W + 4 + 3 * G) * Tl * want * s.HD * sizeof(double);
      const int hk = unchunked <= bound ? s.NKV : want;
      {
        st::CpAttention<double> probe(c, be, st::CpComm::AllGather, bound);
        EXPECT_EQ(probe.gather_kv_heads(Tl, s.NH, s.NKV, s.HD), hk);
        st::CpAttention<double> less(c, be, st::CpComm::AllGather, std::min(bound, unchunked) - 1);
        // A byte less: one head fewer when chunked; chunked when the unchunked no longer fits.
        const size_t per_head = bound / want;
        const int fewer = hk < s.NKV ? std::max(1, hk - 1)
                                     : std::max(1, std::min(s.NKV - 1, static_cast<int>((unchunked - 1) / per_head)));
        EXPECT_EQ(less.gather_kv_heads(Tl, s.NH, s.NKV, s.HD), fewer);
      }
      const Local l = run_cp<double>(c, be, st::CpComm::AllGather, s, w, &st_hk, bound, &scratch_hk);
      const std::string what = "cp " + std::to_string(W) + " hk " + std::to_string(hk) + (with_doc ? " documents" : " causal");
      EXPECT_EQ(l.y, all.y) << what;
      EXPECT_EQ(l.lse, all.lse) << what;
      EXPECT_EQ(l.dq, all.dq) << what;
      EXPECT_EQ(l.dk, all.dk) << what;
      EXPECT_EQ(l.dv, all.dv) << what;
      EXPECT_LE(rel(l.y, take_rows(ref.y, s.B, s.T, s.ldq(), rows)), 1e-12) << what;
      EXPECT_LE(rel(l.dq, take_rows(ref.dq, s.B, s.T, s.ldq(), rows)), 1e-12) << what;
      EXPECT_LE(rel(l.dk, take_rows(ref.dk, s.B, s.T, s.ldk(), rows)), 1e-12) << what;
      EXPECT_LE(rel(l.dv, take_rows(ref.dv, s.B, s.T, s.ldk(), rows)), 1e-12) << what;
      EXPECT_DOUBLE_EQ(st_hk.bytes, st_all.bytes) << what;
      const size_t gathered = static_cast<size_t>(4) * Tk * hk * s.HD;  // K, V, dK, dV
      const size_t packed = hk < s.NKV ? static_cast<size_t>(4) * Tl * hk * s.HD + static_cast<size_t>(3) * Tl * G * hk * s.HD : 0;
      EXPECT_EQ(scratch_hk, gathered + packed) << what;
      EXPECT_EQ(st::cp_gather_scratch_bytes(W, Tl, s.NH, s.NKV, s.HD, sizeof(double), bound),
                static_cast<int64_t>(scratch_hk * sizeof(double))) << what;
      EXPECT_LE(scratch_hk * sizeof(double), bound) << what << ": the packed copies count in the bound";
      if (world().rank() == 0 && !with_doc)
        std::printf("[ cp ] all-gather cp %d, hk %d of %d KV heads: gathered %zu B + packed %zu B (bound %zu B, "
                    "unchunked %zu B), %lld transfers (unchunked %lld)\n",
                    W, hk, s.NKV, gathered * sizeof(double), packed * sizeof(double), bound, unchunked,
                    static_cast<long long>(st_hk.transfers), static_cast<long long>(st_all.transfers));
    }
  }
}

// The kernels' tile-pair counters (forward + backward) against the tile rule applied to the blocks
// each method visits: ring, this rank's rows against each rank's rows; all-gather, against the
// concatenation of all ranks' rows. Skipped pairs > 0 (the causal mask hides pairs at every cp);
// with the head-tail split and no documents every rank of the group computes the same number of
// pairs (T/(2·cp) is a multiple of the tile size here).
TEST_F(ContextParallel, TilePairsCountedAndBalanced) {
  const int W = world().world_size(), r = world().rank();
  auto be = st::make_cpu_backend<float>();
  st::MpiComm c = group_comm(W);
  const Shape s{2, 1536, 2, 1, 8};  // 1536 = 2^9 * 3: chunks of 768, 384, 256, 192 rows at cp 1..4
  for (bool with_doc : {false, true}) {
    Whole w = make_whole<float>(s, 77 + with_doc, with_doc);
    if (with_doc)  // few long documents, so that documents hide whole tiles too
      for (size_t i = 0; i < w.doc.size(); ++i) w.doc[i] = static_cast<int32_t>((i % s.T) / 400);
    for (st::CpComm m : {st::CpComm::Ring, st::CpComm::AllGather}) {
      st::CpCommStats got;
      (void)run_cp<float>(c, *be, m, s, w, &got);
      st::CpTilePairs want;
      for (int b = 0; b < s.B; ++b) {
        std::vector<int32_t> all_pos, all_doc;
        for (int o = 0; o < W; ++o) {
          const std::vector<int32_t> ro = st::cp_rows(s.T, W, o);
          all_pos.insert(all_pos.end(), ro.begin(), ro.end());
          if (with_doc)
            for (int32_t t : ro) all_doc.push_back(w.doc[static_cast<size_t>(b) * s.T + t]);
        }
        const int Tl = s.T / W;
        const int32_t* mp = all_pos.data() + static_cast<size_t>(r) * Tl;
        const int32_t* md = with_doc ? all_doc.data() + static_cast<size_t>(r) * Tl : nullptr;
        if (m == st::CpComm::AllGather) {
          const st::CpTilePairs x = st::block_tile_pairs(mp, md, Tl, all_pos.data(), with_doc ? all_doc.data() : nullptr, s.T);
          want.pairs += x.pairs, want.skipped += x.skipped;
        } else {
          for (int o = 0; o < W; ++o) {
            const st::CpTilePairs x = st::block_tile_pairs(mp, md, Tl, all_pos.data() + static_cast<size_t>(o) * Tl,
                                                           with_doc ? all_doc.data() + static_cast<size_t>(o) * Tl : nullptr, Tl);
            want.pairs += x.pairs, want.skipped += x.skipped;
          }
        }
      }
      const int64_t k = 2 * s.NH;  // forward + backward, per head
      const std::string what = std::string(st::cp_comm_name(m)) + (with_doc ? " documents" : " causal");
      EXPECT_EQ(got.tile_pairs, k * want.pairs) << what;
      EXPECT_EQ(got.skipped, k * want.skipped) << what;
      EXPECT_GT(got.skipped, 0) << what;
      std::vector<int64_t> computed(static_cast<size_t>(W));
      const int64_t mine = got.tile_pairs - got.skipped;
      c.all_gather(&mine, computed.data(), 1);
      if (!with_doc) {
        const auto [lo, hi] = std::minmax_element(computed.begin(), computed.end());
        EXPECT_EQ(*lo, *hi) << what << ": head-tail ranks compute different numbers of tile pairs";
      }
      if (r == 0) {
        std::printf("[ cp ] cp %d %s: tile pairs computed per rank", W, what.c_str());
        for (int64_t x : computed) std::printf(" %lld", static_cast<long long>(x));
        std::printf(" (skipped on rank 0: %lld of %lld)\n", static_cast<long long>(got.skipped),
                    static_cast<long long>(got.tile_pairs));
      }
    }
  }
}

// The ring's K/V shifts are started before a block's attention and complete during it: advanced
// only by the backend's progress polls (nothing else calls MPI between the start and the wait), a
// poll sees each shift complete before the wait. K and V blocks of 64 KiB (rendezvous protocol:
// Open MPI moves them only inside MPI calls). As P2p.RingShiftAdvancesDuring*: the forward is
// repeated (at most 30 times, a bound, not a wait) until one forward saw every shift complete during
// compute; on an idle machine the first does, under a loaded one (ranks descheduled in turn, so
// that the peer polls at other times) a later one. Each forward's counts must add up.
TEST_F(ContextParallel, RingShiftsAdvanceDuringBlockAttention) {
  const int W = world().world_size();
  auto be = st::make_cpu_backend<float>();
  ASSERT_NE(be->progress(), nullptr);
  st::MpiComm c = group_comm(W);
  using S = float;
  const int Tl = 256, NH = 16, NKV = 1, HD = 64, B = 1;  // MQA: much compute per byte of K/V
  const size_t nq = static_cast<size_t>(Tl) * NH * HD, nk = static_cast<size_t>(Tl) * NKV * HD;
  std::vector<float> h(nq);
  for (size_t i = 0; i < nq; ++i) h[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + c.rank()));
  st::Buffer<float> q(*be, nq), y(*be, nq), dy(*be, nq), dq(*be, nq), k(*be, nk), v(*be, nk), dk(*be, nk), dv(*be, nk);
  for (st::Buffer<float>* b : {&q, &dy}) be->from_host(b->data(), h.data(), nq);
  for (st::Buffer<float>* b : {&k, &v}) be->from_host(b->data(), h.data() + 7, nk);
  st::AccBuffer<float> lse(*be, static_cast<size_t>(NH) * Tl);
  const std::vector<int32_t> pos = st::cp_positions(B, Tl * W, W, c.rank());
  st::IdBuffer<float> bpos(*be, pos.size());
  be->ids_from_host(bpos.data(), pos.data(), pos.size());
  st::CpAttention<float> cp(c, *be, st::CpComm::Ring);
  st::CpCommStats before = cp.stats(), f;
  int tries = 0;
  int64_t all_done = 0;  // 1 when this rank's last forward saw every shift done during compute
  for (bool group_done = false; !group_done && tries < 30; ++tries) {
    c.barrier();
    cp.forward(y.data(), lse.data(), q.data(), k.data(), v.data(), bpos.data(), nullptr, B, Tl, NH, NKV, HD, S(0.125));
    const st::CpCommStats now = cp.stats();
    f.transfers = now.transfers - before.transfers;
    f.done_in_compute = now.done_in_compute - before.done_in_compute;
    f.polls = now.polls - before.polls;
    f.bytes = now.bytes - before.bytes;
    f.exposed_s = now.exposed_s - before.exposed_s;
    f.issued_s = now.issued_s - before.issued_s;
    before = now;
    EXPECT_EQ(f.transfers, 3 * (W - 1)) << "forward: k, v, positions per step but the last";
    EXPECT_DOUBLE_EQ(f.bytes, (W - 1) * (2.0 * nk * sizeof(float) + 4.0 * Tl));
    all_done = f.done_in_compute == f.transfers ? 1 : 0;
    int64_t sum = all_done;
    c.all_reduce(&sum, 1, st::ReduceOp::Sum);
    group_done = sum == W;
  }
  EXPECT_EQ(all_done, 1) << "no forward of " << tries << " saw every shift complete during the block attention ("
                         << f.done_in_compute << " of " << f.transfers << " in the last, " << f.polls << " polls)";
  if (W > 1) {
    EXPECT_GT(f.polls, 0);
  }
  cp.backward(dq.data(), dk.data(), dv.data(), dy.data(), q.data(), k.data(), v.data(), y.data(), lse.data(), bpos.data(),
              nullptr, B, Tl, NH, NKV, HD, S(0.125));
  const st::CpCommStats fb = cp.stats();
  EXPECT_EQ(fb.transfers - before.transfers, 3 * (W - 1) + (W > 1 ? 2 * W : 0)) << "backward: K/V and dK/dV shifts";
  if (world().rank() == 0)
    std::printf("[ cp ] ring at cp %d, K/V blocks of %zu KiB: forward %d: %lld of %lld shifts done during compute, "
                "exposed %.2f ms of %.2f ms issued, %lld polls; backward: %lld of %lld\n",
                W, nk * sizeof(float) / 1024, tries, static_cast<long long>(f.done_in_compute),
                static_cast<long long>(f.transfers), 1e3 * f.exposed_s, 1e3 * f.issued_s, static_cast<long long>(f.polls),
                static_cast<long long>(fb.done_in_compute - before.done_in_compute),
                static_cast<long long>(fb.transfers - before.transfers));
}

// Sizes out of range are refused with std::invalid_argument before anything is sent (every rank
// passes the same sizes and throws alike, so nothing is left unmatched).
TEST_F(ContextParallel, RefusesBadSizes) {
  auto be = st::make_cpu_backend<float>();
  st::MpiComm c = group_comm(world().world_size());
  st::Buffer<float> x(*be, 64);
  st::AccBuffer<float> l(*be, 64);
  st::IdBuffer<float> p(*be, 64);
  for (st::CpComm m : {st::CpComm::Ring, st::CpComm::AllGather}) {
    st::CpAttention<float> cp(c, *be, m);
    EXPECT_THROW(cp.forward(x.data(), l.data(), x.data(), x.data(), x.data(), p.data(), nullptr, 1, 4, 3, 2, 2, 0.5f),
                 std::invalid_argument);  // NH = 3 not a multiple of NKV = 2
    EXPECT_THROW(cp.forward(x.data(), l.data(), x.data(), x.data(), x.data(), p.data(), nullptr, 1, 0, 2, 2, 2, 0.5f),
                 std::invalid_argument);  // Tl = 0
    EXPECT_THROW(cp.backward(x.data(), x.data(), x.data(), x.data(), x.data(), x.data(), x.data(), x.data(), l.data(),
                             nullptr, nullptr, 1, 4, 2, 2, 2, 0.5f),
                 std::invalid_argument);  // no positions
    EXPECT_EQ(cp.stats().transfers, 0);
  }
}
