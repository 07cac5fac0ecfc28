// Dense stride-1 direct convolution over flattened padded planes (see conv_direct.h).
//
// Forward, per image and group (Cg in, Kg out channels, RS = R*S taps, Jr = padded output domain):
//   tile [Kr,Jr] = sum_{c,t} wpk[k][c][t] * xp[c][j + off[t]]      (Kr = Kg rounded up to MR)
// register block: MR output channels x NV vectors of 16 positions; weights are broadcast.
// Backward data: the same with dy padded by R-1-pad, channels swapped and the kernel flipped.
// Backward weight: conv_direct_wgrad.cpp.
#include "backends/cpu/conv_direct.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "backends/cpu/always_inline.h"
#include "backends/cpu/balance.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/carve.h"
#include "backends/cpu/conv_simd.h"
#include "backends/cpu/fused_elementwise.h"

namespace et::cpu {

namespace {
// d[0, n) = s[0, n): whole vectors, then the rest. The rows of CIFAR's planes are 2 to 32 floats,
// where a call of memcpy per row costs more than the copy: ResNet-20's 16 -> 16 forward and data
// gradient at 32x32 2-3 % faster (one thread, CPU time, six alternating runs; session 41).
// in_register: else GCC turns the loop back into a call of memcpy where it inlines it.
inline void copy_row(const float* s, int64_t n, float* d) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    VNative v = VNative::load(s + i);
    in_register(v);
    v.store(d + i);
  }
#if defined(__AVX512F__)
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(d + i, m, _mm512_maskz_loadu_ps(m, s + i));
  }
#else
  for (; i < n; ++i) d[i] = s[i];
#endif
}

bool g_force_scalar = false;
bool g_rows = true;
// Forward / data gradient register block: MR output channels x kNV vectors of 16 positions (24 zmm
// accumulators; narrow vectors: 6 VNative, 12 ymm, 2 more for x and 1 for the broadcast. bench_conv
// on 2 Zen 3 cores, 3 interleaved runs: resnet20's 16 -> 16 and 32 -> 32 forward and data gradient
// 12-15 % faster than 4 x 1 (8 ymm: too few FMAs in flight to cover their latency), though 16
// channels fill 18 rows; the stems' data gradients (3 rows of 6) lose 0-25 %; 2 x 2 was slower).
constexpr int MR = kDirectMR, kNV = kNarrowVectors ? 1 : 3;

}  // namespace

void conv_force_scalar(bool on) { g_force_scalar = on; }
void conv_direct_rows(bool on) { g_rows = on; }
bool scalar_forced() { return g_force_scalar; }

void place_plane(const float* src, int64_t H, int64_t W, int64_t dil, int64_t top, int64_t left, int64_t Wp,
                 float* dst) {
  for (int64_t h = 0; h < H; ++h) {
    float* d = dst + (top + h * dil) * Wp + left;
    const float* s = src + h * W;
    if (dil == 1) copy_row(s, W, d);
    else
      for (int64_t w = 0; w < W; ++w) d[w * dil] = s[w];
  }
}

ConvInput::ConvInput(const Tensor& x) {
  if (x.dtype != DType::AffineRelu) {
    planes = x.f32();
    return;
  }
  stack = static_cast<const AffineReluSource*>(x.data);
  ET_CHECK(stack->x.dtype == DType::F32 && stack->x.numel() == x.numel(), "conv2d: relu(affine) input ",
           x.shape.str());
  planes = stack->x.f32();
}

void ConvInput::place(int64_t C, int64_t pl, int64_t H, int64_t W, int64_t top, int64_t left, int64_t Wp,
                      float* dst) const {
  const float* x = planes + pl * H * W;
  if (!stack) return place_plane(x, H, W, 1, top, left, Wp, dst);
  // The stack's run over as many rows as fill a buffer in L1, then each row to its place: a call
  // per row cost 5-15 % of the forward of ResNet-20's 32x32 and 16x16 convs (session 41, bench_conv
  // --fused), the run's channel lookup and tail more than its arithmetic on 16 or 32 floats.
  constexpr int64_t kBuf = 1024;
  alignas(64) float buf[kBuf];
  const int64_t rows = std::max<int64_t>(1, kBuf / W);
  for (int64_t h = 0; h < H; h += rows) {
    const int64_t k = std::min(rows, H - h), at = pl * H * W + h * W;
    if (W > kBuf) {  // a row longer than the buffer: straight to its place
      stack->run(x + h * W, stack->scale, stack->shift, C, H * W, at, W, dst + (top + h) * Wp + left);
      continue;
    }
    stack->run(x + h * W, stack->scale, stack->shift, C, H * W, at, k * W, buf);
    for (int64_t i = 0; i < k; ++i) copy_row(buf + i * W, W, dst + (top + h + i) * Wp + left);
  }
}

