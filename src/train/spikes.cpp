// Loss-spike detection (--skip-spikes Z, train.h check_spike): a step whose loss or gradient norm
// lies more than Z standard deviations above the mean of the last kSpikeWindow steps has its update
// skipped. Plain double arithmetic over the window in a fixed order (oldest first), from the
// globally reduced loss and norm: every rank, and a resumed run, decides the same. Not here: the
// skip itself (the trainer leaves parameters and AdamW moments alone) and the checkpoint attribute
// (checkpoint_meta_write.cpp / checkpoint_meta_read.cpp, `spike_stats`).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "shardtrain/train/train.h"

namespace shardtrain {

namespace {
// A skipped value enters the window from the kAbsorbAfter-th skip in a row on, so that a lasting
// change of level (not a spike) ends up in the statistics instead of skipping every later step.
constexpr int64_t kAbsorbAfter = 3;

// Mean and population standard deviation of `w` (two passes, oldest first).
void mean_std(const std::vector<double>& w, double* mean, double* sd) {
  double s = 0;
  for (double x : w) s += x;
  *mean = s / static_cast<double>(w.size());
  double q = 0;
  for (double x : w) q += (x - *mean) * (x - *mean);
  *sd = std::sqrt(q / static_cast<double>(w.size()));
}

void push(std::vector<double>& w, double x) {
  if (w.size() >= static_cast<size_t>(kSpikeWindow)) w.erase(w.begin(), w.end() - (kSpikeWindow - 1));
  w.push_back(x);
}

std::string num(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
}  // namespace

SpikeCheck check_spike(SpikeStats& st, double loss, double grad_norm, double z) {
  SpikeCheck c;
  c.judged = st.loss.size() >= static_cast<size_t>(kSpikeWindow);
  if (c.judged) {
    mean_std(st.loss, &c.loss_mean, &c.loss_std);
    mean_std(st.grad_norm, &c.grad_mean, &c.grad_std);
    // A constant window (std 0) judges nothing, as in llm.c.
    c.loss_z = c.loss_std > 0 ? (loss - c.loss_mean) / c.loss_std : 0;
    c.grad_z = c.grad_std > 0 ? (grad_norm - c.grad_mean) / c.grad_std : 0;
    c.skip = z > 0 && (c.loss_z > z || c.grad_z > z);
  }
  if (c.skip) {
    ++st.skipped_updates;
    ++st.skipped_in_a_row;
  } else {
    st.skipped_in_a_row = 0;
  }
  if (!c.skip || st.skipped_in_a_row >= kAbsorbAfter) {
    push(st.loss, loss);
    push(st.grad_norm, grad_norm);
  }
  return c;
}

std::string describe_spike(const SpikeCheck& c, double loss, double grad_norm, double z) {
  std::string why;
  auto one = [&](const char* what, double v, double zv, double mean, double sd) {
    why += std::string(why.empty() ? "" : "; ") + what + " " + num("%.6g", v) + " is " + num("%.1f", zv) +
           " standard deviations above the mean of the last " + std::to_string(kSpikeWindow) + " steps (" +
           num("%.6g", mean) + ", std " + num("%.3g", sd) + ")";
  };
  if (c.loss_z > z) one("loss", loss, c.loss_z, c.loss_mean, c.loss_std);
  if (c.grad_z > z) one("grad_norm", grad_norm, c.grad_z, c.grad_mean, c.grad_std);
  return why + " (--skip-spikes " + num("%g", z) + ")";
}

TestSpike test_spike_hook() {
  TestSpike t;
  const char* steps = std::getenv("SHARDTRAIN_TEST_SPIKE_STEP");
  if (!steps || !*steps) return t;
  std::stringstream ss(steps);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (end != item.c_str() && *end == '\0' && v > 0) t.steps.push_back(v);
  }
  const char* scale = std::getenv("SHARDTRAIN_TEST_SPIKE_SCALE");
  t.scale = 100;
  if (scale && *scale) {
    char* end = nullptr;
    const double v = std::strtod(scale, &end);
    if (end != scale && *end == '\0' && std::isfinite(v) && v > 0) t.scale = v;
  }
  return t;
}

double TestSpike::at(int64_t step) const {
  for (int64_t s : steps)
    if (s == step) return scale;
  return 1.0;
}

}  // namespace shardtrain
