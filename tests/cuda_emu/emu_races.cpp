// The CUDA emulator's race checker (-DEDGETRAIN_CUDA_EMU_RACES=ON, scripts/cuda_emu.sh with
// RACES=1). The emulator runs one thread at a time, so two threads of a launch that touch one
// address without a barrier between them give the same result in every run here, and a GPU may
// give another. The kernels' sources are compiled with GCC's ThreadSanitizer instrumentation
// (-fsanitize=thread), which calls __tsan_readN / __tsan_writeN before each memory access; this
// file is that runtime, not TSan's: it keeps, for each byte a launch touches, the last thread that
// wrote it and the last that read it, with the barrier and warp collective they had passed, and
// stops with a report where a thread reads or writes what another thread wrote (or writes what it
// read) and nothing orders the two:
//   - threads of two blocks: nothing does (a launch's blocks run in any order, at once);
//   - threads of one block: a __syncthreads between them, or in one warp a warp collective.
// Atomics (cuda_emu.h) do not race with each other, only with plain accesses. Shared memory (a
// kernel's __shared__, here a function's static) is its block's own: a new block starts it afresh.
// Each thread's own stack (its locals) is not checked. Host code (outside a launch) is not either.
// It also stops at a read of shared memory the block has not written, and at a misaligned access.
// It keeps one reader a byte (the last), so it can miss a read followed by another thread's write;
// what it reports is a race. With EDGETRAIN_CUDA_EMU_TRAFFIC, it counts the accesses instead
// (emu_traffic.cpp).
#include "emu_internal.h"

#if defined(EDGETRAIN_CUDA_EMU_RACES)
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>

// Every __shared__ array (a function's static here) is in section emu_shared (cuda_emu.h), which
// the linker brackets with these.
extern "C" char __start_emu_shared[] __attribute__((weak)), __stop_emu_shared[] __attribute__((weak));

