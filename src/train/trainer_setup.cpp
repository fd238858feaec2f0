// The trainer's set-up (trainer.h): the constructor and its steps: the run's plan (the parallel
// layer's: batch geometry, pipeline stages, schedules) and the data's checks, the memory plan,
// allocation, resume, the data record, the outputs, the set-up lines of the log.
#include "trainer.h"

namespace shardtrain::trainer_detail {

namespace {

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

}  // namespace

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
  if (tc_.examples) {
    pack_examples();
    return plan;
  }
  for (auto [n, name] : {std::pair{data_.size(Split::Train), "train"}, std::pair{data_.size(Split::Val), "validation"}})
    if (n < static_cast<uint64_t>(tc_.seq_len) + 1)
      throw CollectiveError(0, std::string("the ") + name + " split of the token file holds " + std::to_string(n) +
                                   " tokens, fewer than one sequence of --seq-len + 1 = " +
                                   std::to_string(tc_.seq_len + 1));
  return plan;
}

// Example data: the examples packed into rows (every rank the same, from the same files), and a
// line per split of what packing did; a split with no row to train on is refused.
template <typename C> void Trainer<C>::pack_examples() {
  agree(comm_, [&] {
    packed_ = std::make_shared<PackedBatches>(
        data_, PackOptions{tc_.seq_len, tc_.pack, tc_.max_length, tc_.train_on}, tc_.seed, tc_.global_batch,
        tc_.shuffle);
  });
  const int64_t rows = packed_->stream(Split::Train).rows();
  if (rows > 0 && rows < tc_.global_batch)
    log_info(comm_, "note: --global-batch " + std::to_string(tc_.global_batch) + " is more than the " +
                        std::to_string(rows) + " packed rows of an epoch: each step holds rows of several epochs, "
                        "so the same conversations more than once (a smaller --global-batch, or more data)");
  for (Split s : {Split::Train, Split::Val}) {
    const PackStats& p = packed_->stream(s).stats();
    const std::string name = s == Split::Train ? "train" : "validation";
    const std::string what =
        std::to_string(p.examples) + " examples" +
        (p.truncated ? ", " + std::to_string(p.truncated) + " truncated to --seq-len" : std::string()) +
        (p.dropped_long ? ", " + std::to_string(p.dropped_long) + " longer than --seq-len left out" : std::string()) +
        (p.dropped_no_target ? ", " + std::to_string(p.dropped_no_target) + " without a target token left out"
                             : std::string());
    if (p.rows == 0)
      throw CollectiveError(0, "the " + name + " split of " + data_.path() + " has no example to " +
                                   (s == Split::Train ? "train" : "evaluate") + " on (" + what +
                                   "; --train-on " + train_on_name(tc_.train_on) + ", --max-length-policy " +
                                   max_length_policy_name(tc_.max_length) + ")");
    const double fill = static_cast<double>(p.tokens) / (static_cast<double>(p.rows) * tc_.seq_len);
    log_info(comm_, "data: " + name + ": " + what + "; " + std::to_string(p.packed) + " in " + std::to_string(p.rows) +
                        " rows of " + std::to_string(tc_.seq_len) + " (--pack " + pack_mode_name(tc_.pack) + ", " +
                        fmt("%.1f", 100.0 * fill) + "% tokens, " +
                        fmt("%.1f", 100.0 * static_cast<double>(p.targets) / (static_cast<double>(p.rows) * tc_.seq_len)) +
                        "% targets, --train-on " + train_on_name(tc_.train_on) + ")" +
                        (s == Split::Train ? "; an epoch is " + fmt("%.2f", static_cast<double>(p.rows) / tc_.global_batch) +
                                                 " steps" + (tc_.shuffle ? "" : ", rows in packing order (--shuffle off)")
                                           : std::string()));
  }
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
  const MemoryPlan mp = plan_memory(mi);
  plan_total_ = mp.total();
  plan_worst_extra_ = mp.worst_extra;
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
        model_ = std::make_unique<LlamaModel<bf16>>(mc_, *eng_.be16, mopt_, run_.tp_ops(), run_.cp_ops(), run_.ep_ops());
      else
        model_ = std::make_unique<LlamaModel<float>>(mc_, eng_.be, mopt_, run_.tp_ops(), run_.cp_ops(), run_.ep_ops());
      opt_ = std::make_unique<AdamW<float>>(*f_, tc_);
      Backend<C>* be = nullptr;
      if constexpr (std::is_same_v<C, bf16>) be = eng_.be16;
      else be = &eng_.be;
      runner_ = std::make_unique<StageRunner<C>>(mesh_, *be, *model_, *units_, run_.stage, run_.plan.pipeline,
                                                 run_.pp.get(),
                                                 packed_ ? batch_reader(packed_) : batch_reader(tc_, data_), tc_.seq_len,
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
  // One run per checkpoint directory, held until this run ends (a second one started beside it is
  // refused before it reads or writes anything there).
  if (!tc_.checkpoint_dir.empty()) {
    dir_lock_ = std::make_unique<CheckpointDirLock>(comm_, tc_.checkpoint_dir);
    if (!dir_lock_->note().empty()) log_info(comm_, dir_lock_->note());
  }
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
    // '--resume auto' took the newest checkpoint; one that cannot be read (every rank agreed) names
    // the one before it, which the user may resume from by path. Not collective: the listing is
    // each rank's, the same on the shared file system the checkpoints are on.
    auto earlier = [&](const CollectiveError& e) {
      std::string hint;
      if (tc_.resume == "auto") {
        const std::string mine = std::filesystem::path(resume_path_).filename().string();
        for (const std::string& n : published_checkpoints(tc_.checkpoint_dir))
          if (n < mine) hint = n;  // oldest first: the last one before it
        if (!hint.empty())
          hint = "; the checkpoint before it is '" + (std::filesystem::path(tc_.checkpoint_dir) / hint).string() +
                 "': pass it to '--resume' to continue from there ('latest' still names the unreadable one)";
      }
      return CollectiveError(e.origin_rank, e.what() + hint);
    };
    CheckpointInfo info;
    try {
      info = read_checkpoint_info(comm_, resume_path_);
    } catch (const CollectiveError& e) {
      throw earlier(e);
    }
    check_resume_settings(comm_, info, tc_);  // refuses changed settings unless --accept-change names them
    const ShardedTensors live = checkpoint_tensors(*f_, opt_.get());
    try {
      state_ = load_checkpoint(comm_, resume_path_, run_.checkpoint->load_target(live), mc_, &info);
    } catch (const CollectiveError& e) {
      throw earlier(e);
    }
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
  log_info(comm_, "shardtrain: model " + mc_.name + ", " + std::to_string(mc_.num_params()) + " parameters" +
                      (mc_.is_moe() ? " (" + std::to_string(mc_.num_active_params()) + " active per token: " +
                                          std::to_string(mc_.num_experts_per_tok) + " of " +
                                          std::to_string(mc_.num_experts) + " experts)"
                                    : std::string()) +
                      ", " +
                      std::to_string(f_->num_units()) + " units, world size " + std::to_string(W_) + ", micro-batch " +
                      std::to_string(geo().micro_batch) + " x " + std::to_string(geo().accum) +
                      " accumulation steps, global batch " + std::to_string(tc_.global_batch) + " x " +
                      std::to_string(tc_.seq_len) + " tokens");
  const OverlapConfig& ov = run_.overlap;
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

template Trainer<float>::Trainer(Engine&, const ModelConfig&, const TrainConfig&, const TokenDataset&);
template Trainer<bf16>::Trainer(Engine&, const ModelConfig&, const TrainConfig&, const TokenDataset&);

}  // namespace shardtrain::trainer_detail
