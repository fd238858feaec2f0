// Pipeline schedules (pipeline_schedule.h) without a model: the block split of issue 42 and its
// refusals; 1F1B's table against PipeDream-Flush's figure (Narayanan et al. 2021, figure 3, p = 4,
// m = 8); the interleaved table by Megatron-LM's rule (ibid., figure 4, p = 4, v = 2, m = 8); ZB-H1's;
// and for every schedule over a range of (p, v, m), the simulated step: it finishes (no rank waits
// forever, also with fewer micro-batches than stages), each micro-batch passes every chunk once
// forward and once backward, and its idle fraction equals the published bubble formula.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "shardtrain/parallel/pipeline_schedule.h"

namespace st = shardtrain;
using K = st::PipelineKind;

namespace {

std::vector<int> split(int L, int S, std::vector<int> counts = {}) {
  std::string why;
  std::vector<int> b = st::pipeline_split(L, S, counts, &why);
  EXPECT_EQ(why, "") << "L " << L << " S " << S;
  return b;
}

std::string refusal(int L, int S, std::vector<int> counts = {}) {
  std::string why;
  EXPECT_TRUE(st::pipeline_split(L, S, counts, &why).empty());
  return why;
}

std::string row(const std::string& table, int stage) {  // the cells of one stage's row
  const std::string key = "stage " + std::to_string(stage) + " ";
  const size_t at = table.find(key);
  if (at == std::string::npos) return "";
  const size_t bar = table.find("| ", at), nl = table.find('\n', at);
  return table.substr(bar + 2, nl - bar - 2);
}

}  // namespace

TEST(PipelineSchedule, EvenSplitCountsEmbeddingAndHeadAsLayers) {
  EXPECT_EQ(split(16, 2), (std::vector<int>{0, 8, 16}));    // 18 layers: 1 + 8 | 8 + 1
  EXPECT_EQ(split(5, 2), (std::vector<int>{0, 3, 5}));      // 7 layers: 4 | 3, the earlier takes the remainder
  EXPECT_EQ(split(126, 16)[1], 7);                          // llama-405b at pp 16: 7, 8 x 14, 7
  EXPECT_EQ(split(126, 16)[15], 7 + 14 * 8);
  EXPECT_EQ(split(8, 4), (std::vector<int>{0, 2, 5, 7, 8}));  // 10 layers: 3 3 2 2 -> blocks 2 3 2 1
  EXPECT_EQ(split(3, 3), (std::vector<int>{0, 1, 2, 3}));   // 5 layers would leave the head alone
  EXPECT_EQ(split(5, 4), (std::vector<int>{0, 1, 3, 4, 5}));  // then: a block each, the 5th to the lightest
  EXPECT_EQ(split(60, 32)[1], 1);                            // chunk 0 carries the embedding and one block
  EXPECT_EQ(split(2147483647, 2).back(), 2147483647);        // no overflow in L + 2
  EXPECT_EQ(split(7, 1), (std::vector<int>{0, 7}));
  EXPECT_EQ(split(6, 3, {1, 2, 3}), (std::vector<int>{0, 1, 3, 6}));  // --pp-layers
  EXPECT_NE(refusal(4, 5).find("5 model chunks for 4 transformer blocks"), std::string::npos);
  EXPECT_NE(refusal(6, 3, {1, 2, 2}).find("sum to 5, the model has 6"), std::string::npos);
  EXPECT_NE(refusal(6, 3, {0, 3, 3}).find("chunk 0 has 0 blocks"), std::string::npos);
  EXPECT_NE(refusal(6, 3, {3, 3}).find("2 counts for 3 model chunks"), std::string::npos);
  EXPECT_NE(refusal(6, 0).find("0 model chunks"), std::string::npos);
}

