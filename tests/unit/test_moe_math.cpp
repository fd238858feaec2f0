// The MoE router math of backend/moe_math.h (issue 56) against references written here from its
// sources: routing against probabilities in long double and a sort of (probability desc, index
// asc); every gradient against central differences in float64; the load-balancing loss against
// transformers' load_balancing_loss_func written out (one-hot counts, mean probabilities) and its
// known values (balanced routing gives exactly k).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "shardtrain/backend/moe_math.h"

namespace m = shardtrain::math;

namespace {
std::vector<double> random_logits(std::mt19937_64& g, int E) {
  std::normal_distribution<double> d(0.0, 1.5);
  std::vector<double> x(E);
  for (double& v : x) v = d(g);
  return x;
}

struct Routed {
  std::vector<double> probs, weights;
  std::vector<int32_t> experts;
};
Routed route(const std::vector<double>& logits, int k, bool renorm) {
  const int E = static_cast<int>(logits.size());
  Routed r{std::vector<double>(E), std::vector<double>(k), std::vector<int32_t>(k)};
  m::moe_route(logits.data(), E, k, renorm, r.probs.data(), r.experts.data(), r.weights.data());
  return r;
}

// Central difference of f at x along each coordinate.
std::vector<double> central(const std::function<double(const std::vector<double>&)>& f, std::vector<double> x) {
  std::vector<double> g(x.size());
  const double h = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}
double max_abs(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s = std::max(s, std::abs(x));
  return s;
}
}  // namespace

TEST(MoeMath, RouteIsSoftmaxTopKWithTheLowerIndexWinningTies) {
  std::mt19937_64 g(7);
  for (int E : {1, 2, 8, 60, 128})
    for (int k : {1, 2, 8})
      for (bool renorm : {false, true}) {
        if (k > E) continue;
        SCOPED_TRACE(testing::Message() << "E " << E << " k " << k << " renorm " << renorm);
        const std::vector<double> x = random_logits(g, E);
        const Routed r = route(x, k, renorm);
        long double z = 0;
        for (double v : x) z += std::exp(static_cast<long double>(v));
        std::vector<int> order(E);
        std::iota(order.begin(), order.end(), 0);
        std::vector<double> p(E);
        for (int e = 0; e < E; ++e) p[e] = static_cast<double>(std::exp(static_cast<long double>(x[e])) / z);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
        double chosen = 0;
        for (int j = 0; j < k; ++j) chosen += p[order[j]];
        for (int e = 0; e < E; ++e) EXPECT_NEAR(r.probs[e], p[e], 1e-15) << e;
        for (int j = 0; j < k; ++j) {
          EXPECT_EQ(r.experts[j], order[j]) << j;
          EXPECT_NEAR(r.weights[j], renorm ? p[order[j]] / chosen : p[order[j]], 1e-15) << j;
        }
      }
  // Ties: equal logits choose the lower indices, in index order.
  const Routed t = route({0.5, 2.0, 0.5, 2.0, 2.0, -1.0}, 4, true);
  EXPECT_EQ(t.experts, (std::vector<int32_t>{1, 3, 4, 0}));
  EXPECT_NEAR(t.weights[0], t.weights[2], 0.0);
  // float agrees with double to float precision (fast_expf: 8.3e-8 relative).
  const std::vector<double> x = random_logits(g, 16);
  std::vector<float> xf(x.begin(), x.end()), pf(16), wf(2);
  std::vector<int32_t> ef(2);
  m::moe_route(xf.data(), 16, 2, true, pf.data(), ef.data(), wf.data());
  const Routed rd = route(std::vector<double>(xf.begin(), xf.end()), 2, true);
  EXPECT_EQ(ef, rd.experts);
  for (int j = 0; j < 2; ++j) EXPECT_NEAR(wf[j], rd.weights[j], 1e-6);
}

// L(logits) = sum_j a_j w_j + sum_e b_e p_e with the expert choice held (no tie within 1e-6):
// moe_route_backward(dweights = a, dprobs = b) equals the central differences.
TEST(MoeMath, RouteBackwardEqualsCentralDifferences) {
  std::mt19937_64 g(11);
  std::normal_distribution<double> d(0.0, 1.0);
  for (int E : {2, 8, 32})
    for (int k : {1, 2, 4})
      for (bool renorm : {false, true})
        for (bool with_dprobs : {false, true}) {
          if (k > E) continue;
          SCOPED_TRACE(testing::Message() << "E " << E << " k " << k << " renorm " << renorm << " dprobs " << with_dprobs);
          const std::vector<double> x = random_logits(g, E);
          std::vector<double> a(k), b(E, 0.0);
          for (double& v : a) v = d(g);
          if (with_dprobs)
            for (double& v : b) v = d(g);
          const Routed r = route(x, k, renorm);
          const auto loss = [&](const std::vector<double>& y) {
            const Routed q = route(y, k, renorm);
            EXPECT_EQ(q.experts, r.experts) << "the choice changed under the difference step";
            double l = 0;
            for (int j = 0; j < k; ++j) l += a[j] * q.weights[j];
            for (int e = 0; e < E; ++e) l += b[e] * q.probs[e];
            return l;
          };
          std::vector<double> got(E);
          m::moe_route_backward(r.probs.data(), r.experts.data(), r.weights.data(), a.data(),
                                with_dprobs ? b.data() : nullptr, E, k, renorm, got.data());
          const std::vector<double> want = central(loss, x);
          for (int e = 0; e < E; ++e) EXPECT_NEAR(got[e], want[e], 1e-8 * std::max(1.0, max_abs(want))) << e;
        }
}

