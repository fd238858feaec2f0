// attention_bench: causal attention forward and forward+backward TFLOP/s of the CUDA backend's bf16
// Backend::flash_attention_* (cuDNN's fused SDPA, then shardtrain's tiled kernels), on the shapes of
// the FlashAttention-2 paper's benchmark (Dao 2023, section 4.1): batch x seq = 16k tokens, hidden
// 2048 (heads = 2048 / head dim), head dims 64 and 128, seq 1024 .. 4096; plus llama-1b's GQA shape.
// FLOPs as that paper counts them: forward 4 * B * T^2 * NH * HD, halved for the causal mask;
// backward 2.5x the forward (so forward+backward is 3.5x).
//
// --cp: context parallelism's block attention instead (issue 57, item 2), in one process: the
// attention of every rank of a cp-way ring over one sequence, run one rank after the other, as
// CpAttention's ring runs it (src/parallel/context_parallel.cpp): rank r's queries (its head-tail
// chunks r and 2cp-1-r of T / 2cp tokens) against each rank's key/value block through
// Backend::attention_block_forward, the parts merged in an fp32 accumulator (attention_merge_acc,
// then from_f32), and the backward's attention_row_dot and attention_block_backward per block pair
// with the dK/dV partial sums zeroed and added as the ring adds them. Causal, and with document
// masks (documents of 256 - 4,096 tokens, uniform, seed 1; a query sees the keys of its own
// document at or before its position). Useful FLOPs: 4 * HD * NH per visible (query, key) pair
// (counted on the host from the positions and documents), the backward 2.5x. Beside it cuDNN's
// causal SDPA over the whole sequence (the same B, T, heads; FLOPs as above): issue 57's target is
// CP's useful TFLOP/s >= 50% of that.
// Time: the median of --reps timed repetitions after --warmup, each bracketed by
// Backend::synchronize() (host wall clock; the kernels of one repetition queue back to back).
// Prints one markdown table and exits 0; without a CUDA device prints "attention_bench: skipped: no
// CUDA device (<reason>)" and exits 0.
// Usage: attention_bench [--cp] [--reps N] [--warmup N]   (tests/gpu/run.sh stages 5d and 5f run it)
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

template <typename F> double time_of(st::Backend<st::bf16>& be, int reps, int warmup, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  be.synchronize();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    be.synchronize();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(t);
}

