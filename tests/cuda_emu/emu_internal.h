// What the CUDA emulator's runtime (emu_runtime.cpp) lends its other parts (emu_cublas.cpp).
#pragma once
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>

#include "cuda_runtime.h"

namespace emu {

std::recursive_mutex& runtime_lock();  // one caller of the runtime at a time
[[noreturn]] void report_fault(const std::string& what);
bool in_device_memory(const void* p, size_t bytes);  // [p, p + bytes) inside one allocation
std::string where(const void* p);                    // an address against the allocations near it
// An operation of stream s: recorded where s records, else run now with device memory readable.
cudaError_t issue(cudaStream_t s, std::function<void()> op);

}  // namespace emu
