// Llama forward and backward over FSDP units. Read each *_backward right after its forward.
// Activation gradients are written (=) except on the residual stream `dres_`, which every block
// accumulates into (+=), as in llm.c.
#include <cmath>
#include <stdexcept>
#include <string>

#include "shardtrain/model/model.h"
#include "shardtrain/backend/ops_math.h"

namespace shardtrain {

std::string check_tensor_parallel(const ModelConfig& c, int tp) {
  if (tp < 1) return "option '--tp' must be >= 1, got " + std::to_string(tp);
  for (auto [n, what] : {std::pair{c.num_attention_heads, "attention heads"},
                         std::pair{c.num_key_value_heads, "key/value heads"},
                         std::pair{c.intermediate_size, "intermediate size"}})
    if (n % tp != 0)
      return "option '--tp' (" + std::to_string(tp) + ") does not divide the model's " + what + " (" +
             std::to_string(n) + "): tensor parallelism splits them evenly over the TP group";
  return "";
}

std::vector<UnitSpec> llama_units(const ModelConfig& c, int tp, int tp_rank) {
  if (const std::string why = check_tensor_parallel(c, tp); !why.empty()) throw std::invalid_argument(why);
  if (tp_rank < 0 || tp_rank >= tp) throw std::invalid_argument("llama_units: TP rank out of range");
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
  auto norm = [&](std::string n) {
    ParamSpec p{std::move(n), {C}, false, Init::Ones, 0.0};
    if (tp > 1) p.tp = TpSlice{TpSplit::Replicated, tp, C, 1, 0};
    return p;
  };
  std::vector<UnitSpec> units;
  units.push_back({"model.embed_tokens", {rows("model.embed_tokens.weight", V, C, Vl)}});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    units.push_back({"model.layers." + std::to_string(l),
                     {norm(p + "input_layernorm.weight"), rows(p + "self_attn.q_proj.weight", Q, C, Q / tp),
                      rows(p + "self_attn.k_proj.weight", KV, C, KV / tp),
                      rows(p + "self_attn.v_proj.weight", KV, C, KV / tp), cols(p + "self_attn.o_proj.weight", C, Q),
                      norm(p + "post_attention_layernorm.weight"), rows(p + "mlp.gate_proj.weight", I, C, I / tp),
                      rows(p + "mlp.up_proj.weight", I, C, I / tp), cols(p + "mlp.down_proj.weight", C, I)}});
  }
  UnitSpec head{"model.norm", {norm("model.norm.weight")}};
  if (!c.tie_word_embeddings) head.params.push_back(rows("lm_head.weight", V, C, Vl));
  units.push_back(head);
  return units;
}

template <typename T> void rope_tables(std::vector<T>& cs, std::vector<T>& sn, int T_, const std::vector<double>& inv_freq) {
  const int half = static_cast<int>(inv_freq.size());
  cs.resize(static_cast<size_t>(T_) * half);
  sn.resize(cs.size());
  for (int t = 0; t < T_; ++t)
    for (int j = 0; j < half; ++j) {
      double a = t * inv_freq[static_cast<size_t>(j)];
      cs[static_cast<size_t>(t) * half + j] = static_cast<T>(std::cos(a));
      sn[static_cast<size_t>(t) * half + j] = static_cast<T>(std::sin(a));
    }
}

// ---- attention ------------------------------------------------------------------------------
// Query head h = j*G + g reads key/value head j (G = NH/NKV). For a fixed sequence b and a fixed
// g, the NKV pairs (h, j) are evenly strided in memory (q: G*HD, k and v: HD, scores: G*T*T), so
// each (b, g) is one strided-batched GEMM over j: B*G calls per product (B for plain MHA).
template <typename T>
void attention_forward(Backend<T>& be, const T* q, const T* k, const T* v, T* att, T* y, int B, int T_, int NH,
                       int NKV, int HD, const int32_t* doc) {
  using S = typename Backend<T>::S;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD;
  const int64_t TT = static_cast<int64_t>(T_) * T_;
  for (int b = 0; b < B; ++b)
    for (int g = 0; g < G; ++g) {
      const T* qb = q + static_cast<int64_t>(b) * T_ * ldq + static_cast<int64_t>(g) * HD;
      const T* kb = k + static_cast<int64_t>(b) * T_ * ldk;
      T* ab = att + (static_cast<int64_t>(b) * NH + g) * TT;
      be.gemm_strided_batched(false, true, T_, T_, HD, S(1), qb, ldq, static_cast<int64_t>(G) * HD, kb, ldk, HD, S(0),
                              ab, T_, G * TT, NKV);
    }
  if (doc) be.softmax_causal_doc_forward(att, doc, B, NH, T_, S(1) / std::sqrt(static_cast<S>(HD)));
  else be.softmax_causal_forward(att, B * NH, T_, S(1) / std::sqrt(static_cast<S>(HD)));
  if (!y) return;  // the probabilities only (recomputed for backward)
  for (int b = 0; b < B; ++b)
    for (int g = 0; g < G; ++g) {
      const T* ab = att + (static_cast<int64_t>(b) * NH + g) * TT;
      const T* vb = v + static_cast<int64_t>(b) * T_ * ldk;
      T* yb = y + static_cast<int64_t>(b) * T_ * ldq + static_cast<int64_t>(g) * HD;
      be.gemm_strided_batched(false, false, T_, HD, T_, S(1), ab, T_, G * TT, vb, ldk, HD, S(0), yb, ldq,
                              static_cast<int64_t>(G) * HD, NKV);
    }
}

