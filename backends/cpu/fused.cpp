// Fused stacks on CPU (engine/fused_stack.h, docs/fusion.md). A tile is `tile_channels` whole
// planes of one image; tiles spread over threads, and inside a tile each channel's plane runs
// through every stage in a thread's scratch (a few KiB per plane at CIFAR sizes: L1 / L2), so only
// x, the side input and y touch memory. Every stage calls the row / plane functions the layer
// kernels call (bn_rows, pool_planes, the same element-wise expressions), and the BN reductions
// keep their order (per plane in float, planes in double, n in order), so the results equal the
// unfused layers' bit for bit.
//
// Forward (training): BN statistics over x (one read), then one tiled pass x (+ side) -> y with
// the stash's bitmap of y. Backward: two tiled sweeps, each recomputing from x what the stages'
// backward needs (ReLU masks, pool inputs); the first reduces dgamma / dbeta (and writes the side
// gradient), the second writes dx.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/pool_planes.h"
#include "memory/bitmap.h"

namespace et {

namespace {

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // 64-byte multiples of floats

int64_t max_plane(const FusedStack& s) {
  int64_t m = 0;
  for (const FusedStage& st : s.stages) m = std::max({m, st.H * st.W, st.P * st.Q});
  return round16(m);
}

// Per thread: one plane per stage output and two gradient planes.
int64_t thread_floats(const FusedStack& s) { return max_plane(s) * int64_t(s.stages.size() + 2); }

struct Tiles {
  int64_t blocks, count;  // channel blocks per image, tiles in all
  Tiles(const FusedStack& s, int64_t N) : blocks((s.C + s.tile_channels - 1) / s.tile_channels), count(N * blocks) {}
};

// One channel plane through the stages: out[k] receives stage k's output (out[last] may be y).
void forward_plane(const FusedStack& s, const float* x, const float* side, float scale, float shift, float* const* out) {
  const FusedStage& bn = s.stages[0];
  bn_rows::apply(x, scale, shift, bn.H * bn.W, out[0]);
  for (size_t k = 1; k < s.stages.size(); ++k) {
    const FusedStage& st = s.stages[k];
    const float* in = out[k - 1];
    float* o = out[k];
    const int64_t n = st.H * st.W;
    switch (st.kind) {
      case FusedKind::Relu:
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = in[i] > 0.f ? in[i] : 0.f;  // relu_forward's rule (NaN -> 0)
        break;
      case FusedKind::Add:
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = in[i] + side[i];
        break;
      case FusedKind::MaxPool: pool_planes::max_forward(pool_planes::of(st), in, o); break;
      case FusedKind::AvgPool: pool_planes::avg_forward(pool_planes::of(st), in, o); break;
      default: ET_CHECK(false, "fused stage kind ", int(st.kind));
    }
  }
}

bool needs_recompute(const FusedStack& s) {
  for (size_t k = 1; k < s.stages.size(); ++k) {
    const FusedKind kind = s.stages[k].kind;
    if (kind == FusedKind::MaxPool) return true;
    if (kind == FusedKind::Relu && !(k + 1 == s.stages.size() && s.saves_output_mask)) return true;
  }
  return false;
}

// y's bitmap words [w0, w1) with the stash's keep rule (y >= +0 by construction here, so it is one
// unsigned compare, as in relu_forward). Returns the set bits.
int64_t mask_words(const float* y, int64_t w0, int64_t w1, uint32_t tb, uint64_t* bits) {
  int64_t kept = 0;
  for (int64_t w = w0; w < w1; ++w) {
    uint64_t m = 0;
    const float* v = y + w * 64;
    for (int t = 0; t < 64; ++t) {
      uint32_t u;
      std::memcpy(&u, v + t, 4);
      m |= uint64_t(u >= tb) << t;
    }
    bits[w] = m;
    kept += __builtin_popcountll(m);
  }
  return kept;
}

// The stack's output is >= +0 (a ReLU, then only pools): the bitmap keep rule applies to it.
bool output_nonnegative(const FusedStack& s) {
  bool nonneg = false;
  for (size_t k = 1; k < s.stages.size(); ++k) {
    const FusedKind kind = s.stages[k].kind;
    nonneg = kind == FusedKind::Relu || (nonneg && (kind == FusedKind::MaxPool || kind == FusedKind::AvgPool));
  }
  return nonneg;
}

}  // namespace

size_t CpuBackend::fused_workspace_bytes(const FusedStack& s, int64_t batch) const {
  return sizeof(float) * size_t(thread_floats(s) * cpu_threads() + round16(2 * batch * s.C) + round16(5 * s.C));
}

void CpuBackend::fused_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws) {
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t N = t.x.dim(0), C = s.C, HW = bn.H * bn.W, PQ = last.P * last.Q, S = int64_t(s.stages.size());
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  ET_CHECK(S <= 8, "fused stack of ", S, " stages");
  const float* xp = t.x.f32();
  float* yp = t.y.f32();
  if (training) {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; ++c)
      bn_rows::channel_statistics(xp, N, C, HW, c, bn.momentum, bn.eps, t.running_mean, t.running_var, t.mean,
                                  t.invstd);
  }
  // The bitmap is written tile by tile when tiles cover whole 64-bit words, else in a pass over y.
  const bool want_mask = training && mask && mask->bits && output_nonnegative(s);
  const bool tile_words = (s.tile_channels * PQ) % 64 == 0 && (C * PQ) % 64 == 0;
  const uint32_t tb = want_mask ? bitmap::keep_threshold_bits(mask->prune_threshold) : 0;
  const Tiles tiles(s, N);
  const int64_t per_thread = thread_floats(s), plane = max_plane(s);
  int64_t kept = 0;
