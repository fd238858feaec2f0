// shardtrain data layer: the byte-level tokenizer, the token file format, and the per-rank loader.
//
// Token file layout (little-endian; documented in docs/data-format.md):
//   offset  size  field
//   0       8     magic "STTOKv1\0"
//   8       4     u32 format version (1)
//   12      4     u32 vocab_size (258 for the byte tokenizer)
//   16      4     u32 bos_id (256)
//   20      4     u32 eos_id (257)
//   24      4     u32 bytes per token: 2 (tokens are u16) or 4 (u32, for ids above 65535)
//   28      4     u32 reserved (0)
//   32      8     u64 n_train tokens
//   40      8     u64 n_val tokens
//   48      16    tokenizer name, NUL-padded ("byte-level")
//   64      b*n_train  train tokens, then b*n_val validation tokens (b = bytes per token)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardtrain {

// "No such id" in a token file header's bos_id / eos_id (a tokenizer without BOS, as GPT-2's).
inline constexpr uint32_t kNoTokenId = 0xFFFFFFFFu;

// The tokenizer a token file was made with (format version 2 metadata, docs/data-format.md): what
// export writes next to the model so that AutoTokenizer gives the ids training used.
struct TokenizerInfo {
  std::string kind = "byte-level";  // "byte-level" | "sentencepiece" | "hf-tokenizers" | "" (unknown: llm.c / nanoGPT data)
  uint32_t vocab_size = 0;          // ids of the data are < vocab_size
  int64_t bos_id = -1, eos_id = -1, pad_id = -1, unk_id = -1;  // -1: none
  bool add_bos = true;              // each document starts with bos_id (when there is one)
  bool add_eos = true;              // each document ends with eos_id
  // The tokenizer's files by name ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
  // "special_tokens_map.json"), their exact bytes. Empty for byte-level (export synthesizes it).
  std::map<std::string, std::string> files;
};

// Byte-level tokenizer: ids 0-255 are the bytes of UTF-8 text, BOS = 256, EOS = 257.
struct ByteTokenizer {
  static constexpr int kBos = 256;
  static constexpr int kEos = 257;
  static constexpr int kVocab = 258;
  static std::vector<int32_t> encode(const std::string& text);  // bytes only, no BOS/EOS
  static std::string decode(const std::vector<int32_t>& ids);   // BOS/EOS and ids > 255 dropped
};

struct TokenFileHeader {
  uint32_t version = 1, vocab_size = ByteTokenizer::kVocab, bos_id = ByteTokenizer::kBos,
           eos_id = ByteTokenizer::kEos, token_bytes = 2;
  uint64_t n_train = 0, n_val = 0;
  std::string tokenizer = "byte-level";
};

// prepare_tokens (prepare.h) with the byte-level tokenizer: each input file one document,
// BOS + bytes + EOS, the last `val_fraction` of tokens (rounded down) the validation split, written
// as format version 2 (u16 tokens). Throws as prepare_tokens. Returns the header written.
TokenFileHeader prepare_token_file(const std::vector<std::string>& inputs, const std::string& out_path,
                                   double val_fraction);

// Reads and checks only the 64-byte header of token file `path` (and that the file's size matches
// it). Throws std::runtime_error naming the file, as TokenDataset does, for a missing or
// unreadable file, bad magic, unknown version, token size other than 2 or 4 (field "bytes per
// token"), size not matching.
TokenFileHeader read_token_file_header(const std::string& path);

// A token file held in memory, u16 or u32 tokens alike, as u32.
class TokenDataset {
 public:
  // Reads and checks `path`. Throws std::runtime_error naming the file for: missing file, bad
  // magic, unknown version, size not matching the header, tokens >= vocab_size.
  explicit TokenDataset(const std::string& path);
  const TokenFileHeader& header() const { return h_; }
  const std::string& path() const { return path_; }  // as given to the constructor
  uint32_t crc32() const { return crc32_; }  // zlib CRC32 of the whole file: ranks compare it
  const std::vector<uint32_t>& train() const { return train_; }
  const std::vector<uint32_t>& val() const { return val_; }

 private:
  std::string path_;
  uint32_t crc32_ = 0;
  TokenFileHeader h_;
  std::vector<uint32_t> train_, val_;
};

// Which batch of which split. Sequence `i` of global batch `index` starts at a pseudo-random
// offset that depends only on (seed, stream, index, i): the global batch is the same at any world
// size, and rank r of W takes sequences [r*G/W, (r+1)*G/W).
enum class Split { Train, Val };

// Fills tokens and targets ([count, T] row-major, targets shifted by one) with sequences
// [first, first+count) of global batch `index` of `split`. Throws std::runtime_error if the split
// holds fewer than T+1 tokens.
void fill_batch(const TokenDataset& ds, Split split, uint64_t seed, int64_t index, int first, int count, int T,
                int32_t* tokens, int32_t* targets);

}  // namespace shardtrain
