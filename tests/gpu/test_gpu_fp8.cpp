// GPU tests of the CUDA backend's float8 linear GEMMs (Backend::linear_fp8, src/backend/cuda/fp8.cu;
// issue 57 item 3) against the CPU emulation (fp8_linear_emulated, src/backend/cpu/fp8.cpp) on the
// same stored inputs: every role (Forward, InputGrad, WeightGrad), float and bf16 storage, written
// and accumulated, at shapes with M, N, K multiples of 16 (cuBLASLt writes out directly) and not
// (the padded path: fp8 copies zero-padded to 16 in the reduction dimension, an fp32 scratch
// output written back by a kernel), operands of different magnitudes (x ~ 1, W ~ 0.02, dy ~ 1e-3:
// each gets its own scale), and an operand with a NaN (the whole product NaN).
//
// Run: `mpirun -np 1 build/gpu_tests --gtest_filter='Gpu*Fp8*'` (tests/gpu/fp8_stage.sh). Without a
// CUDA build or device every test is skipped ("skipped: no CUDA device"); on a device of compute
// capability < 8.9 linear_fp8 must refuse with std::runtime_error naming the capability, which is
// checked, and the comparisons are skipped. SHARDTRAIN_GPU_TESTS_EMULATE=1 (test_gpu.cpp's
// self-check) runs the comparisons with the CPU backend in place of the device: identical by
// construction, it exercises this file's code and tolerance, not the GPU.
//
// Tolerance (derived, not fitted). Both sides quantize identically: the same fp8_math.h functions
// on the same stored values (amax is exact, the scale divides in double, x * scale is one float
// product, no FMA can contract it), so the fp8 codes and both inverse scales are equal. The
// products of fp8 values are exact in fp32; what differs is (1) the order and precision of the
// accumulation: Hopper's FP8 tensor cores keep ~14 bits in their internal accumulator between
// cuBLASLt's promotions to fp32 (fast accumulation is off; DeepSeek-V3 report, sect. 3.3.2), so
// at most ~2^-13 of the sum of magnitudes: allowed 2^-12 * m, m = sum_k |a'_k b'_k| of the decoded,
// rescaled operands (plus |out| when accumulating); (2) the application of the two inverse scales
// (a few float roundings: inside the 2^-12 m); (3) the final rounding to T, which may fall on the
// other side of a rounding boundary: one unit of T's last place, unit_T * |ref| (bf16 2^-7,
// float 2^-23). An element passes when |got - ref| <= 2^-12 * m + unit_T * |ref| + 1e-30.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../test_env.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/backend/fp8.h"
#include "shardtrain/backend/fp8_math.h"

namespace st = shardtrain;
using st::bf16;

