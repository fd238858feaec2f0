// GPU tests: the CUDA backend (cuBLAS + kernels), the device-buffer collectives (NCCL and
// host-staged), mixed precision over an fp32 Fsdp, and the Llama model on the GPU, each against the
// CPU backend of the same storage type (or the host MPI Comm) on identical inputs.
//
// Run: `mpirun -np 1 build/gpu_tests` (any -np works; NCCL tests need one GPU per rank on a node and
// are skipped otherwise). Without a CUDA build or device every test is skipped and stdout carries
// the line "skipped: no CUDA device". Self-check of this file on a machine without a GPU:
// SHARDTRAIN_GPU_TESTS_EMULATE=1 replaces the CUDA backends by EmulatedBackend (emulated_backend.h:
// host memory, every op computed in double and rounded once) and the device Comms by the host
// Comm; everything then runs and must pass, which exercises the test code and its tolerances.
//
// What is checked (float and bf16 each, random inputs from fixed-seed std::mt19937):
//   memory: alloc is zeroed (after dirtying a block of the same size), zero, copy, alloc_ids;
//   gemm: all four transposes, padded leading dimensions, alpha/beta != (1, 0), beta == 0 over a
//     NaN-filled C (BLAS: C is not read), untouched padding; gemm_strided_batched: GQA shapes with
//     stride 0 on B, stride 0 on A, padded strides, both transposed;
//   axpy, scale, sum_squares (including > 1024 blocks); embedding forward (bitwise) and backward
//     (repeated ids; a token repeated 2200 times: one long run of the sorted positions);
//   rmsnorm forward (out, rstd) and backward (+= into non-zero dx, dw), row lengths that take the
//     16-byte packs and lengths that do not; rope forward/backward with
//     rope_tables; causal softmax forward/backward with rows of 1..300 (longer than a block) and
//     more rows than a grid (exact zeros above the diagonal); flash attention forward (y, lse) and
//     backward (dq, dk, dv) with GQA, MQA, T not a multiple of the tile, head dims 24, 64, 128
//     (max |diff| / max(1, max |ref|): f32 1e-5, bf16 2e-2), shardtrain's tiled kernels; bf16
//     attention through cuDNN's fused SDPA (CudnnAttentionBf16) at T = 2 .. 4096, GQA and MQA, head
//     dims 64 and 128, against the same CPU reference; block attention at global positions
//     (block_attention_run.h: random-size blocks, all pairs merged, backward accumulated; with and
//     without documents; y, lse, dq, dk, dv within the flash tolerances, skipped tile pairs equal);
//     bf16 block attention through cuDNN's SDPA on the pieces of each pair (CudnnBlockAttentionBf16:
//     required; context parallelism's head-tail blocks at cp 2 and 4 with and without documents,
//     uneven contiguous blocks),
//     the exact path's document mask, RoPE at positions (bitwise the device's whole-sequence rows);
//     rope_qk (queries and keys in one launch: bitwise the two calls, with and without positions);
//     swiglu forward/backward (16-byte packs with a tail, and one element off alignment: the scalar
//     kernel); the mixture-of-experts kernels (routing and its backward, the
//     probability sums, gather, combine and its backward);
//   cross_entropy for V = 50257, 260 and 7 (66000 rows; every fifth row without a target, kNoTarget:
//     no loss, a zero gradient row), with dlogits == nullptr, a separate
//     buffer and dlogits aliasing logits (loss and gradient; logits untouched when not aliased);
//     cross_entropy_sum over two calls read by take_loss_sum (the sum of the two losses, bitwise);
//   adamw (steps 1 and 1000); from_f32 (bitwise, incl. ties, NaN, Inf, overflow, subnormals);
//     add_to_f32;
//   Comm on device buffers (NCCL and staged): all_gather (out of place, in place), reduce_scatter_sum,
//     all_reduce Sum/Max/Min (float; bf16 must be refused, as MpiComm does), broadcast from every
//     root, count 0; ring_shift and start_ring_shift, a send/receive exchange between ranks r and
//     r^1, start_group with both neighbours (sends listed first: one NCCL group); bitwise equal to the same collective or transfer on host buffers through the MPI Comm
//     (inputs are small dyadic numbers, so every summation order is exact);
//   MixedPrecisionUnits over Fsdp<float> on CUDA vs on CPU: gathered bf16 bitwise equal (and equal
//     to rounding the fp32 shards on the host), reduce_scatter_grad (reduce_bf16 false / true);
//   checkpoint snapshots (CheckpointSnapshotPinned): into pinned host memory on the copy stream,
//     ordered after the queued updates, isolated from the next ones (see check_checkpoint_snapshot);
//   LlamaModel<float> "tiny" forward+backward: loss within 1e-5 relative, every gradient shard within
//     1e-4 of its max-abs, eval logits within 1e-4 of their max-abs; the same with the document mask
//     (EOS tokens in the batch: positions per document, the block attention kernels); LlamaModel<bf16> through
//     MixedPrecisionUnits: loss within 1e-2 relative, gradient shards with cosine similarity >= 0.99.
//
// Tolerances. The two sides run the same per-element math (ops_math.h) on the same stored inputs;
// they differ in summation order, FMA contraction (nvcc contracts, g++ -std=c++20 does not) and,
// for bf16, possibly in the last-bit rounding of a result. An element passes when
//     |got - ref| <= rtol_T * |ref| + r32(n) * m + atol_T * rms(ref)
//   m      = the sum of the magnitudes of the terms that make the element (|alpha| sum |a_ik b_kj| +
//            |beta c| for a GEMM, |x1 cos| + |x2 sin| for RoPE, ...; m = |ref| when nothing cancels).
//            Rounding errors scale with m, not with the result, wherever terms cancel.
//   r32(n) = max(1e-5, 4 sqrt(n) 2^-24): fp32 arithmetic (both types compute in fp32) over a
//            reduction of n terms; 1e-5 bounds K 2^-24 (Higham's gamma_K, any order) for K <= 160,
//            and 4 sqrt(n) u is the probabilistic bound for longer sums (V = 50257, N = 66000).
//   float: rtol 1e-5, atol 1e-6.  bf16: rtol 1e-2 (one bf16 ulp is at most 2^-7 = 0.0078 of a
//            value: each side rounds a nearly equal fp32 value once), atol 1e-3.
// Exceptions: embedding_backward on random data allows (r+1) roundings of T per row repeated r
// times (the CPU's bf16 path rounds after every addition; the GPU sums a row's repeats in float, in
// position order, and rounds once); on dyadic data (every partial sum
// exact) it is bitwise, as are embedding_forward, from_f32, the collectives and the mixed-precision
// gathers. sum_squares (double accumulation): 1e-9 relative. Mixed-precision gradient shards: the
// float criterion with m = sum over ranks of |g| / W, plus 2 (W - 1) 2^-8 m with reduce_bf16 (the
// bf16 reduction rounds once per step on either side; exact at one rank). Each comparison prints
// "[ GPU ] <what>: <n> elements, worst |diff|/allowed <r>" on rank 0, so margins show in CI logs.
// Placement: device local_rank % device count (device 0 at one rank).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../test_env.h"
#include "../unit/block_attention_run.h"
#include "emulated_backend.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/data/data.h"
#include "shardtrain/model/model.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard.h"

namespace st = shardtrain;
using st::bf16;

// A config whose plain RoPE (rope_inv_freqs) has head size HD and base theta.
static shardtrain::ModelConfig rope_test_config(int HD, double theta) {
  shardtrain::ModelConfig c;
  c.hidden_size = HD;
  c.num_attention_heads = 1;
  c.rope_theta = theta;
  return c;
}

namespace {

// =============================================================================================
// Shared state: one CUDA context and its backends for the whole binary, created by the first
// test's SetUp, released by the environment's TearDown (before MPI_Finalize and before the CUDA
// runtime unloads).

struct GpuState {
  bool checked = false;
  bool available = false;  // run the tests: a device on every rank (or emulation)
  bool emulated = false;
  std::string skip_reason;  // when !available
  std::string init_error;   // context or backends failed to start: every test fails with it
  int devices = 0;
  std::unique_ptr<st::CudaContext> ctx;
  std::unique_ptr<st::Backend<float>> dev_f32, cpu_f32;
  std::unique_ptr<st::Backend<bf16>> dev_bf16, cpu_bf16;
  // Device Comms, made on first use (make_nccl_comm is collective).
  bool comms_made = false;
  std::string nccl_skip, nccl_error;
  std::unique_ptr<st::Comm> nccl_owned, staged_owned;
  st::Comm* nccl = nullptr;
  st::Comm* staged = nullptr;

  void release() {
    nccl = staged = nullptr;
    nccl_owned.reset();
    staged_owned.reset();
    dev_f32.reset();
    dev_bf16.reset();
    cpu_f32.reset();
    cpu_bf16.reset();
    ctx.reset();
  }
};

GpuState& gs() {
  static GpuState s;
  return s;
}

class GpuEnvironment final : public ::testing::Environment {
 public:
  void TearDown() override { gs().release(); }
};
[[maybe_unused]] ::testing::Environment* const g_gpu_env = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

st::Comm& host() { return st::testing::comm(); }

// cuda_device_count without its test hook: SHARDTRAIN_FAKE_CUDA_DEVICES would report devices that
// cannot run anything.
int real_device_count(std::string* why) {
  const char* fake = std::getenv("SHARDTRAIN_FAKE_CUDA_DEVICES");
  const std::string saved = fake ? fake : "";
  if (fake) unsetenv("SHARDTRAIN_FAKE_CUDA_DEVICES");
  const int n = st::cuda_device_count(why);
  if (fake) setenv("SHARDTRAIN_FAKE_CUDA_DEVICES", saved.c_str(), 1);
  return n;
}

void note_skip() {
  if (host().rank() == 0) {
    std::printf("skipped: no CUDA device\n");
    std::fflush(stdout);
  }
}

// Collective on first call (every rank's first test's SetUp): all ranks agree whether to run.
void check_once() {
  GpuState& s = gs();
  if (s.checked) return;
  s.checked = true;
  st::Comm& c = host();
  const char* emu = std::getenv("SHARDTRAIN_GPU_TESTS_EMULATE");
  if (emu && *emu && std::strcmp(emu, "0") != 0) {
    s.available = s.emulated = true;
    s.dev_f32 = std::make_unique<st::gputest::EmulatedBackend<float>>();
    s.dev_bf16 = std::make_unique<st::gputest::EmulatedBackend<bf16>>();
    s.cpu_f32 = st::make_cpu_backend<float>();
    s.cpu_bf16 = st::make_cpu_backend<bf16>();
    if (c.rank() == 0)
      std::printf("[ GPU ] SHARDTRAIN_GPU_TESTS_EMULATE is set: the device backend is emulated on the CPU "
                  "(a self-check of these tests; no GPU is used)\n");
    return;
  }
  if (!st::cuda_built()) {
    s.skip_reason = "this build has no CUDA backend";
    note_skip();
    return;
  }
  std::string why;
  const int n = real_device_count(&why);
  int64_t everywhere = n > 0 ? 1 : 0;
  c.all_reduce(&everywhere, 1, st::ReduceOp::Min);
  if (everywhere == 0) {
    s.skip_reason = n > 0 ? "another rank has none" : (why.empty() ? "no device found" : why);
    note_skip();
    return;
  }
  s.available = true;
  s.devices = n;
  std::string err;
  try {
    // Device 0 for a single rank; with several ranks on a node, one device each where possible.
    const int device = st::testing::g_runtime->topo().local_rank % n;
    s.ctx = st::CudaContext::create(device);
    s.dev_f32 = st::make_cuda_backend<float>(*s.ctx);
    s.dev_bf16 = st::make_cuda_backend<bf16>(*s.ctx);
  } catch (const std::exception& e) {
    err = std::string("CUDA initialization failed: ") + e.what();
  }
  int64_t ok = err.empty() ? 1 : 0;
  c.all_reduce(&ok, 1, st::ReduceOp::Min);
  if (ok == 0) {
    s.init_error = err.empty() ? "CUDA initialization failed on another rank" : err;
    s.release();
    return;
  }
  s.cpu_f32 = st::make_cpu_backend<float>();
  s.cpu_bf16 = st::make_cpu_backend<bf16>();
  if (c.rank() == 0) std::printf("[ GPU ] device %d: %s\n", s.ctx->device(), s.ctx->device_name().c_str());
}

// Collective on first call. NCCL refuses two ranks on one GPU: skipped (on every rank) then.
void ensure_comms() {
  GpuState& s = gs();
  if (s.comms_made) return;
  s.comms_made = true;
  st::Comm& c = host();
  if (s.emulated) {  // emulated device memory is host memory
    s.nccl = s.staged = &c;
    return;
  }
  s.staged_owned = st::make_staged_comm(c, *s.ctx);
  s.staged = s.staged_owned.get();
  const st::Topology& topo = st::testing::g_runtime->topo();
  int64_t fits = topo.local_size <= s.devices ? 1 : 0;
  c.all_reduce(&fits, 1, st::ReduceOp::Min);
  if (fits == 0) {
    s.nccl_skip = "NCCL needs one GPU per rank; here " + std::to_string(topo.local_size) + " ranks share " +
                  std::to_string(s.devices) + " GPU(s) on a node";
    return;
  }
  try {
    s.nccl_owned = st::make_nccl_comm(c, *s.ctx);  // failures are agreed: every rank throws
    s.nccl = s.nccl_owned.get();
  } catch (const std::exception& e) {
    s.nccl_error = e.what();
  }
}

// The device Comm for Fsdp's data traffic: NCCL when usable, else host-staged.
st::Comm& data_comm() {
  ensure_comms();
  return gs().nccl ? *gs().nccl : *gs().staged;
}

template <typename T> st::Backend<T>& dev() {
  if constexpr (std::is_same_v<T, float>) return *gs().dev_f32;
  else return *gs().dev_bf16;
}
template <typename T> st::Backend<T>& cpu() {
  if constexpr (std::is_same_v<T, float>) return *gs().cpu_f32;
  else return *gs().cpu_bf16;
}

// =============================================================================================
// Values, transfers, comparisons

constexpr double kU32 = 0x1p-24;  // unit roundoff of float

template <typename T> struct Tol;
template <> struct Tol<float> {
  static constexpr double rtol = 1e-5, atol = 1e-6, unit = 0x1p-24;
  static constexpr const char* name = "f32";
};
template <> struct Tol<bf16> {
  static constexpr double rtol = 1e-2, atol = 1e-3, unit = 0x1p-8;
  static constexpr const char* name = "bf16";
};
// fp32 arithmetic over a reduction of n terms (see the header).
double r32(size_t n) { return std::max(1e-5, 4.0 * std::sqrt(static_cast<double>(n)) * kU32); }

template <typename T> double val(T x) { return static_cast<double>(st::math::ld(x)); }
template <typename T> T cast(double x) { return st::math::st<T>(static_cast<st::math::Acc<T>>(x)); }
template <typename T> uint32_t bits(T x) {
  if constexpr (std::is_same_v<T, float>) return std::bit_cast<uint32_t>(x);
  else return x.bits;
}
template <typename T> std::string label(const std::string& s) { return s + " [" + Tol<T>::name + "]"; }

template <typename T> std::vector<T> randn(size_t n, std::mt19937& g, double sd = 1.0, double mean = 0.0) {
  std::normal_distribution<double> d(mean, sd);
  std::vector<T> v(n);
  for (auto& x : v) x = cast<T>(d(g));
  return v;
}
std::vector<int32_t> rand_ids(size_t n, int V, std::mt19937& g) {
  std::uniform_int_distribution<int32_t> d(0, V - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

template <typename T> st::Buffer<T> upload(st::Backend<T>& be, const std::vector<T>& h) {
  st::Buffer<T> b(be, h.size());
  if (!h.empty()) be.from_host(b.data(), h.data(), h.size());
  return b;
}
template <typename T> st::IdBuffer<T> upload_ids(st::Backend<T>& be, const std::vector<int32_t>& h) {
  st::IdBuffer<T> b(be, h.size());
  if (!h.empty()) be.ids_from_host(b.data(), h.data(), h.size());
  return b;
}
template <typename T> std::vector<T> download(st::Backend<T>& be, const T* p, size_t n) {
  std::vector<T> h(n);
  if (n) be.to_host(h.data(), p, n);
  return h;
}

std::string fmt(double x) {
  char b[40];
  std::snprintf(b, sizeof b, "%.9g", x);
  return b;
}
void note(const std::string& line) {
  if (host().rank() == 0) std::printf("[ GPU ] %s\n", line.c_str());
}

template <typename T> double rms(const std::vector<T>& v) {
  double s = 0;
  size_t n = 0;
  for (const T& x : v) {
    const double d = val(x);
    if (std::isfinite(d)) {
      s += d * d;
      ++n;
    }
  }
  return n ? std::sqrt(s / static_cast<double>(n)) : 0.0;
}

// got vs ref element by element with a per-element allowed error; reports the worst element
// (largest |diff| / allowed) and prints one summary line.
template <typename T>
void expect_within(const std::string& what, const std::vector<T>& got, const std::vector<T>& ref,
                   const std::vector<double>& allowed) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  ASSERT_EQ(allowed.size(), ref.size()) << what;
  size_t bad = 0, wi = 0;
  double worst = -1;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = val(got[i]), w = val(ref[i]);
    bool ok;
    double ratio;
    if (!std::isfinite(g) || !std::isfinite(w)) {
      ok = (std::isnan(g) && std::isnan(w)) || g == w;
      ratio = ok ? 0.0 : std::numeric_limits<double>::infinity();
    } else {
      const double e = std::fabs(g - w);
      ok = e <= allowed[i];
      ratio = allowed[i] > 0 ? e / allowed[i] : (e == 0 ? 0.0 : std::numeric_limits<double>::infinity());
    }
    if (!ok) ++bad;
    if (ratio > worst) {
      worst = ratio;
      wi = i;
    }
  }
  if (ref.empty()) return;
  note(what + ": " + std::to_string(ref.size()) + " elements, worst |diff|/allowed " + fmt(worst));
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << ref.size() << " elements outside tolerance; worst at ["
                     << wi << "]: got " << fmt(val(got[wi])) << ", want " << fmt(val(ref[wi])) << ", |diff| "
                     << fmt(std::fabs(val(got[wi]) - val(ref[wi]))) << ", allowed " << fmt(allowed[wi]);
}

// The standard criterion (header): allowed = rtol_T |ref| + r32(n) m + atol_T rms(ref); mag empty
// means m = |ref| (nothing cancels).
template <typename T>
void expect_close(const std::string& what, const std::vector<T>& got, const std::vector<T>& ref,
                  const std::vector<double>& mag, size_t n_terms) {
  const double s = rms(ref), rf = r32(n_terms);
  std::vector<double> allowed(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    const double w = std::fabs(val(ref[i]));
    const double m = mag.empty() ? w : mag[i];
    allowed[i] = Tol<T>::rtol * w + rf * m + Tol<T>::atol * s;
  }
  expect_within(label<T>(what), got, ref, allowed);
}

// Bitwise equality; two NaNs count as equal when nan_equal.
template <typename T>
void expect_bitwise(const std::string& what, const std::vector<T>& got, const std::vector<T>& ref,
                    bool nan_equal = false) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (bits(got[i]) == bits(ref[i])) continue;
    if (nan_equal && std::isnan(val(got[i])) && std::isnan(val(ref[i]))) continue;
    if (bad++ == 0) first = i;
  }
  char b[160] = "";
  if (bad)
    std::snprintf(b, sizeof b, "first at [%zu]: got 0x%x (%.9g), want 0x%x (%.9g)", first, bits(got[first]),
                  val(got[first]), bits(ref[first]), val(ref[first]));
  EXPECT_EQ(bad, 0u) << label<T>(what) << ": " << bad << " of " << ref.size() << " elements differ; " << b;
}

