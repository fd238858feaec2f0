// Pipeline schedules (pipeline_schedule.h): the block split, each schedule's actions, the published
// bubble formulas, and the simulation that checks both.
#include "shardtrain/parallel/pipeline_schedule.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <stdexcept>
#include <tuple>

namespace shardtrain {

std::vector<int> pipeline_split(int layers, int chunks, const std::vector<int>& counts, std::string* why) {
  const std::string L = std::to_string(layers), S = std::to_string(chunks);
  auto refuse = [&](const std::string& w) { return *why = w, std::vector<int>{}; };
  if (chunks < 1) return refuse("pipeline: " + S + " model chunks (at least 1)");
  if (chunks > layers) return refuse("pipeline: " + S + " model chunks for " + L + " transformer blocks (at most one chunk per block)");
  std::vector<int> b(1, 0);
  if (!counts.empty()) {
    if (static_cast<int>(counts.size()) != chunks)
      return refuse("--pp-layers: " + std::to_string(counts.size()) + " counts for " + S + " model chunks");
    long sum = 0;
    for (size_t c = 0; c < counts.size(); ++c) {
      if (counts[c] < 1) return refuse("--pp-layers: chunk " + std::to_string(c) + " has " + std::to_string(counts[c]) + " blocks (at least 1)");
      sum += counts[c];
      b.push_back(static_cast<int>(std::min<long>(sum, std::numeric_limits<int>::max())));
    }
    if (sum != layers) return refuse("--pp-layers: the counts sum to " + std::to_string(sum) + ", the model has " + L + " blocks");
    return *why = "", b;
  }
  // L + 2 layers (embedding, blocks, head) evenly; earlier chunks take the remainder.
  const int64_t n = int64_t{layers} + 2;
  std::vector<int> blocks(static_cast<size_t>(chunks));
  bool empty = false;
  for (int c = 0; c < chunks; ++c) {
    blocks[static_cast<size_t>(c)] =
        static_cast<int>(n / chunks + (c < n % chunks ? 1 : 0)) - (c == 0) - (c == chunks - 1);
    empty = empty || blocks[static_cast<size_t>(c)] < 1;
  }
  if (empty) {  // a chunk would hold only the embedding or the head: one block each, then each further
                // block to the chunk with the fewest layers (the embedding and head counted), earliest first
    std::vector<int> load(static_cast<size_t>(chunks));
    for (int c = 0; c < chunks; ++c) {
      blocks[static_cast<size_t>(c)] = 1;
      load[static_cast<size_t>(c)] = 1 + (c == 0) + (c == chunks - 1);
    }
    for (int k = chunks; k < layers; ++k) {
      const size_t c = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      ++blocks[c];
      ++load[c];
    }
  }
  for (int c : blocks) b.push_back(b.back() + c);
  return *why = "", b;
}

std::string pipeline_schedule_problem(PipelineKind kind, int p, int v, int m) {
  const std::string name = std::string("--pp-schedule ") + pipeline_kind_name(kind);
  if (p < 1) return "--pp " + std::to_string(p) + ": at least 1 pipeline stage";
  if (m < 1) return name + ": " + std::to_string(m) + " micro-batches per step (at least 1)";
  if (v < 1) return "--pp-virtual " + std::to_string(v) + ": at least 1 chunk per rank";
  if (kind != PipelineKind::Interleaved && v != 1)
    return "--pp-virtual " + std::to_string(v) + " needs --pp-schedule interleaved (" + name + " runs one chunk per rank)";
  if (kind == PipelineKind::Interleaved) {
    if (v < 2) return name + " needs --pp-virtual of at least 2 chunks per rank (got " + std::to_string(v) + ")";
    if (m % p != 0)
      return name + ": " + std::to_string(m) + " micro-batches per step is not a multiple of --pp " + std::to_string(p) +
             " (the interleaved schedule runs micro-batches in groups of p, as Megatron-LM requires)";
  }
  return "";
}

PipelineSchedule::PipelineSchedule(PipelineKind kind, int ranks, int chunks_per_rank, int microbatches,
                                   std::vector<int> bounds, bool backward)
    : kind_(kind), p_(ranks), v_(chunks_per_rank), m_(microbatches), bounds_(std::move(bounds)), backward_(backward) {
  if (const std::string why = pipeline_schedule_problem(kind, ranks, chunks_per_rank, microbatches); !why.empty())
    throw std::invalid_argument(why);
  if (static_cast<long>(bounds_.size()) != static_cast<long>(ranks) * chunks_per_rank + 1)
    throw std::invalid_argument("PipelineSchedule: " + std::to_string(bounds_.size()) + " chunk bounds for " +
                                std::to_string(ranks * chunks_per_rank) + " chunks");
  if (bounds_.front() != 0 || !std::is_sorted(bounds_.begin(), bounds_.end()))
    throw std::invalid_argument("PipelineSchedule: chunk bounds must start at 0 and not decrease (pipeline_split)");
}

std::string PipelineSchedule::name() const {
  std::string n = backward_ ? pipeline_kind_name(kind_) : "evaluation";
  if (v_ > 1) n += " (" + std::to_string(v_) + " chunks per stage)";
  return n;
}

std::vector<Action> PipelineSchedule::actions() const {
  std::vector<Action> out;
  auto act = [&](ActionKind k, int mb, int rank, int local) {  // local: the rank's chunk index 0..v-1
    const int c = local * p_ + rank;
    out.push_back({k, mb, rank, bounds_[static_cast<size_t>(c)], bounds_[static_cast<size_t>(c) + 1], c});
  };
  for (int r = 0; r < p_; ++r) {
    if (!backward_) {  // evaluation: the forwards in training's order, all of them "warm-up"
      for (int k = 0; k < m_ * v_; ++k) act(ActionKind::Forward, (k / (p_ * v_)) * p_ + k % p_, r, (k % (p_ * v_)) / p_);
      continue;
    }
    switch (kind_) {
      case PipelineKind::GPipe:
        for (int mb = 0; mb < m_; ++mb) act(ActionKind::Forward, mb, r, 0);
        for (int mb = 0; mb < m_; ++mb) act(ActionKind::Backward, mb, r, 0);
        break;
      case PipelineKind::OneFOneB:
      case PipelineKind::ZeroBubble: {
        const bool split = kind_ == PipelineKind::ZeroBubble;
        const int warm = std::min(p_ - 1 - r, m_);
        std::deque<int> deferred;  // ZB-H1: micro-batches whose W waits (at most r of them)
        auto backward = [&](int mb) {
          if (!split) return act(ActionKind::Backward, mb, r, 0);
          act(ActionKind::BackwardInput, mb, r, 0);
          deferred.push_back(mb);
          if (static_cast<int>(deferred.size()) > r) {
            act(ActionKind::BackwardWeight, deferred.front(), r, 0);
            deferred.pop_front();
          }
        };
        for (int mb = 0; mb < warm; ++mb) act(ActionKind::Forward, mb, r, 0);
        for (int k = 0; k < m_ - warm; ++k) {
          act(ActionKind::Forward, warm + k, r, 0);
          backward(k);
        }
        for (int mb = m_ - warm; mb < m_; ++mb) backward(mb);
        for (int mb : deferred) act(ActionKind::BackwardWeight, mb, r, 0);
        break;
      }
      case PipelineKind::Interleaved: {
        const int total = m_ * v_, group = p_ * v_;
        const int warm = m_ == p_ ? total : std::min(total, (p_ - r - 1) * 2 + (v_ - 1) * p_);
        auto mb_of = [&](int k) { return (k / group) * p_ + k % p_; };
        auto chunk_of = [&](int k, bool fwd) {
          const int j = (k % group) / p_;
          return fwd ? j : v_ - 1 - j;
        };
        for (int k = 0; k < warm; ++k) act(ActionKind::Forward, mb_of(k), r, chunk_of(k, true));
        for (int k = 0; k < total - warm; ++k) {
          act(ActionKind::Forward, mb_of(warm + k), r, chunk_of(warm + k, true));
          act(ActionKind::Backward, mb_of(k), r, chunk_of(k, false));
        }
        for (int k = total - warm; k < total; ++k) act(ActionKind::Backward, mb_of(k), r, chunk_of(k, false));
        break;
      }
    }
  }
  return out;
}

double PipelineSchedule::ideal_bubble(double tf, double ti, double tw) const {
  if (!backward_) return 0;
  const double p = p_, m = m_, v = v_, tb = ti + tw;
  double idle = 0;  // per rank, in units of one chunk's times
  switch (kind_) {
    case PipelineKind::GPipe:
    case PipelineKind::OneFOneB:
    case PipelineKind::Interleaved: idle = (p - 1) * (tf + tb); break;  // interleaved: against v chunks of work
    // The paper's (p-1)(tf + ti - tw) assumes a W fits the slot it fills (tw <= min(tf, ti)); a
    // longer W adds its excess on every rank boundary (this table's simulation, checked in tests).
    case PipelineKind::ZeroBubble: idle = (p - 1) * (tf + ti - tw + std::max(0.0, tw - std::min(tf, ti))); break;
  }
  const double work = m * v * (tf + tb);
  return idle / (work + idle);
}

PipelineTimeline simulate(const Schedule& s, const std::vector<ActionTimes>& times) {
  PipelineTimeline t;
  const int P = s.stages();
  const std::vector<Action> all = s.actions();
  std::vector<std::vector<const Action*>> per(static_cast<size_t>(std::max(P, 0)));
  int chunks = 0;
  for (const Action& a : all) {
    if (a.stage < 0 || a.stage >= P) return t.error = "an action on stage " + std::to_string(a.stage), t;
    per[static_cast<size_t>(a.stage)].push_back(&a);
    chunks = std::max(chunks, a.chunk + 1);
  }
  if (P < 1) return t.error = "a schedule of " + std::to_string(P) + " stages", t;
  if (times.size() != 1 && times.size() != static_cast<size_t>(chunks))
    return t.error = std::to_string(times.size()) + " action times for " + std::to_string(chunks) + " chunks (1 or one per chunk)", t;
  for (const ActionTimes& x : times)
    if (!(x.forward >= 0 && x.backward >= 0 && x.backward_input >= 0 && x.backward_weight >= 0))
      return t.error = "a negative or NaN action time", t;
  auto dur = [&](const Action& a) {
    const ActionTimes& x = times.size() == 1 ? times[0] : times[static_cast<size_t>(a.chunk)];
    switch (a.kind) {
      case ActionKind::Forward: return x.forward;
      case ActionKind::Backward: return x.backward;
      case ActionKind::BackwardInput: return x.backward_input;
      case ActionKind::BackwardWeight: return x.backward_weight;
    }
    return 0.0;
  };
  // End times: (kind class, micro-batch, chunk); Backward and BackwardInput share class 1.
  std::map<std::tuple<int, int, int>, double> end;
  auto cls = [](ActionKind k) { return k == ActionKind::Forward ? 0 : k == ActionKind::BackwardWeight ? 2 : 1; };
  auto done = [&](int c, int mb, int ch, double* at) {
    auto it = end.find({c, mb, ch});
    if (it == end.end()) return false;
    *at = std::max(*at, it->second);
    return true;
  };
  std::vector<size_t> pos(per.size(), 0);
  std::vector<double> clock(per.size(), 0.0);
  std::vector<int> in_flight(per.size(), 0);
  std::vector<bool> split(per.size(), false);  // a rank whose backward ends at its W
  for (size_t r = 0; r < per.size(); ++r)
    for (const Action* x : per[r]) split[r] = split[r] || x->kind == ActionKind::BackwardWeight;
  t.busy.assign(per.size(), 0.0);
  t.peak_in_flight.assign(per.size(), 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t r = 0; r < per.size(); ++r)
      for (; pos[r] < per[r].size(); ++pos[r]) {
        const Action& a = *per[r][pos[r]];
        double at = clock[r];
        bool ready = true;
        if (a.kind == ActionKind::Forward) {
          if (a.chunk > 0) ready = done(0, a.microbatch, a.chunk - 1, &at);
        } else if (a.kind == ActionKind::BackwardWeight) {
          ready = done(1, a.microbatch, a.chunk, &at);
        } else {
          ready = done(0, a.microbatch, a.chunk, &at) && (a.chunk == chunks - 1 || done(1, a.microbatch, a.chunk + 1, &at));
        }
        if (!ready) break;
        clock[r] = at + dur(a);
        t.busy[r] += dur(a);
        end[{cls(a.kind), a.microbatch, a.chunk}] = clock[r];
        if (a.kind == ActionKind::Forward) in_flight[r]++;
        if (a.kind == ActionKind::BackwardWeight || (a.kind != ActionKind::Forward && !split[r])) in_flight[r]--;
        t.peak_in_flight[r] = std::max(t.peak_in_flight[r], in_flight[r]);
        moved = true;
      }
  }
  for (size_t r = 0; r < per.size(); ++r)
    if (pos[r] < per[r].size()) {
      const Action& a = *per[r][pos[r]];
      t.error = "stage " + std::to_string(r) + " waits forever at action " + std::to_string(pos[r]) + " (" +
                action_letter(a.kind) + std::to_string(a.microbatch) + " of chunk " + std::to_string(a.chunk) + ")";
      return t;
    }
  t.makespan = *std::max_element(clock.begin(), clock.end());
  for (size_t r = 0; r < per.size(); ++r) t.idle.push_back(t.makespan > 0 ? (t.makespan - t.busy[r]) / t.makespan : 0);
  return t;
}

}  // namespace shardtrain
