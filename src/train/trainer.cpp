// The trainer: setup (checks, memory plan, allocation, resume), the step, the loop, evaluation and
// saving, each a function of its own. train_step reads as the algorithm: get batch, forward,
// backward (reduce-scatter), all-reduce loss and norm, clip, step. The model sees only UnitSource;
// every communicator and every "which rank does what" comes from the mesh (mesh.h).
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
#include "shardtrain/parallel/geometry.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/train/memory_plan.h"
#include "shardtrain/parallel/parallelize.h"
#include "shardtrain/io/tensorboard.h"
#include "shardtrain/train/mfu.h"
#include "shardtrain/parallel/schedule.h"
#include "shardtrain/parallel/stage_runner.h"
#include "shardtrain/train/train.h"

namespace shardtrain {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string fmt(const char* f, double v) {
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
};

// Test hooks of the form VAR=R:MS (docs/errors.md): the ms that rank `rank` is to sleep (0: none).
// SHARDTRAIN_TEST_SLOW_RANK: at the start of every step, so that the straggler report has a rank to
// find; SHARDTRAIN_TEST_LATE_RANK: once, before the trainer's checks of the options, so that the
// ranks reach an agreed error at very different times. Exactly two decimal integers,
// 0 < MS <= 60000; anything else is ignored.
int64_t rank_sleep_hook(const char* var, int rank) {
  const char* v = std::getenv(var);
  if (!v) return 0;
  const std::string t(v);
  const size_t c = t.find(':');
  const auto digits = [](const std::string& x) {
    return !x.empty() && x.size() <= 9 && x.find_first_not_of("0123456789") == std::string::npos;
  };
  if (c == std::string::npos || !digits(t.substr(0, c)) || !digits(t.substr(c + 1))) return 0;
  const long long r = std::stoll(t.substr(0, c)), ms = std::stoll(t.substr(c + 1));
  return (r == rank && ms > 0 && ms <= 60000) ? ms : 0;
}

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
  ParallelPlan resolve_plan();
  void log_memory_plan(const ParallelPlan& plan);
  void allocate(const ParallelPlan& plan);
  void restore();
  void record_data();
  void prepare_outputs();
  void gather_hosts();
  void log_setup();
  StepOutcome train_step(int64_t s);
  void log_step(int64_t s, const StepOutcome& o);
  void evaluate_at(int64_t step);
  typename Backend<C>::BlockAttentionStats take_attention_stats();
  void write_record(const nlohmann::json& j);
  void check_outputs();
  void save(int64_t step, bool wait);
  void collect_save(int64_t s);
  void log_background_save(const AsyncCheckpointWriter::Result& r, double waited_s, int64_t now);
  [[noreturn]] void rethrow_save_failure(const std::exception& e, int64_t step);
  void report_memory();
  const BatchGeometry& geo() const { return run_.plan.geometry; }  // the batch layout (geometry.h)

  Engine& eng_;
  const Mesh& mesh_;
  Comm& comm_;  // mesh_.world(): control traffic
  const ModelConfig& mc_;
  const TrainConfig tc_;
  const TokenDataset& data_;
  const int W_, G_;  // world size, shard group size
  int64_t plan_total_ = 0;  // bytes of this rank's memory plan (a pipeline rank's: its stage's)
  ModelOptions mopt_;
  // The run's layout (parallelize.h): its plan (batch geometry, pipeline stages, schedules), sharded
  // state, unit source, each dimension's ops for the model, the checkpoint layout (with
  // checkpoints). Outlives model_ and opt_.
  ParallelRun<C> run_;
  ShardedState<float>* f_ = nullptr;  // run_.state: fp32 master shards and gradient shards
  UnitPipeline<C>* units_ = nullptr;  // run_.units: the model's UnitSource over f_
  std::unique_ptr<LlamaModel<C>> model_;
  std::unique_ptr<AdamW<float>> opt_;
  std::unique_ptr<StageRunner<C>> runner_;  // runs this rank's actions: data, contexts, activations between stages
  CheckpointOptions co_;
  TrainState state_;         // the facts of the run: step, batch history, data and tokenizer record, layout
  std::string resume_path_;  // the checkpoint resumed from; "" for a fresh start
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
  Clock::time_point t_start_;  // the loop's start: elapsed_s of the step lines
  Clock::time_point t_first_;  // the end of this process's first step: the ETA's mean step time from there
  // The checkpoint saves (with --checkpoint-dir): a background writer thread on a communicator of
  // its own (--checkpoint-async on) or synchronous. Last member: destroyed (joined) first.
  std::unique_ptr<AsyncCheckpointWriter> writer_;
  int64_t writing_step_ = 0;  // the step of the save in flight, while one is
};

template <typename C>
Trainer<C>::Trainer(Engine& eng, const ModelConfig& mc, const TrainConfig& tc, const TokenDataset& data)
    : eng_(eng), mesh_(eng.mesh), comm_(eng.mesh.world()), mc_(mc), tc_(tc), data_(data),
      W_(eng.mesh.world_size()), G_(eng.mesh.dims().fsdp()) {
  if (const int64_t late = rank_sleep_hook("SHARDTRAIN_TEST_LATE_RANK", comm_.rank()); late > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(late));
  const ParallelPlan plan = resolve_plan();
  agree(comm_, [&] { mopt_ = model_options(tc_); });
  log_memory_plan(plan);
  allocate(plan);
  f_->init_params(tc_.seed);
  co_ = CheckpointOptions{tc_.checkpoint_dir, tc_.checkpoint_every, tc_.keep_last, tc_.debug_crash_before_publish,
                          run_.checkpoint && run_.checkpoint->writes_shards()};
  restore();
  record_data();
  prepare_outputs();
  gather_hosts();
  slow_rank_ms_ = rank_sleep_hook("SHARDTRAIN_TEST_SLOW_RANK", comm_.rank());
  if (!tc_.checkpoint_dir.empty()) {  // collective: duplicates the world communicator for the writer
    writer_ = std::make_unique<AsyncCheckpointWriter>(comm_, tc_.checkpoint_async, mesh_.collective_timeout());
    // A snapshot copies unless it can borrow the live rows (synchronous saves on the CPU).
    const ShardedTensors ct = checkpoint_tensors(*f_, opt_.get());
    // (Rows the layout owns are the snapshot: they change only at the next save, which waits for
    // this one's write first.)
    if (!run_.checkpoint->owns_saved_rows() && (!ct.backend->host_kernels() || writer_->asynchronous()))
      agree(comm_, [&] {
        try {
          snap_buf_ = std::make_shared<SnapshotBuffer>(*ct.backend, *ct.plan, ct.tensors.size());
        } catch (const std::bad_alloc&) {
          uint64_t n = 0;
          for (auto& up : ct.plan->units) n += static_cast<uint64_t>(up.shard_size);
          throw std::runtime_error("cannot allocate the checkpoint snapshot buffer (" +
                                   fmt("%.1f", 4.0 * static_cast<double>(n * ct.tensors.size()) / (1 << 20)) + " MiB of " +
                                   (ct.backend->host_kernels() ? "host" : "pinned host") + " memory)");
        }
      });
  }
  log_setup();
}

