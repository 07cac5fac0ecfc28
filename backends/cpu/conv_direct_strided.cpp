// Stride-2 direct kernels by phases: the forward and the data gradient of a stride-2 conv as
// stride-1 correlations over phase planes, run by the direct kernels' own register blocks
// (conv_direct.cpp's corr_planes_*): no multiply-add is spent on positions the stride skips.
//
// Forward. Output (p, q) reads xpad[2p + r][2q + s] for tap (r, s). Split the padded input into its
// four phases, plane (a, b) holding xpad[2i + a][2j + b]; tap (r, s) then reads phase (r % 2, s % 2)
// at (p + r / 2, q + s / 2): a stride-1 read. Staged per channel as four planes of Hq x Wq
// (Hq = P + (R - 1) / 2, Wq = Q + (S - 1) / 2; the planes one after another, L floats a channel),
// every tap is one offset from the output position p * Wq + q, and the 9 taps of a 3x3 window are
// a 9-tap correlation with the weights in their own order: the direct forward's arithmetic (the
// same FMAs per element in the same order, c outer, t inner).
//
// Data gradient. dx[h][w] takes dy[p][q] * w[r][s] where h = 2p + r - pad_h, w = 2q + s - pad_w.
// The dx positions of one parity (a, b) (h = 2i + a, w = 2j + b) take only the taps with
// r = a + pad_h (mod 2), s = b + pad_w (mod 2), from dy[i + (a + pad_h - r) / 2][j + (b + pad_w - s) / 2]:
// per phase a stride-1 correlation of dy (zero padded) with a sub-kernel (3x3: 1, 2, 2 and 4 taps),
// written to a buffer and placed into dx's rows by twos. The zero-upsampled dy of the stride-1
// form (3 multiply-adds in 4 on zeros) never exists.
//
// Where output rows are whole vectors (Q, resp. the phases' width, a multiple of 16: ResNet's
// 32x32 -> 16x16 downsampling) the row form runs, else the flat form (a tile over the padded width,
// then the valid columns). Images are balanced over the threads (balance.h).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/balance.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/carve.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/fused_elementwise.h"

