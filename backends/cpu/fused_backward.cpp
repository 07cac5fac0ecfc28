// Fused stacks headed by a BN on CPU, their backward (the forward: fused.cpp; docs/fusion.md). BN's
// two backward reductions are per channel over the whole batch, so the backward makes two sweeps:
// sweep 1 rebuilds dz (the gradient of BN's output) plane by plane, from the saved y mask or a
// recompute from x, writes the side gradient, takes the plane's sums and parks dz in dx; sweep 2
// turns dz into dx in place. BN -> ReLU -> 2x2 max-pool rebuilds dz in registers in both sweeps
// instead (fused_bn_relu_pool.h), BN -> ReLU -> stride-1 max-pool through pool_stride1.h, and dx
// that accumulates has sweep 2 rebuild it. Sweep 1 may come done from y's reader (a conv's data
// gradient, FusedGrads::dz_sums) and sweep 2 may be handed on to the stack before
// (FusedGrads::dx_coef). Every stage calls the functions the layers' backward calls, and the
// reductions keep their order, so the results equal the unfused layers' bit for bit.
#include <omp.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/fused_bn_relu_pool.h"
#include "backends/cpu/fused_common.h"
#include "backends/cpu/fused_elementwise.h"
#include "backends/cpu/pool_planes.h"

namespace et {
using namespace fused_elementwise;
using namespace fused_planes;

namespace {
// BN -> ReLU -> stride-1 max-pool on whole planes: each plane's dz from pool_stride1.h's backward.
bool stride1_pool_planes(const FusedStack& s) { return bn_relu_pool_stride1(s) && !s.small_planes(); }
}  // namespace

bool CpuBackend::fused_reads_dy_affine(const FusedStack& s) const { return stride1_pool_planes(s); }

// pool_stride1.h's backward reads a plane's dy rows before it writes the dx rows over them
// (pool_3x3_rows.h reads the whole plane first; the general kernel reads output rows ahead of the
// input row it writes), and sweep 2 is element-wise on the plane. bench fusion at depth 8: the
// backward 48-54 -> 39-41 ms (docs/fusion-log.md, session 44).
bool CpuBackend::fused_pool_grad_in_place(const FusedStack& s) const { return stride1_pool_planes(s); }

// Sweep 1 in the reader's data gradient (fused_elementwise::dz_sums_piece): stacks whose own
// sweep 1 is elementwise_dz's in memory order (BN -> ReLU, BN -> add -> ReLU, BN -> add), so the
// sums are those bits; sweep 2 then writes the side gradient from the parked dz.
bool CpuBackend::fused_takes_dz_sums(const FusedStack& s) const {
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
  return s.headed_by_bn() && elementwise_kind(s) != ElementwiseOnly::No && !s.small_planes() &&
         !s.channel_slabs && s.band_rows == 0;
#else
  (void)s;
  return false;
#endif
}

void CpuBackend::fused_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws) {
  // The second sweep handed on to the stack before (FusedGrads::dx_coef): not unless taken below.
  if (g.dx_coef.defined()) g.dx_coef.f32()[0] = 0.f;
  if (!s.headed_by_bn()) return relu_pool_backward(s, t, g, ws);
  if (s.small_planes()) return fused_blocks_backward(s, t, g, ws);
  // A folded side BN (FusedStack::side_bn): g.dside is x2's gradient, which its own sweep 2 writes;
  // the first sweep writes no side gradient (the BN's dy is dz itself).
  const Tensor side_dx = s.side_bn ? g.dside : Tensor{};
  const bool side_dx_accumulate = g.dside_accumulate;
  if (s.side_bn) g.dside = Tensor{};
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t N = t.x.dim(0), C = s.C, HW = bn.H * bn.W, PQ = last.P * last.Q, S = int64_t(s.stages.size());
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  const int add = s.add_stage();
  const bool recompute = needs_recompute(s, g.x_exact);
  const bool read_y_mask = s.saves_output_mask && !(recompute && add < 0);
  const int64_t per_thread = thread_floats(s), plane = stage_buffer(s);
  const SumTables tab(static_cast<float*>(ws.data) + per_thread * cpu_threads(), N, C);
  auto* coef = reinterpret_cast<bn_rows::GradCoefficients*>(tab.rest);
  const SumTables side_tab = side_bn_tables(static_cast<float*>(ws.data) + per_thread * cpu_threads(), N, C);
  auto* side_coef = reinterpret_cast<bn_rows::GradCoefficients*>(side_tab.rest);
  const bool memory_order = !s.channel_slabs;
  ET_CHECK(!s.side_bn || (memory_order && s.band_rows == 0 && t.side.dtype == DType::F32 &&
                          t.side.numel() == t.x.numel()),
           "fused stack: a side BN off whole planes in memory order, or without its x2");
  [[maybe_unused]] const ElementwiseOnly ew = elementwise_only(s, g, recompute);  // AVX-512, AVX2, NEON
  // Bands of rows (FusedStack::band_rows): the scratch holds a band, not a plane. The paths in
  // registers need no scratch but for x widened from a 16-bit stash, a whole plane: not then.
  const bool banded = s.band_rows > 0;
  [[maybe_unused]] const bool whole_x = !banded || t.x.dtype == DType::F32;
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
  const bool in_registers = ew != ElementwiseOnly::No && whole_x;
#else
  [[maybe_unused]] const bool in_registers = false;
#endif
  // The forward's BN as y = x * scale + shift, for plane pl's channel (the recomputes below).
  [[maybe_unused]] auto coefficients = [&](int64_t pl, float* scale, float* shift) {
    const int64_t c = pl % C;
    bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], scale, shift);
  };
