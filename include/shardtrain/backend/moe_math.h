// Mixture-of-experts router math shared by the CPU backend and CUDA kernels (issue 56): one
// token's routing (softmax, top-k, renormalization) and its backward, the auxiliary load-balancing
// loss and the router z-loss. Every function is ST_HD, pure and templated on the scalar type, as
// in ops_math.h, so the CPU tests (float64 against central differences) cover what the GPU runs.
//
// Shapes: one token's router logits `logits[E]` (the linear C -> E of its normed hidden state,
// computed in fp32 or wider), its probabilities `probs[E]`, its k chosen experts `experts[k]` and
// weights `weights[k]`, slot j = 0..k-1 in descending order of score.
//
// Sources: Mixtral / Qwen3-MoE routing as transformers computes it (MixtralSparseMoeBlock /
// Qwen3MoeSparseMoeBlock: softmax over all E, top-k, divided by the sum of the k when
// norm_topk_prob, Mixtral always); the load-balancing loss of Switch Transformer (Fedus et al.
// 2021, eq. 4) as transformers' load_balancing_loss_func writes it; the router z-loss of ST-MoE
// (Zoph et al. 2022, eq. 5).
#pragma once

#include <cstdint>

#include "shardtrain/backend/ops_math.h"

namespace shardtrain::math {

// Softmax of logits[E] into probs[E] (max-subtracted), then the k (1 <= k <= E) largest
// probabilities: experts[j] is the j-th largest, ties broken by the lower expert index, so the
// choice is a total order of (probability, -index) that depends on nothing but the token's logits
// (not the batch, the layout or the thread count; torch.topk leaves ties unspecified, and with
// random weights they do not occur). weights[j] = probs[experts[j]], divided by their sum when
// `renorm`. O(E k).
template <typename T>
ST_HD void moe_route(const T* logits, int E, int k, bool renorm, T* probs, int32_t* experts, T* weights) {
  T m = logits[0];
  for (int e = 1; e < E; ++e) m = logits[e] > m ? logits[e] : m;
  T sum = T(0);
  for (int e = 0; e < E; ++e) {
    probs[e] = st_exp(logits[e] - m);
    sum += probs[e];
  }
  for (int e = 0; e < E; ++e) probs[e] = probs[e] / sum;
  T chosen = T(0);
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken = taken || experts[i] == e;
      if (!taken && (best < 0 || probs[e] > probs[best])) best = e;  // strict: the lower index keeps a tie
    }
    experts[j] = best;
    weights[j] = probs[best];
    chosen += probs[best];
  }
  if (renorm)
    for (int j = 0; j < k; ++j) weights[j] = weights[j] / chosen;
}

// Backward of moe_route for one token: dweights[k] = dL/dweights (the experts' outputs dotted with
// the output gradient), dprobs[E] = any gradient that reaches the probabilities directly (the
// load-balancing loss's moe_aux_dprob, zero otherwise); writes dlogits[E] = dL/dlogits. With
// renormalization w_j = p_{e_j} / S, S = sum_i p_{e_i}: dL/dp_{e_j} = (dw_j - sum_i dw_i w_i) / S.
// Softmax: dlogit_e = p_e (g_e - sum_m p_m g_m), g = dL/dprobs. The expert choice is piecewise
// constant (no gradient), as in every top-k router.
template <typename T>
ST_HD void moe_route_backward(const T* probs, const int32_t* experts, const T* weights, const T* dweights,
                              const T* dprobs, int E, int k, bool renorm, T* dlogits) {
  for (int e = 0; e < E; ++e) dlogits[e] = dprobs ? dprobs[e] : T(0);  // g, built in place
  if (renorm) {
    T s = T(0), dot = T(0);
    for (int j = 0; j < k; ++j) {
      s += probs[experts[j]];
      dot += dweights[j] * weights[j];
    }
    for (int j = 0; j < k; ++j) dlogits[experts[j]] += (dweights[j] - dot) / s;
  } else {
    for (int j = 0; j < k; ++j) dlogits[experts[j]] += dweights[j];
  }
  T pg = T(0);
  for (int e = 0; e < E; ++e) pg += probs[e] * dlogits[e];
  for (int e = 0; e < E; ++e) dlogits[e] = probs[e] * (dlogits[e] - pg);
}

// The load-balancing loss over a set of n token rows (its scope: a sequence, or a micro-batch,
// every MoE layer's rows of it together, as load_balancing_loss_func concatenates the layers):
//   f_e = count_e / n   (count_e: how many of the n rows chose e among their k; sum_e f_e = k)
//   P_e = psum_e / n    (psum_e: the sum of the n rows' probability of e)
//   aux = E * sum_e f_e P_e
// (transformers: num_experts * sum(tokens_per_expert * router_prob_per_expert), with
// tokens_per_expert summed over the k slots). Its gradient reaches the probabilities only (f is a
// count): d aux / d p_{t,e} = E f_e / n = moe_aux_dprob.
template <typename T>
ST_HD T moe_aux_loss(const T* count, const T* psum, int E, T n) {
  T s = T(0);
  for (int e = 0; e < E; ++e) s += count[e] * psum[e];
  return T(E) * s / (n * n);
}
template <typename T>
ST_HD T moe_aux_dprob(T count_e, int E, T n) {
  return T(E) * count_e / (n * n);
}

// Router z-loss term of one token (ST-MoE): z = (log sum_e exp(logit_e))^2; the loss is the mean
// of z over the tokens. dz/dlogit_e = 2 lse p_e (moe_z_loss_backward, p = softmax(logits)).
template <typename T>
ST_HD T moe_logsumexp(const T* logits, int E) {
  T m = logits[0];
  for (int e = 1; e < E; ++e) m = logits[e] > m ? logits[e] : m;
  T s = T(0);
  for (int e = 0; e < E; ++e) s += st_exp(logits[e] - m);
  return m + st_log(s);
}
template <typename T>
ST_HD T moe_z_loss(const T* logits, int E) {
  const T l = moe_logsumexp(logits, E);
  return l * l;
}
// dlogits += dz x d(lse^2)/d(logits) = dz 2 lse p, from the token's lse and probabilities.
template <typename T>
ST_HD void moe_z_dlogits(const T* probs, T lse, int E, T dz, T* dlogits) {
  for (int e = 0; e < E; ++e) dlogits[e] += dz * T(2) * lse * probs[e];
}
template <typename T>
ST_HD void moe_z_loss_backward(const T* logits, const T* probs, int E, T dz, T* dlogits) {
  moe_z_dlogits(probs, moe_logsumexp(logits, E), E, dz, dlogits);
}

}  // namespace shardtrain::math
