// Document masking (--attention-mask document; model.h AttentionMask, TokenLayout; data.h
// document_layout), each against an independent reference:
//   - document_layout: hand-checked rows, and random rows against a count of the EOS before each
//     token and a backward scan for its document's start;
//   - the model in float64 with documents: every parameter's gradient against central differences
//     (tiled and exact attention, the recompute modes);
//   - each row of packed documents gives the loss and the weight gradients of its documents run
//     one by one as separate sequences (causal, positions from 0), within 1e-12: what the mask and
//     the restarting positions mean, checked without them; tiled == exact within 1e-12, and the
//     recompute modes bitwise equal;
//   - no EOS in the batch: the layout changes nothing, and loss and gradients are bitwise those of
//     the causal model (float64 and fp32);
//   - the tile pairs the block kernels compute for a batch of many short documents: exactly those
//     holding a visible (query, key) pair (a brute-force count), fewer than causal attention's;
//   - positions alone (RoPE is relative, so under the document mask the restart only rounds
//     differently): they change the loss, tiled == exact within 1e-12;
//   - the range calls (pipeline stages) keep each micro-batch's layout: two in flight, bitwise the
//     whole model one at a time; a position outside [0, T) is refused;
//   - the model allocates what activation_bytes counts with mask Document.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../mpi/counting_backend.h"
#include "../test_env.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/model/config.h"
#include "shardtrain/data/data.h"
#include "shardtrain/backend/flash_attention.h"
#include "shardtrain/model/model.h"
#include "shardtrain/shard/shard.h"