namespace et::cpu {

namespace {

int64_t round_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// ---------------------------------------------------------------- forward

struct FwdPhases {
  int64_t Hq, Wq, Lq, L;  // a phase plane's rows and row width, its stride, a channel's 4 planes
  int64_t Jr;             // the flat form's output domain, P rows of Wq, rounded up to 16
  int64_t off[kMaxTaps];  // tap (r, s) -> phase (r % 2, s % 2), row r / 2, column s / 2
  int RS;
};

FwdPhases fwd_phases(const Conv2dGeom& g) {
  FwdPhases f;
  f.Hq = g.P + (g.R - 1) / 2;
  f.Wq = g.Q + (g.S - 1) / 2;
  // Slack past a plane's rows: the flat form's last vector and its taps read up to Wq + 16 floats
  // beyond (junk lanes, dropped), never past the channel's last plane.
  f.Lq = round_to(f.Hq * f.Wq + f.Wq + 16, 16);
  f.L = 4 * f.Lq;
  f.Jr = round_to(g.P * f.Wq, 16);
  f.RS = int(g.R * g.S);
  for (int64_t r = 0; r < g.R; ++r)
    for (int64_t s = 0; s < g.S; ++s)
      f.off[r * g.S + s] = ((r % 2) * 2 + s % 2) * f.Lq + (r / 2) * f.Wq + s / 2;
  return f;
}

// Plane src [H, W] into its four phase planes at dst (phase (a, b) at dst + (2a + b) * Lq):
// element (i, j) of phase (a, b) is src[2i + a - pad_h][2j + b - pad_w]. Only positions inside src
// are written: the rest stay zero from the workspace's first clearing, the same every image.
void place_phases(const Conv2dGeom& g, const FwdPhases& f, const float* src, float* dst) {
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      float* d = dst + (2 * a + b) * f.Lq;
      // j with 0 <= 2j + b - pad_w < W
      const int64_t last = g.W - 1 + g.pad_w - b;
      const int64_t j0 = std::max<int64_t>(0, (g.pad_w - b + 1) / 2);
      const int64_t j1 = last < 0 ? 0 : std::min<int64_t>(f.Wq, last / 2 + 1);
      for (int64_t i = 0; i < f.Hq; ++i) {
        const int64_t h = 2 * i + a - g.pad_h;
        if (h < 0 || h >= g.H) continue;
        const float* s = src + h * g.W;
        float* row = d + i * f.Wq;
        for (int64_t j = j0; j < j1; ++j) row[j] = s[2 * j + b - g.pad_w];
      }
    }
}

// ---------------------------------------------------------------- data gradient

struct DataPhase {
  int taps = 0;
  int64_t off[kMaxTaps] = {};   // tap -> offset in the padded dy plane from the phase position
  int64_t wtap[kMaxTaps] = {};  // tap -> r * S + s in the weight tensor
  int64_t Ha = 0, Wb = 0;       // the phase's dx positions: rows 2i + a, columns 2j + b
  int a = 0, b = 0;
};

struct DataPhases {
  DataPhase ph[4];
  int64_t top, left;      // dy placed at (top, left) of its padded plane
  int64_t Hd, Wd, Ld;     // padded dy plane rows, row width, stride
  int64_t Jr;             // the flat form's largest phase domain (Ha rows of Wd), rounded up to 16
  bool rows;              // every phase's width is whole vectors: the row form
};

DataPhases data_phases(const Conv2dGeom& g) {
  DataPhases d;
  // dy row of tap r in phase a: i + du, du = (a + pad_h - r) / 2 (exact: the parity matches).
  int64_t du_min = 0, du_max = 0, dv_min = 0, dv_max = 0;
  for (int a = 0; a < 2; ++a)
    for (int64_t r = 0; r < g.R; ++r)
      if ((a + g.pad_h - r) % 2 == 0) du_min = std::min(du_min, (a + g.pad_h - r) / 2), du_max = std::max(du_max, (a + g.pad_h - r) / 2);
  for (int b = 0; b < 2; ++b)
    for (int64_t s = 0; s < g.S; ++s)
      if ((b + g.pad_w - s) % 2 == 0) dv_min = std::min(dv_min, (b + g.pad_w - s) / 2), dv_max = std::max(dv_max, (b + g.pad_w - s) / 2);
  d.top = -du_min, d.left = -dv_min;
  const int64_t Hmax = (g.H + 1) / 2, Wmax = (g.W + 1) / 2;
  d.Hd = std::max(d.top + g.P, d.top + Hmax + du_max);
  d.Wd = std::max(d.left + g.Q, d.left + Wmax + dv_max);
  d.Ld = round_to(d.Hd * d.Wd + d.Wd + 16, 16);
  d.Jr = round_to(Hmax * d.Wd, 16);
  d.rows = true;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      DataPhase& f = d.ph[2 * a + b];
      f.a = a, f.b = b;
      f.Ha = (g.H - a + 1) / 2, f.Wb = (g.W - b + 1) / 2;
      d.rows = d.rows && rows_apply(f.Wb);
      for (int64_t r = 0; r < g.R; ++r) {
        if ((a + g.pad_h - r) % 2 != 0) continue;
        for (int64_t s = 0; s < g.S; ++s) {
          if ((b + g.pad_w - s) % 2 != 0) continue;
          const int64_t du = (a + g.pad_h - r) / 2 + d.top, dv = (b + g.pad_w - s) / 2 + d.left;
          f.off[f.taps] = du * d.Wd + dv;
          f.wtap[f.taps] = r * g.S + s;
          ++f.taps;
        }
      }
    }
  return d;
}

// Phase f's weights for the correlation (out = Cg channels of dx, in = Kg of dy): [Cr / MR][Kg][taps][MR],
// rows >= Cg zero. w [Kg][Cg][RS] (one group).
void pack_phase_weights(const Conv2dGeom& g, const DataPhase& f, const float* w, int64_t Kg, int64_t Cg,
                        float* wpk) {
  const int64_t RS = g.R * g.S, Cr = round_to(Cg, kDirectMR);
  for (int64_t ob = 0; ob < Cr / kDirectMR; ++ob)
    for (int64_t k = 0; k < Kg; ++k)
      for (int t = 0; t < f.taps; ++t)
        for (int i = 0; i < kDirectMR; ++i) {
          const int64_t c = ob * kDirectMR + i;
          *wpk++ = c < Cg ? w[(k * Cg + c) * RS + f.wtap[t]] : 0.f;
        }
}

// dx plane [H, W] (+)= phase f's values src (row stride ld) at rows 2i + a, columns 2j + b.
void place_phase_values(const Conv2dGeom& g, const DataPhase& f, const float* src, int64_t ld, bool accumulate,
                        float* dx) {
  for (int64_t i = 0; i < f.Ha; ++i) {
    float* d = dx + (2 * i + f.a) * g.W + f.b;
    const float* s = src + i * ld;
    if (accumulate)
      for (int64_t j = 0; j < f.Wb; ++j) d[2 * j] += s[j];
    else
      for (int64_t j = 0; j < f.Wb; ++j) d[2 * j] = s[j];
  }
}

}  // namespace

