// Pipeline transfers on stream-ordered Comms (NCCL; pipeline.h, issue 42 item 9): the groups each
// pipeline rank starts (pipeline_p2p_groups) run to the end on p2p_groups_problem's model of NCCL
// (a rank's groups one after another, transfers matched in start order per pair of ranks, no tags)
// for every schedule, small (p, m, v), training and evaluation, in the order pipeline_p2p_order
// picks (a slot per action; interleaved training: a forward and the next backward as one slot);
// every send's matching receive expects the same chunk, direction and micro-batch. And the model can fail: the MPI path's order
// (receives posted ahead, each transfer alone) and the grouped order with its groups split into
// single transfers both deadlock, and a receive order swapped between two micro-batches is named.
// The link starts exactly these groups over MPI (tests/mpi/test_pipeline.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/parallel/pipeline_schedule.h"

namespace shardtrain {
namespace {

PipelineLayout layout(PipelineKind kind, int p, int v, int layers) {
  PipelineLayout pl;
  pl.kind = kind;
  pl.ranks = p;
  pl.chunks_per_rank = v;
  std::string why;
  pl.bounds = pipeline_split(layers, p * v, {}, &why);
  EXPECT_EQ(why, "");
  return pl;
}

std::vector<P2pGroups> plan(const Schedule& s, const PipelineLayout& pl, P2pOrder o = P2pOrder::PerAction) {
  std::vector<P2pGroups> g;
  for (int r = 0; r < pl.ranks; ++r) g.push_back(pipeline_p2p_groups(s, pl, r, o));
  return g;
}

TEST(PipelineGroups, EverySchedulesGroupsRunToTheEndOnAStreamOrderedComm) {
  struct Case {
    PipelineKind k;
    int v;
  };
  int runs = 0;
  for (Case c : {Case{PipelineKind::GPipe, 1}, Case{PipelineKind::OneFOneB, 1}, Case{PipelineKind::Interleaved, 2},
                 Case{PipelineKind::Interleaved, 3}, Case{PipelineKind::ZeroBubble, 1}})
    for (int p = 2; p <= 5; ++p)
      for (int m = 1; m <= 4 * p; ++m) {
        if (!pipeline_schedule_problem(c.k, p, c.v, m).empty()) continue;
        const PipelineLayout pl = layout(c.k, p, c.v, 2 * p * c.v);
        for (bool backward : {true, false}) {
          const auto s = pl.schedule(m, backward);
          SCOPED_TRACE(std::string(pipeline_kind_name(c.k)) + " p " + std::to_string(p) + " v " + std::to_string(c.v) +
                       " m " + std::to_string(m) + (backward ? " training" : " evaluation"));
          std::string why;
          const P2pOrder order = pipeline_p2p_order(*s, pl, &why);
          EXPECT_EQ(why, "");
          // One slot per action runs every schedule but interleaved training with a steady state
          // (m > p), whose chunks wrap from the last rank to the first: there each rank's head group
          // would send a gradient down the ring (Megatron-LM groups a forward with the next backward
          // there too).
          const bool wraps = c.k == PipelineKind::Interleaved && backward && m > p;
          EXPECT_EQ(order, wraps ? P2pOrder::PerPair : P2pOrder::PerAction);
          if (wraps) {
            EXPECT_TRUE(p2p_groups_problem(plan(*s, pl, P2pOrder::PerAction)).starts_with("deadlock"));
          }
          const std::vector<P2pGroups> g = plan(*s, pl, order);
          EXPECT_EQ(p2p_groups_problem(g), "");
          // Every transfer the schedule implies is in a group: S - 1 boundaries each way per micro-batch.
          size_t transfers = 0;
          for (const auto& r : g)
            for (const auto& grp : r) transfers += grp.size();
          const size_t per_direction = static_cast<size_t>(m) * static_cast<size_t>(p * c.v - 1);
          EXPECT_EQ(transfers, 2 * (backward ? 2 : 1) * per_direction);  // each counted at both ends
          ++runs;
        }
      }
  EXPECT_GT(runs, 100);
}

TEST(PipelineGroups, OneFOneBPairsASendWithTheNextActionsReceive) {
  // p 2, m 2: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1 (Narayanan et al. 2021, figure 4 top).
  const PipelineLayout pl = layout(PipelineKind::OneFOneB, 2, 1, 4);
  const auto s = pl.schedule(2);
  const P2pGroups r0 = pipeline_p2p_groups(*s, pl, 0), r1 = pipeline_p2p_groups(*s, pl, 1);
  const P2pGroups want0 = {{{false, 1, 0, false, 0}},                           // after F0: its output
                           {{false, 1, 0, false, 1}, {true, 1, 1, true, 0}},     // after F1, with B0's gradient
                           {{true, 1, 1, true, 1}}};                             // B0 sends nothing; B1's gradient
  const P2pGroups want1 = {{{true, 0, 0, false, 0}},                            // F0's input
                           {{false, 0, 1, true, 0}, {true, 0, 0, false, 1}},     // after B0, with F1's input
                           {{false, 0, 1, true, 1}}};                            // after B1
  EXPECT_EQ(r0, want0);
  EXPECT_EQ(r1, want1);
}

TEST(PipelineGroups, TheModelFindsDeadlocksAndMismatches) {
  const PipelineLayout pl = layout(PipelineKind::OneFOneB, 2, 1, 4);
  // The MPI path's start order, each transfer alone: stage 0 posts both gradients' receives ahead,
  // stage 1 both activations': each receive waits for a send queued behind the other's receive.
  const std::vector<P2pGroups> mpi_order = {
      {{{true, 1, 1, true, 0}}, {{true, 1, 1, true, 1}}, {{false, 1, 0, false, 0}}, {{false, 1, 0, false, 1}}},
      {{{true, 0, 0, false, 0}}, {{true, 0, 0, false, 1}}, {{false, 0, 1, true, 0}}, {{false, 0, 1, true, 1}}}};
  EXPECT_TRUE(p2p_groups_problem(mpi_order).starts_with("deadlock: rank 0 in its group 0")) << p2p_groups_problem(mpi_order);
  // The grouped order with each group split into single transfers: 1F1B's steady state sends
  // towards each other (stage 1 B0's gradient, stage 0 F1's output) before receiving.
  for (int p : {2, 4}) {
    const PipelineLayout q = layout(PipelineKind::OneFOneB, p, 1, 2 * p);
    const auto s = q.schedule(2 * p);
    std::vector<P2pGroups> split = plan(*s, q);
    for (auto& r : split) {
      P2pGroups singles;
      for (const auto& g : r)
        for (const auto& t : g) singles.push_back({t});
      r = singles;
    }
    EXPECT_TRUE(p2p_groups_problem(split).starts_with("deadlock")) << "p " << p;
  }
  // Stage 1 receiving micro-batches 0 and 1 the other way round: NCCL would deliver the wrong rows.
  const auto s = pl.schedule(2);
  std::vector<P2pGroups> swapped = plan(*s, pl);
  std::swap(swapped[1][0][0].microbatch, swapped[1][1][1].microbatch);
  EXPECT_EQ(p2p_groups_problem(swapped),
            "transfer 0 from rank 0 to rank 1 carries the output of chunk 0 for micro-batch 0 but is received as the "
            "output of chunk 0 for micro-batch 1");
  // A receive nobody sends.
  std::vector<P2pGroups> extra = plan(*s, pl);
  extra[0].push_back({{true, 1, 1, true, 2}});
  EXPECT_EQ(p2p_groups_problem(extra), "rank 1 sends 2 transfers to rank 0, which receives 3 from it");
}

}  // namespace
}  // namespace shardtrain
