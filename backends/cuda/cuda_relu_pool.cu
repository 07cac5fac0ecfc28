// Fused stacks without a BN on CUDA (engine/fused_stack.h; the CPU's are backends/cpu/
// fused_relu_pool.cpp): a ReLU, then a max or average pool whose windows do not overlap (VGG
// without BN: conv, ReLU, 2x2 max-pool).
//
// Forward: y = pool(relu(x)) in one pass, the ReLU's output never written (the layers' kernels'
// arithmetic: relu_forward's rule, the first maximum from -FLT_MAX with a strict >, the average's
// sum times 1 / (R * S)); y's bitmap where the stash takes one. Training also writes the pass bits
// (FusedTensors::pass, one 64-bit word run per plane): bit i set where dx[i] takes a gradient,
// relu(x[i]) > 0 and, for a max-pool, i is its window's first maximum. Each input lies in at most
// one window, so these bits are all the backward needs, where the layers keep relu(x), 32 bits an
// element.
// Backward: dx (+)= pass ? +0 + (the pool's gradient: dy of the window, times 1 / (R * S) for an
// average) : +0, as the pool's backward and then relu_backward compute it: the same bits.
#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/cuda_fused_output.h"
#include "backends/cuda/cuda_pool_window.h"
#include "backends/cuda/index_math.h"

