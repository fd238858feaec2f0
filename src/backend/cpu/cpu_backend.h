// The CPU backend's class, private to src/backend/cpu/: CpuBackend<T> declared once here, its
// methods defined by operation in the files of this folder (the counterparts of src/backend/cuda/'s):
//   cpu_backend.cpp  construction (thread setup), buffers (alloc, zero, copies), make_cpu_backend
//   gemm.cpp         GEMMs (tiled OpenBLAS calls; bf16 widened to float), from_f32, add_to_f32
//   attention.cpp    exact causal softmax, flash attention, block attention at global positions
//   norm.cpp         RMSNorm
//   rope.cpp         rotary embeddings
//   swiglu.cpp       SwiGLU
//   moe.cpp          mixture-of-experts routing, dispatch (gather) and combine
//   loss.cpp         cross-entropy, vocabulary-parallel cross-entropy
//   embedding.cpp    token embedding
//   optimizer.cpp    AdamW, axpy, scale, sum of squares (gradient norm)
// plus the work-splitting helpers every file uses. The per-element math comes from
// include/shardtrain/backend/ops_math.h (attention's from flash_attention.h), shared with the CUDA
// kernels. Loops are written so the compiler can vectorize them; reductions accumulate in double
// where a long sum would otherwise lose precision.
//
// Threads inside a rank (OpenMP, count set by set_cpu_threads). Every kernel splits its work into
// pieces whose boundaries depend only on the shapes, never on the thread count, and every sum is
// taken in one fixed order, so results are bitwise the same with 1, 2 or 64 threads:
//  - GEMM: C is cut into fixed tiles (gemm_tiles), each computed by one single-threaded sgemm call
//    (PyTorch's intra-op parallelism does the same with its own kernels); batched GEMMs run whole
//    batch entries side by side. OpenBLAS itself runs single-threaded.
//  - Row-wise kernels (RMSNorm, softmax, cross-entropy, RoPE, embedding) split rows; elementwise
//    kernels split ranges. Column sums (RMSNorm's dw, the embedding gradient) split columns and sum
//    the rows of each column in order; sum_squares and the loss add fixed-size partials in order.
//  - Flash attention (flash_attention.h): independent work items, (b, h, query tile) for the
//    forward and the dQ pass, (b, kv head, key tile) for the dK/dV pass, each computed by one
//    thread with single-threaded GEMMs on its tiles in a fixed order. Block attention at global
//    positions: the same items over the key (query) tiles of the block, masked tile pairs skipped;
//    thread 0 (the calling thread) polls the progress hook between its tiles.
//
// Each file ends with the explicit instantiations of the virtual methods it defines, for T = float,
// double and bf16 (cpu_backend.cpp, which constructs the class, instantiates the class itself); a
// method missing there is a link error.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/flash_attention.h"
#include "shardtrain/backend/ops_math.h"

