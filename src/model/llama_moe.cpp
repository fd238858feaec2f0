// The mixture-of-experts MLP sub-block of a Llama block (model.h, docs/moe.md): routing, the sort
// of the routed slots by expert, the experts' GEMMs (one gate, up and down GEMM per expert over its
// rows: a loop of BLAS calls) and the combine; their backward. Dropless: every token reaches all K
// of its experts. The per-token routing math is include/shardtrain/backend/moe_math.h.
#include <algorithm>
#include <memory>
#include <new>
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

// The experts' GEMMs (a loop of BLAS calls, one per run of rows). gate_up_proj[e]: We_gate = rows
// [0, IE), We_up = rows [IE, 2 IE); down_proj[e] [C, IE].
template <typename T>
void LlamaModel<T>::expert_runs(const std::vector<int32_t>& eo, std::vector<ExpertRows>& out) {
  out.clear();
  for (size_t j = 0; j + 1 < eo.size(); ++j)
    if (eo[j + 1] > eo[j]) out.push_back({static_cast<int>(j), eo[j], eo[j + 1] - eo[j]});
}

template <typename T>
void LlamaModel<T>::experts_gate_up(const T* w, const T* x, const std::vector<ExpertRows>& rs, T* g, T* u) {
  const LlamaDims& d = d_;
  const int64_t C = d.C, IE = d.IE, gu = 2 * IE * C;
  for (const ExpertRows& r : rs) {
    const T* We = w + moe_off_.egu + r.e * gu;
    const int m = static_cast<int>(r.n);
    linear(be_, kMoeFwd, m, d.IE, d.C, x + r.r0 * C, We, g + r.r0 * IE, false);
    linear(be_, kMoeFwd, m, d.IE, d.C, x + r.r0 * C, We + IE * C, u + r.r0 * IE, false);
  }
}

template <typename T>
void LlamaModel<T>::experts_down(const T* w, const T* h, const std::vector<ExpertRows>& rs, T* y) {
  const LlamaDims& d = d_;
  const int64_t C = d.C, IE = d.IE, dn = C * IE;
  for (const ExpertRows& r : rs)
    linear(be_, kMoeFwd, static_cast<int>(r.n), d.C, d.IE, h + r.r0 * IE, w + moe_off_.edown + r.e * dn, y + r.r0 * C,
           false);
}

template <typename T>
void LlamaModel<T>::experts_down_dinput(const T* w, const T* dy, const std::vector<ExpertRows>& rs, T* dh) {
  const LlamaDims& d = d_;
  const int64_t C = d.C, IE = d.IE, dn = C * IE;
  for (const ExpertRows& r : rs)
    linear(be_, kMoeDIn, static_cast<int>(r.n), d.C, d.IE, dy + r.r0 * C, w + moe_off_.edown + r.e * dn,
           dh + r.r0 * IE, false);
}

template <typename T>
void LlamaModel<T>::experts_down_dweight(const T* dy, const T* h, const std::vector<ExpertRows>& rs, T* gw) {
  const LlamaDims& d = d_;
  const int64_t C = d.C, IE = d.IE, dn = C * IE;
  for (const ExpertRows& r : rs)
    linear(be_, kMoeDW, static_cast<int>(r.n), d.C, d.IE, dy + r.r0 * C, h + r.r0 * IE, gw + moe_off_.edown + r.e * dn,
           true);
}

template <typename T>
void LlamaModel<T>::experts_gate_up_dinput(const T* w, const T* dg, const T* du, const std::vector<ExpertRows>& rs,
                                           T* dx) {
  const LlamaDims& d = d_;
  const int64_t C = d.C, IE = d.IE, gu = 2 * IE * C;
  for (const ExpertRows& r : rs) {
    const int m = static_cast<int>(r.n);
    const T* We = w + moe_off_.egu + r.e * gu;
    linear(be_, kMoeDIn, m, d.IE, d.C, dg + r.r0 * IE, We, dx + r.r0 * C, false);
    linear(be_, kMoeDIn, m, d.IE, d.C, du + r.r0 * IE, We + IE * C, dx + r.r0 * C, true);
  }
}

