// Job-file text before Boost parses it (normalize_job_file): the byte order mark and full-line
// ';' comments go, line numbers and everything else (a ';' after a value included) stay.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "shardtrain/parallel/geometry.h"
#include "shardtrain/app/options.h"

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

// --cp C with --tp N and --shard-group-size G (ranks of a replica: its CP and TP groups included):
// {dp_replicate W / G, dp_shard G / (C x N), cp C, tp N}, each field against the arithmetic here;
// every refusal names the option and the numbers.
TEST(MeshDims, ContextParallelResolves) {
  for (int W : {1, 2, 4, 6, 8, 12})
    for (int C : {1, 2, 3, 4})
      for (int N : {1, 2})
        for (int G : {0, 2, 4, 6, 12}) {  // 0: the default (the world)
          const int g = G == 0 ? W : G;
          const bool ok = W % (C * N) == 0 && W % g == 0 && g % (C * N) == 0;
          const std::string sgs = G == 0 ? "" : std::to_string(G);
          try {
            const MeshDims d = resolve_mesh_dims(sgs, N, C, W, 1);
            EXPECT_TRUE(ok) << "accepted W " << W << " cp " << C << " tp " << N << " G " << g;
            EXPECT_EQ(d.cp, C);
            EXPECT_EQ(d.tp, N);
            EXPECT_EQ(d.dp_replicate, W / g);
            EXPECT_EQ(d.dp_shard * C * N, g);
            EXPECT_EQ(d.world(), W);
            EXPECT_EQ(d.fsdp(), g / N);  // the FSDP shard group: dp_shard x cp ranks of equal TP rank
          } catch (const std::invalid_argument& e) {
            EXPECT_FALSE(ok) << "refused W " << W << " cp " << C << " tp " << N << " G " << g << ": " << e.what();
          }
        }
}

TEST(MeshDims, ContextParallelRefusalsNameTheNumbers) {
  auto msg = [](const std::string& sgs, int tp, int cp, int W) {
    try {
      resolve_mesh_dims(sgs, tp, cp, W, 1);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(msg("", 1, 3, 4),
            "option '--cp' (3) does not divide the world size (4): the ranks are dp_replicate x dp_shard x cp x tp");
  EXPECT_EQ(msg("", 2, 3, 4), "option '--cp' (3) x '--tp' (2) does not divide the world size (4): the ranks are "
                              "dp_replicate x dp_shard x cp x tp");
  EXPECT_EQ(msg("2", 1, 4, 8), "option '--shard-group-size' (2) is not a multiple of '--cp' x '--tp' (4 x 1): a shard "
                               "group is made of whole CP and TP groups");
  EXPECT_EQ(msg("", 1, 0, 4), "option '--cp' must be an integer in [1, 65536], got 0");
  EXPECT_EQ(msg("", 1, 65537, 4), "option '--cp' must be an integer in [1, 65536], got 65537");
  EXPECT_EQ(msg("4", 2, 2, 8), "accepted");
}

TEST(CpComm, ParsesTheOptionsSpellingsAndRefusesOthers) {
  EXPECT_EQ(parse_cp_comm("ring"), CpComm::Ring);
  EXPECT_EQ(parse_cp_comm("allgather"), CpComm::AllGather);
  EXPECT_STREQ(cp_comm_name(CpComm::Ring), "ring");
  EXPECT_STREQ(cp_comm_name(CpComm::AllGather), "allgather");
  try {
    parse_cp_comm("all-gather");
    ADD_FAILURE() << "accepted 'all-gather'";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "option '--cp-comm' must be ring or allgather, got 'all-gather'");
  }
}

// --pp P: the outermost dimension; everything else resolves inside one stage's W / P ranks.
TEST(MeshDims, PipelineStagesResolve) {
  for (int W : {1, 2, 4, 6, 8, 12})
    for (int P : {1, 2, 3, 4})
      for (int N : {1, 2})
        for (int G : {0, 2, 3}) {  // shard group size: 0 = the ranks of a stage
          const bool ok = W % P == 0 && (W / P) % N == 0 && (G == 0 || ((W / P) % G == 0 && G % N == 0));
          try {
            const MeshDims d = resolve_mesh_dims(G ? std::to_string(G) : "", N, 1, W, 1, P);
            EXPECT_TRUE(ok) << "accepted W " << W << " pp " << P << " tp " << N << " G " << G;
            EXPECT_EQ(d.pp, P);
            EXPECT_EQ(d.world(), W);
            EXPECT_EQ(d.dp_replicate * d.dp_shard * N, W / P);
            EXPECT_EQ(d.dp_replicate, G ? W / P / G : 1);
          } catch (const std::invalid_argument& e) {
            EXPECT_FALSE(ok) << "refused W " << W << " pp " << P << " tp " << N << " G " << G << ": " << e.what();
          }
        }
  try {
    resolve_mesh_dims("", 3, 1, 12, 1, 3);  // 4 ranks per stage: tp 3 does not divide them
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "option '--tp' (3) does not divide the ranks of a pipeline stage (4 = world size "
                                     "12 / '--pp' 3)");
  }
  try {
    resolve_mesh_dims("4", 1, 1, 4, 1, 2);  // a stage has 2 ranks
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "option '--shard-group-size' (4) does not divide the ranks of a pipeline stage (2 = "
                                     "world size 4 / '--pp' 2)");
  }
  EXPECT_EQ(parse_pp_layers("3,1,12"), (std::vector<int>{3, 1, 12}));
  EXPECT_TRUE(parse_pp_layers("").empty());
  for (const char* bad : {"3,,1", "0,2", "-1,3", "a", "3,", "1234567"})
    EXPECT_THROW(parse_pp_layers(bad), std::invalid_argument) << bad;
}