#if defined(ET_POOL_IN_REGISTERS)
  // BN -> ReLU -> 2x2 max-pool: dz in registers from x and dy in both sweeps (fused_bn_relu_pool.h).
  const bool pool_in_registers = fused_bn_relu_pool::applies(s) && whole_x;
  const fused_bn_relu_pool::Layout pool_layout(pool_in_registers ? last.Q : 4);
  auto pool_dz = [&](int64_t pl, const float* x) {
    float scale, shift;
    coefficients(pl, &scale, &shift);
    return fused_bn_relu_pool::PlaneDz(pool_layout, x, g.dy.f32() + pl * PQ, scale, shift);
  };
#else
  const bool pool_in_registers = false;
#endif
  // dz parks in dx between the sweeps (in dy's place, as the planner shares them, it costs no
  // bytes), unless dx accumulates or the pool's dz is rebuilt: then sweep 2 builds it again.
  const bool park = g.dx.defined() && !g.dx_accumulate && !pool_in_registers;
  // The second sweep handed on (FusedGrads::dx_coef): dz stays parked in dx, and the stack before
  // builds dx from it with y, its own output, which is this x where x keeps the forward's values.
  float* const hand_on = g.dx_coef.defined() && park && g.x_lossless ? g.dx_coef.f32() : nullptr;
  if (hand_on) hand_on[0] = 1.f;
  auto hand_on_channel = [&](int64_t c, const bn_rows::GradCoefficients& k) {
    float* to = hand_on + dy_coef_of(c);
    to[0] = k.a, to[1] = k.b, to[2] = k.c0;
  };
  // dy handed on by the stack after this one (FusedGrads::dy_coef); the flag is spent on reading.
  const float* dy_coef = g.dy_coef.defined() && g.dy_coef.f32()[0] == 1.f ? g.dy_coef.f32() : nullptr;
  if (g.dy_coef.defined()) g.dy_coef.f32()[0] = 0.f;
#if defined(ET_POOL_IN_REGISTERS)
  // dx, a tensor of its own here (dy is a quarter of it), by streaming stores where the planner
  // asks for them (FusedStack::stream_dx).
  const bool stream_dx = pool_in_registers && s.stream_dx && g.dx.defined() && !g.dx_accumulate &&
                         reinterpret_cast<uintptr_t>(g.dx.f32()) % 64 == 0;
