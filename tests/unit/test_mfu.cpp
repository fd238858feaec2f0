// MFU and progress (mfu.h, train.h flops_per_token): the GPU peak table by exact device name, the
// PaLM FLOP count against a hand count, the ETA and the step line's tail.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "shardtrain/model/config.h"
#include "shardtrain/train/mfu.h"
#include "shardtrain/train/train.h"

namespace st = shardtrain;

TEST(Mfu, KnownGpusByExactName) {
  // Dense bf16 and plain FP32 peaks (data sheets and whitepapers; src/train/mfu.cpp).
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA H100 80GB HBM3", true), 989.4e12);  // SXM5
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA H100 80GB HBM3", false), 66.9e12);
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA H100 PCIe", true), 756.5e12);
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA H100 PCIe", false), 51.2e12);
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA H100 NVL", true), 835.5e12);
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA H100 NVL", false), 60e12);
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA H200", true), 989.4e12);
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA H200", false), 66.9e12);
  for (const char* a100 : {"NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB",
                           "NVIDIA A100 80GB PCIe"}) {
    EXPECT_DOUBLE_EQ(st::gpu_peak_flops(a100, true), 312e12) << a100;
    EXPECT_DOUBLE_EQ(st::gpu_peak_flops(a100, false), 19.5e12) << a100;
  }
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA L40S", true), 362.05e12);
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA L40S", false), 91.6e12);
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("NVIDIA L4", true), 121e12);
  // Case and whitespace are normalised; nothing else is.
  EXPECT_DOUBLE_EQ(st::gpu_peak_flops("  nvidia   h100 NVL ", true), 835.5e12);
}

TEST(Mfu, H100VariantsAreDistinct) {
  // The old substring match gave the NVL (and any "H100 ...") the SXM's 989 TFLOP/s.
  const st::GpuPeak* sxm = st::find_gpu_peak("NVIDIA H100 80GB HBM3");
  const st::GpuPeak* pcie = st::find_gpu_peak("NVIDIA H100 PCIe");
  const st::GpuPeak* nvl = st::find_gpu_peak("NVIDIA H100 NVL");
  ASSERT_TRUE(sxm && pcie && nvl);
  EXPECT_NE(sxm, pcie);
  EXPECT_NE(sxm, nvl);
  EXPECT_NE(pcie, nvl);
  EXPECT_NE(sxm->bf16_tflops, nvl->bf16_tflops);
  EXPECT_NE(pcie->bf16_tflops, nvl->bf16_tflops);
}

TEST(Mfu, UnknownGpusGetNoNumber) {
  for (const char* name : {"Tesla T4", "NVIDIA H100", "NVIDIA H100 PCIe-2", "H200", "NVIDIA A100", "NVIDIA H20",
                           "", "   ", "NVIDIA GeForce RTX 4090 D"}) {
    EXPECT_EQ(st::find_gpu_peak(name), nullptr) << name;
    EXPECT_EQ(st::gpu_peak_flops(name, true), 0.0) << name;
    EXPECT_EQ(st::gpu_peak_flops(name, false), 0.0) << name;
  }
  // A known device whose fp32 figure is not in its data sheet: fp32 MFU is unknown, bf16 known.
  EXPECT_GT(st::gpu_peak_flops("NVIDIA B200", true), 0.0);
  EXPECT_EQ(st::gpu_peak_flops("NVIDIA B200", false), 0.0);
  EXPECT_EQ(st::unknown_peak_message("Tesla T4"), "MFU n/a (unknown peak for Tesla T4; --peak-tflops sets it)");
  EXPECT_LT(st::mfu_percent(1000, 1e6, 0), 0.0);
  EXPECT_LT(st::mfu_percent(1000, 1e6, std::numeric_limits<double>::quiet_NaN()), 0.0);
  const std::string tail = st::step_line_tail(st::mfu_percent(1000, 1e6, 0), 2.5, 61, 2048);
  EXPECT_EQ(tail, "MFU n/a | 2.5 s | ETA 0:01:01 | 2048 tokens");
  EXPECT_EQ(tail.find_first_of("0123456789"), tail.find("2.5"));  // no number before the elapsed time
}

TEST(Mfu, TableEntriesAreComplete) {
  for (const st::GpuPeak& p : st::gpu_peak_table()) {
    EXPECT_GT(p.bf16_tflops, 0.0) << p.name;
    EXPECT_GE(p.fp32_tflops, 0.0) << p.name;
    EXPECT_LT(p.fp32_tflops, p.bf16_tflops) << p.name;  // tensor cores are faster than CUDA cores
    EXPECT_TRUE(p.source && *p.source) << p.name;
    EXPECT_EQ(st::find_gpu_peak(p.name), &p) << p.name << ": a duplicate or shadowed name";
  }
}

