// The parallel layer's entry point (parallelize.h): the run's layout from its mesh.
#include "shardtrain/parallel/parallelize.h"

#include <algorithm>
#include <string>
#include <type_traits>

#include "shardtrain/model/model.h"  // llama_units

namespace shardtrain {

namespace {

// Pipeline parallelism (format version 6): where this rank's units (`held`, its plan's, in its
// order; `ru` says which is the tied copy) go in the file, whose units are the whole model's
// (`file_units`) in held.world_size rows; nullptr with one stage.
std::shared_ptr<const StageUnits> stage_units(const PipelineLayout& pl, const RankUnits& ru,
                                              const std::vector<UnitSpec>& file_units, const ShardPlan& held) {
  if (pl.ranks <= 1) return nullptr;
  auto su = std::make_shared<StageUnits>();
  su->pp = pl.ranks;
  su->chunks_per_rank = pl.chunks_per_rank;
  su->schedule = pipeline_kind_name(pl.kind);
  su->bounds = pl.bounds;
  su->file_plan = ShardPlan::build(file_units, held.world_size);
  for (size_t u = 0; u < su->file_plan.units.size(); ++u)
    su->unit_stage.push_back(pipeline_unit_stage(pl.bounds, pl.ranks, static_cast<int>(u)));
  for (size_t i = 0; i < held.units.size(); ++i) {
    const int u = su->file_plan.unit_index(held.units[i].name);
    if (u < 0 || su->file_plan.units[static_cast<size_t>(u)].numel != held.units[i].numel)
      throw std::logic_error("stage_units: unit '" + held.units[i].name + "' is not the model's");
    su->file_unit.push_back(u);
    su->tied_copy.push_back(ru.tied_copy && static_cast<int>(i) == ru.embedding ? 1 : 0);
  }
  return su;
}

// The ShardedTensors `t` with the stage's record attached (format version 6 when set).
ShardedTensors with_stage(ShardedTensors t, const std::shared_ptr<const StageUnits>& su) {
  t.stage = su;
  return t;
}

// What a layout whose file rows are the shard group's records (ShardRowsLayout, EpCanonicalLayout):
// the world size (train_config's; the file's plan is the shard group's), the shard group's size and
// the mesh record (version 5 with cp > 1, 6 with pp > 1, 7 with MoE).
SavedLayout shard_rows_saved(const Mesh& mesh) {
  const MeshDims& d = mesh.dims();
  SavedLayout s;
  s.world_size = mesh.world_size();
  s.shard_group_size = d.fsdp();
  s.tp_record.dp_shard = d.dp_shard;
  s.tp_record.dp_replicate = d.dp_replicate;
  s.tp_record.cp = d.cp;
  s.tp_record.ep = d.ep;
  return s;
}

// FSDP and HSDP (and CP, whose ranks are part of the shard group): a checkpoint holds the shard
// group's rows (dp_shard x cp of them) as the run holds them; replica group 0 writes them
// (Mesh::writes_checkpoint, row Mesh::shard_index). Under PP, each stage's shard group the rows of
// its own units (`stage`: nullptr with one stage).
class ShardRowsLayout final : public CheckpointLayout {
 public:
  ShardRowsLayout(const Mesh& mesh, std::shared_ptr<const StageUnits> stage)
      : writes_(mesh.writes_checkpoint()), stage_(std::move(stage)) {
    saved_ = shard_rows_saved(mesh);
  }
  bool writes_shards() const override { return writes_; }
  ShardedTensors for_save(Comm&, const ShardedTensors& live) override { return with_stage(live, stage_); }
  bool owns_saved_rows() const override { return false; }
  ShardedTensors load_target(const ShardedTensors& live) override { return with_stage(live, stage_); }
  void finish_load(Comm&, const ShardedTensors&) override {}
  const SavedLayout& saved_layout() const override { return saved_; }