// The run's plan from the parallel layer (resolve_parallel: what the mesh cannot train, the batch
// geometry, the pipeline's stages and schedules), then the data's fit to the model: identical on
// every rank, so every rank throws the same message.
template <typename C> ParallelPlan Trainer<C>::resolve_plan() {
  std::vector<std::string> notes;
  ParallelPlan plan = resolve_parallel(mesh_, mc_, {tc_.global_batch, tc_.micro_batch, tc_.seq_len}, tc_.pp,
                                       tc_.attention, &notes);
  for (const std::string& line : notes) log_info(comm_, line);
  if (data_.header().vocab_size > static_cast<uint32_t>(mc_.vocab_size))
    throw CollectiveError(0, "the token file's vocab_size (" + std::to_string(data_.header().vocab_size) +
                                 ") exceeds the model's vocab_size (" + std::to_string(mc_.vocab_size) + ")");
  // Data without a vocabulary (llm.c, nanoGPT) is checked here, against the model's.
  if (data_.max_id() >= static_cast<uint32_t>(mc_.vocab_size))
    throw CollectiveError(0, "token id " + std::to_string(data_.max_id()) + " at " + data_.max_id_where() +
                                 " is >= the model's vocab_size (" + std::to_string(mc_.vocab_size) +
                                 "): the data was tokenized for another vocabulary");
  if (const std::string why = check_attention_mask(tc_, data_); !why.empty()) throw CollectiveError(0, why);
  if (data_.size(Split::Val) == 0)
    throw CollectiveError(0, "no validation tokens: the '--data' files have no validation split (llm.c and nanoGPT "
                             "files are all training tokens); name validation files with option '--val-data'");
  for (auto [n, name] : {std::pair{data_.size(Split::Train), "train"}, std::pair{data_.size(Split::Val), "validation"}})
    if (n < static_cast<uint64_t>(tc_.seq_len) + 1)
      throw CollectiveError(0, std::string("the ") + name + " split of the token file holds " + std::to_string(n) +
                                   " tokens, fewer than one sequence of --seq-len + 1 = " +
                                   std::to_string(tc_.seq_len + 1));
  return plan;
}

// The memory plan, before anything is allocated (the process's own memory so far measured): every
// pipeline stage's (one without a pipeline), logged by rank 0; each rank keeps its own's total.
template <typename C> void Trainer<C>::log_memory_plan(const ParallelPlan& plan) {
  MemoryPlanInput mi{mc_, tc_, W_, tc_.precision, tc_.reduce_bf16, !eng_.be.host_kernels(),
                     0, 4, 0};  // token data: memory-mapped (page cache), not held by the rank
  mi.train.micro_batch = plan.geometry.micro_batch;
  mi.overlap = tc_.overlap;
  mi.mesh = mesh_.dims();
  mi.stream_lane = eng_.mesh.shard_data().stream_ordered();
  mi.runtime_bytes = mi.cuda ? kGpuRuntimeEstimate : current_rss_bytes();
  comm_.all_reduce(&mi.runtime_bytes, 1, ReduceOp::Max);
  mi.pipeline = plan.pipeline;
  mi.pp_rank = mesh_.coord().pp;
  mi.microbatches = plan.geometry.accum;
  plan_total_ = plan_memory(mi).total();
  const std::string mem = std::string(mi.cuda ? "device" : "host") + " memory; --mode plan prints it without a launch";
  log_info(comm_, format_plans(plan_stages(mi), [&](const MemoryPlan& p) {
             return "memory plan per rank" + p.stage_of + " (" + mem + "):";
           }));
}

// Allocation depends on local success: agree on it, and say what did not fit.
template <typename C> void Trainer<C>::allocate(const ParallelPlan& plan) {
  agree(comm_, [&] {
    try {
      const bool checkpoints = !tc_.checkpoint_dir.empty() || !tc_.resume.empty() || !tc_.init_from.empty();
      run_ = parallelize<C>(mesh_, mc_, eng_.be, eng_.be16,
                            {tc_.overlap, tc_.reduce_bf16, checkpoints, tc_.cp_comm, plan, tc_.pp.reshard});
      f_ = run_.state.get();
      units_ = run_.units.get();
      if constexpr (std::is_same_v<C, bf16>)
        model_ = std::make_unique<LlamaModel<bf16>>(mc_, *eng_.be16, mopt_, run_.tp_ops(), run_.cp_ops());
      else
        model_ = std::make_unique<LlamaModel<float>>(mc_, eng_.be, mopt_, run_.tp_ops(), run_.cp_ops());
      opt_ = std::make_unique<AdamW<float>>(*f_, tc_);
      Backend<C>* be = nullptr;
      if constexpr (std::is_same_v<C, bf16>) be = eng_.be16;
      else be = &eng_.be;
      runner_ = std::make_unique<StageRunner<C>>(mesh_, *be, *model_, *units_, run_.stage, run_.plan.pipeline,
                                                 run_.pp.get(), batch_reader(tc_, data_), tc_.seq_len,
                                                 plan.geometry.per_rank, plan.geometry.micro_batch);
      runner_->reserve();  // the activations the first step needs, now
    } catch (const std::bad_alloc&) {
      throw std::runtime_error("out of memory allocating model '" + mc_.name + "' (" + std::to_string(mc_.num_params()) +
                               " parameters, sharded over " + std::to_string(G_) + " ranks) with activations for " +
                               std::to_string(plan.geometry.micro_batch) + " x " + std::to_string(tc_.seq_len) +
                               " tokens per micro-batch; use more ranks, a smaller '--micro-batch' or '--seq-len', or a smaller '--model'");
    }
  });
}