// dP_h = dy_h v_j^T;  dv_j = sum_g P_h^T dy_h;  dS_h = softmax_backward(dP_h);
// dq_h = dS_h k_j;    dk_j = sum_g dS_h^T q_h   (h = j*G + g). The sums over the G heads of a group
// are successive batched GEMMs over j, beta = 0 for g = 0 and 1 after (within one batched call
// every j writes its own dv_j / dk_j).
template <typename T>
void attention_backward(Backend<T>& be, const T* q, const T* k, const T* v, const T* att, const T* dy, T* datt,
                        T* dq, T* dk, T* dv, int B, int T_, int NH, int NKV, int HD) {
  using S = typename Backend<T>::S;
  const int G = NH / NKV, ldq = NH * HD, ldk = NKV * HD;
  const int64_t TT = static_cast<int64_t>(T_) * T_, sq = static_cast<int64_t>(G) * HD, sa = G * TT;
  for (int b = 0; b < B; ++b)
    for (int g = 0; g < G; ++g) {
      const int64_t qo = static_cast<int64_t>(b) * T_ * ldq + static_cast<int64_t>(g) * HD;
      const int64_t ko = static_cast<int64_t>(b) * T_ * ldk;
      const int64_t ao = (static_cast<int64_t>(b) * NH + g) * TT;
      be.gemm_strided_batched(false, true, T_, T_, HD, S(1), dy + qo, ldq, sq, v + ko, ldk, HD, S(0), datt + ao, T_, sa,
                              NKV);
      be.gemm_strided_batched(true, false, T_, HD, T_, S(1), att + ao, T_, sa, dy + qo, ldq, sq, g == 0 ? S(0) : S(1),
                              dv + ko, ldk, HD, NKV);
    }
  be.softmax_causal_backward(datt, att, B * NH, T_, S(1) / std::sqrt(static_cast<S>(HD)));
  for (int b = 0; b < B; ++b)
    for (int g = 0; g < G; ++g) {
      const int64_t qo = static_cast<int64_t>(b) * T_ * ldq + static_cast<int64_t>(g) * HD;
      const int64_t ko = static_cast<int64_t>(b) * T_ * ldk;
      const int64_t ao = (static_cast<int64_t>(b) * NH + g) * TT;
      be.gemm_strided_batched(false, false, T_, HD, T_, S(1), datt + ao, T_, sa, k + ko, ldk, HD, S(0), dq + qo, ldq,
                              sq, NKV);
      be.gemm_strided_batched(true, false, T_, HD, T_, S(1), datt + ao, T_, sa, q + qo, ldq, sq, g == 0 ? S(0) : S(1),
                              dk + ko, ldk, HD, NKV);
    }
}

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

// ---- options and memory ----------------------------------------------------------------------
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
const char* attention_name(AttentionKind a) { return a == AttentionKind::Tiled ? "tiled" : "exact"; }
const char* attention_mask_name(AttentionMask m) { return m == AttentionMask::Document ? "document" : "causal"; }
int default_loss_chunk(int V) { return std::max(256, static_cast<int>((int64_t{1} << 24) / std::max(1, V))); }

