// Hugging Face export and import (hf.h); text generation is hf_generate.cpp's.
#include "shardtrain/io/hf.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include <sentencepiece_processor.h>

#include "hf_internal.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"
#include "shardtrain/data/data.h"
#include "shardtrain/runtime/files.h"
#include "shardtrain/runtime/json_input.h"
#include "shardtrain/model/model.h"
#include "shardtrain/data/tokenizer.h"

namespace shardtrain {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using hf::Loaded;
using hf::load_model;

uint64_t parse_size(const std::string& s) {
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  std::string num = s.substr(0, i), unit = s.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = unit.empty() || unit == "B" ? 1 : unit == "KB" ? 1e3 : unit == "MB" ? 1e6 : unit == "GB" ? 1e9
              : unit == "KIB" ? 1024.0 : unit == "MIB" ? 1048576.0 : unit == "GIB" ? 1073741824.0 : -1;
  double v = -1;
  try {
    size_t used = 0;
    if (!num.empty()) v = std::stod(num, &used);
    if (used != num.size()) v = -1;  // "1.2.3"
  } catch (...) {
    v = -1;
  }
  if (mult < 0 || !(v > 0) || !(v * mult >= 1) || !(v * mult < 9.2e18))
    throw std::invalid_argument("option '--max-shard-size' must be a positive size like 5GB, 200MB or 4096, got '" + s + "'");
  return static_cast<uint64_t>(v * mult);
}

std::string canonical_tensor_name(const std::string& name) {
  static const std::set<std::string> wrappers = {"module", "_orig_mod", "_fsdp_wrapped_module"};
  std::string out, part;
  std::istringstream is(name);
  while (std::getline(is, part, '.'))
    if (!wrappers.count(part)) out += (out.empty() ? "" : ".") + part;
  return out;
}

namespace {

// GPT-2's bytes_to_unicode: the printable character standing for each byte in a ByteLevel
// tokenizer. With vocab[char(b)] = b, the tokenizer's ids are exactly the bytes.
std::vector<std::string> byte_chars() {
  std::vector<int> bs, cs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  cs = bs;
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
      bs.push_back(b);
      cs.push_back(256 + n++);
    }
  std::vector<std::string> out(256);
  for (size_t i = 0; i < bs.size(); ++i) {
    int c = cs[i];
    std::string u;  // UTF-8 of code point c (< 0x800)
    if (c < 0x80) u.push_back(static_cast<char>(c));
    else {
      u.push_back(static_cast<char>(0xC0 | (c >> 6)));
      u.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
    out[static_cast<size_t>(bs[i])] = u;
  }
  return out;
}

// The byte-level tokenizer of data.h as a tokenizers `tokenizer.json`: ids 0-255 are the bytes,
// "<s>" = bos_token_id, "</s>" = the primary eos_token_id (both added special tokens). The
// post-processor prepends "<s>" (TemplateProcessing, https://huggingface.co/docs/tokenizers/api/post-processors),
// so the tokenizer's ids for a text are exactly what `--mode generate` feeds: BOS + UTF-8 bytes.
// The templates are the ones transformers itself builds for add_bos_token = true, add_eos_token =
// false (TokenizersBackend.update_post_processor): single "<s>:0 $A:0", pair "<s>:0 $A:0 <s>:1 $B:1".
json tokenizer_json(const ModelConfig& mc) {
  json vocab = json::object();
  auto chars = byte_chars();
  for (int b = 0; b < 256; ++b) vocab[chars[static_cast<size_t>(b)]] = b;
  json bl = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  auto special = [](int id, const char* content) {
    return json{{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  auto piece = [](const char* kind, const char* id, int type_id) {
    return json{{kind, {{"id", id}, {"type_id", type_id}}}};
  };
  json template_processing = {
      {"type", "TemplateProcessing"},
      {"single", {piece("SpecialToken", "<s>", 0), piece("Sequence", "A", 0)}},
      {"pair", {piece("SpecialToken", "<s>", 0), piece("Sequence", "A", 0), piece("SpecialToken", "<s>", 1),
                piece("Sequence", "B", 1)}},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {mc.bos_token_id}}, {"tokens", {"<s>"}}}}}}};
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", {special(mc.bos_token_id, "<s>"), special(mc.primary_eos(), "</s>")}},
              {"normalizer", nullptr},
              {"pre_tokenizer", bl},
              {"post_processor", template_processing},
              {"decoder", bl},
              {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                         {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                         {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                         {"vocab", vocab}, {"merges", json::array()}}}};
}

void write_text(const fs::path& p, const std::string& s) { write_file_atomic(p.string(), s); }

// Carried beside the tokenizer (tokenizer_file_names), written by export merged, not as recorded.
constexpr const char* kGenerationConfig = "generation_config.json";

const char* torch_dtype(DType d) { return d == DType::F32 ? "float32" : d == DType::BF16 ? "bfloat16" : "float16"; }

// CheckpointInfo::data_info: null, or {"path", "tokenizer", "vocab_size", "bos_id", "eos_id"}.
// Returns false for null; throws std::runtime_error naming the checkpoint attribute if malformed.
bool parse_data_info(const std::string& ckpt, const std::string& text, DataSpecialIds& ids, std::string& tokenizer) {
  try {
    nlohmann::json j = read_json(text, json_limits::kCheckpointAttr);
    if (j.is_null()) return false;
    const std::string path = j.at("path").get<std::string>();
    tokenizer = j.at("tokenizer").get<std::string>();
    for (const char* k : {"vocab_size", "bos_id", "eos_id"})
      if (!j.at(k).is_number_integer()) throw std::runtime_error(std::string("'") + k + "' is not an integer");
    ids.vocab_size = j["vocab_size"].get<int64_t>();
    // A token file without BOS (GPT-2-style) records bos_id 0xFFFFFFFF (kNoTokenId): none.
    auto id = [&](const char* k) { const int64_t v = j[k].get<int64_t>(); return v == kNoTokenId ? int64_t{-1} : v; };
    ids.bos_id = id("bos_id");
    ids.eos_id = id("eos_id");
    if (ids.vocab_size == 0) return false;  // llm.c / nanoGPT data: no tokenizer, no special ids known
    ids.source = "token file '" + path + "' (which checkpoint '" + ckpt + "' was trained on)";
    return true;
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint '" + ckpt + "': attribute 'data' is malformed (" + e.what() + ")");
  }
}

}  // namespace

