// The CUDA emulator (tests/cuda_emu; docs/cuda-log.md, "The CUDA emulator"): the CUDA runtime, the
// kernel language and the cuBLAS calls this backend uses, run on the host, so the CUDA backend and
// its tests run on a machine without a GPU. It is a test tool, not a backend: every launch runs its
// blocks one after another, each block's threads as fibers on one host thread that switch at
// __syncthreads and at the warp's collectives (shuffles, ballots). What it checks that a compiler
// cannot: the kernels' index arithmetic and bounds (device allocations end at a guard page), the
// launch configurations (CUDA's limits), barriers every thread reaches, warp collectives with every
// lane of their mask, copies and cuBLAS operands inside their allocations, and what a recorded
// step (stream capture) may call, work read before its stream ran it (streams are lazy:
// emu_runtime.cpp), and, built with its race checker (emu_races.cpp), two threads' accesses to one
// address that nothing orders, misaligned accesses and reads of shared memory the block has not
// written. What it cannot: the GPU's rounding where the code
// leaves it to the compiler (nvcc's contraction: CONTRACT=1 builds the device code with GCC's,
// which is not nvcc's) or to device math functions, and speed.
#pragma once
// Device code that has an emulated form of an instruction (inline PTX) asks for it by this.
#define EDGETRAIN_CUDA_EMULATOR 1
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

struct CUstream_st;
struct CUevent_st;

// ---- the kernel language ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
// One block runs at a time, so a function's static is its block's shared memory. The race
// checker finds every __shared__ array in one section (emu_races.cpp: __start_emu_shared).
#if defined(EDGETRAIN_CUDA_EMU_RACES)
#define __shared__ static __attribute__((section("emu_shared")))
#else
#define __shared__ static
#endif

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void syncthreads();
// Exchanges one 64-bit word among the lanes of `mask` (a warp collective): returns what lane
// `src_lane` gave (its own word where `src_lane` is outside the warp's lanes).
uint64_t warp_exchange(unsigned mask, uint64_t mine, int src_lane);
unsigned warp_ballot(unsigned mask, bool pred);
// Gives each lane of `mask` every lane's `words` words (1 to 4; a warp collective):
// all[l * words + i] is lane l's word i.
void warp_gather(unsigned mask, const uint64_t* mine, int words, uint64_t* all);
int lane_id();
// The device's compute capability major (EDGETRAIN_CUDA_EMU_MAJOR): code nvcc builds per
// architecture (__CUDA_ARCH__) chooses by it here.
int device_major();

// A launch: runs `body` once per thread of the grid (when its stream runs it, or at replay when it records).
void launch_kernel(const char* name, dim3 grid, dim3 block, size_t shared_bytes, CUstream_st* stream,
                   std::function<void()> body);

// A kernel's pointer arguments must point into device (or page-locked host) memory, or be null.
void check_kernel_pointer(const char* kernel, int index, const void* p);
template <class T>
void check_argument(const char* kernel, int index, const T& v) {
  (void)kernel, (void)index, (void)v;
  if constexpr (std::is_pointer<T>::value) check_kernel_pointer(kernel, index, static_cast<const void*>(v));
}
template <class Tuple, size_t... I>
void check_arguments(const char* kernel, const Tuple& args, std::index_sequence<I...>) {
  (check_argument(kernel, int(I), std::get<I>(args)), ...);
}

template <class F>
struct Launcher {
  const char* name;
  F kernel;
  dim3 grid, block;
  size_t shared_bytes;
  CUstream_st* stream;
  template <class... A>
  void operator()(A&&... a) const {
    // The arguments are copied at the launch, as CUDA copies a kernel's parameters.
    auto args = std::make_tuple(typename std::decay<A>::type(std::forward<A>(a))...);
    check_arguments(name, args, std::index_sequence_for<A...>());
    F k = kernel;
    launch_kernel(name, grid, block, shared_bytes, stream, [k, args]() { std::apply(k, args); });
  }
};

template <class F>
Launcher<F> launch(const char* name, F kernel, dim3 grid, dim3 block, size_t shared_bytes = 0,
                   CUstream_st* stream = nullptr) {
  return Launcher<F>{name, kernel, grid, block, shared_bytes, stream};
}

template <class T>
T shfl_as(uint64_t bits) {
  static_assert(sizeof(T) <= 8, "a shuffled value is at most 8 bytes");
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}
template <class T>
uint64_t shfl_bits(T v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())
constexpr int warpSize = 32;

inline void __syncthreads() { emu::syncthreads(); }
inline unsigned __ballot_sync(unsigned mask, int pred) { return emu::warp_ballot(mask, pred != 0); }
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = emu::lane_id(), base = lane / width * width;
  const int src = lane + int(delta) < base + width ? lane + int(delta) : lane;
  return emu::shfl_as<T>(emu::warp_exchange(mask, emu::shfl_bits(v), src));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = emu::lane_id(), base = lane / width * width;
  const int src = lane - int(delta) >= base ? lane - int(delta) : lane;
  return emu::shfl_as<T>(emu::warp_exchange(mask, emu::shfl_bits(v), src));
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  const int lane = emu::lane_id(), base = lane / width * width;
  return emu::shfl_as<T>(emu::warp_exchange(mask, emu::shfl_bits(v), base + src_lane % width));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = emu::lane_id(), base = lane / width * width, src = lane ^ lane_mask;
  return emu::shfl_as<T>(emu::warp_exchange(mask, emu::shfl_bits(v), src >= base && src < base + width ? src : lane));
}

