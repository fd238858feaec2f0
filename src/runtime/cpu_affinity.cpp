// Affinity masks and threads per rank (see cpu_affinity.h).
#include "shardtrain/runtime/cpu_affinity.h"

#include <sched.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <stdexcept>
#include <utility>

namespace shardtrain {

std::vector<int> affinity_cpus() {
  for (int n = 1024;; n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (!set) throw std::runtime_error("affinity mask: out of memory");
    const size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      std::vector<int> cpus;
      for (int c = 0; c < n; ++c)
        if (CPU_ISSET_S(c, bytes, set)) cpus.push_back(c);
      CPU_FREE(set);
      return cpus;
    }
    const int err = errno;
    CPU_FREE(set);
    if (err != EINVAL || n >= (1 << 20))
      throw std::runtime_error(std::string("cannot read this process's CPU affinity (sched_getaffinity): ") +
                               std::strerror(err));
  }
}

int online_cpus() { return get_nprocs(); }

int count_cores(const std::vector<int>& cpus) {
  std::set<std::pair<long, long>> cores;
  long unknown = -1;  // each unreadable CPU is its own core
  for (int c : cpus) {
    const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    long pkg = 0, core = 0;
    std::ifstream p(dir + "physical_package_id"), q(dir + "core_id");
    if ((p >> pkg) && (q >> core)) cores.insert({pkg, core});
    else cores.insert({unknown--, 0});
  }
  return static_cast<int>(cores.size());
}

std::string cpu_list(const std::vector<int>& cpus) { return int_ranges(cpus, ","); }

namespace {

bool overlap(const std::vector<int>& a, const std::vector<int>& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] == b[j]) return true;
    if (a[i] < b[j]) ++i;
    else ++j;
  }
  return false;
}

std::string cpus_phrase(const std::vector<int>& cpus) {
  return (cpus.size() == 1 ? "CPU " : "CPUs ") + cpu_list(cpus);
}

std::string count_phrase(size_t n) { return std::to_string(n) + (n == 1 ? " CPU" : " CPUs"); }

}  // namespace

