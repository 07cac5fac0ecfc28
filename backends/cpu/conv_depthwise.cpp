// Depthwise conv (groups == C == K) over flattened padded planes (see conv_direct.h), any stride.
// Per channel plane:
//   forward:  tile[j] = sum_t w[t] * xp[j + off[t]] over the stride-1 domain, output picks every
//             stride-th row/column (a stride-2 layer computes 4x the needed sums; they are cheap
//             next to the 1x1 convs around it, and it keeps one vector loop for every case).
//   data:     the same over dy zero-upsampled by the stride and padded by R-1-pad, kernel flipped.
//   weight:   dw[t] = sum_{n,j} dyu[j] * xp[j + off[t]], dyu = dy upsampled into the stride-1 domain.
// Forward / data split images over threads; weight splits channels (each channel summed in a fixed
// order by one thread), so all three are deterministic.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_simd.h"
#include "memory/stored_reader.h"

namespace et::cpu {
namespace {

struct Plane {  // padded plane geometry + tap offsets
  int64_t Hp, Wp, L, rows, Jr;
  int64_t off[kMaxTaps];
  int RS;
};

Plane make_plane(int64_t Hp, int64_t Wp, int64_t R, int64_t S) {
  Plane p;
  p.Hp = Hp;
  p.Wp = Wp;
  p.L = plane_stride(Hp, Wp, S);
  p.rows = Hp - R + 1;
  p.Jr = round16(p.rows * Wp);
  p.RS = int(R * S);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t s = 0; s < S; ++s) p.off[r * S + s] = r * Wp + s;
  return p;
}

Plane fwd_plane(const Conv2dGeom& g) { return make_plane(g.H + 2 * g.pad_h, g.W + 2 * g.pad_w, g.R, g.S); }

// dy upsampled by the stride ((P-1)*s+1 rows) and padded R-1-pad around, plus the rows / columns the
// forward window never reached ((H + 2*pad - R) % stride) at the bottom / right.
Plane data_plane(const Conv2dGeom& g) {
  const int64_t rem_h = (g.H + 2 * g.pad_h - g.R) % g.stride_h, rem_w = (g.W + 2 * g.pad_w - g.S) % g.stride_w;
  const int64_t Hp = (g.P - 1) * g.stride_h + 1 + 2 * (g.R - 1 - g.pad_h) + rem_h;
  const int64_t Wp = (g.Q - 1) * g.stride_w + 1 + 2 * (g.S - 1 - g.pad_w) + rem_w;
  return make_plane(Hp, Wp, g.R, g.S);
}

// tile[j] = sum_t w[t] * xp[j + off[t]], 4 vectors at a time for independent FMA chains. The
// weights stay scalars (fma_scalar): on NEON a splat of each of 9 taps took 36 of the 32 q
// registers, the loop reloaded them and spilled loads to the stack on every tap.
template <class V>
void dw_corr(const float* xp, const Plane& p, const float* w, float* tile) {
  int64_t j = 0;
  for (; j + 64 <= p.Jr; j += 64) {
    V a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
    for (int t = 0; t < p.RS; ++t) {
      const float* s = xp + j + p.off[t];
      const float wt = w[t];
      a0.fma_scalar(wt, V::load(s));
      a1.fma_scalar(wt, V::load(s + 16));
      a2.fma_scalar(wt, V::load(s + 32));
      a3.fma_scalar(wt, V::load(s + 48));
    }
    a0.store(tile + j); a1.store(tile + j + 16); a2.store(tile + j + 32); a3.store(tile + j + 48);
  }
  for (; j < p.Jr; j += 16) {
    V a = V::zero();
    for (int t = 0; t < p.RS; ++t) a.fma_scalar(w[t], V::load(xp + j + p.off[t]));
    a.store(tile + j);
  }
}

// acc[t] += dyu[j] * xp[j + off[t]] over the domain (vector partial sums kept across images).
template <class V>
void dw_wgrad(const float* dyu, const float* xp, const Plane& p, V* acc) {
  for (int64_t j = 0; j < p.Jr; j += 16) {
    const V d = V::load(dyu + j);
    for (int t = 0; t < p.RS; ++t) acc[t].fma(d, V::load(xp + j + p.off[t]));
  }
}

template <class V>
void forward_impl(const Conv2dGeom& g, const ConvInput& x, const float* w, const float* b, float* y, float* ws,
                  float* sum1, float* sum2) {
  const Plane p = fwd_plane(g);
  const int64_t per_thread = p.L + p.Jr + 32;
#pragma omp parallel
  {
    float* xp = ws + omp_get_thread_num() * per_thread;
    float* tile = xp + p.L;
    std::memset(xp, 0, sizeof(float) * size_t(p.L));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t c = 0; c < g.C; ++c) {
        x.place(g.C, n * g.C + c, g.H, g.W, g.pad_h, g.pad_w, p.Wp, xp);
        dw_corr<V>(xp, p, w + c * p.RS, tile);
        // stride_h == stride_w is not required: rows and columns are picked separately.
        for (int64_t r = 0; r < g.P; ++r) {
          const float* t = tile + r * g.stride_h * p.Wp;
          float* d = y + ((n * g.C + c) * g.P + r) * g.Q;
          const float bias = b ? b[c] : 0.f;
          for (int64_t q = 0; q < g.Q; ++q) d[q] = t[q * g.stride_w] + bias;
        }
        // The plane's BN sums while it is in L1 (the sweep Backend::plane_sums makes, the same bits).
        const int64_t pl = n * g.C + c;
        if (sum1) bn_rows::plane_sums(y + pl * g.P * g.Q, g.P * g.Q, sum1 + pl, sum2 + pl);
      }
  }
}

