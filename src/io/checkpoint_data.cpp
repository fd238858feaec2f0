// Checkpoint tensor data (checkpoint.h): the named sharded tensors, snapshots of them, the file's
// write through parallel HDF5 and MPI-IO (space reserved first; every rank writes, with
// independent MPI-IO, exactly one slice per dataset, never an empty one, thanks to padding; or an
// empty selection when another replica group writes its rows), and
// loading with resharding (each rank reads, independently, the saved slices it needs, each checked
// against its CRC32).
#include <fcntl.h>
#include <hdf5.h>
#include <mpi.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>

#include "checkpoint_internal.h"
#include "shardtrain/io/direct_io.h"
#include "shardtrain/runtime/json_input.h"

namespace shardtrain {
namespace fs = std::filesystem;
using namespace ckpt;

const std::vector<std::string>& checkpoint_tensor_names() {
  static const std::vector<std::string> names = {"params", "adam_m", "adam_v"};
  return names;
}

namespace {

// Column of `name` in the shard_crc32 table; -1 if the format has no such tensor.
int tensor_column(const std::string& name) {
  const auto& n = checkpoint_tensor_names();
  auto it = std::find(n.begin(), n.end(), name);
  return it == n.end() ? -1 : static_cast<int>(it - n.begin());
}

// Every tensor named like one of the format's, once, with one shard per unit of `plan`.
void check_tensor_set(const ShardPlan& plan, const std::vector<std::string>& names, const std::vector<size_t>& shard_counts,
                      const char* who) {
  std::set<std::string> seen;
  for (size_t i = 0; i < names.size(); ++i) {
    if (tensor_column(names[i]) < 0)
      throw std::invalid_argument(std::string(who) + ": no checkpoint tensor is called '" + names[i] + "'");
    if (!seen.insert(names[i]).second) throw std::invalid_argument(std::string(who) + ": tensor '" + names[i] + "' given twice");
    if (shard_counts[i] != plan.units.size())
      throw std::invalid_argument(std::string(who) + ": tensor '" + names[i] + "' has " + std::to_string(shard_counts[i]) +
                                  " shards for " + std::to_string(plan.units.size()) + " units");
  }
}

}  // namespace

ShardedTensors sharded_params(ShardedState<float>& f) {
  ShardedTensors t;
  t.plan = &f.plan();
  t.plan_rank = f.plan_rank();
  t.backend = &f.backend();
  ShardedTensor p{"params", {}};
  for (int u = 0; u < f.num_units(); ++u) p.shards.push_back(f.param_shard(u));
  t.tensors.push_back(std::move(p));
  return t;
}

bool SnapshotBuffer::fits(const ShardPlan& plan, size_t tensors) const {
  if (tensors_ < tensors || units() != plan.units.size()) return false;
  for (size_t u = 0; u < units(); ++u)
    if (size_[u] != plan.units[u].shard_size) return false;
  return true;
}

SnapshotBuffer::SnapshotBuffer(Backend<float>& be, const ShardPlan& plan, size_t tensors) : be_(&be), tensors_(tensors) {
  for (auto& up : plan.units) {
    offset_.push_back(per_tensor_);
    size_.push_back(up.shard_size);
    // Each unit's rows start on a 64-byte boundary (16 floats), as a separate allocation would.
    per_tensor_ += (static_cast<size_t>(up.shard_size) + 15) / 16 * 16;
  }
  base_ = static_cast<float*>(be.alloc_pinned_host(4 * std::max<size_t>(per_tensor_ * tensors_, 1)));
}

SnapshotBuffer::~SnapshotBuffer() { be_->free_pinned_host(base_); }

uint64_t CheckpointSnapshot::bytes() const {
  uint64_t b = 0;
  for (auto& t : tensors)
    for (auto& s : t.shards) b += 4 * static_cast<uint64_t>(s.size());
  if (buffer)
    for (size_t k = 0; k < tensors.size(); ++k)
      for (size_t u = 0; u < buffer->units(); ++u) b += 4 * static_cast<uint64_t>(buffer->shard_size(u));
  return b;
}

CheckpointSnapshot take_checkpoint_snapshot(const ShardedTensors& t, const ModelConfig& mc, const std::string& train_config,
                                            const TrainState& state, bool write_shards, bool borrow,
                                            std::shared_ptr<SnapshotBuffer> into) {
  if (!t.plan || !t.backend) throw std::invalid_argument("take_checkpoint_snapshot: no plan or backend");
  std::vector<std::string> names;
  std::vector<size_t> counts;
  for (auto& x : t.tensors) {
    names.push_back(x.name);
    counts.push_back(x.shards.size());
  }
  check_tensor_set(*t.plan, names, counts, "take_checkpoint_snapshot");
  const bool borrowed = borrow && t.backend->host_kernels();
  if (into && !borrowed) {
    if (!into->fits(*t.plan, t.tensors.size()))
      throw std::invalid_argument("take_checkpoint_snapshot: the snapshot buffer does not fit the tensors (" +
                                  std::to_string(into->tensors()) + " tensors of " + std::to_string(into->units()) +
                                  " units, given " + std::to_string(t.tensors.size()) + " of " +
                                  std::to_string(t.plan->units.size()) + ")");
  }
  CheckpointSnapshot s;
  s.plan = *t.plan;
  s.plan_rank = t.plan_rank;
  s.write_shards = write_shards;
  s.state = state;
  s.model_config = canonical_json(mc);
  s.train_config = train_config;
  s.stage = t.stage;
  for (size_t k = 0; k < t.tensors.size(); ++k) {
    const ShardedTensor& x = t.tensors[k];
    CheckpointSnapshot::Tensor c{x.name, {}, {}};
    if (borrowed) {
      c.view.assign(x.shards.begin(), x.shards.end());
    } else if (into) {  // queued on the copy stream, waited for below
      for (size_t u = 0; u < x.shards.size(); ++u) {
        t.backend->to_host_async(into->rows(k, u), x.shards[u], static_cast<size_t>(s.plan.units[u].shard_size));
        c.view.push_back(into->rows(k, u));
      }
    } else {
      c.shards.resize(x.shards.size());
      for (size_t u = 0; u < x.shards.size(); ++u) {
        c.shards[u].resize(static_cast<size_t>(s.plan.units[u].shard_size));
        t.backend->to_host(c.shards[u].data(), x.shards[u], c.shards[u].size());
      }
    }
    s.tensors.push_back(std::move(c));
  }
  if (into && !borrowed) {
    // Synchronous: the copies end here, before the caller queues the next step's update of the
    // shards (a GPU's compute stream is not made to wait: nothing after this call may start early).
    t.backend->wait_host_copies();
    s.buffer = std::move(into);
  }
  return s;
}

namespace {

// An upper bound on the size of the file write_checkpoint_file makes from `snap`: the tensor data
// exactly, plus generous room for HDF5's structures and the metadata (attributes, tables, the
// tokenizer's files). It is what the save reserves (and, where the file system cannot reserve,
// what must be free).
uint64_t checkpoint_file_bound(const CheckpointSnapshot& snap) {
  const uint64_t C = checkpoint_tensor_names().size(), W = static_cast<uint64_t>(snap.plan.world_size);
  const TrainState& st = snap.state;
  uint64_t b = 64u << 10;  // superblock, root group, the small root attributes, the checksum table's own
  b += 2 * (snap.model_config.size() + snap.train_config.size() + st.data_info.size()) + 256 * st.segments.size();
  if (!st.tokenizer.kind.empty()) {
    b += (8u << 10) + 24 * st.tokenizer.end_of_turn_ids.size();
    for (auto& [name, bytes] : st.tokenizer.files) b += (2u << 10) + name.size() + bytes.size();
  }
  for (auto& up : (snap.stage ? snap.stage->file_plan : snap.plan).units)
    b += (8u << 10) + 256 * up.params.size() + W * (24 + 4 * C) + C * 4 * static_cast<uint64_t>(up.padded_numel);
  return b;
}

std::string dir_of(const std::string& path) {
  fs::path dir = fs::path(path).parent_path();
  return dir.empty() ? std::string(".") : dir.string();
}

// The free space of the directory holding `path` (ckpt::free_space_in).
std::string free_space_text(const std::string& path) { return free_space_in(dir_of(path)); }

// Rank 0, before HDF5 opens the file: creates `path` empty and reserves `need` bytes for it
// (fallocate with FALLOC_FL_KEEP_SIZE: the blocks are the file's, its size stays 0, so HDF5's
// create does not truncate them away and the file's bytes are what they would be without). Every
// later write of the save lands in reserved blocks, so a disk that fills up, or a quota reached,
// during the save cannot fail it half-way. Returns "" on success, or when the file system cannot
// reserve (*reserved false: then the free space is checked instead); else the error, the file
// removed.
std::string reserve_checkpoint_file(const std::string& path, uint64_t need, bool* reserved) {
  *reserved = false;
  const std::string kib = std::to_string(need >> 10) + " KiB";
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return "cannot create it: " + std::string(std::strerror(errno));
  int rc, e = 0;
  do {
    rc = ::fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(need));
    e = rc == 0 ? 0 : errno;
  } while (rc != 0 && e == EINTR);
  ::close(fd);
  if (rc == 0) {
    *reserved = true;
    return "";
  }
  if (e == EOPNOTSUPP || e == ENOSYS || e == EINVAL) {  // NFS v3, some FUSE file systems: check instead
    struct statvfs sv {};
    if (::statvfs(dir_of(path).c_str(), &sv) == 0 && static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize < need) {
      ::unlink(path.c_str());
      return "not enough space in '" + dir_of(path) + "' (need " + kib + ", " + free_space_text(path) + ")";
    }
    return "";
  }
  ::unlink(path.c_str());  // frees whatever part was reserved
  const std::string free = free_space_text(path);
  return "not enough space in '" + dir_of(path) + "' (need " + kib + (free.empty() ? "" : ", " + free) +
         "): reserving the file's space failed: " + std::strerror(e);
}

// Why this rank's write of `n` bytes at `offset` of `path` failed: MPI-IO and HDF5 report only
// "file write failed" and errno does not survive them, so the same bytes are written again with
// pwrite (harmless: they belong there) and its errno is returned; 0 if that write succeeds.
int diagnose_write(const std::string& path, haddr_t offset, const void* data, size_t n) {
  if (offset == HADDR_UNDEF) return 0;
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  int e = 0;
  const char* p = static_cast<const char*>(data);
  for (size_t done = 0; done < n && e == 0;) {
    ssize_t w = ::pwrite(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (w > 0) done += static_cast<size_t>(w);
    else if (w == 0) e = EIO;  // (a short write that makes no progress)
    else if (errno != EINTR) e = errno;
  }
  ::close(fd);
  return e;
}

// A write by HDF5 that failed on this rank while a checkpoint file was open for writing, other
// than a tensor row's (see MPI_File_write_at below).
struct Hdf5WriteFailure {
  std::string path;   // the file being written
  int err = 0;        // errno of the first failed write; 0: none
  long long offset = -1;
  long long bytes = 0;
};
thread_local Hdf5WriteFailure* t_capture = nullptr;

// Sets t_capture for its lifetime (RAII); destroying it early suspends the capture (around the
// tensor rows' H5Dwrite, whose failure HDF5 reports and the caller diagnoses itself).
class CaptureHdf5Writes {
 public:
  explicit CaptureHdf5Writes(Hdf5WriteFailure* f) : saved_(t_capture) { t_capture = f; }
  ~CaptureHdf5Writes() { t_capture = saved_; }
  CaptureHdf5Writes(const CaptureHdf5Writes&) = delete;
  CaptureHdf5Writes& operator=(const CaptureHdf5Writes&) = delete;

 private:
  Hdf5WriteFailure* saved_;
};

}  // namespace

}  // namespace shardtrain

