// Element-wise kernels on CUDA: ReLU (writing its bitmap in the stash's layout with warp ballots),
// its backward from a bitmap or a dense mask, add, gradient accumulation, dropout with the CPU's
// counter-based mask (the same hash of (seed, i), so both backends drop the same elements).
#include "backends/cuda/cuda_backend_impl.h"
#include "memory/bitmap.h"
#include "quant/codes.h"

namespace et {

namespace {

using cuda::blocks_for;
using cuda::kThreads;

__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i) {  // backends/cpu/elementwise.cpp
  uint64_t x = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return float(x >> 40) * (1.0f / 16777216.0f);
}

__global__ void relu_kernel(const float* x, float* y, int64_t n) {
  ET_GRID_STRIDE(i, n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}

// y = relu(x) and its bitmap: 256 elements (8 ballots, 4 words) per block step; words past n's
// last are not written, bits past n in the last word are zero. kept counts the set bits.
__global__ void relu_mask_kernel(const float* x, float* y, int64_t n, uint32_t threshold, uint32_t* bits32,
                                 int64_t words32, unsigned long long* kept) {
  unsigned long long local = 0;
  const int64_t chunks = (words32 * 32 + 255) / 256;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t i = c * 256 + threadIdx.x;
    float v = 0.f;
    if (i < n) {
      v = x[i] > 0.f ? x[i] : 0.f;
      y[i] = v;
    }
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, i < n && __float_as_uint(v) >= threshold);
    if ((threadIdx.x & 31) == 0 && i / 32 < words32) {
      bits32[i / 32] = ballot;
      local += __popc(ballot);
    }
  }
  if (local) atomicAdd(kept, local);
}

__global__ void relu_backward_bits_kernel(const float* dy, const uint32_t* bits32, float* dx, int64_t n, bool acc) {
  ET_GRID_STRIDE(i, n) {
    const float v = (bits32[i / 32] >> (i % 32)) & 1u ? dy[i] : 0.f;
    dx[i] = acc ? dx[i] + v : v;
  }
}

__global__ void relu_backward_dense_kernel(const float* dy, const float* m, float* dx, int64_t n, bool acc) {
  ET_GRID_STRIDE(i, n) {
    const float v = m[i] > 0.f ? dy[i] : 0.f;
    dx[i] = acc ? dx[i] + v : v;
  }
}

__global__ void zero_where_zero_kernel(const float* r, float* y, int64_t n) {
  ET_GRID_STRIDE(i, n) if (r[i] == 0.f) y[i] = 0.f;
}

__global__ void add_kernel(const float* a, const float* b, float* y, int64_t n) { ET_GRID_STRIDE(i, n) y[i] = a[i] + b[i]; }

__global__ void accumulate_kernel(const float* s, float* d, int64_t n) { ET_GRID_STRIDE(i, n) d[i] += s[i]; }

// The node's seed from the step seed in device memory (a replayed step's, set before its launch).
__global__ void dropout_kernel(const float* x, float p, float scale, const uint64_t* step_seed, uint64_t node, float* y,
                               int64_t n, bool acc) {
  const uint64_t seed = quant::mix64(*step_seed ^ node);  // OpContext::seed
  ET_GRID_STRIDE(i, n) {
    // Rounded apart, as the CPU's (elementwise.cpp): no contraction into one FMA.
    const float v = hash_uniform(seed, uint64_t(i)) >= p ? __fmul_rn(x[i], scale) : 0.f;
    y[i] = acc ? __fadd_rn(y[i], v) : v;
  }
}

}  // namespace

void CudaBackend::relu_forward(const Tensor& x, Tensor& y, MaskOut* mask) {
  const int64_t n = x.numel();
  if (!mask) {
    relu_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(x.f32(), y.f32(), n);
    cuda::launched("relu_forward");
    return;
  }
  ET_CHECK(mask->prune_threshold >= 0.f, "prune threshold ", mask->prune_threshold);
  const uint32_t threshold = bitmap::keep_threshold_bits(mask->prune_threshold);
  const int64_t words32 = (n + 63) / 64 * 2;
  unsigned long long* kept = counter();
  relu_mask_kernel<<<blocks_for(words32 * 32), 256, 0, stream_>>>(
      x.f32(), y.f32(), n, threshold, reinterpret_cast<uint32_t*>(mask->bits), words32, kept);
  cuda::launched("relu_forward (mask)");
  take_mask_count(*mask);
}

