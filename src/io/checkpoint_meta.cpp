// Checkpoint metadata (checkpoint.h, docs/checkpoint-format.md): the HDF5 plumbing, the root and
// unit attributes, the per-unit tables, their checksums ("Integrity") and cross-checks, the reading
// of what a file holds (read_checkpoint_info) and the comparison with a model (layout, config).
// Reads are local to each rank (HDF5's POSIX driver, no collective inside HDF5), and the ranks
// agree on what they read afterwards.
#include <hdf5.h>
#include <mpi.h>

#include <sys/stat.h>

#include <algorithm>
#include <tuple>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "checkpoint_internal.h"
#include "shardtrain/files.h"
#include "shardtrain/model.h"

namespace shardtrain {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace ckpt {

hid_t chk(hid_t id, const std::string& what) {
  if (id < 0) throw H5Error(what);
  return id;
}
void chk(herr_t rc, const std::string& what, int) {
  if (rc < 0) throw H5Error(what);
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

// Collective create through MPI-IO (saves). On failure returns an invalid id and sets *why to
// HDF5's own reason (read before any other HDF5 call clears the error stack).
// Metadata is written by rank 0 alone (H5AC_METADATA_WRITE_STRATEGY__PROCESS_0_ONLY; HDF5 1.10's
// default distributes the dirty metadata over all ranks at each sync point): a rank other than 0
// then writes only its own tensor rows, through calls whose failure the ranks agree on, never
// inside one of HDF5's sync points, whose error path skips the barrier the others wait in (a
// failed write on a replica rank, which writes no rows, hung the save there). The file's bytes do
// not depend on which rank writes its metadata.
H5Id create_file(Comm& comm, const std::string& path, std::string* why) {
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  H5Pset_fapl_mpio(fapl, reinterpret_cast<MPI_Comm>(comm.mpi_handle()), MPI_INFO_NULL);
  H5AC_cache_config_t mdc;
  mdc.version = H5AC__CURR_CACHE_CONFIG_VERSION;
  if (H5Pget_mdc_config(fapl, &mdc) >= 0) {
    mdc.metadata_write_strategy = H5AC_METADATA_WRITE_STRATEGY__PROCESS_0_ONLY;
    H5Pset_mdc_config(fapl, &mdc);
  }
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  if (f < 0 && why) *why = h5_detail();
  H5Pclose(fapl);
  return H5Id(f, H5Fclose);
}

// Local read-only open (POSIX driver) on this rank alone. Reads are independent, so no rank ever
// waits inside HDF5 for another: a rank that sees a different or damaged copy of the file fails
// on its own and the ranks then agree (agree_on_file). File locking is off: a published
// checkpoint is never written again, and many file systems (NFS, Lustre) refuse flock.
H5Id open_local(const std::string& path, std::string* why) {
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  H5Pset_file_locking(fapl, false, true);
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  if (f < 0 && why) *why = h5_detail();
  H5Pclose(fapl);
  return H5Id(f, H5Fclose);
}

void quiet_hdf5() {
  static const bool once = [] {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    return true;
  }();
  (void)once;
}

uint32_t crc32_bytes(const std::string& b) { return crc32_update(0, b.data(), b.size()); }

namespace {

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


// ---- Metadata checksums (docs/checkpoint-format.md, "Integrity") ----------------------------
// Every attribute and small table is an item with a key ("@step" for a root attribute,
// "units/U@numel" for a unit attribute, "units/U/shard_table" for a table) and canonical bytes
// (a string's UTF-8 bytes; an int64 as 8 bytes little-endian; a table's elements little-endian,
// row-major; a param_table row packed field by field, 180 bytes). The root attribute
// `metadata_crc32` maps every key to the zlib CRC32 of its bytes; `metadata_crc32_check` is the
// CRC32 of that attribute's own bytes.
constexpr const char* kMetaTable = "metadata_crc32";
constexpr const char* kMetaTableCheck = "metadata_crc32_check";

template <typename U> void put_le(std::string& b, U v) {
  for (size_t i = 0; i < sizeof(U); ++i) b.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}
std::string le_i64(int64_t v) {
  std::string b;
  put_le<uint64_t>(b, static_cast<uint64_t>(v));
  return b;
}
std::string param_rows_bytes(const std::vector<ParamRow>& rows) {
  std::string b;
  for (const ParamRow& r : rows) {
    b.append(r.name, kNameLen);
    put_le<uint64_t>(b, static_cast<uint64_t>(r.offset));
    put_le<uint64_t>(b, static_cast<uint64_t>(r.numel));
    put_le<uint32_t>(b, static_cast<uint32_t>(r.ndim));
    for (int j = 0; j < kMaxDims; ++j) put_le<uint64_t>(b, static_cast<uint64_t>(r.shape[j]));
  }
  return b;
}

// "@step" -> "attribute 'step'"; "units/U@numel" -> "attribute 'numel' of unit 'U'";
// "units/U/shard_table" -> "dataset 'units/U/shard_table'"; "tokenizer@info" -> "attribute 'info'
// of group '/tokenizer'".
std::string describe_item(const std::string& key) {
  size_t at = key.find('@');
  if (at == std::string::npos) return "dataset '" + key + "'";
  std::string attr = "attribute '" + key.substr(at + 1) + "'";
  if (at == 0) return attr;
  if (key.rfind("units/", 0) == 0) return attr + " of unit '" + key.substr(6, at - 6) + "'";
  return attr + " of group '/" + key.substr(0, at) + "'";
}


}  // namespace

void MetaSums::add(const std::string& key, const std::string& bytes) {
  uint32_t c = crc32_bytes(bytes);
  computed[key] = c;
  if (!verify) return;
  auto it = stored.find(key);
  if (it == stored.end())
    throw H5Error(describe_item(key) + " has no entry in the metadata checksum table ('" + kMetaTable +
                  "'); the file is damaged or was edited");
  if (it->second != c) {
    char b[96];
    std::snprintf(b, sizeof b, " (stored %08x, computed %08x)", it->second, c);
    throw H5Error(describe_item(key) + " fails its CRC32 check" + b +
                  ": the file was damaged or edited after it was saved");
  }
}
void MetaSums::finish() const {
  for (auto& [k, v] : stored)
    if (!computed.count(k))
      throw H5Error("the metadata checksum table names " + describe_item(k) + ", which the file lacks; the file is damaged");
}
std::string MetaSums::table_json() const {
  json j = json::object();
  for (auto& [k, v] : computed) j[k] = v;
  return j.dump();
}

namespace {

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
// The same, recording the item's checksum under `prefix` + "@" + name.
void put_str(hid_t obj, MetaSums& ms, const std::string& prefix, const char* name, const std::string& v) {
  write_attr_str(obj, name, v);
  ms.add(prefix + "@" + name, v);
}
void put_i64(hid_t obj, MetaSums& ms, const std::string& prefix, const char* name, int64_t v) {
  write_attr_i64(obj, name, v);
  ms.add(prefix + "@" + name, le_i64(v));
}
// Opens attribute `name` of `obj`, which must hold exactly one element of class `cls` (reading
// an array into one element's buffer would overrun it).
H5Id open_scalar_attr(hid_t obj, const char* name, H5T_class_t cls, const std::string& where) {
  if (H5Aexists(obj, name) <= 0) throw H5Error(where + " has no attribute '" + name + "'");
  H5Id a(chk(H5Aopen(obj, name, H5P_DEFAULT), std::string("open attribute ") + name), H5Aclose);
  H5Id sp(H5Aget_space(a), H5Sclose);
  H5Id ft(H5Aget_type(a), H5Tclose);
  if (!sp.ok() || H5Sget_simple_extent_npoints(sp) != 1)
    throw H5Error(where + ": attribute '" + name + "' is not a single value");
  if (!ft.ok() || H5Tget_class(ft) != cls)
    throw H5Error(where + ": attribute '" + name + "' is not " + (cls == H5T_STRING ? "a string" : "an integer"));
  return a;
}
std::string read_attr_str(hid_t obj, const char* name, const std::string& where) {
  H5Id a = open_scalar_attr(obj, name, H5T_STRING, where);
  H5Id ft(H5Aget_type(a), H5Tclose);
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
  H5Id a = open_scalar_attr(obj, name, H5T_INTEGER, where);
  int64_t v = 0;
  chk(H5Aread(a, H5T_NATIVE_INT64, &v), std::string("read attribute ") + name, 0);
  return v;
}
std::string get_str(hid_t obj, MetaSums& ms, const std::string& prefix, const char* name, const std::string& where) {
  std::string v = read_attr_str(obj, name, where);
  ms.add(prefix + "@" + name, v);
  return v;
}
int64_t get_i64(hid_t obj, MetaSums& ms, const std::string& prefix, const char* name, const std::string& where) {
  int64_t v = read_attr_i64(obj, name, where);
  ms.add(prefix + "@" + name, le_i64(v));
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

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

// Group /tokenizer (docs/checkpoint-format.md, "Tokenizer"): attribute `info` is this JSON; the
// files' bytes are u8 datasets named like the files.
json tokenizer_record(const TokenizerInfo& t) {
  auto id = [](int64_t v) { return v < 0 ? json(nullptr) : json(v); };
  json files = json::object();
  for (auto& [name, bytes] : t.files) files[name] = {{"bytes", bytes.size()}, {"crc32", crc32_bytes(bytes)}};
  return {{"kind", t.kind}, {"vocab_size", t.vocab_size}, {"bos_id", id(t.bos_id)}, {"eos_id", id(t.eos_id)},
          {"pad_id", id(t.pad_id)}, {"unk_id", id(t.unk_id)}, {"add_bos", t.add_bos}, {"add_eos", t.add_eos},
          {"files", files}};
}

// Reads group /tokenizer (kind "" when absent), verifying each file against the CRC32 in `info`.
TokenizerInfo read_tokenizer_group(hid_t file, MetaSums& ms) {
  TokenizerInfo t;
  t.kind = "";
  if (H5Lexists(file, "tokenizer", H5P_DEFAULT) <= 0) return t;
  H5Id g(chk(H5Gopen2(file, "tokenizer", H5P_DEFAULT), "open group /tokenizer"), H5Gclose);
  const std::string text = get_str(g, ms, "tokenizer", "info", "group '/tokenizer'");
  json j;
  try {
    j = json::parse(text);
    t.kind = j.at("kind").get<std::string>();
    t.vocab_size = j.at("vocab_size").get<uint32_t>();
    auto id = [&](const char* k) { return j.at(k).is_null() ? int64_t{-1} : j.at(k).get<int64_t>(); };
    t.bos_id = id("bos_id");
    t.eos_id = id("eos_id");
    t.pad_id = id("pad_id");
    t.unk_id = id("unk_id");
    t.add_bos = j.at("add_bos").get<bool>();
    t.add_eos = j.at("add_eos").get<bool>();
    if (!j.at("files").is_object()) throw std::runtime_error("'files' is not an object");
  } catch (const std::exception& e) {
    throw H5Error("attribute 'info' of group '/tokenizer' is malformed (" + std::string(e.what()) + ")");
  }
  for (auto& [name, meta] : j["files"].items()) {
    const std::string w = "dataset 'tokenizer/" + name + "'";
    if (H5Lexists(g, name.c_str(), H5P_DEFAULT) <= 0) throw H5Error(w + " is missing");
    H5Id d(chk(H5Dopen2(g, name.c_str(), H5P_DEFAULT), "open " + w), H5Dclose);
    H5Id sp(H5Dget_space(d), H5Sclose);
    const hssize_t n = H5Sget_simple_extent_npoints(sp);
    if (n < 0 || static_cast<uint64_t>(n) != meta.value("bytes", uint64_t{0}))
      throw H5Error(w + " holds " + std::to_string(n) + " bytes, attribute 'info' says " + meta.value("bytes", json()).dump());
    // Written contiguous and uncompressed: a declared extent beyond what the file stores is damage,
    // refused before it decides an allocation.
    if (H5Dget_storage_size(d) < static_cast<hsize_t>(n))
      throw H5Error(w + " declares " + std::to_string(n) + " bytes but the file stores " +
                    std::to_string(H5Dget_storage_size(d)) + "; the file is damaged");
    std::string bytes(static_cast<size_t>(n), '\0');
    if (n > 0) chk(H5Dread(d, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()), "read " + w, 0);
    if (crc32_bytes(bytes) != meta.value("crc32", uint64_t{0}))
      throw H5Error(w + " fails its CRC32 check; the file is damaged");
    t.files[name] = std::move(bytes);
  }
  return t;
}

// Attribute `spike_stats` (format version 3): the loss-spike statistics as JSON. Doubles are
// written in their shortest round-trip form, so a resumed run reads back the exact window.
json spike_stats_json(const SpikeStats& st) {
  return {{"window", kSpikeWindow}, {"loss", st.loss}, {"grad_norm", st.grad_norm},
          {"skipped_in_a_row", st.skipped_in_a_row}, {"skipped_updates", st.skipped_updates}};
}

// The statistics of attribute `spike_stats`; throws H5Error naming what is malformed. A window
// longer than this program's (a future version) keeps its newest kSpikeWindow values.
SpikeStats parse_spike_stats(const std::string& text) {
  SpikeStats st;
  try {
    const json j = json::parse(text);
    if (!j.is_object()) throw std::runtime_error("not a JSON object");
    for (const char* k : {"window", "skipped_in_a_row", "skipped_updates"})
      if (!j.contains(k) || !j[k].is_number_integer() || j[k].get<int64_t>() < 0)
        throw std::runtime_error(std::string("'") + k + "' is not a non-negative integer");
    for (const char* k : {"loss", "grad_norm"}) {
      if (!j.contains(k) || !j[k].is_array()) throw std::runtime_error(std::string("'") + k + "' is not an array");
      for (const json& v : j[k])
        if (!v.is_number()) throw std::runtime_error(std::string("'") + k + "' holds " + v.dump() + ", not a number");
    }
    st.loss = j["loss"].get<std::vector<double>>();
    st.grad_norm = j["grad_norm"].get<std::vector<double>>();
    st.skipped_in_a_row = j["skipped_in_a_row"].get<int64_t>();
    st.skipped_updates = j["skipped_updates"].get<int64_t>();
    if (st.loss.size() != st.grad_norm.size() || st.loss.size() > j["window"].get<uint64_t>())
      throw std::runtime_error("'loss' and 'grad_norm' hold " + std::to_string(st.loss.size()) + " and " +
                               std::to_string(st.grad_norm.size()) + " values for a window of " + j["window"].dump());
    if (st.skipped_in_a_row > st.skipped_updates)
      throw std::runtime_error("'skipped_in_a_row' exceeds 'skipped_updates'");
  } catch (const std::exception& e) {
    throw H5Error(std::string("attribute 'spike_stats' is malformed: ") + e.what());
  }
  for (std::vector<double>* v : {&st.loss, &st.grad_norm})
    if (v->size() > static_cast<size_t>(kSpikeWindow)) v->erase(v->begin(), v->end() - kSpikeWindow);
  return st;
}

json segments_json(const std::vector<BatchSegment>& segs) {
  json a = json::array();
  for (auto& g : segs)
    a.push_back({{"from_step", g.from_step}, {"global_batch", g.global_batch}, {"seq_len", g.seq_len}, {"seed", g.seed}});
  return a;
}

// What one rank made of a checkpoint file.
struct FileView {
  bool ok = true;
  std::string err;        // why not ok
  int64_t bytes = -1;     // file size on this rank, -1: missing
  uint64_t digest = 0;    // of the metadata checksums (valid when ok)
  int64_t step = -1;      // the step it read (valid when ok)
};

// Collective. The ranks compare what they read of `path` and all throw the same CollectiveError
// unless every rank read it successfully with the same size and metadata digest. When only some
// ranks fail or the views differ, the message names the ranks: the file at this path is not the
// same on every node (a stale or partial copy on local disk, an NFS cache).
void agree_on_file(Comm& comm, const std::string& path, const FileView& v) {
  const int W = comm.world_size();
  uint64_t mine[4] = {v.ok ? 1u : 0u, static_cast<uint64_t>(v.bytes), v.digest, static_cast<uint64_t>(v.step)};
  std::vector<uint64_t> all(static_cast<size_t>(W) * 4);
  comm.all_gather(mine, all.data(), 4);
  auto ok = [&](int r) { return all[r * 4] != 0; };
  auto bytes = [&](int r) { return static_cast<int64_t>(all[r * 4 + 1]); };
  auto digest = [&](int r) { return all[r * 4 + 2]; };
  auto step = [&](int r) { return static_cast<int64_t>(all[r * 4 + 3]); };
  std::vector<int> failed;
  bool same = true;
  for (int r = 0; r < W; ++r) {
    if (!ok(r)) failed.push_back(r);
    same = same && bytes(r) == bytes(0) && (!ok(r) || !ok(0) || digest(r) == digest(0));
  }
  if (failed.empty() && same) return;
  // The reason of the lowest failing rank, for everybody.
  std::string why = failed.empty() ? "" : comm.broadcast_string(v.err, failed.front());
  const std::string who = "checkpoint '" + path + "'";
  const std::string hint = ": every rank must read the same complete file (a stale or partial copy on one node's local "
                           "disk, or an NFS cache, gives ranks different files under one path)";
  if (static_cast<int>(failed.size()) == W && same) throw CollectiveError(failed.front(), why);  // one damaged file
  std::map<int64_t, std::vector<int>> by_size;
  for (int r = 0; r < W; ++r) by_size[bytes(r)].push_back(r);
  if (by_size.size() > 1) {
    std::string sizes;
    for (auto& [b, rs] : by_size)
      sizes += (sizes.empty() ? "" : ", ") + (b < 0 ? "missing on " + rank_list(rs) : std::to_string(b) + " bytes on " + rank_list(rs));
    const std::vector<int>& small = by_size.begin()->second;  // the smallest copy (or none) is the damaged one
    throw CollectiveError(small.front(), who + " is not the same file on every rank (" + sizes + "): it is " +
                                             (by_size.begin()->first < 0 ? "missing" : "truncated or damaged") + " on " +
                                             rank_list(small) + hint + (failed.empty() ? "" : "; " + why));
  }
  if (!failed.empty()) {
    std::vector<int> good;
    for (int r = 0; r < W; ++r)
      if (ok(r)) good.push_back(r);
    throw CollectiveError(failed.front(), who + " is damaged as " + rank_list(failed) + " read it, while " +
                                              rank_list(good) + " read it without error" + hint + "; " + rank_list({failed.front()}) +
                                              ": " + why);
  }
  // Groups of ranks with the same view, in order of their lowest rank (rank 0's group first).
  std::vector<std::pair<std::pair<uint64_t, int64_t>, std::vector<int>>> by_view;
  for (int r = 0; r < W; ++r) {
    const std::pair<uint64_t, int64_t> k{digest(r), step(r)};
    auto it = std::find_if(by_view.begin(), by_view.end(), [&](auto& g) { return g.first == k; });
    if (it == by_view.end()) by_view.push_back({k, {r}});
    else it->second.push_back(r);
  }
  std::string views;
  std::vector<int> odd;
  for (auto& [k, rs] : by_view) {
    views += (views.empty() ? "" : ", ") + rank_list(rs) + " read step " + std::to_string(k.second);
    if (&rs != &by_view.front().second) odd.insert(odd.end(), rs.begin(), rs.end());
  }
  std::sort(odd.begin(), odd.end());
  throw CollectiveError(odd.front(), who + " has different contents on different ranks (" + views + ", " +
                                         std::to_string(bytes(0)) + " bytes each): " + rank_list(odd) +
                                         (odd.size() == 1 ? " differs" : " differ") + " from rank 0" + hint);
}


// Version 4: the TP record of every unit must be the one a run of the file's model and mesh writes
// (tp_record of llama_units(model, tp, 0) sharded over dp_shard): the record follows from the
// model, the parameter table and the mesh, so any other value is damage or an edit (the loader
// does not use it, but --mode inspect and the h5py recipe of docs/checkpoint-format.md do).
void check_tp_record(const CheckpointInfo& info, const std::vector<std::pair<int64_t, CheckpointUnitInfo>>& units) {
  TpRecord want;
  try {
    const ModelConfig mc = from_canonical_json(info.model_config);
    want = tp_record({ShardPlan::build(llama_units(mc, info.tp, 0), info.tp_dp_shard)},
                     MeshDims{info.tp_dp_replicate, info.tp_dp_shard, 1, info.tp});
  } catch (const std::exception& e) {
    throw H5Error("attribute 'tensor_parallel' (tp " + std::to_string(info.tp) + ") does not fit attribute "
                  "'model_config': " + e.what());
  }
  if (want.units.size() != units.size())
    throw H5Error("the file has " + std::to_string(units.size()) + " units, its 'model_config' " +
                  std::to_string(want.units.size()));
  for (size_t u = 0; u < units.size(); ++u) {
    const CheckpointUnitInfo& ui = units[u].second;
    const TpUnitRecord &got = ui.tp, &w = want.units[u];
    const std::string where = "unit '" + ui.name + "'";
    if (got.local_numel != w.local_numel || got.local_shard_size != w.local_shard_size)
      throw H5Error(where + ": attributes local_numel (" + std::to_string(got.local_numel) + ") and local_shard_size (" +
                    std::to_string(got.local_shard_size) + ") are not the model's at tp " + std::to_string(info.tp) +
                    ", dp_shard " + std::to_string(info.tp_dp_shard) + " (" + std::to_string(w.local_numel) + ", " +
                    std::to_string(w.local_shard_size) + ")");
    if (got.params != w.params)
      for (size_t p = 0; p < std::min(got.params.size(), w.params.size()); ++p)
        if (got.params[p] != w.params[p])
          throw H5Error(where + ": row " + std::to_string(p) + " of dataset 'tp_table' (" + std::to_string(got.params[p][0]) +
                        ", " + std::to_string(got.params[p][1]) + ", " + std::to_string(got.params[p][2]) + ", " +
                        std::to_string(got.params[p][3]) + ") is not the model's (" + std::to_string(w.params[p][0]) +
                        ", " + std::to_string(w.params[p][1]) + ", " + std::to_string(w.params[p][2]) + ", " +
                        std::to_string(w.params[p][3]) + ")");
    if (got.params.size() != w.params.size())
      throw H5Error(where + ": dataset 'tp_table' has " + std::to_string(got.params.size()) + " rows, the model " +
                    std::to_string(w.params.size()));
    for (size_t d = 0; d < w.shards.size(); ++d) {
      const RankShard &a = got.shards.at(d), &b = w.shards[d];
      if (a.start != b.start || a.valid != b.valid || a.padding != b.padding)
        throw H5Error(where + ": row " + std::to_string(d) + " of dataset 'tp_shard_table' (" + std::to_string(a.start) +
                      ", " + std::to_string(a.valid) + ", " + std::to_string(a.padding) + ") is not (" +
                      std::to_string(b.start) + ", " + std::to_string(b.valid) + ", " + std::to_string(b.padding) +
                      "), the rule of docs/checkpoint-format.md for local_numel and dp_shard");
    }
  }
}

// This rank's reading of the metadata of `path` (no collectives). Throws H5Error/std::exception
// with a message that does not yet name the file.
void read_metadata(const std::string& path, CheckpointInfo& info, MetaSums& ms) {
  std::string why;
  H5Id file = open_local(path, &why);
  if (!file.ok()) throw H5Error("cannot open (" + why + "); the file may be truncated or damaged");
  const std::string where = "root group";
  const std::string fmt = read_attr_str(file, "format", where);
  if (fmt != kFormatName) throw H5Error("attribute 'format' is '" + fmt + "', expected '" + kFormatName + "'");
  info.format_version = static_cast<int>(read_attr_i64(file, "format_version", where));
  const bool has_table = H5Aexists(file, kMetaTable) > 0;
  // The version decides how the rest is read, so it is checked before anything else is trusted.
  if (info.format_version < 1 || info.format_version > kCheckpointFormatVersion)
    throw H5Error("unknown format version " + std::to_string(info.format_version) +
                  " in attribute 'format_version' (this program reads versions 1 to " +
                  std::to_string(kCheckpointFormatVersion) + ")");
  if (info.format_version == 1 && has_table)
    throw H5Error("attribute 'format_version' says 1, but the file carries the metadata checksums of versions 2 "
                  "and later; the file is damaged or was edited");
  if (info.format_version >= 2) {
    if (!has_table) throw H5Error("attribute '" + std::string(kMetaTable) + "' (the metadata checksums) is missing");
    const std::string table = read_attr_str(file, kMetaTable, where);
    const int64_t check = read_attr_i64(file, kMetaTableCheck, where);
    if (static_cast<int64_t>(crc32_bytes(table)) != check)
      throw H5Error("attribute '" + std::string(kMetaTable) + "' (the metadata checksums) fails its own CRC32 check ('" +
                    kMetaTableCheck + "'); the file is damaged or was edited");
    try {
      const json t = json::parse(table);
      if (!t.is_object()) throw json::type_error::create(302, "not an object", &t);
      for (auto& [k, v] : t.items()) {
        if (!v.is_number_unsigned() || v.get<uint64_t>() > 0xffffffffull)
          throw H5Error("attribute '" + std::string(kMetaTable) + "': the entry of '" + k + "' is not a CRC32");
        ms.stored[k] = static_cast<uint32_t>(v.get<uint64_t>());
      }
    } catch (const json::exception& e) {
      throw H5Error("attribute '" + std::string(kMetaTable) + "' is not a JSON object of CRC32s: " + e.what());
    }
    ms.verify = true;
  }
  ms.add("@format", fmt);
  ms.add("@format_version", le_i64(info.format_version));
  info.step = get_i64(file, ms, "", "step", where);
  info.tokens_seen = get_i64(file, ms, "", "tokens_seen", where);
  info.world_size = static_cast<int>(get_i64(file, ms, "", "world_size", where));
  info.model_config = get_str(file, ms, "", "model_config", where);
  info.train_config = get_str(file, ms, "", "train_config", where);
  info.data_position = get_str(file, ms, "", "data_position", where);
  info.rng_state = get_str(file, ms, "", "rng_state", where);
  info.program_version = get_str(file, ms, "", "program_version", where);
  info.data_info = info.format_version >= 2 ? get_str(file, ms, "", "data", where) : "null";
  if (info.format_version >= 2) info.tokenizer = read_tokenizer_group(file, ms);
  if (info.format_version >= 3) info.spikes = parse_spike_stats(get_str(file, ms, "", "spike_stats", where));
  if (info.world_size < 1) throw H5Error("attribute 'world_size' is " + std::to_string(info.world_size));
  if (info.format_version >= 4) {  // the saving run's mesh: tp x dp_shard x dp_replicate = world_size
    const std::string tp = get_str(file, ms, "", "tensor_parallel", where);
    try {
      const json j = json::parse(tp);
      int* out[3] = {&info.tp, &info.tp_dp_shard, &info.tp_dp_replicate};
      const char* keys[3] = {"tp", "dp_shard", "dp_replicate"};
      for (int k = 0; k < 3; ++k) {
        const json& v = j.at(keys[k]);
        if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > info.world_size)
          throw H5Error(std::string("attribute 'tensor_parallel' (") + tp + "): '" + keys[k] +
                        "' is not an integer in [1, world_size]");
        *out[k] = static_cast<int>(v.get<int64_t>());
      }
    } catch (const json::exception& e) {
      throw H5Error(std::string("attribute 'tensor_parallel' is malformed: ") + e.what());
    }
    if (info.tp < 2 || int64_t{info.tp} * info.tp_dp_shard * info.tp_dp_replicate != info.world_size)
      throw H5Error("attribute 'tensor_parallel' (" + tp + ") is not a mesh of tp >= 2 whose sizes multiply to "
                    "attribute 'world_size' (" + std::to_string(info.world_size) + ")");
  }
  H5Id units(H5Gopen2(file, "units", H5P_DEFAULT), H5Gclose);
  if (!units.ok()) throw H5Error("group '/units' is missing");
  H5G_info_t gi;
  chk(H5Gget_info(units, &gi), "read /units", 0);
  std::vector<std::pair<int64_t, CheckpointUnitInfo>> found;
  H5Id rowt = param_row_type();
  const int W = info.world_size;
  for (hsize_t i = 0; i < gi.nlinks; ++i) {
    char name[512] = {};
    const ssize_t len = H5Lget_name_by_idx(units, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT);
    if (len <= 0 || len >= static_cast<ssize_t>(sizeof name)) throw H5Error("cannot read the name of unit " + std::to_string(i) + " in group '/units'");
    CheckpointUnitInfo ui;
    ui.name = name;
    const std::string w = "unit '" + ui.name + "'", key = "units/" + ui.name;
    H5Id g(chk(H5Gopen2(units, name, H5P_DEFAULT), "open " + w), H5Gclose);
    int64_t index = get_i64(g, ms, key, "index", w);
    ui.numel = get_i64(g, ms, key, "numel", w);
    ui.shard_size = get_i64(g, ms, key, "shard_size", w);
    ui.padded_numel = get_i64(g, ms, key, "padded_numel", w);
    // numel / W + (remainder), not (numel + W - 1) / W: numel may be anything up to 2^63 - 1.
    if (ui.numel < 1 || ui.shard_size != std::max<int64_t>(1, ui.numel / W + (ui.numel % W != 0)) ||
        ui.shard_size > INT64_MAX / W || ui.padded_numel != ui.shard_size * W)
      throw H5Error(w + ": attributes numel (" + std::to_string(ui.numel) + "), shard_size (" +
                    std::to_string(ui.shard_size) + ") and padded_numel (" + std::to_string(ui.padded_numel) +
                    ") are inconsistent with world_size (" + std::to_string(W) + ")");
    // Reads a [rows][cols] table into `out`, sized only once the dataset's shape is known to match
    // (world_size comes from the file: it must not decide an allocation before it is confirmed).
    auto read_table = [&]<typename T>(const char* ds, hid_t mtype, std::vector<T>& out, hsize_t rows, hsize_t cols,
                                      const char* from = "attribute 'world_size'") {
      H5Id d(H5Dopen2(g, ds, H5P_DEFAULT), H5Dclose);
      if (!d.ok()) throw H5Error(w + ": dataset '" + ds + "' is missing");
      H5Id sp(H5Dget_space(d), H5Sclose);
      hsize_t dims[2] = {0, 0};
      int nd = H5Sget_simple_extent_ndims(sp);
      if (nd != 2 || H5Sget_simple_extent_dims(sp, dims, nullptr) != 2 || dims[0] != rows || dims[1] != cols)
        throw H5Error(w + ": dataset '" + ds + "' has an unexpected shape (expected [" + std::to_string(rows) + "][" +
                      std::to_string(cols) + "] from " + from + ")");
      out.resize(static_cast<size_t>(rows * cols));
      chk(H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), w + ": read " + ds, 0);
    };
    std::vector<int64_t> table;
    read_table("shard_table", H5T_NATIVE_INT64, table, W, 3);
    std::string tb;
    for (int64_t v : table) put_le<uint64_t>(tb, static_cast<uint64_t>(v));
    ms.add(key + "/shard_table", tb);
    for (int q = 0; q < W; ++q) {
      RankShard rs{table[q * 3], table[q * 3 + 1], table[q * 3 + 2]};
      const int64_t valid = std::clamp<int64_t>(ui.numel - q * ui.shard_size, 0, ui.shard_size);
      if (rs.start != q * ui.shard_size || rs.valid != valid || rs.padding != ui.shard_size - valid)
        throw H5Error(w + ": row " + std::to_string(q) + " of dataset 'shard_table' is (" + std::to_string(rs.start) + ", " +
                      std::to_string(rs.valid) + ", " + std::to_string(rs.padding) + "), expected (" +
                      std::to_string(q * ui.shard_size) + ", " + std::to_string(valid) + ", " +
                      std::to_string(ui.shard_size - valid) + ") from numel and world_size");
      ui.ranks.push_back(rs);
    }
    read_table("shard_crc32", H5T_NATIVE_UINT32, ui.crc32, W, checkpoint_tensor_names().size());
    std::string cb;
    for (uint32_t v : ui.crc32) put_le<uint32_t>(cb, v);
    ms.add(key + "/shard_crc32", cb);
    H5Id pd(H5Dopen2(g, "param_table", H5P_DEFAULT), H5Dclose);
    if (!pd.ok()) throw H5Error(w + ": dataset 'param_table' is missing");
    H5Id psp(H5Dget_space(pd), H5Sclose);
    hssize_t np = H5Sget_simple_extent_npoints(psp);
    if (np < 1) throw H5Error(w + ": empty param_table");
    // Rows are allocated from the dataset's declared extent, which a damaged file can make huge.
    if (np > ui.numel || np > kMaxParamRows)
      throw H5Error(w + ": dataset 'param_table' has " + std::to_string(np) + " rows, more than the unit's " +
                    std::to_string(std::min<int64_t>(ui.numel, kMaxParamRows)) + " tensors could be");
    std::vector<ParamRow> rows(static_cast<size_t>(np));
    std::memset(rows.data(), 0, rows.size() * sizeof(ParamRow));
    chk(H5Dread(pd, rowt, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data()), w + ": read param_table", 0);
    ms.add(key + "/param_table", param_rows_bytes(rows));
    for (auto& row : rows) {
      ParamSlot ps;
      ps.spec.name = std::string(row.name, strnlen(row.name, kNameLen));
      if (row.ndim < 0 || row.ndim > kMaxDims) throw H5Error(w + ": bad ndim for '" + ps.spec.name + "'");
      for (int j = 0; j < row.ndim; ++j) ps.spec.shape.push_back(row.shape[j]);
      ps.offset = row.offset;
      ps.numel = row.numel;
      if (ps.offset < 0 || ps.numel < 0 || ps.offset > ui.numel || ps.numel > ui.numel - ps.offset)  // no overflow
        throw H5Error(w + ": tensor '" + ps.spec.name + "' (offset " + std::to_string(ps.offset) + ", numel " +
                      std::to_string(ps.numel) + " in 'param_table') lies outside the unit's " +
                      std::to_string(ui.numel) + " elements");
      for (auto& other : ui.params)
        if (other.spec.name == ps.spec.name) throw H5Error(w + ": tensor '" + ps.spec.name + "' appears twice in 'param_table'");
      ui.params.push_back(ps);
    }
    if (info.tp > 1) {  // version 4: the saving run's TP record of this unit (docs/checkpoint-format.md)
      TpUnitRecord& t = ui.tp;
      t.local_numel = get_i64(g, ms, key, "local_numel", w);
      t.local_shard_size = get_i64(g, ms, key, "local_shard_size", w);
      std::vector<int64_t> tt, st;
      read_table("tp_table", H5T_NATIVE_INT64, tt, ui.params.size(), 4, "dataset 'param_table'");
      read_table("tp_shard_table", H5T_NATIVE_INT64, st, static_cast<hsize_t>(info.tp_dp_shard), 3,
                 "attribute 'tensor_parallel'");
      for (auto [ds, v] : {std::pair{"tp_table", &tt}, std::pair{"tp_shard_table", &st}}) {
        std::string b;
        for (int64_t x : *v) put_le<uint64_t>(b, static_cast<uint64_t>(x));
        ms.add(key + "/" + ds, b);
      }
      for (size_t p = 0; p < ui.params.size(); ++p) {
        const std::array<int64_t, 4> row{tt[4 * p], tt[4 * p + 1], tt[4 * p + 2], tt[4 * p + 3]};
        if (row[0] < -1 || row[0] > 1 || row[1] != info.tp || row[2] < 0 || row[3] < 0)
          throw H5Error(w + ": row " + std::to_string(p) + " of dataset 'tp_table' (" + std::to_string(row[0]) + ", " +
                        std::to_string(row[1]) + ", " + std::to_string(row[2]) + ", " + std::to_string(row[3]) +
                        ") is not a TP record of degree " + std::to_string(info.tp));
        t.params.push_back(row);
      }
      for (int d = 0; d < info.tp_dp_shard; ++d)
        t.shards.push_back({st[3 * static_cast<size_t>(d)], st[3 * static_cast<size_t>(d) + 1], st[3 * static_cast<size_t>(d) + 2]});
    }
    found.emplace_back(index, std::move(ui));
  }
  ms.finish();
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first < b.first; });
  if (info.tp > 1) check_tp_record(info, found);
  for (size_t i = 0; i < found.size(); ++i)
    if (found[i].first != static_cast<int64_t>(i))
      throw H5Error("the units' 'index' attributes are not 0.." + std::to_string(found.size() - 1) + " (unit '" +
                    found[i].second.name + "' has " + std::to_string(found[i].first) + ")");
  for (auto& [i, u] : found) info.units.push_back(std::move(u));
  info.metadata_verified = ms.verify;
}

// The redundant fields agree: step = data_position.next_batch_index; tokens_seen = what the batch
// history consumed in `step` steps; the seeds of rng_state, train_config and the last segment; the
// last segment's batch geometry = train_config's.
void cross_check(CheckpointInfo& info) {
  json tc, dp, rng;
  auto parse = [](const std::string& s, const char* attr) {
    try {
      json j = json::parse(s);
      if (!j.is_object()) throw std::runtime_error("not a JSON object");
      return j;
    } catch (const std::exception& e) {
      throw H5Error(std::string("attribute '") + attr + "' is malformed: " + e.what());
    }
  };
  tc = parse(info.train_config, "train_config");
  dp = parse(info.data_position, "data_position");
  rng = parse(info.rng_state, "rng_state");
  try {
    json d = json::parse(info.data_info);
    if (!d.is_null() && !d.is_object()) throw std::runtime_error("neither null nor an object");
  } catch (const std::exception& e) {
    throw H5Error(std::string("attribute 'data' is malformed: ") + e.what());
  }
  auto field = [](const json& j, const char* key, const char* attr) -> const json& {
    if (!j.contains(key)) throw H5Error(std::string("attribute '") + attr + "' has no '" + key + "'");
    return j[key];
  };
  for (const char* k : {"seq_len", "global_batch", "micro_batch", "steps", "warmup", "seed"})
    if (!field(tc, k, "train_config").is_number_integer())
      throw H5Error(std::string("attribute 'train_config': '") + k + "' is not an integer");
  for (const char* k : {"lr", "min_lr", "beta1", "beta2", "eps", "weight_decay", "clip"})
    if (!field(tc, k, "train_config").is_number())
      throw H5Error(std::string("attribute 'train_config': '") + k + "' is not a number");
  if (!field(tc, "precision", "train_config").is_string())
    throw H5Error("attribute 'train_config': 'precision' is not a string");
  try {
    if (info.step < 0) throw H5Error("attribute 'step' is negative");
    if (field(dp, "next_batch_index", "data_position").get<int64_t>() != info.step)
      throw H5Error("attribute 'data_position' says next_batch_index " + dp["next_batch_index"].dump() +
                    ", but attribute 'step' is " + std::to_string(info.step));
    const uint64_t seed = field(rng, "seed", "rng_state").get<uint64_t>();
    if (field(tc, "seed", "train_config").get<uint64_t>() != seed)
      throw H5Error("attribute 'train_config' has seed " + tc["seed"].dump() + ", attribute 'rng_state' has " +
                    std::to_string(seed));
    if (info.format_version >= 2) {
      for (auto& g : field(dp, "segments", "data_position"))
        info.segments.push_back({g.at("from_step").get<int64_t>(), g.at("global_batch").get<int>(),
                                 g.at("seq_len").get<int>(), g.at("seed").get<uint64_t>()});
    } else if (info.step > 0) {  // version 1: one geometry for the whole run
      info.segments.push_back({0, field(tc, "global_batch", "train_config").get<int>(),
                               field(tc, "seq_len", "train_config").get<int>(), seed});
    }
    if (info.segments.empty()) {
      if (info.step != 0 || info.tokens_seen != 0)
        throw H5Error("attribute 'data_position' has no batch history, but attribute 'step' is " +
                      std::to_string(info.step) + " and 'tokens_seen' " + std::to_string(info.tokens_seen));
    } else {
      const BatchSegment& last = info.segments.back();
      if (last.seed != seed || last.global_batch != tc.at("global_batch").get<int>() ||
          last.seq_len != tc.at("seq_len").get<int>())
        throw H5Error("the last segment of attribute 'data_position' (global_batch " + std::to_string(last.global_batch) +
                      ", seq_len " + std::to_string(last.seq_len) + ", seed " + std::to_string(last.seed) +
                      ") disagrees with attributes 'train_config' and 'rng_state'");
      int64_t want = 0;
      try {
        want = tokens_of(info.segments, info.step);
      } catch (const std::invalid_argument& e) {
        throw H5Error(std::string("attribute 'data_position': ") + e.what());
      }
      if (want != info.tokens_seen)
        throw H5Error("attribute 'tokens_seen' is " + std::to_string(info.tokens_seen) + ", but " +
                      std::to_string(info.step) + " steps of the batch history in attribute 'data_position' consume " +
                      std::to_string(want) + " tokens");
    }
  } catch (const json::exception& e) {
    throw H5Error(std::string("attributes 'train_config', 'data_position' or 'rng_state' are malformed: ") + e.what());
  }
}


}  // namespace