#pragma omp parallel reduction(+ : kept)
  {
    float* scratch = static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread;
    float* out[8];
    for (int64_t k = 0; k < S; ++k) out[k] = scratch + k * plane;
#pragma omp for schedule(static)
    for (int64_t ti = 0; ti < tiles.count; ++ti) {
      const int64_t n = ti / tiles.blocks, c0 = ti % tiles.blocks * s.tile_channels;
      const int64_t c1 = std::min(C, c0 + s.tile_channels);
      for (int64_t c = c0; c < c1; ++c) {
        float scale, shift;
        if (training)
          bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &scale,
                                      &shift);
        else
          bn_rows::eval_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.running_mean.f32()[c],
                                     t.running_var.f32()[c], bn.eps, &scale, &shift);
        const int64_t in_plane = n * C + c;
        out[S - 1] = yp + in_plane * PQ;  // the last stage writes y
        const int add = s.add_stage();
        const float* side = add >= 0 ? t.side.f32() + in_plane * s.stages[size_t(add)].H * s.stages[size_t(add)].W
                                     : nullptr;
        forward_plane(s, xp + in_plane * HW, side, scale, shift, out);
      }
      if (want_mask && tile_words) {
        const int64_t e0 = (n * C + c0) * PQ, e1 = (n * C + c1) * PQ;
        kept += mask_words(yp, e0 / 64, e1 / 64, tb, mask->bits);
      }
    }
  }
  if (want_mask) {
    if (tile_words) {
      mask->kept = kept;
    } else {
      Tensor y = t.y;
      relu_forward(y, y, mask);  // y >= +0: an identity that writes the bitmap
    }
  }
}

