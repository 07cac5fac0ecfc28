#include "memory/stored_codes.h"

#include "memory/code_bitmap.h"

namespace et {

bool is_input_codes(DType t) {
  return t == DType::I4 || t == DType::U4 || t == DType::BitmapI4 || t == DType::BitmapU4;
}

const int8_t* code_rows(const Tensor& xq, int64_t first, int64_t count, int8_t* scratch) {
  ET_CHECK(first >= 0 && count >= 0 && first + count <= xq.dim(0), "rows [", first, ", +", count, ") of ",
           xq.shape.str());
  const int64_t row = xq.numel() / xq.dim(0);
  if (xq.dtype == DType::I4 || xq.dtype == DType::U4) return xq.codes() + first * row;
  ET_CHECK(xq.dtype == DType::BitmapI4 || xq.dtype == DType::BitmapU4, "code_rows: dtype ", dtype_name(xq.dtype));
  code_bitmap::decode(xq.data, xq.numel(), xq.dtype == DType::BitmapI4, first * row, count * row, scratch);
  return scratch;
}

}  // namespace et
