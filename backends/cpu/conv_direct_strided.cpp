// Stride-2 direct kernels by phases: the forward and the data gradient of a stride-2 conv as
// stride-1 correlations over staged copies, run by the direct kernels' own register blocks
// (conv_direct.cpp's corr_planes_*): no multiply-add is spent on positions the stride skips.
//
// Forward. Output (p, q) reads xpad[2p + r][2q + s] for tap (r, s). The input is staged per channel
// as 2 x S copies, copy (a, s) holding xpad[2i + a][2j + s] at (i, j), Q columns a row; tap (r, s)
// then reads copy (r % 2, s) at (p + r / 2, q): every tap is one offset from the output position
// p * Q + q, so the output plane is one dense run of positions (no junk columns whatever Q is),
// computed 16 at a time with the weights in their own order: the direct forward's arithmetic (the
// same FMAs per element in the same order, c outer, t inner).
//
// Data gradient. dx[h][w] takes dy[p][q] * w[r][s] where h = 2p + r - pad_h, w = 2q + s - pad_w.
// The dx positions of one parity (a, b) (h = 2i + a, w = 2j + b) take only the taps with
// r = a + pad_h (mod 2), s = b + pad_w (mod 2), from dy[i + (a + pad_h - r) / 2][j + (b + pad_w - s) / 2]:
// per phase a stride-1 correlation of dy (zero padded) with a sub-kernel (3x3: 1, 2, 2 and 4 taps).
// dy is staged as copies shifted by each column offset, the phase's width a row, so a phase's
// positions are again one dense run; its values go to a buffer and into dx's rows by twos. The
// zero-upsampled dy of the stride-1 form (3 multiply-adds in 4 on zeros) never exists.
//
// A dense run whose length is whole vectors runs by vectors straight into the output (the row form
// with rows of 16 positions), else through a tile (the same bits). Images are balanced over the
// threads (balance.h).
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

}  // namespace

// ---------------------------------------------------------------- forward (and the weight gradient's staging)

StridedCopies strided_copies(const Conv2dGeom& g) {
  StridedCopies f;
  f.Hq = g.P + (g.R - 1) / 2;
  f.Lc = round_to(f.Hq * g.Q + 16, 16);  // slack: the flat form's last vector reads past P * Q
  f.L = 2 * g.S * f.Lc;
  f.RS = int(g.R * g.S);
  for (int64_t r = 0; r < g.R; ++r)
    for (int64_t s = 0; s < g.S; ++s) f.off[r * g.S + s] = ((r % 2) * g.S + s) * f.Lc + (r / 2) * g.Q;
  return f;
}

// Copy (a, s) at dst + (a * S + s) * Lc. Only positions inside src are written: the rest stay zero
// from the workspace's first clearing, every image alike.
void place_strided_copies(const Conv2dGeom& g, const StridedCopies& f, const float* src, float* dst) {
  for (int a = 0; a < 2; ++a)
    for (int64_t s = 0; s < g.S; ++s) {
      float* d = dst + (a * g.S + s) * f.Lc;
      // j with 0 <= 2j + s - pad_w < W
      const int64_t last = g.W - 1 + g.pad_w - s;
      const int64_t j0 = std::max<int64_t>(0, (g.pad_w - s + 1) / 2);
      const int64_t j1 = last < 0 ? 0 : std::min<int64_t>(g.Q, last / 2 + 1);
      for (int64_t i = 0; i < f.Hq; ++i) {
        const int64_t h = 2 * i + a - g.pad_h;
        if (h < 0 || h >= g.H) continue;
        const float* sr = src + h * g.W;
        float* row = d + i * g.Q;
        for (int64_t j = j0; j < j1; ++j) row[j] = sr[2 * j + s - g.pad_w];
      }
    }
}

