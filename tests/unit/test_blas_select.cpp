// OpenBLAS kernel-set selection (choose_kernel_set, next_weaker_set: pure rules) and the start-up
// GEMM check (check_gemm) against deliberately wrong GEMMs, plus the selection this very test
// binary went through at start (tests/test_main.cpp calls select_blas_kernels).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "shardtrain/backend/blas_select.h"

namespace st = shardtrain;
using st::KernelLevel;

namespace {

st::CpuFeatures avx512_cpu() {
  st::CpuFeatures f;
  f.sse3 = f.avx = f.avx2 = f.fma = true;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512cd = true;
  return f;
}

bool has_all(std::string_view) { return true; }

st::KernelChoiceInput input(KernelLevel cpu, const std::string& loaded) {
  st::KernelChoiceInput in;
  in.cpu = cpu;
  in.loaded = loaded;
  in.available = has_all;
  return in;
}

// Textbook row-major GEMM with `flaw` injected.
enum class Flaw { None, DropLastK, WritePadding, IgnoreBeta, ReadCWhenBetaZero, IgnoreTransA };
template <typename T> st::GemmFn<T> naive_gemm(Flaw flaw) {
  return [flaw](bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta, T* C,
                int ldc) {
    if (flaw == Flaw::IgnoreTransA) ta = false;
    const int kk = flaw == Flaw::DropLastK && K >= 1000 ? K - 1 : K;
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) {
        double s = 0;
        for (int k = 0; k < kk; ++k) {
          const T a = ta ? A[static_cast<size_t>(k) * lda + i] : A[static_cast<size_t>(i) * lda + k];
          const T b = tb ? B[static_cast<size_t>(j) * ldb + k] : B[static_cast<size_t>(k) * ldb + j];
          s += static_cast<double>(a) * b;
        }
        T& c = C[static_cast<size_t>(i) * ldc + j];
        if (flaw == Flaw::ReadCWhenBetaZero) c = static_cast<T>(alpha * s + beta * c);  // 0 * NaN = NaN
        else if (beta == 0 || flaw == Flaw::IgnoreBeta) c = static_cast<T>(alpha * s);
        else c = static_cast<T>(alpha * s + beta * c);
        if (flaw == Flaw::WritePadding && ldc > N && j == N - 1) C[static_cast<size_t>(i) * ldc + N] = 0;
      }
  };
}

}  // namespace

TEST(BlasSelect, KernelLevels) {
  EXPECT_EQ(st::kernel_level("Prescott"), KernelLevel::Sse);
  EXPECT_EQ(st::kernel_level("Nehalem"), KernelLevel::Sse);
  EXPECT_EQ(st::kernel_level("Sandybridge"), KernelLevel::Avx);
  EXPECT_EQ(st::kernel_level("Haswell"), KernelLevel::Avx2);
  EXPECT_EQ(st::kernel_level("Zen"), KernelLevel::Avx2);
  EXPECT_EQ(st::kernel_level("SkylakeX"), KernelLevel::Avx512);
  EXPECT_EQ(st::kernel_level("skylakex"), KernelLevel::Avx512);  // OPENBLAS_CORETYPE is case-insensitive
  EXPECT_EQ(st::kernel_level("Cooperlake"), KernelLevel::Avx512Bf16);
  EXPECT_EQ(st::kernel_level("NEOVERSEN1"), KernelLevel::Unknown);
}

TEST(BlasSelect, CpuLevelAndWantedSet) {
  st::CpuFeatures f = avx512_cpu();
  EXPECT_EQ(st::cpu_level(f), KernelLevel::Avx512);
  EXPECT_EQ(st::wanted_kernel_set(st::cpu_level(f)), "SkylakeX");
  f.avx512bf16 = true;
  EXPECT_EQ(st::cpu_level(f), KernelLevel::Avx512Bf16);
  EXPECT_EQ(st::wanted_kernel_set(st::cpu_level(f)), "SkylakeX");
  f.avx512bf16 = false;
  f.avx512cd = false;  // not all the AVX-512 subsets SkylakeX kernels use
  EXPECT_EQ(st::cpu_level(f), KernelLevel::Avx2);
  EXPECT_EQ(st::wanted_kernel_set(KernelLevel::Avx2), "Haswell");
  f.fma = false;
  EXPECT_EQ(st::cpu_level(f), KernelLevel::Avx);
  EXPECT_EQ(st::wanted_kernel_set(KernelLevel::Avx), "Sandybridge");
  EXPECT_EQ(st::cpu_level(st::CpuFeatures{}), KernelLevel::Sse);
  EXPECT_EQ(st::wanted_kernel_set(KernelLevel::Sse), "");
}