TEST(Mfu, MfuIsTokensTimesFlopsOverPeak) {
  // --peak-tflops 1 on 2 ranks: peak 2e12.
  EXPECT_DOUBLE_EQ(st::mfu_percent(5000, 4e6, 2e12), 100.0 * 5000 * 4e6 / 2e12);
  EXPECT_EQ(st::step_line_tail(1.0, 12.34, 3725, 20480), "MFU 1.0% | 12.3 s | ETA 1:02:05 | 20.5k tokens");
}

// The PaLM count (6 N + 12 L H Q T) against a hand count of a small GQA/SwiGLU config.
TEST(Mfu, FlopsPerTokenHandCount) {
  st::ModelConfig c;
  c.vocab_size = 258;
  c.hidden_size = 64;
  c.intermediate_size = 172;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;  // head_dim 16
  c.num_key_value_heads = 2;  // GQA: K and V are 64 x 32
  c.tie_word_embeddings = false;
  // Per layer: q 64x64 = 4096, k 64x32 = 2048, v 2048, o 4096 -> 12288; SwiGLU gate, up, down
  // 3 x 64 x 172 = 33024; two RMSNorm weights 128 -> 45440. Two layers 90880, final norm 64,
  // LM head 258 x 64 = 16512; the input embedding (a lookup) is left out: N = 107456.
  // 6 N = 644736. Attention at T = 32: 12 x L 2 x H 4 x Q 16 x T 32 = 49152. Sum 693888.
  EXPECT_DOUBLE_EQ(st::flops_per_token(c, 32), 693888.0);
  // Tied: the one [V, C] matrix counts once, as the LM head: the same count.
  c.tie_word_embeddings = true;
  EXPECT_DOUBLE_EQ(st::flops_per_token(c, 32), 693888.0);
  // Attention is linear in T and not halved for the causal mask.
  EXPECT_DOUBLE_EQ(st::flops_per_token(c, 64) - st::flops_per_token(c, 32), 49152.0);
  // head_dim given wider than C / NH: the query width NH x HD counts (q, o and K/V grow in N too).
  c.head_dim_override = 24;
  const double q = 4 * 24, kv = 2 * 24;
  const double N = 2 * (64 * q + 2 * 64 * kv + q * 64 + 3 * 64 * 172 + 128) + 64 + 258 * 64;
  EXPECT_DOUBLE_EQ(st::flops_per_token(c, 32), 6 * N + 12 * 2 * q * 32);
}

TEST(Mfu, FlopsPerTokenPresets) {
  for (const char* name : {"llama-125m", "llama-350m", "tiny", "llama-1b", "llama-8b"}) {
    const st::ModelConfig c = st::preset(name);
    const double C = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, L = c.num_hidden_layers;
    const double Q = c.num_attention_heads * c.head_dim(), KV = c.num_key_value_heads * c.head_dim();
    const double N = L * (2 * C + C * Q + 2 * C * KV + Q * C + 3 * C * I) + C + V * C;  // head, not the lookup
    for (int T : {64, 1024}) EXPECT_DOUBLE_EQ(st::flops_per_token(c, T), 6 * N + 12 * L * Q * T) << name << " T=" << T;
  }
}

TEST(Mfu, EtaFormatting) {
  EXPECT_EQ(st::format_eta(0), "0:00:00");
  EXPECT_EQ(st::format_eta(59.4), "0:00:59");
  EXPECT_EQ(st::format_eta(59.6), "0:01:00");
  EXPECT_EQ(st::format_eta(3599), "0:59:59");
  EXPECT_EQ(st::format_eta(3600), "1:00:00");
  EXPECT_EQ(st::format_eta(100000), "27:46:40");
  EXPECT_EQ(st::format_eta(-1), "n/a");
  EXPECT_EQ(st::format_eta(std::numeric_limits<double>::infinity()), "n/a");
  EXPECT_EQ(st::format_eta(std::numeric_limits<double>::quiet_NaN()), "n/a");
}

TEST(Mfu, EtaFromStepsAfterTheFirst) {
  EXPECT_EQ(st::eta_seconds(0, 0, 10), -1.0);   // only the first (warm-up) step has run
  EXPECT_EQ(st::eta_seconds(0, 0, 0), 0.0);     // nothing left
  EXPECT_DOUBLE_EQ(st::eta_seconds(4.0, 8, 90), 45.0);  // 0.5 s per step x 90
  EXPECT_EQ(st::eta_seconds(4.0, 8, 0), 0.0);
}

TEST(Mfu, TokenCounts) {
  EXPECT_EQ(st::format_count(0), "0");
  EXPECT_EQ(st::format_count(9999), "9999");
  EXPECT_EQ(st::format_count(10000), "10.0k");
  EXPECT_EQ(st::format_count(20480), "20.5k");
  EXPECT_EQ(st::format_count(999999), "1.00M");
  EXPECT_EQ(st::format_count(1234567), "1.23M");
  EXPECT_EQ(st::format_count(123456789), "123M");
  EXPECT_EQ(st::format_count(4100000000000LL), "4.10T");
}
