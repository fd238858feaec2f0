// AdamW on shards, LR schedule, and the training loop. The loop in train() reads as the algorithm:
// get batch, forward, backward (reduce-scatter), clip, step, log, evaluate.
#include "shardtrain/train.h"

#include "shardtrain/checkpoint.h"
#include "shardtrain/files.h"
#include "shardtrain/memory_plan.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

namespace shardtrain {

double lr_at(const TrainConfig& tc, int64_t s) {
  if (s < tc.warmup) return tc.lr * static_cast<double>(s + 1) / static_cast<double>(tc.warmup);
  int64_t decay_steps = std::max<int64_t>(1, tc.steps - tc.warmup);
  double p = std::min(1.0, static_cast<double>(s - tc.warmup) / static_cast<double>(decay_steps));
  return tc.min_lr + 0.5 * (1.0 + std::cos(M_PI * p)) * (tc.lr - tc.min_lr);
}

namespace {
// The settings a resume compares: option name -> train_config key.
const std::vector<std::pair<std::string, std::string>>& checked_keys() {
  static const std::vector<std::pair<std::string, std::string>> k = {
      {"seq-len", "seq_len"}, {"global-batch", "global_batch"}, {"steps", "steps"},     {"lr", "lr"},
      {"min-lr", "min_lr"},   {"warmup", "warmup"},             {"beta1", "beta1"},     {"beta2", "beta2"},
      {"adam-eps", "eps"},    {"weight-decay", "weight_decay"}, {"clip", "clip"},       {"seed", "seed"}};
  return k;
}
}  // namespace

const std::vector<std::string>& resume_checked_settings() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (auto& [opt, key] : checked_keys()) n.push_back(opt);
    return n;
  }();
  return names;
}

std::string train_config_json(const TrainConfig& tc) {
  nlohmann::json j({{"seq_len", tc.seq_len}, {"global_batch", tc.global_batch}, {"micro_batch", tc.micro_batch},
                         {"steps", tc.steps}, {"lr", tc.lr}, {"min_lr", tc.min_lr}, {"warmup", tc.warmup},
                         {"beta1", tc.beta1}, {"beta2", tc.beta2}, {"eps", tc.eps}, {"weight_decay", tc.weight_decay},
                         {"clip", tc.clip}, {"seed", tc.seed}, {"precision", tc.precision}});
  if (tc.world_size > 0) {  // the run's layout (hybrid sharding): informational, not compared on resume
    j["world_size"] = tc.world_size;
    j["shard_group_size"] = tc.shard_group_size > 0 ? tc.shard_group_size : tc.world_size;
  }
  return j.dump();
}

