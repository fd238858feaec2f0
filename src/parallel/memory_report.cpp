// The end-of-run memory line (memory_report.h).
#include "shardtrain/parallel/memory_report.h"

#include <algorithm>
#include <cstdio>

namespace shardtrain {

std::string peak_memory_report(const std::vector<int64_t>& ranks) {
  const size_t W = ranks.size() / 4;
  auto mib = [](const char* f, int64_t b) {
    char s[64];
    std::snprintf(s, sizeof s, f, static_cast<double>(b) / (1 << 20));
    return std::string(s);
  };
  auto percent = [](int64_t peak, int64_t plan) {
    char s[64];
    std::snprintf(s, sizeof s, "%+.1f", 100.0 * (static_cast<double>(peak) / static_cast<double>(plan) - 1.0));
    return std::string(s);
  };
  std::string per;
  int stages = 0;
  for (size_t r = 0; r < W; ++r) {
    per += (r ? ", " : "") + mib("%.0f", ranks[4 * r]);
    stages = std::max(stages, static_cast<int>(ranks[4 * r + 2]) + 1);
  }
  // Per stage the largest of its ranks, against its ranks' plan (the same for every rank of a stage).
  std::vector<int64_t> peak(static_cast<size_t>(stages), 0), plan(static_cast<size_t>(stages), 0),
      worst(static_cast<size_t>(stages), 0);
  for (size_t r = 0; r < W; ++r) {
    const size_t s = static_cast<size_t>(ranks[4 * r + 2]);
    peak[s] = std::max(peak[s], ranks[4 * r]);
    plan[s] = ranks[4 * r + 1];
    worst[s] = ranks[4 * r + 3];
  }
  auto at_worst = [&](size_t s) {
    if (worst[s] <= 0) return std::string();
    return "; " + mib("%.0f", plan[s] + worst[s]) + " MiB at the worst routing imbalance (" +
           percent(peak[s], plan[s] + worst[s]) + "%)";
  };
  const std::string head = "memory: peak resident (VmHWM) per rank " + per + " MiB; ";
  if (stages == 1)
    return head + "plan " + mib("%.0f", plan[0]) + " MiB (largest rank " + percent(peak[0], plan[0]) + "%" +
           at_worst(0) + ")";
  std::string each;
  for (size_t s = 0; s < peak.size(); ++s)
    each += (s ? "; " : "") + std::string("stage ") + std::to_string(s) + " peak " + mib("%.0f", peak[s]) +
            " MiB, plan " + mib("%.0f", plan[s]) + " MiB (" + percent(peak[s], plan[s]) + "%" + at_worst(s) + ")";
  return head + "per pipeline stage (largest rank vs its stage's plan): " + each;
}

}  // namespace shardtrain
