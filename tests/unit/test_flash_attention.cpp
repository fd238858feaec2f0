// Tiled causal attention (flash_attention_forward / _backward, FlashAttention-2) of the CPU backend
// against the exact path of the model (attention_forward / attention_backward in
// llama_attention.cpp, which stores the [B, NH, T, T] probabilities), in double within 1e-12, bf16
// storage against fp32 within bf16 rounding, lse against a float64 loop, bitwise the same results
// with 1, 2 and 3 threads.
// Shapes: T = 1, 17 (one partial tile), 64 (one full tile), 300 (partial last tile), 2048 (32 tiles)
// with MHA, GQA (NH 4, NKV 2; NH 6, NKV 2) and MQA (NKV 1), q, k ~ N(0, 1) and N(0, 4) (peaked).
//
// fp32 criterion (err = max|a - b| / max|b| per output y, dq, dk, dv; absolute where b is all 0).
// The target was flash vs exact <= 1e-6; it is not met with peaked softmaxes (q, k sd 2): flash vs
// exact reaches 1.9e-6 (dq, T = 300, GQA). Measured against the exact path run in float64 on the
// same inputs, the fp32 exact path itself is that far off (up to 2.0e-6: dq, T = 130, qk sd 2; 1.5e-6
// for dk at T = 2048 MQA, qk sd 1), and flash is as close or closer (worst 1.5e-6 except T = 1). So
// the two fp32 paths differ by their own rounding, each ~1e-6 of max|b|: flash and exact round
// differently (online rescaling, P = exp(x - lse) instead of e / sum, D = dy.y instead of sum p dp).
// T = 1: the true dq, dk are 0 (softmax over one key). The exact path gets exactly 0 (dot = p dp
// with p = 1); flash forms dp - D with D = dy.y summed apart from dp = dy.v and gets up to 2.0e-6
// absolute (qk sd 2, MQA): FlashAttention-2's D is a different rounding of the same number.
// Asserted: flash vs float64 <= max(1.5e-6, 1.25 x (exact vs float64)) (3e-6 absolute where the
// true gradient is 0), and flash vs exact <= 3e-6. Every case prints all three numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/flash_attention.h"
#include "shardtrain/model/model.h"