// HDF5's metadata is written by rank 0 alone, but inside HDF5's own collectives (a metadata flush:
// barrier, rank 0 writes, then a broadcast of what it wrote; the close's truncate): a write that
// fails there makes rank 0 leave the collective early, and the other ranks wait in the broadcast
// for ever (issue 29: an I/O error in the close's metadata flush on rank 0 hung the save until the
// watchdog). Through MPI's profiling interface this executable sees HDF5's MPI-IO writes: while
// a checkpoint file is written on this thread (t_capture set), a failed write is recorded and
// reported to HDF5 as done, so every rank goes through HDF5's collectives as if nothing happened;
// write_checkpoint_file then agrees on the recorded error (all_ok) like on any other, and the file
// is discarded. HDF5 keeps what it writes in its metadata cache and does not read it back during
// the close; should it re-read an evicted entry whose write failed, that read fails (or its
// checksum does) inside an HDF5 call that the ranks agree on like any other. Outside a save, and
// on other threads, this is PMPI_File_write_at.
extern "C" int MPI_File_write_at(MPI_File fh, MPI_Offset offset, const void* buf, int count, MPI_Datatype datatype,
                                 MPI_Status* status) {
  shardtrain::Hdf5WriteFailure* c = shardtrain::t_capture;
  if (!c) return PMPI_File_write_at(fh, offset, buf, count, datatype, status);
  MPI_Status own;
  if (status == MPI_STATUS_IGNORE) status = &own;
  errno = 0;
  const int rc = PMPI_File_write_at(fh, offset, buf, count, datatype, status);
  int e = errno, size = 0;
  PMPI_Type_size(datatype, &size);
  const long long bytes = static_cast<long long>(size) * count;
  // Open MPI's ompio returns MPI_SUCCESS for a pwritev that failed, with fewer bytes in the status
  // (HDF5 then says "file write failed"): a short count is a failure too.
  MPI_Count done = 0;
  if (rc == MPI_SUCCESS && PMPI_Get_elements_x(status, MPI_BYTE, &done) == MPI_SUCCESS && done >= bytes) return rc;
  if (datatype == MPI_BYTE && offset >= 0)  // MPI-IO may not leave errno: write the bytes again to learn it
    if (int d = shardtrain::diagnose_write(c->path, static_cast<haddr_t>(offset), buf, static_cast<size_t>(bytes))) e = d;
  if (c->err == 0) {
    c->err = e ? e : EIO;
    c->offset = static_cast<long long>(offset);
    c->bytes = bytes;
  }
  PMPI_Status_set_elements(status, datatype, count);
  return MPI_SUCCESS;
}

