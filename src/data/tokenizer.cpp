// Tokenizers (byte-level, SentencePiece), input expansion, SentencePiece training.
#include "shardtrain/data/tokenizer.h"

#include <glob.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "shardtrain/runtime/files.h"
#include "shardtrain/runtime/json_input.h"
#include "text_inputs.h"

// libsentencepiece's log threshold (0 INFO, 1 WARNING, 2 ERROR); exported by the library but
// declared only in its internal common.h.
namespace sentencepiece::logging {
void SetMinLogLevel(int v);
}
// The builtin normalization tables ("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"; "identity":
// empty) as libsentencepiece_train compiled them in (normalizer::Builder, builder.h, which the
// Debian package does not install; the symbol is exported).
namespace sentencepiece::normalizer {
class Builder {
 public:
  static util::Status GetPrecompiledCharsMap(std::string_view name, std::string* output);
};
}  // namespace sentencepiece::normalizer

namespace shardtrain {
namespace fs = std::filesystem;

namespace detail {
bool is_jsonl(const std::string& path) {  // by extension, in any case (".jsonl", ".JSONL")
  if (path.size() < 6) return false;
  std::string ext = path.substr(path.size() - 6);
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext == ".jsonl";
}

bool is_blank_line(const std::string& line) { return line.find_first_not_of(" \t\r") == std::string::npos; }

bool read_jsonl_line(std::istream& in, std::string& line, const std::string& path, uint64_t lineno) {
  line.clear();
  std::streambuf* sb = in.rdbuf();
  const uint64_t max = json_limits::kJsonlLine.max_bytes;
  for (;;) {
    const int c = sb->sbumpc();
    if (c == std::char_traits<char>::eof()) {
      in.setstate(std::ios::eofbit);
      return !line.empty();
    }
    if (c == '\n') return true;
    if (line.size() == max)
      throw std::runtime_error(path + ":" + std::to_string(lineno) + ": a line longer than " + std::to_string(max) +
                               " bytes (the limit for " + json_limits::kJsonlLine.kind + "; option '--input')");
    line.push_back(static_cast<char>(c));
  }
}

std::string jsonl_text(const std::string& line, const std::string& field, const std::string& path, uint64_t lineno) {
  const std::string where = path + ":" + std::to_string(lineno) + ": ";
  nlohmann::json j;
  try {
    j = read_json(line, json_limits::kJsonlLine);
  } catch (const JsonError& e) {
    throw std::runtime_error(where + "invalid JSON (option '--input', a .jsonl file holds one JSON object a line): " +
                             e.what());
  }
  if (!j.is_object()) throw std::runtime_error(where + "not a JSON object (option '--input')");
  auto it = j.find(field);
  // Chat data needs the model's chat template, which --mode prepare does not render (issue 55).
  if (it == j.end() && (j.contains("messages") || (j.contains("prompt") && j.contains("completion"))))
    throw std::runtime_error(where + "a " + std::string(j.contains("messages") ? "chat" : "prompt/completion") +
                             " record: --mode prepare writes plain text only; chat data is rendered by the model's chat "
                             "template with scripts/tokenize_hf.py (docs/data-format.md, \"Chat and prompt/completion data\")");
  if (it == j.end())
    throw std::runtime_error(where + "no field '" + field + "' (option '--text-field' names the field holding the text)");
  if (!it->is_string())
    throw std::runtime_error(where + "field '" + field + "' is not a string (option '--text-field')");
  return it->get<std::string>();
}
}  // namespace detail

namespace {

// A tokenizer file named by the user: a regular file (InputFile: never a FIFO's endless wait).
std::string read_file(const std::string& path, const std::string& what) { return InputFile::open(path, what).read_all(); }

class ByteLevelTokenizer final : public Tokenizer {
 public:
  ByteLevelTokenizer() {
    info_.kind = "byte-level";
    info_.vocab_size = ByteTokenizer::kVocab;
    info_.bos_id = ByteTokenizer::kBos;
    info_.eos_id = ByteTokenizer::kEos;
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override { return ByteTokenizer::decode(ids); }
  bool cuttable() const override { return true; }
  bool is_cut(std::string_view text, size_t i) const override { return i > 0 && i < text.size(); }
  std::vector<int32_t> encode_continuation(std::string_view piece) const override { return encode(piece); }
};

// Minimal protobuf reading of a serialized sentencepiece ModelProto: the NormalizerSpec fields
// that decide whether a text may be encoded in pieces (sentencepiece_model.proto: ModelProto
// field 3 = normalizer_spec; NormalizerSpec 2 = precompiled_charsmap, 5 = escape_whitespaces).
struct NormalizerFacts {
  std::string name;
  size_t charsmap_bytes = 0;
  bool escape_whitespaces = true;  // proto default
};
bool read_varint(std::string_view b, size_t& p, uint64_t& v) {
  v = 0;
  for (int s = 0; s < 64 && p < b.size(); s += 7) {
    const auto c = static_cast<unsigned char>(b[p++]);
    v |= static_cast<uint64_t>(c & 0x7f) << s;
    if (!(c & 0x80)) return true;
  }
  return false;
}
// Calls f(field, wire_type, varint value, bytes) for each field of message `b`; false if malformed.
template <typename F> bool for_each_field(std::string_view b, F&& f) {
  size_t p = 0;
  while (p < b.size()) {
    uint64_t key = 0, v = 0;
    if (!read_varint(b, p, key)) return false;
    const int wt = static_cast<int>(key & 7);
    std::string_view bytes;
    if (wt == 0) {
      if (!read_varint(b, p, v)) return false;
    } else if (wt == 1 || wt == 5) {
      const size_t n = wt == 1 ? 8 : 4;
      if (b.size() - p < n) return false;
      p += n;
    } else if (wt == 2) {
      if (!read_varint(b, p, v) || v > b.size() - p) return false;
      bytes = b.substr(p, v);
      p += v;
    } else {
      return false;
    }
    f(key >> 3, wt, v, bytes);
  }
  return true;
}
// The NormalizerSpec (ModelProto field 3) or the denormalizer's (field 5) of a serialized model.
// Protobuf merges repeated occurrences of a message field, the last value of a field winning, which
// visiting every occurrence in order reproduces. Returns false if the bytes are not a protobuf.
bool normalizer_facts(std::string_view model, uint64_t which, NormalizerFacts& n, std::string_view* charsmap) {
  bool ok = true;
  const bool outer = for_each_field(model, [&](uint64_t field, int wt, uint64_t, std::string_view bytes) {
    if (field != which || wt != 2) return;
    ok = ok && for_each_field(bytes, [&](uint64_t f2, int wt2, uint64_t v2, std::string_view b2) {
      if (f2 == 1 && wt2 == 2) n.name = std::string(b2);
      if (f2 == 2 && wt2 == 2) n.charsmap_bytes = b2.size(), *charsmap = b2;
      if (f2 == 5 && wt2 == 0) n.escape_whitespaces = v2 != 0;
    });
  });
  return outer && ok;
}
NormalizerFacts normalizer_facts(std::string_view model) {
  NormalizerFacts n;
  std::string_view cm;
  normalizer_facts(model, 3, n, &cm);
  return n;
}

uint32_t le_u32(std::string_view b, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(b[at + i])) << (8 * i);
  return v;
}

// Why libsentencepiece's Normalizer would read outside `blob` (its precompiled_charsmap), "" when
// it cannot. The blob (normalizer.cc, DecodePrecompiledCharsMap): a u32 little-endian trie size T,
// T bytes of a darts-clone double-array trie (4-byte units), then the normalized strings, each
// NUL-terminated. The Normalizer looks up every prefix of the input, any byte 0-255 after any node
// it reached (Darts::DoubleArray::commonPrefixSearch, no bounds checks), and reads the C string at a
// leaf's value. So every node reachable from the root must have its 256 child slots inside the
// array, and every leaf value must start a NUL-terminated string inside the normalized strings.
std::string charsmap_problem(std::string_view blob) {
  if (blob.size() <= 4) return "holds " + std::to_string(blob.size()) + " bytes, fewer than its 4-byte trie size and a trie";
  const uint64_t trie_bytes = le_u32(blob, 0);
  if (trie_bytes > blob.size() - 4)  // the library checks only trie_bytes < blob.size()
    return "says its trie holds " + std::to_string(trie_bytes) + " bytes, beyond the " +
           std::to_string(blob.size() - 4) + " bytes after its 4-byte size";
  const std::string_view trie = blob.substr(4, trie_bytes);
  const std::string_view normalized = blob.substr(4 + trie.size());
  const uint64_t n = trie.size() / 4;  // units, as the library counts them
  auto unit = [&](uint64_t i) { return le_u32(trie, 4 * i); };
  auto offset = [](uint32_t u) { return static_cast<uint64_t>(u >> 10) << ((u & (1u << 9)) >> 6); };
  auto label = [](uint32_t u) { return u & ((1u << 31) | 0xffu); };
  if (n == 0) return "has an empty trie";
  std::vector<bool> seen(n, false);
  std::vector<uint64_t> stack = {0};
  seen[0] = true;
  while (!stack.empty()) {
    const uint64_t pos = stack.back();
    stack.pop_back();
    const uint32_t u = unit(pos);
    const uint64_t base = pos ^ offset(u);
    if ((base | 0xff) >= n)
      return "has a trie node (unit " + std::to_string(pos) + ") whose children lie beyond its " + std::to_string(n) +
             " units";
    if ((u >> 8) & 1) {  // has_leaf: the value is in the unit at `base`
      const uint64_t v = unit(base) & 0x7fffffffu;
      if (v >= normalized.size() || normalized.find('\0', v) == std::string_view::npos)
        return "has a trie value (unit " + std::to_string(base) + ") at offset " + std::to_string(v) +
               ", not the start of a NUL-terminated string inside its " + std::to_string(normalized.size()) +
               " bytes of normalized strings";
    }
    for (uint32_t c = 1; c < 256; ++c) {
      const uint64_t child = base ^ c;
      if (!seen[child] && label(unit(child)) == c) {
        seen[child] = true;
        stack.push_back(child);
      }
    }
  }
  return "";
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& spec, const std::string& model_path, std::string model_bytes) {
    auto st = sp_.LoadFromSerializedProto(model_bytes);
    if (!st.ok())
      throw std::runtime_error("cannot load tokenizer '" + spec + "': '" + model_path +
                               "' is not a SentencePiece model (" + st.ToString() + ")");
    check_sentencepiece_model(model_bytes, "cannot load tokenizer '" + spec + "': '" + model_path + "'");
    info_.kind = "sentencepiece";
    info_.vocab_size = static_cast<uint32_t>(sp_.GetPieceSize());
    info_.bos_id = sp_.bos_id();
    info_.eos_id = sp_.eos_id();
    info_.pad_id = sp_.pad_id();
    info_.unk_id = sp_.unk_id();
    info_.add_bos = info_.bos_id >= 0;
    info_.add_eos = true;
    if (info_.eos_id < 0)
      throw std::runtime_error("tokenizer '" + spec + "': the SentencePiece model has no EOS piece (eos_id -1); "
                               "prepare ends every document with EOS, the separator training sees");
    // Cutting a text before "x| y" is exact when no piece can span the cut, i.e. no piece holds a
    // non-space character followed by the space mark U+2581 (true of every model trained with
    // split_by_whitespace and without treat_whitespace_as_suffix, Llama's included), and the
    // normalizer maps text character by character (identity: no precompiled charsmap, which
    // could match across the cut) with spaces escaped to U+2581.
    const NormalizerFacts nf = normalizer_facts(model_bytes);
    bool ok = nf.charsmap_bytes == 0 && nf.escape_whitespaces;
    static const std::string kMark = "\xe2\x96\x81";
    for (int id = 0; ok && id < sp_.GetPieceSize(); ++id) {
      if (sp_.IsControl(id) || sp_.IsUnknown(id) || sp_.IsByte(id)) continue;
      const std::string& p = sp_.IdToPiece(id);
      for (size_t at = p.find(kMark, 1); ok && at != std::string::npos; at = p.find(kMark, at + 1))
        if (at < 3 || p.compare(at - 3, 3, kMark) != 0) ok = false;
    }
    if (ok) {  // the sentinel word whose ids a continuation drops (see encode_continuation)
      sentinel_ids_ = encode(kSentinel);
      ok = !sentinel_ids_.empty();
    }
    cuttable_ = ok;
    info_.files["tokenizer.model"] = std::move(model_bytes);
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    auto st = sp_.Encode(text, &ids);
    if (!st.ok()) throw std::runtime_error("SentencePiece encode failed: " + st.ToString());
    return std::vector<int32_t>(ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> v;
    v.reserve(ids.size());
    for (int32_t id : ids)
      if (id >= 0 && static_cast<uint32_t>(id) < info_.vocab_size) v.push_back(id);
    std::string s;
    auto st = sp_.Decode(v, &s);
    if (!st.ok()) throw std::runtime_error("SentencePiece decode failed: " + st.ToString());
    return s;
  }
  void add_file(const std::string& name, std::string bytes) { info_.files[name] = std::move(bytes); }
  // Takes the special ids, framing and files as recorded (a checkpoint may carry the original
  // tokenizer_config.json etc.); the model itself stays the one loaded.
  void set_recorded(const TokenizerInfo& t) {
    const std::string model = std::move(info_.files["tokenizer.model"]);
    info_ = t;
    info_.files["tokenizer.model"] = model;
  }
  bool cuttable() const override { return cuttable_; }
  bool is_cut(std::string_view t, size_t i) const override {
    return cuttable_ && i > 0 && i + 1 < t.size() && t[i] == ' ' && t[i - 1] != ' ' && t[i + 1] != ' ';
  }
  // "word" + piece is encoded as the word's ids (the same as encoding "word" alone, since no piece
  // spans the cut between them) followed by exactly the ids `piece` has inside a longer text: the
  // dummy prefix went to the sentinel. The prefix is checked on every call.
  std::vector<int32_t> encode_continuation(std::string_view piece) const override {
    if (!cuttable_ || piece.size() < 2 || piece[0] != ' ' || piece[1] == ' ')
      throw std::logic_error("SentencePiece: encode_continuation of a piece that does not start at a cut");
    std::string s(kSentinel);
    s.append(piece);
    std::vector<int32_t> ids = encode(s);
    if (ids.size() < sentinel_ids_.size() || !std::equal(sentinel_ids_.begin(), sentinel_ids_.end(), ids.begin()))
      throw std::logic_error("SentencePiece: the sentinel's ids changed inside a longer text");
    ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(sentinel_ids_.size()));
    return ids;
  }

