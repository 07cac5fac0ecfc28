// Direct 3x3 kernels (stride 1 or 2) with vectors along the input channels (channels last): the
// weight gradient and the data gradient.
//
// Weight gradient:
//   dw[k][c][t] = sum_{n,p,q} dy[n][k][p*Q + q] * xpad[n][c][(st*p + r)*Wp + st*q + s]     t = r*3 + s
//
// The outer-product form (conv_direct.cpp, vectors along output channels) broadcasts one x value
// per tap for each vector of dy it loads: with 16 output channels that is 25 loads for 24 FMAs, and
// resnet20's 16 -> 16 layers ran at ~68 % of the FMA rate in the kernel. Here x is staged with its
// channels last, xcl[position][c], so the 9 taps of one position are 9 aligned vector loads of 16
// channels, each used by KB = 3 output channels whose dy values are broadcast once per position:
// 12 loads for 27 FMAs, the 27 accumulators (KB x 9 taps x 16 channels) in registers for a whole
// chunk of images (their staged x near 256 KiB, in L2). dy is read where it lies (no transposed
// copy); only x is staged.
//
// The batch goes in slots (balance.h's wgrad_slots: fixed runs of images, taken by the threads in
// any order), each with its partial sums part[k][t][c], reduced in slot order (deterministic for a
// given thread count, like the other direct kernels).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/balance.h"
#include "backends/cpu/carve.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_implicit.h"
#include "backends/cpu/conv_simd.h"
#include "backends/cpu/fused_elementwise.h"
#include "memory/stored_reader.h"

