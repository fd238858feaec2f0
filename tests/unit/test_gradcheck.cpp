// Gradient checks: every hand-written backward of the CPU backend, attention and the whole Llama
// model, in double precision, against central finite differences.
//
// Method (per op): random inputs from a fixed-seed std::mt19937, a scalar L = sum(out * R) with a
// fixed random R, the analytic gradient from the backward op, and the numerical gradient
// (L(x + h) - L(x - h)) / 2h, h = 1e-5, for every input element (every tensor here is small).
// An element passes when |a - n| / max(1e-8, |a| + |n|) < 1e-6 or |a - n| < 1e-9.
// Each test prints how many elements it checked and the largest errors it saw.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../test_env.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/model/config.h"
#include "shardtrain/model/model.h"
#include "shardtrain/shard/shard.h"

namespace shardtrain {
namespace {

using Vec = std::vector<double>;

// A config whose plain RoPE (rope_inv_freqs) has head size HD and base theta.
shardtrain::ModelConfig rope_test_config(int HD, double theta) {
  shardtrain::ModelConfig c;
  c.hidden_size = HD;
  c.num_attention_heads = 1;
  c.rope_theta = theta;
  return c;
}

constexpr double kH = 1e-5;       // finite-difference step
constexpr double kRelTol = 1e-6;  // relative error bound
constexpr double kAbsTol = 1e-9;  // absolute error bound (either one suffices)

Vec randn(size_t n, std::mt19937& g, double sd = 1.0, double mean = 0.0) {
  std::normal_distribution<double> nd(mean, sd);
  Vec v(n);
  for (auto& x : v) x = nd(g);
  return v;
}

double dot(const double* a, const double* b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Central difference of loss() with respect to *p; restores *p.
template <class F> double central_diff(double* p, F&& loss) {
  const double old = *p;
  *p = old + kH;
  const double lp = loss();
  *p = old - kH;
  const double lm = loss();
  *p = old;
  return (lp - lm) / (2 * kH);
}

// The five-point stencil (Abramowitz & Stegun 25.3.6): truncation error O(h^4) where central_diff's
// is O(h^2); for the models whose third derivatives are large enough (the MoE blocks' products of
// routing weights and experts) that h^2 f''' / 6 reaches the tolerance at h = 1e-5.
template <class F> double central_diff4(double* p, F&& loss) {
  const double old = *p;
  double l[4];
  const double at[4] = {old + 2 * kH, old + kH, old - kH, old - 2 * kH};
  for (int i = 0; i < 4; ++i) {
    *p = at[i];
    l[i] = loss();
  }
  *p = old;
  return (-l[0] + 8 * l[1] - 8 * l[2] + l[3]) / (12 * kH);
}

// Collects per-element comparisons, reports the first failures and the largest errors.
class GradReport {
 public:
  explicit GradReport(std::string name) : name_(std::move(name)) {}

  void check(const std::string& what, size_t i, double analytic, double numeric) {
    const double abs_err = std::fabs(analytic - numeric);
    const double mag = std::fabs(analytic) + std::fabs(numeric);
    const double rel_err = abs_err / std::max(1e-8, mag);
    ++n_;
    max_abs_ = std::max(max_abs_, abs_err);
    // Relative error is only meaningful away from zero; near zero the absolute bound decides.
    if (mag > 1e-6) max_rel_ = std::max(max_rel_, rel_err);
    // Closeness to failing: < 1 passes; the larger the closer to the tolerance.
    worst_ = std::max(worst_, std::min(rel_err / kRelTol, abs_err / kAbsTol));
    if (!(rel_err < kRelTol || abs_err < kAbsTol)) {
      ++fails_;
      if (fails_ <= 10)
        ADD_FAILURE() << name_ << ": " << what << "[" << i << "] analytic " << analytic << " numeric " << numeric
                      << " abs err " << abs_err << " rel err " << rel_err;
    }
  }

  void finish() {
    std::printf("[ GradCheck ] %-24s %5d elements, max abs err %.2e, max rel err %.2e (|a|+|n| > 1e-6), "
                "worst min(rel/1e-6, abs/1e-9) %.3f\n",
                name_.c_str(), n_, max_abs_, max_rel_, worst_);
    EXPECT_GT(n_, 0) << name_;
    EXPECT_EQ(fails_, 0) << name_ << ": " << fails_ << " of " << n_ << " elements outside tolerance";
  }

 private:
  std::string name_;
  int n_ = 0, fails_ = 0;
  double max_abs_ = 0, max_rel_ = 0, worst_ = 0;
};

// ---- 1. embedding ---------------------------------------------------------------------------
TEST(GradCheck, Embedding) {
  auto be = make_cpu_backend<double>();
  std::mt19937 g(101);
  const int V = 7, C = 5, N = 9;
  // Repeated ids (2, 5) accumulate; row 6 is never looked up.
  const std::vector<int32_t> tok = {2, 0, 5, 2, 1, 3, 5, 4, 2};
  Vec table = randn(static_cast<size_t>(V) * C, g);
  const Vec R = randn(static_cast<size_t>(N) * C, g);
  Vec out(static_cast<size_t>(N) * C);
  auto loss = [&] {
    be->embedding_forward(out.data(), tok.data(), table.data(), N, C);
    return dot(out.data(), R.data(), out.size());
  };
  loss();
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) ASSERT_EQ(out[i * C + c], table[tok[i] * C + c]);

  // Parameter gradients accumulate: start from a non-zero buffer and subtract it afterwards.
  const Vec g0 = randn(table.size(), g);
  Vec dtable = g0;
  be->embedding_backward(dtable.data(), tok.data(), R.data(), N, C);
  for (int c = 0; c < C; ++c) EXPECT_EQ(dtable[6 * C + c], g0[6 * C + c]) << "unused row must stay untouched";

  GradReport rep("embedding dtable");
  for (size_t i = 0; i < table.size(); ++i) rep.check("dtable", i, dtable[i] - g0[i], central_diff(&table[i], loss));
  rep.finish();
}

// ---- 2. RMSNorm -------------------------------------------------------------------------------
TEST(GradCheck, RMSNorm) {
  auto be = make_cpu_backend<double>();
  std::mt19937 g(202);
  const int N = 6, C = 10;
  const double eps = 1e-5;
  Vec x = randn(static_cast<size_t>(N) * C, g);
  Vec w = randn(C, g, 0.3, 1.0);
  const Vec R = randn(x.size(), g);
  Vec out(x.size()), rstd(N);
  auto loss = [&] {
    be->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
    return dot(out.data(), R.data(), out.size());
  };
  loss();
  for (int i = 0; i < N; ++i) {  // forward against the definition
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += x[i * C + c] * x[i * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    EXPECT_NEAR(rstd[i], r, 1e-14 * r);
    for (int c = 0; c < C; ++c) EXPECT_NEAR(out[i * C + c], x[i * C + c] * r * w[c], 1e-13);
  }

  Vec dx(x.size(), 0.0), dw(C, 0.0);
  be->rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);

  GradReport rep("rmsnorm dx, dw");
  for (size_t i = 0; i < x.size(); ++i) rep.check("dx", i, dx[i], central_diff(&x[i], loss));
  for (size_t i = 0; i < w.size(); ++i) rep.check("dw", i, dw[i], central_diff(&w[i], loss));
  rep.finish();

  // Both dx and dw accumulate (+=).
  const Vec px = randn(x.size(), g), pw = randn(C, g);
  Vec dx2 = px, dw2 = pw;
  loss();  // restore rstd for the unperturbed x
  be->rmsnorm_backward(dx2.data(), dw2.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(dx2[i], px[i] + dx[i], 1e-13) << "dx must accumulate";
  for (int c = 0; c < C; ++c) EXPECT_NEAR(dw2[c], pw[c] + dw[c], 1e-13) << "dw must accumulate";
}

// ---- 3. RoPE ------------------------------------------------------------------------------------
// Hugging Face apply_rotary_pos_emb written out: emb = cat(freqs, freqs), freqs[j] = t * inv_freq[j],
// inv_freq[j] = theta^(-2j/HD); out = x * cos(emb) + rotate_half(x) * sin(emb), rotate_half(x) =
// cat(-x[HD/2:], x[:HD/2]).
Vec rope_reference(const Vec& x, int B, int T, int H, int HD, double theta) {
  const int half = HD / 2;
  Vec out(x.size());
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        const size_t base = ((static_cast<size_t>(b) * T + t) * H + h) * HD;
        for (int d = 0; d < HD; ++d) {
          const double inv_freq = std::pow(theta, -2.0 * (d % half) / HD);
          const double ang = static_cast<double>(t) * inv_freq;
          const double rot = d < half ? -x[base + d + half] : x[base + d - half];
          out[base + d] = x[base + d] * std::cos(ang) + rot * std::sin(ang);
        }
      }
  return out;
}

TEST(GradCheck, RoPE) {
  auto be = make_cpu_backend<double>();
  std::mt19937 g(303);
  const int B = 2, T = 7, H = 3, HD = 8;

  // Forward against the independent reference, for two bases.
  for (double theta : {10000.0, 500000.0}) {
    Vec cs, sn;
    rope_tables(cs, sn, T, rope_inv_freqs(rope_test_config(HD, theta)));
    ASSERT_EQ(cs.size(), static_cast<size_t>(T) * HD / 2);
    const Vec x0 = randn(static_cast<size_t>(B) * T * H * HD, g);
    Vec x = x0;
    be->rope_forward(x.data(), cs.data(), sn.data(), B, T, H, HD);
    const Vec ref = rope_reference(x0, B, T, H, HD, theta);
    double max_err = 0;
    for (size_t i = 0; i < x.size(); ++i) max_err = std::max(max_err, std::fabs(x[i] - ref[i]));
    std::printf("[ GradCheck ] rope forward vs HF reference (theta %g): max abs err %.3e\n", theta, max_err);
    EXPECT_LT(max_err, 1e-12) << "theta " << theta;
  }

  Vec cs, sn;
  rope_tables(cs, sn, T, rope_inv_freqs(rope_test_config(HD, 10000.0)));
  Vec x = randn(static_cast<size_t>(B) * T * H * HD, g);
  const Vec R = randn(x.size(), g);
  Vec tmp(x.size());
  auto loss = [&] {
    tmp = x;
    be->rope_forward(tmp.data(), cs.data(), sn.data(), B, T, H, HD);
    return dot(tmp.data(), R.data(), tmp.size());
  };
  Vec dx = R;  // rope_backward turns d(rotated x) into d(x) in place
  be->rope_backward(dx.data(), cs.data(), sn.data(), B, T, H, HD);

  GradReport rep("rope dx");
  for (size_t i = 0; i < x.size(); ++i) rep.check("dx", i, dx[i], central_diff(&x[i], loss));
  rep.finish();
}

// ---- 4. causal softmax ----------------------------------------------------------------------
TEST(GradCheck, CausalSoftmax) {
  auto be = make_cpu_backend<double>();
  std::mt19937 g(404);
  const int Rn = 3, T = 6;
  const double scale = 0.37;
  const size_t n = static_cast<size_t>(Rn) * T * T;
  Vec z = randn(n, g, 2.0);      // raw (pre-scale) scores, upper triangle included
  const Vec Rw = randn(n, g);    // non-zero above the diagonal too
  Vec p(n);
  auto loss = [&] {
    p = z;
    be->softmax_causal_forward(p.data(), Rn, T, scale);
    return dot(p.data(), Rw.data(), n);
  };
  loss();
  for (int r = 0; r < Rn; ++r)  // forward against the definition
    for (int t = 0; t < T; ++t) {
      const size_t o = (static_cast<size_t>(r) * T + t) * T;
      double mx = -INFINITY, sum = 0;
      for (int s = 0; s <= t; ++s) mx = std::max(mx, scale * z[o + s]);
      for (int s = 0; s <= t; ++s) sum += std::exp(scale * z[o + s] - mx);
      for (int s = 0; s <= t; ++s) EXPECT_NEAR(p[o + s], std::exp(scale * z[o + s] - mx) / sum, 1e-15);
      for (int s = t + 1; s < T; ++s) EXPECT_EQ(p[o + s], 0.0) << "masked probability";
    }

  Vec dz = Rw;  // in: d(probabilities); out: d(raw scores)
  be->softmax_causal_backward(dz.data(), p.data(), Rn, T, scale);

  GradReport rep("causal softmax dscores");
  int masked = 0;
  for (int r = 0; r < Rn; ++r)
    for (int t = 0; t < T; ++t)
      for (int s = 0; s < T; ++s) {
        const size_t i = (static_cast<size_t>(r) * T + t) * T + s;
        const double num = central_diff(&z[i], loss);
        rep.check("dz", i, dz[i], num);
        if (s > t) {  // above the diagonal: no influence on L, and the backward must write exact zeros
          ++masked;
          EXPECT_EQ(num, 0.0) << "FD of a masked score";
          EXPECT_EQ(dz[i], 0.0) << "gradient of masked score r=" << r << " t=" << t << " s=" << s;
        }
      }
  EXPECT_EQ(masked, Rn * T * (T - 1) / 2);
  rep.finish();
}

// ---- 5. attention with GQA ------------------------------------------------------------------
TEST(GradCheck, AttentionGQA) {
  auto be = make_cpu_backend<double>();
  std::mt19937 g(505);
  const int B = 2, T = 5, NH = 4, NKV = 2, HD = 6, G = NH / NKV;
  const int ldq = NH * HD, ldk = NKV * HD;
  const size_t BT = static_cast<size_t>(B) * T, nA = static_cast<size_t>(B) * NH * T * T;
  Vec q = randn(BT * ldq, g), k = randn(BT * ldk, g), v = randn(BT * ldk, g);
  const Vec R = randn(BT * ldq, g);
  Vec att(nA), y(BT * ldq);
  auto loss = [&] {
    attention_forward<double>(*be, q.data(), k.data(), v.data(), att.data(), y.data(), B, T, NH, NKV, HD);
    return dot(y.data(), R.data(), y.size());
  };
  loss();

  // Forward against a naive triple loop.
  double max_err_y = 0, max_err_att = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      const int kh = h / G;
      for (int t = 0; t < T; ++t) {
        std::vector<double> s(T, 0.0);
        double mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {
          double acc = 0;
          for (int d = 0; d < HD; ++d)
            acc += q[(b * T + t) * ldq + h * HD + d] * k[(b * T + u) * ldk + kh * HD + d];
          s[u] = acc / std::sqrt(static_cast<double>(HD));
          mx = std::max(mx, s[u]);
        }
        double sum = 0;
        for (int u = 0; u <= t; ++u) sum += (s[u] = std::exp(s[u] - mx));
        for (int u = 0; u < T; ++u) {
          const double pr = u <= t ? s[u] / sum : 0.0;
          max_err_att = std::max(max_err_att, std::fabs(att[((static_cast<size_t>(b) * NH + h) * T + t) * T + u] - pr));
        }
        for (int d = 0; d < HD; ++d) {
          double acc = 0;
          for (int u = 0; u <= t; ++u) acc += s[u] / sum * v[(b * T + u) * ldk + kh * HD + d];
          max_err_y = std::max(max_err_y, std::fabs(y[(b * T + t) * ldq + h * HD + d] - acc));
        }
      }
    }
  std::printf("[ GradCheck ] attention forward vs naive loop: max abs err y %.3e, att %.3e\n", max_err_y, max_err_att);
  EXPECT_LT(max_err_y, 1e-13);
  EXPECT_LT(max_err_att, 1e-14);

