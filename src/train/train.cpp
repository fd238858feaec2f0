// AdamW on shards, the LR schedule, evaluation, and the checkpoint's record of the settings. The
// training loop is in trainer.cpp; what a resume checks is in resume.cpp.
#include "shardtrain/train/train.h"

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/files.h"
#include "shardtrain/train/memory_plan.h"
#include "shardtrain/parallel/parallelize.h"  // SequenceSplit
#include "shardtrain/parallel/schedule.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace shardtrain {

double mean_loss_grad_scale(double tokens_per_step, double targets, double rank_tokens) {
  return tokens_per_step / targets / rank_tokens;
}

double lr_at(const TrainConfig& tc, int64_t s) {
  if (s < tc.warmup) return tc.lr * static_cast<double>(s + 1) / static_cast<double>(tc.warmup);
  int64_t decay_steps = std::max<int64_t>(1, tc.steps - tc.warmup);
  double p = std::min(1.0, static_cast<double>(s - tc.warmup) / static_cast<double>(decay_steps));
  return tc.min_lr + 0.5 * (1.0 + std::cos(M_PI * p)) * (tc.lr - tc.min_lr);
}


std::string train_config_json(const TrainConfig& tc, int world_size, int shard_group_size, int tp) {
  const std::string precision = (tc.precision == Precision::FP32 ? std::string("fp32")
                                 : tc.reduce_bf16               ? std::string("bf16 (bf16 gradient reduce)")
                                                                : std::string("bf16 (fp32 gradient reduce)")) +
                                (tc.fp8 ? std::string(", fp8 block GEMMs") : std::string());
  nlohmann::json j({{"seq_len", tc.seq_len}, {"global_batch", tc.global_batch}, {"micro_batch", tc.micro_batch},
                         {"steps", tc.steps}, {"lr", tc.lr}, {"min_lr", tc.min_lr}, {"warmup", tc.warmup},
                         {"beta1", tc.beta1}, {"beta2", tc.beta2}, {"eps", tc.eps}, {"weight_decay", tc.weight_decay},
                         {"clip", tc.clip}, {"seed", tc.seed}, {"precision", precision}});
  if (world_size > 0) {  // the run's layout (hybrid sharding): informational, not compared on resume
    j["world_size"] = world_size;
    j["shard_group_size"] = shard_group_size > 0 ? shard_group_size : world_size;
  }
  if (tp > 1) j["tp"] = tp;
  if (tc.attention_mask == AttentionMask::Document) j["attention_mask"] = attention_mask_name(tc.attention_mask);
  if (tc.aux_scope == MoeAuxScope::MicroBatch) j["aux_loss_scope"] = aux_scope_name(tc.aux_scope);
  if (tc.router_z_loss_coef != 0) j["router_z_loss_coef"] = tc.router_z_loss_coef;
  if (tc.examples) {  // what is trained on (absent: plain data, every token a target)
    j["train_on"] = train_on_name(tc.train_on);
    j["pack"] = pack_mode_name(tc.pack);
    j["max_length_policy"] = max_length_policy_name(tc.max_length);
    j["shuffle"] = tc.shuffle ? "on" : "off";
  }
  return j.dump();
}

template <typename T> AdamW<T>::AdamW(ShardedState<T>& f, const TrainConfig& tc) : f_(f), tc_(tc) {
  const ShardPlan& plan = f.plan();
  for (int u = 0; u < f.num_units(); ++u) {
    const UnitPlan& up = plan.units[u];
    m_.emplace_back(f.backend(), static_cast<size_t>(up.shard_size));
    v_.emplace_back(f.backend(), static_cast<size_t>(up.shard_size));
    const RankShard& rs = up.ranks[static_cast<size_t>(f.unit_rank(u))];
    for (const auto& slot : up.params) {
      int64_t lo = std::max(slot.offset, rs.start), hi = std::min(slot.offset + slot.numel, rs.start + rs.valid);
      if (hi > lo) segs_.push_back({u, lo - rs.start, hi - lo, slot.spec.weight_decay});
    }
  }
}

template <typename T> void AdamW<T>::step(int64_t t, double lr, double grad_scale) {
  Backend<T>& be = f_.backend();
  using S = typename Backend<T>::S;
  for (const auto& s : segs_) {
    size_t b = static_cast<size_t>(s.begin);
    be.adamw(f_.param_shard(s.unit) + b, m_[s.unit].data() + b, v_[s.unit].data() + b, f_.grad_shard(s.unit) + b,
             static_cast<size_t>(s.count), static_cast<S>(lr), static_cast<S>(tc_.beta1), static_cast<S>(tc_.beta2),
             static_cast<S>(tc_.eps), s.decay ? static_cast<S>(tc_.weight_decay) : S(0), static_cast<S>(grad_scale), t);
  }
}

