// Convolution and linear layers on CUDA. Each pass takes cuDNN where it measured faster for the
// geometry and pass (cuda_conv_cudnn.h), else the backend's own kernels:
//   - groups == 1: im2col of a chunk of images into the workspace, then cuBLAS SGEMMs
//     (strided-batched over the chunk's images); the data gradient gathers the columns back
//     (col2im, no atomics); the weight gradient is one SGEMM per chunk over its images' columns
//     side by side (a per-image SGEMM was most of a ResNet-20 step on an H200); 1x1 stride-1
//     convs skip im2col and col2im in the forward and data gradient (x is its own columns);
//   - groups > 1 (depthwise): direct kernels, without workspace (cuDNN's candidates too); the
//     weight gradient of a 3 x 3 one sums a filter plane's nine taps in one pass over x and dy.
// The weight gradient reads x as the stash keeps it (fp16, bf16, or a bitmap of kept f32 / fp16
// values: conv2d_weight_reads, cuda_stored_x.h), each element as its im2col or the grouped kernel
// gathers it, so the executor plans no f32 decode buffer for x (BitTrain's memory; the CPU reads
// stored x likewise). It also reads a fused BN -> ReLU stack's output that nothing keeps, computing
// it from the stack's x as stored (DType::AffineRelu, memory.recompute_stack_outputs): no buffer
// of y's size for the recompute either. cuDNN reads f32 only: where x decoded to f32 fits at the
// workspace's front (the executor's one workspace, planned for the largest pass), cuDNN over that
// copy competes with the own kernels' read in place, measured as the other passes are.
// Linear layers: one SGEMM each way. cuBLAS runs in its default FP32 math (no TF32).
//
// Row-major [a, b] matrices are column-major [b, a] ones to cuBLAS, so each product below is
// written for the transposes: Y = W X becomes Y^T = X^T W^T.
#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/cuda_conv_cudnn.h"
#include "backends/cuda/cuda_stored_x.h"
#include "backends/cuda/index_math.h"

