#include "engine/tensor.h"

#include <sstream>

namespace et {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::U8:
    case DType::I4:
    case DType::U4:
    case DType::F4: return 1;
    case DType::BitmapF32:
    case DType::BitmapF16:
    case DType::BitmapI4:
    case DType::BitmapU4:
    case DType::AffineRelu: break;
  }
  ET_CHECK(false, "dtype ", dtype_name(t), " has no per-element size");
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::U8: return "u8";
    case DType::BitmapF32: return "bitmap+f32";
    case DType::BitmapF16: return "bitmap+f16";
    case DType::I4: return "int4";
    case DType::U4: return "uint4";
    case DType::F4: return "fp4";
    case DType::BitmapI4: return "bitmap+int4";
    case DType::BitmapU4: return "bitmap+uint4";
    case DType::AffineRelu: return "relu(affine)";
  }
  return "?";
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  ET_CHECK(dims.size() <= size_t(kMaxDims), "at most ", kMaxDims, " dims");
  for (int64_t v : dims) d[ndim++] = v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= d[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (d[i] != o.d[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << d[i];
  os << "]";
  return os.str();
}

Tensor Tensor::contiguous(void* data, const Shape& shape, DType dtype, Device dev) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.device = dev;
  t.shape = shape;
  int64_t s = 1;
  for (int i = shape.ndim - 1; i >= 0; --i) {
    t.strides[i] = s;
    s *= shape.d[i];
  }
  return t;
}

bool Tensor::is_contiguous() const {
  int64_t s = 1;
  for (int i = shape.ndim - 1; i >= 0; --i) {
    if (shape.d[i] != 1 && strides[i] != s) return false;
    s *= shape.d[i];
  }
  return true;
}

Tensor Tensor::with_batch(int64_t n) const {
  Tensor t = *this;
  t.shape.d[0] = n;
  return t;
}

Tensor Tensor::reshaped(const Shape& s) const {
  ET_CHECK(is_contiguous() && s.numel() == numel(), "reshape ", shape.str(), " -> ", s.str());
  Tensor t = contiguous(data, s, dtype, device);
  t.scale = scale;
  t.scale_at = scale_at;
  return t;
}

}  // namespace et
