// Batch norm on CUDA: P blocks per channel reduce its N planes (double accumulators, as the CPU
// does, in another order: results agree to rounding), then applies the CPU's coefficients
// (backends/cpu/batchnorm.cpp: train / eval scale and shift, the backward's a * dy + b * x + c0).
//
// The fused stacks it heads (engine/fused_stack.h, FusionSpec::whole_tensors): BN -> ReLU [->
// max-pool | average pool | global average pool], BN -> add [-> ReLU], in two passes forward (the statistics, then y with its bitmap) and
// two backward (the sums, writing the side gradient on the way, then dx), where the layers take
// four to six. A folded side BN (a projection shortcut's, FusedStack::side_bn) adds its statistics
// pass forward and its sums backward; the apply passes write y, and dx with x2's gradient, once. Each pass runs the layers' own kernels (the same templates: the same reductions in
// the same order, the same expressions, cuda_pool_window.h's windows and plane sums), with BN's output and its
// gradient dz computed in registers instead of read from memory: fused and unfused give the same
// bits. The backward (the layer's and the stacks') reads x as the stash keeps it (fp16 / bf16,
// cuda_stored_x.h), without a decode buffer. A BN -> ReLU stack's output need not be kept
// (memory.recompute_stack_outputs): its readers compute it from x (fused_affine_coefficients, then
// cuda_stored_x.h's AffineReluX) or have it recomputed into a buffer (fused_recompute_output), and
// where nothing of it is kept its backward finds the ReLU's mask from x the same way.
#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/cuda_fused_output.h"
#include "backends/cuda/cuda_pool_window.h"
#include "backends/cuda/cuda_stored_x.h"
#include "backends/cuda/index_math.h"
#include "memory/bitmap.h"

namespace et {

namespace {

constexpr int kBnThreads = 256;
using cuda_index::idiv;  // (backends/cuda/index_math.h: 32-bit divisions where they fit)
using cuda_index::imod;
using cuda::fused_forward_kernel;

// Block-wide sums of two doubles; every thread gets them.
__device__ void block_sum2(double& a, double& b) {
  __shared__ double sa[kBnThreads], sb[kBnThreads];
  sa[threadIdx.x] = a;
  sb[threadIdx.x] = b;
  __syncthreads();
  for (int s = kBnThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      sa[threadIdx.x] += sa[threadIdx.x + s];
      sb[threadIdx.x] += sb[threadIdx.x + s];
    }
    __syncthreads();
  }
  a = sa[0];
  b = sb[0];
  __syncthreads();
}

// The reductions are split over P blocks per channel, each over a fixed run of images, so that
// a layer of 16 channels still fills the GPU (one block per channel left 116 of an H200's 132 SMs
// idle: BN was a third of a ResNet-20 step); the partials are summed in a fixed order
// (deterministic, no atomics). P: about 1024 blocks in all, at most one per image.
int64_t parts_for(int64_t N, int64_t C) {
  const int64_t p = (1024 + C - 1) / C;
  return p < 1 ? 1 : p > N ? N : p;
}

// The gradient of BN's output at element i: the layer's dy, or a fused stack's dz = dy where its
// last ReLU passed (its bitmap, memory/bitmap.h's layout read as 32-bit words, or y itself), else
// +0 (relu_backward's rule, cuda_elementwise.cu).
struct OutputGrad {
  const float* dy = nullptr;
  const uint32_t* bits = nullptr;
  const float* y = nullptr;
  __device__ __forceinline__ float operator()(int64_t i) const {
    if (bits) return (bits[i / 32] >> (i % 32)) & 1u ? dy[i] : 0.f;
    if (y) return y[i] > 0.f ? dy[i] : 0.f;
    return dy[i];
  }
};

// Block (c, part): the sums of x and x^2 over channel c of images [N * part / P, N * (part + 1) / P).
__global__ void bn_partials_kernel(const float* x, int64_t N, int64_t C, int64_t HW, int64_t P, double* partials) {
  const int64_t c = blockIdx.x, part = blockIdx.y;
  const int64_t n0 = N * part / P, n1 = N * (part + 1) / P, M = (n1 - n0) * HW;
  double a = 0, b = 0;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const float v = x[((n0 + idiv(j, HW)) * C + c) * HW + imod(j, HW)];
    a += v;
    b += double(v) * double(v);
  }
  block_sum2(a, b);
  if (threadIdx.x == 0) {
    partials[(c * P + part) * 2] = a;
    partials[(c * P + part) * 2 + 1] = b;
  }
}

