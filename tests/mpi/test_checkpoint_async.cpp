// Multi-rank tests of AsyncCheckpointWriter (checkpoint.h): a background save publishes the
// snapshot's state although the live tensors change and the world communicator carries collectives
// meanwhile; one save in flight at a time; a failed save is seen by failed() on every rank and
// rethrown by wait() with the same message everywhere; synchronous mode saves on return. Run under
// mpirun at 1, 2, 3 and 4 ranks (needs MPI_THREAD_MULTIPLE for the asynchronous cases, which
// Debian's Open MPI grants; without it they check the synchronous fallback and its note).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard.h"
#include "shardtrain/train/train.h"
#include "rank_test.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

// Pages of `path` in the page cache (mincore(2) on a read-only mapping), or -1 where the question
// has no answer: a file system whose files live in memory (tmpfs, ramfs), or an empty file.
long resident_pages(const std::string& path) {
  struct statfs sf {};
  if (::statfs(path.c_str(), &sf) != 0 || sf.f_type == 0x01021994 /*TMPFS*/ || sf.f_type == 0x858458f6 /*RAMFS*/)
    return -1;
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return -1;
  const off_t size = ::lseek(fd, 0, SEEK_END);
  long n = -1;
  if (size > 0) {
    void* m = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
    if (m != MAP_FAILED) {
      const long page = ::sysconf(_SC_PAGESIZE);
      std::vector<unsigned char> v(static_cast<size_t>((size + page - 1) / page));
      if (::mincore(m, static_cast<size_t>(size), v.data()) == 0) {
        n = 0;
        for (unsigned char b : v) n += b & 1;
      }
      ::munmap(m, static_cast<size_t>(size));
    }
  }
  ::close(fd);
  return n;
}

st::ParamSpec pspec(std::string name, std::vector<int64_t> shape) {
  st::ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  return p;
}

// Two units, one split unevenly at 3 and 4 ranks.
std::vector<st::UnitSpec> units() {
  return {{"model.embed_tokens", {pspec("model.embed_tokens.weight", {5, 7})}},
          {"model.norm", {pspec("model.norm.weight", {13})}}};
}

// One rank's rows of params, adam_m, adam_v, filled with `v(k, u, global element)`.
struct Rows {
  st::ShardPlan plan;
  int rank;
  std::vector<std::vector<float>> t[3];
  Rows(const st::ShardPlan& p, int r) : plan(p), rank(r) {
    for (auto& x : t)
      for (auto& up : plan.units) x.emplace_back(static_cast<size_t>(up.shard_size), 0.0f);
  }
  void fill(float base) {
    for (int k = 0; k < 3; ++k)
      for (size_t u = 0; u < plan.units.size(); ++u) {
        const st::RankShard& rs = plan.units[u].ranks[static_cast<size_t>(rank)];
        for (int64_t j = 0; j < rs.valid; ++j)
          t[k][u][static_cast<size_t>(j)] = base + 100.0f * static_cast<float>(k) + static_cast<float>(1000 * u) +
                                            static_cast<float>(rs.start + j);
      }
  }
  st::ShardedTensors view(st::Backend<float>& be) {
    st::ShardedTensors s;
    s.plan = &plan;
    s.plan_rank = rank;
    s.backend = &be;
    for (int k = 0; k < 3; ++k) {
      st::ShardedTensor x{st::checkpoint_tensor_names()[static_cast<size_t>(k)], {}};
      for (auto& shard : t[k]) x.shards.push_back(shard.data());
      s.tensors.push_back(std::move(x));
    }
    return s;
  }
  bool operator==(const Rows& o) const {
    for (int k = 0; k < 3; ++k)
      if (t[k] != o.t[k]) return false;
    return true;
  }
};

st::TrainState state_at(int64_t step) {
  st::TrainState s;
  s.step = step;
  s.seed = 7;
  s.segments = {{0, 8, 16, 7}};
  s.tokens_seen = st::tokens_of(s.segments, step);
  return s;
}
std::string train_config() {
  st::TrainConfig tc;
  tc.global_batch = 8;
  tc.seq_len = 16;
  tc.seed = 7;
  return st::train_config_json(tc);
}

class CheckpointAsync : public st::testing::TempDirTest {
 protected:
  st::CheckpointSnapshot snapshot(Rows& r, int64_t step) {
    return st::take_checkpoint_snapshot(r.view(*be_), st::preset("tiny"), train_config(), state_at(step));
  }
  std::unique_ptr<st::Backend<float>> be_ = st::make_cpu_backend<float>();
};