// ---- Writers (called by write_checkpoint_file, checkpoint_data.cpp, in the file's order) ----

void write_root_attributes(hid_t file, MetaSums& ms, const CheckpointSnapshot& snap) {
  const TrainState& st = snap.state;
  put_str(file, ms, "", "format", kFormatName);
  // Version 4 only where it says more (a tensor-parallel run's tables); else version 3, which
  // older programs read.
  put_i64(file, ms, "", "format_version", snap.tp.tp > 1 ? 4 : 3);
  put_i64(file, ms, "", "step", st.step);
  put_i64(file, ms, "", "tokens_seen", st.tokens_seen);
  put_i64(file, ms, "", "world_size", snap.plan.world_size);
  put_str(file, ms, "", "model_config", snap.model_config);
  put_str(file, ms, "", "train_config", snap.train_config);
  put_str(file, ms, "", "data_position",
          json({{"next_batch_index", st.step}, {"split", "train"}, {"segments", segments_json(st.segments)}}).dump());
  put_str(file, ms, "", "rng_state", json({{"seed", st.seed}, {"generator", "splitmix64 counter (data.h, shard.h)"}}).dump());
  put_str(file, ms, "", "program_version", kProgramVersion);
  put_str(file, ms, "", "data", st.data_info.empty() ? "null" : st.data_info);
  put_str(file, ms, "", "spike_stats", spike_stats_json(st.spikes).dump());
  if (snap.tp.tp > 1)
    put_str(file, ms, "", "tensor_parallel",
            json({{"tp", snap.tp.tp}, {"dp_shard", snap.tp.dp_shard}, {"dp_replicate", snap.tp.dp_replicate}}).dump());
}

