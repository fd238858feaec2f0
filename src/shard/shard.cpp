// The sharding layer (shard.h): shard plan construction, the CommQueue lanes (host, stream), the
// sharded state, the codecs (identity, bf16) and the unit pipeline (gather / reduce-scatter per unit).
#include "shardtrain/shard.h"

#include <algorithm>
#include <chrono>
#include <type_traits>
#include <cmath>
#include <set>
#include <stdexcept>

namespace shardtrain {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int64_t ParamSpec::canonical_index(int64_t e) const {
  if (tp.degree <= 1 || tp.split == TpSplit::None || tp.split == TpSplit::Replicated) return e;
  const int64_t lcols = shape.size() == 2 ? shape[1] : 1;
  const int64_t r = e / lcols, c = e % lcols;
  if (tp.split == TpSplit::Rows) return tp.offset + r < tp.rows ? (tp.offset + r) * tp.cols + c : -1;
  return r * tp.cols + tp.offset + c;  // Cols
}

const ParamSlot& UnitPlan::param(const std::string& n) const {
  for (auto& p : params)
    if (p.spec.name == n) return p;
  throw std::out_of_range("unit '" + name + "' has no parameter '" + n + "'");
}

ShardPlan ShardPlan::build(const std::vector<UnitSpec>& units, int world) {
  if (world < 1) throw std::invalid_argument("ShardPlan: world size must be >= 1, got " + std::to_string(world));
  ShardPlan plan;
  plan.world_size = world;
  std::set<std::string> seen;
  for (const auto& us : units) {
    if (us.params.empty()) throw std::invalid_argument("ShardPlan: unit '" + us.name + "' has no parameters");
    UnitPlan up;
    up.name = us.name;
    int64_t off = 0;
    for (const auto& ps : us.params) {
      if (!seen.insert(ps.name).second) throw std::invalid_argument("ShardPlan: duplicate parameter '" + ps.name + "'");
      for (auto d : ps.shape)
        if (d <= 0) throw std::invalid_argument("ShardPlan: parameter '" + ps.name + "' has a non-positive dimension");
      ParamSlot slot{ps, off, ps.numel()};
      off += slot.numel;
      up.params.push_back(slot);
    }
    up.numel = off;
    up.shard_size = std::max<int64_t>(1, (off + world - 1) / world);
    up.padded_numel = up.shard_size * world;
    for (int r = 0; r < world; ++r) {
      RankShard rs;
      rs.start = r * up.shard_size;
      rs.valid = std::clamp<int64_t>(up.numel - rs.start, 0, up.shard_size);
      rs.padding = up.shard_size - rs.valid;
      up.ranks.push_back(rs);
    }
    plan.units.push_back(std::move(up));
  }
  return plan;
}

int64_t ShardPlan::max_padded_numel() const {
  int64_t m = 0;
  for (const UnitPlan& u : units) m = std::max(m, u.padded_numel);
  return m;
}

int64_t ShardPlan::max_shard_size() const {
  int64_t m = 0;
  for (const UnitPlan& u : units) m = std::max(m, u.shard_size);
  return m;
}

int64_t ShardPlan::total_numel() const {
  int64_t n = 0;
  for (auto& u : units) n += u.numel;
  return n;
}

int ShardPlan::unit_index(const std::string& name) const {
  for (size_t i = 0; i < units.size(); ++i)
    if (units[i].name == name) return static_cast<int>(i);
  return -1;
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

double counter_normal(uint64_t seed, uint64_t key, uint64_t i) {
  uint64_t a = splitmix64(seed ^ splitmix64(key ^ splitmix64(2 * i)));
  uint64_t b = splitmix64(seed ^ splitmix64(key ^ splitmix64(2 * i + 1)));
  double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;          // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

template <typename T>
ShardedState<T>::ShardedState(Backend<T>& be, Comm& comm, ShardPlan plan, Comm* data_comm, Comm* replica_comm)
    : be_(be), comm_(comm), dcomm_(data_comm ? data_comm : &comm), rcomm_(replica_comm), plan_(std::move(plan)) {
  if (plan_.world_size != dcomm_->world_size())
    throw std::invalid_argument("ShardedState: plan built for " + std::to_string(plan_.world_size) +
                                " ranks, comm has " + std::to_string(dcomm_->world_size()));
  for (auto& u : plan_.units) {
    params_.emplace_back(be_, static_cast<size_t>(u.shard_size));
    grads_.emplace_back(be_, static_cast<size_t>(u.shard_size));
  }
}

template <typename T> void ShardedState<T>::init_params(uint64_t seed) {
  int r = plan_rank();
  constexpr int64_t kPiece = int64_t{1} << 20;  // host staging of at most 1M elements, not a whole shard
  std::vector<T> host;
  for (size_t u = 0; u < plan_.units.size(); ++u) {
    const UnitPlan& up = plan_.units[u];
    const RankShard& rs = up.ranks[r];
    for (int64_t p0 = 0; p0 < up.shard_size; p0 += kPiece) {  // shard elements [p0, p1)
      const int64_t p1 = std::min(up.shard_size, p0 + kPiece);
      host.assign(static_cast<size_t>(p1 - p0), T(0));
      for (const auto& slot : up.params) {
        const int64_t lo = std::max({slot.offset, rs.start + p0}),
                      hi = std::min({slot.offset + slot.numel, rs.start + rs.valid, rs.start + p1});
        const uint64_t key = fnv1a64(slot.spec.name);
        for (int64_t e = lo; e < hi; ++e) {
          T v = 0;
          switch (slot.spec.init) {
            case Init::Ones: v = 1; break;
            case Init::Zeros: v = 0; break;
            case Init::Normal: {
              const int64_t ci = slot.spec.canonical_index(e - slot.offset);  // -1: vocabulary padding
              v = ci < 0 ? T(0) : static_cast<T>(slot.spec.init_std * counter_normal(seed, key, static_cast<uint64_t>(ci)));
              break;
            }
          }
          host[static_cast<size_t>(e - rs.start - p0)] = v;
        }
      }
      be_.from_host(params_[u].data() + p0, host.data(), host.size());
    }
  }
}

template <typename T> void ShardedState<T>::zero_grads() {
  for (size_t u = 0; u < grads_.size(); ++u) be_.zero(grads_[u].data(), grads_[u].size());
}

size_t reduce_slab(const ShardPlan& plan, size_t slab_elements, bool stream_lane) {
  const size_t max_shard = static_cast<size_t>(plan.max_shard_size()), W = static_cast<size_t>(plan.world_size);
  if (stream_lane) return max_shard;
  return std::min(max_shard, std::max<size_t>(1, slab_elements / W));
}

// ---- CommQueue --------------------------------------------------------------------------------

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

CommProgress parse_comm_progress(const std::string& s) {
  if (s == "thread") return CommProgress::Thread;
  if (s == "poll") return CommProgress::Poll;
  if (s == "wait") return CommProgress::Wait;
  throw std::invalid_argument("option '--comm-progress' must be thread, poll or wait, got '" + s + "'");
}
const char* comm_progress_name(CommProgress p) {
  switch (p) {
    case CommProgress::Thread: return "thread";
    case CommProgress::Poll: return "poll";
    case CommProgress::Wait: return "wait";
  }
  return "?";
}

std::unique_ptr<CommQueue> CommQueue::make(Comm& lane, Comm& watch, bool background, CommProgress progress,
                                            std::function<void()> prepare_thread, const char* what) {
  if (lane.stream_ordered()) return std::make_unique<StreamCommQueue>(lane, watch, background, what);
  return std::make_unique<HostCommQueue>(lane, watch, background, progress, std::move(prepare_thread), what);
}

// ---- HostCommQueue ----

HostCommQueue::HostCommQueue(Comm& lane, Comm& watch, bool background, CommProgress progress,
                             std::function<void()> prepare_thread, const char* what)
    : lane_(lane), watch_(watch), what_(what), background_(background && lane.asynchronous()), progress_(progress) {
  if (!background_ || progress_ != CommProgress::Thread) return;
  thread_ = std::thread([this, prep = std::move(prepare_thread)] {
    if (prep) prep();
    std::unique_lock<std::mutex> lk(mu_);
    int nap_us = kPollMinUs;
    for (;;) {
      cv_work_.wait(lk, [&] { return quit_ || !jobs_.empty(); });
      if (jobs_.empty()) break;  // quit_ and nothing left
      try {
        bool moved = false;
        while (advance_locked()) moved = true;
        // Back off while nothing completes: each MPI_Test runs Open MPI's whole progress loop, and
        // on a machine with no spare core these wake-ups are taken from the compute threads.
        nap_us = moved ? kPollMinUs : std::min(2 * nap_us, kPollMaxUs);
      } catch (...) {
        error_ = std::current_exception();
        jobs_.clear();
        completed_ = last_;
        cv_done_.notify_all();
        continue;
      }
      if (!jobs_.empty()) {  // in flight: test again shortly (MPI_Test drives Open MPI's progress)
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(nap_us));
        lk.lock();
      }
    }
  });
}

HostCommQueue::~HostCommQueue() {
  try {
    wait_all();
  } catch (...) {  // an error was reported to the waiter already, or nobody waits any more
  }
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      quit_ = true;
    }
    cv_work_.notify_all();
    thread_.join();
  }
}