namespace shardtrain {
namespace {

struct Shape {
  int B, T, NH, NKV, HD;
  std::string str() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
           " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD);
  }
  size_t nq() const { return static_cast<size_t>(B) * T * NH * HD; }
  size_t nk() const { return static_cast<size_t>(B) * T * NKV * HD; }
  size_t ns() const { return static_cast<size_t>(B) * NH * T; }
};

// Inputs in float: q, k ~ N(0, qk_sd^2) (with sd 1 and HD 64, scaled scores have sd 1; larger sd
// gives peaked softmaxes), v, dy ~ N(0, 1).
struct Inputs {
  std::vector<float> q, k, v, dy;
};
Inputs make_inputs(const Shape& s, uint32_t seed, double qk_sd) {
  std::mt19937 g(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  auto fill = [&](size_t count, double sd) {
    std::vector<float> x(count);
    for (auto& e : x) e = static_cast<float>(sd * n(g));
    return x;
  };
  Inputs in;
  in.q = fill(s.nq(), qk_sd);
  in.k = fill(s.nk(), qk_sd);
  in.v = fill(s.nk(), 1.0);
  in.dy = fill(s.nq(), 1.0);
  return in;
}

template <typename T> std::vector<T> conv(const std::vector<float>& x) {
  std::vector<T> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = math::st<T>(static_cast<math::Acc<T>>(x[i]));
  return r;
}
template <typename T> std::vector<double> wide(const std::vector<T>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(math::ld(x[i]));
  return r;
}

struct Out {  // as double, whatever the storage type
  std::vector<double> y, lse, dq, dk, dv;
};

template <typename T> Buffer<T> upload(Backend<T>& be, const std::vector<T>& h) {
  Buffer<T> b(be, h.size());
  be.from_host(b.data(), h.data(), h.size());
  return b;
}
template <typename T> std::vector<double> download(Backend<T>& be, const Buffer<T>& b) {
  std::vector<T> h(b.size());
  be.to_host(h.data(), b.data(), h.size());
  return wide(h);
}

template <typename T> Out run_flash(Backend<T>& be, const Shape& s, const Inputs& in) {
  using S = typename Backend<T>::S;
  Buffer<T> q = upload(be, conv<T>(in.q)), k = upload(be, conv<T>(in.k)), v = upload(be, conv<T>(in.v)),
            dy = upload(be, conv<T>(in.dy)), y(be, s.nq()), dq(be, s.nq()), dk(be, s.nk()), dv(be, s.nk());
  AccBuffer<T> lse(be, s.ns()), dsum(be, s.ns());
  const S scale = S(1) / std::sqrt(static_cast<S>(s.HD));
  be.flash_attention_forward(y.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.NH, s.NKV, s.HD, scale);
  be.flash_attention_backward(dq.data(), dk.data(), dv.data(), dsum.data(), dy.data(), q.data(), k.data(), v.data(),
                              y.data(), lse.data(), s.B, s.T, s.NH, s.NKV, s.HD, scale);
  Out o{download(be, y), std::vector<double>(lse.data(), lse.data() + s.ns()), download(be, dq), download(be, dk),
        download(be, dv)};
  return o;
}

template <typename T> Out run_exact(Backend<T>& be, const Shape& s, const Inputs& in) {
  Buffer<T> q = upload(be, conv<T>(in.q)), k = upload(be, conv<T>(in.k)), v = upload(be, conv<T>(in.v)),
            dy = upload(be, conv<T>(in.dy)), y(be, s.nq()), dq(be, s.nq()), dk(be, s.nk()), dv(be, s.nk());
  const size_t natt = s.ns() * static_cast<size_t>(s.T);
  Buffer<T> att(be, natt), datt(be, natt);
  attention_forward(be, q.data(), k.data(), v.data(), att.data(), y.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  attention_backward(be, q.data(), k.data(), v.data(), att.data(), dy.data(), datt.data(), dq.data(), dk.data(),
                     dv.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  return Out{download(be, y), {}, download(be, dq), download(be, dk), download(be, dv)};
}

// max |a - b| / max |b|.
double rel(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  return den > 0 ? num / den : num;
}

// lse in float64 from the (stored) inputs: log sum_{s <= t} exp(scale q_t . k_s). mag (optional):
// per row, max_s scale sum_d |q_t,d k_s,d|, the size of the rounding error of fp32 scores.
std::vector<double> lse_f64(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
                            std::vector<double>* mag = nullptr) {
  std::vector<double> out(s.ns());
  if (mag) mag->assign(s.ns(), 0.0);
  const int G = s.NH / s.NKV, ldq = s.NH * s.HD, ldk = s.NKV * s.HD;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.HD));
  std::vector<double> x(static_cast<size_t>(s.T));
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.NH; ++h)
      for (int t = 0; t < s.T; ++t) {
        const double* qt = q.data() + (static_cast<size_t>(b) * s.T + t) * ldq + static_cast<size_t>(h) * s.HD;
        double mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {
          const double* ku = k.data() + (static_cast<size_t>(b) * s.T + u) * ldk + static_cast<size_t>(h / G) * s.HD;
          double d = 0, a = 0;
          for (int e = 0; e < s.HD; ++e) {
            d += qt[e] * ku[e];
            a += std::fabs(qt[e] * ku[e]);
          }
          x[static_cast<size_t>(u)] = scale * d;
          mx = std::max(mx, scale * d);
          if (mag) {
            double& m = (*mag)[(static_cast<size_t>(b) * s.NH + h) * s.T + t];
            m = std::max(m, scale * a);
          }
        }
        double sum = 0;
        for (int u = 0; u <= t; ++u) sum += std::exp(x[static_cast<size_t>(u)] - mx);
        out[(static_cast<size_t>(b) * s.NH + h) * s.T + t] = mx + std::log(sum);
      }
  return out;
}

// max |a - b| / max(1, |b|) over the rows: lse is a log, compared in absolute terms near 0.
double lse_err(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) e = std::max(e, std::fabs(a[i] - b[i]) / std::max(1.0, std::fabs(b[i])));
  return e;
}

std::vector<Shape> shapes() {
  std::vector<Shape> v;
  for (int T : {1, 17, 64, 300})
    for (int nkv : {4, 2, 1}) v.push_back({2, T, 4, nkv, 64});
  v.push_back({1, 2048, 2, 2, 64});  // MHA
  v.push_back({1, 2048, 2, 1, 64});  // MQA (= GQA with 2 heads per group)
  v.push_back({1, 130, 6, 2, 24});   // GQA with 3 heads per group, head dim not a multiple of 16
  return v;
}

