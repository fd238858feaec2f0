// Fatal-signal report (issue 39): on SIGSEGV, SIGBUS, SIGFPE or SIGILL, the faulting thread's
// backtrace with the job's rank, the signal and the fault address on stderr, then death by the same
// signal (its default action), so launchers and job scripts see what they saw before.
//
// Everything the handler does is async-signal-safe: write(2), backtrace() (libgcc is loaded at
// install time by a first call, so the handler never runs the dynamic loader) and
// backtrace_symbols_fd() (writes, no malloc). It runs on an alternate stack (sigaltstack) on the
// thread that installed it (the main thread), so that a stack overflow there is reported too.
//
// Open MPI: MPI_Init installs its own handler for the signals of the MCA parameter opal_signal
// (default 6,7,8,11) unless a handler is already installed ("Open MPI will *not* replace signals if
// handlers are already installed by the time MPI_INIT is invoked", ompi_info --param opal base
// --level 3). main() installs this one before MPI_Init, so it stays; fatal_signal_mpi_ready() checks
// after MPI_Init and re-installs it where a library replaced it, saying so.
#include "shardtrain/runtime/runtime.h"

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace shardtrain {
namespace {

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
constexpr size_t kAltStackBytes = 256 * 1024;
alignas(64) char g_alt_stack[kAltStackBytes];

// What the handler prints, fixed before it can run (no getenv or allocation in the handler).
std::atomic<int> g_rank{-1};
std::atomic<int> g_world{0};
std::atomic<const char*> g_rank_source{""};  // the variable the rank came from before MPI_Init; "" after
char g_host[64] = "?";
std::atomic<int> g_reporting{0};

// ---- async-signal-safe output ----
struct Out {
  char buf[1024];
  size_t n = 0;
  void s(const char* t) {
    while (*t && n < sizeof buf) buf[n++] = *t++;
  }
  void u(uint64_t v) {
    char d[24];
    int k = 0;
    do {
      d[k++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v);
    while (k && n < sizeof buf) buf[n++] = d[--k];
  }
  void i(int64_t v) {
    if (v < 0) {
      s("-");
      u(static_cast<uint64_t>(-(v + 1)) + 1);
    } else {
      u(static_cast<uint64_t>(v));
    }
  }
  void x(uintptr_t v) {
    s("0x");
    char d[20];
    int k = 0;
    do {
      d[k++] = "0123456789abcdef"[v & 15];
      v >>= 4;
    } while (v);
    while (k && n < sizeof buf) buf[n++] = d[--k];
  }
  void flush() {
    size_t off = 0;
    while (off < n) {
      ssize_t w = ::write(2, buf + off, n - off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    n = 0;
  }
};

const char* sig_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV (segmentation fault)";
    case SIGBUS: return "SIGBUS (bus error)";
    case SIGFPE: return "SIGFPE (arithmetic exception)";
    case SIGILL: return "SIGILL (illegal instruction)";
  }
  return "signal";
}

const char* code_name(int sig, int code) {
  if (code <= 0) return "sent by a process (kill, raise), not a fault";
  switch (sig) {
    case SIGSEGV:
      if (code == SEGV_MAPERR) return "SEGV_MAPERR: address not mapped";
      if (code == SEGV_ACCERR) return "SEGV_ACCERR: no permission for the access";
      break;
    case SIGBUS:
      if (code == BUS_ADRALN) return "BUS_ADRALN: misaligned address";
      if (code == BUS_ADRERR) return "BUS_ADRERR: no such physical address (e.g. past the end of a mapped file)";
      if (code == BUS_OBJERR) return "BUS_OBJERR: object-specific hardware error";
      break;
    case SIGFPE:
      if (code == FPE_INTDIV) return "FPE_INTDIV: integer division by zero";
      if (code == FPE_INTOVF) return "FPE_INTOVF: integer overflow";
      if (code == FPE_FLTDIV) return "FPE_FLTDIV: floating-point division by zero";
      if (code == FPE_FLTINV) return "FPE_FLTINV: invalid floating-point operation";
      break;
    case SIGILL:
      if (code == ILL_ILLOPC) return "ILL_ILLOPC: illegal opcode";
      if (code == ILL_ILLOPN) return "ILL_ILLOPN: illegal operand";
      if (code == ILL_PRVOPC) return "ILL_PRVOPC: privileged opcode";
      break;
  }
  return "code";
}

// "shardtrain: fatal [rank 3/8] " (the prefix of every line, so that interleaved ranks stay apart).
void prefix(Out& o, const char* what = "fatal") {
  o.s("shardtrain: ");
  o.s(what);
  o.s(" [rank ");
  const int r = g_rank.load();
  if (r >= 0) o.i(r);
  else o.s("?");
  const int w = g_world.load();
  if (w > 0) {
    o.s("/");
    o.i(w);
  }
  o.s("] ");
}

// Whether the page holding address a is mapped (mincore(2): ENOMEM for an unmapped range).
uintptr_t g_page = 4096;  // sysconf(_SC_PAGESIZE), read at install time
bool page_mapped(uintptr_t a) {
  const uintptr_t page = g_page;
  unsigned char v = 0;
  return a >= page && mincore(reinterpret_cast<void*>(a & ~(page - 1)), page, &v) == 0;
}

// The instruction pointer and stack pointer of the interrupted context.
uintptr_t* ctx_pc(void* uc) {
#if defined(__x86_64__)
  return reinterpret_cast<uintptr_t*>(&static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
  return reinterpret_cast<uintptr_t*>(&static_cast<ucontext_t*>(uc)->uc_mcontext.pc);
#else
  (void)uc;
  return nullptr;
#endif
}

// The report's first line: the signal, process, host, thread (id, name, main or not) and where the
// rank came from; without its newline. Async-signal-safe, as report.
void report_process(Out& o, int sig) {
  prefix(o);
  o.s(sig_name(sig));
  o.s(" in process ");
  o.i(getpid());
  o.s(" on ");
  o.s(g_host);
  const long tid = syscall(SYS_gettid);
  o.s(", thread ");
  o.i(tid);
  {  // the thread's name (OpenBLAS, Open MPI, PMIx and our own threads differ): /proc, read(2)
    char comm[32] = {0};
    const int fd = ::open("/proc/thread-self/comm", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      const ssize_t k = ::read(fd, comm, sizeof comm - 1);
      ::close(fd);
      if (k > 0) {
        comm[k] = 0;
        for (ssize_t j = 0; j < k; ++j)
          if (comm[j] == '\n') comm[j] = 0;
        o.s(" '");
        o.s(comm);
        o.s("'");
      }
    }
  }
  o.s(tid == getpid() ? " (the main thread)" : " (not the main thread)");
  if (const char* src = g_rank_source.load(); src && *src) {
    o.s("; rank from ");
    o.s(src);
    o.s(", before MPI_Init completed");
  }
}

// The note on a fault at a null or unmapped instruction address, whose backtrace starts at the
// return address ret_addr. Async-signal-safe, as report.
void report_redirected_pc(Out& o, bool null_call, uintptr_t ret_addr) {
  prefix(o);
  o.s(null_call ? "the instruction address is in the null page: a call through a null function pointer"
                : "the instruction address is in no mapping: a call through a dangling function pointer (e.g. into "
                  "an unloaded library)");
  o.s(" (or a return to a corrupted address); the backtrace starts at the return address on the stack, ");
  o.x(ret_addr);
  o.s(" (the frame after the signal frame)\n");
  o.flush();
}

void report(int sig, siginfo_t* si, void* uc) {
  Out o;
  report_process(o, sig);
  o.s("\n");
  o.flush();
  prefix(o);
  o.s("fault address ");
  o.x(reinterpret_cast<uintptr_t>(si ? si->si_addr : nullptr));
  o.s(" (");
  o.s(code_name(sig, si ? si->si_code : 0));
  if (si && si->si_code > 0) {
    o.s(" [");
    o.i(si->si_code);
    o.s("]");
  }
  o.s(")");
  uintptr_t* pc = uc ? ctx_pc(uc) : nullptr;
  uintptr_t saved_pc = 0;
#if defined(__x86_64__)
  uintptr_t* sp = uc ? reinterpret_cast<uintptr_t*>(&static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_RSP]) : nullptr;
  uintptr_t saved_sp = sp ? *sp : 0;
#endif
  bool null_call = false, wild_pc = false;
  uintptr_t ret_addr = 0;
  if (pc) {
    saved_pc = *pc;
    o.s(", instruction at ");
    o.x(saved_pc);
    // A call through a null (or tiny) function pointer, or a dangling one (into a library no longer
    // mapped): the instruction pointer is in no mapping. The unwinder finds no frame there (and its
    // fallback would read the code at that address, faulting again inside this handler); the caller
    // is one return away.
    null_call = sig == SIGSEGV && saved_pc < 4096;
    wild_pc = !null_call && (sig == SIGSEGV || sig == SIGBUS) && !page_mapped(saved_pc);
    if (null_call || wild_pc) {
#if defined(__x86_64__)
      if (sp && page_mapped(saved_sp)) {  // `call` pushed the return address: pretend the callee returned at once
        ret_addr = *reinterpret_cast<uintptr_t*>(saved_sp);
        *pc = ret_addr;
        *sp = saved_sp + sizeof(uintptr_t);
      }
#elif defined(__aarch64__)
      ret_addr = static_cast<ucontext_t*>(uc)->uc_mcontext.regs[30];  // the link register
      *pc = ret_addr;
#endif
    }
  }
  o.s("\n");
  o.flush();
  if (null_call || wild_pc) report_redirected_pc(o, null_call, ret_addr);
  prefix(o);
  o.s("backtrace of the faulting thread (addresses as +0xOFFSET in a file: addr2line -Cfie FILE 0xOFFSET; names: c++filt):\n");
  o.flush();
  void* frames[64];
  const int n = backtrace(frames, 64);
  // Frame 0 is this handler (report, inlined or not, and on_fatal_signal): from its caller on.
  // Each frame's line is one write(2), so that the reports of ranks sharing a terminal or a job log
  // do not interleave inside a line: backtrace_symbols_fd writes the symbol into a pipe, read back.
  int pfd[2] = {-1, -1};
  const bool piped = pipe2(pfd, O_CLOEXEC | O_NONBLOCK) == 0;
  for (int k = 1; k < n; ++k) {
    prefix(o);
    o.s("  #");
    o.i(k - 1);
    o.s(" ");
    if (!piped) {
      o.flush();
      backtrace_symbols_fd(&frames[k], 1, 2);
      continue;
    }
    backtrace_symbols_fd(&frames[k], 1, pfd[1]);
    char line[768];
    ssize_t got = 0, r;
    while (got < static_cast<ssize_t>(sizeof line) - 1 &&
           (r = ::read(pfd[0], line + got, sizeof line - 1 - static_cast<size_t>(got))) > 0)
      got += r;
    line[got] = 0;
    o.s(line);  // ends with the newline backtrace_symbols_fd wrote
    if (got == 0 || line[got - 1] != '\n') o.s("\n");
    o.flush();
  }
  if (piped) {
    ::close(pfd[0]);
    ::close(pfd[1]);
  }
  prefix(o);
  o.s("end of backtrace; ending the process with ");
  o.s(sig_name(sig));
  o.s(" (its default action)\n");
  o.flush();
  if (pc) *pc = saved_pc;
#if defined(__x86_64__)
  if (sp) *sp = saved_sp;
#endif
}

extern "C" void on_fatal_signal(int sig, siginfo_t* si, void* uc) {
  const int saved_errno = errno;
  if (g_reporting.exchange(1) != 0) {
    // Another thread is reporting (or this one faulted inside the report: then the kernel ended the
    // process, since the signal is blocked here). Wait for that report to end the process.
    for (;;) pause();
  }
  // A report that hangs (a fault inside the dynamic loader's lock, say) must not hang the job.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGALRM, &dfl, nullptr);
  alarm(10);
  report(sig, si, uc);
  // Death by the same signal: the default action, delivered as soon as it is unblocked.
  sigaction(sig, &dfl, nullptr);
  raise(sig);
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, sig);
  pthread_sigmask(SIG_UNBLOCK, &s, nullptr);
  errno = saved_errno;
  _exit(128 + sig);  // not reached
}

void install_handlers() {
  struct sigaction sa {};
  sa.sa_sigaction = on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  for (int s : kFatalSignals) sigaddset(&sa.sa_mask, s);  // one report at a time on this thread
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (int s : kFatalSignals) sigaction(s, &sa, nullptr);
}

bool handler_installed(int sig) {
  struct sigaction cur {};
  if (sigaction(sig, nullptr, &cur) != 0) return false;
  return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_fatal_signal;
}

// ---- test hook: SHARDTRAIN_TEST_FATAL_SIGNAL=WHAT[:RANK][:pre] ----
struct Injection {
  std::string what;
  int rank = -1;      // -1: every rank
  bool pre = false;   // before MPI_Init (rank from the launcher's environment) instead of after
  bool valid = false;
};

Injection parse_injection() {
  Injection in;
  const char* e = std::getenv("SHARDTRAIN_TEST_FATAL_SIGNAL");
  if (!e || !*e) return in;
  std::string v = e;
  std::string parts[3];
  int np = 0;
  size_t a = 0;
  while (np < 3) {
    const size_t c = v.find(':', a);
    parts[np++] = v.substr(a, c == std::string::npos ? std::string::npos : c - a);
    if (c == std::string::npos) break;
    a = c + 1;
    if (np == 3) return in;  // too many fields
  }
  in.what = parts[0];
  if (in.what != "SIGSEGV" && in.what != "SIGBUS" && in.what != "SIGFPE" && in.what != "SIGILL" &&
      in.what != "NULLCALL" && in.what != "WILDCALL" && in.what != "STACKOVERFLOW")
    return in;
  for (int k = 1; k < np; ++k) {
    const std::string& p = parts[k];
    if (p == "pre") {
      in.pre = true;
    } else if (!p.empty() && p.size() <= 6 && p.find_first_not_of("0123456789") == std::string::npos) {
      in.rank = std::atoi(p.c_str());
    } else {
      return in;
    }
  }
  in.valid = true;
  return in;
}

}  // namespace

// The injected faults: external functions, kept out of line, so that the backtrace names them.
__attribute__((noinline)) void fatal_signal_test_segv() {
  volatile int* volatile p = nullptr;  // both volatile: neither the pointer nor the store is optimised away
  *p = 1;
}
__attribute__((noinline)) void fatal_signal_test_null_call() {
  void (*volatile f)() = nullptr;
  f();
  asm volatile("" ::: "memory");  // not a tail call: this frame stays on the stack
}
__attribute__((noinline)) void fatal_signal_test_wild_call() {
  // A function pointer into a page that is no longer mapped (as after a library was unloaded).
  void* m = mmap(nullptr, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return;
  munmap(m, 4096);
  void (*volatile f)() = reinterpret_cast<void (*)()>(static_cast<char*>(m) + 16);
  f();
  asm volatile("" ::: "memory");  // not a tail call: this frame stays on the stack
}
__attribute__((noinline)) void fatal_signal_test_bus() {
  // A page of a file that has no bytes: reading it is SIGBUS (BUS_ADRERR).
  const int fd = memfd_create("shardtrain-test-sigbus", MFD_CLOEXEC);
  if (fd < 0) return;
  void* m = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return;
  volatile char c = *static_cast<volatile char*>(m);
  (void)c;
}
__attribute__((noinline)) void fatal_signal_test_fpe() {
  volatile int one = 1, zero = 0;  // an idiv: with a constant numerator the compiler avoids the division
  volatile int r = one / zero;
  (void)r;
}
__attribute__((noinline)) void fatal_signal_test_ill() { __builtin_trap(); }
volatile int g_recurse_limit = -1;  // never reached: the recursion ends in the stack's guard page
__attribute__((noinline)) int fatal_signal_test_recurse(int depth) {
  volatile char pad[4096];
  pad[0] = static_cast<char>(depth);
  if (depth == g_recurse_limit) return pad[0];
  return fatal_signal_test_recurse(depth + 1) + pad[0];
}

namespace {
void maybe_inject(bool pre) {
  const Injection in = parse_injection();
  if (!in.valid || in.pre != pre) return;
  if (in.rank >= 0 && in.rank != g_rank.load()) return;
  if (in.what == "SIGSEGV") fatal_signal_test_segv();
  else if (in.what == "NULLCALL") fatal_signal_test_null_call();
  else if (in.what == "WILDCALL") fatal_signal_test_wild_call();
  else if (in.what == "SIGBUS") fatal_signal_test_bus();
  else if (in.what == "SIGFPE") fatal_signal_test_fpe();
  else if (in.what == "SIGILL") fatal_signal_test_ill();
  else if (in.what == "STACKOVERFLOW") fatal_signal_test_recurse(0);
}
}  // namespace

void install_fatal_signal_handlers() {
  // The rank before MPI_Init, from the launcher: mpirun (OMPI_COMM_WORLD_RANK), PMIx (srun
  // --mpi=pmix and mpirun: PMIX_RANK), Slurm (SLURM_PROCID).
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"}) {
    const char* e = std::getenv(v);
    if (e && *e && std::strspn(e, "0123456789") == std::strlen(e) && std::strlen(e) <= 7) {
      g_rank.store(std::atoi(e));
      g_rank_source.store(v);
      break;
    }
  }
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"}) {
    const char* e = std::getenv(v);
    if (e && *e && std::strspn(e, "0123456789") == std::strlen(e) && std::strlen(e) <= 7) {
      g_world.store(std::atoi(e));
      break;
    }
  }
  if (const long ps = sysconf(_SC_PAGESIZE); ps > 0) g_page = static_cast<uintptr_t>(ps);
  if (gethostname(g_host, sizeof g_host - 1) != 0) std::strcpy(g_host, "?");
  g_host[sizeof g_host - 1] = 0;
  {  // load libgcc's unwinder now: the first backtrace() dlopen()s it, which a handler must not do
    void* f[2];
    (void)backtrace(f, 2);
  }
  stack_t ss {};
  ss.ss_sp = g_alt_stack;
  ss.ss_size = kAltStackBytes;
  ss.ss_flags = 0;
  sigaltstack(&ss, nullptr);
  install_handlers();
  maybe_inject(true);
}

void fatal_signal_mpi_ready(int rank, int world) {
  g_world.store(world);
  g_rank.store(rank);
  g_rank_source.store("");
  bool replaced = false;
  for (int s : kFatalSignals) replaced = replaced || !handler_installed(s);
  if (replaced) {
    install_handlers();
    Out o;
    prefix(o, "note");
    o.s("a library replaced shardtrain's fatal-signal handler during MPI_Init; re-installed it\n");
    o.flush();
  }
  maybe_inject(false);
}

}  // namespace shardtrain
