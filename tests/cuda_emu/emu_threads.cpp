// The CUDA emulator's threads (include/cuda_emu.h): a launch's blocks run one after another
// (run_grid); a block's threads are fibers, each on its own stack, that run to their end one after
// another until a barrier or a warp collective makes them take turns (the scheduler switches
// only then). The kernel language's built-ins (threadIdx, __syncthreads, shuffles, ballots) read
// and change this state. EDGETRAIN_CUDA_EMU_PROFILE=1 prints each kernel's launches, threads and
// host time at exit. The runtime (emu_runtime.cpp) runs a launch through run_grid in stream order.
// EDGETRAIN_CUDA_EMU_REVERSE=1 runs the blocks, and a block's threads between barriers, last to
// first: a kernel whose results change with it reads what another thread (or block) writes with no
// barrier between, a race on a GPU. In thread order a read of a lower thread's write sees it and
// one of a higher thread's does not; reversed, the other way round, so the two orders show both.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

// The threads switch stacks by the assembly below on x86-64 and AArch64 (a Jetson's CPU, and
// qemu-user running the cross build: scripts/cuda_emu.sh CROSS=aarch64), by ucontext elsewhere
// (swapcontext also sets the signal mask: a system call per switch).
#if defined(__x86_64__) || defined(__aarch64__)
#define EMU_OWN_SWITCH 1
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#if !defined(EMU_OWN_SWITCH)
#include <ucontext.h>
#endif

#include "cuda_runtime.h"
#include "emu_internal.h"

namespace emu {
namespace {

const size_t kPage = 4096;
[[noreturn]] void fail(const std::string& what) { report_fault(what); }

bool reversed() {
  static const bool r = setting("EDGETRAIN_CUDA_EMU_REVERSE", 0) != 0;
  return r;
}

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// ---- fibers: the threads of one block ----
struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;
  uint3 tid{0, 0, 0};
  int linear = 0;
  bool done = false;
  const uint64_t* wait_on = nullptr;  // a barrier's generation this thread waits to change
  uint64_t wait_gen = 0;
#if !defined(EMU_OWN_SWITCH)
  ucontext_t ctx;
#endif
};
constexpr int kGatherWords = 4;

struct Warp {
  int count = 0;
  uint64_t gen = 0;
  uint64_t slot[32][kGatherWords];  // each lane's words in a collective
};

const size_t kStackBytes = 256 * 1024;

struct Run {
  const char* kernel = "";
  dim3 grid, block;
  uint3 block_idx{0, 0, 0};
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;  // free thread stacks, kept for later blocks and launches
  std::vector<Warp> warps;
  int threads = 0, live = 0, bar_count = 0;
  int major = 9;  // the device's compute capability at this launch (EDGETRAIN_CUDA_EMU_MAJOR)
  uint64_t bar_gen = 0, progress = 0;
  uint32_t launch_serial = 0, block_serial = 0;  // for the race checker (ThreadAt)
  Fiber* cur = nullptr;
  Fiber* ended = nullptr;  // the thread that ended and returned to the scheduler, its stack to free
  void* sched_sp = nullptr;
  bool running = false;
#if !defined(EMU_OWN_SWITCH)
  ucontext_t sched_ctx;
#endif
};
Run run;
thread_local bool running_here = false;  // this host thread runs the launch (the fibers' thread)

}  // namespace

bool running_thread(char* buf, size_t bytes) {
  if (!run.running || !run.cur) return false;
  std::snprintf(buf, bytes, "kernel %s, block (%u, %u, %u), thread (%u, %u, %u)", run.kernel, run.block_idx.x,
                run.block_idx.y, run.block_idx.z, run.cur->tid.x, run.cur->tid.y, run.cur->tid.z);
  return true;
}

bool thread_at(ThreadAt& t) {
  if (!running_here || !run.cur) return false;
  const Fiber& f = *run.cur;
  t.launch = run.launch_serial;
  t.block = run.block_serial;
  t.thread = uint32_t(f.linear);
  t.barrier = uint32_t(run.bar_gen);
  t.warp_sync = uint32_t(run.warps[size_t(f.linear / 32)].gen);
  t.stack_lo = f.stack;
  t.stack_hi = f.stack + kStackBytes;
  return true;
}

}  // namespace emu

