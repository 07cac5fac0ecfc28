// Tensor: a non-owning view (data pointer, dtype, device, shape, strides). Memory belongs to the
// arena that planned it (memory/), so a tensor is a plain value that is cheap to copy.
// Activations are NCHW; strides are in elements.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "engine/check.h"

namespace et {

// BitmapF32 / BitmapF16: BitTrain's encoding of a saved activation (memory/bitmap.h): `data`
// points to ceil(numel / 64) uint64 bitmap words, followed directly by the kept values (fp32 /
// fp16). Such a tensor has no per-element size; only kernels that say they read it see one
// (the stash hands them its storage as is, see OpContext::saved(i, accepted)).
//
// I4 / U4 / F4: 4-bit codes in the integer kernels' layout, one per byte (quant/codes.h): INT4
// signed -7..7, INT4 unsigned 0..15, FP4 as the signed power of two it stands for. Their value is
// code * Tensor::scale (the per-tensor scale, or FP4's alpha), carried beside the data (or in the
// backend's memory, at Tensor::scale_at).
//
// BitmapI4 / BitmapU4: the stash's bitmap_int4 encoding of INT4 (signed / unsigned) codes
// (memory/code_bitmap.h): the bitmap of the non-zero input values, a directory, and the kept
// elements' codes two per byte; the scale in Tensor::scale. Read through memory/stored_codes.h.
//
// AffineRelu: values not stored at all, y = relu(x * scale[c] + shift[c]) of another stored tensor x
// (a fused BN -> ReLU stack's output, memory.recompute_stack_outputs): `data` points to an
// AffineReluSource (engine/affine_relu.h); memory/stored_reader.h computes its pieces as it reads.
enum class DType : uint8_t {
  F32, F16, BF16, I32, U8, BitmapF32, BitmapF16, I4, U4, F4, BitmapI4, BitmapU4, AffineRelu
};
enum class Device : uint8_t { CPU, CUDA };

size_t dtype_size(DType t);  // aborts for the bitmap encodings
const char* dtype_name(DType t);
// Sets of dtypes, as bit masks (what a kernel can read).
using DTypeSet = uint32_t;
constexpr DTypeSet dtype_bit(DType t) { return DTypeSet(1) << unsigned(t); }
constexpr bool dtype_in(DType t, DTypeSet s) { return (s & dtype_bit(t)) != 0; }
// Every encoding of f32 values the stash may hand out (memory/stash.h); bitmap_int4's codes are not
// f32 values: only the integer kernels read them (memory/stored_codes.h).
constexpr DTypeSet kStashDTypes = dtype_bit(DType::F32) | dtype_bit(DType::F16) | dtype_bit(DType::BF16) |
                                  dtype_bit(DType::BitmapF32) | dtype_bit(DType::BitmapF16);
// What memory/stored_reader.h reads: the stash's encodings, and values computed from one as read.
constexpr DTypeSet kReaderDTypes = kStashDTypes | dtype_bit(DType::AffineRelu);

constexpr int kMaxDims = 4;

struct Shape {
  int ndim = 0;
  int64_t d[kMaxDims] = {0, 0, 0, 0};

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int64_t operator[](int i) const { return d[i]; }
  int64_t& operator[](int i) { return d[i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "[128, 16, 32, 32]"
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  Shape shape;
  int64_t strides[kMaxDims] = {0, 0, 0, 0};
  float scale = 1.f;  // I4 / U4 / F4: value = code * scale
  // Where the scale is kept instead, in the backend's memory (Backend::quant_scales_in_memory: a
  // recordable 4-bit step, whose scales a kernel writes there every step); nullptr: `scale`.
  const float* scale_at = nullptr;

  static Tensor contiguous(void* data, const Shape& shape, DType dtype = DType::F32, Device dev = Device::CPU);

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape.d[i]; }
  bool is_contiguous() const;
  bool defined() const { return data != nullptr; }
  // The scale of codes in host-addressable memory (the CPU backend's kernels): *scale_at or scale.
  float host_scale() const { return scale_at ? *scale_at : scale; }

  float* f32() const { ET_CHECK(dtype == DType::F32); return static_cast<float*>(data); }
  int32_t* i32() const { ET_CHECK(dtype == DType::I32); return static_cast<int32_t*>(data); }
  uint8_t* u8() const { ET_CHECK(dtype == DType::U8); return static_cast<uint8_t*>(data); }
  int8_t* codes() const {
    ET_CHECK(dtype == DType::I4 || dtype == DType::U4 || dtype == DType::F4);
    return static_cast<int8_t*>(data);
  }

  // Same memory, leading dimension replaced (the batch of a partial last batch).
  Tensor with_batch(int64_t n) const;
  // Same memory, new shape with the same number of elements (contiguous only).
  Tensor reshaped(const Shape& s) const;
};

}  // namespace et
