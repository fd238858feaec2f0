// ExpertParallelOps<C> (shard layer, beside TensorParallelOps and ContextParallelOps): the
// interface through which the model's mixture-of-experts blocks send their routed rows to the ranks
// that compute their experts and take the results back, when expert parallelism (--ep N; issue 56,
// docs/moe.md) splits every MoE block's E experts over an EP group of N ranks. The implementation
// on the EP group's communicator, EpGroup, is the parallel layer's (expert_parallel.h), which the
// model never includes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace shardtrain {

// ---- Expert parallelism ---------------------------------------------------------------------------
//
// Rank i of the EP group computes experts [i E/N, (i+1) E/N) of every MoE block, for the tokens of
// every rank of the group (N divides E: the parallel layer refuses a mesh where it does not). Every
// rank of the group makes the same calls in the same order (each call communicates); the sizes of
// start_all_to_all differ per rank and must match pairwise (rank r's send_rows[q] = rank q's
// recv_rows[r]), which the counts exchanged by all_gather_counts give. Buffers are backend memory
// of the compute type C (host memory on the CPU), rows of `width` elements, packed in rank order.
// Errors: std::invalid_argument for sizes out of range (before anything is sent); a failed transfer
// as the communicator reports it (a dead peer: its collective watchdog ends the rank).

// A started all-to-all. wait() returns when the rows arrived (on a stream-ordered device Comm: when
// the compute stream is ordered after them); until then the transfer owns the buffers' travelling
// blocks. Destroyed before wait(): it waits (the communicator's watchdog watches it).
class ExpertTransfer {
 public:
  virtual ~ExpertTransfer() = default;
  virtual void wait() = 0;
};

template <typename C> class ExpertParallelOps {
 public:
  virtual ~ExpertParallelOps() = default;
  virtual int size() const = 0;  // N, the EP degree
  virtual int rank() const = 0;  // this rank's index in the EP group, in [0, N)
  // Collective, host memory: every rank's `counts` (the same length on every rank) side by side,
  // rank order: result[p * counts.size() + e] = rank p's counts[e].
  virtual std::vector<int64_t> all_gather_counts(const std::vector<int64_t>& counts) = 0;
  // Collective, started: rank r sends send_rows[q] rows of `send` (block q, packed in rank order)
  // to every other rank q and receives recv_rows[p] rows from every other rank p into block p of
  // `recv` (packed likewise). Its own block does not travel: block rank() of `recv` is left as it
  // is and the caller places its own rows there or wherever it wants (send_rows[rank()] rows at
  // block rank() of `send`), while the others travel. Returns at once; the transfer advances
  // while the compute backend's kernels run (they poll the progress registry, progress.h) and is
  // complete when the returned ExpertTransfer's wait() returned. `send` and `recv` must not
  // overlap; neither may be touched outside block rank() before wait().
  virtual std::unique_ptr<ExpertTransfer> start_all_to_all(const C* send, const std::vector<size_t>& send_rows, C* recv,
                                                            const std::vector<size_t>& recv_rows, size_t width) = 0;
};

}  // namespace shardtrain
