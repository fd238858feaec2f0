// Threads inside a rank: every CPU-backend kernel gives bitwise the same result with 1, 2, 3 and 5
// OpenMP threads (work is cut by shape, sums are taken in a fixed order), and the tiled GEMM
// agrees with a float64 loop. Shapes are chosen so that the kernels really split: GEMMs large
// enough for several tiles in M and in N, odd edges, all transpose pairs, beta 0 and 1, row
// counts beyond one piece.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"

namespace shardtrain {
namespace {

using Vec = std::vector<float>;

Vec randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  Vec v(n);
  for (auto& x : v) x = nd(g);
  return v;
}

// A double as two floats' worth of bits, so that it can be compared bitwise with the rest.
Vec bits(double d) {
  Vec v(2);
  std::memcpy(v.data(), &d, sizeof d);
  return v;
}

// Runs `op` (which fills the returned buffers from fixed inputs) with each thread count and expects
// every result to equal the 1-thread result bit for bit.
void expect_same_for_all_thread_counts(const std::string& what, const std::function<std::vector<Vec>()>& op) {
  const int saved = cpu_threads();
  set_cpu_threads(1);
  const std::vector<Vec> ref = op();
  for (int t : {2, 3, 5}) {
    set_cpu_threads(t);
    ASSERT_EQ(cpu_threads(), t);
    const std::vector<Vec> got = op();
    ASSERT_EQ(got.size(), ref.size());
    for (size_t k = 0; k < ref.size(); ++k) {
      ASSERT_EQ(got[k].size(), ref[k].size());
      size_t diff = 0, first = 0;
      for (size_t i = 0; i < ref[k].size(); ++i)
        if (std::memcmp(&got[k][i], &ref[k][i], sizeof(float)) != 0 && diff++ == 0) first = i;
      EXPECT_EQ(diff, 0u) << what << ", output " << k << ", " << t << " threads: " << diff << " of " << ref[k].size()
                          << " elements differ from 1 thread, first at " << first << " (" << got[k][first] << " vs "
                          << ref[k][first] << ")";
    }
  }
  set_cpu_threads(saved);
}

TEST(CpuThreads, GemmBitwiseAndAccurate) {
  auto be = make_cpu_backend<float>();
  struct Shape { int M, N, K; };
  // Tiles in M (the demo model's MLP shape, odd M); tiles in N once M runs out, K past one OpenBLAS
  // block; one tile.
  const std::vector<Shape> shapes{{777, 384, 128}, {20, 2001, 1000}, {5, 3, 2}};
  EXPECT_GT(cpu_gemm_tiles(777, 384, 128).first, 2);
  EXPECT_EQ(cpu_gemm_tiles(20, 2001, 1000).first, 1);  // under 2 x 64 rows: columns are cut
  EXPECT_GT(cpu_gemm_tiles(20, 2001, 1000).second, 2);
  EXPECT_EQ(cpu_gemm_tiles(5, 3, 2), std::make_pair(1, 1));
  for (Shape s : shapes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (float beta : {0.0f, 1.0f}) {
          const int lda = (ta ? s.M : s.K) + 3, ldb = (tb ? s.K : s.N) + 5, ldc = s.N + 7;
          const Vec a = randn(static_cast<size_t>(ta ? s.K : s.M) * lda, 1);
          const Vec b = randn(static_cast<size_t>(tb ? s.N : s.K) * ldb, 2);
          const Vec c0 = randn(static_cast<size_t>(s.M) * ldc, 3);
          const std::string what = "gemm " + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" +
                                   std::to_string(s.K) + (ta ? " A^T" : "") + (tb ? " B^T" : "") +
                                   " beta " + std::to_string(beta);
          Vec c;
          expect_same_for_all_thread_counts(what, [&] {
            c = c0;
            be->gemm(ta, tb, s.M, s.N, s.K, 0.5f, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
            return std::vector<Vec>{c};
          });
          // float64 reference: C = 0.5 op(A) op(B) + beta C0.
          double worst = 0;
          for (int i = 0; i < s.M; ++i)
            for (int j = 0; j < s.N; ++j) {
              double acc = 0, mag = 0;
              for (int k = 0; k < s.K; ++k) {
                const double x = ta ? a[static_cast<size_t>(k) * lda + i] : a[static_cast<size_t>(i) * lda + k];
                const double y = tb ? b[static_cast<size_t>(j) * ldb + k] : b[static_cast<size_t>(k) * ldb + j];
                acc += x * y;
                mag += std::fabs(x * y);
              }
              const double want = 0.5 * acc + beta * c0[static_cast<size_t>(i) * ldc + j];
              const double err = std::fabs(c[static_cast<size_t>(i) * ldc + j] - want) / (0.5 * mag + 1.0);
              worst = std::max(worst, err);
            }
          EXPECT_LT(worst, 4e-7 * std::sqrt(static_cast<double>(s.K)) + 1e-6) << what;
          // Padding columns of C (j >= N) are never written.
          for (int i = 0; i < s.M; ++i)
            for (int j = s.N; j < ldc; ++j)
              ASSERT_EQ(c[static_cast<size_t>(i) * ldc + j], c0[static_cast<size_t>(i) * ldc + j]) << what;
        }
}

TEST(CpuThreads, BatchedGemmBitwise) {
  auto be = make_cpu_backend<float>();
  const int T = 96, HD = 32, batch = 7;  // attention-like: scores = q k^T per head
  const Vec q = randn(static_cast<size_t>(batch) * T * HD, 4), k = randn(q.size(), 5);
  expect_same_for_all_thread_counts("gemm_strided_batched", [&] {
    Vec s(static_cast<size_t>(batch) * T * T);
    be->gemm_strided_batched(false, true, T, T, HD, 1.0f, q.data(), HD, static_cast<int64_t>(T) * HD, k.data(), HD,
                             static_cast<int64_t>(T) * HD, 0.0f, s.data(), T, static_cast<int64_t>(T) * T, batch);
    return std::vector<Vec>{s};
  });
}

TEST(CpuThreads, RowAndElementwiseKernelsBitwise) {
  auto be = make_cpu_backend<float>();
  const int N = 700, C = 96, V = 301, T = 64, R = 12, H = 3, HD = 32, B = 5;
  const Vec x = randn(static_cast<size_t>(N) * C, 6), w = randn(C, 7), dy = randn(x.size(), 8);
  expect_same_for_all_thread_counts("rmsnorm", [&] {
    Vec out(x.size()), rstd(N), dx = randn(x.size(), 9), dw = randn(C, 10);
    be->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    be->rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    return std::vector<Vec>{out, rstd, dx, dw};
  });
  const Vec sc = randn(static_cast<size_t>(R) * T * T, 11), dp = randn(sc.size(), 12);
  expect_same_for_all_thread_counts("softmax", [&] {
    Vec p = sc, d = dp;
    be->softmax_causal_forward(p.data(), R, T, 0.25f);
    be->softmax_causal_backward(d.data(), p.data(), R, T, 0.25f);
    return std::vector<Vec>{p, d};
  });
  std::vector<int32_t> tok(N);
  for (int i = 0; i < N; ++i) tok[static_cast<size_t>(i)] = (i * 37) % 50;  // tokens repeat
  const Vec logits = randn(static_cast<size_t>(N) * V, 13, 3.0f), table = randn(static_cast<size_t>(50) * C, 14);
  expect_same_for_all_thread_counts("cross_entropy, embedding", [&] {
    std::vector<int32_t> tgt(N);
    for (int i = 0; i < N; ++i) tgt[static_cast<size_t>(i)] = (i * 53) % V;
    Vec d(logits.size());
    const double loss = be->cross_entropy(d.data(), logits.data(), tgt.data(), N, V, 0.01f);
    const double loss_eval = be->cross_entropy(nullptr, logits.data(), tgt.data(), N, V, 0.0f);
    EXPECT_EQ(loss, loss_eval);
    Vec e(x.size()), dt = randn(table.size(), 15);
    be->embedding_forward(e.data(), tok.data(), table.data(), N, C);
    be->embedding_backward(dt.data(), tok.data(), dy.data(), N, C);
    return std::vector<Vec>{d, e, dt, bits(loss)};
  });
  const size_t n = 100003;
  const Vec g = randn(n, 16), u = randn(n, 17), dh = randn(n, 18);
  expect_same_for_all_thread_counts("swiglu, axpy, scale, sum_squares, adamw", [&] {
    Vec h(n), dg(n), du(n), p = g, m = u, v(n, 0.01f), y = u;
    be->swiglu_forward(h.data(), g.data(), u.data(), n);
    be->swiglu_backward(dg.data(), du.data(), dh.data(), g.data(), u.data(), n);
    be->axpy(n, 0.3f, g.data(), y.data());
    be->scale(n, 1.7f, y.data());
    const double ss = be->sum_squares(dh.data(), n);
    be->adamw(p.data(), m.data(), v.data(), dh.data(), n, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.1f, 0.5f, 3);
    return std::vector<Vec>{h, dg, du, y, p, m, v, bits(ss)};
  });
  std::vector<float> cs(static_cast<size_t>(T) * HD / 2), sn(cs.size());
  for (size_t i = 0; i < cs.size(); ++i) { cs[i] = std::cos(0.01f * i); sn[i] = std::sin(0.01f * i); }
  const Vec qk = randn(static_cast<size_t>(B) * T * H * HD, 19);
  expect_same_for_all_thread_counts("rope", [&] {
    Vec f = qk, b = qk;
    be->rope_forward(f.data(), cs.data(), sn.data(), B, T, H, HD);
    be->rope_backward(b.data(), cs.data(), sn.data(), B, T, H, HD);
    return std::vector<Vec>{f, b};
  });
}

// sum_squares against a float64 loop (the fixed-chunk partial sums must still add up).
TEST(CpuThreads, SumSquaresMatchesFloat64) {
  auto be = make_cpu_backend<float>();
  const Vec x = randn(123457, 20);
  double want = 0;
  for (float v : x) want += static_cast<double>(v) * v;
  set_cpu_threads(3);
  EXPECT_NEAR(be->sum_squares(x.data(), x.size()), want, 1e-9 * want);
  set_cpu_threads(1);
}

}  // namespace
}  // namespace shardtrain

namespace shardtrain {
namespace {

// Denormal results are flushed to zero on every thread of the backend (FTZ/DAZ), the calling thread
// and the OpenMP workers alike, so that a run's numbers do not depend on which thread computed
// them. 1e-20 * 1e-20 = 1e-40 is a denormal float (below FLT_MIN = 1.18e-38); 1e-18 * 1e-18 is not.
TEST(CpuThreads, DenormalsFlushedOnEveryThread) {
  auto be = make_cpu_backend<float>();
  for (int t : {1, 3}) {
    set_cpu_threads(t);
    const size_t n = 200000;  // several pieces: workers run some of them
    std::vector<float> x(n, 1e-20f), y(n, 0.0f), z(n, 1e-18f), w(n, 0.0f);
    be->axpy(n, 1e-20f, x.data(), y.data());
    be->axpy(n, 1e-18f, z.data(), w.data());
    size_t nonzero = 0;
    for (float v : y) nonzero += v != 0.0f;
    EXPECT_EQ(nonzero, 0u) << t << " threads: denormal results were kept";
    EXPECT_FLOAT_EQ(w[0], 1e-36f);
    EXPECT_FLOAT_EQ(w[n - 1], 1e-36f);
  }
  set_cpu_threads(1);
}

}  // namespace
}  // namespace shardtrain
