// The CUDA emulator's own checks (tests/cuda_emu): the kernel language's collectives and barriers,
// streams, capture and replay, and the faults it must stop at. Compiled like the backend's .cu
// files (rewritten launches), so it is CUDA too: with nvcc it would run the same on a GPU (but the
// lazy streams' order, which is the emulator's).
//   emu_selftest            the checks that pass; exit 0 when all hold
//   emu_selftest CASE       one fault, which must abort the process with the emulator's report:
//                           past_end | divergent_barrier | exited_lane | bad_config | copy_past_end |
//                           host_pointer | host_touch | cudnn_outside | race_blocks | race_barrier
//                           | shared_unwritten | misaligned
//                           (the last four: with the race checker, EDGETRAIN_CUDA_EMU_RACES)
//   emu_selftest order      prints the order the blocks and threads of a launch ran in ("forward",
//                           or "reverse" under EDGETRAIN_CUDA_EMU_REVERSE=1)
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

// Each warp: lane sums by shuffles (down), an inclusive scan (up), a ballot of odd lanes.
__global__ void warp_kernel(const int* x, int* sum, int* scan, unsigned* ballot) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
  int s = x[i];
  for (int o = 16; o > 0; o /= 2) s += __shfl_down_sync(0xFFFFFFFFu, s, o);
  if (lane == 0) sum[i / 32] = s;
  int v = x[i];
  for (int d = 1; d < 32; d *= 2) {
    const int y = __shfl_up_sync(0xFFFFFFFFu, v, d);
    if (lane >= d) v += y;
  }
  scan[i] = v;
  const unsigned b = __ballot_sync(0xFFFFFFFFu, x[i] % 2 != 0);
  if (lane == 0) ballot[i / 32] = b;
}

// A block's reversal through shared memory: correct only if the barrier waits for every thread.
__global__ void reverse_kernel(const float* x, float* y, int n) {
  __shared__ float buf[256];
  const int t = threadIdx.x, base = blockIdx.x * blockDim.x;
  if (base + t < n) buf[t] = x[base + t];
  __syncthreads();
  const int r = blockDim.x - 1 - t;
  if (base + r < n && base + t < n) y[base + t] = buf[r];
}

__global__ void add_one(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.f;
}

// Each thread's turn: the order the emulator ran the threads and blocks in (on a GPU, any).
__global__ void tickets(unsigned* counter, unsigned* ticket) {
  ticket[blockIdx.x * blockDim.x + threadIdx.x] = atomicAdd(counter, 1u);
}

__global__ void read_past(const float* x, float* y, int n) { y[0] = x[n + 1024]; }

// Lane 0 waits at the block's barrier, the other lanes at a shuffle that needs lane 0: a hang on a GPU.
__global__ void divergent_barrier(int* x) {
  if (threadIdx.x == 0)
    __syncthreads();
  else
    x[threadIdx.x] = __shfl_down_sync(0xFFFFFFFFu, x[threadIdx.x], 1);
}

__global__ void exited_lane(const int* x, int* y) {
  if (threadIdx.x == 3) return;
  y[threadIdx.x] = __shfl_down_sync(0xFFFFFFFFu, x[threadIdx.x], 1);
}

// Races (the race checker): two blocks write one address; a thread reads its neighbour's shared
// element with no barrier after the neighbour's write.
__global__ void race_blocks(int* x) {
  if (threadIdx.x == 0) x[0] = int(blockIdx.x);
}
__global__ void race_barrier(const float* x, float* y) {
  __shared__ float buf[32];
  buf[threadIdx.x] = 0.f;  // (written before it is read: not the unwritten read below)
  __syncthreads();
  buf[threadIdx.x] = x[threadIdx.x];
  y[threadIdx.x] = buf[(threadIdx.x + 1) % 32];
}
// Thread 5 reads the shared element it skipped writing.
__global__ void shared_unwritten(float* y) {
  __shared__ float buf[32];
  if (threadIdx.x != 5) buf[threadIdx.x] = 1.f;
  __syncthreads();
  y[threadIdx.x] = buf[threadIdx.x];
}
// A 4-byte word read 2 bytes into a float array (the race checker's build sees the address).
__global__ void misaligned(const float* x, unsigned* y) {
  y[threadIdx.x] = *reinterpret_cast<const unsigned*>(reinterpret_cast<const char*>(x) + 2 + 4 * threadIdx.x);
}

