// resolve_geometry (geometry.h): the batch layout and every refusal, against arithmetic done here
// independently over a grid of meshes and options.
#include <gtest/gtest.h>

#include "shardtrain/parallel/geometry.h"
#include "shardtrain/model/model.h"

namespace shardtrain {
namespace {

ModelConfig model() {  // 4 heads, 2 KV heads, intermediate 64 (checked below), 256 positions
  ModelConfig c = preset("tiny");
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 64;
  c.max_position_embeddings = 256;
  return c;
}

TEST(Geometry, LayoutOverAGridOfMeshes) {
  const ModelConfig mc = model();
  int checked = 0;
  for (int R : {1, 2, 3})
    for (int G : {1, 2, 4})
      for (int tp : {1, 2}) {
        const MeshDims d{R, G, 1, tp};
        const int dp = R * G;
        for (int gb : {dp, 2 * dp, 6 * dp, 24})
          for (int mb : {0, 1, 2, 3})
            for (int T : {1, 7, 16}) {
              const GeometryResult r = resolve_geometry({gb, mb, T}, d, mc);
              const bool fits = gb % dp == 0 && (mb == 0 || (gb / dp) % mb == 0) &&
                                int64_t{mb > 0 ? mb : gb / dp} * T % tp == 0;
              ASSERT_EQ(r.ok(), fits) << "R" << R << " G" << G << " tp" << tp << " gb" << gb << " mb" << mb
                                      << " T" << T << ": " << r.refusal;
              if (!fits) continue;
              const BatchGeometry& g = r.geometry;
              EXPECT_EQ(g.dp, dp);
              EXPECT_EQ(g.per_rank * dp, gb);
              EXPECT_EQ(g.micro_batch * g.accum, g.per_rank);
              EXPECT_EQ(g.micro_batch, mb > 0 ? mb : gb / dp);
              EXPECT_EQ(g.rank_tokens() * dp, int64_t{gb} * T);  // every target token counted once
              EXPECT_EQ(g.tp_tokens() * tp, g.micro_tokens());
              ++checked;
            }
      }
  EXPECT_GT(checked, 300);
}

// With context parallelism (cp in 1, 2, 4; with tp 1, 2; with R, D): the head-tail rule, the rows a
// CP and a TP rank hold, and the gradient scale: (1 / rank_tokens) / (dp x cp), the weight each
// token's gradient gets after the reduce-scatter over dp_shard x cp and the replica all-reduce,
// must be 1 / (global_batch x T), the non-CP run's (exact in double: every factor is a power of 2
// or a small integer).
TEST(Geometry, ContextParallelGrid) {
  const ModelConfig mc = model();
  int checked = 0, refused_cp = 0;
  for (int R : {1, 2})
    for (int D : {1, 3})
      for (int C : {1, 2, 4})
        for (int tp : {1, 2}) {
          const MeshDims d{R, D, C, tp};
          const int dp = R * D;
          for (int gb : {dp, 4 * dp})
            for (int mb : {0, 1})
              for (int T : {4, 6, 7, 8, 12, 16, 24, 48}) {
                const GeometryResult r = resolve_geometry({gb, mb, T}, d, mc);
                const int micro = mb > 0 ? mb : gb / dp;
                const bool split_ok = C == 1 || T % (2 * C) == 0;  // the head-tail rule, with cp only
                const bool fits = split_ok && (micro * T / C) % tp == 0;  // rows of a CP rank over TP
                ASSERT_EQ(r.ok(), fits) << "R" << R << " D" << D << " C" << C << " tp" << tp << " gb" << gb << " mb" << mb
                                        << " T" << T << ": " << r.refusal;
                if (!split_ok) {
                  ++refused_cp;
                  EXPECT_NE(r.refusal.find("is not divisible by 2 x '--cp'"), std::string::npos) << r.refusal;
                }
                if (!fits) continue;
                const BatchGeometry& g = r.geometry;
                EXPECT_EQ(g.dp, dp);  // cp is not data parallelism: CP ranks read the same rows
                EXPECT_EQ(g.cp_tokens(), int64_t{micro} * T / C);
                EXPECT_EQ(g.tp_tokens(), int64_t{micro} * T / C / tp);
                EXPECT_EQ(g.rank_tokens(), int64_t{gb / dp} * T / C);  // the tokens a rank holds per step
                // Every target token once: the ranks of distinct (batch index, CP part) together.
                EXPECT_EQ(g.rank_tokens() * dp * C, int64_t{gb} * T);
                const double weight = (1.0 / static_cast<double>(g.rank_tokens())) / (dp * C);
                EXPECT_EQ(weight, 1.0 / (static_cast<double>(gb) * T));
                ++checked;
              }
        }
  EXPECT_GT(checked, 150);
  EXPECT_GT(refused_cp, 50);
}

TEST(Geometry, RefusalsNameTheOptionAndTheNumbers) {
  const ModelConfig mc = model();
  // Context parallelism: 2 x cp must divide T; with TP, the rows a CP rank holds split over TP;
  // max_position_embeddings applies to T itself, not T / cp.
  EXPECT_EQ(resolve_geometry({4, 0, 12}, {1, 1, 4, 1}, mc).refusal,
            "option '--seq-len' (12) is not divisible by 2 x '--cp' (2 x 4 = 8): the head-tail split of context "
            "parallelism cuts every sequence into 2 x 4 equal chunks");
  EXPECT_TRUE(resolve_geometry({4, 0, 16}, {1, 1, 4, 1}, mc).ok());
  ModelConfig m3 = mc;  // TP 3: 6 heads, 3 KV heads, intermediate 66
  m3.hidden_size = 48;
  m3.num_attention_heads = 6;
  m3.num_key_value_heads = 3;
  m3.intermediate_size = 66;
  ASSERT_EQ(check_tensor_parallel(m3, 3), "");
  EXPECT_EQ(resolve_geometry({1, 1, 4}, {1, 1, 2, 3}, m3).refusal,
            "option '--tp' (3) does not divide the tokens of a micro-batch (1 x 4 / cp 2 = 2 held by a CP rank): "
            "sequence parallelism splits them evenly over the TP group");
  EXPECT_TRUE(resolve_geometry({1, 1, 12}, {1, 1, 2, 3}, m3).ok());  // 6 rows per CP rank, 2 per TP rank
  EXPECT_EQ(resolve_geometry({4, 0, 512}, {1, 1, 4, 1}, mc).refusal,
            "option '--seq-len' (512) exceeds the model's max_position_embeddings (256)");
  EXPECT_TRUE(resolve_geometry({4, 0, 256}, {1, 1, 4, 1}, mc).ok());  // T = 256 = the limit; 64 per rank
  EXPECT_EQ(resolve_geometry({5, 0, 16}, {1, 2, 2, 1}, mc).refusal,
            "option '--global-batch' (5) is not divisible by the data-parallel size (world 4 / cp 2 = 2)");
  EXPECT_EQ(resolve_geometry({5, 0, 16}, {1, 2, 1, 1}, mc).refusal,
            "option '--global-batch' (5) is not divisible by the world size (2)");
  EXPECT_TRUE(resolve_geometry({6, 0, 16}, {1, 2, 1, 2}, mc).ok());  // 6 / dp 2: fits
  EXPECT_EQ(resolve_geometry({5, 0, 16}, {1, 2, 1, 2}, mc).refusal,
            "option '--global-batch' (5) is not divisible by the data-parallel size (world 4 / tp 2 = 2)");
  EXPECT_EQ(resolve_geometry({12, 4, 16}, {1, 2, 1, 1}, mc).refusal,
            "option '--global-batch' (12) is not divisible by world size x '--micro-batch' (2 x 4)");
  EXPECT_EQ(resolve_geometry({12, 4, 16}, {1, 2, 1, 2}, mc).refusal,
            "option '--global-batch' (12) is not divisible by data-parallel size x '--micro-batch' (2 x 4)");
  EXPECT_EQ(resolve_geometry({4, 1, 33}, {1, 2, 1, 2}, mc).refusal,
            "option '--tp' (2) does not divide the tokens of a micro-batch (1 x 33 = 33): sequence parallelism "
            "splits them evenly over the TP group");
  EXPECT_EQ(resolve_geometry({4, 0, 16}, {1, 1, 1, 3}, mc).refusal,
            check_tensor_parallel(mc, 3));  // the model's rule, named by model.h
  EXPECT_NE(check_tensor_parallel(mc, 3), "");
  EXPECT_EQ(resolve_geometry({4, 0, 257}, {1, 2, 1, 1}, mc).refusal,
            "option '--seq-len' (257) exceeds the model's max_position_embeddings (256)");
  EXPECT_EQ(resolve_geometry({4, 0, 0}, {1, 2, 1, 1}, mc).refusal, "option '--seq-len' must be >= 1, got 0");
}

}  // namespace
}  // namespace shardtrain
