// shardtrain checkpoints: one HDF5 file per checkpoint, written collectively by all ranks through
// parallel HDF5 (MPI-IO), self-describing (per-unit shard and parameter tables), checksummed,
// published atomically, and loadable at any world size (resharding).
//
// Three parts (src/io/):
//   checkpoint_dir.cpp   the directory: names, the temporary file, rename, `latest`, --keep-last,
//                        --resume resolution;
//   metadata             checkpoint_h5.cpp (HDF5 plumbing, attributes, their checksums),
//                        checkpoint_meta_write.cpp, checkpoint_meta_read.cpp (reading, cross-checks,
//                        what a file holds, read_checkpoint_info), checkpoint_meta_compare.cpp
//                        (whether it fits a model);
//   checkpoint_data.cpp  tensor data: the named sharded tensors (ShardedTensors), snapshots of
//                        them, their hyperslabs and CRC32s, loading with resharding.
// Saving is snapshot (a host copy, take_checkpoint_snapshot; on a GPU into pinned host memory, a
// SnapshotBuffer, on a copy stream) -> write (write_checkpoint_file) -> publish (save_checkpoint
// does all three).
//
// Layout: docs/checkpoint-format.md (enough to rebuild every tensor with h5py alone).
// HDF5 reference: https://docs.hdfgroup.org/hdf5/v1_10/ (H5P_SET_FAPL_MPIO, H5Sselect_hyperslab).
#pragma once

#include <atomic>
#include <condition_variable>
#include <array>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/model/config.h"
#include "shardtrain/data/data.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard.h"
#include "shardtrain/io/train_state.h"
#include "shardtrain/runtime/version.h"

