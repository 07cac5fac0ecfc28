// The INT4 input codes of a quantized conv / linear as its integer kernels read them: one code per
// byte, row by row (a row is one entry of the leading dimension: an image of a conv input, a
// sample of a linear input). The codes come either dense from the node's buffer (I4 / U4) or, under
// memory.stash = bitmap_int4, as the stash stores them (BitmapI4 / BitmapU4, memory/code_bitmap.h),
// decoded a few rows at a time into the kernel's scratch, in cache, just before it uses them.
#pragma once
#include <cstdint>

#include "engine/tensor.h"

namespace et {

// I4, U4, BitmapI4, BitmapU4: what a kernel taking an INT4 input through code_rows() accepts.
bool is_input_codes(DType t);

// Rows [first, first + count) of xq, contiguous: a pointer into xq for dense codes, else decoded into
// `scratch` (count * xq.numel() / xq.dim(0) bytes).
const int8_t* code_rows(const Tensor& xq, int64_t first, int64_t count, int8_t* scratch);

}  // namespace et