// The traffic count's cases (EDGETRAIN_CUDA_EMU_TRAFFIC, emu_traffic.cpp), 64 threads each: a warp
// reading 32 consecutive floats takes 4 sectors; 32 floats 8 apart take 32; a warp writing a
// column of a 32 x 32 shared array hits one bank 32 times, of a 32 x 33 one every bank once.
__global__ void traffic_coalesced(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x]; }
__global__ void traffic_strided(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x * 8]; }
__global__ void traffic_banks(float* y) {
  __shared__ float square[32 * 32], padded[32 * 33];
  const unsigned lane = threadIdx.x % 32;
  if (threadIdx.x < 32) {
    square[lane * 32] = float(lane);
    padded[lane * 33] = float(lane);
  }
  __syncthreads();
  if (threadIdx.x < 32) y[lane] = square[lane * 32] + padded[lane * 33];
}

int run_checks() {
  const int n = 256;
  std::vector<int> hx(n);
  for (int i = 0; i < n; ++i) hx[i] = (i * 7 + 3) % 11;
  int *x, *sum, *scan;
  unsigned* ballot;
  cudaMalloc(&x, n * sizeof(int));
  cudaMalloc(&sum, 8 * sizeof(int));
  cudaMalloc(&scan, n * sizeof(int));
  cudaMalloc(&ballot, 8 * sizeof(unsigned));
  cudaMemcpy(x, hx.data(), n * sizeof(int), cudaMemcpyHostToDevice);
  warp_kernel<<<2, 128>>>(x, sum, scan, ballot);
  expect(cudaGetLastError() == cudaSuccess, "the warp kernel launches");
  std::vector<int> hsum(8), hscan(n);
  std::vector<unsigned> hballot(8);
  cudaMemcpy(hsum.data(), sum, 8 * sizeof(int), cudaMemcpyDeviceToHost);
  cudaMemcpy(hscan.data(), scan, n * sizeof(int), cudaMemcpyDeviceToHost);
  cudaMemcpy(hballot.data(), ballot, 8 * sizeof(unsigned), cudaMemcpyDeviceToHost);
  for (int w = 0; w < 8; ++w) {
    int s = 0, run = 0;
    unsigned odd = 0;
    bool scan_ok = true;
    for (int l = 0; l < 32; ++l) {
      s += hx[w * 32 + l];
      run += hx[w * 32 + l];
      scan_ok = scan_ok && hscan[w * 32 + l] == run;
      if (hx[w * 32 + l] % 2) odd |= 1u << l;
    }
    expect(hsum[w] == s, "a warp's shuffle-down sum");
    expect(scan_ok, "a warp's shuffle-up inclusive scan");
    expect(hballot[w] == odd, "a warp's ballot");
  }

  // A barrier: every thread's write is seen by the others (two blocks, a partial last one).
  const int m = 300;
  std::vector<float> hf(m), hr(m);
  for (int i = 0; i < m; ++i) hf[i] = float(i);
  float *f, *r;
  cudaMalloc(&f, m * sizeof(float));
  cudaMalloc(&r, m * sizeof(float));
  cudaMemcpy(f, hf.data(), m * sizeof(float), cudaMemcpyHostToDevice);
  reverse_kernel<<<2, 256>>>(f, r, m);
  cudaMemcpy(hr.data(), r, m * sizeof(float), cudaMemcpyDeviceToHost);
  bool rev = true;
  for (int i = 0; i < 256; ++i) rev = rev && hr[i] == float(255 - i);
  expect(rev, "a block reversed through shared memory after __syncthreads");

  // What the race checker must let pass: atomics of every block on one counter, and shared memory
  // used again by the next block (reverse_kernel above).
  unsigned *counter, *ticket;
  cudaMalloc(&counter, sizeof(unsigned));
  cudaMalloc(&ticket, 256 * sizeof(unsigned));
  cudaMemset(counter, 0, sizeof(unsigned));
  tickets<<<4, 64>>>(counter, ticket);
  unsigned count = 0;
  cudaMemcpy(&count, counter, sizeof(unsigned), cudaMemcpyDeviceToHost);
  expect(count == 256, "atomics of four blocks on one counter");
  cudaFree(counter);
  cudaFree(ticket);

  // A launch outside CUDA's limits fails with the error CUDA gives, and runs nothing.
  add_one<<<1, 2048>>>(f, m);
  expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "2048 threads a block: invalid configuration");
  add_one<<<0, 32>>>(f, m);
  expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "an empty grid: invalid configuration");

  // A record runs nothing until launched; each launch runs it again; a synchronising call while
  // recording fails, and so does the record.
  cudaStream_t s;
  cudaStreamCreate(&s);
  cudaMemset(f, 0, m * sizeof(float));
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  add_one<<<2, 256, 0, s>>>(f, m);
  cudaGraph_t g;
  expect(cudaStreamEndCapture(s, &g) == cudaSuccess, "a record ends");
  cudaMemcpy(hr.data(), f, m * sizeof(float), cudaMemcpyDeviceToHost);
  expect(hr[0] == 0.f && hr[m - 1] == 0.f, "a recorded launch runs nothing while recording");
  cudaGraphExec_t e;
  cudaGraphInstantiate(&e, g, 0);
  cudaGraphLaunch(e, s);
  cudaGraphLaunch(e, s);
  cudaStreamSynchronize(s);
  cudaMemcpy(hr.data(), f, m * sizeof(float), cudaMemcpyDeviceToHost);
  expect(hr[0] == 2.f && hr[m - 1] == 2.f, "each replay runs the record");
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  expect(cudaMemcpy(hr.data(), f, 4, cudaMemcpyDeviceToHost) != cudaSuccess, "a synchronous copy while recording fails");
  void* p = nullptr;
  expect(cudaMalloc(&p, 64) != cudaSuccess, "cudaMalloc while recording fails");
  cudaGraph_t bad;
  expect(cudaStreamEndCapture(s, &bad) == cudaErrorStreamCaptureInvalidated && bad == nullptr,
         "a record with a prohibited call is invalidated");
  (void)cudaGetLastError();
  cudaGraphExecDestroy(e);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);

  // cuDNN (emu_cudnn.cpp): a forward convolution against the host's sums, beta accumulating,
  // recorded in stream order; the checks it makes of its caller.
  {
    const int N = 2, C = 3, H = 5, W = 5, K = 4;  // 3 x 3, pad 1: y is N x K x 5 x 5
    std::vector<float> hx(N * C * H * W), hw(K * C * 9), hy(N * K * H * W);
    for (size_t i = 0; i < hx.size(); ++i) hx[i] = float(int(i % 7) - 3);
    for (size_t i = 0; i < hw.size(); ++i) hw[i] = float(int(i % 5) - 2) * 0.5f;
    float *dx, *dw, *dy;
    cudaMalloc(&dx, hx.size() * 4);
    cudaMalloc(&dw, hw.size() * 4);
    cudaMalloc(&dy, hy.size() * 4);
    cudaMemcpy(dx, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dw, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice);
    cudnnHandle_t h;
    cudnnTensorDescriptor_t xd, yd, bad_yd;
    cudnnFilterDescriptor_t wd;
    cudnnConvolutionDescriptor_t cd;
    expect(cudnnCreate(&h) == CUDNN_STATUS_SUCCESS, "cudnnCreate");
    cudnnCreateTensorDescriptor(&xd);
    cudnnCreateTensorDescriptor(&yd);
    cudnnCreateTensorDescriptor(&bad_yd);
    cudnnCreateFilterDescriptor(&wd);
    cudnnCreateConvolutionDescriptor(&cd);
    cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, C, H, W);
    cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, K, H, W);
    cudnnSetTensor4dDescriptor(bad_yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, K, H - 1, W);
    cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, K, C, 3, 3);
    cudnnSetConvolution2dDescriptor(cd, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT);
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int returned = 0;
    cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &returned, perf);
    bool listed_gemm = false, direct_unsupported = false;
    for (int i = 0; i < returned; ++i) {
      listed_gemm |= perf[i].algo == CUDNN_CONVOLUTION_FWD_ALGO_GEMM && perf[i].memory > 0;
      direct_unsupported |= perf[i].algo == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT && perf[i].status != CUDNN_STATUS_SUCCESS;
    }
    expect(returned == CUDNN_CONVOLUTION_FWD_ALGO_COUNT && listed_gemm && direct_unsupported,
           "cuDNN's forward list: every algorithm, GEMM with workspace, DIRECT unsupported");
    const float one = 1.f, zero = 0.f;
    expect(cudnnConvolutionForward(h, &one, xd, dx, wd, dw, cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, nullptr, 0,
                                   &zero, bad_yd, dy) == CUDNN_STATUS_BAD_PARAM,
           "cuDNN: an output descriptor of another shape is a bad parameter");
    expect(cudnnConvolutionForward(h, &one, xd, dx, wd, dw, cd, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, nullptr, 0, &zero, yd,
                                   dy) == CUDNN_STATUS_BAD_PARAM,
           "cuDNN: less workspace than the algorithm needs is a bad parameter");
    // The host's sums, then the device's in a record (nothing runs until it is launched), twice
    // with beta = 1 after a first launch with beta = 0: 2x.
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k)
        for (int p = 0; p < H; ++p)
          for (int q = 0; q < W; ++q) {
            double acc = 0;
            for (int c = 0; c < C; ++c)
              for (int r = 0; r < 3; ++r)
                for (int u = 0; u < 3; ++u) {
                  const int hh = p - 1 + r, ww = q - 1 + u;
                  if (hh >= 0 && hh < H && ww >= 0 && ww < W)
                    acc += double(hx[((n * C + c) * H + hh) * W + ww]) * hw[((k * C + c) * 3 + r) * 3 + u];
                }
            hy[((n * K + k) * H + p) * W + q] = float(acc);
          }
    cudaStream_t cs;
    cudaStreamCreate(&cs);
    cudnnSetStream(h, cs);
    expect(cudnnConvolutionForward(h, &one, xd, dx, wd, dw, cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, nullptr, 0,
                                   &zero, yd, dy) == CUDNN_STATUS_SUCCESS,
           "cuDNN's forward runs");
    cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal);
    cudnnConvolutionForward(h, &one, xd, dx, wd, dw, cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, nullptr, 0, &one, yd,
                            dy);
    cudaGraph_t cg;
    expect(cudaStreamEndCapture(cs, &cg) == cudaSuccess, "a record of a cuDNN call ends");
    std::vector<float> got(hy.size());
    cudaMemcpy(got.data(), dy, got.size() * 4, cudaMemcpyDeviceToHost);
    bool once = true;
    for (size_t i = 0; i < hy.size(); ++i) once = once && got[i] == hy[i];
    expect(once, "cuDNN's forward: the host's sums (beta = 0), nothing run by the record yet");
    cudaGraphExec_t ce;
    cudaGraphInstantiate(&ce, cg, 0);
    cudaGraphLaunch(ce, cs);
    cudaStreamSynchronize(cs);
    cudaMemcpy(got.data(), dy, got.size() * 4, cudaMemcpyDeviceToHost);
    bool twice = true;
    for (size_t i = 0; i < hy.size(); ++i) twice = twice && got[i] == 2.f * hy[i];
    expect(twice, "cuDNN's forward replayed with beta = 1 adds the sums again");
    cudaGraphExecDestroy(ce);
    cudaGraphDestroy(cg);
    cudaStreamDestroy(cs);
    cudnnDestroyConvolutionDescriptor(cd);
    cudnnDestroyFilterDescriptor(wd);
    cudnnDestroyTensorDescriptor(bad_yd);
    cudnnDestroyTensorDescriptor(yd);
    cudnnDestroyTensorDescriptor(xd);
    cudnnDestroy(h);
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dy);
  }

  // Lazy streams (EDGETRAIN_CUDA_EMU_STREAMS, lazy by default): a non-blocking stream's work runs
  // when something waits for it. The legacy stream's copy does not; a stream that waits for its
  // event does; one that does not reads what was there before.
  // (The emulator's order: a GPU runs the first kernel whenever it likes.)
  const char* mode = std::getenv("EDGETRAIN_CUDA_EMU_STREAMS");