bool direct_strided_applies(const Conv2dGeom& g, ConvPass pass) {
  if (g.stride_h != 2 || g.stride_w != 2 || g.R * g.S > kMaxTaps || g.P <= 0 || g.Q <= 0) return false;
  if (g.pad_h >= g.R || g.pad_w >= g.S) return false;  // every window meets the plane
  return pass == ConvPass::Forward || pass == ConvPass::BackwardData;
}

size_t direct_strided_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S;
  int64_t shared = 0, per_thread = 0;
  if (pass == ConvPass::Forward) {
    const FwdPhases f = fwd_phases(g);
    shared = g.groups * round_to(Kg, kDirectMR) * Cg * RS;
    per_thread = g.C * f.L + round_to(Kg, kDirectMR) * f.Jr + g.H * g.W + 128;
  } else {
    const DataPhases d = data_phases(g);
    const int64_t Cr = round_to(Cg, kDirectMR);
    shared = g.groups * Cr * Kg * RS;
    per_thread = g.K * d.Ld + Cr * std::max(d.Jr, d.ph[0].Ha * d.ph[0].Wb) + 128;
  }
  return size_t(shared + 64 + threads * per_thread) * sizeof(float);
}

void direct_strided_forward(const Conv2dGeom& g, const Tensor& xt, const float* w, const float* b, float* y,
                            void* ws, float* sum1, float* sum2) {
  ET_CHECK(direct_strided_applies(g, ConvPass::Forward), "direct strided forward: this geometry");
  const ConvInput x(xt);
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S, Kr = round_to(Kg, kDirectMR);
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q;
  const FwdPhases f = fwd_phases(g);
  Carve cv(static_cast<float*>(ws));
  float* wpk = cv.take<float>(g.groups * Kr * Cg * RS);
  for (int64_t gi = 0; gi < g.groups; ++gi)
    pack_weights(w + gi * Kg * Cg * RS, Kg, Cg, int(RS), false, wpk + gi * Kr * Cg * RS);
  float* thread_base = reinterpret_cast<float*>(cv.p);
  const int64_t per_thread = g.C * f.L + Kr * f.Jr + HW + 128;
  StealingRanges images(g.N, 1, omp_get_max_threads());
#pragma omp parallel
  {
    Carve tc(thread_base + omp_get_thread_num() * per_thread);
    float* xp = tc.take<float>(g.C * f.L);
    float* tile = tc.take<float>(Kr * f.Jr);
    float* plane = tc.take<float>(HW);  // a fused stack's output plane, computed (DType::AffineRelu)
    std::memset(xp, 0, sizeof(float) * size_t(g.C * f.L));
    images.run([&](int64_t n_begin, int64_t n_end) {
      for (int64_t n = n_begin; n < n_end; ++n) {
        for (int64_t c = 0; c < g.C; ++c) {
          const int64_t pl = n * g.C + c;
          const float* src = x.planes + pl * HW;
          if (x.stack) {
            x.stack->run(src, x.stack->scale, x.stack->shift, g.C, HW, pl * HW, HW, plane);
            src = plane;
          }
          place_phases(g, f, src, xp + c * f.L);
        }
        for (int64_t gi = 0; gi < g.groups; ++gi) {
          const int64_t pl0 = n * g.K + gi * Kg;
          const float* wg = wpk + gi * Kr * Cg * RS;
          auto sums = [&](int64_t k0, int64_t k1) {
            if (sum1)
              for (int64_t k = k0; k < k1; ++k) bn_rows::plane_sums(y + (pl0 + k) * PQ, PQ, sum1 + pl0 + k, sum2 + pl0 + k);
          };
          if (rows_apply(g.Q)) {
            for (int64_t k0 = 0; k0 < Kg; k0 += kDirectMR) {
              const int64_t nk = std::min<int64_t>(kDirectMR, Kg - k0);
              corr_planes_rows_any(xp + gi * Cg * f.L, Cg, f.L, f.Wq, f.off, f.RS, wg + k0 * Cg * RS, int(nk), g.P,
                                   g.Q, y + (pl0 + k0) * PQ, PQ, b ? b + gi * Kg + k0 : nullptr, false);
              sums(k0, k0 + nk);
            }
          } else {
            corr_planes_any(xp + gi * Cg * f.L, Cg, f.L, f.off, f.RS, wg, Kr, tile, f.Jr);
            for (int64_t k = 0; k < Kg; ++k)
              extract_plane(tile + k * f.Jr, f.Wq, g.P, g.Q, 1, b ? b[gi * Kg + k] : 0.f, false, y + (pl0 + k) * PQ);
            sums(0, Kg);
          }
        }
      }
    });
  }
}