// Device functions with the rounding they name: each operation rounded once, never contracted
// into an FMA with its neighbours, as nvcc keeps them. The emulator's translation units are built
// without contraction; -DEDGETRAIN_CUDA_EMU_CONTRACT=ON builds them with it, as nvcc's default
// (--fmad=true) may contract a kernel's plain a * b + c, and the barrier below keeps these apart.
template <class T>
inline T emu_rounded(T v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));  // the value in a register as it is: no FMA can take the operation in
#endif
  return v;
}
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return emu_rounded(a * b); }
inline float __fadd_rn(float a, float b) { return emu_rounded(a + b); }
inline float __fsub_rn(float a, float b) { return emu_rounded(a - b); }
inline float __fdiv_rn(float a, float b) { return emu_rounded(a / b); }
inline double __dmul_rn(double a, double b) { return emu_rounded(a * b); }
inline double __dadd_rn(double a, double b) { return emu_rounded(a + b); }
inline double __dsub_rn(double a, double b) { return emu_rounded(a - b); }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int __float_as_int(float f) { return int(__float_as_uint(f)); }
inline float __int_as_float(int i) { return __uint_as_float(unsigned(i)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __dp4a(int a, int b, int c) {
  for (int j = 0; j < 4; ++j) c += int(int8_t(a >> (8 * j))) * int(int8_t(b >> (8 * j)));
  return c;
}

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (int8 tensor cores, sm_80 and later), a warp
// collective of all 32 lanes: c += A (16 x 32) x B (32 x 8), each matrix spread over the lanes as
// the PTX ISA's "Matrix Fragments for mma.m16n8k32" lays out 8-bit operands (lane = 4 g + t):
//   A: a0 = row g, k 4t..4t+3 (byte j: k 4t + j); a1 = row g + 8, k 4t..; a2 = row g, k 16 + 4t..;
//      a3 = row g + 8, k 16 + 4t..
//   B: b0 = column g, k 4t..4t+3; b1 = column g, k 16 + 4t..
//   C: c0, c1 = row g, columns 2t, 2t + 1; c2, c3 = row g + 8, the same columns.
// A model of the instruction, written from the ISA rather than from the kernel that calls it, so
// the kernel's fragment loads are tested against the layout without a GPU. Sums wrap as int32.
namespace emu {
inline void mma_m16n8k32_s8(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
  auto pair = [](int lo, int hi) { return uint64_t(uint32_t(lo)) | uint64_t(uint32_t(hi)) << 32; };
  const uint64_t mine[3] = {pair(a0, a1), pair(a2, a3), pair(b0, b1)};
  uint64_t all[32 * 3];
  warp_gather(0xFFFFFFFFu, mine, 3, all);
  int8_t A[16][32], B[32][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    const uint32_t a[4] = {uint32_t(all[3 * l]), uint32_t(all[3 * l] >> 32), uint32_t(all[3 * l + 1]),
                           uint32_t(all[3 * l + 1] >> 32)};
    const uint32_t b[2] = {uint32_t(all[3 * l + 2]), uint32_t(all[3 * l + 2] >> 32)};
    for (int j = 0; j < 4; ++j) {
      A[g][4 * t + j] = int8_t(a[0] >> (8 * j));
      A[g + 8][4 * t + j] = int8_t(a[1] >> (8 * j));
      A[g][16 + 4 * t + j] = int8_t(a[2] >> (8 * j));
      A[g + 8][16 + 4 * t + j] = int8_t(a[3] >> (8 * j));
      B[4 * t + j][g] = int8_t(b[0] >> (8 * j));
      B[16 + 4 * t + j][g] = int8_t(b[1] >> (8 * j));
    }
  }
  const int g = lane_id() / 4, t = lane_id() % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    uint32_t sum = uint32_t(c[e]);
    for (int k = 0; k < 32; ++k) sum += uint32_t(int(A[row][k]) * int(B[k][col]));
    c[e] = int(sum);
  }
}
}  // namespace emu

// Atomics: one host thread runs every fiber and none is switched out inside an operation. With
// the race checker (EDGETRAIN_CUDA_EMU_RACES, emu_races.cpp) each tells it of its access, which
// races with plain accesses only, and its own load and store are left out of the instrumentation.
namespace emu {
void race_atomic(const void* p, unsigned bytes);
}
#if defined(EDGETRAIN_CUDA_EMU_RACES)
#define ET_EMU_ATOMIC __attribute__((noinline, no_sanitize_thread))
#else
#define ET_EMU_ATOMIC inline
#endif
template <class T>
ET_EMU_ATOMIC T atomicAdd(T* p, T v) {
  emu::race_atomic(p, sizeof(T));
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
ET_EMU_ATOMIC T atomicMax(T* p, T v) {
  emu::race_atomic(p, sizeof(T));
  const T old = *p;
  if (v > old) *p = v;
  return old;
}
template <class T>
ET_EMU_ATOMIC T atomicMin(T* p, T v) {
  emu::race_atomic(p, sizeof(T));
  const T old = *p;
  if (v < old) *p = v;
  return old;
}
template <class T>
ET_EMU_ATOMIC T atomicOr(T* p, T v) {
  emu::race_atomic(p, sizeof(T));
  const T old = *p;
  *p = old | v;
  return old;
}
#undef ET_EMU_ATOMIC

// CUDA's math functions in the global namespace.
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

// CUDA's integer and float min / max of the same type.
#define ET_EMU_MINMAX(T)                    \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
ET_EMU_MINMAX(int)
ET_EMU_MINMAX(unsigned)
ET_EMU_MINMAX(long)
ET_EMU_MINMAX(unsigned long)
ET_EMU_MINMAX(long long)
ET_EMU_MINMAX(unsigned long long)
#undef ET_EMU_MINMAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
