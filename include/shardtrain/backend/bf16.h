// bfloat16 storage type shared by host and device code.
//
// bf16 is the upper 16 bits of an IEEE-754 binary32: 1 sign, 8 exponent, 7 mantissa bits (Google
// Brain's "bfloat16", also __nv_bfloat16 in CUDA and torch.bfloat16). `bf16` is a 2-byte trivially
// copyable struct with the same bit layout as __nv_bfloat16, so a buffer of it can be handed to
// cuBLAS (CUDA_R_16BF), NCCL (ncclBfloat16) and safetensors ("BF16") as is.
//
// There is deliberately no arithmetic on bf16: kernels load to float (ld), compute in float, and
// store once with round-to-nearest-even (st). That is the "bf16 storage, fp32 math" contract of
// mixed precision (Micikevicius et al. 2018, "Mixed Precision Training"; Kalamkar et al. 2019,
// "A Study of BFLOAT16 for Deep Learning Training").
#pragma once

#include <cstdint>
#include <type_traits>

#include "shardtrain/backend/ops_math.h"

namespace shardtrain {

struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);

namespace math {

// float -> bf16, round to nearest even; NaN stays a (quiet) NaN, +-Inf stays Inf, overflow
// rounds to Inf as IEEE rounding does. Same result as torch's float->bfloat16 conversion.
ST_HD bf16 f32_to_bf16(float f) {
  uint32_t u = static_cast<uint32_t>(float_bits(f));
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}
// bf16 -> float, exact.
ST_HD float bf16_to_f32(bf16 h) { return bits_float(static_cast<int32_t>(static_cast<uint32_t>(h.bits) << 16)); }

// The type arithmetic happens in for storage type T: float for bf16, T otherwise.
template <typename T> struct AccumOf { using type = T; };
template <> struct AccumOf<bf16> { using type = float; };
template <typename T> using Acc = typename AccumOf<T>::type;

// Load a stored element into its arithmetic type, and store an arithmetic value (rounding once).
ST_HD float ld(float x) { return x; }
ST_HD double ld(double x) { return x; }
ST_HD float ld(bf16 x) { return bf16_to_f32(x); }
template <typename T> ST_HD T st(Acc<T> x);
template <> ST_HD float st<float>(float x) { return x; }
template <> ST_HD double st<double>(double x) { return x; }
template <> ST_HD bf16 st<bf16>(float x) { return f32_to_bf16(x); }

}  // namespace math
}  // namespace shardtrain