template <typename T>
void LlamaModel<T>::experts_gate_up_dweight(const T* dg, const T* du, const T* x, const std::vector<ExpertRows>& rs,
                                            T* gw) {
  const LlamaDims& d = d_;
  const int64_t C = d.C, IE = d.IE, gu = 2 * IE * C;
  for (const ExpertRows& r : rs) {
    const int m = static_cast<int>(r.n);
    T* gWe = gw + moe_off_.egu + r.e * gu;
    linear(be_, kMoeDW, m, d.IE, d.C, dg + r.r0 * IE, x + r.r0 * C, gWe, true);
    linear(be_, kMoeDW, m, d.IE, d.C, du + r.r0 * IE, x + r.r0 * C, gWe + IE * C, true);
  }
}

// EP: rank q of the group computes experts [q El, (q+1) El); this rank's sorted slots are cut there
// (send_[q]). From rank p it receives, per expert j of its own, ecnt[p][me El + j] rows, in expert
// order (p's sorted order): block p of the received rows, at recv_at[p]. Expert-major row r (expert
// j's rows from rank 0, then rank 1, ...) is received row perm[r].
template <typename T> void LlamaModel<T>::ep_routes(Layer& a) {
  const LlamaDims& d = d_;
  const size_t n = static_cast<size_t>(ep_->size()), me = static_cast<size_t>(ep_->rank());
  const size_t E = static_cast<size_t>(d.E), El = static_cast<size_t>(d.El);
  ep_send_.assign(n, 0);
  ep_recv_.assign(n, 0);
  ep_send_at_.assign(n + 1, 0);
  ep_recv_at_.assign(n + 1, 0);
  std::vector<int64_t> recv_at(n + 1, 0);
  for (size_t q = 0; q < n; ++q) {
    ep_send_[q] = static_cast<size_t>(a.eoff[(q + 1) * El] - a.eoff[q * El]);
    for (size_t j = 0; j < El; ++j) ep_recv_[q] += static_cast<size_t>(a.ecnt[q * E + me * El + j]);
    recv_at[q + 1] = recv_at[q] + static_cast<int64_t>(ep_recv_[q]);
    ep_send_at_[q + 1] = ep_send_at_[q] + ep_send_[q];
    ep_recv_at_[q + 1] = ep_recv_at_[q] + ep_recv_[q];
  }
  const int64_t rows = recv_at[n];
  if (rows > d.er)  // each rank sends at most its slots: a broken count exchange, never indexed
    throw std::logic_error("LlamaModel: " + std::to_string(rows) + " expert rows received, more than " +
                           std::to_string(d.er));
  a.nrecv = rows;
  grow_expert_scratch(static_cast<size_t>(rows));
  ep_eoff_.assign(El + 1, 0);
  perm_host_.resize(2 * static_cast<size_t>(rows));
  int32_t* perm = perm_host_.data();
  int32_t* inv = perm + rows;
  std::vector<int64_t> within(n, 0);  // rows of rank p's block before expert j
  int64_t r = 0;
  for (auto* v : {&ep_all_, &ep_own_[0], &ep_own_[1], &ep_other_}) v->clear();
  auto run = [](std::vector<ExpertRows>& v, int e, int64_t r0, int64_t r1) {
    if (r1 > r0) v.push_back({e, r0, r1 - r0});
  };
  for (size_t j = 0; j < El; ++j) {
    int64_t own0 = r, own1 = r;
    for (size_t p = 0; p < n; ++p) {
      const int64_t c = a.ecnt[p * E + me * El + j], base = recv_at[p] + within[p];
      if (p == me) own0 = r, own1 = r + c;
      for (int64_t i = 0; i < c; ++i, ++r) {
        perm[r] = static_cast<int32_t>(base + i);
        inv[base + i] = static_cast<int32_t>(r);
      }
      within[p] += c;
    }
    ep_eoff_[j + 1] = static_cast<int32_t>(r);
    const int e = static_cast<int>(j);
    run(ep_all_, e, ep_eoff_[j], r);
    run(ep_own_[0], e, own0, own0 + (own1 - own0) / 2);
    run(ep_own_[1], e, own0 + (own1 - own0) / 2, own1);
    run(ep_other_, e, ep_eoff_[j], own0);
    run(ep_other_, e, own1, r);
  }
  be_.ids_from_host(perm_.data(), perm, static_cast<size_t>(rows));
  be_.ids_from_host(inv_.data(), inv, static_cast<size_t>(rows));
}