// =============================================================================================
// Fixture

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    check_once();
    const GpuState& s = gs();
    if (!s.available) GTEST_SKIP() << "skipped: no CUDA device (" << s.skip_reason << ")";
    ran_ = true;
    trace_ = std::make_unique<::testing::ScopedTrace>(
        __FILE__, __LINE__, "rank " + std::to_string(host().rank()) + " of " + std::to_string(host().world_size()));
    if (!s.init_error.empty()) FAIL() << s.init_error;
  }
  // As tests/mpi: rank 0 reports failures of other ranks (gtest prints on rank 0 only). Every
  // rank runs the same tests, so this all_reduce is matched.
  void TearDown() override {
    trace_.reset();
    if (!ran_) return;
    st::Comm& c = host();
    const int64_t mine = ::testing::Test::HasFailure() ? 1 : 0;
    int64_t failed = mine;
    c.all_reduce(&failed, 1, st::ReduceOp::Sum);
    if (c.rank() == 0 && failed > mine)
      ADD_FAILURE() << "this test failed on " << failed - mine << " other rank(s) (their output is not printed)";
  }

 private:
  bool ran_ = false;
  std::unique_ptr<::testing::ScopedTrace> trace_;
};

// =============================================================================================
// Memory

template <typename T> void check_alloc() {
  st::Backend<T>& be = dev<T>();
  std::mt19937 g(11);
  for (size_t n : {size_t{1}, size_t{1000}, (size_t{1} << 20) + 3}) {
    {  // dirty a block of the same size first: a recycled block must still come back zeroed
      std::vector<T> junk = randn<T>(n, g, 1.0, 5.0);
      st::Buffer<T> dirty = upload(be, junk);
      be.synchronize();
    }
    st::Buffer<T> b(be, n);
    expect_bitwise("alloc(" + std::to_string(n) + ") zeroed", download(be, b.data(), n), std::vector<T>(n, T{}));
    // copy (device to device) and zero of a sub-range.
    const std::vector<T> x = randn<T>(n, g);
    be.from_host(b.data(), x.data(), n);
    st::Buffer<T> c(be, n);
    be.copy(c.data(), b.data(), n);
    be.zero(b.data() + n / 2, n - n / 2);
    std::vector<T> want = x;
    std::fill(want.begin() + static_cast<std::ptrdiff_t>(n / 2), want.end(), T{});
    expect_bitwise("copy", download(be, c.data(), n), x);
    expect_bitwise("zero of the upper half", download(be, b.data(), n), want);
  }
  // alloc_ids is zeroed too: a lookup through fresh ids reads row 0 everywhere. The ids are
  // dirtied first with in-range values only, so that a non-zeroed block cannot index out of range.
  const int V = 50, C = 33, N = 300;
  {
    std::vector<int32_t> junk(N);
    for (int i = 0; i < N; ++i) junk[static_cast<size_t>(i)] = 1 + i % (V - 1);
    st::IdBuffer<T> dirty = upload_ids(be, junk);
    be.synchronize();
  }
  st::IdBuffer<T> ids(be, N);
  const std::vector<T> table = randn<T>(static_cast<size_t>(V) * C, g);
  st::Buffer<T> dt = upload(be, table), out(be, static_cast<size_t>(N) * C);
  be.embedding_forward(out.data(), ids.data(), dt.data(), N, C);
  std::vector<T> want(static_cast<size_t>(N) * C);
  for (int i = 0; i < N; ++i) std::copy(table.begin(), table.begin() + C, want.begin() + static_cast<std::ptrdiff_t>(i) * C);
  expect_bitwise("alloc_ids zeroed (lookup of row 0)", download(be, out.data(), want.size()), want);
}

// =============================================================================================
// GEMM

struct GemmCase {
  bool ta, tb;
  int M, N, K;
  int lda;
  int64_t sa;
  int ldb;
  int64_t sb;
  int ldc;
  int64_t sc;
  int batch;
  double alpha, beta;
  bool nan_c;  // C filled with NaN (beta must be 0: C is not read)
  std::string name;
};

size_t span(int rows, int cols, int ld, int64_t stride, int batch) {
  return static_cast<size_t>(batch - 1) * static_cast<size_t>(stride) + static_cast<size_t>(rows - 1) * ld +
         static_cast<size_t>(cols);
}

template <typename T> void gemm_case(const GemmCase& c, bool batched, std::mt19937& g) {
  using S = st::math::Acc<T>;
  const int ra = c.ta ? c.K : c.M, ca = c.ta ? c.M : c.K, rb = c.tb ? c.N : c.K, cb = c.tb ? c.K : c.N;
  ASSERT_GE(c.lda, ca);
  ASSERT_GE(c.ldb, cb);
  ASSERT_GE(c.ldc, c.N);
  const size_t ea = span(ra, ca, c.lda, c.sa, c.batch), eb = span(rb, cb, c.ldb, c.sb, c.batch);
  const size_t ec = span(c.M, c.N, c.ldc, c.sc, c.batch);
  const std::vector<T> A = randn<T>(ea, g), B = randn<T>(eb, g);
  const std::vector<T> C0 =
      c.nan_c ? std::vector<T>(ec, cast<T>(std::numeric_limits<double>::quiet_NaN())) : randn<T>(ec, g);
  auto run = [&](st::Backend<T>& be) {
    st::Buffer<T> dA = upload(be, A), dB = upload(be, B), dC = upload(be, C0);
    if (batched)
      be.gemm_strided_batched(c.ta, c.tb, c.M, c.N, c.K, static_cast<S>(c.alpha), dA.data(), c.lda, c.sa, dB.data(),
                              c.ldb, c.sb, static_cast<S>(c.beta), dC.data(), c.ldc, c.sc, c.batch);
    else
      be.gemm(c.ta, c.tb, c.M, c.N, c.K, static_cast<S>(c.alpha), dA.data(), c.lda, dB.data(), c.ldb,
              static_cast<S>(c.beta), dC.data(), c.ldc);
    return download(be, dC.data(), ec);
  };
  const std::vector<T> got = run(dev<T>()), want = run(cpu<T>());

  // op(X)[i, k] of matrix b, X stored row-major with row stride ld and matrix stride s.
  auto op = [](const std::vector<T>& X, int64_t s, int ld, bool trans, int b, int i, int k) {
    const size_t o = static_cast<size_t>(b) * static_cast<size_t>(s);
    return val(trans ? X[o + static_cast<size_t>(k) * ld + i] : X[o + static_cast<size_t>(i) * ld + k]);
  };
  std::vector<int> written(ec, 0);
  std::vector<T> got_w, want_w;
  std::vector<double> mag;
  for (int b = 0; b < c.batch; ++b)
    for (int i = 0; i < c.M; ++i)
      for (int j = 0; j < c.N; ++j) {
        const size_t idx = static_cast<size_t>(b) * static_cast<size_t>(c.sc) + static_cast<size_t>(i) * c.ldc + j;
        ++written[idx];
        double m = 0;
        for (int k = 0; k < c.K; ++k) m += std::fabs(op(A, c.sa, c.lda, c.ta, b, i, k) * op(B, c.sb, c.ldb, c.tb, b, k, j));
        m = std::fabs(c.alpha) * m + (c.beta != 0 ? std::fabs(c.beta * val(C0[idx])) : 0.0);
        got_w.push_back(got[idx]);
        want_w.push_back(want[idx]);
        mag.push_back(m);
      }
  ASSERT_EQ(std::count_if(written.begin(), written.end(), [](int w) { return w > 1; }), 0)
      << c.name << ": test bug, output matrices overlap";
  const std::string what = c.name + (c.ta ? " A^T" : " A") + (c.tb ? " B^T" : " B") + " M=" + std::to_string(c.M) +
                           " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K);
  expect_close(what, got_w, want_w, mag, static_cast<size_t>(c.K) + 2);
  // Elements outside every op(A) op(B) block (ldc padding, gaps between strided matrices) are untouched.
  std::vector<T> got_gap, want_gap;
  for (size_t i = 0; i < ec; ++i)
    if (!written[i]) {
      got_gap.push_back(got[i]);
      want_gap.push_back(C0[i]);
    }
  expect_bitwise(what + ": padding of C untouched", got_gap, want_gap);
}

template <typename T> void check_gemm() {
  std::mt19937 g(1001);
  struct Shape { int M, N, K; double alpha, beta; bool nan_c; };
  for (const Shape& s : {Shape{37, 53, 61, 0.75, -0.5, false}, Shape{128, 96, 160, -1.25, 0.25, false},
                         Shape{1, 7, 3, 1.0, 1.0, false}, Shape{45, 33, 20, 1.5, 0.0, true}})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        GemmCase c{};
        c.ta = ta != 0;
        c.tb = tb != 0;
        c.M = s.M;
        c.N = s.N;
        c.K = s.K;
        c.lda = (c.ta ? s.M : s.K) + 5;  // lda > columns of A as stored
        c.ldb = (c.tb ? s.K : s.N) + 3;
        c.ldc = s.N + 7;
        c.batch = 1;
        c.alpha = s.alpha;
        c.beta = s.beta;
        c.nan_c = s.nan_c;
        c.name = s.nan_c ? "gemm beta=0 over NaN C" : "gemm";
        gemm_case<T>(c, false, g);
      }
}

template <typename T> void check_gemm_batched() {
  std::mt19937 g(1002);
  // Attention with GQA: T = 33, HD = 24, NH = 8, NKV = 2, G = 4 query heads per key/value head.
  const int Tq = 33, HD = 24, NH = 8, NKV = 2, G = NH / NKV;
  std::vector<GemmCase> cases;
  // scores_h = q_h k^T: A = q (row stride NH*HD, head stride HD), B = the shared k (stride 0).
  cases.push_back({false, true, Tq, Tq, HD, NH * HD, HD, NKV * HD, 0, Tq, int64_t{Tq} * Tq + 5, G,
                   1.0 / std::sqrt(24.0), 0.0, false, "batched q k^T (stride_b 0)"});
  // y_h = att_h v: B = the shared v (stride 0), C = y (row stride NH*HD, head stride HD), beta != 0.
  cases.push_back({false, false, Tq, HD, Tq, Tq, int64_t{Tq} * Tq, NKV * HD, 0, NH * HD, HD, G, 1.0, 0.5, false,
                   "batched att v (stride_b 0)"});
  // Both transposed, every stride padded.
  cases.push_back({true, true, 20, 18, 26, 22, 26 * 22 + 11, 27, 18 * 27 + 3, 22, 20 * 22 + 9, 3, -1.5, 0.25, false,
                   "batched padded strides"});
  // Shared A (stride 0), A transposed.
  cases.push_back({true, false, 16, 40, 64, 16, 0, 48, 64 * 48, 40, 16 * 40, 5, 0.5, -1.0, false,
                   "batched stride_a 0"});
  for (const GemmCase& c : cases) gemm_case<T>(c, true, g);
}

// =============================================================================================
// Elementwise and reductions

template <typename T> void check_axpy_scale() {
  using S = st::math::Acc<T>;
  std::mt19937 g(2001);
  const size_t n = 100003;
  const std::vector<T> x = randn<T>(n, g), y = randn<T>(n, g);
  const double alpha = -0.37, beta = 1.7;
  auto run = [&](st::Backend<T>& be) {
    st::Buffer<T> dx = upload(be, x), dy = upload(be, y);
    be.axpy(n, static_cast<S>(alpha), dx.data(), dy.data());
    be.scale(n, static_cast<S>(beta), dx.data());
    return std::make_pair(download(be, dy.data(), n), download(be, dx.data(), n));
  };
  const auto got = run(dev<T>()), want = run(cpu<T>());
  std::vector<double> mag(n);
  for (size_t i = 0; i < n; ++i) mag[i] = std::fabs(val(y[i])) + std::fabs(alpha * val(x[i]));
  expect_close("axpy", got.first, want.first, mag, 2);
  expect_close("scale", got.second, want.second, {}, 1);
}

