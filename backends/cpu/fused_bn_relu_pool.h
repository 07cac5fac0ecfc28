// A fused BN -> ReLU -> 2x2 max-pool stack (every pooled stack of VGG-16-BN) in registers, forward
// and backward. Stage by stage, a plane goes through scratch three times (BN apply, ReLU, pool), and
// backward rebuilds it so again, with a zeroed gradient, the pool's scatter and the ReLU mask, and
// sweep 1 parks dz in dx: a full-size write and read-back that an in-place dx does not save here,
// since dy is a quarter of dx. Here the forward goes from x to y in registers, and both backward
// sweeps rebuild dz (the gradient of the BN output) from x (read anyway) and dy, as the
// element-wise stacks build theirs (fused.cpp, elementwise_dz); nothing is parked.
//
// Where the windows tile the plane (stride 2, H = 2P, W = 2Q) and Q is 4, 8 or 16, the 64 floats
// from any multiple of 64 in a plane are exactly the windows of 16 consecutive outputs:
//   Q = 16: one output row (two input rows of 32); Q = 8: two (four rows of 16); Q = 4: four
//   (eight rows of 8).
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

// Whether stack s is BN -> ReLU -> 2x2 stride-2 max-pool on planes this layout covers.
inline bool applies(const FusedStack& s) {
  if (s.stages.size() != 3 || s.stages[1].kind != FusedKind::Relu || s.stages[2].kind != FusedKind::MaxPool)
    return false;
  const FusedStage& p = s.stages[2];
  const PoolWindow& w = p.pool;
  return w.R == 2 && w.S == 2 && w.stride_h == 2 && w.stride_w == 2 && w.pad_h == 0 && w.pad_w == 0 &&
         p.H == 2 * p.P && p.W == 2 * p.Q && (p.Q == 4 || p.Q == 8 || p.Q == 16) && (p.P * p.Q) % 16 == 0;
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

// The 64 floats of x from x0 through BN's apply and the ReLU (r, in element order) and as the four
// taps of their 16 windows (t).
inline void relu_taps(const Layout& L, const float* x0, __m512 scale, __m512 shift, __m512 r[4], __m512 t[4]) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 all = 0xFFFF;  // maskz forms: the plain ones make GCC 12 warn (pool_pairs.h)
  for (int j = 0; j < 4; ++j) r[j] = _mm512_maskz_max_ps(all, _mm512_fmadd_ps(_mm512_loadu_ps(x0 + 16 * j), scale, shift), zero);
  for (int k = 0; k < 4; ++k) {  // elements 0..31 from r[0], r[1]; 32..63 from r[2], r[3]
    const __m512i e = L.tap_index[k];
    const __mmask16 high = _mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(32));
    t[k] = _mm512_mask_blend_ps(high, _mm512_permutex2var_ps(r[0], e, r[1]), _mm512_permutex2var_ps(r[2], e, r[3]));
  }
}

// Forward over one plane of HW floats (a multiple of 64): y = pool(relu(x * scale + shift)), HW / 4
// floats.
inline void plane_forward(const Layout& L, const float* x, int64_t HW, float scale, float shift, float* y) {
  const __m512 vs = _mm512_set1_ps(scale), vt = _mm512_set1_ps(shift);
  for (int64_t i = 0; i < HW; i += 64) {
    __m512 r[4], t[4];
    __m512i which;
    relu_taps(L, x + i, vs, vt, r, t);
    _mm512_storeu_ps(y + i / 4, pool_pairs::window_max(t, &which));
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
    const __m512 zero = _mm512_setzero_ps();
    const __mmask16 all = 0xFFFF;
    __m512 r[4], t[4];
    relu_taps(*L_, x_ + i, scale_, shift_, r, t);
    __m512i which;
    pool_pairs::window_max(t, &which);
    const __m512 g = _mm512_loadu_ps(dy_ + i / 4);
    for (int j = 0; j < 4; ++j) {
      const __m512i o = L_->out_of[j];
      const __mmask16 won = _mm512_cmpeq_epi32_mask(_mm512_maskz_permutexvar_epi32(all, o, which), L_->tap_of[j]) &
                            _mm512_cmp_ps_mask(r[j], zero, _CMP_GT_OQ);
      dz_[j] = _mm512_maskz_add_ps(won, zero, _mm512_maskz_permutexvar_ps(all, o, g));
    }
  }

  const Layout* L_;
  const float *x_, *dy_;
  __m512 scale_, shift_;
  __m512 dz_[4];
};

}  // namespace fused_bn_relu_pool
}  // namespace et
#endif
