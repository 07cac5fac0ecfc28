#include "memory/planner.h"

#include <algorithm>
#include <numeric>

#include "memory/arena.h"

namespace et {

namespace {
// First fit in the given order: each buffer at the lowest offset free during its lifetime.
MemoryPlan first_fit(const std::vector<BufferRequest>& requests, const std::vector<size_t>& order) {
  MemoryPlan plan;
  plan.offsets.assign(requests.size(), 0);
  struct Placed { size_t offset, end; int first, last; };
  std::vector<Placed> placed;
  for (size_t idx : order) {
    const BufferRequest& r = requests[idx];
    const size_t bytes = Arena::align_up(r.bytes);
    plan.sum_bytes += bytes;
    if (bytes == 0) continue;
    // Intervals of memory taken by buffers whose lifetime overlaps this one, sorted by offset.
    std::vector<std::pair<size_t, size_t>> busy;
    for (const Placed& p : placed)
      if (p.first <= r.last && r.first <= p.last) busy.emplace_back(p.offset, p.end);
    std::sort(busy.begin(), busy.end());
    size_t offset = 0;
    for (const auto& [b, e] : busy) {
      if (offset + bytes <= b) break;
      offset = std::max(offset, e);
    }
    plan.offsets[idx] = offset;
    placed.push_back({offset, offset + bytes, r.first, r.last});
    plan.total_bytes = std::max(plan.total_bytes, offset + bytes);
  }
  return plan;
}
}  // namespace

// First fit is a heuristic, and no one order wins on every time line: the largest first, and the
// largest area (bytes x lifetime) first, are both tried and the smaller plan kept. (With largest
// first only, removing a buffer could grow a small plan by a few KB.)
MemoryPlan plan_memory(const std::vector<BufferRequest>& requests) {
  std::vector<size_t> by_size(requests.size());
  std::iota(by_size.begin(), by_size.end(), 0);
  std::vector<size_t> by_area = by_size;
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](size_t a, size_t b) { return requests[a].bytes > requests[b].bytes; });
  auto area = [&](size_t i) { return double(requests[i].bytes) * double(requests[i].last - requests[i].first + 1); };
  std::stable_sort(by_area.begin(), by_area.end(), [&](size_t a, size_t b) { return area(a) > area(b); });
  MemoryPlan a = first_fit(requests, by_size), b = first_fit(requests, by_area);
  return b.total_bytes < a.total_bytes ? b : a;
}

}  // namespace et