template <typename T> void check_sum_squares() {
  std::mt19937 g(2002);
  for (size_t n : {size_t{5}, size_t{1000}, (size_t{1} << 20) + 7}) {
    const std::vector<T> x = randn<T>(n, g, 1.0, 0.5);
    auto run = [&](st::Backend<T>& be) {
      st::Buffer<T> d = upload(be, x);
      return be.sum_squares(d.data(), n);
    };
    const double got = run(dev<T>()), want = run(cpu<T>());
    EXPECT_LE(std::fabs(got - want), 1e-9 * want) << label<T>("sum_squares n=" + std::to_string(n)) << ": got "
                                                   << fmt(got) << ", want " << fmt(want);
  }
}

template <typename T> void check_embedding_forward() {
  std::mt19937 g(3001);
  struct Case { int V, C, N; };
  for (const Case& c : {Case{97, 300, 257}, Case{13, 8, 70000}}) {  // C > block; more rows than a grid
    const std::vector<T> table = randn<T>(static_cast<size_t>(c.V) * c.C, g);
    const std::vector<int32_t> tok = rand_ids(static_cast<size_t>(c.N), c.V, g);
    auto run = [&](st::Backend<T>& be) {
      st::Buffer<T> dt = upload(be, table), out(be, static_cast<size_t>(c.N) * c.C);
      st::IdBuffer<T> ids = upload_ids(be, tok);
      be.embedding_forward(out.data(), ids.data(), dt.data(), c.N, c.C);
      return download(be, out.data(), static_cast<size_t>(c.N) * c.C);
    };
    expect_bitwise("embedding_forward N=" + std::to_string(c.N) + " C=" + std::to_string(c.C), run(dev<T>()),
                   run(cpu<T>()));
  }
}

template <typename T> void check_embedding_backward() {
  std::mt19937 g(3002);
  auto run = [](st::Backend<T>& be, const std::vector<T>& dtable0, const std::vector<int32_t>& tok,
                const std::vector<T>& dout, int N, int C) {
    st::Buffer<T> dt = upload(be, dtable0), dd = upload(be, dout);
    st::IdBuffer<T> ids = upload_ids(be, tok);
    be.embedding_backward(dt.data(), ids.data(), dd.data(), N, C);
    return download(be, dt.data(), dtable0.size());
  };
  {  // Random data: 40 ids used 3 times each, rows 40..49 unused (must stay as they were).
    const int V = 50, C = 300, N = 120;
    std::vector<int32_t> tok(N);
    for (int i = 0; i < N; ++i) tok[static_cast<size_t>(i)] = i % 40;
    std::shuffle(tok.begin(), tok.end(), g);
    const std::vector<T> dt0 = randn<T>(static_cast<size_t>(V) * C, g), dout = randn<T>(static_cast<size_t>(N) * C, g);
    const std::vector<T> got = run(dev<T>(), dt0, tok, dout, N, C), want = run(cpu<T>(), dt0, tok, dout, N, C);
    std::vector<double> mag(dt0.size()), count(static_cast<size_t>(V), 0.0);
    for (size_t i = 0; i < dt0.size(); ++i) mag[i] = std::fabs(val(dt0[i]));
    for (int i = 0; i < N; ++i) {
      const size_t row = static_cast<size_t>(tok[static_cast<size_t>(i)]);
      count[row] += 1;
      for (int c = 0; c < C; ++c) mag[row * C + c] += std::fabs(val(dout[static_cast<size_t>(i) * C + c]));
    }
    // Up to r+1 roundings of T on either side (the CPU rounds bf16 after every addition).
    const double s = rms(want);
    std::vector<double> allowed(dt0.size());
    for (size_t i = 0; i < dt0.size(); ++i)
      allowed[i] = Tol<T>::rtol * std::fabs(val(want[i])) + (count[i / C] + 1) * 2 * Tol<T>::unit * mag[i] +
                   Tol<T>::atol * s;
    expect_within(label<T>("embedding_backward random, ids x3"), got, want, allowed);
  }
  {  // Dyadic data, every partial sum exact in bf16 whatever the order: bitwise. Token 1 is repeated
     // 2200 times (one long run of the sorted positions), 266 others 3-4 times.
    const int V = 400, C = 40, N = 3000, hot = 2200;
    std::vector<int32_t> tok(N);
    for (int i = 0; i < N; ++i) tok[static_cast<size_t>(i)] = i < hot ? 1 : 2 + (i - hot) % 266;
    std::shuffle(tok.begin(), tok.end(), g);
    std::uniform_int_distribution<int> small(-8, 8), step(-1, 1);
    std::vector<T> dt0(static_cast<size_t>(V) * C), dout(static_cast<size_t>(N) * C);
    for (auto& x : dt0) x = cast<T>(small(g) / 16.0);
    int hot_seen = 0;
    for (int i = 0; i < N; ++i) {
      const bool is_hot = tok[static_cast<size_t>(i)] == 1;
      for (int c = 0; c < C; ++c) {
        // Hot row: +-1/16 at about one occurrence in 11, so that its sum of |terms| stays < 16.
        const double v = is_hot ? ((hot_seen + c) % 11 == 0 ? step(g) / 16.0 : 0.0) : small(g) / 16.0;
        dout[static_cast<size_t>(i) * C + c] = cast<T>(v);
      }
      hot_seen += is_hot;
    }
    std::vector<double> exact(dt0.size()), absum(dt0.size());
    for (size_t i = 0; i < dt0.size(); ++i) absum[i] = std::fabs(exact[i] = val(dt0[i]));
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < C; ++c) {
        const size_t k = static_cast<size_t>(tok[static_cast<size_t>(i)]) * C + c;
        exact[k] += val(dout[static_cast<size_t>(i) * C + c]);
        absum[k] += std::fabs(val(dout[static_cast<size_t>(i) * C + c]));
      }
    ASSERT_LT(*std::max_element(absum.begin(), absum.end()), 16.0) << "test bug: sums would not be exact in bf16";
    std::vector<T> want_exact(dt0.size());
    for (size_t i = 0; i < exact.size(); ++i) want_exact[i] = cast<T>(exact[i]);
    const std::vector<T> got = run(dev<T>(), dt0, tok, dout, N, C), want = run(cpu<T>(), dt0, tok, dout, N, C);
    expect_bitwise("embedding_backward dyadic: CPU reference vs exact sums", want, want_exact);
    expect_bitwise("embedding_backward dyadic, token x2200", got, want);
  }
}

struct NormCase { int N, C; };
// C > block; more rows than a grid; C = 1; C a multiple of 8 (both types' 16-byte packs: 700 is of
// 4 only, so bf16 takes the scalar kernel there), and one of more packs than a block's threads.
const NormCase kNormCases[] = {{64, 700}, {66000, 16}, {5, 1}, {33, 1024}, {9, 4104}};

template <typename T> void check_rmsnorm_forward() {
  using S = st::math::Acc<T>;
  std::mt19937 g(4001);
  for (const NormCase& c : kNormCases) {
    const size_t n = static_cast<size_t>(c.N) * c.C;
    const std::vector<T> x = randn<T>(n, g), w = randn<T>(static_cast<size_t>(c.C), g, 0.2, 1.0);
    auto run = [&](st::Backend<T>& be) {
      st::Buffer<T> dx = upload(be, x), dw = upload(be, w), out(be, n), rstd(be, static_cast<size_t>(c.N));
      be.rmsnorm_forward(out.data(), rstd.data(), dx.data(), dw.data(), c.N, c.C, static_cast<S>(1e-5));
      return std::make_pair(download(be, out.data(), n), download(be, rstd.data(), static_cast<size_t>(c.N)));
    };
    const auto got = run(dev<T>()), want = run(cpu<T>());
    const std::string sz = " N=" + std::to_string(c.N) + " C=" + std::to_string(c.C);
    expect_close("rmsnorm_forward out" + sz, got.first, want.first, {}, static_cast<size_t>(c.C));
    expect_close("rmsnorm_forward rstd" + sz, got.second, want.second, {}, static_cast<size_t>(c.C));
  }
}

template <typename T> void check_rmsnorm_backward() {
  using S = st::math::Acc<T>;
  std::mt19937 g(4002);
  for (const NormCase& c : kNormCases) {
    const int N = c.N, C = c.C;
    const size_t n = static_cast<size_t>(N) * C;
    const std::vector<T> x = randn<T>(n, g), w = randn<T>(static_cast<size_t>(C), g, 0.2, 1.0);
    const std::vector<T> dout = randn<T>(n, g), dx0 = randn<T>(n, g), dw0 = randn<T>(static_cast<size_t>(C), g);
    std::vector<T> rstd;  // the CPU forward's, given to both sides
    {
      st::Backend<T>& be = cpu<T>();
      st::Buffer<T> dx = upload(be, x), dw = upload(be, w), out(be, n), r(be, static_cast<size_t>(N));
      be.rmsnorm_forward(out.data(), r.data(), dx.data(), dw.data(), N, C, static_cast<S>(1e-5));
      rstd = download(be, r.data(), static_cast<size_t>(N));
    }
    auto run = [&](st::Backend<T>& be) {
      st::Buffer<T> ddx = upload(be, dx0), ddw = upload(be, dw0), dd = upload(be, dout), dxx = upload(be, x),
                    dww = upload(be, w), dr = upload(be, rstd);
      be.rmsnorm_backward(ddx.data(), ddw.data(), dd.data(), dxx.data(), dww.data(), dr.data(), N, C);
      return std::make_pair(download(be, ddx.data(), n), download(be, ddw.data(), static_cast<size_t>(C)));
    };
    const auto got = run(dev<T>()), want = run(cpu<T>());
    // dx = dx0 + r w dy - k x, k = r^3/C sum(w dy x); dw = dw0 + sum_i dy x r.
    std::vector<double> mdx(n), mdw(static_cast<size_t>(C));
    for (int c2 = 0; c2 < C; ++c2) mdw[static_cast<size_t>(c2)] = std::fabs(val(dw0[static_cast<size_t>(c2)]));
    for (int i = 0; i < N; ++i) {
      const double r = val(rstd[static_cast<size_t>(i)]);
      double kabs = 0;
      for (int c2 = 0; c2 < C; ++c2) {
        const size_t k = static_cast<size_t>(i) * C + c2;
        kabs += std::fabs(val(w[static_cast<size_t>(c2)]) * val(dout[k]) * val(x[k]));
      }
      kabs *= r * r * r / C;
      for (int c2 = 0; c2 < C; ++c2) {
        const size_t k = static_cast<size_t>(i) * C + c2;
        mdx[k] = std::fabs(val(dx0[k])) + std::fabs(r * val(w[static_cast<size_t>(c2)]) * val(dout[k])) +
                 kabs * std::fabs(val(x[k]));
        mdw[static_cast<size_t>(c2)] += std::fabs(val(dout[k]) * val(x[k]) * r);
      }
    }
    const std::string sz = " N=" + std::to_string(N) + " C=" + std::to_string(C);
    expect_close("rmsnorm_backward dx (+=)" + sz, got.first, want.first, mdx, static_cast<size_t>(C));
    expect_close("rmsnorm_backward dw (+=)" + sz, got.second, want.second, mdw, static_cast<size_t>(N));
  }
}

template <typename T> void check_rope() {
  std::mt19937 g(5001);
  struct Case { int B, T_, H, HD; };
  for (const Case& c : {Case{2, 50, 6, 64}, Case{3, 17, 2, 10}, Case{1, 3, 1, 2}}) {
    std::vector<float> cs, sn;
    st::rope_tables(cs, sn, c.T_, st::rope_inv_freqs(rope_test_config(c.HD, 10000.0)));
    std::vector<T> ct(cs.size()), stt(sn.size());
    for (size_t i = 0; i < cs.size(); ++i) {
      ct[i] = cast<T>(cs[i]);
      stt[i] = cast<T>(sn[i]);
    }
    const size_t n = static_cast<size_t>(c.B) * c.T_ * c.H * c.HD;
    const int half = c.HD / 2;
    for (bool backward : {false, true}) {
      const std::vector<T> x = randn<T>(n, g);
      auto run = [&](st::Backend<T>& be) {
        st::Buffer<T> dx = upload(be, x), dc = upload(be, ct), ds = upload(be, stt);
        if (backward) be.rope_backward(dx.data(), dc.data(), ds.data(), c.B, c.T_, c.H, c.HD);
        else be.rope_forward(dx.data(), dc.data(), ds.data(), c.B, c.T_, c.H, c.HD);
        return download(be, dx.data(), n);
      };
      const std::vector<T> got = run(dev<T>()), want = run(cpu<T>());
      std::vector<double> mag(n);
      for (size_t row = 0; row < n / static_cast<size_t>(c.HD); ++row) {  // row = (b*T + t)*H + h
        const size_t t = (row / static_cast<size_t>(c.H)) % static_cast<size_t>(c.T_);
        for (int j = 0; j < half; ++j) {
          const size_t i1 = row * c.HD + j, i2 = i1 + half, tj = t * half + j;
          const double a = std::fabs(val(x[i1])), b = std::fabs(val(x[i2]));
          const double co = std::fabs(val(ct[tj])), si = std::fabs(val(stt[tj]));
          mag[i1] = a * co + b * si;
          mag[i2] = b * co + a * si;
        }
      }
      expect_close(std::string(backward ? "rope_backward" : "rope_forward") + " B=" + std::to_string(c.B) +
                       " T=" + std::to_string(c.T_) + " H=" + std::to_string(c.H) + " HD=" + std::to_string(c.HD),
                   got, want, mag, 2);
    }
  }
}

// rope_qk (queries and keys in one launch) against the two calls it replaces on the same backend,
// bitwise: without positions (rope_forward / rope_backward) and at positions (rope_*_at, a sequence
// whose positions restart at 7), with 16-byte packs (HD 64, 128) and the scalar kernel (HD 10, and
// q one element past a 16-byte boundary); and against the CPU's rope_qk (the two calls there).
template <typename T> void check_rope_qk() {
  std::mt19937 g(5002);
  struct Case { int B, T_, Hq, Hk, HD, off; };
  for (const Case& c : {Case{2, 50, 8, 2, 64, 0}, Case{1, 33, 4, 4, 128, 0}, Case{3, 17, 3, 1, 10, 0},
                        Case{2, 20, 4, 2, 64, 1}}) {
    std::vector<float> cs, sn;
    st::rope_tables(cs, sn, c.T_, st::rope_inv_freqs(rope_test_config(c.HD, 10000.0)));
    std::vector<T> ct(cs.size()), stt(sn.size());
    for (size_t i = 0; i < cs.size(); ++i) ct[i] = cast<T>(cs[i]), stt[i] = cast<T>(sn[i]);
    const int N = c.B * c.T_;
    const size_t nq = static_cast<size_t>(N) * c.Hq * c.HD, nk = static_cast<size_t>(N) * c.Hk * c.HD;
    std::vector<int32_t> pos(static_cast<size_t>(N));
    for (int i = 0; i < N; ++i) pos[static_cast<size_t>(i)] = i < 7 ? i : (i - 7) % c.T_;
    for (bool at : {false, true})
      for (bool backward : {false, true}) {
        const std::vector<T> q = randn<T>(nq + 1, g), k = randn<T>(nk, g);
        auto run = [&](st::Backend<T>& be, bool fused) {
          st::Buffer<T> bq = upload(be, q), bk = upload(be, k), bc = upload(be, ct), bs = upload(be, stt);
          st::IdBuffer<T> bp(be, pos.size());
          be.ids_from_host(bp.data(), pos.data(), pos.size());
          T* qd = bq.data() + c.off;
          const int32_t* p = at ? bp.data() : nullptr;
          if (fused) be.rope_qk(qd, c.Hq, bk.data(), c.Hk, bc.data(), bs.data(), p, c.B, c.T_, c.HD, backward);
          else
            for (auto [x, H] : {std::pair<T*, int>{qd, c.Hq}, std::pair<T*, int>{bk.data(), c.Hk}}) {
              if (at && backward) be.rope_backward_at(x, bc.data(), bs.data(), p, N, H, c.HD);
              else if (at) be.rope_forward_at(x, bc.data(), bs.data(), p, N, H, c.HD);
              else if (backward) be.rope_backward(x, bc.data(), bs.data(), c.B, c.T_, H, c.HD);
              else be.rope_forward(x, bc.data(), bs.data(), c.B, c.T_, H, c.HD);
            }
          std::vector<T> out = download(be, qd, nq), kk = download(be, bk.data(), nk);
          out.insert(out.end(), kk.begin(), kk.end());
          return out;
        };
        const std::string what = std::string("rope_qk ") + (backward ? "backward" : "forward") +
                                 (at ? " at positions" : "") + " B=" + std::to_string(c.B) + " T=" +
                                 std::to_string(c.T_) + " Hq=" + std::to_string(c.Hq) + " Hk=" + std::to_string(c.Hk) +
                                 " HD=" + std::to_string(c.HD) + " offset " + std::to_string(c.off);
        const std::vector<T> got = run(dev<T>(), true);
        expect_bitwise(what + ": one launch vs the two calls", got, run(dev<T>(), false));
        // Each rotated value is x1 c - x2 s or x2 c + x1 s: |x1| + |x2| of its pair bounds its terms.
        std::vector<T> in(q.begin() + c.off, q.begin() + c.off + static_cast<std::ptrdiff_t>(nq));
        in.insert(in.end(), k.begin(), k.end());
        std::vector<double> mag(in.size());
        const size_t half = static_cast<size_t>(c.HD / 2);
        for (size_t i = 0; i < in.size(); ++i) {
          const size_t j = i % static_cast<size_t>(c.HD), partner = j < half ? i + half : i - half;
          mag[i] = std::fabs(val(in[i])) + std::fabs(val(in[partner]));
        }
        expect_close(what + ": vs the CPU", got, run(cpu<T>(), true), mag, 2);
      }
  }
}

