// shardtrain pipeline schedules: the order in which each pipeline rank runs the forward and backward
// of its model chunks over an optimizer step's micro-batches (issue 42). Schedule objects in the
// sense of schedule.h: they know no model and no communicator, so each is tested alone as a table
// of actions per rank and by simulate() against the published bubble formulas.
//
// Terms. p pipeline ranks, v chunks per rank (virtual stages; v = 1 except `interleaved`), m
// micro-batches per step. The model's L transformer blocks are cut into S = p·v contiguous chunks
// in model order (pipeline_split); chunk c runs on pipeline rank c mod p, so rank r holds chunks
// r, r + p, ... (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
// Clusters Using Megatron-LM", section 2.2.2). Action::stage is the pipeline rank that runs an
// action, Action::chunk its chunk, [begin, end) the chunk's blocks; the embedding belongs to chunk
// 0, the final norm, head and loss to chunk S - 1.
//
// The schedules, each rank's actions in the order it runs them:
//   gpipe        all m forwards, then all m backwards, micro-batches in order (Huang et al. 2019,
//                "GPipe"; the backward order of torch.distributed.pipelining's ScheduleGPipe).
//   1f1b         rank r: min(p - 1 - r, m) warm-up forwards, then one forward and one backward in
//                turn, then the remaining backwards (PipeDream-Flush: Narayanan et al. 2021, figure
//                3, top; Schedule1F1B). At most p - r micro-batches in flight on rank r.
//   interleaved  1F1B over v chunks per rank (Narayanan et al. 2021, figure 4; Megatron-LM's
//                forward_backward_pipelining_with_interleaving): the k-th forward of a rank runs
//                chunk (k mod p·v) div p on micro-batch (k div p·v)·p + k mod p, the k-th backward
//                the same with the chunk order reversed; rank r warms up with (p - r - 1)·2 +
//                (v - 1)·p forwards (all m·v when m = p). Needs m a multiple of p (Megatron's rule;
//                refused otherwise).
//   zero-bubble  ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1):
//                1F1B's order with each backward split into I (input gradients, on the critical
//                path) and W (weight gradients); rank r defers up to r of its W, each W running
//                after a later I, the rest at the end. Every rank then holds at most p micro-batches
//                between forward and W, 1F1B's peak (rank 0's), and with equal F, I and W times the
//                step is 3m + p - 1 of them: the bubble is (p - 1)(T_F + T_I - T_W) against 1F1B's
//                (p - 1)(T_F + T_I + T_W) (ibid., section 3.1).
// Every schedule runs any m >= 1 except `interleaved` (m a multiple of p): fewer micro-batches than
// ranks make 1F1B and ZB-H1 warm up with all of them, never wait on a micro-batch that does not
// exist (tested by simulate(), which reports a schedule that cannot finish).
#pragma once

#include <string>
#include <vector>

#include "shardtrain/runtime/pipeline_kind.h"  // PipelineKind, its names
#include "shardtrain/parallel/schedule.h"

namespace shardtrain {

// The chunk boundaries of L blocks over S chunks: S + 1 numbers, 0 = b[0] <= ... <= b[S] = L, chunk
// c has blocks [b[c], b[c+1]). Even split (issue 42, item 1): the embedding and the head each count
// as one layer, L + 2 layers are cut evenly with earlier chunks taking the remainder, and chunk 0
// then holds one layer fewer of blocks (the embedding), chunk S - 1 likewise (the head). Where that
// would leave a chunk without a block (L + 2 < 2S), every chunk gets one block and each further
// block goes to the chunk with the fewest layers (embedding and head counted), earliest first.
// `counts` non-empty (--pp-layers): the blocks of each chunk by hand. "" in *why and the bounds, or
// an empty vector and *why naming the numbers: S < 1, S > L (more chunks than blocks), counts not
// S long, a count < 1, counts not summing to L.
std::vector<int> pipeline_split(int layers, int chunks, const std::vector<int>& counts, std::string* why);

// "" when the schedule can run p ranks with v chunks each over m micro-batches, else the reason,
// naming the numbers: p < 1, m < 1, v < 1, v > 1 with a schedule other than interleaved,
// interleaved with v < 2 or m not a multiple of p.
std::string pipeline_schedule_problem(PipelineKind kind, int ranks, int chunks_per_rank, int microbatches);

class PipelineSchedule final : public Schedule {
 public:
  // bounds: pipeline_split's S + 1 boundaries with S = ranks · chunks_per_rank. backward = false:
  // evaluation, every rank's forwards only, in the order training runs them (for interleaved,
  // micro-batches in groups of p per chunk, as Megatron-LM's forward-only pass).
  // std::invalid_argument with pipeline_schedule_problem's reason, or when bounds is not S + 1
  // long, does not start at 0 or decreases.
  PipelineSchedule(PipelineKind kind, int ranks, int chunks_per_rank, int microbatches, std::vector<int> bounds,
                   bool backward = true);
  std::string name() const override;
  int stages() const override { return p_; }
  int microbatches() const override { return m_; }
  std::vector<Action> actions() const override;
  PipelineKind kind() const { return kind_; }
  int chunks_per_rank() const { return v_; }
  // The bubble of the schedule's published formula, as a fraction of the step (idle / makespan),
  // with forward, backward-input and backward-weight times tf, ti, tw per chunk (tb = ti + tw):
  //   gpipe, 1f1b:  (p-1)(tf+tb) / (m(tf+tb) + (p-1)(tf+tb)) = (p-1)/(m+p-1)   (GPipe, section 2.2)
  //   interleaved:  (p-1)(tf+tb)/v / (m(tf+tb) + (p-1)(tf+tb)/v)                (Narayanan 2021, 2.2.2)
  //   zero-bubble:  (p-1)(tf+ti-tw) / (m(tf+tb) + (p-1)(tf+ti-tw))            (Qi et al. 2024, 3.1)
  //                 for tw <= min(tf, ti); a longer W adds (p-1)(tw - min(tf, ti)) to the idle time
  // per rank time with v chunks counted as v times a chunk's. 0 in evaluation (no formula).
  double ideal_bubble(double tf, double ti, double tw) const;

 private:
  PipelineKind kind_;
  int p_, v_, m_;
  std::vector<int> bounds_;
  bool backward_;
};

// Durations of a chunk's actions (any unit): Forward, Backward (= BackwardInput + BackwardWeight
// when those are given separately), BackwardInput, BackwardWeight.
struct ActionTimes {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1;
};

// Each rank runs its actions in order, each as soon as the rank is free and its inputs exist:
// Forward (m, c) after Forward (m, c - 1); Backward or BackwardInput (m, c) after Forward (m, c)
// and after the Backward or BackwardInput of (m, c + 1); BackwardWeight (m, c) after
// BackwardInput (m, c). Point-to-point transfers take no time. `times` per chunk (S entries), or
// one entry for every chunk; another count, or a negative time, is reported in `error`.
struct PipelineTimeline {
  std::string error;               // "" or why the schedule cannot finish (a rank waits forever)
  double makespan = 0;             // end of the last action
  std::vector<double> busy;        // per rank: the sum of its actions' durations
  std::vector<double> idle;        // per rank: (makespan - busy) / makespan
  std::vector<int> peak_in_flight;  // per rank: most micro-batch chunks between Forward and the end
                                    // of their backward (Backward, or BackwardWeight when split)
};
PipelineTimeline simulate(const Schedule& s, const std::vector<ActionTimes>& times);

}  // namespace shardtrain
