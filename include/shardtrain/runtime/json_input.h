// The one reader of JSON text that comes from files: config.json, tokenizer.json, safetensors
// headers and indexes, .jsonl data, token-file metadata, checkpoint attributes, metrics files.
//
// Such files come from strangers. nlohmann::json's own parse builds a whole DOM with no bound: a
// deeply nested 90 MB safetensors header costs about 3.4 GB per rank before any check runs. Here
// every text is first streamed (nlohmann's SAX parser, which is iterative: no recursion however
// deep the input) through limits on bytes, nesting depth, string length and value count, and
// refused at the first value past a limit, before the memory it would take is spent:
//   - read_json: a DOM (nlohmann::json) for small files, built in the same pass; its memory is
//     bounded by max_values and the input's bytes;
//   - scan_json: the events alone, for a reader that keeps only what it needs (the safetensors
//     header's tensor table: read_safetensors_header).
// A NUL byte anywhere is refused (nlohmann's char* input ends at one and would ignore the rest;
// Python's json and the safetensors library refuse it), as are invalid UTF-8 (nlohmann's lexer) and
// a leading UTF-8 byte order mark (which nlohmann would skip; serde_json and Python's json.load of
// the text refuse it). nlohmann's syntax messages quote the token they stopped at: cut at 300 bytes.
//
// Errors: JsonError (a nlohmann::json::exception) whose what() is the reason alone, e.g.
//   "not valid JSON: [json.exception.parse_error.101] parse error at line 1, column 2: ..."
//   "not valid JSON: a NUL byte at byte offset 7 of 12 (JSON text holds none; ...)"
//   "JSON nested deeper than 64 levels (the limit for a config.json)"
//   "a JSON string of 2000000 bytes, more than the 1048576 allowed in a config.json"
//   "more than 1000000 JSON values (the limit for a config.json)"
//   "70000000 bytes, more than the 67108864 read from a config.json"
// Callers prefix it with the file (and key) they read, as every refusal names the file.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace shardtrain {

// Limits of one kind of JSON text. `kind` names it in refusals ("a config.json").
struct JsonLimits {
  const char* kind;
  uint64_t max_bytes;   // the text's length
  uint32_t max_depth;   // nesting of arrays and objects; a scalar at top level is depth 0
  uint64_t max_string;  // bytes of one string or object key (after unescaping)
  uint64_t max_values;  // values of every kind, arrays and objects included (keys not counted)
};