template <typename T> AdamW<T>::AdamW(Fsdp<T>& f, const TrainConfig& tc) : f_(f), tc_(tc) {
  const ShardPlan& plan = f.plan();
  int r = f.plan_rank();
  for (int u = 0; u < f.num_units(); ++u) {
    const UnitPlan& up = plan.units[u];
    m_.emplace_back(f.backend(), static_cast<size_t>(up.shard_size));
    v_.emplace_back(f.backend(), static_cast<size_t>(up.shard_size));
    const RankShard& rs = up.ranks[r];
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

template <typename T>
double evaluate(Comm& comm, LlamaModel<T>& model, UnitSource<T>& f, const TokenDataset& data, const TrainConfig& tc,
                int batches) {
  const int W = comm.world_size(), per_rank = tc.global_batch / W;
  const int mb = tc.micro_batch > 0 ? tc.micro_batch : per_rank;
  std::vector<int32_t> tok(static_cast<size_t>(mb) * tc.seq_len), tgt(tok.size());
  double sum = 0;
  f.begin_pass("eval");  // the sharding layer prefetches along the order the last evaluation gathered in
  for (int e = 0; e < batches; ++e)
    for (int m = 0; m < per_rank / mb; ++m) {
      fill_batch(data, Split::Val, tc.seed, e, comm.rank() * per_rank + m * mb, mb, tc.seq_len, tok.data(), tgt.data());
      model.forward(f, tok.data(), mb, tc.seq_len);
      sum += model.loss(f, tgt.data());
    }
  f.end_pass();
  comm.all_reduce(&sum, 1, ReduceOp::Sum);
  return sum / (static_cast<double>(batches) * tc.global_batch * tc.seq_len);
}

namespace {
std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
}  // namespace

double flops_per_token(const ModelConfig& c, int T) {
  // Attention scores and weighted values: 2 products of T x (NH*HD) per token and layer, forward
  // and twice backward; NH*HD is the query width, not hidden_size when head_dim is given.
  const double q_width = static_cast<double>(c.num_attention_heads) * c.head_dim();
  return 6.0 * static_cast<double>(c.num_params()) + 12.0 * c.num_hidden_layers * q_width * static_cast<double>(T);
}

ModelOptions model_options(const TrainConfig& tc) {
  ModelOptions o;
  o.recompute = parse_recompute(tc.activation_checkpointing);
  o.attention = parse_attention(tc.attention);
  if (tc.loss_chunk < 0) throw std::invalid_argument("option '--loss-chunk' must be >= 0 (0: the default)");
  o.loss_chunk = tc.loss_chunk;
  return o;
}

Precision parse_precision(const std::string& s) {
  if (s == "fp32") return Precision::FP32;
  if (s == "bf16") return Precision::BF16;
  throw std::invalid_argument("option '--precision' must be fp32 or bf16, got '" + s + "'");
}

namespace {
// The model and its unit source in compute type C, over the fp32 Fsdp `f`.
template <typename C> struct Compute {
  std::unique_ptr<MixedPrecisionUnits> mixed;  // C = bf16 only
  std::unique_ptr<LlamaModel<C>> model;
  UnitSource<C>* units = nullptr;
};
}  // namespace

namespace {
std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string o;
  for (auto& x : v) o += (o.empty() ? "" : sep) + x;
  return o;
}

// Compares the run's settings with the checkpoint's train_config, key by key. A change of one of
// resume_checked_settings() not named by --accept-change is refused on every rank (the inputs are
// identical on every rank); accepted ones are logged, with the learning rate the next step gets
// under the old and the new schedule when the schedule changed. micro_batch and precision may
// change (like the world size, they do not change what is trained) and are logged.
void check_resume_settings(Comm& comm, const CheckpointInfo& info, const TrainConfig& tc) {
  nlohmann::json old, now = nlohmann::json::parse(train_config_json(tc));
  try {
    old = nlohmann::json::parse(info.train_config);
  } catch (const std::exception& e) {  // read_checkpoint_info checked it already
    throw CollectiveError(0, "checkpoint '" + info.path + "': attribute 'train_config' is malformed: " + e.what());
  }
  const auto& acc = tc.accept_changes;
  std::vector<std::string> refused, refused_names, accepted;
  bool schedule = false;
  for (auto& [opt, key] : checked_keys()) {
    if (!old.contains(key) || old[key] == now[key]) continue;
    const std::string change = "--" + opt + " " + old[key].dump() + " -> " + now[key].dump();
    if (std::find(acc.begin(), acc.end(), opt) == acc.end()) {
      refused.push_back(change);
      refused_names.push_back(opt);
    } else {
      accepted.push_back(change);
      schedule = schedule || opt == "steps" || opt == "lr" || opt == "min-lr" || opt == "warmup";
    }
  }
  if (!refused.empty())
    throw CollectiveError(0, "resume from '" + info.path + "' at step " + std::to_string(info.step) +
                                 ": these settings differ from the checkpoint's: " + join(refused, ", ") +
                                 ". Resuming with them would change the run mid-way (its learning-rate schedule, "
                                 "batches or token count). Pass '--accept-change " + join(refused_names, ",") +
                                 "' to continue with the new values, or give the checkpoint's values");
  for (auto& c : accepted)
    log_info(comm, "note: resume at step " + std::to_string(info.step) + ": accepted change " + c + " (--accept-change)");
  for (auto& a : acc) {
    auto it = std::find_if(checked_keys().begin(), checked_keys().end(), [&](auto& k) { return k.first == a; });
    if (it != checked_keys().end() && old.contains(it->second) && old[it->second] == now[it->second])
      log_info(comm, "note: '--accept-change " + a + "': --" + a + " is unchanged (" + now[it->second].dump() + ")");
  }
  if (schedule) {
    TrainConfig o = tc;
    o.steps = old["steps"].get<int64_t>();
    o.lr = old["lr"].get<double>();
    o.min_lr = old["min_lr"].get<double>();
    o.warmup = old["warmup"].get<int64_t>();
    char b[200];
    std::snprintf(b, sizeof b, "%.3e under the checkpoint's settings, %.3e under the new ones", lr_at(o, info.step),
                  lr_at(tc, info.step));
    log_info(comm, "note: the learning-rate schedule is recomputed from the new settings: step " +
                       std::to_string(info.step + 1) + " runs at lr " + b);
  }
  if (old.contains("micro_batch") && old["micro_batch"] != now["micro_batch"])
    log_info(comm, "note: resume: --micro-batch " + old["micro_batch"].dump() + " -> " + now["micro_batch"].dump() +
                       " (gradient accumulation only: the global batch and the update are the same)");
  if (old.contains("precision") && old["precision"] != now["precision"])
    log_info(comm, "note: resume: precision " + old["precision"].get<std::string>() + " -> " +
                       now["precision"].get<std::string>() + " (checkpoints hold fp32 master weights and AdamW state)");
}

// Rank 0, before a resumed run (or a start-over) appends to its metrics file: keeps the rows of
// steps <= `step` and moves the others (written after the checkpoint it resumes from, by a run
// that then crashed or was stopped; and any torn last line) to "<path>.discarded", so that no step
// appears twice. Returns a note for the log, or "" when nothing moved. Throws std::runtime_error.
std::string continue_metrics(const std::string& given, int64_t step) {
  std::error_code ec;  // a symbolic link: rewrite the file it points to, not the link
  const std::string path = std::filesystem::is_symlink(given, ec) ? std::filesystem::canonical(given).string() : given;
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";  // no file yet
  std::string kept, dropped, line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    bool keep = false;
    try {
      nlohmann::json j = nlohmann::json::parse(line);
      keep = j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step;
    } catch (const nlohmann::json::exception&) {
    }
    if (keep) {
      kept += line + "\n";
    } else if (!line.empty()) {
      dropped += line + "\n";
      ++n;
    }
  }
  if (n == 0) return "";
  const std::string aside = path + ".discarded";
  {
    std::ofstream d(aside, std::ios::app | std::ios::binary);
    d << dropped;
    d.flush();
    if (!d) throw std::runtime_error("cannot append to '" + aside + "'");
  }
  write_file_atomic(path, kept);
  return "metrics: moved " + std::to_string(n) + " line(s) of steps after " + std::to_string(step) + " (or unreadable) from '" +
         path + "' to '" + aside + "' (written after the checkpoint this run continues from)";
}
}  // namespace

