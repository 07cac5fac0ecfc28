// What the fused-stack kernels share (fused.cpp: stacks headed by a BN; fused_relu_pool.cpp:
// a ReLU and a pool): the per-thread plane scratch, prefetching of the next plane, and y's bitmap
// words written in the stash's own layout.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "engine/fused_stack.h"

namespace et {
namespace fused_planes {

constexpr int64_t kMaxStages = 8;

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // 64-byte multiples of floats

inline int64_t max_plane(const FusedStack& s) {
  int64_t m = 0;
  for (const FusedStage& st : s.stages) m = std::max({m, st.H * st.W, st.P * st.Q});
  return round16(m);
}

// Per thread: one plane per stage output and two gradient planes.
inline int64_t thread_floats(const FusedStack& s) { return max_plane(s) * int64_t(s.stages.size() + 2); }

// Small planes (fused_blocks.cpp), per thread: a block (tile_channels planes) per stage output and
// two gradient blocks, five per-element coefficient arrays, four per-channel floats and two
// per-channel doubles.
inline int64_t block_thread_floats(const FusedStack& s) {
  int64_t plane = 0;
  for (const FusedStage& st : s.stages) plane = std::max({plane, st.H * st.W, st.P * st.Q});
  const int64_t T = s.tile_channels, HW = s.stages[0].H * s.stages[0].W;
  return round16(T * plane * int64_t(s.stages.size() + 2)) + round16(5 * T * HW) + round16(4 * T) + round16(4 * T);
}

// The planes of one channel lie C planes apart, and a CIFAR plane is one 4 KiB page, where the
// hardware prefetcher stops. Touching the first lines of the next plane early starts the
// prefetcher on its page; more than a few lines per stream would stall on the fill buffers.
constexpr int64_t kPrefetchFloats = 256;
inline void prefetch_plane(const float* p, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kPrefetchFloats); i += 16) __builtin_prefetch(p + i);
}
inline void prefetch_plane_for_write(float* p, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kPrefetchFloats); i += 16) __builtin_prefetch(p + i, 1);
}

// The stack's output is >= +0 (a ReLU, then only pools): the bitmap keep rule applies to it.
inline bool output_nonnegative(const FusedStack& s) {
  bool nonneg = false;
  for (size_t k = 1; k < s.stages.size(); ++k) {
    const FusedKind kind = s.stages[k].kind;
    nonneg = kind == FusedKind::Relu || (nonneg && (kind == FusedKind::MaxPool || kind == FusedKind::AvgPool));
  }
  return nonneg;
}

// Whether the backward rebuilds the stages' values from x: for a ReLU's mask or a max-pool's input.
// A last ReLU reads y's saved mask, unless x is exact and no Add precedes it (recomputing its mask
// from x, read anyway, saves reading the mask).
inline bool needs_recompute(const FusedStack& s, bool x_exact) {
  const bool has_add = s.add_stage() >= 0;
  for (size_t k = 1; k < s.stages.size(); ++k) {
    const FusedKind kind = s.stages[k].kind;
    if (kind == FusedKind::MaxPool) return true;
    if (kind == FusedKind::Relu && (k + 1 < s.stages.size() || !s.saves_output_mask || (x_exact && !has_add)))
      return true;
  }
  return false;
}

// y's bitmap words [w0, w1) with the stash's keep rule (y >= +0 by construction here, so it is one
// unsigned compare, as in relu_forward). Returns the set bits.
inline int64_t mask_words(const float* y, int64_t w0, int64_t w1, uint32_t tb, uint64_t* bits) {
  int64_t kept = 0;
  for (int64_t w = w0; w < w1; ++w) {
    uint64_t m = 0;
    const float* v = y + w * 64;
#if defined(__AVX512F__)
    const __m512i thr = _mm512_set1_epi32(int32_t(tb));
    for (int j = 0; j < 4; ++j)
      m |= uint64_t(_mm512_cmpge_epu32_mask(_mm512_castps_si512(_mm512_loadu_ps(v + 16 * j)), thr)) << (16 * j);
    bits[w] = m;
    kept += __builtin_popcountll(m);
    continue;
#endif
    for (int t = 0; t < 64; ++t) {
      uint32_t u;
      std::memcpy(&u, v + t, 4);
      m |= uint64_t(u >= tb) << t;
    }
    bits[w] = m;
    kept += __builtin_popcountll(m);
  }
  return kept;
}

}  // namespace fused_planes
}  // namespace et
