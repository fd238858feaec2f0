// Byte tokenizer, token file writer; the memory-mapped reader of shardtrain, llm.c and nanoGPT token
// files; deterministic batch sampling.
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include <nlohmann/json.hpp>

#include "shardtrain/data/data.h"
#include "shardtrain/runtime/files.h"
#include "shardtrain/runtime/json_input.h"
#include "shardtrain/backend/ops_math.h"  // math::splitmix64

namespace shardtrain {
namespace {
constexpr char kMagic[8] = {'S', 'T', 'T', 'O', 'K', 'v', '1', '\0'};

template <typename U> void put(std::string& b, U v) {
  for (size_t i = 0; i < sizeof(U); ++i) b.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}
template <typename U> U get(const unsigned char* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(U); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<U>(v);
}
}  // namespace

std::vector<int32_t> ByteTokenizer::encode(const std::string& text) {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids)
    if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
  return s;
}

void check_carried_file(const std::string& name, const std::string& bytes, uint32_t vocab_size,
                        const std::string& what) {
  auto fail = [&](const std::string& why) { throw std::runtime_error(what + ": " + why); };
  if (name == "chat_template.jinja") {
    if (bytes.size() > kMaxChatTemplateBytes)
      fail(std::to_string(bytes.size()) + " bytes, more than the " + std::to_string(kMaxChatTemplateBytes) +
           " read from a chat template");
    try {  // nlohmann's serializer checks UTF-8 strictly (overlong forms and surrogates included)
      (void)nlohmann::json(bytes).dump();
    } catch (const nlohmann::json::exception& e) {
      fail(std::string("not UTF-8 text, which transformers reads a chat template as (") + e.what() + ")");
    }
  } else if (name == "generation_config.json") {
    nlohmann::json j;
    try {
      j = read_json(bytes, json_limits::kGenerationConfig);
    } catch (const JsonError& e) {
      fail(e.what());
    }
    if (!j.is_object()) fail("not a JSON object");
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
      if (!j.contains(key) || j[key].is_null()) continue;
      const nlohmann::json& v = j[key];
      const bool eos = std::string(key) == "eos_token_id", list = eos && v.is_array();
      if (list && v.empty()) fail("key 'eos_token_id' is an empty list");
      std::string shown = v.dump();
      if (shown.size() > 80) shown = shown.substr(0, 80) + "...";
      for (const nlohmann::json& x : list ? v : nlohmann::json::array({v})) {
        if (!x.is_number_unsigned())
          fail(std::string("key '") + key + "' must be a token id (an integer >= 0)" + (eos ? " or a list of them" : "") +
               ", got " + shown);
        if (vocab_size > 0 && x.get<uint64_t>() >= vocab_size)
          fail(std::string("key '") + key + "' = " + shown + ": id " + std::to_string(x.get<uint64_t>()) +
               " is outside the vocabulary (vocab_size " + std::to_string(vocab_size) + ")");
      }
    }
  }
}

// prepare_token_file: src/data/prepare.cpp (the streaming writer).

