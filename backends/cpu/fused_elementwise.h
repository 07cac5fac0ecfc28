// The fused stacks whose stages after the BN are element-wise (ResNet's BN -> ReLU and BN -> add
// -> ReLU, MobileNetV2's BN and BN -> add), in registers (backends/cpu/fused.cpp): the forward from
// x to y and the backward's dz element by element, on AVX-512's 16 lanes or lanes16.h's (AVX2,
// NEON), with the layers' own arithmetic. Included by fused.cpp and fused_backward.cpp.
#pragma once
#include <cstdint>

#include "backends/cpu/always_inline.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/fused_common.h"
#include "engine/fused_stack.h"
#include "memory/bitmap.h"

#if defined(__AVX512F__) || defined(ET_LANES16)
#define ET_ELEMENTWISE_IN_REGISTERS 1  // elementwise_forward_plane / elementwise_dz below
#endif

namespace et {
namespace fused_elementwise {

// Stacks whose stages after the BN are element-wise (ResNet's two kinds, MobileNetV2's): the first
// backward sweep builds dz element by element in registers instead of plane by plane in scratch.
enum class ElementwiseOnly { No, Relu, AddRelu, Add };

// The kind of the first n stages of s.
inline ElementwiseOnly elementwise_kind(const FusedStack& s, size_t n) {
  if (n == 2 && s.stages[1].kind == FusedKind::Relu) return ElementwiseOnly::Relu;
  if (n == 2 && s.stages[1].kind == FusedKind::Add) return ElementwiseOnly::Add;
  if (n == 3 && s.stages[1].kind == FusedKind::Add && s.stages[2].kind == FusedKind::Relu)
    return ElementwiseOnly::AddRelu;
  return ElementwiseOnly::No;
}
inline ElementwiseOnly elementwise_kind(const FusedStack& s) { return elementwise_kind(s, s.stages.size()); }

// A stack ending in a global average pool: the kind of the stages before it, which the forward and
// the backward run in registers into and from a plane of scratch (the plane before the pool, its
// gradient dy / HW); other stacks: elementwise_kind.
inline ElementwiseOnly elementwise_kind_before_global_pool(const FusedStack& s) {
  return elementwise_kind(s, s.stages.size() - (s.ends_in_global_pool() ? 1 : 0));
}

// The same for the backward, where it can go in registers.
inline ElementwiseOnly elementwise_only(const FusedStack& s, const FusedGrads& g, bool recompute) {
  const int64_t PQ = s.last().P * s.last().Q;
  const ElementwiseOnly e = elementwise_kind_before_global_pool(s);
  // A mask read as bits goes 16 bits at a time: planes must start on 16-element boundaries.
  const bool reads_mask = e == ElementwiseOnly::AddRelu || (e == ElementwiseOnly::Relu && !recompute);
  if (reads_mask && g.y_mask.bits && PQ % 16 != 0) return ElementwiseOnly::No;
  return e;
}

// What elementwise_dz (below, per instruction set) reads and writes for plane (n, c) at offset o:
// dy, the side gradient (first sweep), dz's parking place in dx, y's saved mask (dense or bits),
// and the BN stage's training coefficients.
struct DzSources {
  const float* dy;
  float *dside, *park;
  const float* ym;
  const uint64_t* bits;
  bool side_acc;
  bool stream_park;  // dz parked by streaming stores (whole aligned vectors)
  float scale, shift;
};
// dy_plane: where the plane's dy is, if not in g.dy at o (a last global pool's dy / HW, in scratch).
inline DzSources dz_sources(FusedGrads& g, const FusedTensors& t, int64_t c, int64_t o,
                                             bool first_sweep, bool park_dz, const float* dy_plane,
                                             bool stream_park) {
  DzSources r;
  r.stream_park = stream_park;
  r.dy = dy_plane ? dy_plane : g.dy.f32() + o;
  r.dside = first_sweep && g.dside.defined() ? g.dside.f32() + o : nullptr;
  r.park = first_sweep && park_dz ? g.dx.f32() + o : nullptr;
  r.ym = g.y_mask.bits ? nullptr : (g.y_mask.dense.defined() ? g.y_mask.dense.f32() + o : nullptr);
  r.bits = g.y_mask.bits;
  r.side_acc = g.dside_accumulate;
  bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &r.scale,
                              &r.shift);
  return r;
}

#if defined(__AVX512F__)
// The forward of such a stack over one plane (n, c) in registers, with the stages' own arithmetic
// (bn_rows::apply's FMA, + side, relu_forward's rule): y, and where `words`, y's bitmap words with
// the stash's keep rule (mask_words; a plane of whole words). `stream`: y by streaming stores (y
// 64-byte aligned, HW a multiple of 16). Returns the kept count.
inline int64_t elementwise_forward_plane(ElementwiseOnly e, const float* x, const float* side, float scale, float shift,
                                  int64_t HW, float* y, bool stream, uint32_t tb, uint64_t* words) {
  const __m512 vs = _mm512_set1_ps(scale), vt = _mm512_set1_ps(shift), zero = _mm512_setzero_ps();
  const __m512i threshold = _mm512_set1_epi32(int32_t(tb));
  int64_t kept = 0;
  // Whole words: four vectors at a time, no masks to build, each word from their four compares.
  // ResNet-20's block-output stacks at 32x32: 0.61-0.65 -> 0.51-0.57 ms, the words included.
  if (HW % 64 == 0) {
    for (int64_t i = 0; i < HW; i += 64) {
      uint64_t word = 0;
      for (int k = 0; k < 4; ++k) {
        const int64_t at = i + 16 * k;
        __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(x + at), vs, vt);
        if (e != ElementwiseOnly::Relu) v = _mm512_add_ps(v, _mm512_loadu_ps(side + at));
        if (e != ElementwiseOnly::Add) v = _mm512_maskz_max_ps(0xFFFF, v, zero);
        if (stream)
          _mm512_stream_ps(y + at, v);
        else
          _mm512_storeu_ps(y + at, v);
        if (words)
          word |= uint64_t(_cvtmask16_u32(_mm512_cmpge_epu32_mask(_mm512_castps_si512(v), threshold))) << (16 * k);
      }
      if (words) {
        words[i >> 6] = word;
        kept += __builtin_popcountll(word);
      }
    }
    return kept;
  }
  uint64_t word = 0;
  for (int64_t i = 0; i < HW; i += 16) {
    const __mmask16 m = HW - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (HW - i)) - 1);
    __m512 v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), vs, vt);
    if (e != ElementwiseOnly::Relu) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, side + i));
    if (e != ElementwiseOnly::Add) v = _mm512_maskz_max_ps(0xFFFF, v, zero);  // v > 0 ? v : +0 (NaN -> +0)
    if (stream)
      _mm512_stream_ps(y + i, v);
    else
      _mm512_mask_storeu_ps(y + i, m, v);
    if (words) {
      word |= uint64_t(_mm512_cmpge_epu32_mask(_mm512_castps_si512(v), threshold)) << (i & 63);
      if ((i & 63) == 48) {
        words[i >> 6] = word;
        kept += __builtin_popcountll(word);
        word = 0;
      }
    }
  }
  return kept;
}