const float* ConvInput::image(int64_t C, int64_t HW, int64_t n, float* scratch) const {
  const float* x = planes + n * C * HW;
  if (!stack) return x;
  stack->run(x, stack->scale, stack->shift, C, HW, n * C * HW, C * HW, scratch);
  return scratch;
}

void extract_plane(const float* tile, int64_t Wp, int64_t P, int64_t Q, int64_t s, float bias, bool accumulate,
                   float* dst) {
  for (int64_t p = 0; p < P; ++p) {
    const float* t = tile + p * s * Wp;
    float* d = dst + p * Q;
    if (s == 1) {
      if (accumulate)
        for (int64_t q = 0; q < Q; ++q) d[q] += t[q] + bias;
      else
        for (int64_t q = 0; q < Q; ++q) d[q] = t[q] + bias;
    } else {
      if (accumulate)
        for (int64_t q = 0; q < Q; ++q) d[q] += t[q * s] + bias;
      else
        for (int64_t q = 0; q < Q; ++q) d[q] = t[q * s] + bias;
    }
  }
}

namespace {

// ---------------------------------------------------------------- forward-style correlation

// acc += one tap: the MR weights at wpk times the NV input vectors at xs + at[v].
template <class V, int NV>
ET_ALWAYS_INLINE inline void corr_tap(const float* xs, const int64_t* at, const float* wpk, V (&acc)[MR][NV]) {
  V xv[NV];
  for (int v = 0; v < NV; ++v) xv[v] = V::load(xs + at[v]);
  fma_broadcast_rows<MR>(wpk, xv, acc);
}

// acc[i][v] = sum over c, t of wpk's weight i of (c, t) times the 16 inputs at xp + c * L + off[t]
// + at[v], c outer, t inner: every caller's FMAs per element in this one order.
// wpk [Cin][RS][MR]: the MR weights of one tap are adjacent (broadcast one after the other).
// Always inlined: called out of line, its accumulators lived in memory (2.5x slower).
template <class V, int NV>
ET_ALWAYS_INLINE inline void corr_accumulate(const float* xp, int64_t L, const int64_t* off, int RS,
                                                           int64_t Cin, const float* wpk, const int64_t* at,
                                                           V (&acc)[MR][NV]) {
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = V::zero();
  for (int64_t c = 0; c < Cin; ++c) {
    const float* xc = xp + c * L;
    for (int t = 0; t < RS; ++t, wpk += MR) corr_tap(xc + off[t], at, wpk, acc);
  }
}

// The same sums where vectors are narrow (NEON, AVX2), out of line, with loops that run at least
// once (Cin, RS >= 1), the block written to tile [MR][16 NV] at the end: inlined into its callers,
// GCC 12 for aarch64 kept the accumulators in memory as well and stored them on every tap (8 stp
// per 16 fmla; always_inline.h, ET_NOINLINE).
template <class V, int NV>
ET_NOINLINE void corr_accumulate_to_tile(const float* xp, int64_t L, const int64_t* off, int RS, int64_t Cin,
                                         const float* wpk, const int64_t* at, float* tile) {
  V acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = V::zero();
  int64_t c = 0;
  do {
    const float* xc = xp + c * L;
    int t = 0;
    do {
      corr_tap(xc + off[t], at, wpk, acc);
      wpk += MR;
    } while (++t < RS);
  } while (++c < Cin);
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v].store(tile + (i * NV + v) * 16);
}