namespace et {

namespace {

using cuda::blocks_for;
using cuda::kThreads;

constexpr size_t kColumnBytes = size_t(64) << 20;  // the im2col workspace's cap (a chunk of images)

// One image's workspace floats: its columns, and for the weight gradient its dy rearranged too.
int64_t image_floats(const Conv2dGeom& g, ConvPass pass) {
  return (g.C * g.R * g.S + (pass == ConvPass::BackwardWeight ? g.K : 0)) * g.P * g.Q;
}
int64_t chunk_images(const Conv2dGeom& g, ConvPass pass) {
  const int64_t per = image_floats(g, pass) * 4, fit = int64_t(kColumnBytes) / (per > 0 ? per : 1);
  return fit < 1 ? 1 : fit < g.N ? fit : g.N;
}

struct Geom {
  int64_t C, H, W, K, P, Q, R, S, sh, sw, ph, pw, groups;
};
Geom geom_of(const Conv2dGeom& g) {
  return Geom{g.C, g.H, g.W, g.K, g.P, g.Q, g.R, g.S, g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.groups};
}

using cuda::StoredX;
using cuda_index::idiv;  // (backends/cuda/index_math.h: 32-bit divisions where they fit)
using cuda_index::imod;

// col [images][C*R*S][P*Q] of x's images [n0, n0 + images)
__global__ void im2col_kernel(Geom g, const float* x, int64_t images, float* col) {
  const int64_t rows = g.C * g.R * g.S, PQ = g.P * g.Q, total = images * rows * PQ;
  ET_GRID_STRIDE(i, total) {
    const int64_t b = idiv(i, rows * PQ), row = imod(idiv(i, PQ), rows), pq = imod(i, PQ);
    const int64_t c = idiv(row, g.R * g.S), r = imod(idiv(row, g.S), g.R), s = imod(row, g.S);
    const int64_t p = idiv(pq, g.Q), q = imod(pq, g.Q);
    const int64_t h = p * g.sh - g.ph + r, w = q * g.sw - g.pw + s;
    col[i] = h >= 0 && h < g.H && w >= 0 && w < g.W ? x[((b * g.C + c) * g.H + h) * g.W + w] : 0.f;
  }
}

// The weight gradient's operands, each image's positions side by side (L = images * PQ):
// col [C*R*S][L] of x's images [n0, n0 + images), and dyt [K][L] of dy's.
// X: const float*, StoredX or AffineReluX (cuda_stored_x.h): the whole of x, read from image n0 on.
template <class X>
__global__ void im2col_rows_kernel(Geom g, X x, int64_t n0, int64_t images, float* col) {
  const int64_t rows = g.C * g.R * g.S, PQ = g.P * g.Q, L = images * PQ, total = rows * L;
  ET_GRID_STRIDE(i, total) {
    const int64_t row = idiv(i, L), b = idiv(imod(i, L), PQ), pq = imod(i, PQ);
    const int64_t c = idiv(row, g.R * g.S), r = imod(idiv(row, g.S), g.R), s = imod(row, g.S);
    const int64_t p = idiv(pq, g.Q), q = imod(pq, g.Q);
    const int64_t h = p * g.sh - g.ph + r, w = q * g.sw - g.pw + s;
    col[i] = h >= 0 && h < g.H && w >= 0 && w < g.W ? x[(((n0 + b) * g.C + c) * g.H + h) * g.W + w] : 0.f;
  }
}
__global__ void dy_rows_kernel(const float* dy, int64_t images, int64_t K, int64_t PQ, float* dyt) {
  const int64_t L = images * PQ, total = K * L;
  ET_GRID_STRIDE(i, total) {
    const int64_t k = idiv(i, L), b = idiv(imod(i, L), PQ), pq = imod(i, PQ);
    dyt[i] = dy[(b * K + k) * PQ + pq];
  }
}

// dx[images] (+)= the columns gathered back: each input element sums the column entries that read it.
__global__ void col2im_kernel(Geom g, const float* col, int64_t images, float* dx, bool acc) {
  const int64_t rows = g.C * g.R * g.S, PQ = g.P * g.Q, total = images * g.C * g.H * g.W;
  ET_GRID_STRIDE(i, total) {
    const int64_t b = idiv(i, g.C * g.H * g.W), c = imod(idiv(i, g.H * g.W), g.C), h = imod(idiv(i, g.W), g.H);
    const int64_t w = imod(i, g.W);
    float v = acc ? dx[i] : 0.f;
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t ph = h + g.ph - r;  // (>= 0 where divided)
      if (ph < 0 || imod(ph, g.sh) != 0 || idiv(ph, g.sh) >= g.P) continue;
      for (int64_t s = 0; s < g.S; ++s) {
        const int64_t pw = w + g.pw - s;
        if (pw < 0 || imod(pw, g.sw) != 0 || idiv(pw, g.sw) >= g.Q) continue;
        v += col[(b * rows + (c * g.R + r) * g.S + s) * PQ + idiv(ph, g.sh) * g.Q + idiv(pw, g.sw)];
      }
    }
    dx[i] = v;
  }
}

// y [N, K, PQ] += b[k]
__global__ void add_bias_kernel(float* y, const float* b, int64_t total, int64_t K, int64_t PQ) {
  ET_GRID_STRIDE(i, total) y[i] += b[imod(idiv(i, PQ), K)];
}

// db[k] (+)= sum over n and the PQ positions of dy [N, K, PQ]: one block per k.
__global__ void bias_grad_kernel(const float* dy, int64_t N, int64_t K, int64_t PQ, float* db, bool acc) {
  __shared__ double part[kThreads];
  const int64_t k = blockIdx.x;
  double s = 0;
  for (int64_t j = threadIdx.x; j < N * PQ; j += blockDim.x) s += dy[(idiv(j, PQ) * K + k) * PQ + imod(j, PQ)];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int t = kThreads / 2; t > 0; t /= 2) {
    if (threadIdx.x < t) part[threadIdx.x] += part[threadIdx.x + t];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[k] = acc ? db[k] + float(part[0]) : float(part[0]);
}

// ---- groups > 1: direct kernels. w [K, C/groups, R, S].
__global__ void grouped_forward_kernel(Geom g, const float* x, const float* w, int64_t N, float* y) {
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, total = N * g.K * g.P * g.Q;
  ET_GRID_STRIDE(i, total) {
    const int64_t n = idiv(i, g.K * g.P * g.Q), k = imod(idiv(i, g.P * g.Q), g.K), p = imod(idiv(i, g.Q), g.P);
    const int64_t q = imod(i, g.Q), c0 = idiv(k, Kg) * Cg;
    float acc = 0.f;  // the bias is added after (add_bias_kernel), as on every path
    for (int64_t c = 0; c < Cg; ++c)
      for (int64_t r = 0; r < g.R; ++r) {
        const int64_t h = p * g.sh - g.ph + r;
        if (h < 0 || h >= g.H) continue;
        for (int64_t s = 0; s < g.S; ++s) {
          const int64_t ww = q * g.sw - g.pw + s;
          if (ww < 0 || ww >= g.W) continue;
          acc += x[((n * g.C + c0 + c) * g.H + h) * g.W + ww] * w[((k * Cg + c) * g.R + r) * g.S + s];
        }
      }
    y[i] = acc;
  }
}

__global__ void grouped_backward_data_kernel(Geom g, const float* dy, const float* w, int64_t N, float* dx, bool acc) {
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, total = N * g.C * g.H * g.W;
  ET_GRID_STRIDE(i, total) {
    const int64_t n = idiv(i, g.C * g.H * g.W), c = imod(idiv(i, g.H * g.W), g.C), h = imod(idiv(i, g.W), g.H);
    const int64_t ww = imod(i, g.W), grp = idiv(c, Cg), cl = imod(c, Cg);
    float v = acc ? dx[i] : 0.f;
    for (int64_t kl = 0; kl < Kg; ++kl) {
      const int64_t k = grp * Kg + kl;
      for (int64_t r = 0; r < g.R; ++r) {
        const int64_t ph = h + g.ph - r;
        if (ph < 0 || imod(ph, g.sh) != 0 || idiv(ph, g.sh) >= g.P) continue;
        for (int64_t s = 0; s < g.S; ++s) {
          const int64_t pw = ww + g.pw - s;
          if (pw < 0 || imod(pw, g.sw) != 0 || idiv(pw, g.sw) >= g.Q) continue;
          v += dy[((n * g.K + k) * g.P + idiv(ph, g.sh)) * g.Q + idiv(pw, g.sw)] * w[((k * Cg + cl) * g.R + r) * g.S + s];
        }
      }
    }
    dx[i] = v;
  }
}

// One block per weight element: the sum over images and output positions.
// X: const float*, StoredX (x as the stash keeps it) or AffineReluX (y computed from it).
template <class X>
__global__ void grouped_backward_weight_kernel(Geom g, X x, const float* dy, int64_t N, float* dw, bool acc) {
  __shared__ double part[kThreads];
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, e = blockIdx.x;
  const int64_t k = e / (Cg * g.R * g.S), c = k / Kg * Cg + e / (g.R * g.S) % Cg, r = e / g.S % g.R, s = e % g.S;
  double sum = 0;
  for (int64_t j = threadIdx.x; j < N * g.P * g.Q; j += blockDim.x) {
    const int64_t n = idiv(j, g.P * g.Q), p = imod(idiv(j, g.Q), g.P), q = imod(j, g.Q);
    const int64_t h = p * g.sh - g.ph + r, ww = q * g.sw - g.pw + s;
    if (h < 0 || h >= g.H || ww < 0 || ww >= g.W) continue;
    sum += double(x[((n * g.C + c) * g.H + h) * g.W + ww]) * double(dy[((n * g.K + k) * g.P + p) * g.Q + q]);
  }
  part[threadIdx.x] = sum;
  __syncthreads();
  for (int t = kThreads / 2; t > 0; t /= 2) {
    if (threadIdx.x < t) part[threadIdx.x] += part[threadIdx.x + t];
    __syncthreads();
  }
  if (threadIdx.x == 0) dw[e] = acc ? dw[e] + float(part[0]) : float(part[0]);
}

// The same sums for R x S windows known at compile time (MobileNet-V2's 3 x 3 depthwise convs):
// one block per filter plane (k, c), its R * S taps side by side, so x and dy are read once per
// plane instead of once per tap. Each tap's sum runs in the per-element kernel's order (each
// thread over positions j = tid, tid + 256, ..., then the same tree; the products are exact in
// double), so the results are its bits.
template <int R, int S, class X>
__global__ void grouped_backward_weight_planes_kernel(Geom g, X x, const float* dy, int64_t N, float* dw, bool acc) {
  __shared__ double part[kThreads];
  const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups, plane = blockIdx.x;  // plane = k * Cg + (c's index in its group)
  const int64_t k = plane / Cg, c = k / Kg * Cg + plane % Cg, PQ = g.P * g.Q;
  double sum[R * S];
#pragma unroll
  for (int t = 0; t < R * S; ++t) sum[t] = 0;
  const float* dyk = dy + k * PQ;
  for (int64_t j = threadIdx.x; j < N * PQ; j += blockDim.x) {
    const int64_t n = idiv(j, PQ), pq = imod(j, PQ), p = idiv(pq, g.Q), q = imod(pq, g.Q);
    const double d = double(dyk[n * g.K * PQ + pq]);
    const int64_t x0 = (n * g.C + c) * g.H * g.W;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t h = p * g.sh - g.ph + r;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const int64_t ww = q * g.sw - g.pw + s;
        if (h >= 0 && h < g.H && ww >= 0 && ww < g.W) sum[r * S + s] += double(x[x0 + h * g.W + ww]) * d;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < R * S; ++t) {
    part[threadIdx.x] = sum[t];
    __syncthreads();
    for (int u = kThreads / 2; u > 0; u /= 2) {
      if (threadIdx.x < u) part[threadIdx.x] += part[threadIdx.x + u];
      __syncthreads();
    }
    const int64_t e = plane * R * S + t;
    if (threadIdx.x == 0) dw[e] = acc ? dw[e] + float(part[0]) : float(part[0]);
    __syncthreads();  // part is written again for the next tap
  }
}

// A grouped conv's weight gradient into dw (x: const float*, StoredX or AffineReluX).
template <class X>
void grouped_backward_weight(cudaStream_t stream, const Conv2dGeom& g, X x, const float* dy, float* dw, bool acc) {
  if (g.R == 3 && g.S == 3) {
    grouped_backward_weight_planes_kernel<3, 3><<<unsigned(g.K * (g.C / g.groups)), kThreads, 0, stream>>>(
        geom_of(g), x, dy, g.N, dw, acc);
    return cuda::launched("conv2d_backward_weight (grouped, by filter plane)");
  }
  grouped_backward_weight_kernel<<<unsigned(g.K * (g.C / g.groups) * g.R * g.S), kThreads, 0, stream>>>(
      geom_of(g), x, dy, g.N, dw, acc);
  cuda::launched("conv2d_backward_weight (grouped)");
}

// y [N, O] += b[o]; db[o] (+)= sum_n dy[n, o]
__global__ void linear_bias_kernel(float* y, const float* b, int64_t total, int64_t O) { ET_GRID_STRIDE(i, total) y[i] += b[imod(i, O)]; }
__global__ void linear_bias_grad_kernel(const float* dy, int64_t N, int64_t O, float* db, bool acc) {
  ET_GRID_STRIDE(o, O) {
    float s = 0.f;
    for (int64_t n = 0; n < N; ++n) s += dy[n * O + o];
    db[o] = acc ? db[o] + s : s;
  }
}

// ---- the im2col + SGEMM passes (groups == 1); `ws` holds conv2d_workspace_bytes of the pass.
// Their kernels go on the cuBLAS handle's stream (the backend's).
cudaStream_t stream_of(cublasHandle_t blas) {
  cudaStream_t s = nullptr;
  cuda::check(cublasGetStream(blas, &s), "cublasGetStream");
  return s;
}

// A 1x1 stride-1 pad-0 conv (MobileNet-V2's pointwise layers): x is its own columns, so the
// forward and data gradient are one strided-batched SGEMM over the batch, without im2col or col2im
// (which made those passes 0.2-0.4 of the SGEMM rate in bench_cuda_conv, session 47).
bool pointwise(const Conv2dGeom& g) {
  return g.groups == 1 && g.R == 1 && g.S == 1 && g.stride_h == 1 && g.stride_w == 1 && g.pad_h == 0 && g.pad_w == 0;
}

void im2col_forward(cublasHandle_t blas, const Conv2dGeom& g, const float* x, const float* w, float* y, Workspace ws) {
  const cudaStream_t stream = stream_of(blas);
  const Geom gg = geom_of(g);
  const int64_t PQ = g.P * g.Q, CRS = g.C * g.R * g.S, chunk = chunk_images(g, ConvPass::Forward);
  float* col = static_cast<float*>(ws.data);
  const float one = 1.f, zero = 0.f;
  if (pointwise(g)) {  // Y_b^T (PQ x K) = X_b^T (PQ x C) W^T (C x K)
    cuda::check(cublasSgemmStridedBatched(blas, CUBLAS_OP_N, CUBLAS_OP_N, int(PQ), int(g.K), int(g.C), &one, x,
                                          int(PQ), g.C * PQ, w, int(g.C), 0, &zero, y, int(PQ), g.K * PQ, int(g.N)),
                "conv2d_forward sgemm (1x1)");
    return;
  }
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t nb = g.N - n0 < chunk ? g.N - n0 : chunk;
    im2col_kernel<<<blocks_for(nb * CRS * PQ), kThreads, 0, stream>>>(gg, x + n0 * g.C * g.H * g.W, nb, col);
    cuda::launched("im2col");
    // Y_b^T (PQ x K) = col_b^T (PQ x CRS) W^T (CRS x K)
    cuda::check(cublasSgemmStridedBatched(blas, CUBLAS_OP_N, CUBLAS_OP_N, int(PQ), int(g.K), int(CRS), &one, col,
                                          int(PQ), CRS * PQ, w, int(CRS), 0, &zero, y + n0 * g.K * PQ, int(PQ),
                                          g.K * PQ, int(nb)),
                "conv2d_forward sgemm");
  }
}

