// shardtrain model layer: the Llama architecture (Touvron et al. 2023), forward and hand-written
// backward, in the storage type T of its backend: float (fp32 training), bf16 (mixed precision:
// bf16 weights and activations, fp32 arithmetic) or double (gradient checks). Written against a
// UnitSource (the FSDP engine): each unit is gathered just before it is used and its gradient
// reduce-scattered right after it is computed.
//
// Shapes: B = micro-batch sequences, T = sequence length, C = hidden size, V = vocab size,
// NH / NKV = query / key-value heads, HD = head dim, I = intermediate size. Activations are
// row-major [B, T, ...]; attention probabilities are [B, NH, T, T].
//
// Units and canonical (Hugging Face LlamaForCausalLM) parameter names, in flat-buffer order:
//   unit 0      "model.embed_tokens": model.embed_tokens.weight [V, C]
//   unit 1+l    "model.layers.l":     input_layernorm.weight [C], self_attn.{q_proj [NH*HD, C],
//               k_proj [NKV*HD, C], v_proj [NKV*HD, C], o_proj [C, NH*HD]}.weight,
//               post_attention_layernorm.weight [C], mlp.{gate_proj [I, C], up_proj [I, C],
//               down_proj [C, I]}.weight   (each prefixed "model.layers.l.")
//   unit L+1    "model.norm":         model.norm.weight [C], and lm_head.weight [V, C] when untied.
// Tied head: the LM head multiplies by model.embed_tokens.weight, gathering unit 0 a second time;
// its gradient is reduce-scattered into unit 0 right away, so no unit stays gathered.
#pragma once

#include <cstdint>
#include <vector>

#include "shardtrain/backend.h"
#include "shardtrain/config.h"
#include "shardtrain/shard.h"

namespace shardtrain {

// The units of a Llama model for config `c`, with init: matrices Normal(0, initializer_range),
// norms Ones (as transformers' LlamaPreTrainedModel._init_weights). Norm weights get no decay.
std::vector<UnitSpec> llama_units(const ModelConfig& c);

template <typename T> class LlamaModel {
 public:
  using S = typename Backend<T>::S;  // scalar type: float for float and bf16, double for double
  LlamaModel(const ModelConfig& c, Backend<T>& be);

  // Collective (gathers every unit once, the embedding twice when tied).
  // tokens, targets: host arrays [B, T] of ids in [0, V). targets may be nullptr: no loss is
  // computed and logits() holds the logits afterwards.
  // When `train` is true, activations are kept and d(loss)/d(logits) * grad_scale is formed, ready
  // for backward(); grad_scale is usually 1 / (tokens per rank per optimizer step).
  // Returns the sum over the B*T positions of the cross-entropy (nats); 0 if targets == nullptr.
  // Throws std::invalid_argument if T exceeds max_position_embeddings or a token is out of range.
  double forward(UnitSource<T>& f, const int32_t* tokens, const int32_t* targets, int B, int T_, bool train,
                 S grad_scale = S(1));
  // Collective. Backward of the last training forward(): adds the gradients, averaged over ranks,
  // into f's gradient shards (one reduce-scatter per unit, two for a tied embedding).
  void backward(UnitSource<T>& f);
  // Logits of the last forward with targets == nullptr, [B*T, V], copied to host.
  std::vector<T> logits();

  const ModelConfig& config() const { return c_; }
  // Allocates the activation buffers for micro-batches of B x T_ tokens (forward does it lazily).
  // Throws std::bad_alloc.
  void reserve(int B, int T_) { ensure(B, T_); }

 private:
  // Saved activations of one block. The RMSNorm outputs are not kept: backward recomputes them
  // from x / x1 and the weights (rstd is kept), which saves 2 x [B*T, C] per layer for two
  // cheap row passes.
  struct Layer {
    Buffer<T> x, rstd1, q, k, v, att, y, x1, rstd2, g, u, h;
  };
  struct Offsets {  // flat offsets inside a block unit
    int64_t ln1, q, k, v, o, ln2, gate, up, down;
  };
  void ensure(int B, int T_);
  
  ModelConfig c_;
  Backend<T>& be_;
  Offsets off_{};
  int64_t head_off_norm_ = 0, head_off_w_ = 0;
  int cur_b_ = 0, cur_t_ = 0;  // micro-batch shape the buffers are sized for
  IdBuffer<T> tokens_, targets_;  // the micro-batch's ids, in backend memory
  std::vector<Layer> layers_;
  Buffer<T> xf_, lnf_, rstdf_, logits_, cos_, sin_;
  Buffer<T> ln_;  // a block's RMSNorm output [B*T, C], forward and (recomputed) backward
  Buffer<T> dres_, dln_, dq_, dk_, dv_, datt_, dy_, dh_, dg_, du_;
};

// RoPE tables for positions [0, T) and pairs [0, HD/2) with HD/2 = inv_freq.size(): cos/sin of
// t * inv_freq[j], row-major [T, HD/2], computed in double. inv_freq: rope_inv_freqs(config).
template <typename T>
void rope_tables(std::vector<T>& cos, std::vector<T>& sin, int T_, const std::vector<double>& inv_freq);

// Causal self-attention with GQA on already-projected, RoPE-rotated q [B*T, NH*HD],
// k and v [B*T, NKV*HD]; writes att [B, NH, T, T] (softmax probabilities) and y [B*T, NH*HD].
// Query head h reads key/value head h / (NH/NKV). Exposed for tests.
template <typename T>
void attention_forward(Backend<T>& be, const T* q, const T* k, const T* v, T* att, T* y, int B, int T_, int NH,
                       int NKV, int HD);
// Given dy, writes dq (=), and dk, dv (=). datt is scratch of the size of att.
template <typename T>
void attention_backward(Backend<T>& be, const T* q, const T* k, const T* v, const T* att, const T* dy, T* datt,
                        T* dq, T* dk, T* dv, int B, int T_, int NH, int NKV, int HD);

}  // namespace shardtrain
