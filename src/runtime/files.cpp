// write_file_atomic: temp file, flush, optional fsync, rename; crc32_update: libdeflate's CRC-32.
#include "shardtrain/runtime/files.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <libdeflate.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <cstdlib>

namespace shardtrain {

uint32_t crc32_update(uint32_t crc, const void* p, size_t bytes) {
  // libdeflate's CRC-32 is zlib's (same polynomial, initial value and final xor; size_t length),
  // carry-less-multiply (PCLMULQDQ) code where the CPU has it: ~10x zlib 1.2.13's table code, which
  // took ~0.45 s per rank of a 1.2 GB checkpoint save (docs/benchmarks.md).
  return libdeflate_crc32(crc, p, bytes);
}

namespace {

namespace fs = std::filesystem;

[[noreturn]] void refuse_inside(const std::string& dir, const std::string& name, const std::string& what,
                                const std::string& why) {
  throw std::runtime_error(what + " names '" + name + "', " + why + " of directory '" + dir +
                           "': every file read must lie inside it");
}

// path_inside's rules for the name alone: not empty, not absolute, no "..".
fs::path checked_name(const std::string& dir, const std::string& name, const std::string& what) {
  const fs::path rel(name);
  if (name.empty()) refuse_inside(dir, name, what, "an empty name, not a file");
  if (rel.is_absolute() || rel.has_root_name() || rel.has_root_directory())
    refuse_inside(dir, name, what, "an absolute path outside");
  for (const fs::path& part : rel)
    if (part == "..") refuse_inside(dir, name, what, "a path with '..', which may lead out");
  return fs::path(dir) / rel;
}

// Is `name` a hub-cache blob's name: the git (40) or SHA-256 (64) hash, in lower-case hex?
bool hub_blob_name(const std::string& name) {
  if (name.size() != 40 && name.size() != 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// Refuses `real` (a canonical path: no links, no "..") unless it lies under `top` (the directory's
// real path) or, when `top` is a hub-cache snapshot, is a blob of that repository (files.h path_inside).
// `dir` is the directory as named, for the message.
void check_real_inside(const std::string& dir, const std::string& name, const std::string& what, const fs::path& top,
                       const fs::path& real) {
  auto under = [&](const fs::path& root) {
    return std::mismatch(root.begin(), root.end(), real.begin(), real.end()).first == root.end();
  };
  if (under(top)) return;
  // huggingface_hub's cache: models--ORG--NAME/snapshots/REV/FILE is a symbolic link to
  // ../../blobs/HASH. Only that layout counts: a folder named snapshots elsewhere does not.
  const fs::path snapshots = top.parent_path(), repo = snapshots.parent_path();
  if (snapshots.filename() == "snapshots" && repo.filename().string().starts_with("models--") &&
      real.parent_path() == repo / "blobs" && hub_blob_name(real.filename().string()))
    return;
  refuse_inside(dir, name, what, "a symbolic link to '" + real.string() + "', outside");
}

// The kernel's name of open descriptor `fd` ("" where /proc is not mounted).
std::string fd_real_path(int fd) {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/fd/" + std::to_string(fd), ec);
  return ec ? std::string() : p.string();
}

}  // namespace

const char* file_kind(unsigned mode) {
  const mode_t m = static_cast<mode_t>(mode);
  return S_ISREG(m) ? "a regular file" : S_ISDIR(m) ? "a directory" : S_ISCHR(m) || S_ISBLK(m) ? "a device"
       : S_ISFIFO(m) ? "a FIFO" : S_ISSOCK(m) ? "a socket" : "not a regular file";
}

void wait_while_flag(const std::string& flag) {
  { std::ofstream(flag) << ::getpid() << "\n"; }
  for (int i = 0; i < 6000 && path_exists(flag); ++i) ::usleep(10'000);
}

std::string path_inside(const std::string& dir, const std::string& name, const std::string& what) {
  const fs::path p = checked_name(dir, name, what);
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(p, ec))) return p.string();
  const fs::path real = fs::canonical(p, ec);
  if (ec) refuse_inside(dir, name, what, "a file that cannot be resolved (a dangling symbolic link?) inside");
  const fs::path top = fs::canonical(dir, ec);
  if (ec) refuse_inside(dir, name, what, "a file that cannot be resolved inside");
  check_real_inside(dir, name, what, top, real);
  return p.string();
}

const char* pseudo_fs_name(int fd) {
  struct statfs s {};
  if (::fstatfs(fd, &s) != 0) return nullptr;
  switch (static_cast<unsigned long>(s.f_type)) {  // (f_type is signed on some ABIs)
    case PROC_SUPER_MAGIC: return "proc";
    case SYSFS_MAGIC: return "sysfs";
    case DEBUGFS_MAGIC: return "debugfs";
    case TRACEFS_MAGIC: return "tracefs";
    case SECURITYFS_MAGIC: return "securityfs";
    case CGROUP_SUPER_MAGIC: return "cgroup";
    case CGROUP2_SUPER_MAGIC: return "cgroup2";
    case BPF_FS_MAGIC: return "bpf";
    case PSTOREFS_MAGIC: return "pstore";
    case EFIVARFS_MAGIC: return "efivarfs";
    case SELINUX_MAGIC: return "selinuxfs";
    case SMACK_MAGIC: return "smackfs";
    case BINFMTFS_MAGIC: return "binfmt_misc";
    case NSFS_MAGIC: return "nsfs";
    case USBDEVICE_SUPER_MAGIC: return "usbdevfs";
    case DEVPTS_SUPER_MAGIC: return "devpts";
    default: return nullptr;
  }
}

void refuse_pseudo_fs(int fd, const std::string& named) {
  if (const char* fsname = pseudo_fs_name(fd))
    throw std::runtime_error(named + " lies on the " + fsname + " pseudo file system (as /proc and /sys), whose "
                             "files the kernel makes up when read (their size says nothing): give a file on disk");
}

InputFile InputFile::checked(int fd, const std::string& path, const std::string& named) {
  std::shared_ptr<const int> held(new int(fd), [](const int* p) {
    ::close(*p);
    delete p;
  });
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw std::runtime_error("cannot stat " + named + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    throw std::runtime_error(named + " is not a regular file (" + file_kind(st.st_mode) + "); give a file to read");
  refuse_pseudo_fs(fd, named);
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);  // (no effect on a regular file's reads; for clarity)
  return InputFile(path, std::move(held), static_cast<uint64_t>(st.st_size));
}

InputFile InputFile::open(const std::string& path, const std::string& what) {
  const std::string named = (what.empty() ? std::string("file") : what) + " '" + path + "'";
  // O_NONBLOCK: opening a FIFO with no writer returns at once (without it, open(2) waits for one,
  // and SA_RESTART handlers restart the wait); the descriptor is checked before any read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int e = errno;
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))  // a socket: ENXIO
      throw std::runtime_error(named + " is not a regular file (" + file_kind(st.st_mode) + "); give a file to read");
    if (e == ENOENT) throw std::runtime_error(named + ": no such file");
    throw std::runtime_error("cannot open " + named + ": " + std::strerror(e));
  }
  return checked(fd, path, named);
}

