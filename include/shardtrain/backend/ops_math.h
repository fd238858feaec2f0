// Per-element math shared by the CPU backend (plain C++) and the CUDA backend (device code).
// Every function is `ST_HD` (= __host__ __device__ under nvcc), pure, and templated on the scalar
// type, so the CPU tests, which run these exact functions in float and double, cover the math the
// GPU kernels run.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define ST_HD __host__ __device__ __forceinline__
#else
#define ST_HD inline
#endif

namespace shardtrain {
// A target that does not count: the cross-entropy (Backend::cross_entropy, the vocabulary-parallel
// passes) gives its row no loss and a zero gradient. The -100 of Hugging Face's labels; packed
// example data (data/packing.h) puts it on every token that is not a training target.
inline constexpr int32_t kNoTarget = -1;
}  // namespace shardtrain

namespace shardtrain::math {

ST_HD int32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(x);
#else
  return __builtin_bit_cast(int32_t, x);
#endif
}
ST_HD float bits_float(int32_t x) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(x);
#else
  return __builtin_bit_cast(float, x);
#endif
}

// e^x in float, branch-free so that loops over it vectorize (the C library's expf does not).
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 polynomial for e^r (Cephes
// expf coefficients, S. Moshier) and 2^n built in the exponent bits. Inputs are clamped to
// [-87.3, 88] so 2^n stays a normal float: results below e^-87.3 = 1.2e-38 and above
// e^88 = 1.7e38 saturate. Max relative error 8.3e-8 over [-87, 88] (< FLT_EPSILON), checked by
// tests/unit/test_ops_math.cpp. NaN propagates.
ST_HD float fast_expf(float x) {
  x = x < -87.33654f ? -87.33654f : x;
  x = x > 88.0f ? 88.0f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: x*log2(e) + shifter rounds to an integer
  float t = x * 1.44269504088896341f + shifter;
  float n = t - shifter;
  float r = x - n * 0.693359375f;  // ln 2 split in two for an exact n*ln2_hi
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_float((float_bits(t) - 0x4B400000 + 127) << 23);  // p * 2^n
}

// Exponential used by every kernel: fast_expf in float, the C library's exp in double (gradient
// checks run in double and want full precision).
ST_HD float st_exp(float x) { return fast_expf(x); }
ST_HD double st_exp(double x) { return exp(x); }
ST_HD float st_sqrt(float x) { return sqrtf(x); }
ST_HD double st_sqrt(double x) { return sqrt(x); }
ST_HD float st_log(float x) { return logf(x); }
ST_HD double st_log(double x) { return log(x); }
ST_HD float st_pow(float x, float y) { return powf(x, y); }
ST_HD double st_pow(double x, double y) { return pow(x, y); }

// SiLU (swish): x * sigmoid(x). Ramachandran et al. 2017, "Searching for Activation Functions".
template <typename T> ST_HD T sigmoid(T x) { return T(1) / (T(1) + st_exp(-x)); }
template <typename T> ST_HD T silu(T x) { return x * sigmoid(x); }
// d silu / dx = s + x s (1 - s), s = sigmoid(x).
template <typename T> ST_HD T silu_grad(T x) {
  T s = sigmoid(x);
  return s + x * s * (T(1) - s);
}

// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): h = silu(gate) * up.
template <typename T> ST_HD T swiglu(T gate, T up) { return silu(gate) * up; }
// Backward of swiglu for one element: given dh, writes d gate and d up.
template <typename T> ST_HD void swiglu_backward(T gate, T up, T dh, T* dgate, T* dup) {
  T s = sigmoid(gate);  // once: silu = gate*s, silu' = s + gate*s*(1-s)
  *dgate = dh * up * (s + gate * s * (T(1) - s));
  *dup = dh * gate * s;
}

// RoPE rotation of one pair (x1, x2) by angle with (cos, sin), Hugging Face rotate-half convention:
// out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, where x1 = x[j], x2 = x[j + head_dim/2].
// Su et al. 2021, "RoFormer"; transformers' apply_rotary_pos_emb / rotate_half.
template <typename T> ST_HD void rope_rotate(T x1, T x2, T c, T s, T* o1, T* o2) {
  *o1 = x1 * c - x2 * s;
  *o2 = x2 * c + x1 * s;
}
// Backward of rope_rotate is rotation by -angle (the rotation matrix is orthogonal).
template <typename T> ST_HD void rope_rotate_backward(T d1, T d2, T c, T s, T* g1, T* g2) {
  *g1 = d1 * c + d2 * s;
  *g2 = d2 * c - d1 * s;
}

// RoPE inverse frequency of pair j for a head of size head_dim: theta^(-2j/head_dim).
template <typename T> ST_HD T rope_inv_freq(int j, int head_dim, T theta) {
  return T(1) / st_pow(theta, T(2 * j) / T(head_dim));
}

// RMSNorm (Zhang & Sennrich 2019): rstd = 1 / sqrt(sum(x^2)/C + eps), given ss = sum(x^2) of the
// row. Backward, with y = x * rstd * w and dy: dx = rstd * w * dy - k * x where
// k = rstd^3 / C * sum_c(w*dy*x) (rmsnorm_k of dot = that sum).
template <typename T> ST_HD T rmsnorm_rstd(T ss, int C, T eps) { return T(1) / st_sqrt(ss / T(C) + eps); }
template <typename T> ST_HD T rmsnorm_k(T dot, T rstd, int C) { return dot * rstd * rstd * rstd / T(C); }
template <typename T> ST_HD T rmsnorm_dx(T rstd, T w, T dy, T k, T x) { return rstd * w * dy - k * x; }

// Softmax backward of one element: p = softmax(scale * z) of the row, dp the incoming gradient,
// dot = sum(p * dp) over the row: dz = scale * p * (dp - dot).
template <typename T> ST_HD T softmax_grad(T p, T dp, T dot, T scale) { return scale * p * (dp - dot); }

// Vocabulary-parallel cross-entropy (backend.h vocab_ce_*): the row maximum over the G ranks'
// maxima, laid out [G, N] (rank g's N rows at g * N), of row i; and one element's gradient,
// (exp(l - m) / sum - [v is the target]) * grad_scale, with k = grad_scale / sum.
template <typename T> ST_HD T group_max(const T* maxes, int G, int N, size_t i) {
  T m = maxes[i];
  for (int g = 1; g < G; ++g) {
    const T x = maxes[static_cast<size_t>(g) * static_cast<size_t>(N) + i];
    m = x > m ? x : m;
  }
  return m;
}
template <typename T> ST_HD T vocab_ce_grad(T l, T m, T k, bool target, T grad_scale) {
  const T p = st_exp(l - m) * k;
  return target ? p - grad_scale : p;
}

// AdamW update of one element (Loshchilov & Hutter 2019, "Decoupled Weight Decay
// Regularization"; the same arithmetic as torch.optim.AdamW):
//   p <- p - lr*wd*p;  m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
//   p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// bc1 = 1 - b1^t and bc2 = 1 - b2^t are precomputed by the caller (t = 1-based step).
template <typename T> ST_HD void adamw(T* p, T* m, T* v, T g, T lr, T b1, T b2, T eps, T wd, T bc1, T bc2) {
  T pv = *p * (T(1) - lr * wd);
  T mv = b1 * *m + (T(1) - b1) * g;
  T vv = b2 * *v + (T(1) - b2) * g * g;
  *m = mv;
  *v = vv;
  *p = pv - lr * (mv / bc1) / (st_sqrt(vv / bc2) + eps);
}

// SplitMix64's output function (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number
// generators"; Vigna's splitmix64.c): a bijective 64-bit mix. The counter-based randomness of
// parameter initialization (counter_normal) and of batch sampling (data.cpp) is built on it.
ST_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace shardtrain::math
