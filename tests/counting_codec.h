// A stash codec for tests (memory/stash_codec.h): the host's, counting what the stash asks of it,
// and with `defer`, leaving its counts at count_out as a GPU's codec does (the stash's fixed layout);
// and a CPU backend that defers its counts with it, as the CUDA backend does.
#pragma once
#include "backends/cpu/cpu_backend.h"
#include "memory/stash_codec.h"

namespace et::test {

// The host's codec, counting what the stash asks of it.
class CountingCodec final : public StashCodec {
 public:
  int encodes = 0, decodes = 0, code_encodes = 0, deferred = 0, read_backs = 0;
  bool code_bitmap = true;  // false: as the CUDA codec, no bitmap_int4
  bool defer = false;       // true: as the CUDA codec, counts left at count_out (the stash's fixed layout)
  bool encodes_codes() const override { return code_bitmap; }
  bool defers_counts() const override { return defer; }
  int64_t count_nonzero(const float* x, int64_t n, float t) override { return host().count_nonzero(x, n, t); }
  int64_t make_bits(const float* x, int64_t n, float t, uint64_t* bits, int64_t* count_out) override {
    ++encodes;
    return counted(host().make_bits(x, n, t, bits, nullptr), count_out);
  }
  void pack_values(const float* x, uint64_t* bits, int64_t n, void* v, bool f16, int64_t capacity) override {
    ++encodes;
    host().pack_values(x, bits, n, v, f16, capacity);
  }
  int64_t pack(const float* x, int64_t n, float t, uint64_t* bits, void* v, bool f16, int64_t capacity,
               int64_t* count_out) override {
    ++encodes;
    return counted(host().pack(x, n, t, bits, v, f16, capacity, nullptr), count_out);
  }
  void unpack(const uint64_t* bits, const void* v, int64_t n, bool f16, float* y) override {
    ++decodes;
    host().unpack(bits, v, n, f16, y);
  }
  int64_t encode_codes(const float* x, const int8_t* c, int64_t n, float t, void* out, int64_t capacity,
                       int64_t* count_out) override {
    ++encodes, ++code_encodes;
    return counted(host().encode_codes(x, c, n, t, out, capacity, nullptr), count_out);
  }
  void decode_codes(const void* data, int64_t n, bool is_signed, int8_t* out) override {
    ++decodes;
    host().decode_codes(data, n, is_signed, out);
  }
  void to_half(const float* x, int64_t n, bool bf16, uint16_t* out) override {
    ++encodes;
    host().to_half(x, n, bf16, out);
  }
  void from_half(const uint16_t* x, int64_t n, bool bf16, float* out) override {
    ++decodes;
    host().from_half(x, n, bf16, out);
  }
  void copy(void* dst, const void* src, size_t bytes) override { host().copy(dst, src, bytes); }
  void read_back(void* dst, const void* src, size_t bytes) override {
    ++read_backs;
    host().read_back(dst, src, bytes);
  }

 private:
  static StashCodec& host() { return host_stash_codec(); }
  int64_t counted(int64_t count, int64_t* count_out) {
    if (!defer || !count_out) return count;
    ++deferred;
    *count_out = count;
    return -1;
  }
};

// A backend whose codec and ReLU leave their counts where the stash's fixed layout asks
// (memory/stash.h), as the CUDA backend does so that no push waits for the device.
class DeferringCpu : public CpuBackend {
 public:
  CountingCodec codec;
  int relu_slots = 0;
  DeferringCpu() { codec.defer = true; }
  StashCodec& stash_codec() override { return codec; }
  void relu_forward(const Tensor& x, Tensor& y, MaskOut* mask) override {
    CpuBackend::relu_forward(x, y, mask);
    if (mask && mask->kept_slot && mask->kept >= 0) {
      *mask->kept_slot = mask->kept;
      mask->kept = -1;
      mask->kept_in_slot = true;
      ++relu_slots;
    }
  }
};

}  // namespace et::test
