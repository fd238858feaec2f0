// Example packing and the global batches of example data (packing.h).
#include "shardtrain/data/packing.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <stdexcept>
#include <utility>

#include "shardtrain/backend/ops_math.h"  // math::splitmix64

namespace shardtrain {

TrainOn parse_train_on(const std::string& s) {
  if (s == "assistant" || s == "completion") return TrainOn::Assistant;
  if (s == "all") return TrainOn::All;
  throw std::invalid_argument("option '--train-on' must be assistant, completion (the same) or all, got '" + s + "'");
}
PackMode parse_pack_mode(const std::string& s) {
  if (s == "best-fit") return PackMode::BestFit;
  if (s == "none") return PackMode::None;
  throw std::invalid_argument("option '--pack' must be best-fit or none, got '" + s + "'");
}
MaxLengthPolicy parse_max_length_policy(const std::string& s) {
  if (s == "truncate") return MaxLengthPolicy::Truncate;
  if (s == "drop") return MaxLengthPolicy::Drop;
  throw std::invalid_argument("option '--max-length-policy' must be truncate or drop, got '" + s + "'");
}
const char* train_on_name(TrainOn t) { return t == TrainOn::All ? "all" : "assistant"; }
const char* pack_mode_name(PackMode p) { return p == PackMode::None ? "none" : "best-fit"; }
const char* max_length_policy_name(MaxLengthPolicy m) { return m == MaxLengthPolicy::Drop ? "drop" : "truncate"; }

PackedExamples::PackedExamples(const TokenDataset& ds, Split s, const PackOptions& o) : ds_(ds), split_(s), o_(o) {
  if (!ds.has_examples()) throw std::invalid_argument("PackedExamples: the data has no examples (format version 3)");
  if (o.seq_len < 2) throw std::invalid_argument("PackedExamples: seq_len must be >= 2");
  const TokenizerInfo& tk = ds.tokenizer();
  pad_ = tk.pad_id >= 0 ? static_cast<int32_t>(tk.pad_id)
         : ds.header().eos_id != kNoTokenId ? static_cast<int32_t>(ds.header().eos_id) : 0;
  const std::vector<uint64_t>& starts = ds.example_starts(s);
  const uint64_t end = ds.size(s);
  st_.examples = starts.size();
  std::vector<uint8_t> roles;
  for (size_t e = 0; e < starts.size(); ++e) {
    const uint64_t n = (e + 1 < starts.size() ? starts[e + 1] : end) - starts[e];
    uint64_t len = n;
    if (n > static_cast<uint64_t>(o.seq_len)) {
      if (o.max_length == MaxLengthPolicy::Drop) {
        ++st_.dropped_long;
        continue;
      }
      len = static_cast<uint64_t>(o.seq_len);
    }
    uint64_t targets = len - 1;  // every token but the first
    if (o.train_on == TrainOn::Assistant) {
      roles.resize(static_cast<size_t>(len));
      ds.copy_roles(s, starts[e], len, roles.data());
      targets = 0;
      for (uint64_t t = 1; t < len; ++t) targets += roles[t] != static_cast<uint8_t>(RoleClass::Context);
    }
    if (targets == 0) {
      ++st_.dropped_no_target;
      continue;
    }
    st_.truncated += len < n;
    ex_start_.push_back(starts[e]);
    ex_len_.push_back(static_cast<int32_t>(len));
    st_.tokens += len;
    st_.targets += targets;
    row_targets_.push_back(static_cast<int32_t>(targets));  // per example for now; per row below
  }
  st_.packed = ex_start_.size();
  const size_t n = ex_start_.size();
  std::vector<int32_t> ex_targets;
  ex_targets.swap(row_targets_);
  row_begin_.push_back(0);
  if (o.pack == PackMode::None) {
    row_ex_.resize(n);
    std::iota(row_ex_.begin(), row_ex_.end(), 0u);
    for (size_t i = 0; i < n; ++i) {
      row_begin_.push_back(static_cast<int64_t>(i + 1));
      row_targets_.push_back(ex_targets[i]);
    }
  } else {
    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return ex_len_[a] > ex_len_[b]; });
    std::vector<std::vector<uint32_t>> rows;
    std::set<std::pair<int32_t, size_t>> room;  // (positions left, row) of the rows not full
    for (uint32_t e : order) {
      const int32_t L = ex_len_[e];
      auto it = room.lower_bound({L, size_t{0}});  // the least room that holds L, the first row among equals
      size_t r;
      int32_t left;
      if (it == room.end()) {
        r = rows.size();
        rows.emplace_back();
        left = o.seq_len;
      } else {
        r = it->second;
        left = it->first;
        room.erase(it);
      }
      rows[r].push_back(e);
      if (left - L > 0) room.insert({left - L, r});
    }
    for (const auto& row : rows) {
      int64_t t = 0;
      for (uint32_t e : row) {
        row_ex_.push_back(e);
        t += ex_targets[e];
      }
      row_begin_.push_back(static_cast<int64_t>(row_ex_.size()));
      row_targets_.push_back(static_cast<int32_t>(t));
    }
  }
  st_.rows = static_cast<int64_t>(row_targets_.size());
}

