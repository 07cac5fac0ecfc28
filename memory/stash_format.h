// Stash formats and the encodings they store, each described once (stash_format.cpp's tables):
// the executor's planner (which dtypes a save is read as, whether it needs a decode buffer) and
// the stash (region size, what a push writes, how it is read back) derive everything from here.
//
// Formats (per value; memory.stash globally, memory.layers per layer):
//   dense_fp32   the forward buffer itself is kept (zero copy): exact, the baseline;
//   dense_fp16 / dense_bf16   converted copies (lossy);
//   bitmap_fp32 / bitmap_fp16 BitTrain: 1 bit per element + the non-zero values (fp32 exact);
//   bitmap_int4  the INT4 codes a quantized layer computed from its input: 1 bit per element + 4
//                bits per non-zero (memory/code_bitmap.h), exactly what its integer backward reads;
//   auto         per tensor the smaller exact one of bitmap_fp32 and a dense fp32 copy (and
//                bitmap_int4 for the inputs of INT4 layers, engine/executor_codes.cpp).
// A value only ever read as a mask is stored as its bitmap alone in every format but dense_fp32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/tensor.h"

namespace et {

enum class StashFormat : uint8_t { DenseF32, DenseF16, DenseBF16, BitmapF32, BitmapF16, BitmapI4, Auto };

// What one push actually stored (a format stores one encoding per save; auto chooses per push).
enum class StashEncoding : uint8_t {
  None,       // nothing pushed
  ZeroCopy,   // the forward buffer itself (dense_fp32)
  CopyF32,    // an f32 copy in the stash (auto, when dense is smaller)
  F16,
  BF16,
  BitmapF32,  // memory/bitmap.h: bitmap words, then the kept values
  BitmapF16,
  BitmapI4,   // memory/code_bitmap.h: bitmap, directory, signed INT4 codes of the kept elements
  BitmapU4,   // the same with unsigned codes (inputs >= 0 by construction)
  Mask,       // the bitmap alone: a value only read as a > 0 mask
  Recomputed, // nothing: its producer recomputes it for the first reader's backward (SavedValue::recomputed)
};

struct StashEncodingInfo {
  const char* display;  // stash records and memory profiles: "fp32 (zero copy)", "bits (mask)", ...
  bool every_element;   // false: only the > 0 mask can be read back
  bool bitmap;          // starts with a bitmap (memory/bitmap.h layout), which a mask reads as is
  DType dtype;          // the tensor dtype the stash hands it out as (Stash::get_stored)
  int value_bits;       // per kept value in the stash region (0: none there)
  bool codes;           // the 4-bit codes of a quantized layer's input (pushed with them), not f32 values
};
const StashEncodingInfo& stash_encoding_info(StashEncoding e);
// Bytes in the stash region for n elements of which `kept` are stored (bitmaps; n for dense).
// Zero copy takes none there.
size_t stash_encoding_bytes(StashEncoding e, int64_t n, int64_t kept);

struct StashFormatInfo {
  const char* name;            // in configs: "dense_fp32", ...
  // A save of every element stores `full` or `full_alt`: auto's dense copy when that is smaller,
  // bitmap_int4's unsigned codes.
  StashEncoding full, full_alt;
  StashEncoding mask;          // a save of the > 0 mask alone
};
const StashFormatInfo& stash_format_info(StashFormat f);

const char* stash_format_name(StashFormat f);
bool parse_stash_format(const std::string& s, StashFormat* out);
std::string stash_format_names();  // "dense_fp32, dense_fp16, ..." for messages

// The dtypes a full save in format f may be handed out as (Stash::get_stored).
DTypeSet stash_format_dtypes(StashFormat f);
// The dtypes of full saves a mask reads without a decode: the bitmap, or the f32 values.
DTypeSet stash_mask_dtypes();
// Whether a save in format f (of every element, or the mask alone) may start with a bitmap.
bool stash_format_has_bitmap(StashFormat f, bool full);
// The most a save of n elements in format f takes in the stash region (every value kept).
size_t stash_worst_case_bytes(StashFormat f, int64_t n, bool full);
// The same when at most `room` elements are kept (room >= n: the worst case), for the formats whose
// size follows the count (bitmaps with values or codes; others take their worst case). auto then
// takes its bitmap with `room` values, or its copy where that is smaller.
size_t stash_room_bytes(StashFormat f, int64_t n, bool full, int64_t room);

}  // namespace et
