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
// So a block of four vectors gives the four taps of 16 windows by two-source permutes, and the
// running first maximum picks the winners as pool_pairs.h does (the reference's order and
// compare). Every value equals the unfused layers': BN's apply is the one FMA of bn_rows::apply,
// the ReLU is max(z, +0) (z > 0 ? z : +0, NaN -> +0); backward, each element takes its window's
// dy where it won and its ReLU passed (the pool's gradient is +0 + dy at the winner), masked
// lanes are +0.
#pragma once
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "backends/cpu/pool_pairs.h"
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

// Index vectors for one Q (W = 2Q): element e of a 64-float block lies in row e / W, column e % W;
// its window is output (row / 2) * Q + column / 2 of the block's 16, its tap 2 (row % 2) + column % 2.
struct Layout {
  __m512i tap_index[4];  // tap k of output o: its element of the block, 0..63
  __m512i out_of[4];     // vector j, lane l: the output its element belongs to
  __m512i tap_of[4];     // and its tap
  explicit Layout(int64_t Q) {
    const int64_t W = 2 * Q;
    alignas(64) int32_t v[16];
    for (int k = 0; k < 4; ++k) {
      for (int o = 0; o < 16; ++o) v[o] = int32_t((2 * (o / Q) + k / 2) * W + 2 * (o % Q) + k % 2);
      tap_index[k] = _mm512_load_si512(v);
    }
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 16; ++l) {
        const int64_t e = 16 * j + l, row = e / W, col = e % W;
        v[l] = int32_t((row / 2) * Q + col / 2);
      }
      out_of[j] = _mm512_load_si512(v);
      for (int l = 0; l < 16; ++l) {
        const int64_t e = 16 * j + l, row = e / W, col = e % W;
        v[l] = int32_t(2 * (row % 2) + col % 2);
      }
      tap_of[j] = _mm512_load_si512(v);
    }
  }
};

inline __m512 relu(__m512 z) { return _mm512_maskz_max_ps(0xFFFF, z, _mm512_setzero_ps()); }  // z > 0 ? z : +0

// The four taps of the 16 windows of a 64-float block r (in element order): elements 0..31 come
// from r[0], r[1], 32..63 from r[2], r[3].
inline void taps(const Layout& L, const __m512 r[4], __m512 t[4]) {
  for (int k = 0; k < 4; ++k) {
    const __m512i e = L.tap_index[k];
    const __mmask16 high = _mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(32));
    t[k] = _mm512_mask_blend_ps(high, _mm512_permutex2var_ps(r[0], e, r[1]), _mm512_permutex2var_ps(r[2], e, r[3]));
  }
}

// dz of a block from its ReLU outputs r and g, the dy of its 16 windows: dy where the element won
// its window and its ReLU passed, else +0.
inline void block_dz(const Layout& L, const __m512 r[4], __m512 g, __m512 dz[4]) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 all = 0xFFFF;  // maskz forms: the plain ones make GCC 12 warn (pool_pairs.h)
  __m512 t[4];
  __m512i which;
  taps(L, r, t);
  pool_pairs::window_max(t, &which);
  for (int j = 0; j < 4; ++j) {
    const __m512i o = L.out_of[j];
    const __mmask16 won = _mm512_cmpeq_epi32_mask(_mm512_maskz_permutexvar_epi32(all, o, which), L.tap_of[j]) &
                          _mm512_cmp_ps_mask(r[j], zero, _CMP_GT_OQ);
    dz[j] = _mm512_maskz_add_ps(won, zero, _mm512_maskz_permutexvar_ps(all, o, g));
  }
}

// Forward over one plane of HW floats (a multiple of 64): y = pool(relu(x * scale + shift)), HW / 4
// floats; `stream`: by streaming stores (y 64-byte aligned).
inline void plane_forward(const Layout& L, const float* x, int64_t HW, float scale, float shift, float* y,
                          bool stream) {
  const __m512 vs = _mm512_set1_ps(scale), vt = _mm512_set1_ps(shift);
  for (int64_t i = 0; i < HW; i += 64) {
    __m512 r[4], t[4];
    __m512i which;
    for (int j = 0; j < 4; ++j) r[j] = relu(_mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16 * j), vs, vt));
    taps(L, r, t);
    const __m512 v = pool_pairs::window_max(t, &which);
    if (stream)
      _mm512_stream_ps(y + i / 4, v);
    else
      _mm512_storeu_ps(y + i / 4, v);
  }
}

// The same over a block of len floats (a multiple of 64) with BN's coefficients per element
// (block_apply's FMA).
inline void block_forward(const Layout& L, const float* x, const float* scale, const float* shift, int64_t len,
                          float* y) {
  for (int64_t i = 0; i < len; i += 64) {
    __m512 r[4], t[4];
    __m512i which;
    for (int j = 0; j < 4; ++j) {
      const int64_t e = i + 16 * j;
      r[j] = relu(_mm512_fmadd_ps(_mm512_loadu_ps(x + e), _mm512_loadu_ps(scale + e), _mm512_loadu_ps(shift + e)));
    }
    taps(L, r, t);
    _mm512_storeu_ps(y + i / 4, pool_pairs::window_max(t, &which));
  }
}

// dz over a block of len floats (a multiple of 64) from x and dy (len / 4 floats), BN recomputed
// with its coefficients per element.
inline void block_backward_dz(const Layout& L, const float* x, const float* scale, const float* shift,
                              const float* dy, int64_t len, float* dz) {
  for (int64_t i = 0; i < len; i += 64) {
    __m512 r[4], d[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t e = i + 16 * j;
      r[j] = relu(_mm512_fmadd_ps(_mm512_loadu_ps(x + e), _mm512_loadu_ps(scale + e), _mm512_loadu_ps(shift + e)));
    }
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
      : L_(&layout), x_(x), dy_(dy), scale_(_mm512_set1_ps(scale)), shift_(_mm512_set1_ps(shift)) {}

  __m512 operator()(int64_t i, __mmask16) {
    const int64_t j = (i >> 4) & 3;
    if (j == 0) block(i);
    return dz_[j];
  }

 private:
  void block(int64_t i) {
    __m512 r[4];
    for (int j = 0; j < 4; ++j) r[j] = relu(_mm512_fmadd_ps(_mm512_loadu_ps(x_ + i + 16 * j), scale_, shift_));
    block_dz(*L_, r, _mm512_loadu_ps(dy_ + i / 4), dz_);
  }

  const Layout* L_;
  const float *x_, *dy_;
  __m512 scale_, shift_;
  __m512 dz_[4];
};

}  // namespace fused_bn_relu_pool
}  // namespace et
#endif