// The --cp table (see the top of this file).
void cp_table(st::Backend<st::bf16>& be, int reps, int warmup) {
  struct CpShape {
    const char* name;
    int B, T, NH, NKV, HD, cp;
  };
  const std::vector<CpShape> shapes{{"llama-350m", 1, 16384, 16, 16, 64, 2}, {"llama-350m", 1, 16384, 16, 16, 64, 4},
                                    {"llama-1b", 1, 16384, 32, 8, 64, 2},    {"llama-1b", 1, 16384, 32, 8, 64, 4}};
  std::printf("| kernel | shape | B | T | NH | NKV | HD | cp | mask | useful forward TFLOP/s | useful forward+backward "
              "TFLOP/s | cuDNN causal, whole sequence: forward | forward+backward | CP / cuDNN, forward+backward |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::mt19937 g(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const CpShape& s : shapes) {
    const int P = s.cp, c = s.T / (2 * P), Tl = 2 * c;
    const size_t rq = static_cast<size_t>(s.NH) * s.HD, rk = static_cast<size_t>(s.NKV) * s.HD;
    const size_t nq = static_cast<size_t>(s.B) * Tl * rq, nk = static_cast<size_t>(s.B) * Tl * rk;
    const size_t ns = static_cast<size_t>(s.B) * s.NH * Tl;
    // Rank r's tokens: chunks r and 2P-1-r (global positions); the same for every sequence b.
    std::vector<std::vector<int32_t>> pos(static_cast<size_t>(P)), doc(static_cast<size_t>(P));
    std::vector<int32_t> doc_of(static_cast<size_t>(s.T));
    {
      std::mt19937 dg(1);
      std::uniform_int_distribution<int> len(256, 4096);
      int id = 0;
      for (int t = 0; t < s.T;) {
        const int n = len(dg);
        for (int u = t; u < std::min(s.T, t + n); ++u) doc_of[static_cast<size_t>(u)] = id;
        t += n;
        ++id;
      }
    }
    for (int r = 0; r < P; ++r)
      for (int b = 0; b < s.B; ++b)
        for (int chunk : {r, 2 * P - 1 - r})
          for (int t = chunk * c; t < (chunk + 1) * c; ++t) {
            pos[static_cast<size_t>(r)].push_back(t);
            doc[static_cast<size_t>(r)].push_back(doc_of[static_cast<size_t>(t)]);
          }
    // Visible (query, key) pairs of the whole sequence, per sequence: causal T (T + 1) / 2; with
    // documents the sum over documents of n (n + 1) / 2.
    double causal_pairs = 0.5 * s.T * (s.T + 1.0), doc_pairs = 0;
    for (int t = 0, n = 0; t <= s.T; ++t) {
      if (t == s.T || (t > 0 && doc_of[static_cast<size_t>(t)] != doc_of[static_cast<size_t>(t - 1)])) {
        doc_pairs += 0.5 * n * (n + 1.0);
        n = 0;
      }
      ++n;
    }
    std::vector<st::bf16> hq(nq), hk(nk);
    for (auto& x : hq) x = st::math::f32_to_bf16(nd(g));
    for (auto& x : hk) x = st::math::f32_to_bf16(nd(g));
    std::vector<st::Buffer<st::bf16>> q, k, v, y, dy, dq, dk, dv;
    std::vector<st::IdBuffer<st::bf16>> bpos, bdoc;
    for (int r = 0; r < P; ++r) {
      for (auto* vec : {&q, &y, &dy, &dq}) vec->emplace_back(be, nq);
      for (auto* vec : {&k, &v, &dk, &dv}) vec->emplace_back(be, nk);
      be.from_host(q.back().data(), hq.data(), nq);
      be.from_host(dy.back().data(), hq.data(), nq);
      be.from_host(k.back().data(), hk.data(), nk);
      be.from_host(v.back().data(), hk.data(), nk);
      bpos.emplace_back(be, pos[static_cast<size_t>(r)].size());
      bdoc.emplace_back(be, doc[static_cast<size_t>(r)].size());
      be.ids_from_host(bpos.back().data(), pos[static_cast<size_t>(r)].data(), pos[static_cast<size_t>(r)].size());
      be.ids_from_host(bdoc.back().data(), doc[static_cast<size_t>(r)].data(), doc[static_cast<size_t>(r)].size());
    }
    st::Buffer<st::bf16> yt(be, nq), gk(be, nk), gv(be, nk);
    st::AccBuffer<st::bf16> yacc(be, nq), lse(be, ns), lt(be, ns), dsum(be, ns);
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.HD));
    for (bool docs : {false, true}) {
      auto dptr = [&](int r) { return docs ? bdoc[static_cast<size_t>(r)].data() : nullptr; };
      // Rank r's forward over the ring (the step order of ring_forward: key block of rank r - step).
      auto fwd_rank = [&](int r) {
        for (int step = 0; step < P; ++step) {
          const int j = ((r - step) % P + P) % P;
          be.attention_block_forward(yt.data(), step == 0 ? lse.data() : lt.data(), q[static_cast<size_t>(r)].data(),
                                     k[static_cast<size_t>(j)].data(), v[static_cast<size_t>(j)].data(),
                                     bpos[static_cast<size_t>(r)].data(), bpos[static_cast<size_t>(j)].data(), dptr(r),
                                     dptr(j), s.B, Tl, Tl, s.NH, s.NKV, s.HD, scale);
          if (step == 0) {
            be.zero_acc(yacc.data(), nq);
            be.add_to_f32(yacc.data(), 1.0f, yt.data(), nq);
          } else {
            be.attention_merge_acc(yacc.data(), lse.data(), yt.data(), lt.data(), s.B, Tl, s.NH, s.HD);
          }
        }
        be.from_f32(y[static_cast<size_t>(r)].data(), yacc.data(), nq);
      };
      auto bwd_rank = [&](int r) {
        be.attention_row_dot(dsum.data(), dy[static_cast<size_t>(r)].data(), y[static_cast<size_t>(r)].data(), s.B, Tl,
                             s.NH, s.HD);
        be.zero(dq[static_cast<size_t>(r)].data(), nq);
        for (int step = 0; step < P; ++step) {
          const int j = ((r - step) % P + P) % P;
          be.zero(gk.data(), nk);
          be.zero(gv.data(), nk);
          be.attention_block_backward(dq[static_cast<size_t>(r)].data(), gk.data(), gv.data(),
                                      dy[static_cast<size_t>(r)].data(), q[static_cast<size_t>(r)].data(),
                                      k[static_cast<size_t>(j)].data(), v[static_cast<size_t>(j)].data(),
                                      y[static_cast<size_t>(r)].data(), lse.data(),
                                      dsum.data(), bpos[static_cast<size_t>(r)].data(),
                                      bpos[static_cast<size_t>(j)].data(), dptr(r), dptr(j), s.B, Tl, Tl, s.NH, s.NKV,
                                      s.HD, scale);
          be.axpy(nk, 1.0f, gk.data(), dk[static_cast<size_t>(j)].data());
          be.axpy(nk, 1.0f, gv.data(), dv[static_cast<size_t>(j)].data());
        }
      };
      // The lse the backward reads is the last forward rank's; every rank's pairs cost the same
      // with any lse, and the bench times, it does not check (gpu_tests' block attention does).
      const double tf = time_of(be, reps, warmup, [&] {
        for (int r = 0; r < P; ++r) fwd_rank(r);
      });
      const double tfb = time_of(be, reps, warmup, [&] {
        for (int r = 0; r < P; ++r) {
          fwd_rank(r);
          bwd_rank(r);
        }
      });
      const double pairs = (docs ? doc_pairs : causal_pairs) * s.B;
      const double fl = 4.0 * s.HD * s.NH * pairs;
      // cuDNN causal over the whole sequence, the same shape (q, k of rank 0's size x cp); the
      // user's SHARDTRAIN_CUDNN_ATTENTION (which chose the block pairs' kernels above) restored after.
      double cf = 0, cfb = 0;
      {
        const char* user = std::getenv("SHARDTRAIN_CUDNN_ATTENTION");
        const std::string saved = user ? user : "";
        setenv("SHARDTRAIN_CUDNN_ATTENTION", "require", 1);
        const size_t Nq = nq * static_cast<size_t>(P), Nk = nk * static_cast<size_t>(P),
                     Ns = ns * static_cast<size_t>(P);
        st::Buffer<st::bf16> Q(be, Nq), K(be, Nk), V(be, Nk), Y(be, Nq), DY(be, Nq), DQ(be, Nq), DK(be, Nk), DV(be, Nk);
        st::AccBuffer<st::bf16> L(be, Ns), D(be, Ns);
        for (size_t r = 0; r < static_cast<size_t>(P); ++r) {
          be.copy(Q.data() + r * nq, q[r].data(), nq);
          be.copy(DY.data() + r * nq, dy[r].data(), nq);
          be.copy(K.data() + r * nk, k[r].data(), nk);
          be.copy(V.data() + r * nk, v[r].data(), nk);
        }
        auto f = [&] { be.flash_attention_forward(Y.data(), L.data(), Q.data(), K.data(), V.data(), s.B, s.T, s.NH,
                                                  s.NKV, s.HD, scale); };
        const double t1 = time_of(be, reps, warmup, f), t2 = time_of(be, reps, warmup, [&] {
          f();
          be.flash_attention_backward(DQ.data(), DK.data(), DV.data(), D.data(), DY.data(), Q.data(), K.data(),
                                      V.data(), Y.data(), L.data(), s.B, s.T, s.NH, s.NKV, s.HD, scale);
        });
        const double cfl = 4.0 * s.HD * s.NH * causal_pairs * s.B;
        cf = cfl / t1 / 1e12;
        cfb = 3.5 * cfl / t2 / 1e12;
        if (user) setenv("SHARDTRAIN_CUDNN_ATTENTION", saved.c_str(), 1);
        else unsetenv("SHARDTRAIN_CUDNN_ATTENTION");
      }
      const double uf = fl / tf / 1e12, ufb = 3.5 * fl / tfb / 1e12;
      // Which kernels the pairs ran (attention.cu, cudnn_for_blocks): cuDNN's pieces unless the
      // variable says off, documents only under require; else the tiled block kernels.
      const char* env = std::getenv("SHARDTRAIN_CUDNN_ATTENTION");
      const std::string use = env ? env : "auto";
      const bool off = use == "off" || use == "0", req = use == "require" || use == "1";
      const char* kname = off || (docs && !req) ? "CP ring, tiled block kernels" : "CP ring, cuDNN pieces (if taken)";
      std::printf("| %s | %s | %d | %d | %d | %d | %d | %d | %s | %.1f | %.1f | %.1f | %.1f | %.0f%% |\n", kname, s.name,
                  s.B, s.T, s.NH, s.NKV, s.HD, P, docs ? "documents" : "causal", uf, ufb, cf, cfb, 100.0 * ufb / cfb);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 10, warmup = 3;
  bool cp = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--cp")) cp = true;
    else {
      const bool help = !std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h");
      if (!help) std::fprintf(stderr, "attention_bench: unknown or incomplete option '%s'\n", argv[i]);
      std::fprintf(help ? stdout : stderr,
                   "usage: attention_bench [--cp] [--reps N] [--warmup N]\n"
                   "  causal attention TFLOP/s of the CUDA backend (cuDNN, then the tiled kernels); --cp: context\n"
                   "  parallelism's block pairs against cuDNN over the whole sequence (the file's header says how)\n");
      return help ? 0 : 2;
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
    if (cp) {
      cp_table(*be, reps, warmup);
      return 0;
    }
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
        const double flops_fwd = 4.0 * s.B * static_cast<double>(s.T) * s.T * s.NH * s.HD / 2;  // causal
        const double tf = time_of(*be, reps, warmup, fwd), tfb = time_of(*be, reps, warmup, [&] {
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