namespace hf {
namespace {

// Loaded::generation_config and generation_eos of `l`, whose model config and tokenizer are read.
// Throws std::runtime_error naming the checkpoint for an end-of-turn id outside the model's
// vocabulary or a recorded generation_config.json that check_carried_file refuses.
void set_generation_eos(Loaded& l, const std::string& ckpt) {
  const auto vocab = static_cast<uint32_t>(l.mc.vocab_size);
  std::vector<int> ids = l.mc.eos_token_ids;  // the primary one first
  auto add = [&](int64_t id) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(static_cast<int>(id));
  };
  for (int64_t id : l.tokenizer.end_of_turn_ids) {
    if (id < 0 || id >= l.mc.vocab_size)
      throw std::runtime_error("checkpoint '" + ckpt + "': end-of-turn id " + std::to_string(id) + " (group /tokenizer) "
                               "is outside the model's vocabulary (vocab_size " + std::to_string(vocab) + ")");
    add(id);
  }
  const auto it = l.tokenizer.files.find(kGenerationConfig);
  if (it == l.tokenizer.files.end()) {
    l.generation_eos = ids;
    return;
  }
  check_carried_file(it->first, it->second, vocab, "dataset 'tokenizer/" + it->first + "' of checkpoint '" + ckpt + "'");
  l.generation_config = read_json(it->second, json_limits::kGenerationConfig);
  const nlohmann::json& e = l.generation_config.value("eos_token_id", nlohmann::json(nullptr));
  if (e.is_array())
    for (const nlohmann::json& v : e) add(v.get<int64_t>());
  else if (!e.is_null())
    add(e.get<int64_t>());
  l.generation_eos = ids;
}

}  // namespace

Loaded load_model(Comm& comm, const std::string& ckpt) {
  Loaded l;
  CheckpointInfo info = read_checkpoint_info(comm, ckpt);
  DataSpecialIds data;
  agree(comm, [&] {
    l.mc = from_canonical_json(info.model_config);
    validate(l.mc, "in checkpoint '" + ckpt + "'");
    l.has_data = parse_data_info(ckpt, info.data_info, data, l.data_tokenizer);
  });
  l.tokenizer = info.tokenizer;
  l.be = make_cpu_backend<float>();
  l.f = std::make_unique<Fsdp<float>>(*l.be, comm, ShardPlan::build(llama_units(l.mc), comm.world_size()));
  load_checkpoint(comm, ckpt, sharded_params(*l.f), l.mc, &info);  // compares the config as stored: fill only after
  if (l.has_data) {
    take_special_ids_from_data(comm, l.mc, "the model config of checkpoint '" + ckpt + "'", data);
    // With several eos ids, the token file's (the one its documents end with) is the primary one:
    // the tokenizer's "</s>" and generation's pad id. Stopping uses all of them, in any order.
    auto& e = l.mc.eos_token_ids;
    auto it = std::find(e.begin(), e.end(), static_cast<int>(data.eos_id));
    if (it != e.end()) std::rotate(e.begin(), it, it + 1);
  }
  agree(comm, [&] { set_generation_eos(l, ckpt); });
  return l;
}

}  // namespace hf

namespace {

// Why shardtrain's byte-level tokenizer cannot stand for this model; "" when it can: the
// checkpoint's token file is byte-level (or, unrecorded, the ids are the byte-level tokenizer's
// 256 / 257: an import of another tokenizer's model, e.g. Llama 3's 128000, is not), and "<s>" /
// "</s>" get ids of their own, outside the bytes 0-255.
std::string byte_tokenizer_unfit(const Loaded& l) {
  const ModelConfig& mc = l.mc;
  if (l.has_data && l.data_tokenizer != "byte-level")
    return "the checkpoint's token file uses tokenizer '" + l.data_tokenizer + "', not byte-level";
  if (!mc.has_bos() || mc.eos_token_ids.empty())
    return std::string("the model has no ") + (mc.has_bos() ? "eos_token_id" : "bos_token_id");
  if (!l.has_data && (mc.bos_token_id != ByteTokenizer::kBos || mc.primary_eos() != ByteTokenizer::kEos))
    return "the checkpoint records no token file, and its bos_token_id " + std::to_string(mc.bos_token_id) +
           " / eos_token_id " + std::to_string(mc.primary_eos()) + " are not the byte-level tokenizer's (" +
           std::to_string(ByteTokenizer::kBos) + " / " + std::to_string(ByteTokenizer::kEos) + ")";
  if (mc.bos_token_id < 256 || mc.primary_eos() < 256)
    return "bos_token_id " + std::to_string(mc.bos_token_id) + " / eos_token_id " + std::to_string(mc.primary_eos()) +
           " would share ids with the bytes 0-255 of shardtrain's byte-level tokenizer";
  if (mc.bos_token_id == mc.primary_eos()) return "bos_token_id and eos_token_id are the same id";
  return "";
}

// The files a model's own tokenizer may consist of, as Hugging Face names them, with its chat
// template: export writes them as recorded. Nothing else is imported, stored or exported (a name
// from a file never becomes a path of its own) but generation_config.json (kGenerationConfig),
// which import carries beside them and export writes merged (generation_config_text).
const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                                 "special_tokens_map.json", "chat_template.jinja"};
  return names;
}

// The most bytes import reads of carried file `name`: data.h's limits for the chat template and
// generation_config.json, the tokenizer.json limit for the tokenizer's own files.
uint64_t carried_max_bytes(const std::string& name) {
  if (name == "chat_template.jinja") return kMaxChatTemplateBytes;
  if (name == kGenerationConfig) return json_limits::kGenerationConfig.max_bytes;
  return json_limits::kTokenizer.max_bytes;
}