extern "C" void emu_thread_body();

#if defined(EMU_OWN_SWITCH)
// emu_switch(save_sp, next_sp): saves the callee-saved registers on this stack and its pointer in
// *save_sp, then restores another thread's from next_sp and returns into it.
// emu_call_on_stack(save_sp, stack_top, fn): saves this context as emu_switch does and calls fn on
// a fresh stack. A thread that ends without waiting returns through it: one call and one return,
// which the return predictor follows (a switch costs two mispredicted returns). A thread that
// waits switches back to *save_sp, which returns from emu_call_on_stack at once; when it ends
// later, it returns to the scheduler's context saved last in *save_sp (rbx, x19 on AArch64, holds
// save_sp).
extern "C" void emu_switch(void** save_sp, void* next_sp);
extern "C" void emu_call_on_stack(void** save_sp, void* stack_top, void (*fn)());
#if defined(__x86_64__)
asm(R"(
.pushsection .text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch, .-emu_switch
.globl emu_call_on_stack
.type emu_call_on_stack,@function
emu_call_on_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rdi, %rbx
  movq %rsi, %rsp
  call *%rdx
  movq (%rbx), %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_call_on_stack, .-emu_call_on_stack
.popsection
)");
#else
// AArch64 (AAPCS64): x19-x28, the frame pointer x29, the link register x30 (the return address)
// and the low halves of v8-v15 are the callee's to keep; 160 bytes keep sp 16-byte aligned.
#define EMU_SAVE_REGS \
  "  sub sp, sp, #160\n" \
  "  stp x19, x20, [sp, #0]\n" \
  "  stp x21, x22, [sp, #16]\n" \
  "  stp x23, x24, [sp, #32]\n" \
  "  stp x25, x26, [sp, #48]\n" \
  "  stp x27, x28, [sp, #64]\n" \
  "  stp x29, x30, [sp, #80]\n" \
  "  stp d8, d9, [sp, #96]\n" \
  "  stp d10, d11, [sp, #112]\n" \
  "  stp d12, d13, [sp, #128]\n" \
  "  stp d14, d15, [sp, #144]\n" \
  "  mov x9, sp\n" \
  "  str x9, [x0]\n"
#define EMU_RESTORE_REGS_AND_RETURN \
  "  ldp x19, x20, [sp, #0]\n" \
  "  ldp x21, x22, [sp, #16]\n" \
  "  ldp x23, x24, [sp, #32]\n" \
  "  ldp x25, x26, [sp, #48]\n" \
  "  ldp x27, x28, [sp, #64]\n" \
  "  ldp x29, x30, [sp, #80]\n" \
  "  ldp d8, d9, [sp, #96]\n" \
  "  ldp d10, d11, [sp, #112]\n" \
  "  ldp d12, d13, [sp, #128]\n" \
  "  ldp d14, d15, [sp, #144]\n" \
  "  add sp, sp, #160\n" \
  "  ret\n"
asm(".pushsection .text\n"
    ".globl emu_switch\n"
    ".type emu_switch,%function\n"
    "emu_switch:\n" EMU_SAVE_REGS
    "  mov sp, x1\n" EMU_RESTORE_REGS_AND_RETURN
    ".size emu_switch, .-emu_switch\n"
    ".globl emu_call_on_stack\n"
    ".type emu_call_on_stack,%function\n"
    "emu_call_on_stack:\n" EMU_SAVE_REGS
    "  mov x19, x0\n"
    "  mov sp, x1\n"
    "  blr x2\n"
    "  ldr x9, [x19]\n"
    "  mov sp, x9\n" EMU_RESTORE_REGS_AND_RETURN
    ".size emu_call_on_stack, .-emu_call_on_stack\n"
    ".popsection\n");
#undef EMU_SAVE_REGS
#undef EMU_RESTORE_REGS_AND_RETURN
#endif
#endif

