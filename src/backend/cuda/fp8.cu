// CudaBackend<T>::linear_fp8 (backend.h; issue 57 item 3): a linear layer's GEMM in float8 on
// cuBLASLt, with torchao's tensorwise dynamic scaling computed on the device (fp8_math.h, the
// same per-element functions as the CPU emulation fp8_linear_emulated, src/backend/cpu/fp8.cpp).
//
// Per call, all on the backend's stream, no host synchronization:
//   1. amax of each operand: fp8_amax_partial_kernel (kFp8AmaxBlocks blocks, grid-stride, a fixed
//      warp-butterfly then warp-order block reduction: deterministic, no atomics; NaN propagates
//      through fp8_amax_step), then fp8_amax_final_kernel (one block) which also writes
//      scale = fp8_scale(format, amax) and its inverse 1/scale (float) into device memory.
//   2. quantize: fp8_quantize_kernel writes encode_saturating(x * scale) as bytes into a copy with
//      the reduction dimension contiguous (cuBLASLt's FP8 GEMMs take only the "TN" layout), zero
//      padded to a multiple of 16 in that dimension (kFp8Align), transposed where the role needs it
//      (32 x 32 shared-memory tiles):
//        Forward     out[M,N] = x W^T     A = W   [N, K]  E4M3    B = x   [M, K]  E4M3
//        InputGrad   out[M,K] = dy W      A = W^T [K, N]  E4M3    B = dy  [M, N]  E5M2
//        WeightGrad  out[N,K] = dy^T x    A = x^T [K, M]  E4M3    B = dy^T [N, M] E5M2
//      (row-major [r, k] arrays, = column-major k x r with ld k_pad: cuBLASLt's A transposed, B not;
//      the row-major out[R, Cn] is the column-major D = A^T B of m = Cn, n = R.)
//   3. cublasLtMatmul: CUBLAS_COMPUTE_32F, scale type fp32, A_SCALE_POINTER / B_SCALE_POINTER = the
//      device inverse scales, fast accumulation off (cuBLASLt promotes partial sums to fp32, as
//      torchao does for the gradients' GEMMs), alpha 1, beta 1 when accumulating. Output: straight
//      into out (D type T: bf16 or fp32, C = D = out) when m and n are multiples of 16 and out is
//      16-byte aligned; otherwise into an fp32 scratch D of padded shape, then
//      fp8_store_kernel writes (or adds to) out, rounding once to T.
// Scratch (CudaBackend::scratch, one allocation, partitioned): the stats (amax, scale, 1/scale of
// both operands), the amax partials, the two fp8 copies (k_pad x rows bytes each), the fp32 D of the
// padded path, and the cuBLASLt workspace (kFp8Workspace bytes); fp8_scratch_bytes below.
// Refused (std::runtime_error) on a device of compute capability < 8.9 (no FP8 tensor cores).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/fp8.h"
#include "shardtrain/backend/fp8_math.h"
#include "shardtrain/backend/ops_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace shardtrain {
namespace {

constexpr int kFp8AmaxBlocks = 256;           // blocks of the amax reduction's first pass
constexpr int kFp8Align = 16;                 // cuBLASLt FP8: dimensions / leading dimensions in 16s
constexpr size_t kFp8Workspace = static_cast<size_t>(kFp8CublasLtWorkspace);  // cuBLASLt workspace (fp8.h)
constexpr int kFp8Tile = 32;                  // transpose tile side

// Per operand: the amax, the scale and its inverse (the GEMM's scale pointer), 16-byte aligned.
struct Fp8Stats {
  float amax, scale, inv, pad;
};

// The amax step as a block_reduce operation (cuda_common.cuh: fixed order, every thread gets the
// result; fp8_amax_step keeps a NaN).
struct Fp8AmaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return math::fp8_amax_step(a, b); }
};

template <typename T> __global__ void fp8_amax_partial_kernel(const T* x, size_t n, float* partial) {
  float a = 0.0f;
  for (size_t i = gtid(); i < n; i += gstride()) a = math::fp8_amax_step(a, math::ld(x[i]));
  a = block_reduce(a, Fp8AmaxOp{});
  if (threadIdx.x == 0) partial[blockIdx.x] = a;
}