ThreadPlan plan_threads(const std::vector<RankCpus>& ranks, int rank, int requested) {
  const int world = static_cast<int>(ranks.size());
  if (rank < 0 || rank >= world) throw std::invalid_argument("plan_threads: rank out of range");
  if (requested < 0) throw std::invalid_argument("plan_threads: negative thread count");
  // Ranks of the same node whose masks overlap rank r's, r included.
  std::vector<int> sharing(world, 0), threads(world, 1);
  for (int r = 0; r < world; ++r) {
    for (int s = 0; s < world; ++s)
      if (ranks[s].host == ranks[r].host && overlap(ranks[s].cpus, ranks[r].cpus)) ++sharing[r];
    sharing[r] = std::max(1, sharing[r]);
    threads[r] = requested > 0 ? requested : std::max(1, ranks[r].cores / sharing[r]);
  }
  ThreadPlan p;
  p.threads = threads[rank];
  const auto [lo, hi] = std::minmax_element(threads.begin(), threads.end());
  p.per_rank = *lo == *hi ? std::to_string(*lo)
                          : std::to_string(*lo) + " to " + std::to_string(*hi) + " (rank 0: " +
                                std::to_string(threads[0]) + ")";

  // Binding: rank 0's, then the others by kind.
  auto bound = [&](int r) { return static_cast<int>(ranks[r].cpus.size()) < ranks[r].online; };
  auto desc = [&](int r) {
    return bound(r) ? "bound to " + cpus_phrase(ranks[r].cpus) : "unbound on " + cpus_phrase(ranks[r].cpus);
  };
  bool all_same_kind = true, all_same_cpus = true;
  for (int r = 1; r < world; ++r) {
    all_same_kind &= bound(r) == bound(0) && ranks[r].cpus.size() == ranks[0].cpus.size();
    all_same_cpus &= ranks[r].cpus == ranks[0].cpus;
  }
  if (world == 1) {
    p.binding = "rank 0 " + desc(0);
  } else if (all_same_kind && !bound(0)) {
    p.binding = all_same_cpus ? "every rank unbound on " + cpus_phrase(ranks[0].cpus)
                              : "every rank unbound, rank 0 on " + cpus_phrase(ranks[0].cpus);
  } else if (all_same_kind) {
    p.binding = "each rank bound to " + count_phrase(ranks[0].cpus.size()) + ", rank 0 to " + cpus_phrase(ranks[0].cpus);
  } else {
    p.binding = "rank 0 " + desc(0);
    std::vector<bool> done(world, false);
    for (int r = 1; r < world; ++r) {
      if (done[r]) continue;
      std::vector<int> group;
      for (int s = r; s < world; ++s)
        if (!done[s] && bound(s) == bound(r) && ranks[s].cpus.size() == ranks[r].cpus.size()) {
          group.push_back(s);
          done[s] = true;
        }
      p.binding += "; " + rank_list(group) + (bound(r) ? " bound to " + count_phrase(ranks[r].cpus.size()) : " unbound") +
                   (group.size() > 1 ? " each" : "");
    }
  }
  // Cores to itself: the threads of the ranks whose masks overlap this one fit in its cores.
  for (int r = 0; r < world && !p.cores_shared; ++r) {
    int load = 0;
    for (int s = 0; s < world; ++s)
      if (ranks[s].host == ranks[r].host && overlap(ranks[s].cpus, ranks[r].cpus)) load += threads[s];
    if (load <= std::max(1, ranks[r].cores)) continue;
    p.cores_shared = true;
    p.shared_why = "rank " + std::to_string(r) + ": " + std::to_string(load) + " threads of " +
                   std::to_string(sharing[r]) + (sharing[r] == 1 ? " rank" : " ranks") + " on " +
                   std::to_string(ranks[r].cores) + (ranks[r].cores == 1 ? " core (" : " cores (") +
                   cpus_phrase(ranks[r].cpus) + ")";
  }
  const int most_sharing = *std::max_element(sharing.begin(), sharing.end());
  if (most_sharing > 1)
    p.binding += ", shared by up to " + std::to_string(most_sharing) + " ranks";

  // Warnings, only for an explicit --threads.
  if (requested > 0) {
    std::vector<int> over, shared;
    for (int r = 0; r < world; ++r) {
      const int n = static_cast<int>(ranks[r].cpus.size());
      if (requested > n) over.push_back(r);
      else if (requested * sharing[r] > n) shared.push_back(r);
    }
    if (!over.empty() && !bound(over.front())) {  // already unbound: the node itself has too few CPUs
      const int r = over.front();
      p.warnings.push_back("warning: option '--threads " + std::to_string(requested) + "' is more than the " +
                           std::to_string(ranks[r].online) + " CPUs of " + rank_list(over) + "'s node (" +
                           cpus_phrase(ranks[r].cpus) + "), so threads will share CPUs: use at most " +
                           std::to_string(ranks[r].online) + ", or '--threads 0' (the cores each rank may use)");
    } else if (!over.empty()) {
      const int r = over.front();
      p.warnings.push_back(
          "warning: option '--threads " + std::to_string(requested) + "' is more than the CPUs " + rank_list(over) +
          " may run on (" + (over.size() == 1 ? "" : "rank " + std::to_string(r) + ": ") + cpus_phrase(ranks[r].cpus) +
          "), so threads will share CPUs. "
          "Give each rank " + std::to_string(requested) + " cores: mpirun binds a rank to one core by default (2 ranks "
          "or fewer), so run it with '--bind-to none' (or '--map-by slot:PE=" + std::to_string(requested) + "'); under "
          "Slurm, '--cpus-per-task=" + std::to_string(requested) + "'. Or use '--threads 0' (the cores each rank may use)");
    }
    if (!shared.empty()) {
      const int r = shared.front();
      p.warnings.push_back("warning: option '--threads " + std::to_string(requested) + "': " + rank_list(shared) + " share their CPUs with other ranks of their node (rank " +
                           std::to_string(r) + ": " + cpus_phrase(ranks[r].cpus) + ", " + std::to_string(sharing[r]) +
                           " ranks): " + std::to_string(sharing[r] * requested) + " threads on " +
                           count_phrase(ranks[r].cpus.size()) + "; '--threads 0' divides the cores among the ranks");
    }
  }
  return p;
}

ThreadPlan plan_threads(Comm& comm, const std::string& host, int requested) {
  RankCpus me;
  agree(comm, [&] {
    me.cpus = affinity_cpus();
    me.cores = count_cores(me.cpus);
    me.online = online_cpus();
    me.host = fnv1a64(host);
  });
  int64_t top = me.cpus.empty() ? 0 : me.cpus.back();
  comm.all_reduce(&top, 1, ReduceOp::Max);
  const size_t words = static_cast<size_t>(top) / 64 + 1, rec = 3 + words;
  std::vector<uint64_t> mine(rec, 0), all(rec * static_cast<size_t>(comm.world_size()));
  mine[0] = me.host;
  mine[1] = static_cast<uint64_t>(me.online);
  mine[2] = static_cast<uint64_t>(me.cores);
  for (int c : me.cpus) mine[3 + static_cast<size_t>(c) / 64] |= uint64_t{1} << (c % 64);
  comm.all_gather(mine.data(), all.data(), rec);
  std::vector<RankCpus> ranks(static_cast<size_t>(comm.world_size()));
  for (size_t r = 0; r < ranks.size(); ++r) {
    const uint64_t* w = all.data() + r * rec;
    ranks[r].host = w[0];
    ranks[r].online = static_cast<int>(w[1]);
    ranks[r].cores = static_cast<int>(w[2]);
    for (size_t c = 0; c < words * 64; ++c)
      if (w[3 + c / 64] >> (c % 64) & 1) ranks[r].cpus.push_back(static_cast<int>(c));
  }
  return plan_threads(ranks, comm.rank(), requested);
}

}  // namespace shardtrain