// Elements above the diagonal of every [T, T] matrix that are not exactly zero.
template <typename T> size_t nonzero_above_diagonal(const std::vector<T>& a, int R, int T_) {
  size_t bad = 0;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T_; ++t)
      for (int s = t + 1; s < T_; ++s)
        if (val(a[(static_cast<size_t>(r) * T_ + t) * T_ + s]) != 0.0) ++bad;
  return bad;
}

template <typename T> void check_softmax() {
  using S = st::math::Acc<T>;
  std::mt19937 g(6001);
  struct Case { int R, T_; double scale; };
  // The forward's warp-per-row kernel at every row size class (32*K >= T for K = 1, 2, ..., 64:
  // T = 17, 50, 70, 200, 300, 1024, 2048; T = 1), the block kernel from T = 2049 (the backward's at
  // every T), rows longer than a 256-thread block, and more rows than a grid holds: 70000 rows for
  // the block kernels (65535 blocks), 528000 for the warp kernel (65535 blocks of 8 warps).
  for (const Case& c : {Case{3, 300, 0.125}, Case{5, 17, 1.0}, Case{1, 1, 0.5}, Case{1000, 70, 0.3},
                        Case{3, 50, 0.5}, Case{2, 200, 0.2}, Case{2, 1024, 0.125}, Case{1, 2048, 0.09},
                        Case{1, 2049, 0.09}, Case{33000, 16, 0.7}}) {
    const size_t n = static_cast<size_t>(c.R) * c.T_ * c.T_;
    const std::string sz = " R=" + std::to_string(c.R) + " T=" + std::to_string(c.T_);
    const std::vector<T> z = randn<T>(n, g, 4.0);  // the upper triangle holds junk too
    auto fwd = [&](st::Backend<T>& be) {
      st::Buffer<T> d = upload(be, z);
      be.softmax_causal_forward(d.data(), c.R, c.T_, static_cast<S>(c.scale));
      return download(be, d.data(), n);
    };
    const std::vector<T> p_got = fwd(dev<T>()), p = fwd(cpu<T>());
    expect_close("softmax_causal_forward" + sz, p_got, p, {}, static_cast<size_t>(c.T_));
    EXPECT_EQ(nonzero_above_diagonal(p_got, c.R, c.T_), 0u) << label<T>("softmax_causal_forward" + sz);

    // Backward from the CPU's probabilities (both sides), with junk above the diagonal of datt.
    const std::vector<T> dp = randn<T>(n, g);
    auto bwd = [&](st::Backend<T>& be) {
      st::Buffer<T> dd = upload(be, dp), dpp = upload(be, p);
      be.softmax_causal_backward(dd.data(), dpp.data(), c.R, c.T_, static_cast<S>(c.scale));
      return download(be, dd.data(), n);
    };
    const std::vector<T> got = bwd(dev<T>()), want = bwd(cpu<T>());
    std::vector<double> mag(n, 0.0);  // scale p (|dp| + sum p |dp|)
    for (size_t row = 0; row < n / static_cast<size_t>(c.T_); ++row) {
      const int t = static_cast<int>(row % static_cast<size_t>(c.T_));
      const size_t o = row * c.T_;
      double dot_abs = 0;
      for (int s = 0; s <= t; ++s) dot_abs += val(p[o + s]) * std::fabs(val(dp[o + s]));
      for (int s = 0; s <= t; ++s) mag[o + s] = std::fabs(c.scale) * val(p[o + s]) * (std::fabs(val(dp[o + s])) + dot_abs);
    }
    expect_close("softmax_causal_backward" + sz, got, want, mag, static_cast<size_t>(c.T_));
    EXPECT_EQ(nonzero_above_diagonal(got, c.R, c.T_), 0u) << label<T>("softmax_causal_backward" + sz);
  }
}

// Flash attention (FlashAttention-2 tiles, flash_attention.h): device against the CPU backend on the
// same inputs, forward (y, lse) and backward (dq, dk, dv, each side from its own forward). Shapes:
// T not a multiple of the 64-row tiles, one full tile, T = 1, GQA (2 and 3 heads per group), MQA,
// head dims 24 and 128 (the latter needs more than 48 KiB of shared memory). Criterion
// max |got - ref| / max(1, max |ref|) per output (the inputs are O(1); at T = 1 the true dq, dk are
// 0 and each side returns its own rounding noise of dp - D, ~1e-6): f32 1e-5 (the kernels and the CPU differ in summation
// order and FMA contraction only), bf16 2e-2 (outputs rounded to bf16 on each side, y rounded
// before the backward reads it); lse is fp32 in both (1e-5 of max(1, |lse|)).
template <typename T> std::vector<float> download_acc(st::Backend<T>& be, const st::AccBuffer<T>& b) {
  // The backend copies T elements; an S buffer is moved as the same bytes.
  static_assert(sizeof(st::math::Acc<T>) % sizeof(T) == 0);
  std::vector<float> h(b.size());
  const size_t per = sizeof(float) / sizeof(T);
  if (!h.empty()) be.to_host(reinterpret_cast<T*>(h.data()), reinterpret_cast<const T*>(b.data()), b.size() * per);
  return h;
}

struct FlashCase { int B, T_, NH, NKV, HD; };

// Sets SHARDTRAIN_CUDNN_ATTENTION (src/backend/cuda/cudnn_attention.h) for one scope, restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

// lse_tol: relative to max(1, |lse|).
template <typename T>
void check_flash_attention_cases(const std::vector<FlashCase>& cases, const std::string& what_kernel, double lse_tol) {
  using S = st::math::Acc<T>;
  std::mt19937 g(9101);
  using Case = FlashCase;
  for (const Case& c : cases) {
    const std::string sz = " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T_) + " NH=" + std::to_string(c.NH) +
                           " NKV=" + std::to_string(c.NKV) + " HD=" + std::to_string(c.HD) + " (" + what_kernel + ")";
    const size_t nq = static_cast<size_t>(c.B) * c.T_ * c.NH * c.HD, nk = static_cast<size_t>(c.B) * c.T_ * c.NKV * c.HD;
    const size_t ns = static_cast<size_t>(c.B) * c.NH * c.T_;
    const std::vector<T> q = randn<T>(nq, g, 1.5), k = randn<T>(nk, g, 1.5), v = randn<T>(nk, g), dy = randn<T>(nq, g);
    const S scale = S(1) / std::sqrt(static_cast<S>(c.HD));
    auto run = [&](st::Backend<T>& be) {
      st::Buffer<T> bq = upload(be, q), bk = upload(be, k), bv = upload(be, v), ddy = upload(be, dy), y(be, nq),
                    gq(be, nq), gk(be, nk), gv(be, nk);
      st::AccBuffer<T> lse(be, ns), dsum(be, ns);
      be.flash_attention_forward(y.data(), lse.data(), bq.data(), bk.data(), bv.data(), c.B, c.T_, c.NH, c.NKV, c.HD,
                                 scale);
      be.flash_attention_backward(gq.data(), gk.data(), gv.data(), dsum.data(), ddy.data(), bq.data(), bk.data(),
                                  bv.data(), y.data(), lse.data(), c.B, c.T_, c.NH, c.NKV, c.HD, scale);
      return std::make_tuple(download(be, y.data(), nq), download_acc(be, lse), download(be, gq.data(), nq),
                             download(be, gk.data(), nk), download(be, gv.data(), nk));
    };
    const auto got = run(dev<T>()), want = run(cpu<T>());
    const double tol = std::is_same_v<T, float> ? 1e-5 : 2e-2;
    auto rel = [](const auto& a, const auto& b) {
      double num = 0, den = 0;
      for (size_t i = 0; i < b.size(); ++i) {
        const double x = static_cast<double>(st::math::ld(a[i])), w = static_cast<double>(st::math::ld(b[i]));
        num = std::isfinite(x) ? std::max(num, std::fabs(x - w)) : std::numeric_limits<double>::infinity();
        den = std::max(den, std::fabs(w));
      }
      return num / std::max(den, 1.0);
    };
    auto expect = [&](const char* what, double e, double t) {
      note(label<T>(std::string("flash_attention ") + what + sz) + ": max|diff|/max(1,|ref|) " + fmt(e) + " (allowed " +
           fmt(t) + ")");
      EXPECT_LE(e, t) << label<T>(std::string("flash_attention ") + what + sz);
    };
    expect("y", rel(std::get<0>(got), std::get<0>(want)), tol);
    double le = 0;
    for (size_t i = 0; i < ns; ++i) {
      const double a = std::get<1>(got)[i], b = std::get<1>(want)[i];
      le = std::isfinite(a) ? std::max(le, std::fabs(a - b) / std::max(1.0, std::fabs(b))) : 1e30;
    }
    expect("lse", le, lse_tol);
    expect("dq", rel(std::get<2>(got), std::get<2>(want)), tol);
    expect("dk", rel(std::get<3>(got), std::get<3>(want)), tol);
    expect("dv", rel(std::get<4>(got), std::get<4>(want)), tol);
  }
}

// shardtrain's own tiled kernels (cuDNN switched off for bf16).
template <typename T> void check_flash_attention() {
  ScopedEnv own("SHARDTRAIN_CUDNN_ATTENTION", "off");
  check_flash_attention_cases<T>({FlashCase{2, 300, 4, 2, 64}, FlashCase{1, 64, 4, 4, 64}, FlashCase{1, 17, 4, 1, 64},
                                  FlashCase{1, 1, 2, 2, 64}, FlashCase{1, 130, 6, 2, 24}, FlashCase{1, 200, 2, 1, 128},
                                  FlashCase{1, 1000, 2, 1, 64}},
                                 "tiled kernels", 1e-5);
}

// bf16 attention through cuDNN's fused SDPA (SHARDTRAIN_CUDNN_ATTENTION=require: a missing cuDNN or
// an unsupported shape fails instead of falling back), against the CPU backend's tiled reference
// within the bf16 tolerance above: T = 2, 17, 300, 1024, 2049, 4096 (partial, single and many
// tiles), GQA (4 query heads per key/value head) and MQA, head dims 64 and 128. lse: 5e-5 of
// max(1, |lse|) (cuDNN forms exp as exp2 with log2(e) folded into the scale).
void check_cudnn_attention() {
  ScopedEnv require("SHARDTRAIN_CUDNN_ATTENTION", "require");
  // T = 1 is left out: cuDNN's backward refuses s_q = s_kv = 1 (frontend 1.32, scaled_dot_product_flash_attention.h),
  // so `require` would throw there; under the default `auto` that shape runs the tiled kernels.
  check_flash_attention_cases<bf16>({FlashCase{1, 2, 4, 1, 64}, FlashCase{2, 17, 8, 2, 64}, FlashCase{1, 300, 8, 2, 128},
                                     FlashCase{1, 1024, 4, 1, 64}, FlashCase{1, 2049, 4, 4, 128},
                                     FlashCase{1, 4096, 4, 1, 64}},
                                    "cuDNN", 5e-5);
  ScopedEnv automatic("SHARDTRAIN_CUDNN_ATTENTION", "auto");  // T = 1: cuDNN forward, tiled backward
  check_flash_attention_cases<bf16>({FlashCase{1, 1, 4, 1, 64}}, "auto", 5e-5);
}

template <typename T> void check_swiglu() {
  std::mt19937 g(7001);
  const size_t n = 100003;
  const std::vector<T> gate = randn<T>(n, g, 3.0), up = randn<T>(n, g), dh = randn<T>(n, g);
  // off 0: 16-byte packs and a tail of 3 (float) or 3 (bf16); off 1: every pointer one element
  // past a 16-byte boundary, the scalar kernel (cuda_common.cuh, "16-byte vector access").
  for (size_t off : {size_t{0}, size_t{1}}) {
    const size_t m = n - off;
    auto run = [&](st::Backend<T>& be) {
      st::Buffer<T> dg = upload(be, gate), du = upload(be, up), ddh = upload(be, dh), h(be, n), dgate(be, n),
                    dup(be, n);
      be.swiglu_forward(h.data() + off, dg.data() + off, du.data() + off, m);
      be.swiglu_backward(dgate.data() + off, dup.data() + off, ddh.data() + off, dg.data() + off, du.data() + off, m);
      auto tail = [&](const T* p) { return download(be, p + off, m); };
      return std::make_tuple(tail(h.data()), tail(dgate.data()), tail(dup.data()));
    };
    const auto got = run(dev<T>()), want = run(cpu<T>());
    std::vector<double> mag(m);  // dgate = dh up (s + g s (1 - s)): the sum can cancel
    for (size_t i = 0; i < m; ++i) {
      const double gv = val(gate[i + off]), s = 1.0 / (1.0 + std::exp(-gv));
      mag[i] = std::fabs(val(dh[i + off]) * val(up[i + off])) * (s + std::fabs(gv) * s * (1 - s));
    }
    const std::string at = " (offset " + std::to_string(off) + ")";
    expect_close("swiglu_forward" + at, std::get<0>(got), std::get<0>(want), {}, 1);
    expect_close("swiglu_backward dgate" + at, std::get<1>(got), std::get<1>(want), mag, 2);
    expect_close("swiglu_backward dup" + at, std::get<2>(got), std::get<2>(want), {}, 1);
  }
}

