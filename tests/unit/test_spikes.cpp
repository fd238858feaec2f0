// --skip-spikes (train.h check_spike): warm-up, the z-score against the window of earlier steps,
// what enters the window (applied steps; skipped ones from the third in a row), the window's length,
// and the test hook SHARDTRAIN_TEST_SPIKE_STEP. The trainer's use of it (W = 1 and 3, checkpoints,
// resume) is tests/e2e/test_skip_spikes.sh.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "shardtrain/train/train.h"

using namespace shardtrain;

namespace {
constexpr int K = kSpikeWindow;

// A loss curve with noise: 3 + 0.1 sin(i), grad norm 1 + 0.05 cos(3 i).
double loss_at(int i) { return 3.0 + 0.1 * std::sin(i); }
double norm_at(int i) { return 1.0 + 0.05 * std::cos(3.0 * i); }

// `n` ordinary steps into `st`, none of which may be skipped at threshold z.
void feed(SpikeStats& st, int from, int n, double z) {
  for (int i = from; i < from + n; ++i) ASSERT_FALSE(check_spike(st, loss_at(i), norm_at(i), z).skip) << "step " << i;
}
}  // namespace

TEST(SkipSpikes, NothingIsJudgedUntilTheWindowIsFull) {
  SpikeStats st;
  feed(st, 0, K - 1, 3);
  // A spike during the warm-up is applied (and enters the window): there is nothing to judge it by.
  SpikeCheck c = check_spike(st, 1000, 1000, 3);
  EXPECT_FALSE(c.judged);
  EXPECT_FALSE(c.skip);
  EXPECT_EQ(st.loss.size(), static_cast<size_t>(K));
  EXPECT_EQ(st.loss.back(), 1000);
  EXPECT_EQ(st.skipped_updates, 0);
  c = check_spike(st, loss_at(K), norm_at(K), 3);
  EXPECT_TRUE(c.judged);
  EXPECT_FALSE(c.skip);
}

TEST(SkipSpikes, ZScoreAgainstTheEarlierStepsOnly) {
  SpikeStats st;
  feed(st, 0, K, 3);
  // The reference: mean and population std of the window, long double, one pass each.
  long double m = 0, q = 0;
  for (int i = 0; i < K; ++i) m += loss_at(i);
  m /= K;
  for (int i = 0; i < K; ++i) q += (loss_at(i) - m) * (loss_at(i) - m);
  const long double sd = std::sqrt(q / K);
  const double x = static_cast<double>(m + 2.5L * sd);  // z = 2.5: below 3, above 2
  SpikeStats a = st, b = st;
  const SpikeCheck ca = check_spike(a, x, norm_at(K), 3), cb = check_spike(b, x, norm_at(K), 2);
  EXPECT_NEAR(ca.loss_z, 2.5, 1e-9);
  EXPECT_NEAR(ca.loss_mean, static_cast<double>(m), 1e-12);
  EXPECT_NEAR(ca.loss_std, static_cast<double>(sd), 1e-12);
  EXPECT_FALSE(ca.skip);
  EXPECT_TRUE(cb.skip);
  // A value below the mean, however far, is never a spike.
  SpikeStats c = st;
  EXPECT_FALSE(check_spike(c, -100, norm_at(K), 3).skip);
}

TEST(SkipSpikes, ASkippedStepLeavesTheWindowAsItWas) {
  SpikeStats st;
  feed(st, 0, K + 10, 4);
  const SpikeStats before = st;
  const SpikeCheck c = check_spike(st, 50, norm_at(0), 4);
  EXPECT_TRUE(c.skip);
  EXPECT_GT(c.loss_z, 4);
  EXPECT_LE(c.grad_z, 4);
  EXPECT_EQ(st.loss, before.loss);
  EXPECT_EQ(st.grad_norm, before.grad_norm);
  EXPECT_EQ(st.skipped_updates, 1);
  EXPECT_EQ(st.skipped_in_a_row, 1);
  const std::string why = describe_spike(c, 50, norm_at(0), 4);
  EXPECT_EQ(why.rfind("loss 50 is ", 0), 0u) << why;
  EXPECT_NE(why.find(" standard deviations above the mean of the last 128 steps ("), std::string::npos) << why;
  EXPECT_EQ(why.find("grad_norm"), std::string::npos) << why;
  EXPECT_NE(why.find("(--skip-spikes 4)"), std::string::npos) << why;
  // The next ordinary step is applied and resets the run of skips.
  EXPECT_FALSE(check_spike(st, loss_at(K + 11), norm_at(K + 11), 4).skip);
  EXPECT_EQ(st.skipped_in_a_row, 0);
  EXPECT_EQ(st.skipped_updates, 1);
}

