// ShardedState<T> (shard layer): this rank's parameter and gradient shards with their plan and
// communicators, what AdamW and checkpoints use; the counter-based init (counter_normal).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard_plan.h"

namespace shardtrain {

// ---- The sharded state ----------------------------------------------------------------------------
//
// For this rank, each unit's parameter shard and gradient shard (O(P / W) memory) in the master
// type T, with their plan: what AdamW updates and checkpoints save. No full-unit buffer and no
// collective pipeline (those are UnitPipeline's). Collective calls (gather_param) must be made by
// every rank in the same order.
//
// Three communicators: `comm` carries host-memory control traffic (loss, norms, checkpoint
// tables); `data_comm` moves the backend's buffers (gathers, reduce-scatters): the same MPI Comm on
// the CPU, NCCL (or MPI on host copies) on GPUs.
//
// Hybrid sharding (HSDP; PyTorch FSDP2 / torchtitan HSDP, ZeRO++ hpZ): the plan is built for the
// G ranks of a shard group, data_comm spans that group (G consecutive ranks), and `replica_comm`
// (nullptr with one group) joins the ranks of equal shard rank in the R = W / G groups. Gradients
// are reduce-scattered within the group, summed over replica_comm and divided by W = G * R (see
// UnitCodec). Every replica then holds and updates identical shards. `comm` stays the whole world.
//
// Unit groups (expert parallelism, docs/moe.md): a plan whose units of group 1 (UnitSpec::group)
// are sharded over the expert shard group, `expert_comm` (the G / N ranks of the shard group that
// hold the same experts; plan.expert_world_size of them), and whose other units over data_comm.
// Each unit's shard row is this rank's rank in its group's comm (unit_rank); its gradient is still
// summed over replica_comm and divided by the same W = G * R (mean_divisor): the experts' ranks
// computed on the tokens of all W ranks, so the mean is over the same global tokens as every other
// gradient. group_plan(g) / group_units(g) give one group's units as a plan of their own (what a
// codec over one group sees: UnitCodec's `group`).
template <typename T> class ShardedState {
 public:
  // Throws std::invalid_argument if the plan's world size differs from data_comm's (comm's when
  // data_comm is nullptr; the shard group's with hybrid sharding), or its expert_world_size from
  // expert_comm's (a plan with group-1 units needs one), std::bad_alloc.
  ShardedState(Backend<T>& be, Comm& comm, ShardPlan plan, Comm* data_comm = nullptr, Comm* replica_comm = nullptr,
               Comm* expert_comm = nullptr);
  // The communicators from the run's mesh (mesh.h): comm = mesh.world(), data_comm =
  // mesh.shard_data(), replica_comm = mesh.replica_data(). `plan` must be built for the shard group
  // (mesh.dims().fsdp() = dp_shard x cp ranks). The mesh must outlive the state. Throws as the constructor above.
  ShardedState(Backend<T>& be, const Mesh& mesh, ShardPlan plan)
      : ShardedState(be, mesh.world(), std::move(plan), &mesh.shard_data(), mesh.replica_data()) {}
  ShardedState(const ShardedState&) = delete;
  ShardedState& operator=(const ShardedState&) = delete;
  virtual ~ShardedState() = default;

  const ShardPlan& plan() const { return plan_; }
  Backend<T>& backend() { return be_; }
  Comm& comm() { return comm_; }
  Comm& data_comm() { return *dcomm_; }
  // Group g's data comm (0: data_comm(); 1: expert_comm), plan and its units' indices in plan().
  Comm& data_comm(int g) { return g == 0 ? *dcomm_ : *ecomm_; }
  const ShardPlan& group_plan(int g) const { return gplan_[static_cast<size_t>(g)]; }
  const std::vector<int>& group_units(int g) const { return gunits_[static_cast<size_t>(g)]; }
  int num_groups() const { return plan_.grouped() ? 2 : 1; }
  // This rank's row in unit u's shard table: its rank in the unit's group's comm.
  int unit_rank(int u) const { return plan_.units[static_cast<size_t>(u)].group == 0 ? dcomm_->rank() : ecomm_->rank(); }
  // W = G * R: what every unit's summed gradient is divided by (UnitCodec).
  int mean_divisor() const { return plan_.world_size * replicas(); }
  int num_units() const { return static_cast<int>(plan_.units.size()); }
  // This rank's row in the plan (its rank in the shard group; = comm().rank() without HSDP), the
  // replica communicator (nullptr: one group) and the number of replica groups R (the gradient
  // mean divides by G * R). Which replica writes checkpoints and counts in the gradient norm is
  // the mesh's answer (Mesh::writes_checkpoint, Mesh::counts_in_norm).
  int plan_rank() const { return dcomm_->rank(); }
  Comm* replica_comm() { return rcomm_; }
  int replicas() const { return rcomm_ ? rcomm_->world_size() : 1; }

  // This rank's shard of unit u: shard_size elements (valid ones first, then zero padding).
  T* param_shard(int u) { return params_[u].data(); }
  T* grad_shard(int u) { return grads_[u].data(); }

  // Fills every parameter shard deterministically from `seed`: element i of parameter p gets a
  // value that depends only on (seed, p's name, i), so the model is the same at any world size.
  // Under tensor parallelism i is the canonical index (ParamSpec::canonical_index): each TP rank's
  // slice holds exactly the values of the same elements without TP (padding rows: zero).
  void init_params(uint64_t seed);
  // Zeroes every gradient shard.
  void zero_grads();

  // Collective over data_comm: the whole parameter `name`, gathered (one all-gather of its unit
  // into a temporary full-unit buffer), copied to host (numel elements). Throws std::out_of_range
  // for an unknown name, std::bad_alloc.
  std::vector<T> gather_param(const std::string& name);
  // Overwrites this rank's part of parameter `name` from the full host tensor `full` (numel
  // elements). Not collective. Throws std::out_of_range, std::invalid_argument (wrong size).
  void set_param(const std::string& name, const std::vector<T>& full);

  // Sum of squares of this rank's valid gradient elements (padding excluded), in double. With
  // include_replicated false, the elements of TP-replicated parameters (ParamSpec::tp_replicated)
  // are left out: every TP rank but the group's first holds a copy of them, and the norm counts
  // each element once (Mesh::counts_replicated_in_norm). skip_unit >= 0: that unit is left out
  // (a pipeline's second copy of the tied embedding, ParallelRun::unit_not_in_norm).
  double local_grad_sumsq(bool include_replicated = true, int skip_unit = -1);
  // Collective over the TP group (every rank of it holds the same plan): sums this rank's gradient
  // shard elements of TP-replicated parameters over the group, in place, each range by
  // `sum(pointer, count)` (TpGroup::all_reduce_sum_acc, which counts the traffic).
  // Under sequence parallelism each TP rank computed the RMSNorm weights' gradient from its own
  // tokens, so the sum is the gradient (Korthikanti et al. 2022, section 4.2.2). No-op when no
  // parameter is replicated.
  void sum_replicated_grads(const std::function<void(T*, size_t)>& sum);

 private:
  Backend<T>& be_;
  Comm& comm_;
  Comm* dcomm_;
  Comm* rcomm_;  // HSDP replica communicator, nullptr with one group
  Comm* ecomm_;  // the expert shard group's data comm, nullptr when no unit is in group 1
  ShardPlan plan_;
  ShardPlan gplan_[2];
  std::vector<int> gunits_[2];
  std::vector<Buffer<T>> params_, grads_;
};

// Deterministic standard normal for counter `i` of stream (seed, key): SplitMix64 + Box-Muller.
double counter_normal(uint64_t seed, uint64_t key, uint64_t i);

}  // namespace shardtrain