  // dq, dk, dv are written (=): fill them with garbage first.
  Vec datt(nA, 3.0), dq(q.size(), 7.0), dk(k.size(), -5.0), dv(v.size(), 11.0);
  attention_backward<double>(*be, q.data(), k.data(), v.data(), att.data(), R.data(), datt.data(), dq.data(),
                             dk.data(), dv.data(), B, T, NH, NKV, HD);

  GradReport rep("attention dq, dk, dv");
  for (size_t i = 0; i < q.size(); ++i) rep.check("dq", i, dq[i], central_diff(&q[i], loss));
  for (size_t i = 0; i < k.size(); ++i) rep.check("dk", i, dk[i], central_diff(&k[i], loss));
  for (size_t i = 0; i < v.size(); ++i) rep.check("dv", i, dv[i], central_diff(&v[i], loss));
  rep.finish();
}

// ---- 6. SwiGLU --------------------------------------------------------------------------------
TEST(GradCheck, SwiGLU) {
  auto be = make_cpu_backend<double>();
  std::mt19937 g(606);
  const size_t n = 48;
  Vec gate = randn(n, g, 3.0), up = randn(n, g);
  const Vec R = randn(n, g);
  Vec h(n);
  auto loss = [&] {
    be->swiglu_forward(h.data(), gate.data(), up.data(), n);
    return dot(h.data(), R.data(), n);
  };
  loss();
  for (size_t i = 0; i < n; ++i) EXPECT_NEAR(h[i], gate[i] / (1.0 + std::exp(-gate[i])) * up[i], 1e-14);

  Vec dgate(n, 9.0), dup(n, -9.0);  // written (=), not accumulated
  be->swiglu_backward(dgate.data(), dup.data(), R.data(), gate.data(), up.data(), n);

  GradReport rep("swiglu dgate, dup");
  for (size_t i = 0; i < n; ++i) rep.check("dgate", i, dgate[i], central_diff(&gate[i], loss));
  for (size_t i = 0; i < n; ++i) rep.check("dup", i, dup[i], central_diff(&up[i], loss));
  rep.finish();
}

// ---- 7. cross-entropy -------------------------------------------------------------------------
TEST(GradCheck, CrossEntropy) {
  auto be = make_cpu_backend<double>();
  std::mt19937 g(707);
  const int N = 6, V = 9;
  const double gs = 0.25;
  Vec logits = randn(static_cast<size_t>(N) * V, g, 2.0);
  const std::vector<int32_t> tgt = {3, 0, 8, 3, 5, 1};

  // Loss against log-sum-exp written out.
  double ref = 0;
  for (int i = 0; i < N; ++i) {
    double mx = -INFINITY, s = 0;
    for (int v = 0; v < V; ++v) mx = std::max(mx, logits[i * V + v]);
    for (int v = 0; v < V; ++v) s += std::exp(logits[i * V + v] - mx);
    ref += mx + std::log(s) - logits[i * V + tgt[i]];
  }
  auto loss = [&] { return be->cross_entropy(nullptr, logits.data(), tgt.data(), N, V, gs); };
  EXPECT_NEAR(loss(), ref, 1e-13 * ref);

  Vec dl(logits.size(), 42.0);  // written (=)
  const double l1 = be->cross_entropy(dl.data(), logits.data(), tgt.data(), N, V, gs);
  EXPECT_EQ(l1, loss()) << "loss must not depend on whether dlogits is requested";

  // dlogits = d(loss)/d(logits) * grad_scale.
  GradReport rep("cross-entropy dlogits");
  for (size_t i = 0; i < logits.size(); ++i)
    rep.check("dlogits", i, dl[i], gs * central_diff(&logits[i], loss));
  rep.finish();

  // In place (dlogits aliasing logits) gives the same loss and gradient.
  Vec alias = logits;
  const double l2 = be->cross_entropy(alias.data(), alias.data(), tgt.data(), N, V, gs);
  EXPECT_EQ(l2, l1);
  for (size_t i = 0; i < alias.size(); ++i) EXPECT_NEAR(alias[i], dl[i], 1e-15) << "aliased dlogits[" << i << "]";

  // Shift invariance with logits that overflow a naive exp (e^800 > DBL_MAX): loss and gradient
  // of a row do not change when a constant is added to it.
  Vec shifted = logits;
  for (int v = 0; v < V; ++v) shifted[2 * V + v] += 800.0;
  Vec ds(shifted.size());
  const double l3 = be->cross_entropy(ds.data(), shifted.data(), tgt.data(), N, V, gs);
  EXPECT_NEAR(l3, l1, 1e-12 * l1);
  for (size_t i = 0; i < ds.size(); ++i) EXPECT_NEAR(ds[i], dl[i], 1e-13) << "shifted dlogits[" << i << "]";
}

// ---- 8, 9. the whole model ------------------------------------------------------------------
ModelConfig tiny_config(bool tied) {
  ModelConfig c;
  c.name = "gradcheck";
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = tied;
  c.bos_token_id = 0;
  c.eos_token_ids = {1};
  return c;
}

// Shard = whole unit at world size 1: element i of parameter `slot` is at param_shard(u) + offset + i.
Vec grad_of(Fsdp<double>& f, const std::string& name) {
  for (int u = 0; u < f.num_units(); ++u)
    for (const auto& slot : f.plan().units[u].params)
      if (slot.spec.name == name) {
        const double* gp = f.grad_shard(u) + slot.offset;
        return Vec(gp, gp + slot.numel);
      }
  ADD_FAILURE() << "no parameter " << name;
  return {};
}

// init_params gives std-0.02 matrices and unit norms: attention is then almost uniform and many
// gradients are ~1e-6, too small for a meaningful relative check. Spread the weights out (matrices
// x15 -> std 0.3, norm weights 1 + N(0, 0.2^2)) so every path carries a sizeable gradient.
void spread_params(Fsdp<double>& f, uint64_t seed) {
  std::mt19937 g(static_cast<uint32_t>(seed));
  std::normal_distribution<double> nd(0.0, 0.2);
  for (int u = 0; u < f.num_units(); ++u)
    for (const auto& slot : f.plan().units[u].params) {
      double* p = f.param_shard(u) + slot.offset;
      for (int64_t i = 0; i < slot.numel; ++i) p[i] = slot.spec.init == Init::Ones ? 1.0 + nd(g) : 15.0 * p[i];
    }
}

struct Batch {
  int B = 2, T = 5;
  std::vector<int32_t> tokens, targets;
};

// Inputs use ids [0, 8) only, so embedding rows 8..10 get no lookup gradient; targets use all 11.
Batch make_batch() {
  Batch b;
  std::mt19937 g(808);
  std::uniform_int_distribution<int> in(0, 7), out(0, 10);
  for (int i = 0; i < b.B * b.T; ++i) {
    b.tokens.push_back(in(g));
    b.targets.push_back(out(g));
  }
  return b;
}

// Training forward + backward, then FD over every element of every parameter (perturbing the
// shard directly, loss from an eval forward). Leaves f's gradient shards holding the analytic
// gradient. Returns the training loss.
double check_model(Fsdp<double>& f, LlamaModel<double>& m, const Batch& bt, GradReport& rep) {
  f.zero_grads();
  m.forward(f, bt.tokens.data(), bt.B, bt.T);
  const double loss = m.head_backward(f, bt.targets.data(), 1.0);
  m.backward(f);
  std::vector<Vec> grads;
  for (int u = 0; u < f.num_units(); ++u) {
    const int64_t S = f.plan().units[u].shard_size;
    grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + S);
  }
  auto eval = [&] {
    m.forward(f, bt.tokens.data(), bt.B, bt.T);
    return m.loss(f, bt.targets.data());
  };
  EXPECT_NEAR(eval(), loss, 1e-13 * loss) << "train and eval forward disagree";