namespace emu {
namespace {

enum : uint8_t { kWritten = 1, kRead = 2, kAtomicWrite = 4 };

// One byte's last writer and reader in the launch (device memory) or block (shared) of `stamp`.
struct Cell {
  uint32_t stamp;
  uint32_t w_block, r_block;
  uint16_t w_thread, r_thread;
  uint16_t w_barrier, w_warp, r_barrier, r_warp;
  uint8_t flags;
};

// The shadow of a 4 KiB page: its cells where it is device or shared memory, nothing for other
// host memory (a launch's parameters, constants: read only, never a race), which is skipped.
const size_t kPageBytes = 4096;
struct Page {
  Cell* cells = nullptr;
  uint32_t classified = 0;  // the launch that found its kind (device memory comes and goes)
  bool tracked = false, shared = false;
};
struct Shadow {
  std::unordered_map<uintptr_t, Page> pages;
  // The pages used last, by page number: a thread's accesses go to a few tensors in turn.
  struct Slot {
    uintptr_t page = ~uintptr_t(0);
    Page* at = nullptr;
  };
  Slot recent[64];
  Page& page(uintptr_t a, uint32_t launch, bool with_cells = true) {
    const uintptr_t n = a / kPageBytes;
    Slot& slot = recent[n % 64];
    if (slot.page != n) {
      slot.page = n;
      slot.at = &pages[n];  // unordered_map: a Page stays where it is while others come
    }
    Page& p = *slot.at;
    if (p.classified != launch) {
      p.classified = launch;
      p.shared = is_shared(a);
      p.tracked = p.shared || in_device_memory(reinterpret_cast<const void*>(a), 1);
      if (p.tracked && with_cells && !p.cells) p.cells = static_cast<Cell*>(std::calloc(kPageBytes, sizeof(Cell)));  // stamp 0
    }
    return p;
  }
  size_t bytes() const { return pages.size() * kPageBytes * sizeof(Cell); }
  void clear() {
    for (auto& kv : pages) std::free(kv.second.cells);
    pages.clear();
    for (Slot& s : recent) s = Slot();
  }
  static bool in_shared(uintptr_t a) { return a >= uintptr_t(__start_emu_shared) && a < uintptr_t(__stop_emu_shared); }
  // The page holds shared memory (and maybe other statics, which in_shared() tells apart).
  static bool is_shared(uintptr_t a) {
    const uintptr_t first = a / kPageBytes * kPageBytes;
    return first < uintptr_t(__stop_emu_shared) && first + kPageBytes > uintptr_t(__start_emu_shared);
  }
};
Shadow shadow;

// An access by another thread (its block, thread, barrier and warp-collective counts) ordered
// before t's?
bool ordered(const ThreadAt& t, uint32_t block, uint16_t thread, uint16_t barrier, uint16_t warp) {
  if (block != t.block) return false;
  if (barrier != uint16_t(t.barrier)) return true;
  return thread / 32 == t.thread / 32 && warp != uint16_t(t.warp_sync);
}

// The kernel's line of an access (`code`: the instrumented call's return address), by addr2line
// (a RelWithDebInfo build names the line, a Release build the function).
std::string source_line(const void* code) {
  Dl_info info;
  if (!dladdr(code, &info) || !info.dli_fname) return "an unknown place";
  char cmd[1024];
  std::snprintf(cmd, sizeof(cmd), "addr2line -f -C -i -e '%s' %#lx 2>/dev/null", info.dli_fname,
                (unsigned long)(uintptr_t(code) - 1 - uintptr_t(info.dli_fbase)));
  std::string out;
  if (FILE* f = popen(cmd, "r")) {
    char line[512];
    while (std::fgets(line, sizeof(line), f)) {
      std::string l(line);
      while (!l.empty() && l.back() == '\n') l.pop_back();
      out += (out.empty() ? "" : " <- ") + l;
    }
    pclose(f);
  }
  return out.empty() ? std::string("an address addr2line cannot name in ") + info.dli_fname : out;
}

[[noreturn]] void report(const ThreadAt& t, uintptr_t a, const void* code, const char* mine, const char* theirs,
                         uint32_t block, uint16_t thread, bool shared) {
  char buf[640];
  std::snprintf(buf, sizeof(buf),
                "race: this thread %s %s address %#lx (%s) that thread %u of %s %s with nothing ordering the two "
                "(no __syncthreads between them; threads of two blocks are never ordered), at ",
                mine, shared ? "shared-memory" : "device-memory", (unsigned long)a,
                shared ? "a __shared__ array" : where(reinterpret_cast<const void*>(a)).c_str(), unsigned(thread),
                block == t.block ? "this block" : "another block", theirs);
  report_fault(buf + source_line(code));
}

enum class Kind { Read, Write, Atomic };

[[noreturn]] void report_unwritten(uintptr_t a, Kind kind, const void* code) {
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "unwritten: this thread %s shared-memory address %#lx (a __shared__ array) that no thread of this "
                "block wrote: a GPU gives whatever the memory held, at ",
                kind == Kind::Read ? "reads" : "atomically updates", (unsigned long)a);
  report_fault(buf + source_line(code));
}

// One byte of an access by t: a report where it races, else the byte's new writer or reader.
void check_byte(const ThreadAt& t, const Page& page, uintptr_t a, Kind kind, const void* code) {
  const bool shared = page.shared;
  const uint32_t stamp = shared ? t.block : t.launch;
  const uint16_t me = uint16_t(t.thread), bar = uint16_t(t.barrier), warp = uint16_t(t.warp_sync);
  Cell& cell = page.cells[a % kPageBytes];
  if (cell.stamp != stamp) {
    std::memset(&cell, 0, sizeof(cell));
    cell.stamp = stamp;
  }
  const bool w_other = (cell.flags & kWritten) && !(cell.w_block == t.block && cell.w_thread == me);
  const bool r_other = (cell.flags & kRead) && !(cell.r_block == t.block && cell.r_thread == me);
  const bool w_unordered = w_other && !ordered(t, cell.w_block, cell.w_thread, cell.w_barrier, cell.w_warp);
  const bool both_atomic = kind == Kind::Atomic && (cell.flags & kAtomicWrite);
  if (w_unordered && !both_atomic)
    report(t, a, code, kind == Kind::Read ? "reads" : "writes",
           (cell.flags & kAtomicWrite) ? "wrote atomically" : "wrote", cell.w_block, cell.w_thread, shared);
  // A block's shared memory starts holding anything (here what the last block left): a read, or an
  // atomic, of a byte no thread of the block has written reads that.
  if (shared && kind != Kind::Write && !(cell.flags & kWritten)) report_unwritten(a, kind, code);
  if (kind == Kind::Read) {
    cell.flags |= kRead;
    cell.r_block = t.block;
    cell.r_thread = me;
    cell.r_barrier = bar;
    cell.r_warp = warp;
    return;
  }
  if (r_other && !ordered(t, cell.r_block, cell.r_thread, cell.r_barrier, cell.r_warp))
    report(t, a, code, kind == Kind::Atomic ? "atomically writes" : "writes", "read", cell.r_block, cell.r_thread,
           shared);
  // kAtomicWrite: the last write was an atomic's (the next atomic does not race with it).
  cell.flags = uint8_t((cell.flags & ~kAtomicWrite) | kWritten | (kind == Kind::Atomic ? kAtomicWrite : 0));
  cell.w_block = t.block;
  cell.w_thread = me;
  cell.w_barrier = bar;
  cell.w_warp = warp;
}

// A GPU reads and writes 2, 4 and 8 bytes only at a multiple of their size: elsewhere the
// kernel stops ("misaligned address"), where the host's x86 just reads. `align` is what the
// access needs (its size for the compiler's aligned accesses, 1 where it knew of less).
[[noreturn]] void report_misaligned(uintptr_t a, size_t bytes, size_t align, Kind kind, bool shared,
                                    const void* code) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "misaligned: this thread %s %zu bytes at address %#lx (%s), not a multiple of %zu: a GPU stops the "
                "kernel there (misaligned address), at ",
                kind == Kind::Read ? "reads" : kind == Kind::Write ? "writes" : "atomically updates", bytes,
                (unsigned long)a, shared ? "a __shared__ array" : where(reinterpret_cast<const void*>(a)).c_str(),
                align);
  report_fault(buf + source_line(code));
}

