// The unit pipeline (unit_pipeline.h): gather buffers, prefetch along the recorded order of a pass,
// gradient buffers, the two CommQueues.
#include "shardtrain/unit_pipeline.h"
#include <algorithm>
#include <set>
#include <stdexcept>

namespace shardtrain {

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

}  // namespace shardtrain
