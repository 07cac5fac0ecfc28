// The dense direct convolution's weight gradient (conv_direct.h; the forward and the data gradient:
// conv_direct.cpp). Per image: dw[k][c*RS+t] += sum_j dyp[k][j] * xp[c][j + off[t]], in one of
// three forms: outer products (vectors along output channels), dot products (vectors along
// positions: stems) or, for 3x3 layers with 16 output channels, channels last
// (conv_channels_last.cpp). Stride 2: the outer products over the input's staged copies
// (StridedCopies), positions dense. Partial sums per thread (a contiguous slice of the batch) are reduced
// in thread order, so the result is deterministic.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/carve.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_simd.h"
#include "memory/stored_reader.h"

namespace et::cpu {

namespace {

// The valid positions of a chunk: rows of `len` positions starting at (r / per_image) * image +
// (r % per_image) * row for r < rows, in x and (images dy_image apart) in dyT. The padded plane's
// junk columns (dy = 0 there) are skipped: 36 % of the positions of an 8x8 map with pad 1, 21 % of
// a 16x16 one.
struct PosRows {
  int64_t rows, per_image, image, row, len, dy_image;
  int64_t start(int64_t r) const { return (r / per_image) * image + (r % per_image) * row; }
  int64_t dy_start(int64_t r) const { return (r / per_image) * dy_image + (r % per_image) * row; }
};

// dw [dw_n] and db [K] (if any) = the threads' partials added in thread order (+ their old values
// where accumulate); thread t of nt writes its slice. part_of(u): thread u's partials; at(i): where
// element i of dw (i < dw_n) or of db (i - dw_n) lies in them.
template <class PartOf, class At>
void reduce_in_thread_order(int t, int nt, int64_t dw_n, int64_t K, PartOf part_of, At at, float* dw, float* db,
                            bool accumulate) {
  const int64_t total = dw_n + (db ? K : 0);
  const int64_t i0 = total * t / nt, i1 = total * (t + 1) / nt;
  for (int64_t i = i0; i < i1; ++i) {
    float s = 0.f;
    const int64_t a = at(i);
    for (int u = 0; u < nt; ++u) s += part_of(u)[a];
    float& d = i < dw_n ? dw[i] : db[i - dw_n];
    d = accumulate ? d + s : s;
  }
}

// Where weight i = k * CRS + u of dw [K][CRS] lies in partials transposed per group, [groups][CRS][ldk]
// (wgrad_planes_nv's layout).
int64_t transposed_at(int64_t i, int64_t CRS, int64_t Kg, int64_t ldk) {
  const int64_t k = i / CRS, u = i % CRS;
  return ((k / Kg) * CRS + u) * ldk + k % Kg;
}

// Outer-product form: vectors run along output channels, so nothing needs a horizontal sum.
// acc[t][v] (16 channels k0+16v..) += dyT[j][k0 + 16v ..] * xs[t][j] over the positions j of pr.
// dyT is the output gradient transposed to [position][channel] (row stride kp).
template <class V, int NV, int NT>
void wgrad_tile(const float* dyT, int64_t kp, const PosRows& pr, const float* const* xs, float* res /*[NT][NV*16]*/) {
  V acc[NT][NV];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = V::zero();
  for (int64_t r = 0; r < pr.rows; ++r) {
    const int64_t j0 = pr.start(r);
    const float* xt[NT];
    for (int t = 0; t < NT; ++t) xt[t] = xs[t] + j0;
    const float* dr = dyT + pr.dy_start(r) * kp;
    for (int64_t j = 0; j < pr.len; ++j) {
      V d[NV];
      for (int v = 0; v < NV; ++v) d[v] = V::load(dr + j * kp + 16 * v);
      // Fully unrolled so the NT*NV accumulators live in registers (GCC 12 otherwise kept them on the
      // stack for NT = 24: a store-to-load chain per FMA, 2.5x slower).
#pragma GCC unroll 24
      for (int t = 0; t < NT; ++t) {
        const V xb = V::set1(xt[t][j]);
        for (int v = 0; v < NV; ++v) acc[t][v].fma(xb, d[v]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v].store(res + (t * NV + v) * 16);
}

// dwp [Cg*RS][ldk] += sum_j dyT[j][k] * x[c][j + off[t]], the weight gradient transposed: ldk >=
// round_up(Kg, 64), so a tile adds into it by vectors of channels (channels past Kg: zeros, into
// padding). dyT holds this group's Kg channels from column 0 (row stride kp >= round16(Kg), padding
// columns zero), x rows [Cg] have stride lx. Each weight gets one add a tile, in tile order: the
// bits of a scalar add into [Kg][Cg*RS], which cost as much as the multiply-adds where a tile sums
// few positions (8x8 maps, the strided form's 8x8 outputs).
template <class V, int NV, int NT>
void wgrad_planes_nv(const float* dyT, int64_t kp, int64_t Kg, const PosRows& pr, const float* xp, int64_t Cg,
                     int64_t lx, const int64_t* off, int RS, float* dwp, int64_t ldk) {
  const int64_t CRS = Cg * RS;
  alignas(64) float res[NT * NV * 16];
  for (int64_t u0 = 0; u0 < CRS; u0 += NT) {
    const float* xs[NT];
    for (int t = 0; t < NT; ++t) {
      const int64_t u = std::min(u0 + t, CRS - 1);  // tail taps repeat the last one; discarded
      xs[t] = xp + (u / RS) * lx + off[u % RS];
    }
    const int64_t nt = std::min<int64_t>(NT, CRS - u0);
    for (int64_t k0 = 0; k0 < Kg; k0 += 16 * NV) {
      wgrad_tile<V, NV, NT>(dyT + k0, kp, pr, xs, res);
      for (int64_t t = 0; t < nt; ++t)
        for (int v = 0; v < NV; ++v)
          V::load(res + (t * NV + v) * 16).store_plus(dwp + (u0 + t) * ldk + k0 + 16 * v, 0.f, true);
    }
  }
}

// Register block by channel count: NV vectors of 16 channels x NT taps, NV*NT = 24 accumulators
// (narrow vectors: 1 x 6, 12 ymm; each accumulator is one (tap, 16 channels) summed over the
// positions in order whatever the block, so the results do not depend on it).
template <class V>
void wgrad_planes(const float* dyT, int64_t kp, int64_t Kg, const PosRows& pr, const float* xp, int64_t Cg,
                  int64_t lx, const int64_t* off, int RS, float* dwp, int64_t ldk) {
  if (kNarrowVectors) wgrad_planes_nv<V, 1, 6>(dyT, kp, Kg, pr, xp, Cg, lx, off, RS, dwp, ldk);
  else if (Kg <= 16) wgrad_planes_nv<V, 1, 24>(dyT, kp, Kg, pr, xp, Cg, lx, off, RS, dwp, ldk);
  else if (Kg <= 32) wgrad_planes_nv<V, 2, 12>(dyT, kp, Kg, pr, xp, Cg, lx, off, RS, dwp, ldk);
  else if (Kg <= 48) wgrad_planes_nv<V, 3, 8>(dyT, kp, Kg, pr, xp, Cg, lx, off, RS, dwp, ldk);
  else wgrad_planes_nv<V, 4, 6>(dyT, kp, Kg, pr, xp, Cg, lx, off, RS, dwp, ldk);
}

// Dot-product form, for few output channels (WgradLayout::dot says where). With 16 channels the
// outer-product form above has one vector of channels per broadcast of x, and a 3-channel stem's
// 27 taps fill its 24-tap tiles twice. Here vectors run along positions instead: a tile of KB
// channels x UB taps loads KB rows of dy and UB shifted rows of x per 16 positions for KB*UB FMAs. A tile sweeps one image (its rows of dy and x stay in L1 across the taps); its
// accumulators carry over in `part` (16 lanes per weight), whose lanes are summed once per call of
// the kernel (wgrad_dot_fold).
constexpr int kDotKB = kNarrowVectors ? 2 : 8, kDotUB = kNarrowVectors ? 2 : 3;  // narrow: 4 accumulators

template <class V, int KB, int UB>
void wgrad_dot_tile(const float* dy, int64_t ldy, const float* const* xs, int64_t nvec, float* part /*[KB][UB][16]*/) {
  V acc[KB][UB];
  for (int k = 0; k < KB; ++k)
    for (int t = 0; t < UB; ++t) acc[k][t] = V::load(part + (k * UB + t) * 16);
  for (int64_t i = 0; i < nvec; ++i) {
    const int64_t j = 16 * i;
    V xv[UB];
    for (int t = 0; t < UB; ++t) xv[t] = V::load(xs[t] + j);
#pragma GCC unroll 16
    for (int k = 0; k < KB; ++k) {
      const V d = V::load(dy + k * ldy + j);
      for (int t = 0; t < UB; ++t) acc[k][t].fma(d, xv[t]);
    }
  }
  for (int k = 0; k < KB; ++k)
    for (int t = 0; t < UB; ++t) acc[k][t].store(part + (k * UB + t) * 16);
}

// The partial sums of a group: part [ceil(Kg / KB)][ceil(CRS / UB)][KB][UB][16]; a tile's rows past
// Kg (zeros) and its taps past CRS (the last one again) go to slots nothing reads.
int64_t dot_part_floats(int64_t Kg, int64_t CRS) {
  return round_up(Kg, kDotKB) * round_up(CRS, kDotUB) * 16;
}

// part += the dot form over nimg images: dy rows [round_up(Kg, KB)] of stride ldy, x rows [Cg] of stride lx,
// images `img` floats apart in both, nvec vectors of positions per image.
template <class V>
void wgrad_dot(const float* dy, int64_t ldy, int64_t Kg, const float* xp, int64_t Cg, int64_t lx, const int64_t* off,
               int RS, int64_t nimg, int64_t img, int64_t nvec, float* part) {
  const int64_t CRS = Cg * RS, ublocks = round_up(CRS, kDotUB) / kDotUB;
  for (int64_t b = 0; b < nimg; ++b)
    for (int64_t k0 = 0; k0 < Kg; k0 += kDotKB) {
      const float* dyb = dy + k0 * ldy + b * img;  // rows past Kg: zeros (WgradLayout::dy_n)
      for (int64_t ub = 0; ub < ublocks; ++ub) {
        const float* xs[kDotUB];
        for (int t = 0; t < kDotUB; ++t) {
          const int64_t u = std::min(ub * kDotUB + t, CRS - 1);
          xs[t] = xp + (u / RS) * lx + off[u % RS] + b * img;
        }
        wgrad_dot_tile<V, kDotKB, kDotUB>(dyb, ldy, xs, nvec, part + ((k0 / kDotKB) * ublocks + ub) * kDotKB * kDotUB * 16);
      }
    }
}

// dwp [Kg][CRS] += the lanes of part, in a fixed order.
template <class V>
void wgrad_dot_fold(const float* part, int64_t Kg, int64_t CRS, float* dwp) {
  const int64_t ublocks = round_up(CRS, kDotUB) / kDotUB;
  for (int64_t k = 0; k < Kg; ++k)
    for (int64_t u = 0; u < CRS; ++u) {
      const float* p = part + (((k / kDotKB) * ublocks + u / kDotUB) * kDotKB * kDotUB + (k % kDotKB) * kDotUB + u % kDotUB) * 16;
      dwp[k * CRS + u] += V::load(p).hsum();
    }
}

// Weight-gradient layout: NB images' padded planes back to back per channel (plane = Hp*Wp), so
// one vector loop covers NB images and the horizontal sums are paid once per chunk. A valid
// output position of image b only reads image b's plane; junk positions have dy = 0.
// The dot form keeps dy as planes too, [K][NB images], each image's output positions
// where its padded input plane has them (p * Wp + q), zeros elsewhere. It reads NB * img positions
// per row: images lie img >= Hp*Wp + 16 floats apart, so no vector reads into the next image.
struct WgradLayout {
  int64_t Hp, Wp, HW, NB;  // padded plane, images per chunk
  bool dot;                // the dot-product form
  int64_t img;             // floats from one image's plane to the next in a row of x (and of dy: dot)
  int64_t kp, lx;          // outer form: dyT row stride (channels, every group 16-aligned); x row stride
  int64_t x_n, dy_n;       // floats of the x and dy staging areas, per thread
  int64_t part_n;          // dot: floats of the partial sums, per thread
  int64_t dw_part_n;       // floats of the dw partials: outer form transposed per group, [Cg*RS][Kg
                           // rounded to 64] (wgrad_planes_nv's ldk), dot form [K][Cg*RS]
  int64_t thread_n;        // floats per thread in all: the areas above, dw and db partials, a decode
                           // plane, and the Carve alignment of its five pieces
  int64_t nvec;            // dot: vectors of positions per image (they cover P rows of Wp)
  int64_t off[kMaxTaps];
  int RS;
};

WgradLayout wgrad_layout(const Conv2dGeom& g, int threads) {
  WgradLayout l;
  l.Hp = g.H + 2 * g.pad_h;
  l.Wp = g.W + 2 * g.pad_w;
  l.HW = l.Hp * l.Wp;
  // Keep a chunk's x and dy (about (C+K) planes of NB images) near 384 KiB: L2-resident.
  const int64_t per_image = (g.C + g.K) * l.HW, budget = 96 * 1024;
  const int64_t images_per_thread = (g.N + threads - 1) / threads;
  l.NB = std::max<int64_t>(1, std::min(images_per_thread, budget / std::max<int64_t>(per_image, 1)));
  // The dot form where it measured faster (wall, batch 128, 3 alternating runs): resnet20's stem
  // (3 -> 16) 1.5x, whose 27 taps filled the outer form's tiles of 24 twice. Even on the 16 -> 16
  // layers at 32x32 (both read about as fast as memory delivers x and dy there), slower on vgg16's
  // 3 -> 64 stem (0.93x), where the outer form has 4 vectors of channels per broadcast.
  l.dot = g.K / g.groups <= 16 && g.C / g.groups < 8;
  l.img = l.dot ? round16(l.HW + 16) : l.HW;
  l.nvec = (g.P * l.Wp + 15) / 16;
  l.kp = g.groups * round_up(g.K / g.groups, 64) + 16;  // +16: a 64-channel block may overrun by < 64 zeros
  l.lx = round16(l.NB * l.img) + round16((g.R - 1) * l.Wp + g.S + 16);
  l.x_n = g.C * l.lx;
  l.dy_n = l.dot ? g.groups * round_up(g.K / g.groups, kDotKB) * l.NB * l.img : (l.NB * l.HW + 1) * l.kp;
  l.RS = int(g.R * g.S);
  l.part_n = l.dot ? g.groups * dot_part_floats(g.K / g.groups, g.C / g.groups * l.RS) : 0;
  const int64_t CRS = g.C / g.groups * l.RS;
  l.dw_part_n = l.dot ? g.K * CRS : g.groups * CRS * round_up(g.K / g.groups, 64);
  l.thread_n = l.x_n + l.dy_n + l.part_n + l.dw_part_n + g.K + round16(g.H * g.W) + 5 * 16;
  for (int64_t r = 0; r < g.R; ++r)
    for (int64_t s = 0; s < g.S; ++s) l.off[r * g.S + s] = r * l.Wp + s;
  return l;
}

// Stride 2 (conv_direct.h's StridedCopies): per chunk of NB images, x's copies (each channel's NB
// images f.L floats apart) and dy transposed to [NB * P * Q][channels], the outer-product form over
// the dense positions p * Q + q, tap t reading x's copies at off[t]; no multiply-add on a position
// the stride skips. A register tile sums NB images' positions before it adds into the partials: with
// one image at a time, 8x8 and 4x4 outputs ended each tile after 64 or 16 positions, and the adds
// of its K x 9C sums into the partials cost more than the multiply-adds. Per thread: the copies,
// dyT, the dw and db partials, a decode plane.
struct StridedWgradLayout {
  StridedCopies f;
  int64_t NB, kp, gstride, x_n, dy_n, dw_part_n, thread_n;  // dw partials transposed per group, db after
};

StridedWgradLayout strided_wgrad_layout(const Conv2dGeom& g, int threads) {
  StridedWgradLayout l;
  l.f = strided_copies(g);
  const int64_t Kg = g.K / g.groups, PQ = g.P * g.Q;
  l.gstride = round_up(Kg, 64);
  l.kp = g.groups * l.gstride + 16;  // as the stride-1 form's: a 64-channel block may read past Kg (zeros)
  // Images a chunk: enough for 256 positions a tile, while a chunk's copies and dyT stay within
  // 384 KiB (the stride-1 form's L2 budget), and no more than a thread's share of the batch.
  const int64_t per_image = g.C * l.f.L + PQ * l.kp, budget = 96 * 1024;
  const int64_t images_per_thread = (g.N + threads - 1) / threads;
  l.NB = std::max<int64_t>(1, std::min({(256 + PQ - 1) / PQ, budget / per_image, images_per_thread}));
  l.x_n = g.C * l.NB * l.f.L;
  l.dy_n = l.NB * PQ * l.kp;
  l.dw_part_n = g.groups * (g.C / g.groups) * g.R * g.S * l.gstride;
  l.thread_n = l.x_n + l.dy_n + l.dw_part_n + g.K + round16(g.H * g.W) + 4 * 16;
  return l;
}

void strided_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                             bool accumulate, void* ws) {
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S, CRS = Cg * RS;
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q, dw_n = g.K * CRS;
  const StridedWgradLayout l = strided_wgrad_layout(g, omp_get_max_threads());
  const int64_t lx = l.NB * l.f.L;  // a channel's copies: NB images
  float* base = static_cast<float*>(ws);
  auto carve = [&](int u, float** xs, float** dyT, float** part, float** plane) {
    Carve c(base + u * l.thread_n);
    *xs = c.take<float>(l.x_n);
    *dyT = c.take<float>(l.dy_n);
    *part = c.take<float>(l.dw_part_n + g.K);
    *plane = c.take<float>(round16(HW));
  };
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float *xs, *dyT, *dw_part, *plane;
    carve(t, &xs, &dyT, &dw_part, &plane);
    StoredReader xr(x, plane, HW);
    float* db_part = dw_part + l.dw_part_n;
    std::memset(xs, 0, sizeof(float) * size_t(l.x_n));    // the copies' padding stays zero
    std::memset(dyT, 0, sizeof(float) * size_t(l.dy_n));  // so do the padding channels
    std::memset(dw_part, 0, sizeof(float) * size_t(l.dw_part_n + g.K));
    // Static contiguous split of the batch: thread t takes images [n0, n1), NB at a time.
    const int64_t n0 = g.N * t / nt, n1 = g.N * (t + 1) / nt, j8 = PQ / 8 * 8;
    for (int64_t nc = n0; nc < n1; nc += l.NB) {
      const int64_t nb = std::min(l.NB, n1 - nc);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t n = nc + b;
        for (int64_t c = 0; c < g.C; ++c)
          place_strided_copies(g, l.f, xr.read((n * g.C + c) * HW, HW), xs + c * lx + b * l.f.L);
        for (int64_t k = 0; k < g.K; ++k) {
          const float* src = dy + (n * g.K + k) * PQ;
          if (db) {
            float s = 0.f;
            for (int64_t i = 0; i < PQ; ++i) s += src[i];
            db_part[k] += s;
          }
          float* dst = dyT + b * PQ * l.kp + (k / Kg) * l.gstride + k % Kg;
          // 8 channels x 8 positions at a time where the block stays inside a group (the stride-1
          // form's transposes), the rest one by one.
          if (j8 && k % 8 == 0 && k % Kg + 8 <= Kg)
            for (int64_t j = 0; j < j8; j += 8) transpose8x8(src + j, PQ, dst + j * l.kp, l.kp);
          const int64_t j0 = (j8 && (k / 8 * 8) % Kg + 8 <= Kg) ? j8 : 0;  // positions the block above covered
          for (int64_t j = j0; j < PQ; ++j) dst[j * l.kp] = src[j];
        }
      }
      // nb rows of P * Q positions: image b's at b * f.L in x's copies, b * P * Q in dyT.
      const PosRows pr{nb, 1, l.f.L, 0, PQ, PQ};
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        const float* dyg = dyT + gi * l.gstride;
        const float* xg = xs + gi * Cg * lx;
        float* dwg = dw_part + gi * CRS * l.gstride;  // [CRS][gstride]
        if (scalar_forced()) wgrad_planes<VScalar>(dyg, l.kp, Kg, pr, xg, Cg, lx, l.f.off, int(RS), dwg, l.gstride);
        else wgrad_planes<VNative>(dyg, l.kp, Kg, pr, xg, Cg, lx, l.f.off, int(RS), dwg, l.gstride);
      }
    }
#pragma omp barrier
    reduce_in_thread_order(t, nt, dw_n, g.K, [&](int u) {
      float *a, *b, *part, *c;
      carve(u, &a, &b, &part, &c);
      return part;
    }, [&](int64_t i) { return i >= dw_n ? l.dw_part_n + (i - dw_n) : transposed_at(i, CRS, Kg, l.gstride); },
    dw, db, accumulate);
  }
}

}  // namespace

