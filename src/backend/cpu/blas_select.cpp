// OpenBLAS kernel-set selection and the start-up GEMM check (see blas_select.h).
#include "shardtrain/backend/blas_select.h"

#include <cblas.h>
#include <omp.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <type_traits>

namespace shardtrain {
namespace {

// Set by select_blas_kernels before it re-executes the program; read (and removed) by the next
// process. Lines "key=value": reexecs=N, user=<OPENBLAS_CORETYPE as the user set it> (absent if
// unset), pick=<the set OpenBLAS loaded on its own>, set=<the OPENBLAS_CORETYPE it set>,
// failed=<set>, note=..., warn=... A marker whose `set` is not the OPENBLAS_CORETYPE in force (one
// left in the environment by a parent, or garbage) was not written by our own restart: ignored.
constexpr const char* kMarker = "SHARDTRAIN_BLAS_STARTUP";
constexpr const char* kCoretype = "OPENBLAS_CORETYPE";
constexpr const char* kTestFail = "SHARDTRAIN_TEST_BLAS_FAIL";
constexpr int kMaxReexecs = 8;  // more than the fallback chain is long: a bound, never reached

std::string lower(std::string_view s) {
  std::string o(s);
  for (char& c : o) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return o;
}
std::string upper(std::string_view s) {
  std::string o(s);
  for (char& c : o) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return o;
}
bool ieq(std::string_view a, std::string_view b) { return lower(a) == lower(b); }

const char* level_name(KernelLevel l) {
  switch (l) {
    case KernelLevel::Avx512Bf16: return "AVX-512 with BF16";
    case KernelLevel::Avx512: return "AVX-512";
    case KernelLevel::Avx2: return "AVX2 and FMA";
    case KernelLevel::Avx: return "AVX";
    case KernelLevel::Sse: return "SSE3";
    default: return "unknown";
  }
}

// Fallback chain, strongest first.
const char* const kChain[] = {"SapphireRapids", "Cooperlake", "SkylakeX", "Haswell", "Sandybridge", "Prescott"};

// The library has this kernel set: DYNAMIC_ARCH builds export one gotoblas_<SET> table per set.
bool library_has_set(std::string_view name) {
  return dlsym(RTLD_DEFAULT, ("gotoblas_" + upper(name)).c_str()) != nullptr;
}

struct Marker {
  bool present = false;
  int reexecs = 0;
  std::optional<std::string> user;  // the user's OPENBLAS_CORETYPE
  std::string pick;                 // OpenBLAS's own pick in the first process
  std::string set;                  // the OPENBLAS_CORETYPE the restart set
  bool stale = false;               // a marker was in the environment but not written by our restart
  std::vector<std::string> failed, notes, warnings;
};

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

Marker read_marker() {
  Marker m;
  const char* v = std::getenv(kMarker);
  if (!v) return m;
  m.present = true;
  std::istringstream is(v);
  std::string line;
  while (std::getline(is, line)) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = line.substr(0, eq), val = line.substr(eq + 1);
    if (k == "reexecs") m.reexecs = std::atoi(val.c_str());
    else if (k == "user") m.user = val;
    else if (k == "pick") m.pick = val;
    else if (k == "set") m.set = val;
    else if (k == "failed") m.failed.push_back(val);
    else if (k == "note") m.notes.push_back(val);
    else if (k == "warn") m.warnings.push_back(val);
  }
  const char* ct = std::getenv(kCoretype);
  if (m.reexecs < 1 || m.set.empty() || !ct || m.set != ct) {  // not ours: start as if absent
    Marker fresh;
    fresh.stale = true;
    unsetenv(kMarker);
    return fresh;
  }
  return m;
}

std::string write_marker(const Marker& m) {
  std::string s = "reexecs=" + std::to_string(m.reexecs) + "\n";
  if (m.user) s += "user=" + one_line(*m.user) + "\n";
  s += "pick=" + m.pick + "\n";
  s += "set=" + one_line(m.set) + "\n";
  for (auto& f : m.failed) s += "failed=" + one_line(f) + "\n";
  for (auto& n : m.notes) s += "note=" + one_line(n) + "\n";
  for (auto& w : m.warnings) s += "warn=" + one_line(w) + "\n";
  return s;
}

// The arguments that started this process image. Normally main()'s argv; but when the program was
// started through the dynamic loader (`ld-linux-x86-64.so.2 [--library-path P] prog args`, as
// tests/gpu/bundle.sh does to bring its own glibc), /proc/self/exe is the loader and main() sees
// only prog's arguments: then the loader's whole command line, from /proc/self/cmdline.
std::vector<std::string> restart_args(char** argv) {
  std::vector<std::string> args;
  std::error_code ec;
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).filename().string();
  if (!ec && (exe.starts_with("ld-linux") || exe.starts_with("ld.so") || exe.starts_with("ld64.so"))) {
    std::ifstream f("/proc/self/cmdline", std::ios::binary);
    std::string a;
    while (std::getline(f, a, '\0')) args.push_back(a);
    if (!args.empty()) return args;
  }
  for (char** p = argv; p && *p; ++p) args.emplace_back(*p);
  return args;
}

