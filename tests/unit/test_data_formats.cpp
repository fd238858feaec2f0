// Token data as people keep it: llm.c .bin shards, nanoGPT raw uint16 files, shardtrain version 2
// (metadata + tokenizer files), several files read as one stream. Every file here is written byte by
// byte from the documented layouts (docs/data-format.md; llm.c dev/data/data_common.py
// write_datafile), independently of the reader under test.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardtrain/data/data.h"
#include "shardtrain/runtime/files.h"
#include "../token_files.h"

using namespace shardtrain;
using shardtrain::testing::put;
using shardtrain::testing::st_file;
using shardtrain::testing::eot_list;
using shardtrain::testing::V3;
using shardtrain::testing::v3_file;

namespace {
std::string tmp(const std::string& name) { return ::testing::TempDir() + "shardtrain_fmt_" + name; }
void write(const std::string& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }
std::string read(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
// llm.c: 256 int32 header (magic, version, token count, zeros), then the tokens.
std::string llmc(const std::vector<uint32_t>& toks, bool llama3 = false, int64_t count = -1) {
  std::string b;
  put(b, llama3 ? 20240801 : 20240520, 4);
  put(b, llama3 ? 7 : 1, 4);
  put(b, static_cast<uint64_t>(count < 0 ? static_cast<int64_t>(toks.size()) : count), 4);
  b.resize(1024, '\0');
  for (uint32_t t : toks) put(b, t, llama3 ? 4 : 2);
  return b;
}
std::string raw16(const std::vector<uint32_t>& toks) {
  std::string b;
  for (uint32_t t : toks) put(b, t, 2);
  return b;
}
std::vector<uint32_t> seq(size_t n, uint32_t mod, uint32_t mul = 2654435761u) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint32_t>((i * mul + 12345) % mod);
  return v;
}
std::vector<uint32_t> stream(const TokenDataset& ds, Split s) {
  std::vector<uint32_t> v(ds.size(s));
  ds.copy(s, 0, v.size(), v.data());
  return v;
}
// The message of the std::runtime_error that `f` throws ("" if none).
template <typename F> std::string error_of(F f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}
#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nwant: " << (part)
}  // namespace

TEST(DataFormats, LlmcGpt2AndLlama3ShardsReadBack) {
  const std::vector<uint32_t> g = seq(3000, 50257), l = seq(2000, 128256);
  write(tmp("gpt2.bin"), llmc(g));
  write(tmp("llama3.bin"), llmc(l, true));
  TokenDataset a(tmp("gpt2.bin"));
  EXPECT_EQ(stream(a, Split::Train), g);
  EXPECT_EQ(a.size(Split::Val), 0u);
  EXPECT_EQ(a.files()[0].format, "llm.c gpt-2 (u16)");
  EXPECT_EQ(a.header().vocab_size, 0u);
  EXPECT_EQ(a.tokenizer().kind, "");
  EXPECT_EQ(a.tokenizer().vocab_size, 0u);
  const size_t gmax = static_cast<size_t>(std::max_element(g.begin(), g.end()) - g.begin());
  EXPECT_EQ(a.max_id(), g[gmax]);
  EXPECT_EQ(a.max_id_where(), "token file '" + tmp("gpt2.bin") + "' byte offset " + std::to_string(1024 + 2 * gmax));
  EXPECT_EQ(a.crc32(), crc32_update(0, read(tmp("gpt2.bin")).data(), read(tmp("gpt2.bin")).size()));
  TokenDataset b(tmp("llama3.bin"), DataFormat::Llmc);
  EXPECT_EQ(stream(b, Split::Train), l);
  EXPECT_EQ(b.files()[0].token_bytes, 4u);
  EXPECT_GT(b.max_id(), 65535u);
}

TEST(DataFormats, NanoGptRawUint16NeedsTheFlag) {
  const std::vector<uint32_t> t = seq(1001, 50257);
  write(tmp("train.bin"), raw16(t));
  TokenDataset ds(tmp("train.bin"), DataFormat::NanoGPT);
  EXPECT_EQ(stream(ds, Split::Train), t);
  EXPECT_EQ(ds.files()[0].format, "nanogpt (u16)");
  const std::string m = error_of([&] { TokenDataset x(tmp("train.bin")); });
  EXPECT_HAS(m, "token file '" + tmp("train.bin") + "': bad magic");
  EXPECT_HAS(m, "'--data-format nanogpt'");
  write(tmp("odd.bin"), raw16(t) + "x");
  EXPECT_HAS(error_of([&] { TokenDataset x(tmp("odd.bin"), DataFormat::NanoGPT); }),
             "token file '" + tmp("odd.bin") + "': size 2003 bytes is odd");
}