// The tokenizer the run's checkpoints record: the token data's, or the checkpoint's (resumed or
// --init-from) where the data names none (llm.c, nanoGPT). A model's own tokenizer is defined by
// its tokenizer.model (SentencePiece) or tokenizer.json (Hugging Face); when the data and the
// checkpoint share such a file byte for byte, they name the same tokenizer and the checkpoint's
// record is kept, with the data's other files added (an imported model keeps its tokenizer.json and
// tokenizer_config.json for export). When both have a tokenizer of their own but share no such file,
// the data is refused (CollectiveError naming both): every id would mean another token. A change
// from or to byte-level is noted; the data's tokenizer is recorded.
static TokenizerInfo pick_tokenizer(Comm& comm, const TokenizerInfo& ckpt, const std::string& ckpt_path,
                                    const TokenizerInfo& data, const std::string& data_path) {
  if (data.kind.empty()) return ckpt;
  if (ckpt.kind.empty()) return data;
  auto own = [](const TokenizerInfo& t) { return t.kind == "sentencepiece" || t.kind == "hf-tokenizers"; };
  if (own(data) && own(ckpt)) {
    bool same = false;
    for (const char* f : {"tokenizer.model", "tokenizer.json"}) {
      auto x = data.files.find(f), y = ckpt.files.find(f);
      if (x != data.files.end() && y != ckpt.files.end()) {
        if (x->second != y->second) {
          same = false;
          break;
        }
        same = true;
      }
    }
    if (!same)
      throw CollectiveError(0, "token file '" + data_path + "' was made with another tokenizer (" + data.kind +
                               ") than the model of checkpoint '" + ckpt_path + "' (" + ckpt.kind + "): their "
                               "tokenizer.model / tokenizer.json differ or cannot be compared, so the ids mean other "
                               "tokens. Prepare the data with the model's own tokenizer: --mode prepare --tokenizer "
                               "<its directory> (tokenizer.model), or scripts/tokenize_hf.py --tokenizer <its "
                               "directory> (tokenizer.json)");
    TokenizerInfo t = ckpt;
    for (auto& [name, bytes] : data.files) t.files.emplace(name, bytes);  // the checkpoint's own files win
    return t;
  }
  if (ckpt.kind != data.kind)
    log_info(comm, "note: checkpoint '" + ckpt_path + "' records a " + ckpt.kind + " tokenizer, token file '" + data_path +
                       "' was made with " + data.kind + "; new checkpoints record the token file's");
  return data;
}

