// BN-headed fused stacks on small planes (H * W <= kSmallPlane, engine/fused_stack.h): VGG's 4x4
// and 2x2 stages, the 4x4 stages of the ResNets and MobileNetV2. A plane there is 16 floats or
// fewer, less work than visiting it costs (a call per stage, a reduction tree, a prefetch), and
// going plane by plane made these stacks 1.5-2x slower than the unfused layers. So the work goes by
// channel blocks: the tile's channels of one image, [T, H, W], contiguous in memory. Every stage
// runs on a whole block (BN's block functions, flat element-wise loops, a pool over the block as
// one tall plane where no window crosses two planes, a global pool plane by plane: the plane
// function the layer takes), and the batch is walked image by image.
//
// Bit-identity with the unfused layers holds by construction: the BN layer takes the same block
// functions on small planes (batchnorm.cpp), whose per-channel results do not depend on the block
// size, and the pools are the plane functions on windows that are the same windows.
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
#include "backends/cpu/pool_planes.h"
#include "memory/bitmap.h"

namespace et {

namespace {

using namespace fused_planes;

// One block through the first `stages` stages: out[k] receives stage k's output over L planes from
// plane b0 (a dropout stage draws from `seed` there, where `training`).
void forward_block(const FusedStack& s, size_t stages, int64_t L, const float* x, const float* side,
                   const float* scale, const float* shift, float* const* out, int64_t b0, uint64_t seed,
                   bool training) {
  const FusedStage& bn = s.stages[0];
  const int64_t len = L * bn.H * bn.W;
  size_t k = 1;
#if defined(__AVX512F__)
  // The element-wise stages after the BN in registers, as the layers compute them (the same FMA
  // as block_apply, relu_forward's rule, one add): a stage reading the block the previous stage
  // has just stored stalls on store forwarding (measured 1.4x the unfused pass).
  size_t e = 1;
  while (e < stages && (s.stages[e].kind == FusedKind::Relu || s.stages[e].kind == FusedKind::Add)) ++e;
  if (e > 1) {
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 m = len - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - i)) - 1);
      __m512 v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, scale + i),
                                 _mm512_maskz_loadu_ps(m, shift + i));
      for (size_t j = 0;; ++j) {
        if (j + 1 == e || out[j] != out[e - 1]) _mm512_mask_storeu_ps(out[j] + i, m, v);
        if (j + 1 == e) break;
        if (s.stages[j + 1].kind == FusedKind::Relu)
          v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ), v);  // NaN -> 0, -0 -> +0
        else
          v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, side + i));
      }
    }
    k = e;
  } else
#elif defined(ET_LANES16)
  // The same on AVX2 / NEON (lanes16.h): relu16 is relu_forward's rule too.
  size_t e = 1;
  while (e < stages && (s.stages[e].kind == FusedKind::Relu || s.stages[e].kind == FusedKind::Add)) ++e;
  if (e > 1) {
    using namespace lanes16;
    auto vector = [&](int64_t i, const auto& m) {
      Lanes16 v = fmadd16(load16(m, x + i), load16(m, scale + i), load16(m, shift + i));
      for (size_t j = 0;; ++j) {
        if (j + 1 == e || out[j] != out[e - 1]) store16(m, out[j] + i, v);
        if (j + 1 == e) break;
        v = s.stages[j + 1].kind == FusedKind::Relu ? relu16(v) : add16(v, load16(m, side + i));
      }
    };
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) vector(i, Full{});
    if (i < len) vector(i, lanes_first(len - i));
    k = e;
  } else
#endif
  {
    bn_rows::block_apply(x, scale, shift, len, out[0]);
  }
  for (; k < stages; ++k) {
    const FusedStage& st = s.stages[k];
    stage_forward(st, L, out[k - 1], side, out[k], DropoutDraw{seed, b0 * st.H * st.W, training});
  }
}

