// The bounded JSON reader (json_input.h) and the streamed safetensors header (issue 53): the DOM
// equals nlohmann::json::parse's (the independent reference) for valid text, every limit holds at
// its exact boundary, and the refusals name the limit; the safetensors table against hand-written
// headers.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

#include "shardtrain/runtime/json_input.h"
#include "shardtrain/io/safetensors.h"

using namespace shardtrain;
using nlohmann::json;

namespace {
constexpr JsonLimits kSmall{"a test file", 200, 3, 10, 20};

std::string nested(size_t depth, const std::string& inner = "") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

// The message of the JsonError that read_json(text, lim) throws ("" if none).
std::string refusal(const std::string& text, const JsonLimits& lim) {
  try {
    (void)read_json(text, lim);
  } catch (const JsonError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(JsonInput, DomEqualsNlohmannsParse) {
  const char* docs[] = {
      R"({"a": 1, "b": [true, false, null], "c": {"d": -2, "e": 1.5e-3, "f": "x\u00e9\n"}})",
      R"([18446744073709551615, -9223372036854775808, 1e300, 0, -0.0, "", [], {}])",
      R"({"dup": 1, "dup": [2], "k": {"dup": "a", "dup": "b"}})",  // the last value of a key, as parse keeps
      R"("a top-level string")", "42", "null", R"([[[[]]], {"": {"": []}}])",
      R"({"vocab": {"<s>": 0, "</s>": 1, "\ud83d\ude00": 2}, "merges": [["a", "b"], ["ab", "c"]]})"};
  for (const char* d : docs) EXPECT_EQ(read_json(d, json_limits::kConfig), json::parse(d)) << d;
}

TEST(JsonInput, DepthLimitAtItsBoundary) {
  EXPECT_EQ(read_json(nested(3), kSmall), json::parse(nested(3)));
  EXPECT_EQ(refusal(nested(4), kSmall), "JSON nested deeper than 3 levels (the limit for a test file)");
  EXPECT_EQ(refusal(R"({"a": {"b": {"c": {}}}})", kSmall), "JSON nested deeper than 3 levels (the limit for a test file)");
  // 10^5 levels: refused at level 65 by the iterative parser (no recursion, no stack overflow).
  const std::string deep = "{\"a\": " + nested(100'000) + "}";
  EXPECT_EQ(refusal(deep, json_limits::kConfig), "JSON nested deeper than 64 levels (the limit for a config.json)");
}

TEST(JsonInput, StringLimitAtItsBoundaryForValuesAndKeys) {
  EXPECT_EQ(read_json(R"(["0123456789"])", kSmall), json::array({"0123456789"}));
  EXPECT_EQ(refusal(R"(["0123456789a"])", kSmall),
            "a JSON string of 11 bytes, more than the 10 allowed in a test file");
  EXPECT_EQ(refusal(R"({"0123456789a": 1})", kSmall),
            "a JSON string of 11 bytes, more than the 10 allowed in a test file");
  // Bytes after unescaping: "\u00e9" is 2 bytes of UTF-8.
  EXPECT_EQ(read_json(R"(["\u00e9\u00e9\u00e9\u00e9\u00e9"])", kSmall).at(0).get<std::string>().size(), 10u);
}

TEST(JsonInput, ValueAndByteLimitsAtTheirBoundaries) {
  std::string a = "[";  // the array itself and 19 numbers: 20 values
  for (int i = 0; i < 19; ++i) {
    if (i > 0) a += ",";
    a += std::to_string(i);
  }
  EXPECT_EQ(read_json(a + "]", kSmall).size(), 19u);
  EXPECT_EQ(refusal(a + ",19]", kSmall), "more than 20 JSON values (the limit for a test file)");
  EXPECT_EQ(refusal(R"({"a":{"b":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18]}})", kSmall),
            "more than 20 JSON values (the limit for a test file)");
  const std::string padded = "[1]" + std::string(197, ' ');  // 200 bytes
  EXPECT_EQ(read_json(padded, kSmall), json::array({1}));
  EXPECT_EQ(refusal(padded + " ", kSmall), "201 bytes, more than the 200 read from a test file");
}

TEST(JsonInput, NulBadUtf8AndTrailingTextAreRefused) {
  const std::string nul = std::string("{\"a\": 1}") + '\0' + "{{{";
  EXPECT_EQ(refusal(nul, kSmall),
            "not valid JSON: a NUL byte at byte offset 8 of 12 (JSON text holds none; a parser that stopped there "
            "would ignore the rest)");
  EXPECT_NE(refusal("[\"\xff\"]", kSmall).find("not valid JSON: [json.exception.parse_error.101]"), std::string::npos);
  EXPECT_NE(refusal("[1] [2]", kSmall).find("not valid JSON: [json.exception.parse_error.101]"), std::string::npos);
  EXPECT_NE(refusal("", kSmall).find("not valid JSON"), std::string::npos);
  EXPECT_EQ(refusal("\xEF\xBB\xBF[1]", kSmall).rfind("not valid JSON: it starts with a UTF-8 byte order mark", 0), 0u);
  // nlohmann quotes the token it stopped at: the message is cut, whatever the token's length.
  const std::string bad = "{\"x\": 1" + std::string(1'000'000, '0') + "x}";
  const std::string cut = refusal(bad, json_limits::kConfig);
  EXPECT_EQ(cut.rfind("not valid JSON: [json.exception.", 0), 0u) << cut.substr(0, 200);
  EXPECT_LT(cut.size(), 400u);
  EXPECT_NE(cut.find("-byte message cut)"), std::string::npos);
  EXPECT_TRUE(read_json_or_discarded("[1", kSmall).is_discarded());
  EXPECT_EQ(read_json_or_discarded("[1]", kSmall), json::array({1}));
}

TEST(JsonInput, ScanJsonPassesEventsAndAHandlersExceptionAsItIs) {
  struct Recorder {
    std::string log;
    void null() { log += "n"; }
    void boolean(bool v) { log += v ? "T" : "F"; }
    void number_integer(int64_t v) { log += "i" + std::to_string(v); }
    void number_unsigned(uint64_t v) { log += "u" + std::to_string(v); }
    void number_float(double, const std::string& s) { log += "f" + s; }
    void string(std::string& s) {
      if (s == "stop") throw std::out_of_range("handler says stop");
      log += "s" + s;
    }
    void key(std::string& k) { log += "k" + k; }
    void start_object() { log += "{"; }
    void end_object() { log += "}"; }
    void start_array() { log += "["; }
    void end_array() { log += "]"; }
  } r;
  scan_json(R"({"a": [1, -2, 2.50, "x", null, true]})", kSmall, r);
  EXPECT_EQ(r.log, "{ka[u1i-2f2.50sxnT]}");
  Recorder r2;
  EXPECT_THROW(scan_json(R"(["stop"])", kSmall, r2), std::out_of_range);
}

namespace {
// A safetensors file of header text `h` (padded to 8 bytes) and `data` bytes of data buffer.
std::string st_file(const std::string& name, std::string h, size_t data) {
  const std::string p = ::testing::TempDir() + "shardtrain_json_" + name + ".safetensors";
  while (h.size() % 8) h.push_back(' ');
  std::ofstream o(p, std::ios::binary | std::ios::trunc);
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) o.put(static_cast<char>(n >> (8 * i)));
  o << h << std::string(data, '\0');
  return p;
}
std::string st_refusal(const std::string& name, const std::string& h, size_t data, uint64_t max_tensors = UINT64_MAX) {
  const std::string p = st_file(name, h, data);
  try {
    (void)read_safetensors_header(p, max_tensors);
  } catch (const std::runtime_error& e) {
    std::remove(p.c_str());
    const std::string w = e.what(), prefix = "safetensors file '" + p + "': ";
    return w.rfind(prefix, 0) == 0 ? w.substr(prefix.size()) : "(no file named) " + w;
  }
  std::remove(p.c_str());
  return "";
}
}  // namespace

TEST(SafetensorsHeader, TableOfAValidHeaderInFileOrder) {
  // Two tensors, an empty one sharing an offset, metadata, and a key the format ignores (with a
  // nested value, skipped as serde skips it in the safetensors crate).
  const std::string h = R"({"__metadata__": {"format": "pt", "note": "x"},
    "b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32], "extra": {"k": [[1], {"z": null}]}, "s": "x"},
    "a": {"shape": [4], "dtype": "BF16", "data_offsets": [0, 8]},
    "e": {"dtype": "F16", "shape": [0, 5], "data_offsets": [8, 8]}})";
  const std::string p = st_file("valid", h, 32);
  const StFile f = read_safetensors_header(p);
  ASSERT_EQ(f.entries.size(), 3u);
  EXPECT_EQ(f.entries[0].name, "b");
  EXPECT_EQ(f.entries[0].dtype, DType::F32);
  EXPECT_EQ(f.entries[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.entries[0].begin, 8u);
  EXPECT_EQ(f.entries[0].end, 32u);
  EXPECT_EQ(f.entries[1].name, "a");
  EXPECT_EQ(f.entries[1].dtype, DType::BF16);
  EXPECT_EQ(f.entries[2].shape, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(f.data_start, 8 + ((h.size() + 7) / 8) * 8);
  std::remove(p.c_str());
  EXPECT_EQ(st_refusal("meta_null", R"({"__metadata__": null, "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}})", 4), "");
}

TEST(SafetensorsHeader, MalformedTablesAreRefusedNamingTheTensor) {
  const std::string ok = R"("dtype": "F32", "shape": [1], "data_offsets": [0, 4])";
  EXPECT_EQ(st_refusal("top", "[1]", 0), "header is not a JSON object");
  EXPECT_EQ(st_refusal("meta_nested", R"({"__metadata__": {"k": {"deep": 1}}, "a": {)" + ok + "}}", 4),
            "'__metadata__' entry 'k' is an object; its values must be strings");
  EXPECT_EQ(st_refusal("meta_int", R"({"__metadata__": {"k": 5}, "a": {)" + ok + "}}", 4),
            "'__metadata__' entry 'k' is 5; its values must be strings");
  EXPECT_EQ(st_refusal("entry_array", R"({"a": [1]})", 0), "tensor 'a': malformed entry (an array, not an object)");
  EXPECT_EQ(st_refusal("no_dtype", R"({"a": {"shape": [1], "data_offsets": [0, 4]}})", 4),
            "tensor 'a': malformed entry (key 'dtype' not found)");
  EXPECT_EQ(st_refusal("dtype_int", R"({"a": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}})", 4),
            "tensor 'a': dtype 7 is not a string");
  EXPECT_EQ(st_refusal("shape_str", R"({"a": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})", 4),
            "tensor 'a': shape must be a list of integers, got \"1\"");
  EXPECT_EQ(st_refusal("shape_nested", R"({"a": {"dtype": "F32", "shape": [[1]], "data_offsets": [0, 4]}})", 4),
            "tensor 'a': dimension 0 of its shape (an array) is not an integer");
  EXPECT_EQ(st_refusal("shape_frac", R"({"a": {"dtype": "F32", "shape": [1, 2.5], "data_offsets": [0, 4]}})", 4),
            "tensor 'a': dimension 1 of its shape (2.5) is not an integer (a JSON integer, without fraction or exponent)");
  EXPECT_EQ(st_refusal("offsets_3", R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 4]}})", 4),
            "tensor 'a': data_offsets must have 2 entries");
  EXPECT_EQ(st_refusal("offsets_neg", R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-1, 4]}})", 4),
            "tensor 'a': data_offsets[0] (-1) is negative");
  EXPECT_EQ(st_refusal("dup", R"({"a": {)" + ok + R"(}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8),
            "tensor 'a' appears twice in the header");
  EXPECT_EQ(st_refusal("overlap", R"({"a": {)" + ok + R"(}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})", 6),
            "tensor 'b' overlaps the tensor before it (data_offsets 2)");
  // As serde in the safetensors crate: a field twice, __metadata__ twice, and -0 are refused.
  EXPECT_EQ(st_refusal("dup_shape", R"({"a": {"dtype": "F32", "shape": [3], "shape": [1], "data_offsets": [0, 4]}})", 4),
            "tensor 'a': key 'shape' appears twice in its entry");
  EXPECT_EQ(st_refusal("dup_meta", R"({"__metadata__": {}, "a": {)" + ok + R"(}, "__metadata__": null})", 4),
            "'__metadata__' appears twice in the header");
  EXPECT_EQ(st_refusal("neg0", R"({"a": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}})", 0),
            "tensor 'a': dimension 0 of its shape (-0) is negative");
  std::string dims = "[1";
  for (int i = 0; i < 64; ++i) dims += ", 1";
  EXPECT_EQ(st_refusal("dims65", R"({"a": {"dtype": "F32", "shape": )" + dims + R"(], "data_offsets": [0, 4]}})", 4),
            "tensor 'a': its shape has more than 64 dimensions");
  EXPECT_EQ(st_refusal("gap", R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8),
            "gap in the data buffer before tensor 'a'");
  // Deep nesting is refused at the first level past the entry's structure, or by the depth limit
  // inside a skipped key.
  EXPECT_EQ(st_refusal("deep_top", "{\"a\": " + nested(50'000) + "}", 0),
            "tensor 'a': malformed entry (an array, not an object)");
  EXPECT_EQ(st_refusal("deep_skip", R"({"a": {"x": )" + nested(20) + ", " + ok + "}}", 4),
            "header: JSON nested deeper than 16 levels (the limit for a safetensors header)");
}

TEST(SafetensorsHeader, MoreTensorsThanExpectedAreRefusedAtTheFirstOnePast) {
  std::string h = "{";
  for (int i = 0; i < 5; ++i) {
    if (i > 0) h += ", ";
    h += "\"t" + std::to_string(i) + R"(": {"dtype": "F32", "shape": [1], "data_offsets": [)" + std::to_string(4 * i) +
         ", " + std::to_string(4 * i + 4) + "]}";
  }
  h += "}";
  EXPECT_EQ(st_refusal("count5", h, 20, 5), "");
  EXPECT_EQ(st_refusal("count4", h, 20, 4), "holds more than 4 tensors, the most expected here (tensor 't4' is one too many)");
}