namespace {
// Elements of every activation buffer, by the buffer's role; LlamaModel::ensure allocates exactly
// these and activation_bytes() adds them up, so the memory plan cannot drift from the code.
struct Sizes {
  int64_t BT, x, rstd, q, kv, att, lse, y, gi;  // gi: gate / up / h / their gradients, [BT, I]
  int64_t chunk_logits, rope, dsum;
  bool keep_all, keep_h, keep_att;  // per-layer buffers besides x; h; exact probabilities
  int64_t full, ce;  // TP > 1: full_ and dfull_ [BT, C] each; the cross-entropy's scalars
  int64_t layout;    // mask Document: a context's positions and documents, the model's row indices (ids each)
  Sizes(const LlamaDims& d, const ModelOptions& o) {
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
    norms = 2 * int64_t{d.C};
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
  const Sizes z(LlamaDims(c, tp, 0, cp).with_batch(B, T_, o.loss_chunk), o);
  return int64_t{blocks} * static_cast<int64_t>(E) * z.deferred();
}

int64_t context_bytes(const ModelConfig& c, const ModelOptions& o, int B, int T_, size_t E, int begin, int end, int tp,
                      int cp) {
  if (begin < 0 || begin > end || end > c.num_hidden_layers)
    throw std::invalid_argument("context_bytes: blocks [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") are not a range of a model of " + std::to_string(c.num_hidden_layers) + " blocks");
  const Sizes z(LlamaDims(c, tp, 0, cp).with_batch(B, T_, o.loss_chunk), o);
  const int64_t e = static_cast<int64_t>(E), a = E == 8 ? 8 : 4;  // Backend<T>::S: double for double, else float
  const int64_t rest = e * (2 * z.rstd + z.q + 2 * z.kv + z.y + z.x + 2 * z.gi) + a * z.lse;  // as ensure_context
  const int64_t block =
      e * z.x + (z.keep_all ? rest : 0) + (z.keep_h ? e * z.gi : 0) + (z.keep_att ? e * z.att : 0);
  const bool head = end == c.num_hidden_layers, first = begin == 0;
  return int64_t{end - begin} * block + e * 2 * z.x + (head ? e * (z.x + z.rstd) : 0) +
         4 * z.BT * ((first ? 1 : 0) + (first && tp > 1 ? 1 : 0) + (head ? 1 : 0)) + 2 * 4 * z.layout;
}

ActivationBytes activation_bytes(const ModelConfig& c, const ModelOptions& o, int B, int T_, size_t E, size_t A,
                                 int tp, int cp) {
  const Sizes z(LlamaDims(c, tp, 0, cp).with_batch(B, T_, o.loss_chunk), o);
  const int64_t e = static_cast<int64_t>(E), a = static_cast<int64_t>(A);
  // One block's activations besides its input x, h and the exact probabilities.
  const int64_t rest = e * (2 * z.rstd + z.q + 2 * z.kv + z.y + z.x + 2 * z.gi) + a * z.lse;
  ActivationBytes r;
  r.per_layer = c.num_hidden_layers *
                (e * z.x + (z.keep_all ? rest : 0) + (z.keep_h ? e * z.gi : 0) + (z.keep_att ? e * z.att : 0));
  if (o.recompute == Recompute::Selective) r.recompute = e * (z.gi + z.att);
  if (o.recompute == Recompute::Full) r.recompute = rest + e * (z.gi + z.att);
  r.block_scratch = e * (3 * z.x + 2 * z.q + 2 * z.kv + 3 * z.gi + z.att) + a * z.dsum;
  r.head = e * (2 * z.x + z.rstd + z.chunk_logits + 2 * z.rope) + 2 * 4 * z.BT + 3 * 4 * z.layout;
  if (tp > 1) {  // full_, dfull_, ids_tp_, the cross-entropy's scalars
    r.block_scratch += e * 2 * z.full;
    r.head += 4 * z.BT + a * z.ce;
  }
  return r;
}

LlamaDims::LlamaDims(const ModelConfig& c, int tp_, int tp_rank, int cp_)
    : C(c.hidden_size), I(c.intermediate_size / tp_), V(c.vocab_size), L(c.num_hidden_layers),
      NH(c.num_attention_heads / tp_), NKV(c.num_key_value_heads / tp_), HD(c.head_dim()), Q(NH * HD), KV(NKV * HD),
      tp(tp_), cp(cp_), Vl((c.vocab_size + tp_ - 1) / tp_), v0(tp_rank * Vl),
      valid(std::clamp(c.vocab_size - tp_rank * Vl, 0, Vl)) {}

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
  d.chunk = static_cast<int>(std::min<int64_t>(loss_chunk > 0 ? loss_chunk : default_loss_chunk(Vl), int64_t{B_} * T));
  return d;
}

// ---- model ------------------------------------------------------------------------------------
namespace {
constexpr LinearRole kFwd = LinearRole::Forward, kDIn = LinearRole::InputGrad, kDW = LinearRole::WeightGrad;
}  // namespace

template <typename T>
LlamaModel<T>::LlamaModel(const ModelConfig& c, Backend<T>& be, const ModelOptions& o, TensorParallelOps<T>* tp,
                          ContextParallelOps<T>* cp)
    : c_(c), o_(o), be_(be), tp_(tp && tp->size() > 1 ? tp : nullptr), cp_(cp && cp->size() > 1 ? cp : nullptr),
      tp_n_(tp_ ? tp_->size() : 1), tp_rank_(tp_ ? tp_->rank() : 0), d_(c, tp_n_, tp_rank_, cp_ ? cp_->size() : 1) {
  if (cp_ && o_.attention == AttentionKind::Exact)
    throw std::invalid_argument("context parallelism (--cp " + std::to_string(cp_->size()) +
                                ") runs tiled attention only, not '--attention exact'");
  // Offsets do not depend on the world size; with TP, the slices' (llama_units checks tp).
  ShardPlan p = ShardPlan::build(llama_units(c, tp_n_, tp_rank_), 1);
  const UnitPlan& blk = p.units[1];
  auto of = [&](const char* n) { return blk.param("model.layers.0." + std::string(n)).offset; };
  off_ = {of("input_layernorm.weight"), of("self_attn.q_proj.weight"), of("self_attn.k_proj.weight"),
          of("self_attn.v_proj.weight"), of("self_attn.o_proj.weight"), of("post_attention_layernorm.weight"),
          of("mlp.gate_proj.weight"), of("mlp.up_proj.weight"), of("mlp.down_proj.weight")};
  const UnitPlan& head = p.units.back();
  head_off_norm_ = head.param("model.norm.weight").offset;
  head_off_w_ = c.tie_word_embeddings ? 0 : head.param("lm_head.weight").offset;
  if (o_.loss_chunk < 0) throw std::invalid_argument("option '--loss-chunk' must be >= 0");
  eps_ = static_cast<S>(c.rms_norm_eps);
  attn_scale_ = S(1) / std::sqrt(static_cast<S>(d_.HD));
  ctx_ = Context(BlockRange{0, c.num_hidden_layers, {}});
}

template <typename T> void LlamaModel<T>::ensure(int B, int T_) {
  if (B == d_.B && T_ == d_.T_) return;
  d_ = d_.with_batch(B, T_, o_.loss_chunk);  // throws when TP does not divide B*T_
  const Sizes z(d_, o_);
  auto buf = [&](int64_t n) { return Buffer<T>(be_, static_cast<size_t>(n)); };
  auto acc = [&](int64_t n) { return AccBuffer<T>(be_, static_cast<size_t>(n)); };
  work_ = Layer{};
  if (o_.recompute == Recompute::Full) {
    work_.rstd1 = buf(z.rstd); work_.q = buf(z.q); work_.k = buf(z.kv); work_.v = buf(z.kv); work_.lse = acc(z.lse);
    work_.y = buf(z.y); work_.x1 = buf(z.x); work_.rstd2 = buf(z.rstd); work_.g = buf(z.gi); work_.u = buf(z.gi);
  }
  if (o_.recompute != Recompute::None) { work_.h = buf(z.gi); work_.att = buf(z.att); }
  chunk_logits_ = buf(z.chunk_logits);
  logits_ = Buffer<T>();
  ln_ = buf(z.x);
  dln_ = buf(z.x);
  dq_ = buf(z.q); dk_ = buf(z.kv); dv_ = buf(z.kv);
  datt_ = buf(z.att); dsum_ = acc(z.dsum); dy_ = buf(z.y);
  dh_ = buf(z.gi); dg_ = buf(z.gi); du_ = buf(z.gi);
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

template <typename T> void LlamaModel<T>::check_layout(const TokenLayout& lay, int B, int T_) const {
  if (cp_ && !lay.pos)
    throw std::invalid_argument("LlamaModel::forward: under context parallelism the layout must give every row's "
                                "global position (TokenLayout::pos)");
  if (!lay.pos) return;
  const int64_t Tg = int64_t{T_} * d_.cp;
  for (int64_t i = 0; i < int64_t{B} * T_; ++i)
    if (lay.pos[i] < 0 || lay.pos[i] >= Tg)
      throw std::invalid_argument("token position " + std::to_string(lay.pos[i]) + " at token " + std::to_string(i) +
                                  " is outside [0, " + std::to_string(Tg) + ") (the sequence length)");
}

// Only what changes something is used: positions other than t, rows of more than one document.
template <typename T> void LlamaModel<T>::set_layout(Context& ctx, const TokenLayout& lay) {
  const LlamaDims& d = d_;
  const size_t n = static_cast<size_t>(d.BT), T_ = static_cast<size_t>(d.T_);
  bool pos = false, doc = false;
  for (size_t i = 0; i < n; ++i) {
    pos = pos || (lay.pos && lay.pos[i] != static_cast<int32_t>(i % T_));
    doc = doc || (lay.doc && lay.doc[i] != lay.doc[i - i % T_]);
  }
  // Under CP the rows are not in order (the positions always matter), and every rank of the group
  // must make the same attention call: documents given are used whatever this rank's rows hold.
  if (cp_) {
    pos = true;
    doc = lay.doc != nullptr;
  }
  ctx.use_pos_ = pos;
  ctx.use_doc_ = doc;
  if (pos) {
    if (ctx.pos_.size() != n) ctx.pos_ = IdBuffer<T>(be_, n);
    be_.ids_from_host(ctx.pos_.data(), lay.pos, n);
  }
  if (doc) {
    if (ctx.doc_.size() != n) ctx.doc_ = IdBuffer<T>(be_, n);
    be_.ids_from_host(ctx.doc_.data(), lay.doc, n);
    if (!cp_) ensure_rows();
  }
}

// A context's buffers for d_'s micro-batch: per block of its range what the mode keeps (Sizes), the
// range's output and residual gradient; the ids and the final norm's buffers where the range has
// the embedding / the head. For [0, L) exactly what activation_bytes counts besides the scratch.
template <typename T> void LlamaModel<T>::ensure_context(Context& ctx) {
  if (ctx.B_ == d_.B && ctx.T_ == d_.T_) return;
  const Sizes z(d_, o_);
  const BlockRange& r = ctx.r_;
  auto buf = [&](int64_t n) { return Buffer<T>(be_, static_cast<size_t>(n)); };
  auto acc = [&](int64_t n) { return AccBuffer<T>(be_, static_cast<size_t>(n)); };
  auto ids = [&](bool need) { return IdBuffer<T>(be_, need ? static_cast<size_t>(z.BT) : 0); };
  ctx.B_ = ctx.T_ = 0;
  ctx.stage_ = Stage::None;
  ctx.layers_.clear();
  ctx.layers_.resize(static_cast<size_t>(r.end - r.begin));
  ctx.w_.clear();  // sized for the old micro-batch: the next backward_input allocates them again
  for (auto& L : ctx.layers_) {
    L.x = buf(z.x);
    if (z.keep_all) {  // everything of a block but x, h and the exact probabilities
      L.rstd1 = buf(z.rstd); L.q = buf(z.q); L.k = buf(z.kv); L.v = buf(z.kv); L.lse = acc(z.lse); L.y = buf(z.y);
      L.x1 = buf(z.x); L.rstd2 = buf(z.rstd); L.g = buf(z.gi); L.u = buf(z.gi);
    }
    if (z.keep_h) L.h = buf(z.gi);
    if (z.keep_att) L.att = buf(z.att);
  }
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
  const Sizes z(d_, o_);
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
    linear(be_, kFwd, d.BT, d.C, K, in, W, out, true);
    return;
  }
  linear(be_, kFwd, d.BT, d.C, K, in, W, full_.data(), false);  // this rank's partial sums, all rows
  tp_->reduce_scatter_sum(full_.data(), out, n);                 // summed over the group, this rank's rows
  be_.axpy(n, S(1), x, out);
}

template <typename T> void LlamaModel<T>::reduce_input_grad() {
  if (tp_n_ > 1) tp_->reduce_scatter_sum(dfull_.data(), dln_.data(), static_cast<size_t>(d_.R) * d_.C);
}

template <typename T> void LlamaModel<T>::rope(const Context& ctx, T* x, int H, bool backward) {
  const LlamaDims& d = d_;
  if (!ctx.use_pos_) {
    if (backward) be_.rope_backward(x, cos_.data(), sin_.data(), d.B, d.T_, H, d.HD);
    else be_.rope_forward(x, cos_.data(), sin_.data(), d.B, d.T_, H, d.HD);
  } else if (backward) {
    be_.rope_backward_at(x, cos_.data(), sin_.data(), ctx.pos_.data(), d.BT, H, d.HD);
  } else {
    be_.rope_forward_at(x, cos_.data(), sin_.data(), ctx.pos_.data(), d.BT, H, d.HD);
  }
}

// With documents, the tiled path is block attention (flash_attention.h) of the whole sequence
// against itself: positions = row indices, so the mask is s <= t within a document, and tile pairs
// that it hides entirely (other documents, above the diagonal) are skipped and counted
// (take_block_attention_stats). One block: its y and lse are the final ones (no merge).
template <typename T> void LlamaModel<T>::attend(const Context& ctx, Layer& a, T* att) {
  const LlamaDims& d = d_;
  const int32_t* doc = ctx.use_doc_ ? ctx.doc_.data() : nullptr;
  if (cp_)  // tiled only (the constructor refuses exact): this rank's rows against the whole sequence
    cp_->forward(a.y.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), ctx.pos_.data(), doc, d.B, d.T_, d.NH,
                 d.NKV, d.HD, attn_scale_);
  else if (o_.attention == AttentionKind::Exact)
    shardtrain::attention_forward(be_, a.q.data(), a.k.data(), a.v.data(), att, a.y.data(), d.B, d.T_, d.NH, d.NKV,
                                  d.HD, doc);
  else if (!doc)
    be_.flash_attention_forward(a.y.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), d.B, d.T_, d.NH, d.NKV,
                                d.HD, attn_scale_);
  else
    be_.attention_block_forward(a.y.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), rows_.data(),
                                rows_.data(), doc, doc, d.B, d.T_, d.T_, d.NH, d.NKV, d.HD, attn_scale_);
}