namespace et::cpu {

namespace {

constexpr int kTaps = 9;  // 3x3

// x's (or dx's) padded plane with its channels last: position j = h * Wp + w holds C floats, and
// tap t = r * 3 + s of the window at j is off[t] floats further.
struct Padded {
  int64_t Wp, HWp, HW;
  int64_t off[kTaps];
};

Padded padded(const Conv2dGeom& g) {
  Padded l;
  l.Wp = g.W + 2 * g.pad_w;
  l.HWp = (g.H + 2 * g.pad_h) * l.Wp;
  l.HW = g.H * g.W;
  for (int r = 0; r < 3; ++r)
    for (int s = 0; s < 3; ++s) l.off[r * 3 + s] = (r * l.Wp + s) * g.C;
  return l;
}

// dst[0..15] += a (a vector add through the FMA: dst + a * 1 is dst + a exactly).
template <class V>
void add_into(float* dst, const V& a) {
  V sum = V::load(dst);
  sum.fma(a, V::set1(1.f));
  sum.store(dst);
}

// Weight gradient, per thread: staged x of a chunk of NB images and one decoded image; then the
// partials of each slot of the batch (wgrad_slots).
struct ClLayout : Padded {
  int64_t NB;                  // images per chunk: a tile sweeps them all
  int64_t slots;               // the batch's slots, each a fixed run of images with its own partials
  int64_t xcl_n, plane_n, part_n;
  size_t thread_bytes, part_bytes;
  float* part_of(void* ws, int threads, int64_t slot) const {  // slot's partials, after the threads' buffers
    return reinterpret_cast<float*>(static_cast<uint8_t*>(ws) + size_t(threads) * thread_bytes +
                                    size_t(slot) * part_bytes);
  }
};

ClLayout cl_layout(const Conv2dGeom& g, int threads) {
  ClLayout l;
  static_cast<Padded&>(l) = padded(g);
  l.part_n = g.K * kTaps * g.C + g.K;  // dw partials [K][9][C], then db [K]
  l.part_bytes = CarveSize().add<float>(l.part_n).bytes;
  l.slots = wgrad_slots(g.N, threads, l.part_bytes);
  // A chunk's staged x near 256 KiB (L2): its tiles add into the partials once per chunk.
  l.NB = std::clamp<int64_t>(64 * 1024 / (l.HWp * g.C), 1, std::max<int64_t>(1, (g.N + l.slots - 1) / l.slots));
  l.xcl_n = l.NB * l.HWp * g.C;
  l.plane_n = g.C * l.HW;
  l.thread_bytes = CarveSize().add<float>(l.xcl_n).add<float>(l.plane_n).bytes;
  return l;
}

// part[(kb*9 + t)*C + 0..15] += sum over the output positions of nb images of
//   dy[b*dy_img + kb*PQ + p*Q + q] * xcl[b*x_img + (st*p*Wp + st*q) * C + off[t] + 0..15]
// dy at output channel k0, xcl at input channel c0 (both already offset).
template <class V, int KB>
void cl_tile(const float* dy, int64_t dy_img, int64_t P, int64_t Q, const float* xcl, int64_t x_img, int64_t nb,
             int64_t C, int64_t Wp, int64_t st, const int64_t* off, float* part) {
  const int64_t PQ = P * Q;
  V acc[KB][kTaps];
  for (int kb = 0; kb < KB; ++kb)
    for (int t = 0; t < kTaps; ++t) acc[kb][t] = V::zero();
  for (int64_t r = 0; r < nb * P; ++r) {
    const int64_t b = r / P, p = r % P;
    const float* xr = xcl + b * x_img + st * p * Wp * C;
    const float* dr = dy + b * dy_img + p * Q;
    for (int64_t q = 0; q < Q; ++q) {
      V d[KB];
      for (int kb = 0; kb < KB; ++kb) d[kb] = V::set1(dr[kb * PQ + q]);
      const float* xq = xr + st * q * C;
#pragma GCC unroll 9
      for (int t = 0; t < kTaps; ++t) {
        V xv = V::load(xq + off[t]);
        in_register(xv);
        for (int kb = 0; kb < KB; ++kb) acc[kb][t].fma(d[kb], xv);
      }
    }
  }
  for (int kb = 0; kb < KB; ++kb)
    for (int t = 0; t < kTaps; ++t) add_into(part + (kb * kTaps + t) * C, acc[kb][t]);
}

// A chunk of nb images: every 16-channel block of x against output channels in blocks of 3 (the
// last ones of 2 or 1: 16 = 3+3+3+3+2+2).
template <class V>
void cl_chunk(const float* dy, int64_t K, int64_t P, int64_t Q, const float* xcl, int64_t x_img, int64_t nb,
              int64_t C, int64_t Wp, int64_t st, const int64_t* off, float* part) {
  const int64_t PQ = P * Q, dy_img = K * PQ;
  for (int64_t c0 = 0; c0 < C; c0 += 16)
    for (int64_t k0 = 0; k0 < K;) {
      const int64_t left = K - k0, kb = left == 4 || left == 2 ? 2 : std::min<int64_t>(left, 3);
      const float* d = dy + k0 * PQ;
      const float* x = xcl + c0;
      float* pt = part + k0 * kTaps * C + c0;
      if (kb == 3) cl_tile<V, 3>(d, dy_img, P, Q, x, x_img, nb, C, Wp, st, off, pt);
      else if (kb == 2) cl_tile<V, 2>(d, dy_img, P, Q, x, x_img, nb, C, Wp, st, off, pt);
      else cl_tile<V, 1>(d, dy_img, P, Q, x, x_img, nb, C, Wp, st, off, pt);
      k0 += kb;
    }
}

}  // namespace

// Every read lies inside the padded plane: the last window starts at st*(P-1) <= Hp - 3.
bool wgrad_cl_applies(const Conv2dGeom& g) {
  return g.groups == 1 && g.C % 16 == 0 && g.R == 3 && g.S == 3 && g.stride_h == g.stride_w &&
         (g.stride_h == 1 || g.stride_h == 2) && g.pad_h <= 2 && g.pad_w <= 2 && g.P > 0 && g.Q > 0;
}

// Where this form runs (conv.cpp asks before the implicit GEMM and the outer form, after
// Winograd): layers of up to 128 x 128 channels. Against the paths it replaced (bench_conv, batch
// 128, GFLOP/s, two alternating runs): resnet20 16 -> 16 at 32x32 300 -> 450 (outer form), 16 -> 32
// stride 2 161 -> 415 and 32 -> 64 stride 2 250 -> 430 (implicit GEMM), 32 -> 32 at 16x16 413 -> 470
// (outer form), 64 -> 64 at 8x8 310-366 -> 463 (implicit GEMM); vgg16 64 -> 64 at 32x32 420 -> 449,
// 64 -> 128 at 16x16 361 -> 458; 128 -> 128 at 16x16 even. With more channels the partials
// ([K][9][C] per thread, 1.2 MiB at 128 x 256) leave L2 and it measured even or behind.
// With narrow vectors (conv_simd.h) not even one output channel's 9 taps fit the registers (18
// ymm): the outer form and the implicit GEMM measured 1.6-2.5x faster there (bench_conv, 2 Zen 3
// cores, resnet20's 16 -> 16 and 32 -> 32 61 / 56 -> 100 GFLOP/s).
bool wgrad_cl_chosen(const Conv2dGeom& g) {
  return !kNarrowVectors && wgrad_cl_applies(g) && g.K * g.C <= 128 * 128;
}

size_t wgrad_cl_workspace(const Conv2dGeom& g, int threads) {
  const ClLayout l = cl_layout(g, threads);
  return size_t(threads) * l.thread_bytes + size_t(l.slots) * l.part_bytes;
}

void wgrad_cl(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db, bool accumulate,
              void* ws) {
  const int threads = omp_get_max_threads();
  const ClLayout l = cl_layout(g, threads);
  const int64_t C = g.C, K = g.K, PQ = g.P * g.Q, dw_n = K * kTaps * C, x_img = l.HWp * C;
  const int64_t* off = l.off;
  StealingRanges slots(l.slots, 1, threads);
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    Carve carve(static_cast<uint8_t*>(ws) + size_t(t) * l.thread_bytes);
    float* xcl = carve.take<float>(l.xcl_n);
    float* plane = carve.take<float>(l.plane_n);
    StoredReader xr(x, plane, C * l.HW);
    std::memset(xcl, 0, sizeof(float) * size_t(l.xcl_n));  // the padding positions stay zero
    slots.run([&](int64_t s0, int64_t s1) {
        for (int64_t slot = s0; slot < s1; ++slot) {
          float* part = l.part_of(ws, threads, slot);
          std::memset(part, 0, sizeof(float) * size_t(l.part_n));
          const int64_t n0 = g.N * slot / l.slots, n1 = g.N * (slot + 1) / l.slots;
          for (int64_t nc = n0; nc < n1; nc += l.NB) {
            const int64_t nb = std::min(l.NB, n1 - nc);
            for (int64_t b = 0; b < nb; ++b) {
              const int64_t n = nc + b;
              // xcl[((h + pad_h) * Wp + w + pad_w) * C + c]; the padding positions stay zero
              image_to_channels_last(xr, n, C, g.H, g.W, g.pad_h, g.pad_w, g.H + 2 * g.pad_h, l.Wp, xcl + b * x_img);
              const float* dyn = dy + n * K * PQ;
              if (db)
                for (int64_t k = 0; k < K; ++k) {
                  float s = 0.f;
                  for (int64_t i = 0; i < PQ; ++i) s += dyn[k * PQ + i];
                  part[dw_n + k] += s;
                }
            }
            const float* dyc = dy + nc * K * PQ;
            if (scalar_forced()) cl_chunk<VScalar>(dyc, K, g.P, g.Q, xcl, x_img, nb, C, l.Wp, g.stride_h, off, part);
            else cl_chunk<VNative>(dyc, K, g.P, g.Q, xcl, x_img, nb, C, l.Wp, g.stride_h, off, part);
          }
        }
    });
#pragma omp barrier
    // dw[k][c][t] = sum over the slots, in slot order, of part[k][t][c]; each thread owns a slice.
    const int64_t total = dw_n + (db ? K : 0);
    const int64_t i0 = total * t / nt, i1 = total * (t + 1) / nt;
    for (int64_t i = i0; i < i1; ++i) {
      int64_t src = i;  // db: the partials' layout too
      if (i < dw_n) {
        const int64_t k = i / (C * kTaps), c = i / kTaps % C, tap = i % kTaps;
        src = (k * kTaps + tap) * C + c;
      }
      float s = 0.f;
      for (int64_t u = 0; u < l.slots; ++u) s += l.part_of(ws, threads, u)[src];
      float& dst = i < dw_n ? dw[i] : db[i - dw_n];
      dst = accumulate ? dst + s : s;
    }
  }
}