TEST(DataFormats, ShardtrainVersion2MetadataAndTokenizerFiles) {
  const std::vector<uint32_t> t = seq(500, 1000);
  const std::string model = "a tokenizer.model's bytes \x01\x02\x03", cfg = "{\"x\": 1}";
  auto meta = [&](const std::string& kind, int vocab, const std::string& bos, uint32_t crc_model) {
    return std::string("{\"format\": \"shardtrain-tokens\", \"tokenizer\": {\"kind\": \"") + kind +
           "\", \"vocab_size\": " + std::to_string(vocab) + ", \"bos_id\": " + bos +
           ", \"eos_id\": 2, \"pad_id\": null, \"unk_id\": 0, \"add_bos\": true, \"add_eos\": false, \"files\": {"
           "\"tokenizer.model\": {\"offset\": 0, \"bytes\": " + std::to_string(model.size()) +
           ", \"crc32\": " + std::to_string(crc_model) + "}, \"tokenizer_config.json\": {\"offset\": " +
           std::to_string(model.size()) + ", \"bytes\": " + std::to_string(cfg.size()) +
           ", \"crc32\": " + std::to_string(crc32_update(0, cfg.data(), cfg.size())) +
           "}}}, \"documents\": 3, \"unknown_key\": [1]}";
  };
  const uint32_t crc = crc32_update(0, model.data(), model.size());
  const std::string area = model + cfg;
  write(tmp("v2.tok"), st_file(t, 100, 1000, kNoTokenId, 2, "sentencepiece", meta("sentencepiece", 1000, "null", crc), area));
  TokenDataset ds(tmp("v2.tok"));
  EXPECT_EQ(ds.files()[0].format, "shardtrain v2");
  EXPECT_EQ(stream(ds, Split::Train), std::vector<uint32_t>(t.begin(), t.begin() + 400));
  EXPECT_EQ(stream(ds, Split::Val), std::vector<uint32_t>(t.begin() + 400, t.end()));
  const TokenizerInfo& k = ds.tokenizer();
  EXPECT_EQ(k.kind, "sentencepiece");
  EXPECT_EQ(k.vocab_size, 1000u);
  EXPECT_EQ(k.bos_id, -1);
  EXPECT_EQ(k.eos_id, 2);
  EXPECT_EQ(k.pad_id, -1);
  EXPECT_EQ(k.unk_id, 0);
  EXPECT_TRUE(k.add_bos);
  EXPECT_FALSE(k.add_eos);
  ASSERT_EQ(k.files.size(), 2u);
  EXPECT_EQ(k.files.at("tokenizer.model"), model);
  EXPECT_EQ(k.files.at("tokenizer_config.json"), cfg);
  EXPECT_EQ(read_token_file_header(tmp("v2.tok")).version, 2u);
  // Version 1: byte-level info from the header, no files.
  write(tmp("v1.tok"), st_file(seq(100, 258), 10));
  TokenDataset one(tmp("v1.tok"));
  EXPECT_EQ(one.tokenizer().kind, "byte-level");
  EXPECT_EQ(one.tokenizer().vocab_size, 258u);
  EXPECT_EQ(one.tokenizer().bos_id, 256);
  EXPECT_EQ(one.tokenizer().eos_id, 257);
  EXPECT_TRUE(one.tokenizer().files.empty());

  // Bad metadata: each names the file and what is wrong.
  struct Bad {
    const char* name;
    std::string file, want;
  } bad[] = {
      {"json", st_file(t, 100, 1000, kNoTokenId, 2, "sentencepiece", "{not json}", ""), "not valid JSON"},
      {"crc", st_file(t, 100, 1000, kNoTokenId, 2, "sentencepiece", meta("sentencepiece", 1000, "null", crc ^ 1), area),
       "tokenizer file 'tokenizer.model' at byte offset"},
      {"kind", st_file(t, 100, 1000, kNoTokenId, 2, "sentencepiece", meta("hf-tokenizers", 1000, "null", crc), area),
       "tokenizer.kind 'hf-tokenizers' disagrees with the header's 'sentencepiece'"},
      {"vocab", st_file(t, 100, 1000, kNoTokenId, 2, "sentencepiece", meta("sentencepiece", 999, "null", crc), area),
       "tokenizer.vocab_size 999 disagrees with the header's 1000"},
      {"bos", st_file(t, 100, 1000, kNoTokenId, 2, "sentencepiece", meta("sentencepiece", 1000, "1", crc), area),
       "tokenizer.bos_id 1 disagrees with the header's none"},
      {"beyond", st_file(t, 100, 1000, kNoTokenId, 2, "sentencepiece", meta("sentencepiece", 1000, "null", crc),
                            area.substr(0, area.size() - 3)),
       "lies beyond the end of the file"},
      {"extra", st_file(t, 100, 1000, kNoTokenId, 2, "sentencepiece", meta("sentencepiece", 1000, "null", crc), area + "zz"),
       "does not match header and metadata"},
  };
  for (const Bad& x : bad) {
    const std::string p = tmp(std::string("v2bad_") + x.name + ".tok");
    write(p, x.file);
    const std::string m = error_of([&] { TokenDataset d(p); });
    EXPECT_HAS(m, "token file '" + p + "'");
    EXPECT_HAS(m, x.want);
  }
}

