// shardtrain model layer: the Llama architecture (Touvron et al. 2023), forward and hand-written
// backward, in the storage type T of its backend: float (fp32 training), bf16 (mixed precision:
// bf16 weights and activations, fp32 arithmetic) or double (gradient checks). Written against a
// UnitSource (unit_source.h; UnitPipeline is the FSDP one): each unit is gathered just before it is used
// and its gradient reduce-scattered right after it is computed. The model never sees a
// communicator or the mesh.
//
// Shapes: B = micro-batch sequences, T = sequence length, C = hidden size, V = vocab size,
// NH / NKV = query / key-value heads, HD = head dim, I = intermediate size. Activations are
// row-major [B, T, ...]; the exact attention path's probabilities are [B, NH, T, T] (the tiled
// path, the default, keeps a log-sum-exp [B, NH, T] instead).
//
// Units and canonical (Hugging Face LlamaForCausalLM) parameter names, in flat-buffer order:
//   unit 0      "model.embed_tokens": model.embed_tokens.weight [V, C]
//   unit 1+l    "model.layers.l":     input_layernorm.weight [C], self_attn.{q_proj [NH*HD, C],
//               k_proj [NKV*HD, C], v_proj [NKV*HD, C], o_proj [C, NH*HD]}.weight,
//               post_attention_layernorm.weight [C], mlp.{gate_proj [I, C], up_proj [I, C],
//               down_proj [C, I]}.weight   (each prefixed "model.layers.l.")
//               With ModelConfig::qk_norm (Qwen3ForCausalLM) self_attn.q_norm.weight [HD] and
//               self_attn.k_norm.weight [HD] follow o_proj: an RMSNorm (eps rms_norm_eps) over
//               each head's HD values of q and of k, after the projection and before RoPE
//               (transformers' Qwen3Attention); replicated under TP, like the other norms.
//               A mixture-of-experts block (ModelConfig::is_moe_layer(l); transformers'
//               MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock) holds, in place of the three MLP
//               weights, mlp.gate.weight [E, C] (the router) and the E experts' SwiGLU weights fused
//               as transformers 5 keeps them in memory: mlp.experts.gate_up_proj [E, 2*IE, C] (each
//               expert's gate rows, then its up rows) and mlp.experts.down_proj [E, C, IE]
//               (IE = moe_intermediate_size). Dense blocks of an MoE model (Qwen3-MoE's
//               mlp_only_layers) are Llama's.
//   unit L+1    "model.norm":         model.norm.weight [C], and lm_head.weight [V, C] when untied.
// Tied head: the LM head multiplies by model.embed_tokens.weight, gathering unit 0 a second time;
// its gradient is reduce-scattered into unit 0 right away, so no unit stays gathered.
//
// Tensor parallelism (--tp N; Megatron-LM, Shoeybi et al. 2019, "Megatron-LM: Training
// Multi-Billion Parameter Language Models Using Model Parallelism"; sequence parallelism,
// Korthikanti et al. 2022). Rank t of a TP group of N ranks holds (llama_units(c, N, t)):
//   q/k/v_proj, gate/up_proj: column-parallel, rows [t*n, (t+1)*n) of the canonical weight (its
//     heads NH/N and KV heads NKV/N, a slice I/N of the intermediate size);
//   o_proj, down_proj: row-parallel, columns [t*n, (t+1)*n) (the matching input slice);
//   embed_tokens, lm_head: vocabulary-parallel, rows [t*Vl, (t+1)*Vl), Vl = ceil(V / N); rows at or
//     past V are padding (zero, never trained, masked to -inf in the loss);
//   the RMSNorm weights: replicated (their gradient summed over the group after the backward,
//     ParallelRun::finish_grads, parallelize.h).
// Sequence parallelism: the residual stream (x, x1, the RMSNorms, the embedding output, the final
// norm) holds this rank's B*T/N rows, block t of the micro-batch's B*T rows. Per block: all-gather
// the RMSNorm output before q/k/v and before gate/up (the GEMMs see all B*T rows), reduce-scatter
// the partial sums after o and after down into the residual; backward the mirror image (all-gather
// of the residual gradient, reduce-scatter of the input gradients, the RMSNorm outputs all-gathered
// again for the weight gradients). The embedding's partial lookups are reduce-scattered; the head
// all-gathers the final norm's output, computes logits [chunk, Vl] and the vocabulary-parallel
// cross-entropy (backend.h vocab_ce_*), reduce-scattering its input gradient. Every rank of the
// group computes the loss of all B*T tokens. The model calls the group only through
// TensorParallelOps (tensor_parallel_ops.h); with N = 1 it calls nothing and computes bitwise as without TP.
//
// Mixture of experts (issue 56; docs/moe.md). The MLP sub-block of an MoE block: router logits
// z = n2 Wr^T [BT, E] (a GEMM in T, widened to S), per token softmax over E and its top K experts
// with their weights (Backend::moe_route; ties to the lower index, weights renormalized when
// norm_topk_prob), the BT*K slots sorted by expert (stable: by token, then slot), each slot's input
// row gathered, per expert e one gate, one up and one down GEMM over its rows (a loop of GEMMs:
// dropless, no capacity), and the combine x_next = x1 + sum_j w_j y_{e_j} over each token's slots
// in slot order. The load-balancing loss (moe_aux_loss) pools every MoE block's rows of its scope
// (ModelOptions::aux_scope); its gradient reaches the routing probabilities only. Under CP a
// sequence's rows are the CP group's: at the end of a forward over [0, L) the counts and
// probability sums of each scope group are summed over it (ContextParallelOps::sum_host), so every
// CP rank holds the sequences' loss and gives the gradient of its own rows (the group's sum is the
// gradient). Not with tensor parallelism or the split backward yet (std::invalid_argument /
// std::logic_error, naming what is missing).
// Expert parallelism (--ep N; the model given ExpertParallelOps of size N > 1): rank i of the EP
// group computes experts [i E/N, (i+1) E/N) for the tokens of the whole group. Per MoE block the
// routing and the sort stay local; the group exchanges each rank's slots per expert
// (all_gather_counts), every rank sends each peer the rows routed to its experts (all_to_all, the
// sorted order cut at the peers' expert ranges), orders what it received expert-major (expert j's
// rows from rank 0, then rank 1, ...), runs its experts' GEMMs, puts the outputs back in the order
// received and returns them (all_to_all); the combine is local. Backward sends d(ye) the same way,
// sends the inputs again for the weight gradients (nothing of [rows, C] is kept) and returns d(xe).
// Every weight gradient of an expert this rank does not compute stays zero: the FSDP reduce-scatter
// over the shard group, which holds the whole EP group, sums each expert's from the ranks that
// computed it, divided by the same W as every gradient (docs/moe.md, "The gradient's divisor").
// The buffers of an expert's rows (g, u, h and the exchange's) are sized for the worst case
// dropless allows, N x B*T*K rows (every rank's slots to one rank's experts).
//
// Context parallelism (--cp N; Ring Attention, Liu et al. 2023; Llama 3, section 3.3.2): every
// sequence of T tokens is split over a CP group of N ranks, each holding Tl = T / N rows of it (the
// parallel layer's head-tail split, context_parallel.h cp_rows). The model is given those rows
// ([B, Tl] tokens and targets) and each row's GLOBAL position (TokenLayout::pos, required under
// CP) and, with the document mask, its document id; it runs everything as for B x Tl tokens except
// self-attention, which goes through ContextParallelOps (context_parallel_ops.h: this rank's query
// rows against the keys of the whole sequence; forward and backward are collective over the CP
// group). The sequence's global length is N x Tl (the split gives every rank Tl = T / N rows): the
// RoPE tables cover it, the positions are checked against it and max_position_embeddings applies to
// it. The loss is the sum over this rank's rows (the caller sums over the group). The CP ranks hold
// the same parameters and see different tokens: their gradients are partial sums, to be summed (the
// FSDP reduce-scatter over dp_shard x cp does it). With N = 1 (or no ops) nothing changes, bitwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/model/config.h"
#include "shardtrain/shard/context_parallel_ops.h"
#include "shardtrain/shard/expert_parallel_ops.h"
#include "shardtrain/shard/shard.h"