void report(const std::string& line) { std::printf("[ flash ] %s\n", line.c_str()); }

TEST(FlashAttention, Fp32MatchesExactPath) {
  auto be = make_cpu_backend<float>();
  auto bd = make_cpu_backend<double>();
  uint32_t seed = 1;
  for (const Shape& s : shapes())
    for (double sd : {1.0, 2.0}) {  // sd 2: scaled scores with sd 4, peaked softmaxes
      if (s.T == 2048 && sd != 1.0) continue;
      const Inputs in = make_inputs(s, seed++, sd);
      const Out f = run_flash(*be, s, in), e = run_exact(*be, s, in);
      const Out r = run_exact(*bd, s, in);  // float64 reference on the same inputs
      const std::string what = s.str() + " qk_sd=" + std::to_string(sd).substr(0, 3);
      const char* names[] = {"y", "dq", "dk", "dv"};
      const std::vector<double>* fv[] = {&f.y, &f.dq, &f.dk, &f.dv};
      const std::vector<double>* ev[] = {&e.y, &e.dq, &e.dk, &e.dv};
      const std::vector<double>* rv[] = {&r.y, &r.dq, &r.dk, &r.dv};
      std::string line = what + ":";
      for (int i = 0; i < 4; ++i) {
        const double fe = rel(*fv[i], *ev[i]), f64 = rel(*fv[i], *rv[i]), e64 = rel(*ev[i], *rv[i]);
        const bool zero = std::all_of(rv[i]->begin(), rv[i]->end(), [](double x) { return x == 0.0; });
        char b[160];
        std::snprintf(b, sizeof b, " %s %.2e (f64: flash %.2e exact %.2e)", names[i], fe, f64, e64);
        line += b;
        EXPECT_LE(fe, 3e-6) << what << " " << names[i] << ": flash vs exact";
        EXPECT_LE(f64, zero ? 3e-6 : std::max(1.5e-6, 1.25 * e64)) << what << " " << names[i] << ": flash vs float64";
      }
      std::vector<double> mag;
      const std::vector<double> l64 = lse_f64(s, wide(in.q), wide(in.k), &mag);
      double worst = 0;  // |diff| / allowed, allowed = 1e-6 max(1, |lse|) + fp32 rounding of the scores
      for (size_t i = 0; i < l64.size(); ++i)
        worst = std::max(worst, std::fabs(f.lse[i] - l64[i]) /
                                    (1e-6 * std::max(1.0, std::fabs(l64[i])) + 4 * std::sqrt(s.HD) * 0x1p-24 * mag[i]));
      char b[96];
      std::snprintf(b, sizeof b, " lse %.2e (worst |diff|/allowed %.2f)", lse_err(f.lse, l64), worst);
      report(line + b);
      EXPECT_LE(worst, 1.0) << what << " lse vs float64 loop";
    }
}

TEST(FlashAttention, DoubleMatchesExactPath) {
  auto bd = make_cpu_backend<double>();
  uint32_t seed = 100;
  for (const Shape& s : shapes()) {
    if (s.T == 2048) continue;  // the fp32 test covers many tiles; 300 has 5 here
    const Inputs in = make_inputs(s, seed++, 2.0);
    const Out f = run_flash(*bd, s, in), e = run_exact(*bd, s, in);
    EXPECT_LE(rel(f.y, e.y), 1e-12) << s.str() << " y";
    EXPECT_LE(rel(f.dq, e.dq), 1e-12) << s.str() << " dq";
    EXPECT_LE(rel(f.dk, e.dk), 1e-12) << s.str() << " dk";
    EXPECT_LE(rel(f.dv, e.dv), 1e-12) << s.str() << " dv";
    EXPECT_LE(lse_err(f.lse, lse_f64(s, wide(in.q), wide(in.k))), 1e-13) << s.str() << " lse";
  }
}

