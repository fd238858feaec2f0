// shardtrain device mesh: every dimension of parallelism of a run in one value, built once from the
// world and the options, owning every communicator the run uses (torchtitan's ParallelDims, in C++).
//
// What this is not: a place that computes. The mesh only answers questions about ranks (which
// coordinate, which group, who reads which batch rows, who writes which checkpoint rows, whose
// gradient elements count in the norm) and hands out communicators. The model never sees it; the
// shard layer takes its communicators from it (ShardedState's Mesh constructor), the trainer asks it the
// questions above.
//
// Dimensions, outermost first: pp (P, pipeline stages, issue 42: each stage holds a contiguous
// range of the model's blocks, pipeline_schedule.h) x dp_replicate (R, replica groups of hybrid
// sharding) x dp_shard (D) x cp (C, context parallelism, --cp: the ranks of a CP group hold
// different parts of the same sequences) x tp (N, tensor parallelism, --tp: the TP group of
// consecutive ranks, model.h). The global rank of coordinate (pp, rep, shard, cp, tp) is
// (((pp * R + rep) * D + shard) * C + cp) * N + tp: tp varies fastest (its ranks sit together on a
// node), then cp, pp slowest (stages across nodes: only activations cross between them). With
// pp = tp = cp = 1 this is rank = rep * D + shard: a shard group is D consecutive ranks, a replica
// group the ranks of equal shard rank. Every group below lies inside one stage (equal pp); the PP
// group (pp_group) is the ranks of equal (rep, shard, cp, tp), one per stage.
//
// What each dimension does to the questions below (each stated again at its function):
//   FSDP's shard group spans dp_shard x cp (D * C ranks, MeshDims::fsdp()): the CP ranks of a group
//     hold different shards of the same parameters, as torchtitan's dp_shard_cp mesh does. Its
//     ranks: equal (rep, tp), differing in (shard, cp), in rank order: index shard * C + cp.
//   Batch rows: ranks that differ only in cp or tp read the same rows (dp_index excludes both).
//   Checkpoint rows: replica group 0 writes them, one row per rank of the (larger) shard group.
//   Gradient norm: every rank of replica group 0 counts its shards (CP ranks hold different ones);
//     a TP group's replicated parameters count once (TP rank 0).
//   Expert parallelism (ep, issue 56; docs/moe.md) adds no ranks: an EP group is ep ranks of one
//     FSDP shard group that hold different tokens, those of consecutive shard index
//     (shard_index / ep equal: cp varies fastest, then dp_shard, as torchtitan carves ep out of
//     dp_shard x cp). Rank i of the group computes experts [i E/ep, (i+1) E/ep) of every MoE block
//     for the tokens of the whole group (all-to-all).
//   Loss: each CP rank holds different tokens, so the loss sums over CP ranks; a TP group's ranks
//     compute the loss of the same tokens, so it counts once (TP rank 0); only the last pipeline
//     stage computes it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/runtime/runtime.h"

