// The memory plan's parts from the mesh's tp, cp and pp (parallelize.h layout_memory): the same
// sizes the parallel layer and the model allocate, added up.
#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "shardtrain/parallel/parallelize.h"

namespace shardtrain {

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), o;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) o += ',';
    o += s[i];
  }
  return o;
}

namespace {

// The stage's words: "stage 1 of 4: blocks [8, 16)", its chunks' blocks, embedding and head.
std::string stage_words(const ModelConfig& mc, const PipelineLayout& pl, int r) {
  std::string w = "stage " + std::to_string(r) + " of " + std::to_string(pl.ranks) + ": blocks";
  for (int c : pl.rank_chunks(r)) {
    const int b = pl.bounds[static_cast<size_t>(c)], e = pl.bounds[static_cast<size_t>(c) + 1];
    w += " [" + std::to_string(b) + ", " + std::to_string(e) + ")" + (b == 0 ? " + embedding" : "") +
         (e == mc.num_hidden_layers ? " + head" : "");
  }
  return w;
}

// A pipeline rank's activations: the contexts in flight (pipeline_contexts: pooled per chunk), each
// its chunk's context_bytes, + its deferred weight-gradient inputs under zero-bubble.
void stage_activations(const LayoutMemoryInput& in, int rows, const std::string& geo, LayoutMemory& m) {
  const ModelConfig& mc = in.model;
  const PipelineLayout& pl = in.pipeline;
  const int N = in.dims.tp, B = in.micro_batch;
  int peak = 0;
  const std::vector<int> held = pipeline_contexts(pl, in.pp_rank, in.microbatches, &peak);
  const std::vector<int> chunks = pl.rank_chunks(in.pp_rank);
  const bool zb = pl.kind == PipelineKind::ZeroBubble;
  const size_t es = in.elem_bytes;
  int64_t ctx_total = 0, def_total = 0;
  int nctx = 0;
  std::string per;
  for (size_t j = 0; j < chunks.size(); ++j) {
    const int b = pl.bounds[static_cast<size_t>(chunks[j])], e = pl.bounds[static_cast<size_t>(chunks[j]) + 1];
    const int64_t cb = context_bytes(mc, in.options, B, rows, es, b, e, N, in.dims.cp, in.dims.ep);
    const int64_t db = zb ? deferred_weight_bytes(mc, in.options, B, rows, es, e - b, N, in.dims.cp) : 0;
    ctx_total += held[j] * cb;
    def_total += held[j] * db;
    nctx += held[j];
    char mib[32];
    std::snprintf(mib, sizeof mib, "%.1f MiB", static_cast<double>(cb) / (1 << 20));
    per += std::string(j ? "; " : "") + (chunks.size() > 1 ? "chunk " + std::to_string(chunks[j]) + ": " : "") +
           std::to_string(held[j]) + " x " + mib + " (" + std::to_string(e - b) + " blocks" +
           (b == 0 ? " + embedding ids" : "") + (e == mc.num_hidden_layers ? " + final norm, targets" : "") + ")";
  }
  // Expert parallelism: each context's expert rows grow on their own (LlamaModel::grow_expert_rows).
  if (mc.is_moe() && in.dims.ep > 1) {
    int64_t grown = 0;
    for (size_t j = 0; j < chunks.size(); ++j) {
      const int b = pl.bounds[static_cast<size_t>(chunks[j])], e = pl.bounds[static_cast<size_t>(chunks[j]) + 1];
      grown += held[j] * (context_bytes(mc, in.options, B, rows, es, b, e, N, in.dims.cp, in.dims.ep, true) -
                          context_bytes(mc, in.options, B, rows, es, b, e, N, in.dims.cp, in.dims.ep));
    }
    char mib[32];
    std::snprintf(mib, sizeof mib, "%.1f MiB", static_cast<double>(grown) / (1 << 20));
    per += std::string("; MoE: expert rows for balanced routing, growing with the imbalance by up to ") + mib;
    m.ep_worst_extra += grown;
  }
  m.kept.push_back(
      {"activations: " + std::to_string(nctx) + (nctx == 1 ? " micro-batch chunk" : " micro-batch chunks") +
           " in flight (" + pipeline_kind_name(pl.kind) +
           (pl.chunks_per_rank > 1 ? " v " + std::to_string(pl.chunks_per_rank) : "") + ", stage " +
           std::to_string(in.pp_rank) + " of " + std::to_string(pl.ranks) + ", " + std::to_string(in.microbatches) +
           (in.microbatches == 1 ? " micro-batch)" : " micro-batches)"),
       ctx_total,
       per + "; " + geo + (chunks.size() > 1 ? "; pooled per chunk, simulate's peak at once " + std::to_string(peak) : "")});
  if (zb)
    m.kept.push_back({"deferred weight-gradient inputs (zero-bubble)", def_total,
                      std::to_string(nctx) + " contexts x deferred_weight_bytes of their blocks: kept by each context once used"});
}

// A pipeline rank's buffers besides its contexts: the model's shared scratch, StageLink's, the tied
// embedding gradient's.
void stage_buffers(const LayoutMemoryInput& in, int rows, const std::string& logits_words, LayoutMemory& m) {
  const ModelConfig& mc = in.model;
  const int N = in.dims.tp;
  const size_t es = in.elem_bytes;
  const ActivationBytes& a = m.activations;
  const int64_t scratch = a.total() - a.recompute -
                          context_bytes(mc, in.options, in.micro_batch, rows, es, 0, mc.num_hidden_layers, N, in.dims.cp, in.dims.ep);
  if (mc.is_moe() && in.dims.ep > 1) {  // the shared scratch's and the recomputed block's expert rows grow too
    const ActivationBytes w =
        activation_bytes(mc, in.options, in.micro_batch, rows, es, 4, N, in.dims.cp, in.dims.ep);
    const int64_t ws = w.total() - w.recompute -
                       context_bytes(mc, in.options, in.micro_batch, rows, es, 0, mc.num_hidden_layers, N, in.dims.cp,
                                     in.dims.ep, true);
    m.ep_worst_extra += (ws - scratch) + (w.recompute - a.recompute);
  }
  m.scratch.push_back({"model scratch: activation gradients, logits chunk, RoPE", scratch,
                       "shared by every context: activation_bytes less a whole-model context; " + logits_words});
  const int64_t rc = int64_t{in.micro_batch} * rows / N * mc.hidden_size;  // [R, C]: the micro-batch's rows of this rank
  // StageLink: two receive buffers per direction (one posted ahead), and its send buffers, one per
  // send in flight (counted as two: one each way; more only while the network lags behind).
  // A mixture of experts' messages carry the load-balancing statistics after the rows (StageRunner:
  // both directions padded to the larger, G (2E + 1) or G (E + 1) + 2 doubles; G = B or 1 by the scope).
  int64_t tail = 0;
  if (mc.is_moe()) {
    const int64_t G = in.options.aux_scope == MoeAuxScope::Sequence ? in.micro_batch : 1, E = mc.num_experts;
    tail = 8 * std::max(G * (2 * E + 1), G * (E + 1) + 2);
  }
  m.scratch.push_back({"pipeline receive and send buffers", 6 * (static_cast<int64_t>(es) * rc + tail),
                       "inputs and output gradients received, 2 each, and 2 send buffers: 6 x " + std::to_string(es) +
                           " B x " + with_commas(rc) + " ([R, C])" +
                           (tail ? " + 6 x " + with_commas(tail) + " B of MoE statistics" : std::string())});
  // The first stage's embedding and the last's copy for the tied head (RankUnits::embedding).
  const RankUnits ru = pipeline_rank_units(mc, in.pipeline, in.pp_rank, N, 0);
  if (mc.tie_word_embeddings && ru.embedding >= 0) {
    const int64_t ne = m.plan.units[static_cast<size_t>(ru.embedding)].shard_size;
    m.scratch.push_back({"tied embedding gradient receive buffer", 4 * ne,
                         "4 B x " + with_commas(ne) + ": the other end's shard, summed after backward (sum_tied_grads)"});
  }
}

}  // namespace

