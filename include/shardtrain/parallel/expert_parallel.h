// The parallel layer's expert parallelism (--ep N; issue 56, docs/moe.md): EpGroup<C>, the
// ExpertParallelOps the model's mixture-of-experts blocks call (expert_parallel_ops.h), on the
// mesh's EP communicators (Mesh::ep_host for the counts, Mesh::ep_data for the rows), and what
// its transfers cost. The parallel layer sits between io and train: the shard, model and io layers
// never include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/expert_parallel_ops.h"

namespace shardtrain {

// Accumulated since construction. The all-to-alls are blocking (the compute waits for each), so
// issued and exposed time are the same wall time. bytes: the rows this rank sends to other ranks
// (its own block stays local), dispatch and combine, forward and backward; the counts exchange
// (E int64 per rank per MoE block) is counted in calls and seconds, not in bytes.
struct EpCommStats {
  double seconds = 0;
  int64_t calls = 0;  // all-to-alls and counts exchanges
  double bytes = 0;
};

// ExpertParallelOps on the EP group: `host` (MPI, host memory) exchanges the counts, `data` (MPI on
// the CPU; NCCL or the host-staged device Comm on GPUs) moves the rows, Comm::start_all_to_all_v
// (grouped point-to-point). Both are the same group in the same rank order; both must outlive this.
template <typename C> class EpGroup final : public ExpertParallelOps<C> {
 public:
  EpGroup(Comm& host, Comm& data) : host_(host), data_(data) {}
  int size() const override { return host_.world_size(); }
  int rank() const override { return host_.rank(); }
  std::vector<int64_t> all_gather_counts(const std::vector<int64_t>& counts) override;
  void all_to_all(const C* send, const std::vector<size_t>& send_rows, C* recv, const std::vector<size_t>& recv_rows,
                  size_t width) override;
  const EpCommStats& stats() const { return stats_; }

 private:
  Comm& host_;
  Comm& data_;
  EpCommStats stats_;
};

}  // namespace shardtrain