// The limits of each kind of file shardtrain reads. Each admits the largest real file of its kind
// with a wide margin (sizes in docs/errors.md, "JSON limits"); the DOM of one at its limits stays
// within a few hundred MB.
namespace json_limits {
inline constexpr uint64_t kMiB = uint64_t{1} << 20;
// Hugging Face config.json (also --model PATH and the canonical config of a checkpoint): ~1 KB.
inline constexpr JsonLimits kConfig{"a config.json", 64 * kMiB, 64, 1 * kMiB, 1'000'000};  // bytes: config.h kMaxConfigBytes
// model.safetensors.index.json: one weight_map entry a tensor (~60 bytes each).
inline constexpr JsonLimits kIndex{"a safetensors index", 64 * kMiB, 64, 64 * 1024, 4'000'000};
// tokenizer.json: the largest common ones (Gemma 3, 262k tokens) are ~33 MB and ~2M values.
inline constexpr JsonLimits kTokenizer{"a tokenizer.json", 128 * kMiB, 128, 16 * kMiB, 8'000'000};
// A safetensors header: the format's own 100 MB (kSafetensorsMaxHeader); streamed into the tensor
// table, never a DOM, so its values are bounded by its bytes alone. Depth: {name: {shape: [..]}}
// is 3; deeper only inside keys that are skipped.
inline constexpr JsonLimits kSafetensorsHeader{"a safetensors header", 100'000'000, 16, 100'000'000, UINT64_MAX};
// generation_config.json carried beside a model's tokenizer (data.h check_carried_file): a few
// hundred bytes for Llama-family models; a few KB where it lists suppressed tokens.
inline constexpr JsonLimits kGenerationConfig{"a generation_config.json", 1 * kMiB, 16, 64 * 1024, 100'000};
// One line of a .jsonl input (--mode prepare): one document.
inline constexpr JsonLimits kJsonlLine{"a line of a .jsonl file", 1024 * kMiB, 64, 1024 * kMiB, 1'000'000};
// The metadata JSON of a token file (format version 2) and the JSON attributes of a checkpoint.
inline constexpr JsonLimits kTokenFileMeta{"a token file's metadata", 16 * kMiB, 16, 1 * kMiB, 100'000};
inline constexpr JsonLimits kCheckpointAttr{"a checkpoint attribute", 64 * kMiB, 32, 16 * kMiB, 4'000'000};
// One line of a metrics file (--metrics, read back at --resume).
inline constexpr JsonLimits kMetricsLine{"a metrics line", 1 * kMiB, 16, 64 * 1024, 10'000};
}  // namespace json_limits

// A nlohmann::json::exception, so that a reader's `catch (const json::exception&)` around both the
// parse and its .at() / .get() handles a refusal of the reader the same way; what() is the reason.
class JsonError : public nlohmann::json::exception {
 public:
  explicit JsonError(const std::string& what) : nlohmann::json::exception(0, what.c_str()) {}
};

// Parses `text` (whole: trailing non-space is an error) into a DOM within `lim`. Throws JsonError.
// J: nlohmann::json (objects as std::map: keys sorted, N log N for N keys), or, for text shardtrain
// wrote itself and whose key order it keeps, nlohmann::ordered_json (each key looked up linearly:
// quadratic in one object's keys, so never for a file from outside).
template <class J = nlohmann::json>
J read_json(std::string_view text, const JsonLimits& lim);

// Like read_json, but never throws: a discarded value (is_discarded()) for text that read_json
// refuses. For readers that treat bad JSON as "no information" (a tokenizer.json asked for a token's
// string).
nlohmann::json read_json_or_discarded(std::string_view text, const JsonLimits& lim);

namespace json_detail {
// Builds the DOM from the events. Each container's parent is on `open_`; a value goes into the
// innermost open container (at the slot its key made, for an object). Pointers into a parent stay
// valid while a child is open: nothing is added to the parent until the child closes.
template <class J>
class DomBuilder {
 public:
  explicit DomBuilder(J& root) : root_(root) {}
  void null() { put(nullptr); }
  void boolean(bool v) { put(v); }
  void number_integer(int64_t v) { put(v); }
  void number_unsigned(uint64_t v) { put(v); }
  void number_float(double v, const std::string&) { put(v); }
  void string(std::string& s) { put(std::move(s)); }
  // A repeated key keeps its last value, as Python's json and nlohmann::json::parse do.
  void key(std::string& s) { slot_ = &(*open_.back())[std::move(s)]; }
  void start_object() { open_.push_back(put(J::object())); }
  void start_array() { open_.push_back(put(J::array())); }
  void end_object() { open_.pop_back(); }
  void end_array() { open_.pop_back(); }

 private:
  J* put(J v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    J& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }
  J& root_;
  std::vector<J*> open_;
  J* slot_ = nullptr;
};

// The checks common to read_json and scan_json: the byte limit and NUL, before any parse.
void check_text(std::string_view text, const JsonLimits& lim);
[[noreturn]] void too_deep(const JsonLimits& lim);
[[noreturn]] void too_long(const JsonLimits& lim, uint64_t bytes);
[[noreturn]] void too_many(const JsonLimits& lim);
[[noreturn]] void syntax(const std::string& what);

// nlohmann's SAX interface over a Handler, with the limits checked before each event reaches it.
template <class Handler>
class LimitedSax {
 public:
  using number_integer_t = int64_t;
  using number_unsigned_t = uint64_t;
  using number_float_t = double;
  using string_t = std::string;
  using binary_t = nlohmann::json::binary_t;

  LimitedSax(Handler& h, const JsonLimits& lim) : h_(h), lim_(lim) {}

  bool null() { count(); h_.null(); return true; }
  bool boolean(bool v) { count(); h_.boolean(v); return true; }
  bool number_integer(int64_t v) { count(); h_.number_integer(v); return true; }
  bool number_unsigned(uint64_t v) { count(); h_.number_unsigned(v); return true; }
  bool number_float(double v, const std::string& s) { count(); h_.number_float(v, s); return true; }
  bool string(std::string& s) { count(); length(s); h_.string(s); return true; }
  bool binary(binary_t&) { syntax("binary value"); }  // not produced by the JSON lexer
  bool key(std::string& s) { length(s); h_.key(s); return true; }
  bool start_object(std::size_t) { open(); h_.start_object(); return true; }
  bool end_object() { --depth_; h_.end_object(); return true; }
  bool start_array(std::size_t) { open(); h_.start_array(); return true; }
  bool end_array() { --depth_; h_.end_array(); return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) { syntax(ex.what()); }

 private:
  void count() {
    if (++values_ > lim_.max_values) too_many(lim_);
  }
  void length(const std::string& s) {
    if (s.size() > lim_.max_string) too_long(lim_, s.size());
  }
  void open() {
    count();
    if (++depth_ > lim_.max_depth) too_deep(lim_);
  }
  Handler& h_;
  const JsonLimits& lim_;
  uint64_t values_ = 0;
  uint32_t depth_ = 0;
};
}  // namespace json_detail

// Streams `text` through `h` within `lim`: no DOM is built. Handler has the member functions
//   void null(); void boolean(bool); void number_integer(int64_t);  // negative integers
//   void number_unsigned(uint64_t);                                // non-negative integers
//   void number_float(double, const std::string& as_written); void string(std::string&);
//   void key(std::string&); void start_object(); void end_object(); void start_array(); void end_array();
// called in document order (a key before its value); any of them may throw to refuse the text,
// and that exception propagates as it is. Throws JsonError for a limit or a syntax error.
template <class Handler>
void scan_json(std::string_view text, const JsonLimits& lim, Handler& h) {
  json_detail::check_text(text, lim);
  json_detail::LimitedSax<Handler> sax(h, lim);
  nlohmann::json::sax_parse(text.begin(), text.end(), &sax, nlohmann::json::input_format_t::json, /*strict=*/true);
}

template <class J>
J read_json(std::string_view text, const JsonLimits& lim) {
  J root;
  json_detail::DomBuilder<J> b(root);
  scan_json(text, lim, b);
  return root;
}

}  // namespace shardtrain
