// Example packing (data/packing.h, issue 55) against references written here from the header's
// contract, on token files written byte by byte (tests/token_files.h): the rows are the best-fit
// decreasing packing a plain O(n^2) loop makes; every position's target, document and position
// follow from the examples and their role classes; truncation, dropping and examples without a
// target are counted; the global batches are a permutation of the rows per epoch, the same however
// a batch is split over ranks; and the cross-entropy gives kNoTarget rows no loss and no gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/data/packing.h"
#include "../token_files.h"

using namespace shardtrain;

namespace {

std::string tmp(const std::string& name) { return ::testing::TempDir() + "shardtrain_pack_" + name; }

// Examples of the given lengths; roles: a context run, then an assistant run whose last token is
// the end of turn, repeated (a conversation of turns of 1-7 tokens); example `no_target` all context.
shardtrain::testing::V3 make_examples(const std::vector<uint64_t>& lens, uint64_t e_val, int no_target = -1) {
  shardtrain::testing::V3 v;
  v.e_val = e_val;
  v.vocab = 300;
  for (size_t e = 0; e < lens.size(); ++e) {
    v.starts.push_back(v.toks.size());
    uint64_t i = 0;
    int turn = 0;
    while (i < lens[e]) {
      const uint64_t ctx = 1 + (e * 7 + static_cast<uint64_t>(turn) * 3) % 5, ans = 1 + (e + static_cast<uint64_t>(turn)) % 7;
      for (uint64_t k = 0; k < ctx && i < lens[e]; ++k, ++i) v.roles.push_back(0);
      for (uint64_t k = 0; k < ans && i < lens[e]; ++k, ++i)
        v.roles.push_back(static_cast<int>(e) == no_target ? 0 : k + 1 == ans ? 2 : 1);
      ++turn;
    }
    for (uint64_t k = 0; k < lens[e]; ++k) v.toks.push_back(static_cast<uint32_t>((e * 37 + k * 11 + 5) % 300));
  }
  return v;
}

std::string write_file(const std::string& name, const shardtrain::testing::V3& v) {
  const std::string p = tmp(name);
  std::ofstream(p, std::ios::binary) << shardtrain::testing::v3_file(v);
  return p;
}

// The best-fit decreasing rows of the header's rule, by brute force: examples (indices into `lens`)
// longest first (ties: stream order), each into the open row with the least room >= its length
// (ties: the first opened), else a new row.
std::vector<std::vector<size_t>> best_fit(const std::vector<int>& lens, const std::vector<size_t>& kept, int T) {
  std::vector<size_t> order = kept;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lens[a] > lens[b]; });
  std::vector<std::vector<size_t>> rows;
  std::vector<int> room;
  for (size_t e : order) {
    int best = -1;
    for (size_t r = 0; r < rows.size(); ++r)
      if (room[r] >= lens[e] && (best < 0 || room[r] < room[static_cast<size_t>(best)])) best = static_cast<int>(r);
    if (best < 0) {
      rows.emplace_back();
      room.push_back(T);
      best = static_cast<int>(rows.size()) - 1;
    }
    rows[static_cast<size_t>(best)].push_back(e);
    room[static_cast<size_t>(best)] -= lens[e];
  }
  return rows;
}

struct Row {
  std::vector<int32_t> tok, tgt, doc, pos;
  explicit Row(int T) : tok(T), tgt(T), doc(T), pos(T) {}
};

}  // namespace

