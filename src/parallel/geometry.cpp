// Batch geometry (geometry.h): every dimension's divisibility rule, once.
#include "shardtrain/geometry.h"

#include "shardtrain/model.h"  // check_tensor_parallel

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
  if (g.micro_tokens() % dims.tp != 0)
    return refuse("option '--tp' (" + str(dims.tp) + ") does not divide the tokens of a micro-batch (" +
                       str(g.micro_batch) + " x " + str(o.seq_len) + " = " + str(g.micro_tokens()) +
                       "): sequence parallelism splits them evenly over the TP group");
  return r;
}

}  // namespace shardtrain
