// CUDA device memory (backends/cuda/cuda_device.h) as the executor's arena and stash use it.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <vector>

#include "backends/cuda/cuda_device.h"
#include "engine/check.h"
#include "memory/arena.h"

using namespace et;

TEST_CASE("cuda: device memory is zeroed, device-resident and freed", "[cuda]") {
  const std::unique_ptr<DeviceMemory> mem = make_cuda_memory(0);
  CHECK(mem->device() == Device::CUDA);
  size_t free_before = 0, total = 0;
  cuda_memory_info(0, &free_before, &total);
  CHECK(total > 0);
  const size_t bytes = 64 << 20;
  void* p = mem->allocate(bytes);
  REQUIRE(p != nullptr);
  cudaPointerAttributes attr;
  REQUIRE(cudaPointerGetAttributes(&attr, p) == cudaSuccess);
  CHECK(attr.type == cudaMemoryTypeDevice);
  std::vector<unsigned char> host(bytes, 1);
  REQUIRE(cudaMemcpy(host.data(), p, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(host == std::vector<unsigned char>(bytes, 0));
  size_t free_during = 0;
  cuda_memory_info(0, &free_during, &total);
  CHECK(free_during + bytes <= free_before + (2 << 20));  // the allocation shows in cudaMemGetInfo
  CHECK(mem->resident_bytes(p, bytes) == bytes);
  mem->deallocate(p, bytes);
}

TEST_CASE("cuda: an arena on the device", "[cuda]") {
  const std::unique_ptr<DeviceMemory> mem = make_cuda_memory(0);
  Arena a;
  a.reserve(10000, "a test arena", *mem);
  CHECK(a.device() == Device::CUDA);
  CHECK(a.size() == 12288);
  float one = 1.f, back = 0.f;
  REQUIRE(cudaMemcpy(a.at(4096), &one, 4, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(&back, a.at(4096), 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(back == 1.f);
}

TEST_CASE("cuda: a device that does not exist is an error naming it", "[cuda]") {
  const int n = cuda_device_count();
  CHECK_THROWS_WITH(make_cuda_memory(n), Catch::Contains("no CUDA device " + std::to_string(n)));
  CHECK_THROWS_AS(make_cuda_memory(-1), UserError);
}

TEST_CASE("cuda: out of device memory names the buffer and its bytes, and the device goes on", "[cuda]") {
  const std::unique_ptr<DeviceMemory> mem = make_cuda_memory(0);  // (selects device 0)
  size_t free_bytes = 0, total = 0;
  cuda_memory_info(0, &free_bytes, &total);
  const size_t too_much = total * 2;
  CHECK_THROWS_WITH(cuda_allocate(too_much, "a test buffer"),
                    Catch::Contains("out of memory: could not allocate " + std::to_string(too_much) +
                                    " bytes of device memory for a test buffer") &&
                        Catch::Contains("memory.budget_mb"));
  // The error is not sticky: the next allocation and copy work.
  float* p = cuda_allocate_array<float>(256, "a test buffer");
  REQUIRE(p != nullptr);
  float one = 1.f, back = 0.f;
  CHECK(cudaMemcpy(p + 255, &one, 4, cudaMemcpyHostToDevice) == cudaSuccess);
  CHECK(cudaMemcpy(&back, p + 255, 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(back == 1.f);
  CHECK(cudaGetLastError() == cudaSuccess);
  cudaFree(p);
}
