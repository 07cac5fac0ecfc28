// The CUDA emulator's runtime (include/cuda_emu.h says what it is for and what it cannot check):
// device memory with guard pages, streams whose work runs as late as CUDA allows (or in issue
// order), stream capture into replayable graphs, events, launches and the fault reports (a block's
// threads: emu_threads.cpp; cuBLAS: emu_cublas.cpp).
//
// Settings (environment): EDGETRAIN_CUDA_EMU_DEVICES (default 1; 0 = a machine without a GPU),
// EDGETRAIN_CUDA_EMU_MB (device memory, default 8192), EDGETRAIN_CUDA_EMU_SMS (multiprocessors,
// default 4), EDGETRAIN_CUDA_EMU_MAJOR (compute capability major, default 9; below 8 the int8 MMA
// model gives way to dp4a, as nvcc builds for those GPUs),
// EDGETRAIN_CUDA_EMU_FILL (the byte fresh device memory holds, default 0xFF: NaN floats),
// EDGETRAIN_CUDA_EMU_STREAMS (lazy, the default, or eager: see lazy_streams()),
// EDGETRAIN_CUDA_EMU_PROFILE and EDGETRAIN_CUDA_EMU_LAUNCHES (emu_threads.cpp).
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "emu_internal.h"

// ---- objects behind the runtime's handles ----
struct CUgraph_st {
  std::vector<std::function<void()>> ops;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> ops;
};
struct CUstream_st {
  bool non_blocking = false;
  CUgraph_st* capture = nullptr;  // recording (cudaStreamBeginCapture) into this graph
  bool capture_invalidated = false;
  // Lazy streams (EDGETRAIN_CUDA_EMU_STREAMS): the work issued and not run yet, and the numbers of
  // operations issued and run so far.
  std::deque<std::function<void()>> pending;
  uint64_t issued = 0, done = 0;
};
struct CUevent_st {
  bool timing = true;
  bool recorded = false;
  double ms = 0;                     // host time of the last record
  CUgraph_st* recorded_in = nullptr;  // the record it was last recorded in, while recording
  CUstream_st* stream = nullptr;     // lazy streams: its last record is operation `seq` of `stream`
  uint64_t seq = 0;
};

