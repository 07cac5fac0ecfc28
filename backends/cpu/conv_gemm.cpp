// im2col + SGEMM conv path (see conv_gemm.h for the GEMM of each pass).
//
// Chunks: forward / backward data give each thread a contiguous slice of the batch and run one
// GEMM per chunk of nb of its images (nb*PQ >= ~256 columns, so 4x4 and 2x2 maps still feed the
// micro-kernel whole vectors). When nb == 1 the GEMM reads / writes the tensors in place (1x1
// convs need no im2col at all); otherwise the chunk is gathered into [rows, nb*PQ] matrices and
// scattered back. The weight gradient splits the output channels between the threads (each
// gathers every chunk itself; no partial sums, no reduction, no barrier), except for 1x1 convs,
// which split the batch and reduce per-thread partials once (bwd_weight_layout).
// Workspace: carved in the same order as sized by the *_layout functions below.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/balance.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_gemm.h"
#include "backends/cpu/fused_elementwise.h"
#include "backends/cpu/gemm.h"
#include "memory/stored_reader.h"

namespace et::cpu {

namespace {

float* align64(float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); }
struct Carve {  // bump allocator over the workspace, 64-byte aligned pieces
  float* p;
  float* take(int64_t n) { float* r = align64(p); p = r + n; return r; }
};

bool pointwise(const Conv2dGeom& g) {
  return g.R == 1 && g.S == 1 && g.stride_h == 1 && g.stride_w == 1 && g.pad_h == 0 && g.pad_w == 0;
}

// Images per GEMM: enough for target_cols columns, at most max_images.
int64_t chunk_images(const Conv2dGeom& g, int64_t target_cols, int64_t max_images) {
  const int64_t PQ = g.P * g.Q;
  return std::clamp<int64_t>((target_cols + PQ - 1) / PQ, 1, std::max<int64_t>(1, max_images));
}

// One cache line on its way. GCC dropped __builtin_prefetch from the loop below (a loop over rows
// with a skipped branch lost every prefetch); the asm stays. A prefetch never faults.
inline void prefetch_line(const char* p, bool for_write) {
#if defined(__x86_64__)
  if (for_write) asm volatile("prefetchw %0" : : "m"(*p));
  else asm volatile("prefetcht0 %0" : : "m"(*p));
#elif defined(__aarch64__)
  if (for_write) asm volatile("prfm pstl1keep, [%0]" : : "r"(p));
  else asm volatile("prfm pldl1keep, [%0]" : : "r"(p));
#else
  (void)p, (void)for_write;
#endif
}

// The lines of plane `x` [H, W] the windows read, on their way to the cache ahead of use (for
// writing, where col2im adds into them). A 32x32 plane is one 4 KiB page, and the hardware
// prefetchers stop at pages, so a strided im2col met a full memory latency at every cold plane:
// ResNet-20's 1x1 stride-2 shortcut gathered at 2-4 ns a float in a training step (1 ns warm),
// its forward 1.2-1.8 ms; with the rows 4 planes ahead, 0.9-1.0 ms.
void prefetch_window_rows(const Conv2dGeom& g, const float* x, bool for_write) {
  const bool distinct = g.stride_h >= g.R;  // else rows repeat across windows: the whole plane
  const int64_t rows = distinct ? g.P * g.R : g.H;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t h = distinct ? (i / g.R) * g.stride_h - g.pad_h + i % g.R : i;
    if (h < 0 || h >= g.H) continue;
    const char* row = reinterpret_cast<const char*>(x + h * g.W);
    for (int64_t b = 0; b < g.W * int64_t(sizeof(float)); b += 64) prefetch_line(row + b, for_write);
  }
}
constexpr int64_t kPrefetchPlanes = 4;  // planes ahead

