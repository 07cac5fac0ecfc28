// Fused stacks without a BN (engine/fused_stack.h, docs/fusion.md): a ReLU, then a max or average
// pool whose windows do not overlap (VGG without BN: conv, ReLU, 2x2 max-pool). Nothing here
// reduces over the batch, so the work goes plane by plane (threads over planes, in memory order).
//
// Forward: x -> r = relu(x) in scratch -> y = pool(r), and in training the pass bits of the plane:
// bit i is set where dx[i] takes a gradient, i.e. r[i] > 0 and, for a max-pool, i is its window's
// first maximum (where max_backward routes dy). Each input lies in at most one window, so one bit
// per element of x holds all the backward needs; the unfused layers keep r instead (the ReLU's
// mask and the max-pool's input), 32 bits per element dense.
//
// Backward: dx = pass ? (the pool's gradient of dy) : +0, with the unfused layers' arithmetic:
// the pool's gradient starts from +0 and adds dy (max: once, at the first maximum; average: its
// window's share), then the ReLU's rule keeps it or writes +0. So the results equal the unfused
// layers' bit for bit (the stash's lossy formats and activation pruning aside: the unfused max-pool
// searches its window in the stored r, the fused one in the exact r; docs/fusion.md).
//
// AVX-512: VGG's 2x2 stride-2 pool runs the whole forward in registers (relu_maxpool_2x2, no r
// plane), and the max-pool backward gathers each row's dy 16 columns at a time. The portable
// loops serve every other pool, and every pool on AVX2 / NEON; tests/test_fusion.cpp checks both
// against the layers.
#include <omp.h>

#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/fused_common.h"
#include "backends/cpu/pool_planes.h"
#include "memory/bitmap.h"

