// The model-level MPI tests' expert parallelism (test_moe.cpp, test_sft.cpp): a model's units at
// EP index ep_rank of ep (llama_units: under ep > 1 the experts are units of their own, sharded
// over the expert shard group), their state and the model's unit source over it, as the parallel
// layer builds them (parallelize: one UnitPipeline per unit group), on `comm`, whose ranks form EP
// groups of `ep` consecutive ranks (EP index = rank % ep; the expert shard group: the ranks of one
// EP index). canonical_param gathers a parameter whole, an expert tensor from its EP group's slices.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "shardtrain/model/model.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard.h"

namespace ep_test {

namespace st = shardtrain;

template <typename T> struct EpUnits {
  std::unique_ptr<st::MpiComm> experts, group;  // the expert shard group and the EP group (ep > 1)
  std::unique_ptr<st::ShardedState<T>> state;
  std::unique_ptr<st::UnitSource<T>> src;
  int ep = 1;

  EpUnits(st::Backend<T>& be, st::Comm& comm, const st::ModelConfig& mc, int ep_size) : ep(ep_size) {
    const int W = comm.world_size(), r = comm.rank();
    if (ep > 1) {
      experts = std::make_unique<st::MpiComm>(st::MpiComm::split(comm, r % ep, r));
      group = std::make_unique<st::MpiComm>(st::MpiComm::split(comm, r / ep, r));
    }
    state = std::make_unique<st::ShardedState<T>>(
        be, comm, st::ShardPlan::build(st::llama_units(mc, 1, 0, ep, r % ep), W, ep > 1 ? W / ep : 0), &comm, nullptr,
        experts.get());
    std::vector<std::unique_ptr<st::UnitPipeline<T>>> lanes;
    for (int g = 0; g < state->num_groups(); ++g)
      lanes.push_back(std::make_unique<st::UnitPipeline<T>>(be, std::make_unique<st::IdentityCodec<T>>(*state, g)));
    src = st::group_sources(std::move(lanes), state->plan());
  }

  // Collective over the world: the whole canonical parameter `name` (an expert tensor under ep > 1:
  // the EP group's slices in EP index order, which is the canonical [E, ...] order).
  std::vector<T> canonical_param(const std::string& name) {
    std::vector<T> mine = state->gather_param(name);
    if (ep == 1 || name.find(".mlp.experts.") == std::string::npos) return mine;
    std::vector<T> all(mine.size() * static_cast<size_t>(ep));
    group->all_gather(mine.data(), all.data(), mine.size());
    return all;
  }
};

}  // namespace ep_test
