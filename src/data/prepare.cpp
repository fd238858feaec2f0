// --mode prepare: streaming tokenization of a corpus into a version-2 token file.
#include "shardtrain/data/prepare.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "shardtrain/runtime/files.h"
#include "shardtrain/runtime/process_stats.h"  // peak_rss_bytes
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/runtime/version.h"  // kProgramVersion
#include "text_inputs.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {
constexpr char kMagic[8] = {'S', 'T', 'T', 'O', 'K', 'v', '1', '\0'};
using Clock = std::chrono::steady_clock;

template <typename U> void put(std::string& b, U v) {
  for (size_t i = 0; i < sizeof(U); ++i) b.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}

// "<out>.tmp", written sequentially, then patched and renamed over `out`; removed unless published.
class TempFile {
 public:
  explicit TempFile(std::string out) : out_(std::move(out)), tmp_(out_ + ".tmp") {
    f_ = std::fopen(tmp_.c_str(), "wb");
    if (!f_)
      throw std::runtime_error("cannot write '" + tmp_ + "' (option '--out'): " + std::strerror(errno) +
                               (errno == ENOENT ? " (its directory does not exist: create it first)" : ""));
  }
  ~TempFile() {
    if (f_) std::fclose(f_);
    if (!published_) std::remove(tmp_.c_str());
  }
  void write(const void* p, size_t n) {
    if (n && std::fwrite(p, 1, n, f_) != n) fail("write failed");
  }
  void write(const std::string& s) { write(s.data(), s.size()); }
  void patch(const std::string& s) {
    if (std::fseek(f_, 0, SEEK_SET) != 0) fail("seek failed");
    write(s);
  }
  void publish() {
    FILE* f = f_;
    f_ = nullptr;
    if (std::fflush(f) != 0 || std::ferror(f)) {
      std::fclose(f);
      fail("write failed");
    }
    if (std::fclose(f) != 0) fail("close failed");
    std::error_code ec;
    fs::rename(tmp_, out_, ec);
    if (ec) fail("cannot rename it to '" + out_ + "': " + ec.message());
    published_ = true;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error("option '--out': '" + tmp_ + "': " + what + " (" + std::strerror(errno) + ")");
  }
  std::string out_, tmp_;
  FILE* f_ = nullptr;
  bool published_ = false;
};

// A piece of a document: the whole of it, its start, a continuation, or its end.
struct Segment {
  std::string text;
  bool first = true;  // starts the document: encoded with encode() and preceded by BOS
  bool last = true;   // ends the document: followed by EOS
};

// Collects segments, encodes a batch of them in parallel and writes their ids in order.
class Encoder {
 public:
  Encoder(const Tokenizer& tok, TempFile& out, uint32_t token_bytes, size_t batch_bytes)
      : tok_(tok), out_(out), tb_(token_bytes), batch_bytes_(batch_bytes) {}
  void add(Segment s) {
    bytes_ += s.text.size();
    batch_.push_back(std::move(s));
    if (bytes_ >= batch_bytes_) flush();
  }
  void flush() {
    buf_.reserve(static_cast<size_t>(tb_) * (bytes_ + 2 * batch_.size()));
    const int64_t n = static_cast<int64_t>(batch_.size());
    ids_.resize(batch_.size());
    errors_.assign(batch_.size(), std::string());
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int64_t i = 0; i < n; ++i) {
      try {
        const Segment& s = batch_[static_cast<size_t>(i)];
        ids_[static_cast<size_t>(i)] = s.first ? tok_.encode(s.text) : tok_.encode_continuation(s.text);
      } catch (const std::exception& e) {
        errors_[static_cast<size_t>(i)] = e.what();
      }
    }
    for (const std::string& e : errors_)
      if (!e.empty()) throw std::runtime_error(e);
    for (size_t i = 0; i < batch_.size(); ++i) {
      if (batch_[i].first && tok_.bos_id() >= 0) emit(static_cast<uint32_t>(tok_.bos_id()));
      for (int32_t id : ids_[i]) emit(static_cast<uint32_t>(id));
      if (batch_[i].last) emit(static_cast<uint32_t>(tok_.eos_id())), ++documents;
    }
    batch_.clear();
    ids_.clear();
    bytes_ = 0;
    out_.write(buf_);
    buf_.clear();
  }
  uint64_t tokens = 0, documents = 0;

 private:
  void emit(uint32_t id) {
    if (tb_ == 2) put<uint16_t>(buf_, static_cast<uint16_t>(id));
    else put<uint32_t>(buf_, id);
    ++tokens;
  }
  const Tokenizer& tok_;
  TempFile& out_;
  uint32_t tb_;
  size_t batch_bytes_, bytes_ = 0;
  std::vector<Segment> batch_;
  std::vector<std::vector<int32_t>> ids_;
  std::vector<std::string> errors_;
  std::string buf_;
};

