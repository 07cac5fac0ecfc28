// CudaBackend: device, memory, copies, reductions for the host (finiteness, tensor statistics),
// softmax cross-entropy and the SGD step; what it does not run yet. The other kernels:
// cuda_elementwise.cu, cuda_batchnorm.cu, cuda_pooling.cu, cuda_conv.cu, cuda_quant.cu (4-bit).
#include <cfloat>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/cuda_device.h"
#include "backends/cuda/cuda_stash_codec.h"

namespace et {

namespace cuda {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) user_error("CUDA: ", what, " failed: ", cudaGetErrorString(e));
}

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) user_error("cuBLAS: ", what, " failed (status ", int(s), ")");
}

}  // namespace cuda

namespace {

using cuda::blocks_for;
using cuda::kThreads;

__global__ void fill_kernel(float* p, int64_t n, float v) {
  ET_GRID_STRIDE(i, n) p[i] = v;
}

// The entry of a tensor list (cuda::ListEntry, starts ascending, none empty) holding element j of
// its index space.
__device__ __forceinline__ int entry_of(const cuda::ListEntry* e, int count, int64_t j) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (e[mid].start <= j) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Counts the non-finite elements (|x| > FLT_MAX fails for NaN and infinities) of a list of tensors
// (all_finite: every parameter's gradient in one launch).
__global__ void count_nonfinite_list_kernel(const cuda::ListEntry* e, int count, int64_t total, unsigned long long* bad) {
  unsigned long long local = 0;
  ET_GRID_STRIDE(j, total) {
    const cuda::ListEntry& t = e[entry_of(e, count, j)];
    local += !(fabsf(t.p[j - t.start]) <= FLT_MAX);
  }
  if (local) atomicAdd(bad, local);
}

// Sum of squares and of |x| (doubles), max |x| over the finite values, and the non-finite count:
// each block's part into part[blockIdx.x], which stats_finish_kernel adds in a fixed order, so the
// sums (and the SAWB scales made from them) are the same in every run.
struct StatsPart {
  double sq, ab;
  unsigned long long bad;
  unsigned int max_bits;
  unsigned int unused;  // the padding, named so that the braced initialisations zero it: a copy
                        // of the struct (shared memory to device memory) reads no unwritten bytes
};

__global__ void stats_kernel(const float* x, int64_t n, StatsPart* part) {
  __shared__ double s_sq[kThreads], s_abs[kThreads];
  __shared__ unsigned int s_max[kThreads];
  __shared__ unsigned long long s_bad[kThreads];
  double sq = 0, ab = 0;
  unsigned int mx = 0;
  unsigned long long nonfinite = 0;
  ET_GRID_STRIDE(i, n) {
    const float a = fabsf(x[i]);
    if (!(a <= FLT_MAX)) {
      ++nonfinite;
      continue;
    }
    sq += double(a) * double(a);
    ab += double(a);
    mx = max(mx, __float_as_uint(a));  // non-negative floats order like their bits
  }
  s_sq[threadIdx.x] = sq;
  s_abs[threadIdx.x] = ab;
  s_max[threadIdx.x] = mx;
  s_bad[threadIdx.x] = nonfinite;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      s_sq[threadIdx.x] += s_sq[threadIdx.x + s];
      s_abs[threadIdx.x] += s_abs[threadIdx.x + s];
      s_max[threadIdx.x] = max(s_max[threadIdx.x], s_max[threadIdx.x + s]);
      s_bad[threadIdx.x] += s_bad[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = StatsPart{s_sq[0], s_abs[0], s_bad[0], s_max[0], 0u};
}

// One block: part[0] = the sum of part[0..blocks).
__global__ void stats_finish_kernel(StatsPart* part, int blocks) {
  __shared__ StatsPart s[kThreads];
  StatsPart a{0, 0, 0, 0, 0};
  for (int b = threadIdx.x; b < blocks; b += kThreads) {
    const StatsPart p = part[b];
    a.sq += p.sq;
    a.ab += p.ab;
    a.bad += p.bad;
    a.max_bits = max(a.max_bits, p.max_bits);
  }
  s[threadIdx.x] = a;
  __syncthreads();
  for (int h = kThreads / 2; h > 0; h /= 2) {
    if (threadIdx.x < h) {
      StatsPart& d = s[threadIdx.x];
      const StatsPart& o = s[threadIdx.x + h];
      d.sq += o.sq;
      d.ab += o.ab;
      d.bad += o.bad;
      d.max_bits = max(d.max_bits, o.max_bits);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) part[0] = s[0];
}

// A scale kept on the device (quant_scales_in_memory) from the statistics in part[0]: SAWB's INT4
// scale, or FP4's alpha; a non-finite tensor leaves `code` in *flag if nothing is there yet.
__global__ void scale_from_stats_kernel(const StatsPart* part, int64_t n, bool sawb, bool is_unsigned, int levels,
                                        float* out, uint32_t* flag, uint32_t code) {
  const StatsPart p = part[0];
  TensorStats s;
  s.sum_sq = p.sq;
  s.sum_abs = p.ab;
  s.max_abs = __uint_as_float(p.max_bits);
  s.finite = p.bad == 0;
  if (!s.finite && *flag == 0) *flag = code;
  *out = sawb ? quant::sawb_scale(s, n, is_unsigned) : quant::fp4_alpha(s.max_abs, levels);
}

__global__ void divide_scale_kernel(const float* scale, float divisor, float* out) { *out = __fdiv_rn(*scale, divisor); }

// One row (sample) per block: log-sum-exp in double as the CPU does, the row's loss into `rows`.
__global__ void xent_forward_kernel(const float* z, const int32_t* labels, int64_t K, float smoothing, double* rows) {
  const int64_t n = blockIdx.x;
  if (threadIdx.x != 0) return;  // K is small (classes): one thread per row keeps the CPU's order
  const float* zr = z + n * K;
  float m = -FLT_MAX;
  for (int64_t k = 0; k < K; ++k) m = fmaxf(m, zr[k]);
  double se = 0, sum_z = 0;
  for (int64_t k = 0; k < K; ++k) {
    se += exp(double(zr[k] - m));
    sum_z += zr[k];
  }
  const double lse = double(m) + log(se);
  const int32_t y = labels[n];
  const double zy = y >= 0 && y < K ? double(zr[y]) : 0.0;  // (a bad label aborts at the loss's readback)
  rows[n] = (1.0 - smoothing) * (lse - zy) + smoothing * (lse - sum_z / double(K));
}

__global__ void xent_mean_kernel(const double* rows, int64_t N, float* loss) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double total = 0;
  for (int64_t n = 0; n < N; ++n) total += rows[n];
  loss[0] = float(total / double(N));
}

__global__ void xent_backward_kernel(const float* z, const int32_t* labels, int64_t N, int64_t K, float smoothing,
                                     float scale, float* d, bool accumulate) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float* zr = z + n * K;
  float* dr = d + n * K;
  const int32_t y = labels[n];
  float m = -FLT_MAX;
  for (int64_t k = 0; k < K; ++k) m = fmaxf(m, zr[k]);
  double se = 0;
  for (int64_t k = 0; k < K; ++k) se += exp(double(zr[k] - m));
  for (int64_t k = 0; k < K; ++k) {
    const float p = float(exp(double(zr[k] - m)) / se);
    const float t = (k == y ? 1.f - smoothing : 0.f) + smoothing / float(K);
    const float v = (p - t) * scale;
    dr[k] = accumulate ? dr[k] + v : v;
  }
}

__global__ void label_check_kernel(const int32_t* labels, int64_t N, int64_t K, unsigned long long* bad) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n < N && (labels[n] < 0 || labels[n] >= K)) atomicAdd(bad, 1ull);
}