size_t direct_dense_wgrad_workspace(const Conv2dGeom& g, int threads) {
  if (g.stride_h != 1 || g.stride_w != 1)
    return size_t(64 + threads * strided_wgrad_layout(g, threads).thread_n) * sizeof(float);
  return size_t(64 + threads * wgrad_layout(g, threads).thread_n) * sizeof(float);
}

void direct_dense_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                                  bool accumulate, void* ws) {
  if (wgrad_cl_chosen(g)) return wgrad_cl(g, x, dy, dw, db, accumulate, ws);
  if (g.stride_h != 1 || g.stride_w != 1) return strided_backward_weight(g, x, dy, dw, db, accumulate, ws);
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S, CRS = Cg * RS;
  const WgradLayout l = wgrad_layout(g, omp_get_max_threads());
  const int64_t dw_n = g.K * CRS, gstride = round_up(Kg, 64);  // dyT column of group gi: gi * gstride
  const int64_t HW = g.H * g.W, per_thread = l.thread_n;
  float* base = static_cast<float*>(ws);
  auto carve = [&](int u, float** xp, float** dyT, float** lanes, float** part, float** plane) {
    Carve c(base + u * per_thread);
    *xp = c.take<float>(l.x_n);
    *dyT = c.take<float>(l.dy_n);
    *lanes = c.take<float>(l.part_n);
    *part = c.take<float>(l.dw_part_n + g.K);
    *plane = c.take<float>(round16(HW));
  };
  const int64_t KgR = round_up(Kg, kDotKB), ldy = l.NB * l.img;  // dot: dy rows per group, row stride
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float *xp, *dyT, *lanes, *dw_part, *plane;
    carve(t, &xp, &dyT, &lanes, &dw_part, &plane);
    StoredReader xr(x, plane, HW);
    float* db_part = dw_part + l.dw_part_n;
    std::memset(xp, 0, sizeof(float) * size_t(l.x_n));
    std::memset(dyT, 0, sizeof(float) * size_t(l.dy_n));  // junk positions / padding channels stay zero
    std::memset(lanes, 0, sizeof(float) * size_t(l.part_n));
    std::memset(dw_part, 0, sizeof(float) * size_t(l.dw_part_n + g.K));
    // Static contiguous split of the batch: thread t takes images [n0, n1), in chunks of NB.
    const int64_t n0 = g.N * t / nt, n1 = g.N * (t + 1) / nt;
    for (int64_t nc = n0; nc < n1; nc += l.NB) {
      const int64_t nb = std::min(l.NB, n1 - nc);
      const PosRows pr{nb * g.P, g.P, l.HW, l.Wp, g.Q, l.HW};
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t n = nc + b;
        for (int64_t c = 0; c < g.C; ++c)
          place_plane(xr.read((n * g.C + c) * HW, HW), g.H, g.W, 1, g.pad_h, g.pad_w, l.Wp, xp + c * l.lx + b * l.img);
        const int64_t PQ = g.P * g.Q, q8 = g.Q / 8 * 8;
        for (int64_t k = 0; k < g.K; ++k) {
          const float* src = dy + (n * g.K + k) * PQ;
          if (db) {
            float s = 0.f;
            for (int64_t i = 0; i < g.P * g.Q; ++i) s += src[i];
            db_part[k] += s;
          }
          if (l.dot) {  // dy row k, image b: the output rows at the padded plane's row stride
            place_plane(src, g.P, g.Q, 1, 0, 0, l.Wp, dyT + ((k / Kg) * KgR + k % Kg) * ldy + b * l.img);
            continue;
          }
          float* dst = dyT + b * l.HW * l.kp + (k / Kg) * gstride + k % Kg;
          // 8 channels x 8 positions at a time (one strided scalar store per element was ~10% of
          // resnet20's 16-channel weight gradients); channel blocks stay inside a group.
          if (q8 && k % 8 == 0 && k % Kg + 8 <= Kg)
            for (int64_t p = 0; p < g.P; ++p)
              for (int64_t q = 0; q < q8; q += 8) transpose8x8(src + p * g.Q + q, PQ, dst + (p * l.Wp + q) * l.kp, l.kp);
          const int64_t q0 = (q8 && (k / 8 * 8) % Kg + 8 <= Kg) ? q8 : 0;  // columns the block above covered
          for (int64_t p = 0; p < g.P; ++p)
            for (int64_t q = q0; q < g.Q; ++q) dst[(p * l.Wp + q) * l.kp] = src[p * g.Q + q];
        }
      }
      if (l.dot) {
        for (int64_t gi = 0; gi < g.groups; ++gi) {
          const float* dyg = dyT + gi * KgR * ldy;
          const float* xg = xp + gi * Cg * l.lx;
          float* pg = lanes + gi * dot_part_floats(Kg, CRS);
          if (scalar_forced()) wgrad_dot<VScalar>(dyg, ldy, Kg, xg, Cg, l.lx, l.off, l.RS, nb, l.img, l.nvec, pg);
          else wgrad_dot<VNative>(dyg, ldy, Kg, xg, Cg, l.lx, l.off, l.RS, nb, l.img, l.nvec, pg);
        }
        continue;
      }
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        const float* dyg = dyT + gi * gstride;
        const float* xg = xp + gi * Cg * l.lx;
        float* dwg = dw_part + gi * CRS * gstride;  // [CRS][gstride]
        if (scalar_forced()) wgrad_planes<VScalar>(dyg, l.kp, Kg, pr, xg, Cg, l.lx, l.off, l.RS, dwg, gstride);
        else wgrad_planes<VNative>(dyg, l.kp, Kg, pr, xg, Cg, l.lx, l.off, l.RS, dwg, gstride);
      }
    }
    if (l.dot)
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        const float* pg = lanes + gi * dot_part_floats(Kg, CRS);
        if (scalar_forced()) wgrad_dot_fold<VScalar>(pg, Kg, CRS, dw_part + gi * Kg * CRS);
        else wgrad_dot_fold<VNative>(pg, Kg, CRS, dw_part + gi * Kg * CRS);
      }
#pragma omp barrier
    reduce_in_thread_order(t, nt, dw_n, g.K, [&](int u) {
      float *a, *b, *lane, *part, *c;
      carve(u, &a, &b, &lane, &part, &c);
      return part;
    }, [&](int64_t i) {  // db after the dw partials: the dot form's as dw, the outer form's transposed
      return i >= dw_n ? l.dw_part_n + (i - dw_n) : l.dot ? i : transposed_at(i, CRS, Kg, gstride);
    }, dw, db, accumulate);
  }
}

}  // namespace et::cpu
