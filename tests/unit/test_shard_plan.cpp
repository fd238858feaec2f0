// Property tests of ShardPlan (pure logic, no collectives; runs at world size 1).
//
// For several hundred random unit layouts and every world size 1..8 the plan must satisfy the
// layout described in shard.h: S = max(1, ceil(numel / W)), padded_numel = S * W, rank r owns
// [r*S, (r+1)*S) with valid = clamp(numel - r*S, 0, S) real elements followed by zero padding, and
// parameters are laid out contiguously in declaration order. The FSDP data movement is then
// simulated by hand (cut a flat buffer into zero-padded shards, concatenate them as an all-gather
// would) to check that the layout round-trips every element exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/shard/shard.h"

namespace {

using shardtrain::Init;
using shardtrain::ParamSpec;
using shardtrain::RankShard;
using shardtrain::ShardPlan;
using shardtrain::UnitPlan;
using shardtrain::UnitSpec;

constexpr int kMaxWorld = 8;
constexpr int kRandomSets = 250;

int64_t spec_numel(const ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}

int64_t unit_numel(const UnitSpec& u) {
  int64_t n = 0;
  for (const auto& p : u.params) n += spec_numel(p);
  return n;
}

// Smallest S >= 1 with S * W >= numel, found by a different route than integer ceil-division.
int64_t expected_shard_size(int64_t numel, int world) {
  auto s = static_cast<int64_t>(std::ceil(static_cast<double>(numel) / static_cast<double>(world)));
  return std::max<int64_t>(1, s);
}

ParamSpec param(std::string name, std::vector<int64_t> shape, Init init = Init::Normal) {
  ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.init = init;
  p.weight_decay = init == Init::Normal;
  return p;
}

// Checks every documented property of one unit's plan against its spec.
void check_unit_plan(const UnitSpec& spec, const UnitPlan& up, int world) {
  SCOPED_TRACE("unit '" + spec.name + "' world " + std::to_string(world));
  const int64_t numel = unit_numel(spec);
  const int64_t S = expected_shard_size(numel, world);

  EXPECT_EQ(up.name, spec.name);
  EXPECT_EQ(up.numel, numel);
  EXPECT_EQ(up.shard_size, S);
  EXPECT_GE(up.shard_size, 1);
  if (up.shard_size > 1) {
    EXPECT_LT((up.shard_size - 1) * world, numel) << "shard_size is not minimal";
  }
  EXPECT_EQ(up.padded_numel, S * world);
  EXPECT_GE(up.padded_numel, numel);
  EXPECT_LT(up.padded_numel - numel, world) << "more padding than one element per rank";

  ASSERT_EQ(up.ranks.size(), static_cast<size_t>(world));
  int64_t valid_sum = 0;
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankShard& rs = up.ranks[static_cast<size_t>(r)];
    EXPECT_EQ(rs.start, static_cast<int64_t>(r) * up.shard_size);
    EXPECT_EQ(rs.valid + rs.padding, up.shard_size);
    EXPECT_GE(rs.valid, 0);
    EXPECT_LE(rs.valid, up.shard_size);
    EXPECT_GE(rs.padding, 0);
    // Independent per-rank count: how many flat indices in [start, start+S) are < numel.
    int64_t real = 0;
    for (int64_t e = rs.start; e < rs.start + up.shard_size; ++e)
      if (e < numel) ++real;
    EXPECT_EQ(rs.valid, real);
    if (rs.start >= numel) {
      EXPECT_EQ(rs.valid, 0) << "a shard past the end must be all padding";
    }
    // Valid elements come first: a rank with padding is the last rank with data or after it.
    if (rs.padding > 0 && r + 1 < world) {
      EXPECT_EQ(up.ranks[static_cast<size_t>(r + 1)].valid, 0);
    }
    valid_sum += rs.valid;
  }
  EXPECT_EQ(valid_sum, numel);

