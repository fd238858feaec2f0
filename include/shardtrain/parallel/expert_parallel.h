// The parallel layer's expert parallelism (--ep N; issue 56, docs/moe.md): EpGroup<C>, the
// ExpertParallelOps the model's mixture-of-experts blocks call (expert_parallel_ops.h), on the
// mesh's EP communicators (Mesh::ep_host for the counts, Mesh::ep_data for the rows), and what
// its transfers cost. The parallel layer sits between io and train: the shard, model and io layers
// never include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardtrain/runtime/progress.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/expert_parallel_ops.h"

namespace shardtrain {

// Accumulated since construction. issued_s: each all-to-all's time in flight, from its start to
// its completion (as a progress poll saw it, else the wait's return; as CP's and PP's);
// exposed_s: the time the compute thread waited in wait(). The counts exchange is blocking: its
// time is in both. bytes: the rows this rank sends to other ranks (its own block never travels),
// dispatch and combine, forward and backward; the counts exchange (E int64 per rank per MoE
// block) is counted in calls and seconds, not in bytes.
struct EpCommStats {
  double issued_s = 0;
  double exposed_s = 0;
  int64_t calls = 0;  // all-to-alls and counts exchanges
  double bytes = 0;
  int64_t done_in_compute = 0;  // all-to-alls a progress poll saw complete before their wait
};

// ExpertParallelOps on the EP group: `host` (MPI, host memory) exchanges the counts, `data` (MPI on
// the CPU; NCCL or the host-staged device Comm on GPUs) moves the rows, Comm::start_all_to_all_v
// with OwnBlock::Keep (grouped point-to-point). Both are the same group in the same rank order; both
// must outlive this. `progress`: the compute backend's registry (Backend::progress; nullptr on
// device backends, whose Comm progresses on its own stream): a started all-to-all joins it until
// its wait, so MPI advances it during the GEMMs. Its ExpertTransfers must not outlive this.
template <typename C> class EpGroup final : public ExpertParallelOps<C> {
 public:
  EpGroup(Comm& host, Comm& data, ProgressRegistry* progress = nullptr) : host_(host), data_(data), progress_(progress) {}
  int size() const override { return host_.world_size(); }
  int rank() const override { return host_.rank(); }
  std::vector<int64_t> all_gather_counts(const std::vector<int64_t>& counts) override;
  std::unique_ptr<ExpertTransfer> start_all_to_all(const C* send, const std::vector<size_t>& send_rows, C* recv,
                                                   const std::vector<size_t>& recv_rows, size_t width) override;
  const EpCommStats& stats() const { return stats_; }

 private:
  Comm& host_;
  Comm& data_;
  ProgressRegistry* progress_;
  EpCommStats stats_;
};

}  // namespace shardtrain
