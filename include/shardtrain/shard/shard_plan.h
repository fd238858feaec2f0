// The shard plan (shard layer): units of parameters, their flat layout and each rank's shard
// (start / valid / padding), built for the G ranks of a shard group; the tensor-parallel slice a
// parameter is (TpSlice); the reduce-scatter slab size.
//
// Layout (the same idea as llm.c's single flat parameter buffer, one per unit):
//   A unit's parameters are concatenated, in declaration order, into one flat buffer of `numel`
//   elements. It is padded with zeros to `padded_numel` = S * W where S = ceil(numel / W) (at
//   least 1) and W is the world size. Rank r owns flat elements [r*S, (r+1)*S): its shard. Of
//   those, `valid` = clamp(numel - r*S, 0, S) are real parameters and `padding` = S - valid are
//   zeros. A rank whose shard is all padding (valid = 0, e.g. 2 elements over 4 ranks) still
//   takes part in every all-gather and reduce-scatter of that unit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

// How a parameter is initialized.
enum class Init { Normal, Ones, Zeros };

// Which part of a canonical tensor a tensor-parallel rank holds (Megatron-LM's split; model.h
// llama_units). The canonical tensor is 2-D [rows, cols] row-major (1-D tensors are only ever
// replicated). With degree N, rank t of the TP group holds:
//   Rows (column-parallel q/k/v/gate/up, vocabulary-parallel embedding and LM head): rows
//     [offset, offset + local rows) of the canonical tensor; rows at or past `rows` (the canonical
//     row count) are padding (the vocabulary padded to a multiple of N): zero, never trained.
//   Cols (row-parallel o/down): columns [offset, offset + local cols).
//   Replicated: all of it, on every rank of the group (RMSNorm weights): their gradients are
//     summed over the group (ShardedState::sum_replicated_grads) and they count once in the
//     gradient norm.
// degree 1 (the default): the whole canonical tensor, as without tensor parallelism.
enum class TpSplit { None, Rows, Cols, Replicated };
struct TpSlice {
  TpSplit split = TpSplit::None;
  int degree = 1;       // N, the TP group's size
  int64_t rows = 0;     // canonical rows (Rows: unpadded; the local rows may reach past them)
  int64_t cols = 0;     // canonical columns
  int64_t offset = 0;   // first canonical row (Rows) or column (Cols) held here
};

struct ParamSpec {
  std::string name;             // canonical (Hugging Face) name, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;   // row-major, e.g. {intermediate_size, hidden_size}: this rank's slice under TP
  bool weight_decay = true;     // AdamW decay applies (false for norm weights)
  Init init = Init::Normal;
  double init_std = 0.02;       // for Init::Normal
  TpSlice tp{};                 // the slice of the canonical tensor `shape` is (default: all of it)
  int64_t numel() const;
  // The canonical flat index of local element e (row-major in `shape`), or -1 for vocabulary
  // padding (a Rows slice's rows past tp.rows). Without TP: e.
  int64_t canonical_index(int64_t e) const;
  // Replicated over a TP group of more than one rank.
  bool tp_replicated() const { return tp.split == TpSplit::Replicated && tp.degree > 1; }
};

// Which ranks shard a unit (ShardPlan::build). 0: the shard group (dp_shard x cp ranks, the whole
// world without hybrid sharding or a pipeline); 1: the expert shard group, the ranks of the shard
// group that hold the same experts under expert parallelism (dp_shard x cp / ep of them;
// docs/moe.md). Every unit's gradient is still the mean over the same W ranks (UnitCodec).
struct UnitSpec {
  std::string name;             // e.g. "model.layers.0"
  std::vector<ParamSpec> params;
  int group = 0;
};

// One parameter's place in its unit's flat buffer.
struct ParamSlot {
  ParamSpec spec;
  int64_t offset = 0;  // first flat element
  int64_t numel = 0;
};

// One rank's shard of one unit. Elements are flat indices into the unit's buffer.
struct RankShard {
  int64_t start = 0;    // r * shard_size
  int64_t valid = 0;    // real parameters in the shard (0 .. shard_size)
  int64_t padding = 0;  // shard_size - valid
};

struct UnitPlan {
  std::string name;
  std::vector<ParamSlot> params;
  int group = 0;             // UnitSpec::group: whose ranks shard it
  int64_t numel = 0;         // real elements
  int64_t shard_size = 0;    // S, elements per rank (>= 1)
  int64_t padded_numel = 0;  // S * its group's ranks
  std::vector<RankShard> ranks;  // one per rank of its group
  const ParamSlot& param(const std::string& name) const;  // throws std::out_of_range naming it
};

struct ShardPlan {
  int world_size = 1;         // ranks of group 0 (the shard group)
  int expert_world_size = 0;  // ranks of group 1 (the expert shard group); 0: no unit is in it
  std::vector<UnitPlan> units;
  // Builds the plan: units of group 0 for `world` ranks, units of group 1 for `expert_world`.
  // Throws std::invalid_argument on world < 1, a group-1 unit with expert_world < 1, a group
  // other than 0 and 1, an empty unit, a non-positive dimension, or a duplicate parameter name.
  static ShardPlan build(const std::vector<UnitSpec>& units, int world, int expert_world = 0);
  int group_size(int g) const { return g == 0 ? world_size : expert_world_size; }
  bool grouped() const { return expert_world_size > 0; }  // some unit is in group 1
  // The plan of group g's units alone, in plan order (world size: the group's); *index (if given)
  // receives each one's index in this plan.
  ShardPlan group_plan(int g, std::vector<int>* index = nullptr) const;
  int64_t total_numel() const;  // sum of real elements over units
  int64_t max_padded_numel() const;  // largest UnitPlan::padded_numel: size of a full-unit buffer
  int64_t max_shard_size() const;    // largest UnitPlan::shard_size: size of a shard-sized buffer
  int unit_index(const std::string& name) const;  // -1 if absent
};

// Shard elements per reduce-scatter call when `slab_elements` elements of all ranks' blocks are
// reduced at a time: min(largest shard, max(1, slab_elements / W)). On the stream lane
// (stream_lane: the data Comm is stream-ordered, NCCL; see CommQueue) the largest shard: one
// collective per unit, so that no compute-stream wait sits between slabs; its result buffer is then
// a whole shard, and mixed precision's fp32 widening a whole unit (the memory plan shows it). The
// FSDP engine's and mixed precision's buffers are sized by it, and so is the memory plan.
size_t reduce_slab(const ShardPlan& plan, size_t slab_elements, bool stream_lane = false);

}  // namespace shardtrain