// One step of the head job: start its current part, or test it and, when complete, consume it.
bool HostCommQueue::advance_locked() {
  if (jobs_.empty()) return false;
  Active& a = jobs_.front();
  if (!a.req) {
    if (a.part == 0) a.t0 = now_s();
    a.req = a.job.start(lane_, a.part);
    ++times_.collectives;
  }
  if (!a.req->test()) return false;
  a.req.reset();
  if (a.job.done) a.job.done(a.part);
  if (++a.part == a.job.parts) {
    times_.issued_s += now_s() - a.t0;
    completed_ = a.ticket;
    jobs_.pop_front();
    cv_done_.notify_all();
  }
  return true;
}

void HostCommQueue::run_inline(Job& job) {
  const double t0 = now_s();
  for (int i = 0; i < job.parts; ++i) {
    auto r = job.start(lane_, i);
    ++times_.collectives;
    r->wait();
    if (job.done) job.done(i);
  }
  const double dt = now_s() - t0;
  times_.issued_s += dt;
  times_.exposed_s += dt;
}

CommQueue::Ticket HostCommQueue::submit(Job job) {
  if (job.parts <= 0) throw std::logic_error("CommQueue::submit: a job needs at least one part");
  std::unique_lock<std::mutex> lk(mu_);
  const Ticket t = ++last_;
  ++times_.jobs;
  if (!background_) {
    lk.unlock();
    CommWatch w(watch_, what_);
    run_inline(job);
    lk.lock();
    completed_ = t;
    return t;
  }
  Active a;
  a.job = std::move(job);
  a.ticket = t;
  jobs_.push_back(std::move(a));
  if (thread_.joinable()) {
    cv_work_.notify_one();
  } else {
    while (advance_locked()) {  // start it now if the lane is idle (and finish whatever is done)
    }
  }
  return t;
}