namespace shardtrain {

// Version 2 added the metadata checksums (docs/checkpoint-format.md, "Integrity"), the batch
// history in data_position and the `data` attribute; version 3 the `spike_stats` attribute (the
// loss-spike statistics, SpikeStats). Version 1 files still load (their attributes unverified, with
// a note), version 1 and 2 files with empty spike statistics; saves always write version 3.
// Version 4 (--tp N > 1) adds the TP record, version 5 (--cp C > 1) the saving run's mesh with cp
// (attribute `mesh`; docs/checkpoint-format.md, "Version 5"). Files of versions 1 to 4 read with cp = 1.
// Version 6 (--pp P > 1) adds the pipeline record (attribute `pipeline`, `mesh` with pp, unit
// attribute `stage`; docs/checkpoint-format.md, "Version 6"). Files of versions 1 to 5 read with pp = 1.
inline constexpr int kCheckpointFormatVersion = 7;  // the newest read; a run writes 3, 4 (--tp), 5 (--cp), 6 (--pp), 7 (MoE)

// Per-unit tables as stored.
// Version 4 (docs/checkpoint-format.md): how a tensor-parallel run held one unit. `params`: per
// parameter, in param_table's order, {split (0 rows, 1 columns, -1 replicated), degree N,
// padded_rows, local_offset}; the TP-local buffer of local_numel elements, sharded over the
// ranks of its FSDP shard group as `shards` (dp_shard x cp rows: start, valid, padding), the same
// for every TP rank.
struct TpUnitRecord {
  std::vector<std::array<int64_t, 4>> params;
  int64_t local_numel = 0, local_shard_size = 0;
  std::vector<RankShard> shards;
};
// The saving run's mesh and, tp > 1, every unit's record (version 4; tp = 1: no units). cp > 1:
// the file is version 5, which records the mesh with cp (attribute `mesh`).
struct TpRecord {
  int tp = 1, dp_shard = 1, dp_replicate = 1, cp = 1;
  int ep = 1;  // the saving run's --ep (version 7's mesh record; the rows do not depend on it)
  std::vector<TpUnitRecord> units;
};
// The record of a run with these TP plans (TpCheckpointLayout::tp_plans) and mesh.
TpRecord tp_record(const std::vector<ShardPlan>& tp_plans, const MeshDims& dims);

// ---- Pipeline parallelism (format version 6) ---------------------------------------------------
//
// Under --pp P a rank holds only the units of its pipeline rank's chunks (pipeline.h
// pipeline_rank_units, in that rank's order), and the last stage of a tied model also a copy of the
// embedding. The file holds the whole model's units once: unit u is written by the ranks of stage
// pipeline_unit_stage(bounds, P, u) (the tied embedding by the first stage), rows of that stage's
// plan (a stage's ranks as a file of one stage would hold them: its shard group, or under TP its
// canonical rows); every other rank joins each collective HDF5 call with empty selections. A load
// reads only the units this rank holds, the tied copy too, from the one stored tensor.

// The stage (pipeline rank) that holds model unit `u` (0: the embedding, 1..L: block u-1, L+1: the
// final norm and untied head) in a pipeline of `pp` ranks over the chunk boundaries `bounds` (S + 1
// numbers over L blocks, chunk c on pipeline rank c mod pp): the embedding is chunk 0's, a block
// its chunk's, the final norm chunk S-1's. -1 when `u` is not a unit of L + 2.
int pipeline_unit_stage(const std::vector<int>& bounds, int pp, int u);

// What a rank of a pipeline stage saves and loads, beside its own tensors (ShardedTensors::stage).
struct StageUnits {
  // The record (attribute `pipeline`): stages, chunks per stage, the schedule's name, the chunk
  // boundaries (S + 1 numbers, S = pp x chunks_per_rank).
  int pp = 1, chunks_per_rank = 1;
  std::string schedule;
  std::vector<int> bounds;
  ShardPlan file_plan;            // the whole model's units at the file's rows (world size: the rank's plan's)
  std::vector<int> unit_stage;    // [unit of file_plan] the stage that writes it (unit attribute `stage`)
  std::vector<int> file_unit;     // [unit of the rank's plan] its index in file_plan
  std::vector<char> tied_copy;    // [unit of the rank's plan] 1: the last stage's copy of the tied
                                  // embedding: loaded, not written; at save its checksums must equal
                                  // the written copy's, row for row, or the save is refused
};

struct CheckpointUnitInfo {
  std::string name;
  int64_t numel = 0, shard_size = 0, padded_numel = 0;
  TpUnitRecord tp;                    // version 4: the saving run's TP record of this unit
  int stage = -1;                     // version 6: attribute `stage`, the pipeline rank that wrote it; -1 before
  std::vector<RankShard> ranks;       // the shard table, one row per saving rank
  std::vector<ParamSlot> params;      // the parameter table (name, shape, offset, numel)
  // [world][C], C = checkpoint_tensor_names().size(): CRC32 of each saving rank's slice of each
  // tensor, in the columns of checkpoint_tensor_names().
  std::vector<uint32_t> crc32;
};

struct CheckpointInfo {
  std::string path;
  int format_version = 0;
  int64_t step = 0, tokens_seen = 0;
  int world_size = 0;
  std::string model_config, train_config, data_position, rng_state, program_version;
  // The token file the run trained on: JSON null (none: an import, or a version 1 file), or
  // {"path", "tokenizer", "vocab_size", "bos_id", "eos_id"} from its header (data.h), "crc32" of the file.
  std::string data_info = "null";
  std::vector<BatchSegment> segments;  // from data_position (version 1: one segment from train_config)
  SpikeStats spikes;                   // from spike_stats (versions 1 and 2: empty)
  // Group /tokenizer: its attribute `info` (kind, ids, file names, sizes and CRC32s) and the
  // files' bytes, each checked against its CRC32. kind "" when the file has no such group.
  TokenizerInfo tokenizer = no_tokenizer();
  uint64_t file_bytes = 0;             // size of the file as this rank saw it
  bool metadata_verified = false;      // version 2: every attribute and table matched its checksum
  std::vector<CheckpointUnitInfo> units;
  // Version 4: the saving run's mesh (attribute `tensor_parallel`); tp = 1 for older versions.
  // Version 5: the same from attribute `mesh`, with cp (tp may be 1); cp = 1 for older versions.
  int tp = 1, tp_dp_shard = 0, tp_dp_replicate = 0, cp = 1;
  // Version 6: `mesh`'s pp and attribute `pipeline` (chunks per stage, schedule, chunk boundaries);
  // pp = 1 and no bounds for older versions.
  int pp = 1, pp_virtual = 1;
  std::string pp_schedule;
  std::vector<int> pp_bounds;
  // Version 7 (a mixture-of-experts model): `mesh`'s ep (expert parallelism); 1 otherwise.
  int ep = 1;
};

struct CheckpointOptions {
  std::string dir;                      // --checkpoint-dir; empty: no checkpoints
  int64_t every = 0;                    // --checkpoint-every N steps; 0: only at the end
  int keep_last = 0;                    // --keep-last K published checkpoints; 0: keep all
  int64_t debug_crash_before_publish = 0;  // test hook: die after writing step N, before publishing
  // Whether this rank writes its shard rows (Mesh::writes_checkpoint: replica group 0 under hybrid
  // sharding); false: it joins every collective HDF5 call with empty selections.
  bool write_shards = true;
  // Test hook: sleep this long between writing the temporary file and publishing it (set by
  // AsyncCheckpointWriter from SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS for background saves).
  int64_t test_delay_before_publish_ms = 0;
};

// "step_00000100.h5" for step 100.
std::string checkpoint_name(int64_t step);
// True iff `name` has the form of checkpoint_name's result ("step_" + 8 digits + ".h5").
bool is_checkpoint_name(const std::string& name);
// The published checkpoints in `dir` (regular files named like checkpoint_name), oldest first;
// temporary files never match. Empty if `dir` does not exist. Not collective.
std::vector<std::string> published_checkpoints(const std::string& dir);

// Collective. A run resumed from step `step` (e.g. rolled back after a loss spike) in a directory
// that holds checkpoints of later steps: those belong to the abandoned continuation. Left in place,
// --keep-last would prune this run's new checkpoints before them and '--resume auto' could pick
// them. Rank 0 moves them to "<dir>/abandoned/" (nothing is deleted) and points `latest` at the
// checkpoint resumed from when it is in `dir`. Throws CollectiveError if a move fails.
void set_aside_later_checkpoints(Comm& comm, const std::string& dir, int64_t step, const std::string& resumed);

// Collective. Prepares `dir` (option '--checkpoint-dir') for saves: rank 0 creates it and checks it
// is writable, then writes a probe file there with a fresh name, and every rank checks it sees that
// file: a path that is not one shared directory on every rank (node-local, a relative path under
// different working directories, a file system not mounted everywhere) would make the collective
// write hang or publish an incomplete file. Throws CollectiveError (same message on every rank)
// naming the directory and, for the last case, the ranks that do not see it. The probe is named
// ".shardtrain-probe-<tag>.<nonce>" (tag: rank 0's checkpoint_temp_tag(); written through
// "<probe>.tmp") and removed again.
void prepare_checkpoint_dir(Comm& comm, const std::string& dir);

// Collective. One training run per checkpoint directory: rank 0 creates `dir` if needed and holds
// an exclusive flock(2) on "<dir>/.shardtrain.lock" for this object's lifetime (the kernel drops
// it when the process ends, SIGKILL included: no stale lock after a killed or preempted job), and
// writes its host, process id and start time into the file. Two runs in one directory (a job
// submitted twice, a requeue while the first still runs) would write the same step names and move
// each other's `latest`; the second is refused on every rank, naming the directory and the holder
// (CollectiveError). A file system without flock (ENOLCK, EOPNOTSUPP, ...) gets no lock: `note()`
// says so, once, and the run goes on.
class CheckpointDirLock {
 public:
  CheckpointDirLock(Comm& comm, const std::string& dir);
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;
  const std::string& note() const { return note_; }  // "" when locked (or not rank 0)