namespace shardtrain {

// The units of a Llama model for config `c`, with init: matrices Normal(0, initializer_range),
// norms Ones (as transformers' LlamaPreTrainedModel._init_weights). Norm weights get no decay.
// With tp > 1: the slices of TP rank tp_rank (above; ParamSpec::tp says which part of the canonical
// tensor each is). Throws std::invalid_argument when tp does not divide the heads, the KV heads
// or the intermediate size (check_tensor_parallel's message).
// Expert parallelism (ep > 1, an MoE model; docs/moe.md): a block's unit holds its router but not
// its experts; each MoE block's experts are a unit of their own, after the L + 2 units in block
// order, "model.layers.l.mlp.experts" (unit llama_expert_unit(c, l)): EP rank ep_rank's E / ep
// experts, mlp.experts.gate_up_proj [E/ep, 2 IE, C] and mlp.experts.down_proj [E/ep, C, IE], each
// a Rows slice of degree ep of the canonical [E, ...] tensor (ParamSpec::tp: init and checkpoints
// see canonical indices), sharded over the expert shard group (UnitSpec::group 1). Throws
// std::invalid_argument when ep does not divide the experts (or ep > 1 on a dense model).
std::vector<UnitSpec> llama_units(const ModelConfig& c, int tp = 1, int tp_rank = 0, int ep = 1, int ep_rank = 0);
// The units llama_units makes: L + 2, plus one per MoE block with ep > 1.
int llama_num_units(const ModelConfig& c, int ep = 1);
// The expert unit of MoE block l under ep > 1: L + 2 + the MoE blocks before l.
int llama_expert_unit(const ModelConfig& c, int l);
// "" when `tp` fits the model (divides num_attention_heads, num_key_value_heads and
// intermediate_size), else why not, naming option '--tp' and the numbers.
std::string check_tensor_parallel(const ModelConfig& c, int tp);

// Activation checkpointing (recompute in backward what forward did not keep; Chen et al. 2016,
// "Training Deep Nets with Sublinear Memory Cost"). Per block (one FSDP unit), what is kept from
// forward to backward, with BT = B*T rows:
//   None:      the block input x [BT, C]; rstd of both RMSNorms [BT]; q, k after RoPE [BT, NH*HD],
//              [BT, NKV*HD]; v [BT, NKV*HD]; the attention state (tiled: lse [B, NH, T]; exact: the
//              probabilities [B, NH, T, T]); the attention output y [BT, NH*HD]; x1 = x + attention
//              [BT, C]; gate and up [BT, I]; h = silu(gate) * up [BT, I]. (The RMSNorm outputs are
//              never kept: backward recomputes them from x / x1, as in every mode.) With q/k norm
//              also q and k before the norm [BT, NH*HD], [BT, NKV*HD] and their rstd [BT*NH],
//              [BT*NKV] (the norm's backward reads them).
//   Selective: as None without h, and without the exact path's probabilities: every GEMM output
//              is kept, the cheap elementwise parts are recomputed in backward (h from gate and up;
//              the exact path's scores and softmax from q and k). Megatron-LM's "selective"
//              recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
//              Transformer Models") and torchtitan's op-level policy that saves matmul outputs.
//   Full:      only the block input x; backward reruns the block's forward (all but its last GEMM)
//              into one shared set of buffers, then its backward (torchtitan / Megatron "full").
// The recomputation runs the same kernels on the same inputs, so gradients are bitwise identical in
// every mode. The final norm and the LM head are not a block: their backward runs in the head step,
// chunk by chunk (LlamaModel::head_backward), so nothing vocabulary-sized is kept.
enum class Recompute { None, Selective, Full };
// Attention implementation. Tiled: FlashAttention-2 (include/shardtrain/backend/flash_attention.h), O(B*NH*T)
// memory; Exact: scores and probabilities materialized, [B, NH, T, T] (reference for tests).
enum class AttentionKind { Tiled, Exact };

// What attention masks (--attention-mask). Causal: query t sees keys s <= t of its sequence.
// Document (packed training data; Llama 3, Dubey et al. 2024, section 3.2: "an attention mask that
// prevents self-attention between different documents within the same sequence"): query t sees keys
// s <= t of its own document, and RoPE positions restart at 0 at each document's first token (as
// transformers does for packed sequences given position_ids). The documents of a micro-batch come
// with it (TokenLayout, below; the data layer's document_layout, data.h).
enum class AttentionMask { Causal, Document };

// The rows the load-balancing loss of a mixture-of-experts model pools (--aux-loss-scope; issue 56,
// docs/moe.md): Sequence, each row of the micro-batch (a sequence) on its own, so that the loss of
// a batch is a sum over its sequences and the same at every layout; MicroBatch, all rows of the
// micro-batch together (transformers' load_balancing_loss_func over one forward call). Every MoE
// block's rows of the scope count (R = MoE blocks x the scope's tokens).
enum class MoeAuxScope { Sequence, MicroBatch };

// How a model computes; none of it but `mask` changes what is computed (beyond summation order of
// the loss chunks). Not part of the checkpoint.
struct ModelOptions {
  Recompute recompute = Recompute::None;
  AttentionKind attention = AttentionKind::Tiled;
  int loss_chunk = 0;  // tokens per LM-head / cross-entropy chunk; 0 = default_loss_chunk(V)
  // Document: the model reserves (and activation_bytes counts) the buffers of a TokenLayout per
  // micro-batch; the mask itself is what each forward's layout says (none given: causal).
  AttentionMask mask = AttentionMask::Causal;
  MoeAuxScope aux_scope = MoeAuxScope::Sequence;  // mixture of experts only
  // float8 GEMMs (issue 57 item 3, `--precision fp8`): the transformer blocks' projections (q, k,
  // v, o, gate, up, down; all three GEMMs of each) run through Backend::linear_fp8 (per-tensor
  // dynamic scales, E4M3 x / W, E5M2 dy); the LM head, attention, the norms and everything else
  // keep the storage type's GEMMs. Refused (std::invalid_argument from LlamaModel's constructor)
  // with a mixture-of-experts config: its experts and router are not quantized, and half an fp8
  // model is not what the flag promises. A backend without linear_fp8 throws std::logic_error at
  // the first projection (Backend::linear_fp8).
  bool fp8 = false;
};
// Parse "none" | "selective" | "full", "tiled" | "exact" and "causal" | "document"; throw
// std::invalid_argument naming the options '--activation-checkpointing' / '--attention' /
// '--attention-mask'.
Recompute parse_recompute(const std::string& s);
AttentionKind parse_attention(const std::string& s);
AttentionMask parse_attention_mask(const std::string& s);
// "sequence" | "micro-batch"; std::invalid_argument naming option '--aux-loss-scope'.
MoeAuxScope parse_aux_scope(const std::string& s);
const char* aux_scope_name(MoeAuxScope s);
const char* recompute_name(Recompute r);
const char* attention_name(AttentionKind a);
const char* attention_mask_name(AttentionMask m);

// Where the tokens of one micro-batch are, for RoPE and the attention mask: host arrays [B, T]
// (row-major, int32) that a forward() copies into the micro-batch's Context (kept for its backward,
// as the token ids are), or nullptr.
//   pos: each token's RoPE position, in [0, T) (T: the global sequence length, cp x the rows given
//        under context parallelism; document masking: its position in its document,
//        0 at each document's first token and at a row's first token); nullptr: t, the token's
//        index in its row (today's RoPE).
//   doc: each token's document id, compared only within a row (document_layout numbers them 0, 1,
//        ... along the row); query t sees key s iff s <= t (row order) and doc[s] == doc[t];
//        nullptr: one document per row (causal).
// Both nullptr (the default), or arrays that change nothing (every pos[b, t] == t, every row one
// document), run today's causal code path, bitwise. The rows are whole sequences in order: the
// mask compares row indices, the positions only rotate. Any document ids are correct; with ids
// non-decreasing along a row (contiguous documents, as document_layout's) the tiled path skips
// exactly the tile pairs in which no query sees a key (flash_attention.h).
// Under context parallelism (LlamaModel given ContextParallelOps of size > 1) the rows are this
// rank's chunks of each sequence, not in order: pos is REQUIRED and must be each row's global
// position, which is also what the mask compares (query t sees key s iff pos[s] <= pos[t] and, doc
// given, doc[s] == doc[t]; so positions restart per document only together with doc ids);
// doc, when given, is always used (every rank of the CP group must give it or none: the CP
// attention moves the ids with K/V).
// real: [B, T] host int32, nonzero for a token and 0 for padding (the rest of a fine-tuning row,
// data/packing.h), or nullptr (every position a token). Only a mixture-of-experts model's
// load-balancing loss reads it: padding is left out of its counts, probability sums and row count
// R, and gets none of its gradient (transformers' load_balancing_loss_func given an attention mask).
// Padding is otherwise computed as any row (it has no targets, and no real token attends to it).
struct TokenLayout {
  const int32_t* pos = nullptr;
  const int32_t* doc = nullptr;
  const int32_t* real = nullptr;
};
// Default chunk of the LM head and loss: as many tokens as make a [chunk, V] logits block of
// 2^24 elements (64 MiB in fp32), at least 256 tokens: about 131 (-> 256) for a 128,256
// vocabulary, 65,027 for 258.
int default_loss_chunk(int vocab_size);

// The sizes a LlamaModel computes with, computed once from the config (the micro-batch's by
// with_batch). Local: with tensor parallelism the heads, I and the vocabulary rows are this rank's
// slice, and every buffer size and projection shape follows from here.
struct LlamaDims {
  int C = 0, I = 0, V = 0, L = 0;  // hidden, local intermediate (SwiGLU), canonical vocabulary, blocks
  int NH = 0, NKV = 0, HD = 0;     // local query heads, local key/value heads, head dim
  int Q = 0, KV = 0;               // NH*HD, NKV*HD: widths of q and of k, v (local)
  int tp = 1;                      // TP degree N
  int cp = 1;                      // CP degree: the model holds T_ of the sequence's Tg = cp * T_ rows
  int Vl = 0, v0 = 0, valid = 0;   // vocabulary rows held (ceil(V/N)), the first one, how many are real
  int B = 0, T_ = 0, BT = 0;       // micro-batch (T_: rows of each sequence held); rows B*T_; 0 until with_batch
  int Tg = 0;                      // the sequence's global length cp * T_ (T_ without CP)
  int R = 0;                       // residual-stream rows held: BT / tp (sequence parallelism)
  int chunk = 0;                   // LM head / loss chunk in tokens, min(loss chunk, BT)
  int E = 0, K = 0, IE = 0;        // MoE: experts, experts per token, an expert's inner size (0: dense)
  bool renorm = false;             // MoE: the K weights divided by their sum (norm_topk_prob)
  int slots = 0;                   // MoE: BT * K routed rows
  int ep = 1, El = 0;              // MoE: EP degree N, this rank's experts E / N
  int er = 0;                      // MoE: rows this rank's experts may get, N x slots (slots without EP)
  // tp must divide the heads, KV heads and I (check_tensor_parallel; not checked here); ep must
  // divide E (the parallel layer refuses it first; here std::invalid_argument).
  explicit LlamaDims(const ModelConfig& c, int tp = 1, int tp_rank = 0, int cp = 1, int ep = 1);
  // This with the micro-batch B x T_ and the loss chunk min(loss_chunk, B*T_); loss_chunk 0 =
  // default_loss_chunk(Vl). Throws std::invalid_argument naming '--tp' when tp does not divide B*T_.
  LlamaDims with_batch(int B, int T_, int loss_chunk) const;
};

// Activation memory of a LlamaModel<T> for micro-batches of B x T tokens, in bytes, by buffer
// group; the same numbers LlamaModel::reserve allocates (a test counts the allocations).
struct ActivationBytes {
  int64_t per_layer = 0;       // kept per block from forward to backward, times num_hidden_layers
  int64_t recompute = 0;       // one block's recomputed activations (Selective, Full)
  int64_t block_scratch = 0;   // shared by blocks: RMSNorm output, the backward's activation gradients
  int64_t head = 0;            // final norm input/output, the logits chunk, ids, RoPE tables; with
                               // mask Document the layout's positions, documents and row indices
  int64_t total() const { return per_layer + recompute + block_scratch + head; }
};
// tp: the TP degree (sequence-parallel rows B*T/tp, local heads and intermediate slice). cp: the CP
// degree, T_ the rows of each sequence a rank holds (T / cp): the RoPE tables cover cp * T_
// positions, and the layout's ids are kept as with mask Document (positions are required).
// ep: the EP degree (an MoE block's expert rows sized N x B*T*K, and the exchange's buffers: the
// worst case dropless allows, every slot of the EP group on this rank's experts); balanced: those
// rows sized B*T*K instead, what balanced routing fills and what the model allocates at reserve()
// (the memory plan's figure). Under EP the model grows them to the rows its experts get (grow-only),
// so a run's peak lies between the two.
ActivationBytes activation_bytes(const ModelConfig& c, const ModelOptions& o, int B, int T_, size_t elem_bytes,
                                 size_t acc_bytes, int tp = 1, int cp = 1, int ep = 1, bool balanced = false);

// The backend memory of one LlamaModel<T>::Context over blocks [begin, end) of a model of L blocks
// (a pipeline chunk; [0, L): the whole model's context), for micro-batches of B x T_ tokens, in
// bytes: exactly what the model allocates for it at its first forward (ensure_context), with R =
// B*T_ / tp rows, x = R*C and the per-block part of activation_bytes (per_layer / L; its
// accumulator arrays in Backend<T>::S: 8 bytes when elem_bytes is 8, else 4):
//   (end - begin) x per-block kept activations
//   + elem_bytes x 2x                       the range's output and its residual gradient
//   + elem_bytes x (x + R)    end == L      the final norm's output and rstd
//   + 4 x B*T_                begin == 0    the token ids (+ 4 x B*T_ with tp > 1: the embedding
//                                           slice's rows)
//   + 4 x B*T_                end == L      the target ids
//   + 2 x 4 x B*T_            positions and documents, with mask Document or cp > 1
// Deferred weight gradients (zero-bubble) come on top: deferred_weight_bytes. The model's shared
// scratch (one per model, however many contexts) is the rest of activation_bytes:
//   activation_bytes(c, o, B, T_, ...).total() - context_bytes(c, o, B, T_, ..., 0, L, ...).
// std::invalid_argument when not 0 <= begin <= end <= L.
// ep > 1: its expert rows as allocated, for balanced routing; worst: at the worst imbalance they
// grow to (activation_bytes' two figures).
int64_t context_bytes(const ModelConfig& c, const ModelOptions& o, int B, int T_, size_t elem_bytes, int begin, int end,
                      int tp = 1, int cp = 1, int ep = 1, bool worst = false);

// The memory of one deferred weight gradient (LlamaModel::backward_input, below): the bytes a
// Context keeps from its backward_input to its backward_weight for a range of `blocks` blocks, for
// micro-batches of B x T_ tokens (T_: rows per sequence held, T / cp), elem_bytes = sizeof(T), TP
// degree tp. Per block, with BT = B*T_ (every row of the micro-batch: under TP the kept rows are the
// all-gathered ones), C, I / tp, Q = NH*HD / tp, KV = NKV*HD / tp:
//   elem_bytes * (4*BT*C            d(x_next) before the MLP (down's dy), d(x1) (o's dy), and the
//                                   RMSNorm outputs n2 (gate/up's x), n1 (q/k/v's x) as recomputed
//                 + 2*BT*I          d(gate), d(up) (gate/up's dy)
//                 + BT*Q + 2*BT*KV  d(q), d(k) after the RoPE backward, d(v) (q/k/v's dy)
//                 + 2*C             both RMSNorm weight gradients, computed by backward_input
//                                   (+ 2*HD with q/k norm: q_norm's and k_norm's)
//                 + BT*I            h (down's x), unless Recompute::None keeps it anyway
//                 + BT*Q)           y (o's x), only under Recompute::Full (the other modes keep it)
// The context allocates exactly this at its first backward_input (and again after a forward of
// another micro-batch size) and keeps it for reuse: LlamaModel::Context::deferred_bytes().
int64_t deferred_weight_bytes(const ModelConfig& c, const ModelOptions& o, int B, int T_, size_t elem_bytes,
                              int blocks, int tp = 1, int cp = 1);

// The three products of a projection y = x W^T, where W is [N, K] row-major (torch.nn.Linear's
// weight: N outputs, K inputs), over M rows; row-major [M, ...] operands, leading dimension = row
// width. Every projection of the model (q, k, v, o, gate, up, down, the LM head) goes through
// this one function, so that a change of how projections compute (tensor parallelism's split of
// W) is made here; with ModelOptions::fp8 the blocks' projections (not the LM head, not the MoE
// experts) call Backend::linear_fp8 with the same arguments instead (LlamaModel::proj). The backend's gemm computes in S (fp32 for bf16 storage).
//   Forward:    out[M, N]  (+)=  a[M, K] · b[N, K]^T     a = x,  b = W,  out = y
//   InputGrad:  out[M, K]  (+)=  a[M, N] · b[N, K]       a = dy, b = W,  out = dx
//   WeightGrad: out[N, K]  (+)=  a[M, N]^T · b[M, K]     a = dy, b = x,  out = dW (the model accumulates)
// accumulate: out += product (beta 1), else out = product (beta 0; out is not read). Pointers are
// backend memory and must not alias out. Errors: those of Backend::gemm.
enum class LinearRole { Forward, InputGrad, WeightGrad };
template <typename T>
void linear(Backend<T>& be, LinearRole role, int M, int N, int K, const T* a, const T* b, T* out, bool accumulate);

// The blocks [begin, end) of a model of L blocks (0 <= begin <= end <= L), as one pipeline stage runs
// them, and where the UnitSource it is given holds the units they use. A range uses the embedding
// (unit 0) when begin == 0, blocks begin..end-1 (units 1+l), and the final norm and head (unit L+1,
// and unit 0 again for a tied head) when end == L, and under ep > 1 its MoE blocks' expert units.
// units[u] is the index in the UnitSource of model unit u in [0, llama_num_units(c, ep)), -1 for a
// unit it does not hold; empty: the identity (the whole model's plan). A stage's plan holds only
// its units (llama_stage_units), so its map is not the identity.
struct BlockRange {
  int begin = 0, end = 0;
  std::vector<int> units;
  // The UnitSource index of model unit u; std::logic_error when the map says it is not held.
  int unit(int u) const;
};
// The units of a stage over blocks [begin, end) of config c (llama_units' slices, in model order):
// the embedding when begin == 0 or (end == L and the head is tied: the LM head reads it; the
// pipeline then owns summing that gradient with the first stage's), the blocks, the final norm
// (and lm_head when untied) when end == L. llama_stage_range: the same range with the map into
// these units. std::invalid_argument when not 0 <= begin <= end <= L.
std::vector<UnitSpec> llama_stage_units(const ModelConfig& c, int begin, int end, int tp = 1, int tp_rank = 0,
                                        int ep = 1, int ep_rank = 0);
BlockRange llama_stage_range(const ModelConfig& c, int begin, int end, int ep = 1);

// One training micro-batch, as the caller runs it (src/parallel/stage_runner.cpp, one stage):
//   model.forward(f, tokens, B, T);                         // embedding, blocks, final norm
//   loss_sum += model.head_backward(f, targets, scale);     // LM head + loss with their backward, chunked
//   model.backward(f);                                      // blocks, then the embedding
// Evaluation: forward, then loss(f, targets). Generation: forward, then head_logits(f), logits().
// The head step must follow forward() on the same UnitSource with no gather in between by other
// code (it uses the final norm's unit as forward left it gathered, and gathers it again when this
// model gathered since); out of order calls throw std::logic_error.
//
// The same over a range of blocks, several micro-batches in flight (a pipeline stage): each
// micro-batch has a Context, owned by the caller, that holds what its backward needs from its
// forward (the blocks' kept activations, the range's output or the final norm's, the residual
// gradient, the ids); scratch that is dead between calls (recomputed blocks, activation gradients,
// logits chunks, RoPE tables) is the model's and shared. Per micro-batch and range:
//   model.forward(f, ctx, tokens, input, B, T);    // begin == 0: tokens; else input [R, C] (the
//                                                  // previous range's ctx.output())
//   end == L: loss += model.head_backward(f, ctx, targets, scale);
//   model.backward(f, ctx, output_grad);           // end < L: d(loss)/d(output) [R, C] (the next
//                                                  // range's ctx.input_grad()); end == L: nullptr
//   begin > 0: ctx.input_grad() is d(loss)/d(input) [R, C]
// Zero-bubble schedules (ZB-H1; Qi et al. 2024, "Zero Bubble Pipeline Parallelism") split the
// backward in two: model.backward_input(f, ctx, output_grad) in place of backward, then, any time
// later (before ctx's next forward), model.backward_weight(f, ctx). Together they leave bitwise
// what backward leaves (below).
// R = B*T / tp rows of this rank (sequence parallelism; B*T without TP). The whole-model calls are
// these over one context of [0, L) held by the model; ranges [0, a), [a, b), [b, L) chained compute
// bitwise what the whole model does (the same kernels on the same values, the same UnitSource
// requests in the same order).
template <typename T> class LlamaModel {
 public:
  using S = typename Backend<T>::S;  // scalar type: float for float and bf16, double for double

 private:
  // One block's activations (which of them exist depends on the Recompute mode, see above).
  struct Layer {
    Buffer<T> x, rstd1, q, k, v, att, y, x1, rstd2, g, u, h;
    Buffer<T> qp, kp, rq, rk;  // q/k norm only: q and k before it, its rstd [BT*NH], [BT*NKV]
    AccBuffer<T> lse;
    // MoE blocks: g, u, h are [slots, IE] in slot-sorted order; ye the experts' outputs [slots, C];
    // probs [BT, E], wts [BT*K], zlse (the router logits' logsumexp, the z-loss's) [BT] (S); experts
    // [BT*K], rowtok (the token of each sorted row) and pos (the sorted row of each slot), int32;
    // eoff: expert e's rows are [eoff[e], eoff[e+1]) (host).
    Buffer<T> ye;
    AccBuffer<T> probs, wts, zlse;
    IdBuffer<T> experts, rowtok, pos;
    std::vector<int32_t> eoff;
    std::vector<int64_t> routed;  // the slots of real tokens (not padding) per expert [E] (host; expert_counts)
    // EP (ep_ set): every EP rank's slots per expert [N, E] (host; all_gather_counts) and the rows
    // this rank's experts got (g, u, h hold that many).
    std::vector<int64_t> ecnt;
    int64_t nrecv = 0;
  };
  // What backward_weight needs of one block, kept from backward_input (deferred_weight_bytes). The
  // operands of the weight-gradient GEMMs (LinearRole::WeightGrad: out += dy^T x) that the context
  // does not keep anyway, and the RMSNorm weight gradients. dr2, dr1, n2, n1: [BT, C] (all rows:
  // under TP as all-gathered); dg, du, h: [BT, I]; dq, y: [BT, Q]; dk, dv: [BT, KV]; dnorm: [2, C].
  struct Deferred {
    Buffer<T> dr2, dr1, n2, n1;  // down's and o's dy (d(x_next), d(x1)); gate/up's and q/k/v's x
    Buffer<T> dg, du, h;         // gate's and up's dy; down's x (h; empty under Recompute::None: kept)
    Buffer<T> dq, dk, dv, y;     // q/k/v's dy after the RoPE backward; o's x (y; only Recompute::Full)
    Buffer<T> dnorm;             // d(input_layernorm.weight) [C], d(post_attention_layernorm.weight) [C]
                                 // (q/k norm: then d(q_norm.weight) [HD], d(k_norm.weight) [HD])
  };
  // Where a micro-batch is: which call may come next. WeightPending: after backward_input, until
  // backward_weight.
  enum class Stage { None, Forward, HeadBackward, WeightPending };

 public:
  // One micro-batch's state over a BlockRange between its forward and its backward. Allocated by
  // the model at forward() for the micro-batch's B x T (activation_bytes' per-layer part for its
  // blocks, plus [R, C] output and gradient, plus the ids, the final norm's input, output and rstd
  // when end == L); movable, not copyable; must not outlive the model's backend.
  class Context {
   public:
    Context() = default;
    explicit Context(BlockRange r) : r_(std::move(r)) {}
    const BlockRange& range() const { return r_; }
    // After forward() with end < L: the range's output activation [R, C] (backend memory).
    const T* output() const { return xf_.data(); }
    // After backward() or backward_input() with begin > 0: d(loss)/d(the range's input) [R, C]
    // (backend memory; backward_weight leaves it as it is).
    const T* input_grad() const { return dres_.data(); }
    // Bytes of backend memory this context holds for deferred weight gradients: 0 before its first
    // backward_input, then deferred_weight_bytes(..., range's blocks, ...) (kept for reuse).
    int64_t deferred_bytes() const {
      int64_t n = 0;
      for (const Deferred& k : w_)
        for (const Buffer<T>* b : {&k.dr2, &k.dr1, &k.n2, &k.n1, &k.dg, &k.du, &k.h, &k.dq, &k.dk, &k.dv, &k.y,
                                   &k.dnorm})
          n += static_cast<int64_t>(b->size() * sizeof(T));
      return n;
    }
    // True between backward_input() and backward_weight().
    bool weight_pending() const { return stage_ == Stage::WeightPending; }

   private:
    friend class LlamaModel;
    BlockRange r_;
    int B_ = 0, T_ = 0;
    Stage stage_ = Stage::None;
    const T* head_w_ = nullptr;      // unit L+1 as forward() gathered it (valid until the next gather)
    int64_t head_gathers_ = -1;      // the model's gather count right after that gather
    std::vector<Layer> layers_;      // blocks begin..end-1
    std::vector<Deferred> w_;        // blocks begin..end-1: backward_input's kept W inputs (empty before)
    Buffer<T> xf_, lnf_, rstdf_;     // the range's output (the final norm's input); end == L: its output, rstd
    Buffer<T> dres_;                 // d(loss)/d(residual stream), backward's running gradient
    IdBuffer<T> tokens_, targets_;   // begin == 0 / end == L: the micro-batch's ids in backend memory
    IdBuffer<T> ids_tp_;             // TP > 1, begin == 0: tokens as rows of this rank's embedding slice
    IdBuffer<T> pos_, doc_;          // the layout's positions and documents [B, T] (mask Document, or
                                     // allocated at the first forward given a layout)
    bool use_pos_ = false, use_doc_ = false;  // this micro-batch's layout changes RoPE / the mask
    // MoE: per scope group g (aux_scope: the B rows, or 1) the routed slots per expert, counts_
    // [G, E] (host), and the probabilities' sums psum_ [G, E], over the range's MoE blocks; the
    // aux loss's gradient per group aux_dprob_ [G, E] and its weight aux_scale_ (0: none). The
    // router z-loss's sums of lse^2 zsum_ [G], its gradient's weight per token of group g z_dlse_
    // [G] and its weight z_scale_ (0: none).
    std::vector<double> counts_;
    AccBuffer<T> psum_, aux_dprob_, zsum_, z_dlse_;
    S aux_scale_ = S(0), z_scale_ = S(0);
    // seed_aux_stats' [2 G E + G] for the next forward (empty: that forward starts from zeros).
    std::vector<double> aux_seed_;
    // MoE with a layout's `real` flags (TokenLayout): the rows' flags (host [BT]; empty: every row
    // real) and per scope group the real rows, summed over the CP group (R of the group = that x
    // the MoE blocks).
    std::vector<int32_t> real_;
    std::vector<double> real_n_;
  };

  // tp: the TP group's collectives (tensor_parallel_ops.h), nullptr or size 1 = no tensor parallelism; must
  // outlive the model. Under TP the UnitSource serves this rank's slices (llama_units(c, N, t)).
  // cp: context-parallel attention (context_parallel_ops.h, above), nullptr or size 1 = none; must
  // outlive the model; its backend memory is this model's backend's. Under CP every forward's T_ is
  // the rows held per sequence (T / cp) and its layout must give positions.
  // Throws std::invalid_argument when tp does not fit the model (check_tensor_parallel), or when cp
  // is given with --attention exact (CP runs the tiled block kernels only).
  // ep: expert parallelism's transfers (expert_parallel_ops.h, above), nullptr or size 1 = none;
  // must outlive the model; std::invalid_argument when its size does not divide num_experts, or
  // when given for a dense model. With ep of size N > 1 the UnitSource serves llama_units(c, 1, 0,
  // N, ep->rank()) (each MoE block's experts a unit of their own) and must keep a block's unit
  // gathered, and one gradient buffer of it out, while the block's expert unit is gathered and its
  // gradient handed back: GroupedUnits does (the parallel layer's; a single UnitPipeline does not).
  LlamaModel(const ModelConfig& c, Backend<T>& be, const ModelOptions& o = {}, TensorParallelOps<T>* tp = nullptr,
             ContextParallelOps<T>* cp = nullptr, ExpertParallelOps<T>* ep = nullptr);

  // Collective (gathers units 0, 1..L, L+1). tokens: host array [B, T] of ids in [0, V). Runs the
  // embedding, the blocks and the final norm, keeping what backward() needs (options().recompute).
  // layout: the micro-batch's positions and documents (TokenLayout; default: causal).
  // Throws std::invalid_argument if T (under CP: cp x T_) exceeds max_position_embeddings, a token is
  // out of range, a layout position is outside [0, T), or under CP the layout has no positions
  // (before any collective).
  void forward(UnitSource<T>& f, const int32_t* tokens, int B, int T_, const TokenLayout& layout = {}) {
    forward(f, ctx_, tokens, nullptr, B, T_, layout);
  }
  // Collective (gathers unit 0 again when tied). After forward(): the LM head and cross-entropy
  // over chunks of options().loss_chunk tokens (no [B*T, V] buffer). targets: host [B, T], ids in
  // [0, V) (std::invalid_argument otherwise, before any collective). Returns the sum over the B*T
  // positions of the cross-entropy (nats).
  double loss(UnitSource<T>& f, const int32_t* targets) { return loss(f, ctx_, targets); }
  // Collective. After forward(): the same loss (bitwise), and per chunk, while its logits exist,
  // the head's backward: dlogits = d(loss)/d(logits) * grad_scale in place, dlnf = dlogits W,
  // dW += dlogits^T lnf; then the final norm's backward. The head's weight gradient is
  // reduce-scattered into its shard (unit 0 when tied, and unit L+1). grad_scale is usually
  // 1 / (tokens per rank per optimizer step). Returns the loss sum, as loss() does.
  double head_backward(UnitSource<T>& f, const int32_t* targets, S grad_scale) {
    return head_backward(f, ctx_, targets, grad_scale);
  }
  // Collective. After head_backward(): the backward of the blocks and the embedding; adds the
  // gradients, averaged over ranks, into f's gradient shards (one reduce-scatter per unit).
  void backward(UnitSource<T>& f) { backward(f, ctx_, nullptr); }

  // The range calls (see above). forward: collective over the range's units in order (0 when
  // begin == 0, 1+begin..end, L+1 when end == L); tokens (host [B, T], begin == 0) or input
  // (backend [R, C], begin > 0) must be given, the other is ignored; std::invalid_argument for a bad
  // range or unit map, a missing input, T past max_position_embeddings, a token out of range or a
  // layout position outside [0, T) (before any collective). Every range of a micro-batch takes its
  // layout (every block attends). loss / head_backward: as the whole-model ones, on a context whose
  // range ends at L (std::logic_error otherwise or out of order). backward: after head_backward()
  // (end == L, output_grad ignored) or forward() (end < L, output_grad required: backend [R, C]);
  // blocks end-1..begin, then the embedding when begin == 0; else leaves ctx.input_grad().
  void forward(UnitSource<T>& f, Context& ctx, const int32_t* tokens, const T* input, int B, int T_,
               const TokenLayout& layout = {});
  double loss(UnitSource<T>& f, Context& ctx, const int32_t* targets);
  double head_backward(UnitSource<T>& f, Context& ctx, const int32_t* targets, S grad_scale);
  void backward(UnitSource<T>& f, Context& ctx, const T* output_grad);

  // backward() in two halves, for zero-bubble pipeline schedules (ZB-H1, above).
  // backward_input: the same preconditions and arguments as backward (after head_backward() when
  // end == L, output_grad ignored; after forward() otherwise, output_grad [R, C] required). Computes
  // d(loss)/d(input) through blocks end-1..begin: leaves ctx.input_grad() (begin > 0) bitwise as
  // backward does, and keeps in ctx what the weight gradients need (Deferred above, sized by
  // deferred_weight_bytes; allocated at the first call on ctx, reused after). Collective like
  // backward's blocks: gathers units 1+l, l = end-1 .. begin, and under TP / CP the same group
  // collectives; it touches no gradient buffer of f (no full_grad, no reduce_scatter_grad). The head
  // is not split: head_backward already added (and reduce-scattered) the LM head's and the final
  // norm's gradients.
  // backward_weight: after backward_input on ctx (any calls on other contexts in between). For each
  // block l = end-1 .. begin: f.full_grad(1+l), the weight-gradient GEMMs and the RMSNorm weight
  // gradients from what ctx kept, f.reduce_scatter_grad(1+l); then, begin == 0, the embedding's
  // gradient into unit 0 (full_grad(0), reduce_scatter_grad(0)); under TP that reads all rows of the
  // residual gradient: an all-gather over the TP group first, as in backward. Gathers no unit.
  // Afterwards ctx may take a forward again (its kept buffers stay allocated for the next one).
  // Together: f's gradient shards receive bitwise the reduce-scatters backward would send, one per
  // unit, in the order the backward_weight calls are made (so micro-batches whose W run in another
  // order than their backward_input accumulate in that other order). Every rank of a stage's FSDP
  // group (and TP group) must make the same calls in the same order, as for backward.
  // std::logic_error: backward_weight without a pending backward_input on ctx; backward_input,
  // backward, head_backward, loss or forward on a context whose backward_weight is pending; a
  // forward() of another micro-batch size in between (as for backward).
  void backward_input(UnitSource<T>& f, Context& ctx, const T* output_grad);
  void backward_weight(UnitSource<T>& f, Context& ctx);

  // Mixture of experts (docs/moe.md). After forward() of ctx over a range that ends at block L
  // (the whole model, or the last pipeline stage's after seed_aux_stats; std::logic_error
  // otherwise): the load-balancing loss of its micro-batch, aux_g = E sum_e f_e P_e
  // for each group g of options().aux_scope (f_e = slots of the group's tokens routed to e, P_e =
  // their probabilities of e summed, both over every MoE block, divided by R_g = MoE blocks x the
  // group's tokens: transformers' load_balancing_loss_func), summed over the groups (Sequence: the
  // B rows; MicroBatch: one group). 0 for a dense model. Not collective.
  double moe_aux_loss(const Context& ctx) const;
  double moe_aux_loss() const { return moe_aux_loss(ctx_); }
  // The router z-loss (ST-MoE, Zoph et al. 2022, eq. 5), the same way: z_g = the mean of
  // logsumexp(router logits)^2 over the group's real tokens and every MoE block (divided by the
  // same R_g), summed over the groups. 0 for a dense model; std::logic_error as moe_aux_loss.
  double moe_z_loss(const Context& ctx) const;
  double moe_z_loss() const { return moe_z_loss(ctx_); }
  // The weights of those sums in the gradient of ctx's next backward(): it adds
  // scale x d(moe_aux_loss)/d(parameters) (through the routing probabilities) + z_scale x
  // d(moe_z_loss)/d(parameters) (through the router logits); 0 adds nothing. After forward(),
  // before backward(); std::logic_error as moe_aux_loss.
  void set_aux_grad_scale(Context& ctx, S scale, S z_scale = S(0));
  void set_aux_grad_scale(S scale, S z_scale = S(0)) { set_aux_grad_scale(ctx_, scale, z_scale); }
  // Pipeline stages (StageRunner): the load-balancing loss pools every MoE block of a micro-batch,
  // so its statistics travel with the activations and its gradient with theirs. All host doubles,
  // not collective; a dense model has none (aux_stats_size 0, the rest no-ops).
  //   aux_stats_size(B)  2 G E + G for a micro-batch of B rows (G: B under scope Sequence, 1 under
  //                      MicroBatch); aux_grad_size(B): G E + G + 2.
  //   aux_stats          after forward() of ctx: aux_stats_size doubles, the slots per group and
  //                      expert routed by blocks [0, ctx's end) of this rank's rows, their
  //                      probability sums, then the z-loss's sums per group (S widened: exact).
  //   seed_aux_stats     before forward() of a range that starts after block 0: what the previous
  //                      range's aux_stats wrote for the same micro-batch. That forward adds its
  //                      blocks to them instead of to zeros: the sums of one range over [0, L), in
  //                      the same order, so the last range's moe_aux_loss and set_aux_grad_scale
  //                      are the whole model's (under CP its end sums them over the CP group, as then).
  //   aux_grad           after set_aux_grad_scale of ctx (the last range): aux_grad_size doubles,
  //                      d(aux)/d(p) per group and expert times the scale, the z-loss's weight per
  //                      token of each group (both as S), then the two scales.
  //   set_aux_grad       before backward() of an earlier range of that micro-batch: what aux_grad
  //                      wrote, in place of set_aux_grad_scale (which needs the totals).
  // std::invalid_argument: a vector of another size than the micro-batch's.
  size_t aux_stats_size(int B) const;
  size_t aux_grad_size(int B) const;
  std::vector<double> aux_stats(const Context& ctx) const;
  void seed_aux_stats(Context& ctx, std::vector<double> in) const;
  std::vector<double> aux_grad(const Context& ctx) const;
  void set_aux_grad(Context& ctx, const std::vector<double>& in);
  // The slots block l routed to each expert in ctx's last forward (host, [E]; they sum to K x the
  // real tokens: B*T less the layout's padding rows). Empty for a dense block or a block outside
  // ctx's range.
  std::vector<int64_t> expert_counts(const Context& ctx, int l) const;
  std::vector<int64_t> expert_counts(int l) const { return expert_counts(ctx_, l); }

  // Collective (gathers unit 0 again when tied). After forward(): the logits [B*T, V] into a model
  // buffer (allocated here, B*T*V elements), for generation and export checks. Not under tensor
  // parallelism (std::logic_error).
  void head_logits(UnitSource<T>& f);
  // The logits of the last head_logits(), copied to host, [B*T, V] row-major. Not collective.
  std::vector<T> logits();

  const ModelConfig& config() const { return c_; }
  const ModelOptions& options() const { return o_; }
  // Allocates the activation buffers for micro-batches of B x T_ tokens (forward does it lazily):
  // the shared scratch and the whole-model context, activation_bytes(c, options, B, T_, ..., tp)
  // in total. Throws std::bad_alloc, and std::invalid_argument when the TP degree does not divide
  // B*T_.
  void reserve(int B, int T_) {
    ensure(B, T_);
    ensure_context(ctx_);
  }

 private:
  struct Offsets {  // flat offsets inside a block unit
    int64_t ln1, q, k, v, o, ln2, gate, up, down;
    int64_t qn = -1, kn = -1;  // q_norm, k_norm (ModelConfig::qk_norm), else -1
    int64_t router = -1, egu = -1, edown = -1;  // MoE blocks: mlp.gate, experts.gate_up_proj, experts.down_proj
  };
  // f.gather(u), counted (gathers_): the head knows whether unit L+1 is still where forward() left it.
  const T* gather(UnitSource<T>& f, int u) {
    ++gathers_;
    return f.gather(u);
  }
  void ensure(int B, int T_);
  void ensure_context(Context& ctx);  // sized for d_ (B, T), when it is not yet
  void ensure_rows();                 // rows_ sized for d_ and filled, when it is not yet
  void check_range(const BlockRange& r) const;           // std::invalid_argument if not a range of this model
  // std::invalid_argument if one is outside [0, V); targets: kNoTarget (-1, no loss) allowed too.
  void check_ids(const int32_t* ids, int64_t n, bool targets = false) const;
  void expect_stage(const Context& ctx, Stage s, const char* call) const;  // std::logic_error if not at s
  // The embedding of ctx's tokens into x0 [R, C] (collective: gathers unit 0).
  void embed(UnitSource<T>& f, Context& ctx, const int32_t* tokens, T* x0);
  // Forward of block l (ctx's micro-batch) with weights w from input x: fills the activations of
  // `a` and, when xn is not nullptr, writes the block output to xn (else stops before the down
  // projection: recompute).
  // Under ep > 1 an MoE block gathers its expert unit from f after its router (expert_weights).
  void block_forward(UnitSource<T>& f, const Context& ctx, int l, const T* w, const T* x, Layer& a, T* h, T* att,
                     T* xn);
  // The MLP sub-block of MoE block l on n2 = rmsnorm(x1) (ln_): the routing into a, its experts'
  // g, u, h and ye; with xn the combine x_next = x1 + sum_j w_j ye. Its backward: d(n2) into dln_
  // from dres (d x_next), the weight gradients into gw (the block unit's full gradient).
  // Under ep > 1 the experts' weights are block l's expert unit, gathered from f after the router
  // (GroupedUnits keeps the block's unit gathered meanwhile), and their gradients go to that unit's
  // full gradient, reduce-scattered before moe_backward returns; else both are the block's (w, gw).
  void moe_forward(UnitSource<T>& f, const Context& ctx, int l, const T* w, Layer& a, T* h, T* xn);
  void moe_backward(UnitSource<T>& f, Context& ctx, int l, const T* w, Layer& a, const T* h, T* gw);
  // Block l's experts' weights: its expert unit, gathered (ep > 1), or the block's own `w`.
  const T* expert_weights(UnitSource<T>& f, const Context& ctx, int l, const T* w);
  // Under ep > 1: std::logic_error unless f keeps 2 units gathered at once (gathered_groups).
  void check_expert_source(const UnitSource<T>& f) const;
  // The routing's host half: a's experts to the host, sorted by expert (counting sort, stable), into
  // a.rowtok, a.pos, a.eoff.
  void moe_sort(Layer& a);
  // Rows [r0, r0 + n) of an expert-major buffer, all routed to expert e of the weights at hand
  // (the block's E experts, or under EP its expert unit's E / ep).
  struct ExpertRows {
    int e;
    int64_t r0, n;
  };
  // The experts of an MoE block (weights w) on the row runs `rs` of x [rows, C]: g, u = x W_gate^T,
  // x W_up^T [rows, IE]; y = h W_down^T. Their backward, split into what each row needs alone and
  // what sums over an expert's rows: dh = dy W_down and dx = dg W_gate + du W_up (row by row; dg, du
  // from swiglu_backward), gw += dy^T h (down_proj) and gw += dg^T x, du^T x (gate_up_proj), one GEMM
  // per run. A row's values can depend on the run it is in (OpenBLAS's kernels and the CPU
  // backend's tiles follow the GEMM's shape: a row cut into another run may differ in the last
  // bits); the weight gradients take an expert's rows whole, in one run each.
  void experts_gate_up(const T* w, const T* x, const std::vector<ExpertRows>& rs, T* g, T* u);
  void experts_down(const T* w, const T* h, const std::vector<ExpertRows>& rs, T* y);
  void experts_down_dinput(const T* w, const T* dy, const std::vector<ExpertRows>& rs, T* dh);
  void experts_down_dweight(const T* dy, const T* h, const std::vector<ExpertRows>& rs, T* gw);
  void experts_gate_up_dinput(const T* w, const T* dg, const T* du, const std::vector<ExpertRows>& rs, T* dx);
  void experts_gate_up_dweight(const T* dg, const T* du, const T* x, const std::vector<ExpertRows>& rs, T* gw);
  // EP forward on the runs rs of the received rows: gathered expert-major from xr_ (perm_) into
  // xs_, the experts' forward into a.g, a.u, h and ys_.
  void ep_experts_forward(const T* we, Layer& a, T* h, const std::vector<ExpertRows>& rs);
  // Each expert's rows whole, from expert-major offsets eo (expert j: rows [eo[j], eo[j+1])).
  static void expert_runs(const std::vector<int32_t>& eo, std::vector<ExpertRows>& out);
  // EP: from a.ecnt and a.eoff, the rows sent to and received from each rank (ep_send_, ep_recv_,
  // their offsets ep_send_at_, ep_recv_at_), the received rows' expert-major offsets (ep_eoff_) and
  // row runs (ep_all_: each expert's rows; ep_own_[0], ep_own_[1]: the first and second half of the
  // rows this rank sent itself; ep_other_: the other ranks' rows) and the permutations between the
  // order received and expert-major (perm_: expert-major row r is received row perm_[r]; inv_ its
  // inverse), in backend memory; a.nrecv. No communication.
  void ep_routes(Layer& a);
  void grow_expert_scratch(size_t rows);   // EP: the scratch for a block's expert rows (llama_moe.cpp)
  T* grow_expert_rows(Layer& a, T* h);     // ... a's g, u and h's buffer; returns h
  // Rows of an MoE block's expert buffers (g, u, h) filled for `a`: a.nrecv under EP, else slots.
  size_t expert_rows(const Layer& a) const { return static_cast<size_t>(ep_ ? a.nrecv : d_.slots); }
  bool is_moe(int l) const { return !moe_layer_.empty() && moe_layer_[static_cast<size_t>(l)]; }
  // R of the load-balancing loss: the rows one scope group pools over the MoE blocks, its tokens
  // whole (under CP the group's rows: Tg = cp x T_ per sequence) times the MoE blocks.
  double aux_rows(const Context& ctx, size_t g) const {
    if (!ctx.real_n_.empty()) return static_cast<double>(moe_blocks_) * ctx.real_n_[g];
    return static_cast<double>(moe_blocks_) *
           (o_.aux_scope == MoeAuxScope::Sequence ? double{1} * d_.Tg : double{1} * d_.B * d_.Tg);
  }
  // The runs of rows [t0, t1) of one scope group that are all real or all padding (ctx.real_,
  // non-empty), in order: f(t0, t1, group, real).
  template <typename F> void real_runs(const Context& ctx, F&& f) const {
    const int n = d_.BT, grp = o_.aux_scope == MoeAuxScope::Sequence ? d_.T_ : d_.BT;
    for (int t0 = 0; t0 < n;) {
      const bool real = ctx.real_[static_cast<size_t>(t0)] != 0;
      int t1 = t0 + 1;
      while (t1 < n && t1 % grp != 0 && (ctx.real_[static_cast<size_t>(t1)] != 0) == real) ++t1;
      f(t0, t1, t0 / grp, real);
      t0 = t1;
    }
  }
  const Offsets& offsets(int l) const { return is_moe(l) ? moe_off_ : dense_off_; }
  // The layout's checks (std::invalid_argument) and, in set_layout, its copy into ctx (use_pos_ /
  // use_doc_ only where it changes something).
  void check_layout(const TokenLayout& lay, int B, int T_) const;
  void set_layout(Context& ctx, const TokenLayout& lay);
  // RoPE (forward or backward) of the queries q [BT, NH, HD] and keys k [BT, NKV, HD] at ctx's
  // positions: one Backend::rope_qk call.
  void rope_qk(const Context& ctx, T* q, T* k, bool backward);
  // q/k norm (qk_norm): raw [BT, H*HD] -> out, RMSNorm of each head's HD values with weight wn, its
  // rstd [BT*H] into rstd; backward: d(out) in d (in place) becomes d(raw), d(wn) added into dwn.
  void head_norm(T* out, T* rstd, const T* raw, const T* wn, int H);
  void head_norm_backward(T* d, T* dwn, const T* raw, const T* wn, const T* rstd, int H);
  // Attention of block activations `a` (tiled: y, lse; exact: att, y), and its backward into dq,
  // dk, dv ([BT, Q], [BT, KV] x 2; dq_, dk_, dv_ or a Deferred's) from dy_: causal (flash_attention_* / the exact path) or, with ctx's documents, the
  // block attention kernels over the whole sequence as one block (masked tile pairs skipped).
  void attend(const Context& ctx, Layer& a, T* att);
  void attend_backward(const Context& ctx, const Layer& a, const T* att, T* dq, T* dk, T* dv);
  // Backward of block l (ctx's) with weights w: ctx.dres_ from d(block output) to d(block input).
  // keep == nullptr (backward): the weight gradients into the full-unit gradient (f.full_grad,
  // taken after any recomputation) as soon as their operands exist. keep given (backward_input): no
  // weight gradient GEMM and no f call; their operands into *keep, the RMSNorm weight gradients
  // into keep->dnorm.
  void block_backward(UnitSource<T>& f, Context& ctx, int l, const T* w, Deferred* keep);
  // backward_weight's part of block l: the weight gradients into gw (zeroed: f.full_grad) from
  // what block_backward kept.
  void block_weight(const Context& ctx, int l, T* gw);
  // backward / backward_input's checks and the start of dres_; the embedding's gradient (begin == 0).
  void start_backward(Context& ctx, const T* output_grad, const char* call);
  void embedding_backward(UnitSource<T>& f, Context& ctx);
  // ctx.w_ allocated for d_'s micro-batch (deferred_weight_bytes), when it is not yet.
  void ensure_deferred(Context& ctx);
  // backward_input: the rows [BT, C] the weight gradients read of the local [R, C] `local` into
  // `into` (TP: all-gathered, as gather_rows; else copied); and a block's RMSNorm output, recomputed
  // as block_backward does, into ln_ / full_ (into == nullptr, as gather_rows) or into `into`.
  const T* keep_rows(const T* local, Buffer<T>& into);
  const T* norm_rows(T* rstd, const T* x, const T* wn, Buffer<T>* into);
  // The LM head and the loss over chunks; with `grad` their backward and the final norm's. See
  // loss() and head_backward().
  double head(UnitSource<T>& f, Context& ctx, const int32_t* targets, bool grad, S grad_scale);
  // Where block l's activations are in backward (recomputed first when not kept).
  Layer& backward_activations(UnitSource<T>& f, Context& ctx, int l, const T* w);
  // Sequence parallelism (TP > 1; identity without): the full [BT, C] rows of the local [R, C]
  // `local`, all-gathered into `into` (full_ or dfull_); without TP `local` itself.
  const T* gather_rows(const T* local, Buffer<T>& into);
  // out[R, C] = x + (in[BT, K] W[C, K]^T), the product summed over the TP group and
  // reduce-scattered (row-parallel o / down); without TP: out = x, then the GEMM accumulates.
  void row_parallel_residual(const T* in, int K, const T* W, const T* x, T* out);
  // A transformer block's projection: linear(be_, role, ...), or with o_.fp8 the backend's
  // linear_fp8 of the same product (same shapes and accumulate semantics). Only the blocks call
  // it; the LM head and the MoE experts / router call linear() itself.
  void proj(LinearRole role, int M, int N, int K, const T* a, const T* b, T* out, bool accumulate);
  // After the input-gradient GEMMs wrote the full partial gradient of a column-parallel input into
  // dfull_ (TP > 1): reduce-scatters it into dln_. No-op without TP (they wrote dln_ directly).
  void reduce_input_grad();
  T* input_grad() { return tp_n_ > 1 ? dfull_.data() : dln_.data(); }  // where those GEMMs write

  ModelConfig c_;
  ModelOptions o_;
  Backend<T>& be_;
  TensorParallelOps<T>* tp_ = nullptr;  // the TP group; nullptr without TP
  ContextParallelOps<T>* cp_ = nullptr;  // the CP group's attention; nullptr without CP
  ExpertParallelOps<T>* ep_ = nullptr;   // the EP group's transfers; nullptr without EP
  int tp_n_ = 1, tp_rank_ = 0;
  LlamaDims d_;
  S eps_ = S(0), attn_scale_ = S(0);  // rms_norm_eps; 1 / sqrt(HD)
  Offsets dense_off_{};           // a dense block's offsets
  Offsets moe_off_{};               // the offsets of an MoE block (attention part as off_'s)
  std::vector<char> moe_layer_;     // per block: MoE (empty for a dense model)
  // ep > 1: each MoE block's experts are a unit of their own (llama_units), moe_off_.egu / .edown
  // are offsets in it; else they are in the block's unit.
  bool own_experts_ = false;
  std::vector<int> expert_unit_;    // own_experts_: per block, its experts' unit (llama_expert_unit; -1 dense)
  int moe_blocks_ = 0;              // how many
  int64_t head_off_norm_ = 0, head_off_w_ = 0;
  Context ctx_;                   // the whole-model calls' micro-batch, blocks [0, L)
  int64_t gathers_ = 0;           // gathers made through this model (gather())
  Layer work_;                    // recomputed block (Selective: h, exact att; Full: all)
  Buffer<T> chunk_logits_, logits_, cos_, sin_;
  Buffer<T> ln_;  // a block's RMSNorm output [B*T, C], forward and (recomputed) backward
  Buffer<T> dln_, dq_, dk_, dv_, datt_, dy_, dh_, dg_, du_;
  Buffer<T> dqk_;  // q/k norm only: the norm backward's d(raw) [BT, Q] before it replaces d(q) / d(k)
  // MoE only: the gathered expert inputs [slots, C] (forward and backward), d(ye) and then d(xe)
  // [slots, C], router logits and their gradient [BT, E], d(weights) [slots]; host staging.
  Buffer<T> xe_, dye_, rl_;
  AccBuffer<T> dwts_;
  std::vector<int32_t> ex_host_, sort_host_;
  // EP only (empty without): the rows received [rows, C], the same expert-major (the experts'
  // inputs in backward), the experts' outputs / gradients expert-major; the permutations [rows]
  // (ep_routes) and their host side. Sized for balanced routing (rows = B·T·k) and grown to the
  // most rows a block's experts got (grow_expert_scratch; up to er, the worst case).
  Buffer<T> xr_, xs_, ys_;
  IdBuffer<T> perm_, inv_;
  std::vector<size_t> ep_send_, ep_recv_, ep_send_at_, ep_recv_at_;
  std::vector<int32_t> ep_eoff_, perm_host_;
  std::vector<ExpertRows> ep_all_, ep_own_[2], ep_other_, runs_;
  AccBuffer<T> dsum_;  // tiled attention backward: rowsum(dy * y) [B, NH, T]
  IdBuffer<T> rows_;   // block attention with documents: each token's index t in its row [B, T]
  // TP > 1 only (empty without TP). full_: an all-gathered [BT, C] (an RMSNorm output; in the head
  // step the final norm's, which the head reads); dfull_: a [BT, C] gradient (the all-gathered
  // residual gradient, or the partial input gradient before its reduce-scatter); the
  // cross-entropy's row maxima [chunk], the group's [N, chunk] and the sums [2 * chunk].
  Buffer<T> full_, dfull_;
  std::vector<int32_t> ids_host_;  // ids_tp_'s host staging (kept: no allocation per micro-batch)
  AccBuffer<T> ce_mx_, ce_maxes_, ce_st_;
};

// RoPE tables for positions [0, T) and pairs [0, HD/2) with HD/2 = inv_freq.size(): cos/sin of
// t * inv_freq[j], row-major [T, HD/2], computed in double. inv_freq: rope_inv_freqs(config).
template <typename T>
void rope_tables(std::vector<T>& cos, std::vector<T>& sin, int T_, const std::vector<double>& inv_freq);

// Causal self-attention with GQA on already-projected, RoPE-rotated q [B*T, NH*HD],
// k and v [B*T, NKV*HD]; writes att [B, NH, T, T] (softmax probabilities) and y [B*T, NH*HD]
// (y == nullptr: the probabilities only). Query head h reads key/value head h / (NH/NKV). The
// exact path (--attention exact), and the reference the tiled path is tested against.
// doc: document ids [B, T] (int32, backend memory) or nullptr; given, query t also sees only keys
// of its own document (softmax_causal_doc_forward; the backward is unchanged, masked
// probabilities are 0). nullptr is bitwise the causal-only path.
template <typename T>
void attention_forward(Backend<T>& be, const T* q, const T* k, const T* v, T* att, T* y, int B, int T_, int NH,
                       int NKV, int HD, const int32_t* doc = nullptr);
// Given dy, writes dq (=), and dk, dv (=). datt is scratch of the size of att.
template <typename T>
void attention_backward(Backend<T>& be, const T* q, const T* k, const T* v, const T* att, const T* dy, T* datt,
                        T* dq, T* dk, T* dv, int B, int T_, int NH, int NKV, int HD);

}  // namespace shardtrain