#endif

  const bool global_pool = s.ends_in_global_pool();  // whole planes: dy is one value a plane
  ET_CHECK(!global_pool || !banded, "fused stack: a global pool over bands");
  // After a global pool dx is a tensor of its own (no dy of its size to share): dz parks there by
  // streaming stores where the planner asks for them (FusedStack::stream_dx), as the pooled stacks
  // write dx, sparing the read of each line before it is written.
  [[maybe_unused]] const bool stream_park = global_pool && in_registers && park && s.stream_dx && HW % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(g.dx.f32()) % 64 == 0;
  const bool last_pool = s.last().kind == FusedKind::MaxPool || s.last().kind == FusedKind::AvgPool || global_pool;
  // A last global pool's gradient of plane pl, dy / HW in every element, into the scratch's first
  // plane (the paths in registers read it as their dy plane; the layer's arithmetic).
  [[maybe_unused]] auto global_pool_dy = [&](float* scratch, int64_t pl) -> const float* {
    if (!global_pool) return nullptr;
    pool_planes::plane_mean_backward(g.dy.f32()[pl], HW, scratch, false);
    return scratch;
  };
  // BN -> ReLU -> stride-1 max-pool: dz of plane pl from x and dy into `into` (pool_stride1.h).
  const bool pool_stride1 = bn_relu_pool_stride1(s);
  // Sweep 1 done by the reader's data gradient (FusedGrads::dz_sums): dz in dy, the planes' sums
  // in g.dz_sums; sweep 2 alone is left.
  const bool dz_in_dy = g.dz_sums.defined();
  ET_CHECK(!dz_in_dy || (fused_takes_dz_sums(s) && memory_order && in_registers && !hand_on &&
                         g.dz_sums.numel() >= dz_sums_floats(N, C)),
           "fused stack: a first sweep taken from its reader it cannot use");
  ET_CHECK(!dy_coef || fused_reads_dy_affine(s), "fused stack: dy handed on to a stack that cannot read it");
  auto pool_stride1_dz = [&](int64_t pl, const float* x, float* into) -> const float* {
#if defined(ET_BN_RELU_POOL_STRIDE1)
    float scale, shift;
    coefficients(pl, &scale, &shift);
    const pool_planes::DyAffine affine(dy_coef ? dy_coef + dy_coef_of(pl % C) : nullptr);
    pool_planes::max_backward_stride1(pool_planes::of(last), x, pool_planes::BnReluInput(scale, shift),
                                      g.dy.f32() + pl * PQ, into, false, dy_coef ? &affine : nullptr);
#else
    (void)pl, (void)x;
#endif
    return into;
  };
  // x's plane (n, c) as f32: in place, or widened into the scratch's last plane.
  auto x_plane = [&](float* scratch, int64_t pl) {
    return bn_rows::x_f32(t.x, pl * HW, HW, scratch + (S + 2) * plane);
  };
  // Bands: x's rows [r0, r1) of plane (n, c) as f32, and dz of band b over its input-side rows
  // [b0, b1) (x from row b0), the stages run on the band's rows and the pool's halo.
  auto x_rows = [&](float* scratch, int64_t pl, int64_t r0, int64_t r1) {
    return bn_rows::x_f32(t.x, pl * HW + r0 * bn.W, (r1 - r0) * bn.W, scratch + (S + 2) * plane);
  };
  // dz (the gradient of the BN output) in the thread's scratch, or where the pool's gradient goes:
  // pool_into (a plane of dx, where sweep 1 parks dz: the pool writes it there and the stages before
  // it work in place, no copy). The first sweep also writes the side input's gradient, which the
  // Add stage hands on unchanged. A last pool's output is not needed, only its input.
  auto band_dz = [&](float* scratch, int64_t pl, const BandRows& b, const float* x, bool first_sweep,
                     float* pool_into = nullptr) -> const float* {
    const StageRows rows = global_pool ? whole_planes(s, pl, 1, t.seed) : one_band(s, b, pl, t.seed);
    float* out[kMaxStages];
    for (int64_t k = 0; k < S; ++k) out[k] = scratch + k * plane;
    float* ga = scratch + S * plane;
    float* gb = pool_into ? pool_into : ga + plane;
    if (recompute) {
      float scale, shift;
      coefficients(pl, &scale, &shift);
      forward_rows(s, rows, s.stages.size() - (last_pool ? 1 : 0), x, add >= 0 ? t.side.f32() + rows.side_off : nullptr,
                   scale, shift, out, true);
    }
    return stages_backward(s, rows, g, out, g.dy.f32() + rows.y_off, ga, gb, first_sweep, read_y_mask);
  };
  // ... of a whole plane: one band of all its rows.
  auto plane_dz = [&](float* scratch, int64_t pl, const float* x, bool first_sweep, float* pool_into = nullptr) {
    return band_dz(scratch, pl, forward_band(s, 0, last.P), x, first_sweep, pool_into);
  };
  // Sweep 1 on plane (n, c): dz, the side gradient, dz parked, the plane's two sums in float.
  auto sweep1 = [&](float* scratch, int64_t pl, float* a, float* b) {
    const int64_t c = pl % C, o = pl * HW;
    if (banded && !in_registers && !pool_in_registers) {  // the sums carried across the bands
      bn_rows::GradLanes lanes;
      for (int64_t a0 = 0; a0 < bn.H; a0 += s.band_rows) {
        const int64_t a1 = std::min(bn.H, a0 + s.band_rows);
        const BandRows band = backward_band(s, a0, a1);
        const float* x = x_rows(scratch, pl, band.b0, band.b1);
        const int64_t from = (a0 - band.b0) * bn.W;
        const float* dz = band_dz(scratch, pl, band, x, true) + from;
        bn_rows::grad_sums_piece(bn_rows::row_of(dz), x + from, t.mean.f32()[c], (a1 - a0) * bn.W, &lanes);
        if (park) std::memcpy(g.dx.f32() + o + a0 * bn.W, dz, sizeof(float) * size_t((a1 - a0) * bn.W));
      }
      return bn_rows::grad_sums_finish(lanes, a, b);
    }
    const float* x = x_plane(scratch, pl);
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
    if (in_registers)  // dz from dy and the mask (recomputed from x or read)
      return bn_rows::grad_sums(
          elementwise_dz(ew, g, t, c, o, x, recompute, true, park, global_pool_dy(scratch, pl), stream_park), x,
          t.mean.f32()[c], HW, a, b);
#endif
#if defined(ET_POOL_IN_REGISTERS)
    if (pool_in_registers) return bn_rows::grad_sums(pool_dz(pl, x), x, t.mean.f32()[c], HW, a, b);
#endif
    float* parked = park ? g.dx.f32() + o : nullptr;
    const float* dz = pool_stride1 ? pool_stride1_dz(pl, x, park ? parked : scratch + S * plane)
                                   : plane_dz(scratch, pl, x, true, parked);
    bn_rows::grad_sums(bn_rows::row_of(dz), x, t.mean.f32()[c], HW, a, b);
    if (park && dz != parked) std::memcpy(parked, dz, sizeof(float) * size_t(HW));
  };
  auto finish_channel = [&](int64_t c, double sdy, double sdyx) {
    return bn_rows::channel_gradients(sdy, sdyx, t.gamma, t.mean, t.invstd, c, N * HW, g.dgamma, g.dbeta,
                                      g.params_accumulate);
  };
  // Sweep 1 taken by the reader: the side gradient from the dz it parked in dy, before dx takes its
  // place, as sweep 1 writes it (elementwise_dz: dz, or the side gradient + dz).
  auto side_from_parked_dz = [&](int64_t pl) {
    if (!g.dside.defined()) return;
    const float* dz = g.dy.f32() + pl * HW;
    float* ds = g.dside.f32() + pl * HW;
    if (g.dside_accumulate)
      for (int64_t i = 0; i < HW; ++i) ds[i] += dz[i];
    else
      std::memcpy(ds, dz, sizeof(float) * size_t(HW));
  };
  // Sweep 2 on plane (n, c): dx = a * dz + b * x + c0.
  auto sweep2 = [&](float* scratch, int64_t pl, const bn_rows::GradCoefficients& k) {
    float* dx = g.dx.f32() + pl * HW;
    if (banded && !in_registers && !pool_in_registers) {
      for (int64_t a0 = 0; a0 < bn.H; a0 += s.band_rows) {
        const int64_t a1 = std::min(bn.H, a0 + s.band_rows), len = (a1 - a0) * bn.W;
        float* d = dx + a0 * bn.W;
        if (park) {
          bn_rows::grad_apply(d, x_rows(scratch, pl, a0, a1), k, len, d, false);
        } else {
          const BandRows band = backward_band(s, a0, a1);
          const float* x = x_rows(scratch, pl, band.b0, band.b1);
          const int64_t from = (a0 - band.b0) * bn.W;
          bn_rows::grad_apply(band_dz(scratch, pl, band, x, false) + from, x + from, k, len, d, g.dx_accumulate);
        }
      }
      return;
    }
    const float* x = x_plane(scratch, pl);
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
    if (in_registers && !park && !dz_in_dy)
      return bn_rows::grad_apply_d(
          elementwise_dz(ew, g, t, pl % C, pl * HW, x, recompute, false, false, global_pool_dy(scratch, pl)), x, k.a,
          k.b, k.c0, HW, dx, g.dx_accumulate);
#endif
#if defined(ET_POOL_IN_REGISTERS)
    if (pool_in_registers)
      return bn_rows::grad_apply_d(pool_dz(pl, x), x, k.a, k.b, k.c0, HW, dx, g.dx_accumulate, stream_dx);
#endif
    const float* dz = dz_in_dy       ? g.dy.f32() + pl * HW
                      : park         ? dx
                      : pool_stride1 ? pool_stride1_dz(pl, x, scratch + S * plane)
                                     : plane_dz(scratch, pl, x, false);
    if (dz_in_dy) side_from_parked_dz(pl);
    bn_rows::grad_apply(dz, x, k, HW, dx, g.dx_accumulate);
  };

  // The folded side BN (FusedStack::side_bn), plane pl: its dy is dz, parked in dx or rebuilt.
  // Sweep 1: its two sums, as the BN layer takes them; sweep 2: dx2 = a2 * dz + b2 * x2 + c02.
  ET_CHECK(!s.side_bn || (!dz_in_dy && !hand_on), "fused stack: a side BN with a sweep done elsewhere");
  auto side_sums = [&](float* scratch, int64_t pl) {
    const int64_t c = pl % C, o = pl * HW;
    const float *x2 = t.side.f32() + o, mu2 = t.side_mean.f32()[c];
    float *a = &side_tab.sum1[pl], *b = &side_tab.sum2[pl];
    if (park) return bn_rows::grad_sums(bn_rows::row_of(g.dx.f32() + o), x2, mu2, HW, a, b);
    const float* x = x_plane(scratch, pl);  // to rebuild dz
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
    if (in_registers)
      return bn_rows::grad_sums(elementwise_dz(ew, g, t, c, o, x, recompute, false, false), x2, mu2, HW, a, b);
#endif
    bn_rows::grad_sums(bn_rows::row_of(plane_dz(scratch, pl, x, false)), x2, mu2, HW, a, b);
  };
  auto side_sweep2 = [&](float* scratch, int64_t pl) {
    const int64_t o = pl * HW;
    const bn_rows::GradCoefficients& k = side_coef[pl % C];
    const float* x2 = t.side.f32() + o;
    float* dx2 = side_dx.f32() + o;
    if (park) return bn_rows::grad_apply(g.dx.f32() + o, x2, k, HW, dx2, side_dx_accumulate);  // before dx's apply
    const float* x = x_plane(scratch, pl);
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
    if (in_registers)
      return bn_rows::grad_apply_d(elementwise_dz(ew, g, t, pl % C, o, x, recompute, false, false), x2, k.a, k.b, k.c0,
                                   HW, dx2, side_dx_accumulate);
#endif
    bn_rows::grad_apply(plane_dz(scratch, pl, x, false), x2, k, HW, dx2, side_dx_accumulate);
  };

  cpu::StealingRanges sweep1_planes = plane_ranges(N * C, HW), sweep2_planes = plane_ranges(N * C, HW);
