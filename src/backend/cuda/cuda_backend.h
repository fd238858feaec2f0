// CudaBackend<T>: the Backend<T> (backend.h) of the CUDA plugin, cuBLAS for the GEMMs, hand-written
// kernels for everything else, all ordered on the CudaContext's stream. The per-element math comes
// from ops_math.h / bf16.h (shared with the CPU backend, whose tests cover it); the kernels only
// decide the parallel decomposition (cuda_common.cuh: precision, determinism, launch shapes).
// Private to src/backend/cuda/; the trainer gets it through cuda_impl::make_backend (plugin_abi.h).
//
// The class is declared here and defined by operation, each file with its kernels and its explicit
// instantiations for T = float and bf16:
//   cuda_backend.cu  construction, memory and transfers, the copy stream, scratch, the device sum
//   gemm.cu          GEMMs (cuBLAS), precision conversion (from_f32, add_to_f32)
//   attention.cu     causal softmax, flash attention (tiled kernels; cuDNN for bf16), block attention;
//                    the tiled kernels' loops are flash_tiles.cuh's
//   norm.cu          RMSNorm
//   rope.cu          rotary embeddings
//   swiglu.cu        SwiGLU
//   moe.cu           mixture-of-experts routing, dispatch (gather) and combine
//   loss.cu          cross-entropy, vocabulary-parallel cross-entropy
//   embedding.cu     token embedding
//   optimizer.cu     AdamW, axpy, scale, sums of squares (gradient norm)
//   fp8.cu           float8 linear GEMMs (cuBLASLt; device amax, scales and quantize kernels)
// and share cuda_common.cuh (error checks, launch shapes, device reductions).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "shardtrain/backend/attention_pieces.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/cuda.h"
#include "cudnn_attention.h"

namespace shardtrain::cuda_detail {

template <typename T> class CudaBackend final : public Backend<T> {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>, "CUDA backend: T = float or bf16");

 public:
  using S = math::Acc<T>;

  explicit CudaBackend(CudaContext& ctx);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const char* name() const override { return "cuda"; }

  // ---- memory (cuda_backend.cu) ----
  T* alloc(size_t n) override;
  void free(T* p) override;
  void zero(T* p, size_t n) override;
  void copy(T* dst, const T* src, size_t n) override;
  void to_host(T* host, const T* src, size_t n) override;
  void from_host(T* dst, const T* host, size_t n) override;
  int32_t* alloc_ids(size_t n) override;
  void free_ids(int32_t* p) override;
  void ids_from_host(int32_t* dst, const int32_t* host, size_t n) override;
  void ids_to_host(int32_t* host, const int32_t* src, size_t n) override;  // moe.cu
  void acc_to_host(S* host, const S* src, size_t n) override;              // moe.cu
  void acc_from_host(S* dst, const S* host, size_t n) override;            // moe.cu
  S* alloc_acc(size_t n) override;
  void free_acc(S* p) override;
  void copy_2d(T* dst, size_t ldd, const T* src, size_t lds, size_t rows, size_t cols) override;
  void zero_acc(S* p, size_t n) override;
  void synchronize() override;

  // ---- staging to the host: pinned memory, the copy stream (cuda_backend.cu) ----
  void* alloc_pinned_host(size_t bytes) override;
  void free_pinned_host(void* p) noexcept override;
  void to_host_async(T* host, const T* src, size_t n) override;
  void wait_host_copies() override;

  // ---- precision conversion, GEMM (gemm.cu) ----
  void from_f32(T* dst, const float* src, size_t n) override;
  void add_to_f32(float* dst, float alpha, const T* src, size_t n) override;
  void gemm(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, const T* B, int ldb, S beta, T* C,
            int ldc) override;
  void gemm_strided_batched(bool ta, bool tb, int M, int N, int K, S alpha, const T* A, int lda, int64_t sa,
                            const T* B, int ldb, int64_t sb, S beta, T* C, int ldc, int64_t sc, int batch) override;

