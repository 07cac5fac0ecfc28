// batchnorm2d on CPU: channels spread over threads; each channel's reduction runs in one thread in
// a fixed order (double accumulators), so results do not depend on scheduling. The row pieces are
// in bn_rows (batchnorm_rows.h), shared with the fused stacks.
#include <algorithm>
#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backends/cpu/balance.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/cpu_backend.h"

namespace et {

namespace bn_rows {

// The row functions stay out of line (noinline): inlined into one caller, GCC vectorises a
// reduction differently there than in the other, and fused results would drift by ulps.
#define ET_ROW_FUNCTION __attribute__((noinline))

void channel_statistics(const float* xp, int64_t N, int64_t C, int64_t HW, int64_t c, float momentum, float eps,
                        Tensor& running_mean, Tensor& running_var, Tensor& mean, Tensor& invstd) {
  const int64_t M = N * HW;
  double s = 0, ss = 0;
  for (int64_t n = 0; n < N; ++n) {
    const float* row = xp + (n * C + c) * HW;
    // A channel's planes lie C planes apart; the hardware prefetcher stops at each plane's end
    // (a CIFAR plane is one page): touching the next plane's first lines starts it there.
    if (n + 1 < N)
      for (int64_t i = 0; i < std::min<int64_t>(HW, 64); i += 16) __builtin_prefetch(row + C * HW + i);
    float s1, s2;
    plane_sums(row, HW, &s1, &s2);
    s += s1;
    ss += s2;
  }
  finish_statistics(s, ss, M, c, momentum, eps, running_mean, running_var, mean, invstd);
}

// AVX-512: four accumulators of each sum (vector j into j % 4, a masked last one), so the adds
// are four independent chains: a conv epilogue takes the sums of a plane it just wrote (in L1),
// where one chain made them latency-bound. Portable builds: the compiler's vector order.
ET_ROW_FUNCTION void plane_sums(const float* x, int64_t HW, float* s1_out, float* s2_out) {
#if defined(__AVX512F__)
  PlaneSumLanes lanes;  // vector j into set j % 4 (PlaneSumLanes), four at a time in registers
  int64_t i = 0, j = 0;
  for (; i + 64 <= HW; i += 64, j += 4)
    for (int k = 0; k < 4; ++k) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * k);
      lanes.a[k] = _mm512_add_ps(lanes.a[k], v);
      lanes.b[k] = _mm512_fmadd_ps(v, v, lanes.b[k]);
    }
  for (; i < HW; i += 16, ++j) {
    const __mmask16 m = HW - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (HW - i)) - 1);
    lanes.add(j, _mm512_maskz_loadu_ps(m, x + i));
  }
  lanes.finish(s1_out, s2_out);
#else
  float s1 = 0.f, s2 = 0.f;
#pragma omp simd reduction(+ : s1, s2)
  for (int64_t i = 0; i < HW; ++i) {
    s1 += x[i];
    s2 += x[i] * x[i];
  }
  *s1_out = s1;
  *s2_out = s2;
#endif
}

void finish_statistics(double s, double ss, int64_t M, int64_t c, float momentum, float eps, Tensor& running_mean,
                       Tensor& running_var, Tensor& mean, Tensor& invstd) {
  const double mu = s / double(M);
  const double var = std::max(0.0, ss / double(M) - mu * mu);
  mean.f32()[c] = float(mu);
  invstd.f32()[c] = float(1.0 / std::sqrt(var + double(eps)));
  const double unbiased = M > 1 ? var * double(M) / double(M - 1) : var;
  if (running_mean.defined()) {
    running_mean.f32()[c] = (1.f - momentum) * running_mean.f32()[c] + momentum * float(mu);
    running_var.f32()[c] = (1.f - momentum) * running_var.f32()[c] + momentum * float(unbiased);
  }
}

