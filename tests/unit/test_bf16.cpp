// bf16: the float -> bf16 rounding against an independent reference (nearest of the two
// neighbouring bf16 values, computed in double, ties to the even mantissa), and the CPU bf16
// backend (bf16 storage, float math) against the fp32 backend on the same, bf16-representable,
// inputs: each op must agree to bf16 resolution (relative 1e-2, the tolerance the GPU tests use).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/model/model.h"

namespace st = shardtrain;
using st::bf16;

// A config whose plain RoPE (rope_inv_freqs) has head size HD and base theta.
static shardtrain::ModelConfig rope_test_config(int HD, double theta) {
  shardtrain::ModelConfig c;
  c.hidden_size = HD;
  c.num_attention_heads = 1;
  c.rope_theta = theta;
  return c;
}

namespace {
float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// Reference rounding: the two bf16 candidates around f (truncation and its successor), pick the
// nearer in double; on a tie the one with an even last mantissa bit. Overflow past the largest
// finite bf16 goes to infinity as IEEE rounding does (the successor of 0x7f7f is 0x7f80 = inf).
uint16_t ref_round(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t lo = static_cast<uint16_t>(u >> 16);
  if ((u & 0xffffu) == 0) return lo;
  uint16_t hi = static_cast<uint16_t>(lo + 1);
  double x = f, a = bits_to_float(static_cast<uint32_t>(lo) << 16), b = bits_to_float(static_cast<uint32_t>(hi) << 16);
  if (std::isinf(b)) b = std::copysign(std::ldexp(1.0, 128), x);  // the "next" value past the max finite
  double da = std::fabs(x - a), db = std::fabs(x - b);
  if (da < db) return lo;
  if (db < da) return hi;
  return (lo & 1) ? hi : lo;
}
}  // namespace

TEST(Bf16, RoundingMatchesReference) {
  // The reference computes in double from the float: with MXCSR's DAZ bit, which every CPU backend
  // sets on the calling thread (cpu_backend.cpp prepare_threads), a denormal f reads as zero there.
  // Off for this test (whichever test made a backend before it), restored after.
#if defined(__SSE__)
  struct Csr {
    unsigned saved = _mm_getcsr();
    Csr() { _mm_setcsr(saved & ~0x8040u); }
    ~Csr() { _mm_setcsr(saved); }
  } no_ftz_daz;
#endif
  std::mt19937 rng(7);
  int checked = 0;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng();
    float f = bits_to_float(u);
    if (std::isnan(f)) continue;
    ASSERT_EQ(st::math::f32_to_bf16(f).bits, ref_round(f)) << std::hexfloat << f;
    ++checked;
  }
  // Ties both ways, the largest finite values, denormals, zeros, infinities.
  for (uint32_t u : {0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x7f7f7fffu, 0x7f7f8000u, 0x00000001u, 0x00018000u,
                     0x80000000u, 0x7f800000u, 0xff800000u, 0x3f800001u, 0xbf80ffffu})
    EXPECT_EQ(st::math::f32_to_bf16(bits_to_float(u)).bits, ref_round(bits_to_float(u))) << std::hex << u;
  EXPECT_GT(checked, 1900000);
  EXPECT_TRUE(std::isnan(st::math::bf16_to_f32(st::math::f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(st::math::bf16_to_f32(st::math::f32_to_bf16(bits_to_float(0x7f800001u)))));  // sNaN stays NaN
}

namespace {
// Random bf16 values (and the same values as float), uniform in [-scale, scale].
struct Pair {
  std::vector<bf16> h;
  std::vector<float> f;
};
Pair rnd(size_t n, std::mt19937& g, float scale = 1.0f, float offset = 0.0f) {
  std::uniform_real_distribution<float> d(-scale, scale);
  Pair p;
  for (size_t i = 0; i < n; ++i) {
    bf16 b = st::math::f32_to_bf16(offset + d(g));
    p.h.push_back(b);
    p.f.push_back(st::math::bf16_to_f32(b));
  }
  return p;
}

struct Dev {
  std::unique_ptr<st::Backend<bf16>> b = st::make_cpu_backend<bf16>();
  std::unique_ptr<st::Backend<float>> f = st::make_cpu_backend<float>();
};

// Every bf16 output within 1e-2 relative of the fp32 output (plus atol for values near zero).
void expect_close(const std::vector<bf16>& got, const std::vector<float>& want, const char* what, float atol = 1e-2f) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  size_t wi = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double g = st::math::bf16_to_f32(got[i]), w = want[i];
    double excess = std::fabs(g - w) - (1e-2 * std::fabs(w) + atol);
    if (excess > worst) { worst = excess; wi = i; }
  }
  EXPECT_LE(worst, 0.0) << what << ": element " << wi << " bf16 " << st::math::bf16_to_f32(got[wi]) << " vs fp32 "
                        << want[wi];
}
}  // namespace

