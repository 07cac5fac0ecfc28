// cuDNN's convolutions (cuda_conv_cudnn.h): descriptors and the measured choice per geometry.
#include "backends/cuda/cuda_conv_cudnn.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(EDGETRAIN_WITH_CUDNN)
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <map>
#include <string>

#include "backends/cuda/cuda_backend_impl.h"
#endif

namespace et {
namespace cuda {

#if !defined(EDGETRAIN_WITH_CUDNN)

std::unique_ptr<CudnnConvs> make_cudnn_convs(CUstream_st*) { return nullptr; }

#else

namespace {

void check_dnn(cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS) user_error("cuDNN: ", what, " failed: ", cudnnGetErrorString(s));
}

constexpr int kPasses = 3;
constexpr int kMaxAlgos = std::max({int(CUDNN_CONVOLUTION_FWD_ALGO_COUNT), int(CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT),
                                    int(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT)});
int pass_index(ConvPass p) { return p == ConvPass::Forward ? 0 : p == ConvPass::BackwardData ? 1 : 2; }

using Key = std::array<int64_t, 10>;
Key key_of(const Conv2dGeom& g) {
  return Key{{g.N, g.C, g.H, g.W, g.K, g.R, g.S, g.stride_h * 1000 + g.stride_w, g.pad_h * 1000 + g.pad_w, g.groups}};
}

// One geometry's descriptors and its three passes' choices, for f32 operands and for a weight
// gradient's x decoded into the workspace (CudnnConvs' x_decoded).
struct Entry {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  // [x_decoded][pass]: the choice, and the workspace the chosen algorithm needs.
  int choice[2][kPasses] = {{CudnnConvs::kUnmeasured, CudnnConvs::kUnmeasured, CudnnConvs::kUnmeasured},
                            {CudnnConvs::kUnmeasured, CudnnConvs::kUnmeasured, CudnnConvs::kUnmeasured}};
  size_t workspace[2][kPasses] = {{0, 0, 0}, {0, 0, 0}};
};

// Deterministic FP32 algorithms without tensor-op math that fit the workspace, best first.
template <class Perf>
int candidates(const Perf* perf, int returned, size_t ws_bytes, int* out, size_t* memory, int max_out) {
  int n = 0;
  for (int i = 0; i < returned && n < max_out; ++i) {
    const Perf& p = perf[i];
    if (p.status != CUDNN_STATUS_SUCCESS || p.memory > ws_bytes || p.determinism != CUDNN_DETERMINISTIC) continue;
    if (p.mathType == CUDNN_TENSOR_OP_MATH || p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    memory[n] = p.memory;
    out[n++] = int(p.algo);
  }
  return n;
}

class CudnnConvsImpl final : public CudnnConvs {
 public:
  CudnnConvsImpl(cudnnHandle_t h, cudaStream_t stream, bool always) : h_(h), stream_(stream), always_(always) {}
  ~CudnnConvsImpl() override {
    for (auto& kv : entries_) {
      cudnnDestroyTensorDescriptor(kv.second.x);
      cudnnDestroyTensorDescriptor(kv.second.y);
      cudnnDestroyFilterDescriptor(kv.second.w);
      cudnnDestroyConvolutionDescriptor(kv.second.conv);
    }
    cudnnDestroy(h_);
  }

  int choice(const Conv2dGeom& g, ConvPass pass, bool x_decoded) const override {
    const auto it = entries_.find(key_of(g));
    return it == entries_.end() ? kUnmeasured : it->second.choice[x_decoded][pass_index(pass)];
  }

  bool forced() const override { return always_; }

  size_t workspace(const Conv2dGeom& g, ConvPass pass, bool x_decoded) const override {
    const auto it = entries_.find(key_of(g));
    return it == entries_.end() ? 0 : it->second.workspace[x_decoded][pass_index(pass)];
  }

  int measure(const Conv2dGeom& g, ConvPass pass, bool x_decoded, const float* a, const float* b, float* out,
              Workspace ws, float own_ms) override {
    Entry& e = entry(g);
    // Every candidate, not the heuristics' first few: their order is a guess (a Winograd or FFT
    // tiling that fits can rank below slower implicit GEMMs), and each is timed once per geometry.
    int algos[kMaxAlgos];
    size_t memory[kMaxAlgos];
    const int n = candidate_algos(e, pass, ws.bytes, algos, memory, kMaxAlgos);
    int best = kOwn;
    size_t best_memory = 0;
    float best_ms = always_ ? 1e30f : own_ms;
    cudaEvent_t t0, t1;
    cuda::check(cudaEventCreate(&t0), "cudaEventCreate");
    cuda::check(cudaEventCreate(&t1), "cudaEventCreate");
    for (int i = 0; i < n; ++i) {
      float ms = 1e30f;
      for (int rep = 0; rep < 3; ++rep) {  // the first includes cuDNN's own first-call set-up
        cuda::check(cudaEventRecord(t0, stream_), "cudaEventRecord");
        launch(e, pass, algos[i], a, b, out, false, ws);
        cuda::check(cudaEventRecord(t1, stream_), "cudaEventRecord");
        cuda::check(cudaEventSynchronize(t1), "cudaEventSynchronize");
        float t = 0.f;
        cuda::check(cudaEventElapsedTime(&t, t0, t1), "cudaEventElapsedTime");
        ms = std::min(ms, t);
      }
      if (ms < best_ms) best = algos[i], best_ms = ms, best_memory = memory[i];
    }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    e.choice[x_decoded][pass_index(pass)] = best;
    e.workspace[x_decoded][pass_index(pass)] = best_memory;
    return best;
  }

  void run(const Conv2dGeom& g, ConvPass pass, int algo, const float* a, const float* b, float* out, bool accumulate,
           Workspace ws) override {
    launch(entry(g), pass, algo, a, b, out, accumulate, ws);
  }

 private:
  Entry& entry(const Conv2dGeom& g) {
    const Key k = key_of(g);
    auto it = entries_.find(k);
    if (it != entries_.end()) return it->second;
    Entry e;
    check_dnn(cudnnCreateTensorDescriptor(&e.x), "cudnnCreateTensorDescriptor");
    check_dnn(cudnnCreateTensorDescriptor(&e.y), "cudnnCreateTensorDescriptor");
    check_dnn(cudnnCreateFilterDescriptor(&e.w), "cudnnCreateFilterDescriptor");
    check_dnn(cudnnCreateConvolutionDescriptor(&e.conv), "cudnnCreateConvolutionDescriptor");
    check_dnn(cudnnSetTensor4dDescriptor(e.x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, int(g.N), int(g.C), int(g.H),
                                         int(g.W)),
              "cudnnSetTensor4dDescriptor");
    check_dnn(cudnnSetTensor4dDescriptor(e.y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, int(g.N), int(g.K), int(g.P),
                                         int(g.Q)),
              "cudnnSetTensor4dDescriptor");
    check_dnn(cudnnSetFilter4dDescriptor(e.w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, int(g.K), int(g.C / g.groups),
                                         int(g.R), int(g.S)),
              "cudnnSetFilter4dDescriptor");
    check_dnn(cudnnSetConvolution2dDescriptor(e.conv, int(g.pad_h), int(g.pad_w), int(g.stride_h), int(g.stride_w), 1,
                                              1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
              "cudnnSetConvolution2dDescriptor");
    check_dnn(cudnnSetConvolutionGroupCount(e.conv, int(g.groups)), "cudnnSetConvolutionGroupCount");
    // FMA kernels only: no TF32 (CUDNN_DEFAULT_MATH lets Ampere and later use it for FP32).
    check_dnn(cudnnSetConvolutionMathType(e.conv, CUDNN_FMA_MATH), "cudnnSetConvolutionMathType");
    return entries_.emplace(k, e).first->second;
  }

  int candidate_algos(const Entry& e, ConvPass pass, size_t ws_bytes, int* out, size_t* memory, int max_out) {
    int returned = 0;
    if (pass == ConvPass::Forward) {
      cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
      check_dnn(cudnnGetConvolutionForwardAlgorithm_v7(h_, e.x, e.w, e.conv, e.y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                                                       &returned, perf),
                "cudnnGetConvolutionForwardAlgorithm_v7");
      return candidates(perf, returned, ws_bytes, out, memory, max_out);
    }
    if (pass == ConvPass::BackwardData) {
      cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
      check_dnn(cudnnGetConvolutionBackwardDataAlgorithm_v7(h_, e.w, e.y, e.conv, e.x,
                                                            CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &returned, perf),
                "cudnnGetConvolutionBackwardDataAlgorithm_v7");
      return candidates(perf, returned, ws_bytes, out, memory, max_out);
    }
    cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
    check_dnn(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h_, e.x, e.y, e.conv, e.w,
                                                            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &returned, perf),
              "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
    return candidates(perf, returned, ws_bytes, out, memory, max_out);
  }

  void launch(const Entry& e, ConvPass pass, int algo, const float* a, const float* b, float* out, bool accumulate,
              Workspace ws) {
    const float one = 1.f, beta = accumulate ? 1.f : 0.f;
    if (pass == ConvPass::Forward)
      check_dnn(cudnnConvolutionForward(h_, &one, e.x, a, e.w, b, e.conv, cudnnConvolutionFwdAlgo_t(algo), ws.data,
                                        ws.bytes, &beta, e.y, out),
                "cudnnConvolutionForward");
    else if (pass == ConvPass::BackwardData)
      check_dnn(cudnnConvolutionBackwardData(h_, &one, e.w, b, e.y, a, e.conv, cudnnConvolutionBwdDataAlgo_t(algo),
                                             ws.data, ws.bytes, &beta, e.x, out),
                "cudnnConvolutionBackwardData");
    else
      check_dnn(cudnnConvolutionBackwardFilter(h_, &one, e.x, a, e.y, b, e.conv, cudnnConvolutionBwdFilterAlgo_t(algo),
                                               ws.data, ws.bytes, &beta, e.w, out),
                "cudnnConvolutionBackwardFilter");
  }

  cudnnHandle_t h_ = nullptr;
  cudaStream_t stream_;  // the backend's: cuDNN's work and the measurement's events
  bool always_;
  std::map<Key, Entry> entries_;
};

}  // namespace

std::unique_ptr<CudnnConvs> make_cudnn_convs(CUstream_st* stream) {
  const char* env = std::getenv("EDGETRAIN_CUDA_CONV");
  const std::string mode = env ? env : "auto";
  if (mode != "auto" && mode != "im2col" && mode != "cudnn")
    user_error("EDGETRAIN_CUDA_CONV='", mode, "': expected auto, im2col or cudnn");
  if (mode == "im2col") return nullptr;
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t st = cudnnCreate(&h);
  if (st != CUDNN_STATUS_SUCCESS) {  // a library that loads but cannot start: im2col, and say so
    std::fprintf(stderr, "note: cuDNN did not start (%s); CUDA convolutions use their own kernels\n",
                 cudnnGetErrorString(st));
    return nullptr;
  }
  check_dnn(cudnnSetStream(h, stream), "cudnnSetStream");
  return std::unique_ptr<CudnnConvs>(new CudnnConvsImpl(h, stream, mode == "cudnn"));
}

#endif

}  // namespace cuda
}  // namespace et