// With AVX-512, AVX2 or NEON the fused stacks' backward recomputes relu(bn(x)) with one fused multiply-add
// per element (fused.cpp, elementwise_dz); the forward uses the same instruction explicitly, so the
// mask bits agree in every build (an -O1 build, ASan's, did not contract x * scale + shift).
ET_ROW_FUNCTION void apply(const float* x, float scale, float shift, int64_t len, float* out) {
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(scale), vt = _mm512_set1_ps(shift);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) _mm512_storeu_ps(out + i, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), vs, vt));
  if (i < len) {
    const __mmask16 m = __mmask16((1u << (len - i)) - 1);
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), vs, vt));
  }
#elif defined(ET_LANES16)
  const Lanes16 vs = splat16(scale), vt = splat16(shift);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) store16(Full{}, out + i, fmadd16(load16(Full{}, x + i), vs, vt));
  if (i < len) {
    const Lanes16 m = lanes_first(len - i);
    store16(m, out + i, fmadd16(load16(m, x + i), vs, vt));
  }
#else
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) out[i] = x[i] * scale + shift;
#endif
}

// The block functions reduce 16 channels at a time. AVX-512: each plane sums as a binary tree of
// adjacent pairs (pair_sums below); where HW divides 16 the planes are read as contiguous vectors
// (16 / HW planes each), else one plane per vector, padded with zeros to 16 lanes. Portable: left
// to right. Either way the order depends on HW only, not on L or on where a block starts.
#if defined(__AVX512F__)
namespace {
// [a0 + a1, a2 + a3, ..., a14 + a15, b0 + b1, ..., b14 + b15]
inline __m512 pair_sums(__m512 a, __m512 b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

// Per channel l < min(L, 16) of planes [L, HW]: lane l of *s1 / *s2 = the plane's sum of the two
// values load(offset, mask) returns for its elements.
template <class Load>
inline void reduce16(int64_t L, int64_t HW, Load load, __m512* s1, __m512* s2) {
  __m512 u[16], v[16];
  int64_t n = 16;
  if (16 % HW == 0) {  // HW vectors, each 16 / HW whole planes
    const int64_t len = std::min<int64_t>(L, 16) * HW;
    n = HW;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t left = len - j * 16;
      const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
      load(j * 16, m, &u[j], &v[j]);
    }
  } else {  // a plane per vector
    const __mmask16 plane = __mmask16((1u << HW) - 1);
    for (int64_t l = 0; l < 16; ++l) load(l * HW, l < L ? plane : __mmask16(0), &u[l], &v[l]);
  }
  for (; n > 1; n /= 2)
    for (int64_t k = 0; k < n / 2; ++k) {
      u[k] = pair_sums(u[2 * k], u[2 * k + 1]);
      v[k] = pair_sums(v[2 * k], v[2 * k + 1]);
    }
  *s1 = u[0];
  *s2 = v[0];
}

// s1[l], s2[l] for every channel l < L, 16 at a time; loader_of(first channel) gives reduce16's loader.
template <class LoaderOf>
inline void reduce_channels(int64_t L, int64_t HW, LoaderOf loader_of, float* s1, float* s2) {
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    __m512 a, b;
    reduce16(L - l0, HW, loader_of(l0), &a, &b);
    const __mmask16 m = L - l0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (L - l0)) - 1);
    _mm512_mask_storeu_ps(s1 + l0, m, a);
    _mm512_mask_storeu_ps(s2 + l0, m, b);
  }
}
}  // namespace
#endif

ET_ROW_FUNCTION void block_sums(const float* x, int64_t L, int64_t HW, float* s1, float* s2) {
#if defined(__AVX512F__)
  reduce_channels(L, HW, [=](int64_t l0) {
    const float* p = x + l0 * HW;
    return [p](int64_t o, __mmask16 m, __m512* u, __m512* v) {
      const __m512 e = _mm512_maskz_loadu_ps(m, p + o);
      *u = e;
      *v = _mm512_mul_ps(e, e);
    };
  }, s1, s2);
#else
  for (int64_t l = 0; l < L; ++l) {
    float a = 0.f, q = 0.f;
    for (int64_t i = 0; i < HW; ++i) {
      const float v = x[l * HW + i];
      a += v;
      q = std::fma(v, v, q);
    }
    s1[l] = a;
    s2[l] = q;
  }
#endif
}