void write_unit_tp_tables(Comm& comm, hid_t g, MetaSums& ms, const UnitPlan& up, const TpUnitRecord& t, hid_t dxpl) {
  const std::string key = "units/" + up.name;
  if (t.params.size() != up.params.size()) throw std::logic_error("write_unit_tp_tables: record of the wrong unit");
  put_i64(g, ms, key, "local_numel", t.local_numel);
  put_i64(g, ms, key, "local_shard_size", t.local_shard_size);
  std::vector<int64_t> tt, st;
  for (auto& row : t.params) tt.insert(tt.end(), row.begin(), row.end());
  for (auto& rs : t.shards) st.insert(st.end(), {rs.start, rs.valid, rs.padding});
  for (auto [name, v, cols] : {std::tuple{"tp_table", &tt, 4}, std::tuple{"tp_shard_table", &st, 3}}) {
    hsize_t dims[2] = {static_cast<hsize_t>(v->size() / cols), static_cast<hsize_t>(cols)};
    write_small(comm, g, name, H5T_STD_I64LE, H5T_NATIVE_INT64, 2, dims, v->data(), dxpl);
    std::string b;
    for (int64_t x : *v) put_le<uint64_t>(b, static_cast<uint64_t>(x));
    ms.add(key + "/" + name, b);
  }
}

