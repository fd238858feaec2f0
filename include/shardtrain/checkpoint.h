// shardtrain checkpoints: one HDF5 file per checkpoint, written collectively by all ranks through
// parallel HDF5 (MPI-IO), self-describing (per-unit shard and parameter tables), checksummed,
// published atomically, and loadable at any world size (resharding).
//
// Layout: docs/checkpoint-format.md (enough to rebuild every tensor with h5py alone).
// HDF5 reference: https://docs.hdfgroup.org/hdf5/v1_10/ (H5P_SET_FAPL_MPIO, H5Sselect_hyperslab).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/config.h"
#include "shardtrain/runtime.h"
#include "shardtrain/shard.h"

namespace shardtrain {

template <typename T> class AdamW;
struct TrainConfig;

inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr const char* kProgramVersion = "shardtrain 0.1.0";

// Where a run stands, besides its tensors. The data position is `step` itself: batch k of the
// train split is a pure function of (seed, k) (see data.h), and so is the init.
struct TrainState {
  int64_t step = 0;         // optimizer steps completed
  int64_t tokens_seen = 0;  // step * global_batch * seq_len
  uint64_t seed = 0;        // seed of init and data stream
  int saved_world_size = 0; // world size the checkpoint was written at (0: not loaded)
};

// Per-unit tables as stored.
struct CheckpointUnitInfo {
  std::string name;
  int64_t numel = 0, shard_size = 0, padded_numel = 0;
  std::vector<RankShard> ranks;       // the shard table, one row per saving rank
  std::vector<ParamSlot> params;      // the parameter table (name, shape, offset, numel)
  std::vector<uint32_t> crc32;        // [world][3]: CRC32 of each rank's slice of params, adam_m, adam_v
};

struct CheckpointInfo {
  std::string path;
  int format_version = 0;
  int64_t step = 0, tokens_seen = 0;
  int world_size = 0;
  std::string model_config, train_config, data_position, rng_state, program_version;
  // JSON record of the token file the checkpoint was trained on (root attribute `data`): null
  // (none: an import, or an older checkpoint), or {"path": "...", "tokenizer": "byte-level",
  // "vocab_size": 258, "bos_id": 256, "eos_id": 257} from the token file's header.
  std::string data_info = "null";
  std::vector<CheckpointUnitInfo> units;
};

struct CheckpointOptions {
  std::string dir;                      // --checkpoint-dir; empty: no checkpoints
  int64_t every = 0;                    // --checkpoint-every N steps; 0: only at the end
  int keep_last = 0;                    // --keep-last K published checkpoints; 0: keep all
  int64_t debug_crash_before_publish = 0;  // test hook: die after writing step N, before publishing
};

// "step_00000100.h5" for step 100.
std::string checkpoint_name(int64_t step);

// Collective. Writes the checkpoint of `state.step` to "<dir>/.step_N.h5.tmp", then (all ranks
// done and the file closed) rank 0 fsyncs it, renames it to "<dir>/step_N.h5", points
// "<dir>/latest" at it (write-temp-then-rename), and only then deletes checkpoints beyond
// keep_last. Returns the published path. Throws CollectiveError (same message on every rank) if
// the directory cannot be created or written, or HDF5 fails.
std::string save_checkpoint(Comm& comm, Fsdp<float>& f, AdamW<float>& opt, const ModelConfig& mc,
                            const TrainConfig& tc, const TrainState& state, const CheckpointOptions& co);

// Collective. Writes a complete checkpoint file at `path` (no rename, no `latest`): the building
// block of save_checkpoint, also used by import. Throws CollectiveError naming the file.
void write_checkpoint_file(Comm& comm, const std::string& path, Fsdp<float>& f, AdamW<float>& opt,
                           const ModelConfig& mc, const TrainConfig& tc, const TrainState& state);

// Collective. Reads the metadata (root attributes and unit tables) of `path`. Throws
// CollectiveError naming the file for: a missing or unreadable file, a file that is not HDF5 or is
// truncated, a wrong format name, an unknown format version.
CheckpointInfo read_checkpoint_info(Comm& comm, const std::string& path);

// Collective. Loads parameters (and AdamW moments when opt != nullptr) from `path` into f, whose
// plan may be for any world size. Checks, each failing with a CollectiveError naming file and
// unit/tensor: model config equal to `mc`; every unit present, none extra; every tensor's name,
// shape and offset as expected; the CRC32 of every saved slice (each rank verifies a share).
TrainState load_checkpoint(Comm& comm, const std::string& path, Fsdp<float>& f, AdamW<float>* opt,
                           const ModelConfig& mc);

// Collective. Resolves --resume: "" -> "" (fresh start); "auto" -> the checkpoint that
// "<dir>/latest" names, else the newest "<dir>/step_*.h5", else "" (nothing to resume);
// anything else is a path that must exist. Throws CollectiveError if an explicit path is missing.
std::string resolve_resume(Comm& comm, const std::string& resume, const std::string& dir);

}  // namespace shardtrain