void direct_strided_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                                  void* ws, const DzSumsEpilogue* dz_sums) {
  ET_CHECK(direct_strided_applies(g, ConvPass::BackwardData), "direct strided data gradient: this geometry");
  ET_CHECK(!dz_sums || g.groups == 1, "direct strided data gradient: dz sums with groups");
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S, Cr = round_to(Cg, kDirectMR);
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q;
  const DataPhases d = data_phases(g);
  Carve cv(static_cast<float*>(ws));
  // Per group, the phases' packed weights one after another (their taps add up to RS).
  float* wpk = cv.take<float>(g.groups * Cr * Kg * RS);
  int64_t phase_at[4];
  for (int64_t i = 0, at = 0; i < 4; ++i) phase_at[i] = at, at += Cr * Kg * d.ph[i].taps;
  for (int64_t gi = 0; gi < g.groups; ++gi)
    for (int i = 0; i < 4; ++i)
      pack_phase_weights(g, d.ph[i], w + gi * Kg * Cg * RS, Kg, Cg, wpk + gi * Cr * Kg * RS + phase_at[i]);
  float* thread_base = reinterpret_cast<float*>(cv.p);
  const int64_t buf_n = Cr * std::max(d.Jr, d.ph[0].Ha * d.ph[0].Wb);
  const int64_t per_thread = g.K * d.Ld + buf_n + 128;
  StealingRanges images(g.N, 1, omp_get_max_threads());
#pragma omp parallel
  {
    Carve tc(thread_base + omp_get_thread_num() * per_thread);
    float* dyp = tc.take<float>(g.K * d.Ld);
    float* buf = tc.take<float>(buf_n);
    std::memset(dyp, 0, sizeof(float) * size_t(g.K * d.Ld));  // borders stay zero
    images.run([&](int64_t n_begin, int64_t n_end) {
      for (int64_t n = n_begin; n < n_end; ++n) {
        for (int64_t k = 0; k < g.K; ++k)
          place_plane(dy + (n * g.K + k) * PQ, g.P, g.Q, 1, d.top, d.left, d.Wd, dyp + k * d.Ld);
        for (int64_t gi = 0; gi < g.groups; ++gi) {
          float* dxg = dx + (n * g.C + gi * Cg) * HW;
          const float* wg = wpk + gi * Cr * Kg * RS;
          for (int i = 0; i < 4; ++i) {
            const DataPhase& f = d.ph[i];
            if (f.Ha == 0 || f.Wb == 0) continue;
            if (f.taps == 0) {  // no tap reaches these positions: they take nothing
              if (accumulate) continue;
              std::memset(buf, 0, sizeof(float) * size_t(f.Ha * f.Wb));
              for (int64_t c = 0; c < Cg; ++c) place_phase_values(g, f, buf, f.Wb, false, dxg + c * HW);
              continue;
            }
            if (d.rows) {
              for (int64_t c0 = 0; c0 < Cg; c0 += kDirectMR) {
                const int64_t nc = std::min<int64_t>(kDirectMR, Cg - c0);
                corr_planes_rows_any(dyp + gi * Kg * d.Ld, Kg, d.Ld, d.Wd, f.off, f.taps,
                                     wg + phase_at[i] + c0 * Kg * f.taps, int(nc), f.Ha, f.Wb, buf + c0 * f.Ha * f.Wb,
                                     f.Ha * f.Wb, nullptr, false);
              }
              for (int64_t c = 0; c < Cg; ++c)
                place_phase_values(g, f, buf + c * f.Ha * f.Wb, f.Wb, accumulate, dxg + c * HW);
            } else {
              const int64_t Jr = round_to(f.Ha * d.Wd, 16);
              corr_planes_any(dyp + gi * Kg * d.Ld, Kg, d.Ld, f.off, f.taps, wg + phase_at[i], Cr, buf, Jr);
              for (int64_t c = 0; c < Cg; ++c) place_phase_values(g, f, buf + c * Jr, d.Wd, accumulate, dxg + c * HW);
            }
          }
        }
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
        // The first sweep of the stack before on this image's planes of dx, complete now and in cache.
        if (dz_sums) fused_elementwise::dz_sums_images(*dz_sums, n, n + 1, g.C, HW, dx);
#else
        ET_CHECK(!dz_sums, "direct strided data gradient: dz sums in this build");
#endif
      }
    });
  }
}

}  // namespace et::cpu