  for (int u = 0; u < f.num_units(); ++u)
    for (const auto& slot : f.plan().units[u].params) {
      int checked = 0;
      double gnorm = 0;
      for (int64_t i = 0; i < slot.numel; ++i) {
        const double a = grads[u][static_cast<size_t>(slot.offset + i)];
        rep.check(slot.spec.name, static_cast<size_t>(i), a, central_diff(f.param_shard(u) + slot.offset + i, eval));
        ++checked;
        gnorm += a * a;
      }
      EXPECT_GE(checked, 3) << slot.spec.name;
      EXPECT_GT(gnorm, 1e-12) << slot.spec.name << ": gradient is (almost) zero";
    }

  // grad_scale multiplies the gradient; parameter shards are unchanged by the FD loop.
  f.zero_grads();
  m.forward(f, bt.tokens.data(), bt.B, bt.T);
  EXPECT_NEAR(m.head_backward(f, bt.targets.data(), 0.25), loss, 1e-13 * loss);
  m.backward(f);
  for (int u = 0; u < f.num_units(); ++u)
    for (int64_t i = 0; i < f.plan().units[u].numel; ++i)
      EXPECT_NEAR(f.grad_shard(u)[i], 0.25 * grads[u][static_cast<size_t>(i)], 1e-13) << "grad_scale, unit " << u;

