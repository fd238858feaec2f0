// Private to the checkpoint code (src/io/checkpoint_*.cpp): the HDF5 plumbing and the metadata
// writers and readers that the data part (checkpoint_data.cpp) calls while it writes or reads a
// file. The file layout is docs/checkpoint-format.md; the public contract is checkpoint.h.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/files.h"

namespace shardtrain::ckpt {

inline constexpr const char* kFormatName = "shardtrain-checkpoint";
inline constexpr int kMaxDims = 4;
inline constexpr int kNameLen = 128;
inline constexpr int64_t kMaxParamRows = 1 << 16;  // rows of one unit's param_table read (a Llama block has 9)

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
  // Closes now and returns the closer's status (0 when there was nothing to close).
  herr_t close() {
    herr_t rc = id_ >= 0 && close_ ? close_(id_) : 0;
    id_ = -1;
    return rc;
  }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

// A failure inside the checkpoint code whose message does not yet name the file.
struct H5Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
hid_t chk(hid_t id, const std::string& what);
void chk(herr_t rc, const std::string& what, int);

// "N KiB free in 'DIR'" (statvfs: the space an unprivileged user may use), or "" if unknown.
// Defined in checkpoint_dir.cpp.
std::string free_space_in(const std::string& dir);

// HDF5's innermost error message (often the informative one, e.g. "truncated file").
std::string h5_detail();
// Turns off HDF5's own error printing (shardtrain reports failures itself, naming the file); once
// per process, idempotent.
void quiet_hdf5();

// Collective create through MPI-IO (saves). On failure returns an invalid id and sets *why to
// HDF5's own reason.
H5Id create_file(Comm& comm, const std::string& path, std::string* why);
// Local read-only open (POSIX driver, no file locking) on this rank alone. On failure returns an
// invalid id and sets *why.
H5Id open_local(const std::string& path, std::string* why);

uint32_t crc32_bytes(const std::string& b);
inline uint32_t crc32_of(const float* p, size_t n) { return crc32_update(0, p, n * sizeof(float)); }

// The checksums of the metadata items written or read so far (docs/checkpoint-format.md,
// "Integrity"): keys "@step" (root attribute), "units/U@numel" (unit attribute),
// "units/U/shard_table" (table), "tokenizer@info". When reading a version-2 file (`verify`), each
// item is compared with the stored table as it is added; the first damaged item throws H5Error.
struct MetaSums {
  std::map<std::string, uint32_t> computed, stored;
  bool verify = false;
  void add(const std::string& key, const std::string& bytes);
  void finish() const;             // every stored entry names an item that was read
  std::string table_json() const;  // the metadata_crc32 attribute's text
};

// ---- The param_table row, attributes and small tables (checkpoint_h5.cpp) ----
// The packed record of one row of a unit's param_table.
struct ParamRow {
  char name[kNameLen];
  int64_t offset;
  int64_t numel;
  int32_t ndim;
  int64_t shape[kMaxDims];
};
H5Id param_row_type();  // the HDF5 compound type of ParamRow
// ---- Metadata checksums (docs/checkpoint-format.md, "Integrity") ----------------------------
// Every attribute and small table is an item with a key ("@step" for a root attribute,
// "units/U@numel" for a unit attribute, "units/U/shard_table" for a table) and canonical bytes
// (a string's UTF-8 bytes; an int64 as 8 bytes little-endian; a table's elements little-endian,
// row-major; a param_table row packed field by field, 180 bytes). The root attribute
// `metadata_crc32` maps every key to the zlib CRC32 of its bytes; `metadata_crc32_check` is the
// CRC32 of that attribute's own bytes.
inline constexpr const char* kMetaTable = "metadata_crc32";
inline constexpr const char* kMetaTableCheck = "metadata_crc32_check";
template <typename U> void put_le(std::string& b, U v) {
  for (size_t i = 0; i < sizeof(U); ++i) b.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}
std::string le_i64(int64_t v);  // 8 bytes little-endian
// A param_table's canonical bytes: each row packed field by field, little-endian (180 bytes a row).
std::string param_rows_bytes(const std::vector<ParamRow>& rows);
// Attributes. Every rank writes the same value (parallel HDF5 requires attribute writes to be
// collective with identical data). put_* also record the item's checksum under prefix + "@" + name.
void write_attr_str(hid_t obj, const char* name, const std::string& v);
void write_attr_i64(hid_t obj, const char* name, int64_t v);
void put_str(hid_t obj, MetaSums& ms, const std::string& prefix, const char* name, const std::string& v);
void put_i64(hid_t obj, MetaSums& ms, const std::string& prefix, const char* name, int64_t v);
// Opens attribute `name` of `obj`, which must hold exactly one element of class `cls`; throws
// H5Error naming `where` otherwise.
H5Id open_scalar_attr(hid_t obj, const char* name, H5T_class_t cls, const std::string& where);
// Reads one string or integer attribute; get_* also check it against the metadata checksums.
std::string read_attr_str(hid_t obj, const char* name, const std::string& where);
int64_t read_attr_i64(hid_t obj, const char* name, const std::string& where);
std::string get_str(hid_t obj, MetaSums& ms, const std::string& prefix, const char* name, const std::string& where);
int64_t get_i64(hid_t obj, MetaSums& ms, const std::string& prefix, const char* name, const std::string& where);
// Collective write of a whole small dataset by rank 0 (other ranks select nothing).
void write_small(Comm& comm, hid_t grp, const char* name, hid_t ftype, hid_t mtype, int rank, const hsize_t* dims,
                 const void* data, hid_t dxpl);

// ---- Writing (checkpoint_meta_write.cpp). Every rank calls each with the same values (parallel HDF5
// requires collective attribute writes with identical data); tables are written by rank 0.

// Whether a canonical model config (attribute 'model_config') is a mixture-of-experts model's:
// "num_experts" present and > 0 (canonical_json writes it only then); such a model's checkpoint is
// format version 7 (docs/checkpoint-format.md). Malformed text: false (read elsewhere, refused there).
bool model_config_is_moe(const std::string& model_config);
// Version 6, and version 7 with pp > 1: attribute 'pipeline' and the units' 'stage'.
inline bool has_pipeline_record(const CheckpointInfo& info) {
  return info.format_version == 6 || (info.format_version >= 7 && info.pp > 1);
}

// Root attributes: format, format_version, step, tokens_seen, world_size (the snapshot's plan),
// model_config, train_config, data_position, rng_state, program_version, data, spike_stats.
void write_root_attributes(hid_t file, MetaSums& ms, const CheckpointSnapshot& snap);
// Group /tokenizer; only when snap.state.tokenizer.kind is not empty.
void write_tokenizer_group(Comm& comm, hid_t file, MetaSums& ms, const TokenizerInfo& t, hid_t dxpl);
// Unit `u`'s attributes: index, numel, shard_size, padded_numel.
void write_unit_attributes(hid_t group, MetaSums& ms, int u, const UnitPlan& up);
// Version 4 (snapshot of a tensor-parallel run): the unit's attributes local_numel and
// local_shard_size and datasets tp_table [params][4] and tp_shard_table [dp_shard][3]. Collective.
void write_unit_tp_tables(Comm& comm, hid_t group, MetaSums& ms, const UnitPlan& up, const TpUnitRecord& t, hid_t dxpl);
// Unit tables: shard_table [W][3] (start, valid, padding), shard_crc32 [W][C] (`crc`, row-major:
// shard rank, then tensor column), param_table (one row per parameter).
void write_unit_tables(Comm& comm, hid_t group, MetaSums& ms, const UnitPlan& up, int W,
                       const std::vector<uint32_t>& crc, hid_t dxpl);
// The metadata_crc32 table and its own check, last.
void write_metadata_checksums(hid_t file, const MetaSums& ms);

}  // namespace shardtrain::ckpt
