// DirectFileWriter (direct_io.h): the bytes it writes, read back with plain reads, equal the bytes
// given, for ranges at every alignment, across several bounce buffers, from two writers sharing
// blocks; the aligned middles bypass the page cache (mincore(2)); errors come back as errno.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "shardtrain/io/direct_io.h"

namespace {

using shardtrain::DirectFileWriter;
namespace fs = std::filesystem;

struct TempFile {
  std::string path;
  explicit TempFile(size_t bytes) {
    path = (fs::temp_directory_path() / ("shardtrain-direct-io-" + std::to_string(::getpid()) + ".bin")).string();
    std::ofstream(path, std::ios::binary | std::ios::trunc);
    fs::resize_file(path, bytes);
  }
  ~TempFile() { fs::remove(path); }
  std::vector<unsigned char> read() const {
    std::ifstream f(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  }
};

std::vector<unsigned char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(g());
  return v;
}

// The file cut into consecutive ranges of random lengths (1 byte to 3 bounce buffers), so that
// heads, middles and tails of every alignment occur; written in a shuffled order by two writers
// taking turns (two ranks writing their slices of one file).
TEST(DirectIo, RangesAtAnyAlignmentReadBackExactly) {
  const size_t N = 3 * DirectFileWriter::kBounce + 12345;
  TempFile t(N);
  const std::vector<unsigned char> want = random_bytes(N, 7);
  std::mt19937 g(11);
  std::vector<std::pair<size_t, size_t>> ranges;
  for (size_t off = 0; off < N;) {
    size_t len = std::uniform_int_distribution<size_t>(1, 3)(g) == 1
                     ? std::uniform_int_distribution<size_t>(1, 3 * DirectFileWriter::kAlign)(g)
                     : std::uniform_int_distribution<size_t>(1, 3 * DirectFileWriter::kBounce / 2)(g);
    len = std::min(len, N - off);
    ranges.push_back({off, len});
    off += len;
  }
  std::shuffle(ranges.begin(), ranges.end(), g);
  DirectFileWriter a(t.path), b(t.path);
  bool direct = a.direct();
  for (size_t i = 0; i < ranges.size(); ++i) {
    DirectFileWriter& w = i % 2 ? b : a;
    ASSERT_EQ(w.write(ranges[i].first, want.data() + ranges[i].first, ranges[i].second), 0) << ranges[i].first;
  }
  EXPECT_EQ(t.read(), want) << ranges.size() << " ranges";
  if (!direct) std::cout << "note: O_DIRECT refused by the file system of " << t.path << ": buffered writes checked only\n";
}

// A 16 MiB aligned range written direct leaves (almost) none of its pages in the page cache:
// mincore(2) on a mapping of the file counts the resident ones. A range starting 100 bytes in
// keeps at most its head's and tail's pages.
TEST(DirectIo, AlignedMiddleBypassesThePageCache) {
  const size_t N = size_t{16} << 20;
  TempFile t(N + 8192);
  {
    DirectFileWriter w(t.path);
    if (!w.direct()) GTEST_SKIP() << "O_DIRECT refused by the file system of " << t.path;
    const std::vector<unsigned char> data = random_bytes(N, 3);
    ASSERT_EQ(w.write(100, data.data(), N), 0);
  }
  const int fd = ::open(t.path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  const size_t len = N + 8192, page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* m = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  std::vector<unsigned char> vec((len + page - 1) / page);
  ASSERT_EQ(::mincore(m, len, vec.data()), 0);
  size_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  ::munmap(m, len);
  ::close(fd);
  EXPECT_LE(resident, 2u * DirectFileWriter::kAlign / page) << "of " << vec.size() << " pages";
  // and the bytes are right
  const std::vector<unsigned char> data = random_bytes(N, 3), got = t.read();
  ASSERT_EQ(got.size(), N + 8192);
  EXPECT_TRUE(std::equal(data.begin(), data.end(), got.begin() + 100));
}

TEST(DirectIo, MissingFileGivesItsErrno) {
  DirectFileWriter w((fs::temp_directory_path() / "shardtrain-no-such-dir/x.bin").string());
  const char b[4] = {1, 2, 3, 4};
  EXPECT_EQ(w.write(0, b, 4), ENOENT);
  EXPECT_FALSE(w.direct());
}

}  // namespace