// Unit boundaries and GEMM tiles (Poll only: Wait makes no MPI call there, Thread has its own).
void HostCommQueue::poll() {
  if (progress_ == CommProgress::Poll) drive();
}

void HostCommQueue::drive() {
  if (!background_ || thread_.joinable()) return;
  std::lock_guard<std::mutex> lk(mu_);
  while (advance_locked()) {
  }
}

void HostCommQueue::set_sibling(CommQueue* q) {
  sibling_ = dynamic_cast<HostCommQueue*>(q);
  if (q && !sibling_) throw std::logic_error("HostCommQueue::set_sibling: the sibling is on the stream lane");
}

void HostCommQueue::wait(Ticket t) {
  std::unique_lock<std::mutex> lk(mu_);
  if (completed_ >= t && !error_) return;
  const double t0 = now_s();
  {
    // The waiter drives the head job itself, in every progress mode (with a thread too: it would
    // only notice completion after its next nap); the thread blocks on the lock meanwhile.
    CommWatch w(watch_, what_);
    while (completed_ < t && !error_) {
      if (advance_locked() || jobs_.empty()) continue;
      if (sibling_ && !thread_.joinable()) {
        // Keep the other queue moving too: a part it has not started may be what the peers we
        // wait for are waiting on (their next slab, the replica sum), so blocking in MPI_Wait here
        // could close a cycle of waits across the two communicators. Yield like Open MPI does
        // when oversubscribed.
        sibling_->drive();
        std::this_thread::yield();
      } else {
        jobs_.front().req->wait();  // blocks in MPI_Wait: nothing else to do meanwhile
      }
    }
  }
  times_.exposed_s += now_s() - t0;
  if (error_) {
    std::exception_ptr e = error_;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      throw std::runtime_error(std::string("FSDP communication thread: ") + x.what());
    }
  }
}

CommTimes HostCommQueue::times() const {
  std::lock_guard<std::mutex> lk(mu_);
  return times_;
}

// ---- StreamCommQueue ----

StreamCommQueue::StreamCommQueue(Comm& lane, Comm& watch, bool background, const char* what)
    : lane_(lane), watch_(watch), what_(what), background_(background) {}

StreamCommQueue::~StreamCommQueue() {
  try {
    wait_all();
  } catch (...) {  // a device error was reported already, or nobody waits any more
  }
}

