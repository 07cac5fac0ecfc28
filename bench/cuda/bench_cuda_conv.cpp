// bench_cuda_conv: the CUDA backend's conv2d passes against cuBLAS SGEMM on GEMMs of the same
// shapes, in the same run (issue 13's target: each pass at >= 50 % of the SGEMM rate). For every
// distinct conv shape of ResNet-20, ResNet-18, VGG16-BN and MobileNetV2 (bench/conv_shapes.h) at batch 128:
//   forward          Y [K x N*PQ]   = W [K x CRS]      X_col [CRS x N*PQ]
//   backward data    dX_col [CRS x N*PQ] = W^T [CRS x K] dY [K x N*PQ]
//   backward weight  dW [K x CRS]   = dY [K x N*PQ]    X_col^T [N*PQ x CRS]
// Times are CUDA-event medians of --reps after one warm-up; "of SGEMM" is the SGEMM's time over
// the pass's (1.0: the pass runs at the rate cuBLAS reaches on its GEMM alone). Depthwise convs
// have no GEMM and print their times only. FP32 throughout (no TF32), as the backend computes.
// bwd_w16: the weight gradient with x as an fp16 stash keeps it (the own kernels reading it in
// place, or cuDNN over it decoded into the workspace, as measured), beside bwd_w over f32 x.
//
//   bench_cuda_conv [--filter SUBSTR] [--reps N] [--batch N] [--device N]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "bench/conv_shapes.h"

using namespace et;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_cuda_conv: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_cuda_conv: %s: cuBLAS status %d\n", what, int(s));
    std::exit(1);
  }
}

