// The bounded JSON reader (json_input.h): limits checked on nlohmann's SAX events, a DOM built in
// the same pass by DomBuilder.
#include "shardtrain/json_input.h"

#include "shardtrain/files.h"

namespace shardtrain {
namespace json_detail {

void check_text(std::string_view text, const JsonLimits& lim) {
  if (text.size() > lim.max_bytes)
    throw JsonError(std::to_string(text.size()) + " bytes, more than the " + std::to_string(lim.max_bytes) +
                    " read from " + lim.kind);
  if (const size_t z = text.find('\0'); z != std::string_view::npos)
    throw JsonError("not valid JSON: a NUL byte at byte offset " + std::to_string(z) + " of " +
                    std::to_string(text.size()) + " (JSON text holds none; a parser that stopped there would ignore the rest)");
}
void too_deep(const JsonLimits& lim) {
  throw JsonError("JSON nested deeper than " + std::to_string(lim.max_depth) + " levels (the limit for " + lim.kind +
                  ")");
}
void too_long(const JsonLimits& lim, uint64_t bytes) {
  throw JsonError("a JSON string of " + std::to_string(bytes) + " bytes, more than the " +
                  std::to_string(lim.max_string) + " allowed in " + lim.kind);
}
void too_many(const JsonLimits& lim) {
  throw JsonError("more than " + std::to_string(lim.max_values) + " JSON values (the limit for " + lim.kind + ")");
}
void syntax(const std::string& what) { throw JsonError("not valid JSON: " + what); }

namespace {
// Builds the DOM from the events. Each container's parent is on `open_`; a value goes into the
// innermost open container (at the slot its key made, for an object). Pointers into a parent stay
// valid while a child is open: nothing is added to the parent until the child closes.
class DomBuilder {
 public:
  explicit DomBuilder(nlohmann::json& root) : root_(root) {}
  void null() { put(nullptr); }
  void boolean(bool v) { put(v); }
  void number_integer(int64_t v) { put(v); }
  void number_unsigned(uint64_t v) { put(v); }
  void number_float(double v, const std::string&) { put(v); }
  void string(std::string& s) { put(std::move(s)); }
  // A repeated key keeps its last value, as Python's json and nlohmann::json::parse do.
  void key(std::string& s) { slot_ = &(*open_.back())[std::move(s)]; }
  void start_object() { open_.push_back(put(nlohmann::json::object())); }
  void start_array() { open_.push_back(put(nlohmann::json::array())); }
  void end_object() { open_.pop_back(); }
  void end_array() { open_.pop_back(); }

 private:
  nlohmann::json* put(nlohmann::json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    nlohmann::json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }
  nlohmann::json& root_;
  std::vector<nlohmann::json*> open_;
  nlohmann::json* slot_ = nullptr;
};
}  // namespace
}  // namespace json_detail

nlohmann::json read_json(std::string_view text, const JsonLimits& lim) {
  nlohmann::json root;
  json_detail::DomBuilder b(root);
  scan_json(text, lim, b);
  return root;
}

nlohmann::json read_json_or_discarded(std::string_view text, const JsonLimits& lim) {
  try {
    return read_json(text, lim);
  } catch (const JsonError&) {
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
}

}  // namespace shardtrain
