// kernel_bench: the CUDA backend's memory-bound kernels against a device-to-device copy of the same
// bytes (issue 57, item 1: each elementwise kernel at >= 70% of a copy; the reductions reported).
// Shapes of the llama-350m bf16 step at T 1024 x 16 (docs/benchmarks.md, "GPU, 2026-12-04": N =
// 16,384 rows, C 1024, SwiGLU 2816, 16 heads of 64), or llama-1b's (--model llama-1b: T 2048 x 8,
// C 2048, 8192, 32 heads of 64 with 8 KV heads); the cross-entropy on one chunk of 1,024 rows of
// the vocabulary (32,000 or 128,256), as the trainer's chunked loss runs it.
//
// Bytes: what a kernel must read and write at least (each element of each array once: e.g.
// swiglu_forward 3 x n x 2 bytes in bf16, adamw 7 x n x 4: p, m, v, g read, p, m, v written), and
// for the copy 2 x its bytes; bandwidth = bytes / time, "of copy" = the kernel's bandwidth / the
// copy's at the kernel's own size (Backend::copy, cudaMemcpyAsync device to device).
// Time: the median of --reps repetitions of --inner back-to-back calls after --warmup, each
// repetition bracketed by Backend::synchronize() (host wall clock), divided by --inner.
// --gemm: instead, the float8 GEMMs (issue 57 item 3, Backend::linear_fp8: amax, scale, quantize
// and transposed copies included) against cuBLAS's bf16 GEMM of the same product (Backend::gemm, as
// model.h's linear() calls it), each role (forward, input gradient, weight gradient) of the
// projections of Llama-3-8B (C 4096, KV 1024, I 14336; 8,192 tokens) and llama-1b (C 2048, KV 512,
// I 8192; 16,384 tokens): TFLOP/s = 2 M N K / time, and fp8 / bf16 (issue 57's target >= 1.3x).
// Prints one markdown table and exits 0; without a CUDA device prints "kernel_bench: skipped: no CUDA
// device (<reason>)" and exits 0. Usage: kernel_bench [--gemm] [--model llama-350m|llama-1b] [--reps N]
// [--inner N] [--warmup N]   (tests/gpu/run.sh stage 5e runs it, both tables)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/backend/fp8_math.h"

namespace st = shardtrain;

namespace {

struct Shape {
  const char* model;
  int N, C, I, NH, NKV, HD, V;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename T> std::vector<T> randn(size_t n, std::mt19937& g, float sd = 1.0f, float mean = 0.0f) {
  std::normal_distribution<float> nd(mean, sd);
  std::vector<T> v(n);
  for (auto& x : v) x = st::math::st<T>(nd(g));
  return v;
}

template <typename T> st::Buffer<T> upload(st::Backend<T>& be, const std::vector<T>& h) {
  st::Buffer<T> b(be, h.size());
  be.from_host(b.data(), h.data(), h.size());
  return b;
}

struct Timer {
  int reps, inner, warmup;
  template <typename B> double seconds(B& be, const std::function<void()>& f) const {
    for (int i = 0; i < warmup; ++i) f();
    be.synchronize();
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < inner; ++i) f();
      be.synchronize();
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / inner);
    }
    return median(t);
  }
};

// One table row: the kernel's bandwidth and the share of a copy of the same bytes (half read, half
// written) on backend be.
template <typename T>
void row(st::Backend<T>& be, const Timer& tm, const char* kind, const std::string& name, const std::string& shape,
         double bytes, const std::function<void()>& f) {
  const size_t n = static_cast<size_t>(bytes / 2 / sizeof(T));  // elements of the copy: bytes/2 read, bytes/2 written
  st::Buffer<T> a(be, n), b(be, n);
  be.zero(a.data(), n);
  const double tc = tm.seconds(be, [&] { be.copy(b.data(), a.data(), n); });
  const double tk = tm.seconds(be, f);
  const double bw = bytes / tk, copy_bw = 2.0 * n * sizeof(T) / tc;
  std::printf("| %s | %s | %s | %.1f | %.1f | %.2f | %.2f | %.0f%% |\n", kind, name.c_str(), shape.c_str(),
              bytes / 1048576.0, tk * 1e6, bw / 1e12, copy_bw / 1e12, 100.0 * bw / copy_bw);
  std::fflush(stdout);
}

