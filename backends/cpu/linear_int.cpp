// Linear layers on 4-bit codes (docs/quant.md): the exact integer GEMM of igemm.h, int32 results
// scaled back to f32 once per element.
//   forward        y[N, O]  = xq[N, I] (A)            x wq^T[I, O] (B)
//   data gradient  dx[N, I] = gq[N, O] (A, FP4 + 64)  x wq[O, I] (B)
//   weight grad.   dw[O, I] = gq^T[O, N] (A, + 64)    x xq[N, I] (B)
#include <algorithm>

#include "backends/cpu/carve.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/igemm.h"
#include "memory/stored_codes.h"

namespace et {

namespace {

using cpu::IgemmA;
using cpu::IgemmB;

using cpu::Carve;
constexpr size_t kAlign = 64;

int a_offset(DType t) { return t == DType::F4 ? 64 : t == DType::U4 ? 0 : 8; }

}  // namespace

size_t CpuBackend::linear_q_workspace_bytes(int64_t n, int64_t in, int64_t out) const {
  const int64_t m = std::max({n, in, out});
  return cpu::igemm_packed_a_bytes(m, m) + cpu::igemm_scratch_bytes(m) + size_t(m * m) * 4 + 3 * kAlign +
         size_t(n * in) + kAlign;  // stored input codes (code_rows)
}

void CpuBackend::linear_forward_q(const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y, Workspace ws) {
  const int64_t N = xq.dim(0), I = xq.dim(1), O = wq.dim(0);
  Carve cv(ws.data);
  uint8_t* ap = cv.take<uint8_t>(cpu::igemm_packed_a_bytes(N, I));
  void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(I));
  int32_t* acc = cv.take<int32_t>(size_t(N * O));
  const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{xq.codes(), N, I, I, 1, I, 0, a_offset(xq.dtype)}, ap);
  cpu::igemm(a, IgemmB{wq.codes(), I, O, I, 0, 0, true}, acc, O, false, scratch);
  const float scale = xq.host_scale() * wq.host_scale();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      y.f32()[n * O + o] = float(acc[n * O + o]) * scale + (b.defined() ? b.f32()[o] : 0.f);
}

void CpuBackend::linear_backward_data_q(const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate,
                                        Workspace ws) {
  const int64_t N = gq.dim(0), O = gq.dim(1), I = wq.dim(1);
  Carve cv(ws.data);
  uint8_t* ap = cv.take<uint8_t>(cpu::igemm_packed_a_bytes(N, O));
  void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(O));
  int32_t* acc = cv.take<int32_t>(size_t(N * I));
  const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{gq.codes(), N, O, O, 1, O, 0, a_offset(gq.dtype)}, ap);
  cpu::igemm(a, IgemmB{wq.codes(), O, I, I, I, 0, false}, acc, I, false, scratch);
  const float scale = gq.host_scale() * wq.host_scale();
  float* d = dx.f32();
  for (int64_t i = 0; i < N * I; ++i) d[i] = float(acc[i]) * scale + (accumulate ? d[i] : 0.f);
}

void CpuBackend::linear_backward_weight_q(const Tensor& xq, const Tensor& gq, Tensor& dw, Tensor& db, bool accumulate,
                                          Workspace ws) {
  const int64_t N = xq.dim(0), I = xq.dim(1), O = gq.dim(1);
  Carve cv(ws.data);
  uint8_t* ap = cv.take<uint8_t>(cpu::igemm_packed_a_bytes(O, N));
  void* scratch = cv.take<uint8_t>(cpu::igemm_scratch_bytes(N));
  int32_t* acc = cv.take<int32_t>(size_t(O * I));
  const int8_t* x = code_rows(xq, 0, N, cv.take<int8_t>(N * I));  // dense, or decoded from the stash
  // A = gq^T: element (o, n) at gq[n * O + o].
  const cpu::PackedA a = cpu::igemm_pack_a(IgemmA{gq.codes(), O, N, 1, O, N, 0, a_offset(gq.dtype)}, ap);
  cpu::igemm(a, IgemmB{x, N, I, I, I, 0, false}, acc, I, false, scratch);
  const float scale = xq.host_scale() * gq.host_scale();
  float* w = dw.f32();
  for (int64_t i = 0; i < O * I; ++i) w[i] = float(acc[i]) * scale + (accumulate ? w[i] : 0.f);
  if (db.defined())
    for (int64_t o = 0; o < O; ++o) {
      int64_t s = 0;
      for (int64_t n = 0; n < N; ++n) s += gq.codes()[n * O + o];
      db.f32()[o] = float(s) * gq.host_scale() + (accumulate ? db.f32()[o] : 0.f);
    }
}

}  // namespace et
