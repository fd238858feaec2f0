// float8 per-element math shared by the CPU emulation (src/backend/cpu/fp8.cpp) and the CUDA FP8
// path (src/backend/cuda/fp8.cu; issue 57, item 3): the two OCP 8-bit formats, their round-to-nearest-even encoding,
// and the dynamic per-tensor ("tensorwise") scaling recipe. Every function is `ST_HD`, pure and
// free of host-only calls (bits via math::float_bits / bits_float), so device code can run the
// exact arithmetic the CPU tests (tests/unit/test_fp8.cpp, tests/e2e/test_fp8.sh) check.
//
// Formats (OCP "8-bit Floating Point Specification (OFP8)" rev. 1.0, 2023; Micikevicius et al.
// 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433):
//   E4M3 ("fn": finite + NaN; torch.float8_e4m3fn, CUDA __nv_fp8_e4m3): 1 sign, 4 exponent bits
//     (bias 7), 3 mantissa bits. No infinities; S.1111.111 (0x7F, 0xFF) is NaN, so S.1111.110 =
//     +-448 is the largest finite value. Subnormals: exponent field 0, value m * 2^-9 (smallest
//     2^-9 = 0.001953125); smallest normal 2^-6.
//   E5M2 (torch.float8_e5m2, CUDA __nv_fp8_e5m2): 1 sign, 5 exponent bits (bias 15), 2 mantissa
//     bits, IEEE-754-like: exponent field 31 is +-inf (mantissa 0) or NaN; largest finite
//     +-57344 (0x7B); subnormals m * 2^-16; smallest normal 2^-14.
// Relative rounding error of a value in the normal range: at most 2^-4 (E4M3), 2^-3 (E5M2), half
// a unit of the last place; below the normal range the absolute error is at most half the
// subnormal spacing, 2^-10 (E4M3) and 2^-17 (E5M2).
//
// Scaling recipe: torchao's default float8 training recipe, "tensorwise" (torchao.float8,
// Float8LinearConfig() / recipe name "tensorwise", docs: github.com/pytorch/ao/tree/main/torchao/float8;
// the same as Transformer Engine's "current scaling", Float8CurrentScaling): dynamic per-tensor
// scales computed from the operand about to be cast, every GEMM operand quantized separately:
//   amax  = max |x| over the whole operand                      (fp8_amax_step; NaN propagates)
//   scale = fp8_max / max(amax, 1e-12), in double, then rounded to float
//                                                               (torchao float8_utils.amax_to_scale,
//                                                               EPS = 1e-12, no power-of-2 rounding)
//   q     = encode_saturating(float(x) * scale)                 (torchao to_fp8_saturated: clamp to
//                                                               +-fp8_max, then cast; Transformer
//                                                               Engine casts saturating too)
//   x'    = decode(q) / scale                                   (the GEMM applies 1/scale_a * 1/scale_b
//                                                               to its fp32 result, torch._scaled_mm /
//                                                               cuBLASLt's A/B scale pointers)
// An all-zero operand has amax 0: scale = fp8_max / 1e-12 (4.48e14 for E4M3), every q is 0 and
// x' = 0 exactly. An operand with an inf gets scale 0 (fp8_max / inf), one with a NaN scale NaN:
// either makes the whole GEMM result NaN (0 * inf, NaN), which the trainer's non-finite check sees.
// Which format each of a linear layer's three GEMMs uses (torchao's tensorwise defaults: input and
// weight E4M3, grad_output E5M2, in every GEMM an operand appears in; y = x W^T, W [N, K]):
//   Forward     y  = x  W^T     x: E4M3   W: E4M3
//   InputGrad   dx = dy W       dy: E5M2  W: E4M3
//   WeightGrad  dW = dy^T x     dy: E5M2  x: E4M3
// (fp8_format_a / fp8_format_b below; cuBLASLt has no E5M2 x E5M2 GEMM, and none is needed.)
#pragma once

#include <cstdint>

#include "shardtrain/backend/ops_math.h"

namespace shardtrain::math {

enum class Fp8Format : uint8_t { E4M3, E5M2 };

// A linear layer's three products (model.h's LinearRole, whose operand a / b they name).
enum class Fp8Gemm : uint8_t { Forward, InputGrad, WeightGrad };
// The format of operand a (x in Forward, dy in both backward GEMMs) and of operand b (W, W, x).
ST_HD Fp8Format fp8_format_a(Fp8Gemm g) { return g == Fp8Gemm::Forward ? Fp8Format::E4M3 : Fp8Format::E5M2; }
ST_HD Fp8Format fp8_format_b(Fp8Gemm) { return Fp8Format::E4M3; }

// Largest finite value: 448 (E4M3), 57344 (E5M2).
ST_HD float fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? 448.0f : 57344.0f; }

// The code's exponent bias, mantissa bits and largest finite positive code.
ST_HD int fp8_bias(Fp8Format f) { return f == Fp8Format::E4M3 ? 7 : 15; }
ST_HD int fp8_mant_bits(Fp8Format f) { return f == Fp8Format::E4M3 ? 3 : 2; }
ST_HD uint32_t fp8_max_code(Fp8Format f) { return f == Fp8Format::E4M3 ? 0x7Eu : 0x7Bu; }

// True for the NaN codes: 0x7F and 0xFF (E4M3); exponent field 31 with a nonzero mantissa (E5M2).
ST_HD bool fp8_is_nan(Fp8Format f, uint8_t c) {
  const uint32_t a = c & 0x7Fu;
  return f == Fp8Format::E4M3 ? a == 0x7Fu : a > 0x7Cu;
}

