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

#include "backends/cpu/always_inline.h"
#include "backends/cpu/lanes16.h"
#include "backends/cpu/pool_pairs.h"
#include "engine/fused_stack.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define ET_POOL_IN_REGISTERS 1
#elif defined(ET_LANES16)
#define ET_POOL_IN_REGISTERS 1  // on lanes16.h's 16 lanes: the section after the AVX-512 one
#endif

#if defined(ET_POOL_IN_REGISTERS)
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

// The lanes of vector j's other-row partners (Layout, below), from the bits of all four vectors.
inline uint32_t other_row_bits(int64_t Q, const uint32_t e[4], int j) {
  const uint32_t b = e[j];
  switch (Q) {
    case 16: return e[j ^ 2];
    case 8: return e[j ^ 1];
    case 4: return ((b << 8) | (b >> 8)) & 0xFFFFu;
    case 2: return ((b << 4) & 0xF0F0u) | ((b >> 4) & 0x0F0Fu);
    default: return ((b << 2) & 0xCCCCu) | ((b >> 2) & 0x3333u);
  }
}

// The lanes of vector j that won their window (block_dz, below), from eq[k]: the lanes of vector k
// equal to their window's maximum and > 0. The reference's winner is the first maximum in tap order
// (r, s): so eq[j], less odd columns whose even neighbour is equal too, less second rows
// (second_row: vector j's lanes in their window's second row) where the first row has one.
inline uint32_t won_lanes(int64_t Q, const uint32_t eq[4], int j, uint32_t second_row) {
  const uint32_t e = eq[j], row = other_row_bits(Q, eq, j);
  uint32_t either = (row | (row >> 1)) & 0x5555u;  // the other row holds one, in either column
  either |= either << 1;
  return e & ~((e << 1) & 0xAAAAu) & ~(either & second_row);
}

// One Q's geometry (W = 2Q): element e of a 64-float block lies in row e / W, column e % W; its
// window is output (row / 2) * Q + column / 2 of the block's 16, its tap 2 (row % 2) + column % 2.
// An element's partners in its window: the other column (the next or previous lane, W being even),
// the other row (another vector for Q of 16 and 8, the same vector 8, 4 or 2 lanes away for Q of
// 4, 2 and 1), and the diagonal one (the other row's other column).
inline int32_t output_of(int64_t Q, int64_t e) { return int32_t((e / (2 * Q) / 2) * Q + (e % (2 * Q)) / 2); }
inline int32_t top_left_of(int64_t Q, int64_t o) { return int32_t(4 * (o / Q) * Q + 2 * (o % Q)); }
inline uint32_t second_row_lanes(int64_t Q, int j) {  // vector j's lanes in their window's second row
  uint32_t bits = 0;
  for (int l = 0; l < 16; ++l) bits |= uint32_t((16 * j + l) / (2 * Q) % 2) << l;
  return bits;
}