#pragma omp parallel
  {
    float* scratch = static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread;
    if (memory_order) {
      if (dz_in_dy) {  // the reader's sums, at its batch stride
        const float* sums = g.dz_sums.f32() + 1;
        const int64_t max_n = (g.dz_sums.numel() - 1) / (2 * C);
#pragma omp for schedule(static)
        for (int64_t pl = 0; pl < N * C; ++pl) tab.sum1[pl] = sums[pl], tab.sum2[pl] = sums[max_n * C + pl];
      } else {
        sweep1_planes.run([&](int64_t p0, int64_t p1) {
          for (int64_t pl = p0; pl < p1; ++pl) {
            sweep1(scratch, pl, &tab.sum1[pl], &tab.sum2[pl]);
            if (s.side_bn) side_sums(scratch, pl);
          }
        });
#pragma omp barrier
      }
      int64_t ca, cb;
      thread_channels(C, &ca, &cb);
      sum_over_batch(tab.sum1, tab.sum2, N, C, ca, cb, tab.d1, tab.d2);
      for (int64_t c = ca; c < cb; ++c) {
        coef[c] = finish_channel(c, tab.d1[c], tab.d2[c]);
        if (hand_on) hand_on_channel(c, coef[c]);
      }
      if (s.side_bn) {
        sum_over_batch(side_tab.sum1, side_tab.sum2, N, C, ca, cb, side_tab.d1, side_tab.d2);
        for (int64_t c = ca; c < cb; ++c)
          side_coef[c] = bn_rows::channel_gradients(side_tab.d1[c], side_tab.d2[c], t.side_gamma, t.side_mean,
                                                    t.side_invstd, c, N * HW, g.side_dgamma, g.side_dbeta,
                                                    g.side_params_accumulate);
      }
#pragma omp barrier
      if ((g.dx.defined() && !hand_on) || side_dx.defined()) {
        sweep2_planes.run([&](int64_t p0, int64_t p1) {
          for (int64_t pl = p0; pl < p1; ++pl) {
            if (side_dx.defined()) side_sweep2(scratch, pl);
            if (g.dx.defined() && !hand_on) sweep2(scratch, pl, coef[pl % C]);
          }
        });
      } else if (dz_in_dy && g.dside.defined()) {
        sweep2_planes.run([&](int64_t p0, int64_t p1) {
          for (int64_t pl = p0; pl < p1; ++pl) side_from_parked_dz(pl);
        });
      }
    } else {
#pragma omp for schedule(static, s.tile_channels)
      for (int64_t c = 0; c < C; ++c) {
        double sdy = 0, sdyx = 0;
        for (int64_t n = 0; n < N; ++n) {
          const int64_t o = (n * C + c) * HW;
          if (n + 1 < N) {  // the next plane's pages (see prefetch_plane)
            if (t.x.dtype == DType::F32) prefetch_plane(t.x.f32() + o + C * HW, HW);
            prefetch_plane(g.dy.f32() + ((n + 1) * C + c) * PQ, PQ);
            if (read_y_mask && !g.y_mask.bits) prefetch_plane(g.y_mask.dense.f32() + ((n + 1) * C + c) * PQ, PQ);
            if (park) prefetch_plane_for_write(g.dx.f32() + o + C * HW, HW);
          }
          float a, b;
          sweep1(scratch, n * C + c, &a, &b);
          sdy += a;
          sdyx += b;
        }
        const bn_rows::GradCoefficients k = finish_channel(c, sdy, sdyx);
        if (hand_on) hand_on_channel(c, k);
        if (!g.dx.defined() || hand_on) continue;
        for (int64_t n = 0; n < N; ++n) sweep2(scratch, n * C + c, k);  // the slab still in this core's L2
      }
    }
#if defined(__AVX512F__)
    if (stream_dx || stream_park) _mm_sfence();  // this thread's streaming stores, before dx's readers
#elif defined(ET_LANES16)
    if (stream_dx || stream_park) lanes16::stream_fence();
#endif
  }
}

}  // namespace et