TEST(Packing, BestFitRowsTargetsDocumentsAndPositionsFollowTheExamples) {
  const int T = 32;
  const std::vector<uint64_t> lens = {5, 40, 17, 3, 31, 12, 12, 2, 9, 25, 1, 16, 7, 32, 33, 4, 20, 6};
  const shardtrain::testing::V3 v = make_examples(lens, 0, /*no_target=*/8);
  TokenDataset ds(write_file("bf.tok", v));
  for (TrainOn on : {TrainOn::Assistant, TrainOn::All})
    for (MaxLengthPolicy ml : {MaxLengthPolicy::Truncate, MaxLengthPolicy::Drop}) {
      SCOPED_TRACE(std::string(train_on_name(on)) + ", " + max_length_policy_name(ml));
      PackedExamples px(ds, Split::Train, PackOptions{T, PackMode::BestFit, ml, on});
      // The reference: which examples are kept, at what length, with how many targets.
      std::vector<int> len(lens.size());
      std::vector<size_t> kept;
      uint64_t truncated = 0, dropped_long = 0, no_target = 0, targets = 0;
      for (size_t e = 0; e < lens.size(); ++e) {
        if (lens[e] > static_cast<uint64_t>(T) && ml == MaxLengthPolicy::Drop) {
          ++dropped_long;
          continue;
        }
        len[e] = static_cast<int>(std::min<uint64_t>(lens[e], T));
        int n = 0;
        for (int t = 1; t < len[e]; ++t) n += on == TrainOn::All || v.roles[v.starts[e] + static_cast<size_t>(t)] != 0;
        if (n == 0) {
          ++no_target;
          continue;
        }
        truncated += lens[e] > static_cast<uint64_t>(T);
        targets += static_cast<uint64_t>(n);
        kept.push_back(e);
      }
      EXPECT_EQ(px.stats().examples, lens.size());
      EXPECT_EQ(px.stats().packed, kept.size());
      EXPECT_EQ(px.stats().truncated, truncated);
      EXPECT_EQ(px.stats().dropped_long, dropped_long);
      EXPECT_EQ(px.stats().dropped_no_target, no_target);  // example 10 (one token); 8 (all context) under assistant
      EXPECT_EQ(px.stats().targets, targets);
      const auto rows = best_fit(len, kept, T);
      ASSERT_EQ(px.rows(), static_cast<int64_t>(rows.size()));
      for (size_t r = 0; r < rows.size(); ++r) {
        Row got(T);
        std::vector<int32_t> real(static_cast<size_t>(T), -1);
        px.fill_row(static_cast<int64_t>(r), got.tok.data(), got.tgt.data(), got.doc.data(), got.pos.data(),
                    real.data());
        int p = 0, n_targets = 0;
        for (size_t k = 0; k < rows[r].size(); ++k) {
          const size_t e = rows[r][k];
          for (int t = 0; t < len[e]; ++t, ++p) {
            const size_t at = v.starts[e] + static_cast<size_t>(t);
            ASSERT_EQ(got.tok[p], static_cast<int32_t>(v.toks[at])) << "row " << r << " position " << p;
            const bool counts = t + 1 < len[e] && (on == TrainOn::All || v.roles[at + 1] != 0);
            ASSERT_EQ(got.tgt[p], counts ? static_cast<int32_t>(v.toks[at + 1]) : kNoTarget) << "row " << r << " position " << p;
            ASSERT_EQ(got.doc[p], static_cast<int32_t>(k));
            ASSERT_EQ(got.pos[p], t);
            ASSERT_EQ(real[static_cast<size_t>(p)], 1) << "row " << r << " position " << p;  // an example's token
            n_targets += counts;
          }
        }
        for (int t = 0; p < T; ++p, ++t) {  // padding: the tokenizer's EOS, no target, a document of its own
          EXPECT_EQ(got.tok[p], 2);
          EXPECT_EQ(got.tgt[p], kNoTarget);
          EXPECT_EQ(got.doc[p], static_cast<int32_t>(rows[r].size()));
          EXPECT_EQ(got.pos[p], t);
          EXPECT_EQ(real[static_cast<size_t>(p)], 0) << "row " << r << " position " << p;  // flagged as padding
        }
        EXPECT_EQ(px.row_targets(static_cast<int64_t>(r)), n_targets);
      }
      EXPECT_THROW(px.fill_row(px.rows(), nullptr, nullptr, nullptr, nullptr), std::out_of_range);
    }
}

