// EpGroup (expert_parallel.h): the model's expert-parallel transfers on the mesh's EP communicators.
#include "shardtrain/parallel/expert_parallel.h"

#include <chrono>
#include <stdexcept>
#include <string>

namespace shardtrain {

namespace {
double ep_wall_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

template <typename C> std::vector<int64_t> EpGroup<C>::all_gather_counts(const std::vector<int64_t>& counts) {
  const double t0 = ep_wall_s();
  std::vector<int64_t> all(counts.size() * static_cast<size_t>(size()));
  host_.all_gather(counts.data(), all.data(), counts.size());
  ++stats_.calls;
  stats_.seconds += ep_wall_s() - t0;
  return all;
}

template <typename C>
void EpGroup<C>::all_to_all(const C* send, const std::vector<size_t>& send_rows, C* recv,
                            const std::vector<size_t>& recv_rows, size_t width) {
  const size_t n = static_cast<size_t>(size());
  if (send_rows.size() != n || recv_rows.size() != n)
    throw std::invalid_argument("EpGroup::all_to_all: " + std::to_string(send_rows.size()) + " send and " +
                                std::to_string(recv_rows.size()) + " receive counts for an EP group of " +
                                std::to_string(n) + " ranks");
  std::vector<size_t> sc(n), rc(n);
  double sent = 0;
  for (size_t q = 0; q < n; ++q) {
    sc[q] = send_rows[q] * width;
    rc[q] = recv_rows[q] * width;
    if (q != static_cast<size_t>(rank())) sent += static_cast<double>(sc[q]);
  }
  const double t0 = ep_wall_s();
  data_.start_all_to_all_v(send, sc, recv, rc)->wait();
  ++stats_.calls;
  stats_.bytes += sent * sizeof(C);
  stats_.seconds += ep_wall_s() - t0;
}

template class EpGroup<float>;
template class EpGroup<double>;
template class EpGroup<bf16>;

}  // namespace shardtrain