// x [cg,H,W] -> col rows (c*R + r)*S + s (row stride ld), this image's P*Q columns.
void im2col(const Conv2dGeom& g, const float* x, int64_t cg, float* col, int64_t ld) {
  for (int64_t c = 0; c < cg; ++c) {
    if (c + kPrefetchPlanes < cg) prefetch_window_rows(g, x + (c + kPrefetchPlanes) * g.H * g.W, false);
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s) {
        float* dst = col + ((c * g.R + r) * g.S + s) * ld;
        const float* src = x + c * g.H * g.W;
        for (int64_t p = 0; p < g.P; ++p) {
          const int64_t h = p * g.stride_h - g.pad_h + r;
          float* d = dst + p * g.Q;
          if (h < 0 || h >= g.H) {
            std::memset(d, 0, sizeof(float) * size_t(g.Q));
            continue;
          }
          const float* row = src + h * g.W;
          const int64_t w0 = s - g.pad_w;
          // Columns q with 0 <= q*stride + w0 < W.
          const int64_t q_begin = std::min<int64_t>(g.Q, std::max<int64_t>(0, (-w0 + g.stride_w - 1) / g.stride_w));
          const int64_t q_end = std::max(q_begin, std::min<int64_t>(g.Q, (g.W - w0 + g.stride_w - 1) / g.stride_w));
          for (int64_t q = 0; q < q_begin; ++q) d[q] = 0.f;
          if (g.stride_w == 1) {
            std::memcpy(d + q_begin, row + w0 + q_begin, sizeof(float) * size_t(q_end - q_begin));
          } else {
            for (int64_t q = q_begin; q < q_end; ++q) d[q] = row[q * g.stride_w + w0];
          }
          for (int64_t q = q_end; q < g.Q; ++q) d[q] = 0.f;
        }
      }
  }
}

// col rows (row stride ld), this image's P*Q columns, summed into x [cg,H,W] (x initialised).
void col2im(const Conv2dGeom& g, const float* col, int64_t ld, int64_t cg, float* x) {
  for (int64_t c = 0; c < cg; ++c) {
    if (c + kPrefetchPlanes < cg) prefetch_window_rows(g, x + (c + kPrefetchPlanes) * g.H * g.W, true);
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s) {
        const float* src = col + ((c * g.R + r) * g.S + s) * ld;
        float* dst = x + c * g.H * g.W;
        const int64_t w0 = s - g.pad_w;
        const int64_t q_begin = std::min<int64_t>(g.Q, std::max<int64_t>(0, (-w0 + g.stride_w - 1) / g.stride_w));
        const int64_t q_end = std::max(q_begin, std::min<int64_t>(g.Q, (g.W - w0 + g.stride_w - 1) / g.stride_w));
        for (int64_t p = 0; p < g.P; ++p) {
          const int64_t h = p * g.stride_h - g.pad_h + r;
          if (h < 0 || h >= g.H) continue;
          float* row = dst + h * g.W;
          const float* sp = src + p * g.Q;
          if (g.stride_w == 1)
            for (int64_t q = q_begin; q < q_end; ++q) row[q + w0] += sp[q];
          else
            for (int64_t q = q_begin; q < q_end; ++q) row[q * g.stride_w + w0] += sp[q];
        }
      }
  }
}

// rows x [PQ] blocks of one image (row stride src_ld) <-> columns [b*PQ, (b+1)*PQ) of a [rows, ld] matrix.
void gather_rows(const float* src, int64_t rows, int64_t PQ, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ld, src + r * PQ, sizeof(float) * size_t(PQ));
}

struct Layout {
  int64_t nb = 1, cols = 0;          // images per chunk, columns of a full chunk
  int64_t a_n = 0, b_n = 0, scr_n = 0;  // the pieces (see each pass)
  int64_t x_n = 0;                      // weight gradient: one image of a stashed x, decoded
  int64_t img_n = 0;                    // forward: one image of x computed from a stack (ConvInput)
  int64_t part_n = 0;                   // weight gradient split by images: this thread's dw, db
  int64_t per_thread = 0, shared = 0;
};

// Forward, per thread: a = col [C*RS, cols] (not for 1x1 with nb == 1), b = y chunk [K, cols]
// (not when nb == 1), scratch.
Layout fwd_layout(const Conv2dGeom& g, int threads) {
  Layout l;
  const int64_t RS = g.R * g.S, Cg = g.C / g.groups, Kg = g.K / g.groups;
  l.nb = chunk_images(g, 256, (g.N + threads - 1) / threads);
  l.cols = l.nb * g.P * g.Q;
  l.a_n = (pointwise(g) && l.nb == 1) ? 0 : g.C * RS * l.cols;
  l.b_n = l.nb == 1 ? 0 : g.K * l.cols;
  l.scr_n = int64_t(sgemm_scratch_floats(Kg, l.cols, Cg * RS));
  l.img_n = g.C * g.H * g.W;  // one input image, where x is a fused stack's output (ConvInput)
  l.per_thread = l.a_n + l.b_n + l.scr_n + l.img_n + 80;
  return l;
}

