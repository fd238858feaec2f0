// The GPU peak table, the MFU / ETA / tokens part of the step line (see mfu.h).
#include "shardtrain/train/mfu.h"

#include <cctype>
#include <cmath>
#include <cstdio>

namespace shardtrain {

// Dense bf16 (tensor cores, fp32 accumulation, no 2:4 sparsity: NVIDIA's data sheets print the
// sparse figure, twice this, with an asterisk) and plain FP32 (CUDA cores; TF32 is a tensor-core
// format and is not what --precision fp32 runs) peaks, TFLOP/s, at the boost clock, per GPU.
// Names are cudaDeviceProp::name (what nvidia-smi prints). Confidence: "high" = the figure is
// printed in the cited document and the name is the one the driver reports on that product;
// "medium" = the figure or the exact name string was taken from memory of the cited document,
// not re-read for this table. Unknown (0): not in the document.
//
// | name                     | bf16    | fp32 | source                                                     | confidence |
// | NVIDIA H100 80GB HBM3    | 989.4   | 66.9 | NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), | high      |
// |   (H100 SXM5)            |         |      |   table "H100 SXM5": BF16 989.4 / 1978.9*, FP32 66.9;        |           |
// |                          |         |      |   H100 data sheet: 1,979* / 67                              |           |
// | NVIDIA H100 PCIe         | 756.5   | 51.2 | same whitepaper, "H100 PCIe": 756.5 / 1513*, FP32 51.2      | high       |
// | NVIDIA H100 NVL          | 835.5   | 60   | H100 data sheet (nvidia.com/en-us/data-center/h100), H100   | medium     |
// |                          |         |      |   NVL column, per GPU: BF16 1,671*, FP32 60 (early sheets   |            |
// |                          |         |      |   gave the NVL pair's sum)                                  |            |
// | NVIDIA H200              | 989.4   | 66.9 | H200 data sheet (nvidia.com/en-us/data-center/h200), SXM:  | high       |
// |                          |         |      |   BF16 1,979*, FP32 67; same GH100 die and clocks as H100   |            |
// |                          |         |      |   SXM5, whose whitepaper gives the unrounded 989.4 / 66.9   |            |
// | NVIDIA H200 NVL          | 835.5   | 60   | H200 data sheet, H200 NVL column: 1,671*, FP32 60           | medium (name) |
// | NVIDIA GH200 480GB       | 989.4   | 66.9 | NVIDIA GH200 Grace Hopper Superchip data sheet: FP32 67,    | medium     |
// | NVIDIA GH200 144G HBM3e  |         |      |   BF16 1,979* (the H100 SXM5 die)                           | medium (name) |
// | NVIDIA A100-SXM4-40GB    | 312     | 19.5 | NVIDIA A100 Tensor Core GPU data sheet: BF16 312 / 624*,    | high       |
// | NVIDIA A100-SXM4-80GB    |         |      |   FP32 19.5 (the same for SXM4 and PCIe, 40 and 80 GB)      |            |
// | NVIDIA A100-PCIE-40GB    |         |      |                                                             |            |
// | NVIDIA A100 80GB PCIe    |         |      |                                                             |            |
// | NVIDIA A10               | 125     | 31.2 | NVIDIA A10 Tensor Core GPU data sheet: BF16 125 / 250*      | high       |
// | NVIDIA A30               | 165     | 10.3 | NVIDIA A30 Tensor Core GPU data sheet: BF16 165 / 330*      | medium     |
// | NVIDIA L40S              | 362.05  | 91.6 | NVIDIA L40S data sheet: BF16 362.05 / 733*, FP32 91.6       | high       |
// | NVIDIA L40               | 181.05  | 90.5 | NVIDIA L40 data sheet: BF16 181.05 / 362.1*, FP32 90.5      | medium     |
// | NVIDIA L4                | 121     | 30.3 | NVIDIA L4 Tensor Core GPU data sheet: BF16 242*, FP32 30.3  | high       |
// | NVIDIA B200              | 2250    | 0    | NVIDIA HGX B200 / DGX B200 data sheet, per GPU: FP16/BF16   | medium     |
// |                          |         |      |   4.5 PFLOPS* (sparse); FP32 not taken from it: unknown     |            |
// | NVIDIA GeForce RTX 4090  | 165.2   | 82.6 | NVIDIA Ada GPU Architecture whitepaper: BF16 with FP32      | medium     |
// |                          |         |      |   accumulate 165.2 / 330.4* (GeForce: half the FP16-accum.  |            |
// |                          |         |      |   rate), FP32 82.6                                          |            |
// | NVIDIA GeForce RTX 3090  | 71      | 35.6 | NVIDIA Ampere GA102 GPU Architecture whitepaper: BF16 with  | medium     |
// |                          |         |      |   FP32 accumulate 71 / 142*, FP32 35.6                      |            |
// | NVIDIA RTX A6000         | 154.8   | 38.7 | same GA102 whitepaper, RTX A6000: 154.8 / 309.7*, FP32 38.7 | medium     |
// A device not listed gets no MFU ("MFU n/a (unknown peak for ...; --peak-tflops sets it)"); a
// wrong figure is worse than none, so an entry goes in only with its source.
const std::vector<GpuPeak>& gpu_peak_table() {
  static const char* const kHopperWp = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022)";
  static const char* const kH100Ds = "NVIDIA H100 Tensor Core GPU data sheet (NVL column, per GPU)";
  static const char* const kH200Ds = "NVIDIA H200 Tensor Core GPU data sheet";
  static const char* const kGh200Ds = "NVIDIA GH200 Grace Hopper Superchip data sheet";
  static const char* const kA100Ds = "NVIDIA A100 Tensor Core GPU data sheet";
  static const char* const kAdaWp = "NVIDIA Ada GPU Architecture whitepaper";
  static const char* const kGa102Wp = "NVIDIA Ampere GA102 GPU Architecture whitepaper";
  static const std::vector<GpuPeak> t = {
      {"NVIDIA H100 80GB HBM3", 989.4, 66.9, kHopperWp},  // H100 SXM5
      {"NVIDIA H100 PCIe", 756.5, 51.2, kHopperWp},
      {"NVIDIA H100 NVL", 835.5, 60.0, kH100Ds},
      {"NVIDIA H200", 989.4, 66.9, kH200Ds},  // SXM
      {"NVIDIA H200 NVL", 835.5, 60.0, kH200Ds},
      {"NVIDIA GH200 480GB", 989.4, 66.9, kGh200Ds},
      {"NVIDIA GH200 144G HBM3e", 989.4, 66.9, kGh200Ds},
      {"NVIDIA A100-SXM4-40GB", 312.0, 19.5, kA100Ds},
      {"NVIDIA A100-SXM4-80GB", 312.0, 19.5, kA100Ds},
      {"NVIDIA A100-PCIE-40GB", 312.0, 19.5, kA100Ds},
      {"NVIDIA A100 80GB PCIe", 312.0, 19.5, kA100Ds},
      {"NVIDIA A10", 125.0, 31.2, "NVIDIA A10 Tensor Core GPU data sheet"},
      {"NVIDIA A30", 165.0, 10.3, "NVIDIA A30 Tensor Core GPU data sheet"},
      {"NVIDIA L40S", 362.05, 91.6, "NVIDIA L40S GPU data sheet"},
      {"NVIDIA L40", 181.05, 90.5, "NVIDIA L40 GPU data sheet"},
      {"NVIDIA L4", 121.0, 30.3, "NVIDIA L4 Tensor Core GPU data sheet"},
      {"NVIDIA B200", 2250.0, 0.0, "NVIDIA HGX B200 data sheet (per GPU)"},
      {"NVIDIA GeForce RTX 4090", 165.2, 82.6, kAdaWp},
      {"NVIDIA GeForce RTX 3090", 71.0, 35.6, kGa102Wp},
      {"NVIDIA RTX A6000", 154.8, 38.7, kGa102Wp},
  };
  return t;
}