namespace emu {

long setting(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : fallback;
}

namespace {

[[noreturn]] void fail(const std::string& what);

int device_count() { return int(setting("EDGETRAIN_CUDA_EMU_DEVICES", 1)); }
size_t capacity() { return size_t(setting("EDGETRAIN_CUDA_EMU_MB", 8192)) << 20; }

std::recursive_mutex& big_lock() {
  static std::recursive_mutex m;  // the runtime is one device: one caller at a time
  return m;
}
using Lock = std::lock_guard<std::recursive_mutex>;

thread_local cudaError_t last_error = cudaSuccess;
cudaError_t note(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// ---- device memory: each allocation ends at a guard page ----
struct Allocation {
  char* base;        // of the mapping
  size_t map_bytes;  // with the guard page
  size_t bytes;      // asked for
};
std::map<uintptr_t, Allocation>& allocations() {
  static std::map<uintptr_t, Allocation> m;
  return m;
}
size_t allocated_bytes = 0;
const size_t kPage = 4096, kHugePage = size_t(2) << 20;
std::map<uintptr_t, size_t>& pinned() {  // cudaHostAlloc's: host memory a kernel may read (UVA)
  static std::map<uintptr_t, size_t> m;
  return m;
}
bool is_pinned(const void* p, size_t bytes) {
  const uintptr_t a = uintptr_t(p);
  auto it = pinned().upper_bound(a);
  return it != pinned().begin() && a + bytes <= std::prev(it)->first + std::prev(it)->second;
}

// Device memory is readable only by device work (kernels, copies, cuBLAS): between them it is
// PROT_NONE, so host code that reads or writes through a device pointer faults here as it would
// on a GPU (EDGETRAIN_CUDA_EMU_PROTECT=0 leaves it readable).
bool protect_device() {
  static const bool on = setting("EDGETRAIN_CUDA_EMU_PROTECT", 1) != 0;
  return on;
}
int device_depth = 0;
void set_device_access(int prot) {
  for (auto& a : allocations()) mprotect(a.second.base, a.second.map_bytes - kPage, prot);
}
struct DeviceAccess {
  DeviceAccess() {
    if (protect_device() && device_depth++ == 0) set_device_access(PROT_READ | PROT_WRITE);
  }
  ~DeviceAccess() {
    if (protect_device() && --device_depth == 0) set_device_access(PROT_NONE);
  }
};

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The allocation holding [p, p + n), or null.
const Allocation* device_range(const void* p, size_t n, uintptr_t* start = nullptr) {
  const uintptr_t a = uintptr_t(p);
  auto& m = allocations();
  auto it = m.upper_bound(a);
  if (it == m.begin()) return nullptr;
  --it;
  if (a < it->first || a + n > it->first + it->second.bytes) return nullptr;
  if (start) *start = it->first;
  return &it->second;
}

// What lies near an address, for a fault's report.
std::string describe_address(uintptr_t a) {
  char buf[256];
  auto& m = allocations();
  auto it = m.upper_bound(a);
  if (it != m.begin()) {
    --it;
    const uintptr_t end = it->first + round_up(it->second.bytes, 256);
    if (a >= it->first && a < end + kPage) {
      std::snprintf(buf, sizeof(buf), "%zu bytes past the start of a %zu-byte device allocation (%s its end)",
                    size_t(a - it->first), it->second.bytes, a >= it->first + it->second.bytes ? "past" : "before");
      return buf;
    }
  }
  std::snprintf(buf, sizeof(buf), "not in or just after any device allocation");
  return buf;
}

// ---- streams and capture ----
CUstream_st* capturing = nullptr;  // the stream recording (one at a time: thread-local mode)

// EDGETRAIN_CUDA_EMU_STREAMS=lazy (the default): a created stream's work waits in its queue until
// something needs it: a host synchronisation (of the stream, an event recorded in it, the
// device), another stream's wait for one of its events, a synchronous copy or memset (the legacy
// stream, which waits for the blocking streams only), a free. So work a stream issues runs as late
// as CUDA lets it, and a reader that does not wait for it (another stream without
// cudaStreamWaitEvent, the host without a synchronisation, a page-locked buffer the host writes
// again before its copy ran) reads what was there before, as a GPU may. "eager" runs each
// operation when issued (a fault's host stack is then the launch's).
bool lazy_streams() {
  static const bool lazy = [] {
    const char* v = std::getenv("EDGETRAIN_CUDA_EMU_STREAMS");
    if (!v || !*v || !std::strcmp(v, "lazy")) return true;
    if (!std::strcmp(v, "eager")) return false;
    std::fprintf(stderr, "CUDA emulator: EDGETRAIN_CUDA_EMU_STREAMS='%s': expected lazy or eager\n", v);
    std::abort();
  }();
  return lazy;
}
std::set<CUstream_st*>& streams() {  // the created streams (the legacy stream is none of them)
  static std::set<CUstream_st*> s;
  return s;
}

// Runs stream q's queued work up to its operation `upto` (all of it by default).
void drain(CUstream_st* q, uint64_t upto = UINT64_MAX) {
  if (!streams().count(q)) return;  // destroyed: its work ran then
  while (q->done < upto && !q->pending.empty()) {
    std::function<void()> op = std::move(q->pending.front());
    q->pending.pop_front();
    ++q->done;
    DeviceAccess device;
    op();
  }
}
void drain_blocking() {  // what the legacy stream waits for
  for (CUstream_st* s : streams())
    if (!s->non_blocking) drain(s);
}
void drain_all() {
  for (CUstream_st* s : streams()) drain(s);
}

// An operation of stream `s`: recorded where s records; else queued (lazy streams) or run now.
// The legacy stream (s null) runs it now, after the blocking streams' work. The legacy stream while
// a blocking stream records would join that stream to the record: CUDA fails it and invalidates
// the record.
cudaError_t enqueue(cudaStream_t s, std::function<void()> op) {
  if (s && s->capture) {
    s->capture->ops.push_back(std::move(op));
    return cudaSuccess;
  }
  if (!s && capturing) {
    capturing->capture_invalidated = true;
    return note(cudaErrorStreamCaptureImplicit);
  }
  if (lazy_streams()) {
    if (s) {
      s->pending.push_back(std::move(op));
      ++s->issued;
      return cudaSuccess;
    }
    drain_blocking();
  }
  DeviceAccess device;
  op();
  return cudaSuccess;
}

// A call CUDA prohibits while this thread records (thread-local mode): it fails, and so does the
// record.
bool refused_in_capture() {
  if (!capturing) return false;
  capturing->capture_invalidated = true;
  note(cudaErrorStreamCaptureUnsupported);
  return true;
}

// The emulator's report of a fault (the thread that made it, if a kernel runs), then an abort.
[[noreturn]] void fail(const std::string& what) {
  std::fflush(stdout);
  char at[256];
  std::fprintf(stderr, "CUDA emulator: %s", what.c_str());
  if (running_thread(at, sizeof(at))) std::fprintf(stderr, " (%s)", at);
  std::fprintf(stderr, "\n");
  std::abort();
}

// An illegal address (a guard page) or a thread's stack overflow: where it happened.
void on_fault(int sig, siginfo_t* info, void*) {
  const uintptr_t a = uintptr_t(info->si_addr);
  char buf[512];
  char at[256];
  if (running_thread(at, sizeof(at))) {
    std::snprintf(buf, sizeof(buf), "CUDA emulator: illegal address %#lx in %s: %s\n", (unsigned long)a, at,
                  describe_address(a).c_str());
  } else if (device_range(reinterpret_cast<const void*>(a), 1)) {
    std::snprintf(buf, sizeof(buf),
                  "CUDA emulator: host code touched device memory at %#lx (%s): a GPU faults there too; "
                  "the host reads device memory through a copy (HostView). Host stack:\n",
                  (unsigned long)a, describe_address(a).c_str());
  } else {
    std::snprintf(buf, sizeof(buf), "CUDA emulator: signal %d at address %#lx outside any kernel: %s\n", sig,
                  (unsigned long)a, describe_address(a).c_str());
  }
  ssize_t r = write(2, buf, std::strlen(buf));
  (void)r;
  void* frames[32];
  backtrace_symbols_fd(frames, backtrace(frames, 32), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

void install_fault_handler() {
  static bool done = false;
  if (done) return;
  done = true;
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now, not first inside the handler
  static char alt[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt;
  ss.ss_size = sizeof(alt);
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace

void launch_kernel(const char* name, dim3 grid, dim3 block, size_t shared_bytes, CUstream_st* stream,
                   std::function<void()> body) {
  Lock lock(big_lock());
  install_fault_handler();
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u ||
      shared_bytes > 48 * 1024) {
    std::fprintf(stderr,
                 "CUDA emulator: kernel %s launched with grid (%u, %u, %u), block (%u, %u, %u), %zu bytes of "
                 "shared memory: outside CUDA's limits\n",
                 name, grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes);
    note(cudaErrorInvalidConfiguration);
    return;
  }
  std::string kernel = name;
  enqueue(stream, [kernel, grid, block, body]() { run_grid(kernel.c_str(), grid, block, body); });
}

void check_kernel_pointer(const char* kernel, int index, const void* p) {
  if (!p) return;
  Lock lock(big_lock());
  const uintptr_t a = uintptr_t(p);
  auto& m = allocations();
  auto it = m.upper_bound(a);
  if (it != m.begin() && a <= std::prev(it)->first + std::prev(it)->second.bytes) return;  // its end too
  auto& h = pinned();
  auto jt = h.upper_bound(a);
  if (jt != h.begin() && a <= std::prev(jt)->first + std::prev(jt)->second) return;
  fail(std::string("a launch of kernel ") + kernel + " passes argument " + std::to_string(index) +
       " a pointer to neither device nor page-locked memory: a GPU faults on it");
}

}  // namespace emu

using namespace emu;

// ---- the runtime API ----
cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return *count > 0 ? cudaSuccess : note(cudaErrorNoDevice);
}
cudaError_t cudaSetDevice(int device) {
  return device >= 0 && device < device_count() ? cudaSuccess : note(cudaErrorInvalidDevice);
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (device < 0 || device >= device_count()) return note(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof(p->name), "CUDA emulator on the host (tests/cuda_emu)");
  p->totalGlobalMem = capacity();
  p->sharedMemPerBlock = 48 * 1024;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = p->maxGridSize[2] = 65535;
  p->major = int(setting("EDGETRAIN_CUDA_EMU_MAJOR", 9));
  p->minor = 0;
  p->multiProcessorCount = int(setting("EDGETRAIN_CUDA_EMU_SMS", 4));
  p->l2CacheSize = 4 << 20;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) return note(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = int(p.sharedMemPerBlock); break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    default: return note(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  Lock lock(big_lock());
  if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
  drain_all();
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return last_error; }
const char* cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnmatched: return "capture was not initiated in this stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
  }
  return "unknown error";
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  Lock lock(big_lock());
  *total_bytes = capacity();
  *free_bytes = capacity() - std::min(capacity(), allocated_bytes);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  Lock lock(big_lock());
  *p = nullptr;
  if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
  if (device_count() == 0) return note(cudaErrorNoDevice);
  if (bytes == 0) return cudaSuccess;
  if (bytes > capacity() || allocated_bytes + bytes > capacity()) return note(cudaErrorMemoryAllocation);
  install_fault_handler();
  const size_t body = round_up(bytes, 256), map_bytes = round_up(body, kPage) + kPage;
  // Large allocations start on a 2 MiB boundary, in transparent huge pages where the kernel gives
  // them: the protection switched before and after each device operation (set_device_access) then
  // changes one entry per 2 MiB instead of 512 (it was a quarter of the emulator's time).
  const bool huge = map_bytes >= 2 * kHugePage;
  const size_t slack = huge ? kHugePage : 0;
  char* m = static_cast<char*>(mmap(nullptr, map_bytes + slack, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (m == MAP_FAILED) return note(cudaErrorMemoryAllocation);
  char* base = m;
  if (huge) {
    base = reinterpret_cast<char*>(round_up(uintptr_t(m), kHugePage));
    if (base > m) munmap(m, size_t(base - m));
    if (base + map_bytes < m + map_bytes + slack) munmap(base + map_bytes, size_t(m + slack - base));
    madvise(base, map_bytes - kPage, MADV_HUGEPAGE);
  }
  mprotect(base + map_bytes - kPage, kPage, PROT_NONE);
  char* ptr = base + map_bytes - kPage - body;
  // Fresh device memory holds anything: here NaN in every float (and -1 in every integer), so a
  // read before a write shows in the results instead of passing as the zeros a GPU often gives.
  std::memset(ptr, int(setting("EDGETRAIN_CUDA_EMU_FILL", 0xFF)), bytes);
  if (protect_device() && device_depth == 0) mprotect(base, map_bytes - kPage, PROT_NONE);
  allocations()[uintptr_t(ptr)] = Allocation{base, map_bytes, bytes};
  allocated_bytes += bytes;
  *p = ptr;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  Lock lock(big_lock());
  if (!p) return cudaSuccess;
  if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
  auto it = allocations().find(uintptr_t(p));
  if (it == allocations().end()) return note(cudaErrorInvalidDevicePointer);
  drain_all();  // cudaFree waits for the device's work
  allocated_bytes -= it->second.bytes;
  munmap(it->second.base, it->second.map_bytes);
  allocations().erase(it);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  Lock lock(big_lock());
  *p = std::malloc(bytes ? bytes : 1);
  if (!*p) return note(cudaErrorMemoryAllocation);
  pinned()[uintptr_t(*p)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }
cudaError_t cudaFreeHost(void* p) {
  Lock lock(big_lock());
  drain_all();  // as cudaFree
  pinned().erase(uintptr_t(p));
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  Lock lock(big_lock());
  *attr = cudaPointerAttributes{};
  uintptr_t start = 0;
  if (device_range(p, 1, &start)) {
    attr->type = cudaMemoryTypeDevice;
    attr->devicePointer = const_cast<void*>(p);
  } else {
    attr->type = cudaMemoryTypeUnregistered;
    attr->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}

namespace {

// A copy's operands where its kind says they are: on the device, inside one allocation.
void check_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, const char* what) {
  if (bytes == 0) return;
  const bool dst_device = device_range(dst, 1) != nullptr, src_device = device_range(src, 1) != nullptr;
  if (kind == cudaMemcpyDefault) kind = cudaMemcpyKind((src_device ? 2 : 0) | (dst_device ? 1 : 0));
  char buf[160];
  std::snprintf(buf, sizeof(buf), "%s of %zu bytes", what, bytes);
  if ((kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice) && !device_range(dst, bytes))
    fail(std::string(buf) + ": the destination is not inside one device allocation (" +
         describe_address(uintptr_t(dst)) + ")");
  if ((kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice) && !device_range(src, bytes))
    fail(std::string(buf) + ": the source is not inside one device allocation (" + describe_address(uintptr_t(src)) +
         ")");
  if (kind == cudaMemcpyDeviceToHost && dst_device) fail(std::string(buf) + ": device to host into device memory");
  if (kind == cudaMemcpyHostToDevice && src_device) fail(std::string(buf) + ": host to device from device memory");
}

}  // namespace

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  Lock lock(big_lock());
  if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
  check_copy(dst, src, bytes, kind, "cudaMemcpy");
  drain_blocking();  // the legacy stream's copy: after the blocking streams' work, not the others'
  DeviceAccess device;
  if (bytes) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  Lock lock(big_lock());
  check_copy(dst, src, bytes, kind, "cudaMemcpyAsync");
  const bool src_host = bytes && !device_range(src, 1), dst_host = bytes && !device_range(dst, 1);
  if (src_host && !is_pinned(src, bytes)) {
    // From pageable memory CUDA takes the bytes before it returns (a staged copy).
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    return enqueue(s, [dst, staged]() { std::memmove(dst, staged->data(), staged->size()); });
  }
  const cudaError_t e = enqueue(s, [dst, src, bytes]() {
    if (bytes) std::memmove(dst, src, bytes);
  });
  // Into pageable memory it returns once the copy is done (the stream's work before it too).
  if (e == cudaSuccess && dst_host && !is_pinned(dst, bytes) && s && !s->capture) drain(s);
  return e;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  Lock lock(big_lock());
  if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
  if (bytes && !device_range(p, bytes))
    fail("cudaMemset of " + std::to_string(bytes) + " bytes outside one device allocation (" +
         describe_address(uintptr_t(p)) + ")");
  drain_blocking();  // the legacy stream's, as cudaMemcpy
  DeviceAccess device;
  if (bytes) std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  Lock lock(big_lock());
  if (bytes && !device_range(p, bytes))
    fail("cudaMemsetAsync of " + std::to_string(bytes) + " bytes outside one device allocation (" +
         describe_address(uintptr_t(p)) + ")");
  return enqueue(s, [p, value, bytes]() {
    if (bytes) std::memset(p, value, bytes);
  });
}

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  Lock lock(big_lock());
  *s = new CUstream_st;
  (*s)->non_blocking = (flags & cudaStreamNonBlocking) != 0;
  streams().insert(*s);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  Lock lock(big_lock());
  if (s == capturing) capturing = nullptr;
  drain(s);  // CUDA finishes a destroyed stream's work
  streams().erase(s);
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  Lock lock(big_lock());
  if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
  if (s) drain(s);
  else drain_blocking();
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) { return cudaStreamSynchronize(s); }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  Lock lock(big_lock());
  // A recording stream may wait only for an event recorded in the same record (which orders
  // nothing more here: the record's operations replay in the order issued).
  if (s && s->capture && e->recorded_in != s->capture) {
    s->capture_invalidated = true;
    std::fprintf(stderr, "CUDA emulator: cudaStreamWaitEvent on a recording stream, for an event recorded "
                         "outside the record\n");
    return note(cudaErrorStreamCaptureUnsupported);
  }
  if (s && s->capture) return cudaSuccess;
  // Lazy streams: s's later work runs after the event's stream has run up to the record the event
  // has now (an event never recorded, or recorded in the legacy stream, is complete).
  if (CUstream_st* st = e->stream) {
    const uint64_t seq = e->seq;
    return enqueue(s, [st, seq]() { drain(st, seq); });
  }
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  *e = new CUevent_st;
  (*e)->timing = (flags & cudaEventDisableTiming) == 0;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Lock lock(big_lock());
  e->recorded_in = s && s->capture ? s->capture : nullptr;
  const cudaError_t r = enqueue(s, [e]() {
    e->recorded = true;
    e->ms = now_ms();
  });
  if (r == cudaSuccess && !(s && s->capture)) {  // (the legacy stream's record ran at once)
    e->stream = lazy_streams() && s ? s : nullptr;
    e->seq = s ? s->issued : 0;
  }
  return r;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Lock lock(big_lock());
  if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
  if (e->stream) drain(e->stream, e->seq);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) { return cudaEventSynchronize(e); }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!start->timing || !end->timing || !start->recorded || !end->recorded) return note(cudaErrorInvalidResourceHandle);
  *ms = float(end->ms - start->ms);
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  Lock lock(big_lock());
  if (!s || s->capture || capturing) return note(cudaErrorStreamCaptureUnsupported);
  s->capture = new CUgraph_st;
  s->capture_invalidated = false;
  capturing = s;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  Lock lock(big_lock());
  *graph = nullptr;
  if (!s || !s->capture) return note(cudaErrorStreamCaptureUnmatched);
  CUgraph_st* g = s->capture;
  s->capture = nullptr;
  capturing = nullptr;
  if (s->capture_invalidated) {
    delete g;
    return note(cudaErrorStreamCaptureInvalidated);
  }
  *graph = g;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  *exec = new CUgraphExec_st{graph->ops};
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  Lock lock(big_lock());
  if (!exec) return note(cudaErrorInvalidResourceHandle);
  std::vector<std::function<void()>> ops = exec->ops;  // (the exec may be destroyed before it runs)
  return enqueue(s, [ops]() {
    for (const auto& op : ops) op();
  });
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}

// ---- for the emulator's other parts (emu_internal.h) ----
namespace emu {
std::recursive_mutex& runtime_lock() { return big_lock(); }
void report_fault(const std::string& what) { fail(what); }
bool in_device_memory(const void* p, size_t bytes) { return device_range(p, bytes) != nullptr; }
std::string where(const void* p) { return describe_address(uintptr_t(p)); }
cudaError_t issue(cudaStream_t s, std::function<void()> op) { return enqueue(s, std::move(op)); }
}  // namespace emu
