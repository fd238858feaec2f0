// The shard plan (shard_plan.h): units, flat layout, per-rank shards; the reduce-scatter slab.
#include "shardtrain/shard/shard_plan.h"
#include <algorithm>
#include <set>
#include <stdexcept>

namespace shardtrain {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int64_t ParamSpec::canonical_index(int64_t e) const {
  if (tp.degree <= 1 || tp.split == TpSplit::None || tp.split == TpSplit::Replicated) return e;
  const int64_t lcols = shape.size() >= 2 ? numel() / shape[0] : 1;
  const int64_t r = e / lcols, c = e % lcols;
  if (tp.split == TpSplit::Rows) return tp.offset + r < tp.rows ? (tp.offset + r) * tp.cols + c : -1;
  return r * tp.cols + tp.offset + c;  // Cols
}

const ParamSlot& UnitPlan::param(const std::string& n) const {
  for (auto& p : params)
    if (p.spec.name == n) return p;
  throw std::out_of_range("unit '" + name + "' has no parameter '" + n + "'");
}

ShardPlan ShardPlan::build(const std::vector<UnitSpec>& units, int world0, int expert_world) {
  if (world0 < 1) throw std::invalid_argument("ShardPlan: world size must be >= 1, got " + std::to_string(world0));
  ShardPlan plan;
  plan.world_size = world0;
  std::set<std::string> seen;
  for (const auto& us : units) {
    if (us.params.empty()) throw std::invalid_argument("ShardPlan: unit '" + us.name + "' has no parameters");
    if (us.group != 0 && us.group != 1)
      throw std::invalid_argument("ShardPlan: unit '" + us.name + "' is in group " + std::to_string(us.group));
    if (us.group == 1 && expert_world < 1)
      throw std::invalid_argument("ShardPlan: unit '" + us.name + "' is an expert shard group's, whose size is " +
                                  std::to_string(expert_world));
    if (us.group == 1) plan.expert_world_size = expert_world;
    const int world = us.group == 0 ? world0 : expert_world;
    UnitPlan up;
    up.name = us.name;
    up.group = us.group;
    int64_t off = 0;
    for (const auto& ps : us.params) {
      if (!seen.insert(ps.name).second) throw std::invalid_argument("ShardPlan: duplicate parameter '" + ps.name + "'");
      for (auto d : ps.shape)
        if (d <= 0) throw std::invalid_argument("ShardPlan: parameter '" + ps.name + "' has a non-positive dimension");
      ParamSlot slot{ps, off, ps.numel()};
      off += slot.numel;
      up.params.push_back(slot);
    }
    up.numel = off;
    up.shard_size = std::max<int64_t>(1, (off + world - 1) / world);
    up.padded_numel = up.shard_size * world;
    for (int r = 0; r < world; ++r) {
      RankShard rs;
      rs.start = r * up.shard_size;
      rs.valid = std::clamp<int64_t>(up.numel - rs.start, 0, up.shard_size);
      rs.padding = up.shard_size - rs.valid;
      up.ranks.push_back(rs);
    }
    plan.units.push_back(std::move(up));
  }
  return plan;
}

ShardPlan ShardPlan::group_plan(int g, std::vector<int>* index) const {
  ShardPlan p;
  p.world_size = group_size(g);
  if (index) index->clear();
  for (size_t u = 0; u < units.size(); ++u)
    if (units[u].group == g) {
      p.units.push_back(units[u]);
      p.units.back().group = 0;
      if (index) index->push_back(static_cast<int>(u));
    }
  return p;
}

int64_t ShardPlan::max_padded_numel() const {
  int64_t m = 0;
  for (const UnitPlan& u : units) m = std::max(m, u.padded_numel);
  return m;
}

int64_t ShardPlan::max_shard_size() const {
  int64_t m = 0;
  for (const UnitPlan& u : units) m = std::max(m, u.shard_size);
  return m;
}

int64_t ShardPlan::total_numel() const {
  int64_t n = 0;
  for (auto& u : units) n += u.numel;
  return n;
}

int ShardPlan::unit_index(const std::string& name) const {
  for (size_t i = 0; i < units.size(); ++i)
    if (units[i].name == name) return static_cast<int>(i);
  return -1;
}

size_t reduce_slab(const ShardPlan& plan, size_t slab_elements, bool stream_lane) {
  const size_t max_shard = static_cast<size_t>(plan.max_shard_size()), W = static_cast<size_t>(plan.world_size);
  if (stream_lane) return max_shard;
  return std::min(max_shard, std::max<size_t>(1, slab_elements / W));
}

}  // namespace shardtrain
