// The head-tail split of context parallelism (context_parallel.h: cp_split_problem, cp_chunks,
// cp_rows, cp_positions) and the tile-pair count (block_tile_pairs, cp_tile_pairs):
//   - rows: against the definition written differently here (row t lies in chunk c = t / len,
//     which rank min(c, 2·cp−1−c) holds; head chunk first): every row held exactly once, Tl rows
//     per rank, in order; positions are the rows, repeated per sequence.
//   - refusals: T not divisible by 2·cp names T, cp, 2·cp and the rule; cp < 1, T < 1, a rank
//     outside [0, cp) are refused; cp_chunks throws the same text.
//   - block_tile_pairs: against a brute-force count of tile pairs with no visible (query, key) pair,
//     exact for contiguous positions and documents, never above it across a head-tail seam.
//   - balance (count only, the kernels' tile rule): at cp = 4 and T = 65,536 the head-tail split
//     gives every rank the same computed tile pairs (within 10% of the mean is the bar), the
//     contiguous split does not (its last rank has about 2·cp−1 times the first's); both sum to the
//     whole sequence's causal tile count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/parallel/context_parallel.h"
#include "shardtrain/backend/flash_attention.h"

namespace st = shardtrain;

namespace {

// Rank r's rows by the chunk-owner rule: chunk c belongs to rank min(c, 2·cp−1−c).
std::vector<int32_t> rows_by_owner(int T, int cp, int r) {
  const int len = T / (2 * cp);
  std::vector<int32_t> head, tail;
  for (int t = 0; t < T; ++t) {
    const int c = t / len, owner = std::min(c, 2 * cp - 1 - c);
    if (owner == r) (c < cp ? head : tail).push_back(t);
  }
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(CpSplit, RowsAreTheHeadTailChunks) {
  for (int cp : {1, 2, 3, 4, 8})
    for (int T : {2 * cp, 6 * cp, 48 * cp}) {
      std::vector<int> seen(static_cast<size_t>(T), 0);
      for (int r = 0; r < cp; ++r) {
        const std::vector<int32_t> rows = st::cp_rows(T, cp, r);
        EXPECT_EQ(rows, rows_by_owner(T, cp, r)) << "T=" << T << " cp=" << cp << " rank " << r;
        EXPECT_EQ(static_cast<int>(rows.size()), T / cp);
        for (int32_t t : rows) ++seen[static_cast<size_t>(t)];
        const st::CpChunks c = st::cp_chunks(T, cp, r);
        EXPECT_EQ(c.len, T / (2 * cp));
        EXPECT_EQ(rows.front(), c.head);
        EXPECT_EQ(rows[static_cast<size_t>(c.len)], c.tail);
        const std::vector<int32_t> pos = st::cp_positions(3, T, cp, r);
        ASSERT_EQ(pos.size(), 3 * rows.size());
        for (size_t i = 0; i < pos.size(); ++i) EXPECT_EQ(pos[i], rows[i % rows.size()]);
      }
      EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; })) << "T=" << T << " cp=" << cp;
    }
  // A worked example: T = 16, cp = 2: chunks of 4; rank 0 holds rows 0-3 and 12-15, rank 1 4-11.
  EXPECT_EQ(st::cp_rows(16, 2, 0), (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15}));
  EXPECT_EQ(st::cp_rows(16, 2, 1), (std::vector<int32_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(st::cp_rows(12, 3, 1, st::CpSplit::Contiguous), (std::vector<int32_t>{4, 5, 6, 7}));
}

TEST(CpSplit, RefusalNamesTAndCpAndTheRule) {
  EXPECT_EQ(st::cp_split_problem(48, 4), "");
  EXPECT_EQ(st::cp_split_problem(2, 1), "");
  const std::string m = st::cp_split_problem(100, 3);
  std::printf("[ cp ] %s\n", m.c_str());
  EXPECT_TRUE(contains(m, "T = 100")) << m;
  EXPECT_TRUE(contains(m, "cp = 3")) << m;
  EXPECT_TRUE(contains(m, "2 x cp = 6")) << m;
  EXPECT_TRUE(contains(m, "chunks r and 2 x cp - 1 - r")) << m;
  EXPECT_TRUE(contains(m, "multiple of 6")) << m;
  EXPECT_TRUE(contains(st::cp_split_problem(12, 4), "T = 12")) << "12 is divisible by cp = 4 but not by 8";
  EXPECT_TRUE(contains(st::cp_split_problem(16, 0), "cp must be >= 1"));
  EXPECT_TRUE(contains(st::cp_split_problem(0, 2), "T = 0"));
  EXPECT_TRUE(contains(st::cp_split_problem(int64_t{1} << 32, 1), "int32"));
  try {
    (void)st::cp_chunks(100, 3, 0);
    ADD_FAILURE() << "T = 100 at cp = 3 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), m);
  }
  EXPECT_THROW((void)st::cp_chunks(16, 2, 2), std::invalid_argument);
  EXPECT_THROW((void)st::cp_rows(16, 2, -1), std::invalid_argument);
  EXPECT_THROW((void)st::cp_positions(0, 16, 2, 0), std::invalid_argument);
  EXPECT_THROW((void)st::cp_rows(10, 3, 0, st::CpSplit::Contiguous), std::invalid_argument);
}

// block_tile_pairs against brute force: a tile pair is masked iff no (query, key) in it is visible.
TEST(CpSplit, TilePairsAgainstBruteForce) {
  std::mt19937 g(3);
  auto brute = [](const std::vector<int32_t>& qp, const std::vector<int32_t>& qd, const std::vector<int32_t>& kp,
                  const std::vector<int32_t>& kd) {
    st::CpTilePairs c;
    const int Tq = static_cast<int>(qp.size()), Tk = static_cast<int>(kp.size());
    for (int i = 0; i < Tq; i += st::flash::kBr)
      for (int j = 0; j < Tk; j += st::flash::kBc) {
        bool any = false;
        for (int t = i; t < std::min(Tq, i + st::flash::kBr); ++t)
          for (int s = j; s < std::min(Tk, j + st::flash::kBc); ++s)
            any = any || (kp[static_cast<size_t>(s)] <= qp[static_cast<size_t>(t)] &&
                          (qd.empty() || qd[static_cast<size_t>(t)] == kd[static_cast<size_t>(s)]));
        ++c.pairs;
        if (!any) ++c.skipped;
      }
    return c;
  };
  int64_t skipped = 0, visited = 0;
  for (int rep = 0; rep < 20; ++rep) {
    const int T = 64 + static_cast<int>(g() % 600);
    std::vector<int32_t> pos(static_cast<size_t>(T)), doc(static_cast<size_t>(T));
    int id = 0;
    for (int t = 0; t < T; ++t) {
      pos[static_cast<size_t>(t)] = t;
      if (g() % 50 == 0) ++id;
      doc[static_cast<size_t>(t)] = id;
    }
    // A query block and a key block: contiguous slices [a, a + n) and [c, c + m).
    const int a = static_cast<int>(g() % static_cast<uint32_t>(T)), n = 1 + static_cast<int>(g() % static_cast<uint32_t>(T - a));
    const int c = static_cast<int>(g() % static_cast<uint32_t>(T)), m = 1 + static_cast<int>(g() % static_cast<uint32_t>(T - c));
    auto slice = [](const std::vector<int32_t>& x, int s0, int len) {
      return std::vector<int32_t>(x.begin() + s0, x.begin() + s0 + len);
    };
    for (bool with_doc : {false, true}) {
      const auto qp = slice(pos, a, n), kp = slice(pos, c, m);
      const auto qd = with_doc ? slice(doc, a, n) : std::vector<int32_t>{}, kd = with_doc ? slice(doc, c, m) : std::vector<int32_t>{};
      const st::CpTilePairs got = st::block_tile_pairs(qp.data(), with_doc ? qd.data() : nullptr, n, kp.data(),
                                                       with_doc ? kd.data() : nullptr, m);
      const st::CpTilePairs want = brute(qp, qd, kp, kd);
      EXPECT_EQ(got.pairs, want.pairs);
      EXPECT_EQ(got.skipped, want.skipped) << "contiguous blocks: the range rule is exact";
      skipped += got.skipped;
      visited += got.pairs;
    }
  }
  EXPECT_GT(skipped, 0) << "the cases include masked tile pairs";
  EXPECT_LT(skipped, visited) << "and visible ones";
  // Across a head-tail seam (chunks of 40 rows: tiles span two chunks) the rule may compute a masked
  // pair, never skip a visible one.
  for (int r = 0; r < 4; ++r) {
    const std::vector<int32_t> q = st::cp_rows(320, 4, r);
    for (int o = 0; o < 4; ++o) {
      const std::vector<int32_t> k = st::cp_rows(320, 4, o);
      const st::CpTilePairs got = st::block_tile_pairs(q.data(), nullptr, 80, k.data(), nullptr, 80);
      const st::CpTilePairs want = brute(q, {}, k, {});
      EXPECT_EQ(got.pairs, want.pairs);
      EXPECT_LE(got.skipped, want.skipped);
    }
  }
}

// Issue 41's balance item, counted: per-rank computed tile pairs of the ring's forward at cp = 4.
TEST(CpSplit, HeadTailBalancesContiguousDoesNot) {
  const int T = 65536, cp = 4, tiles = T / st::flash::kBr;
  const int64_t whole = int64_t{tiles} * (tiles + 1) / 2;  // causal tile pairs of the whole sequence
  for (st::CpSplit split : {st::CpSplit::HeadTail, st::CpSplit::Contiguous}) {
    const std::vector<st::CpTilePairs> per = st::cp_tile_pairs(T, cp, split);
    ASSERT_EQ(per.size(), static_cast<size_t>(cp));
    int64_t sum = 0, lo = INT64_MAX, hi = 0;
    for (const st::CpTilePairs& p : per) {
      sum += p.computed();
      lo = std::min(lo, p.computed());
      hi = std::max(hi, p.computed());
      EXPECT_EQ(p.pairs, int64_t{tiles / cp} * tiles);  // every block pair is visited (and classified)
    }
    const double mean = static_cast<double>(sum) / cp;
    const bool ht = split == st::CpSplit::HeadTail;
    std::printf("[ cp ] T=%d cp=%d %s: computed tile pairs per rank", T, cp, ht ? "head-tail" : "contiguous");
    for (const st::CpTilePairs& p : per) std::printf(" %lld", static_cast<long long>(p.computed()));
    std::printf(" (max/mean %.3f, min/mean %.3f)\n", hi / mean, lo / mean);
    EXPECT_EQ(sum, whole) << "the split only moves work between ranks";
    if (ht) {
      EXPECT_LE(hi, 1.1 * mean);
      EXPECT_GE(lo, 0.9 * mean);
      EXPECT_EQ(lo, hi) << "chunks of whole tiles: exactly balanced";
    } else {
      EXPECT_GT(hi, 1.5 * mean) << "contiguous: the last rank has most of the work";
      EXPECT_LT(lo, 0.5 * mean);
      EXPECT_EQ(per.back().computed(), hi);
    }
  }
}

// AllGather's chunk of KV heads under the default 256 MiB bound, worked by hand for llama-8b's
// attention (NH = 32, NKV = 8, G = 4, HD = 128) in bf16. All 8 heads' gathered K, V, dK, dV at
// T = cp·Tl tokens take 4·T·8·128·2 B: 256 MiB at T = 32,768 (fits: one chunk, nothing packed).
// Chunked, one head takes its gathered 4·T·128·2 B plus the packed k, v, dk, dv (4·Tl·128·2) and
// q, y, dq (3·Tl·4·128·2): at T = 131,072 on cp = 8 (Tl = 16,384) 128 + 64 = 192 MiB, so hk = 1;
// with a 512 MiB bound hk = 2 (384 MiB). The scratch never exceeds the bound unless hk = 1.
TEST(CpSplit, AllGatherChunkOfKvHeads) {
  const size_t e = 2;  // bf16
  const int64_t MiB = int64_t{1} << 20;
  EXPECT_EQ(st::cp_gather_kv_heads(8, 32768 / 8, 32, 8, 128, e), 8);
  EXPECT_EQ(st::cp_gather_kv_heads(4, 32768 / 4, 32, 8, 128, e), 8);  // unchunked: depends on T = cp·Tl only
  EXPECT_EQ(st::cp_gather_scratch_bytes(8, 32768 / 8, 32, 8, 128, e), 256 * MiB);
  EXPECT_EQ(st::cp_gather_kv_heads(8, 131072 / 8, 32, 8, 128, e), 1);
  EXPECT_EQ(st::cp_gather_scratch_bytes(8, 131072 / 8, 32, 8, 128, e), 192 * MiB);
  EXPECT_EQ(st::cp_gather_kv_heads(8, 131072 / 8, 32, 8, 128, e, size_t{512} << 20), 2);
  EXPECT_EQ(st::cp_gather_scratch_bytes(8, 131072 / 8, 32, 8, 128, e, size_t{512} << 20), 384 * MiB);
  EXPECT_EQ(st::cp_gather_kv_heads(8, 131072 / 8, 32, 8, 128, e, (size_t{576} << 20) - 1), 2);
  EXPECT_EQ(st::cp_gather_kv_heads(8, 131072 / 8, 32, 8, 128, e, size_t{576} << 20), 3);
  EXPECT_EQ(st::cp_gather_kv_heads(8, 131072 / 8, 32, 8, 128, e, size_t{1} << 30), 8);  // 4·T·8·128·2 = 1 GiB fits
  EXPECT_EQ(st::cp_gather_kv_heads(8, 131072 / 8, 32, 8, 128, e, (size_t{1} << 30) - 1), 5);  // chunked: 5 x 192 MiB
  EXPECT_EQ(st::cp_gather_kv_heads(8, 1048576 / 8, 32, 8, 128, e), 1);  // one head alone exceeds the bound
  EXPECT_EQ(st::cp_gather_kv_heads(2, 1 << 20, 8, 1, 128, e), 1);      // NKV = 1 that does not fit
  // fp32, cp 2, T = 32,768 (the case that first showed packed copies outside the bound): unchunked
  // 512 MiB does not fit; one head chunked is (8 + 4 + 12)·16384·128·4 B = 192 MiB.
  EXPECT_EQ(st::cp_gather_kv_heads(2, 16384, 32, 8, 128, 4), 1);
  EXPECT_EQ(st::cp_gather_scratch_bytes(2, 16384, 32, 8, 128, 4), 192 * MiB);
  // Over a grid of shapes the scratch is within the bound whenever more than one head is taken.
  for (int cp : {1, 2, 3, 4, 8})
    for (int T : {4096, 32768, 131072, 262144})
      for (int G : {1, 4, 8})
        for (size_t el : {size_t{2}, size_t{4}, size_t{8}}) {
          const int hk = st::cp_gather_kv_heads(cp, T / cp, 8 * G, 8, 128, el);
          if (hk > 1) {
            EXPECT_LE(st::cp_gather_scratch_bytes(cp, T / cp, 8 * G, 8, 128, el), 256 * MiB)
                << "cp " << cp << " T " << T << " G " << G << " elem " << el;
          }
        }
  EXPECT_THROW(st::cp_gather_kv_heads(0, 16, 8, 8, 128, e), std::invalid_argument);
  EXPECT_THROW(st::cp_gather_kv_heads(2, 16, 6, 4, 128, e), std::invalid_argument);
  EXPECT_THROW(st::cp_gather_scratch_bytes(2, 16, 6, 4, 128, e), std::invalid_argument);
}
