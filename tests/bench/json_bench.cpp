// make bench-json (issue 53): read_safetensors_header's time and peak RSS against the number of
// tensors N in the header (each an empty F32 tensor, the cheapest entry per byte), to show the table
// checks linear in N (N log N sorts) where the DOM-based reader was quadratic (13.7 s at N = 50,000,
// issue 53); and read_json (the DOM) on a config-like object of N keys. One line per N:
//   json_bench: safetensors N=1000000 header_mb=68.9 seconds=0.84 us_per_tensor=0.84 peak_rss_mb=170
// Usage: json_bench [N ...] (default 10000 100000 1000000 1400000). Peak RSS: VmHWM, which only
// grows: run the Ns in increasing order. Not a test: nothing is asserted (docs/benchmarks.md).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "shardtrain/runtime/json_input.h"
#include "shardtrain/io/safetensors.h"

using namespace shardtrain;

namespace {
double peak_rss_mb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  return -1;
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<uint64_t> ns;
  for (int i = 1; i < argc; ++i) ns.push_back(std::strtoull(argv[i], nullptr, 10));
  if (ns.empty()) ns = {10'000, 100'000, 1'000'000, 1'400'000};
  const std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/json_bench.safetensors";
  for (uint64_t n : ns) {
    // Written entry by entry (two passes: the length first), so the bench never holds the header
    // itself and the peak RSS is the reader's.
    auto entry = [](uint64_t i) {
      return ",\"l" + std::to_string(i) + ".w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}";
    };
    const std::string head = "{\"__metadata__\":{\"format\":\"pt\"}";
    uint64_t len = head.size() + 1;
    for (uint64_t i = 0; i < n; ++i) len += entry(i).size();
    const uint64_t pad = (8 - len % 8) % 8;
    {
      std::ofstream o(path, std::ios::binary | std::ios::trunc);
      const uint64_t total = len + pad;
      for (int i = 0; i < 8; ++i) o.put(static_cast<char>(total >> (8 * i)));
      o << head;
      for (uint64_t i = 0; i < n; ++i) o << entry(i);
      o << "}" << std::string(pad, ' ');
    }
    const double mb = static_cast<double>(len + pad) / 1e6;
    const auto t0 = std::chrono::steady_clock::now();
    const StFile f = read_safetensors_header(path);
    const double s = seconds_since(t0);
    std::printf("json_bench: safetensors N=%llu header_mb=%.1f seconds=%.3f us_per_tensor=%.3f peak_rss_mb=%.0f\n",
                static_cast<unsigned long long>(f.entries.size()), mb, s, 1e6 * s / static_cast<double>(n), peak_rss_mb());
    std::fflush(stdout);
  }
  std::remove(path.c_str());
  for (uint64_t n : ns) {  // the DOM reader: an object of n integer values (a tokenizer.json's vocab)
    if (n > json_limits::kTokenizer.max_values) break;
    std::string t = "{\"model\": {\"vocab\": {";
    for (uint64_t i = 0; i < n; ++i) {
      if (i > 0) t += ", ";
      t += "\"t" + std::to_string(i) + "\": " + std::to_string(i);
    }
    t += "}}}";
    const auto t0 = std::chrono::steady_clock::now();
    const nlohmann::json j = read_json(t, json_limits::kTokenizer);
    const double s = seconds_since(t0);
    std::printf("json_bench: read_json N=%llu text_mb=%.1f seconds=%.3f us_per_value=%.3f peak_rss_mb=%.0f\n",
                static_cast<unsigned long long>(j["model"]["vocab"].size()), t.size() / 1e6, s,
                1e6 * s / static_cast<double>(n), peak_rss_mb());
    std::fflush(stdout);
  }
  return 0;
}
