// shardtrain: options -> mode -> one call into the layer that does the job.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/blas_select.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/parallel/geometry.h"
#include "shardtrain/io/hf.h"
#include "shardtrain/model/config.h"
#include "shardtrain/runtime/cpu_affinity.h"
#include "shardtrain/data/data.h"
#include "shardtrain/runtime/files.h"
#include "shardtrain/train/memory_plan.h"
#include "shardtrain/train/mfu.h"
#include "shardtrain/runtime/mesh.h"
#include "shardtrain/app/options.h"
#include "shardtrain/parallel/parallelize.h"  // training_refusal
#include "shardtrain/data/prepare.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/train/train.h"

using namespace shardtrain;

namespace {

// --mode prepare: rank 0 tokenizes and writes the token file (prepare.h); the others wait for the
// agreed outcome. Progress on stderr when it is a terminal; a summary line always.
void run_prepare(Comm& comm, const Options& o) {
  PrepareResult r;
  std::string err;
  if (comm.rank() == 0) {  // one writer; no collective inside
    try {
      PrepareOptions po{o.inputs, o.out, o.val_fraction, o.tokenizer, o.text_field};
      // Test hook: a tiny chunk makes the tests cut documents into many pieces.
      if (const char* c = std::getenv("SHARDTRAIN_TEST_PREPARE_CHUNK_BYTES")) po.chunk_bytes = std::stoul(c);
      po.progress = isatty(STDERR_FILENO) != 0;
      r = prepare_tokens(po);
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  all_ok(comm, err.empty(), err);
  const TokenFileHeader& h = r.header;
  char rates[160];
  std::snprintf(rates, sizeof rates, "%.1f MB in %.2f s: %.1f MB/s, %.3g tokens/s; peak RSS %.1f MB",
                r.input_bytes / 1e6, r.seconds, r.input_bytes / 1e6 / std::max(r.seconds, 1e-9),
                static_cast<double>(h.n_train + h.n_val) / std::max(r.seconds, 1e-9), r.peak_rss_bytes / 1e6);
  log_info(comm, "prepare: wrote '" + o.out + "': " + std::to_string(h.n_train) + " train + " +
                     std::to_string(h.n_val) + " validation tokens (" + h.tokenizer + ", vocab " +
                     std::to_string(h.vocab_size) + "), " + std::to_string(r.documents) +
                     (r.documents == 1 ? " document from " : " documents from ") + std::to_string(r.files) +
                     (r.files == 1 ? " file, " : " files, ") + rates);
}

// --mode tokenizer: rank 0 trains a SentencePiece model (tokenizer.h); all ranks agree on the outcome.
void run_tokenizer(Comm& comm, const Options& o) {
  TokenizerTrainResult r;
  std::string err;
  if (comm.rank() == 0) {
    try {
      TokenizerTrainOptions t;
      t.inputs = o.inputs;
      t.text_field = o.text_field;
      t.vocab_size = o.vocab_size;
      t.out = o.out;
      r = train_sentencepiece(t);
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  all_ok(comm, err.empty(), err);
  char b[96];
  std::snprintf(b, sizeof b, "%.1f MB in %.1f s", r.bytes / 1e6, r.seconds);
  log_info(comm, "tokenizer: wrote '" + o.out + "': SentencePiece BPE, vocab " + std::to_string(r.vocab_size) +
                     ", trained on " + std::to_string(r.sentences) + " lines (" + b + ")");
}

// The run's mesh from options '--pp', '--tp', '--cp' and '--shard-group-size' (hybrid sharding: G
// ranks per shard group, W / P / G replica groups per stage), checked on every rank before anything else; logs the topology line.
std::unique_ptr<Mesh> build_mesh(Comm& comm, const Topology& topo, const Options& o) {
  MeshDims dims;
  agree(comm, [&] {
    dims = resolve_mesh_dims(o.shard_group_size, o.tp, o.cp, topo.world_size, ranks_per_node(topo), o.pp, o.ep);
  });
  auto mesh = std::make_unique<Mesh>(comm, topo, dims, o.collective_timeout);
  log_info(comm, mesh->topology_line());
  if (!mesh->shard_group_note().empty()) log_info(comm, mesh->shard_group_note());
  return mesh;
}

// The token files of '--data' / '--val-data', read (mapped) by every rank and checked to be the same
// everywhere; special ids the model config leaves out are taken from them.
std::unique_ptr<TokenDataset> open_data(Comm& comm, const Options& o, ModelConfig& mc) {
  std::unique_ptr<TokenDataset> data;
  std::string what;  // names the data in messages
  agree(comm, [&] {  // every rank expands the patterns and reads (maps) the files itself
    const std::vector<std::string> train_files = expand_data_paths(o.data, "data");
    const std::vector<std::string> val_files = expand_data_paths(o.val_data, "val-data");
    data = std::make_unique<TokenDataset>(train_files, val_files, parse_data_format(o.data_format));
    const size_t n = data->files().size();
    what = n == 1 ? "token file '" + data->path() + "'"
                  : "token files '" + data->path() + "' and " + std::to_string(n - 1) + " more";
  });
  log_info(comm, "data: " + what + ": " + std::to_string(data->size(Split::Train)) + " train + " +
                     std::to_string(data->size(Split::Val)) + " validation tokens (" + data->files().front().format +
                     (data->header().vocab_size ? ", " + data->header().tokenizer + " vocab " +
                                                      std::to_string(data->header().vocab_size)
                                                : std::string(", no vocabulary: ids checked against the model")) +
                     "), memory-mapped");
  {  // Every rank reads the token files itself: a path that names other files on other nodes would
     // train each rank on other data without a word.
    const std::vector<int> odd = ranks_differing_from_root(comm, data->crc32());
    if (!odd.empty())
      throw CollectiveError(odd.front(), what + " (options '--data', '--val-data') is not the same on every rank: " +
                                             rank_list(odd) + " read other contents than rank 0 (a copy on a node's local "
                                             "disk, or a relative path under different working directories?)");
  }
  if (data->header().vocab_size > 0) {  // Special ids the config leaves out come from the token file; a conflict is refused.
    const bool is_file = o.model.size() > 5 && o.model.ends_with(".json");
    const TokenFileHeader& h = data->header();
    auto id = [](uint32_t v) { return v == kNoTokenId ? int64_t{-1} : static_cast<int64_t>(v); };
    take_special_ids_from_data(comm, mc, (is_file ? "model config '" : "preset '") + o.model + "'",
                               DataSpecialIds{what, h.vocab_size, id(h.bos_id), id(h.eos_id)});
  }
  return data;
}

// Device placement: each rank decides from what its node shows, then all agree, before any device
// is touched; a run is all-GPU or all-CPU. '--device cpu' loads nothing CUDA; '--device auto' loads
// the CUDA plugin only when the driver sees a device (cuda.h). `why`: the driver's or the plugin's
// word when no device was found.
DevicePlan place_devices(Comm& comm, const Topology& topo, const Options& o, std::string& why) {
  DevicePlan dp;
  int devices = 0;
  agree(comm, [&] {
    const int n = devices = o.run.device == DeviceChoice::Cpu ? 0 : cuda_device_count(&why);
    try {
      dp = plan_devices(o.device, o.gpu_comm, topo.local_rank, topo.local_size, n, cuda_built(), topo.host);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(std::string(e.what()) +
                               (cuda_built() && n == 0 && !why.empty() ? " [CUDA: " + why + "]" : ""));
    }
  });
  int64_t on_gpu = dp.cuda ? 1 : 0;
  comm.all_reduce(&on_gpu, 1, ReduceOp::Sum);
  all_ok(comm, on_gpu == 0 || on_gpu == topo.world_size,
         "option '--device auto': " + std::to_string(on_gpu) + " of " + std::to_string(topo.world_size) +
             " ranks found a CUDA device; pass '--device cuda' or '--device cpu' explicitly");
  {  // NCCL refuses two ranks on one GPU: count the ranks of this node bound to this rank's GPU,
     // by UUID (with Slurm's per-task CUDA_VISIBLE_DEVICES every rank sees its GPU as device 0).
    constexpr size_t kRec = 256;
    std::string me;
    agree(comm, [&] { me = topo.host + "|" + (dp.cuda ? cuda_device_uuid(dp.gpu) : std::string()); });
    me.resize(kRec, '\0');
    std::vector<char> all(kRec * static_cast<size_t>(topo.world_size));
    comm.all_gather(me.data(), all.data(), kRec);
    int same = 0;
    for (int r = 0; r < topo.world_size; ++r) same += std::string(all.data() + r * kRec, kRec) == me ? 1 : 0;
    agree(comm, [&] { check_gpu_sharing(dp, same, topo.local_size, devices, topo.host); });
  }
  return dp;
}

std::string num(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// The job's peak FLOP/s for MFU (mfu.h): the sum of the ranks' device peaks -- --peak-tflops, the GPU
// table by each rank's device name and the run's precision, or the CPU's sgemm rate measured here
// (all ranks at once) -- or 0 (MFU n/a) when any rank's is unknown or the ranks share cores. Logs
// one line saying which figure and where it comes from. Collective; after the backends exist (the
// CPU measurement runs on the rank's threads, with OpenBLAS as the backend set it).
double job_peak_flops(Comm& comm, const Options& o, const DevicePlan& dp, const ThreadPlan& tp, const CudaContext* ctx) {
  const int W = comm.world_size();
  const bool bf16 = o.train.precision == Precision::BF16;
  const std::string ranks = std::to_string(W) + (W == 1 ? " rank" : " ranks");
  if (o.peak_tflops_given) {
    const double job = o.peak_tflops * 1e12 * W;
    log_info(comm, "MFU peak: --peak-tflops " + num("%g", o.peak_tflops) + " TFLOP/s per rank's device x " + ranks +
                       " = " + num("%g", job / 1e12) + " TFLOP/s");
    return job;
  }
  // Per-rank figures, then their sum, range and whether any is unknown (0).
  auto gather = [&](double mine, double* sum, double* lo, double* hi) {
    std::vector<double> all(static_cast<size_t>(W));
    comm.all_gather(&mine, all.data(), 1);
    *sum = 0;
    *lo = *hi = all[0];
    for (double v : all) {
      *sum += v;
      *lo = std::min(*lo, v);
      *hi = std::max(*hi, v);
    }
  };
  if (dp.cuda) {
    const std::string name = ctx->device_name();
    const double mine = gpu_peak_flops(name, bf16);
    int64_t first_unknown = mine > 0 ? W : comm.rank();
    comm.all_reduce(&first_unknown, 1, ReduceOp::Min);
    if (first_unknown < W) {
      const std::string who = comm.broadcast_string(name, static_cast<int>(first_unknown));
      const bool fp32_only = !bf16 && find_gpu_peak(who) != nullptr;  // in the table without an FP32 figure
      log_info(comm, unknown_peak_message(who + (fp32_only ? " in fp32" : "")) +
                         (W > 1 ? " (rank " + std::to_string(first_unknown) + ")" : ""));
      return 0;
    }
    double sum = 0, lo = 0, hi = 0;
    gather(mine, &sum, &lo, &hi);
    const GpuPeak* p = find_gpu_peak(name);
    log_info(comm, std::string("MFU peak: ") + (bf16 ? "dense bf16 tensor-core" : "plain FP32 (CUDA cores, not TF32)") +
                       " peak of " + (lo == hi ? name + " (" + p->source + "): " + std::to_string(W) + " x " +
                                                     num("%.1f", hi / 1e12) + " TFLOP/s"
                                                : "the ranks' GPUs, " + num("%.1f", lo / 1e12) + " to " +
                                                      num("%.1f", hi / 1e12) + " TFLOP/s (rank 0: " + name + ")") +
                       (W > 1 ? " = " + num("%.1f", sum / 1e12) + " TFLOP/s" : ""));
    return sum;
  }
  if (tp.cores_shared) {  // the same on every rank (plan_threads sees every rank's mask)
    log_info(comm, "CPU peak not measured: cores shared (" + tp.shared_why + "): MFU n/a; --peak-tflops sets it");
    return 0;
  }
  comm.barrier();  // every rank measures at once, as they will train
  const GemmRate g = measure_sgemm_rate(tp.threads);
  double sum = 0, lo = 0, hi = 0;
  gather(g.flops_per_thread * g.threads, &sum, &lo, &hi);
  double secs = g.seconds;
  comm.all_reduce(&secs, 1, ReduceOp::Max);
  const std::string threads = tp.per_rank + (tp.per_rank == "1" ? " thread" : " threads");
  log_info(comm, "CPU peak (measured: sgemm " + std::to_string(g.n) + "^3 on every thread at once, best of " +
                     std::to_string(g.reps) + ", " + blas_selection().corename + " kernels, " + threads + " x " +
                     ranks + ", " + num("%.2f", secs) + " s): " +
                     (lo == hi || hi - lo < 0.0005 * hi ? std::to_string(W) + " x " + num("%.1f", hi / 1e9) + " GFLOP/s"
                                                        : "ranks " + num("%.1f", lo / 1e9) + " to " +
                                                              num("%.1f", hi / 1e9) + " GFLOP/s") +
                     (W > 1 ? " = " + num("%.1f", sum / 1e9) + " GFLOP/s" : "") +
                     (bf16 ? "; bf16 is emulated on the CPU: MFU is against this fp32 GEMM peak" : ""));
  return sum;
}

// This rank's backends (fp32, and bf16 for mixed precision) on the planned device and, on GPUs, the
// mesh's device communicators (NCCL, or MPI on host copies); logs the device line and notes.
struct Backends {
  std::unique_ptr<Backend<float>> be;
  std::unique_ptr<Backend<bf16>> be16;
  double job_peak = 0;  // dense bf16 peak of all ranks' devices together (0: unknown)
};
Backends make_backends(Comm& comm, const Topology& topo, const Options& o, const DevicePlan& dp,
                       const std::string& device_why, Mesh& mesh, std::unique_ptr<CudaContext>& ctx) {
  const bool mixed = o.train.precision == Precision::BF16;
  Backends b;
  // CPU runs: threads from each rank's affinity mask (--threads 0) and the BLAS kernel set, for the log.
  ThreadPlan tp;
  std::string blas;
  std::vector<std::string> startup_lines;
  if (!dp.cuda) {  // collectives; dp.cuda is the same on every rank
    tp = plan_threads(comm, topo.host, o.threads);
    blas = blas_report(comm, &startup_lines);
    startup_lines.insert(startup_lines.end(), tp.warnings.begin(), tp.warnings.end());
    // The driver saw a GPU but the CUDA plugin did not load: say so rather than train on the CPU silently.
    if (o.run.device == DeviceChoice::Auto && device_why.starts_with("cannot load the CUDA backend plugin"))
      startup_lines.push_back("note: '--device auto' runs on the CPU: " + device_why);
  }
  auto device_comm = [&](Comm& host) { return dp.nccl ? make_nccl_comm(host, *ctx) : make_staged_comm(host, *ctx); };
  agree(comm, [&] {
    if (dp.cuda) {
      ctx = CudaContext::create(dp.gpu);
      b.be = make_cuda_backend<float>(*ctx);
      if (mixed) b.be16 = make_cuda_backend<bf16>(*ctx);
      if (!dp.nccl) mesh.attach_device_comms(device_comm);
    } else {
      set_cpu_threads(tp.threads);
      b.be = make_cpu_backend<float>();
      if (mixed) b.be16 = make_cpu_backend<bf16>();
    }
  });
  if (dp.cuda && dp.nccl) mesh.attach_device_comms(device_comm);  // collective; agrees on failure itself
  const std::string where = dp.cuda ? ", rank 0 on cuda:" + std::to_string(dp.gpu) + " (" + ctx->device_name() + ", " +
                                          std::to_string(ctx->free_bytes() >> 30) + " GiB free)"
                                    : ", " + tp.per_rank + " thread(s) per rank (" + tp.binding + "), " + blas;
  const std::string reduce = o.train.reduce_bf16 ? "bf16" : "fp32";
  log_info(comm, "shardtrain: " + std::to_string(topo.world_size) + " ranks (" + std::to_string(topo.local_size) +
                     " on " + topo.host + "), device " + dp.summary + where + ", precision " +
                     (o.train.fp8 ? "fp8 (bf16, the blocks' projections in float8)"
                                  : precision_name(o.train.precision)) +
                     (mixed ? " (gradients reduced in " + reduce + ")" : ""));
  for (const std::string& l : startup_lines) log_info(comm, l);
  if (!mixed && o.train.reduce_bf16)
    log_info(comm, "note: '--reduce-dtype " + reduce + "' applies only with '--precision bf16'; gradients are "
                   "reduced in fp32");
  if (!dp.cuda && mixed)
    log_info(comm, "note: bf16 on the CPU is emulated (float math, bf16 rounding): slow, meant for testing");
  b.job_peak = job_peak_flops(comm, o, dp, tp, ctx.get());
  return b;
}

// '--precision fp8''s refusals (training and --mode plan alike).
std::string fp8_moe_refusal(const ModelConfig& mc) {
  return "option '--precision fp8' does not support mixture-of-experts models (" +
         (mc.name == "custom" ? mc.architecture : mc.name) + "): the experts and the router would stay bf16; use "
         "'--precision bf16'";
}
std::string fp8_cpu_refusal(const std::string& why) {
  return "option '--precision fp8' needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: sm_89 Ada, "
         "sm_90 Hopper and later); " + why + ": use '--precision bf16' or 'fp32'";
}

void run_train(Comm& comm, const Topology& topo, const Options& o) {
  std::unique_ptr<CudaContext> ctx;  // declared first: destroyed after everything that uses it (the mesh's device comms)
  const std::unique_ptr<Mesh> mesh = build_mesh(comm, topo, o);
  ModelConfig mc = resolve_model_config(comm, o.model);
  const std::unique_ptr<TokenDataset> data = open_data(comm, o, mc);
  TrainConfig tc = o.train;  // settled against the data: example data's settings (identical on every rank)
  std::string note;
  if (const std::string why = apply_data_settings(tc, *data, o.data_given, &note); !why.empty())
    throw CollectiveError(0, why);
  if (!note.empty()) log_info(comm, note);
  all_ok(comm, !(tc.fp8 && mc.is_moe()), fp8_moe_refusal(mc));
  std::string device_why;
  const DevicePlan dp = place_devices(comm, topo, o, device_why);
  all_ok(comm, !(tc.fp8 && !dp.cuda), fp8_cpu_refusal("this run is on the CPU"));
  const Backends b = make_backends(comm, topo, o, dp, device_why, *mesh, ctx);
  Engine eng{*mesh, *b.be, b.be16.get(), b.job_peak};
  train(eng, mc, tc, *data);
}

// --mode plan with a pipeline (pp > 1 stages, m micro-batches per step): the total per rank of
// every stage for each schedule that can run these micro-batches (interleaved with --pp-virtual's
// V, 2 when not given), as lines that follow the stages' plans.
std::string schedule_totals(const MemoryPlanInput& in, int pp, int m) {
  std::ostringstream os;
  char b[64];
  os << "\ntotal per rank by pipeline stage and schedule (GiB; " << m << (m == 1 ? " micro-batch" : " micro-batches")
     << " per step):";
  for (PipelineKind k : {PipelineKind::GPipe, PipelineKind::OneFOneB, PipelineKind::Interleaved,
                         PipelineKind::ZeroBubble}) {
    PipelineOptions po = in.train.pp;
    po.kind = k;
    po.chunks_per_rank = k == PipelineKind::Interleaved ? std::max(2, in.train.pp.chunks_per_rank) : 1;
    // --pp-layers applies to the schedules with its number of chunks; the others split evenly.
    const bool even = !po.layers.empty() && po.layers.size() != static_cast<size_t>(pp * po.chunks_per_rank);
    if (even) po.layers.clear();
    std::string why;
    MemoryPlanInput ki = in;
    ki.pipeline = resolve_pipeline(in.model, pp, po, m, &why);
    os << "\n  " << pipeline_kind_name(k)
       << (k == PipelineKind::Interleaved ? " v " + std::to_string(po.chunks_per_rank) : std::string())
       << (even ? " (even split)" : "") << ":";
    if (!why.empty()) {
      os << " not planned: " << why;
      continue;
    }
    int64_t most = 0;
    const std::vector<MemoryPlan> plans = plan_stages(ki);
    for (size_t s = 0; s < plans.size(); ++s) {
      const int64_t tot = plans[s].total();
      most = std::max(most, tot);
      std::snprintf(b, sizeof b, " %.2f", static_cast<double>(tot) / (1 << 30));
      os << (s ? "," : "") << b;
    }
    std::snprintf(b, sizeof b, "%.2f", static_cast<double>(most) / (1 << 30));
    os << " (largest " << b << ")";
  }
  return os.str();
}

// --mode plan --device-memory SIZE: the largest micro-batch that fits in SIZE per rank for each
// recompute mode, as lines that follow the plan (the plan of in.pp_rank's stage).
std::string device_memory_fits(const MemoryPlanInput& in, const std::string& size) {
  uint64_t dev = 0;
  try {
    dev = parse_size(size);
  } catch (const std::invalid_argument&) {
    throw CollectiveError(0, "option '--device-memory' must be a size like 80GB or 141GiB, got '" + size + "'");
  }
  std::ostringstream os;
  os << "\nfits in " << size << " per rank at seq-len " << in.train.seq_len << ":";
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    MemoryPlanInput m = in;
    m.train.recompute = r;
    m.train.micro_batch = 1;
    const int mb = largest_fitting_micro_batch(m, static_cast<int64_t>(dev));
    char b[64];
    const MemoryPlan p1 = plan_memory(m);  // micro-batch 1
    const double need = static_cast<double>(p1.total());
    if (need >= (1 << 30)) std::snprintf(b, sizeof b, "%.1f GiB", need / (1 << 30));
    else std::snprintf(b, sizeof b, "%.1f MiB", need / (1 << 20));
    os << "\n  --activation-checkpointing " << recompute_name(r) << ": "
       << (mb > 0 ? "micro-batch up to " + std::to_string(mb) + (mb == 1024 ? " (or more)" : "")
                  : std::string("does not fit (micro-batch 1 needs ") + b + ")");
    // Expert parallelism: the expert rows grow with the routing's imbalance (dropless), up to the
    // plan's worst case; what fits when every slot of the EP group lands on one rank's experts.
    if (mb > 0 && p1.worst_extra > 0) {
      int worst = 0;
      for (int k = 1; k <= mb; ++k) {
        m.train.micro_batch = k;
        const MemoryPlan p = k == 1 ? p1 : plan_memory(m);
        if (p.total() + p.worst_extra > static_cast<int64_t>(dev)) break;
        worst = k;
      }
      std::snprintf(b, sizeof b, "%.1f GiB", static_cast<double>(p1.total() + p1.worst_extra) / (1 << 30));
      os << (worst > 0 ? " (up to " + std::to_string(worst) + " at the worst routing imbalance)"
                       : std::string(" (at the worst routing imbalance none: micro-batch 1 needs ") + b +
                             "; a router that collapses onto one EP rank's experts ends the run naming the rows)");
    }
  }
  return os.str();
}

// --mode plan: the memory plan of a training run with these options, for --world-size ranks, without
// launching them; with --device-memory, the largest micro-batch that fits for each recompute mode.
// --mode plan --data F: for example data (token format version 3), what packing does and the
// target tokens per optimizer step (the loss's denominator), over the steps of the first epoch.
void plan_targets(Comm& comm, const Options& o, ModelConfig mc, int dp) {
  const std::unique_ptr<TokenDataset> data = open_data(comm, o, mc);
  TrainConfig tc = o.train;
  std::string note;
  if (const std::string why = apply_data_settings(tc, *data, o.data_given, &note); !why.empty())
    throw CollectiveError(0, why);
  if (!tc.examples) {
    log_info(comm, "data: every token a target: " + std::to_string(int64_t{tc.global_batch} * tc.seq_len) +
                       " per step (" + std::to_string(tc.global_batch) + " x " + std::to_string(tc.seq_len) + ")");
    return;
  }
  std::unique_ptr<PackedBatches> pb;
  agree(comm, [&] {
    pb = std::make_unique<PackedBatches>(*data, PackOptions{tc.seq_len, tc.pack, tc.max_length, tc.train_on}, tc.seed,
                                         tc.global_batch, tc.shuffle);
  });
  for (Split sp : {Split::Train, Split::Val})
    if (pb->stream(sp).rows() == 0)
      throw CollectiveError(0, std::string("the ") + (sp == Split::Train ? "train" : "validation") + " split of " +
                                   data->path() + " has no example to " + (sp == Split::Train ? "train" : "evaluate") +
                                   " on (" + std::to_string(pb->stream(sp).stats().examples) +
                                   " examples; training refuses it too)");
  const PackStats& p = pb->stream(Split::Train).stats();
  const int64_t steps = std::max<int64_t>(1, p.rows / tc.global_batch);
  int64_t lo = INT64_MAX, hi = 0, sum = 0;
  for (int64_t k = 0; k < steps && p.rows > 0; ++k) {
    const int64_t n = pb->batch_targets(Split::Train, k);
    lo = std::min(lo, n);
    hi = std::max(hi, n);
    sum += n;
  }
  char b[160];
  std::snprintf(b, sizeof b, "%.1f (min %lld, max %lld over the first epoch's %lld steps; %.1f%% of %lld positions)",
                static_cast<double>(sum) / static_cast<double>(steps), static_cast<long long>(p.rows ? lo : 0),
                static_cast<long long>(hi), static_cast<long long>(steps),
                100.0 * static_cast<double>(sum) / static_cast<double>(steps) / (double(tc.global_batch) * tc.seq_len),
                static_cast<long long>(int64_t{tc.global_batch} * tc.seq_len));
  log_info(comm, "data: " + std::to_string(p.examples) + " training examples, " + std::to_string(p.packed) + " in " +
                     std::to_string(p.rows) + " rows of " + std::to_string(tc.seq_len) + " (--pack " +
                     pack_mode_name(tc.pack) + ", --train-on " + train_on_name(tc.train_on) + "; " +
                     std::to_string(p.truncated) + " truncated, " + std::to_string(p.dropped_long) + " dropped as too long, " +
                     std::to_string(p.dropped_no_target) + " without a target); target tokens per step: " + b +
                     "; per data-parallel rank " + std::to_string(tc.global_batch / std::max(1, dp)) + " rows a step");
}

void run_plan(Comm& comm, const Topology& topo, const Options& o) {
  const ModelConfig mc = resolve_model_config(comm, o.model);
  const int W = o.plan_world_size > 0 ? o.plan_world_size : comm.world_size();
  const bool cuda = o.run.device == DeviceChoice::Cuda;
  // No plan for a run that training refuses: fp8 with MoE, fp8 on the CPU (a plan is a GPU plan
  // only with '--device cuda').
  all_ok(comm, !(o.train.fp8 && mc.is_moe()), fp8_moe_refusal(mc));
  all_ok(comm, !(o.train.fp8 && !cuda),
         fp8_cpu_refusal("this plan is for the CPU; give '--device cuda' for a GPU plan"));
  all_ok(comm, !(o.run.shard_group_node && W != comm.world_size()),
         "option '--shard-group-size' 'node' with '--world-size " + std::to_string(W) +
             "': the ranks per node of the planned job are not known here (only this launch's); give the number "
             "of ranks per node instead");
  // --shard-group-size: shards over G ranks ('node': this launch's ranks per node), TP groups included.
  all_ok(comm, o.plan_world_size > 0 || W % o.tp == 0,
         "option '--tp' (" + std::to_string(o.tp) + ") does not divide this launch's world size (" + std::to_string(W) +
             "): give the planned job's ranks with '--world-size'");
  all_ok(comm, o.plan_world_size > 0 || W % (int64_t{o.tp} * o.cp) == 0,
         "option '--cp' (" + std::to_string(o.cp) + ") x '--tp' (" + std::to_string(o.tp) +
             ") does not divide this launch's world size (" + std::to_string(W) +
             "): give the planned job's ranks with '--world-size'");
  MeshDims dims;
  agree(comm, [&] { dims = resolve_mesh_dims(o.shard_group_size, o.tp, o.cp, W, ranks_per_node(topo), o.pp, o.ep); });
  const int G = dims.fsdp() * dims.tp;
  MemoryPlanInput in{mc, o.train, W, o.train.precision, o.train.reduce_bf16, cuda, 0, 4, 0, o.train.overlap};
  in.mesh = dims;
  TrainConfig& t = in.train;
  // Training's geometry (geometry.h): no plan for a run that would be refused. Memory depends on the
  // micro-batch alone: given without --global-batch, it stands for the global batch (micro-batch x
  // dp, no accumulation; 64-bit, as the product may not fit an int).
  const bool mb_alone = t.micro_batch > 0 && !o.global_batch_given;
  const BatchOptions bo{mb_alone ? int64_t{t.micro_batch} * dims.dp() : int64_t{t.global_batch}, t.micro_batch, t.seq_len};
  const GeometryResult geo = resolve_geometry(bo, dims, mc);
  const bool batch_refused = t.micro_batch == 0 && geo.refusal.starts_with("option '--global-batch'");
  all_ok(comm, geo.ok(), geo.refusal + (batch_refused ? "; give '--micro-batch' (memory depends on it alone)" : ""));
  const std::string refused = training_refusal(dims, t.attention);  // what the mesh refuses at training
  all_ok(comm, refused.empty(), refused);
  t.micro_batch = geo.geometry.micro_batch;
  // The pipeline (--pp): its stages and schedule over the step's micro-batches, as training resolves them.
  std::string pp_why;
  in.pipeline = resolve_pipeline(mc, dims.pp, t.pp, geo.geometry.accum, &pp_why);
  all_ok(comm, pp_why.empty(), pp_why);
  in.microbatches = geo.geometry.accum;
  // Token data is memory-mapped (page cache, not resident per rank): not part of the plan.
  if (cuda) {
    in.runtime_bytes = kGpuRuntimeEstimate;
  } else {  // this process with a CPU backend and its threads: what a training rank holds before allocating
    auto be = make_cpu_backend<float>();
    in.runtime_bytes = current_rss_bytes();
    comm.all_reduce(&in.runtime_bytes, 1, ReduceOp::Max);
  }
  std::ostringstream os;
  const std::string head =
      "memory plan per rank: '" + o.model + "' (" + std::to_string(mc.num_params()) + " parameters" +
          (mc.is_moe() ? ", " + std::to_string(mc.num_active_params()) + " active per token" : std::string()) + "), " +
      std::to_string(W) + " ranks" +
      (dims.pp > 1 ? " (PP " + std::to_string(dims.pp) + " x " + std::to_string(W / dims.pp) + " ranks per stage)"
                   : std::string()) +
      (G * dims.pp != W ? " (shard group size " + std::to_string(G) + ")" : std::string()) +
                               (dims.tp > 1 ? ", TP " + std::to_string(dims.tp) : std::string()) +
                               (dims.cp > 1 ? ", CP " + std::to_string(dims.cp) + " (" + cp_comm_name(o.train.cp_comm) +
                                                  "; FSDP over dp_shard " + std::to_string(dims.dp_shard) + " x cp " +
                                                  std::to_string(dims.cp) + ")"
                                            : std::string()) +
                               ", " +
                               (o.train.fp8 ? "fp8" : precision_name(o.train.precision)) + ", micro-batch " +
                               std::to_string(t.micro_batch) + " x " + std::to_string(t.seq_len) + " tokens, " +
                               (cuda ? "GPU device memory" : "CPU memory");
  // Every stage's plan with the schedule asked for (one plan without a pipeline); with a pipeline
  // then the total per stage for each schedule.
  os << format_plans(plan_stages(in), [&](const MemoryPlan& p) { return head + p.stage_schedule; });
  if (dims.pp > 1) os << schedule_totals(in, dims.pp, geo.geometry.accum);
  if (!o.device_memory.empty()) os << device_memory_fits(in, o.device_memory);
  log_info(comm, os.str());
  if (!o.data.empty()) plan_targets(comm, o, mc, dims.dp());
  // --out FILE: the resolved model as a Hugging Face config.json (what a peer program, e.g.
  // tests/gpu/peer.py, builds the same model from). Rank 0 writes; all ranks agree on the outcome.
  if (!o.out.empty()) {
    bool wrote = true;
    if (comm.rank() == 0) {
      std::ofstream f(o.out);
      f << to_hf_json(mc, o.train.precision == Precision::BF16 ? "bfloat16" : "float32") << "\n";  // torch_dtype: --precision
      f.close();
      wrote = static_cast<bool>(f);
    }
    all_ok(comm, wrote, "option '--out': cannot write the model's config.json to '" + o.out + "'");
    log_info(comm, "wrote the model's Hugging Face config.json to " + o.out);
  }
}

// --mode inspect: step, world size, config and per-unit shard tables of a checkpoint; optionally
// one parameter gathered at the current world size and written as raw float32.
void run_inspect(Comm& comm, const Options& o) {
  CheckpointInfo info = read_checkpoint_info(comm, o.checkpoint);
  // What is printed passes the loaders' checks first: the model config as load_model reads it, the
  // unit and parameter tables against that model's layout (export and resume refuse the same).
  ModelConfig mc;
  agree(comm, [&] {
    try {
      mc = from_canonical_json(info.model_config);
    } catch (const std::exception& e) {
      throw std::runtime_error("checkpoint '" + o.checkpoint + "': attribute 'model_config': " + e.what());
    }
    validate(mc, "in checkpoint '" + o.checkpoint + "' (attribute 'model_config')");
    try {
      check_checkpoint_layout(info, ShardPlan::build(llama_units(mc), 1));
    } catch (const std::exception& e) {
      throw std::runtime_error("checkpoint '" + o.checkpoint + "': " + e.what());
    }
  });
  std::ostringstream os;
  os << "checkpoint " << info.path << "\n"
     << "  format_version " << info.format_version << ", " << info.program_version << "\n"
     << "  step " << info.step << ", tokens_seen " << info.tokens_seen << ", world_size " << info.world_size << "\n"
     << "  model_config " << info.model_config << "\n"
     << "  train_config " << info.train_config << "\n"
     << "  data_position " << info.data_position << ", rng_state " << info.rng_state << "\n"
     << "  data " << info.data_info << "\n"
     << "  spike_stats " << info.spikes.loss.size() << " of " << kSpikeWindow << " steps in the window, "
     << info.spikes.skipped_updates << " updates skipped"
     << (info.format_version < 3 ? " (none recorded: format version " + std::to_string(info.format_version) + ")" : "")
     << "\n"
     << "  " << info.file_bytes << " bytes; "
     << (info.metadata_verified ? "every attribute and table matches its CRC32 (metadata_crc32)"
                                : "format version 1: attributes not checksummed")
     << "; tensor data is verified when loaded (--dump-param)\n";
  if (info.pp > 1) {
    os << "  saved by a pipeline-parallel run: " << saved_layout_words(info) << " (attributes 'mesh' and 'pipeline', "
       << "chunk bounds [";
    for (size_t i = 0; i < info.pp_bounds.size(); ++i) os << (i ? ", " : "") << info.pp_bounds[i];
    os << "]; each unit written by the ranks of its stage; docs/checkpoint-format.md, version 6)\n";
  } else if (info.cp > 1)
    os << "  saved by a context-parallel run: " << saved_layout_words(info) << " (attribute 'mesh'; "
       << (info.tp > 1 ? "the tensors are canonical, in rows of its world" : "the rows of its shard group, dp_shard x cp")
       << "; docs/checkpoint-format.md, version 5)\n";
  else if (info.tp > 1)
    os << "  saved by a tensor-parallel run: tp " << info.tp << " x dp_shard " << info.tp_dp_shard << " x dp_replicate "
       << info.tp_dp_replicate << "; the tensors are canonical, in rows of its " << info.world_size
       << " ranks (docs/checkpoint-format.md, version 4)\n";
  if (info.format_version >= 7)  // a mixture-of-experts model's file: the saving run's whole mesh
    os << "  mixture-of-experts model (version 7): saved at pp " << info.pp << ", tp " << info.tp << ", cp " << info.cp
       << ", ep " << info.ep << " (attribute 'mesh'; the rows do not depend on ep; docs/checkpoint-format.md)\n";
  for (auto& u : info.units) {
    os << "  unit " << u.name << ": numel " << u.numel << ", shard_size " << u.shard_size << ", padded_numel "
       << u.padded_numel << (u.stage >= 0 ? ", stage " + std::to_string(u.stage) : std::string()) << "\n";
    if (info.tp > 1) {
      os << "    TP-local buffer " << u.tp.local_numel << " elements, shard_size " << u.tp.local_shard_size
         << " over " << (info.cp > 1 ? "dp_shard x cp " : "dp_shard ") << u.tp.shards.size() << "; tp_table (split, degree, padded_rows, local_offset):";
      for (auto& r : u.tp.params) os << " (" << r[0] << ", " << r[1] << ", " << r[2] << ", " << r[3] << ")";
      os << "\n";
    }
    for (auto& p : u.params) {
      os << "    param " << p.spec.name << " [";
      for (size_t i = 0; i < p.spec.shape.size(); ++i) os << (i ? ", " : "") << p.spec.shape[i];
      os << "] offset " << p.offset << " numel " << p.numel << "\n";
    }
    for (size_t r = 0; r < u.ranks.size(); ++r)
      os << "    rank " << r << ": start " << u.ranks[r].start << ", valid " << u.ranks[r].valid << ", padding "
         << u.ranks[r].padding << "\n";
  }
  log_info(comm, os.str());
  if (o.dump_param.empty()) return;
  auto be = make_cpu_backend<float>();
  ShardedState<float> f(*be, comm, ShardPlan::build(llama_units(mc), comm.world_size()));
  load_checkpoint(comm, o.checkpoint, sharded_params(f), mc, &info);
  // "all": every parameter, each to <dump-out>/<name>.bin (dump-out is a directory).
  const bool all = o.dump_param == "all";
  std::vector<std::string> names;
  for (auto& u : f.plan().units)
    for (auto& p : u.params)
      if (all || p.spec.name == o.dump_param) names.push_back(p.spec.name);
  all_ok(comm, !names.empty(), "option '--dump-param': no parameter named '" + o.dump_param + "'");
  std::string err;
  if (all && comm.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(o.dump_out, ec);
    if (ec) err = "option '--dump-out': cannot create directory '" + o.dump_out + "': " + ec.message();
  }
  all_ok(comm, err.empty(), err);
  for (const std::string& name : names) {
    std::vector<float> v = f.gather_param(name);  // collective: every rank, same order
    const std::string out = all ? (std::filesystem::path(o.dump_out) / (name + ".bin")).string() : o.dump_out;
    if (comm.rank() == 0) {
      try {
        write_file_atomic(out, std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)), false,
                          "option '--dump-out'");
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    all_ok(comm, err.empty(), err);
    if (!all)
      log_info(comm, "wrote " + name + " (" + std::to_string(v.size()) + " float32, gathered over " +
                         std::to_string(comm.world_size()) + " ranks) to " + out);
  }
  if (all)
    log_info(comm, "wrote " + std::to_string(names.size()) + " parameters (float32, gathered over " +
                       std::to_string(comm.world_size()) + " ranks) to " + o.dump_out + "/<name>.bin");
}

// Test hook SHARDTRAIN_TEST_MODE_PAUSE=FLAG (docs/errors.md): after the options are parsed and the
// signal dispositions of the mode set, each rank creates FLAG.<rank> (holding its process id) and
// waits, at most 60 s, until it is removed; the tests send signals meanwhile.
void test_mode_pause(int rank) {
  const char* v = std::getenv("SHARDTRAIN_TEST_MODE_PAUSE");
  if (v == nullptr || *v == '\0') return;
  wait_while_flag(std::string(v) + "." + std::to_string(rank));
}

}  // namespace

int main(int argc, char** argv) {
  // First the fatal-signal report; then a possible re-execution with faster OpenBLAS kernels, which
  // must happen before MPI_Init (and before anything else starts).
  install_fatal_signal_handlers();  // a fault anywhere from here on prints a backtrace with the rank
  select_blas_kernels(argv);
  Runtime rt(&argc, &argv);
  Comm& comm = rt.comm();
  const Topology& topo = rt.topo();
  fatal_signal_mpi_ready(topo.rank, topo.world_size);
  install_stop_handlers();
  try {
    all_ok(comm, blas_selection().usable, blas_selection().error);  // every kernel set failed the GEMM check
    Options o = parse_options(comm, argc, argv);
    comm.set_collective_timeout(o.collective_timeout);
    if (o.help) {
      log_info(comm, o.help_text + "\n" +
                         (cuda_built() ? "CUDA backend: built (cuBLAS, NCCL; --device cuda)"
                                       : "CUDA backend: not built (no nvcc at build time; --device cpu only)"));
      return 0;
    }
    if (o.run.mode != Mode::Train) end_on_stop_signals();  // training keeps SIGTERM's meaning: save, exit 75
    test_mode_pause(comm.rank());
    switch (o.run.mode) {
      case Mode::Prepare: run_prepare(comm, o); break;
      case Mode::Tokenizer: run_tokenizer(comm, o); break;
      case Mode::Plan: run_plan(comm, topo, o); break;
      case Mode::Inspect: run_inspect(comm, o); break;
      case Mode::Export:
        export_hf(comm, ExportOptions{o.checkpoint, o.out, parse_export_dtype(o.dtype), parse_size(o.max_shard_size)});
        break;
      case Mode::Import:  // a step-0 checkpoint records the default settings
        import_hf(comm, o.hf_dir, o.out, train_config_json(TrainConfig()), o.data.empty() ? std::string() : o.data.front());
        break;
      case Mode::Generate: {
        std::string text = generate(comm, GenerateOptions{o.checkpoint, o.prompt, o.max_new_tokens, o.temperature,
                                                          o.top_k, o.train.seed, o.dump_logits, o.prompt_ids, o.print_ids});
        log_info(comm, o.prompt + text);
        break;
      }
      case Mode::Train: run_train(comm, topo, o); break;
    }
    comm.barrier();
    return 0;
  } catch (const Preempted& e) {
    // Every rank stopped at the same step (the stop flag rides on the step's all-reduce).
    log_info(comm, std::string("shardtrain: ") + e.what() + "; exit status " + std::to_string(kExitPreempted));
    comm.barrier();
    return kExitPreempted;
  } catch (const CollectiveError& e) {
    // Every rank reached the same decision: each exits non-zero with the same message.
    // Print before anyone exits: mpirun tears the job down at the first non-zero exit.
    log_error(topo.rank, topo.world_size, e.what());
    comm.barrier();
    return 1;
  } catch (const std::exception& e) {
    // A failure on this rank alone, outside any agreement: the others may be waiting in a
    // collective, so end the whole job rather than leave it hanging.
    log_error(topo.rank, topo.world_size, std::string(e.what()) + " (unrecoverable on this rank; aborting the job)");
    Runtime::abort(1);
  }
}
