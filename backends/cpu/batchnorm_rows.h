// The per-channel and per-row pieces of batchnorm2d on CPU, shared by the layer kernels
// (batchnorm.cpp) and the fused stacks (fused.cpp). Both call these same out-of-line functions, so
// the reduction order and the rounding of every element are the same: fused and unfused results
// are bit-identical by construction, not by luck of the compiler.
#pragma once
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backends/cpu/always_inline.h"
#include "backends/cpu/lanes16.h"
#include "engine/fused_stack.h"
#include "engine/check.h"
#include "engine/tensor.h"
#include "memory/half.h"

namespace et {
namespace bn_rows {

// Channel c of x [N,C,HW] (f32): mean[c], invstd[c] from the batch, running statistics updated
// when defined (PyTorch's momentum and unbiased variance). Each plane sums in float, planes add in
// double, n in order.
void channel_statistics(const float* x, int64_t N, int64_t C, int64_t HW, int64_t c, float momentum, float eps,
                        Tensor& running_mean, Tensor& running_var, Tensor& mean, Tensor& invstd);

// x's n elements from offset o as f32 for a backward: in place, or a 16-bit saved copy (the
// dense_fp16 / dense_bf16 stash) widened into buf, so BN reads the stash directly (no decode pass).
// The BN layer and the fused stacks widen the same rows, so they reduce the same values.
inline const float* x_f32(const Tensor& x, int64_t o, int64_t n, float* buf) {
  switch (x.dtype) {
    case DType::F32: return x.f32() + o;
    case DType::F16: f16_to_f32(static_cast<const uint16_t*>(x.data) + o, n, buf); return buf;
    case DType::BF16: bf16_to_f32(static_cast<const uint16_t*>(x.data) + o, n, buf); return buf;
    default: ET_CHECK(false, "batchnorm backward: x dtype ", int(x.dtype));
  }
  return nullptr;
}

// One plane's sums in float (the order channel_statistics uses): *s1 = sum x, *s2 = sum x^2.
void plane_sums(const float* x, int64_t HW, float* s1, float* s2);

// One element of a fused stack's output relu(v * scale + shift) as this build's stack run computes
// it (fused.cpp, bn_relu_channel: apply, then relu_run): one rounding where the vector forms use a
// fused multiply-add (ET_AFFINE_FMA), else apply's portable expression; then relu_forward's rule
// (NaN and -0 give +0). For the kernels that compute the output where they stage their input.
#if defined(__AVX512F__) || defined(ET_LANES16)
#define ET_AFFINE_FMA 1
#endif
inline float affine_relu_one(float v, float scale, float shift) {
#if defined(ET_AFFINE_FMA)
  const float a = std::fma(v, scale, shift);
#else
  const float a = v * scale + shift;
#endif
  return a > 0.f ? a : 0.f;
}

// From a channel's sums over the batch (in double): mean[c], invstd[c], the running statistics.
void finish_statistics(double s, double ss, int64_t M, int64_t c, float momentum, float eps, Tensor& running_mean,
                       Tensor& running_var, Tensor& mean, Tensor& invstd);

// out[i] = x[i] * scale + shift (BN apply; scale, shift per channel).
void apply(const float* x, float scale, float shift, int64_t len, float* out);
// Training: scale = gamma * invstd, shift = beta - mean * scale; eval: from the running statistics.
void train_coefficients(float gamma, float beta, float mean, float invstd, float* scale, float* shift);
void eval_coefficients(float gamma, float beta, float running_mean, float running_var, float eps, float* scale,
                       float* shift);

// Backward reductions of one row: *a = sum d, *b = sum d * (x - mu), in float, in an order fixed
// by this code and not by the compiler: lane j of 16 takes elements j, j + 16, ... in turn, then
// the lanes add in a fixed tree. Every caller gets the same bits: the BN layer with d = dy, the
// fused stacks with d built on the fly from dy, a mask and x. `d(i, m)` returns the 16 values
// from element i (lanes outside the mask m are ignored; AVX2, NEON: m is `Full` or a `Lanes16`);
// portable builds: `d(i)` one value.
#if defined(__AVX512F__)
// The sum of v's lanes by a halving tree: lane j + 8 into j, then j + 4, j + 2, j + 1 (the scalar
// loops' order and _mm512_reduce_add_ps's), in registers. maskz forms: the plain shuffles make
// GCC 12 warn of an uninitialised operand.
inline float halving_sum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0x4E));  // 256-bit halves swapped
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0xB1));  // 128-bit quarters swapped
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(0xFFFF, v, 0x4E));        // 64-bit pairs swapped
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(0xFFFF, v, 0xB1));        // neighbours swapped
  return _mm512_cvtss_f32(v);
}

