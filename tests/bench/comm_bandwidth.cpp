// comm_bandwidth: MPI all-gather and reduce-scatter timings for unit-sized messages, reported as
// nccl-tests reports them (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
//   S      = total bytes of the collective: count per rank x element size x W (the all-gather's
//            receive buffer, the reduce-scatter's send buffer);
//   algbw  = S / t;
//   busbw  = algbw x (W - 1) / W (both collectives), comparable with a link's bandwidth.
// t is the median over --reps repetitions of the slowest rank's time (barrier, then the call;
// MPI_Reduce of the per-rank times with MPI_MAX). Collectives measured:
//   allgather      float32 (MPI_FLOAT)     fp32 parameter gather (shardtrain --precision fp32)
//   allgather      bf16    (MPI_UINT16_T)  bf16 parameter gather (2-byte elements, as shardtrain sends bf16)
//   reduce_scatter float32 (MPI_Reduce_scatter_block, MPI_SUM)  fp32 gradient reduce
// Sizes: powers of two from --min-bytes to --max-bytes (S, as above).
// Output: a table on rank 0's stdout and, with --json FILE, one JSON object appended to FILE as a
// line (one line per run, i.e. per world size): read by scripts/scaling_model.py (docs/scaling.md).
// Usage: mpirun --oversubscribe -np W comm_bandwidth [--min-bytes N] [--max-bytes N] [--reps N]
//                [--warmup N] [--json FILE]
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Options {
  size_t min_bytes = size_t{4} << 10;
  size_t max_bytes = size_t{64} << 20;
  int reps = 15;
  int warmup = 2;
  std::string json;
};

[[noreturn]] void usage(int rank, const char* msg) {
  if (rank == 0)
    std::fprintf(stderr,
                 "comm_bandwidth: %s\nusage: comm_bandwidth [--min-bytes N] [--max-bytes N] [--reps N] [--warmup N] "
                 "[--json FILE]\n",
                 msg);
  MPI_Finalize();
  std::exit(2);
}

Options parse(int argc, char** argv, int rank) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(rank, ("missing value for " + a).c_str());
      return argv[++i];
    };
    if (a == "--min-bytes") o.min_bytes = std::stoull(value());
    else if (a == "--max-bytes") o.max_bytes = std::stoull(value());
    else if (a == "--reps") o.reps = std::stoi(value());
    else if (a == "--warmup") o.warmup = std::stoi(value());
    else if (a == "--json") o.json = value();
    else usage(rank, ("unknown argument " + a).c_str());
  }
  if (o.min_bytes < 1 || o.max_bytes < o.min_bytes || o.reps < 1 || o.warmup < 0) usage(rank, "bad value");
  return o;
}

struct Result {
  std::string op, dtype;
  size_t elem_bytes = 0, bytes = 0, count_per_rank = 0;
  double median_s = 0, min_s = 0, algbw = 0, busbw = 0;
};

// Times one collective: `reps` timed calls after `warmup` untimed ones; each time is the slowest
// rank's (the collective is done when every rank is done). Median and minimum on every rank.
template <typename F> void time_op(F&& call, int reps, int warmup, double& median, double& minimum) {
  for (int i = 0; i < warmup; ++i) call();
  std::vector<double> t(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    call();
    double dt = MPI_Wtime() - t0, worst = 0;
    MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    t[static_cast<size_t>(i)] = worst;
  }
  std::sort(t.begin(), t.end());
  const size_t n = t.size();
  median = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
  minimum = t.front();
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const Options o = parse(argc, argv, rank);
  const size_t W = static_cast<size_t>(world);

  struct Op { const char* op; const char* dtype; size_t es; MPI_Datatype dt; bool gather; };
  const Op ops[] = {{"allgather", "float32", 4, MPI_FLOAT, true},
                    {"allgather", "bf16", 2, MPI_UINT16_T, true},
                    {"reduce_scatter", "float32", 4, MPI_FLOAT, false}};
  std::vector<Result> results;
  std::vector<char> send, recv;
  for (const Op& op : ops) {
    for (size_t S = o.min_bytes; S <= o.max_bytes; S *= 2) {
      const size_t count = std::max<size_t>(1, S / (W * op.es));  // elements per rank
      const size_t total = count * W * op.es;                      // S as actually moved
      if (count > static_cast<size_t>(INT32_MAX)) break;
      const int n = static_cast<int>(count);
      // Non-zero contents (small integers: exact float sums, no denormals).
      send.assign(op.gather ? count * op.es : total, 1);
      recv.assign(op.gather ? total : count * op.es, 0);
      Result r{op.op, op.dtype, op.es, total, count, 0, 0, 0, 0};
      if (op.gather)
        time_op([&] { MPI_Allgather(send.data(), n, op.dt, recv.data(), n, op.dt, MPI_COMM_WORLD); }, o.reps,
                o.warmup, r.median_s, r.min_s);
      else
        time_op([&] { MPI_Reduce_scatter_block(send.data(), recv.data(), n, op.dt, MPI_SUM, MPI_COMM_WORLD); },
                o.reps, o.warmup, r.median_s, r.min_s);
      r.algbw = static_cast<double>(total) / r.median_s / 1e9;
      r.busbw = r.algbw * static_cast<double>(W - 1) / static_cast<double>(W);
      results.push_back(r);
      if (rank == 0) {
        if (results.size() == 1)
          std::printf("# W = %d, median of %d reps (slowest rank each), S = total bytes (nccl-tests)\n"
                      "# %-15s %-8s %12s %12s %11s %11s %11s\n",
                      world, o.reps, "op", "dtype", "S (bytes)", "count/rank", "time (us)", "algbw GB/s",
                      "busbw GB/s");
        std::printf("  %-15s %-8s %12zu %12zu %11.1f %11.3f %11.3f\n", r.op.c_str(), r.dtype.c_str(), r.bytes,
                    r.count_per_rank, r.median_s * 1e6, r.algbw, r.busbw);
        std::fflush(stdout);
      }
    }
  }
  if (rank == 0 && !o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "a");
    if (!f) {
      std::fprintf(stderr, "comm_bandwidth: cannot open '%s'\n", o.json.c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    std::fprintf(f, "{\"tool\": \"comm_bandwidth\", \"world\": %d, \"reps\": %d, \"warmup\": %d, \"results\": [", world,
                 o.reps, o.warmup);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f,
                   "%s{\"op\": \"%s\", \"dtype\": \"%s\", \"elem_bytes\": %zu, \"bytes\": %zu, \"count_per_rank\": %zu, "
                   "\"median_s\": %.9g, \"min_s\": %.9g, \"algbw_GBps\": %.6g, \"busbw_GBps\": %.6g}",
                   i ? ", " : "", r.op.c_str(), r.dtype.c_str(), r.elem_bytes, r.bytes, r.count_per_rank, r.median_s,
                   r.min_s, r.algbw, r.busbw);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  MPI_Finalize();
  return 0;
}