// corr_accumulate, through corr_accumulate_to_tile where vectors are narrow.
template <class V, int NV>
ET_ALWAYS_INLINE inline void corr_block(const float* xp, int64_t L, const int64_t* off, int RS, int64_t Cin,
                                        const float* wpk, const int64_t* at, V (&acc)[MR][NV]) {
  if constexpr (kNarrowVectors && !std::is_same_v<V, VScalar>) {
    ET_CHECK(Cin >= 1 && RS >= 1, "direct conv: an empty correlation");
    alignas(64) float tile[MR * NV * 16];
    corr_accumulate_to_tile<V, NV>(xp, L, off, RS, Cin, wpk, at, tile);
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = V::load(tile + (i * NV + v) * 16);
  } else {
    corr_accumulate<V, NV>(xp, L, off, RS, Cin, wpk, at, acc);
  }
}

// out[i][j0 + 16v] for i < MR, v < NV; xp and out already offset by j0.
template <class V, int NV>
void corr_tile(const float* xp, int64_t L, const int64_t* off, int RS, int64_t Cin, const float* wpk, float* out,
               int64_t Jr) {
  int64_t at[NV];
  for (int v = 0; v < NV; ++v) at[v] = 16 * v;
  V acc[MR][NV];
  corr_block<V, NV>(xp, L, off, RS, Cin, wpk, at, acc);
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v].store(out + i * Jr + 16 * v);
}

// tile [Kr,Jr] = correlation of Cin planes xp [Cin][L] with packed weights wpk [Kr/MR][Cin][RS][MR].
template <class V>
void corr_planes(const float* xp, int64_t Cin, int64_t L, const int64_t* off, int RS, const float* wpk, int64_t Kr,
                 float* tile, int64_t Jr) {
  const int64_t nvec = Jr / 16;
  for (int64_t kb = 0; kb < Kr / MR; ++kb) {
    const float* wb = wpk + kb * Cin * RS * MR;
    float* ob = tile + kb * MR * Jr;
    int64_t v = 0;
    for (; v + kNV <= nvec; v += kNV) corr_tile<V, kNV>(xp + 16 * v, L, off, RS, Cin, wb, ob + 16 * v, Jr);
    if (nvec - v == 2) corr_tile<V, 2>(xp + 16 * v, L, off, RS, Cin, wb, ob + 16 * v, Jr);
    else if (nvec - v == 1) corr_tile<V, 1>(xp + 16 * v, L, off, RS, Cin, wb, ob + 16 * v, Jr);
  }
}

}  // namespace

void corr_planes_any(const float* xp, int64_t Cin, int64_t L, const int64_t* off, int RS, const float* wpk,
                     int64_t Kr, float* tile, int64_t Jr) {
  if (g_force_scalar) corr_planes<VScalar>(xp, Cin, L, off, RS, wpk, Kr, tile, Jr);
  else corr_planes<VNative>(xp, Cin, L, off, RS, wpk, Kr, tile, Jr);
}

namespace {

// Row vectors, where each output row is whole vectors (Q a multiple of 16, stride 1): output vector
// v covers out[16v, 16v + 16) of the plane, row v / (Q / 16), and reads its inputs from that row's
// place in the padded planes. Nothing is computed for the padded planes' junk columns (2 of 18
// columns at 16x16, 2 of 34 at 32x32), and the results go straight to the output planes, with the
// flat form's epilogue arithmetic (+ bias, or out + (acc + bias)): no tile, no extract. Each
// element takes the same FMAs in the same order as in corr_tile, so the results are the same bits.
// out[i * ldo + 16v] for i < nk (<= MR), v < NV; xp already offset by the tile's first vector's
// input place, `at` holds each vector's place relative to it.
template <class V, int NV>
void corr_tile_rows(const float* xp, int64_t L, const int64_t* off, int RS, int64_t Cin, const float* wpk,
                    const int64_t* at, float* out, int64_t ldo, int nk, const float* bias, bool accumulate) {
  V acc[MR][NV];
  corr_block<V, NV>(xp, L, off, RS, Cin, wpk, at, acc);
  for (int i = 0; i < nk; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v].store_plus(out + i * ldo + 16 * v, bias ? bias[i] : 0.f, accumulate);
}

// out [nk][P*Q] (plane stride ldo) = the correlation of Cin padded planes xp [Cin][L] (row width
// Wp) with one block of packed weights wpk [Cin][RS][MR], its first nk <= MR rows (+ bias[k];
// accumulated into out where asked). The callers go block by block, each block's epilogue (plane
// sums, the stack's first sweep) while its planes are in L1.
template <class V>
void corr_planes_rows(const float* xp, int64_t Cin, int64_t L, int64_t Wp, const int64_t* off, int RS,
                      const float* wpk, int nk, int64_t P, int64_t Q, float* out, int64_t ldo, const float* bias,
                      bool accumulate) {
  const int64_t per_row = Q / 16, nvec = P * per_row;
  auto place = [&](int64_t v) { return (v / per_row) * Wp + (v % per_row) * 16; };
  int64_t v = 0;
  for (; v + kNV <= nvec; v += kNV) {
    int64_t at[kNV];
    for (int i = 0; i < kNV; ++i) at[i] = place(v + i) - place(v);
    corr_tile_rows<V, kNV>(xp + place(v), L, off, RS, Cin, wpk, at, out + 16 * v, ldo, nk, bias, accumulate);
  }
  if (nvec - v == 2) {
    const int64_t at[2] = {0, place(v + 1) - place(v)};
    corr_tile_rows<V, 2>(xp + place(v), L, off, RS, Cin, wpk, at, out + 16 * v, ldo, nk, bias, accumulate);
  } else if (nvec - v == 1) {
    const int64_t at[1] = {0};
    corr_tile_rows<V, 1>(xp + place(v), L, off, RS, Cin, wpk, at, out + 16 * v, ldo, nk, bias, accumulate);
  }
}

}  // namespace

