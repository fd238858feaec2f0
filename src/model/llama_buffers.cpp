// Llama's activation buffers (model.h): what each recompute mode keeps per block and what the
// shared scratch holds (Sizes), the byte counts the memory plan reads (activation_bytes,
// context_bytes, deferred_weight_bytes) and the allocations themselves (LlamaModel::ensure*), one
// table for both so that the plan cannot drift from the code.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "shardtrain/model/model.h"
#include "shardtrain/backend/ops_math.h"

namespace shardtrain {

namespace {
// Elements of every activation buffer, by the buffer's role; LlamaModel::ensure allocates exactly
// these and activation_bytes() adds them up, so the memory plan cannot drift from the code.
struct Sizes {
  int64_t BT, x, rstd, q, kv, att, lse, y, gi;  // gi: gate / up / h / their gradients, [BT, I]
  int64_t chunk_logits, rope, dsum;
  bool keep_all, keep_h, keep_att;  // per-layer buffers besides x; h; exact probabilities
  int64_t full, ce;  // TP > 1: full_ and dfull_ [BT, C] each; the cross-entropy's scalars
  int64_t layout;    // mask Document: a context's positions and documents, the model's row indices (ids each)
  // q/k norm (Qwen3): q and k before it ([BT, Q], [BT, KV], kept with q and k) and its rstd
  // ([BT*NH], [BT*NKV]); 0 without. Its weight gradients: 2*HD more in a Deferred's norms.
  int64_t qn, kn, rqn, rkn;
  // Mixture of experts (0 for a dense model): ge [slots, IE] (an MoE block's g, u, h and their
  // gradients), ye [slots, C] (its experts' outputs; the scratch's gathered inputs and their
  // gradient), probs and the router logits [BT, E], slots = BT*K; stats [G, E] (the load-balancing
  // statistics of a context, G = B or 1 by the aux scope; zstats [G] the z-loss's). gmax: the larger of gi and ge among the
  // block kinds the model has (the shared scratch and the recomputed block hold either).
  // Under EP (ep > 1) ge is [er, IE] (er = N x slots, LlamaDims::er), and the exchange's scratch
  // xr [er, C] (three of them: received, expert-major, the experts' outputs) and its two
  // permutations pids [er] (ids); 0 without EP.
  bool moe, dense;
  int64_t ge, ye, probs, slots, stats, zstats, gmax, xr, pids;
  // Elements a block keeps besides x, h and the exact probabilities, when it keeps them
  // (keep_all): in T, in S (accumulator arrays: lse; MoE probs and weights) and int32 ids (MoE
  // experts, rowtok, pos).
  int64_t rest(bool m) const { return 2 * rstd + q + 2 * kv + y + x + (m ? 2 * ge + ye : 2 * gi) + qn + kn + rqn + rkn; }
  int64_t rest_acc(bool m) const { return lse + (m ? probs + slots + BT : 0); }  // BT: zlse
  int64_t rest_ids(bool m) const { return m ? 3 * slots : 0; }
  // Bytes a block of kind m keeps from forward to backward (elements of E bytes, accumulators of A).
  int64_t block(bool m, int64_t E, int64_t A) const {
    return E * x + (keep_all ? E * rest(m) + A * rest_acc(m) + 4 * rest_ids(m) : 0) + (keep_h ? E * (m ? ge : gi) : 0) +
           (keep_att ? E * att : 0);
  }
  // The recomputed block (Recompute::Full): either kind.
  int64_t work_rest() const { return 2 * rstd + q + 2 * kv + y + x + 2 * gmax + (moe ? ye : 0) + qn + kn + rqn + rkn; }
  int64_t work_acc() const { return lse + (moe ? probs + slots + BT : 0); }
  int64_t work_ids() const { return moe ? 3 * slots : 0; }
  // balanced: the expert rows sized for balanced routing (B·T·k, what the plan reports beside the
  // worst case that is allocated) instead of d.er.
  Sizes(const LlamaDims& d, const ModelOptions& o, const ModelConfig& c, bool balanced = false) {
    const bool qk_norm = c.qk_norm;
    BT = d.BT;
    layout = o.mask == AttentionMask::Document || d.cp > 1 ? BT : 0;
    x = int64_t{d.R} * d.C;  // the residual stream: this rank's rows (all of them without TP)
    rstd = d.R;
    full = d.tp > 1 ? BT * d.C : 0;
    ce = d.tp > 1 ? int64_t{d.chunk} * (d.tp + 3) : 0;
    q = BT * d.Q;
    kv = BT * d.KV;
    const bool tiled = o.attention == AttentionKind::Tiled;
    att = tiled ? 0 : int64_t{d.B} * d.NH * d.T_ * d.T_;
    lse = tiled ? int64_t{d.B} * d.NH * d.T_ : 0;
    dsum = lse;
    y = q;
    gi = BT * d.I;
    chunk_logits = int64_t{d.chunk} * d.Vl;
    rope = int64_t{d.Tg} * (d.HD / 2);
    keep_all = o.recompute != Recompute::Full;
    keep_h = o.recompute == Recompute::None;
    keep_att = o.recompute == Recompute::None;
    rows = BT * d.C;
    keep_w_h = o.recompute != Recompute::None;
    keep_w_y = o.recompute == Recompute::Full;
    norms = 2 * int64_t{d.C} + (qk_norm ? 2 * int64_t{d.HD} : 0);
    qn = qk_norm ? q : 0;
    kn = qk_norm ? kv : 0;
    rqn = qk_norm ? BT * d.NH : 0;
    rkn = qk_norm ? BT * d.NKV : 0;
    moe = c.is_moe();
    dense = c.num_moe_layers() < c.num_hidden_layers;
    slots = moe ? int64_t{d.slots} : 0;
    const int64_t er = balanced ? d.slots : d.er;
    ge = (moe ? er : 0) * d.IE;
    xr = moe && d.ep > 1 ? er * d.C : 0;
    pids = moe && d.ep > 1 ? er : 0;
    ye = slots * d.C;
    probs = moe ? BT * d.E : 0;
    zstats = moe ? int64_t{o.aux_scope == MoeAuxScope::Sequence ? d.B : 1} : 0;
    stats = zstats * d.E;
    gmax = std::max(dense ? gi : 0, moe ? ge : 0);
  }
  // A Deferred's buffers (model.h, deferred_weight_bytes): [BT, C] rows (all rows, gathered under
  // TP), whether h and y are kept there (not kept in the context), the RMSNorm weight gradients.
  int64_t rows, norms;
  bool keep_w_h, keep_w_y;
  int64_t deferred() const { return 4 * rows + 2 * gi + q + 2 * kv + norms + (keep_w_h ? gi : 0) + (keep_w_y ? y : 0); }
};
}  // namespace

int64_t deferred_weight_bytes(const ModelConfig& c, const ModelOptions& o, int B, int T_, size_t E, int blocks, int tp,
                              int cp) {
  const Sizes z(LlamaDims(c, tp, 0, cp).with_batch(B, T_, o.loss_chunk), o, c);
  return int64_t{blocks} * static_cast<int64_t>(E) * z.deferred();
}

int64_t context_bytes(const ModelConfig& c, const ModelOptions& o, int B, int T_, size_t E, int begin, int end, int tp,
                      int cp, int ep, bool worst) {
  if (begin < 0 || begin > end || end > c.num_hidden_layers)
    throw std::invalid_argument("context_bytes: blocks [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") are not a range of a model of " + std::to_string(c.num_hidden_layers) + " blocks");
  const Sizes z(LlamaDims(c, tp, 0, cp, ep).with_batch(B, T_, o.loss_chunk), o, c, !worst);  // EP: as allocated
  const int64_t e = static_cast<int64_t>(E), a = E == 8 ? 8 : 4;  // Backend<T>::S: double for double, else float
  int64_t blocks = 0;  // as ensure_context
  for (int l = begin; l < end; ++l) blocks += z.block(c.is_moe_layer(l), e, a);
  const bool head = end == c.num_hidden_layers, first = begin == 0;
  return blocks + e * 2 * z.x + (head ? e * (z.x + z.rstd) : 0) +
         4 * z.BT * ((first ? 1 : 0) + (first && tp > 1 ? 1 : 0) + (head ? 1 : 0)) + 2 * 4 * z.layout +
         a * 2 * (z.stats + z.zstats);
}

ActivationBytes activation_bytes(const ModelConfig& c, const ModelOptions& o, int B, int T_, size_t E, size_t A,
                                 int tp, int cp, int ep, bool balanced) {
  const Sizes z(LlamaDims(c, tp, 0, cp, ep).with_batch(B, T_, o.loss_chunk), o, c, balanced);
  const int64_t e = static_cast<int64_t>(E), a = static_cast<int64_t>(A);
  const int64_t moe = c.num_moe_layers();
  ActivationBytes r;
  r.per_layer = (c.num_hidden_layers - moe) * z.block(false, e, a) + moe * z.block(true, e, a);
  if (o.recompute == Recompute::Selective) r.recompute = e * (z.gmax + z.att);
  if (o.recompute == Recompute::Full)
    r.recompute = e * z.work_rest() + a * z.work_acc() + 4 * z.work_ids() + e * (z.gmax + z.att);
  r.block_scratch = e * (3 * z.x + 2 * z.q + 2 * z.kv + 3 * z.gmax + z.att + z.qn) + a * z.dsum;  // qn: dqk_
  r.block_scratch += e * (2 * z.ye + z.probs) + a * z.slots;  // MoE: xe_, dye_, rl_, dwts_
  r.block_scratch += e * 3 * z.xr + 4 * 2 * z.pids;            // EP: xr_, xs_, ys_, perm_, inv_
  r.head = e * (2 * z.x + z.rstd + z.chunk_logits + 2 * z.rope) + 2 * 4 * z.BT + 3 * 4 * z.layout +
           a * 2 * (z.stats + z.zstats);
  if (tp > 1) {  // full_, dfull_, ids_tp_, the cross-entropy's scalars
    r.block_scratch += e * 2 * z.full;
    r.head += 4 * z.BT + a * z.ce;
  }
  return r;
}

template <typename T> void LlamaModel<T>::ensure(int B, int T_) {
  if (B == d_.B && T_ == d_.T_) return;
  d_ = d_.with_batch(B, T_, o_.loss_chunk);  // throws when TP does not divide B*T_
  const Sizes z(d_, o_, c_, true);  // EP: expert rows for balanced routing; they grow (grow_expert_scratch)
  auto buf = [&](int64_t n) { return Buffer<T>(be_, static_cast<size_t>(n)); };
  auto acc = [&](int64_t n) { return AccBuffer<T>(be_, static_cast<size_t>(n)); };
  work_ = Layer{};
  auto ids = [&](int64_t n) { return IdBuffer<T>(be_, static_cast<size_t>(n)); };
  if (o_.recompute == Recompute::Full) {
    work_.rstd1 = buf(z.rstd); work_.q = buf(z.q); work_.k = buf(z.kv); work_.v = buf(z.kv); work_.lse = acc(z.lse);
    work_.y = buf(z.y); work_.x1 = buf(z.x); work_.rstd2 = buf(z.rstd); work_.g = buf(z.gmax); work_.u = buf(z.gmax);
    work_.qp = buf(z.qn); work_.kp = buf(z.kn); work_.rq = buf(z.rqn); work_.rk = buf(z.rkn);
    if (z.moe) {
      work_.ye = buf(z.ye); work_.probs = acc(z.probs); work_.wts = acc(z.slots); work_.zlse = acc(z.BT);
      work_.experts = ids(z.slots); work_.rowtok = ids(z.slots); work_.pos = ids(z.slots);
    }
  }
  if (o_.recompute != Recompute::None) { work_.h = buf(z.gmax); work_.att = buf(z.att); }
  chunk_logits_ = buf(z.chunk_logits);
  logits_ = Buffer<T>();
  ln_ = buf(z.x);
  dln_ = buf(z.x);
  dq_ = buf(z.q); dk_ = buf(z.kv); dv_ = buf(z.kv);
  datt_ = buf(z.att); dsum_ = acc(z.dsum); dy_ = buf(z.y);
  dqk_ = buf(z.qn);
  dh_ = buf(z.gmax); dg_ = buf(z.gmax); du_ = buf(z.gmax);
  xe_ = buf(z.ye); dye_ = buf(z.ye); rl_ = buf(z.probs); dwts_ = acc(z.slots);
  xr_ = buf(z.xr); xs_ = buf(z.xr); ys_ = buf(z.xr); perm_ = ids(z.pids); inv_ = ids(z.pids);
  full_ = buf(z.full); dfull_ = buf(z.full);
  const int64_t ch = tp_n_ > 1 ? d_.chunk : 0;
  ce_mx_ = acc(ch); ce_maxes_ = acc(ch * tp_n_); ce_st_ = acc(2 * ch);
  std::vector<S> cs, sn;  // tables computed in double, rounded once to the storage type
  rope_tables(cs, sn, d_.Tg, rope_inv_freqs(c_));
  std::vector<T> cst(cs.size()), snt(sn.size());
  for (size_t i = 0; i < cs.size(); ++i) { cst[i] = math::st<T>(cs[i]); snt[i] = math::st<T>(sn[i]); }
  cos_ = buf(z.rope); sin_ = buf(z.rope);
  be_.from_host(cos_.data(), cst.data(), cst.size());
  be_.from_host(sin_.data(), snt.data(), snt.size());
  rows_ = IdBuffer<T>();
  if (z.layout > 0) ensure_rows();
}

template <typename T> void LlamaModel<T>::ensure_rows() {
  if (rows_.size() == static_cast<size_t>(d_.BT)) return;
  std::vector<int32_t> t(static_cast<size_t>(d_.BT));
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(i % static_cast<size_t>(d_.T_));
  rows_ = IdBuffer<T>(be_, t.size());
  be_.ids_from_host(rows_.data(), t.data(), t.size());
}

// A context's buffers for d_'s micro-batch: per block of its range what the mode keeps (Sizes), the
// range's output and residual gradient; the ids and the final norm's buffers where the range has
// the embedding / the head. For [0, L) exactly what activation_bytes counts besides the scratch.
template <typename T> void LlamaModel<T>::ensure_context(Context& ctx) {
  if (ctx.B_ == d_.B && ctx.T_ == d_.T_) return;
  const Sizes z(d_, o_, c_, true);  // EP: expert rows for balanced routing; grow_expert_rows
  const BlockRange& r = ctx.r_;
  auto buf = [&](int64_t n) { return Buffer<T>(be_, static_cast<size_t>(n)); };
  auto acc = [&](int64_t n) { return AccBuffer<T>(be_, static_cast<size_t>(n)); };
  auto ids = [&](bool need) { return IdBuffer<T>(be_, need ? static_cast<size_t>(z.BT) : 0); };
  ctx.B_ = ctx.T_ = 0;
  ctx.stage_ = Stage::None;
  ctx.layers_.clear();
  ctx.layers_.resize(static_cast<size_t>(r.end - r.begin));
  ctx.w_.clear();  // sized for the old micro-batch: the next backward_input allocates them again
  auto idn = [&](int64_t n) { return IdBuffer<T>(be_, static_cast<size_t>(n)); };
  for (size_t i = 0; i < ctx.layers_.size(); ++i) {
    Layer& L = ctx.layers_[i];
    const bool m = is_moe(r.begin + static_cast<int>(i));
    const int64_t gl = m ? z.ge : z.gi;
    L.x = buf(z.x);
    if (z.keep_all) {  // everything of a block but x, h and the exact probabilities
      L.rstd1 = buf(z.rstd); L.q = buf(z.q); L.k = buf(z.kv); L.v = buf(z.kv); L.lse = acc(z.lse); L.y = buf(z.y);
      L.x1 = buf(z.x); L.rstd2 = buf(z.rstd); L.g = buf(gl); L.u = buf(gl);
      L.qp = buf(z.qn); L.kp = buf(z.kn); L.rq = buf(z.rqn); L.rk = buf(z.rkn);
      if (m) {
        L.ye = buf(z.ye); L.probs = acc(z.probs); L.wts = acc(z.slots); L.zlse = acc(z.BT);
        L.experts = idn(z.slots); L.rowtok = idn(z.slots); L.pos = idn(z.slots);
      }
    }
    if (z.keep_h) L.h = buf(gl);
    if (z.keep_att) L.att = buf(z.att);
  }
  ctx.counts_.assign(static_cast<size_t>(z.stats), 0.0);
  ctx.psum_ = acc(z.stats);
  ctx.aux_dprob_ = acc(z.stats);
  ctx.zsum_ = acc(z.zstats);
  ctx.z_dlse_ = acc(z.zstats);
  const bool head = r.end == d_.L;
  ctx.xf_ = buf(z.x);
  ctx.lnf_ = buf(head ? z.x : 0);
  ctx.rstdf_ = buf(head ? z.rstd : 0);
  ctx.dres_ = buf(z.x);
  ctx.tokens_ = ids(r.begin == 0);
  ctx.targets_ = ids(head);
  ctx.ids_tp_ = ids(r.begin == 0 && tp_n_ > 1);
  ctx.pos_ = ids(z.layout > 0);
  ctx.doc_ = ids(z.layout > 0);
  ctx.use_pos_ = ctx.use_doc_ = false;
  ctx.B_ = d_.B;
  ctx.T_ = d_.T_;
}

template <typename T> void LlamaModel<T>::ensure_deferred(Context& ctx) {
  const size_t n = static_cast<size_t>(ctx.r_.end - ctx.r_.begin);
  if (ctx.w_.size() == n) return;  // ensure_context cleared them when the micro-batch size changed
  const Sizes z(d_, o_, c_);
  auto buf = [&](int64_t k) { return Buffer<T>(be_, static_cast<size_t>(k)); };
  std::vector<Deferred> w(n);
  for (Deferred& k : w) {
    k.dr2 = buf(z.rows); k.dr1 = buf(z.rows); k.n2 = buf(z.rows); k.n1 = buf(z.rows);
    k.dg = buf(z.gi); k.du = buf(z.gi); k.h = buf(z.keep_w_h ? z.gi : 0);
    k.dq = buf(z.q); k.dk = buf(z.kv); k.dv = buf(z.kv); k.y = buf(z.keep_w_y ? z.y : 0);
    k.dnorm = buf(z.norms);
  }
  ctx.w_ = std::move(w);
}

// This file's members of LlamaModel, for each storage type (llama.cpp instantiates the class, and
// with it the members defined there).
#define ST_LLAMA_BUFFERS(T) \
  template void LlamaModel<T>::ensure(int, int); \
  template void LlamaModel<T>::ensure_rows(); \
  template void LlamaModel<T>::ensure_context(Context&); \
  template void LlamaModel<T>::ensure_deferred(Context&);
ST_LLAMA_BUFFERS(float)
ST_LLAMA_BUFFERS(double)
ST_LLAMA_BUFFERS(bf16)
#undef ST_LLAMA_BUFFERS

}  // namespace shardtrain
