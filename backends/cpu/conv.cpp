// conv2d on CPU: per image, im2col + SGEMM (a 1x1 / stride 1 / no padding conv reads x directly),
// images spread over threads. Weight gradients: thread-private partial sums reduced in thread
// order, so results are deterministic for a given thread count.
//
// Per image n and group g (Cg = C/groups, Kg = K/groups, CRS = Cg*R*S, PQ = P*Q):
//   forward:  y[n,g] [Kg,PQ]   = w[g] [Kg,CRS] x col(x[n,g]) [CRS,PQ]
//   data:     col [CRS,PQ]     = w[g]^T x dy[n,g];   dx[n,g] = col2im(col)
//   weight:   dw[g] [Kg,CRS]  += dy[n,g] [Kg,PQ] x col^T
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/gemm.h"

namespace et {

void Conv2dGeom::infer_output() {
  P = (H + 2 * pad_h - R) / stride_h + 1;
  Q = (W + 2 * pad_w - S) / stride_w + 1;
  if (H + 2 * pad_h < R || W + 2 * pad_w < S) P = Q = 0;
}

int cpu_threads() { return omp_get_max_threads(); }

namespace {

bool is_pointwise(const Conv2dGeom& g) {
  return g.R == 1 && g.S == 1 && g.stride_h == 1 && g.stride_w == 1 && g.pad_h == 0 && g.pad_w == 0;
}

size_t col_floats(const Conv2dGeom& g) { return size_t(g.C / g.groups * g.R * g.S * g.P * g.Q); }

// x [Cg,H,W] -> col [Cg*R*S, P*Q]
void im2col(const Conv2dGeom& g, const float* x, int64_t cg, float* col) {
  const int64_t PQ = g.P * g.Q;
  for (int64_t c = 0; c < cg; ++c)
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s) {
        float* dst = col + ((c * g.R + r) * g.S + s) * PQ;
        const float* src = x + c * g.H * g.W;
        for (int64_t p = 0; p < g.P; ++p) {
          const int64_t h = p * g.stride_h - g.pad_h + r;
          float* d = dst + p * g.Q;
          if (h < 0 || h >= g.H) {
            std::memset(d, 0, sizeof(float) * size_t(g.Q));
            continue;
          }
          const float* row = src + h * g.W;
          if (g.stride_w == 1) {
            const int64_t w0 = s - g.pad_w;
            const int64_t q_begin = std::max<int64_t>(0, -w0), q_end = std::min<int64_t>(g.Q, g.W - w0);
            for (int64_t q = 0; q < q_begin; ++q) d[q] = 0.f;
            if (q_end > q_begin) std::memcpy(d + q_begin, row + w0 + q_begin, sizeof(float) * size_t(q_end - q_begin));
            for (int64_t q = std::max(q_end, q_begin); q < g.Q; ++q) d[q] = 0.f;
          } else {
            for (int64_t q = 0; q < g.Q; ++q) {
              const int64_t w = q * g.stride_w - g.pad_w + s;
              d[q] = (w >= 0 && w < g.W) ? row[w] : 0.f;
            }
          }
        }
      }
}

// col [Cg*R*S, P*Q] summed into x [Cg,H,W] (x must be initialised)
void col2im(const Conv2dGeom& g, const float* col, int64_t cg, float* x) {
  const int64_t PQ = g.P * g.Q;
  for (int64_t c = 0; c < cg; ++c)
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s) {
        const float* src = col + ((c * g.R + r) * g.S + s) * PQ;
        float* dst = x + c * g.H * g.W;
        for (int64_t p = 0; p < g.P; ++p) {
          const int64_t h = p * g.stride_h - g.pad_h + r;
          if (h < 0 || h >= g.H) continue;
          float* row = dst + h * g.W;
          const float* sp = src + p * g.Q;
          for (int64_t q = 0; q < g.Q; ++q) {
            const int64_t w = q * g.stride_w - g.pad_w + s;
            if (w >= 0 && w < g.W) row[w] += sp[q];
          }
        }
      }
}

enum class Path { Gemm, Direct, Depthwise };

cpu::ConvPathOverride initial_override() {
  const char* e = std::getenv("ET_CONV_PATH");
  if (e && !std::strcmp(e, "gemm")) return cpu::ConvPathOverride::Gemm;
  if (e && !std::strcmp(e, "direct")) return cpu::ConvPathOverride::Direct;
  return cpu::ConvPathOverride::Auto;
}
cpu::ConvPathOverride g_override = initial_override();