#if defined(__AVX512F__)
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
    const uint32_t won = won_lanes(L.Q, eq, j, L.second_row[j]);
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

  ET_ALWAYS_INLINE __m512 operator()(int64_t i, __mmask16) {
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

#else  // ET_LANES16: AVX2 (two ymm) and aarch64 NEON (four q registers)
// The AVX-512 kernels above on lanes16.h's 16 lanes, with the same arithmetic (BN's one FMA,
// max(z, +0), the pool's +0 + dy at the winner) and the same winners, so the same bits. What
// AVX-512 does with one permute across a 64-float block goes by shuffles within a register
// (AVX2's compaction to the window maxima) or by fixed index tables built in the Layout (AVX2's
// vpermps within 8 floats, NEON's byte table lookups over 16 or 8 floats).
using lanes16::Full;
using lanes16::Lanes16;

struct Layout {
  int64_t Q;
  uint32_t second_row[4];  // vector j: the lanes in their window's second row
#if defined(__AVX2__)
  __m256i expand_idx[8];  // elements 8h .. 8h + 7: their outputs, lanes of g's half expand_half[h]
  int expand_half[8];
#else
  uint8x16_t compact_idx[4];  // outputs 4k .. 4k + 3: their windows' first elements, bytes of vector compact_src[k]
  int compact_src[4];
  uint8x16_t expand_idx[16];  // elements 4h .. 4h + 3: their outputs, bytes of g's half expand_half[h]
  int expand_half[16];
#endif
  explicit Layout(int64_t q) : Q(q) {
    for (int j = 0; j < 4; ++j) second_row[j] = second_row_lanes(Q, j);
    // Every run of 8 elements from a multiple of 8 belongs to outputs of one half of g (its rows
    // are whole output rows of Q >= 4 floats, or lie within two output rows of 2 or 1).
#if defined(__AVX2__)
    for (int h = 0; h < 8; ++h) {
      alignas(32) int32_t v[8];
      expand_half[h] = output_of(Q, 8 * h) / 8;
      for (int l = 0; l < 8; ++l) v[l] = output_of(Q, 8 * h + l) - 8 * expand_half[h];
      expand_idx[h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(v));
    }
#else
    auto bytes_of = [](const int32_t f[4]) {  // float lanes f[l] as byte indices
      alignas(16) uint8_t b[16];
      for (int l = 0; l < 4; ++l)
        for (int k = 0; k < 4; ++k) b[4 * l + k] = uint8_t(4 * f[l] + k);
      return vld1q_u8(b);
    };
    for (int k = 0; k < 4; ++k) {  // the 4 windows of outputs 4k .. 4k + 3 start in one vector
      int32_t f[4];
      compact_src[k] = top_left_of(Q, 4 * k) / 16;
      for (int l = 0; l < 4; ++l) f[l] = top_left_of(Q, 4 * k + l) - 16 * compact_src[k];
      compact_idx[k] = bytes_of(f);
    }
    for (int h = 0; h < 16; ++h) {
      int32_t f[4];
      expand_half[h] = output_of(Q, 4 * h) / 8;
      for (int l = 0; l < 4; ++l) f[l] = output_of(Q, 4 * h + l) - 8 * expand_half[h];
      expand_idx[h] = bytes_of(f);
    }
#endif
  }
};

#if defined(__AVX2__)
inline Lanes16 lane_max(const Lanes16& a, const Lanes16& b) {  // values without NaN
  return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}
inline Lanes16 other_column(const Lanes16& r) { return {_mm256_permute_ps(r.lo, 0xB1), _mm256_permute_ps(r.hi, 0xB1)}; }
inline Lanes16 lanes_apart(const Lanes16& r, int64_t d) {  // lane l's partner d lanes away (d = 8, 4, 2)
  if (d == 8) return {r.hi, r.lo};
  if (d == 4) return {_mm256_permute2f128_ps(r.lo, r.lo, 0x01), _mm256_permute2f128_ps(r.hi, r.hi, 0x01)};
  return {_mm256_permute_ps(r.lo, 0x4E), _mm256_permute_ps(r.hi, 0x4E)};
}
// The lanes of r that are > 0 and equal to m, as 16 bits.
inline uint32_t positive_equal_bits(const Lanes16& r, const Lanes16& m) {
  const __m256 zero = _mm256_setzero_ps();
  auto half = [&](__m256 a, __m256 b) {
    const __m256 on = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
    return uint32_t(_mm256_movemask_ps(on));
  };
  return half(r.lo, m.lo) | half(r.hi, m.hi) << 8;
}
using pool_pairs::evens8;  // a's lanes 0, 2, 4, 6, then b's (pool_pairs.h)
inline __m256 pairs8(__m256 a, __m256 b) {  // a's lanes 0, 1, 4, 5, then b's
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x44)), 0xD8));
}
// The outputs' lanes from m, each lane its window's maximum: the even lanes of the block (c, 32
// floats in rows of Q), then c's even rows.
inline Lanes16 window_lanes(const Layout& L, const Lanes16 m[4]) {
  const Lanes16 c0{evens8(m[0].lo, m[0].hi), evens8(m[1].lo, m[1].hi)};
  const Lanes16 c1{evens8(m[2].lo, m[2].hi), evens8(m[3].lo, m[3].hi)};
  switch (L.Q) {
    case 16: return c0;                                             // rows of 16: row 0
    case 8: return {c0.lo, c1.lo};                                  // rows of 8: rows 0, 2
    case 4:                                                         // rows of 4: 0, 2, 4, 6
      return {_mm256_permute2f128_ps(c0.lo, c0.hi, 0x20), _mm256_permute2f128_ps(c1.lo, c1.hi, 0x20)};
    case 2: return {pairs8(c0.lo, c0.hi), pairs8(c1.lo, c1.hi)};    // rows of 2
    default: return {evens8(c0.lo, c0.hi), evens8(c1.lo, c1.hi)};  // rows of 1
  }
}
// Vector j of the block: each lane g's value of its element's output.
inline Lanes16 expand(const Layout& L, const Lanes16& g, int j) {
  auto part = [&](int h) { return _mm256_permutevar8x32_ps(L.expand_half[h] ? g.hi : g.lo, L.expand_idx[h]); };
  return {part(2 * j), part(2 * j + 1)};
}
#else
inline Lanes16 lane_max(const Lanes16& a, const Lanes16& b) {  // values without NaN
  Lanes16 r;
  for (int k = 0; k < 4; ++k) r.q[k] = vmaxq_f32(a.q[k], b.q[k]);
  return r;
}
inline Lanes16 other_column(const Lanes16& r) {
  Lanes16 v;
  for (int k = 0; k < 4; ++k) v.q[k] = vrev64q_f32(r.q[k]);
  return v;
}
inline Lanes16 lanes_apart(const Lanes16& r, int64_t d) {  // lane l's partner d lanes away (d = 8, 4, 2)
  if (d == 8) return {{r.q[2], r.q[3], r.q[0], r.q[1]}};
  if (d == 4) return {{r.q[1], r.q[0], r.q[3], r.q[2]}};
  Lanes16 v;
  for (int k = 0; k < 4; ++k) v.q[k] = vextq_f32(r.q[k], r.q[k], 2);
  return v;
}
inline uint32_t positive_equal_bits(const Lanes16& r, const Lanes16& m) {
  const uint32_t base[4] = {1, 2, 4, 8};
  const uint32x4_t sel = vld1q_u32(base);
  uint32_t bits = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32x4_t on = vandq_u32(vcgtq_f32(r.q[k], vdupq_n_f32(0.f)), vceqq_f32(r.q[k], m.q[k]));
    bits |= vaddvq_u32(vandq_u32(on, sel)) << (4 * k);
  }
  return bits;
}
inline uint8x16x4_t bytes_of(const Lanes16& v) {
  return {{vreinterpretq_u8_f32(v.q[0]), vreinterpretq_u8_f32(v.q[1]), vreinterpretq_u8_f32(v.q[2]),
           vreinterpretq_u8_f32(v.q[3])}};
}
inline Lanes16 window_lanes(const Layout& L, const Lanes16 m[4]) {
  Lanes16 y;
  for (int k = 0; k < 4; ++k)
    y.q[k] = vreinterpretq_f32_u8(vqtbl4q_u8(bytes_of(m[L.compact_src[k]]), L.compact_idx[k]));
  return y;
}
inline Lanes16 expand(const Layout& L, const Lanes16& g, int j) {
  Lanes16 v;
  for (int k = 0; k < 4; ++k) {
    const int h = 4 * j + k, half = L.expand_half[h];
    const uint8x16x2_t t = {{vreinterpretq_u8_f32(g.q[2 * half]), vreinterpretq_u8_f32(g.q[2 * half + 1])}};
    v.q[k] = vreinterpretq_f32_u8(vqtbl2q_u8(t, L.expand_idx[h]));
  }
  return v;
}
#endif

