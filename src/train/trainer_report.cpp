// The trainer's reporting (trainer.h): the step line, the metrics and TensorBoard records, and the
// memory report at the end of a CPU run.
#include "trainer.h"
#include "shardtrain/parallel/memory_report.h"  // peak_memory_report

namespace shardtrain::trainer_detail {

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
    // The other dimensions that communicated: "<dim> comm" (exposed) in the step line, <dim>_comm_ms
    // (exposed), <dim>_issued_ms (in flight), <dim>_bytes and <dim>_collectives per step in the
    // metrics (blocking collectives: all exposed, issued = exposed).
    std::string dims_line;
    nlohmann::json dims_rec = nlohmann::json::object();
    for (CommDim d : {CommDim::Tp, CommDim::Cp, CommDim::Pp, CommDim::Ep}) {
      if (c[d].calls == 0) continue;
      const std::string name = CommStats::name(d);
      const double ms = 1e3 * c[d].exposed_s / n, bytes = c[d].bytes / n;
      dims_line += " | " + name + " comm " + fmt("%.1f", ms) + " ms/step, " + fmt("%.1f", bytes / 1e6) + " MB/step";
      dims_rec[name + "_comm_ms"] = ms;
      dims_rec[name + "_issued_ms"] = 1e3 * c[d].issued_s / n;
      dims_rec[name + "_bytes"] = bytes;
      dims_rec[name + "_collectives"] = static_cast<double>(c[d].calls) / n;
    }
    // Mixture of experts: the load-balancing loss and how evenly the routing spread the tokens, per
    // MoE block the largest expert's slots over the mean (1: balanced; E / k: every token on the
    // same k experts), the step line the worst block's; the metrics also the slots per expert.
    if (!o.expert_counts.empty()) {
      std::vector<double> load;
      nlohmann::json counts = nlohmann::json::array();
      for (const std::vector<int64_t>& v : o.expert_counts) {
        if (v.empty()) continue;
        int64_t sum = 0, mx = 0;
        for (int64_t x : v) sum += x, mx = std::max(mx, x);
        load.push_back(sum > 0 ? static_cast<double>(mx) * static_cast<double>(v.size()) / static_cast<double>(sum) : 0.0);
        counts.push_back(v);
      }
      const double worst = load.empty() ? 0.0 : *std::max_element(load.begin(), load.end());
      dims_line += " | aux " + fmt("%.4f", o.aux) +
                   (tc_.router_z_loss_coef > 0 ? " | z " + fmt("%.4f", o.z_loss) : std::string()) +
                   " | experts max/mean " + fmt("%.2f", worst);
      dims_rec["aux_loss"] = o.aux;
      dims_rec["z_loss"] = o.z_loss;
      dims_rec["moe_load_max_over_mean_max"] = worst;
      dims_rec["moe_load_max_over_mean"] = load;
      dims_rec["moe_tokens_per_expert"] = counts;
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
      if (packed_) {  // example data: the epoch the step's rows end in (0-based) and its target tokens
        j["epoch"] = packed_->epoch_of(s);
        j["targets"] = packed_->batch_targets(Split::Train, s);
      }
      j.update(dims_rec);
      if (mfu >= 0) j["mfu"] = mfu / 100;  // fraction of the peak; left out when the peak is unknown
      if (eta >= 0) j["eta_s"] = eta;
      write_record(j);
    }
    check_outputs();
  }
  res_.steps.push_back(sl);
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

// CPU runs: the memory plan against what each rank's kernel counted (VmHWM). Collective.
template <typename C> void Trainer<C>::report_memory() {
  if (!eng_.be.host_kernels()) return;  // the same on every rank: a run is all-CPU or all-GPU
  // Every rank's peak, its plan's total (its stage's), its pipeline stage and what the worst routing
  // imbalance adds to the plan (memory_plan.h).
  const int64_t mine[4] = {peak_rss_bytes(), plan_total_, mesh_.coord().pp, plan_worst_extra_};
  std::vector<int64_t> ranks(4 * static_cast<size_t>(W_));
  comm_.all_gather(mine, ranks.data(), 4);
  log_info(comm_, peak_memory_report(ranks));
}

// Test hook SHARDTRAIN_TEST_DUMP_GRADS=DIR (a plain FSDP run on the CPU: no TP, no pipeline, one
// replica group): after this process's first backward, every parameter's whole gradient (of the
// mean loss, before clipping) written by rank 0 as DIR/<name>.bin, raw little-endian float32, so a
// test can compare it with a reference's (tests/e2e/test_sft.sh: transformers). Collective over
// the shard group (each unit's gradient shards gathered through the parameters' all-gather: the
// shards are swapped in and back).
template <typename C> void Trainer<C>::dump_grads_for_test() {
  const char* dir = std::getenv("SHARDTRAIN_TEST_DUMP_GRADS");
  if (!dir || grads_dumped_) return;
  grads_dumped_ = true;
  const MeshDims& d = mesh_.dims();
  if (d.tp > 1 || d.pp > 1 || d.dp_replicate > 1 || !eng_.be.host_kernels())
    throw CollectiveError(0, "SHARDTRAIN_TEST_DUMP_GRADS: plain FSDP runs on the CPU only");
  auto swap_all = [&] {
    for (int u = 0; u < f_->num_units(); ++u)
      std::swap_ranges(f_->param_shard(u), f_->param_shard(u) + f_->plan().units[static_cast<size_t>(u)].shard_size,
                       f_->grad_shard(u));
  };
  swap_all();
  for (const UnitPlan& up : f_->plan().units)
    for (const auto& p : up.params) {
      const std::vector<float> g = f_->gather_param(p.spec.name);
      if (comm_.rank() == 0)
        std::ofstream(std::string(dir) + "/" + p.spec.name + ".bin", std::ios::binary)
            .write(reinterpret_cast<const char*>(g.data()), static_cast<std::streamsize>(g.size() * sizeof(float)));
    }
  swap_all();
}

template void Trainer<float>::log_step(int64_t, const StepOutcome&);
template void Trainer<float>::write_record(const nlohmann::json&);
template void Trainer<float>::check_outputs();
template void Trainer<float>::report_memory();
template void Trainer<float>::dump_grads_for_test();
template void Trainer<bf16>::log_step(int64_t, const StepOutcome&);
template void Trainer<bf16>::write_record(const nlohmann::json&);
template void Trainer<bf16>::check_outputs();
template void Trainer<bf16>::report_memory();
template void Trainer<bf16>::dump_grads_for_test();

}  // namespace shardtrain::trainer_detail
