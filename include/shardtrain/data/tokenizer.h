// shardtrain tokenizers: text <-> token ids, for --mode prepare (encode a corpus), --mode generate
// (encode a prompt, decode the output) and export (TokenizerInfo: the files to write next to the model).
//
// Two kinds (docs/data-format.md, "Tokenizers"):
//   * byte-level: ids 0-255 are the bytes of the UTF-8 text, BOS 256, EOS 257 (ByteTokenizer, data.h);
//   * sentencepiece: a SentencePiece model (`tokenizer.model`, e.g. Llama 1/2's or one trained with
//     --mode tokenizer), run by libsentencepiece (https://github.com/google/sentencepiece), so the ids
//     are those of Python's `sentencepiece.SentencePieceProcessor(model_file=...).encode(text)`.
//
// Thread safety: every const member may be called from several threads at once (SentencePiece's
// Encode/Decode are const and keep no state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardtrain/data/data.h"

namespace shardtrain {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // What export writes and a token file records: kind, vocab_size, special ids (-1: none), and the
  // tokenizer's files (exact bytes; "tokenizer.model" for SentencePiece, empty for byte-level).
  const TokenizerInfo& info() const { return info_; }
  const std::string& kind() const { return info_.kind; }
  uint32_t vocab_size() const { return info_.vocab_size; }  // every id encode() returns is < vocab_size
  int64_t bos_id() const { return info_.bos_id; }  // -1: none
  int64_t eos_id() const { return info_.eos_id; }  // -1: none
  int64_t pad_id() const { return info_.pad_id; }  // -1: none
  int64_t unk_id() const { return info_.unk_id; }  // -1: none

  // The ids of `text` (UTF-8; invalid sequences are encoded as SentencePiece does, byte by byte with
  // byte fallback), WITHOUT BOS or EOS: frame documents yourself (prepare adds BOS + ids + EOS).
  // SentencePiece: exactly SentencePieceProcessor::Encode(text), so with add_dummy_prefix (Llama)
  // "Hello" is encoded as " Hello" would be at the start of a text. Throws std::runtime_error only
  // if the library reports an error.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;

  // The text of `ids`: control ids (BOS, EOS, pad) and ids outside [0, vocab_size) are dropped;
  // SentencePiece removes the dummy-prefix space of the first piece and joins byte-fallback bytes.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;

  // --- Encoding a long text in pieces (prepare's streaming) ---
  // True when a text may be cut at any position for which is_cut(text, i) holds, and
  //   encode(text) == encode(text[0, i)) ++ encode_continuation(text[i, end))
  // (applied repeatedly: a continuation may itself be cut again). False: encode each text whole.
  virtual bool cuttable() const = 0;
  // Whether a cut before byte i of `text` (0 < i < text.size()) is exact (see cuttable()). Needs
  // the bytes on both sides of i. Byte-level: every i. SentencePiece: text[i] is a single space
  // between two characters that are not spaces ("x y"), the start of a SentencePiece word.
  virtual bool is_cut(std::string_view text, size_t i) const = 0;
  // The ids of `piece` when it continues a text cut before it (it starts with the space of the
  // cut): no dummy prefix is added. Throws std::logic_error if `piece` does not start at a cut.
  virtual std::vector<int32_t> encode_continuation(std::string_view piece) const = 0;

 protected:
  TokenizerInfo info_;
};

// The tokenizer named by `spec`:
//   * "byte-level": the byte-level tokenizer (vocab 258);
//   * a file: a SentencePiece model (`*.model`), embedded as "tokenizer.model";
//   * a directory holding `tokenizer.model` (a Hugging Face Llama directory): that model, and its
//     tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
//     generation_config.json, when present, embedded too (as import carries them).
// Throws std::runtime_error naming `spec` for a missing path, a directory without tokenizer.model,
// a file that libsentencepiece cannot load, a model without EOS, or a chat_template.jinja /
// generation_config.json that data.h's check_carried_file refuses (naming the file).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

