#include "memory/planner.h"

#include <algorithm>
#include <numeric>

#include "memory/arena.h"

namespace et {

MemoryPlan plan_memory(const std::vector<BufferRequest>& requests) {
  MemoryPlan plan;
  plan.offsets.assign(requests.size(), 0);
  std::vector<size_t> order(requests.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return requests[a].bytes > requests[b].bytes; });

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

}  // namespace et
