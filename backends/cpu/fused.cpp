// Fused stacks on CPU (engine/fused_stack.h, docs/fusion.md). The work goes channel by channel
// (threads over channels): BN's statistics and its two backward reductions are per channel over
// the whole batch, so a channel's slab of x (N planes, 512 KiB at CIFAR's first stage and batch
// 128) is read from memory once and found again in this core's L2 by the pass that follows.
// Inside the slab each plane runs through every stage in a thread's scratch (one plane per stage
// and two gradient planes), so the values between stages never reach memory. Every stage calls
// the row / plane functions the layer kernels call (bn_rows, pool_planes, the same element-wise
// expressions) and the reductions keep their order (per plane in float, planes in double, n in
// order), so the results equal the unfused layers' bit for bit.
//
// Forward (training): statistics of the channel's slab, then its planes x (+ side) -> y, with
// y's bitmap words. Backward: sweep 1 rebuilds dz (the gradient of BN's output) plane by plane,
// from the saved y mask or a recompute from x, writes the side gradient, reduces dgamma / dbeta
// and parks dz in dx; sweep 2 turns dz into dx in place while the slab is still in L2.
#include <omp.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/fused_common.h"
#include "backends/cpu/pool_planes.h"
#include "memory/bitmap.h"

namespace et {

namespace {

using namespace fused_planes;

// One channel plane through the first `stages` stages: out[k] receives stage k's output (out[last]
// may be y).
void forward_plane(const FusedStack& s, size_t stages, const float* x, const float* side, float scale, float shift,
                   float* const* out) {
  const FusedStage& bn = s.stages[0];
  bn_rows::apply(x, scale, shift, bn.H * bn.W, out[0]);
  for (size_t k = 1; k < stages; ++k) stage_forward(s.stages[k], 1, out[k - 1], side, out[k]);
}

// Stacks whose stages after the BN are element-wise (ResNet's two kinds, MobileNetV2's): the first
// backward sweep builds dz element by element in registers instead of plane by plane in scratch.
enum class ElementwiseOnly { No, Relu, AddRelu, Add };

ElementwiseOnly elementwise_only(const FusedStack& s, const FusedGrads& g, bool recompute) {
  const int64_t PQ = s.last().P * s.last().Q;
  ElementwiseOnly e = ElementwiseOnly::No;
  if (s.stages.size() == 2 && s.stages[1].kind == FusedKind::Relu) e = ElementwiseOnly::Relu;
  if (s.stages.size() == 2 && s.stages[1].kind == FusedKind::Add) e = ElementwiseOnly::Add;
  if (s.stages.size() == 3 && s.stages[1].kind == FusedKind::Add && s.stages[2].kind == FusedKind::Relu)
    e = ElementwiseOnly::AddRelu;
  // A mask read as bits goes 16 bits at a time: planes must start on 16-element boundaries.
  const bool reads_mask = e == ElementwiseOnly::AddRelu || (e == ElementwiseOnly::Relu && !recompute);
  if (reads_mask && g.y_mask.bits && PQ % 16 != 0) return ElementwiseOnly::No;
  return e;
}

#if defined(__AVX512F__)
// d(i, m) for grad_sums: plane (n, c)'s dz, 16 elements at a time, with the side gradient and the
// parked dz written on the way (relu_backward's rule: masked-out lanes are +0).
inline auto elementwise_dz(ElementwiseOnly e, FusedGrads& g, const FusedTensors& t, int64_t c, int64_t o,
                           bool recompute) {
  const float* dy = g.dy.f32() + o;
  const float* x = t.x.f32() + o;
  float* park = g.dx.defined() && !g.dx_accumulate ? g.dx.f32() + o : nullptr;
  float* dside = g.dside.defined() ? g.dside.f32() + o : nullptr;
  const bool side_acc = g.dside_accumulate;
  const float* ym = g.y_mask.bits ? nullptr : (g.y_mask.dense.defined() ? g.y_mask.dense.f32() + o : nullptr);
  const uint64_t* bits = g.y_mask.bits;
  float scale = 0, shift = 0;
  bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &scale, &shift);
  const __m512 vscale = _mm512_set1_ps(scale), vshift = _mm512_set1_ps(shift), zero = _mm512_setzero_ps();
  return [=](int64_t i, __mmask16 m) {
    __mmask16 on = m;
    if (e == ElementwiseOnly::Relu && recompute) {  // relu(bn(x)) > 0, the forward's own arithmetic
      const __m512 z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), vscale, vshift);
      on = _mm512_mask_cmp_ps_mask(m, z, zero, _CMP_GT_OQ);
    } else if (e != ElementwiseOnly::Add) {  // y's saved mask
      on = bits ? __mmask16(m & (bits[(o + i) >> 6] >> ((o + i) & 63)))
                : _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, ym + i), zero, _CMP_GT_OQ);
    }
    const __m512 d = _mm512_maskz_loadu_ps(on, dy + i);
    if (dside) {
      const __m512 v = side_acc ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, dside + i), d) : d;
      _mm512_mask_storeu_ps(dside + i, m, v);
    }
    if (park) _mm512_mask_storeu_ps(park + i, m, d);
    return d;
  };
}
#endif

}  // namespace