// Resume: parameters, AdamW moments, step (= data position and LR schedule position), batch
// history; or a fresh start, optionally from --init-from's weights.
template <typename C> void Trainer<C>::restore() {
  state_.seed = tc_.seed;
  {  // A fresh run must not overwrite another run's checkpoints (same step names, other weights),
     // nor silently replace the `latest` of a run whose checkpoints are gone.
    std::string err;
    if (comm_.rank() == 0 && tc_.resume.empty() && !tc_.checkpoint_dir.empty()) {
      std::error_code ec;
      const std::vector<std::string> names = published_checkpoints(tc_.checkpoint_dir);
      if (!names.empty())
        err = "checkpoint directory '" + tc_.checkpoint_dir + "' already holds checkpoints (" + names.front() +
              ", ...): pass '--resume auto' to continue that run, or use another '--checkpoint-dir'";
      if (err.empty() && !tc_.start_over &&
          std::filesystem::exists(std::filesystem::path(tc_.checkpoint_dir) / "latest", ec))
        err = "checkpoint directory '" + tc_.checkpoint_dir + "' holds the 'latest' pointer of an earlier run but none of "
              "its checkpoints: pass '--start-over' to start again from step 0 there, or use another '--checkpoint-dir'";
    }
    all_ok(comm_, err.empty(), err);
  }
  resume_path_ = resolve_resume(comm_, tc_.resume, tc_.checkpoint_dir, tc_.start_over);
  if (!resume_path_.empty()) {
    auto t0 = Clock::now();
    const CheckpointInfo info = read_checkpoint_info(comm_, resume_path_);
    check_resume_settings(comm_, info, tc_);  // refuses changed settings unless --accept-change names them
    const ShardedTensors live = checkpoint_tensors(*f_, opt_.get());
    state_ = load_checkpoint(comm_, resume_path_, run_.checkpoint->load_target(live), mc_, &info);
    run_.checkpoint->finish_load(comm_, live);
    const double dt = seconds_since(t0);
    const double mbytes = 3.0 * 4.0 * static_cast<double>(mc_.num_params()) / 1e6;
    log_info(comm_, "resumed from '" + resume_path_ + "' at step " + std::to_string(state_.step) + " (saved at " +
                        saved_layout_words(info) + ") in " + fmt("%.2f", dt) + " s, " + fmt("%.0f", mbytes / dt) +
                        " MB/s incl. CRC32 verification");
    if (info.format_version < 3 && tc_.skip_spikes > 0)
      log_info(comm_, "note: checkpoint '" + resume_path_ + "' is format version " + std::to_string(info.format_version) +
                          ", without loss-spike statistics: --skip-spikes starts from an empty window and skips nothing "
                          "before it holds " + std::to_string(kSpikeWindow) + " steps again");
  } else {
    if (!tc_.resume.empty())  // '--resume auto' (a path that does not resolve is refused by resolve_resume)
      log_info(comm_, tc_.start_over && std::filesystem::exists(std::filesystem::path(tc_.checkpoint_dir) / "latest")
                          ? "starting over from step 0 in '" + tc_.checkpoint_dir +
                                "' (--start-over): its 'latest' names a checkpoint that no longer exists"
                          : "no checkpoint in '" + tc_.checkpoint_dir + "': starting from step 0");
    if (!tc_.init_from.empty()) {
      // Weights only; AdamW starts from zero. The tokenizer record is kept to compare with the data's.
      const ShardedTensors live = sharded_params(*f_);
      state_.tokenizer = load_checkpoint(comm_, tc_.init_from, run_.checkpoint->load_target(live), mc_).tokenizer;
      run_.checkpoint->finish_load(comm_, live);
      log_info(comm_, "initialized weights from '" + tc_.init_from + "'");
    }
  }
  // The batch history: a new segment where the geometry or the seed changes (an accepted change).
  if (state_.segments.empty() || state_.segments.back().global_batch != tc_.global_batch ||
      state_.segments.back().seq_len != tc_.seq_len || state_.segments.back().seed != tc_.seed)
    state_.segments.push_back({state_.step, tc_.global_batch, tc_.seq_len, tc_.seed});
  state_.seed = tc_.seed;
  state_.world_size = W_;
  state_.shard_group_size = G_;
}

// The token data the checkpoints record (noting a change on resume), and the tokenizer.
template <typename C> void Trainer<C>::record_data() {
  const TokenFileHeader& h = data_.header();
  nlohmann::json files = nlohmann::json::array(), formats = nlohmann::json::array();
  for (const TokenFileEntry& e : data_.files()) {
    files.push_back(e.path);
    formats.push_back(e.format);
  }
  // "path": the first file (what format-1 readers know); "files": every file, train then val.
  const nlohmann::json now = {{"path", data_.path()}, {"files", files},         {"formats", formats},
                              {"tokenizer", h.tokenizer}, {"vocab_size", h.vocab_size}, {"bos_id", h.bos_id},
                              {"eos_id", h.eos_id},  {"n_train", h.n_train}, {"n_val", h.n_val},
                              {"crc32", data_.crc32()}};
  nlohmann::json before;
  try {
    before = read_json(state_.data_info, json_limits::kCheckpointAttr);
  } catch (const std::exception&) {  // verified when read; "null" for a fresh run
  }
  if (!resume_path_.empty() && before.is_object() && before.contains("crc32") && before["crc32"] != now["crc32"])
    log_info(comm_, "note: resume: token file '" + data_.path() + "' is not the one the checkpoint trained on ('" +
                        before.value("path", std::string("?")) + "', other contents): the batches from step " +
                        std::to_string(state_.step + 1) + " on come from the new one");
  state_.data_info = now.dump();
  state_.tokenizer = pick_tokenizer(comm_, state_.tokenizer, resume_path_.empty() ? tc_.init_from : resume_path_,
                                    data_.tokenizer(), data_.path());
}

// Collective: every rank's host name (to name a straggler's node in the step line).
template <typename C> void Trainer<C>::gather_hosts() {
  constexpr size_t kHost = 64;
  std::vector<char> mine(kHost, 0), all(kHost * static_cast<size_t>(W_));
  const std::string& h = mesh_.topology().host;
  std::copy_n(h.begin(), std::min(h.size(), kHost - 1), mine.begin());
  comm_.all_gather(mine.data(), all.data(), kHost);
  hosts_.clear();
  for (int r = 0; r < W_; ++r) hosts_.emplace_back(&all[static_cast<size_t>(r) * kHost]);
}

