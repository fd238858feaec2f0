// Llama (model.h): the model's structure and the drivers of its forward and backward over FSDP
// units. The parts they call live beside this file: llama_block.cpp (a transformer block: its
// forward, backward and deferred weight gradients, the projections), llama_attention.cpp (RoPE,
// the attention kernels' calls, the token layout), llama_head.cpp (the final norm's output through
// the LM head and the loss), llama_buffers.cpp (the activation buffers and the byte counts of the
// memory plan). Read each *_backward right after its forward.
// Activation gradients are written (=) except on the residual stream `dres_`, which every block
// accumulates into (+=), as in llm.c.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/backend/moe_math.h"
#include "shardtrain/model/model.h"

namespace shardtrain {

std::string check_tensor_parallel(const ModelConfig& c, int tp) {
  if (tp < 1) return "option '--tp' must be >= 1, got " + std::to_string(tp);
  if (tp > 1 && c.is_moe())
    return "option '--tp' (" + std::to_string(tp) + ") with a mixture-of-experts model (" + c.architecture +
           ") is not built yet: its experts are not split over a TP group (issue 56)";
  for (auto [n, what] : {std::pair{c.num_attention_heads, "attention heads"},
                         std::pair{c.num_key_value_heads, "key/value heads"},
                         std::pair{c.intermediate_size, "intermediate size"}})
    if (n % tp != 0)
      return "option '--tp' (" + std::to_string(tp) + ") does not divide the model's " + what + " (" +
             std::to_string(n) + "): tensor parallelism splits them evenly over the TP group";
  return "";
}

int llama_num_units(const ModelConfig& c, int ep) {
  return c.num_hidden_layers + 2 + (ep > 1 && c.is_moe() ? static_cast<int>(c.num_moe_layers()) : 0);
}

int llama_expert_unit(const ModelConfig& c, int l) {
  int m = 0;
  for (int i = 0; i < l; ++i) m += c.is_moe_layer(i) ? 1 : 0;
  return c.num_hidden_layers + 2 + m;
}

std::vector<UnitSpec> llama_units(const ModelConfig& c, int tp, int tp_rank, int ep, int ep_rank) {
  if (const std::string why = check_tensor_parallel(c, tp); !why.empty()) throw std::invalid_argument(why);
  if (tp_rank < 0 || tp_rank >= tp) throw std::invalid_argument("llama_units: TP rank out of range");
  if (ep < 1 || ep_rank < 0 || ep_rank >= ep || (ep > 1 && (!c.is_moe() || c.num_experts % ep != 0)))
    throw std::invalid_argument("llama_units: ep " + std::to_string(ep) + " (rank " + std::to_string(ep_rank) +
                                ") does not split the model's experts (" + std::to_string(c.num_experts) + ")");
  const int64_t C = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const int64_t Q = static_cast<int64_t>(c.num_attention_heads) * c.head_dim(), KV = c.kv_dim();
  const int64_t Vl = (V + tp - 1) / tp;
  const double sd = c.initializer_range;
  // A [rows, cols] weight: whole (tp 1), its rows [t*rows/tp, ...) (column-parallel: `split_rows`,
  // `local` rows) or its columns (row-parallel).
  auto mat = [&](std::string n, int64_t r, int64_t k) { return ParamSpec{std::move(n), {r, k}, true, Init::Normal, sd}; };
  auto rows = [&](std::string n, int64_t r, int64_t k, int64_t local) {
    ParamSpec p = mat(std::move(n), local, k);
    if (tp > 1) p.tp = TpSlice{TpSplit::Rows, tp, r, k, tp_rank * local};
    return p;
  };
  auto cols = [&](std::string n, int64_t r, int64_t k) {
    ParamSpec p = mat(std::move(n), r, k / tp);
    if (tp > 1) p.tp = TpSlice{TpSplit::Cols, tp, r, k, tp_rank * (k / tp)};
    return p;
  };
  auto norm = [&](std::string n, int64_t width) {
    ParamSpec p{std::move(n), {width}, false, Init::Ones, 0.0};
    if (tp > 1) p.tp = TpSlice{TpSplit::Replicated, tp, width, 1, 0};
    return p;
  };
  const int64_t HD = c.head_dim();
  std::vector<UnitSpec> units;
  units.push_back({"model.embed_tokens", {rows("model.embed_tokens.weight", V, C, Vl)}});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    UnitSpec u{"model.layers." + std::to_string(l),
               {norm(p + "input_layernorm.weight", C), rows(p + "self_attn.q_proj.weight", Q, C, Q / tp),
                rows(p + "self_attn.k_proj.weight", KV, C, KV / tp), rows(p + "self_attn.v_proj.weight", KV, C, KV / tp),
                cols(p + "self_attn.o_proj.weight", C, Q)}};
    if (c.qk_norm) {
      u.params.push_back(norm(p + "self_attn.q_norm.weight", HD));
      u.params.push_back(norm(p + "self_attn.k_norm.weight", HD));
    }
    u.params.push_back(norm(p + "post_attention_layernorm.weight", C));
    if (c.is_moe_layer(l)) {  // tp == 1 (check_tensor_parallel)
      const int64_t E = c.num_experts, IE = c.moe_intermediate_size;
      u.params.push_back(mat(p + "mlp.gate.weight", E, C));
      if (ep == 1)
        u.params.insert(u.params.end(), {ParamSpec{p + "mlp.experts.gate_up_proj", {E, 2 * IE, C}, true, Init::Normal, sd},
                                         ParamSpec{p + "mlp.experts.down_proj", {E, C, IE}, true, Init::Normal, sd}});
    } else {
      u.params.insert(u.params.end(), {rows(p + "mlp.gate_proj.weight", I, C, I / tp),
                                       rows(p + "mlp.up_proj.weight", I, C, I / tp), cols(p + "mlp.down_proj.weight", C, I)});
    }
    units.push_back(std::move(u));
  }
  UnitSpec head{"model.norm", {norm("model.norm.weight", C)}};
  if (!c.tie_word_embeddings) head.params.push_back(rows("lm_head.weight", V, C, Vl));
  units.push_back(head);
  if (ep > 1) {  // each MoE block's experts: EP rank ep_rank's E / ep of them, in the expert shard group
    const int64_t E = c.num_experts, IE = c.moe_intermediate_size, El = E / ep;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (!c.is_moe_layer(l)) continue;
      const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts";
      ParamSpec gu{p + ".gate_up_proj", {El, 2 * IE, C}, true, Init::Normal, sd};
      gu.tp = TpSlice{TpSplit::Rows, ep, E, 2 * IE * C, ep_rank * El};
      ParamSpec dn{p + ".down_proj", {El, C, IE}, true, Init::Normal, sd};
      dn.tp = TpSlice{TpSplit::Rows, ep, E, C * IE, ep_rank * El};
      units.push_back(UnitSpec{p, {gu, dn}, 1});
    }
  }
  return units;
}

