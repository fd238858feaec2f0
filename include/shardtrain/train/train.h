// shardtrain training layer: AdamW on shards, the LR schedule, global gradient-norm clipping, and
// the training loop (get batch, forward, backward + reduce-scatter, clip, step, log, evaluate,
// save). train() (src/train/trainer.cpp) runs the Trainer (src/train/trainer.h; its set-up in
// trainer_setup.cpp, its step line and reports in trainer_report.cpp); resume rules are
// src/train/resume.h.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"
#include "shardtrain/data/data.h"
#include "shardtrain/parallel/geometry.h"  // CpComm
#include "shardtrain/model/model.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/data/packing.h"  // TrainOn, PackMode, MaxLengthPolicy, PackedBatches
#include "shardtrain/parallel/stage_runner.h"  // StageRunner, MicroBatchReader
#include "shardtrain/shard/shard.h"
#include "shardtrain/parallel/tensor_parallel.h"
#include "shardtrain/io/train_state.h"

namespace shardtrain {

// Compute precision of a run. FP32: parameters, activations, gradients and GEMMs in fp32.
// BF16: mixed precision (see MixedPrecisionUnits): fp32 master shards and AdamW state, bf16
// gathered parameters and activations, fp32 arithmetic and GEMM accumulation.
enum class Precision { FP32, BF16 };
// Parses "fp32" / "bf16" / "fp8"; throws std::invalid_argument naming option '--precision'.
// "fp8" is BF16 plus float8 GEMMs in the transformer blocks (TrainConfig::fp8, ModelOptions::fp8):
// it returns Precision::BF16 and sets *fp8 (when given) to true; the others set it to false.
Precision parse_precision(const std::string& s, bool* fp8 = nullptr);
// "fp32", "bf16": the option's spelling.
const char* precision_name(Precision p);

// The settings of a training run: input only (options and job files fill it; train() reads it).
// What a run finds out (its step, batch history, layout) lives in TrainState (train_state.h).
struct TrainConfig {
  int seq_len = 64;            // T, tokens per sequence
  int global_batch = 12;       // sequences per optimizer step, over all ranks
  int micro_batch = 0;         // sequences per rank per forward/backward; 0 = global_batch / world
  int64_t steps = 100;         // optimizer steps
  double lr = 1e-3;            // peak learning rate
  double min_lr = 1e-4;        // learning rate at the end of cosine decay
  int64_t warmup = 10;         // linear warm-up steps
  double beta1 = 0.9, beta2 = 0.99, eps = 1e-8;
  double weight_decay = 0.1;   // decoupled; not applied to norm weights
  double clip = 1.0;           // max global gradient L2 norm; <= 0 disables
  uint64_t seed = 1337;        // init and data order
  int64_t log_every = 10;      // steps between log lines
  int64_t eval_every = 100;    // steps between evaluations; 0 = only at the end
  int eval_batches = 4;        // global batches of the validation split per evaluation
  std::string metrics_path;    // JSON lines, rank 0; empty = none
  std::string tensorboard_dir;  // TensorBoard event files of the metrics records, rank 0 (tensorboard.h); empty = none
  // Checkpoints (docs/checkpoint-format.md).
  std::string checkpoint_dir;  // empty: no checkpoints
  int64_t checkpoint_every = 0;  // steps between saves; 0: only at the end
  int keep_last = 0;           // published checkpoints kept; 0: all
  // --checkpoint-async on|off: periodic saves write in a background thread (AsyncCheckpointWriter,
  // checkpoint.h) while training goes on; the final and preemption saves always wait. Not part of
  // train_config: it never changes what a checkpoint holds.
  bool checkpoint_async = true;
  std::string resume;          // "" (fresh), "auto" (newest in checkpoint_dir, if any), or a path
  std::string init_from;       // start from these weights at step 0 (fresh optimizer); ignored when resuming
  std::vector<std::string> accept_changes;  // resume: settings (option names, e.g. "steps") allowed to differ from the checkpoint's
  bool start_over = false;     // start at step 0 although --checkpoint-dir's 'latest' names a checkpoint that is gone
  int64_t stop_at_step = 0;    // stop (and save) after this step, keeping the schedule of `steps`; 0: run to `steps`
  int64_t debug_crash_before_publish = 0;  // test hook (see CheckpointOptions)
  bool skip_nonfinite = false;  // skip the update of a step with a non-finite loss or gradient norm instead of stopping
  double skip_spikes = 0;       // --skip-spikes Z: skip the update of a loss or grad-norm spike (check_spike); 0: off
  // How the model computes (model.h ModelOptions); none of these changes the result beyond the
  // summation order of the loss chunks, so a resume may change them freely.
  Recompute recompute = Recompute::None;          // --activation-checkpointing none | selective | full
  AttentionKind attention = AttentionKind::Tiled;  // --attention tiled (FlashAttention-2) | exact ([B, NH, T, T] probabilities)
  // --attention-mask causal | document (model.h AttentionMask). Unlike the others it changes what is
  // computed: document masks attention between the documents of a packed sequence (they end at the
  // data's EOS id) and restarts RoPE positions per document, in training and evaluation.
  AttentionMask attention_mask = AttentionMask::Causal;
  // --aux-loss-scope sequence | micro-batch (model.h MoeAuxScope): the rows a mixture-of-experts
  // model's load-balancing loss pools; it changes the objective (train_config "aux_loss_scope" when
  // micro-batch). Dense models: no effect.
  MoeAuxScope aux_scope = MoeAuxScope::Sequence;
  // --router-z-loss-coef: the router z-loss's weight in the loss (ST-MoE; LlamaModel::moe_z_loss,
  // pooled as the load-balancing loss: per aux scope group, then the mean over them); 0 = off (its
  // value is still measured and reported). Dense models: no effect.
  double router_z_loss_coef = 0;
  int loss_chunk = 0;               // tokens per LM-head / loss chunk; 0 = default_loss_chunk(V)
  // Example data (token format version 3: chat or prompt/completion examples with role classes;
  // data/packing.h): set by apply_data_settings when the data has examples. Then every batch is
  // packed rows (PackedBatches), only target tokens count in the loss, and the mean is over the
  // global batch's targets. train_on, pack and max_length change what is trained on (train_config).
  bool examples = false;
  TrainOn train_on = TrainOn::Assistant;                   // --train-on assistant (alias completion) | all
  PackMode pack = PackMode::BestFit;                       // --pack best-fit | none
  MaxLengthPolicy max_length = MaxLengthPolicy::Truncate;  // --max-length-policy truncate | drop
  bool shuffle = true;                                     // --shuffle on | off: the rows' order per epoch
  // How the run computes and communicates: the result is the same for any overlap setting
  // (bitwise); precision changes the arithmetic (recorded in checkpoints, see train_config_json).
  Precision precision = Precision::FP32;  // --precision
  // --precision fp8: precision is BF16 and the blocks' projections run in float8 (ModelOptions::fp8;
  // GPUs with FP8 tensor cores only: the CLI refuses it on the CPU and with MoE models).
  bool fp8 = false;
  bool reduce_bf16 = false;               // --reduce-dtype bf16 (BF16 only): reduce-scatter gradients in bf16
  OverlapConfig overlap{};                // --overlap, --prefetch, --comm-progress
  CpComm cp_comm = CpComm::Ring;          // --cp-comm (with --cp > 1): how a CP group moves K/V
  // --pp-schedule, --pp-virtual, --pp-layers, --pp-reshard (with --pp > 1, the mesh's): the
  // pipeline's schedule, split and resharding (pipeline.h). They change the order of the work, not
  // its result beyond the summation order of gradients over micro-batches, so a resume may change
  // them.
  PipelineOptions pp{};
};

// The model options of a run; throws std::invalid_argument naming the option for a bad value.
ModelOptions model_options(const TrainConfig& tc);

// Thrown on every rank, at the same step, when some rank received SIGTERM or SIGUSR1: the step in
// progress was finished and (with a checkpoint directory) saved. main() exits with kExitPreempted.
struct Preempted : std::runtime_error {
  Preempted(const std::string& m, int sig) : std::runtime_error(m), signal(sig) {}
  int signal;
};

// The settings a resume compares with the checkpoint's train_config, by option name (without
// dashes): seq-len, global-batch, steps, lr, min-lr, warmup, beta1, beta2, adam-eps, weight-decay,
// clip, seed, attention-mask, aux-loss-scope, and for example data train-on, pack, max-length-policy, shuffle. A resume with any of them changed is refused unless '--accept-change'
// names it.
const std::vector<std::string>& resume_checked_settings();

// The run's settings as stored in a checkpoint's `train_config` attribute: a JSON object with
// seq_len, global_batch, micro_batch, steps, lr, min_lr, warmup, beta1, beta2, eps, weight_decay,
// clip, seed, precision ("fp32", "bf16 (fp32 gradient reduce)" or "bf16 (bf16 gradient reduce)")
// and, when world_size > 0, the run's layout: world_size W and shard_group_size G (G = W for plain
// FSDP; 0 means W) (docs/checkpoint-format.md).
// tp > 1 (a tensor-parallel run) adds "tp"; its checkpoints hold the canonical rows of all W
// ranks (shard_group_size = world_size). --attention-mask document adds "attention_mask":
// "document" (absent: causal); --aux-loss-scope micro-batch adds "aux_loss_scope": "micro-batch"
// (absent: sequence); --router-z-loss-coef Z > 0 adds "router_z_loss_coef": Z (absent: 0). Example data (tc.examples) adds "train_on", "pack" and
// "max_length_policy" (their option spellings).
std::string train_config_json(const TrainConfig& tc, int world_size = 0, int shard_group_size = 0, int tp = 1);

// Example data: the scale of the loss gradient on one rank (Trainer::train_step), so that the
// gradient is that of the mean over the global batch's `targets` target tokens: tokens_per_step
// (global_batch x seq_len) / targets / rank_tokens, where rank_tokens (BatchGeometry) is what the
// reduce-scatter's mean over the shard group and replicas divides by in the rank's share (per_rank
// x seq_len / cp): each target's gradient enters with weight 1 / targets. (Plain data: targets =
// tokens_per_step, and the trainer keeps 1 / rank_tokens in float.)
double mean_loss_grad_scale(double tokens_per_step, double targets, double rank_tokens);

// Learning rate at 0-based step s: linear warm-up lr*(s+1)/warmup for s < warmup, then cosine
// decay from lr to min_lr over the remaining steps (nanoGPT's get_lr).
double lr_at(const TrainConfig& tc, int64_t s);

// --skip-spikes Z (llm.c's -sl / -sg outlier detector, one threshold for both): the verdict on a
// step with a finite loss and gradient norm, both globally reduced (the same on every rank).
struct SpikeCheck {
  bool judged = false;  // the window was full; before that (warm-up) nothing is skipped
  bool skip = false;    // loss_z > Z or grad_z > Z (never with Z = 0)
  double loss_z = 0, grad_z = 0;  // (value - mean) / std over the window; 0 when the std is 0
  double loss_mean = 0, loss_std = 0, grad_mean = 0, grad_std = 0;  // the window's (population std)
};
// Judges (loss, grad_norm) against the window of `st` (the values of earlier steps only) with
// threshold `z` (0: off, nothing is skipped), then records the step in `st`: an applied step's
// values enter the window (the oldest leaves past kSpikeWindow); a skipped step's do not, so that
// a spike does not loosen the statistics that judge the next steps, except from the third skip in
// a row on (a lasting change of level is absorbed instead of skipping every later step). Counts
// skipped_updates and skipped_in_a_row.
SpikeCheck check_spike(SpikeStats& st, double loss, double grad_norm, double z);
// Why step was skipped: "loss 312.4 is 5210.3 standard deviations above the mean of the last 128
// steps (2.95, std 0.0571) (--skip-spikes 6)" (and/or the same for grad_norm).
std::string describe_spike(const SpikeCheck& c, double loss, double grad_norm, double z);

// Test hook (docs/errors.md): SHARDTRAIN_TEST_SPIKE_STEP=N[,M...] multiplies the loss and the
// gradient (so its norm, and the gradient AdamW would apply) of those 1-based steps by
// SHARDTRAIN_TEST_SPIKE_SCALE (default 100), after the step's all-reduce: an injected spike.
struct TestSpike {
  std::vector<int64_t> steps;  // empty: the hook is off
  double scale = 1;
  double at(int64_t step) const;  // scale at a listed step, else 1
};
TestSpike test_spike_hook();  // from the environment

// AdamW over this rank's shards (first and second moments exist only for the owned shard).
// Weight decay is applied per parameter slice according to ParamSpec::weight_decay; padding
// elements are never touched.
template <typename T> class AdamW {
 public:
  AdamW(ShardedState<T>& f, const TrainConfig& tc);
  // One update at 1-based step `t` with learning rate `lr`; gradients are multiplied by
  // grad_scale (the clipping factor) first.
  void step(int64_t t, double lr, double grad_scale);
  std::vector<Buffer<T>>& m() { return m_; }
  std::vector<Buffer<T>>& v() { return v_; }

 private:
  struct Segment { int unit; int64_t begin, count; bool decay; };  // shard-local element ranges
  ShardedState<T>& f_;
  TrainConfig tc_;
  std::vector<Buffer<T>> m_, v_;
  std::vector<Segment> segs_;
};

// The tensors a checkpoint of this run holds (checkpoint.h): f's parameter shards ("params"), then,
// when `opt` is given, its moments ("adam_m", "adam_v"), in checkpoint_tensor_names()'s order;
// views of f's and opt's shards (valid while both live).
ShardedTensors checkpoint_tensors(ShardedState<float>& f, AdamW<float>* opt);

// Stragglers: each log interval, every rank's per-step compute time (its step time less its
// exposed communication) and wait time (its exposed communication), gathered over the world. A
// slow rank computes longer; the others wait for it, so their wait time grows instead. The
// straggler is the rank with the longest compute time, flagged when that is more than
// `threshold` x the median over ranks (1.2, issue 30; the median of an even count is the mean of
// the middle two). Needs at least 2 ranks to flag anyone.
struct StragglerStats {
  double compute_min = 0, compute_median = 0, compute_max = 0;  // ms per step
  double wait_min = 0, wait_median = 0, wait_max = 0;           // ms per step
  int slowest = -1;     // rank with the longest compute time (-1: no ranks)
  bool flagged = false;  // compute_max > threshold * compute_median
};
// compute_ms[r], wait_ms[r]: rank r's per-step means. Same size; throws std::invalid_argument if not.
StragglerStats straggler_stats(const std::vector<double>& compute_ms, const std::vector<double>& wait_ms,
                               double threshold = 1.2);

struct StepLog {
  int64_t step = 0;  // 1-based
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, elapsed_s = 0;
  // This step's time (ms): on compute (step time - exposed), FSDP collectives in flight (summed
  // over collectives), and waiting for them (exposed communication). See CommTimes (comm_queue.h).
  double compute_ms = 0, comm_ms = 0, exposed_comm_ms = 0;
  // Time waiting for communication, every dimension's (CommStats::exposed_s, parallelize.h: FSDP's
  // exposed_comm_ms, the blocking TP collectives, CP's and PP's waits): step time = compute_ms +
  // wait_ms.
  double wait_ms = 0;
  StragglerStats ranks;  // over all ranks (logged steps only; zero elsewhere)
  bool update_skipped = false;  // the update was not applied (--skip-nonfinite, --skip-spikes)
};
struct EvalLog {
  int64_t step = 0;
  double val_loss = 0;
};
struct TrainResult {
  std::vector<StepLog> steps;  // every step (all ranks hold the same values)
  std::vector<EvalLog> evals;
  double train_seconds = 0;    // wall time of the training steps (evaluation excluded)
  double tokens_per_s = 0;     // global tokens / train_seconds
};

// Where a run computes. The backends run on one device (CPU, or this rank's GPU); every
// communicator (control traffic, the shard group's and the replica group's buffers) is the mesh's.
// Nothing here is owned: main() keeps the mesh and the backends alive for the run.
struct Engine {
  const Mesh& mesh;               // dimensions, communicators, who reads / writes / counts what (mesh.h)
  Backend<float>& be;             // fp32: master shards, AdamW, and fp32 compute
  Backend<bf16>* be16 = nullptr;  // bf16 compute; required when TrainConfig::precision == BF16
  double peak_flops = 0;          // the job's peak FLOP/s for MFU, all ranks together (mfu.h); 0 = unknown (MFU n/a)
};

// Model FLOPs per trained token at sequence length T (forward + backward), as PaLM counts them
// (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", appendix B; also
// nanoGPT's estimate_mfu):
//     flops_per_token = 6 N + 12 L H Q T
//   6 N: 2 FLOPs per multiply-add of each weight, once forward and twice backward (input and
//     weight gradients). N = the weights that multiply: every parameter of the model
//     (ModelConfig::num_params) except an untied input embedding table, which is a row lookup
//     (nanoGPT leaves its position-embedding table out for the same reason; a tied table counts
//     once, as the LM head's matrix). GQA's narrower K/V projections and SwiGLU's three matrices
//     enter through N; the RMSNorm weights (2 C per layer + C) stay in N, as in PaLM (< 0.01%).
//   12 L H Q T: attention's two T-long products per token and layer (scores Q K^T, then P V),
//     2 FLOPs each multiply-add, x3 for forward and backward; L layers, H = num_attention_heads,
//     Q = head_dim (H Q = hidden_size unless config.json gives head_dim), T = --seq-len. Causal
//     masking is not halved (PaLM does not), so MFU is comparable with PaLM's and nanoGPT's.
// Recomputation (--activation-checkpointing) is not counted: model FLOPs, not hardware FLOPs.
// MFU = tokens/s x this / the job's peak FLOP/s (mfu.h).
double flops_per_token(const ModelConfig& c, int T);

// Collective. Trains `model_cfg` on `data` with `tc`, from a fresh init or from the checkpoint
// named by tc.resume (any world size, any device, any precision: checkpoints hold fp32 master
// weights). Saves checkpoints as tc asks. Throws CollectiveError (same message on every rank) if
// the batch geometry does not fit the world size or the data, memory runs out, or a checkpoint
// cannot be read or written.
TrainResult train(Engine& eng, const ModelConfig& model_cfg, const TrainConfig& tc, const TokenDataset& data);

// The options of example data as given on the command line or in a job file ("" = not given).
struct DataOptionsGiven {
  std::string train_on, pack, max_length_policy, shuffle, attention_mask;
};
// Settles tc's example-data settings against `data` (identical on every rank, so is the result):
// example data (TokenDataset::has_examples) sets tc.examples, the given --train-on / --pack /
// --max-length-policy / --shuffle (defaults: assistant, best-fit, truncate, on) and, when --attention-mask was not
// given, the document mask (each example its own document); `note` gets a line saying so. Returns
// "" or why the options do not fit the data, naming the option and the file: '--train-on assistant'
// (or completion), '--pack', '--max-length-policy', '--shuffle' on data without examples (every token a target);
// '--attention-mask causal' with packed rows (examples would attend to each other). Throws
// std::invalid_argument for a misspelled value (naming the option).
std::string apply_data_settings(TrainConfig& tc, const TokenDataset& data, const DataOptionsGiven& given,
                                std::string* note);

// "" when tc's attention mask fits `data`, else why not: '--attention-mask document' with data that
// names no EOS id (eos_id kNoTokenId: llm.c / nanoGPT files, a tokenizer without EOS), naming the
// option and the files. The same on every rank (the data's header is).
std::string check_attention_mask(const TrainConfig& tc, const TokenDataset& data);
// The layout of a micro-batch of tokens [B, T] for the model's forward under tc's mask: empty for
// causal; for document the positions and documents of document_layout (data.h) at the data's EOS
// id, written into pos and doc (resized to B * T), which the result points into.
TokenLayout batch_layout(const TrainConfig& tc, const TokenDataset& data, const int32_t* tokens, int B, int T,
                         std::vector<int32_t>& pos, std::vector<int32_t>& doc);

// The micro-batches of `data` as a StageRunner reads them (stage_runner.h MicroBatchReader):
// fill_batch (data.h) with tc.seed and tc.seq_len, then batch_layout under tc's mask (positions and
// document ids kept by the reader until its next call). Borrows `data`; copies tc.
MicroBatchReader batch_reader(const TrainConfig& tc, const TokenDataset& data);
// Example data (tc.examples): the packed rows of `batches` (PackedBatches::fill: targets kNoTarget
// where the loss does not count; positions and documents per example), shared with the caller.
MicroBatchReader batch_reader(std::shared_ptr<const PackedBatches> batches);

// Collective over mesh.world(). Mean validation loss (nats/token) of the model `runner` runs
// (stage_runner.h, reading through batch_reader) over `batches` global batches of the validation
// split; this rank reads the rows of its data-parallel index (Mesh::dp_index), global_batch / dp_size
// sequences of each batch, in micro-batches of tc.micro_batch (0: all at once), through the
// forwards of `schedule` (ParallelPlan::eval_schedule, parallelize.h): with a pipeline the last
// stage computes the loss. The mean is over the batches' target tokens: those of `packed` (example
// data), else every token (batches x global_batch x seq_len).
template <typename T>
double evaluate(const Mesh& mesh, StageRunner<T>& runner, UnitSource<T>& f, const Schedule& schedule,
                const TrainConfig& tc, int batches, const PackedBatches* packed = nullptr);

}  // namespace shardtrain
