// The device mesh (mesh.h) under mpirun at 1..4 ranks (the context-parallel case also at 6 by
// hand): coordinates, group membership, the batch index, the checkpoint writers and the norm and
// loss counting, for plain FSDP (G = W), every hybrid sharding layout (G dividing W), every TP
// degree, every mesh with cp >= 2 and every mesh with pp >= 2 (cp 1 and 2), each checked against an independent computation: the
// communicators' own view (their ranks and an all-gather of the members' global ranks), a brute
// force over all ranks, and the rules the program followed before the mesh (shard group = rank / G,
// replica group = rank mod G, replica group 0 writes and counts).
//
// Every rank makes the same collective calls in the same order; checks are EXPECT_* only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "shardtrain/runtime/mesh.h"
#include "shardtrain/runtime/runtime.h"
#include "../test_env.h"
#include "rank_test.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

class Mesh : public st::testing::RankTest {};

// The global ranks of the members of `c`, in c's rank order.
std::vector<int> members(st::Comm& c) {
  int64_t me = world().rank();
  std::vector<int64_t> all(static_cast<size_t>(c.world_size()));
  c.all_gather(&me, all.data(), 1);
  return std::vector<int>(all.begin(), all.end());
}

// Pure layout arithmetic, the same at every world size: W = 4, shard group 2 (HSDP) and W = 8,
// shard group 4, written out by hand.
TEST_F(Mesh, LayoutByHand) {
  const st::MeshLayout h(st::MeshDims{2, 2, 1, 1});
  EXPECT_EQ(h.dims().world(), 4);
  EXPECT_EQ(h.dims().dp(), 4);
  const st::MeshCoord c3{1, 1, 0, 0}, c2{1, 0, 0, 0};
  EXPECT_EQ(h.coord(3), c3);
  EXPECT_EQ(h.coord(2), c2);
  EXPECT_EQ(h.shard_group(3), (std::vector<int>{2, 3}));
  EXPECT_EQ(h.replica_group(3), (std::vector<int>{1, 3}));
  EXPECT_EQ(h.replica_group(0), (std::vector<int>{0, 2}));
  for (int q = 0; q < 4; ++q) EXPECT_EQ(h.dp_index(q), q);
  EXPECT_EQ((std::vector<int>{h.checkpoint_row(0), h.checkpoint_row(1), h.checkpoint_row(2), h.checkpoint_row(3)}),
            (std::vector<int>{0, 1, -1, -1}));
  EXPECT_EQ((std::vector<bool>{h.counts_in_norm(0), h.counts_in_norm(1), h.counts_in_norm(2), h.counts_in_norm(3)}),
            (std::vector<bool>{true, true, false, false}));
  // pp 2 x dp_shard 2 x tp 2 (W = 8): stage 0 is ranks 0-3, stage 1 ranks 4-7; rank 6 = (pp 1,
  // shard 1, tp 0); its PP group pairs it with rank 2 of stage 0.
  const st::MeshLayout p(st::MeshDims{1, 2, 1, 2, 2});
  EXPECT_EQ(p.dims().world(), 8);
  EXPECT_EQ(p.coord(6), (st::MeshCoord{0, 1, 0, 0, 1}));
  EXPECT_EQ(p.rank_of(st::MeshCoord{0, 1, 0, 0, 1}), 6);
  EXPECT_EQ(p.pp_group(6), (std::vector<int>{2, 6}));
  EXPECT_EQ(p.shard_group(6), (std::vector<int>{4, 6}));
  EXPECT_EQ(p.tp_group(6), (std::vector<int>{6, 7}));
  EXPECT_EQ(p.dp_index(6), p.dp_index(2));
  EXPECT_TRUE(p.counts_loss(6));
  EXPECT_FALSE(p.counts_loss(2));
  EXPECT_THROW(st::MeshLayout(st::MeshDims{1, 2, 1, 1, 0}), std::invalid_argument);
  const st::MeshLayout e(st::MeshDims{2, 4, 1, 1});
  EXPECT_EQ(e.shard_group(5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(e.replica_group(5), (std::vector<int>{1, 5}));
  EXPECT_EQ(e.checkpoint_row(3), 3);
  EXPECT_EQ(e.checkpoint_row(7), -1);
  const st::MeshLayout plain(st::MeshDims{1, 3, 1, 1});  // plain FSDP: everyone writes its row and counts
  for (int q = 0; q < 3; ++q) {
    EXPECT_EQ(plain.checkpoint_row(q), q);
    EXPECT_TRUE(plain.counts_in_norm(q));
    EXPECT_EQ(plain.replica_group(q), (std::vector<int>{q}));
  }
  // Context parallelism: W = 4 = dp_shard 2 x cp 2. Rank = shard * 2 + cp; the shard group spans
  // dp_shard x cp (all 4, row = rank); CP ranks read the same rows and each counts its loss.
  const st::MeshLayout cp(st::MeshDims{1, 2, 2, 1});
  const st::MeshCoord c3cp{0, 1, 1, 0};
  EXPECT_EQ(cp.coord(3), c3cp);
  EXPECT_EQ(cp.cp_group(3), (std::vector<int>{2, 3}));
  EXPECT_EQ(cp.cp_group(0), (std::vector<int>{0, 1}));
  EXPECT_EQ(cp.shard_group(2), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ((std::vector<int>{cp.dp_index(0), cp.dp_index(1), cp.dp_index(2), cp.dp_index(3)}),
            (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ((std::vector<int>{cp.checkpoint_row(0), cp.checkpoint_row(1), cp.checkpoint_row(2), cp.checkpoint_row(3)}),
            (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(cp.counts_loss(1));
  EXPECT_TRUE(cp.counts_in_norm(3));
  EXPECT_EQ(cp.dims().dp(), 2);
  EXPECT_EQ(cp.dims().fsdp(), 4);
  // W = 8 = 2 replica groups x cp 2 x tp 2: rank = (rep * 2 + cp) * 2 + tp. Rank 5 = (1, 0, 0, 1).
  const st::MeshLayout ct(st::MeshDims{2, 1, 2, 2});
  const st::MeshCoord c5ct{1, 0, 0, 1};
  EXPECT_EQ(ct.coord(5), c5ct);
  EXPECT_EQ(ct.cp_group(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(ct.tp_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(ct.shard_group(5), (std::vector<int>{5, 7}));  // equal (rep, tp), cp 0 and 1
  EXPECT_EQ(ct.replica_group(5), (std::vector<int>{1, 5}));
  EXPECT_EQ(ct.dp_index(5), 1);
  EXPECT_EQ(ct.shard_index(7), 1);
  EXPECT_EQ(ct.checkpoint_row(3), 1);   // replica 0, cp 1
  EXPECT_EQ(ct.checkpoint_row(5), -1);  // replica 1
  EXPECT_FALSE(ct.counts_loss(5));      // TP rank 1
  EXPECT_TRUE(ct.counts_loss(6));       // (1, 0, 1, 0): CP rank 1 counts its own tokens
  // W = 8 = dp_shard 2 x cp 2 x tp 2: rank 6 = (0, 1, 1, 0); its shard group: ranks of TP rank 0.
  const st::MeshLayout sct(st::MeshDims{1, 2, 2, 2});
  EXPECT_EQ(sct.shard_group(6), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(sct.shard_index(6), 3);
  EXPECT_EQ(sct.cp_group(6), (std::vector<int>{4, 6}));
  EXPECT_EQ(sct.dp_index(6), 1);
  // Tensor parallelism: W = 8 = 2 replica groups x 2 shard ranks x TP 2. TP groups are consecutive
  // ranks; a shard group joins the ranks of equal TP rank; a TP group reads one batch share.
  const st::MeshLayout t(st::MeshDims{2, 2, 1, 2});
  const st::MeshCoord c5{1, 0, 0, 1};
  EXPECT_EQ(t.coord(5), c5);
  EXPECT_EQ(t.tp_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(t.shard_group(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(t.replica_group(5), (std::vector<int>{1, 5}));
  EXPECT_EQ((std::vector<int>{t.dp_index(0), t.dp_index(1), t.dp_index(2), t.dp_index(3), t.dp_index(4)}),
            (std::vector<int>{0, 0, 1, 1, 2}));
  EXPECT_EQ(t.dims().dp(), 4);
  EXPECT_TRUE(t.counts_in_norm(1));   // replica group 0: its TP slices count
  EXPECT_FALSE(t.counts_in_norm(5));  // replica group 1
  EXPECT_TRUE(t.counts_replicated_in_norm(4));
  EXPECT_FALSE(t.counts_replicated_in_norm(5));  // its norms are TP rank 0's copy
  EXPECT_TRUE(t.counts_loss(2));
  EXPECT_FALSE(t.counts_loss(3));
  EXPECT_THROW(st::MeshLayout(st::MeshDims{0, 2, 1, 1}), std::invalid_argument);
}

// For every TP degree N dividing W (and N <= W): the TP and shard communicators against their
// members computed by brute force, the batch index (one per TP group) and who counts the loss.
TEST_F(Mesh, TensorParallelGroupsAgreeWithIndependentComputation) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const st::Topology& topo = st::testing::g_runtime->topo();
  for (int N = 2; N <= W; ++N) {
    if (W % N != 0) continue;
    SCOPED_TRACE("W = " + std::to_string(W) + ", tp = " + std::to_string(N));
    st::Mesh mesh(c, topo, st::MeshDims{1, W / N, 1, N}, 0);
    ASSERT_NE(mesh.tp_host(), nullptr);
    EXPECT_EQ(mesh.tp_data(), mesh.tp_host());
    std::vector<int> tp_bf, shard_bf;
    for (int q = 0; q < W; ++q) {
      if (q / N == r / N) tp_bf.push_back(q);
      if (q % N == r % N) shard_bf.push_back(q);
    }
    EXPECT_EQ(members(*mesh.tp_host()), tp_bf);
    EXPECT_EQ(members(mesh.shard_host()), shard_bf);
    EXPECT_EQ(mesh.coord().tp, r % N);
    EXPECT_EQ(mesh.dp_index(), r / N);
    EXPECT_EQ(mesh.dp_size(), W / N);
    EXPECT_EQ(mesh.counts_loss(), r % N == 0);
    EXPECT_NE(mesh.topology_line().find("tensor parallel: " + std::to_string(W / N) +
                                        (W / N == 1 ? " TP group of " : " TP groups of ") + std::to_string(N)),
              std::string::npos)
        << mesh.topology_line();
  }
}

// For every G dividing W: the mesh's communicators, coordinates and answers against the
// communicators' own view, a brute force over all ranks, and the pre-mesh rules.
TEST_F(Mesh, GroupsBatchesWritersAndNormAgreeWithIndependentComputation) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const st::Topology& topo = st::testing::g_runtime->topo();
  for (int G = 1; G <= W; ++G) {
    if (W % G != 0) continue;
    const int R = W / G;
    SCOPED_TRACE("W = " + std::to_string(W) + ", G = " + std::to_string(G));
    st::Mesh mesh(c, topo, st::MeshDims{R, G, 1, 1}, 0);
    const st::MeshLayout& L = mesh.layout();
    // Coordinates: the pre-mesh rule, and the communicators' own ranks.
    const st::MeshCoord want{r / G, r % G, 0, 0};
    EXPECT_EQ(mesh.coord(), want);
    EXPECT_EQ(mesh.shard_host().world_size(), G);
    EXPECT_EQ(mesh.shard_host().rank(), r % G);
    EXPECT_EQ(mesh.replica_host() != nullptr, R > 1);
    if (mesh.replica_host()) {
      EXPECT_EQ(mesh.replica_host()->world_size(), R);
      EXPECT_EQ(mesh.replica_host()->rank(), r / G);
    }
    EXPECT_EQ(&mesh.shard_data(), &mesh.shard_host());  // no device communicators attached
    EXPECT_EQ(mesh.cp_host(), nullptr);                   // cp = 1: no CP group
    EXPECT_EQ(mesh.replica_data(), mesh.replica_host());
    for (int q = 0; q < W; ++q) EXPECT_EQ(L.rank_of(L.coord(q)), q);
    // Group membership: brute force over all ranks vs the layout vs the communicators' members.
    std::vector<int> shard_bf, replica_bf;
    for (int q = 0; q < W; ++q) {
      if (q / G == r / G) shard_bf.push_back(q);
      if (q % G == r % G) replica_bf.push_back(q);
    }
    EXPECT_EQ(L.shard_group(r), shard_bf);
    EXPECT_EQ(L.replica_group(r), replica_bf);
    EXPECT_EQ(members(mesh.shard_host()), shard_bf);
    if (mesh.replica_host()) {
      EXPECT_EQ(members(*mesh.replica_host()), replica_bf);
    }
    // The batch index: rank r read rows r * per_rank before the mesh; the indices form a
    // permutation of [0, dp_size).
    EXPECT_EQ(mesh.dp_size(), W);
    EXPECT_EQ(mesh.dp_index(), r);
    int64_t idx = mesh.dp_index();
    std::vector<int64_t> all(static_cast<size_t>(W));
    c.all_gather(&idx, all.data(), 1);
    std::sort(all.begin(), all.end());
    for (int q = 0; q < W; ++q) EXPECT_EQ(all[static_cast<size_t>(q)], q);
    // Checkpoint writers: exactly one rank per shard row, the ranks of replica communicator rank 0
    // (every rank without hybrid sharding), and its row is its rank in the shard communicator.
    const bool pre_mesh_writer = !mesh.replica_host() || mesh.replica_host()->rank() == 0;
    EXPECT_EQ(mesh.writes_checkpoint(), pre_mesh_writer);
    EXPECT_EQ(L.checkpoint_row(r), pre_mesh_writer ? mesh.shard_host().rank() : -1);
    std::vector<int64_t> rows(static_cast<size_t>(W) * 1), per_row(static_cast<size_t>(G), 0);
    int64_t my_row = L.checkpoint_row(r);
    c.all_gather(&my_row, rows.data(), 1);
    for (int64_t row : rows)
      if (row >= 0) ++per_row[static_cast<size_t>(row)];
    for (int k = 0; k < G; ++k) EXPECT_EQ(per_row[static_cast<size_t>(k)], 1) << "checkpoint row " << k;
    // Norm counting: every replica holds the same shard values (here 2^(shard row)); summing the
    // counted ranks' values over the world gives each shard row exactly once.
    double v = mesh.counts_in_norm() ? static_cast<double>(int64_t{1} << mesh.coord().dp_shard) : 0.0;
    c.all_reduce(&v, 1, st::ReduceOp::Sum);
    EXPECT_EQ(v, static_cast<double>((int64_t{1} << G) - 1));
    EXPECT_EQ(mesh.counts_in_norm(), pre_mesh_writer);
    // The topology line names the layout.
    const std::string line = mesh.topology_line();
    EXPECT_NE(line.find("(world " + std::to_string(W) + ")"), std::string::npos) << line;
    EXPECT_NE(line.find(R == 1 ? "fully sharded over all " + std::to_string(W) + " ranks"
                               : "hybrid sharding: " + std::to_string(R) + " replica groups of " + std::to_string(G)),
              std::string::npos)
        << line;
  }
}

// Every mesh with cp >= 2 of this world (all (R, D, C, N) with R x D x C x N = W): the CP, shard,
// replica and TP communicators' members and ranks, the coordinates, the batch index, the
// checkpoint rows and the loss and norm counting, against arithmetic written here from the rank
// alone (rank = ((rep x D + shard) x C + cp) x N + tp) and sums over the world.
TEST_F(Mesh, ContextParallelGroupsAgreeWithIndependentComputation) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const st::Topology& topo = st::testing::g_runtime->topo();
  int meshes = 0;
  for (int C = 2; C <= W; ++C)
    for (int N = 1; N <= W; ++N)
      for (int D = 1; D <= W; ++D) {
        if (W % (C * N * D) != 0) continue;
        const int R = W / (C * N * D);
        SCOPED_TRACE("W " + std::to_string(W) + ": R " + std::to_string(R) + ", D " + std::to_string(D) + ", C " +
                     std::to_string(C) + ", N " + std::to_string(N));
        ++meshes;
        st::Mesh mesh(c, topo, st::MeshDims{R, D, C, N}, 0);
        auto tp_of = [&](int q) { return q % N; };
        auto cp_of = [&](int q) { return q / N % C; };
        auto shard_of = [&](int q) { return q / (N * C) % D; };
        auto rep_of = [&](int q) { return q / (N * C * D); };
        const st::MeshCoord want{rep_of(r), shard_of(r), cp_of(r), tp_of(r)};
        EXPECT_EQ(mesh.coord(), want);
        std::vector<int> cp_bf, shard_bf, replica_bf, tp_bf;
        for (int q = 0; q < W; ++q) {
          const bool rep = rep_of(q) == rep_of(r), sh = shard_of(q) == shard_of(r), cpq = cp_of(q) == cp_of(r),
                     tp = tp_of(q) == tp_of(r);
          if (rep && sh && tp) cp_bf.push_back(q);
          if (rep && tp) shard_bf.push_back(q);
          if (sh && cpq && tp) replica_bf.push_back(q);
          if (rep && sh && cpq) tp_bf.push_back(q);
        }
        ASSERT_NE(mesh.cp_host(), nullptr);
        EXPECT_EQ(mesh.cp_data(), mesh.cp_host());  // no device communicators attached
        EXPECT_EQ(members(*mesh.cp_host()), cp_bf);
        EXPECT_EQ(mesh.cp_host()->rank(), cp_of(r));
        EXPECT_EQ(mesh.layout().cp_group(r), cp_bf);
        EXPECT_EQ(members(mesh.shard_host()), shard_bf);
        EXPECT_EQ(mesh.layout().shard_group(r), shard_bf);
        EXPECT_EQ(mesh.shard_host().rank(), shard_of(r) * C + cp_of(r));
        EXPECT_EQ(mesh.layout().shard_index(r), mesh.shard_host().rank());
        if (R > 1) {
          ASSERT_NE(mesh.replica_host(), nullptr);
          EXPECT_EQ(members(*mesh.replica_host()), replica_bf);
        } else {
          EXPECT_EQ(mesh.replica_host(), nullptr);
        }
        if (N > 1) {
          ASSERT_NE(mesh.tp_host(), nullptr);
          EXPECT_EQ(members(*mesh.tp_host()), tp_bf);
        }
        // CP ranks read the same rows: the batch index of (rep, shard), dp = R x D indices.
        EXPECT_EQ(mesh.dp_index(), rep_of(r) * D + shard_of(r));
        EXPECT_EQ(mesh.dp_size(), R * D);
        // Checkpoint rows: replica 0 writes, row = rank in the shard group; each of the D x C rows
        // is written by exactly N ranks (one per TP rank: TP files are moved to canonical rows first).
        const int row = mesh.layout().checkpoint_row(r);
        EXPECT_EQ(row, rep_of(r) == 0 ? shard_of(r) * C + cp_of(r) : -1);
        std::vector<int64_t> per_row(static_cast<size_t>(D * C), 0);
        std::vector<int64_t> rows(static_cast<size_t>(W));
        int64_t mine = row;
        c.all_gather(&mine, rows.data(), 1);
        for (int64_t q : rows)
          if (q >= 0) ++per_row[static_cast<size_t>(q)];
        for (int k = 0; k < D * C; ++k) EXPECT_EQ(per_row[static_cast<size_t>(k)], N) << "checkpoint row " << k;
        // Loss: every CP rank holds its own tokens of the rows of batch index dp_index, a TP group
        // the same tokens: summing 2^(dp_index x C + cp) over the counting ranks gives each
        // (batch index, CP part) exactly once.
        double loss = mesh.counts_loss() ? std::ldexp(1.0, mesh.dp_index() * C + cp_of(r)) : 0.0;
        c.all_reduce(&loss, 1, st::ReduceOp::Sum);
        EXPECT_EQ(loss, std::ldexp(1.0, R * D * C) - 1);
        // Norm: each (tp, shard row) holds different elements; replicas hold copies: counting
        // 2^(tp x D x C + row) over the counting ranks gives each element group once.
        double norm = mesh.counts_in_norm() ? std::ldexp(1.0, tp_of(r) * D * C + shard_of(r) * C + cp_of(r)) : 0.0;
        c.all_reduce(&norm, 1, st::ReduceOp::Sum);
        EXPECT_EQ(norm, std::ldexp(1.0, N * D * C) - 1);
        const std::string line = mesh.topology_line();
        EXPECT_NE(line.find("context parallel: " + std::to_string(W / C) + (W / C == 1 ? " CP group of " : " CP groups of ") +
                            std::to_string(C) + " ranks (--cp " + std::to_string(C) + ","),
                  std::string::npos)
            << line;
      }
  if (meshes == 0) GTEST_SKIP() << "no mesh with cp >= 2 at world size " << W;
}

// Pipeline stages (issue 42): pp outermost. Every mesh with pp >= 2 at this world size: the PP group
// is one rank per stage with all other coordinates equal; every other group lies inside a stage;
// stages read the same batch rows; only the last stage counts the loss; each stage's replica 0
// writes its rows; the norm counts each (stage, tp, shard row) once.
TEST_F(Mesh, PipelineGroupsAgreeWithIndependentComputation) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const st::Topology& topo = st::testing::g_runtime->topo();
  int meshes = 0;
  for (int P = 2; P <= W; ++P)
    for (int C = 1; C <= 2; ++C)
      for (int N = 1; N <= W; ++N)
        for (int D = 1; D <= W; ++D) {
          if (W % (P * C * N * D) != 0) continue;
          const int R = W / (P * C * N * D);
          SCOPED_TRACE("W " + std::to_string(W) + ": P " + std::to_string(P) + ", R " + std::to_string(R) + ", D " +
                       std::to_string(D) + ", C " + std::to_string(C) + ", N " + std::to_string(N));
          ++meshes;
          st::Mesh mesh(c, topo, st::MeshDims{R, D, C, N, P}, 0);
          auto tp_of = [&](int q) { return q % N; };
          auto cp_of = [&](int q) { return q / N % C; };
          auto shard_of = [&](int q) { return q / (N * C) % D; };
          auto rep_of = [&](int q) { return q / (N * C * D) % R; };
          auto pp_of = [&](int q) { return q / (N * C * D * R); };
          const st::MeshCoord want{rep_of(r), shard_of(r), cp_of(r), tp_of(r), pp_of(r)};
          EXPECT_EQ(mesh.coord(), want);
          std::vector<int> pp_bf, shard_bf, tp_bf, replica_bf;
          for (int q = 0; q < W; ++q) {
            const bool pp = pp_of(q) == pp_of(r), rep = rep_of(q) == rep_of(r), sh = shard_of(q) == shard_of(r),
                       cpq = cp_of(q) == cp_of(r), tp = tp_of(q) == tp_of(r);
            if (rep && sh && cpq && tp) pp_bf.push_back(q);
            if (pp && rep && tp) shard_bf.push_back(q);
            if (pp && rep && sh && cpq) tp_bf.push_back(q);
            if (pp && sh && cpq && tp) replica_bf.push_back(q);
          }
          ASSERT_NE(mesh.pp_host(), nullptr);
          EXPECT_EQ(mesh.pp_data(), mesh.pp_host());
          EXPECT_EQ(members(*mesh.pp_host()), pp_bf);
          EXPECT_EQ(mesh.pp_host()->rank(), pp_of(r));
          EXPECT_EQ(mesh.layout().pp_group(r), pp_bf);
          EXPECT_EQ(members(mesh.shard_host()), shard_bf);
          EXPECT_EQ(mesh.layout().shard_group(r), shard_bf);
          if (N > 1) {
            ASSERT_NE(mesh.tp_host(), nullptr);
            EXPECT_EQ(members(*mesh.tp_host()), tp_bf);
          }
          if (R > 1) {
            ASSERT_NE(mesh.replica_host(), nullptr);
            EXPECT_EQ(members(*mesh.replica_host()), replica_bf);
          }
          EXPECT_EQ(mesh.dp_index(), rep_of(r) * D + shard_of(r));  // every stage reads the same rows
          // Loss: the last stage's counting ranks give each (batch index, CP part) once.
          double loss = mesh.counts_loss() ? std::ldexp(1.0, mesh.dp_index() * C + cp_of(r)) : 0.0;
          EXPECT_TRUE(!mesh.counts_loss() || pp_of(r) == P - 1);
          c.all_reduce(&loss, 1, st::ReduceOp::Sum);
          EXPECT_EQ(loss, std::ldexp(1.0, R * D * C) - 1);
          // Norm: stages hold different units, so each (stage, tp, shard row) counts once.
          const int row = shard_of(r) * C + cp_of(r);
          double norm = mesh.counts_in_norm() ? std::ldexp(1.0, (pp_of(r) * N + tp_of(r)) * D * C + row) : 0.0;
          c.all_reduce(&norm, 1, st::ReduceOp::Sum);
          EXPECT_EQ(norm, std::ldexp(1.0, P * N * D * C) - 1);
          EXPECT_EQ(mesh.layout().checkpoint_row(r), rep_of(r) == 0 ? row : -1);
          const std::string line = mesh.topology_line();
          EXPECT_NE(line.find("pipeline parallel: " + std::to_string(P) + " stages of " + std::to_string(W / P) +
                              " consecutive ranks (--pp " + std::to_string(P) + ")"),
                    std::string::npos)
              << line;
        }
  if (meshes == 0) GTEST_SKIP() << "no mesh with pp >= 2 at world size " << W;
}

// A layout that does not cover the world is refused on every rank, naming the option.
TEST_F(Mesh, RefusesDimsThatDoNotMatchTheWorld) {
  st::Comm& c = world();
  const st::Topology& topo = st::testing::g_runtime->topo();
  try {
    st::Mesh m(c, topo, st::MeshDims{1, c.world_size() + 1, 1, 1}, 0);
    ADD_FAILURE() << "no error";
  } catch (const st::CollectiveError& e) {
    EXPECT_NE(std::string(e.what()).find("'--shard-group-size'"), std::string::npos) << e.what();
  }
  try {  // with stages, every factor is named
    st::Mesh m(c, topo, st::MeshDims{1, c.world_size(), 1, 1, 2}, 0);
    ADD_FAILURE() << "no error";
  } catch (const st::CollectiveError& e) {
    EXPECT_NE(std::string(e.what()).find("the mesh (pp 2 x dp_replicate 1 x dp_shard " + std::to_string(c.world_size()) +
                                         " x cp 1 x tp 1 = " + std::to_string(2 * c.world_size()) +
                                         " ranks) does not match the world size"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace

// Expert parallelism (--ep E): the meshes of this world with cp, tp <= 2 and E = 2 or E = dp_shard x
// cp (dividing it). The EP
// group is E ranks of one shard group (equal rep and tp) of consecutive shard index
// (shard * C + cp), computed here from the rank alone; the EP communicator's members and rank
// agree (and so do the expert shard groups: the shard group's ranks of one EP index), every EP
// group lies inside the shard group, and EP adds no ranks (world unchanged, the
// other groups as without it). A MeshLayout with E not dividing dp_shard x cp is refused by name.
TEST_F(Mesh, ExpertParallelGroupsAgreeWithIndependentComputation) {
  st::Comm& c = world();
  const int W = c.world_size(), r = c.rank();
  const st::Topology& topo = st::testing::g_runtime->topo();
  int meshes = 0;
  for (int C = 1; C <= 2; ++C)  // (each mesh costs ~0.5 s: cp and tp up to 2, ep 2 and the whole shard group)
    for (int N = 1; N <= 2; ++N)
      for (int D = 1; D <= W; ++D)
        for (int E = 2; E <= D * C; ++E) {
          if (W % (C * N * D) != 0 || (D * C) % E != 0 || (E != 2 && E != D * C)) continue;
          const int R = W / (C * N * D);
          SCOPED_TRACE("W " + std::to_string(W) + ": R " + std::to_string(R) + ", D " + std::to_string(D) + ", C " +
                       std::to_string(C) + ", N " + std::to_string(N) + ", E " + std::to_string(E));
          ++meshes;
          st::MeshDims dims{R, D, C, N};
          dims.ep = E;
          st::Mesh mesh(c, topo, dims, 0);
          EXPECT_EQ(mesh.dims().world(), W);
          auto tp_of = [&](int q) { return q % N; };
          auto sidx = [&](int q) { return q / N % (C * D); };  // shard * C + cp
          auto rep_of = [&](int q) { return q / (N * C * D); };
          std::vector<int> ep_bf, shard_bf, eshard_bf;
          for (int q = 0; q < W; ++q) {
            if (rep_of(q) != rep_of(r) || tp_of(q) != tp_of(r)) continue;
            shard_bf.push_back(q);
            if (sidx(q) / E == sidx(r) / E) ep_bf.push_back(q);
            if (sidx(q) % E == sidx(r) % E) eshard_bf.push_back(q);  // the same experts
          }
          ASSERT_NE(mesh.expert_shard_host(), nullptr);
          EXPECT_EQ(members(*mesh.expert_shard_host()), eshard_bf);
          EXPECT_EQ(mesh.layout().expert_shard_group(r), eshard_bf);
          EXPECT_EQ(mesh.expert_shard_host()->rank(), sidx(r) / E);
          ASSERT_NE(mesh.ep_host(), nullptr);
          EXPECT_EQ(members(*mesh.ep_host()), ep_bf);
          EXPECT_EQ(mesh.layout().ep_group(r), ep_bf);
          EXPECT_EQ(mesh.ep_host()->rank(), sidx(r) % E);
          EXPECT_EQ(mesh.layout().ep_index(r), sidx(r) % E);
          EXPECT_EQ(members(mesh.shard_host()), shard_bf);
          for (int q : ep_bf) {
            EXPECT_NE(std::find(shard_bf.begin(), shard_bf.end(), q), shard_bf.end());
          }
        }
  if (W >= 2) {
    EXPECT_GT(meshes, 0);
  }
  st::MeshDims bad{1, 3, 1, 1};
  bad.ep = 2;
  try {
    st::MeshLayout l(bad);
    ADD_FAILURE() << "ep 2 over a shard group of 3 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ep 2 does not divide the FSDP shard group"), std::string::npos) << e.what();
  }
}