namespace emu {
namespace {

void to_scheduler() {
#if defined(EMU_OWN_SWITCH)
  emu_switch(&run.cur->sp, run.sched_sp);
#else
  swapcontext(&run.cur->ctx, &run.sched_ctx);
#endif
}

bool ready(const Fiber& f) { return !f.wait_on || *f.wait_on != f.wait_gen; }

// With the own switch: switches straight from this thread to the next one in the run's order
// (thread order, or reversed) that has started and can run, one stack switch where going through
// the scheduler takes two (barriers were most of the emulator's time). False where the next has
// not started yet, or none can run (and under ucontext): the scheduler starts threads and finds
// deadlocks. Returns true once this thread is resumed (by another thread or the scheduler,
// run.cur = me).
bool switch_to_next_in_order() {
#if defined(EMU_OWN_SWITCH)
  Fiber* me = run.cur;
  const size_t n = run.fibers.size(), at = size_t(me - run.fibers.data());
  const bool back = reversed();
  for (size_t k = 1; k < n; ++k) {
    Fiber& f = run.fibers[back ? (at + n - k) % n : (at + k) % n];
    if (f.done) continue;
    if (!f.stack) return false;
    if (!ready(f)) continue;
    f.wait_on = nullptr;
    run.cur = &f;
    emu_switch(&me->sp, f.sp);
    return true;
  }
#endif
  return false;
}

// This thread waits until *gen_counter is no longer gen.
void wait_for_change(const uint64_t* gen_counter, uint64_t gen) {
  run.cur->wait_on = gen_counter;
  run.cur->wait_gen = gen;
  if (!switch_to_next_in_order()) to_scheduler();
}

// The thread that completes a barrier or warp collective lets the others go first, in the run's
// order from the thread after it: threads arrive in order, so it is the last one, and after the
// barrier they run 0..n-1 (n-1..0 reversed) again. Were it to go on first (one thread ahead of
// the rest), a thread that skips a barrier to read what the first in order writes after it
// would read in time in both orders. It runs on when its turn comes (a thread waits) or the
// scheduler's does; where the next has not started, it goes on (the scheduler starts that later).
void yield_in_order() { (void)switch_to_next_in_order(); }

void resume(Fiber& f) {
  run.cur = &f;
#if defined(EMU_OWN_SWITCH)
  emu_switch(&run.sched_sp, f.sp);
#else
  swapcontext(&run.sched_ctx, &f.ctx);
#endif
}

#if !defined(EMU_OWN_SWITCH)
extern "C" void emu_fiber_main() {
  emu_thread_body();
  to_scheduler();  // never resumed
}
#endif

// A thread's first run, on its stack.
void start(Fiber& f) {
  run.cur = &f;
#if defined(EMU_OWN_SWITCH)
  emu_call_on_stack(&run.sched_sp, reinterpret_cast<void*>(uintptr_t(f.stack + kStackBytes) & ~uintptr_t(15)),
                    &emu_thread_body);
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, emu_fiber_main, 0);
  swapcontext(&run.sched_ctx, &f.ctx);
#endif
}

void complete_barrier_if_all_arrived() {
  if (run.bar_count > 0 && run.bar_count == run.live) {
    run.bar_count = 0;
    ++run.bar_gen;
  }
}

// A block's threads, each to its end; barriers and warp collectives switch between them.
// A thread takes a stack when it first runs and gives it back when it ends, so the threads of a
// block without barriers run one after another on one stack (warm in the caches).
char* take_stack() {
  if (run.stacks.empty()) {
    // A guard page below each stack: a thread that overflows its stack faults.
    char* m = static_cast<char*>(mmap(nullptr, kStackBytes + kPage, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (m == MAP_FAILED) fail("cannot map a thread's stack");
    mprotect(m, kPage, PROT_NONE);
    return m + kPage;
  }
  char* s = run.stacks.back();
  run.stacks.pop_back();
  return s;
}

void run_block() {
  const int n = run.threads;
  if (run.fibers.size() != size_t(n)) run.fibers.resize(size_t(n));
  run.warps.assign(size_t((n + 31) / 32), Warp());
  for (int i = 0; i < n; ++i) {
    Fiber& f = run.fibers[size_t(i)];
    f.linear = i;
    f.tid = uint3{unsigned(i) % run.block.x, unsigned(i) / run.block.x % run.block.y,
                  unsigned(i) / (run.block.x * run.block.y)};
    f.stack = nullptr;
    f.done = false;
    f.wait_on = nullptr;
  }
  run.live = n;
  run.bar_count = 0;
  ++run.block_serial;
  const bool back = reversed();
  while (run.live > 0) {
    const uint64_t before = run.progress;
    for (int i = 0; i < n; ++i) {
      Fiber& f = run.fibers[size_t(back ? n - 1 - i : i)];
      if (!f.done && ready(f)) {
        f.wait_on = nullptr;
        if (!f.stack) {
          f.stack = take_stack();
          start(f);
        } else {
          resume(f);
        }
        // Back here: a thread waits (this one or another it switched to) or one ended.
        if (Fiber* e = run.ended) {
          run.stacks.push_back(e->stack);
          e->stack = nullptr;
          run.ended = nullptr;
        }
      }
    }
    run.cur = nullptr;
    if (run.progress == before) {
      // Every thread left waits at a barrier or a warp collective that cannot complete.
      char buf[320];
      std::snprintf(buf, sizeof(buf), "kernel %s, block (%u, %u, %u): %d of %d threads still running, %d of them at "
                    "__syncthreads", run.kernel, run.block_idx.x, run.block_idx.y, run.block_idx.z, run.live, n,
                    run.bar_count);
      fail(std::string(buf) + ": they wait at a barrier or warp collective that never completes (a thread exited "
           "or went another way first)");
    }
  }
}

}  // namespace

// ---- the kernel language's built-ins ----
const uint3& thread_idx() { return run.cur->tid; }
const uint3& block_idx() { return run.block_idx; }
const dim3& block_dim() { return run.block; }
const dim3& grid_dim() { return run.grid; }
int lane_id() { return run.cur->linear % 32; }

void syncthreads() {
  const uint64_t gen = run.bar_gen;
  ++run.bar_count;
  ++run.progress;
  if (run.bar_count == run.live) {
    run.bar_count = 0;
    ++run.bar_gen;
    yield_in_order();
    return;
  }
  wait_for_change(&run.bar_gen, gen);
}

namespace {

unsigned lanes_of_warp(int w) {
  const int n = std::min(32, run.threads - 32 * w);
  return n == 32 ? 0xFFFFFFFFu : (1u << n) - 1;
}

void warp_arrive(Warp& w, unsigned lanes) {
  const uint64_t gen = w.gen;
  ++w.count;
  ++run.progress;
  if (w.count == __builtin_popcount(lanes)) {
    w.count = 0;
    ++w.gen;
    yield_in_order();
    return;
  }
  wait_for_change(&w.gen, gen);
}

// The running lane's warp for a collective over `mask` (`what`, in a report where the mask leaves
// the lane out or names lanes its block does not have), with the mask's lanes and the lane.
Warp& collective(unsigned mask, const char* what, unsigned& lanes, int& lane) {
  const int wi = run.cur->linear / 32;
  lane = run.cur->linear % 32;
  lanes = mask & lanes_of_warp(wi);
  if (!(lanes >> lane & 1u)) fail(std::string(what) + " by a lane outside its mask");
  if (lanes != mask) fail(std::string(what) + "'s mask names lanes the block does not have");
  return run.warps[size_t(wi)];
}

}  // namespace

uint64_t warp_exchange(unsigned mask, uint64_t mine, int src_lane) {
  unsigned lanes;
  int lane;
  Warp& w = collective(mask, "a warp collective", lanes, lane);
  w.slot[lane][0] = mine;
  warp_arrive(w, lanes);
  const uint64_t got = src_lane >= 0 && src_lane < 32 && (lanes >> src_lane & 1u) ? w.slot[src_lane][0] : mine;
  warp_arrive(w, lanes);  // every lane has read before any lane writes its slot again
  return got;
}

void warp_gather(unsigned mask, const uint64_t* mine, int words, uint64_t* all) {
  unsigned lanes;
  int lane;
  Warp& w = collective(mask, "a warp collective", lanes, lane);
  if (words < 1 || words > kGatherWords) fail("warp_gather: 1 to 4 words a lane");
  for (int i = 0; i < words; ++i) w.slot[lane][i] = mine[i];
  warp_arrive(w, lanes);
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < words; ++i) all[l * words + i] = lanes >> l & 1u ? w.slot[l][i] : 0;
  warp_arrive(w, lanes);
}

unsigned warp_ballot(unsigned mask, bool pred) {
  unsigned lanes;
  int lane;
  Warp& w = collective(mask, "a ballot", lanes, lane);
  w.slot[lane][0] = pred;
  warp_arrive(w, lanes);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l)
    if ((lanes >> l & 1u) && w.slot[l][0]) bits |= 1u << l;
  warp_arrive(w, lanes);
  return bits;
}