// Every part is enqueued now, in program order (the same on every rank). A job with shared
// buffers first finishes the queued jobs that use them (their done reads them). The last part
// stays in flight: its compute-stream wait and done come when the ticket is waited for.
CommQueue::Ticket StreamCommQueue::submit(Job job) {
  if (job.parts <= 0) throw std::logic_error("CommQueue::submit: a job needs at least one part");
  const Ticket t = ++last_;
  ++times_.jobs;
  {
    CommWatch w(watch_, what_);
    if (job.shared_buffers)
      while (shared_in_flight_ > 0) finish_head();
    Active a;
    a.job = std::move(job);
    a.ticket = t;
    for (int i = 0;; ++i) {
      a.last = a.job.start(lane_, i);
      ++times_.collectives;
      if (i + 1 == a.job.parts) break;
      a.last->wait();  // part i + 1 reads what done(i) makes (hybrid sharding's replica sum)
      if (a.job.done) a.job.done(i);
    }
    shared_in_flight_ += a.job.shared_buffers ? 1 : 0;
    jobs_.push_back(std::move(a));
  }
  if (!background_) wait(t);  // overlap off: the same calls, each waited for at once
  return t;
}

void StreamCommQueue::finish_head() {
  Active& a = jobs_.front();
  a.last->wait();
  a.last.reset();
  if (a.job.done) a.job.done(a.job.parts - 1);
  completed_ = a.ticket;
  shared_in_flight_ -= a.job.shared_buffers ? 1 : 0;
  jobs_.pop_front();
}

void StreamCommQueue::wait(Ticket t) {
  if (completed_ >= t) return;
  CommWatch w(watch_, what_);
  while (completed_ < t) finish_head();
}

// ---- UnitPipeline ---------------------------------------------------------------------------------

template <typename C>
UnitPipeline<C>::UnitPipeline(Backend<C>& be, std::unique_ptr<UnitCodec<C>> codec, const OverlapConfig& o)
    : be_(be), codec_(std::move(codec)), plan_(codec_->plan()), ov_(o) {
  Comm& data = codec_->data_comm();
  Comm& watch = codec_->world();
  Comm* replica = codec_->replica_comm();
  const ShardPlan& plan = plan_;
  if (ov_.prefetch < 0) throw std::invalid_argument("option '--prefetch' must be >= 0");
  if (ov_.on && ov_.progress == CommProgress::Thread && !mpi_thread_multiple()) ov_.progress = CommProgress::Poll;
  ag_comm_ = data.duplicate();
  rs_comm_ = data.duplicate();
  // Stream lane (NCCL): the duplicates are split communicators, each with its own communication
  // stream, enqueued in program order; end_pass() synchronizes `data`, which covers them (the one
  // host wait of a pass). Without duplicates both queues share `data` and its stream.
  if (ov_.on && data.stream_ordered()) ordered_lane_ = &data;
  if (replica) {
    rep_comm_ = replica->duplicate();
    rep_ = rep_comm_ ? rep_comm_.get() : replica;
  }
  const bool cpu = be.host_kernels();
  std::function<void()> prep;
  if (cpu) prep = [] { prepare_cpu_helper_thread(); };
  agq_ = CommQueue::make(ag_comm_ ? *ag_comm_ : data, watch, ov_.on, ov_.progress, prep, "FSDP all-gather");
  rsq_ = CommQueue::make(rs_comm_ ? *rs_comm_ : data, watch, ov_.on, ov_.progress, prep, "FSDP reduce-scatter");
  agq_->set_sibling(rsq_.get());
  rsq_->set_sibling(agq_.get());
  const size_t max_padded = static_cast<size_t>(plan.max_padded_numel());
  const int nslots = ov_.on ? 1 + ov_.prefetch : 1, ngrads = ov_.on ? 2 : 1;
  for (int i = 0; i < nslots; ++i) slots_.push_back(Slot{Buffer<C>(be, max_padded)});
  for (int i = 0; i < ngrads; ++i) grads_.push_back(GradBuf{Buffer<C>(be, max_padded)});
  codec_->reserve(nslots);
  if (ov_.on && ov_.progress == CommProgress::Poll && cpu && be.progress() && agq_->background() && !agq_->stream_lane())
    progress_member_ = be.progress()->join(&UnitPipeline<C>::poll_hook, this);
}

template <typename C> UnitPipeline<C>::~UnitPipeline() {
  progress_member_.reset();  // leaves the backend's progress registry
  if (agq_) agq_->set_sibling(nullptr);  // neither may poll the other while it is destroyed
  if (rsq_) rsq_->set_sibling(nullptr);
  agq_.reset();  // each waits for its jobs (which use the codec's buffers), then stops its thread
  rsq_.reset();
}

template <typename C> void UnitPipeline<C>::poll_hook(void* self) { static_cast<UnitPipeline<C>*>(self)->poll_all(); }

template <typename C> void UnitPipeline<C>::poll_all() {
  if (agq_) agq_->poll();
  if (rsq_) rsq_->poll();
}

