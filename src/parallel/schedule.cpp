// Schedules (schedule.h): the actions of gradient accumulation and the table of any schedule.
#include "shardtrain/parallel/schedule.h"

#include <algorithm>
#include <stdexcept>

namespace shardtrain {

const char* action_letter(ActionKind k) {
  switch (k) {
    case ActionKind::Forward: return "F";
    case ActionKind::Backward: return "B";
    case ActionKind::BackwardInput: return "I";
    case ActionKind::BackwardWeight: return "W";
  }
  return "?";
}

namespace {
std::string label(const Action& a) {  // "F3"
  std::string s = action_letter(a.kind);
  s += std::to_string(a.microbatch);
  return s;
}
}  // namespace

std::string Schedule::to_table() const {
  const int S = stages(), M = microbatches();
  std::string out = name() + ": " + std::to_string(M) + (M == 1 ? " micro-batch, " : " micro-batches, ") +
                    std::to_string(S) + (S == 1 ? " stage\n" : " stages\n");
  const std::vector<Action> all = actions();
  // Each stage's chunks in model order, with their ranges; several on one stage: wide cells.
  std::vector<std::vector<const Action*>> chunks(static_cast<size_t>(std::max(S, 0)));
  bool several = false;
  for (const Action& a : all) {
    if (a.stage < 0 || a.stage >= S) continue;
    auto& c = chunks[static_cast<size_t>(a.stage)];
    if (std::none_of(c.begin(), c.end(), [&](const Action* x) { return x->chunk == a.chunk; })) c.push_back(&a);
    several = several || c.size() > 1;
  }
  for (auto& c : chunks) std::sort(c.begin(), c.end(), [](const Action* x, const Action* y) { return x->chunk < y->chunk; });
  // Cells 4 wide (6 with chunk suffixes), wider where a label needs it (100 micro-batches and more).
  size_t width = several ? 6 : 4;
  for (const Action& a : all) width = std::max(width, label(a).size() + (several ? 3 + std::to_string(a.chunk).size() : 1));
  for (int s = 0; s < S; ++s) {
    const auto& c = chunks[static_cast<size_t>(s)];
    std::string row, ranges;
    for (const Action* x : c) {  // (appended piece by piece: GCC 12's -Wrestrict misfires on "[" + ...)
      ranges += '[';
      ranges += std::to_string(x->begin);
      ranges += ", ";
      ranges += std::to_string(x->end);
      ranges += ") ";
    }
    if (c.empty()) ranges = "[-1, -1) ";
    for (const Action& a : all) {
      if (a.stage != s) continue;
      std::string l = label(a);
      if (several)
        for (size_t j = 0; j < c.size(); ++j)
          if (c[j]->chunk == a.chunk) {
            l += '.';
            l += std::to_string(j);
          }
      l.resize(std::max(l.size() + 1, width), ' ');
      row += l;
    }
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += "stage " + std::to_string(s) + " " + ranges + "| " + row + "\n";
  }
  return out;
}

GradAccumulation::GradAccumulation(int microbatches, int blocks, bool backward)
    : m_(microbatches), blocks_(blocks), backward_(backward) {
  if (microbatches < 1) throw std::invalid_argument("GradAccumulation: needs at least one micro-batch");
  if (blocks < 0) throw std::invalid_argument("GradAccumulation: a negative number of blocks");
}

std::vector<Action> GradAccumulation::actions() const {
  std::vector<Action> a;
  for (int m = 0; m < m_; ++m) {
    a.push_back({ActionKind::Forward, m, 0, 0, blocks_});
    if (backward_) a.push_back({ActionKind::Backward, m, 0, 0, blocks_});
  }
  return a;
}

std::string one_in_flight_problem(const Schedule& s, int blocks) {
  const std::vector<Action> all = s.actions();
  for (size_t i = 0; i < all.size(); ++i) {
    const Action& a = all[i];
    const std::string at = "action " + std::to_string(i) + " (" + label(a) + ") of schedule '" + s.name() + "'";
    if (a.stage != 0 || a.begin != 0 || a.end != blocks)
      return at + " is not on one stage over all " + std::to_string(blocks) + " blocks";
    if (a.kind != ActionKind::Forward && a.kind != ActionKind::Backward)
      return at + " splits the backward, which the model does not yet";
    if (a.kind == ActionKind::Backward &&
        (i == 0 || all[i - 1].kind != ActionKind::Forward || all[i - 1].microbatch != a.microbatch))
      return at + " does not directly follow its micro-batch's forward (one micro-batch in flight)";
  }
  return "";
}

}  // namespace shardtrain
