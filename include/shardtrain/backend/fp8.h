// The CPU emulation of a float8 linear-layer GEMM (issue 57, item 4: `--precision fp8`'s scaling
// logic, checked on the CPU; the reference of the cuBLASLt FP8 path, src/backend/cuda/fp8.cu). It
// computes what the GPU does:
// each operand quantized to fp8 with its own dynamic per-tensor scale (amax over the whole
// operand), the product of the quantized operands, and the result multiplied by the two inverse
// scales. The recipe, the formats and the per-element math are in fp8_math.h.
//
// This is a reference, not a fast path: it runs on the calling thread (one single-threaded
// cblas_sgemm call; the CPU backend keeps OpenBLAS at 1 thread) and allocates two float copies of
// the operands and one of the result. Training in fp8 is for GPUs with FP8 tensor cores (issue 57
// refuses `--precision fp8` on the CPU): this exists for the tests and as the CUDA path's reference.
#pragma once

#include <cstdint>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/fp8_math.h"

namespace shardtrain {

// The scales one fp8_linear_emulated call used (fp8_scale of each operand's amax) and the amaxes.
struct Fp8Scales {
  float amax_a = 0, amax_b = 0;
  float scale_a = 0, scale_b = 0;
};

// The three products of a projection y = x W^T, W [N, K] row-major, over M rows: the shapes,
// row-major layouts (leading dimension = row width) and operand names of model.h's linear():
//   Forward:    out[M, N]  (+)=  a[M, K] · b[N, K]^T     a = x  (E4M3), b = W (E4M3)
//   InputGrad:  out[M, K]  (+)=  a[M, N] · b[N, K]       a = dy (E5M2), b = W (E4M3)
//   WeightGrad: out[N, K]  (+)=  a[M, N]^T · b[M, K]     a = dy (E5M2), b = x (E4M3)
// Computed as: sa = fp8_scale(fa, amax(a)), sb likewise; qa = fp8_quantize(fa, a, sa) and qb
// elementwise (saturating, round to nearest even); P = the fp32 GEMM (cblas_sgemm) of
// fp8_decode(qa) and fp8_decode(qb); out = P * ((1/sa) * (1/sb)) (each inverse and their product
// rounded to float, as the per-operand dequantization scales cuBLASLt is given), added to out
// when accumulate (out = out + that, rounded once to T), else out is written and not read.
// T = float or bf16 (operands widened to float before scaling; the result rounded to T once).
// Pointers are host memory (the CPU backend's), must not alias out; M, N, K >= 0 (K = 0 gives a
// zero product). Returns the amaxes and scales.
// Error (the tests' bound, tests/unit/test_fp8.cpp): against the float64 product of the decoded
// operands times the inverse scales, fp32 GEMM rounding only (<= ~K * 2^-24 * sum |a'||b'|);
// against the unquantized product, per output element at most
//   sum_k (ea_k |b_k| + |a_k| eb_k + ea_k eb_k)   (+ that fp32 rounding),
// where an element x of an operand of amax A quantizes with error e = max(u |x|, d * A / fp8_max):
// u = 2^-4, d = 2^-10 (E4M3) and u = 2^-3, d = 2^-17 (E5M2) (half an ulp relative in the normal
// range, half the subnormal spacing below it, in scaled units). A non-finite element in an operand
// makes every output element NaN (see fp8_math.h).
// The device scratch (bytes) the CUDA backend's linear_fp8 (src/backend/cuda/fp8.cu) takes for one
// call of `role` at M, N, K (linear()'s shapes), all from the backend's one scratch allocation:
//   256                                   both operands' amax, scale and 1/scale
//   + 2 x 256 x 4                         the amax reduction's per-block partials
//   + np x kp, + mp x kp                  the two fp8 copies (1 byte per element), reduction
//                                         dimension contiguous (cuBLASLt's TN layout: transposed
//                                         copies of W for InputGrad, of dy and x for WeightGrad),
//                                         zero padded to kp = In rounded up to 16
//   + mp x np x 4       (padded path)     an fp32 output, when R or Cn is not a multiple of 16 or
//                                         out is not 16-byte aligned (out_aligned false)
//   + 32 MiB                              the cuBLASLt workspace (kFp8CublasLtWorkspace)
// with the output out[R, Cn] and the reduction length In of the role (Forward: R = M, Cn = N,
// In = K; InputGrad: M, K, N; WeightGrad: N, K, M), mp = Cn and np = R, each rounded up to 16 on the
// padded path; every piece rounded up to 256 bytes. 0 when R or Cn is 0. The memory plan counts the
// largest over the blocks' projections (memory_plan.cpp, "fp8 GEMM scratch").
inline constexpr int64_t kFp8CublasLtWorkspace = int64_t{32} << 20;
inline int64_t fp8_cuda_scratch_bytes(math::Fp8Gemm role, int64_t M, int64_t N, int64_t K, bool out_aligned) {
  auto up = [](int64_t x, int64_t a) { return (x + a - 1) / a * a; };
  const int64_t R = role == math::Fp8Gemm::WeightGrad ? N : M;
  const int64_t Cn = role == math::Fp8Gemm::Forward ? N : K;
  const int64_t In = role == math::Fp8Gemm::Forward ? K : role == math::Fp8Gemm::InputGrad ? N : M;
  if (R == 0 || Cn == 0) return 0;
  const bool direct = out_aligned && R % 16 == 0 && Cn % 16 == 0;
  const int64_t kp = up(In > 0 ? In : 1, 16), mp = direct ? Cn : up(Cn, 16), np = direct ? R : up(R, 16);
  return 256 + up(2 * 256 * 4, 256) + up(np * kp, 256) + up(mp * kp, 256) + (direct ? 0 : up(mp * np * 4, 256)) +
         kFp8CublasLtWorkspace;
}

template <typename T>
Fp8Scales fp8_linear_emulated(math::Fp8Gemm role, int M, int N, int K, const T* a, const T* b, T* out,
                              bool accumulate);

}  // namespace shardtrain