TEST(Packing, PackNoneIsOneExamplePerRowInStreamOrder) {
  const int T = 16;
  const shardtrain::testing::V3 v = make_examples({5, 16, 3, 9}, 1);
  TokenDataset ds(write_file("none.tok", v));
  PackedExamples px(ds, Split::Train, PackOptions{T, PackMode::None, MaxLengthPolicy::Truncate, TrainOn::All});
  ASSERT_EQ(px.rows(), 3);
  for (int r = 0; r < 3; ++r) {
    Row got(T);
    px.fill_row(r, got.tok.data(), got.tgt.data(), got.doc.data(), got.pos.data());
    EXPECT_EQ(got.tok[0], static_cast<int32_t>(v.toks[v.starts[static_cast<size_t>(r)]]));
  }
  PackedExamples val(ds, Split::Val, PackOptions{T, PackMode::None, MaxLengthPolicy::Truncate, TrainOn::All});
  ASSERT_EQ(val.rows(), 1);
  EXPECT_EQ(val.row_targets(0), 8);
}

TEST(Packing, GlobalBatchesPermuteTheRowsPerEpochWhateverTheSplitOverRanks) {
  const int T = 24, G = 4;
  std::vector<uint64_t> lens;
  for (int e = 0; e < 60; ++e) lens.push_back(2 + static_cast<uint64_t>((e * 13) % 23));
  TokenDataset ds(write_file("perm.tok", make_examples(lens, 6)));
  const PackOptions o{T, PackMode::BestFit, MaxLengthPolicy::Truncate, TrainOn::Assistant};
  PackedBatches pb(ds, o, 7, G), same(ds, o, 7, G), other(ds, o, 8, G);
  const int64_t R = pb.stream(Split::Train).rows();
  ASSERT_GT(R, G);
  // Each row's first token and its target count identify it (checked unique below).
  auto key = [&](const PackedBatches& b, Split s, int64_t index, int i) {
    Row r(T);
    b.fill(s, index, i, 1, r.tok.data(), r.tgt.data(), r.doc.data(), r.pos.data());
    std::string k;
    for (int32_t x : r.tok) k += std::to_string(x) + ",";
    return k;
  };
  std::set<std::string> all_rows;
  for (int64_t r = 0; r < R; ++r) {
    Row x(T);
    pb.stream(Split::Train).fill_row(r, x.tok.data(), x.tgt.data(), x.doc.data(), x.pos.data());
    std::string k;
    for (int32_t t : x.tok) k += std::to_string(t) + ",";
    all_rows.insert(k);
  }
  ASSERT_EQ(static_cast<int64_t>(all_rows.size()), R);
  // Epochs 0 and 1 each hold every row once; sequence j of the concatenation at batch j / G.
  std::vector<std::string> e0, e1, o0;
  for (int64_t j = 0; j < 2 * R; ++j) (j < R ? e0 : e1).push_back(key(pb, Split::Train, j / G, static_cast<int>(j % G)));
  for (int64_t j = 0; j < R; ++j) o0.push_back(key(other, Split::Train, j / G, static_cast<int>(j % G)));
  EXPECT_EQ(std::set<std::string>(e0.begin(), e0.end()), all_rows);
  EXPECT_EQ(std::set<std::string>(e1.begin(), e1.end()), all_rows);
  EXPECT_NE(e0, e1);  // a new order each epoch
  EXPECT_NE(e0, o0);  // and per seed
  EXPECT_EQ(pb.epoch_of(0), 0);
  EXPECT_EQ(pb.epoch_of(R / G + 1), 1);
  // A batch read whole equals its rows read one by one (any split over ranks), also from another
  // object (nothing depends on what was read before), and its target count is the rows'.
  for (int64_t index : {int64_t{0}, R / G, 3 * R / G + 1}) {
    std::vector<int32_t> tok(static_cast<size_t>(G) * T), tgt(tok.size()), doc(tok.size()), pos(tok.size());
    same.fill(Split::Train, index, 0, G, tok.data(), tgt.data(), doc.data(), pos.data());
    int64_t n = 0;
    for (int i = 0; i < G; ++i) {
      std::string k;
      for (int t = 0; t < T; ++t) {
        k += std::to_string(tok[static_cast<size_t>(i) * T + static_cast<size_t>(t)]) + ",";
        n += tgt[static_cast<size_t>(i) * T + static_cast<size_t>(t)] != kNoTarget;
      }
      EXPECT_EQ(k, key(pb, Split::Train, index, i));
    }
    EXPECT_EQ(pb.batch_targets(Split::Train, index), n);
    EXPECT_GE(n, G);  // every row holds a target
  }
  // Validation: the rows in order, wrapping, the same for every evaluation.
  const int64_t Rv = pb.stream(Split::Val).rows();
  for (int i = 0; i < G; ++i) {
    Row x(T);
    pb.stream(Split::Val).fill_row(i % Rv, x.tok.data(), x.tgt.data(), x.doc.data(), x.pos.data());
    std::string k;
    for (int32_t t : x.tok) k += std::to_string(t) + ",";
    EXPECT_EQ(key(pb, Split::Val, 0, i), k);
  }
}