// A batch whose sequences cross file boundaries equals the batch of one file holding the same tokens.
TEST(DataFormats, SeveralFilesReadAsOneStream) {
  const std::vector<uint32_t> t = seq(337, 50257);
  write(tmp("all.bin"), llmc(t));
  const size_t cut[] = {0, 100, 137, 337};  // 100 + 37 + 200 tokens: a 37-token file inside sequences of 50
  std::vector<std::string> parts;
  for (int i = 0; i < 3; ++i) {
    parts.push_back(tmp("part" + std::to_string(i) + ".bin"));
    write(parts.back(), llmc(std::vector<uint32_t>(t.begin() + cut[i], t.begin() + cut[i + 1])));
  }
  TokenDataset one(tmp("all.bin")), many(parts, {});
  ASSERT_EQ(many.size(Split::Train), 337u);
  EXPECT_EQ(stream(many, Split::Train), t);
  std::vector<uint32_t> x(60);
  many.copy(Split::Train, 90, 60, x.data());  // spans files 0, 1 and 2
  EXPECT_EQ(x, std::vector<uint32_t>(t.begin() + 90, t.begin() + 150));
  EXPECT_THROW(many.copy(Split::Train, 300, 38, x.data()), std::out_of_range);
  const int G = 16, T = 50;
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<int32_t> a(G * T), at(G * T), b(G * T), bt(G * T);
    fill_batch(one, Split::Train, 11, step, 0, G, T, a.data(), at.data());
    fill_batch(many, Split::Train, 11, step, 0, G, T, b.data(), bt.data());
    EXPECT_EQ(a, b) << "step " << step;
    EXPECT_EQ(at, bt) << "step " << step;
  }
  // The dataset's CRC32: of the per-file CRC32s (u32 little-endian, in order).
  std::string crcs;
  for (const auto& p : parts) put(crcs, crc32_update(0, read(p).data(), read(p).size()), 4);
  EXPECT_EQ(many.crc32(), crc32_update(0, crcs.data(), crcs.size()));

  // shardtrain files: train = their train splits in order, val = their val splits in order ...
  const std::vector<uint32_t> u = seq(80, 258), v = seq(60, 258, 7);
  write(tmp("s1.tok"), st_file(u, 20));
  write(tmp("s2.tok"), st_file(v, 10));
  TokenDataset s({tmp("s1.tok"), tmp("s2.tok")}, {});
  std::vector<uint32_t> want_train(u.begin(), u.begin() + 60), want_val(u.begin() + 60, u.end());
  want_train.insert(want_train.end(), v.begin(), v.begin() + 50);
  want_val.insert(want_val.end(), v.begin() + 50, v.end());
  EXPECT_EQ(stream(s, Split::Train), want_train);
  EXPECT_EQ(stream(s, Split::Val), want_val);
  EXPECT_EQ(s.header().n_train, 110u);
  EXPECT_EQ(s.header().vocab_size, 258u);
  // ... unless validation files are given: then all their tokens (a shardtrain one's both splits).
  write(tmp("val.bin"), llmc(seq(40, 258, 3)));
  TokenDataset sv({tmp("s1.tok")}, {tmp("val.bin"), tmp("s2.tok")});
  std::vector<uint32_t> want_v = seq(40, 258, 3);
  want_v.insert(want_v.end(), v.begin(), v.end());
  EXPECT_EQ(stream(sv, Split::Val), want_v);
  EXPECT_EQ(stream(sv, Split::Train), std::vector<uint32_t>(u.begin(), u.begin() + 60));
  EXPECT_EQ(sv.files().size(), 3u);
  // llm.c-only training data has no validation stream of its own.
  EXPECT_EQ(many.size(Split::Val), 0u);
}