// Expert parallelism sizes a rank's expert-row buffers for balanced routing (B·T·k rows: the
// memory plan's figure) and grows them to the rows the experts get (ep_routes: up to ep x that,
// dropless), never shrinking: the scratch here, a block's kept g, u (and h) in grow_expert_rows.
// A failed growth names the rows; the job ends (main: a failure on one rank aborts all).
namespace {
template <typename B, typename Be> void grow_to(B& b, Be& be, size_t n, size_t rows, size_t slots) {
  if (b.size() >= n) return;
  try {
    b = B(be, n);
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("mixture of experts: this rank's experts got " + std::to_string(rows) +
                             " routed rows in one block (" + std::to_string(slots) +
                             " when routing is balanced), and growing their buffers to them ran out of memory; "
                             "lower '--micro-batch' or '--seq-len', or balance the router ('router_aux_loss_coef')");
  }
}
}  // namespace

template <typename T> void LlamaModel<T>::grow_expert_scratch(size_t rows) {
  const LlamaDims& d = d_;
  const size_t C = static_cast<size_t>(d.C), IE = static_cast<size_t>(d.IE), slots = static_cast<size_t>(d.slots);
  for (Buffer<T>* b : {&xr_, &xs_, &ys_}) grow_to(*b, be_, rows * C, rows, slots);
  for (IdBuffer<T>* b : {&perm_, &inv_}) grow_to(*b, be_, rows, rows, slots);
  for (Buffer<T>* b : {&dh_, &dg_, &du_}) grow_to(*b, be_, rows * IE, rows, slots);
}

// A block's g and u (a: a context's kept layer or the recomputed work_) and the buffer h points
// into (a's or work_'s) for this block's expert rows; returns h, moved when it grew.
template <typename T> T* LlamaModel<T>::grow_expert_rows(Layer& a, T* h) {
  const size_t n = expert_rows(a) * static_cast<size_t>(d_.IE), rows = expert_rows(a), slots = static_cast<size_t>(d_.slots);
  grow_to(a.g, be_, n, rows, slots);
  grow_to(a.u, be_, n, rows, slots);
  if (!h) return h;
  Buffer<T>& hb = h == work_.h.data() ? work_.h : a.h;
  if (h != hb.data()) throw std::logic_error("LlamaModel::grow_expert_rows: h is neither the block's nor work_'s");
  grow_to(hb, be_, n, rows, slots);
  return hb.data();
}

// n2 = rmsnorm(x1) is in ln_ (no TP). Router logits z = n2 Wr^T [BT, E] in T, routing in S; the
// gathered rows xe [slots, C]; expert e's rows [r0, r1): g = xe We_gate^T, u = xe We_up^T
// ([rows, IE]), h = silu(g) u, ye = h We_down^T [rows, C]; x_next = x1 + sum_j w_j ye[pos(t, j)].
// Under EP the experts' rows are the EP group's (model.h), between two all-to-alls.
template <typename T>
const T* LlamaModel<T>::expert_weights(UnitSource<T>& f, const Context& ctx, int l, const T* w) {
  return own_experts_ ? gather(f, ctx.r_.unit(expert_unit_[static_cast<size_t>(l)])) : w;
}

// Before any transfer of an EP block starts (every rank of the group alike): the block's unit (w)
// would be gone once its experts' unit is gathered from a source that keeps one unit at a time.
template <typename T> void LlamaModel<T>::check_expert_source(const UnitSource<T>& f) const {
  if (own_experts_ && f.gathered_groups() < 2)
    throw std::logic_error("LlamaModel: expert parallelism needs a UnitSource that keeps a block's unit and its "
                           "experts' unit gathered at once (GroupedUnits over the state's unit groups); this one keeps " +
                           std::to_string(f.gathered_groups()));
}