// Backward data, per thread: a = dy chunk [K, cols] (not when nb == 1), b = col [CRS, cols] of one
// group (1x1 with nb == 1 writes dx in place), scratch.
Layout bwd_data_layout(const Conv2dGeom& g, int threads) {
  Layout l;
  const int64_t RS = g.R * g.S, Cg = g.C / g.groups, Kg = g.K / g.groups;
  l.nb = chunk_images(g, 256, (g.N + threads - 1) / threads);
  l.cols = l.nb * g.P * g.Q;
  l.a_n = l.nb == 1 ? 0 : g.K * l.cols;
  l.b_n = (pointwise(g) && l.nb == 1) ? 0 : Cg * RS * l.cols;
  l.scr_n = int64_t(sgemm_scratch_floats(Cg * RS, l.cols, Kg));
  l.per_thread = l.a_n + l.b_n + l.scr_n + 64;
  return l;
}

// Backward weight: thread t owns output channels [k0, k1) (whole micro-tile rows) over the whole
// batch, so it needs no partial sums, no reduction and no barrier (barriers per chunk stall badly
// on a loaded machine). Per thread: a = col [C*RS, cols] (not for 1x1 with nb == 1; every thread
// gathers the chunk itself), b = its dy rows [rows, cols] (not when nb == 1), scratch.
// nb depends on the geometry only, so the summation order is independent of the thread count.
// 1x1 convs split the batch instead (wgrad_splits_batch): their GEMM is a few FLOPs per element
// gathered, so a gather by every thread cost more than the GEMM (resnet20's 1x1 stride-2
// shortcuts: 1.9 ms a step for a 16 -> 32 one, its x cold in memory, against 0.5 in L3); each
// thread sums its images into its own dw / db partials, reduced once in thread order.
int64_t wgrad_rows(const Conv2dGeom& g, int t, int nt, int64_t* k0, int64_t* k1) {
  const int64_t units = (g.K + 7) / 8;
  *k0 = std::min(g.K, units * t / nt * 8);
  *k1 = std::min(g.K, units * (t + 1) / nt * 8);
  return std::min(g.K, (units + nt - 1) / nt * 8);  // bound over threads
}

bool wgrad_splits_batch(const Conv2dGeom& g) { return g.R * g.S == 1; }

Layout bwd_weight_layout(const Conv2dGeom& g, int threads) {
  Layout l;
  const int64_t RS = g.R * g.S, Cg = g.C / g.groups, Kg = g.K / g.groups;
  int64_t k0, k1;
  const bool split = wgrad_splits_batch(g);
  const int64_t rows = split ? g.K : wgrad_rows(g, 0, threads, &k0, &k1);
  l.nb = chunk_images(g, 512, split ? (g.N + threads - 1) / threads : g.N);
  l.cols = l.nb * g.P * g.Q;
  l.a_n = (pointwise(g) && l.nb == 1) ? 0 : g.C * RS * l.cols;
  l.b_n = l.nb == 1 ? 0 : rows * l.cols;
  l.scr_n = int64_t(sgemm_scratch_floats(std::min(rows, Kg), Cg * RS, l.cols));
  l.x_n = g.C * g.H * g.W;
  l.part_n = split ? g.K * Cg * RS + g.K : 0;
  l.per_thread = l.a_n + l.b_n + l.scr_n + l.x_n + l.part_n + 96;
  return l;
}

}  // namespace

size_t gemm_conv_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  Layout l;
  switch (pass) {
    case ConvPass::Forward: l = fwd_layout(g, threads); break;
    case ConvPass::BackwardData: l = bwd_data_layout(g, threads); break;
    case ConvPass::BackwardWeight: l = bwd_weight_layout(g, threads); break;
  }
  return size_t(l.shared + threads * l.per_thread) * sizeof(float);
}

