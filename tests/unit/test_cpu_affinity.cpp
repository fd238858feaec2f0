// Threads per rank from the ranks' affinity masks (plan_threads, pure) and the mask readers.
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/runtime/cpu_affinity.h"

namespace st = shardtrain;

namespace {

std::vector<int> range(int a, int b) {  // [a, b)
  std::vector<int> v;
  for (int i = a; i < b; ++i) v.push_back(i);
  return v;
}

st::RankCpus rank_on(uint64_t host, int online, std::vector<int> cpus, int cores = -1) {
  st::RankCpus r;
  r.host = host;
  r.online = online;
  r.cores = cores < 0 ? static_cast<int>(cpus.size()) : cores;
  r.cpus = std::move(cpus);
  return r;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(CpuAffinity, CpuList) {
  EXPECT_EQ(st::cpu_list({}), "");
  EXPECT_EQ(st::cpu_list({0}), "0");
  EXPECT_EQ(st::cpu_list({0, 1, 2, 3}), "0-3");
  EXPECT_EQ(st::cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
}

TEST(CpuAffinity, ThisProcess) {
  const std::vector<int> cpus = st::affinity_cpus();
  ASSERT_FALSE(cpus.empty());
  EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
  const int cores = st::count_cores(cpus);
  EXPECT_GE(cores, 1);
  EXPECT_LE(cores, static_cast<int>(cpus.size()));
  EXPECT_GE(st::online_cpus(), 1);
}

// mpirun -np 1 binds the lone rank to core 0: --threads 0 gives 1 thread, --threads 3 warns.
TEST(CpuAffinity, RankBoundToOneCore) {
  const std::vector<st::RankCpus> ranks{rank_on(1, 2, {0})};
  st::ThreadPlan p = st::plan_threads(ranks, 0, 0);
  EXPECT_EQ(p.threads, 1);
  EXPECT_EQ(p.per_rank, "1");
  EXPECT_EQ(p.binding, "rank 0 bound to CPU 0");
  EXPECT_TRUE(p.warnings.empty());
  p = st::plan_threads(ranks, 0, 3);
  EXPECT_EQ(p.threads, 3);  // asked for: obeyed, with a warning
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_TRUE(contains(p.warnings[0], "'--bind-to none'")) << p.warnings[0];
  EXPECT_TRUE(contains(p.warnings[0], "'--cpus-per-task=3'")) << p.warnings[0];
  EXPECT_TRUE(contains(p.warnings[0], "rank 0 may run on (CPU 0)")) << p.warnings[0];
  // As many threads as CPUs: no warning.
  EXPECT_TRUE(st::plan_threads({rank_on(1, 8, range(0, 4))}, 0, 4).warnings.empty());
}

// --bind-to none: two ranks on a 2-core node both see both cores; each takes one.
TEST(CpuAffinity, UnboundRanksShareTheNode) {
  const std::vector<st::RankCpus> ranks{rank_on(1, 2, {0, 1}), rank_on(1, 2, {0, 1})};
  for (int r = 0; r < 2; ++r) EXPECT_EQ(st::plan_threads(ranks, r, 0).threads, 1);
  st::ThreadPlan p = st::plan_threads(ranks, 0, 0);
  EXPECT_EQ(p.binding, "every rank unbound on CPUs 0-1, shared by up to 2 ranks");
  EXPECT_TRUE(p.warnings.empty());
  p = st::plan_threads(ranks, 0, 2);  // 4 threads on 2 CPUs
  EXPECT_EQ(p.threads, 2);
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_TRUE(contains(p.warnings[0], "4 threads on 2 CPUs")) << p.warnings[0];
  // Already unbound and more threads than the node has: no advice to unbind, the node's count.
  p = st::plan_threads({rank_on(1, 2, {0, 1})}, 0, 4);
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_TRUE(contains(p.warnings[0], "more than the 2 CPUs of rank 0's node")) << p.warnings[0];
  EXPECT_FALSE(contains(p.warnings[0], "--bind-to none")) << p.warnings[0];
  // 4 unbound ranks on a 64-core node: 16 each; 3 ranks: 21 each.
  std::vector<st::RankCpus> big(4, rank_on(1, 64, range(0, 64)));
  EXPECT_EQ(st::plan_threads(big, 3, 0).threads, 16);
  big.resize(3);
  EXPECT_EQ(st::plan_threads(big, 0, 0).threads, 21);
}

TEST(CpuAffinity, BoundRanksGetTheirCores) {
  const std::vector<st::RankCpus> ranks{rank_on(1, 2, {0}), rank_on(1, 2, {1})};
  const st::ThreadPlan p = st::plan_threads(ranks, 1, 0);
  EXPECT_EQ(p.threads, 1);
  EXPECT_EQ(p.binding, "each rank bound to 1 CPU, rank 0 to CPU 0");
  // Slurm --cpus-per-task=8 --cpu-bind=cores on a 64-core node: 8 each, whatever the node size.
  std::vector<st::RankCpus> slurm;
  for (int r = 0; r < 4; ++r) slurm.push_back(rank_on(1, 64, range(8 * r, 8 * r + 8)));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(st::plan_threads(slurm, r, 0).threads, 8);
  EXPECT_TRUE(st::plan_threads(slurm, 0, 8).warnings.empty());
  // 4 unbound tasks confined (cgroup) to the same 16 CPUs of a 64-CPU node: 4 each, not 16.
  std::vector<st::RankCpus> cg(4, rank_on(1, 64, range(0, 16)));
  EXPECT_EQ(st::plan_threads(cg, 0, 0).threads, 4);
}

TEST(CpuAffinity, OtherNodesDoNotShare) {
  const std::vector<st::RankCpus> ranks{rank_on(1, 2, {0, 1}), rank_on(2, 2, {0, 1})};
  const st::ThreadPlan p = st::plan_threads(ranks, 0, 0);
  EXPECT_EQ(p.threads, 2);
  EXPECT_EQ(p.binding, "every rank unbound on CPUs 0-1");
}

TEST(CpuAffinity, HyperthreadsCountOnce) {
  // Bound to one core = its two hardware threads.
  EXPECT_EQ(st::plan_threads({rank_on(1, 16, {0, 8}, 1)}, 0, 0).threads, 1);
  EXPECT_EQ(st::plan_threads({rank_on(1, 16, {0, 8}, 1)}, 0, 0).binding, "rank 0 bound to CPUs 0,8");
}

TEST(CpuAffinity, MixedBindingsAreSummarized) {
  const std::vector<st::RankCpus> ranks{rank_on(1, 8, {0}), rank_on(1, 8, range(1, 8)), rank_on(1, 8, range(1, 8))};
  st::ThreadPlan p = st::plan_threads(ranks, 1, 0);
  EXPECT_EQ(p.threads, 3);  // 7 cores shared by 2 ranks
  EXPECT_EQ(p.per_rank, "1 to 3 (rank 0: 1)");
  EXPECT_EQ(p.binding, "rank 0 bound to CPU 0; ranks 1-2 bound to 7 CPUs each, shared by up to 2 ranks");
  p = st::plan_threads({rank_on(1, 4, {0}), rank_on(1, 4, range(0, 4))}, 0, 0);
  EXPECT_EQ(p.binding, "rank 0 bound to CPU 0; rank 1 unbound, shared by up to 2 ranks");
}

TEST(CpuAffinity, BadArguments) {
  const std::vector<st::RankCpus> ranks{rank_on(1, 2, {0})};
  EXPECT_THROW(st::plan_threads(ranks, 1, 0), std::invalid_argument);
  EXPECT_THROW(st::plan_threads(ranks, 0, -1), std::invalid_argument);
}

// Whether the ranks have their cores to themselves (the CPU peak is measured only then).
TEST(CpuAffinity, CoresSharedForTheMeasuredPeak) {
  // mpirun -np 2 on 2 cores: each rank bound to its core.
  EXPECT_FALSE(st::plan_threads({rank_on(1, 2, {0}), rank_on(1, 2, {1})}, 0, 0).cores_shared);
  // --bind-to none, 2 ranks x 1 thread on 2 cores: the masks overlap, but the threads fit.
  const std::vector<st::RankCpus> two(2, rank_on(1, 2, {0, 1}));
  EXPECT_FALSE(st::plan_threads(two, 0, 0).cores_shared);
  EXPECT_TRUE(st::plan_threads(two, 0, 0).shared_why.empty());
  // ... with --threads 2: 4 threads on 2 cores.
  EXPECT_TRUE(st::plan_threads(two, 1, 2).cores_shared);
  // mpirun -np 4 --oversubscribe on 2 cores: every rank sees both, 4 threads on 2 cores; every
  // rank knows it (the flag is the job's, not the rank's).
  const std::vector<st::RankCpus> four(4, rank_on(1, 2, {0, 1}));
  for (int r = 0; r < 4; ++r) {
    const st::ThreadPlan p = st::plan_threads(four, r, 0);
    EXPECT_TRUE(p.cores_shared) << r;
    EXPECT_EQ(p.shared_why, "rank 0: 4 threads of 4 ranks on 2 cores (CPUs 0-1)");
  }
  // Two ranks bound to the same core (a launcher's mistake).
  EXPECT_TRUE(st::plan_threads({rank_on(1, 2, {0}), rank_on(1, 2, {0})}, 1, 0).cores_shared);
  // One rank, --threads beyond its mask.
  EXPECT_TRUE(st::plan_threads({rank_on(1, 8, range(0, 4))}, 0, 8).cores_shared);
  EXPECT_FALSE(st::plan_threads({rank_on(1, 8, range(0, 4))}, 0, 4).cores_shared);
  // The same masks on different nodes do not share.
  EXPECT_FALSE(st::plan_threads({rank_on(1, 2, {0, 1}), rank_on(2, 2, {0, 1})}, 0, 0).cores_shared);
  // Hyperthreads: 2 logical CPUs of one core, 2 threads: shared (one core).
  EXPECT_TRUE(st::plan_threads({rank_on(1, 4, {0, 1}, 1)}, 0, 2).cores_shared);
}
