// The checkpoint's HDF5 plumbing (checkpoint_internal.h): error checks, file create and open, the
// param_table row type, attributes (written collectively with identical values, read locally) and
// the metadata checksums (docs/checkpoint-format.md, "Integrity").
#include <hdf5.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "checkpoint_internal.h"

namespace shardtrain {
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

namespace {

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

}  // namespace ckpt
}  // namespace shardtrain