namespace {
constexpr int32_t kLlmcMagicGpt2 = 20240520, kLlmcMagicLlama3 = 20240801;  // llm.c dev/data/data_common.py
constexpr uint64_t kLlmcHeaderBytes = 256 * 4;
constexpr size_t kScanChunk = 4u << 20;  // bytes per pread() when a file is scanned at open

[[noreturn]] void fail_file(const std::string& path, const std::string& what) {
  throw std::runtime_error("token file '" + path + "': " + what);
}

// An open file descriptor, closed on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Opens `path` read-only; throws naming it if it is missing, unreadable or a directory. Returns its size.
uint64_t open_token_file(const std::string& path, Fd& f) {
  // O_NONBLOCK: a FIFO is refused below, not waited on in open(2).
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (f.fd < 0) {
    const int e = errno;
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
      throw std::runtime_error("token file '" + path + "' is not a regular file (" + file_kind(st.st_mode) + ")");
    throw std::runtime_error("cannot open token file '" + path + "' (make one with --mode prepare): " + std::strerror(e));
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail_file(path, std::string("cannot stat: ") + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw std::runtime_error("token file '" + path + "' is a directory");
  if (!S_ISREG(st.st_mode))
    throw std::runtime_error("token file '" + path + "' is not a regular file (" + file_kind(st.st_mode) + ")");
  refuse_pseudo_fs(f.fd, "token file '" + path + "'");  // (/proc, /sys: files.h pseudo_fs_name)
  ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) & ~O_NONBLOCK);
  return static_cast<uint64_t>(st.st_size);
}

// Reads exactly `n` bytes at `off`; throws naming the file on an error or a short read.
void pread_all(const Fd& f, const std::string& path, void* buf, size_t n, uint64_t off) {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(f.fd, p + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      fail_file(path, "cannot read " + std::to_string(n) + " bytes at byte offset " + std::to_string(off) +
                          (r < 0 ? std::string(": ") + std::strerror(errno) : std::string(": end of file")));
    done += static_cast<size_t>(r);
  }
}

// Parses and checks the 64-byte header `b` of shardtrain token file `path`, whose size is `size`
// bytes; `meta_bytes` receives J (version 2; 0 for version 1).
TokenFileHeader parse_header(const std::string& path, const char* b, uint64_t size, uint32_t* meta_bytes = nullptr) {
  auto fail = [&](const std::string& w) { fail_file(path, w); };
  if (size < 64) fail("shorter than its 64-byte header");
  if (std::memcmp(b, kMagic, 8) != 0) fail("bad magic (not a shardtrain token file)");
  auto p = reinterpret_cast<const unsigned char*>(b);
  TokenFileHeader h;
  h.version = get<uint32_t>(p + 8);
  if (h.version < 1 || h.version > 3)
    fail("unknown format version " + std::to_string(h.version) + " (field at byte offset 8; supported: 1, 2, 3)");
  h.vocab_size = get<uint32_t>(p + 12);
  h.bos_id = get<uint32_t>(p + 16);
  h.eos_id = get<uint32_t>(p + 20);
  h.token_bytes = get<uint32_t>(p + 24);
  if (h.token_bytes != 2 && h.token_bytes != 4)
    fail("field 'bytes per token' (offset 24) is " + std::to_string(h.token_bytes) + "; supported: 2 (u16) or 4 (u32)");
  const uint64_t J = h.version >= 2 ? get<uint32_t>(p + 28) : 0;
  if (meta_bytes) *meta_bytes = static_cast<uint32_t>(J);
  h.n_train = get<uint64_t>(p + 32);
  h.n_val = get<uint64_t>(p + 40);
  h.tokenizer = std::string(b + 48, strnlen(b + 48, 16));
  const uint64_t tb = h.token_bytes;
  const uint64_t payload = (size - 64) / tb;  // tokens the file can hold; compared without overflow
  const bool fits = h.n_train <= payload && h.n_val <= payload - h.n_train;
  const uint64_t need = fits ? 64 + tb * (h.n_train + h.n_val) : 0;
  if (!fits || (h.version == 1 && size != need) || (h.version >= 2 && size - need < J))
    fail("size " + std::to_string(size) + " bytes does not match header (" + std::to_string(h.n_train) + " train + " +
         std::to_string(h.n_val) + " val tokens" + (h.version >= 2 ? " + " + std::to_string(J) + " metadata bytes" : "") +
         ")");
  return h;
}

int64_t special(uint32_t id) { return id == kNoTokenId ? -1 : static_cast<int64_t>(id); }

// Version 3's examples, as read from the file (starts: into the file's tokens).
struct FileExamples {
  uint64_t train = 0, val = 0, roles_offset = 0;
  std::vector<uint64_t> starts;
  std::vector<int64_t> end_of_turn_ids;  // ascending
};

// Version 3's arrays (docs/data-format.md, "Version 3"): `ex` is the JSON's "examples" object, the
// area (tokenizer files and arrays) starts at byte `area` and holds `area_bytes`. Checks the CRC32s
// and the rules; returns the bytes the arrays take. Throws naming the file and field.
uint64_t read_examples(const Fd& f, const std::string& path, const TokenFileHeader& h, const nlohmann::json& ex,
                       uint64_t area, uint64_t area_bytes, FileExamples& out) {
  auto fail = [&](const std::string& w) { fail_file(path, "metadata examples: " + w); };
  auto u64 = [&](const nlohmann::json& o, const char* key) {  // a JSON integer >= 0, not 5.9 or -1
    const nlohmann::json& v = o.at(key);
    if (!v.is_number_unsigned()) fail(std::string(key) + " is " + v.dump().substr(0, 40) + ", not a non-negative integer");
    return v.get<uint64_t>();
  };
  const uint64_t n = h.n_train + h.n_val;
  const uint64_t count = u64(ex, "count");
  out.train = u64(ex, "train");
  out.val = u64(ex, "val");
  if (out.train > count || out.val != count - out.train)
    fail("count " + std::to_string(count) + " is not train " + std::to_string(out.train) + " + val " + std::to_string(out.val));
  if ((count == 0) != (n == 0) || count > n)
    fail(std::to_string(count) + " examples for " + std::to_string(n) + " tokens");
  auto place = [&](const char* key, uint64_t want) {
    const nlohmann::json& e = ex.at(key);
    const uint64_t o = u64(e, "offset"), b = u64(e, "bytes");
    if (b != want) fail(std::string(key) + " holds " + std::to_string(b) + " bytes, expected " + std::to_string(want));
    if (o > area_bytes || b > area_bytes - o)
      fail(std::string(key) + " (offset " + std::to_string(o) + ", " + std::to_string(b) +
           " bytes) lies beyond the end of the file (" + std::to_string(area_bytes) + " bytes after the JSON)");
    const uint64_t crc = u64(e, "crc32");
    if (crc > 0xFFFFFFFFu) fail(std::string(key) + ".crc32 " + std::to_string(crc) + " is not a CRC32");
    return std::tuple{area + o, static_cast<uint32_t>(crc)};
  };
  const auto [starts_at, starts_crc] = place("starts", 8 * count);
  const auto [roles_at, roles_crc] = place("roles", n);
  // The starts: 8 bytes an example, within the file's size (checked just above).
  std::string raw(static_cast<size_t>(8 * count), '\0');
  pread_all(f, path, raw.data(), raw.size(), starts_at);
  if (crc32_update(0, raw.data(), raw.size()) != starts_crc) fail("starts at byte offset " + std::to_string(starts_at) + " fail their CRC32 (corrupt file)");
  out.starts.resize(static_cast<size_t>(count));
  for (uint64_t e = 0; e < count; ++e) {
    const uint64_t v = get<uint64_t>(reinterpret_cast<const unsigned char*>(raw.data()) + 8 * e);
    if ((e == 0 && v != 0) || (e > 0 && v <= out.starts[e - 1]) || v >= n)
      fail("starts[" + std::to_string(e) + "] = " + std::to_string(v) + ": expected 0 first, then strictly increasing below " +
           std::to_string(n) + " tokens");
    out.starts[e] = v;
  }
  if (out.val > 0 && out.starts[out.train] != h.n_train)
    fail("the validation split does not begin at an example (starts[" + std::to_string(out.train) + "] = " +
         std::to_string(out.starts[out.train]) + ", n_train " + std::to_string(h.n_train) + ")");
  if (out.val == 0 && h.n_val > 0) fail("validation tokens without validation examples");
  // end_of_turn_ids: the distinct ids of the end-of-turn tokens, ascending (checked against the
  // tokens below: exactly those ids, every one of them used).
  if (!ex.contains("end_of_turn_ids")) fail("end_of_turn_ids is missing (the ids of the end-of-turn tokens, role class 2)");
  const nlohmann::json& eot = ex["end_of_turn_ids"];
  if (!eot.is_array()) fail("end_of_turn_ids is " + eot.dump().substr(0, 40) + ", not a list of token ids");
  for (const nlohmann::json& v : eot) {
    if (!v.is_number_unsigned() || v.get<uint64_t>() >= h.vocab_size)
      fail("end_of_turn_ids holds " + v.dump().substr(0, 40) + ", not a token id below vocab_size " +
           std::to_string(h.vocab_size));
    const int64_t id = static_cast<int64_t>(v.get<uint64_t>());
    if (!out.end_of_turn_ids.empty() && id <= out.end_of_turn_ids.back())
      fail("end_of_turn_ids is not ascending without repeats (" + std::to_string(id) + " after " +
           std::to_string(out.end_of_turn_ids.back()) + ")");
    out.end_of_turn_ids.push_back(id);
  }
  const std::vector<int64_t>& eot_ids = out.end_of_turn_ids;
  std::vector<char> used(eot_ids.size(), 0);
  std::string unlisted;  // the first end-of-turn token whose id the list lacks
  // The roles: one u8 a token, in chunks (resident memory does not grow with the corpus); the
  // tokens of a chunk that holds an end of turn are read beside them.
  const uint64_t tb = h.token_bytes;
  std::vector<unsigned char> buf(static_cast<size_t>(std::min<uint64_t>(n, kScanChunk / 4))), toks(buf.size() * tb);
  uint32_t crc = 0;
  for (uint64_t at = 0; at < n; at += buf.size()) {
    const size_t k = static_cast<size_t>(std::min<uint64_t>(buf.size(), n - at));
    pread_all(f, path, buf.data(), k, roles_at + at);
    crc = crc32_update(crc, buf.data(), k);
    bool any_eot = false;
    for (size_t i = 0; i < k; ++i) {
      if (buf[i] >= kRoleClasses)
        fail("role class " + std::to_string(buf[i]) + " of token " + std::to_string(at + i) + " at byte offset " +
             std::to_string(roles_at + at + i) + " (known: 0-" + std::to_string(kRoleClasses - 1) + ")");
      any_eot |= buf[i] == static_cast<uint8_t>(RoleClass::EndOfTurn);
    }
    if (!any_eot) continue;
    pread_all(f, path, toks.data(), k * tb, 64 + tb * at);
    for (size_t i = 0; i < k; ++i) {
      if (buf[i] != static_cast<uint8_t>(RoleClass::EndOfTurn)) continue;
      const int64_t id = tb == 2 ? get<uint16_t>(toks.data() + 2 * i) : get<uint32_t>(toks.data() + 4 * i);
      const auto it = std::lower_bound(eot_ids.begin(), eot_ids.end(), id);
      if (it != eot_ids.end() && *it == id) used[static_cast<size_t>(it - eot_ids.begin())] = 1;
      else if (unlisted.empty())  // reported after the CRC32: a damaged file is called so
        unlisted = "token " + std::to_string(at + i) + " (id " + std::to_string(id) + ") is an end of turn (role class 2), "
                   "but end_of_turn_ids does not list its id";
    }
  }
  if (crc != roles_crc) fail("roles at byte offset " + std::to_string(roles_at) + " fail their CRC32 (corrupt file)");
  if (!unlisted.empty()) fail(unlisted);
  for (size_t i = 0; i < eot_ids.size(); ++i)
    if (!used[i])
      fail("end_of_turn_ids lists " + std::to_string(eot_ids[i]) + ", which no end-of-turn token (role class 2) has");
  out.roles_offset = roles_at;
  return 8 * count + n;
}

// Version 2 and 3 metadata at `off` (J bytes) and the tokenizer files (version 3: and the example
// arrays) after it, up to the end of the file.
TokenizerInfo read_metadata(const Fd& f, const std::string& path, const TokenFileHeader& h, uint64_t off, uint64_t J,
                            uint64_t size, FileExamples& examples) {
  using nlohmann::json;
  auto fail = [&](const std::string& w) { fail_file(path, "metadata (JSON at byte offset " + std::to_string(off) + "): " + w); };
  if (J > json_limits::kTokenFileMeta.max_bytes)  // before the bytes are allocated
    fail(std::to_string(J) + " bytes, more than the " + std::to_string(json_limits::kTokenFileMeta.max_bytes) + " read from " +
         json_limits::kTokenFileMeta.kind);
  std::string text(J, '\0');
  pread_all(f, path, text.data(), J, off);
  json j;
  try {
    j = read_json(text, json_limits::kTokenFileMeta);
  } catch (const JsonError& e) {
    fail(e.what());
  }
  TokenizerInfo t;
  const uint64_t area = off + J, area_bytes = size - area;
  try {
    const json& k = j.at("tokenizer");
    t.kind = k.at("kind").get<std::string>();
    t.vocab_size = k.at("vocab_size").get<uint32_t>();
    auto id = [&](const char* key) -> int64_t {
      if (!k.contains(key) || k[key].is_null()) return -1;
      return k[key].get<int64_t>();
    };
    t.bos_id = id("bos_id");
    t.eos_id = id("eos_id");
    t.pad_id = id("pad_id");
    t.unk_id = id("unk_id");
    t.add_bos = k.value("add_bos", true);
    t.add_eos = k.value("add_eos", true);
    if (t.kind != h.tokenizer) fail("tokenizer.kind '" + t.kind + "' disagrees with the header's '" + h.tokenizer + "'");
    if (t.vocab_size != h.vocab_size)
      fail("tokenizer.vocab_size " + std::to_string(t.vocab_size) + " disagrees with the header's " +
           std::to_string(h.vocab_size));
    for (auto [key, mine, hdr] : {std::tuple{"bos_id", t.bos_id, h.bos_id}, std::tuple{"eos_id", t.eos_id, h.eos_id}})
      if (mine != special(hdr))
        fail(std::string("tokenizer.") + key + " " + (mine < 0 ? "null" : std::to_string(mine)) +
             " disagrees with the header's " + (hdr == kNoTokenId ? "none (0xFFFFFFFF)" : std::to_string(hdr)));
    uint64_t total = 0;
    if (k.contains("files"))
      for (const auto& [name, e] : k.at("files").items()) {
        const uint64_t fo = e.at("offset").get<uint64_t>(), fb = e.at("bytes").get<uint64_t>();
        const uint32_t crc = e.at("crc32").get<uint32_t>();
        if (fo > area_bytes || fb > area_bytes - fo)
          fail("tokenizer file '" + name + "' (offset " + std::to_string(fo) + ", " + std::to_string(fb) +
               " bytes) lies beyond the end of the file (" + std::to_string(area_bytes) + " bytes after the JSON)");
        std::string bytes(fb, '\0');
        pread_all(f, path, bytes.data(), fb, area + fo);
        const uint32_t got = crc32_update(0, bytes.data(), bytes.size());
        if (got != crc)
          fail("tokenizer file '" + name + "' at byte offset " + std::to_string(area + fo) + " has CRC32 " +
               std::to_string(got) + ", the JSON says " + std::to_string(crc) + " (corrupt file)");
        try {
          check_carried_file(name, bytes, h.vocab_size, "tokenizer file '" + name + "'");
        } catch (const std::runtime_error& bad) {
          fail(bad.what());
        }
        t.files[name] = std::move(bytes);
        total += fb;
      }
    if (h.version == 3) {
      if (!j.contains("examples") || !j["examples"].is_object()) fail("version 3 without an 'examples' object");
      total += read_examples(f, path, h, j["examples"], area, area_bytes, examples);
    }
    if (total != area_bytes)
      fail_file(path, "size " + std::to_string(size) + " bytes does not match header and metadata: " +
                          std::to_string(area_bytes) + " bytes after the JSON, its tokenizer files" +
                          (h.version == 3 ? std::string(" and example arrays") : std::string()) + " hold " +
                          std::to_string(total));
  } catch (const json::exception& e) {
    fail(std::string("field missing or of the wrong type: ") + e.what());
  }
  return t;
}

struct OpenedFile {
  TokenFileEntry e;
  TokenFileHeader h;  // shardtrain files
  TokenizerInfo tok;  // shardtrain files
  FileExamples examples;  // version 3
};

// Opens, identifies and scans one file (see TokenDataset).
OpenedFile open_and_scan(const std::string& path, DataFormat format, std::vector<unsigned char>& buf) {
  Fd f;
  OpenedFile o;
  TokenFileEntry& e = o.e;
  e.path = path;
  e.size = open_token_file(path, f);
  if (e.size == 0) fail_file(path, "is empty");
  unsigned char head[kLlmcHeaderBytes] = {};
  pread_all(f, path, head, static_cast<size_t>(std::min<uint64_t>(e.size, sizeof head)), 0);
  if (format == DataFormat::Auto) {
    const int32_t m = e.size >= 4 ? static_cast<int32_t>(get<uint32_t>(head)) : 0;
    if (e.size >= 5 && std::memcmp(head, kMagic, std::min<uint64_t>(e.size, 8)) == 0) format = DataFormat::Shardtrain;
    else if (m == kLlmcMagicGpt2 || m == kLlmcMagicLlama3) format = DataFormat::Llmc;
    else
      fail_file(path, "bad magic: neither a shardtrain token file (\"STTOKv1\") nor an llm.c shard (int32 20240520 or "
                      "20240801 at byte offset 0); for nanoGPT's raw uint16 train.bin / val.bin (no header) pass "
                      "'--data-format nanogpt'");
  }
  uint64_t meta_off = 0, meta_bytes = 0;
  if (format == DataFormat::Shardtrain) {
    uint32_t J = 0;
    o.h = parse_header(path, reinterpret_cast<const char*>(head), e.size, &J);
    e.format = "shardtrain v" + std::to_string(o.h.version);
    e.data_offset = 64;
    e.token_bytes = o.h.token_bytes;
    e.n_train = o.h.n_train;
    e.n_val = o.h.n_val;
    e.known_vocab = true;
    meta_off = 64 + uint64_t{e.token_bytes} * (e.n_train + e.n_val);
    meta_bytes = J;
  } else if (format == DataFormat::Llmc) {
    if (e.size < kLlmcHeaderBytes) fail_file(path, "shorter than the 1024-byte llm.c header (256 int32)");
    const int32_t magic = static_cast<int32_t>(get<uint32_t>(head)), version = static_cast<int32_t>(get<uint32_t>(head + 4)),
                  ntok = static_cast<int32_t>(get<uint32_t>(head + 8));
    if (magic == kLlmcMagicGpt2 && version == 1) e.token_bytes = 2, e.format = "llm.c gpt-2 (u16)";
    else if (magic == kLlmcMagicLlama3 && version == 7) e.token_bytes = 4, e.format = "llm.c llama-3 (u32)";
    else if (magic != kLlmcMagicGpt2 && magic != kLlmcMagicLlama3)
      fail_file(path, "bad magic " + std::to_string(magic) + " at byte offset 0 (header int32 [0]): not an llm.c shard "
                      "(20240520: GPT-2 u16 tokens, 20240801: Llama 3 u32 tokens)");
    else
      fail_file(path, "unknown llm.c version " + std::to_string(version) + " at byte offset 4 (header int32 [1]) for magic " +
                          std::to_string(magic) + " (supported: 20240520 version 1, 20240801 version 7)");
    if (ntok <= 0)
      fail_file(path, "llm.c header token count " + std::to_string(ntok) + " at byte offset 8 (header int32 [2]) is not positive");
    const uint64_t need = kLlmcHeaderBytes + uint64_t{e.token_bytes} * static_cast<uint64_t>(ntok);
    if (need > e.size)
      fail_file(path, "llm.c header token count " + std::to_string(ntok) + " at byte offset 8 (header int32 [2]) needs " +
                          std::to_string(need) + " bytes, beyond the file size " + std::to_string(e.size));
    if (need != e.size)
      fail_file(path, "file size " + std::to_string(e.size) + " bytes does not match the llm.c header token count " +
                          std::to_string(ntok) + " at byte offset 8 (expected " + std::to_string(need) + " bytes)");
    e.data_offset = kLlmcHeaderBytes;
    e.n_train = static_cast<uint64_t>(ntok);
  } else {  // nanoGPT: raw u16
    if (e.size % 2 != 0)
      fail_file(path, "size " + std::to_string(e.size) + " bytes is odd: not raw uint16 tokens (--data-format nanogpt)");
    e.format = "nanogpt (u16)";
    e.token_bytes = 2;
    e.data_offset = 0;
    e.n_train = e.size / 2;
  }
  // One pass in fixed chunks: CRC32 of the whole file, the largest id, ids < vocab_size.
  const uint64_t tb = e.token_bytes, t_begin = e.data_offset, t_end = e.data_offset + tb * (e.n_train + e.n_val);
  const uint32_t vocab = e.known_vocab ? o.h.vocab_size : 0;
  uint32_t crc = 0, mx = 0;
  uint64_t mx_off = t_begin;
  bool any = false;
  for (uint64_t off = 0; off < e.size; off += kScanChunk) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kScanChunk, e.size - off));
    pread_all(f, path, buf.data(), n, off);
    crc = crc32_update(crc, buf.data(), n);
    // Token bytes of this chunk: chunks start at multiples of 4 MiB and tokens at 64, 1024 or 0,
    // so a chunk never splits a token.
    const uint64_t a = std::max(off, t_begin), b = std::min(off + n, t_end);
    if (a >= b) continue;
    const unsigned char* p = buf.data() + (a - off);
    const size_t cnt = static_cast<size_t>((b - a) / tb);
    uint32_t cmx = 0;
    size_t cpos = 0;
    if (tb == 2) {
      for (size_t i = 0; i < cnt; ++i) {
        const uint32_t v = get<uint16_t>(p + 2 * i);
        if (v > cmx) cmx = v, cpos = i;
      }
    } else {
      for (size_t i = 0; i < cnt; ++i) {
        const uint32_t v = get<uint32_t>(p + 4 * i);
        if (v > cmx) cmx = v, cpos = i;
      }
    }
    if (!any || cmx > mx) mx = cmx, mx_off = a + tb * cpos;
    any = true;
    if (e.known_vocab && cmx >= vocab)
      for (size_t i = 0; i < cnt; ++i) {  // the first bad id of the chunk
        const uint32_t v = tb == 2 ? get<uint16_t>(p + 2 * i) : get<uint32_t>(p + 4 * i);
        if (v >= vocab)
          fail_file(path, "token " + std::to_string(v) + " >= vocab_size " + std::to_string(vocab) + " at byte offset " +
                              std::to_string(a + tb * i));
      }
  }
  e.crc32 = crc;
  e.max_id = mx;
  e.max_id_offset = mx_off;
  if (format == DataFormat::Shardtrain) {
    if (o.h.version >= 2) {
      o.tok = read_metadata(f, path, o.h, meta_off, meta_bytes, e.size, o.examples);
      e.examples_train = o.examples.train;
      e.examples_val = o.examples.val;
      e.roles_offset = o.examples.roles_offset;
      o.tok.end_of_turn_ids = o.examples.end_of_turn_ids;
    } else {
      o.tok.kind = o.h.tokenizer;
      o.tok.vocab_size = o.h.vocab_size;
      o.tok.bos_id = special(o.h.bos_id);
      o.tok.eos_id = special(o.h.eos_id);
    }
  }
  return o;
}
}  // namespace

