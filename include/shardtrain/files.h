// Small file helpers shared by every layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace shardtrain {

// Writes `bytes` to `path` atomically: to "<path><tmp_suffix>" ("<path>.tmp" by default) first,
// flushed (and fsync'd, with the directory, when `durable`), then renamed over `path`. Readers see
// the old file or the new one, never a partial one. On failure the temporary file is removed and
// std::runtime_error names `path` (and `what`, e.g. "option '--out'", when given). `tmp_suffix`:
// the checkpoint directory's writers pass ".<host>.<pid>.tmp" (checkpoint.h checkpoint_temp_tag),
// so that a leftover names its process.
void write_file_atomic(const std::string& path, const std::string& bytes, bool durable = false,
                       const std::string& what = "", const std::string& tmp_suffix = ".tmp");
// write_file_atomic in two halves, for a caller that must know the new file fits before it changes
// anything else (publish_checkpoint writes `latest` this way before it renames the checkpoint):
// write_file_temp writes (and, when `durable`, fsyncs) "<path><tmp_suffix>" and returns its name;
// the message of a failure names `path` and the errno's text. commit_file_temp renames it over
// `path` (no new space needed) and fsyncs the directory when `durable`.
std::string write_file_temp(const std::string& path, const std::string& bytes, bool durable = false,
                            const std::string& what = "", const std::string& tmp_suffix = ".tmp");
void commit_file_temp(const std::string& tmp, const std::string& path, bool durable = false, const std::string& what = "");

// Refuses an output path that exists and is not a regular file (a directory, a device such as
// /dev/null, a FIFO, a socket): a rename over it would replace it. Throws std::runtime_error
// naming `what` (e.g. "option '--out'") and the kind of file. A missing path is fine.
void check_output_path(const std::string& path, const std::string& what);

// The path of file `name` inside directory `dir`, for reading a file that a directory's own
// contents name (a safetensors index's shard files) or that a reader looks for there: refuses
// (std::runtime_error naming `what`, the name and the directory) an empty or absolute name, one
// with a ".." component, and one that exists but resolves, through symbolic links, to a place
// outside `dir` (canonical paths compared). A name that does not exist is returned as is (the
// caller reports it missing), so is one inside `dir` through links that stay inside. One exception,
// the Hugging Face hub cache: when `dir` is a snapshot (.../models--ORG--NAME/snapshots/REV), links
// into that repository's blobs/ folder (../../blobs, where the hub keeps the files) count as inside.
std::string path_inside(const std::string& dir, const std::string& name, const std::string& what);

// A regular file opened for reading, checked on the open descriptor itself, not on its name: what
// is read is what was checked, however the name changes meanwhile. Opened with O_NONBLOCK, so a
// FIFO, device or socket in its place is refused at once instead of blocking in open(2):
// "WHAT 'PATH' is not a regular file (a FIFO); ...", "WHAT 'PATH': no such file". Copies share one descriptor (closed with the last copy), so a
// reader that keeps an InputFile from its header to its last byte reads one file, not two.
// Every refusal is a std::runtime_error naming `what` (e.g. "job file") and the path.
class InputFile {
 public:
  // `path` as named by the user (symbolic links followed anywhere): missing -> "... no such file".
  static InputFile open(const std::string& path, const std::string& what);
  // File `name` of directory `dir`, with path_inside's rules applied to the name and to the file
  // actually opened: its real path (the kernel's, /proc/self/fd) must lie inside `dir` (or, for a
  // hub-cache snapshot, its repository's blobs/), so a link swapped between the check and the
  // open is refused, never read.
  static InputFile open_inside(const std::string& dir, const std::string& name, const std::string& what);

  const std::string& path() const { return path_; }
  // A name that opens this very file again (for readers that need a stream, e.g. std::ifstream):
  // "/proc/self/fd/N" where /proc is mounted, else the path as named. Valid while this InputFile
  // (or a copy) lives.
  std::string reopen_path() const;
  uint64_t size() const { return size_; }  // bytes, at open (fstat)
  int fd() const { return *fd_; }
  // Exactly `n` bytes at byte offset `off`; throws naming the file on an error or end of file.
  void read_at(void* buf, size_t n, uint64_t off) const;
  // The whole file; refuses one larger than `max_bytes` (naming the limit), so a crafted or wrong
  // file cannot make us allocate without bound.
  std::string read_all(uint64_t max_bytes = uint64_t{1} << 30) const;

 private:
  InputFile(std::string path, std::shared_ptr<const int> fd, uint64_t size)
      : path_(std::move(path)), fd_(std::move(fd)), size_(size) {}
  std::string path_;
  std::shared_ptr<const int> fd_;
  uint64_t size_ = 0;
};

// What a stat(2) mode names, for messages: "a regular file", "a directory", "a device", "a FIFO",
// "a socket" (else "not a regular file").
const char* file_kind(unsigned mode);

// Test hooks' pause: creates `flag` (holding this process's id) and waits, at most 60 s, until it
// is removed (the test acts meanwhile).
void wait_while_flag(const std::string& flag);

// Does `path` name something (a file, a directory, a FIFO, a dangling link: anything lstat sees)?
bool path_exists(const std::string& path);

// Test hook SHARDTRAIN_TEST_FILE_PAUSE=POINT:NAME:FLAG (docs/errors.md): the first time this
// process reaches POINT ("open": after a file's name was checked, before it is opened; "read":
// after a safetensors header was read, before its tensors) for a file whose last path component is
// NAME, it creates FLAG and waits (at most 60 s) until FLAG is removed. Tests swap a link meanwhile.
void test_file_pause(const char* point, const std::string& path);

// The CRC-32 of zlib and Python's zlib.crc32 (ISO-HDLC: reflected polynomial 0xEDB88320, initial
// and final xor 0xFFFFFFFF) of `bytes` bytes at `p`, continuing from `crc` (0 to start). Any length.
// Computed by libdeflate (PCLMULQDQ where available); tests/unit/test_data.cpp checks it against zlib.
uint32_t crc32_update(uint32_t crc, const void* p, size_t bytes);

}  // namespace shardtrain
