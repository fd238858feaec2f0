// The batch history's arithmetic (train_state.h).
#include "shardtrain/io/train_state.h"

#include <stdexcept>
#include <string>

namespace shardtrain {

int64_t tokens_of(const std::vector<BatchSegment>& segs, int64_t step) {
  int64_t t = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const BatchSegment& g = segs[i];
    const int64_t end = i + 1 < segs.size() ? segs[i + 1].from_step : step;
    if ((i == 0 && g.from_step != 0) || g.from_step > end || end > step || g.global_batch < 1 || g.seq_len < 1)
      throw std::invalid_argument("the batch history does not cover steps [0, " + std::to_string(step) +
                                  ") in order with positive batch sizes");
    t += (end - g.from_step) * static_cast<int64_t>(g.global_batch) * g.seq_len;
  }
  return t;
}

}  // namespace shardtrain