// Replaces this process by a fresh start of the same program with OPENBLAS_CORETYPE=set. Returns
// only when execv failed (then the environment is as before and *why says why).
void reexec_with(const std::string& set, Marker m, char** argv, std::string* why) {
  std::vector<std::string> args = restart_args(argv);
  std::vector<char*> cargs;
  for (std::string& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  const char* old = std::getenv(kCoretype);
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  m.reexecs++;
  m.set = set;
  setenv(kCoretype, set.c_str(), 1);
  setenv(kMarker, write_marker(m).c_str(), 1);
  std::fflush(nullptr);
  // The program's own path, so that the new image keeps its name (ps -C shardtrain, pgrep, top: an
  // image started from /proc/self/exe is named "exe"); /proc/self/exe when the file is gone.
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec && self.is_absolute() && access(self.c_str(), X_OK) == 0) execv(self.c_str(), cargs.data());
  execv("/proc/self/exe", cargs.data());
  *why = std::string("execv(/proc/self/exe): ") + std::strerror(errno);
  unsetenv(kMarker);
  if (saved) setenv(kCoretype, saved->c_str(), 1);
  else unsetenv(kCoretype);
}

template <typename T> const char* gemm_name() { return std::is_same_v<T, float> ? "sgemm" : "dgemm"; }

struct Case {
  int M, N, K;
  bool ta, tb;
  double alpha, beta;
  int pad;  // leading dimensions exceed the stored row width by this much
};

std::vector<Case> check_cases() {
  std::vector<Case> cs;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    cs.push_back({35, 43, 29, ta, tb, 1.0, 0.0, 3});
    cs.push_back({35, 43, 29, ta, tb, -0.5, 0.75, 5});
    cs.push_back({21, 27, 1000, ta, tb, 1.5, ta ? 0.5 : 0.0, 1});  // K beyond the kernels' K blocking
  }
  cs.push_back({259, 131, 24, false, false, 1.0, 1.0, 2});  // M, N beyond the M/N blocking
  cs.push_back({259, 131, 24, true, true, 1.0, 0.0, 0});
  cs.push_back({64, 48, 257, false, true, 1.0, 0.0, 0});    // a training-like NT product
  cs.push_back({1, 1, 1, false, false, 1.0, 0.0, 0});
  cs.push_back({1, 77, 5, false, true, 1.0, 0.0, 2});
  cs.push_back({77, 1, 5, true, false, 2.0, 0.5, 1});
  return cs;
}

// Deterministic values in [-1, 1).
struct Lcg {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  double next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(s >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;
  }
};