// Group /tokenizer (docs/checkpoint-format.md, "Tokenizer"): attribute `info` (tokenizer_record),
// then the files' bytes as u8 datasets named like the files.
void write_tokenizer_group(Comm& comm, hid_t file, MetaSums& ms, const TokenizerInfo& t, hid_t dxpl) {
  H5Id g(chk(H5Gcreate2(file, "tokenizer", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "create group /tokenizer"), H5Gclose);
  put_str(g, ms, "tokenizer", "info", tokenizer_record(t).dump());
  for (auto& [name, bytes] : t.files) {
    const hsize_t dims[1] = {static_cast<hsize_t>(bytes.size())};
    write_small(comm, g, name.c_str(), H5T_STD_U8LE, H5T_NATIVE_UINT8, 1, dims, bytes.data(), dxpl);
  }
}

void write_unit_attributes(hid_t g, MetaSums& ms, int u, const UnitPlan& up) {
  const std::string key = "units/" + up.name;
  put_i64(g, ms, key, "index", u);
  put_i64(g, ms, key, "numel", up.numel);
  put_i64(g, ms, key, "shard_size", up.shard_size);
  put_i64(g, ms, key, "padded_numel", up.padded_numel);
}

void write_unit_tables(Comm& comm, hid_t g, MetaSums& ms, const UnitPlan& up, int W, const std::vector<uint32_t>& crc,
                       hid_t dxpl) {
  const std::string key = "units/" + up.name;
  const hsize_t C = checkpoint_tensor_names().size();
  if (crc.size() != static_cast<size_t>(W) * C) throw std::logic_error("write_unit_tables: checksum table of the wrong size");
  // Shard table [W, 3] (start, valid, padding) and slice checksums [W, C].
  std::vector<int64_t> table;
  for (auto& rs : up.ranks) table.insert(table.end(), {rs.start, rs.valid, rs.padding});
  hsize_t tdims[2] = {static_cast<hsize_t>(W), 3};
  write_small(comm, g, "shard_table", H5T_STD_I64LE, H5T_NATIVE_INT64, 2, tdims, table.data(), dxpl);
  std::string tb;
  for (int64_t v : table) put_le<uint64_t>(tb, static_cast<uint64_t>(v));
  ms.add(key + "/shard_table", tb);
  hsize_t cdims[2] = {static_cast<hsize_t>(W), C};
  write_small(comm, g, "shard_crc32", H5T_STD_U32LE, H5T_NATIVE_UINT32, 2, cdims, crc.data(), dxpl);
  std::string cb;
  for (uint32_t v : crc) put_le<uint32_t>(cb, v);
  ms.add(key + "/shard_crc32", cb);
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
  H5Id rowt = param_row_type();
  hsize_t pdims[1] = {rows.size()};
  write_small(comm, g, "param_table", rowt, rowt, 1, pdims, rows.data(), dxpl);
  ms.add(key + "/param_table", param_rows_bytes(rows));
}

void write_metadata_checksums(hid_t file, const MetaSums& ms) {
  const std::string table = ms.table_json();
  write_attr_str(file, kMetaTable, table);
  write_attr_i64(file, kMetaTableCheck, crc32_bytes(table));
}

}  // namespace ckpt