// Which kernel family runs a pass (the workspace is sized for the same choice).
// Dense convs: measured with bench/bench_conv (2 Zen 4 cores); the direct kernels win for 3x3
// windows on maps of 8x8 and up (1.5-2.5x), the GEMM wins for 1x1 (no im2col there, and the
// direct kernel measured no better) and for 4x4 / 2x2 maps.
// ET_CONV_PATH=gemm|direct overrides the choice where both apply (A/B measurements).
Path choose(const Conv2dGeom& g, ConvPass pass) {
  if (cpu::depthwise_applies(g, pass)) return Path::Depthwise;
  if (!cpu::direct_dense_applies(g, pass)) return Path::Gemm;
  if (g_override == cpu::ConvPathOverride::Gemm) return Path::Gemm;
  if (g_override == cpu::ConvPathOverride::Direct) return Path::Direct;
  const int64_t PQ = g.P * g.Q;
  if (g.R * g.S == 1 || PQ <= 16) return Path::Gemm;
  // Weight gradient: the direct kernel's chunk of images shrinks to one on small maps with many
  // channels, and Eigen's blocked GEMM wins there (vgg 128->256 and 256->256 on 8x8).
  if (pass == ConvPass::BackwardWeight && (PQ < 64 || g.C / g.groups < 8 || (PQ < 256 && g.C / g.groups > 64)))
    return Path::Gemm;
  return Path::Direct;
}

}  // namespace

namespace cpu {
void conv_set_path_override(ConvPathOverride p) { g_override = p; }
}  // namespace cpu

size_t CpuBackend::conv2d_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const {
  switch (choose(g, pass)) {
    case Path::Depthwise: return cpu::depthwise_workspace(g, pass, cpu_threads());
    case Path::Direct: return cpu::direct_dense_workspace(g, pass, cpu_threads());
    case Path::Gemm: break;
  }
  const size_t threads = size_t(cpu_threads());
  size_t per_thread = is_pointwise(g) ? 0 : col_floats(g);
  if (pass == ConvPass::BackwardWeight) per_thread += size_t(g.K * (g.C / g.groups) * g.R * g.S + g.K);
  return threads * per_thread * sizeof(float);
}

void CpuBackend::conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                                Workspace ws) {
  switch (choose(g, ConvPass::Forward)) {
    case Path::Depthwise:
      return cpu::depthwise_forward(g, x.f32(), w.f32(), b.defined() ? b.f32() : nullptr, y.f32(), ws.data);
    case Path::Direct:
      return cpu::direct_dense_forward(g, x.f32(), w.f32(), b.defined() ? b.f32() : nullptr, y.f32(), ws.data);
    case Path::Gemm: break;
  }
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, CRS = Cg * g.R * g.S, PQ = g.P * g.Q;
  const bool pw = is_pointwise(g);
  const float* xp = x.f32();
  const float* wp = w.f32();
  float* yp = y.f32();
  const float* bp = b.defined() ? b.f32() : nullptr;
  const size_t col_n = col_floats(g);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < g.N; ++n) {
    float* col = static_cast<float*>(ws.data) + size_t(omp_get_thread_num()) * col_n;
    for (int64_t gi = 0; gi < g.groups; ++gi) {
      const float* xn = xp + (n * g.C + gi * Cg) * g.H * g.W;
      float* yn = yp + (n * g.K + gi * Kg) * PQ;
      const float* src = xn;
      if (!pw) {
        im2col(g, xn, Cg, col);
        src = col;
      }
      cpu::sgemm(false, false, Kg, PQ, CRS, 1.f, wp + gi * Kg * CRS, CRS, src, PQ, 0.f, yn, PQ);
      if (bp)
        for (int64_t k = 0; k < Kg; ++k) {
          const float bk = bp[gi * Kg + k];
          float* row = yn + k * PQ;
          for (int64_t i = 0; i < PQ; ++i) row[i] += bk;
        }
    }
  }
}