// The backward's: the sums of dz and dz * (x - mean), dz = grad(i). A fused stack's add hands dz to
// its side input on the way (dside, added where side_acc: accumulate_grad's rule).
// X (here and in the backward's other kernels): const float*, or cuda::StoredX (x as the stash
// keeps it, batchnorm_backward_reads: fp16 or bf16, widened exactly as the decode would).
template <class Grad, class X>
__global__ void bn_grad_partials_kernel(Grad grad, X x, const float* mean, int64_t N, int64_t C,
                                        int64_t HW, int64_t P, double* partials, float* dside, bool side_acc) {
  const int64_t c = blockIdx.x, part = blockIdx.y;
  const int64_t n0 = N * part / P, n1 = N * (part + 1) / P, M = (n1 - n0) * HW;
  double a = 0, b = 0;
  const float mu = mean[c];
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const int64_t at = ((n0 + idiv(j, HW)) * C + c) * HW + imod(j, HW);
    const float dz = grad(at);
    if (dside) dside[at] = side_acc ? dside[at] + dz : dz;
    a += dz;
    b = __fma_rn(double(dz), double(x[at] - mu), b);
  }
  block_sum2(a, b);
  if (threadIdx.x == 0) {
    partials[(c * P + part) * 2] = a;
    partials[(c * P + part) * 2 + 1] = b;
  }
}

// y = x * scale + shift's coefficients from the batch statistics (train) or the running ones
// (eval): one definition for the layers and the fused stacks, so both round alike.
// Rounding here and in the kernels is written out (__fmaf_rn, __fmul_rn, __fadd_rn): the layers
// and the fused stacks run different instantiations of the same templates, and where an expression
// holds two products nvcc's contraction may fuse either one. Spelled out, both round as the CPU's
// row kernels do (batchnorm_rows.h: x * scale + shift one FMA; the backward's (a * d + b * x) + c0
// one multiply, one FMA, one add).
__device__ __forceinline__ void train_coefficients(float gamma, float beta, float mean, float invstd, float* scale,
                                                   float* shift) {
  const float k = gamma * invstd;
  *scale = k;
  *shift = __fmaf_rn(-mean, k, beta);
}
__device__ __forceinline__ void eval_coefficients(float gamma, float beta, float rm, float rv, float eps, float* scale,
                                                  float* shift) {
  const float k = gamma / sqrtf(rv + eps);
  *scale = k;
  *shift = __fmaf_rn(-rm, k, beta);
}

// Channel c's forward statistics, running statistics and coefficients (coef[c] = scale, coef[C + c] = shift).
__global__ void bn_train_coefficients_kernel(const double* partials, int64_t P, int64_t C, int64_t M,
                                             const float* gamma, const float* beta, float* running_mean,
                                             float* running_var, float momentum, float eps, float* mean,
                                             float* invstd, float* coef) {
  ET_GRID_STRIDE(c, C) {
    double s = 0, ss = 0;
    for (int64_t p = 0; p < P; ++p) s += partials[(c * P + p) * 2], ss += partials[(c * P + p) * 2 + 1];
    const double mu = s / double(M);
    const double var = fmax(0.0, ss / double(M) - mu * mu);
    const float m = float(mu), is = float(1.0 / sqrt(var + double(eps)));
    mean[c] = m;
    invstd[c] = is;
    if (running_mean) {
      const double unbiased = M > 1 ? var * double(M) / double(M - 1) : var;
      running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * m;
      running_var[c] = (1.f - momentum) * running_var[c] + momentum * float(unbiased);
    }
    train_coefficients(gamma[c], beta[c], m, is, &coef[c], &coef[C + c]);
  }
}

// y = relu(x * scale + shift) of a BN -> ReLU stack again from its x (memory.recompute_stack_outputs),
// as ElementwiseOut computed it in the forward (coef: the forward's scale [C], shift [C]).
template <class X>
__global__ void bn_relu_recompute_kernel(X x, const float* coef, int64_t n, int64_t C, int64_t HW, float* y) {
  const cuda::AffineReluX<X> v{x, coef, coef + C, C, HW};
  ET_GRID_STRIDE(i, n) y[i] = v[i];
}

// The same coefficients from the statistics a training forward left (a fused stack's backward, its
// output's readers): scale [C], shift [C].
__global__ void bn_saved_coefficients_kernel(int64_t C, const float* gamma, const float* beta, const float* mean,
                                             const float* invstd, float* scale, float* shift) {
  ET_GRID_STRIDE(c, C) train_coefficients(gamma[c], beta[c], mean[c], invstd[c], &scale[c], &shift[c]);
}

__global__ void bn_frozen_backward_kernel(const float* dy, int64_t n_total, int64_t C, int64_t HW, const float* gamma,
                                          const float* rv, float eps, float* dx, bool acc) {
  ET_GRID_STRIDE(i, n_total) {
    const int64_t c = imod(idiv(i, HW), C);
    const float v = dy[i] * (gamma[c] / sqrtf(rv[c] + eps));
    dx[i] = acc ? dx[i] + v : v;
  }
}

// Channel c's dgamma, dbeta and its dx coefficients: dx = a * dy + b * x + c0 (coef[c], [C + c], [2C + c]).
__global__ void bn_backward_coefficients_kernel(const double* partials, int64_t P, int64_t C, int64_t M,
                                                const float* gamma, const float* mean, const float* invstd,
                                                float* dgamma, float* dbeta, bool acc_params, float* coef) {
  ET_GRID_STRIDE(c, C) {
    double sdy = 0, sdyx = 0;
    for (int64_t p = 0; p < P; ++p) sdy += partials[(c * P + p) * 2], sdyx += partials[(c * P + p) * 2 + 1];
    const float mu = mean[c], is = invstd[c];
    const float db = float(sdy), dg = float(sdyx) * is;
    const float g = gamma[c] * is / float(M), k = dg * is;
    coef[c] = g * float(M);
    coef[C + c] = -g * k;
    coef[2 * C + c] = -g * db + g * mu * k;
    if (dbeta) dbeta[c] = acc_params ? dbeta[c] + db : db;
    if (dgamma) dgamma[c] = acc_params ? dgamma[c] + dg : dg;
  }
}

