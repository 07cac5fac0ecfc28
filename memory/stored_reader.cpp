#include "memory/stored_reader.h"

#include "memory/bitmap.h"
#include "memory/half.h"

namespace et {

StoredReader::StoredReader(const Tensor& y, float* scratch, int64_t scratch_elems)
    : x_(y), scratch_(scratch), capacity_(scratch_elems) {
  if (y.dtype == DType::AffineRelu) {
    affine_ = static_cast<const AffineReluSource*>(y.data);
    x_ = affine_->x;
    ET_CHECK(x_.shape == y.shape && x_.shape.ndim == 4, "StoredReader: relu(affine) of ", x_.shape.str(), " as ",
             y.shape.str());
    channels_ = x_.dim(1);
    plane_ = x_.dim(2) * x_.dim(3);
  }
  const Tensor& x = x_;
  if (x.dtype == DType::BitmapF32 || x.dtype == DType::BitmapF16) {
    bits_ = static_cast<const uint64_t*>(x.data);
    values_ = bits_ + bitmap::num_words(x.numel());
    f16_values_ = x.dtype == DType::BitmapF16;
  } else {
    ET_CHECK(x.dtype == DType::F32 || x.dtype == DType::F16 || x.dtype == DType::BF16, "StoredReader: dtype ",
             dtype_name(x.dtype));
  }
}

const float* StoredReader::read(int64_t begin, int64_t count) {
  const float* p = read_source(begin, count);
  return affine_ ? affine_relu(p, begin, count) : p;
}

// The source's piece through the scratch.
const float* StoredReader::affine_relu(const float* src, int64_t begin, int64_t count) {
  ET_CHECK(count <= capacity_, "piece of ", count, " elements, scratch for ", capacity_);
  affine_->run(src, affine_->scale, affine_->shift, channels_, plane_, begin, count, scratch_);
  return scratch_;
}

const float* StoredReader::read_source(int64_t begin, int64_t count) {
  if (bits_) {
    if (begin != next_) value_index_ = bitmap::popcount(bits_, begin);
    next_ = begin + count;
    return read_at_source(begin, count, &value_index_);
  }
  ET_CHECK(begin >= 0 && count >= 0 && begin + count <= x_.numel(), "piece [", begin, ", +", count, ") of ",
           x_.numel());
  if (x_.dtype == DType::F32) return static_cast<const float*>(x_.data) + begin;
  ET_CHECK(count <= capacity_, "piece of ", count, " elements, scratch for ", capacity_);
  const uint16_t* h = static_cast<const uint16_t*>(x_.data) + begin;
  if (x_.dtype == DType::F16) f16_to_f32(h, count, scratch_);
  else bf16_to_f32(h, count, scratch_);
  return scratch_;
}

const float* StoredReader::read_at(int64_t begin, int64_t count, int64_t* cursor) {
  if (!bits_) return read(begin, count);
  const float* p = read_at_source(begin, count, cursor);
  return affine_ ? affine_relu(p, begin, count) : p;
}

const float* StoredReader::read_at_source(int64_t begin, int64_t count, int64_t* cursor) {
  ET_CHECK(begin >= 0 && count >= 0 && begin + count <= x_.numel() && count <= capacity_, "piece [", begin, ", +",
           count, ") of ", x_.numel(), ", scratch for ", capacity_);
  const auto vt = f16_values_ ? bitmap::ValueType::F16 : bitmap::ValueType::F32;
  *cursor = bitmap::unpack_range(bits_, values_, vt, begin, count, *cursor, scratch_);
  return scratch_;
}

int64_t StoredReader::cursor_at(int64_t begin) const { return bits_ ? bitmap::popcount(bits_, begin) : begin; }

int64_t StoredReader::kept(int64_t begin, int64_t count) const {
  return bits_ ? bitmap::popcount_range(bits_, begin, count) : count;
}

}  // namespace et
