// linear on CPU: one SGEMM per pass; the batch is split over threads for forward / data gradient,
// output rows for the weight gradient (every element summed in one thread: thread-count independent).
// Packing scratch: CpuBackend::gemm_scratch_, allocated in the constructor.
#include <omp.h>

#include <algorithm>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/gemm.h"

namespace et {

CpuBackend::CpuBackend()
    : gemm_scratch_(size_t(cpu_threads()) * cpu::sgemm_scratch_floats_max()), gemm_threads_(cpu_threads()) {}

int CpuBackend::gemm_threads() const { return std::min(cpu_threads(), gemm_threads_); }
float* CpuBackend::gemm_scratch(int thread) { return gemm_scratch_.data() + size_t(thread) * cpu::sgemm_scratch_floats_max(); }

// y [N,O] = x [N,I] w^T + b
void CpuBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  const int64_t N = x.dim(0), I = x.dim(1), O = w.dim(0);
  const float* bp = b.defined() ? b.f32() : nullptr;
#pragma omp parallel num_threads(gemm_threads())
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
    if (n1 > n0) {
      cpu::sgemm(false, true, n1 - n0, O, I, 1.f, x.f32() + n0 * I, I, w.f32(), I, 0.f, y.f32() + n0 * O, O,
                 gemm_scratch(t));
      if (bp)
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t o = 0; o < O; ++o) y.f32()[n * O + o] += bp[o];
    }
  }
}

// dx [N,I] (+)= dy [N,O] w [O,I]
void CpuBackend::linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) {
  const int64_t N = dy.dim(0), O = dy.dim(1), I = w.dim(1);
#pragma omp parallel num_threads(gemm_threads())
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
    if (n1 > n0)
      cpu::sgemm(false, false, n1 - n0, I, O, 1.f, dy.f32() + n0 * O, O, w.f32(), I, accumulate ? 1.f : 0.f,
                 dx.f32() + n0 * I, I, gemm_scratch(t));
  }
}

// dw [O,I] (+)= dy^T x; db [O] (+)= sum_n dy. Output rows split over threads.
void CpuBackend::linear_backward_weight(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db, bool accumulate) {
  const int64_t N = x.dim(0), I = x.dim(1), O = dy.dim(1);
#pragma omp parallel num_threads(gemm_threads())
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t o0 = O * t / nt, o1 = O * (t + 1) / nt;
    if (o1 > o0) {
      cpu::sgemm(true, false, o1 - o0, I, N, 1.f, dy.f32() + o0, O, x.f32(), I, accumulate ? 1.f : 0.f,
                 dw.f32() + o0 * I, I, gemm_scratch(t));
      if (db.defined())
        for (int64_t o = o0; o < o1; ++o) {
          float s = 0.f;
          for (int64_t n = 0; n < N; ++n) s += dy.f32()[n * O + o];
          db.f32()[o] = accumulate ? db.f32()[o] + s : s;
        }
    }
  }
}

}  // namespace et