// A folded side BN's part of the second sweep (FusedStack::side_bn): dx2 (+)= a2 * dz + b2 * x2 + c2
// with its own coefficients (coef [3C]), from the same dz; dx2 null: none.
struct SideApply {
  const float* x2 = nullptr;
  const float* coef = nullptr;
  float* dx2 = nullptr;
  bool acc = false;
};

// dx (where not null) and the side BN's dx2. dx may be dy's buffer (a fused stack's,
// Op::grad_in_place): each element of dy is read, once, before dx's is written.
template <class Grad, class X>
__global__ void bn_backward_apply_kernel(Grad grad, X x, int64_t n_total, int64_t C, int64_t HW,
                                         const float* coef, float* dx, bool acc, SideApply side) {
  ET_GRID_STRIDE(i, n_total) {
    const int64_t c = imod(idiv(i, HW), C);
    const float dz = grad(i);
    if (side.dx2) {
      const float* k = side.coef;
      const float v2 = __fadd_rn(__fmaf_rn(k[c], dz, __fmul_rn(k[C + c], side.x2[i])), k[2 * C + c]);
      side.dx2[i] = side.acc ? side.dx2[i] + v2 : v2;
    }
    if (!dx) continue;
    const float v = __fadd_rn(__fmaf_rn(coef[c], dz, __fmul_rn(coef[C + c], x[i])), coef[2 * C + c]);
    dx[i] = acc ? dx[i] + v : v;
  }
}

// relu(x * scale + shift) of one plane, as ElementwiseOut and relu_kernel compute it: a fused
// BN -> ReLU -> max-pool's pool input, never written.
template <class X>
struct BnReluPlane {
  X x;
  int64_t base;  // the plane's first element
  float scale, shift;
  __device__ __forceinline__ float operator()(int64_t i) const {
    const float v = __fmaf_rn(x[base + i], scale, shift);
    return v > 0.f ? v : 0.f;
  }
};

// Channel c's scale and shift: coef's (training: the batch statistics'), else the running ones'.
struct ChannelCoefficients {
  const float *coef, *gamma, *beta, *rm, *rv;
  float eps;
  int64_t C;
  __device__ __forceinline__ void of(int64_t c, float* scale, float* shift) const {
    if (coef) {
      *scale = coef[c];
      *shift = coef[C + c];
    } else {
      eval_coefficients(gamma[c], beta[c], rm[c], rv[c], eps, scale, shift);
    }
  }
};

// Output i of the BN layer (no side, no relu) or a fused BN -> [add] [-> ReLU]: x * scale +
// shift, + side as add_kernel, then max(., 0) as relu_kernel. With side_bn (a folded side BN) the
// side is x2 * scale2 + shift2 first, as that BN layer computes it.
struct ElementwiseOut {
  const float *x, *side;
  ChannelCoefficients k;
  int64_t HW;
  bool relu;
  bool side_bn;
  ChannelCoefficients side_k;
  __device__ __forceinline__ float operator()(int64_t i) const {
    const int64_t c = imod(idiv(i, HW), k.C);
    float scale, shift;
    k.of(c, &scale, &shift);
    float v = __fmaf_rn(x[i], scale, shift);
    if (side) {
      float other = side[i];
      if (side_bn) {
        side_k.of(c, &scale, &shift);
        other = __fmaf_rn(other, scale, shift);
      }
      v = v + other;
    }
    if (relu) v = v > 0.f ? v : 0.f;
    return v;
  }
};

// Output i of a fused BN -> ReLU -> max-pool or average pool: its window's first maximum, as
// maxpool_forward_kernel, or its mean, as avgpool_forward_kernel.
struct PooledOut {
  const float* x;
  ChannelCoefficients k;
  cuda_pool::Geom g;
  bool max;
  __device__ __forceinline__ float operator()(int64_t i) const {
    const int64_t plane = idiv(i, g.P * g.Q), p = imod(idiv(i, g.Q), g.P), q = imod(i, g.Q);
    float scale, shift;
    k.of(imod(plane, k.C), &scale, &shift);
    const BnReluPlane<const float*> v{x, plane * g.H * g.W, scale, shift};
    int64_t arg;
    return max ? cuda_pool::max_at(g, v, p, q, &arg) : cuda_pool::avg_at(g, v, p, q);
  }
};