// ---- options ----------------------------------------------------------------------------------
Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::None;
  if (s == "selective") return Recompute::Selective;
  if (s == "full") return Recompute::Full;
  throw std::invalid_argument("option '--activation-checkpointing' must be none, selective or full, got '" + s + "'");
}
AttentionKind parse_attention(const std::string& s) {
  if (s == "tiled") return AttentionKind::Tiled;
  if (s == "exact") return AttentionKind::Exact;
  throw std::invalid_argument("option '--attention' must be tiled or exact, got '" + s + "'");
}
const char* recompute_name(Recompute r) {
  return r == Recompute::None ? "none" : r == Recompute::Selective ? "selective" : "full";
}
AttentionMask parse_attention_mask(const std::string& s) {
  if (s == "causal") return AttentionMask::Causal;
  if (s == "document") return AttentionMask::Document;
  throw std::invalid_argument("option '--attention-mask' must be causal or document, got '" + s + "'");
}
MoeAuxScope parse_aux_scope(const std::string& s) {
  if (s == "sequence") return MoeAuxScope::Sequence;
  if (s == "micro-batch") return MoeAuxScope::MicroBatch;
  throw std::invalid_argument("option '--aux-loss-scope' must be sequence or micro-batch, got '" + s + "'");
}
const char* aux_scope_name(MoeAuxScope s) { return s == MoeAuxScope::Sequence ? "sequence" : "micro-batch"; }
const char* attention_name(AttentionKind a) { return a == AttentionKind::Tiled ? "tiled" : "exact"; }
const char* attention_mask_name(AttentionMask m) { return m == AttentionMask::Document ? "document" : "causal"; }
int default_loss_chunk(int V) { return std::max(256, static_cast<int>((int64_t{1} << 24) / std::max(1, V))); }

LlamaDims::LlamaDims(const ModelConfig& c, int tp_, int tp_rank, int cp_, int ep_)
    : C(c.hidden_size), I(c.intermediate_size / tp_), V(c.vocab_size), L(c.num_hidden_layers),
      NH(c.num_attention_heads / tp_), NKV(c.num_key_value_heads / tp_), HD(c.head_dim()), Q(NH * HD), KV(NKV * HD),
      tp(tp_), cp(cp_), Vl((c.vocab_size + tp_ - 1) / tp_), v0(tp_rank * Vl),
      valid(std::clamp(c.vocab_size - tp_rank * Vl, 0, Vl)) {
  if (c.is_moe()) {
    E = c.num_experts;
    K = c.num_experts_per_tok;
    IE = c.moe_intermediate_size;
    renorm = c.norm_topk_prob;
    if (ep_ < 1 || E % ep_ != 0)
      throw std::invalid_argument("option '--ep' (" + std::to_string(ep_) + ") does not divide num_experts (" +
                                  std::to_string(E) + ")");
    ep = ep_;
    El = E / ep_;
  } else if (ep_ != 1) {
    throw std::invalid_argument("option '--ep' (" + std::to_string(ep_) +
                                ") needs a mixture-of-experts model; this config is dense");
  }
}