 private:
  int fd_ = -1;
  std::string note_;
};

// ---- Temporary files of the checkpoint directory ----------------------------------------------
//
// Every name a save or the directory probe creates in '--checkpoint-dir' before it is final
// carries the tag of rank 0's process, so that a run can tell its own leftovers (a job killed
// with SIGKILL mid-save) from a live job's files (a shared file system may hold several jobs'
// directories, and a misdirected job may write into another's):
//   ".step_N.h5.<tag>.tmp"                    the checkpoint being written (all ranks, MPI-IO)
//   "latest.<tag>.tmp"                        `latest`'s new contents, staged before the file
//   ".shardtrain-probe-<tag>.<nonce>[.tmp]"   prepare_checkpoint_dir's probe
// One tag per save, rank 0's, broadcast: the collective file must have one name on every rank.

// This process's tag: "<host>.<pid>", host = gethostname() with every character outside
// [A-Za-z0-9.-] replaced by '-' ("unknown-host" when empty), followed by "_pidns<inode>" when the
// process is not in the initial PID namespace (a container: its process ids are not the host's,
// and two containers on one host may share a host name), pid = getpid() (the same for the
// background writer thread). Not collective.
std::string checkpoint_temp_tag();

// A temporary name of the checkpoint directory, parsed (parse_checkpoint_temp_name).
struct CheckpointTempName {
  enum class Kind { kCheckpoint, kLatest, kProbe };
  Kind kind = Kind::kCheckpoint;
  bool tagged = false;  // false: an untagged name of an earlier version (".step_N.h5.tmp",
                        // "latest.tmp", ".shardtrain-probe-<digits>[.tmp]"): no host, pid 0
  std::string host;     // the tag's host part (with its "_pidns<inode>", if any)
  long long pid = 0;    // the tag's process id (>= 1 when tagged)
};
// Whether `name` (a file name, no directory) is one of the temporary names above, tagged or of an
// earlier version; fills *out when it is. A tag is "<host>.<pid>": host non-empty, of
// [A-Za-z0-9._-], pid decimal digits (no leading zero, at most 18). Not collective.
bool parse_checkpoint_temp_name(const std::string& name, CheckpointTempName* out);

// Call on every rank (no MPI call: rank 0 alone looks at `dir`, the others return at once). Run
// once when a training run starts (the trainer, after prepare_checkpoint_dir). Rank 0 lists `dir` (not its sub-directories)
// and, for each temporary name (parse_checkpoint_temp_name):
//  - tagged, this host (the host part equal to this process's, and not "localhost..."), and its
//    process gone (kill(pid, 0) fails with ESRCH, or the process is a zombie): removed (a save
//    that was killed; nothing reads it), and a note "removed '<name>' ...: process <pid> on host
//    <host> is gone";
//  - tagged, this host, process alive (or this process itself, or EPERM: another user's): left,
//    note "left '<name>' ...: process <pid> on <host> is alive". A process id reused since the
//    writer died reads as alive too: the file is left and reported, never a live job's removed;
//  - tagged, another host (or a "localhost..." host name, which does not identify a machine):
//    left, note "... of host <host>: not checked from here";
//  - untagged (an earlier version's): left, note "... names no process: not removed".
// Returns the notes on rank 0, in name order (the caller logs them); empty on the other ranks.
// Never throws: a failure to list or to remove becomes a note (these files are never read, so
// leaving one is harmless; published_checkpoints and resolve_resume see only "step_N.h5").
std::vector<std::string> clean_checkpoint_temp_files(Comm& comm, const std::string& dir);

// ---- Tensor data --------------------------------------------------------------------------

// The tensors a checkpoint file holds, in the column order of each unit's shard_crc32 table:
// "params" (the parameters), "adam_m" and "adam_v" (AdamW's first and second moments). Each is one
// float32 dataset per unit, "units/<unit>/<name>", of the unit's padded_numel elements, sharded
// like the parameters. A new optimizer moment is a new entry here (and a new format version).
const std::vector<std::string>& checkpoint_tensor_names();

// One tensor sharded like the model's units: `shards[u]` is this rank's row of unit u, i.e. the
// plan's shard_size elements of unit u (valid ones, then zero padding), in the memory of the
// backend of the ShardedTensors that holds it. Not owned.
struct ShardedTensor {
  std::string name;            // one of checkpoint_tensor_names()
  std::vector<float*> shards;  // one per unit of the plan
};

// The named sharded tensors of one rank, as the sharded state and the optimizer expose them
// (sharded_params below; train.h checkpoint_tensors adds AdamW's moments). Not owned: the plan,
// the backend and every shard outlive this view.
struct ShardedTensors {
  const ShardPlan* plan = nullptr;    // the layout, for plan->world_size ranks
  int plan_rank = 0;                  // this rank's row of every unit
  Backend<float>* backend = nullptr;  // where the shards live (to_host / from_host)
  std::vector<ShardedTensor> tensors;
  // Pipeline parallelism: the plan holds this rank's stage's units only (its own order), and this
  // says where each goes in the file (format version 6); nullptr: the plan is the whole model's.
  std::shared_ptr<const StageUnits> stage;
};

// The parameter shards of `f` as the tensor "params" (its plan, plan rank and backend).
ShardedTensors sharded_params(ShardedState<float>& f);

// ---- Tensor parallelism: the canonical layout of checkpoints ----------------------------------
//
// Under --tp N a rank holds, per unit, data-parallel shard d of its TP rank t's slices (shard.h
// TpSlice; model.h). Checkpoints store the canonical tensors instead (docs/checkpoint-format.md,
// "Version 4"): the units as without TP, each unit's flat buffer cut into W contiguous rows, one
// per rank of the world (row = world rank), as a plain FSDP run of W ranks would hold them. This
// class moves a run's state between the two layouts (one MPI_Alltoallv per unit over the world,
// in host memory), so that the version 3 writer and reader, with their per-row CRC32s, store and
// verify every byte, and a checkpoint loads at any (tp', dp_shard', dp_replicate').
//   to_canonical:   each canonical element comes from one holder: replica group 0, and for a
//                   replicated parameter (RMSNorm weights) TP rank 0; vocabulary padding rows are
//                   left out (the canonical tensors have none).
//   from_canonical: every holder receives its elements (each replica, each TP rank of a
//                   replicated parameter); padding rows become 0.
// Cost: every rank enumerates every rank's runs of contiguous canonical elements (O(W x runs per
// rank): fine up to thousands of ranks for these shapes; a row-parallel slice is one run per row).
//
// Expert parallelism (format version 7, docs/checkpoint-format.md): the same mover over one shard
// group (`mesh`: a mesh of dp_shard x cp ranks with the run's ep, tp = 1; rank = shard index). A
// rank's plan is its EP index's (plans[e]: ShardPlan::build(llama_units(c, 1, 0, ep, e), G, G / ep)):
// its block units without the experts (rows: shard index) and its expert units (rows: shard index /
// ep, the expert shard group), each mapped by parameter name into the canonical unit that holds
// it (the block's); the canonical rows are the shard group's G. Each replica group moves its own
// copy; replica group 0's rows are written (Mesh::writes_checkpoint).
class TpCheckpointLayout {
 public:
  // tp_plans[t]: TP rank t's plan (ShardPlan::build(llama_units(c, N, t), dp_shard x cp)), N =
  // mesh.dims().tp of them (under EP: EP index e's plan, mesh.dims().ep of them); canonical:
  // ShardPlan::build(llama_units(c), W) for W = mesh's world size. `names`: the tensors held
  // (checkpoint_tensor_names(), or its first for weights only). Allocates the canonical rows (names
  // x canonical shard sizes, host memory; std::bad_alloc). std::invalid_argument when the plans do
  // not cover the canonical units' parameters exactly once.
  TpCheckpointLayout(const MeshLayout& mesh, int rank, std::vector<ShardPlan> tp_plans, ShardPlan canonical,
                     std::vector<std::string> names);
  // Collective over `world` (every rank, in the same order). `local`: this rank's shards (plan
  // tp_plans[t]), tensors named as `names`, in any backend memory. Fills this rank's canonical rows.
  void to_canonical(Comm& world, const ShardedTensors& local);
  // Collective over `world`. Writes this rank's shards of `local` from the canonical rows (padding
  // and rows past a parameter's end: 0).
  void from_canonical(Comm& world, const ShardedTensors& local);
  // This rank's canonical rows as ShardedTensors (plan `canonical`, plan rank = this rank, host
  // memory); valid while this object lives. `n` first tensors (0: all).
  ShardedTensors canonical(size_t n = 0);
  const ShardPlan& canonical_plan() const { return canon_; }
  const std::vector<ShardPlan>& tp_plans() const { return plans_; }
  // Elements this rank sent to other ranks in the last to_canonical / from_canonical, all tensors.
  int64_t last_elements_moved() const { return moved_; }