// The lanes of m where relu(x * scale + shift) > 0, with the forward's own arithmetic (one FMA):
// a last ReLU's mask recomputed from x.
inline __mmask16 relu_on(__mmask16 m, const float* x, __m512 scale, __m512 shift) {
  const __m512 z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x), scale, shift);
  return _mm512_mask_cmp_ps_mask(m, z, _mm512_setzero_ps(), _CMP_GT_OQ);
}

// d(i, m) for grad_sums and grad_apply_d: plane (n, c)'s dz, 16 elements at a time (relu_backward's
// rule: masked-out lanes are +0). The first sweep writes the side gradient on the way, and dz
// parked in dx where `park`.
inline auto elementwise_dz(ElementwiseOnly e, FusedGrads& g, const FusedTensors& t, int64_t c, int64_t o,
                           const float* x, bool recompute, bool first_sweep, bool park_dz,
                           const float* dy_plane = nullptr, bool stream_park = false) {
  const DzSources src = dz_sources(g, t, c, o, first_sweep, park_dz, dy_plane, stream_park);
  const __m512 vscale = _mm512_set1_ps(src.scale), vshift = _mm512_set1_ps(src.shift), zero = _mm512_setzero_ps();
  return [=](int64_t i, __mmask16 m) ET_ALWAYS_INLINE {
    __mmask16 on = m;
    if (e == ElementwiseOnly::Relu && recompute) {
      on = relu_on(m, x + i, vscale, vshift);
    } else if (e != ElementwiseOnly::Add) {  // y's saved mask
      on = src.bits ? __mmask16(m & (src.bits[(o + i) >> 6] >> ((o + i) & 63)))
                    : _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, src.ym + i), zero, _CMP_GT_OQ);
    }
    const __m512 d = _mm512_maskz_loadu_ps(on, src.dy + i);
    if (src.dside) {
      const __m512 v = src.side_acc ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, src.dside + i), d) : d;
      _mm512_mask_storeu_ps(src.dside + i, m, v);
    }
    if (src.park) {
      if (src.stream_park)
        _mm512_stream_ps(src.park + i, d);
      else
        _mm512_mask_storeu_ps(src.park + i, m, d);
    }
    return d;
  };
}