// True when the recorded tokenizer is a model's own (SentencePiece or Hugging Face tokenizers)
// with the file that defines it.
bool has_own_tokenizer(const TokenizerInfo& t) {
  return (t.kind == "sentencepiece" && t.files.count("tokenizer.model")) ||
         (t.kind == "hf-tokenizers" && t.files.count("tokenizer.json"));
}

// The token string of `id` in tokenizer `t` ("" if it has none): the SentencePiece piece, or the
// tokenizer.json added token / vocabulary entry.
std::string token_string(const TokenizerInfo& t, int64_t id) {
  if (id < 0) return "";
  if (t.kind == "sentencepiece") {
    sentencepiece::SentencePieceProcessor sp;
    if (!sp.LoadFromSerializedProto(t.files.at("tokenizer.model")).ok() || id >= sp.GetPieceSize()) return "";
    return sp.IdToPiece(static_cast<int>(id));
  }
  const nlohmann::json j = read_json_or_discarded(t.files.at("tokenizer.json"), json_limits::kTokenizer);
  if (j.is_discarded()) return "";
  if (j.contains("added_tokens") && j["added_tokens"].is_array())
    for (auto& a : j["added_tokens"])
      if (a.value("id", int64_t{-1}) == id && a.contains("content")) return a["content"].get<std::string>();
  if (j.contains("model") && j["model"].contains("vocab") && j["model"]["vocab"].is_object())
    for (auto& [k, v] : j["model"]["vocab"].items())
      if (v.is_number_integer() && v.get<int64_t>() == id) return k;
  return "";
}

// Writes the model's own tokenizer into export directory `d`: its files as recorded, plus a
// tokenizer_config.json / special_tokens_map.json where the recording has none (a tokenizer.model
// trained by --mode tokenizer): the special tokens of the recorded ids, BOS added as training
// framed documents (https://huggingface.co/docs/transformers/main_classes/tokenizer).
void write_own_tokenizer(const fs::path& d, const TokenizerInfo& t, const ModelConfig& mc) {
  for (auto& [name, bytes] : t.files)
    if (std::find(tokenizer_file_names().begin(), tokenizer_file_names().end(), name) != tokenizer_file_names().end())
      write_file_atomic((d / name).string(), bytes);
  json special = json::object();
  auto add = [&](const char* key, int64_t id) {
    const std::string s = token_string(t, id);
    if (!s.empty()) special[key] = s;
  };
  add("bos_token", t.bos_id);
  add("eos_token", t.eos_id);
  add("unk_token", t.unk_id);
  add("pad_token", t.pad_id);
  if (!t.files.count("tokenizer_config.json")) {
    // No tokenizer_class for SentencePiece: transformers 5 then converts tokenizer.model generically
    // (TokenizersBackend: Metaspace prepend "always", as SentencePiece), which gives
    // SentencePiece's ids for every text. Its LlamaTokenizer adds no dummy prefix before a leading
    // space (and drops it on decode): 430 of 2,000 random texts differ (docs/data-format.md).
    json c = json::object();
    if (t.kind != "sentencepiece") c["tokenizer_class"] = "PreTrainedTokenizerFast";
    for (auto& [k, v] : special.items()) c[k] = v;
    c["add_bos_token"] = t.add_bos && t.bos_id >= 0;
    c["add_eos_token"] = false;  // training's trailing EOS ends a document; a prompt has none
    c["model_max_length"] = mc.max_position_embeddings;
    c["clean_up_tokenization_spaces"] = false;
    write_text(d / "tokenizer_config.json", c.dump(2) + "\n");
  }
  if (!t.files.count("special_tokens_map.json")) write_text(d / "special_tokens_map.json", special.dump(2) + "\n");
}

// The tokenizer files of Hugging Face directory `hd` (tokenizer.model: kind sentencepiece, else
// tokenizer.json: hf-tokenizers; kind "" when it has neither), the special ids from `mc`. Throws
// std::runtime_error naming a file that exists but cannot be read, or a tokenizer.model that
// libsentencepiece cannot load.
TokenizerInfo read_hf_tokenizer(const InputDir& hd, const ModelConfig& mc) {
  const std::string& dir = hd.path();
  TokenizerInfo t = no_tokenizer();
  std::vector<std::string> names = tokenizer_file_names();
  names.push_back(kGenerationConfig);
  for (const std::string& name : names) {
    // Absent: skipped. Present: a regular file inside the directory opened, read through the descriptor checked.
    if (!hd.has(name, "Hugging Face directory '" + dir + "'")) continue;
    t.files[name] = hd.open_inside(name, "Hugging Face directory '" + dir + "' (tokenizer file)")
                        .read_all(carried_max_bytes(name));
  }
  if (t.files.count("tokenizer.model")) {
    sentencepiece::SentencePieceProcessor sp;
    const auto st = sp.LoadFromSerializedProto(t.files["tokenizer.model"]);
    if (!st.ok())
      throw std::runtime_error("'" + (fs::path(dir) / "tokenizer.model").string() +
                               "' is not a SentencePiece model (" + st.ToString() + ")");
    check_sentencepiece_model(t.files["tokenizer.model"], "'" + (fs::path(dir) / "tokenizer.model").string() + "'");
    t.kind = "sentencepiece";
    t.vocab_size = static_cast<uint32_t>(sp.GetPieceSize());
    t.unk_id = sp.unk_id();
  } else if (t.files.count("tokenizer.json")) {
    t.kind = "hf-tokenizers";
    nlohmann::json j;  // std::map objects: N log N for a vocabulary of N tokens
    try {
      j = read_json(t.files["tokenizer.json"], json_limits::kTokenizer);
    } catch (const JsonError& e) {
      throw std::runtime_error("'" + (fs::path(dir) / "tokenizer.json").string() + "': " + e.what());
    }
    if (!j.is_object())
      throw std::runtime_error("'" + (fs::path(dir) / "tokenizer.json").string() + "' is not a JSON object");
    int64_t top = -1;  // largest id of the vocabulary and the added tokens
    if (j.contains("model") && j["model"].is_object() && j["model"].contains("vocab")) {
      const json& v = j["model"]["vocab"];
      if (v.is_object())
        for (auto& [k, id] : v.items()) top = std::max(top, id.is_number_integer() ? id.get<int64_t>() : -1);
      else if (v.is_array())  // Unigram: [[piece, score], ...], ids by position
        top = std::max<int64_t>(top, static_cast<int64_t>(v.size()) - 1);
    }
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (auto& a : j["added_tokens"]) top = std::max(top, a.value("id", int64_t{-1}));
    // Compared before narrowing: an id from the file may be anything up to 2^63 - 1.
    if (top >= static_cast<int64_t>(mc.vocab_size))
      throw std::runtime_error("'" + dir + "': its tokenizer (tokenizer.json) has ids up to " + std::to_string(top) +
                               ", beyond the vocab_size " + std::to_string(mc.vocab_size) + " of config.json");
    t.vocab_size = static_cast<uint32_t>(top + 1);
  } else {
    return no_tokenizer();
  }
  if (t.vocab_size > static_cast<uint32_t>(mc.vocab_size))
    throw std::runtime_error("'" + dir + "': its tokenizer (tokenizer.model) has ids up to " +
                             std::to_string(t.vocab_size - 1) + ", beyond the vocab_size " +
                             std::to_string(mc.vocab_size) + " of config.json");
  // The chat template and generation_config.json travel with the tokenizer (checked only then).
  for (const auto& [name, bytes] : t.files)
    check_carried_file(name, bytes, static_cast<uint32_t>(mc.vocab_size), "'" + (fs::path(dir) / name).string() + "'");
  t.bos_id = mc.has_bos() ? mc.bos_token_id : -1;
  t.eos_id = mc.eos_token_ids.empty() ? -1 : mc.primary_eos();
  t.pad_id = -1;  // generation pads with the eos id (generation_config.json)
  t.add_bos = t.bos_id >= 0;
  return t;
}