// m[j]: in every lane, the maximum of its element's window (values >= +0, no NaN: one value
// whatever the order of comparison, as on AVX-512).
inline void lane_maxima(const Layout& L, const Lanes16 r[4], Lanes16 m[4]) {
  for (int j = 0; j < 4; ++j) {
    const Lanes16 other_row =
        L.Q == 16 ? r[j ^ 2] : L.Q == 8 ? r[j ^ 1] : lanes_apart(r[j], L.Q == 4 ? 8 : L.Q == 2 ? 4 : 2);
    m[j] = lane_max(r[j], other_row);
    m[j] = lane_max(m[j], other_column(m[j]));
  }
}

inline Lanes16 window_maxima(const Layout& L, const Lanes16 r[4]) {
  Lanes16 m[4];
  lane_maxima(L, r, m);
  return window_lanes(L, m);
}

// As the AVX-512 block_dz: +0 + dy where the element won its window and its ReLU passed, else +0.
inline void block_dz(const Layout& L, const Lanes16 r[4], const Lanes16& g, Lanes16 dz[4]) {
  Lanes16 m[4];
  lane_maxima(L, r, m);
  uint32_t eq[4];
  for (int j = 0; j < 4; ++j) eq[j] = positive_equal_bits(r[j], m[j]);
  const Lanes16 g0 = lanes16::add16(lanes16::splat16(0.f), g);
  for (int j = 0; j < 4; ++j)
    dz[j] = lanes16::and16(expand(L, g0, j), lanes16::lanes_of_bits(won_lanes(L.Q, eq, j, L.second_row[j])));
}

