// --mode prepare: text corpus -> token file (format version 2, docs/data-format.md), streaming.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/data/data.h"

namespace shardtrain {

struct PrepareOptions {
  std::vector<std::string> inputs;      // files, directories (recursive, sorted), globs: expand_inputs (tokenizer.h)
  std::string out;                      // the token file to write (atomically: "<out>.tmp", then renamed)
  double val_fraction = 0.1;            // the last floor(n * val_fraction) tokens are the validation split
  std::string tokenizer = "byte-level"; // load_tokenizer (tokenizer.h): byte-level | a .model file | a directory
  std::string text_field = "text";      // .jsonl inputs: the field holding each document's text
  size_t chunk_bytes = 1 << 20;         // bytes read at a time; a long document is cut into pieces of min(this, 16 KiB)
  bool progress = false;                // a progress line on stderr, refreshed at most twice a second
};

struct PrepareResult {
  TokenFileHeader header;      // as written (version 2)
  uint64_t documents = 0;      // documents framed (plain-text files + JSONL lines holding a document)
  uint64_t files = 0;          // input files read
  uint64_t input_bytes = 0;    // their bytes
  uint64_t metadata_bytes = 0; // J, the metadata JSON's bytes
  bool cut_documents = false;  // long documents were encoded in pieces (false: each document whole)
  double seconds = 0;          // wall time of the whole prepare
  int64_t peak_rss_bytes = 0;  // VmHWM of this process at the end (Linux; 0 elsewhere)
};

// Tokenizes the inputs and writes the token file, in constant memory (of the order of
// 8 x chunk_bytes, plus the tokenizer) whatever the corpus size:
//   * documents: each plain-text file is one document; each non-blank line of a `.jsonl` file is
//     one (the string field `text_field` of its JSON object); an empty text ("") is a document too;
//   * each document is written as BOS (when the tokenizer has one) + ids + EOS, documents in input order;
//   * a plain-text file is read chunk_bytes at a time; a document longer than that is encoded in
//     pieces cut where Tokenizer::is_cut allows, which gives exactly the ids of the whole document
//     (Tokenizer::cuttable). A tokenizer that is not cuttable, a document without such a cut point
//     (text without single spaces), and a JSONL line are held whole: memory then grows with the
//     largest one;
//   * pieces of a batch (about 4 MiB of text) are encoded in parallel (OpenMP threads), written in order;
//   * tokens are u16 when vocab_size <= 65536, else u32.
// Throws std::runtime_error naming the option and file: '--input' (missing, unreadable or empty
// file; bad JSONL line as "file:line: ..."), '--tokenizer' (load_tokenizer's error), '--out' (a
// directory, also an input, not writable), '--val-fraction' (outside (0, 1), or leaving a split
// with fewer than 2 tokens). On failure no file is left at `out` or "<out>.tmp" (an existing
// `out` is left as it was).
PrepareResult prepare_tokens(const PrepareOptions& o);

}  // namespace shardtrain