DataFormat parse_data_format(const std::string& s) {
  if (s == "auto") return DataFormat::Auto;
  if (s == "shardtrain") return DataFormat::Shardtrain;
  if (s == "llmc") return DataFormat::Llmc;
  if (s == "nanogpt") return DataFormat::NanoGPT;
  throw std::invalid_argument("option '--data-format' must be auto, shardtrain, llmc or nanogpt, got '" + s + "'");
}

std::vector<std::string> expand_data_paths(const std::vector<std::string>& patterns, const std::string& option) {
  std::vector<std::string> out;
  for (const std::string& p : patterns) {
    if (p.find_first_of("*?[") == std::string::npos) {
      out.push_back(p);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(p.c_str(), 0, nullptr, &g);  // sorted (no GLOB_NOSORT)
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (rc == GLOB_NOMATCH) throw std::runtime_error("option '--" + option + "': pattern '" + p + "' matches no file");
    if (rc != 0) throw std::runtime_error("option '--" + option + "': cannot expand pattern '" + p + "' (glob error)");
  }
  return out;
}

TokenFileHeader read_token_file_header(const std::string& path) {
  Fd f;
  const uint64_t size = open_token_file(path, f);
  char b[64] = {};
  if (size > 0) pread_all(f, path, b, static_cast<size_t>(std::min<uint64_t>(size, 64)), 0);
  return parse_header(path, b, size);
}

TokenDataset::TokenDataset(const std::string& path, DataFormat format)
    : TokenDataset(std::vector<std::string>{path}, {}, format) {}

TokenDataset::TokenDataset(const std::vector<std::string>& train_files, const std::vector<std::string>& val_files,
                           DataFormat format) {
  if (train_files.empty()) throw std::runtime_error("option '--data' names no token file");
  std::vector<unsigned char> buf(kScanChunk);
  std::vector<OpenedFile> opened;
  for (const auto* list : {&train_files, &val_files})
    for (const std::string& p : *list) opened.push_back(open_and_scan(p, format, buf));
  // One tokenizer: shardtrain headers must agree; files without a vocabulary must at least agree
  // on their token width (llm.c GPT-2 u16 vs Llama 3 u32 are different tokenizers).
  const OpenedFile* known = nullptr;
  const OpenedFile* unknown = nullptr;
  for (const OpenedFile& o : opened) {
    const TokenFileEntry& e = o.e;
    if (e.known_vocab) {
      if (!known) {
        known = &o;
        continue;
      }
      const TokenFileHeader& a = known->h;
      auto differ = [&](const char* what, const std::string& x, const std::string& y) {
        if (x != y)
          throw std::runtime_error("token files '" + known->e.path + "' and '" + e.path + "' disagree on " + what + " (" +
                                   x + " vs " + y + "): the files of one dataset need one tokenizer");
      };
      differ("the tokenizer", a.tokenizer, o.h.tokenizer);
      differ("vocab_size", std::to_string(a.vocab_size), std::to_string(o.h.vocab_size));
      differ("bos_id", std::to_string(a.bos_id), std::to_string(o.h.bos_id));
      differ("eos_id", std::to_string(a.eos_id), std::to_string(o.h.eos_id));
      // The same kind and sizes can still be two different models: compare the defining files.
      for (const char* f : {"tokenizer.model", "tokenizer.json"}) {
        auto x = known->tok.files.find(f), y = o.tok.files.find(f);
        if ((x == known->tok.files.end()) != (y == o.tok.files.end()) ||
            (x != known->tok.files.end() && x->second != y->second))
          throw std::runtime_error("token files '" + known->e.path + "' and '" + e.path + "' were made with different " +
                                   "tokenizers (their embedded " + f + " differ): the files of one dataset need one tokenizer");
      }
    } else if (!unknown) {
      unknown = &o;
    } else if (unknown->e.token_bytes != e.token_bytes) {
      throw std::runtime_error("token files '" + unknown->e.path + "' (" + unknown->e.format + ") and '" + e.path + "' (" +
                               e.format + ") hold ids of different tokenizers: the files of one dataset need one tokenizer");
    }
  }
  if (known) {
    h_ = known->h;
    tok_ = known->tok;
    std::set<int64_t> eot;  // every file's end-of-turn ids (version 3)
    for (const OpenedFile& o : opened) eot.insert(o.tok.end_of_turn_ids.begin(), o.tok.end_of_turn_ids.end());
    tok_.end_of_turn_ids.assign(eot.begin(), eot.end());
    for (const OpenedFile& o : opened)  // files without a vocabulary next to ones with it
      if (!o.e.known_vocab && o.e.max_id >= h_.vocab_size)
        fail_file(o.e.path, "token " + std::to_string(o.e.max_id) + " >= vocab_size " + std::to_string(h_.vocab_size) +
                                " (of token file '" + known->e.path + "') at byte offset " +
                                std::to_string(o.e.max_id_offset));
  } else {
    h_ = TokenFileHeader{};
    h_.vocab_size = 0;
    h_.bos_id = h_.eos_id = kNoTokenId;
    h_.tokenizer = "";
    tok_ = TokenizerInfo{};
    tok_.kind = "";
  }
  // Chat data (version 3) is a sequence of examples, which other files do not have: one kind per dataset.
  for (const OpenedFile& o : opened)
    if ((o.h.version == 3) != (opened.front().h.version == 3))
      throw std::runtime_error("token files '" + opened.front().e.path + "' (" + opened.front().e.format + ") and '" +
                               o.e.path + "' (" + o.e.format + ") cannot be read as one dataset: format version 3 "
                               "(chat data) has example boundaries and role classes, which the other has not");
  has_examples_ = !opened.empty() && opened.front().h.version == 3;
  h_.token_bytes = 0;
  h_.n_train = h_.n_val = 0;
  std::string crcs;  // several files: CRC32 of their CRC32s (u32 little-endian, in order)
  for (size_t i = 0; i < opened.size(); ++i) {
    const TokenFileEntry& e = opened[i].e;
    files_.push_back(e);
    put<uint32_t>(crcs, e.crc32);
    h_.token_bytes = std::max(h_.token_bytes, e.token_bytes);
    if (e.max_id > max_id_ || i == 0) max_id_ = e.max_id, max_id_file_ = i;
    auto add = [&](Split s, uint64_t first, uint64_t count) {
      if (count == 0) return;
      const int k = s == Split::Train ? 0 : 1;
      const uint64_t at = k == 0 ? h_.n_train : h_.n_val;  // the segment's stream offset
      start_[k].push_back(at);
      seg_[k].push_back({i, first, count});
      (k == 0 ? h_.n_train : h_.n_val) += count;
      for (uint64_t st : opened[i].examples.starts)  // version 3: the examples of tokens [first, first + count)
        if (st >= first && st - first < count) starts_[k].push_back(at + st - first);
    };
    if (i < train_files.size()) {
      add(Split::Train, 0, e.n_train);
      if (val_files.empty()) add(Split::Val, e.n_train, e.n_val);
    } else {
      add(Split::Val, 0, e.n_train + e.n_val);
    }
  }
  crc32_ = opened.size() == 1 ? opened[0].e.crc32 : crc32_update(0, crcs.data(), crcs.size());
  // Map each file; the pages are the page cache's, shared by the ranks of a node.
  for (const TokenFileEntry& e : files_) {
    Fd f;
    const uint64_t size = open_token_file(e.path, f);
    if (size != e.size) fail_file(e.path, "changed while being opened (size " + std::to_string(size) + " bytes, was " +
                                              std::to_string(e.size) + ")");
    void* m = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, f.fd, 0);
    if (m == MAP_FAILED) {
      const std::string why = std::strerror(errno);
      for (size_t i = 0; i < maps_.size(); ++i)  // a throwing constructor runs no destructor
        ::munmap(const_cast<unsigned char*>(maps_[i]), static_cast<size_t>(files_[i].size));
      maps_.clear();
      fail_file(e.path, "cannot map " + std::to_string(size) + " bytes: " + why);
    }
    ::madvise(m, static_cast<size_t>(size), MADV_RANDOM);  // sequences are read at random offsets
    maps_.push_back(static_cast<const unsigned char*>(m));
  }
}