namespace shardtrain {
namespace {

using Vec = std::vector<double>;
constexpr int32_t kEos = 1;

// ---- document_layout ------------------------------------------------------------------------------
struct Layout {
  std::vector<int32_t> doc, pos;
};
Layout layout_of(const std::vector<int32_t>& tok, int B, int T, int64_t stride, int32_t eos) {
  Layout l{std::vector<int32_t>(static_cast<size_t>(B) * T, -7), std::vector<int32_t>(static_cast<size_t>(B) * T, -7)};
  document_layout(tok.data(), B, T, stride, eos, l.doc.data(), l.pos.data());
  return l;
}

TEST(DocumentLayout, HandChecked) {
  // EOS = 9. Row 0: "5 9 | 3 4 9 | 9 | 2": an EOS ends its document, a lone EOS is a document.
  // Row 1 starts with an EOS (a document of one token), then one document without an end.
  const std::vector<int32_t> tok = {5, 9, 3, 4, 9, 9, 2,  //
                                    9, 1, 2, 3, 4, 5, 6};
  const Layout l = layout_of(tok, 2, 7, 7, 9);
  EXPECT_EQ(l.doc, (std::vector<int32_t>{0, 0, 1, 1, 1, 2, 3, 0, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(l.pos, (std::vector<int32_t>{0, 1, 0, 1, 2, 0, 0, 0, 0, 1, 2, 3, 4, 5}));
  // Sequences [B, T + 1] (stride T + 1): the last token (a target only) is not read.
  const std::vector<int32_t> seq = {4, 9, 4, 9,  //
                                    9, 9, 9, 9};
  const Layout s = layout_of(seq, 2, 3, 4, 9);
  EXPECT_EQ(s.doc, (std::vector<int32_t>{0, 0, 1, 0, 1, 2}));
  EXPECT_EQ(s.pos, (std::vector<int32_t>{0, 1, 0, 0, 0, 0}));
  // No EOS: one document per row, positions 0..T-1.
  const Layout n = layout_of({3, 3, 3, 3, 3, 3}, 2, 3, 3, 9);
  EXPECT_EQ(n.doc, (std::vector<int32_t>{0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(n.pos, (std::vector<int32_t>{0, 1, 2, 0, 1, 2}));
  EXPECT_THROW(layout_of(tok, 2, 7, 6, 9), std::invalid_argument);  // stride < T
  EXPECT_NO_THROW(layout_of({}, 0, 0, 0, 9));
}

TEST(DocumentLayout, RandomAgainstReference) {
  std::mt19937 g(4141);
  for (int trial = 0; trial < 200; ++trial) {
    const int B = 1 + static_cast<int>(g() % 4), T = static_cast<int>(g() % 90);
    const int64_t stride = T + static_cast<int>(g() % 3);
    const double p_eos = (g() % 5) / 8.0;  // 0 (no EOS) .. 0.5
    std::bernoulli_distribution is_eos(p_eos);
    std::vector<int32_t> tok(static_cast<size_t>(B) * static_cast<size_t>(stride));
    for (auto& x : tok) x = is_eos(g) ? kEos : 2 + static_cast<int32_t>(g() % 50);
    const Layout l = layout_of(tok, B, T, stride, kEos);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const int32_t* row = tok.data() + b * stride;
        const int32_t eos_before = static_cast<int32_t>(std::count(row, row + t, kEos));
        int start = t;  // scan back to the token after the last EOS before t
        while (start > 0 && row[start - 1] != kEos) --start;
        const size_t i = static_cast<size_t>(b) * T + t;
        ASSERT_EQ(l.doc[i], eos_before) << "trial " << trial << " b " << b << " t " << t;
        ASSERT_EQ(l.pos[i], t - start) << "trial " << trial << " b " << b << " t " << t;
      }
  }
}

// ---- the model ------------------------------------------------------------------------------------
ModelConfig doc_config(int max_pos) {
  ModelConfig c;
  c.name = "document-mask";
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;  // GQA
  c.max_position_embeddings = max_pos;
  c.tie_word_embeddings = false;
  c.bos_token_id = 0;
  c.eos_token_ids = {kEos};
  return c;
}

// As test_gradcheck.cpp: spread the weights (matrices x15, norms 1 + N(0, 0.2^2)) so that attention
// is far from uniform and every gradient is sizeable.
template <typename T> void spread_params(Fsdp<T>& f, uint64_t seed) {
  std::mt19937 g(static_cast<uint32_t>(seed));
  std::normal_distribution<double> nd(0.0, 0.2);
  for (int u = 0; u < f.num_units(); ++u)
    for (const auto& slot : f.plan().units[u].params) {
      T* p = f.param_shard(u) + slot.offset;
      for (int64_t i = 0; i < slot.numel; ++i)
        p[i] = static_cast<T>(slot.spec.init == Init::Ones ? 1.0 + nd(g) : 15.0 * static_cast<double>(p[i]));
    }
}

struct Batch {
  int B = 0, T = 0;
  std::vector<int32_t> tokens, targets;
  Layout lay;
  TokenLayout layout() const { return {lay.pos.data(), lay.doc.data()}; }
};
// Rows of documents of the given lengths (each ends with an EOS, but a row's last one may run on),
// ids 2..10 elsewhere; random targets.
Batch packed(const std::vector<std::vector<int>>& rows, uint32_t seed) {
  std::mt19937 g(seed);
  Batch bt;
  bt.B = static_cast<int>(rows.size());
  for (const auto& r : rows) {
    int n = 0;
    for (int len : r) n += len;
    if (bt.T == 0) bt.T = n;
    EXPECT_EQ(n, bt.T) << "rows of one batch have one length";
    for (size_t d = 0; d < r.size(); ++d)
      for (int i = 0; i < r[d]; ++i)
        bt.tokens.push_back(i + 1 == r[d] && d + 1 < r.size() ? kEos : 2 + static_cast<int32_t>(g() % 9));
  }
  for (size_t i = 0; i < bt.tokens.size(); ++i) bt.targets.push_back(static_cast<int32_t>(g() % 11));
  bt.lay = layout_of(bt.tokens, bt.B, bt.T, bt.T, kEos);
  return bt;
}

template <typename T> struct Step {
  double loss = 0;
  std::vector<std::vector<T>> grads;  // per unit
};
// One training forward + backward from zero gradients (grad_scale 1: the loss sum's gradient).
template <typename T>
Step<T> train_step(Fsdp<T>& f, LlamaModel<T>& m, const Batch& bt, bool with_layout) {
  f.zero_grads();
  m.forward(f, bt.tokens.data(), bt.B, bt.T, with_layout ? bt.layout() : TokenLayout{});
  Step<T> r;
  r.loss = m.head_backward(f, bt.targets.data(), 1.0f);
  m.backward(f);
  for (int u = 0; u < f.num_units(); ++u)
    r.grads.emplace_back(f.grad_shard(u), f.grad_shard(u) + f.plan().units[u].shard_size);
  return r;
}

// max |a - b| over every gradient element, relative to max |b| (at least 1).
template <typename T> double grad_diff(const Step<T>& a, const Step<T>& b) {
  double mx = 1, err = 0;
  for (size_t u = 0; u < b.grads.size(); ++u)
    for (size_t i = 0; i < b.grads[u].size(); ++i) {
      mx = std::max(mx, std::abs(static_cast<double>(b.grads[u][i])));
      err = std::max(err, std::abs(static_cast<double>(a.grads[u][i]) - static_cast<double>(b.grads[u][i])));
    }
  return err / mx;
}
template <typename T> bool bitwise_equal(const Step<T>& a, const Step<T>& b) {
  return a.loss == b.loss && a.grads == b.grads;
}

struct Model {
  std::unique_ptr<Backend<double>> be = make_cpu_backend<double>();
  ModelConfig cfg;
  Fsdp<double> f;
  Model(const ModelConfig& c, uint64_t seed)
      : cfg(c), f(*be, testing::comm(), ShardPlan::build(llama_units(c), 1)) {
    f.init_params(2041);
    spread_params(f, seed);
  }
};

constexpr double kH = 1e-5;  // central differences, as test_gradcheck.cpp
TEST(DocumentMask, GradientsAgainstCentralDifferences) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank FD check";
  // Row 0: three documents (the last runs to the row's end); row 1 begins with a lone EOS.
  const Batch bt = packed({{4, 5, 3}, {1, 6, 5}}, 11);
  struct Case { Recompute r; AttentionKind a; };
  for (const Case& k : {Case{Recompute::None, AttentionKind::Tiled}, Case{Recompute::None, AttentionKind::Exact},
                        Case{Recompute::Selective, AttentionKind::Exact}, Case{Recompute::Full, AttentionKind::Tiled}}) {
    Model md(doc_config(16), 7);
    LlamaModel<double> m(md.cfg, *md.be, ModelOptions{k.r, k.a, 0, AttentionMask::Document});
    const Step<double> an = train_step(md.f, m, bt, true);
    auto eval = [&] {
      m.forward(md.f, bt.tokens.data(), bt.B, bt.T, bt.layout());
      return m.loss(md.f, bt.targets.data());
    };
    EXPECT_NEAR(eval(), an.loss, 1e-13 * an.loss);
    int n = 0, fails = 0;
    double worst = 0;
    for (int u = 0; u < md.f.num_units(); ++u)
      for (int64_t i = 0; i < md.f.plan().units[u].shard_size; ++i) {
        double* p = md.f.param_shard(u) + i;
        const double old = *p;
        *p = old + kH;
        const double lp = eval();
        *p = old - kH;
        const double lm = eval();
        *p = old;
        const double num = (lp - lm) / (2 * kH), a = an.grads[static_cast<size_t>(u)][static_cast<size_t>(i)];
        const double abs_err = std::abs(a - num), rel = abs_err / std::max(1e-8, std::abs(a) + std::abs(num));
        ++n;
        worst = std::max(worst, std::min(rel / 1e-6, abs_err / 1e-9));
        if (!(rel < 1e-6 || abs_err < 1e-9) && ++fails <= 5)
          ADD_FAILURE() << "unit " << u << " [" << i << "] analytic " << a << " numeric " << num;
      }
    std::printf("[ DocMask ] FD, recompute %s, %s attention: %d elements, worst min(rel/1e-6, abs/1e-9) %.3f\n",
                recompute_name(k.r), attention_name(k.a), n, worst);
    EXPECT_GT(n, 500);
    EXPECT_EQ(fails, 0);
  }
}

// The documents of each row, run one by one as sequences of their own (causal, positions 0..n-1,
// the same targets): their losses and weight gradients add up to the packed row's under the
// document mask. T = 150 (3 query tiles, the last partial); documents shorter than a tile, longer
// than one, and straddling the tile seams.
TEST(DocumentMask, PackedRowsEqualTheirDocumentsRunAlone) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  const std::vector<std::vector<int>> rows = {{70, 9, 1, 50, 20}, {3, 130, 17}};
  const Batch bt = packed(rows, 23);
  std::vector<Step<double>> packed_runs;
  for (AttentionKind a : {AttentionKind::Tiled, AttentionKind::Exact}) {
    Model md(doc_config(256), 5);
    LlamaModel<double> m(md.cfg, *md.be, ModelOptions{Recompute::None, a, 0, AttentionMask::Document});
    const Step<double> whole = train_step(md.f, m, bt, true);
    // The reference: every document alone, gradients summed.
    Step<double> sum{0, {}};
    for (const auto& g : whole.grads) sum.grads.emplace_back(g.size(), 0.0);
    LlamaModel<double> causal(md.cfg, *md.be, ModelOptions{Recompute::None, a, 0});
    int first = 0;
    for (size_t b = 0; b < rows.size(); ++b, first = 0)
      for (int len : rows[b]) {
        Batch one;
        one.B = 1;
        one.T = len;
        const size_t o = b * static_cast<size_t>(bt.T) + static_cast<size_t>(first);
        one.tokens.assign(bt.tokens.begin() + static_cast<std::ptrdiff_t>(o), bt.tokens.begin() + static_cast<std::ptrdiff_t>(o) + len);
        one.targets.assign(bt.targets.begin() + static_cast<std::ptrdiff_t>(o), bt.targets.begin() + static_cast<std::ptrdiff_t>(o) + len);
        const Step<double> r = train_step(md.f, causal, one, false);
        sum.loss += r.loss;
        for (size_t u = 0; u < r.grads.size(); ++u)
          for (size_t i = 0; i < r.grads[u].size(); ++i) sum.grads[u][i] += r.grads[u][i];
        first += len;
      }
    const double dl = std::abs(whole.loss - sum.loss) / sum.loss, dg = grad_diff(whole, sum);
    std::printf("[ DocMask ] %s: packed loss %.15g, documents alone %.15g (rel diff %.2e), gradients max rel diff %.2e\n",
                attention_name(a), whole.loss, sum.loss, dl, dg);
    EXPECT_LE(dl, 1e-12);
    EXPECT_LE(dg, 1e-12);
    // The same batch without the mask attends across documents: a different loss.
    const Step<double> c = train_step(md.f, causal, bt, false);
    EXPECT_GT(std::abs(c.loss - whole.loss), 1e-3 * whole.loss) << "the mask must change the result";
    packed_runs.push_back(whole);
  }
  const double dl = std::abs(packed_runs[0].loss - packed_runs[1].loss) / packed_runs[1].loss;
  const double dg = grad_diff(packed_runs[0], packed_runs[1]);
  std::printf("[ DocMask ] tiled vs exact: loss rel diff %.2e, gradients max rel diff %.2e\n", dl, dg);
  EXPECT_LE(dl, 1e-12);
  EXPECT_LE(dg, 1e-12);
}

// Activation checkpointing recomputes the same kernels on the same inputs: bitwise equal gradients
// with documents too (both attention paths).
TEST(DocumentMask, RecomputeModesBitwise) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  const Batch bt = packed({{30, 1, 60, 9}, {77, 23}}, 29);
  for (AttentionKind a : {AttentionKind::Tiled, AttentionKind::Exact}) {
    std::vector<Step<double>> runs;
    for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      Model md(doc_config(128), 3);
      LlamaModel<double> m(md.cfg, *md.be, ModelOptions{r, a, 0, AttentionMask::Document});
      runs.push_back(train_step(md.f, m, bt, true));
    }
    EXPECT_TRUE(bitwise_equal(runs[1], runs[0])) << attention_name(a) << ": selective";
    EXPECT_TRUE(bitwise_equal(runs[2], runs[0])) << attention_name(a) << ": full";
  }
}

// Without an EOS in the batch every row is one document at positions 0..T-1: the model runs
// today's causal path, bitwise (float64 and fp32, both attention paths).
template <typename T> void check_no_eos_is_causal() {
  auto be = make_cpu_backend<T>();
  const ModelConfig cfg = doc_config(256);
  Batch bt = packed({{150}, {150}}, 31);
  ASSERT_EQ(std::count(bt.tokens.begin(), bt.tokens.end(), kEos), 0);
  for (AttentionKind a : {AttentionKind::Tiled, AttentionKind::Exact}) {
    Fsdp<T> f(*be, testing::comm(), ShardPlan::build(llama_units(cfg), 1));
    f.init_params(2042);
    spread_params(f, 2);
    LlamaModel<T> causal(cfg, *be, ModelOptions{Recompute::None, a, 0});
    LlamaModel<T> doc(cfg, *be, ModelOptions{Recompute::None, a, 0, AttentionMask::Document});
    const Step<T> c = train_step(f, causal, bt, false), d = train_step(f, doc, bt, true);
    EXPECT_TRUE(bitwise_equal(d, c)) << attention_name(a) << ": loss " << d.loss << " vs " << c.loss;
  }
}
TEST(DocumentMask, NoEosIsCausalBitwise) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  check_no_eos_is_causal<double>();
  check_no_eos_is_causal<float>();
}

// Tile pairs computed for many short documents: each (b, h, query tile, key tile) whose tiles hold
// some visible (query, key) pair, counted by brute force over the tokens, is computed, no other;
// causal attention (flash_attention_*, the same tile rule) computes the nq (nq + 1) / 2 pairs on
// and below the diagonal per (b, h). Each block forward and backward counts its pairs (pass 1).
TEST(DocumentMask, SkipsTilePairsOfOtherDocuments) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  std::mt19937 g(37);
  std::vector<std::vector<int>> rows(2);
  const int T = 512;
  for (auto& r : rows) {  // documents of 5..40 tokens
    int n = 0;
    while (n < T) {
      const int len = std::min(T - n, 5 + static_cast<int>(g() % 36));
      r.push_back(len);
      n += len;
    }
  }
  const Batch bt = packed(rows, 41);
  Model md(doc_config(T), 1);
  LlamaModel<double> m(md.cfg, *md.be, ModelOptions{Recompute::None, AttentionKind::Tiled, 0, AttentionMask::Document});
  (void)md.be->take_block_attention_stats();
  train_step(md.f, m, bt, true);
  const auto st = md.be->take_block_attention_stats();
  const int nq = flash::num_tiles(T, flash::kBr), nk = flash::num_tiles(T, flash::kBc);
  const int64_t calls = 2 * md.cfg.num_hidden_layers, heads = md.cfg.num_attention_heads;
  int64_t visible_pairs = 0;  // per head, over the rows
  for (int b = 0; b < bt.B; ++b)
    for (int i = 0; i < nq; ++i)
      for (int j = 0; j < nk; ++j) {
        bool any = false;
        for (int t = i * flash::kBr; t < std::min(T, (i + 1) * flash::kBr) && !any; ++t)
          for (int s = j * flash::kBc; s < std::min(T, (j + 1) * flash::kBc) && !any; ++s)
            any = s <= t && bt.lay.doc[static_cast<size_t>(b) * T + s] == bt.lay.doc[static_cast<size_t>(b) * T + t];
        visible_pairs += any;
      }
  const int64_t causal = calls * heads * bt.B * nq * (nq + 1) / 2;
  EXPECT_EQ(st.tile_pairs, calls * heads * bt.B * nq * nk);
  EXPECT_EQ(st.tile_pairs - st.skipped, calls * heads * visible_pairs);
  EXPECT_LT(st.tile_pairs - st.skipped, causal);
  std::printf("[ DocMask ] %zu + %zu documents in 2 x %d tokens: %lld tile pairs computed of %lld (%.0f%% skipped); "
              "causal computes %lld\n",
              rows[0].size(), rows[1].size(), T, static_cast<long long>(st.tile_pairs - st.skipped),
              static_cast<long long>(st.tile_pairs), 100.0 * static_cast<double>(st.skipped) / static_cast<double>(st.tile_pairs),
              static_cast<long long>(causal));
}

// RoPE is relative: within a document, positions restarting at its first token and positions
// counted from the row's start give the same scores (to rounding), so with the document mask the
// restart is invisible in the loss. Positions alone (no documents) are not: tokens then attend
// across documents at distances the positions make up. That the model applies them: a layout of
// positions only changes the loss, and the tiled and exact paths agree on it within 1e-12.
TEST(DocumentMask, PositionsAloneRotate) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  const Batch bt = packed({{30, 1, 60, 9}, {77, 23}}, 53);
  std::vector<Step<double>> runs;
  for (AttentionKind a : {AttentionKind::Tiled, AttentionKind::Exact}) {
    Model md(doc_config(128), 8);
    LlamaModel<double> m(md.cfg, *md.be, ModelOptions{Recompute::None, a, 0});
    const Step<double> plain = train_step(md.f, m, bt, false);
    md.f.zero_grads();
    m.forward(md.f, bt.tokens.data(), bt.B, bt.T, TokenLayout{bt.lay.pos.data(), nullptr});
    Step<double> r;
    r.loss = m.head_backward(md.f, bt.targets.data(), 1.0);
    m.backward(md.f);
    for (int u = 0; u < md.f.num_units(); ++u)
      r.grads.emplace_back(md.f.grad_shard(u), md.f.grad_shard(u) + md.f.plan().units[u].shard_size);
    EXPECT_GT(std::abs(r.loss - plain.loss), 1e-6 * plain.loss) << attention_name(a);
    runs.push_back(r);
  }
  EXPECT_LE(std::abs(runs[0].loss - runs[1].loss), 1e-12 * runs[1].loss);
  EXPECT_LE(grad_diff(runs[0], runs[1]), 1e-12);
}

