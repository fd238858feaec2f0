// Fused causal attention through cuDNN 9's scaled-dot-product-attention graph (the cuDNN frontend's
// Graph::sdpa / Graph::sdpa_backward, as llm.c's cudnn_att.cpp uses it): the FlashAttention-2
// algorithm on tensor cores, bf16 in and out, fp32 softmax statistics, no [B, NH, T, T] buffer.
// Private to src/backend/cuda (the CUDA backend's bf16 flash_attention_* call it).
//
// Layout: exactly Backend::flash_attention_forward's (include/shardtrain/backend/backend.h):
//   q, y, dq, dy  [B*T, NH*HD] bf16 row-major   (cuDNN dims [B, NH, T, HD], strides [T*NH*HD, HD, NH*HD, 1])
//   k, v, dk, dv  [B*T, NKV*HD]                 (GQA: query head h reads key/value head h / (NH/NKV))
//   lse           [B, NH, T] float: cuDNN's "Stats" output, the natural-log log-sum-exp of the scaled
//                 scores per query row, the same quantity as the tiled kernel's lse (flash_attention.h)
// Causal: query t sees keys s <= t (top-left diagonal; T_q = T_k).
//
// libcudnn is not linked: the frontend's dynamic loading (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING)
// dlopen()s libcudnn.so.9 at the first call, so the plugin loads on machines without cuDNN and
// the backend falls back to its own tiled kernels there.
//
// Selection, by the environment variable SHARDTRAIN_CUDNN_ATTENTION (read at each call):
//   unset or "auto"  cuDNN when it loads and supports the shape, else the tiled kernel (a note on
//                    stderr, once per reason)
//   "0" / "off"      never cuDNN (the tiled kernel; what the CPU backend computes)
//   "1" / "require"  cuDNN or a runtime_error saying why not
// Any other value: std::invalid_argument naming the variable.
// SHARDTRAIN_CUDNN_DETERMINISTIC=0 (or off) skips the deterministic backward (on Hopper with cuDNN < 9.25 it
// takes a dP workspace of about B*NH*T*T*2 bytes and is slower); default: deterministic when offered.
// cuDNN's backward refuses T = 1 (frontend: "s_q = s_kv = 1 is not supported"): auto falls back.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "shardtrain/backend/bf16.h"

namespace shardtrain::cuda_detail {

enum class CudnnUse { Auto, Off, Require };

// Parses SHARDTRAIN_CUDNN_ATTENTION (see above). Throws std::invalid_argument on another value.
CudnnUse cudnn_attention_use();
// Parses SHARDTRAIN_CUDNN_DETERMINISTIC: unset, "1" or "on": true; "0" or "off": false; another
// value: std::invalid_argument naming the variable.
bool cudnn_deterministic_wanted();

// One per CUDA backend (stream): the cuDNN handle, the built graphs (one per shape and scale) and a
// workspace. Not thread-safe: called from the backend's thread, as the backend itself.
class CudnnAttention {
 public:
  explicit CudnnAttention(cudaStream_t stream);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Enqueues the forward on the stream and returns true; returns false (nothing enqueued, reason
  // in *why) when cuDNN cannot be loaded or does not support this shape. Throws std::runtime_error
  // when an execution fails.
  bool forward(bf16* y, float* lse, const bf16* q, const bf16* k, const bf16* v, int B, int T, int NH, int NKV,
               int HD, float scale, std::string* why);
  // Enqueues dq, dk, dv (written, not accumulated) from dy and the forward's y and lse; as forward
  // otherwise. Deterministic (cuDNN's deterministic backward) when the device supports it; else
  // the non-deterministic one, and deterministic() turns false.
  bool backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dy, const bf16* q, const bf16* k, const bf16* v,
                const bf16* y, const float* lse, int B, int T, int NH, int NKV, int HD, float scale,
                std::string* why);
  // One piece of block attention at global positions (include/shardtrain/backend/attention_pieces.h):
  // nq query rows of blocks of Tq rows per sequence against nk key rows of blocks of Tk rows. q, y,
  // dy, dq point at the piece's first query row of the first sequence ([B*Tq, NH*HD] row-major, so
  // sequence b's rows follow Tq rows later); k, v, dk, dv at its first key row ([B*Tk, NKV*HD]);
  // lse at the piece's first row of [B, NH, Tq] (row t of head h of sequence b at (b NH + h) Tq + t).
  // causal: query row t of the piece sees key row u iff u <= t (top-left diagonal); else every key.
  // stats_align: the byte alignment of lse (16, 8 or 4: a piece's rows start anywhere in [B, NH, Tq]);
  // the graph declares it, as the frontend assumes 16 and does not check the Stats pointer.
  // forward / backward above are the whole sequence's piece (nq = nk = Tq = Tk = T, causal).
  // Writes (=) the piece's rows only; returns and throws as forward / backward.
  bool piece_forward(bf16* y, float* lse, const bf16* q, const bf16* k, const bf16* v, int B, int Tq, int Tk, int nq,
                     int nk, bool causal, int stats_align, int NH, int NKV, int HD, float scale, std::string* why);
  bool piece_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dy, const bf16* q, const bf16* k, const bf16* v,
                      const bf16* y, const float* lse, int B, int Tq, int Tk, int nq, int nk, bool causal,
                      int stats_align, int NH, int NKV, int HD, float scale, std::string* why);
  // Builds (or finds) the graph piece_forward / piece_backward would run for this shape, running
  // nothing: false and why when cuDNN cannot take it, so that a caller can check every piece of a
  // block pair before any of them writes (a backward accumulates).
  bool prepare_piece(bool backward, int B, int Tq, int Tk, int nq, int nk, bool causal, int stats_align, int NH,
                     int NKV, int HD, float scale, std::string* why);
  bool deterministic() const { return deterministic_; }

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  bool deterministic_ = true;
};

}  // namespace shardtrain::cuda_detail
