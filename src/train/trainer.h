// The trainer's class (private to src/train/): a run in compute type C. Its methods are in three
// files: trainer_setup.cpp (the constructor: the plan, the checks, the memory plan, allocation,
// resume, the outputs), trainer.cpp (the step, the loop, evaluation and saving, and train()) and
// trainer_report.cpp (the step line, the metrics records, the memory report at the end). Each file
// instantiates its methods for float and bf16.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "resume.h"
#include "shardtrain/runtime/files.h"
#include "shardtrain/runtime/json_input.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/train/memory_plan.h"
#include "shardtrain/parallel/parallelize.h"
#include "shardtrain/io/tensorboard.h"
#include "shardtrain/train/mfu.h"
#include "shardtrain/parallel/stage_runner.h"
#include "shardtrain/train/train.h"

namespace shardtrain::trainer_detail {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// One optimizer step's outcome, the same on every rank (from the step's all-reduce).
struct StepOutcome {
  double loss = 0, grad_norm = 0, lr = 0;
  bool stop_requested = false;  // some rank received SIGTERM / SIGUSR1
  bool save_failed = false;     // some rank's background checkpoint save ended with an error
  bool skipped = false;         // the update was not applied (--skip-nonfinite, --skip-spikes)
  double seconds = 0;           // wall time of the step
  CommStats comm;               // the step's communication, every dimension's (parallelize.h)
  Backend<float>::BlockAttentionStats attn;  // --attention-mask document: this rank's tile pairs (backend.h)
  // Mixture-of-experts models: the load-balancing loss (the mean over the global batch's sequences
  // or micro-batches, --aux-loss-scope), and per block the slots routed to each expert over the
  // global batch (empty for dense blocks; they sum to num_experts_per_tok x the batch's tokens).
  double aux = 0;
  double z_loss = 0;  // the router z-loss, the same mean (measured whatever --router-z-loss-coef)
  std::vector<std::vector<int64_t>> expert_counts;
};

// Per-step means over the steps since the last log line.
struct Interval {
  double seconds = 0;
  CommStats comm;  // every dimension's, summed over the steps
  int64_t steps = 0;
  int64_t attn_pairs = 0, attn_skipped = 0;  // --attention-mask document: StepOutcome::attn, summed
  double attn_cpu_s = 0;
};

// A run in compute type C (float, or bf16 for mixed precision over fp32 master shards). The
// constructor is the setup (collective; throws CollectiveError on every rank for anything a rank
// cannot do); run() is the loop. Members are set up in declaration order and live for the run.
template <typename C> class Trainer {
 public:
  Trainer(Engine& eng, const ModelConfig& mc, const TrainConfig& tc, const TokenDataset& data);
  TrainResult run();

 private:
  // Set-up (trainer_setup.cpp): the constructor's steps.
  ParallelPlan resolve_plan();
  void pack_examples();
  void log_memory_plan(const ParallelPlan& plan);
  void allocate(const ParallelPlan& plan);
  void restore();
  void record_data();
  void prepare_outputs();
  void gather_hosts();
  void log_setup();
  // The step, evaluation and saves (trainer.cpp).
  StepOutcome train_step(int64_t s);
  void evaluate_at(int64_t step);
  typename Backend<C>::BlockAttentionStats take_attention_stats();
  void save(int64_t step, bool wait);
  void collect_save(int64_t s);
  void log_background_save(const AsyncCheckpointWriter::Result& r, double waited_s, int64_t now);
  [[noreturn]] void rethrow_save_failure(const std::exception& e, int64_t step);
  // Reporting (trainer_report.cpp): the step line and metrics, the outputs, the memory at the end.
  void log_step(int64_t s, const StepOutcome& o);
  void write_record(const nlohmann::json& j);
  void check_outputs();
  void report_memory();
  void dump_grads_for_test();
  const BatchGeometry& geo() const { return run_.plan.geometry; }  // the batch layout (geometry.h)

  Engine& eng_;
  const Mesh& mesh_;
  Comm& comm_;  // mesh_.world(): control traffic
  const ModelConfig& mc_;
  const TrainConfig tc_;
  const TokenDataset& data_;
  const int W_, G_;  // world size, shard group size
  int64_t plan_total_ = 0;  // bytes of this rank's memory plan (a pipeline rank's: its stage's)
  int64_t plan_worst_extra_ = 0;  // ... and what the worst routing imbalance adds (MemoryPlan::worst_extra)
  ModelOptions mopt_;
  // The run's layout (parallelize.h): its plan (batch geometry, pipeline stages, schedules), sharded
  // state, unit source, each dimension's ops for the model, the checkpoint layout (with
  // checkpoints). Outlives model_ and opt_.
  ParallelRun<C> run_;
  ShardedState<float>* f_ = nullptr;  // run_.state: fp32 master shards and gradient shards
  UnitSource<C>* units_ = nullptr;  // run_.units: the model's UnitSource over f_
  std::unique_ptr<LlamaModel<C>> model_;
  std::unique_ptr<AdamW<float>> opt_;
  std::shared_ptr<const PackedBatches> packed_;  // example data (tc_.examples): the packed rows, else null
  std::unique_ptr<StageRunner<C>> runner_;  // runs this rank's actions: data, contexts, activations between stages
  CheckpointOptions co_;
  TrainState state_;         // the facts of the run: step, batch history, data and tokenizer record, layout
  std::string resume_path_;  // the checkpoint resumed from; "" for a fresh start
  std::unique_ptr<CheckpointDirLock> dir_lock_;  // --checkpoint-dir: this run's, for its lifetime
  int64_t last_step_ = 0;    // the loop stops after this step (--stop-at-step or --steps)
  // Host memory of the snapshots that copy (every save on a GPU, pinned; background saves on the
  // CPU), made once at setup and reused by every save. Declared before writer_: outlives its thread.
  std::shared_ptr<SnapshotBuffer> snap_buf_;
  double copy_wait_s_ = 0;  // the save in flight: time train_step waited for its copy (wait_copied)
  const TestSpike test_spike_ = test_spike_hook();  // SHARDTRAIN_TEST_SPIKE_STEP: injected spikes
  std::ofstream metrics_;    // rank 0, with --metrics
  std::unique_ptr<TensorBoardWriter> tb_;  // rank 0, with --tensorboard
  TrainResult res_;
  Interval interval_;
  std::vector<std::string> hosts_;  // every rank's host (its processor name), to name a straggler's node
  int64_t slow_rank_ms_ = 0;        // test hook SHARDTRAIN_TEST_SLOW_RANK (rank_sleep_hook): ms slept per step
  bool grads_dumped_ = false;       // test hook SHARDTRAIN_TEST_DUMP_GRADS: done (first step only)
  Clock::time_point t_start_;  // the loop's start: elapsed_s of the step lines
  Clock::time_point t_first_;  // the end of this process's first step: the ETA's mean step time from there
  // The checkpoint saves (with --checkpoint-dir): a background writer thread on a communicator of
  // its own (--checkpoint-async on) or synchronous. Last member: destroyed (joined) first.
  std::unique_ptr<AsyncCheckpointWriter> writer_;
  int64_t writing_step_ = 0;  // the step of the save in flight, while one is
};

}  // namespace shardtrain::trainer_detail
