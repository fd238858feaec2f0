// shardtrain data layer: the byte-level tokenizer, the token file format, and the per-rank loader.
//
// Token data: shardtrain token files (versions 1 and 2), llm.c .bin shards and nanoGPT raw u16
// files, one or several, memory-mapped (docs/data-format.md).
//
// shardtrain token file layout (little-endian; documented in docs/data-format.md):
//   offset  size  field
//   0       8     magic "STTOKv1\0"
//   8       4     u32 format version (1, 2 or 3)
//   12      4     u32 vocab_size (258 for the byte tokenizer)
//   16      4     u32 bos_id (256)
//   20      4     u32 eos_id (257)
//   24      4     u32 bytes per token: 2 (tokens are u16) or 4 (u32, for ids above 65535)
//   28      4     u32 version 1: reserved (0); versions 2, 3: J, bytes of the metadata JSON
//   32      8     u64 n_train tokens
//   40      8     u64 n_val tokens
//   48      16    tokenizer name, NUL-padded ("byte-level")
//   64      b*n_train  train tokens, then b*n_val validation tokens (b = bytes per token)
//   then (versions 2, 3) J bytes of metadata JSON, then the tokenizer's files (version 3: and the
//   example starts, u64 each, and the role classes, one u8 per token, as the JSON places them; the
//   JSON also lists the ids of the end-of-turn tokens, examples.end_of_turn_ids)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardtrain {

// "No such id" in a token file header's bos_id / eos_id (a tokenizer without BOS, as GPT-2's).
inline constexpr uint32_t kNoTokenId = 0xFFFFFFFFu;

// Format version 3 (chat data, docs/data-format.md "Version 3"): the role class of each token, as
// scripts/tokenize_hf.py derives it from the model's chat template.
enum class RoleClass : uint8_t {
  Context = 0,    // system / user / tool turns, the template's markup, an assistant header
  Assistant = 1,  // assistant content
  EndOfTurn = 2,  // the end-of-turn token the template emits after an assistant message
};
inline constexpr uint8_t kRoleClasses = 3;

// The tokenizer a token file was made with (format version 2 metadata, docs/data-format.md): what
// export writes next to the model so that AutoTokenizer gives the ids training used.
struct TokenizerInfo {
  std::string kind = "byte-level";  // "byte-level" | "sentencepiece" | "hf-tokenizers" | "" (unknown: llm.c / nanoGPT data)
  uint32_t vocab_size = 0;          // ids of the data are < vocab_size
  int64_t bos_id = -1, eos_id = -1, pad_id = -1, unk_id = -1;  // -1: none
  bool add_bos = true;              // each document starts with bos_id (when there is one)
  bool add_eos = true;              // each document ends with eos_id
  // The tokenizer's files by name ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
  // "special_tokens_map.json"), and beside them the model's chat template ("chat_template.jinja") and
  // "generation_config.json", their exact bytes (check_carried_file checked the last two). Empty for
  // byte-level (export synthesizes it).
  std::map<std::string, std::string> files;
  // The ids of the end-of-turn tokens of chat data (format version 3: the distinct ids of the tokens
  // of role class EndOfTurn, ascending, e.g. <|im_end|>, <|eot_id|>; they may differ from eos_id).
  // Export adds them to generation_config.json's eos_token_id, so that generation stops at the end
  // of a turn. Empty for other data.
  std::vector<int64_t> end_of_turn_ids;
};

// The two files carried beside a tokenizer for chat models (TokenizerInfo::files), as they come
// from strangers (a Hugging Face directory, a token file, a checkpoint), are checked so:
//   chat_template.jinja     at most kMaxChatTemplateBytes bytes of UTF-8 (transformers reads the
//                           file as UTF-8 text);
//   generation_config.json  a JSON object within json_limits::kGenerationConfig whose bos_token_id
//                           and pad_token_id are absent, null or a token id, and eos_token_id also
//                           a non-empty list of token ids; a token id is an integer >= 0 and, when
//                           vocab_size > 0, below vocab_size.
// Any other name: nothing checked. Throws std::runtime_error "WHAT: REASON", e.g. "'D/generation_
// config.json': key 'eos_token_id' = [2,900]: id 900 is outside the vocabulary (vocab_size 600)".
inline constexpr uint64_t kMaxChatTemplateBytes = uint64_t{4} << 20;  // published templates: a few KB to ~60 KB
void check_carried_file(const std::string& name, const std::string& bytes, uint32_t vocab_size,
                        const std::string& what);

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

// Reads and checks only the 64-byte header of shardtrain token file `path` (and that the file's
// size matches it). Throws std::runtime_error naming the file, as TokenDataset does, for a missing
// or unreadable file, bad magic, unknown version, token size other than 2 or 4 (field "bytes per
// token"), size not matching.
TokenFileHeader read_token_file_header(const std::string& path);

