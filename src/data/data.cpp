// Byte tokenizer, token file writer/reader, deterministic batch sampling.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "shardtrain/data.h"
#include "shardtrain/files.h"

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
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
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

// prepare_token_file: src/data/prepare.cpp (the streaming writer).

namespace {
// Opens a token file; throws naming it if it is missing or a directory.
std::ifstream open_token_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::error_code ec;
  if (!f) throw std::runtime_error("cannot open token file '" + path + "' (make one with --mode prepare)");
  if (std::filesystem::is_directory(path, ec)) throw std::runtime_error("token file '" + path + "' is a directory");
  return f;
}

// Parses and checks the 64-byte header `b` of token file `path`, whose size is `size` bytes.
TokenFileHeader parse_header(const std::string& path, const char* b, uint64_t size) {
  auto fail = [&](const std::string& w) { throw std::runtime_error("token file '" + path + "': " + w); };
  if (size < 64) fail("shorter than its 64-byte header");
  if (std::memcmp(b, kMagic, 8) != 0) fail("bad magic (not a shardtrain token file)");
  auto p = reinterpret_cast<const unsigned char*>(b);
  TokenFileHeader h;
  h.version = get<uint32_t>(p + 8);
  if (h.version != 1) fail("unknown format version " + std::to_string(h.version));
  h.vocab_size = get<uint32_t>(p + 12);
  h.bos_id = get<uint32_t>(p + 16);
  h.eos_id = get<uint32_t>(p + 20);
  h.token_bytes = get<uint32_t>(p + 24);
  if (h.token_bytes != 2 && h.token_bytes != 4)
    fail("field 'bytes per token' (offset 24) is " + std::to_string(h.token_bytes) + "; supported: 2 (u16) or 4 (u32)");
  h.n_train = get<uint64_t>(p + 32);
  h.n_val = get<uint64_t>(p + 40);
  h.tokenizer = std::string(b + 48, strnlen(b + 48, 16));
  const uint64_t tb = h.token_bytes;
  const uint64_t payload = (size - 64) / tb;  // tokens the file can hold; compared without overflow
  if (h.n_train > payload || h.n_val > payload - h.n_train || size != 64 + tb * (h.n_train + h.n_val))
    fail("size " + std::to_string(size) + " bytes does not match header (" + std::to_string(h.n_train) +
         " train + " + std::to_string(h.n_val) + " val tokens)");
  return h;
}
}  // namespace

TokenFileHeader read_token_file_header(const std::string& path) {
  std::ifstream f = open_token_file(path);
  char b[64] = {};
  f.read(b, sizeof b);
  f.clear();
  f.seekg(0, std::ios::end);
  const auto size = f.tellg();
  if (size < 0) throw std::runtime_error("token file '" + path + "': cannot read its size");
  return parse_header(path, b, static_cast<uint64_t>(size));
}

TokenDataset::TokenDataset(const std::string& path) : path_(path) {
  std::ifstream f = open_token_file(path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string b = ss.str();
  auto fail = [&](const std::string& w) { throw std::runtime_error("token file '" + path + "': " + w); };
  h_ = parse_header(path, b.data(), b.size());
  auto p = reinterpret_cast<const unsigned char*>(b.data());
  crc32_ = crc32_update(0, p, b.size());
  train_.resize(h_.n_train);
  val_.resize(h_.n_val);
  const uint64_t tb = h_.token_bytes;
  auto token = [&](uint64_t i) {  // i-th token of the file
    const unsigned char* q = p + 64 + tb * i;
    return tb == 2 ? static_cast<uint32_t>(get<uint16_t>(q)) : get<uint32_t>(q);
  };
  for (uint64_t i = 0; i < h_.n_train; ++i) train_[i] = token(i);
  for (uint64_t i = 0; i < h_.n_val; ++i) val_[i] = token(h_.n_train + i);
  for (auto* v : {&train_, &val_})
    for (uint32_t t : *v)
      if (t >= h_.vocab_size) fail("token " + std::to_string(t) + " >= vocab_size " + std::to_string(h_.vocab_size));
}

void fill_batch(const TokenDataset& ds, Split split, uint64_t seed, int64_t index, int first, int count, int T,
                int32_t* tokens, int32_t* targets) {
  const auto& d = split == Split::Train ? ds.train() : ds.val();
  const char* name = split == Split::Train ? "train" : "validation";
  if (d.size() < static_cast<size_t>(T) + 1)
    throw std::runtime_error(std::string("the ") + name + " split holds " + std::to_string(d.size()) +
                             " tokens, fewer than one sequence of " + std::to_string(T + 1));
  const uint64_t span = d.size() - static_cast<uint64_t>(T);  // valid starts: [0, span)
  const uint64_t stream = split == Split::Train ? 0x7472616eull : 0x76616cull;
  for (int s = 0; s < count; ++s) {
    uint64_t i = static_cast<uint64_t>(first + s);
    uint64_t off = mix(seed ^ mix(stream ^ mix(static_cast<uint64_t>(index) * 0x100000001b3ull + i))) % span;
    for (int t = 0; t < T; ++t) {
      // Every token is < vocab_size (checked on reading), which the model's int vocab bounds.
      tokens[static_cast<size_t>(s) * T + t] = static_cast<int32_t>(d[off + t]);
      targets[static_cast<size_t>(s) * T + t] = static_cast<int32_t>(d[off + t + 1]);
    }
  }
}

}  // namespace shardtrain
