// Convolution and linear on 4-bit codes (docs/quant.md): im2col of int8 codes + the exact integer
// GEMM (igemm.h), int32 results scaled back to f32 once per element.
//
//   forward        y[K, PQ]     = wq[K, CRS] (A, +8)            x col(xq)[CRS, PQ] (B)
//   data gradient  dcol[CRS, PQ] = wq^T[CRS, K] (A, +8)         x gq[K, PQ] (B), then col2im
//   weight grad.   dw[K, CRS]   = gq[K, PQ] (A, FP4 + 64)        x col(xq)^T[PQ, CRS] (B)
// Several images share one GEMM on small maps (columns side by side). The weight gradient sums
// images into per-thread int32 partials that are added in thread order: integer sums, so the
// result does not depend on the thread count. groups == 1 only (depthwise layers stay f32).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/igemm.h"
#include "backends/cpu/quantize.h"
#include "memory/stored_codes.h"

namespace et {

namespace {

using cpu::IgemmA;
using cpu::IgemmB;

uint8_t* align64(uint8_t* p) { return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); }
struct Carve {  // bump allocator over the workspace, 64-byte aligned pieces
  uint8_t* p;
  template <typename T>
  T* take(size_t n) {
    uint8_t* r = align64(p);
    p = r + n * sizeof(T);
    return reinterpret_cast<T*>(r);
  }
};
constexpr size_t kAlign = 64;

int a_offset(DType t) { return t == DType::F4 ? 64 : t == DType::U4 ? 0 : 8; }

bool pointwise(const Conv2dGeom& g) {
  return g.R == 1 && g.S == 1 && g.stride_h == 1 && g.stride_w == 1 && g.pad_h == 0 && g.pad_w == 0;
}
int64_t images_per_gemm(const Conv2dGeom& g) {
  const int64_t PQ = g.P * g.Q;
  return std::clamp<int64_t>((256 + PQ - 1) / PQ, 1, std::max<int64_t>(1, g.N));
}
int64_t crs(const Conv2dGeom& g) { return g.C * g.R * g.S; }

// xq image [C,H,W] -> col rows (c*R + r)*S + s, columns [col0, col0 + PQ) of a row of length ld.
void im2col_i8(const Conv2dGeom& g, const int8_t* x, int8_t* col, int64_t ld) {
  for (int64_t c = 0; c < g.C; ++c)
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s) {
        int8_t* dst = col + ((c * g.R + r) * g.S + s) * ld;
        const int8_t* src = x + c * g.H * g.W;
        for (int64_t p = 0; p < g.P; ++p) {
          const int64_t h = p * g.stride_h - g.pad_h + r;
          int8_t* d = dst + p * g.Q;
          if (h < 0 || h >= g.H) {
            std::memset(d, 0, size_t(g.Q));
            continue;
          }
          const int8_t* row = src + h * g.W;
          for (int64_t q = 0; q < g.Q; ++q) {
            const int64_t w = q * g.stride_w - g.pad_w + s;
            d[q] = w >= 0 && w < g.W ? row[w] : int8_t(0);
          }
        }
      }
}

// dx image [C,H,W] += scale * dcol (int32 rows (c*R + r)*S + s, row stride ld).
void col2im_add(const Conv2dGeom& g, const int32_t* col, int64_t ld, float scale, float* dx) {
  for (int64_t c = 0; c < g.C; ++c)
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s) {
        const int32_t* src = col + ((c * g.R + r) * g.S + s) * ld;
        float* dst = dx + c * g.H * g.W;
        for (int64_t p = 0; p < g.P; ++p) {
          const int64_t h = p * g.stride_h - g.pad_h + r;
          if (h < 0 || h >= g.H) continue;
          for (int64_t q = 0; q < g.Q; ++q) {
            const int64_t w = q * g.stride_w - g.pad_w + s;
            if (w >= 0 && w < g.W) dst[h * g.W + w] += float(src[p * g.Q + q]) * scale;
          }
        }
      }
}

struct ThreadBytes {
  size_t shared = 0, per_thread = 0;
  size_t total(int threads) const { return shared + per_thread * size_t(threads); }
};