// How the files given to --data / --val-data are read (option '--data-format'):
//   Auto        by magic: shardtrain ("STTOKv1\0") or llm.c (int32 20240520 / 20240801); a file
//               with neither is refused, suggesting '--data-format nanogpt'
//   Shardtrain  shardtrain token files only (versions 1 and 2, docs/data-format.md)
//   Llmc        llm.c .bin shards only: a header of 256 little-endian int32, [0] magic, [1] version,
//               [2] token count; magic 20240520 version 1: u16 tokens (GPT-2), magic 20240801
//               version 7: u32 tokens (Llama 3). Source: github.com/karpathy/llm.c,
//               dev/data/data_common.py (write_datafile) and llmc/dataloader.h (the size check).
//   NanoGPT     nanoGPT's train.bin / val.bin: raw u16 tokens, no header (data/*/prepare.py)
enum class DataFormat { Auto, Shardtrain, Llmc, NanoGPT };

// "auto" | "shardtrain" | "llmc" | "nanogpt" -> DataFormat; std::invalid_argument naming
// '--data-format' otherwise.
DataFormat parse_data_format(const std::string& s);

// The files named by `patterns` (values of `option`, e.g. "data"): each value holding a glob
// character (* ? [) is expanded with glob(3), sorted; other values are kept as given (a missing
// file is reported when opened). Throws std::runtime_error naming the option and the pattern if a
// pattern matches nothing.
std::vector<std::string> expand_data_paths(const std::vector<std::string>& patterns, const std::string& option);

// Which split of a dataset: the training stream or the validation stream.
enum class Split { Train, Val };

// One file of a TokenDataset, as read at open.
struct TokenFileEntry {
  std::string path;
  std::string format;        // "shardtrain v1", "shardtrain v2", "llm.c gpt-2 (u16)", "llm.c llama-3 (u32)", "nanogpt (u16)"
  uint64_t size = 0;         // bytes
  uint64_t data_offset = 0;  // byte offset of token 0 (64, 1024 or 0)
  uint32_t token_bytes = 2;  // 2 or 4
  uint64_t n_train = 0, n_val = 0;  // tokens; llm.c / nanoGPT files: all tokens are n_train
  uint32_t crc32 = 0;        // zlib CRC32 of the whole file
  uint32_t max_id = 0;       // the largest token id in the file ...
  uint64_t max_id_offset = 0;  // ... and the byte offset (in the file) of its first occurrence
  bool known_vocab = false;  // shardtrain files: the header gives vocab_size / bos / eos
  // Version 3: examples (the first `examples_train` are the training split) and where the arrays lie.
  uint64_t examples_train = 0, examples_val = 0;
  uint64_t roles_offset = 0;  // byte offset of the role classes (one u8 per token, train then val)
};

// A tokenized corpus over one or more files, memory-mapped read-only (MAP_SHARED): no token is
// copied onto the heap, so a corpus larger than memory costs page cache, not resident memory.
//
// Streams (global, concatenated in the order the files are given):
//   train  the training split of each shardtrain file of `train_files`, all tokens of each llm.c or
//          nanoGPT file;
//   val    all tokens (shardtrain: train + val split) of each of `val_files` if there are any, else
//          the validation split of each shardtrain file of `train_files` (possibly empty).
//
// Opening scans every file once with pread() in 4 MiB chunks (resident memory does not grow with
// the corpus): it computes the file's zlib CRC32 and its largest id, and for shardtrain files checks
// every id < the header's vocab_size; version 2 metadata is parsed and each tokenizer file's CRC32
// checked. Throws std::runtime_error naming the file (and the byte offset or field where it applies)
// for: a missing / unreadable / empty file, bad magic (suggesting '--data-format nanogpt' when no
// format is recognized), an unknown version, a token size other than 2 or 4, a header token count
// beyond or not matching the file size, an odd size for raw u16, an id >= vocab_size ("token N >=
// vocab_size V at byte offset O"), bad v2 metadata (JSON, kind / vocab / bos / eos disagreeing with
// the header, a tokenizer file outside the file area or with another CRC32, a chat_template.jinja or
// generation_config.json that check_carried_file refuses), bad version 3 examples (counts, array
// sizes and CRC32s, starts not 0 then strictly increasing, a validation split that does not begin at
// an example, a role class >= kRoleClasses, end_of_turn_ids that are not exactly the distinct ids
// of the end-of-turn tokens, ascending), version 3 files beside others, and
// shardtrain files that disagree on tokenizer / vocab_size / bos_id / eos_id. Ids of files without a vocabulary
// (llm.c, nanoGPT) are checked against the model's vocabulary at train start (max_id()).
class TokenDataset {
 public:
  explicit TokenDataset(const std::string& path, DataFormat format = DataFormat::Auto);
  TokenDataset(const std::vector<std::string>& train_files, const std::vector<std::string>& val_files,
               DataFormat format = DataFormat::Auto);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  // The dataset's header: vocab_size / bos_id / eos_id / tokenizer of its shardtrain files (all
  // agree), or vocab_size 0, bos_id = eos_id = kNoTokenId, tokenizer "" when no file has a
  // vocabulary; n_train / n_val = tokens of the train / val streams; token_bytes = the widest file's.
  const TokenFileHeader& header() const { return h_; }
  // The tokenizer: version 2 metadata (with its files' bytes), byte-level info for version 1,
  // kind "" and vocab_size 0 for llm.c / nanoGPT data. Its files are the first shardtrain file's;
  // end_of_turn_ids (version 3) the union of every file's, ascending.
  const TokenizerInfo& tokenizer() const { return tok_; }
  const std::string& path() const { return files_.front().path; }  // the first file
  const std::vector<TokenFileEntry>& files() const { return files_; }  // train files, then val files
  // zlib CRC32 of the concatenation of all files (train files, then val files) in order: for one
  // file, the file's CRC32. Ranks compare it; checkpoints record it.
  uint32_t crc32() const { return crc32_; }
  uint64_t size(Split s) const { return s == Split::Train ? h_.n_train : h_.n_val; }
  // Copies tokens [first, first + count) of stream `s` into out[0, count) (ids as u32), across file
  // boundaries. Throws std::out_of_range if first + count > size(s).
  void copy(Split s, uint64_t first, uint64_t count, uint32_t* out) const;
  // The largest id of all files, and where it first occurs: "file 'x' byte offset N".
  uint32_t max_id() const { return max_id_; }
  std::string max_id_where() const;