TokenDataset::~TokenDataset() {
  for (size_t i = 0; i < maps_.size(); ++i)
    if (maps_[i]) ::munmap(const_cast<unsigned char*>(maps_[i]), static_cast<size_t>(files_[i].size));
  maps_.clear();
}

std::string TokenDataset::max_id_where() const {
  return "token file '" + files_[max_id_file_].path + "' byte offset " + std::to_string(files_[max_id_file_].max_id_offset);
}

template <typename F>
void TokenDataset::for_each_run(Split s, uint64_t first, uint64_t count, const char* who, F&& f) const {
  const int k = s == Split::Train ? 0 : 1;
  if (first > size(s) || count > size(s) - first)
    throw std::out_of_range(std::string("TokenDataset::") + who + ": tokens [" + std::to_string(first) + ", " +
                            std::to_string(first + count) + ") beyond the stream's " + std::to_string(size(s)));
  if (count == 0) return;
  const auto& st = start_[k];
  size_t j = static_cast<size_t>(std::upper_bound(st.begin(), st.end(), first) - st.begin()) - 1;
  while (count > 0) {
    const Segment& g = seg_[k][j];
    const uint64_t in = first - st[j], n = std::min(count, g.count - in);
    f(g, g.first + in, n);
    first += n;
    count -= n;
    ++j;
  }
}