 private:
  bool writes_;
  std::shared_ptr<const StageUnits> stage_;
  SavedLayout saved_;
};

// The mesh of one pipeline stage (pp = 1: the stage's ranks, numbered from 0 as a run of one stage
// numbers them; a world rank r of stage s is the stage's rank r - s x stage size).
MeshDims stage_dims(MeshDims d) {
  d.pp = 1;
  return d;
}

// Tensor parallelism: a checkpoint holds the canonical rows (one per rank of the world; under PP,
// of the stage: row = rank in the stage), which every rank writes; TpCheckpointLayout moves the
// state between the two layouts, among the ranks of one stage (no byte crosses stages: under PP
// on a communicator of the stage's ranks, split from the world at the first save or load).
class TpCanonicalLayout final : public CheckpointLayout {
 public:
  TpCanonicalLayout(const Mesh& mesh, const ModelConfig& mc, const PipelineLayout& pl, const RankUnits& ru)
      : mesh_(mesh),
        layout_(MeshLayout(stage_dims(mesh.dims())), stage_rank(mesh), tp_plans(mesh, mc, pl),
                ShardPlan::build(pipeline_rank_units(mc, pl, mesh.coord().pp).units, stage_dims(mesh.dims()).world()),
                checkpoint_tensor_names()),
        stage_(stage_units(pl, ru, llama_units(mc), layout_.canonical_plan())) {
    const MeshDims sd = stage_dims(mesh.dims());
    saved_.world_size = saved_.shard_group_size = sd.world();
    saved_.tp = sd.tp;
    // The record of the whole model's units (a stage's are a part of it; the file holds them all).
    std::vector<ShardPlan> whole;
    for (int t = 0; t < sd.tp; ++t) whole.push_back(ShardPlan::build(llama_units(mc, sd.tp, t), sd.fsdp()));
    saved_.tp_record = tp_record(whole, sd);
  }
  bool writes_shards() const override { return true; }
  ShardedTensors for_save(Comm& world, const ShardedTensors& live) override {
    layout_.to_canonical(comm(world), live);
    return with_stage(layout_.canonical(), stage_);
  }
  bool owns_saved_rows() const override { return true; }
  ShardedTensors load_target(const ShardedTensors& live) override {
    return with_stage(layout_.canonical(live.tensors.size()), stage_);
  }
  void finish_load(Comm& world, const ShardedTensors& live) override { layout_.from_canonical(comm(world), live); }
  const SavedLayout& saved_layout() const override { return saved_; }

 private:
  static int stage_rank(const Mesh& mesh) { return mesh.rank() % stage_dims(mesh.dims()).world(); }
  static std::vector<ShardPlan> tp_plans(const Mesh& mesh, const ModelConfig& mc, const PipelineLayout& pl) {
    std::vector<ShardPlan> plans;
    for (int t = 0; t < mesh.dims().tp; ++t) plans.push_back(rank_unit_plan(mc, mesh.dims(), t, &pl, mesh.coord().pp));
    return plans;
  }
  // The world with one stage; else this rank's stage's communicator (collective over `world` the
  // first time: every rank calls for_save / finish_load together).
  Comm& comm(Comm& world) {
    if (mesh_.dims().pp == 1) return world;
    if (!stage_comm_) {
      stage_comm_ = std::make_unique<MpiComm>(MpiComm::split(world, mesh_.coord().pp, world.rank()));
      stage_comm_->set_collective_timeout(mesh_.collective_timeout());
    }
    return *stage_comm_;
  }
  const Mesh& mesh_;
  TpCheckpointLayout layout_;
  std::shared_ptr<const StageUnits> stage_;
  std::unique_ptr<MpiComm> stage_comm_;
  SavedLayout saved_;
};

// Expert parallelism (format version 7): a checkpoint holds the canonical rows of the shard group,
// as a run without EP holds them (the experts in their block's unit; rows: the shard index), which
// replica group 0 writes; TpCheckpointLayout moves the state between the EP layout (block units
// without their experts, and the EP index's expert units over the expert shard group) and them,
// among the ranks of one shard group (mesh.shard_host(): under PP, of one stage; every replica
// group moves its own copy).
class EpCanonicalLayout final : public CheckpointLayout {
 public:
  EpCanonicalLayout(const Mesh& mesh, const ModelConfig& mc, const PipelineLayout& pl)
      : mesh_(mesh),
        writes_(mesh.writes_checkpoint()),
        layout_(MeshLayout(group_dims(mesh.dims())), mesh.layout().shard_index(mesh.rank()), ep_plans(mesh, mc, pl),
                ShardPlan::build(pipeline_rank_units(mc, pl, mesh.coord().pp).units, mesh.dims().fsdp()),
                checkpoint_tensor_names()),
        stage_(stage_units(pl, pipeline_rank_units(mc, pl, mesh.coord().pp), llama_units(mc), layout_.canonical_plan())) {
    saved_ = shard_rows_saved(mesh);
  }
  bool writes_shards() const override { return writes_; }
  ShardedTensors for_save(Comm&, const ShardedTensors& live) override {
    layout_.to_canonical(mesh_.shard_host(), live);
    return with_stage(layout_.canonical(), stage_);
  }
  bool owns_saved_rows() const override { return true; }
  ShardedTensors load_target(const ShardedTensors& live) override {
    return with_stage(layout_.canonical(live.tensors.size()), stage_);
  }
  void finish_load(Comm&, const ShardedTensors& live) override { layout_.from_canonical(mesh_.shard_host(), live); }
  const SavedLayout& saved_layout() const override { return saved_; }