template <class V>
void backward_data_impl(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate, float* ws) {
  const Plane p = data_plane(g);  // p.rows == H
  const int64_t per_thread = p.L + p.Jr + 32 + kMaxTaps;
#pragma omp parallel
  {
    float* dyp = ws + omp_get_thread_num() * per_thread;
    float* tile = dyp + p.L;
    float* wf = tile + p.Jr;
    std::memset(dyp, 0, sizeof(float) * size_t(p.L));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t c = 0; c < g.C; ++c) {
        for (int t = 0; t < p.RS; ++t) wf[t] = w[c * p.RS + p.RS - 1 - t];  // flipped kernel
        place_plane(dy + (n * g.C + c) * g.P * g.Q, g.P, g.Q, g.stride_h, g.R - 1 - g.pad_h, g.S - 1 - g.pad_w, p.Wp,
                    dyp);
        dw_corr<V>(dyp, p, wf, tile);
        extract_plane(tile, p.Wp, g.H, g.W, 1, 0.f, accumulate, dx + (n * g.C + c) * g.H * g.W);
      }
  }
}

// Weight gradient, per thread: x plane, dy plane, a decoded stashed x plane, N value cursors.
int64_t wgrad_per_thread(const Conv2dGeom& g, const Plane& p) {
  return p.L + p.Jr + round16(g.H * g.W) + round16(2 * g.N) + 32;  // 64-byte multiples: threads stay aligned
}

// x: f32 or a stash encoding. Channel c reads planes (n, c) for every n: one value cursor per
// image (StoredReader::read_at), set up when a thread starts its channel range, then advanced.
template <class V>
void backward_weight_impl(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db, bool accumulate,
                          float* ws) {
  const Plane p = fwd_plane(g);  // stride-1 domain: p.rows >= (P-1)*stride + 1
  const int64_t per_thread = wgrad_per_thread(g, p), HW = g.H * g.W;
#pragma omp parallel
  {
    float* xp = ws + omp_get_thread_num() * per_thread;
    float* dyu = xp + p.L;
    float* piece = dyu + p.Jr;
    auto* cursor = reinterpret_cast<int64_t*>(piece + round16(HW));
    StoredReader xr(x, piece, HW);
    int64_t next_c = -1;
    std::memset(xp, 0, sizeof(float) * size_t(p.L + p.Jr));
#pragma omp for schedule(static)
    for (int64_t c = 0; c < g.C; ++c) {
      if (xr.is_bitmap() && c != next_c) {
        int64_t at = 0, before = 0;  // kept values before element `at`
        for (int64_t n = 0; n < g.N; ++n) {
          const int64_t b = (n * g.C + c) * HW;
          before += xr.kept(at, b - at);
          cursor[n] = before;
          at = b;
        }
      }
      next_c = c + 1;
      V acc[kMaxTaps];
      for (int t = 0; t < p.RS; ++t) acc[t] = V::zero();
      float bsum = 0.f;
      for (int64_t n = 0; n < g.N; ++n) {
        place_plane(xr.read_at((n * g.C + c) * HW, HW, &cursor[n]), g.H, g.W, 1, g.pad_h, g.pad_w, p.Wp, xp);
        const float* src = dy + (n * g.C + c) * g.P * g.Q;
        place_plane(src, g.P, g.Q, g.stride_h, 0, 0, p.Wp, dyu);
        if (db)
          for (int64_t i = 0; i < g.P * g.Q; ++i) bsum += src[i];
        dw_wgrad<V>(dyu, xp, p, acc);
      }
      for (int t = 0; t < p.RS; ++t) {
        const float s = acc[t].hsum();
        dw[c * p.RS + t] = accumulate ? dw[c * p.RS + t] + s : s;
      }
      if (db) db[c] = accumulate ? db[c] + bsum : bsum;
    }
  }
}

}  // namespace

bool depthwise_applies(const Conv2dGeom& g, ConvPass pass) {
  if (!(g.groups == g.C && g.K == g.C) || g.R * g.S > kMaxTaps) return false;
  // place_plane upsamples rows and columns by one factor: equal strides only.
  if (g.stride_h != g.stride_w) return false;
  if (pass == ConvPass::BackwardData && (g.pad_h > g.R - 1 || g.pad_w > g.S - 1)) return false;
  return true;
}

size_t depthwise_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  const Plane p = pass == ConvPass::BackwardData ? data_plane(g) : fwd_plane(g);
  const int64_t per_thread = pass == ConvPass::BackwardWeight ? wgrad_per_thread(g, p) : p.L + p.Jr + 32 + kMaxTaps;
  return size_t(threads) * size_t(per_thread) * sizeof(float);
}

void depthwise_forward(const Conv2dGeom& g, const Tensor& xt, const float* w, const float* b, float* y, void* ws,
                       float* sum1, float* sum2) {
  const ConvInput x(xt);
  if (scalar_forced()) forward_impl<VScalar>(g, x, w, b, y, static_cast<float*>(ws), sum1, sum2);
  else forward_impl<VNative>(g, x, w, b, y, static_cast<float*>(ws), sum1, sum2);
}

void depthwise_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                             void* ws) {
  if (scalar_forced()) backward_data_impl<VScalar>(g, dy, w, dx, accumulate, static_cast<float*>(ws));
  else backward_data_impl<VNative>(g, dy, w, dx, accumulate, static_cast<float*>(ws));
}

void depthwise_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                               bool accumulate, void* ws) {
  if (scalar_forced()) backward_weight_impl<VScalar>(g, x, dy, dw, db, accumulate, static_cast<float*>(ws));
  else backward_weight_impl<VNative>(g, x, dy, dw, db, accumulate, static_cast<float*>(ws));
}

}  // namespace et::cpu