// Mixture-of-experts kernels (moe_math.h): routing (E 16, top 4, with and without
// renormalization) with the router's logsumexp, and its backward with the load-balancing loss's
// per-group gradient and the router z-loss's, the per-group probability and z sums, the dispatch gather (bitwise) and the combine and its backward over
// a slot order sorted by expert, against the CPU backend. The expert choice must be the same (the
// logits are far from ties); the S outputs within the float tolerance, the T outputs within T's.
template <typename T> void check_moe() {
  using S = st::math::Acc<T>;
  std::mt19937 g(7101);
  const int N = 300, E = 16, k = 4, C = 40, grp = 100;
  const std::vector<T> logits = randn<T>(static_cast<size_t>(N) * E, g, 2.0), x = randn<T>(static_cast<size_t>(N) * C, g);
  const std::vector<float> dwf = [&] {
    std::vector<float> v(static_cast<size_t>(N) * k);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& e : v) e = nd(g);
    return v;
  }();
  std::vector<float> aux(static_cast<size_t>(N / grp) * E);
  for (size_t i = 0; i < aux.size(); ++i) aux[i] = 0.01f * static_cast<float>(i % 7);
  const std::vector<float> zd = {0.003f, 0.0f, 0.011f};  // per group (N / grp = 3)
  for (bool renorm : {false, true}) {
    auto run = [&](st::Backend<T>& be) {
      st::Buffer<T> dl = upload(be, logits), dx = upload(be, x), dlog(be, logits.size()), xe(be, static_cast<size_t>(N) * k * C),
          out(be, x.size()), dye(be, xe.size());
      st::AccBuffer<T> probs(be, logits.size()), w(be, static_cast<size_t>(N) * k), dw(be, dwf.size()), daux(be, aux.size()),
          psum(be, aux.size()), dwc(be, static_cast<size_t>(N) * k), lse(be, static_cast<size_t>(N)),
          zdl(be, zd.size()), zsum(be, zd.size());
      st::IdBuffer<T> ex(be, static_cast<size_t>(N) * k);
      be.moe_route(probs.data(), ex.data(), w.data(), dl.data(), N, E, k, renorm, lse.data());
      be.acc_from_host(dw.data(), dwf.data(), dwf.size());
      be.acc_from_host(daux.data(), aux.data(), aux.size());
      be.acc_from_host(zdl.data(), zd.data(), zd.size());
      be.moe_route_backward(dlog.data(), probs.data(), ex.data(), w.data(), dw.data(), daux.data(), grp, N, E, k, renorm,
                            lse.data(), zdl.data());
      be.moe_prob_sums(psum.data(), probs.data(), grp, N, E);
      be.zero_acc(zsum.data(), zsum.size());
      be.moe_z_sums(zsum.data(), lse.data(), grp, N);
      std::vector<int32_t> experts(static_cast<size_t>(N) * k);
      be.ids_to_host(experts.data(), ex.data(), experts.size());
      // The slots sorted by expert (stable), as the model's moe_sort.
      std::vector<int32_t> order(experts.size()), rowtok(experts.size()), pos(experts.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return experts[a] < experts[b]; });
      for (size_t r = 0; r < order.size(); ++r) {
        rowtok[r] = order[r] / k;
        pos[static_cast<size_t>(order[r])] = static_cast<int32_t>(r);
      }
      st::IdBuffer<T> rt = upload_ids(be, rowtok), ps = upload_ids(be, pos);
      be.gather_rows(xe.data(), dx.data(), rt.data(), N * k, C);
      be.moe_combine(out.data(), dx.data(), xe.data(), ps.data(), w.data(), N, k, C);
      be.moe_combine_backward(dye.data(), dwc.data(), dx.data(), xe.data(), ps.data(), w.data(), N, k, C);
      auto acc = [&](const st::AccBuffer<T>& b) {
        std::vector<S> h(b.size());
        be.acc_to_host(h.data(), b.data(), h.size());
        return std::vector<float>(h.begin(), h.end());
      };
      return std::make_tuple(experts, acc(probs), acc(w), download(be, dlog.data(), logits.size()), acc(psum),
                             download(be, xe.data(), xe.size()), download(be, out.data(), out.size()),
                             download(be, dye.data(), dye.size()), acc(dwc), acc(lse), acc(zsum));
    };
    const auto got = run(dev<T>()), want = run(cpu<T>());
    const std::string r = renorm ? " (renormalized)" : "";
    EXPECT_EQ(std::get<0>(got), std::get<0>(want)) << label<T>("moe_route experts" + r);
    expect_close("moe_route probs" + r, std::get<1>(got), std::get<1>(want), {}, E);
    expect_close("moe_route weights" + r, std::get<2>(got), std::get<2>(want), {}, E);
    expect_close("moe_route_backward dlogits" + r, std::get<3>(got), std::get<3>(want), {}, 2 * E);
    expect_close("moe_prob_sums" + r, std::get<4>(got), std::get<4>(want), {}, grp);
    expect_bitwise("gather_rows" + r, std::get<5>(got), std::get<5>(want));
    expect_close("moe_combine" + r, std::get<6>(got), std::get<6>(want), {}, k + 1);
    expect_close("moe_combine_backward dye" + r, std::get<7>(got), std::get<7>(want), {}, 1);
    expect_close("moe_combine_backward dw" + r, std::get<8>(got), std::get<8>(want), {}, C);
    expect_close("moe_route lse" + r, std::get<9>(got), std::get<9>(want), {}, E);
    expect_close("moe_z_sums" + r, std::get<10>(got), std::get<10>(want), {}, grp);
  }
}

template <typename T> void check_cross_entropy() {
  using S = st::math::Acc<T>;
  std::mt19937 g(8001);
  struct Case { int N, V; };
  for (const Case& c : {Case{32, 50257}, Case{64, 260}, Case{66000, 7}}) {
    const int N = c.N, V = c.V;
    const size_t n = static_cast<size_t>(N) * V;
    const std::string sz = " N=" + std::to_string(N) + " V=" + std::to_string(V);
    std::vector<T> logits = randn<T>(n, g, 2.0);
    std::vector<int32_t> tgt = rand_ids(static_cast<size_t>(N), V, g);
    for (int i = 0; i < N; ++i) {  // confident rows: right (p_target ~ 1, p - 1 cancels) and wrong
      const size_t t = static_cast<size_t>(tgt[static_cast<size_t>(i)]);
      const size_t o = static_cast<size_t>(i) * V;
      if (i % 8 == 0) logits[o + t] = cast<T>(val(logits[o + t]) + 12.0);
      if (i % 8 == 1) logits[o + (t + 1) % static_cast<size_t>(V)] = cast<T>(val(logits[o + (t + 1) % V]) + 12.0);
    }
    for (int i = 3; i < N; i += 5) tgt[static_cast<size_t>(i)] = st::kNoTarget;  // rows without a target: 0, zero rows
    const double gsc = 0.37;
    // Host double: probabilities for the gradient magnitudes, term sizes of the loss.
    std::vector<double> mag(n);
    double loss_mag = 0;
    for (int i = 0; i < N; ++i) {
      const size_t o = static_cast<size_t>(i) * V, t = static_cast<size_t>(tgt[static_cast<size_t>(i)]);
      if (tgt[static_cast<size_t>(i)] < 0) {  // a zero row: any error is an absolute one
        for (int v = 0; v < V; ++v) mag[o + v] = gsc;
        continue;
      }
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      for (int v = 0; v < V; ++v) mx = std::max(mx, val(logits[o + v]));
      for (int v = 0; v < V; ++v) sum += std::exp(val(logits[o + v]) - mx);
      for (int v = 0; v < V; ++v)
        mag[o + v] = gsc * (std::exp(val(logits[o + v]) - mx) / sum + (static_cast<size_t>(v) == t ? 1.0 : 0.0));
      loss_mag += std::fabs(mx) + std::fabs(val(logits[o + t])) + std::log(sum);
    }
    // Reference: CPU, separate dlogits buffer.
    double want_loss;
    std::vector<T> want_dl;
    {
      st::Backend<T>& be = cpu<T>();
      st::Buffer<T> dl = upload(be, logits), dd(be, n);
      st::IdBuffer<T> ids = upload_ids(be, tgt);
      want_loss = be.cross_entropy(dd.data(), dl.data(), ids.data(), N, V, static_cast<S>(gsc));
      want_dl = download(be, dd.data(), n);
    }
    st::Backend<T>& be = dev<T>();
    st::IdBuffer<T> ids = upload_ids(be, tgt);
    auto expect_loss = [&](const char* mode, double got) {
      EXPECT_LE(std::fabs(got - want_loss), r32(static_cast<size_t>(V)) * loss_mag)
          << label<T>(std::string("cross_entropy loss, ") + mode + sz) << ": got " << fmt(got) << ", want "
          << fmt(want_loss);
    };
    {  // dlogits == nullptr: loss only, logits untouched
      st::Buffer<T> dl = upload(be, logits);
      expect_loss("dlogits nullptr", be.cross_entropy(nullptr, dl.data(), ids.data(), N, V, static_cast<S>(gsc)));
      expect_bitwise("cross_entropy dlogits nullptr: logits untouched" + sz, download(be, dl.data(), n), logits);
    }
    {  // cross_entropy_sum: the rows in two calls, summed on the backend, read once; bitwise the sum of
       // cross_entropy's two returns (same per-row values and order); the sum is then 0 again.
      st::Buffer<T> dl = upload(be, logits);
      const int h = N / 2;
      const size_t off = static_cast<size_t>(h) * V;
      be.cross_entropy_sum(nullptr, dl.data(), ids.data(), h, V, S(0));
      be.cross_entropy_sum(nullptr, dl.data() + off, ids.data() + h, N - h, V, S(0));
      const double a = be.cross_entropy(nullptr, dl.data(), ids.data(), h, V, S(0));
      const double b = be.cross_entropy(nullptr, dl.data() + off, ids.data() + h, N - h, V, S(0));
      const double sum = be.take_loss_sum();
      EXPECT_EQ(sum, a + b) << label<T>("cross_entropy_sum of two calls" + sz);
      EXPECT_EQ(be.take_loss_sum(), 0.0) << label<T>("take_loss_sum after take_loss_sum" + sz);
      expect_loss("cross_entropy_sum", sum);
    }
    {  // separate buffer (holding junk before)
      st::Buffer<T> dl = upload(be, logits), dd = upload(be, randn<T>(n, g));
      expect_loss("separate dlogits", be.cross_entropy(dd.data(), dl.data(), ids.data(), N, V, static_cast<S>(gsc)));
      expect_close("cross_entropy separate dlogits" + sz, download(be, dd.data(), n), want_dl, mag,
                   static_cast<size_t>(V));
      expect_bitwise("cross_entropy separate dlogits: logits untouched" + sz, download(be, dl.data(), n), logits);
    }
    {  // dlogits aliasing logits
      st::Buffer<T> dl = upload(be, logits);
      expect_loss("dlogits == logits", be.cross_entropy(dl.data(), dl.data(), ids.data(), N, V, static_cast<S>(gsc)));
      expect_close("cross_entropy dlogits aliasing logits" + sz, download(be, dl.data(), n), want_dl, mag,
                   static_cast<size_t>(V));
    }
  }
}

template <typename T> void check_adamw() {
  using S = st::math::Acc<T>;
  std::mt19937 g(9001);
  const size_t n = 100003;
  const std::vector<T> p0 = randn<T>(n, g), m0 = randn<T>(n, g, 0.1), gr = randn<T>(n, g);
  std::vector<T> v0 = randn<T>(n, g, 0.01);
  for (auto& x : v0) x = cast<T>(std::fabs(val(x)));
  const double lr = 1e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wdc = 0.1, gsc = 0.5;
  for (int64_t step : {int64_t{1}, int64_t{1000}}) {
    auto run = [&](st::Backend<T>& be) {
      st::Buffer<T> dp = upload(be, p0), dm = upload(be, m0), dv = upload(be, v0), dg = upload(be, gr);
      be.adamw(dp.data(), dm.data(), dv.data(), dg.data(), n, static_cast<S>(lr), static_cast<S>(b1),
               static_cast<S>(b2), static_cast<S>(eps), static_cast<S>(wdc), static_cast<S>(gsc), step);
      return std::make_tuple(download(be, dp.data(), n), download(be, dm.data(), n), download(be, dv.data(), n));
    };
    const auto got = run(dev<T>()), want = run(cpu<T>());
    const double bc1 = 1 - std::pow(b1, static_cast<double>(step)), bc2 = 1 - std::pow(b2, static_cast<double>(step));
    std::vector<double> mp(n), mm(n);
    for (size_t i = 0; i < n; ++i) {
      const double gg = val(gr[i]) * gsc;
      mm[i] = b1 * std::fabs(val(m0[i])) + (1 - b1) * std::fabs(gg);
      const double v1 = b2 * val(v0[i]) + (1 - b2) * gg * gg;
      mp[i] = std::fabs(val(p0[i]) * (1 - lr * wdc)) + lr * (mm[i] / bc1) / (std::sqrt(v1 / bc2) + eps);
    }
    const std::string st_ = " step " + std::to_string(step);
    expect_close("adamw p" + st_, std::get<0>(got), std::get<0>(want), mp, 1);
    expect_close("adamw m" + st_, std::get<1>(got), std::get<1>(want), mm, 1);
    expect_close("adamw v" + st_, std::get<2>(got), std::get<2>(want), {}, 1);
  }
}

template <typename T> void check_from_f32() {
  std::mt19937 g(10001);
  std::vector<float> src;
  // Ties (round to even either way), just off ties, max float and the bf16 overflow tie (-> Inf),
  // subnormals, signed zeros, NaNs (quiet, signalling), infinities.
  for (uint32_t b : {0x3F808000u, 0x3F818000u, 0xBF808000u, 0xBF818000u, 0x3F808001u, 0x3F807FFFu, 0x7F7FFFFFu,
                     0x7F7F8000u, 0x7F7F7FFFu, 0x00000001u, 0x00008000u, 0x00018000u, 0x807FFFFFu, 0x00000000u,
                     0x80000000u, 0x7FC00000u, 0x7FA00001u, 0xFFC12345u, 0x7F800000u, 0xFF800000u, 0x3F800000u,
                     0x40490FDBu, 0x477FE000u})
    src.push_back(std::bit_cast<float>(b));
  std::normal_distribution<float> nd(0.0f, 100.0f);
  for (int i = 0; i < 20000; ++i) src.push_back(nd(g));
  for (int i = 0; i < 20000; ++i) src.push_back(std::bit_cast<float>(static_cast<uint32_t>(g())));  // any bits
  const size_t n = src.size();
  auto run = [&](st::Backend<float>& b32, st::Backend<T>& be) {
    st::Buffer<float> ds = upload(b32, src);
    st::Buffer<T> dd(be, n);
    be.from_f32(dd.data(), ds.data(), n);
    return download(be, dd.data(), n);
  };
  const std::vector<T> got = run(dev<float>(), dev<T>()), want = run(cpu<float>(), cpu<T>());
  std::vector<T> host_ref(n);
  for (size_t i = 0; i < n; ++i) host_ref[i] = st::math::st<T>(src[i]);
  expect_bitwise("from_f32: CPU reference vs math::st", want, host_ref, true);
  expect_bitwise("from_f32", got, want, true);  // NaN payloads may differ; anything else is bitwise
}

template <typename T> void check_add_to_f32() {
  std::mt19937 g(10002);
  const size_t n = 100003;
  const std::vector<float> dst0 = randn<float>(n, g);
  const std::vector<T> src = randn<T>(n, g);
  const float alpha = -0.6f;
  auto run = [&](st::Backend<float>& b32, st::Backend<T>& be) {
    st::Buffer<float> dd = upload(b32, dst0);
    st::Buffer<T> ds = upload(be, src);
    be.add_to_f32(dd.data(), alpha, ds.data(), n);
    return download(b32, dd.data(), n);
  };
  const std::vector<float> got = run(dev<float>(), dev<T>()), want = run(cpu<float>(), cpu<T>());
  std::vector<double> mag(n);
  for (size_t i = 0; i < n; ++i) mag[i] = std::fabs(dst0[i]) + std::fabs(alpha * val(src[i]));
  expect_close(label<T>("add_to_f32 from"), got, want, mag, 2);
}

// =============================================================================================
// Collectives on device buffers

// Small dyadic numbers: every sum over up to 32 ranks is exact in T, in any order.
template <typename T> std::vector<T> dyadic(size_t n, std::mt19937& g) {
  std::uniform_int_distribution<int> d(std::is_same_v<T, float> ? -64 : -8, std::is_same_v<T, float> ? 64 : 8);
  std::vector<T> v(n);
  for (auto& x : v) x = cast<T>(std::is_same_v<T, float> ? d(g) * 0.25 : d(g));
  return v;
}