namespace {

// ---------------------------------------------------------------- data gradient

struct DataPhase {
  int taps = 0;
  int64_t off[kMaxTaps] = {};   // tap -> offset in a dy channel's copies from the phase position
  int64_t wtap[kMaxTaps] = {};  // tap -> r * S + s in the weight tensor
  int64_t Ha = 0, Wb = 0;       // the phase's dx positions: rows 2i + a, columns 2j + b
  int a = 0, b = 0;
};

// dy's copies: for each column parity b of dx and column shift e a tap of such a phase reads, copy
// [u][j] = dy[u - top][j + e - left], Wb columns a row (b's phase width): a phase's taps then read
// whole rows of positions i * Wb + j at a row offset, as the forward's copies do.
struct DataPhases {
  DataPhase ph[4];
  int64_t top, left;   // dy's row p is copy row p + top; a tap's column shift e = dv + left
  int64_t Hd, Lc, L;   // a copy's rows, its stride, a dy channel's copies
  int copies;
  int64_t Jr;          // the flat form's largest phase domain (Ha * Wb), rounded up to 16
  int64_t copy_b[2 * kMaxTaps], copy_e[2 * kMaxTaps];
};

DataPhases data_phases(const Conv2dGeom& g) {
  DataPhases d;
  // dy row of tap r in phase a: i + du, du = (a + pad_h - r) / 2 (exact: the parity matches); columns alike.
  auto takes = [](int64_t parity, int64_t pad, int64_t tap) { return (parity + pad - tap) % 2 == 0; };
  int64_t du_min = 0, du_max = 0, dv_min = 0, dv_max = 0;
  for (int a = 0; a < 2; ++a)
    for (int64_t r = 0; r < g.R; ++r)
      if (takes(a, g.pad_h, r)) du_min = std::min(du_min, (a + g.pad_h - r) / 2), du_max = std::max(du_max, (a + g.pad_h - r) / 2);
  for (int b = 0; b < 2; ++b)
    for (int64_t s = 0; s < g.S; ++s)
      if (takes(b, g.pad_w, s)) dv_min = std::min(dv_min, (b + g.pad_w - s) / 2), dv_max = std::max(dv_max, (b + g.pad_w - s) / 2);
  d.top = -du_min, d.left = -dv_min;
  const int64_t Hmax = (g.H + 1) / 2, Wmax = (g.W + 1) / 2;
  d.Hd = Hmax + du_max + d.top;
  d.Lc = round_to(d.Hd * Wmax + 16, 16);  // slack: the flat form's last vector reads past Ha * Wb
  d.Jr = round_to(Hmax * Wmax, 16);
  d.copies = 0;
  auto copy_of = [&](int64_t b, int64_t e) {
    for (int i = 0; i < d.copies; ++i)
      if (d.copy_b[i] == b && d.copy_e[i] == e) return i;
    d.copy_b[d.copies] = b, d.copy_e[d.copies] = e;
    return d.copies++;
  };
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      DataPhase& f = d.ph[2 * a + b];
      f.a = a, f.b = b;
      f.Ha = (g.H - a + 1) / 2, f.Wb = (g.W - b + 1) / 2;
      for (int64_t r = 0; r < g.R; ++r) {
        if (!takes(a, g.pad_h, r)) continue;
        for (int64_t s = 0; s < g.S; ++s) {
          if (!takes(b, g.pad_w, s)) continue;
          const int64_t du = (a + g.pad_h - r) / 2 + d.top, e = (b + g.pad_w - s) / 2 + d.left;
          f.off[f.taps] = copy_of(b, e) * d.Lc + du * f.Wb;
          f.wtap[f.taps] = r * g.S + s;
          ++f.taps;
        }
      }
    }
  d.L = std::max(1, d.copies) * d.Lc;
  return d;
}

