// The memory plan under context parallelism (memory_plan.h, parallelize.h cp_memory): llama-8b and
// llama-70b at T = 32,768 and 131,072 with --cp 1, 2, 4, 8 on 80 GB and 141 GB GPUs, as
// `--mode plan --cp N` plans them. Checked against arithmetic written here: the activations a rank
// keeps fall exactly as 1 / cp (tiled attention: every buffer is rows x width), the K/V buffers of
// each method follow their formula from the model's shapes, and the refusals are training's
// (resolve_geometry). The CP scratch's formula is CpAttention's buffers (parallelize.h cp_memory).
#include <gtest/gtest.h>

#include <string>

#include "shardtrain/parallel/geometry.h"
#include "shardtrain/train/memory_plan.h"
#include "shardtrain/parallel/parallelize.h"

namespace shardtrain {
namespace {

int64_t line(const MemoryPlan& p, const std::string& name) {
  for (const MemoryLine& l : p.lines)
    if (l.name == name) return l.bytes;
  return -1;
}

MemoryPlanInput input(const std::string& model, int T, int cp, CpComm how, int W = 8, int tp = 1) {
  MemoryPlanInput in;
  in.model = preset(model);
  in.train.seq_len = T;
  in.train.micro_batch = 1;
  in.train.recompute = Recompute::Full;
  in.train.cp_comm = how;
  in.world_size = W;
  in.precision = Precision::BF16;
  in.cuda = true;
  in.runtime_bytes = kGpuRuntimeEstimate;
  in.mesh = MeshDims{1, W / (cp * tp), cp, tp};
  return in;
}

TEST(CpPlan, ActivationsFallAsOneOverCpAndKvBuffersFollowTheirFormula) {
  for (const char* model : {"llama-8b", "llama-70b"}) {
    const ModelConfig mc = preset(model);
    const int64_t nkv = mc.num_key_value_heads, hd = mc.head_dim();
    ASSERT_EQ(nkv, 8);
    ASSERT_EQ(hd, 128);
    for (int T : {32768, 131072})
      for (CpComm how : {CpComm::Ring, CpComm::AllGather}) {
        const MemoryPlan one = plan_memory(input(model, T, 1, how));
        const int64_t kept1 = line(one, "activations kept for backward");
        const int64_t scratch1 = line(one, "block scratch and activation gradients");
        ASSERT_GT(kept1, 0);
        EXPECT_EQ(line(one, "CP ring K/V buffers"), -1);  // cp 1: no K/V exchange
        EXPECT_EQ(line(one, "CP all-gathered K/V buffers"), -1);
        int64_t total_before = plan_memory(input(model, T, 1, how)).total();
        for (int cp : {2, 4, 8}) {
          SCOPED_TRACE(std::string(model) + " T " + std::to_string(T) + " cp " + std::to_string(cp) + " " +
                       cp_comm_name(how));
          const MemoryPlan p = plan_memory(input(model, T, cp, how));
          // Every buffer of a block is (rows held) x (a width): exactly 1 / cp of the cp = 1 plan.
          EXPECT_EQ(line(p, "activations kept for backward") * cp, kept1);
          EXPECT_EQ(line(p, "block scratch and activation gradients") * cp, scratch1);
          // The CP attention's scratch, bf16 (2 bytes), 8 KV heads of 128, NH query heads of 128:
          // ring: 12 blocks of (T / cp) rows of K/V, the merge's y and its fp32 accumulator (bf16),
          // lse + dsum (fp32), 4 int32 id buffers; allgather: gathered K, V, dK, dV of one sequence a
          // chunk of KV heads at a time (cp_gather_scratch_bytes; unchunked at 32K: 4 x T rows of
          // all 8 KV heads), dsum, 2 id buffers of T.
          const int64_t r = T / cp, nh = mc.num_attention_heads;
          if (how == CpComm::Ring) {
            EXPECT_EQ(line(p, "CP ring K/V buffers"),
                      2 * (12 * r * 8 * 128 + r * nh * 128) + 4 * r * nh * 128 + 4 * 2 * r * nh + 4 * 4 * r);
          } else {
            const int64_t gathered = cp_gather_scratch_bytes(cp, static_cast<int>(r), static_cast<int>(nh), 8, 128, 2);
            if (T == 32768) {
              EXPECT_EQ(gathered, 2 * (int64_t{4} * T * 8 * 128));
            }
            EXPECT_EQ(line(p, "CP all-gathered K/V buffers"), gathered + 4 * r * nh + 4 * 2 * int64_t{T});
          }
          // More CP ranks: less memory per rank (parameters are sharded over dp_shard x cp = 8 at
          // every cp, so only activations and K/V change).
          const int64_t total = p.total();
          EXPECT_LT(total, total_before);
          total_before = total;
        }
      }
  }
}

// What fits on 80 GB and 141 GB: the largest micro-batch never shrinks as cp grows, and llama-8b
// at 131,072 tokens without CP needs more than with CP 8 (the point of CP).
TEST(CpPlan, FitsGrowWithCp) {
  for (const char* model : {"llama-8b", "llama-70b"})
    for (int64_t gb : {80, 141})
      for (int T : {32768, 131072}) {
        int prev = -1;
        for (int cp : {1, 2, 4, 8}) {
          const int mb = largest_fitting_micro_batch(input(model, T, cp, CpComm::Ring), gb * 1000000000);
          EXPECT_GE(mb, prev) << model << " " << gb << " GB T " << T << " cp " << cp;
          prev = mb;
        }
      }
  MemoryPlanInput a = input("llama-8b", 131072, 1, CpComm::Ring), b = input("llama-8b", 131072, 8, CpComm::Ring);
  EXPECT_GT(plan_memory(a).total(), plan_memory(b).total());
}

// --mode plan refuses what training refuses (one geometry): T not divisible by 2 x cp, and the
// max_position_embeddings (131,072) check on T itself, not T / cp.
TEST(CpPlan, RefusalsAreTrainings) {
  const ModelConfig mc = preset("llama-8b");
  EXPECT_TRUE(resolve_geometry({8, 1, 131072}, MeshDims{1, 1, 8, 1}, mc).ok());
  EXPECT_EQ(resolve_geometry({8, 1, 32776}, MeshDims{1, 1, 8, 1}, mc).refusal,
            "option '--seq-len' (32776) is not divisible by 2 x '--cp' (2 x 8 = 16): the head-tail split of context "
            "parallelism cuts every sequence into 2 x 8 equal chunks");
  EXPECT_EQ(resolve_geometry({8, 1, 262144}, MeshDims{1, 1, 8, 1}, mc).refusal,
            "option '--seq-len' (262144) exceeds the model's max_position_embeddings (131072)");
}

// The scratch under TP (a TP rank's heads) and B > 1 (the ring holds every sequence's rows, the
// all-gather one sequence at a time).
TEST(CpPlan, KvBuffersUnderTpAndMicroBatches) {
  const ModelConfig mc = preset("llama-8b");  // 32 heads, 8 KV heads, HD 128
  const CpMemory ring = cp_memory(mc, MeshDims{1, 1, 2, 4}, CpComm::Ring, 2, 32768, 2);
  EXPECT_EQ(ring.rows, 16384);
  const int64_t r = 2 * 16384;  // rows held: 2 sequences x 16384
  // 2 KV, 8 Q heads per TP rank; bf16: the merge's y also accumulates in fp32
  EXPECT_EQ(ring.kv_bytes, 2 * (12 * r * 2 * 128 + r * 8 * 128) + 4 * r * 8 * 128 + 4 * 2 * r * 8 + 4 * 4 * r);
  const CpMemory ag = cp_memory(mc, MeshDims{1, 1, 2, 1}, CpComm::AllGather, 3, 32768, 4);
  // fp32, cp 2, 16384 rows a rank: all 8 KV heads' gathered K, V, dK, dV over T rows take
  // 4 x 32768 x 8 x 128 x 4 B = 512 MiB > 256 MiB, so chunked; one head's chunk is its gathered
  // 4 x 32768 x 128 x 4 B plus its packed k, v, dk, dv (1 KV head) and q, y, dq (4 query heads) of
  // the rank's rows, (8 + 4 + 12) x 16384 x 128 x 4 B = 192 MiB: hk = 1, within the bound.
  const int64_t gathered = int64_t{4} * 32768 * 1 * 128 * 4, packed = (int64_t{4} * 16384 * 128 + 3 * 16384 * 4 * 128) * 4;
  EXPECT_EQ(gathered + packed, int64_t{192} << 20);
  EXPECT_EQ(ag.kv_bytes, gathered + packed + 4 * (3 * 16384) * 32 + 4 * 2 * 32768);
  // Open MPI's libnbc reduce-scatter on the host: at cp 2 the first rank receives once (one
  // temporary of the whole chunk of dK, one of dV); from cp 3 on, twice (two each).
  EXPECT_EQ(ag.mpi_reduce_scatter_bytes, int64_t{1} * 2 * 32768 * 1 * 128 * 4);
  EXPECT_EQ(cp_memory(mc, MeshDims{1, 1, 4, 1}, CpComm::AllGather, 1, 32768, 2).mpi_reduce_scatter_bytes,
            int64_t{2} * 2 * 32768 * 8 * 128 * 2);  // bf16 cp 4: all 8 KV heads in one chunk (their 256 MiB fit)
  EXPECT_EQ(ring.mpi_reduce_scatter_bytes, 0);
  const CpMemory none = cp_memory(mc, MeshDims{1, 2, 1, 1}, CpComm::Ring, 1, 32768, 2);
  EXPECT_EQ(none.kv_bytes, 0);
  EXPECT_EQ(none.rows, 32768);
  EXPECT_EQ(none.rows_words, "1 x 32768 tokens");
}

}  // namespace
}  // namespace shardtrain
