// Per-element math shared by the CPU backend (plain C++) and the CUDA backend (device code).
// Every function is `ST_HD` (= __host__ __device__ under nvcc), pure, and templated on the scalar
// type, so the CPU tests, which run these exact functions in float and double, cover the math the
// GPU kernels run.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define ST_HD __host__ __device__ __forceinline__
#else
#define ST_HD inline
#endif

namespace shardtrain::math {

// SiLU (swish): x * sigmoid(x). Ramachandran et al. 2017, "Searching for Activation Functions".
template <typename T> ST_HD T sigmoid(T x) { return T(1) / (T(1) + exp(-x)); }
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
  *dgate = dh * up * silu_grad(gate);
  *dup = dh * silu(gate);
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
  return T(1) / pow(theta, T(2 * j) / T(head_dim));
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
  *p = pv - lr * (mv / bc1) / (sqrt(vv / bc2) + eps);
}

}  // namespace shardtrain::math