template <typename T>
void LlamaModel<T>::ep_experts_forward(const T* we, Layer& a, T* h, const std::vector<ExpertRows>& rs) {
  const LlamaDims& d = d_;
  const int64_t C = d.C, IE = d.IE;
  for (const ExpertRows& r : rs)
    be_.gather_rows(xs_.data() + r.r0 * C, xr_.data(), perm_.data() + r.r0, static_cast<int>(r.n), d.C);
  experts_gate_up(we, xs_.data(), rs, a.g.data(), a.u.data());
  for (const ExpertRows& r : rs)
    be_.swiglu_forward(h + r.r0 * IE, a.g.data() + r.r0 * IE, a.u.data() + r.r0 * IE, static_cast<size_t>(r.n * IE));
  experts_down(we, h, rs, ys_.data());
}

template <typename T>
void LlamaModel<T>::moe_forward(UnitSource<T>& f, const Context& ctx, int l, const T* w, Layer& a, T* h, T* xn) {
  const LlamaDims& d = d_;
  const Offsets& o = moe_off_;
  const T* n2 = ln_.data();
  linear(be_, kMoeFwd, d.BT, d.E, d.C, n2, w + o.router, rl_.data(), false);
  be_.moe_route(a.probs.data(), a.experts.data(), a.wts.data(), rl_.data(), d.BT, d.E, d.K, d.renorm, a.zlse.data());
  moe_sort(a);
  be_.gather_rows(xe_.data(), n2, a.rowtok.data(), d.slots, d.C);
  if (ep_) {
    check_expert_source(f);
    std::vector<int64_t> mine(static_cast<size_t>(d.E));
    for (size_t e = 0; e < mine.size(); ++e) mine[e] = a.eoff[e + 1] - a.eoff[e];
    a.ecnt = ep_->all_gather_counts(mine);
    ep_routes(a);
    h = grow_expert_rows(a, h);
    const size_t rows = static_cast<size_t>(a.nrecv), C = static_cast<size_t>(d.C),
                 me = static_cast<size_t>(ep_->rank());
    const size_t at = ep_recv_at_[me], own = ep_recv_[me];
    // The other ranks' rows travel while this rank's experts gather (their own unit, experts
    // 0 .. El-1) and compute the first half of the rows this rank routed to itself, which never travel.
    std::unique_ptr<ExpertTransfer> go = ep_->start_all_to_all(xe_.data(), ep_send_, xr_.data(), ep_recv_, C);
    const T* we = expert_weights(f, ctx, l, w);
    be_.copy(xr_.data() + at * C, xe_.data() + ep_send_at_[me] * C, own * C);
    ep_experts_forward(we, a, h, ep_own_[0]);
    go->wait();
    ep_experts_forward(we, a, h, ep_other_);
    // The other ranks' results go back (received order: inv_) while the second half of this rank's
    // own rows is computed; those are placed straight into a.ye.
    be_.gather_rows(xr_.data(), ys_.data(), inv_.data(), static_cast<int>(at), d.C);
    be_.gather_rows(xr_.data() + (at + own) * C, ys_.data(), inv_.data() + at + own, static_cast<int>(rows - at - own),
                    d.C);
    std::unique_ptr<ExpertTransfer> back = ep_->start_all_to_all(xr_.data(), ep_recv_, a.ye.data(), ep_send_, C);
    ep_experts_forward(we, a, h, ep_own_[1]);
    be_.gather_rows(a.ye.data() + ep_send_at_[me] * C, ys_.data(), inv_.data() + at, static_cast<int>(own), d.C);
    back->wait();
  } else {
    expert_runs(a.eoff, runs_);
    experts_gate_up(w, xe_.data(), runs_, a.g.data(), a.u.data());
    be_.swiglu_forward(h, a.g.data(), a.u.data(), static_cast<size_t>(d.slots) * d.IE);
    experts_down(w, h, runs_, a.ye.data());
  }
  if (xn) be_.moe_combine(xn, a.x1.data(), a.ye.data(), a.pos.data(), a.wts.data(), d.BT, d.K, d.C);
}