// PyTorch's SGD as the CPU backend computes it, element i of parameter p (gradient gr, momentum
// b); 1 where the new value is not finite.
struct SgdArgs {
  float lr, momentum, wd;
  bool nesterov, first;
};
__device__ __forceinline__ unsigned sgd_element(float* p, const float* gr, float* b, int64_t i, const SgdArgs& a) {
  const float g = __fadd_rn(gr[i], __fmul_rn(a.wd, p[i]));
  const float buf = a.momentum == 0.f ? g : (a.first ? g : __fadd_rn(__fmul_rn(a.momentum, b[i]), g));
  b[i] = buf;
  const float step = a.nesterov ? __fadd_rn(g, __fmul_rn(a.momentum, buf)) : buf;
  const float np = __fsub_rn(p[i], __fmul_rn(a.lr, step));
  p[i] = np;
  return !(fabsf(np) <= FLT_MAX);
}

// One parameter's step, counting its non-finite results into `bad`.
__global__ void sgd_kernel(float* p, const float* gr, float* b, int64_t n, SgdArgs a, unsigned long long* bad) {
  unsigned long long local = 0;
  ET_GRID_STRIDE(i, n) local += sgd_element(p, gr, b, i, a);
  if (local) atomicAdd(bad, local);
}

// Every parameter of a list in one launch (sgd_steps_deferred), each element as sgd_kernel's.
__global__ void sgd_list_kernel(const cuda::ListEntry* e, int count, int64_t total, SgdArgs a, unsigned long long* bad) {
  unsigned long long local = 0;
  ET_GRID_STRIDE(j, total) {
    const cuda::ListEntry& t = e[entry_of(e, count, j)];
    local += sgd_element(t.p, t.g, t.m, j - t.start, a);
  }
  if (local) atomicAdd(bad, local);
}

}  // namespace