// A device buffer of `floats`, filled with small values through the backend.
struct DevBuf {
  float* p = nullptr;
  Tensor t;
  DevBuf(Backend& be, const Shape& s, float value) {
    check(cudaMalloc(&p, size_t(s.numel()) * 4 + 16), "cudaMalloc");
    t = Tensor::contiguous(p, s, DType::F32, Device::CUDA);
    be.fill(t, value);
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
};

template <class F>
double time_ms(int reps, F&& f) {
  f();  // warm-up (also cuBLAS's first-call setup)
  check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(a), "cudaEventRecord");
    f();
    check(cudaEventRecord(b), "cudaEventRecord");
    check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0.f;
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string filter;
  int reps = 20, device = 0;
  int64_t batch = 128;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--filter" && i + 1 < argc) filter = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--batch" && i + 1 < argc) batch = std::max(1, std::atoi(argv[++i]));
    else if (a == "--device" && i + 1 < argc) device = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_cuda_conv [--filter SUBSTR] [--reps N] [--batch N] [--device N]\n");
      return 2;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n <= device) {
    std::fprintf(stderr, "bench_cuda_conv: no CUDA device %d\n", device);
    return 1;
  }
  const std::unique_ptr<Backend> be = make_cuda_backend(device);
  cublasHandle_t blas;
  check(cublasCreate(&blas), "cublasCreate");
  check(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");  // FP32, no TF32
  std::printf("%s, batch %ld, median of %d (CUDA events)\n", be->name().c_str(), long(batch), reps);
  std::printf("%-12s %-24s %3s | %8s %8s %8s %8s | %8s %8s %8s | %6s %6s %6s  (ms | SGEMM ms / ours)\n", "net",
              "shape", "n", "fwd", "bwd_d", "bwd_w", "bwd_w16", "gemm_f", "gemm_d", "gemm_w", "fwd", "bwd_d", "bwd_w");
  std::map<std::string, double> ours, ours_dense, gemm;
  for (const bench::Shape2& s : bench::all_shapes()) {
    const std::string full = s.net + "/" + s.name;
    if (!filter.empty() && full.find(filter) == std::string::npos) continue;
    Conv2dGeom g;
    g.N = batch, g.C = s.C, g.H = s.H, g.W = s.W, g.K = s.K, g.R = g.S = s.R;
    g.stride_h = g.stride_w = s.stride;
    g.pad_h = g.pad_w = s.R / 2;
    g.groups = s.groups;
    g.infer_output();
    DevBuf x(*be, {g.N, g.C, g.H, g.W}, 0.5f), w(*be, {g.K, g.C / g.groups, g.R, g.S}, 0.01f);
    DevBuf y(*be, {g.N, g.K, g.P, g.Q}, 0.f), dy(*be, {g.N, g.K, g.P, g.Q}, 0.25f);
    DevBuf dx(*be, {g.N, g.C, g.H, g.W}, 0.f), dw(*be, {g.K, g.C / g.groups, g.R, g.S}, 0.f);
    size_t wsb = 0;
    for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight})
      wsb = std::max(wsb, be->conv2d_workspace_bytes(g, p));
    void* wsp = nullptr;
    check(cudaMalloc(&wsp, wsb + 16), "cudaMalloc");
    const Workspace ws{wsp, wsb};
    Tensor none;
    const double tf = time_ms(reps, [&] { be->conv2d_forward(g, x.t, w.t, none, y.t, ws); });
    const double td = time_ms(reps, [&] { be->conv2d_backward_data(g, dy.t, w.t, dx.t, false, ws); });
    const double tw = time_ms(reps, [&] { be->conv2d_backward_weight(g, x.t, dy.t, dw.t, none, false, ws); });
    void* x16p = nullptr;  // fp16 x: 0x3C3C, about 1.06, in every element
    check(cudaMalloc(&x16p, size_t(g.N * g.C * g.H * g.W) * 2 + 16), "cudaMalloc");
    check(cudaMemset(x16p, 0x3C, size_t(g.N * g.C * g.H * g.W) * 2), "cudaMemset");
    const Tensor x16 = Tensor::contiguous(x16p, {g.N, g.C, g.H, g.W}, DType::F16, Device::CUDA);
    const double tw16 = time_ms(reps, [&] { be->conv2d_backward_weight(g, x16, dy.t, dw.t, none, false, ws); });
    cudaFree(x16p);
    ours[s.net] += double(s.count) * (tf + td + tw);
    if (s.groups != 1) {
      std::printf("%-12s %-24s %3ld | %8.3f %8.3f %8.3f %8.3f | (depthwise: no GEMM)\n", s.net.c_str(),
                  s.name.c_str(), long(s.count), tf, td, tw, tw16);
      cudaFree(wsp);
      continue;
    }
    // The three GEMMs, column-major to cuBLAS: an m x n result from m x k and k x n operands.
    const int64_t M = g.K, L = g.N * g.P * g.Q, CRS = g.C * g.R * g.S;
    float *A = nullptr, *B = nullptr, *C = nullptr;
    const int64_t big = std::max({M * CRS, CRS * L, M * L});
    check(cudaMalloc(&A, size_t(big) * 4), "cudaMalloc");
    check(cudaMalloc(&B, size_t(big) * 4), "cudaMalloc");
    check(cudaMalloc(&C, size_t(big) * 4), "cudaMalloc");
    check(cudaMemset(A, 0, size_t(big) * 4), "cudaMemset");
    check(cudaMemset(B, 0, size_t(big) * 4), "cudaMemset");
    const float one = 1.f, zero = 0.f;
    auto sgemm = [&](int64_t m, int64_t nn, int64_t k) {
      return time_ms(reps, [&] {
        check(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, int(m), int(nn), int(k), &one, A, int(m), B, int(k), &zero, C,
                          int(m)),
              "cublasSgemm");
      });
    };
    const double gf = sgemm(M, L, CRS), gd = sgemm(CRS, L, M), gw = sgemm(M, CRS, L);
    gemm[s.net] += double(s.count) * (gf + gd + gw);
    ours_dense[s.net] += double(s.count) * (tf + td + tw);
    std::printf("%-12s %-24s %3ld | %8.3f %8.3f %8.3f %8.3f | %8.3f %8.3f %8.3f | %6.2f %6.2f %6.2f\n",
                s.net.c_str(), s.name.c_str(), long(s.count), tf, td, tw, tw16, gf, gd, gw, gf / tf, gd / td, gw / tw);
    std::fflush(stdout);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    cudaFree(wsp);
  }
  for (const auto& [net, ms] : ours) {
    const auto gi = gemm.find(net);
    std::printf("total %-12s %8.2f ms per batch (fwd + bwd_data + bwd_weight, weighted by count)", net.c_str(), ms);
    if (gi != gemm.end())
      std::printf("; dense convs %.2f ms, their GEMMs in cuBLAS %.2f ms (%.2f of the SGEMM rate)", ours_dense[net],
                  gi->second, gi->second / ours_dense[net]);
    std::printf("\n");
  }
  cublasDestroy(blas);
  return 0;
}