TEST_F(CheckpointAsync, BackgroundSaveIsIsolatedAndPublished) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(units(), c.world_size());
  st::AsyncCheckpointWriter w(c, true, 60);
  EXPECT_EQ(w.asynchronous(), st::mpi_thread_multiple());
  EXPECT_EQ(w.note().empty(), st::mpi_thread_multiple());
  Rows live(plan, c.rank());
  live.fill(0.5f);
  st::CheckpointOptions co;
  co.dir = dir_ + "/run";
  co.keep_last = 1;
  w.start(snapshot(live, 1), co);
  EXPECT_TRUE(w.in_flight());
  EXPECT_THROW(w.start(snapshot(live, 2), co), std::logic_error);  // one save in flight
  // Training goes on: the live rows change, the world carries collectives.
  live.fill(-3.0f);
  for (int i = 0; i < 50; ++i) {
    double x = 1;
    c.all_reduce(&x, 1, st::ReduceOp::Sum);
    EXPECT_EQ(x, c.world_size());
  }
  EXPECT_FALSE(w.failed());
  st::AsyncCheckpointWriter::Result r;
  EXPECT_TRUE(w.wait(&r));
  EXPECT_FALSE(w.in_flight());
  EXPECT_FALSE(w.wait(&r));  // nothing in flight
  EXPECT_EQ(r.step, 1);
  EXPECT_EQ(r.path, co.dir + "/step_00000001.h5");
  // The background write ran at nice 19 (checkpoint.h), a synchronous one at the caller's priority.
  EXPECT_EQ(r.sched_policy, ::sched_getscheduler(0));
  EXPECT_EQ(r.nice, w.asynchronous() ? 19 : ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid())));
  // ... and on any CPU of the job, not only the ones mpirun bound this rank to (checkpoint_async.cpp:
  // a writer on its rank's busy core ran 4.7x slower than with a core beside it idle).
  {
    cpu_set_t own;
    CPU_ZERO(&own);
    ASSERT_EQ(::sched_getaffinity(0, sizeof own, &own), 0);
    const int mine = CPU_COUNT(&own), online = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
    EXPECT_GE(r.cpus, mine);
    if (w.asynchronous() && mine < online && !std::getenv("SLURM_JOB_ID")) {  // bound by mpirun, no cgroup limit
      EXPECT_EQ(r.cpus, online) << "the background writer kept its rank's binding (" << mine << " of " << online
                                << " CPUs)";
    }
  }
  // Published = on disk and out of the page cache (publish_checkpoint's POSIX_FADV_DONTNEED).
  if (c.rank() == 0) {
    const long pages = resident_pages(r.path);
    if (pages < 0)
      std::printf("[ note ] page-cache check skipped: %s is in memory (tmpfs) or unmappable\n", r.path.c_str());
    else
      EXPECT_EQ(pages, 0) << r.path << ": pages left in the page cache after publishing";
  }
  c.barrier();  // before any rank reads the file back (which caches its pages again)
  Rows want(plan, c.rank()), got(plan, c.rank());
  want.fill(0.5f);
  EXPECT_EQ(st::load_checkpoint(c, r.path, got.view(*be_), st::preset("tiny")).step, 1);
  EXPECT_TRUE(got == want) << "the file holds the state at the snapshot, not the later one";
  // A second save, collected by poll(); --keep-last 1 prunes step 1 only after publishing step 2.
  w.start(snapshot(live, 2), co);
  bool done = false;
  for (int i = 0; i < 6000 && !done; ++i) {
    done = w.poll(&r);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(r.step, 2);
  c.barrier();
  EXPECT_EQ(st::published_checkpoints(co.dir), std::vector<std::string>{"step_00000002.h5"});
  EXPECT_EQ(st::resolve_resume(c, "auto", co.dir), co.dir + "/step_00000002.h5");
}

// A save that fails (the directory is a file): every rank's writer reports failed(), and wait()
// rethrows the same CollectiveError on every rank.
TEST_F(CheckpointAsync, FailureIsSeenOnEveryRank) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(units(), c.world_size());
  if (c.rank() == 0) std::ofstream(dir_ + "/file") << "x";
  c.barrier();
  for (bool async : {true, false}) {
    st::AsyncCheckpointWriter w(c, async, 60);
    Rows live(plan, c.rank());
    live.fill(1.0f);
    st::CheckpointOptions co;
    co.dir = dir_ + "/file/sub";
    std::string msg;
    try {
      w.start(snapshot(live, 1), co);
      EXPECT_TRUE(async && w.asynchronous()) << "a synchronous save must throw from start()";
      for (int i = 0; i < 6000 && !w.failed(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      EXPECT_TRUE(w.failed());
      w.wait(nullptr);
      ADD_FAILURE() << "wait() returned";
    } catch (const st::CollectiveError& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("cannot create checkpoint directory"), std::string::npos) << msg;
    EXPECT_FALSE(w.in_flight());
    EXPECT_TRUE(st::same_on_all_ranks(c, st::fnv1a64(msg))) << "ranks report different errors";
  }
}

}  // namespace
