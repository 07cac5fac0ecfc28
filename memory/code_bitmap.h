// Bitmap + 4-bit codes: how the stash's bitmap_int4 keeps a quantized layer's INT4 input codes
// (docs/quant.md). The bitmap marks the input's kept (non-zero) values, so a ReLU output's bitmap
// is also its backward mask; only the kept elements' codes are stored, two per byte. Elements
// whose bit is clear decode to code 0 (a zero input quantizes to code 0).
//
// Layout of an encoded tensor of n elements:
//   bits       bitmap::num_words(n) uint64 words (memory/bitmap.h layout and keep rule);
//   directory  num_blocks(n) int64: where each block of kBlock elements starts in `nibbles` (bytes);
//   nibbles    per block, its kept elements' codes in order, two per byte, low nibble first
//              (quant/codes.h: signed codes as two's complement nibbles). Every block starts on a
//              byte, so blocks encode and decode independently (threads; a row of the tensor is
//              found without counting the bits before it).
// Size: 1 bit per element + 4 bits per kept element + 8 bytes per 4096 elements (+ half a byte
// per block at most).
// C++14 (the CUDA stash codec encodes the same bytes).
#pragma once
#include <cstddef>
#include <cstdint>

namespace et {
namespace code_bitmap {

constexpr int64_t kBlock = 4096;  // a multiple of 64: blocks start on a bitmap word
constexpr int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// The most an encoding of n elements with `kept` of them kept takes, bitmap included.
size_t encoded_bytes(int64_t n, int64_t kept);
// The most its nibbles take (every block starts on a byte).
constexpr int64_t nibble_bytes(int64_t n, int64_t kept) { return (kept + num_blocks(n) + 1) / 2; }

// Encodes n elements: the bitmap of x (memory/bitmap.h keep rule with `prune_threshold`), the
// directory, and the codes (one per byte) of the kept elements. `out` has encoded_bytes(n, n)
// bytes, or encoded_bytes(n, capacity) where capacity < n: then the nibbles stay within
// nibble_bytes(n, capacity), and a block whose codes would pass that keeps those that fit, the
// bits of the others cleared (the stash's fixed layout: every reader stays within the room).
// Returns the number of kept elements (before any is left out). Large tensors use several
// threads (the output does not depend on their number).
int64_t encode(const float* x, const int8_t* codes, int64_t n, float prune_threshold, void* out,
               int64_t capacity = -1);

// Elements [begin, begin + count) of an encoding of n elements as codes, one per byte, on the
// calling thread.
void decode(const void* data, int64_t n, bool is_signed, int64_t begin, int64_t count, int8_t* out);

// Kernels on one block, for tests and benchmarks: the plain reference (one element at a time)
// and the fast path of this build (AVX-512 VBMI2 byte compress / expand; AVX2 and NEON byte
// shuffles from 256-entry tables; `available` false where the build has none, and the dispatch
// then runs the reference).
struct Impl {
  const char* name;
  bool available;
  // The kept codes of elements [0, count) of a block (bits starts at its first element) as
  // nibbles from the start of `out`.
  void (*pack)(const uint64_t* bits, const int8_t* codes, int64_t count, uint8_t* out);
  // count elements from element `first` of `bits` whose first kept code is nibble `nibble` of
  // `nibbles`, as codes one per byte.
  void (*unpack)(const uint64_t* bits, int64_t first, const uint8_t* nibbles, int64_t nibble, int64_t count,
                 bool is_signed, int8_t* out);
};
const Impl& reference_impl();
const Impl& fast_impl();

}  // namespace code_bitmap
}  // namespace et