void CpuBackend::fused_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws) {
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t N = t.x.dim(0), C = s.C, HW = bn.H * bn.W, PQ = last.P * last.Q, S = int64_t(s.stages.size());
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  ET_CHECK(t.x.dtype == DType::F32, "fused stack backward reads x as f32");
  const float* xp = t.x.f32();
  const int add = s.add_stage();
  const int64_t side_plane = add >= 0 ? s.stages[size_t(add)].H * s.stages[size_t(add)].W : 0;
  const bool recompute = needs_recompute(s);
  const int64_t per_thread = thread_floats(s), plane = max_plane(s);
  float* partial = static_cast<float*>(ws.data) + per_thread * cpu_threads();  // [N][C][2]
  auto* coef = reinterpret_cast<bn_rows::GradCoefficients*>(partial + round16(2 * N * C));
  static_assert(sizeof(bn_rows::GradCoefficients) == 5 * sizeof(float), "coefficient layout");
  const Tiles tiles(s, N);

  // dz (the gradient of the BN output) of plane (n, c), in the thread's scratch. The first sweep
  // also writes the side input's gradient, which the Add stage hands on unchanged.
  auto plane_dz = [&](float* scratch, int64_t n, int64_t c, bool first_sweep) -> const float* {
    float* out[8];
    for (int64_t k = 0; k < S; ++k) out[k] = scratch + k * plane;
    float* ga = scratch + S * plane;
    float* gb = ga + plane;
    const int64_t in_plane = n * C + c;
    if (recompute) {
      float scale, shift;
      bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &scale,
                                  &shift);
      forward_plane(s, xp + in_plane * HW, add >= 0 ? t.side.f32() + in_plane * side_plane : nullptr, scale, shift,
                    out);
    }
    std::memcpy(ga, g.dy.f32() + in_plane * PQ, sizeof(float) * size_t(PQ));
    for (int64_t k = S - 1; k >= 1; --k) {
      const FusedStage& st = s.stages[size_t(k)];
      const int64_t n_in = st.H * st.W;
      switch (st.kind) {
        case FusedKind::Relu:
          if (k == S - 1 && s.saves_output_mask) {
            const int64_t o = in_plane * PQ;
            if (g.y_mask.bits) {
              const uint64_t* bits = g.y_mask.bits;
              for (int64_t i = 0; i < n_in; ++i) ga[i] = (bits[(o + i) >> 6] >> ((o + i) & 63)) & 1 ? ga[i] : 0.f;
            } else {
              const float* m = g.y_mask.dense.f32() + o;
#pragma omp simd
              for (int64_t i = 0; i < n_in; ++i) ga[i] = m[i] > 0.f ? ga[i] : 0.f;
            }
          } else {
            const float* m = out[k];
#pragma omp simd
            for (int64_t i = 0; i < n_in; ++i) ga[i] = m[i] > 0.f ? ga[i] : 0.f;
          }
          break;
        case FusedKind::Add:
          if (first_sweep && g.dside.defined()) {
            float* d = g.dside.f32() + in_plane * side_plane;
            if (g.dside_accumulate) {
#pragma omp simd
              for (int64_t i = 0; i < n_in; ++i) d[i] += ga[i];
            } else {
              std::memcpy(d, ga, sizeof(float) * size_t(n_in));
            }
          }
          break;
        case FusedKind::MaxPool:
        case FusedKind::AvgPool:
          std::memset(gb, 0, sizeof(float) * size_t(n_in));
          if (st.kind == FusedKind::MaxPool)
            pool_planes::max_backward(pool_planes::of(st), out[k - 1], ga, gb);
          else
            pool_planes::avg_backward(pool_planes::of(st), ga, gb);
          std::swap(ga, gb);
          break;
        default: ET_CHECK(false, "fused stage kind ", int(st.kind));
      }
    }
    return ga;
  };

  // Sweep 1: per-plane reductions (float), then per channel over n in order (double).
#pragma omp parallel
  {
    float* scratch = static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
    for (int64_t ti = 0; ti < tiles.count; ++ti) {
      const int64_t n = ti / tiles.blocks, c0 = ti % tiles.blocks * s.tile_channels;
      for (int64_t c = c0; c < std::min(C, c0 + s.tile_channels); ++c) {
        const float* dz = plane_dz(scratch, n, c, true);
        float* p = partial + 2 * (n * C + c);
        bn_rows::grad_sums(dz, xp + (n * C + c) * HW, t.mean.f32()[c], HW, p, p + 1);
      }
    }
#pragma omp for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      double sdy = 0, sdyx = 0;
      for (int64_t n = 0; n < N; ++n) {
        sdy += partial[2 * (n * C + c)];
        sdyx += partial[2 * (n * C + c) + 1];
      }
      const bn_rows::GradCoefficients k =
          bn_rows::grad_coefficients(sdy, sdyx, t.gamma.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], N * HW);
      coef[c] = k;
      if (g.dbeta.defined()) g.dbeta.f32()[c] = g.params_accumulate ? g.dbeta.f32()[c] + k.dbeta : k.dbeta;
      if (g.dgamma.defined()) g.dgamma.f32()[c] = g.params_accumulate ? g.dgamma.f32()[c] + k.dgamma : k.dgamma;
    }
    // Sweep 2: dx.
    if (g.dx.defined()) {
#pragma omp for schedule(static)
      for (int64_t ti = 0; ti < tiles.count; ++ti) {
        const int64_t n = ti / tiles.blocks, c0 = ti % tiles.blocks * s.tile_channels;
        for (int64_t c = c0; c < std::min(C, c0 + s.tile_channels); ++c) {
          const float* dz = plane_dz(scratch, n, c, false);
          const int64_t o = (n * C + c) * HW;
          bn_rows::grad_apply(dz, xp + o, coef[c], HW, g.dx.f32() + o, g.dx_accumulate);
        }
      }
    }
  }
}

}  // namespace et
