// Checkpoint metadata, writing (checkpoint_internal.h): the root attributes, the tokenizer group,
// the unit attributes and tables, the metadata checksums; called by write_checkpoint_file
// (checkpoint_data.cpp) in the file's order.
#include <hdf5.h>

#include <algorithm>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint_internal.h"

namespace shardtrain {
using json = nlohmann::json;

namespace ckpt {
namespace {

// Group /tokenizer (docs/checkpoint-format.md, "Tokenizer"): attribute `info` is this JSON; the
// files' bytes are u8 datasets named like the files. "end_of_turn_ids" only when there are some
// (chat data), so that other checkpoints are written as before.
json tokenizer_record(const TokenizerInfo& t) {
  auto id = [](int64_t v) { return v < 0 ? json(nullptr) : json(v); };
  json files = json::object();
  for (auto& [name, bytes] : t.files) files[name] = {{"bytes", bytes.size()}, {"crc32", crc32_bytes(bytes)}};
  json r = {{"kind", t.kind}, {"vocab_size", t.vocab_size}, {"bos_id", id(t.bos_id)}, {"eos_id", id(t.eos_id)},
            {"pad_id", id(t.pad_id)}, {"unk_id", id(t.unk_id)}, {"add_bos", t.add_bos}, {"add_eos", t.add_eos},
            {"files", files}};
  if (!t.end_of_turn_ids.empty()) r["end_of_turn_ids"] = t.end_of_turn_ids;
  return r;
}

// Attribute `spike_stats` (format version 3): the loss-spike statistics as JSON. Doubles are
// written in their shortest round-trip form, so a resumed run reads back the exact window.
json spike_stats_json(const SpikeStats& st) {
  return {{"window", kSpikeWindow}, {"loss", st.loss}, {"grad_norm", st.grad_norm},
          {"skipped_in_a_row", st.skipped_in_a_row}, {"skipped_updates", st.skipped_updates}};
}

json segments_json(const std::vector<BatchSegment>& segs) {
  json a = json::array();
  for (auto& g : segs)
    a.push_back({{"from_step", g.from_step}, {"global_batch", g.global_batch}, {"seq_len", g.seq_len}, {"seed", g.seed}});
  return a;
}

}  // namespace

// ---- Writers (called by write_checkpoint_file, checkpoint_data.cpp, in the file's order) ----

void write_root_attributes(hid_t file, MetaSums& ms, const CheckpointSnapshot& snap) {
  const TrainState& st = snap.state;
  put_str(file, ms, "", "format", kFormatName);
  // Version 4, 5 or 6 only where they say more (a tensor-parallel run's tables; a context-parallel
  // run's mesh; a pipeline's record); else version 3, which older programs read. A mixture-of-experts
  // model: version 7, whatever the mesh.
  const StageUnits* su = snap.stage.get();
  const bool moe = model_config_is_moe(snap.model_config);
  put_i64(file, ms, "", "format_version", moe ? 7 : su ? 6 : snap.tp.cp > 1 ? 5 : snap.tp.tp > 1 ? 4 : 3);
  put_i64(file, ms, "", "step", st.step);
  put_i64(file, ms, "", "tokens_seen", st.tokens_seen);
  put_i64(file, ms, "", "world_size", su ? su->file_plan.world_size : snap.plan.world_size);
  put_str(file, ms, "", "model_config", snap.model_config);
  put_str(file, ms, "", "train_config", snap.train_config);
  put_str(file, ms, "", "data_position",
          json({{"next_batch_index", st.step}, {"split", "train"}, {"segments", segments_json(st.segments)}}).dump());
  put_str(file, ms, "", "rng_state", json({{"seed", st.seed}, {"generator", "splitmix64 counter (data.h, shard.h)"}}).dump());
  put_str(file, ms, "", "program_version", kProgramVersion);
  put_str(file, ms, "", "data", st.data_info.empty() ? "null" : st.data_info);
  put_str(file, ms, "", "spike_stats", spike_stats_json(st.spikes).dump());
  if (moe) {  // version 7: the mesh with pp and ep, always; the pipeline's record under PP
    // Without TP the rows are the shard group's, cp x dp_shard (a tool's snapshot, such as
    // import's, carries no mesh record: its plan's rows are its dp_shard).
    const int rows = su ? su->file_plan.world_size : snap.plan.world_size;
    const int cp = std::max(1, snap.tp.cp), dp_shard = snap.tp.tp > 1 ? snap.tp.dp_shard : rows / cp;
    put_str(file, ms, "", "mesh",
            json({{"pp", su ? su->pp : 1}, {"tp", snap.tp.tp}, {"cp", cp}, {"ep", std::max(1, snap.tp.ep)}, {"dp_shard", dp_shard},
                  {"dp_replicate", snap.tp.dp_replicate}})
                .dump());
    if (su)
      put_str(file, ms, "", "pipeline",
              json({{"pp", su->pp}, {"virtual", su->chunks_per_rank}, {"schedule", su->schedule}, {"bounds", su->bounds}})
                  .dump());
  } else if (su) {  // version 6: the mesh with pp, and the pipeline's record
    put_str(file, ms, "", "mesh",
            json({{"pp", su->pp}, {"tp", snap.tp.tp}, {"cp", snap.tp.cp}, {"dp_shard", snap.tp.dp_shard},
                  {"dp_replicate", snap.tp.dp_replicate}}).dump());
    put_str(file, ms, "", "pipeline",
            json({{"pp", su->pp}, {"virtual", su->chunks_per_rank}, {"schedule", su->schedule}, {"bounds", su->bounds}})
                .dump());
  } else if (snap.tp.cp > 1)  // version 5: the mesh with cp (in place of version 4's 'tensor_parallel')
    put_str(file, ms, "", "mesh",
            json({{"tp", snap.tp.tp}, {"cp", snap.tp.cp}, {"dp_shard", snap.tp.dp_shard},
                  {"dp_replicate", snap.tp.dp_replicate}}).dump());
  else if (snap.tp.tp > 1)
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
}  // namespace shardtrain
