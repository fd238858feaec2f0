// DirectFileWriter (direct_io.h): O_DIRECT writes through an aligned bounce buffer, buffered heads
// and tails, and a buffered fallback where the file system refuses O_DIRECT.
#include "shardtrain/io/direct_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace shardtrain {

DirectFileWriter::DirectFileWriter(const std::string& path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd_ < 0) {
    open_errno_ = errno;
    return;
  }
  direct_fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_DIRECT);  // -1 where refused: buffered only
  if (direct_fd_ >= 0 && ::posix_memalign(&bounce_, kAlign, kBounce) != 0) bounce_ = nullptr;
}

DirectFileWriter::~DirectFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
  std::free(bounce_);
}

int DirectFileWriter::buffered(uint64_t off, const char* p, size_t n) {
  for (size_t done = 0; done < n;) {
    const ssize_t w = ::pwrite(fd_, p + done, n - done, static_cast<off_t>(off + done));
    if (w > 0) done += static_cast<size_t>(w);
    else if (w == 0) return EIO;
    else if (errno != EINTR) return errno;
  }
  return 0;
}

int DirectFileWriter::write(uint64_t off, const void* src, size_t n) {
  if (fd_ < 0) return open_errno_;
  const char* p = static_cast<const char*>(src);
  const uint64_t end = off + n;
  uint64_t a = std::min<uint64_t>(end, (off + kAlign - 1) / kAlign * kAlign);  // first aligned byte
  const uint64_t b = end / kAlign * kAlign;                                     // last aligned boundary
  if (!direct() || b <= a) return buffered(off, p, n);
  if (int e = buffered(off, p, static_cast<size_t>(a - off))) return e;  // the head
  while (a < b && direct()) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(b - a, kBounce));
    std::memcpy(bounce_, p + (a - off), len);
    ssize_t w;
    do {
      w = ::pwrite(direct_fd_, bounce_, len, static_cast<off_t>(a));
    } while (w < 0 && errno == EINTR);
    if (w < 0 && errno == EINVAL) {  // alignment refused after all: this and every later write buffered
      ::close(direct_fd_);
      direct_fd_ = -1;
      break;
    }
    if (w < 0) return errno;
    if (w == 0) return EIO;
    a += static_cast<uint64_t>(w);
    if (static_cast<size_t>(w) % kAlign != 0) break;  // short and unaligned: finish through the page cache
  }
  return buffered(a, p + (a - off), static_cast<size_t>(end - a));  // what is left, and the tail
}

}  // namespace shardtrain
