// The CUDA backend's stash codec (memory/stash_codec.h): the BitTrain bitmap, its packed non-zeros,
// bitmap_int4's code bitmap (memory/code_bitmap.h) and the fp16 / bf16 conversions in device
// memory, byte for byte the host codec's encodings
// (memory/bitmap.h: bit i of word i / 64, the same keep rule on the integer bits; half.h: the same
// rounding and NaN rule). Bitmaps come from warp ballots, value offsets from per-chunk popcounts
// and an exclusive scan. C++14.
#pragma once
#include <memory>

#include "memory/stash_codec.h"

struct CUstream_st;  // cudaStream_t without the runtime header

namespace et {

// For GPU `device`, its kernels on `stream` (a cudaStream_t; nullptr: the legacy default stream);
// its scratch (chunk counts and offsets) grows on first use and is then reused. UserError naming
// the device if it does not exist.
std::unique_ptr<StashCodec> make_cuda_stash_codec(int device, CUstream_st* stream = nullptr);

}  // namespace et
