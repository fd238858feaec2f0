// The parallel layer's tensor parallelism: TpGroup<C>, the TensorParallelOps the model calls
// (tensor_parallel_ops.h), on the mesh's TP communicator, and what its collectives cost
// (TpCommStats). The parallel layer sits between io and train: train includes it; the shard, model
// and io layers never do.
#pragma once

#include <cstdint>
#include <cstddef>

#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/tensor_parallel_ops.h"

namespace shardtrain {

// Where a rank's TP collectives went (seconds, bytes), accumulated since construction. The TP
// collectives are blocking (the compute waits for each), so issued and exposed time are the same
// wall time. Bytes are those one rank sends in a ring algorithm, the measure of docs/scaling.md:
// an all-gather or reduce-scatter of `count` elements per rank sends (N - 1) * count elements, an
// all-reduce of `count` elements 2 * (N - 1) / N * count.
struct TpCommStats {
  double seconds = 0;
  int64_t all_gathers = 0, reduce_scatters = 0, all_reduces = 0;  // calls
  double all_gather_bytes = 0, reduce_scatter_bytes = 0, all_reduce_bytes = 0;
  double bytes() const { return all_gather_bytes + reduce_scatter_bytes + all_reduce_bytes; }
};

// TensorParallelOps on a communicator of the TP group (Mesh::tp_data(): MPI on the CPU, NCCL or
// the host-staged device Comm on GPUs). On a stream-ordered Comm (NCCL, on its own stream) each
// call is started and waited for at once, which orders the compute stream after it without
// blocking the host; elsewhere the calls are blocking. `comm` must outlive this.
template <typename C> class TpGroup final : public TensorParallelOps<C> {
 public:
  using S = math::Acc<C>;
  explicit TpGroup(Comm& comm) : comm_(comm) {}
  int size() const override { return comm_.world_size(); }
  int rank() const override { return comm_.rank(); }
  void all_gather(const C* local, C* full, size_t count) override;
  void reduce_scatter_sum(const C* full, C* local, size_t count) override;
  void all_gather_acc(const S* local, S* full, size_t count) override;
  void all_reduce_sum_acc(S* buf, size_t count) override;
  const TpCommStats& stats() const { return stats_; }

 private:
  template <typename E> void gather(const E* local, E* full, size_t count);
  template <typename F> void timed(F&& call);  // runs call, adding its wall time to stats_.seconds
  Comm& comm_;
  TpCommStats stats_;
};

}  // namespace shardtrain
