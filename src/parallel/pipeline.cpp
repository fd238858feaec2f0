// Pipeline parallelism's room (pipeline.h): the layout of a run's stages, the units each rank holds,
// and the point-to-point link between the stages of a PP group.
#include "shardtrain/parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "shardtrain/backend/bf16.h"

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

std::vector<int> pipeline_contexts(const PipelineLayout& pl, int pp_rank, int microbatches, int* peak) {
  if (pl.ranks <= 1) {
    if (peak) *peak = 1;
    return {1};
  }
  const std::unique_ptr<Schedule> s = pl.schedule(microbatches);
  const std::vector<int> chunks = pl.rank_chunks(pp_rank);
  std::vector<int> now(chunks.size(), 0), most(chunks.size(), 0);
  bool split = false;
  const std::vector<Action> all = s->actions();
  for (const Action& a : all) split = split || (a.stage == pp_rank && a.kind == ActionKind::BackwardWeight);
  for (const Action& a : all) {
    if (a.stage != pp_rank) continue;
    const size_t j = static_cast<size_t>(a.chunk / pl.ranks);
    if (a.kind == ActionKind::Forward) most[j] = std::max(most[j], ++now[j]);
    if (a.kind == ActionKind::BackwardWeight || (a.kind == ActionKind::Backward && !split) ||
        (a.kind == ActionKind::BackwardInput && !split))
      --now[j];
  }
  if (peak) {
    const PipelineTimeline t = simulate(*s, {ActionTimes{}});
    if (!t.error.empty()) throw std::logic_error("pipeline_contexts: " + t.error);
    *peak = t.peak_in_flight[static_cast<size_t>(pp_rank)];
  }
  return most;
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
  if (o.kind == PipelineKind::ZeroBubble && mc.is_moe()) {  // LlamaModel::backward_input: dense blocks only
    *why = "option '--pp-schedule zero-bubble' with a mixture-of-experts model (" + mc.architecture +
           ") is not built yet: the split backward covers dense blocks only; use gpipe, 1f1b or interleaved";
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

RankUnits pipeline_rank_units(const ModelConfig& mc, const PipelineLayout& pl, int r, int tp, int tp_rank, int ep,
                              int ep_rank) {
  RankUnits ru;
  const int L = mc.num_hidden_layers;
  if (pl.ranks == 1) {
    ru.units = llama_units(mc, tp, tp_rank, ep, ep_rank);
    ru.ranges.push_back(BlockRange{0, L, {}});
    ru.embedding = 0;
    return ru;
  }
  for (int c : pl.rank_chunks(r)) {
    const int b = pl.bounds[static_cast<size_t>(c)], e = pl.bounds[static_cast<size_t>(c) + 1];
    BlockRange range = llama_stage_range(mc, b, e, ep);
    const int offset = static_cast<int>(ru.units.size());
    for (int& u : range.units)
      if (u >= 0) u += offset;
    if (range.units[0] >= 0) {
      ru.embedding = range.units[0];
      ru.tied_copy = b > 0;  // held for the tied LM head only
      ru.tied = mc.tie_word_embeddings;
    }
    for (UnitSpec& s : llama_stage_units(mc, b, e, tp, tp_rank, ep, ep_rank)) ru.units.push_back(std::move(s));
    ru.ranges.push_back(std::move(range));
  }
  return ru;
}

const char* p2p_order_name(P2pOrder o) { return o == P2pOrder::PerAction ? "per action" : "per pair"; }

std::vector<size_t> p2p_slot_starts(const std::vector<Action>& acts, P2pOrder order) {
  std::vector<size_t> starts;
  for (size_t i = 0; i < acts.size(); ++i) {
    starts.push_back(i);
    const bool pair = order == P2pOrder::PerPair && i + 1 < acts.size() && acts[i].kind == ActionKind::Forward &&
                      (acts[i + 1].kind == ActionKind::Backward || acts[i + 1].kind == ActionKind::BackwardInput);
    if (pair) ++i;
  }
  return starts;
}

bool action_receive(const Action& a, const PipelineLayout& pl, P2pTransfer* t) {
  const int S = pl.chunks();
  if (a.kind == ActionKind::Forward && a.chunk > 0) {
    *t = {true, pl.rank_of(a.chunk - 1), a.chunk - 1, false, a.microbatch};
    return true;
  }
  if ((a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput) && a.chunk < S - 1) {
    *t = {true, pl.rank_of(a.chunk + 1), a.chunk + 1, true, a.microbatch};
    return true;
  }
  return false;
}

bool action_send(const Action& a, const PipelineLayout& pl, P2pTransfer* t) {
  const int S = pl.chunks();
  if (a.kind == ActionKind::Forward && a.chunk < S - 1) {
    *t = {false, pl.rank_of(a.chunk + 1), a.chunk, false, a.microbatch};
    return true;
  }
  if ((a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput) && a.chunk > 0) {
    *t = {false, pl.rank_of(a.chunk - 1), a.chunk, true, a.microbatch};
    return true;
  }
  return false;
}

P2pGroups pipeline_p2p_groups(const Schedule& schedule, const PipelineLayout& pl, int r, P2pOrder order) {
  std::vector<Action> acts;
  for (const Action& a : schedule.actions())
    if (a.stage == r) acts.push_back(a);
  std::vector<size_t> starts = p2p_slot_starts(acts, order);
  starts.push_back(acts.size());
  P2pGroups groups;
  std::vector<P2pTransfer> held;  // the sends of the slot before
  P2pTransfer t;
  for (size_t k = 0; k + 1 < starts.size(); ++k) {
    std::vector<P2pTransfer> g = std::move(held);
    held.clear();
    for (size_t i = starts[k]; i < starts[k + 1]; ++i) {
      if (action_receive(acts[i], pl, &t)) g.push_back(t);
      if (action_send(acts[i], pl, &t)) held.push_back(t);
    }
    if (!g.empty()) groups.push_back(std::move(g));
  }
  if (!held.empty()) groups.push_back(std::move(held));
  return groups;
}

P2pOrder pipeline_p2p_order(const Schedule& schedule, const PipelineLayout& pl, std::string* why) {
  why->clear();
  std::string first;
  for (P2pOrder o : {P2pOrder::PerAction, P2pOrder::PerPair}) {
    std::vector<P2pGroups> all;
    for (int r = 0; r < pl.ranks; ++r) all.push_back(pipeline_p2p_groups(schedule, pl, r, o));
    const std::string p = p2p_groups_problem(all);
    if (p.empty()) return o;
    if (first.empty()) first = p;
  }
  *why = "no order of grouped transfers runs " + schedule.name() + " on a stream-ordered Comm (NCCL): " + first;
  return P2pOrder::PerAction;
}

std::string p2p_groups_problem(const std::vector<P2pGroups>& per_rank) {
  const int p = static_cast<int>(per_rank.size());
  auto name = [](const P2pTransfer& t) {
    return std::string(t.grad ? "the input gradient of chunk " : "the output of chunk ") + std::to_string(t.chunk) +
           " for micro-batch " + std::to_string(t.microbatch);
  };
  // Where each transfer is (rank, group, index), and its match, by FIFO order per (sender, receiver).
  struct Ref {
    int rank, group, index;
  };
  std::vector<std::vector<Ref>> sq(static_cast<size_t>(p) * p), rq(static_cast<size_t>(p) * p);  // [from * p + to]
  for (int r = 0; r < p; ++r)
    for (size_t g = 0; g < per_rank[static_cast<size_t>(r)].size(); ++g)
      for (size_t i = 0; i < per_rank[static_cast<size_t>(r)][g].size(); ++i) {
        const P2pTransfer& t = per_rank[static_cast<size_t>(r)][g][i];
        if (t.peer < 0 || t.peer >= p) return "rank " + std::to_string(r) + " names pipeline rank " + std::to_string(t.peer);
        const Ref ref{r, static_cast<int>(g), static_cast<int>(i)};
        (t.recv ? rq[static_cast<size_t>(t.peer * p + r)] : sq[static_cast<size_t>(r * p + t.peer)]).push_back(ref);
      }
  // match[r][g][i]: the matching transfer's Ref.
  std::vector<std::vector<std::vector<Ref>>> match(static_cast<size_t>(p));
  std::vector<std::vector<std::vector<char>>> done(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    const P2pGroups& gs = per_rank[static_cast<size_t>(r)];
    match[static_cast<size_t>(r)].resize(gs.size());
    done[static_cast<size_t>(r)].resize(gs.size());
    for (size_t g = 0; g < gs.size(); ++g) {
      match[static_cast<size_t>(r)][g].resize(gs[g].size());
      done[static_cast<size_t>(r)][g].assign(gs[g].size(), 0);
    }
  }
  auto at = [&](const Ref& x) -> const P2pTransfer& {
    return per_rank[static_cast<size_t>(x.rank)][static_cast<size_t>(x.group)][static_cast<size_t>(x.index)];
  };
  for (int from = 0; from < p; ++from)
    for (int to = 0; to < p; ++to) {
      const auto& s = sq[static_cast<size_t>(from * p + to)];
      const auto& v = rq[static_cast<size_t>(from * p + to)];
      if (s.size() != v.size())
        return "rank " + std::to_string(from) + " sends " + std::to_string(s.size()) + " transfers to rank " +
               std::to_string(to) + ", which receives " + std::to_string(v.size()) + " from it";
      for (size_t k = 0; k < s.size(); ++k) {
        const P2pTransfer &a = at(s[k]), &b = at(v[k]);
        if (a.chunk != b.chunk || a.grad != b.grad || a.microbatch != b.microbatch)
          return "transfer " + std::to_string(k) + " from rank " + std::to_string(from) + " to rank " +
                 std::to_string(to) + " carries " + name(a) + " but is received as " + name(b);
        match[static_cast<size_t>(s[k].rank)][static_cast<size_t>(s[k].group)][static_cast<size_t>(s[k].index)] = v[k];
        match[static_cast<size_t>(v[k].rank)][static_cast<size_t>(v[k].group)][static_cast<size_t>(v[k].index)] = s[k];
      }
    }
  // Run: every rank's head group; a transfer completes with its match in the peer's head group.
  std::vector<size_t> head(static_cast<size_t>(p), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const size_t g = head[static_cast<size_t>(r)];
      if (g >= per_rank[static_cast<size_t>(r)].size()) continue;
      const auto& grp = per_rank[static_cast<size_t>(r)][g];
      for (size_t i = 0; i < grp.size(); ++i) {
        if (done[static_cast<size_t>(r)][g][i]) continue;
        bool blocked = false;  // an earlier transfer of the same direction and peer in the group not done
        for (size_t j = 0; j < i; ++j)
          blocked = blocked || (!done[static_cast<size_t>(r)][g][j] && grp[j].recv == grp[i].recv && grp[j].peer == grp[i].peer);
        const Ref m = match[static_cast<size_t>(r)][g][i];
        if (blocked || head[static_cast<size_t>(m.rank)] != static_cast<size_t>(m.group)) continue;
        const auto& pg = per_rank[static_cast<size_t>(m.rank)][static_cast<size_t>(m.group)];
        bool pblocked = false;
        for (int j = 0; j < m.index; ++j)
          pblocked = pblocked || (!done[static_cast<size_t>(m.rank)][static_cast<size_t>(m.group)][static_cast<size_t>(j)] &&
                                  pg[static_cast<size_t>(j)].recv == pg[static_cast<size_t>(m.index)].recv &&
                                  pg[static_cast<size_t>(j)].peer == pg[static_cast<size_t>(m.index)].peer);
        if (pblocked) continue;
        done[static_cast<size_t>(r)][g][i] = 1;
        done[static_cast<size_t>(m.rank)][static_cast<size_t>(m.group)][static_cast<size_t>(m.index)] = 1;
        progress = true;
      }
    }
    for (int r = 0; r < p; ++r) {
      size_t& g = head[static_cast<size_t>(r)];
      while (g < per_rank[static_cast<size_t>(r)].size() &&
             std::all_of(done[static_cast<size_t>(r)][g].begin(), done[static_cast<size_t>(r)][g].end(),
                         [](char c) { return c != 0; })) {
        ++g;
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < p; ++r) {
    const size_t g = head[static_cast<size_t>(r)];
    if (g >= per_rank[static_cast<size_t>(r)].size()) continue;
    std::string what;
    for (size_t i = 0; i < per_rank[static_cast<size_t>(r)][g].size(); ++i) {
      if (done[static_cast<size_t>(r)][g][i]) continue;
      const P2pTransfer& t = per_rank[static_cast<size_t>(r)][g][i];
      what += (what.empty() ? "" : ", ") + std::string(t.recv ? "receiving " : "sending ") + name(t) +
              (t.recv ? " from rank " : " to rank ") + std::to_string(t.peer);
    }
    stuck += (stuck.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " in its group " + std::to_string(g) + " (" + what + ")");
  }
  return stuck.empty() ? "" : "deadlock: " + stuck;
}

bool pipeline_grouped(const Comm& pp) {
  const char* e = std::getenv("SHARDTRAIN_TEST_PP_GROUPED");
  return pp.stream_ordered() || (e && std::string(e) == "1");
}

std::string check_pipeline_transfers(Comm& world, const Comm& pp, const PipelineLayout& pl, int microbatches) {
  if (pl.ranks == 1) return "";
  // Every rank's Comm is of one kind; the test hook is read per rank.
  const bool grouped = pipeline_grouped(pp);
  if (!same_on_all_ranks(world, grouped ? 1 : 0))
    throw CollectiveError(0, "the ranks disagree on whether the pipeline's transfers run grouped: "
                             "SHARDTRAIN_TEST_PP_GROUPED=1 is set on some ranks only");
  if (!grouped) return "";
  std::string orders, why;
  for (bool backward : {true, false}) {  // the same answer on every rank: a function of the layout
    const P2pOrder o = pipeline_p2p_order(*pl.schedule(microbatches, backward), pl, &why);
    if (!why.empty()) throw CollectiveError(0, why + (pp.stream_ordered() ? "; pass '--gpu-comm mpi'" : ""));
    orders += std::string(backward ? "training " : ", evaluation ") + p2p_order_name(o);
  }
  return "pipeline: transfers grouped (stream-ordered Comm order): " + orders;
}

template <typename C> struct StageLink<C>::Xfer {
  std::shared_ptr<Comm::Request> req;  // grouped: shared by the transfers of one group
  const C* buf;
  size_t n;
  int chunk;  // the sending chunk (a receive: the chunk it comes from)
  bool grad;
  Clock::time_point t0;
  bool done = false;  // test() returned true: the buffer is free, no wait needed
};

template <typename C>
StageLink<C>::StageLink(Comm& comm, const PipelineLayout& pl, Backend<C>& be, bool grouped)
    : comm_(comm), pl_(pl), be_(be), reg_(be.progress()), grouped_(grouped), device_timed_(comm.stream_ordered()) {
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
        if (!device_timed_) issued_s_ += since(x->t0);
      }
}

// A member of the progress registry while anything is in flight (joined and left on the compute thread).
template <typename C> void StageLink<C>::update_membership() {
  if (!reg_) return;
  const bool busy = !sends_.empty() || !recvs_.empty();
  if (busy && !member_.joined()) member_ = reg_->join(&StageLink::poll, this);
  if (!busy && member_.joined()) member_.reset();
}

// Grouped: the held sends and receives as one group, with one tag for every transfer, so that MPI
// matches in start order as NCCL does.
template <typename C> void StageLink<C>::issue() {
  if (!grouped_ || (held_.empty() && held_recvs_.empty())) return;
  std::vector<Comm::P2pOp> ops;
  std::vector<P2pTransfer> entry;
  for (const auto* v : {&held_, &held_recvs_})
    for (const auto& x : *v) {
      const bool recv = v == &held_recvs_;
      // A send goes to the neighbour of its chunk; a receive comes from its chunk's rank.
      const int peer = recv ? pl_.rank_of(x->chunk) : pl_.rank_of(x->grad ? x->chunk - 1 : x->chunk + 1);
      ops.push_back({recv, const_cast<C*>(x->buf), x->n, peer, kTagBase});
      entry.push_back({recv, peer, x->chunk, x->grad, 0});
    }
  std::shared_ptr<Comm::Request> req = comm_.start_group<C>(ops);
  const auto t0 = Clock::now();
  for (auto* v : {&held_, &held_recvs_})
    for (auto& x : *v) {
      x->req = req;
      x->t0 = t0;
      (v == &held_ ? sends_ : recvs_).push_back(std::move(x));
    }
  held_.clear();
  held_recvs_.clear();
  if (log_groups_) log_.push_back(std::move(entry));
  update_membership();
}

template <typename C> void StageLink<C>::post_recv(int chunk, bool grad, C* buf, size_t n) {
  const int from = grad ? chunk + 1 : chunk - 1;
  auto x = std::make_unique<Xfer>(Xfer{nullptr, buf, n, from, grad, Clock::now()});
  ++calls_;
  if (grouped_) {
    held_recvs_.push_back(std::move(x));
    return;
  }
  x->req = comm_.start_recv(buf, n, pl_.rank_of(from), tag(from, grad));
  recvs_.push_back(std::move(x));
  update_membership();
}

template <typename C> void StageLink<C>::wait_recv(int chunk, bool grad, C* buf, size_t n) {
  const int from = grad ? chunk + 1 : chunk - 1;
  auto find = [&] {
    auto i = recvs_.begin();
    while (i != recvs_.end() && ((*i)->chunk != from || (*i)->grad != grad)) ++i;
    return i;
  };
  auto it = find();
  if (it == recvs_.end()) {
    bool held = false;
    for (const auto& x : held_recvs_) held = held || (x->chunk == from && x->grad == grad);
    if (!held) post_recv(chunk, grad, buf, n);
    issue();  // grouped: start what is held, this receive included
    it = find();
  }
  if ((*it)->buf != buf) throw std::logic_error("StageLink::wait_recv: the oldest posted receive is into another buffer");
  if (!(*it)->done) {
    const auto t0 = Clock::now();
    (*it)->req->wait();
    if (!device_timed_) {
      exposed_s_ += since(t0);
      issued_s_ += since((*it)->t0);
    }
  }
  recvs_.erase(it);
  update_membership();
}

template <typename C>
void StageLink<C>::send(int chunk, bool grad, const C* src, size_t rows, const std::vector<double>& tail) {
  static_assert(sizeof(double) % sizeof(C) == 0, "StageLink: a tail's doubles must fill whole elements");
  const int to = grad ? chunk - 1 : chunk + 1;
  const size_t n = rows + tail_elems<C>(tail.size());
  test_all();
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(), [](const auto& x) { return x->done; }), sends_.end());
  // A pool buffer no send in flight or held uses, else a new one.
  C* buf = nullptr;
  for (Buffer<C>& b : pool_) {
    if (b.size() < n) continue;
    bool used = false;
    for (const auto* v : {&sends_, &held_})
      for (const auto& x : *v) used = used || x->buf == b.data();
    if (!used) {
      buf = b.data();
      break;
    }
  }
  if (!buf) {
    pool_.emplace_back(be_, n);
    buf = pool_.back().data();
  }
  be_.copy(buf, src, rows);
  if (!tail.empty()) {  // the doubles' bytes, as elements of C
    std::vector<C> t(tail_elems<C>(tail.size()));
    std::memcpy(t.data(), tail.data(), tail.size() * sizeof(double));
    be_.from_host(buf + rows, t.data(), t.size());
  }
  auto x = std::make_unique<Xfer>(Xfer{nullptr, buf, n, chunk, grad, Clock::now()});
  ++calls_;
  bytes_ += static_cast<double>(n) * sizeof(C);
  if (grouped_) {
    held_.push_back(std::move(x));
    return;
  }
  x->req = comm_.start_send(static_cast<const C*>(buf), n, pl_.rank_of(to), tag(chunk, grad));
  sends_.push_back(std::move(x));
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
  issue();
  const auto t0 = Clock::now();
  for (auto& x : sends_)
    if (!x->done) {
      x->req->wait();
      x->done = true;
      if (!device_timed_) issued_s_ += since(x->t0);
    }
  sends_.clear();
  if (device_timed_) {
    // Stream-ordered: every group done, and the Comm's timing events drained (they pile up
    // otherwise); its device times are this link's (the host's waits above returned at once).
    comm_.synchronize();
    const Comm::DeviceTimes t = comm_.device_times();
    issued_s_ += t.issued_s - device_.issued_s;
    exposed_s_ += t.exposed_s - device_.exposed_s;
    device_ = t;
  } else {
    exposed_s_ += since(t0);
  }
  update_membership();
}

template <typename T> double sum_tied_grads(Comm& comm, Backend<T>& be, T* grad, size_t n) {
  const int p = comm.world_size(), r = comm.rank();
  if (p == 1 || (r != 0 && r != p - 1) || n == 0) return 0;
  const int peer = r == 0 ? p - 1 : 0;
  Buffer<T> other(be, n);
  // One group (an exchange): on a stream-ordered Comm a receive alone would wait for the peer's
  // send queued behind the peer's own receive.
  comm.start_group<T>({{true, other.data(), n, peer, kTagBase - 1}, {false, grad, n, peer, kTagBase - 1}})->wait();
  be.axpy(n, 1, other.data(), grad);
  return static_cast<double>(n) * sizeof(T);
}
template double sum_tied_grads<float>(Comm&, Backend<float>&, float*, size_t);
template double sum_tied_grads<double>(Comm&, Backend<double>&, double*, size_t);

template class StageLink<float>;
template class StageLink<double>;
template class StageLink<bf16>;

}  // namespace shardtrain