// From d(x_next) (ctx.dres_): d(w), d(ye) (combine backward), the experts' backward (d(h), their
// weight gradients, d(xe)), d(n2) = the slots' d(xe) summed per token (into dln_), and the
// router's: d(z) from d(w) and the load-balancing loss's d(probs), dln_ += d(z) Wr, dWr += d(z)^T n2.
// Under EP: d(ye) to the experts' ranks, the inputs sent again, d(xe) back (model.h).
template <typename T>
void LlamaModel<T>::moe_backward(UnitSource<T>& f, Context& ctx, int l, const T* w, Layer& a, const T* h, T* gw) {
  const LlamaDims& d = d_;
  const Offsets& o = moe_off_;
  be_.moe_combine_backward(dye_.data(), dwts_.data(), ctx.dres_.data(), a.ye.data(), a.pos.data(), a.wts.data(), d.BT,
                           d.K, d.C);
  const T* n2 = nullptr;
  T* dxe = dye_.data();  // d(ye) is spent once the experts' first loop ran: d(xe) takes its place
  if (ep_) {
    check_expert_source(f);
    ep_routes(a);
    const size_t rows = static_cast<size_t>(a.nrecv), C = static_cast<size_t>(d.C),
                 me = static_cast<size_t>(ep_->rank());
    const size_t at = ep_recv_at_[me], own = ep_recv_[me], sat = ep_send_at_[me];
    // d(ye) travels to the experts' ranks while the normalized input is recomputed (bitwise the
    // same values, not kept) and gathered to be sent again, and the experts' unit is gathered
    // (this rank's experts 0 .. El-1; their full gradient is reduce-scattered over the expert
    // shard group once their backward is done).
    std::unique_ptr<ExpertTransfer> go = ep_->start_all_to_all(dye_.data(), ep_send_, xr_.data(), ep_recv_, C);
    be_.copy(xr_.data() + at * C, dye_.data() + sat * C, own * C);
    n2 = norm_rows(a.rstd2.data(), a.x1.data(), w + o.ln2, nullptr);
    be_.gather_rows(xe_.data(), n2, a.rowtok.data(), d.slots, d.C);
    const int eu = ctx.r_.unit(expert_unit_[static_cast<size_t>(l)]);
    const T* we = expert_weights(f, ctx, l, w);
    T* gwe = f.full_grad(eu);
    go->wait();
    be_.gather_rows(ys_.data(), xr_.data(), perm_.data(), static_cast<int>(rows), d.C);
    // The inputs travel while d(h), down_proj's gradient, d(g), d(u) and d(x) are computed.
    go = ep_->start_all_to_all(xe_.data(), ep_send_, xr_.data(), ep_recv_, C);
    be_.copy(xr_.data() + at * C, xe_.data() + sat * C, own * C);
    experts_down_dinput(we, ys_.data(), ep_all_, dh_.data());
    experts_down_dweight(ys_.data(), h, ep_all_, gwe);
    be_.swiglu_backward(dg_.data(), du_.data(), dh_.data(), a.g.data(), a.u.data(), rows * d.IE);
    experts_gate_up_dinput(we, dg_.data(), du_.data(), ep_all_, ys_.data());  // d(ye) is spent
    go->wait();
    be_.gather_rows(xs_.data(), xr_.data(), perm_.data(), static_cast<int>(rows), d.C);
    // d(x) goes back (received order) while gate_up_proj's gradient is computed and its
    // reduce-scatter starts; this rank's own rows go straight into dxe.
    be_.gather_rows(xr_.data(), ys_.data(), inv_.data(), static_cast<int>(rows), d.C);
    std::unique_ptr<ExpertTransfer> back = ep_->start_all_to_all(xr_.data(), ep_recv_, dxe, ep_send_, C);
    be_.copy(dxe + sat * C, xr_.data() + at * C, own * C);
    experts_gate_up_dweight(dg_.data(), du_.data(), xs_.data(), ep_all_, gwe);
    f.reduce_scatter_grad(eu);
    back->wait();
  } else {
    expert_runs(a.eoff, runs_);
    experts_down_dinput(w, dye_.data(), runs_, dh_.data());
    experts_down_dweight(dye_.data(), h, runs_, gw);
    be_.swiglu_backward(dg_.data(), du_.data(), dh_.data(), a.g.data(), a.u.data(), static_cast<size_t>(d.slots) * d.IE);
    // The normalized input is not kept: recomputed (bitwise the same values), and gathered again.
    n2 = norm_rows(a.rstd2.data(), a.x1.data(), w + o.ln2, nullptr);
    be_.gather_rows(xe_.data(), n2, a.rowtok.data(), d.slots, d.C);
    experts_gate_up_dinput(w, dg_.data(), du_.data(), runs_, dxe);
    experts_gate_up_dweight(dg_.data(), du_.data(), xe_.data(), runs_, gw);
  }
  be_.moe_combine(dln_.data(), nullptr, dxe, a.pos.data(), nullptr, d.BT, d.K, d.C);
  const int grp = o_.aux_scope == MoeAuxScope::Sequence ? d.T_ : d.BT;
  const S* aux = ctx.aux_scale_ != S(0) ? ctx.aux_dprob_.data() : nullptr;
  const S* zd = ctx.z_scale_ != S(0) ? ctx.z_dlse_.data() : nullptr;  // the router z-loss's weights per group
  if ((!aux && !zd) || ctx.real_.empty()) {
    be_.moe_route_backward(rl_.data(), a.probs.data(), a.experts.data(), a.wts.data(), dwts_.data(), aux, grp, d.BT,
                           d.E, d.K, d.renorm, a.zlse.data(), zd);
  } else {  // padding gets no load-balancing or z-loss gradient: the runs of real and padding rows apart
    real_runs(ctx, [&](int t0, int t1, int g, bool real) {
      const size_t r = static_cast<size_t>(t0), E = static_cast<size_t>(d.E), K = static_cast<size_t>(d.K);
      be_.moe_route_backward(rl_.data() + r * E, a.probs.data() + r * E, a.experts.data() + r * K, a.wts.data() + r * K,
                             dwts_.data() + r * K, real && aux ? aux + static_cast<size_t>(g) * E : nullptr, t1 - t0,
                             t1 - t0, d.E, d.K, d.renorm, a.zlse.data() + r, real && zd ? zd + g : nullptr);
    });
  }
  linear(be_, kMoeDIn, d.BT, d.E, d.C, rl_.data(), w + o.router, dln_.data(), true);
  linear(be_, kMoeDW, d.BT, d.E, d.C, rl_.data(), n2, gw + o.router, true);
}

