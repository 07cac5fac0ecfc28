// The forward pass of a fused stack (or the BN layer) over its n outputs: y[i] = out(i) for an
// output functor, and y's bitmap where the stash asks for it (MaskOut), in relu_mask_kernel's
// layout: 256 outputs a block step, 8 ballots, bits past n zero; kept counts the set bits. Shared
// by cuda_batchnorm.cu (BN-headed stacks) and cuda_relu_pool.cu (stacks without a BN). C++14.
#pragma once
#include <cstdint>

namespace et {
namespace cuda {

// The bitmap's kernel arguments (OutputMask{}: none): CudaBackend::output_mask sets them.
struct OutputMask {
  uint32_t threshold = 0;
  uint32_t* bits32 = nullptr;
  int64_t words32 = 0;
  unsigned long long* kept = nullptr;
};

template <class Out>
__global__ void fused_forward_kernel(Out out, int64_t n, float* y, OutputMask m) {
  unsigned long long local = 0;
  const int64_t steps = m.bits32 ? (m.words32 * 32 + 255) / 256 : (n + 255) / 256;
  for (int64_t k = blockIdx.x; k < steps; k += gridDim.x) {
    const int64_t i = k * 256 + threadIdx.x;
    float v = 0.f;
    if (i < n) {
      v = out(i);
      y[i] = v;
    }
    if (m.bits32) {
      const unsigned ballot = __ballot_sync(0xFFFFFFFFu, i < n && __float_as_uint(v) >= m.threshold);
      if ((threadIdx.x & 31) == 0 && i / 32 < m.words32) {
        m.bits32[i / 32] = ballot;
        local += __popc(ballot);
      }
    }
  }
  if (local) atomicAdd(m.kept, local);
}

// Blocks for n outputs, or for the bitmap's whole words where one is written.
inline unsigned output_blocks(int64_t n, const OutputMask& m) {
  const int64_t total = m.bits32 ? m.words32 * 32 : n;
  const int64_t b = (total + 255) / 256;
  return unsigned(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

}  // namespace cuda
}  // namespace et