template <typename T> void run_cases(const GemmFn<T>& gemm, GemmCheckResult& res) {
  // float64 reference for both: for dgemm its own rounding (at most K u |a||b|) fits in the bound's
  // factor 2 beside the kernel's.
  using Acc = double;
  const double u = std::numeric_limits<T>::epsilon() / 2;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T sentinel = static_cast<T>(12345.0);
  Lcg rng;
  for (const Case& c : check_cases()) {
    // Stored shapes (row-major): A is M x K (K x M when ta), B is K x N (N x K when tb).
    const int ar = c.ta ? c.K : c.M, ac = c.ta ? c.M : c.K;
    const int br = c.tb ? c.N : c.K, bc = c.tb ? c.K : c.N;
    const int lda = ac + c.pad, ldb = bc + c.pad, ldc = c.N + c.pad;
    // Padding of A and B is NaN: a kernel that uses it poisons its result.
    std::vector<T> A(static_cast<size_t>(ar) * lda, nan), B(static_cast<size_t>(br) * ldb, nan);
    std::vector<T> C(static_cast<size_t>(c.M) * ldc, sentinel);
    for (int i = 0; i < ar; ++i)
      for (int j = 0; j < ac; ++j) A[static_cast<size_t>(i) * lda + j] = static_cast<T>(rng.next());
    for (int i = 0; i < br; ++i)
      for (int j = 0; j < bc; ++j) B[static_cast<size_t>(i) * ldb + j] = static_cast<T>(rng.next());
    for (int i = 0; i < c.M; ++i)
      for (int j = 0; j < c.N; ++j)  // beta 0: C need not be set on input (BLAS), NaN must not come out
        C[static_cast<size_t>(i) * ldc + j] = c.beta == 0 ? nan : static_cast<T>(rng.next());
    const std::vector<T> C0 = C;
    const T alpha = static_cast<T>(c.alpha), beta = static_cast<T>(c.beta);
    gemm(c.ta, c.tb, c.M, c.N, c.K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
    auto fail = [&](int i, int j, const std::string& what) {
      std::ostringstream os;
      os << gemm_name<T>() << ' ' << (c.ta ? 'T' : 'N') << (c.tb ? 'T' : 'N') << ' ' << c.M << 'x' << c.N << 'x' << c.K
         << " alpha " << c.alpha << " beta " << c.beta << " (lda " << lda << ", ldb " << ldb << ", ldc " << ldc
         << "): C[" << i << "][" << j << "] " << what;
      res.ok = false;
      res.detail = os.str();
    };
    for (int i = 0; i < c.M; ++i) {
      for (int j = 0; j < ldc; ++j) {
        const T got = C[static_cast<size_t>(i) * ldc + j];
        if (j >= c.N) {  // padding of C: untouched
          if (std::memcmp(&got, &sentinel, sizeof(T)) != 0 && res.ok) {
            std::ostringstream os;
            os << "(beyond N, inside ldc) was overwritten: " << static_cast<double>(got);
            fail(i, j, os.str());
          }
          continue;
        }
        Acc sum = 0, mag = 0;
        for (int k = 0; k < c.K; ++k) {
          const Acc a = A[c.ta ? static_cast<size_t>(k) * lda + i : static_cast<size_t>(i) * lda + k];
          const Acc b = B[c.tb ? static_cast<size_t>(j) * ldb + k : static_cast<size_t>(k) * ldb + j];
          sum += a * b;
          mag += std::fabs(a * b);
        }
        Acc ref = static_cast<Acc>(alpha) * sum;
        Acc scale = std::fabs(static_cast<Acc>(alpha)) * mag;
        if (c.beta != 0) {
          const Acc c0 = C0[static_cast<size_t>(i) * ldc + j];
          ref += static_cast<Acc>(beta) * c0;
          scale += std::fabs(static_cast<Acc>(beta) * c0);
        }
        const double bound = 2.0 * (c.K + 3) * u * static_cast<double>(scale) + std::numeric_limits<T>::min();
        const double err = std::fabs(static_cast<double>(static_cast<Acc>(got) - ref));
        const double ratio = err / bound;
        if (!(ratio <= res.worst)) res.worst = std::isnan(ratio) ? std::numeric_limits<double>::infinity()
                                                                  : std::max(res.worst, ratio);
        if (!(ratio <= 1.0) && res.ok) {
          std::ostringstream os;
          os.precision(9);
          os << "= " << static_cast<double>(got) << " where float64 gives " << static_cast<double>(ref);
          os.precision(2);
          os << " (" << std::scientific << ratio << " x the bound " << bound << ")";
          fail(i, j, os.str());
        }
      }
    }
    if (!res.ok) return;
  }
}

// The test hook's target sets (lower case), from SHARDTRAIN_TEST_BLAS_FAIL.
bool test_fail_requested(const std::string& corename) {
  const char* v = std::getenv(kTestFail);
  if (!v || !*v) return false;
  std::istringstream is(v);
  std::string item;
  while (std::getline(is, item, ','))
    if (ieq(item, "all") || ieq(item, corename)) return true;
  return false;
}

BlasSelection g_sel;
bool g_selected = false;

}  // namespace

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.sse3 = __builtin_cpu_supports("sse3") != 0;
  f.avx = __builtin_cpu_supports("avx") != 0;
  f.avx2 = __builtin_cpu_supports("avx2") != 0;
  f.fma = __builtin_cpu_supports("fma") != 0;
  f.avx512f = __builtin_cpu_supports("avx512f") != 0;
  f.avx512bw = __builtin_cpu_supports("avx512bw") != 0;
  f.avx512vl = __builtin_cpu_supports("avx512vl") != 0;
  f.avx512dq = __builtin_cpu_supports("avx512dq") != 0;
  f.avx512cd = __builtin_cpu_supports("avx512cd") != 0;
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16") != 0;
#endif
  return f;
}