// This file's members of LlamaModel, for each storage type (llama.cpp instantiates the class).
#define ST_LLAMA_MOE(T)                                                                         \
  template void LlamaModel<T>::moe_sort(Layer&);                                                \
  template const T* LlamaModel<T>::expert_weights(UnitSource<T>&, const Context&, int, const T*); \
  template void LlamaModel<T>::check_expert_source(const UnitSource<T>&) const;                   \
  template void LlamaModel<T>::moe_forward(UnitSource<T>&, const Context&, int, const T*, Layer&, T*, T*); \
  template void LlamaModel<T>::moe_backward(UnitSource<T>&, Context&, int, const T*, Layer&, const T*, T*); \
  template void LlamaModel<T>::expert_runs(const std::vector<int32_t>&, std::vector<ExpertRows>&);              \
  template void LlamaModel<T>::ep_experts_forward(const T*, Layer&, T*, const std::vector<ExpertRows>&);          \
  template void LlamaModel<T>::experts_gate_up(const T*, const T*, const std::vector<ExpertRows>&, T*, T*);      \
  template void LlamaModel<T>::experts_down(const T*, const T*, const std::vector<ExpertRows>&, T*);             \
  template void LlamaModel<T>::experts_down_dinput(const T*, const T*, const std::vector<ExpertRows>&, T*);      \
  template void LlamaModel<T>::experts_down_dweight(const T*, const T*, const std::vector<ExpertRows>&, T*);     \
  template void LlamaModel<T>::experts_gate_up_dinput(const T*, const T*, const T*, const std::vector<ExpertRows>&, \
                                                      T*);                                                     \
  template void LlamaModel<T>::experts_gate_up_dweight(const T*, const T*, const T*, const std::vector<ExpertRows>&, \
                                                       T*);                                                    \
  template void LlamaModel<T>::ep_routes(Layer&);
ST_LLAMA_MOE(float)
ST_LLAMA_MOE(double)
ST_LLAMA_MOE(bf16)
#undef ST_LLAMA_MOE

}  // namespace shardtrain
