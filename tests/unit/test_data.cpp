// Token file format and loader: round trip against the documented byte layout, deterministic
// batches that do not depend on the world size, clear errors for bad files.
#include <zlib.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "shardtrain/data/data.h"
#include "shardtrain/runtime/files.h"

using namespace shardtrain;

namespace {
std::string tmp(const std::string& name) { return ::testing::TempDir() + "shardtrain_" + name; }
void write(const std::string& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }
std::vector<uint32_t> split(const TokenDataset& ds, Split s) {  // a whole stream, through copy()
  std::vector<uint32_t> v(ds.size(s));
  ds.copy(s, 0, v.size(), v.data());
  return v;
}
}  // namespace

TEST(Data, TokenizerRoundTripsBytes) {
  std::string s = "Hello, w\xc3\xb6rld!\n\t\x01\xff";
  auto ids = ByteTokenizer::encode(s);
  ASSERT_EQ(ids.size(), s.size());
  EXPECT_EQ(ids[0], 'H');
  EXPECT_EQ(ids.back(), 255);
  ids.insert(ids.begin(), ByteTokenizer::kBos);
  ids.push_back(ByteTokenizer::kEos);
  EXPECT_EQ(ByteTokenizer::decode(ids), s);
}

TEST(Data, PrepareWritesDocumentedLayout) {
  write(tmp("a.txt"), "abc");
  write(tmp("b.txt"), "defghij");
  auto h = prepare_token_file({tmp("a.txt"), tmp("b.txt")}, tmp("ab.tok"), 0.25);
  // Tokens: BOS a b c EOS BOS d e f g h i j EOS = 14; val = floor(14 * 0.25) = 3.
  EXPECT_EQ(h.n_train + h.n_val, 14u);
  EXPECT_EQ(h.n_val, 3u);
  std::ifstream f(tmp("ab.tok"), std::ios::binary);
  std::string b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(b.substr(0, 8), std::string("STTOKv1\0", 8));
  auto u16 = [&](size_t off) { return static_cast<unsigned>(static_cast<unsigned char>(b[off])) |
                                      (static_cast<unsigned>(static_cast<unsigned char>(b[off + 1])) << 8); };
  auto u32 = [&](size_t off) { return u16(off) | (u16(off + 2) << 16); };
  // Format version 2: the tokens, then J bytes of metadata JSON (byte-level: no tokenizer files).
  EXPECT_EQ(u32(8), 2u);
  const size_t J = u32(28);
  ASSERT_EQ(b.size(), 64u + 2 * 14 + J);
  const auto meta = nlohmann::json::parse(b.substr(64 + 2 * 14, J));
  EXPECT_EQ(meta.at("tokenizer").at("kind"), "byte-level");
  EXPECT_EQ(meta.at("tokenizer").at("files").size(), 0u);
  EXPECT_EQ(meta.at("documents"), 2);
  EXPECT_EQ(u16(12), 258u);   // vocab_size (low half of the u32)
  EXPECT_EQ(u16(64), 256u);   // BOS
  EXPECT_EQ(u16(66), unsigned('a'));
  EXPECT_EQ(u16(64 + 2 * 4), 257u);  // EOS after "abc"
  EXPECT_EQ(b.substr(48, 10), "byte-level");
  TokenDataset ds(tmp("ab.tok"));
  EXPECT_EQ(split(ds, Split::Train).size(), 11u);
  EXPECT_EQ(split(ds, Split::Val).size(), 3u);
  EXPECT_EQ(split(ds, Split::Val).back(), 257);
}

TEST(Data, BatchesAreDeterministicAndIndependentOfWorldSize) {
  std::string text;
  for (int i = 0; i < 2000; ++i) text += static_cast<char>('a' + (i * 7) % 26);
  write(tmp("c.txt"), text);
  prepare_token_file({tmp("c.txt")}, tmp("c.tok"), 0.1);
  TokenDataset ds(tmp("c.tok"));
  const int G = 12, T = 16;
  std::vector<int32_t> all(G * T), allt(G * T);
  fill_batch(ds, Split::Train, 7, 3, 0, G, T, all.data(), allt.data());
  for (int W : {2, 3, 4}) {
    for (int r = 0; r < W; ++r) {
      int per = G / W;
      std::vector<int32_t> tk(per * T), tg(per * T);
      fill_batch(ds, Split::Train, 7, 3, r * per, per, T, tk.data(), tg.data());
      for (int i = 0; i < per * T; ++i) ASSERT_EQ(tk[i], all[r * per * T + i]) << "W=" << W << " r=" << r;
    }
  }
  // Targets are the next token; different steps and seeds give different batches.
  for (int s = 0; s < G; ++s)
    for (int t = 0; t + 1 < T; ++t) ASSERT_EQ(allt[s * T + t], all[s * T + t + 1]);
  std::vector<int32_t> other(G * T), ot(G * T);
  fill_batch(ds, Split::Train, 7, 4, 0, G, T, other.data(), ot.data());
  EXPECT_NE(other, all);
  std::set<int32_t> starts;
  for (int s = 0; s < G; ++s) starts.insert(all[s * T] * 1000 + all[s * T + 1]);
  EXPECT_GT(starts.size(), 1u);
}