LlamaDims LlamaDims::with_batch(int B_, int T, int loss_chunk) const {
  LlamaDims d = *this;
  d.B = B_;
  d.T_ = T;
  d.Tg = cp * T;
  d.BT = B_ * T;
  if (d.BT % tp != 0)
    throw std::invalid_argument("option '--tp' (" + std::to_string(tp) + ") does not divide the tokens of a micro-batch (" +
                                std::to_string(B_) + " x " + std::to_string(T) + " = " + std::to_string(d.BT) +
                                "): sequence parallelism splits them evenly over the TP group");
  d.R = d.BT / tp;
  if (int64_t{d.BT} * d.K > INT32_MAX)
    throw std::invalid_argument("a micro-batch of " + std::to_string(B_) + " x " + std::to_string(T) + " tokens routes " +
                                std::to_string(int64_t{d.BT} * d.K) + " slots (x num_experts_per_tok " +
                                std::to_string(d.K) + "), more than 2^31: lower '--micro-batch' or '--seq-len'");
  d.slots = d.BT * d.K;
  if (int64_t{d.slots} * d.ep > INT32_MAX)
    throw std::invalid_argument("a micro-batch of " + std::to_string(B_) + " x " + std::to_string(T) + " tokens routes " +
                                std::to_string(d.slots) + " slots, and with '--ep " + std::to_string(d.ep) +
                                "' a rank's experts may get " + std::to_string(int64_t{d.slots} * d.ep) +
                                " rows, more than 2^31: lower '--micro-batch' or '--seq-len'");
  d.er = d.slots * d.ep;
  d.chunk = static_cast<int>(std::min<int64_t>(loss_chunk > 0 ? loss_chunk : default_loss_chunk(Vl), int64_t{B_} * T));
  return d;
}

// ---- model ------------------------------------------------------------------------------------
template <typename T>
LlamaModel<T>::LlamaModel(const ModelConfig& c, Backend<T>& be, const ModelOptions& o, TensorParallelOps<T>* tp,
                          ContextParallelOps<T>* cp, ExpertParallelOps<T>* ep)
    : c_(c), o_(o), be_(be), tp_(tp && tp->size() > 1 ? tp : nullptr), cp_(cp && cp->size() > 1 ? cp : nullptr),
      ep_(ep && ep->size() > 1 ? ep : nullptr), tp_n_(tp_ ? tp_->size() : 1), tp_rank_(tp_ ? tp_->rank() : 0),
      d_(c, tp_n_, tp_rank_, cp_ ? cp_->size() : 1, ep_ ? ep_->size() : 1) {
  if (o_.fp8 && c.is_moe())
    throw std::invalid_argument("'--precision fp8' does not support mixture-of-experts models (" + c.name +
                                "): the experts and the router are not quantized; use '--precision bf16'");
  if (cp_ && o_.attention == AttentionKind::Exact)
    throw std::invalid_argument("context parallelism (--cp " + std::to_string(cp_->size()) +
                                ") runs tiled attention only, not '--attention exact'");
  // Offsets do not depend on the world size; with TP, the slices' (llama_units checks tp).
  const int ep_n = ep_ ? ep_->size() : 1;
  own_experts_ = ep_n > 1;
  ShardPlan p = ShardPlan::build(llama_units(c, tp_n_, tp_rank_, ep_n, ep_ ? ep_->rank() : 0), 1, 1);
  // A dense block's offsets, and an MoE block's (the same attention part): from the first of each.
  auto offsets_of = [&](int l, bool moe) {
    const UnitPlan& blk = p.units[static_cast<size_t>(1 + l)];
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    auto of = [&](const char* n) { return blk.param(pre + n).offset; };
    Offsets r{of("input_layernorm.weight"), of("self_attn.q_proj.weight"), of("self_attn.k_proj.weight"),
              of("self_attn.v_proj.weight"), of("self_attn.o_proj.weight"), of("post_attention_layernorm.weight"),
              moe ? -1 : of("mlp.gate_proj.weight"), moe ? -1 : of("mlp.up_proj.weight"),
              moe ? -1 : of("mlp.down_proj.weight")};
    if (c.qk_norm) {
      r.qn = of("self_attn.q_norm.weight");
      r.kn = of("self_attn.k_norm.weight");
    }
    if (moe) {
      r.router = of("mlp.gate.weight");
      const UnitPlan& ex = own_experts_ ? p.units[static_cast<size_t>(llama_expert_unit(c, l))] : blk;
      r.egu = ex.param(pre + "mlp.experts.gate_up_proj").offset;
      r.edown = ex.param(pre + "mlp.experts.down_proj").offset;
    }
    return r;
  };
  if (c.is_moe()) {
    moe_layer_.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int l = 0; l < c.num_hidden_layers; ++l) moe_layer_[static_cast<size_t>(l)] = c.is_moe_layer(l) ? 1 : 0;
    if (own_experts_)
      for (int l = 0; l < c.num_hidden_layers; ++l) expert_unit_.push_back(is_moe(l) ? llama_expert_unit(c, l) : -1);
    for (int l = c.num_hidden_layers - 1; l >= 0; --l) {
      if (is_moe(l)) { moe_off_ = offsets_of(l, true); ++moe_blocks_; }
      else dense_off_ = offsets_of(l, false);
    }
  } else {
    dense_off_ = offsets_of(0, false);
  }
  const UnitPlan& head = p.units[static_cast<size_t>(c.num_hidden_layers) + 1];  // (expert units follow it)
  head_off_norm_ = head.param("model.norm.weight").offset;
  head_off_w_ = c.tie_word_embeddings ? 0 : head.param("lm_head.weight").offset;
  if (o_.loss_chunk < 0) throw std::invalid_argument("option '--loss-chunk' must be >= 0");
  eps_ = static_cast<S>(c.rms_norm_eps);
  attn_scale_ = S(1) / std::sqrt(static_cast<S>(d_.HD));
  ctx_ = Context(BlockRange{0, c.num_hidden_layers, {}});
}

