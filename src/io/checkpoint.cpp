// HDF5 checkpoints over MPI-IO. Writes are collective (every rank writes exactly one slice per
// dataset, never an empty one, thanks to padding); reads are independent, so ranks may read
// different numbers of slices (checksum verification, resharding) without a collective mismatch.
#include "shardtrain/checkpoint.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <hdf5.h>
#include <mpi.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "shardtrain/files.h"
#include "shardtrain/train.h"

namespace shardtrain {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kFormatName = "shardtrain-checkpoint";
constexpr int kMaxDims = 4;
constexpr int kNameLen = 128;
const char* const kMoments[3] = {"params", "adam_m", "adam_v"};

// Owns an HDF5 id; closes it with the right H5*close.
class H5Id {
 public:
  H5Id() = default;
  H5Id(hid_t id, herr_t (*closer)(hid_t)) : id_(id), close_(closer) {}
  ~H5Id() { reset(); }
  H5Id(H5Id&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  H5Id& operator=(H5Id&& o) noexcept {
    if (this != &o) { reset(); id_ = o.id_; close_ = o.close_; o.id_ = -1; }
    return *this;
  }
  H5Id(const H5Id&) = delete;
  operator hid_t() const { return id_; }
  bool ok() const { return id_ >= 0; }
  void reset() { if (id_ >= 0 && close_) close_(id_); id_ = -1; }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

struct H5Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
hid_t chk(hid_t id, const std::string& what) {
  if (id < 0) throw H5Error(what);
  return id;
}
void chk(herr_t rc, const std::string& what, int) {
  if (rc < 0) throw H5Error(what);
}

// The packed record of one row of a unit's param_table.
struct ParamRow {
  char name[kNameLen];
  int64_t offset;
  int64_t numel;
  int32_t ndim;
  int64_t shape[kMaxDims];
};

H5Id param_row_type() {
  H5Id str(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(str, kNameLen);
  H5Tset_strpad(str, H5T_STR_NULLTERM);
  hsize_t dims[1] = {kMaxDims};
  H5Id arr(H5Tarray_create2(H5T_STD_I64LE, 1, dims), H5Tclose);
  H5Id t(H5Tcreate(H5T_COMPOUND, sizeof(ParamRow)), H5Tclose);
  H5Tinsert(t, "name", HOFFSET(ParamRow, name), str);
  H5Tinsert(t, "offset", HOFFSET(ParamRow, offset), H5T_STD_I64LE);
  H5Tinsert(t, "numel", HOFFSET(ParamRow, numel), H5T_STD_I64LE);
  H5Tinsert(t, "ndim", HOFFSET(ParamRow, ndim), H5T_STD_I32LE);
  H5Tinsert(t, "shape", HOFFSET(ParamRow, shape), arr);
  return t;
}

// Names HDF5's innermost error, which is often the informative one (e.g. "truncated file").
std::string h5_detail() {
  std::string msg;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD,
           [](unsigned, const H5E_error2_t* e, void* out) -> herr_t {
             auto* s = static_cast<std::string*>(out);
             if (s->empty() && e->desc) *s = e->desc;
             return 0;
           },
           &msg);
  return msg;
}

// Collective open/create through MPI-IO. On failure returns an invalid id and sets *why to HDF5's
// own reason (read before any other HDF5 call clears the error stack).
H5Id open_file(Comm& comm, const std::string& path, bool create, std::string* why) {
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  H5Pset_fapl_mpio(fapl, reinterpret_cast<MPI_Comm>(comm.mpi_handle()), MPI_INFO_NULL);
  hid_t f = create ? H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl)
                   : H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  if (f < 0 && why) *why = h5_detail();
  H5Pclose(fapl);
  return H5Id(f, H5Fclose);
}

// Attributes. Every rank writes the same value (parallel HDF5 requires attribute writes to be
// collective with identical data).
void write_attr_str(hid_t obj, const char* name, const std::string& v) {
  H5Id t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t, H5T_VARIABLE);
  H5Tset_cset(t, H5T_CSET_UTF8);
  H5Id sp(H5Screate(H5S_SCALAR), H5Sclose);
  H5Id a(chk(H5Acreate2(obj, name, t, sp, H5P_DEFAULT, H5P_DEFAULT), std::string("create attribute ") + name), H5Aclose);
  const char* p = v.c_str();
  chk(H5Awrite(a, t, &p), std::string("write attribute ") + name, 0);
}
void write_attr_i64(hid_t obj, const char* name, int64_t v) {
  H5Id sp(H5Screate(H5S_SCALAR), H5Sclose);
  H5Id a(chk(H5Acreate2(obj, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT), std::string("create attribute ") + name), H5Aclose);
  chk(H5Awrite(a, H5T_NATIVE_INT64, &v), std::string("write attribute ") + name, 0);
}
std::string read_attr_str(hid_t obj, const char* name, const std::string& where) {
  if (H5Aexists(obj, name) <= 0) throw H5Error(where + " has no attribute '" + name + "'");
  H5Id a(chk(H5Aopen(obj, name, H5P_DEFAULT), std::string("open attribute ") + name), H5Aclose);
  H5Id ft(H5Aget_type(a), H5Tclose);
  if (H5Tget_class(ft) != H5T_STRING) throw H5Error(where + ": attribute '" + name + "' is not a string");
  H5Id t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t, H5T_VARIABLE);
  H5Tset_cset(t, H5T_CSET_UTF8);
  if (H5Tis_variable_str(ft) > 0) {
    char* p = nullptr;
    chk(H5Aread(a, t, &p), std::string("read attribute ") + name, 0);
    std::string s = p ? p : "";
    H5free_memory(p);
    return s;
  }
  size_t n = H5Tget_size(ft);
  std::string s(n, '\0');
  H5Id ft2(H5Tcopy(ft), H5Tclose);
  chk(H5Aread(a, ft2, s.data()), std::string("read attribute ") + name, 0);
  s.resize(strnlen(s.data(), n));
  return s;
}
int64_t read_attr_i64(hid_t obj, const char* name, const std::string& where) {
  if (H5Aexists(obj, name) <= 0) throw H5Error(where + " has no attribute '" + name + "'");
  H5Id a(chk(H5Aopen(obj, name, H5P_DEFAULT), std::string("open attribute ") + name), H5Aclose);
  int64_t v = 0;
  chk(H5Aread(a, H5T_NATIVE_INT64, &v), std::string("read attribute ") + name, 0);
  return v;
}

