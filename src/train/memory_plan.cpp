// The memory plan (include/shardtrain/train/memory_plan.h): the same sizes the code allocates, added up.
#include "shardtrain/train/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "shardtrain/parallel/parallelize.h"  // rank_unit_plan, sharding_words, checkpoint_layout_rows
#include "shardtrain/shard/shard.h"

namespace shardtrain {
namespace {
std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), o;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) o += ',';
    o += s[i];
  }
  return o;
}
// The CPU's FSDP collectives through MpiComm over G ranks: its packed slab (when a block exceeds
// one, Comm::kCollectiveSlab) and the MPI library's temporary (at most that slab), for the
// all-gather of the largest shard (maxs elements, in the compute type: bf16 or fp32) and the
// reduce-scatter (bf16 with reduce_bf16, else fp32 slabs), whichever needs more.
int64_t mpi_collective_bytes(const ShardPlan& sp, int G, bool bf, bool reduce_bf16, int64_t maxs) {
  const int64_t W = G, cap = static_cast<int64_t>(Comm::kCollectiveSlab);
  const int64_t gs = bf ? 2 : 4;  // all-gather: shards in the compute type
  const int64_t rs = bf && reduce_bf16 ? 2 : 4;
  const int64_t rcount = bf && reduce_bf16
                             ? maxs
                             : static_cast<int64_t>(reduce_slab(sp, IdentityCodec<float>::kReduceSlab));
  auto ours = [&](int64_t count, int64_t es) {
    const int64_t slab = std::max<int64_t>(1, cap / es / W);
    return count > slab ? slab * W * es : 0;
  };
  const int64_t o = std::max(ours(maxs, gs), ours(rcount, rs));
  const int64_t lib = std::max(std::min(cap, maxs * W * gs), std::min(cap, rcount * W * rs));
  return o + lib;
}
}  // namespace

int64_t MemoryPlan::total() const {
  int64_t t = 0;
  for (auto& l : lines)
    if (!l.host) t += l.bytes;
  return t;
}

std::string MemoryPlan::format(const std::string& title) const {
  std::ostringstream os;
  char b[64];
  os << title << "\n";
  for (auto& l : lines) {
    std::snprintf(b, sizeof b, "%10.1f MiB", static_cast<double>(l.bytes) / (1 << 20));
    os << "  " << b << "  " << l.name << (l.detail.empty() ? "" : " (" + l.detail + ")") << "\n";
  }
  std::snprintf(b, sizeof b, "%10.1f MiB", static_cast<double>(total()) / (1 << 20));
  os << "  " << b << "  total per rank";
  return os.str();
}