  ASSERT_EQ(up.params.size(), spec.params.size());
  int64_t off = 0;
  for (size_t j = 0; j < spec.params.size(); ++j) {
    const auto& slot = up.params[j];
    SCOPED_TRACE("param '" + spec.params[j].name + "'");
    EXPECT_EQ(slot.spec.name, spec.params[j].name);
    EXPECT_EQ(slot.spec.shape, spec.params[j].shape);
    EXPECT_EQ(slot.spec.init, spec.params[j].init);
    EXPECT_EQ(slot.offset, off) << "parameters must be contiguous in declaration order";
    EXPECT_EQ(slot.numel, spec_numel(spec.params[j]));
    EXPECT_EQ(&up.param(spec.params[j].name), &slot);
    off += spec_numel(spec.params[j]);
  }
  EXPECT_EQ(off, up.numel);
  EXPECT_THROW(up.param("no.such.parameter"), std::out_of_range);
}

// Simulates FSDP by hand for one unit: each parameter gets random values, they are concatenated
// in declaration order into the flat buffer, the buffer is cut into per-rank zero-padded shards
// (valid elements first), and the shards are concatenated as an all-gather would.
void check_unit_layout(const UnitPlan& up, int world, std::mt19937& rng) {
  SCOPED_TRACE("layout of unit '" + up.name + "' world " + std::to_string(world));
  std::uniform_real_distribution<double> mag(0.5, 1.5);
  std::bernoulli_distribution neg(0.5);

  // Per-parameter tensors (never zero, so padding cannot be mistaken for data).
  std::vector<std::vector<double>> tensors;
  std::vector<double> flat;
  for (const auto& slot : up.params) {
    std::vector<double> t(static_cast<size_t>(slot.numel));
    for (auto& v : t) v = neg(rng) ? -mag(rng) : mag(rng);
    flat.insert(flat.end(), t.begin(), t.end());
    tensors.push_back(std::move(t));
  }
  ASSERT_EQ(static_cast<int64_t>(flat.size()), up.numel);

  // Cut into shards.
  std::vector<std::vector<double>> shards(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const RankShard& rs = up.ranks[static_cast<size_t>(r)];
    auto& sh = shards[static_cast<size_t>(r)];
    sh.assign(static_cast<size_t>(up.shard_size), 0.0);
    for (int64_t k = 0; k < rs.valid; ++k) sh[static_cast<size_t>(k)] = flat[static_cast<size_t>(rs.start + k)];
    // Every element of the shard past `valid` is padding and stays zero.
    for (int64_t k = rs.valid; k < up.shard_size; ++k) EXPECT_EQ(sh[static_cast<size_t>(k)], 0.0);
  }

  // All-gather: concatenate the shards in rank order.
  std::vector<double> gathered;
  for (const auto& sh : shards) gathered.insert(gathered.end(), sh.begin(), sh.end());
  ASSERT_EQ(static_cast<int64_t>(gathered.size()), up.padded_numel);

  int64_t mismatches = 0, nonzero_padding = 0;
  for (int64_t i = 0; i < up.numel; ++i)
    if (gathered[static_cast<size_t>(i)] != flat[static_cast<size_t>(i)]) ++mismatches;
  for (int64_t i = up.numel; i < up.padded_numel; ++i)
    if (gathered[static_cast<size_t>(i)] != 0.0) ++nonzero_padding;
  EXPECT_EQ(mismatches, 0) << "gathered buffer differs from the original flat buffer";
  EXPECT_EQ(nonzero_padding, 0) << "padding of the gathered buffer is not zero";

  // Each parameter is found again at its offset.
  for (size_t j = 0; j < up.params.size(); ++j) {
    const auto& slot = up.params[j];
    int64_t bad = 0;
    for (int64_t i = 0; i < slot.numel; ++i)
      if (gathered[static_cast<size_t>(slot.offset + i)] != tensors[j][static_cast<size_t>(i)]) ++bad;
    EXPECT_EQ(bad, 0) << "parameter '" << slot.spec.name << "' not at its offset after the gather";
  }

  // Every real element is owned by exactly one rank: index i lives on rank i / S at i % S < valid.
  for (int64_t i = 0; i < up.numel; ++i) {
    int64_t owner = i / up.shard_size;
    ASSERT_LT(owner, world);
    ASSERT_LT(i - up.ranks[static_cast<size_t>(owner)].start, up.ranks[static_cast<size_t>(owner)].valid);
  }
}