ET_ROW_FUNCTION void block_grad_sums(const float* d, const float* x, const float* mu, int64_t L, int64_t HW, float* a,
                                     float* b) {
#if defined(__AVX512F__)
  reduce_channels(L, HW, [=](int64_t l0) {
    const float *dp = d + l0 * HW, *xp = x + l0 * HW, *mp = mu + l0 * HW;
    return [=](int64_t o, __mmask16 m, __m512* u, __m512* v) {
      const __m512 e = _mm512_maskz_loadu_ps(m, dp + o);
      *u = e;
      *v = _mm512_mul_ps(e, _mm512_sub_ps(_mm512_maskz_loadu_ps(m, xp + o), _mm512_maskz_loadu_ps(m, mp + o)));
    };
  }, a, b);
#else
  for (int64_t l = 0; l < L; ++l) {
    float sa = 0.f, sb = 0.f;
    for (int64_t i = 0; i < HW; ++i) {
      const float v = d[l * HW + i];
      sa += v;
      sb = std::fma(v, x[l * HW + i] - mu[l * HW + i], sb);
    }
    a[l] = sa;
    b[l] = sb;
  }
#endif
}

ET_ROW_FUNCTION void block_apply(const float* x, const float* scale, const float* shift, int64_t len, float* out) {
#if defined(__AVX512F__)
  int64_t i = 0;
  for (; i + 16 <= len; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(scale + i),
                                              _mm512_loadu_ps(shift + i)));
  if (i < len) {
    const __mmask16 m = __mmask16((1u << (len - i)) - 1);
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i),
                                                      _mm512_maskz_loadu_ps(m, scale + i),
                                                      _mm512_maskz_loadu_ps(m, shift + i)));
  }
#elif defined(ET_LANES16)
  // The explicit FMA of apply() and of the readers' relu(affine) run: a portable loop is contracted
  // to one only where the compiler chooses (-O2 and up), and ASan's -O1 build then differed.
  int64_t i = 0;
  for (; i + 16 <= len; i += 16)
    store16(Full{}, out + i, fmadd16(load16(Full{}, x + i), load16(Full{}, scale + i), load16(Full{}, shift + i)));
  if (i < len) {
    const Lanes16 m = lanes_first(len - i);
    store16(m, out + i, fmadd16(load16(m, x + i), load16(m, scale + i), load16(m, shift + i)));
  }
#else
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) out[i] = x[i] * scale[i] + shift[i];
#endif
}

void expand(const float* v, int64_t L, int64_t HW, float* out) {
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < HW; ++i) out[l * HW + i] = v[l];
}

void train_coefficients(float gamma, float beta, float mean, float invstd, float* scale, float* shift) {
  *scale = gamma * invstd;
  *shift = beta - mean * *scale;
}

void eval_coefficients(float gamma, float beta, float running_mean, float running_var, float eps, float* scale,
                       float* shift) {
  *scale = gamma / std::sqrt(running_var + eps);
  *shift = beta - running_mean * *scale;
}

// With x_hat = (x - mean) * invstd:
//   dbeta = sum dy, dgamma = sum dy * x_hat,
//   dx = gamma * invstd / M * (M * dy - dbeta - x_hat * dgamma)
GradCoefficients grad_coefficients(double sum_dy, double sum_dy_xmu, float gamma, float mu, float is, int64_t M) {
  GradCoefficients k;
  k.dbeta = float(sum_dy);
  k.dgamma = float(sum_dy_xmu) * is;
  const float g = gamma * is / float(M);
  const float coef = k.dgamma * is;  // multiplies (x - mu)
  // dx = a * dy + b * x + c0, hoisted so the loop is one FMA chain
  k.a = g * float(M);
  k.b = -g * coef;
  k.c0 = -g * k.dbeta + g * mu * coef;
  return k;
}