// plane_sums's running lanes, for a producer that sums its plane as it writes it (the stride-1
// pool's forward, fused.cpp): vector j of the plane (elements [16 j, 16 j + 16), zeros past the
// end) adds into set j % 4, j in increasing order; finish adds the sets as plane_sums does. The
// same bits as plane_sums over the plane.
struct PlaneSumLanes {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __m512 b[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  ET_ALWAYS_INLINE void add(int64_t j, __m512 v) {
    a[j & 3] = _mm512_add_ps(a[j & 3], v);
    b[j & 3] = _mm512_fmadd_ps(v, v, b[j & 3]);
  }
  void finish(float* s1, float* s2) const {
    *s1 = halving_sum(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    *s2 = halving_sum(_mm512_add_ps(_mm512_add_ps(b[0], b[1]), _mm512_add_ps(b[2], b[3])));
  }
};

// The running lanes of grad_sums. A plane may be summed in pieces (the fused stacks' row bands,
// fused.cpp) with one GradLanes carried across them: every piece but the last must be a multiple of
// 16 elements long, so each element meets the lane and the position in its lane's chain it would
// meet in one call over the whole plane, and the sums are the same bits.
struct GradLanes {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
};
template <class D>
inline void grad_sums_piece(D d, const float* x, float mu, int64_t len, GradLanes* lanes) {
  __m512 la = lanes->a, lb = lanes->b;
  const __m512 vmu = _mm512_set1_ps(mu);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 v = d(i, __mmask16(0xFFFF));
    la = _mm512_add_ps(la, v);
    lb = _mm512_fmadd_ps(v, _mm512_sub_ps(_mm512_loadu_ps(x + i), vmu), lb);
  }
  if (i < len) {
    const __mmask16 m = __mmask16((1u << (len - i)) - 1);
    const __m512 v = d(i, m);
    la = _mm512_mask_add_ps(la, m, la, v);
    lb = _mm512_mask3_fmadd_ps(v, _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vmu), lb, m);
  }
  lanes->a = la;
  lanes->b = lb;
}
inline void grad_sums_finish(const GradLanes& lanes, float* a_out, float* b_out) {
  *a_out = halving_sum(lanes.a);
  *b_out = halving_sum(lanes.b);
}
// d(i, m) for a plain row.
inline auto row_of(const float* p) {
  return [p](int64_t i, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p + i); };
}
// out (+)= (a * d + b * x) + c0, one multiply, one FMA and one add per element in this order, so
// the BN layer (grad_apply, d = dy) and the fused stacks (d built from dy and a mask in registers)
// round every element alike. `stream`: out (64-byte aligned, len a multiple of 16, not accumulated)
// by streaming stores (FusedStack::stream_dx); the caller fences.
template <class D>
inline void grad_apply_d(D d, const float* x, float a, float b, float c0, int64_t len, float* out, bool accumulate,
                         bool stream = false) {
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b), vc = _mm512_set1_ps(c0);
  auto value = [&](int64_t i, __mmask16 m, __m512 xv) ET_ALWAYS_INLINE {
    return _mm512_add_ps(_mm512_fmadd_ps(va, d(i, m), _mm512_mul_ps(vb, xv)), vc);
  };
  int64_t i = 0;
  // Whole vectors unmasked: a masked store is several times slower on some cores (AMD Zen 4).
  if (accumulate) {
    for (; i + 16 <= len; i += 16)
      _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_loadu_ps(out + i), value(i, 0xFFFF, _mm512_loadu_ps(x + i))));
  } else if (stream) {
    for (; i + 16 <= len; i += 16) _mm512_stream_ps(out + i, value(i, 0xFFFF, _mm512_loadu_ps(x + i)));
  } else {
    for (; i + 16 <= len; i += 16) _mm512_storeu_ps(out + i, value(i, 0xFFFF, _mm512_loadu_ps(x + i)));
  }
  if (i < len) {
    const __mmask16 m = __mmask16((1u << (len - i)) - 1);
    __m512 v = value(i, m, _mm512_maskz_loadu_ps(m, x + i));
    if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + i), v);
    _mm512_mask_storeu_ps(out + i, m, v);
  }
}
#elif defined(ET_LANES16)
// AVX2 and NEON: AVX-512's 16 lanes in two ymm or four q registers (lanes16.h), so every sum takes
// its elements in the same order and the bits are the same as there and in the portable loops.
using namespace lanes16;
struct GradLanes {
  Lanes16 a = splat16(0.f), b = splat16(0.f);
};
template <class D>
inline void grad_sums_piece(D d, const float* x, float mu, int64_t len, GradLanes* lanes) {
  Lanes16 la = lanes->a, lb = lanes->b;
  const Lanes16 vmu = splat16(mu);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const Lanes16 v = d(i, Full{});
    la = add16(la, v);
    lb = fmadd16(v, sub16(load16(Full{}, x + i), vmu), lb);
  }
  if (i < len) {  // the lanes off keep their sums as they are (AVX-512's masked add and FMA)
    const Lanes16 m = lanes_first(len - i);
    const Lanes16 v = d(i, m);
    la = blend16(la, add16(la, v), m);
    lb = blend16(lb, fmadd16(v, sub16(load16(m, x + i), vmu), lb), m);
  }
  lanes->a = la;
  lanes->b = lb;
}
inline void grad_sums_finish(const GradLanes& lanes, float* a_out, float* b_out) {
  *a_out = halving_sum(lanes.a);
  *b_out = halving_sum(lanes.b);
}
inline auto row_of(const float* p) {
  return [p](int64_t i, auto m) { return load16(m, p + i); };
}
// As the AVX-512 grad_apply_d: (a * d + b * x) + c0, one multiply, one FMA and one add.
template <class D>
inline void grad_apply_d(D d, const float* x, float a, float b, float c0, int64_t len, float* out, bool accumulate,
                         bool stream = false) {
  const Lanes16 va = splat16(a), vb = splat16(b), vc = splat16(c0);
  auto value = [&](int64_t i, auto m, const Lanes16& xv) ET_ALWAYS_INLINE { return add16(fmadd16(va, d(i, m), mul16(vb, xv)), vc); };
  int64_t i = 0;
  if (accumulate) {
    for (; i + 16 <= len; i += 16)
      store16(Full{}, out + i, add16(load16(Full{}, out + i), value(i, Full{}, load16(Full{}, x + i))));
  } else if (stream) {
    for (; i + 16 <= len; i += 16) stream16(out + i, value(i, Full{}, load16(Full{}, x + i)));
  } else {
    for (; i + 16 <= len; i += 16) store16(Full{}, out + i, value(i, Full{}, load16(Full{}, x + i)));
  }
  if (i < len) {
    const Lanes16 m = lanes_first(len - i);
    Lanes16 v = value(i, m, load16(m, x + i));
    if (accumulate) v = add16(load16(m, out + i), v);
    store16(m, out + i, v);
  }
}
#else
struct GradLanes {  // as above: pieces of multiples of 16 elements but the last
  float a[16] = {}, b[16] = {};
};
template <class D>
inline void grad_sums_piece(D d, const float* x, float mu, int64_t len, GradLanes* lanes) {
  float* la = lanes->a;
  float* lb = lanes->b;
  for (int64_t i = 0; i < len; ++i) {
    const float v = d(i);
    la[i % 16] += v;
    lb[i % 16] = std::fma(v, x[i] - mu, lb[i % 16]);
  }
}
inline void grad_sums_finish(GradLanes lanes, float* a_out, float* b_out) {
  float* la = lanes.a;
  float* lb = lanes.b;
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) {
      la[j] += la[j + w];
      lb[j] += lb[j + w];
    }
  *a_out = la[0];
  *b_out = lb[0];
}
inline auto row_of(const float* p) {
  return [p](int64_t i) { return p[i]; };
}
#endif
// One row's sums in one call: the lanes of grad_sums_piece over the whole row, then the tree.
template <class D>
inline void grad_sums(D d, const float* x, float mu, int64_t len, float* a_out, float* b_out) {
  GradLanes lanes;
  grad_sums_piece(d, x, mu, len, &lanes);
  grad_sums_finish(lanes, a_out, b_out);
}