TEST(Data, BadFilesGiveClearErrors) {
  auto expect_msg = [](const std::string& path, const std::string& want) {
    try {
      TokenDataset ds(path);
      FAIL() << "no error for " << path;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  };
  expect_msg(tmp("missing.tok"), "cannot open token file");
  write(tmp("short.tok"), "STTOKv1");
  expect_msg(tmp("short.tok"), "shorter than its 64-byte header");
  write(tmp("d.txt"), "hello world");
  prepare_token_file({tmp("d.txt")}, tmp("d.tok"), 0.5);
  std::ifstream f(tmp("d.tok"), std::ios::binary);
  std::string b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::string v = b;
  v[8] = 9;  // version 9
  write(tmp("v.tok"), v);
  expect_msg(tmp("v.tok"), "unknown format version 9");
  write(tmp("trunc.tok"), b.substr(0, b.size() - 2));
  expect_msg(tmp("trunc.tok"), "does not match header");
  std::string big = b;
  big[64] = '\xff';
  big[65] = '\x7f';  // token 32767 >= vocab 258
  write(tmp("big.tok"), big);
  expect_msg(tmp("big.tok"), ">= vocab_size 258");
  EXPECT_THROW(prepare_token_file({tmp("d.txt")}, tmp("x.tok"), 1.5), std::runtime_error);
  EXPECT_THROW(prepare_token_file({tmp("nope.txt")}, tmp("x.tok"), 0.1), std::runtime_error);
  // A split shorter than one sequence is refused by the loader.
  TokenDataset ds(tmp("d.tok"));
  std::vector<int32_t> a(64), t(64);
  EXPECT_THROW(fill_batch(ds, Split::Val, 1, 0, 0, 1, 64, a.data(), t.data()), std::runtime_error);
}

TEST(Data, HeaderAloneReadsAndChecksLikeTheDataset) {
  write(tmp("h.txt"), "hello header");
  auto h = prepare_token_file({tmp("h.txt")}, tmp("h.tok"), 0.25);
  const TokenFileHeader r = read_token_file_header(tmp("h.tok"));
  TokenDataset ds(tmp("h.tok"));
  const TokenFileHeader& d = ds.header();
  for (const TokenFileHeader* x : {&r, &d}) {
    EXPECT_EQ(x->vocab_size, h.vocab_size);
    EXPECT_EQ(x->bos_id, 256u);
    EXPECT_EQ(x->eos_id, 257u);
    EXPECT_EQ(x->n_train, h.n_train);
    EXPECT_EQ(x->n_val, h.n_val);
    EXPECT_EQ(x->tokenizer, "byte-level");
  }
  std::ifstream f(tmp("h.tok"), std::ios::binary);
  std::string b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  write(tmp("htrunc.tok"), b.substr(0, b.size() - 2));
  write(tmp("hshort.tok"), b.substr(0, 40));
  for (auto [file, want] : {std::pair{tmp("htrunc.tok"), "does not match header"},
                            std::pair{tmp("hshort.tok"), "shorter than its 64-byte header"},
                            std::pair{tmp("hmissing.tok"), "cannot open token file"}}) {
    try {
      read_token_file_header(file);
      ADD_FAILURE() << "no error for " << file;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
  }
}

// crc32_update against the CRC-32 check value of the standard (ISO-HDLC, zlib's and Python's):
// CRC32("123456789") = 0xCBF43926; and a buffer taken in two pieces gives the same value.
TEST(Crc32, CheckValueAndPieces) {
  const std::string s = "123456789";
  EXPECT_EQ(shardtrain::crc32_update(0, s.data(), s.size()), 0xCBF43926u);
  EXPECT_EQ(shardtrain::crc32_update(shardtrain::crc32_update(0, s.data(), 4), s.data() + 4, 5), 0xCBF43926u);
  EXPECT_EQ(shardtrain::crc32_update(0, s.data(), 0), 0u);
}

// crc32_update (libdeflate) against zlib's crc32, the reference implementation of the same CRC:
// random buffers of every length 0..300 and a few large ones, at every start offset modulo 16
// (the vector code's alignment head and tail), and continued from a non-zero CRC.
TEST(Crc32, EqualsZlibAtAnyLengthAndAlignment) {
  std::vector<unsigned char> buf((size_t{1} << 22) + 64);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : buf) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  auto zlib = [](uint32_t c, const unsigned char* p, size_t n) {
    return static_cast<uint32_t>(::crc32(c, p, static_cast<uInt>(n)));
  };
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {size_t{4095}, size_t{65536}, size_t{1000003}, size_t{1} << 22}) lengths.push_back(n);
  for (size_t off = 0; off < 16; ++off)
    for (size_t n : lengths) {
      ASSERT_EQ(shardtrain::crc32_update(0, buf.data() + off, n), zlib(0, buf.data() + off, n)) << off << " " << n;
      ASSERT_EQ(shardtrain::crc32_update(0xDEADBEEFu, buf.data() + off, n), zlib(0xDEADBEEFu, buf.data() + off, n));
    }
}