// The thread's scratch (block_thread_floats): a block per stage output, two gradient blocks, x's
// block widened from a 16-bit stash.
struct BlockScratch {
  float* out[kMaxStages];
  float *ga, *gb, *x;
  BlockScratch(const FusedStack& s, float* p) {
    const int64_t T = s.tile_channels, S = int64_t(s.stages.size()), plane = plane_floats(s);
    for (int64_t k = 0; k < S; ++k) out[k] = p + k * T * plane;
    ga = p + S * T * plane;
    gb = ga + T * plane;
    x = gb + T * plane;
  }
};

// The shared tables after the threads' scratch (table_floats): per plane two sums, per channel its
// coefficients expanded per element [C, HW], so a block of any channels reads them as one run.
// Item i of the memory-order walk: block i % blocks of image i / blocks, L channels from c0, its
// first plane b0.
struct BlockAt {
  int64_t c0, L, b0;
  BlockAt(int64_t i, int64_t blocks, int64_t T, int64_t C)
      : c0(i % blocks * T), L(std::min(T, C - c0)), b0(i / blocks * C + c0) {}
};

struct BlockTables : SumTables {
  float* e[kBlockExpanded];
  BlockTables(const FusedStack& s, int64_t N, float* p) : SumTables(p, N, s.C) {
    const int64_t CHW = round16(s.C * s.stages[0].H * s.stages[0].W);
    for (int k = 0; k < kBlockExpanded; ++k) e[k] = rest + k * CHW;
  }
};

void fill_channel(float* expanded, int64_t c, int64_t HW, float v) {
  std::fill(expanded + c * HW, expanded + (c + 1) * HW, v);
}

#if defined(__AVX512F__) || defined(ET_LANES16)
// Blocks of stacks whose stages after the BN are element-wise: BN + ReLU (its mask recomputed from
// x), BN + add + ReLU (y's saved mask), BN + add. dz = dy where the mask passes, else +0
// (relu_backward's rule), built 16 elements at a time into `dz` in one pass, with the side
// gradient written on the way, instead of the stages' planes in scratch. false: not such a stack
// (or a bit mask whose words do not start on 16-element boundaries); the caller goes the long way.
bool block_dz_registers(const FusedStack& s, const FusedTensors& t, FusedGrads& g, bool recompute, int64_t b0,
                        int64_t len, const float* x, const float* scale, const float* shift, float* dz) {
  const size_t S = s.stages.size();
  const bool relu = S == 2 && s.stages[1].kind == FusedKind::Relu;
  const bool add_relu = S == 3 && s.stages[1].kind == FusedKind::Add && s.stages[2].kind == FusedKind::Relu;
  const bool add = S == 2 && s.stages[1].kind == FusedKind::Add;
  if (!relu && !add_relu && !add) return false;
  if (relu && !recompute && !g.y_mask.bits && !g.y_mask.dense.defined()) return false;
  const int64_t HW = s.stages[0].H * s.stages[0].W, o = b0 * HW;
  const uint64_t* bits = (add_relu || (relu && !recompute)) ? g.y_mask.bits : nullptr;
  if (bits && (o % 16 != 0)) return false;
  const float* ym = (add_relu || (relu && !recompute)) && !bits ? g.y_mask.dense.f32() + o : nullptr;
  const float* dy = g.dy.f32() + o;
  float* dside = g.dside.defined() ? g.dside.f32() + o : nullptr;
#if defined(__AVX512F__)
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 16) {
    const __mmask16 m = len - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - i)) - 1);
    __mmask16 on = m;
    if (relu && recompute) {  // the forward's own arithmetic (forward_block): one FMA, then > 0
      const __m512 z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, scale + i),
                                       _mm512_maskz_loadu_ps(m, shift + i));
      on = _mm512_mask_cmp_ps_mask(m, z, zero, _CMP_GT_OQ);
    }
    else if (bits)
      on = __mmask16(m & (bits[(o + i) >> 6] >> ((o + i) & 63)));
    else if (ym)
      on = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, ym + i), zero, _CMP_GT_OQ);
    const __m512 d = _mm512_maskz_loadu_ps(on, dy + i);
    if (dside) {
      const __m512 v = g.dside_accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, dside + i), d) : d;
      _mm512_mask_storeu_ps(dside + i, m, v);
    }
    _mm512_mask_storeu_ps(dz + i, m, d);
  }