ThreadBytes conv_q_bytes(const Conv2dGeom& g, ConvPass pass) {
  const int64_t G = images_per_gemm(g), cols = G * g.P * g.Q, rows = crs(g);
  const size_t decoded = size_t(G * g.C * g.H * g.W) + kAlign;  // stored input codes (code_rows)
  ThreadBytes b;
  switch (pass) {
    case ConvPass::Forward:
      b.shared = cpu::igemm_packed_a_bytes(g.K, rows) + kAlign;
      b.per_thread = size_t(rows * cols) + size_t(g.K * cols) * 4 + cpu::igemm_scratch_bytes(rows) + 3 * kAlign + decoded;
      break;
    case ConvPass::BackwardData:
      b.shared = cpu::igemm_packed_a_bytes(rows, g.K) + kAlign;
      b.per_thread = size_t(rows * cols) * 4 + cpu::igemm_scratch_bytes(g.K) + 2 * kAlign;
      break;
    case ConvPass::BackwardWeight:
      b.per_thread = size_t(rows * cols) + cpu::igemm_packed_a_bytes(g.K, cols) + cpu::igemm_scratch_bytes(cols) +
                     size_t(g.K * rows) * 4 + size_t(g.K) * 8 + 5 * kAlign + decoded;
      break;
  }
  return b;
}

}  // namespace

size_t CpuBackend::conv2d_q_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const {
  return conv_q_bytes(g, pass).total(cpu_threads());
}

void CpuBackend::conv2d_forward_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y,
                                  Workspace ws) {
  ET_CHECK(g.groups == 1 && wq.dtype == DType::I4 && is_input_codes(xq.dtype));
  const int64_t rows = crs(g), PQ = g.P * g.Q, G = images_per_gemm(g), chunks = (g.N + G - 1) / G;
  const ThreadBytes tb = conv_q_bytes(g, ConvPass::Forward);
  ET_CHECK(ws.bytes >= tb.total(cpu_threads()), "conv int workspace");
  uint8_t* base = static_cast<uint8_t*>(ws.data);
  const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{wq.codes(), g.K, rows, rows, 1, rows, 0, 8}, base);
  const float scale = xq.scale * wq.scale;
  const float* bias = b.defined() ? b.f32() : nullptr;
#pragma omp parallel
  {
    Carve cv{base + tb.shared + tb.per_thread * size_t(omp_get_thread_num())};
    int8_t* col = cv.take<int8_t>(size_t(rows * G * PQ));
    int32_t* acc = cv.take<int32_t>(size_t(g.K * G * PQ));
    void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(rows));
    int8_t* decoded = cv.take<int8_t>(size_t(G * g.C * g.H * g.W));
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t n0 = ch * G, nb = std::min(G, g.N - n0), cols = nb * PQ;
      const int8_t* xb = code_rows(xq, n0, nb, decoded);
      IgemmB bm;
      if (pointwise(g)) {  // 1x1: the codes are the columns (image groups side by side)
        bm = IgemmB{xb, rows, cols, PQ, PQ, g.C * PQ, false};
      } else {
        for (int64_t i = 0; i < nb; ++i) im2col_i8(g, xb + i * g.C * g.H * g.W, col + i * PQ, G * PQ);
        bm = IgemmB{col, rows, cols, G * PQ, cols, 0, false};
      }
      cpu::igemm(a, bm, acc, cols, false, scratch);
      for (int64_t i = 0; i < nb; ++i)
        for (int64_t k = 0; k < g.K; ++k) {
          float* dst = y.f32() + ((n0 + i) * g.K + k) * PQ;
          const int32_t* src = acc + k * cols + i * PQ;
          const float bk = bias ? bias[k] : 0.f;
          for (int64_t p = 0; p < PQ; ++p) dst[p] = float(src[p]) * scale + bk;
        }
    }
  }
}

void CpuBackend::conv2d_backward_data_q(const Conv2dGeom& g, const Tensor& gq, const Tensor& wq, Tensor& dx,
                                        bool accumulate, Workspace ws) {
  ET_CHECK(g.groups == 1 && wq.dtype == DType::I4);
  const int64_t rows = crs(g), PQ = g.P * g.Q, HW = g.H * g.W, G = images_per_gemm(g), chunks = (g.N + G - 1) / G;
  const ThreadBytes tb = conv_q_bytes(g, ConvPass::BackwardData);
  ET_CHECK(ws.bytes >= tb.total(cpu_threads()), "conv int workspace");
  uint8_t* base = static_cast<uint8_t*>(ws.data);
  // A = wq^T: element (crs, k) at wq[k * CRS + crs].
  const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{wq.codes(), rows, g.K, 1, rows, g.K, 0, 8}, base);
  const float scale = gq.scale * wq.scale;
  const bool direct = pointwise(g);
