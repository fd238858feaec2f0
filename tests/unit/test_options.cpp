// Job-file text before Boost parses it (normalize_job_file): the byte order mark and full-line
// ';' comments go, line numbers and everything else (a ';' after a value included) stay.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "shardtrain/options.h"

using namespace shardtrain;

TEST(JobFile, StripsLeadingByteOrderMarkOnly) {
  EXPECT_EQ(normalize_job_file("\xEF\xBB\xBFsteps = 3\n"), "steps = 3\n");
  // A BOM elsewhere is not ours to drop: Boost then names the line.
  EXPECT_EQ(normalize_job_file("steps = 3\n\xEF\xBB\xBFlr = 1\n"), "steps = 3\n\xEF\xBB\xBFlr = 1\n");
  EXPECT_EQ(normalize_job_file("\xEF\xBB"), "\xEF\xBB");  // a partial BOM is left to Boost too
  EXPECT_EQ(normalize_job_file(""), "");
}

TEST(JobFile, FullLineSemicolonCommentsBecomeEmptyLines) {
  EXPECT_EQ(normalize_job_file("; a\nsteps = 3\n  ; b [x]\n\t;c\r\nlr = 1"), "\nsteps = 3\n\n\nlr = 1");
  EXPECT_EQ(normalize_job_file("\xEF\xBB\xBF; after a BOM\nsteps = 3"), "\nsteps = 3");
  EXPECT_EQ(normalize_job_file("steps = 3\n;last line, no newline"), "steps = 3\n");
  EXPECT_EQ(normalize_job_file(";\n;\n"), "\n\n");
}

TEST(JobFile, SemicolonAfterValueAndHashAreLeftAlone) {
  // Inline ';' is part of the value; '#' is Boost's comment, handled by Boost.
  const std::string s = "metrics = a;b.jsonl\nprompt = x ; y\n# hash\nsteps = 3 # three\n";
  EXPECT_EQ(normalize_job_file(s), s);
}

// --shard-group-size (hybrid sharding): empty = the world size, "node" = the ranks per node, a
// number must divide the world size; every refusal names the option.
TEST(ShardGroupSize, Resolves) {
  EXPECT_EQ(resolve_shard_group_size("", 4, 2), 4);
  EXPECT_EQ(resolve_shard_group_size("2", 4, 1), 2);
  EXPECT_EQ(resolve_shard_group_size("4", 4, 1), 4);
  EXPECT_EQ(resolve_shard_group_size("node", 8, 4), 4);
  EXPECT_EQ(resolve_shard_group_size("3", 0, 0), 3);  // form only (option validation)
}

TEST(ShardGroupSize, RefusesNamingTheOption) {
  for (auto [v, w, k] : {std::tuple{"3", 4, 4}, {"0", 4, 4}, {"-2", 4, 4}, {"2x", 4, 4}, {"x", 4, 4},
                         {"node", 4, 0}, {"node", 4, 3}})
    try {
      resolve_shard_group_size(v, w, k);
      ADD_FAILURE() << "accepted '" << v << "' at world " << w;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("'--shard-group-size'"), std::string::npos) << e.what();
    }
  try {
    resolve_shard_group_size("3", 4, 4);
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "option '--shard-group-size' (3) does not divide the world size (4)");
  }
}
