// ET_ALWAYS_INLINE: for the lambdas and functors a kernel's loop calls once per vector (every 8 or
// 16 floats). GCC 12 compiled some of them out of line on AVX-512: a call, the captured state
// reloaded from memory and a store-forwarding stall per vector, which made ResNet-20's fused
// backward twice as slow (docs/fusion-log.md, session 36). Clang and GCC both honour the attribute.
#pragma once

#define ET_ALWAYS_INLINE __attribute__((always_inline))

// ET_NOINLINE: a register-blocked accumulation loop kept out of line where vectors are narrow
// (conv_simd.h, kNarrowVectors): inlined beside its epilogue's branches, GCC 12 for aarch64 kept the
// accumulators in memory too and stored all of them on every step of the loop.
#define ET_NOINLINE __attribute__((noinline))