  // Leave the unscaled gradient in the shards for the caller.
  for (int u = 0; u < f.num_units(); ++u)
    std::copy(grads[u].begin(), grads[u].end(), f.grad_shard(u));
  return loss;
}

TEST(GradCheck, ModelTiedHead) {
  Comm& comm = testing::comm();
  if (comm.world_size() != 1) GTEST_SKIP() << "single-rank FD check";
  auto be = make_cpu_backend<double>();
  const ModelConfig cfg = tiny_config(true);
  validate(cfg, "gradcheck");
  Fsdp<double> f(*be, comm, ShardPlan::build(llama_units(cfg), 1));
  ASSERT_EQ(f.num_units(), cfg.num_hidden_layers + 2);
  ASSERT_EQ(f.plan().units.back().params.size(), 1u) << "tied head: model.norm holds only model.norm.weight";
  f.init_params(2024);
  spread_params(f, 7);
  LlamaModel<double> m(cfg, *be);
  const Batch bt = make_batch();

  GradReport rep("model (tied head)");
  const double loss = check_model(f, m, bt, rep);
  rep.finish();

  // The tied embedding gradient is lookup + LM head. The untied model with lm_head.weight set to a
  // copy of the embedding computes the same function and splits the two contributions apart.
  const ModelConfig cu = tiny_config(false);
  Fsdp<double> f2(*be, comm, ShardPlan::build(llama_units(cu), 1));
  for (const auto& unit : f.plan().units)
    for (const auto& slot : unit.params) f2.set_param(slot.spec.name, f.gather_param(slot.spec.name));
  f2.set_param("lm_head.weight", f.gather_param("model.embed_tokens.weight"));
  LlamaModel<double> m2(cu, *be);
  f2.zero_grads();
  m2.forward(f2, bt.tokens.data(), bt.B, bt.T);
  const double loss2 = m2.head_backward(f2, bt.targets.data(), 1.0);
  m2.backward(f2);
  EXPECT_NEAR(loss2, loss, 1e-13 * loss);

  const int C = cfg.hidden_size, V = cfg.vocab_size;
  const Vec tied = grad_of(f, "model.embed_tokens.weight");
  const Vec lookup = grad_of(f2, "model.embed_tokens.weight");
  const Vec head = grad_of(f2, "lm_head.weight");
  ASSERT_EQ(tied.size(), static_cast<size_t>(V) * C);
  std::vector<bool> used(V, false);
  for (int32_t t : bt.tokens) used[t] = true;
  double lookup_norm = 0, head_norm = 0;
  for (int r = 0; r < V; ++r) {
    double row_lookup = 0, row_head = 0;
    for (int c = 0; c < C; ++c) {
      const size_t i = static_cast<size_t>(r) * C + c;
      EXPECT_NEAR(tied[i], lookup[i] + head[i], 1e-13) << "tied embedding grad != lookup + head at row " << r;
      row_lookup += lookup[i] * lookup[i];
      row_head += head[i] * head[i];
    }
    if (used[r]) {
      EXPECT_GT(row_lookup, 1e-12) << "row " << r << " is looked up";
    } else {
      EXPECT_EQ(row_lookup, 0.0) << "row " << r << " is never looked up";
    }
    EXPECT_GT(row_head, 1e-12) << "every row gets an LM-head gradient, row " << r;
    lookup_norm += row_lookup;
    head_norm += row_head;
  }
  std::printf("[ GradCheck ] tied embedding grad: |lookup part| %.3e, |head part| %.3e\n", std::sqrt(lookup_norm),
              std::sqrt(head_norm));
  ASSERT_FALSE(used[V - 1]) << "the batch should leave some rows without lookups";

  // Every other parameter's gradient is the same in both models.
  for (const auto& unit : f.plan().units)
    for (const auto& slot : unit.params) {
      if (slot.spec.name == "model.embed_tokens.weight") continue;
      const Vec a = grad_of(f, slot.spec.name), b = grad_of(f2, slot.spec.name);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-13) << slot.spec.name << "[" << i << "]";
    }
}

