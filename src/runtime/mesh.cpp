// The device mesh (mesh.h): layout arithmetic, the split of the world into groups, the topology line.
#include "shardtrain/runtime/mesh.h"

#include <stdexcept>

namespace shardtrain {

MeshLayout::MeshLayout(MeshDims d) : d_(d) {
  if (d.dp_replicate < 1 || d.dp_shard < 1 || d.cp < 1 || d.tp < 1 || d.pp < 1 || d.ep < 1)
    throw std::invalid_argument("mesh: every dimension must be >= 1 (pp " + std::to_string(d.pp) + ", dp_replicate " +
                                std::to_string(d.dp_replicate) + ", dp_shard " + std::to_string(d.dp_shard) + ", cp " +
                                std::to_string(d.cp) + ", tp " + std::to_string(d.tp) + ", ep " + std::to_string(d.ep) + ")");
  if (d.fsdp() % d.ep != 0)
    throw std::invalid_argument("mesh: ep " + std::to_string(d.ep) + " does not divide the FSDP shard group (dp_shard " +
                                std::to_string(d.dp_shard) + " x cp " + std::to_string(d.cp) + ")");
}

MeshCoord MeshLayout::coord(int rank) const {
  MeshCoord c;
  c.tp = rank % d_.tp;
  rank /= d_.tp;
  c.cp = rank % d_.cp;
  rank /= d_.cp;
  c.dp_shard = rank % d_.dp_shard;
  rank /= d_.dp_shard;
  c.dp_replicate = rank % d_.dp_replicate;
  c.pp = rank / d_.dp_replicate;
  return c;
}

int MeshLayout::rank_of(const MeshCoord& c) const {
  return (((c.pp * d_.dp_replicate + c.dp_replicate) * d_.dp_shard + c.dp_shard) * d_.cp + c.cp) * d_.tp + c.tp;
}

int MeshLayout::dp_index(int rank) const {
  const MeshCoord c = coord(rank);
  return c.dp_replicate * d_.dp_shard + c.dp_shard;
}

std::vector<int> MeshLayout::shard_group(int rank) const {
  MeshCoord c = coord(rank);
  std::vector<int> v;
  for (c.dp_shard = 0; c.dp_shard < d_.dp_shard; ++c.dp_shard)
    for (c.cp = 0; c.cp < d_.cp; ++c.cp) v.push_back(rank_of(c));  // rank order: cp varies faster
  return v;
}

int MeshLayout::shard_index(int rank) const {
  const MeshCoord c = coord(rank);
  return c.dp_shard * d_.cp + c.cp;
}

std::vector<int> MeshLayout::cp_group(int rank) const {
  MeshCoord c = coord(rank);
  std::vector<int> v;
  for (c.cp = 0; c.cp < d_.cp; ++c.cp) v.push_back(rank_of(c));
  return v;
}

std::vector<int> MeshLayout::ep_group(int rank) const {
  const std::vector<int> g = shard_group(rank);
  const size_t first = static_cast<size_t>(shard_index(rank) / d_.ep * d_.ep);
  return std::vector<int>(g.begin() + static_cast<std::ptrdiff_t>(first),
                          g.begin() + static_cast<std::ptrdiff_t>(first) + d_.ep);
}

std::vector<int> MeshLayout::expert_shard_group(int rank) const {
  const std::vector<int> g = shard_group(rank);
  std::vector<int> v;
  for (size_t i = static_cast<size_t>(ep_index(rank)); i < g.size(); i += static_cast<size_t>(d_.ep)) v.push_back(g[i]);
  return v;
}

std::vector<int> MeshLayout::pp_group(int rank) const {
  MeshCoord c = coord(rank);
  std::vector<int> v;
  for (c.pp = 0; c.pp < d_.pp; ++c.pp) v.push_back(rank_of(c));
  return v;
}

std::vector<int> MeshLayout::replica_group(int rank) const {
  MeshCoord c = coord(rank);
  std::vector<int> v;
  for (c.dp_replicate = 0; c.dp_replicate < d_.dp_replicate; ++c.dp_replicate) v.push_back(rank_of(c));
  return v;
}

std::vector<int> MeshLayout::tp_group(int rank) const {
  MeshCoord c = coord(rank);
  std::vector<int> v;
  for (c.tp = 0; c.tp < d_.tp; ++c.tp) v.push_back(rank_of(c));
  return v;
}

namespace {
MeshLayout checked_layout(const Comm& world, MeshDims d) {
  if (d.pp > 1 && d.dp_shard >= 1 && d.cp >= 1 && d.tp >= 1 && d.dp_replicate >= 1 && d.world() != world.world_size())  // pp is the outermost factor: name them all
    throw CollectiveError(0, "the mesh (pp " + std::to_string(d.pp) + " x dp_replicate " + std::to_string(d.dp_replicate) +
                                 " x dp_shard " + std::to_string(d.dp_shard) + " x cp " + std::to_string(d.cp) + " x tp " +
                                 std::to_string(d.tp) + " = " + std::to_string(d.world()) + " ranks) does not match the world size (" +
                                 std::to_string(world.world_size()) + ")");
  if (d.dp_shard < 1 || d.cp < 1 || d.tp < 1 || d.pp < 1 || d.world() != world.world_size())
    throw CollectiveError(0, "option '--shard-group-size' (" + std::to_string(d.fsdp() * d.tp) +
                                 ") does not divide the world size (" + std::to_string(world.world_size()) + ")");
  try {
    return MeshLayout(d);
  } catch (const std::invalid_argument& e) {  // the same dims on every rank: the same message
    throw CollectiveError(0, e.what());
  }
}
}  // namespace

Mesh::Mesh(Comm& world, const Topology& topo, MeshDims dims, double collective_timeout)
    : world_(world), topo_(topo), layout_(checked_layout(world, dims)), coord_(layout_.coord(world.rank())), collective_timeout_(collective_timeout) {
  // Colors: the group's first global rank (any value equal within a group and distinct across
  // groups); keys: the global rank, so a group's ranks keep the world's order. Every rank makes the
  // same splits (the dims are the same everywhere).
  const int r = world.rank();
  if (dims.tp > 1) {
    tp_host_ = std::make_unique<MpiComm>(MpiComm::split(world, layout_.tp_group(r).front(), r));
    tp_host_->set_collective_timeout(collective_timeout);
  }
  if (dims.cp > 1) {
    cp_host_ = std::make_unique<MpiComm>(MpiComm::split(world, layout_.cp_group(r).front(), r));
    cp_host_->set_collective_timeout(collective_timeout);
  }
  if (dims.pp > 1) {
    pp_host_ = std::make_unique<MpiComm>(MpiComm::split(world, layout_.pp_group(r).front(), r));
    pp_host_->set_collective_timeout(collective_timeout);
  }
  if (dims.ep > 1) {
    ep_host_ = std::make_unique<MpiComm>(MpiComm::split(world, layout_.ep_group(r).front(), r));
    ep_host_->set_collective_timeout(collective_timeout);
    eshard_host_ = std::make_unique<MpiComm>(MpiComm::split(world, layout_.expert_shard_group(r).front(), r));
    eshard_host_->set_collective_timeout(collective_timeout);
  }
  if (dims.fsdp() != world.world_size()) {  // else the shard group is the world
    shard_host_ = std::make_unique<MpiComm>(MpiComm::split(world, layout_.shard_group(r).front(), r));
    shard_host_->set_collective_timeout(collective_timeout);
  }
  if (dims.dp_replicate == 1) return;  // no replica group
  replica_host_ = std::make_unique<MpiComm>(MpiComm::split(world, layout_.replica_group(r).front(), r));
  replica_host_->set_collective_timeout(collective_timeout);
  // A shard group is meant to sit inside a node; with ranks not placed node by node it does not.
  const int G = dims.fsdp();
  int64_t ids[2] = {topo.node_id, -static_cast<int64_t>(topo.node_id)};
  shard_host_->all_reduce(ids, 2, ReduceOp::Max);
  int64_t spans = ids[0] != -ids[1] && G <= topo.min_local_size ? 1 : 0;
  world.all_reduce(&spans, 1, ReduceOp::Max);
  if (spans)
    note_ = "note: '--shard-group-size " + std::to_string(G) + "': some shard groups span several nodes "
            "although a node holds " + std::to_string(topo.min_local_size) + " or more ranks: the ranks are not "
            "placed node by node (use mpirun's --map-by slot or srun's block distribution), so gathers and "
            "reduce-scatters cross nodes";
}

Mesh::~Mesh() = default;

void Mesh::attach_device_comms(const std::function<std::unique_ptr<Comm>(Comm& host)>& make) {
  shard_dev_ = make(shard_host());
  if (replica_host_) replica_dev_ = make(*replica_host_);
  if (tp_host_) tp_dev_ = make(*tp_host_);
  if (cp_host_) cp_dev_ = make(*cp_host_);
  if (pp_host_) pp_dev_ = make(*pp_host_);
  if (ep_host_) ep_dev_ = make(*ep_host_);
  if (eshard_host_) eshard_dev_ = make(*eshard_host_);
}

std::string Mesh::topology_line() const {
  const Topology& t = topo_;
  // G: the ranks of an FSDP shard group (dp_shard x cp).
  const int W = t.world_size, G = dims().fsdp(), R = dims().dp_replicate, C = dims().cp;
  const std::string per = t.min_local_size == t.max_local_size
                              ? std::to_string(t.max_local_size)
                              : std::to_string(t.min_local_size) + "-" + std::to_string(t.max_local_size);
  std::string s = "topology: " + std::to_string(t.nodes) + (t.nodes == 1 ? " node x " : " nodes x ") + per +
                  (t.max_local_size == 1 ? " rank per node" : " ranks per node") + " (world " + std::to_string(W) + ")";
  const int N = dims().tp;
  if (N > 1)
    s += "; tensor parallel: " + std::to_string(W / N) + (W / N == 1 ? " TP group of " : " TP groups of ") +
         std::to_string(N) + " consecutive ranks (--tp " + std::to_string(N) + ", sequence parallel), FSDP over " +
         std::to_string(G) + (G == 1 ? " rank" : " ranks") + " of equal TP rank";
  if (C > 1)
    s += "; context parallel: " + std::to_string(W / C) + (W / C == 1 ? " CP group of " : " CP groups of ") +
         std::to_string(C) + " ranks (--cp " + std::to_string(C) + ", head-tail split of every sequence), FSDP over " +
         std::to_string(dims().dp_shard) + " x " + std::to_string(C) + " ranks (dp_shard x cp)";
  const int P = dims().pp;
  if (P > 1)
    s += "; pipeline parallel: " + std::to_string(P) + " stages of " + std::to_string(W / P) + " consecutive ranks (--pp " +
         std::to_string(P) + ")";
  const int E = dims().ep;
  if (E > 1)
    s += "; expert parallel: " + std::to_string(W / E) + (W / E == 1 ? " EP group of " : " EP groups of ") + std::to_string(E) +
         " ranks (--ep " + std::to_string(E) + ", inside the FSDP shard group)";
  if (R == 1 && N == 1 && P == 1)
    s += "; fully sharded over all " + std::to_string(W) + " ranks (shard group size " + std::to_string(G) + ")";
  else if (R == 1 && N == 1)
    s += "; fully sharded over the " + std::to_string(G) + " ranks of each stage (shard group size " + std::to_string(G) + ")";
  else if (R == 1)
    s += "; one replica (shard group size " + std::to_string(G * N) + " ranks: TP groups included)";
  else
    s += "; hybrid sharding: " + std::to_string(R) + " replica groups of " + std::to_string(G * N) +
         (G * N == 1 ? " rank" : " ranks") + " (shard group size " + std::to_string(G * N) + ")";
  if (t.emulated_ranks_per_node > 0)
    s += "; nodes emulated by SHARDTRAIN_TEST_RANKS_PER_NODE=" + std::to_string(t.emulated_ranks_per_node) + " (test hook)";
  return s;
}

int ranks_per_node(const Topology& t) { return t.min_local_size == t.max_local_size ? t.local_size : 0; }

}  // namespace shardtrain
