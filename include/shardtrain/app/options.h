// shardtrain command-line and INI job-file options (Boost.ProgramOptions).
//
// Precedence: command line > job file (--config) > built-in default. Job files are INI: one
// `key = value` per line with the long option names (no leading dashes). Comments:
//   * `#` starts a comment anywhere on a line, also after a value (Boost.ProgramOptions' rule), so
//     a value cannot contain `#`;
//   * `;` starts a comment only as the first non-blank character of a line (full-line comments,
//     as Python's configparser writes them); after a value it is part of the value
//     (`prompt = a;b` is "a;b"), because paths and prompts may contain `;`;
//   * a UTF-8 byte order mark at the start of the file is ignored.
// Rank 0 alone reads the job file and broadcasts its text; every rank parses the same text, so
// every rank holds the same options or all fail together.
#pragma once

#include <string>
#include <vector>

#include "shardtrain/runtime/mesh.h"
#include "shardtrain/train/train.h"
#include "shardtrain/io/hf.h"

namespace shardtrain {

// The job of a launch (option '--mode').
enum class Mode { Train, Prepare, Tokenizer, Inspect, Export, Import, Generate, Plan };
// Option '--device': auto (a GPU when the CUDA plugin loads and the node has one), cpu, cuda.
enum class DeviceChoice { Auto, Cpu, Cuda };

// The typed run config: what main() and the layers below decide on, parsed once by parse_options
// from the option strings, so that no option is compared as a string after parsing. The training
// settings among them (precision, gradient reduce dtype, overlap) are in TrainConfig (train.h).
struct RunConfig {
  Mode mode = Mode::Train;
  DeviceChoice device = DeviceChoice::Auto;
  bool shard_group_node = false;  // '--shard-group-size node': G = the ranks per node
};

// The options as given (strings as typed, for messages) and, in `run` and `train`, their typed form.
struct Options {
  RunConfig run;                  // typed, from mode, device, shard_group_size (parse_options)
  bool help = false;
  std::string help_text;
  std::string mode = "train";     // train | prepare | tokenizer | inspect | export | import | generate | plan
  std::string config_file;        // INI job file
  std::string model = "demo";     // preset name or path to a Hugging Face config.json
  std::vector<std::string> data;  // train: token files / glob patterns (--data, repeatable; job file: repeated keys)
  std::vector<std::string> val_data;  // train: validation token files / glob patterns (--val-data, repeatable)
  std::string data_format = "auto";   // auto | shardtrain | llmc | nanogpt (parse_data_format, data.h)
  std::vector<std::string> inputs;  // text files, directories, globs (prepare, tokenizer)
  std::string out;                // token file to write (prepare), .model file (tokenizer)
  std::string tokenizer = "byte-level";  // prepare: byte-level | SentencePiece .model | directory with tokenizer.model
  std::string text_field = "text";  // prepare, tokenizer: the text field of .jsonl inputs
  int vocab_size = 0;             // tokenizer: vocabulary size to train
  double val_fraction = 0.1;
  double collective_timeout = 600;  // seconds a collective may take before this rank ends the job; 0: never
  int threads = 0;                // threads per rank (OpenMP), 0 = by the affinity mask (plan_threads, cpu_affinity.h)
  double peak_tflops = 0;         // train: --peak-tflops, each rank's device peak for MFU (TFLOP/s; mfu.h)
  bool peak_tflops_given = false; // --peak-tflops was given (then peak_tflops > 0, finite)
  bool global_batch_given = false;  // --global-batch was given (command line or job file), not defaulted
  std::string device = "auto";    // train: auto | cpu | cuda (see plan_devices in cuda.h)
  std::string gpu_comm = "nccl";  // train on cuda: nccl | mpi (MPI on host copies; GPUs shared by ranks)
  std::string precision = "fp32"; // train: fp32 | bf16 (mixed precision)
  std::string activation_checkpointing = "none";  // train, plan: none | selective | full (parse_recompute, model.h)
  std::string attention = "tiled";                // train, plan: tiled | exact (parse_attention, model.h)
  std::string attention_mask = "causal";          // train, plan: causal | document (parse_attention_mask, model.h)
  std::string aux_loss_scope = "sequence";        // train: sequence | micro-batch (parse_aux_scope, model.h; MoE models)
  // train, plan: --train-on, --pack, --max-length-policy and --attention-mask as given ("" = not
  // given), settled against the data by apply_data_settings (train.h).
  DataOptionsGiven data_given;
  std::string reduce_dtype = "fp32";  // train, bf16: dtype of the gradient reduce-scatter, fp32 | bf16
  std::string checkpoint_async = "on";  // train: on | off (TrainConfig::checkpoint_async)
  std::string overlap = "on";      // train: on | off (prefetched all-gathers, asynchronous reduce-scatters)
  int prefetch = 1;                // train: all-gathers in flight ahead of the unit computed
  std::string comm_progress = "poll";  // train: poll | thread | wait (parse_comm_progress, comm_queue.h)
  std::string shard_group_size;   // train, plan: ranks a unit is sharded over (HSDP): "" = all, N, or "node"
  int tp = 1;                     // train, plan: tensor-parallel degree (--tp; model.h)
  int cp = 1;                     // train, plan: context-parallel degree (--cp; mesh.h, geometry.h)
  int ep = 1;                     // train, plan: expert-parallel degree (--ep; mesh.h, docs/moe.md)
  std::string cp_comm = "ring";   // train, plan: ring | allgather (parse_cp_comm, geometry.h; TrainConfig::cp_comm)
  int pp = 1;                     // train, plan: pipeline stages (--pp; mesh.h, pipeline_schedule.h)
  std::string pp_schedule = "1f1b";  // train, plan: gpipe | 1f1b | interleaved | zero-bubble (parse_pipeline_kind)
  int pp_virtual = 1;             // train, plan: chunks per pipeline rank (--pp-virtual; interleaved only)
  std::string pp_layers;          // train, plan: blocks per chunk by hand, "a,b,..." (pipeline_split); "" = even
  std::string pp_reshard = "per-step";  // train, plan: per-step | per-microbatch (--pp > 1; Reshard, unit_source.h)
  std::string checkpoint;         // inspect: the checkpoint file (also positional)
  std::string dump_param;         // inspect: write this gathered parameter ("all": every one) ...
  std::string dump_out;           // ... to this file (raw float32, little-endian; "all": a directory of <name>.bin)
  std::string dtype = "fp32";     // export: fp32 | bf16 | fp16
  std::string max_shard_size = "5GB";  // export: per safetensors file
  std::string hf_dir;             // import: Hugging Face model directory
  std::string prompt;             // generate
  int max_new_tokens = 200;       // generate
  double temperature = 0.8;       // generate; 0 = greedy
  int top_k = 40;                 // generate; 0 = off
  std::string dump_logits;        // generate: raw float32 logits of BOS + prompt
  std::string prompt_ids;         // generate: comma-separated ids after BOS, in place of --prompt
  bool print_ids = false;         // generate: log the prompt's and the generated ids
  int plan_world_size = 0;        // plan: ranks to plan for (0: this launch's)
  std::string device_memory;      // plan: bytes of one device ("80GB"): print what fits
  TrainConfig train;  // its precision, reduce_bf16 and overlap: from precision, reduce_dtype, overlap, prefetch, comm_progress
};

// Collective. Parses argv (and the --config job file, read by rank 0) and fills the typed fields
// (Options::run; TrainConfig's precision, reduce_bf16, overlap). Throws CollectiveError on
// every rank for an unknown option, a value of the wrong type, an out-of-range value (the message
// names the option), an unreadable job file, or invalid INI syntax (the message names the file).
Options parse_options(Comm& comm, int argc, char** argv);

// The shard group size G of option '--shard-group-size' (hybrid sharding) for `world` ranks with
// `ranks_per_node` ranks on every node (0: not the same on every node): "" -> world, "node" ->
// ranks_per_node, else the number. Throws std::invalid_argument naming the option when G is not a
// positive integer, "node" has no single value, or G does not divide the world size.
// `ranks`: how the message names the `world` ranks ("" = "the world size (W)"; under --pp, the ranks
// of a pipeline stage).
int resolve_shard_group_size(const std::string& value, int world, int ranks_per_node, const std::string& ranks = "");
// The mesh of options '--pp' P, '--tp' N, '--cp' C and '--shard-group-size' G (ranks of a replica
// inside one stage: its TP and CP groups included) for `world` ranks, of which W / P are one
// pipeline stage: {dp_replicate (W / P) / G, dp_shard G / (C x N), cp C, tp N, pp P}. G defaults to
// the ranks of a stage, W / P. Throws std::invalid_argument naming the option and the numbers when P
// does not divide the world size, N or C x N does not divide the ranks of a stage, or G is not a
// multiple of C x N (and as resolve_shard_group_size). world 0: the forms only. '--ep' E (no ranks of
// its own: EP groups are formed inside the FSDP shard group) must divide dp_shard x cp.
MeshDims resolve_mesh_dims(const std::string& shard_group_size, int tp, int cp, int world, int ranks_per_node,
                           int pp = 1, int ep = 1);
// Option '--pp-layers' "a,b,...": the blocks of each chunk (pipeline_split checks them against the
// model); "" -> empty (an even split). Throws std::invalid_argument naming the option for anything
// but comma-separated positive decimal integers.
std::vector<int> parse_pp_layers(const std::string& s);

// The job-file text as Boost's INI parser is given it: a leading UTF-8 byte order mark (EF BB BF)
// removed and every full-line `;` comment (first non-blank character `;`, after spaces or tabs)
// replaced by an empty line, so lines keep their numbers; everything else, `;` after a value
// included, unchanged. Pure function, throws nothing but std::bad_alloc.
std::string normalize_job_file(std::string text);

}  // namespace shardtrain