// ---------------------------------------------------------------- data gradient
//   dxpad[c][(st*p + r)*Wp + st*q + s] += sum_k dy[k][p*Q + q] * w[k][c][r][s]
// The same register tile with the roles of positions and output channels swapped: NP = 3
// consecutive output positions x 9 taps x 16 input channels, 27 accumulators summed over all K
// output channels (per k: 3 broadcasts of dy, 9 loads of the packed weights wt[k][t][c0..], 27
// FMAs), then added into the image's channels-last dx at the 27 padded positions they belong to.
// The implicit GEMM computes strided data gradients by stride x stride phases whose GEMMs are
// 1 to 4 taps deep, so packing dominates there (resnet20 16 -> 32 at 32x32: 177 GFLOP/s).

namespace {

// Data gradient: the packed weights (shared), then per thread the image's staged dx and a row of planes.
struct DgradLayout : Padded {
  int64_t wt_n, dxcl_n, rows_n;
  size_t shared_bytes, thread_bytes;
};

DgradLayout dgrad_layout(const Conv2dGeom& g) {
  DgradLayout l;
  static_cast<Padded&>(l) = padded(g);
  l.wt_n = g.K * kTaps * g.C;
  l.dxcl_n = l.HWp * g.C;
  l.rows_n = g.C * g.W;
  l.shared_bytes = CarveSize().add<float>(l.wt_n).bytes;
  l.thread_bytes = CarveSize().add<float>(l.dxcl_n).add<float>(l.rows_n).bytes;
  return l;
}

template <class V, int NP>
void cl_dgrad_tile(const float* dy, int64_t PQ, int64_t K, const float* wt, int64_t C, float* dxq, int64_t step,
                   const int64_t* off) {
  V acc[NP][kTaps];
  for (int i = 0; i < NP; ++i)
    for (int t = 0; t < kTaps; ++t) acc[i][t] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    V d[NP];
    for (int i = 0; i < NP; ++i) d[i] = V::set1(dy[k * PQ + i]);
    const float* wk = wt + k * kTaps * C;
#pragma GCC unroll 9
    for (int t = 0; t < kTaps; ++t) {
      V wv = V::load(wk + t * C);
      in_register(wv);
      for (int i = 0; i < NP; ++i) acc[i][t].fma(d[i], wv);
    }
  }
  for (int i = 0; i < NP; ++i)
    for (int t = 0; t < kTaps; ++t) add_into(dxq + i * step + off[t], acc[i][t]);
}

