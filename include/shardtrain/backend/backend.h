// shardtrain backend layer: the primitives the model, optimizer and sharding code are written in.
// A BLAS-shaped GEMM (explicit transposes and leading dimensions) plus elementwise and reduction
// kernels. CpuBackend = OpenBLAS + loops; CudaBackend (include/shardtrain/backend/cuda.h) maps 1:1 to
// cuBLAS + CUDA kernels. Both instantiate for T = float (fp32 training and master weights) and
// T = bf16 (mixed-precision compute: bf16 storage, fp32 arithmetic and GEMM accumulation); the CPU
// backend also for T = double (gradient checks).
//
// Conventions for every call:
//  - Matrices are row-major. A "[N, C]" buffer holds N rows of C contiguous elements.
//  - B = batch (sequences), T = time (sequence length), C = channels (hidden size), V = vocabulary,
//    NH = query heads, NKV = key/value heads, HD = head dimension. "BT" = B*T rows.
//  - Pointers are device pointers of the backend (host memory for CpuBackend).
//  - Gradients of parameters are accumulated (+=); gradients of activations are written (=),
//    except where a comment says "+=" (the residual stream), as in llm.c.
//  - Scalars (alpha, beta, eps, learning rate, ...) are passed as S = math::Acc<T>: float for
//    float and bf16 storage, double for double. Arithmetic happens in S; bf16 is only stored.
//  - Calls are ordered: each call sees the results of the previous ones. A device backend may run
//    them asynchronously on its stream; calls that return a value to the host (sum_squares,
//    cross_entropy, to_host) wait for the queued work first. to_host_async alone runs on a stream
//    of its own (ordered after the calls before it), until wait_host_copies.
//  - Nothing throws except allocation (std::bad_alloc) and device failures (std::runtime_error
//    naming the CUDA/cuBLAS call); shape errors are the caller's bug.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/fp8_math.h"  // math::Fp8Gemm
#include "shardtrain/backend/ops_math.h"  // kNoTarget
#include "shardtrain/runtime/progress.h"