namespace shardtrain {

// The sizes of the mesh's dimensions; each >= 1, their product the world size.
struct MeshDims {
  int dp_replicate = 1;  // R: replica groups (hybrid sharding); 1 = plain FSDP
  int dp_shard = 1;      // G: ranks a unit is sharded over
  int cp = 1;            // C: context parallelism, ranks of a CP group (--cp)
  int tp = 1;            // N: tensor parallelism, ranks of a TP group (--tp)
  int pp = 1;            // P: pipeline stages, the outermost dimension (last here so that the
                         //    four-number initialisers {R, D, C, N} keep their meaning)
  int ep = 1;            // expert parallelism (--ep): ranks of an EP group, a part of the FSDP shard
                         //    group (adds no ranks: not a factor of world()); divides fsdp()
  int world() const { return pp * dp_replicate * dp_shard * cp * tp; }
  int dp() const { return dp_replicate * dp_shard; }  // data-parallel degree: ranks reading different batches
  int fsdp() const { return dp_shard * cp; }          // ranks of an FSDP shard group: dp_shard x cp
};

// A rank's coordinate in the mesh: each index in [0, size of its dimension).
struct MeshCoord {
  int dp_replicate = 0, dp_shard = 0, cp = 0, tp = 0, pp = 0;
  bool operator==(const MeshCoord&) const = default;
};

// The mesh as pure arithmetic on ranks: no communicator, usable anywhere (planning, tests).
// Every function is a pure function of (dims, rank); ranks are global ranks in [0, dims.world()).
class MeshLayout {
 public:
  // Throws std::invalid_argument when a size is < 1.
  explicit MeshLayout(MeshDims d);
  const MeshDims& dims() const { return d_; }
  MeshCoord coord(int rank) const;
  int rank_of(const MeshCoord& c) const;
  // Data parallelism: the index of the batch rows `rank` reads, in [0, dims().dp()): replica-major
  // (rep * G + shard). Ranks that differ only in cp / tp read the same rows.
  int dp_index(int rank) const;
  // The global ranks of `rank`'s FSDP shard group (its dp_shard and cp dimensions: the ranks of
  // equal dp_replicate and tp, dims().fsdp() of them) and replica group (its dp_replicate
  // dimension), in increasing order (= their rank order in the group's Comm).
  std::vector<int> shard_group(int rank) const;
  std::vector<int> replica_group(int rank) const;
  // `rank`'s index in its shard group (its row of the shard plan): dp_shard * cp_size + cp, in
  // [0, dims().fsdp()); = the position of `rank` in shard_group(rank).
  int shard_index(int rank) const;
  // The global ranks of `rank`'s TP group (its tp dimension: tp consecutive ranks), in order.
  std::vector<int> tp_group(int rank) const;
  // The global ranks of `rank`'s CP group (its cp dimension: the ranks differing from it only in
  // the cp coordinate, tp apart), in order; index i holds chunks i and 2·cp−1−i of every sequence.
  std::vector<int> cp_group(int rank) const;
  // The global ranks of `rank`'s EP group (dims().ep ranks of its shard group: the shard indices
  // [e * ep, (e + 1) * ep) with e = shard_index / ep), in order; `rank`'s index in it is
  // ep_index = shard_index % ep, which says whose experts it computes.
  std::vector<int> ep_group(int rank) const;
  int ep_index(int rank) const { return shard_index(rank) % d_.ep; }
  // The global ranks of `rank`'s expert shard group: the ranks of its shard group with its
  // ep_index (shard indices ep_index + k * ep, k < fsdp / ep), in order, which hold the same
  // experts and shard them (ShardedState's group 1); `rank`'s index in it is shard_index / ep.
  std::vector<int> expert_shard_group(int rank) const;
  // The global ranks of `rank`'s PP group (its pp dimension: one rank per stage, equal in every
  // other coordinate), in stage order: activations go from index s to s + 1, their gradients back.
  std::vector<int> pp_group(int rank) const;
  // Checkpoints hold one logical copy: the ranks of replica group 0 write it, the rank of shard
  // index r (shard_index: over dp_shard x cp) writing row r of every unit's flat buffers; the
  // others join every collective HDF5 call with empty selections. checkpoint_row: the row `rank`
  // writes, or -1 when it writes none.
  bool writes_checkpoint(int rank) const { return coord(rank).dp_replicate == 0; }
  int checkpoint_row(int rank) const { return writes_checkpoint(rank) ? shard_index(rank) : -1; }
  // The global gradient norm counts every parameter element once: replicas hold identical gradient
  // shards, so only replica group 0 adds its shards' sums of squares to the all-reduce. The CP
  // ranks of a shard group hold different shards: each counts its own.
  bool counts_in_norm(int rank) const { return coord(rank).dp_replicate == 0; }
  // ... and of a TP group, whose ranks each hold their own slices but the same copy of the
  // replicated parameters (the RMSNorm weights), those count on the group's first rank only.
  bool counts_replicated_in_norm(int rank) const { return coord(rank).tp == 0; }
  // Every rank of a TP group computes the loss of the group's tokens: it counts once, from the
  // group's first rank, in the step's loss sum. The ranks of a CP group hold different tokens of
  // the same sequences: each counts its own (the loss sums over CP ranks). Only the last pipeline
  // stage computes the loss.
  bool counts_loss(int rank) const {
    const MeshCoord c = coord(rank);
    return c.tp == 0 && c.pp == d_.pp - 1;
  }
  // Statistics of a stage's own blocks over its rows (a mixture of experts' tokens per expert):
  // every stage holds other blocks and every CP or data-parallel rank other rows, so each counts
  // its own; a TP group's ranks the same, once from the group's first rank.
  bool counts_block_stats(int rank) const { return coord(rank).tp == 0; }

 private:
  MeshDims d_;
};

// The mesh of a run: the layout, this rank's coordinate, and the communicators of each dimension.
// Host communicators (MPI, host memory) always; device communicators (NCCL, or MPI on host copies)
// once attach_device_comms gave them. With one replica group (R = 1) and one stage (pp = 1) the
// shard group is the world and there is no replica communicator; otherwise the groups are split
// from the world (MPI_Comm_split). Not copyable; destroy it before the device context its device
// communicators use.
class Mesh {
 public:
  // Collective over `world`. Checks dims against the world size (throws CollectiveError naming
  // option '--shard-group-size' on every rank when the product differs), splits the groups (each
  // with `collective_timeout` seconds, see Comm::set_collective_timeout), and finds whether some
  // shard group spans nodes although a node holds G or more ranks (shard_group_note). `topo`: this
  // rank's placement (nodes, ranks per node) for the topology line and that check.
  Mesh(Comm& world, const Topology& topo, MeshDims dims, double collective_timeout);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  const MeshLayout& layout() const { return layout_; }
  const MeshDims& dims() const { return layout_.dims(); }
  const MeshCoord& coord() const { return coord_; }
  int rank() const { return world_.rank(); }
  int world_size() const { return world_.world_size(); }
  // This rank's placement (host, node, ranks per node), as given to the constructor.
  const Topology& topology() const { return topo_; }

