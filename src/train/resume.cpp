// What a resume checks and continues (resume.h): the settings compared with the checkpoint's, the
// metrics file continued at the resumed step, the tokenizer the new checkpoints record.
#include "resume.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "shardtrain/runtime/files.h"
#include "shardtrain/runtime/json_input.h"

namespace shardtrain {

namespace {
// The settings a resume compares: option name -> train_config key.
const std::vector<std::pair<std::string, std::string>>& checked_keys() {
  static const std::vector<std::pair<std::string, std::string>> k = {
      {"seq-len", "seq_len"}, {"global-batch", "global_batch"}, {"steps", "steps"},     {"lr", "lr"},
      {"min-lr", "min_lr"},   {"warmup", "warmup"},             {"beta1", "beta1"},     {"beta2", "beta2"},
      {"adam-eps", "eps"},    {"weight-decay", "weight_decay"}, {"clip", "clip"},       {"seed", "seed"},
      {"attention-mask", "attention_mask"}, {"aux-loss-scope", "aux_loss_scope"}, {"train-on", "train_on"}, {"pack", "pack"},
      {"max-length-policy", "max_length_policy"}, {"shuffle", "shuffle"}, {"router-z-loss-coef", "router_z_loss_coef"}};
  return k;
}
// Setting `key` of a train_config; null when absent, except attention_mask, aux_loss_scope and
// router_z_loss_coef: written only for "document" / "micro-batch" / a weight > 0
// (train_config_json), so absent is "causal" / "sequence" / 0, in older checkpoints too.
nlohmann::json setting(const nlohmann::json& j, const std::string& key) {
  if (j.contains(key)) return j[key];
  if (key == "aux_loss_scope") return nlohmann::json("sequence");
  if (key == "router_z_loss_coef") return nlohmann::json(0.0);
  return key == "attention_mask" ? nlohmann::json("causal") : nlohmann::json();
}
}  // namespace

const std::vector<std::string>& resume_checked_settings() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (auto& [opt, key] : checked_keys()) n.push_back(opt);
    return n;
  }();
  return names;
}

namespace {
std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string o;
  for (auto& x : v) o += (o.empty() ? "" : sep) + x;
  return o;
}

}  // namespace

// The inputs are identical on every rank, so every rank takes the same decisions.
void check_resume_settings(Comm& comm, const CheckpointInfo& info, const TrainConfig& tc) {
  nlohmann::json old, now = read_json(train_config_json(tc), json_limits::kCheckpointAttr);
  try {
    old = read_json(info.train_config, json_limits::kCheckpointAttr);
  } catch (const std::exception& e) {  // read_checkpoint_info checked it already
    throw CollectiveError(0, "checkpoint '" + info.path + "': attribute 'train_config' is malformed: " + e.what());
  }
  const auto& acc = tc.accept_changes;
  std::vector<std::string> refused, refused_names, accepted;
  bool schedule = false;
  for (auto& [opt, key] : checked_keys()) {
    if (setting(old, key).is_null() || setting(old, key) == setting(now, key)) continue;
    const std::string change = "--" + opt + " " + setting(old, key).dump() + " -> " + setting(now, key).dump();
    if (std::find(acc.begin(), acc.end(), opt) == acc.end()) {
      refused.push_back(change);
      refused_names.push_back(opt);
    } else {
      accepted.push_back(change);
      schedule = schedule || opt == "steps" || opt == "lr" || opt == "min-lr" || opt == "warmup";
    }
  }
  if (!refused.empty())
    throw CollectiveError(0, "resume from '" + info.path + "' at step " + std::to_string(info.step) +
                                 ": these settings differ from the checkpoint's: " + join(refused, ", ") +
                                 ". Resuming with them would change the run mid-way (its learning-rate schedule, "
                                 "batches or token count). Pass '--accept-change " + join(refused_names, ",") +
                                 "' to continue with the new values, or give the checkpoint's values");
  for (auto& c : accepted)
    log_info(comm, "note: resume at step " + std::to_string(info.step) + ": accepted change " + c + " (--accept-change)");
  for (auto& a : acc) {
    auto it = std::find_if(checked_keys().begin(), checked_keys().end(), [&](auto& k) { return k.first == a; });
    if (it != checked_keys().end() && !setting(old, it->second).is_null() &&
        setting(old, it->second) == setting(now, it->second))
      log_info(comm, "note: '--accept-change " + a + "': --" + a + " is unchanged (" + setting(now, it->second).dump() + ")");
  }
  if (schedule) {
    TrainConfig o = tc;
    o.steps = old["steps"].get<int64_t>();
    o.lr = old["lr"].get<double>();
    o.min_lr = old["min_lr"].get<double>();
    o.warmup = old["warmup"].get<int64_t>();
    char b[200];
    std::snprintf(b, sizeof b, "%.3e under the checkpoint's settings, %.3e under the new ones", lr_at(o, info.step),
                  lr_at(tc, info.step));
    log_info(comm, "note: the learning-rate schedule is recomputed from the new settings: step " +
                       std::to_string(info.step + 1) + " runs at lr " + b);
  }
  if (old.contains("micro_batch") && old["micro_batch"] != now["micro_batch"])
    log_info(comm, "note: resume: --micro-batch " + old["micro_batch"].dump() + " -> " + now["micro_batch"].dump() +
                       " (gradient accumulation only: the global batch and the update are the same)");
  if (old.contains("precision") && old["precision"] != now["precision"])
    log_info(comm, "note: resume: precision " + old["precision"].get<std::string>() + " -> " +
                       now["precision"].get<std::string>() + " (checkpoints hold fp32 master weights and AdamW state)");
}