namespace shardtrain {

template <typename T> class Backend {
 public:
  using S = math::Acc<T>;  // scalar (and arithmetic) type of this backend
  virtual ~Backend() = default;
  virtual const char* name() const = 0;  // for messages only; ask host_kernels() what it is
  // True when the kernels run on this process's CPU threads (CpuBackend): the layers above install
  // the CPU's thread setup (FTZ/DAZ, one OpenMP thread) on their helper threads and measure host
  // memory. False for device backends (and test wrappers).
  virtual bool host_kernels() const { return false; }
  // Host kernels: the progress registry (progress.h) whose members the backend polls on the calling
  // thread while kernels run: after every GEMM (after each tile when the tiles run serially) and
  // between the work items of flash attention forward and backward (on the OpenMP master thread,
  // i.e. the calling thread). Clients that need host progress (Open MPI advances nonblocking
  // transfers only inside MPI calls: FSDP's `--comm-progress poll` queues, a context-parallel ring,
  // pipeline transfers) join it for as long as they have transfers in flight. nullptr (the
  // default): a device backend, whose transfers need no host progress. Polling changes no result.
  virtual ProgressRegistry* progress() { return nullptr; }

  // ---- memory -------------------------------------------------------------------------------
  virtual T* alloc(size_t n) = 0;  // n elements, zero-initialized; throws std::bad_alloc
  virtual void free(T* p) = 0;
  virtual void zero(T* p, size_t n) = 0;
  virtual void copy(T* dst, const T* src, size_t n) = 0;  // device to device
  // Device to device, 2-D: rows x cols elements, row i from src + i * ld_src to dst + i * ld_dst
  // (ld >= cols; the regions must not overlap): a column slice of a row-major matrix packed or
  // unpacked (context parallelism's per-KV-head chunks). Default: one copy() per row.
  virtual void copy_2d(T* dst, size_t ld_dst, const T* src, size_t ld_src, size_t rows, size_t cols) {
    for (size_t i = 0; i < rows; ++i) copy(dst + i * ld_dst, src + i * ld_src, cols);
  }
  virtual void to_host(T* host, const T* src, size_t n) = 0;
  virtual void from_host(T* dst, const T* host, size_t n) = 0;
  // Token ids (int32) in the backend's memory, for embedding and cross_entropy.
  virtual int32_t* alloc_ids(size_t n) = 0;  // zero-initialized; throws std::bad_alloc
  virtual void free_ids(int32_t* p) = 0;
  virtual void ids_from_host(int32_t* dst, const int32_t* host, size_t n) = 0;
  // Backend ids to the host (waits for the queued calls first; the MoE routing's expert choice).
  virtual void ids_to_host(int32_t* host, const int32_t* src, size_t n) = 0;
  // n scalars of type S (float for float and bf16, double for double) in the backend's memory,
  // zero-initialized, for the flash attention statistics (lse, dsum); throws std::bad_alloc.
  virtual S* alloc_acc(size_t n) = 0;
  virtual void free_acc(S* p) = 0;
  virtual void zero_acc(S* p, size_t n) = 0;  // n scalars of S set to 0
  // n scalars of S to / from the host (waiting as to_host / from_host do).
  virtual void acc_to_host(S* host, const S* src, size_t n) = 0;
  virtual void acc_from_host(S* dst, const S* host, size_t n) = 0;
  // Waits until every queued call has finished (no-op on the CPU).
  virtual void synchronize() = 0;

  // ---- staging to the host (checkpoint snapshots) ---------------------------------------------
  // `bytes` of host memory that to_host_async copies into fastest: page-locked ("pinned",
  // cudaHostAlloc) on a GPU, so that the copy is a DMA of the copy engine that blocks no stream but
  // its own; plain host memory (64-byte aligned) on the CPU. Contents unspecified (not zeroed).
  // Expensive on a GPU (the pages are locked): allocate once and reuse. Throws std::bad_alloc.
  // The default is the CPU's: malloc'ed memory.
  virtual void* alloc_pinned_host(size_t bytes) {
    void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return p;
  }
  // Frees memory of alloc_pinned_host (nullptr: nothing), after the copies into it have finished.
  // Never throws.
  virtual void free_pinned_host(void* p) noexcept { std::free(p); }
  // Copies n elements of backend memory `src` to host memory `host` (alloc_pinned_host's, or any
  // host memory): the copy sees the results of every call queued before it and delays none queued
  // after it. On a GPU it is queued on a copy stream of the backend's own, after an event recorded
  // on the compute stream, and may still run on return: `host` must not be read, nor `src`
  // written, before wait_host_copies() returns. Default (the CPU): to_host, done on return.
  virtual void to_host_async(T* host, const T* src, size_t n) { to_host(host, src, n); }
  // Waits until every to_host_async so far has finished (the host's wait for the copy stream
  // alone; the compute stream runs on). No-op on the CPU (the default).
  virtual void wait_host_copies() {}

  // ---- precision conversion (mixed precision: fp32 master shards <-> compute type T) ---------
  // dst[i] = T(src[i]), rounding to nearest even for bf16. n elements; src is fp32 memory of the
  // same device (a Backend<float> of the same device allocated it).
  virtual void from_f32(T* dst, const float* src, size_t n) = 0;
  // dst[i] += alpha * float(src[i]), in float. dst is fp32 memory of the same device.
  virtual void add_to_f32(float* dst, float alpha, const T* src, size_t n) = 0;

  // ---- GEMM ---------------------------------------------------------------------------------
  // C[M,N] = alpha * op(A) op(B) + beta * C, row-major, op(X) = X or X^T. op(A) is [M,K], op(B) is
  // [K,N]. lda/ldb/ldc are row strides in elements of A, B, C as stored (BLAS semantics, row-major).
  virtual void gemm(bool trans_a, bool trans_b, int M, int N, int K, S alpha, const T* A, int lda, const T* B,
                    int ldb, S beta, T* C, int ldc) = 0;
  // `batch` independent GEMMs; matrix i uses A + i*stride_a, B + i*stride_b, C + i*stride_c
  // (strides in elements; 0 reuses one matrix, as for GQA's shared key/value heads).
  // Same semantics as cublasSgemmStridedBatched.
  virtual void gemm_strided_batched(bool trans_a, bool trans_b, int M, int N, int K, S alpha, const T* A, int lda,
                                    int64_t stride_a, const T* B, int ldb, int64_t stride_b, S beta, T* C, int ldc,
                                    int64_t stride_c, int batch) = 0;

  // A linear layer's GEMM in float8 (issue 57 item 3, `--precision fp8`): the product `role` of
  // y = x W^T, W [N, K] row-major, over M rows, with the shapes and layouts of model.h's linear()
  // (row-major, leading dimension = row width, pointers are this backend's memory, out aliases
  // neither operand):
  //   Forward:    out[M, N]  (+)=  a[M, K] · b[N, K]^T     a = x  (E4M3), b = W (E4M3)
  //   InputGrad:  out[M, K]  (+)=  a[M, N] · b[N, K]       a = dy (E5M2), b = W (E4M3)
  //   WeightGrad: out[N, K]  (+)=  a[M, N]^T · b[M, K]     a = dy (E5M2), b = x (E4M3)
  // Each operand is quantized with its own dynamic per-tensor scale (fp8_math.h: amax over the
  // whole operand, scale = fp8_max / max(amax, 1e-12), saturating round-to-nearest-even cast), the
  // quantized operands multiplied with fp32 accumulation, the result times (1/scale_a)(1/scale_b),
  // then written (accumulate false: out is not read) or added to out (accumulate true), rounded to
  // T once. The CPU backend emulates it (fp8.h fp8_linear_emulated, float and bf16; the reference);
  // the CUDA backend runs cuBLASLt's FP8 GEMMs (src/backend/cuda/fp8.cu; needs compute capability
  // >= 8.9, else std::runtime_error). This default throws std::logic_error naming the backend, so
  // that no backend silently runs an fp8 request unquantized.
  virtual void linear_fp8(math::Fp8Gemm role, int M, int N, int K, const T* a, const T* b, T* out, bool accumulate) {
    (void)role, (void)M, (void)N, (void)K, (void)a, (void)b, (void)out, (void)accumulate;
    throw std::logic_error(std::string("the ") + name() + " backend has no float8 linear GEMM (linear_fp8)");
  }

  // ---- elementwise / reductions -------------------------------------------------------------
  // y += alpha * x, n elements.
  virtual void axpy(size_t n, S alpha, const T* x, T* y) = 0;
  // x *= alpha, n elements.
  virtual void scale(size_t n, S alpha, T* x) = 0;
  // Sum of squares of x (n elements), accumulated in double.
  virtual double sum_squares(const T* x, size_t n) = 0;
  // Sums of squares of k arrays (x[i], n[i] elements; k >= 0), each as sum_squares computes it,
  // added on the host in order i = 0..k-1: the same double as that loop, bitwise. One wait for the
  // device (the gradient norm's one host synchronisation per step) where sum_squares needs one per
  // array. Default: the loop.
  virtual double sum_squares_many(const T* const* x, const size_t* n, size_t k) {
    double s = 0;
    for (size_t i = 0; i < k; ++i) s += sum_squares(x[i], n[i]);
    return s;
  }

  // Embedding lookup: out[i, :] = table[tokens[i], :], out [N, C], table [V, C], tokens [N] ids in
  // the backend's memory (alloc_ids). A negative id gives a zero row (the vocabulary-parallel
  // embedding: a token of another rank's rows).
  virtual void embedding_forward(T* out, const int32_t* tokens, const T* table, int N, int C) = 0;
  // dtable[tokens[i], :] += dout[i, :]; rows of negative ids are skipped.
  virtual void embedding_backward(T* dtable, const int32_t* tokens, const T* dout, int N, int C) = 0;

  // RMSNorm (Zhang & Sennrich 2019): out[i,:] = x[i,:] * rstd[i] * w, rstd[i] = 1/sqrt(mean(x^2)+eps).
  // x, out [N, C]; w [C]; rstd [N] (saved for backward).
  virtual void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) = 0;
  // dx += ..., dw += ...; dout [N, C].
  virtual void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N,
                                int C) = 0;

  // RoPE in place on x [B*T, H, HD] (row stride H*HD), position of row b*T+t is t.
  // cos/sin tables are [T, HD/2] (see rope_tables). Rotate-half pairing: j with j + HD/2.
  virtual void rope_forward(T* x, const T* cos, const T* sin, int B, int T_, int H, int HD) = 0;
  // In place: turns d(rotated x) into d(x).
  virtual void rope_backward(T* dx, const T* cos, const T* sin, int B, int T_, int H, int HD) = 0;

  // RoPE at per-token positions: row i of x [N, H, HD] (row stride H*HD) is rotated by the table
  // row pos[i] (pos [N] int32, backend memory; 0 <= pos[i] < rows of the tables): cos/sin
  // [P, HD/2] as rope_tables. A sequence's slice, a head-tail pair of chunks or positions that
  // restart per document: each row is bitwise the row of the whole-sequence rope_forward at that
  // position (a gather of the same table entries, the same per-pair math).
  virtual void rope_forward_at(T* x, const T* cos, const T* sin, const int32_t* pos, int N, int H, int HD) = 0;
  // In place: turns d(rotated x) into d(x), rows as rope_forward_at.
  virtual void rope_backward_at(T* dx, const T* cos, const T* sin, const int32_t* pos, int N, int H, int HD) = 0;

  // RoPE on the queries q [B*T, Hq, HD] and the keys k [B*T, Hk, HD] of the same rows in one call:
  // each exactly (bitwise) as rope_forward / rope_backward (pos == nullptr) or rope_forward_at /
  // rope_backward_at (pos [B*T], backend memory) on it. The default makes those two calls; the CUDA
  // backend rotates both in one launch.
  virtual void rope_qk(T* q, int Hq, T* k, int Hk, const T* cos, const T* sin, const int32_t* pos, int B, int T_,
                       int HD, bool backward) {
    for (auto [x, H] : {std::pair<T*, int>{q, Hq}, std::pair<T*, int>{k, Hk}}) {
      if (pos && backward) rope_backward_at(x, cos, sin, pos, B * T_, H, HD);
      else if (pos) rope_forward_at(x, cos, sin, pos, B * T_, H, HD);
      else if (backward) rope_backward(x, cos, sin, B, T_, H, HD);
      else rope_forward(x, cos, sin, B, T_, H, HD);
    }
  }

  // Causal softmax in place over `rows` = R*T_ rows of length T_ (R score matrices [T_, T_]):
  // att[t, s] = softmax_s(scale * att[t, s]) over s <= t; att[t, s] = 0 for s > t.
  virtual void softmax_causal_forward(T* att, int R, int T_, S scale) = 0;
  // datt (in: d softmax output; out: d pre-scale scores * scale), att = softmax output.
  virtual void softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) = 0;

  // Tiled causal self-attention with GQA, never storing the [T, T] probabilities: the
  // FlashAttention-2 algorithm (Dao 2023), loop structure and per-row math in
  // include/shardtrain/backend/flash_attention.h (tiles of flash::kBr query x flash::kBc key rows).
  // q, y [B*T, NH*HD] (row stride NH*HD); k, v [B*T, NKV*HD]; query head h reads key/value head
  // h / (NH/NKV) (NH a multiple of NKV; NKV = 1 is MQA). Causal: query t sees keys s <= t.
  // scale multiplies the scores q.k (1/sqrt(HD) in the model). Arithmetic in S.
  // Writes y (=) and lse [B, NH, T] = log sum_s exp(scale * q_t.k_s), the per-row log-sum-exp of
  // the scaled scores (kept for the backward). Same result as attention_forward
  // (llama_attention.cpp) to rounding.
  virtual void flash_attention_forward(T* y, S* lse, const T* q, const T* k, const T* v, int B, int T_, int NH,
                                       int NKV, int HD, S scale) = 0;
  // Given dy [B*T, NH*HD] and the forward's y and lse, writes dq, dk, dv (=, not accumulated;
  // shapes of q, k, v). dsum [B, NH, T] is scratch (D = rowsum(dy * y)). Deterministic: every
  // output row is summed by one work item in a fixed order (no atomics).
  virtual void flash_attention_backward(T* dq, T* dk, T* dv, S* dsum, const T* dy, const T* q, const T* k,
                                        const T* v, const T* y, const S* lse, int B, int T_, int NH, int NKV,
                                        int HD, S scale) = 0;

  // ---- block attention at global positions (flash_attention.h, "Block attention") ---------------
  // One query block of Tq rows against one key block of Tk rows of the same B sequences, for
  // context parallelism: q, y, dq, dy [B*Tq, NH*HD]; k, v, dk, dv [B*Tk, NKV*HD] (GQA as
  // flash_attention_forward); lse, dsum [B, NH, Tq] in S. q_pos [B, Tq] and k_pos [B, Tk]: every
  // token's global position (int32, backend memory: alloc_ids); q_doc, k_doc: document ids of the
  // same shapes, or both nullptr (one document). Query t sees key s iff k_pos[s] <= q_pos[t] and
  // (documents given) q_doc[t] == k_doc[s]. A tile pair that no query can see is skipped
  // (flash::tile_pair_masked) and counted (block_attention_stats).
  // Forward: writes (=) the block's normalised y and lse = log sum_{visible s} exp(scale q_t.k_s);
  // rows that see no key of the block get y = 0, lse = -inf.
  virtual void attention_block_forward(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* q_pos,
                                       const int32_t* k_pos, const int32_t* q_doc, const int32_t* k_doc, int B,
                                       int Tq, int Tk, int NH, int NKV, int HD, S scale) = 0;
  // Online-softmax merge in S (flash::merge_weights): (y, lse) <- merge((y, lse), (y_part,
  // lse_part)), y, y_part [B*Tq, NH*HD], lse, lse_part [B, NH, Tq]; -inf-safe (a part that saw no
  // key changes nothing). Merging the blocks of disjoint key sets in any order gives attention over
  // their union (to rounding).
  virtual void attention_merge(T* y, S* lse, const T* y_part, const S* lse_part, int B, int Tq, int NH, int HD) = 0;
  // The same merge into an accumulator y_acc [B*Tq, NH*HD] of the arithmetic type S (the part still
  // in T): merging cp parts rounds y once, when the caller stores y_acc in T (from_f32), instead of
  // at every merge (context parallelism's ring in bf16, issue 41). For T = S the same arithmetic as
  // attention_merge, bitwise.
  virtual void attention_merge_acc(S* y_acc, S* lse, const T* y_part, const S* lse_part, int B, int Tq, int NH,
                                   int HD) = 0;
  // dsum [B, NH, Tq] = rowsum(dy o y) per (b, h, t) (flash::row_dot), with y the MERGED output.
  virtual void attention_row_dot(S* dsum, const T* dy, const T* y, int B, int Tq, int NH, int HD) = 0;
  // Backward of one block pair given the MERGED lse (over every key block of these queries) and
  // dsum = attention_row_dot of the merged y: ACCUMULATES (+=) this pair's terms into dq [query
  // block], dk, dv [key block]; summed over all block pairs they are the whole-sequence gradients.
  // y: that merged y [B*Tq, NH*HD], or nullptr; a backend may read it in place of dsum (cuDNN's
  // fused backward computes D from y and dy itself) and takes its other path without it.
  // Deterministic (two passes as flash_attention_backward, no atomics; the CUDA backend's cuDNN
  // path unless SHARDTRAIN_CUDNN_DETERMINISTIC=off).
  virtual void attention_block_backward(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v,
                                        const T* y, const S* lse, const S* dsum, const int32_t* q_pos,
                                        const int32_t* k_pos, const int32_t* q_doc, const int32_t* k_doc, int B, int Tq,
                                        int Tk, int NH, int NKV, int HD, S scale) = 0;
  // Tile pairs of block attention since the last call, and how many of them were skipped as fully
  // masked; resets them. Each attention_block_forward and each attention_block_backward adds its
  // B * NH * ceil(Tq/kBr) * ceil(Tk/kBc) pairs (b, h, query tile, key tile). Waits for queued work.
  // cpu_s: host backends, the process's CPU seconds (CLOCK_PROCESS_CPUTIME_ID, OpenMP workers
  // included, and any other thread busy meanwhile) inside those calls; 0 where not measured (devices).
  struct BlockAttentionStats {
    int64_t tile_pairs = 0, skipped = 0;
    double cpu_s = 0;
  };
  virtual BlockAttentionStats take_block_attention_stats() = 0;

  // Exact path with document masks: softmax_causal_forward over B*NH matrices [T, T] (matrix
  // b*NH + h is sequence b) where key s is also masked (p = 0) unless doc[b*T + s] == doc[b*T + t];
  // doc [B, T] int32 (alloc_ids). Every row keeps its diagonal, so no row is empty. The backward
  // is softmax_causal_backward (masked probabilities are 0 and give 0).
  virtual void softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S scale) = 0;

  // SwiGLU: h = silu(gate) * up, all [n].
  virtual void swiglu_forward(T* h, const T* gate, const T* up, size_t n) = 0;
  // dgate = ..., dup = ... (written, not accumulated).
  virtual void swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up, size_t n) = 0;

  // ---- mixture of experts (issue 56; the per-token math is include/shardtrain/backend/moe_math.h) --
  // N tokens, E experts, k experts per token; a token's slot j in [0, k) is its j-th choice, slot
  // id t*k + j. Routing tensors are in S: probs [N, E], weights [N, k]; experts [N, k] int32.
  // Router: moe_route of each row of logits [N, E] (the router GEMM's output), widened to S; and,
  // when lse is not nullptr, lse[t] = moe_logsumexp of row t (the router z-loss's, [N]).
  virtual void moe_route(S* probs, int32_t* experts, S* weights, const T* logits, int N, int E, int k, bool renorm,
                         S* lse = nullptr) = 0;
  // Its backward: dlogits [N, E] (=) from dweights [N, k] (d loss / d weights) and, when aux_dprob
  // is not nullptr, the gradient aux_dprob[t / group_rows, :] ([N / group_rows, E]) that reaches row
  // t's probabilities directly (the load-balancing loss: moe_aux_dprob); when z_dlse is not nullptr,
  // plus the router z-loss's z_dlse[t / group_rows] x d(lse[t]^2)/d(logits) (moe_z_dlogits), added
  // in S before the one rounding to T.
  virtual void moe_route_backward(T* dlogits, const S* probs, const int32_t* experts, const S* weights,
                                  const S* dweights, const S* aux_dprob, int group_rows, int N, int E, int k,
                                  bool renorm, const S* lse = nullptr, const S* z_dlse = nullptr) = 0;
  // psum[t / group_rows, e] += probs[t, e] for every row t, rows added in order (the load-balancing
  // loss's P, per sequence or micro-batch).
  virtual void moe_prob_sums(S* psum, const S* probs, int group_rows, int N, int E) = 0;
  // zsum[t / group_rows] += lse[t]^2 for every row t, rows added in order (the router z-loss's sums).
  virtual void moe_z_sums(S* zsum, const S* lse, int group_rows, int N) = 0;
  // out[i, :] = in[idx[i], :] for i < n (rows of C; dispatch: each slot's token row).
  virtual void gather_rows(T* out, const T* in, const int32_t* idx, int n, int C) = 0;
  // Combine: out[t, :] = (base ? base[t, :] : 0) + sum_j (w ? w[t*k+j] : 1) * ye[pos[t*k+j], :],
  // j = 0..k-1 in order, summed in S, then rounded once. pos: the row of slot t*k+j in ye [N*k, C].
  // out must not alias ye (it may alias base).
  virtual void moe_combine(T* out, const T* base, const T* ye, const int32_t* pos, const S* w, int N, int k,
                           int C) = 0;
  // Combine's backward in w and ye: dye[pos[t*k+j], :] = w[t*k+j] * dout[t, :] and
  // dw[t*k+j] = sum_c dout[t, c] * ye[pos[t*k+j], c] (both written).
  virtual void moe_combine_backward(T* dye, S* dw, const T* dout, const T* ye, const int32_t* pos, const S* w, int N,
                                    int k, int C) = 0;

  // Fused softmax cross-entropy. logits [N, V]; targets [N] ids in [0, V), or negative for a row
  // that is no target (kNoTarget, packing.h: it adds 0 to the loss and its dlogits row is 0),
  // backend memory (alloc_ids). Returns sum over rows of -log softmax(logits)[target] (double). If
  // dlogits != nullptr writes dlogits = (softmax(logits) - onehot(target)) * grad_scale (may alias
  // logits).
  virtual double cross_entropy(T* dlogits, const T* logits, const int32_t* targets, int N, int V,
                               S grad_scale) = 0;
  // The same, with the loss summed where it is computed: adds what cross_entropy would return to the
  // backend's loss sum (double) instead of returning it, so that a chunked loss costs one host
  // synchronisation, in take_loss_sum(), not one per chunk. take_loss_sum() returns the sum and
  // resets it to 0 (on a device: waits for the queued work). Sums in call order, each call's rows
  // summed as cross_entropy sums them: the total is bitwise that of adding cross_entropy's returns
  // in a double. The default does exactly that on the host.
  virtual void cross_entropy_sum(T* dlogits, const T* logits, const int32_t* targets, int N, int V, S grad_scale) {
    loss_sum_ += cross_entropy(dlogits, logits, targets, N, V, grad_scale);
  }
  virtual double take_loss_sum() {
    const double s = loss_sum_;
    loss_sum_ = 0.0;
    return s;
  }

  // Vocabulary-parallel cross-entropy (Megatron-LM's VocabParallelCrossEntropy; tensor
  // parallelism, model.h): each rank of the TP group of G ranks holds the logits of its vocabulary
  // columns, logits [N, Vl] row-major = columns [v0, v0 + Vl) of the full [N, V] logits, of which
  // the first `valid` (0 <= valid <= Vl) are real and the rest padding of the vocabulary to a
  // multiple of G (masked: as -inf, never in a sum, gradient 0). targets [N]: global ids in
  // [0, V), or negative (no target: 0 loss, a zero gradient row, as cross_entropy), backend
  // memory. Three local passes, the group's reductions between them (the model runs them through
  // TensorParallelOps):
  //   1. vocab_ce_max:    mx[i] = max over row i's real columns (-inf when valid == 0).
  //      (group: mx of every rank all-gathered into maxes [G, N], rank g's at g * N)
  //   2. vocab_ce_sum:    with m_i = max_g maxes[g * N + i]: st[2i] = sum over real columns of
  //                       exp(l - m_i), st[2i + 1] = l[target - v0] if this rank holds the target,
  //                       else 0.  (group: st all-reduced, summed)
  //   3. vocab_ce_finish: adds sum_i (m_i + log st[2i] - st[2i + 1]) to the backend's loss sum
  //                       (take_loss_sum; rows in order, each in double) and, when dlogits is not
  //                       nullptr, writes dlogits = (exp(l - m_i) / st[2i] - onehot) * grad_scale
  //                       on real columns, 0 on padding (dlogits may alias logits).
  // mx, maxes, st: S scalars in backend memory (alloc_acc). Arithmetic in S, as cross_entropy.
  // With G = 1 and valid = V this is cross_entropy's loss and gradient to rounding.
  virtual void vocab_ce_max(const T* logits, int N, int Vl, int valid, S* mx) = 0;
  virtual void vocab_ce_sum(const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0,
                            const S* maxes, int G, S* st) = 0;
  virtual void vocab_ce_finish(T* dlogits, const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0,
                               const S* maxes, int G, const S* st, S grad_scale) = 0;

  // AdamW on n elements (see math::adamw). grad is multiplied by grad_scale first (clipping).
  // step is 1-based.
  virtual void adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S grad_scale,
                     int64_t step) = 0;

 protected:
  void add_loss_sum(double x) { loss_sum_ += x; }  // for host-side overrides (the CPU backend)

 private:
  double loss_sum_ = 0.0;  // the default cross_entropy_sum's
};