#pragma omp parallel
  {
    Carve cv{base + tb.shared + tb.per_thread * size_t(omp_get_thread_num())};
    int32_t* acc = cv.take<int32_t>(size_t(rows * G * PQ));
    void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(g.K));
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t n0 = ch * G, nb = std::min(G, g.N - n0), cols = nb * PQ;
      cpu::igemm(a, IgemmB{gq.codes() + n0 * g.K * PQ, g.K, cols, PQ, PQ, g.K * PQ, false}, acc, cols, false,
                 scratch);
      for (int64_t i = 0; i < nb; ++i) {
        float* dxi = dx.f32() + (n0 + i) * g.C * HW;
        if (direct) {  // 1x1 stride 1: dcol is dx
          for (int64_t c = 0; c < g.C; ++c) {
            const int32_t* src = acc + c * cols + i * PQ;
            float* dst = dxi + c * HW;
            for (int64_t p = 0; p < PQ; ++p) dst[p] = float(src[p]) * scale + (accumulate ? dst[p] : 0.f);
          }
          continue;
        }
        if (!accumulate) std::memset(dxi, 0, sizeof(float) * size_t(g.C * HW));
        col2im_add(g, acc + i * PQ, cols, scale, dxi);
      }
    }
  }
}

void CpuBackend::conv2d_backward_weight_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& gq, Tensor& dw,
                                          Tensor& db, bool accumulate, Workspace ws) {
  ET_CHECK(g.groups == 1 && is_input_codes(xq.dtype));
  const int64_t rows = crs(g), PQ = g.P * g.Q, G = images_per_gemm(g), chunks = (g.N + G - 1) / G;
  // |sum| <= N * PQ * 64 * 15 (per sample) must fit the int32 partials.
  ET_CHECK(double(g.N) * double(PQ) * 64.0 * 15.0 < 2147483647.0, "int32 weight-gradient sums could overflow");
  const ThreadBytes tb = conv_q_bytes(g, ConvPass::BackwardWeight);
  const int threads = cpu_threads();
  ET_CHECK(ws.bytes >= tb.total(threads), "conv int workspace");
  uint8_t* base = static_cast<uint8_t*>(ws.data);
  auto partial = [&](int t, int32_t** dwp, int64_t** dbp) {
    Carve cv{base + tb.per_thread * size_t(t)};
    cv.take<int8_t>(size_t(rows * G * PQ));
    cv.take<uint8_t>(cpu::igemm_packed_a_bytes(g.K, G * PQ));
    cv.take<uint8_t>(cpu::igemm_scratch_bytes(G * PQ));
    *dwp = cv.take<int32_t>(size_t(g.K * rows));
    *dbp = cv.take<int64_t>(size_t(g.K));
  };
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    Carve cv{base + tb.per_thread * size_t(t)};
    int8_t* col = cv.take<int8_t>(size_t(rows * G * PQ));
    uint8_t* apack = cv.take<uint8_t>(cpu::igemm_packed_a_bytes(g.K, G * PQ));
    void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(G * PQ));
    int32_t* dwp = cv.take<int32_t>(size_t(g.K * rows));
    int64_t* dbp = cv.take<int64_t>(size_t(g.K));
    int8_t* decoded = cv.take<int8_t>(size_t(G * g.C * g.H * g.W));
    std::memset(dwp, 0, sizeof(int32_t) * size_t(g.K * rows));
    std::memset(dbp, 0, sizeof(int64_t) * size_t(g.K));
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t n0 = ch * G, nb = std::min(G, g.N - n0), cols = nb * PQ;
      const int8_t* gb = gq.codes() + n0 * g.K * PQ;
      const int8_t* xb = code_rows(xq, n0, nb, decoded);
      for (int64_t i = 0; i < nb; ++i) im2col_i8(g, xb + i * g.C * g.H * g.W, col + i * PQ, cols);
      // A = gq chunk: element (k, (i, p)) at gb[i * K*PQ + k * PQ + p]; B = col^T.
      const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{gb, g.K, cols, PQ, 1, PQ, g.K * PQ, 64}, apack);
      cpu::igemm(a, IgemmB{col, cols, rows, cols, 0, 0, true}, dwp, rows, true, scratch);
      if (db.defined())
        for (int64_t i = 0; i < nb; ++i)
          for (int64_t k = 0; k < g.K; ++k) dbp[k] += cpu::sum_codes(gb + (i * g.K + k) * PQ, PQ);
    }
  }
  // Partials in thread order (integers: any order gives the same sums).
  const float scale = xq.scale * gq.scale;
  int32_t* dw0;
  int64_t* db0;
  partial(0, &dw0, &db0);
  for (int t = 1; t < threads; ++t) {
    int32_t* dwt;
    int64_t* dbt;
    partial(t, &dwt, &dbt);
    for (int64_t i = 0; i < g.K * rows; ++i) dw0[i] += dwt[i];
    for (int64_t k = 0; k < g.K; ++k) db0[k] += dbt[k];
  }
  float* w = dw.f32();
  for (int64_t i = 0; i < g.K * rows; ++i) w[i] = float(dw0[i]) * scale + (accumulate ? w[i] : 0.f);
  if (db.defined())
    for (int64_t k = 0; k < g.K; ++k) db.f32()[k] = float(db0[k]) * gq.scale + (accumulate ? db.f32()[k] : 0.f);
}

