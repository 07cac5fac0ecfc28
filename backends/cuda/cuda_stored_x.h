// A saved input read as the stash keeps it (engine/tensor.h's kStashDTypes: dense f32, fp16,
// bf16, or a bitmap with kept f32 / fp16 values), element by element, so a backward kernel needs no
// f32 decode buffer (BitTrain's memory: the executor plans one only for dtypes a pass does not
// list in its *_reads()). The conv weight gradient's im2col, the max-pool backward's window search
// and BN's backward sweeps read through it; each is a template over its x (`const float*` for
// f32, StoredX for the others), so the f32 path stays a plain load. The conv weight gradient also
// reads a value nothing keeps, a fused stack's y = relu(x * scale[c] + shift[c]), from the stack's
// x as stored (DType::AffineRelu, engine/affine_relu.h: AffineReluX). C++14.
#pragma once
#include <cstdint>

#include "backends/cuda/cuda_half.h"
#include "backends/cuda/index_math.h"
#include "engine/affine_relu.h"
#include "engine/check.h"
#include "engine/tensor.h"
#include "memory/stash_codec.h"

namespace et {
namespace cuda {

// Element i of x: fp16 and bf16 widen exactly; a bitmap (bit i of word i / 64, then the kept
// values) gives 0 where its bit is clear, else kept value number offsets[i / kOffsetChunk] (the
// chunk's first, StashCodec::value_offsets) + the set bits before i in its chunk.
struct StoredX {
  enum Kind { F16, BF16, BitmapF32, BitmapF16 };
  const void* data;
  const uint64_t* bits;     // bitmaps
  const uint64_t* offsets;  // bitmaps: each chunk's first value index
  Kind kind;
  __device__ __forceinline__ float operator[](int64_t i) const {
    if (kind == F16) return from_f16(static_cast<const uint16_t*>(data)[i]);
    if (kind == BF16) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(data)[i]) << 16);
    const int64_t word = i / 64;
    const uint64_t w = bits[word];
    if (!(w >> (i % 64) & 1)) return 0.f;
    constexpr int64_t kWordsPerChunk = StashCodec::kOffsetChunk / 64;
    int64_t index = int64_t(offsets[i / StashCodec::kOffsetChunk]) + __popcll(w & ((uint64_t(1) << (i % 64)) - 1));
    for (int64_t j = word / kWordsPerChunk * kWordsPerChunk; j < word; ++j) index += __popcll(bits[j]);
    return kind == BitmapF32 ? static_cast<const float*>(data)[index]
                             : from_f16(static_cast<const uint16_t*>(data)[index]);
  }
};

// x (any of kStashDTypes but F32) as a StoredX; `codec` gives a bitmap's chunk offsets (computed
// on the device, in stream order). `what` names the pass for the message of another dtype.
inline StoredX stored_x(const Tensor& x, StashCodec& codec, const char* what) {
  StoredX s{x.data, nullptr, nullptr, StoredX::F16};
  switch (x.dtype) {
    case DType::F16: return s;
    case DType::BF16: s.kind = StoredX::BF16; return s;
    case DType::BitmapF32:
    case DType::BitmapF16: {
      const int64_t n = x.numel(), words = (n + 63) / 64;
      s.kind = x.dtype == DType::BitmapF32 ? StoredX::BitmapF32 : StoredX::BitmapF16;
      s.bits = static_cast<const uint64_t*>(x.data);
      s.data = s.bits + words;
      s.offsets = codec.value_offsets(s.bits, n);
      return s;
    }
    default: break;
  }
  ET_CHECK(false, what, ": x dtype ", dtype_name(x.dtype));
  return s;
}

// Calls f with x as its kernels read it: `const float*` for f32, else a StoredX (stored_x). Each
// call site instantiates its kernels for both.
template <class F>
void with_stored_x(const Tensor& x, StashCodec& codec, const char* what, F&& f) {
  if (x.dtype == DType::F32) return f(static_cast<const float*>(x.data));
  f(stored_x(x, codec, what));
}

// Element i of y = relu(x[i] * scale[c] + shift[c]), c = i / HW % C: a BN -> ReLU stack's output
// as its forward computed it (cuda_batchnorm.cu's ElementwiseOut: one FMA, then relu_kernel's rule,
// NaN and -0 giving +0), so a reader gets the forward's bits wherever x is kept exact. X: const
// float* or StoredX. scale, shift: [C] in device memory.
template <class X>
struct AffineReluX {
  X x;
  const float* scale;
  const float* shift;
  int64_t C, HW;
  __device__ __forceinline__ float operator[](int64_t i) const {
    const int64_t c = cuda_index::imod(cuda_index::idiv(i, HW), C);
    const float v = __fmaf_rn(x[i], scale[c], shift[c]);
    return v > 0.f ? v : 0.f;
  }
};

// Calls f with x as its kernels read it: with_stored_x's, or for DType::AffineRelu (a value its
// readers compute, x [N, C, H, W]) an AffineReluX over the source's x as stored.
template <class F>
void with_read_x(const Tensor& x, StashCodec& codec, const char* what, F&& f) {
  if (x.dtype != DType::AffineRelu) return with_stored_x(x, codec, what, f);
  const auto* src = static_cast<const AffineReluSource*>(x.data);
  ET_CHECK(src->x.numel() == x.numel(), what, ": a computed input of ", x.shape.str(), " from ", src->x.shape.str());
  const int64_t C = x.dim(1), HW = x.numel() / (x.dim(0) * C);
  with_stored_x(src->x, codec, what, [&](auto sx) { f(AffineReluX<decltype(sx)>{sx, src->scale, src->shift, C, HW}); });
}

}  // namespace cuda
}  // namespace et
