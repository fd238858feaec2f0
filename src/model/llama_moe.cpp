// The mixture-of-experts MLP sub-block of a Llama block (model.h, docs/moe.md): routing, the sort
// of the routed slots by expert, the experts' GEMMs (one gate, up and down GEMM per expert over its
// rows: a loop of BLAS calls) and the combine; their backward. Dropless: every token reaches all K
// of its experts. The per-token routing math is include/shardtrain/backend/moe_math.h.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/model/model.h"

namespace shardtrain {

namespace {
constexpr LinearRole kMoeFwd = LinearRole::Forward, kMoeDIn = LinearRole::InputGrad, kMoeDW = LinearRole::WeightGrad;  // (unity build: names of its own)
}  // namespace

// The slots t*K + j, in token then slot order, each put into its expert's run of rows (a stable
// counting sort): row r of the sorted order holds slot s, rowtok[r] = s / K (its token) and
// pos[s] = r. The order depends only on the expert choices, so every layout that routes the same
// tokens the same way computes the same rows.
template <typename T> void LlamaModel<T>::moe_sort(Layer& a) {
  const LlamaDims& d = d_;
  const size_t n = static_cast<size_t>(d.slots);
  ex_host_.resize(n);
  be_.ids_to_host(ex_host_.data(), a.experts.data(), n);
  a.eoff.assign(static_cast<size_t>(d.E) + 1, 0);
  for (int32_t e : ex_host_) {
    if (e < 0 || e >= d.E)  // moe_route picks k distinct experts in [0, E): a kernel fault, never indexed
      throw std::logic_error("LlamaModel: the router chose expert " + std::to_string(e) + " of " + std::to_string(d.E));
    ++a.eoff[static_cast<size_t>(e) + 1];
  }
  for (size_t e = 0; e < static_cast<size_t>(d.E); ++e) a.eoff[e + 1] += a.eoff[e];
  std::vector<int32_t> next(a.eoff.begin(), a.eoff.end() - 1);
  sort_host_.resize(2 * n);
  int32_t* rowtok = sort_host_.data();
  int32_t* pos = rowtok + n;
  for (size_t s = 0; s < n; ++s) {
    const int32_t r = next[static_cast<size_t>(ex_host_[s])]++;
    rowtok[r] = static_cast<int32_t>(s / static_cast<size_t>(d.K));
    pos[s] = r;
  }
  be_.ids_from_host(a.rowtok.data(), rowtok, n);
  be_.ids_from_host(a.pos.data(), pos, n);
}

// n2 = rmsnorm(x1) is in ln_ (no TP). Router logits z = n2 Wr^T [BT, E] in T, routing in S; the
// gathered rows xe [slots, C]; expert e's rows [r0, r1): g = xe We_gate^T, u = xe We_up^T
// ([rows, IE]; We_gate, We_up: rows [0, IE) and [IE, 2 IE) of gate_up_proj[e]), h = silu(g) u,
// ye = h We_down^T [rows, C]; x_next = x1 + sum_j w_j ye[pos(t, j)].
template <typename T> void LlamaModel<T>::moe_forward(const T* w, Layer& a, T* h, T* xn) {
  const LlamaDims& d = d_;
  const Offsets& o = moe_off_;
  const T* n2 = ln_.data();
  linear(be_, kMoeFwd, d.BT, d.E, d.C, n2, w + o.router, rl_.data(), false);
  be_.moe_route(a.probs.data(), a.experts.data(), a.wts.data(), rl_.data(), d.BT, d.E, d.K, d.renorm);
  moe_sort(a);
  be_.gather_rows(xe_.data(), n2, a.rowtok.data(), d.slots, d.C);
  const int64_t C = d.C, IE = d.IE, gu = 2 * IE * C, dn = C * IE;
  for (int e = 0; e < d.E; ++e) {
    const int64_t r0 = a.eoff[static_cast<size_t>(e)], n = a.eoff[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) continue;
    const T* We = w + o.egu + e * gu;
    linear(be_, kMoeFwd, static_cast<int>(n), d.IE, d.C, xe_.data() + r0 * C, We, a.g.data() + r0 * IE, false);
    linear(be_, kMoeFwd, static_cast<int>(n), d.IE, d.C, xe_.data() + r0 * C, We + IE * C, a.u.data() + r0 * IE, false);
  }
  be_.swiglu_forward(h, a.g.data(), a.u.data(), static_cast<size_t>(d.slots) * d.IE);
  for (int e = 0; e < d.E; ++e) {
    const int64_t r0 = a.eoff[static_cast<size_t>(e)], n = a.eoff[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) continue;
    linear(be_, kMoeFwd, static_cast<int>(n), d.C, d.IE, h + r0 * IE, w + o.edown + e * dn, a.ye.data() + r0 * C, false);
  }
  if (xn) be_.moe_combine(xn, a.x1.data(), a.ye.data(), a.pos.data(), a.wts.data(), d.BT, d.K, d.C);
}

// From d(x_next) (ctx.dres_): d(w), d(ye) (combine backward), the experts' backward (d(h), their
// weight gradients, d(xe)), d(n2) = the slots' d(xe) summed per token (into dln_), and the
// router's: d(z) from d(w) and the load-balancing loss's d(probs), dln_ += d(z) Wr, dWr += d(z)^T n2.
template <typename T> void LlamaModel<T>::moe_backward(Context& ctx, const T* w, Layer& a, const T* h, T* gw) {
  const LlamaDims& d = d_;
  const Offsets& o = moe_off_;
  const int64_t C = d.C, IE = d.IE, gu = 2 * IE * C, dn = C * IE;
  be_.moe_combine_backward(dye_.data(), dwts_.data(), ctx.dres_.data(), a.ye.data(), a.pos.data(), a.wts.data(), d.BT,
                           d.K, d.C);
  for (int e = 0; e < d.E; ++e) {
    const int64_t r0 = a.eoff[static_cast<size_t>(e)], n = a.eoff[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) continue;
    const int m = static_cast<int>(n);
    linear(be_, kMoeDIn, m, d.C, d.IE, dye_.data() + r0 * C, w + o.edown + e * dn, dh_.data() + r0 * IE, false);
    linear(be_, kMoeDW, m, d.C, d.IE, dye_.data() + r0 * C, h + r0 * IE, gw + o.edown + e * dn, true);
  }
  be_.swiglu_backward(dg_.data(), du_.data(), dh_.data(), a.g.data(), a.u.data(), static_cast<size_t>(d.slots) * d.IE);
  // The normalized input is not kept: recomputed (bitwise the same values), and gathered again.
  const T* n2 = norm_rows(a.rstd2.data(), a.x1.data(), w + o.ln2, nullptr);
  be_.gather_rows(xe_.data(), n2, a.rowtok.data(), d.slots, d.C);
  T* dxe = dye_.data();  // d(ye) is spent: d(xe) takes its place
  for (int e = 0; e < d.E; ++e) {
    const int64_t r0 = a.eoff[static_cast<size_t>(e)], n = a.eoff[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) continue;
    const int m = static_cast<int>(n);
    const T* We = w + o.egu + e * gu;
    T* gWe = gw + o.egu + e * gu;
    linear(be_, kMoeDIn, m, d.IE, d.C, dg_.data() + r0 * IE, We, dxe + r0 * C, false);
    linear(be_, kMoeDIn, m, d.IE, d.C, du_.data() + r0 * IE, We + IE * C, dxe + r0 * C, true);
    linear(be_, kMoeDW, m, d.IE, d.C, dg_.data() + r0 * IE, xe_.data() + r0 * C, gWe, true);
    linear(be_, kMoeDW, m, d.IE, d.C, du_.data() + r0 * IE, xe_.data() + r0 * C, gWe + IE * C, true);
  }
  be_.moe_combine(dln_.data(), nullptr, dxe, a.pos.data(), nullptr, d.BT, d.K, d.C);
  const int grp = o_.aux_scope == MoeAuxScope::Sequence ? d.T_ : d.BT;
  be_.moe_route_backward(rl_.data(), a.probs.data(), a.experts.data(), a.wts.data(), dwts_.data(),
                         ctx.aux_scale_ != S(0) ? ctx.aux_dprob_.data() : nullptr, grp, d.BT, d.E, d.K, d.renorm);
  linear(be_, kMoeDIn, d.BT, d.E, d.C, rl_.data(), w + o.router, dln_.data(), true);
  linear(be_, kMoeDW, d.BT, d.E, d.C, rl_.data(), n2, gw + o.router, true);
}

// This file's members of LlamaModel, for each storage type (llama.cpp instantiates the class).
#define ST_LLAMA_MOE(T)                                                                         \
  template void LlamaModel<T>::moe_sort(Layer&);                                                \
  template void LlamaModel<T>::moe_forward(const T*, Layer&, T*, T*);                           \
  template void LlamaModel<T>::moe_backward(Context&, const T*, Layer&, const T*, T*);
ST_LLAMA_MOE(float)
ST_LLAMA_MOE(double)
ST_LLAMA_MOE(bf16)
#undef ST_LLAMA_MOE

}  // namespace shardtrain