// The first backward sweep of a stack over plane (n, c) done by its reader's data gradient
// (FusedGrads::dz_sums): d holds the plane's dy and gets dz, with the arithmetic of elementwise_dz
// (the ReLU's mask recomputed from x, or read from y or y's bitmap, or none after an add) and the
// sums of the stack's sweep 1. A piece of the plane: len elements from flat element `at` of
// [N, C, H, W] (d: dx + at), its sums carried in `lanes` (every piece but the last a multiple of
// 16 elements: the same bits as the whole plane at once, bn_rows::GradLanes), so a kernel can take
// each piece right after it writes it. FromBits: `at` a multiple of 16.
inline void dz_sums_piece(const DzSumsEpilogue& e, int64_t c, int64_t at, float* d, int64_t len,
                          bn_rows::GradLanes* lanes) {
  const float* x = e.x + at;
  if (e.mask == DzMask::None) {  // dz = dy, in place already
    auto dz = [=](int64_t i, __mmask16 m) ET_ALWAYS_INLINE { return _mm512_maskz_loadu_ps(m, d + i); };
    return bn_rows::grad_sums_piece(dz, x, e.mean[c], len, lanes);
  }
  if (e.mask == DzMask::FromY) {  // y > 0, as elementwise_dz reads a dense saved y
    const float* y = e.y + at;
    auto dz = [=](int64_t i, __mmask16 m) ET_ALWAYS_INLINE {
      const __mmask16 on = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, y + i), _mm512_setzero_ps(), _CMP_GT_OQ);
      const __m512 v = _mm512_maskz_loadu_ps(on, d + i);
      _mm512_mask_storeu_ps(d + i, m, v);
      return v;
    };
    return bn_rows::grad_sums_piece(dz, x, e.mean[c], len, lanes);
  }
  if (e.mask == DzMask::FromBits) {  // y > 0 from its bitmap: 16 bits a vector
    const uint64_t* bits = e.bits;
    auto dz = [=](int64_t i, __mmask16 m) ET_ALWAYS_INLINE {
      const int64_t f = at + i;
      const __mmask16 on = __mmask16(m & (bits[f >> 6] >> (f & 63)));
      const __m512 v = _mm512_maskz_loadu_ps(on, d + i);
      _mm512_mask_storeu_ps(d + i, m, v);
      return v;
    };
    return bn_rows::grad_sums_piece(dz, x, e.mean[c], len, lanes);
  }
  const __m512 vscale = _mm512_set1_ps(e.scale[c]), vshift = _mm512_set1_ps(e.shift[c]);
  auto dz = [=](int64_t i, __mmask16 m) ET_ALWAYS_INLINE {
    const __m512 v = _mm512_maskz_loadu_ps(relu_on(m, x + i, vscale, vshift), d + i);
    _mm512_mask_storeu_ps(d + i, m, v);
    return v;
  };
  bn_rows::grad_sums_piece(dz, x, e.mean[c], len, lanes);
}
#elif defined(ET_LANES16)
// The AVX-512 functions above on AVX2's or NEON's registers (lanes16.h), with the same arithmetic.
inline int64_t elementwise_forward_plane(ElementwiseOnly e, const float* x, const float* side, float scale, float shift,
                                  int64_t HW, float* y, bool stream, uint32_t tb, uint64_t* words) {
  using namespace lanes16;
  const Lanes16 vs = splat16(scale), vt = splat16(shift);
  auto value = [&](int64_t i, auto m) ET_ALWAYS_INLINE {
    Lanes16 v = fmadd16(load16(m, x + i), vs, vt);
    if (e != ElementwiseOnly::Relu) v = add16(v, load16(m, side + i));
    if (e != ElementwiseOnly::Add) v = relu16(v);
    return v;
  };
  int64_t kept = 0;
  uint64_t word = 0;
  int64_t i = 0;
  for (; i + 16 <= HW; i += 16) {
    const Lanes16 v = value(i, Full{});
    if (stream)
      stream16(y + i, v);
    else
      store16(Full{}, y + i, v);
    if (words) {  // a plane of whole words: every vector is whole
      word |= uint64_t(bits_at_least16(v, tb)) << (i & 63);
      if ((i & 63) == 48) {
        words[i >> 6] = word;
        kept += __builtin_popcountll(word);
        word = 0;
      }
    }
  }
  if (i < HW) {
    const Lanes16 m = lanes_first(HW - i);
    store16(m, y + i, value(i, m));
  }
  return kept;
}

// As the AVX-512 relu_on: the lanes of m where relu(x * scale + shift) > 0.
template <class M>
inline lanes16::Lanes16 relu_on(const M& m, const float* x, const lanes16::Lanes16& scale,
                                const lanes16::Lanes16& shift) {
  using namespace lanes16;
  return and16(on16(m), gt_zero16(fmadd16(load16(m, x), scale, shift)));
}

