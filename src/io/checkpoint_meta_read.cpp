// Checkpoint metadata, reading and validation (checkpoint.h, docs/checkpoint-format.md): the root
// and unit attributes and tables with their checksums ("Integrity") and cross-checks, what a file
// holds (read_checkpoint_info). Its comparison with a model (layout, config) is
// checkpoint_meta_compare.cpp's. Reads are local to each rank (HDF5's POSIX driver, no collective
// inside HDF5), and the ranks agree on what they read afterwards.
#include <hdf5.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <tuple>

#include "checkpoint_internal.h"
#include "shardtrain/runtime/json_input.h"
#include "shardtrain/runtime/pipeline_kind.h"  // parse_pipeline_kind
#include "shardtrain/runtime/files.h"
#include "shardtrain/model/model.h"

namespace shardtrain {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace ckpt {
namespace {

// Reads group /tokenizer (kind "" when absent), verifying each file against the CRC32 in `info`.
TokenizerInfo read_tokenizer_group(hid_t file, MetaSums& ms) {
  TokenizerInfo t;
  t.kind = "";
  if (H5Lexists(file, "tokenizer", H5P_DEFAULT) <= 0) return t;
  H5Id g(chk(H5Gopen2(file, "tokenizer", H5P_DEFAULT), "open group /tokenizer"), H5Gclose);
  const std::string text = get_str(g, ms, "tokenizer", "info", "group '/tokenizer'");
  json j;
  try {
    j = read_json(text, json_limits::kCheckpointAttr);
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
    if (j.contains("end_of_turn_ids")) {  // optional: chat data's end-of-turn ids, ascending, in the vocabulary
      const json& e = j["end_of_turn_ids"];
      if (!e.is_array()) throw std::runtime_error("'end_of_turn_ids' is not a list");
      for (const json& v : e) {
        if (!v.is_number_unsigned() || (t.vocab_size > 0 && v.get<uint64_t>() >= t.vocab_size))
          throw std::runtime_error("'end_of_turn_ids' holds " + v.dump().substr(0, 40) + ", not a token id below vocab_size " +
                                   std::to_string(t.vocab_size));
        const int64_t x = static_cast<int64_t>(v.get<uint64_t>());
        if (!t.end_of_turn_ids.empty() && x <= t.end_of_turn_ids.back())
          throw std::runtime_error("'end_of_turn_ids' is not ascending without repeats");
        t.end_of_turn_ids.push_back(x);
      }
    }
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

// The statistics of attribute `spike_stats`; throws H5Error naming what is malformed. A window
// longer than this program's (a future version) keeps its newest kSpikeWindow values.
SpikeStats parse_spike_stats(const std::string& text) {
  SpikeStats st;
  try {
    const json j = read_json(text, json_limits::kCheckpointAttr);
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
    validate(mc, "in attribute 'model_config'");  // before llama_units: a crafted size is refused, not allocated
    // Version 5: the TP-local buffer is sharded over the FSDP shard group, dp_shard x cp.
    want = tp_record({ShardPlan::build(llama_units(mc, info.tp, 0), info.tp_dp_shard * info.cp)},
                     MeshDims{info.tp_dp_replicate, info.tp_dp_shard, info.cp, info.tp});
  } catch (const std::exception& e) {
    throw H5Error("attribute '" + std::string(info.format_version >= 5 ? "mesh" : "tensor_parallel") + "' (tp " +
                  std::to_string(info.tp) + ") does not fit attribute 'model_config': " + e.what());
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
                      "), the rule of docs/checkpoint-format.md for local_numel and dp_shard" +
                      (info.cp > 1 ? " x cp" : ""));
    }
  }
}

// The format attributes and, from version 2 on, the metadata checksum table (stored into ms, which
// then verifies every item read after it): checked before anything else in the file is trusted.
// Returns attribute 'format'.
std::string read_format_and_checksums(hid_t file, CheckpointInfo& info, MetaSums& ms) {
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
      const json t = read_json(table, json_limits::kCheckpointAttr);
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
  return fmt;
}

// Root attributes (after the format): step, tokens, world size, configs, data, tokenizer, spikes.
void read_root_attributes(hid_t file, CheckpointInfo& info, MetaSums& ms, const std::string& fmt) {
  const std::string where = "root group";
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
}

// Version 4: attribute 'tensor_parallel', the saving run's mesh (tp x dp_shard x dp_replicate = world_size).
void read_tp_mesh(hid_t file, CheckpointInfo& info, MetaSums& ms) {
  const std::string where = "root group";
  const std::string tp = get_str(file, ms, "", "tensor_parallel", where);
  try {
    const json j = read_json(tp, json_limits::kCheckpointAttr);
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

// Version 5: attribute 'mesh', the saving run's mesh with context parallelism (cp >= 2). The file
// holds the rows of the FSDP shard group (cp x dp_shard = world_size) without TP, the canonical rows
// of the world (tp x cp x dp_shard x dp_replicate = world_size) with TP. Version 6: the same with
// "pp" (>= 2) and any cp >= 1; the rows are one stage's.
void read_mesh(hid_t file, CheckpointInfo& info, MetaSums& ms) {
  const std::string where = "root group";
  const std::string m = get_str(file, ms, "", "mesh", where);
  int dims[6] = {0, 0, 0, 0, 1, 1};
  const char* keys[6] = {"tp", "cp", "dp_shard", "dp_replicate", "pp", "ep"};
  const int nkeys = info.format_version >= 7 ? 6 : info.format_version >= 6 ? 5 : 4;
  try {
    const json j = read_json(m, json_limits::kCheckpointAttr);
    if (!j.is_object()) throw H5Error("attribute 'mesh' (" + m + ") is not a JSON object");
    if (info.format_version >= 7)  // version 7 names every key it has (older readers took any more)
      for (const auto& item : j.items())
        if (std::find(keys, keys + nkeys, item.key()) == keys + nkeys)
          throw H5Error("attribute 'mesh' (" + m + "): key '" + item.key() + "' is not one of version " +
                        std::to_string(info.format_version) + "'s (tp, cp, dp_shard, dp_replicate, pp, ep)");
    for (int k = 0; k < nkeys; ++k) {
      if (!j.contains(keys[k])) throw H5Error("attribute 'mesh' (" + m + "): key '" + keys[k] + "' is missing");
      const json& v = j.at(keys[k]);
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (int64_t{1} << 24))
        throw H5Error("attribute 'mesh' (" + m + "): '" + keys[k] + "' is not an integer in [1, 2^24]");
      dims[k] = static_cast<int>(v.get<int64_t>());
    }
  } catch (const json::exception& e) {
    throw H5Error(std::string("attribute 'mesh' is malformed: ") + e.what());
  }
  info.tp = dims[0];
  info.cp = dims[1];
  info.tp_dp_shard = dims[2];
  info.tp_dp_replicate = dims[3];
  info.pp = dims[4];
  info.ep = dims[5];
  const int64_t rows = int64_t{info.cp} * info.tp_dp_shard * (info.tp > 1 ? int64_t{info.tp} * info.tp_dp_replicate : 1);
  if (info.format_version >= 7) {  // any pp, cp and tp; ep divides the experts and dp_shard x cp
    if (rows != info.world_size)
      throw H5Error("attribute 'mesh' (" + m + ") is not a mesh whose " +
                    (info.tp > 1 ? "sizes (tp x cp x dp_shard x dp_replicate)" : "shard group (cp x dp_shard)") +
                    " multiply to attribute 'world_size' (" + std::to_string(info.world_size) + ")");
    int64_t experts = 0;
    try {
      const json mc = read_json(info.model_config, json_limits::kCheckpointAttr);
      experts = mc.at("num_experts").get<int64_t>();
    } catch (const json::exception& e) {
      throw H5Error("attribute 'model_config' has no integer 'num_experts' (" + std::string(e.what()) + ")");
    }
    if (experts < 1 || experts % info.ep != 0)
      throw H5Error("attribute 'mesh' (" + m + "): 'ep' (" + std::to_string(info.ep) +
                    ") does not divide the experts (num_experts " + std::to_string(experts) +
                    " in attribute 'model_config')");
    if ((int64_t{info.tp_dp_shard} * info.cp) % info.ep != 0)
      throw H5Error("attribute 'mesh' (" + m + "): 'ep' (" + std::to_string(info.ep) +
                    ") does not divide dp_shard x cp (" + std::to_string(int64_t{info.tp_dp_shard} * info.cp) +
                    "), which the EP groups are formed inside");
    return;
  }
  if (info.format_version >= 6) {
    if (info.pp < 2 || rows != info.world_size)
      throw H5Error("attribute 'mesh' (" + m + ") is not a mesh of pp >= 2 whose stage's " +
                    (info.tp > 1 ? "sizes (tp x cp x dp_shard x dp_replicate)" : "shard group (cp x dp_shard)") +
                    " multiply to attribute 'world_size' (" + std::to_string(info.world_size) + ")");
    return;
  }
  if (info.cp < 2 || rows != info.world_size)
    throw H5Error("attribute 'mesh' (" + m + ") is not a mesh of cp >= 2 whose " +
                  (info.tp > 1 ? "sizes (tp x cp x dp_shard x dp_replicate)" : "shard group (cp x dp_shard)") +
                  " multiply to attribute 'world_size' (" + std::to_string(info.world_size) + ")");
}

// Version 6: attribute 'pipeline', {"pp", "virtual", "schedule", "bounds"}: pp equal to mesh's,
// virtual >= 1, a schedule name, and S + 1 = pp x virtual + 1 chunk boundaries from 0, strictly
// increasing (no chunk is empty), to the model's number of blocks.
void read_pipeline(hid_t file, CheckpointInfo& info, MetaSums& ms) {
  const std::string text = get_str(file, ms, "", "pipeline", "root group");
  const std::string w = "attribute 'pipeline' (" + text + ")";
  int64_t L = -1;
  try {
    L = read_json(info.model_config, json_limits::kCheckpointAttr).at("num_hidden_layers").get<int64_t>();
  } catch (const json::exception& e) {
    throw H5Error("attribute 'model_config' has no integer 'num_hidden_layers' (" + std::string(e.what()) + ")");
  }
  try {
    const json j = read_json(text, json_limits::kCheckpointAttr);
    if (!j.is_object()) throw H5Error(w + " is not a JSON object");
    for (const char* k : {"pp", "virtual"})
      if (!j.contains(k) || !j[k].is_number_integer() || j[k].get<int64_t>() < 1 || j[k].get<int64_t>() > (1 << 24))
        throw H5Error(w + ": '" + k + "' is not an integer in [1, 2^24]");
    if (j["pp"].get<int64_t>() != info.pp)
      throw H5Error(w + ": 'pp' is " + j["pp"].dump() + ", but attribute 'mesh' says pp " + std::to_string(info.pp));
    PipelineKind kind;
    if (!j.contains("schedule") || !j["schedule"].is_string() || !parse_pipeline_kind(j["schedule"].get<std::string>(), &kind))
      throw H5Error(w + ": 'schedule' is not a schedule's name (gpipe, 1f1b, interleaved, zero-bubble)");
    info.pp_virtual = static_cast<int>(j["virtual"].get<int64_t>());
    info.pp_schedule = j["schedule"].get<std::string>();
    const int64_t S = int64_t{info.pp} * info.pp_virtual;
    if (!j.contains("bounds") || !j["bounds"].is_array() || static_cast<int64_t>(j["bounds"].size()) != S + 1)
      throw H5Error(w + ": 'bounds' is not an array of pp x virtual + 1 = " + std::to_string(S + 1) +
                    " chunk boundaries");
    int64_t prev = -1;
    for (const json& b : j["bounds"]) {
      if (!b.is_number_integer()) throw H5Error(w + ": 'bounds' holds " + b.dump() + ", not an integer");
      const int64_t v = b.get<int64_t>();
      if (prev < 0 ? v != 0 : v <= prev)
        throw H5Error(w + ": 'bounds' must rise strictly from 0 (every chunk holds a block), but holds " +
                      std::to_string(v) + (prev < 0 ? " first" : " after " + std::to_string(prev)));
      prev = v;
    }
    if (prev != L)
      throw H5Error(w + ": 'bounds' ends at " + std::to_string(prev) + ", but the model (attribute 'model_config') has " +
                    std::to_string(L) + " blocks");
    info.pp_bounds = j["bounds"].get<std::vector<int>>();
  } catch (const json::exception& e) {
    throw H5Error(w + " is malformed: " + e.what());
  }
}

// Version 6: every unit's attribute 'stage' follows from attribute 'pipeline' (pipeline_unit_stage).
void check_unit_stages(const CheckpointInfo& info, const std::vector<std::pair<int64_t, CheckpointUnitInfo>>& units) {
  for (auto& [index, ui] : units) {
    const int want = pipeline_unit_stage(info.pp_bounds, info.pp, static_cast<int>(index));
    if (want < 0)
      throw H5Error("unit '" + ui.name + "' (index " + std::to_string(index) + ") is not a unit of the " +
                    std::to_string(info.pp_bounds.back()) + " blocks of attribute 'pipeline'");
    if (ui.stage != want)
      throw H5Error("unit '" + ui.name + "': attribute 'stage' is " + std::to_string(ui.stage) +
                    ", but attribute 'pipeline' (bounds " + json(info.pp_bounds).dump() + ", pp " +
                    std::to_string(info.pp) + ") puts it on stage " + std::to_string(want));
  }
}

// Reads a [rows][cols] table into `out`, sized only once the dataset's shape is known to match
// (world_size comes from the file: it must not decide an allocation before it is confirmed).
template <typename T>
void read_unit_table(hid_t g, const std::string& w, const char* ds, hid_t mtype, std::vector<T>& out, hsize_t rows,
                     hsize_t cols, const char* from = "attribute 'world_size'") {
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
}

// A unit's shard_table (checked against numel and world_size) and shard_crc32 table.
void read_unit_shards(hid_t g, const std::string& w, const std::string& key, int W, CheckpointUnitInfo& ui, MetaSums& ms) {
  std::vector<int64_t> table;
  read_unit_table(g, w, "shard_table", H5T_NATIVE_INT64, table, W, 3);
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
  read_unit_table(g, w, "shard_crc32", H5T_NATIVE_UINT32, ui.crc32, W, checkpoint_tensor_names().size());
  std::string cb;
  for (uint32_t v : ui.crc32) put_le<uint32_t>(cb, v);
  ms.add(key + "/shard_crc32", cb);
}

// A unit's param_table: one slot per tensor, inside the unit, no name twice.
void read_param_table(hid_t g, const std::string& w, const std::string& key, hid_t rowt, CheckpointUnitInfo& ui,
                      MetaSums& ms) {
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
}

// Version 4: the saving run's TP record of one unit (docs/checkpoint-format.md).
void read_unit_tp_record(hid_t g, const std::string& w, const std::string& key, const CheckpointInfo& info,
                         CheckpointUnitInfo& ui, MetaSums& ms) {
  TpUnitRecord& t = ui.tp;
  t.local_numel = get_i64(g, ms, key, "local_numel", w);
  t.local_shard_size = get_i64(g, ms, key, "local_shard_size", w);
  std::vector<int64_t> tt, st;
  read_unit_table(g, w, "tp_table", H5T_NATIVE_INT64, tt, ui.params.size(), 4, "dataset 'param_table'");
  const int fsdp = info.tp_dp_shard * info.cp;  // the TP-local buffer's shard group (version 5: with cp)
  read_unit_table(g, w, "tp_shard_table", H5T_NATIVE_INT64, st, static_cast<hsize_t>(fsdp), 3,
                  info.format_version >= 5 ? "attribute 'mesh'" : "attribute 'tensor_parallel'");
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
  for (int d = 0; d < fsdp; ++d)
    t.shards.push_back({st[3 * static_cast<size_t>(d)], st[3 * static_cast<size_t>(d) + 1], st[3 * static_cast<size_t>(d) + 2]});
}

// Link i of group /units: its attributes, tables and (version 4) TP record, with its 'index'.
std::pair<int64_t, CheckpointUnitInfo> read_unit(hid_t units, hsize_t i, const CheckpointInfo& info, hid_t rowt,
                                                 MetaSums& ms) {
  const int W = info.world_size;
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
  read_unit_shards(g, w, key, W, ui, ms);
  read_param_table(g, w, key, rowt, ui, ms);
  if (info.tp > 1) read_unit_tp_record(g, w, key, info, ui, ms);
  if (has_pipeline_record(info)) {
    const int64_t stage = get_i64(g, ms, key, "stage", w);
    if (stage < 0 || stage >= info.pp)
      throw H5Error(w + ": attribute 'stage' is " + std::to_string(stage) + ", not a stage of pp " + std::to_string(info.pp));
    ui.stage = static_cast<int>(stage);
  }
  return {index, std::move(ui)};
}

// This rank's reading of the metadata of `path` (no collectives). Throws H5Error/std::exception
// with a message that does not yet name the file.
void read_metadata(const std::string& path, CheckpointInfo& info, MetaSums& ms) {
  std::string why;
  H5Id file = open_local(path, &why);
  if (!file.ok()) throw H5Error("cannot open (" + why + "); the file may be truncated or damaged");
  const std::string fmt = read_format_and_checksums(file, info, ms);
  read_root_attributes(file, info, ms, fmt);
  // A mixture-of-experts model's checkpoint is version 7, and version 7 is one's.
  const bool moe = model_config_is_moe(info.model_config);
  if (info.format_version >= 7 && !moe)
    throw H5Error("attribute 'format_version' is " + std::to_string(info.format_version) +
                  " (a mixture-of-experts model's), but attribute 'model_config' is a dense model's");
  if (info.format_version < 7 && moe)
    throw H5Error("attribute 'model_config' is a mixture-of-experts model's, which format version 7 holds, but "
                  "attribute 'format_version' is " + std::to_string(info.format_version));
  if (info.format_version == 4) read_tp_mesh(file, info, ms);
  if (info.format_version >= 5) read_mesh(file, info, ms);
  if (has_pipeline_record(info)) read_pipeline(file, info, ms);
  H5Id units(H5Gopen2(file, "units", H5P_DEFAULT), H5Gclose);
  if (!units.ok()) throw H5Error("group '/units' is missing");
  H5G_info_t gi;
  chk(H5Gget_info(units, &gi), "read /units", 0);
  std::vector<std::pair<int64_t, CheckpointUnitInfo>> found;
  H5Id rowt = param_row_type();
  for (hsize_t i = 0; i < gi.nlinks; ++i) found.push_back(read_unit(units, i, info, rowt, ms));
  ms.finish();
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first < b.first; });
  if (info.tp > 1) check_tp_record(info, found);
  for (size_t i = 0; i < found.size(); ++i)
    if (found[i].first != static_cast<int64_t>(i))
      throw H5Error("the units' 'index' attributes are not 0.." + std::to_string(found.size() - 1) + " (unit '" +
                    found[i].second.name + "' has " + std::to_string(found[i].first) + ")");
  if (has_pipeline_record(info)) check_unit_stages(info, found);
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
      json j = read_json(s, json_limits::kCheckpointAttr);
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
    json d = read_json(info.data_info, json_limits::kCheckpointAttr);
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

bool model_config_is_moe(const std::string& model_config) {
  try {
    const json j = read_json(model_config, json_limits::kCheckpointAttr);
    return j.is_object() && j.contains("num_experts") && j["num_experts"].is_number_integer() &&
           j["num_experts"].get<int64_t>() > 0;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace ckpt

using namespace ckpt;

int pipeline_unit_stage(const std::vector<int>& bounds, int pp, int u) {
  if (bounds.size() < 2 || pp < 1) return -1;
  const int S = static_cast<int>(bounds.size()) - 1, L = bounds.back();
  if (u < 0 || u > L + 1) return -1;
  if (u == 0) return 0;              // the embedding: chunk 0's (the tied copy of chunk S-1 is not stored)
  if (u == L + 1) return (S - 1) % pp;  // the final norm (and untied head): the last chunk's
  for (int c = 0; c < S; ++c)
    if (u - 1 >= bounds[static_cast<size_t>(c)] && u - 1 < bounds[static_cast<size_t>(c) + 1]) return c % pp;
  return -1;
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


}  // namespace shardtrain