// A gather buffer to fill for position `pos`: not the one handed out last, not one prefetched for
// a later position; the one handed out last if there is nothing else (a single buffer).
template <typename C> int UnitPipeline<C>::free_slot(int64_t pos) const {
  for (int i = 0; i < num_slots(); ++i)
    if (i != current_ && slots_[i].pos < pos) return i;
  return current_ >= 0 && slots_[current_].pos < pos ? current_ : -1;
}

template <typename C> const C* UnitPipeline<C>::gather(int u) {
  poll_all();
  const int64_t p = pos_++;
  if (in_pass_) rec_.push_back(u);
  int s = -1;
  for (int i = 0; i < num_slots(); ++i)
    if (slots_[i].pos == p) s = i;
  if (s >= 0 && slots_[s].unit != u) {  // the pass left its recorded order: stop following it
    follow_ = false;
    s = -1;
  }
  if (s < 0) {
    if (follow_ && trace_ && static_cast<size_t>(p) >= trace_->size()) follow_ = false;
    s = free_slot(p);
    if (s < 0) throw std::logic_error("UnitPipeline::gather: no free gather buffer");
    Slot& sl = slots_[s];
    agq_->wait(sl.ticket);  // a stale prefetch may still be writing it
    sl.unit = u;
    sl.pos = p;
    sl.ticket = codec_->issue_gather(*agq_, u, sl.buf.data(), s);
    gather_bytes_ += static_cast<double>(plan_.world_size - 1) * static_cast<double>(plan_.units[u].shard_size) * sizeof(C);
  }
  agq_->wait(slots_[s].ticket);
  current_ = s;
  if (follow_ && trace_)
    for (int k = 1; k <= ov_.prefetch; ++k) {
      const int64_t q = p + k;
      if (static_cast<size_t>(q) >= trace_->size()) break;
      bool have = false;
      for (const Slot& sl : slots_) have = have || sl.pos == q;
      if (have) continue;
      const int f = free_slot(p + 1);
      if (f < 0) break;
      Slot& sl = slots_[f];
      agq_->wait(sl.ticket);
      sl.unit = (*trace_)[static_cast<size_t>(q)];
      sl.pos = q;
      sl.ticket = codec_->issue_gather(*agq_, sl.unit, sl.buf.data(), f);
      gather_bytes_ += static_cast<double>(plan_.world_size - 1) *
                       static_cast<double>(plan_.units[static_cast<size_t>(sl.unit)].shard_size) * sizeof(C);
    }
  return slots_[s].buf.data();
}

template <typename C> C* UnitPipeline<C>::full_grad(int u) {
  poll_all();
  const int g = gnext_;
  gnext_ = (gnext_ + 1) % static_cast<int>(grads_.size());
  rsq_->wait(grads_[g].ticket);  // its previous reduce-scatter still reads it
  grads_[g].unit = u;
  grads_[g].ticket = 0;
  be_.zero(grads_[g].buf.data(), static_cast<size_t>(plan_.units[u].padded_numel));
  gcur_ = g;
  return grads_[g].buf.data();
}

template <typename C> void UnitPipeline<C>::reduce_scatter_grad(int u) {
  if (gcur_ < 0 || grads_[gcur_].unit != u)
    throw std::logic_error("UnitPipeline::reduce_scatter_grad(" + std::to_string(u) +
                           "): not the unit of the last full_grad");
  GradBuf& g = grads_[gcur_];
  g.ticket = codec_->issue_reduce(*rsq_, u, g.buf.data(), rep_);
  const double S = static_cast<double>(plan_.units[u].shard_size);
  reduce_bytes_ += static_cast<double>(plan_.world_size - 1) * S * static_cast<double>(codec_->reduce_elem_bytes());
  if (rep_) {
    const double R = rep_->world_size();
    reduce_bytes_ += 2.0 * (R - 1) / R * S * static_cast<double>(codec_->replica_elem_bytes());
  }
  gcur_ = -1;
  poll_all();
}

template <typename C> void UnitPipeline<C>::begin_pass(const std::string& label) {
  if (in_pass_) end_pass();
  agq_->wait_all();
  for (Slot& sl : slots_) sl.pos = -1, sl.unit = -1;
  current_ = -1;
  pos_ = 0;
  label_ = label;
  rec_.clear();
  in_pass_ = true;
  auto it = traces_.find(label);
  trace_ = it == traces_.end() ? nullptr : &it->second;
  follow_ = ov_.on && ov_.prefetch > 0 && trace_ != nullptr;
}

template <typename C> void UnitPipeline<C>::end_pass() {
  agq_->wait_all();
  rsq_->wait_all();
  if (ordered_lane_) ordered_lane_->synchronize();
  for (Slot& sl : slots_) sl.pos = -1, sl.unit = -1;
  current_ = -1;
  if (in_pass_) {
    trace_ = nullptr;  // (it may point into traces_[label_])
    traces_[label_] = std::move(rec_);
    rec_.clear();
  }
  in_pass_ = false;
  follow_ = false;
  pos_ = 0;
}