 private:
  static constexpr std::string_view kSentinel = "a";
  sentencepiece::SentencePieceProcessor sp_;
  bool cuttable_ = false;
  std::vector<int32_t> sentinel_ids_;
};

void add_sorted_dir(const fs::path& dir, std::vector<std::string>& out) {
  std::vector<std::string> files;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    // Everything but a directory: a FIFO, socket or device found here is refused by expand_inputs.
    if (!it->is_directory(ec)) files.push_back(it->path().string());
  }
  if (ec) throw std::runtime_error("cannot list input directory '" + dir.string() + "' (option '--input'): " + ec.message());
  std::sort(files.begin(), files.end());
  out.insert(out.end(), files.begin(), files.end());
}

// One training sentence a line of every input (see train_sentencepiece).
class LineIterator final : public sentencepiece::SentenceIterator {
 public:
  LineIterator(std::vector<std::string> files, std::string field) : files_(std::move(files)), field_(std::move(field)) {
    Next();
  }
  bool done() const override { return done_; }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override {
    return error_.empty() ? sentencepiece::util::Status()
                          : sentencepiece::util::Status(sentencepiece::util::StatusCode::kInternal, error_);
  }
  void Next() override {
    try {
      next();
    } catch (const std::exception& e) {
      error_ = e.what();
      done_ = true;
    }
  }
  const std::string& error() const { return error_; }
  uint64_t sentences = 0, bytes = 0;

