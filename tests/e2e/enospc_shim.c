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

static int g_init, g_active, g_ignore_reservation;
static char g_dir[4096];
static long long g_limit;

static void init(void) {
  if (g_init) return;
  g_init = 1;
  const char* d = getenv("ENOSPC_SHIM_DIR");
  const char* l = getenv("ENOSPC_SHIM_LIMIT");
  const char* r = getenv("ENOSPC_SHIM_RANK");
  const char* me = getenv("OMPI_COMM_WORLD_RANK");
  if (!d || !l) return;
  if (r && *r && (!me || strcmp(r, me) != 0)) return;
  snprintf(g_dir, sizeof g_dir, "%s/", d);
  g_limit = atoll(l);
  const char* ig = getenv("ENOSPC_SHIM_IGNORE_RESERVATION");
  g_ignore_reservation = ig && strcmp(ig, "1") == 0;
  g_active = 1;
}

// 1 if the write of `len` bytes at `off` to `fd` must fail with ENOSPC.
static int full_(int fd, off_t off, size_t len, int is_fallocate) {
  init();
  if (!g_active || len == 0) return 0;
  char link[64], path[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, path, sizeof path - 1);
  if (n <= 0) return 0;
  path[n] = 0;
  if (strncmp(path, g_dir, strlen(g_dir)) != 0) return 0;
  struct stat st;
  if (fstat(fd, &st) != 0) return 0;
  const long long alloc = (long long)st.st_blocks * 512;
  if (!is_fallocate && !g_ignore_reservation && off >= 0 && (long long)off + (long long)len <= alloc) return 0;
  return alloc + (long long)len > g_limit;
}

static int full(int fd, off_t off, size_t len, int is_fallocate) {
  const int saved = errno;  // (lseek on a pipe, readlink: the caller's errno must survive a pass)
  const int f = full_(fd, off, len, is_fallocate);
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
  if (full(fd, lseek(fd, 0, SEEK_CUR), count, 0)) { errno = ENOSPC; return -1; }
  return real_write(fd, buf, count);
}
ssize_t writev(int fd, const struct iovec* iov, int n) {
  REAL(writev, ssize_t, int, const struct iovec*, int);
  if (full(fd, lseek(fd, 0, SEEK_CUR), iov_len(iov, n), 0)) { errno = ENOSPC; return -1; }
  return real_writev(fd, iov, n);
}
ssize_t pwrite(int fd, const void* buf, size_t count, off_t off) {
  REAL(pwrite, ssize_t, int, const void*, size_t, off_t);
  if (full(fd, off, count, 0)) { errno = ENOSPC; return -1; }
  return real_pwrite(fd, buf, count, off);
}
ssize_t pwrite64(int fd, const void* buf, size_t count, off_t off) {
  REAL(pwrite64, ssize_t, int, const void*, size_t, off_t);
  if (full(fd, off, count, 0)) { errno = ENOSPC; return -1; }
  return real_pwrite64(fd, buf, count, off);
}
ssize_t pwritev(int fd, const struct iovec* iov, int n, off_t off) {
  REAL(pwritev, ssize_t, int, const struct iovec*, int, off_t);
  if (full(fd, off, iov_len(iov, n), 0)) { errno = ENOSPC; return -1; }
  return real_pwritev(fd, iov, n, off);
}
ssize_t pwritev64(int fd, const struct iovec* iov, int n, off_t off) {
  REAL(pwritev64, ssize_t, int, const struct iovec*, int, off_t);
  if (full(fd, off, iov_len(iov, n), 0)) { errno = ENOSPC; return -1; }
  return real_pwritev64(fd, iov, n, off);
}
int fallocate(int fd, int mode, off_t off, off_t len) {
  REAL(fallocate, int, int, int, off_t, off_t);
  if (full(fd, off, (size_t)len, 1)) { errno = ENOSPC; return -1; }
  return real_fallocate(fd, mode, off, len);
}
int fallocate64(int fd, int mode, off_t off, off_t len) {
  REAL(fallocate64, int, int, int, off_t, off_t);
  if (full(fd, off, (size_t)len, 1)) { errno = ENOSPC; return -1; }
  return real_fallocate64(fd, mode, off, len);
}
int posix_fallocate(int fd, off_t off, off_t len) {
  REAL(posix_fallocate, int, int, off_t, off_t);
  if (full(fd, off, (size_t)len, 1)) return ENOSPC;
  return real_posix_fallocate(fd, off, len);
}
int posix_fallocate64(int fd, off_t off, off_t len) {
  REAL(posix_fallocate64, int, int, off_t, off_t);
  if (full(fd, off, (size_t)len, 1)) return ENOSPC;
  return real_posix_fallocate64(fd, off, len);
}