 private:
  struct Run {
    int64_t local = 0, canon = 0, len = 0;  // offset in the holder's shard, in the canonical unit; elements
    bool replicated = false;
  };
  // Rank q's shards of the plan units that hold canonical unit u's parameters, in canonical runs
  // (Run::local: offset in those shards concatenated in contrib_ order).
  std::vector<Run> runs(int q, size_t u) const;
  void move(Comm& world, const ShardedTensors& local, bool to_canon);
  int variant(int q) const;         // which plan rank q holds: its TP rank (tp > 1) or its EP index
  int row(int q, int lu) const;     // rank q's row in plan unit lu: its shard index, / ep in group 1
  MeshLayout mesh_;
  int rank_;
  std::vector<ShardPlan> plans_;
  ShardPlan canon_;
  std::vector<std::string> names_;
  std::unique_ptr<Backend<float>> host_;  // the canonical rows' memory (CPU backend: host memory)
  std::vector<std::vector<Buffer<float>>> rows_;  // [tensor][unit]
  std::vector<std::vector<int64_t>> canon_offset_;  // [plan unit][param] offset in its canonical unit
  std::vector<std::vector<int>> contrib_;           // [canonical unit] the plan units holding its parameters
  std::vector<std::vector<int64_t>> lbase_;         // [variant][plan unit] its shard's offset in the concatenation
  int64_t moved_ = 0;
};

// Host memory for the snapshots of one run, allocated once and reused by every save: one block of
// Backend::alloc_pinned_host (page-locked on a GPU, so that the device-to-host copies are DMAs at
// full bandwidth; plain host memory on the CPU) holding this rank's rows of `tensors` tensors,
// [tensor][unit] one after the other, plan.units[u].shard_size floats each. Pinning is slow and
// fresh pages cost a first touch: both are paid once per run, not per save. The backend must
// outlive it. Snapshots taken into it share its ownership (CheckpointSnapshot::buffer); a new one
// overwrites the bytes of the one before, so take it only after that one's write has ended
// (Trainer::save waits for the write in flight first).
class SnapshotBuffer {
 public:
  // Throws std::bad_alloc (from the backend) when the memory cannot be had.
  SnapshotBuffer(Backend<float>& be, const ShardPlan& plan, size_t tensors);
  ~SnapshotBuffer();
  SnapshotBuffer(const SnapshotBuffer&) = delete;
  SnapshotBuffer& operator=(const SnapshotBuffer&) = delete;
  size_t tensors() const { return tensors_; }
  size_t units() const { return offset_.size(); }
  int64_t shard_size(size_t unit) const { return size_[unit]; }
  // Tensor k's rows of unit u: shard_size(u) floats.
  float* rows(size_t k, size_t u) const { return base_ + k * per_tensor_ + offset_[u]; }
  uint64_t bytes() const { return 4 * static_cast<uint64_t>(per_tensor_) * tensors_; }
  // Whether `tensors` tensors of `plan` fit: as many tensor slots or more, the plan's units and
  // shard sizes.
  bool fits(const ShardPlan& plan, size_t tensors) const;

