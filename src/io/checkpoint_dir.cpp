// The checkpoint directory (checkpoint.h): names, the temporary files (tagged with rank 0's host
// and process id) and the removal of a dead process's, fsync + rename, `latest`, --keep-last, the
// abandoned continuation of a rolled-back run, and --resume resolution. Rank 0
// alone touches the directory; the ranks agree on the outcome.
#include <fcntl.h>
#include <sys/file.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string_view>
#include <thread>

#include "checkpoint_internal.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/files.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

// fsync; returns 0 or the errno (a file system that writes back late, NFS among them, may report
// a full disk or an I/O error only here). `drop_cache`: once the data is on disk, tell the kernel
// this file's pages will not be read soon (POSIX_FADV_DONTNEED, best effort), so that each save
// does not leave a checkpoint's worth of page cache behind: the next save's writes then reuse those
// pages instead of taking fresh ones, which on the VM of docs/benchmarks.md ("Asynchronous
// checkpoint saves") made a save about 5x faster and slowed the training steps running beside a
// background write far less.
int fsync_path(const std::string& p, bool dir, bool drop_cache = false) {
  int fd = ::open(p.c_str(), dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return errno;
  int e = ::fsync(fd) == 0 ? 0 : errno;
  if (e == 0 && drop_cache) (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  if (::close(fd) != 0 && e == 0) e = errno;
  return e;
}

// " (N KiB free in 'D')", or "" if unknown.
std::string free_space_note(const std::string& dir) {
  const std::string f = ckpt::free_space_in(dir);
  return f.empty() ? f : " (" + f + ")";
}

// "<dir>/.step_N.h5.<tag>.tmp": the checkpoint being written (checkpoint.h, "Temporary files").
std::string tmp_path_of(const CheckpointOptions& co, int64_t step, const std::string& tag) {
  std::string name = ".";  // (GCC 12's -Wrestrict misreads "." + std::string here)
  name += checkpoint_name(step);
  name += "." + tag + ".tmp";
  return (fs::path(co.dir) / name).string();
}

// `latest`'s temporary file: "<dir>/latest.<tag>.tmp" (write_file_temp's suffix).
std::string latest_suffix(const std::string& tag) { return "." + tag + ".tmp"; }

constexpr const char* kProbePrefix = ".shardtrain-probe-";

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "<host>.<pid>" -> host, pid; false unless both are well-formed (checkpoint.h).
bool parse_tag(std::string_view tag, CheckpointTempName* out) {
  const size_t dot = tag.rfind('.');
  if (dot == std::string_view::npos || dot == 0) return false;
  const std::string_view host = tag.substr(0, dot), pid = tag.substr(dot + 1);
  if (!all_digits(pid) || pid.size() > 18 || pid[0] == '0') return false;
  if (!std::all_of(host.begin(), host.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
      }))
    return false;
  out->tagged = true;
  out->host = std::string(host);
  out->pid = std::stoll(std::string(pid));
  return true;
}

// Whether process `pid` of this host (this PID namespace) is gone: kill(pid, 0) fails with ESRCH,
// or it is a zombie (it has exited; its parent has not collected it yet: mpirun's ranks for a
// moment after a kill -9). Anything else (alive, EPERM: another user's) counts as alive.
bool process_gone(long long pid) {
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream st("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(st, line);
  const size_t paren = line.rfind(')');  // "pid (comm) S ...": comm may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < line.size() && (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}

}  // namespace

std::string checkpoint_temp_tag() {
  char h[256] = {};
  std::string host;
  if (::gethostname(h, sizeof h - 1) == 0) host = h;
  for (char& c : host)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-')) c = '-';
  if (host.empty()) host = "unknown-host";
  // A process in a PID namespace other than the initial one (inode 0xEFFFFFFC, PROC_PID_INIT_INO)
  // has process ids that mean nothing outside it: such a container's files name their namespace.
  char ns[64] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  if (n > 0) {
    const std::string_view v(ns, static_cast<size_t>(n));  // "pid:[4026531836]"
    if (v.starts_with("pid:[") && v.ends_with("]")) {
      const std::string_view ino = v.substr(5, v.size() - 6);
      if (all_digits(ino) && ino != "4026531836") host += "_pidns" + std::string(ino);
    }
  }
  return host + "." + std::to_string(static_cast<long long>(::getpid()));
}

bool parse_checkpoint_temp_name(const std::string& name, CheckpointTempName* out) {
  CheckpointTempName t;
  std::string_view v(name);
  // ".step_NNNNNNNN.h5" + (".tmp" | ".<tag>.tmp")
  if (v.size() > 17 && v[0] == '.' && is_checkpoint_name(std::string(v.substr(1, 16))) && v.ends_with(".tmp")) {
    t.kind = CheckpointTempName::Kind::kCheckpoint;
    const std::string_view mid = v.substr(17, v.size() - 17 - 4);  // "" or ".<tag>"
    if (!(mid.empty() || (mid[0] == '.' && parse_tag(mid.substr(1), &t)))) return false;
  } else if (v.starts_with("latest.") && v.ends_with(".tmp")) {
    t.kind = CheckpointTempName::Kind::kLatest;
    const std::string_view mid = v.substr(6, v.size() - 6 - 4);  // "" or ".<tag>"
    if (!(mid.empty() || (mid[0] == '.' && parse_tag(mid.substr(1), &t)))) return false;
  } else if (v.starts_with(kProbePrefix)) {
    t.kind = CheckpointTempName::Kind::kProbe;
    v.remove_prefix(std::strlen(kProbePrefix));
    if (v.ends_with(".tmp")) v.remove_suffix(4);          // write_file_atomic's own temporary
    const size_t dot = v.rfind('.');                       // "<tag>.<nonce>" or "<nonce>"
    if (dot == std::string_view::npos) {
      if (!all_digits(v)) return false;
    } else if (!all_digits(v.substr(dot + 1)) || !parse_tag(v.substr(0, dot), &t)) {
      return false;
    }
  } else {
    return false;
  }
  if (out != nullptr) *out = t;
  return true;
}

std::vector<std::string> clean_checkpoint_temp_files(Comm& comm, const std::string& dir) {
  std::vector<std::string> notes;
  if (comm.rank() != 0) return notes;
  try {
    std::vector<std::pair<std::string, CheckpointTempName>> found;
    std::error_code ec;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
      CheckpointTempName t;
      std::error_code ec2;
      const std::string n = it->path().filename().string();
      // Regular files only (not followed through links): a directory or link of that name is no save's.
      if (parse_checkpoint_temp_name(n, &t) && fs::is_regular_file(it->symlink_status(ec2))) found.emplace_back(n, t);
    }
    if (ec) notes.push_back("note: could not list '" + dir + "' for the temporary files of interrupted saves: " + ec.message());
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    const std::string mine = checkpoint_temp_tag();
    const std::string my_host = mine.substr(0, mine.rfind('.'));
    const bool host_known = !my_host.starts_with("localhost");
    for (const auto& [n, t] : found) {
      const std::string at = "'" + n + "' in '" + dir + "'";
      if (!t.tagged) {
        notes.push_back("note: left " + at + ": a temporary file of an earlier shardtrain version, which names no " +
                        "process: not removed (remove it once no job of an earlier version writes to this directory)");
      } else if (t.host != my_host || !host_known) {
        notes.push_back("note: left " + at + ": a temporary file of process " + std::to_string(t.pid) + " of host " +
                        t.host + ": not checked from here" +
                        (host_known ? std::string() : " (host name '" + my_host + "' does not identify a machine)"));
      } else if (t.pid == static_cast<long long>(::getpid()) || !process_gone(t.pid)) {
        notes.push_back("note: left " + at + ": process " + std::to_string(t.pid) + " on " + t.host +
                        " is alive (a save of another job, or a process id used again since its writer died)");
      } else if (fs::remove(fs::path(dir) / n, ec); ec) {
        notes.push_back("note: could not remove " + at + " (process " + std::to_string(t.pid) + " on " + t.host +
                        " is gone): " + ec.message());
      } else {
        notes.push_back("note: removed " + at + ": a temporary file of an interrupted save; process " +
                        std::to_string(t.pid) + " on " + t.host + " is gone");
      }
    }
  } catch (const std::exception& e) {  // (allocation; the listing itself reports through ec)
    notes.push_back("note: looking for the temporary files of interrupted saves in '" + dir + "': " + e.what());
  }
  return notes;
}

std::string checkpoint_name(int64_t step) {
  char b[64];
  std::snprintf(b, sizeof b, "step_%08lld.h5", static_cast<long long>(step));
  return b;
}

bool is_checkpoint_name(const std::string& n) {
  return n.size() == 16 && n.rfind("step_", 0) == 0 && n.ends_with(".h5") &&
         std::all_of(n.begin() + 5, n.begin() + 13, [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::string> published_checkpoints(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    std::string n = e.path().filename().string();
    if (is_checkpoint_name(n) && e.is_regular_file(ec)) names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

void set_aside_later_checkpoints(Comm& comm, const std::string& dir, int64_t step, const std::string& resumed) {
  std::string err, moved;
  if (comm.rank() == 0) {
    try {
      std::vector<std::string> later;
      std::error_code ec;
      for (const std::string& n : published_checkpoints(dir))
        if (n > checkpoint_name(step)) later.push_back(n);
      if (!later.empty()) {
        const fs::path aside = fs::path(dir) / "abandoned";
        fs::create_directories(aside);
        for (auto& n : later) {
          fs::rename(fs::path(dir) / n, aside / n);
          moved += (moved.empty() ? "" : ", ") + n;
        }
        if (fs::equivalent(fs::path(resumed).parent_path().empty() ? "." : fs::path(resumed).parent_path(), dir, ec))
          write_file_atomic((fs::path(dir) / "latest").string(), fs::path(resumed).filename().string() + "\n", true, "",
                            latest_suffix(checkpoint_temp_tag()));
      }
    } catch (const std::exception& e) {
      err = "moving the later checkpoints of the abandoned run in '" + dir + "' aside: " + e.what();
    }
  }
  all_ok(comm, err.empty(), err);
  if (!moved.empty())
    log_info(comm, "note: resumed at step " + std::to_string(step) + " while '" + dir + "' holds checkpoints of later steps " +
                       "(" + moved + ") from the run that went on from there: moved to '" + dir +
                       "/abandoned/', so that --keep-last and '--resume auto' follow this run");
}

namespace {

// prepare_checkpoint_dir; returns rank 0's checkpoint_temp_tag() on every rank (the names of the
// save that follows).
std::string prepare_dir(Comm& comm, const std::string& dir) {
  std::string err, id;  // id: "<tag>.<nonce>"
  if (comm.rank() == 0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) err = "cannot create checkpoint directory '" + dir + "' (option '--checkpoint-dir'): " + ec.message();
    else if (::access(dir.c_str(), W_OK) != 0)
      err = "checkpoint directory '" + dir + "' is not writable (option '--checkpoint-dir')";
    const uint64_t nonce = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                           (static_cast<uint64_t>(::getpid()) << 40);
    id = checkpoint_temp_tag() + "." + std::to_string(nonce);
  }
  all_ok(comm, err.empty(), err);
  id = comm.broadcast_string(id, 0);
  const std::string tag = id.substr(0, id.rfind('.'));
  // A name never used before: no rank can have it in a (negative) lookup cache.
  const std::string probe = (fs::path(dir) / (kProbePrefix + id)).string();
  if (comm.rank() == 0) {
    try {
      write_file_atomic(probe, id + "\n");  // (through "<probe>.tmp", which carries the tag too)
    } catch (const std::exception& e) {  // (a disk filled by another writer before the save fails here)
      err = "checkpoint directory '" + dir + "' (option '--checkpoint-dir'): " + e.what() + free_space_note(dir);
    }
  }
  all_ok(comm, err.empty(), err);
  std::string seen;
  std::ifstream(probe) >> seen;
  const std::vector<int> blind = ranks_differing_from_root(comm, seen == id ? 1 : 0);
  if (comm.rank() == 0) ::unlink(probe.c_str());
  if (!blind.empty())
    throw CollectiveError(blind.front(), "checkpoint directory '" + dir + "' (option '--checkpoint-dir') is not the same "
                                         "directory on every rank: " + rank_list(blind) + " cannot see the file rank 0 "
                                         "wrote there (a node-local path, a relative path under different working "
                                         "directories, or a file system not mounted on every node); every rank must "
                                         "write into one shared directory");
  return tag;
}

}  // namespace

void prepare_checkpoint_dir(Comm& comm, const std::string& dir) { (void)prepare_dir(comm, dir); }

CheckpointDirLock::CheckpointDirLock(Comm& comm, const std::string& dir) {
  std::string err;
  if (comm.rank() == 0) {
    const std::string path = (fs::path(dir) / ".shardtrain.lock").string();
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      err = "cannot create checkpoint directory '" + dir + "' (option '--checkpoint-dir'): " + ec.message();
    } else if ((fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644)) < 0) {
      // O_NOFOLLOW: a symbolic link planted there must not make this run (often root) truncate and
      // write the file it points to; O_NONBLOCK: nor a FIFO block the open.
      err = "checkpoint directory '" + dir + "' (option '--checkpoint-dir'): cannot open '" + path + "': " +
            (errno == ELOOP ? std::string("it is a symbolic link (the lock file must be a regular file: remove it)")
                            : std::string(std::strerror(errno)));
    } else if (struct stat st{}; ::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) {
      // A hard link would make the writes below land in another file too.
      err = "checkpoint directory '" + dir + "' (option '--checkpoint-dir'): '" + path +
            "' is not a regular file of its own (a device, a FIFO or a hard link): remove it";
      ::close(fd_);
      fd_ = -1;
    } else if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      if (e == EWOULDBLOCK) {
        char buf[512] = {};
        const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
        std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
        while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
        for (char& c : holder)
          if (c == '\n') c = ',';
        err = "checkpoint directory '" + dir + "' is in use by another training run" +
              (holder.empty() ? std::string() : " (" + holder + ")") +
              ": two runs in one directory overwrite each other's checkpoints; wait for that run to end, or use "
              "another '--checkpoint-dir'";
      } else {
        note_ = "note: cannot lock checkpoint directory '" + dir + "' (" + std::strerror(e) +
                "; the file system may not support flock): a second run started in it would not be detected";
      }
      ::close(fd_);
      fd_ = -1;
    } else {
      char h[256] = {};
      ::gethostname(h, sizeof h - 1);
      char when[32] = {};
      const std::time_t now = std::time(nullptr);
      std::tm utc{};
      if (gmtime_r(&now, &utc)) std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &utc);
      const std::string who = "host " + std::string(h) + ", pid " + std::to_string(::getpid()) + ", since " + when + "\n";
      if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, who.data(), who.size(), 0) < 0) {
        // The lock holds without the words: nothing to refuse over.
      }
    }
  }
  all_ok(comm, err.empty(), err);
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ >= 0) ::close(fd_);  // drops the lock (the file stays: removing it would race a new holder)
}