 private:
  // One shard group (dp_shard x cp ranks, numbered by shard index) with the run's ep.
  static MeshDims group_dims(const MeshDims& d) {
    MeshDims g{1, d.dp_shard, d.cp, 1};
    g.ep = d.ep;
    return g;
  }
  static std::vector<ShardPlan> ep_plans(const Mesh& mesh, const ModelConfig& mc, const PipelineLayout& pl) {
    std::vector<ShardPlan> plans;
    for (int e = 0; e < mesh.dims().ep; ++e) plans.push_back(rank_unit_plan(mc, mesh.dims(), 0, &pl, mesh.coord().pp, e));
    return plans;
  }
  const Mesh& mesh_;
  bool writes_;
  TpCheckpointLayout layout_;
  std::shared_ptr<const StageUnits> stage_;
  SavedLayout saved_;
};

}  // namespace

const char* CommStats::name(CommDim d) {
  static const char* const names[kDims] = {"fsdp", "tp", "cp", "pp", "ep"};
  return names[static_cast<size_t>(d)];
}

double CommStats::exposed_s() const {
  double t = 0;
  for (const DimComm& d : dim) t += d.exposed_s;
  return t;
}

CommStats& CommStats::operator+=(const CommStats& b) {
  for (size_t i = 0; i < dim.size(); ++i) {
    dim[i].calls += b.dim[i].calls;
    dim[i].bytes += b.dim[i].bytes;
    dim[i].issued_s += b.dim[i].issued_s;
    dim[i].exposed_s += b.dim[i].exposed_s;
  }
  return *this;
}

CommStats CommStats::operator-(const CommStats& b) const {
  CommStats r = *this;
  for (size_t i = 0; i < dim.size(); ++i) {
    r.dim[i].calls -= b.dim[i].calls;
    r.dim[i].bytes -= b.dim[i].bytes;
    r.dim[i].issued_s -= b.dim[i].issued_s;
    r.dim[i].exposed_s -= b.dim[i].exposed_s;
  }
  return r;
}

template <typename C> CommStats ParallelRun<C>::comm_stats() const {
  CommStats s;
  const CommTimes f = units->comm_times();
  s[CommDim::Fsdp] = {f.collectives, f.gather_bytes + f.reduce_bytes, f.issued_s, f.exposed_s};
  if (tp) {
    const TpCommStats& t = tp->stats();
    s[CommDim::Tp] = {t.all_gathers + t.reduce_scatters + t.all_reduces, t.bytes(), t.seconds, t.seconds};
  }
  if (cp) {
    const CpCommStats& c = cp->stats();
    s[CommDim::Cp] = {c.transfers, c.bytes, c.issued_s, c.exposed_s};
  }
  if (pp) s[CommDim::Pp] = {pp->calls(), pp->bytes(), pp->issued_s(), pp->exposed_s()};
  if (ep) {
    const EpCommStats& e = ep->stats();
    s[CommDim::Ep] = {e.calls, e.bytes, e.issued_s, e.exposed_s};
  }
  return s;
}

SequenceSplit::SequenceSplit(const Mesh& mesh, int T) : T_(T), Tl_(T) {
  const int cp = mesh.dims().cp;
  if (cp == 1) return;
  rows_ = cp_rows(T, cp, mesh.coord().cp);  // throws cp_split_problem's text
  Tl_ = static_cast<int>(rows_.size());
}

TokenLayout SequenceSplit::take(const int32_t* tokens, const int32_t* targets, const TokenLayout& whole, int B) {
  if (rows_.empty()) {
    tok_ = tokens;
    tgt_ = targets;
    return whole;
  }
  const size_t n = static_cast<size_t>(B) * Tl_;
  tok_l_.resize(n);
  tgt_l_.resize(targets ? n : 0);
  pos_l_.resize(n);
  doc_l_.resize(whole.doc ? n : 0);
  real_l_.resize(whole.real ? n : 0);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < Tl_; ++i) {
      const size_t src = static_cast<size_t>(b) * T_ + static_cast<size_t>(rows_[static_cast<size_t>(i)]);
      const size_t dst = static_cast<size_t>(b) * Tl_ + static_cast<size_t>(i);
      tok_l_[dst] = tokens[src];
      if (targets) tgt_l_[dst] = targets[src];
      pos_l_[dst] = whole.pos ? whole.pos[src] : rows_[static_cast<size_t>(i)];
      if (whole.doc) doc_l_[dst] = whole.doc[src];
      if (whole.real) real_l_[dst] = whole.real[src];
    }
  tok_ = tok_l_.data();
  tgt_ = targets ? tgt_l_.data() : nullptr;
  return {pos_l_.data(), whole.doc ? doc_l_.data() : nullptr, whole.real ? real_l_.data() : nullptr};
}