template <typename T> void check_comm_type(st::Comm& dc, const std::string& name) {
  st::Comm& hc = host();
  st::Backend<T>& be = dev<T>();
  const int W = hc.world_size(), r = hc.rank();
  ASSERT_EQ(dc.world_size(), W);
  ASSERT_EQ(dc.rank(), r);
  const T sentinel = cast<T>(-3.0);
  for (size_t n : {size_t{1}, size_t{1000}, size_t{300001}}) {
    const std::string sz = " n=" + std::to_string(n);
    const size_t Wn = static_cast<size_t>(W) * n, off = static_cast<size_t>(r) * n;
    std::mt19937 g(static_cast<uint32_t>(5000 + 7919 * r + n));
    {  // all_gather, out of place and in place
      const std::vector<T> send = dyadic<T>(n, g);
      std::vector<T> want(Wn);
      hc.all_gather(send.data(), want.data(), n);
      st::Buffer<T> ds = upload(be, send), dr = upload(be, std::vector<T>(Wn, sentinel));
      dc.all_gather(ds.data(), dr.data(), n);
      expect_bitwise(name + " all_gather" + sz, download(be, dr.data(), Wn), want);
      std::vector<T> init(Wn, sentinel);
      std::copy(send.begin(), send.end(), init.begin() + static_cast<std::ptrdiff_t>(off));
      st::Buffer<T> db = upload(be, init);
      dc.all_gather(db.data() + off, db.data(), n);
      expect_bitwise(name + " all_gather in place" + sz, download(be, db.data(), Wn), want);
    }
    {  // reduce_scatter_sum
      const std::vector<T> send = dyadic<T>(Wn, g);
      std::vector<T> want(n);
      hc.reduce_scatter_sum(send.data(), want.data(), n);
      st::Buffer<T> ds = upload(be, send), dr = upload(be, std::vector<T>(n, sentinel));
      dc.reduce_scatter_sum(ds.data(), dr.data(), n);
      expect_bitwise(name + " reduce_scatter_sum" + sz, download(be, dr.data(), n), want);
    }
    if constexpr (std::is_same_v<T, float>) {
      for (st::ReduceOp op : {st::ReduceOp::Sum, st::ReduceOp::Max, st::ReduceOp::Min}) {
        std::vector<T> want = dyadic<T>(n, g);
        st::Buffer<T> db = upload(be, want);
        hc.all_reduce(want.data(), n, op);
        dc.all_reduce(db.data(), n, op);
        expect_bitwise(name + " all_reduce op " + std::to_string(static_cast<int>(op)) + sz, download(be, db.data(), n),
                       want);
      }
    } else if (n == 1) {
      // The Comm contract has no bf16 all_reduce: refused on every rank before anything moves.
      st::Buffer<T> db = upload(be, dyadic<T>(n, g));
      EXPECT_THROW(dc.all_reduce(db.data(), n, st::ReduceOp::Sum), std::exception) << name << " bf16 all_reduce";
    }
    for (int root = 0; root < W; ++root) {  // broadcast
      std::vector<T> want = dyadic<T>(n, g);
      st::Buffer<T> db = upload(be, want);
      hc.broadcast(want.data(), n, root);
      dc.broadcast(db.data(), n, root);
      expect_bitwise(name + " broadcast root " + std::to_string(root) + sz, download(be, db.data(), n), want);
    }    {  // point-to-point: ring shift (blocking, and started), a pairwise exchange (r, r^1)
      const std::vector<T> send = dyadic<T>(n, g);
      std::vector<T> want(n);
      hc.ring_shift(send.data(), want.data(), n);
      st::Buffer<T> ds = upload(be, send), dr = upload(be, std::vector<T>(n, sentinel)),
                    dr2 = upload(be, std::vector<T>(n, sentinel));
      dc.ring_shift(ds.data(), dr.data(), n);
      expect_bitwise(name + " ring_shift" + sz, download(be, dr.data(), n), want);
      auto q = dc.start_ring_shift(ds.data(), dr2.data(), n);
      q->wait();
      dc.synchronize();
      expect_bitwise(name + " start_ring_shift" + sz, download(be, dr2.data(), n), want);
      const int peer = r ^ 1;
      if (peer < W) {  // the lower rank sends first, the higher receives first (NCCL: one stream)
        std::vector<T> hwant(n);
        auto hr = hc.start_recv(hwant.data(), n, peer, 3);
        auto hs = hc.start_send(send.data(), n, peer, 3);
        hr->wait();
        hs->wait();
        st::Buffer<T> dx = upload(be, std::vector<T>(n, sentinel));
        std::unique_ptr<st::Comm::Request> a, b;
        if (r < peer) {
          a = dc.start_send(ds.data(), n, peer, 3);
          b = dc.start_recv(dx.data(), n, peer, 3);
        } else {
          b = dc.start_recv(dx.data(), n, peer, 3);
          a = dc.start_send(ds.data(), n, peer, 3);
        }
        a->wait();
        b->wait();
        dc.synchronize();
        expect_bitwise(name + " send/recv with rank " + std::to_string(peer) + sz, download(be, dx.data(), n), hwant);
      }
      {  // start_group (pipeline stages): sends listed before receives, to and from both neighbours
        const int up = (r + 1) % W, down = (r + W - 1) % W;
        std::vector<T> from_down(n), from_up(n);
        hc.start_group<T>({{true, from_down.data(), n, down, 4},
                           {true, from_up.data(), n, up, 4},
                           {false, const_cast<T*>(send.data()), n, up, 4},
                           {false, const_cast<T*>(send.data()), n, down, 4}})
            ->wait();
        st::Buffer<T> gd = upload(be, std::vector<T>(n, sentinel)), gu = upload(be, std::vector<T>(n, sentinel));
        auto gq = dc.start_group<T>({{false, ds.data(), n, up, 4},
                                     {false, ds.data(), n, down, 4},
                                     {true, gd.data(), n, down, 4},
                                     {true, gu.data(), n, up, 4}});
        gq->wait();
        dc.synchronize();
        expect_bitwise(name + " start_group from rank " + std::to_string(down) + sz, download(be, gd.data(), n), from_down);
        expect_bitwise(name + " start_group from rank " + std::to_string(up) + sz, download(be, gu.data(), n), from_up);
      }
    }
  }
  {  // count 0: allowed, collective, writes nothing
    const std::vector<T> one(1, cast<T>(2.0)), many(static_cast<size_t>(W), sentinel);
    st::Buffer<T> d1 = upload(be, one), dm = upload(be, many);
    dc.all_gather(d1.data(), dm.data(), 0);
    dc.reduce_scatter_sum(dm.data(), d1.data(), 0);
    dc.broadcast(d1.data(), 0, 0);
    expect_bitwise(name + " count 0 (send)", download(be, d1.data(), 1), one);
    expect_bitwise(name + " count 0 (recv)", download(be, dm.data(), many.size()), many);
  }
}

void check_comm(st::Comm& dc, const std::string& name) {
  check_comm_type<float>(dc, name);
  check_comm_type<bf16>(dc, name);
}

// =============================================================================================
// Mixed precision and the model

st::ParamSpec pspec(std::string name, std::vector<int64_t> shape, st::Init init, double stdev = 0.02) {
  st::ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.init = init;
  p.init_std = stdev;
  p.weight_decay = init == st::Init::Normal;
  return p;
}

std::vector<st::UnitSpec> mp_units() {
  using st::Init;
  return {
      {"mp.embed", {pspec("mp.embed.weight", {37, 29}, Init::Normal, 0.02)}},
      {"mp.layer",
       {pspec("mp.layer.norm", {13}, Init::Ones), pspec("mp.layer.w", {61, 47}, Init::Normal, 0.5),
        pspec("mp.layer.ties", {23}, Init::Zeros)}},
      {"mp.scalar", {pspec("mp.scalar.x", {1}, Init::Normal, 0.7)}},
      {"mp.big", {pspec("mp.big.w", {300, 1001}, Init::Normal, 1.0)}},
  };
}

void check_mixed_precision(st::Comm& dcomm, const std::string& name) {
  st::Comm& hc = host();
  const int W = hc.world_size(), r = hc.rank();
  const st::ShardPlan plan = st::ShardPlan::build(mp_units(), W);
  st::Fsdp<float> fd(dev<float>(), hc, plan, &dcomm), fh(cpu<float>(), hc, plan);
  fd.init_params(4242);
  fh.init_params(4242);
  // Rounding ties and edge values (as in check_from_f32) in one parameter.
  std::vector<float> ties;
  for (uint32_t b : {0x3F808000u, 0x3F818000u, 0xBF808000u, 0xBF818000u, 0x3F808001u, 0x3F807FFFu, 0x7F7FFFFFu,
                     0x7F7F8000u, 0x00000001u, 0x00018000u, 0x80000000u, 0x40490FDBu, 0x477FE000u, 0x3DCCCCCDu,
                     0x42F6E979u, 0xC2F6E979u, 0x3F7FFFFFu, 0x3F7F8000u, 0x3F7E8000u, 0x00800000u, 0x00808000u,
                     0x33800000u, 0x3F000000u})
    ties.push_back(std::bit_cast<float>(b));
  fd.set_param("mp.layer.ties", ties);
  fh.set_param("mp.layer.ties", ties);
  const int U = fd.num_units();
  for (bool reduce_bf16 : {false, true}) {
    const std::string what = name + (reduce_bf16 ? " reduce_bf16" : " reduce fp32");
    st::MixedPrecisionUnits md(fd, dev<bf16>(), reduce_bf16), mh(fh, cpu<bf16>(), reduce_bf16);
    for (int u = 0; u < U; ++u) {
      const st::UnitPlan& up = plan.units[static_cast<size_t>(u)];
      const size_t P = static_cast<size_t>(up.padded_numel);
      const std::vector<bf16> got = download(dev<bf16>(), md.gather(u), P);
      const std::vector<bf16> want = download(cpu<bf16>(), mh.gather(u), P);
      // Independent reference: the fp32 unit, gathered on the CPU, rounded here.
      const std::vector<float> full = download(cpu<float>(), fh.gather(u), P);
      std::vector<bf16> rounded(P);
      for (size_t i = 0; i < P; ++i) rounded[i] = st::math::f32_to_bf16(full[i]);
      expect_bitwise(what + " gather " + up.name + ": CPU vs rounding on the host", want, rounded);
      expect_bitwise(what + " gather " + up.name, got, want);
    }
    fd.zero_grads();
    fh.zero_grads();
    std::vector<std::vector<double>> mag(static_cast<size_t>(U));  // sum over rounds of sum_q |g_q| / W
    for (int round = 0; round < 2; ++round)
      for (int u = 0; u < U; ++u) {
        const st::UnitPlan& up = plan.units[static_cast<size_t>(u)];
        const st::RankShard& rs = up.ranks[static_cast<size_t>(r)];
        const size_t P = static_cast<size_t>(up.padded_numel), numel = static_cast<size_t>(up.numel);
        mag[static_cast<size_t>(u)].resize(static_cast<size_t>(up.shard_size), 0.0);
        std::vector<bf16> mine;
        for (int q = 0; q < W; ++q) {  // every rank's gradient, for the magnitudes
          std::mt19937 g(static_cast<uint32_t>(100000 * round + 1000 * u + q));
          std::vector<bf16> gq = randn<bf16>(numel, g);
          for (int64_t k = 0; k < rs.valid; ++k)
            mag[static_cast<size_t>(u)][static_cast<size_t>(k)] += std::fabs(val(gq[static_cast<size_t>(rs.start + k)])) / W;
          if (q == r) mine = std::move(gq);
        }
        bf16* gd = md.full_grad(u);
        bf16* gh = mh.full_grad(u);
        expect_bitwise(what + " full_grad zeroed", download(dev<bf16>(), static_cast<const bf16*>(gd), P),
                       std::vector<bf16>(P, bf16{}));
        dev<bf16>().from_host(gd, mine.data(), numel);
        cpu<bf16>().from_host(gh, mine.data(), numel);
        md.reduce_scatter_grad(u);
        mh.reduce_scatter_grad(u);
      }
    for (int u = 0; u < U; ++u) {
      const st::UnitPlan& up = plan.units[static_cast<size_t>(u)];
      const size_t S = static_cast<size_t>(up.shard_size);
      const std::vector<float> got = download(dev<float>(), static_cast<const float*>(fd.grad_shard(u)), S);
      const std::vector<float> want = download(cpu<float>(), static_cast<const float*>(fh.grad_shard(u)), S);
      // fp32: reduction over W ranks in fp32; bf16: W - 1 roundings to bf16 on either side.
      const double s = rms(want);
      std::vector<double> allowed(S);
      for (size_t k = 0; k < S; ++k) {
        const double m = mag[static_cast<size_t>(u)][k];
        allowed[k] = 1e-5 * std::fabs(want[k]) + r32(static_cast<size_t>(W)) * m +
                     (reduce_bf16 ? 2.0 * (W - 1) * 0x1p-8 * m : 0.0) + 1e-6 * s;
      }
      expect_within(what + " reduce_scatter_grad " + up.name, got, want, allowed);
    }
  }
}

struct Batch {
  int B = 2, T = 64;
  std::vector<int32_t> tokens, targets;
};

Batch make_batch(const st::ModelConfig& cfg, int rank) {
  Batch b;
  b.T = std::min(b.T, cfg.max_position_embeddings);
  std::mt19937 g(static_cast<uint32_t>(777 + rank));
  b.tokens = rand_ids(static_cast<size_t>(b.B * b.T), cfg.vocab_size, g);
  b.targets = rand_ids(static_cast<size_t>(b.B * b.T), cfg.vocab_size, g);
  return b;
}