TEST(GradCheck, ModelUntiedHead) {
  Comm& comm = testing::comm();
  if (comm.world_size() != 1) GTEST_SKIP() << "single-rank FD check";
  auto be = make_cpu_backend<double>();
  const ModelConfig cfg = tiny_config(false);
  validate(cfg, "gradcheck");
  Fsdp<double> f(*be, comm, ShardPlan::build(llama_units(cfg), 1));
  const UnitPlan& head_unit = f.plan().units.back();
  ASSERT_NO_THROW(head_unit.param("lm_head.weight"));
  f.init_params(2025);
  spread_params(f, 8);
  LlamaModel<double> m(cfg, *be);
  const Batch bt = make_batch();

  GradReport rep("model (untied head)");
  check_model(f, m, bt, rep);
  rep.finish();

  // Untied: the embedding gradient is the lookup alone, so rows never looked up stay zero.
  const Vec ge = grad_of(f, "model.embed_tokens.weight");
  std::vector<bool> used(cfg.vocab_size, false);
  for (int32_t t : bt.tokens) used[t] = true;
  for (int r = 0; r < cfg.vocab_size; ++r) {
    if (used[r]) continue;
    for (int c = 0; c < cfg.hidden_size; ++c)
      EXPECT_EQ(ge[static_cast<size_t>(r) * cfg.hidden_size + c], 0.0) << "row " << r << " is never looked up";
  }
}

