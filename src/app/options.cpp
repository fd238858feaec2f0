// Option parsing with Boost.ProgramOptions; range checks that name the offending option.
#include "shardtrain/app/options.h"
#include "shardtrain/runtime/files.h"
#include "shardtrain/data/data.h"
#include "shardtrain/parallel/geometry.h"  // parse_cp_comm
#include "shardtrain/runtime/pipeline_kind.h"  // parse_pipeline_kind

#include <boost/program_options.hpp>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace shardtrain {
namespace po = boost::program_options;

namespace {
// default_value for doubles shown as typed (0.1, not 0.10000000000000001, which is what Boost's
// own lexical_cast of the value prints): the shortest text that reads back as the same double
// (std::to_chars), so --help neither shows noise digits nor rounds a default it does not hold.
// Every double option goes through this.
po::typed_value<double>* dbl(double* v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, *v);
  return po::value<double>(v)->default_value(*v, std::string(buf, r.ptr));
}

po::options_description describe(Options& o) {
  TrainConfig& t = o.train;
  po::options_description gen("General");
  gen.add_options()
      ("help,h", "print this help and exit")
      ("config", po::value<std::string>(&o.config_file), "INI job file (key = value, long option names); the command line overrides it")
      ("mode", po::value<std::string>(&o.mode)->default_value(o.mode), "job to run: train | prepare (text -> token file) | tokenizer (train a SentencePiece model) | inspect | export | import | generate | plan (memory per rank, no launch needed)")
      ("threads", po::value<int>(&o.threads)->default_value(o.threads), "threads per rank (OpenMP; each calls OpenBLAS single-threaded); 0 = the cores this rank may run on (its CPU affinity), shared with the ranks of its node bound to the same cores")
      ("collective-timeout", dbl(&o.collective_timeout), "seconds a collective may wait for the other ranks before this rank ends the job (a peer died or hangs); 0 = never")
      ("device", po::value<std::string>(&o.device)->default_value(o.device), "train on: auto (cuda when a GPU is visible, else cpu) | cpu | cuda (one GPU per rank: the local rank's)")
      ("gpu-comm", po::value<std::string>(&o.gpu_comm)->default_value(o.gpu_comm), "GPU collectives: nccl (one rank per GPU) | mpi (through MPI on host copies; lets several ranks share a GPU)")
      ("precision", po::value<std::string>(&o.precision)->default_value(o.precision), "fp32 | bf16 (mixed precision: bf16 weights for compute and bf16 activations, fp32 master weights, AdamW state and GEMM accumulation) | fp8 (bf16, and the transformer blocks' projections as float8 GEMMs with per-tensor dynamic scales; GPUs with FP8 tensor cores, sm_89 or newer, only; not with MoE models)")
      ("reduce-dtype", po::value<std::string>(&o.reduce_dtype)->default_value(o.reduce_dtype), "with --precision bf16: gradients are reduce-scattered in fp32 | bf16 (half the bytes)")
      ("overlap", po::value<std::string>(&o.overlap)->default_value(o.overlap), "on: all-gathers are prefetched and reduce-scatters run asynchronously, behind the compute | off: every collective is waited for when it is started (the reference: results are bitwise the same)")
      ("prefetch", po::value<int>(&o.prefetch)->default_value(o.prefetch), "with --overlap on: units whose all-gather runs ahead of the unit being computed (each needs a buffer of the largest unit)")
      ("comm-progress", po::value<std::string>(&o.comm_progress)->default_value(o.comm_progress), "with --overlap on, CPU: what advances MPI's nonblocking collectives: poll (MPI_Test between GEMM tiles; hid the most in docs/benchmarks.md) | thread (a communication thread) | wait (only when started and waited for)")
      ("shard-group-size", po::value<std::string>(&o.shard_group_size), "hybrid sharding (HSDP): shard parameters within groups of G consecutive ranks and replicate them across the W / G groups; a number dividing the world size, or 'node' (the ranks of one node); default: the world size (plain FSDP). With --tp N and --cp C, G counts ranks and must be a multiple of C x N")
      ("tp", po::value<int>(&o.tp)->default_value(o.tp), "tensor parallelism (Megatron-style, with sequence parallelism): groups of N consecutive ranks (inside a node) split every layer's heads and MLP and the vocabulary; FSDP shards each rank's slice over the data-parallel ranks. N must divide the world size, the attention and key/value heads, the intermediate size and the tokens of a micro-batch")
      ("cp", po::value<int>(&o.cp)->default_value(o.cp), "context parallelism: every sequence is split over a CP group of N ranks (head-tail: 2 x N chunks, rank r holding chunks r and 2N-1-r), which read the same batch rows; FSDP shards over dp_shard x cp. N (x --tp) must divide the world size, 2 x N the sequence length; --attention tiled only. --cp-comm chooses how K/V move; --mode plan --cp N plans it")
      ("ep", po::value<int>(&o.ep)->default_value(o.ep), "expert parallelism (mixture-of-experts models): the E experts of every MoE block split over an EP group of N ranks that hold different tokens (N consecutive ranks of the FSDP shard group, no ranks of its own); tokens travel to their experts and back by all-to-all. N must divide num_experts and dp_shard x cp; --mode plan --ep N plans it")
      ("cp-comm", po::value<std::string>(&o.cp_comm)->default_value(o.cp_comm), "with --cp N > 1: how K/V move between the ranks of a CP group: ring (blocks pass around the group, overlapped with the block attention) | allgather (K/V gathered before attention, dK/dV reduce-scattered after it)")
      ("pp", po::value<int>(&o.pp)->default_value(o.pp), "pipeline parallelism: P stages, the mesh's outermost dimension (stages across nodes, everything else inside a stage); each stage holds a contiguous range of blocks (the embedding on the first, the final norm and head on the last) and passes activations to the next. P must divide the world size and be at most the blocks")
      ("pp-schedule", po::value<std::string>(&o.pp_schedule)->default_value(o.pp_schedule), "with --pp P > 1: gpipe | 1f1b | interleaved (--pp-virtual V chunks per rank; micro-batches a multiple of P) | zero-bubble (ZB-H1: weight gradients deferred into the bubble)")
      ("pp-virtual", po::value<int>(&o.pp_virtual)->default_value(o.pp_virtual), "with --pp-schedule interleaved: model chunks per pipeline rank (V >= 2; rank r holds chunks r, r + P, ...)")
      ("pp-layers", po::value<std::string>(&o.pp_layers), "with --pp: blocks of each chunk by hand, 'a,b,...' (P x V numbers summing to the blocks); default: an even split counting the embedding and the head as one block each")
      ("pp-reshard", po::value<std::string>(&o.pp_reshard)->default_value(o.pp_reshard), "with --pp P > 1: when a stage's FSDP units are resharded: per-step (each unit all-gathered once per step and kept unsharded until the step's end, its gradient accumulated over the micro-batches and reduce-scattered once: the stage's units and their full gradients stay in memory) | per-microbatch (gathered and reduce-scattered again for every micro-batch, as without a pipeline)");
  po::options_description data("Data (--mode prepare, --mode tokenizer; docs/data-format.md)");
  data.add_options()
      ("input", po::value<std::vector<std::string>>(&o.inputs)->multitoken(), "text inputs (repeatable): files, directories (their files, recursively, sorted; hidden ones left out) or glob patterns; a plain-text file is one document, a .jsonl file one document per line")
      ("out", po::value<std::string>(&o.out), "output: token file (prepare), SentencePiece .model (tokenizer), Hugging Face directory (export), checkpoint file (import), the model's Hugging Face config.json (plan)")
      ("val-fraction", dbl(&o.val_fraction), "prepare: fraction of tokens (the last ones) held out for validation, in (0, 1)")
      ("tokenizer", po::value<std::string>(&o.tokenizer)->default_value(o.tokenizer), "prepare: byte-level | a SentencePiece .model file | a directory holding tokenizer.model (e.g. a Hugging Face Llama directory); each document becomes BOS (if the tokenizer has one) + ids + EOS")
      ("text-field", po::value<std::string>(&o.text_field)->default_value(o.text_field), "prepare, tokenizer: the JSON field holding the text in .jsonl inputs")
      ("vocab-size", po::value<int>(&o.vocab_size)->default_value(o.vocab_size), "tokenizer: vocabulary size of the SentencePiece BPE model to train (Llama-style: byte fallback, so >= 256 + 3 + the corpus' characters)");
  po::options_description model("Model");
  model.add_options()
      ("model", po::value<std::string>(&o.model)->default_value(o.model), "preset name (tiny, tiny-moe, test-uneven, demo, llama-125m, llama-350m, llama-1b, tinyllama-1.1b, llama-8b, llama-70b, llama-405b, mixtral-8x7b, qwen3-30b-a3b) or path to a Hugging Face config.json of a LlamaForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or Qwen3MoeForCausalLM");
  po::options_description tr("Training (--mode train)");
  tr.add_options()
      ("data", po::value<std::vector<std::string>>(&o.data), "training token file(s), repeatable, each a path or a glob pattern (sorted): shardtrain files (--mode prepare; their train splits), llm.c .bin shards, nanoGPT train.bin; files are memory-mapped and concatenated in order")
      ("val-data", po::value<std::vector<std::string>>(&o.val_data), "validation token file(s), repeatable, paths or glob patterns, all their tokens; default: the validation splits of the shardtrain '--data' files")
      ("data-format", po::value<std::string>(&o.data_format)->default_value(o.data_format), "format of the --data / --val-data files: auto (by magic: shardtrain or llm.c) | shardtrain | llmc | nanogpt (raw uint16, no header: needs this flag)")
      ("seq-len", po::value<int>(&t.seq_len)->default_value(t.seq_len), "sequence length T, tokens")
      ("global-batch", po::value<int>(&t.global_batch)->default_value(t.global_batch), "sequences per optimizer step over all ranks; divisible by world size x micro-batch")
      ("micro-batch", po::value<int>(&t.micro_batch)->default_value(t.micro_batch), "sequences per rank per forward/backward; 0 = global-batch / world size (no accumulation)")
      ("steps", po::value<int64_t>(&t.steps)->default_value(t.steps), "optimizer steps")
      ("lr", dbl(&t.lr), "peak learning rate")
      ("min-lr", dbl(&t.min_lr), "learning rate at the end of the cosine decay")
      ("warmup", po::value<int64_t>(&t.warmup)->default_value(t.warmup), "linear warm-up, steps")
      ("beta1", dbl(&t.beta1), "AdamW beta1, in [0, 1)")
      ("beta2", dbl(&t.beta2), "AdamW beta2, in [0, 1)")
      ("adam-eps", dbl(&t.eps), "AdamW epsilon")
      ("weight-decay", dbl(&t.weight_decay), "AdamW decoupled weight decay (not on norm weights)")
      ("clip", dbl(&t.clip), "max global gradient L2 norm; 0 disables clipping")
      ("seed", po::value<uint64_t>(&t.seed)->default_value(t.seed), "seed of the init and of the data order")
      ("log-every", po::value<int64_t>(&t.log_every)->default_value(t.log_every), "steps between log lines")
      ("eval-every", po::value<int64_t>(&t.eval_every)->default_value(t.eval_every), "steps between validation evaluations; 0 = only at the end")
      ("eval-batches", po::value<int>(&t.eval_batches)->default_value(t.eval_batches), "global batches of the validation split per evaluation")
      ("metrics", po::value<std::string>(&t.metrics_path), "JSON-lines metrics file written by rank 0")
      ("tensorboard", po::value<std::string>(&t.tensorboard_dir), "directory for TensorBoard event files of the same records (rank 0 writes; created if missing): tensorboard --logdir DIR, or wandb sync --sync-tensorboard DIR")
      ("train-on", po::value<std::string>(&o.data_given.train_on), "example data (chat or prompt/completion examples written by scripts/tokenize_hf.py): which tokens are targets of the loss: assistant (default; alias completion: the answers and their end-of-turn tokens) | all (every token after an example's first)")
      ("pack", po::value<std::string>(&o.data_given.pack), "example data: best-fit (default: examples packed into rows of --seq-len, best-fit decreasing, each under the document mask) | none (one example per row, padded)")
      ("shuffle", po::value<std::string>(&o.data_given.shuffle), "example data: on (default: each epoch's rows in a seeded random order) | off (the rows in packing order; with --pack none the examples in file order)")
      ("max-length-policy", po::value<std::string>(&o.data_given.max_length_policy), "example data: an example longer than --seq-len is truncate'd (default: its first --seq-len tokens) or drop'ped; either is counted at start")
      ("peak-tflops", po::value<double>(&o.peak_tflops), "MFU: the peak of each rank's device, TFLOP/s (GPU: dense bf16, or plain FP32 for fp32 runs; CPU: what its cores can do); replaces the GPU peak table and the CPU's measured peak. Default: the table by the GPU's name, or measured at start-up on the CPU");
  po::options_description mem("Memory (train, plan)");
  mem.add_options()
      ("activation-checkpointing", po::value<std::string>(&o.activation_checkpointing)->default_value(o.activation_checkpointing), "none | selective (keep GEMM outputs, recompute elementwise parts) | full (keep each block's input, recompute the block in backward); gradients are identical")
      ("attention", po::value<std::string>(&o.attention)->default_value(o.attention), "tiled (FlashAttention-2: no [T, T] matrices) | exact (keeps the [B, heads, T, T] probabilities; reference)")
      ("attention-mask", po::value<std::string>(&o.attention_mask)->default_value(o.attention_mask), "causal | document: a token attends only to earlier tokens of its own document (documents end at the data's EOS id; in chat data each example is one) and RoPE positions restart at 0 per document (packed sequences, as Llama 3); training and evaluation. Chat data: document unless given (causal is refused with --pack best-fit)")
      ("router-z-loss-coef", dbl(&o.train.router_z_loss_coef), "mixture-of-experts models: the weight of the router z-loss (ST-MoE: the mean of logsumexp(router logits)^2 over the tokens and MoE blocks of each --aux-loss-scope group, as the load-balancing loss) in the loss, e.g. 1e-3; 0 = off (the value is still reported as z_loss)")
      ("aux-loss-scope", po::value<std::string>(&o.aux_loss_scope)->default_value(o.aux_loss_scope), "mixture-of-experts models: the rows the load-balancing loss pools, sequence (each sequence alone, the loss the mean over the global batch's sequences: the same at every layout) | micro-batch (every row of a micro-batch, as transformers' load_balancing_loss_func; the loss the mean over the micro-batches)")
      ("loss-chunk", po::value<int>(&t.loss_chunk)->default_value(t.loss_chunk), "tokens per LM-head and cross-entropy chunk (no [tokens, vocab] logits are held); 0 = max(256, 2^24 / vocab)")
      ("world-size", po::value<int>(&o.plan_world_size)->default_value(o.plan_world_size), "plan: ranks to plan for; 0 = the ranks of this launch")
      ("device-memory", po::value<std::string>(&o.device_memory), "plan: memory of one device, e.g. 80GB, 141GB: also print the largest micro-batch that fits for each --activation-checkpointing mode");
  po::options_description ck("Checkpoints");
  ck.add_options()
      ("checkpoint-dir", po::value<std::string>(&t.checkpoint_dir), "directory of HDF5 checkpoints (step_N.h5 and a 'latest' pointer); empty: none")
      ("checkpoint-every", po::value<int64_t>(&t.checkpoint_every)->default_value(t.checkpoint_every), "steps between checkpoints; 0 = only at the end of training")
      ("checkpoint-async", po::value<std::string>(&o.checkpoint_async)->default_value(o.checkpoint_async), "on: periodic saves are written by a background thread while training goes on (the final and a preemption save wait for it); off: every save stops training until written")
      ("keep-last", po::value<int>(&t.keep_last)->default_value(t.keep_last), "published checkpoints to keep, older ones are deleted after a save; 0 = keep all")
      ("resume", po::value<std::string>(&t.resume), "'auto' (newest checkpoint in --checkpoint-dir, if any) or a checkpoint file; at any world size")
      ("accept-change", po::value<std::vector<std::string>>(&t.accept_changes)->composing(), "resume: let these settings differ from the checkpoint's (comma-separated option names, e.g. steps,lr; repeatable); any other change is refused")
      ("start-over", po::bool_switch(&t.start_over), "train from step 0 although --checkpoint-dir's 'latest' names a checkpoint that no longer exists (the old metrics rows are moved aside)")
      ("skip-nonfinite", po::bool_switch(&t.skip_nonfinite), "skip the update of a step whose loss or gradient norm is not finite, instead of stopping")
      ("skip-spikes", dbl(&t.skip_spikes), "Z: skip the update of a step whose loss or gradient norm is more than Z standard deviations above the mean of the last 128 steps (nothing is skipped before 128 steps); 0 = off")
      ("stop-at-step", po::value<int64_t>(&t.stop_at_step)->default_value(t.stop_at_step), "stop and save after this step, keeping the LR schedule of --steps; 0 = run to --steps")
      ("checkpoint", po::value<std::string>(&o.checkpoint), "checkpoint file for --mode inspect (also the positional argument)")
      ("dump-param", po::value<std::string>(&o.dump_param), "inspect: gather this parameter (canonical name), or 'all' ...")
      ("dump-out", po::value<std::string>(&o.dump_out), "inspect: ... and write it to this file as raw little-endian float32 (with 'all': to DIR/<name>.bin)")
      ("debug-crash-before-publish", po::value<int64_t>(&t.debug_crash_before_publish)->default_value(0), "testing: exit with status 86 after writing the checkpoint of this step, before publishing it");
  po::options_description hf("Hugging Face export / import, generation");
  hf.add_options()
      ("dtype", po::value<std::string>(&o.dtype)->default_value(o.dtype), "export: tensor dtype fp32 | bf16 | fp16 (rounded to nearest even from fp32)")
      ("max-shard-size", po::value<std::string>(&o.max_shard_size)->default_value(o.max_shard_size), "export: bytes per safetensors file, e.g. 5GB, 200MB; larger models get an index")
      ("hf-dir", po::value<std::string>(&o.hf_dir), "import: Hugging Face model directory (config.json + safetensors)")
      ("init-from", po::value<std::string>(&t.init_from), "train: start from this checkpoint's weights at step 0 (e.g. one made by --mode import)")
      ("prompt", po::value<std::string>(&o.prompt)->default_value(o.prompt), "generate: text after BOS, encoded with the checkpoint's tokenizer")
      ("max-new-tokens", po::value<int>(&o.max_new_tokens)->default_value(o.max_new_tokens), "generate: tokens (bytes) to sample")
      ("temperature", dbl(&o.temperature), "generate: sampling temperature; 0 = greedy")
      ("top-k", po::value<int>(&o.top_k)->default_value(o.top_k), "generate: sample among the k most likely tokens; 0 = all")
      ("dump-logits", po::value<std::string>(&o.dump_logits), "generate: write the float32 logits [T, V] of BOS + prompt to this file")
      ("prompt-ids", po::value<std::string>(&o.prompt_ids), "generate: token ids after BOS, comma-separated (e.g. 5,70000,128255), in place of --prompt's bytes")
      ("print-ids", po::bool_switch(&o.print_ids), "generate: also print the prompt's and the generated token ids");
  po::options_description all(
      "shardtrain: fully sharded (FSDP / ZeRO-3) Llama training over MPI.\n"
      "Usage: mpirun -np N shardtrain [--config JOB.ini] [options]   (command line overrides the job file)");
  all.add(gen).add(data).add(model).add(tr).add(mem).add(ck).add(hf);
  return all;
}