 private:
  Backend<float>* be_;
  float* base_ = nullptr;
  size_t tensors_ = 0, per_tensor_ = 0;  // per_tensor_: floats of one tensor's rows (all units)
  std::vector<size_t> offset_;           // [unit] first float of its rows within a tensor's
  std::vector<int64_t> size_;            // [unit] shard_size
};

// What one save writes: this rank's rows of every tensor (owned copies, rows in a SnapshotBuffer,
// or borrowed live rows) and the metadata. Taking it is the only part of a save that reads the
// training state: once taken (copied), training may change the tensors while the snapshot is
// written.
struct CheckpointSnapshot {
  ShardPlan plan;        // the tensors' layout (units, shard sizes, parameter tables)
  int plan_rank = 0;     // the row of every unit these copies are
  // Whether this rank's rows go into the file (CheckpointOptions::write_shards). Exactly one rank
  // per plan row writes; the others (replica groups under hybrid sharding) join every collective
  // HDF5 call with empty selections, and their rows are only compared with the written ones.
  bool write_shards = true;
  TrainState state;          // step, tokens_seen, seed, batch history, data record, tokenizer, layout
  std::string model_config;  // canonical JSON (config.h canonical_json)
  std::string train_config;  // the train_config attribute (train.h train_config_json)
  // A tensor-parallel run's record (tp > 1): the file is format version 4 with its tables; the
  // tensors are the canonical rows (TpCheckpointLayout). tp = 1: version 3.
  TpRecord tp;
  // A pipeline stage's snapshot (format version 6): `plan` holds the stage's units; the file the
  // whole model's (StageUnits). nullptr: version 3 to 5, the plan is the file's.
  std::shared_ptr<const StageUnits> stage;
  struct Tensor {
    std::string name;
    std::vector<std::vector<float>> shards;  // [unit] plan.units[u].shard_size floats (a copy)
    // A borrowed snapshot (take_checkpoint_snapshot with borrow): [unit] the live rows in host
    // memory, not owned; or the copies in `buffer` (a snapshot taken into a SnapshotBuffer).
    // `shards` is then empty.
    std::vector<const float*> view;
    size_t units() const { return view.empty() ? shards.size() : view.size(); }
    const float* rows(size_t u) const { return view.empty() ? shards[u].data() : view[u]; }
  };
  std::vector<Tensor> tensors;  // in the order of the ShardedTensors it was taken from
  // The SnapshotBuffer holding the copies, when taken into one (kept alive by the snapshot).
  std::shared_ptr<const SnapshotBuffer> buffer;
  // Bytes of tensor data copied by this rank (4 B x elements of every copy, owned or in `buffer`;
  // 0 when borrowed).
  uint64_t bytes() const;
};

// Copies this rank's rows of every tensor of `t` to host memory with the metadata. Not collective.
// Throws std::invalid_argument when a tensor's shard count differs from the plan's units or its name
// is not in checkpoint_tensor_names(), or when `into` does not fit `t` (fewer tensors, other units
// or shard sizes).
// `borrow` (a save written before the tensors change again: synchronous saves): on a backend whose
// memory is host memory (Backend::host_kernels) the snapshot points at the live rows instead of
// copying them, so a synchronous save costs no memory; elsewhere it copies as without borrow.
// `into` (the trainer's, made once per run): the copies go into it, tensor k of `t` into its rows
// of tensor k, through the backend's to_host_async (on a GPU: on the copy stream, into pinned
// memory, after everything queued on the compute stream, i.e. the step's optimizer update), and
// the copies are waited for (wait_host_copies) before this returns: the snapshot is the state at
// the call, bitwise, whatever the compute stream does next. Without `into`: owned std::vectors,
// filled with to_host (on a GPU, synchronous on the compute stream).
CheckpointSnapshot take_checkpoint_snapshot(const ShardedTensors& t, const ModelConfig& mc, const std::string& train_config,
                                            const TrainState& state, bool write_shards = true, bool borrow = false,
                                            std::shared_ptr<SnapshotBuffer> into = nullptr);

// Collective. Writes a complete checkpoint file of `snap` at `path` (no rename, no `latest`): the
// building block of save_checkpoint, also used by import. Every rank passes a snapshot of the same
// plan, metadata and tensor names; the snapshot must hold every tensor of checkpoint_tensor_names()
// (throws std::invalid_argument, on every rank alike, before any collective, if not). Row r of
// every unit comes from the rank with plan_rank r and write_shards true. Refuses up front when the
// directory has too little space. Throws CollectiveError naming the file (disk full, HDF5 failure).
// Snapshots of pipeline stages (snap.stage, every rank's or none's): format version 6, the whole
// model's units (stage->file_plan), unit u's row r from the rank of stage unit_stage[u] that holds
// u (not as a tied copy) with plan_rank r and write_shards true; the ranks that do not hold u write
// empty selections. The tied copies' slice checksums must equal the written ones: otherwise every
// rank throws the same CollectiveError naming the unit, tensor and row, and the file is removed
// (the copies are identical by construction: a difference is a bug, never published).
void write_checkpoint_file(Comm& comm, const std::string& path, const CheckpointSnapshot& snap);

// Collective. Writes `snap` (of step N = snap.state.step) to "<dir>/.step_N.h5.<tag>.tmp" (tag:
// rank 0's checkpoint_temp_tag(), broadcast; after prepare_checkpoint_dir, and after writing
// `latest`'s new contents to "<dir>/latest.<tag>.tmp", so that a disk filling during the save
// cannot fail the publication), then publishes it (publish_checkpoint). Returns the published path.
// Throws CollectiveError (same message on every rank) if the directory cannot be created or
// written, or HDF5 fails. The test hook CheckpointOptions::debug_crash_before_publish ends the
// process (exit status 86) between the two.
std::string save_checkpoint(Comm& comm, const CheckpointSnapshot& snap, const CheckpointOptions& co);

// Collective. Publishes the complete file "<dir>/.step_N.h5.<tag>.tmp" (N = `step`, tag: rank 0's
// checkpoint_temp_tag()): rank 0 fsyncs it, renames it to "<dir>/step_N.h5", fsyncs the directory,
// points "<dir>/latest" at it (write-temp-then-rename; "<dir>/latest.<tag>.tmp" is written before
// the rename, or taken as it is when save_checkpoint wrote it already, so that no space is needed
// once the checkpoint is renamed),
// and only then deletes the oldest checkpoints beyond co.keep_last
// (never step N's). Returns the published path. Throws CollectiveError naming it on failure.
std::string publish_checkpoint(Comm& comm, const CheckpointOptions& co, int64_t step);

// ---- Asynchronous saves -----------------------------------------------------------------

// Test hook (documented in docs/errors.md): SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS=ms makes the
// writer thread of a background save sleep that long in all, so that a tiny model's background
// save spans several training steps: half before it writes the temporary file (the file is then
// written after later steps changed the live tensors: the isolation tests) and half between
// writing it and publishing it (an unpublished .tmp exists meanwhile: the kill -9 test).
// Synchronous saves are not delayed. 0 when unset or not a positive integer.
int64_t checkpoint_write_delay_ms();

// Saves in the background: one writer thread per rank runs the whole save_checkpoint (CRC32s, the
// collective HDF5 write, fsync, rename, `latest`, --keep-last) of a snapshot on the writer's own
// communicator (a Comm::duplicate of the world, made once, under the collective watchdog), while
// the calling thread trains on. Every HDF5 call of a save happens on that thread; the caller must
// make none while a write is in flight (Debian's parallel HDF5 is not thread-safe). At most one
// write is in flight. The writer thread runs at nice 19, on any CPU of the job (checkpoint_async.cpp
// says why), so that it takes little of a core training's threads want. Needs
// MPI_THREAD_MULTIPLE (mpi_thread_multiple()); without it, or with `async` false, start() saves
// synchronously on `world` in the calling thread, as save_checkpoint.
//
// Failures: the save's errors are agreed collectively on the writer's communicator (every rank's
// thread ends with the same CollectiveError). failed() reports this rank's thread's outcome
// locally; the trainer joins it to its per-step all-reduce so that every rank learns of a failure
// at the same step boundary, then calls wait(), which rethrows the error on every rank.
class AsyncCheckpointWriter {
 public:
  // Collective over `world` (the duplicate is made on every rank, also when saves will be
  // synchronous, so that every rank takes the same path). `collective_timeout`: the watchdog of
  // the writer's communicator (seconds, 0: none; option '--collective-timeout').
  AsyncCheckpointWriter(Comm& world, bool async, double collective_timeout);
  // Joins a write still in flight (its outcome is dropped: the caller is already leaving with an
  // error of its own, which every rank shares, so every rank's thread runs to its end).
  ~AsyncCheckpointWriter();
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  // Whether start() returns before the write ends; when not, note() says why ("" when async was
  // not asked for).
  bool asynchronous() const { return async_; }
  const std::string& note() const { return note_; }