template <typename C>
static TrainResult train_in(Engine& eng, const ModelConfig& mc, const TrainConfig& tc, const TokenDataset& data) {
  Comm& comm = eng.comm;
  Backend<float>& be = eng.be;
  using clock = std::chrono::steady_clock;
  const int W = comm.world_size(), rank = comm.rank();
  const int G = eng.data_comm.world_size();  // shard group size (hybrid sharding; W for plain FSDP)
  // Geometry checks: identical on every rank, so every rank throws the same message.
  if (tc.global_batch % W != 0)
    throw CollectiveError(0, "option '--global-batch' (" + std::to_string(tc.global_batch) +
                                 ") is not divisible by the world size (" + std::to_string(W) + ")");
  const int per_rank = tc.global_batch / W;
  const int mb = tc.micro_batch > 0 ? tc.micro_batch : per_rank;
  if (per_rank % mb != 0)
    throw CollectiveError(0, "option '--global-batch' (" + std::to_string(tc.global_batch) +
                                 ") is not divisible by world size x '--micro-batch' (" + std::to_string(W) + " x " +
                                 std::to_string(mb) + ")");
  if (tc.seq_len > mc.max_position_embeddings)
    throw CollectiveError(0, "option '--seq-len' (" + std::to_string(tc.seq_len) +
                                 ") exceeds the model's max_position_embeddings (" +
                                 std::to_string(mc.max_position_embeddings) + ")");
  if (data.header().vocab_size > static_cast<uint32_t>(mc.vocab_size))
    throw CollectiveError(0, "the token file's vocab_size (" + std::to_string(data.header().vocab_size) +
                                 ") exceeds the model's vocab_size (" + std::to_string(mc.vocab_size) + ")");
  // Data without a vocabulary (llm.c, nanoGPT) is checked here, against the model's.
  if (data.max_id() >= static_cast<uint32_t>(mc.vocab_size))
    throw CollectiveError(0, "token id " + std::to_string(data.max_id()) + " at " + data.max_id_where() +
                                 " is >= the model's vocab_size (" + std::to_string(mc.vocab_size) +
                                 "): the data was tokenized for another vocabulary");
  if (data.size(Split::Val) == 0)
    throw CollectiveError(0, "no validation tokens: the '--data' files have no validation split (llm.c and nanoGPT "
                             "files are all training tokens); name validation files with option '--val-data'");
  for (auto [n, name] : {std::pair{data.size(Split::Train), "train"}, std::pair{data.size(Split::Val), "validation"}})
    if (n < static_cast<uint64_t>(tc.seq_len) + 1)
      throw CollectiveError(0, std::string("the ") + name + " split of the token file holds " + std::to_string(n) +
                                   " tokens, fewer than one sequence of --seq-len + 1 = " +
                                   std::to_string(tc.seq_len + 1));
  const int accum = per_rank / mb;
  int64_t plan_total = 0;
  ModelOptions mopt;
  agree(comm, [&] { mopt = model_options(tc); });
  {  // The memory plan, before anything is allocated (the process's own memory so far measured).
    MemoryPlanInput mi{mc, tc, W, std::is_same_v<C, bf16> ? Precision::BF16 : Precision::FP32, eng.reduce_bf16,
                       std::string(be.name()).find("cuda") != std::string::npos,
                       0, 4, 0};  // token data: memory-mapped (page cache), not held by the rank
    mi.train.micro_batch = mb;
    mi.overlap = eng.overlap;
    mi.shard_group_size = G;
    mi.runtime_bytes = mi.cuda ? kGpuRuntimeEstimate : current_rss_bytes();
    comm.all_reduce(&mi.runtime_bytes, 1, ReduceOp::Max);
    const MemoryPlan plan = plan_memory(mi);
    plan_total = plan.total();
    log_info(comm, plan.format("memory plan per rank (" + std::string(mi.cuda ? "device" : "host") +
                                          " memory; --mode plan prints it without a launch):"));
  }

  // Allocation depends on local success: agree on it, and say what did not fit.
  std::unique_ptr<Fsdp<float>> fp;
  Compute<C> cp;
  std::unique_ptr<AdamW<float>> op;
  std::vector<int32_t> tok, tgt;
  agree(comm, [&] {
    try {
      constexpr bool mixed = std::is_same_v<C, bf16>;
      fp = std::make_unique<Fsdp<float>>(be, comm, ShardPlan::build(llama_units(mc), G), &eng.data_comm, !mixed,
                                         eng.replica_comm, eng.overlap);
      if constexpr (mixed) {
        cp.mixed = std::make_unique<MixedPrecisionUnits>(*fp, *eng.be16, eng.reduce_bf16,
                                                         MixedPrecisionUnits::kWidenSlab, eng.overlap);
        cp.model = std::make_unique<LlamaModel<bf16>>(mc, *eng.be16, mopt);
        cp.units = cp.mixed.get();
      } else {
        cp.model = std::make_unique<LlamaModel<float>>(mc, be, mopt);
        cp.units = fp.get();
      }
      op = std::make_unique<AdamW<float>>(*fp, tc);
      cp.model->reserve(mb, tc.seq_len);
      tok.resize(static_cast<size_t>(mb) * tc.seq_len);
      tgt.resize(tok.size());
    } catch (const std::bad_alloc&) {
      throw std::runtime_error("out of memory allocating model '" + mc.name + "' (" + std::to_string(mc.num_params()) +
                               " parameters, sharded over " + std::to_string(G) + " ranks) with activations for " +
                               std::to_string(mb) + " x " + std::to_string(tc.seq_len) +
                               " tokens per micro-batch; use more ranks, a smaller '--micro-batch' or '--seq-len', or a smaller '--model'");
    }
  });
  Fsdp<float>& f = *fp;
  LlamaModel<C>& model = *cp.model;
  UnitSource<C>& units = *cp.units;
  AdamW<float>& opt = *op;
  f.init_params(tc.seed);
  const CheckpointOptions co{tc.checkpoint_dir, tc.checkpoint_every, tc.keep_last, tc.debug_crash_before_publish};

  // Resume: parameters, AdamW moments, step (= data position and LR schedule position), batch history.
  TrainState state;
  state.seed = tc.seed;
  {  // A fresh run must not overwrite another run's checkpoints (same step names, other weights),
     // nor silently replace the `latest` of a run whose checkpoints are gone.
    std::string err;
    if (rank == 0 && tc.resume.empty() && !tc.checkpoint_dir.empty()) {
      std::error_code ec;
      const std::vector<std::string> names = published_checkpoints(tc.checkpoint_dir);
      if (!names.empty())
        err = "checkpoint directory '" + tc.checkpoint_dir + "' already holds checkpoints (" + names.front() +
              ", ...): pass '--resume auto' to continue that run, or use another '--checkpoint-dir'";
      if (err.empty() && !tc.start_over && std::filesystem::exists(std::filesystem::path(tc.checkpoint_dir) / "latest", ec))
        err = "checkpoint directory '" + tc.checkpoint_dir + "' holds the 'latest' pointer of an earlier run but none of "
              "its checkpoints: pass '--start-over' to start again from step 0 there, or use another '--checkpoint-dir'";
    }
    all_ok(comm, err.empty(), err);
  }
  const std::string resume_path = resolve_resume(comm, tc.resume, tc.checkpoint_dir, tc.start_over);
  if (!resume_path.empty()) {
    auto t0 = clock::now();
    const CheckpointInfo info = read_checkpoint_info(comm, resume_path);
    check_resume_settings(comm, info, tc);  // refuses changed settings unless --accept-change names them
    state = load_checkpoint(comm, resume_path, f, &opt, mc, &info);
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    double mbytes = 3.0 * 4.0 * static_cast<double>(f.plan().total_numel()) / 1e6;
    std::string saved = "world size " + std::to_string(state.saved_world_size);
    {  // hybrid sharding: the file's world_size is its shard group's; train_config records the run's
      const nlohmann::json j = nlohmann::json::parse(info.train_config);
      if (j.contains("world_size") && j.contains("shard_group_size") &&
          j["world_size"] != j["shard_group_size"])
        saved = "world size " + j["world_size"].dump() + ", shard group size " + j["shard_group_size"].dump();
    }
    log_info(comm, "resumed from '" + resume_path + "' at step " + std::to_string(state.step) + " (saved at " +
                       saved + ") in " + fmt("%.2f", dt) + " s, " +
                       fmt("%.0f", mbytes / dt) + " MB/s incl. CRC32 verification");
  } else {
    if (tc.resume == "auto")
      log_info(comm, tc.start_over && std::filesystem::exists(std::filesystem::path(tc.checkpoint_dir) / "latest")
                         ? "starting over from step 0 in '" + tc.checkpoint_dir +
                               "' (--start-over): its 'latest' names a checkpoint that no longer exists"
                         : "no checkpoint in '" + tc.checkpoint_dir + "': starting from step 0");
    if (!tc.init_from.empty()) {
      // Weights only; AdamW starts from zero. The tokenizer record is kept to compare with the data's.
      state.tokenizer = load_checkpoint(comm, tc.init_from, f, nullptr, mc).tokenizer;
      log_info(comm, "initialized weights from '" + tc.init_from + "'");
    }
  }
  // The batch history: a new segment where the geometry or the seed changes (an accepted change).
  if (state.segments.empty() || state.segments.back().global_batch != tc.global_batch ||
      state.segments.back().seq_len != tc.seq_len || state.segments.back().seed != tc.seed)
    state.segments.push_back({state.step, tc.global_batch, tc.seq_len, tc.seed});
  state.seed = tc.seed;
  {
    const TokenFileHeader& h = data.header();
    nlohmann::json files = nlohmann::json::array(), formats = nlohmann::json::array();
    for (const TokenFileEntry& e : data.files()) {
      files.push_back(e.path);
      formats.push_back(e.format);
    }
    // "path": the first file (what format-1 readers know); "files": every file, train then val.
    const nlohmann::json now = {{"path", data.path()}, {"files", files},         {"formats", formats},
                                {"tokenizer", h.tokenizer}, {"vocab_size", h.vocab_size}, {"bos_id", h.bos_id},
                                {"eos_id", h.eos_id},  {"n_train", h.n_train}, {"n_val", h.n_val},
                                {"crc32", data.crc32()}};
    nlohmann::json before;
    try {
      before = nlohmann::json::parse(state.data_info);
    } catch (const nlohmann::json::exception&) {  // verified when read; "null" for a fresh run
    }
    if (!resume_path.empty() && before.is_object() && before.contains("crc32") && before["crc32"] != now["crc32"])
      log_info(comm, "note: resume: token file '" + data.path() + "' is not the one the checkpoint trained on ('" +
                         before.value("path", std::string("?")) + "', other contents): the batches from step " +
                         std::to_string(state.step + 1) + " on come from the new one");
    state.data_info = now.dump();
  }
  state.tokenizer = pick_tokenizer(comm, state.tokenizer, resume_path.empty() ? tc.init_from : resume_path,
                                   data.tokenizer(), data.path());
  const uint64_t seed = tc.seed;
  if (state.step >= tc.steps)
    throw CollectiveError(0, "checkpoint is at step " + std::to_string(state.step) + ", not before option '--steps' (" +
                                 std::to_string(tc.steps) + "): nothing to train (to train further, raise '--steps' "
                                 "and pass '--accept-change steps')");
  if (tc.stop_at_step > 0 && tc.stop_at_step <= state.step)
    throw CollectiveError(0, "option '--stop-at-step' (" + std::to_string(tc.stop_at_step) +
                                 ") is not after the checkpoint's step (" + std::to_string(state.step) +
                                 "): nothing to train");
  const int64_t last_step = tc.stop_at_step > 0 ? std::min(tc.stop_at_step, tc.steps) : tc.steps;
  if (!tc.checkpoint_dir.empty()) {
    // Before hours of training, not at the first save: every rank must see one shared directory.
    prepare_checkpoint_dir(comm, tc.checkpoint_dir);
    if (!resume_path.empty()) set_aside_later_checkpoints(comm, tc.checkpoint_dir, state.step, resume_path);
  }

  // Metrics: a fresh run starts the file; a resumed run (or a start-over) continues it exactly at
  // its step, moving the rows of steps it will redo (written after that checkpoint) aside.
  std::ofstream metrics;
  {
    std::string err;
    if (rank == 0 && !tc.metrics_path.empty()) {
      const bool continuing = !resume_path.empty() || tc.start_over;
      try {
        if (continuing) {
          std::string note = continue_metrics(tc.metrics_path, state.step);
          if (!note.empty()) log_info(comm, note);
        }
        metrics.open(tc.metrics_path, continuing ? std::ios::app : std::ios::trunc);
        if (!metrics) throw std::runtime_error("cannot open it");
      } catch (const std::exception& e) {
        err = "cannot write metrics file '" + tc.metrics_path + "' (option '--metrics'): " + e.what();
      }
    }
    all_ok(comm, err.empty(), err);
  }

  log_info(comm, "shardtrain: model " + mc.name + ", " + std::to_string(mc.num_params()) + " parameters, " +
                     std::to_string(f.num_units()) + " units, world size " + std::to_string(W) + ", micro-batch " +
                     std::to_string(mb) + " x " + std::to_string(accum) + " accumulation steps, global batch " +
                     std::to_string(tc.global_batch) + " x " + std::to_string(tc.seq_len) + " tokens");
  {
    const OverlapConfig& ov = cp.mixed ? cp.mixed->overlap() : f.overlap();
    log_info(comm, std::string("overlap: ") +
                       (ov.on ? "on (prefetch " + std::to_string(ov.prefetch) + " unit(s), asynchronous reduce-scatter, " +
                                    (eng.data_comm.stream_ordered()
                                         ? std::string("stream-ordered: NCCL on a communication stream, one host wait per pass")
                                     : eng.data_comm.asynchronous()
                                         ? std::string("progress: ") + comm_progress_name(ov.progress)
                                         : std::string("collectives complete on return on this device")) +
                                    ")"
                              : std::string("off (every collective waited for when started; --prefetch and --comm-progress have no effect)")) +
                       (eng.overlap.on && ov.progress != eng.overlap.progress
                            ? "; note: MPI granted no MPI_THREAD_MULTIPLE, so '--comm-progress thread' became poll"
                            : std::string()));
  }

  const float grad_scale = 1.0f / static_cast<float>(per_rank * tc.seq_len);  // d(mean loss on this rank)
  const double tokens_per_step = static_cast<double>(tc.global_batch) * tc.seq_len;
  TrainResult res;
  double train_s = 0, interval_s = 0;
  int64_t interval_steps = 0;
  double interval_issued_s = 0, interval_exposed_s = 0;  // FSDP collectives of the steps in the interval
  auto t_start = clock::now();

  auto save = [&](int64_t step) {
    auto t0 = clock::now();
    TrainState st = state;
    st.step = step;
    st.tokens_seen = tokens_of(state.segments, step);
    st.saved_world_size = W;
    std::string p = save_checkpoint(comm, f, opt, mc, tc, st, co);
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    double mbytes = 3.0 * 4.0 * static_cast<double>(f.plan().total_numel()) / 1e6;
    log_info(comm, "checkpoint: saved '" + p + "' (" + fmt("%.1f", mbytes) + " MB of parameters + AdamW state) in " +
                       fmt("%.2f", dt) + " s, " + fmt("%.0f", mbytes / dt) + " MB/s");
  };

  for (int64_t s = state.step; s < last_step; ++s) {
    auto t0 = clock::now();
    const CommTimes comm0 = units.comm_times();
    f.zero_grads();
    double loss_sum = 0;
    units.begin_pass("train");  // the sharding layer prefetches along the order the last step gathered in
    for (int m = 0; m < accum; ++m) {
      fill_batch(data, Split::Train, seed, s, rank * per_rank + m * mb, mb, tc.seq_len, tok.data(), tgt.data());
      model.forward(units, tok.data(), mb, tc.seq_len);
      loss_sum += model.head_backward(units, tgt.data(), grad_scale);  // LM head and loss, forward and backward
      model.backward(units);  // reduce-scatters each unit's gradient (mean over ranks) into its shard
    }
    units.end_pass();  // every reduce-scatter has landed in the gradient shards
    // One all-reduce: loss, squared gradient norm, and "some rank was asked to stop" (a signal),
    // so every rank sees the same values and takes the same decisions below.
    // Hybrid sharding: the replica groups hold identical gradient shards, so only replica group
    // 0's ranks add theirs to the squared norm (each parameter counted once).
    double red[3] = {loss_sum, f.replica_index() == 0 ? f.local_grad_sumsq() : 0.0, stop_signal() != 0 ? 1.0 : 0.0};
    comm.all_reduce(red, 3, ReduceOp::Sum);
    const double loss = red[0] / tokens_per_step, gnorm = std::sqrt(red[1]);
    const bool stop_requested = red[2] > 0;
    const double lr = lr_at(tc, s);
    if (!std::isfinite(loss) || !std::isfinite(gnorm)) {
      std::string what = "non-finite " + std::string(std::isfinite(loss) ? "gradient norm" : "loss") + " at step " +
                         std::to_string(s + 1) + " (loss " + fmt("%g", loss) + ", grad_norm " + fmt("%g", gnorm) + ")";
      if (!tc.skip_nonfinite)  // nothing is applied or saved from this state
        throw CollectiveError(0, what + "; stopping without applying it. Lower '--lr', enable '--clip', or pass "
                                        "'--skip-nonfinite' to skip such steps");
      log_info(comm, what + ": update skipped (--skip-nonfinite)");
    } else {
      const double clip_scale = (tc.clip > 0 && gnorm > tc.clip) ? tc.clip / gnorm : 1.0;
      opt.step(s + 1, lr, clip_scale);
    }
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    train_s += dt;
    interval_s += dt;
    {
      const CommTimes comm1 = units.comm_times();
      interval_issued_s += comm1.issued_s - comm0.issued_s;
      interval_exposed_s += comm1.exposed_s - comm0.exposed_s;
    }
    ++interval_steps;

    StepLog sl{s + 1, loss, lr, gnorm, 0, std::chrono::duration<double>(clock::now() - t_start).count()};
    if ((s + 1) % tc.log_every == 0 || s + 1 == last_step || s == state.step) {
      sl.tokens_per_s = tokens_per_step * static_cast<double>(interval_steps) / interval_s;
      {  // per-step means over the interval
        const double n = static_cast<double>(interval_steps);
        sl.comm_ms = 1e3 * interval_issued_s / n;
        sl.exposed_comm_ms = 1e3 * interval_exposed_s / n;
        sl.compute_ms = 1e3 * interval_s / n - sl.exposed_comm_ms;
        interval_issued_s = interval_exposed_s = 0;
      }
      interval_s = 0;
      interval_steps = 0;
      log_info(comm, "step " + std::to_string(s + 1) + "/" + std::to_string(tc.steps) + " | loss " + fmt("%.4f", loss) +
                         " | lr " + fmt("%.3e", lr) + " | grad_norm " + fmt("%.4f", gnorm) + " | " +
                         fmt("%.0f", sl.tokens_per_s) + " tok/s | exposed comm " + fmt("%.1f", sl.exposed_comm_ms) +
                         " ms/step | " +
                         (eng.peak_flops > 0 ? "MFU " + fmt("%.1f", 100.0 * sl.tokens_per_s * flops_per_token(mc, tc.seq_len) / eng.peak_flops) + "% | " : std::string()) +
                         fmt("%.1f", sl.elapsed_s) + " s");
      if (metrics.is_open()) {
        nlohmann::json j = {{"step", sl.step}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm},
                            {"tokens_per_s", sl.tokens_per_s}, {"elapsed_s", sl.elapsed_s},
                            {"compute_ms", sl.compute_ms}, {"comm_ms", sl.comm_ms},
                            {"exposed_comm_ms", sl.exposed_comm_ms}};
        metrics << j.dump() << "\n" << std::flush;
      }
      if (!tc.metrics_path.empty())  // rank 0 writes; everybody learns whether it could
        all_ok(comm, !metrics.is_open() || metrics.good(), "cannot write metrics file '" + tc.metrics_path + "' (option '--metrics')");
    }
    res.steps.push_back(sl);

    bool last = s + 1 == last_step;
    if ((tc.eval_every > 0 && (s + 1) % tc.eval_every == 0) || last) {
      double vl = evaluate(comm, model, units, data, tc, tc.eval_batches);
      res.evals.push_back({s + 1, vl});
      log_info(comm, "eval step " + std::to_string(s + 1) + " | val_loss " + fmt("%.4f", vl));
      if (metrics.is_open()) metrics << nlohmann::json({{"step", s + 1}, {"val_loss", vl}}).dump() << "\n" << std::flush;
    }
    const bool saved_now = !tc.checkpoint_dir.empty() &&
                           ((tc.checkpoint_every > 0 && (s + 1) % tc.checkpoint_every == 0) || last || stop_requested);
    if (saved_now) save(s + 1);
    if (stop_requested && !last) {
      const int sig = stop_signal();
      throw Preempted("stop requested by a signal (SIGTERM or SIGUSR1) during step " + std::to_string(s + 1) + ": " +
                          (tc.checkpoint_dir.empty() ? std::string("no --checkpoint-dir, nothing saved")
                                                     : "checkpoint of step " + std::to_string(s + 1) +
                                                           " published; continue with --resume auto"),
                      sig);
    }
  }
  res.train_seconds = train_s;
  const int64_t ran = last_step - state.step;
  res.tokens_per_s = tokens_per_step * static_cast<double>(ran) / train_s;
  log_info(comm, "done: " + std::to_string(ran) + " steps in " + fmt("%.1f", train_s) + " s of training, " +
                     fmt("%.0f", res.tokens_per_s) + " tok/s" +
                     (res.evals.empty() ? std::string() : ", final val_loss " + fmt("%.4f", res.evals.back().val_loss)));
  if (std::string(be.name()) == "cpu") {  // the plan against what each rank's kernel counted
    std::vector<int64_t> hwm(static_cast<size_t>(W));
    int64_t mine = peak_rss_bytes();
    comm.all_gather(&mine, hwm.data(), 1);
    std::string per;
    for (int r = 0; r < W; ++r) per += (r ? ", " : "") + fmt("%.0f", static_cast<double>(hwm[r]) / (1 << 20));
    const int64_t mx = *std::max_element(hwm.begin(), hwm.end());
    log_info(comm, "memory: peak resident (VmHWM) per rank " + per + " MiB; plan " +
                       fmt("%.0f", static_cast<double>(plan_total) / (1 << 20)) + " MiB (largest rank " +
                       fmt("%+.1f", 100.0 * (static_cast<double>(mx) / static_cast<double>(plan_total) - 1.0)) + "%)");
  }
  return res;
}

TrainResult train(Engine& eng, const ModelConfig& mc, const TrainConfig& tc_in, const TokenDataset& data) {
  TrainConfig tc = tc_in;
  tc.world_size = eng.comm.world_size();
  tc.shard_group_size = eng.data_comm.world_size();
  if (eng.precision == Precision::BF16) {
    if (!eng.be16) throw std::logic_error("train: Precision::BF16 without a bf16 backend");
    tc.precision = eng.reduce_bf16 ? "bf16 (bf16 gradient reduce)" : "bf16 (fp32 gradient reduce)";
    return train_in<bf16>(eng, mc, tc, data);
  }
  tc.precision = "fp32";
  return train_in<float>(eng, mc, tc, data);
}

template class AdamW<float>;
template class AdamW<double>;
template double evaluate<float>(Comm&, LlamaModel<float>&, UnitSource<float>&, const TokenDataset&, const TrainConfig&,
                                int);
template double evaluate<bf16>(Comm&, LlamaModel<bf16>&, UnitSource<bf16>&, const TokenDataset&, const TrainConfig&,
                               int);

}  // namespace shardtrain
