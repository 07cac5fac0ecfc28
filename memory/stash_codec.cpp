// The host's stash codec: the SIMD codecs of memory/ behind the StashCodec interface.
#include "memory/stash_codec.h"

#include <cstring>

#include "memory/bitmap.h"
#include "memory/code_bitmap.h"
#include "memory/half.h"

namespace et {

namespace {

bitmap::ValueType value_type(bool f16) { return f16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32; }

class HostStashCodec final : public StashCodec {
 public:
  int64_t count_nonzero(const float* x, int64_t n, float prune_threshold) override {
    return bitmap::count_nonzero(x, n, prune_threshold);
  }
  int64_t make_bits(const float* x, int64_t n, float prune_threshold, uint64_t* bits, int64_t*) override {
    return bits ? bitmap::make_bits(x, n, prune_threshold, bits) : bitmap::count_nonzero(x, n, prune_threshold);
  }
  // With less room than n (the fixed layout; never the host's own compact one) and more kept:
  // the first `capacity` values, the other bits cleared (memory/stash_codec.h).
  void pack_values(const float* x, uint64_t* bits, int64_t n, void* values, bool f16,
                   int64_t capacity) override {
    if (capacity < n && bitmap::popcount(bits, n) > capacity)
      bitmap::keep_first(bits, n, capacity);
    bitmap::pack_values(x, bits, n, values, value_type(f16));
  }
  int64_t pack(const float* x, int64_t n, float prune_threshold, uint64_t* bits, void* values, bool f16,
               int64_t capacity, int64_t*) override {
    if (capacity < n) {
      const int64_t kept = bitmap::make_bits(x, n, prune_threshold, bits);
      if (kept > capacity) {
        bitmap::keep_first(bits, n, capacity);
        bitmap::pack_values(x, bits, n, values, value_type(f16));
        return kept;
      }
    }
    return bitmap::pack(x, n, prune_threshold, bits, values, value_type(f16));
  }
  void unpack(const uint64_t* bits, const void* values, int64_t n, bool f16, float* y) override {
    bitmap::unpack(bits, values, n, value_type(f16), y);
  }
  int64_t encode_codes(const float* x, const int8_t* codes, int64_t n, float prune_threshold, void* out,
                       int64_t capacity, int64_t*) override {
    return code_bitmap::encode(x, codes, n, prune_threshold, out, capacity);
  }
  void decode_codes(const void* data, int64_t n, bool is_signed, int8_t* out) override {
    code_bitmap::decode(data, n, is_signed, 0, n, out);
  }
  void to_half(const float* x, int64_t n, bool bf16, uint16_t* out) override {
    bf16 ? f32_to_bf16(x, n, out) : f32_to_f16(x, n, out);
  }
  void from_half(const uint16_t* x, int64_t n, bool bf16, float* out) override {
    bf16 ? bf16_to_f32(x, n, out) : f16_to_f32(x, n, out);
  }
  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void read_back(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
};

}  // namespace

StashCodec& host_stash_codec() {
  static HostStashCodec codec;
  return codec;
}

}  // namespace et