void TokenDataset::copy(Split s, uint64_t first, uint64_t count, uint32_t* out) const {
  for_each_run(s, first, count, "copy", [&](const Segment& g, uint64_t at, uint64_t n) {
    const TokenFileEntry& e = files_[g.file];
    const unsigned char* p = maps_[g.file] + e.data_offset + uint64_t{e.token_bytes} * at;
    if (e.token_bytes == 2)
      for (uint64_t i = 0; i < n; ++i) out[i] = get<uint16_t>(p + 2 * i);
    else
      for (uint64_t i = 0; i < n; ++i) out[i] = get<uint32_t>(p + 4 * i);
    out += n;
  });
}

void TokenDataset::copy_roles(Split s, uint64_t first, uint64_t count, uint8_t* out) const {
  if (!has_examples_) throw std::logic_error("TokenDataset::copy_roles: the data has no role classes (format version 3)");
  for_each_run(s, first, count, "copy_roles", [&](const Segment& g, uint64_t at, uint64_t n) {
    std::memcpy(out, maps_[g.file] + files_[g.file].roles_offset + at, static_cast<size_t>(n));
    out += n;
  });
}

void fill_batch(const TokenDataset& ds, Split split, uint64_t seed, int64_t index, int first, int count, int T,
                int32_t* tokens, int32_t* targets) {
  const uint64_t n = ds.size(split);
  const char* name = split == Split::Train ? "train" : "validation";
  if (n < static_cast<uint64_t>(T) + 1)
    throw std::runtime_error(std::string("the ") + name + " split holds " + std::to_string(n) +
                             " tokens, fewer than one sequence of " + std::to_string(T + 1));
  const uint64_t span = n - static_cast<uint64_t>(T);  // valid starts: [0, span)
  const uint64_t stream = split == Split::Train ? 0x7472616eull : 0x76616cull;
  std::vector<uint32_t> seq(static_cast<size_t>(T) + 1);
  for (int s = 0; s < count; ++s) {
    uint64_t i = static_cast<uint64_t>(first + s);
    using math::splitmix64;
    uint64_t off = splitmix64(seed ^ splitmix64(stream ^ splitmix64(static_cast<uint64_t>(index) * 0x100000001b3ull + i))) % span;
    ds.copy(split, off, seq.size(), seq.data());
    for (int t = 0; t < T; ++t) {
      // Ids are < vocab_size (checked on reading, or against the model at train start).
      tokens[static_cast<size_t>(s) * T + t] = static_cast<int32_t>(seq[t]);
      targets[static_cast<size_t>(s) * T + t] = static_cast<int32_t>(seq[t + 1]);
    }
  }
}

}  // namespace shardtrain
