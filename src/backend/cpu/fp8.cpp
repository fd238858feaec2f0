// The CPU emulation of a float8 linear GEMM (fp8.h): quantize each operand with its own tensorwise
// scale (fp8_math.h), multiply the decoded values with one fp32 cblas_sgemm, rescale. Compiled in
// the cpu_backend unity group; it uses none of the CpuBackend class.
#include <cblas.h>

#include <cstddef>
#include <vector>

#include "shardtrain/backend/fp8.h"

namespace shardtrain {
namespace {

// Widens operand x (n elements of T) to float, returns its amax, and writes the decoded fp8 values
// in scaled units, fp8_decode(fp8_quantize(x, scale)), into dq (n floats); scale = fp8_scale(amax).
template <typename T>
float fp8_quantize_operand(math::Fp8Format f, const T* x, size_t n, std::vector<float>& dq, float* scale) {
  float amax = 0;
  for (size_t i = 0; i < n; ++i) amax = math::fp8_amax_step(amax, math::ld(x[i]));
  const float s = math::fp8_scale(f, amax);
  dq.resize(n);
  for (size_t i = 0; i < n; ++i) dq[i] = math::fp8_decode(f, math::fp8_quantize(f, math::ld(x[i]), s));
  *scale = s;
  return amax;
}

}  // namespace

template <typename T>
Fp8Scales fp8_linear_emulated(math::Fp8Gemm role, int M, int N, int K, const T* a, const T* b, T* out,
                              bool accumulate) {
  using math::Fp8Gemm;
  const size_t m = static_cast<size_t>(M), n = static_cast<size_t>(N), k = static_cast<size_t>(K);
  // Operand and result sizes, and the sgemm of linear(): op(A) [rows, inner] op(B) [inner, cols].
  size_t na = 0, nb = 0;
  int rows = 0, cols = 0, inner = 0, lda = 0, ldb = 0;
  CBLAS_TRANSPOSE ta = CblasNoTrans, tb = CblasNoTrans;
  switch (role) {
    case Fp8Gemm::Forward:  // out[M, N] = x[M, K] W[N, K]^T
      na = m * k, nb = n * k, rows = M, cols = N, inner = K, lda = K, ldb = K, tb = CblasTrans;
      break;
    case Fp8Gemm::InputGrad:  // out[M, K] = dy[M, N] W[N, K]
      na = m * n, nb = n * k, rows = M, cols = K, inner = N, lda = N, ldb = K;
      break;
    case Fp8Gemm::WeightGrad:  // out[N, K] = dy[M, N]^T x[M, K]
      na = m * n, nb = m * k, rows = N, cols = K, inner = M, lda = N, ldb = K, ta = CblasTrans;
      break;
  }
  Fp8Scales s;
  std::vector<float> da, db;
  s.amax_a = fp8_quantize_operand(math::fp8_format_a(role), a, na, da, &s.scale_a);
  s.amax_b = fp8_quantize_operand(math::fp8_format_b(role), b, nb, db, &s.scale_b);
  const size_t nout = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  if (nout == 0) return s;
  std::vector<float> p(nout, 0.0f);
  if (inner > 0)
    cblas_sgemm(CblasRowMajor, ta, tb, rows, cols, inner, 1.0f, da.data(), lda, db.data(), ldb, 0.0f, p.data(), cols);
  const float inv = (1.0f / s.scale_a) * (1.0f / s.scale_b);
  for (size_t i = 0; i < nout; ++i) {
    const float v = p[i] * inv;
    out[i] = math::st<T>(accumulate ? math::ld(out[i]) + v : v);
  }
  return s;
}

template Fp8Scales fp8_linear_emulated<float>(math::Fp8Gemm, int, int, int, const float*, const float*, float*, bool);
template Fp8Scales fp8_linear_emulated<bf16>(math::Fp8Gemm, int, int, int, const bf16*, const bf16*, bf16*, bool);

}  // namespace shardtrain