size_t CpuBackend::fused_workspace_bytes(const FusedStack& s, int64_t batch) const {
  (void)batch;
  return sizeof(float) * size_t((s.small_planes() ? block_thread_floats(s) : thread_floats(s)) * cpu_threads());
}

// The stack output's bitmap: counted where the planes wrote whole words, else one pass over y.
void CpuBackend::finish_output_mask(Tensor y, MaskOut* mask, bool plane_words, int64_t kept) {
  if (plane_words)
    mask->kept = kept;
  else
    relu_forward(y, y, mask);  // y >= +0: an identity that writes the bitmap
}

void CpuBackend::fused_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws) {
  if (!s.headed_by_bn()) return relu_pool_forward(s, t, training, mask, ws);
  if (s.small_planes()) return fused_blocks_forward(s, t, training, mask, ws);
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t N = t.x.dim(0), C = s.C, HW = bn.H * bn.W, PQ = last.P * last.Q, S = int64_t(s.stages.size());
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  ET_CHECK(S <= kMaxStages, "fused stack of ", S, " stages");
  const float* xp = t.x.f32();
  float* yp = t.y.f32();
  // The bitmap is written plane by plane when planes cover whole 64-bit words, else in a pass over y.
  const bool want_mask = training && mask && mask->bits && output_nonnegative(s);
  const bool plane_words = PQ % 64 == 0;
  const uint32_t tb = want_mask ? bitmap::keep_threshold_bits(mask->prune_threshold) : 0;
  const int add = s.add_stage();
  const int64_t side_plane = add >= 0 ? s.stages[size_t(add)].H * s.stages[size_t(add)].W : 0;
  const int64_t per_thread = thread_floats(s), plane = max_plane(s);
  int64_t kept = 0;
#pragma omp parallel reduction(+ : kept)
  {
    float* scratch = static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread;
    float* out[kMaxStages];
    for (int64_t k = 0; k < S; ++k) out[k] = scratch + k * plane;
#pragma omp for schedule(static, s.tile_channels)
    for (int64_t c = 0; c < C; ++c) {
      float scale, shift;
      if (training) {
        bn_rows::channel_statistics(xp, N, C, HW, c, bn.momentum, bn.eps, t.running_mean, t.running_var, t.mean,
                                    t.invstd);
        bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &scale,
                                    &shift);
      } else {
        bn_rows::eval_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.running_mean.f32()[c],
                                   t.running_var.f32()[c], bn.eps, &scale, &shift);
      }
      for (int64_t n = 0; n < N; ++n) {
        const int64_t pl = n * C + c;
        if (n + 1 < N) {  // x's next plane is in L2 already (the statistics read it)
          prefetch_plane_for_write(yp + (pl + C) * PQ, PQ);
          if (add >= 0) prefetch_plane(t.side.f32() + (pl + C) * side_plane, side_plane);
        }
        out[S - 1] = yp + pl * PQ;  // the last stage writes y
        forward_plane(s, s.stages.size(), xp + pl * HW, add >= 0 ? t.side.f32() + pl * side_plane : nullptr, scale,
                      shift, out);
        if (want_mask && plane_words) kept += mask_words(yp, pl * PQ / 64, (pl + 1) * PQ / 64, tb, mask->bits);
      }
    }
  }
  if (want_mask) finish_output_mask(t.y, mask, plane_words, kept);
}

