// shardtrain sharding layer: the shard plan (units, flat layout, per-rank start / valid / padding)
// and the FSDP (ZeRO-3) engine that gathers a unit for compute and reduce-scatters its gradient.
//
// Layout (the same idea as llm.c's single flat parameter buffer, one per unit):
//   A unit's parameters are concatenated, in declaration order, into one flat buffer of `numel`
//   elements. It is padded with zeros to `padded_numel` = S * W where S = ceil(numel / W) (at
//   least 1) and W is the world size. Rank r owns flat elements [r*S, (r+1)*S): its shard. Of
//   those, `valid` = clamp(numel - r*S, 0, S) are real parameters and `padding` = S - valid are
//   zeros. A rank whose shard is all padding (valid = 0, e.g. 2 elements over 4 ranks) still
//   takes part in every all-gather and reduce-scatter of that unit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/backend.h"
#include "shardtrain/runtime.h"

namespace shardtrain {

// How a parameter is initialized.
enum class Init { Normal, Ones, Zeros };

struct ParamSpec {
  std::string name;             // canonical (Hugging Face) name, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;   // row-major, e.g. {intermediate_size, hidden_size}
  bool weight_decay = true;     // AdamW decay applies (false for norm weights)
  Init init = Init::Normal;
  double init_std = 0.02;       // for Init::Normal
  int64_t numel() const;
};

struct UnitSpec {
  std::string name;             // e.g. "model.layers.0"
  std::vector<ParamSpec> params;
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
  int64_t numel = 0;         // real elements
  int64_t shard_size = 0;    // S, elements per rank (>= 1)
  int64_t padded_numel = 0;  // S * world
  std::vector<RankShard> ranks;  // size world
  const ParamSlot& param(const std::string& name) const;  // throws std::out_of_range naming it
};

struct ShardPlan {
  int world_size = 1;
  std::vector<UnitPlan> units;
  // Builds the plan for `world` ranks. Throws std::invalid_argument on world < 1, an empty unit,
  // a non-positive dimension, or a duplicate parameter name.
  static ShardPlan build(const std::vector<UnitSpec>& units, int world);
  int64_t total_numel() const;  // sum of real elements over units
  int unit_index(const std::string& name) const;  // -1 if absent
};

// The FSDP engine. Holds, for this rank, each unit's parameter shard and gradient shard
// (O(P / W) memory), plus one full-unit gather buffer and one full-unit gradient buffer sized for
// the largest unit. Collective calls (gather, reduce_scatter_grad, gather_param) must be made by
// every rank in the same order.
template <typename T> class Fsdp {
 public:
  Fsdp(Backend<T>& be, Comm& comm, ShardPlan plan);

  const ShardPlan& plan() const { return plan_; }
  Backend<T>& backend() { return be_; }
  Comm& comm() { return comm_; }
  int num_units() const { return static_cast<int>(plan_.units.size()); }

  // This rank's shard of unit u: shard_size elements (valid ones first, then zero padding).
  T* param_shard(int u) { return params_[u].data(); }
  T* grad_shard(int u) { return grads_[u].data(); }

  // Fills every parameter shard deterministically from `seed`: element i of parameter p gets a
  // value that depends only on (seed, p's name, i), so the model is the same at any world size.
  void init_params(uint64_t seed);
  // Zeroes every gradient shard.
  void zero_grads();

  // Collective: all-gathers unit u into the gather buffer and returns it (padded_numel elements;
  // parameter p at + slot.offset). Valid until the next gather.
  const T* gather(int u);
  // Zeroes and returns the full-unit gradient buffer for unit u (padded_numel elements).
  T* full_grad(int u);
  // Collective: reduce-scatters the full-unit gradient buffer of unit u, divides by the world size
  // (mean over ranks) and adds the result into this rank's gradient shard.
  void reduce_scatter_grad(int u);

  // Collective: the whole parameter `name`, gathered, copied to host (numel elements).
  std::vector<T> gather_param(const std::string& name);
  // Overwrites this rank's part of parameter `name` from the full host tensor `full` (numel
  // elements). Not collective.
  void set_param(const std::string& name, const std::vector<T>& full);

  // Sum of squares of this rank's valid gradient elements (padding excluded), in double.
  double local_grad_sumsq();

 private:
  Backend<T>& be_;
  Comm& comm_;
  ShardPlan plan_;
  std::vector<Buffer<T>> params_, grads_;
  Buffer<T> gather_buf_, grad_buf_, scatter_tmp_;
  int gathered_ = -1;
};

// Deterministic standard normal for counter `i` of stream (seed, key): SplitMix64 + Box-Muller.
double counter_normal(uint64_t seed, uint64_t key, uint64_t i);

}  // namespace shardtrain