int BlockRange::unit(int u) const {
  if (units.empty()) return u;
  const int i = units.at(static_cast<size_t>(u));
  if (i < 0) throw std::logic_error("BlockRange: model unit " + std::to_string(u) + " is not held by this range's units");
  return i;
}

std::vector<UnitSpec> llama_stage_units(const ModelConfig& c, int begin, int end, int tp, int tp_rank, int ep,
                                        int ep_rank) {
  const BlockRange r = llama_stage_range(c, begin, end, ep);
  std::vector<UnitSpec> all = llama_units(c, tp, tp_rank, ep, ep_rank), out;
  for (size_t u = 0; u < all.size(); ++u)
    if (r.units[u] >= 0) out.push_back(std::move(all[u]));
  return out;
}

BlockRange llama_stage_range(const ModelConfig& c, int begin, int end, int ep) {
  const int L = c.num_hidden_layers;
  if (begin < 0 || begin > end || end > L)
    throw std::invalid_argument("block range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") is not inside [0, " + std::to_string(L) + ")");
  BlockRange r{begin, end, std::vector<int>(static_cast<size_t>(llama_num_units(c, ep)), -1)};
  int n = 0;
  if (begin == 0 || (end == L && c.tie_word_embeddings)) r.units[0] = n++;
  for (int l = begin; l < end; ++l) r.units[static_cast<size_t>(1 + l)] = n++;
  if (end == L) r.units[static_cast<size_t>(L) + 1] = n++;
  if (r.units.size() > static_cast<size_t>(L) + 2)  // the range's blocks' expert units (ep > 1)
    for (int l = begin; l < end; ++l)
      if (c.is_moe_layer(l)) r.units[static_cast<size_t>(llama_expert_unit(c, l))] = n++;
  return r;
}

template <typename T> void LlamaModel<T>::check_range(const BlockRange& r) const {
  if (r.begin < 0 || r.begin > r.end || r.end > c_.num_hidden_layers)
    throw std::invalid_argument("LlamaModel: block range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                ") is not inside [0, " + std::to_string(c_.num_hidden_layers) + ")");
  const int n = llama_num_units(c_, ep_ ? ep_->size() : 1);
  if (!r.units.empty() && r.units.size() != static_cast<size_t>(n))
    throw std::invalid_argument("LlamaModel: a unit map has one entry per model unit (" + std::to_string(n) + "), got " +
                                std::to_string(r.units.size()));
}