TEST(DataFormats, BadFilesNameTheFileAndTheOffset) {
  const std::vector<uint32_t> t = seq(100, 50257);
  auto check = [](const std::string& name, const std::string& bytes, DataFormat f, const std::string& want) {
    write(tmp(name), bytes);
    const std::string m = error_of([&] { TokenDataset d(tmp(name), f); });
    EXPECT_HAS(m, "token file '" + tmp(name) + "'");
    EXPECT_HAS(m, want);
  };
  std::string wrong = llmc(t);
  wrong[0] = 1;
  check("magic.bin", wrong, DataFormat::Llmc, "bad magic");
  check("magic_auto.bin", wrong, DataFormat::Auto, "bad magic");
  std::string ver = llmc(t);
  ver[4] = 2;
  check("version.bin", ver, DataFormat::Auto, "unknown llm.c version 2 at byte offset 4");
  check("count.bin", llmc(t, false, 101), DataFormat::Auto,
        "llm.c header token count 101 at byte offset 8 (header int32 [2]) needs 1226 bytes, beyond the file size 1224");
  check("short_count.bin", llmc(t, false, 99), DataFormat::Auto, "does not match the llm.c header token count 99");
  check("stnot.bin", llmc(t), DataFormat::Shardtrain, "bad magic (not a shardtrain token file)");
  // An id >= vocab_size: the offset of the first one (token 3: byte 64 + 2*3).
  std::vector<uint32_t> ids = seq(100, 258);
  ids[3] = 300;
  ids[50] = 400;
  check("id.tok", st_file(ids, 10), DataFormat::Auto, "token 300 >= vocab_size 258 at byte offset 70");
  // ... also past the first 4 MiB chunk of the scan.
  std::vector<uint32_t> big(3u << 20, 7);
  big[2500000] = 258;
  check("id_big.tok", st_file(big, 1000), DataFormat::Auto,
        "token 258 >= vocab_size 258 at byte offset " + std::to_string(64 + 2 * 2500000));
  check("empty.bin", "", DataFormat::Auto, "is empty");
  EXPECT_HAS(error_of([] { TokenDataset d(tmp("nonexistent.bin")); }), "cannot open token file '" + tmp("nonexistent.bin") + "'");
  // Mixed tokenizers are refused.
  write(tmp("b1.tok"), st_file(seq(100, 258), 10));
  write(tmp("b2.tok"), st_file(seq(100, 258), 10, 1000, 1, 2, "sentencepiece"));
  EXPECT_HAS(error_of([] { TokenDataset d({tmp("b1.tok")}, {tmp("b2.tok")}); }),
             "token files '" + tmp("b1.tok") + "' and '" + tmp("b2.tok") + "' disagree on the tokenizer");
  write(tmp("g.bin"), llmc(t));
  write(tmp("l.bin"), llmc(t, true));
  EXPECT_HAS(error_of([] { TokenDataset d({tmp("g.bin"), tmp("l.bin")}, {}); }), "hold ids of different tokenizers");
  // An llm.c file next to a shardtrain file: its ids are checked against that vocabulary.
  std::vector<uint32_t> w = seq(100, 258);
  w[42] = 5000;
  write(tmp("w.bin"), llmc(w));
  EXPECT_HAS(error_of([] { TokenDataset d({tmp("b1.tok"), tmp("w.bin")}, {}); }),
             "token file '" + tmp("w.bin") + "': token 5000 >= vocab_size 258 (of token file '" + tmp("b1.tok") +
                 "') at byte offset " + std::to_string(1024 + 2 * 42));
}