GradCoefficients channel_gradients(double sum_dy, double sum_dy_xmu, const Tensor& gamma, const Tensor& mean,
                                   const Tensor& invstd, int64_t c, int64_t M, Tensor& dgamma, Tensor& dbeta,
                                   bool accumulate) {
  const GradCoefficients k = grad_coefficients(sum_dy, sum_dy_xmu, gamma.f32()[c], mean.f32()[c], invstd.f32()[c], M);
  if (dbeta.defined()) dbeta.f32()[c] = accumulate ? dbeta.f32()[c] + k.dbeta : k.dbeta;
  if (dgamma.defined()) dgamma.f32()[c] = accumulate ? dgamma.f32()[c] + k.dgamma : k.dgamma;
  return k;
}

ET_ROW_FUNCTION void grad_apply(const float* dy, const float* x, const GradCoefficients& k, int64_t len, float* out,
                               bool accumulate) {
  const float a = k.a, b = k.b, c0 = k.c0;
#if defined(__AVX512F__) || defined(ET_LANES16)
  grad_apply_d(row_of(dy), x, a, b, c0, len, out, accumulate);
#else
  if (accumulate) {
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) out[i] += a * dy[i] + b * x[i] + c0;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) out[i] = a * dy[i] + b * x[i] + c0;
  }
#endif
}

ET_ROW_FUNCTION void block_grad_apply(const float* dy, const float* x, const float* a, const float* b, const float* c0,
                                      int64_t len, float* out, bool accumulate) {
  if (accumulate) {
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) out[i] += a[i] * dy[i] + b[i] * x[i] + c0[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) out[i] = a[i] * dy[i] + b[i] * x[i] + c0[i];
  }
}

}  // namespace bn_rows

// y [N,C,H,W] -> sums [2, >= N, C]: each plane's sums as channel_statistics takes them.
void CpuBackend::plane_sums(const Tensor& y, Tensor& sums) {
  const int64_t N = y.dim(0), C = y.dim(1), HW = y.dim(2) * y.dim(3);
  ET_CHECK(sums.dim(0) == 2 && sums.dim(1) >= N && sums.dim(2) == C, "plane sums of ", y.shape.str(), " into ",
           sums.shape.str());
  const float* yp = y.f32();
  float *s1 = sums.f32(), *s2 = s1 + sums.dim(1) * C;
  cpu::balanced_for(N * C, std::max<int64_t>(1, 16384 / HW), [&](int64_t p0, int64_t p1) {
    for (int64_t pl = p0; pl < p1; ++pl) bn_rows::plane_sums(yp + pl * HW, HW, s1 + pl, s2 + pl);
  });
}

// x, y [N,C,H,W]; mean, invstd, gamma, beta, running_* [C]
void CpuBackend::batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         Tensor& running_mean, Tensor& running_var, float momentum, float eps,
                                         Tensor& y, Tensor& mean, Tensor& invstd) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  const float* xp = x.f32();
  float* yp = y.f32();
  if (HW <= kSmallPlane) {  // channel blocks (batchnorm_rows.h)
    const int64_t L = small_plane_block_channels(HW, C), M = N * HW;
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < C; c0 += L) {
      const int64_t Lb = std::min(L, C - c0);
      double s[kSmallPlaneBlock] = {}, ss[kSmallPlaneBlock] = {};
      alignas(64) float s1[kSmallPlaneBlock], s2[kSmallPlaneBlock], scale[kSmallPlaneBlock], shift[kSmallPlaneBlock];
      for (int64_t n = 0; n < N; ++n) {
        bn_rows::block_sums(xp + (n * C + c0) * HW, Lb, HW, s1, s2);
        for (int64_t l = 0; l < Lb; ++l) s[l] += s1[l], ss[l] += s2[l];
      }
      for (int64_t l = 0; l < Lb; ++l) {
        bn_rows::finish_statistics(s[l], ss[l], M, c0 + l, momentum, eps, running_mean, running_var, mean, invstd);
        bn_rows::train_coefficients(gamma.f32()[c0 + l], beta.f32()[c0 + l], mean.f32()[c0 + l], invstd.f32()[c0 + l],
                                    &s1[l], &s2[l]);
      }
      bn_rows::expand(s1, Lb, HW, scale);
      bn_rows::expand(s2, Lb, HW, shift);
      for (int64_t n = 0; n < N; ++n)
        bn_rows::block_apply(xp + (n * C + c0) * HW, scale, shift, Lb * HW, yp + (n * C + c0) * HW);
    }
    return;
  }
  cpu::balanced_for(C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      bn_rows::channel_statistics(xp, N, C, HW, c, momentum, eps, running_mean, running_var, mean, invstd);
      float scale, shift;
      bn_rows::train_coefficients(gamma.f32()[c], beta.f32()[c], mean.f32()[c], invstd.f32()[c], &scale, &shift);
      for (int64_t n = 0; n < N; ++n) bn_rows::apply(xp + (n * C + c) * HW, scale, shift, HW, yp + (n * C + c) * HW);
    }
  });
}