 private:
  void next() {
    for (;;) {
      if (!pending_.empty()) {  // lines of the current JSONL document
        size_t nl = pending_.find('\n', pend_at_);
        value_ = pending_.substr(pend_at_, nl == std::string::npos ? std::string::npos : nl - pend_at_);
        pend_at_ = nl == std::string::npos ? pending_.size() : nl + 1;
        if (pend_at_ >= pending_.size()) pending_.clear(), pend_at_ = 0;
        if (!value_.empty()) return ++sentences, void();
        continue;
      }
      if (in_.is_open() && (jsonl_ ? detail::read_jsonl_line(in_, line_, files_[file_ - 1], lineno_ + 1)
                                   : static_cast<bool>(std::getline(in_, line_)))) {
        ++lineno_;
        if (jsonl_) {
          if (detail::is_blank_line(line_)) continue;
          pending_ = detail::jsonl_text(line_, field_, files_[file_ - 1], lineno_);
          pend_at_ = 0;
          continue;
        }
        if (!line_.empty() && line_.back() == '\r') line_.pop_back();
        if (line_.empty()) continue;
        value_ = line_;
        ++sentences;
        return;
      }
      if (in_.is_open() && in_.bad()) throw std::runtime_error("error reading input '" + files_[file_ - 1] + "' (option '--input')");
      in_.close();
      if (file_ == files_.size()) return done_ = true, void();
      const std::string& p = files_[file_++];
      // Checked on the descriptor (a regular file, opened without blocking), then read through it.
      cur_ = detail::open_input_text(p);
      in_.open(cur_->reopen_path(), std::ios::binary);
      if (!in_) throw std::runtime_error("cannot read input text '" + p + "' (option '--input')");
      const uint64_t size = cur_->size();
      if (size == 0) throw std::runtime_error("input text '" + p + "' is empty (option '--input')");
      bytes += size;
      jsonl_ = detail::is_jsonl(p);
      lineno_ = 0;
    }
  }
  std::vector<std::string> files_;
  std::string field_;
  size_t file_ = 0;
  std::optional<InputFile> cur_;  // the file being read (in_ reads it through its descriptor)
  std::ifstream in_;
  bool jsonl_ = false, done_ = false;
  uint64_t lineno_ = 0;
  std::string line_, value_, pending_, error_;
  size_t pend_at_ = 0;
};

}  // namespace