// The range calls (pipeline stages) take the layout per micro-batch and keep it in its Context:
// two micro-batches with different documents, over ranges [0, 1) and [1, 2), both forwards before
// either backward (1F1B's order), give bitwise the loss and gradients of the whole model running
// them one at a time. And a position outside [0, T) is refused before anything runs.
TEST(DocumentMask, RangesKeepEachMicroBatchsLayout) {
  if (testing::comm().world_size() != 1) GTEST_SKIP() << "single-rank check";
  const Batch b1 = packed({{30, 1, 60, 9}, {77, 23}}, 43), b2 = packed({{100}, {12, 12, 12, 64}}, 47);
  Model md(doc_config(128), 6);
  LlamaModel<double> m(md.cfg, *md.be, ModelOptions{Recompute::None, AttentionKind::Tiled, 0, AttentionMask::Document});
  md.f.zero_grads();
  double want_loss = 0;
  for (const Batch* b : {&b1, &b2}) {
    m.forward(md.f, b->tokens.data(), b->B, b->T, b->layout());
    want_loss += m.head_backward(md.f, b->targets.data(), 1.0);
    m.backward(md.f);
  }
  std::vector<std::vector<double>> want;
  for (int u = 0; u < md.f.num_units(); ++u)
    want.emplace_back(md.f.grad_shard(u), md.f.grad_shard(u) + md.f.plan().units[u].shard_size);

  using Ctx = LlamaModel<double>::Context;
  Ctx c0[2] = {Ctx(BlockRange{0, 1, {}}), Ctx(BlockRange{0, 1, {}})};
  Ctx c1[2] = {Ctx(BlockRange{1, 2, {}}), Ctx(BlockRange{1, 2, {}})};
  const Batch* bs[2] = {&b1, &b2};
  md.f.zero_grads();
  for (int k = 0; k < 2; ++k) {
    m.forward(md.f, c0[k], bs[k]->tokens.data(), nullptr, bs[k]->B, bs[k]->T, bs[k]->layout());
    m.forward(md.f, c1[k], nullptr, c0[k].output(), bs[k]->B, bs[k]->T, bs[k]->layout());
  }
  double got_loss = 0;
  for (int k = 0; k < 2; ++k) {
    got_loss += m.head_backward(md.f, c1[k], bs[k]->targets.data(), 1.0);
    m.backward(md.f, c1[k], nullptr);
    m.backward(md.f, c0[k], c1[k].input_grad());
  }
  EXPECT_EQ(got_loss, want_loss);
  for (int u = 0; u < md.f.num_units(); ++u)
    EXPECT_TRUE(std::equal(want[static_cast<size_t>(u)].begin(), want[static_cast<size_t>(u)].end(), md.f.grad_shard(u)))
        << "unit " << u;

  std::vector<int32_t> bad = b1.lay.pos;
  bad[5] = b1.T;
  EXPECT_THROW(m.forward(md.f, b1.tokens.data(), b1.B, b1.T, TokenLayout{bad.data(), b1.lay.doc.data()}),
               std::invalid_argument);
}

// With mask Document the model allocates what activation_bytes counts (the layout's ids included).
TEST(DocumentMask, ActivationBytesMatchAllocations) {
  const ModelConfig mc = doc_config(64);
  for (Recompute r : {Recompute::None, Recompute::Full})
    for (AttentionKind a : {AttentionKind::Tiled, AttentionKind::Exact}) {
      const ModelOptions mo{r, a, 0, AttentionMask::Document};
      testing::CountingBackend<float> be;
      {
        LlamaModel<float> m(mc, be, mo);
        m.reserve(3, 37);
        EXPECT_EQ(static_cast<int64_t>(be.live_bytes()), activation_bytes(mc, mo, 3, 37, 4, 4).total())
            << recompute_name(r) << ", " << attention_name(a);
      }
      EXPECT_EQ(be.live_bytes(), 0u);
    }
  const ModelOptions causal{}, doc{Recompute::None, AttentionKind::Tiled, 0, AttentionMask::Document};
  EXPECT_EQ(activation_bytes(mc, doc, 3, 37, 4, 4).total() - activation_bytes(mc, causal, 3, 37, 4, 4).total(),
            3 * 4 * 3 * 37) << "positions, documents and row indices: three int32 per token";
}

}  // namespace
}  // namespace shardtrain