void access(const void* p, size_t bytes, Kind kind, const void* code, size_t align = 1) {
  ThreadAt t;
  if (!thread_at(t)) return;
  const char* c = static_cast<const char*>(p);
  if (c >= t.stack_lo && c < t.stack_hi) return;  // its own locals
  const uintptr_t a0 = uintptr_t(p);
  static const bool counting = traffic_on();  // instead of checking
  if (counting) {
    const Page& page = shadow.page(a0, t.launch, false);
    if (page.tracked && (!page.shared || Shadow::in_shared(a0)))
      traffic_access(t, a0, bytes, int(kind), page.shared, code);
    return;
  }
  for (uintptr_t a = a0, end = a0 + bytes; a < end;) {
    const Page& page = shadow.page(a, t.launch);  // once per page the access touches
    const uintptr_t stop = std::min(end, (a / kPageBytes + 1) * kPageBytes);
    if (!page.tracked) {
      a = stop;
      continue;
    }
    if (a == a0 && a0 % align && (!page.shared || Shadow::in_shared(a0)))
      report_misaligned(a0, bytes, align, kind, page.shared, code);
    for (; a < stop; ++a)
      if (!page.shared || Shadow::in_shared(a)) check_byte(t, page, a, kind, code);
  }
}

}  // namespace