LayoutMemory layout_memory(const LayoutMemoryInput& in) {
  const ModelConfig& mc = in.model;
  const ModelOptions& mo = in.options;
  const MeshDims& d = in.dims;
  const PipelineLayout& pl = in.pipeline;
  if (pl.ranks != d.pp || in.pp_rank < 0 || in.pp_rank >= d.pp)
    throw std::invalid_argument("plan_memory: a pipeline of " + std::to_string(pl.ranks) + " stages (stage " +
                                std::to_string(in.pp_rank) + ") on a mesh of pp " + std::to_string(d.pp));
  const int N = d.tp, B = in.micro_batch, m = in.microbatches;
  const bool pp = pl.ranks > 1;
  LayoutMemory lm;
  lm.plan = rank_unit_plan(mc, d, 0, &pl, in.pp_rank);
  lm.params_words = with_commas(mc.num_params());
  if (pp) {
    const int64_t stage_params = ShardPlan::build(pipeline_rank_units(mc, pl, in.pp_rank).units, 1).total_numel();
    lm.params_words = with_commas(stage_params) + " of " + stage_words(mc, pl, in.pp_rank) + ";";
    const std::string stage = "pipeline stage " + std::to_string(in.pp_rank) + " of " + std::to_string(pl.ranks);
    lm.stage_of = " of " + stage;
    lm.stage_schedule = ", " + stage + " (" + pipeline_kind_name(pl.kind) +
                        (pl.chunks_per_rank > 1 ? " v " + std::to_string(pl.chunks_per_rank) : std::string()) + ", " +
                        std::to_string(m) + (m == 1 ? " micro-batch" : " micro-batches") + " per step)";
  }
  if (pp && in.pp_reshard == Reshard::PerPass) {
    // --pp-reshard per-step (unit_pipeline.h): every unit of the stage stays gathered through the
    // step and its gradient accumulates unsharded (fp32 under mixed precision) until end_pass.
    int64_t all = 0;
    for (auto& u : lm.plan.units) all += u.shard_size * d.fsdp();
    const int64_t e = static_cast<int64_t>(in.elem_bytes);
    lm.held.push_back({"FSDP per-step: the stage's units gathered + gradient accumulators", (e + 4) * all,
                       "(" + std::to_string(e) + " + 4) B x " + with_commas(all) +
                           " elements (every unit of the stage, padded): gathered once per step, reduced once "
                           "(--pp-reshard per-step; per-microbatch: none)"});
  }
  // Context parallelism (the rows and K/V buffers): a rank holds T / cp rows of every sequence (all
  // T without CP).
  const CpMemory cpm = cp_memory(mc, d, in.cp_comm, B, in.seq_len, in.elem_bytes);
  const int64_t rows = int64_t{B} * cpm.rows;
  if (!in.cuda && N > 1) {  // the TP collectives' ([rows, C] over N ranks) packed slab and temporary
    const int64_t es = static_cast<int64_t>(in.elem_bytes), cap = static_cast<int64_t>(Comm::kCollectiveSlab);
    const int64_t full = rows * mc.hidden_size * es;
    lm.comm.push_back({"MPI buffers of the TP collectives", 2 * std::min(cap, full),
                       "a packed slab and Open MPI's temporary, each <= 16 MiB"});
  }
  const int vl = (mc.vocab_size + N - 1) / N;  // vocabulary rows per TP rank
  // Under EP the expert rows are allocated for balanced routing and grow with the imbalance
  // (LlamaModel::grow_expert_rows): the plan counts what is allocated, and says the worst case.
  lm.activations = activation_bytes(mc, mo, B, cpm.rows, in.elem_bytes, 4, N, d.cp, d.ep, true);
  const std::string geo = cpm.rows_words + ", " + recompute_name(mo.recompute) + " recompute, " +
                          attention_name(mo.attention) + " attention" +
                          (mo.mask == AttentionMask::Document ? ", document mask" : "");
  const std::string logits_words =
      "chunk of " + std::to_string(std::min<int64_t>(mo.loss_chunk > 0 ? mo.loss_chunk : default_loss_chunk(vl), rows)) +
      " tokens x " + with_commas(vl) + (N > 1 ? " vocabulary rows of this TP rank" : " vocabulary");
  const ActivationBytes& a = lm.activations;
  // Expert parallelism: an MoE block's expert rows (g, u, h, their gradients, the exchange's
  // buffers) are allocated for balanced routing, B·T·k rows, and grow to the rows a rank's experts
  // get, up to ep x B·T·k (dropless: every slot of the EP group on this rank's experts; model.h).
  // The lines count the first; the worst case is said in them and as a second total.
  std::string ep_kept, ep_scratch;
  if (mc.is_moe() && d.ep > 1) {
    const ActivationBytes worst = activation_bytes(mc, mo, B, cpm.rows, in.elem_bytes, 4, N, d.cp, d.ep);
    const int64_t slots = rows * mc.num_experts_per_tok;
    auto mib = [](int64_t b) {
      char t[32];
      std::snprintf(t, sizeof t, "%.1f MiB", static_cast<double>(b) / (1 << 20));
      return std::string(t);
    };
    const std::string rows_words = "expert rows for balanced routing, " + with_commas(slots) +
                                   " per block; growing with the imbalance up to ";
    ep_kept = "; MoE: " + rows_words + mib(worst.per_layer) + " (ep " + std::to_string(d.ep) + " x those rows)";
    ep_scratch = "; MoE: " + rows_words + mib(worst.block_scratch);
    if (!pp) lm.ep_worst_extra = worst.total() - a.total();  // under PP: stage_activations, stage_buffers
    lm.ep_worst_words = "every slot of the EP group routed to this rank's experts: --ep " + std::to_string(d.ep) +
                        " x " + with_commas(slots) + " expert rows per block";
  }
  if (!pp)
    lm.kept.push_back({"activations kept for backward", a.per_layer,
                       std::to_string(mc.num_hidden_layers) + " blocks, " + geo +
                           (N > 1 ? ", TP " + std::to_string(N) + ": the residual stream's rows and the heads / MLP split"
                                  : "") + ep_kept});
  else
    stage_activations(in, cpm.rows, geo, lm);
  if (cpm.kv_bytes) lm.kept.push_back({cpm.kv_name, cpm.kv_bytes, cpm.kv_detail});
  if (!in.cuda && cpm.mpi_reduce_scatter_bytes)  // the host Comm's MPI_Ireduce_scatter_block (CpMemory)
    lm.kept.push_back({"MPI buffers of the CP reduce-scatter", cpm.mpi_reduce_scatter_bytes,
                       "Open MPI's non-blocking reduce-scatter of dK and dV reduces to the CP group's first rank, "
                       "which holds " + std::string(d.cp > 2 ? "2 temporaries" : "1 temporary") + " of each"});
  if (!pp) {
    lm.scratch.push_back({"block scratch and activation gradients", a.block_scratch, "shared by the blocks" + ep_scratch});
    lm.scratch.push_back({"head: final norm, logits chunk, ids, RoPE", a.head, logits_words});
  } else {
    stage_buffers(in, cpm.rows, logits_words, lm);
  }
  return lm;
}

}  // namespace shardtrain