void CpuBackend::fused_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws) {
  if (!s.headed_by_bn()) return relu_pool_backward(s, t, g, ws);
  if (s.small_planes()) return fused_blocks_backward(s, t, g, ws);
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t N = t.x.dim(0), C = s.C, HW = bn.H * bn.W, PQ = last.P * last.Q, S = int64_t(s.stages.size());
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  ET_CHECK(t.x.dtype == DType::F32, "fused stack backward reads x as f32");
  const float* xp = t.x.f32();
  const int add = s.add_stage();
  const int64_t side_plane = add >= 0 ? s.stages[size_t(add)].H * s.stages[size_t(add)].W : 0;
  const bool recompute = needs_recompute(s, g.x_exact);
  const bool read_y_mask = s.saves_output_mask && !(recompute && add < 0);
  const int64_t per_thread = thread_floats(s), plane = max_plane(s);
  // dz parks in dx between the sweeps unless dx accumulates (then sweep 2 rebuilds it).
  const bool park = g.dx.defined() && !g.dx_accumulate;
  [[maybe_unused]] const ElementwiseOnly ew = elementwise_only(s, g, recompute);  // AVX-512 only

  // dz (the gradient of the BN output) of plane (n, c), in the thread's scratch. The first sweep
  // also writes the side input's gradient, which the Add stage hands on unchanged.
  auto plane_dz = [&](float* scratch, int64_t n, int64_t c, bool first_sweep) -> const float* {
    float* out[kMaxStages];
    for (int64_t k = 0; k < S; ++k) out[k] = scratch + k * plane;
    float* ga = scratch + S * plane;
    float* gb = ga + plane;
    const int64_t in_plane = n * C + c;
    if (recompute) {
      float scale, shift;
      bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &scale,
                                  &shift);
      // A last pool's output is not needed, only its input.
      const bool last_pool = s.last().kind == FusedKind::MaxPool || s.last().kind == FusedKind::AvgPool;
      forward_plane(s, s.stages.size() - (last_pool ? 1 : 0), xp + in_plane * HW,
                    add >= 0 ? t.side.f32() + in_plane * side_plane : nullptr, scale, shift, out);
    }
    std::memcpy(ga, g.dy.f32() + in_plane * PQ, sizeof(float) * size_t(PQ));
    return stages_backward(s, g, out, ga, gb, in_plane, 1, first_sweep, read_y_mask);
  };

#pragma omp parallel
  {
    float* scratch = static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static, s.tile_channels)
    for (int64_t c = 0; c < C; ++c) {
      // Sweep 1: per-plane reductions in float, over n in order in double (BN's own order).
      const float mu = t.mean.f32()[c];
      double sdy = 0, sdyx = 0;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t o = (n * C + c) * HW;
        if (n + 1 < N) {
          prefetch_plane(xp + o + C * HW, HW);
          prefetch_plane(g.dy.f32() + ((n + 1) * C + c) * PQ, PQ);
          if (read_y_mask && !g.y_mask.bits) prefetch_plane(g.y_mask.dense.f32() + ((n + 1) * C + c) * PQ, PQ);
          if (park) prefetch_plane_for_write(g.dx.f32() + o + C * HW, HW);
        }
        float a, b;
#if defined(__AVX512F__)
        if (ew != ElementwiseOnly::No) {
          // One pass: dz from dy and the mask (recomputed from x or read), side gradient, sums.
          bn_rows::grad_sums(elementwise_dz(ew, g, t, c, o, recompute), xp + o, mu, HW, &a, &b);
        } else
#endif
        {
          const float* dz = plane_dz(scratch, n, c, true);
          bn_rows::grad_sums(bn_rows::row_of(dz), xp + o, mu, HW, &a, &b);
          if (park) std::memcpy(g.dx.f32() + o, dz, sizeof(float) * size_t(HW));
        }
        sdy += a;
        sdyx += b;
      }
      const bn_rows::GradCoefficients k =
          bn_rows::grad_coefficients(sdy, sdyx, t.gamma.f32()[c], mu, t.invstd.f32()[c], N * HW);
      if (g.dbeta.defined()) g.dbeta.f32()[c] = g.params_accumulate ? g.dbeta.f32()[c] + k.dbeta : k.dbeta;
      if (g.dgamma.defined()) g.dgamma.f32()[c] = g.params_accumulate ? g.dgamma.f32()[c] + k.dgamma : k.dgamma;
      if (!g.dx.defined()) continue;
      // Sweep 2: dx = a * dz + b * x + c0, the channel's slab still in this core's cache.
      for (int64_t n = 0; n < N; ++n) {
        const int64_t o = (n * C + c) * HW;
        float* dx = g.dx.f32() + o;
        bn_rows::grad_apply(park ? dx : plane_dz(scratch, n, c, false), xp + o, k, HW, dx, g.dx_accumulate);
      }
    }
  }
}

}  // namespace et
