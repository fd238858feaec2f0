// OpenBLAS kernel-set selection at start-up, and the start-up GEMM check.
//
// Why: a DYNAMIC_ARCH OpenBLAS (Debian's) picks its kernel set ("core type") from the CPU's model
// number, once, in its library constructor (gotoblas_dynamic_init), before main(). A CPU model it
// does not know -- cloud VMs that mask the model, newer parts than the release -- gets its Prescott
// (SSE3) kernels even when AVX2/FMA/AVX-512 are there: 3x slower training. OpenBLAS reads the
// environment variable OPENBLAS_CORETYPE in that constructor and loads the named set instead
// (OpenBLAS docs, "Runtime variables": OPENBLAS_CORETYPE). So select_blas_kernels(), first thing
// in main(), compares the set OpenBLAS loaded with the one the CPU's features allow and, when
// the loaded one is weaker and the user did not set OPENBLAS_CORETYPE, sets it and re-executes
// the program (execv of /proc/self/exe, same PID, same argv, before MPI_Init: safe under mpirun
// and srun). A marker variable carries what the first process saw, so it never loops.
//
// Then it runs a GEMM check (check_gemm) of sgemm and dgemm against a float64 loop; a kernel set
// that fails is replaced by the next weaker one (SkylakeX -> Haswell -> Sandybridge -> Prescott)
// through another re-exec, with a warning; when every set fails the program must not train
// (blas_selection().usable is false; main() then exits non-zero on every rank).
//
// Nothing here calls MPI except blas_report (collective).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardtrain/runtime/runtime.h"