// The steps to run, the checkpoint directory and the metrics file. A fresh run starts the metrics
// file; a resumed run (or a start-over) continues it exactly at its step, moving the rows of steps
// it will redo (written after that checkpoint) aside.
template <typename C> void Trainer<C>::prepare_outputs() {
  if (state_.step >= tc_.steps)
    throw CollectiveError(0, "checkpoint is at step " + std::to_string(state_.step) + ", not before option '--steps' (" +
                                 std::to_string(tc_.steps) + "): nothing to train (to train further, raise '--steps' "
                                 "and pass '--accept-change steps')");
  if (tc_.stop_at_step > 0 && tc_.stop_at_step <= state_.step)
    throw CollectiveError(0, "option '--stop-at-step' (" + std::to_string(tc_.stop_at_step) +
                                 ") is not after the checkpoint's step (" + std::to_string(state_.step) +
                                 "): nothing to train");
  last_step_ = tc_.stop_at_step > 0 ? std::min(tc_.stop_at_step, tc_.steps) : tc_.steps;
  if (!tc_.checkpoint_dir.empty()) {
    // Before hours of training, not at the first save: every rank must see one shared directory.
    prepare_checkpoint_dir(comm_, tc_.checkpoint_dir);
    // What a killed save left: removed where its process is gone, reported otherwise (checkpoint.h).
    for (const std::string& note : clean_checkpoint_temp_files(comm_, tc_.checkpoint_dir)) log_info(comm_, note);
    if (!resume_path_.empty()) set_aside_later_checkpoints(comm_, tc_.checkpoint_dir, state_.step, resume_path_);
  }
  std::string err;
  if (comm_.rank() == 0 && !tc_.metrics_path.empty()) {
    const bool continuing = !resume_path_.empty() || tc_.start_over;
    try {
      // A FIFO or device here would block the open (and a FIFO's reader would wait forever).
      check_output_path(tc_.metrics_path, "");
      if (continuing) {
        std::string note = continue_metrics(tc_.metrics_path, state_.step);
        if (!note.empty()) log_info(comm_, note);
      }
      metrics_.open(tc_.metrics_path, continuing ? std::ios::app : std::ios::trunc);
      if (!metrics_) throw std::runtime_error("cannot open it");
    } catch (const std::exception& e) {
      err = "cannot write metrics file '" + tc_.metrics_path + "' (option '--metrics'): " + e.what();
    }
  }
  std::string tb_note;
  if (comm_.rank() == 0 && !tc_.tensorboard_dir.empty() && err.empty()) {
    try {  // a new event file; its START event at the first step to train hides later steps of earlier files
      tb_ = std::make_unique<TensorBoardWriter>(tc_.tensorboard_dir, state_.step + 1);
      tb_note = tb_->note();
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  all_ok(comm_, err.empty(), err);
  if (!tb_note.empty()) log_info(comm_, tb_note);
  if (tb_) log_info(comm_, "tensorboard: writing '" + tb_->path() + "' (tensorboard --logdir " + tc_.tensorboard_dir + ")");
}

template <typename C> void Trainer<C>::log_setup() {
  log_info(comm_, "shardtrain: model " + mc_.name + ", " + std::to_string(mc_.num_params()) + " parameters, " +
                      std::to_string(f_->num_units()) + " units, world size " + std::to_string(W_) + ", micro-batch " +
                      std::to_string(geo().micro_batch) + " x " + std::to_string(geo().accum) + " accumulation steps, global batch " +
                      std::to_string(tc_.global_batch) + " x " + std::to_string(tc_.seq_len) + " tokens");
  const OverlapConfig& ov = units_->overlap();
  const Comm& data = mesh_.shard_data();
  log_info(comm_, std::string("overlap: ") +
                      (ov.on ? "on (prefetch " + std::to_string(ov.prefetch) + " unit(s), asynchronous reduce-scatter, " +
                                   (data.stream_ordered()
                                        ? std::string("stream-ordered: NCCL on a communication stream, one host wait per pass")
                                    : data.asynchronous()
                                        ? std::string("progress: ") + comm_progress_name(ov.progress)
                                        : std::string("collectives complete on return on this device")) +
                                   ")"
                             : std::string("off (every collective waited for when started; --prefetch and --comm-progress have no effect)")) +
                      (tc_.overlap.on && ov.progress != tc_.overlap.progress
                           ? "; note: MPI granted no MPI_THREAD_MULTIPLE, so '--comm-progress thread' became poll"
                           : std::string()));
  if (writer_) {
    if (!writer_->note().empty()) log_info(comm_, writer_->note());
    log_info(comm_, writer_->asynchronous()
                        ? std::string("checkpoints: asynchronous (--checkpoint-async on): a periodic save blocks training "
                                      "for its host snapshot only, a writer thread at low CPU priority (nice 19) writes "
                                      "and publishes it; the final "
                                      "and a preemption save are written before training goes on") +
                              (checkpoint_write_delay_ms() > 0
                                   ? "; test hook SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS=" +
                                         std::to_string(checkpoint_write_delay_ms()) + " delays every background write"
                                   : std::string())
                        : std::string("checkpoints: synchronous: training waits for every save"));
    if (snap_buf_ && !f_->backend().host_kernels())
      log_info(comm_, "checkpoints: snapshots copied on a copy stream into " +
                          fmt("%.1f", static_cast<double>(snap_buf_->bytes()) / (1 << 20)) +
                          " MiB of pinned host memory per rank (allocated once)");
  }
  if (tc_.skip_spikes > 0)
    log_info(comm_, "skip-spikes: the update of a step whose loss or grad_norm is more than " + fmt("%g", tc_.skip_spikes) +
                        " standard deviations above the mean of the last " + std::to_string(kSpikeWindow) +
                        " steps is skipped; the window holds " + std::to_string(state_.spikes.loss.size()) + " of them");
  if (!test_spike_.steps.empty()) {
    std::string at;
    for (int64_t x : test_spike_.steps) at += (at.empty() ? std::string() : std::string(",")) + std::to_string(x);
    log_info(comm_, "test hook SHARDTRAIN_TEST_SPIKE_STEP=" + at + ": the loss and gradient of step(s) " + at +
                        " are multiplied by " + fmt("%g", test_spike_.scale));
  }
}

// One optimizer step: this rank's actions of the step's schedule (StageRunner: each micro-batch's
// forward, the LM head and loss, the backward, which reduce-scatters each unit's gradient into its
// shard), then the all-reduce of loss and norm, clipping and AdamW.
template <typename C> StepOutcome Trainer<C>::train_step(int64_t s) {
  const auto t0 = Clock::now();
  if (slow_rank_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_rank_ms_));  // test hook
  const CommStats comm0 = run_.comm_stats();
  // d(mean loss on this rank): rank_tokens = per_rank x T / cp target tokens. The reduce-scatter
  // averages over the shard group's dp_shard x cp ranks (and hybrid sharding's replica sum over
  // dp_replicate divides by it too), so each token's gradient enters with weight
  // (1 / (per_rank T / cp)) / (dp_shard cp dp_replicate) = 1 / (per_rank dp T) = 1 / (global_batch T):
  // the gradient of the mean over every target token of the global batch, with CP as without.
  const float grad_scale = 1.0f / static_cast<float>(geo().rank_tokens());
  const double tokens_per_step = static_cast<double>(tc_.global_batch) * tc_.seq_len;
  f_->zero_grads();
  double loss_sum = 0;
  units_->begin_pass("train");  // the sharding layer prefetches along the order the last step gathered in
  runner_->begin(Split::Train, s);
  loss_sum += runner_->run(*run_.plan.schedule, grad_scale);  // this rank's actions of the step's schedule
  runner_->end();      // every activation sent has arrived
  units_->end_pass();  // every reduce-scatter has landed in the gradient shards
  const auto attn = take_attention_stats();
  // TP: each rank's gradient of the replicated RMSNorm weights came from its own rows: sum them.
  // Through the TP group, which counts it with the step's TP communication (its S is float for
  // both compute types). A pipeline: the tied embedding's gradient, summed over first and last stage.
  run_.finish_grads();
  // One all-reduce: loss, squared gradient norm, "some rank was asked to stop" (a signal) and "the
  // background checkpoint save of some rank failed" (AsyncCheckpointWriter), so every rank sees the
  // same values and takes the same decisions, a failed save included, at the same step boundary.
  // The mesh says whose gradient elements count (each parameter once: replica group 0 under hybrid
  // sharding; a TP group's replicated norms on its first rank) and whose loss (a TP group's first
  // rank on the last stage: every rank of the group computed the same loss of the same tokens); the
  // layout, which copy of a parameter held twice (the tied embedding on the last stage) stays out.
  double red[4] = {mesh_.counts_loss() ? loss_sum : 0.0,
                   mesh_.counts_in_norm()
                       ? f_->local_grad_sumsq(mesh_.counts_replicated_in_norm(), run_.unit_not_in_norm())
                       : 0.0,
                   stop_signal() != 0 ? 1.0 : 0.0, writer_ && writer_->failed() ? 1.0 : 0.0};
  comm_.all_reduce(red, 4, ReduceOp::Sum);
  StepOutcome o;
  o.loss = red[0] / tokens_per_step;
  o.grad_norm = std::sqrt(red[1]);
  o.stop_requested = red[2] > 0;
  o.save_failed = red[3] > 0;
  o.lr = lr_at(tc_, s);
  const double injected = test_spike_.at(s + 1);  // test hook: 1 at every other step
  o.loss *= injected;
  o.grad_norm *= injected;
  o.skipped = true;  // unless applied below
  SpikeCheck spike;
  if (!std::isfinite(o.loss) || !std::isfinite(o.grad_norm)) {
    std::string what = "non-finite " + std::string(std::isfinite(o.loss) ? "gradient norm" : "loss") + " at step " +
                       std::to_string(s + 1) + " (loss " + fmt("%g", o.loss) + ", grad_norm " + fmt("%g", o.grad_norm) + ")";
    if (!tc_.skip_nonfinite)  // nothing is applied or saved from this state
      throw CollectiveError(0, what + "; stopping without applying it. Lower '--lr', enable '--clip', or pass "
                                      "'--skip-nonfinite' to skip such steps");
    log_info(comm_, what + ": update skipped (--skip-nonfinite)");
    ++state_.spikes.skipped_updates;  // the window is left as it was
  } else if ((spike = check_spike(state_.spikes, o.loss, o.grad_norm, tc_.skip_spikes)).skip) {
    // As a non-finite step: parameters and AdamW moments stay; step, LR schedule and data advance.
    log_info(comm_, "step " + std::to_string(s + 1) + ": update skipped: " +
                        describe_spike(spike, o.loss, o.grad_norm, tc_.skip_spikes));
  } else {
    const double clip_scale = (tc_.clip > 0 && o.grad_norm > tc_.clip) ? tc_.clip / o.grad_norm : 1.0;
    // A background save's copy of the shards (AsyncCheckpointWriter::start with copy_into) must
    // have ended before the update changes them.
    if (writer_) copy_wait_s_ += writer_->wait_copied();
    opt_->step(s + 1, o.lr, clip_scale * injected);
    o.skipped = false;
  }
  o.seconds = seconds_since(t0);
  o.comm = run_.comm_stats() - comm0;
  o.attn = {attn.tile_pairs, attn.skipped, attn.cpu_s};
  return o;
}

// The block attention kernels (the document mask's tiled path, and every mask under context
// parallelism) count the tile pairs they compute and skip and their CPU time: this rank's since
// the last call (the evaluation's are taken after it and dropped). Zeros where they did not run
// (the backend then has nothing to wait for); else waits for the compute backend's queued work.
// Asked whatever the mesh: the trainer does not ask which dimensions are on.
template <typename C> typename Backend<C>::BlockAttentionStats Trainer<C>::take_attention_stats() {
  if constexpr (std::is_same_v<C, bf16>) return eng_.be16->take_block_attention_stats();
  else return eng_.be.take_block_attention_stats();
}

// Records step s (0-based) and, every --log-every steps (and at the first and the last), prints the
// step line with the per-step means over the steps since the last line and appends it to the
// metrics file.
template <typename C> void Trainer<C>::log_step(int64_t s, const StepOutcome& o) {
  res_.train_seconds += o.seconds;
  interval_.seconds += o.seconds;
  interval_.comm += o.comm;
  ++interval_.steps;
  interval_.attn_pairs += o.attn.tile_pairs;
  interval_.attn_skipped += o.attn.skipped;
  interval_.attn_cpu_s += o.attn.cpu_s;
  StepLog sl;
  sl.step = s + 1;
  sl.loss = o.loss, sl.lr = o.lr, sl.grad_norm = o.grad_norm, sl.elapsed_s = seconds_since(t_start_);
  if (s == state_.step) t_first_ = Clock::now();  // the ETA leaves out this process's first (warm-up) step
  sl.update_skipped = o.skipped;
  if ((s + 1) % tc_.log_every == 0 || s + 1 == last_step_ || s == state_.step) {
    const double n = static_cast<double>(interval_.steps);
    sl.tokens_per_s = static_cast<double>(tc_.global_batch) * tc_.seq_len * n / interval_.seconds;
    const CommStats& c = interval_.comm;
    sl.comm_ms = 1e3 * c[CommDim::Fsdp].issued_s / n;
    sl.exposed_comm_ms = 1e3 * c[CommDim::Fsdp].exposed_s / n;
    const double fsdp_bytes = c[CommDim::Fsdp].bytes / n;
    // Every dimension's waiting (TP's blocking collectives included) is not compute (and is the
    // straggler report's wait time).
    sl.wait_ms = 1e3 * c.exposed_s() / n;
    sl.compute_ms = 1e3 * interval_.seconds / n - sl.wait_ms;
    // The other dimensions that communicated: "<dim> comm" in the step line, <dim>_comm_ms,
    // <dim>_bytes and <dim>_collectives per step in the metrics (blocking collectives: all exposed).
    std::string dims_line;
    nlohmann::json dims_rec = nlohmann::json::object();
    for (CommDim d : {CommDim::Tp, CommDim::Cp, CommDim::Pp}) {
      if (c[d].calls == 0) continue;
      const std::string name = CommStats::name(d);
      const double ms = 1e3 * c[d].exposed_s / n, bytes = c[d].bytes / n;
      dims_line += " | " + name + " comm " + fmt("%.1f", ms) + " ms/step, " + fmt("%.1f", bytes / 1e6) + " MB/step";
      dims_rec[name + "_comm_ms"] = ms;
      dims_rec[name + "_bytes"] = bytes;
      dims_rec[name + "_collectives"] = static_cast<double>(c[d].calls) / n;
    }
    // The pipeline's bubble per stage, measured beside its two predictions (collective; nothing with one stage).
    dims_line += runner_->bubble_report(*run_.plan.schedule, &dims_rec);
    // The document mask: the fraction of attention tile pairs skipped as fully masked (rank 0's).
    const int64_t pairs = interval_.attn_pairs, skipped = interval_.attn_skipped;
    const double skip_frac = pairs > 0 ? static_cast<double>(skipped) / static_cast<double>(pairs) : 0.0;
    if (pairs > 0) {
      dims_line += " | attn tiles skipped " + fmt("%.0f", 100 * skip_frac) + "%";
      dims_rec["attn_tile_pairs"] = static_cast<double>(pairs) / n;
      dims_rec["attn_tiles_skipped"] = static_cast<double>(skipped) / n;
    }
    // Collective (every rank logs the same steps): every rank's compute and wait time, its
    // attention tile pairs computed (not skipped) and the block kernels' CPU milliseconds per step.
    constexpr size_t kPer = 4;
    const double mine[kPer] = {sl.compute_ms, sl.wait_ms, static_cast<double>(pairs - skipped) / n,
                               1e3 * interval_.attn_cpu_s / n};
    std::vector<double> all(kPer * static_cast<size_t>(W_)), compute(static_cast<size_t>(W_)),
        wait(static_cast<size_t>(W_)), tiles(static_cast<size_t>(W_)), attn_cpu(static_cast<size_t>(W_));
    comm_.all_gather(mine, all.data(), kPer);
    for (size_t r = 0; r < compute.size(); ++r)
      compute[r] = all[kPer * r], wait[r] = all[kPer * r + 1], tiles[r] = all[kPer * r + 2], attn_cpu[r] = all[kPer * r + 3];
    // Per rank (index = world rank) where the block kernels ran: under CP the balance of the
    // sequence split (issue 41); the attention's CPU time where the backend measures it (host
    // backends). Every rank logs the same steps and ran the same kernels: the same decision.
    if (pairs > 0) {
      dims_rec["attn_tiles_computed_ranks"] = tiles;
      dims_rec["compute_ms_ranks"] = compute;
      if (interval_.attn_cpu_s > 0) dims_rec["attn_cpu_ms_ranks"] = attn_cpu;
    }
    interval_ = Interval{};
    sl.ranks = straggler_stats(compute, wait);
    const std::string straggler =
        sl.ranks.flagged ? " | straggler: rank " + std::to_string(sl.ranks.slowest) + " on " +
                               hosts_[static_cast<size_t>(sl.ranks.slowest)] + ", compute " +
                               fmt("%.0f", sl.ranks.compute_max) + " ms/step vs median " +
                               fmt("%.0f", sl.ranks.compute_median)
                         : std::string();
    const double mfu = mfu_percent(sl.tokens_per_s, flops_per_token(mc_, tc_.seq_len), eng_.peak_flops);  // < 0: n/a
    const double eta = eta_seconds(seconds_since(t_first_), s - state_.step, tc_.steps - (s + 1));  // < 0: n/a
    const int64_t seen = tokens_of(state_.segments, s + 1);  // every step since 0, through resumes
    log_info(comm_, "step " + std::to_string(s + 1) + "/" + std::to_string(tc_.steps) + " | loss " + fmt("%.4f", o.loss) +
                        " | lr " + fmt("%.3e", o.lr) + " | grad_norm " + fmt("%.4f", o.grad_norm) + " | " +
                        fmt("%.0f", sl.tokens_per_s) + " tok/s | exposed comm " + fmt("%.1f", sl.exposed_comm_ms) +
                        " ms/step" + dims_line + straggler + " | " + step_line_tail(mfu, sl.elapsed_s, eta, seen));
    if (metrics_.is_open() || tb_) {
      nlohmann::json j = {{"step", sl.step}, {"loss", o.loss}, {"lr", o.lr}, {"grad_norm", o.grad_norm},
                          {"tokens_per_s", sl.tokens_per_s}, {"elapsed_s", sl.elapsed_s},
                          {"compute_ms", sl.compute_ms}, {"comm_ms", sl.comm_ms},
                          {"exposed_comm_ms", sl.exposed_comm_ms}, {"fsdp_bytes", fsdp_bytes},
                          {"compute_ms_min", sl.ranks.compute_min}, {"compute_ms_median", sl.ranks.compute_median},
                          {"compute_ms_max", sl.ranks.compute_max}, {"wait_ms_min", sl.ranks.wait_min},
                          {"wait_ms_median", sl.ranks.wait_median}, {"wait_ms_max", sl.ranks.wait_max},
                          {"slowest_rank", sl.ranks.slowest}, {"tokens_seen", seen}, {"update_skipped", o.skipped},
                          {"skipped_updates", state_.spikes.skipped_updates}};
      if (sl.ranks.flagged) j["straggler_rank"] = sl.ranks.slowest;
      j.update(dims_rec);
      if (mfu >= 0) j["mfu"] = mfu / 100;  // fraction of the peak; left out when the peak is unknown
      if (eta >= 0) j["eta_s"] = eta;
      write_record(j);
    }
    check_outputs();
  }
  res_.steps.push_back(sl);
}

// Collective: the validation loss after `step` steps, logged and recorded.
template <typename C> void Trainer<C>::evaluate_at(int64_t step) {
  const double vl = evaluate(mesh_, *runner_, *units_, *run_.plan.eval_schedule, tc_, tc_.eval_batches);
  (void)take_attention_stats();  // not the training steps' tile pairs
  res_.evals.push_back({step, vl});
  log_info(comm_, "eval step " + std::to_string(step) + " | val_loss " + fmt("%.4f", vl));
  if (metrics_.is_open() || tb_) write_record({{"step", step}, {"val_loss", vl}});
  check_outputs();
}

// Rank 0: one metrics record to the --metrics file and the --tensorboard event file, each flushed.
template <typename C> void Trainer<C>::write_record(const nlohmann::json& j) {
  if (metrics_.is_open()) metrics_ << j.dump() << "\n" << std::flush;
  if (tb_) tb_->write(j);
}

// Collective when --metrics or --tensorboard is given (the same on every rank): rank 0 wrote, every
// rank learns whether it could.
template <typename C> void Trainer<C>::check_outputs() {
  if (tc_.metrics_path.empty() && tc_.tensorboard_dir.empty()) return;
  std::string err;  // one agreement for both outputs
  if (metrics_.is_open() && !metrics_.good())
    err = "cannot write metrics file '" + tc_.metrics_path + "' (option '--metrics')";
  else if (tb_ && !tb_->good())
    err = "cannot write TensorBoard event file '" + tb_->path() + "' (option '--tensorboard')";
  all_ok(comm_, err.empty(), err);
}

// Collective: the checkpoint of `step` (the mesh decided in co_ which ranks write their rows). A
// save still in flight is waited for first (the log says how long). Then the snapshot (the only
// part that reads the training state; training is blocked for it) goes to the writer: in the
// background (--checkpoint-async on, `wait` false: training goes on and collect_save reports the
// write when it ends), or written before this returns (`wait`: the final and a preemption save;
// or synchronous saves).
template <typename C> void Trainer<C>::save(int64_t step, bool wait) {
  const auto t0 = Clock::now();
  double waited_s = 0;
  if (writer_->in_flight()) {
    AsyncCheckpointWriter::Result prev;
    try {
      writer_->wait(&prev);
    } catch (const std::exception& e) {
      rethrow_save_failure(e, step);
    }
    waited_s = seconds_since(t0);
    log_background_save(prev, waited_s, step);
  }
  const auto t1 = Clock::now();
  TrainState st = state_;
  st.step = step;
  st.tokens_seen = tokens_of(state_.segments, step);
  st.saved_world_size = W_;
  CheckpointLayout& layout = *run_.checkpoint;
  const ShardedTensors ct = layout.for_save(comm_, checkpoint_tensors(*f_, opt_.get()));  // collective
  // A background save on the CPU borrows the live shards and its writer thread copies them while
  // the next step's forward and backward run (they only read them); the update waits for the copy
  // (train_step: wait_copied). Elsewhere the copy is made here (on a GPU: pinned memory, copy stream).
  const bool copy_later = writer_->asynchronous() && !wait && snap_buf_ && ct.backend->host_kernels();
  const SavedLayout& sl = layout.saved_layout();
  CheckpointSnapshot snap =
      take_checkpoint_snapshot(ct, mc_, train_config_json(tc_, sl.world_size, sl.shard_group_size, sl.tp), st,
                               co_.write_shards,
                               /*borrow=*/!writer_->asynchronous() || wait || copy_later || layout.owns_saved_rows(),
                               copy_later ? nullptr : snap_buf_);
  snap.tp = sl.tp_record;
  const double snap_s = seconds_since(t1);
  const double mbytes = 3.0 * 4.0 * static_cast<double>(mc_.num_params()) / 1e6;
  const std::string waited = waited_s > 0 ? ", of which " + fmt("%.2f", waited_s) + " s waiting for the previous write" : "";
  copy_wait_s_ = 0;
  // A save that training waits for (`wait`) is written on this thread, at its priority; synchronous
  // saves too. Both are published when start() returns.
  writer_->start(std::move(snap), co_, copy_later ? snap_buf_ : nullptr, /*foreground=*/wait);
  writing_step_ = step;
  if (writer_->asynchronous() && !wait) {
    log_info(comm_, "checkpoint: step " + std::to_string(step) + ": snapshot taken in " + fmt("%.2f", snap_s) +
                        " s, writing in the background (training blocked " + fmt("%.2f", seconds_since(t0)) + " s" +
                        waited + ")" +
                        (copy_later ? "; the writer thread copies the shards first, the next update waits for that"
                                    : std::string()));
    return;
  }
  AsyncCheckpointWriter::Result r;
  try {
    writer_->wait(&r);
  } catch (const std::exception& e) {
    rethrow_save_failure(e, step);
  }
  const double dt = seconds_since(t0);
  log_info(comm_, "checkpoint: saved '" + r.path + "' (" + fmt("%.1f", mbytes) + " MB of parameters + AdamW state) in " +
                      fmt("%.2f", dt) + " s, " + fmt("%.0f", mbytes / std::max(r.write_s, 1e-9)) +
                      " MB/s (training blocked " + fmt("%.2f", dt) + " s: snapshot " + fmt("%.2f", snap_s) + " s, write " +
                      fmt("%.2f", r.write_s) + " s" +
                      (r.delay_s > 0 ? ", test delay " + fmt("%.2f", r.delay_s) + " s" : std::string()) + waited + ")");
}

// At a step boundary (after step s, 0-based): a background save that has ended on this rank is
// collected and reported. Local: joining a finished thread needs no other rank.
template <typename C> void Trainer<C>::collect_save(int64_t s) {
  AsyncCheckpointWriter::Result r;
  if (writer_ && writer_->poll(&r)) log_background_save(r, 0, s + 1);
}

// The line of a finished background save: where it went, the write time and rate, and the steps
// that ran while it was written (from the save's step to `now`, the step boundary it is reported
// at; the last of them may have overlapped it only in part).
template <typename C>
void Trainer<C>::log_background_save(const AsyncCheckpointWriter::Result& r, double waited_s, int64_t now) {
  const double mbytes = 3.0 * 4.0 * static_cast<double>(mc_.num_params()) / 1e6;
  log_info(comm_, "checkpoint: saved '" + r.path + "' (" + fmt("%.1f", mbytes) +
                      " MB of parameters + AdamW state) in the background: write " + fmt("%.2f", r.write_s) + " s, " +
                      fmt("%.0f", mbytes / std::max(r.write_s, 1e-9)) + " MB/s" +
                      (r.delay_s > 0 ? " (plus the test delay of " + fmt("%.2f", r.delay_s) + " s)" : std::string()) +
                      (r.copy_s > 0 ? ", its copy of the shards " + fmt("%.2f", r.copy_s) + " s, training blocked " +
                                          fmt("%.2f", copy_wait_s_) + " s waiting for it"
                                    : std::string()) +
                      (now > r.step ? "; steps " + std::to_string(r.step + 1) + "-" + std::to_string(now) +
                                          " ran meanwhile"
                                    : std::string()) +
                      (waited_s > 0 ? "; the next save waited " + fmt("%.2f", waited_s) + " s for it" : std::string()));
}

// A save that failed (the writer's error, agreed on every rank by the write's collectives): the run
// stops here, with that error, on every rank.
template <typename C> void Trainer<C>::rethrow_save_failure(const std::exception& e, int64_t step) {
  const auto* ce = dynamic_cast<const CollectiveError*>(&e);
  throw CollectiveError(ce ? ce->origin_rank : 0,
                        std::string(e.what()) + " (checkpoint of step " + std::to_string(writing_step_) +
                            (writer_->asynchronous() ? ", written in the background; training stopped after step " +
                                                           std::to_string(step)
                                                     : std::string()) +
                            ")");
}

// CPU runs: the memory plan against what each rank's kernel counted (VmHWM). Collective.
template <typename C> void Trainer<C>::report_memory() {
  if (!eng_.be.host_kernels()) return;  // the same on every rank: a run is all-CPU or all-GPU
  // Every rank's peak, its plan's total (its stage's) and its pipeline stage (memory_plan.h).
  const int64_t mine[3] = {peak_rss_bytes(), plan_total_, mesh_.coord().pp};
  std::vector<int64_t> ranks(3 * static_cast<size_t>(W_));
  comm_.all_gather(mine, ranks.data(), 3);
  log_info(comm_, peak_memory_report(ranks));
}

// The loop: step, log, evaluate (every --eval-every steps and at the end), save (every
// --checkpoint-every steps, at the end, and when a stop was requested), stop on a signal.
template <typename C> TrainResult Trainer<C>::run() {
  t_start_ = Clock::now();
  for (int64_t s = state_.step; s < last_step_; ++s) {
    const StepOutcome o = train_step(s);
    log_step(s, o);
    if (o.save_failed) {  // every rank, at this step boundary: join the writer, stop with its error
      try {
        writer_->wait(nullptr);
      } catch (const std::exception& e) {
        rethrow_save_failure(e, s + 1);
      }
      throw CollectiveError(0, "the background save of the checkpoint of step " + std::to_string(writing_step_) +
                                   " failed on another rank; training stopped after step " + std::to_string(s + 1));
    }
    collect_save(s);
    const bool last = s + 1 == last_step_;
    if ((tc_.eval_every > 0 && (s + 1) % tc_.eval_every == 0) || last) evaluate_at(s + 1);
    if (!tc_.checkpoint_dir.empty() &&
        ((tc_.checkpoint_every > 0 && (s + 1) % tc_.checkpoint_every == 0) || last || o.stop_requested))
      save(s + 1, last || o.stop_requested);  // the final and a preemption save wait for their write
    if (o.stop_requested && !last)
      throw Preempted("stop requested by a signal (SIGTERM or SIGUSR1) during step " + std::to_string(s + 1) + ": " +
                          (tc_.checkpoint_dir.empty() ? std::string("no --checkpoint-dir, nothing saved")
                                                      : "checkpoint of step " + std::to_string(s + 1) +
                                                            " published; continue with --resume auto"),
                      stop_signal());
  }
  const int64_t ran = last_step_ - state_.step;
  res_.tokens_per_s = static_cast<double>(tc_.global_batch) * tc_.seq_len * static_cast<double>(ran) / res_.train_seconds;
  log_info(comm_, "done: " + std::to_string(ran) + " steps in " + fmt("%.1f", res_.train_seconds) + " s of training, " +
                      fmt("%.0f", res_.tokens_per_s) + " tok/s" +
                      (res_.evals.empty() ? std::string() : ", final val_loss " + fmt("%.4f", res_.evals.back().val_loss)));
  report_memory();
  return res_;
}

}  // namespace

TrainResult train(Engine& eng, const ModelConfig& mc, const TrainConfig& tc, const TokenDataset& data) {
  if (tc.precision == Precision::BF16) {
    if (!eng.be16) throw std::logic_error("train: Precision::BF16 without a bf16 backend");
    return Trainer<bf16>(eng, mc, tc, data).run();
  }
  return Trainer<float>(eng, mc, tc, data).run();
}

}  // namespace shardtrain
