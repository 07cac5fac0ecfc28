// The CUDA emulator's cuDNN (include/cudnn.h): FP32 NCHW convolutions with groups, computed on the
// host in the handle's stream order (emu_internal.h), so stream capture records them as a GPU's
// would. What it checks of its caller, as cuDNN does or as a GPU would show:
//   - descriptors that agree (the output's shape from the input, filter and convolution; channels
//     a multiple of the groups), FP32 NCHW only;
//   - an algorithm the geometry supports (its perf list's status), and workspace_bytes at least
//     what that algorithm needs (CUDNN_STATUS_BAD_PARAM otherwise);
//   - operands and workspace inside device allocations (an emulator fault otherwise);
//   - the workspace is the algorithm's own: each call fills it with NaNs first, so a workspace
//     that overlaps an operand corrupts the result.
// Its algorithm lists mirror cuDNN's flags (status by geometry, workspace, determinism: the data
// gradient's ALGO_0 and the filter gradient's ALGO_0 and ALGO_3 are not deterministic), in an order
// that is not the fastest first. Every algorithm computes the same sums (double accumulators);
// y = alpha * conv + beta * y, y not read where beta is 0, as cuDNN.
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "cudnn.h"
#include "emu_internal.h"

struct cudnnContext {
  cudaStream_t stream = nullptr;
};
struct cudnnTensorStruct {
  bool set = false;
  int n = 0, c = 0, h = 0, w = 0;
};
struct cudnnFilterStruct {
  bool set = false;
  int k = 0, c = 0, r = 0, s = 0;
};
struct cudnnConvolutionStruct {
  bool set = false;
  int pad_h = 0, pad_w = 0, stride_h = 1, stride_w = 1, groups = 1;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
};

