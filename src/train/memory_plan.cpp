// The memory plan (include/shardtrain/train/memory_plan.h): the same sizes the code allocates, added up.
#include "shardtrain/train/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "shardtrain/backend/fp8.h"  // fp8_cuda_scratch_bytes
#include "shardtrain/parallel/parallelize.h"  // rank_unit_plan, sharding_words, checkpoint_layout_rows
#include "shardtrain/shard/shard.h"

namespace shardtrain {
namespace {
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
  if (worst_extra > 0) {
    std::snprintf(b, sizeof b, "%10.1f MiB", static_cast<double>(total() + worst_extra) / (1 << 20));
    os << " (mixture of experts: routing balanced)\n  " << b << "  total per rank at the worst routing imbalance ("
       << worst_words << ")";
  }
  return os.str();
}

namespace {

// The FSDP buffers (unit_pipeline.h, shard.h): the gather and gradient buffers of the largest unit,
// the reduce-scatter's slabs or result buffer, and under mixed precision the bf16 copies.
// Under EP the expert units are a group of their own (ShardedState, GroupedUnits): its own pipeline
// and codec, so its own buffers, sized by the largest expert unit over the expert shard group
// (`what`: " of the expert units").
void add_fsdp_buffers(const MemoryPlanInput& in, const ShardPlan& sp, int G, MemoryPlan& p, bool hybrid,
                      const std::string& what = "") {
  auto add = [&](std::string name, int64_t bytes, std::string detail) {
    p.lines.push_back({std::move(name) + what, bytes, std::move(detail), false});
  };
  const int64_t maxp = sp.max_padded_numel(), maxs = sp.max_shard_size();
  const std::string mx = with_commas(maxp) + " elements, the largest unit";
  const int64_t nbuf = (in.overlap.on ? 1 + in.overlap.prefetch : 1) + (in.overlap.on ? 2 : 1);  // gather + gradient
  const std::string nb = std::to_string(nbuf) + " x ";
  const std::string why = in.overlap.on ? " (overlap: " + std::to_string(1 + in.overlap.prefetch) + " gather + 2 gradient)" : "";
  const int64_t W = G;
  if (in.precision != Precision::BF16) {
    add("FSDP gather + gradient buffers", 4 * nbuf * maxp, nb + "4 B x " + mx + why);
    const int64_t slab = static_cast<int64_t>(reduce_slab(sp, IdentityCodec<float>::kReduceSlab, in.stream_lane));
    if (in.stream_lane)
      add("FSDP reduce-scatter result buffer", 4 * slab,
          "4 B x " + with_commas(slab) + ": a whole shard, one reduce-scatter per unit (NCCL stream lane)");
    else
      add("FSDP reduce-scatter slab buffers", 4 * (slab + (maxs > slab ? slab * W : 0)),
          "4 B x " + with_commas(slab) + (maxs > slab ? " x (" + std::to_string(W) + " + 1)" : std::string()));
    return;
  }
  const int64_t ngather = in.overlap.on ? 1 + in.overlap.prefetch : 1;
  add("bf16 gather + gradient buffers", 2 * nbuf * maxp, nb + "2 B x " + mx + why);
  add("bf16 shard copy", 2 * ngather * maxs, std::to_string(ngather) + " x 2 B x " + with_commas(maxs));
  if (in.reduce_bf16) {
    add("bf16 reduce-scatter buffer", 2 * maxs, "2 B x " + with_commas(maxs));
    if (hybrid)
      add("fp32 replica all-reduce buffer", 4 * maxs, "4 B x " + with_commas(maxs) + ": hybrid sharding");
    return;
  }
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

// The checkpoint's host memory: the rows the checkpoint layout keeps (TP's canonical rows), or the
// snapshot a save copies. `sh`: the shard lines' words.
void add_checkpoint_rows(const MemoryPlanInput& in, const MeshDims& d, int64_t shard, const std::string& sh,
                         MemoryPlan& p) {
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
    p.lines.push_back({"checkpoint snapshot (while saving in the background)", 4 * ntensors * shard,
                       std::to_string(ntensors) + " x 4 B x " + sh + "; --checkpoint-async off: none", false});
  if (!tp_rows && in.cuda && !in.train.checkpoint_dir.empty())
    p.lines.push_back({"checkpoint snapshot (pinned host memory, not in the device total)", 4 * ntensors * shard,
                       std::to_string(ntensors) + " x 4 B x " + sh + "; allocated once, reused by every save", true});
}

}  // namespace

MemoryPlan plan_memory(const MemoryPlanInput& in) {
  // What a rank holds, as the parallel layer lays the run out (its TP slices over its shard group,
  // with a pipeline its stage's units; the TP ranks' are the same size), and what the mesh's
  // dimensions add (layout_memory, parallelize.h).
  const MeshDims d = in.mesh ? *in.mesh : MeshDims{1, in.world_size, 1, 1};
  const int G = d.fsdp();  // the FSDP shard group, dp_shard x cp
  const bool bf = in.precision == Precision::BF16;
  const LayoutMemoryInput li{in.model,           model_options(in.train), d,
                             in.pipeline,        in.pp_rank,              in.microbatches,
                             in.train.pp.reshard, in.train.cp_comm,       in.train.micro_batch,
                             in.train.seq_len,   bf ? size_t{2} : size_t{4}, in.cuda};
  const LayoutMemory lm = layout_memory(li);
  const ShardPlan& sp = lm.plan;
  int64_t shard = 0;
  for (auto& u : sp.units) shard += u.shard_size;
  MemoryPlan p;
  p.stage_of = lm.stage_of;
  p.stage_schedule = lm.stage_schedule;
  p.worst_extra = lm.ep_worst_extra;
  p.worst_words = lm.ep_worst_words;
  auto add = [&](std::string name, int64_t bytes, std::string detail) {
    p.lines.push_back({std::move(name), bytes, std::move(detail), false});
  };
  auto append = [&](const std::vector<MemoryLine>& l) { p.lines.insert(p.lines.end(), l.begin(), l.end()); };
  const std::string sh =
      with_commas(shard) + " shard elements (" + lm.params_words + " / " + sharding_words(d) + ", padded)";
  add("fp32 parameter shards", 4 * shard, "4 B x " + sh);
  add("fp32 gradient shards", 4 * shard, "4 B x " + sh);
  add("AdamW m and v shards", 8 * shard, "2 x 4 B x " + sh);
  add_checkpoint_rows(in, d, shard, sh, p);
  const ShardPlan sp0 = sp.grouped() ? sp.group_plan(0) : ShardPlan{}, sp1 = sp.grouped() ? sp.group_plan(1) : ShardPlan{};
  add_fsdp_buffers(in, sp.grouped() ? sp0 : sp, G, p, G != in.world_size);
  if (sp.grouped()) add_fsdp_buffers(in, sp1, sp.expert_world_size, p, G != in.world_size, " of the expert units");
  append(lm.held);
  if (!in.cuda && G > 1)  // MpiComm's packed slab and the MPI library's temporaries (runtime.h)
    add("MPI collective buffers",
        sp.grouped() ? mpi_collective_bytes(sp0, G, bf, in.reduce_bf16, sp0.max_shard_size()) +
                           mpi_collective_bytes(sp1, sp.expert_world_size, bf, in.reduce_bf16, sp1.max_shard_size())
                     : mpi_collective_bytes(sp, G, bf, in.reduce_bf16, sp.max_shard_size()),
        "a packed slab and Open MPI's temporary, each <= 16 MiB" +
            std::string(sp.grouped() ? ", for the shard group's and the expert shard group's collectives" : ""));
  append(lm.comm);
  append(lm.kept);
  if (lm.activations.recompute) add("recomputed block activations", lm.activations.recompute, "one block at a time");
  append(lm.scratch);
  if (in.train.fp8) {  // --precision fp8: the largest projection GEMM's fp8 copies and cuBLASLt workspace
    const ModelConfig& c = in.model;
    const int64_t BT = int64_t{in.train.micro_batch} * (in.train.seq_len / std::max(1, d.cp));
    const int64_t C = c.hidden_size, I = c.intermediate_size / d.tp, HD = c.head_dim();
    const int64_t Q = c.num_attention_heads * HD / d.tp, KV = c.num_key_value_heads * HD / d.tp;
    int64_t most = 0;
    std::string which;
    const std::pair<int64_t, int64_t> nk[] = {{Q, C}, {KV, C}, {C, Q}, {I, C}, {C, I}};
    const char* names[] = {"q", "k/v", "o", "gate/up", "down"};
    const char* roles[] = {"forward", "input gradient", "weight gradient"};
    for (int r = 0; r < 3; ++r)
      for (int i = 0; i < 5; ++i) {
        const int64_t b = fp8_cuda_scratch_bytes(static_cast<math::Fp8Gemm>(r), BT, nk[i].first, nk[i].second, true);
        if (b > most) {
          most = b;
          which = std::string(names[i]) + " " + roles[r];
        }
      }
    add("fp8 GEMM scratch", most,
        "the largest block projection GEMM's (" + which + ", " + with_commas(BT) +
            " rows) fp8 copies incl. transposed, and the 32 MiB cuBLASLt workspace");
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

std::vector<MemoryPlan> plan_stages(MemoryPlanInput in) {
  std::vector<MemoryPlan> plans;
  for (int s = 0; s < in.pipeline.ranks; ++s) {
    in.pp_rank = s;
    plans.push_back(plan_memory(in));
  }
  return plans;
}

std::string format_plans(const std::vector<MemoryPlan>& plans,
                         const std::function<std::string(const MemoryPlan&)>& title) {
  std::string out;
  for (size_t s = 0; s < plans.size(); ++s) {
    if (s) out += '\n';
    out += plans[s].format(title(plans[s]));
  }
  return out;
}

int largest_fitting_micro_batch(MemoryPlanInput in, int64_t device_bytes, int max_micro_batch) {
  int lo = 0, hi = max_micro_batch;  // activations grow with the micro-batch: bisect
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    in.train.micro_batch = mid;
    bool fits = false;
    try {
      fits = plan_memory(in).total() <= device_bytes;
    } catch (const std::invalid_argument&) {  // a micro-batch the model cannot run (an MoE's 2^31 routed slots)
    }
    if (fits) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace shardtrain