MemoryPlan plan_memory(const MemoryPlanInput& in) {
  const ModelOptions mo = model_options(in.train);
  // What a rank holds, as the parallel layer lays the run out (its TP slices over its shard group;
  // the TP ranks' are the same size).
  const MeshDims d = in.mesh ? *in.mesh : MeshDims{1, in.world_size, 1, 1};
  const int N = d.tp, G = d.fsdp();  // G: the FSDP shard group, dp_shard x cp
  const PipelineLayout& pl = in.pipeline;
  if (pl.ranks != d.pp || in.pp_rank < 0 || in.pp_rank >= d.pp)
    throw std::invalid_argument("plan_memory: a pipeline of " + std::to_string(pl.ranks) + " stages (stage " +
                                std::to_string(in.pp_rank) + ") on a mesh of pp " + std::to_string(d.pp));
  const bool pp = pl.ranks > 1;
  const ShardPlan sp = pp ? rank_unit_plan(in.model, d, 0, &pl, in.pp_rank) : rank_unit_plan(in.model, d);
  int64_t shard = 0;
  for (auto& u : sp.units) shard += u.shard_size;
  // The stage's words: "stage 1 of 4 (blocks [8, 16))", its chunks' blocks, embedding and head.
  std::string stage_words;
  int64_t stage_params = 0;  // the stage's parameters, whole (its units before TP and sharding)
  if (pp) {
    stage_params = ShardPlan::build(pipeline_rank_units(in.model, pl, in.pp_rank).units, 1).total_numel();
    stage_words = "stage " + std::to_string(in.pp_rank) + " of " + std::to_string(pl.ranks) + ": blocks";
    for (int c : pl.rank_chunks(in.pp_rank)) {
      const int b = pl.bounds[static_cast<size_t>(c)], e = pl.bounds[static_cast<size_t>(c) + 1];
      stage_words += " [" + std::to_string(b) + ", " + std::to_string(e) + ")" + (b == 0 ? " + embedding" : "") +
                     (e == in.model.num_hidden_layers ? " + head" : "");
    }
  }
  const int64_t maxp = sp.max_padded_numel(), maxs = sp.max_shard_size();
  const bool bf = in.precision == Precision::BF16;
  MemoryPlan p;
  auto add = [&](std::string name, int64_t bytes, std::string detail) {
    p.lines.push_back({std::move(name), bytes, std::move(detail), false});
  };
  const std::string sh = with_commas(shard) + " shard elements (" +
                         (pp ? with_commas(stage_params) + " of " + stage_words + "; / "
                             : with_commas(in.model.num_params()) + " / ") +
                         sharding_words(d) + ", padded)";
  add("fp32 parameter shards", 4 * shard, "4 B x " + sh);
  add("fp32 gradient shards", 4 * shard, "4 B x " + sh);
  add("AdamW m and v shards", 8 * shard, "2 x 4 B x " + sh);
  // A background save first copies every checkpoint tensor's rows (CheckpointSnapshot, host
  // memory); a synchronous one writes from the live shards on the CPU (a borrowed snapshot). On a
  // GPU every save copies, into pinned host memory (a SnapshotBuffer, made once per run): host
  // memory, listed in the device plan but not counted in its total.
  const int64_t ntensors = static_cast<int64_t>(checkpoint_tensor_names().size());
  // Rows the checkpoint layout keeps (TP's canonical rows): made once, they are the snapshot of
  // every save (host memory; in a GPU rank's plan listed, not counted).
  const bool checkpoints = !in.train.checkpoint_dir.empty() || !in.train.resume.empty() || !in.train.init_from.empty();
  const LayoutRows kept = checkpoint_layout_rows(in.model, d);
  const bool tp_rows = checkpoints && kept.elements > 0;
  if (tp_rows)
    p.lines.push_back({kept.name, 4 * ntensors * kept.elements,
                       std::to_string(ntensors) + " x 4 B x " + with_commas(kept.elements) + " elements (" +
                           with_commas(in.model.num_params()) + " / " + std::to_string(in.world_size) + " ranks, padded)",
                       in.cuda});
  if (!tp_rows && !in.cuda && !in.train.checkpoint_dir.empty() && in.train.checkpoint_async)
    add("checkpoint snapshot (while saving in the background)", 4 * ntensors * shard,
        std::to_string(ntensors) + " x 4 B x " + sh + "; --checkpoint-async off: none");
  if (!tp_rows && in.cuda && !in.train.checkpoint_dir.empty())
    p.lines.push_back({"checkpoint snapshot (pinned host memory, not in the device total)", 4 * ntensors * shard,
                       std::to_string(ntensors) + " x 4 B x " + sh + "; allocated once, reused by every save", true});
  const std::string mx = with_commas(maxp) + " elements, the largest unit";
  const int64_t nbuf = (in.overlap.on ? 1 + in.overlap.prefetch : 1) + (in.overlap.on ? 2 : 1);  // gather + gradient
  const std::string nb = std::to_string(nbuf) + " x ";
  const std::string why = in.overlap.on ? " (overlap: " + std::to_string(1 + in.overlap.prefetch) + " gather + 2 gradient)" : "";
  if (!bf) {
    add("FSDP gather + gradient buffers", 4 * nbuf * maxp, nb + "4 B x " + mx + why);
    const int64_t W = G;
    const int64_t slab = static_cast<int64_t>(reduce_slab(sp, IdentityCodec<float>::kReduceSlab, in.stream_lane));
    if (in.stream_lane)
      add("FSDP reduce-scatter result buffer", 4 * slab,
          "4 B x " + with_commas(slab) + ": a whole shard, one reduce-scatter per unit (NCCL stream lane)");
    else
      add("FSDP reduce-scatter slab buffers", 4 * (slab + (maxs > slab ? slab * W : 0)),
          "4 B x " + with_commas(slab) + (maxs > slab ? " x (" + std::to_string(W) + " + 1)" : std::string()));
  } else {
    const int64_t ngather = in.overlap.on ? 1 + in.overlap.prefetch : 1;
    add("bf16 gather + gradient buffers", 2 * nbuf * maxp, nb + "2 B x " + mx + why);
    add("bf16 shard copy", 2 * ngather * maxs, std::to_string(ngather) + " x 2 B x " + with_commas(maxs));
    if (in.reduce_bf16) {
      add("bf16 reduce-scatter buffer", 2 * maxs, "2 B x " + with_commas(maxs));
      if (G != in.world_size)
        add("fp32 replica all-reduce buffer", 4 * maxs, "4 B x " + with_commas(maxs) + ": hybrid sharding");
    } else {
      const int64_t W = G;
      const int64_t slab = static_cast<int64_t>(reduce_slab(sp, MixedPrecisionUnits::kWidenSlab, in.stream_lane));
      if (in.stream_lane)
        add("fp32 reduce-scatter of a whole unit", 4 * slab * (W + 1),
            "4 B x " + with_commas(slab) + " x (" + std::to_string(W) +
                " + 1): the bf16 gradient widened a whole unit at once, one reduce-scatter per unit (NCCL stream "
                "lane)");
      else
        add("fp32 reduce-scatter slabs", 4 * slab * (W + 1),
            "4 B x " + with_commas(slab) + " x (" + std::to_string(W) + " + 1): the bf16 gradient widened a slab at a time");
    }
  }
  if (pl.ranks > 1 && in.train.pp.reshard == Reshard::PerPass) {
    // --pp-reshard per-step (unit_pipeline.h): every unit of the stage stays gathered through the
    // step and its gradient accumulates unsharded (fp32 under mixed precision) until end_pass.
    int64_t all = 0;
    for (auto& u : sp.units) all += u.shard_size * G;
    const int64_t e = bf ? 2 : 4;
    add("FSDP per-step: the stage's units gathered + gradient accumulators", (e + 4) * all,
        "(" + std::to_string(e) + " + 4) B x " + with_commas(all) +
            " elements (every unit of the stage, padded): gathered once per step, reduced once (--pp-reshard "
            "per-step; per-microbatch: none)");
  }
  if (!in.cuda && G > 1)  // MpiComm's packed slab and the MPI library's temporaries (runtime.h)
    add("MPI collective buffers", mpi_collective_bytes(sp, G, bf, in.reduce_bf16, maxs),
        "a packed slab and Open MPI's temporary, each <= 16 MiB");
  const int B = in.train.micro_batch, T = in.train.seq_len;
  // Context parallelism (the parallel layer's rows and K/V buffers): a rank holds T / cp rows of
  // every sequence (all T without CP).
  const CpMemory cpm = cp_memory(in.model, d, in.train.cp_comm, B, T, bf ? 2 : 4);
  const int64_t rows = int64_t{B} * cpm.rows;
  if (!in.cuda && N > 1) {  // the TP collectives' ([rows, C] over N ranks) packed slab and temporary
    const int64_t es = bf ? 2 : 4, cap = static_cast<int64_t>(Comm::kCollectiveSlab);
    const int64_t full = rows * in.model.hidden_size * es;
    add("MPI buffers of the TP collectives", 2 * std::min(cap, full), "a packed slab and Open MPI's temporary, each <= 16 MiB");
  }
  const int vl = (in.model.vocab_size + N - 1) / N;  // vocabulary rows per TP rank
  const ActivationBytes a = activation_bytes(in.model, mo, B, cpm.rows, bf ? 2 : 4, 4, N, d.cp);
  const std::string geo = cpm.rows_words + ", " + recompute_name(mo.recompute) + " recompute, " +
                          attention_name(mo.attention) + " attention" +
                          (mo.mask == AttentionMask::Document ? ", document mask" : "");
  const std::string logits_words =
      "chunk of " + std::to_string(std::min<int64_t>(mo.loss_chunk > 0 ? mo.loss_chunk : default_loss_chunk(vl), rows)) +
      " tokens x " + with_commas(vl) + (N > 1 ? " vocabulary rows of this TP rank" : " vocabulary");
  if (!pp) {
    add("activations kept for backward", a.per_layer,
        std::to_string(in.model.num_hidden_layers) + " blocks, " + geo +
            (N > 1 ? ", TP " + std::to_string(N) + ": the residual stream's rows and the heads / MLP split" : ""));
  } else {
    // The contexts in flight (pipeline_contexts: pooled per chunk), each its chunk's context_bytes,
    // + its deferred weight-gradient inputs under zero-bubble.
    int peak = 0;
    const std::vector<int> held = pipeline_contexts(pl, in.pp_rank, in.microbatches, &peak);
    const std::vector<int> chunks = pl.rank_chunks(in.pp_rank);
    const bool zb = pl.kind == PipelineKind::ZeroBubble;
    const size_t es = bf ? 2 : 4;
    int64_t ctx_total = 0, def_total = 0;
    int nctx = 0;
    std::string per;
    for (size_t j = 0; j < chunks.size(); ++j) {
      const int b = pl.bounds[static_cast<size_t>(chunks[j])], e = pl.bounds[static_cast<size_t>(chunks[j]) + 1];
      const int64_t cb = context_bytes(in.model, mo, B, cpm.rows, es, b, e, N, d.cp);
      const int64_t db = zb ? deferred_weight_bytes(in.model, mo, B, cpm.rows, es, e - b, N, d.cp) : 0;
      ctx_total += held[j] * cb;
      def_total += held[j] * db;
      nctx += held[j];
      char mib[32];
      std::snprintf(mib, sizeof mib, "%.1f MiB", static_cast<double>(cb) / (1 << 20));
      per += std::string(j ? "; " : "") + (chunks.size() > 1 ? "chunk " + std::to_string(chunks[j]) + ": " : "") +
             std::to_string(held[j]) + " x " + mib + " (" + std::to_string(e - b) + " blocks" +
             (b == 0 ? " + embedding ids" : "") + (e == in.model.num_hidden_layers ? " + final norm, targets" : "") +
             ")";
    }
    add("activations: " + std::to_string(nctx) + " micro-batch chunks in flight (" + pipeline_kind_name(pl.kind) +
            (pl.chunks_per_rank > 1 ? " v " + std::to_string(pl.chunks_per_rank) : "") + ", stage " +
            std::to_string(in.pp_rank) + " of " + std::to_string(pl.ranks) + ", " + std::to_string(in.microbatches) +
            (in.microbatches == 1 ? " micro-batch)" : " micro-batches)"),
        ctx_total,
        per + "; " + geo + (chunks.size() > 1 ? "; pooled per chunk, simulate's peak at once " + std::to_string(peak) : ""));
    if (zb)
      add("deferred weight-gradient inputs (zero-bubble)", def_total,
          std::to_string(nctx) + " contexts x deferred_weight_bytes of their blocks: kept by each context once used");
  }
  if (cpm.kv_bytes) add(cpm.kv_name, cpm.kv_bytes, cpm.kv_detail);
  if (!in.cuda && cpm.mpi_reduce_scatter_bytes)  // the host Comm's MPI_Ireduce_scatter_block (parallelize.h CpMemory)
    add("MPI buffers of the CP reduce-scatter", cpm.mpi_reduce_scatter_bytes,
        "Open MPI's non-blocking reduce-scatter of dK and dV reduces to the CP group's first rank, "
        "which holds " + std::string(d.cp > 2 ? "2 temporaries" : "1 temporary") + " of each");
  if (a.recompute) add("recomputed block activations", a.recompute, "one block at a time");
  if (!pp) {
    add("block scratch and activation gradients", a.block_scratch, "shared by the blocks");
    add("head: final norm, logits chunk, ids, RoPE", a.head, logits_words);
  } else {
    const size_t es = bf ? 2 : 4;
    const int64_t scratch = a.total() - a.recompute -
                            context_bytes(in.model, mo, B, cpm.rows, es, 0, in.model.num_hidden_layers, N, d.cp);
    add("model scratch: activation gradients, logits chunk, RoPE", scratch,
        "shared by every context: activation_bytes less a whole-model context; " + logits_words);
    const int64_t rc = rows / N * in.model.hidden_size;  // [R, C]: the micro-batch's rows of this rank
    // StageLink: two receive buffers per direction (one posted ahead), and its send buffers, one per
    // send in flight (counted as two: one each way; more only while the network lags behind).
    add("pipeline receive and send buffers", 6 * static_cast<int64_t>(es) * rc,
        "inputs and output gradients received, 2 each, and 2 send buffers: 6 x " + std::to_string(es) + " B x " +
            with_commas(rc) + " ([R, C])");
    // The first stage's embedding and the last's copy for the tied head (RankUnits::embedding).
    const RankUnits ru = pipeline_rank_units(in.model, pl, in.pp_rank, N, 0);
    if (in.model.tie_word_embeddings && ru.embedding >= 0) {
      const int64_t ne = sp.units[static_cast<size_t>(ru.embedding)].shard_size;
      add("tied embedding gradient receive buffer", 4 * ne,
          "4 B x " + with_commas(ne) + ": the other end's shard, summed after backward (sum_tied_grads)");
    }
  }
  if (!in.cuda && in.data_tokens)
    add("token data", static_cast<int64_t>(in.data_tokens) * in.token_bytes,
        with_commas(static_cast<int64_t>(in.data_tokens)) + " tokens x " + std::to_string(in.token_bytes) +
            " B, read by every rank");
  if (in.runtime_bytes)
    add(in.cuda ? "CUDA runtime (context, cuBLAS, NCCL)" : "process before allocation (libraries, MPI, threads)",
        in.runtime_bytes, in.cuda ? "estimate" : "VmRSS measured");
  return p;
}

