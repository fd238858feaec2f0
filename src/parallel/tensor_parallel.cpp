// TpGroup (tensor_parallel.h): the model's TP collectives on the mesh's TP communicator.
#include "shardtrain/parallel/tensor_parallel.h"
#include <chrono>

namespace shardtrain {

// ---- TpGroup ------------------------------------------------------------------------------------

namespace {
double wall_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

template <typename C> template <typename F> void TpGroup<C>::timed(F&& call) {
  const double t0 = wall_s();
  call();
  stats_.seconds += wall_s() - t0;
}
template <typename C> template <typename E> void TpGroup<C>::gather(const E* local, E* full, size_t count) {
  timed([&] {
    if (comm_.stream_ordered()) comm_.start_all_gather(local, full, count)->wait();
    else comm_.all_gather(local, full, count);
  });
  ++stats_.all_gathers;
  stats_.all_gather_bytes += static_cast<double>(size() - 1) * static_cast<double>(count * sizeof(E));
}
template <typename C> void TpGroup<C>::all_gather(const C* local, C* full, size_t count) { gather(local, full, count); }
template <typename C> void TpGroup<C>::all_gather_acc(const S* local, S* full, size_t count) {
  gather(local, full, count);
}
template <typename C> void TpGroup<C>::reduce_scatter_sum(const C* full, C* local, size_t count) {
  timed([&] {
    if (comm_.stream_ordered()) comm_.start_reduce_scatter_sum(full, local, count)->wait();
    else comm_.reduce_scatter_sum(full, local, count);
  });
  ++stats_.reduce_scatters;
  stats_.reduce_scatter_bytes += static_cast<double>(size() - 1) * static_cast<double>(count * sizeof(C));
}
template <typename C> void TpGroup<C>::all_reduce_sum_acc(S* buf, size_t count) {
  timed([&] {
    if (comm_.stream_ordered()) comm_.start_all_reduce_sum(buf, count)->wait();
    else comm_.all_reduce(buf, count, ReduceOp::Sum);
  });
  ++stats_.all_reduces;
  stats_.all_reduce_bytes +=
      2.0 * static_cast<double>(size() - 1) / size() * static_cast<double>(count * sizeof(S));
}
template class TpGroup<float>;
template class TpGroup<double>;
template class TpGroup<bf16>;

}  // namespace shardtrain
