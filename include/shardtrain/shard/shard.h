// shardtrain sharding layer: the shard plan (units, flat layout, per-rank start / valid / padding),
// the sharded state (each rank's parameter and gradient shards), and the FSDP (ZeRO-3) unit
// pipeline that gathers a unit for compute and reduce-scatters its gradient through a codec (the
// dtype a unit travels in), on CommQueues (a host lane for MPI, a stream lane for NCCL).
//
// Layout (the same idea as llm.c's single flat parameter buffer, one per unit):
//   A unit's parameters are concatenated, in declaration order, into one flat buffer of `numel`
//   elements. It is padded with zeros to `padded_numel` = S * W where S = ceil(numel / W) (at
//   least 1) and W is the world size. Rank r owns flat elements [r*S, (r+1)*S): its shard. Of
//   those, `valid` = clamp(numel - r*S, 0, S) are real parameters and `padding` = S - valid are
//   zeros. A rank whose shard is all padding (valid = 0, e.g. 2 elements over 4 ranks) still
//   takes part in every all-gather and reduce-scatter of that unit.
//
// The layer's parts, one header each (included here, so that a caller may include this one):
//   shard_plan.h          ShardPlan, UnitSpec, ParamSpec, TpSlice, reduce_slab
//   comm_queue.h          CommQueue, HostCommQueue, StreamCommQueue, CommProgress, OverlapConfig, CommTimes
//   unit_source.h         UnitSource<C>, the model's interface to the units
//   tensor_parallel_ops.h TensorParallelOps<C>, the model's interface to TP (TpGroup: tensor_parallel.h)
//   sharded_state.h       ShardedState<T>, counter_normal
//   codec.h               UnitCodec<C>, IdentityCodec<T>, Bf16Codec
//   unit_pipeline.h       UnitPipeline<C>, Fsdp<T>, MixedPrecisionUnits
#pragma once

#include "shardtrain/shard/codec.h"
#include "shardtrain/shard/comm_queue.h"
#include "shardtrain/shard/shard_plan.h"
#include "shardtrain/shard/sharded_state.h"
#include "shardtrain/shard/tensor_parallel_ops.h"
#include "shardtrain/shard/unit_pipeline.h"
#include "shardtrain/shard/unit_source.h"