  // The outcome of one finished save.
  struct Result {
    int64_t step = 0;
    std::string path;         // the published checkpoint
    double write_s = 0;       // the save: write + publish (the test delay, if any, not counted)
    double delay_s = 0;       // SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS slept by the thread
    uint64_t bytes = 0;       // tensor bytes of this rank's snapshot
    int sched_policy = -1;    // the writing thread's scheduling policy (sched_getscheduler)
    int nice = 0;             // and its nice value: 19 for a background write, the caller's otherwise
    double copy_s = 0;        // start() with copy_into: the thread's copy of the live rows
    int cpus = -1;            // CPUs the writing thread may run on (a background writer: every CPU of
                              // the job's cpuset, not only its rank's binding; see checkpoint_async.cpp)
  };

  // Collective in effect (every rank calls it at the same step, after wait() returned). Saves
  // `snap` (step snap.state.step) with `co`: asynchronous: moves the snapshot into the writer
  // thread and returns at once; synchronous: saves and returns when published (then finished()
  // holds the result). Throws std::logic_error if a write is still in flight (call wait() first).
  //
  // `copy_into` (asynchronous saves on a backend with host memory, Backend::host_kernels): `snap`
  // was taken with borrow (its rows are the live shards) and the thread, first of all and at the
  // caller's priority, copies them into `copy_into` (which must fit the plan: std::invalid_argument
  // here otherwise) and writes the copies. Training goes on meanwhile, reading the shards (forward
  // and backward), but must call wait_copied() before it changes them (the optimizer update):
  // the file still holds the state of step snap.state.step, bitwise. What this saves: the copy
  // (~0.1 s per 600 MB, memory-bound) no longer blocks training at the save; it overlaps the next
  // step's forward and backward instead (docs/benchmarks.md).
  //
  // `foreground` (a save training waits for anyway: the final and a preemption save): written on the
  // calling thread, at its priority, on the writer's communicator, and published on return, as a
  // synchronous save. (On the writer thread it would run at nice 19, behind every other busy process
  // of the node.)
  void start(CheckpointSnapshot&& snap, const CheckpointOptions& co, std::shared_ptr<SnapshotBuffer> copy_into = nullptr,
             bool foreground = false);
  // Blocks until the rows of a save started with copy_into have been copied (at once when none is
  // pending); returns the seconds it waited. Local. Call before changing the shards.
  double wait_copied();