// dz of a fused BN -> ReLU -> pool at input i: where its ReLU passed, what the windows send it
// (maxpool_backward_kernel's sum over the windows it won, or avgpool_backward_kernel's over those
// covering it; then relu_backward's mask: the ReLU's output > 0), the pool's input found again
// from x with the forward's coefficients (coef: scale [C], shift [C]).
template <class X>
struct PooledGrad {
  X x;
  const float *coef, *dy;
  cuda_pool::Geom g;
  bool max;
  __device__ __forceinline__ float operator()(int64_t i) const {
    const int64_t HW = g.H * g.W, plane = idiv(i, HW), c = imod(plane, g.C), at = imod(i, HW);
    const BnReluPlane<X> v{x, plane * HW, coef[c], coef[g.C + c]};
    if (!(v(at) > 0.f)) return 0.f;
    const float* dyp = dy + plane * g.P * g.Q;
    return max ? cuda_pool::max_gradient(g, v, dyp, idiv(at, g.W), imod(at, g.W), 0.f)
               : cuda_pool::avg_gradient(g, dyp, idiv(at, g.W), imod(at, g.W), 0.f);
  }
};

// The forward of a BN -> ReLU -> global average pool over its n = N * C planes of HW: y[plane] =
// the plane's sum (cuda_pool::warp_plane_sum, global_avg_forward_kernel's order) / HW. A block
// step takes 32 outputs (a word of y's bitmap, written by warp 0's ballot as relu_mask_kernel's
// layout has it), each of its 8 warps 4 of their planes, all lanes on each plane.
constexpr int kGlobalPoolWarps = 8;
__global__ void bn_relu_global_pool_kernel(const float* x, ChannelCoefficients k, int64_t n, int64_t HW, float* y,
                                           cuda::OutputMask m) {
  __shared__ float means[32];
  unsigned long long local = 0;
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x / 32);
  const int64_t groups = m.bits32 ? m.words32 : (n + 31) / 32;
  for (int64_t group = blockIdx.x; group < groups; group += gridDim.x) {
    for (int j = warp; j < 32; j += kGlobalPoolWarps) {
      const int64_t plane = group * 32 + j;
      float mean = 0.f;
      if (plane < n) {  // the same on every lane of the warp
        float scale, shift;
        k.of(imod(plane, k.C), &scale, &shift);
        const float s = cuda_pool::warp_plane_sum(BnReluPlane<const float*>{x, plane * HW, scale, shift}, HW, lane);
        mean = s / float(HW);
      }
      if (lane == 0) means[j] = mean;
    }
    __syncthreads();
    if (warp == 0) {
      const int64_t i = group * 32 + lane;
      const float v = means[lane];
      if (i < n) y[i] = v;
      if (m.bits32) {
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, i < n && __float_as_uint(v) >= m.threshold);
        if (lane == 0) {
          m.bits32[group] = ballot;
          local += __popc(ballot);
        }
      }
    }
    __syncthreads();  // means[] is the next step's
  }
  if (local) atomicAdd(m.kept, local);
}
// Its blocks: one a group of 32 outputs (or bitmap word), at most 65535 (the rest by grid stride).
unsigned global_pool_blocks(int64_t n, const cuda::OutputMask& m) {
  const int64_t groups = m.bits32 ? m.words32 : (n + 31) / 32;
  return unsigned(groups < 1 ? 1 : groups > 65535 ? 65535 : groups);
}

// dz of a BN -> ReLU -> global average pool at input i: where its ReLU passed, its plane's dy / HW
// (global_avg_backward_kernel's, then relu_backward's mask), the ReLU's output found again from x.
template <class X>
struct GlobalPooledGrad {
  X x;
  const float *coef, *dy;
  int64_t C, HW;
  __device__ __forceinline__ float operator()(int64_t i) const {
    const int64_t plane = idiv(i, HW), c = imod(plane, C);
    const float v = __fmaf_rn(x[i], coef[c], coef[C + c]);
    return v > 0.f ? dy[plane] / float(HW) : 0.f;
  }
};

// dz of a BN -> ReLU stack whose output its readers compute (memory.recompute_stack_outputs:
// nothing of y kept, not even its mask): dy where y > 0, y found again from x as the readers find it.
template <class X>
struct ReluFromXGrad {
  cuda::AffineReluX<X> y;
  const float* dy;
  __device__ __forceinline__ float operator()(int64_t i) const { return y[i] > 0.f ? dy[i] : 0.f; }
};

