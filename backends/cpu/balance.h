// Items [0, n) shared out to the threads of an OpenMP team so that a slow thread does not hold the
// others up, while each thread keeps the items a static split gives it where it can.
//
// Why: on a virtual machine one of two vCPUs can run vector code at half the other's speed for
// minutes at a time (a busy SMT sibling: session 49 measured 0.46 against 0.80 s for the same
// AVX-512 loop on the two vCPUs of this host), and with schedule(static) the fast thread then waits
// for the slow one at every kernel's end (15 % of a ResNet-20 step's samples were the main thread
// spinning in libgomp). A plain schedule(dynamic) balances but scatters the images over the cores,
// and the next kernel, split statically, finds half its input in the other core's L2: slower than
// the imbalance it fixed.
//
// How: each thread owns the range schedule(static) would give it and takes it from the front, a
// chunk (`grain` items) at a time; a thread whose range is done takes chunks from the back of the
// others' ranges. The fast thread thus takes the tail of the slow one's range, kernel after
// kernel, and the affinity of everything else is kept. A range is one 64-bit word (front, back)
// changed by compare-and-swap, so the owner and a thief never take the same chunk.
//
// Use only for work whose results do not depend on the thread that runs an item (each item writes
// its own outputs, or adds into per-item slots reduced in a fixed order afterwards).
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>

#include "engine/check.h"

namespace et::cpu {

class StealingRanges {
 public:
  static constexpr int kMaxOwners = 256;

  // Before the parallel region; `threads` is the team size asked for (omp_get_max_threads()). A team
  // that comes out smaller still runs every item: the ranges of the threads that never start are taken
  // by the others (as are all of them with more than kMaxOwners threads, where the threads beyond own
  // none).
  StealingRanges(int64_t n, int64_t grain, int threads)
      : grain_(grain < 1 ? 1 : grain), owners_(threads < 1 ? 1 : threads > kMaxOwners ? kMaxOwners : threads) {
    ET_CHECK(n >= 0 && n < (int64_t(1) << 31), "StealingRanges: item count ", n);
    for (int t = 0; t < owners_; ++t) {
      const int64_t lo = n * t / owners_, hi = n * (t + 1) / owners_;
      ranges_[t].store(pack(uint32_t(lo), uint32_t(hi)), std::memory_order_relaxed);
    }
  }

  // In the parallel region, by every thread of the team: f(i0, i1) on chunks of items until none is
  // left. No barrier at the end.
  template <class F>
  void run(F&& f) {
    const int t = omp_get_thread_num();
    int64_t i0, i1;
    if (t < owners_)
      while (take_front(ranges_[t], &i0, &i1)) f(i0, i1);
    for (int k = 1; k <= owners_; ++k) {
      std::atomic<uint64_t>& r = ranges_[(t + k) % owners_];
      while (take_back(r, &i0, &i1)) f(i0, i1);
    }
  }

 private:
  // A range: its front in the low 32 bits, its back (one past its last item) in the high. (Not padded
  // to a line each: a chunk is microseconds of work, so the owners' updates seldom meet.)
  static uint64_t pack(uint32_t front, uint32_t back) { return uint64_t(back) << 32 | front; }

  bool take_front(std::atomic<uint64_t>& r, int64_t* i0, int64_t* i1) const {
    uint64_t w = r.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = uint32_t(w), back = uint32_t(w >> 32);
      if (front >= back) return false;
      const uint32_t to = int64_t(back - front) > grain_ ? front + uint32_t(grain_) : back;
      if (r.compare_exchange_weak(w, pack(to, back), std::memory_order_relaxed)) {
        *i0 = front, *i1 = to;
        return true;
      }
    }
  }
  bool take_back(std::atomic<uint64_t>& r, int64_t* i0, int64_t* i1) const {
    uint64_t w = r.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = uint32_t(w), back = uint32_t(w >> 32);
      if (front >= back) return false;
      const uint32_t from = int64_t(back - front) > grain_ ? back - uint32_t(grain_) : front;
      if (r.compare_exchange_weak(w, pack(front, from), std::memory_order_relaxed)) {
        *i0 = from, *i1 = back;
        return true;
      }
    }
  }

  std::atomic<uint64_t> ranges_[kMaxOwners];
  int64_t grain_;
  int owners_;
};

// A parallel loop over [0, n) in chunks of `grain`, balanced as above: f(i0, i1), f callable from
// any thread. The items' results must not depend on which thread runs them.
template <class F>
void balanced_for(int64_t n, int64_t grain, F&& f) {
  StealingRanges ranges(n, grain, omp_get_max_threads());
#pragma omp parallel
  ranges.run(f);
}

// The slots a weight gradient splits the batch into (wgrad_cl): each a fixed run of images whose
// partial sums are its own and are added in slot order at the end, so the threads can take the slots
// in any order (StealingRanges) and the gradient keeps its bits from run to run. Four a thread where
// their partials together fit in kWgradSlotBytes, else fewer, down to one a thread (a static split);
// never more than N. Each slot's partials are zeroed, filled and read back, so slots cost memory
// traffic where partials are large: tried on the Winograd weight gradient, whose ResNet-20 64 -> 64
// partials are 256 KiB, four slots a thread took it from 1.14 to 1.31 ms, more than the balance won
// back (session 49); that kernel keeps its per-thread split.
constexpr size_t kWgradSlotBytes = size_t(256) << 10;
inline int64_t wgrad_slots(int64_t N, int threads, size_t part_bytes) {
  const int64_t fit = int64_t(kWgradSlotBytes / (part_bytes > 0 ? part_bytes : 1));
  int64_t slots = fit < 4 * int64_t(threads) ? fit : 4 * int64_t(threads);
  if (slots < threads) slots = threads;
  if (slots > N) slots = N;
  return slots < 1 ? 1 : slots;
}

}  // namespace et::cpu