void check_plan(const std::vector<UnitSpec>& units, int world, std::mt19937& rng) {
  ShardPlan plan = ShardPlan::build(units, world);
  EXPECT_EQ(plan.world_size, world);
  ASSERT_EQ(plan.units.size(), units.size());
  int64_t total = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    check_unit_plan(units[u], plan.units[u], world);
    check_unit_layout(plan.units[u], world, rng);
    EXPECT_EQ(plan.unit_index(units[u].name), static_cast<int>(u));
    total += unit_numel(units[u]);
  }
  EXPECT_EQ(plan.total_numel(), total);
  EXPECT_EQ(plan.unit_index("no.such.unit"), -1);
}

// A random unit: 1..4 parameters of 1..3 dimensions, biased towards tiny sizes so that units with
// fewer elements than ranks are common.
UnitSpec random_unit(std::mt19937& rng, const std::string& prefix) {
  std::uniform_int_distribution<int> nparams(1, 4), ndims(1, 3), small(1, 3), large(1, 40), kind(0, 3), init(0, 2);
  UnitSpec u;
  u.name = prefix;
  int np = nparams(rng);
  for (int j = 0; j < np; ++j) {
    std::vector<int64_t> shape;
    int nd = ndims(rng);
    for (int d = 0; d < nd; ++d) shape.push_back(kind(rng) == 0 ? large(rng) : small(rng));
    u.params.push_back(param(prefix + ".p" + std::to_string(j), shape, static_cast<Init>(init(rng))));
  }
  return u;
}

TEST(ShardPlanProperty, RandomUnitsEveryWorldSize) {
  std::mt19937 rng(0x5eed1234u);
  std::uniform_int_distribution<int> nunits(1, 3);
  int plans = 0;
  for (int set = 0; set < kRandomSets; ++set) {
    std::vector<UnitSpec> units;
    int nu = nunits(rng);
    for (int k = 0; k < nu; ++k) {
      std::string name = "s";  // built by appending (GCC 12 warns falsely on "lit" + std::string&&)
      name += std::to_string(set);
      name += ".u";
      name += std::to_string(k);
      units.push_back(random_unit(rng, name));
    }
    for (int world = 1; world <= kMaxWorld; ++world) {
      SCOPED_TRACE("random set " + std::to_string(set));
      check_plan(units, world, rng);
      ++plans;
      if (::testing::Test::HasFailure()) return;  // one bad set is enough output
    }
  }
  EXPECT_EQ(plans, kRandomSets * kMaxWorld);
}

TEST(ShardPlanProperty, TinyUnitsEveryWorldSize) {
  // Units with fewer elements than ranks, and sizes not divisible by the world size.
  std::vector<UnitSpec> units = {
      {"one", {param("one.w", {1})}},
      {"two", {param("two.w", {2}, Init::Ones)}},
      {"norm6", {param("norm6.weight", {6}, Init::Ones)}},
      {"odd", {param("odd.a", {5, 7}), param("odd.b", {13}, Init::Zeros), param("odd.c", {2})}},
      {"ones", {param("ones.a", {1, 1, 1}), param("ones.b", {1})}},
  };
  std::mt19937 rng(7);
  for (int world = 1; world <= kMaxWorld; ++world) check_plan(units, world, rng);
}

