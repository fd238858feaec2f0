// safetensors reading and writing, and fp32 <-> bf16 / fp16 conversion.
// Format: https://github.com/huggingface/safetensors#format : 8-byte little-endian u64 N, then N
// bytes of UTF-8 JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}}, then the data buffer; offsets are relative to the buffer, tensors are
// contiguous row-major little-endian and together cover the buffer exactly.
#pragma once

#include "shardtrain/runtime/files.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain {

enum class DType { F32, BF16, F16 };
const char* dtype_name(DType t);     // "F32", "BF16", "F16" (safetensors names)
size_t dtype_size(DType t);          // bytes per element
DType parse_export_dtype(const std::string& s);  // "fp32"|"bf16"|"fp16"; throws std::invalid_argument

// fp16 round-to-nearest-even conversions (NaN stays NaN; overflow gives +-inf). bf16: bf16.h.
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t h);

struct StTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<float> values;  // fp32 values (converted when written as bf16/fp16)
};

// Writes `tensors` (in the given order) to `path` as dtype `dt`, with __metadata__ {"format": "pt"}.
// The header is padded with spaces to a multiple of 8 bytes. Throws std::runtime_error naming path.
void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors, DType dt);
// Bytes the file of `tensors` would have as dtype dt, header excluded.
uint64_t safetensors_data_bytes(const std::vector<StTensor>& tensors, DType dt);

// Header of one safetensors file.
struct StEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data buffer
};
struct StFile {
  std::string path;
  std::shared_ptr<const InputFile> file;  // the descriptor the header came from; tensors are read from it
  uint64_t data_start = 0;  // 8 + N
  std::vector<StEntry> entries;
};
// Largest header length (bytes, the u64 after which the JSON follows) that is read:
// 100,000,000, the format's own limit, MAX_HEADER_SIZE in the safetensors crate
// (huggingface/safetensors, safetensors/src/tensor.rs, `const MAX_HEADER_SIZE: usize =
// 100_000_000`, refused there as HeaderTooLarge), so a file that shardtrain reads is one that the
// Hugging Face libraries read too; it also bounds the memory a damaged length can make us allocate.
inline constexpr uint64_t kSafetensorsMaxHeader = 100'000'000;

// Parses and validates the header: JSON, dtypes (F32/BF16/F16), shapes (JSON integers in
// [0, 2^63); a fraction, a negative or larger number is refused naming the dimension), offsets
// inside the file, sizes matching dtype x shape, no overlaps, no gaps, no name twice, no field of an
// entry twice, at most 64 dimensions, no "-0";
// "__metadata__", when present, an object of strings (or null), as the safetensors crate requires.
// The header is streamed (json_input.h scan_json, limits json_limits::kSafetensorsHeader) into the
// table alone: memory proportional to the number of tensors (about 100 bytes each beside the
// header's own bytes), never a DOM, and the checks take N log N time for N tensors. A header of
// more than `max_tensors` tensors is refused at the first one past it (a reader that knows the
// model passes how many it can hold). Throws std::runtime_error naming the file and the tensor; a
// header length longer than the rest of the file: "... exceeds the file (M bytes after the 8-byte
// length)"; one within the file but above kSafetensorsMaxHeader: "... exceeds the safetensors
// format's limit of 100000000 bytes"; a JSON limit: "... header: JSON nested deeper than ...".
// The StFile keeps `file` open: every tensor is read through the descriptor the header came
// from, so a name swapped meanwhile changes nothing that is read.
StFile read_safetensors_header(const InputFile& file, uint64_t max_tensors = UINT64_MAX);
// The same for a file named by the user (InputFile::open: a regular file).
StFile read_safetensors_header(const std::string& path, uint64_t max_tensors = UINT64_MAX);
// Reads one tensor as fp32, from f.file.
std::vector<float> read_safetensors_tensor(const StFile& f, const StEntry& e);

}  // namespace shardtrain