// The exact path's backward needs no documents (masked probabilities are 0). The block backward
// accumulates into dq_, dk_, dv_ (zeroed first), given D = rowsum(dy o y) of the (final) y.
template <typename T>
void LlamaModel<T>::attend_backward(const Context& ctx, const Layer& a, const T* att, T* dq, T* dk, T* dv) {
  const LlamaDims& d = d_;
  if (cp_) {  // writes (=) dq and this rank's dk, dv (the other ranks' queries' parts come home)
    cp_->backward(dq, dk, dv, dy_.data(), a.q.data(), a.k.data(), a.v.data(), a.y.data(), a.lse.data(),
                  ctx.pos_.data(), ctx.use_doc_ ? ctx.doc_.data() : nullptr, d.B, d.T_, d.NH, d.NKV, d.HD,
                  attn_scale_);
  } else if (o_.attention == AttentionKind::Exact) {
    shardtrain::attention_backward(be_, a.q.data(), a.k.data(), a.v.data(), att, dy_.data(), datt_.data(), dq, dk, dv,
                                   d.B, d.T_, d.NH, d.NKV, d.HD);
  } else if (!ctx.use_doc_) {
    be_.flash_attention_backward(dq, dk, dv, dsum_.data(), dy_.data(), a.q.data(), a.k.data(), a.v.data(), a.y.data(),
                                 a.lse.data(), d.B, d.T_, d.NH, d.NKV, d.HD, attn_scale_);
  } else {
    const int32_t* doc = ctx.doc_.data();
    be_.attention_row_dot(dsum_.data(), dy_.data(), a.y.data(), d.B, d.T_, d.NH, d.HD);
    be_.zero(dq, static_cast<size_t>(d.BT) * d.Q);
    be_.zero(dk, static_cast<size_t>(d.BT) * d.KV);
    be_.zero(dv, static_cast<size_t>(d.BT) * d.KV);
    be_.attention_block_backward(dq, dk, dv, dy_.data(), a.q.data(), a.k.data(), a.v.data(), a.lse.data(),
                                 dsum_.data(), rows_.data(), rows_.data(), doc, doc, d.B, d.T_, d.T_, d.NH, d.NKV,
                                 d.HD, attn_scale_);
  }
}

