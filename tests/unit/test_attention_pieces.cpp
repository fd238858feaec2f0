// attention_pieces.h: the fused-attention pieces of a block pair cover exactly its visible (query,
// key) pairs, checked against the visibility rule itself (k_pos <= q_pos) pair by pair.
#include "shardtrain/backend/attention_pieces.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace at = shardtrain::attn;

namespace {

// How many pieces cover each (query row, key row) pair of a Tq x Tk block.
std::vector<int> coverage(const std::vector<at::Piece>& pieces, int Tq, int Tk) {
  std::vector<int> c(static_cast<size_t>(Tq) * Tk, 0);
  for (const at::Piece& p : pieces)
    for (int t = 0; t < p.nq; ++t)
      for (int u = 0; u < p.nk; ++u)
        if (!p.causal || u <= t) ++c[static_cast<size_t>(p.q0 + t) * Tk + (p.k0 + u)];
  return c;
}

// Positions made of chunks of consecutive positions at random offsets (overlapping, in any order,
// of 1 .. 40 rows), as context parallelism's head-tail chunks and uneven layouts give.
std::vector<int32_t> random_positions(std::mt19937& g, int chunks) {
  std::uniform_int_distribution<int> len(1, 40), start(0, 200);
  std::vector<int32_t> p;
  for (int i = 0; i < chunks; ++i) {
    const int s = start(g), n = len(g);
    for (int t = 0; t < n; ++t) p.push_back(s + t);
  }
  return p;
}

// qd, kd: document ids of the rows, or empty (one document).
void check_exact(const std::vector<int32_t>& qp, const std::vector<int32_t>& kp, const std::string& what,
                 const std::vector<int32_t>& qd = {}, const std::vector<int32_t>& kd = {}) {
  const int Tq = static_cast<int>(qp.size()), Tk = static_cast<int>(kp.size());
  const std::vector<at::Piece> pieces = at::plan(at::runs_of(qp.data(), Tq, qd.empty() ? nullptr : qd.data()),
                                                 at::runs_of(kp.data(), Tk, kd.empty() ? nullptr : kd.data()));
  const std::vector<int> c = coverage(pieces, Tq, Tk);
  int wrong = 0;
  for (int t = 0; t < Tq; ++t)
    for (int s = 0; s < Tk; ++s) {
      const bool same_doc = qd.empty() || qd[static_cast<size_t>(t)] == kd[static_cast<size_t>(s)];
      const int want = same_doc && kp[static_cast<size_t>(s)] <= qp[static_cast<size_t>(t)] ? 1 : 0;
      if (c[static_cast<size_t>(t) * Tk + s] != want && wrong++ < 3)
        ADD_FAILURE() << what << ": query row " << t << " (position " << qp[static_cast<size_t>(t)] << "), key row "
                      << s << " (position " << kp[static_cast<size_t>(s)] << "): covered "
                      << c[static_cast<size_t>(t) * Tk + s] << " times, visible " << want;
    }
  EXPECT_EQ(wrong, 0) << what;
  for (const at::Piece& p : pieces) {
    EXPECT_GT(p.nq, 0) << what;
    EXPECT_GT(p.nk, 0) << what;
    if (p.causal) {
      EXPECT_LE(p.nk, p.nq) << what << ": a causal piece with more keys than rows";
    }
  }
  const auto L = at::layers(pieces);
  size_t placed = 0;
  for (const auto& layer : L) {
    std::vector<int> rows(static_cast<size_t>(Tq), 0);
    for (int i : layer)
      for (int t = 0; t < pieces[static_cast<size_t>(i)].nq; ++t) ++rows[static_cast<size_t>(pieces[static_cast<size_t>(i)].q0 + t)];
    EXPECT_LE(*std::max_element(rows.begin(), rows.end()), 1) << what << ": a layer writes a row twice";
    EXPECT_EQ(at::rows_covered(pieces, layer), std::count(rows.begin(), rows.end(), 1)) << what;
    placed += layer.size();
  }
  EXPECT_EQ(placed, pieces.size()) << what;
}

}  // namespace