#else  // ET_LANES16: the same selections as bit masks of lanes (lanes16.h)
  using namespace lanes16;
  auto vector = [&](int64_t i, const auto& m) {
    Lanes16 on = on16(m);
    if (relu && recompute) {  // the forward's own arithmetic (forward_block): one FMA, then > 0
      on = and16(on, gt_zero16(fmadd16(load16(m, x + i), load16(m, scale + i), load16(m, shift + i))));
    } else if (bits) {
      on = and16(on, lanes_of_bits(uint32_t(bits[(o + i) >> 6] >> ((o + i) & 63))));
    } else if (ym) {
      on = and16(on, gt_zero16(load16(m, ym + i)));
    }
    const Lanes16 d = and16(load16(m, dy + i), on);  // dy where on, else +0
    if (dside) store16(m, dside + i, g.dside_accumulate ? add16(load16(m, dside + i), d) : d);
    store16(m, dz + i, d);
  };
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) vector(i, Full{});
  if (i < len) vector(i, lanes_first(len - i));
#endif
  return true;
}
#endif

}  // namespace

// Both sweeps go in memory order: block after block of each image, image after image, each thread
// a contiguous range of the tensors (as fused.cpp's planes). Per-plane sums go to an [N, C] table
// and add per channel in double over n in order, the BN layer's order.
void CpuBackend::fused_blocks_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask,
                                      Workspace ws) {
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t N = t.x.dim(0), C = s.C, HW = bn.H * bn.W, PQ = last.P * last.Q, S = int64_t(s.stages.size());
  const int64_t T = s.tile_channels, blocks = (C + T - 1) / T;
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  ET_CHECK(S <= kMaxStages, "fused stack of ", S, " stages");
  const float* xp = t.x.f32();
  float* yp = t.y.f32();
  const bool want_mask = training && mask && mask->bits && output_nonnegative(s);
  // Every block of y covers whole 64-bit words of the bitmap, or one pass over y writes it after.
  const bool plane_words = (T * PQ) % 64 == 0 && (C * PQ) % 64 == 0;
  const uint32_t tb = want_mask ? bitmap::keep_threshold_bits(mask->prune_threshold) : 0;
  const int add = s.add_stage();
  const int64_t side_plane = add >= 0 ? s.stages[size_t(add)].H * s.stages[size_t(add)].W : 0;
  const int64_t per_thread = block_thread_floats(s);
  const BlockTables tab(s, N, static_cast<float*>(ws.data) + per_thread * cpu_threads());
  float *scale = tab.e[0], *shift = tab.e[1];
  bool has_pool = false;
  for (const FusedStage& st : s.stages)
    has_pool |= st.kind == FusedKind::MaxPool || st.kind == FusedKind::AvgPool || st.kind == FusedKind::GlobalAvgPool;
  int64_t kept = 0;
#if defined(ET_POOL_IN_REGISTERS)
  // BN -> ReLU -> 2x2 max-pool: x to y in registers (fused_bn_relu_pool.h).
  const bool pool_in_registers = fused_bn_relu_pool::applies_to_blocks(s, T);
  const fused_bn_relu_pool::Layout pool_layout(pool_in_registers ? last.Q : 4);
#endif
#pragma omp parallel reduction(+ : kept)
  {
    BlockScratch sc(s, static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread);
    float* out[kMaxStages];
    std::copy(sc.out, sc.out + S, out);
    if (training) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N * blocks; ++i) {
        const BlockAt b(i, blocks, T, C);
        bn_rows::block_sums(xp + b.b0 * HW, b.L, HW, tab.sum1 + b.b0, tab.sum2 + b.b0);
      }
    }
    int64_t ca, cb;
    thread_channels(C, &ca, &cb);
    if (training) sum_over_batch(tab.sum1, tab.sum2, N, C, ca, cb, tab.d1, tab.d2);
    for (int64_t c = ca; c < cb; ++c) {
      float sc1, sc2;
      if (training) {
        bn_rows::finish_statistics(tab.d1[c], tab.d2[c], N * HW, c, bn.momentum, bn.eps, t.running_mean,
                                   t.running_var, t.mean, t.invstd);
        bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &sc1, &sc2);
      } else {
        bn_rows::eval_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.running_mean.f32()[c], t.running_var.f32()[c],
                                   bn.eps, &sc1, &sc2);
      }
      fill_channel(scale, c, HW, sc1);
      fill_channel(shift, c, HW, sc2);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N * blocks; ++i) {
      const BlockAt blk(i, blocks, T, C);
      const int64_t c0 = blk.c0, L = blk.L, b0 = blk.b0;
      out[S - 1] = yp + b0 * PQ;  // the last stage writes y
      // Without a pool every stage is element-wise and runs in place in y's block: a block in
      // the scratch would sit at an arbitrary distance from x's modulo 4 KiB, and loads of x
      // falsely waiting on stores to the scratch (4K aliasing) made the pass 1.4x slower.
      if (!has_pool)
        for (int64_t k = 0; k < S; ++k) out[k] = out[S - 1];
#if defined(ET_POOL_IN_REGISTERS)
      if (pool_in_registers)
        fused_bn_relu_pool::forward(pool_layout, xp + b0 * HW, fused_bn_relu_pool::ElementBn{scale + c0 * HW, shift + c0 * HW},
                                    L * HW, out[S - 1], false);
      else
#endif
        forward_block(s, size_t(S), L, xp + b0 * HW, add >= 0 ? t.side.f32() + b0 * side_plane : nullptr,
                      scale + c0 * HW, shift + c0 * HW, out, b0, t.seed, training);
      if (want_mask && plane_words) kept += mask_words(yp, b0 * PQ / 64, (b0 + L) * PQ / 64, tb, mask->bits);
    }
  }
  if (want_mask) finish_output_mask(t.y, mask, plane_words, kept);
}