// Same parameters on both engines: init_params, then matrices x10 (std 0.2, so that attention is
// far from uniform) and norm weights 1 + N(0, 0.2^2), identical on every rank.
void spread_params(st::Fsdp<float>& a, st::Fsdp<float>& b) {
  int k = 0;
  for (const st::UnitPlan& up : b.plan().units)
    for (const st::ParamSlot& slot : up.params) {
      std::vector<float> v = b.gather_param(slot.spec.name);  // collective
      std::mt19937 g(static_cast<uint32_t>(31 * k++ + 5));
      std::normal_distribution<float> nd(0.0f, 0.2f);
      for (float& x : v) x = slot.spec.init == st::Init::Ones ? 1.0f + nd(g) : 10.0f * x;
      a.set_param(slot.spec.name, v);
      b.set_param(slot.spec.name, v);
    }
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

// document: --attention-mask document, EOS tokens put into the batch (documents of 1 to 30 tokens):
// RoPE at per-document positions and the block attention kernels (cuDNN is never used for it).
void check_llama_f32(bool document = false) {
  st::Comm& hc = host();
  const st::ModelConfig cfg = st::preset("tiny");
  const st::ShardPlan plan = st::ShardPlan::build(st::llama_units(cfg), hc.world_size());
  st::Fsdp<float> fd(dev<float>(), hc, plan, &data_comm()), fh(cpu<float>(), hc, plan);
  fd.init_params(2024);
  fh.init_params(2024);
  spread_params(fd, fh);
  Batch bt = make_batch(cfg, hc.rank());
  const float gscale = 1.0f / static_cast<float>(bt.B * bt.T);
  st::ModelOptions mo;
  std::vector<int32_t> doc(bt.tokens.size()), pos(bt.tokens.size());
  st::TokenLayout lay;
  if (document) {
    mo.mask = st::AttentionMask::Document;
    for (int t : {9, 10, 30, bt.T + 20, bt.T + 50}) bt.tokens[static_cast<size_t>(t % (bt.B * bt.T))] = cfg.eos_token_ids.front();
    st::document_layout(bt.tokens.data(), bt.B, bt.T, bt.T, cfg.eos_token_ids.front(), doc.data(), pos.data());
    lay = {pos.data(), doc.data()};
  }
  st::LlamaModel<float> md(cfg, dev<float>(), mo), mh(cfg, cpu<float>(), mo);
  fd.zero_grads();
  fh.zero_grads();
  md.forward(fd, bt.tokens.data(), bt.B, bt.T, lay);
  const double ld = md.head_backward(fd, bt.targets.data(), gscale);
  md.backward(fd);
  mh.forward(fh, bt.tokens.data(), bt.B, bt.T, lay);
  const double lh = mh.head_backward(fh, bt.targets.data(), gscale);
  mh.backward(fh);
  note(std::string(document ? "llama f32 (document mask)" : "llama f32") + " loss: cuda " + fmt(ld) + ", cpu " + fmt(lh));
  EXPECT_LE(std::fabs(ld - lh), 1e-5 * std::fabs(lh)) << "llama f32 loss: cuda " << fmt(ld) << ", cpu " << fmt(lh);
  for (int u = 0; u < fd.num_units(); ++u) {
    const st::UnitPlan& up = plan.units[static_cast<size_t>(u)];
    const size_t valid = static_cast<size_t>(up.ranks[static_cast<size_t>(hc.rank())].valid);
    const std::vector<float> got = download(dev<float>(), static_cast<const float*>(fd.grad_shard(u)), valid);
    const std::vector<float> want = download(cpu<float>(), static_cast<const float*>(fh.grad_shard(u)), valid);
    const double scale = max_abs(want);
    expect_within("llama f32 gradient shard " + up.name + " (1e-4 of max-abs " + fmt(scale) + ")", got, want,
                  std::vector<double>(valid, 1e-4 * scale));
    if (valid) {
      EXPECT_GT(scale, 0.0) << up.name << ": gradient is zero";
    }
  }
  // Eval forward: logits.
  md.forward(fd, bt.tokens.data(), bt.B, bt.T, lay);
  md.head_logits(fd);
  mh.forward(fh, bt.tokens.data(), bt.B, bt.T, lay);
  mh.head_logits(fh);
  const std::vector<float> lg = md.logits(), lw = mh.logits();
  expect_within("llama f32 eval logits (1e-4 of max-abs)", lg, lw, std::vector<double>(lw.size(), 1e-4 * max_abs(lw)));
}

void check_llama_bf16() {
  st::Comm& hc = host();
  const st::ModelConfig cfg = st::preset("tiny");
  const st::ShardPlan plan = st::ShardPlan::build(st::llama_units(cfg), hc.world_size());
  st::Fsdp<float> fd(dev<float>(), hc, plan, &data_comm()), fh(cpu<float>(), hc, plan);
  fd.init_params(2024);
  fh.init_params(2024);
  spread_params(fd, fh);
  const Batch bt = make_batch(cfg, hc.rank());
  const float gscale = 1.0f / static_cast<float>(bt.B * bt.T);
  st::MixedPrecisionUnits ud(fd, dev<bf16>(), false), uh(fh, cpu<bf16>(), false);
  st::LlamaModel<bf16> md(cfg, dev<bf16>()), mh(cfg, cpu<bf16>());
  fd.zero_grads();
  fh.zero_grads();
  md.forward(ud, bt.tokens.data(), bt.B, bt.T);
  const double ld = md.head_backward(ud, bt.targets.data(), gscale);
  md.backward(ud);
  mh.forward(uh, bt.tokens.data(), bt.B, bt.T);
  const double lh = mh.head_backward(uh, bt.targets.data(), gscale);
  mh.backward(uh);
  note("llama bf16 loss: cuda " + fmt(ld) + ", cpu " + fmt(lh));
  EXPECT_LE(std::fabs(ld - lh), 1e-2 * std::fabs(lh)) << "llama bf16 loss: cuda " << fmt(ld) << ", cpu " << fmt(lh);
  for (int u = 0; u < fd.num_units(); ++u) {
    const st::UnitPlan& up = plan.units[static_cast<size_t>(u)];
    const size_t valid = static_cast<size_t>(up.ranks[static_cast<size_t>(hc.rank())].valid);
    const std::vector<float> a = download(dev<float>(), static_cast<const float*>(fd.grad_shard(u)), valid);
    const std::vector<float> b = download(cpu<float>(), static_cast<const float*>(fh.grad_shard(u)), valid);
    double ab = 0, aa = 0, bb = 0;
    for (size_t i = 0; i < valid; ++i) {
      ab += static_cast<double>(a[i]) * b[i];
      aa += static_cast<double>(a[i]) * a[i];
      bb += static_cast<double>(b[i]) * b[i];
    }
    if (valid == 0) continue;
    const double cosine = aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : (aa == bb ? 1.0 : 0.0);
    note("llama bf16 gradient shard " + up.name + ": cosine similarity " + fmt(cosine));
    EXPECT_GE(cosine, 0.99) << "llama bf16 gradient shard " << up.name;
    EXPECT_GT(bb, 0.0) << up.name << ": gradient is zero";
  }
}

// Overlap on NCCL (issue 15): the stream-ordered pipeline (prefetch on the communication stream,
// waits that order the compute stream) against --overlap off on the same device and comm, two
// training passes of llama tiny (the second prefetches along the first's order): losses and
// gradient shards bitwise equal, in fp32 and in mixed precision; the device's own times recorded;
// and sum_squares_many equal to the loop of sum_squares, bitwise.
void check_overlap_nccl(st::Comm& nc) {
  st::Comm& hc = host();
  const st::ModelConfig cfg = st::preset("tiny");
  const st::ShardPlan plan = st::ShardPlan::build(st::llama_units(cfg), hc.world_size());
  const Batch bt = make_batch(cfg, hc.rank());
  const float gscale = 1.0f / static_cast<float>(bt.B * bt.T);
  for (bool mixed : {false, true}) {
    std::vector<double> loss[2];
    std::vector<std::vector<float>> grads[2];
    double sumsq[2] = {0, 0};
    double issued = 0;
    for (int k = 0; k < 2; ++k) {
      const st::OverlapConfig ov = k == 0 ? st::OverlapConfig{false, 0, st::CommProgress::Wait}
                                          : st::OverlapConfig{true, 1, st::CommProgress::Poll};
      st::ShardedState<float> f(dev<float>(), hc, plan, &nc);
      f.init_params(2025);
      std::unique_ptr<st::MixedPrecisionUnits> mp;
      std::unique_ptr<st::UnitPipeline<float>> p32;
      if (mixed) mp = std::make_unique<st::MixedPrecisionUnits>(f, dev<bf16>(), false, st::MixedPrecisionUnits::kWidenSlab, ov);
      else p32 = std::make_unique<st::UnitPipeline<float>>(dev<float>(), std::make_unique<st::IdentityCodec<float>>(f), ov);
      st::LlamaModel<float> m32(cfg, dev<float>());
      st::LlamaModel<bf16> m16(cfg, dev<bf16>());
      for (int pass = 0; pass < 2; ++pass) {
        f.zero_grads();
        if (mixed) {
          mp->begin_pass("train");
          m16.forward(*mp, bt.tokens.data(), bt.B, bt.T);
          loss[k].push_back(m16.head_backward(*mp, bt.targets.data(), gscale));
          m16.backward(*mp);
          mp->end_pass();
        } else {
          p32->begin_pass("train");
          m32.forward(*p32, bt.tokens.data(), bt.B, bt.T);
          loss[k].push_back(m32.head_backward(*p32, bt.targets.data(), gscale));
          m32.backward(*p32);
          p32->end_pass();
        }
      }
      for (int u = 0; u < f.num_units(); ++u)
        grads[k].push_back(download(dev<float>(), static_cast<const float*>(f.grad_shard(u)),
                                    static_cast<size_t>(plan.units[static_cast<size_t>(u)].shard_size)));
      sumsq[k] = f.local_grad_sumsq();
      if (k == 1) issued = (mixed ? mp->comm_times() : p32->comm_times()).issued_s;
    }
    const std::string what = mixed ? "overlap on NCCL, mixed precision" : "overlap on NCCL, fp32";
    EXPECT_EQ(loss[0], loss[1]) << what << ": losses";
    for (size_t u = 0; u < grads[0].size(); ++u)
      EXPECT_EQ(grads[0][u], grads[1][u]) << what << ": gradient shard of unit " << u;
    EXPECT_EQ(sumsq[0], sumsq[1]) << what << ": local sum of squares";
    EXPECT_GT(issued, 0.0) << what << ": the communication stream's time was not recorded";
    note(what + ": bitwise equal to overlap off; device comm time " + fmt(issued * 1e3) + " ms");
  }
  // sum_squares_many against the loop, on arrays of different lengths (one empty).
  const std::vector<size_t> lens = {1, 0, 4097, 1u << 20, 333};
  std::vector<st::Buffer<float>> bufs;
  std::vector<const float*> ptrs;
  double loop = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    std::vector<float> h(lens[i]);
    for (size_t j = 0; j < h.size(); ++j) h[j] = static_cast<float>(std::sin(0.37 * static_cast<double>(j + 17 * i)));
    bufs.emplace_back(dev<float>(), std::max<size_t>(lens[i], 1));
    dev<float>().from_host(bufs.back().data(), h.data(), h.size());
    ptrs.push_back(bufs.back().data());
  }
  for (size_t i = 0; i < lens.size(); ++i) loop += dev<float>().sum_squares(ptrs[i], lens[i]);
  EXPECT_EQ(dev<float>().sum_squares_many(ptrs.data(), lens.data(), lens.size()), loop) << "sum_squares_many";
}

}  // namespace

// =============================================================================================
// Tests (in this order: AllocZeroed runs first, on fresh device memory).

// =============================================================================================
// Checkpoint snapshots (issue 29): take_checkpoint_snapshot into a SnapshotBuffer copies the device
// shards into pinned host memory (Backend::alloc_pinned_host) on the backend's copy stream
// (to_host_async), after the work queued on the compute stream, and waits for the copies before it
// returns (wait_host_copies).
//   - the buffer is page-locked: cudaPointerGetAttributes says cudaMemoryTypeHost ("pinned host");
//   - ordering: updates are queued on the compute stream (not waited for) right before the
//     snapshot, on a shard of 8 MiB; the snapshot holds their result, bitwise, which is also what
//     a plain device-to-host copy (to_host, pageable memory, compute stream) reads;
//   - isolation: updates queued right after the snapshot (the next step's optimizer) leave it
//     unchanged, read before and after they run; the next snapshot reuses the same memory.

st::UnitSpec snapshot_unit(const std::string& name, int64_t n) {
  st::ParamSpec p;
  p.name = name + ".weight";
  p.shape = {n};
  return {name, {p}};
}

void check_checkpoint_snapshot() {
  st::Backend<float>& be = dev<float>();
  const st::ShardPlan plan =
      st::ShardPlan::build({snapshot_unit("big", (int64_t{1} << 21) + 5), snapshot_unit("small", 37), snapshot_unit("one", 1)}, 1);
  const std::vector<std::string>& names = st::checkpoint_tensor_names();
  const size_t K = names.size(), U = plan.units.size();
  constexpr int kReps = 8;  // queued axpy passes before the snapshot
  std::vector<std::vector<st::Buffer<float>>> live(K);
  std::vector<st::Buffer<float>> step(U);
  std::vector<std::vector<std::vector<float>>> want(K, std::vector<std::vector<float>>(U));
  for (size_t u = 0; u < U; ++u) {
    const size_t n = static_cast<size_t>(plan.units[u].shard_size);
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 7 + 1);
    step[u] = upload(be, x);
    for (size_t k = 0; k < K; ++k) {
      std::vector<float> h(n);
      for (size_t i = 0; i < n; ++i) h[i] = static_cast<float>((i * 13 + 7 * k + u) % 1024);  // exact sums below
      live[k].push_back(upload(be, h));
      want[k][u] = h;
      for (size_t i = 0; i < n; ++i) want[k][u][i] += static_cast<float>(kReps) * x[i];
    }
  }
  st::ShardedTensors t;
  t.plan = &plan;
  t.plan_rank = 0;
  t.backend = &be;
  for (size_t k = 0; k < K; ++k) {
    st::ShardedTensor x{names[k], {}};
    for (auto& b : live[k]) x.shards.push_back(b.data());
    t.tensors.push_back(std::move(x));
  }
  auto buf = std::make_shared<st::SnapshotBuffer>(be, plan, K);
  if (!gs().emulated) {
    EXPECT_EQ(st::cuda_memory_kind(buf->rows(0, 0)), "pinned host") << "the snapshot buffer is not page-locked";
    EXPECT_EQ(st::cuda_memory_kind(live[0][0].data()), "device");
    std::vector<float> pageable(16);
    EXPECT_EQ(st::cuda_memory_kind(pageable.data()), "host");
  }
  // The "optimizer step": queued on the compute stream, not waited for.
  auto queue_updates = [&](float scale) {
    for (size_t k = 0; k < K; ++k)
      for (size_t u = 0; u < U; ++u) {
        const size_t n = static_cast<size_t>(plan.units[u].shard_size);
        if (scale == 0) {
          for (int r = 0; r < kReps; ++r) be.axpy(n, 1.0f, step[u].data(), live[k][u].data());
        } else {
          be.scale(n, scale, live[k][u].data());
        }
      }
  };
  queue_updates(0);
  const st::CheckpointSnapshot snap =
      st::take_checkpoint_snapshot(t, st::preset("tiny"), "{}", st::TrainState{}, true, false, buf);
  queue_updates(-3.0f);  // the next step, queued at once
  std::vector<std::vector<std::vector<float>>> early(K);
  for (size_t k = 0; k < K; ++k)
    for (size_t u = 0; u < U; ++u) {
      const size_t n = static_cast<size_t>(plan.units[u].shard_size);
      ASSERT_EQ(snap.tensors[k].rows(u), buf->rows(k, u)) << "tensor " << k << " unit " << u;
      early[k].emplace_back(snap.tensors[k].rows(u), snap.tensors[k].rows(u) + n);  // while the update may run
    }
  be.synchronize();
  for (size_t k = 0; k < K; ++k)
    for (size_t u = 0; u < U; ++u) {
      const size_t n = static_cast<size_t>(plan.units[u].shard_size);
      const std::string what = "snapshot of " + names[k] + " unit " + plan.units[u].name;
      const std::vector<float> now(snap.tensors[k].rows(u), snap.tensors[k].rows(u) + n);
      expect_bitwise(what + ": the queued update's result", early[k][u], want[k][u]);
      expect_bitwise(what + ": unchanged by the next update", now, want[k][u]);
      std::vector<float> moved = want[k][u];
      for (float& v : moved) v *= -3.0f;
      expect_bitwise(what + ": the device shard after the next update", download(be, live[k][u].data(), n), moved);
    }
  // A plain device-to-host copy (to_host: pageable memory, the compute stream) reads the same bytes;
  // and the next snapshot reuses the buffer.
  const st::CheckpointSnapshot again =
      st::take_checkpoint_snapshot(t, st::preset("tiny"), "{}", st::TrainState{}, true, false, buf);
  const st::CheckpointSnapshot plain = st::take_checkpoint_snapshot(t, st::preset("tiny"), "{}", st::TrainState{});
  for (size_t k = 0; k < K; ++k)
    for (size_t u = 0; u < U; ++u) {
      const size_t n = static_cast<size_t>(plan.units[u].shard_size);
      EXPECT_EQ(again.tensors[k].rows(u), buf->rows(k, u));
      expect_bitwise("snapshot of " + names[k] + " unit " + plan.units[u].name + " vs a plain device-to-host copy",
                     std::vector<float>(again.tensors[k].rows(u), again.tensors[k].rows(u) + n),
                     std::vector<float>(plain.tensors[k].rows(u), plain.tensors[k].rows(u) + n));
    }
  EXPECT_EQ(again.bytes(), plain.bytes());
  if (host().rank() == 0)
    std::printf("[ GPU ] checkpoint snapshot: %.1f MiB of %s memory, %zu tensors x %zu units, ordered after %d queued "
                "updates and isolated from the next\n",
                static_cast<double>(buf->bytes()) / (1 << 20),
                gs().emulated ? "emulated" : st::cuda_memory_kind(buf->rows(0, 0)).c_str(), K, U, kReps);
}

// Block attention at global positions (block_attention_run.h): the same blocks, documents and
// inputs on the device and on the CPU backend; y, lse, dq, dk, dv within the flash attention
// tolerances, the skipped tile pairs equal. The exact path's document mask (softmax_causal_doc_forward)
// likewise. RoPE at positions: bitwise the device's own whole-sequence rope rows (a head-tail pair
// and per-document restarts) and within rope's tolerance of the CPU's.
// max |a - b| / max(1, max |b|) of block attention's outputs; lse may be -inf on both (equal), -inf
// on one side only is an infinite error.
double block_rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (std::isfinite(b[i])) den = std::max(den, std::fabs(b[i]));
    if (a[i] == b[i]) continue;
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::fabs(a[i] - b[i]));
  }
  return num / std::max(den, 1.0);
}