// Collective write of a whole small dataset by rank 0 (other ranks select nothing).
void write_small(Comm& comm, hid_t grp, const char* name, hid_t ftype, hid_t mtype, int rank, const hsize_t* dims,
                 const void* data, hid_t dxpl) {
  H5Id fsp(H5Screate_simple(rank, dims, nullptr), H5Sclose);
  H5Id d(chk(H5Dcreate2(grp, name, ftype, fsp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), std::string("create dataset ") + name), H5Dclose);
  H5Id msp(H5Screate_simple(rank, dims, nullptr), H5Sclose);
  if (comm.rank() != 0) {
    H5Sselect_none(fsp);
    H5Sselect_none(msp);
  }
  chk(H5Dwrite(d, mtype, msp, fsp, dxpl, data), std::string("write dataset ") + name, 0);
}

uint32_t crc32_of(const float* p, size_t n) {
  uLong c = crc32(0L, Z_NULL, 0);
  const Bytef* b = reinterpret_cast<const Bytef*>(p);
  size_t bytes = n * sizeof(float);
  while (bytes > 0) {  // zlib's length is uInt
    uInt chunk = static_cast<uInt>(std::min<size_t>(bytes, 1u << 30));
    c = crc32(c, b, chunk);
    b += chunk;
    bytes -= chunk;
  }
  return static_cast<uint32_t>(c);
}

