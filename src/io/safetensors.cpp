// safetensors I/O and the float conversions used by export.
#include "shardtrain/safetensors.h"

#include "shardtrain/bf16.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace shardtrain {
using json = nlohmann::ordered_json;

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
// A count from the header (a dimension, an offset): a JSON integer in [0, max], checked before any
// conversion (nlohmann's get<int64_t>() truncates 64.9, and converting 1e300 is undefined).
template <typename Fail>
uint64_t json_count(const json& d, const std::string& which, uint64_t max, Fail&& fail) {
  const std::string w = which + " (" + d.dump() + ")";
  if (d.is_number_float()) {
    const double x = d.get<double>();
    if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) > static_cast<double>(max))
      fail(w + " is out of range (" + (max == UINT64_MAX ? "2^64" : "2^63") + " or more)");
    fail(w + " is not an integer (a JSON integer, without fraction or exponent)");
  }
  if (!d.is_number_integer()) fail(w + " is not an integer");
  if (!d.is_number_unsigned() && d.get<int64_t>() < 0) fail(w + " is negative");
  if (d.get<uint64_t>() > max) fail(w + " is out of range (" + (max == UINT64_MAX ? "2^64" : "2^63") + " or more)");
  return d.get<uint64_t>();
}
}  // namespace

StFile read_safetensors_header(const std::string& path) {
  return read_safetensors_header(InputFile::open(path, "safetensors file"));
}

StFile read_safetensors_header(const InputFile& file) {
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
  std::string hs(n, '\0');
  file.read_at(hs.data(), n, 8);
  f.data_start = 8 + n;
  const uint64_t data_len = fsize - f.data_start;
  json h;
  if (const std::string nul = json_nul_problem(hs); !nul.empty()) fail("header is not valid JSON (" + nul + ")");
  try {
    h = json::parse(hs);
  } catch (const std::exception& e) {
    fail(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!h.is_object()) fail("header is not a JSON object");
  for (auto& [k, v] : h.items()) {
    if (k == "__metadata__") continue;
    StEntry e;
    e.name = k;
    try {
      std::string dt = v.at("dtype");
      if (dt == "F32") e.dtype = DType::F32;
      else if (dt == "BF16") e.dtype = DType::BF16;
      else if (dt == "F16") e.dtype = DType::F16;
      else fail("tensor '" + k + "' has unsupported dtype " + dt + " (F32, BF16, F16 are read)");
      const json& shape = v.at("shape");
      if (!shape.is_array()) fail("tensor '" + k + "': shape must be a list of integers, got " + shape.dump());
      for (size_t i = 0; i < shape.size(); ++i)
        e.shape.push_back(static_cast<int64_t>(
            json_count(shape[i], "tensor '" + k + "': dimension " + std::to_string(i) + " of its shape", INT64_MAX, fail)));
      const json& off = v.at("data_offsets");
      if (!off.is_array() || off.size() != 2) fail("tensor '" + k + "': data_offsets must have 2 entries");
      e.begin = json_count(off[0], "tensor '" + k + "': data_offsets[0]", UINT64_MAX, fail);
      e.end = json_count(off[1], "tensor '" + k + "': data_offsets[1]", UINT64_MAX, fail);
    } catch (const nlohmann::json::exception& ex) {
      fail("tensor '" + k + "': malformed entry (" + ex.what() + ")");
    }
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
    f.entries.push_back(e);
  }
  std::vector<StEntry> sorted = f.entries;
  std::sort(sorted.begin(), sorted.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  uint64_t pos = 0;
  for (auto& e : sorted) {
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
