// TensorBoard event files written by shardtrain itself (--tensorboard DIR): the metrics records of
// a run (the JSON objects of --metrics) as scalar summaries, readable by `tensorboard --logdir` and by
// `wandb sync --sync-tensorboard`. Rank 0 only; not collective, and it knows no communicator: the
// trainer decides who writes and makes every rank agree on errors.
//
// Deliberately not libprotobuf: an event file needs three tiny messages, encoded here by hand
// (varints, length-delimited fields, one fixed64 and one fixed32). Field numbers are those of
// TensorBoard's tensorboard/compat/proto/event.proto and summary.proto (as its event_pb2 /
// summary_pb2 descriptors report them):
//   Event      { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
//                SessionLog session_log = 7; SourceMetadata source_metadata = 10; }
//   Summary    { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
//   SessionLog { SessionStatus status = 1; }   (START = 1)
//   SourceMetadata { string writer = 1; }
// libprotobuf would add protoc to the build, TensorBoard's .proto files to the repository and a
// library to every link for these ~60 lines. Records are framed as TFRecord: uint64 length (little
// endian), masked CRC32C of those 8 bytes, the data, masked CRC32C of the data; mask(c) =
// ((c >> 15) | (c << 17)) + 0xa282ead8.
//
// Restarts. A file's first events are Event{file_version "brain.Event:2"} and
// Event{step = first_step, session_log {status START}}. TensorBoard's EventAccumulator (the
// Python loader, `purge_orphaned_data`, on by default) reads a run's files in name order and, on a
// START event of step S, drops every event it has seen with step >= S. A resumed run from the
// checkpoint of step N writes a new file with START at N + 1: the steps a crashed run logged after
// its last checkpoint disappear, as the --metrics file moves them to <metrics>.discarded, and each
// step shows once. A fresh run (START at 1) hides the events of an earlier run in the same
// directory, as --metrics truncates its file (the old files stay on disk).
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain {

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78) of `n` bytes at `p`, continuing from `crc`
// (0 to start): crc32c("123456789") = 0xE3069283. Table-driven; the records are small.
uint32_t crc32c_update(uint32_t crc, const void* p, size_t n);
// TFRecord's masked CRC32C of `n` bytes at `p`.
uint32_t tfrecord_masked_crc(const void* p, size_t n);
// One TFRecord: the 8-byte length, its masked CRC, `data`, the data's masked CRC.
std::string tfrecord_frame(const std::string& data);

// The serialized Event messages the writer emits (layout above).
std::string tb_event_file_version(double wall_time);
std::string tb_event_start(double wall_time, int64_t step);
// `values`: (tag, value) pairs of one Summary, each value stored as float32 (simple_value).
std::string tb_event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);

// The TensorBoard tag of a metrics key (docs/monitoring.md, "TensorBoard"): loss -> train/loss, val_loss ->
// val/loss, any other val_X -> val/X; timings, rates, memory and MFU (keys ending in _s, _ms,
// _per_s, _bytes, _mib, _gib, or holding "_ms_", "mem", "mfu" or "rank": the straggler fields) -> perf/<key>; everything else
// -> train/<key> (lr, grad_norm, skipped updates, ...). "" for "step", which is the event's step.
std::string tensorboard_tag(const std::string& key);

// The file name TensorFlow's EventFileWriter gives: events.out.tfevents.<%010d seconds>.<host>.<pid>.<n>.
std::string tensorboard_file_name(int64_t seconds, const std::string& host, long pid, int n);

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and a new event file in it, then writes and flushes the file-version
  // event and the START event of `first_step` (the first step this run trains, 1-based). The file's
  // seconds are now, or one more than the newest event file already in `dir` (so that its name sorts
  // after theirs: TensorBoard reads a run's files in name order). Throws std::runtime_error naming
  // the file (or the directory) and option '--tensorboard'.
  TensorBoardWriter(const std::string& dir, int64_t first_step);

  // One metrics record (a JSON object with an integer "step"): its numbers (and booleans, as 0 / 1)
  // as one Event of scalars at that step, under tensorboard_tag(key); strings, arrays and objects
  // are left out; NaN and infinities are kept (TensorBoard draws them). Flushed (not fsync'd) at
  // once, as TensorBoard reads live files. Errors are kept for good().
  void write(const nlohmann::json& record);
  bool good() const { return static_cast<bool>(out_); }
  const std::string& path() const { return path_; }
  // "" or a sentence for the log: the directory already held event files, and what TensorBoard
  // will show of them.
  const std::string& note() const { return note_; }

 private:
  void append(const std::string& event);
  std::string path_, note_;
  std::ofstream out_;
};

}  // namespace shardtrain