namespace et {

using namespace fused_planes;

namespace {

inline bool bit(const uint64_t* w, int64_t i) { return (w[i >> 6] >> (i & 63)) & 1; }

#if defined(__AVX512F__)
// Bits i .. i + 15 of a plane's `words` words (those past its last word read as 0).
inline uint32_t bits16(const uint64_t* w, int64_t words, int64_t i) {
  const int64_t k = i >> 6, off = i & 63;
  uint64_t v = w[k] >> off;
  if (off > 48 && k + 1 < words) v |= w[k + 1] << (64 - off);
  return uint32_t(v & 0xFFFF);
}
#endif

// The output row (column) whose window holds input row (column) i, or -1: windows do not overlap.
inline int64_t window_of(int64_t i, int64_t stride, int64_t pad, int64_t window, int64_t outputs) {
  const int64_t o = (i + pad) / stride;
  return i + pad - o * stride < window && o < outputs ? o : -1;
}

// The pass bits of one plane: r > 0 (average pool), or r > 0 at a window's first maximum (max
// pool; `sel` receives r at the first maxima and +0 elsewhere). Each word is built in a register:
// OR-ing bit after bit into memory would chain every output through a store.
void pass_bits(const FusedStage& pool, const float* r, const int32_t* arg, int64_t HW, int64_t PQ, float* sel,
               uint64_t* w) {
  const float* v = r;
  if (pool.kind == FusedKind::MaxPool) {
    std::memset(sel, 0, sizeof(float) * size_t(HW));
    for (int64_t o = 0; o < PQ; ++o)
      if (arg[o] >= 0) sel[arg[o]] = r[arg[o]];
    v = sel;
  }
  const int64_t words = (HW + 63) / 64;
  for (int64_t k = 0; k < words; ++k) {
    const int64_t i0 = k * 64, n = std::min<int64_t>(64, HW - i0);
    uint64_t m = 0;
#if defined(__AVX512F__)
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
      const __m512 x = _mm512_maskz_loadu_ps(lanes, v + i0 + j);
      m |= uint64_t(_mm512_mask_cmp_ps_mask(lanes, x, _mm512_setzero_ps(), _CMP_GT_OQ)) << j;
    }
#else
    for (int64_t t = 0; t < n; ++t) m |= uint64_t(v[i0 + t] > 0.f) << t;
#endif
    w[k] = m;
  }
}

// r = relu(x), y = pool(r) of one plane; with `arg`, also the max-pool's first maxima.
void relu_pool_plane(const FusedStage& pool, const pool_planes::Plane& pg, const float* x, float* r, float* y,
                     int32_t* arg) {
  const int64_t HW = pg.H * pg.W;
#pragma omp simd
  for (int64_t i = 0; i < HW; ++i) r[i] = x[i] > 0.f ? x[i] : 0.f;  // relu_forward's rule (NaN -> 0)
  if (pool.kind == FusedKind::AvgPool)
    pool_planes::avg_forward(pg, r, y);
  else if (arg)
    pool_planes::max_forward_args(pg, r, y, arg);
  else
    pool_planes::max_forward(pg, r, y);
}

#if defined(__AVX512F__)
// Spreads the 16 bits of x to the even bits of the result.
inline uint32_t even_bits(uint32_t x) {
#if defined(__BMI2__)
  return _pdep_u32(x, 0x55555555u);
#endif
  x = (x | x << 8) & 0x00FF00FFu;
  x = (x | x << 4) & 0x0F0F0F0Fu;
  x = (x | x << 2) & 0x33333333u;
  return (x | x << 1) & 0x55555555u;
}

// ORs up to 32 bits into a plane's words at bit `pos` (the plane has `words` words).
inline void or_bits(uint64_t* w, int64_t words, int64_t pos, uint32_t bits) {
  const int64_t k = pos >> 6, off = pos & 63;
  w[k] |= uint64_t(bits) << off;
  if (off > 32 && k + 1 < words) w[k + 1] |= uint64_t(bits) >> (64 - off);
}

// VGG's pool, 2x2 windows at stride 2 without padding: ReLU, the windows' first maxima and the
// pass bits of one plane in registers, 16 outputs at a time, without the r plane. The taps go in
// the reference's order with its strict compare from -FLT_MAX (r >= +0, so the first tap always
// starts the maximum); the last tap that raised it is the first maximum.
inline bool relu_maxpool_2x2_applies(const pool_planes::Plane& g) {
  return g.R == 2 && g.S == 2 && g.stride_h == 2 && g.stride_w == 2 && g.pad_h == 0 && g.pad_w == 0;
}
void relu_maxpool_2x2(const pool_planes::Plane& g, const float* x, float* y, uint64_t* pass, int64_t words) {
  if (pass) std::memset(pass, 0, sizeof(uint64_t) * size_t(words));
  const __m512 zero = _mm512_setzero_ps();
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  auto relu = [&](const float* p, __mmask16 m) {  // relu_forward's rule: NaN and -0 -> +0
    const __m512 v = _mm512_maskz_loadu_ps(m, p);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ), v);
  };
  for (int64_t p = 0; p < g.P; ++p) {
    const float* ra = x + 2 * p * g.W;
    const float* rb = ra + g.W;
    for (int64_t q0 = 0; q0 < g.Q; q0 += 16) {
      const int64_t n = std::min<int64_t>(16, g.Q - q0), cols = 2 * n;
      const __mmask16 lanes = __mmask16((1u << n) - 1u);
      const __mmask16 lo = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1u);
      const __mmask16 hi = cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1u);
      const __m512 a0 = relu(ra + 2 * q0, lo), a1 = relu(ra + 2 * q0 + 16, hi);
      const __m512 b0 = relu(rb + 2 * q0, lo), b1 = relu(rb + 2 * q0 + 16, hi);
      const __m512 t1 = _mm512_permutex2var_ps(a0, odd, a1), t2 = _mm512_permutex2var_ps(b0, even, b1);
      const __m512 t3 = _mm512_permutex2var_ps(b0, odd, b1);
      __m512 m = _mm512_permutex2var_ps(a0, even, a1);
      const __mmask16 k1 = _mm512_cmp_ps_mask(t1, m, _CMP_GT_OQ);
      m = _mm512_mask_mov_ps(m, k1, t1);
      const __mmask16 k2 = _mm512_cmp_ps_mask(t2, m, _CMP_GT_OQ);
      m = _mm512_mask_mov_ps(m, k2, t2);
      const __mmask16 k3 = _mm512_cmp_ps_mask(t3, m, _CMP_GT_OQ);
      m = _mm512_mask_mov_ps(m, k3, t3);
      _mm512_mask_storeu_ps(y + p * g.Q + q0, lanes, m);
      if (!pass) continue;
      const uint32_t on = _mm512_mask_cmp_ps_mask(lanes, m, zero, _CMP_GT_OQ);
      const uint32_t w3 = k3 & on, w2 = k2 & ~k3 & on, w1 = k1 & ~k2 & ~k3 & on, w0 = ~(k1 | k2 | k3) & on;
      or_bits(pass, words, 2 * p * g.W + 2 * q0, even_bits(w0) | even_bits(w1) << 1);
      or_bits(pass, words, (2 * p + 1) * g.W + 2 * q0, even_bits(w2) | even_bits(w3) << 1);
    }
  }
}
#endif

}  // namespace