void CudaBackend::take_mask_count(MaskOut& mask) {
  if (mask.kept_slot) {  // the stash's fixed layout: the count stays on the device (no wait)
    cuda::check(cudaMemcpyAsync(mask.kept_slot, scratch_, sizeof(int64_t), cudaMemcpyDeviceToDevice, stream_),
                "cudaMemcpyAsync (a mask's count)");
    mask.kept_in_slot = true;
    return;
  }
  // A caller without a slot (a test) reads it back; inside a record that throws (nothing to read yet).
  mask.kept = read_counter();
}

void CudaBackend::relu_backward(const Tensor& dy, const MaskView& mask, Tensor& dx, bool accumulate) {
  const int64_t n = dy.numel();
  if (mask.bits)
    relu_backward_bits_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(
        dy.f32(), reinterpret_cast<const uint32_t*>(mask.bits), dx.f32(), n, accumulate);
  else
    relu_backward_dense_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(dy.f32(), mask.dense.f32(), dx.f32(), n,
                                                                        accumulate);
  cuda::launched("relu_backward");
}

void CudaBackend::zero_where_zero(const Tensor& ref, Tensor& y) {
  ET_CHECK(ref.numel() == y.numel() && ref.is_contiguous() && y.is_contiguous());
  zero_where_zero_kernel<<<blocks_for(y.numel()), kThreads, 0, stream_>>>(ref.f32(), y.f32(), y.numel());
  cuda::launched("zero_where_zero");
}

void CudaBackend::add_forward(const Tensor& a, const Tensor& b, Tensor& y) {
  add_kernel<<<blocks_for(a.numel()), kThreads, 0, stream_>>>(a.f32(), b.f32(), y.f32(), a.numel());
  cuda::launched("add_forward");
}

void CudaBackend::accumulate_grad(const Tensor& src, Tensor& dst, bool accumulate) {
  if (!accumulate) {
    if (src.data != dst.data)
      cuda::check(cudaMemcpyAsync(dst.data, src.data, size_t(src.numel()) * 4, cudaMemcpyDeviceToDevice, stream_),
                  "cudaMemcpyAsync");
    return;
  }
  accumulate_kernel<<<blocks_for(src.numel()), kThreads, 0, stream_>>>(src.f32(), dst.f32(), src.numel());
  cuda::launched("accumulate_grad");
}

__global__ void set_u64_kernel(uint64_t* p, uint64_t v) { *p = v; }

void CudaBackend::set_step_seed(uint64_t step) {
  if (step == step_seed_) return;  // the device holds it already (in stream order)
  ET_CHECK(!capturing_, "set_step_seed while recording: a replay would keep this value");
  set_u64_kernel<<<1, 1, 0, stream_>>>(step_seed_dev_, step);
  cuda::launched("set_step_seed");
  step_seed_ = step;
}

// A caller that gives a step seed other than the last set (a test, or another executor on this
// backend) sets it first; while recording that would be lost on replay, so set_step_seed refuses.
void CudaBackend::dropout_forward(const Tensor& x, float p, const DropoutSeed& seed, Tensor& y) {
  set_step_seed(seed.step);
  dropout_kernel<<<blocks_for(x.numel()), kThreads, 0, stream_>>>(x.f32(), p, 1.f / (1.f - p), step_seed_dev_,
                                                                  seed.node, y.f32(), x.numel(), false);
  cuda::launched("dropout_forward");
}

void CudaBackend::dropout_backward(const Tensor& dy, float p, const DropoutSeed& seed, Tensor& dx, bool accumulate) {
  set_step_seed(seed.step);
  dropout_kernel<<<blocks_for(dy.numel()), kThreads, 0, stream_>>>(dy.f32(), p, 1.f / (1.f - p), step_seed_dev_,
                                                                   seed.node, dx.f32(), dy.numel(), accumulate);
  cuda::launched("dropout_backward");
}

}  // namespace et