ShardPlan rank_unit_plan(const ModelConfig& mc, const MeshDims& d, int tp_rank, const PipelineLayout* pl, int pp_rank,
                         int ep_rank) {
  const int experts = d.ep > 1 ? d.fsdp() / d.ep : 0;  // the expert shard group's ranks
  if (pl && pl->ranks > 1)
    return ShardPlan::build(pipeline_rank_units(mc, *pl, pp_rank, d.tp, tp_rank, d.ep, ep_rank).units, d.fsdp(), experts);
  return ShardPlan::build(llama_units(mc, d.tp, tp_rank, d.ep, ep_rank), d.fsdp(), experts);
}

std::string sharding_words(const MeshDims& d) {
  const int N = d.tp, G = d.fsdp();
  const std::string g = d.cp > 1 ? std::to_string(d.dp_shard) + " x " + std::to_string(d.cp) + " (dp_shard x cp)"
                                 : std::to_string(G);
  return (N > 1 ? "(TP " + std::to_string(N) + " x " : "") + g +
         (G * N != d.world() ? " ranks of a shard group" : "") + (N > 1 ? ")" : "") +
         (N > 1 ? ", norms replicated over TP" : "") +
         (d.ep > 1 ? "; the experts 1/" + std::to_string(d.ep) + " per EP index over " + std::to_string(G / d.ep) +
                         " ranks"
                   : "");
}

LayoutRows checkpoint_layout_rows(const ModelConfig& mc, const MeshDims& d) {
  LayoutRows r;
  if (d.tp == 1 && d.ep == 1) return r;  // ShardRowsLayout: the live shards
  // TP: one canonical row per rank of the world; EP: per rank of the shard group (EpCanonicalLayout).
  for (const UnitPlan& up : ShardPlan::build(llama_units(mc), d.tp > 1 ? d.world() : d.fsdp()).units)
    r.elements += up.shard_size;
  r.name = d.tp > 1 ? "checkpoint canonical rows (TP; the snapshot of every save)"
                    : "checkpoint canonical rows (EP; the snapshot of every save)";
  return r;
}

std::string training_refusal(const MeshDims& d, AttentionKind attention) {
  if (d.cp > 1 && attention == AttentionKind::Exact)
    return "option '--attention exact' does not run under '--cp " + std::to_string(d.cp) +
           "': context parallelism computes attention with the tiled block kernels (use '--attention tiled')";
  return "";
}