  // Format version 3 (every file; a dataset mixing it with other formats is refused at open): the
  // stream is a sequence of examples. example_starts(s): the stream offset of each example's first
  // token, strictly increasing, [0] = 0 (empty for an empty stream); example e is tokens
  // [starts[e], starts[e+1]) (the last ends at size(s)). Empty for versions 1, 2 and other formats.
  bool has_examples() const { return has_examples_; }
  const std::vector<uint64_t>& example_starts(Split s) const { return starts_[s == Split::Train ? 0 : 1]; }
  // Version 3: copies the role classes (RoleClass values) of tokens [first, first + count) of
  // stream `s`. Throws std::logic_error without examples, std::out_of_range as copy().
  void copy_roles(Split s, uint64_t first, uint64_t count, uint8_t* out) const;

 private:
  struct Segment {  // a run of tokens of one file in a stream
    size_t file;
    uint64_t first, count;  // in tokens of the file
  };
  // Calls f(segment, token index in the file, n) for each run of tokens [first, first + count) of
  // stream `s`, in order, across files; throws std::out_of_range naming `who` beyond the stream.
  template <typename F> void for_each_run(Split s, uint64_t first, uint64_t count, const char* who, F&& f) const;
  std::vector<TokenFileEntry> files_;
  std::vector<const unsigned char*> maps_;  // mmap of each file (nullptr for an empty file)
  std::vector<Segment> seg_[2];
  std::vector<uint64_t> start_[2];  // stream offset of each segment
  uint32_t crc32_ = 0, max_id_ = 0;
  size_t max_id_file_ = 0;
  bool has_examples_ = false;
  std::vector<uint64_t> starts_[2];  // version 3: example starts of each stream
  TokenFileHeader h_;
  TokenizerInfo tok_;
};

// Sequence `i` of global batch `index` starts at a pseudo-random offset that depends only on
// (seed, split, index, i): the global batch is the same at any world size, and rank r of W takes
// sequences [r*G/W, (r+1)*G/W).
// Fills tokens and targets ([count, T] row-major, targets shifted by one) with sequences
// [first, first+count) of global batch `index` of `split`. Throws std::runtime_error if the split
// holds fewer than T+1 tokens.
void fill_batch(const TokenDataset& ds, Split split, uint64_t seed, int64_t index, int first, int count, int T,
                int32_t* tokens, int32_t* targets);

// Document masking (--attention-mask document, model.h AttentionMask): the documents of packed
// sequences. Documents end AT the EOS: a token equal to `eos` is the last token of its document
// and the next token starts a new one; a row's first token starts a document too (a row that
// begins inside a document starts at position 0). For tokens [B, T] (row b at tokens + b * stride,
// stride >= T; fill_batch's tokens have stride T, whole sequences [B, T + 1] stride T + 1, of which
// the first T tokens are read), writes [B, T] row-major:
//   doc[b, t] = the number of EOS among tokens[b, 0 .. t-1]  (0, 1, ... along the row)
//   pos[b, t] = t minus the index of the first token of t's document  (0 at each document's start)
// the inputs of LlamaModel's TokenLayout. Pure; throws std::invalid_argument when B < 0, T < 0 or
// stride < T.
void document_layout(const int32_t* tokens, int B, int T, int64_t stride, int32_t eos, int32_t* doc, int32_t* pos);

}  // namespace shardtrain
