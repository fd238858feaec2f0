// Token files written byte by byte from docs/data-format.md, independently of the reader
// (data.cpp): shardtrain versions 1 and 2 (st_file) and version 3 with examples and role classes
// (v3_file). Shared by the unit tests of the formats and the example-data tests.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardtrain/data/data.h"
#include "shardtrain/runtime/files.h"  // crc32_update

namespace shardtrain::testing {

// Little-endian: the low n bytes of v.
inline void put(std::string& b, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// shardtrain: the 64-byte header, tokens (u16), then for version 2 the JSON and the file area.
inline std::string st_file(const std::vector<uint32_t>& toks, uint64_t n_val, uint32_t vocab = 258, uint32_t bos = 256,
                           uint32_t eos = 257, const std::string& kind = "byte-level", const std::string& json = "",
                           const std::string& area = "") {
  std::string b("STTOKv1\0", 8);
  const bool v2 = !json.empty();
  for (uint64_t v : {v2 ? 2u : 1u, vocab, bos, eos, 2u, v2 ? static_cast<uint32_t>(json.size()) : 0u}) put(b, v, 4);
  put(b, toks.size() - n_val, 8);
  put(b, n_val, 8);
  std::string name = kind;
  name.resize(16, '\0');
  b += name;
  for (uint32_t t : toks) put(b, t, 2);
  return b + json + area;
}

// Version 3 (chat data): examples with explicit starts and a role class per token; tokenizer
// "hf-tokenizers" of `vocab` ids, EOS `eos`, no BOS.
struct V3 {
  std::vector<uint32_t> toks;
  std::vector<uint64_t> starts;  // into toks
  std::vector<uint8_t> roles;
  uint64_t e_val = 0;            // the last e_val examples are the validation split
  uint32_t vocab = 600, eos = 2;
};
// The distinct ids of v's end-of-turn tokens (role class 2), ascending, as a JSON list: the
// metadata's examples.end_of_turn_ids.
inline std::string eot_list(const V3& v) {
  std::set<uint32_t> ids;
  for (size_t i = 0; i < v.toks.size(); ++i)
    if (v.roles[i] == 2) ids.insert(v.toks[i]);
  std::string out;
  for (uint32_t id : ids) out += (out.empty() ? "" : ", ") + std::to_string(id);
  return "[" + out + "]";
}
// Overrides for crafted files: a JSON field of "examples" replaced (override_val "<absent>": left
// out), the arrays' CRC32 flipped; `files`: the tokenizer's files as the metadata's JSON object,
// their bytes `area`, placed before the arrays.
inline std::string v3_file(const V3& v, const std::string& override_key = "", const std::string& override_val = "",
                           bool bad_crc = false, const std::string& files = "{}", const std::string& area = "") {
  const uint64_t count = v.starts.size(), n = v.toks.size();
  const uint64_t n_val = v.e_val ? n - v.starts[count - v.e_val] : 0;
  std::string starts, roles(v.roles.begin(), v.roles.end());
  for (uint64_t x : v.starts) put(starts, x, 8);
  const uint32_t sc = crc32_update(0, starts.data(), starts.size()) ^ (bad_crc ? 1u : 0u);
  const uint32_t rc = crc32_update(0, roles.data(), roles.size());
  std::map<std::string, std::string> f = {
      {"count", std::to_string(count)}, {"train", std::to_string(count - v.e_val)}, {"val", std::to_string(v.e_val)},
      {"starts", "{\"offset\": " + std::to_string(area.size()) + ", \"bytes\": " + std::to_string(starts.size()) +
                     ", \"crc32\": " + std::to_string(sc) + "}"},
      {"roles", "{\"offset\": " + std::to_string(area.size() + starts.size()) + ", \"bytes\": " +
                    std::to_string(roles.size()) + ", \"crc32\": " + std::to_string(rc) + "}"},
      {"end_of_turn_ids", eot_list(v)}};
  if (override_val == "<absent>") f.erase(override_key);
  else if (!override_key.empty()) f[override_key] = override_val;
  std::string ex;
  for (auto& [k, x] : f) ex += (ex.empty() ? "" : ", ") + ("\"" + k + "\": " + x);
  const std::string json = "{\"format\": \"shardtrain-tokens\", \"tokenizer\": {\"kind\": \"hf-tokenizers\", "
                           "\"vocab_size\": " + std::to_string(v.vocab) + ", \"bos_id\": null, \"eos_id\": " +
                           std::to_string(v.eos) + ", \"files\": " + files + "}, \"examples\": {" + ex + "}}";
  std::string b = st_file(v.toks, n_val, v.vocab, kNoTokenId, v.eos, "hf-tokenizers", json, area + starts + roles);
  b[8] = 3;  // version 3 (st_file writes 2 when there is JSON)
  return b;
}

}  // namespace shardtrain::testing