std::string check_attention_mask(const TrainConfig& tc, const TokenDataset& data) {
  if (tc.attention_mask != AttentionMask::Document || tc.examples) return "";  // examples: documents are examples
  // Every file must name the EOS (llm.c and nanoGPT files name none even beside a file that does:
  // their documents would not end at the merged header's id).
  const bool merged_eos = data.header().eos_id != kNoTokenId;
  std::string files;
  for (const TokenFileEntry& e : data.files())
    if (!merged_eos || !e.known_vocab) files += (files.empty() ? "'" : ", '") + e.path + "' (" + e.format + ")";
  if (files.empty()) return "";
  return "option '--attention-mask document' needs the data's EOS id (documents end at it), but the token data " +
         files + " names none: give data prepared with an EOS (shardtrain token files with an eos_id) or use "
         "'--attention-mask causal'";
}

TokenLayout batch_layout(const TrainConfig& tc, const TokenDataset& data, const int32_t* tokens, int B, int T,
                         std::vector<int32_t>& pos, std::vector<int32_t>& doc) {
  if (tc.attention_mask != AttentionMask::Document) return {};
  pos.resize(static_cast<size_t>(B) * T);
  doc.resize(pos.size());
  document_layout(tokens, B, T, T, static_cast<int32_t>(data.header().eos_id), doc.data(), pos.data());
  return {pos.data(), doc.data()};
}

MicroBatchReader batch_reader(std::shared_ptr<const PackedBatches> batches) {
  auto pos = std::make_shared<std::vector<int32_t>>(), doc = std::make_shared<std::vector<int32_t>>();
  auto real = std::make_shared<std::vector<int32_t>>();  // padding flags (MoE's load-balancing loss)
  return [batches, pos, doc, real](Split split, int64_t index, int first, int count, int32_t* tokens,
                                   int32_t* targets) {
    const size_t n = static_cast<size_t>(count) * static_cast<size_t>(batches->stream(split).seq_len());
    pos->resize(n);
    doc->resize(n);
    real->resize(n);
    batches->fill(split, index, first, count, tokens, targets, doc->data(), pos->data(), real->data());
    return TokenLayout{pos->data(), doc->data(), real->data()};
  };
}

std::string apply_data_settings(TrainConfig& tc, const TokenDataset& data, const DataOptionsGiven& given,
                                std::string* note) {
  if (!given.train_on.empty()) tc.train_on = parse_train_on(given.train_on);
  if (!given.pack.empty()) tc.pack = parse_pack_mode(given.pack);
  if (!given.max_length_policy.empty()) tc.max_length = parse_max_length_policy(given.max_length_policy);
  if (!given.shuffle.empty()) {
    if (given.shuffle != "on" && given.shuffle != "off")
      throw std::invalid_argument("option '--shuffle' must be on or off, got '" + given.shuffle + "'");
    tc.shuffle = given.shuffle == "on";
  }
  const std::string file = "token file '" + data.path() + "' (" + data.files().front().format + ")";
  if (!data.has_examples()) {
    tc.examples = false;
    std::string opt;
    if (!given.train_on.empty() && tc.train_on == TrainOn::Assistant) opt = "--train-on " + given.train_on;
    else if (!given.pack.empty()) opt = "--pack";
    else if (!given.max_length_policy.empty()) opt = "--max-length-policy";
    else if (!given.shuffle.empty()) opt = "--shuffle";
    if (opt.empty()) return "";
    return "option '" + opt + "' applies to example data (chat or prompt/completion examples with role classes, token "
           "format version 3, written by scripts/tokenize_hf.py), but " + file + " has none: every token is a "
           "target there (" + (opt.starts_with("--train-on") ? "use '--train-on all', or" : "leave the option out, or") +
           " tokenize the examples with scripts/tokenize_hf.py)";
  }
  tc.examples = true;
  if (given.attention_mask.empty() && tc.attention_mask != AttentionMask::Document) {
    tc.attention_mask = AttentionMask::Document;
    if (note)
      *note = "data: example data: '--attention-mask document' (each example its own document: positions restart "
              "and attention stays inside it)";
  }
  if (tc.pack == PackMode::BestFit && tc.attention_mask != AttentionMask::Document)
    return "option '--attention-mask causal' with packed example data (" + file + ") would let each example attend "
           "to the examples packed before it: leave '--attention-mask' out (document is the default for example "
           "data) or give '--pack none' (one example per row)";
  return "";
}

MicroBatchReader batch_reader(const TrainConfig& tc, const TokenDataset& data) {
  auto pos = std::make_shared<std::vector<int32_t>>(), doc = std::make_shared<std::vector<int32_t>>();
  return [tc, &data, pos, doc](Split split, int64_t index, int first, int count, int32_t* tokens, int32_t* targets) {
    fill_batch(data, split, tc.seed, index, first, count, tc.seq_len, tokens, targets);
    return batch_layout(tc, data, tokens, count, tc.seq_len, *pos, *doc);
  };
}