// float -> fp8 code, round to nearest, ties to even, subnormals included (no flush to zero); the
// arithmetic is on the bits, so the FTZ/DAZ mode of the thread does not change it.
// NaN -> the NaN code 0x7F with x's sign (0x7F / 0xFF), as torch's conversion gives.
// A result beyond the largest finite value (after rounding, so E4M3's 464 still gives 448, its tie
// rounding to the even 448), infinities included:
//   saturate = true:  +-fp8_max (torchao's and Transformer Engine's cast of scaled values, i.e.
//                     torch.clamp(x, -max, max).to(dtype));
//   saturate = false: E5M2 +-inf (IEEE overflow, torch's x.to(torch.float8_e5m2)); E4M3 NaN
//                     (the OCP spec's non-saturating mode: E4M3 has no inf).
// Note: torch 2.15's plain x.to(torch.float8_e4m3fn) on the CPU saturates (inf -> 448 too), i.e.
// equals saturate = true; tests/e2e/test_fp8.sh checks both.
ST_HD uint8_t fp8_encode(Fp8Format f, float x, bool saturate = true) {
  const uint32_t bits = static_cast<uint32_t>(float_bits(x));
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);  // NaN
  const int bias = fp8_bias(f), mb = fp8_mant_bits(f);
  const uint32_t max_code = fp8_max_code(f);
  const int e = static_cast<int>(a >> 23);  // float's biased exponent, 0..255
  uint32_t code;
  if (e - 127 >= 1 - bias) {
    // Normal in fp8: rebias the exponent in place, then round the 23 - mb dropped mantissa bits
    // (a carry out of the mantissa increments the exponent, as it should).
    const int s = 23 - mb;
    uint32_t v = a - (static_cast<uint32_t>(127 - bias) << 23);
    v += (1u << (s - 1)) - 1u + ((v >> s) & 1u);
    code = v >> s;  // may exceed max_code (inf's bits included): handled below
  } else {
    // Below fp8's normal range: q = x / 2^(1 - bias - mb) rounded to an integer in [0, 2^mb]
    // (2^mb is the smallest normal, whose code is exactly 2^mb). x = sig * 2^(max(e,1) - 150).
    const uint32_t sig = e == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
    const int sh = 151 - bias - mb - (e == 0 ? 1 : e);  // >= 1 here
    code = sh > 24 ? 0u : (sig + (1u << (sh - 1)) - 1u + ((sig >> sh) & 1u)) >> sh;
  }
  if (code > max_code) {
    if (saturate) code = max_code;
    else code = f == Fp8Format::E4M3 ? 0x7Fu : 0x7Cu;  // NaN (E4M3) / inf (E5M2)
  }
  return static_cast<uint8_t>(sign | code);
}

// fp8 code -> float, exact (every fp8 value is a float). NaN codes give a quiet NaN with the code's
// sign; E5M2's 0x7C / 0xFC give +-inf.
ST_HD float fp8_decode(Fp8Format f, uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const int bias = fp8_bias(f), mb = fp8_mant_bits(f);
  const uint32_t ef = (c & 0x7Fu) >> mb, m = c & ((1u << mb) - 1u);
  if (fp8_is_nan(f, c)) return bits_float(static_cast<int32_t>(sign | 0x7FC00000u));
  if (f == Fp8Format::E5M2 && ef == 31u) return bits_float(static_cast<int32_t>(sign | 0x7F800000u));
  if (ef == 0u) {  // subnormal: m * 2^(1 - bias - mb), a product of exact floats
    const float unit = bits_float((127 + 1 - bias - mb) << 23);
    return bits_float(static_cast<int32_t>(sign | static_cast<uint32_t>(float_bits(static_cast<float>(m) * unit))));
  }
  const uint32_t e32 = static_cast<uint32_t>(static_cast<int>(ef) - bias + 127);
  return bits_float(static_cast<int32_t>(sign | (e32 << 23) | (m << (23 - mb))));
}

// One step of the amax reduction: max(acc, |x|), where a NaN x makes the result NaN and a NaN acc
// stays NaN (torch.max's propagation). Start from acc = 0.
ST_HD float fp8_amax_step(float acc, float x) {
  const float ax = bits_float(float_bits(x) & 0x7FFFFFFF);
  return (ax > acc || ax != ax) ? ax : acc;
}

// The quantization scale of an operand of absolute maximum amax: fp8_max / max(amax, 1e-12),
// divided in double and rounded to float (torchao's amax_to_scale). 1e-12 is torchao's EPS:
// an all-zero operand gets 448e12 (E4M3) / 57344e12 (E5M2). NaN amax -> NaN; inf -> 0.
ST_HD float fp8_scale(Fp8Format f, float amax) {
  const double eps = 1e-12;
  const double m = amax < eps ? eps : static_cast<double>(amax);  // NaN < eps is false: NaN stays
  return static_cast<float>(static_cast<double>(fp8_max(f)) / m);
}

// Quantize one element with the operand's scale: encode(x * scale), the product in float,
// saturating (torchao's hp_tensor_and_scale_to_float8).
ST_HD uint8_t fp8_quantize(Fp8Format f, float x, float scale) { return fp8_encode(f, x * scale, true); }
// Dequantize one element: decode(q) / scale.
ST_HD float fp8_dequantize(Fp8Format f, uint8_t q, float scale) { return fp8_decode(f, q) / scale; }

}  // namespace shardtrain::math
