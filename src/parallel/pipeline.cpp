// Pipeline parallelism's room (pipeline.h): the layout of a run's stages, the units each rank holds,
// and the point-to-point link between the stages of a PP group.
#include "shardtrain/pipeline.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "shardtrain/bf16.h"

namespace shardtrain {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Tags on the PP group's Comm: one per (chunk, direction); every schedule moves a chunk's
// micro-batches in increasing order, so MPI's non-overtaking rule matches them (pipeline.h).
constexpr int kTagBase = 16;
int tag(int chunk, bool grad) { return kTagBase + 2 * chunk + (grad ? 1 : 0); }
// Chunks the tags can name (Comm::kP2pTagLimit, the ring shift's tag kept free).
constexpr int kMaxChunks = (Comm::kP2pTagLimit - kTagBase) / 2 - 1;

// "--pp-layers: the counts ..." (pipeline_schedule.cpp's words) -> "option '--pp-layers': the counts ...".
std::string as_option(const std::string& why) {
  const size_t c = why.find(": ");
  if (!why.starts_with("--") || c == std::string::npos) return why;
  return "option '" + why.substr(0, c) + "'" + why.substr(c);
}
}  // namespace

std::vector<int> PipelineLayout::rank_chunks(int r) const {
  std::vector<int> c;
  for (int j = 0; j < chunks_per_rank; ++j) c.push_back(r + j * ranks);
  return c;
}

std::unique_ptr<Schedule> PipelineLayout::schedule(int microbatches, bool backward) const {
  if (ranks == 1) return std::make_unique<GradAccumulation>(microbatches, bounds.back(), backward);
  return std::make_unique<PipelineSchedule>(kind, ranks, chunks_per_rank, microbatches, bounds, backward);
}

PipelineLayout resolve_pipeline(const ModelConfig& mc, int pp, const PipelineOptions& o, int microbatches,
                                std::string* why) {
  why->clear();
  const int L = mc.num_hidden_layers;
  PipelineLayout pl;
  if (pp <= 1) {  // the layout options mean nothing without stages: refused rather than ignored
    if (!o.layers.empty()) *why = "option '--pp-layers' needs '--pp' P > 1 (pipeline stages)";
    else if (o.chunks_per_rank != 1) *why = "option '--pp-virtual' needs '--pp' P > 1 (pipeline stages)";
    pl.bounds = {0, L};
    return pl;
  }
  pl.kind = o.kind;
  pl.ranks = pp;
  pl.chunks_per_rank = o.chunks_per_rank;
  if (o.kind == PipelineKind::Interleaved && o.chunks_per_rank < 2) {
    *why = "option '--pp-schedule interleaved' needs '--pp-virtual' V >= 2 model chunks per pipeline rank (got " +
           std::to_string(o.chunks_per_rank) + ")";
    return pl;
  }
  if (o.kind != PipelineKind::Interleaved && o.chunks_per_rank != 1) {
    *why = "option '--pp-virtual' (" + std::to_string(o.chunks_per_rank) + ") needs '--pp-schedule interleaved' (got '" +
           pipeline_kind_name(o.kind) + "')";
    return pl;
  }
  const int64_t S = int64_t{pp} * o.chunks_per_rank;
  if (S > kMaxChunks) {
    *why = "'--pp' x '--pp-virtual' (" + std::to_string(S) + " chunks) is more than the " + std::to_string(kMaxChunks) +
           " chunks a pipeline can name";
    return pl;
  }
  std::string split_why;
  pl.bounds = pipeline_split(L, static_cast<int>(S), o.layers, &split_why);
  if (!split_why.empty()) {
    // pipeline_split names --pp-layers itself when the counts are the problem.
    *why = o.layers.empty() ? "'--pp' " + std::to_string(pp) +
                                  (o.chunks_per_rank > 1 ? " x '--pp-virtual' " + std::to_string(o.chunks_per_rank) : "") +
                                  ": " + split_why
                            : as_option(split_why);
    return pl;
  }
  if (microbatches > 0) {
    const std::string p = pipeline_schedule_problem(o.kind, pp, o.chunks_per_rank, microbatches);
    if (!p.empty()) *why = as_option(p) + " (micro-batches per step = global batch / (data-parallel ranks x micro-batch))";
  }
  return pl;
}

RankUnits pipeline_rank_units(const ModelConfig& mc, const PipelineLayout& pl, int r, int tp, int tp_rank) {
  RankUnits ru;
  const int L = mc.num_hidden_layers;
  if (pl.ranks == 1) {
    ru.units = llama_units(mc, tp, tp_rank);
    ru.ranges.push_back(BlockRange{0, L, {}});
    ru.embedding = 0;
    return ru;
  }
  for (int c : pl.rank_chunks(r)) {
    const int b = pl.bounds[static_cast<size_t>(c)], e = pl.bounds[static_cast<size_t>(c) + 1];
    BlockRange range = llama_stage_range(mc, b, e);
    const int offset = static_cast<int>(ru.units.size());
    for (int& u : range.units)
      if (u >= 0) u += offset;
    if (range.units[0] >= 0) {
      ru.embedding = range.units[0];
      ru.tied_copy = b > 0;  // held for the tied LM head only
      ru.tied = mc.tie_word_embeddings;
    }
    for (UnitSpec& s : llama_stage_units(mc, b, e, tp, tp_rank)) ru.units.push_back(std::move(s));
    ru.ranges.push_back(std::move(range));
  }
  return ru;
}