TEST(ShardPlanProperty, ExplicitSmallCases) {
  // A norm of 6 elements at world 4: S = 2, the last rank is all padding.
  {
    ShardPlan p = ShardPlan::build({{"norm", {param("norm.weight", {6}, Init::Ones)}}}, 4);
    const UnitPlan& u = p.units[0];
    EXPECT_EQ(u.numel, 6);
    EXPECT_EQ(u.shard_size, 2);
    EXPECT_EQ(u.padded_numel, 8);
    ASSERT_EQ(u.ranks.size(), 4u);
    const int64_t start[] = {0, 2, 4, 6}, valid[] = {2, 2, 2, 0}, pad[] = {0, 0, 0, 2};
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(u.ranks[r].start, start[r]) << "rank " << r;
      EXPECT_EQ(u.ranks[r].valid, valid[r]) << "rank " << r;
      EXPECT_EQ(u.ranks[r].padding, pad[r]) << "rank " << r;
    }
  }
  // A single parameter of shape {2} at world 4: S = 1, ranks 2 and 3 hold only padding.
  {
    ShardPlan p = ShardPlan::build({{"b", {param("b.bias", {2})}}}, 4);
    const UnitPlan& u = p.units[0];
    EXPECT_EQ(u.shard_size, 1);
    EXPECT_EQ(u.padded_numel, 4);
    const int64_t valid[] = {1, 1, 0, 0};
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(u.ranks[r].start, r);
      EXPECT_EQ(u.ranks[r].valid, valid[r]) << "rank " << r;
      EXPECT_EQ(u.ranks[r].padding, 1 - valid[r]) << "rank " << r;
    }
  }
  // A single element at world 8.
  {
    ShardPlan p = ShardPlan::build({{"s", {param("s.x", {1})}}}, 8);
    const UnitPlan& u = p.units[0];
    EXPECT_EQ(u.shard_size, 1);
    EXPECT_EQ(u.padded_numel, 8);
    for (int r = 0; r < 8; ++r) EXPECT_EQ(u.ranks[r].valid, r == 0 ? 1 : 0) << "rank " << r;
  }
  // 50 elements (13 + 35 + 2) at world 3 and 4: parameters straddle shard boundaries.
  {
    UnitSpec us{"L", {param("L.norm", {13}, Init::Ones), param("L.q", {5, 7}), param("L.bias", {2})}};
    ShardPlan p3 = ShardPlan::build({us}, 3);
    EXPECT_EQ(p3.units[0].shard_size, 17);
    EXPECT_EQ(p3.units[0].ranks[2].valid, 16);
    EXPECT_EQ(p3.units[0].ranks[2].padding, 1);
    EXPECT_EQ(p3.units[0].param("L.q").offset, 13);
    EXPECT_EQ(p3.units[0].param("L.bias").offset, 48);
    ShardPlan p4 = ShardPlan::build({us}, 4);
    EXPECT_EQ(p4.units[0].shard_size, 13);
    EXPECT_EQ(p4.units[0].ranks[3].start, 39);
    EXPECT_EQ(p4.units[0].ranks[3].valid, 11);
    EXPECT_EQ(p4.units[0].ranks[3].padding, 2);
  }
  // World 1: one shard holding everything, no padding.
  {
    ShardPlan p = ShardPlan::build({{"w", {param("w.a", {3, 5}), param("w.b", {4})}}}, 1);
    EXPECT_EQ(p.units[0].shard_size, 19);
    EXPECT_EQ(p.units[0].padded_numel, 19);
    EXPECT_EQ(p.units[0].ranks[0].valid, 19);
    EXPECT_EQ(p.units[0].ranks[0].padding, 0);
  }
}