// Block attention through cuDNN's fused SDPA (bf16: attention_pieces.h, the CUDA backend's
// block_forward_cudnn / block_backward_cudnn), required (SHARDTRAIN_CUDNN_ATTENTION=require: a
// piece cuDNN refuses fails the test), against the CPU's block kernels: context parallelism's
// head-tail layout (cp 2 and 4: each block one rank's chunks r and 2cp-1-r, every rank's queries
// against every rank's keys, merged, the backward accumulated), with documents (of 40 + 16 b tokens
// in sequence b, few shapes of pieces: the same in each sequence, one plan for all; or each sequence
// its own, a plan per sequence) and without, and blocks of a contiguous sequence cut unevenly; y,
// lse, dq, dk, dv within the bf16 flash tolerance, the tile pairs and the skipped ones counted as
// the tiled kernels count them.
void check_block_attention_cudnn() {
  ScopedEnv require("SHARDTRAIN_CUDNN_ATTENTION", "require");
  std::mt19937 g(9302);
  struct Case { int B, T_, NH, NKV, HD, cp; std::vector<int> cuts; bool docs, same_docs; };
  const std::vector<Case> cases = {{2, 512, 4, 2, 64, 2, {}, false, true},
                                   {1, 1024, 4, 4, 128, 4, {}, false, true},
                                   {2, 384, 4, 1, 64, 0, {0, 100, 228, 384}, false, true},
                                   {1, 244, 4, 2, 64, 2, {}, false, true},  // chunks of 61: lse rows 4-byte aligned
                                   {2, 512, 4, 2, 64, 2, {}, true, true},
                                   {3, 512, 4, 1, 64, 4, {}, true, false}};
  for (const Case& c : cases) {
    const size_t nq = static_cast<size_t>(c.B) * c.T_ * c.NH * c.HD, nk = static_cast<size_t>(c.B) * c.T_ * c.NKV * c.HD;
    const std::vector<bf16> q = randn<bf16>(nq, g, 1.5), k = randn<bf16>(nk, g, 1.5), v = randn<bf16>(nk, g),
                            dy = randn<bf16>(nq, g);
    // Storage order: rank 0's chunks, then rank 1's, ... (head-tail), or the sequence in order.
    std::vector<int32_t> order, pos;
    std::vector<int> cuts = c.cuts;
    if (c.cp > 0) {
      const int ch = c.T_ / (2 * c.cp);
      cuts.push_back(0);
      for (int r = 0; r < c.cp; ++r) {
        for (int chunk : {r, 2 * c.cp - 1 - r})
          for (int t = 0; t < ch; ++t) order.push_back(chunk * ch + t);
        cuts.push_back(static_cast<int>(order.size()));
      }
    } else {
      for (int t = 0; t < c.T_; ++t) order.push_back(t);
    }
    std::vector<int32_t> doc_of(static_cast<size_t>(c.T_)), doc;
    for (int b = 0; b < c.B; ++b) {
      if (b == 0 || !c.same_docs)
        for (int t = 0; t < c.T_; ++t) doc_of[static_cast<size_t>(t)] = t / (40 + 16 * b);
      pos.insert(pos.end(), order.begin(), order.end());
      if (c.docs)
        for (int32_t t : order) doc.push_back(doc_of[static_cast<size_t>(t)]);
    }
    const std::string sz = " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T_) + " NH=" + std::to_string(c.NH) +
                           " NKV=" + std::to_string(c.NKV) + " HD=" + std::to_string(c.HD) +
                           (c.cp ? " head-tail cp " + std::to_string(c.cp) : std::string(" uneven blocks")) +
                           (c.docs ? (c.same_docs ? " documents" : " documents per sequence") : "");
    const auto got = st::blocktest::run_blocks<bf16>(dev<bf16>(), c.B, c.T_, c.NH, c.NKV, c.HD, q, k, v, dy, pos, doc,
                                                     cuts);
    const auto want = st::blocktest::run_blocks<bf16>(cpu<bf16>(), c.B, c.T_, c.NH, c.NKV, c.HD, q, k, v, dy, pos,
                                                      doc, cuts);
    auto expect = [&](const char* what, double e) {
      note(std::string("[bf16] cuDNN block attention ") + what + sz + ": max|diff|/max(1,|ref|) " + fmt(e) +
           " (allowed 2e-2)");
      EXPECT_LE(e, 2e-2) << "cuDNN block attention " << what << sz;
    };
    expect("y", block_rel(got.y, want.y));
    expect("lse", block_rel(got.lse, want.lse));
    expect("dq", block_rel(got.dq, want.dq));
    expect("dk", block_rel(got.dk, want.dk));
    expect("dv", block_rel(got.dv, want.dv));
    EXPECT_EQ(got.tile_pairs, want.tile_pairs) << sz;
    EXPECT_EQ(got.skipped, want.skipped) << sz;
  }
}

template <typename T> void check_block_attention() {
  ScopedEnv tiled("SHARDTRAIN_CUDNN_ATTENTION", "off");  // the tiled block kernels (cuDNN's: the next test)
  std::mt19937 g(9301);
  struct Case { int B, T_, NH, NKV, HD; std::vector<int> cuts; bool docs; };
  const std::vector<Case> cases = {{2, 300, 4, 2, 64, {0, 1, 90, 170, 300}, false},
                                   {1, 260, 4, 1, 24, {0, 64, 65, 200, 260}, true},
                                   {2, 150, 4, 4, 64, {0, 75, 150}, true}};
  const double tol = std::is_same_v<T, float> ? 1e-5 : 2e-2;
  for (const Case& c : cases) {
    const size_t nq = static_cast<size_t>(c.B) * c.T_ * c.NH * c.HD, nk = static_cast<size_t>(c.B) * c.T_ * c.NKV * c.HD;
    const std::vector<T> q = randn<T>(nq, g, 1.5), k = randn<T>(nk, g, 1.5), v = randn<T>(nk, g), dy = randn<T>(nq, g);
    std::vector<int32_t> pos, doc;
    for (int b = 0; b < c.B; ++b)
      for (int t = 0; t < c.T_; ++t) {
        pos.push_back(t);
        if (c.docs) doc.push_back(t / 37 + (t > 100 ? 1 : 0) + b);
      }
    const std::string sz = " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T_) + " NH=" + std::to_string(c.NH) +
                           " NKV=" + std::to_string(c.NKV) + " HD=" + std::to_string(c.HD) + (c.docs ? " docs" : "");
    const auto got = st::blocktest::run_blocks<T>(dev<T>(), c.B, c.T_, c.NH, c.NKV, c.HD, q, k, v, dy, pos, doc, c.cuts);
    const auto want = st::blocktest::run_blocks<T>(cpu<T>(), c.B, c.T_, c.NH, c.NKV, c.HD, q, k, v, dy, pos, doc, c.cuts);
    auto expect = [&](const char* what, double e) {
      note(label<T>(std::string("block attention ") + what + sz) + ": max|diff|/max(1,|ref|) " + fmt(e) + " (allowed " +
           fmt(tol) + ")");
      EXPECT_LE(e, tol) << label<T>(std::string("block attention ") + what + sz);
    };
    expect("y", block_rel(got.y, want.y));
    expect("lse", block_rel(got.lse, want.lse));
    expect("dq", block_rel(got.dq, want.dq));
    expect("dk", block_rel(got.dk, want.dk));
    expect("dv", block_rel(got.dv, want.dv));
    EXPECT_EQ(got.tile_pairs, want.tile_pairs) << sz;
    EXPECT_EQ(got.skipped, want.skipped) << sz;
    EXPECT_GT(got.skipped, 0) << sz;
    if (c.docs) {  // the exact path with the same document mask: probabilities
      const size_t natt = static_cast<size_t>(c.B) * c.NH * c.T_ * c.T_;
      auto run = [&](st::Backend<T>& be) {
        st::Buffer<T> bq = upload(be, q), bk = upload(be, k), bv = upload(be, v), att(be, natt), y(be, nq);
        st::IdBuffer<T> bd(be, doc.size());
        be.ids_from_host(bd.data(), doc.data(), doc.size());
        st::attention_forward(be, bq.data(), bk.data(), bv.data(), att.data(), y.data(), c.B, c.T_, c.NH, c.NKV, c.HD,
                              bd.data());
        std::vector<double> out;
        for (const T& e : download(be, att.data(), natt)) out.push_back(val(e));
        return out;
      };
      expect("exact path, document mask: probabilities", block_rel(run(dev<T>()), run(cpu<T>())));
    }
  }
  // RoPE at positions.
  const int Tn = 120, H = 4, HD = 64, row = H * HD;
  std::vector<float> cs, sn;
  st::rope_tables(cs, sn, Tn, st::rope_inv_freqs(rope_test_config(HD, 10000.0)));
  std::vector<T> ct(cs.size()), stt(sn.size());
  for (size_t i = 0; i < cs.size(); ++i) ct[i] = cast<T>(cs[i]), stt[i] = cast<T>(sn[i]);
  const std::vector<T> x = randn<T>(static_cast<size_t>(Tn) * row, g);
  std::vector<int32_t> ht, restart;  // head-tail chunks [10, 30) + [90, 110); documents [0, 50), [50, 120)
  for (int t = 10; t < 30; ++t) ht.push_back(t);
  for (int t = 90; t < 110; ++t) ht.push_back(t);
  for (int t = 0; t < Tn; ++t) restart.push_back(t < 50 ? t : t - 50);
  for (bool backward : {false, true}) {
    auto whole = [&](st::Backend<T>& be, const std::vector<T>& in, int rows) {
      st::Buffer<T> bx = upload(be, in), bc = upload(be, ct), bs = upload(be, stt);
      if (backward) be.rope_backward(bx.data(), bc.data(), bs.data(), 1, rows, H, HD);
      else be.rope_forward(bx.data(), bc.data(), bs.data(), 1, rows, H, HD);
      return download(be, bx.data(), in.size());
    };
    auto at = [&](st::Backend<T>& be, const std::vector<T>& in, const std::vector<int32_t>& p) {
      st::Buffer<T> bx = upload(be, in), bc = upload(be, ct), bs = upload(be, stt);
      st::IdBuffer<T> bp(be, p.size());
      be.ids_from_host(bp.data(), p.data(), p.size());
      const int N = static_cast<int>(p.size());
      if (backward) be.rope_backward_at(bx.data(), bc.data(), bs.data(), bp.data(), N, H, HD);
      else be.rope_forward_at(bx.data(), bc.data(), bs.data(), bp.data(), N, H, HD);
      return download(be, bx.data(), in.size());
    };
    auto rows = [&](const std::vector<T>& src, int r0, int r1) {
      return std::vector<T>(src.begin() + static_cast<size_t>(r0) * row, src.begin() + static_cast<size_t>(r1) * row);
    };
    auto same_bits = [](const std::vector<T>& a, const std::vector<T>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
    };
    const std::string what = std::string(backward ? "rope_backward_at" : "rope_forward_at");
    const std::vector<T> w = whole(dev<T>(), x, Tn);
    std::vector<T> in_ht = rows(x, 10, 30), want_ht = rows(w, 10, 30);
    const std::vector<T> x2 = rows(x, 90, 110), w2 = rows(w, 90, 110);
    in_ht.insert(in_ht.end(), x2.begin(), x2.end());
    want_ht.insert(want_ht.end(), w2.begin(), w2.end());
    const std::vector<T> got_ht = at(dev<T>(), in_ht, ht);
    EXPECT_TRUE(same_bits(got_ht, want_ht)) << label<T>(what + " head-tail vs whole-sequence rows");
    std::vector<T> want_doc = whole(dev<T>(), rows(x, 0, 50), 50);
    const std::vector<T> d2 = whole(dev<T>(), rows(x, 50, Tn), Tn - 50);
    want_doc.insert(want_doc.end(), d2.begin(), d2.end());
    const std::vector<T> got_doc = at(dev<T>(), x, restart);
    EXPECT_TRUE(same_bits(got_doc, want_doc)) << label<T>(what + " per-document restarts vs whole-sequence rows");
    const std::vector<T> cpu_doc = at(cpu<T>(), x, restart);
    std::vector<double> a, b;
    for (size_t i = 0; i < got_doc.size(); ++i) a.push_back(val(got_doc[i])), b.push_back(val(cpu_doc[i]));
    const double e = block_rel(a, b);
    note(label<T>(what + " per-document restarts vs CPU") + ": max|diff|/max(1,|ref|) " + fmt(e) + " (allowed " +
         fmt(tol) + ")");
    EXPECT_LE(e, tol) << label<T>(what + " vs CPU");
  }
}

#define GPU_TEST_BOTH(Name, fn)       \
  TEST_F(Gpu, Name##F32) { fn<float>(); } \
  TEST_F(Gpu, Name##Bf16) { fn<bf16>(); }

GPU_TEST_BOTH(AllocZeroed, check_alloc)
GPU_TEST_BOTH(Gemm, check_gemm)
GPU_TEST_BOTH(GemmStridedBatched, check_gemm_batched)
GPU_TEST_BOTH(AxpyScale, check_axpy_scale)
GPU_TEST_BOTH(SumSquares, check_sum_squares)
GPU_TEST_BOTH(EmbeddingForward, check_embedding_forward)
GPU_TEST_BOTH(EmbeddingBackward, check_embedding_backward)
GPU_TEST_BOTH(RmsNormForward, check_rmsnorm_forward)
GPU_TEST_BOTH(RmsNormBackward, check_rmsnorm_backward)
GPU_TEST_BOTH(Rope, check_rope)
GPU_TEST_BOTH(RopeQk, check_rope_qk)
GPU_TEST_BOTH(SoftmaxCausal, check_softmax)
GPU_TEST_BOTH(FlashAttention, check_flash_attention)
GPU_TEST_BOTH(BlockAttention, check_block_attention)
TEST_F(Gpu, CudnnBlockAttentionBf16) { check_block_attention_cudnn(); }
TEST_F(Gpu, CudnnAttentionBf16) { check_cudnn_attention(); }
GPU_TEST_BOTH(SwiGLU, check_swiglu)
GPU_TEST_BOTH(MixtureOfExperts, check_moe)
GPU_TEST_BOTH(CrossEntropy, check_cross_entropy)
GPU_TEST_BOTH(AdamW, check_adamw)
GPU_TEST_BOTH(FromF32, check_from_f32)
GPU_TEST_BOTH(AddToF32, check_add_to_f32)

TEST_F(Gpu, NcclComm) {
  ensure_comms();
  if (!gs().nccl_skip.empty()) GTEST_SKIP() << gs().nccl_skip;
  ASSERT_TRUE(gs().nccl_error.empty()) << gs().nccl_error;  // agreed: the same on every rank
  check_comm(*gs().nccl, "nccl");
}

TEST_F(Gpu, StagedComm) {
  ensure_comms();
  check_comm(*gs().staged, "staged");
}

TEST_F(Gpu, MixedPrecisionUnitsStaged) {
  ensure_comms();
  check_mixed_precision(*gs().staged, "mixed precision (staged)");
}

TEST_F(Gpu, MixedPrecisionUnitsNccl) {
  ensure_comms();
  if (!gs().nccl_skip.empty()) GTEST_SKIP() << gs().nccl_skip;
  ASSERT_TRUE(gs().nccl_error.empty()) << gs().nccl_error;
  check_mixed_precision(*gs().nccl, "mixed precision (nccl)");
}

TEST_F(Gpu, OverlapNcclBitwise) {
  ensure_comms();
  if (!gs().nccl_skip.empty()) GTEST_SKIP() << gs().nccl_skip;
  ASSERT_TRUE(gs().nccl_error.empty()) << gs().nccl_error;
  check_overlap_nccl(*gs().nccl);
}

TEST_F(Gpu, CheckpointSnapshotPinned) { check_checkpoint_snapshot(); }

TEST_F(Gpu, LlamaTinyF32) { check_llama_f32(); }
TEST_F(Gpu, LlamaTinyDocumentMaskF32) { check_llama_f32(true); }

TEST_F(Gpu, LlamaTinyBf16MixedPrecision) { check_llama_bf16(); }
