// A fused BN -> ReLU -> 2x2 max-pool stack (every pooled stack of VGG-16-BN) in registers, forward
// and backward. Stage by stage, a plane goes through scratch three times (BN apply, ReLU, pool), and
// backward rebuilds it so again, with a zeroed gradient, the pool's scatter and the ReLU mask, and
// sweep 1 parks dz in dx: a full-size write and read-back that an in-place dx does not save here,
// since dy is a quarter of dx. Here the forward goes from x to y in registers, and both backward
// sweeps rebuild dz (the gradient of the BN output) from x (read anyway) and dy, as the
// element-wise stacks build theirs (fused.cpp, elementwise_dz); nothing is parked.
//
// Where the windows tile the plane (stride 2, H = 2P, W = 2Q) and Q is 1, 2, 4, 8 or 16, the 64
// floats from any multiple of 64 in a plane are exactly the windows of 16 consecutive outputs:
//   Q = 16: one output row (two input rows of 32); Q = 8: two (four rows of 16); Q = 4: four
//   (eight rows of 8); Q = 2 and 1 (4x4 and 2x2 planes): a block of 4 or 16 planes, pooled as one
//   tall plane by the small-plane stacks (fused_blocks.cpp), which keep BN's coefficients per element.
// Each element finds its window's other three in registers (the next or previous lane; another
// vector or lanes 8, 4 or 2 away), so every lane gets its window's maximum by two max_ps: the
// forward keeps one lane per window, the backward the first lane equal to it. Every value equals
// the unfused layers': BN's apply is the one FMA of bn_rows::apply, the ReLU is max(z, +0) (z > 0 ?
// z : +0, NaN -> +0), and after it no value is NaN or -0, so the window's maximum and its first
// maximum in the reference's (r, s) order are found alike; backward, an element takes its window's
// dy where it won and its ReLU passed (the pool's gradient is +0 + dy at the winner), else +0.
#pragma once
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "engine/fused_stack.h"