TEST(AttentionPieces, RunsOfPositions) {
  const std::vector<int32_t> p{5, 6, 7, 0, 1, 9, 9, 10};
  const auto r = at::runs_of(p.data(), static_cast<int>(p.size()));
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].row0, 0); EXPECT_EQ(r[0].n, 3); EXPECT_EQ(r[0].pos0, 5);
  EXPECT_EQ(r[1].row0, 3); EXPECT_EQ(r[1].n, 2); EXPECT_EQ(r[1].pos0, 0);
  EXPECT_EQ(r[2].row0, 5); EXPECT_EQ(r[2].n, 1); EXPECT_EQ(r[2].pos0, 9);
  EXPECT_EQ(r[3].row0, 6); EXPECT_EQ(r[3].n, 2); EXPECT_EQ(r[3].pos0, 9);
  const std::vector<int32_t> two{1, 2, 3, 1, 2, 3}, other{1, 2, 3, 1, 2, 4};
  EXPECT_TRUE(at::same_rows(two.data(), 2, 3));
  EXPECT_FALSE(at::same_rows(other.data(), 2, 3));
}

// Context parallelism's head-tail split (rank r: chunks r and 2P-1-r of c positions), every rank's
// queries against every rank's keys: exact, and the pieces of the three kinds of ring step.
TEST(AttentionPieces, HeadTailBlockPairsAreExactAndFew) {
  for (int P : {1, 2, 3, 4, 8})
    for (int c : {1, 3, 64}) {
      auto block = [&](int r) {
        std::vector<int32_t> p;
        for (int chunk : {r, 2 * P - 1 - r})
          for (int t = 0; t < c; ++t) p.push_back(chunk * c + t);
        return p;
      };
      for (int r = 0; r < P; ++r)
        for (int j = 0; j < P; ++j) {
          const auto qp = block(r), kp = block(j);
          const std::string what = "P " + std::to_string(P) + " c " + std::to_string(c) + " queries of rank " +
                                   std::to_string(r) + ", keys of rank " + std::to_string(j);
          check_exact(qp, kp, what);
          const auto pieces = at::plan(at::runs_of(qp.data(), 2 * c), at::runs_of(kp.data(), 2 * c));
          // The diagonal step (j == r) is three fused calls in two layers: the head causal, the tail
          // against the head's chunk full and against its own causal. Any other rank's block is one
          // full piece: keys of an earlier rank are its head chunk, seen by both of this rank's
          // chunks; of a later rank both its chunks, seen by this rank's tail only. (Rank P-1's
          // chunks P-1 and P are one run, so its diagonal is one causal piece.)
          if (P > 1 && c > 1 && !(j == r && r == P - 1)) {
            EXPECT_EQ(pieces.size(), j == r ? 3u : 1u) << what;
            EXPECT_EQ(at::layers(pieces).size(), j == r ? 2u : 1u) << what;
          }
        }
    }
}

TEST(AttentionPieces, RandomRunLayoutsAreCoveredExactly) {
  std::mt19937 g(57);
  for (int i = 0; i < 400; ++i) {
    std::uniform_int_distribution<int> chunks(1, 5);
    check_exact(random_positions(g, chunks(g)), random_positions(g, chunks(g)), "layout " + std::to_string(i));
  }
}

// Documents: a query sees a key only in its own document. Packed documents over the whole sequence
// (global positions, documents as contiguous spans of 1 .. 60 tokens), split head-tail over cp ranks,
// every rank's queries against every rank's keys; and positions that restart per document.
TEST(AttentionPieces, DocumentsAreCoveredExactly) {
  std::mt19937 g(58);
  for (int trial = 0; trial < 40; ++trial) {
    const int P = 1 + trial % 4, c = 8 + trial % 13, T = 2 * P * c;
    std::uniform_int_distribution<int> len(1, 60);
    std::vector<int32_t> doc(static_cast<size_t>(T)), restart(static_cast<size_t>(T));
    for (int t = 0, id = 0, left = len(g), start = 0; t < T; ++t) {
      if (left-- == 0) id++, left = len(g) - 1, start = t;
      doc[static_cast<size_t>(t)] = id;
      restart[static_cast<size_t>(t)] = t - start;
    }
    for (bool restarts : {false, true}) {
      auto block = [&](int r, std::vector<int32_t>* d) {
        std::vector<int32_t> p;
        for (int chunk : {r, 2 * P - 1 - r})
          for (int t = chunk * c; t < (chunk + 1) * c; ++t) {
            p.push_back(restarts ? restart[static_cast<size_t>(t)] : t);
            d->push_back(doc[static_cast<size_t>(t)]);
          }
        return p;
      };
      for (int r = 0; r < P; ++r)
        for (int j = 0; j < P; ++j) {
          std::vector<int32_t> qd, kd;
          const auto qp = block(r, &qd), kp = block(j, &kd);
          check_exact(qp, kp,
                      "trial " + std::to_string(trial) + (restarts ? " (positions restart per document)" : "") +
                          " queries of rank " + std::to_string(r) + ", keys of rank " + std::to_string(j),
                      qd, kd);
        }
    }
  }
}
