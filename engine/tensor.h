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

enum class DType : uint8_t { F32, F16, BF16, I32, U8 };
enum class Device : uint8_t { CPU, CUDA };

size_t dtype_size(DType t);
const char* dtype_name(DType t);

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

  static Tensor contiguous(void* data, const Shape& shape, DType dtype = DType::F32, Device dev = Device::CPU);

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape.d[i]; }
  bool is_contiguous() const;
  bool defined() const { return data != nullptr; }

  float* f32() const { ET_CHECK(dtype == DType::F32); return static_cast<float*>(data); }
  int32_t* i32() const { ET_CHECK(dtype == DType::I32); return static_cast<int32_t*>(data); }
  uint8_t* u8() const { ET_CHECK(dtype == DType::U8); return static_cast<uint8_t*>(data); }

  // Same memory, leading dimension replaced (the batch of a partial last batch).
  Tensor with_batch(int64_t n) const;
  // Same memory, new shape with the same number of elements (contiguous only).
  Tensor reshaped(const Shape& s) const;
};

}  // namespace et