bool rows_apply(int64_t Q) { return g_rows && Q % 16 == 0; }

void corr_planes_rows_any(const float* xp, int64_t Cin, int64_t L, int64_t Wp, const int64_t* off, int RS,
                          const float* wpk, int nk, int64_t P, int64_t Q, float* out, int64_t ldo, const float* bias,
                          bool accumulate) {
  if (g_force_scalar)
    corr_planes_rows<VScalar>(xp, Cin, L, Wp, off, RS, wpk, nk, P, Q, out, ldo, bias, accumulate);
  else
    corr_planes_rows<VNative>(xp, Cin, L, Wp, off, RS, wpk, nk, P, Q, out, ldo, bias, accumulate);
}

void pack_weights(const float* w, int64_t Kg, int64_t Cg, int RS, bool flip, float* wpk) {
  const int64_t out = flip ? Cg : Kg, in = flip ? Kg : Cg, Or = round_up(out, MR);
  for (int64_t ob = 0; ob < Or / MR; ++ob)
    for (int64_t c = 0; c < in; ++c)
      for (int t = 0; t < RS; ++t)
        for (int i = 0; i < MR; ++i) {
          const int64_t o = ob * MR + i;
          float v = 0.f;
          if (o < out) v = flip ? w[(c * Cg + o) * RS + (RS - 1 - t)] : w[(o * Cg + c) * RS + t];
          *wpk++ = v;
        }
}

namespace {

// Geometry of a stride-1 correlation over padded planes.
struct Flat {
  int64_t Hp, Wp, L;  // padded plane rows, row width, plane stride
  int64_t rows, Jr;   // output rows (Hp - R + 1), output domain rows*Wp rounded up to 16
  int64_t off[kMaxTaps];
  int RS;
};

Flat make_flat(int64_t Hp, int64_t Wp, int64_t R, int64_t S) {
  Flat f;
  f.Hp = Hp;
  f.Wp = Wp;
  f.L = plane_stride(Hp, Wp, S);
  f.rows = Hp - R + 1;
  f.Jr = round16(f.rows * Wp);
  f.RS = int(R * S);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t s = 0; s < S; ++s) f.off[r * S + s] = r * Wp + s;
  return f;
}

Flat fwd_flat(const Conv2dGeom& g) { return make_flat(g.H + 2 * g.pad_h, g.W + 2 * g.pad_w, g.R, g.S); }
Flat bwd_data_flat(const Conv2dGeom& g) {
  return make_flat(g.P + 2 * (g.R - 1 - g.pad_h), g.Q + 2 * (g.S - 1 - g.pad_w), g.R, g.S);
}


}  // namespace

bool direct_dense_applies(const Conv2dGeom& g, ConvPass pass) {
  if (g.stride_h != 1 || g.stride_w != 1) return direct_strided_applies(g, pass);
  if (g.R * g.S > kMaxTaps) return false;
  if (pass == ConvPass::BackwardData && (g.pad_h > g.R - 1 || g.pad_w > g.S - 1)) return false;
  return true;
}