template <typename T>
void LlamaModel<T>::forward(UnitSource<T>& f, Context& ctx, const int32_t* tokens, const T* input, int B, int T_,
                            const TokenLayout& layout) {
  check_range(ctx.r_);
  if (ctx.stage_ == Stage::WeightPending)  // its forward would overwrite what backward_weight reads
    throw std::logic_error("LlamaModel::forward: the context's backward_weight() is pending (backward_input() ran)");
  const int a = ctx.r_.begin, b = ctx.r_.end;
  if (int64_t{T_} * d_.cp > c_.max_position_embeddings)
    throw std::invalid_argument("sequence length " + std::to_string(int64_t{T_} * d_.cp) +
                                (d_.cp > 1 ? " (" + std::to_string(T_) + " rows x CP " + std::to_string(d_.cp) + ")" : "") +
                                " exceeds max_position_embeddings " + std::to_string(c_.max_position_embeddings));
  if (a == 0 && !tokens) throw std::invalid_argument("LlamaModel::forward: a range from block 0 needs the tokens");
  if (a > 0 && !input) throw std::invalid_argument("LlamaModel::forward: a range from block > 0 needs its input");
  if (a == 0) check_ids(tokens, int64_t{B} * T_);
  check_layout(layout, B, T_);
  ctx.stage_ = Stage::None;
  ensure(B, T_);
  ensure_context(ctx);
  set_layout(ctx, layout);
  const LlamaDims& d = d_;
  if (moe_blocks_ > 0) {  // this micro-batch's load-balancing statistics start from zero
    std::fill(ctx.counts_.begin(), ctx.counts_.end(), 0.0);
    be_.zero_acc(ctx.psum_.data(), ctx.psum_.size());
    be_.zero_acc(ctx.zsum_.data(), ctx.zsum_.size());
    ctx.aux_scale_ = ctx.z_scale_ = S(0);
    if (!ctx.aux_seed_.empty()) {  // a later pipeline stage: blocks [0, a)'s sums (seed_aux_stats)
      const size_t n = ctx.counts_.size(), nz = ctx.zsum_.size();
      if (ctx.aux_seed_.size() != 2 * n + nz)
        throw std::invalid_argument("LlamaModel::forward: seed_aux_stats gave " + std::to_string(ctx.aux_seed_.size()) +
                                    " values for a micro-batch of " + std::to_string(2 * n + nz));
      std::copy(ctx.aux_seed_.begin(), ctx.aux_seed_.begin() + static_cast<ptrdiff_t>(n), ctx.counts_.begin());
      std::vector<S> ps(n + nz);
      for (size_t i = 0; i < n + nz; ++i) ps[i] = static_cast<S>(ctx.aux_seed_[n + i]);
      be_.acc_from_host(ctx.psum_.data(), ps.data(), n);
      be_.acc_from_host(ctx.zsum_.data(), ps.data() + n, nz);
      ctx.aux_seed_.clear();
    }
    // Padding (layout.real) stays out of them: its rows and, per scope group, the real rows.
    const size_t n = static_cast<size_t>(d_.BT), grp = o_.aux_scope == MoeAuxScope::Sequence ? d_.T_ : n;
    bool padded = false;
    for (size_t i = 0; layout.real && i < n && !padded; ++i) padded = layout.real[i] == 0;
    if (padded) {
      ctx.real_.assign(layout.real, layout.real + n);
      ctx.real_n_.assign(n / grp, 0.0);
      for (size_t i = 0; i < n; ++i) ctx.real_n_[i / grp] += ctx.real_[i] != 0 ? 1.0 : 0.0;
    } else {
      ctx.real_.clear();
      ctx.real_n_.clear();
    }
  }
  T* x0 = b > a ? ctx.layers_[0].x.data() : ctx.xf_.data();
  if (a == 0)
    embed(f, ctx, tokens, x0);
  else
    be_.copy(x0, input, static_cast<size_t>(d.R) * d.C);

  for (int l = a; l < b; ++l) {
    const T* w = gather(f, ctx.r_.unit(1 + l));
    Layer& kept = ctx.layers_[static_cast<size_t>(l - a)];
    Layer& act = o_.recompute == Recompute::Full ? work_ : kept;
    T* h = o_.recompute == Recompute::None ? act.h.data() : work_.h.data();
    T* att = o_.recompute == Recompute::None ? act.att.data() : work_.att.data();
    block_forward(f, ctx, l, w, kept.x.data(), act, h, att,
                  l + 1 < b ? ctx.layers_[static_cast<size_t>(l + 1 - a)].x.data() : ctx.xf_.data());
    if (is_moe(l)) {  // the load-balancing loss's counts and probability sums of this block's tokens
      const int grp = o_.aux_scope == MoeAuxScope::Sequence ? d.T_ : d.BT;
      if (ctx.real_.empty()) {
        be_.moe_prob_sums(ctx.psum_.data(), act.probs.data(), grp, d.BT, d.E);
        be_.moe_z_sums(ctx.zsum_.data(), act.zlse.data(), grp, d.BT);
      } else {  // the real rows' runs only, each into its group's sums (in row order, as above)
        real_runs(ctx, [&](int t0, int t1, int g, bool real) {
          if (!real) return;
          be_.moe_prob_sums(ctx.psum_.data() + static_cast<size_t>(g) * d.E, act.probs.data() + static_cast<size_t>(t0) * d.E,
                            t1 - t0, t1 - t0, d.E);
          be_.moe_z_sums(ctx.zsum_.data() + g, act.zlse.data() + t0, t1 - t0, t1 - t0);
        });
      }
      kept.routed.assign(static_cast<size_t>(d.E), 0);  // expert_counts: the real tokens' slots
      for (size_t i = 0; i < ex_host_.size(); ++i)
        if (ctx.real_.empty() || ctx.real_[i / static_cast<size_t>(d.K)] != 0) {
          ctx.counts_[(i / static_cast<size_t>(d.K)) / static_cast<size_t>(grp) * d.E + ex_host_[i]] += 1;
          ++kept.routed[static_cast<size_t>(ex_host_[i])];
        }
    }
  }

  if (moe_blocks_ > 0 && cp_ && b == d.L) {  // a sequence's statistics (every block's): the CP group's rows
    const size_t n = ctx.counts_.size(), nz = ctx.zsum_.size();
    std::vector<S> ps(n), zs(nz);
    be_.acc_to_host(ps.data(), ctx.psum_.data(), n);
    be_.acc_to_host(zs.data(), ctx.zsum_.data(), nz);
    std::vector<double> both(ctx.counts_);
    both.insert(both.end(), ps.begin(), ps.end());
    // And each group's padding rows (0 on a rank without padding), so that every rank of the group
    // makes the same call whatever its rows hold.
    const size_t groups = n / static_cast<size_t>(d.E);
    const double rows = o_.aux_scope == MoeAuxScope::Sequence ? double{1} * d.T_ : double{1} * d.BT;
    for (size_t g = 0; g < groups; ++g) both.push_back(ctx.real_n_.empty() ? 0.0 : rows - ctx.real_n_[g]);
    both.insert(both.end(), zs.begin(), zs.end());  // the z-loss's sums, after the padding rows
    cp_->sum_host(both.data(), both.size());
    std::copy(both.begin(), both.begin() + static_cast<ptrdiff_t>(n), ctx.counts_.begin());
    for (size_t i = 0; i < n; ++i) ps[i] = static_cast<S>(both[n + i]);
    for (size_t i = 0; i < nz; ++i) zs[i] = static_cast<S>(both[2 * n + groups + i]);
    be_.acc_from_host(ctx.psum_.data(), ps.data(), n);
    be_.acc_from_host(ctx.zsum_.data(), zs.data(), nz);
    bool any_pad = false;
    for (size_t g = 0; g < groups; ++g) any_pad = any_pad || both[2 * n + g] != 0.0;
    if (any_pad) {  // R per group: the group's rows over the CP ranks less their padding
      ctx.real_n_.assign(groups, 0.0);
      for (size_t g = 0; g < groups; ++g) ctx.real_n_[g] = rows * d.cp - both[2 * n + g];
    }
  }
  if (b == d.L) {
    ctx.head_w_ = gather(f, ctx.r_.unit(d.L + 1));
    ctx.head_gathers_ = gathers_;
    be_.rmsnorm_forward(ctx.lnf_.data(), ctx.rstdf_.data(), ctx.xf_.data(), ctx.head_w_ + head_off_norm_, d.R, d.C,
                        eps_);
  }
  ctx.stage_ = Stage::Forward;
}

