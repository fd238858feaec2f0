// Checkpoint metadata against a model and a run (checkpoint.h): whether a file's units and tensors
// are the ones a model's shard plan has (check_checkpoint_layout), which fields of the file's model
// config change the weights' meaning against a requested one (architecture_differences), and the
// words that name the saving run's layout (saved_layout_words). What they compare was read and
// verified by read_checkpoint_info (checkpoint_meta_read.cpp).
#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"
#include "shardtrain/runtime/json_input.h"

namespace shardtrain {
using json = nlohmann::json;

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

}  // namespace

std::vector<std::string> architecture_differences(const std::string& ckpt, const std::string& requested) {
  json a, b;
  try {
    a = read_json(ckpt, json_limits::kCheckpointAttr);
    b = read_json(requested, json_limits::kCheckpointAttr);
  } catch (const json::exception& e) {
    throw std::invalid_argument(std::string("model config is not valid JSON: ") + e.what());
  }
  if (!a.is_object() || !b.is_object()) throw std::invalid_argument("model config is not a JSON object");
  // Keys that older versions did not write ("head_dim", "rope_scaling") take the values they meant
  // (hidden_size / num_attention_heads, no scaling): an old checkpoint of the same model matches.
  std::vector<std::string> diff;
  for (json* x : {&a, &b}) {
    try {
      *x = read_json(canonical_json(from_canonical_json(x->dump())), json_limits::kCheckpointAttr);
    } catch (const std::exception& e) {
      // Malformed for from_canonical_json (a null, an unknown key): a difference in itself (the
      // file's config is not one this version reads), and compared as written, key by key.
      const std::string why = e.what();
      diff.push_back(std::string(x == &a ? "checkpoint" : "requested") + ": " +
                     (why.size() <= 300 ? why : why.substr(0, 300) + "..."));
    }
  }
  std::set<std::string> keys;
  for (auto& [k, v] : a.items()) keys.insert(k);
  for (auto& [k, v] : b.items()) keys.insert(k);
  // A value is quoted whole up to 120 characters (a crafted list may hold a million entries).
  const auto shown = [](const json& v) {
    const std::string d = v.dump();
    return d.size() <= 120 ? d : d.substr(0, 100) + "... (" + std::to_string(d.size()) + " characters)";
  };
  for (const std::string& k : keys) {
    // How the field table (config.h) says the key compares; a key it does not know counts.
    const ModelConfigField* field = nullptr;
    for (const ModelConfigField& f : model_config_fields())
      if (k == f.key) field = &f;
    if (field && !field->architecture) continue;  // labels: they do not change the weights' meaning
    const json va = a.contains(k) ? a[k] : json(), vb = b.contains(k) ? b[k] : json();
    if (field && field->unset_matches && (va.is_null() || vb.is_null())) continue;  // unset on one side: filled from the other
    if (va != vb)
      diff.push_back((k.size() <= 64 ? k : k.substr(0, 64) + "...") + ": checkpoint has " +
                     (a.contains(k) ? shown(va) : "nothing") + ", requested " + (b.contains(k) ? shown(vb) : "nothing"));
  }
  return diff;
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

std::string saved_layout_words(const CheckpointInfo& info) {
  if (info.pp > 1) {  // version 6: a stage's rows
    std::string w = "pp " + std::to_string(info.pp) + " (" + info.pp_schedule +
                    (info.pp_virtual > 1 ? ", " + std::to_string(info.pp_virtual) + " chunks per stage" : "") +
                    ") x world size " + std::to_string(info.world_size) + " per stage";
    if (info.tp > 1)
      w += ": tp " + std::to_string(info.tp) + " x cp " + std::to_string(info.cp) + " x dp_shard " +
           std::to_string(info.tp_dp_shard) + " x dp_replicate " + std::to_string(info.tp_dp_replicate);
    else
      w += ": cp " + std::to_string(info.cp) + " x dp_shard " + std::to_string(info.tp_dp_shard) +
           (info.tp_dp_replicate > 1 ? " (one of " + std::to_string(info.tp_dp_replicate) + " replica groups)" : "");
    return w;
  }
  if (info.cp > 1 && info.tp > 1)  // the canonical rows of the world
    return "world size " + std::to_string(info.world_size) + ": tp " + std::to_string(info.tp) + " x cp " +
           std::to_string(info.cp) + " x dp_shard " + std::to_string(info.tp_dp_shard) + " x dp_replicate " +
           std::to_string(info.tp_dp_replicate);
  if (info.cp > 1)  // the rows of a shard group
    return "world size " + std::to_string(info.world_size) + ": cp " + std::to_string(info.cp) + " x dp_shard " +
           std::to_string(info.tp_dp_shard) +
           (info.tp_dp_replicate > 1 ? " (one of " + std::to_string(info.tp_dp_replicate) + " replica groups)" : "");
  if (info.tp > 1)
    return "world size " + std::to_string(info.world_size) + ": tp " + std::to_string(info.tp) + " x dp_shard " +
           std::to_string(info.tp_dp_shard) + " x dp_replicate " + std::to_string(info.tp_dp_replicate);
  const nlohmann::json j = read_json_or_discarded(info.train_config, json_limits::kCheckpointAttr);
  if (j.is_object() && j.contains("world_size") && j.contains("shard_group_size") && j["world_size"] != j["shard_group_size"])
    return "world size " + j["world_size"].dump() + ", shard group size " + j["shard_group_size"].dump();
  return "world size " + std::to_string(info.world_size);
}

}  // namespace shardtrain