void im2col_backward_data(cublasHandle_t blas, const Conv2dGeom& g, const float* dy, const float* w, float* dx,
                          bool accumulate, Workspace ws) {
  const cudaStream_t stream = stream_of(blas);
  const Geom gg = geom_of(g);
  const int64_t PQ = g.P * g.Q, CRS = g.C * g.R * g.S, chunk = chunk_images(g, ConvPass::BackwardData);
  float* col = static_cast<float*>(ws.data);
  const float one = 1.f, zero = 0.f;
  if (pointwise(g)) {  // dX_b^T (PQ x C) (+)= dY_b^T (PQ x K) W (K x C)
    cuda::check(cublasSgemmStridedBatched(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(PQ), int(g.C), int(g.K), &one, dy,
                                          int(PQ), g.K * PQ, w, int(g.C), 0, accumulate ? &one : &zero, dx, int(PQ),
                                          g.C * PQ, int(g.N)),
                "conv2d_backward_data sgemm (1x1)");
    return;
  }
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t nb = g.N - n0 < chunk ? g.N - n0 : chunk;
    // col_b^T (PQ x CRS) = dY_b^T (PQ x K) W (K x CRS)
    cuda::check(cublasSgemmStridedBatched(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(PQ), int(CRS), int(g.K), &one,
                                          dy + n0 * g.K * PQ, int(PQ), g.K * PQ, w, int(CRS), 0, &zero, col, int(PQ),
                                          CRS * PQ, int(nb)),
                "conv2d_backward_data sgemm");
    col2im_kernel<<<blocks_for(nb * g.C * g.H * g.W), kThreads, 0, stream>>>(gg, col, nb, dx + n0 * g.C * g.H * g.W,
                                                                             accumulate);
    cuda::launched("col2im");
  }
}