std::vector<std::string> expand_inputs(const std::vector<std::string>& specs, const std::string& option) {
  std::vector<std::string> out;
  for (const std::string& s : specs) {
    std::error_code ec;
    if (fs::is_directory(s, ec)) {
      const size_t before = out.size();
      add_sorted_dir(s, out);
      if (out.size() == before) throw std::runtime_error("input directory '" + s + "' (option '" + option + "') holds no file");
    } else if (fs::exists(s, ec) || s.find_first_of("*?[") == std::string::npos) {
      out.push_back(s);  // a file; a missing one is named when it is opened
    } else {
      glob_t g{};
      const int rc = glob(s.c_str(), 0, nullptr, &g);
      std::vector<std::string> m(g.gl_pathv, g.gl_pathv + (rc == 0 ? g.gl_pathc : 0));
      globfree(&g);
      if (m.empty()) throw std::runtime_error("cannot read input text '" + s + "' (option '" + option + "'): the pattern matches no file");
      for (const std::string& p : m) {
        if (fs::is_directory(p, ec)) add_sorted_dir(p, out);
        else out.push_back(p);
      }
    }
  }
  // Every input that exists must be a regular file, checked without blocking: a FIFO would
  // otherwise hang the reader in open(2) (a missing file is named when it is opened).
  for (const std::string& p : out)
    if (path_exists(p)) {
      try {
        (void)InputFile::open(p, "input text");
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string(e.what()) + " (option '" + option + "')");
      }
    }
  return out;
}