void gemm_conv_forward(const Conv2dGeom& g, const Tensor& xt, const float* w, const float* b, float* y, void* ws,
                       float* sum1, float* sum2) {
  const ConvInput x(xt);
  const int threads = omp_get_max_threads();
  const Layout l = fwd_layout(g, threads);
  const int64_t RS = g.R * g.S, Cg = g.C / g.groups, Kg = g.K / g.groups, CRS = Cg * RS, PQ = g.P * g.Q,
                HW = g.H * g.W;
  StealingRanges chunks((g.N + l.nb - 1) / l.nb, 1, threads);  // of l.nb images (balance.h)
#pragma omp parallel num_threads(threads)
  {
    Carve cv{static_cast<float*>(ws) + omp_get_thread_num() * l.per_thread};
    float* col = cv.take(l.a_n);
    float* out = cv.take(l.b_n);
    float* scr = cv.take(l.scr_n);
    float* img = cv.take(l.img_n);
    chunks.run([&](int64_t c0, int64_t c1) {
      for (int64_t n0 = c0 * l.nb; n0 < std::min(g.N, c1 * l.nb); n0 += l.nb) {
        const int64_t nb = std::min(l.nb, g.N - n0), cols = nb * PQ;
        const float* src = col;
        if (l.a_n) {
          for (int64_t i = 0; i < nb; ++i) im2col(g, x.image(g.C, HW, n0 + i, img), g.C, col + i * PQ, cols);
        } else {
          src = x.image(g.C, HW, n0, img);  // 1x1, nb == 1: x [C, PQ] itself (or the stack's output)
        }
        float* dst = l.b_n ? out : y + n0 * g.K * PQ;
        for (int64_t gi = 0; gi < g.groups; ++gi)
          sgemm(false, false, Kg, cols, CRS, 1.f, w + gi * Kg * CRS, CRS, src + gi * CRS * cols, cols, 0.f,
                dst + gi * Kg * cols, cols, scr);
        for (int64_t i = 0; i < nb; ++i)
          for (int64_t k = 0; k < g.K; ++k) {
            float* yr = y + ((n0 + i) * g.K + k) * PQ;
            const float bk = b ? b[k] : 0.f;
            if (l.b_n) {
              const float* o = out + k * cols + i * PQ;
              for (int64_t j = 0; j < PQ; ++j) yr[j] = o[j] + bk;
            } else if (b) {
              for (int64_t j = 0; j < PQ; ++j) yr[j] += bk;
            }
          }
        if (sum1)  // the chunk's planes, still in this core's cache
          for (int64_t pl = n0 * g.K; pl < (n0 + nb) * g.K; ++pl)
            bn_rows::plane_sums(y + pl * PQ, PQ, sum1 + pl, sum2 + pl);
      }
    });
  }
}

void gemm_conv_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                             void* ws, const DzSumsEpilogue* dz_sums) {
  ET_CHECK(!dz_sums || g.groups == 1, "gemm data gradient: dz sums here");
  const int threads = omp_get_max_threads();
  const Layout l = bwd_data_layout(g, threads);
  const int64_t RS = g.R * g.S, Cg = g.C / g.groups, Kg = g.K / g.groups, CRS = Cg * RS, PQ = g.P * g.Q,
                HW = g.H * g.W;
  const bool pw = pointwise(g);
  StealingRanges chunks((g.N + l.nb - 1) / l.nb, 1, threads);  // of l.nb images (balance.h)
#pragma omp parallel num_threads(threads)
  {
    Carve cv{static_cast<float*>(ws) + omp_get_thread_num() * l.per_thread};
    float* dyc = cv.take(l.a_n);
    float* col = cv.take(l.b_n);
    float* scr = cv.take(l.scr_n);
    chunks.run([&](int64_t c0, int64_t c1) {
      for (int64_t n0 = c0 * l.nb; n0 < std::min(g.N, c1 * l.nb); n0 += l.nb) {
        const int64_t nb = std::min(l.nb, g.N - n0), cols = nb * PQ;
        const float* src = dy + n0 * g.K * PQ;  // nb == 1: dy [K, PQ] itself
        if (l.a_n) {
          for (int64_t i = 0; i < nb; ++i) gather_rows(dy + (n0 + i) * g.K * PQ, g.K, PQ, dyc + i * PQ, cols);
          src = dyc;
        }
        for (int64_t gi = 0; gi < g.groups; ++gi) {
          const float* wg = w + gi * Kg * CRS;
          const float* dyg = src + gi * Kg * cols;
          if (!l.b_n) {  // 1x1, nb == 1: dx [Cg, HW] (+)= w^T dy
            sgemm(true, false, CRS, cols, Kg, 1.f, wg, CRS, dyg, cols, accumulate ? 1.f : 0.f,
                  dx + (n0 * g.C + gi * Cg) * HW, cols, scr);
            continue;
          }
          sgemm(true, false, CRS, cols, Kg, 1.f, wg, CRS, dyg, cols, 0.f, col, cols, scr);
          for (int64_t i = 0; i < nb; ++i) {
            float* dxn = dx + ((n0 + i) * g.C + gi * Cg) * HW;
            if (pw) {
              for (int64_t c = 0; c < Cg; ++c) {
                const float* cr = col + c * cols + i * PQ;
                float* d = dxn + c * HW;
                if (accumulate)
                  for (int64_t j = 0; j < HW; ++j) d[j] += cr[j];
                else
                  std::memcpy(d, cr, sizeof(float) * size_t(HW));
              }
            } else {
              if (!accumulate) std::memset(dxn, 0, sizeof(float) * size_t(Cg * HW));
              col2im(g, col + i * PQ, cols, Cg, dxn);
            }
          }
        }
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
        if (dz_sums) fused_elementwise::dz_sums_images(*dz_sums, n0, n0 + nb, g.C, HW, dx);  // in cache
#endif
      }
    });
  }
}

