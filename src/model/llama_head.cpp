// Llama's head (model.h): the final norm's output through the LM head and the cross-entropy loss,
// in chunks of tokens, with their backward (head_backward) or without (loss); the full logits for
// generation (head_logits).
#include <algorithm>
#include <stdexcept>

#include "shardtrain/model/model.h"

namespace shardtrain {

template <typename T> void LlamaModel<T>::head_logits(UnitSource<T>& f) {
  expect_stage(ctx_, Stage::Forward, "head_logits");
  if (tp_n_ > 1) throw std::logic_error("LlamaModel::head_logits is not available under tensor parallelism");
  ctx_.stage_ = Stage::None;
  const LlamaDims& d = d_;
  const T* hw = ctx_.head_gathers_ == gathers_ ? ctx_.head_w_ : gather(f, d.L + 1);
  const T* wout = c_.tie_word_embeddings ? gather(f, 0) : hw + head_off_w_;
  if (logits_.size() != static_cast<size_t>(d.BT) * d.V) logits_ = Buffer<T>(be_, static_cast<size_t>(d.BT) * d.V);
  linear(be_, LinearRole::Forward, d.BT, d.V, d.C, ctx_.lnf_.data(), wout, logits_.data(), false);
}

template <typename T> double LlamaModel<T>::loss(UnitSource<T>& f, Context& ctx, const int32_t* targets) {
  if (ctx.r_.end != c_.num_hidden_layers) throw std::logic_error("LlamaModel::loss: the range does not end at the head");
  expect_stage(ctx, Stage::Forward, "loss");
  ctx.stage_ = Stage::None;
  return head(f, ctx, targets, false, S(0));
}

template <typename T>
double LlamaModel<T>::head_backward(UnitSource<T>& f, Context& ctx, const int32_t* targets, S grad_scale) {
  if (ctx.r_.end != c_.num_hidden_layers)
    throw std::logic_error("LlamaModel::head_backward: the range does not end at the head");
  expect_stage(ctx, Stage::Forward, "head_backward");
  ctx.stage_ = Stage::None;
  const double loss_sum = head(f, ctx, targets, true, grad_scale);
  ctx.stage_ = Stage::HeadBackward;
  return loss_sum;
}

// LM head and loss in chunks of d.chunk tokens (Liger-Kernel's fused linear cross-entropy and
// torchtune's chunked loss do the same): per chunk, logits = lnf W^T, the loss, and with `grad`
// dlogits (in place), dlnf = dlogits W and dW += dlogits^T lnf. Then the final norm's backward
// gives ctx.dres_, where the blocks' backward starts. Collective (TP: the all-gather of the final
// norm's output first; gathers, reduce-scatters).
template <typename T>
double LlamaModel<T>::head(UnitSource<T>& f, Context& ctx, const int32_t* targets, bool grad, S grad_scale) {
  const LlamaDims& d = d_;
  const BlockRange& r = ctx.r_;
  check_ids(targets, d.BT, /*targets=*/true);
  // Under TP the logits are this rank's vocabulary columns [chunk, Vl] of all BT rows (the final
  // norm's output all-gathered into full_), the loss the vocabulary-parallel one.
  const T* lnf = gather_rows(ctx.lnf_.data(), full_);
  be_.ids_from_host(ctx.targets_.data(), targets, static_cast<size_t>(d.BT));
  const bool tied = c_.tie_word_embeddings;
  // ctx.head_w_ is the unit as ctx's forward() gathered it, unless this model gathered since (another
  // micro-batch's forward in between, as in a pipeline schedule): then it is gathered again.
  // (Tied, hw is not read before the gather of unit 0, and unit L+1 is gathered again after it.)
  const T* hw = tied || ctx.head_gathers_ == gathers_ ? ctx.head_w_ : gather(f, r.unit(d.L + 1));
  const T* wout = tied ? gather(f, r.unit(0)) : hw + head_off_w_;  // gathering unit 0 invalidates hw
  T* gw = nullptr;
  if (grad) gw = tied ? f.full_grad(r.unit(0)) : f.full_grad(r.unit(d.L + 1)) + head_off_w_;
  // The loss is summed on the backend (cross_entropy_sum) and read once, at the end: one host
  // synchronisation per micro-batch on a GPU instead of one per chunk. The sum starts at 0 (every
  // path out of here takes it).
  T* dlnf = input_grad();
  try {
    for (int r0 = 0; r0 < d.BT; r0 += d.chunk) {
      const int n = std::min(d.chunk, d.BT - r0);
      T* lg = chunk_logits_.data();
      const T* x = lnf + static_cast<int64_t>(r0) * d.C;
      const int32_t* tg = ctx.targets_.data() + r0;
      linear(be_, LinearRole::Forward, n, d.Vl, d.C, x, wout, lg, false);
      if (tp_n_ == 1) {
        be_.cross_entropy_sum(grad ? lg : nullptr, lg, tg, n, d.V, grad ? grad_scale : S(0));
      } else {
        be_.vocab_ce_max(lg, n, d.Vl, d.valid, ce_mx_.data());
        tp_->all_gather_acc(ce_mx_.data(), ce_maxes_.data(), static_cast<size_t>(n));
        be_.vocab_ce_sum(lg, tg, n, d.Vl, d.valid, d.v0, ce_maxes_.data(), tp_n_, ce_st_.data());
        tp_->all_reduce_sum_acc(ce_st_.data(), 2 * static_cast<size_t>(n));
        be_.vocab_ce_finish(grad ? lg : nullptr, lg, tg, n, d.Vl, d.valid, d.v0, ce_maxes_.data(), tp_n_,
                            ce_st_.data(), grad ? grad_scale : S(0));
      }
      if (!grad) continue;
      linear(be_, LinearRole::InputGrad, n, d.Vl, d.C, lg, wout, dlnf + static_cast<int64_t>(r0) * d.C, false);
      linear(be_, LinearRole::WeightGrad, n, d.Vl, d.C, lg, x, gw, true);
    }
  } catch (...) {
    try {
      (void)be_.take_loss_sum();
    } catch (...) {  // the first error is the one to report
    }
    throw;
  }
  if (!grad) return be_.take_loss_sum();
  if (tied) {
    f.reduce_scatter_grad(r.unit(0));
    hw = gather(f, r.unit(d.L + 1));  // again: the embedding replaced it in the gather buffer (norm weight only: [C])
  }
  T* ghw = tied ? f.full_grad(r.unit(d.L + 1)) : gw - head_off_w_;
  reduce_input_grad();  // TP: the partial d(final norm output) summed, this rank's rows into dln_
  be_.zero(ctx.dres_.data(), static_cast<size_t>(d.R) * d.C);
  be_.rmsnorm_backward(ctx.dres_.data(), ghw + head_off_norm_, dln_.data(), ctx.xf_.data(), hw + head_off_norm_,
                       ctx.rstdf_.data(), d.R, d.C);
  f.reduce_scatter_grad(r.unit(d.L + 1));
  return be_.take_loss_sum();
}

// This file's members of LlamaModel, for each storage type (llama.cpp instantiates the class, and
// with it the members defined there).
#define ST_LLAMA_HEAD(T) \
  template void LlamaModel<T>::head_logits(UnitSource<T>&); \
  template double LlamaModel<T>::loss(UnitSource<T>&, Context&, const int32_t*); \
  template double LlamaModel<T>::head_backward(UnitSource<T>&, Context&, const int32_t*, S); \
  template double LlamaModel<T>::head(UnitSource<T>&, Context&, const int32_t*, bool, S);
ST_LLAMA_HEAD(float)
ST_LLAMA_HEAD(double)
ST_LLAMA_HEAD(bf16)
#undef ST_LLAMA_HEAD

}  // namespace shardtrain