TEST(PipelineSchedule, Refusals) {
  EXPECT_EQ(st::pipeline_schedule_problem(K::OneFOneB, 4, 1, 1), "");  // fewer micro-batches than stages: runs
  EXPECT_NE(st::pipeline_schedule_problem(K::Interleaved, 4, 2, 6).find("6 micro-batches per step is not a multiple of --pp 4"),
            std::string::npos);
  EXPECT_NE(st::pipeline_schedule_problem(K::Interleaved, 4, 1, 8).find("at least 2 chunks"), std::string::npos);
  EXPECT_NE(st::pipeline_schedule_problem(K::OneFOneB, 4, 2, 8).find("needs --pp-schedule interleaved"), std::string::npos);
  EXPECT_NE(st::pipeline_schedule_problem(K::GPipe, 2, 1, 0).find("0 micro-batches"), std::string::npos);
  EXPECT_THROW(st::PipelineSchedule(K::Interleaved, 4, 2, 6, split(16, 8)), std::invalid_argument);
  EXPECT_THROW(st::PipelineSchedule(K::OneFOneB, 4, 1, 8, split(16, 2)), std::invalid_argument);  // bounds of 2 chunks
  st::PipelineKind k = K::GPipe;
  EXPECT_TRUE(st::parse_pipeline_kind("zero-bubble", &k));
  EXPECT_EQ(k, K::ZeroBubble);
  EXPECT_FALSE(st::parse_pipeline_kind("zb-h1", &k));
}

// PipeDream-Flush (1F1B), Narayanan et al. 2021 figure 3 (top), 4 devices, 8 micro-batches, numbered
// from 0 here: device d warms up with 3 - d forwards.
TEST(PipelineSchedule, OneFOneBIsPipeDreamFlush) {
  const st::PipelineSchedule s(K::OneFOneB, 4, 1, 8, split(16, 4));
  const std::string t = s.to_table();
  std::printf("%s", t.c_str());
  EXPECT_EQ(row(t, 0), "F0  F1  F2  F3  B0  F4  B1  F5  B2  F6  B3  F7  B4  B5  B6  B7");
  EXPECT_EQ(row(t, 1), "F0  F1  F2  B0  F3  B1  F4  B2  F5  B3  F6  B4  F7  B5  B6  B7");
  EXPECT_EQ(row(t, 2), "F0  F1  B0  F2  B1  F3  B2  F4  B3  F5  B4  F6  B5  F7  B6  B7");
  EXPECT_EQ(row(t, 3), "F0  B0  F1  B1  F2  B2  F3  B3  F4  B4  F5  B5  F6  B6  F7  B7");
  EXPECT_NE(t.find("stage 0 [0, 4) |"), std::string::npos);  // 18 layers over 4: 5 5 4 4 -> blocks 4 5 4 3
  const st::PipelineSchedule g(K::GPipe, 2, 1, 3, split(4, 2));
  EXPECT_EQ(row(g.to_table(), 1), "F0  F1  F2  B0  B1  B2");
}

// Interleaved 1F1B, 4 devices x 2 chunks, 8 micro-batches (Narayanan et al. 2021 figure 4; the order
// of Megatron-LM's forward_backward_pipelining_with_interleaving): device 0 warms up with
// (4 - 0 - 1) x 2 + (2 - 1) x 4 = 10 forwards, micro-batches in groups of 4 per chunk.
TEST(PipelineSchedule, InterleavedIsMegatrons) {
  const st::PipelineSchedule s(K::Interleaved, 4, 2, 8, split(16, 8));
  const std::string t = s.to_table();
  std::printf("%s", t.c_str());
  EXPECT_EQ(row(t, 0),
            "F0.0  F1.0  F2.0  F3.0  F0.1  F1.1  F2.1  F3.1  F4.0  F5.0  F6.0  B0.1  F7.0  B1.1  F4.1  B2.1  "
            "F5.1  B3.1  F6.1  B0.0  F7.1  B1.0  B2.0  B3.0  B4.1  B5.1  B6.1  B7.1  B4.0  B5.0  B6.0  B7.0");
  EXPECT_EQ(row(t, 3).substr(0, 6 * 6), "F0.0  F1.0  F2.0  F3.0  F0.1  B0.1  ");  // (4 - 3 - 1) x 2 + 4 = 4 warm-up
  EXPECT_NE(t.find("stage 1 [2, 5) [11, 13) |"), std::string::npos);  // chunks 1 and 5 of 18 layers over 8
}