std::string save_checkpoint(Comm& comm, const CheckpointSnapshot& snap, const CheckpointOptions& co) {
  const int64_t step = snap.state.step;
  const std::string tag = prepare_dir(comm, co.dir);  // rank 0's: one name on every rank
  const std::string tmp_path = tmp_path_of(co, step, tag);
  // `latest`'s new contents are written (to "latest.<tag>.tmp") before the checkpoint, like the file's
  // reserved space: a disk that another writer fills during the save then cannot fail the
  // publication either (it failed there when `latest` was written last: issue 29's race).
  // publish_checkpoint renames it into place; a save that fails removes it.
  const std::string latest = (fs::path(co.dir) / "latest").string();
  std::string err;
  if (comm.rank() == 0) {
    try {
      (void)write_file_temp(latest, checkpoint_name(step) + "\n", true, "", latest_suffix(tag));
    } catch (const std::exception& e) {
      err = "checkpoint '" + tmp_path + "': " + e.what() + free_space_note(co.dir);
    }
  }
  all_ok(comm, err.empty(), err);
  try {
    write_checkpoint_file(comm, tmp_path, snap);
  } catch (...) {
    if (comm.rank() == 0) ::unlink((latest + latest_suffix(tag)).c_str());
    throw;
  }
  if (co.test_delay_before_publish_ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(co.test_delay_before_publish_ms));
  if (co.debug_crash_before_publish > 0 && step == co.debug_crash_before_publish) {
    comm.barrier();
    log_error(comm.rank(), comm.world_size(),
              "debug: crashing after writing step " + std::to_string(step) + " before publishing it");
    std::_Exit(86);
  }
  return publish_checkpoint(comm, co, step);
}