KernelLevel cpu_level(const CpuFeatures& f) {
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512cd && f.avx2 && f.fma;
  if (avx512 && f.avx512bf16) return KernelLevel::Avx512Bf16;
  if (avx512) return KernelLevel::Avx512;
  if (f.avx2 && f.fma && f.avx) return KernelLevel::Avx2;
  if (f.avx) return KernelLevel::Avx;
  return KernelLevel::Sse;
}

KernelLevel kernel_level(std::string_view corename) {
  const std::string n = lower(corename);
  if (n == "sapphirerapids" || n == "cooperlake") return KernelLevel::Avx512Bf16;
  if (n == "skylakex") return KernelLevel::Avx512;
  if (n == "haswell" || n == "zen") return KernelLevel::Avx2;
  if (n == "sandybridge" || n == "bulldozer" || n == "piledriver" || n == "steamroller" || n == "excavator")
    return KernelLevel::Avx;
  for (const char* s : {"katmai", "coppermine", "northwood", "prescott", "banias", "atom", "core2", "penryn",
                        "dunnington", "nehalem", "athlon", "opteron", "opteron(sse3)", "opteron_sse3", "barcelona",
                        "nano", "bobcat"})
    if (n == s) return KernelLevel::Sse;
  return KernelLevel::Unknown;
}

std::string wanted_kernel_set(KernelLevel l) {
  switch (l) {
    case KernelLevel::Avx512Bf16:
    case KernelLevel::Avx512: return "SkylakeX";
    case KernelLevel::Avx2: return "Haswell";
    case KernelLevel::Avx: return "Sandybridge";
    default: return "";
  }
}

std::optional<std::string> next_weaker_set(std::string_view failed, KernelLevel cpu,
                                           const std::function<bool(std::string_view)>& available,
                                           const std::vector<std::string>& tried) {
  const size_t n = std::size(kChain);
  size_t start = n;
  for (size_t i = 0; i < n && start == n; ++i)
    if (ieq(kChain[i], failed)) start = i + 1;
  if (start == n && !ieq(kChain[n - 1], failed)) {  // not in the chain: from the first entry below its level
    const KernelLevel fl = kernel_level(failed);
    for (start = 0; start < n; ++start)
      if (fl == KernelLevel::Unknown ? kernel_level(kChain[start]) <= cpu : kernel_level(kChain[start]) < fl) break;
  }
  for (size_t i = start; i < n; ++i) {
    const std::string s = kChain[i];
    if (kernel_level(s) > cpu || !available(s)) continue;
    if (std::any_of(tried.begin(), tried.end(), [&](const std::string& t) { return ieq(t, s); })) continue;
    return s;
  }
  return std::nullopt;
}

KernelChoice choose_kernel_set(const KernelChoiceInput& in) {
  KernelChoice ch;
  if (!in.dynamic_arch || in.reexecuted) return ch;
  const std::string want = wanted_kernel_set(in.cpu);
  const KernelLevel have = kernel_level(in.loaded);
  const bool can_want = !want.empty() && (!in.available || in.available(want));
  if (in.user_coretype) {
    if (have != KernelLevel::Unknown && have > in.cpu && can_want) {
      ch.reexec_with = want;
      ch.note = "OPENBLAS_CORETYPE=" + *in.user_coretype + " loads kernels that need " + level_name(have) +
                ", which this CPU lacks; using " + want + " instead";
    } else if (have != KernelLevel::Unknown && can_want && have < kernel_level(want)) {
      ch.note = "OPENBLAS_CORETYPE=" + *in.user_coretype + " selects OpenBLAS's " + in.loaded +
                " kernels; this CPU has " + level_name(in.cpu) + " and runs " + want +
                " (faster); unset OPENBLAS_CORETYPE to use them";
    }
    return ch;
  }
  if (have != KernelLevel::Unknown && can_want && have < kernel_level(want)) ch.reexec_with = want;
  return ch;
}

GemmCheckResult check_gemm(const GemmFn<float>& sgemm, const GemmFn<double>& dgemm) {
  GemmCheckResult r;
  run_cases<float>(sgemm, r);
  if (r.ok) run_cases<double>(dgemm, r);
  return r;
}