namespace {

// One CUDA context and its two backends for this file's tests (test_gpu.cpp keeps its own).
struct Fp8GpuState {
  bool checked = false, available = false, emulated = false;
  std::string skip_reason, init_error;
  std::unique_ptr<st::CudaContext> ctx;
  std::unique_ptr<st::Backend<float>> dev_f32;
  std::unique_ptr<st::Backend<bf16>> dev_bf16;
  void release() {
    dev_f32.reset();
    dev_bf16.reset();
    ctx.reset();
  }
};
Fp8GpuState& fs() {
  static Fp8GpuState s;
  return s;
}
class Fp8GpuEnvironment final : public ::testing::Environment {
 public:
  void TearDown() override { fs().release(); }
};
[[maybe_unused]] ::testing::Environment* const g_fp8_env = ::testing::AddGlobalTestEnvironment(new Fp8GpuEnvironment);

void fp8_check_once() {
  Fp8GpuState& s = fs();
  if (s.checked) return;
  s.checked = true;
  const char* emu = std::getenv("SHARDTRAIN_GPU_TESTS_EMULATE");
  if (emu && *emu && std::strcmp(emu, "0") != 0) {
    s.available = s.emulated = true;
    s.dev_f32 = st::make_cpu_backend<float>();
    s.dev_bf16 = st::make_cpu_backend<bf16>();
    return;
  }
  if (!st::cuda_built()) {
    s.skip_reason = "this build has no CUDA backend";
    return;
  }
  // cuda_device_count without its test hook (SHARDTRAIN_FAKE_CUDA_DEVICES reports devices that
  // cannot run anything), as test_gpu.cpp's real_device_count.
  const char* fake = std::getenv("SHARDTRAIN_FAKE_CUDA_DEVICES");
  const std::string saved = fake ? fake : "";
  if (fake) unsetenv("SHARDTRAIN_FAKE_CUDA_DEVICES");
  std::string why;
  const int n = st::cuda_device_count(&why);
  if (fake) setenv("SHARDTRAIN_FAKE_CUDA_DEVICES", saved.c_str(), 1);
  if (n <= 0) {
    s.skip_reason = why.empty() ? "no device found" : why;
    return;
  }
  s.available = true;
  try {
    s.ctx = st::CudaContext::create(st::testing::g_runtime->topo().local_rank % n);
    s.dev_f32 = st::make_cuda_backend<float>(*s.ctx);
    s.dev_bf16 = st::make_cuda_backend<bf16>(*s.ctx);
  } catch (const std::exception& e) {
    s.init_error = std::string("CUDA initialization failed: ") + e.what();
    s.release();
  }
}

template <typename T> st::Backend<T>& dev() {
  if constexpr (std::is_same_v<T, float>) return *fs().dev_f32;
  else return *fs().dev_bf16;
}

class GpuFp8 : public ::testing::Test {
 protected:
  void SetUp() override {
    fp8_check_once();
    if (!fs().available) {
      if (st::testing::comm().rank() == 0) std::printf("skipped: no CUDA device\n");
      GTEST_SKIP() << "skipped: no CUDA device (" << fs().skip_reason << ")";
    }
    if (!fs().init_error.empty()) FAIL() << fs().init_error;
  }
};

// Device buffers of T from host values (and back), freed with the backend.
template <typename T> struct DevBuf {
  st::Backend<T>& be;
  T* p;
  size_t n;
  DevBuf(st::Backend<T>& b, const std::vector<T>& h) : be(b), p(b.alloc(std::max<size_t>(h.size(), 1))), n(h.size()) {
    if (n) be.from_host(p, h.data(), n);
  }
  ~DevBuf() { be.free(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  std::vector<T> host() const {
    std::vector<T> h(n);
    if (n) be.to_host(h.data(), p, n);
    return h;
  }
};

template <typename T> std::vector<T> randn(size_t n, double sd, std::mt19937& g) {
  std::normal_distribution<double> d(0.0, sd);
  std::vector<T> v(n);
  for (auto& x : v) x = st::math::st<T>(static_cast<float>(d(g)));
  return v;
}
template <typename T> double wd(T x) { return static_cast<double>(st::math::ld(x)); }

// The decoded, rescaled fp8 value of every element of x (what the GEMM multiplies), |.|.
template <typename T> std::vector<double> dequantized_abs(const std::vector<T>& x, st::math::Fp8Format f, float scale) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    r[i] = std::fabs(static_cast<double>(st::math::fp8_decode(f, st::math::fp8_quantize(f, st::math::ld(x[i]), scale)))) /
           static_cast<double>(scale);
  return r;
}

const char* role_name(st::math::Fp8Gemm r) {
  return r == st::math::Fp8Gemm::Forward ? "Forward" : r == st::math::Fp8Gemm::InputGrad ? "InputGrad" : "WeightGrad";
}

// One comparison: role at M x N x K, accumulate or not; nan_at >= 0 puts a NaN into operand a.
template <typename T>
void check_linear_fp8(st::math::Fp8Gemm role, int M, int N, int K, bool accumulate, uint32_t seed, long nan_at = -1) {
  using st::math::Fp8Gemm;
  constexpr double unit = std::is_same_v<T, float> ? 0x1p-23 : 0x1p-7;
  const std::string what = std::string(std::is_same_v<T, float> ? "f32 " : "bf16 ") + role_name(role) + " M " +
                           std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K) +
                           (accumulate ? " accumulate" : "");
  SCOPED_TRACE(what);
  std::mt19937 g(seed);
  // Operand a: x [M, K] (Forward), dy [M, N]; operand b: W [N, K], x [M, K] (WeightGrad).
  const size_t M_ = static_cast<size_t>(M), N_ = static_cast<size_t>(N), K_ = static_cast<size_t>(K);
  const bool fwd = role == Fp8Gemm::Forward, wg = role == Fp8Gemm::WeightGrad;
  std::vector<T> a = randn<T>(fwd ? M_ * K_ : M_ * N_, fwd ? 1.0 : 1e-3, g);
  const std::vector<T> b = randn<T>(wg ? M_ * K_ : N_ * K_, wg ? 1.0 : 0.02, g);
  if (nan_at >= 0) a[static_cast<size_t>(nan_at) % a.size()] = st::math::st<T>(std::numeric_limits<float>::quiet_NaN());
  const int R = wg ? N : M, Cn = fwd ? N : K, In = fwd ? K : wg ? M : N;
  const std::vector<T> out0 = randn<T>(static_cast<size_t>(R) * static_cast<size_t>(Cn), 0.1, g);

  std::vector<T> ref = out0;
  const st::Fp8Scales s = st::fp8_linear_emulated<T>(role, M, N, K, a.data(), b.data(), ref.data(), accumulate);

  st::Backend<T>& be = dev<T>();
  DevBuf<T> da(be, a), db(be, b), dout(be, out0);
  try {
    be.linear_fp8(role, M, N, K, da.p, db.p, dout.p, accumulate);
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    if (msg.find("compute capability") != std::string::npos && msg.find("8.9") != std::string::npos)
      GTEST_SKIP() << "this GPU has no FP8 tensor cores; linear_fp8 refused as it must: " << msg;
    throw;
  }
  const std::vector<T> got = dout.host();

  // m = sum_k |a'_k b'_k| per element (+ |out0| when accumulating), from the decoded operands.
  const std::vector<double> qa = dequantized_abs(a, st::math::fp8_format_a(role), s.scale_a);
  const std::vector<double> qb = dequantized_abs(b, st::math::fp8_format_b(role), s.scale_b);
  auto A = [&](int r, int i) {  // the row-major [R, In] left factor, as linear() defines the role
    switch (role) {
      case Fp8Gemm::Forward: return qa[static_cast<size_t>(r) * K_ + static_cast<size_t>(i)];
      case Fp8Gemm::InputGrad: return qa[static_cast<size_t>(r) * N_ + static_cast<size_t>(i)];
      case Fp8Gemm::WeightGrad: return qa[static_cast<size_t>(i) * N_ + static_cast<size_t>(r)];
    }
    return 0.0;
  };
  auto B = [&](int i, int c) {  // the [In, Cn] right factor
    switch (role) {
      case Fp8Gemm::Forward: return qb[static_cast<size_t>(c) * K_ + static_cast<size_t>(i)];
      case Fp8Gemm::InputGrad: return qb[static_cast<size_t>(i) * K_ + static_cast<size_t>(c)];
      case Fp8Gemm::WeightGrad: return qb[static_cast<size_t>(i) * K_ + static_cast<size_t>(c)];
    }
    return 0.0;
  };
  size_t bad = 0, nan_ref = 0;
  double worst = 0;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < Cn; ++c) {
      const size_t e = static_cast<size_t>(r) * static_cast<size_t>(Cn) + static_cast<size_t>(c);
      const double want = wd(ref[e]), have = wd(got[e]);
      if (std::isnan(want)) {
        ++nan_ref;
        if (!std::isnan(have) && ++bad <= 5) ADD_FAILURE() << "element " << r << "," << c << ": " << have << ", want NaN";
        continue;
      }
      double m = accumulate ? std::fabs(wd(out0[e])) : 0.0;
      for (int i = 0; i < In; ++i) m += A(r, i) * B(i, c);
      const double tol = 0x1p-12 * m + unit * std::fabs(want) + 1e-30;
      const double err = std::fabs(have - want);
      worst = std::max(worst, err / tol);
      if (!(err <= tol) && ++bad <= 5)
        ADD_FAILURE() << "element " << r << "," << c << ": " << have << ", want " << want << " (|diff| " << err
                      << ", tolerance " << tol << ")";
    }
  if (nan_at >= 0) {
    EXPECT_EQ(nan_ref, static_cast<size_t>(R) * static_cast<size_t>(Cn)) << "a NaN operand: all NaN";
  }
  EXPECT_EQ(bad, 0u) << bad << " of " << R * Cn << " elements outside the tolerance";
  std::printf("[ GpuFp8 ] %-44s amax a %.3g b %.3g, worst |diff| / tolerance %.3f\n", what.c_str(), s.amax_a,
              s.amax_b, worst);
}