template <typename C> CommTimes UnitPipeline<C>::comm_times() const {
  CommTimes t;
  t.gather_bytes = gather_bytes_;
  t.reduce_bytes = reduce_bytes_;
  for (const CommQueue* q : {agq_.get(), rsq_.get()})
    if (q) {
      const CommTimes a = q->times();
      t.issued_s += a.issued_s;
      t.exposed_s += a.exposed_s;
      t.collectives += a.collectives;
      t.jobs += a.jobs;
    }
  if (ordered_lane_) {  // the host only enqueued: the device's own times (CUDA events)
    const Comm::DeviceTimes d = ordered_lane_->device_times();
    t.issued_s = d.issued_s;
    t.exposed_s = d.exposed_s;
  }
  return t;
}

template class UnitPipeline<float>;
template class UnitPipeline<double>;
template class UnitPipeline<bf16>;

// ---- IdentityCodec ---------------------------------------------------------------------------------

template <typename T> IdentityCodec<T>::IdentityCodec(ShardedState<T>& state) : s_(state) {
  const ShardPlan& plan = s_.plan();
  const size_t max_shard = static_cast<size_t>(plan.max_shard_size()), W = static_cast<size_t>(plan.world_size);
  slab_ = reduce_slab(plan, kReduceSlab, s_.data_comm().stream_ordered());
  scatter_tmp_ = Buffer<T>(s_.backend(), slab_);
  if (max_shard > slab_) pack_ = Buffer<T>(s_.backend(), slab_ * W);
}

template <typename T> CommQueue::Ticket IdentityCodec<T>::issue_gather(CommQueue& q, int u, T* dst, int) {
  const size_t S = static_cast<size_t>(s_.plan().units[u].shard_size);
  const T* src = s_.param_shard(u);
  // dst is its own gather buffer (the pipeline waits for its ticket before reusing it): no shared buffers.
  return q.submit({1, [=](Comm& c, int) { return c.start_all_gather(src, dst, S); }, {}, false});
}

// The one slab job of both gradient paths. `full` is a full-unit buffer laid out [W, S] (rank r's
// block at r*S). With `direct` (S <= slab, same element type) it is reduce-scattered as it is, in
// one part; else one slab of n <= slab elements of every block per part: stage(packed + r*n,
// full + r*S + a, n) fills the packed [W, n] buffer (a copy, or a widening to fp32; MPI libraries
// allocate a temporary of the whole send buffer, slabs bound it), which is reduce-scattered into
// `out`. add(a, n, out) consumes each summed piece [a, a+n) of this rank's shard, in slab order.
//
// Hybrid sharding (rc != nullptr): after each slab's reduce-scatter comes a part of its own on the
// replica communicator rc: prep(a, n, out) readies rbuf (n elements of R: `out` itself, or `out`
// widened to fp32), a nonblocking all-reduce sums rbuf over the replica groups, and radd(a, n,
// rbuf) consumes it in place of add. Nothing in a job blocks: a blocking replica all-reduce inside
// a polled step let ranks wait on each other across the two communicators (a deadlock).
template <typename F, typename P, typename R, typename Stage, typename Add, typename Prep, typename RAdd>
CommQueue::Ticket submit_reduce_slabs(CommQueue& q, const F* full, size_t S, size_t W, size_t slab, bool direct,
                                      P* packed, P* out, Stage stage, Add add, Comm* rc, R* rbuf, Prep prep,
                                      RAdd radd) {
  const size_t step = direct ? S : slab;
  const int per = rc ? 2 : 1;  // parts per slab
  const int parts = static_cast<int>((S + step - 1) / step) * per;
  auto piece = [=](int i) {
    const size_t a = static_cast<size_t>(i / per) * step;
    return std::pair<size_t, size_t>(a, std::min(step, S - a));
  };
  return q.submit({parts,
                   [=](Comm& c, int i) -> std::unique_ptr<Comm::Request> {
                     const auto [a, n] = piece(i);
                     if (rc && i % 2 == 1) {
                       prep(a, n, out);
                       return rc->start_all_reduce_sum(rbuf, n);
                     }
                     if (direct) {
                       if constexpr (std::is_same_v<F, P>) return c.start_reduce_scatter_sum(full, out, S);
                       else throw std::logic_error("submit_reduce_slabs: direct needs one element type");
                     }
                     for (size_t r = 0; r < W; ++r) stage(packed + r * n, full + r * S + a, n);
                     return c.start_reduce_scatter_sum(static_cast<const P*>(packed), out, n);
                   },
                   [=](int i) {
                     const auto [a, n] = piece(i);
                     if (!rc) add(a, n, out);
                     else if (i % 2 == 1) radd(a, n, rbuf);
                   },
                   true});  // packed, out and rbuf serve every reduce-scatter job of the queue
}