int device_major() { return run.major; }

namespace {

// EDGETRAIN_CUDA_EMU_PROFILE=1: each kernel's launches, threads and host time, printed at exit
// (where the emulator's time goes). EDGETRAIN_CUDA_EMU_LAUNCHES=<file>: each kernel's largest block
// appended to the file at exit, a line "<kernel as launched> <threads>" each, for
// scripts/cuda_resources.py to hold against the registers nvcc gives the kernel (what a GPU needs
// to launch it, which the emulator does not have).
struct KernelTime {
  long launches = 0;
  double threads = 0, ms = 0;
  unsigned largest_block = 0;
};
std::map<std::string, KernelTime>* kernel_times() {
  static std::map<std::string, KernelTime>* m = nullptr;
  static const bool profile = setting("EDGETRAIN_CUDA_EMU_PROFILE", 0) != 0;
  static const char* launches = std::getenv("EDGETRAIN_CUDA_EMU_LAUNCHES");
  if ((profile || (launches && *launches)) && !m) {
    m = new std::map<std::string, KernelTime>;
    std::atexit([] {
      std::vector<std::pair<std::string, KernelTime>> v(kernel_times()->begin(), kernel_times()->end());
      if (launches && *launches) {
        std::string lines;
        for (const auto& k : v) lines += k.first + " " + std::to_string(k.second.largest_block) + "\n";
        // One write with O_APPEND: the test processes scripts/cuda_emu.sh runs side by side share it.
        const int fd = open(launches, O_WRONLY | O_APPEND | O_CREAT, 0644);
        if (fd < 0 || write(fd, lines.data(), lines.size()) != ssize_t(lines.size()))
          std::fprintf(stderr, "CUDA emulator: could not append to EDGETRAIN_CUDA_EMU_LAUNCHES=%s\n", launches);
        if (fd >= 0) close(fd);
      }
      if (!profile) return;
      std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
      std::fprintf(stderr, "CUDA emulator profile: kernel, launches, threads, ms\n");
      for (size_t i = 0; i < v.size() && i < 25; ++i)
        std::fprintf(stderr, "  %-40s %8ld %14.0f %10.1f\n", v[i].first.c_str(), v[i].second.launches,
                     v[i].second.threads, v[i].second.ms);
    });
  }
  return m;
}

}  // namespace

