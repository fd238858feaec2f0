// write_file_atomic: temp file, flush, optional fsync, rename; crc32_update: libdeflate's CRC-32.
#include "shardtrain/files.h"

#include <fcntl.h>
#include <unistd.h>
#include <libdeflate.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace shardtrain {

uint32_t crc32_update(uint32_t crc, const void* p, size_t bytes) {
  // libdeflate's CRC-32 is zlib's (same polynomial, initial value and final xor; size_t length),
  // carry-less-multiply (PCLMULQDQ) code where the CPU has it: ~10x zlib 1.2.13's table code, which
  // took ~0.45 s per rank of a 1.2 GB checkpoint save (docs/benchmarks.md).
  return libdeflate_crc32(crc, p, bytes);
}

std::string path_inside(const std::string& dir, const std::string& name, const std::string& what) {
  namespace fs = std::filesystem;
  const fs::path rel(name);
  auto refuse = [&](const std::string& why) {
    throw std::runtime_error(what + " names '" + name + "', " + why + " of directory '" + dir +
                             "': every file read must lie inside it");
  };
  if (name.empty()) refuse("an empty name, not a file");
  if (rel.is_absolute() || rel.has_root_name() || rel.has_root_directory()) refuse("an absolute path outside");
  for (const fs::path& part : rel)
    if (part == "..") refuse("a path with '..', which may lead out");
  const fs::path p = fs::path(dir) / rel;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(p, ec))) return p.string();
  std::error_code ec2;
  const fs::path real = fs::canonical(p, ec), top = fs::canonical(dir, ec2);
  if (ec || ec2) refuse("a file that cannot be resolved (a dangling symbolic link?) inside");
  auto under = [&](const fs::path& root) {
    return std::mismatch(root.begin(), root.end(), real.begin(), real.end()).first == root.end();
  };
  if (under(top)) return p.string();
  // A Hugging Face hub cache snapshot (huggingface_hub's layout: models--ORG--NAME/snapshots/REV/FILE
  // is a symbolic link to ../../blobs/SHA256): links into that repository's own blobs/ are inside.
  if (top.parent_path().filename() == "snapshots") {
    const fs::path blobs = top.parent_path().parent_path() / "blobs";
    if (fs::is_directory(blobs, ec2) && under(blobs)) return p.string();
  }
  refuse("a symbolic link to '" + real.string() + "', outside");
  return p.string();
}

void check_output_path(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st) || fs::is_regular_file(st)) return;
  const char* kind = fs::is_directory(st) ? "a directory" : fs::is_character_file(st) || fs::is_block_file(st) ? "a device"
                   : fs::is_fifo(st) ? "a FIFO" : fs::is_socket(st) ? "a socket" : "not a regular file";
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