// Summed over the replica groups (HSDP), divided by W = G * R and added into the gradient shard.
template <typename T>
CommQueue::Ticket IdentityCodec<T>::issue_reduce(CommQueue& q, int u, const T* full, Comm* replica) {
  // G: ranks of the shard group (blocks of the buffer); the mean is over all G * R ranks.
  const size_t S = static_cast<size_t>(s_.plan().units[u].shard_size), G = static_cast<size_t>(s_.plan().world_size);
  const T inv_w = T(1) / static_cast<T>(G * static_cast<size_t>(s_.replicas()));
  T* shard = s_.grad_shard(u);
  Backend<T>* be = &s_.backend();
  auto add = [=](size_t a, size_t n, const T* sum) { be->axpy(n, inv_w, sum, shard + a); };
  return submit_reduce_slabs(
      q, full, S, G, slab_, S <= slab_, pack_.data(), scatter_tmp_.data(),
      [=](T* d, const T* src, size_t n) { be->copy(d, src, n); }, add, replica, scatter_tmp_.data(),
      [](size_t, size_t, const T*) {}, add);
}

template <typename T> std::vector<T> ShardedState<T>::gather_param(const std::string& name) {
  for (size_t u = 0; u < plan_.units.size(); ++u)
    for (auto& slot : plan_.units[u].params)
      if (slot.spec.name == name) {
        const UnitPlan& up = plan_.units[u];
        Buffer<T> full(be_, static_cast<size_t>(up.padded_numel));
        dcomm_->all_gather(static_cast<const T*>(params_[u].data()), full.data(), static_cast<size_t>(up.shard_size));
        std::vector<T> out(static_cast<size_t>(slot.numel));
        be_.to_host(out.data(), full.data() + slot.offset, out.size());
        return out;
      }
  throw std::out_of_range("no parameter named '" + name + "'");
}

template <typename T> void ShardedState<T>::set_param(const std::string& name, const std::vector<T>& full) {
  int r = plan_rank();
  for (size_t u = 0; u < plan_.units.size(); ++u)
    for (auto& slot : plan_.units[u].params)
      if (slot.spec.name == name) {
        if (static_cast<int64_t>(full.size()) != slot.numel)
          throw std::invalid_argument("set_param '" + name + "': expected " + std::to_string(slot.numel) +
                                      " elements, got " + std::to_string(full.size()));
        const RankShard& rs = plan_.units[u].ranks[r];
        int64_t lo = std::max(slot.offset, rs.start), hi = std::min(slot.offset + slot.numel, rs.start + rs.valid);
        if (hi > lo)
          be_.from_host(params_[u].data() + (lo - rs.start), full.data() + (lo - slot.offset),
                        static_cast<size_t>(hi - lo));
        return;
      }
  throw std::out_of_range("no parameter named '" + name + "'");
}

namespace {
// The shard-local ranges [begin, end) of unit plan `up`'s TP-replicated parameters in rank r's shard.
std::vector<std::pair<int64_t, int64_t>> replicated_ranges(const UnitPlan& up, int r) {
  std::vector<std::pair<int64_t, int64_t>> v;
  const RankShard& rs = up.ranks[static_cast<size_t>(r)];
  for (const ParamSlot& slot : up.params) {
    if (!slot.spec.tp_replicated()) continue;
    const int64_t lo = std::max(slot.offset, rs.start), hi = std::min(slot.offset + slot.numel, rs.start + rs.valid);
    if (lo < hi) v.emplace_back(lo - rs.start, hi - rs.start);
  }
  return v;
}
}  // namespace

template <typename T> double ShardedState<T>::local_grad_sumsq(bool include_replicated) {
  int r = plan_rank();
  std::vector<const T*> x;
  std::vector<size_t> n;
  for (size_t u = 0; u < plan_.units.size(); ++u) {
    const int64_t valid = plan_.units[u].ranks[r].valid;
    if (include_replicated) {  // the shard's valid elements in one piece (without TP: always)
      x.push_back(grads_[u].data());
      n.push_back(static_cast<size_t>(valid));
      continue;
    }
    int64_t at = 0;  // the valid elements between the replicated ranges
    for (auto [b, e] : replicated_ranges(plan_.units[u], r)) {
      if (b > at) { x.push_back(grads_[u].data() + at); n.push_back(static_cast<size_t>(b - at)); }
      at = e;
    }
    if (valid > at) { x.push_back(grads_[u].data() + at); n.push_back(static_cast<size_t>(valid - at)); }
  }
  return be_.sum_squares_many(x.data(), n.data(), x.size());
}