void CpuBackend::fused_blocks_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws) {
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t N = t.x.dim(0), C = s.C, HW = bn.H * bn.W, PQ = last.P * last.Q, S = int64_t(s.stages.size());
  const int64_t T = s.tile_channels, blocks = (C + T - 1) / T;
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  const int add = s.add_stage();
  const int64_t side_plane = add >= 0 ? s.stages[size_t(add)].H * s.stages[size_t(add)].W : 0;
  const bool recompute = needs_recompute(s, g.x_exact);
  const bool read_y_mask = s.saves_output_mask && !(recompute && add < 0);
  const int64_t per_thread = block_thread_floats(s);
  const BlockTables tab(s, N, static_cast<float*>(ws.data) + per_thread * cpu_threads());
  // Per element of a channel: the mean, BN's scale and shift (to recompute), dx's a, b, c0.
  float *mu = tab.e[0], *scale = tab.e[1], *shift = tab.e[2], *ka = tab.e[3], *kb = tab.e[4], *kc = tab.e[5];
  // dz parks in dx between the sweeps unless dx accumulates (then sweep 2 rebuilds it).
  const bool park = g.dx.defined() && !g.dx_accumulate;
  // A last pool's output is not needed again, only its input.
  const bool last_pool = last.kind == FusedKind::MaxPool || last.kind == FusedKind::AvgPool || s.ends_in_global_pool();

#if defined(ET_POOL_IN_REGISTERS)
  // BN -> ReLU -> 2x2 max-pool: dz in registers from x and dy (fused_bn_relu_pool.h).
  const bool pool_in_registers = fused_bn_relu_pool::applies_to_blocks(s, T);
  const fused_bn_relu_pool::Layout pool_layout(pool_in_registers ? last.Q : 4);
#endif

  // dz (the gradient of the BN output) of the block of L planes from plane b0 (channel c0) on. The
  // first sweep also writes the side input's gradient, which the Add stage hands on unchanged.
  auto block_dz = [&](BlockScratch& sc, int64_t b0, int64_t c0, int64_t L, const float* x,
                      bool first_sweep) -> const float* {
#if defined(ET_POOL_IN_REGISTERS)
    if (pool_in_registers) {
      fused_bn_relu_pool::backward_dz(pool_layout, x, fused_bn_relu_pool::ElementBn{scale + c0 * HW, shift + c0 * HW},
                                      g.dy.f32() + b0 * PQ, L * HW, sc.ga);
      return sc.ga;
    }
#endif
    if (recompute)
      forward_block(s, size_t(S) - (last_pool ? 1 : 0), L, x, add >= 0 ? t.side.f32() + b0 * side_plane : nullptr,
                    scale + c0 * HW, shift + c0 * HW, sc.out, b0, t.seed, true);
    return stages_backward(s, whole_planes(s, b0, L, t.seed), g, sc.out, g.dy.f32() + b0 * PQ, sc.ga, sc.gb,
                           first_sweep, read_y_mask);
  };

#pragma omp parallel
  {
    BlockScratch sc(s, static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      fill_channel(mu, c, HW, t.mean.f32()[c]);
      if (!recompute) continue;
      float sc1, sc2;
      bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &sc1, &sc2);
      fill_channel(scale, c, HW, sc1);
      fill_channel(shift, c, HW, sc2);
    }
    // Sweep 1: per-plane sums in float into the table.
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N * blocks; ++i) {
      const BlockAt blk(i, blocks, T, C);
      const int64_t c0 = blk.c0, L = blk.L, b0 = blk.b0;
      const float* x = bn_rows::x_f32(t.x, b0 * HW, L * HW, sc.x);
#if defined(ET_POOL_IN_REGISTERS)
      // BN -> ReLU -> 2x2 max-pool, or (AVX-512) element-wise stages: dz in one pass in registers,
      // straight into its parking place.
      float* fast = park ? g.dx.f32() + b0 * HW : sc.ga;
      if (pool_in_registers) {
        fused_bn_relu_pool::backward_dz(pool_layout, x, fused_bn_relu_pool::ElementBn{scale + c0 * HW, shift + c0 * HW},
                                        g.dy.f32() + b0 * PQ, L * HW, fast);
        bn_rows::block_grad_sums(fast, x, mu + c0 * HW, L, HW, tab.sum1 + b0, tab.sum2 + b0);
        continue;
      }
#endif
#if defined(__AVX512F__) || defined(ET_LANES16)
      if (block_dz_registers(s, t, g, recompute, b0, L * HW, x, scale + c0 * HW, shift + c0 * HW, fast)) {
        bn_rows::block_grad_sums(fast, x, mu + c0 * HW, L, HW, tab.sum1 + b0, tab.sum2 + b0);
        continue;
      }
#endif
      const float* dz = block_dz(sc, b0, c0, L, x, true);
      bn_rows::block_grad_sums(dz, x, mu + c0 * HW, L, HW, tab.sum1 + b0, tab.sum2 + b0);
      if (park) std::memcpy(g.dx.f32() + b0 * HW, dz, sizeof(float) * size_t(L * HW));
    }
    // Per channel: the sums over n in order in double (the BN layer's order), the coefficients.
    int64_t ca, cb;
    thread_channels(C, &ca, &cb);
    sum_over_batch(tab.sum1, tab.sum2, N, C, ca, cb, tab.d1, tab.d2);
    for (int64_t c = ca; c < cb; ++c) {
      const bn_rows::GradCoefficients k = bn_rows::channel_gradients(tab.d1[c], tab.d2[c], t.gamma, t.mean, t.invstd, c,
                                                                     N * HW, g.dgamma, g.dbeta, g.params_accumulate);
      fill_channel(ka, c, HW, k.a);
      fill_channel(kb, c, HW, k.b);
      fill_channel(kc, c, HW, k.c0);
    }
#pragma omp barrier
    // Sweep 2: dx = a * dz + b * x + c0.
    if (g.dx.defined()) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N * blocks; ++i) {
        const BlockAt blk(i, blocks, T, C);
      const int64_t c0 = blk.c0, L = blk.L, b0 = blk.b0;
        float* dx = g.dx.f32() + b0 * HW;
        const float* x = bn_rows::x_f32(t.x, b0 * HW, L * HW, sc.x);
        bn_rows::block_grad_apply(park ? dx : block_dz(sc, b0, c0, L, x, false), x, ka + c0 * HW, kb + c0 * HW,
                                  kc + c0 * HW, L * HW, dx, g.dx_accumulate);
      }
    }
  }
}

}  // namespace et
