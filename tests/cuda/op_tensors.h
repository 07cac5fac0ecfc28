// Tensors on the CPU and CUDA backends side by side, for the CUDA tests that compare them op by
// op: the same random contents on both, workspaces on both, and the comparisons (bits, or a
// relative tolerance).
#pragma once
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"

namespace et {
namespace cuda_test {

// A tensor on both backends with the same contents.
struct Both {
  std::vector<float> host;
  Tensor cpu, dev;
  void* dptr = nullptr;
  Both(const Shape& s, uint32_t seed, float zero_share = 0.f, DType dtype = DType::F32) {
    const int64_t n = s.numel();
    host.assign(size_t(n), 0.f);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (float& v : host) v = u(rng) < zero_share ? 0.f : normal(rng);
    cpu = Tensor::contiguous(host.data(), s, dtype);
    REQUIRE(cudaMalloc(&dptr, size_t(n) * 4 + 8) == cudaSuccess);
    REQUIRE(cudaMemcpy(dptr, host.data(), size_t(n) * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    dev = Tensor::contiguous(dptr, s, dtype, Device::CUDA);
  }
  ~Both() { cudaFree(dptr); }
  Tensor& on(bool device) { return device ? dev : cpu; }
  Both(const Both&) = delete;
  std::vector<float> device_values() const {
    std::vector<float> out(host.size());
    REQUIRE(cudaMemcpy(out.data(), dptr, out.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
};

// Max |a - b| / (|b| + 1): relative for large values, absolute near zero.
inline double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])) / (std::fabs(double(b[i])) + 1.0));
  return m;
}
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

struct Backends {
  std::unique_ptr<Backend> cpu = make_cpu_backend(), dev = make_cuda_backend(0);
};

// Workspace on both sides.
struct Scratch {
  std::vector<float> host;
  void* dptr = nullptr;
  Workspace cpu, dev;
  Scratch(size_t cpu_bytes, size_t dev_bytes) : host(cpu_bytes / 4 + 16) {
    cpu = Workspace{host.data(), cpu_bytes};
    REQUIRE(cudaMalloc(&dptr, dev_bytes + 8) == cudaSuccess);
    dev = Workspace{dptr, dev_bytes};
  }
  ~Scratch() { cudaFree(dptr); }
};

}  // namespace cuda_test
}  // namespace et