template <class X>
void im2col_backward_weight(cublasHandle_t blas, const Conv2dGeom& g, X x, const float* dy, float* dw, bool accumulate,
                            Workspace ws) {
  const cudaStream_t stream = stream_of(blas);
  const Geom gg = geom_of(g);
  const int64_t PQ = g.P * g.Q, CRS = g.C * g.R * g.S, chunk = chunk_images(g, ConvPass::BackwardWeight);
  float* col = static_cast<float*>(ws.data);
  float* dyt = col + chunk * CRS * PQ;
  const float one = 1.f, zero = 0.f;
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t nb = g.N - n0 < chunk ? g.N - n0 : chunk, L = nb * PQ;
    im2col_rows_kernel<<<blocks_for(CRS * L), kThreads, 0, stream>>>(gg, x, n0, nb, col);
    cuda::launched("im2col (rows)");
    dy_rows_kernel<<<blocks_for(g.K * L), kThreads, 0, stream>>>(dy + n0 * g.K * PQ, nb, g.K, PQ, dyt);
    cuda::launched("dy rows");
    // dW^T (CRS x K) (+)= col (CRS x L) dyt^T (L x K)
    const bool overwrite = !accumulate && n0 == 0;
    cuda::check(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(CRS), int(g.K), int(L), &one, col, int(L), dyt, int(L),
                            overwrite ? &zero : &one, dw, int(CRS)),
                "conv2d_backward_weight sgemm");
  }
}