void race_atomic(const void* p, unsigned bytes) {
  access(p, bytes, Kind::Atomic, __builtin_return_address(0), bytes);
}

void races_launch_done() {
  // The cells of a launch's device memory are stale once it ends (their stamp); their pages are
  // kept for the next launches unless they hold more than 256 MB.
  if (shadow.bytes() > (size_t(256) << 20)) shadow.clear();
}

}  // namespace emu

// ---- ThreadSanitizer's entry points, as GCC's instrumentation calls them ----
using emu::Kind;
extern "C" {
void __tsan_init() {}
#define ET_HERE __builtin_return_address(0)  // the instrumented access's place in the kernel
// The alignment the compiler's aligned access of n bytes promises. 16 bytes (a struct copied whole)
// are 8-aligned at most here, as the GPU would copy such a struct in 8-byte parts.
#define ET_ALIGN(n) ((n) < 8 ? size_t(n) : size_t(8))
#define ET_TSAN_ACCESS(n)                                                                         \
  void __tsan_read##n(void* p) { emu::access(p, n, Kind::Read, ET_HERE, ET_ALIGN(n)); }           \
  void __tsan_write##n(void* p) { emu::access(p, n, Kind::Write, ET_HERE, ET_ALIGN(n)); }         \
  void __tsan_unaligned_read##n(void* p) { emu::access(p, n, Kind::Read, ET_HERE); }              \
  void __tsan_unaligned_write##n(void* p) { emu::access(p, n, Kind::Write, ET_HERE); }            \
  void __tsan_volatile_read##n(void* p) { emu::access(p, n, Kind::Read, ET_HERE, ET_ALIGN(n)); }  \
  void __tsan_volatile_write##n(void* p) { emu::access(p, n, Kind::Write, ET_HERE, ET_ALIGN(n)); }
ET_TSAN_ACCESS(1)
ET_TSAN_ACCESS(2)
ET_TSAN_ACCESS(4)
ET_TSAN_ACCESS(8)
ET_TSAN_ACCESS(16)
#undef ET_TSAN_ACCESS
void __tsan_read_range(void* p, unsigned long n) { emu::access(p, n, Kind::Read, ET_HERE); }
void __tsan_write_range(void* p, unsigned long n) { emu::access(p, n, Kind::Write, ET_HERE); }
#undef ET_HERE
#undef ET_ALIGN
void __tsan_vptr_read(void**) {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}

// The host code's atomics in the instrumented files (the backend's host side: reference counts,
// std::atomic), done as asked, sequentially consistent; kernels' atomics are cuda_emu.h's.
#define ET_TSAN_ATOMIC(bits, T)                                                                              \
  T __tsan_atomic##bits##_load(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); }  \
  void __tsan_atomic##bits##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); }  \
  T __tsan_atomic##bits##_exchange(volatile T* a, T v, int) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_add(volatile T* a, T v, int) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_sub(volatile T* a, T v, int) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_and(volatile T* a, T v, int) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_or(volatile T* a, T v, int) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }   \
  T __tsan_atomic##bits##_fetch_xor(volatile T* a, T v, int) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_nand(volatile T* a, T v, int) {                                            \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                                    \
  }                                                                                                         \
  int __tsan_atomic##bits##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {                  \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                \
  }                                                                                                         \
  int __tsan_atomic##bits##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {                    \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                 \
  }                                                                                                         \
  T __tsan_atomic##bits##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                        \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                      \
    return c;                                                                                               \
  }
ET_TSAN_ATOMIC(8, uint8_t)
ET_TSAN_ATOMIC(16, uint16_t)
ET_TSAN_ATOMIC(32, uint32_t)
ET_TSAN_ATOMIC(64, uint64_t)
#undef ET_TSAN_ATOMIC
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
}

#else

namespace emu {
void race_atomic(const void*, unsigned) {}
void races_launch_done() {}
}  // namespace emu

#endif
