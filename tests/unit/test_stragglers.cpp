// straggler_stats (train.h): min / median / max of every rank's per-step compute and wait time, and
// the slowest rank flagged when its compute time is more than the threshold x the median.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "shardtrain/train/train.h"

namespace st = shardtrain;

TEST(Stragglers, OddCountMedianAndFlag) {
  const st::StragglerStats s = st::straggler_stats({10, 31, 12}, {20, 1, 18});
  EXPECT_EQ(s.compute_min, 10);
  EXPECT_EQ(s.compute_median, 12);
  EXPECT_EQ(s.compute_max, 31);
  EXPECT_EQ(s.wait_min, 1);
  EXPECT_EQ(s.wait_median, 18);
  EXPECT_EQ(s.wait_max, 20);
  EXPECT_EQ(s.slowest, 1);
  EXPECT_TRUE(s.flagged);  // 31 > 1.2 x 12
}

TEST(Stragglers, EvenCountMedianIsTheMeanOfTheMiddleTwo) {
  const st::StragglerStats s = st::straggler_stats({10, 20, 30, 40}, {0, 0, 0, 0});
  EXPECT_EQ(s.compute_median, 25);
  EXPECT_EQ(s.slowest, 3);
  EXPECT_TRUE(s.flagged);  // 40 > 30
}

TEST(Stragglers, ThresholdIsStrict) {
  EXPECT_FALSE(st::straggler_stats({10, 10, 12}, {0, 0, 0}).flagged);    // 12 = 1.2 x 10: not more
  EXPECT_TRUE(st::straggler_stats({10, 10, 12.01}, {0, 0, 0}).flagged);
  EXPECT_FALSE(st::straggler_stats({10, 10, 14}, {0, 0, 0}, 1.5).flagged);
}

TEST(Stragglers, OneRankIsNeverFlaggedAndNoneHasNoSlowest) {
  const st::StragglerStats one = st::straggler_stats({100}, {5});
  EXPECT_FALSE(one.flagged);
  EXPECT_EQ(one.slowest, 0);
  EXPECT_EQ(one.compute_min, one.compute_max);
  EXPECT_EQ(st::straggler_stats({}, {}).slowest, -1);
  EXPECT_THROW(st::straggler_stats({1, 2}, {1}), std::invalid_argument);
}
