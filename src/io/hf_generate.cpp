// Text generation (hf.h, --mode generate): a checkpoint's model, its prompt as token ids (from
// --prompt-ids, the checkpoint's SentencePiece tokenizer or shardtrain's byte-level one), greedy
// or temperature / top-k sampling until an eos id or --max-new-tokens.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "hf_internal.h"
#include "shardtrain/data/data.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/io/hf.h"
#include "shardtrain/model/model.h"
#include "shardtrain/runtime/files.h"

namespace shardtrain {

using hf::Loaded;
using hf::load_model;

std::string generate(Comm& comm, const GenerateOptions& o) {
  Loaded l = load_model(comm, o.checkpoint);
  if (!l.mc.has_bos())  // same metadata on every rank: the same decision
    throw CollectiveError(0, "checkpoint '" + o.checkpoint + "': the model config has no bos_token_id (and the "
                             "checkpoint records no token file to take it from); --mode generate starts from BOS. "
                             "Import with '--data TOKENFILE' to take the ids from a token file");
  LlamaModel<float> model(l.mc, *l.be);
  const int V = l.mc.vocab_size, maxT = l.mc.max_position_embeddings;
  // The checkpoint's own tokenizer when it records a SentencePiece one (same bytes on every rank).
  std::unique_ptr<Tokenizer> sp;
  if (l.tokenizer.kind == "sentencepiece") {
    try {
      sp = tokenizer_from_info(l.tokenizer, "checkpoint '" + o.checkpoint + "'");
    } catch (const std::exception& e) {
      throw CollectiveError(0, e.what());
    }
  }
  std::vector<int32_t> ids = {l.mc.bos_token_id};
  if (!o.prompt_ids.empty()) {  // same text on every rank: the same decision
    std::stringstream ss(o.prompt_ids);
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != item.size() || v < 0 || v >= V)
        throw CollectiveError(0, "option '--prompt-ids': '" + item + "' is not a token id in [0, " + std::to_string(V) +
                                     ") (give comma-separated integers)");
      ids.push_back(static_cast<int32_t>(v));
    }
  } else if (sp) {
    const std::vector<int32_t> p = sp->encode(o.prompt);
    ids.insert(ids.end(), p.begin(), p.end());
  } else if (l.tokenizer.kind == "hf-tokenizers") {
    if (!o.prompt.empty())
      throw CollectiveError(0, "option '--prompt': checkpoint '" + o.checkpoint + "' has a Hugging Face tokenizer.json "
                               "tokenizer, which shardtrain cannot run; give the prompt as '--prompt-ids' (ids from "
                               "scripts/tokenize_hf.py or AutoTokenizer) or generate with transformers on the export");
  } else {
    for (int32_t b : ByteTokenizer::encode(o.prompt)) ids.push_back(b);
  }
  if (static_cast<int>(ids.size()) > maxT)  // same decision on every rank
    throw CollectiveError(0, "option '--prompt': BOS + " + std::to_string(ids.size() - 1) + " bytes exceed the model's " +
                                 "max_position_embeddings (" + std::to_string(maxT) + ")");
  if (!o.dump_logits.empty()) {
    model.forward(*l.f, ids.data(), 1, static_cast<int>(ids.size()));
    model.head_logits(*l.f);
    std::vector<float> lg = model.logits();
    std::string err;
    if (comm.rank() == 0) {
      try {
        write_file_atomic(o.dump_logits, std::string(reinterpret_cast<const char*>(lg.data()), lg.size() * sizeof(float)),
                          false, "option '--dump-logits'");
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    all_ok(comm, err.empty(), err);
  }
  std::mt19937_64 rng(o.seed);
  std::vector<int32_t> out;
  for (int i = 0; i < o.max_new_tokens; ++i) {
    size_t T = std::min(ids.size(), static_cast<size_t>(maxT));
    const int32_t* ctx = ids.data() + (ids.size() - T);
    model.forward(*l.f, ctx, 1, static_cast<int>(T));
    model.head_logits(*l.f);
    int64_t next = 0;
    if (comm.rank() == 0) {
      std::vector<float> lg = model.logits();
      const float* last = lg.data() + (T - 1) * static_cast<size_t>(V);
      if (o.temperature <= 0) {
        next = std::max_element(last, last + V) - last;
      } else {
        std::vector<std::pair<float, int>> c;
        for (int v = 0; v < V; ++v) c.push_back({last[v], v});
        std::sort(c.begin(), c.end(), std::greater<>());
        if (o.top_k > 0 && o.top_k < V) c.resize(static_cast<size_t>(o.top_k));
        std::vector<double> w;
        for (auto& [lv, v] : c) w.push_back(std::exp((lv - c[0].first) / o.temperature));
        std::discrete_distribution<size_t> dist(w.begin(), w.end());
        next = c[dist(rng)].second;
      }
    }
    comm.broadcast(&next, 1, 0);
    // Any id of the export's generation_config.json eos_token_id stops: the model's eos ids, the
    // end-of-turn ids of its chat data, a carried generation_config.json's.
    if (std::find(l.generation_eos.begin(), l.generation_eos.end(), next) != l.generation_eos.end()) break;
    ids.push_back(static_cast<int32_t>(next));
    out.push_back(static_cast<int32_t>(next));
  }
  if (o.print_ids) {
    auto list = [](const int32_t* p, size_t n) {
      std::string r;
      for (size_t i = 0; i < n; ++i) {
        if (i) r += ',';
        r += std::to_string(p[i]);
      }
      return r;
    };
    log_info(comm, "generate: prompt ids: " + list(ids.data(), ids.size() - out.size()));
    log_info(comm, "generate: new ids: " + list(out.data(), out.size()));
  }
  if (sp) return sp->decode(out);
  if (l.tokenizer.kind == "hf-tokenizers") return "";  // ids only (--print-ids); decode with AutoTokenizer
  return ByteTokenizer::decode(out);
}

}  // namespace shardtrain