// The pass's path (cuda_conv_cudnn.h): a cuDNN algorithm (>= 0) or the backend's own kernels (< 0:
// im2col + SGEMM for dense convs, the direct kernels for grouped ones), measured at the geometry
// and pass's first use. The measurement writes a scratch output (allocated for it, in the first
// step only), so an accumulating pass's real output is untouched. `ours(out, accumulate)` runs the
// backend's own pass; `ws` is cuDNN's workspace. x_decoded: cuDNN's operand a is a stored x that
// `decode()` writes as f32 (into workspace the own pass may use too: decoded again before each
// cuDNN call).
struct NothingToDecode {
  void operator()() const {}
};
template <class Ours, class Decode = NothingToDecode>
int conv_path(cuda::CudnnConvs* dnn, cudaStream_t stream, const Conv2dGeom& g, ConvPass pass, const float* a,
              const float* b, int64_t out_floats, Workspace ws, Ours&& ours, bool x_decoded = false,
              Decode&& decode = Decode{}) {
  if (!dnn) return cuda::CudnnConvs::kOwn;
  const int known = dnn->choice(g, pass, x_decoded);
  if (known >= 0 && dnn->workspace(g, pass, x_decoded) > ws.bytes) return cuda::CudnnConvs::kOwn;  // (measured with more)
  if (known != cuda::CudnnConvs::kUnmeasured) return known;
  float* scratch = nullptr;
  scratch = cuda_allocate_array<float>(size_t(out_floats), "a conv pass's measurement (first step only)");
  float best = 1e30f;  // the own kernels' time (not measured where cuDNN is forced)
  cudaEvent_t t0, t1;
  cuda::check(cudaEventCreate(&t0), "cudaEventCreate");
  cuda::check(cudaEventCreate(&t1), "cudaEventCreate");
  for (int rep = 0; rep < 3 && !dnn->forced(); ++rep) {
    cuda::check(cudaEventRecord(t0, stream), "cudaEventRecord");
    ours(scratch, false);
    cuda::check(cudaEventRecord(t1, stream), "cudaEventRecord");
    cuda::check(cudaEventSynchronize(t1), "cudaEventSynchronize");
    float ms = 0.f;
    cuda::check(cudaEventElapsedTime(&ms, t0, t1), "cudaEventElapsedTime");
    best = ms < best ? ms : best;
  }
  // cuDNN over a decoded x pays for the decode too: it is charged against it (the own kernels'
  // time less the decode's).
  float decode_ms = 0.f;
  if (x_decoded) {
    cuda::check(cudaEventRecord(t0, stream), "cudaEventRecord");
    decode();
    cuda::check(cudaEventRecord(t1, stream), "cudaEventRecord");
    cuda::check(cudaEventSynchronize(t1), "cudaEventSynchronize");
    cuda::check(cudaEventElapsedTime(&decode_ms, t0, t1), "cudaEventElapsedTime");
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  const int chosen = dnn->measure(g, pass, x_decoded, a, b, scratch, ws, best - decode_ms);
  cuda::check(cudaFree(scratch), "cudaFree");
  return chosen;
}

// The pass into `out` (accumulating where asked) on its path.
template <class Ours, class Decode = NothingToDecode>
void run_pass(cuda::CudnnConvs* dnn, cudaStream_t stream, const Conv2dGeom& g, ConvPass pass, const float* a,
              const float* b, float* out, int64_t out_floats, bool accumulate, Workspace ws, Ours&& ours,
              bool x_decoded = false, Decode&& decode = Decode{}) {
  const int path = conv_path(dnn, stream, g, pass, a, b, out_floats, ws, ours, x_decoded, decode);
  if (path < 0) return ours(out, accumulate);
  decode();
  dnn->run(g, pass, path, a, b, out, accumulate, ws);
}

// x [n] as f32, from any encoding cuda_stored_x.h reads (cuDNN's operand, for a stored x).
template <class X>
__global__ void decode_x_kernel(X x, int64_t n, float* out) {
  ET_GRID_STRIDE(i, n) out[i] = x[i];
}

}  // namespace

