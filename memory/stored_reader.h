// StoredReader: pieces of a saved activation as f32, whatever encoding the stash keeps it in
// (engine/tensor.h: F32, F16, BF16, BitmapF32, BitmapF16), or computed from another stored value as
// it is read (AffineRelu, engine/affine_relu.h: a piece of x, then relu(x * scale[c] + shift[c]) on
// it channel by channel). For kernels that decode each piece
// just before they use it (an image or a plane, in cache) instead of a decode pass over the whole
// tensor into a buffer of its dense size: that pass costs a write and a read of the dense tensor
// through memory, and the buffer itself is planned memory.
//
// One reader per thread. Pieces are cheapest in increasing order: a bitmap reader keeps its cursor
// into the packed values; a jump counts the set bits before the new position.
#pragma once
#include <cstdint>

#include "engine/affine_relu.h"
#include "engine/tensor.h"

namespace et {

class StoredReader {
 public:
  // `scratch` holds the largest piece this reader will be asked for (unused for dense f32).
  // AffineRelu: x is the source's x, and pieces go through the scratch.
  StoredReader(const Tensor& x, float* scratch, int64_t scratch_elems);
  // f32 elements [begin, begin + count) of x (flat index): a pointer into x itself when x is
  // dense f32, else into the scratch (valid until the next read).
  const float* read(int64_t begin, int64_t count);
  // For kernels that walk several interleaved sequences of pieces (a depthwise conv reads plane
  // (n, c) for every n, then c + 1): the caller holds one cursor per sequence. `*cursor` is the
  // number of kept values before `begin` (cursor_at(begin) to start) and is advanced past the piece.
  const float* read_at(int64_t begin, int64_t count, int64_t* cursor);
  int64_t cursor_at(int64_t begin) const;
  bool is_bitmap() const { return bits_ != nullptr; }  // of the source, for AffineRelu
  // x is a fused stack's output over an f32 input (DType::AffineRelu): the source, for kernels that
  // compute the output as they stage it (cpu::to_channels_last); else null.
  const AffineReluSource* affine_over_f32() const { return affine_ && x_.dtype == DType::F32 ? affine_ : nullptr; }
  // Kept values among elements [begin, begin + count) (bitmaps; count for dense encodings); for
  // AffineRelu, the source's (cursors count the source's stored values).
  int64_t kept(int64_t begin, int64_t count) const;

 private:
  const float* read_source(int64_t begin, int64_t count);
  const float* read_at_source(int64_t begin, int64_t count, int64_t* cursor);
  const float* affine_relu(const float* src, int64_t begin, int64_t count);

  const AffineReluSource* affine_ = nullptr;
  int64_t channels_ = 0, plane_ = 0;  // AffineRelu: C and H * W of x
  Tensor x_;
  float* scratch_;
  int64_t capacity_;
  const uint64_t* bits_ = nullptr;
  const void* values_ = nullptr;
  bool f16_values_ = false;
  int64_t next_ = 0, value_index_ = 0;  // bitmaps: the element after the last piece, its value index
};

}  // namespace et