void PackedExamples::fill_row(int64_t r, int32_t* tokens, int32_t* targets, int32_t* doc, int32_t* pos,
                              int32_t* real) const {
  if (r < 0 || r >= st_.rows)
    throw std::out_of_range("PackedExamples::fill_row: row " + std::to_string(r) + " of " + std::to_string(st_.rows));
  const int T = o_.seq_len;
  std::vector<uint32_t> ids;
  std::vector<uint8_t> roles;
  int p = 0;
  int32_t d = 0;
  for (int64_t k = row_begin_[static_cast<size_t>(r)]; k < row_begin_[static_cast<size_t>(r) + 1]; ++k, ++d) {
    const uint32_t e = row_ex_[static_cast<size_t>(k)];
    const int32_t L = ex_len_[e];
    ids.resize(static_cast<size_t>(L));
    ds_.copy(split_, ex_start_[e], static_cast<uint64_t>(L), ids.data());
    const bool assistant = o_.train_on == TrainOn::Assistant;
    if (assistant) {
      roles.resize(static_cast<size_t>(L));
      ds_.copy_roles(split_, ex_start_[e], static_cast<uint64_t>(L), roles.data());
    }
    for (int32_t t = 0; t < L; ++t, ++p) {
      tokens[p] = static_cast<int32_t>(ids[static_cast<size_t>(t)]);  // < vocab_size (checked at open)
      const bool counts = t + 1 < L && (!assistant || roles[static_cast<size_t>(t) + 1] !=
                                                          static_cast<uint8_t>(RoleClass::Context));
      targets[p] = counts ? static_cast<int32_t>(ids[static_cast<size_t>(t) + 1]) : kNoTarget;
      doc[p] = d;
      pos[p] = t;
      if (real) real[p] = 1;
    }
  }
  for (int32_t t = 0; p < T; ++p, ++t) {
    tokens[p] = pad_;
    targets[p] = kNoTarget;
    doc[p] = d;
    pos[p] = t;
    if (real) real[p] = 0;
  }
}

PackedBatches::PackedBatches(const TokenDataset& ds, const PackOptions& o, uint64_t seed, int global_batch,
                             bool shuffle)
    : train_(ds, Split::Train, o), val_(ds, Split::Val, o), seed_(seed), G_(global_batch), T_(o.seq_len),
      shuffle_(shuffle) {
  if (global_batch < 1) throw std::invalid_argument("PackedBatches: global_batch must be >= 1");
}

int64_t PackedBatches::epoch_of(int64_t index) const {
  const int64_t R = train_.rows();
  return R > 0 ? ((index + 1) * G_ - 1) / R : 0;
}

int64_t PackedBatches::row_of(Split s, int64_t j) const {
  const int64_t R = stream(s).rows();
  if (R <= 0) throw std::out_of_range("PackedBatches: the " + std::string(s == Split::Train ? "train" : "validation") +
                                      " split has no example to train on");
  if (s == Split::Val || !shuffle_) return j % R;
  const int64_t e = j / R;
  std::shared_ptr<const std::vector<int64_t>> perm;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = perms_.find(e);
    if (it != perms_.end()) {
      perm = it->second;
    } else {
      auto p = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(R));
      std::iota(p->begin(), p->end(), int64_t{0});
      using math::splitmix64;
      const uint64_t base = splitmix64(seed_ ^ splitmix64(0x7061636bull ^ splitmix64(static_cast<uint64_t>(e))));
      for (int64_t i = R - 1; i > 0; --i) {
        const uint64_t k = splitmix64(base + static_cast<uint64_t>(i)) % static_cast<uint64_t>(i + 1);
        std::swap((*p)[static_cast<size_t>(i)], (*p)[static_cast<size_t>(k)]);
      }
      while (perms_.size() >= 2) perms_.erase(perms_.begin());  // batches move forward: keep the newest
      perms_.emplace(e, p);
      perm = p;
    }
  }
  return (*perm)[static_cast<size_t>(j % R)];
}

void PackedBatches::fill(Split s, int64_t index, int first, int count, int32_t* tokens, int32_t* targets,
                         int32_t* doc, int32_t* pos, int32_t* real) const {
  const PackedExamples& px = stream(s);
  for (int i = 0; i < count; ++i) {
    const int64_t j = index * G_ + first + i;
    const size_t o = static_cast<size_t>(i) * static_cast<size_t>(T_);
    px.fill_row(row_of(s, j), tokens + o, targets + o, doc + o, pos + o, real ? real + o : nullptr);
  }
}

int64_t PackedBatches::batch_targets(Split s, int64_t index) const {
  int64_t n = 0;
  for (int i = 0; i < G_; ++i) n += stream(s).row_targets(row_of(s, index * G_ + i));
  return n;
}

}  // namespace shardtrain
