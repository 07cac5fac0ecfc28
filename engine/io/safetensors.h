// The safetensors format (huggingface/safetensors): u64 little-endian header length N, N bytes of
// JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"key": "string"}}, then the tensors' bytes, offsets relative to the end of the
// header. Row-major, little-endian. What model.weights imports and `edgetrain export` writes.
//
// Reading trusts nothing in the file: the header length, every tensor's offsets and its byte size
// (shape x dtype) are checked against the file's real size before anything is allocated or read,
// and every failure is a UserError naming the file and, where there is one, the tensor.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace et {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;            // "F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Opens and validates the header; throws UserError naming `path`.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in file order
  const SafetensorsEntry* find(const std::string& name) const;               // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor's values converted to float32 (F32, F16, BF16, F64; other dtypes are an error naming
  // it) into `out`, which holds numel() floats.
  void read_f32(const SafetensorsEntry& e, float* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

struct SafetensorsOut {
  std::string name;
  std::vector<int64_t> shape;
  const float* data;  // numel floats, written as F32
};

// Writes `tensors` (data in the given order) to `path` atomically: a temporary file beside it,
// fsync'ed and renamed, so a failure (full disk, unwritable folder) leaves whatever was there.
void write_safetensors(const std::string& path, const std::vector<SafetensorsOut>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace et