GemmCheckResult check_openblas_gemm() {
  const std::string core = openblas_get_corename();
  const bool inject = test_fail_requested(core);
  auto sgemm = [inject](bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                        int ldb, float beta, float* C, int ldc) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda,
                B, ldb, beta, C, ldc);
    if (inject && K >= 1000) C[static_cast<size_t>(M / 2) * ldc + N / 2] += 0.25f;  // a wrong element, as a bad kernel would give
  };
  auto dgemm = [](bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda, const double* B,
                  int ldb, double beta, double* C, int ldc) {
    cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda,
                B, ldb, beta, C, ldc);
  };
  GemmCheckResult r = check_gemm(sgemm, dgemm);
  if (inject && !r.ok) r.detail += " [made to fail by " + std::string(kTestFail) + "]";
  return r;
}

GemmRate measure_sgemm_rate(int threads, int n, double budget_s) {
  using Clock = std::chrono::steady_clock;
  GemmRate g;
  g.threads = std::max(1, threads);
  g.n = std::max(16, n);
  const size_t nn = static_cast<size_t>(g.n) * g.n;
  const int saved = openblas_get_num_threads();
  openblas_set_num_threads(1);
  const auto t_begin = Clock::now();
  Clock::time_point t0;
  double best = 0;
  bool stop = false;
#pragma omp parallel num_threads(g.threads)
  {
    // Each thread's own operands, first touched by it (its NUMA node). Values in [0.5, 1.5): no
    // denormals, no overflow at K = n.
    std::vector<float> A(nn), B(nn), C(nn);
    for (size_t i = 0; i < nn; ++i) {
      A[i] = 0.5f + static_cast<float>(i % 97) / 97.0f;
      B[i] = 1.5f - static_cast<float>(i % 89) / 89.0f;
    }
    for (int rep = 0; rep < 8; ++rep) {
#pragma omp barrier
#pragma omp single
      t0 = Clock::now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g.n, g.n, g.n, 1.0f, A.data(), g.n, B.data(), g.n, 0.0f,
                  C.data(), g.n);
#pragma omp barrier
#pragma omp single
      {
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        best = std::max(best, 2.0 * static_cast<double>(g.n) * g.n * g.n / std::max(dt, 1e-9));
        g.reps = rep + 1;
        stop = g.reps >= 2 && std::chrono::duration<double>(Clock::now() - t_begin).count() >= budget_s;
      }  // implicit barrier: every thread reads the same `stop`
      if (stop) break;
    }
  }
  openblas_set_num_threads(saved);
  g.flops_per_thread = best;
  g.seconds = std::chrono::duration<double>(Clock::now() - t_begin).count();
  return g;
}

const BlasSelection& blas_selection() { return g_sel; }