// Version 3 (chat data): examples with explicit starts and a role class per token, written byte by
// byte from docs/data-format.md ("Version 3") by tests/token_files.h, independently of the reader.
namespace {
// Examples of lengths `lens`; roles cycle 0, 1, 2 with the example index.
V3 examples(const std::vector<uint64_t>& lens, uint64_t e_val, uint32_t salt) {
  V3 v;
  v.e_val = e_val;
  for (size_t e = 0; e < lens.size(); ++e) {
    v.starts.push_back(v.toks.size());
    for (uint64_t i = 0; i < lens[e]; ++i) {
      v.toks.push_back(static_cast<uint32_t>((salt + 31 * e + 7 * i) % 600));
      v.roles.push_back(static_cast<uint8_t>((e + i) % 3));
    }
  }
  return v;
}
std::vector<int64_t> eot_ids(const std::vector<const V3*>& vs) {
  std::set<int64_t> ids;
  for (const V3* v : vs)
    for (size_t i = 0; i < v->toks.size(); ++i)
      if (v->roles[i] == 2) ids.insert(v->toks[i]);
  return {ids.begin(), ids.end()};
}
// A tokenizer file entry of the metadata's "files" object at `offset` in the area.
std::string file_entry(const std::string& name, const std::string& bytes, size_t offset) {
  return "\"" + name + "\": {\"offset\": " + std::to_string(offset) + ", \"bytes\": " + std::to_string(bytes.size()) +
         ", \"crc32\": " + std::to_string(crc32_update(0, bytes.data(), bytes.size())) + "}";
}
std::vector<uint8_t> role_stream(const TokenDataset& ds, Split s) {
  std::vector<uint8_t> r(ds.size(s));
  ds.copy_roles(s, 0, r.size(), r.data());
  return r;
}
}  // namespace