struct ChannelBn {
  Lanes16 scale, shift;
  ChannelBn(float sc, float sh) : scale(lanes16::splat16(sc)), shift(lanes16::splat16(sh)) {}
  Lanes16 operator()(const Lanes16& x, int64_t) const { return lanes16::fmadd16(x, scale, shift); }
};
struct ElementBn {
  const float *scale, *shift;
  Lanes16 operator()(const Lanes16& x, int64_t e) const {
    return lanes16::fmadd16(x, lanes16::load16(Full{}, scale + e), lanes16::load16(Full{}, shift + e));
  }
};

template <class Bn>
inline void relu_block(const float* x, int64_t i, const Bn& bn, Lanes16 r[4]) {
  for (int j = 0; j < 4; ++j) r[j] = lanes16::relu16(bn(lanes16::load16(Full{}, x + i + 16 * j), i + 16 * j));
}

// As the AVX-512 forward; `stream`: y 32-byte aligned, the caller fences (lanes16::stream_fence).
template <class Bn>
inline void forward(const Layout& L, const float* x, const Bn& bn, int64_t len, float* y, bool stream) {
  for (int64_t i = 0; i < len; i += 64) {
    Lanes16 r[4];
    relu_block(x, i, bn, r);
    const Lanes16 v = window_maxima(L, r);
    if (stream)
      lanes16::stream16(y + i / 4, v);
    else
      lanes16::store16(Full{}, y + i / 4, v);
  }
}

template <class Bn>
inline void backward_dz(const Layout& L, const float* x, const Bn& bn, const float* dy, int64_t len, float* dz) {
  for (int64_t i = 0; i < len; i += 64) {
    Lanes16 r[4], d[4];
    relu_block(x, i, bn, r);
    block_dz(L, r, lanes16::load16(Full{}, dy + i / 4), d);
    for (int j = 0; j < 4; ++j) lanes16::store16(Full{}, dz + i + 16 * j, d[j]);
  }
}

// d(i, m) for bn_rows::grad_sums / grad_apply_d (whole vectors only), as the AVX-512 PlaneDz.
class PlaneDz {
 public:
  PlaneDz(const Layout& layout, const float* x, const float* dy, float scale, float shift)
      : L_(&layout), x_(x), dy_(dy), bn_(scale, shift) {}

  template <class Mask>
  ET_ALWAYS_INLINE Lanes16 operator()(int64_t i, const Mask&) {
    const int64_t j = (i >> 4) & 3;
    if (j == 0) {
      Lanes16 r[4];
      relu_block(x_, i, bn_, r);
      block_dz(*L_, r, lanes16::load16(Full{}, dy_ + i / 4), dz_);
    }
    return dz_[j];
  }

 private:
  const Layout* L_;
  const float *x_, *dy_;
  ChannelBn bn_;
  Lanes16 dz_[4];
};
#endif
}  // namespace fused_bn_relu_pool
}  // namespace et
#endif