  // ---- float8 linear GEMMs (fp8.cu): backend.h's contract; cuBLASLt FP8 with device-side
  // tensorwise scales. std::runtime_error on a device of compute capability < 8.9. ----
  void linear_fp8(math::Fp8Gemm role, int M, int N, int K, const T* a, const T* b, T* out, bool accumulate) override;

  // ---- elementwise, reductions, optimizer (optimizer.cu) ----
  void axpy(size_t n, S alpha, const T* x, T* y) override;
  void scale(size_t n, S alpha, T* x) override;
  double sum_squares(const T* x, size_t n) override;
  double sum_squares_many(const T* const* x, const size_t* n, size_t k) override;
  void adamw(T* p, T* m, T* v, const T* g, size_t n, S lr, S b1, S b2, S eps, S wd, S grad_scale,
             int64_t step) override;

  // ---- embedding.cu, norm.cu, rope.cu, swiglu.cu ----
  void embedding_forward(T* out, const int32_t* tokens, const T* table, int N, int C) override;
  void embedding_backward(T* dtable, const int32_t* tokens, const T* dout, int N, int C) override;
  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int N, int C, S eps) override;
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int N, int C) override;
  void rope_forward(T* x, const T* cos, const T* sin, int B, int T_, int H, int HD) override;
  void rope_backward(T* dx, const T* cos, const T* sin, int B, int T_, int H, int HD) override;
  void rope_forward_at(T* x, const T* cos, const T* sin, const int32_t* pos, int N, int H, int HD) override;
  void rope_backward_at(T* dx, const T* cos, const T* sin, const int32_t* pos, int N, int H, int HD) override;
  void rope_qk(T* q, int Hq, T* k, int Hk, const T* cos, const T* sin, const int32_t* pos, int B, int T_, int HD,
               bool backward) override;
  void swiglu_forward(T* h, const T* gate, const T* up, size_t n) override;
  void swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up, size_t n) override;

  // ---- moe.cu ----
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

  // ---- attention (attention.cu) ----
  void softmax_causal_forward(T* att, int R, int T_, S scale) override;
  void softmax_causal_backward(T* datt, const T* att, int R, int T_, S scale) override;
  void softmax_causal_doc_forward(T* att, const int32_t* doc, int B, int NH, int T_, S scale) override;
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

  // ---- loss (loss.cu) ----
  double cross_entropy(T* dlogits, const T* logits, const int32_t* targets, int N, int V, S grad_scale) override;
  void cross_entropy_sum(T* dlogits, const T* logits, const int32_t* targets, int N, int V, S grad_scale) override;
  double take_loss_sum() override;
  void vocab_ce_max(const T* logits, int N, int Vl, int valid, S* mx) override;
  void vocab_ce_sum(const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0, const S* maxes, int G,
                    S* st) override;
  void vocab_ce_finish(T* dlogits, const T* logits, const int32_t* targets, int N, int Vl, int valid, int v0,
                       const S* maxes, int G, const S* st, S grad_scale) override;

 private:
  cudaStream_t stream_;
  cublasHandle_t handle_;
  void* scratch_ = nullptr;  // reduction scratch, stream-ordered reuse across calls
  size_t scratch_bytes_ = 0;
  double* loss_sum_ = nullptr;  // cross_entropy_sum's device double
  unsigned long long* skip_ = nullptr;  // block attention: skipped tile pairs (device counter)
  int64_t block_pairs_ = 0;             // block attention: tile pairs launched (host count)
  int64_t block_skipped_ = 0;           // block attention through cuDNN: tile pairs a tiled kernel skips
  std::unordered_map<const void*, size_t> static_smem_;  // allow_smem: each kernel's static shared memory
  cudaStream_t copy_stream_ = nullptr;  // to_host_async's, made at its first call
  cudaEvent_t compute_done_ = nullptr;  // recorded on stream_, waited for by copy_stream_
  bool warned_free_ = false;
  std::unique_ptr<CudnnAttention> cudnn_;  // created at the first bf16 attention call
  std::set<std::string> noted_;            // notes already printed
  cublasLtHandle_t lt_ = nullptr;          // fp8.cu: created with the first linear_fp8
  bool fp8_ok_ = false;                    // fp8.cu: the device's compute capability was checked

  // ---- cuda_backend.cu ----
  void note_once(const std::string& msg);
  // cudaMalloc + zero on the stream; synchronized so the memory is zero for any later user,
  // whatever stream it runs on.
  void* alloc_bytes(size_t bytes);
  // Frees after the queued work that may use p has finished. Never throws (it runs in destructors
  // of Buffer); a failure is printed once per backend (a sticky device error is reported by the
  // next checked call anyway).
  void release(void* p) noexcept;
  void warn_free(cudaError_t e) noexcept;
  // At least `bytes` of device scratch (grown, never shrunk), reused by every call on the stream.
  void* scratch(size_t bytes);
  // out[0] = sum of in[0..n) (device doubles), in double; accumulate: out[0] += that sum. One block.
  void sum_doubles(const double* in, size_t n, double* out, bool accumulate);
  // Sums in[0..n) (device doubles) into *out (device) and returns it on the host.
  double sum_to_host(const double* in, size_t n, double* out);

  // ---- gemm.cu ----
  void scale_c(T* C, int M, int N, int ldc, float beta);  // C = beta C (the K == 0 GEMM)

  // ---- fp8.cu ----
  // Throws std::runtime_error unless the current device has compute capability >= 8.9; creates lt_.
  void fp8_check_device();

  // ---- rope.cu ----
  void rope(T* x, const T* cs, const T* sn, int B, int T_, int H, int HD, bool backward);
  void rope_at(T* x, const T* cs, const T* sn, const int32_t* pos, int N, int H, int HD, bool backward);

  // ---- attention.cu ----
  CudnnAttention& cudnn();
  // Runs `try_cudnn(&why)` unless SHARDTRAIN_CUDNN_ATTENTION is off; true if cuDNN ran. When cuDNN
  // cannot: "require" throws the reason, "auto" prints it once and returns false (tiled kernels).
  template <typename F> bool use_cudnn(F&& try_cudnn);
  // Lets `kernel` use `bytes` of dynamic shared memory (beyond the device's limit: runtime_error).
  template <typename K> void allow_smem(K* kernel, size_t bytes, int HD);
  // The device counter of skipped block-attention tile pairs (allocated zeroed on first use).
  unsigned long long* skip_counter();
  // Block attention through cuDNN's fused SDPA (bf16): the block pair cut into pieces
  // (include/shardtrain/backend/attention_pieces.h) from its positions and documents (qd, kd or
  // nullptr), read back to the host; every piece's graph prepared before any runs. false and why
  // (nothing written) when cuDNN cannot take a piece: the tiled kernels then run.
  // Sequences [b0, b0 + nb) of a block pair and their pieces: all B sequences when they share
  // positions and documents, else one group per sequence.
  // stats_align[i]: the byte alignment of piece i's lse rows (16, 8 or 4), in (y, lse) and in the
  // merge scratch alike (cuDNN must be told: CudnnAttention::piece_forward).
  bool cudnn_for_blocks(const int32_t* qd, const int32_t* kd) const;
  struct BlockGroup {
    int b0 = 0, nb = 0;
    std::vector<attn::Piece> pieces;
    std::vector<int> stats_align;
  };
  bool block_plan(const int32_t* qp, const int32_t* kp, const int32_t* qd, const int32_t* kd, const S* lse, int B,
                  int Tq, int Tk, int NH, int NKV, int HD, S scale, bool backward, std::vector<BlockGroup>* groups,
                  int64_t* masked, std::string* why);
  bool block_forward_cudnn(T* y, S* lse, const T* q, const T* k, const T* v, const int32_t* qp, const int32_t* kp,
                           const int32_t* qd, const int32_t* kd, int B, int Tq, int Tk, int NH, int NKV, int HD,
                           S scale, std::string* why);
  bool block_backward_cudnn(T* dq, T* dk, T* dv, const T* dy, const T* q, const T* k, const T* v, const T* y,
                            const S* lse, const int32_t* qp, const int32_t* kp, const int32_t* qd, const int32_t* kd,
                            int B, int Tq, int Tk, int NH, int NKV, int HD, S scale, std::string* why);
};

}  // namespace shardtrain::cuda_detail
