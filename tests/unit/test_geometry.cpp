// resolve_geometry (geometry.h): the batch layout and every refusal, against arithmetic done here
// independently over a grid of meshes and options.
#include <gtest/gtest.h>

#include "shardtrain/geometry.h"
#include "shardtrain/model.h"

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

TEST(Geometry, RefusalsNameTheOptionAndTheNumbers) {
  const ModelConfig mc = model();
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
