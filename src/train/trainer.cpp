// The trainer (trainer.h): the step, the loop, evaluation and saving, each a function of its own
// (the set-up is in trainer_setup.cpp, the step line and reports in trainer_report.cpp). train_step
// reads as the algorithm: get batch, forward, backward (reduce-scatter), all-reduce loss and norm,
// clip, step. The model sees only UnitSource; every communicator and every "which rank does what"
// comes from the mesh (mesh.h), every layout question from the parallel layer (parallelize.h).
#include "trainer.h"

#include <cstdio>

namespace shardtrain {

namespace trainer_detail {

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
  // Example data: the mean over the global batch's target tokens instead (counted from the packed
  // rows, which every rank knows: no collective), so each target's gradient enters with weight
  // 1 / targets whatever micro-batch, rank, CP chunk or pipeline stage holds it. Every packed row
  // holds a target (PackedExamples leaves out examples without one), so targets >= global_batch.
  const double tokens_per_step = static_cast<double>(tc_.global_batch) * tc_.seq_len;
  const double targets = packed_ ? static_cast<double>(packed_->batch_targets(Split::Train, s)) : tokens_per_step;
  const float grad_scale = packed_ ? static_cast<float>(mean_loss_grad_scale(tokens_per_step, targets,
                                                                            static_cast<double>(geo().rank_tokens())))
                                   : 1.0f / static_cast<float>(geo().rank_tokens());
  // Mixture of experts: the load-balancing loss enters with weight coef per sequence of the global
  // batch (--aux-loss-scope sequence) or per micro-batch (micro-batch): this rank's share coef /
  // its sequences (micro-batches), which the reduce-scatter's mean over the dp ranks makes coef /
  // the global batch's.
  const bool moe = mc_.is_moe(), per_seq = tc_.aux_scope == MoeAuxScope::Sequence;
  const double pools = per_seq ? geo().per_rank : geo().accum;  // this rank's scope groups
  if (moe) runner_->set_aux_scale(mc_.router_aux_loss_coef / pools, tc_.router_z_loss_coef / pools);
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
  dump_grads_for_test();  // test hook (SHARDTRAIN_TEST_DUMP_GRADS): the first step's gradients
  // One all-reduce: loss, squared gradient norm, "some rank was asked to stop" (a signal) and "the
  // background checkpoint save of some rank failed" (AsyncCheckpointWriter), so every rank sees the
  // same values and takes the same decisions, a failed save included, at the same step boundary.
  // The mesh says whose gradient elements count (each parameter once: replica group 0 under hybrid
  // sharding; a TP group's replicated norms on its first rank) and whose loss (a TP group's first
  // rank on the last stage: every rank of the group computed the same loss of the same tokens); the
  // layout, which copy of a parameter held twice (the tied embedding on the last stage) stays out.
  const double aux_sum = moe ? runner_->take_aux_sum() : 0.0, z_sum = moe ? runner_->take_z_sum() : 0.0;
  double red[6] = {mesh_.counts_loss() ? loss_sum : 0.0,
                   mesh_.counts_in_norm()
                       ? f_->local_grad_sumsq(mesh_.counts_replicated_in_norm(), run_.unit_not_in_norm())
                       : 0.0,
                   stop_signal() != 0 ? 1.0 : 0.0, writer_ && writer_->failed() ? 1.0 : 0.0,
                   mesh_.counts_loss() ? aux_sum : 0.0, mesh_.counts_loss() ? z_sum : 0.0};
  comm_.all_reduce(red, moe ? 6 : 4, ReduceOp::Sum);
  StepOutcome o;
  if (moe) {  // the mean over the global batch's sequences (micro-batches), and the routing's balance
    const double groups = per_seq ? static_cast<double>(tc_.global_batch) : static_cast<double>(geo().accum) * geo().dp;
    o.aux = red[4] / groups;
    o.z_loss = red[5] / groups;
    o.expert_counts = runner_->take_expert_counts();
    std::vector<double> flat;
    for (const auto& v : o.expert_counts)
      for (int64_t n : v) flat.push_back(mesh_.counts_block_stats() ? static_cast<double>(n) : 0.0);
    comm_.all_reduce(flat.data(), flat.size(), ReduceOp::Sum);
    size_t i = 0;
    for (auto& v : o.expert_counts)
      for (int64_t& n : v) n = static_cast<int64_t>(flat[i++]);
  }
  o.loss = red[0] / targets;
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

// Collective: the validation loss after `step` steps, logged and recorded.
template <typename C> void Trainer<C>::evaluate_at(int64_t step) {
  const double vl = evaluate(mesh_, *runner_, *units_, *run_.plan.eval_schedule, tc_, tc_.eval_batches, packed_.get());
  (void)take_attention_stats();  // not the training steps' tile pairs
  res_.evals.push_back({step, vl});
  log_info(comm_, "eval step " + std::to_string(step) + " | val_loss " + fmt("%.4f", vl));
  if (metrics_.is_open() || tb_) write_record({{"step", step}, {"val_loss", vl}});
  check_outputs();
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

template class Trainer<float>;
template class Trainer<bf16>;

}  // namespace trainer_detail

TrainResult train(Engine& eng, const ModelConfig& mc, const TrainConfig& tc_given, const TokenDataset& data) {
  // --aux-loss-scope changes nothing for a dense model: not recorded, so that no resume of it is
  // refused for a setting that had no effect.
  TrainConfig tc = tc_given;
  if (!mc.is_moe() && tc.aux_scope != MoeAuxScope::Sequence) {
    log_info(eng.mesh.world(), "note: option '--aux-loss-scope' has no effect on a dense model (" + mc.architecture +
                                   "): ignored");
    tc.aux_scope = MoeAuxScope::Sequence;
  }
  if (!mc.is_moe() && tc.router_z_loss_coef != 0) {
    log_info(eng.mesh.world(), "note: option '--router-z-loss-coef' has no effect on a dense model (" +
                                   mc.architecture + "): ignored");
    tc.router_z_loss_coef = 0;
  }
  // A warm-up longer than the run: the learning rate never reaches --lr (nanoGPT's get_lr, lr_at).
  if (tc.warmup > tc.steps) {
    char b[160];
    std::snprintf(b, sizeof b, "%.3e at the last step, never --lr %.3e", lr_at(tc, tc.steps - 1), tc.lr);
    log_info(eng.mesh.world(), "note: option '--warmup' (" + std::to_string(tc.warmup) + ") is more than '--steps' (" +
                                   std::to_string(tc.steps) + "): the learning rate rises to " + b +
                                   ", and the cosine decay to --min-lr never starts");
  }
  if (tc.precision == Precision::BF16) {
    if (!eng.be16) throw std::logic_error("train: Precision::BF16 without a bf16 backend");
    return trainer_detail::Trainer<bf16>(eng, mc, tc, data).run();
  }
  return trainer_detail::Trainer<float>(eng, mc, tc, data).run();
}

}  // namespace shardtrain
