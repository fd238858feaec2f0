// This process's memory as the kernel reports it (runtime layer; depends on nothing).
#pragma once

#include <cstdint>

namespace shardtrain {

// This process's resident memory now and its peak, from /proc/self/status (VmRSS, VmHWM), bytes;
// 0 where unavailable.
int64_t current_rss_bytes();
int64_t peak_rss_bytes();

}  // namespace shardtrain
