// AdamW on shards, LR schedule, and the training loop. The loop in train() reads as the algorithm:
// get batch, forward, backward (reduce-scatter), clip, step, log, evaluate.
#include "shardtrain/train.h"

#include "shardtrain/checkpoint.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

namespace shardtrain {

double lr_at(const TrainConfig& tc, int64_t s) {
  if (s < tc.warmup) return tc.lr * static_cast<double>(s + 1) / static_cast<double>(tc.warmup);
  int64_t decay_steps = std::max<int64_t>(1, tc.steps - tc.warmup);
  double p = std::min(1.0, static_cast<double>(s - tc.warmup) / static_cast<double>(decay_steps));
  return tc.min_lr + 0.5 * (1.0 + std::cos(M_PI * p)) * (tc.lr - tc.min_lr);
}

template <typename T> AdamW<T>::AdamW(Fsdp<T>& f, const TrainConfig& tc) : f_(f), tc_(tc) {
  const ShardPlan& plan = f.plan();
  int r = f.comm().rank();
  for (int u = 0; u < f.num_units(); ++u) {
    const UnitPlan& up = plan.units[u];
    m_.emplace_back(f.backend(), static_cast<size_t>(up.shard_size));
    v_.emplace_back(f.backend(), static_cast<size_t>(up.shard_size));
    const RankShard& rs = up.ranks[r];
    for (const auto& slot : up.params) {
      int64_t lo = std::max(slot.offset, rs.start), hi = std::min(slot.offset + slot.numel, rs.start + rs.valid);
      if (hi > lo) segs_.push_back({u, lo - rs.start, hi - lo, slot.spec.weight_decay});
    }
  }
}

template <typename T> void AdamW<T>::step(int64_t t, double lr, double grad_scale) {
  Backend<T>& be = f_.backend();
  using S = typename Backend<T>::S;
  for (const auto& s : segs_) {
    size_t b = static_cast<size_t>(s.begin);
    be.adamw(f_.param_shard(s.unit) + b, m_[s.unit].data() + b, v_[s.unit].data() + b, f_.grad_shard(s.unit) + b,
             static_cast<size_t>(s.count), static_cast<S>(lr), static_cast<S>(tc_.beta1), static_cast<S>(tc_.beta2),
             static_cast<S>(tc_.eps), s.decay ? static_cast<S>(tc_.weight_decay) : S(0), static_cast<S>(grad_scale), t);
  }
}

template <typename T>
double evaluate(Comm& comm, LlamaModel<T>& model, UnitSource<T>& f, const TokenDataset& data, const TrainConfig& tc,
                int batches) {
  const int W = comm.world_size(), per_rank = tc.global_batch / W;
  const int mb = tc.micro_batch > 0 ? tc.micro_batch : per_rank;
  std::vector<int32_t> tok(static_cast<size_t>(mb) * tc.seq_len), tgt(tok.size());
  double sum = 0;
  for (int e = 0; e < batches; ++e)
    for (int m = 0; m < per_rank / mb; ++m) {
      fill_batch(data, Split::Val, tc.seed, e, comm.rank() * per_rank + m * mb, mb, tc.seq_len, tok.data(), tgt.data());
      sum += model.forward(f, tok.data(), tgt.data(), mb, tc.seq_len, false);
    }
  comm.all_reduce(&sum, 1, ReduceOp::Sum);
  return sum / (static_cast<double>(batches) * tc.global_batch * tc.seq_len);
}

namespace {
std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
}  // namespace

double flops_per_token(const ModelConfig& c, int T) {
  return 6.0 * static_cast<double>(c.num_params()) +
         12.0 * c.num_hidden_layers * static_cast<double>(c.hidden_size) * static_cast<double>(T);
}

Precision parse_precision(const std::string& s) {
  if (s == "fp32") return Precision::FP32;
  if (s == "bf16") return Precision::BF16;
  throw std::invalid_argument("option '--precision' must be fp32 or bf16, got '" + s + "'");
}

namespace {
// The model and its unit source in compute type C, over the fp32 Fsdp `f`.
template <typename C> struct Compute {
  std::unique_ptr<MixedPrecisionUnits> mixed;  // C = bf16 only
  std::unique_ptr<LlamaModel<C>> model;
  UnitSource<C>* units = nullptr;
};
}  // namespace

template <typename C>
static TrainResult train_in(Engine& eng, const ModelConfig& mc, const TrainConfig& tc, const TokenDataset& data) {
  Comm& comm = eng.comm;
  Backend<float>& be = eng.be;
  using clock = std::chrono::steady_clock;
  const int W = comm.world_size(), rank = comm.rank();
  // Geometry checks: identical on every rank, so every rank throws the same message.
  if (tc.global_batch % W != 0)
    throw CollectiveError(0, "option '--global-batch' (" + std::to_string(tc.global_batch) +
                                 ") is not divisible by the world size (" + std::to_string(W) + ")");
  const int per_rank = tc.global_batch / W;
  const int mb = tc.micro_batch > 0 ? tc.micro_batch : per_rank;
  if (per_rank % mb != 0)
    throw CollectiveError(0, "option '--global-batch' (" + std::to_string(tc.global_batch) +
                                 ") is not divisible by world size x '--micro-batch' (" + std::to_string(W) + " x " +
                                 std::to_string(mb) + ")");
  if (tc.seq_len > mc.max_position_embeddings)
    throw CollectiveError(0, "option '--seq-len' (" + std::to_string(tc.seq_len) +
                                 ") exceeds the model's max_position_embeddings (" +
                                 std::to_string(mc.max_position_embeddings) + ")");
  if (data.header().vocab_size > static_cast<uint32_t>(mc.vocab_size))
    throw CollectiveError(0, "the token file's vocab_size (" + std::to_string(data.header().vocab_size) +
                                 ") exceeds the model's vocab_size (" + std::to_string(mc.vocab_size) + ")");
  for (auto [n, name] : {std::pair{data.train().size(), "train"}, std::pair{data.val().size(), "validation"}})
    if (n < static_cast<size_t>(tc.seq_len) + 1)
      throw CollectiveError(0, std::string("the ") + name + " split of the token file holds " + std::to_string(n) +
                                   " tokens, fewer than one sequence of --seq-len + 1 = " +
                                   std::to_string(tc.seq_len + 1));
  const int accum = per_rank / mb;

  // Allocation depends on local success: agree on it, and say what did not fit.
  std::unique_ptr<Fsdp<float>> fp;
  Compute<C> cp;
  std::unique_ptr<AdamW<float>> op;
  std::vector<int32_t> tok, tgt;
  agree(comm, [&] {
    try {
      constexpr bool mixed = std::is_same_v<C, bf16>;
      fp = std::make_unique<Fsdp<float>>(be, comm, ShardPlan::build(llama_units(mc), W), &eng.data_comm, !mixed);
      if constexpr (mixed) {
        cp.mixed = std::make_unique<MixedPrecisionUnits>(*fp, *eng.be16, eng.reduce_bf16);
        cp.model = std::make_unique<LlamaModel<bf16>>(mc, *eng.be16);
        cp.units = cp.mixed.get();
      } else {
        cp.model = std::make_unique<LlamaModel<float>>(mc, be);
        cp.units = fp.get();
      }
      op = std::make_unique<AdamW<float>>(*fp, tc);
      cp.model->reserve(mb, tc.seq_len);
      tok.resize(static_cast<size_t>(mb) * tc.seq_len);
      tgt.resize(tok.size());
    } catch (const std::bad_alloc&) {
      throw std::runtime_error("out of memory allocating model '" + mc.name + "' (" + std::to_string(mc.num_params()) +
                               " parameters, sharded over " + std::to_string(W) + " ranks) with activations for " +
                               std::to_string(mb) + " x " + std::to_string(tc.seq_len) +
                               " tokens per micro-batch; use more ranks, a smaller '--micro-batch' or '--seq-len', or a smaller '--model'");
    }
  });
  Fsdp<float>& f = *fp;
  LlamaModel<C>& model = *cp.model;
  UnitSource<C>& units = *cp.units;
  AdamW<float>& opt = *op;
  f.init_params(tc.seed);
  const CheckpointOptions co{tc.checkpoint_dir, tc.checkpoint_every, tc.keep_last, tc.debug_crash_before_publish};

  // Resume: parameters, AdamW moments, step (= data position and LR schedule position), seed.
  TrainState state{0, 0, tc.seed, 0};
  {  // A fresh run must not overwrite another run's checkpoints (same step names, other weights).
    std::string err;
    if (rank == 0 && tc.resume.empty() && !tc.checkpoint_dir.empty()) {
      std::error_code ec;
      for (auto& e : std::filesystem::directory_iterator(tc.checkpoint_dir, ec))
        if (e.path().extension() == ".h5" && e.path().filename().string().rfind("step_", 0) == 0) {
          err = "checkpoint directory '" + tc.checkpoint_dir + "' already holds checkpoints (" +
                e.path().filename().string() + ", ...): pass '--resume auto' to continue that run, or use another "
                "'--checkpoint-dir'";
          break;
        }
    }
    all_ok(comm, err.empty(), err);
  }
  const std::string resume_path = resolve_resume(comm, tc.resume, tc.checkpoint_dir);
  if (!resume_path.empty()) {
    auto t0 = clock::now();
    state = load_checkpoint(comm, resume_path, f, &opt, mc);
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    double mbytes = 3.0 * 4.0 * static_cast<double>(f.plan().total_numel()) / 1e6;
    log_info(comm, "resumed from '" + resume_path + "' at step " + std::to_string(state.step) + " (saved at world size " +
                       std::to_string(state.saved_world_size) + ") in " + fmt("%.2f", dt) + " s, " +
                       fmt("%.0f", mbytes / dt) + " MB/s incl. CRC32 verification");
    if (state.seed != tc.seed)
      log_info(comm, "note: using the checkpoint's seed " + std::to_string(state.seed) + " (option '--seed' is " +
                         std::to_string(tc.seed) + ")");
  } else {
    if (tc.resume == "auto") log_info(comm, "no checkpoint in '" + tc.checkpoint_dir + "': starting from step 0");
    if (!tc.init_from.empty()) {
      load_checkpoint(comm, tc.init_from, f, nullptr, mc);  // weights only; AdamW starts from zero
      log_info(comm, "initialized weights from '" + tc.init_from + "'");
    }
  }
  const uint64_t seed = state.seed;
  TrainConfig tcs = tc;  // the run's effective config: the checkpoint's seed wins
  tcs.seed = seed;
  if (state.step >= tc.steps)
    throw CollectiveError(0, "checkpoint is at step " + std::to_string(state.step) + ", not before option '--steps' (" +
                                 std::to_string(tc.steps) + "): nothing to train");
  const int64_t last_step = tc.stop_at_step > 0 ? std::min(tc.stop_at_step, tc.steps) : tc.steps;

  std::ofstream metrics;
  bool metrics_ok = true;
  if (rank == 0 && !tc.metrics_path.empty()) {
    metrics.open(tc.metrics_path, resume_path.empty() ? std::ios::trunc : std::ios::app);
    metrics_ok = static_cast<bool>(metrics);
  }
  all_ok(comm, metrics_ok, "cannot write metrics file '" + tc.metrics_path + "' (option '--metrics')");

  log_info(comm, "shardtrain: model " + mc.name + ", " + std::to_string(mc.num_params()) + " parameters, " +
                     std::to_string(f.num_units()) + " units, world size " + std::to_string(W) + ", micro-batch " +
                     std::to_string(mb) + " x " + std::to_string(accum) + " accumulation steps, global batch " +
                     std::to_string(tc.global_batch) + " x " + std::to_string(tc.seq_len) + " tokens");

  const float grad_scale = 1.0f / static_cast<float>(per_rank * tc.seq_len);  // d(mean loss on this rank)
  const double tokens_per_step = static_cast<double>(tc.global_batch) * tc.seq_len;
  TrainResult res;
  double train_s = 0, interval_s = 0;
  int64_t interval_steps = 0;
  auto t_start = clock::now();

  auto save = [&](int64_t step) {
    auto t0 = clock::now();
    TrainState st{step, step * static_cast<int64_t>(tokens_per_step), seed, W};
    std::string p = save_checkpoint(comm, f, opt, mc, tcs, st, co);
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    double mbytes = 3.0 * 4.0 * static_cast<double>(f.plan().total_numel()) / 1e6;
    log_info(comm, "checkpoint: saved '" + p + "' (" + fmt("%.1f", mbytes) + " MB of parameters + AdamW state) in " +
                       fmt("%.2f", dt) + " s, " + fmt("%.0f", mbytes / dt) + " MB/s");
  };

  for (int64_t s = state.step; s < last_step; ++s) {
    auto t0 = clock::now();
    f.zero_grads();
    double loss_sum = 0;
    for (int m = 0; m < accum; ++m) {
      fill_batch(data, Split::Train, seed, s, rank * per_rank + m * mb, mb, tc.seq_len, tok.data(), tgt.data());
      loss_sum += model.forward(units, tok.data(), tgt.data(), mb, tc.seq_len, true, grad_scale);
      model.backward(units);  // reduce-scatters each unit's gradient (mean over ranks) into its shard
    }
    // One all-reduce: loss, squared gradient norm, and "some rank was asked to stop" (a signal),
    // so every rank sees the same values and takes the same decisions below.
    double red[3] = {loss_sum, f.local_grad_sumsq(), stop_signal() != 0 ? 1.0 : 0.0};
    comm.all_reduce(red, 3, ReduceOp::Sum);
    const double loss = red[0] / tokens_per_step, gnorm = std::sqrt(red[1]);
    const bool stop_requested = red[2] > 0;
    const double lr = lr_at(tc, s);
    if (!std::isfinite(loss) || !std::isfinite(gnorm)) {
      std::string what = "non-finite " + std::string(std::isfinite(loss) ? "gradient norm" : "loss") + " at step " +
                         std::to_string(s + 1) + " (loss " + fmt("%g", loss) + ", grad_norm " + fmt("%g", gnorm) + ")";
      if (!tc.skip_nonfinite)  // nothing is applied or saved from this state
        throw CollectiveError(0, what + "; stopping without applying it. Lower '--lr', enable '--clip', or pass "
                                        "'--skip-nonfinite' to skip such steps");
      log_info(comm, what + ": update skipped (--skip-nonfinite)");
    } else {
      const double clip_scale = (tc.clip > 0 && gnorm > tc.clip) ? tc.clip / gnorm : 1.0;
      opt.step(s + 1, lr, clip_scale);
    }
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    train_s += dt;
    interval_s += dt;
    ++interval_steps;

    StepLog sl{s + 1, loss, lr, gnorm, 0, std::chrono::duration<double>(clock::now() - t_start).count()};
    if ((s + 1) % tc.log_every == 0 || s + 1 == last_step || s == state.step) {
      sl.tokens_per_s = tokens_per_step * static_cast<double>(interval_steps) / interval_s;
      interval_s = 0;
      interval_steps = 0;
      log_info(comm, "step " + std::to_string(s + 1) + "/" + std::to_string(tc.steps) + " | loss " + fmt("%.4f", loss) +
                         " | lr " + fmt("%.3e", lr) + " | grad_norm " + fmt("%.4f", gnorm) + " | " +
                         fmt("%.0f", sl.tokens_per_s) + " tok/s | " +
                         (eng.peak_flops > 0 ? "MFU " + fmt("%.1f", 100.0 * sl.tokens_per_s * flops_per_token(mc, tc.seq_len) / eng.peak_flops) + "% | " : std::string()) +
                         fmt("%.1f", sl.elapsed_s) + " s");
      if (metrics.is_open()) {
        nlohmann::json j = {{"step", sl.step}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm},
                            {"tokens_per_s", sl.tokens_per_s}, {"elapsed_s", sl.elapsed_s}};
        metrics << j.dump() << "\n" << std::flush;
      }
      if (!tc.metrics_path.empty())  // rank 0 writes; everybody learns whether it could
        all_ok(comm, !metrics.is_open() || metrics.good(), "cannot write metrics file '" + tc.metrics_path + "' (option '--metrics')");
    }
    res.steps.push_back(sl);

    bool last = s + 1 == last_step;
    if ((tc.eval_every > 0 && (s + 1) % tc.eval_every == 0) || last) {
      double vl = evaluate(comm, model, units, data, tcs, tc.eval_batches);
      res.evals.push_back({s + 1, vl});
      log_info(comm, "eval step " + std::to_string(s + 1) + " | val_loss " + fmt("%.4f", vl));
      if (metrics.is_open()) metrics << nlohmann::json({{"step", s + 1}, {"val_loss", vl}}).dump() << "\n" << std::flush;
    }
    const bool saved_now = !tc.checkpoint_dir.empty() &&
                           ((tc.checkpoint_every > 0 && (s + 1) % tc.checkpoint_every == 0) || last || stop_requested);
    if (saved_now) save(s + 1);
    if (stop_requested && !last) {
      const int sig = stop_signal();
      throw Preempted("stop requested by a signal (SIGTERM or SIGUSR1) during step " + std::to_string(s + 1) + ": " +
                          (tc.checkpoint_dir.empty() ? std::string("no --checkpoint-dir, nothing saved")
                                                     : "checkpoint of step " + std::to_string(s + 1) +
                                                           " published; continue with --resume auto"),
                      sig);
    }
  }
  res.train_seconds = train_s;
  const int64_t ran = last_step - state.step;
  res.tokens_per_s = tokens_per_step * static_cast<double>(ran) / train_s;
  log_info(comm, "done: " + std::to_string(ran) + " steps in " + fmt("%.1f", train_s) + " s of training, " +
                     fmt("%.0f", res.tokens_per_s) + " tok/s" +
                     (res.evals.empty() ? std::string() : ", final val_loss " + fmt("%.4f", res.evals.back().val_loss)));
  return res;
}

TrainResult train(Engine& eng, const ModelConfig& mc, const TrainConfig& tc_in, const TokenDataset& data) {
  TrainConfig tc = tc_in;
  if (eng.precision == Precision::BF16) {
    if (!eng.be16) throw std::logic_error("train: Precision::BF16 without a bf16 backend");
    tc.precision = eng.reduce_bf16 ? "bf16 (bf16 gradient reduce)" : "bf16 (fp32 gradient reduce)";
    return train_in<bf16>(eng, mc, tc, data);
  }
  tc.precision = "fp32";
  return train_in<float>(eng, mc, tc, data);
}

template class AdamW<float>;
template class AdamW<double>;
template double evaluate<float>(Comm&, LlamaModel<float>&, UnitSource<float>&, const TokenDataset&, const TrainConfig&,
                                int);
template double evaluate<bf16>(Comm&, LlamaModel<bf16>&, UnitSource<bf16>&, const TokenDataset&, const TrainConfig&,
                               int);

}  // namespace shardtrain
