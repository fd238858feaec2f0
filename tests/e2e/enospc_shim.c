// Test-only LD_PRELOAD shim (tests/e2e/test_checkpoint_diskfull.sh): a small disk for the files
// under one directory, where mounting a small tmpfs is not permitted. Compiled by the test with
// `cc -shared -fPIC -o enospc_shim.so enospc_shim.c -ldl`.
//
//   ENOSPC_SHIM_DIR    directory (absolute, resolved); only writes to files under it are checked
//   ENOSPC_SHIM_LIMIT  bytes: the disk's size as seen by the checked files. A write or fallocate
//                      that would take a file's allocated blocks (st_blocks) past it fails with
//                      ENOSPC; a write inside blocks the file already holds (written, or reserved
//                      by fallocate) needs no new ones and succeeds, as on a real disk.
//   ENOSPC_SHIM_RANK   if set, only the process with this OMPI_COMM_WORLD_RANK is affected
//   ENOSPC_SHIM_IGNORE_RESERVATION=1  writes past the limit fail even inside reserved blocks (a
//                      file system that does not honour fallocate, or a rank that hits a quota)
//
// I/O errors other than a full disk (EIO: a failing device, a lost connection to a server):
//   ENOSPC_SHIM_ERRNO  the errno a failing write returns instead of ENOSPC: a number or one of EIO,
//                      EDQUOT, ENOSPC, EROFS, EFBIG. With it set, ENOSPC_SHIM_LIMIT may be left out
//                      (then it is 0: every write considered fails), and a write fails whether or
//                      not it lands in reserved blocks (an I/O error is not about space).
//   ENOSPC_SHIM_MAX_BYTES  only writes of at most this many bytes can fail (HDF5's metadata: the
//                      superblock, object headers, heaps, B-trees, each a few hundred bytes or KiB)
//   ENOSPC_SHIM_MIN_BYTES  only writes of at least this many bytes can fail (tensor data)
//   ENOSPC_SHIM_OFFSET=A-B  only writes starting at a byte offset in [A, B) can fail (HDF5 puts its
//                      superblock and root group in a checkpoint's first 2 KiB and writes them only
//                      when the file is closed: 0-2048 selects the metadata flush of the close)
//   ENOSPC_SHIM_NAME   only files whose path contains this can fail (".step_": the checkpoint being
//                      written, ".step_N.h5.<host>.<pid>.tmp", not `latest` or the directory probe)
//   ENOSPC_SHIM_SKIP   the first this many writes that would fail succeed instead (counted per
//                      process), so a failure can be placed later in the save
// fallocate is never failed with an errno other than ENOSPC (a reservation either gets the space
// or not). With ENOSPC_SHIM_TRACE=FILE every write to a checked file is appended to FILE (rank, call,
// offset, length, failed or not), to see which writes are metadata.
//
// The files' own allocation is the only state, so the processes of a job see one disk, and a file
// truncated by one of them frees space for all. Interposes write, pwrite, pwritev (and their 64
// and writev variants), fallocate and posix_fallocate.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static int g_init, g_active, g_ignore_reservation, g_errno = ENOSPC, g_trace = -1;
static char g_dir[4096];
static const char* g_rank = "-";
static long long g_limit, g_min_bytes, g_max_bytes = -1, g_skip, g_off_lo = 0, g_off_hi = -1;
static const char* g_name;