// ZB-H1: rank r defers r weight-gradient halves; the last rank runs them latest.
TEST(PipelineSchedule, ZeroBubbleH1) {
  const st::PipelineSchedule s(K::ZeroBubble, 4, 1, 8, split(16, 4));
  const std::string t = s.to_table();
  std::printf("%s", t.c_str());
  EXPECT_EQ(row(t, 0), "F0  F1  F2  F3  I0  W0  F4  I1  W1  F5  I2  W2  F6  I3  W3  F7  I4  W4  I5  W5  I6  W6  I7  W7");
  EXPECT_EQ(row(t, 3), "F0  I0  F1  I1  F2  I2  F3  I3  W0  F4  I4  W1  F5  I5  W2  F6  I6  W3  F7  I7  W4  W5  W6  W7");
}

// Every schedule, a range of shapes: the simulated step finishes, each micro-batch runs each chunk's
// forward and backward once on the chunk's rank, and the idle fraction is the published formula's.
TEST(PipelineSchedule, SimulatedBubbleIsThePublishedFormula) {
  struct Case { K kind; int p, v, m; };
  std::vector<Case> cases;
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 5, 8, 12, 16}) {
      cases.push_back({K::GPipe, p, 1, m});
      cases.push_back({K::OneFOneB, p, 1, m});
      cases.push_back({K::ZeroBubble, p, 1, m});
      for (int v : {2, 3})
        if (m % p == 0) cases.push_back({K::Interleaved, p, v, m});
    }
  int checked = 0;
  for (const Case& c : cases) {
    const int S = c.p * c.v;
    const std::string what = std::string(st::pipeline_kind_name(c.kind)) + " p " + std::to_string(c.p) + " v " +
                             std::to_string(c.v) + " m " + std::to_string(c.m);
    const st::PipelineSchedule s(c.kind, c.p, c.v, c.m, split(4 * S, S));
    std::map<std::tuple<int, int, int>, int> seen;  // (kind, micro-batch, chunk) -> count
    for (const st::Action& a : s.actions()) {
      EXPECT_EQ(a.stage, a.chunk % c.p) << what;
      seen[{static_cast<int>(a.kind), a.microbatch, a.chunk}]++;
    }
    const bool zb = c.kind == K::ZeroBubble;
    EXPECT_EQ(seen.size(), static_cast<size_t>(c.m) * S * (zb ? 3 : 2)) << what;
    for (const auto& [key, n] : seen) EXPECT_EQ(n, 1) << what;
    const st::PipelineTimeline tl = st::simulate(s, {st::ActionTimes{}});  // F 1, B 2 (I 1 + W 1)
    ASSERT_EQ(tl.error, "") << what;
    // The formulas hold where the pipeline reaches its steady state: m >= p.
    const bool steady = c.m >= c.p;
    const double want = s.ideal_bubble(1, 1, 1);
    const double rank0 = tl.idle[0];
    if (steady) {
      EXPECT_NEAR(rank0, want, 1e-12) << what;
      ++checked;
    } else {
      EXPECT_GE(rank0 + 1e-12, want) << what << ": the formula is a lower bound";
    }
    const int peak = *std::max_element(tl.peak_in_flight.begin(), tl.peak_in_flight.end());
    if (c.kind == K::OneFOneB || zb) {
      EXPECT_LE(peak, std::min(c.p, c.m)) << what;  // 1F1B's memory, ZB-H1's too
    }
    if (c.kind == K::GPipe) {
      EXPECT_EQ(peak, c.m) << what;
    }
  }
  EXPECT_GT(checked, 40);
  // The headline numbers of issue 42: p 4, m 8.
  auto idle = [](K k, int v) {
    const st::PipelineSchedule s(k, 4, v, 8, split(16, 4 * v));
    return st::simulate(s, {st::ActionTimes{}}).idle[0];
  };
  std::printf("idle at p 4, m 8: 1f1b %.4f, interleaved v 2 %.4f, zero-bubble %.4f, gpipe %.4f\n", idle(K::OneFOneB, 1),
              idle(K::Interleaved, 2), idle(K::ZeroBubble, 1), idle(K::GPipe, 1));
  EXPECT_NEAR(idle(K::OneFOneB, 1), 3.0 / 11, 1e-12);      // (p-1)/(m+p-1)
  EXPECT_NEAR(idle(K::Interleaved, 2), 3.0 / 19, 1e-12);   // (p-1)/(vm+p-1)
  EXPECT_NEAR(idle(K::ZeroBubble, 1), 3.0 / 27, 1e-12);    // (p-1)/(3m+p-1): a third of 1F1B's idle time
  // Unequal times, per chunk too: the formulas against the simulation (ZB-H1 with a W longer than
  // the slot it fills: the paper's formula plus the excess, ideal_bubble's extension).
  for (const auto& [tf, ti, tw] : std::vector<std::tuple<double, double, double>>{
           {1, 1, 1}, {1, 2, 1}, {2, 1, 1}, {1, 1, 0.5}, {1, 0.5, 1}, {1, 1, 2}, {1, 1, 3}, {3, 2, 1}}) {
    const st::ActionTimes at{tf, ti + tw, ti, tw};
    for (K k : {K::OneFOneB, K::GPipe, K::ZeroBubble}) {
      const st::PipelineSchedule s(k, 4, 1, 16, split(16, 4));
      EXPECT_NEAR(st::simulate(s, {at}).idle[0], s.ideal_bubble(tf, ti, tw), 1e-12)
          << st::pipeline_kind_name(k) << " tf " << tf << " ti " << ti << " tw " << tw;
    }
    const st::PipelineSchedule il(K::Interleaved, 4, 2, 16, split(16, 8));
    EXPECT_NEAR(st::simulate(il, {at}).idle[0], il.ideal_bubble(tf, ti, tw), 1e-12) << "interleaved tf " << tf;
  }
}