const BlasSelection& select_blas_kernels(char** argv) {
  if (g_selected) return g_sel;
  g_selected = true;
  Marker m = read_marker();
  unsetenv(kMarker);
  if (m.stale)
    m.notes.push_back(std::string(kMarker) + " was in the environment but not set by this start (shardtrain's restart "
                      "marker, left by a parent process?): ignored");
  BlasSelection& s = g_sel;
  {  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64": name and version
    const std::string cfg = openblas_get_config();
    std::istringstream is(cfg);
    std::string name, version;
    is >> name >> version;
    s.library = name + (version.empty() ? "" : " " + version);
    const bool dynamic = cfg.find("DYNAMIC_ARCH") != std::string::npos;
    const int par = openblas_get_parallel();
    s.build = std::string(dynamic ? "DYNAMIC_ARCH" : "one kernel set") + ", " +
              (par == 0 ? "sequential" : par == 2 ? "OpenMP" : "pthreads");
  }
  const bool dynamic = s.build.starts_with("DYNAMIC_ARCH");
  const std::string loaded = openblas_get_corename();
  if (!m.present) {
    const char* u = std::getenv(kCoretype);
    if (u && *u) m.user = u;
    else m.pick = loaded;
  }
  s.user_coretype = m.user;
  s.openblas_pick = m.pick;
  const KernelLevel cpu = cpu_level(detect_cpu_features());
  KernelChoiceInput in;
  in.cpu = cpu;
  in.loaded = loaded;
  in.dynamic_arch = dynamic;
  in.available = library_has_set;
  in.user_coretype = m.user;
  in.reexecuted = m.present;
  const KernelChoice ch = choose_kernel_set(in);
  if (!ch.note.empty()) m.notes.push_back(ch.note);
  if (!ch.reexec_with.empty() && m.reexecs < kMaxReexecs) {
    std::string why;
    reexec_with(ch.reexec_with, m, argv, &why);
    m.warnings.push_back("could not restart with OPENBLAS_CORETYPE=" + ch.reexec_with + " (" + why + "); keeping " +
                         loaded);
  }
  const GemmCheckResult r = check_openblas_gemm();
  if (!r.ok) {
    m.failed.push_back(loaded);
    std::string w = "OpenBLAS's " + loaded + " kernels failed the start-up GEMM check: " + r.detail;
    const std::optional<std::string> next = dynamic ? next_weaker_set(loaded, cpu, library_has_set, m.failed)
                                                    : std::nullopt;
    if (next && m.reexecs < kMaxReexecs) {
      m.warnings.push_back(w + "; falling back to " + *next);
      std::string why;
      reexec_with(*next, m, argv, &why);
      m.warnings.back() += " failed: " + why;
    }
    s.usable = false;
    std::string tried;
    for (auto& f : m.failed) tried += (tried.empty() ? "" : ", ") + f;
    s.error = w + "; no other kernel set is left to try (failed: " + tried +
              "). Set OPENBLAS_CORETYPE to a kernel set that works here, or install another OpenBLAS release";
  }
  s.corename = loaded;
  s.notes = m.notes;
  s.warnings = m.warnings;
  // Why this set.
  std::string failed_sets;
  for (auto& f : m.failed)
    if (!ieq(f, loaded)) failed_sets += (failed_sets.empty() ? "" : ", ") + f;
  if (m.user && ieq(*m.user, loaded)) s.how = "set by OPENBLAS_CORETYPE";
  else if (m.user) s.how = "OPENBLAS_CORETYPE=" + *m.user + " not used";
  else if (!dynamic) s.how = "the one kernel set of this OpenBLAS build";
  else if (ieq(m.pick, loaded)) s.how = "OpenBLAS's own choice";
  else s.how = "chosen from the CPU's features";
  if (!failed_sets.empty()) s.how += " after " + failed_sets + " failed the GEMM check";
  if (!m.pick.empty() && !ieq(m.pick, loaded)) s.how += ", OpenBLAS alone picked " + m.pick;
  if (s.usable) s.how += "; GEMM check passed";
  return s;
}

std::string blas_report(Comm& comm, std::vector<std::string>* lines) {
  const BlasSelection& s = blas_selection();
  all_ok(comm, s.usable, s.error);
  // Every rank's kernel set.
  constexpr size_t kRec = 64;
  std::string me = s.corename.substr(0, kRec - 1);
  me.resize(kRec, '\0');
  std::vector<char> all(kRec * static_cast<size_t>(comm.world_size()));
  comm.all_gather(me.data(), all.data(), kRec);
  std::vector<std::string> names;
  for (int r = 0; r < comm.world_size(); ++r) names.emplace_back(all.data() + r * kRec);
  std::string text = s.library + " (" + s.build + ") with " + s.corename + " kernels (" + s.how + ")";
  std::vector<bool> done(names.size(), false);
  for (size_t r = 1; r < names.size(); ++r) {
    if (done[r] || names[r] == names[0]) continue;
    std::vector<int> group;
    for (size_t q = r; q < names.size(); ++q)
      if (names[q] == names[r]) {
        group.push_back(static_cast<int>(q));
        done[q] = true;
      }
    text += "; " + rank_list(group) + " use" + (group.size() == 1 ? "s " : " ") + names[r];
  }
  // Notes and warnings: rank 0's, plus those of the first rank whose differ.
  std::string mine;
  for (auto& n : s.notes) mine += "note: " + n + "\n";
  for (auto& w : s.warnings) mine += "warning: " + w + "\n";
  const std::vector<int> odd = ranks_differing_from_root(comm, fnv1a64(mine));
  std::string other = odd.empty() ? std::string() : comm.broadcast_string(mine, odd.front());
  if (lines) {
    std::istringstream is(mine);
    std::string l;
    while (std::getline(is, l)) lines->push_back(l + (odd.empty() || comm.world_size() == 1 ? "" : " (rank 0)"));
    std::istringstream os(other);
    while (std::getline(os, l)) lines->push_back(l + " (" + rank_list({odd.front()}) + ")");
    if (odd.size() > 1)
      lines->push_back("note: " + rank_list(std::vector<int>(odd.begin() + 1, odd.end())) +
                       " also differ from rank 0 in their BLAS start-up notes");
  }
  return text;
}

}  // namespace shardtrain
