// TensorBoard event files (tensorboard.h): TFRecord framing with masked CRC32C, and the Event /
// Summary / SessionLog messages encoded by hand (protobuf wire format: varint, fixed64, fixed32,
// length-delimited).
#include "shardtrain/io/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace shardtrain {

namespace {
const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> a{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      a[i] = c;
    }
    return a;
  }();
  return t;
}

// Protobuf wire format. Key = field number << 3 | wire type (0 varint, 1 fixed64, 2 length-delimited,
// 5 fixed32).
void put_varint(std::string& o, uint64_t v) {
  while (v >= 0x80) {
    o.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  o.push_back(static_cast<char>(v));
}
void put_key(std::string& o, int field, int wire) { put_varint(o, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire)); }
template <typename T> void put_le(std::string& o, T v) {  // x86-64 and every target here: little endian
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  o.append(b, sizeof(T));
}
void put_bytes(std::string& o, int field, const std::string& s) {
  put_key(o, field, 2);
  put_varint(o, s.size());
  o += s;
}
// Event's common head: wall_time (1, double) and step (2, int64 as a varint of its two's complement).
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_le(e, wall_time);
  if (step != 0) {
    put_key(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

const char kPrefix[] = "events.out.tfevents.";
}  // namespace

uint32_t crc32c_update(uint32_t crc, const void* p, size_t n) {
  const auto& t = crc32c_table();
  const auto* b = static_cast<const unsigned char*>(p);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ b[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t tfrecord_masked_crc(const void* p, size_t n) {
  const uint32_t c = crc32c_update(0, p, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(const std::string& data) {
  std::string r;
  put_le(r, static_cast<uint64_t>(data.size()));
  put_le(r, tfrecord_masked_crc(r.data(), 8));
  r += data;
  put_le(r, tfrecord_masked_crc(data.data(), data.size()));
  return r;
}

std::string tb_event_file_version(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  std::string meta;
  put_bytes(meta, 1, "shardtrain");
  put_bytes(e, 10, meta);  // source_metadata { writer }
  return e;
}

std::string tb_event_start(double wall_time, int64_t step) {
  std::string e = event_head(wall_time, step), log;
  put_key(log, 1, 0);  // SessionLog.status = START (1)
  put_varint(log, 1);
  put_bytes(e, 7, log);
  return e;
}

std::string tb_event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (auto& [tag, v] : values) {
    std::string val;
    put_bytes(val, 1, tag);
    put_key(val, 2, 5);
    put_le(val, v);
    put_bytes(summary, 1, val);  // Summary.value (repeated)
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string tensorboard_tag(const std::string& key) {
  if (key == "step") return "";
  if (key == "loss") return "train/loss";
  if (key.rfind("val_", 0) == 0) return "val/" + key.substr(4);
  auto ends = [&](const char* s) {
    const size_t n = std::strlen(s);
    return key.size() >= n && key.compare(key.size() - n, n, s) == 0;
  };
  const bool perf = ends("_s") || ends("_ms") || ends("_per_s") || ends("_bytes") || ends("_mib") || ends("_gib") ||
                    key.find("_ms_") != std::string::npos || key.find("mem") != std::string::npos ||
                    key.find("mfu") != std::string::npos || key.find("rank") != std::string::npos;
  return (perf ? "perf/" : "train/") + key;
}

std::string tensorboard_file_name(int64_t seconds, const std::string& host, long pid, int n) {
  char b[32];
  std::snprintf(b, sizeof b, "%010lld", static_cast<long long>(seconds));
  return kPrefix + std::string(b) + "." + host + "." + std::to_string(pid) + "." + std::to_string(n);
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t first_step) {
  namespace fs = std::filesystem;
  const std::string opt = " (option '--tensorboard')";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw std::runtime_error("cannot create TensorBoard directory '" + dir + "'" + opt +
                             (ec ? ": " + ec.message() : std::string(": not a directory")));
  // The newest event file already there (by the seconds in its name) and how many there are.
  int64_t newest = -1, count = 0;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kPrefix, 0) != 0) continue;
    ++count;
    const size_t b = sizeof kPrefix - 1, e = name.find('.', b);
    try {
      newest = std::max<int64_t>(newest, std::stoll(name.substr(b, e - b)));
    } catch (const std::exception&) {
    }
  }
  static int n = 0;  // TensorFlow's per-process counter of writers
  char host[256] = "localhost";
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  host[sizeof host - 1] = 0;
  const double t = now_seconds();
  const int64_t secs = std::max<int64_t>(static_cast<int64_t>(t), newest + 1);
  path_ = (fs::path(dir) / tensorboard_file_name(secs, host, static_cast<long>(getpid()), n++)).string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot create TensorBoard event file '" + path_ + "'" + opt);
  if (count > 0)
    note_ = "tensorboard: '" + dir + "' already holds " + std::to_string(count) + " event file(s); this run starts at step " +
            std::to_string(first_step) + " (a START event), so TensorBoard drops their steps from " +
            std::to_string(first_step) + " on" +
            (first_step <= 1 ? std::string(" (all of them: a fresh run, as '--metrics' is rewritten); give each run a "
                                           "directory of its own to compare runs")
                             : std::string(" (logged after the checkpoint this run continues from)"));
  append(tb_event_file_version(t));
  append(tb_event_start(t, first_step));
  out_.flush();
  if (!out_) throw std::runtime_error("cannot write TensorBoard event file '" + path_ + "'" + opt);
}

void TensorBoardWriter::append(const std::string& event) { out_ << tfrecord_frame(event); }

void TensorBoardWriter::write(const nlohmann::json& record) {
  if (!record.is_object() || !record.contains("step") || !record["step"].is_number_integer()) return;
  std::vector<std::pair<std::string, float>> values;
  for (auto& [key, v] : record.items()) {
    if (key == "step") continue;
    if (v.is_number())
      values.emplace_back(tensorboard_tag(key), static_cast<float>(v.get<double>()));
    else if (v.is_boolean())
      values.emplace_back(tensorboard_tag(key), v.get<bool>() ? 1.0f : 0.0f);
  }
  if (values.empty()) return;
  append(tb_event_scalars(now_seconds(), record["step"].get<int64_t>(), values));
  out_.flush();
}

}  // namespace shardtrain