size_t CudaBackend::conv2d_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const {
  return g.groups == 1 ? size_t(chunk_images(g, pass) * image_floats(g, pass)) * 4 : 0;
}

void CudaBackend::conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                                 Workspace ws) {
  ET_CHECK(ws.bytes >= conv2d_workspace_bytes(g, ConvPass::Forward), "conv2d_forward: workspace");
  run_pass(cudnn_.get(), stream_, g, ConvPass::Forward, x.f32(), w.f32(), y.f32(), y.numel(), false, ws,
           [&](float* out, bool) {
             if (g.groups == 1) return im2col_forward(blas_, g, x.f32(), w.f32(), out, ws);
             grouped_forward_kernel<<<blocks_for(y.numel()), kThreads, 0, stream_>>>(geom_of(g), x.f32(), w.f32(), g.N,
                                                                                     out);
             cuda::launched("conv2d_forward (grouped)");
           });
  if (b.defined()) {
    add_bias_kernel<<<blocks_for(y.numel()), kThreads, 0, stream_>>>(y.f32(), b.f32(), y.numel(), g.K, g.P * g.Q);
    cuda::launched("conv bias");
  }
}

void CudaBackend::conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx,
                                       bool accumulate, Workspace ws) {
  ET_CHECK(ws.bytes >= conv2d_workspace_bytes(g, ConvPass::BackwardData), "conv2d_backward_data: workspace");
  run_pass(cudnn_.get(), stream_, g, ConvPass::BackwardData, dy.f32(), w.f32(), dx.f32(), dx.numel(), accumulate, ws,
           [&](float* out, bool acc) {
             if (g.groups == 1) return im2col_backward_data(blas_, g, dy.f32(), w.f32(), out, acc, ws);
             grouped_backward_data_kernel<<<blocks_for(dx.numel()), kThreads, 0, stream_>>>(geom_of(g), dy.f32(),
                                                                                            w.f32(), g.N, out, acc);
             cuda::launched("conv2d_backward_data (grouped)");
           });
}