// The exported tensors in model order (`order`, with each one's unit in `unit_of`), cut into
// safetensors files of at most o.max_shard_bytes each (a larger tensor alone); `total`: their bytes.
std::vector<std::vector<const ParamSlot*>> export_files(const ShardPlan& plan, const ExportOptions& o,
                                                       std::vector<const ParamSlot*>& order, std::vector<int>& unit_of,
                                                       uint64_t& total) {
  for (size_t u = 0; u < plan.units.size(); ++u)
    for (auto& p : plan.units[u].params) {
      order.push_back(&p);
      unit_of.push_back(static_cast<int>(u));
    }
  std::vector<std::vector<const ParamSlot*>> files(1);
  uint64_t cur = 0;
  for (auto* p : order) {
    uint64_t bytes = static_cast<uint64_t>(p->numel) * dtype_size(o.dtype);
    if (cur > 0 && cur + bytes > o.max_shard_bytes) {
      files.emplace_back();
      cur = 0;
    }
    files.back().push_back(p);
    cur += bytes;
    total += bytes;
  }
  return files;
}

// Rank 0's export directory: created, and cleared of an earlier export's weights. Returns the
// error ("" if none).
std::string prepare_export_dir(const ExportOptions& o) {
  std::string err;
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec || !fs::is_directory(o.out_dir))
    err = "cannot create export directory '" + o.out_dir + "' (option '--out')" + (ec ? ": " + ec.message() : "");
  // Weights of an earlier export in the same directory would be loaded in place of (or next
  // to) this one: remove every model*.safetensors and the index first.
  for (auto& e : fs::directory_iterator(o.out_dir, ec)) {
    std::string fname = e.path().filename().string();
    if (fname == "model.safetensors.index.json" || (fname.rfind("model", 0) == 0 && fname.ends_with(".safetensors")))
      fs::remove(e.path(), ec);
  }
  return err;
}

// The export's generation_config.json. Its eos_token_id is Loaded::generation_eos (the model's eos
// ids, then the end-of-turn ids of its chat data, then those of a carried generation_config.json):
// transformers' generate stops at any of them, and reads them from this file alone when it exists
// (GenerationMixin.adjust_generation_fn; config.json's eos_token_id is its fallback without one).
// One id is written as an integer, several as a list; none as null. Without a carried file: bos and
// eos as config.json has them and pad = the primary eos, as before chat data. With one (import of a
// model directory that has it, or a token file that recorded it): rewritten, not copied, since its
// eos_token_id must grow by the end-of-turn ids and its bos_token_id follow config.json; every other
// key is kept (keys sorted, as transformers' own save_pretrained writes them), its pad_token_id too
// when it names one. Unset ids stay null (transformers then substitutes nothing).
template <class J> J eos_json(const std::vector<int>& e) { return e.empty() ? J(nullptr) : e.size() == 1 ? J(e.front()) : J(e); }
std::string generation_config_text(const Loaded& l, const json& cfg) {
  const int pad = l.mc.eos_token_ids.empty() ? -1 : l.mc.primary_eos();
  if (l.generation_config.is_null())
    return json{{"_from_model_config", true}, {"bos_token_id", cfg["bos_token_id"]},
                {"eos_token_id", eos_json<json>(l.generation_eos)}, {"pad_token_id", pad < 0 ? json(nullptr) : json(pad)}}
               .dump(2) + "\n";
  nlohmann::json g = l.generation_config;  // std::map objects: the carried file comes from outside (json_input.h)
  g["bos_token_id"] = l.mc.has_bos() ? nlohmann::json(l.mc.bos_token_id) : nlohmann::json(nullptr);
  g["eos_token_id"] = eos_json<nlohmann::json>(l.generation_eos);
  if (!g.contains("pad_token_id") || g["pad_token_id"].is_null())
    g["pad_token_id"] = pad < 0 ? nlohmann::json(nullptr) : nlohmann::json(pad);
  return g.dump(2) + "\n";
}