#if defined(EDGETRAIN_CUDA_EMULATOR)
  const bool lazy = !mode || !*mode || !std::strcmp(mode, "lazy");
#else
  const bool lazy = false;
#endif
  if (lazy) {
    cudaStream_t s1, s2;
    cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
    cudaEvent_t added;
    cudaEventCreateWithFlags(&added, cudaEventDisableTiming);
    float* v;  // v[0], and v[1] its copy (reverse_kernel of one element)
    cudaMalloc(&v, 2 * sizeof(float));
    cudaMemset(v, 0, 2 * sizeof(float));
    float h[2] = {-1.f, -1.f};
    add_one<<<1, 1, 0, s1>>>(v, 1);
    cudaMemcpy(h, v, sizeof(h), cudaMemcpyDeviceToHost);
    expect(h[0] == 0.f, "lazy streams: the legacy stream's copy does not wait for a non-blocking stream");
    cudaEventRecord(added, s1);
    cudaStreamWaitEvent(s2, added, 0);
    reverse_kernel<<<1, 1, 0, s2>>>(v, v + 1, 1);
    cudaStreamSynchronize(s2);
    cudaMemcpy(h, v, sizeof(h), cudaMemcpyDeviceToHost);
    expect(h[0] == 1.f && h[1] == 1.f, "lazy streams: a stream that waits for an event sees the work before it");
    add_one<<<1, 1, 0, s1>>>(v, 1);
    reverse_kernel<<<1, 1, 0, s2>>>(v, v + 1, 1);  // no wait: reads v[0] before s1's add
    cudaStreamSynchronize(s2);
    cudaStreamSynchronize(s1);
    cudaMemcpy(h, v, sizeof(h), cudaMemcpyDeviceToHost);
    expect(h[0] == 2.f && h[1] == 1.f, "lazy streams: a stream that does not wait reads what was there before");
    cudaFree(v);
    cudaEventDestroy(added);
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
  }

  // Fresh device memory is not zero; memory is freed once.
  float* fresh;
  cudaMalloc(&fresh, 16);
  unsigned word = 0;
  cudaMemcpy(&word, fresh, 4, cudaMemcpyDeviceToHost);
  expect(word != 0, "fresh device memory is not zero");
  expect(cudaFree(fresh) == cudaSuccess && cudaFree(fresh) != cudaSuccess, "a second cudaFree fails");
  (void)cudaGetLastError();
  for (void* q : {static_cast<void*>(x), static_cast<void*>(sum), static_cast<void*>(scan),
                  static_cast<void*>(ballot), static_cast<void*>(f), static_cast<void*>(r)})
    cudaFree(q);
  std::printf("%s\n", failures ? "emu_selftest: FAILED" : "emu_selftest: all checks passed");
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return run_checks();
  if (!std::strcmp(argv[1], "order")) {
    const int n = 2 * 64;
    unsigned *counter, *ticket;
    cudaMalloc(&counter, sizeof(unsigned));
    cudaMalloc(&ticket, n * sizeof(unsigned));
    cudaMemset(counter, 0, sizeof(unsigned));
    tickets<<<2, 64>>>(counter, ticket);
    std::vector<unsigned> t(n);
    cudaMemcpy(t.data(), ticket, n * sizeof(unsigned), cudaMemcpyDeviceToHost);
    bool forward = true, reverse = true;
    for (int i = 0; i < n; ++i) forward &= t[size_t(i)] == unsigned(i), reverse &= t[size_t(i)] == unsigned(n - 1 - i);
    std::printf("order: %s\n", forward ? "forward" : reverse ? "reverse" : "other");
    return 0;
  }
  float *a, *b;
  cudaMalloc(&a, 1000 * sizeof(float));
  cudaMalloc(&b, 1000 * sizeof(float));
  int *xi, *yi;
  cudaMalloc(&xi, 32 * sizeof(int));
  cudaMalloc(&yi, 32 * sizeof(int));
  if (!std::strcmp(argv[1], "past_end")) read_past<<<1, 1>>>(a, b, 1000);
  else if (!std::strcmp(argv[1], "divergent_barrier")) divergent_barrier<<<1, 32>>>(xi);
  else if (!std::strcmp(argv[1], "exited_lane")) exited_lane<<<1, 32>>>(xi, yi);
  else if (!std::strcmp(argv[1], "copy_past_end")) cudaMemcpy(a, b, 1001 * sizeof(float), cudaMemcpyDeviceToDevice);
  else if (!std::strcmp(argv[1], "host_pointer")) {
    static float on_host[1000];
    add_one<<<1, 32>>>(on_host, 1000);
  } else if (!std::strcmp(argv[1], "host_touch")) {
    std::printf("%f\n", a[0]);  // a device pointer read by the host
  } else if (!std::strcmp(argv[1], "cudnn_outside")) {  // y of 2 x 4 x 5 x 5 in a 1000-float allocation
    cudnnHandle_t h;
    cudnnTensorDescriptor_t xd, yd;
    cudnnFilterDescriptor_t wd;
    cudnnConvolutionDescriptor_t cd;
    cudnnCreate(&h);
    cudnnCreateTensorDescriptor(&xd);
    cudnnCreateTensorDescriptor(&yd);
    cudnnCreateFilterDescriptor(&wd);
    cudnnCreateConvolutionDescriptor(&cd);
    cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 2, 3, 5, 5);
    cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 2, 4, 5, 5);
    cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, 4, 3, 3, 3);
    cudnnSetConvolution2dDescriptor(cd, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT);
    const float one = 1.f, zero = 0.f;
    cudnnConvolutionForward(h, &one, xd, a, wd, b, cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, nullptr, 0, &zero, yd,
                            a + 900);
  } else if (!std::strcmp(argv[1], "race_blocks")) {
    race_blocks<<<2, 32>>>(xi);
  } else if (!std::strcmp(argv[1], "race_barrier")) {
    race_barrier<<<1, 32>>>(a, b);
  } else if (!std::strcmp(argv[1], "shared_unwritten")) {
    shared_unwritten<<<1, 32>>>(b);
  } else if (!std::strcmp(argv[1], "misaligned")) {
    misaligned<<<1, 32>>>(a, reinterpret_cast<unsigned*>(b));
  } else if (!std::strcmp(argv[1], "traffic")) {
    traffic_coalesced<<<1, 64>>>(a, b);
    traffic_strided<<<1, 64>>>(a, b);
    traffic_banks<<<1, 64>>>(b);
    cudaDeviceSynchronize();
  } else if (!std::strcmp(argv[1], "bad_config")) {
    add_one<<<1, 1025>>>(a, 1000);
    if (cudaGetLastError() != cudaSuccess) std::abort();
  }
  std::printf("emu_selftest %s: no fault\n", argv[1]);
  return 0;
}