TEST(Packing, OptionSpellingsAndDataWithoutExamples) {
  EXPECT_EQ(parse_train_on("completion"), TrainOn::Assistant);
  EXPECT_EQ(parse_train_on("all"), TrainOn::All);
  EXPECT_EQ(parse_pack_mode("none"), PackMode::None);
  EXPECT_EQ(parse_max_length_policy("drop"), MaxLengthPolicy::Drop);
  for (auto f : {+[] { parse_train_on("prompt"); }, +[] { parse_pack_mode("first-fit"); },
                 +[] { parse_max_length_policy("cut"); }})
    EXPECT_THROW(f(), std::invalid_argument);
  std::vector<uint32_t> toks(100, 5);
  std::ofstream(tmp("v1.tok"), std::ios::binary) << shardtrain::testing::st_file(toks, 10);
  TokenDataset ds(tmp("v1.tok"));
  EXPECT_THROW(PackedExamples(ds, Split::Train, PackOptions{}), std::invalid_argument);
}

// The cross-entropy (CPU, whole rows and vocabulary-parallel with G = 1) with kNoTarget rows: the
// loss is the sum over the other rows alone, their gradient rows are those of a run without the
// masked rows, and the masked rows' gradients are zero.
TEST(Packing, CrossEntropySkipsRowsWithoutATarget) {
  auto be = make_cpu_backend<double>();
  const int N = 6, V = 11;
  std::vector<double> logits(static_cast<size_t>(N) * V);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(0.7 * static_cast<double>(i)) * 3.0;
  const std::vector<int32_t> tgt = {3, kNoTarget, 10, kNoTarget, 0, 7};
  // Reference: each counted row alone, in float64 loops.
  double want = 0;
  std::vector<double> dwant(logits.size(), 0.0);
  const double scale = 0.125;
  for (int i = 0; i < N; ++i) {
    if (tgt[static_cast<size_t>(i)] < 0) continue;
    const double* l = logits.data() + static_cast<size_t>(i) * V;
    double mx = l[0], sum = 0;
    for (int v = 1; v < V; ++v) mx = std::max(mx, l[v]);
    for (int v = 0; v < V; ++v) sum += std::exp(l[v] - mx);
    want += mx + std::log(sum) - l[tgt[static_cast<size_t>(i)]];
    for (int v = 0; v < V; ++v)
      dwant[static_cast<size_t>(i) * V + static_cast<size_t>(v)] =
          (std::exp(l[v] - mx) / sum - (v == tgt[static_cast<size_t>(i)] ? 1.0 : 0.0)) * scale;
  }
  std::vector<double> d(logits.size(), 99.0);
  const double got = be->cross_entropy(d.data(), logits.data(), tgt.data(), N, V, scale);
  EXPECT_NEAR(got, want, 1e-12 * std::abs(want));
  for (size_t i = 0; i < d.size(); ++i) EXPECT_NEAR(d[i], dwant[i], 1e-14) << i;
  // Vocabulary-parallel, one rank holding all V columns.
  std::vector<double> mx(N), st(2 * N), dv(logits.size(), 99.0);
  be->vocab_ce_max(logits.data(), N, V, V, mx.data());
  be->vocab_ce_sum(logits.data(), tgt.data(), N, V, V, 0, mx.data(), 1, st.data());
  (void)be->take_loss_sum();
  be->vocab_ce_finish(dv.data(), logits.data(), tgt.data(), N, V, V, 0, mx.data(), 1, st.data(), scale);
  EXPECT_NEAR(be->take_loss_sum(), want, 1e-12 * std::abs(want));
  for (size_t i = 0; i < dv.size(); ++i) EXPECT_NEAR(dv[i], dwant[i], 1e-14) << i;
}