namespace {

enum class Pass { Forward, Data, Filter };

// One convolution's sizes, from descriptors that agree with each other.
struct Geom {
  int N, C, H, W, K, Cg, R, S, P, Q, pad_h, pad_w, sh, sw, groups;
  size_t x_elems() const { return size_t(N) * C * H * W; }
  size_t y_elems() const { return size_t(N) * K * P * Q; }
  size_t w_elems() const { return size_t(K) * Cg * R * S; }
  bool winograd_shape() const { return R == 3 && S == 3 && sh == 1 && sw == 1 && groups == 1; }
};

bool geometry(const cudnnTensorStruct* x, const cudnnFilterStruct* w, const cudnnConvolutionStruct* conv,
              const cudnnTensorStruct* y, Geom* g) {
  if (!x || !w || !conv || !y || !x->set || !w->set || !conv->set || !y->set) return false;
  const int groups = conv->groups;
  if (groups < 1 || x->c % groups != 0 || w->k % groups != 0 || w->c * groups != x->c) return false;
  const int P = (x->h + 2 * conv->pad_h - w->r) / conv->stride_h + 1;
  const int Q = (x->w + 2 * conv->pad_w - w->s) / conv->stride_w + 1;
  if (P < 1 || Q < 1 || y->n != x->n || y->c != w->k || y->h != P || y->w != Q) return false;
  *g = Geom{x->n, x->c, x->h, x->w, w->k, w->c, w->r, w->s, P, Q,
            conv->pad_h, conv->pad_w, conv->stride_h, conv->stride_w, groups};
  return true;
}

// One algorithm of a pass as cuDNN lists it for a geometry.
struct Algo {
  int algo;
  cudnnStatus_t status;
  size_t memory;
  cudnnDeterminism_t determinism;
};

Algo supported(int algo, bool ok, size_t memory, bool deterministic = true) {
  return Algo{algo, ok ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_NOT_SUPPORTED, ok ? memory : 0,
              deterministic ? CUDNN_DETERMINISTIC : CUDNN_NON_DETERMINISTIC};
}

// The pass's algorithms for g, in the emulator's heuristic order (not the fastest first: the
// caller measures). Workspace sizes are the emulator's own, of the kinds cuDNN's are: none, an
// index table, partial sums, whole transformed tensors.
std::vector<Algo> algorithms(Pass pass, const Geom& g) {
  const size_t f = sizeof(float);
  const bool dense = g.groups == 1, unit_stride = g.sh == 1 && g.sw == 1;
  const size_t fft = f * size_t(g.N) * (g.C + g.K) * (g.H + g.R) * (g.W + g.S) * 2;
  const size_t wino = f * size_t(g.N) * (g.C + g.K) * ((g.P + 1) / 2) * ((g.Q + 1) / 2) * 16;
  switch (pass) {
    case Pass::Forward:
      return {supported(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, true, 8 * size_t(g.Cg) * g.R * g.S),
              supported(CUDNN_CONVOLUTION_FWD_ALGO_GEMM, dense, f * size_t(g.N) * g.C * g.R * g.S * g.P * g.Q),
              supported(CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED, g.winograd_shape(), wino),
              supported(CUDNN_CONVOLUTION_FWD_ALGO_FFT, dense && unit_stride, fft),
              supported(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, true, 0),
              supported(CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD, g.winograd_shape(), 0),
              supported(CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING, false, 0),
              supported(CUDNN_CONVOLUTION_FWD_ALGO_DIRECT, false, 0)};
    case Pass::Data:
      return {supported(CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, true, 0, false),
              supported(CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED, g.winograd_shape(), wino),
              supported(CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, true, 0),
              supported(CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT, dense && unit_stride, fft),
              supported(CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD, g.winograd_shape(), 0),
              supported(CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING, false, 0)};
    case Pass::Filter:
      return {supported(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, true, 0, false),
              supported(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3, true, f * g.w_elems(), false),
              supported(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, true, f * g.w_elems() * 4),
              supported(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT, dense && unit_stride, fft),
              supported(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED, g.winograd_shape(), wino),
              supported(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD, false, 0),
              supported(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING, false, 0)};
  }
  return {};
}

template <class AlgoEnum>
cudnnStatus_t list(Pass pass, const Geom& g, cudnnMathType_t math, int requested, int* returned,
                   cudnnAlgoPerf<AlgoEnum>* perf) {
  if (requested < 1 || !returned || !perf) return CUDNN_STATUS_BAD_PARAM;
  const std::vector<Algo> all = algorithms(pass, g);
  int n = 0;
  for (const Algo& a : all) {
    if (n == requested) break;
    cudnnAlgoPerf<AlgoEnum> p{};
    p.algo = AlgoEnum(a.algo);
    p.status = a.status;
    p.time = -1.f;
    p.memory = a.memory;
    p.determinism = a.determinism;
    p.mathType = math;
    perf[n++] = p;
  }
  *returned = n;
  return CUDNN_STATUS_SUCCESS;
}

// Operands of a call inside device allocations (a GPU faults on any other pointer).
void inside(const void* p, size_t bytes, const char* what) {
  if (bytes == 0) return;
  if (!p || !emu::in_device_memory(p, bytes))
    emu::report_fault(std::string("a cuDNN convolution's ") + what + " is not inside one device allocation (" +
                      emu::where(p) + ")");
}

// out[i] = alpha * acc[i] + beta * out[i]; out not read where beta is 0.
void blend(const std::vector<double>& acc, float alpha, float beta, float* out) {
  for (size_t i = 0; i < acc.size(); ++i) {
    const float v = alpha * float(acc[i]);
    out[i] = beta == 0.f ? v : v + beta * out[i];
  }
}

// Calls f(n, k, p, q, c, r, s, h, w) for every product of the convolution (c: the input channel,
// h, w: inside the input).
template <class F>
void for_each_product(const Geom& g, F&& f) {
  const int Kg = g.K / g.groups;
  for (int n = 0; n < g.N; ++n)
    for (int k = 0; k < g.K; ++k) {
      const int c0 = k / Kg * g.Cg;
      for (int p = 0; p < g.P; ++p)
        for (int q = 0; q < g.Q; ++q)
          for (int ci = 0; ci < g.Cg; ++ci)
            for (int r = 0; r < g.R; ++r) {
              const int h = p * g.sh - g.pad_h + r;
              if (h < 0 || h >= g.H) continue;
              for (int s = 0; s < g.S; ++s) {
                const int w = q * g.sw - g.pad_w + s;
                if (w >= 0 && w < g.W) f(n, k, p, q, c0 + ci, ci, r, s, h, w);
              }
            }
    }
}

size_t x_at(const Geom& g, int n, int c, int h, int w) { return ((size_t(n) * g.C + c) * g.H + h) * g.W + w; }
size_t y_at(const Geom& g, int n, int k, int p, int q) { return ((size_t(n) * g.K + k) * g.P + p) * g.Q + q; }
size_t w_at(const Geom& g, int k, int ci, int r, int s) { return ((size_t(k) * g.Cg + ci) * g.R + r) * g.S + s; }

// One call: its checks, then the pass in stream order. a, b: the operands (forward x, w; data
// dy, w; filter x, dy); out: the result.
cudnnStatus_t convolve(cudnnHandle_t h, Pass pass, const Geom& g, int algo, const void* alpha, const void* a,
                       const void* b, void* workspace, size_t workspace_bytes, const void* beta, void* out) {
  if (!h || !alpha || !beta) return CUDNN_STATUS_BAD_PARAM;
  const Algo* chosen = nullptr;
  const std::vector<Algo> all = algorithms(pass, g);
  for (const Algo& x : all)
    if (x.algo == algo) chosen = &x;
  if (!chosen || chosen->status != CUDNN_STATUS_SUCCESS) return CUDNN_STATUS_NOT_SUPPORTED;
  if (workspace_bytes < chosen->memory) return CUDNN_STATUS_BAD_PARAM;
  const size_t need = chosen->memory;
  std::lock_guard<std::recursive_mutex> lock(emu::runtime_lock());
  const size_t xb = g.x_elems() * 4, yb = g.y_elems() * 4, wb = g.w_elems() * 4;
  const size_t a_bytes = pass == Pass::Data ? yb : xb;
  const size_t b_bytes = pass == Pass::Forward ? wb : pass == Pass::Data ? wb : yb;
  const size_t out_bytes = pass == Pass::Forward ? yb : pass == Pass::Data ? xb : wb;
  inside(a, a_bytes, pass == Pass::Data ? "dy" : "x");
  inside(b, b_bytes, pass == Pass::Filter ? "dy" : "w");
  inside(out, out_bytes, "output");
  inside(workspace, need, "workspace");
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  const float* A = static_cast<const float*>(a);
  const float* B = static_cast<const float*>(b);
  float* O = static_cast<float*>(out);
  float* ws = static_cast<float*>(workspace);
  const cudaError_t e = emu::issue(h->stream, [=]() {
    for (size_t i = 0; i < need / 4; ++i) ws[i] = std::numeric_limits<float>::quiet_NaN();
    std::vector<double> acc(out_bytes / 4, 0.0);
    if (pass == Pass::Forward)
      for_each_product(g, [&](int n, int k, int p, int q, int c, int ci, int r, int s, int hh, int ww) {
        acc[y_at(g, n, k, p, q)] += double(A[x_at(g, n, c, hh, ww)]) * B[w_at(g, k, ci, r, s)];
      });
    else if (pass == Pass::Data)
      for_each_product(g, [&](int n, int k, int p, int q, int c, int ci, int r, int s, int hh, int ww) {
        acc[x_at(g, n, c, hh, ww)] += double(A[y_at(g, n, k, p, q)]) * B[w_at(g, k, ci, r, s)];
      });
    else
      for_each_product(g, [&](int n, int k, int p, int q, int c, int ci, int r, int s, int hh, int ww) {
        acc[w_at(g, k, ci, r, s)] += double(A[x_at(g, n, c, hh, ww)]) * B[y_at(g, n, k, p, q)];
      });
    blend(acc, al, be, O);
  });
  return e == cudaSuccess ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_EXECUTION_FAILED;
}

// The descriptors' create and destroy calls.
template <class T>
cudnnStatus_t create(T** d) {
  if (!d) return CUDNN_STATUS_BAD_PARAM;
  *d = new T;
  return CUDNN_STATUS_SUCCESS;
}
template <class T>
cudnnStatus_t destroy(T* d) {
  delete d;
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace

size_t cudnnGetVersion() { return CUDNN_VERSION; }
const char* cudnnGetErrorString(cudnnStatus_t s) {
  switch (s) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
  }
  return "CUDNN_STATUS_UNKNOWN";
}
cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) {
  if (!handle) return CUDNN_STATUS_BAD_PARAM;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return CUDNN_STATUS_NOT_INITIALIZED;
  }
  *handle = new cudnnContext;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
  delete handle;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream) {
  if (!handle) return CUDNN_STATUS_BAD_PARAM;
  handle->stream = stream;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d) { return create(d); }
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) { return destroy(d); }
cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d, cudnnTensorFormat_t format, cudnnDataType_t type,
                                         int n, int c, int h, int w) {
  if (!d || n < 1 || c < 1 || h < 1 || w < 1) return CUDNN_STATUS_BAD_PARAM;
  if (format != CUDNN_TENSOR_NCHW || type != CUDNN_DATA_FLOAT) return CUDNN_STATUS_NOT_SUPPORTED;  // (the emulator's)
  *d = cudnnTensorStruct{true, n, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d) { return create(d); }
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) { return destroy(d); }
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t type, cudnnTensorFormat_t format,
                                         int k, int c, int h, int w) {
  if (!d || k < 1 || c < 1 || h < 1 || w < 1) return CUDNN_STATUS_BAD_PARAM;
  if (format != CUDNN_TENSOR_NCHW || type != CUDNN_DATA_FLOAT) return CUDNN_STATUS_NOT_SUPPORTED;
  *d = cudnnFilterStruct{true, k, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d) { return create(d); }
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) { return destroy(d); }
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int pad_h, int pad_w, int u, int v,
                                              int dilation_h, int dilation_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t compute_type) {
  if (!d || pad_h < 0 || pad_w < 0 || u < 1 || v < 1 || dilation_h < 1 || dilation_w < 1) return CUDNN_STATUS_BAD_PARAM;
  // The emulator's: cross-correlation without dilation, in FP32 (what the backend asks for).
  if (mode != CUDNN_CROSS_CORRELATION || dilation_h != 1 || dilation_w != 1 || compute_type != CUDNN_DATA_FLOAT)
    return CUDNN_STATUS_NOT_SUPPORTED;
  d->set = true;
  d->pad_h = pad_h, d->pad_w = pad_w, d->stride_h = u, d->stride_w = v;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t d, int groups) {
  if (!d || groups < 1) return CUDNN_STATUS_BAD_PARAM;
  d->groups = groups;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t math) {
  if (!d) return CUDNN_STATUS_BAD_PARAM;
  d->math = math;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t handle, const cudnnTensorDescriptor_t x,
                                                     const cudnnFilterDescriptor_t w,
                                                     const cudnnConvolutionDescriptor_t conv,
                                                     const cudnnTensorDescriptor_t y, int requested, int* returned,
                                                     cudnnConvolutionFwdAlgoPerf_t* perf) {
  Geom g;
  if (!handle || !geometry(x, w, conv, y, &g)) return CUDNN_STATUS_BAD_PARAM;
  return list(Pass::Forward, g, conv->math, requested, returned, perf);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t handle, const cudnnFilterDescriptor_t w,
                                                          const cudnnTensorDescriptor_t dy,
                                                          const cudnnConvolutionDescriptor_t conv,
                                                          const cudnnTensorDescriptor_t dx, int requested,
                                                          int* returned, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
  Geom g;
  if (!handle || !geometry(dx, w, conv, dy, &g)) return CUDNN_STATUS_BAD_PARAM;
  return list(Pass::Data, g, conv->math, requested, returned, perf);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnnHandle_t handle, const cudnnTensorDescriptor_t x,
                                                            const cudnnTensorDescriptor_t dy,
                                                            const cudnnConvolutionDescriptor_t conv,
                                                            const cudnnFilterDescriptor_t dw, int requested,
                                                            int* returned, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
  Geom g;
  if (!handle || !geometry(x, dw, conv, dy, &g)) return CUDNN_STATUS_BAD_PARAM;
  return list(Pass::Filter, g, conv->math, requested, returned, perf);
}

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t handle, const void* alpha, const cudnnTensorDescriptor_t x_desc,
                                      const void* x, const cudnnFilterDescriptor_t w_desc, const void* w,
                                      const cudnnConvolutionDescriptor_t conv, cudnnConvolutionFwdAlgo_t algo,
                                      void* workspace, size_t workspace_bytes, const void* beta,
                                      const cudnnTensorDescriptor_t y_desc, void* y) {
  Geom g;
  if (!geometry(x_desc, w_desc, conv, y_desc, &g)) return CUDNN_STATUS_BAD_PARAM;
  return convolve(handle, Pass::Forward, g, algo, alpha, x, w, workspace, workspace_bytes, beta, y);
}
cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t handle, const void* alpha, const cudnnFilterDescriptor_t w_desc,
                                           const void* w, const cudnnTensorDescriptor_t dy_desc, const void* dy,
                                           const cudnnConvolutionDescriptor_t conv, cudnnConvolutionBwdDataAlgo_t algo,
                                           void* workspace, size_t workspace_bytes, const void* beta,
                                           const cudnnTensorDescriptor_t dx_desc, void* dx) {
  Geom g;
  if (!geometry(dx_desc, w_desc, conv, dy_desc, &g)) return CUDNN_STATUS_BAD_PARAM;
  return convolve(handle, Pass::Data, g, algo, alpha, dy, w, workspace, workspace_bytes, beta, dx);
}
cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t handle, const void* alpha,
                                             const cudnnTensorDescriptor_t x_desc, const void* x,
                                             const cudnnTensorDescriptor_t dy_desc, const void* dy,
                                             const cudnnConvolutionDescriptor_t conv,
                                             cudnnConvolutionBwdFilterAlgo_t algo, void* workspace,
                                             size_t workspace_bytes, const void* beta,
                                             const cudnnFilterDescriptor_t dw_desc, void* dw) {
  Geom g;
  if (!geometry(x_desc, dw_desc, conv, dy_desc, &g)) return CUDNN_STATUS_BAD_PARAM;
  return convolve(handle, Pass::Filter, g, algo, alpha, x, dy, workspace, workspace_bytes, beta, dw);
}
