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
  int64_t max_padded_numel() const;  // largest UnitPlan::padded_numel: size of a full-unit buffer
  int64_t max_shard_size() const;    // largest UnitPlan::shard_size: size of a shard-sized buffer
  int unit_index(const std::string& name) const;  // -1 if absent
};

// Shard elements per reduce-scatter call when `slab_elements` elements of all ranks' blocks are
// reduced at a time: min(largest shard, max(1, slab_elements / W)). The FSDP engine's and mixed
// precision's buffers are sized by it, and so is the memory plan.
size_t reduce_slab(const ShardPlan& plan, size_t slab_elements);

// What the model needs from the sharding layer, in its compute type C: a unit's parameters,
// gathered in full; a zeroed full-unit gradient buffer; and the reduce-scatter of that buffer into
// this rank's gradient shard. Fsdp<T> is the UnitSource<T> of plain fp32 (or fp64) training;
// MixedPrecisionUnits is the UnitSource<bf16> over an fp32 Fsdp (mixed precision).
template <typename C> class UnitSource {
 public:
  virtual ~UnitSource() = default;
  // Collective: all-gathers unit u and returns it (padded_numel elements; parameter p at
  // + slot.offset). Valid until the next gather.
  virtual const C* gather(int u) = 0;
  // Zeroes and returns the full-unit gradient buffer for unit u (padded_numel elements).
  virtual C* full_grad(int u) = 0;
  // Collective: reduce-scatters the full-unit gradient buffer of unit u, divides by the world
  // size (mean over ranks) and adds the result into this rank's gradient shard. Under hybrid
  // sharding the reduce-scattered slabs are first summed over the replica groups (replica_sum in
  // shard.cpp), so the mean is still over all W ranks.
  virtual void reduce_scatter_grad(int u) = 0;
};

// The FSDP engine. Holds, for this rank, each unit's parameter shard and gradient shard
// (O(P / W) memory), plus one full-unit gather buffer and one full-unit gradient buffer sized for
// the largest unit (both are needed at once for the tied LM head, so per-unit sizing would not
// lower the peak), and slab-sized reduce-scatter buffers. Collective calls (gather, reduce_scatter_grad, gather_param) must be made by
// every rank in the same order.
//
// Two communicators: `comm` carries host-memory control traffic (loss, norms, checkpoint tables);
// `data_comm` moves the backend's buffers (gathers, reduce-scatters): the same MPI Comm on the
// CPU, NCCL (or MPI on host copies) on GPUs. With full_buffers == false the full-unit gather and
// gradient buffers are not allocated (mixed precision keeps its own, in bf16) and gather(),
// full_grad(), reduce_scatter_grad() and gather_param() must not be called.
//
// Hybrid sharding (HSDP; PyTorch FSDP2 / torchtitan HSDP, ZeRO++ hpZ): the plan is built for the
// G ranks of a shard group, data_comm spans that group (G consecutive ranks), and `replica_comm`
// (nullptr with one group) joins the ranks of equal shard rank in the R = W / G groups. Gradients
// are reduce-scattered within the group, summed over replica_comm and divided by W = G * R.
// Every replica then holds and updates identical shards. `comm` stays the whole world.
template <typename T> class Fsdp final : public UnitSource<T> {
 public:
  // Gradients are reduce-scattered kReduceSlab elements (all ranks' blocks together) at a time,
  // packed from the full-unit buffer: the result buffer is 1/W of that, not a whole shard of the
  // largest unit (for a 128k-vocabulary embedding at W = 2 that shard is 500 MiB).
  static constexpr size_t kReduceSlab = size_t{1} << 22;
  // Throws std::invalid_argument if the plan's world size differs from data_comm's (comm's when
  // data_comm is nullptr; the shard group's with hybrid sharding), std::bad_alloc.
  Fsdp(Backend<T>& be, Comm& comm, ShardPlan plan, Comm* data_comm = nullptr, bool full_buffers = true,
       Comm* replica_comm = nullptr);

  const ShardPlan& plan() const { return plan_; }
  Backend<T>& backend() { return be_; }
  Comm& comm() { return comm_; }
  Comm& data_comm() { return *dcomm_; }
  int num_units() const { return static_cast<int>(plan_.units.size()); }
  // HSDP (see above): this rank's row in the plan (its rank in the shard group; = comm().rank()
  // without HSDP), the replica communicator (nullptr: one group), this rank's replica group
  // (0 .. R-1) and the number of replica groups R.
  int plan_rank() const { return dcomm_->rank(); }
  Comm* replica_comm() { return rcomm_; }
  int replica_index() const { return rcomm_ ? rcomm_->rank() : 0; }
  int replicas() const { return rcomm_ ? rcomm_->world_size() : 1; }

  // This rank's shard of unit u: shard_size elements (valid ones first, then zero padding).
  T* param_shard(int u) { return params_[u].data(); }
  T* grad_shard(int u) { return grads_[u].data(); }

  // Fills every parameter shard deterministically from `seed`: element i of parameter p gets a
  // value that depends only on (seed, p's name, i), so the model is the same at any world size.
  void init_params(uint64_t seed);
  // Zeroes every gradient shard.
  void zero_grads();

  // UnitSource<T> (see there), through data_comm.
  const T* gather(int u) override;
  T* full_grad(int u) override;
  void reduce_scatter_grad(int u) override;

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
  Comm* dcomm_;
  Comm* rcomm_;  // HSDP replica communicator, nullptr with one group
  ShardPlan plan_;
  std::vector<Buffer<T>> params_, grads_;
  Buffer<T> gather_buf_, grad_buf_;
  Buffer<T> scatter_tmp_, pack_;  // reduce-scatter of one slab: [slab_] result, [W, slab_] packed input
  size_t slab_ = 0;               // shard elements per reduce-scatter call
  int gathered_ = -1;
};

