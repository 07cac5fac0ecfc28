// CUDA device discovery and device memory (backends/cuda/cuda_device.h).
#include "backends/cuda/cuda_device.h"

#include <cuda_runtime.h>

#include <cstdio>

#include "engine/check.h"

namespace et {

namespace {

void check_cuda(cudaError_t e, const char* what, int device) {
  if (e != cudaSuccess) user_error("CUDA device ", device, ": ", what, " failed: ", cudaGetErrorString(e));
}

void use_device(int device) {
  const int n = cuda_device_count();
  if (device < 0 || device >= n)
    user_error("no CUDA device ", device, " (this machine has ", n, n == 1 ? " device" : " devices", ")");
  check_cuda(cudaSetDevice(device), "cudaSetDevice", device);
}

class CudaMemory final : public DeviceMemory {
 public:
  explicit CudaMemory(int device) : device_(device) {}
  Device device() const override { return Device::CUDA; }
  size_t granularity() const override { return 4096; }
  void* allocate(size_t bytes) override {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice", device_);
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      (void)cudaGetLastError();  // clears the (non-sticky) error; the caller reports the failure
      return nullptr;
    }
    check_cuda(cudaMemset(p, 0, bytes), "cudaMemset", device_);
    return p;
  }
  void deallocate(void* p, size_t) override {
    cudaSetDevice(device_);
    cudaFree(p);  // in a destructor: nothing to report to
  }
  void release(void*, size_t) override {}
  size_t resident_bytes(const void*, size_t bytes) const override { return bytes; }
  bool usage(size_t* used, size_t* total) const override {
    size_t free_bytes = 0;
    cuda_memory_info(device_, &free_bytes, total);
    *used = *total - free_bytes;
    return true;
  }

 private:
  int device_;
};

}  // namespace

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = cudaGetErrorString(e);
    (void)cudaGetLastError();
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device";
  return n;
}

std::string cuda_device_description(int device) {
  use_device(device);
  cudaDeviceProp p;
  check_cuda(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties", device);
  char buf[320];
  std::snprintf(buf, sizeof(buf), "%s, sm_%d%d, %.1f GiB", p.name, p.major, p.minor,
                double(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

void* cuda_allocate(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // (not sticky: cleared, the process may go on)
    user_error("out of memory: could not allocate ", bytes, " bytes of device memory for ", what, kMemoryBudgetHint);
  }
  if (e != cudaSuccess) user_error("CUDA: cudaMalloc (", what, ") failed: ", cudaGetErrorString(e));
  return p;
}

std::unique_ptr<DeviceMemory> make_cuda_memory(int device) {
  use_device(device);
  return std::unique_ptr<DeviceMemory>(new CudaMemory(device));
}

void cuda_memory_info(int device, size_t* free_bytes, size_t* total_bytes) {
  use_device(device);
  check_cuda(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo", device);
}

}  // namespace et