// The --gemm table (see the top of this file).
void gemm_table(st::Backend<st::bf16>& be, const Timer& tm) {
  using S = st::math::Acc<st::bf16>;
  using G = st::math::Fp8Gemm;
  struct Proj {
    const char* model;
    const char* name;
    int M, N, K;  // y[M, N] = x[M, K] W[N, K]^T
  };
  const std::vector<Proj> projs{{"Llama-3-8B", "q, o", 8192, 4096, 4096},  {"Llama-3-8B", "k, v", 8192, 1024, 4096},
                                {"Llama-3-8B", "gate, up", 8192, 14336, 4096}, {"Llama-3-8B", "down", 8192, 4096, 14336},
                                {"llama-1b", "q, o", 16384, 2048, 2048},     {"llama-1b", "gate, up", 16384, 8192, 2048},
                                {"llama-1b", "down", 16384, 2048, 8192}};
  std::printf("| model | projection | role | tokens x outputs x inputs | bf16 TFLOP/s (cuBLAS) | fp8 TFLOP/s "
              "(linear_fp8) | fp8 / bf16 |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  std::mt19937 g(2);
  for (const Proj& p : projs)
    for (G role : {G::Forward, G::InputGrad, G::WeightGrad}) {
      // Operand and output shapes of the role (model.h, linear()).
      const size_t M = static_cast<size_t>(p.M), N = static_cast<size_t>(p.N), K = static_cast<size_t>(p.K);
      const size_t na = role == G::Forward ? M * K : M * N, nb = role == G::WeightGrad ? M * K : N * K,
                   no = role == G::Forward ? M * N : role == G::InputGrad ? M * K : N * K;
      auto a = upload(be, randn<st::bf16>(na, g)), b = upload(be, randn<st::bf16>(nb, g, 0.02f));
      st::Buffer<st::bf16> out(be, no);
      auto bf16_gemm = [&] {
        if (role == G::Forward)
          be.gemm(false, true, p.M, p.N, p.K, S(1), a.data(), p.K, b.data(), p.K, S(0), out.data(), p.N);
        else if (role == G::InputGrad)
          be.gemm(false, false, p.M, p.K, p.N, S(1), a.data(), p.N, b.data(), p.K, S(0), out.data(), p.K);
        else
          be.gemm(true, false, p.N, p.K, p.M, S(1), a.data(), p.N, b.data(), p.K, S(0), out.data(), p.K);
      };
      const double flops = 2.0 * p.M * static_cast<double>(p.N) * p.K;
      const double tb = tm.seconds(be, bf16_gemm);
      const double tf = tm.seconds(be, [&] { be.linear_fp8(role, p.M, p.N, p.K, a.data(), b.data(), out.data(), false); });
      const char* rn = role == G::Forward ? "forward" : role == G::InputGrad ? "input gradient" : "weight gradient";
      std::printf("| %s | %s | %s | %d x %d x %d | %.0f | %.0f | %.2f |\n", p.model, p.name, rn, p.M, p.N, p.K,
                  flops / tb / 1e12, flops / tf / 1e12, tb / tf);
      std::fflush(stdout);
    }
}

}  // namespace

