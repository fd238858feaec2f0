// Internal to src/data: the reading of text inputs shared by --mode tokenizer (tokenizer.cpp) and
// --mode prepare (prepare.cpp).
#pragma once

#include <cstdint>
#include <istream>
#include <string>

#include "shardtrain/runtime/files.h"

namespace shardtrain::detail {

// True for a JSON Lines input (one document per line): the name ends with ".jsonl".
bool is_jsonl(const std::string& path);

// The document of JSON Lines line `line` (1-based number `lineno` of file `path`): the string
// value of field `field` of the JSON object on the line. Throws std::runtime_error
// "<path>:<lineno>: ..." for invalid JSON, a value that is not an object, a missing field or a
// field that is not a string; a chat or prompt/completion record ("messages"; "prompt" and
// "completion") without the field is refused naming scripts/tokenize_hf.py.
std::string jsonl_text(const std::string& line, const std::string& field, const std::string& path, uint64_t lineno);

// The next line of JSON Lines file `path` from `in` into `line` (without its '\n'); false at the
// end of the input. A line is read up to json_limits::kJsonlLine.max_bytes and no further: a longer
// one is refused (std::runtime_error "<path>:<lineno>: a line longer than N bytes ..."), so a file
// without line ends cannot make us hold all of it. `lineno` is the number the line will have.
bool read_jsonl_line(std::istream& in, std::string& line, const std::string& path, uint64_t lineno);

// True for a line of a JSON Lines file that holds no document (empty or only spaces, tabs, CR):
// skipped, as most JSONL readers do with a trailing blank line.
bool is_blank_line(const std::string& line);

// Input text `path` of option '--input', opened and checked on its descriptor (files.h InputFile):
// "cannot read input text 'P' (option '--input'): no such file" when it is gone, "input text 'P' is
// not a regular file (a FIFO) ... (option '--input')" for a FIFO, device, socket or directory.
InputFile open_input_text(const std::string& path);

}  // namespace shardtrain::detail