template <typename T>
void LlamaModel<T>::block_forward(const Context& ctx, const T* w, const T* x, Layer& a, T* h, T* att, T* xn) {
  const LlamaDims& d = d_;
  // Attention sub-block: x1 = x + o_proj(attn(rope(q), rope(k), v)) on rmsnorm(x).
  be_.rmsnorm_forward(ln_.data(), a.rstd1.data(), x, w + off_.ln1, d.R, d.C, eps_);
  const T* n1 = gather_rows(ln_.data(), full_);
  linear(be_, kFwd, d.BT, d.Q, d.C, n1, w + off_.q, a.q.data(), false);
  linear(be_, kFwd, d.BT, d.KV, d.C, n1, w + off_.k, a.k.data(), false);
  linear(be_, kFwd, d.BT, d.KV, d.C, n1, w + off_.v, a.v.data(), false);
  rope(ctx, a.q.data(), d.NH, false);
  rope(ctx, a.k.data(), d.NKV, false);
  attend(ctx, a, att);
  row_parallel_residual(a.y.data(), d.Q, w + off_.o, x, a.x1.data());
  // MLP sub-block: x_next = x1 + down(silu(gate(n)) * up(n)), n = rmsnorm(x1).
  be_.rmsnorm_forward(ln_.data(), a.rstd2.data(), a.x1.data(), w + off_.ln2, d.R, d.C, eps_);
  const T* n2 = gather_rows(ln_.data(), full_);
  linear(be_, kFwd, d.BT, d.I, d.C, n2, w + off_.gate, a.g.data(), false);
  linear(be_, kFwd, d.BT, d.I, d.C, n2, w + off_.up, a.u.data(), false);
  be_.swiglu_forward(h, a.g.data(), a.u.data(), static_cast<size_t>(d.BT) * d.I);
  if (!xn) return;
  row_parallel_residual(h, d.I, w + off_.down, a.x1.data(), xn);
}