size_t direct_dense_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S;
  int64_t shared = 0, per_thread = 0;
  // The kernels each entry point hands over to, in the entry points' order.
  if (pass == ConvPass::BackwardData && dgrad_cl_chosen(g)) return dgrad_cl_workspace(g, threads);
  if (pass == ConvPass::BackwardWeight && wgrad_cl_chosen(g)) return wgrad_cl_workspace(g, threads);
  if (pass == ConvPass::BackwardWeight) return direct_dense_wgrad_workspace(g, threads);  // strided too
  if (g.stride_h != 1 || g.stride_w != 1) return direct_strided_workspace(g, pass, threads);
  if (pass == ConvPass::Forward) {
    const Flat f = fwd_flat(g);
    shared = g.groups * round_up(Kg, MR) * Cg * RS;
    per_thread = g.C * f.L + round_up(Kg, MR) * f.Jr + 128;
  } else {
    const Flat f = bwd_data_flat(g);
    shared = g.groups * round_up(Cg, MR) * Kg * RS;
    per_thread = g.K * f.L + round_up(Cg, MR) * f.Jr + 128;
  }
  return size_t(shared + 64 + threads * per_thread) * sizeof(float);
}

void direct_dense_forward(const Conv2dGeom& g, const Tensor& xt, const float* w, const float* b, float* y, void* ws,
                          float* sum1, float* sum2) {
  if (g.stride_h != 1 || g.stride_w != 1) return direct_strided_forward(g, xt, w, b, y, ws, sum1, sum2);
  const ConvInput x(xt);
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S, Kr = round_up(Kg, MR);
  const Flat f = fwd_flat(g);
  Carve cv(static_cast<float*>(ws));
  float* wpk = cv.take<float>(g.groups * Kr * Cg * RS);
  for (int64_t gi = 0; gi < g.groups; ++gi)
    pack_weights(w + gi * Kg * Cg * RS, Kg, Cg, int(RS), false, wpk + gi * Kr * Cg * RS);
  float* thread_base = reinterpret_cast<float*>(cv.p);  // the threads' pieces after the shared one
  StealingRanges images(g.N, 1, omp_get_max_threads());  // balance.h
#pragma omp parallel
  {
    Carve tc(thread_base + omp_get_thread_num() * (g.C * f.L + Kr * f.Jr + 128));
    float* xp = tc.take<float>(g.C * f.L);
    float* tile = tc.take<float>(Kr * f.Jr);
    std::memset(xp, 0, sizeof(float) * size_t(g.C * f.L));  // borders stay zero; interiors are overwritten
    images.run([&](int64_t n_begin, int64_t n_end) {
      for (int64_t n = n_begin; n < n_end; ++n) {
        for (int64_t c = 0; c < g.C; ++c) x.place(g.C, n * g.C + c, g.H, g.W, g.pad_h, g.pad_w, f.Wp, xp + c * f.L);
        for (int64_t gi = 0; gi < g.groups; ++gi) {
          const int64_t pl0 = n * g.K + gi * Kg;
          const int64_t PQ = g.P * g.Q;
          auto sums = [&](int64_t k0, int64_t k1) {  // planes [k0, k1)'s sums for the BN after the conv
            if (sum1)
              for (int64_t k = k0; k < k1; ++k)
                bn_rows::plane_sums(y + (pl0 + k) * PQ, PQ, sum1 + pl0 + k, sum2 + pl0 + k);
          };
          if (rows_apply(g.Q)) {
            // Straight into y, MR planes at a time, and their sums while they are in L1 (after all Kg
            // planes, 3-4 % of the forward of ResNet-20's 32x32 and 16x16 convs: their 64 and 32 KiB
            // had left it, session 41).
            for (int64_t k0 = 0; k0 < Kg; k0 += MR) {
              const int64_t nk = std::min<int64_t>(MR, Kg - k0);
              corr_planes_rows_any(xp + gi * Cg * f.L, Cg, f.L, f.Wp, f.off, f.RS, wpk + (gi * Kr + k0) * Cg * RS,
                                   int(nk), g.P, g.Q, y + (pl0 + k0) * PQ, PQ, b ? b + gi * Kg + k0 : nullptr, false);
              sums(k0, k0 + nk);
            }
          } else {
            corr_planes_any(xp + gi * Cg * f.L, Cg, f.L, f.off, f.RS, wpk + gi * Kr * Cg * RS, Kr, tile, f.Jr);
            for (int64_t k = 0; k < Kg; ++k)
              extract_plane(tile + k * f.Jr, f.Wp, g.P, g.Q, 1, b ? b[gi * Kg + k] : 0.f, false, y + (pl0 + k) * PQ);
            sums(0, Kg);
          }
        }
      }
    });
  }
}