// The rows moved aside were written after the checkpoint the run resumes from, by a run that then
// crashed or was stopped (and any torn last line): no step appears twice.
std::string continue_metrics(const std::string& given, int64_t step) {
  std::error_code ec;  // a symbolic link: rewrite the file it points to, not the link
  const std::string path = std::filesystem::is_symlink(given, ec) ? std::filesystem::canonical(given).string() : given;
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";  // no file yet
  std::string kept, dropped, line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    bool keep = false;
    try {
      nlohmann::json j = read_json(line, json_limits::kMetricsLine);
      keep = j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step;
    } catch (const std::exception&) {  // a torn or foreign line: moved aside
    }
    if (keep) {
      kept += line + "\n";
    } else if (!line.empty()) {
      dropped += line + "\n";
      ++n;
    }
  }
  if (n == 0) return "";
  const std::string aside = path + ".discarded";
  {
    std::ofstream d(aside, std::ios::app | std::ios::binary);
    d << dropped;
    d.flush();
    if (!d) throw std::runtime_error("cannot append to '" + aside + "'");
  }
  write_file_atomic(path, kept);
  return "metrics: moved " + std::to_string(n) + " line(s) of steps after " + std::to_string(step) + " (or unreadable) from '" +
         path + "' to '" + aside + "' (written after the checkpoint this run continues from)";
}

// The tokenizer the run's checkpoints record: the token data's, or the checkpoint's (resumed or
// --init-from) where the data names none (llm.c, nanoGPT). A model's own tokenizer is defined by
// its tokenizer.model (SentencePiece) or tokenizer.json (Hugging Face); when the data and the
// checkpoint share such a file byte for byte, they name the same tokenizer and the checkpoint's
// record is kept, with the data's other files added (an imported model keeps its tokenizer.json and
// tokenizer_config.json for export) and the end-of-turn ids of both; the data's chat template
// (chat_template.jinja) replaces the checkpoint's: chat examples were rendered with it, so the model
// learns it (and data made from a tokenizer directory carries that directory's). When both have a
// tokenizer of their own but share no such file, the data is refused (CollectiveError naming both):
// every id would mean another token. A change from or to byte-level is noted; the data's tokenizer
// is recorded.
TokenizerInfo pick_tokenizer(Comm& comm, const TokenizerInfo& ckpt, const std::string& ckpt_path,
                                    const TokenizerInfo& data, const std::string& data_path) {
  if (data.kind.empty()) return ckpt;
  if (ckpt.kind.empty()) return data;
  auto own = [](const TokenizerInfo& t) { return t.kind == "sentencepiece" || t.kind == "hf-tokenizers"; };
  if (own(data) && own(ckpt)) {
    bool same = false;
    for (const char* f : {"tokenizer.model", "tokenizer.json"}) {
      auto x = data.files.find(f), y = ckpt.files.find(f);
      if (x != data.files.end() && y != ckpt.files.end()) {
        if (x->second != y->second) {
          same = false;
          break;
        }
        same = true;
      }
    }
    if (!same)
      throw CollectiveError(0, "token file '" + data_path + "' was made with another tokenizer (" + data.kind +
                               ") than the model of checkpoint '" + ckpt_path + "' (" + ckpt.kind + "): their "
                               "tokenizer.model / tokenizer.json differ or cannot be compared, so the ids mean other "
                               "tokens. Prepare the data with the model's own tokenizer: --mode prepare --tokenizer "
                               "<its directory> (tokenizer.model), or scripts/tokenize_hf.py --tokenizer <its "
                               "directory> (tokenizer.json)");
    TokenizerInfo t = ckpt;
    for (auto& [name, bytes] : data.files) t.files.emplace(name, bytes);  // the checkpoint's own files win ...
    if (auto it = data.files.find("chat_template.jinja"); it != data.files.end()) t.files[it->first] = it->second;  // ... but this
    std::set<int64_t> eot(ckpt.end_of_turn_ids.begin(), ckpt.end_of_turn_ids.end());
    eot.insert(data.end_of_turn_ids.begin(), data.end_of_turn_ids.end());
    t.end_of_turn_ids.assign(eot.begin(), eot.end());
    return t;
  }
  if (ckpt.kind != data.kind)
    log_info(comm, "note: checkpoint '" + ckpt_path + "' records a " + ckpt.kind + " tokenizer, token file '" + data_path +
                       "' was made with " + data.kind + "; new checkpoints record the token file's");
  return data;
}
}  // namespace shardtrain
