// TpCheckpointLayout (checkpoint.h): a tensor-parallel run's state <-> the canonical rows of
// checkpoints, by one MPI_Alltoallv per unit over the world.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "shardtrain/io/checkpoint.h"

namespace shardtrain {

TpCheckpointLayout::TpCheckpointLayout(const MeshLayout& mesh, int rank, std::vector<ShardPlan> tp_plans,
                                       ShardPlan canonical, std::vector<std::string> names)
    : mesh_(mesh), rank_(rank), plans_(std::move(tp_plans)), canon_(std::move(canonical)), names_(std::move(names)),
      host_(make_cpu_backend<float>()) {
  const MeshDims& d = mesh_.dims();
  if (d.tp > 1 && d.ep > 1) throw std::invalid_argument("TpCheckpointLayout: tp and ep together");
  if (static_cast<int>(plans_.size()) != (d.tp > 1 ? d.tp : d.ep) || canon_.world_size != d.world())
    throw std::invalid_argument("TpCheckpointLayout: plans do not match the mesh");
  for (const ShardPlan& p : plans_)
    if (p.units.size() != plans_[0].units.size() || p.world_size != d.fsdp() ||
        (p.grouped() && p.expert_world_size * d.ep != d.fsdp()))
      throw std::invalid_argument("TpCheckpointLayout: a plan does not match dp_shard x cp (or its expert groups ep)");
  // Each plan unit's parameters are in one canonical unit; every canonical parameter in one plan unit.
  contrib_.resize(canon_.units.size());
  std::vector<size_t> covered(canon_.units.size(), 0);
  for (size_t lu = 0; lu < plans_[0].units.size(); ++lu) {
    const UnitPlan& up = plans_[0].units[lu];
    size_t cu = canon_.units.size();
    for (size_t c = 0; c < canon_.units.size() && cu == canon_.units.size(); ++c)
      for (const ParamSlot& slot : canon_.units[c].params)
        if (slot.spec.name == up.params.front().spec.name) cu = c;
    if (cu == canon_.units.size())
      throw std::invalid_argument("TpCheckpointLayout: unit '" + up.name + "' is not in the canonical plan");
    std::vector<int64_t> off;
    for (const ParamSlot& slot : up.params) off.push_back(canon_.units[cu].param(slot.spec.name).offset);  // throws if not there
    canon_offset_.push_back(std::move(off));
    contrib_[cu].push_back(static_cast<int>(lu));
    covered[cu] += up.params.size();
  }
  for (size_t cu = 0; cu < canon_.units.size(); ++cu)
    if (covered[cu] != canon_.units[cu].params.size())
      throw std::invalid_argument("TpCheckpointLayout: the plans do not hold canonical unit '" + canon_.units[cu].name +
                                  "' once");
  for (const ShardPlan& p : plans_) {
    std::vector<int64_t> base(p.units.size(), 0);
    for (const std::vector<int>& c : contrib_) {
      int64_t at = 0;
      for (int lu : c) {
        base[static_cast<size_t>(lu)] = at;
        at += p.units[static_cast<size_t>(lu)].shard_size;
      }
    }
    lbase_.push_back(std::move(base));
  }
  rows_.resize(names_.size());
  for (auto& t : rows_)
    for (const UnitPlan& up : canon_.units) t.emplace_back(*host_, static_cast<size_t>(up.shard_size));
}

TpRecord tp_record(const std::vector<ShardPlan>& tp_plans, const MeshDims& dims) {
  TpRecord r;
  r.tp = dims.tp;
  r.dp_shard = dims.dp_shard;
  r.dp_replicate = dims.dp_replicate;
  r.cp = dims.cp;
  r.ep = dims.ep;
  if (tp_plans.empty()) return r;
  for (const UnitPlan& up : tp_plans[0].units) {
    TpUnitRecord t;
    for (const ParamSlot& slot : up.params) {
      const TpSlice& s = slot.spec.tp;
      const int64_t split = s.split == TpSplit::Rows ? 0 : s.split == TpSplit::Cols ? 1 : -1;
      const int64_t padded = s.split == TpSplit::Rows ? slot.spec.shape[0] * s.degree - s.rows : 0;
      t.params.push_back({split, s.degree, padded, slot.offset});
    }
    t.local_numel = up.numel;
    t.local_shard_size = up.shard_size;
    t.shards = up.ranks;
    r.units.push_back(std::move(t));
  }
  return r;
}

ShardedTensors TpCheckpointLayout::canonical(size_t n) {
  ShardedTensors t;
  t.plan = &canon_;
  t.plan_rank = rank_;
  t.backend = host_.get();
  if (n == 0 || n > names_.size()) n = names_.size();
  for (size_t k = 0; k < n; ++k) {
    ShardedTensor st{names_[k], {}};
    for (auto& b : rows_[k]) st.shards.push_back(b.data());
    t.tensors.push_back(std::move(st));
  }
  return t;
}

int TpCheckpointLayout::variant(int q) const {
  return mesh_.dims().tp > 1 ? mesh_.coord(q).tp : mesh_.ep_index(q);
}

int TpCheckpointLayout::row(int q, int lu) const {
  const UnitPlan& up = plans_[static_cast<size_t>(variant(q))].units[static_cast<size_t>(lu)];
  return up.group == 0 ? mesh_.shard_index(q) : mesh_.shard_index(q) / mesh_.dims().ep;  // over dp_shard x cp
}

std::vector<TpCheckpointLayout::Run> TpCheckpointLayout::runs(int q, size_t cu) const {
  const int v = variant(q);
  std::vector<Run> out;
  for (const int lu : contrib_[cu]) {
  const UnitPlan& up = plans_[static_cast<size_t>(v)].units[static_cast<size_t>(lu)];
  const RankShard& rs = up.ranks[static_cast<size_t>(row(q, lu))];
  const int64_t lbase = lbase_[static_cast<size_t>(v)][static_cast<size_t>(lu)];
  for (size_t i = 0; i < up.params.size(); ++i) {
    const ParamSlot& slot = up.params[i];
    const int64_t lo = std::max(slot.offset, rs.start), hi = std::min(slot.offset + slot.numel, rs.start + rs.valid);
    if (lo >= hi) continue;
    const int64_t e0 = lo - slot.offset, e1 = hi - slot.offset, base = canon_offset_[static_cast<size_t>(lu)][i];
    const TpSlice& tp = slot.spec.tp;
    const int64_t lcols = slot.spec.shape.size() >= 2 ? slot.numel / slot.spec.shape[0] : 1;
    auto add = [&](int64_t e, int64_t canon, int64_t len) {
      if (len > 0) out.push_back({lbase + slot.offset + e - rs.start, base + canon, len, slot.spec.tp_replicated()});
    };
    if (tp.degree <= 1 || tp.split == TpSplit::None || tp.split == TpSplit::Replicated) {
      add(e0, e0, e1 - e0);
    } else if (tp.split == TpSplit::Rows) {  // contiguous rows; rows past tp.rows are padding
      const int64_t real = std::max<int64_t>(0, (tp.rows - tp.offset) * lcols);
      add(e0, tp.offset * tp.cols + e0, std::min(e1, real) - e0);
    } else {  // Cols: one run per row, columns [tp.offset, tp.offset + lcols)
      for (int64_t r = e0 / lcols; r * lcols < e1; ++r) {
        const int64_t a = std::max(e0, r * lcols), b = std::min(e1, (r + 1) * lcols);
        add(a, r * tp.cols + tp.offset + (a - r * lcols), b - a);
      }
    }
  }
  }
  return out;
}

void TpCheckpointLayout::to_canonical(Comm& world, const ShardedTensors& local) { move(world, local, true); }
void TpCheckpointLayout::from_canonical(Comm& world, const ShardedTensors& local) { move(world, local, false); }

// For each unit: every rank walks every rank q's runs in order, cutting each at the canonical row
// boundaries (row = canonical index / canonical shard size). A piece moves between its holder q
// and its canonical row's rank; both sides see the pieces of one pair in the same order, so the
// packed buffers need no headers. Tensors travel together: per piece, tensor 0's elements, then
// tensor 1's, ...
void TpCheckpointLayout::move(Comm& world, const ShardedTensors& local, bool to_canon) {
  const int W = mesh_.dims().world();
  if (world.world_size() != W || world.rank() != rank_)
    throw std::invalid_argument("TpCheckpointLayout: communicator is not the mesh's world");
  const size_t K = local.tensors.size();
  if (K > names_.size()) throw std::invalid_argument("TpCheckpointLayout: more tensors than it holds");
  for (size_t k = 0; k < K; ++k)
    if (local.tensors[k].name != names_[k]) throw std::invalid_argument("TpCheckpointLayout: tensor order differs");
  MPI_Comm comm = static_cast<MPI_Comm>(world.mpi_handle());
  moved_ = 0;
  std::vector<float> shard, sendbuf, recvbuf;
  std::vector<int> scount(static_cast<size_t>(W)), sdispl(static_cast<size_t>(W)), rcount(static_cast<size_t>(W)),
      rdispl(static_cast<size_t>(W));
  for (size_t u = 0; u < canon_.units.size(); ++u) {
    const int64_t S = canon_.units[u].shard_size;
    // This rank's shards of the plan units holding unit u's parameters, concatenated, all tensors,
    // in host memory: [tensor][local_size].
    const ShardPlan& mine = plans_[static_cast<size_t>(variant(rank_))];
    const std::vector<int64_t>& lbase = lbase_[static_cast<size_t>(variant(rank_))];
    int64_t local_size = 0;
    for (const int lu : contrib_[u]) local_size += mine.units[static_cast<size_t>(lu)].shard_size;
    shard.assign(static_cast<size_t>(local_size) * K, 0.0f);
    if (to_canon)
      for (size_t k = 0; k < K; ++k)
        for (const int lu : contrib_[u])
          local.backend->to_host(shard.data() + k * local_size + lbase[static_cast<size_t>(lu)],
                                 local.tensors[k].shards[static_cast<size_t>(lu)],
                                 static_cast<size_t>(mine.units[static_cast<size_t>(lu)].shard_size));
    // Pieces of rank q's runs: (holder-side offset, canonical offset, len, canonical row).
    struct Piece {
      int64_t local, canon, len;
      int row;
    };
    auto pieces_of = [&](int q, auto&& fn) {
      const MeshCoord c = mesh_.coord(q);
      for (const Run& r : runs(q, u)) {
        // The holder that sends to the canonical layout: replica group 0, TP rank 0 for replicated.
        if (to_canon && (c.dp_replicate != 0 || (r.replicated && c.tp != 0))) continue;
        for (int64_t a = 0; a < r.len;) {
          const int row = static_cast<int>((r.canon + a) / S);
          const int64_t n = std::min(r.len - a, (row + 1) * S - (r.canon + a));
          fn(Piece{r.local + a, r.canon + a, n, row});
          a += n;
        }
      }
    };
    // Counts (in floats, all tensors) per peer. Holder side: this rank's pieces by row; row side:
    // every rank's pieces that land in this rank's row.
    std::vector<int64_t> hold(static_cast<size_t>(W), 0), own(static_cast<size_t>(W), 0);
    pieces_of(rank_, [&](const Piece& p) { hold[static_cast<size_t>(p.row)] += p.len * static_cast<int64_t>(K); });
    for (int q = 0; q < W; ++q)
      pieces_of(q, [&](const Piece& p) {
        if (p.row == rank_) own[static_cast<size_t>(q)] += p.len * static_cast<int64_t>(K);
      });
    const std::vector<int64_t>& out = to_canon ? hold : own;  // what this rank sends
    const std::vector<int64_t>& in = to_canon ? own : hold;   // what it receives
    int64_t so = 0, ro = 0;
    bool fits = true;  // MPI_Alltoallv's int counts and displacements
    for (int q = 0; q < W; ++q) fits = fits && (so += out[static_cast<size_t>(q)]) <= INT_MAX && (ro += in[static_cast<size_t>(q)]) <= INT_MAX;
    // Agreed before the collective (a rank alone refusing would leave the others in it).
    all_ok(world, fits,
           "checkpoint of a tensor- or expert-parallel run: unit '" + canon_.units[u].name +
               "' would move more than 2^31 floats to or from one rank in the canonical layout; use more ranks");
    so = ro = 0;
    for (int q = 0; q < W; ++q) {
      scount[static_cast<size_t>(q)] = static_cast<int>(out[static_cast<size_t>(q)]);
      rcount[static_cast<size_t>(q)] = static_cast<int>(in[static_cast<size_t>(q)]);
      sdispl[static_cast<size_t>(q)] = static_cast<int>(so);
      rdispl[static_cast<size_t>(q)] = static_cast<int>(ro);
      so += out[static_cast<size_t>(q)];
      ro += in[static_cast<size_t>(q)];
      if (q != rank_) moved_ += out[static_cast<size_t>(q)];
    }
    sendbuf.assign(static_cast<size_t>(so), 0.0f);
    recvbuf.assign(static_cast<size_t>(ro), 0.0f);
    std::vector<int64_t> at(static_cast<size_t>(W), 0);  // next float per peer
    auto rows_of = [&](size_t k) { return rows_[k][u].data(); };
    if (to_canon) {  // pack this rank's pieces by row
      pieces_of(rank_, [&](const Piece& p) {
        float* dst = sendbuf.data() + sdispl[static_cast<size_t>(p.row)] + at[static_cast<size_t>(p.row)];
        for (size_t k = 0; k < K; ++k) std::copy_n(shard.data() + k * local_size + p.local, p.len, dst + k * p.len);
        at[static_cast<size_t>(p.row)] += p.len * static_cast<int64_t>(K);
      });
    } else {  // pack, from this rank's canonical row, every rank's pieces in it
      for (int q = 0; q < W; ++q)
        pieces_of(q, [&](const Piece& p) {
          if (p.row != rank_) return;
          float* dst = sendbuf.data() + sdispl[static_cast<size_t>(q)] + at[static_cast<size_t>(q)];
          for (size_t k = 0; k < K; ++k) std::copy_n(rows_of(k) + (p.canon - rank_ * S), p.len, dst + k * p.len);
          at[static_cast<size_t>(q)] += p.len * static_cast<int64_t>(K);
        });
    }
    const int rc = MPI_Alltoallv(sendbuf.data(), scount.data(), sdispl.data(), MPI_FLOAT, recvbuf.data(), rcount.data(),
                                 rdispl.data(), MPI_FLOAT, comm);
    if (rc != MPI_SUCCESS) throw std::runtime_error("MPI_Alltoallv failed moving unit '" + canon_.units[u].name + "'");
    std::fill(at.begin(), at.end(), 0);
    if (to_canon) {  // unpack every rank's pieces into this rank's row; the rest of the row is 0
      for (size_t k = 0; k < K; ++k) std::fill_n(rows_of(k), static_cast<size_t>(S), 0.0f);
      for (int q = 0; q < W; ++q)
        pieces_of(q, [&](const Piece& p) {
          if (p.row != rank_) return;
          const float* src = recvbuf.data() + rdispl[static_cast<size_t>(q)] + at[static_cast<size_t>(q)];
          for (size_t k = 0; k < K; ++k) std::copy_n(src + k * p.len, p.len, rows_of(k) + (p.canon - rank_ * S));
          at[static_cast<size_t>(q)] += p.len * static_cast<int64_t>(K);
        });
    } else {  // unpack this rank's pieces from their rows into its shard (padding stays 0)
      pieces_of(rank_, [&](const Piece& p) {
        const float* src = recvbuf.data() + rdispl[static_cast<size_t>(p.row)] + at[static_cast<size_t>(p.row)];
        for (size_t k = 0; k < K; ++k) std::copy_n(src + k * p.len, p.len, shard.data() + k * local_size + p.local);
        at[static_cast<size_t>(p.row)] += p.len * static_cast<int64_t>(K);
      });
      for (size_t k = 0; k < K; ++k)
        for (const int lu : contrib_[u])
          local.backend->from_host(local.tensors[k].shards[static_cast<size_t>(lu)],
                                   shard.data() + k * local_size + lbase[static_cast<size_t>(lu)],
                                   static_cast<size_t>(mine.units[static_cast<size_t>(lu)].shard_size));
    }
  }
}

}  // namespace shardtrain