// Small planes (HW <= kSmallPlane, engine/fused_stack.h) go by channel blocks: x [L, HW], the planes
// of L consecutive channels of one image, contiguous. Every small-plane caller (the BN layer, the
// fused stacks) uses these functions and no per-plane one, so results agree bit for bit; per
// channel they do not depend on L. Each plane sums in float in an order fixed by HW (batchnorm.cpp),
// planes add in double over n in order, as for large planes.
// s1[l] = sum of x[l, :], s2[l] = sum of x[l, :]^2
void block_sums(const float* x, int64_t L, int64_t HW, float* s1, float* s2);
// a[l] = sum of d[l, :], b[l] = sum of d[l, :] * (x[l, :] - mu[l, :]) (mu: the mean expanded per element)
void block_grad_sums(const float* d, const float* x, const float* mu, int64_t L, int64_t HW, float* a, float* b);
// out[i] = x[i] * scale[i] + shift[i]: apply with the per-channel coefficients expanded per element
// (expand()), so a block is one flat loop.
void block_apply(const float* x, const float* scale, const float* shift, int64_t len, float* out);
// out[l * HW + i] = v[l]
void expand(const float* v, int64_t L, int64_t HW, float* out);

// From a channel's reductions (summed in double over its rows): dbeta, dgamma and the three
// coefficients of dx = a * dy + b * x + c0.
struct GradCoefficients {
  float dbeta, dgamma, a, b, c0;
};
GradCoefficients grad_coefficients(double sum_dy, double sum_dy_xmu, float gamma, float mu, float invstd, int64_t M);
// The same for channel c of a BN over M elements per channel, with dbeta[c], dgamma[c] written (or
// added to, when `accumulate`; undefined: frozen, left alone).
GradCoefficients channel_gradients(double sum_dy, double sum_dy_xmu, const Tensor& gamma, const Tensor& mean,
                                   const Tensor& invstd, int64_t c, int64_t M, Tensor& dgamma, Tensor& dbeta,
                                   bool accumulate);
// out (+)= a * dy + b * x + c0
void grad_apply(const float* dy, const float* x, const GradCoefficients& k, int64_t len, float* out, bool accumulate);
// The same over a block, a, b, c0 expanded per element.
void block_grad_apply(const float* dy, const float* x, const float* a, const float* b, const float* c0, int64_t len,
                      float* out, bool accumulate);

}  // namespace bn_rows
}  // namespace et