void fsync_path(const std::string& p, bool dir) {
  int fd = ::open(p.c_str(), dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

struct QuietHdf5 {  // shardtrain reports HDF5 failures itself, with the file name
  QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
};

// Published checkpoints in `dir` ("step_NNNNNNNN.h5"), oldest first. Temporary files never match.
std::vector<std::string> published_checkpoints(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    std::string n = e.path().filename().string();
    if (n.size() == 16 && n.rfind("step_", 0) == 0 && n.ends_with(".h5")) names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  char b[64];
  std::snprintf(b, sizeof b, "step_%08lld.h5", static_cast<long long>(step));
  return b;
}

void write_checkpoint_file(Comm& comm, const std::string& tmp_path, Fsdp<float>& f, AdamW<float>& opt,
                           const ModelConfig& mc, const TrainConfig& tc, const TrainState& st) {
  static QuietHdf5 quiet;
  const int W = comm.world_size(), r = comm.rank();
  Backend<float>& be = f.backend();
  const ShardPlan& plan = f.plan();
  std::string err;
  // Refuse up front when the file cannot fit, rather than fail half-way through. (The test suite
  // sets SHARDTRAIN_TEST_SKIP_SPACE_CHECK to exercise the mid-write failure path instead.)
  if (r == 0 && !std::getenv("SHARDTRAIN_TEST_SKIP_SPACE_CHECK")) {
    uint64_t need = 64u << 10;  // HDF5 superblock, root attributes
    for (auto& up : plan.units) need += (8u << 10) + 3 * 4 * static_cast<uint64_t>(up.padded_numel);
    struct statvfs sv {};
    fs::path dir = fs::path(tmp_path).parent_path();
    if (dir.empty()) dir = ".";
    if (::statvfs(dir.c_str(), &sv) == 0 && static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize < need)
      err = "checkpoint '" + tmp_path + "': not enough space in '" + dir.string() + "' (need " +
            std::to_string(need >> 10) + " KiB, " + std::to_string((static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize) >> 10) +
            " KiB free)";
  }
  all_ok(comm, err.empty(), err);
  // HDF5's internal collectives are invisible to Comm; a failure inside HDF5 on one rank (a full
  // disk during a metadata flush) can leave ranks in different MPI calls. The watchdog ends the
  // job then, instead of a hang.
  CommWatch watch(comm, "checkpoint write (parallel HDF5)");
  try {
    std::string why;
    H5Id file = open_file(comm, tmp_path, true, &why);
    if (!file.ok()) throw H5Error("cannot create '" + tmp_path + "': " + why);
    json tcj = {{"seq_len", tc.seq_len}, {"global_batch", tc.global_batch}, {"micro_batch", tc.micro_batch},
                {"steps", tc.steps}, {"lr", tc.lr}, {"min_lr", tc.min_lr}, {"warmup", tc.warmup},
                {"beta1", tc.beta1}, {"beta2", tc.beta2}, {"eps", tc.eps}, {"weight_decay", tc.weight_decay},
                {"clip", tc.clip}, {"seed", tc.seed}, {"precision", tc.precision}};
    write_attr_str(file, "format", kFormatName);
    write_attr_i64(file, "format_version", kCheckpointFormatVersion);
    write_attr_i64(file, "step", st.step);
    write_attr_i64(file, "tokens_seen", st.tokens_seen);
    write_attr_i64(file, "world_size", W);
    write_attr_str(file, "model_config", canonical_json(mc));
    write_attr_str(file, "train_config", tcj.dump());
    write_attr_str(file, "data_position", json({{"next_batch_index", st.step}, {"split", "train"}}).dump());
    write_attr_str(file, "rng_state", json({{"seed", st.seed}, {"generator", "splitmix64 counter (data.h, shard.h)"}}).dump());
    write_attr_str(file, "program_version", kProgramVersion);
    H5Id units(chk(H5Gcreate2(file, "units", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "create group /units"), H5Gclose);
    H5Id dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
    H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_COLLECTIVE);
    H5Id rowt = param_row_type();
    std::vector<float> host;
    std::string write_err;
    for (int u = 0; u < f.num_units(); ++u) {
      const UnitPlan& up = plan.units[u];
      const hsize_t S = static_cast<hsize_t>(up.shard_size);
      H5Id g(chk(H5Gcreate2(units, up.name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "create group " + up.name), H5Gclose);
      write_attr_i64(g, "index", u);
      write_attr_i64(g, "numel", up.numel);
      write_attr_i64(g, "shard_size", up.shard_size);
      write_attr_i64(g, "padded_numel", up.padded_numel);
      // The three flat buffers: rank r writes its S elements (valid, then zero padding) at r*S.
      uint32_t my_crc[3];
      float* src[3] = {f.param_shard(u), opt.m()[u].data(), opt.v()[u].data()};
      for (int k = 0; k < 3; ++k) {
        hsize_t dims[1] = {static_cast<hsize_t>(up.padded_numel)};
        H5Id fsp(H5Screate_simple(1, dims, nullptr), H5Sclose);
        H5Id d(chk(H5Dcreate2(g, kMoments[k], H5T_IEEE_F32LE, fsp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                   "create dataset " + up.name + "/" + kMoments[k]),
               H5Dclose);
        hsize_t start[1] = {static_cast<hsize_t>(r) * S}, count[1] = {S};
        H5Sselect_hyperslab(fsp, H5S_SELECT_SET, start, nullptr, count, nullptr);
        H5Id msp(H5Screate_simple(1, count, nullptr), H5Sclose);
        host.resize(S);
        be.to_host(host.data(), src[k], S);
        my_crc[k] = crc32_of(host.data(), S);
        // A failed write (disk full) may fail on this rank only: record it and agree after the
        // unit, so that every rank leaves the collective sequence at the same point.
        if (H5Dwrite(d, H5T_NATIVE_FLOAT, msp, fsp, dxpl, host.data()) < 0 && write_err.empty())
          write_err = "write " + up.name + "/" + kMoments[k] + " failed (" + h5_detail() + "; disk full?)";
      }
      all_ok(comm, write_err.empty(), write_err);
      // Shard table [W, 3] (start, valid, padding) and slice checksums [W, 3] (params, adam_m, adam_v).
      std::vector<int64_t> table;
      for (auto& rs : up.ranks) table.insert(table.end(), {rs.start, rs.valid, rs.padding});
      hsize_t tdims[2] = {static_cast<hsize_t>(W), 3};
      write_small(comm, g, "shard_table", H5T_STD_I64LE, H5T_NATIVE_INT64, 2, tdims, table.data(), dxpl);
      // Every rank's checksums: row r of [W, 3] comes from rank r.
      uint64_t mine[3] = {my_crc[0], my_crc[1], my_crc[2]};
      std::vector<uint64_t> table_crc(static_cast<size_t>(W) * 3);
      comm.all_gather(mine, table_crc.data(), 3);
      std::vector<uint32_t> crc32s(table_crc.begin(), table_crc.end());
      write_small(comm, g, "shard_crc32", H5T_STD_U32LE, H5T_NATIVE_UINT32, 2, tdims, crc32s.data(), dxpl);
      std::vector<ParamRow> rows(up.params.size());
      for (size_t i = 0; i < up.params.size(); ++i) {
        const ParamSlot& ps = up.params[i];
        ParamRow& row = rows[i];
        std::memset(&row, 0, sizeof row);
        if (ps.spec.name.size() >= static_cast<size_t>(kNameLen) || ps.spec.shape.size() > static_cast<size_t>(kMaxDims))
          throw H5Error("parameter '" + ps.spec.name + "' does not fit the param_table record");
        std::memcpy(row.name, ps.spec.name.data(), ps.spec.name.size());
        row.offset = ps.offset;
        row.numel = ps.numel;
        row.ndim = static_cast<int32_t>(ps.spec.shape.size());
        for (size_t j = 0; j < ps.spec.shape.size(); ++j) row.shape[j] = ps.spec.shape[j];
      }
      hsize_t pdims[1] = {rows.size()};
      write_small(comm, g, "param_table", rowt, rowt, 1, pdims, rows.data(), dxpl);
    }
  } catch (const std::exception& e) {
    err = std::string("checkpoint '") + tmp_path + "': " + e.what();
  }
  all_ok(comm, err.empty(), err);  // the file is closed on every rank here
}

std::string save_checkpoint(Comm& comm, Fsdp<float>& f, AdamW<float>& opt, const ModelConfig& mc,
                            const TrainConfig& tc, const TrainState& st, const CheckpointOptions& co) {
  static QuietHdf5 quiet;
  const int W = comm.world_size(), r = comm.rank();
  const std::string final_path = (fs::path(co.dir) / checkpoint_name(st.step)).string();
  const std::string tmp_path = (fs::path(co.dir) / ("." + checkpoint_name(st.step) + ".tmp")).string();
  {
    std::string err;
    if (r == 0) {
      std::error_code ec;
      fs::create_directories(co.dir, ec);
      if (ec) err = "cannot create checkpoint directory '" + co.dir + "' (option '--checkpoint-dir'): " + ec.message();
      else if (::access(co.dir.c_str(), W_OK) != 0)
        err = "checkpoint directory '" + co.dir + "' is not writable (option '--checkpoint-dir')";
    }
    all_ok(comm, err.empty(), err);
  }
  write_checkpoint_file(comm, tmp_path, f, opt, mc, tc, st);
  std::string err;

  if (co.debug_crash_before_publish > 0 && st.step == co.debug_crash_before_publish) {
    comm.barrier();
    log_error(r, W, "debug: crashing after writing step " + std::to_string(st.step) + " before publishing it");
    std::_Exit(86);
  }

  // Publish (rank 0): fsync data, rename, fsync dir, move `latest`, then prune.
  if (r == 0) {
    try {
      fsync_path(tmp_path, false);
      fs::rename(tmp_path, final_path);
      fsync_path(co.dir, true);
      write_file_atomic((fs::path(co.dir) / "latest").string(), checkpoint_name(st.step) + "\n", true);
      if (co.keep_last > 0) {
        std::vector<std::string> names = published_checkpoints(co.dir);
        for (size_t i = 0; i + static_cast<size_t>(co.keep_last) < names.size(); ++i)
          if (names[i] != checkpoint_name(st.step)) fs::remove(fs::path(co.dir) / names[i]);
      }
    } catch (const std::exception& e) {
      err = "publishing checkpoint '" + final_path + "': " + e.what();
    }
  }
  all_ok(comm, err.empty(), err);
  return final_path;
}

CheckpointInfo read_checkpoint_info(Comm& comm, const std::string& path) {
  static QuietHdf5 quiet;
  CommWatch watch(comm, "checkpoint read (parallel HDF5)");
  CheckpointInfo info;
  info.path = path;
  std::string err;
  try {
    if (!fs::exists(path)) throw H5Error("no such file");
    if (fs::is_directory(path)) throw H5Error("is a directory, not a checkpoint file");
    if (H5Fis_hdf5(path.c_str()) <= 0) throw H5Error("not an HDF5 file");
  } catch (const std::exception& e) {
    err = "checkpoint '" + path + "': " + e.what();
  }
  all_ok(comm, err.empty(), err);
  std::string why;
  H5Id file = open_file(comm, path, false, &why);
  all_ok(comm, file.ok(), "checkpoint '" + path + "': cannot open (" + why + "); the file may be truncated or damaged");
  try {
    const std::string where = "root group";
    std::string fmt = read_attr_str(file, "format", where);
    if (fmt != kFormatName) throw H5Error("attribute 'format' is '" + fmt + "', expected '" + kFormatName + "'");
    info.format_version = static_cast<int>(read_attr_i64(file, "format_version", where));
    if (info.format_version != kCheckpointFormatVersion)
      throw H5Error("unknown format version " + std::to_string(info.format_version) + " (this program reads version " +
                    std::to_string(kCheckpointFormatVersion) + ")");
    info.step = read_attr_i64(file, "step", where);
    info.tokens_seen = read_attr_i64(file, "tokens_seen", where);
    info.world_size = static_cast<int>(read_attr_i64(file, "world_size", where));
    info.model_config = read_attr_str(file, "model_config", where);
    info.train_config = read_attr_str(file, "train_config", where);
    info.data_position = read_attr_str(file, "data_position", where);
    info.rng_state = read_attr_str(file, "rng_state", where);
    info.program_version = read_attr_str(file, "program_version", where);
    info.data_info = H5Aexists(file, "data") > 0 ? read_attr_str(file, "data", where) : "null";
    if (info.world_size < 1) throw H5Error("attribute 'world_size' is " + std::to_string(info.world_size));
    H5Id units(H5Gopen2(file, "units", H5P_DEFAULT), H5Gclose);
    if (!units.ok()) throw H5Error("group '/units' is missing");
    H5G_info_t gi;
    chk(H5Gget_info(units, &gi), "read /units", 0);
    std::vector<std::pair<int64_t, CheckpointUnitInfo>> found;
    H5Id rowt = param_row_type();
    for (hsize_t i = 0; i < gi.nlinks; ++i) {
      char name[512];
      H5Lget_name_by_idx(units, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT);
      CheckpointUnitInfo ui;
      ui.name = name;
      const std::string w = "unit '" + ui.name + "'";
      H5Id g(chk(H5Gopen2(units, name, H5P_DEFAULT), "open " + w), H5Gclose);
      int64_t index = read_attr_i64(g, "index", w);
      ui.numel = read_attr_i64(g, "numel", w);
      ui.shard_size = read_attr_i64(g, "shard_size", w);
      ui.padded_numel = read_attr_i64(g, "padded_numel", w);
      if (ui.padded_numel != ui.shard_size * info.world_size || ui.numel > ui.padded_numel || ui.numel < 1)
        throw H5Error(w + ": numel/shard_size/padded_numel are inconsistent with world_size");
      auto read_table = [&](const char* ds, hid_t mtype, void* out, hsize_t rows, hsize_t cols) {
        H5Id d(H5Dopen2(g, ds, H5P_DEFAULT), H5Dclose);
        if (!d.ok()) throw H5Error(w + ": dataset '" + ds + "' is missing");
        H5Id sp(H5Dget_space(d), H5Sclose);
        hsize_t dims[2] = {0, 0};
        int nd = H5Sget_simple_extent_dims(sp, dims, nullptr);
        if (nd < 1 || dims[0] != rows || (cols > 0 && (nd != 2 || dims[1] != cols)))
          throw H5Error(w + ": dataset '" + ds + "' has an unexpected shape");
        chk(H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out), w + ": read " + ds, 0);
      };
      std::vector<int64_t> table(static_cast<size_t>(info.world_size) * 3);
      read_table("shard_table", H5T_NATIVE_INT64, table.data(), info.world_size, 3);
      for (int q = 0; q < info.world_size; ++q)
        ui.ranks.push_back({table[q * 3], table[q * 3 + 1], table[q * 3 + 2]});
      ui.crc32.resize(static_cast<size_t>(info.world_size) * 3);
      read_table("shard_crc32", H5T_NATIVE_UINT32, ui.crc32.data(), info.world_size, 3);
      H5Id pd(H5Dopen2(g, "param_table", H5P_DEFAULT), H5Dclose);
      if (!pd.ok()) throw H5Error(w + ": dataset 'param_table' is missing");
      H5Id psp(H5Dget_space(pd), H5Sclose);
      hssize_t np = H5Sget_simple_extent_npoints(psp);
      if (np < 1) throw H5Error(w + ": empty param_table");
      std::vector<ParamRow> rows(static_cast<size_t>(np));
      chk(H5Dread(pd, rowt, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data()), w + ": read param_table", 0);
      for (auto& row : rows) {
        ParamSlot ps;
        ps.spec.name = std::string(row.name, strnlen(row.name, kNameLen));
        if (row.ndim < 0 || row.ndim > kMaxDims) throw H5Error(w + ": bad ndim for '" + ps.spec.name + "'");
        for (int j = 0; j < row.ndim; ++j) ps.spec.shape.push_back(row.shape[j]);
        ps.offset = row.offset;
        ps.numel = row.numel;
        if (ps.offset < 0 || ps.numel < 0 || ps.offset + ps.numel > ui.numel)
          throw H5Error(w + ": tensor '" + ps.spec.name + "' lies outside the unit");
        ui.params.push_back(ps);
      }
      found.emplace_back(index, std::move(ui));
    }
    std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first < b.first; });
    for (auto& [i, u] : found) info.units.push_back(std::move(u));
  } catch (const std::exception& e) {
    err = "checkpoint '" + path + "': " + e.what();
  }
  all_ok(comm, err.empty(), err);
  return info;
}

TrainState load_checkpoint(Comm& comm, const std::string& path, Fsdp<float>& f, AdamW<float>* opt,
                           const ModelConfig& mc) {
  CommWatch watch(comm, "checkpoint read (parallel HDF5)");
  CheckpointInfo info = read_checkpoint_info(comm, path);
  const ShardPlan& plan = f.plan();
  const int M = comm.world_size(), r = comm.rank();
  std::string err;
  // Structure checks: identical on every rank (same metadata), agreed anyway.
  try {
    if (info.model_config != canonical_json(mc)) {
      json a = json::parse(info.model_config), b = json::parse(canonical_json(mc));
      std::string diff;
      for (auto& [k, v] : b.items())
        if (!a.contains(k) || a[k] != v)
          diff += (diff.empty() ? "" : ", ") + k + ": checkpoint has " + (a.contains(k) ? a[k].dump() : "nothing") +
                  ", requested " + v.dump();
      throw std::runtime_error("model config does not match the requested one (" + diff + ")");
    }
    for (auto& u : info.units)
      if (plan.unit_index(u.name) < 0) throw std::runtime_error("unexpected unit '" + u.name + "' for this model");
    for (auto& up : plan.units) {
      auto it = std::find_if(info.units.begin(), info.units.end(), [&](auto& u) { return u.name == up.name; });
      if (it == info.units.end()) throw std::runtime_error("missing unit '" + up.name + "'");
      if (it->numel != up.numel)
        throw std::runtime_error("unit '" + up.name + "' holds " + std::to_string(it->numel) + " elements, expected " +
                                 std::to_string(up.numel));
      for (auto& ps : up.params) {
        auto pt = std::find_if(it->params.begin(), it->params.end(), [&](auto& q) { return q.spec.name == ps.spec.name; });
        if (pt == it->params.end()) throw std::runtime_error("tensor '" + ps.spec.name + "' is missing from unit '" + up.name + "'");
        if (pt->spec.shape != ps.spec.shape)
          throw std::runtime_error("tensor '" + ps.spec.name + "' has shape " + shape_str(pt->spec.shape) +
                                   " in the file, expected " + shape_str(ps.spec.shape));
        if (pt->offset != ps.offset || pt->numel != ps.numel)
          throw std::runtime_error("tensor '" + ps.spec.name + "' is at offset " + std::to_string(pt->offset) +
                                   " in the file, expected " + std::to_string(ps.offset));
      }
    }
  } catch (const std::exception& e) {
    err = "checkpoint '" + path + "': " + e.what();
  }
  all_ok(comm, err.empty(), err);

  std::string why;
  H5Id file = open_file(comm, path, false, &why);
  all_ok(comm, file.ok(), "checkpoint '" + path + "': cannot open (" + why + ")");
  Backend<float>& be = f.backend();
  H5Id dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
  H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_INDEPENDENT);
  try {
    std::vector<float> host;
    for (int u = 0; u < f.num_units(); ++u) {
      const UnitPlan& up = plan.units[u];
      const CheckpointUnitInfo& ui =
          *std::find_if(info.units.begin(), info.units.end(), [&](auto& x) { return x.name == up.name; });
      const std::string ug = "units/" + up.name;
      for (int k = 0; k < 3; ++k) {
        const std::string dsname = ug + "/" + kMoments[k];
        H5Id d(H5Dopen2(file, dsname.c_str(), H5P_DEFAULT), H5Dclose);
        if (!d.ok()) throw std::runtime_error("dataset '" + dsname + "' is missing");
        H5Id fsp(H5Dget_space(d), H5Sclose);
        if (H5Sget_simple_extent_npoints(fsp) != ui.padded_numel)
          throw std::runtime_error("dataset '" + dsname + "' has " + std::to_string(H5Sget_simple_extent_npoints(fsp)) +
                                   " elements, expected " + std::to_string(ui.padded_numel));
        // 1. Integrity: this rank verifies the saved slices q with q % M == r.
        for (int q = r; q < info.world_size; q += M) {
          hsize_t start[1] = {static_cast<hsize_t>(q) * ui.shard_size}, count[1] = {static_cast<hsize_t>(ui.shard_size)};
          H5Sselect_hyperslab(fsp, H5S_SELECT_SET, start, nullptr, count, nullptr);
          H5Id msp(H5Screate_simple(1, count, nullptr), H5Sclose);
          host.resize(ui.shard_size);
          if (H5Dread(d, H5T_NATIVE_FLOAT, msp, fsp, dxpl, host.data()) < 0)
            throw std::runtime_error("cannot read '" + dsname + "' (" + h5_detail() + ")");
          uint32_t c = crc32_of(host.data(), host.size()), want = ui.crc32[static_cast<size_t>(q) * 3 + k];
          if (c != want) {
            char b[160];
            std::snprintf(b, sizeof b, "slice of saving rank %d fails its CRC32 check (stored %08x, computed %08x)", q,
                          want, c);
            throw std::runtime_error("dataset '" + dsname + "': " + b + "; the file is damaged");
          }
        }
        if (k > 0 && !opt) continue;
        // 2. This rank's shard under the current plan: [start, start + valid) of the flat buffer.
        const RankShard& rs = up.ranks[r];
        float* dst = k == 0 ? f.param_shard(u) : k == 1 ? opt->m()[u].data() : opt->v()[u].data();
        host.assign(static_cast<size_t>(up.shard_size), 0.0f);
        hsize_t start[1] = {static_cast<hsize_t>(rs.start)}, count[1] = {static_cast<hsize_t>(rs.valid)};
        if (rs.valid > 0) {
          H5Sselect_hyperslab(fsp, H5S_SELECT_SET, start, nullptr, count, nullptr);
          H5Id msp(H5Screate_simple(1, count, nullptr), H5Sclose);
          if (H5Dread(d, H5T_NATIVE_FLOAT, msp, fsp, dxpl, host.data()) < 0)
            throw std::runtime_error("cannot read '" + dsname + "' (" + h5_detail() + ")");
        }
        be.from_host(dst, host.data(), host.size());  // padding stays zero
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
  try {
    st.seed = json::parse(info.rng_state).at("seed").get<uint64_t>();
  } catch (const std::exception& e) {
    err = "checkpoint '" + path + "': attribute 'rng_state' is malformed: " + e.what();
  }
  all_ok(comm, err.empty(), err);
  return st;
}

std::string resolve_resume(Comm& comm, const std::string& resume, const std::string& dir) {
  std::string path, err;
  if (comm.rank() == 0 && !resume.empty()) {
    try {
      if (resume == "auto") {
        if (dir.empty()) throw std::runtime_error("option '--resume auto' needs '--checkpoint-dir'");
        fs::path latest = fs::path(dir) / "latest";
        if (fs::exists(latest)) {
          std::ifstream l(latest);
          std::string name;
          std::getline(l, name);
          if (name.find('/') == std::string::npos && !name.empty() && fs::exists(fs::path(dir) / name))
            path = (fs::path(dir) / name).string();
        }
        if (path.empty()) {
          std::vector<std::string> names = published_checkpoints(dir);
          if (!names.empty()) {
            path = (fs::path(dir) / names.back()).string();
            if (fs::exists(latest))  // rank 0 only: a message, not a collective
              std::printf("note: '%s' does not name a checkpoint in '%s'; resuming from the newest, %s\n",
                          latest.string().c_str(), dir.c_str(), names.back().c_str());
          }
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

}  // namespace shardtrain