TEST(ShardPlanProperty, RejectsInvalidInput) {
  const std::vector<UnitSpec> good = {{"u", {param("u.w", {3, 4})}}};
  EXPECT_NO_THROW(ShardPlan::build(good, 1));

  // World size < 1.
  EXPECT_THROW(ShardPlan::build(good, 0), std::invalid_argument);
  EXPECT_THROW(ShardPlan::build(good, -1), std::invalid_argument);

  // An empty unit (alone, or after a valid one).
  EXPECT_THROW(ShardPlan::build({{"empty", {}}}, 2), std::invalid_argument);
  EXPECT_THROW(ShardPlan::build({good[0], {"empty", {}}}, 2), std::invalid_argument);

  // A zero or negative dimension.
  EXPECT_THROW(ShardPlan::build({{"z", {param("z.w", {0})}}}, 1), std::invalid_argument);
  EXPECT_THROW(ShardPlan::build({{"z", {param("z.w", {4, 0, 3})}}}, 2), std::invalid_argument);
  EXPECT_THROW(ShardPlan::build({{"z", {param("z.a", {2}), param("z.w", {3, 0})}}}, 4), std::invalid_argument);
  EXPECT_THROW(ShardPlan::build({{"n", {param("n.w", {-2, 3})}}}, 1), std::invalid_argument);

  // A duplicate parameter name, within a unit and across units.
  EXPECT_THROW(ShardPlan::build({{"d", {param("d.w", {2}), param("d.w", {3})}}}, 1), std::invalid_argument);
  EXPECT_THROW(ShardPlan::build({{"d0", {param("same", {2})}}, {"d1", {param("same", {2})}}}, 2),
               std::invalid_argument);

  // A unit of the expert shard group (group 1) without its group's size, or a group that is not 0 or 1.
  EXPECT_THROW(ShardPlan::build({{"x", {param("x.w", {2})}, 1}}, 2), std::invalid_argument);
  EXPECT_THROW(ShardPlan::build({{"x", {param("x.w", {2})}, 2}}, 2, 1), std::invalid_argument);
}

// Unit groups: a group-1 unit is planned over the expert shard group's ranks, the others over the
// shard group's; group_plan(g) is one group's units alone, in plan order, with their indices.
TEST(ShardPlanProperty, ExpertGroupUnitsArePlannedOverTheirGroup) {
  const std::vector<UnitSpec> units = {{"a", {param("a.w", {7})}},
                                       {"x", {param("x.w", {2, 3, 5})}, 1},
                                       {"b", {param("b.w", {5})}},
                                       {"y", {param("y.w", {9})}, 1}};
  const ShardPlan p = ShardPlan::build(units, 4, 2);
  EXPECT_EQ(p.world_size, 4);
  EXPECT_EQ(p.expert_world_size, 2);
  EXPECT_TRUE(p.grouped());
  EXPECT_EQ(p.units[0].ranks.size(), 4u);
  EXPECT_EQ(p.units[1].ranks.size(), 2u);
  EXPECT_EQ(p.units[1].shard_size, 15);  // 30 over 2 ranks
  EXPECT_EQ(p.units[1].padded_numel, 30);
  EXPECT_EQ(p.units[3].shard_size, 5);   // 9 over 2: 5 + 4, one padding element
  EXPECT_EQ(p.units[3].ranks[1].valid, 4);
  EXPECT_EQ(p.units[3].ranks[1].padding, 1);
  std::vector<int> index;
  const ShardPlan g1 = p.group_plan(1, &index);
  EXPECT_EQ(g1.world_size, 2);
  ASSERT_EQ(g1.units.size(), 2u);
  EXPECT_EQ(index, (std::vector<int>{1, 3}));
  EXPECT_EQ(g1.units[1].name, "y");
  const ShardPlan g0 = p.group_plan(0, &index);
  EXPECT_EQ(index, (std::vector<int>{0, 2}));
  EXPECT_EQ(g0.world_size, 4);
  EXPECT_FALSE(ShardPlan::build({units[0]}, 4).grouped());
  // A [rows, ...] slice of an N-D tensor (the experts' [E, 2 I, C]): rows are its first dimension.
  ParamSpec ex = param("e.w", {2, 3, 5});
  ex.tp = shardtrain::TpSlice{shardtrain::TpSplit::Rows, 3, 6, 15, 4};  // experts 4 and 5 of 6
  EXPECT_EQ(ex.canonical_index(0), 60);
  EXPECT_EQ(ex.canonical_index(29), 89);
}

}  // namespace
