// The bounded JSON reader (json_input.h): its messages, and read_json_or_discarded.
#include "shardtrain/runtime/json_input.h"

#include "shardtrain/runtime/files.h"

namespace shardtrain {
namespace json_detail {

void check_text(std::string_view text, const JsonLimits& lim) {
  if (text.size() > lim.max_bytes)
    throw JsonError(std::to_string(text.size()) + " bytes, more than the " + std::to_string(lim.max_bytes) +
                    " read from " + lim.kind);
  if (text.starts_with("\xEF\xBB\xBF"))  // nlohmann's lexer would skip it
    throw JsonError("not valid JSON: it starts with a UTF-8 byte order mark (Python's json.load of the text, serde_json "
                    "and the safetensors library refuse it)");
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
// nlohmann's message quotes the token it stopped at ("last read: '...'"), which may be as long as
// the input: cut, so that a refusal stays one line whatever the file.
void syntax(const std::string& what) {
  constexpr size_t kMax = 300;
  if (what.size() <= kMax) throw JsonError("not valid JSON: " + what);
  throw JsonError("not valid JSON: " + what.substr(0, kMax) + "... (" + std::to_string(what.size()) +
                  "-byte message cut)");
}

}  // namespace json_detail

nlohmann::json read_json_or_discarded(std::string_view text, const JsonLimits& lim) {
  try {
    return read_json(text, lim);
  } catch (const JsonError&) {
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
}

}  // namespace shardtrain