TEST(DataFormats, Version3ExamplesAndRoleClasses) {
  const V3 a = examples({5, 9, 1, 4, 7}, 2, 1), b = examples({3, 6}, 0, 2), c = examples({8, 2, 2}, 1, 3);
  write(tmp("a3.tok"), v3_file(a));
  write(tmp("b3.tok"), v3_file(b));
  write(tmp("c3.tok"), v3_file(c));
  TokenDataset one(tmp("a3.tok"));
  EXPECT_TRUE(one.has_examples());
  EXPECT_EQ(one.files()[0].format, "shardtrain v3");
  EXPECT_EQ(one.size(Split::Train), 15u);  // 5 + 9 + 1; the last two examples (4 + 7) are validation
  EXPECT_EQ(one.size(Split::Val), 11u);
  EXPECT_EQ(one.example_starts(Split::Train), (std::vector<uint64_t>{0, 5, 14}));
  EXPECT_EQ(one.example_starts(Split::Val), (std::vector<uint64_t>{0, 4}));
  EXPECT_EQ(role_stream(one, Split::Train), std::vector<uint8_t>(a.roles.begin(), a.roles.begin() + 15));
  EXPECT_EQ(role_stream(one, Split::Val), std::vector<uint8_t>(a.roles.begin() + 15, a.roles.end()));
  uint8_t mid[4];
  one.copy_roles(Split::Train, 12, 3, mid);  // across examples 1 and 2
  EXPECT_EQ(std::vector<uint8_t>(mid, mid + 3), std::vector<uint8_t>(a.roles.begin() + 12, a.roles.begin() + 15));
  EXPECT_THROW(one.copy_roles(Split::Val, 9, 3, mid), std::out_of_range);
  // end_of_turn_ids: the distinct ids of the end-of-turn tokens (what export adds to
  // generation_config.json's eos_token_id); a dataset's are every file's.
  const std::vector<int64_t> a_eot = eot_ids({&a});
  ASSERT_GE(a_eot.size(), 3u);
  EXPECT_EQ(one.tokenizer().end_of_turn_ids, a_eot);
  // Several files: the train stream is a's 3 training examples, b's 2 and c's 2; validation from
  // a's and c's validation splits; with --val-data, every example of the val files.
  TokenDataset many({tmp("a3.tok"), tmp("b3.tok"), tmp("c3.tok")}, {});
  EXPECT_EQ(many.example_starts(Split::Train), (std::vector<uint64_t>{0, 5, 14, 15, 18, 24, 32}));
  EXPECT_EQ(many.example_starts(Split::Val), (std::vector<uint64_t>{0, 4, 11}));
  std::vector<uint8_t> want(a.roles.begin(), a.roles.begin() + 15);
  want.insert(want.end(), b.roles.begin(), b.roles.end());
  want.insert(want.end(), c.roles.begin(), c.roles.begin() + 10);
  EXPECT_EQ(role_stream(many, Split::Train), want);
  TokenDataset val({tmp("b3.tok")}, {tmp("a3.tok"), tmp("c3.tok")});
  EXPECT_EQ(val.example_starts(Split::Val), (std::vector<uint64_t>{0, 5, 14, 15, 19, 26, 34, 36}));
  EXPECT_EQ(many.tokenizer().end_of_turn_ids, eot_ids({&a, &b, &c}));
  EXPECT_EQ(val.tokenizer().end_of_turn_ids, eot_ids({&a, &b, &c}));
  EXPECT_GT(eot_ids({&a, &b, &c}).size(), a_eot.size());
  // Versions 1 and 2 have no examples.
  write(tmp("v1e.tok"), st_file(seq(100, 258), 10));
  TokenDataset plain(tmp("v1e.tok"));
  EXPECT_FALSE(plain.has_examples());
  EXPECT_TRUE(plain.example_starts(Split::Train).empty());
  EXPECT_THROW(plain.copy_roles(Split::Train, 0, 1, mid), std::logic_error);

  // Crafted files: each refused naming the file and what is wrong.
  V3 bad_start = a;
  bad_start.starts[2] = bad_start.starts[1];  // not strictly increasing
  V3 bad_role = a;
  bad_role.roles[11] = 3;
  V3 split = a;  // the validation split begins inside an example
  struct Bad {
    const char* name;
    std::string file, want;
  } bad[] = {
      {"crc", v3_file(a, "", "", true), "starts at byte offset"},
      {"increasing", v3_file(bad_start), "starts[2] = 5: expected 0 first, then strictly increasing"},
      {"role", v3_file(bad_role), "role class 3 of token 11"},
      {"count", v3_file(a, "count", "6"), "count 6 is not train 3 + val 2"},
      {"many", v3_file(a, "count", "100", false), "count 100 is not train"},
      {"size", v3_file(a, "roles", "{\"offset\": 40, \"bytes\": 25, \"crc32\": 0}"), "roles holds 25 bytes, expected 26"},
      {"beyond", v3_file(a, "roles", "{\"offset\": 41, \"bytes\": 26, \"crc32\": 0}"), "roles (offset 41, 26 bytes) lies beyond"},
      {"missing", v3_file(a, "starts", "null"), "field missing or of the wrong type"},
      {"split", v3_file(split, "train", "2"), "is not train 2 + val 2"},
      {"eot_absent", v3_file(a, "end_of_turn_ids", "<absent>"), "end_of_turn_ids is missing"},
      {"eot_null", v3_file(a, "end_of_turn_ids", "null"), "end_of_turn_ids is null, not a list of token ids"},
      {"eot_vocab", v3_file(a, "end_of_turn_ids", "[600]"), "end_of_turn_ids holds 600, not a token id below vocab_size 600"},
      {"eot_negative", v3_file(a, "end_of_turn_ids", "[-1]"), "end_of_turn_ids holds -1, not a token id"},
      {"eot_float", v3_file(a, "end_of_turn_ids", "[2.0]"), "end_of_turn_ids holds 2.0, not a token id"},
      {"eot_order", v3_file(a, "end_of_turn_ids", "[" + std::to_string(a_eot[1]) + ", " + std::to_string(a_eot[0]) + "]"),
       "end_of_turn_ids is not ascending without repeats (" + std::to_string(a_eot[0]) + " after " +
           std::to_string(a_eot[1]) + ")"},
      {"eot_unused", v3_file(a, "end_of_turn_ids", eot_list(a).substr(0, eot_list(a).size() - 1) + ", 599]"),
       "end_of_turn_ids lists 599, which no end-of-turn token (role class 2) has"},
      {"eot_unlisted", v3_file(a, "end_of_turn_ids", "[" + eot_list(a).substr(eot_list(a).find(',') + 2)),
       "(id " + std::to_string(a_eot[0]) + ") is an end of turn (role class 2), but end_of_turn_ids does not list its id"},
  };
  for (const Bad& x : bad) {
    const std::string p = tmp(std::string("v3bad_") + x.name + ".tok");
    write(p, x.file);
    const std::string m = error_of([&] { TokenDataset d(p); });
    EXPECT_HAS(m, "token file '" + p + "'");
    EXPECT_HAS(m, x.want);
  }
  // The split must begin at an example: a's header says n_train 15; move it to 20.
  std::string shifted = v3_file(a);
  shifted[32] = 20;
  shifted[40] = 6;
  write(tmp("v3bad_shift.tok"), shifted);
  EXPECT_HAS(error_of([] { TokenDataset d(tmp("v3bad_shift.tok")); }), "the validation split does not begin at an example");
  // One kind per dataset: a version 2 file of the same tokenizer beside it is refused.
  write(tmp("v2same.tok"), st_file(seq(50, 600), 5, 600, kNoTokenId, 2, "hf-tokenizers",
                                   "{\"tokenizer\": {\"kind\": \"hf-tokenizers\", \"vocab_size\": 600, "
                                   "\"bos_id\": null, \"eos_id\": 2, \"files\": {}}}"));
  EXPECT_HAS(error_of([] { TokenDataset d({tmp("a3.tok"), tmp("v2same.tok")}, {}); }),
             "cannot be read as one dataset: format version 3 (chat data)");

  // The chat template and generation_config.json among the tokenizer files: kept byte for byte
  // when check_carried_file passes them, else the file is refused naming the entry.
  auto with_files = [&](const std::string& gen, const std::string& tpl) {
    std::string files = "{";  // appended piece by piece: GCC 12's -Wrestrict misfires on "{" + std::string
    files += file_entry("generation_config.json", gen, 0);
    files += ", ";
    files += file_entry("chat_template.jinja", tpl, gen.size());
    files += "}";
    return v3_file(a, "", "", false, files, gen + tpl);
  };
  const std::string gen = "{\"eos_token_id\": [2, 5], \"temperature\": 0.6}", tpl = "{{ messages }}\xc3\xa9\n";
  write(tmp("v3chat.tok"), with_files(gen, tpl));
  TokenDataset chat(tmp("v3chat.tok"));
  EXPECT_EQ(chat.tokenizer().files.at("generation_config.json"), gen);
  EXPECT_EQ(chat.tokenizer().files.at("chat_template.jinja"), tpl);
  EXPECT_EQ(chat.example_starts(Split::Train), one.example_starts(Split::Train));
  struct BadFile {
    const char* name;
    std::string gen, tpl, want;
  } bad_files[] = {
      {"gen_json", "{\"eos_token_id\": [2,", tpl, "tokenizer file 'generation_config.json': not valid JSON"},
      {"gen_vocab", "{\"eos_token_id\": [2, 600]}", tpl,
       "tokenizer file 'generation_config.json': key 'eos_token_id' = [2,600]: id 600 is outside the vocabulary (vocab_size 600)"},
      {"tpl_utf8", gen, "{{ x }}\xff", "tokenizer file 'chat_template.jinja': not UTF-8 text"},
  };
  for (const BadFile& x : bad_files) {
    const std::string p = tmp(std::string("v3bad_") + x.name + ".tok");
    write(p, with_files(x.gen, x.tpl));
    const std::string m = error_of([&] { TokenDataset d(p); });
    EXPECT_HAS(m, "token file '" + p + "': metadata (JSON at byte offset");
    EXPECT_HAS(m, x.want);
  }
}