// Activation checkpointing, both attention paths and a loss chunk that does not divide the tokens:
// every combination against finite differences (the recomputed activations, the chunked head's
// backward (head_backward) and the exact path's recomputed probabilities all enter the gradient).
TEST(GradCheck, ModelRecomputeModesAttentionPathsAndLossChunks) {
  Comm& comm = testing::comm();
  if (comm.world_size() != 1) GTEST_SKIP() << "single-rank FD check";
  auto be = make_cpu_backend<double>();
  struct Case { Recompute r; AttentionKind a; int chunk; bool tied; };
  for (const Case& k : {Case{Recompute::Full, AttentionKind::Tiled, 3, true},
                        Case{Recompute::Selective, AttentionKind::Exact, 4, false},
                        Case{Recompute::Full, AttentionKind::Exact, 0, false},
                        Case{Recompute::Selective, AttentionKind::Tiled, 7, true}}) {
    const ModelConfig cfg = tiny_config(k.tied);
    Fsdp<double> f(*be, comm, ShardPlan::build(llama_units(cfg), 1));
    f.init_params(2026);
    spread_params(f, 9);
    LlamaModel<double> m(cfg, *be, ModelOptions{k.r, k.a, k.chunk});
    GradReport rep(std::string("model, recompute ") + recompute_name(k.r) + ", " + attention_name(k.a) +
                   " attention, loss chunk " + std::to_string(k.chunk) + (k.tied ? ", tied" : ", untied"));
    check_model(f, m, make_batch(), rep);
    rep.finish();
  }
}

