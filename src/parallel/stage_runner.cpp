// StageRunner (stage_runner.h): a schedule's actions on this rank's chunks.
#include "shardtrain/parallel/stage_runner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>

namespace shardtrain {

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::string fixed(double v, const char* f = "%.2f") {
  char b[32];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
}  // namespace

template <typename C>
StageRunner<C>::StageRunner(const Mesh& mesh, Backend<C>& be, LlamaModel<C>& model, UnitSource<C>& f,
                            const RankUnits& stage, const PipelineLayout& pl, StageLink<C>* link,
                            MicroBatchReader read, int seq_len, int per_rank, int micro_batch)
    : mesh_(mesh), be_(be), model_(model), f_(f), stage_(stage), pl_(pl), link_(link), read_(std::move(read)),
      per_rank_(per_rank), mb_(micro_batch), split_(mesh, seq_len) {
  whole_ = stage_.ranges.size() == 1 && stage_.ranges[0].units.empty();
  free_.resize(stage_.ranges.size());
  chunk_times_.assign(stage_.ranges.size(), {});
  tok_.resize(static_cast<size_t>(mb_) * seq_len);
  tgt_.resize(tok_.size());
  // R x C rows of a micro-batch on this rank: B x T / cp tokens, 1 / tp of them under sequence parallelism.
  rows_elems_ = static_cast<size_t>(mb_) * static_cast<size_t>(split_.rows()) / static_cast<size_t>(mesh.dims().tp) *
                static_cast<size_t>(model.config().hidden_size);
  // A mixture of experts' load-balancing and z-loss statistics travel after the rows
  // (LlamaModel::aux_stats, forward), their gradient weights after the gradient's (aux_grad). Both
  // directions' messages are padded to one size, so that StageLink's send buffers serve either.
  tail_doubles_ = std::max(model.aux_stats_size(mb_), model.aux_grad_size(mb_));
  fwd_elems_ = bwd_elems_ = rows_elems_ + tail_elems<C>(tail_doubles_);
  if (link_)
    for (int i = 0; i < 2; ++i) {
      in_[i] = Buffer<C>(be_, fwd_elems_);
      grad_in_[i] = Buffer<C>(be_, bwd_elems_);
    }
}

template <typename C> std::vector<double> StageRunner<C>::padded(std::vector<double> tail) const {
  if (!tail.empty()) tail.resize(tail_doubles_, 0.0);
  return tail;
}

template <typename C> std::vector<double> StageRunner<C>::read_tail(const C* buf, size_t doubles) {
  std::vector<C> t(tail_elems<C>(doubles));
  be_.to_host(t.data(), buf + rows_elems_, t.size());
  std::vector<double> out(doubles);
  std::memcpy(out.data(), t.data(), doubles * sizeof(double));
  return out;
}

// The load-balancing and z-losses of a micro-batch whose forward ended at block L (ctx, or the
// model's own context): their values into the sums, their weights into the gradient. Under CP every
// rank of the group holds its sequences' losses (the group's pooled statistics) and the gradient of
// its own rows: each adds 1 / cp of the value, and the gradient enters with cp x the weight, since
// the reduce-scatter's mean divides by the CP ranks too.
template <typename C> void StageRunner<C>::moe_losses(typename LlamaModel<C>::Context* ctx) {
  using S = typename LlamaModel<C>::S;
  const int cp = mesh_.dims().cp;
  const S aux = static_cast<S>(aux_scale_ * cp), z = static_cast<S>(z_scale_ * cp);
  if (ctx) {
    aux_sum_ += model_.moe_aux_loss(*ctx) / cp;
    z_sum_ += model_.moe_z_loss(*ctx) / cp;
    model_.set_aux_grad_scale(*ctx, aux, z);
  } else {
    aux_sum_ += model_.moe_aux_loss() / cp;
    z_sum_ += model_.moe_z_loss() / cp;
    model_.set_aux_grad_scale(aux, z);
  }
}

template <typename C> void StageRunner<C>::add_expert_counts(const typename LlamaModel<C>::Context* ctx) {
  const ModelConfig& mc = model_.config();
  const int L = mc.num_hidden_layers;
  if (expert_counts_.empty()) {  // [L][E], empty for a dense block, on every rank (the trainer sums them)
    expert_counts_.resize(static_cast<size_t>(L));
    for (int blk = 0; blk < L; ++blk)
      if (mc.is_moe_layer(blk)) expert_counts_[static_cast<size_t>(blk)].assign(static_cast<size_t>(mc.num_experts), 0);
  }
  for (int blk = 0; blk < L; ++blk) {  // the blocks outside the context's range give none
    const std::vector<int64_t> n = ctx ? model_.expert_counts(*ctx, blk) : model_.expert_counts(blk);
    std::vector<int64_t>& into = expert_counts_[static_cast<size_t>(blk)];
    for (size_t e = 0; e < n.size() && e < into.size(); ++e) into[e] += n[e];
  }
}

template <typename C> void StageRunner<C>::reserve() {
  if (whole_) model_.reserve(mb_, split_.rows());
}

template <typename C> void StageRunner<C>::begin(Split split, int64_t index) {
  which_ = split;
  index_ = index;
  batches_.assign(static_cast<size_t>(per_rank_ / mb_), MicroBatch{});
  timing_ = link_ && split == Split::Train;
  if (timing_) {
    t_begin_ = now_s();
    wait_begin_ = link_->exposed_s();
  }
}

template <typename C> typename StageRunner<C>::MicroBatch& StageRunner<C>::load(int m) {
  MicroBatch& b = batches_.at(static_cast<size_t>(m));
  if (b.loaded) return b;
  // Every rank of a CP group reads the same rows (dp_index excludes cp and pp: every stage reads the
  // micro-batch too, the first for its tokens, the last for its targets, all for its layout); the
  // layout is the whole sequences' (documents are found on them), then the split keeps this rank's rows.
  const TokenLayout whole =
      read_(which_, index_, mesh_.dp_index() * per_rank_ + m * mb_, mb_, tok_.data(), tgt_.data());
  const TokenLayout lay = split_.take(tok_.data(), tgt_.data(), whole, mb_);
  const size_t n = static_cast<size_t>(mb_) * static_cast<size_t>(split_.rows());
  b.tok.assign(split_.tokens(), split_.tokens() + n);
  b.tgt.assign(split_.targets(), split_.targets() + n);
  if (lay.pos) b.pos.assign(lay.pos, lay.pos + n);
  if (lay.doc) b.doc.assign(lay.doc, lay.doc + n);
  if (lay.real) b.real.assign(lay.real, lay.real + n);
  b.layout = {lay.pos ? b.pos.data() : nullptr, lay.doc ? b.doc.data() : nullptr, lay.real ? b.real.data() : nullptr};
  b.loaded = true;
  return b;
}

template <typename C> int StageRunner<C>::local_chunk(int chunk) const {
  const int j = chunk / pl_.ranks;
  if (chunk % pl_.ranks != mesh_.coord().pp || j >= static_cast<int>(stage_.ranges.size()))
    throw std::logic_error("StageRunner: chunk " + std::to_string(chunk) + " is not on this pipeline rank");
  return j;
}

template <typename C> typename LlamaModel<C>::Context& StageRunner<C>::context(int m, int chunk) {
  const auto key = std::make_pair(m, chunk);
  auto it = live_.find(key);
  if (it != live_.end()) return it->second;
  const int j = local_chunk(chunk);
  // A free context of the chunk (sends copy what they send: a released context is free), else a new one.
  auto& pool = free_[static_cast<size_t>(j)];
  typename LlamaModel<C>::Context ctx;
  if (!pool.empty()) {
    ctx = std::move(pool.back());
    pool.pop_back();
  } else {
    ctx = typename LlamaModel<C>::Context(stage_.ranges[static_cast<size_t>(j)]);
  }
  return live_.emplace(key, std::move(ctx)).first->second;
}

template <typename C> void StageRunner<C>::release(int m, int chunk) {
  auto it = live_.find(std::make_pair(m, chunk));
  if (it == live_.end()) return;
  free_[static_cast<size_t>(local_chunk(chunk))].push_back(std::move(it->second));
  live_.erase(it);
}

template <typename C> double StageRunner<C>::run(const Schedule& schedule, double grad_scale) {
  const int me = mesh_.coord().pp;
  std::vector<Action> acts;
  for (const Action& a : schedule.actions())
    if (a.stage == me) acts.push_back(a);
  // The receives, per direction (0: inputs, 1: output gradients), in the order the actions need them.
  auto needs = [&](const Action& a, int d) {
    P2pTransfer t;
    return link_ && action_receive(a, pl_, &t) && t.grad == (d == 1);
  };
  std::vector<size_t> need[2];
  for (size_t i = 0; i < acts.size(); ++i)
    for (int d = 0; d < 2; ++d)
      if (needs(acts[i], d)) need[d].push_back(i);
  size_t posted[2] = {0, 0}, used[2] = {0, 0};
  // Posts the receives of the actions up to index `last` not posted yet, each into its buffer, at most
  // two per direction ahead of the action running.
  auto post = [&](size_t last) {
    for (int d = 0; d < 2; ++d)
      while (posted[d] < need[d].size() && need[d][posted[d]] <= last && posted[d] < used[d] + 2) {
        const Action& n = acts[need[d][posted[d]]];
        link_->post_recv(n.chunk, d == 1, (d == 0 ? in_ : grad_in_)[posted[d] % 2].data(), d == 0 ? fwd_elems_ : bwd_elems_);
        ++posted[d];
      }
  };
  // Grouped link (stream-ordered Comms, pipeline.h): at each slot's start the receives of its actions,
  // in one group with the slot before's sends (pipeline_p2p_groups); else this action's receive and
  // the next one's are in flight during this action's compute.
  const bool grouped = link_ && link_->grouped();
  if (grouped && acts != slot_acts_) {  // the order of a new schedule (every rank's groups simulated)
    std::string why;
    slot_starts_ = p2p_slot_starts(acts, pipeline_p2p_order(schedule, pl_, &why));
    if (!why.empty()) throw std::invalid_argument(why);  // the trainer refused it on every rank before
    slot_starts_.push_back(acts.size());
    slot_acts_ = acts;
  }
  const std::vector<size_t>& starts = slot_starts_;
  size_t slot = 0;
  double loss = 0;
  for (size_t i = 0; i < acts.size(); ++i) {
    const Action& a = acts[i];
    if (!grouped) {
      post(acts.size());
    } else if (i == starts[slot]) {
      post(starts[++slot] - 1);
      link_->issue();
    }
    recv_buf_ = nullptr;
    for (int d = 0; d < 2; ++d)
      if (needs(a, d)) recv_buf_ = (d == 0 ? in_ : grad_in_)[used[d]++ % 2].data();
    loss += run_timed(a, grad_scale);
  }
  return loss;
}

template <typename C> double StageRunner<C>::run_timed(const Action& a, double grad_scale) {
  if (!timing_) return run_action(a, grad_scale);
  const double t0 = now_s(), w0 = link_->exposed_s();
  const double loss = run_action(a, grad_scale);
  const double dt = now_s() - t0 - (link_->exposed_s() - w0);
  const size_t k = static_cast<size_t>(a.kind);  // Forward, Backward, BackwardInput, BackwardWeight
  std::array<double, 8>& c = chunk_times_[static_cast<size_t>(local_chunk(a.chunk))];
  c[k] += dt;
  c[4 + k] += 1;
  return loss;
}

template <typename C> double StageRunner<C>::run_action(const Action& a, double grad_scale) {
  const bool train = grad_scale > 0;
  const bool last = a.end == model_.config().num_hidden_layers, first = a.begin == 0;
  MicroBatch& b = load(a.microbatch);
  if (whole_) {  // the whole model: its own context, one micro-batch in flight (gradient accumulation)
    switch (a.kind) {
      case ActionKind::Forward:
        model_.forward(f_, b.tok.data(), mb_, split_.rows(), b.layout);
        return train ? 0.0 : model_.loss(f_, b.tgt.data());
      case ActionKind::Backward: {
        const double l = model_.head_backward(f_, b.tgt.data(), static_cast<typename LlamaModel<C>::S>(grad_scale));
        if (model_.config().is_moe()) {  // the load-balancing loss: its value, its gradient, the routing's counts
          moe_losses(nullptr);
          add_expert_counts(nullptr);
        }
        model_.backward(f_);
        return l;
      }
      default:
        break;
    }
    throw std::logic_error("StageRunner: a split backward action on the whole-model path (one_in_flight_problem)");
  }
  auto& ctx = context(a.microbatch, a.chunk);
  const bool moe = model_.config().is_moe();
  double loss = 0;
  switch (a.kind) {
    case ActionKind::Forward:
      if (!first) {
        link_->wait_recv(a.chunk, false, recv_buf_, fwd_elems_);
        if (moe) model_.seed_aux_stats(ctx, read_tail(recv_buf_, model_.aux_stats_size(mb_)));
      }
      model_.forward(f_, ctx, b.tok.data(), first ? nullptr : recv_buf_, mb_, split_.rows(), b.layout);
      if (!last) link_->send(a.chunk, false, ctx.output(), rows_elems_, padded(model_.aux_stats(ctx)));
      if (!train) {
        if (last) loss = model_.loss(f_, ctx, b.tgt.data());
        release(a.microbatch, a.chunk);
      }
      return loss;
    case ActionKind::Backward:
    case ActionKind::BackwardInput: {
      // Backward: the whole backward; BackwardInput (zero-bubble): the input gradients only, the
      // context keeping what the weight gradients need until this micro-batch's BackwardWeight.
      const bool split = a.kind == ActionKind::BackwardInput;
      const C* grad = nullptr;
      if (last) {
        loss = model_.head_backward(f_, ctx, b.tgt.data(), static_cast<typename LlamaModel<C>::S>(grad_scale));
        if (moe) moe_losses(&ctx);  // from the totals this last range holds
      } else {
        link_->wait_recv(a.chunk, true, recv_buf_, bwd_elems_);
        grad = recv_buf_;
        if (moe) model_.set_aux_grad(ctx, read_tail(recv_buf_, model_.aux_grad_size(mb_)));
      }
      if (moe) add_expert_counts(&ctx);
      if (split) model_.backward_input(f_, ctx, grad);
      else model_.backward(f_, ctx, grad);
      if (!first) link_->send(a.chunk, true, ctx.input_grad(), rows_elems_, padded(model_.aux_grad(ctx)));
      if (!split) release(a.microbatch, a.chunk);
      return loss;
    }
    case ActionKind::BackwardWeight:
      model_.backward_weight(f_, ctx);
      release(a.microbatch, a.chunk);
      return 0.0;
  }
  throw std::logic_error("StageRunner: an unknown action kind");
}

template <typename C> double StageRunner<C>::take_aux_sum() {
  const double s = aux_sum_;
  aux_sum_ = 0;
  return s;
}
template <typename C> double StageRunner<C>::take_z_sum() {
  const double s = z_sum_;
  z_sum_ = 0;
  return s;
}
template <typename C> std::vector<std::vector<int64_t>> StageRunner<C>::take_expert_counts() {
  std::vector<std::vector<int64_t>> n = std::move(expert_counts_);
  expert_counts_.clear();
  return n;
}

template <typename C> void StageRunner<C>::end() {
  if (link_) link_->flush();
  if (timing_) {
    loop_s_ += now_s() - t_begin_;
    wait_s_ += link_->exposed_s() - wait_begin_;
    timing_ = false;
  }
  for (auto& [key, ctx] : live_) free_[static_cast<size_t>(local_chunk(key.second))].push_back(std::move(ctx));
  live_.clear();
}

template <typename C> std::string StageRunner<C>::bubble_report(const Schedule& schedule, nlohmann::json* rec) {
  if (!link_) return "";
  // Every rank: [loop, wait, then per local chunk the mean F, B, I, W seconds], gathered over the world.
  const size_t v = chunk_times_.size(), per = 2 + 4 * v;
  std::vector<double> mine(per, 0.0), all(per * static_cast<size_t>(mesh_.world_size()));
  mine[0] = loop_s_;
  mine[1] = wait_s_;
  for (size_t j = 0; j < v; ++j)
    for (size_t k = 0; k < 4; ++k)
      mine[2 + 4 * j + k] = chunk_times_[j][4 + k] > 0 ? chunk_times_[j][k] / chunk_times_[j][4 + k] : 0.0;
  mesh_.world().all_gather(mine.data(), all.data(), per);
  loop_s_ = wait_s_ = 0;
  chunk_times_.assign(v, {});
  const std::vector<int> group = mesh_.layout().pp_group(0);  // world ranks of stages 0..p-1
  const int p = pl_.ranks, S = pl_.chunks();
  std::vector<double> measured(static_cast<size_t>(p));
  std::vector<ActionTimes> times(static_cast<size_t>(S));
  nlohmann::json ms = {{"forward", nlohmann::json::array()}, {"backward", nlohmann::json::array()},
                       {"backward_input", nlohmann::json::array()}, {"backward_weight", nlohmann::json::array()}};
  double tf = 0, ti = 0, tw = 0;
  // The step's span is the longest stage's (every stage starts the step together, after the last
  // step's all-reduce): a stage that finished earlier idles until then, besides its waits inside.
  double span = 0;
  for (int r = 0; r < p; ++r) span = std::max(span, all[per * static_cast<size_t>(group[static_cast<size_t>(r)])]);
  for (int r = 0; r < p; ++r) {
    const double* x = all.data() + per * static_cast<size_t>(group[static_cast<size_t>(r)]);
    measured[static_cast<size_t>(r)] = span > 0 ? (x[1] + span - x[0]) / span : 0.0;
  }
  const bool split = pl_.kind == PipelineKind::ZeroBubble;
  for (int c = 0; c < S; ++c) {
    const double* x = all.data() + per * static_cast<size_t>(group[static_cast<size_t>(pl_.rank_of(c))]) + 2 +
                      4 * static_cast<size_t>(c / p);
    ActionTimes& t = times[static_cast<size_t>(c)];
    t.forward = x[0];
    t.backward = split ? x[2] + x[3] : x[1];
    t.backward_input = split ? x[2] : x[1];
    t.backward_weight = split ? x[3] : 0.0;
    tf += t.forward / S;
    ti += t.backward_input / S;
    tw += t.backward_weight / S;
    ms["forward"].push_back(1e3 * x[0]);
    ms["backward"].push_back(1e3 * x[1]);
    ms["backward_input"].push_back(1e3 * x[2]);
    ms["backward_weight"].push_back(1e3 * x[3]);
  }
  const PipelineTimeline sim = simulate(schedule, times);
  const auto* ps = dynamic_cast<const PipelineSchedule*>(&schedule);
  const double ideal = ps ? ps->ideal_bubble(tf, ti, tw) : 0.0;
  (*rec)["pp_bubble"] = measured;
  // The largest stage's, a number TensorBoard shows (it leaves the per-stage arrays out).
  (*rec)["pp_bubble_max"] = *std::max_element(measured.begin(), measured.end());
  if (sim.error.empty()) (*rec)["pp_bubble_simulated"] = sim.idle;
  (*rec)["pp_bubble_ideal"] = ideal;
  (*rec)["pp_action_ms"] = ms;
  auto list = [](const std::vector<double>& x) {
    std::string s;
    for (double y : x) s += (s.empty() ? "" : ", ") + fixed(y);
    return s;
  };
  return " | pp bubble " + list(measured) + (sim.error.empty() ? " (simulated " + list(sim.idle) + "; " : " (") +
         "ideal " + fixed(ideal) + ")";
}

template class StageRunner<float>;
template class StageRunner<double>;
template class StageRunner<bf16>;

}  // namespace shardtrain
