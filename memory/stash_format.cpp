#include "memory/stash_format.h"

#include <algorithm>

#include "memory/bitmap.h"
#include "memory/code_bitmap.h"

namespace et {

namespace {
// Indexed by StashEncoding.
const StashEncodingInfo kEncodings[] = {
    /* None      */ {"", false, false, DType::F32, 0, false},
    /* ZeroCopy  */ {"fp32 (zero copy)", true, false, DType::F32, 0, false},
    /* CopyF32   */ {"fp32 (copy)", true, false, DType::F32, 32, false},
    /* F16       */ {"fp16", true, false, DType::F16, 16, false},
    /* BF16      */ {"bf16", true, false, DType::BF16, 16, false},
    /* BitmapF32 */ {"bitmap+fp32", true, true, DType::BitmapF32, 32, false},
    /* BitmapF16 */ {"bitmap+fp16", true, true, DType::BitmapF16, 16, false},
    /* BitmapI4  */ {"bitmap+int4", true, true, DType::BitmapI4, 4, true},
    /* BitmapU4  */ {"bitmap+uint4", true, true, DType::BitmapU4, 4, true},
    /* Mask      */ {"bits (mask)", false, true, DType::F32, 0, false},  // dtype unused: not read as a tensor
    /* Recomputed */ {"recomputed", true, false, DType::F32, 0, false},  // read through Stash::get only
};
static_assert(sizeof(kEncodings) / sizeof(kEncodings[0]) == size_t(StashEncoding::Recomputed) + 1);

using E = StashEncoding;
// Indexed by StashFormat.
const StashFormatInfo kFormats[] = {
    /* DenseF32  */ {"dense_fp32", E::ZeroCopy, E::ZeroCopy, E::Mask},
    /* DenseF16  */ {"dense_fp16", E::F16, E::F16, E::Mask},
    /* DenseBF16 */ {"dense_bf16", E::BF16, E::BF16, E::Mask},
    /* BitmapF32 */ {"bitmap_fp32", E::BitmapF32, E::BitmapF32, E::Mask},
    /* BitmapF16 */ {"bitmap_fp16", E::BitmapF16, E::BitmapF16, E::Mask},
    /* BitmapI4  */ {"bitmap_int4", E::BitmapI4, E::BitmapU4, E::Mask},  // the codes' signedness picks
    /* Auto      */ {"auto", E::BitmapF32, E::CopyF32, E::Mask},
};
constexpr size_t kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);
static_assert(kNumFormats == size_t(StashFormat::Auto) + 1);
}  // namespace

const StashEncodingInfo& stash_encoding_info(StashEncoding e) { return kEncodings[size_t(e)]; }

size_t stash_encoding_bytes(StashEncoding e, int64_t n, int64_t kept) {
  const StashEncodingInfo& info = stash_encoding_info(e);
  if (info.codes) return code_bitmap::encoded_bytes(n, kept);
  return (info.bitmap ? size_t(bitmap::num_words(n)) * 8 : 0) + (size_t(kept) * size_t(info.value_bits) + 7) / 8;
}

const StashFormatInfo& stash_format_info(StashFormat f) { return kFormats[size_t(f)]; }

const char* stash_format_name(StashFormat f) { return size_t(f) < kNumFormats ? kFormats[size_t(f)].name : "?"; }

bool parse_stash_format(const std::string& s, StashFormat* out) {
  for (size_t i = 0; i < kNumFormats; ++i)
    if (s == kFormats[i].name) {
      *out = StashFormat(i);
      return true;
    }
  return false;
}

std::string stash_format_names() {
  std::string out;
  for (const StashFormatInfo& f : kFormats) out += (out.empty() ? "" : ", ") + std::string(f.name);
  return out;
}

DTypeSet stash_format_dtypes(StashFormat f) {
  const StashFormatInfo& info = stash_format_info(f);
  return dtype_bit(stash_encoding_info(info.full).dtype) | dtype_bit(stash_encoding_info(info.full_alt).dtype);
}

DTypeSet stash_mask_dtypes() {
  DTypeSet s = 0;
  for (const StashEncodingInfo& e : kEncodings)
    if (e.every_element && (e.bitmap || e.dtype == DType::F32)) s |= dtype_bit(e.dtype);
  return s;
}

bool stash_format_has_bitmap(StashFormat f, bool full) {
  const StashFormatInfo& info = stash_format_info(f);
  if (!full) return stash_encoding_info(info.mask).bitmap;
  return stash_encoding_info(info.full).bitmap || stash_encoding_info(info.full_alt).bitmap;
}

size_t stash_worst_case_bytes(StashFormat f, int64_t n, bool full) {
  const StashFormatInfo& info = stash_format_info(f);
  if (!full) return stash_encoding_bytes(info.mask, n, n);
  return std::max(stash_encoding_bytes(info.full, n, n), stash_encoding_bytes(info.full_alt, n, n));
}

size_t stash_room_bytes(StashFormat f, int64_t n, bool full, int64_t room) {
  const StashFormatInfo& info = stash_format_info(f);
  // Dense encodings and masks take the same whatever is kept.
  if (room >= n || !full || !stash_encoding_info(info.full).bitmap) return stash_worst_case_bytes(f, n, full);
  const size_t kept = stash_encoding_bytes(info.full, n, room);
  if (info.full_alt == info.full || stash_encoding_info(info.full_alt).codes) return kept;
  return std::min(kept, stash_encoding_bytes(info.full_alt, n, n));  // auto: a denser value is copied
}

}  // namespace et