namespace detail {
InputFile open_input_text(const std::string& path) {
  if (!path_exists(path)) throw std::runtime_error("cannot read input text '" + path + "' (option '--input'): no such file");
  try {
    return InputFile::open(path, "input text");
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(e.what()) + " (option '--input')");
  }
}
}  // namespace detail

void check_sentencepiece_model(std::string_view model, const std::string& where) {
  for (const auto& [field, spec] : {std::pair<uint64_t, const char*>{3, "normalizer_spec"}, {5, "denormalizer_spec"}}) {
    NormalizerFacts nf;
    std::string_view charsmap;
    if (!normalizer_facts(model, field, nf, &charsmap))
      throw std::runtime_error(where + ": not a well-formed SentencePiece model (protobuf)");
    if (charsmap.empty()) continue;  // no table: the identity (Llama's tokenizer.model)
    std::string builtin;
    if (!nf.name.empty() && sentencepiece::normalizer::Builder::GetPrecompiledCharsMap(nf.name, &builtin).ok() &&
        builtin == charsmap)
      continue;  // the library's own table for this name (nmt_nfkc: T5's, mT5's)
    const std::string why = charsmap_problem(charsmap);
    if (!why.empty())
      throw std::runtime_error(where + ": field '" + spec + ".precompiled_charsmap' (normalizer '" + nf.name + "', " +
                               std::to_string(charsmap.size()) + " bytes) " + why +
                               "; libsentencepiece would read outside it: the file is damaged or crafted");
  }
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "byte-level") return std::make_unique<ByteLevelTokenizer>();
  std::error_code ec;
  if (!fs::exists(spec, ec))
    throw std::runtime_error("cannot load tokenizer '" + spec +
                             "': no such file or directory (give 'byte-level', a SentencePiece .model file, or a "
                             "directory holding tokenizer.model)");
  if (fs::is_directory(spec, ec)) {
    // A directory's files (often a downloaded model's) are read as import reads them: each a
    // regular file, opened inside the directory, opened once (files.h InputDir).
    const fs::path model = fs::path(spec) / "tokenizer.model";
    const std::string what = "tokenizer directory '" + spec + "'";
    const InputDir dir = InputDir::open(spec, what);
    if (!dir.has("tokenizer.model", what))
      throw std::runtime_error("cannot load tokenizer '" + spec + "': the directory holds no tokenizer.model "
                               "(a SentencePiece model; tokenizer.json alone is not supported)");
    auto t = std::make_unique<SentencePieceTokenizer>(spec, model.string(),
                                                      dir.open_inside("tokenizer.model", what).read_all());
    // Beside the model, as import carries them: its JSON files, the chat template and
    // generation_config.json (the last two checked as data.h's check_carried_file says).
    for (const std::string extra : {"tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                                    "generation_config.json"}) {
      if (!dir.has(extra, what)) continue;
      const uint64_t max = extra == "chat_template.jinja"      ? kMaxChatTemplateBytes
                           : extra == "generation_config.json" ? json_limits::kGenerationConfig.max_bytes
                                                               : json_limits::kTokenizer.max_bytes;
      std::string bytes = dir.open_inside(extra, what).read_all(max);
      check_carried_file(extra, bytes, t->info().vocab_size, "'" + (fs::path(spec) / extra).string() + "'");
      t->add_file(extra, std::move(bytes));
    }
    return t;
  }
  return std::make_unique<SentencePieceTokenizer>(spec, spec, read_file(spec, "tokenizer"));
}