// dy's plane [P, Q] into a channel's copies at dst (the rows and columns inside dy; the rest stay zero).
void place_dy_copies(const Conv2dGeom& g, const DataPhases& d, const float* src, float* dst) {
  for (int i = 0; i < d.copies; ++i) {
    const int64_t Wb = (g.W - d.copy_b[i] + 1) / 2, e = d.copy_e[i] - d.left;  // copy column j reads dy column j + e
    const int64_t j0 = std::max<int64_t>(0, -e), j1 = std::min<int64_t>(Wb, g.Q - e);
    float* c = dst + i * d.Lc;
    for (int64_t p = 0; p < g.P && p + d.top < d.Hd; ++p) {
      const float* sr = src + p * g.Q + e;
      float* row = c + (p + d.top) * Wb;
      for (int64_t j = j0; j < j1; ++j) row[j] = sr[j];
    }
  }
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

// Rows 2i + a of a dx plane [H, W] (+)= the values of its phases (a, 0) and (a, 1), ev [Ha, W0] and
// od [Ha, W1] (null: a phase no tap reaches, zeros), interleaved: ev to the even columns, od to the
// odd ones. Two streams into one contiguous row, which the compiler vectorizes with shuffles (a
// store or add per element at a stride of 2 cost the data gradient more than its phases saved).
void place_phase_rows(const Conv2dGeom& g, int a, int64_t Ha, const float* ev, const float* od, bool accumulate,
                      float* dx) {
  const int64_t W0 = (g.W + 1) / 2, W1 = g.W / 2;
  for (int64_t i = 0; i < Ha; ++i) {
    float* d = dx + (2 * i + a) * g.W;
    const float* e = ev ? ev + i * W0 : nullptr;
    const float* o = od ? od + i * W1 : nullptr;
    if (accumulate) {
      if (e && o)
        for (int64_t j = 0; j < W1; ++j) d[2 * j] += e[j], d[2 * j + 1] += o[j];
      else if (e)
        for (int64_t j = 0; j < W1; ++j) d[2 * j] += e[j];
      else if (o)
        for (int64_t j = 0; j < W1; ++j) d[2 * j + 1] += o[j];
      if (W0 > W1 && e) d[2 * W1] += e[W1];
    } else {
      if (e && o)
        for (int64_t j = 0; j < W1; ++j) d[2 * j] = e[j], d[2 * j + 1] = o[j];
      else if (e)
        for (int64_t j = 0; j < W1; ++j) d[2 * j] = e[j], d[2 * j + 1] = 0.f;
      else if (o)
        for (int64_t j = 0; j < W1; ++j) d[2 * j] = 0.f, d[2 * j + 1] = o[j];
      else
        std::memset(d, 0, sizeof(float) * size_t(2 * W1));
      if (W0 > W1) d[2 * W1] = e ? e[W1] : 0.f;
    }
  }
}

// out [nk][n] (+ bias) = the correlation over a dense domain of n positions (a plane's P x Q, a
// phase's Ha x Wb): by rows of 16 where n is whole vectors (corr_planes_rows_any, a "row" of 16
// positions whatever the plane's width), else a tile over n rounded up to 16 and its first n
// positions copied out (the same bits). nk <= Kr rows of packed weights wpk (whole blocks).
void corr_dense(const float* xp, int64_t Cin, int64_t L, const int64_t* off, int RS, const float* wpk, int64_t nk,
                int64_t n, float* out, int64_t ldo, const float* bias, float* tile) {
  if (n % 16 == 0 && rows_apply(16)) {
    for (int64_t k0 = 0; k0 < nk; k0 += kDirectMR) {
      const int64_t m = std::min<int64_t>(kDirectMR, nk - k0);
      corr_planes_rows_any(xp, Cin, L, 16, off, RS, wpk + k0 * Cin * RS, int(m), n / 16, 16, out + k0 * ldo, ldo,
                           bias ? bias + k0 : nullptr, false);
    }
    return;
  }
  const int64_t Jr = round_to(n, 16), Kr = round_to(nk, kDirectMR);
  corr_planes_any(xp, Cin, L, off, RS, wpk, Kr, tile, Jr);
  for (int64_t k = 0; k < nk; ++k) {
    const float* t = tile + k * Jr;
    float* o = out + k * ldo;
    const float bk = bias ? bias[k] : 0.f;
    for (int64_t j = 0; j < n; ++j) o[j] = t[j] + bk;
  }
}

// Per thread: the staged input (x's copies, or dy's) and tiles (the forward: one, with a plane of a
// fused stack's output at its end; the data gradient: the values of a pair of phases, and a tile).
struct StridedLayout {
  int64_t staged, tile, tiles;
  int64_t floats() const { return staged + tiles * tile + 64; }
};
StridedLayout forward_layout(const Conv2dGeom& g, const StridedCopies& f) {
  return {g.C * f.L, round_to(g.K / g.groups, kDirectMR) * round_to(g.P * g.Q, 16) + g.H * g.W, 1};
}
StridedLayout data_layout(const Conv2dGeom& g, const DataPhases& d) {
  return {g.K * d.L, round_to(g.C / g.groups, kDirectMR) * d.Jr, 3};
}

}  // namespace