int main(int argc, char** argv) {
  Timer tm{20, 10, 5};
  std::string model = "llama-350m";
  bool gemm = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) tm.reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--inner") && i + 1 < argc) tm.inner = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--warmup") && i + 1 < argc) tm.warmup = std::max(0, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
    else if (!std::strcmp(argv[i], "--gemm")) gemm = true;
    else {
      const bool help = !std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h");
      if (!help) std::fprintf(stderr, "kernel_bench: unknown or incomplete option '%s'\n", argv[i]);
      std::fprintf(help ? stdout : stderr,
                   "usage: kernel_bench [--gemm] [--model llama-350m|llama-1b] [--reps N] [--inner N] [--warmup N]\n"
                   "  the CUDA backend's memory-bound kernels against a device copy of the same bytes; --gemm: the\n"
                   "  float8 GEMMs against bf16 (tests/bench/kernel_bench.cpp's header says what is measured)\n");
      return help ? 0 : 2;
    }
  }
  const Shape s = model == "llama-1b" ? Shape{"llama-1b", 16384, 2048, 8192, 32, 8, 64, 128256}
                                      : Shape{"llama-350m", 16384, 1024, 2816, 16, 16, 64, 32000};
  if (model != s.model) {
    std::fprintf(stderr, "kernel_bench: --model '%s': expected llama-350m or llama-1b\n", model.c_str());
    return 2;
  }
  std::string why;
  if (st::cuda_device_count(&why) <= 0) {
    std::printf("kernel_bench: skipped: no CUDA device (%s)\n", why.c_str());
    return 0;
  }
  try {
    auto ctx = st::CudaContext::create(0);
    auto bp = st::make_cuda_backend<st::bf16>(*ctx);
    auto fp = st::make_cuda_backend<float>(*ctx);
    st::Backend<st::bf16>& be = *bp;
    st::Backend<float>& bf = *fp;
    if (gemm) {
      gemm_table(be, tm);
      return 0;
    }
    using S = st::math::Acc<st::bf16>;
    std::mt19937 g(1);
    const size_t NC = static_cast<size_t>(s.N) * s.C, NI = static_cast<size_t>(s.N) * s.I;
    const size_t NQ = static_cast<size_t>(s.N) * s.NH * s.HD, NK = static_cast<size_t>(s.N) * s.NKV * s.HD;
    const int T_ = 1024, B = s.N / T_, half = s.HD / 2;
    const std::string rows = std::to_string(s.N) + " x ";
    std::printf("kernel_bench: %s shapes, %d rows (B %d x T %d), bf16 activations, fp32 optimizer state; "
                "median of %d x %d calls\n\n",
                s.model, s.N, B, T_, tm.reps, tm.inner);
    std::printf("| kind | kernel | shape | MiB moved | us per call | TB/s | copy TB/s | of copy |\n");
    std::printf("|---|---|---|---|---|---|---|---|\n");
    const size_t b2 = sizeof(st::bf16);
    {  // RMSNorm forward and its dx backward
      const size_t C = static_cast<size_t>(s.C);
      auto x = upload(be, randn<st::bf16>(NC, g)), w = upload(be, randn<st::bf16>(C, g, 0.2f, 1.0f));
      st::Buffer<st::bf16> out(be, NC), rstd(be, static_cast<size_t>(s.N)), dx(be, NC), dw(be, C);
      be.zero(dx.data(), NC);
      be.zero(dw.data(), C);
      row(be, tm, "elementwise", "rmsnorm_forward", rows + std::to_string(s.C), 2.0 * NC * b2,
          [&] { be.rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), s.N, s.C, S(1e-5)); });
      row(be, tm, "elementwise + reduction", "rmsnorm_backward (dw partials and dx)", rows + std::to_string(s.C),
          6.0 * NC * b2,
          [&] { be.rmsnorm_backward(dx.data(), dw.data(), out.data(), x.data(), w.data(), rstd.data(), s.N, s.C); });
    }
    {  // RoPE on q and on k (two calls, as the model makes them)
      std::vector<float> cs(static_cast<size_t>(T_) * half), sn(cs.size());
      for (int t = 0; t < T_; ++t)
        for (int j = 0; j < half; ++j) {
          const double a = t * std::pow(10000.0, -2.0 * j / s.HD);
          cs[static_cast<size_t>(t) * half + j] = static_cast<float>(std::cos(a));
          sn[static_cast<size_t>(t) * half + j] = static_cast<float>(std::sin(a));
        }
      std::vector<st::bf16> cb(cs.size()), sb(sn.size());
      for (size_t i = 0; i < cs.size(); ++i) cb[i] = st::math::f32_to_bf16(cs[i]), sb[i] = st::math::f32_to_bf16(sn[i]);
      auto c = upload(be, cb), sn_d = upload(be, sb), q = upload(be, randn<st::bf16>(NQ, g)),
           k = upload(be, randn<st::bf16>(NK, g));
      const std::string heads = rows + std::to_string(s.NH) + "+" + std::to_string(s.NKV) + " heads x " +
                                std::to_string(s.HD);
      row(be, tm, "elementwise", "rope_qk (q and k, one launch: the model's)", heads, 2.0 * (NQ + NK) * b2, [&] {
        be.rope_qk(q.data(), s.NH, k.data(), s.NKV, c.data(), sn_d.data(), nullptr, B, T_, s.HD, false);
      });
      row(be, tm, "elementwise", "rope_forward (q, then k: two launches)", heads, 2.0 * (NQ + NK) * b2, [&] {
        be.rope_forward(q.data(), c.data(), sn_d.data(), B, T_, s.NH, s.HD);
        be.rope_forward(k.data(), c.data(), sn_d.data(), B, T_, s.NKV, s.HD);
      });
    }
    {  // SwiGLU
      auto ga = upload(be, randn<st::bf16>(NI, g)), up = upload(be, randn<st::bf16>(NI, g)),
           dh = upload(be, randn<st::bf16>(NI, g));
      st::Buffer<st::bf16> h(be, NI), dg(be, NI), du(be, NI);
      row(be, tm, "elementwise", "swiglu_forward", rows + std::to_string(s.I), 3.0 * NI * b2,
          [&] { be.swiglu_forward(h.data(), ga.data(), up.data(), NI); });
      row(be, tm, "elementwise", "swiglu_backward", rows + std::to_string(s.I), 5.0 * NI * b2,
          [&] { be.swiglu_backward(dg.data(), du.data(), dh.data(), ga.data(), up.data(), NI); });
    }
    {  // conversions between the fp32 state and bf16 (a 4096 x 4096 weight) and the gradient add
      const size_t n = size_t{4096} * 4096;
      auto src = upload(bf, randn<float>(n, g));
      auto b16 = upload(be, randn<st::bf16>(n, g));
      st::Buffer<st::bf16> dst(be, n);
      st::Buffer<float> acc(bf, n);
      bf.zero(acc.data(), n);
      row(be, tm, "elementwise", "from_f32 (fp32 -> bf16)", "4096 x 4096", n * (4.0 + b2),
          [&] { be.from_f32(dst.data(), src.data(), n); });
      row(be, tm, "elementwise", "add_to_f32 (fp32 += bf16)", "4096 x 4096", n * (8.0 + b2),
          [&] { be.add_to_f32(acc.data(), 1.0f, b16.data(), n); });
    }
    {  // AdamW on the fp32 state (a 4096 x 4096 shard), axpy and the gradient norm's sum of squares
      const size_t n = size_t{4096} * 4096;
      auto p = upload(bf, randn<float>(n, g)), m = upload(bf, randn<float>(n, g, 0.1f)),
           gr = upload(bf, randn<float>(n, g));
      std::vector<float> hv = randn<float>(n, g, 0.01f);
      for (auto& x : hv) x = std::fabs(x);
      auto v = upload(bf, hv);
      row(bf, tm, "elementwise", "adamw (fp32 state)", "4096 x 4096", 7.0 * n * 4,
          [&] { bf.adamw(p.data(), m.data(), v.data(), gr.data(), n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 10); });
      row(bf, tm, "elementwise", "axpy (fp32)", "4096 x 4096", 3.0 * n * 4,
          [&] { bf.axpy(n, 1e-3f, gr.data(), m.data()); });
      row(bf, tm, "reduction", "sum_squares (fp32, to the host)", "4096 x 4096", 1.0 * n * 4,
          [&] { (void)bf.sum_squares(gr.data(), n); });
    }
    {  // the loss on one chunk of 1,024 rows, and the embedding's backward over every row
      const int Nc = 1024;
      const size_t nl = static_cast<size_t>(Nc) * s.V;
      auto logits = upload(be, randn<st::bf16>(nl, g));
      std::vector<int32_t> tgt(static_cast<size_t>(s.N));
      std::uniform_int_distribution<int32_t> ud(0, s.V - 1);
      for (auto& t : tgt) t = ud(g);
      st::IdBuffer<st::bf16> ids(be, tgt.size());
      be.ids_from_host(ids.data(), tgt.data(), tgt.size());
      st::Buffer<st::bf16> dl(be, nl);
      row(be, tm, "reduction", "cross_entropy (loss and dlogits)", std::to_string(Nc) + " x " + std::to_string(s.V),
          2.0 * nl * b2, [&] { (void)be.cross_entropy(dl.data(), logits.data(), ids.data(), Nc, s.V, S(1.0f / Nc)); });
      const size_t nt = static_cast<size_t>(s.V) * s.C;
      st::Buffer<st::bf16> table(be, nt);
      be.zero(table.data(), nt);
      auto dout = upload(be, randn<st::bf16>(NC, g));
      row(be, tm, "reduction", "embedding_backward",
          rows + std::to_string(s.C) + " into " + std::to_string(s.V) + " rows", 3.0 * NC * b2,
          [&] { be.embedding_backward(table.data(), ids.data(), dout.data(), s.N, s.C); });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernel_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