float* opt(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

// Training statistics of x [N, C, HW] (partials: C * P * 2 doubles): the batch mean and invstd,
// the running statistics where given, y's coefficients into coef [2C]. The layer's and the stacks'.
void train_statistics(cudaStream_t stream, const float* x, int64_t N, int64_t C, int64_t HW, double* partials,
                      const float* gamma, const float* beta, float* running_mean, float* running_var, float momentum,
                      float eps, float* mean, float* invstd, float* coef) {
  const int64_t P = parts_for(N, C);
  bn_partials_kernel<<<dim3(unsigned(C), unsigned(P)), kBnThreads, 0, stream>>>(x, N, C, HW, P, partials);
  cuda::launched("batchnorm statistics (sums)");
  bn_train_coefficients_kernel<<<cuda::blocks_for(C), cuda::kThreads, 0, stream>>>(
      partials, P, C, N * HW, gamma, beta, running_mean, running_var, momentum, eps, mean, invstd, coef);
  cuda::launched("batchnorm statistics (coefficients)");
}

// The backward's two passes over x [N, C, HW] (X: f32 or stored) with BN's output gradient
// `grad`: the sums (dz to the side input on the way, where dside), dgamma / dbeta and dx's
// coefficients (coef [3C]), then dx (where wanted). The layer's and the stacks'.
struct BackwardArgs {
  const float *gamma, *mean, *invstd;
  int64_t N, C, HW;
  double* partials;
  float* coef;
  float *dgamma, *dbeta;
  bool params_acc;
  float* dx;
  bool dx_acc;
  float* dside;
  bool side_acc;
};
// The sums and coefficients of one BN (the first sweep).
template <class Grad, class X>
void backward_sums(cudaStream_t stream, const Grad& grad, const X& x, const BackwardArgs& a) {
  const int64_t P = parts_for(a.N, a.C);
  bn_grad_partials_kernel<<<dim3(unsigned(a.C), unsigned(P)), kBnThreads, 0, stream>>>(
      grad, x, a.mean, a.N, a.C, a.HW, P, a.partials, a.dside, a.side_acc);
  cuda::launched("batchnorm backward (sums)");
  bn_backward_coefficients_kernel<<<cuda::blocks_for(a.C), cuda::kThreads, 0, stream>>>(
      a.partials, P, a.C, a.N * a.HW, a.gamma, a.mean, a.invstd, a.dgamma, a.dbeta, a.params_acc, a.coef);
  cuda::launched("batchnorm backward (coefficients)");
}
// side: a folded side BN's arguments (its x2, statistics, parameters' gradients, dx2 in dx), or
// null. Its sums come from the same dz as the head's, as its layer's from the add's gradient.
template <class Grad, class X>
void backward_sweeps(cudaStream_t stream, const Grad& grad, const X& x, const BackwardArgs& a,
                     const BackwardArgs* side = nullptr, const float* x2 = nullptr) {
  backward_sums(stream, grad, x, a);
  SideApply sa;
  if (side) {
    backward_sums(stream, grad, x2, *side);
    sa = SideApply{x2, side->coef, side->dx, side->dx_acc};
  }
  if (!a.dx && !sa.dx2) return;
  const int64_t n = a.N * a.C * a.HW;
  bn_backward_apply_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, stream>>>(grad, x, n, a.C, a.HW, a.coef, a.dx,
                                                                               a.dx_acc, sa);
  cuda::launched("batchnorm backward (apply)");
}

}  // namespace

double* CudaBackend::bn_scratch(int64_t doubles) {
  if (doubles > bn_scratch_capacity_) {
    cudaFree(bn_scratch_);
    bn_scratch_ = nullptr;
    bn_scratch_capacity_ = 0;
    bn_scratch_ = cuda_allocate_array<double>(size_t(doubles), "batch norm's scratch");
    bn_scratch_capacity_ = doubles;
    ++record_generation_;  // a recorded step holds the old buffer
  }
  return bn_scratch_;
}

void CudaBackend::batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                          Tensor& running_mean, Tensor& running_var, float momentum, float eps,
                                          Tensor& y, Tensor& mean, Tensor& invstd) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), P = parts_for(N, C);
  double* partials = bn_scratch(C * P * 2 + 2 * C);  // then the coefficients, 2C floats in C doubles' room
  float* coef = reinterpret_cast<float*>(partials + C * P * 2);
  train_statistics(stream_, x.f32(), N, C, HW, partials, gamma.f32(), beta.f32(), opt(running_mean),
                   opt(running_var), momentum, eps, mean.f32(), invstd.f32(), coef);
  const ChannelCoefficients k{coef, nullptr, nullptr, nullptr, nullptr, eps, C};
  fused_forward_kernel<<<cuda::blocks_for(x.numel()), 256, 0, stream_>>>(
      ElementwiseOut{x.f32(), nullptr, k, HW, false, false, k}, x.numel(), y.f32(), cuda::OutputMask{});
  cuda::launched("batchnorm_forward_train (apply)");
}

void CudaBackend::batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         const Tensor& running_mean, const Tensor& running_var, float eps, Tensor& y) {
  const int64_t C = x.dim(1), HW = x.dim(2) * x.dim(3);
  const ChannelCoefficients k{nullptr, gamma.f32(), beta.f32(), running_mean.f32(), running_var.f32(), eps, C};
  fused_forward_kernel<<<cuda::blocks_for(x.numel()), 256, 0, stream_>>>(
      ElementwiseOut{x.f32(), nullptr, k, HW, false, false, k}, x.numel(), y.f32(), cuda::OutputMask{});
  cuda::launched("batchnorm_forward_eval");
}

// As the CPU's (backends/cpu/cpu_backend.h): the bitmaps, kept for sparse values, are not a BN
// input's encoding there.
DTypeSet CudaBackend::batchnorm_backward_reads() const {
  return dtype_bit(DType::F32) | dtype_bit(DType::F16) | dtype_bit(DType::BF16);
}

void CudaBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                     const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma,
                                     Tensor& dbeta, bool accumulate_params) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), P = parts_for(N, C);
  double* partials = bn_scratch(C * P * 2 + 2 * C);  // then the coefficients, 3C floats in 2C doubles' room
  OutputGrad grad;
  grad.dy = dy.f32();
  const BackwardArgs args{gamma.f32(), mean.f32(), invstd.f32(), N, C, HW, partials,
                          reinterpret_cast<float*>(partials + C * P * 2), opt(dgamma), opt(dbeta),
                          accumulate_params, opt(dx), accumulate_dx, nullptr, false};
  ET_CHECK(dtype_in(x.dtype, batchnorm_backward_reads()), "batchnorm_backward: x dtype ", dtype_name(x.dtype));
  cuda::with_stored_x(x, *codec_, "batchnorm_backward", [&](auto xs) { backward_sweeps(stream_, grad, xs, args); });
}

void CudaBackend::batchnorm_backward_frozen(const Tensor& dy, const Tensor& gamma, const Tensor& running_var, float eps,
                                            Tensor& dx, bool accumulate) {
  const int64_t C = dy.dim(1), HW = dy.dim(2) * dy.dim(3);
  bn_frozen_backward_kernel<<<cuda::blocks_for(dy.numel()), cuda::kThreads, 0, stream_>>>(
      dy.f32(), dy.numel(), C, HW, gamma.f32(), running_var.f32(), eps, dx.f32(), accumulate);
  cuda::launched("batchnorm_backward_frozen");
}

// ---- fused stacks (FusionSpec::whole_tensors) ----

namespace {
// The stacks this backend runs (FusionSpec::whole_tensors): BN, then ReLU [-> max-pool | average
// pool | global average pool] or add [-> ReLU], the add's other operand a folded side BN's output
// or not (side_bn), nothing handed on.
struct StackForm {
  bool add = false, relu = false, pool = false, max = false, global = false, side_bn = false;
};
StackForm stack_form(const FusedStack& s) {
  const size_t n = s.stages.size();
  const FusedKind k1 = n > 1 ? s.stages[1].kind : FusedKind::None, k2 = n > 2 ? s.stages[2].kind : FusedKind::None;
  const bool pooled = k2 == FusedKind::MaxPool || k2 == FusedKind::AvgPool || k2 == FusedKind::GlobalAvgPool;
  const bool ok = s.headed_by_bn() && n >= 2 && n <= 3 &&
                  (n == 2 ? k1 == FusedKind::Relu || k1 == FusedKind::Add
                          : (k1 == FusedKind::Add && k2 == FusedKind::Relu) || (k1 == FusedKind::Relu && pooled));
  ET_CHECK(ok, "cuda: a fused stack of other stages than BN -> ReLU [-> pool] or BN -> add [-> ReLU] (plan it "
               "with FusionSpec::whole_tensors)");
  StackForm f;
  f.add = s.add_stage() >= 0;
  f.relu = s.last().kind == FusedKind::Relu;
  f.pool = s.last().kind == FusedKind::MaxPool || s.last().kind == FusedKind::AvgPool;
  f.max = s.last().kind == FusedKind::MaxPool;
  f.global = s.last().kind == FusedKind::GlobalAvgPool;
  f.side_bn = s.side_bn;
  ET_CHECK(!f.side_bn || f.add, "cuda: a folded side BN without an add");
  return f;
}

// bn_scratch's room for a stack: the head BN's partials (C * P * 2 doubles), a folded side BN's,
// then floats: the head's coefficients (3C: the backward's; the forward's 2C), a pool's forward
// coefficients in the backward (2C), the side BN's (3C).
struct StackScratch {
  double *partials, *side_partials;
  float *coef, *pool_coef, *side_coef;
};
int64_t stack_scratch_doubles(const StackForm& f, int64_t C, int64_t P) { return C * P * 2 * (f.side_bn ? 2 : 1) + 4 * C; }
StackScratch stack_scratch(double* room, const StackForm& f, int64_t C, int64_t P) {
  StackScratch r;
  r.partials = room;
  r.side_partials = room + C * P * 2;
  r.coef = reinterpret_cast<float*>(room + C * P * 2 * (f.side_bn ? 2 : 1));
  r.pool_coef = r.coef + 3 * C;
  r.side_coef = r.coef + 5 * C;
  return r;
}
// The pool stage's window over x's planes.
cuda_pool::Geom pool_geom(const FusedStack& s) {
  const FusedStage& st = s.last();
  return cuda_pool::Geom{s.C, st.H, st.W, st.P, st.Q, st.pool.R, st.pool.S,
                         st.pool.stride_h, st.pool.stride_w, st.pool.pad_h, st.pool.pad_w};
}
}  // namespace

size_t CudaBackend::fused_workspace_bytes(const FusedStack&, int64_t) const { return 0; }  // bn_scratch

cuda::OutputMask CudaBackend::output_mask(MaskOut* mask, int64_t n) {
  cuda::OutputMask m;
  if (!mask || !mask->bits) return m;
  ET_CHECK(mask->prune_threshold >= 0.f, "prune threshold ", mask->prune_threshold);
  m.threshold = bitmap::keep_threshold_bits(mask->prune_threshold);
  m.bits32 = reinterpret_cast<uint32_t*>(mask->bits);
  m.words32 = (n + 63) / 64 * 2;
  m.kept = counter();
  return m;
}