// Pieces a document is encoded in: libsentencepiece's BPE encoder takes ~250 bytes of memory per
// input byte and slows down on long inputs (1 MiB pieces: 0.6 MB/s, 270 MB peak; 16 KiB: 1.9 MB/s,
// 46 MB, the same ids), so pieces are smaller than the read chunk.
constexpr size_t kPieceBytes = 16 << 10;

// Cuts the text of one document, as it arrives, into pieces of about `chunk` bytes at the
// tokenizer's exact cut points, and hands them to the encoder.
class DocumentSplitter {
 public:
  DocumentSplitter(const Tokenizer& tok, Encoder& enc, size_t chunk) : tok_(tok), enc_(enc), chunk_(chunk) {}
  void append(std::string_view s) {
    buf_.append(s);
    if (!tok_.cuttable()) return;
    while (buf_.size() > chunk_) {
      const size_t cut = find_cut();
      if (cut == std::string::npos) break;
      enc_.add(Segment{buf_.substr(0, cut), first_, false});
      first_ = false;
      buf_.erase(0, cut);
      checked_ = 0;
    }
  }
  void finish() {
    enc_.add(Segment{std::move(buf_), first_, true});
    buf_.clear();
    first_ = true;
    checked_ = 0;
  }

 private:
  // The last cut at or before chunk_, else the first one after it; npos if the buffer has none
  // (positions [1, checked_) are known to have none).
  size_t find_cut() {
    const size_t lo = std::max<size_t>(1, checked_);
    const size_t hi = std::min(chunk_, buf_.size() - 1);
    for (size_t i = hi; i >= lo && i <= hi; --i)
      if (tok_.is_cut(buf_, i)) return i;
    for (size_t i = std::max(hi + 1, lo); i + 1 < buf_.size(); ++i)
      if (tok_.is_cut(buf_, i)) return i;
    checked_ = buf_.size() - 1;  // is_cut(size - 1) needs the next byte
    return std::string::npos;
  }
  const Tokenizer& tok_;
  Encoder& enc_;
  size_t chunk_;
  std::string buf_;
  bool first_ = true;
  size_t checked_ = 0;
};

class Progress {
 public:
  Progress(bool on, uint64_t total) : on_(on), total_(total), t0_(Clock::now()), last_(t0_) {}
  void update(uint64_t done, uint64_t tokens, bool force = false) {
    if (!on_) return;
    const auto now = Clock::now();
    if (!force && now - last_ < std::chrono::milliseconds(500)) return;
    last_ = now;
    const double s = std::max(1e-9, std::chrono::duration<double>(now - t0_).count());
    const double rate = static_cast<double>(done) / s;
    const double eta = rate > 0 ? static_cast<double>(total_ - std::min(done, total_)) / rate : 0;
    std::fprintf(stderr, "\rprepare: %.1f / %.1f MB, %.1f MB/s, %.3g tokens/s, ETA %.0f s   ", done / 1e6, total_ / 1e6,
                 rate / 1e6, static_cast<double>(tokens) / s, eta);
    std::fflush(stderr);
    shown_ = true;
  }
  void end() {
    if (shown_) std::fprintf(stderr, "\n");
  }

 private:
  bool on_, shown_ = false;
  uint64_t total_;
  Clock::time_point t0_, last_;
};

std::string fmt_fraction(double v) { return (std::ostringstream() << v).str(); }