namespace et {

namespace {

using cuda_index::idiv;
using cuda_index::imod;

// relu(x) of the plane starting at element base, as relu_kernel computes it.
struct ReluPlane {
  const float* x;
  int64_t base;
  __device__ __forceinline__ float operator()(int64_t i) const {
    const float v = x[base + i];
    return v > 0.f ? v : 0.f;
  }
};

// Output i: the pool of relu(x) over its window (maxpool_forward_kernel's / avgpool_forward_kernel's).
struct ReluPoolOut {
  const float* x;
  cuda_pool::Geom g;
  bool max;
  __device__ __forceinline__ float operator()(int64_t i) const {
    const int64_t plane = idiv(i, g.P * g.Q), p = imod(idiv(i, g.Q), g.P), q = imod(i, g.Q);
    const ReluPlane r{x, plane * g.H * g.W};
    int64_t arg;
    return max ? cuda_pool::max_at(g, r, p, q, &arg) : cuda_pool::avg_at(g, r, p, q);
  }
};

// The output row (column) whose window holds input row (column) i, or -1 (windows do not overlap).
__device__ __forceinline__ int64_t window_of(int64_t i, int64_t stride, int64_t pad, int64_t window, int64_t outputs) {
  const int64_t o = idiv(i + pad, stride);
  return i + pad - o * stride < window && o < outputs ? o : -1;
}

// The pass bits: one thread per element of each plane's word run (planes * wpp * 64 threads, the
// elements past a plane's end unset), 32 bits a ballot, written as the 32-bit halves of the plane's
// 64-bit words (little-endian, as the CPU reads them), so a warp reads 32 neighbouring elements.
__global__ void pass_bits_kernel(const float* x, cuda_pool::Geom g, bool max, int64_t planes, int64_t wpp,
                                 uint32_t* pass32) {
  const int64_t HW = g.H * g.W, run = wpp * 64;
  ET_GRID_STRIDE(k, planes * run) {  // planes * run is a multiple of 64: every warp runs whole
    const int64_t plane = idiv(k, run), i = imod(k, run);
    bool on = false;
    if (i < HW) {
      const ReluPlane r{x, plane * HW};
      on = r(i) > 0.f;
      if (on && max) {  // only the first maximum of the window holding it
        const int64_t h = idiv(i, g.W), w = imod(i, g.W);
        const int64_t p = window_of(h, g.sh, g.ph, g.R, g.P), q = window_of(w, g.sw, g.pw, g.S, g.Q);
        int64_t arg = -1;
        if (p >= 0 && q >= 0) cuda_pool::max_at(g, r, p, q, &arg);
        on = arg == i;
      }
    }
    const unsigned bits = __ballot_sync(0xFFFFFFFFu, on);
    if ((threadIdx.x & 31) == 0) pass32[k / 32] = bits;
  }
}

__global__ void relu_pool_backward_kernel(const uint64_t* pass, const float* dy, cuda_pool::Geom g, bool max,
                                          int64_t n, int64_t wpp, float* dx, bool acc) {
  const int64_t HW = g.H * g.W;
  const float inv = 1.f / float(g.R * g.S);
  ET_GRID_STRIDE(i, n) {
    const int64_t plane = idiv(i, HW), at = imod(i, HW), h = idiv(at, g.W), w = imod(at, g.W);
    const int64_t p = window_of(h, g.sh, g.ph, g.R, g.P), q = window_of(w, g.sw, g.pw, g.S, g.Q);
    float v = 0.f;
    if ((pass[plane * wpp + (at >> 6)] >> (at & 63)) & 1u) {
      if (p >= 0 && q >= 0) {
        const float d = dy[plane * g.P * g.Q + p * g.Q + q];
        v = max ? 0.f + d : 0.f + d * inv;
      }
    }
    dx[i] = acc ? dx[i] + v : v;
  }
}

// The pool stage's window over x's planes.
cuda_pool::Geom relu_pool_geom(const FusedStack& s) {
  const FusedStage& st = s.stages[1];
  return cuda_pool::Geom{s.C, st.H, st.W, st.P, st.Q, st.pool.R, st.pool.S,
                         st.pool.stride_h, st.pool.stride_w, st.pool.pad_h, st.pool.pad_w};
}

void check_form(const FusedStack& s) {
  const bool ok = s.stages.size() == 2 && s.stages[0].kind == FusedKind::Relu &&
                  (s.stages[1].kind == FusedKind::MaxPool || s.stages[1].kind == FusedKind::AvgPool) &&
                  s.stages[1].pool.stride_h >= s.stages[1].pool.R && s.stages[1].pool.stride_w >= s.stages[1].pool.S;
  ET_CHECK(ok, "cuda: a fused stack without a BN is a ReLU, then a pool whose windows do not overlap");
}

}  // namespace

void CudaBackend::relu_pool_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask) {
  check_form(s);
  const cuda_pool::Geom g = relu_pool_geom(s);
  const bool max = s.stages[1].kind == FusedKind::MaxPool;
  const int64_t planes = t.x.dim(0) * s.C, wpp = pass_words_per_plane(s.stages[0]), n = t.y.numel();
  ET_CHECK(t.x.dtype == DType::F32, "cuda: fused stack x dtype ", dtype_name(t.x.dtype));
  const cuda::OutputMask m = output_mask(training ? mask : nullptr, n);  // y = pool(relu(x)) >= +0
  cuda::fused_forward_kernel<<<cuda::output_blocks(n, m), 256, 0, stream_>>>(ReluPoolOut{t.x.f32(), g, max}, n,
                                                                              t.y.f32(), m);
  cuda::launched("fused_forward (ReLU, pool)");
  if (m.bits32) take_mask_count(*mask);
  if (!training) return;
  ET_CHECK(t.pass.defined() && t.pass.nbytes() >= size_t(planes * wpp * 8), "cuda: fused stack pass bits");
  pass_bits_kernel<<<cuda::blocks_for(planes * wpp * 64), cuda::kThreads, 0, stream_>>>(
      t.x.f32(), g, max, planes, wpp, static_cast<uint32_t*>(t.pass.data));
  cuda::launched("fused_forward (pass bits)");
}

void CudaBackend::relu_pool_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g) {
  check_form(s);
  if (!g.dx.defined()) return;
  const int64_t wpp = pass_words_per_plane(s.stages[0]), n = g.dx.numel();
  relu_pool_backward_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, stream_>>>(
      static_cast<const uint64_t*>(t.pass.data), g.dy.f32(), relu_pool_geom(s), s.stages[1].kind == FusedKind::MaxPool,
      n, wpp, g.dx.f32(), g.dx_accumulate);
  cuda::launched("fused_backward (ReLU, pool)");
}

}  // namespace et
