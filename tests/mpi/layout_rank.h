// The layout-checkpoint MPI tests' rank (test_cp_checkpoint.cpp, test_pp_checkpoint.cpp): one
// rank of a run laid out by the parallel layer, its shards filled with value() at each element's
// canonical place, and the count of elements that differ from it after a load.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/parallelize.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/runtime/runtime.h"
#include "../test_env.h"

namespace layout_test {

namespace st = shardtrain;

// Tensor k (params, adam_m, adam_v), model unit u, canonical flat element i: distinct values, exact in
// float32 (tests/e2e/test_cp_layout.sh writes the same formula in Python).
inline float value(size_t k, size_t u, int64_t i) {
  return static_cast<float>(1000000 * k + 10000 * u + i % 9973) + 0.25f;
}

// One rank of a run laid out by the parallel layer at mesh `d` (pipeline of d.pp stages, `virt`
// chunks each) over `comm`: its parameter shards and AdamW moments, with the run's checkpoint layout.
struct Rank {
  std::unique_ptr<st::Mesh> mesh;
  st::ParallelRun<float> run;
  std::vector<std::vector<float>> m, v;
  Rank(st::Comm& c, const st::MeshDims& d, const st::ModelConfig& cfg, st::Backend<float>& be, int virt = 1)
      : mesh(std::make_unique<st::Mesh>(c, st::testing::g_runtime->topo(), d, 0)) {
    st::ParallelOptions o;
    o.overlap.on = false;
    o.checkpoints = true;
    st::PipelineOptions po;
    if (virt > 1) {
      po.kind = st::PipelineKind::Interleaved;
      po.chunks_per_rank = virt;
    }
    std::string why;
    o.plan.pipeline = st::resolve_pipeline(cfg, d.pp, po, 0, &why);
    if (!why.empty()) throw std::invalid_argument(why);
    run = st::parallelize<float>(*mesh, cfg, be, nullptr, o);
    for (const st::UnitPlan& up : run.state->plan().units) {
      m.emplace_back(static_cast<size_t>(up.shard_size), -3.0f);
      v.emplace_back(static_cast<size_t>(up.shard_size), -3.0f);
    }
  }
  st::ShardedTensors tensors(st::Backend<float>& be) {
    st::ShardedTensors t;
    t.plan = &run.state->plan();
    t.plan_rank = run.state->plan_rank();
    t.backend = &be;
    const auto& names = st::checkpoint_tensor_names();
    st::ShardedTensor p{names[0], {}}, mm{names[1], {}}, vv{names[2], {}};
    for (int u = 0; u < run.state->num_units(); ++u) {
      p.shards.push_back(run.state->param_shard(u));
      mm.shards.push_back(m[static_cast<size_t>(u)].data());
      vv.shards.push_back(v[static_cast<size_t>(u)].data());
    }
    t.tensors = {p, mm, vv};
    return t;
  }
};

// Sets (fill) or counts the elements that differ from (check) value() at their canonical place;
// a stage's unit is found in the whole model by name, an expert unit's parameters (expert
// parallelism) in their block's unit, and its row is the expert shard group's (plan rank / ep).
inline int64_t visit(const st::ShardedTensors& t, const st::ShardPlan& canon, bool fill) {
  int64_t bad = 0;
  auto canonical_unit = [&](const std::string& param) {
    for (size_t c = 0; c < canon.units.size(); ++c)
      for (const auto& slot : canon.units[c].params)
        if (slot.spec.name == param) return c;
    throw std::invalid_argument("visit: no canonical unit holds '" + param + "'");
  };
  for (size_t u = 0; u < t.plan->units.size(); ++u) {
    const st::UnitPlan& up = t.plan->units[u];
    const size_t mu = canonical_unit(up.params.front().spec.name);
    const int ep = up.group == 1 ? t.plan->world_size / t.plan->expert_world_size : 1;
    const st::RankShard& rs = up.ranks[static_cast<size_t>(t.plan_rank / ep)];
    for (size_t k = 0; k < t.tensors.size(); ++k) {
      float* r = t.tensors[k].shards[u];
      for (int64_t e = 0; e < up.shard_size; ++e) {
        float want = 0.0f;
        const int64_t flat = rs.start + e;
        if (e < rs.valid)
          for (const auto& slot : up.params)
            if (flat >= slot.offset && flat < slot.offset + slot.numel) {
              const int64_t ci = slot.spec.canonical_index(flat - slot.offset);
              if (ci >= 0) want = value(k, mu, canon.units[mu].param(slot.spec.name).offset + ci);
            }
        if (fill) r[e] = want;
        else if (r[e] != want) ++bad;
      }
    }
  }
  return bad;
}

// Writes rank `a`'s tensors through its run's checkpoint layout to `file` (collective), as the
// trainer saves: the layout's rows, its record, step 0 with `train_config` as the train config.
inline void save_rank(st::Comm& c, Rank& a, const st::ModelConfig& cfg, st::Backend<float>& be,
                      const std::string& file, const char* train_config) {
  st::CheckpointLayout& layout = *a.run.checkpoint;
  const st::ShardedTensors rows = layout.for_save(c, a.tensors(be));  // collective
  st::TrainState state;
  state.step = 0;
  state.seed = 7;
  st::CheckpointSnapshot snap = st::take_checkpoint_snapshot(rows, cfg, train_config, state, layout.writes_shards());
  snap.tp = layout.saved_layout().tp_record;
  st::write_checkpoint_file(c, file, snap);
}

// Loads `file` into rank `b` through its run's checkpoint layout (collective) and counts the elements
// that differ from value() at their canonical place (`canon`: the whole model's units).
inline int64_t load_rank(st::Comm& c, Rank& b, const st::ModelConfig& cfg, st::Backend<float>& be,
                         const std::string& file, const st::ShardPlan& canon) {
  st::CheckpointLayout& layout = *b.run.checkpoint;
  const st::ShardedTensors live = b.tensors(be);
  st::load_checkpoint(c, file, layout.load_target(live), cfg);
  layout.finish_load(c, live);  // collective
  return visit(live, canon, false);
}

}  // namespace layout_test
