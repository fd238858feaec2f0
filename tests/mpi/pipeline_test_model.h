// The model and data of the pipeline MPI tests (test_pipeline.cpp, test_pp_reshard.cpp, test_sft.cpp): a small
// Llama of 8 blocks (pp 4 x v 2 interleaved: 8 chunks of one block), GQA, byte-level vocabulary, and
// a token file each rank writes for itself (the same bytes) with a validation split; their float64
// gradients gathered whole and compared.
#pragma once

#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "shardtrain/model/config.h"
#include "shardtrain/data/data.h"
#include "shardtrain/shard/shard.h"
#include "../test_env.h"

namespace shardtrain::testing {

inline ModelConfig pipeline_test_config(bool tied, const std::string& name) {
  ModelConfig c;
  c.name = name;
  c.vocab_size = 258;
  c.hidden_size = 32;
  c.intermediate_size = 56;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;  // GQA
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = tied;
  c.bos_token_id = 256;
  c.eos_token_ids = {257};
  return c;
}

// /tmp/shardtrain-<tag>-<mpirun's pid>-<rank>/a.tok, written by this rank.
inline std::string pipeline_test_tokens(const std::string& tag) {
  const int r = comm().rank();
  const std::string dir = "/tmp/shardtrain-" + tag + "-" + std::to_string(getppid()) + "-" + std::to_string(r);
  std::filesystem::create_directories(dir);
  {
    std::ofstream t(dir + "/a.txt");
    for (int i = 0; i < 400; ++i) t << "line " << i * 7919 % 1000 << " of the " << tag << ", " << (i % 13) << "\n";
  }
  prepare_token_file({dir + "/a.txt"}, dir + "/a.tok", 0.2);
  return dir + "/a.tok";
}

// Every parameter's whole gradient of `f` by name: the gradient shards copied over the parameter
// shards (which they replace), then gathered as parameters. Collective over f's data communicator.
inline std::map<std::string, std::vector<double>> whole_grads(ShardedState<double>& f) {
  std::map<std::string, std::vector<double>> g;
  for (int u = 0; u < f.num_units(); ++u)
    std::copy(f.grad_shard(u), f.grad_shard(u) + f.plan().units[static_cast<size_t>(u)].shard_size, f.param_shard(u));
  for (const auto& up : f.plan().units)
    for (const auto& p : up.params) g[p.spec.name] = f.gather_param(p.spec.name);
  return g;
}

// Every parameter's gradient of `got` within 1e-12 of the largest element of the same parameter's
// in `ref` (which is not all zero); returns how many parameters were compared.
inline int expect_same_grads(const std::map<std::string, std::vector<double>>& got,
                             const std::map<std::string, std::vector<double>>& ref) {
  int n = 0;
  for (const auto& [name, g] : got) {
    const auto it = ref.find(name);
    if (it == ref.end() || g.size() != it->second.size()) {
      ADD_FAILURE() << name << ": not in the reference's gradients, or of another size";
      continue;
    }
    double worst = 0, scale = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      worst = std::max(worst, std::abs(g[i] - it->second[i]));
      scale = std::max(scale, std::abs(it->second[i]));
    }
    EXPECT_GT(scale, 0.0) << name;
    EXPECT_LE(worst, 1e-12 * scale) << name << ": worst difference " << worst << " of " << scale;
    ++n;
  }
  return n;
}

}  // namespace shardtrain::testing