void CpuBackend::conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx,
                                      bool accumulate, Workspace ws) {
  switch (choose(g, ConvPass::BackwardData)) {
    case Path::Depthwise: return cpu::depthwise_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data);
    case Path::Direct: return cpu::direct_dense_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data);
    case Path::Gemm: break;
  }
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, CRS = Cg * g.R * g.S, PQ = g.P * g.Q;
  const bool pw = is_pointwise(g);
  const float* dyp = dy.f32();
  const float* wp = w.f32();
  float* dxp = dx.f32();
  const size_t col_n = col_floats(g);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < g.N; ++n) {
    float* col = static_cast<float*>(ws.data) + size_t(omp_get_thread_num()) * col_n;
    for (int64_t gi = 0; gi < g.groups; ++gi) {
      const float* dyn = dyp + (n * g.K + gi * Kg) * PQ;
      float* dxn = dxp + (n * g.C + gi * Cg) * g.H * g.W;
      if (pw) {
        cpu::sgemm(true, false, CRS, PQ, Kg, 1.f, wp + gi * Kg * CRS, CRS, dyn, PQ, accumulate ? 1.f : 0.f, dxn, PQ);
        continue;
      }
      cpu::sgemm(true, false, CRS, PQ, Kg, 1.f, wp + gi * Kg * CRS, CRS, dyn, PQ, 0.f, col, PQ);
      if (!accumulate) std::memset(dxn, 0, sizeof(float) * size_t(Cg * g.H * g.W));
      col2im(g, col, Cg, dxn);
    }
  }
}

void CpuBackend::conv2d_backward_weight(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw,
                                        Tensor& db, bool accumulate, Workspace ws) {
  float* dbp = db.defined() ? db.f32() : nullptr;
  switch (choose(g, ConvPass::BackwardWeight)) {
    case Path::Depthwise:
      return cpu::depthwise_backward_weight(g, x.f32(), dy.f32(), dw.f32(), dbp, accumulate, ws.data);
    case Path::Direct:
      return cpu::direct_dense_backward_weight(g, x.f32(), dy.f32(), dw.f32(), dbp, accumulate, ws.data);
    case Path::Gemm: break;
  }
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, CRS = Cg * g.R * g.S, PQ = g.P * g.Q;
  const bool pw = is_pointwise(g);
  const float* xp = x.f32();
  const float* dyp = dy.f32();
  const size_t col_n = pw ? 0 : col_floats(g);
  const size_t dw_n = size_t(g.K * CRS), per_thread = col_n + dw_n + size_t(g.K);
  const int threads = cpu_threads();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float* base = static_cast<float*>(ws.data) + size_t(t) * per_thread;
    float* col = base;
    float* dw_part = base + col_n;
    float* db_part = dw_part + dw_n;
    std::memset(dw_part, 0, sizeof(float) * (dw_n + size_t(g.K)));
    // Static contiguous split of the batch: thread t takes images [n0, n1).
    const int64_t n0 = g.N * t / nt, n1 = g.N * (t + 1) / nt;
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        const float* xn = xp + (n * g.C + gi * Cg) * g.H * g.W;
        const float* dyn = dyp + (n * g.K + gi * Kg) * PQ;
        const float* src = xn;
        if (!pw) {
          im2col(g, xn, Cg, col);
          src = col;
        }
        cpu::sgemm(false, true, Kg, CRS, PQ, 1.f, dyn, PQ, src, PQ, 1.f, dw_part + gi * Kg * CRS, CRS);
        if (db.defined())
          for (int64_t k = 0; k < Kg; ++k) {
            const float* row = dyn + k * PQ;
            float s = 0.f;
            for (int64_t i = 0; i < PQ; ++i) s += row[i];
            db_part[gi * Kg + k] += s;
          }
      }
#pragma omp barrier
    // Reduce partial sums in thread order; each thread owns a slice of the weights.
    float* dwp = dw.f32();
    const int64_t total = int64_t(dw_n) + (db.defined() ? g.K : 0);
    const int64_t i0 = total * t / nt, i1 = total * (t + 1) / nt;
    for (int64_t i = i0; i < i1; ++i) {
      float s = 0.f;
      for (int u = 0; u < nt; ++u) s += static_cast<float*>(ws.data)[size_t(u) * per_thread + col_n + size_t(i)];
      float& dst = i < int64_t(dw_n) ? dwp[i] : db.f32()[i - int64_t(dw_n)];
      dst = accumulate ? dst + s : s;
    }
  }
}

}  // namespace et