template <typename C> struct StageLink<C>::Xfer {
  std::unique_ptr<Comm::Request> req;
  const C* buf;
  int chunk;
  bool grad;
  Clock::time_point t0;
  bool done = false;  // test() returned true: the buffer is free, no wait needed
};

template <typename C>
StageLink<C>::StageLink(Comm& comm, const PipelineLayout& pl, Backend<C>& be)
    : comm_(comm), pl_(pl), be_(be), reg_(be.progress()) {
  if (comm.world_size() != pl.ranks)
    throw std::invalid_argument("StageLink: the PP group has " + std::to_string(comm.world_size()) +
                                " ranks, the layout " + std::to_string(pl.ranks) + " stages");
}

template <typename C> StageLink<C>::~StageLink() {
  member_.reset();
  try {
    for (auto& x : recvs_)
      if (!x->done) x->req->wait();
    for (auto& x : sends_)
      if (!x->done) x->req->wait();
  } catch (...) {  // a failed transfer was reported where it was waited for; nothing to add here
  }
}

template <typename C> void StageLink<C>::poll(void* self) { static_cast<StageLink*>(self)->test_all(); }

template <typename C> void StageLink<C>::test_all() {
  for (auto* v : {&sends_, &recvs_})
    for (auto& x : *v)
      if (!x->done && x->req->test()) {
        x->done = true;
        issued_s_ += since(x->t0);
      }
}

// A member of the progress registry while anything is in flight (joined and left on the compute thread).
template <typename C> void StageLink<C>::update_membership() {
  if (!reg_) return;
  const bool busy = !sends_.empty() || !recvs_.empty();
  if (busy && !member_.joined()) member_ = reg_->join(&StageLink::poll, this);
  if (!busy && member_.joined()) member_.reset();
}

template <typename C> void StageLink<C>::post_recv(int chunk, bool grad, C* buf, size_t n) {
  const int from = grad ? chunk + 1 : chunk - 1;
  recvs_.push_back(std::make_unique<Xfer>(
      Xfer{comm_.start_recv(buf, n, pl_.rank_of(from), tag(from, grad)), buf, chunk, grad, Clock::now()}));
  ++calls_;
  update_membership();
}

template <typename C> void StageLink<C>::wait_recv(int chunk, bool grad, C* buf, size_t n) {
  auto it = recvs_.begin();
  while (it != recvs_.end() && ((*it)->chunk != chunk || (*it)->grad != grad)) ++it;
  if (it == recvs_.end()) {
    post_recv(chunk, grad, buf, n);
    it = recvs_.end() - 1;
  }
  if ((*it)->buf != buf) throw std::logic_error("StageLink::wait_recv: the oldest posted receive is into another buffer");
  if (!(*it)->done) {
    const auto t0 = Clock::now();
    (*it)->req->wait();
    exposed_s_ += since(t0);
    issued_s_ += since((*it)->t0);
  }
  recvs_.erase(it);
  update_membership();
}

template <typename C> void StageLink<C>::send(int chunk, bool grad, const C* src, size_t n) {
  const int to = grad ? chunk - 1 : chunk + 1;
  test_all();
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(), [](const auto& x) { return x->done; }), sends_.end());
  // A pool buffer no send in flight uses (sends_ now holds only those in flight), else a new one.
  C* buf = nullptr;
  for (Buffer<C>& b : pool_) {
    if (b.size() < n) continue;
    bool used = false;
    for (const auto& x : sends_) used = used || x->buf == b.data();
    if (!used) {
      buf = b.data();
      break;
    }
  }
  if (!buf) {
    pool_.emplace_back(be_, n);
    buf = pool_.back().data();
  }
  be_.copy(buf, src, n);
  sends_.push_back(std::make_unique<Xfer>(
      Xfer{comm_.start_send(static_cast<const C*>(buf), n, pl_.rank_of(to), tag(chunk, grad)), buf, chunk, grad,
           Clock::now()}));
  ++calls_;
  bytes_ += static_cast<double>(n) * sizeof(C);
  update_membership();
}

template <typename C> void StageLink<C>::sum_tied(Backend<float>& be, float* grad, size_t n) {
  const double b = sum_tied_grads(comm_, be, grad, n);
  if (b > 0) {
    calls_ += 2;
    bytes_ += b;
  }
}

template <typename C> void StageLink<C>::flush() {
  const auto t0 = Clock::now();
  for (auto& x : sends_)
    if (!x->done) {
      x->req->wait();
      x->done = true;
      issued_s_ += since(x->t0);
    }
  sends_.clear();
  exposed_s_ += since(t0);
  update_membership();
}

template <typename T> double sum_tied_grads(Comm& comm, Backend<T>& be, T* grad, size_t n) {
  const int p = comm.world_size(), r = comm.rank();
  if (p == 1 || (r != 0 && r != p - 1) || n == 0) return 0;
  const int peer = r == 0 ? p - 1 : 0;
  Buffer<T> other(be, n);
  auto rq = comm.start_recv(other.data(), n, peer, kTagBase - 1);
  auto sq = comm.start_send(static_cast<const T*>(grad), n, peer, kTagBase - 1);
  rq->wait();
  sq->wait();
  be.axpy(n, 1, other.data(), grad);
  return static_cast<double>(n) * sizeof(T);
}
template double sum_tied_grads<float>(Comm&, Backend<float>&, float*, size_t);
template double sum_tied_grads<double>(Comm&, Backend<double>&, double*, size_t);

template class StageLink<float>;
template class StageLink<double>;
template class StageLink<bf16>;

}  // namespace shardtrain