// Mixed precision (Micikevicius et al. 2018; PyTorch FSDP's MixedPrecision(param_dtype=bf16,
// reduce_dtype=fp32 or bf16)) over an fp32 Fsdp that keeps the master shards, gradient shards and,
// in AdamW, the optimizer state in fp32:
//   gather(u):   this rank's fp32 shard is rounded to bf16, then the bf16 shards are all-gathered
//                (half the bytes of an fp32 gather);
//   full_grad(u): a bf16 full-unit gradient buffer, which the model's bf16 GEMMs fill (fp32
//                accumulation inside each GEMM);
//   reduce_scatter_grad(u): with reduce_bf16 == false the buffer is widened to fp32 and
//                reduce-scattered in fp32, one slab of at most kWidenSlab elements (over all
//                ranks) at a time, so no fp32 copy of a whole unit exists (for a 128k vocabulary
//                embedding that copy would be 4 bytes x V x C); else reduce-scattered in bf16 (half
//                the bytes). The mean is added into the fp32 gradient shard.
// `be` must run on the same device as master.backend().
class MixedPrecisionUnits final : public UnitSource<bf16> {
 public:
  static constexpr size_t kWidenSlab = size_t{1} << 22;  // fp32 elements (16 MiB) per widened slab
  // Throws std::bad_alloc.
  // widen_slab: fp32 elements per widened slab (tests make it small to cut units into many slabs).
  MixedPrecisionUnits(Fsdp<float>& master, Backend<bf16>& be, bool reduce_bf16, size_t widen_slab = kWidenSlab);
  const bf16* gather(int u) override;
  bf16* full_grad(int u) override;
  void reduce_scatter_grad(int u) override;

 private:
  Fsdp<float>& m_;
  Backend<bf16>& be_;
  bool reduce_bf16_;
  Buffer<bf16> shard_, gather_, grad_, scatter_;
  Buffer<float> grad32_, scatter32_;  // [W, slab_] and [slab_]: the fp32 reduce-scatter of one slab
  Buffer<float> replica32_;           // HSDP with bf16 reduce: a shard widened to fp32 for replica_sum
  size_t slab_ = 0;                   // shard elements per fp32 reduce-scatter
};

// Deterministic standard normal for counter `i` of stream (seed, key): SplitMix64 + Box-Muller.
double counter_normal(uint64_t seed, uint64_t key, uint64_t i);

}  // namespace shardtrain