InputFile InputFile::open_inside(const std::string& dir, const std::string& name, const std::string& what) {
  return InputDir::open(dir, what).open_inside(name, what);
}

InputDir InputDir::open(const std::string& path, const std::string& what) {
  const std::string named = (what.empty() ? std::string("directory") : what) + " '" + path + "'";
  // O_PATH: nothing is read through this descriptor itself; it anchors openat and fstatat.
  const int fd = ::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    struct stat st {};
    if (e == ENOTDIR && ::stat(path.c_str(), &st) == 0)
      throw std::runtime_error(named + " is not a directory (" + file_kind(st.st_mode) + ")");
    if (e == ENOENT) throw std::runtime_error(named + ": no such directory");
    throw std::runtime_error("cannot open " + named + ": " + std::strerror(e));
  }
  std::shared_ptr<const int> held(new int(fd), [](const int* p) {
    ::close(*p);
    delete p;
  });
  refuse_pseudo_fs(fd, named);
  return InputDir(path, std::move(held));
}

std::string InputDir::real_path() const {
  std::string real = fd_real_path(*fd_);
  if (!real.empty()) return real;
  // No /proc: the name resolved now must be this very directory.
  std::error_code ec;
  real = fs::canonical(path_, ec).string();
  struct stat a {}, b {};
  if (ec || ::stat(real.c_str(), &a) != 0 || ::fstat(*fd_, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino)
    throw std::runtime_error("directory '" + path_ + "' changed while it was read (its name now leads elsewhere)");
  return real;
}

bool InputDir::has(const std::string& name, const std::string& what) const {
  (void)checked_name(path_, name, what);
  struct stat st {};
  return ::fstatat(*fd_, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
}

InputFile InputDir::open_inside(const std::string& name, const std::string& what) const {
  const fs::path p = checked_name(path_, name, what);
  test_file_pause("open", p.string());
  const std::string named = what + ": file '" + p.string() + "'";
  // First an O_PATH descriptor (links followed, but nothing opened for reading: a link to a device
  // opens no device), whose real path must lie inside and which must be a regular file; only then
  // the file itself, reopened through that descriptor (/proc/self/fd/N), so the same inode.
  int fd = -1;
  if (const int pfd = ::openat(*fd_, name.c_str(), O_PATH | O_CLOEXEC); pfd >= 0) {
    const std::shared_ptr<const int> hold(new int(pfd), [](const int* q) { ::close(*q); delete q; });
    const fs::path preal = fd_real_path(pfd);
    if (!preal.empty()) {
      refuse_pseudo_fs(pfd, named);  // fstatfs is allowed on an O_PATH descriptor
      check_real_inside(path_, name, what, real_path(), preal);
      struct stat st {};
      if (::fstat(pfd, &st) == 0 && !S_ISREG(st.st_mode))
        throw std::runtime_error(named + " is not a regular file (" + file_kind(st.st_mode) + "); give a file to read");
      fd = ::open(("/proc/self/fd/" + std::to_string(pfd)).c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    }
  }
  if (fd < 0) fd = ::openat(*fd_, name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int e = errno;
    struct stat st {};
    if (::fstatat(*fd_, name.c_str(), &st, 0) == 0 && !S_ISREG(st.st_mode))  // a socket: ENXIO
      throw std::runtime_error(named + " is not a regular file (" + file_kind(st.st_mode) + "); give a file to read");
    if (e == ENOENT) throw std::runtime_error(named + ": no such file");
    throw std::runtime_error("cannot open " + named + ": " + std::strerror(e));
  }
  InputFile f = InputFile::checked(fd, p.string(), named);
  // The file actually opened, by the kernel's name for its descriptor, against the directory's
  // own: a link swapped after any check of a name cannot bring in another file's bytes.
  const fs::path top = real_path();
  fs::path real = fd_real_path(f.fd());
  if (real.empty()) {  // no /proc: the name resolved now must be the very file opened (device and inode)
    std::error_code ec;
    real = fs::canonical(top / name, ec);
    struct stat a {}, b {};
    if (ec || ::stat(real.c_str(), &a) != 0 || ::fstat(f.fd(), &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino)
      refuse_inside(path_, name, what, "a file that changed while it was opened, inside");
  }
  check_real_inside(path_, name, what, top, real);
  return f;
}

std::string InputFile::reopen_path() const {
  const std::string self = "/proc/self/fd/" + std::to_string(*fd_);
  struct stat a {}, b {};
  if (::stat(self.c_str(), &a) == 0 && ::fstat(*fd_, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) return self;
  return path_;
}

void InputFile::read_at(void* buf, size_t n, uint64_t off) const {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(*fd_, p + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      throw std::runtime_error("cannot read " + std::to_string(n) + " bytes at byte offset " + std::to_string(off) +
                               " of '" + path_ + "': " + (r < 0 ? std::strerror(errno) : "end of file"));
    done += static_cast<size_t>(r);
  }
}

std::string InputFile::read_all(uint64_t max_bytes) const {
  if (size_ > max_bytes)
    throw std::runtime_error("'" + path_ + "' has " + std::to_string(size_) + " bytes, more than the " +
                             std::to_string(max_bytes) + " read from such a file");
  std::string s(size_, '\0');
  read_at(s.data(), s.size(), 0);
  return s;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

void test_file_pause(const char* point, const std::string& path) {
  static std::atomic<bool> done{false};
  const char* v = std::getenv("SHARDTRAIN_TEST_FILE_PAUSE");
  if (v == nullptr || done.load()) return;
  const std::string spec(v);
  const size_t a = spec.find(':'), b = a == std::string::npos ? a : spec.find(':', a + 1);
  if (b == std::string::npos) return;
  if (spec.substr(0, a) != point || spec.substr(a + 1, b - a - 1) != fs::path(path).filename().string()) return;
  if (done.exchange(true)) return;
  const std::string flag = spec.substr(b + 1);
  wait_while_flag(flag);
}

void check_output_path(const std::string& path, const std::string& what) {
  std::error_code ec;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return;
  const char* kind = file_kind(st.st_mode);
  throw std::runtime_error((what.empty() ? std::string() : what + ": ") + "'" + path + "' is " + kind +
                           "; give the name of a file to write");
}

std::string write_file_temp(const std::string& path, const std::string& bytes, bool durable, const std::string& what,
                            const std::string& tmp_suffix) {
  check_output_path(path, what);
  const std::string tmp = path + tmp_suffix;
  const std::string ctx = "'" + path + "'" + (what.empty() ? "" : " (" + what + ")");
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + ctx + ": " + std::strerror(errno));
  size_t off = 0;
  int e = 0;  // the first failure's errno
  while (e == 0 && off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n > 0) off += static_cast<size_t>(n);
    else if (n == 0) e = EIO;  // (no progress)
    else if (errno != EINTR) e = errno;
  }
  if (e == 0 && durable && ::fsync(fd) != 0) e = errno;
  if (::close(fd) != 0 && e == 0) e = errno;
  if (e != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("write failed for " + ctx + ": " + std::strerror(e));
  }
  return tmp;
}

void commit_file_temp(const std::string& tmp, const std::string& path, bool durable, const std::string& what) {
  const std::string ctx = "'" + path + "'" + (what.empty() ? "" : " (" + what + ")");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot rename '" + tmp + "' to " + ctx + ": " + std::strerror(e));
  }
  if (durable) {
    std::string dir = std::filesystem::path(path).parent_path().string();
    int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }
}

void write_file_atomic(const std::string& path, const std::string& bytes, bool durable, const std::string& what,
                       const std::string& tmp_suffix) {
  commit_file_temp(write_file_temp(path, bytes, durable, what, tmp_suffix), path, durable, what);
}

}  // namespace shardtrain
