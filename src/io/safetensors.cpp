// safetensors I/O and the float conversions used by export.
#include "shardtrain/io/safetensors.h"

#include "shardtrain/backend/bf16.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <tuple>

#include "shardtrain/runtime/json_input.h"

namespace shardtrain {
using json = nlohmann::ordered_json;  // the header written: keys in file order

const char* dtype_name(DType t) { return t == DType::F32 ? "F32" : t == DType::BF16 ? "BF16" : "F16"; }
size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
DType parse_export_dtype(const std::string& s) {
  if (s == "fp32") return DType::F32;
  if (s == "bf16") return DType::BF16;
  if (s == "fp16") return DType::F16;
  throw std::invalid_argument("option '--dtype' must be fp32, bf16 or fp16, got '" + s + "'");
}

// IEEE binary32 -> binary16, round to nearest even, subnormals and overflow handled.
uint16_t f32_to_f16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to 0 (2^-25 ties to even 0)
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(abs >> 23);  // bits of mant below the half's subnormal unit
    // value = mant * 2^(e-150); the half subnormal unit is 2^-24, so q = mant >> (126 - e).
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t e = (abs >> 23) - 127 + 15;
  uint32_t mant = abs & 0x7fffffu;
  uint32_t h = (e << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}
float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  if (e == 0) {
    if (m == 0) u = sign;
    else {  // subnormal: normalize
      int k = -1;
      do { ++k; m <<= 1; } while ((m & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(127 - 15 - k) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    u = sign | 0x7f800000u | (m << 13);
  } else {
    u = sign | ((e - 15 + 127) << 23) | (m << 13);
  }
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

uint64_t safetensors_data_bytes(const std::vector<StTensor>& ts, DType dt) {
  uint64_t n = 0;
  for (auto& t : ts) n += t.values.size() * dtype_size(dt);
  return n;
}

void write_safetensors(const std::string& path, const std::vector<StTensor>& ts, DType dt) {
  json h = json::object();
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t off = 0;
  for (auto& t : ts) {
    uint64_t bytes = t.values.size() * dtype_size(dt);
    h[t.name] = {{"dtype", dtype_name(dt)}, {"shape", t.shape}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  std::string hs = h.dump();
  while (hs.size() % 8 != 0) hs.push_back(' ');
  std::ofstream o(path, std::ios::binary | std::ios::trunc);
  if (!o) throw std::runtime_error("cannot write '" + path + "'");
  uint64_t n = hs.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  o.write(reinterpret_cast<const char*>(len), 8);
  o.write(hs.data(), static_cast<std::streamsize>(hs.size()));
  std::vector<char> buf;
  for (auto& t : ts) {
    buf.resize(t.values.size() * dtype_size(dt));
    for (size_t i = 0; i < t.values.size(); ++i) {
      if (dt == DType::F32) {
        std::memcpy(buf.data() + 4 * i, &t.values[i], 4);  // little-endian host (x86-64, aarch64)
      } else {
        uint16_t v = dt == DType::BF16 ? math::f32_to_bf16(t.values[i]).bits : f32_to_f16(t.values[i]);
        buf[2 * i] = static_cast<char>(v & 0xff);
        buf[2 * i + 1] = static_cast<char>(v >> 8);
      }
    }
    o.write(buf.data(), static_cast<std::streamsize>(buf.size()));
  }
  o.flush();
  if (!o) throw std::runtime_error("write failed for '" + path + "' (disk full?)");
}

namespace {
const char* range_text(uint64_t max) { return max == UINT64_MAX ? "2^64" : "2^63"; }

// Builds the tensor table from the header's JSON events (scan_json), keeping only the table:
// memory proportional to the number of tensors, none for __metadata__ or keys that are skipped.
// The structure is the safetensors crate's (safetensors/src/tensor.rs, Metadata / TensorInfo):
// {"__metadata__": {string: string} (optional), NAME: {"dtype": string, "shape": [int...],
// "data_offsets": [int, int]}, ...}; other keys of an entry are ignored, as serde does there.
class HeaderTable {
 public:
  // Refusals are std::runtime_error(prefix + why); more than max_tensors entries are refused at
  // the first one past the limit, before it is stored.
  HeaderTable(std::string prefix, uint64_t max_tensors) : prefix_(std::move(prefix)), max_tensors_(max_tensors) {}
  std::vector<StEntry> entries;

  void null() { scalar("null"); }
  void boolean(bool v) { scalar(v ? "true" : "false"); }
  // Numbers as nlohmann::json dumps them in messages (1e300 as 1e+300), made only on a refusal.
  // A negative integer, or "-0" (non-negative ones come as number_unsigned), which serde refuses.
  void number_integer(int64_t v) { number([v] { return v == 0 ? std::string("-0") : nlohmann::json(v).dump(); }, true, false, 0, 0); }
  void number_unsigned(uint64_t v) { number([v] { return nlohmann::json(v).dump(); }, false, false, v, 0); }
  void number_float(double v, const std::string&) { number([v] { return nlohmann::json(v).dump(); }, false, true, 0, v); }
  void string(std::string& s) {
    if (skipped_scalar()) return;
    if (depth_ == 0) top_not_object();
    if (depth_ == 2 && in_meta_) return;  // a metadata value: a string, as it must be
    if (depth_ == 2 && field_ == Field::Dtype) {
      have_dtype_ = true;
      if (s == "F32") cur_.dtype = DType::F32;
      else if (s == "BF16") cur_.dtype = DType::BF16;
      else if (s == "F16") cur_.dtype = DType::F16;
      else fail("tensor '" + cur_.name + "' has unsupported dtype " + s + " (F32, BF16, F16 are read)");
      return;
    }
    not_expected(nlohmann::json(s).dump());
  }
  void key(std::string& k) {
    if (skip_ > 0) return;
    if (depth_ == 1) {
      name_ = std::move(k);
      return;
    }
    if (in_meta_) {  // depth 2 of __metadata__
      meta_key_ = std::move(k);
      return;
    }
    field_ = k == "dtype" ? Field::Dtype : k == "shape" ? Field::Shape : k == "data_offsets" ? Field::Offsets : Field::Other;
    // A field given twice is refused, as serde refuses it in the safetensors crate ("duplicate field").
    if ((field_ == Field::Dtype && have_dtype_) || (field_ == Field::Shape && have_shape_) ||
        (field_ == Field::Offsets && have_offsets_))
      fail("tensor '" + cur_.name + "': key '" + k + "' appears twice in its entry");
  }
  void start_object() {
    if (skip_ > 0) return ++skip_, void();
    if (opens_skipped()) return;
    if (depth_ == 0) {
      depth_ = 1;
      return;
    }
    if (depth_ == 1) {
      depth_ = 2;
      in_meta_ = name_ == "__metadata__";
      if (in_meta_) seen_meta();
      else begin_entry();
      return;
    }
    not_expected("an object");
  }
  void end_object() {
    if (skip_ > 0) {
      --skip_;
      return;
    }
    if (depth_ == 2 && !in_meta_) end_entry();
    in_meta_ = false;
    --depth_;
  }
  void start_array() {
    if (skip_ > 0) return ++skip_, void();
    if (opens_skipped()) return;
    if (depth_ == 0) top_not_object();
    if (depth_ == 2 && !in_meta_ && (field_ == Field::Shape || field_ == Field::Offsets)) {
      depth_ = 3;
      if (field_ == Field::Shape) {
        have_shape_ = true;
        cur_.shape.clear();
      } else {
        n_offsets_ = 0;
      }
      return;
    }
    not_expected("an array");
  }
  void end_array() {
    if (skip_ > 0) {
      --skip_;
      return;
    }
    if (field_ == Field::Offsets && n_offsets_ != 2) bad_offsets();
    if (field_ == Field::Offsets) have_offsets_ = true;
    depth_ = 2;
  }

 private:
  enum class Field { Dtype, Shape, Offsets, Other };
  // A value of a key that is ignored (Field::Other inside an entry) opens a skipped subtree.
  bool opens_skipped() {
    if (depth_ == 2 && !in_meta_ && field_ == Field::Other) {
      skip_ = 1;
      return true;
    }
    return false;
  }
  bool skipped_scalar() const { return skip_ > 0 || (depth_ == 2 && !in_meta_ && field_ == Field::Other); }
  void scalar(const char* text) {
    if (skipped_scalar()) return;
    if (depth_ == 0) top_not_object();
    if (depth_ == 1 && name_ == "__metadata__" && std::string_view(text) == "null") return seen_meta();  // Option<..>: none
    not_expected(text);
  }
  template <class Text>
  void number(Text text, bool negative, bool is_float, uint64_t u, double x) {
    if (skipped_scalar()) return;
    if (depth_ == 0) top_not_object();
    if (depth_ != 3) not_expected(text());
    const bool shape = field_ == Field::Shape;
    const uint64_t max = shape ? INT64_MAX : UINT64_MAX;
    auto where = [&] {
      return "tensor '" + cur_.name + "': " +
             (shape ? "dimension " + std::to_string(cur_.shape.size()) + " of its shape"
                    : "data_offsets[" + std::to_string(n_offsets_) + "]") +
             " (" + text() + ")";
    };
    if (is_float) {
      if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) > static_cast<double>(max))
        fail(where() + " is out of range (" + range_text(max) + " or more)");
      fail(where() + " is not an integer (a JSON integer, without fraction or exponent)");
    }
    if (negative) fail(where() + " is negative");
    if (u > max) fail(where() + " is out of range (" + range_text(max) + " or more)");
    if (shape) {
      if (cur_.shape.size() == kMaxDims)
        fail("tensor '" + cur_.name + "': its shape has more than " + std::to_string(kMaxDims) + " dimensions");
      cur_.shape.push_back(static_cast<int64_t>(u));
    } else {
      if (n_offsets_ == 0) cur_.begin = u;
      else if (n_offsets_ == 1) cur_.end = u;
      if (++n_offsets_ > 2) bad_offsets();
    }
  }
  [[noreturn]] void not_expected(const std::string& what) {
    if (depth_ == 1) fail("tensor '" + name_ + "': malformed entry (" + what + ", not an object)");
    if (depth_ == 2 && in_meta_)
      fail("'__metadata__' entry '" + meta_key_ + "' is " + what + "; its values must be strings");
    if (depth_ == 2 && field_ == Field::Dtype) fail("tensor '" + cur_.name + "': dtype " + what + " is not a string");
    if (depth_ == 2 && field_ == Field::Shape)
      fail("tensor '" + cur_.name + "': shape must be a list of integers, got " + what);
    if (depth_ == 2 && field_ == Field::Offsets) bad_offsets();
    if (depth_ == 3 && field_ == Field::Shape)
      fail("tensor '" + cur_.name + "': dimension " + std::to_string(cur_.shape.size()) + " of its shape (" + what +
           ") is not an integer");
    if (depth_ == 3) fail("tensor '" + cur_.name + "': data_offsets[" + std::to_string(n_offsets_) + "] (" + what + ") is not an integer");
    fail("malformed header (" + what + ")");
  }
  void seen_meta() {
    if (have_meta_) fail("'__metadata__' appears twice in the header");
    have_meta_ = true;
  }
  [[noreturn]] void top_not_object() { fail("header is not a JSON object"); }
  [[noreturn]] void bad_offsets() { fail("tensor '" + cur_.name + "': data_offsets must have 2 entries"); }
  void begin_entry() {
    cur_ = StEntry{};
    cur_.name = name_;
    have_dtype_ = have_shape_ = have_offsets_ = false;
    field_ = Field::Other;
  }
  void end_entry() {
    for (auto [have, key] : {std::pair{have_dtype_, "dtype"}, std::pair{have_shape_, "shape"},
                             std::pair{have_offsets_, "data_offsets"}})
      if (!have) fail("tensor '" + cur_.name + "': malformed entry (key '" + key + "' not found)");
    if (entries.size() == max_tensors_)
      fail("holds more than " + std::to_string(max_tensors_) + " tensors, the most expected here (tensor '" +
           cur_.name + "' is one too many)");
    entries.push_back(std::move(cur_));
  }
  [[noreturn]] void fail(const std::string& w) const { throw std::runtime_error(prefix_ + w); }

  const std::string prefix_;
  const uint64_t max_tensors_;
  std::string meta_key_;  // the key at depth 2 of __metadata__
  uint32_t depth_ = 0;   // 1: the top object; 2: an entry or __metadata__; 3: a shape or data_offsets
  uint32_t skip_ = 0;    // open containers of an ignored key's value
  bool in_meta_ = false;
  std::string name_;     // the key at depth 1
  Field field_ = Field::Other;
  StEntry cur_;
  bool have_dtype_ = false, have_shape_ = false, have_offsets_ = false, have_meta_ = false;
  // Dimensions of one shape: PyTorch's own limit is 64; a longer list only costs memory (8 bytes a
  // dimension, beyond the header's bytes).
  static constexpr size_t kMaxDims = 64;
  int n_offsets_ = 0;
};
}  // namespace

StFile read_safetensors_header(const std::string& path, uint64_t max_tensors) {
  return read_safetensors_header(InputFile::open(path, "safetensors file"), max_tensors);
}

StFile read_safetensors_header(const InputFile& file, uint64_t max_tensors) {
  StFile f;
  f.path = file.path();
  f.file = std::make_shared<const InputFile>(file);
  const std::string& path = f.path;
  auto fail = [&](const std::string& w) { throw std::runtime_error("safetensors file '" + path + "': " + w); };
  const uint64_t fsize = file.size();
  if (fsize < 8) fail("shorter than its 8-byte header length");
  unsigned char len[8];
  file.read_at(len, 8, 0);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  if (n > fsize - 8)
    fail("header length " + std::to_string(n) + " bytes exceeds the file (" + std::to_string(fsize - 8) +
         " bytes after the 8-byte length)");
  if (n > kSafetensorsMaxHeader)
    fail("header length " + std::to_string(n) + " bytes exceeds the safetensors format's limit of " +
         std::to_string(kSafetensorsMaxHeader) + " bytes (MAX_HEADER_SIZE of the safetensors library)");
  f.data_start = 8 + n;
  const uint64_t data_len = fsize - f.data_start;
  {
    std::string hs(n, '\0');
    file.read_at(hs.data(), n, 8);
    HeaderTable table("safetensors file '" + path + "': ", max_tensors);
    try {
      scan_json(hs, json_limits::kSafetensorsHeader, table);
    } catch (const JsonError& e) {
      fail(std::string("header: ") + e.what());
    }
    f.entries = std::move(table.entries);
  }
  for (const StEntry& e : f.entries) {
    const std::string& k = e.name;
    // Elements and bytes with overflow checks: [2^62, 4] must not wrap to 0 bytes.
    uint64_t numel = 1, bytes = 0;
    for (auto d : e.shape) {
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel))
        fail("tensor '" + k + "': the element count of its shape overflows 64 bits");
    }
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(e.dtype)), &bytes))
      fail("tensor '" + k + "': its shape of " + std::to_string(numel) + " elements of " + dtype_name(e.dtype) +
           " needs more than 2^64 bytes");
    if (e.end < e.begin || e.end > data_len)
      fail("tensor '" + k + "': data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
           ") are out of range (data buffer is " + std::to_string(data_len) + " bytes)");
    if (e.end - e.begin != bytes)
      fail("tensor '" + k + "': " + std::to_string(e.end - e.begin) + " bytes for shape of " + std::to_string(numel) +
           " elements of " + dtype_name(e.dtype));
  }
  // Names and offsets through sorted indices (N log N; the entries themselves are not copied).
  std::vector<uint32_t> order(f.entries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint32_t>(i);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return f.entries[a].name < f.entries[b].name; });
  for (size_t i = 1; i < order.size(); ++i)
    if (f.entries[order[i]].name == f.entries[order[i - 1]].name)
      fail("tensor '" + f.entries[order[i]].name + "' appears twice in the header");
  // By offset, an empty tensor before a non-empty one at the same offset (then by position).
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const StEntry &x = f.entries[a], &y = f.entries[b];
    return std::tuple(x.begin, x.end, a) < std::tuple(y.begin, y.end, b);
  });
  uint64_t pos = 0;
  for (uint32_t i : order) {
    const StEntry& e = f.entries[i];
    if (e.begin < pos) fail("tensor '" + e.name + "' overlaps the tensor before it (data_offsets " + std::to_string(e.begin) + ")");
    if (e.begin > pos) fail("gap in the data buffer before tensor '" + e.name + "'");
    pos = e.end;
  }
  if (pos != data_len) fail("the data buffer has " + std::to_string(data_len - pos) + " bytes not covered by any tensor");
  return f;
}

std::vector<float> read_safetensors_tensor(const StFile& f, const StEntry& e) {
  if (!f.file) throw std::logic_error("read_safetensors_tensor: '" + f.path + "' is not open");
  test_file_pause("read", f.path);
  std::vector<char> buf(e.end - e.begin);
  try {
    f.file->read_at(buf.data(), buf.size(), f.data_start + e.begin);
  } catch (const std::exception& ex) {
    throw std::runtime_error("safetensors file '" + f.path + "': cannot read tensor '" + e.name + "' (" + ex.what() + ")");
  }
  size_t n = buf.size() / dtype_size(e.dtype);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (e.dtype == DType::F32) {
      std::memcpy(&out[i], buf.data() + 4 * i, 4);
    } else {
      uint16_t v = static_cast<uint16_t>(static_cast<unsigned char>(buf[2 * i]) |
                                         (static_cast<unsigned char>(buf[2 * i + 1]) << 8));
      out[i] = e.dtype == DType::BF16 ? math::bf16_to_f32(bf16{v}) : f16_to_f32(v);
    }
  }
  return out;
}

}  // namespace shardtrain