// Checks the output path (not the tokenizer, not an input) and every input (a non-empty regular text
// file, not a token file); returns the inputs' total size in bytes. Throws std::runtime_error
// naming the option.
uint64_t check_prepare_paths(const PrepareOptions& o, const std::vector<std::string>& files) {
  uint64_t total = 0;
  std::error_code ec;
  check_output_path(o.out, "option '--out'");
  for (const std::string& name : {std::string(), std::string("tokenizer.model"), std::string("tokenizer_config.json"),
                                  std::string("special_tokens_map.json"), std::string("chat_template.jinja"),
                                  std::string("generation_config.json")})
    if (o.tokenizer != "byte-level" && fs::equivalent(name.empty() ? fs::path(o.tokenizer) : fs::path(o.tokenizer) / name, o.out, ec))
      throw std::runtime_error("option '--out': '" + o.out + "' is the tokenizer (option '--tokenizer'); refusing to overwrite it");
  for (const auto& in : files) {
    // Checked on the descriptor (a regular file, opened without blocking), then read through it.
    const InputFile file = detail::open_input_text(in);
    std::ifstream f(file.reopen_path(), std::ios::binary);
    if (!f) throw std::runtime_error("cannot read input text '" + in + "' (option '--input')");
    const uint64_t size = file.size();
    if (size == 0) throw std::runtime_error("input text '" + in + "' is empty");
    char magic[8] = {};
    if (f.read(magic, 8) && std::string(magic, 7) == "STTOKv1")
      throw std::runtime_error("input '" + in + "' is a shardtrain token file, not text (option '--input'; an "
                               "earlier --out inside an input directory?)");
    total += size;
    if (fs::equivalent(in, o.out, ec))
      throw std::runtime_error("option '--out': '" + o.out + "' is also an input; refusing to overwrite it");
  }
  return total;
}

// Reads the inputs in order, in chunks of o.chunk_bytes (JSONL: a document per line), into the
// splitter; returns the bytes read and counts the files in r.files.
uint64_t encode_inputs(const PrepareOptions& o, const std::vector<std::string>& files, DocumentSplitter& split,
                       Encoder& enc, Progress& progress, PrepareResult& r) {
  uint64_t done = 0;
  std::vector<char> chunk(o.chunk_bytes);
  for (const std::string& path : files) {
    const InputFile file = detail::open_input_text(path);  // (checked again: the name may have changed)
    std::ifstream f(file.reopen_path(), std::ios::binary);
    if (!f) throw std::runtime_error("cannot read input text '" + path + "' (option '--input')");
    ++r.files;
    if (detail::is_jsonl(path)) {
      std::string line;
      for (uint64_t lineno = 1; detail::read_jsonl_line(f, line, path, lineno); ++lineno) {
        done += line.size() + 1;
        if (detail::is_blank_line(line)) continue;
        split.append(detail::jsonl_text(line, o.text_field, path, lineno));
        split.finish();
        progress.update(done, enc.tokens);
      }
    } else {
      while (f) {
        f.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
        const auto n = static_cast<size_t>(f.gcount());
        if (n == 0) break;
        done += n;
        split.append(std::string_view(chunk.data(), n));
        progress.update(done, enc.tokens);
      }
      split.finish();
    }
    if (f.bad()) throw std::runtime_error("error reading input text '" + path + "' (option '--input')");
  }
  return done;
}

// The token file's metadata JSON (docs/data-format.md): the tokenizer with its files' offsets,
// sizes and CRC32s, the document and input counts, the writing program.
std::string token_file_metadata(const TokenizerInfo& info, const PrepareResult& r) {
  nlohmann::ordered_json files_json = nlohmann::ordered_json::object();
  uint64_t offset = 0;
  for (const auto& [name, bytes] : info.files) {
    files_json[name] = {{"offset", offset}, {"bytes", bytes.size()}, {"crc32", crc32_update(0, bytes.data(), bytes.size())}};
    offset += bytes.size();
  }
  auto id = [](int64_t v) { return v >= 0 ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
  nlohmann::ordered_json meta = {
      {"format", "shardtrain-tokens"},
      {"tokenizer",
       {{"kind", info.kind},
        {"vocab_size", info.vocab_size},
        {"bos_id", id(info.bos_id)},
        {"eos_id", id(info.eos_id)},
        {"pad_id", id(info.pad_id)},
        {"unk_id", id(info.unk_id)},
        {"add_bos", info.bos_id >= 0},
        {"add_eos", true},
        {"files", files_json}}},
      {"documents", r.documents},
      {"inputs", r.files},
      {"written_by", std::string(kProgramVersion) + " --mode prepare"},
  };
  return meta.dump(2) + "\n";
}

// The token file's 64-byte header (data.h) for a metadata JSON of json_bytes bytes.
std::string token_file_header_bytes(const TokenFileHeader& h, size_t json_bytes) {
  std::string b(kMagic, 8);
  put<uint32_t>(b, h.version);
  put<uint32_t>(b, h.vocab_size);
  put<uint32_t>(b, h.bos_id);
  put<uint32_t>(b, h.eos_id);
  put<uint32_t>(b, h.token_bytes);
  put<uint32_t>(b, static_cast<uint32_t>(json_bytes));
  put<uint64_t>(b, h.n_train);
  put<uint64_t>(b, h.n_val);
  std::string name = h.tokenizer;
  name.resize(16, '\0');
  b += name;
  return b;
}

}  // namespace

