// Per-element math shared with the GPU: fast_expf accuracy, AdamW against an independent float64
// transcription of torch.optim.AdamW, and the LR schedule.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>

#include "shardtrain/backend/ops_math.h"
#include "shardtrain/train/train.h"

using namespace shardtrain;

TEST(OpsMath, FastExpfWithinOneEpsilonOfDoubleExp) {
  double worst = 0;
  for (float x = -87.0f; x < 88.0f; x += 1.37e-4f) {
    double ref = std::exp(static_cast<double>(x));
    double rel = std::fabs(math::fast_expf(x) - ref) / ref;
    worst = std::max(worst, rel);
  }
  EXPECT_LT(worst, static_cast<double>(FLT_EPSILON));
  EXPECT_EQ(math::fast_expf(0.0f), 1.0f);
}

TEST(OpsMath, FastExpfSaturatesAndPropagatesNaN) {
  EXPECT_GT(math::fast_expf(-1000.0f), 0.0f);
  EXPECT_LT(math::fast_expf(-1000.0f), 1.2e-38f);
  EXPECT_TRUE(std::isfinite(math::fast_expf(1000.0f)));
  EXPECT_GT(math::fast_expf(1000.0f), 1e38f);
  EXPECT_TRUE(std::isnan(math::fast_expf(std::numeric_limits<float>::quiet_NaN())));
  // sigmoid stays in [0, 1] at the extremes.
  EXPECT_NEAR(math::sigmoid(-200.0f), 0.0f, 1e-30f);
  EXPECT_EQ(math::sigmoid(200.0f), 1.0f);
}

TEST(OpsMath, AdamWMatchesReferenceOverManySteps) {
  // Reference: torch.optim.AdamW's update written out in float64, fed the same gradients.
  const double lr = 1e-2, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1;
  float p = 0.7f, m = 0, v = 0;
  double P = 0.7, M = 0, Vv = 0;
  for (int t = 1; t <= 50; ++t) {
    double g = std::sin(0.3 * t) + 0.1;
    P *= 1 - lr * wd;
    M = b1 * M + (1 - b1) * g;
    Vv = b2 * Vv + (1 - b2) * g * g;
    double mh = M / (1 - std::pow(b1, t)), vh = Vv / (1 - std::pow(b2, t));
    P -= lr * mh / (std::sqrt(vh) + eps);
    math::adamw<float>(&p, &m, &v, static_cast<float>(g), lr, b1, b2, eps, wd, 1 - std::pow(b1, t), 1 - std::pow(b2, t));
    ASSERT_NEAR(p, P, 1e-5) << "step " << t;
  }
}

TEST(OpsMath, LrScheduleWarmupThenCosine) {
  TrainConfig tc;
  tc.lr = 1e-3;
  tc.min_lr = 1e-4;
  tc.warmup = 100;
  tc.steps = 2000;
  EXPECT_DOUBLE_EQ(lr_at(tc, 0), 1e-5);
  EXPECT_DOUBLE_EQ(lr_at(tc, 49), 5e-4);
  EXPECT_DOUBLE_EQ(lr_at(tc, 99), 1e-3);
  EXPECT_DOUBLE_EQ(lr_at(tc, 100), 1e-3);
  EXPECT_NEAR(lr_at(tc, 100 + 950), 0.5 * (1e-3 + 1e-4), 1e-12);  // half way: cos = 0
  EXPECT_NEAR(lr_at(tc, 2000), 1e-4, 1e-15);
  for (int64_t s = 101; s < 2000; ++s) ASSERT_LE(lr_at(tc, s), lr_at(tc, s - 1));
}