// OpenBLAS + loops, run on the rank's OpenMP threads (set_cpu_threads). Results are bitwise the
// same for every thread count: work is cut by shape, never by thread count, and sums are taken in
// a fixed order (see src/backend/cpu/cpu_backend.h). Not thread-safe per instance: call from one
// thread; one backend per rank. T = float, double or bf16 (bf16 GEMMs convert their operands to
// float, call sgemm and round the result once, on the calling thread: slow, for tests and as the
// reference of the CUDA bf16 path).
template <typename T> std::unique_ptr<Backend<T>> make_cpu_backend();

// Sets the number of threads the CPU backend uses inside this process (OpenMP), n >= 1; 0 leaves it
// as is. (Every CPU backend, from its constructor on, keeps OpenBLAS at 1 thread: it calls it from
// its own threads, one call per tile.)
void set_cpu_threads(int n);
// The thread count the CPU backend uses now.
int cpu_threads();
// Prepares a thread other than the rank's main thread (FSDP's communication thread) to make CPU
// backend calls with the results the main thread would get: the FTZ/DAZ mode of the rank's threads
// and one OpenMP thread (its calls run serially on it, and no second thread pool competes).
void prepare_cpu_helper_thread();
// How the CPU backend cuts an M x N x K GEMM: {tiles along M, tiles along N}. A function of the
// shape only (never of the thread count); exposed for tests.
std::pair<int, int> cpu_gemm_tiles(int M, int N, int K);

