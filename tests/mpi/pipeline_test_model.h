// The model and data of the pipeline MPI tests (test_pipeline.cpp, test_pp_reshard.cpp): a small
// Llama of 8 blocks (pp 4 x v 2 interleaved: 8 chunks of one block), GQA, byte-level vocabulary, and
// a token file each rank writes for itself (the same bytes) with a validation split.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "shardtrain/model/config.h"
#include "shardtrain/data/data.h"
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

}  // namespace shardtrain::testing