void gemm_conv_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                               bool accumulate, void* ws) {
  const int threads = omp_get_max_threads();
  const Layout l = bwd_weight_layout(g, threads);
  const int64_t RS = g.R * g.S, Cg = g.C / g.groups, Kg = g.K / g.groups, CRS = Cg * RS, PQ = g.P * g.Q;
  const bool split = wgrad_splits_batch(g);
  const int64_t dw_n = g.K * CRS;
  auto partials_of = [&](int u) {  // thread u's dw / db partials (the carve below, in its order)
    Carve c{static_cast<float*>(ws) + u * l.per_thread};
    for (int64_t n : {l.a_n, l.b_n, l.scr_n, l.x_n}) c.take(n);
    return c.take(l.part_n);
  };
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    Carve cv{static_cast<float*>(ws) + t * l.per_thread};
    float* col = cv.take(l.a_n);
    float* dyc = cv.take(l.b_n);
    float* scr = cv.take(l.scr_n);
    StoredReader xr(x, cv.take(l.x_n), l.x_n);
    float* part = cv.take(l.part_n);  // split: [dw_n] then [K]
    int64_t k0 = 0, k1 = g.K, lo = 0, hi = g.N;
    if (split) {
      lo = g.N * t / nt;
      hi = g.N * (t + 1) / nt;
    } else {
      wgrad_rows(g, t, nt, &k0, &k1);
    }
    float* dwo = split ? part : dw;            // where this thread's sums go
    float* dbo = split ? part + dw_n : db;
    const bool acc_out = !split && accumulate;  // the first chunk adds to dw / db, else overwrites them
    for (int64_t n0 = lo; n0 < hi && k1 > k0; n0 += l.nb) {
      const int64_t nb = std::min(l.nb, hi - n0), cols = nb * PQ;
      const float* xs = l.a_n ? nullptr : xr.read(n0 * l.x_n, l.x_n);  // 1x1, nb == 1: x [C, PQ] itself
      const float* ds = dy + (n0 * g.K + k0) * PQ;  // nb == 1: dy rows [k0, k1) [PQ] themselves
      for (int64_t i = 0; i < nb && l.a_n; ++i)
        im2col(g, xr.read((n0 + i) * l.x_n, l.x_n), g.C, col + i * PQ, cols);
      for (int64_t i = 0; i < nb && l.b_n; ++i)
        gather_rows(dy + ((n0 + i) * g.K + k0) * PQ, k1 - k0, PQ, dyc + i * PQ, cols);
      if (l.a_n) xs = col;
      if (l.b_n) ds = dyc;
      const bool first = n0 == lo && !acc_out;
      for (int64_t gi = 0; gi < g.groups; ++gi) {  // this thread's rows of group gi
        const int64_t ka = std::max(k0, gi * Kg), kb = std::min(k1, (gi + 1) * Kg);
        if (kb > ka)
          sgemm(false, true, kb - ka, CRS, cols, 1.f, ds + (ka - k0) * cols, cols, xs + gi * CRS * cols, cols,
                first ? 0.f : 1.f, dwo + ka * CRS, CRS, scr);
      }
      if (db)
        for (int64_t k = k0; k < k1; ++k) {
          const float* r = ds + (k - k0) * cols;
          float s = 0.f;
          for (int64_t j = 0; j < cols; ++j) s += r[j];
          dbo[k] = first ? s : dbo[k] + s;
        }
    }
    if (split) {
      if (hi == lo) std::memset(part, 0, sizeof(float) * size_t(l.part_n));  // more threads than images
#pragma omp barrier
      // Each thread owns a slice of the weights and sums the partials in thread order.
      const int64_t total = dw_n + (db ? g.K : 0);
      const int64_t i0 = total * t / nt, i1 = total * (t + 1) / nt;
      for (int64_t i = i0; i < i1; ++i) {
        float s = 0.f;
        for (int u = 0; u < nt; ++u) s += partials_of(u)[i];
        float& dst = i < dw_n ? dw[i] : db[i - dw_n];
        dst = accumulate ? dst + s : s;
      }
    }
  }
}

}  // namespace et::cpu