  // True while a started asynchronous save has not been collected by wait() / poll().
  bool in_flight() const { return in_flight_; }
  // Local, never blocks: whether this rank's writer thread has ended with an error.
  bool failed() const;
  // Local, never blocks: if this rank's save has ended successfully, collects it (joins the
  // thread) and returns true with *out set. False while it runs, after a failure (see failed()),
  // or with none in flight.
  bool poll(Result* out);
  // Waits for the save in flight (none: returns false at once) and collects it into *out. A
  // failed save rethrows its error (a CollectiveError, the same on every rank) after the join.
  // Every rank waits for its own thread, which ends when the collective write does.
  bool wait(Result* out);

 private:
  // background: on the writer thread (nice 19, any CPU); else on the caller's. The test delay
  // (SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS) applies to every save of an asynchronous writer.
  void run(CheckpointSnapshot snap, CheckpointOptions co, std::shared_ptr<SnapshotBuffer> copy_into, bool background);
  Comm& world_;
  std::mutex copy_mu_;
  std::condition_variable copy_cv_;
  bool copy_pending_ = false;  // guarded by copy_mu_
  std::unique_ptr<Comm> comm_;  // the writer's duplicate of world_ (asynchronous saves)
  bool async_ = false;
  std::string note_;
  bool in_flight_ = false;
  std::thread thread_;
  std::atomic<int> state_{0};  // 0 idle or running, 1 done, 2 failed (set by the thread last)
  Result result_;              // written by the thread before state_ is set
  std::exception_ptr error_;   // likewise
};

// Collective. Reads the metadata (root and unit attributes, shard, checksum and parameter tables)
// of `path`, verifies each against the file's metadata checksums (format version 2,
// docs/checkpoint-format.md "Integrity") and cross-checks the redundant fields (step, tokens_seen,
// data_position, batch history, seeds, world size, shard tables). Then the ranks compare what they
// read (a digest of the checksum table and the file size): a file that differs between ranks (a
// stale or partial copy on one node) is refused on every rank, naming the ranks whose view differs.
// Throws CollectiveError (same message on every rank) naming the file and the attribute or table
// for: a missing, unreadable, non-HDF5 or truncated file, a wrong format name, an unknown format
// version, a checksum mismatch, an inconsistent field, ranks that disagree.
CheckpointInfo read_checkpoint_info(Comm& comm, const std::string& path);

// The saving run's layout in words, for log lines: "world size 4", "world size 8, shard group size
// 4" (hybrid sharding: the file holds a shard group's rows; train_config records the run), "world
// size 8: tp 2 x dp_shard 2 x dp_replicate 2" (version 4), "world size 4: cp 2 x dp_shard 2" (a
// shard group's rows; " (one of R replica groups)" under hybrid sharding) or "world size 8: tp 2 x
// cp 2 x dp_shard 2 x dp_replicate 1" (version 5).
std::string saved_layout_words(const CheckpointInfo& info);

// The unit and parameter tables of `info` against the model split as `plan` (any world size: the
// tables do not depend on it): every unit present, none extra, its numel; each unit's tensors by
// name (none missing, none extra), shape, offset and numel. Not collective. Throws
// std::runtime_error naming the unit, the tensor and the field that differs ("tensor 'T' has numel
// 7 in the file (dataset 'param_table' of unit 'U'), expected 8 (the elements of its shape [2, 4])"),
// not the file.
void check_checkpoint_layout(const CheckpointInfo& info, const ShardPlan& plan);

// Collective. Loads every tensor of `into` (by name: "params" alone for the weights, or all of
// checkpoint_tensor_names() for a resume) from `path`; its plan may be for any world size (the
// saved rows are resharded: each rank reads the saved slices that overlap its rows; padding is
// zero). Checks, each failing with a CollectiveError naming file and unit/tensor: the model
// architecture equal to `mc`'s (labels such as `name` and `initializer_range` may differ; special
// token ids, where both set, must agree); every unit present, none extra; every tensor's name,
// shape and offset as expected; the CRC32 of every saved slice that this rank loads, plus a share
// of the others so that every slice is verified. `info`, when given, is the already read metadata
// of `path` (it is read otherwise). Returns the state the file records (saved_world_size set).
// A pipeline stage's tensors (into.stage set): the file must hold every unit of the whole model
// (stage->file_plan, checked as above), and this rank reads only the units of its plan, found by
// name (a tied copy reads the one stored embedding), from a file of any version and any saving
// mesh; a stage-less `into` reads a version 6 file like any other (every unit).
TrainState load_checkpoint(Comm& comm, const std::string& path, const ShardedTensors& into, const ModelConfig& mc,
                           const CheckpointInfo* info = nullptr);

// The model-config keys whose values differ between two canonical configs (config.h) in a way that
// matters for loading weights: every key except the labels (`name`, `initializer_range`: the field
// table's architecture = false);
// `bos_token_id`/`eos_token_id` count only when set (non-null) in both. Each entry reads
// "key: checkpoint has A, requested B" (values longer than 120 characters shortened). Both are
// first read as from_canonical_json reads them, so keys an older version did not write
// ("head_dim", "rope_scaling", issue 56's rows) take their old meaning; a side it refuses (a null,
// a key this version does not know) is itself a difference, "checkpoint: <why>", and its keys are
// then compared as written. Throws std::invalid_argument on malformed JSON.
std::vector<std::string> architecture_differences(const std::string& checkpoint_config,
                                                  const std::string& requested_config);

// Collective. Resolves --resume: "" -> "" (fresh start); "auto" -> the checkpoint that
// "<dir>/latest" names; with no `latest`, the newest "<dir>/step_*.h5"; with neither, "" (a first
// run); anything else is a path that must exist. A `latest` that names no existing checkpoint
// means a run existed and its newest state is gone: refused (naming the file and the newest
// checkpoint still present, if any), except that `start_over` with no checkpoint left returns ""
// (step 0). Throws CollectiveError (same message on every rank).
std::string resolve_resume(Comm& comm, const std::string& resume, const std::string& dir, bool start_over = false);

}  // namespace shardtrain