template <typename T>
double evaluate(const Mesh& mesh, StageRunner<T>& runner, UnitSource<T>& f, const Schedule& schedule,
                const TrainConfig& tc, int batches, const PackedBatches* packed) {
  double sum = 0, targets = 0;
  f.begin_pass("eval");  // the sharding layer prefetches along the order the last evaluation gathered in
  for (int e = 0; e < batches; ++e) {
    runner.begin(Split::Val, e);
    // The last chunk's forwards with their loss. A TP group's ranks computed the same loss: counted
    // once; a CP group's hold different tokens: each counts (Mesh::counts_loss, last stage only).
    const double l = runner.run(schedule, 0.0f);
    if (mesh.counts_loss()) sum += l;
    runner.end();
    targets += packed ? static_cast<double>(packed->batch_targets(Split::Val, e))
                      : static_cast<double>(tc.global_batch) * tc.seq_len;
  }
  f.end_pass();
  mesh.world().all_reduce(&sum, 1, ReduceOp::Sum);
  if (packed) return targets > 0 ? sum / targets : 0.0;
  return sum / (static_cast<double>(batches) * tc.global_batch * tc.seq_len);  // as before: bitwise
}

StragglerStats straggler_stats(const std::vector<double>& compute_ms, const std::vector<double>& wait_ms,
                               double threshold) {
  if (compute_ms.size() != wait_ms.size()) throw std::invalid_argument("straggler_stats: sizes differ");
  StragglerStats st;
  if (compute_ms.empty()) return st;
  auto summary = [](std::vector<double> v, double& lo, double& med, double& hi) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    lo = v.front();
    hi = v.back();
    med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  summary(compute_ms, st.compute_min, st.compute_median, st.compute_max);
  summary(wait_ms, st.wait_min, st.wait_median, st.wait_max);
  st.slowest = static_cast<int>(std::max_element(compute_ms.begin(), compute_ms.end()) - compute_ms.begin());
  st.flagged = compute_ms.size() > 1 && st.compute_max > threshold * st.compute_median;
  return st;
}

double flops_per_token(const ModelConfig& c, int T) {
  // train.h has the formula and why. N leaves out an untied input embedding (a lookup, no FLOPs).
  const double lookup = c.tie_word_embeddings ? 0.0 : static_cast<double>(c.vocab_size) * c.hidden_size;
  const double N = static_cast<double>(c.num_active_params()) - lookup;  // MoE: the experts a token uses
  // H Q: the query width num_attention_heads x head_dim, not hidden_size when head_dim is given.
  const double HQ = static_cast<double>(c.num_attention_heads) * c.head_dim();
  return 6.0 * N + 12.0 * c.num_hidden_layers * HQ * static_cast<double>(T);
}

ModelOptions model_options(const TrainConfig& tc) {
  ModelOptions o;
  o.recompute = tc.recompute;
  o.attention = tc.attention;
  o.mask = tc.attention_mask;
  o.aux_scope = tc.aux_scope;
  if (tc.loss_chunk < 0) throw std::invalid_argument("option '--loss-chunk' must be >= 0 (0: the default)");
  o.loss_chunk = tc.loss_chunk;
  o.fp8 = tc.fp8;
  return o;
}

Precision parse_precision(const std::string& s, bool* fp8) {
  if (fp8) *fp8 = s == "fp8";
  if (s == "fp32") return Precision::FP32;
  if (s == "bf16" || s == "fp8") return Precision::BF16;
  throw std::invalid_argument("option '--precision' must be fp32, bf16 or fp8, got '" + s + "'");
}

const char* precision_name(Precision p) { return p == Precision::BF16 ? "bf16" : "fp32"; }


ShardedTensors checkpoint_tensors(ShardedState<float>& f, AdamW<float>* opt) {
  ShardedTensors t = sharded_params(f);
  if (!opt) return t;
  ShardedTensor m{"adam_m", {}}, v{"adam_v", {}};
  for (int u = 0; u < f.num_units(); ++u) {
    m.shards.push_back(opt->m()[u].data());
    v.shards.push_back(opt->v()[u].data());
  }
  t.tensors.push_back(std::move(m));
  t.tensors.push_back(std::move(v));
  return t;
}

template class AdamW<float>;
template class AdamW<double>;
template double evaluate<float>(const Mesh&, StageRunner<float>&, UnitSource<float>&, const Schedule&,
                                const TrainConfig&, int, const PackedBatches*);
template double evaluate<bf16>(const Mesh&, StageRunner<bf16>&, UnitSource<bf16>&, const Schedule&,
                               const TrainConfig&, int, const PackedBatches*);

}  // namespace shardtrain