// data.h check_carried_file: the chat template and generation_config.json, as they come from
// strangers (an HF directory, a token file, a checkpoint).
TEST(DataFormats, CarriedChatFilesChecked) {
  auto refusal = [](const std::string& name, const std::string& bytes, uint32_t vocab = 600) {
    return error_of([&] { check_carried_file(name, bytes, vocab, "'d/" + name + "'"); });
  };
  const char* ok[] = {
      "{}", "{\"eos_token_id\": 2}", "{\"eos_token_id\": [2, 7], \"bos_token_id\": null, \"pad_token_id\": 0}",
      "{\"do_sample\": true, \"temperature\": 0.6, \"top_p\": 0.9, \"transformers_version\": \"4.45.0\"}"};
  for (const char* g : ok) EXPECT_EQ(refusal("generation_config.json", g), "") << g;
  EXPECT_EQ(refusal("generation_config.json", "{\"eos_token_id\": 70000}", 0), "");  // vocab unknown: no bound
  EXPECT_EQ(refusal("tokenizer_config.json", "not checked here"), "");
  EXPECT_EQ(refusal("chat_template.jinja", "{{ bos_token }}\xe6\x97\xa5"), "");
  const std::pair<std::string, std::string> bad[] = {
      {"[1, 2]", "'d/generation_config.json': not a JSON object"},
      {"{\"eos_token_id\": 2", "'d/generation_config.json': not valid JSON"},
      {"{\"eos_token_id\": []}", "key 'eos_token_id' is an empty list"},
      {"{\"eos_token_id\": [2, \"x\"]}", "key 'eos_token_id' must be a token id (an integer >= 0) or a list of them, got [2,\"x\"]"},
      {"{\"eos_token_id\": 600}", "key 'eos_token_id' = 600: id 600 is outside the vocabulary (vocab_size 600)"},
      {"{\"pad_token_id\": -1}", "key 'pad_token_id' must be a token id (an integer >= 0), got -1"},
      {"{\"pad_token_id\": [0]}", "key 'pad_token_id' must be a token id (an integer >= 0), got [0]"},
      {"{\"bos_token_id\": 1.5}", "key 'bos_token_id' must be a token id"},
      {"{\"bos_token_id\": true}", "key 'bos_token_id' must be a token id"},
      {std::string(20, '[') + std::string(20, ']'), "JSON nested deeper than 16 levels (the limit for a generation_config.json)"},
      {std::string("{\"a\": \"") + std::string(2 << 20, 'x') + "\"}", "more than the 1048576 read from a generation_config.json"},
  };
  for (const auto& [g, want] : bad) EXPECT_HAS(refusal("generation_config.json", g), want);
  EXPECT_HAS(refusal("chat_template.jinja", "{{ x }}\xc3"), "'d/chat_template.jinja': not UTF-8 text");
  EXPECT_HAS(refusal("chat_template.jinja", "\xed\xa0\x80"), "not UTF-8 text");  // a UTF-16 surrogate
  EXPECT_HAS(refusal("chat_template.jinja", std::string(kMaxChatTemplateBytes + 1, 'x')),
             "'d/chat_template.jinja': 4194305 bytes, more than the 4194304 read from a chat template");
  EXPECT_EQ(refusal("chat_template.jinja", std::string(kMaxChatTemplateBytes, 'x')), "");
}

TEST(DataFormats, GlobPatternsExpandSorted) {
  const std::string dir = tmp("globdir");
  std::filesystem::create_directories(dir);
  for (const char* n : {"shard_002.bin", "shard_000.bin", "shard_001.bin", "other.txt"}) write(dir + "/" + n, "x");
  const auto v = expand_data_paths({dir + "/shard_*.bin", dir + "/other.txt", dir + "/plain_missing.bin"}, "data");
  ASSERT_EQ(v.size(), 5u);
  EXPECT_EQ(v[0], dir + "/shard_000.bin");
  EXPECT_EQ(v[1], dir + "/shard_001.bin");
  EXPECT_EQ(v[2], dir + "/shard_002.bin");
  EXPECT_EQ(v[3], dir + "/other.txt");
  EXPECT_EQ(v[4], dir + "/plain_missing.bin");  // reported when opened
  EXPECT_HAS(error_of([&] { expand_data_paths({dir + "/none_*.bin"}, "val-data"); }),
             "option '--val-data': pattern '" + dir + "/none_*.bin' matches no file");
  EXPECT_EQ(parse_data_format("nanogpt"), DataFormat::NanoGPT);
  EXPECT_THROW(parse_data_format("npy"), std::invalid_argument);
}