// Qwen3's q/k norm (ModelConfig::qk_norm): the per-head RMSNorm of q and k before RoPE, its
// weights q_norm / k_norm [HD] and everything upstream of it, against finite differences, in the
// mode that keeps everything and in the one that recomputes the block (the norm's q, k and rstd
// from the recomputed forward).
TEST(GradCheck, ModelQkNorm) {
  Comm& comm = testing::comm();
  if (comm.world_size() != 1) GTEST_SKIP() << "single-rank FD check";
  auto be = make_cpu_backend<double>();
  for (Recompute r : {Recompute::None, Recompute::Full}) {
    ModelConfig cfg = tiny_config(false);
    cfg.architecture = "Qwen3ForCausalLM";
    cfg.qk_norm = true;
    cfg.num_attention_heads = 4;  // HD 2 from C 8 would leave one rotary pair: take head_dim 4
    cfg.num_key_value_heads = 2;
    cfg.head_dim_override = 4;
    validate(cfg, "gradcheck qk_norm");
    Fsdp<double> f(*be, comm, ShardPlan::build(llama_units(cfg), 1));
    ASSERT_EQ(f.plan().units[1].param("model.layers.0.self_attn.q_norm.weight").numel, 4);
    ASSERT_EQ(f.plan().units[1].param("model.layers.0.self_attn.k_norm.weight").numel, 4);
    f.init_params(2027);
    spread_params(f, 10);
    LlamaModel<double> m(cfg, *be, ModelOptions{r, AttentionKind::Tiled, 0});
    GradReport rep(std::string("model, q/k norm, recompute ") + recompute_name(r));
    check_model(f, m, make_batch(), rep);
    rep.finish();
  }
}

// Mixture of experts (issue 56): the router, the experts, the shared attention and everything
// upstream against central differences (five-point) of CE + coef x the load-balancing loss + zc x
// the router z-loss, with their gradients given by set_aux_grad_scale. Qwen3-MoE style (q/k norm, block 0 dense by
// mlp_only_layers, no renormalization) and Mixtral style (every block MoE, renormalized), in every
// recompute mode and both aux scopes.
ModelConfig moe_config(bool mixtral) {
  ModelConfig c = tiny_config(false);
  c.architecture = mixtral ? "MixtralForCausalLM" : "Qwen3MoeForCausalLM";
  c.qk_norm = !mixtral;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = mixtral ? c.intermediate_size : 6;
  c.norm_topk_prob = mixtral;
  c.router_aux_loss_coef = 0.25;
  if (!mixtral) c.mlp_only_layers = {0};
  return c;
}

