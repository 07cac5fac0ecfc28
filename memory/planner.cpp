#include "memory/planner.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>

#include "memory/arena.h"

namespace et {

namespace {

enum class Fit {
  First,  // the lowest offset free during the buffer's lifetime
  Best,   // the smallest free gap that holds it (lowest offset among equals), else the top
};

// Places the buffers one by one in the given order. The placed ones are kept sorted by offset, so
// each new buffer walks them once, skipping those whose lifetimes miss its own (no list of the
// overlapping ones to build and sort per buffer: 5x faster on MobileNet-V2's 450 buffers).
// Abandoned (total_bytes SIZE_MAX) as soon as a buffer would reach `limit`: no smaller plan then.
MemoryPlan place(const std::vector<BufferRequest>& requests, const std::vector<size_t>& order, Fit fit,
                 size_t limit = SIZE_MAX) {
  MemoryPlan plan;
  plan.offsets.assign(requests.size(), 0);
  struct Placed { size_t offset, end; int first, last; };
  std::vector<Placed> placed;  // by offset
  placed.reserve(requests.size());
  for (size_t idx : order) {
    const BufferRequest& r = requests[idx];
    const size_t bytes = Arena::align_up(r.bytes);
    plan.sum_bytes += bytes;
    if (bytes == 0) continue;
    auto overlaps = [&](const Placed& p) { return p.first <= r.last && r.first <= p.last; };
    size_t offset = 0;
    if (fit == Fit::First) {
      for (const Placed& p : placed) {
        if (!overlaps(p)) continue;
        if (offset + bytes <= p.offset) break;
        offset = std::max(offset, p.end);
      }
    } else {
      size_t top = 0, best_gap = SIZE_MAX, best = SIZE_MAX;
      for (const Placed& p : placed) {
        if (!overlaps(p)) continue;
        if (p.offset > top && p.offset - top >= bytes && p.offset - top < best_gap) best_gap = p.offset - top, best = top;
        top = std::max(top, p.end);
      }
      offset = best != SIZE_MAX ? best : top;
    }
    if (offset + bytes >= limit) {
      plan.total_bytes = SIZE_MAX;
      return plan;
    }
    plan.offsets[idx] = offset;
    const Placed now{offset, offset + bytes, r.first, r.last};
    placed.insert(std::upper_bound(placed.begin(), placed.end(), now,
                                   [](const Placed& a, const Placed& b) { return a.offset < b.offset; }),
                  now);
    plan.total_bytes = std::max(plan.total_bytes, offset + bytes);
  }
  return plan;
}

// Greedy by breadth: the time steps with the most bytes alive first, and at each the buffers alive
// there not yet ordered, largest first. The busiest step is packed before anything can fragment it.
std::vector<size_t> breadth_order(const std::vector<BufferRequest>& requests, const std::vector<size_t>& live) {
  const int horizon = int(live.size());
  std::vector<int> steps(static_cast<size_t>(horizon));
  std::iota(steps.begin(), steps.end(), 0);
  std::stable_sort(steps.begin(), steps.end(), [&](int a, int b) { return live[size_t(a)] > live[size_t(b)]; });
  std::vector<size_t> order, alive;
  std::vector<uint8_t> taken(requests.size(), 0);
  order.reserve(requests.size());
  for (int t : steps) {
    alive.clear();
    for (size_t i = 0; i < requests.size(); ++i)
      if (!taken[i] && requests[i].first <= t && t <= requests[i].last) alive.push_back(i);
    std::stable_sort(alive.begin(), alive.end(), [&](size_t a, size_t b) { return requests[a].bytes > requests[b].bytes; });
    for (size_t i : alive) taken[i] = 1, order.push_back(i);
  }
  for (size_t i = 0; i < requests.size(); ++i)
    if (!taken[i]) order.push_back(i);  // empty lifetimes
  return order;
}

// The perturbed rounds: about kPerturbedWork overlap tests in all (rounds x buffers^2 / 2 x 2 fits),
// at least kMinPerturbedRounds, at most kMaxPerturbedRounds. MobileNet-V2's 430-450 buffers get
// 1024 rounds, about 0.1 s (most rounds end early, above the best plan so far).
constexpr double kPerturbedWork = 2e8;
constexpr int kMinPerturbedRounds = 16, kMaxPerturbedRounds = 1024;

}  // namespace

std::vector<size_t> live_bytes(const std::vector<BufferRequest>& requests) {
  int horizon = 0;
  for (const BufferRequest& r : requests) horizon = std::max(horizon, r.last + 1);
  std::vector<size_t> live(static_cast<size_t>(horizon), 0);
  for (const BufferRequest& r : requests)
    for (int t = std::max(r.first, 0); t <= r.last; ++t) live[size_t(t)] += Arena::align_up(r.bytes);
  return live;
}

// Offset assignment is NP-hard and no one greedy order wins on every time line, so several are
// tried and the smallest plan kept: the largest first (the longest-lived first among equals), the
// largest area (bytes x lifetime) first, and by breadth; each with first fit and best fit. Measured
// on the shipped models' plans: by size alone left LUQ ResNet-20 with the bitmap_int4 stash at 32 MB
// where 26 MB are ever alive at once (fragmentation); by breadth reaches the 26. Where all six stay
// above that bound, perturbed largest-first orders follow (with recomputation every conv, the same
// model: 52.0 -> 50.0 MB, the bound). Up to 1024 of them (session 42; 16 before), each abandoned
// once it reaches the best plan so far: over the shipped configs with checkpoint_every 0-4 and the
// dense and auto stashes, fused and unfused (120 plans), three got smaller and none larger
// (MobileNet-V2 every second conv, dense, fused: 481.07 -> 479.32 MB of 478.63 alive at once,
// below the unfused 480.57; LUQ ResNet-20 every conv, auto, fused: 44.04 -> 42.04, the unfused 43.03),
// at up to 0.5 s for a 450-buffer plan that never reaches its bound.
MemoryPlan plan_memory(const std::vector<BufferRequest>& requests) {
  std::vector<size_t> by_size(requests.size());
  std::iota(by_size.begin(), by_size.end(), 0);
  std::vector<size_t> by_area = by_size;
  auto span = [&](size_t i) { return requests[i].last - requests[i].first; };
  std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
    if (requests[a].bytes != requests[b].bytes) return requests[a].bytes > requests[b].bytes;
    return span(a) > span(b);
  });
  auto area = [&](size_t i) { return double(requests[i].bytes) * double(span(i) + 1); };
  std::stable_sort(by_area.begin(), by_area.end(), [&](size_t a, size_t b) { return area(a) > area(b); });
  const std::vector<size_t> live = live_bytes(requests);
  std::vector<size_t> by_breadth = breadth_order(requests, live);
  MemoryPlan best;
  bool have = false;
  auto keep_smaller = [&](const std::vector<size_t>& order) {
    for (Fit fit : {Fit::First, Fit::Best}) {
      MemoryPlan p = place(requests, order, fit, have ? best.total_bytes : SIZE_MAX);
      if (!have || p.total_bytes < best.total_bytes) best = std::move(p), have = true;
    }
  };
  for (const std::vector<size_t>* order : {&by_size, &by_area, &by_breadth}) keep_smaller(*order);
  // Above the bytes alive at once, the largest-first order with each size scaled by up to 30 %
  // (a fixed sequence: the same plan on every run and machine), as many times as the work allows.
  const size_t bound = live.empty() ? 0 : *std::max_element(live.begin(), live.end());  // no plan is smaller
  std::mt19937 rng(12345);
  std::vector<uint64_t> key(requests.size());
  const double n = double(requests.size());
  const int rounds = int(std::clamp(kPerturbedWork / std::max(1.0, n * n), double(kMinPerturbedRounds),
                                    double(kMaxPerturbedRounds)));
  for (int round = 0; round < rounds && best.total_bytes > bound; ++round) {
    for (size_t i = 0; i < requests.size(); ++i) key[i] = uint64_t(requests[i].bytes) * (1024 + rng() % 308);
    std::vector<size_t> order = by_size;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key[a] > key[b]; });
    keep_smaller(order);
  }
  return best;
}

}  // namespace et