namespace {
std::string normalise(const std::string& s) {
  std::string out;
  bool space = false;
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (std::isspace(c)) {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += static_cast<char>(std::tolower(c));
  }
  return out;
}
std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
}  // namespace

const GpuPeak* find_gpu_peak(const std::string& device_name) {
  const std::string want = normalise(device_name);
  if (want.empty()) return nullptr;
  for (const GpuPeak& p : gpu_peak_table())
    if (normalise(p.name) == want) return &p;
  return nullptr;
}

double gpu_peak_flops(const std::string& device_name, bool bf16) {
  const GpuPeak* p = find_gpu_peak(device_name);
  if (!p) return 0;
  return (bf16 ? p->bf16_tflops : p->fp32_tflops) * 1e12;
}

std::string unknown_peak_message(const std::string& device) {
  return "MFU n/a (unknown peak for " + device + "; --peak-tflops sets it)";
}

std::string format_eta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 3.6e12) return "n/a";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  char b[48];
  std::snprintf(b, sizeof b, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return b;
}

std::string format_count(int64_t n) {
  if (n < 10000) return std::to_string(n);
  static const char* const unit = "kMGTPE";
  double v = static_cast<double>(n);
  int u = -1;
  while (v >= 999.5 && u < 5) {
    v /= 1000;
    ++u;
  }
  return fmt(v >= 99.95 ? "%.0f" : v >= 9.995 ? "%.1f" : "%.2f", v) + unit[u];
}

double mfu_percent(double tokens_per_s, double flops_per_token, double peak_flops) {
  if (!(peak_flops > 0) || !std::isfinite(peak_flops)) return -1;
  return 100.0 * tokens_per_s * flops_per_token / peak_flops;
}

std::string step_line_tail(double mfu_pct, double elapsed_s, double eta_s, int64_t tokens_seen) {
  return std::string("MFU ") + (mfu_pct >= 0 ? fmt("%.1f", mfu_pct) + "%" : "n/a") + " | " + fmt("%.1f", elapsed_s) +
         " s | ETA " + format_eta(eta_s) + " | " + format_count(tokens_seen) + " tokens";
}

double eta_seconds(double since_first_s, int64_t steps_since_first, int64_t remaining) {
  if (remaining <= 0) return 0;
  if (steps_since_first <= 0 || !(since_first_s >= 0)) return -1;
  return since_first_s / static_cast<double>(steps_since_first) * static_cast<double>(remaining);
}

}  // namespace shardtrain
