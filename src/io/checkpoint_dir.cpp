// The checkpoint directory (checkpoint.h): names, the temporary file, fsync + rename, `latest`,
// --keep-last, the abandoned continuation of a rolled-back run, and --resume resolution. Rank 0
// alone touches the directory; the ranks agree on the outcome.
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <thread>

#include "checkpoint_internal.h"
#include "shardtrain/checkpoint.h"
#include "shardtrain/files.h"

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

std::string tmp_path_of(const CheckpointOptions& co, int64_t step) {
  std::string name = ".";  // (GCC 12's -Wrestrict misreads "." + std::string here)
  name += checkpoint_name(step);
  name += ".tmp";
  return (fs::path(co.dir) / name).string();
}

}  // namespace

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
          write_file_atomic((fs::path(dir) / "latest").string(), fs::path(resumed).filename().string() + "\n", true);
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

void prepare_checkpoint_dir(Comm& comm, const std::string& dir) {
  std::string err;
  uint64_t nonce = 0;
  if (comm.rank() == 0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) err = "cannot create checkpoint directory '" + dir + "' (option '--checkpoint-dir'): " + ec.message();
    else if (::access(dir.c_str(), W_OK) != 0)
      err = "checkpoint directory '" + dir + "' is not writable (option '--checkpoint-dir')";
    nonce = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
            (static_cast<uint64_t>(::getpid()) << 40);
  }
  all_ok(comm, err.empty(), err);
  comm.broadcast(&nonce, 1, 0);
  // A name never used before: no rank can have it in a (negative) lookup cache.
  const std::string probe = (fs::path(dir) / (".shardtrain-probe-" + std::to_string(nonce))).string();
  if (comm.rank() == 0) {
    try {
      write_file_atomic(probe, std::to_string(nonce) + "\n");
    } catch (const std::exception& e) {  // (a disk filled by another writer before the save fails here)
      err = "checkpoint directory '" + dir + "' (option '--checkpoint-dir'): " + e.what() + free_space_note(dir);
    }
  }
  all_ok(comm, err.empty(), err);
  std::string seen;
  std::ifstream(probe) >> seen;
  const std::vector<int> blind = ranks_differing_from_root(comm, seen == std::to_string(nonce) ? 1 : 0);
  if (comm.rank() == 0) ::unlink(probe.c_str());
  if (!blind.empty())
    throw CollectiveError(blind.front(), "checkpoint directory '" + dir + "' (option '--checkpoint-dir') is not the same "
                                         "directory on every rank: " + rank_list(blind) + " cannot see the file rank 0 "
                                         "wrote there (a node-local path, a relative path under different working "
                                         "directories, or a file system not mounted on every node); every rank must "
                                         "write into one shared directory");
}

std::string save_checkpoint(Comm& comm, const CheckpointSnapshot& snap, const CheckpointOptions& co) {
  const int64_t step = snap.state.step;
  prepare_checkpoint_dir(comm, co.dir);
  // `latest`'s new contents are written (to "latest.tmp") before the checkpoint, like the file's
  // reserved space: a disk that another writer fills during the save then cannot fail the
  // publication either (it failed there when `latest` was written last: issue 29's race).
  // publish_checkpoint renames it into place; a save that fails removes it.
  const std::string latest = (fs::path(co.dir) / "latest").string();
  std::string err;
  if (comm.rank() == 0) {
    try {
      (void)write_file_temp(latest, checkpoint_name(step) + "\n", true);
    } catch (const std::exception& e) {
      err = "checkpoint '" + tmp_path_of(co, step) + "': " + e.what() + free_space_note(co.dir);
    }
  }
  all_ok(comm, err.empty(), err);
  try {
    write_checkpoint_file(comm, tmp_path_of(co, step), snap);
  } catch (...) {
    if (comm.rank() == 0) ::unlink((latest + ".tmp").c_str());
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
  const std::string tmp_path = tmp_path_of(co, step);
  std::string err;
  // Rank 0: fsync data, rename, fsync dir, move `latest`, then prune.
  if (comm.rank() == 0) {
    try {
      // A data fsync that fails leaves the file unpublished and removed; `latest` untouched.
      if (int e = fsync_path(tmp_path, false, /*drop_cache=*/true)) {
        std::error_code ec;
        fs::remove(tmp_path, ec);
        fs::remove(fs::path(co.dir) / "latest.tmp", ec);
        throw std::runtime_error("fsync of '" + tmp_path + "' failed: " + std::strerror(e) + "; not published, removed");
      }
      // `latest`'s new contents are written before anything is renamed: on a disk that another
      // writer filled since the save's reservation, that small write is what fails, and then nothing
      // is published (the .tmp removed, `latest` untouched) rather than a checkpoint renamed into
      // place that `latest` does not name. The two renames need no space.
      const std::string latest = (fs::path(co.dir) / "latest").string(), want = checkpoint_name(step) + "\n";
      std::string latest_tmp = latest + ".tmp", staged;
      {
        std::ifstream in(latest_tmp, std::ios::binary);
        staged.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      }
      try {
        if (staged != want) latest_tmp = write_file_temp(latest, want, true);  // (not staged by save_checkpoint)
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
          std::ifstream l(latest);
          std::string name;
          std::getline(l, name);
          while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();  // CRLF, blanks
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
