// Small file helpers shared by every layer.
#pragma once

#include <string>

namespace shardtrain {

// Writes `bytes` to `path` atomically: to "<path>.tmp" first, flushed (and fsync'd, with the
// directory, when `durable`), then renamed over `path`. Readers see the old file or the new one,
// never a partial one. On failure the temporary file is removed and std::runtime_error names
// `path` (and `what`, e.g. "option '--out'", when given).
void write_file_atomic(const std::string& path, const std::string& bytes, bool durable = false,
                       const std::string& what = "");

}  // namespace shardtrain