template <typename T> void ShardedState<T>::sum_replicated_grads(const std::function<void(T*, size_t)>& sum) {
  const int r = plan_rank();
  for (size_t u = 0; u < plan_.units.size(); ++u)
    for (auto [b, e] : replicated_ranges(plan_.units[u], r)) sum(grads_[u].data() + b, static_cast<size_t>(e - b));
}

Bf16Codec::Bf16Codec(ShardedState<float>& master, Backend<bf16>& be, bool reduce_bf16, size_t widen_slab)
    : m_(master), be_(be), reduce_bf16_(reduce_bf16) {
  const size_t max_shard = static_cast<size_t>(m_.plan().max_shard_size());
  if (reduce_bf16_) {
    scatter_ = Buffer<bf16>(be_, max_shard);
  } else {
    slab_ = reduce_slab(m_.plan(), widen_slab, m_.data_comm().stream_ordered());
    grad32_ = Buffer<float>(m_.backend(), slab_ * static_cast<size_t>(m_.plan().world_size));
    scatter32_ = Buffer<float>(m_.backend(), slab_);
  }
  if (reduce_bf16_ && m_.replica_comm()) replica32_ = Buffer<float>(m_.backend(), max_shard);
}

void Bf16Codec::reserve(int slots) {
  const size_t max_shard = static_cast<size_t>(m_.plan().max_shard_size());
  while (static_cast<int>(shard_.size()) < slots) shard_.emplace_back(be_, max_shard);
}

// This rank's fp32 shard is rounded to bf16 (in the slot's own staging buffer, at once: the master
// shard does not change within a pass), then the bf16 shards are all-gathered.
CommQueue::Ticket Bf16Codec::issue_gather(CommQueue& q, int u, bf16* dst, int slot) {
  const size_t S = static_cast<size_t>(m_.plan().units[u].shard_size);
  bf16* stage = shard_[static_cast<size_t>(slot)].data();
  be_.from_f32(stage, m_.param_shard(u), S);
  return q.submit(
      {1, [=](Comm& c, int) { return c.start_all_gather(static_cast<const bf16*>(stage), dst, S); }, {}, false});
}

// bf16 reduce: the whole shard at once (scatter_ is shard-sized), the mean added into the fp32
// gradient shard. fp32 reduce: widened to fp32 a slab at a time ([W, n] of at most slab_ * W floats),
// so no fp32 copy of a whole unit exists (stream lane: slab_ is the largest shard, one part).
// Hybrid sharding: the group's sum is summed over the replica groups in fp32 (a bf16 group sum is
// widened into replica32_ first) before the mean over W = G * R is added.
CommQueue::Ticket Bf16Codec::issue_reduce(CommQueue& q, int u, const bf16* full, Comm* replica) {
  // G: ranks of the shard group (blocks of the buffer); the mean is over all G * R ranks.
  const size_t S = static_cast<size_t>(m_.plan().units[u].shard_size), G = static_cast<size_t>(m_.plan().world_size);
  const float inv_w = 1.0f / static_cast<float>(G * static_cast<size_t>(m_.replicas()));
  float* shard = m_.grad_shard(u);
  Backend<bf16>* be = &be_;
  Backend<float>* b32 = &m_.backend();
  Comm* rc = replica;
  auto add32 = [=](size_t a, size_t n, const float* sum) { b32->axpy(n, inv_w, sum, shard + a); };
  if (reduce_bf16_) {
    float* w = replica32_.data();  // jobs run one at a time (FIFO): one buffer serves them all
    return submit_reduce_slabs(
        q, full, S, G, S, true, static_cast<bf16*>(nullptr), scatter_.data(), [](bf16*, const bf16*, size_t) {},
        [=](size_t a, size_t n, const bf16* sum) { be->add_to_f32(shard + a, inv_w, sum, n); }, rc, w,
        [=](size_t, size_t n, const bf16* sum) {  // the group's bf16 sum, widened for the fp32 replica sum
          b32->zero(w, n);
          be->add_to_f32(w, 1.0f, sum, n);
        },
        add32);
  }
  return submit_reduce_slabs(
      q, full, S, G, slab_, false, grad32_.data(), scatter32_.data(),
      [=](float* d, const bf16* src, size_t n) {
        b32->zero(d, n);
        be->add_to_f32(d, 1.0f, src, n);
      },
      add32, rc, scatter32_.data(), [](size_t, size_t, const float*) {}, add32);
}

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

template class ShardedState<float>;
template class ShardedState<double>;
template class IdentityCodec<float>;
template class IdentityCodec<double>;

}  // namespace shardtrain