// Rank 0's files of an export besides the weights: the index (several weight files), config.json,
// generation_config.json and the tokenizer (the model's own, or the byte-level one when it fits:
// no_tokenizer empty). Returns the error ("" if none).
std::string write_export_side_files(const Loaded& l, const ExportOptions& o, size_t n, uint64_t total,
                                    const json& weight_map, bool own_tokenizer, const std::string& no_tokenizer) {
  std::string err;
  try {
    fs::path d(o.out_dir);
    if (n > 1) {
      write_text(d / "model.safetensors.index.json",
                 json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n");
    } else {
      fs::remove(d / "model.safetensors.index.json");  // a stale index would shadow model.safetensors
    }
    json cfg = read_json<json>(to_hf_json(l.mc, torch_dtype(o.dtype)), json_limits::kConfig);
    write_text(d / "config.json", cfg.dump(2) + "\n");
    write_text(d / kGenerationConfig, generation_config_text(l, cfg));
    // Files of an earlier export would be loaded with this model's: the tokenizer is rewritten whole.
    for (const std::string& fname : tokenizer_file_names()) fs::remove(d / fname);
    if (own_tokenizer) {
      write_own_tokenizer(d, l.tokenizer, l.mc);
    } else if (no_tokenizer.empty()) {
      write_text(d / "tokenizer.json", tokenizer_json(l.mc).dump(2) + "\n");
      // "<s>" comes from tokenizer.json's post-processor alone, so it is added exactly once:
      // transformers 5 drops add_bos_token / add_eos_token when a tokenizer.json is present
      // (PreTrainedTokenizerBase._from_pretrained), and 4.x's PreTrainedTokenizerFast never reads
      // them. They are written to say the same thing for readers that do (true / false; from them
      // TokenizersBackend.update_post_processor builds the same templates).
      write_text(d / "tokenizer_config.json",
                 json{{"tokenizer_class", "PreTrainedTokenizerFast"}, {"bos_token", "<s>"}, {"eos_token", "</s>"},
                      {"pad_token", "</s>"}, {"model_max_length", l.mc.max_position_embeddings},
                      {"add_bos_token", true}, {"add_eos_token", false}, {"split_special_tokens", true},
                      {"clean_up_tokenization_spaces", false}}
                         .dump(2) + "\n");
      write_text(d / "special_tokens_map.json",
                 json{{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"pad_token", "</s>"}}.dump(2) + "\n");
    }
  } catch (const std::exception& e) {
    err = std::string("export to '") + o.out_dir + "': " + e.what();
  }
  return err;
}

// The safetensors headers of a Hugging Face directory (model.safetensors, or the files its index
// names, each inside the directory opened, `hd`), and where each canonical tensor name lies in them
// (file, entry). Throws std::runtime_error naming the file for a missing, duplicate or unsafe name,
// or a header of more than `max_tensors` tensors.
void read_hf_weight_headers(const InputDir& hd, uint64_t max_tensors, std::vector<StFile>& files,
                            std::map<std::string, std::pair<size_t, size_t>>& where) {
  const std::string& hf_dir = hd.path();
  const std::string what = "Hugging Face directory '" + hf_dir + "'";
  const fs::path d(hf_dir), index = d / "model.safetensors.index.json";
  std::vector<std::string> names;  // inside the directory, each opened once by hd.open_inside
  if (hd.has("model.safetensors.index.json", what)) {
    const std::string text = hd.open_inside("model.safetensors.index.json", what).read_all(json_limits::kIndex.max_bytes);
    nlohmann::json j;  // std::map objects: N log N for N weight_map entries
    try {
      j = read_json(text, json_limits::kIndex);
    } catch (const JsonError& e) {
      throw std::runtime_error("index '" + index.string() + "': " + e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw std::runtime_error("index '" + index.string() + "' has no 'weight_map' object");
    std::set<std::string> uniq;
    for (auto& [k, v] : j["weight_map"].items()) {
      if (!v.is_string())
        throw std::runtime_error("index '" + index.string() + "': 'weight_map' entry '" + k + "' is not a file name");
      uniq.insert(v.get<std::string>());
    }
    for (auto& u : uniq) {
      // A name from the file: it must stay inside the directory (no absolute path, no '..', no
      // link out), or a crafted index would have us read, and echo in messages, any file.
      if (!hd.has(u, "index '" + index.string() + "' (key 'weight_map')"))
        throw std::runtime_error("index '" + index.string() + "' names shard file '" + u + "', which is missing");
      names.push_back(u);
    }
  } else if (hd.has("model.safetensors", what)) {
    names.push_back("model.safetensors");
  } else if (hd.has("pytorch_model.bin", what)) {
    throw std::runtime_error("'" + hf_dir + "' holds pytorch_model.bin only; re-save it with safe_serialization=True");
  } else {
    throw std::runtime_error("'" + hf_dir + "' has no model.safetensors or model.safetensors.index.json");
  }
  // One descriptor per file from its header to its last tensor (StFile::file).
  for (auto& nm : names)
    files.push_back(read_safetensors_header(
        hd.open_inside(nm, nm == "model.safetensors" ? what : "index '" + index.string() + "' (key 'weight_map')"),
        max_tensors));
  for (size_t fi = 0; fi < files.size(); ++fi)
    for (size_t ei = 0; ei < files[fi].entries.size(); ++ei) {
      const std::string& raw = files[fi].entries[ei].name;
      if (raw.ends_with("rotary_emb.inv_freq")) continue;  // a buffer, not a weight
      std::string c = canonical_tensor_name(raw);
      if (!where.emplace(c, std::make_pair(fi, ei)).second)
        throw std::runtime_error("tensor '" + c + "' appears twice (as '" + raw + "')");
    }
}

// "tensor T names expert k, but config.json declares E experts ..." when T is a hub expert tensor
// ("....experts.<k>....") of an index the model does not have; "" otherwise.
std::string expert_beyond_config(const std::string& tensor, const ModelConfig& mc) {
  const size_t at = tensor.find(".experts.");
  if (!mc.is_moe() || at == std::string::npos) return "";
  size_t i = at + 9, k = 0, digits = 0;
  for (; i < tensor.size() && tensor[i] >= '0' && tensor[i] <= '9' && digits < 9; ++i, ++digits)
    k = k * 10 + static_cast<size_t>(tensor[i] - '0');
  if (digits == 0 || k < static_cast<size_t>(mc.num_experts)) return "";
  return "tensor '" + tensor + "' names expert " + std::to_string(k) + ", but config.json declares " +
         std::to_string(mc.num_experts) + " experts per MoE block (num_local_experts or num_experts): the config "
         "and the weight files disagree";
}

// Checks the directory's tensors against the model's (each present with its shape; nothing extra
// but a tied lm_head equal to the embedding) and sets f's parameters from them, adding each one's
// bytes to `digest` (CRC32, model order). Throws std::runtime_error naming the file.
// Mixture-of-experts tensors as the hub stores them (docs/moe.md): shardtrain's canonical names are
// transformers 5's in-memory ones, the experts fused per block; the hub (and transformers'
// save_pretrained) stores one tensor per expert and matrix. The parts of canonical parameter `p`,
// in order, tile its flat data contiguously:
//   mlp.experts.gate_up_proj [E, 2I, C]: per expert e its gate [I, C], then its up [I, C]
//     (Mixtral block_sparse_moe.experts.e.w1 / w3; Qwen3-MoE mlp.experts.e.gate_proj / up_proj);
//   mlp.experts.down_proj [E, C, I]: per expert [C, I] (Mixtral w2; Qwen3-MoE down_proj);
//   mlp.gate.weight [E, C]: Mixtral's block_sparse_moe.gate.weight (Qwen3-MoE: the same name).
// Any other parameter: itself.
struct HubPart {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<HubPart> hub_parts(const ModelConfig& mc, const ParamSpec& p) {
  const std::string& n = p.name;
  const bool mixtral = mc.architecture == "MixtralForCausalLM";
  auto block = [&](const std::string& suffix) -> std::string {  // "model.layers.l." of ...suffix, or ""
    if (n.size() <= suffix.size() || n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0) return "";
    return n.substr(0, n.size() - suffix.size());
  };
  const int64_t E = mc.num_experts, I = mc.moe_intermediate_size, C = mc.hidden_size;
  const std::string moe = mixtral ? "block_sparse_moe." : "mlp.";
  std::vector<HubPart> parts;
  if (const std::string b = block("mlp.experts.gate_up_proj"); mc.is_moe() && !b.empty()) {
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = b + moe + "experts." + std::to_string(e) + ".";
      parts.push_back({x + (mixtral ? "w1" : "gate_proj") + ".weight", {I, C}});
      parts.push_back({x + (mixtral ? "w3" : "up_proj") + ".weight", {I, C}});
    }
  } else if (const std::string d = block("mlp.experts.down_proj"); mc.is_moe() && !d.empty()) {
    for (int64_t e = 0; e < E; ++e)
      parts.push_back({d + moe + "experts." + std::to_string(e) + "." + (mixtral ? "w2" : "down_proj") + ".weight", {C, I}});
  } else if (const std::string g = block("mlp.gate.weight"); mc.is_moe() && mixtral && !g.empty()) {
    parts.push_back({g + "block_sparse_moe.gate.weight", p.shape});
  } else {
    parts.push_back({n, p.shape});
  }
  return parts;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

void set_hf_weights(ShardedState<float>& f, const ModelConfig& mc, const std::string& hf_dir,
                    const std::vector<StFile>& files, const std::map<std::string, std::pair<size_t, size_t>>& where,
                    uint32_t& digest) {
  std::set<std::string> expected;
  // Per parameter: read whole (its own name: transformers 5's fused experts too) or from its hub
  // parts (hub_parts), never from both.
  std::map<std::string, std::vector<HubPart>> from_parts;
  auto check_shape = [&](const std::pair<size_t, size_t>& at, const std::string& name, const std::vector<int64_t>& want) {
    const StEntry& e = files[at.first].entries[at.second];
    if (e.shape != want)
      throw std::runtime_error("'" + files[at.first].path + "': tensor '" + name + "' has shape " + shape_str(e.shape) +
                               ", expected " + shape_str(want) + " from config.json");
  };
  for (auto& u : f.plan().units)
    for (auto& p : u.params) {
      expected.insert(p.spec.name);
      std::vector<HubPart> parts = hub_parts(mc, p.spec);
      const bool split = parts.size() > 1 || parts.front().name != p.spec.name;
      auto it = where.find(p.spec.name);
      if (split) {
        std::string given;
        for (const HubPart& h : parts) {
          expected.insert(h.name);
          if (given.empty() && where.count(h.name)) given = h.name;
        }
        if (it != where.end() && !given.empty())
          throw std::runtime_error("'" + hf_dir + "': tensor '" + p.spec.name + "' is given twice: whole, and in parts ('" +
                                   given + "', ...)");
        if (it == where.end()) {
          for (const HubPart& h : parts) {
            auto at = where.find(h.name);
            if (at == where.end())
              throw std::runtime_error("'" + hf_dir + "': tensor '" + h.name + "' is missing" +
                                       (parts.size() > 1 ? " (one of the " + std::to_string(parts.size()) + " parts of '" +
                                                               p.spec.name + "' " + shape_str(p.spec.shape) + ")"
                                                         : std::string()));
            check_shape(at->second, h.name, h.shape);
          }
          from_parts[p.spec.name] = std::move(parts);
          continue;
        }
      }
      if (it == where.end())
        throw std::runtime_error("'" + hf_dir + "': tensor '" + p.spec.name + "' is missing");
      check_shape(it->second, p.spec.name, p.spec.shape);
    }
  for (auto& [name, loc] : where) {
    if (expected.count(name)) continue;
    if (name == "lm_head.weight" && mc.tie_word_embeddings) {  // tied: must be the embedding itself
      auto emb = where.find("model.embed_tokens.weight");
      if (emb != where.end() &&
          read_safetensors_tensor(files[loc.first], files[loc.first].entries[loc.second]) !=
              read_safetensors_tensor(files[emb->second.first], files[emb->second.first].entries[emb->second.second]))
        throw std::runtime_error("'" + hf_dir + "': config.json says tie_word_embeddings, but tensor 'lm_head.weight' "
                                 "differs from 'model.embed_tokens.weight'");
      continue;
    }
    throw std::runtime_error("'" + files[loc.first].path + "': tensor '" + name +
                             "' has no place in a " + mc.architecture + " of this config" +
                             (name.find(".bias") != std::string::npos ? " (shardtrain's Llama has no biases)" : ""));
  }
  for (auto& u : f.plan().units)
    for (auto& p : u.params) {
      std::vector<float> v;
      if (auto parts = from_parts.find(p.spec.name); parts != from_parts.end()) {
        v.reserve(static_cast<size_t>(p.spec.numel()));
        for (const HubPart& h : parts->second) {  // they tile the parameter in order
          auto loc = where.at(h.name);
          const std::vector<float> x = read_safetensors_tensor(files[loc.first], files[loc.first].entries[loc.second]);
          v.insert(v.end(), x.begin(), x.end());
        }
      } else {
        auto loc = where.at(p.spec.name);
        v = read_safetensors_tensor(files[loc.first], files[loc.first].entries[loc.second]);
      }
      digest = crc32_update(digest, v.data(), v.size() * sizeof(float));
      f.set_param(p.spec.name, v);
    }
}

}  // namespace

void export_hf(Comm& comm, const ExportOptions& o) {
  Loaded l = load_model(comm, o.checkpoint);
  // The model's own tokenizer (SentencePiece, tokenizer.json) when the checkpoint records one; else
  // shardtrain's byte-level tokenizer when it fits the model.
  const bool own_tokenizer = has_own_tokenizer(l.tokenizer);
  const std::string no_tokenizer = own_tokenizer ? "" : byte_tokenizer_unfit(l);
  const ShardPlan& plan = l.f->plan();
  // Tensors in model order; files cut by size from the plan alone (no data needed).
  std::vector<const ParamSlot*> order;
  std::vector<int> unit_of;  // unit index of order[k]
  uint64_t total = 0;
  const std::vector<std::vector<const ParamSlot*>> files = export_files(plan, o, order, unit_of, total);
  const size_t n = files.size();
  auto file_name = [&](size_t i) {
    if (n == 1) return std::string("model.safetensors");
    char b[64];
    std::snprintf(b, sizeof b, "model-%05zu-of-%05zu.safetensors", i + 1, n);
    return std::string(b);
  };
  std::string err = comm.rank() == 0 ? prepare_export_dir(o) : "";
  all_ok(comm, err.empty(), err);
  json weight_map = json::object();
  size_t k = 0;            // index into order / unit_of
  int gathered = -1;       // the unit now in the gather buffer: each unit is all-gathered once
  const float* full = nullptr;
  for (size_t i = 0; i < n; ++i) {
    std::vector<StTensor> ts;
    for (auto* p : files[i]) {
      if (unit_of[k] != gathered) full = l.f->gather(gathered = unit_of[k]);  // collective: every rank
      ++k;
      int64_t at = 0;  // the hub's names: a fused expert tensor as its parts, which tile it in order
      for (const HubPart& h : hub_parts(l.mc, p->spec)) {
        StTensor t;
        t.name = h.name;
        t.shape = h.shape;
        int64_t count = 1;
        for (int64_t d : h.shape) count *= d;
        if (comm.rank() == 0) {  // only rank 0 keeps data
          t.values.resize(static_cast<size_t>(count));
          l.be->to_host(t.values.data(), full + p->offset + at, t.values.size());
        }
        at += count;
        weight_map[h.name] = file_name(i);
        ts.push_back(std::move(t));
      }
    }
    if (comm.rank() == 0) {
      try {
        fs::path dst = fs::path(o.out_dir) / file_name(i), tmp = dst;
        tmp += ".tmp";
        write_safetensors(tmp.string(), ts, o.dtype);
        fs::rename(tmp, dst);
      } catch (const std::exception& e) {
        err = std::string("export to '") + o.out_dir + "': " + e.what();
      }
    }
    all_ok(comm, err.empty(), err);
  }
  if (comm.rank() == 0) err = write_export_side_files(l, o, n, total, weight_map, own_tokenizer, no_tokenizer);
  all_ok(comm, err.empty(), err);
  // An id the recorded tokenizer has none of (ChatML's BOS) is no gap to note.
  const bool told = !l.tokenizer.kind.empty();
  const bool no_bos = !l.mc.has_bos() && !(told && l.tokenizer.bos_id < 0);
  const bool no_eos = l.mc.eos_token_ids.empty() && !(told && l.tokenizer.eos_id < 0);
  if (no_bos || no_eos) {
    const bool both = no_bos && no_eos;
    log_info(comm, "note: checkpoint '" + o.checkpoint + "' has no " +
                       (both ? "bos_token_id or eos_token_id" : no_bos ? "bos_token_id" : "eos_token_id") +
                       " and records no token file to take " + (both ? "them" : "it") +
                       " from: config.json and generation_config.json say null (import with '--data TOKENFILE' to "
                       "take the ids from a token file)");
  }
  if (own_tokenizer)
    log_info(comm, "export: tokenizer: " + l.tokenizer.kind + " (" + std::to_string(l.tokenizer.files.size()) +
                       " file(s) as recorded in the checkpoint)");
  if (l.generation_eos.size() > l.mc.eos_token_ids.size() || !l.generation_config.is_null()) {
    std::string ids;
    for (int id : l.generation_eos) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    log_info(comm, "export: generation_config.json: eos_token_id [" + ids + "]: the model's eos_token_id" +
                       (l.tokenizer.end_of_turn_ids.empty() ? "" : ", the end-of-turn ids of its chat data") +
                       (l.generation_config.is_null() ? ""
                                                      : ", those of the generation_config.json it carries (its other "
                                                        "keys kept)"));
  }
  if (!no_tokenizer.empty())
    log_info(comm, "note: no tokenizer written to '" + o.out_dir + "': " + no_tokenizer +
                       "; this model needs its own tokenizer (tokenizer.json and tokenizer_config.json of its origin)");
  log_info(comm, "export: wrote '" + o.out_dir + "' (" + std::to_string(weight_map.size()) + " tensors in " +
                     std::to_string(n) + " safetensors file(s), " + dtype_name(o.dtype) + ", " +
                     std::to_string(total) + " bytes) from '" + o.checkpoint + "' at world size " +
                     std::to_string(comm.world_size()));
}

void import_hf(Comm& comm, const std::string& hf_dir, const std::string& out_path, const std::string& train_config,
               const std::string& data_path) {
  {
    std::string err;
    std::error_code ec;
    if (comm.rank() == 0 && fs::exists(out_path, ec))
      err = "option '--out': '" + out_path + "' exists; import never overwrites a checkpoint";
    all_ok(comm, err.empty(), err);
  }
  // The directory, opened once on every rank: every file below is opened relative to it, so a
  // --hf-dir that is a link pointed elsewhere meanwhile cannot mix two directories' files.
  std::optional<InputDir> hd;
  agree(comm, [&] { hd.emplace(InputDir::open(hf_dir, "option '--hf-dir'")); });
  // Config: rank 0 alone resolves it, as for training. Every file read lies inside the directory.
  const std::string config_path = (fs::path(hf_dir) / "config.json").string();
  ModelConfig mc = resolve_model_config(comm, "config.json", &*hd);
  std::string data_info = "null";  // the checkpoint's record of the token file, as training writes it
  if (!data_path.empty()) {  // as training does: every rank reads the token file's header itself
    TokenFileHeader h;
    agree(comm, [&] { h = read_token_file_header(data_path); });
    data_info = nlohmann::json{{"path", data_path}, {"tokenizer", h.tokenizer}, {"vocab_size", h.vocab_size},
                     {"bos_id", h.bos_id}, {"eos_id", h.eos_id}}.dump();
    take_special_ids_from_data(comm, mc, "model config '" + config_path + "'",
                               DataSpecialIds{"token file '" + data_path + "'", h.vocab_size, h.bos_id, h.eos_id});
  }
  // The model's own tokenizer files travel into the checkpoint (group /tokenizer), so that data
  // prepared with them can be checked against it and export gives them back.
  TokenizerInfo tokenizer = no_tokenizer();
  agree(comm, [&] { tokenizer = read_hf_tokenizer(*hd, mc); });
  {
    uint32_t c = 0;
    for (auto& [name, bytes] : tokenizer.files) c = crc32_update(crc32_update(c, name.data(), name.size()), bytes.data(), bytes.size());
    const std::vector<int> odd = ranks_differing_from_root(comm, c);
    if (!odd.empty())
      throw CollectiveError(odd.front(), "Hugging Face directory '" + hf_dir + "' (option '--hf-dir') holds other "
                                         "tokenizer files on " + rank_list(odd) + " than on rank 0");
  }
  // Weight files and headers: every rank reads them (local I/O, agreed).
  std::vector<StFile> files;
  std::map<std::string, std::pair<size_t, size_t>> where;  // canonical name -> (file, entry)
  // No file of a model holds more tensors than the model has, with a tied lm_head and a
  // rotary_emb.inv_freq buffer per layer: a header's table is refused past that, before it is stored.
  uint64_t max_tensors = 1 + static_cast<uint64_t>(mc.num_hidden_layers);
  for (const UnitSpec& u : llama_units(mc)) max_tensors += u.params.size();
  // The hub's parts, per expert (3 per MoE block), for up to 1024 experts however few config.json
  // declares: files holding more experts than it says get through the header, to be named below.
  max_tensors += static_cast<uint64_t>(mc.num_moe_layers()) * 3 * std::max<uint64_t>(mc.num_experts, 1024);
  agree(comm, [&] {
    read_hf_weight_headers(*hd, max_tensors, files, where);
    for (const StFile& sf : files)  // more experts in the files than config.json declares
      for (const StEntry& e : sf.entries)
        if (const std::string why = expert_beyond_config(e.name, mc); !why.empty())
          throw std::runtime_error("Hugging Face directory '" + hf_dir + "' (option '--hf-dir'): " + why);
  });
  auto be = make_cpu_backend<float>();
  ShardedState<float> f(*be, comm, ShardPlan::build(llama_units(mc), comm.world_size()));
  uint32_t digest = 0;  // CRC32 of every weight this rank read, in model order
  agree(comm, [&] { set_hf_weights(f, mc, hf_dir, files, where, digest); });
  {  // Every rank read the weights itself: other files under the same path on other nodes would
     // give a checkpoint whose shards come from different models.
    const std::vector<int> odd = ranks_differing_from_root(comm, digest);
    if (!odd.empty())
      throw CollectiveError(odd.front(), "Hugging Face directory '" + hf_dir + "' (option '--hf-dir') holds other weights on " +
                                             rank_list(odd) + " than on rank 0 (a copy on a node's local disk, or a "
                                             "relative path under different working directories?): every rank must read "
                                             "the same files");
  }
  const std::string tmp = out_path + ".tmp";
  TrainState st;  // step 0: no batch history
  st.seed = read_json(train_config, json_limits::kCheckpointAttr).at("seed").get<uint64_t>();  // rng_state's seed must be train_config's
  st.data_info = data_info;
  st.tokenizer = tokenizer;
  st.saved_world_size = comm.world_size();
  CheckpointSnapshot snap = take_checkpoint_snapshot(sharded_params(f), mc, train_config, st, true, /*borrow=*/true);
  for (const std::string& name : checkpoint_tensor_names()) {  // the optimizer state of a fresh start: zeros
    if (name == "params") continue;
    CheckpointSnapshot::Tensor zero{name, {}, {}};
    for (const UnitPlan& up : snap.plan.units) zero.shards.emplace_back(static_cast<size_t>(up.shard_size), 0.0f);
    snap.tensors.push_back(std::move(zero));
  }
  write_checkpoint_file(comm, tmp, snap);
  std::string err;
  if (comm.rank() == 0) {
    std::error_code ec;
    fs::rename(tmp, out_path, ec);
    if (ec) err = "cannot rename '" + tmp + "' to '" + out_path + "' (option '--out'): " + ec.message();
  }
  all_ok(comm, err.empty(), err);
  log_info(comm, "import: wrote '" + out_path + "' (step 0, " + std::to_string(mc.num_params()) + " parameters) from '" +
                     hf_dir + "'; tokenizer: " +
                     (tokenizer.kind.empty() ? std::string("none found (no tokenizer.model or tokenizer.json)")
                                             : tokenizer.kind + " (" + std::to_string(tokenizer.files.size()) + " file(s))"));
}

}  // namespace shardtrain