namespace shardtrain {

// x86 features that decide which OpenBLAS kernel sets can run. Each flag means "the CPU has it
// and the OS saves its register state" (CPUID bits, Intel SDM vol. 2A, CPUID leaf 1 ECX: SSE3 0,
// FMA 12, AVX 28; leaf 7 EBX: AVX2 5, AVX512F 16, AVX512DQ 17, AVX512CD 28, AVX512BW 30,
// AVX512VL 31; EDX/EAX of leaf 7 sub-leaf 1: AVX512_BF16 EAX 5; OS support through XGETBV: GCC's
// __builtin_cpu_supports checks it). All false on other architectures.
struct CpuFeatures {
  bool sse3 = false, avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512cd = false;
  bool avx512bf16 = false;
};

// This CPU's features (GCC's __builtin_cpu_supports: CPUID plus XGETBV). Never throws.
CpuFeatures detect_cpu_features();

// The instruction-set level a kernel set needs, ordered: a set of level L runs on a CPU of level
// >= L, and a higher level is (for GEMM) faster.
enum class KernelLevel { Unknown = -1, Sse = 0, Avx = 1, Avx2 = 2, Avx512 = 3, Avx512Bf16 = 4 };

// The highest level this CPU supports: Avx512 needs AVX-512 F+BW+VL+DQ+CD (what OpenBLAS's
// SkylakeX kernels use), Avx512Bf16 that plus AVX512_BF16, Avx2 AVX2+FMA, Avx AVX, else Sse.
KernelLevel cpu_level(const CpuFeatures& f);

// Level of an OpenBLAS kernel set by the name openblas_get_corename() returns (case-insensitive):
// SapphireRapids/Cooperlake Avx512Bf16; SkylakeX Avx512; Haswell, Zen Avx2; Sandybridge,
// Bulldozer, Piledriver, Steamroller, Excavator Avx; the older x86 sets (Prescott, Core2,
// Nehalem, Atom, Opteron, Barcelona, ...) Sse; any other name Unknown (left alone: OpenBLAS may
// know a newer CPU than this table).
KernelLevel kernel_level(std::string_view corename);

// The set to ask for (an OPENBLAS_CORETYPE value) on a CPU of level `l`: SkylakeX for Avx512 and
// Avx512Bf16 (Cooperlake adds only bf16 GEMM, which shardtrain does not call),
// Haswell for Avx2, Sandybridge for Avx, "" for Sse/Unknown (nothing better than OpenBLAS's own
// pick to ask for).
std::string wanted_kernel_set(KernelLevel l);

// The next weaker set to try after `failed` failed the GEMM check, among the fallback chain
// SapphireRapids, Cooperlake, SkylakeX, Haswell, Sandybridge, Prescott: the first entry after
// `failed` (for a set not in the chain, the first entry of a lower level) that the CPU can run
// (level <= cpu), the library has (available(name)), and that is not in `tried`. nullopt when
// none is left.
std::optional<std::string> next_weaker_set(std::string_view failed, KernelLevel cpu,
                                           const std::function<bool(std::string_view)>& available,
                                           const std::vector<std::string>& tried);

// What select_blas_kernels does before the GEMM check, as a pure function (unit-tested).
struct KernelChoiceInput {
  KernelLevel cpu = KernelLevel::Sse;  // cpu_level(detect_cpu_features())
  std::string loaded;                  // openblas_get_corename()
  bool dynamic_arch = true;            // the library can load another set (DYNAMIC_ARCH build)
  std::function<bool(std::string_view)> available;  // the library has this set
  std::optional<std::string> user_coretype;  // OPENBLAS_CORETYPE as the user set it; nullopt if unset
  bool reexecuted = false;             // this process is already a re-exec by select_blas_kernels
};
struct KernelChoice {
  std::string reexec_with;  // non-empty: set OPENBLAS_CORETYPE to this and re-execute
  std::string note;         // non-empty: a line for the log (e.g. the user's set is weaker than the CPU allows)
};
// Rules, in order:
//   * not DYNAMIC_ARCH: keep (the set was fixed when OpenBLAS was built);
//   * already re-executed: keep (the marker stops any loop);
//   * the user set OPENBLAS_CORETYPE: keep, with a note when its level is below the CPU's
//     (faster kernels would run) -- unless the loaded set needs a level the CPU lacks (it would
//     die of SIGILL), then re-exec with wanted_kernel_set(cpu) and say so in the note;
//   * the loaded set's level is known and below that of wanted_kernel_set(cpu), which the
//     library has: re-exec with it;
//   * otherwise keep.
KernelChoice choose_kernel_set(const KernelChoiceInput& in);

// A row-major GEMM as the backend calls it: C[M x N] = alpha * op(A) op(B) + beta * C, op(A)
// M x K (ta: A stored K x M), op(B) K x N (tb: B stored N x K), leading dimensions in elements.
template <typename T>
using GemmFn = std::function<void(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B,
                                  int ldb, T beta, T* C, int ldc)>;

// Outcome of check_gemm.
struct GemmCheckResult {
  bool ok = true;
  double worst = 0;    // largest |C - reference| / bound over every element checked (ok iff <= 1)
  std::string detail;  // when !ok: the first failing call and element, e.g.
                       // "sgemm NT 21x27x1000 alpha 1.5 beta 0.5: C[3][7] = 1.23 where float64 gives 1.57 (4.1e+03 x the bound)"
};

// Checks `sgemm` and `dgemm` against a float64 loop on awkward cases: odd M, N, K; all four
// transpose combinations; leading dimensions larger than the rows (the padding of A and B holds
// NaN, which must not leak into C); beta 0 (C filled with NaN
// first, which must not propagate) and non-zero; alpha != 1; K = 1000 (beyond the kernels' K
// blocking); M x N beyond their M/N blocking; 1 x N and M x 1. Elements of C between N and ldc
// must come back untouched. Bound per element: 2 (K + 3) u (|alpha| sum_k |a_ik b_kj| +
// |beta c_ij|), u the unit roundoff of T -- twice the worst case of any summation order
// (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 3.1), so a correct
// GEMM never fails it and a wrong kernel, whose errors are of the order of the result, does
// (docs/architecture.md, "CPU start-up", has the measured margins and cost).
// 18 cases, about 5 M multiply-adds per precision. Never throws.
GemmCheckResult check_gemm(const GemmFn<float>& sgemm, const GemmFn<double>& dgemm);

// check_gemm of this process's OpenBLAS (cblas_sgemm / cblas_dgemm, row-major). Test hook:
// SHARDTRAIN_TEST_BLAS_FAIL=<set>[,<set>...] (or "all") makes the check fail, as a real failure
// would (one element of each K = 1000 sgemm result is off by 0.25 when compared), while the loaded set
// is one of those named (case-insensitive). Test-only: it exists so that the fallback path can be
// exercised on a machine whose kernels are correct.
GemmCheckResult check_openblas_gemm();

// The CPU's own GEMM limit, for MFU (mfu.h), measured with this process's kernel set.
struct GemmRate {
  double flops_per_thread = 0;  // best rate of one thread, FLOP/s (2 n^3 per sgemm)
  int threads = 0, n = 0, reps = 0;
  double seconds = 0;           // wall time of the whole measurement
};
// Runs an n x n x n single-threaded sgemm (row-major NN, fp32; what the CPU backend runs on each
// thread, one tile per call) on each of `threads` OpenMP threads at the same time, repeated until
// `budget_s` is spent (at least 2, at most 8 times), and keeps the fastest repetition: the first
// pays page faults and OpenBLAS's buffers. All threads at once, so that what the cores share
// (clock under full load, caches, memory bandwidth) is in the figure. Sets OpenBLAS to one thread
// for the calls and restores its count. n = 1024 takes ~20 ms per repetition with AVX-512 kernels
// (~100 GFLOP/s per core), ~0.15 s with SSE ones. Never throws; threads < 1 counts as 1.
GemmRate measure_sgemm_rate(int threads, int n = 1024, double budget_s = 0.25);

// What select_blas_kernels decided, for the log (blas_report).
struct BlasSelection {
  std::string library;       // "OpenBLAS 0.3.21" (from openblas_get_config())
  std::string build;         // "DYNAMIC_ARCH, pthreads": how the library was built
  std::string corename;      // the set in use (openblas_get_corename())
  std::string openblas_pick; // the set OpenBLAS loaded on its own (before any re-exec); "" if the user chose
  std::optional<std::string> user_coretype;  // OPENBLAS_CORETYPE as the user set it
  std::string how;           // why this set: "chosen from the CPU's features; OpenBLAS alone picked Prescott", ...
  std::vector<std::string> notes;     // notes for the log (user's weaker set, ...)
  std::vector<std::string> warnings;  // GEMM check failures and the fallbacks they caused
  bool usable = true;        // false: every set failed the GEMM check (error in `error`)
  std::string error;
};

// Call first in main(), before MPI_Init and before anything starts threads or opens files that
// matter: may replace the process (execv) up to a few times; returns in the final process.
// argv is main()'s argv (argv[0] is kept). On any failure to re-execute it keeps the loaded set
// and records a warning. Idempotent: later calls return the first result.
const BlasSelection& select_blas_kernels(char** argv);

// The result of select_blas_kernels (empty library name if it was never called).
const BlasSelection& blas_selection();

// Collective. One phrase for the first log line, e.g. "OpenBLAS 0.3.21 (DYNAMIC_ARCH, pthreads),
// SkylakeX kernels (chosen from the CPU's features; OpenBLAS alone picked Prescott)", naming
// the ranks whose set differs from rank 0's (heterogeneous nodes); `lines` gets the notes and
// warnings to log after it (rank 0's, plus the first differing rank's). Throws CollectiveError on
// every rank when any rank's selection is not usable.
std::string blas_report(Comm& comm, std::vector<std::string>* lines);

}  // namespace shardtrain
