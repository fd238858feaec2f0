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

// The path of file `name` inside directory `dir`, for a check by name before a file is opened
// (InputDir::open_inside then checks the file actually opened): refuses (std::runtime_error naming
// `what`, the name and the directory) an empty or absolute name, one with a ".." component, and one
// that exists but resolves, through symbolic links, to a place outside `dir` (canonical paths
// compared). A name that does not exist is returned as is (the caller reports it missing), so is
// one inside `dir` through links that stay inside. One exception, the Hugging Face hub cache
// (huggingface_hub's layout): when `dir` resolves to a snapshot, .../models--ORG--NAME/snapshots/REV,
// a file may resolve to a blob of that same repository, .../models--ORG--NAME/blobs/HASH (HASH: 40
// or 64 hex digits, the git or SHA-256 hash the hub names blobs by; the hub's links are
// ../../blobs/HASH). Nothing else counts: a directory merely named "snapshots", a grandparent not
// named models--*, a file in a subfolder of blobs/ or named otherwise, are outside.
std::string path_inside(const std::string& dir, const std::string& name, const std::string& what);

// Pseudo file systems, whose files the kernel makes up when read (proc, sysfs, debugfs, tracefs,
// securityfs, cgroup and cgroup2, bpf, pstore, efivarfs, selinuxfs, smackfs, binfmt_misc, nsfs,
// usbdevfs, devpts: <linux/magic.h>): their "regular" files report a size of 0 (or 4096) whatever
// they hold, and reading them can have effects. Returns the file system's name ("proc", "sysfs",
// ...) when the open descriptor `fd` lies on one (fstatfs(2) of the descriptor itself, not of a
// name), else nullptr (also when fstatfs fails: the reads that follow report the error).
const char* pseudo_fs_name(int fd);
// Throws std::runtime_error "NAMED lies on the FS pseudo file system (/proc, /sys, ...), whose
// files the kernel makes up when read: give a file on disk" when pseudo_fs_name(fd) is not null.
// `named` names the input, e.g. "job file '/proc/self/status'".
void refuse_pseudo_fs(int fd, const std::string& named);

class InputFile;

// A directory opened once (open(2) with O_PATH | O_DIRECTORY: symbolic links in its name are
// followed then, once), whose files are then opened relative to that descriptor (openat(2)): when
// the name given is a link (or a path through one) that someone points elsewhere meanwhile, every
// file still comes from the directory first opened, never from two. The "inside" rule of
// path_inside is checked against the descriptor's own real path (the kernel's, /proc/self/fd/N,
// read at each check) and each file's descriptor's real path, so links inside the directory
// resolve from where the directory really is (a hub cache's ../../blobs links included). Copies
// share one descriptor (closed with the last copy). Refusals: std::runtime_error naming `what`
// (e.g. "option '--hf-dir'") and the path: "WHAT 'PATH': no such directory", "WHAT 'PATH' is not a
// directory (a regular file)", "cannot open WHAT 'PATH': <errno text>", and refuse_pseudo_fs's.
class InputDir {
 public:
  static InputDir open(const std::string& path, const std::string& what);
  const std::string& path() const { return path_; }  // as named (messages name the directory so)
  int fd() const { return *fd_; }
  // The directory's real path now: /proc/self/fd/N, or where /proc is not mounted the canonical
  // path of its name, which must then be this very directory (device and inode), else throws.
  std::string real_path() const;
  // Does `name` (path_inside's rules for the name: relative, no "..") name anything in the
  // directory (fstatat, links not followed: a dangling link exists)? Refuses a bad name as
  // path_inside does, naming `what`.
  bool has(const std::string& name, const std::string& what) const;
  // File `name` of this directory, opened with openat(2) on the descriptor and checked as
  // InputFile::open checks a file (a regular file, not on a pseudo file system, opened without
  // blocking), and its real path must lie inside real_path() (or, for a hub-cache snapshot, in
  // its repository's blobs/ as path_inside says), else "WHAT names 'NAME', a symbolic link to
  // 'T', outside of directory 'PATH': every file read must lie inside it". Missing: "WHAT: file
  // 'PATH/NAME': no such file". The InputFile's path() is PATH/NAME. Test hook: test_file_pause
  // ("open") after the name is checked, before the open.
  InputFile open_inside(const std::string& name, const std::string& what) const;

 private:
  InputDir(std::string path, std::shared_ptr<const int> fd) : path_(std::move(path)), fd_(std::move(fd)) {}
  std::string path_;
  std::shared_ptr<const int> fd_;
};

// A regular file opened for reading, checked on the open descriptor itself, not on its name: what
// is read is what was checked, however the name changes meanwhile. Opened with O_NONBLOCK, so a
// FIFO, device or socket in its place is refused at once instead of blocking in open(2):
// "WHAT 'PATH' is not a regular file (a FIFO); ...", "WHAT 'PATH': no such file". A file on a
// pseudo file system (/proc, /sys, ...: pseudo_fs_name) is refused by its file system's type, not
// by its size (refuse_pseudo_fs's message). Copies share one descriptor (closed with the last
// copy), so a reader that keeps an InputFile from its header to its last byte reads one file, not two.
// Every refusal is a std::runtime_error naming `what` (e.g. "job file") and the path.
class InputFile {
 public:
  // `path` as named by the user (symbolic links followed anywhere): missing -> "... no such file".
  static InputFile open(const std::string& path, const std::string& what);
  // File `name` of directory `dir`: InputDir::open(dir, what).open_inside(name, what) (the
  // directory opened for this one file; a reader of several files of one directory opens an
  // InputDir once and opens them all through it).
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
  friend class InputDir;
  // The checks of open() on descriptor `fd` (already opened, O_NONBLOCK), which this takes over.
  static InputFile checked(int fd, const std::string& path, const std::string& named);
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