std::vector<int> pipeline_contexts(const PipelineLayout& pl, int pp_rank, int microbatches, int* peak) {
  if (pl.ranks <= 1) {
    if (peak) *peak = 1;
    return {1};
  }
  const std::unique_ptr<Schedule> s = pl.schedule(microbatches);
  const std::vector<int> chunks = pl.rank_chunks(pp_rank);
  std::vector<int> now(chunks.size(), 0), most(chunks.size(), 0);
  bool split = false;
  const std::vector<Action> all = s->actions();
  for (const Action& a : all) split = split || (a.stage == pp_rank && a.kind == ActionKind::BackwardWeight);
  for (const Action& a : all) {
    if (a.stage != pp_rank) continue;
    const size_t j = static_cast<size_t>(a.chunk / pl.ranks);
    if (a.kind == ActionKind::Forward) most[j] = std::max(most[j], ++now[j]);
    if (a.kind == ActionKind::BackwardWeight || (a.kind == ActionKind::Backward && !split) ||
        (a.kind == ActionKind::BackwardInput && !split))
      --now[j];
  }
  if (peak) {
    const PipelineTimeline t = simulate(*s, {ActionTimes{}});
    if (!t.error.empty()) throw std::logic_error("pipeline_contexts: " + t.error);
    *peak = t.peak_in_flight[static_cast<size_t>(pp_rank)];
  }
  return most;
}

int largest_fitting_micro_batch(MemoryPlanInput in, int64_t device_bytes, int max_micro_batch) {
  int lo = 0, hi = max_micro_batch;  // activations grow with the micro-batch: bisect
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    in.train.micro_batch = mid;
    if (plan_memory(in).total() <= device_bytes) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace shardtrain
