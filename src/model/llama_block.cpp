// A Llama transformer block (model.h): its forward (the attention and MLP sub-blocks), its
// backward and, split off for zero-bubble schedules, its weight gradients; every projection
// (linear), and the sequence-parallel movements of the residual rows around them.
#include <stdexcept>

#include "shardtrain/model/model.h"

namespace shardtrain {

namespace {
constexpr LinearRole kFwd = LinearRole::Forward, kDIn = LinearRole::InputGrad, kDW = LinearRole::WeightGrad;
}  // namespace

// ---- projections ------------------------------------------------------------------------------
template <typename T>
void linear(Backend<T>& be, LinearRole role, int M, int N, int K, const T* a, const T* b, T* out, bool accumulate) {
  using S = typename Backend<T>::S;
  const S beta = accumulate ? S(1) : S(0);
  switch (role) {
    case LinearRole::Forward:  // out[M, N] = x[M, K] W[N, K]^T
      be.gemm(false, true, M, N, K, S(1), a, K, b, K, beta, out, N);
      return;
    case LinearRole::InputGrad:  // out[M, K] = dy[M, N] W[N, K]
      be.gemm(false, false, M, K, N, S(1), a, N, b, K, beta, out, K);
      return;
    case LinearRole::WeightGrad:  // out[N, K] = dy[M, N]^T x[M, K]
      be.gemm(true, false, N, K, M, S(1), a, N, b, K, beta, out, K);
      return;
  }
}

template <typename T>
void LlamaModel<T>::proj(LinearRole role, int M, int N, int K, const T* a, const T* b, T* out, bool accumulate) {
  if (!o_.fp8) return linear(be_, role, M, N, K, a, b, out, accumulate);
  math::Fp8Gemm g = math::Fp8Gemm::Forward;
  switch (role) {
    case LinearRole::Forward: g = math::Fp8Gemm::Forward; break;
    case LinearRole::InputGrad: g = math::Fp8Gemm::InputGrad; break;
    case LinearRole::WeightGrad: g = math::Fp8Gemm::WeightGrad; break;
  }
  be_.linear_fp8(g, M, N, K, a, b, out, accumulate);
}

template <typename T> const T* LlamaModel<T>::keep_rows(const T* local, Buffer<T>& into) {
  if (tp_n_ > 1) return gather_rows(local, into);
  be_.copy(into.data(), local, static_cast<size_t>(d_.R) * d_.C);
  return into.data();
}

template <typename T> const T* LlamaModel<T>::norm_rows(T* rstd, const T* x, const T* wn, Buffer<T>* into) {
  const LlamaDims& d = d_;
  if (into && tp_n_ == 1) {  // the rows are all rows: normalize straight into the kept buffer
    be_.rmsnorm_forward(into->data(), rstd, x, wn, d.R, d.C, eps_);
    return into->data();
  }
  be_.rmsnorm_forward(ln_.data(), rstd, x, wn, d.R, d.C, eps_);
  return gather_rows(ln_.data(), into ? *into : full_);
}

template <typename T> const T* LlamaModel<T>::gather_rows(const T* local, Buffer<T>& into) {
  if (tp_n_ == 1) return local;
  tp_->all_gather(local, into.data(), static_cast<size_t>(d_.R) * d_.C);
  return into.data();
}

template <typename T> void LlamaModel<T>::row_parallel_residual(const T* in, int K, const T* W, const T* x, T* out) {
  const LlamaDims& d = d_;
  const size_t n = static_cast<size_t>(d.R) * d.C;
  if (tp_n_ == 1) {
    be_.copy(out, x, n);
    proj(kFwd, d.BT, d.C, K, in, W, out, true);
    return;
  }
  proj(kFwd, d.BT, d.C, K, in, W, full_.data(), false);  // this rank's partial sums, all rows
  tp_->reduce_scatter_sum(full_.data(), out, n);                 // summed over the group, this rank's rows
  be_.axpy(n, S(1), x, out);
}

template <typename T> void LlamaModel<T>::reduce_input_grad() {
  if (tp_n_ > 1) tp_->reduce_scatter_sum(dfull_.data(), dln_.data(), static_cast<size_t>(d_.R) * d_.C);
}

template <typename T>
void LlamaModel<T>::block_forward(UnitSource<T>& f, const Context& ctx, int l, const T* w, const T* x, Layer& a, T* h,
                                  T* att, T* xn) {
  const LlamaDims& d = d_;
  const Offsets& off_ = offsets(l);  // a dense or an MoE block's
  // Attention sub-block: x1 = x + o_proj(attn(rope(q), rope(k), v)) on rmsnorm(x).
  be_.rmsnorm_forward(ln_.data(), a.rstd1.data(), x, w + off_.ln1, d.R, d.C, eps_);
  const T* n1 = gather_rows(ln_.data(), full_);
  const bool qkn = off_.qn >= 0;  // Qwen3: q and k are normalized per head before RoPE
  proj(kFwd, d.BT, d.Q, d.C, n1, w + off_.q, qkn ? a.qp.data() : a.q.data(), false);
  proj(kFwd, d.BT, d.KV, d.C, n1, w + off_.k, qkn ? a.kp.data() : a.k.data(), false);
  proj(kFwd, d.BT, d.KV, d.C, n1, w + off_.v, a.v.data(), false);
  if (qkn) {
    head_norm(a.q.data(), a.rq.data(), a.qp.data(), w + off_.qn, d.NH);
    head_norm(a.k.data(), a.rk.data(), a.kp.data(), w + off_.kn, d.NKV);
  }
  rope_qk(ctx, a.q.data(), a.k.data(), false);
  attend(ctx, a, att);
  row_parallel_residual(a.y.data(), d.Q, w + off_.o, x, a.x1.data());
  // MLP sub-block: x_next = x1 + down(silu(gate(n)) * up(n)), n = rmsnorm(x1).
  be_.rmsnorm_forward(ln_.data(), a.rstd2.data(), a.x1.data(), w + off_.ln2, d.R, d.C, eps_);
  if (is_moe(l)) return moe_forward(f, ctx, l, w, a, h, xn);  // ... or its experts'
  const T* n2 = gather_rows(ln_.data(), full_);
  proj(kFwd, d.BT, d.I, d.C, n2, w + off_.gate, a.g.data(), false);
  proj(kFwd, d.BT, d.I, d.C, n2, w + off_.up, a.u.data(), false);
  be_.swiglu_forward(h, a.g.data(), a.u.data(), static_cast<size_t>(d.BT) * d.I);
  if (!xn) return;
  row_parallel_residual(h, d.I, w + off_.down, a.x1.data(), xn);
}

template <typename T>
typename LlamaModel<T>::Layer& LlamaModel<T>::backward_activations(UnitSource<T>& f, Context& ctx, int l, const T* w) {
  const LlamaDims& d = d_;
  const size_t n = static_cast<size_t>(d.BT) * d.I;
  Layer& a = ctx.layers_[static_cast<size_t>(l - ctx.r_.begin)];
  switch (o_.recompute) {
    case Recompute::None:
      return a;
    case Recompute::Selective:
      if (is_moe(l) && ep_) grow_expert_rows(a, work_.h.data());  // work_.h holds this block's expert rows
      be_.swiglu_forward(work_.h.data(), a.g.data(), a.u.data(), is_moe(l) ? expert_rows(a) * d.IE : n);
      if (o_.attention == AttentionKind::Exact)  // the probabilities only (y is kept)
        shardtrain::attention_forward<T>(be_, a.q.data(), a.k.data(), a.v.data(), work_.att.data(), nullptr, d.B, d.T_,
                                         d.NH, d.NKV, d.HD, ctx.use_doc_ ? ctx.doc_.data() : nullptr);
      return a;
    case Recompute::Full:
      block_forward(f, ctx, l, w, a.x.data(), work_, work_.h.data(), work_.att.data(), nullptr);
      return work_;
  }
  return a;
}

// With keep (backward_input) every operand a weight-gradient GEMM reads goes to *keep instead of
// the model's scratch (the same kernels on the same values, so the same bits), and block_weight
// makes those GEMMs later with the arguments this function would have passed.
template <typename T>
void LlamaModel<T>::block_backward(UnitSource<T>& f, Context& ctx, int l, const T* w, Deferred* keep) {
  const LlamaDims& d = d_;
  const Offsets& off_ = offsets(l);
  Layer& a = backward_activations(f, ctx, l, w);
  T* gw = keep ? nullptr : f.full_grad(ctx.r_.unit(1 + l));
  T* dres = ctx.dres_.data();
  const T* x = ctx.layers_[static_cast<size_t>(l - ctx.r_.begin)].x.data();
  const T* h = o_.recompute == Recompute::None ? a.h.data() : work_.h.data();
  const T* att = o_.recompute == Recompute::None ? a.att.data() : work_.att.data();
  if (keep) {  // what the context does not keep and the next block's recomputation overwrites
    if (keep->h.size()) be_.copy(keep->h.data(), h, keep->h.size());
    if (keep->y.size()) be_.copy(keep->y.data(), a.y.data(), keep->y.size());
    be_.zero(keep->dnorm.data(), keep->dnorm.size());  // the RMSNorm kernels add into it, as into gw
  }
  T* dg = keep ? keep->dg.data() : dg_.data();
  T* du = keep ? keep->du.data() : du_.data();
  T* dq = keep ? keep->dq.data() : dq_.data();
  T* dk = keep ? keep->dk.data() : dk_.data();
  T* dv = keep ? keep->dv.data() : dv_.data();
  T* gln1 = keep ? keep->dnorm.data() : gw + off_.ln1;
  T* gln2 = keep ? keep->dnorm.data() + d.C : gw + off_.ln2;
  const T* dr = nullptr;
  if (is_moe(l)) {  // the experts' and the router's, into dln_ (no TP, no keep: llama_units, backward_input)
    moe_backward(f, ctx, l, w, a, h, gw);
  } else {
    // MLP: x_next = x1 + h Wd^T.  dres flows to x1 unchanged (+ the norm path below).
    dr = keep ? keep_rows(dres, keep->dr2) : gather_rows(dres, dfull_);  // TP: all rows of d(x_next)
    proj(kDIn, d.BT, d.C, d.I, dr, w + off_.down, dh_.data(), false);
    if (!keep) proj(kDW, d.BT, d.C, d.I, dr, h, gw + off_.down, true);
    be_.swiglu_backward(dg, du, dh_.data(), a.g.data(), a.u.data(), static_cast<size_t>(d.BT) * d.I);
    proj(kDIn, d.BT, d.I, d.C, dg, w + off_.gate, input_grad(), false);
    proj(kDIn, d.BT, d.I, d.C, du, w + off_.up, input_grad(), true);
    // The normalized input is not kept per layer: recomputed (bitwise the same values, rstd too).
    const T* n2 = norm_rows(a.rstd2.data(), a.x1.data(), w + off_.ln2, keep ? &keep->n2 : nullptr);
    if (!keep) {
      proj(kDW, d.BT, d.I, d.C, dg, n2, gw + off_.gate, true);
      proj(kDW, d.BT, d.I, d.C, du, n2, gw + off_.up, true);
    }
    reduce_input_grad();
  }
  be_.rmsnorm_backward(dres, gln2, dln_.data(), a.x1.data(), w + off_.ln2, a.rstd2.data(), d.R, d.C);
  // Attention: x1 = x + y Wo^T.
  dr = keep ? keep_rows(dres, keep->dr1) : gather_rows(dres, dfull_);
  proj(kDIn, d.BT, d.C, d.Q, dr, w + off_.o, dy_.data(), false);
  if (!keep) proj(kDW, d.BT, d.C, d.Q, dr, a.y.data(), gw + off_.o, true);
  attend_backward(ctx, a, att, dq, dk, dv);
  rope_qk(ctx, dq, dk, true);
  if (off_.qn >= 0) {  // d(q), d(k) before the per-head norm; its weight gradients after the others'
    head_norm_backward(dq, keep ? keep->dnorm.data() + 2 * d.C : gw + off_.qn, a.qp.data(), w + off_.qn, a.rq.data(),
                       d.NH);
    head_norm_backward(dk, keep ? keep->dnorm.data() + 2 * d.C + d.HD : gw + off_.kn, a.kp.data(), w + off_.kn,
                       a.rk.data(), d.NKV);
  }
  proj(kDIn, d.BT, d.Q, d.C, dq, w + off_.q, input_grad(), false);
  proj(kDIn, d.BT, d.KV, d.C, dk, w + off_.k, input_grad(), true);
  proj(kDIn, d.BT, d.KV, d.C, dv, w + off_.v, input_grad(), true);
  const T* n1 = norm_rows(a.rstd1.data(), x, w + off_.ln1, keep ? &keep->n1 : nullptr);
  if (!keep) {
    proj(kDW, d.BT, d.Q, d.C, dq, n1, gw + off_.q, true);
    proj(kDW, d.BT, d.KV, d.C, dk, n1, gw + off_.k, true);
    proj(kDW, d.BT, d.KV, d.C, dv, n1, gw + off_.v, true);
  }
  reduce_input_grad();
  be_.rmsnorm_backward(dres, gln1, dln_.data(), x, w + off_.ln1, a.rstd1.data(), d.R, d.C);
}

// block_backward's weight gradients, in its order, from what it kept. gw is zeroed (full_grad), and
// the RMSNorm kernels started keep.dnorm from zero as they would have started gw: copying them in
// gives backward's bits.
template <typename T> void LlamaModel<T>::block_weight(const Context& ctx, int l, T* gw) {
  const LlamaDims& d = d_;  // dense blocks only (backward_input refuses a model with MoE blocks)
  const Offsets& off_ = dense_off_;
  const size_t i = static_cast<size_t>(l - ctx.r_.begin);
  const Deferred& k = ctx.w_[i];
  const Layer& a = ctx.layers_[i];  // h (Recompute::None) and y (None, Selective) are the context's
  const T* h = k.h.size() ? k.h.data() : a.h.data();
  const T* y = k.y.size() ? k.y.data() : a.y.data();
  proj(kDW, d.BT, d.C, d.I, k.dr2.data(), h, gw + off_.down, true);
  proj(kDW, d.BT, d.I, d.C, k.dg.data(), k.n2.data(), gw + off_.gate, true);
  proj(kDW, d.BT, d.I, d.C, k.du.data(), k.n2.data(), gw + off_.up, true);
  be_.copy(gw + off_.ln2, k.dnorm.data() + d.C, static_cast<size_t>(d.C));
  proj(kDW, d.BT, d.C, d.Q, k.dr1.data(), y, gw + off_.o, true);
  proj(kDW, d.BT, d.Q, d.C, k.dq.data(), k.n1.data(), gw + off_.q, true);
  proj(kDW, d.BT, d.KV, d.C, k.dk.data(), k.n1.data(), gw + off_.k, true);
  proj(kDW, d.BT, d.KV, d.C, k.dv.data(), k.n1.data(), gw + off_.v, true);
  be_.copy(gw + off_.ln1, k.dnorm.data(), static_cast<size_t>(d.C));
  if (off_.qn >= 0) {
    be_.copy(gw + off_.qn, k.dnorm.data() + 2 * d.C, static_cast<size_t>(d.HD));
    be_.copy(gw + off_.kn, k.dnorm.data() + 2 * d.C + d.HD, static_cast<size_t>(d.HD));
  }
}

// This file's members of LlamaModel and linear, for each storage type (llama.cpp instantiates
// the class, and with it the members defined there).
#define ST_LLAMA_BLOCK(T) \
  template void linear<T>(Backend<T>&, LinearRole, int, int, int, const T*, const T*, T*, bool); \
  template void LlamaModel<T>::proj(LinearRole, int, int, int, const T*, const T*, T*, bool); \
  template const T* LlamaModel<T>::keep_rows(const T*, Buffer<T>&); \
  template const T* LlamaModel<T>::norm_rows(T*, const T*, const T*, Buffer<T>*); \
  template const T* LlamaModel<T>::gather_rows(const T*, Buffer<T>&); \
  template void LlamaModel<T>::row_parallel_residual(const T*, int, const T*, const T*, T*); \
  template void LlamaModel<T>::reduce_input_grad(); \
  template void LlamaModel<T>::block_forward(UnitSource<T>&, const Context&, int, const T*, const T*, Layer&, T*, T*, \
                                             T*);                                                               \
  template LlamaModel<T>::Layer& LlamaModel<T>::backward_activations(UnitSource<T>&, Context&, int, const T*); \
  template void LlamaModel<T>::block_backward(UnitSource<T>&, Context&, int, const T*, Deferred*); \
  template void LlamaModel<T>::block_weight(const Context&, int, T*);
ST_LLAMA_BLOCK(float)
ST_LLAMA_BLOCK(double)
ST_LLAMA_BLOCK(bf16)
#undef ST_LLAMA_BLOCK

}  // namespace shardtrain