// bf16 storage (fp32 arithmetic) against the fp32 flash path on the same bf16-rounded inputs: each
// output is rounded to bf16 once (relative 2^-9), y is rounded before the backward reads it.
TEST(FlashAttention, Bf16MatchesFp32) {
  auto bb = make_cpu_backend<bf16>();
  auto bf = make_cpu_backend<float>();
  uint32_t seed = 200;
  for (const Shape& s : {Shape{2, 300, 4, 2, 64}, Shape{1, 17, 4, 1, 64}, Shape{1, 1, 4, 4, 64}, Shape{1, 130, 6, 2, 24}}) {
    Inputs in = make_inputs(s, seed++, 1.0);
    for (auto* x : {&in.q, &in.k, &in.v, &in.dy})  // the values bf16 stores
      for (float& e : *x) e = math::bf16_to_f32(math::f32_to_bf16(e));
    const Out b = run_flash(*bb, s, in), f = run_flash(*bf, s, in);
    const double ey = rel(b.y, f.y), eq = rel(b.dq, f.dq), ek = rel(b.dk, f.dk), ev = rel(b.dv, f.dv);
    const double el = lse_err(b.lse, f.lse);
    char line[200];
    std::snprintf(line, sizeof line, "bf16 %s: y %.2e dq %.2e dk %.2e dv %.2e lse %.2e", s.str().c_str(), ey, eq, ek,
                  ev, el);
    report(line);
    EXPECT_LE(ey, 8e-3) << s.str();
    EXPECT_LE(eq, 1.5e-2) << s.str();
    EXPECT_LE(ek, 1.5e-2) << s.str();
    EXPECT_LE(ev, 8e-3) << s.str();
    EXPECT_LE(el, 1e-6) << s.str();  // lse is kept in fp32 and reads only q and k
  }
}

template <typename T> void expect_thread_invariant(const Shape& s, uint32_t seed) {
  auto be = make_cpu_backend<T>();
  const Inputs in = make_inputs(s, seed, 1.0);
  const int saved = cpu_threads();
  set_cpu_threads(1);
  const Out ref = run_flash(*be, s, in);
  for (int t : {2, 3}) {
    set_cpu_threads(t);
    const Out got = run_flash(*be, s, in);
    const char* names[] = {"y", "lse", "dq", "dk", "dv"};
    const std::vector<double>* a[] = {&got.y, &got.lse, &got.dq, &got.dk, &got.dv};
    const std::vector<double>* b[] = {&ref.y, &ref.lse, &ref.dq, &ref.dk, &ref.dv};
    for (int i = 0; i < 5; ++i) {
      ASSERT_EQ(a[i]->size(), b[i]->size());
      size_t diff = 0;
      for (size_t j = 0; j < b[i]->size(); ++j) diff += std::memcmp(&(*a[i])[j], &(*b[i])[j], sizeof(double)) != 0;
      EXPECT_EQ(diff, 0u) << s.str() << " " << names[i] << ", " << t << " threads vs 1";
    }
  }
  set_cpu_threads(saved);
}

TEST(FlashAttention, BitwiseSameForThreadCounts) {
  expect_thread_invariant<float>({2, 300, 4, 2, 64}, 300);
  expect_thread_invariant<float>({1, 200, 3, 1, 32}, 301);
  expect_thread_invariant<double>({1, 150, 2, 1, 64}, 302);
  expect_thread_invariant<bf16>({1, 150, 4, 2, 64}, 303);
}

// The shared per-row math: online softmax over tiles equals the one-pass softmax.
TEST(FlashAttention, OnlineSoftmaxRowMath) {
  const std::vector<double> x{0.3, -2.0, 5.0, 4.9, -40.0, 1.0, 7.5};
  double m = -INFINITY, l = 0;
  for (size_t i = 0; i < x.size(); i += 3) {  // tiles of 3
    double mx = -INFINITY;
    for (size_t j = i; j < std::min(x.size(), i + 3); ++j) mx = std::max(mx, x[j]);
    const double mn = flash::online_max(m, mx), a = flash::online_rescale(m, mn);
    double sum = 0;
    for (size_t j = i; j < std::min(x.size(), i + 3); ++j) sum += flash::prob(x[j], mn);
    l = a * l + sum;
    m = mn;
  }
  double ref = 0;
  for (double e : x) ref += std::exp(e - 7.5);
  EXPECT_NEAR(flash::finish_lse(m, l), 7.5 + std::log(ref), 1e-14);
  EXPECT_EQ(flash::online_rescale(-HUGE_VAL, 3.0), 0.0);
  EXPECT_NEAR(flash::prob_from_lse(x[2], flash::finish_lse(m, l)), std::exp(5.0 - 7.5) / ref, 1e-15);
  EXPECT_EQ(flash::dscore(0.5, 2.0, 1.5, 0.25), 0.25 * 0.5 * (2.0 - 1.5));
}

}  // namespace
}  // namespace shardtrain
