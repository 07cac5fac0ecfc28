// The CUDA backend's foundation (issue 13, docs/architecture.md section 5): device discovery and
// device memory for the executor's arena and stash region. Built with -DEDGETRAIN_CUDA=ON only;
// C++14, like every header a .cu file includes.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "memory/device_memory.h"

namespace et {

// CUDA devices this process can use: 0 when there is no driver, no device, or the runtime fails
// (`why` gets the runtime's reason then). Never throws.
int cuda_device_count(std::string* why = nullptr);
// "NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB"; UserError naming the index if there is no such device.
std::string cuda_device_description(int device);

// Device memory of GPU `device` (cudaMalloc / cudaFree): zeroed allocations; release() leaves the
// memory allocated (a device has no pages to hand back one by one), resident_bytes() counts all
// of it. UserError naming the device if it does not exist.
std::unique_ptr<DeviceMemory> make_cuda_memory(int device);

// The backend's own device buffers (scratch, workspaces, the codec's counts) on the current device:
// out of memory is a UserError naming `what` and the bytes, as the arena's is; nothing is zeroed.
void* cuda_allocate(size_t bytes, const char* what);
template <class T>
T* cuda_allocate_array(size_t n, const char* what) {
  return static_cast<T*>(cuda_allocate(n * sizeof(T), what));
}

// Bytes free and in total on `device` (cudaMemGetInfo): what memprofile reports beside the plan.
void cuda_memory_info(int device, size_t* free_bytes, size_t* total_bytes);

}  // namespace et
