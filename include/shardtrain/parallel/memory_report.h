// shardtrain's end-of-run memory line: every rank's peak resident memory against its memory plan,
// per pipeline stage where there is more than one (the PP room's report, so that the trainer, which
// gathers the numbers, never asks how many stages there are).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

// The line that ends a CPU run: every rank's peak resident memory (VmHWM) against the plan. `ranks`:
// per world rank, four numbers: its peak (bytes), its plan's total (bytes; a pipeline rank's is its
// stage's), its pipeline stage and the bytes its plan adds at the worst routing imbalance (expert
// parallelism, MemoryPlan::worst_extra; 0 otherwise). Without a pipeline (every rank at stage 0):
// each rank's peak in MiB, the plan and the largest rank's difference from it; with one: besides
// each rank's peak, per stage the largest of its ranks against its stage's plan. Where the worst
// case adds something, it is given beside the plan, with the largest rank's difference from it.
std::string peak_memory_report(const std::vector<int64_t>& ranks);

}  // namespace shardtrain
