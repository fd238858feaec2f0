// The documents of packed sequences, for document masking (data.h document_layout).
#include <stdexcept>
#include <string>

#include "shardtrain/data/data.h"

namespace shardtrain {

void document_layout(const int32_t* tokens, int B, int T, int64_t stride, int32_t eos, int32_t* doc, int32_t* pos) {
  if (B < 0 || T < 0 || stride < T)
    throw std::invalid_argument("document_layout: B (" + std::to_string(B) + ") and T (" + std::to_string(T) +
                                ") must be >= 0 and the row stride (" + std::to_string(stride) + ") >= T");
  for (int b = 0; b < B; ++b) {
    const int32_t* x = tokens + b * stride;
    int32_t* d = doc + static_cast<int64_t>(b) * T;
    int32_t* p = pos + static_cast<int64_t>(b) * T;
    int32_t id = 0, start = 0;  // the current document and the index of its first token
    for (int t = 0; t < T; ++t) {
      if (t > 0 && x[t - 1] == eos) {
        ++id;
        start = t;
      }
      d[t] = id;
      p[t] = t - start;
    }
  }
}

}  // namespace shardtrain
