// Batch geometry (geometry.h): every dimension's divisibility rule, once.
#include "shardtrain/parallel/geometry.h"

#include <cstdint>
#include <stdexcept>

#include "shardtrain/model/model.h"  // check_tensor_parallel

namespace shardtrain {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

// The ranks that read different rows, named for a message: the world size when every rank does.
std::string dp_what(const MeshDims& d) {
  if (d.dp() == d.world()) return "the world size (" + str(d.dp()) + ")";
  std::string how = "world " + str(d.world());
  if (d.cp > 1) how += " / cp " + str(d.cp);
  if (d.tp > 1) how += " / tp " + str(d.tp);
  return "the data-parallel size (" + how + " = " + str(d.dp()) + ")";
}

}  // namespace

CpComm parse_cp_comm(const std::string& s) {
  if (s == "ring") return CpComm::Ring;
  if (s == "allgather") return CpComm::AllGather;
  throw std::invalid_argument("option '--cp-comm' must be ring or allgather, got '" + s + "'");
}

const char* cp_comm_name(CpComm c) { return c == CpComm::Ring ? "ring" : "allgather"; }

GeometryResult resolve_geometry(const BatchOptions& o, const MeshDims& dims, const ModelConfig& mc) {
  GeometryResult r;
  BatchGeometry& g = r.geometry;
  auto refuse = [&r](std::string why) {
    r.refusal = std::move(why);
    return r;
  };
  g.dims = dims;
  g.seq_len = o.seq_len;
  g.dp = dims.dp();
  if (o.seq_len < 1) return refuse("option '--seq-len' must be >= 1, got " + str(o.seq_len));
  if (o.seq_len > mc.max_position_embeddings)
    return refuse("option '--seq-len' (" + str(o.seq_len) + ") exceeds the model's max_position_embeddings (" +
                       str(mc.max_position_embeddings) + ")");
  if (dims.cp > 1 && o.seq_len % (2 * dims.cp) != 0)
    return refuse("option '--seq-len' (" + str(o.seq_len) + ") is not divisible by 2 x '--cp' (2 x " + str(dims.cp) +
                  " = " + str(2 * dims.cp) + "): the head-tail split of context parallelism cuts every sequence into 2 x " +
                  str(dims.cp) + " equal chunks");
  if (o.global_batch < 1 || o.global_batch % g.dp != 0)
    return refuse("option '--global-batch' (" + str(o.global_batch) + ") is not divisible by " + dp_what(dims));
  g.per_rank = static_cast<int>(o.global_batch / g.dp);  // <= the micro-batch or --global-batch: an int
  g.micro_batch = o.micro_batch > 0 ? o.micro_batch : g.per_rank;
  if (g.per_rank % g.micro_batch != 0)
    return refuse("option '--global-batch' (" + str(o.global_batch) + ") is not divisible by " +
                       (g.dp == dims.world() ? "world size" : "data-parallel size") + " x '--micro-batch' (" +
                       str(g.dp) + " x " + str(g.micro_batch) + ")");
  g.accum = g.per_rank / g.micro_batch;
  if (std::string why = check_tensor_parallel(mc, dims.tp); !why.empty()) return refuse(std::move(why));
  // Mixture of experts (issue 56, docs/moe.md): the load-balancing loss pools a sequence's rows over
  // every MoE block, across CP ranks and pipeline stages (its statistics travel with the activations).
  if (dims.ep > 1 && !mc.is_moe())
    return refuse("option '--ep' (" + str(dims.ep) + ") needs a mixture-of-experts model; " + mc.architecture +
                  " is dense");
  if (dims.ep > 1 && mc.num_experts % dims.ep != 0)
    return refuse("option '--ep' (" + str(dims.ep) + ") does not divide num_experts (" + str(mc.num_experts) +
                  "): every rank of an EP group computes num_experts / ep experts");
  if (mc.is_moe() && g.cp_tokens() * mc.num_experts_per_tok * dims.ep > INT32_MAX)
    return refuse("a micro-batch of " + str(g.micro_batch) + " x " + str(o.seq_len) + " tokens routes " +
                  std::to_string(g.cp_tokens() * mc.num_experts_per_tok) + " slots (x num_experts_per_tok " +
                  str(mc.num_experts_per_tok) + ")" +
                  (dims.ep > 1 ? ", x '--ep' " + str(dims.ep) + " rows that a rank's experts may get" : std::string()) +
                  ", more than 2^31: lower '--micro-batch' or '--seq-len'");
  if (g.cp_tokens() % dims.tp != 0)
    return refuse("option '--tp' (" + str(dims.tp) + ") does not divide the tokens of a micro-batch (" +
                       str(g.micro_batch) + " x " + str(o.seq_len) +
                       (dims.cp > 1 ? " / cp " + str(dims.cp) + " = " + str(g.cp_tokens()) + " held by a CP rank"
                                    : " = " + str(g.micro_tokens())) +
                       "): sequence parallelism splits them evenly over the TP group");
  return r;
}

}  // namespace shardtrain