using namespace ckpt;

int64_t tokens_of(const std::vector<BatchSegment>& segs, int64_t step) {
  int64_t t = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const BatchSegment& g = segs[i];
    const int64_t end = i + 1 < segs.size() ? segs[i + 1].from_step : step;
    if ((i == 0 && g.from_step != 0) || g.from_step > end || end > step || g.global_batch < 1 || g.seq_len < 1)
      throw std::invalid_argument("the batch history does not cover steps [0, " + std::to_string(step) +
                                  ") in order with positive batch sizes");
    t += (end - g.from_step) * static_cast<int64_t>(g.global_batch) * g.seq_len;
  }
  return t;
}

std::vector<std::string> architecture_differences(const std::string& ckpt, const std::string& requested) {
  json a, b;
  try {
    a = json::parse(ckpt);
    b = json::parse(requested);
  } catch (const json::exception& e) {
    throw std::invalid_argument(std::string("model config is not valid JSON: ") + e.what());
  }
  if (!a.is_object() || !b.is_object()) throw std::invalid_argument("model config is not a JSON object");
  // Keys that older versions did not write ("head_dim", "rope_scaling") take the values they meant
  // (hidden_size / num_attention_heads, no scaling): an old checkpoint of the same model matches.
  for (json* x : {&a, &b}) {
    try {
      *x = json::parse(canonical_json(from_canonical_json(x->dump())));
    } catch (const std::exception&) {
      // Malformed for from_canonical_json: compared as written, key by key.
    }
  }
  std::set<std::string> keys;
  for (auto& [k, v] : a.items()) keys.insert(k);
  for (auto& [k, v] : b.items()) keys.insert(k);
  std::vector<std::string> diff;
  for (const std::string& k : keys) {
    // How the field table (config.h) says the key compares; a key it does not know counts.
    const ModelConfigField* field = nullptr;
    for (const ModelConfigField& f : model_config_fields())
      if (k == f.key) field = &f;
    if (field && !field->architecture) continue;  // labels: they do not change the weights' meaning
    const json va = a.contains(k) ? a[k] : json(), vb = b.contains(k) ? b[k] : json();
    if (field && field->unset_matches && (va.is_null() || vb.is_null())) continue;  // unset on one side: filled from the other
    if (va != vb)
      diff.push_back(k + ": checkpoint has " + (a.contains(k) ? va.dump() : "nothing") + ", requested " +
                     (b.contains(k) ? vb.dump() : "nothing"));
  }
  return diff;
}