TEST(BlasSelect, WeakerLoadedSetIsReplaced) {
  // This VM: AVX-512, OpenBLAS picked Prescott from the masked model number.
  EXPECT_EQ(st::choose_kernel_set(input(KernelLevel::Avx512, "Prescott")).reexec_with, "SkylakeX");
  EXPECT_EQ(st::choose_kernel_set(input(KernelLevel::Avx512Bf16, "Haswell")).reexec_with, "SkylakeX");
  EXPECT_EQ(st::choose_kernel_set(input(KernelLevel::Avx512, "Zen")).reexec_with, "SkylakeX");
  EXPECT_EQ(st::choose_kernel_set(input(KernelLevel::Avx2, "Prescott")).reexec_with, "Haswell");
  EXPECT_EQ(st::choose_kernel_set(input(KernelLevel::Avx, "Nehalem")).reexec_with, "Sandybridge");
  EXPECT_TRUE(st::choose_kernel_set(input(KernelLevel::Avx2, "Prescott")).note.empty());
}

TEST(BlasSelect, GoodOrUnknownLoadedSetIsKept) {
  for (auto [cpu, loaded] : std::vector<std::pair<KernelLevel, std::string>>{
           {KernelLevel::Avx512, "SkylakeX"},
           {KernelLevel::Avx512Bf16, "Cooperlake"},  // OpenBLAS's own pick, as good as ours
           {KernelLevel::Avx512Bf16, "SkylakeX"},    // Cooperlake would only add bf16 GEMM
           {KernelLevel::Avx2, "Haswell"},
           {KernelLevel::Avx2, "Zen"},
           {KernelLevel::Avx512, "SomeFutureCore"},  // unknown to us: OpenBLAS knows better
           {KernelLevel::Sse, "Prescott"},
           {KernelLevel::Sse, "Core2"}}) {
    const st::KernelChoice c = st::choose_kernel_set(input(cpu, loaded));
    EXPECT_EQ(c.reexec_with, "") << loaded;
    EXPECT_EQ(c.note, "") << loaded;
  }
}

TEST(BlasSelect, NoReexecWithoutDynamicArchOrAfterOne) {
  auto in = input(KernelLevel::Avx512, "Prescott");
  in.dynamic_arch = false;
  EXPECT_EQ(st::choose_kernel_set(in).reexec_with, "");
  in = input(KernelLevel::Avx512, "Prescott");
  in.reexecuted = true;  // the marker: never loop
  EXPECT_EQ(st::choose_kernel_set(in).reexec_with, "");
  in = input(KernelLevel::Avx512, "Prescott");
  in.available = [](std::string_view s) { return s != "SkylakeX"; };  // a build without it
  EXPECT_EQ(st::choose_kernel_set(in).reexec_with, "");
}

TEST(BlasSelect, UserCoretypeIsRespectedWithANote) {
  auto in = input(KernelLevel::Avx512, "Prescott");
  in.user_coretype = "Prescott";
  st::KernelChoice c = st::choose_kernel_set(in);
  EXPECT_EQ(c.reexec_with, "");
  EXPECT_NE(c.note.find("OPENBLAS_CORETYPE=Prescott"), std::string::npos) << c.note;
  EXPECT_NE(c.note.find("SkylakeX"), std::string::npos) << c.note;
  in = input(KernelLevel::Avx512, "SkylakeX");
  in.user_coretype = "skylakex";
  c = st::choose_kernel_set(in);
  EXPECT_EQ(c.reexec_with, "");
  EXPECT_EQ(c.note, "");
}

TEST(BlasSelect, UserCoretypeTheCpuCannotRunIsReplaced) {
  auto in = input(KernelLevel::Avx2, "SkylakeX");  // would die of SIGILL
  in.user_coretype = "SkylakeX";
  const st::KernelChoice c = st::choose_kernel_set(in);
  EXPECT_EQ(c.reexec_with, "Haswell");
  EXPECT_NE(c.note.find("lacks"), std::string::npos) << c.note;
}

TEST(BlasSelect, FallbackChain) {
  const std::vector<std::string> none;
  EXPECT_EQ(st::next_weaker_set("SkylakeX", KernelLevel::Avx512, has_all, none), "Haswell");
  EXPECT_EQ(st::next_weaker_set("Haswell", KernelLevel::Avx512, has_all, none), "Sandybridge");
  EXPECT_EQ(st::next_weaker_set("Sandybridge", KernelLevel::Avx512, has_all, none), "Prescott");
  EXPECT_EQ(st::next_weaker_set("Prescott", KernelLevel::Avx512, has_all, none), std::nullopt);
  EXPECT_EQ(st::next_weaker_set("Cooperlake", KernelLevel::Avx512Bf16, has_all, none), "SkylakeX");
  EXPECT_EQ(st::next_weaker_set("zen", KernelLevel::Avx2, has_all, none), "Sandybridge");  // not in the chain
  EXPECT_EQ(st::next_weaker_set("Nehalem", KernelLevel::Avx2, has_all, none), std::nullopt);  // Sse: nothing below
  EXPECT_EQ(st::next_weaker_set("Mystery", KernelLevel::Avx2, has_all, none), "Haswell");  // unknown: best the CPU runs
  // Sets already tried, and sets the library lacks, are skipped.
  EXPECT_EQ(st::next_weaker_set("SkylakeX", KernelLevel::Avx512, has_all, {"SkylakeX", "Haswell"}), "Sandybridge");
  auto no_sandy = [](std::string_view s) { return s != "Sandybridge"; };
  EXPECT_EQ(st::next_weaker_set("Haswell", KernelLevel::Avx2, no_sandy, none), "Prescott");
}