TEST(SkipSpikes, AGradNormSpikeAloneIsSkipped) {
  SpikeStats st;
  feed(st, 0, K, 6);
  const SpikeCheck c = check_spike(st, loss_at(K), 10, 6);
  EXPECT_TRUE(c.skip);
  const std::string why = describe_spike(c, loss_at(K), 10, 6);
  EXPECT_EQ(why.rfind("grad_norm 10 is ", 0), 0u) << why;
}

TEST(SkipSpikes, ALastingChangeOfLevelIsAbsorbedFromTheThirdSkipInARow) {
  SpikeStats st;
  feed(st, 0, K, 3);
  const SpikeStats before = st;
  EXPECT_TRUE(check_spike(st, 10, 1, 3).skip);
  EXPECT_TRUE(check_spike(st, 10, 1, 3).skip);
  EXPECT_EQ(st.loss, before.loss);  // two skips: the window as it was
  EXPECT_TRUE(check_spike(st, 10, 1, 3).skip);
  EXPECT_EQ(st.loss.back(), 10);  // the third enters it (the oldest value left)
  EXPECT_EQ(st.loss.size(), static_cast<size_t>(K));
  EXPECT_EQ(st.skipped_in_a_row, 3);
  // The new level soon stops being a spike.
  int skipped = 3;
  while (check_spike(st, 10, 1, 3).skip) ASSERT_LT(++skipped, K) << "the new level is never absorbed";
  EXPECT_EQ(st.skipped_in_a_row, 0);
  EXPECT_EQ(st.skipped_updates, skipped);
}

TEST(SkipSpikes, OffRecordsButNeverSkips) {
  SpikeStats st;
  feed(st, 0, K, 0);
  const SpikeCheck c = check_spike(st, 1e6, 1e6, 0);
  EXPECT_TRUE(c.judged);
  EXPECT_GT(c.loss_z, 100);
  EXPECT_FALSE(c.skip);
  EXPECT_EQ(st.loss.back(), 1e6);
  EXPECT_EQ(st.skipped_updates, 0);
}

TEST(SkipSpikes, AConstantWindowJudgesNothing) {
  SpikeStats st;
  for (int i = 0; i < K; ++i) check_spike(st, 2.0, 1.0, 3);
  const SpikeCheck c = check_spike(st, 3.0, 1.0, 3);
  EXPECT_EQ(c.loss_std, 0);
  EXPECT_EQ(c.loss_z, 0);
  EXPECT_FALSE(c.skip);
}

TEST(SkipSpikes, TheWindowHoldsTheLastValues) {
  SpikeStats st;
  feed(st, 0, 3 * K + 5, 3);
  ASSERT_EQ(st.loss.size(), static_cast<size_t>(K));
  ASSERT_EQ(st.grad_norm.size(), static_cast<size_t>(K));
  for (int i = 0; i < K; ++i) {
    EXPECT_EQ(st.loss[static_cast<size_t>(i)], loss_at(2 * K + 5 + i));
    EXPECT_EQ(st.grad_norm[static_cast<size_t>(i)], norm_at(2 * K + 5 + i));
  }
}

TEST(SkipSpikes, TestHookFromTheEnvironment) {
  unsetenv("SHARDTRAIN_TEST_SPIKE_STEP");
  unsetenv("SHARDTRAIN_TEST_SPIKE_SCALE");
  EXPECT_TRUE(test_spike_hook().steps.empty());
  EXPECT_EQ(test_spike_hook().at(5), 1.0);
  setenv("SHARDTRAIN_TEST_SPIKE_STEP", "5,9,x,-2", 1);
  TestSpike t = test_spike_hook();
  EXPECT_EQ(t.steps, (std::vector<int64_t>{5, 9}));
  EXPECT_EQ(t.at(5), 100.0);
  EXPECT_EQ(t.at(6), 1.0);
  setenv("SHARDTRAIN_TEST_SPIKE_SCALE", "50", 1);
  EXPECT_EQ(test_spike_hook().at(9), 50.0);
  unsetenv("SHARDTRAIN_TEST_SPIKE_STEP");
  unsetenv("SHARDTRAIN_TEST_SPIKE_SCALE");
}