// Embedding: x = wte[tokens]. Vocabulary-parallel: each rank looks up the tokens of its rows (zero
// rows for the others'); the reduce-scatter sums them and leaves this rank its rows of x.
template <typename T> void LlamaModel<T>::embed(UnitSource<T>& f, Context& ctx, const int32_t* tokens, T* x0) {
  const LlamaDims& d = d_;
  be_.ids_from_host(ctx.tokens_.data(), tokens, static_cast<size_t>(d.BT));
  const T* emb = gather(f, ctx.r_.unit(0));
  if (tp_n_ == 1) {
    be_.embedding_forward(x0, ctx.tokens_.data(), emb, d.BT, d.C);
  } else {
    ids_host_.resize(static_cast<size_t>(d.BT));
    for (int i = 0; i < d.BT; ++i)
      ids_host_[static_cast<size_t>(i)] = tokens[i] >= d.v0 && tokens[i] < d.v0 + d.valid ? tokens[i] - d.v0 : -1;
    be_.ids_from_host(ctx.ids_tp_.data(), ids_host_.data(), ids_host_.size());
    be_.embedding_forward(full_.data(), ctx.ids_tp_.data(), emb, d.BT, d.C);
    tp_->reduce_scatter_sum(full_.data(), x0, static_cast<size_t>(d.R) * d.C);
  }
}

template <typename T> void LlamaModel<T>::check_ids(const int32_t* ids, int64_t n, bool targets) const {
  const int32_t lo = targets ? kNoTarget : 0;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < lo || ids[i] >= c_.vocab_size)
      throw std::invalid_argument("token id out of range [0, " + std::to_string(c_.vocab_size) + ") at position " +
                                  std::to_string(i));
}

template <typename T> void LlamaModel<T>::expect_stage(const Context& ctx, Stage s, const char* call) const {
  if (ctx.stage_ == Stage::WeightPending && s != Stage::WeightPending)
    throw std::logic_error(std::string("LlamaModel::") + call +
                           ": this micro-batch's backward_weight() is pending (backward_input() ran)");
  if (ctx.stage_ != s)
    throw std::logic_error(std::string("LlamaModel::") + call +
                           (s == Stage::Forward          ? " must follow forward()"
                            : s == Stage::HeadBackward   ? " must follow head_backward()"
                            : s == Stage::WeightPending  ? " must follow backward_input()"
                                                         : " is out of order"));
  if (ctx.B_ != d_.B || ctx.T_ != d_.T_)
    throw std::logic_error(std::string("LlamaModel::") + call +
                           ": a forward() of another micro-batch size came in between (the scratch is sized for it)");
}

template <typename T> void LlamaModel<T>::start_backward(Context& ctx, const T* output_grad, const char* call) {
  const LlamaDims& d = d_;
  if (ctx.r_.end == c_.num_hidden_layers) {
    expect_stage(ctx, Stage::HeadBackward, call);  // head_backward() left d(final block output) in dres_
  } else {
    expect_stage(ctx, Stage::Forward, call);
    if (!output_grad)
      throw std::invalid_argument(std::string("LlamaModel::") + call + ": a range before the head needs output_grad");
    be_.copy(ctx.dres_.data(), output_grad, static_cast<size_t>(d.R) * d.C);
  }
  ctx.stage_ = Stage::None;
}

