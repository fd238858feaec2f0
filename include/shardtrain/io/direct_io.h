// DirectFileWriter: writes byte ranges of an existing file past the page cache (open(2) O_DIRECT)
// where the file system allows it, through the page cache where it does not. Used for the tensor
// rows of a checkpoint (checkpoint_data.cpp), which each rank writes at the offsets HDF5 allocated.
//
// Why: a buffered write of a large file costs the CPU twice, a copy into the page cache and then
// the kernel's writeback, which runs in kernel threads at normal priority whatever the writer
// thread's own priority; on a CPU run with one rank per core, a background checkpoint written that
// way made the steps during it up to 2x slower, and on a VM the page cache's pages could fault in
// the host (docs/benchmarks.md, "Checkpoint writes past the page cache"). A direct write hands the
// device the pages (DMA) and waits.
//
// Contract:
// - O_DIRECT needs file offsets, lengths and memory aligned to the device's logical block. Every
//   write(off, src, n) splits [off, off+n) into an unaligned head and tail (each < kAlign bytes;
//   the blocks a range may share with its neighbours' ranges) written through the page cache, and
//   an aligned middle copied through an aligned bounce buffer (kBounce bytes) and written direct.
//   Ranges written by different processes may share a block only in their heads and tails, which
//   are buffered, so concurrent writers of disjoint ranges never overwrite each other's bytes.
// - Where O_DIRECT is refused (the open, or a direct write failing with EINVAL: some FUSE file
//   systems, tmpfs before Linux 6.6), that write and every later one go through the page cache.
//   A short direct write is finished through the page cache. direct() says which path is in use.
// - The bytes in the file are the same either way. Durability is the caller's: fsync(2) the file
//   (the checkpoint's publish does) covers both paths.
// - Errors: write() returns 0, or the errno of the first failure (ENOSPC, EDQUOT, EIO, ...; a write
//   that makes no progress: EIO); a file that could not be opened: that open's errno, from every
//   write(). Nothing is thrown. Not thread-safe: one writer per object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardtrain {

class DirectFileWriter {
 public:
  static constexpr size_t kAlign = 4096;              // covers 512- and 4096-byte logical blocks
  static constexpr size_t kBounce = size_t{8} << 20;  // bytes per direct write

  // Opens `path`, which must exist, for writing (never creates or truncates it).
  explicit DirectFileWriter(const std::string& path);
  ~DirectFileWriter();
  DirectFileWriter(const DirectFileWriter&) = delete;
  DirectFileWriter& operator=(const DirectFileWriter&) = delete;

  // Writes the `n` bytes at `src` to bytes [off, off + n) of the file. 0 or an errno (see above).
  int write(uint64_t off, const void* src, size_t n);
  // Whether the aligned middles of the next writes go past the page cache.
  bool direct() const { return direct_fd_ >= 0 && bounce_ != nullptr; }

 private:
  int buffered(uint64_t off, const char* p, size_t n);
  int fd_ = -1, direct_fd_ = -1, open_errno_ = 0;
  void* bounce_ = nullptr;
};

}  // namespace shardtrain
