// MFU (model FLOPs utilization) and progress: the peak FLOP/s of a device, and the MFU / ETA /
// tokens-seen part of the step line. Pure, CUDA-independent code (tests/unit/test_mfu.cpp): the
// CUDA plugin only reports a device's name (cudaDeviceProp::name); the table is here.
//
// MFU = tokens/s x flops_per_token(T) / peak FLOP/s of the job (train.h: flops_per_token is
// PaLM's 6 N + 12 L H Q T). The job's peak is the sum of its ranks' peaks:
//   * GPU: the device's dense (no sparsity) bf16 tensor-core peak for --precision bf16, its plain
//     FP32 (CUDA-core, non-tensor, not TF32) peak for --precision fp32 -- cuBLAS runs fp32 GEMMs with
//     CUBLAS_COMPUTE_32F and no TF32 (cuda.h) -- from gpu_peak_table() by the device's exact name;
//   * CPU: measured at start-up (blas_select.h: measure_sgemm_rate): single-threaded sgemm
//     FLOP/s per thread with every thread of the rank running one at once, x the rank's threads;
//     not measured when ranks share cores (cpu_affinity.h: ThreadPlan::cores_shared);
//   * --peak-tflops X: X TFLOP/s per rank's device (GPU or CPU), replacing both.
// An unknown peak is 0: no MFU is printed ("MFU n/a") and the metrics rows leave `mfu` out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

// One device of the peak table. TFLOP/s, dense (without 2:4 sparsity). fp32_tflops 0: not known
// (an fp32 run on it reports MFU n/a).
struct GpuPeak {
  const char* name;    // cudaDeviceProp::name exactly as NVIDIA's driver reports it
  double bf16_tflops;  // dense bf16 tensor-core peak (fp32 accumulation)
  double fp32_tflops;  // plain FP32 (CUDA cores; not TF32)
  const char* source;  // the data sheet or whitepaper the figures come from
};

// The table (src/train/mfu.cpp has each entry's source and how sure it is).
const std::vector<GpuPeak>& gpu_peak_table();

// The entry whose name equals `device_name` once both are normalised (ASCII case folded, runs of
// whitespace made one space, leading/trailing whitespace dropped): an exact match, not a
// substring ("NVIDIA H100 NVL" is not "NVIDIA H100 PCIe", nor a "NVIDIA H100 80GB HBM3").
// nullptr for a device not in the table.
const GpuPeak* find_gpu_peak(const std::string& device_name);

// Peak FLOP/s of `device_name` for a run in bf16 (true) or fp32 (false); 0 when unknown.
double gpu_peak_flops(const std::string& device_name, bool bf16);

// The start-up line of an unknown peak: "MFU n/a (unknown peak for DEVICE; --peak-tflops sets it)".
std::string unknown_peak_message(const std::string& device);

// "h:mm:ss" of a duration, rounded to the second (hours not wrapped: "27:46:40"); "n/a" for a
// negative or non-finite value.
std::string format_eta(double seconds);

// A token count for the log: exact below 10000, else 3 significant digits with k, M, G, T
// ("20.5k", "1.23M", "4.10T").
std::string format_count(int64_t n);

// MFU in percent, or a negative value when peak_flops <= 0 (unknown).
double mfu_percent(double tokens_per_s, double flops_per_token, double peak_flops);

// The end of a step line: "MFU 3.4% | 12.3 s | ETA 0:01:02 | 20.5k tokens" -- "MFU n/a" when
// mfu_pct < 0, "ETA n/a" when eta_s < 0 (not known yet).
std::string step_line_tail(double mfu_pct, double elapsed_s, double eta_s, int64_t tokens_seen);

// ETA to --steps from the mean wall time per step since the end of this process's first step
// (which includes warm-up and is left out): `since_first_s` seconds for `steps_since_first`
// steps, `remaining` steps to go. -1 (unknown) when no step after the first has run, unless
// none remain (0).
double eta_seconds(double since_first_s, int64_t steps_since_first, int64_t remaining);

}  // namespace shardtrain
