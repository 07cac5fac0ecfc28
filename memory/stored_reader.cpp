#include "memory/stored_reader.h"

#include "memory/bitmap.h"
#include "memory/half.h"

namespace et {

StoredReader::StoredReader(const Tensor& x, float* scratch, int64_t scratch_elems)
    : x_(x), scratch_(scratch), capacity_(scratch_elems) {
  if (x.dtype == DType::BitmapF32 || x.dtype == DType::BitmapF16) {
    bits_ = static_cast<const uint64_t*>(x.data);
    values_ = bits_ + bitmap::num_words(x.numel());
  } else {
    ET_CHECK(x.dtype == DType::F32 || x.dtype == DType::F16 || x.dtype == DType::BF16, "StoredReader: dtype ",
             dtype_name(x.dtype));
  }
}

const float* StoredReader::read(int64_t begin, int64_t count) {
  ET_CHECK(begin >= 0 && count >= 0 && begin + count <= x_.numel(), "piece [", begin, ", +", count, ") of ",
           x_.numel());
  if (x_.dtype == DType::F32) return static_cast<const float*>(x_.data) + begin;
  ET_CHECK(count <= capacity_, "piece of ", count, " elements, scratch for ", capacity_);
  const uint16_t* h = static_cast<const uint16_t*>(x_.data) + begin;
  switch (x_.dtype) {
    case DType::F16: f16_to_f32(h, count, scratch_); break;
    case DType::BF16: bf16_to_f32(h, count, scratch_); break;
    default: {
      const auto vt = x_.dtype == DType::BitmapF16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32;
      if (begin != next_) value_index_ = bitmap::popcount(bits_, begin);
      value_index_ = bitmap::unpack_range(bits_, values_, vt, begin, count, value_index_, scratch_);
      next_ = begin + count;
    }
  }
  return scratch_;
}

const float* StoredReader::read_at(int64_t begin, int64_t count, int64_t* cursor) {
  if (!bits_) return read(begin, count);
  ET_CHECK(begin >= 0 && count >= 0 && begin + count <= x_.numel() && count <= capacity_, "piece [", begin, ", +",
           count, ") of ", x_.numel());
  const auto vt = x_.dtype == DType::BitmapF16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32;
  *cursor = bitmap::unpack_range(bits_, values_, vt, begin, count, *cursor, scratch_);
  return scratch_;
}

int64_t StoredReader::cursor_at(int64_t begin) const { return bits_ ? bitmap::popcount(bits_, begin) : begin; }

int64_t StoredReader::kept(int64_t begin, int64_t count) const {
  if (!bits_ || count <= 0) return bits_ ? 0 : count;
  const int64_t end = begin + count, w0 = begin / 64, w1 = end / 64;
  const uint64_t head = bits_[w0] >> (begin % 64);
  if (w0 == w1) return __builtin_popcountll(head & ((uint64_t(1) << (end - begin)) - 1));
  int64_t s = __builtin_popcountll(head);
  for (int64_t w = w0 + 1; w < w1; ++w) s += __builtin_popcountll(bits_[w]);
  if (end % 64) s += __builtin_popcountll(bits_[w1] & ((uint64_t(1) << (end % 64)) - 1));
  return s;
}

}  // namespace et