namespace et {
namespace fused_bn_relu_pool {

// Whether stack s is BN -> ReLU -> 2x2 stride-2 max-pool whose windows tile its planes (H = 2P,
// W = 2Q) with Q of 1, 2, 4, 8 or 16: then 64 floats from any multiple of 64 of a plane, or of a
// block of consecutive planes (as one tall plane: no window crosses two), are 16 whole windows.
inline bool is_bn_relu_pool2(const FusedStack& s) {
  if (s.stages.size() != 3 || s.stages[1].kind != FusedKind::Relu || s.stages[2].kind != FusedKind::MaxPool)
    return false;
  const FusedStage& p = s.stages[2];
  const PoolWindow& w = p.pool;
  return w.R == 2 && w.S == 2 && w.stride_h == 2 && w.stride_w == 2 && w.pad_h == 0 && w.pad_w == 0 &&
         p.H == 2 * p.P && p.W == 2 * p.Q && (p.Q == 1 || p.Q == 2 || p.Q == 4 || p.Q == 8 || p.Q == 16);
}

// Plane by plane (fused.cpp): every plane a whole number of 64-float blocks.
inline bool applies(const FusedStack& s) { return is_bn_relu_pool2(s) && (s.last().P * s.last().Q) % 16 == 0; }

// By channel blocks of `tile` planes (fused_blocks.cpp): every block, the last one too.
inline bool applies_to_blocks(const FusedStack& s, int64_t tile) {
  const int64_t HW = s.stages[0].H * s.stages[0].W;
  return is_bn_relu_pool2(s) && (tile * HW) % 64 == 0 && ((s.C % tile) * HW) % 64 == 0;
}

// One Q's geometry (W = 2Q): element e of a 64-float block lies in row e / W, column e % W; its
// window is output (row / 2) * Q + column / 2 of the block's 16, its tap 2 (row % 2) + column % 2.
// An element's partners in its window: the other column (the next or previous lane, W being even),
// the other row (another vector for Q of 16 and 8, the same vector 8, 4 or 2 lanes away for Q of
// 4, 2 and 1), and the diagonal one (the other row's other column).
struct Layout {
  int64_t Q;
  __m512i top_left;         // output o: its window's first element in the block, 0..63
  __m512i out_of[4];        // vector j, lane l: the output its element belongs to
  __mmask16 second_row[4];  // vector j: the lanes in their window's second row
  explicit Layout(int64_t q) : Q(q) {
    const int64_t W = 2 * Q;
    alignas(64) int32_t v[16];
    for (int o = 0; o < 16; ++o) v[o] = int32_t(2 * (o / Q) * W + 2 * (o % Q));
    top_left = _mm512_load_si512(v);
    for (int j = 0; j < 4; ++j) {
      second_row[j] = 0;
      for (int l = 0; l < 16; ++l) {
        const int64_t e = 16 * j + l, row = e / W, col = e % W;
        v[l] = int32_t((row / 2) * Q + col / 2);
        if (row % 2) second_row[j] = __mmask16(second_row[j] | (1u << l));
      }
      out_of[j] = _mm512_load_si512(v);
    }
  }
};

inline __m512 relu(__m512 z) { return _mm512_maskz_max_ps(0xFFFF, z, _mm512_setzero_ps()); }  // z > 0 ? z : +0

// Each lane's element of the other column of its window (lanes 2i and 2i + 1 swapped).
inline __m512 other_column(__m512 r) { return _mm512_maskz_permute_ps(0xFFFF, r, 0xB1); }

// v[j]: each lane's element of the other row of its window.
inline void other_rows(const Layout& L, const __m512 r[4], __m512 v[4]) {
  for (int j = 0; j < 4; ++j) {
    switch (L.Q) {
      case 16: v[j] = r[j ^ 2]; break;                                // rows of 32: vectors 0, 1 over 2, 3
      case 8: v[j] = r[j ^ 1]; break;                                 // rows of 16: a vector each
      case 4: v[j] = _mm512_maskz_shuffle_f32x4(0xFFFF, r[j], r[j], 0x4E); break;   // rows of 8: lanes 8 apart
      case 2: v[j] = _mm512_maskz_shuffle_f32x4(0xFFFF, r[j], r[j], 0xB1); break;   // rows of 4: lanes 4 apart
      default: v[j] = _mm512_maskz_permute_ps(0xFFFF, r[j], 0x4E); break;           // rows of 2: lanes 2 apart
    }
  }
}

// m[j]: in every lane, the maximum of its element's window. The values are all >= +0 and never
// NaN, so the maximum is one value whatever the order of comparison (the reference's running
// first maximum finds the same), and max_ps returns it.
inline void lane_maxima(const Layout& L, const __m512 r[4], __m512 m[4]) {
  const __mmask16 all = 0xFFFF;  // maskz forms: the plain ones make GCC 12 warn of an uninitialised operand
  __m512 v[4];
  other_rows(L, r, v);
  for (int j = 0; j < 4; ++j) {
    m[j] = _mm512_maskz_max_ps(all, r[j], v[j]);
    m[j] = _mm512_maskz_max_ps(all, m[j], other_column(m[j]));
  }
}

// The forward's 16 outputs from a block of ReLU outputs r: the window maxima.
inline __m512 window_maxima(const Layout& L, const __m512 r[4]) {
  __m512 m[4];
  lane_maxima(L, r, m);
  const __m512i e = L.top_left;  // elements 0..31 in m[0], m[1]; 32..63 in m[2], m[3]
  const __mmask16 high = _mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(32));
  return _mm512_mask_blend_ps(high, _mm512_permutex2var_ps(m[0], e, m[1]), _mm512_permutex2var_ps(m[2], e, m[3]));
}

// The lanes of vector j's other-row partners, from the bits of all four vectors.
inline uint32_t other_row_bits(const Layout& L, const uint32_t e[4], int j) {
  const uint32_t b = e[j];
  switch (L.Q) {
    case 16: return e[j ^ 2];
    case 8: return e[j ^ 1];
    case 4: return ((b << 8) | (b >> 8)) & 0xFFFFu;
    case 2: return ((b << 4) & 0xF0F0u) | ((b >> 4) & 0x0F0Fu);
    default: return ((b << 2) & 0xCCCCu) | ((b >> 2) & 0x3333u);
  }
}

// dz of a block from its ReLU outputs r and g, the dy of its 16 windows: dy where the element won
// its window and its ReLU passed, else +0. The reference's winner is the first maximum in tap
// order (r, s); with values >= +0 and no NaN that is the first element equal to the window's
// maximum. So: the lanes equal to it (and > 0: where the maximum is +0 no ReLU passed), less odd
// columns whose even neighbour is equal too, less second rows where the first row has one; a few
// integer operations on the 16-bit lane masks.
inline void block_dz(const Layout& L, const __m512 r[4], __m512 g, __m512 dz[4]) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 all = 0xFFFF;
  __m512 m[4];
  lane_maxima(L, r, m);
  uint32_t eq[4];
  for (int j = 0; j < 4; ++j)
    eq[j] = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(r[j], zero, _CMP_GT_OQ), r[j], m[j], _CMP_EQ_OQ);
  for (int j = 0; j < 4; ++j) {
    const uint32_t e = eq[j], row = other_row_bits(L, eq, j);
    uint32_t either = (row | (row >> 1)) & 0x5555u;  // the other row holds one, in either column
    either |= either << 1;
    const uint32_t won = e & ~((e << 1) & 0xAAAAu) & ~(either & L.second_row[j]);
    dz[j] = _mm512_maskz_add_ps(__mmask16(won), zero, _mm512_maskz_permutexvar_ps(all, L.out_of[j], g));
  }
}