TEST(GradCheck, ModelMoe) {
  Comm& comm = testing::comm();
  if (comm.world_size() != 1) GTEST_SKIP() << "single-rank FD check";
  auto be = make_cpu_backend<double>();
  struct Case { bool mixtral; Recompute r; MoeAuxScope scope; };
  for (const Case& k : {Case{false, Recompute::None, MoeAuxScope::Sequence}, Case{true, Recompute::None, MoeAuxScope::MicroBatch},
                        Case{false, Recompute::Full, MoeAuxScope::MicroBatch}, Case{true, Recompute::Selective, MoeAuxScope::Sequence}}) {
    const ModelConfig cfg = moe_config(k.mixtral);
    validate(cfg, "gradcheck moe");
    Fsdp<double> f(*be, comm, ShardPlan::build(llama_units(cfg), 1));
    f.init_params(2028);
    spread_params(f, 11);
    ModelOptions o{k.r, AttentionKind::Tiled, 0};
    o.aux_scope = k.scope;
    LlamaModel<double> m(cfg, *be, o);
    const Batch bt = make_batch();
    const double coef = cfg.router_aux_loss_coef, zc = 0.05;
    f.zero_grads();
    m.forward(f, bt.tokens.data(), bt.B, bt.T);
    const double ce = m.head_backward(f, bt.targets.data(), 1.0);
    const double aux = m.moe_aux_loss(), z = m.moe_z_loss();
    m.set_aux_grad_scale(coef, zc);
    m.backward(f);
    const double loss = ce + coef * aux + zc * z;
    EXPECT_GT(aux, 0.0);
    EXPECT_GT(z, 0.0);
    // Every token's K slots are counted once per MoE block: the expert counts sum to K x tokens.
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const std::vector<int64_t> n = m.expert_counts(l);
      if (!cfg.is_moe_layer(l)) { EXPECT_TRUE(n.empty()); continue; }
      int64_t sum = 0;
      for (int64_t v : n) sum += v;
      EXPECT_EQ(sum, int64_t{cfg.num_experts_per_tok} * bt.B * bt.T) << "block " << l;
    }
    std::vector<Vec> grads;
    for (int u = 0; u < f.num_units(); ++u)
      grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + f.plan().units[u].shard_size);
    auto eval = [&] {
      m.forward(f, bt.tokens.data(), bt.B, bt.T);
      return m.loss(f, bt.targets.data()) + coef * m.moe_aux_loss() + zc * m.moe_z_loss();
    };
    EXPECT_NEAR(eval(), loss, 1e-13 * loss);
    GradReport rep(std::string(k.mixtral ? "MoE (Mixtral)" : "MoE (Qwen3-MoE)") + ", recompute " + recompute_name(k.r) +
                   (k.scope == MoeAuxScope::Sequence ? ", aux per sequence" : ", aux per micro-batch"));
    for (int u = 0; u < f.num_units(); ++u)
      for (const auto& slot : f.plan().units[u].params) {
        double gnorm = 0;
        for (int64_t i = 0; i < slot.numel; ++i) {
          const double a = grads[u][static_cast<size_t>(slot.offset + i)];
          rep.check(slot.spec.name, static_cast<size_t>(i), a, central_diff4(f.param_shard(u) + slot.offset + i, eval));
          gnorm += a * a;
        }
        EXPECT_GT(gnorm, 1e-12) << slot.spec.name << ": gradient is (almost) zero";
      }
    rep.finish();
    // The aux and z terms' gradients are in there: without each the router's gradient differs.
    const std::string router = "model.layers.1.mlp.gate.weight";
    const Vec with = [&] {
      for (int u = 0; u < f.num_units(); ++u)
        for (const auto& slot : f.plan().units[u].params)
          if (slot.spec.name == router) return Vec(grads[u].begin() + slot.offset, grads[u].begin() + slot.offset + slot.numel);
      return Vec{};
    }();
    for (const auto& [a, zz, what] : {std::tuple{0.0, zc, "the load-balancing loss"}, std::tuple{coef, 0.0, "the router z-loss"}}) {
      f.zero_grads();
      m.forward(f, bt.tokens.data(), bt.B, bt.T);
      m.head_backward(f, bt.targets.data(), 1.0);
      m.set_aux_grad_scale(a, zz);
      m.backward(f);
      const Vec without = grad_of(f, router);
      ASSERT_EQ(with.size(), without.size());
      double diff = 0;
      for (size_t i = 0; i < with.size(); ++i) diff = std::max(diff, std::fabs(with[i] - without[i]));
      EXPECT_GT(diff, 1e-6) << what << " does not reach the router";
    }
  }
}

}  // namespace
}  // namespace shardtrain
