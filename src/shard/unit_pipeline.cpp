// The unit pipeline (unit_pipeline.h): gather buffers, prefetch along the recorded order of a pass,
// gradient buffers, the two CommQueues.
#include "shardtrain/shard/unit_pipeline.h"
#include <algorithm>
#include <set>
#include <stdexcept>

namespace shardtrain {

// ---- UnitPipeline ---------------------------------------------------------------------------------

template <typename C>
UnitPipeline<C>::UnitPipeline(Backend<C>& be, std::unique_ptr<UnitCodec<C>> codec, const OverlapConfig& o,
                              Reshard reshard)
    : be_(be), codec_(std::move(codec)), plan_(codec_->plan()), ov_(o), reshard_(reshard) {
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
  // PerPass: one gather buffer (gathers outside a pass; a pass gathers into the units' own), and
  // the codec's staging for the kept gathers in flight at once (1 + prefetch).
  const int in_flight = ov_.on ? 1 + ov_.prefetch : 1, ngrads = ov_.on ? 2 : 1;
  const int nslots = reshard_ == Reshard::PerPass ? 1 : in_flight;
  for (int i = 0; i < nslots; ++i) slots_.push_back(Slot{Buffer<C>(be, max_padded)});
  for (int i = 0; i < ngrads; ++i) grads_.push_back(GradBuf{Buffer<C>(be, max_padded)});
  codec_->reserve(in_flight);
  if (reshard_ == Reshard::PerPass) {
    kept_.resize(plan.units.size());
    staging_.assign(static_cast<size_t>(in_flight), 0);
  }
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

template <typename C> void UnitPipeline<C>::count_gather(int u) {
  gather_bytes_ += static_cast<double>(plan_.world_size - 1) *
                   static_cast<double>(plan_.units[static_cast<size_t>(u)].shard_size) * sizeof(C);
  ++unit_gathers_;
}

template <typename C> void UnitPipeline<C>::count_reduce(int u) {
  const double S = static_cast<double>(plan_.units[static_cast<size_t>(u)].shard_size);
  reduce_bytes_ += static_cast<double>(plan_.world_size - 1) * S * static_cast<double>(codec_->reduce_elem_bytes());
  if (rep_) {
    const double R = rep_->world_size();
    reduce_bytes_ += 2.0 * (R - 1) / R * S * static_cast<double>(codec_->replica_elem_bytes());
  }
  ++unit_reduces_;
}

// PerPass: unit u's gather into its kept buffer, through the codec's staging buffers in turn (a
// buffer is reused once the gather before through it is done).
template <typename C> void UnitPipeline<C>::issue_kept(int u) {
  Kept& k = kept_[static_cast<size_t>(u)];
  if (!k.param.data()) k.param = Buffer<C>(be_, static_cast<size_t>(plan_.units[static_cast<size_t>(u)].padded_numel));
  const int s = staging_next_;
  staging_next_ = (staging_next_ + 1) % static_cast<int>(staging_.size());
  agq_->wait(staging_[static_cast<size_t>(s)]);
  k.ticket = codec_->issue_gather(*agq_, u, k.param.data(), s);
  staging_[static_cast<size_t>(s)] = k.ticket;
  k.gathered = true;
  first_.push_back(u);
  count_gather(u);
}

template <typename C> const C* UnitPipeline<C>::gather_kept(int u) {
  if (u < 0 || static_cast<size_t>(u) >= kept_.size())
    throw std::out_of_range("UnitPipeline::gather: unit " + std::to_string(u) + " is not in the plan");
  Kept& k = kept_[static_cast<size_t>(u)];
  if (!k.gathered) issue_kept(u);
  else if (!k.asked) --ahead_;  // a prefetched unit, asked for now
  k.asked = true;
  // Prefetch along the order the last pass of this label first gathered its units in: keep up to
  // `prefetch` units gathered ahead of those asked for. (A pass that leaves that order only
  // gathers early units it would gather anyway, or ones it does not use: never wrong.)
  if (follow_ && trace_)
    while (ahead_ < ov_.prefetch && trace_next_ < trace_->size()) {
      const int v = (*trace_)[trace_next_++];
      if (kept_[static_cast<size_t>(v)].gathered) continue;
      issue_kept(v);
      ++ahead_;
    }
  agq_->wait(k.ticket);
  return k.param.data();
}

template <typename C> const C* UnitPipeline<C>::gather(int u) {
  poll_all();
  if (keeping()) return gather_kept(u);
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
    count_gather(u);
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
      count_gather(sl.unit);
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
  if (keeping()) {  // into u's accumulator: no communication until end_pass
    Kept& k = kept_[static_cast<size_t>(u)];
    const size_t n = static_cast<size_t>(plan_.units[static_cast<size_t>(u)].padded_numel);
    if (!k.grad.data()) k.grad = Buffer<Acc>(codec_->acc_backend(), n);
    if (!k.accumulated) {
      codec_->acc_backend().zero(k.grad.data(), n);
      k.accumulated = true;
      accumulated_.push_back(u);
    }
    codec_->accumulate(k.grad.data(), g.buf.data(), n);
    gcur_ = -1;
    poll_all();
    return;
  }
  g.ticket = codec_->issue_reduce(*rsq_, u, g.buf.data(), rep_);
  count_reduce(u);
  gcur_ = -1;
  poll_all();
}

// PerPass, at end_pass: each accumulator reduce-scattered once, in the order of its first gradient;
// the scratch buffers in turn as the codec's staging (bf16 reduce), each reused once its last
// reduce is done.
template <typename C> void UnitPipeline<C>::reduce_kept() {
  for (const int u : accumulated_) {
    Kept& k = kept_[static_cast<size_t>(u)];
    const int g = gnext_;
    gnext_ = (gnext_ + 1) % static_cast<int>(grads_.size());
    rsq_->wait(grads_[g].ticket);
    grads_[g].unit = -1;
    grads_[g].ticket = codec_->issue_reduce_acc(*rsq_, u, k.grad.data(), grads_[g].buf.data(), rep_);
    count_reduce(u);
    k.accumulated = false;
    poll_all();
  }
  accumulated_.clear();
}

template <typename C> void UnitPipeline<C>::begin_pass(const std::string& label) {
  if (in_pass_) end_pass();
  agq_->wait_all();
  for (Slot& sl : slots_) sl.pos = -1, sl.unit = -1;
  current_ = -1;
  pos_ = 0;
  label_ = label;
  rec_.clear();
  first_.clear();
  trace_next_ = 0;
  ahead_ = 0;
  in_pass_ = true;
  auto it = traces_.find(label);
  trace_ = it == traces_.end() ? nullptr : &it->second;
  follow_ = ov_.on && ov_.prefetch > 0 && trace_ != nullptr;
}

template <typename C> void UnitPipeline<C>::end_pass() {
  if (keeping()) reduce_kept();  // (a full_grad never handed back is dropped, as PerUse drops it)
  agq_->wait_all();
  rsq_->wait_all();
  if (ordered_lane_) ordered_lane_->synchronize();
  for (Slot& sl : slots_) sl.pos = -1, sl.unit = -1;
  current_ = -1;
  if (in_pass_) {
    trace_ = nullptr;  // (it may point into traces_[label_])
    // PerPass follows the order of first gathers; PerUse the order of every gather.
    traces_[label_] = std::move(reshard_ == Reshard::PerPass ? first_ : rec_);
    rec_.clear();
    first_.clear();
    for (Kept& k : kept_) k.gathered = k.asked = false;
  }
  in_pass_ = false;
  follow_ = false;
  pos_ = 0;
}

template <typename C> CommTimes UnitPipeline<C>::comm_times() const {
  CommTimes t;
  t.gather_bytes = gather_bytes_;
  t.reduce_bytes = reduce_bytes_;
  t.unit_gathers = unit_gathers_;
  t.unit_reduces = unit_reduces_;
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

// ---- GroupedUnits ---------------------------------------------------------------------------------

template <typename C>
GroupedUnits<C>::GroupedUnits(std::vector<std::unique_ptr<UnitPipeline<C>>> lanes, const ShardPlan& plan)
    : lanes_(std::move(lanes)) {
  std::vector<int> count(lanes_.size(), 0);
  for (const UnitPlan& up : plan.units) {
    if (up.group < 0 || static_cast<size_t>(up.group) >= lanes_.size() || !lanes_[static_cast<size_t>(up.group)])
      throw std::invalid_argument("GroupedUnits: unit '" + up.name + "' is in group " + std::to_string(up.group) +
                                  ", which has no pipeline");
    group_.push_back(up.group);
    local_.push_back(count[static_cast<size_t>(up.group)]++);
  }
  for (size_t g = 0; g < lanes_.size(); ++g)
    if (lanes_[g] && static_cast<int>(lanes_[g]->units()) != count[g])
      throw std::invalid_argument("GroupedUnits: group " + std::to_string(g) + "'s pipeline has " +
                                  std::to_string(lanes_[g]->units()) + " units, the plan " + std::to_string(count[g]));
}

template <typename C> UnitPipeline<C>& GroupedUnits<C>::lane(int u) {
  if (u < 0 || static_cast<size_t>(u) >= group_.size())
    throw std::out_of_range("GroupedUnits: unit " + std::to_string(u) + " is not in the plan");
  return *lanes_[static_cast<size_t>(group_[static_cast<size_t>(u)])];
}

template <typename C> void GroupedUnits<C>::begin_pass(const std::string& label) {
  for (auto& l : lanes_) l->begin_pass(label);
}

template <typename C> void GroupedUnits<C>::end_pass() {
  for (auto& l : lanes_) l->end_pass();
}

template <typename C> CommTimes GroupedUnits<C>::comm_times() const {
  CommTimes t;
  for (const auto& l : lanes_) {
    const CommTimes a = l->comm_times();
    t.issued_s += a.issued_s;
    t.exposed_s += a.exposed_s;
    t.collectives += a.collectives;
    t.jobs += a.jobs;
    t.gather_bytes += a.gather_bytes;
    t.reduce_bytes += a.reduce_bytes;
    t.unit_gathers += a.unit_gathers;
    t.unit_reduces += a.unit_reduces;
  }
  return t;
}

template class GroupedUnits<float>;
template class GroupedUnits<double>;
template class GroupedUnits<bf16>;

template class UnitPipeline<float>;
template class UnitPipeline<double>;
template class UnitPipeline<bf16>;

}  // namespace shardtrain