// Output channels per sweep over the positions: 32 x 9 vectors of weights (18 KiB) stay in L1.
constexpr int64_t kDgradK = 32;

// dx_cl of one image (zeroed) += the contributions of all its output positions.
template <class V>
void cl_dgrad_image(const float* dy, const Conv2dGeom& g, const float* wt, int64_t Wp, const int64_t* off,
                    float* dxcl) {
  const int64_t PQ = g.P * g.Q, C = g.C, st = g.stride_h;
  for (int64_t c0 = 0; c0 < C; c0 += 16)
    for (int64_t k0 = 0; k0 < g.K; k0 += kDgradK) {  // the block's weights stay in L1 over its sweep
      const int64_t kn = std::min(kDgradK, g.K - k0);
      const float* w0 = wt + k0 * kTaps * C + c0;
      for (int64_t p = 0; p < g.P; ++p) {
        const float* dr = dy + k0 * PQ + p * g.Q;
        float* xr = dxcl + st * p * Wp * C + c0;
        int64_t q = 0;
        for (; q + 3 <= g.Q; q += 3) cl_dgrad_tile<V, 3>(dr + q, PQ, kn, w0, C, xr + st * q * C, st * C, off);
        if (g.Q - q == 2) cl_dgrad_tile<V, 2>(dr + q, PQ, kn, w0, C, xr + st * q * C, st * C, off);
        if (g.Q - q == 1) cl_dgrad_tile<V, 1>(dr + q, PQ, kn, w0, C, xr + st * q * C, st * C, off);
      }
    }
}

