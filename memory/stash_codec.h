// StashCodec: the per-backend part of the stash. The Stash (memory/stash.h) decides what to store
// where in its region; a backend's codec does the element work on that backend's memory: the > 0
// bitmap, the bitmap + packed non-zeros (memory/bitmap.h), the INT4 code bitmap
// (memory/code_bitmap.h), fp16 / bf16 conversions and copies. Every pointer is one of the
// backend's (device memory on a GPU); counts come back to the host. The host's codec wraps the
// SIMD code of memory/; a GPU backend implements the same encodings bit for bit (its tests compare
// bytes). Backend neutral, C++14.
//
// Counts: make_bits, pack and encode_codes return the kept count. A codec whose counts would each
// cost a wait for the device (defers_counts(): a GPU) stores it at `count_out` instead, when given
// (an int64 of the codec's memory), and returns -1; read_back fetches such counts later, many at
// once (the Stash's fixed layout, memory/stash.h). Other codecs ignore count_out.
//
// Room: pack, pack_values and encode_codes write the kept elements' values or codes only where an
// encoding of `capacity` kept elements would (stash_encoding_bytes(.., n, capacity)): the fixed
// layout sizes each entry from the counts of earlier steps. When more are kept, the encoding holds
// the first kept elements that fit (values: `capacity` of them; codes: those whose nibbles fit
// code_bitmap::nibble_bytes(n, capacity)) and the bits of the others are cleared, so a reader of
// it (unpack, decode_codes, a mask) stays within the room too; nothing lands beyond it, and the
// count is still the whole count, so the stash sees the overflow (and the step runs again with
// more room). capacity >= n: no limit.
#pragma once
#include <cstddef>
#include <cstdint>

namespace et {

class StashCodec {
 public:
  virtual ~StashCodec() = default;
  // Elements of x[n] with |x| above the prune threshold (bitmap::count_nonzero).
  virtual int64_t count_nonzero(const float* x, int64_t n, float prune_threshold) = 0;
  virtual bool defers_counts() const { return false; }
  // Waits until the work it issued has run (a GPU's kernels run after their calls return), so that
  // a timed stash (Stash::set_timing: the budget's calibration) measures the work, not its launch.
  virtual void synchronize() {}
  // Scratch for encodings of up to n elements, sized now (outside the step: a recorded step may
  // not allocate); the stash calls it with its largest value. Only grows.
  virtual void reserve(int64_t /*n*/) {}
  // Changes whenever the codec's scratch moves (grows): work recorded before holds the old places
  // (Backend::record_generation).
  virtual int64_t scratch_generation() const { return 0; }
  // bits[num_words(n)] = the kept-element bitmap; returns its population (bitmap::make_bits).
  // bits == nullptr: the count alone (count_nonzero), left at count_out as other counts are.
  virtual int64_t make_bits(const float* x, int64_t n, float prune_threshold, uint64_t* bits, int64_t* count_out) = 0;
  // values[] = the elements `bits` keeps, in order, f32 or f16 (bitmap::pack_values); past the
  // room, the bits of those left out are cleared (above).
  virtual void pack_values(const float* x, uint64_t* bits, int64_t n, void* values, bool f16,
                           int64_t capacity) = 0;
  // make_bits and pack_values in one pass; returns the kept count (bitmap::pack).
  virtual int64_t pack(const float* x, int64_t n, float prune_threshold, uint64_t* bits, void* values, bool f16,
                       int64_t capacity, int64_t* count_out) = 0;
  // y[n] = the dense tensor `bits` / `values` encode, zeros elsewhere (bitmap::unpack).
  virtual void unpack(const uint64_t* bits, const void* values, int64_t n, bool f16, float* y) = 0;
  // For kernels that read a bitmap encoding in place (a CUDA conv's weight gradient): the index of
  // each kOffsetChunk-element chunk's first kept value, in the codec's memory (valid until its next
  // call), or null where the codec keeps none (the host's readers count as they go).
  static constexpr int64_t kOffsetChunk = 256;
  virtual const uint64_t* value_offsets(const uint64_t* /*bits*/, int64_t /*n*/) { return nullptr; }
  // Whether encode_codes runs on this backend (memory.stash = bitmap_int4; auto then keeps a
  // quantized layer's input codes); the planner asks before choosing it.
  virtual bool encodes_codes() const { return true; }
  // The bitmap_int4 encoding of x's codes (code_bitmap::encode); returns the kept count.
  virtual int64_t encode_codes(const float* x, const int8_t* codes, int64_t n, float prune_threshold, void* out,
                               int64_t capacity, int64_t* count_out) = 0;
  // out[n] = the codes of a bitmap_int4 encoding of n elements, one per byte, 0 where the bitmap
  // has no bit (code_bitmap::decode); is_signed: I4 codes (else U4). A GPU's integer kernels read
  // the stored codes so; the CPU's decode a few rows at a time (memory/stored_codes.h).
  virtual void decode_codes(const void* data, int64_t n, bool is_signed, int8_t* out) = 0;
  // IEEE half (round to nearest even) or bfloat16 (round to nearest even) and back (memory/half.h).
  virtual void to_half(const float* x, int64_t n, bool bf16, uint16_t* out) = 0;
  virtual void from_half(const uint16_t* x, int64_t n, bool bf16, float* out) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // dst (host memory) = src (the codec's), once the work issued so far has written it.
  virtual void read_back(void* dst, const void* src, size_t bytes) = 0;
};

// The host's (the CPU backend's): memory/bitmap.h, code_bitmap.h and half.h.
StashCodec& host_stash_codec();

}  // namespace et