inline auto elementwise_dz(ElementwiseOnly e, FusedGrads& g, const FusedTensors& t, int64_t c, int64_t o,
                           const float* x, bool recompute, bool first_sweep, bool park_dz,
                           const float* dy_plane = nullptr, bool stream_park = false) {
  using namespace lanes16;
  const DzSources src = dz_sources(g, t, c, o, first_sweep, park_dz, dy_plane, stream_park);
  const Lanes16 vscale = splat16(src.scale), vshift = splat16(src.shift);
  return [=](int64_t i, auto m) ET_ALWAYS_INLINE {
    Lanes16 on = on16(m);
    if (e == ElementwiseOnly::Relu && recompute) {
      on = relu_on(m, x + i, vscale, vshift);
    } else if (e != ElementwiseOnly::Add) {  // y's saved mask
      on = and16(on, src.bits ? lanes_of_bits(uint32_t(src.bits[(o + i) >> 6] >> ((o + i) & 63)))
                              : gt_zero16(load16(m, src.ym + i)));
    }
    const Lanes16 d = and16(load16(m, src.dy + i), on);  // +0 in the lanes off
    if (src.dside) store16(m, src.dside + i, src.side_acc ? add16(load16(m, src.dside + i), d) : d);
    if (src.park) {
      if (src.stream_park)
        stream16(src.park + i, d);  // whole vectors only (the caller's condition)
      else
        store16(m, src.park + i, d);
    }
    return d;
  };
}

inline void dz_sums_piece(const DzSumsEpilogue& e, int64_t c, int64_t at, float* d, int64_t len,
                          bn_rows::GradLanes* lanes) {
  using namespace lanes16;
  const float* x = e.x + at;
  if (e.mask == DzMask::None) {  // dz = dy, in place already
    auto dz = [=](int64_t i, auto m) ET_ALWAYS_INLINE { return and16(load16(m, d + i), on16(m)); };
    return bn_rows::grad_sums_piece(dz, x, e.mean[c], len, lanes);
  }
  if (e.mask == DzMask::FromY) {  // y > 0, as elementwise_dz reads a dense saved y
    const float* y = e.y + at;
    auto dz = [=](int64_t i, auto m) ET_ALWAYS_INLINE {
      const Lanes16 v = and16(load16(m, d + i), and16(on16(m), gt_zero16(load16(m, y + i))));  // +0 in the lanes off
      store16(m, d + i, v);
      return v;
    };
    return bn_rows::grad_sums_piece(dz, x, e.mean[c], len, lanes);
  }
  if (e.mask == DzMask::FromBits) {  // y > 0 from its bitmap: 16 bits a vector
    const uint64_t* bits = e.bits;
    auto dz = [=](int64_t i, auto m) ET_ALWAYS_INLINE {
      const int64_t f = at + i;
      const Lanes16 on = and16(on16(m), lanes_of_bits(uint32_t(bits[f >> 6] >> (f & 63))));
      const Lanes16 v = and16(load16(m, d + i), on);  // +0 in the lanes off
      store16(m, d + i, v);
      return v;
    };
    return bn_rows::grad_sums_piece(dz, x, e.mean[c], len, lanes);
  }
  const Lanes16 vscale = splat16(e.scale[c]), vshift = splat16(e.shift[c]);
  auto dz = [=](int64_t i, auto m) ET_ALWAYS_INLINE {
    const Lanes16 v = and16(load16(m, d + i), relu_on(m, x + i, vscale, vshift));  // +0 in the lanes off
    store16(m, d + i, v);
    return v;
  };
  bn_rows::grad_sums_piece(dz, x, e.mean[c], len, lanes);
}
#endif

#if defined(ET_ELEMENTWISE_IN_REGISTERS)
// dz_sums_piece over planes [pl0, pl1) (plane n * C + c) of a data gradient dx [N, C, HW], whole
// planes, their final values (each conv kernel calls it on the planes it has just written, while
// they are in its core's cache).
inline void dz_sums_planes(const DzSumsEpilogue& e, int64_t pl0, int64_t pl1, int64_t C, int64_t HW, float* dx) {
  for (int64_t pl = pl0; pl < pl1; ++pl) {
    bn_rows::GradLanes lanes;
    dz_sums_piece(e, pl % C, pl * HW, dx + pl * HW, HW, &lanes);
    bn_rows::grad_sums_finish(lanes, e.sum1 + pl, e.sum2 + pl);
  }
}
// ... over images [n0, n1).
inline void dz_sums_images(const DzSumsEpilogue& e, int64_t n0, int64_t n1, int64_t C, int64_t HW, float* dx) {
  dz_sums_planes(e, n0 * C, n1 * C, C, HW, dx);
}
#endif

}  // namespace fused_elementwise
}  // namespace et