// 4-byte tokens (bytes per token 4): ids above 65535 read back whole, batches carry them; other
// token sizes are refused naming the file and the field.
TEST(Data, U32TokensAboveU16Range) {
  const uint32_t V = 128256;
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 400; ++i) toks.push_back((i * 2654435761u) % V);
  toks[0] = 128000;
  toks[1] = 65535;
  toks[2] = 65536;
  toks[3] = V - 1;
  auto file = [&](uint32_t token_bytes, const std::vector<uint32_t>& t) {
    std::string b("STTOKv1\0", 8);
    auto put = [&](uint64_t v, int n) { for (int i = 0; i < n; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff)); };
    for (uint32_t v : {1u, V, 128000u, 128001u, token_bytes, 0u}) put(v, 4);
    put(300, 8);
    put(t.size() - 300, 8);
    std::string name = "test-u32";
    name.resize(16, '\0');
    b += name;
    for (uint32_t v : t) put(v, token_bytes);
    return b;
  };
  write(tmp("u32.tok"), file(4, toks));
  const TokenFileHeader h = read_token_file_header(tmp("u32.tok"));
  EXPECT_EQ(h.token_bytes, 4u);
  TokenDataset ds(tmp("u32.tok"));
  const std::vector<uint32_t> tr = split(ds, Split::Train), va = split(ds, Split::Val);
  ASSERT_EQ(tr.size(), 300u);
  ASSERT_EQ(va.size(), 100u);
  for (size_t i = 0; i < 300; ++i) ASSERT_EQ(tr[i], toks[i]) << i;
  for (size_t i = 0; i < 100; ++i) ASSERT_EQ(va[i], toks[300 + i]) << i;
  size_t high = 0;
  for (uint32_t t : tr) high += t > 65535;
  EXPECT_GT(high, 100u);
  // Batches hold the ids as they are (int32), none cut to 16 bits.
  std::vector<int32_t> a(4 * 16), tg(4 * 16);
  fill_batch(ds, Split::Train, 3, 0, 0, 4, 16, a.data(), tg.data());
  std::set<int32_t> in_file(toks.begin(), toks.end());
  int above = 0;
  for (int32_t x : a) {
    EXPECT_TRUE(in_file.count(x)) << x;
    above += x > 65535;
  }
  EXPECT_GT(above, 0);
  // A token >= vocab_size is refused as for u16 files.
  std::vector<uint32_t> bad = toks;
  bad[5] = V;
  write(tmp("u32bad.tok"), file(4, bad));
  try {
    TokenDataset x(tmp("u32bad.tok"));
    ADD_FAILURE() << "token 128256 accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("token 128256 >= vocab_size 128256"), std::string::npos) << e.what();
  }
  // Bytes per token 3 (or 8): refused naming the file and the field.
  for (uint32_t tb : {3u, 8u, 1u}) {
    std::string b = file(4, toks);
    b[24] = static_cast<char>(tb);
    write(tmp("u32tb.tok"), b);
    for (int header_only = 0; header_only < 2; ++header_only) {
      try {
        if (header_only) read_token_file_header(tmp("u32tb.tok"));
        else TokenDataset x(tmp("u32tb.tok"));
        ADD_FAILURE() << "token size " << tb << " accepted";
      } catch (const std::runtime_error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("token file '" + tmp("u32tb.tok") + "'"), std::string::npos) << m;
        EXPECT_NE(m.find("field 'bytes per token' (offset 24) is " + std::to_string(tb) + "; supported: 2 (u16) or 4 (u32)"),
                  std::string::npos)
            << m;
      }
    }
  }
  // A u32 file whose size does not match its header (one token short).
  write(tmp("u32short.tok"), file(4, toks).substr(0, 64 + 4 * 400 - 4));
  EXPECT_THROW(TokenDataset(tmp("u32short.tok")), std::runtime_error);
}