TEST(GemmCheck, CorrectGemmsPass) {
  const st::GemmCheckResult r = st::check_gemm(naive_gemm<float>(Flaw::None), naive_gemm<double>(Flaw::None));
  EXPECT_TRUE(r.ok) << r.detail;
  EXPECT_LE(r.worst, 1.0);
  EXPECT_GT(r.worst, 0.0);  // float rounding is measured, not zero
}

TEST(GemmCheck, ThisProcessesOpenBlasPasses) {
  const st::GemmCheckResult r = st::check_openblas_gemm();
  EXPECT_TRUE(r.ok) << r.detail;
  EXPECT_LE(r.worst, 1.0);
}

TEST(GemmCheck, WrongGemmsFail) {
  for (Flaw f : {Flaw::DropLastK, Flaw::WritePadding, Flaw::IgnoreBeta, Flaw::ReadCWhenBetaZero, Flaw::IgnoreTransA}) {
    const st::GemmCheckResult r = st::check_gemm(naive_gemm<float>(f), naive_gemm<double>(Flaw::None));
    EXPECT_FALSE(r.ok) << static_cast<int>(f);
    EXPECT_NE(r.detail.find("sgemm"), std::string::npos) << r.detail;
    EXPECT_NE(r.detail.find("C["), std::string::npos) << r.detail;
  }
  // A dropped term of K = 1000 is one part in ~1000: far beyond the rounding bound.
  st::GemmCheckResult r = st::check_gemm(naive_gemm<float>(Flaw::DropLastK), naive_gemm<double>(Flaw::None));
  EXPECT_NE(r.detail.find("x1000"), std::string::npos) << r.detail;
  EXPECT_NE(r.detail.find("x the bound"), std::string::npos) << r.detail;
  r = st::check_gemm(naive_gemm<float>(Flaw::WritePadding), naive_gemm<double>(Flaw::None));
  EXPECT_NE(r.detail.find("overwritten"), std::string::npos) << r.detail;
  // dgemm is checked too.
  r = st::check_gemm(naive_gemm<float>(Flaw::None), naive_gemm<double>(Flaw::DropLastK));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.detail.find("dgemm"), std::string::npos) << r.detail;
}

TEST(GemmCheck, TestHookFailsTheNamedSet) {
  const std::string core = st::blas_selection().corename;
  ASSERT_FALSE(core.empty()) << "select_blas_kernels was not called (tests/test_main.cpp)";
  setenv("SHARDTRAIN_TEST_BLAS_FAIL", ("NoSuchSet," + core).c_str(), 1);
  st::GemmCheckResult r = st::check_openblas_gemm();
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.detail.find("SHARDTRAIN_TEST_BLAS_FAIL"), std::string::npos) << r.detail;
  setenv("SHARDTRAIN_TEST_BLAS_FAIL", "NoSuchSet", 1);
  r = st::check_openblas_gemm();
  EXPECT_TRUE(r.ok) << r.detail;
  unsetenv("SHARDTRAIN_TEST_BLAS_FAIL");
}

// The selection this binary made at start: the kernels the CPU allows, unless the user chose.
TEST(BlasSelect, ThisProcessRunsTheFastestSetTheCpuAllows) {
  const st::BlasSelection& s = st::blas_selection();
  EXPECT_TRUE(s.usable) << s.error;
  EXPECT_EQ(s.library.rfind("OpenBLAS", 0), 0u) << s.library;
  if (s.user_coretype || !s.build.starts_with("DYNAMIC_ARCH")) GTEST_SKIP() << "OPENBLAS_CORETYPE set, or a single-set build";
  if (!s.warnings.empty()) GTEST_SKIP() << "a kernel set failed the GEMM check here: " << s.warnings.front();
  const KernelLevel want = st::kernel_level(st::wanted_kernel_set(st::cpu_level(st::detect_cpu_features())));
  const KernelLevel have = st::kernel_level(s.corename);
  if (have != KernelLevel::Unknown && want != KernelLevel::Unknown) {
    EXPECT_GE(static_cast<int>(have), static_cast<int>(want)) << s.corename << ": " << s.how;
  }
}