CpMemory cp_memory(const ModelConfig& mc, const MeshDims& d, CpComm method, int B, int T, size_t elem_bytes) {
  CpMemory m;
  const int C = d.cp;
  m.rows = T / C;
  if (C == 1) {
    m.rows_words = std::to_string(B) + " x " + std::to_string(T) + " tokens";
    return m;
  }
  m.rows_words = std::to_string(B) + " x " + std::to_string(T) + " / " + std::to_string(C) + " = " + std::to_string(B) +
                 " x " + std::to_string(m.rows) + " tokens of each sequence (CP " + std::to_string(C) + ")";
  const int64_t e = static_cast<int64_t>(elem_bytes), HD = mc.head_dim();
  const int64_t kv = int64_t{mc.num_key_value_heads / d.tp} * HD, nh = mc.num_attention_heads / d.tp, q = nh * HD;
  const int64_t r = int64_t{B} * m.rows;  // rows held
  const std::string es = std::to_string(e) + " B";
  if (method == CpComm::Ring) {
    // bf16 (e < 4): the merge accumulates y in fp32 (CpAttention rounds it once, at the end).
    const int64_t yacc = e < 4 ? 4 * r * q : 0;
    m.kv_bytes = e * (12 * r * kv + r * q) + yacc + 4 * 2 * r * nh + 4 * 4 * r;
    m.kv_name = "CP ring K/V buffers";
    m.kv_detail = es + " x (12 x " + std::to_string(r) + " rows x " + std::to_string(kv) + " + the merge's y): K, V "
                  "arriving and dK, dV travelling, double-buffered; " + (yacc ? "the fp32 y accumulator; " : "") +
                  "lse, dsum, positions, document ids";
  } else {
    // One sequence at a time, K/V gathered a chunk of KV heads at a time (cp_gather_kv_heads: at most
    // kCpGatherBytes of gathered K, V, dK, dV and, when chunked, the chunk's packed copies).
    const int nkv = mc.num_key_value_heads / d.tp,
              hk = cp_gather_kv_heads(C, m.rows, static_cast<int>(nh), nkv, static_cast<int>(HD), e);
    m.kv_bytes = cp_gather_scratch_bytes(C, m.rows, static_cast<int>(nh), nkv, static_cast<int>(HD), e) + 4 * r * nh +
                 4 * 2 * int64_t{T};
    const int64_t rounds = C > 2 ? 2 : 1;  // ceil(log2 C) receiving rounds of the first rank, up to 2 buffers
    m.mpi_reduce_scatter_bytes = rounds * 2 * int64_t{T} * hk * HD * e;
    m.kv_name = "CP all-gathered K/V buffers";
    m.kv_detail = "one sequence's gathered K, V and their gradients, " + std::to_string(hk) + " of " +
                  std::to_string(nkv) + " KV heads at a time (at most " +
                  std::to_string(kCpGatherBytes >> 20) + " MiB with the chunk's packed copies)" +
                  "; dsum, positions, document ids";
  }
  return m;
}

ParallelPlan resolve_parallel(const Mesh& mesh, const ModelConfig& mc, const BatchOptions& batch,
                              const PipelineOptions& pp, AttentionKind attention, std::vector<std::string>* notes) {
  if (const std::string why = training_refusal(mesh.dims(), attention); !why.empty()) throw CollectiveError(0, why);
  const GeometryResult g = resolve_geometry(batch, mesh.dims(), mc);
  if (!g.ok()) throw CollectiveError(0, g.refusal);
  ParallelPlan p;
  p.geometry = g.geometry;
  std::string why;
  p.pipeline = resolve_pipeline(mc, mesh.dims().pp, pp, p.geometry.accum, &why);
  if (!why.empty()) throw CollectiveError(0, why);
  p.schedule = p.pipeline.schedule(p.geometry.accum);
  p.eval_schedule = p.pipeline.schedule(p.geometry.accum, false);
  // NCCL: the order of the stages' grouped transfers (pipeline.h), checked on every rank alike.
  if (const std::string line = check_pipeline_transfers(mesh.world(), *mesh.pp_data(), p.pipeline, p.geometry.accum);
      !line.empty())
    notes->push_back(line);
  return p;
}

template <typename C> void ParallelRun<C>::finish_grads() {
  if (tp) state->sum_replicated_grads([&](float* g, size_t n) { tp->all_reduce_sum_acc(g, n); });
  if (pp && stage.tied) {
    const int u = stage.embedding;
    pp->sum_tied(state->backend(), state->grad_shard(u),
                 static_cast<size_t>(state->plan().units[static_cast<size_t>(u)].shard_size));
  }
}

