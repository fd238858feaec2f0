// This process's memory from /proc/self/status (include/shardtrain/runtime/process_stats.h).
#include "shardtrain/runtime/process_stats.h"

#include <fstream>
#include <string>

namespace shardtrain {
namespace {
// The value of `key` in /proc/self/status (kB for the Vm* keys), 0 if absent or unreadable.
int64_t status_kib(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line))
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size()));
  return 0;
}
}  // namespace

int64_t current_rss_bytes() { return status_kib("VmRSS") * 1024; }
int64_t peak_rss_bytes() { return status_kib("VmHWM") * 1024; }

}  // namespace shardtrain