void CpuBackend::relu_pool_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws) {
  const FusedStage &head = s.stages[0], &pool = s.stages[1];
  const int64_t N = t.x.dim(0), planes = N * s.C, HW = head.H * head.W, PQ = pool.P * pool.Q;
  ET_CHECK(s.stages.size() == 2 && head.kind == FusedKind::Relu, "fused stack without BN: ReLU, pool");
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  const int64_t wpp = pass_words_per_plane(head);
  uint64_t* pass = training ? static_cast<uint64_t*>(t.pass.data) : nullptr;
  ET_CHECK(!training || (t.pass.defined() && t.pass.numel() >= planes * wpp * 8), "fused stack: pass bits");
  const pool_planes::Plane pg = pool_planes::of(pool);
  const bool want_mask = training && mask && mask->bits;  // y = pool(relu(x)) >= +0
  const bool plane_words = PQ % 64 == 0;
  const uint32_t tb = want_mask ? bitmap::keep_threshold_bits(mask->prune_threshold) : 0;
  const float* xp = t.x.f32();
  float* yp = t.y.f32();
  const int64_t per_thread = thread_floats(s), plane = max_plane(s);
  int64_t kept = 0;
#pragma omp parallel reduction(+ : kept)
  {
    float* r = static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread;
    int32_t* arg = reinterpret_cast<int32_t*>(r + plane);
    float* sel = r + 2 * plane;
#pragma omp for schedule(static)
    for (int64_t pl = 0; pl < planes; ++pl) {
      const float* x = xp + pl * HW;
      float* y = yp + pl * PQ;
#if defined(__AVX512F__)
      if (pool.kind == FusedKind::MaxPool && relu_maxpool_2x2_applies(pg)) {
        relu_maxpool_2x2(pg, x, y, pass ? pass + pl * wpp : nullptr, wpp);
      } else
#endif
      {
        relu_pool_plane(pool, pg, x, r, y, pass ? arg : nullptr);
        if (pass) pass_bits(pool, r, arg, HW, PQ, sel, pass + pl * wpp);
      }
      if (want_mask && plane_words) kept += mask_words(yp, pl * PQ / 64, (pl + 1) * PQ / 64, tb, mask->bits);
    }
  }
  if (want_mask) finish_output_mask(t.y, mask, plane_words, kept);
}

void CpuBackend::relu_pool_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws) {
  const FusedStage &head = s.stages[0], &pool = s.stages[1];
  const int64_t N = g.dy.dim(0), planes = N * s.C, HW = head.H * head.W, PQ = pool.P * pool.Q;
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  if (!g.dx.defined()) return;
  const int64_t wpp = pass_words_per_plane(head);
  const uint64_t* pass = static_cast<const uint64_t*>(t.pass.data);
  const pool_planes::Plane pg = pool_planes::of(pool);
  const float* dyp = g.dy.f32();
  float* dxp = g.dx.f32();
  const bool acc = g.dx_accumulate;
  const int64_t per_thread = thread_floats(s);
#pragma omp parallel
  {
    float* gp = static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread;  // the pool's gradient
    int32_t* qmap = reinterpret_cast<int32_t*>(gp + max_plane(s));  // input column -> its window's
    for (int64_t x = 0; x < pg.W; ++x) qmap[x] = int32_t(window_of(x, pg.stride_w, pg.pad_w, pg.S, pg.Q));
#pragma omp for schedule(static)
    for (int64_t pl = 0; pl < planes; ++pl) {
      const uint64_t* w = pass + pl * wpp;
      const float* dy = dyp + pl * PQ;
      float* dx = dxp + pl * HW;
      if (pool.kind == FusedKind::MaxPool) {
        // A set bit lies in a window (its first maximum): dx = +0 + dy of that window, else +0.
        for (int64_t h = 0; h < pg.H; ++h) {
          const int64_t p = window_of(h, pg.stride_h, pg.pad_h, pg.R, pg.P);
          const float* dyr = dy + (p < 0 ? 0 : p * pg.Q);
          const int64_t i0 = h * pg.W;
          float* d = dx + i0;
#if defined(__AVX512F__)
          // 16 columns at a time: the set lanes gather their window's dy; +0 + dy, or +0.
          const __m512 zero = _mm512_setzero_ps();
          for (int64_t x0 = 0; x0 < pg.W; x0 += 16) {
            const int64_t n = std::min<int64_t>(16, pg.W - x0);
            const __mmask16 lanes = __mmask16((1u << n) - 1u);
            const __mmask16 on = p >= 0 ? __mmask16(bits16(w, wpp, i0 + x0) & lanes) : __mmask16(0);
            const __m512i q = _mm512_maskz_loadu_epi32(lanes, qmap + x0);
            __m512 v = _mm512_maskz_add_ps(on, zero, _mm512_mask_i32gather_ps(zero, on, q, dyr, 4));
            if (acc) v = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, d + x0), v);
            _mm512_mask_storeu_ps(d + x0, lanes, v);
          }
#else
          for (int64_t x = 0; x < pg.W; ++x) {
            const float v = p >= 0 && bit(w, i0 + x) ? 0.f + dyr[qmap[x]] : 0.f;
            d[x] = acc ? d[x] + v : v;
          }
#endif
        }
      } else {
        std::memset(gp, 0, sizeof(float) * size_t(HW));
        pool_planes::avg_backward(pg, dy, gp);
        for (int64_t i = 0; i < HW; ++i) {
          const float v = bit(w, i) ? gp[i] : 0.f;
          dx[i] = acc ? dx[i] + v : v;
        }
      }
    }
  }
}

}  // namespace et
