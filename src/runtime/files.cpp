// write_file_atomic: temp file, flush, optional fsync, rename; crc32_update: libdeflate's CRC-32.
#include "shardtrain/files.h"

#include <fcntl.h>
#include <sys/stat.h>
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

// Refuses `real` (a canonical path: no links, no "..") unless it lies under canonical(dir) or, when
// dir is a hub-cache snapshot, under that repository's blobs/.
void check_real_inside(const std::string& dir, const std::string& name, const std::string& what, const fs::path& real) {
  std::error_code ec;
  const fs::path top = fs::canonical(dir, ec);
  if (ec) refuse_inside(dir, name, what, "a file that cannot be resolved inside");
  auto under = [&](const fs::path& root) {
    return std::mismatch(root.begin(), root.end(), real.begin(), real.end()).first == root.end();
  };
  if (under(top)) return;
  // A Hugging Face hub cache snapshot (huggingface_hub's layout: models--ORG--NAME/snapshots/REV/FILE
  // is a symbolic link to ../../blobs/SHA256): links into that repository's own blobs/ are inside.
  if (top.parent_path().filename() == "snapshots") {
    const fs::path blobs = top.parent_path().parent_path() / "blobs";
    if (fs::is_directory(blobs, ec) && under(blobs)) return;
  }
  refuse_inside(dir, name, what, "a symbolic link to '" + real.string() + "', outside");
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
  check_real_inside(dir, name, what, real);
  return p.string();
}

InputFile InputFile::open(const std::string& path, const std::string& what) {
  const std::string named = (what.empty() ? std::string("file") : what) + " '" + path + "'";
  auto not_regular = [&](mode_t m) {
    return std::runtime_error(named + " is not a regular file (" + file_kind(m) + "); give a file to read");
  };
  // O_NONBLOCK: opening a FIFO with no writer returns at once (without it, open(2) waits for one,
  // and SA_RESTART handlers restart the wait); the descriptor is checked before any read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int e = errno;
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) throw not_regular(st.st_mode);  // a socket: ENXIO
    if (e == ENOENT) throw std::runtime_error(named + ": no such file");
    throw std::runtime_error("cannot open " + named + ": " + std::strerror(e));
  }
  std::shared_ptr<const int> held(new int(fd), [](const int* p) {
    ::close(*p);
    delete p;
  });
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw std::runtime_error("cannot stat " + named + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw not_regular(st.st_mode);
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);  // (no effect on a regular file's reads; for clarity)
  return InputFile(path, std::move(held), static_cast<uint64_t>(st.st_size));
}

InputFile InputFile::open_inside(const std::string& dir, const std::string& name, const std::string& what) {
  const fs::path p = checked_name(dir, name, what);
  test_file_pause("open", p.string());
  InputFile f = open(p.string(), what + ": file");
  // The file actually opened, by the kernel's name for the descriptor: a link swapped after any
  // check of the name cannot bring in another file's bytes.
  std::error_code ec;
  fs::path real = fs::read_symlink("/proc/self/fd/" + std::to_string(f.fd()), ec);
  if (ec) {  // no /proc: the name resolved now must be the very file opened (device and inode)
    real = fs::canonical(p, ec);
    struct stat a {}, b {};
    if (ec || ::stat(real.c_str(), &a) != 0 || ::fstat(f.fd(), &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino)
      refuse_inside(dir, name, what, "a file that changed while it was opened, inside");
  }
  check_real_inside(dir, name, what, real);
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