CheckpointInfo read_checkpoint_info(Comm& comm, const std::string& path) {
  quiet_hdf5();
  CheckpointInfo info;
  info.path = path;
  FileView v;
  try {
    std::error_code ec;
    if (!fs::exists(path, ec)) throw H5Error("no such file");
    if (fs::is_directory(path, ec)) throw H5Error("is a directory, not a checkpoint file");
    // A FIFO would block H5Fis_hdf5's open(2): refused by its type, which stat(2) gives without opening.
    if (struct stat st {}; ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      throw H5Error(std::string("is not a regular file (") + file_kind(st.st_mode) + "), not a checkpoint file");
    v.bytes = static_cast<int64_t>(fs::file_size(path, ec));
    if (ec) throw H5Error("cannot read its size (" + ec.message() + ")");
    if (H5Fis_hdf5(path.c_str()) <= 0) throw H5Error("not an HDF5 file");
    MetaSums ms;
    read_metadata(path, info, ms);
    cross_check(info);
    v.digest = fnv1a64(ms.table_json());
    v.step = info.step;
    info.file_bytes = static_cast<uint64_t>(v.bytes);
  } catch (const std::exception& e) {
    v.ok = false;
    v.err = "checkpoint '" + path + "': " + e.what();
  }
  agree_on_file(comm, path, v);
  if (!info.metadata_verified)
    log_info(comm, "note: checkpoint '" + path + "' is format version 1: its attributes carry no checksums and are "
                   "not verified (its tensor data is); saving it again writes version " +
                   std::to_string(kCheckpointFormatVersion));
  return info;
}

void check_checkpoint_layout(const CheckpointInfo& info, const ShardPlan& plan) {
  for (auto& u : info.units)
    if (plan.unit_index(u.name) < 0) throw std::runtime_error("unexpected unit '" + u.name + "' for this model");
  for (auto& up : plan.units) {
    auto it = std::find_if(info.units.begin(), info.units.end(), [&](auto& u) { return u.name == up.name; });
    if (it == info.units.end()) throw std::runtime_error("missing unit '" + up.name + "'");
    if (it->numel != up.numel)
      throw std::runtime_error("unit '" + up.name + "' holds " + std::to_string(it->numel) + " elements (attribute "
                               "'numel'), expected " + std::to_string(up.numel));
    for (auto& q : it->params)
      if (std::none_of(up.params.begin(), up.params.end(), [&](auto& ps) { return ps.spec.name == q.spec.name; }))
        throw std::runtime_error("unit '" + up.name + "' holds tensor '" + q.spec.name + "', which this model does not have");
    for (auto& ps : up.params) {
      auto pt = std::find_if(it->params.begin(), it->params.end(), [&](auto& q) { return q.spec.name == ps.spec.name; });
      if (pt == it->params.end()) throw std::runtime_error("tensor '" + ps.spec.name + "' is missing from unit '" + up.name + "'");
      // Each field that differs is named: shape, then offset, then numel.
      const std::string row = "tensor '" + ps.spec.name + "' has ";
      const std::string in = " in the file (dataset 'param_table' of unit '" + up.name + "'), expected ";
      if (pt->spec.shape != ps.spec.shape)
        throw std::runtime_error(row + "shape " + shape_str(pt->spec.shape) + " in the file, expected " +
                                 shape_str(ps.spec.shape));
      if (pt->offset != ps.offset)
        throw std::runtime_error(row + "offset " + std::to_string(pt->offset) + in + std::to_string(ps.offset));
      if (pt->numel != ps.numel)
        throw std::runtime_error(row + "numel " + std::to_string(pt->numel) + in + std::to_string(ps.numel) +
                                 " (the elements of its shape " + shape_str(ps.spec.shape) + ")");
    }
  }
}

}  // namespace shardtrain