TEST(Bf16Backend, GemmAllTransposesAgainstFp32) {
  Dev d;
  std::mt19937 g(1);
  const int M = 13, N = 11, K = 17, ld = 21;  // ld > every width: strided operands
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      Pair A = rnd(static_cast<size_t>(ld) * 32, g), B = rnd(static_cast<size_t>(ld) * 32, g), C = rnd(static_cast<size_t>(ld) * M, g);
      std::vector<bf16> Ch = C.h;
      std::vector<float> Cf = C.f;
      d.b->gemm(ta, tb, M, N, K, 0.5f, A.h.data(), ld, B.h.data(), ld, 2.0f, Ch.data(), ld);
      d.f->gemm(ta, tb, M, N, K, 0.5f, A.f.data(), ld, B.f.data(), ld, 2.0f, Cf.data(), ld);
      // Round the fp32 reference once: the bf16 GEMM must be exactly that (same sgemm inside).
      for (size_t i = 0; i < Cf.size(); ++i)
        ASSERT_EQ(Ch[i].bits, st::math::f32_to_bf16(Cf[i]).bits) << "ta " << ta << " tb " << tb << " i " << i;
    }
}

TEST(Bf16Backend, ElementwiseOpsAgainstFp32) {
  Dev d;
  std::mt19937 g(2);
  const int N = 24, C = 40, V = 50;
  // RMSNorm forward and backward (dx, dw accumulate).
  Pair x = rnd(N * C, g), w = rnd(C, g, 0.5f, 1.0f), dy = rnd(N * C, g), dx0 = rnd(N * C, g), dw0 = rnd(C, g);
  std::vector<bf16> ob(N * C), rb(N), dxb = dx0.h, dwb = dw0.h;
  std::vector<float> of(N * C), rf(N), dxf = dx0.f, dwf = dw0.f;
  d.b->rmsnorm_forward(ob.data(), rb.data(), x.h.data(), w.h.data(), N, C, 1e-5f);
  d.f->rmsnorm_forward(of.data(), rf.data(), x.f.data(), w.f.data(), N, C, 1e-5f);
  expect_close(ob, of, "rmsnorm_forward out");
  expect_close(rb, rf, "rmsnorm_forward rstd");
  // Backward from the bf16-rounded rstd on both sides.
  std::vector<float> rbf(N);
  for (int i = 0; i < N; ++i) rbf[i] = st::math::bf16_to_f32(rb[i]);
  d.b->rmsnorm_backward(dxb.data(), dwb.data(), dy.h.data(), x.h.data(), w.h.data(), rb.data(), N, C);
  d.f->rmsnorm_backward(dxf.data(), dwf.data(), dy.f.data(), x.f.data(), w.f.data(), rbf.data(), N, C);
  expect_close(dxb, dxf, "rmsnorm_backward dx");
  expect_close(dwb, dwf, "rmsnorm_backward dw", 5e-2f);  // a sum over 24 rows of O(1) terms
  // SwiGLU.
  Pair gt = rnd(N * C, g, 3.0f), up = rnd(N * C, g), dh = rnd(N * C, g);
  std::vector<bf16> hb(N * C), dgb(N * C), dub(N * C);
  std::vector<float> hf(N * C), dgf(N * C), duf(N * C);
  d.b->swiglu_forward(hb.data(), gt.h.data(), up.h.data(), hb.size());
  d.f->swiglu_forward(hf.data(), gt.f.data(), up.f.data(), hf.size());
  expect_close(hb, hf, "swiglu_forward");
  d.b->swiglu_backward(dgb.data(), dub.data(), dh.h.data(), gt.h.data(), up.h.data(), hb.size());
  d.f->swiglu_backward(dgf.data(), duf.data(), dh.f.data(), gt.f.data(), up.f.data(), hf.size());
  expect_close(dgb, dgf, "swiglu_backward dgate");
  expect_close(dub, duf, "swiglu_backward dup");
  // Causal softmax forward and backward (rows of 9, zeros above the diagonal).
  const int R = 3, T = 9;
  Pair s = rnd(R * T * T, g, 4.0f), ds = rnd(R * T * T, g);
  std::vector<bf16> sb = s.h, dsb = ds.h;
  std::vector<float> sf = s.f, dsf = ds.f;
  d.b->softmax_causal_forward(sb.data(), R, T, 0.3f);
  d.f->softmax_causal_forward(sf.data(), R, T, 0.3f);
  expect_close(sb, sf, "softmax_causal_forward");
  std::vector<float> sbf(sb.size());
  for (size_t i = 0; i < sb.size(); ++i) sbf[i] = st::math::bf16_to_f32(sb[i]);
  d.b->softmax_causal_backward(dsb.data(), sb.data(), R, T, 0.3f);
  d.f->softmax_causal_backward(dsf.data(), sbf.data(), R, T, 0.3f);
  expect_close(dsb, dsf, "softmax_causal_backward");
  // Cross-entropy, in place (dlogits aliases logits), loss and gradient.
  Pair lg = rnd(N * V, g, 5.0f);
  std::vector<int32_t> tgt(N);
  for (int i = 0; i < N; ++i) tgt[i] = static_cast<int32_t>(g() % V);
  std::vector<bf16> lb = lg.h;
  std::vector<float> lf = lg.f;
  double Lb = d.b->cross_entropy(lb.data(), lb.data(), tgt.data(), N, V, 0.25f);
  double Lf = d.f->cross_entropy(lf.data(), lf.data(), tgt.data(), N, V, 0.25f);
  EXPECT_NEAR(Lb, Lf, 1e-5 * std::fabs(Lf)) << "same inputs, float math: only rounding order differs";
  expect_close(lb, lf, "cross_entropy dlogits", 1e-3f);
  // RoPE forward then backward on [B=2, T=5, H=3, HD=8], tables rounded to bf16 as the model does.
  std::vector<float> cs, sn;
  st::rope_tables(cs, sn, 5, st::rope_inv_freqs(rope_test_config(8, 10000.0)));
  std::vector<bf16> csb(cs.size()), snb(sn.size());
  for (size_t i = 0; i < cs.size(); ++i) { csb[i] = st::math::f32_to_bf16(cs[i]); snb[i] = st::math::f32_to_bf16(sn[i]); cs[i] = st::math::bf16_to_f32(csb[i]); sn[i] = st::math::bf16_to_f32(snb[i]); }
  Pair q = rnd(2 * 5 * 3 * 8, g);
  std::vector<bf16> qb = q.h;
  std::vector<float> qf = q.f;
  d.b->rope_forward(qb.data(), csb.data(), snb.data(), 2, 5, 3, 8);
  d.f->rope_forward(qf.data(), cs.data(), sn.data(), 2, 5, 3, 8);
  expect_close(qb, qf, "rope_forward");
  d.b->rope_backward(qb.data(), csb.data(), snb.data(), 2, 5, 3, 8);
  expect_close(qb, q.f, "rope_backward(rope_forward(x)) = x");
  // Conversions between the fp32 master and bf16.
  std::vector<float> master(100);
  for (auto& v : master) v = std::uniform_real_distribution<float>(-3, 3)(g);
  std::vector<bf16> cast(100);
  d.b->from_f32(cast.data(), master.data(), 100);
  for (size_t i = 0; i < 100; ++i) ASSERT_EQ(cast[i].bits, st::math::f32_to_bf16(master[i]).bits);
  std::vector<float> acc = master;
  d.b->add_to_f32(acc.data(), 0.5f, cast.data(), 100);
  for (size_t i = 0; i < 100; ++i) ASSERT_EQ(acc[i], master[i] + 0.5f * st::math::bf16_to_f32(cast[i]));
}