template <typename T> void LlamaModel<T>::backward(UnitSource<T>& f, Context& ctx, const T* output_grad) {
  start_backward(ctx, output_grad, "backward");
  const BlockRange& r = ctx.r_;
  for (int l = r.end - 1; l >= r.begin; --l) {
    const T* w = gather(f, r.unit(1 + l));
    block_backward(f, ctx, l, w, nullptr);
    f.reduce_scatter_grad(r.unit(1 + l));
  }
  if (r.begin == 0) embedding_backward(f, ctx);  // else ctx.dres_ is d(loss)/d(the range's input)
}

template <typename T> void LlamaModel<T>::backward_input(UnitSource<T>& f, Context& ctx, const T* output_grad) {
  if (moe_blocks_ > 0)
    throw std::logic_error("LlamaModel::backward_input: the split backward (zero-bubble schedules) of a "
                           "mixture-of-experts model is not built yet (issue 56)");
  start_backward(ctx, output_grad, "backward_input");
  ensure_deferred(ctx);
  const BlockRange& r = ctx.r_;
  for (int l = r.end - 1; l >= r.begin; --l) {
    const T* w = gather(f, r.unit(1 + l));
    block_backward(f, ctx, l, w, &ctx.w_[static_cast<size_t>(l - r.begin)]);
  }
  ctx.stage_ = Stage::WeightPending;  // ctx.dres_ is d(loss)/d(the range's input); the embedding's input
}

template <typename T> void LlamaModel<T>::backward_weight(UnitSource<T>& f, Context& ctx) {
  expect_stage(ctx, Stage::WeightPending, "backward_weight");
  ctx.stage_ = Stage::None;
  const BlockRange& r = ctx.r_;
  for (int l = r.end - 1; l >= r.begin; --l) {
    block_weight(ctx, l, f.full_grad(r.unit(1 + l)));
    f.reduce_scatter_grad(r.unit(1 + l));
  }
  if (r.begin == 0) embedding_backward(f, ctx);
}

// Embedding: dwte[tokens] += dres (TP: all rows, this rank's vocabulary rows).
template <typename T> void LlamaModel<T>::embedding_backward(UnitSource<T>& f, Context& ctx) {
  const LlamaDims& d = d_;
  const BlockRange& r = ctx.r_;
  T* ge = f.full_grad(r.unit(0));
  if (tp_n_ == 1)
    be_.embedding_backward(ge, ctx.tokens_.data(), ctx.dres_.data(), d.BT, d.C);
  else
    be_.embedding_backward(ge, ctx.ids_tp_.data(), gather_rows(ctx.dres_.data(), dfull_), d.BT, d.C);
  f.reduce_scatter_grad(r.unit(0));
}

// ---- mixture of experts: the load-balancing loss (moe_math.h moe_aux_loss) -----------------------
namespace {
template <typename T> void expect_whole_range(const BlockRange& r, int L, const char* call) {
  if (r.end != L)
    throw std::logic_error(std::string("LlamaModel::") + call + ": the load-balancing loss pools every MoE block; " +
                           "a context over blocks [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                           ") of " + std::to_string(L) + " is not the last range (aux_stats, seed_aux_stats)");
}
}  // namespace

template <typename T> size_t LlamaModel<T>::aux_stats_size(int B) const {
  if (moe_blocks_ == 0) return 0;
  const size_t G = static_cast<size_t>(o_.aux_scope == MoeAuxScope::Sequence ? B : 1);
  return G * (2 * static_cast<size_t>(d_.E) + 1);
}

template <typename T> size_t LlamaModel<T>::aux_grad_size(int B) const {
  if (moe_blocks_ == 0) return 0;
  const size_t G = static_cast<size_t>(o_.aux_scope == MoeAuxScope::Sequence ? B : 1);
  return G * (static_cast<size_t>(d_.E) + 1) + 2;
}

template <typename T> std::vector<double> LlamaModel<T>::aux_stats(const Context& ctx) const {
  if (moe_blocks_ == 0) return {};
  const size_t n = ctx.counts_.size(), nz = ctx.zsum_.size();
  std::vector<double> out(ctx.counts_);
  std::vector<S> ps(n + nz);
  be_.acc_to_host(ps.data(), ctx.psum_.data(), n);
  be_.acc_to_host(ps.data() + n, ctx.zsum_.data(), nz);
  for (size_t i = 0; i < n + nz; ++i) out.push_back(static_cast<double>(ps[i]));
  return out;
}

template <typename T> void LlamaModel<T>::seed_aux_stats(Context& ctx, std::vector<double> in) const {
  if (moe_blocks_ == 0) return;
  ctx.aux_seed_ = std::move(in);  // checked against the micro-batch's size by forward()
}