// ---- linear: y [N,O] = xq [N,I] wq[O,I]^T

size_t CpuBackend::linear_q_workspace_bytes(int64_t n, int64_t in, int64_t out) const {
  const int64_t m = std::max({n, in, out});
  return cpu::igemm_packed_a_bytes(m, m) + cpu::igemm_scratch_bytes(m) + size_t(m * m) * 4 + 3 * kAlign +
         size_t(n * in) + kAlign;  // stored input codes (code_rows)
}

void CpuBackend::linear_forward_q(const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y, Workspace ws) {
  const int64_t N = xq.dim(0), I = xq.dim(1), O = wq.dim(0);
  Carve cv{static_cast<uint8_t*>(ws.data)};
  uint8_t* ap = cv.take<uint8_t>(cpu::igemm_packed_a_bytes(N, I));
  void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(I));
  int32_t* acc = cv.take<int32_t>(size_t(N * O));
  const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{xq.codes(), N, I, I, 1, I, 0, a_offset(xq.dtype)}, ap);
  cpu::igemm(a, IgemmB{wq.codes(), I, O, I, 0, 0, true}, acc, O, false, scratch);
  const float scale = xq.scale * wq.scale;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      y.f32()[n * O + o] = float(acc[n * O + o]) * scale + (b.defined() ? b.f32()[o] : 0.f);
}

void CpuBackend::linear_backward_data_q(const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate,
                                        Workspace ws) {
  const int64_t N = gq.dim(0), O = gq.dim(1), I = wq.dim(1);
  Carve cv{static_cast<uint8_t*>(ws.data)};
  uint8_t* ap = cv.take<uint8_t>(cpu::igemm_packed_a_bytes(N, O));
  void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(O));
  int32_t* acc = cv.take<int32_t>(size_t(N * I));
  const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{gq.codes(), N, O, O, 1, O, 0, a_offset(gq.dtype)}, ap);
  cpu::igemm(a, IgemmB{wq.codes(), O, I, I, I, 0, false}, acc, I, false, scratch);
  const float scale = gq.scale * wq.scale;
  float* d = dx.f32();
  for (int64_t i = 0; i < N * I; ++i) d[i] = float(acc[i]) * scale + (accumulate ? d[i] : 0.f);
}

void CpuBackend::linear_backward_weight_q(const Tensor& xq, const Tensor& gq, Tensor& dw, Tensor& db, bool accumulate,
                                          Workspace ws) {
  const int64_t N = xq.dim(0), I = xq.dim(1), O = gq.dim(1);
  Carve cv{static_cast<uint8_t*>(ws.data)};
  uint8_t* ap = cv.take<uint8_t>(cpu::igemm_packed_a_bytes(O, N));
  void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(N));
  int32_t* acc = cv.take<int32_t>(size_t(O * I));
  const int8_t* x = code_rows(xq, 0, N, cv.take<int8_t>(size_t(N * I)));
  // A = gq^T: element (o, n) at gq[n * O + o].
  const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{gq.codes(), O, N, 1, O, N, 0, a_offset(gq.dtype)}, ap);
  cpu::igemm(a, IgemmB{x, N, I, I, I, 0, false}, acc, I, false, scratch);
  const float scale = xq.scale * gq.scale;
  float* w = dw.f32();
  for (int64_t i = 0; i < O * I; ++i) w[i] = float(acc[i]) * scale + (accumulate ? w[i] : 0.f);
  if (db.defined())
    for (int64_t o = 0; o < O; ++o) {
      int64_t s = 0;
      for (int64_t n = 0; n < N; ++n) s += gq.codes()[n * O + o];
      db.f32()[o] = float(s) * gq.scale + (accumulate ? db.f32()[o] : 0.f);
    }
}

}  // namespace et