// Shapes: multiples of 16 (direct output), then M, N, K that are not (padded path), a single row.
template <typename T> void check_all_roles() {
  const int shapes[][3] = {{64, 128, 256}, {256, 48, 96}, {37, 50, 23}, {130, 33, 70}, {1, 16, 40}};
  uint32_t seed = 1;
  for (auto role : {st::math::Fp8Gemm::Forward, st::math::Fp8Gemm::InputGrad, st::math::Fp8Gemm::WeightGrad})
    for (const auto& sh : shapes)
      for (bool acc : {false, true}) {
        check_linear_fp8<T>(role, sh[0], sh[1], sh[2], acc, seed++);
        if (::testing::Test::HasFatalFailure() || ::testing::Test::IsSkipped()) return;
      }
}

TEST_F(GpuFp8, LinearMatchesEmulationF32) { check_all_roles<float>(); }
TEST_F(GpuFp8, LinearMatchesEmulationBf16) { check_all_roles<bf16>(); }
TEST_F(GpuFp8, NanOperandGivesNan) {
  check_linear_fp8<bf16>(st::math::Fp8Gemm::Forward, 32, 32, 32, false, 99, 17);
  check_linear_fp8<float>(st::math::Fp8Gemm::WeightGrad, 20, 24, 40, true, 98, 5);
}

}  // namespace