template <typename T> std::vector<double> LlamaModel<T>::aux_grad(const Context& ctx) const {
  if (moe_blocks_ == 0) return {};  // set by set_aux_grad_scale (the last range) or set_aux_grad (passed on)
  const size_t n = ctx.counts_.size(), nz = ctx.zsum_.size();
  std::vector<S> g(n + nz);
  be_.acc_to_host(g.data(), ctx.aux_dprob_.data(), n);
  be_.acc_to_host(g.data() + n, ctx.z_dlse_.data(), nz);
  std::vector<double> out(g.begin(), g.end());
  out.push_back(static_cast<double>(ctx.aux_scale_));
  out.push_back(static_cast<double>(ctx.z_scale_));
  return out;
}

template <typename T> void LlamaModel<T>::set_aux_grad(Context& ctx, const std::vector<double>& in) {
  if (moe_blocks_ == 0) return;
  const size_t n = ctx.counts_.size(), nz = ctx.zsum_.size();
  if (in.size() != n + nz + 2)
    throw std::invalid_argument("LlamaModel::set_aux_grad: " + std::to_string(in.size()) + " values for a micro-batch of " +
                                std::to_string(n + nz + 2));
  std::vector<S> g(n + nz);
  for (size_t i = 0; i < n + nz; ++i) g[i] = static_cast<S>(in[i]);
  be_.acc_from_host(ctx.aux_dprob_.data(), g.data(), n);
  be_.acc_from_host(ctx.z_dlse_.data(), g.data() + n, nz);
  ctx.aux_scale_ = static_cast<S>(in[n + nz]);
  ctx.z_scale_ = static_cast<S>(in[n + nz + 1]);
}

template <typename T> double LlamaModel<T>::moe_aux_loss(const Context& ctx) const {
  if (moe_blocks_ == 0) return 0.0;
  expect_whole_range<T>(ctx.r_, c_.num_hidden_layers, "moe_aux_loss");
  const int E = d_.E, G = static_cast<int>(ctx.counts_.size()) / std::max(1, E);
  std::vector<S> ps(ctx.psum_.size());
  be_.acc_to_host(ps.data(), ctx.psum_.data(), ps.size());
  double sum = 0;
  for (int g = 0; g < G; ++g) {
    const double n = aux_rows(ctx, static_cast<size_t>(g));
    if (n == 0) continue;  // a group of padding only: no loss
    std::vector<double> p(ps.begin() + static_cast<ptrdiff_t>(g) * E, ps.begin() + static_cast<ptrdiff_t>(g + 1) * E);
    sum += math::moe_aux_loss(ctx.counts_.data() + static_cast<size_t>(g) * E, p.data(), E, n);
  }
  return sum;
}

template <typename T> void LlamaModel<T>::set_aux_grad_scale(Context& ctx, S scale, S z_scale) {
  if (moe_blocks_ == 0) return;
  expect_whole_range<T>(ctx.r_, c_.num_hidden_layers, "set_aux_grad_scale");
  ctx.aux_scale_ = scale;
  ctx.z_scale_ = z_scale;
  std::vector<S> g(ctx.counts_.size());
  for (size_t i = 0; i < g.size(); ++i) {
    const double n = aux_rows(ctx, i / static_cast<size_t>(d_.E));
    g[i] = n == 0 ? S(0) : static_cast<S>(static_cast<double>(scale) * math::moe_aux_dprob(ctx.counts_[i], d_.E, n));
  }
  be_.acc_from_host(ctx.aux_dprob_.data(), g.data(), g.size());
  // z-loss: each real token of group g enters with weight z_scale / R_g (its lse^2 is summed once).
  std::vector<S> zd(ctx.zsum_.size());
  for (size_t i = 0; i < zd.size(); ++i) {
    const double n = aux_rows(ctx, i);
    zd[i] = n == 0 ? S(0) : static_cast<S>(static_cast<double>(z_scale) / n);
  }
  be_.acc_from_host(ctx.z_dlse_.data(), zd.data(), zd.size());
}

template <typename T> double LlamaModel<T>::moe_z_loss(const Context& ctx) const {
  if (moe_blocks_ == 0) return 0.0;
  expect_whole_range<T>(ctx.r_, c_.num_hidden_layers, "moe_z_loss");
  std::vector<S> zs(ctx.zsum_.size());
  be_.acc_to_host(zs.data(), ctx.zsum_.data(), zs.size());
  double sum = 0;
  for (size_t g = 0; g < zs.size(); ++g) {
    const double n = aux_rows(ctx, g);
    if (n > 0) sum += static_cast<double>(zs[g]) / n;
  }
  return sum;
}

template <typename T> std::vector<int64_t> LlamaModel<T>::expert_counts(const Context& ctx, int l) const {
  if (!is_moe(l) || l < ctx.r_.begin || l >= ctx.r_.end) return {};
  return ctx.layers_[static_cast<size_t>(l - ctx.r_.begin)].routed;
}

template <typename T> std::vector<T> LlamaModel<T>::logits() {
  std::vector<T> out(logits_.size());
  be_.to_host(out.data(), logits_.data(), out.size());
  return out;
}

template class LlamaModel<float>;
template class LlamaModel<double>;
template class LlamaModel<bf16>;

}  // namespace shardtrain
