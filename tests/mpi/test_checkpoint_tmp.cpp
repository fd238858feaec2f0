// The checkpoint directory's temporary names (checkpoint.h, "Temporary files"): the tag of this
// process, the names a save leaves when it is killed, parsed, and clean_checkpoint_temp_files
// removing a dead process's leftovers of this host while leaving (and reporting) a live process's,
// another host's and an earlier version's. The processes are real: a child that exited and was
// collected (gone), a zombie (exited, not collected: gone too), a sleeping child (alive).
// tests/e2e/test_checkpoint_tmp_names.sh does the same around a real kill -9 mid-save.
// Run under mpirun at 1, 2, 3 and 4 ranks.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/runtime.h"
#include "rank_test.h"

namespace st = shardtrain;
namespace fs = std::filesystem;

namespace {

st::Comm& world() { return st::testing::comm(); }

using Kind = st::CheckpointTempName::Kind;

st::CheckpointTempName parsed(const std::string& name, bool* ok) {
  st::CheckpointTempName t;
  t.host = "(untouched)";
  *ok = st::parse_checkpoint_temp_name(name, &t);
  return t;
}

// The one note that names `name`, or "" (none), or "(several)".
std::string note_of(const std::vector<std::string>& notes, const std::string& name) {
  std::string found;
  for (const std::string& n : notes)
    if (n.find("'" + name + "'") != std::string::npos) {
      if (!found.empty()) return "(several)";
      found = n;
    }
  return found;
}

std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names;
  for (auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class TempNames : public st::testing::TempDirTest {};

}  // namespace

TEST(CheckpointTempName, TagIsHostAndPid) {
  const std::string tag = st::checkpoint_temp_tag();
  char h[256] = {};
  ASSERT_EQ(::gethostname(h, sizeof h - 1), 0);
  std::string host = h;
  for (char& c : host)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-')) c = '-';
  char ns[64] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  const std::string nss = n > 0 ? std::string(ns, static_cast<size_t>(n)) : "";
  if (!nss.empty() && nss != "pid:[4026531836]") host += "_pidns" + nss.substr(5, nss.size() - 6);
  EXPECT_EQ(tag, host + "." + std::to_string(::getpid()));
  bool ok = false;
  const st::CheckpointTempName t = parsed(".step_00000008.h5." + tag + ".tmp", &ok);
  EXPECT_TRUE(ok);
  EXPECT_TRUE(t.tagged);
  EXPECT_EQ(t.host, host);
  EXPECT_EQ(t.pid, static_cast<long long>(::getpid()));
}

TEST(CheckpointTempName, ParsesEveryKindAndRefusesLookalikes) {
  bool ok = false;
  st::CheckpointTempName t = parsed(".step_00000008.h5.node-7.cluster.local.4242.tmp", &ok);
  EXPECT_TRUE(ok);
  EXPECT_EQ(t.kind, Kind::kCheckpoint);
  EXPECT_TRUE(t.tagged);
  EXPECT_EQ(t.host, "node-7.cluster.local");
  EXPECT_EQ(t.pid, 4242);
  t = parsed("latest.n1_pidns4026532001.17.tmp", &ok);
  EXPECT_TRUE(ok);
  EXPECT_EQ(t.kind, Kind::kLatest);
  EXPECT_EQ(t.host, "n1_pidns4026532001");
  EXPECT_EQ(t.pid, 17);
  t = parsed(".shardtrain-probe-vm.31337.123456789", &ok);
  EXPECT_TRUE(ok);
  EXPECT_EQ(t.kind, Kind::kProbe);
  EXPECT_EQ(t.host, "vm");
  EXPECT_EQ(t.pid, 31337);
  t = parsed(".shardtrain-probe-vm.31337.123456789.tmp", &ok);  // write_file_atomic's own temporary
  EXPECT_TRUE(ok);
  EXPECT_EQ(t.kind, Kind::kProbe);
  EXPECT_EQ(t.pid, 31337);
  // An earlier version's names: recognized, untagged.
  for (const std::string n : {".step_00000010.h5.tmp", "latest.tmp", ".shardtrain-probe-98765", ".shardtrain-probe-98765.tmp"}) {
    t = parsed(n, &ok);
    EXPECT_TRUE(ok) << n;
    EXPECT_FALSE(t.tagged) << n;
    EXPECT_EQ(t.pid, 0) << n;
    EXPECT_EQ(t.host, "") << n;
  }
  EXPECT_EQ(parsed("latest.tmp", &ok).kind, Kind::kLatest);
  EXPECT_EQ(parsed(".step_00000010.h5.tmp", &ok).kind, Kind::kCheckpoint);
  // Not temporary names of ours (published files, other files, malformed tags): *out untouched.
  for (const std::string n :
       {"step_00000008.h5", "latest", ".step_0000008.h5.tmp", ".step_00000008.h5.vm.tmp", ".step_00000008.h5.vm.01.tmp",
        ".step_00000008.h5..12.tmp", ".step_00000008.h5.a b.12.tmp", ".step_00000008.h5.vm.12x.tmp",
        ".step_00000008.h5.vm.1234567890123456789.tmp", "latest..tmp", "latest.x.tmp", "latest.vm.12.tmp.bak",
        ".shardtrain-probe-", ".shardtrain-probe-abc", ".shardtrain-probe-vm.12.x", "metrics.jsonl.tmp", "x.tmp"}) {
    t = parsed(n, &ok);
    EXPECT_FALSE(ok) << n;
    EXPECT_EQ(t.host, "(untouched)") << n;
  }
}

// Rank 0 plants the names; every rank calls the cleanup (only rank 0 acts, no rank waits).
TEST_F(TempNames, CleanupRemovesOnlyDeadProcessesFilesOfThisHost) {
  st::Comm& c = world();
  const std::string tag = st::checkpoint_temp_tag();
  const std::string host = tag.substr(0, tag.rfind('.'));
  pid_t gone = -1, zombie = -1, alive = -1;
  std::vector<std::string> want_left;
  if (c.rank() == 0) {
    gone = ::fork();
    if (gone == 0) ::_exit(0);
    ::waitpid(gone, nullptr, 0);  // exited and collected: its pid names no process
    zombie = ::fork();
    if (zombie == 0) ::_exit(0);
    alive = ::fork();
    if (alive == 0) {
      ::pause();
      ::_exit(0);
    }
    for (int i = 0; i < 500; ++i) {  // until the zombie is one (its exit is asynchronous)
      std::ifstream st("/proc/" + std::to_string(zombie) + "/stat");
      std::string l;
      std::getline(st, l);
      if (l.find(") Z") != std::string::npos) break;
      ::usleep(10'000);
    }
    const std::string G = host + "." + std::to_string(gone), Z = host + "." + std::to_string(zombie),
                      A = host + "." + std::to_string(alive);
    const std::vector<std::string> files = {
        ".step_00000008.h5." + G + ".tmp", "latest." + G + ".tmp", ".shardtrain-probe-" + G + ".77",
        ".shardtrain-probe-" + G + ".77.tmp", ".step_00000012.h5." + Z + ".tmp",  // removed
        ".step_00000008.h5." + A + ".tmp", "latest." + A + ".tmp",                // live process
        ".step_00000008.h5." + tag + ".tmp",                                       // this process
        ".step_00000008.h5.elsewhere.example." + std::to_string(gone) + ".tmp",   // another host
        "latest." + host + "_pidns4026532999." + std::to_string(gone) + ".tmp",   // another PID namespace
        ".step_00000004.h5.tmp", "latest.tmp", ".shardtrain-probe-12345",          // an earlier version
        "step_00000004.h5", "latest", "notes.tmp"};                                // not temporary
    for (const std::string& f : files) std::ofstream(dir_ + "/" + f) << "x";
    fs::create_directory(dir_ + "/.step_00000016.h5." + G + ".tmp");  // not a regular file: not ours
    want_left = {".shardtrain-probe-12345",
                 ".step_00000004.h5.tmp",
                 ".step_00000008.h5." + A + ".tmp",
                 ".step_00000008.h5." + tag + ".tmp",
                 ".step_00000008.h5.elsewhere.example." + std::to_string(gone) + ".tmp",
                 ".step_00000016.h5." + G + ".tmp",
                 "latest",
                 "latest." + A + ".tmp",
                 "latest." + host + "_pidns4026532999." + std::to_string(gone) + ".tmp",
                 "latest.tmp",
                 "notes.tmp",
                 "step_00000004.h5"};
    std::sort(want_left.begin(), want_left.end());
  }
  c.barrier();
  const std::vector<std::string> notes = st::clean_checkpoint_temp_files(c, dir_);
  c.barrier();
  if (c.rank() != 0) {
    EXPECT_TRUE(notes.empty());
    return;
  }
  EXPECT_EQ(listing(dir_), want_left);
  EXPECT_EQ(notes.size(), 13u);
  const std::string G = host + "." + std::to_string(gone);
  for (const std::string& f : {".step_00000008.h5." + G + ".tmp", "latest." + G + ".tmp", ".shardtrain-probe-" + G + ".77",
                               ".shardtrain-probe-" + G + ".77.tmp"}) {
    EXPECT_EQ(note_of(notes, f), "note: removed '" + f + "' in '" + dir_ + "': a temporary file of an interrupted save; process " +
                                     std::to_string(gone) + " on " + host + " is gone");
  }
  const std::string zf = ".step_00000012.h5." + host + "." + std::to_string(zombie) + ".tmp";
  EXPECT_EQ(note_of(notes, zf), "note: removed '" + zf + "' in '" + dir_ +
                                    "': a temporary file of an interrupted save; process " + std::to_string(zombie) +
                                    " on " + host + " is gone");
  const std::string af = ".step_00000008.h5." + host + "." + std::to_string(alive) + ".tmp";
  EXPECT_EQ(note_of(notes, af), "note: left '" + af + "' in '" + dir_ + "': process " + std::to_string(alive) + " on " +
                                    host + " is alive (a save of another job, or a process id used again since its writer died)");
  EXPECT_NE(note_of(notes, "latest." + host + "." + std::to_string(alive) + ".tmp").find(" is alive"), std::string::npos);
  EXPECT_NE(note_of(notes, ".step_00000008.h5." + tag + ".tmp").find(" is alive"), std::string::npos);
  const std::string of = ".step_00000008.h5.elsewhere.example." + std::to_string(gone) + ".tmp";
  EXPECT_EQ(note_of(notes, of), "note: left '" + of + "' in '" + dir_ + "': a temporary file of process " +
                                    std::to_string(gone) + " of host elsewhere.example: not checked from here");
  const std::string nf = "latest." + host + "_pidns4026532999." + std::to_string(gone) + ".tmp";
  EXPECT_NE(note_of(notes, nf).find("of host " + host + "_pidns4026532999: not checked from here"), std::string::npos)
      << note_of(notes, nf);
  for (const std::string f : {".step_00000004.h5.tmp", "latest.tmp", ".shardtrain-probe-12345"})
    EXPECT_EQ(note_of(notes, f), "note: left '" + f + "' in '" + dir_ + "': a temporary file of an earlier shardtrain " +
                                     "version, which names no process: not removed (remove it once no job of an earlier " +
                                     "version writes to this directory)");
  for (const std::string f : {"latest", "step_00000004.h5", "notes.tmp"}) EXPECT_EQ(note_of(notes, f), "") << f;
  EXPECT_EQ(note_of(notes, ".step_00000016.h5." + G + ".tmp"), "");
  // Notes in name order.
  EXPECT_TRUE(std::is_sorted(notes.begin(), notes.end(), [](const std::string& a, const std::string& b) {
    return a.substr(a.find('\'')) < b.substr(b.find('\''));
  }));
  ::kill(alive, SIGKILL);
  ::waitpid(alive, nullptr, 0);
  ::waitpid(zombie, nullptr, 0);
  // The live one's writer is gone now: a second run removes its files, and reports the rest again.
  const std::vector<std::string> again = st::clean_checkpoint_temp_files(c, dir_);
  EXPECT_EQ(again.size(), 8u);
  EXPECT_NE(note_of(again, af).find("note: removed '"), std::string::npos) << note_of(again, af);
  EXPECT_FALSE(fs::exists(dir_ + "/" + af));
  EXPECT_FALSE(fs::exists(dir_ + "/latest." + host + "." + std::to_string(alive) + ".tmp"));
}

// A missing directory: one note, no throw, on every rank.
TEST_F(TempNames, MissingDirectoryIsANote) {
  st::Comm& c = world();
  const std::vector<std::string> notes = st::clean_checkpoint_temp_files(c, dir_ + "/nope");
  if (c.rank() == 0) {
    ASSERT_EQ(notes.size(), 1u);
    EXPECT_NE(notes[0].find("could not list '" + dir_ + "/nope'"), std::string::npos) << notes[0];
  } else {
    EXPECT_TRUE(notes.empty());
  }
}
