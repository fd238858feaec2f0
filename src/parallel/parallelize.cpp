// The parallel layer's entry point (parallelize.h): the run's layout from its mesh.
#include "shardtrain/parallelize.h"

#include <string>
#include <type_traits>

#include "shardtrain/model.h"  // llama_units

namespace shardtrain {

namespace {

// FSDP and HSDP: a checkpoint holds the shard group's rows as the run holds them; replica group 0
// writes them (Mesh::writes_checkpoint).
class ShardRowsLayout final : public CheckpointLayout {
 public:
  explicit ShardRowsLayout(const Mesh& mesh) : writes_(mesh.writes_checkpoint()) {
    saved_.world_size = mesh.world_size();  // train_config's; the file's plan is the shard group's
    saved_.shard_group_size = mesh.dims().dp_shard;
  }
  bool writes_shards() const override { return writes_; }
  ShardedTensors for_save(Comm&, const ShardedTensors& live) override { return live; }
  bool owns_saved_rows() const override { return false; }
  ShardedTensors load_target(const ShardedTensors& live) override { return live; }
  void finish_load(Comm&, const ShardedTensors&) override {}
  const SavedLayout& saved_layout() const override { return saved_; }

 private:
  bool writes_;
  SavedLayout saved_;
};

// Tensor parallelism: a checkpoint holds the canonical rows (one per world rank), which every rank
// writes; TpCheckpointLayout moves the state between the two layouts.
class TpCanonicalLayout final : public CheckpointLayout {
 public:
  TpCanonicalLayout(const Mesh& mesh, const ModelConfig& mc)
      : layout_(mesh.layout(), mesh.rank(), tp_plans(mesh, mc), ShardPlan::build(llama_units(mc), mesh.world_size()),
                checkpoint_tensor_names()) {
    saved_.world_size = saved_.shard_group_size = mesh.world_size();
    saved_.tp = mesh.dims().tp;
    saved_.tp_record = tp_record(layout_.tp_plans(), mesh.dims());
  }
  bool writes_shards() const override { return true; }
  ShardedTensors for_save(Comm& world, const ShardedTensors& live) override {
    layout_.to_canonical(world, live);
    return layout_.canonical();
  }
  bool owns_saved_rows() const override { return true; }
  ShardedTensors load_target(const ShardedTensors& live) override { return layout_.canonical(live.tensors.size()); }
  void finish_load(Comm& world, const ShardedTensors& live) override { layout_.from_canonical(world, live); }
  const SavedLayout& saved_layout() const override { return saved_; }

 private:
  static std::vector<ShardPlan> tp_plans(const Mesh& mesh, const ModelConfig& mc) {
    std::vector<ShardPlan> plans;
    for (int t = 0; t < mesh.dims().tp; ++t) plans.push_back(rank_unit_plan(mc, mesh.dims(), t));
    return plans;
  }
  TpCheckpointLayout layout_;
  SavedLayout saved_;
};

}  // namespace

const char* CommStats::name(CommDim d) {
  static const char* const names[kDims] = {"fsdp", "tp", "cp", "pp"};
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
  return s;
}

ShardPlan rank_unit_plan(const ModelConfig& mc, const MeshDims& d, int tp_rank) {
  return ShardPlan::build(llama_units(mc, d.tp, tp_rank), d.dp_shard);
}

std::string sharding_words(const MeshDims& d) {
  const int N = d.tp, G = d.dp_shard;
  return (N > 1 ? "(TP " + std::to_string(N) + " x " : "") + std::to_string(G) +
         (G * N != d.world() ? " ranks of a shard group" : "") + (N > 1 ? ")" : "") +
         (N > 1 ? ", norms replicated over TP" : "");
}

LayoutRows checkpoint_layout_rows(const ModelConfig& mc, const MeshDims& d) {
  LayoutRows r;
  if (d.tp == 1) return r;  // ShardRowsLayout: the live shards
  for (const UnitPlan& up : ShardPlan::build(llama_units(mc), d.world()).units) r.elements += up.shard_size;
  r.name = "checkpoint canonical rows (TP; the snapshot of every save)";
  return r;
}

template <typename C> void ParallelRun<C>::finish_grads() {
  if (tp) state->sum_replicated_grads([&](float* g, size_t n) { tp->all_reduce_sum_acc(g, n); });
}

template <typename C>
ParallelRun<C> parallelize(const Mesh& mesh, const ModelConfig& mc, Backend<float>& be, Backend<bf16>* be16,
                           const ParallelOptions& o) {
  ParallelRun<C> r;
  const MeshDims& d = mesh.dims();
  // Each rank holds its TP slices (llama_units), sharded over its shard group (dp_shard ranks of
  // equal TP rank).
  r.state = std::make_unique<ShardedState<float>>(be, mesh, rank_unit_plan(mc, d, mesh.coord().tp));
  if (d.tp > 1) r.tp = std::make_unique<TpGroup<C>>(*mesh.tp_data());
  if constexpr (std::is_same_v<C, bf16>) {
    if (!be16) throw std::invalid_argument("parallelize: mixed precision needs the bf16 backend");
    r.units = std::make_unique<MixedPrecisionUnits>(*r.state, *be16, o.reduce_bf16, MixedPrecisionUnits::kWidenSlab, o.overlap);
  } else {
    r.units = std::make_unique<UnitPipeline<float>>(be, std::make_unique<IdentityCodec<float>>(*r.state), o.overlap);
  }
  if (o.checkpoints) {
    if (d.tp > 1) r.checkpoint = std::make_unique<TpCanonicalLayout>(mesh, mc);
    else r.checkpoint = std::make_unique<ShardRowsLayout>(mesh);
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
