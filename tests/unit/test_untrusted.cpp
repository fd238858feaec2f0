// Files from strangers (issue 27): the SentencePiece charsmap check against libsentencepiece's own
// builtin tables (an independent reference for valid tries), crafted tries, the path confinement of
// path_inside, and InputFile (issue 39: the checks hold for the open descriptor; no FIFO waited on).
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>

#include "shardtrain/runtime/files.h"
#include "shardtrain/data/tokenizer.h"

// libsentencepiece_train's builtin tables (builder.h is not installed; see src/data/tokenizer.cpp).
namespace sentencepiece::normalizer {
class Builder {
 public:
  static util::Status GetPrecompiledCharsMap(std::string_view name, std::string* output);
};
}  // namespace sentencepiece::normalizer

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {
std::string varint(uint64_t v) {
  std::string s;
  do {
    s.push_back(static_cast<char>((v & 0x7f) | (v > 0x7f ? 0x80 : 0)));
    v >>= 7;
  } while (v);
  return s;
}
std::string bytes_field(int field, const std::string& b) { return varint(static_cast<uint64_t>(field) << 3 | 2) + varint(b.size()) + b; }
// A ModelProto holding only normalizer_spec {name, precompiled_charsmap}: all the check reads.
std::string model_with(const std::string& name, const std::string& charsmap, int spec_field = 3) {
  return bytes_field(spec_field, bytes_field(1, name) + bytes_field(2, charsmap));
}
std::string u32(uint32_t v) { return std::string{char(v), char(v >> 8), char(v >> 16), char(v >> 24)}; }
std::string builtin(const char* name) {
  std::string t;
  EXPECT_TRUE(sentencepiece::normalizer::Builder::GetPrecompiledCharsMap(name, &t).ok()) << name;
  return t;
}
std::string refusal(const std::string& model) {
  try {
    check_sentencepiece_model(model, "'m.model'");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// Each builtin table (as T5-like models carry it) passes both ways: equal to the library's table
// for its name, and, under a name that is not builtin, through the full trie walk.
TEST(Untrusted, BuiltinCharsmapsPass) {
  for (const char* name : {"nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"}) {
    const std::string t = builtin(name);
    ASSERT_GT(t.size(), 1000u) << name;
    EXPECT_EQ(refusal(model_with(name, t)), "") << name;
    EXPECT_EQ(refusal(model_with("user_defined", t)), "") << name;
    EXPECT_EQ(refusal(model_with("user_defined", t, 5)), "") << name;  // denormalizer_spec
  }
  EXPECT_EQ(refusal(model_with("identity", "")), "");  // Llama's: no table
}

// The smallest crash of the issue: one trie unit whose offset leads far past the trie.
TEST(Untrusted, TrieOffsetPastTheBlobIsRefused) {
  const std::string blob = u32(4) + u32(0x7ffffc00u) + std::string(1, '\0');
  const std::string m = refusal(model_with("identity", blob));
  EXPECT_NE(m.find("'m.model': field 'normalizer_spec.precompiled_charsmap'"), std::string::npos) << m;
  EXPECT_NE(m.find("unit 0) whose children lie beyond its 1 units"), std::string::npos) << m;
  EXPECT_NE(refusal(model_with("identity", blob, 5)).find("'denormalizer_spec.precompiled_charsmap'"), std::string::npos);
  // A trie size beyond the blob (the library checks only size < blob size: 3 bytes would be read past).
  const std::string t = builtin("nmt_nfkc");
  std::string bad = t;
  const std::string sz = u32(static_cast<uint32_t>(t.size() - 1));
  bad.replace(0, 4, sz);
  EXPECT_NE(refusal(model_with("nmt_nfkc", bad)).find("says its trie holds"), std::string::npos);
  EXPECT_NE(refusal(model_with("x", std::string(3, '\0'))).find("holds 3 bytes"), std::string::npos);
}

// A leaf value past the normalized strings, or a string without its NUL, is refused.
TEST(Untrusted, TrieValueOutsideTheStringsIsRefused) {
  const std::string t = builtin("nfkc");
  const uint32_t trie_bytes = static_cast<uint32_t>(static_cast<unsigned char>(t[0]) | static_cast<unsigned char>(t[1]) << 8 |
                                                    static_cast<unsigned char>(t[2]) << 16 | static_cast<unsigned char>(t[3]) << 24);
  // Cut the normalized strings to nothing: every leaf value now points outside them.
  const std::string cut = t.substr(0, 4 + trie_bytes) + std::string("");
  const std::string m = refusal(model_with("user_defined", cut));
  EXPECT_NE(m.find("not the start of a NUL-terminated string inside its 0 bytes"), std::string::npos) << m;
  // The same table with its last NUL removed: the last string is not terminated inside the blob.
  std::string open_end = t;
  ASSERT_EQ(open_end.back(), '\0');
  open_end.back() = 'x';
  EXPECT_NE(refusal(model_with("user_defined", open_end)).find("NUL-terminated"), std::string::npos);
  EXPECT_NE(refusal("\x1a\xff").find("not a well-formed SentencePiece model"), std::string::npos);
}

TEST(Untrusted, PathInsideRefusesWaysOut) {
  const fs::path d = fs::path(::testing::TempDir()) / "shardtrain_inside";
  const fs::path outside = fs::path(::testing::TempDir()) / "shardtrain_outside";
  fs::remove_all(d);
  fs::create_directories(d / "sub");
  fs::create_directories(outside);
  std::ofstream(outside / "secret") << "12345678";
  std::ofstream(d / "sub" / "a.bin") << "x";
  std::error_code ec;
  fs::create_symlink(outside / "secret", d / "out", ec);
  fs::create_symlink("sub/a.bin", d / "in", ec);
  const std::string dir = d.string();
  EXPECT_EQ(path_inside(dir, "sub/a.bin", "index 'i'"), (d / "sub" / "a.bin").string());
  EXPECT_EQ(path_inside(dir, "in", "index 'i'"), (d / "in").string());        // a link that stays inside
  EXPECT_EQ(path_inside(dir, "missing", "index 'i'"), (d / "missing").string());  // reported missing by the caller
  auto why = [&](const std::string& name) {
    try {
      path_inside(dir, name, "index 'i'");
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(why("/etc/passwd").find("index 'i' names '/etc/passwd', an absolute path outside"), std::string::npos);
  EXPECT_NE(why("sub/../../x").find("a path with '..'"), std::string::npos);
  EXPECT_NE(why("out").find("a symbolic link to '" + fs::canonical(outside / "secret").string() + "', outside of directory"),
            std::string::npos);
  EXPECT_NE(why("").find("an empty name"), std::string::npos);
  fs::remove_all(d);
  fs::remove_all(outside);
}

namespace {
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// InputFile: the checks hold for the descriptor, whatever happens to the name afterwards.
TEST(Untrusted, InputFileReadsTheFileItChecked) {
  const fs::path d = fs::path(::testing::TempDir()) / "shardtrain_inputfile";
  const fs::path outside = fs::path(::testing::TempDir()) / "shardtrain_inputfile_out";
  fs::remove_all(d);
  fs::remove_all(outside);
  fs::create_directories(d);
  fs::create_directories(outside);
  std::ofstream(d / "real") << "inside!!";
  std::ofstream(outside / "secret") << "SECRET!!";
  fs::create_symlink("real", d / "link");
  const InputFile f = InputFile::open_inside(d.string(), "link", "dir 'd'");
  EXPECT_EQ(f.size(), 8u);
  // The name now leads outside: the open descriptor still reads the file that was checked.
  fs::remove(d / "link");
  fs::create_symlink(outside / "secret", d / "link");
  EXPECT_EQ(f.read_all(), "inside!!");
  char b[4];
  f.read_at(b, 4, 4);
  EXPECT_EQ(std::string(b, 4), "de!!");
  EXPECT_NE(error_of([&] { f.read_at(b, 4, 6); }).find("end of file"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)f.read_all(7); }).find("has 8 bytes, more than the 7"), std::string::npos);
  // Opened now, the link is refused by the file it reaches, not by its name.
  EXPECT_NE(error_of([&] { InputFile::open_inside(d.string(), "link", "dir 'd'"); })
                .find("a symbolic link to '" + fs::canonical(outside / "secret").string() + "', outside"),
            std::string::npos);
  // Anything but a regular file, refused without blocking (a FIFO with no writer would block open(2)).
  ASSERT_EQ(::mkfifo((d / "fifo").c_str(), 0600), 0);
  fs::create_directories(d / "adir");
  EXPECT_NE(error_of([&] { InputFile::open((d / "fifo").string(), "model config file"); })
                .find("model config file '" + (d / "fifo").string() + "' is not a regular file (a FIFO)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { InputFile::open_inside(d.string(), "fifo", "dir 'd'"); }).find("is not a regular file (a FIFO)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { InputFile::open((d / "adir").string(), "job file"); }).find("is not a regular file (a directory)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { InputFile::open((d / "none").string(), "job file"); }).find("': no such file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { InputFile::open("/dev/null", "job file"); }).find("is not a regular file (a device)"),
            std::string::npos);
  EXPECT_TRUE(path_exists((d / "fifo").string()));
  EXPECT_FALSE(path_exists((d / "none").string()));
  fs::remove_all(d);
  fs::remove_all(outside);
}

// The hub-cache exception (issue 53): only huggingface_hub's own layout counts,
// models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/HASH. A folder merely named "snapshots" is
// not a cache, nor a repository folder not named models--*, nor a blob not named by its hash.
TEST(Untrusted, HubCacheExceptionNeedsTheCacheLayout) {
  const fs::path root = fs::path(::testing::TempDir()) / "shardtrain_hub";
  fs::remove_all(root);
  const std::string sha(64, 'a'), sha1(40, '0');
  // make(REPO, BLOB): REPO/blobs/BLOB holding "blob!!!!", REPO/snapshots/rev/f -> ../../blobs/BLOB.
  auto make = [&](const std::string& repo, const std::string& blob) {
    const fs::path r = root / repo;
    fs::create_directories((r / "blobs" / blob).parent_path());
    fs::create_directories(r / "snapshots" / "rev");
    std::ofstream(r / "blobs" / blob) << "blob!!!!";
    fs::create_symlink("../../blobs/" + blob, r / "snapshots" / "rev" / "f");
    return (r / "snapshots" / "rev").string();
  };
  for (const std::string& blob : {sha, sha1}) {  // the hub's layout: read (SHA-256 and git blob names)
    const std::string snap = make("models--org--m" + std::to_string(blob.size()), blob);
    EXPECT_EQ(InputFile::open_inside(snap, "f", "dir 's'").read_all(), "blob!!!!");
    EXPECT_EQ(path_inside(snap, "f", "dir 's'"), snap + "/f");
  }
  auto refusal = [&](const std::string& snap) {
    const std::string a = error_of([&] { InputFile::open_inside(snap, "f", "dir 's'"); });
    const std::string b = error_of([&] { path_inside(snap, "f", "dir 's'"); });
    EXPECT_EQ(a, b);  // by name and by descriptor, the same rule
    return a;
  };
  const std::string outside = "', outside of directory '";
  // Any directory named snapshots, outside a models--* repository folder: refused.
  const std::string plain = make("somewhere", sha);
  EXPECT_NE(refusal(plain).find("names 'f', a symbolic link to '" + fs::canonical(root / "somewhere/blobs" / sha).string() + outside),
            std::string::npos);
  EXPECT_NE(refusal(make("datasets--org--m", sha)).find(outside), std::string::npos);
  // In the layout, but not a blob: a name that is not a hash, a file in a subfolder of blobs/.
  EXPECT_NE(refusal(make("models--org--name", "secret.txt")).find(outside), std::string::npos);
  EXPECT_NE(refusal(make("models--org--sub", "x/" + sha)).find(outside), std::string::npos);
  EXPECT_NE(refusal(make("models--org--upper", std::string(64, 'A'))).find(outside), std::string::npos);
  // Another repository's blob, from a real snapshot: refused.
  const std::string snap = make("models--org--two", sha);
  fs::remove(fs::path(snap) / "f");
  fs::create_symlink("../../../models--org--m64/blobs/" + sha, fs::path(snap) / "f");
  EXPECT_NE(refusal(snap).find(outside), std::string::npos);
  fs::remove_all(root);
}

// InputDir (issue 53): a directory named through a link that is pointed elsewhere after the open
// still gives every file from the directory first opened.
TEST(Untrusted, InputDirKeepsTheDirectoryOpened) {
  const fs::path root = fs::path(::testing::TempDir()) / "shardtrain_inputdir";
  fs::remove_all(root);
  fs::create_directories(root / "a");
  fs::create_directories(root / "b");
  std::ofstream(root / "a" / "x") << "from a";
  std::ofstream(root / "b" / "x") << "from b";
  std::ofstream(root / "b" / "only_b") << "b";
  fs::create_symlink("a", root / "cur");
  const InputDir d = InputDir::open((root / "cur").string(), "option '--hf-dir'");
  EXPECT_EQ(d.real_path(), fs::canonical(root / "a").string());
  fs::remove(root / "cur");
  fs::create_symlink("b", root / "cur");
  EXPECT_EQ(d.open_inside("x", "dir").read_all(), "from a");
  EXPECT_EQ(d.open_inside("x", "dir").path(), (root / "cur" / "x").string());  // messages: the name given
  EXPECT_FALSE(d.has("only_b", "dir"));
  EXPECT_TRUE(d.has("x", "dir"));
  EXPECT_NE(error_of([&] { d.has("../b/x", "dir"); }).find("a path with '..'"), std::string::npos);
  EXPECT_NE(error_of([&] { d.open_inside("/etc/passwd", "dir"); }).find("an absolute path outside"), std::string::npos);
  // A link inside resolves from where the directory really is: ../b/x leads out of a.
  fs::create_symlink("../b/x", root / "a" / "up");
  EXPECT_NE(error_of([&] { d.open_inside("up", "dir"); })
                .find("names 'up', a symbolic link to '" + fs::canonical(root / "b" / "x").string() + "', outside of directory '" +
                      (root / "cur").string() + "'"),
            std::string::npos);
  // A link to a device outside is refused before anything is opened for reading (an O_PATH
  // descriptor checked first: opening a device can have effects of its own).
  fs::create_symlink("/dev/null", root / "a" / "dev");
  EXPECT_NE(error_of([&] { d.open_inside("dev", "dir"); }).find("a symbolic link to '/dev/null', outside"), std::string::npos);
  EXPECT_NE(error_of([&] { d.open_inside("none", "dir"); }).find("dir: file '" + (root / "cur" / "none").string() + "': no such file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { InputDir::open((root / "none").string(), "option '--hf-dir'"); })
                .find("option '--hf-dir' '" + (root / "none").string() + "': no such directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] { InputDir::open((root / "a" / "x").string(), "option '--hf-dir'"); })
                .find("is not a directory (a regular file)"),
            std::string::npos);
  fs::remove_all(root);
}

// Pseudo file systems (issue 53): refused by the file system's type (fstatfs), not by size.
TEST(Untrusted, PseudoFileSystemsRefused) {
  const fs::path d = fs::path(::testing::TempDir()) / "shardtrain_pseudo";
  fs::remove_all(d);
  fs::create_directories(d);
  std::ofstream(d / "plain") << "x";
  EXPECT_EQ(pseudo_fs_name(InputFile::open((d / "plain").string(), "f").fd()), nullptr);
  EXPECT_NE(error_of([&] { InputFile::open("/proc/self/status", "job file"); })
                .find("job file '/proc/self/status' lies on the proc pseudo file system"),
            std::string::npos);
  EXPECT_NE(error_of([&] { InputDir::open("/proc/self", "option '--hf-dir'"); })
                .find("option '--hf-dir' '/proc/self' lies on the proc pseudo file system"),
            std::string::npos);
  // Through a link from a directory on disk: refused by where the file is, not by its name.
  fs::create_symlink("/proc/self/environ", d / "config.json");
  EXPECT_NE(error_of([&] { InputFile::open_inside(d.string(), "config.json", "dir 'd'"); })
                .find("dir 'd': file '" + (d / "config.json").string() + "' lies on the proc pseudo file system"),
            std::string::npos);
  if (fs::exists("/sys/kernel/mm/transparent_hugepage/enabled")) {  // (sysfs: mounted in most containers)
    EXPECT_NE(error_of([&] { InputFile::open("/sys/kernel/mm/transparent_hugepage/enabled", "tokenizer"); })
                  .find("lies on the sysfs pseudo file system"),
              std::string::npos);
  }
  fs::remove_all(d);
}