  // Communicators. world(): control traffic (error agreement, losses, norms, checkpoint tables).
  // shard_host(): the shard group in host memory (the world when it is the whole world).
  // replica_host(): the replica group in host memory, nullptr when R = 1. tp_host(): the TP group
  // in host memory, nullptr when tp = 1. cp_host(): the CP group (cp_group) in host memory, nullptr
  // when cp = 1. pp_host(): the PP group (pp_group), nullptr when pp = 1. shard_data() /
  // ep_host(): the EP group (ep_group) in host memory, nullptr when ep = 1.
  // replica_data() / tp_data() / cp_data() / pp_data() / ep_data(): the same groups for the backend's buffers:
  // the device communicators when attached, else the host ones.
  // References stay valid for the mesh's lifetime.
  Comm& world() const { return world_; }
  Comm& shard_host() const { return shard_host_ ? *shard_host_ : world_; }
  Comm* replica_host() const { return replica_host_.get(); }
  Comm* tp_host() const { return tp_host_.get(); }
  Comm& shard_data() const { return shard_dev_ ? *shard_dev_ : shard_host(); }
  Comm* replica_data() const { return replica_dev_ ? replica_dev_.get() : replica_host(); }
  Comm* tp_data() const { return tp_dev_ ? tp_dev_.get() : tp_host(); }
  Comm* cp_host() const { return cp_host_.get(); }
  Comm* cp_data() const { return cp_dev_ ? cp_dev_.get() : cp_host(); }
  Comm* pp_host() const { return pp_host_.get(); }
  Comm* pp_data() const { return pp_dev_ ? pp_dev_.get() : pp_host(); }
  Comm* ep_host() const { return ep_host_.get(); }
  Comm* ep_data() const { return ep_dev_ ? ep_dev_.get() : ep_host(); }
  // The expert shard group (expert_shard_group), nullptr when ep = 1.
  Comm* expert_shard_host() const { return eshard_host_.get(); }
  Comm* expert_shard_data() const { return eshard_dev_ ? eshard_dev_.get() : expert_shard_host(); }

  // Builds the device communicators of the shard group, (R > 1) the replica group, (tp > 1) the
  // TP group, (cp > 1) the CP group, (pp > 1) the PP group and (ep > 1) the EP group and the expert shard group with `make`, given each group's host
  // communicator, in that order, and owns them.
  // Collective as `make` is (NCCL: collective over the group; it agrees on failure itself). Call
  // once.
  void attach_device_comms(const std::function<std::unique_ptr<Comm>(Comm& host)>& make);

  // This rank's answers (MeshLayout's, for rank()).
  int dp_index() const { return layout_.dp_index(rank()); }
  int dp_size() const { return dims().dp(); }
  bool writes_checkpoint() const { return layout_.writes_checkpoint(rank()); }
  bool counts_in_norm() const { return layout_.counts_in_norm(rank()); }
  bool counts_replicated_in_norm() const { return layout_.counts_replicated_in_norm(rank()); }
  bool counts_loss() const { return layout_.counts_loss(rank()); }
  bool counts_block_stats() const { return layout_.counts_block_stats(rank()); }

  // The first line of a training run, e.g. "topology: 2 nodes x 2 ranks per node (world 4); hybrid
  // sharding: 2 replica groups of 2 ranks (shard group size 2)".
  std::string topology_line() const;
  // A note for the log when some shard group spans nodes although a node holds G or more ranks
  // (ranks not placed node by node); "" otherwise.
  const std::string& shard_group_note() const { return note_; }
  // The collective watchdog's timeout the mesh was made with (option '--collective-timeout'), for
  // communicators made later (the checkpoint writer's).
  double collective_timeout() const { return collective_timeout_; }

 private:
  Comm& world_;
  Topology topo_;
  MeshLayout layout_;
  MeshCoord coord_;
  std::unique_ptr<MpiComm> shard_host_, replica_host_, tp_host_, cp_host_, pp_host_, ep_host_, eshard_host_;
  std::unique_ptr<Comm> shard_dev_, replica_dev_, tp_dev_, cp_dev_, pp_dev_, ep_dev_, eshard_dev_;
  std::string note_;
  double collective_timeout_ = 0;
};

// "ranks per node" for option '--shard-group-size node': 0 when the nodes hold different numbers.
int ranks_per_node(const Topology& t);

}  // namespace shardtrain
