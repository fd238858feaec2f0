// shardtrain schedules: which micro-batch runs forward or backward of which range of blocks, in
// which order (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019, "PipeDream"; zero-bubble
// schedules split the backward into its input and weight parts, Qi et al. 2023). A schedule is a
// list of Actions, per stage in the order that stage runs them; StageRunner runs what it yields
// (stage_runner.h; src/train/trainer.cpp train_step, src/train/train.cpp evaluate). Gradient
// accumulation is the schedule of one stage over all blocks; the pipeline schedules are in
// pipeline_schedule.h.
// A schedule knows no model: it can be built and printed (to_table) without one.
#pragma once

#include <string>
#include <vector>

namespace shardtrain {

// What an action runs on its micro-batch and range (model.h, LlamaModel's range calls):
//   Forward:        forward() of the range (from the tokens when it starts at block 0, else from
//                   the previous range's output); on a range that ends at the last block, in
//                   evaluation, also the loss.
//   Backward:       the whole backward of the range: on a range ending at the last block the LM
//                   head and loss with their backward (head_backward) first, then backward().
//   BackwardInput:  the input-gradient half of Backward (zero-bubble schedules): head_backward on
//                   the last range, then backward_input() (model.h), which keeps what the weight
//                   gradients need in the micro-batch's context.
//   BackwardWeight: the weight-gradient half: backward_weight(), the deferred GEMMs and the
//                   reduce-scatter of each unit's gradient.
enum class ActionKind { Forward, Backward, BackwardInput, BackwardWeight };
// "F", "B", "I", "W": a table cell's prefix.
const char* action_letter(ActionKind k);

struct Action {
  ActionKind kind = ActionKind::Forward;
  int microbatch = 0;        // index within the optimizer step (or evaluation batch), from 0
  int stage = 0;             // the pipeline stage (pipeline rank) that runs it, from 0
  int begin = 0, end = 0;    // blocks [begin, end) of the model
  int chunk = 0;             // the model chunk [begin, end) is, in model order (pipeline_schedule.h);
                             // = stage unless a rank holds several chunks (interleaved)
  bool operator==(const Action&) const = default;
};

class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual std::string name() const = 0;
  virtual int stages() const = 0;
  virtual int microbatches() const = 0;
  // Every action of one optimizer step (training) or one batch (evaluation); each stage's
  // actions in the order it runs them.
  virtual std::vector<Action> actions() const = 0;
  // The schedule as text: a title line (name, micro-batches, stages), then one row per stage,
  // "stage s [begin, end) |" and its actions in order as cells F<m> / B<m> / I<m> / W<m>, each
  // 4 characters wide (where a stage holds several chunks: "[b0, e0) [b1, e1) ... |" and cells
  // F<m>.<j>, 6 wide, j the chunk's place on its stage; wider when a label needs it, so that cells
  // never run together), for instance for gradient accumulation
  // over 4 micro-batches of 12 blocks:
  //   gradient accumulation: 4 micro-batches, 1 stage
  //   stage 0 [0, 12) | F0  B0  F1  B1  F2  B2  F3  B3
  std::string to_table() const;
};

// Gradient accumulation (today's loop): one stage over blocks [0, blocks); micro-batch m's Forward
// then its Backward, m = 0 .. microbatches-1. With backward = false (evaluation) the forwards only.
// std::invalid_argument when microbatches < 1 or blocks < 0.
class GradAccumulation final : public Schedule {
 public:
  GradAccumulation(int microbatches, int blocks, bool backward = true);
  std::string name() const override { return backward_ ? "gradient accumulation" : "evaluation"; }
  int stages() const override { return 1; }
  int microbatches() const override { return m_; }
  std::vector<Action> actions() const override;

 private:
  int m_, blocks_;
  bool backward_;
};

// What keeps the whole-model path of StageRunner (stage_runner.h: the model's one context, used
// when one stage holds every block) from running `s` on a model of `blocks` blocks: "" when every action is on stage 0 over [0, blocks), is a Forward or a
// Backward, and each Backward directly follows the Forward of its micro-batch (one micro-batch
// in flight); else a sentence naming the first action that is not.
std::string one_in_flight_problem(const Schedule& s, int blocks);

}  // namespace shardtrain
