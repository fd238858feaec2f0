// StageRunner (stage_runner.h): a schedule's actions on this rank's chunks.
#include "shardtrain/stage_runner.h"

#include <stdexcept>
#include <string>

namespace shardtrain {

template <typename C>
StageRunner<C>::StageRunner(const Mesh& mesh, Backend<C>& be, LlamaModel<C>& model, UnitSource<C>& f,
                            const RankUnits& stage, const PipelineLayout& pl, StageLink<C>* link,
                            const TrainConfig& tc, const TokenDataset& data, int per_rank, int micro_batch)
    : mesh_(mesh), be_(be), model_(model), f_(f), stage_(stage), pl_(pl), link_(link), tc_(tc), data_(data),
      per_rank_(per_rank), mb_(micro_batch), split_(mesh, tc.seq_len) {
  whole_ = stage_.ranges.size() == 1 && stage_.ranges[0].units.empty();
  free_.resize(stage_.ranges.size());
  tok_.resize(static_cast<size_t>(mb_) * tc.seq_len);
  tgt_.resize(tok_.size());
  // R x C rows of a micro-batch on this rank: B x T / cp tokens, 1 / tp of them under sequence parallelism.
  rows_elems_ = static_cast<size_t>(mb_) * static_cast<size_t>(split_.rows()) / static_cast<size_t>(mesh.dims().tp) *
                static_cast<size_t>(model.config().hidden_size);
  if (link_) {
    in_ = Buffer<C>(be_, rows_elems_);
    grad_in_ = Buffer<C>(be_, rows_elems_);
  }
}

template <typename C> void StageRunner<C>::begin(Split split, int64_t index) {
  which_ = split;
  index_ = index;
  batches_.assign(static_cast<size_t>(per_rank_ / mb_), MicroBatch{});
}

template <typename C> typename StageRunner<C>::MicroBatch& StageRunner<C>::load(int m) {
  MicroBatch& b = batches_.at(static_cast<size_t>(m));
  if (b.loaded) return b;
  // Every rank of a CP group reads the same rows (dp_index excludes cp and pp: every stage reads the
  // micro-batch too, the first for its tokens, the last for its targets, all for its layout); the
  // layout is the whole sequences' (documents are found on them), then the split keeps this rank's rows.
  fill_batch(data_, which_, tc_.seed, index_, mesh_.dp_index() * per_rank_ + m * mb_, mb_, tc_.seq_len, tok_.data(),
             tgt_.data());
  const TokenLayout lay =
      split_.take(tok_.data(), tgt_.data(), batch_layout(tc_, data_, tok_.data(), mb_, tc_.seq_len, pos_, doc_), mb_);
  const size_t n = static_cast<size_t>(mb_) * static_cast<size_t>(split_.rows());
  b.tok.assign(split_.tokens(), split_.tokens() + n);
  b.tgt.assign(split_.targets(), split_.targets() + n);
  if (lay.pos) b.pos.assign(lay.pos, lay.pos + n);
  if (lay.doc) b.doc.assign(lay.doc, lay.doc + n);
  b.layout = {lay.pos ? b.pos.data() : nullptr, lay.doc ? b.doc.data() : nullptr};
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
  // A free context whose output and input gradient have left (a send in flight still reads them);
  // else a new one. Never waits for a send here: the receiver may be waiting for this rank's next
  // action, and the sends are waited for only at end().
  auto& pool = free_[static_cast<size_t>(j)];
  typename LlamaModel<C>::Context ctx;
  bool found = false;
  for (size_t i = 0; i < pool.size() && !found; ++i)
    if (!link_ || (link_->done_sending(pool[i].output()) && link_->done_sending(pool[i].input_grad()))) {
      ctx = std::move(pool[i]);
      pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(i));
      found = true;
    }
  if (!found) ctx = typename LlamaModel<C>::Context(stage_.ranges[static_cast<size_t>(j)]);
  return live_.emplace(key, std::move(ctx)).first->second;
}

template <typename C> void StageRunner<C>::release(int m, int chunk) {
  auto it = live_.find(std::make_pair(m, chunk));
  if (it == live_.end()) return;
  free_[static_cast<size_t>(local_chunk(chunk))].push_back(std::move(it->second));
  live_.erase(it);
}

template <typename C> double StageRunner<C>::run(const Action& a, float grad_scale) {
  const bool train = grad_scale > 0;
  const bool last = a.end == model_.config().num_hidden_layers, first = a.begin == 0;
  MicroBatch& b = load(a.microbatch);
  if (whole_) {  // the whole model: its own context, one micro-batch in flight (gradient accumulation)
    switch (a.kind) {
      case ActionKind::Forward:
        model_.forward(f_, b.tok.data(), mb_, split_.rows(), b.layout);
        return train ? 0.0 : model_.loss(f_, b.tgt.data());
      case ActionKind::Backward: {
        const double l = model_.head_backward(f_, b.tgt.data(), grad_scale);
        model_.backward(f_);
        return l;
      }
      default:
        break;
    }
    throw std::logic_error("StageRunner: a split backward action on the whole-model path (one_in_flight_problem)");
  }
  auto& ctx = context(a.microbatch, a.chunk);
  double loss = 0;
  switch (a.kind) {
    case ActionKind::Forward:
      if (!first) link_->recv_input(a.chunk, in_.data(), rows_elems_);
      model_.forward(f_, ctx, b.tok.data(), first ? nullptr : in_.data(), mb_, split_.rows(), b.layout);
      if (!last) link_->send_output(a.chunk, ctx.output(), rows_elems_);
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
        loss = model_.head_backward(f_, ctx, b.tgt.data(), grad_scale);
      } else {
        link_->recv_output_grad(a.chunk, grad_in_.data(), rows_elems_);
        grad = grad_in_.data();
      }
      if (split) model_.backward_input(f_, ctx, grad);
      else model_.backward(f_, ctx, grad);
      if (!first) link_->send_input_grad(a.chunk, ctx.input_grad(), rows_elems_);
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

template <typename C> void StageRunner<C>::end() {
  if (link_) link_->flush();
  for (auto& [key, ctx] : live_) free_[static_cast<size_t>(local_chunk(key.second))].push_back(std::move(ctx));
  live_.clear();
}

template class StageRunner<float>;
template class StageRunner<double>;
template class StageRunner<bf16>;

}  // namespace shardtrain
