// Schedules (schedule.h) without a model: gradient accumulation's actions are today's loop (per
// micro-batch its forward, then its backward, over all blocks on one stage), its table says so,
// and the trainer's check accepts it and refuses what it cannot run (several micro-batches in
// flight, other ranges or stages, a split backward).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "shardtrain/parallel/schedule.h"

namespace st = shardtrain;

namespace {

// A schedule given as its action list (the orders a pipeline would have).
class Listed final : public st::Schedule {
 public:
  Listed(std::vector<st::Action> a, int stages, int m) : a_(std::move(a)), s_(stages), m_(m) {}
  std::string name() const override { return "listed"; }
  int stages() const override { return s_; }
  int microbatches() const override { return m_; }
  std::vector<st::Action> actions() const override { return a_; }

 private:
  std::vector<st::Action> a_;
  int s_, m_;
};

}  // namespace

TEST(Schedule, GradAccumulationIsTodaysLoop) {
  const st::GradAccumulation ga(4, 12);
  const std::vector<st::Action> a = ga.actions();
  ASSERT_EQ(a.size(), 8u);
  for (int m = 0; m < 4; ++m) {  // the loop train_step ran: forward m, then backward m
    EXPECT_EQ(a[2 * m], (st::Action{st::ActionKind::Forward, m, 0, 0, 12})) << "micro-batch " << m;
    EXPECT_EQ(a[2 * m + 1], (st::Action{st::ActionKind::Backward, m, 0, 0, 12})) << "micro-batch " << m;
  }
  const std::string table = ga.to_table();
  std::printf("%s", table.c_str());
  EXPECT_EQ(table,
            "gradient accumulation: 4 micro-batches, 1 stage\n"
            "stage 0 [0, 12) | F0  B0  F1  B1  F2  B2  F3  B3\n");
  EXPECT_EQ(st::one_in_flight_problem(ga, 12), "");

  const st::GradAccumulation ev(3, 2, false);  // evaluation: the forwards only
  EXPECT_EQ(ev.to_table(), "evaluation: 3 micro-batches, 1 stage\nstage 0 [0, 2) | F0  F1  F2\n");
  EXPECT_EQ(st::one_in_flight_problem(ev, 2), "");
  EXPECT_THROW(st::GradAccumulation(0, 2), std::invalid_argument);
}

TEST(Schedule, TableOfTwoStagesAndWhatTheTrainerRefuses) {
  using K = st::ActionKind;
  // 1F1B on two stages over blocks [0, 2) and [2, 4), two micro-batches.
  const Listed p({{K::Forward, 0, 0, 0, 2}, {K::Forward, 0, 1, 2, 4}, {K::Forward, 1, 0, 0, 2}, {K::Backward, 0, 1, 2, 4},
                  {K::Forward, 1, 1, 2, 4}, {K::Backward, 0, 0, 0, 2}, {K::Backward, 1, 1, 2, 4}, {K::Backward, 1, 0, 0, 2}},
                 2, 2);
  const std::string t = p.to_table();
  std::printf("%s", t.c_str());
  EXPECT_EQ(t,
            "listed: 2 micro-batches, 2 stages\n"
            "stage 0 [0, 2) | F0  F1  B0  B1\n"
            "stage 1 [2, 4) | F0  B0  F1  B1\n");
  EXPECT_NE(st::one_in_flight_problem(p, 4).find("not on one stage"), std::string::npos);
  // One stage, two micro-batches in flight.
  const Listed two({{K::Forward, 0, 0, 0, 4}, {K::Forward, 1, 0, 0, 4}, {K::Backward, 0, 0, 0, 4},
                    {K::Backward, 1, 0, 0, 4}},
                   1, 2);
  EXPECT_NE(st::one_in_flight_problem(two, 4).find("one micro-batch in flight"), std::string::npos);
  const Listed split({{K::Forward, 0, 0, 0, 4}, {K::BackwardInput, 0, 0, 0, 4}, {K::BackwardWeight, 0, 0, 0, 4}}, 1, 1);
  EXPECT_NE(st::one_in_flight_problem(split, 4).find("splits the backward"), std::string::npos);
  EXPECT_EQ(split.to_table(), "listed: 1 micro-batch, 1 stage\nstage 0 [0, 4) | F0  I0  W0\n");
}
