// Shared helpers for shardtrain tests.
#pragma once
#include <cstdio>
#include "shardtrain/runtime/runtime.h"

namespace shardtrain::testing {
extern Runtime* g_runtime;
inline Comm& comm() { return g_runtime->comm(); }
}  // namespace shardtrain::testing