// The tokenizer a TokenizerInfo records (a checkpoint's group /tokenizer, a token file's metadata):
// byte-level, or SentencePiece from files["tokenizer.model"]; nullptr for other kinds
// ("hf-tokenizers": no C++ library here; "": unknown). The special ids are the recorded ones.
// Throws std::runtime_error naming `source` if tokenizer.model is missing or does not load.
std::unique_ptr<Tokenizer> tokenizer_from_info(const TokenizerInfo& info, const std::string& source);

// Checks a serialized SentencePiece model (ModelProto) for what libsentencepiece's loader does not,
// so that a model from a stranger cannot crash encode or decode: the precompiled_charsmap of its
// normalizer_spec and denormalizer_spec must be empty (identity: Llama's), or the library's own
// builtin table for the spec's name (nmt_nfkc, nfkc, nmt_nfkc_cf, nfkc_cf: T5's, mT5's), or
// otherwise (a custom table from normalization_rule_tsv) a trie that the library can walk on any
// input without reading outside the blob (every reachable node's children and every value inside
// it, every value a NUL-terminated string). Called by every load (load_tokenizer,
// tokenizer_from_info, import). Throws std::runtime_error starting with `where` and naming the
// field ("field 'normalizer_spec.precompiled_charsmap' ... has a trie node (unit N) whose children
// lie beyond its M units"), or saying the bytes are not a well-formed protobuf.
void check_sentencepiece_model(std::string_view model, const std::string& where);

// --mode tokenizer: trains a SentencePiece BPE model configured as Llama's tokenizer.model was
// (trainer_spec printed from Llama 2's model: BPE, byte_fallback, identity normalization,
// add_dummy_prefix, no whitespace removal, split_digits, allow_whitespace_only_pieces,
// split_by_whitespace, max_sentencepiece_length 16, max_sentence_length 4192, unk 0 / bos 1 /
// eos 2 / no pad), so that transformers' LlamaTokenizer(Fast) loaded from it gives the same ids.
struct TokenizerTrainOptions {
  std::vector<std::string> inputs;   // files, directories, globs (expand_inputs); .jsonl: one document a line
  std::string text_field = "text";  // .jsonl: the field holding the text
  int vocab_size = 0;               // >= 256 byte pieces + 3 specials + the corpus' characters kept
  std::string out;                  // the model file to write (atomically)
  double character_coverage = 0.99995;  // Llama's; the rest of the characters go through byte fallback
  uint64_t max_sentences = 2'000'000;   // sampled (shuffled) training sentences: bounds memory and time
};
struct TokenizerTrainResult {
  uint64_t sentences = 0;  // lines read (before SentencePiece's sampling)
  uint64_t bytes = 0;      // bytes of input files
  int vocab_size = 0;
  double seconds = 0;
};
// Every line of every input (plain text: each line of the file; .jsonl: each line of each
// document's text) is a training sentence; empty lines are skipped, and SentencePiece skips lines
// longer than 4192 bytes. Throws std::runtime_error naming the option: '--input' (missing,
// unreadable or empty file, bad JSON), '--vocab-size' (below 260, or too small or too large for
// the corpus: SentencePiece's message), '--out' (a directory, or not writable).
TokenizerTrainResult train_sentencepiece(const TokenizerTrainOptions& o);

// The input files named by `specs`, in order: a file as is; a directory: its regular files,
// recursively, sorted by path, hidden ones (name starting with '.') left out; otherwise a glob
// pattern (glob(3), sorted; directories it matches are expanded as above). Throws
// std::runtime_error naming `option` and the spec for a spec that names nothing (the message
// "cannot read input text '<spec>' (option '--input')" for a missing file).
std::vector<std::string> expand_inputs(const std::vector<std::string>& specs, const std::string& option = "--input");

}  // namespace shardtrain