// dx [C][H][W] (+)= the interior of dxcl, a row at a time through rows [C][W].
void unstage_channels_last(const float* dxcl, const Conv2dGeom& g, int64_t Wp, bool accumulate, float* rows,
                           float* dx) {
  const int64_t HW = g.H * g.W, C = g.C, W = g.W, w8 = W / 8 * 8;
  for (int64_t h = 0; h < g.H; ++h) {
    const float* src = dxcl + ((h + g.pad_h) * Wp + g.pad_w) * C;
    for (int64_t c = 0; c + 8 <= C; c += 8)
      for (int64_t w = 0; w < w8; w += 8) transpose8x8(src + w * C + c, C, rows + c * W + w, W);
    for (int64_t w = w8; w < W; ++w)
      for (int64_t c = 0; c < C; ++c) rows[c * W + w] = src[w * C + c];
    for (int64_t c = 0; c < C; ++c) {
      float* d = dx + c * HW + h * W;
      const float* r = rows + c * W;
      if (accumulate)
        for (int64_t w = 0; w < W; ++w) d[w] += r[w];
      else
        std::memcpy(d, r, sizeof(float) * size_t(W));
    }
  }
}

}  // namespace

// Strided layers with up to 64 output channels (the shapes measured): resnet20's 16 -> 32 at 32x32
// 1.58x the implicit GEMM's phases (193 -> 305 GFLOP/s), 32 -> 64 at 16x16 1.25x (250 -> 300-330,
// with the output channels in sweeps of 32; 0.95x in one sweep of 64), bench_conv, batch 128, two
// alternating runs.
// Narrow vectors: 27 accumulators do not fit (above); the implicit GEMM's phases run resnet20's
// 32 -> 64 stride 2 at 73 GFLOP/s there against 35.
bool dgrad_cl_chosen(const Conv2dGeom& g) {
  return !kNarrowVectors && wgrad_cl_applies(g) && g.stride_h > 1 && g.K <= 64;
}

size_t dgrad_cl_workspace(const Conv2dGeom& g, int threads) {
  const DgradLayout l = dgrad_layout(g);
  return l.shared_bytes + size_t(threads) * l.thread_bytes;
}

void dgrad_cl(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate, void* ws,
              const DzSumsEpilogue* dz_sums) {
  ET_CHECK(!dz_sums || g.groups == 1, "channels-last data gradient: dz sums here");
  const DgradLayout l = dgrad_layout(g);
  const int64_t C = g.C, K = g.K, PQ = g.P * g.Q;
  const int64_t* off = l.off;
  float* wt = Carve(ws).take<float>(l.wt_n);  // wt[k][t][c] = w[k][c][t]
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = 0; c < C; ++c)
      for (int t = 0; t < kTaps; ++t) wt[(k * kTaps + t) * C + c] = w[(k * C + c) * kTaps + t];
  StealingRanges images(g.N, 1, omp_get_max_threads());  // balance.h
#pragma omp parallel
  {
    Carve carve(static_cast<uint8_t*>(ws) + l.shared_bytes + size_t(omp_get_thread_num()) * l.thread_bytes);
    float* dxcl = carve.take<float>(l.dxcl_n);
    float* rows = carve.take<float>(l.rows_n);
    images.run([&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        std::memset(dxcl, 0, sizeof(float) * size_t(l.HWp * C));
        if (scalar_forced()) cl_dgrad_image<VScalar>(dy + n * K * PQ, g, wt, l.Wp, off, dxcl);
        else cl_dgrad_image<VNative>(dy + n * K * PQ, g, wt, l.Wp, off, dxcl);
        unstage_channels_last(dxcl, g, l.Wp, accumulate, rows, dx + n * C * l.HW);
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
        // The first sweep of the stack before on this image of dx, its final values, in this core's L2.
        if (dz_sums) fused_elementwise::dz_sums_images(*dz_sums, n, n + 1, C, l.HW, dx);
#endif
      }
    });
  }
}

}  // namespace et::cpu
