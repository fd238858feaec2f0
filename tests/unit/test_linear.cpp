// linear() (model.h): each role is the product its table says, with = and +=, against loops in
// double on the CPU backend. Uneven M, N, K so that a swapped dimension or leading dimension fails.
#include <gtest/gtest.h>

#include <random>
#include <stdexcept>
#include <vector>

#include "shardtrain/model/model.h"

using namespace shardtrain;

namespace {
std::vector<double> rnd(size_t n, std::mt19937_64& g) {
  std::normal_distribution<double> d;
  std::vector<double> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// out[r, c] (+)= sum_i a(r, i) * b(i, c) over an R x Cn result: the reference of every role.
template <typename A, typename B>
std::vector<double> product(std::vector<double> out, int R, int Cn, int In, A a, B b, bool acc) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < Cn; ++c) {
      double s = 0;
      for (int i = 0; i < In; ++i) s += a(r, i) * b(i, c);
      out[static_cast<size_t>(r * Cn + c)] = (acc ? out[static_cast<size_t>(r * Cn + c)] : 0.0) + s;
    }
  return out;
}

void expect_near(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << what << " element " << i;
}

}  // namespace

TEST(Linear, EachRoleIsItsProduct) {
  auto be = make_cpu_backend<double>();
  const int M = 5, N = 3, K = 7;
  std::mt19937_64 g(7);
  const std::vector<double> x = rnd(M * K, g), w = rnd(N * K, g), dy = rnd(M * N, g);
  auto X = [&](int i, int k) { return x[static_cast<size_t>(i * K + k)]; };   // [M, K]
  auto W = [&](int j, int k) { return w[static_cast<size_t>(j * K + k)]; };   // [N, K]
  auto DY = [&](int i, int j) { return dy[static_cast<size_t>(i * N + j)]; };  // [M, N]
  for (bool acc : {false, true}) {
    SCOPED_TRACE(acc ? "accumulate" : "overwrite");
    std::vector<double> y = rnd(M * N, g), dx = rnd(M * K, g), dw = rnd(N * K, g);
    const auto want_y = product(y, M, N, K, X, [&](int k, int j) { return W(j, k); }, acc);    // x W^T
    const auto want_dx = product(dx, M, K, N, DY, W, acc);                                    // dy W
    const auto want_dw = product(dw, N, K, M, [&](int j, int i) { return DY(i, j); }, X, acc);  // dy^T x
    linear(*be, LinearRole::Forward, M, N, K, x.data(), w.data(), y.data(), acc);
    linear(*be, LinearRole::InputGrad, M, N, K, dy.data(), w.data(), dx.data(), acc);
    linear(*be, LinearRole::WeightGrad, M, N, K, dy.data(), x.data(), dw.data(), acc);
    expect_near(y, want_y, "forward");
    expect_near(dx, want_dx, "input gradient");
    expect_near(dw, want_dw, "weight gradient");
  }
}

TEST(Linear, HeadStepsOutOfOrderAreRefused) {
  auto be = make_cpu_backend<double>();
  LlamaModel<double> m(preset("tiny"), *be);
  struct NoUnits : UnitSource<double> {
    const double* gather(int) override { throw std::runtime_error("no gather expected"); }
    double* full_grad(int) override { throw std::runtime_error("no gradient expected"); }
    void reduce_scatter_grad(int) override { throw std::runtime_error("no reduce-scatter expected"); }
  } none;
  const std::vector<int32_t> t(4, 1);
  EXPECT_THROW(m.loss(none, t.data()), std::logic_error);
  EXPECT_THROW(m.head_backward(none, t.data(), 1.0), std::logic_error);
  EXPECT_THROW(m.head_logits(none), std::logic_error);
  EXPECT_THROW(m.backward(none), std::logic_error);
}