int BlockRange::unit(int u) const {
  if (units.empty()) return u;
  const int i = units.at(static_cast<size_t>(u));
  if (i < 0) throw std::logic_error("BlockRange: model unit " + std::to_string(u) + " is not held by this range's units");
  return i;
}

std::vector<UnitSpec> llama_stage_units(const ModelConfig& c, int begin, int end, int tp, int tp_rank) {
  const BlockRange r = llama_stage_range(c, begin, end);
  std::vector<UnitSpec> all = llama_units(c, tp, tp_rank), out;
  for (size_t u = 0; u < all.size(); ++u)
    if (r.units[u] >= 0) out.push_back(std::move(all[u]));
  return out;
}

BlockRange llama_stage_range(const ModelConfig& c, int begin, int end) {
  const int L = c.num_hidden_layers;
  if (begin < 0 || begin > end || end > L)
    throw std::invalid_argument("block range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") is not inside [0, " + std::to_string(L) + ")");
  BlockRange r{begin, end, std::vector<int>(static_cast<size_t>(L) + 2, -1)};
  int n = 0;
  if (begin == 0 || (end == L && c.tie_word_embeddings)) r.units[0] = n++;
  for (int l = begin; l < end; ++l) r.units[static_cast<size_t>(1 + l)] = n++;
  if (end == L) r.units[static_cast<size_t>(L) + 1] = n++;
  return r;
}