template <typename C>
ParallelRun<C> parallelize(const Mesh& mesh, const ModelConfig& mc, Backend<float>& be, Backend<bf16>* be16,
                           const ParallelOptions& o) {
  ParallelRun<C> r;
  const MeshDims& d = mesh.dims();
  // Each rank holds its TP slices (llama_units), sharded over its shard group (dp_shard x cp ranks
  // of equal TP rank).
  // With a pipeline, only this rank's chunks (pipeline_rank_units), sharded over its stage's group.
  r.plan = o.plan;
  PipelineLayout& pl = r.plan.pipeline;
  if (pl.bounds.empty()) pl.bounds = {0, mc.num_hidden_layers};
  // Under EP, each MoE block's experts are a unit of this rank's EP index, sharded over its expert
  // shard group (the shard group's ranks of that EP index), in their own pipeline (GroupedUnits).
  const int ep_rank = mesh.layout().ep_index(mesh.rank());
  r.stage = pipeline_rank_units(mc, pl, mesh.coord().pp, d.tp, mesh.coord().tp, d.ep, ep_rank);
  r.state = std::make_unique<ShardedState<float>>(
      be, mesh.world(), ShardPlan::build(r.stage.units, d.fsdp(), d.ep > 1 ? d.fsdp() / d.ep : 0), &mesh.shard_data(),
      mesh.replica_data(), mesh.expert_shard_data());
  if (d.pp > 1) {
    // The compute backend: its memory holds the activations, its kernels advance the transfers.
    if constexpr (std::is_same_v<C, bf16>) r.pp = std::make_unique<StageLink<C>>(*mesh.pp_data(), pl, *be16);
    else r.pp = std::make_unique<StageLink<C>>(*mesh.pp_data(), pl, be);
  }
  if (d.tp > 1) r.tp = std::make_unique<TpGroup<C>>(*mesh.tp_data());
  if (d.ep > 1) {  // its all-to-alls advance during the compute backend's kernels
    if constexpr (std::is_same_v<C, bf16>) r.ep = std::make_unique<EpGroup<C>>(*mesh.ep_host(), *mesh.ep_data(), be16->progress());
    else r.ep = std::make_unique<EpGroup<C>>(*mesh.ep_host(), *mesh.ep_data(), be.progress());
  }
  const Reshard reshard = pl.ranks > 1 ? o.pp_reshard : Reshard::PerUse;
  // One pipeline per unit group of the state (the expert units' under EP: GroupedUnits).
  auto lane = [&](int g) -> std::unique_ptr<UnitPipeline<C>> {
    if constexpr (std::is_same_v<C, bf16>)
      return std::make_unique<UnitPipeline<bf16>>(
          *be16, std::make_unique<Bf16Codec>(*r.state, *be16, o.reduce_bf16, Bf16Codec::kWidenSlab, g), o.overlap, reshard);
    else
      return std::make_unique<UnitPipeline<float>>(be, std::make_unique<IdentityCodec<float>>(*r.state, g), o.overlap,
                                                   reshard);
  };
  if constexpr (std::is_same_v<C, bf16>) {
    if (!be16) throw std::invalid_argument("parallelize: mixed precision needs the bf16 backend");
    if (d.cp > 1) r.cp = std::make_unique<CpAttention<bf16>>(*mesh.cp_data(), *be16, o.cp_comm, kCpGatherBytes, mesh.cp_host());
  } else {
    if (d.cp > 1) r.cp = std::make_unique<CpAttention<float>>(*mesh.cp_data(), be, o.cp_comm, kCpGatherBytes, mesh.cp_host());
  }
  std::vector<std::unique_ptr<UnitPipeline<C>>> lanes;
  for (int g = 0; g < r.state->num_groups(); ++g) lanes.push_back(lane(g));
  r.overlap = lanes.front()->overlap();
  r.units = group_sources(std::move(lanes), r.state->plan());
  if (o.checkpoints) {
    if (d.tp > 1) r.checkpoint = std::make_unique<TpCanonicalLayout>(mesh, mc, pl, r.stage);
    else if (d.ep > 1) r.checkpoint = std::make_unique<EpCanonicalLayout>(mesh, mc, pl);
    else r.checkpoint = std::make_unique<ShardRowsLayout>(mesh, stage_units(pl, r.stage, llama_units(mc), r.state->plan()));
  }
  return r;
}

template struct ParallelRun<float>;
template struct ParallelRun<bf16>;
template ParallelRun<float> parallelize<float>(const Mesh&, const ModelConfig&, Backend<float>&, Backend<bf16>*,
                                               const ParallelOptions&);
template ParallelRun<bf16> parallelize<bf16>(const Mesh&, const ModelConfig&, Backend<float>&, Backend<bf16>*,
                                             const ParallelOptions&);

}  // namespace shardtrain