namespace shardtrain {

namespace {

// The snapshot's tensors in the file's column order: all of them, each once. Throws
// std::invalid_argument if a tensor is missing or does not fit the plan.
std::vector<const CheckpointSnapshot::Tensor*> snapshot_columns(const CheckpointSnapshot& snap) {
  const std::vector<std::string>& names = checkpoint_tensor_names();
  const size_t C = names.size();
  std::vector<const CheckpointSnapshot::Tensor*> cols(C, nullptr);
  {
    std::vector<std::string> given;
    std::vector<size_t> counts;
    for (auto& x : snap.tensors) {
      given.push_back(x.name);
      counts.push_back(x.units());
    }
    check_tensor_set(snap.plan, given, counts, "write_checkpoint_file");
    for (auto& x : snap.tensors) cols[static_cast<size_t>(tensor_column(x.name))] = &x;
    for (size_t k = 0; k < C; ++k)
      if (!cols[k]) throw std::invalid_argument("write_checkpoint_file: the snapshot lacks tensor '" + names[k] + "'");
  }
  return cols;
}

// One rank's write of a checkpoint file: its path, the prefix of its messages, and the capture of
// HDF5's own writes (suspended around a tensor row's H5Dwrite). References into
// write_checkpoint_file's frame, which owns them.
struct WriteContext {
  const std::string& tmp_path;
  const std::string& where;
  Hdf5WriteFailure& hw;
  std::optional<CaptureHdf5Writes>& capture;
};

// The message of the HDF5 write failure recorded in c.hw ("" if none); `when` is added after the offset.
std::string hdf5_write_error(const WriteContext& c, const char* when) {
  const Hdf5WriteFailure& hw = c.hw;
  if (hw.err == 0) return "";
  const std::string free = free_space_text(c.tmp_path);
  return c.where + "writing HDF5's metadata or tables (" + std::to_string(hw.bytes) + " bytes at byte offset " +
         std::to_string(hw.offset) + when + ") failed: " + std::strerror(hw.err) + (free.empty() ? "" : " (" + free + ")");
}

// A unit's tensors: one flat dataset each (created by every rank, so that the ranks' HDF5 metadata
// stays identical), into which this rank writes its plan row r of S elements (valid, then zero
// padding; src[k]: tensor k's) at r*S when it is the row's writer. Records its first failure in `fail`.
void write_unit_rows(WriteContext& c, hid_t g, const UnitPlan& up, const std::vector<const float*>& src, int r,
                     bool writer, hid_t dxpl, std::optional<DirectFileWriter>& rows_out, std::string& fail) {
  const std::vector<std::string>& names = checkpoint_tensor_names();
  const size_t C = names.size();
  const hsize_t S = static_cast<hsize_t>(up.shard_size);
  // One flat dataset per tensor: rank r writes its S elements (valid, then zero padding) at r*S.
  for (size_t k = 0; k < C; ++k) {
    hsize_t dims[1] = {static_cast<hsize_t>(up.padded_numel)};
    H5Id fsp(H5Screate_simple(1, dims, nullptr), H5Sclose);
    H5Id d(chk(H5Dcreate2(g, names[k].c_str(), H5T_IEEE_F32LE, fsp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
               "create dataset " + up.name + "/" + names[k]),
           H5Dclose);
    hsize_t start[1] = {static_cast<hsize_t>(r) * S}, count[1] = {S};
    H5Sselect_hyperslab(fsp, H5S_SELECT_SET, start, nullptr, count, nullptr);
    H5Id msp(H5Screate_simple(1, count, nullptr), H5Sclose);
    if (!writer) {  // another replica group (same shard, written by replica group 0), or another stage's unit
      H5Sselect_none(fsp);
      H5Sselect_none(msp);
    }
    // A failed write (disk full, EIO) may fail on this rank only. The other tensors' datasets
    // are still created (the ranks' HDF5 metadata stays identical, for the close).
    const float* rows = src[k];
    // The rows themselves: at the dataset's file offset (contiguous layout, allocated at
    // creation: parallel HDF5 allocates early), by DirectFileWriter, past the page cache
    // (direct_io.h says why); through H5Dwrite only if HDF5 gives no offset. Either way the
    // same bytes at the same place (tests/bench/bitwise_ab.sh: every dataset and attribute).
    const haddr_t at = H5Dget_offset(d);
    if (writer && at != HADDR_UNDEF) {
      if (!rows_out) rows_out.emplace(c.tmp_path);
      if (const int e = rows_out->write(at + start[0] * 4, rows, 4 * S); e != 0 && fail.empty()) {
        const std::string free = free_space_text(c.tmp_path);
        fail = c.where + "writing " + up.name + "/" + names[k] + " failed: " + std::strerror(e) +
               (free.empty() ? "" : " (" + free + ")");
      }
      continue;
    }
    c.capture.reset();  // a tensor row: its failure is HDF5's to report, diagnosed below
    const herr_t wrc = H5Dwrite(d, H5T_NATIVE_FLOAT, msp, fsp, dxpl, rows);
    c.capture.emplace(&c.hw);
    if (wrc < 0 && fail.empty()) {
      const std::string detail = h5_detail();
      const int e = writer ? diagnose_write(c.tmp_path, H5Dget_offset(d) + start[0] * 4, rows, 4 * S) : 0;
      const std::string free = free_space_text(c.tmp_path);
      fail = c.where + "writing " + up.name + "/" + names[k] + " failed: " +
             (e ? std::string(std::strerror(e)) : std::string("write error (written again with pwrite, it succeeded)")) +
             " (HDF5: " + detail + (free.empty() ? "" : "; " + free) + ")";
    }
  }
}

// What a rank is to one unit's rows at a save.
enum UnitRole : uint64_t {
  kAbsent = 0,   // another pipeline stage's unit: no rows here
  kWriter = 1,   // writes its plan row
  kReplica = 2,  // holds a copy of a written row (another replica group): compared, a difference warned of
  kTiedCopy = 3, // the last stage's copy of the tied embedding: compared, a difference refuses the save
};

// Collective. The [W, C] checksum table of unit `up` from every rank's `my_crc`: every rank's
// checksums, with its plan row and its role: row r of the [W, C] table comes from the rank that
// wrote plan row r (CheckpointSnapshot::write_shards; the mesh says which). Hybrid sharding:
// every other rank of row r (another replica group) must repeat them (identical replicas); the
// first that does not is described in `diverged` (if still empty). A tied copy (pipeline) that
// does not repeat them is described in `tied` (if still empty). Throws std::logic_error if a
// plan row has no writer or more than one.
std::vector<uint32_t> gather_unit_checksums(Comm& comm, const UnitPlan& up, int W, int r, UnitRole role,
                                            const std::vector<uint64_t>& my_crc, std::string& diverged,
                                            std::string& tied) {
  const std::vector<std::string>& names = checkpoint_tensor_names();
  const size_t C = names.size();
  const size_t E = C + 2;  // per rank: plan row, writer, C checksums
  std::vector<uint64_t> mine(E), all(static_cast<size_t>(comm.world_size()) * E);
  mine[0] = static_cast<uint64_t>(r);
  mine[1] = role;
  std::copy(my_crc.begin(), my_crc.end(), mine.begin() + 2);
  comm.all_gather(mine.data(), all.data(), E);
  const size_t WC = static_cast<size_t>(W) * C;
  std::vector<uint32_t> crc32s(WC, 0);
  std::vector<int> wrote(static_cast<size_t>(W), -1);  // plan row -> the global rank that wrote it
  for (int q = 0; q < comm.world_size(); ++q) {
    const uint64_t* e = all.data() + static_cast<size_t>(q) * E;
    if (e[1] != kWriter) continue;
    if (e[0] >= static_cast<uint64_t>(W) || wrote[e[0]] >= 0)
      throw std::logic_error("write_checkpoint_file: plan row " + std::to_string(e[0]) + " written by more than one rank");
    wrote[e[0]] = q;
    for (size_t k = 0; k < C; ++k) crc32s[e[0] * C + k] = static_cast<uint32_t>(e[2 + k]);
  }
  for (int row = 0; row < W; ++row)
    if (wrote[static_cast<size_t>(row)] < 0)
      throw std::logic_error("write_checkpoint_file: no rank writes plan row " + std::to_string(row));
  for (int q = 0; q < comm.world_size(); ++q) {
    const uint64_t* e = all.data() + static_cast<size_t>(q) * E;
    if (e[1] != kReplica && e[1] != kTiedCopy) continue;
    std::string& out = e[1] == kTiedCopy ? tied : diverged;
    for (size_t k = 0; k < C && out.empty(); ++k)
      if (static_cast<uint32_t>(e[2 + k]) != crc32s[e[0] * C + k]) {
        char b[64];
        std::snprintf(b, sizeof b, " (CRC32 %08x, written %08x)", static_cast<unsigned>(e[2 + k]), crc32s[e[0] * C + k]);
        out = "unit '" + up.name + "', " + names[k] + " of shard rank " + std::to_string(e[0]) + ": global rank " +
              std::to_string(q) + " differs from rank " + std::to_string(wrote[e[0]]) + (e[1] == kTiedCopy ? b : "");
      }
  }
  return crc32s;
}

// The end of write_checkpoint_file on every rank, success (`failed` null) or not: after a failure
// the partial file's blocks are given back, the file is closed, the close's errors agreed on, the
// reservation's excess freed; after a failure the file is removed and the failure rethrown.
void finish_checkpoint_file(Comm& comm, WriteContext& c, H5Id& file, std::exception_ptr failed, std::string err,
                            bool reserved) {
  // Every rank is here, at the same point (a logic_error above is the same on every rank too).
  // After a failure, give the partial file's blocks back before the close: the close flushes
  // HDF5's cached metadata (a few KiB, a collective sync point), and a write failing in it would
  // leave the ranks in different MPI calls; on a full disk the freed blocks let it succeed. The
  // file is discarded anyway.
  if (failed) {
    if (comm.rank() == 0) (void)::truncate(c.tmp_path.c_str(), 0);
    comm.barrier();
  }
  // Close on every rank, success or not: an HDF5 file left open is closed by HDF5 inside
  // MPI_Finalize, after MPI is gone (a segfault).
  // (A metadata write failing in the close is recorded (hw), not failed inside HDF5: every rank
  // leaves the close, and the agreement below carries rank 0's error to the others.)
  if (file.close() < 0 && !failed) err = c.where + "closing it failed (" + h5_detail() + ")";
  c.capture.reset();
  if (err.empty() && !failed && c.hw.err) err = hdf5_write_error(c, ", closing the file");
  if (!failed && comm.rank() == 0 && reserved) {
    // Give back what the reservation held beyond the file's end (truncating to the same size
    // frees the blocks past it).
    std::error_code ec;
    const auto size = fs::file_size(c.tmp_path, ec);
    if (!ec) (void)::truncate(c.tmp_path.c_str(), static_cast<off_t>(size));
  }
  try {
    if (!failed) all_ok(comm, err.empty(), err);
  } catch (const CollectiveError&) {
    failed = std::current_exception();
  }
  if (failed) {
    comm.barrier();  // every rank has closed the file
    if (comm.rank() == 0) ::unlink(c.tmp_path.c_str());
    std::rethrow_exception(failed);
  }
}

// File unit u's unit in the snapshot, -1 for another pipeline stage's unit: a stage (snap.stage)
// holds some units of the file's; without a stage, the identity. Throws std::invalid_argument when
// the stage's units do not fit the snapshot or the file's plan.
std::vector<int> snapshot_units(const CheckpointSnapshot& snap) {
  const StageUnits* su = snap.stage.get();
  const ShardPlan& plan = su ? su->file_plan : snap.plan;
  std::vector<int> local(plan.units.size(), -1);
  if (su) {
    if (su->file_unit.size() != snap.plan.units.size() || su->tied_copy.size() != snap.plan.units.size() ||
        su->unit_stage.size() != plan.units.size() || plan.world_size != snap.plan.world_size)
      throw std::invalid_argument("write_checkpoint_file: the stage's units do not fit the snapshot");
    for (size_t i = 0; i < snap.plan.units.size(); ++i) {
      const int u = su->file_unit[i];
      if (u < 0 || static_cast<size_t>(u) >= plan.units.size() || plan.units[static_cast<size_t>(u)].shard_size !=
                                                                       snap.plan.units[i].shard_size)
        throw std::invalid_argument("write_checkpoint_file: stage unit '" + snap.plan.units[i].name +
                                    "' does not fit the file's plan");
      local[static_cast<size_t>(u)] = static_cast<int>(i);
    }
  } else {
    for (size_t u = 0; u < plan.units.size(); ++u) local[u] = static_cast<int>(u);
  }
  return local;
}

// Collective. Reserves the whole file's space before anything is written (docs/checkpoint-format.md,
// "A failure during the write"): a full disk is refused here, by rank 0, before any rank enters
// HDF5; the ranks agree on the outcome (every rank throws the same CollectiveError). (The test
// suite sets SHARDTRAIN_TEST_SKIP_SPACE_CHECK to exercise the mid-write failure path instead.)
// Returns whether the space was reserved (rank 0; see reserve_checkpoint_file).
bool reserve_file_space(Comm& comm, const std::string& tmp_path, const CheckpointSnapshot& snap,
                        const std::string& where) {
  std::string err;
  bool reserved = false;
  if (comm.rank() == 0 && !std::getenv("SHARDTRAIN_TEST_SKIP_SPACE_CHECK")) {
    std::string e = reserve_checkpoint_file(tmp_path, checkpoint_file_bound(snap), &reserved);
    if (!e.empty()) err = where + e;
  }
  all_ok(comm, err.empty(), err);
  return reserved;
}

// This rank's part in one file unit of S elements per shard: its role, and per tensor (the file's
// column order, `cols`) its rows and their CRC32. i: the unit in the snapshot, -1 when this rank
// does not hold it (rows: an empty selection's buffer, CRC32s 0).
struct UnitShare {
  UnitRole role;
  std::vector<const float*> src;
  std::vector<uint64_t> crc;
};
UnitShare unit_share(const CheckpointSnapshot& snap, const std::vector<const CheckpointSnapshot::Tensor*>& cols, int i,
                     hsize_t S) {
  static const float kNoRows = 0;  // a unit this rank does not hold: an empty selection's buffer
  const StageUnits* su = snap.stage.get();
  const bool writer = snap.write_shards;
  const bool copy = su && i >= 0 && su->tied_copy[static_cast<size_t>(i)];
  const size_t C = cols.size();
  UnitShare s{i < 0 ? kAbsent : copy ? (writer ? kTiedCopy : kReplica) : writer ? kWriter : kReplica,
              std::vector<const float*>(C, &kNoRows), std::vector<uint64_t>(C, 0)};
  if (i >= 0)
    for (size_t k = 0; k < C; ++k) {
      s.src[k] = cols[k]->rows(static_cast<size_t>(i));
      s.crc[k] = crc32_of(s.src[k], S);
    }
  return s;
}

}  // namespace

void write_checkpoint_file(Comm& comm, const std::string& tmp_path, const CheckpointSnapshot& snap) {
  quiet_hdf5();
  // One logical copy for the plan's W = G ranks (G: shard group size; the world size without hybrid
  // sharding), each plan row written by the one rank whose snapshot says write_shards (who writes
  // is the mesh's decision, Mesh::writes_checkpoint). The ranks of the other replica groups hold
  // identical shards: they take part in every HDF5 call with empty selections.
  // A pipeline stage (snap.stage) holds some units of the file's: `local` maps each file unit to
  // the snapshot's (-1: another stage's).
  const StageUnits* su = snap.stage.get();
  const ShardPlan& plan = su ? su->file_plan : snap.plan;
  const int W = plan.world_size, r = snap.plan_rank;
  const std::vector<int> local = snapshot_units(snap);
  const std::vector<const CheckpointSnapshot::Tensor*> cols = snapshot_columns(snap);
  const std::string where = "checkpoint '" + tmp_path + "': ";
  const bool reserved = reserve_file_space(comm, tmp_path, snap, where);
  // HDF5's internal collectives (create, the metadata flushes, close) are invisible to Comm: if a
  // failure inside HDF5 still left ranks in different MPI calls (an I/O error in a metadata write
  // on one rank; a full disk cannot get there: reserve_file_space), the watchdog ends the job, and its
  // message says that this, not only a dead rank, can be why.
  CommWatch watch(comm, "checkpoint write (parallel HDF5; also after a write error inside HDF5 on some rank)");
  // HDF5's own writes on this rank (metadata, tables) that fail are recorded, not failed inside
  // HDF5 (MPI_File_write_at above), and agreed on with the rest.
  Hdf5WriteFailure hw;
  hw.path = tmp_path;
  std::optional<CaptureHdf5Writes> capture(std::in_place, &hw);
  WriteContext wc{tmp_path, where, hw, capture};
  std::string why, err;
  H5Id file = create_file(comm, tmp_path, &why);
  if (!file.ok()) err = where + "cannot create it (" + why + ")";
  all_ok(comm, err.empty(), err);

  // Tensor data and tables are written with independent MPI-IO: a rank whose write fails returns
  // from it alone and no rank waits for it inside HDF5 (with collective MPI-IO, a failing
  // aggregator strands the others in the two-phase exchange). The write is a series of steps (the
  // root attributes; each unit's group, attributes, datasets and rows; each unit's tables; the
  // metadata checksums); in a step each rank records its first failure, and every step ends in
  // the ranks' agreement on it (all_ok), so they all leave the write at the same point with the
  // same message, and no rank skips an HDF5 call that another makes after a failure it recorded
  // (a failed write, which never throws; a call that throws on one rank alone still leaves the
  // ranks apart until the collective watchdog: issue 53's note). Parallel HDF5 needs
  // every rank to make the same metadata calls (create a group, a dataset, an attribute) in the
  // same order: a rank that skipped some holds other metadata and another end of allocation, and
  // the close's collectives then differ (issue 53: a table write of rank 0 that failed was agreed
  // only after the next unit, whose calls rank 0 skipped; in the close rank 0 waited in
  // MPI_File_set_size's barrier, rank 1 in the metadata cache's broadcast, until the watchdog).
  std::string fail;
  auto step = [&](auto&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      if (fail.empty()) fail = where + e.what();
    }
    if (fail.empty()) fail = hdf5_write_error(wc, "");
    all_ok(comm, fail.empty(), fail);
  };
  std::exception_ptr failed;  // the agreed failure (the same CollectiveError on every rank)
  try {
    MetaSums ms;  // every rank computes the same table from the same values
    H5Id units, dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
    H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_INDEPENDENT);
    std::optional<DirectFileWriter> rows_out;  // opened at this rank's first row (direct_io.h)
    step([&] {
      write_root_attributes(file, ms, snap);
      units = H5Id(chk(H5Gcreate2(file, "units", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "create group /units"), H5Gclose);
      if (!snap.state.tokenizer.kind.empty()) write_tokenizer_group(comm, file, ms, snap.state.tokenizer, dxpl);
    });
    std::string diverged, tied;
    for (size_t u = 0; u < plan.units.size(); ++u) {
      const UnitPlan& up = plan.units[u];
      const UnitShare mine = unit_share(snap, cols, local[u], static_cast<hsize_t>(up.shard_size));
      H5Id g;
      step([&] {
        g = H5Id(chk(H5Gcreate2(units, up.name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "create group " + up.name),
                 H5Gclose);
        write_unit_attributes(g, ms, static_cast<int>(u), up);
        if (su) put_i64(g, ms, "units/" + up.name, "stage", su->unit_stage[u]);
        if (snap.tp.tp > 1) write_unit_tp_tables(comm, g, ms, up, snap.tp.units.at(u), dxpl);
        write_unit_rows(wc, g, up, mine.src, r, mine.role == kWriter, dxpl, rows_out, fail);
      });
      const std::vector<uint32_t> crc32s = gather_unit_checksums(comm, up, W, r, mine.role, mine.crc, diverged, tied);
      if (!tied.empty())  // every rank saw the same table: all refuse alike, and nothing is published
        throw CollectiveError(0, where + "the last pipeline stage's copy of the tied embedding differs from the first "
                                 "stage's (" + tied + "): the copies must be identical (their gradients are summed "
                                 "before every update); the checkpoint is not published. This is a bug in shardtrain, "
                                 "not an error of the run's settings: please report it");
      step([&] { write_unit_tables(comm, g, ms, up, W, crc32s, dxpl); });  // rank 0 writes them: agreed now
    }
    step([&] { write_metadata_checksums(file, ms); });
    if (!diverged.empty())  // every rank saw the same table; the writing replica's copy is what was saved
      log_info(comm, "warning: checkpoint '" + tmp_path + "': the hybrid-sharding replica groups hold different "
                     "parameters or AdamW state (" + diverged + "); the writing replica group's copy is saved");
  } catch (const CollectiveError&) {
    failed = std::current_exception();
  }
  finish_checkpoint_file(comm, wc, file, failed, err, reserved);
}

TrainState load_checkpoint(Comm& comm, const std::string& path, const ShardedTensors& into, const ModelConfig& mc,
                           const CheckpointInfo* given) {
  if (!into.plan || !into.backend) throw std::invalid_argument("load_checkpoint: no plan or backend");
  {
    std::vector<std::string> names;
    std::vector<size_t> counts;
    for (auto& x : into.tensors) {
      names.push_back(x.name);
      counts.push_back(x.shards.size());
    }
    check_tensor_set(*into.plan, names, counts, "load_checkpoint");
  }
  CheckpointInfo read;
  const CheckpointInfo& info = given ? *given : (read = read_checkpoint_info(comm, path));
  const ShardPlan& plan = *into.plan;
  // Hybrid sharding: every replica group reads the slices of its own shard ranks.
  const int M = plan.world_size, r = into.plan_rank;
  const size_t C = checkpoint_tensor_names().size();
  std::string err;
  // Structure checks: identical on every rank (the ranks agreed on the metadata), agreed anyway.
  try {
    std::vector<std::string> diff = architecture_differences(info.model_config, canonical_json(mc));
    if (!diff.empty()) {
      std::string d;
      for (auto& x : diff) d += (d.empty() ? "" : ", ") + x;
      throw std::runtime_error("model config does not match the requested one (" + d + ")");
    }
    // A pipeline stage loads its own units, but the file must be a whole model's.
    check_checkpoint_layout(info, into.stage ? into.stage->file_plan : plan);
    if (into.stage)
      for (const UnitPlan& up : plan.units) {
        auto it = std::find_if(info.units.begin(), info.units.end(), [&](auto& x) { return x.name == up.name; });
        if (it == info.units.end()) throw std::runtime_error("missing unit '" + up.name + "'");
        if (it->numel != up.numel)
          throw std::runtime_error("unit '" + up.name + "' holds " + std::to_string(it->numel) +
                                   " elements (attribute 'numel'), expected " + std::to_string(up.numel));
      }
  } catch (const std::exception& e) {
    err = "checkpoint '" + path + "': " + e.what();
  }
  all_ok(comm, err.empty(), err);

  // Data: every rank opens the file itself and reads, independently, each saved slice that
  // overlaps its own shard under the current plan, plus the slices q with q % M == r (so that
  // every slice is verified by some rank); each slice read is checked against its CRC32 before use.
  Backend<float>& be = *into.backend;
  try {
    std::string why;
    H5Id file = open_local(path, &why);
    if (!file.ok()) throw std::runtime_error("cannot open (" + why + ")");
    std::vector<float> slice, out;
    for (size_t u = 0; u < plan.units.size(); ++u) {
      const UnitPlan& up = plan.units[u];
      const CheckpointUnitInfo& ui =
          *std::find_if(info.units.begin(), info.units.end(), [&](auto& x) { return x.name == up.name; });
      const std::string ug = "units/" + up.name;
      const RankShard& rs = up.ranks[r];
      const int64_t S = ui.shard_size, lo = rs.start, hi = rs.start + rs.valid;  // my elements [lo, hi)
      std::set<int> qs;
      for (int q = r; q < info.world_size; q += M) qs.insert(q);
      if (hi > lo)
        for (int64_t q = lo / S; q <= (hi - 1) / S; ++q) qs.insert(static_cast<int>(q));
      for (const ShardedTensor& t : into.tensors) {
        const size_t k = static_cast<size_t>(tensor_column(t.name));
        const std::string dsname = ug + "/" + t.name;
        H5Id d(H5Dopen2(file, dsname.c_str(), H5P_DEFAULT), H5Dclose);
        if (!d.ok()) throw std::runtime_error("dataset '" + dsname + "' is missing");
        H5Id fsp(H5Dget_space(d), H5Sclose);
        if (H5Sget_simple_extent_npoints(fsp) != ui.padded_numel)
          throw std::runtime_error("dataset '" + dsname + "' has " + std::to_string(H5Sget_simple_extent_npoints(fsp)) +
                                   " elements, expected " + std::to_string(ui.padded_numel));
        out.assign(static_cast<size_t>(up.shard_size), 0.0f);  // padding stays zero
        for (int q : qs) {
          hsize_t start[1] = {static_cast<hsize_t>(q) * static_cast<hsize_t>(S)}, count[1] = {static_cast<hsize_t>(S)};
          H5Sselect_hyperslab(fsp, H5S_SELECT_SET, start, nullptr, count, nullptr);
          H5Id msp(H5Screate_simple(1, count, nullptr), H5Sclose);
          slice.resize(static_cast<size_t>(S));
          if (H5Dread(d, H5T_NATIVE_FLOAT, msp, fsp, H5P_DEFAULT, slice.data()) < 0)
            throw std::runtime_error("cannot read '" + dsname + "' (" + h5_detail() + ")");
          uint32_t c = crc32_of(slice.data(), slice.size()), want = ui.crc32[static_cast<size_t>(q) * C + k];
          if (c != want) {
            char b[160];
            std::snprintf(b, sizeof b, "slice of saving rank %d fails its CRC32 check (stored %08x, computed %08x)", q,
                          want, c);
            throw std::runtime_error("dataset '" + dsname + "': " + b + "; the file is damaged");
          }
          for (int64_t p = std::max(lo, q * S); p < std::min(hi, (q + 1) * S); ++p)
            out[static_cast<size_t>(p - lo)] = slice[static_cast<size_t>(p - q * S)];
        }
        be.from_host(t.shards[u], out.data(), out.size());
      }
    }
  } catch (const std::exception& e) {
    err = "checkpoint '" + path + "': " + e.what();
  }
  all_ok(comm, err.empty(), err);
  TrainState st;
  st.step = info.step;
  st.tokens_seen = info.tokens_seen;
  st.saved_world_size = info.world_size;
  st.segments = info.segments;
  st.data_info = info.data_info;
  st.tokenizer = info.tokenizer;
  st.spikes = info.spikes;
  st.seed = read_json(info.rng_state, json_limits::kCheckpointAttr).at("seed").get<uint64_t>();  // checked by read_checkpoint_info
  return st;
}

}  // namespace shardtrain