std::unique_ptr<Tokenizer> tokenizer_from_info(const TokenizerInfo& info, const std::string& source) {
  if (info.kind == "byte-level") return std::make_unique<ByteLevelTokenizer>();
  if (info.kind != "sentencepiece") return nullptr;
  auto it = info.files.find("tokenizer.model");
  if (it == info.files.end())
    throw std::runtime_error(source + ": its SentencePiece tokenizer has no tokenizer.model");
  auto t = std::make_unique<SentencePieceTokenizer>(source, source + " (tokenizer.model)", it->second);
  t->set_recorded(info);
  return t;
}

TokenizerTrainResult train_sentencepiece(const TokenizerTrainOptions& o) {
  // 256 byte pieces + <unk>, <s>, </s>, and at least one more piece.
  if (o.vocab_size < 260)
    throw std::runtime_error("option '--vocab-size' must be at least 260 (256 byte-fallback pieces, <unk>, <s>, </s>, "
                             "and the corpus' characters), got " + std::to_string(o.vocab_size));
  if (o.out.empty()) throw std::runtime_error("option '--out' is required with --mode tokenizer (the .model file to write)");
  std::error_code ec;
  check_output_path(o.out, "option '--out'");
  std::vector<std::string> files = expand_inputs(o.inputs);
  if (files.empty()) throw std::runtime_error("option '--input' names no file");
  for (const auto& in : files)
    if (fs::equivalent(in, o.out, ec))
      throw std::runtime_error("option '--out': '" + o.out + "' is also an input; refusing to overwrite it");

  const auto t0 = std::chrono::steady_clock::now();
  std::ostringstream cov;
  cov << o.character_coverage;
  // Llama 2's trainer_spec / normalizer_spec (printed from its tokenizer.model), except the input
  // sampling size and threads.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"character_coverage", cov.str()},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "true"},
      {"split_digits", "true"},
      {"split_by_unicode_script", "true"},
      {"split_by_whitespace", "true"},
      {"split_by_number", "true"},
      {"treat_whitespace_as_suffix", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"max_sentencepiece_length", "16"},
      {"max_sentence_length", "4192"},
      {"input_sentence_size", std::to_string(o.max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"hard_vocab_limit", "true"},
      {"vocabulary_output_piece_score", "true"},
      {"num_threads", "2"},
  };
  LineIterator lines(files, o.text_field);
  std::string model;
  sentencepiece::logging::SetMinLogLevel(1);  // INFO lines (one per training step) off
  const auto st = sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
  sentencepiece::logging::SetMinLogLevel(0);
  if (!lines.error().empty()) throw std::runtime_error(lines.error());
  if (!st.ok()) {
    const std::string m = st.ToString();
    if (m.find("ocab") != std::string::npos)  // "Vocabulary size is smaller than required_chars", "too high"
      throw std::runtime_error("option '--vocab-size' " + std::to_string(o.vocab_size) + " does not fit the corpus: " + m);
    throw std::runtime_error("SentencePiece training failed (option '--input'): " + m);
  }
  write_file_atomic(o.out, model, false, "option '--out'");
  TokenizerTrainResult r;
  r.sentences = lines.sentences;
  r.bytes = lines.bytes;
  r.vocab_size = o.vocab_size;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace shardtrain