namespace shardtrain::cpu {

// Work below this many elements (or multiply-adds for GEMM tiles) runs on the calling thread: an
// OpenMP fork/join costs about a microsecond, as much as a few thousand flops.
constexpr size_t kGrain = 16384;

// Runs fn(begin, end) over [0, n) in pieces of `grain` on the rank's threads, or once on the calling
// thread when there is a single piece or a single thread. Only for work whose result does not
// depend on how [0, n) is cut (each index written by exactly one piece).
template <typename F> void par_ranges(size_t n, size_t grain, F&& fn) {
  if (n == 0) return;
  const size_t pieces = (n + grain - 1) / grain;
  if (pieces <= 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    fn(size_t(0), n);
    return;
  }
#pragma omp parallel for schedule(static)
  for (size_t p = 0; p < pieces; ++p) fn(p * grain, std::min(n, (p + 1) * grain));
}

// Runs fn(i) for every i in [0, n) on the rank's threads, one item at a time (dynamic schedule: items
// may differ in cost). Only for items that write disjoint outputs.
template <typename F> void par_items(size_t n, F&& fn) {
  if (n == 0) return;
  if (n == 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < n; ++i) fn(i);
}

// par_items, with poll() on the calling thread after each item it runs (the master thread of the
// region; the calling thread itself when the items run serially) and, in a region, once more when
// the master ran out of items (it may run none under the dynamic schedule) while the others may
// still work: the progress registry between attention tiles. Items are distributed as par_items
// does and write disjoint outputs, so the results do not change.
template <typename F, typename P> void par_items_polled(size_t n, F&& fn, P&& poll) {
  if (n == 0) return;
  if (n == 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    for (size_t i = 0; i < n; ++i) {
      fn(i);
      poll();
    }
    return;
  }
#pragma omp parallel
  {
    const bool master = omp_get_thread_num() == 0;
#pragma omp for schedule(dynamic, 1) nowait
    for (size_t i = 0; i < n; ++i) {
      fn(i);
      if (master) poll();
    }
    if (master) poll();
  }
}

// Grain (in rows) so that a piece of rows of `row_cost` elements each is about kGrain elements.
inline size_t row_grain(size_t row_cost) { return std::max<size_t>(1, kGrain / std::max<size_t>(1, row_cost)); }

// Every kernel loads stored elements with math::ld into the arithmetic type A (float for bf16),
// computes in A and stores once with math::st<T>. For float and double both are the identity, so
// those loops compile to what they would be without the indirection.
template <typename T> class CpuBackend final : public Backend<T> {
 public:
  using S = typename Backend<T>::S;
  using A = math::Acc<T>;
  CpuBackend();
  const char* name() const override { return "cpu"; }
  bool host_kernels() const override { return true; }
  ProgressRegistry* progress() override { return &progress_; }

  // ---- cpu_backend.cpp: buffers ----
  T* alloc(size_t n) override;
  void free(T* p) override;
  void zero(T* p, size_t n) override;
  void copy(T* d, const T* s, size_t n) override;
  void to_host(T* h, const T* s, size_t n) override;
  void from_host(T* d, const T* h, size_t n) override;
  int32_t* alloc_ids(size_t n) override;
  void free_ids(int32_t* p) override;
  void ids_from_host(int32_t* d, const int32_t* h, size_t n) override;
  void ids_to_host(int32_t* h, const int32_t* s, size_t n) override;  // moe.cpp
  void acc_to_host(S* h, const S* s, size_t n) override;              // moe.cpp
  void acc_from_host(S* d, const S* h, size_t n) override;            // moe.cpp
  S* alloc_acc(size_t n) override;
  void free_acc(S* p) override;
  void copy_2d(T* d, size_t ldd, const T* s, size_t lds, size_t rows, size_t cols) override;
  void zero_acc(S* p, size_t n) override;
  void synchronize() override {}

  // ---- gemm.cpp ----
  void from_f32(T* d, const float* s, size_t n) override;
  void add_to_f32(float* d, float alpha, const T* s, size_t n) override;
  void gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb, S beta,
            T* C, int ldc) override;
  void gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, int64_t sa,
                            const T* B, int ldb, int64_t sb, S beta, T* C, int ldc, int64_t sc, int batch) override;
  // fp8_linear_emulated (fp8.h) for float and bf16 storage; std::logic_error for double (the
  // emulation widens to float: a double run has nothing to compare it with).
  void linear_fp8(math::Fp8Gemm role, int M, int N, int K, const T* a, const T* b, T* out, bool accumulate) override;

  // ---- optimizer.cpp ----
  void axpy(size_t n, S alpha, const T* x, T* y) override;
  void scale(size_t n, S alpha, T* x) override;
  double sum_squares(const T* x, size_t n) override;
  void adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S gs, int64_t step) override;

  // ---- embedding.cpp ----
  void embedding_forward(T* out, const int32_t* tok, const T* table, int N, int C) override;
  void embedding_backward(T* dtable, const int32_t* tok, const T* dout, int N, int C) override;

  // ---- norm.cpp ----
  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) override;
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) override;

  // ---- rope.cpp ----
  void rope_forward(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD) override;
  void rope_backward(T* dx, const T* cs, const T* sn, int B, int T_, int H, int HD) override;
  void rope_forward_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD) override;
  void rope_backward_at(T* dx, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD) override;

  // ---- attention.cpp ----
  void softmax_causal_forward(T* att, int R, int T_, S scale) override;
  void softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S scale) override;
  void softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) override;
  void flash_attention_forward(T* y, S* lse, const T* q, const T* k, const T* v, int B, int T_, int NH, int NKV,
                               int HD, S scale) override;
  void flash_attention_backward(T* dq, T* dk, T* dv, S* dsum, const T* dy, const T* q, const T* k, const T* v,
                                const T* y, const S* lse, int B, int T_, int NH, int NKV, int HD, S scale) override;
  void attention_block_forward(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp, const int32_t* kp,
                               const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                               S scale) override;
  void attention_merge(T* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) override;
  void attention_merge_acc(S* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD) override;
  void attention_row_dot(S* dsum, const T* dy, const T* y, int B, int Tq, int NH, int HD) override;
  void attention_block_backward(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v, const T* y,
                                const S* lse, const S* dsum, const int32_t* qp, const int32_t* kp, const int32_t* qd,
                                const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD, S scale) override;
  typename Backend<T>::BlockAttentionStats take_block_attention_stats() override;

  // ---- swiglu.cpp ----
  void swiglu_forward(T* h, const T* g, const T* u, size_t n) override;
  void swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n) override;

  // ---- moe.cpp ----
  void moe_route(S* probs, int32_t* experts, S* weights, const T* logits, int N, int E, int k, bool renorm,
                 S* lse) override;
  void moe_route_backward(T* dlogits, const S* probs, const int32_t* experts, const S* weights, const S* dweights,
                          const S* aux_dprob, int group_rows, int N, int E, int k, bool renorm, const S* lse,
                          const S* z_dlse) override;
  void moe_prob_sums(S* psum, const S* probs, int group_rows, int N, int E) override;
  void moe_z_sums(S* zsum, const S* lse, int group_rows, int N) override;
  void gather_rows(T* out, const T* in, const int32_t* idx, int n, int C) override;
  void moe_combine(T* out, const T* base, const T* ye, const int32_t* pos, const S* w, int N, int k, int C) override;
  void moe_combine_backward(T* dye, S* dw, const T* dout, const T* ye, const int32_t* pos, const S* w, int N, int k,
                            int C) override;

  // ---- loss.cpp ----
  double cross_entropy(T* dlogits, const T* logits, const int32_t* tgt, int N, int V, S grad_scale) override;
  void vocab_ce_max(const T* logits, int N, int Vl, int valid, S* mx) override;
  void vocab_ce_sum(const T* logits, const int32_t* tgt, int N, int Vl, int valid, int v0, const S* maxes, int G,
                    S* st) override;
  void vocab_ce_finish(T* dlogits, const T* logits, const int32_t* tgt, int N, int Vl, int valid, int v0,
                       const S* maxes, int G, const S* st, S grad_scale) override;

 private:
  // progress()'s registry. poll_progress() is the one call kernels make between their tiles: on
  // the calling thread outside a parallel region, on the master thread (the calling thread) inside
  // one, nowhere else (the registry also ignores any thread but its members' one).
  ProgressRegistry progress_;
  int64_t block_pairs_ = 0, block_skipped_ = 0;  // take_block_attention_stats
  double block_cpu_s_ = 0;
  void poll_progress() {
    if (progress_.size() == 0) return;
    if (omp_in_parallel() && omp_get_thread_num() != 0) return;
    progress_.poll();
  }

  std::vector<A> row_;     // bf16 embedding_backward: one row summed in float
  std::vector<double> part_;  // sum_squares / cross_entropy partial sums, added in order
  std::vector<int> order_; // bf16 embedding_backward: positions grouped by token
  std::vector<float> fa_, fb_, fc_;  // bf16 GEMM operands widened to float

  // Columns per piece for a column-parallel sum over N rows of C columns: ~kGrain elements, at
  // least 16 columns (one cache line of floats, so pieces never share a line).
  static size_t col_grain(int N) {
    return std::max<size_t>(16, kGrain / std::max<size_t>(1, static_cast<size_t>(N)));
  }

  // ---- cpu_backend.cpp ----
  static void* aligned_zeroed(size_t bytes);  // 64-byte aligned, zeroed; freed by aligned_free
  static void aligned_free(void* p);

  // ---- gemm.cpp ----
  static void gemm1(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb, S beta,
                    T* C, int ldc);
  static constexpr int kWiden = 512;  // gemm_bf16's block side
  void gemm_bf16(bool ta, bool tb, int M, int N, int K, S alpha, const T* Am, int lda, const T* B, int ldb, S beta,
                 T* C, int ldc);
  static void widen(std::vector<float>& dst, const T* src, int rows, int cols, int ld);

  // ---- rope.cpp ----
  template <typename RowPos>
  static void rope_rows(T* x, const T* cs, const T* sn, size_t N, RowPos&& row_pos, int H, int HD, bool backward);
  static void rope_apply_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward);
  static void rope_apply(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward);

  // ---- attention.cpp (the types are defined there) ----
  struct FlashScratch;
  struct QueryTile;
  struct KeyTile;
  struct PosTile;
  template <typename Y> void merge_rows(Y* y, S* lse, const T* yp, const S* lsep, int B, int Tq, int NH, int HD);
  static FlashScratch& flash_scratch();
  static const S* tile_s(const T* src, int ld, int rows, int HD, std::vector<S>& buf, int* ld_out);
  static QueryTile query_tile(FlashScratch& w, const T* q, const T* dy, int b, int h, int T_, int NH, int HD, int r0,
                              int nr);
  static void start_query_tile(FlashScratch& w, int nr, int HD, bool backward);
  static KeyTile key_tile(FlashScratch& w, const T* k, const T* v, size_t ko, int ldk, int nc, int HD);
  static KeyTile start_key_tile(FlashScratch& w, const T* k, const T* v, size_t ko, int ldk, int nc, int HD);
  template <typename RowVis>
  static void forward_pair(FlashScratch& w, const S* Q, int lQ, const KeyTile& kt, int nr, int nc, int HD, S scale,
                           RowVis&& row_vis);
  template <typename PDs>
  static void backward_pair(FlashScratch& w, const QueryTile& qt, const KeyTile& kt, int nr, int nc, int HD, bool dq,
                            PDs&& p_ds);
  static PosTile pos_tile(const int32_t* pos, const int32_t* doc, int b, int T_, int t0, int n);
  static auto block_row_vis(const PosTile& qt, const PosTile& kt);
  template <typename F>
  int64_t walk_unmasked_tiles(const int32_t* pos, const int32_t* doc, int b, int T_, int tile,
                              const flash::TileRange& other, bool keys, F&& f);
  template <typename Pair, typename Done>
  void block_query_pass(const T* q, const T* dy, const T* k, const T* v, const int32_t* qp, const int32_t* kp,
                        const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                        Pair&& pair, Done&& done);
  static void finish_query_tile(const FlashScratch& w, T* y, S* lse, int b, int h, int T_, int NH, int HD, int r0,
                                int nr, bool block);
  static void store_tile(T* dst, int ld, int rows, int HD, const S* src);
  static void gemm_s(bool ta, bool tb, int M, int N, int K, S alpha, const S* Am, int lda, const S* B, int ldb,
                     S beta, S* C, int ldc);
};

}  // namespace shardtrain::cpu
