// A stand-in "device" backend for self-checking tests/gpu/test_gpu.cpp on a machine without a GPU
// (SHARDTRAIN_GPU_TESTS_EMULATE=1; see the header of test_gpu.cpp). Not used otherwise.
//
// Memory is host memory (the CPU backend of T). Every kernel widens its operands to double, runs the
// CPU backend in double (exact libm exp, double accumulation) and rounds each output once to T, so it
// differs from the CPU backend of T the way a correct GPU kernel does: other summation orders, no
// intermediate roundings. The GPU tests' tolerances must accept it; everything else they check
// (layouts, aliasing, zeroed masked entries, untouched gaps) holds exactly.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"

namespace shardtrain::gputest {

template <typename T> class EmulatedBackend final : public Backend<T> {
 public:
  using S = typename Backend<T>::S;
  const char* name() const override { return "emulated"; }

  T* alloc(size_t n) override { return mem_->alloc(n); }
  void free(T* p) override { mem_->free(p); }
  void zero(T* p, size_t n) override { mem_->zero(p, n); }
  void copy(T* d, const T* s, size_t n) override { mem_->copy(d, s, n); }
  void to_host(T* h, const T* s, size_t n) override { mem_->to_host(h, s, n); }
  void from_host(T* d, const T* h, size_t n) override { mem_->from_host(d, h, n); }
  int32_t* alloc_ids(size_t n) override { return mem_->alloc_ids(n); }
  void free_ids(int32_t* p) override { mem_->free_ids(p); }
  void ids_from_host(int32_t* d, const int32_t* h, size_t n) override { mem_->ids_from_host(d, h, n); }
  void ids_to_host(int32_t* h, const int32_t* s, size_t n) override { mem_->ids_to_host(h, s, n); }
  void acc_to_host(S* h, const S* s, size_t n) override { mem_->acc_to_host(h, s, n); }
  void acc_from_host(S* d, const S* h, size_t n) override { mem_->acc_from_host(d, h, n); }
  S* alloc_acc(size_t n) override { return mem_->alloc_acc(n); }
  void free_acc(S* p) override { mem_->free_acc(p); }
  void zero_acc(S* p, size_t n) override { mem_->zero_acc(p, n); }
  void synchronize() override {}

  void from_f32(T* d, const float* s, size_t n) override { mem_->from_f32(d, s, n); }
  void add_to_f32(float* d, float alpha, const T* s, size_t n) override {
    for (size_t i = 0; i < n; ++i)
      d[i] = static_cast<float>(static_cast<double>(d[i]) + static_cast<double>(alpha) * wd(s[i]));
  }

  void gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, const T* B, int ldb, S beta, T* C,
            int ldc) override {
    gemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
  }
  void gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, int64_t sa,
                            const T* B, int ldb, int64_t sb, S beta, T* C, int ldc, int64_t sc, int batch) override {
    if (M == 0 || N == 0 || batch <= 0) return;
    const size_t ea = extent(ta ? K : M, ta ? M : K, lda, sa, batch);
    const size_t eb = extent(tb ? N : K, tb ? K : N, ldb, sb, batch);
    const size_t ec = extent(M, N, ldc, sc, batch);
    std::vector<double> a = wide(A, ea), b = wide(B, eb), c = wide(C, ec);
    d_->gemm_strided_batched(ta, tb, M, N, K, alpha, a.data(), lda, sa, b.data(), ldb, sb, beta, c.data(), ldc, sc,
                             batch);
    narrow(C, c);  // elements no matrix covers go back unchanged (T -> double -> T is exact)
  }

  void axpy(size_t n, S alpha, const T* x, T* y) override {
    std::vector<double> xd = wide(x, n), yd = wide(y, n);
    d_->axpy(n, alpha, xd.data(), yd.data());
    narrow(y, yd);
  }
  void scale(size_t n, S alpha, T* x) override {
    std::vector<double> xd = wide(x, n);
    d_->scale(n, alpha, xd.data());
    narrow(x, xd);
  }
  double sum_squares(const T* x, size_t n) override { return d_->sum_squares(wide(x, n).data(), n); }

  void embedding_forward(T* out, const int32_t* tok, const T* table, int N, int C) override {
    mem_->embedding_forward(out, tok, table, N, C);
  }
  void embedding_backward(T* dtable, const int32_t* tok, const T* dout, int N, int C) override {
    if (N <= 0 || C <= 0) return;
    const size_t rows = static_cast<size_t>(*std::max_element(tok, tok + N)) + 1;
    std::vector<double> t = wide(dtable, rows * C), d = wide(dout, static_cast<size_t>(N) * C);
    d_->embedding_backward(t.data(), tok, d.data(), N, C);
    narrow(dtable, t);
  }

  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) override {
    const size_t n = static_cast<size_t>(N) * C;
    std::vector<double> xd = wide(x, n), wdv = wide(w, static_cast<size_t>(C)), o(n), r(static_cast<size_t>(N));
    d_->rmsnorm_forward(o.data(), r.data(), xd.data(), wdv.data(), N, C, eps);
    narrow(out, o);
    narrow(rstd, r);
  }
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) override {
    const size_t n = static_cast<size_t>(N) * C;
    std::vector<double> dxd = wide(dx, n), dwd = wide(dw, static_cast<size_t>(C)), dod = wide(dout, n),
                        xd = wide(x, n), wdv = wide(w, static_cast<size_t>(C)), rd = wide(rstd, static_cast<size_t>(N));
    d_->rmsnorm_backward(dxd.data(), dwd.data(), dod.data(), xd.data(), wdv.data(), rd.data(), N, C);
    narrow(dx, dxd);
    narrow(dw, dwd);
  }

  void rope_forward(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD) override {
    rope(x, cs, sn, B, T_, H, HD, false);
  }
  void rope_backward(T* dx, const T* cs, const T* sn, int B, int T_, int H, int HD) override {
    rope(dx, cs, sn, B, T_, H, HD, true);
  }

  void softmax_causal_forward(T* att, int R, int T_, S scale) override {
    const size_t n = static_cast<size_t>(R) * T_ * T_;
    std::vector<double> a = wide(att, n);
    d_->softmax_causal_forward(a.data(), R, T_, scale);
    narrow(att, a);
  }
  void softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) override {
    const size_t n = static_cast<size_t>(R) * T_ * T_;
    std::vector<double> d = wide(datt, n), a = wide(att, n);
    d_->softmax_causal_backward(d.data(), a.data(), R, T_, scale);
    narrow(datt, d);
  }

  void rope_forward_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD) override {
    rope_at(x, cs, sn, pos, N, H, HD, false);
  }
  void rope_backward_at(T* dx, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD) override {
    rope_at(dx, cs, sn, pos, N, H, HD, true);
  }
  void softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S scale) override {
    const size_t n = static_cast<size_t>(B) * NH * T_ * T_;
    std::vector<double> a = wide(att, n);
    d_->softmax_causal_doc_forward(a.data(), doc, B, NH, T_, scale);
    narrow(att, a);
  }
  void attention_block_forward(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp, const int32_t* kp,
                               const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                               S scale) override {
    const size_t nq = static_cast<size_t>(B) * Tq * NH * HD, nk = static_cast<size_t>(B) * Tk * NKV * HD;
    std::vector<double> yd(nq), lsd(static_cast<size_t>(B) * NH * Tq), qd2 = wide(q, nq), kd2 = wide(k, nk),
        vd = wide(v, nk);
    d_->attention_block_forward(yd.data(), lsd.data(), qd2.data(), kd2.data(), vd.data(), qp, kp, qd, kd, B, Tq, Tk,
                                NH, NKV, HD, scale);
    narrow(y, yd);
    for (size_t i = 0; i < lsd.size(); ++i) lse[i] = static_cast<S>(lsd[i]);
  }
  void attention_merge(T* y, S* lse, const T* yp, const S* lp, int B, int Tq, int NH, int HD) override {
    const size_t n = static_cast<size_t>(B) * Tq * NH * HD, ns = static_cast<size_t>(B) * NH * Tq;
    std::vector<double> yd = wide(y, n), ypd = wide(yp, n), ld(lse, lse + ns), lpd(lp, lp + ns);
    d_->attention_merge(yd.data(), ld.data(), ypd.data(), lpd.data(), B, Tq, NH, HD);
    narrow(y, yd);
    for (size_t i = 0; i < ns; ++i) lse[i] = static_cast<S>(ld[i]);
  }
  void attention_merge_acc(S* y, S* lse, const T* yp, const S* lp, int B, int Tq, int NH, int HD) override {
    const size_t n = static_cast<size_t>(B) * Tq * NH * HD, ns = static_cast<size_t>(B) * NH * Tq;
    std::vector<double> yd(y, y + n), ypd = wide(yp, n), ld(lse, lse + ns), lpd(lp, lp + ns);
    d_->attention_merge(yd.data(), ld.data(), ypd.data(), lpd.data(), B, Tq, NH, HD);
    for (size_t i = 0; i < n; ++i) y[i] = static_cast<S>(yd[i]);
    for (size_t i = 0; i < ns; ++i) lse[i] = static_cast<S>(ld[i]);
  }
  void attention_row_dot(S* dsum, const T* dy, const T* y, int B, int Tq, int NH, int HD) override {
    const size_t n = static_cast<size_t>(B) * Tq * NH * HD, ns = static_cast<size_t>(B) * NH * Tq;
    std::vector<double> s(ns), dyd = wide(dy, n), yd = wide(y, n);
    d_->attention_row_dot(s.data(), dyd.data(), yd.data(), B, Tq, NH, HD);
    for (size_t i = 0; i < ns; ++i) dsum[i] = static_cast<S>(s[i]);
  }
  void attention_block_backward(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v, const T* y,
                                const S* lse, const S* dsum, const int32_t* qp, const int32_t* kp, const int32_t* qd,
                                const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD, S scale) override {
    const size_t nq = static_cast<size_t>(B) * Tq * NH * HD, nk = static_cast<size_t>(B) * Tk * NKV * HD;
    const size_t ns = static_cast<size_t>(B) * NH * Tq;
    std::vector<double> dqd = wide(dq, nq), dkd = wide(dk, nk), dvd = wide(dv, nk), dyd = wide(dy, nq),
                        qd2 = wide(q, nq), kd2 = wide(k, nk), vd = wide(v, nk), lsd(lse, lse + ns),
                        sd(dsum, dsum + ns);
    const std::vector<double> yd = y ? wide(y, nq) : std::vector<double>();
    d_->attention_block_backward(dqd.data(), dkd.data(), dvd.data(), dyd.data(), qd2.data(), kd2.data(), vd.data(),
                                 y ? yd.data() : nullptr, lsd.data(), sd.data(), qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, scale);
    narrow(dq, dqd);
    narrow(dk, dkd);
    narrow(dv, dvd);
  }
  typename Backend<T>::BlockAttentionStats take_block_attention_stats() override {
    const auto s = d_->take_block_attention_stats();  // Backend<double>'s struct: copied field by field
    typename Backend<T>::BlockAttentionStats r;
    r.tile_pairs = s.tile_pairs;
    r.skipped = s.skipped;
    r.cpu_s = s.cpu_s;
    return r;
  }
  void flash_attention_forward(T* y, S* lse, const T* q, const T* k, const T* v, int B, int T_, int NH, int NKV,
                               int HD, S scale) override {
    const size_t nq = static_cast<size_t>(B) * T_ * NH * HD, nk = static_cast<size_t>(B) * T_ * NKV * HD;
    std::vector<double> yd(nq), lsd(static_cast<size_t>(B) * NH * T_), qd = wide(q, nq), kd = wide(k, nk), vd = wide(v, nk);
    d_->flash_attention_forward(yd.data(), lsd.data(), qd.data(), kd.data(), vd.data(), B, T_, NH, NKV, HD, scale);
    narrow(y, yd);
    for (size_t i = 0; i < lsd.size(); ++i) lse[i] = static_cast<S>(lsd[i]);
  }
  void flash_attention_backward(T* dq, T* dk, T* dv, S* dsum, const T* dy, const T* q, const T* k, const T* v,
                                const T* y, const S* lse, int B, int T_, int NH, int NKV, int HD, S scale) override {
    const size_t nq = static_cast<size_t>(B) * T_ * NH * HD, nk = static_cast<size_t>(B) * T_ * NKV * HD;
    const size_t ns = static_cast<size_t>(B) * NH * T_;
    std::vector<double> dqd(nq), dkd(nk), dvd(nk), sd(ns), lsd(lse, lse + ns), dyd = wide(dy, nq), qd = wide(q, nq),
        kd = wide(k, nk), vd = wide(v, nk), yd = wide(y, nq);
    d_->flash_attention_backward(dqd.data(), dkd.data(), dvd.data(), sd.data(), dyd.data(), qd.data(), kd.data(),
                                 vd.data(), yd.data(), lsd.data(), B, T_, NH, NKV, HD, scale);
    narrow(dq, dqd);
    narrow(dk, dkd);
    narrow(dv, dvd);
    for (size_t i = 0; i < ns; ++i) dsum[i] = static_cast<S>(sd[i]);
  }

  void swiglu_forward(T* h, const T* g, const T* u, size_t n) override {
    std::vector<double> hd(n), gd = wide(g, n), ud = wide(u, n);
    d_->swiglu_forward(hd.data(), gd.data(), ud.data(), n);
    narrow(h, hd);
  }
  void swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) override {
    std::vector<double> a(n), b(n), dhd = wide(dh, n), gd = wide(g, n), ud = wide(u, n);
    d_->swiglu_backward(a.data(), b.data(), dhd.data(), gd.data(), ud.data(), n);
    narrow(dg, a);
    narrow(du, b);
  }

  // Mixture of experts: the CPU backend of T (routing and permutations; no GPU test reads them yet).
  void moe_route(S* p, int32_t* x, S* w, const T* z, int N, int E, int k, bool r, S* l) override {
    mem_->moe_route(p, x, w, z, N, E, k, r, l);
  }
  void moe_route_backward(T* dz, const S* p, const int32_t* x, const S* w, const S* dw, const S* a, int g, int N, int E,
                          int k, bool r, const S* l, const S* zd) override {
    mem_->moe_route_backward(dz, p, x, w, dw, a, g, N, E, k, r, l, zd);
  }
  void moe_prob_sums(S* ps, const S* p, int g, int N, int E) override { mem_->moe_prob_sums(ps, p, g, N, E); }
  void moe_z_sums(S* zs, const S* l, int g, int N) override { mem_->moe_z_sums(zs, l, g, N); }
  void gather_rows(T* o, const T* i, const int32_t* x, int n, int C) override { mem_->gather_rows(o, i, x, n, C); }
  void moe_combine(T* o, const T* b, const T* y, const int32_t* p, const S* w, int N, int k, int C) override {
    mem_->moe_combine(o, b, y, p, w, N, k, C);
  }
  void moe_combine_backward(T* dy, S* dw, const T* d, const T* y, const int32_t* p, const S* w, int N, int k,
                            int C) override {
    mem_->moe_combine_backward(dy, dw, d, y, p, w, N, k, C);
  }

  double cross_entropy(T* dlogits, const T* logits, const int32_t* targets, int N, int V, S grad_scale) override {
    const size_t n = static_cast<size_t>(N) * V;
    std::vector<double> l = wide(logits, n), d(dlogits ? n : 0);
    const double loss = d_->cross_entropy(dlogits ? d.data() : nullptr, l.data(), targets, N, V, grad_scale);
    if (dlogits) narrow(dlogits, d);  // logits were read into l first: aliasing is harmless
    return loss;
  }

  void vocab_ce_max(const T* logits, int N, int Vl, int valid, S* mx) override {
    std::vector<double> l = wide(logits, static_cast<size_t>(N) * Vl), m(static_cast<size_t>(N));
    d_->vocab_ce_max(l.data(), N, Vl, valid, m.data());
    for (size_t i = 0; i < m.size(); ++i) mx[i] = static_cast<S>(m[i]);
  }
  void vocab_ce_sum(const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0, const S* maxes, int G,
                    S* st) override {
    std::vector<double> l = wide(logits, static_cast<size_t>(N) * Vl), mx(maxes, maxes + static_cast<size_t>(G) * N),
                        s(2 * static_cast<size_t>(N));
    d_->vocab_ce_sum(l.data(), targets, N, Vl, valid, v0, mx.data(), G, s.data());
    for (size_t i = 0; i < s.size(); ++i) st[i] = static_cast<S>(s[i]);
  }
  void vocab_ce_finish(T* dlogits, const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0,
                       const S* maxes, int G, const S* st, S grad_scale) override {
    const size_t n = static_cast<size_t>(N) * Vl;
    std::vector<double> l = wide(logits, n), d(dlogits ? n : 0), mx(maxes, maxes + static_cast<size_t>(G) * N),
                        s(st, st + 2 * static_cast<size_t>(N));
    d_->vocab_ce_finish(dlogits ? d.data() : nullptr, l.data(), targets, N, Vl, valid, v0, mx.data(), G, s.data(),
                        grad_scale);
    if (dlogits) narrow(dlogits, d);
    this->add_loss_sum(d_->take_loss_sum());
  }

  void adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wdecay, S grad_scale,
             int64_t step) override {
    std::vector<double> pd = wide(p, n), md = wide(m, n), vd = wide(v, n), gd = wide(g, n);
    d_->adamw(pd.data(), md.data(), vd.data(), gd.data(), n, lr, b1, b2, eps, wdecay, grad_scale, step);
    narrow(p, pd);
    narrow(m, md);
    narrow(v, vd);
  }

 private:
  std::unique_ptr<Backend<T>> mem_ = make_cpu_backend<T>();
  std::unique_ptr<Backend<double>> d_ = make_cpu_backend<double>();

  static double wd(T x) { return static_cast<double>(math::ld(x)); }
  static std::vector<double> wide(const T* p, size_t n) {
    std::vector<double> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = wd(p[i]);
    return v;
  }
  static void narrow(T* p, const std::vector<double>& v) {
    for (size_t i = 0; i < v.size(); ++i) p[i] = math::st<T>(static_cast<S>(v[i]));
  }
  // Elements spanned by `batch` row-major rows x cols matrices with row stride ld, matrix stride s.
  static size_t extent(int rows, int cols, int ld, int64_t s, int batch) {
    if (rows <= 0 || cols <= 0) return 0;
    return static_cast<size_t>(batch - 1) * static_cast<size_t>(s) + static_cast<size_t>(rows - 1) * ld +
           static_cast<size_t>(cols);
  }
  void rope_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward) {
    const size_t n = static_cast<size_t>(N) * H * HD;
    int P = 0;
    for (int i = 0; i < N; ++i) P = std::max(P, pos[i] + 1);
    const size_t nt = static_cast<size_t>(P) * (HD / 2);
    std::vector<double> xd = wide(x, n), c = wide(cs, nt), s = wide(sn, nt);
    if (backward) d_->rope_backward_at(xd.data(), c.data(), s.data(), pos, N, H, HD);
    else d_->rope_forward_at(xd.data(), c.data(), s.data(), pos, N, H, HD);
    narrow(x, xd);
  }
  void rope(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward) {
    const size_t n = static_cast<size_t>(B) * T_ * H * HD, nt = static_cast<size_t>(T_) * (HD / 2);
    std::vector<double> xd = wide(x, n), c = wide(cs, nt), s = wide(sn, nt);
    if (backward) d_->rope_backward(xd.data(), c.data(), s.data(), B, T_, H, HD);
    else d_->rope_forward(xd.data(), c.data(), s.data(), B, T_, H, HD);
    narrow(x, xd);
  }
};

}  // namespace shardtrain::gputest