bool direct_dense_dz_sums_applies(const Conv2dGeom& g) {
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
  return g.groups == 1;  // the stride-1 kernels per block of planes, the strided ones per image
#else
  (void)g;
  return false;
#endif
}

void direct_dense_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                                void* ws, const DzSumsEpilogue* dz_sums) {
  ET_CHECK(!dz_sums || direct_dense_dz_sums_applies(g), "direct data gradient: dz sums here");
  if (dgrad_cl_chosen(g)) return dgrad_cl(g, dy, w, dx, accumulate, ws, dz_sums);
  if (g.stride_h != 1 || g.stride_w != 1) return direct_strided_backward_data(g, dy, w, dx, accumulate, ws, dz_sums);
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, RS = g.R * g.S, Cr = round_up(Cg, MR);
  const Flat f = bwd_data_flat(g);  // f.rows == H
  Carve cv(static_cast<float*>(ws));
  float* wpk = cv.take<float>(g.groups * Cr * Kg * RS);
  for (int64_t gi = 0; gi < g.groups; ++gi)
    pack_weights(w + gi * Kg * Cg * RS, Kg, Cg, int(RS), true, wpk + gi * Cr * Kg * RS);
  float* thread_base = reinterpret_cast<float*>(cv.p);  // the threads' pieces after the shared one
  const int64_t ph = g.R - 1 - g.pad_h, pw = g.S - 1 - g.pad_w;
  StealingRanges images(g.N, 1, omp_get_max_threads());  // balance.h
#pragma omp parallel
  {
    Carve tc(thread_base + omp_get_thread_num() * (g.K * f.L + Cr * f.Jr + 128));
    float* dyp = tc.take<float>(g.K * f.L);
    float* tile = tc.take<float>(Cr * f.Jr);
    std::memset(dyp, 0, sizeof(float) * size_t(g.K * f.L));
    images.run([&](int64_t n_begin, int64_t n_end) {
      for (int64_t n = n_begin; n < n_end; ++n) {
        for (int64_t k = 0; k < g.K; ++k)
          place_plane(dy + (n * g.K + k) * g.P * g.Q, g.P, g.Q, 1, ph, pw, f.Wp, dyp + k * f.L);
        for (int64_t gi = 0; gi < g.groups; ++gi) {
          const int64_t HW = g.H * g.W, pl0 = n * g.C + gi * Cg;
          float* dxg = dx + pl0 * HW;
          // The first sweep of the stack before on planes [pl0 + c0, pl0 + c1) of dx (dz_sums: groups 1),
          // while they are in this core's cache.
          auto sweep1 = [&](int64_t c0, int64_t c1) {
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
            if (dz_sums) fused_elementwise::dz_sums_planes(*dz_sums, pl0 + c0, pl0 + c1, g.C, HW, dx);
#else
            (void)c0, (void)c1;
#endif
          };
          if (rows_apply(g.W)) {  // straight into dx, MR planes at a time, each block's sweep while in L1
            for (int64_t c0 = 0; c0 < Cg; c0 += MR) {
              const int64_t nc = std::min<int64_t>(MR, Cg - c0);
              corr_planes_rows_any(dyp + gi * Kg * f.L, Kg, f.L, f.Wp, f.off, f.RS, wpk + (gi * Cr + c0) * Kg * RS,
                                   int(nc), g.H, g.W, dxg + c0 * HW, HW, nullptr, accumulate);
              sweep1(c0, c0 + nc);
            }
          } else {
            corr_planes_any(dyp + gi * Kg * f.L, Kg, f.L, f.off, f.RS, wpk + gi * Cr * Kg * RS, Cr, tile, f.Jr);
            for (int64_t c = 0; c < Cg; ++c)
              extract_plane(tile + c * f.Jr, f.Wp, g.H, g.W, 1, 0.f, accumulate, dxg + c * HW);
            sweep1(0, Cg);
          }
        }
      }
    });
  }
}

}  // namespace et::cpu