// RAII array of n elements of E in a backend's memory, from Alloc and returned by Free. Move-only.
template <typename T, typename E, E* (Backend<T>::*Alloc)(size_t), void (Backend<T>::*Free)(E*)>
class BackendArray {
 public:
  BackendArray() = default;
  BackendArray(Backend<T>& be, size_t n) : be_(&be), n_(n), p_(n ? (be.*Alloc)(n) : nullptr) {}
  ~BackendArray() { reset(); }
  BackendArray(BackendArray&& o) noexcept : be_(o.be_), n_(o.n_), p_(o.p_) { o.p_ = nullptr; o.n_ = 0; }
  BackendArray& operator=(BackendArray&& o) noexcept {
    if (this != &o) { reset(); be_ = o.be_; n_ = o.n_; p_ = o.p_; o.p_ = nullptr; o.n_ = 0; }
    return *this;
  }
  BackendArray(const BackendArray&) = delete;
  E* data() { return p_; }
  const E* data() const { return p_; }
  size_t size() const { return n_; }
  void reset() { if (p_) (be_->*Free)(p_); p_ = nullptr; n_ = 0; }

 private:
  Backend<T>* be_ = nullptr;
  size_t n_ = 0;
  E* p_ = nullptr;
};

// n elements of T (zero-initialized) on a backend.
template <typename T> using Buffer = BackendArray<T, T, &Backend<T>::alloc, &Backend<T>::free>;
// n token ids (int32, zero-initialized) in a backend's memory, for a Backend<T>.
template <typename T> using IdBuffer = BackendArray<T, int32_t, &Backend<T>::alloc_ids, &Backend<T>::free_ids>;
// n scalars of S = math::Acc<T> (zero-initialized) in a backend's memory: flash attention's lse and
// dsum.
template <typename T>
using AccBuffer = BackendArray<T, typename Backend<T>::S, &Backend<T>::alloc_acc, &Backend<T>::free_acc>;

}  // namespace shardtrain