bool direct_strided_applies(const Conv2dGeom& g, ConvPass pass) {
  if (g.stride_h != 2 || g.stride_w != 2 || g.R * g.S > kMaxTaps || g.P <= 0 || g.Q <= 0) return false;
  if (g.pad_h >= g.R || g.pad_w >= g.S) return false;  // every window meets the plane
  (void)pass;  // every pass (the weight gradient: conv_direct_wgrad.cpp, over the forward's copies)
  return true;
}

size_t direct_strided_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  ET_CHECK(pass != ConvPass::BackwardWeight, "direct strided: the weight gradient's workspace is direct_dense_wgrad_workspace's");
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S;
  const bool fwd = pass == ConvPass::Forward;
  const int64_t shared = g.groups * (fwd ? round_to(Kg, kDirectMR) * Cg : round_to(Cg, kDirectMR) * Kg) * RS;
  const StridedLayout l = fwd ? forward_layout(g, strided_copies(g)) : data_layout(g, data_phases(g));
  return size_t(shared + 64 + threads * l.floats()) * sizeof(float);
}

void direct_strided_forward(const Conv2dGeom& g, const Tensor& xt, const float* w, const float* b, float* y,
                            void* ws, float* sum1, float* sum2) {
  ET_CHECK(direct_strided_applies(g, ConvPass::Forward), "direct strided forward: this geometry");
  const ConvInput x(xt);
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S, Kr = round_to(Kg, kDirectMR);
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q;
  const StridedCopies f = strided_copies(g);
  const StridedLayout l = forward_layout(g, f);
  Carve cv(ws);
  float* wpk = cv.take<float>(g.groups * Kr * Cg * RS);
  for (int64_t gi = 0; gi < g.groups; ++gi)
    pack_weights(w + gi * Kg * Cg * RS, Kg, Cg, int(RS), false, wpk + gi * Kr * Cg * RS);
  float* thread_base = reinterpret_cast<float*>(cv.p);
  StealingRanges images(g.N, 1, omp_get_max_threads());  // balance.h
#pragma omp parallel
  {
    Carve tc(thread_base + omp_get_thread_num() * l.floats());
    float* xp = tc.take<float>(l.staged);
    float* tile = tc.take<float>(l.tile);
    float* plane = tile + (l.tile - HW);  // a fused stack's output plane (DType::AffineRelu), before the tile's use
    std::memset(xp, 0, sizeof(float) * size_t(l.staged));
    images.run([&](int64_t n_begin, int64_t n_end) {
      for (int64_t n = n_begin; n < n_end; ++n) {
        for (int64_t c = 0; c < g.C; ++c) {
          const int64_t pl = n * g.C + c;
          const float* src = x.planes + pl * HW;
          if (x.stack) {
            x.stack->run(src, x.stack->scale, x.stack->shift, g.C, HW, pl * HW, HW, plane);
            src = plane;
          }
          place_strided_copies(g, f, src, xp + c * f.L);
        }
        for (int64_t gi = 0; gi < g.groups; ++gi) {
          const int64_t pl0 = n * g.K + gi * Kg;
          corr_dense(xp + gi * Cg * f.L, Cg, f.L, f.off, f.RS, wpk + gi * Kr * Cg * RS, Kg, PQ, y + pl0 * PQ, PQ,
                     b ? b + gi * Kg : nullptr, tile);
          if (sum1)  // the planes' sums for the BN after the conv, while they are in cache
            for (int64_t k = 0; k < Kg; ++k) bn_rows::plane_sums(y + (pl0 + k) * PQ, PQ, sum1 + pl0 + k, sum2 + pl0 + k);
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
  const StridedLayout l = data_layout(g, d);
  Carve cv(ws);
  // Per group, the phases' packed weights one after another (their taps add up to RS).
  float* wpk = cv.take<float>(g.groups * Cr * Kg * RS);
  int64_t phase_at[4];
  for (int64_t i = 0, at = 0; i < 4; ++i) phase_at[i] = at, at += Cr * Kg * d.ph[i].taps;
  for (int64_t gi = 0; gi < g.groups; ++gi)
    for (int i = 0; i < 4; ++i)
      pack_phase_weights(g, d.ph[i], w + gi * Kg * Cg * RS, Kg, Cg, wpk + gi * Cr * Kg * RS + phase_at[i]);
  float* thread_base = reinterpret_cast<float*>(cv.p);
  StealingRanges images(g.N, 1, omp_get_max_threads());  // balance.h
#pragma omp parallel
  {
    Carve tc(thread_base + omp_get_thread_num() * l.floats());
    float* dyc = tc.take<float>(l.staged);
    // The values of phases (a, 0) and (a, 1) for every channel of a group, [Cg][Ha * Wb], and the
    // flat form's tile.
    float* buf[2] = {tc.take<float>(l.tile), tc.take<float>(l.tile)};
    float* tile = tc.take<float>(l.tile);
    std::memset(dyc, 0, sizeof(float) * size_t(l.staged));  // borders stay zero
    images.run([&](int64_t n_begin, int64_t n_end) {
      for (int64_t n = n_begin; n < n_end; ++n) {
        for (int64_t k = 0; k < g.K; ++k) place_dy_copies(g, d, dy + (n * g.K + k) * PQ, dyc + k * d.L);
        for (int64_t gi = 0; gi < g.groups; ++gi) {
          float* dxg = dx + (n * g.C + gi * Cg) * HW;
          const float* wg = wpk + gi * Cr * Kg * RS;
          for (int a = 0; a < 2; ++a) {  // dx's rows 2i + a from phases (a, 0) and (a, 1)
            const float* vals[2] = {nullptr, nullptr};  // null: no tap reaches the phase (zeros)
            for (int b = 0; b < 2; ++b) {
              const int i = 2 * a + b;
              const DataPhase& f = d.ph[i];
              const int64_t n_pos = f.Ha * f.Wb;
              if (n_pos == 0 || f.taps == 0) continue;
              corr_dense(dyc + gi * Kg * d.L, Kg, d.L, f.off, f.taps, wg + phase_at[i], Cg, n_pos, buf[b], n_pos,
                         nullptr, tile);
              vals[b] = buf[b];
            }
            const DataPhase &even = d.ph[2 * a], &odd = d.ph[2 * a + 1];
            if (even.Ha == 0) continue;
            for (int64_t c = 0; c < Cg; ++c)
              place_phase_rows(g, a, even.Ha, vals[0] ? vals[0] + c * even.Ha * even.Wb : nullptr,
                               vals[1] ? vals[1] + c * odd.Ha * odd.Wb : nullptr, accumulate, dxg + c * HW);
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
