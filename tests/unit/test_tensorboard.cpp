// TensorBoard event files (tensorboard.h): CRC32C against published vectors (RFC 3720 B.4 and the
// "123456789" check value), the TFRecord framing and the Event encoding against bytes written out
// here by hand (CRCs from TensorBoard's own pure-Python masked_crc32c), the tag map, and a written
// file read back record by record. tests/e2e/test_tensorboard.sh reads real runs' files with
// TensorBoard's EventAccumulator.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "shardtrain/io/tensorboard.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {
std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string o;
  for (unsigned char c : s) o += {d[c >> 4], d[c & 15]};
  return o;
}
}  // namespace

TEST(TensorBoard, Crc32cKnownVectors) {
  EXPECT_EQ(crc32c_update(0, "123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c_update(0, zeros.data(), zeros.size()), 0x8A9136AAu);
  std::string inc;
  for (int i = 0; i < 32; ++i) inc.push_back(static_cast<char>(i));
  EXPECT_EQ(crc32c_update(0, inc.data(), inc.size()), 0x46DD794Eu);
  // Continuing in pieces gives the CRC of the whole.
  EXPECT_EQ(crc32c_update(crc32c_update(0, "1234", 4), "56789", 5), 0xE3069283u);
}

TEST(TensorBoard, EventAndRecordBytes) {
  // Event{wall_time 1.5, step 3, summary{value{tag "a", simple_value 1.0}}}, by hand:
  // 09 <1.5 as LE double> | 10 03 | 2a 0a [ 0a 08 [ 0a 01 'a' | 15 <1.0f LE> ] ]
  const std::string want = "09000000000000f83f" "1003" "2a0a" "0a08" "0a0161" "150000803f";
  const std::string ev = tb_event_scalars(1.5, 3, {{"a", 1.0f}});
  EXPECT_EQ(hex(ev), want);
  // length 23 (LE uint64), masked CRC32C of those 8 bytes, data, masked CRC32C of the data.
  EXPECT_EQ(hex(tfrecord_frame(ev)), "1700000000000000" "e7cef81e" + want + "59859981");
  // START at step 7: 09 <0.0> | 10 07 | 3a 02 [ 08 01 ]  (session_log = field 7)
  EXPECT_EQ(hex(tb_event_start(0.0, 7)), "090000000000000000" "1007" "3a020801");
  // A step past 2^31 is a multi-byte varint.
  EXPECT_EQ(hex(tb_event_start(0.0, int64_t{1} << 32)).substr(18, 14), "1080808080103a");
  // file_version "brain.Event:2" (field 3) and source_metadata{writer "shardtrain"} (field 10).
  EXPECT_EQ(hex(tb_event_file_version(0.0)).substr(18), "1a0d" + hex("brain.Event:2") + "520c0a0a" + hex("shardtrain"));
}

TEST(TensorBoard, TagMap) {
  EXPECT_EQ(tensorboard_tag("step"), "");
  EXPECT_EQ(tensorboard_tag("loss"), "train/loss");
  EXPECT_EQ(tensorboard_tag("lr"), "train/lr");
  EXPECT_EQ(tensorboard_tag("grad_norm"), "train/grad_norm");
  EXPECT_EQ(tensorboard_tag("val_loss"), "val/loss");
  EXPECT_EQ(tensorboard_tag("tokens_per_s"), "perf/tokens_per_s");
  EXPECT_EQ(tensorboard_tag("elapsed_s"), "perf/elapsed_s");
  EXPECT_EQ(tensorboard_tag("compute_ms"), "perf/compute_ms");
  EXPECT_EQ(tensorboard_tag("comm_ms"), "perf/comm_ms");
  EXPECT_EQ(tensorboard_tag("exposed_comm_ms"), "perf/exposed_comm_ms");
  EXPECT_EQ(tensorboard_tag("mfu"), "perf/mfu");
  EXPECT_EQ(tensorboard_tag("peak_mem_mib"), "perf/peak_mem_mib");
  EXPECT_EQ(tensorboard_tag("step_ms_max"), "perf/step_ms_max");
  EXPECT_EQ(tensorboard_tag("wait_ms_median"), "perf/wait_ms_median");
  EXPECT_EQ(tensorboard_tag("slowest_rank"), "perf/slowest_rank");
  EXPECT_EQ(tensorboard_tag("skipped_updates"), "train/skipped_updates");
}

TEST(TensorBoard, FileName) {
  EXPECT_EQ(tensorboard_file_name(1700000000, "node1", 4242, 0), "events.out.tfevents.1700000000.node1.4242.0");
  EXPECT_EQ(tensorboard_file_name(5, "h", 1, 2), "events.out.tfevents.0000000005.h.1.2");
}

TEST(TensorBoard, WritesRecordsInOrderAndSortsAfterExistingFiles) {
  char tmpl[] = "/tmp/shardtrain-tb.XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const fs::path root = tmpl, d = root / "tb";
  fs::create_directories(d);
  std::ofstream(d / "events.out.tfevents.9999999990.other.1.0") << "";  // from the future: the new name sorts after it
  TensorBoardWriter w(d.string(), 5);
  ASSERT_TRUE(w.good());
  EXPECT_NE(w.note().find("already holds 1 event file(s)"), std::string::npos) << w.note();
  EXPECT_EQ(fs::path(w.path()).filename().string().substr(0, 31), "events.out.tfevents.9999999991.");
  w.write(nlohmann::json{{"step", 5}, {"loss", 2.5}, {"note", "text"}, {"flag", true}});
  w.write(nlohmann::json{{"val_loss", 1.0}});  // no step: not a record
  ASSERT_TRUE(w.good());
  std::ifstream in(w.path(), std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> events;
  for (size_t p = 0; p < bytes.size();) {
    ASSERT_LE(p + 12, bytes.size());
    uint64_t n = 0;
    std::memcpy(&n, bytes.data() + p, 8);
    ASSERT_LE(p + 16 + n, bytes.size());
    const std::string data = bytes.substr(p + 12, n);
    EXPECT_EQ(tfrecord_frame(data), bytes.substr(p, 16 + n));
    events.push_back(data);
    p += 16 + n;
  }
  ASSERT_EQ(events.size(), 3u);
  EXPECT_NE(events[0].find("brain.Event:2"), std::string::npos);
  EXPECT_EQ(hex(events[1]).substr(18), "1005" "3a020801");
  // loss and flag (as 1.0), in the record's (sorted) key order; the string is left out.
  EXPECT_EQ(hex(events[2]).substr(18), "1005" "2a26" "0a11" "0a0a" + hex("train/flag") + "150000803f" + "0a11" "0a0a" +
                                           hex("train/loss") + "1500002040");
  fs::remove_all(root);
}