std::string publish_checkpoint(Comm& comm, const CheckpointOptions& co, int64_t step) {
  const std::string final_path = (fs::path(co.dir) / checkpoint_name(step)).string();
  const std::string tag = comm.rank() == 0 ? checkpoint_temp_tag() : "";  // (rank 0 alone uses the names)
  const std::string tmp_path = tmp_path_of(co, step, tag);
  std::string err;
  // Rank 0: fsync data, rename, fsync dir, move `latest`, then prune.
  if (comm.rank() == 0) {
    try {
      // A data fsync that fails leaves the file unpublished and removed; `latest` untouched.
      if (int e = fsync_path(tmp_path, false, /*drop_cache=*/true)) {
        std::error_code ec;
        fs::remove(tmp_path, ec);
        fs::remove(fs::path(co.dir) / ("latest" + latest_suffix(tag)), ec);
        throw std::runtime_error("fsync of '" + tmp_path + "' failed: " + std::strerror(e) + "; not published, removed");
      }
      // `latest`'s new contents are written before anything is renamed: on a disk that another
      // writer filled since the save's reservation, that small write is what fails, and then nothing
      // is published (the .tmp removed, `latest` untouched) rather than a checkpoint renamed into
      // place that `latest` does not name. The two renames need no space.
      const std::string latest = (fs::path(co.dir) / "latest").string(), want = checkpoint_name(step) + "\n";
      std::string latest_tmp = latest + latest_suffix(tag), staged;
      try {  // (our own staged file; read through a checked descriptor all the same, and bounded)
        const InputFile in = InputFile::open(latest_tmp, "the staged checkpoint pointer");
        if (in.size() <= 4096) staged = in.read_all(4096);
      } catch (const std::exception&) {
        staged.clear();  // missing or not a file: written afresh below
      }
      try {
        if (staged != want) latest_tmp = write_file_temp(latest, want, true, "", latest_suffix(tag));  // (not staged by save_checkpoint)
      } catch (const std::exception& e) {
        std::error_code ec;
        fs::remove(tmp_path, ec);
        throw std::runtime_error(std::string(e.what()) + "; '" + tmp_path + "' not published, removed" +
                                 free_space_note(co.dir));
      }
      try {
        fs::rename(tmp_path, final_path);
      } catch (...) {
        std::error_code ec;
        fs::remove(latest_tmp, ec);
        throw;
      }
      (void)fsync_path(co.dir, true);  // directory fsync: not supported everywhere, best effort
      commit_file_temp(latest_tmp, latest, true);
      if (co.keep_last > 0) {
        std::vector<std::string> names = published_checkpoints(co.dir);
        for (size_t i = 0; i + static_cast<size_t>(co.keep_last) < names.size(); ++i)
          if (names[i] != checkpoint_name(step)) fs::remove(fs::path(co.dir) / names[i]);
      }
    } catch (const std::exception& e) {
      err = "publishing checkpoint '" + final_path + "': " + e.what();
    }
  }
  all_ok(comm, err.empty(), err);
  return final_path;
}