__global__ void fp8_amax_final_kernel(const float* partial, int np, math::Fp8Format f, Fp8Stats* st) {
  float a = 0.0f;
  for (int i = static_cast<int>(threadIdx.x); i < np; i += static_cast<int>(blockDim.x))
    a = math::fp8_amax_step(a, partial[i]);
  a = block_reduce(a, Fp8AmaxOp{});
  if (threadIdx.x == 0) {
    const float s = math::fp8_scale(f, a);
    st->amax = a;
    st->scale = s;
    st->inv = 1.0f / s;
    st->pad = 0.0f;
  }
}

// dst: `drows` rows of `ld` bytes. Not transposed: dst[r, c] = q(src[r, c]) for src [drows, dcols];
// transposed: dst[c, r] = q(src[r, c]) for src [dcols, drows] (so dst is [drows = src cols, ...]).
// Bytes c in [dcols, ld) of every row are 0. One 32 x 32 tile of dst per block (32 x 8 threads).
template <typename T, bool kTrans>
__global__ void fp8_quantize_kernel(uint8_t* dst, const T* src, int drows, int dcols, int ld, math::Fp8Format f,
                                    const Fp8Stats* st) {
  __shared__ float tile[kFp8Tile][kFp8Tile + 1];
  const float scale = st->scale;
  const int r0 = static_cast<int>(blockIdx.y) * kFp8Tile, c0 = static_cast<int>(blockIdx.x) * kFp8Tile;
  if (kTrans) {  // read src rows c0.. (its row = dst column), coalesced along src's row (dst rows)
    for (int j = static_cast<int>(threadIdx.y); j < kFp8Tile; j += static_cast<int>(blockDim.y)) {
      const int sr = c0 + j, sc = r0 + static_cast<int>(threadIdx.x);  // src [dcols, drows]
      tile[j][threadIdx.x] =
          (sr < dcols && sc < drows) ? math::ld(src[static_cast<size_t>(sr) * static_cast<size_t>(drows) + sc]) : 0.0f;
    }
    __syncthreads();
  }
  for (int j = static_cast<int>(threadIdx.y); j < kFp8Tile; j += static_cast<int>(blockDim.y)) {
    const int r = r0 + j, c = c0 + static_cast<int>(threadIdx.x);
    if (r >= drows || c >= ld) continue;
    uint8_t q = 0;
    if (c < dcols) {
      const float v = kTrans ? tile[threadIdx.x][j] : math::ld(src[static_cast<size_t>(r) * static_cast<size_t>(dcols) + c]);
      q = math::fp8_quantize(f, v, scale);
    }
    dst[static_cast<size_t>(r) * static_cast<size_t>(ld) + c] = q;
  }
}

// out[r, c] (+)= d[r, c] for r < rows, c < cols; d has row stride ldd (floats). One rounding to T.
template <typename T>
__global__ void fp8_store_kernel(T* out, const float* d, int rows, int cols, int ldd, bool accumulate) {
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  for (size_t i = gtid(); i < n; i += gstride()) {
    const size_t r = i / static_cast<size_t>(cols), c = i % static_cast<size_t>(cols);
    const float v = d[r * static_cast<size_t>(ldd) + c];
    out[i] = math::st<T>(accumulate ? math::ld(out[i]) + v : v);
  }
}

size_t fp8_round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