// BN's apply (bn_rows::apply's FMA) on 16 elements from element e: with one channel's coefficients
// (a plane, fused.cpp), or with coefficients per element (a block of planes, fused_blocks.cpp).
struct ChannelBn {
  __m512 scale, shift;
  ChannelBn(float sc, float sh) : scale(_mm512_set1_ps(sc)), shift(_mm512_set1_ps(sh)) {}
  __m512 operator()(__m512 x, int64_t) const { return _mm512_fmadd_ps(x, scale, shift); }
};
struct ElementBn {
  const float *scale, *shift;
  __m512 operator()(__m512 x, int64_t e) const {
    return _mm512_fmadd_ps(x, _mm512_loadu_ps(scale + e), _mm512_loadu_ps(shift + e));
  }
};

// r: the block of 64 floats from element i through BN and the ReLU.
template <class Bn>
inline void relu_block(const float* x, int64_t i, const Bn& bn, __m512 r[4]) {
  for (int j = 0; j < 4; ++j) r[j] = relu(bn(_mm512_loadu_ps(x + i + 16 * j), i + 16 * j));
}

// Forward over len floats (a multiple of 64): y = pool(relu(bn(x))), len / 4 floats; `stream`: by
// streaming stores (y 64-byte aligned).
template <class Bn>
inline void forward(const Layout& L, const float* x, const Bn& bn, int64_t len, float* y, bool stream) {
  for (int64_t i = 0; i < len; i += 64) {
    __m512 r[4];
    relu_block(x, i, bn, r);
    const __m512 v = window_maxima(L, r);
    if (stream)
      _mm512_stream_ps(y + i / 4, v);
    else
      _mm512_storeu_ps(y + i / 4, v);
  }
}

// dz over len floats (a multiple of 64) from x and dy (len / 4 floats), BN and the ReLU recomputed.
template <class Bn>
inline void backward_dz(const Layout& L, const float* x, const Bn& bn, const float* dy, int64_t len, float* dz) {
  for (int64_t i = 0; i < len; i += 64) {
    __m512 r[4], d[4];
    relu_block(x, i, bn, r);
    block_dz(L, r, _mm512_loadu_ps(dy + i / 4), d);
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(dz + i + 16 * j, d[j]);
  }
}

// d(i, m) for bn_rows::grad_sums / grad_apply_d over one plane: called with i = 0, 16, 32, ... in
// turn (whole vectors only: H * W is a multiple of 64), it builds each block's four vectors of dz
// at the block's first and hands them out in order.
class PlaneDz {
 public:
  PlaneDz(const Layout& layout, const float* x, const float* dy, float scale, float shift)
      : L_(&layout), x_(x), dy_(dy), bn_(scale, shift) {}

  __m512 operator()(int64_t i, __mmask16) {
    const int64_t j = (i >> 4) & 3;
    if (j == 0) {
      __m512 r[4];
      relu_block(x_, i, bn_, r);
      block_dz(*L_, r, _mm512_loadu_ps(dy_ + i / 4), dz_);
    }
    return dz_[j];
  }

 private:
  const Layout* L_;
  const float *x_, *dy_;
  ChannelBn bn_;
  __m512 dz_[4];
};

}  // namespace fused_bn_relu_pool
}  // namespace et
#endif
