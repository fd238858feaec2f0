// attention_bench: causal attention forward and forward+backward TFLOP/s of the CUDA backend's bf16
// Backend::flash_attention_* (cuDNN's fused SDPA, then shardtrain's tiled kernels), on the shapes of
// the FlashAttention-2 paper's benchmark (Dao 2023, section 4.1): batch x seq = 16k tokens, hidden
// 2048 (heads = 2048 / head dim), head dims 64 and 128, seq 1024 .. 4096; plus llama-1b's GQA shape.
// FLOPs as that paper counts them: forward 4 * B * T^2 * NH * HD, halved for the causal mask;
// backward 2.5x the forward (so forward+backward is 3.5x).
// Time: the median of --reps timed repetitions after --warmup, each bracketed by
// Backend::synchronize() (host wall clock; the kernels of one repetition queue back to back).
// Prints one markdown table (kernel, shape, forward TFLOP/s, forward+backward TFLOP/s) and exits 0;
// without a CUDA device prints "attention_bench: skipped: no CUDA device (<reason>)" and exits 0.
// Usage: attention_bench [--reps N] [--warmup N]   (tests/gpu/run.sh stage 5d runs it)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/cuda.h"

namespace st = shardtrain;

namespace {

struct Shape {
  const char* name;
  int B, T, NH, NKV, HD;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 10, warmup = 3;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: attention_bench [--reps N] [--warmup N]\n");
      return 2;
    }
  }
  std::string why;
  if (st::cuda_device_count(&why) <= 0) {
    std::printf("attention_bench: skipped: no CUDA device (%s)\n", why.c_str());
    return 0;
  }
  try {
    auto ctx = st::CudaContext::create(0);
    auto be = st::make_cuda_backend<st::bf16>(*ctx);
    const std::vector<Shape> shapes{{"FA2 paper", 16, 1024, 32, 32, 64}, {"FA2 paper", 8, 2048, 32, 32, 64},
                                    {"FA2 paper", 4, 4096, 32, 32, 64},  {"FA2 paper", 16, 1024, 16, 16, 128},
                                    {"FA2 paper", 8, 2048, 16, 16, 128}, {"FA2 paper", 4, 4096, 16, 16, 128},
                                    {"llama-1b", 8, 2048, 32, 8, 64}};
    std::printf("| kernel | shape | B | T | NH | NKV | HD | forward TFLOP/s | forward+backward TFLOP/s |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    std::mt19937 g(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (const char* kernel : {"require", "off"}) {
      setenv("SHARDTRAIN_CUDNN_ATTENTION", kernel, 1);
      const char* kname = std::strcmp(kernel, "off") ? "cuDNN SDPA" : "tiled (own)";
      for (const Shape& s : shapes) {
        const size_t nq = static_cast<size_t>(s.B) * s.T * s.NH * s.HD, nk = static_cast<size_t>(s.B) * s.T * s.NKV * s.HD;
        const size_t ns = static_cast<size_t>(s.B) * s.NH * s.T;
        std::vector<st::bf16> hq(nq), hk(nk);
        for (auto& x : hq) x = st::math::f32_to_bf16(nd(g));
        for (auto& x : hk) x = st::math::f32_to_bf16(nd(g));
        st::Buffer<st::bf16> q(*be, nq), k(*be, nk), v(*be, nk), y(*be, nq), dy(*be, nq), dq(*be, nq), dk(*be, nk),
            dv(*be, nk);
        st::AccBuffer<st::bf16> lse(*be, ns), dsum(*be, ns);
        be->from_host(q.data(), hq.data(), nq);
        be->from_host(dy.data(), hq.data(), nq);
        be->from_host(k.data(), hk.data(), nk);
        be->from_host(v.data(), hk.data(), nk);
        const float scale = 1.0f / std::sqrt(static_cast<float>(s.HD));
        auto fwd = [&] {
          be->flash_attention_forward(y.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.NH, s.NKV, s.HD,
                                      scale);
        };
        auto bwd = [&] {
          be->flash_attention_backward(dq.data(), dk.data(), dv.data(), dsum.data(), dy.data(), q.data(), k.data(),
                                       v.data(), y.data(), lse.data(), s.B, s.T, s.NH, s.NKV, s.HD, scale);
        };
        auto time_of = [&](auto&& f) {
          for (int i = 0; i < warmup; ++i) f();
          be->synchronize();
          std::vector<double> t;
          for (int i = 0; i < reps; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            f();
            be->synchronize();
            t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          }
          return median(t);
        };
        const double flops_fwd = 4.0 * s.B * static_cast<double>(s.T) * s.T * s.NH * s.HD / 2;  // causal
        const double tf = time_of(fwd), tfb = time_of([&] {
          fwd();
          bwd();
        });
        std::printf("| %s | %s | %d | %d | %d | %d | %d | %.1f | %.1f |\n", kname, s.name, s.B, s.T, s.NH, s.NKV, s.HD,
                    flops_fwd / tf / 1e12, 3.5 * flops_fwd / tfb / 1e12);
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
