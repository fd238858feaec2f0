// The parallel layer's context parallelism: the head-tail split of a sequence over a CP group (pure
// functions: rows, positions, the refusal text, the attention tile pairs each rank computes), and
// CpAttention<C>, the ContextParallelOps the model calls (context_parallel_ops.h), on the CP group's
// communicator, with K/V moved around a ring or all-gathered, and what it cost (CpCommStats, for
// CommStats[CommDim::Cp]). The parallel layer sits between io and train: train includes it; the
// shard, model and io layers never do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/shard/context_parallel_ops.h"
#include "shardtrain/parallel/geometry.h"
#include "shardtrain/runtime/runtime.h"

namespace shardtrain {

// ---- The split ----------------------------------------------------------------------------------
// A sequence of T tokens is cut into 2·cp chunks of T/(2·cp) tokens; CP rank r holds chunk r and
// chunk 2·cp−1−r, in that order (the "head-tail" or load-balanced split of Megatron-LM's context
// parallelism and Llama 3, section 3.3.2): under the causal mask every rank then has the same
// attention work (cp_tile_pairs). Contiguous (rank r holds rows [r·T/cp, (r+1)·T/cp)) is there only
// to show the imbalance it gives.

// "" when a sequence of T tokens splits over cp ranks; otherwise the refusal, naming T, cp and the
// rule (T >= 1, cp >= 1, T divisible by 2·cp). Pure: the same text on every rank.
std::string cp_split_problem(int64_t T, int cp);

// The two chunks of rank `rank`: `len` = T/(2·cp) tokens from row `head` = rank·len and from row
// `tail` = (2·cp−1−rank)·len. Throws std::invalid_argument (cp_split_problem's text, or a rank
// outside [0, cp)).
struct CpChunks {
  int len = 0, head = 0, tail = 0;
};
CpChunks cp_chunks(int T, int cp, int rank);

enum class CpSplit { HeadTail, Contiguous };
// The rows of one sequence that rank `rank` holds, in the order it holds them: Tl = T/cp row
// indices in [0, T) (head-tail: the head chunk's rows, then the tail chunk's). Row i of the rank's
// [Tl, ...] buffers is row cp_rows(...)[i] of the whole sequence. Contiguous needs T divisible by cp
// only. Throws as cp_chunks.
std::vector<int32_t> cp_rows(int T, int cp, int rank, CpSplit split = CpSplit::HeadTail);
// The positions array ContextParallelOps takes, for B sequences whose positions are their row
// indices (no restart per document): [B, Tl] int32, host memory, cp_rows repeated B times.
std::vector<int32_t> cp_positions(int B, int T, int cp, int rank, CpSplit split = CpSplit::HeadTail);

// ---- Attention work per rank (counted, by the kernels' tile rule) --------------------------------
// Tile pairs of one (sequence, head) of Backend::attention_block_forward (and as many again in its
// backward): query tiles of flash::kBr rows of a query block against key tiles of flash::kBc rows
// of a key block, each pair classified from the tiles' position and document ranges
// (flash::tile_range, flash::tile_pair_masked): `skipped` pairs no query can see, the rest computed.
// The kernels count B·NH times this per call (take_block_attention_stats).
struct CpTilePairs {
  int64_t pairs = 0, skipped = 0;
  int64_t computed() const { return pairs - skipped; }
};
// qpos [Tq], kpos [Tk], qdoc / kdoc (document ids, or both nullptr): host memory.
CpTilePairs block_tile_pairs(const int32_t* qpos, const int32_t* qdoc, int Tq, const int32_t* kpos,
                             const int32_t* kdoc, int Tk);
// Per CP rank (index = rank), the tile pairs of the ring's forward for one (sequence, head) of a
// causal sequence of T tokens: the rank's query rows against each rank's key rows (cp blocks).
// The balance measure of issue 41: head-tail gives every rank the same computed() count (exactly,
// when T/(2·cp) is a multiple of the tile size), contiguous gives rank cp−1 about 2·cp−1 times the
// work of rank 0. Throws as cp_rows.
std::vector<CpTilePairs> cp_tile_pairs(int T, int cp, CpSplit split);

// ---- CpAttention ----------------------------------------------------------------------------------

// How K/V reach the queries (issue 41, --cp-comm):
//   Ring       K, V (with their positions and document ids) travel around the CP group, one ring
//              shift per step (Comm::start_ring_shift, rank r sends to r+1): step s starts the shift
//              of the block in hand before that block's attention and waits for it after, so the
//              transfer overlaps the compute (on host backends the kernels poll the progress
//              registry, progress.h, which advances MPI transfers); partial results are merged in S
//              (attention_merge). Backward: the same ring, with each visiting block's dK/dV partial
//              sums travelling with it (one step behind, so that their shift too overlaps a block's
//              compute) and arriving home after cp shifts.
//   AllGather  per sequence, the group all-gathers its positions and document ids, then, per
//              chunk of hk KV heads (gather_kv_heads: as many as the bound gather_bytes allows),
//              that chunk's K, V into [cp·Tl, hk·HD] and attends to all of them with the query
//              heads that read the chunk (GQA) in one block call; the backward reduce-scatters
//              (sums) the chunk's dK, dV of the whole sequence back to their owners. Chunks of
//              fewer than NKV heads pack their columns (Backend::copy_2d); the results do not
//              depend on the chunking; the bytes sent neither (ceil(NKV/hk) times as many
//              collectives of K, V, dK, dV, each that much smaller). The backward gathers K, V again rather than keeping the
//              forward's: kept, every layer's gathered K/V (cp times the rank's K/V) would live from
//              its forward to its backward, the activation memory context parallelism exists to
//              divide by cp; gathering again costs one more all-gather of K/V per layer, the same
//              bytes as the forward's ((cp − 1)·2·Tl·NKV·HD·sizeof(C) per sequence and rank).
// CpComm (Ring, AllGather) and cp_comm_name: geometry.h (the option --cp-comm).

// What a rank's context-parallel attention cost, accumulated since construction. Transfers: ring
// shifts (each of k, v, positions, document ids and, in the backward, dK and dV is one) or
// collectives (all-gathers, reduce-scatters). Bytes are those this rank sends: a ring shift of n
// bytes sends n, an all-gather or reduce-scatter of n bytes per rank (cp − 1)·n (docs/scaling.md's
// measure). Times are wall seconds on the host: issued = from a transfer's start until it was seen
// complete (by a progress poll or its wait), exposed = time the compute thread waited in
// Request::wait (stream-ordered Comms: the host does not wait; both near 0). With cp = 1 nothing is
// sent (the ring shifts to itself are not counted).
struct CpCommStats {
  int64_t transfers = 0;
  int64_t done_in_compute = 0;  // transfers a progress poll saw complete before their wait
  int64_t polls = 0;            // progress polls (host backends) while transfers were in flight
  double bytes = 0, issued_s = 0, exposed_s = 0;
  int64_t tile_pairs = 0, skipped = 0;  // block attention tile pairs (b, h, query tile, key tile)
};

// ContextParallelOps on a communicator of the CP group (MPI on the CPU; NCCL or the host-staged
// device Comm on GPUs) and the model's backend (whose memory every buffer is in). `comm` and `be`
// must outlive this. Scratch buffers are kept between calls (reallocated when sizes grow), in
// elements of C unless said (G = NH/NKV, Tl rows per sequence and rank, hk = gather_kv_heads):
//   Ring       2 x (K, V, ids) of this rank's size (2·B·Tl·NKV·HD each of K, V); in the backward
//              4 x (dK, dV) of it; in bf16 also y's fp32 accumulator (B·Tl·NH·HD floats).
//   AllGather  the gathered buffers: K, V of one chunk of one sequence, [cp·Tl, hk·HD] each, and in
//              the backward dK, dV of the same size; positions and ids [cp·Tl] int32. When hk < NKV
//              also the packed chunk of this rank's rows: k, v [Tl, hk·HD] and q, y [Tl, G·hk·HD]
//              (forward), plus dk, dv [Tl, hk·HD] and dq [Tl, G·hk·HD] (backward; dy reuses y's).
//              hk is chosen so that all of these together fit in gather_bytes: every KV head in one
//              chunk (nothing packed) when 4·cp·Tl·NKV·HD·sizeof(C) does, else the most heads whose
//              (4·cp + 4 + 3·G)·Tl·hk·HD·sizeof(C) does, or hk = 1 when even one head does not (the
//              bound is then exceeded, by the size of one head's buffers). These are what a memory
//              plan must count for the all-gather (cp_gather_scratch_bytes).
// The default, 256 MiB: for llama-8b (NH = 32, NKV = 8, HD = 128) in bf16 at T = cp·Tl = 32,768 the
// four gathered buffers of all 8 heads take 4·32768·8·128·2 B = 256 MiB: one chunk, nothing packed;
// at T = 131,072 on cp = 8 one head chunked takes (32 + 4 + 12)·16384·128·2 B = 192 MiB, so hk = 1.
inline constexpr size_t kCpGatherBytes = size_t{256} << 20;  // default bound on AllGather's gathered buffers

// AllGather's chunk for cp ranks of Tl rows per sequence, NH query and NKV KV heads of HD (this
// rank's: NH / tp and NKV / tp under TP), elements of elem_bytes: KV heads per chunk, chosen as the
// list above says so that the scratch fits in gather_bytes (CpAttention::gather_kv_heads); and that
// scratch CpAttention then holds after a forward and backward, in bytes (gathered K, V, dK, dV, and
// when hk < NKV the packed k, v, dk, dv and q, y (dy), dq; positions, ids and the S-typed dsum not
// included): at most gather_bytes unless hk = 1. Pure: for a memory plan. Throws
// std::invalid_argument for sizes < 1 or NH not a multiple of NKV.
int cp_gather_kv_heads(int cp, int Tl, int NH, int NKV, int HD, size_t elem_bytes, size_t gather_bytes = kCpGatherBytes);
int64_t cp_gather_scratch_bytes(int cp, int Tl, int NH, int NKV, int HD, size_t elem_bytes,
                                size_t gather_bytes = kCpGatherBytes);
template <typename C> class CpAttention final : public ContextParallelOps<C> {
 public:
  using S = math::Acc<C>;
  // host: the same group in host memory for sum_host (Mesh::cp_host); nullptr: `comm` itself, which
  // must then not be stream-ordered (std::logic_error at sum_host otherwise).
  CpAttention(Comm& comm, Backend<C>& be, CpComm method, size_t gather_bytes = kCpGatherBytes, Comm* host = nullptr);
  ~CpAttention() override;
  int size() const override { return comm_.world_size(); }
  int rank() const override { return comm_.rank(); }
  CpComm method() const { return method_; }
  // AllGather: KV heads per chunk for Tl rows per rank, NH query and NKV KV heads of HD
  // (cp_gather_kv_heads with this group's size, sizeof(C) and the bound).
  int gather_kv_heads(int Tl, int NH, int NKV, int HD) const;
  void forward(C* y, S* lse, const C* q, const C* k, const C* v, const int32_t* pos, const int32_t* doc, int B,
               int Tl, int NH, int NKV, int HD, S scale) override;
  void backward(C* dq, C* dk, C* dv, const C* dy, const C* q, const C* k, const C* v, const C* y, const S* lse,
                const int32_t* pos, const int32_t* doc, int B, int Tl, int NH, int NKV, int HD, S scale) override;
  void sum_host(double* buf, size_t n) override;
  // The totals so far; takes the backend's block-attention counters into tile_pairs / skipped
  // (take_block_attention_stats: on a device, a wait for the queued work; call it once per step).
  const CpCommStats& stats();

  struct Args;  // one call's pointers and sizes (context_parallel.cpp)

 private:
  struct Work;  // scratch buffers
  void ring_forward(const Args& a);
  void ring_backward(const Args& a);
  void gather_forward(const Args& a);
  void gather_backward(const Args& a);
  Comm& comm_;
  Comm* host_ = nullptr;
  Backend<C>& be_;
  CpComm method_;
  size_t gather_bytes_;
  CpCommStats stats_;
  std::unique_ptr<Work> work_;
};

}  // namespace shardtrain