// The load-balancing loss as transformers' load_balancing_loss_func computes it (no attention
// mask): expert_mask = one_hot(selected_experts) [n, k, E]; tokens_per_expert = mean over n of
// expert_mask [k, E]; router_prob_per_expert = mean over n of probs [E];
// loss = E * sum(tokens_per_expert * router_prob_per_expert) (the k slots summed).
TEST(MoeMath, AuxLossIsTransformersLoadBalancingLoss) {
  std::mt19937_64 g(5);
  const int E = 8, k = 2, n = 37;
  std::vector<Routed> rows;
  for (int t = 0; t < n; ++t) rows.push_back(route(random_logits(g, E), k, true));
  std::vector<double> count(E, 0), psum(E, 0);
  for (const Routed& r : rows) {
    for (int j = 0; j < k; ++j) count[r.experts[j]] += 1;
    for (int e = 0; e < E; ++e) psum[e] += r.probs[e];
  }
  double want = 0;
  for (int j = 0; j < k; ++j)
    for (int e = 0; e < E; ++e) {
      double tokens = 0, prob = 0;
      for (const Routed& r : rows) {
        tokens += r.experts[j] == e ? 1.0 / n : 0.0;
        prob += r.probs[e] / n;
      }
      want += tokens * prob;
    }
  want *= E;
  EXPECT_NEAR(m::moe_aux_loss(count.data(), psum.data(), E, static_cast<double>(n)), want, 1e-14 * want);
  // Balanced routing (every expert chosen equally, uniform probabilities): exactly k.
  std::vector<double> cb(E, static_cast<double>(n) * k / E), pb(E, static_cast<double>(n) / E);
  EXPECT_NEAR(m::moe_aux_loss(cb.data(), pb.data(), E, static_cast<double>(n)), static_cast<double>(k), 1e-14);
  // Everything on expert 0 with probability 1: E * k.
  std::vector<double> c0(E, 0), p0(E, 0);
  c0[0] = static_cast<double>(n) * k;
  p0[0] = n;
  EXPECT_NEAR(m::moe_aux_loss(c0.data(), p0.data(), E, static_cast<double>(n)), static_cast<double>(E * k), 1e-12);
}

// The gradient of coef * aux over n rows with respect to one row's logits (the counts held, as f
// is a count): moe_route_backward with dprobs_e = coef * moe_aux_dprob(count_e) against central
// differences of the loss recomputed from all rows.
TEST(MoeMath, AuxLossGradientEqualsCentralDifferences) {
  std::mt19937_64 g(9);
  const int E = 8, k = 2, n = 6;
  const double coef = 0.02;
  std::vector<std::vector<double>> x;
  for (int t = 0; t < n; ++t) x.push_back(random_logits(g, E));
  const auto aux = [&](const std::vector<std::vector<double>>& rows) {
    std::vector<double> count(E, 0), psum(E, 0);
    for (const auto& l : rows) {
      const Routed r = route(l, k, true);
      for (int j = 0; j < k; ++j) count[r.experts[j]] += 1;
      for (int e = 0; e < E; ++e) psum[e] += r.probs[e];
    }
    return coef * m::moe_aux_loss(count.data(), psum.data(), E, static_cast<double>(n));
  };
  std::vector<double> count(E, 0);
  for (const auto& l : x) {
    const Routed r = route(l, k, true);
    for (int j = 0; j < k; ++j) count[r.experts[j]] += 1;
  }
  for (int t : {0, 3}) {
    const Routed r = route(x[t], k, true);
    std::vector<double> dprobs(E), zero(k, 0.0), got(E);
    for (int e = 0; e < E; ++e) dprobs[e] = coef * m::moe_aux_dprob(count[e], E, static_cast<double>(n));
    m::moe_route_backward(r.probs.data(), r.experts.data(), r.weights.data(), zero.data(), dprobs.data(), E, k, true,
                          got.data());
    const std::vector<double> want = central(
        [&](const std::vector<double>& y) {
          auto rows = x;
          rows[t] = y;
          return aux(rows);
        },
        x[t]);
    // The differences' rounding: eps * aux / h = 1e-16 * 0.04 / 1e-6 ~ 4e-12 (the gradient is ~3e-5).
    for (int e = 0; e < E; ++e) EXPECT_NEAR(got[e], want[e], 2e-11 + 1e-7 * max_abs(want)) << t << " " << e;
  }
}

TEST(MoeMath, ZLossAndItsGradient) {
  std::mt19937_64 g(3);
  const std::vector<double> x = random_logits(g, 16);
  long double s = 0;
  for (double v : x) s += std::exp(static_cast<long double>(v));
  const double lse = static_cast<double>(std::log(s));
  EXPECT_NEAR(m::moe_z_loss(x.data(), 16), lse * lse, 1e-13);
  const Routed r = route(x, 2, true);
  std::vector<double> got(16, 0.0);
  m::moe_z_loss_backward(x.data(), r.probs.data(), 16, 0.5, got.data());
  const std::vector<double> want = central([](const std::vector<double>& y) { return 0.5 * m::moe_z_loss(y.data(), 16); }, x);
  for (int e = 0; e < 16; ++e) EXPECT_NEAR(got[e], want[e], 1e-8) << e;
}
