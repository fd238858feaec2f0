// A Backend that forwards to the CPU backend and records every allocation (elements and bytes of
// every kind: T buffers, token ids, accumulator scalars), so tests can check how much memory the
// FSDP engine and the model hold. Shared by the multi-rank tests.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "shardtrain/backend/backend.h"

namespace shardtrain::testing {

// A backend that forwards to the CPU backend and records every allocation, so the tests can
// check how much memory the FSDP engine holds per rank; also every linear_fp8 call, and with
// record_gemms every gemm call (their shapes), so tests can check which GEMMs ran in float8.
template <typename T> class CountingBackend final : public shardtrain::Backend<T> {
 public:
  using S = typename shardtrain::Backend<T>::S;
  CountingBackend() : inner_(shardtrain::make_cpu_backend<T>()) {}
  std::map<const T*, size_t> live;  // pointer -> elements
  size_t allocs = 0, frees = 0;
  // One GEMM call: for gemm, kind -1 and the BLAS arguments; for linear_fp8, kind = the role
  // (0 Forward, 1 InputGrad, 2 WeightGrad) and linear()'s M, N, K (ta, tb false).
  struct Gemm {
    int kind;
    bool ta, tb;
    int M, N, K;
  };
  bool record_gemms = false;      // gemm calls are recorded only when set
  std::vector<Gemm> gemms, fp8s;  // gemm calls (when record_gemms), linear_fp8 calls (always)
  size_t live_elements() const {  // T buffers only
    size_t n = 0;
    for (auto& [p, k] : live) n += k;
    return n;
  }
  size_t live_bytes() const {  // T buffers, ids and accumulator buffers
    size_t n = live_elements() * sizeof(T);
    for (auto& [p, k] : other_) n += k;
    return n;
  }

  const char* name() const override { return "counting-cpu"; }
  shardtrain::ProgressRegistry* progress() override { return inner_->progress(); }  // the kernels that poll it
  T* alloc(size_t n) override {
    T* p = inner_->alloc(n);
    live[p] = n;
    ++allocs;
    return p;
  }
  void free(T* p) override {
    live.erase(p);
    ++frees;
    inner_->free(p);
  }
  void zero(T* p, size_t n) override { inner_->zero(p, n); }
  void copy(T* d, const T* s, size_t n) override { inner_->copy(d, s, n); }
  void to_host(T* h, const T* s, size_t n) override { inner_->to_host(h, s, n); }
  void from_host(T* d, const T* h, size_t n) override { inner_->from_host(d, h, n); }
  int32_t* alloc_ids(size_t n) override {
    int32_t* p = inner_->alloc_ids(n);
    other_[p] = n * sizeof(int32_t);
    return p;
  }
  void free_ids(int32_t* p) override {
    other_.erase(p);
    inner_->free_ids(p);
  }
  void ids_from_host(int32_t* d, const int32_t* h, size_t n) override { inner_->ids_from_host(d, h, n); }
  void ids_to_host(int32_t* h, const int32_t* s, size_t n) override { inner_->ids_to_host(h, s, n); }
  void acc_to_host(S* h, const S* s, size_t n) override { inner_->acc_to_host(h, s, n); }
  void acc_from_host(S* d, const S* h, size_t n) override { inner_->acc_from_host(d, h, n); }
  // Flash attention statistics (S = T here): forwarded, not counted (the FSDP engine holds none).
  S* alloc_acc(size_t n) override {
    S* p = inner_->alloc_acc(n);
    other_[p] = n * sizeof(S);
    return p;
  }
  void free_acc(S* p) override {
    other_.erase(p);
    inner_->free_acc(p);
  }
  void zero_acc(S* p, size_t n) override { inner_->zero_acc(p, n); }
  void synchronize() override { inner_->synchronize(); }
  void from_f32(T* d, const float* s, size_t n) override { inner_->from_f32(d, s, n); }
  void add_to_f32(float* d, float a, const T* s, size_t n) override { inner_->add_to_f32(d, a, s, n); }
  void gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, const T* B, int ldb, S beta, T* C,
            int ldc) override {
    if (record_gemms) gemms.push_back({-1, ta, tb, M, N, K});
    inner_->gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void linear_fp8(shardtrain::math::Fp8Gemm role, int M, int N, int K, const T* a, const T* b, T* out,
                  bool accumulate) override {
    fp8s.push_back({static_cast<int>(role), false, false, M, N, K});
    inner_->linear_fp8(role, M, N, K, a, b, out, accumulate);
  }
  void gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, int64_t sa,
                            const T* B, int ldb, int64_t sb, S beta, T* C, int ldc, int64_t sc, int batch) override {
    inner_->gemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch);
  }
  void axpy(size_t n, S alpha, const T* x, T* y) override { inner_->axpy(n, alpha, x, y); }
  void scale(size_t n, S alpha, T* x) override { inner_->scale(n, alpha, x); }
  double sum_squares(const T* x, size_t n) override { return inner_->sum_squares(x, n); }
  void embedding_forward(T* out, const int32_t* tok, const T* table, int N, int C) override {
    inner_->embedding_forward(out, tok, table, N, C);
  }
  void embedding_backward(T* dtable, const int32_t* tok, const T* dout, int N, int C) override {
    inner_->embedding_backward(dtable, tok, dout, N, C);
  }
  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) override {
    inner_->rmsnorm_forward(out, rstd, x, w, N, C, eps);
  }
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) override {
    inner_->rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C);
  }
  void rope_forward(T* x, const T* c, const T* s, int B, int T_, int H, int HD) override {
    inner_->rope_forward(x, c, s, B, T_, H, HD);
  }
  void rope_backward(T* dx, const T* c, const T* s, int B, int T_, int H, int HD) override {
    inner_->rope_backward(dx, c, s, B, T_, H, HD);
  }
  void softmax_causal_forward(T* att, int R, int T_, S sc) override { inner_->softmax_causal_forward(att, R, T_, sc); }
  void softmax_causal_backward(T* datt, const T* att, int R, int T_, S sc) override {
    inner_->softmax_causal_backward(datt, att, R, T_, sc);
  }
  void rope_forward_at(T* x, const T* c, const T* s, const int32_t* pos, int N, int H, int HD) override {
    inner_->rope_forward_at(x, c, s, pos, N, H, HD);
  }
  void rope_backward_at(T* dx, const T* c, const T* s, const int32_t* pos, int N, int H, int HD) override {
    inner_->rope_backward_at(dx, c, s, pos, N, H, HD);
  }
  void softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S sc) override {
    inner_->softmax_causal_doc_forward(att, doc, B, NH, T_, sc);
  }
  void attention_block_forward(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp, const int32_t* kp,
                               const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                               S sc) override {
    inner_->attention_block_forward(y, lse, q, k, v, qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, sc);
  }
  void attention_merge(T* y, S* lse, const T* yp, const S* lp, int B, int Tq, int NH, int HD) override {
    inner_->attention_merge(y, lse, yp, lp, B, Tq, NH, HD);
  }
  void attention_merge_acc(S* y, S* lse, const T* yp, const S* lp, int B, int Tq, int NH, int HD) override {
    inner_->attention_merge_acc(y, lse, yp, lp, B, Tq, NH, HD);
  }
  void attention_row_dot(S* dsum, const T* dy, const T* y, int B, int Tq, int NH, int HD) override {
    inner_->attention_row_dot(dsum, dy, y, B, Tq, NH, HD);
  }
  void attention_block_backward(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v, const T* y,
                                const S* lse, const S* dsum, const int32_t* qp, const int32_t* kp, const int32_t* qd,
                                const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD, S sc) override {
    inner_->attention_block_backward(dq, dk, dv, dy, q, k, v, y, lse, dsum, qp, kp, qd, kd, B, Tq, Tk, NH, NKV, HD, sc);
  }
  typename shardtrain::Backend<T>::BlockAttentionStats take_block_attention_stats() override {
    return inner_->take_block_attention_stats();
  }
  void flash_attention_forward(T* y, S* lse, const T* q, const T* k, const T* v, int B, int T_, int NH, int NKV,
                               int HD, S sc) override {
    inner_->flash_attention_forward(y, lse, q, k, v, B, T_, NH, NKV, HD, sc);
  }
  void flash_attention_backward(T* dq, T* dk, T* dv, S* dsum, const T* dy, const T* q, const T* k, const T* v,
                                const T* y, const S* lse, int B, int T_, int NH, int NKV, int HD, S sc) override {
    inner_->flash_attention_backward(dq, dk, dv, dsum, dy, q, k, v, y, lse, B, T_, NH, NKV, HD, sc);
  }
  void swiglu_forward(T* h, const T* g, const T* u, size_t n) override { inner_->swiglu_forward(h, g, u, n); }
  void moe_route(S* p, int32_t* x, S* w, const T* z, int N, int E, int k, bool r, S* l) override {
    inner_->moe_route(p, x, w, z, N, E, k, r, l);
  }
  void moe_route_backward(T* dz, const S* p, const int32_t* x, const S* w, const S* dw, const S* a, int g, int N, int E,
                          int k, bool r, const S* l, const S* zd) override {
    inner_->moe_route_backward(dz, p, x, w, dw, a, g, N, E, k, r, l, zd);
  }
  void moe_prob_sums(S* ps, const S* p, int g, int N, int E) override { inner_->moe_prob_sums(ps, p, g, N, E); }
  void moe_z_sums(S* zs, const S* l, int g, int N) override { inner_->moe_z_sums(zs, l, g, N); }
  void gather_rows(T* o, const T* i, const int32_t* x, int n, int C) override { inner_->gather_rows(o, i, x, n, C); }
  void moe_combine(T* o, const T* b, const T* y, const int32_t* p, const S* w, int N, int k, int C) override {
    inner_->moe_combine(o, b, y, p, w, N, k, C);
  }
  void moe_combine_backward(T* dy, S* dw, const T* d, const T* y, const int32_t* p, const S* w, int N, int k,
                            int C) override {
    inner_->moe_combine_backward(dy, dw, d, y, p, w, N, k, C);
  }
  void swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) override {
    inner_->swiglu_backward(dg, du, dh, g, u, n);
  }
  double cross_entropy(T* dl, const T* l, const int32_t* t, int N, int V, S gs) override {
    return inner_->cross_entropy(dl, l, t, N, V, gs);
  }
  void vocab_ce_max(const T* l, int N, int Vl, int valid, S* mx) override { inner_->vocab_ce_max(l, N, Vl, valid, mx); }
  void vocab_ce_sum(const T* l, const int32_t* t, int N, int Vl, int valid, int v0, const S* mx, int G, S* st) override {
    inner_->vocab_ce_sum(l, t, N, Vl, valid, v0, mx, G, st);
  }
  void vocab_ce_finish(T* dl, const T* l, const int32_t* t, int N, int Vl, int valid, int v0, const S* mx, int G,
                       const S* st, S gs) override {
    inner_->vocab_ce_finish(dl, l, t, N, Vl, valid, v0, mx, G, st, gs);
    this->add_loss_sum(inner_->take_loss_sum());
  }
  void adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S gs, int64_t step) override {
    inner_->adamw(p, m, v, g, n, lr, b1, b2, eps, wd, gs, step);
  }

 private:
  std::unique_ptr<shardtrain::Backend<T>> inner_;
  std::map<const void*, size_t> other_;  // ids and accumulator buffers -> bytes
};

}  // namespace shardtrain::testing
