// EpGroup (expert_parallel.h): the model's expert-parallel transfers on the mesh's EP communicators.
#include "shardtrain/parallel/expert_parallel.h"

#include <chrono>
#include <memory>
#include <utility>
#include <stdexcept>
#include <string>

namespace shardtrain {

namespace {
double ep_wall_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

// A started all-to-all: polled by the compute backend's progress registry until wait() (MPI
// advances it only inside MPI calls); a poll that saw it complete spares the wait.
class EpTransfer final : public ExpertTransfer {
 public:
  EpTransfer(std::unique_ptr<Comm::Request> req, ProgressRegistry* reg, EpCommStats& st)
      : req_(std::move(req)), st_(st), t0_(ep_wall_s()) {
    if (reg) member_ = reg->join(&EpTransfer::poll, this);
  }
  ~EpTransfer() override { member_.reset(); }  // then req_'s destructor waits for a pending transfer
  void wait() override {
    member_.reset();
    const double t = ep_wall_s();
    if (done_) ++st_.done_in_compute;
    else req_->wait();  // a failed test() is reported here
    const double t1 = ep_wall_s();
    if (!done_) t_done_ = t1;
    done_ = true;
    st_.exposed_s += t1 - t;
    st_.issued_s += t_done_ - t0_;
  }

 private:
  // Runs inside kernels: never throws (a failing test() leaves the failure to wait()).
  static void poll(void* self) {
    auto* t = static_cast<EpTransfer*>(self);
    if (t->done_ || t->failed_) return;
    try {
      t->done_ = t->req_->test();
      if (t->done_) t->t_done_ = ep_wall_s();
    } catch (...) {
      t->failed_ = true;
    }
  }
  std::unique_ptr<Comm::Request> req_;
  EpCommStats& st_;
  double t0_, t_done_ = 0;  // started; seen complete (by a poll, else at the wait's return)
  bool done_ = false, failed_ = false;
  ProgressRegistry::Member member_;  // declared last: leaves first
};

template <typename C> std::vector<int64_t> EpGroup<C>::all_gather_counts(const std::vector<int64_t>& counts) {
  const double t0 = ep_wall_s();
  std::vector<int64_t> all(counts.size() * static_cast<size_t>(size()));
  host_.all_gather(counts.data(), all.data(), counts.size());
  ++stats_.calls;
  const double dt = ep_wall_s() - t0;
  stats_.issued_s += dt;
  stats_.exposed_s += dt;
  return all;
}

template <typename C>
std::unique_ptr<ExpertTransfer> EpGroup<C>::start_all_to_all(const C* send, const std::vector<size_t>& send_rows, C* recv,
                                                             const std::vector<size_t>& recv_rows, size_t width) {
  const size_t n = static_cast<size_t>(size());
  if (send_rows.size() != n || recv_rows.size() != n)
    throw std::invalid_argument("EpGroup::start_all_to_all: " + std::to_string(send_rows.size()) + " send and " +
                                std::to_string(recv_rows.size()) + " receive counts for an EP group of " +
                                std::to_string(n) + " ranks");
  std::vector<size_t> sc(n), rc(n);
  double sent = 0;
  for (size_t q = 0; q < n; ++q) {
    sc[q] = send_rows[q] * width;
    rc[q] = recv_rows[q] * width;
    if (q != static_cast<size_t>(rank())) sent += static_cast<double>(sc[q]);
  }
  auto t = std::make_unique<EpTransfer>(data_.start_all_to_all_v(send, sc, recv, rc, Comm::OwnBlock::Keep), progress_,
                                        stats_);
  ++stats_.calls;
  stats_.bytes += sent * sizeof(C);
  return t;
}

template class EpGroup<float>;
template class EpGroup<double>;
template class EpGroup<bf16>;

}  // namespace shardtrain
