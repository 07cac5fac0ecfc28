// Workspace carving for CPU kernels, which never allocate: a bump allocator that hands out
// 64-byte aligned pieces of the caller's workspace, and the size arithmetic that goes with it
// (a CarveSize adding the same pieces in the same order gives the bytes the kernel needs).
#pragma once
#include <cstddef>
#include <cstdint>

namespace et::cpu {

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

template <class T>
T* align64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

struct Carve {
  uint8_t* p;
  explicit Carve(void* base) : p(static_cast<uint8_t*>(base)) {}
  template <class T>
  T* take(int64_t n) {
    uint8_t* r = align64(p);
    p = r + size_t(n) * sizeof(T);
    return reinterpret_cast<T*>(r);
  }
};

struct CarveSize {
  size_t bytes = 0;
  template <class T>
  CarveSize& add(int64_t n) {
    bytes += size_t(n) * sizeof(T) + 64;
    return *this;
  }
};

}  // namespace et::cpu