static void init(void) {
  if (g_init) return;
  g_init = 1;
  const char* d = getenv("ENOSPC_SHIM_DIR");
  const char* l = getenv("ENOSPC_SHIM_LIMIT");
  const char* r = getenv("ENOSPC_SHIM_RANK");
  const char* me = getenv("OMPI_COMM_WORLD_RANK");
  const char* en = getenv("ENOSPC_SHIM_ERRNO");
  if (!d || (!l && !(en && *en))) return;
  if (r && *r && (!me || strcmp(r, me) != 0)) return;
  snprintf(g_dir, sizeof g_dir, "%s/", d);
  g_limit = l ? atoll(l) : 0;
  const char* ig = getenv("ENOSPC_SHIM_IGNORE_RESERVATION");
  g_ignore_reservation = ig && strcmp(ig, "1") == 0;
  if (en && *en) {
    g_errno = !strcmp(en, "EIO") ? EIO : !strcmp(en, "EDQUOT") ? EDQUOT : !strcmp(en, "ENOSPC") ? ENOSPC
            : !strcmp(en, "EROFS") ? EROFS : !strcmp(en, "EFBIG") ? EFBIG : atoi(en);
    if (g_errno <= 0) g_errno = EIO;
    if (g_errno != ENOSPC) g_ignore_reservation = 1;
  }
  const char* mn = getenv("ENOSPC_SHIM_MIN_BYTES");
  const char* mx = getenv("ENOSPC_SHIM_MAX_BYTES");
  const char* sk = getenv("ENOSPC_SHIM_SKIP");
  if (mn && *mn) g_min_bytes = atoll(mn);
  if (mx && *mx) g_max_bytes = atoll(mx);
  if (sk && *sk) g_skip = atoll(sk);
  const char* of = getenv("ENOSPC_SHIM_OFFSET");
  if (of && *of && sscanf(of, "%lld-%lld", &g_off_lo, &g_off_hi) != 2) g_off_lo = 0, g_off_hi = -1;
  const char* nm = getenv("ENOSPC_SHIM_NAME");
  if (nm && *nm) g_name = nm;
  if (me) g_rank = me;
  const char* tr = getenv("ENOSPC_SHIM_TRACE");
  if (tr && *tr) g_trace = open(tr, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  g_active = 1;
}

// 1 if the write of `len` bytes at `off` to `fd` must fail (with g_errno; a fallocate: ENOSPC).
static int full_(int fd, off_t off, size_t len, int is_fallocate, const char* call) {
  init();
  if (!g_active || len == 0) return 0;
  char link[64], path[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, path, sizeof path - 1);
  if (n <= 0) return 0;
  path[n] = 0;
  if (strncmp(path, g_dir, strlen(g_dir)) != 0) return 0;
  if (g_name && !strstr(path + strlen(g_dir), g_name)) return 0;
  struct stat st;
  if (fstat(fd, &st) != 0) return 0;
  const long long alloc = (long long)st.st_blocks * 512;
  int f;
  if (is_fallocate && g_errno != ENOSPC) f = 0;
  else if (!is_fallocate && ((long long)len < g_min_bytes || (g_max_bytes >= 0 && (long long)len > g_max_bytes))) f = 0;
  else if (!is_fallocate && g_off_hi >= 0 && (off < g_off_lo || off >= g_off_hi)) f = 0;
  else if (!is_fallocate && !g_ignore_reservation && off >= 0 && (long long)off + (long long)len <= alloc) f = 0;
  else f = alloc + (long long)len > g_limit;
  if (f && !is_fallocate && g_skip > 0) {
    --g_skip;
    f = 0;
  }
  if (g_trace >= 0) {
    char line[256];
    int n = snprintf(line, sizeof line, "rank %s %s off %lld len %zu%s\n", g_rank, call, (long long)off, len, f ? " FAILED" : "");
    if (n > 0) (void)!write(g_trace, line, (size_t)n);  // (the shim's own write: not checked, g_trace is outside g_dir)
  }
  return f;
}

static int full(int fd, off_t off, size_t len, int is_fallocate, const char* call) {
  const int saved = errno;  // (lseek on a pipe, readlink: the caller's errno must survive a pass)
  const int f = full_(fd, off, len, is_fallocate, call);
  errno = saved;
  return f;
}

#define REAL(name, ret, ...)                                 \
  static ret (*real_##name)(__VA_ARGS__);                    \
  if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

static size_t iov_len(const struct iovec* iov, int n) {
  size_t s = 0;
  for (int i = 0; i < n; ++i) s += iov[i].iov_len;
  return s;
}

ssize_t write(int fd, const void* buf, size_t count) {
  REAL(write, ssize_t, int, const void*, size_t);
  if (full(fd, lseek(fd, 0, SEEK_CUR), count, 0, "write")) { errno = g_errno; return -1; }
  return real_write(fd, buf, count);
}
ssize_t writev(int fd, const struct iovec* iov, int n) {
  REAL(writev, ssize_t, int, const struct iovec*, int);
  if (full(fd, lseek(fd, 0, SEEK_CUR), iov_len(iov, n), 0, "writev")) { errno = g_errno; return -1; }
  return real_writev(fd, iov, n);
}
ssize_t pwrite(int fd, const void* buf, size_t count, off_t off) {
  REAL(pwrite, ssize_t, int, const void*, size_t, off_t);
  if (full(fd, off, count, 0, "pwrite")) { errno = g_errno; return -1; }
  return real_pwrite(fd, buf, count, off);
}
ssize_t pwrite64(int fd, const void* buf, size_t count, off_t off) {
  REAL(pwrite64, ssize_t, int, const void*, size_t, off_t);
  if (full(fd, off, count, 0, "pwrite64")) { errno = g_errno; return -1; }
  return real_pwrite64(fd, buf, count, off);
}
ssize_t pwritev(int fd, const struct iovec* iov, int n, off_t off) {
  REAL(pwritev, ssize_t, int, const struct iovec*, int, off_t);
  if (full(fd, off, iov_len(iov, n), 0, "pwritev")) { errno = g_errno; return -1; }
  return real_pwritev(fd, iov, n, off);
}
ssize_t pwritev64(int fd, const struct iovec* iov, int n, off_t off) {
  REAL(pwritev64, ssize_t, int, const struct iovec*, int, off_t);
  if (full(fd, off, iov_len(iov, n), 0, "pwritev64")) { errno = g_errno; return -1; }
  return real_pwritev64(fd, iov, n, off);
}
int fallocate(int fd, int mode, off_t off, off_t len) {
  REAL(fallocate, int, int, int, off_t, off_t);
  if (full(fd, off, (size_t)len, 1, "fallocate")) { errno = ENOSPC; return -1; }
  return real_fallocate(fd, mode, off, len);
}
int fallocate64(int fd, int mode, off_t off, off_t len) {
  REAL(fallocate64, int, int, int, off_t, off_t);
  if (full(fd, off, (size_t)len, 1, "fallocate64")) { errno = ENOSPC; return -1; }
  return real_fallocate64(fd, mode, off, len);
}
int posix_fallocate(int fd, off_t off, off_t len) {
  REAL(posix_fallocate, int, int, off_t, off_t);
  if (full(fd, off, (size_t)len, 1, "posix_fallocate")) return ENOSPC;
  return real_posix_fallocate(fd, off, len);
}
int posix_fallocate64(int fd, off_t off, off_t len) {
  REAL(posix_fallocate64, int, int, off_t, off_t);
  if (full(fd, off, (size_t)len, 1, "posix_fallocate64")) return ENOSPC;
  return real_posix_fallocate64(fd, off, len);
}