void run_grid(const char* name, dim3 grid, dim3 block, const std::function<void()>& body) {
  if (run.running) fail(std::string("a launch from inside kernel ") + run.kernel);
  const double t0 = kernel_times() ? now_ms() : 0;
  run.running = true;
  running_here = true;
  ++run.launch_serial;
  run.kernel = name;
  run.grid = grid;
  run.block = block;
  run.body = &body;
  run.threads = int(block.x * block.y * block.z);
  run.major = int(setting("EDGETRAIN_CUDA_EMU_MAJOR", 9));
  const bool back = reversed();
  static const bool counting = traffic_on();
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        run.block_idx = back ? uint3{grid.x - 1 - x, grid.y - 1 - y, grid.z - 1 - z} : uint3{x, y, z};
        run_block();
        if (counting) traffic_block_done(name);
      }
  if (counting) traffic_launch_done(name, uint64_t(grid.x) * grid.y * grid.z, uint64_t(run.threads));
  run.running = false;
  running_here = false;
  run.cur = nullptr;
  races_launch_done();
  if (auto* times = kernel_times()) {
    KernelTime& k = (*times)[name];
    ++k.launches;
    k.threads += double(grid.x) * grid.y * grid.z * run.threads;
    k.ms += now_ms() - t0;
    k.largest_block = std::max(k.largest_block, unsigned(run.threads));
  }
}

}  // namespace emu

using namespace emu;

// A thread's whole run; it returns to the scheduler (emu_call_on_stack) when it ends.
extern "C" void emu_thread_body() {
  (*run.body)();
  run.cur->done = true;
  run.ended = run.cur;
  --run.live;
  ++run.progress;
  complete_barrier_if_all_arrived();
}
