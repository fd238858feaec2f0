// The bounded JSON reader (json_input.h): its messages, and read_json_or_discarded.
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

}  // namespace json_detail

nlohmann::json read_json_or_discarded(std::string_view text, const JsonLimits& lim) {
  try {
    return read_json(text, lim);
  } catch (const JsonError&) {
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
}

}  // namespace shardtrain