CudaBackend::CudaBackend(int device) : device_(device) {
  memory_ = make_cuda_memory(device);  // validates the index
  cuda::check(cudaStreamCreate(&stream_), "cudaStreamCreate");
  cuda::check(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (copies)");
  cuda::check(cudaEventCreateWithFlags(&released_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cuda::check(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cuda::check(cudaEventCreateWithFlags(&label_copied_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cuda::check(cudaHostAlloc(reinterpret_cast<void**>(&label_host_), sizeof(*label_host_), cudaHostAllocDefault),
              "cudaHostAlloc");
  cuda::check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  codec_ = make_cuda_stash_codec(device, stream_);
  const char* host_scales = std::getenv("EDGETRAIN_CUDA_HOST_SCALES");
  scales_on_device_ = !(host_scales && std::string(host_scales) == "1");
  cuda::check(cublasCreate(&blas_), "cublasCreate");
  cuda::check(cublasSetStream(blas_, stream_), "cublasSetStream");
#if CUDART_VERSION >= 11000
  // cuBLAS's workspace, owned here: a recorded step cannot allocate one (4 MiB, 32 on Hopper and
  // later, as NVIDIA recommends).
  int major = 0;
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  blas_workspace_bytes_ = size_t(major >= 9 ? 32 : 4) << 20;
  blas_workspace_ = cuda_allocate(blas_workspace_bytes_, "cuBLAS's workspace");
  cuda::check(cublasSetWorkspace(blas_, blas_workspace_, blas_workspace_bytes_), "cublasSetWorkspace");
#endif
  // The CPU's FP32 arithmetic: no TF32 tensor-core rounding in the GEMMs.
  cuda::check(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  scratch_ = cuda_allocate(64, "the backend's scratch");
  step_seed_dev_ = cuda_allocate_array<uint64_t>(1, "the step's seed");
  cuda::check(cudaMemset(step_seed_dev_, 0, sizeof(uint64_t)), "cudaMemset");  // step_seed_ = 0
  stats_parts_ = cuda_allocate(sizeof(StatsPart) * kStatsBlocks, "the quantizers' statistics");
  cuda::check(cudaMemset(scratch_, 0, 64), "cudaMemset");  // the deferred SGD count starts at 0
  cudnn_ = cuda::make_cudnn_convs(stream_);
}

CudaBackend::~CudaBackend() {
  drop_capture();
  cudnn_.reset();  // before the stream they use
  codec_.reset();
  if (blas_) cublasDestroy(blas_);
  cudaFree(blas_workspace_);
  cudaFree(xent_rows_);
  cudaFree(bn_scratch_);
  cudaFree(sgd_list_.device);
  cudaFree(finite_list_.device);
  cudaFree(scratch_);
  cudaFree(step_seed_dev_);
  cudaFree(stats_parts_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  if (released_) cudaEventDestroy(released_);
  if (copied_) cudaEventDestroy(copied_);
  if (label_copied_) cudaEventDestroy(label_copied_);
  if (label_host_) cudaFreeHost(label_host_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

std::string CudaBackend::name() const { return "cuda:" + std::to_string(device_) + " (" + cuda_device_description(device_) + ")"; }

unsigned long long* CudaBackend::counter() {
  auto* c = static_cast<unsigned long long*>(scratch_);
  cuda::check(cudaMemsetAsync(c, 0, sizeof(*c), stream_), "cudaMemsetAsync");
  return c;
}

int64_t CudaBackend::read_counter() {
  unsigned long long v = 0;
  cuda::check(cudaMemcpy(&v, scratch_, sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy");
  check_labels();  // (its copy came earlier in stream order: no further wait)
  return int64_t(v);
}

void CudaBackend::copy_to_host(const Tensor& src, void* dst) {
  ET_CHECK(src.is_contiguous());
  cuda::check(cudaMemcpy(dst, src.data, src.nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
  check_labels();  // the loss's readback: a bad label aborts before the backward or the update
}

void CudaBackend::copy_from_host(const void* src, Tensor& dst) {
  ET_CHECK(dst.is_contiguous());
  cuda::check(cudaMemcpy(dst.data, src, dst.nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy from the host");
}

void* CudaBackend::allocate_staging(size_t bytes) {
  void* p = nullptr;
  cuda::check(cudaHostAlloc(&p, bytes > 0 ? bytes : 1, cudaHostAllocDefault), "cudaHostAlloc (page-locked staging)");
  return p;
}

void CudaBackend::free_staging(void* p) { cudaFreeHost(p); }

// The copy lane. An event never recorded is complete, so the first copy waits for nothing.
void CudaBackend::side_copy_from_host(const void* src, Tensor& dst) {
  ET_CHECK(dst.is_contiguous() && !capturing_);
  cuda::check(cudaStreamWaitEvent(copy_stream_, released_, 0), "cudaStreamWaitEvent (copies)");
  cuda::check(cudaMemcpyAsync(dst.data, src, dst.nbytes(), cudaMemcpyHostToDevice, copy_stream_),
              "cudaMemcpyAsync from the host (copies)");
  cuda::check(cudaEventRecord(copied_, copy_stream_), "cudaEventRecord (copies)");
}

void CudaBackend::side_release() {
  ET_CHECK(!capturing_);
  cuda::check(cudaEventRecord(released_, stream_), "cudaEventRecord");
}

void CudaBackend::side_acquire() {
  ET_CHECK(!capturing_);
  cuda::check(cudaStreamWaitEvent(stream_, copied_, 0), "cudaStreamWaitEvent");
}

void CudaBackend::side_wait() { cuda::check(cudaStreamSynchronize(copy_stream_), "cudaStreamSynchronize (copies)"); }

void CudaBackend::synchronize() {
  cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_labels();
}

void CudaBackend::fill(Tensor& t, float value) {
  ET_CHECK(t.is_contiguous());
  fill_kernel<<<blocks_for(t.numel()), kThreads, 0, stream_>>>(t.f32(), t.numel(), value);
  cuda::launched("fill");
}

void CudaBackend::copy(const Tensor& src, Tensor& dst) {
  ET_CHECK(src.nbytes() == dst.nbytes() && src.is_contiguous() && dst.is_contiguous());
  cuda::check(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
}

const cuda::ListEntry* CudaBackend::upload(TensorListTable& t, const char* what) {
  const size_t n = t.entries.size();
  if (t.device && n == t.uploaded.size() &&
      std::memcmp(t.entries.data(), t.uploaded.data(), n * sizeof(cuda::ListEntry)) == 0)
    return t.device;
  if (n > t.capacity) {
    cuda::check(cudaFree(t.device), "cudaFree");
    t.device = nullptr;
    t.capacity = 0;
    t.device = cuda_allocate_array<cuda::ListEntry>(n, what);
    t.capacity = n;
  }
  // From pageable memory: the call waits for the stream, then returns once the entries are staged,
  // so the host list may change (a new list: once per executor).
  cuda::check(cudaMemcpyAsync(t.device, t.entries.data(), n * sizeof(cuda::ListEntry), cudaMemcpyHostToDevice, stream_),
              "cudaMemcpyAsync");
  t.uploaded = t.entries;
  return t.device;
}

bool CudaBackend::all_finite(const std::vector<Tensor>& tensors) {
  finite_list_.entries.clear();
  int64_t total = 0;
  for (const Tensor& t : tensors)
    if (t.numel() > 0) {
      finite_list_.entries.push_back(cuda::ListEntry{t.f32(), nullptr, nullptr, t.numel(), total});
      total += t.numel();
    }
  unsigned long long* bad = counter();
  if (total > 0) {
    const cuda::ListEntry* list = upload(finite_list_, "the finiteness check's tensor list");
    count_nonfinite_list_kernel<<<blocks_for(total), kThreads, 0, stream_>>>(list, int(finite_list_.entries.size()),
                                                                            total, bad);
    cuda::launched("all_finite");
  }
  return read_counter() == 0;
}

// The statistics of x into stats_parts_[0], on the device (x not empty).
void CudaBackend::stats_on_device(const Tensor& x) {
  ET_CHECK(x.is_contiguous() && x.numel() > 0);
  // At most kStatsBlocks parts (8 blocks an SM: the reads fill the device, and the parts stay few).
  const int64_t most = std::min<int64_t>(int64_t(sm_count_) * 8, int64_t(kStatsBlocks));  // (by value: C++14)
  const int blocks = int(std::min<int64_t>(blocks_for(x.numel()), most));
  auto* part = static_cast<StatsPart*>(stats_parts_);
  stats_kernel<<<unsigned(blocks), kThreads, 0, stream_>>>(x.f32(), x.numel(), part);
  stats_finish_kernel<<<1, kThreads, 0, stream_>>>(part, blocks);
  cuda::launched("tensor_stats");
}

TensorStats CudaBackend::tensor_stats(const Tensor& x) {
  ET_CHECK(x.is_contiguous());
  TensorStats out;
  if (x.numel() == 0) return out;
  stats_on_device(x);
  auto* part = static_cast<StatsPart*>(stats_parts_);
  StatsPart p;
  cuda::check(cudaMemcpy(&p, part, sizeof(p), cudaMemcpyDeviceToHost), "cudaMemcpy");
  out.sum_sq = p.sq;
  out.sum_abs = p.ab;
  std::memcpy(&out.max_abs, &p.max_bits, 4);
  out.finite = p.bad == 0;
  return out;
}

// The scales kept on the device: statistics and scale without a read back (an empty tensor's
// statistics are zeros, parts cleared first).
void CudaBackend::int4_scale_to(const Tensor& x, bool is_unsigned, float* scale, uint32_t* flag, uint32_t code) {
  if (x.numel() == 0) cuda::check(cudaMemsetAsync(stats_parts_, 0, sizeof(StatsPart), stream_), "cudaMemsetAsync");
  else stats_on_device(x);
  scale_from_stats_kernel<<<1, 1, 0, stream_>>>(static_cast<const StatsPart*>(stats_parts_), x.numel(), true,
                                                is_unsigned, 0, scale, flag, code);
  cuda::launched("int4_scale_to");
}

void CudaBackend::fp4_alpha_to(const Tensor& g, int levels, float* alpha, uint32_t* flag, uint32_t code) {
  if (g.numel() == 0) cuda::check(cudaMemsetAsync(stats_parts_, 0, sizeof(StatsPart), stream_), "cudaMemsetAsync");
  else stats_on_device(g);
  scale_from_stats_kernel<<<1, 1, 0, stream_>>>(static_cast<const StatsPart*>(stats_parts_), g.numel(), false, false,
                                                levels, alpha, flag, code);
  cuda::launched("fp4_alpha_to");
}

void CudaBackend::divide_scale_to(const float* scale, int divisor, float* out) {
  divide_scale_kernel<<<1, 1, 0, stream_>>>(scale, float(divisor), out);
  cuda::launched("divide_scale_to");
}

TensorStats CudaBackend::tensor_max_abs(const Tensor& x) {
  TensorStats full = tensor_stats(x);  // the sums come along; tests compare only max_abs and finite
  TensorStats out;
  out.max_abs = full.max_abs;
  out.finite = full.finite;
  return out;
}

void CudaBackend::softmax_xent_forward(const Tensor& logits, const Tensor& labels, float smoothing, Tensor& loss) {
  const int64_t N = logits.dim(0), K = logits.dim(1);
  // Counted on the device and read at the next readback (queue_label_check, check_labels: the
  // loss's, before the backward or the update): no wait for the forward here, so the backward's
  // launches follow at once; a recorded step's count replay() queues.
  if (!capturing_) check_labels();  // the last pass's, long done (its loss was read)
  unsigned long long* bad = label_errors();
  cuda::check(cudaMemsetAsync(bad, 0, sizeof(*bad), stream_), "cudaMemsetAsync");
  label_check_kernel<<<unsigned((N + kThreads - 1) / kThreads), kThreads, 0, stream_>>>(labels.i32(), N, K, bad);
  cuda::launched("label check");
  if (!capturing_) queue_label_check(K);
  if (N > xent_rows_capacity_) {  // per-sample losses, summed in the CPU's order; grows in the first step only
    cudaFree(xent_rows_);
    xent_rows_ = nullptr;
    xent_rows_capacity_ = 0;
    xent_rows_ = cuda_allocate_array<double>(size_t(N), "the loss's per-sample values");
    xent_rows_capacity_ = N;
    ++record_generation_;  // a recorded step holds the old buffer
  }
  xent_forward_kernel<<<unsigned(N), 32, 0, stream_>>>(logits.f32(), labels.i32(), K, smoothing, xent_rows_);
  xent_mean_kernel<<<1, 32, 0, stream_>>>(xent_rows_, N, loss.f32());
  cuda::launched("softmax_xent_forward");
}

void CudaBackend::softmax_xent_backward(const Tensor& logits, const Tensor& labels, float smoothing, float dloss,
                                        Tensor& dlogits, bool accumulate) {
  const int64_t N = logits.dim(0), K = logits.dim(1);
  xent_backward_kernel<<<unsigned((N + 127) / 128), 128, 0, stream_>>>(logits.f32(), labels.i32(), N, K, smoothing,
                                                                       dloss / float(N), dlogits.f32(), accumulate);
  cuda::launched("softmax_xent_backward");
}

namespace {
// One SGD kernel over a parameter, counting its non-finite results into `bad`.
void launch_sgd(cudaStream_t stream, Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                float weight_decay, bool nesterov, bool first_step, unsigned long long* bad) {
  sgd_kernel<<<blocks_for(param.numel()), kThreads, 0, stream>>>(param.f32(), grad.f32(), momentum_buf.f32(),
                                                                 param.numel(),
                                                                 SgdArgs{lr, momentum, weight_decay, nesterov, first_step},
                                                                 bad);
  cuda::launched("sgd_step");
}
}  // namespace

bool CudaBackend::sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                           float weight_decay, bool nesterov, bool first_step) {
  launch_sgd(stream_, param, grad, momentum_buf, lr, momentum, weight_decay, nesterov, first_step, counter());
  return read_counter() == 0;
}

// scratch_ [32, 40): the non-finite count of the deferred steps since the last sgd_finite().
unsigned long long* CudaBackend::deferred_sgd_count() {
  return reinterpret_cast<unsigned long long*>(static_cast<char*>(scratch_) + 32);
}

void CudaBackend::sgd_step_deferred(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                                    float weight_decay, bool nesterov, bool first_step) {
  launch_sgd(stream_, param, grad, momentum_buf, lr, momentum, weight_decay, nesterov, first_step,
             deferred_sgd_count());
}

void CudaBackend::sgd_steps_deferred(const std::vector<SgdSlot>& slots, float lr, float momentum, float weight_decay,
                                     bool nesterov, bool first_step) {
  sgd_list_.entries.clear();
  int64_t total = 0;
  for (const SgdSlot& s : slots) {
    const int64_t n = s.param.numel();
    ET_CHECK(s.grad.numel() == n && s.momentum.numel() == n, "sgd_steps_deferred: ", s.param.shape.str(), " with ",
             s.grad.shape.str(), " and ", s.momentum.shape.str());
    if (n == 0) continue;
    sgd_list_.entries.push_back(cuda::ListEntry{s.param.f32(), s.grad.f32(), s.momentum.f32(), n, total});
    total += n;
  }
  if (total == 0) return;
  const cuda::ListEntry* list = upload(sgd_list_, "the SGD step's parameter list");
  sgd_list_kernel<<<blocks_for(total), kThreads, 0, stream_>>>(list, int(sgd_list_.entries.size()), total,
                                                               SgdArgs{lr, momentum, weight_decay, nesterov, first_step},
                                                               deferred_sgd_count());
  cuda::launched("sgd_steps");
}

bool CudaBackend::sgd_finite() {
  unsigned long long v = 0;
  cuda::check(cudaMemcpy(&v, deferred_sgd_count(), sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cuda::check(cudaMemsetAsync(deferred_sgd_count(), 0, sizeof(v), stream_), "cudaMemsetAsync");
  check_labels();
  return v == 0;
}

// scratch_ [40, 48): the label check's count (queue_label_check copies it to the host).
unsigned long long* CudaBackend::label_errors() {
  return reinterpret_cast<unsigned long long*>(static_cast<char*>(scratch_) + 40);
}

void CudaBackend::begin_capture() {
  ET_CHECK(!capturing_, "begin_capture: already recording");
  drop_capture();
  // Thread-local: a synchronising call of this thread during the record fails it (end_capture
  // says which), instead of running out of order.
  cuda::check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  capturing_ = true;
  ++record_generation_;  // the record kept before (another executor's step) is gone
}

std::string CudaBackend::end_capture() {
  ET_CHECK(capturing_, "end_capture without begin_capture");
  capturing_ = false;
  cudaGraph_t g = nullptr;
  const cudaError_t e = cudaStreamEndCapture(stream_, &g);
  if (e != cudaSuccess || g == nullptr) {
    (void)cudaGetLastError();  // not sticky: the stream and context go on
    if (g) cudaGraphDestroy(g);
    return std::string("recording the step failed: ") + cudaGetErrorString(e);
  }
  cudaGraphExec_t x = nullptr;
#if CUDART_VERSION >= 12000
  const cudaError_t ie = cudaGraphInstantiate(&x, g, 0);
#else
  const cudaError_t ie = cudaGraphInstantiate(&x, g, nullptr, nullptr, 0);
#endif
  cudaGraphDestroy(g);  // the instantiated graph stands alone
  if (ie != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("instantiating the recorded step failed: ") + cudaGetErrorString(ie);
  }
  graph_exec_ = x;
  return "";
}

void CudaBackend::replay() {
  ET_CHECK(graph_exec_ != nullptr, "replay: no step recorded");
  check_labels();  // the last step's
  cuda::check(cudaGraphLaunch(graph_exec_, stream_), "cudaGraphLaunch");
  queue_label_check(0);  // (the classes are the graph's: the message names none)
}

void CudaBackend::queue_label_check(int64_t classes) {
  cuda::check(cudaMemcpyAsync(label_host_, label_errors(), sizeof(*label_host_), cudaMemcpyDeviceToHost, stream_),
              "cudaMemcpyAsync (the label check)");
  cuda::check(cudaEventRecord(label_copied_, stream_), "cudaEventRecord");
  label_pending_ = true;
  label_classes_ = classes;
}

void CudaBackend::check_labels() {
  if (!label_pending_) return;
  cuda::check(cudaEventSynchronize(label_copied_), "cudaEventSynchronize (the label check)");
  label_pending_ = false;
  if (label_classes_ > 0) ET_CHECK(*label_host_ == 0, "a label outside 0..", label_classes_ - 1);
  ET_CHECK(*label_host_ == 0, "a label outside the model's classes");
}

void CudaBackend::drop_capture() {
  if (graph_exec_) cudaGraphExecDestroy(graph_exec_);
  graph_exec_ = nullptr;
}

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::unique_ptr<Backend>(new CudaBackend(device)); }

}  // namespace et