PrepareResult prepare_tokens(const PrepareOptions& o) {
  const auto t0 = Clock::now();
  if (!(o.val_fraction > 0 && o.val_fraction < 1))
    throw std::runtime_error("option '--val-fraction' must be in (0, 1), got " + std::to_string(o.val_fraction));
  if (o.inputs.empty()) throw std::runtime_error("option '--input' names no file");
  if (o.chunk_bytes < 2) throw std::runtime_error("prepare: chunk size must be at least 2 bytes");
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = load_tokenizer(o.tokenizer);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("option '--tokenizer': ") + e.what());
  }
  const std::vector<std::string> files = expand_inputs(o.inputs);
  if (files.empty()) throw std::runtime_error("option '--input' names no file");
  const uint64_t total = check_prepare_paths(o, files);
  const TokenizerInfo& info = tok->info();
  PrepareResult r;
  TokenFileHeader& h = r.header;
  h.version = 2;
  h.vocab_size = info.vocab_size;
  h.bos_id = info.bos_id >= 0 ? static_cast<uint32_t>(info.bos_id) : kNoTokenId;
  h.eos_id = static_cast<uint32_t>(info.eos_id);
  h.token_bytes = info.vocab_size <= 65536 ? 2 : 4;
  h.tokenizer = info.kind;
  r.cut_documents = tok->cuttable();

  TempFile out(o.out);
  out.write(std::string(64, '\0'));  // the header, written last
  Encoder enc(*tok, out, h.token_bytes, std::max<size_t>(size_t{4} << 20, 2 * o.chunk_bytes));
  DocumentSplitter split(*tok, enc, std::min(o.chunk_bytes, kPieceBytes));
  Progress progress(o.progress, total);
  const uint64_t done = encode_inputs(o, files, split, enc, progress, r);
  enc.flush();
  progress.update(done, enc.tokens, true);
  progress.end();
  r.documents = enc.documents;
  r.input_bytes = done;

  const uint64_t n = enc.tokens;
  h.n_val = static_cast<uint64_t>(static_cast<double>(n) * o.val_fraction);
  h.n_train = n - h.n_val;
  if (h.n_val < 2 || h.n_train < 2)
    throw std::runtime_error("option '--val-fraction' " + fmt_fraction(o.val_fraction) + " leaves " +
                             std::to_string(h.n_train) + " train and " + std::to_string(h.n_val) +
                             " validation tokens; each split needs at least 2");

  const std::string js = token_file_metadata(info, r);
  if (js.size() > 0xFFFFFFFFull) throw std::runtime_error("prepare: metadata JSON too large");
  r.metadata_bytes = js.size();
  out.write(js);
  for (const auto& [name, bytes] : info.files) out.write(bytes);

  const std::string b = token_file_header_bytes(h, js.size());
  out.patch(b);
  out.publish();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.peak_rss_bytes = peak_rss_bytes();
  return r;
}

TokenFileHeader prepare_token_file(const std::vector<std::string>& inputs, const std::string& out_path,
                                   double val_fraction) {
  PrepareOptions o;
  o.inputs = inputs;
  o.out = out_path;
  o.val_fraction = val_fraction;
  return prepare_tokens(o).header;
}

}  // namespace shardtrain
