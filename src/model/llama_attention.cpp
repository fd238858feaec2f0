// Llama's self-attention (model.h): the RoPE tables and rotation, the exact attention path
// (attention_forward / attention_backward), and the model's attention calls, which pick the tiled,
// exact, document-masked or context-parallel kernels; the token layout (positions, documents)
// they read.
#include <cmath>
#include <stdexcept>
#include <string>

#include "shardtrain/model/model.h"

namespace shardtrain {

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

// RoPE on this block's queries and keys (or their gradients), at positions 0 .. T-1 of each
// sequence or at the context's per-token positions: one backend call for both.
template <typename T> void LlamaModel<T>::rope_qk(const Context& ctx, T* q, T* k, bool backward) {
  const LlamaDims& d = d_;
  be_.rope_qk(q, d.NH, k, d.NKV, cos_.data(), sin_.data(), ctx.use_pos_ ? ctx.pos_.data() : nullptr, d.B, d.T_, d.HD,
              backward);
}

// Qwen3's q/k norm: the same RMSNorm kernels over BT*H rows of HD values (each head of each token).
// Its backward writes d(raw) into dqk_ (zeroed: the kernel adds), then over d: the caller's d(q) or
// d(k) buffer holds d(raw) afterwards, as the projections' backward reads it.
template <typename T> void LlamaModel<T>::head_norm(T* out, T* rstd, const T* raw, const T* wn, int H) {
  be_.rmsnorm_forward(out, rstd, raw, wn, d_.BT * H, d_.HD, eps_);
}
template <typename T>
void LlamaModel<T>::head_norm_backward(T* d, T* dwn, const T* raw, const T* wn, const T* rstd, int H) {
  const size_t n = static_cast<size_t>(d_.BT) * H * d_.HD;
  be_.zero(dqk_.data(), n);
  be_.rmsnorm_backward(dqk_.data(), dwn, d, raw, wn, rstd, d_.BT * H, d_.HD);
  be_.copy(d, dqk_.data(), n);
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
    be_.attention_block_backward(dq, dk, dv, dy_.data(), a.q.data(), a.k.data(), a.v.data(), a.y.data(),
                                 a.lse.data(), dsum_.data(), rows_.data(), rows_.data(), doc, doc, d.B, d.T_, d.T_,
                                 d.NH, d.NKV, d.HD, attn_scale_);
  }
}

// This file's members of LlamaModel and the attention functions, for each storage type
// (llama.cpp instantiates the class, and with it the members defined there).
#define ST_LLAMA_ATTENTION(T) \
  template void LlamaModel<T>::check_layout(const TokenLayout&, int, int) const; \
  template void LlamaModel<T>::set_layout(Context&, const TokenLayout&); \
  template void LlamaModel<T>::rope_qk(const Context&, T*, T*, bool); \
  template void LlamaModel<T>::head_norm(T*, T*, const T*, const T*, int); \
  template void LlamaModel<T>::head_norm_backward(T*, T*, const T*, const T*, const T*, int); \
  template void LlamaModel<T>::attend(const Context&, Layer&, T*); \
  template void LlamaModel<T>::attend_backward(const Context&, const Layer&, const T*, T*, T*, T*); \
  template void attention_forward<T>(Backend<T>&, const T*, const T*, const T*, T*, T*, int, int, int, int, int, \
                                     const int32_t*); \
  template void attention_backward<T>(Backend<T>&, const T*, const T*, const T*, const T*, const T*, T*, T*, T*, \
                                      T*, int, int, int, int, int);
ST_LLAMA_ATTENTION(float)
ST_LLAMA_ATTENTION(double)
ST_LLAMA_ATTENTION(bf16)
#undef ST_LLAMA_ATTENTION
// The RoPE tables in the scalar types they are computed in (LlamaModel::ensure rounds them to T).
template void rope_tables<float>(std::vector<float>&, std::vector<float>&, int, const std::vector<double>&);
template void rope_tables<double>(std::vector<double>&, std::vector<double>&, int, const std::vector<double>&);

}  // namespace shardtrain