DTypeSet CudaBackend::conv2d_weight_reads(const Conv2dGeom&) const {
  return kStashDTypes | dtype_bit(DType::AffineRelu);
}

void CudaBackend::conv2d_backward_weight(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw,
                                         Tensor& db, bool accumulate, Workspace ws) {
  if (db.defined()) {
    bias_grad_kernel<<<unsigned(g.K), kThreads, 0, stream_>>>(dy.f32(), g.N, g.K, g.P * g.Q, db.f32(), accumulate);
    cuda::launched("conv bias gradient");
  }
  ET_CHECK(ws.bytes >= conv2d_workspace_bytes(g, ConvPass::BackwardWeight), "conv2d_backward_weight: workspace");
  ET_CHECK(dtype_in(x.dtype, conv2d_weight_reads(g)), "conv2d weight gradient: x dtype ", dtype_name(x.dtype));
  if (x.dtype != DType::F32) {
    // x as the stash keeps it (or y computed from x): the own kernels read it in place; cuDNN
    // reads f32 only, so where x decoded fits at the workspace's front it competes over that copy
    // with the rest of the workspace (the decode is one pass over x, small beside the conv's).
    auto own = [&](float* out, bool acc) {
      cuda::with_read_x(x, *codec_, "conv2d weight gradient", [&](auto rx) {
        if (g.groups == 1) return im2col_backward_weight(blas_, g, rx, dy.f32(), out, acc, ws);
        grouped_backward_weight(stream_, g, rx, dy.f32(), out, acc);
      });
    };
    const size_t x_room = (size_t(x.numel()) * 4 + 255) / 256 * 256;
    if (!cudnn_ || ws.bytes < x_room) return own(dw.f32(), accumulate);
    float* xf = static_cast<float*>(ws.data);
    const Workspace rest{static_cast<char*>(ws.data) + x_room, ws.bytes - x_room};
    auto decode = [&] {
      cuda::with_read_x(x, *codec_, "conv2d weight gradient", [&](auto rx) {
        decode_x_kernel<<<blocks_for(x.numel()), kThreads, 0, stream_>>>(rx, x.numel(), xf);
      });
      cuda::launched("conv2d weight gradient (x decoded for cuDNN)");
    };
    return run_pass(cudnn_.get(), stream_, g, ConvPass::BackwardWeight, xf, dy.f32(), dw.f32(), dw.numel(),
                    accumulate, rest, own, true, decode);
  }
  run_pass(cudnn_.get(), stream_, g, ConvPass::BackwardWeight, x.f32(), dy.f32(), dw.f32(), dw.numel(), accumulate, ws,
           [&](float* out, bool acc) {
             if (g.groups == 1) return im2col_backward_weight(blas_, g, x.f32(), dy.f32(), out, acc, ws);
             grouped_backward_weight(stream_, g, x.f32(), dy.f32(), out, acc);
           });
}