void check(bool ok, const std::string& opt, const std::string& what) {
  if (!ok) throw std::invalid_argument("option '--" + opt + "' " + what);
}
}  // namespace

int resolve_shard_group_size(const std::string& v, int world, int ranks_per_node, const std::string& ranks) {
  int g = world;
  if (v == "node") {
    check(world == 0 || ranks_per_node > 0, "shard-group-size",
          "'node' needs the same number of ranks on every node, and the nodes of this job hold different numbers");
    g = ranks_per_node;
  } else if (!v.empty()) {
    size_t used = 0;
    long n = 0;
    try {
      n = std::stol(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    check(used == v.size() && n >= 1 && n <= (1 << 24), "shard-group-size",
          "must be a positive integer or 'node', got '" + v + "'");
    g = static_cast<int>(n);
  }
  if (world > 0)
    check(world % g == 0, "shard-group-size",
          "(" + std::to_string(g) + (v == "node" ? ", the ranks per node" : "") +
              ") does not divide " + (ranks.empty() ? "the world size (" + std::to_string(world) + ")" : ranks));
  return g;
}

MeshDims resolve_mesh_dims(const std::string& sgs, int tp, int cp, int world, int ranks_per_node, int pp, int ep) {
  check(ep >= 1 && ep <= (1 << 16), "ep", "must be an integer in [1, 65536], got " + std::to_string(ep));
  check(pp >= 1 && pp <= (1 << 16), "pp", "must be an integer in [1, 65536], got " + std::to_string(pp));
  check(tp >= 1 && tp <= (1 << 16), "tp", "must be an integer in [1, 65536], got " + std::to_string(tp));
  check(cp >= 1 && cp <= (1 << 16), "cp", "must be an integer in [1, 65536], got " + std::to_string(cp));
  if (world > 0)
    check(world % pp == 0, "pp",
          "(" + std::to_string(pp) + ") does not divide the world size (" + std::to_string(world) + ")");
  // Everything below is inside one pipeline stage: its W / P ranks.
  const int stage = world > 0 ? world / pp : 0;
  const std::string ranks = pp > 1 ? "the ranks of a pipeline stage (" + std::to_string(stage) + " = world size " +
                                         std::to_string(world) + " / '--pp' " + std::to_string(pp) + ")"
                                   : "the world size (" + std::to_string(world) + ")";
  if (stage > 0) check(stage % tp == 0, "tp", "(" + std::to_string(tp) + ") does not divide " + ranks);
  const int64_t ct = int64_t{cp} * tp;  // up to 2^32
  if (stage > 0)
    check(stage % ct == 0, "cp",
          "(" + std::to_string(cp) + ")" + (tp > 1 ? " x '--tp' (" + std::to_string(tp) + ")" : std::string()) +
              " does not divide " + ranks + ": the ranks are " + (pp > 1 ? "pp x " : "") +
              "dp_replicate x dp_shard x cp x tp");
  const int g = resolve_shard_group_size(sgs, stage, ranks_per_node, ranks);
  if (stage > 0 && g % ct != 0) {
    const std::string what = cp > 1 ? "'--cp' x '--tp' (" + std::to_string(cp) + " x " + std::to_string(tp) + ")"
                                    : "'--tp' (" + std::to_string(tp) + ")";
    check(false, "shard-group-size",
          "(" + std::to_string(g) + ") is not a multiple of " + what + ": a shard group is made of whole " +
              (cp > 1 ? "CP and TP groups" : "TP groups"));
  }
  MeshDims d{stage > 0 ? stage / g : 1, stage > 0 ? static_cast<int>(g / ct) : 1, cp, tp};
  d.pp = pp;
  if (stage > 0)
    check(d.fsdp() % ep == 0, "ep",
          "(" + std::to_string(ep) + ") does not divide the FSDP shard group (dp_shard " + std::to_string(d.dp_shard) +
              " x cp " + std::to_string(cp) + " = " + std::to_string(d.fsdp()) + (d.fsdp() == 1 ? " rank" : " ranks") +
              "): an EP group is ranks of one shard group that hold different tokens" +
              (world / d.fsdp() > 1
                   ? " (the " + std::to_string(world) + " ranks are " + (pp > 1 ? "pp " + std::to_string(pp) + " x " : "") +
                         "dp_replicate " + std::to_string(d.dp_replicate) + " x shard group " + std::to_string(d.fsdp()) +
                         (tp > 1 ? " x tp " + std::to_string(tp) : "") + ")"
                   : std::string()));
  d.ep = ep;
  return d;
}

std::vector<int> parse_pp_layers(const std::string& s) {
  std::vector<int> out;
  if (s.empty()) return out;
  size_t i = 0;
  while (true) {
    const size_t j = s.find(',', i);
    const std::string t = s.substr(i, j == std::string::npos ? std::string::npos : j - i);
    check(!t.empty() && t.size() <= 6 && t.find_first_not_of("0123456789") == std::string::npos && std::stoi(t) > 0,
          "pp-layers", "must be comma-separated positive block counts such as '3,4,4,3', got '" + s + "'");
    out.push_back(std::stoi(t));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

namespace {
void finite(double v, const std::string& opt) { check(std::isfinite(v), opt, "must be a finite number"); }

// The mode, the model's options (parsed only for their errors), --mode plan's and generation's
// settings, and what export, generate and import require.
void validate_mode(const Options& o) {
  const TrainConfig& t = o.train;
  check(o.mode == "train" || o.mode == "prepare" || o.mode == "tokenizer" || o.mode == "inspect" || o.mode == "export" || o.mode == "import" ||
            o.mode == "generate" || o.mode == "plan",
        "mode", "must be train, prepare, tokenizer, inspect, export, import, generate or plan, got '" + o.mode + "'");
  parse_recompute(o.activation_checkpointing);  // throws naming option '--activation-checkpointing'
  parse_attention(o.attention);                 // throws naming option '--attention'
  parse_attention_mask(o.attention_mask);       // throws naming option '--attention-mask'
  parse_aux_scope(o.aux_loss_scope);            // throws naming option '--aux-loss-scope'
  model_options(t);                             // throws naming option '--loss-chunk'
  check(o.plan_world_size >= 0, "world-size", "must be >= 0 (0: the ranks of this launch)");
  if (!o.device_memory.empty()) {
    try {
      parse_size(o.device_memory);
    } catch (const std::invalid_argument&) {
      check(false, "device-memory", "must be a size like 80GB or 139GiB, got '" + o.device_memory + "'");
    }
    // A bare number would be bytes (what --max-shard-size reads): '80' meaning 80 GB would plan for
    // a device of 80 bytes, on which nothing fits. A device's memory is given with its unit.
    const char last = o.device_memory.back();
    check(!(std::isdigit(static_cast<unsigned char>(last)) || last == '.'), "device-memory",
          "needs a unit, e.g. 80GB or 139GiB, got '" + o.device_memory + "' (a bare number would be bytes)");
  }
  finite(o.temperature, "temperature");
  check(o.temperature >= 0, "temperature", "must be >= 0");
  check(o.top_k >= 0, "top-k", "must be >= 0");
  check(o.max_new_tokens >= 0, "max-new-tokens", "must be >= 0");
  check(o.prompt_ids.empty() || o.prompt.empty(), "prompt-ids", "and '--prompt' exclude each other");
  if (o.mode == "export" || o.mode == "generate")
    check(!o.checkpoint.empty(), "checkpoint", "is required with --mode " + o.mode + " (or give the file as an argument)");
  if (o.mode == "export") {
    check(!o.out.empty(), "out", "is required with --mode export (the Hugging Face directory to write)");
    parse_export_dtype(o.dtype);
    parse_size(o.max_shard_size);
  }
  if (o.mode == "import") {
    check(!o.hf_dir.empty(), "hf-dir", "is required with --mode import");
    check(!o.out.empty(), "out", "is required with --mode import (the checkpoint file to write)");
  }
}

// Checkpoints and resuming, --mode inspect's, the threads, the peak TFLOP/s, the device.
void validate_checkpoints_and_devices(const Options& o) {
  const TrainConfig& t = o.train;
  check(t.checkpoint_every >= 0, "checkpoint-every", "must be >= 0");
  check(t.keep_last >= 0, "keep-last", "must be >= 0");
  check(t.stop_at_step >= 0, "stop-at-step", "must be >= 0");
  if (t.resume == "auto") check(!t.checkpoint_dir.empty(), "resume", "auto needs '--checkpoint-dir'");
  for (const std::string& k : t.accept_changes) {
    const auto& known = resume_checked_settings();
    std::string list;
    for (auto& n : known) list += (list.empty() ? "" : ", ") + n;
    check(std::find(known.begin(), known.end(), k) != known.end(), "accept-change",
          "names '" + k + "', which is not a setting a resume checks (" + list + ")");
  }
  if (o.mode == "inspect") check(!o.checkpoint.empty(), "checkpoint", "is required with --mode inspect (or give the file as an argument)");
  if (!o.dump_param.empty()) check(!o.dump_out.empty(), "dump-out", "is required with --dump-param");
  check(o.threads >= 0 && o.threads <= 1024, "threads", "must be in [0, 1024]");
  if (o.peak_tflops_given) {
    finite(o.peak_tflops, "peak-tflops");
    check(o.peak_tflops > 0, "peak-tflops", "must be > 0 (TFLOP/s of each rank's device)");
    // A device's peak lies far inside [1e-6, 1e6] TFLOP/s (1 MFLOP/s .. 1 EFLOP/s); outside it the
    // job's peak (a sum over ranks) and MFU over- or underflow into inf, 0 or absurd percentages.
    check(o.peak_tflops >= 1e-6 && o.peak_tflops <= 1e6, "peak-tflops",
          [&] {
            char b[64];
            std::snprintf(b, sizeof b, "must be in [1e-6, 1e6] TFLOP/s per device (got %g)", o.peak_tflops);
            return std::string(b);
          }());
  }
  check(o.device == "auto" || o.device == "cpu" || o.device == "cuda", "device", "must be auto, cpu or cuda, got '" + o.device + "'");
  check(o.gpu_comm == "nccl" || o.gpu_comm == "mpi", "gpu-comm", "must be nccl or mpi, got '" + o.gpu_comm + "'");
}

// The mesh (shard groups, TP, CP, PP), precision and the communication settings.
void validate_parallelism(const Options& o) {
  if (!o.shard_group_size.empty()) resolve_shard_group_size(o.shard_group_size, 0, 0);  // the form only
  check(o.tp >= 1 && o.tp <= (1 << 16), "tp", "must be an integer in [1, 65536], got " + std::to_string(o.tp));
  check(o.cp >= 1 && o.cp <= (1 << 16), "cp", "must be an integer in [1, 65536], got " + std::to_string(o.cp));
  check(o.ep >= 1 && o.ep <= (1 << 16), "ep", "must be an integer in [1, 65536], got " + std::to_string(o.ep));
  parse_cp_comm(o.cp_comm);  // throws naming option '--cp-comm'
  check(o.pp >= 1 && o.pp <= (1 << 16), "pp", "must be an integer in [1, 65536], got " + std::to_string(o.pp));
  {
    PipelineKind k;
    check(parse_pipeline_kind(o.pp_schedule, &k), "pp-schedule",
          "must be gpipe, 1f1b, interleaved or zero-bubble, got '" + o.pp_schedule + "'");
  }
  check(o.pp_virtual >= 1 && o.pp_virtual <= 1024, "pp-virtual", "must be an integer in [1, 1024], got " + std::to_string(o.pp_virtual));
  parse_pp_layers(o.pp_layers);  // the form; pipeline_split checks the numbers against the model
  check(o.pp_reshard == "per-step" || o.pp_reshard == "per-microbatch", "pp-reshard",
        "must be per-step or per-microbatch, got '" + o.pp_reshard + "'");
  parse_precision(o.precision);  // throws naming option '--precision'
  check(o.reduce_dtype == "fp32" || o.reduce_dtype == "bf16", "reduce-dtype", "must be fp32 or bf16, got '" + o.reduce_dtype + "'");
  check(o.checkpoint_async == "on" || o.checkpoint_async == "off", "checkpoint-async",
        "must be on or off, got '" + o.checkpoint_async + "'");
  check(o.overlap == "on" || o.overlap == "off", "overlap", "must be on or off, got '" + o.overlap + "'");
  check(o.prefetch >= 0 && o.prefetch <= 8, "prefetch", "must be in [0, 8], got " + std::to_string(o.prefetch));
  check(o.comm_progress == "thread" || o.comm_progress == "poll" || o.comm_progress == "wait", "comm-progress",
        "must be poll, thread or wait, got '" + o.comm_progress + "'");
  finite(o.collective_timeout, "collective-timeout");
  check(o.collective_timeout >= 0, "collective-timeout", "must be >= 0");
}

// The training hyperparameters and the data (train, import, prepare, tokenizer).
void validate_training_and_data(const Options& o) {
  const TrainConfig& t = o.train;
  for (auto [v, n] : {std::pair{o.val_fraction, "val-fraction"}, {t.lr, "lr"}, {t.min_lr, "min-lr"}, {t.beta1, "beta1"},
                      {t.beta2, "beta2"}, {t.eps, "adam-eps"}, {t.weight_decay, "weight-decay"}, {t.clip, "clip"},
                      {t.skip_spikes, "skip-spikes"}, {t.router_z_loss_coef, "router-z-loss-coef"}})
    finite(v, n);
  check(o.val_fraction > 0 && o.val_fraction < 1, "val-fraction", "must be in (0, 1)");
  check(t.seq_len >= 1, "seq-len", "must be >= 1");
  check(t.global_batch >= 1, "global-batch", "must be >= 1");
  check(t.micro_batch >= 0, "micro-batch", "must be >= 0");
  check(t.steps >= 1, "steps", "must be >= 1");
  check(t.lr > 0, "lr", "must be > 0");
  check(t.min_lr >= 0 && t.min_lr <= t.lr, "min-lr", "must be in [0, lr]");
  check(t.warmup >= 0, "warmup", "must be >= 0");
  check(t.beta1 >= 0 && t.beta1 < 1, "beta1", "must be in [0, 1)");
  check(t.beta2 >= 0 && t.beta2 < 1, "beta2", "must be in [0, 1)");
  check(t.eps > 0, "adam-eps", "must be > 0");
  check(t.weight_decay >= 0, "weight-decay", "must be >= 0");
  check(t.clip >= 0, "clip", "must be >= 0");
  check(t.router_z_loss_coef >= 0, "router-z-loss-coef", "must be >= 0 (0: off)");
  check(t.skip_spikes >= 0, "skip-spikes", "must be >= 0 (0: off)");
  check(t.log_every >= 1, "log-every", "must be >= 1");
  check(t.eval_every >= 0, "eval-every", "must be >= 0");
  check(t.eval_batches >= 1, "eval-batches", "must be >= 1");
  if (o.mode == "train") check(!o.data.empty(), "data", "is required with --mode train (a token file from --mode prepare)");
  if (o.mode == "import") check(o.data.size() <= 1, "data", "names one token file with --mode import");
  parse_data_format(o.data_format);  // throws naming option '--data-format'

  if (o.mode == "prepare") {
    check(!o.inputs.empty(), "input", "is required with --mode prepare");
    check(!o.out.empty(), "out", "is required with --mode prepare");
  }
  check(o.vocab_size >= 0, "vocab-size", "must be >= 0");
  if (o.mode == "tokenizer") {
    check(!o.inputs.empty(), "input", "is required with --mode tokenizer");
    check(!o.out.empty(), "out", "is required with --mode tokenizer (the SentencePiece .model file to write)");
    check(o.vocab_size > 0, "vocab-size", "is required with --mode tokenizer (e.g. 32000, Llama's)");
  }
  check(!o.text_field.empty(), "text-field", "must not be empty");
}

// The options' values and what the mode requires, checked in this order: the first problem found
// throws std::invalid_argument naming its option (check).
void validate(const Options& o) {
  validate_mode(o);
  validate_checkpoints_and_devices(o);
  validate_parallelism(o);
  validate_training_and_data(o);
}
}  // namespace

namespace {
// The typed run config from the validated option strings (validate() accepted each of them).
void fill_typed(Options& o) {
  static const std::pair<const char*, Mode> modes[] = {
      {"train", Mode::Train},     {"prepare", Mode::Prepare},   {"tokenizer", Mode::Tokenizer}, {"inspect", Mode::Inspect},
      {"export", Mode::Export},   {"import", Mode::Import},     {"generate", Mode::Generate},   {"plan", Mode::Plan}};
  for (auto& [name, m] : modes)
    if (o.mode == name) o.run.mode = m;
  o.run.device = o.device == "cpu" ? DeviceChoice::Cpu : o.device == "cuda" ? DeviceChoice::Cuda : DeviceChoice::Auto;
  o.run.shard_group_node = o.shard_group_size == "node";
  o.train.precision = parse_precision(o.precision, &o.train.fp8);
  o.train.recompute = parse_recompute(o.activation_checkpointing);
  o.train.attention = parse_attention(o.attention);
  o.train.cp_comm = parse_cp_comm(o.cp_comm);
  parse_pipeline_kind(o.pp_schedule, &o.train.pp.kind);
  o.train.pp.chunks_per_rank = o.pp_virtual;
  o.train.pp.layers = parse_pp_layers(o.pp_layers);
  o.train.pp.reshard = o.pp_reshard == "per-microbatch" ? Reshard::PerUse : Reshard::PerPass;

  o.train.attention_mask = parse_attention_mask(o.attention_mask);
  o.train.aux_scope = parse_aux_scope(o.aux_loss_scope);
  // Example data's options are settled against the data (apply_data_settings); spellings checked now.
  if (!o.data_given.train_on.empty()) o.train.train_on = parse_train_on(o.data_given.train_on);
  if (!o.data_given.pack.empty()) o.train.pack = parse_pack_mode(o.data_given.pack);
  if (!o.data_given.max_length_policy.empty())
    o.train.max_length = parse_max_length_policy(o.data_given.max_length_policy);
  if (!o.data_given.shuffle.empty() && o.data_given.shuffle != "on" && o.data_given.shuffle != "off")
    throw std::invalid_argument("option '--shuffle' must be on or off, got '" + o.data_given.shuffle + "'");
  o.train.reduce_bf16 = o.reduce_dtype == "bf16";
  o.train.checkpoint_async = o.checkpoint_async == "on";
  o.train.overlap = OverlapConfig{o.overlap == "on", o.prefetch, parse_comm_progress(o.comm_progress)};
}
}  // namespace

std::string normalize_job_file(std::string text) {
  if (text.starts_with("\xEF\xBB\xBF")) text.erase(0, 3);  // UTF-8 byte order mark
  size_t line = 0;
  while (line < text.size()) {
    size_t end = text.find('\n', line);
    if (end == std::string::npos) end = text.size();
    size_t first = text.find_first_not_of(" \t", line);
    // Blank the line but keep its '\n', so that line numbers stay those of the file.
    if (first < end && text[first] == ';') {
      text.erase(line, end - line);
      end = line;
    }
    line = end + 1;
  }
  return text;
}

Options parse_options(Comm& comm, int argc, char** argv) {
  Options o;
  po::options_description desc = describe(o);
  po::variables_map vm;
  std::string err;
  {  // Every rank must hold the same command line (an MPMD launch could give ranks different
     // options, e.g. one rank in bf16: the run would then crash in a mismatched collective).
    std::string line;
    for (int i = 1; i < argc; ++i) line.append(argv[i]).push_back('\0');
    all_ok(comm, same_on_all_ranks(comm, fnv1a64(line)),
           "the ranks were started with different command-line options; every rank must get the same ones");
  }
  // Command line first (values stored first win in Boost), on every rank: argv is the same.
  try {
    po::positional_options_description pos;
    pos.add("checkpoint", 1);
    po::store(po::command_line_parser(argc, argv).options(desc).positional(pos).run(), vm);
  } catch (const std::exception& e) {
    err = std::string(e.what());
  }
  all_ok(comm, err.empty(), err);
  std::string cfg = vm.count("config") ? vm["config"].as<std::string>() : "";
  // Job file: rank 0 reads it, everybody parses the same text.
  std::string text;
  if (!cfg.empty()) {
    std::string rerr;
    if (comm.rank() == 0) {
      // A regular file, checked on the open descriptor without blocking (files.h InputFile).
      try {
        if (!path_exists(cfg)) throw std::runtime_error("cannot read job file '" + cfg + "': no such file");
        text = InputFile::open(cfg, "job file").read_all(16u << 20);
      } catch (const std::exception& e) {
        rerr = std::string(e.what()) + " (option '--config')";
      }
    }
    all_ok(comm, rerr.empty(), rerr);
    text = comm.broadcast_string(text, 0);
    try {
      std::istringstream is(normalize_job_file(text));
      // Job files also take `shard_group_size` (the spelling of the HSDP design notes) for `shard-group-size`.
      po::options_description file_desc;
      file_desc.add(desc).add_options()("shard_group_size", po::value<std::string>(&o.shard_group_size), "");
      po::store(po::parse_config_file(is, file_desc), vm);
    } catch (const std::exception& e) {
      err = "job file '" + cfg + "': " + e.what();
    }
    all_ok(comm, err.empty(), err);
  }
  try {
    po::notify(vm);
    // '--shard-group-size' (command line or job file) wins over the job file's `shard_group_size`.
    if (vm.count("shard-group-size")) o.shard_group_size = vm["shard-group-size"].as<std::string>();
    // Given but empty is a mistake, not "the default".
    if ((vm.count("shard-group-size") || vm.count("shard_group_size")) && o.shard_group_size.empty())
      check(false, "shard-group-size", "must be a positive integer or 'node', got ''");
    std::vector<std::string> keys;  // "--accept-change steps,lr --accept-change seed" -> steps, lr, seed
    for (const std::string& v : o.train.accept_changes) {
      std::istringstream is(v);
      for (std::string k; std::getline(is, k, ',');) {
        k.erase(0, k.find_first_not_of(" \t"));  // "steps, lr"
        k.erase(k.find_last_not_of(" \t") + 1);
        if (!k.empty()) keys.push_back(k.rfind("--", 0) == 0 ? k.substr(2) : k);
      }
    }
    o.train.accept_changes = keys;
    o.peak_tflops_given = vm.count("peak-tflops") > 0;
    o.global_batch_given = vm.count("global-batch") > 0 && !vm["global-batch"].defaulted();
    if (vm.count("attention-mask") && !vm["attention-mask"].defaulted()) o.data_given.attention_mask = o.attention_mask;
    o.help = vm.count("help") > 0;
    if (o.help) {
      std::ostringstream os;
      os << desc;
      o.help_text = os.str();
    } else {
      validate(o);
      fill_typed(o);
    }
  } catch (const std::exception& e) {
    err = e.what();
  }
  all_ok(comm, err.empty(), err);
  return o;
}

}  // namespace shardtrain