cudaDataType_t fp8_cuda_type(math::Fp8Format f) {
  return f == math::Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

// RAII for the per-call cuBLASLt descriptors.
struct Fp8LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Fp8LtDescs() {
    if (pref) (void)cublasLtMatmulPreferenceDestroy(pref);
    if (c) (void)cublasLtMatrixLayoutDestroy(c);
    if (b) (void)cublasLtMatrixLayoutDestroy(b);
    if (a) (void)cublasLtMatrixLayoutDestroy(a);
    if (op) (void)cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

namespace cuda_detail {

template <typename T> void CudaBackend<T>::fp8_check_device() {
  if (fp8_ok_) return;
  int dev = 0, major = 0, minor = 0;
  ST_CUDA(cudaGetDevice(&dev));
  ST_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  ST_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major * 10 + minor < 89)
    throw std::runtime_error("float8 GEMMs ('--precision fp8') need a GPU with FP8 tensor cores (compute capability "
                             "8.9 or newer: sm_89 Ada, sm_90 Hopper and later); CUDA device " +
                             std::to_string(dev) + " has compute capability " + std::to_string(major) + "." +
                             std::to_string(minor));
  if (!lt_) ST_CUBLAS(cublasLtCreate(&lt_));
  fp8_ok_ = true;
}

template <typename T>
void CudaBackend<T>::linear_fp8(math::Fp8Gemm role, int M, int N, int K, const T* a, const T* b, T* out,
                                bool accumulate) {
  using math::Fp8Gemm;
  fp8_check_device();
  // The output [R, Cn] and the reduction length In; the operands as the GEMM reads them (row-major
  // [rows, In] fp8 copies): A from b (E4M3, Cn rows), B from a (E4M3 / E5M2, R rows).
  int R = 0, Cn = 0, In = 0;
  switch (role) {
    case Fp8Gemm::Forward: R = M, Cn = N, In = K; break;
    case Fp8Gemm::InputGrad: R = M, Cn = K, In = N; break;
    case Fp8Gemm::WeightGrad: R = N, Cn = K, In = M; break;
  }
  if (R == 0 || Cn == 0) return;
  const math::Fp8Format fa = math::fp8_format_a(role), fb = math::fp8_format_b(role);
  const size_t na = static_cast<size_t>(role == Fp8Gemm::Forward ? K : N) * static_cast<size_t>(M);  // a's elements
  const size_t nb = static_cast<size_t>(role == Fp8Gemm::WeightGrad ? M : N) * static_cast<size_t>(K);
  const size_t kp = fp8_round_up(static_cast<size_t>(In > 0 ? In : 1), kFp8Align);
  const bool direct = Cn % kFp8Align == 0 && R % kFp8Align == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const size_t mp = direct ? static_cast<size_t>(Cn) : fp8_round_up(static_cast<size_t>(Cn), kFp8Align);
  const size_t np = direct ? static_cast<size_t>(R) : fp8_round_up(static_cast<size_t>(R), kFp8Align);
  // Scratch partition, each piece 256-byte aligned.
  const size_t o_part = 256, o_qa = o_part + fp8_round_up(2 * kFp8AmaxBlocks * sizeof(float), 256);
  const size_t o_qb = o_qa + fp8_round_up(np * kp, 256);      // B: the a operand, np rows (pad rows zero)
  const size_t o_d = o_qb + fp8_round_up(mp * kp, 256);       // A: the b operand, mp rows
  const size_t o_ws = o_d + (direct ? 0 : fp8_round_up(mp * np * sizeof(float), 256));
  const size_t total = o_ws + kFp8Workspace;  // == fp8_cuda_scratch_bytes (fp8.h), the memory plan's figure
  char* base = static_cast<char*>(scratch(total));
  Fp8Stats* st = reinterpret_cast<Fp8Stats*>(base);  // [0]: operand a, [1]: operand b
  float* part = reinterpret_cast<float*>(base + o_part);
  uint8_t* qa = reinterpret_cast<uint8_t*>(base + o_qa);
  uint8_t* qb = reinterpret_cast<uint8_t*>(base + o_qb);
  float* dpad = reinterpret_cast<float*>(base + o_d);
  void* ws = base + o_ws;

  // 1. amax and scales.
  auto amax = [&](const T* x, size_t n, math::Fp8Format f, float* p, Fp8Stats* s) {
    if (n) {
      fp8_amax_partial_kernel<T><<<kFp8AmaxBlocks, kBlock, 0, stream_>>>(x, n, p);
      ST_LAUNCHED("fp8_amax_partial_kernel");
    }
    fp8_amax_final_kernel<<<1, kBlock, 0, stream_>>>(p, n ? kFp8AmaxBlocks : 0, f, s);
    ST_LAUNCHED("fp8_amax_final_kernel");
  };
  amax(a, na, fa, part, st);
  amax(b, nb, fb, part + kFp8AmaxBlocks, st + 1);

  // 2. the fp8 copies, reduction dimension contiguous, zero padded to kp (and to the padded rows).
  auto quantize = [&](uint8_t* dst, const T* src, int drows, int drows_pad, int dcols, bool trans, math::Fp8Format f,
                      const Fp8Stats* s) {
    if (drows_pad > drows)
      ST_CUDA(cudaMemsetAsync(dst + static_cast<size_t>(drows) * kp, 0,
                              static_cast<size_t>(drows_pad - drows) * kp, stream_));
    if (drows == 0) return;
    const dim3 grid(static_cast<unsigned>((kp + kFp8Tile - 1) / kFp8Tile),
                    static_cast<unsigned>((drows + kFp8Tile - 1) / kFp8Tile));
    const dim3 block(kFp8Tile, 8);
    if (trans)
      fp8_quantize_kernel<T, true><<<grid, block, 0, stream_>>>(dst, src, drows, dcols, static_cast<int>(kp), f, s);
    else
      fp8_quantize_kernel<T, false><<<grid, block, 0, stream_>>>(dst, src, drows, dcols, static_cast<int>(kp), f, s);
    ST_LAUNCHED("fp8_quantize_kernel");
  };
  // B (GEMM) = operand a as [R, In]: Forward x [M, K], InputGrad dy [M, N], WeightGrad dy^T [N, M].
  quantize(qa, a, R, static_cast<int>(np), In, role == Fp8Gemm::WeightGrad, fa, st);
  // A (GEMM) = operand b as [Cn, In]: Forward W [N, K], InputGrad W^T [K, N], WeightGrad x^T [K, M].
  quantize(qb, b, Cn, static_cast<int>(mp), In, role != Fp8Gemm::Forward, fb, st + 1);

  // 3. D[mp x np] (column-major) = (A^T B) * inv_b * inv_a (+ C).
  const cudaDataType_t dt = direct ? cuda_type<T>() : CUDA_R_32F;
  Fp8LtDescs d;
  ST_CUBLAS(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  ST_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)));
  ST_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
  const float* inv_a_gemm = &st[1].inv;  // GEMM A = operand b
  const float* inv_b_gemm = &st[0].inv;  // GEMM B = operand a
  ST_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &inv_a_gemm,
                                           sizeof(inv_a_gemm)));
  ST_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &inv_b_gemm,
                                           sizeof(inv_b_gemm)));
  const int8_t fast = 0;
  ST_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  const uint64_t m64 = mp, n64 = np, k64 = kp;
  ST_CUBLAS(cublasLtMatrixLayoutCreate(&d.a, fp8_cuda_type(fb), k64, m64, static_cast<int64_t>(kp)));
  ST_CUBLAS(cublasLtMatrixLayoutCreate(&d.b, fp8_cuda_type(fa), k64, n64, static_cast<int64_t>(kp)));
  ST_CUBLAS(cublasLtMatrixLayoutCreate(&d.c, dt, m64, n64, static_cast<int64_t>(mp)));
  ST_CUBLAS(cublasLtMatmulPreferenceCreate(&d.pref));
  const size_t wsb = kFp8Workspace;
  ST_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  ST_CUBLAS(cublasLtMatmulAlgoGetHeuristic(lt_, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &heur, &found));
  if (found == 0)
    throw std::runtime_error("cuBLASLt has no FP8 GEMM for linear_fp8 (role " + std::to_string(static_cast<int>(role)) +
                             ", m " + std::to_string(mp) + ", n " + std::to_string(np) + ", k " + std::to_string(kp) +
                             ", output " + (dt == CUDA_R_32F ? "fp32" : "bf16") + ")");
  const float alpha = 1.0f, beta = (direct && accumulate) ? 1.0f : 0.0f;
  void* dptr = direct ? static_cast<void*>(out) : static_cast<void*>(dpad);
  ST_CUBLAS(cublasLtMatmul(lt_, d.op, &alpha, qb, d.a, qa, d.b, &beta, dptr, d.c, dptr, d.c, &heur.algo, ws, wsb,
                           stream_));
  if (!direct) {
    fp8_store_kernel<T><<<grid_for(static_cast<size_t>(R) * static_cast<size_t>(Cn), kBlock), kBlock, 0, stream_>>>(
        out, dpad, R, Cn, static_cast<int>(mp), accumulate);
    ST_LAUNCHED("fp8_store_kernel");
  }
}

#define ST_INSTANTIATE(T)                                    \
  template void CudaBackend<T>::fp8_check_device();          \
  template void CudaBackend<T>::linear_fp8(math::Fp8Gemm, int, int, int, const T*, const T*, T*, bool);
ST_INSTANTIATE(float)
ST_INSTANTIATE(bf16)
#undef ST_INSTANTIATE

}  // namespace cuda_detail
}  // namespace shardtrain