void CudaBackend::fused_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace) {
  if (!s.headed_by_bn()) return relu_pool_forward(s, t, training, mask);
  const StackForm f = stack_form(s);
  ET_CHECK(!t.x_sums.defined() && !t.y_sums.defined() && !t.side_x_sums.defined(),
           "cuda: fused stacks take no plane sums");
  ET_CHECK(t.x.dtype == DType::F32 && (!f.add || t.side.dtype == DType::F32), "cuda: fused stack inputs");
  const FusedStage &bn = s.stages[0], &bn2 = s.side_stage;
  const int64_t N = t.x.dim(0), C = s.C, HW = t.x.dim(2) * t.x.dim(3), P = parts_for(N, C), n = t.y.numel();
  // The layers' statistics, coefficients and running statistics (training), else the running
  // statistics' coefficients: the head BN's and a folded side BN's (of x2, in t.side).
  ChannelCoefficients k{nullptr, t.gamma.f32(), t.beta.f32(), nullptr, nullptr, bn.eps, C};
  ChannelCoefficients k2{nullptr, opt(t.side_gamma), opt(t.side_beta), nullptr, nullptr, bn2.eps, C};
  if (training) {
    const StackScratch room = stack_scratch(bn_scratch(stack_scratch_doubles(f, C, P)), f, C, P);
    train_statistics(stream_, t.x.f32(), N, C, HW, room.partials, t.gamma.f32(), t.beta.f32(), opt(t.running_mean),
                     opt(t.running_var), bn.momentum, bn.eps, t.mean.f32(), t.invstd.f32(), room.coef);
    k.coef = room.coef;
    if (f.side_bn) {
      train_statistics(stream_, t.side.f32(), N, C, HW, room.side_partials, t.side_gamma.f32(), t.side_beta.f32(),
                       opt(t.side_running_mean), opt(t.side_running_var), bn2.momentum, bn2.eps, t.side_mean.f32(),
                       t.side_invstd.f32(), room.side_coef);
      k2.coef = room.side_coef;
    }
  } else {
    k.rm = t.running_mean.f32();
    k.rv = t.running_var.f32();
    k2.rm = opt(t.side_running_mean);
    k2.rv = opt(t.side_running_var);
  }
  // y's bitmap where the stash (or the stack's aux) asks for it, relu_forward's way.
  const cuda::OutputMask m = output_mask(training && (f.relu || f.pool || f.global) ? mask : nullptr, n);
  const unsigned blocks = cuda::output_blocks(n, m);
  if (f.pool)
    fused_forward_kernel<<<blocks, 256, 0, stream_>>>(PooledOut{t.x.f32(), k, pool_geom(s), f.max}, n, t.y.f32(), m);
  else if (f.global)
    bn_relu_global_pool_kernel<<<global_pool_blocks(n, m), kGlobalPoolWarps * 32, 0, stream_>>>(t.x.f32(), k, n, HW,
                                                                                             t.y.f32(), m);
  else
    fused_forward_kernel<<<blocks, 256, 0, stream_>>>(
        ElementwiseOut{t.x.f32(), f.add ? t.side.f32() : nullptr, k, HW, f.relu, f.side_bn, k2}, n, t.y.f32(), m);
  cuda::launched("fused_forward (apply)");
  if (m.bits32) take_mask_count(*mask);
}

// BN -> ReLU: y is the forward's FMA with its channel's coefficients (from the statistics the
// forward left, computed as the forward computed them), then the ReLU: bit for bit where x is exact.
bool CudaBackend::fused_recomputes(const FusedStack& s) const {
  return s.headed_by_bn() && s.stages.size() == 2 && s.stages[1].kind == FusedKind::Relu && !s.side_bn;
}

void CudaBackend::fused_recompute_output(const FusedStack& s, const FusedTensors& t, Tensor& y) {
  ET_CHECK(fused_recomputes(s), "cuda: no output recompute for this fused stack");
  const int64_t N = t.x.dim(0), C = s.C, HW = t.x.dim(2) * t.x.dim(3), n = N * C * HW;
  ET_CHECK(y.numel() == n && y.dtype == DType::F32, "cuda: fused stack recompute into ", y.shape.str());
  ET_CHECK(dtype_in(t.x.dtype, fused_backward_reads()), "cuda: fused stack x dtype ", dtype_name(t.x.dtype));
  // The forward's room in bn_scratch is at least C doubles (2C floats) already: no growth here,
  // inside another node's backward or a record.
  float* coef = reinterpret_cast<float*>(bn_scratch(C));
  bn_saved_coefficients_kernel<<<cuda::blocks_for(C), cuda::kThreads, 0, stream_>>>(
      C, t.gamma.f32(), t.beta.f32(), t.mean.f32(), t.invstd.f32(), coef, coef + C);
  cuda::launched("fused_recompute_output (coefficients)");
  cuda::with_stored_x(t.x, *codec_, "fused_recompute_output", [&](auto xs) {
    bn_relu_recompute_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, stream_>>>(xs, coef, n, C, HW, y.f32());
  });
  cuda::launched("fused_recompute_output");
}