std::string resolve_resume(Comm& comm, const std::string& resume, const std::string& dir, bool start_over) {
  std::string path, err;
  if (comm.rank() == 0 && !resume.empty()) {
    try {
      if (resume == "auto") {
        if (dir.empty()) throw std::runtime_error("option '--resume auto' needs '--checkpoint-dir'");
        const fs::path latest = fs::path(dir) / "latest";
        const std::vector<std::string> names = published_checkpoints(dir);
        std::error_code ec;
        if (fs::exists(latest, ec) || fs::is_symlink(latest, ec)) {
          // Read through a checked descriptor: a FIFO or device named `latest` is refused at once
          // (never waited on), and only a small file is read (one name and a line end).
          std::string name;
          if (struct stat st {}; ::stat(latest.c_str(), &st) == 0) {
            const InputFile lf = InputFile::open(latest.string(), "the checkpoint pointer");
            if (lf.size() <= 4096) {
              const std::string text = lf.read_all(4096);
              name = text.substr(0, text.find('\n'));
            } else {
              name = "(" + std::to_string(lf.size()) + " bytes)";
            }
          }
          while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();  // CRLF, blanks
          for (char& c : name)  // quoted in the message below: no control bytes (a NUL would end it)
            if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
          const bool well_formed = fs::is_regular_file(latest, ec) && is_checkpoint_name(name);
          if (well_formed && fs::is_regular_file(fs::path(dir) / name, ec)) {
            path = (fs::path(dir) / name).string();
          } else if (!(start_over && names.empty())) {
            // A run existed (it wrote `latest`) and its newest checkpoint is gone, or the pointer is
            // damaged: starting over, or silently going back to an older one, could lose progress.
            std::string msg = !well_formed ? "'" + latest.string() + "' is damaged: it should hold one checkpoint name like '" +
                                                 checkpoint_name(0) + "', not '" + name.substr(0, 80) + "'. "
                              : "'" + latest.string() + "' names '" + name + "', which " +
                                    (fs::exists(fs::path(dir) / name, ec) ? "is not a checkpoint file"
                                                                          : "does not exist") +
                                    ": the newest checkpoint of the run in '" + dir +
                                    "' is gone (deleted, or on a file system this node does not see). ";
            if (!names.empty())
              msg += "The newest checkpoint still present is '" + names.back() + "': to continue from it, pass '--resume " +
                     (fs::path(dir) / names.back()).string() + "'";
            else
              msg += "No checkpoint is left: to start again from step 0 in this directory, pass '--start-over'";
            throw std::runtime_error(msg);
          }
        } else if (!names.empty()) {
          path = (fs::path(dir) / names.back()).string();
        }
      } else {
        if (!fs::exists(resume)) throw std::runtime_error("checkpoint '" + resume + "' (option '--resume'): no such file");
        path = resume;
      }
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  all_ok(comm, err.empty(), err);
  return comm.broadcast_string(path, 0);
}

namespace ckpt {

std::string free_space_in(const std::string& dir) {
  struct statvfs sv {};
  if (::statvfs(dir.c_str(), &sv) != 0) return "";
  return std::to_string((static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize) >> 10) + " KiB free in '" + dir + "'";
}

}  // namespace ckpt

}  // namespace shardtrain