template <typename T> void LlamaModel<T>::check_range(const BlockRange& r) const {
  if (r.begin < 0 || r.begin > r.end || r.end > c_.num_hidden_layers)
    throw std::invalid_argument("LlamaModel: block range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                ") is not inside [0, " + std::to_string(c_.num_hidden_layers) + ")");
  if (!r.units.empty() && r.units.size() != static_cast<size_t>(c_.num_hidden_layers) + 2)
    throw std::invalid_argument("LlamaModel: a unit map has one entry per model unit (" +
                                std::to_string(c_.num_hidden_layers + 2) + "), got " + std::to_string(r.units.size()));
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
    block_forward(ctx, w, kept.x.data(), act, h, att,
                  l + 1 < b ? ctx.layers_[static_cast<size_t>(l + 1 - a)].x.data() : ctx.xf_.data());
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

template <typename T> void LlamaModel<T>::check_ids(const int32_t* ids, int64_t n) const {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= c_.vocab_size)
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

template <typename T> void LlamaModel<T>::head_logits(UnitSource<T>& f) {
  expect_stage(ctx_, Stage::Forward, "head_logits");
  if (tp_n_ > 1) throw std::logic_error("LlamaModel::head_logits is not available under tensor parallelism");
  ctx_.stage_ = Stage::None;
  const LlamaDims& d = d_;
  const T* hw = ctx_.head_gathers_ == gathers_ ? ctx_.head_w_ : gather(f, d.L + 1);
  const T* wout = c_.tie_word_embeddings ? gather(f, 0) : hw + head_off_w_;
  if (logits_.size() != static_cast<size_t>(d.BT) * d.V) logits_ = Buffer<T>(be_, static_cast<size_t>(d.BT) * d.V);
  linear(be_, kFwd, d.BT, d.V, d.C, ctx_.lnf_.data(), wout, logits_.data(), false);
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
  check_ids(targets, d.BT);
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
      linear(be_, kFwd, n, d.Vl, d.C, x, wout, lg, false);
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
      linear(be_, kDIn, n, d.Vl, d.C, lg, wout, dlnf + static_cast<int64_t>(r0) * d.C, false);
      linear(be_, kDW, n, d.Vl, d.C, lg, x, gw, true);
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

template <typename T>
typename LlamaModel<T>::Layer& LlamaModel<T>::backward_activations(Context& ctx, int l, const T* w) {
  const LlamaDims& d = d_;
  const size_t n = static_cast<size_t>(d.BT) * d.I;
  Layer& a = ctx.layers_[static_cast<size_t>(l - ctx.r_.begin)];
  switch (o_.recompute) {
    case Recompute::None:
      return a;
    case Recompute::Selective:
      be_.swiglu_forward(work_.h.data(), a.g.data(), a.u.data(), n);
      if (o_.attention == AttentionKind::Exact)  // the probabilities only (y is kept)
        shardtrain::attention_forward<T>(be_, a.q.data(), a.k.data(), a.v.data(), work_.att.data(), nullptr, d.B, d.T_,
                                         d.NH, d.NKV, d.HD, ctx.use_doc_ ? ctx.doc_.data() : nullptr);
      return a;
    case Recompute::Full:
      block_forward(ctx, w, a.x.data(), work_, work_.h.data(), work_.att.data(), nullptr);
      return work_;
  }
  return a;
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

// With keep (backward_input) every operand a weight-gradient GEMM reads goes to *keep instead of
// the model's scratch (the same kernels on the same values, so the same bits), and block_weight
// makes those GEMMs later with the arguments this function would have passed.
template <typename T>
void LlamaModel<T>::block_backward(UnitSource<T>& f, Context& ctx, int l, const T* w, Deferred* keep) {
  const LlamaDims& d = d_;
  Layer& a = backward_activations(ctx, l, w);
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
  // MLP: x_next = x1 + h Wd^T.  dres flows to x1 unchanged (+ the norm path below).
  const T* dr = keep ? keep_rows(dres, keep->dr2) : gather_rows(dres, dfull_);  // TP: all rows of d(x_next)
  linear(be_, kDIn, d.BT, d.C, d.I, dr, w + off_.down, dh_.data(), false);
  if (!keep) linear(be_, kDW, d.BT, d.C, d.I, dr, h, gw + off_.down, true);
  be_.swiglu_backward(dg, du, dh_.data(), a.g.data(), a.u.data(), static_cast<size_t>(d.BT) * d.I);
  linear(be_, kDIn, d.BT, d.I, d.C, dg, w + off_.gate, input_grad(), false);
  linear(be_, kDIn, d.BT, d.I, d.C, du, w + off_.up, input_grad(), true);
  // The normalized input is not kept per layer: recomputed (bitwise the same values, rstd too).
  const T* n2 = norm_rows(a.rstd2.data(), a.x1.data(), w + off_.ln2, keep ? &keep->n2 : nullptr);
  if (!keep) {
    linear(be_, kDW, d.BT, d.I, d.C, dg, n2, gw + off_.gate, true);
    linear(be_, kDW, d.BT, d.I, d.C, du, n2, gw + off_.up, true);
  }
  reduce_input_grad();
  be_.rmsnorm_backward(dres, gln2, dln_.data(), a.x1.data(), w + off_.ln2, a.rstd2.data(), d.R, d.C);
  // Attention: x1 = x + y Wo^T.
  dr = keep ? keep_rows(dres, keep->dr1) : gather_rows(dres, dfull_);
  linear(be_, kDIn, d.BT, d.C, d.Q, dr, w + off_.o, dy_.data(), false);
  if (!keep) linear(be_, kDW, d.BT, d.C, d.Q, dr, a.y.data(), gw + off_.o, true);
  attend_backward(ctx, a, att, dq, dk, dv);
  rope(ctx, dq, d.NH, true);
  rope(ctx, dk, d.NKV, true);
  linear(be_, kDIn, d.BT, d.Q, d.C, dq, w + off_.q, input_grad(), false);
  linear(be_, kDIn, d.BT, d.KV, d.C, dk, w + off_.k, input_grad(), true);
  linear(be_, kDIn, d.BT, d.KV, d.C, dv, w + off_.v, input_grad(), true);
  const T* n1 = norm_rows(a.rstd1.data(), x, w + off_.ln1, keep ? &keep->n1 : nullptr);
  if (!keep) {
    linear(be_, kDW, d.BT, d.Q, d.C, dq, n1, gw + off_.q, true);
    linear(be_, kDW, d.BT, d.KV, d.C, dk, n1, gw + off_.k, true);
    linear(be_, kDW, d.BT, d.KV, d.C, dv, n1, gw + off_.v, true);
  }
  reduce_input_grad();
  be_.rmsnorm_backward(dres, gln1, dln_.data(), x, w + off_.ln1, a.rstd1.data(), d.R, d.C);
}

// block_backward's weight gradients, in its order, from what it kept. gw is zeroed (full_grad), and
// the RMSNorm kernels started keep.dnorm from zero as they would have started gw: copying them in
// gives backward's bits.
template <typename T> void LlamaModel<T>::block_weight(const Context& ctx, int l, T* gw) {
  const LlamaDims& d = d_;
  const size_t i = static_cast<size_t>(l - ctx.r_.begin);
  const Deferred& k = ctx.w_[i];
  const Layer& a = ctx.layers_[i];  // h (Recompute::None) and y (None, Selective) are the context's
  const T* h = k.h.size() ? k.h.data() : a.h.data();
  const T* y = k.y.size() ? k.y.data() : a.y.data();
  linear(be_, kDW, d.BT, d.C, d.I, k.dr2.data(), h, gw + off_.down, true);
  linear(be_, kDW, d.BT, d.I, d.C, k.dg.data(), k.n2.data(), gw + off_.gate, true);
  linear(be_, kDW, d.BT, d.I, d.C, k.du.data(), k.n2.data(), gw + off_.up, true);
  be_.copy(gw + off_.ln2, k.dnorm.data() + d.C, static_cast<size_t>(d.C));
  linear(be_, kDW, d.BT, d.C, d.Q, k.dr1.data(), y, gw + off_.o, true);
  linear(be_, kDW, d.BT, d.Q, d.C, k.dq.data(), k.n1.data(), gw + off_.q, true);
  linear(be_, kDW, d.BT, d.KV, d.C, k.dk.data(), k.n1.data(), gw + off_.k, true);
  linear(be_, kDW, d.BT, d.KV, d.C, k.dv.data(), k.n1.data(), gw + off_.v, true);
  be_.copy(gw + off_.ln1, k.dnorm.data(), static_cast<size_t>(d.C));
}

template <typename T> std::vector<T> LlamaModel<T>::logits() {
  std::vector<T> out(logits_.size());
  be_.to_host(out.data(), logits_.data(), out.size());
  return out;
}

template class LlamaModel<float>;
template class LlamaModel<double>;
template class LlamaModel<bf16>;
template void rope_tables<float>(std::vector<float>&, std::vector<float>&, int, const std::vector<double>&);
template void rope_tables<double>(std::vector<double>&, std::vector<double>&, int, const std::vector<double>&);
#define ST_INST(T)                                                                                           \
  template void linear<T>(Backend<T>&, LinearRole, int, int, int, const T*, const T*, T*, bool);                 \
  template void attention_forward<T>(Backend<T>&, const T*, const T*, const T*, T*, T*, int, int, int, int, int, \
                                     const int32_t*);                                                            \
  template void attention_backward<T>(Backend<T>&, const T*, const T*, const T*, const T*, const T*, T*, T*, T*, \
                                      T*, int, int, int, int, int);
ST_INST(float)
ST_INST(double)
ST_INST(bf16)

}  // namespace shardtrain