void CpuBackend::batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                        const Tensor& running_mean, const Tensor& running_var, float eps, Tensor& y) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  if (HW <= kSmallPlane) {  // channel blocks, as the fused stacks apply them
    const int64_t L = small_plane_block_channels(HW, C);
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < C; c0 += L) {
      const int64_t Lb = std::min(L, C - c0);
      alignas(64) float sc[kSmallPlaneBlock], sh[kSmallPlaneBlock], scale[kSmallPlaneBlock], shift[kSmallPlaneBlock];
      for (int64_t l = 0; l < Lb; ++l)
        bn_rows::eval_coefficients(gamma.f32()[c0 + l], beta.f32()[c0 + l], running_mean.f32()[c0 + l],
                                   running_var.f32()[c0 + l], eps, &sc[l], &sh[l]);
      bn_rows::expand(sc, Lb, HW, scale);
      bn_rows::expand(sh, Lb, HW, shift);
      for (int64_t n = 0; n < N; ++n)
        bn_rows::block_apply(x.f32() + (n * C + c0) * HW, scale, shift, Lb * HW, y.f32() + (n * C + c0) * HW);
    }
    return;
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      float scale, shift;
      bn_rows::eval_coefficients(gamma.f32()[c], beta.f32()[c], running_mean.f32()[c], running_var.f32()[c], eps,
                                 &scale, &shift);
      bn_rows::apply(x.f32() + (n * C + c) * HW, scale, shift, HW, y.f32() + (n * C + c) * HW);
    }
}

void CpuBackend::batchnorm_backward_frozen(const Tensor& dy, const Tensor& gamma, const Tensor& running_var,
                                           float eps, Tensor& dx, bool accumulate) {
  const int64_t N = dy.dim(0), C = dy.dim(1), HW = dy.dim(2) * dy.dim(3);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      float scale, shift;  // the forward's scale
      bn_rows::eval_coefficients(gamma.f32()[c], 0.f, 0.f, running_var.f32()[c], eps, &scale, &shift);
      const float* g = dy.f32() + (n * C + c) * HW;
      float* o = dx.f32() + (n * C + c) * HW;
      if (accumulate)
        for (int64_t i = 0; i < HW; ++i) o[i] += g[i] * scale;
      else
        for (int64_t i = 0; i < HW; ++i) o[i] = g[i] * scale;
    }
}

namespace {
// 16-bit x rows are widened chunk by chunk into a stack buffer (bn_rows::x_f32).
constexpr int64_t kRowChunk = 4096;
}  // namespace

void CpuBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                    const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma,
                                    Tensor& dbeta, bool accumulate_params) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), M = N * HW;
  const float* dyp = dy.f32();
  // f32 rows are read whole; 16-bit rows in chunks (a chunk as long as a CIFAR row keeps the
  // reduction order, hence the results, identical to reading the decoded f32 copy).
  const int64_t chunk = x.dtype == DType::F32 ? HW : std::min(HW, kRowChunk);
  if (HW <= kSmallPlane)
    return batchnorm_backward_blocks(dy, x, gamma, mean, invstd, dx, accumulate_dx, dgamma, dbeta, accumulate_params);
  cpu::balanced_for(C, 1, [&](int64_t ca, int64_t cb) {
    for (int64_t c = ca; c < cb; ++c) {
      alignas(64) float buf[kRowChunk];
      const float mu = mean.f32()[c];
      double sdy = 0, sdyx = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i0 = 0; i0 < HW; i0 += chunk) {
          const int64_t len = std::min(chunk, HW - i0), base = (n * C + c) * HW + i0;
          if (i0 == 0 && n + 1 < N && x.dtype == DType::F32)  // the next plane (see channel_statistics)
            for (int64_t i = 0; i < std::min<int64_t>(HW, 64); i += 16) {
              __builtin_prefetch(dyp + base + C * HW + i);
              __builtin_prefetch(x.f32() + base + C * HW + i);
            }
          float a, b;
          const float* dr = dyp + base;
          bn_rows::grad_sums(bn_rows::row_of(dr), bn_rows::x_f32(x, base, len, buf), mu, len, &a, &b);
          sdy += a;
          sdyx += b;
        }
      const bn_rows::GradCoefficients k =
          bn_rows::channel_gradients(sdy, sdyx, gamma, mean, invstd, c, M, dgamma, dbeta, accumulate_params);
      if (!dx.defined()) continue;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i0 = 0; i0 < HW; i0 += chunk) {
          const int64_t len = std::min(chunk, HW - i0), base = (n * C + c) * HW + i0;
          bn_rows::grad_apply(dyp + base, bn_rows::x_f32(x, base, len, buf), k, len, dx.f32() + base, accumulate_dx);
        }
    }
  });
}

// Small planes: channel blocks (batchnorm_rows.h), each block's sums over n in order.
void CpuBackend::batchnorm_backward_blocks(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                           const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma,
                                           Tensor& dbeta, bool accumulate_params) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), M = N * HW;
  const int64_t L = small_plane_block_channels(HW, C);
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += L) {
    const int64_t Lb = std::min(L, C - c0), len = Lb * HW;
    alignas(64) float buf[kSmallPlaneBlock];
    alignas(64) float a[kSmallPlaneBlock], b[kSmallPlaneBlock], c[kSmallPlaneBlock];
    alignas(64) float ae[kSmallPlaneBlock], be[kSmallPlaneBlock], ce[kSmallPlaneBlock];
    double sdy[kSmallPlaneBlock] = {}, sdyx[kSmallPlaneBlock] = {};
    bn_rows::expand(mean.f32() + c0, Lb, HW, ae);  // the mean per element
    for (int64_t n = 0; n < N; ++n) {
      const int64_t base = (n * C + c0) * HW;
      bn_rows::block_grad_sums(dy.f32() + base, bn_rows::x_f32(x, base, len, buf), ae, Lb, HW, a, b);
      for (int64_t l = 0; l < Lb; ++l) sdy[l] += a[l], sdyx[l] += b[l];
    }
    for (int64_t l = 0; l < Lb; ++l) {
      const int64_t ch = c0 + l;
      const bn_rows::GradCoefficients k =
          bn_rows::channel_gradients(sdy[l], sdyx[l], gamma, mean, invstd, ch, M, dgamma, dbeta, accumulate_params);
      a[l] = k.a, b[l] = k.b, c[l] = k.c0;
    }
    if (!dx.defined()) continue;
    bn_rows::expand(a, Lb, HW, ae);
    bn_rows::expand(b, Lb, HW, be);
    bn_rows::expand(c, Lb, HW, ce);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t base = (n * C + c0) * HW;
      bn_rows::block_grad_apply(dy.f32() + base, bn_rows::x_f32(x, base, len, buf), ae, be, ce, len, dx.f32() + base,
                                accumulate_dx);
    }
  }
}

}  // namespace et