TEST(PipelineSchedule, SimulationReportsAScheduleThatCannotFinish) {
  // Rank 1 runs backward before the forward that feeds it: waits forever.
  class Bad final : public st::Schedule {
   public:
    std::string name() const override { return "bad"; }
    int stages() const override { return 2; }
    int microbatches() const override { return 1; }
    std::vector<st::Action> actions() const override {
      using A = st::ActionKind;
      return {{A::Forward, 0, 0, 0, 1, 0}, {A::Backward, 0, 0, 0, 1, 0}, {A::Backward, 0, 1, 1, 2, 1}, {A::Forward, 0, 1, 1, 2, 1}};
    }
  };
  const st::PipelineTimeline tl = st::simulate(Bad{}, {st::ActionTimes{}});
  EXPECT_NE(tl.error.find("waits forever"), std::string::npos) << tl.error;
  // Evaluation: forwards only, in training's order (micro-batches in groups of p per chunk), so that
  // the pipeline fills: at p 4, v 2, m 8, F = 1, 8 x 2 forwards per rank and 3 x 1 of fill.
  const st::PipelineSchedule ev(K::Interleaved, 2, 2, 2, split(8, 4), false);
  EXPECT_EQ(row(ev.to_table(), 0), "F0.0  F1.0  F0.1  F1.1");
  EXPECT_EQ(st::simulate(ev, {st::ActionTimes{}}).error, "");
  const st::PipelineSchedule ev8(K::Interleaved, 4, 2, 8, split(16, 8), false);
  EXPECT_DOUBLE_EQ(st::simulate(ev8, {st::ActionTimes{}}).makespan, 8 * 2 + 3);
  // Times: one for all chunks or one per chunk; negative ones refused.
  EXPECT_NE(st::simulate(ev8, {st::ActionTimes{}, st::ActionTimes{}}).error.find("2 action times for 8 chunks"), std::string::npos);
  EXPECT_NE(st::simulate(ev8, {st::ActionTimes{-1, 2, 1, 1}}).error.find("negative"), std::string::npos);
  EXPECT_EQ(st::simulate(ev8, std::vector<st::ActionTimes>(8)).error, "");
  // Tables stay readable past 99 micro-batches: cells widen.
  const st::PipelineSchedule big(K::OneFOneB, 2, 1, 102, split(4, 2));
  EXPECT_NE(row(big.to_table(), 0).find("F100 B99  F101 B100 B101"), std::string::npos) << row(big.to_table(), 0);
  EXPECT_THROW(st::PipelineSchedule(K::GPipe, 2, 1, 2, {0, 3, 2}), std::invalid_argument);  // decreasing bounds
}
