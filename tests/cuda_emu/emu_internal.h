// What the CUDA emulator's parts lend each other: the runtime (emu_runtime.cpp), the threads of a
// launch (emu_threads.cpp) and cuBLAS (emu_cublas.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
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
long setting(const char* name, long fallback);  // EDGETRAIN_CUDA_EMU_* from the environment

// emu_threads.cpp: runs a launch's blocks, each block's threads to their end (body: one thread's
// run, reading the built-ins); the caller holds runtime_lock() and device memory is readable.
void run_grid(const char* name, dim3 grid, dim3 block, const std::function<void()>& body);
// Inside a kernel: "kernel k, block (x, y, z), thread (x, y, z)" into buf, and true.
bool running_thread(char* buf, size_t bytes);

// The running thread as the race checker (emu_races.cpp) sees it; false outside a kernel (or on
// another host thread). Two accesses by threads of one block are ordered when a barrier lies
// between them (barrier differs), or, in one warp, a warp collective (warp_sync differs).
struct ThreadAt {
  uint32_t launch = 0, block = 0;  // serial numbers: this launch, this block (of every launch)
  uint32_t thread = 0;             // its linear index in the block
  uint32_t barrier = 0, warp_sync = 0;
  const char* stack_lo = nullptr;  // its own stack: what lies there no other thread sees
  const char* stack_hi = nullptr;
};
bool thread_at(ThreadAt& t);
// A launch's end, for the race checker to drop what it kept of it.
void races_launch_done();

// The memory traffic count (emu_traffic.cpp, EDGETRAIN_CUDA_EMU_TRAFFIC): on for this process?
// (In a build without the instrumentation, a fault where it is asked for.) Then each access of
// device (shared: a block's own) memory, kind 0 read, 1 write, 2 atomic, at `place` in a kernel;
// each block's and each launch's end.
bool traffic_on();
void traffic_access(const ThreadAt& t, uintptr_t a, size_t bytes, int kind, bool shared, const void* place);
void traffic_block_done(const char* kernel);
void traffic_launch_done(const char* kernel, uint64_t blocks, uint64_t threads);

}  // namespace emu