// x [N, I], w [O, I], y [N, O]: Y^T (O x N) = W (O x I) X^T (I x N)
void CudaBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  const int64_t N = x.dim(0), I = x.dim(1), O = w.dim(0);
  const float one = 1.f, zero = 0.f;
  cuda::check(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, int(O), int(N), int(I), &one, w.f32(), int(I), x.f32(),
                          int(I), &zero, y.f32(), int(O)),
              "linear_forward sgemm");
  if (b.defined()) {
    linear_bias_kernel<<<blocks_for(N * O), kThreads, 0, stream_>>>(y.f32(), b.f32(), N * O, O);
    cuda::launched("linear bias");
  }
}

// dX^T (I x N) (+)= W^T (I x O) dY^T (O x N)
void CudaBackend::linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) {
  const int64_t N = dy.dim(0), O = dy.dim(1), I = w.dim(1);
  const float one = 1.f, zero = 0.f;
  cuda::check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, int(I), int(N), int(O), &one, w.f32(), int(I), dy.f32(),
                          int(O), accumulate ? &one : &zero, dx.f32(), int(I)),
              "linear_backward_data sgemm");
}

// dW^T (I x O) (+)= X^T (I x N) dY (N x O)
void CudaBackend::linear_backward_weight(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db, bool accumulate) {
  const int64_t N = x.dim(0), I = x.dim(1), O = dy.dim(1);
  const float one = 1.f, zero = 0.f;
  cuda::check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, int(I), int(O), int(N), &one, x.f32(), int(I), dy.f32(),
                          int(O), accumulate ? &one : &zero, dw.f32(), int(I)),
              "linear_backward_weight sgemm");
  if (db.defined()) {
    linear_bias_grad_kernel<<<blocks_for(O), kThreads, 0, stream_>>>(dy.f32(), N, O, db.f32(), accumulate);
    cuda::launched("linear bias gradient");
  }
}

}  // namespace et