// Its readers' coefficients (fused_output_is_affine_relu): the forward's, from the statistics it
// left, into scale / shift in device memory (the executor's).
void CudaBackend::fused_affine_coefficients(const FusedStack& s, const FusedTensors& t, float* scale, float* shift) {
  ET_CHECK(fused_recomputes(s), "cuda: no relu(affine) output for this fused stack");
  bn_saved_coefficients_kernel<<<cuda::blocks_for(s.C), cuda::kThreads, 0, stream_>>>(
      s.C, t.gamma.f32(), t.beta.f32(), t.mean.f32(), t.invstd.f32(), scale, shift);
  cuda::launched("fused_affine_coefficients");
}

void CudaBackend::fused_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace) {
  if (!s.headed_by_bn()) return relu_pool_backward(s, t, g);
  const StackForm f = stack_form(s);
  ET_CHECK(!g.dz_sums.defined() && !g.dy_coef.defined() && !g.dx_coef.defined(),
           "cuda: a fused stack's sweep done elsewhere");
  ET_CHECK(dtype_in(t.x.dtype, fused_backward_reads()), "cuda: fused stack x dtype ", dtype_name(t.x.dtype));
  const int64_t N = t.x.dim(0), C = s.C, HW = t.x.dim(2) * t.x.dim(3), P = parts_for(N, C);
  const StackScratch room = stack_scratch(bn_scratch(stack_scratch_doubles(f, C, P)), f, C, P);
  // The add's gradient dz goes to its side input in the first sweep; with a folded side BN that
  // input is x2 and dside its gradient, which the side BN's second sweep writes.
  const BackwardArgs args{t.gamma.f32(), t.mean.f32(), t.invstd.f32(), N, C, HW, room.partials, room.coef,
                          opt(g.dgamma), opt(g.dbeta), g.params_accumulate, opt(g.dx), g.dx_accumulate,
                          f.add && !f.side_bn ? opt(g.dside) : nullptr, g.dside_accumulate};
  // The forward's scale [C] and shift [C], where the backward finds the ReLU's output from x.
  auto forward_coefficients = [&] {
    float* fwd = room.pool_coef;
    bn_saved_coefficients_kernel<<<cuda::blocks_for(C), cuda::kThreads, 0, stream_>>>(
        C, t.gamma.f32(), t.beta.f32(), t.mean.f32(), t.invstd.f32(), fwd, fwd + C);
    cuda::launched("fused_backward (forward coefficients)");
    return fwd;
  };
  if (f.pool) {
    const float* fwd = forward_coefficients();
    return cuda::with_stored_x(t.x, *codec_, "fused_backward", [&](auto xs) {
      backward_sweeps(stream_, PooledGrad<decltype(xs)>{xs, fwd, g.dy.f32(), pool_geom(s), f.max}, xs, args);
    });
  }
  if (f.global) {
    const float* fwd = forward_coefficients();
    return cuda::with_stored_x(t.x, *codec_, "fused_backward", [&](auto xs) {
      backward_sweeps(stream_, GlobalPooledGrad<decltype(xs)>{xs, fwd, g.dy.f32(), C, HW}, xs, args);
    });
  }
  if (f.relu && !g.y_mask.bits && !g.y_mask.dense.defined()) {  // y computed by its readers: nothing kept of it
    ET_CHECK(fused_recomputes(s), "cuda: a fused stack's ReLU mask");
    const float* fwd = forward_coefficients();
    return cuda::with_stored_x(t.x, *codec_, "fused_backward", [&](auto xs) {
      using Y = cuda::AffineReluX<decltype(xs)>;
      backward_sweeps(stream_, ReluFromXGrad<decltype(xs)>{Y{xs, fwd, fwd + C, C, HW}, g.dy.f32()}, xs, args);
    });
  }
  OutputGrad grad;
  grad.dy = g.dy.f32();
  if (f.relu) {  // the ReLU's saved mask: the stash's bitmap, or y kept dense
    grad.bits = reinterpret_cast<const uint32_t*>(g.y_mask.bits);
    grad.y = g.y_mask.bits ? nullptr : opt(g.y_mask.dense);
    ET_CHECK(grad.bits || grad.y, "cuda: a fused stack's ReLU mask");
  }
  if (!f.side_bn)
    return cuda::with_stored_x(t.x, *codec_, "fused_backward",
                               [&](auto xs) { backward_sweeps(stream_, grad, xs, args); });
  ET_CHECK(t.side.dtype == DType::F32, "cuda: a folded side BN's x2 dtype ", dtype_name(t.side.dtype));
  const BackwardArgs side{t.side_gamma.f32(), t.side_mean.f32(), t.side_invstd.f32(), N, C, HW,
                          room.side_partials, room.side_coef, opt(g.side_dgamma), opt(g.side_dbeta),
                          g.side_params_accumulate, opt(g.dside), g.dside_accumulate, nullptr, false};
  cuda::with_stored_x(t.x, *codec_, "fused_backward",
                      [&](auto xs) { backward_sweeps(stream_, grad, xs, args, &side, t.side.f32()); });
}

}  // namespace et
