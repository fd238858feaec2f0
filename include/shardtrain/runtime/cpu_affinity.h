// The CPUs each rank may run on (its affinity mask) and the number of compute threads per rank
// that follows from them (--threads).
//
// A rank's affinity mask is set by its launcher: mpirun binds each rank to one core by default
// when there are 2 ranks or fewer (to a socket otherwise) and leaves it unbound with
// '--bind-to none'; Slurm's srun binds a task to its --cpus-per-task CPUs with --cpu-bind=cores.
// Threads beyond the mask share its CPUs (a rank bound to one core runs every thread on that
// core), and unbound ranks of one node see the same CPUs, so each must take only its share.
//
// Rule for --threads 0 (the default), per rank: the physical cores in its mask, divided by the
// number of ranks of its node whose masks overlap it (itself included), at least 1. Bound ranks
// get their own cores; N unbound ranks on a node get cores/N each (N ranks x threads never exceed
// the cores); ranks sharing a socket mask split the socket. Hyperthreads of one core count once:
// GEMM threads gain nothing from a core's second hardware thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/runtime/runtime.h"

namespace shardtrain {

// Linux CPU ids (logical CPUs) this process may run on, sorted: sched_getaffinity(2) of the
// calling thread, any number of CPUs. Throws std::runtime_error (errno text) if the call fails.
std::vector<int> affinity_cpus();

// Logical CPUs online on this node (get_nprocs(3)).
int online_cpus();

// Physical cores among `cpus`: distinct (physical_package_id, core_id) pairs read from
// /sys/devices/system/cpu/cpu<N>/topology/. A CPU whose topology cannot be read counts as a core.
int count_cores(const std::vector<int>& cpus);

// A sorted CPU list in the kernel's cpulist notation: "0", "0-3", "0-3,8,10-11"; "" when empty.
std::string cpu_list(const std::vector<int>& cpus);

// One rank's placement, as plan_threads gathers it.
struct RankCpus {
  uint64_t host = 0;      // identifies the node (fnv1a64 of the processor name)
  int online = 0;         // online_cpus() of the node
  int cores = 0;          // count_cores(cpus)
  std::vector<int> cpus;  // affinity_cpus(), sorted
};

// The thread decision for one rank, and its description for rank 0's log.
struct ThreadPlan {
  int threads = 1;        // this rank's threads: `requested`, or by the rule above when 0
  std::string per_rank;   // "1", or "1 to 4 (rank 0: 2)" when ranks differ
  std::string binding;    // "rank 0 bound to CPU 0", "each rank bound to 1 CPU, rank 0 to CPU 0",
                          // "every rank unbound on CPUs 0-1, shared by up to 2 ranks", ...
  std::vector<std::string> warnings;  // "warning: ..." lines for rank 0 to log: more threads than
                                      // CPUs in the mask (names mpirun's '--bind-to none' and
                                      // Slurm's '--cpus-per-task'), or ranks sharing CPUs with
                                      // more threads in all than CPUs
  // Some rank of the job has no cores of its own: the threads of the ranks of its node whose masks
  // overlap its mask (its own included) outnumber the physical cores in its mask (so also when
  // --threads exceeds them). A measured CPU peak would then be a share, not the machine's: the
  // CPU MFU is not measured (mfu.h). shared_why says where, e.g. "rank 0: 4 threads of 4 ranks on
  // 2 cores (CPUs 0-1)"; "" when not shared.
  bool cores_shared = false;
  std::string shared_why;
};

// Pure: the plan of rank `rank` from every rank's placement (ranks[r] for rank r) and the
// --threads option (`requested`, 0 = by the rule above). Throws std::invalid_argument if `rank`
// is out of range or requested < 0.
ThreadPlan plan_threads(const std::vector<RankCpus>& ranks, int rank, int requested);

// Collective: reads this rank's placement (affinity_cpus, count_cores, online_cpus), gathers every
// rank's (one all-reduce and one all-gather), and returns plan_threads(..., comm.rank(), requested).
// `host`: this node's name (Topology::host). Failure to read the mask on any rank is agreed on
// (CollectiveError on every rank).
ThreadPlan plan_threads(Comm& comm, const std::string& host, int requested);

}  // namespace shardtrain
