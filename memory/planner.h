// Lifetime-based memory planner: buffers with [first, last] use times are placed at offsets so that
// buffers alive at the same time never overlap. Greedy placement (first fit and best fit) in several
// orders (largest first, largest bytes x lifetime first, busiest time step first, then perturbed
// largest-first orders while the plan is above the bytes alive at once), the smallest plan kept.
// Deterministic: the same requests give the same offsets on every run and machine.
#pragma once
#include <cstddef>
#include <vector>

namespace et {

struct BufferRequest {
  size_t bytes = 0;
  int first = 0;  // first time step that uses it
  int last = 0;   // last time step that uses it (inclusive)
};

struct MemoryPlan {
  std::vector<size_t> offsets;  // one per request
  size_t total_bytes = 0;       // the arena size the plan needs
  size_t sum_bytes = 0;         // what the requests would need without reuse
};

MemoryPlan plan_memory(const std::vector<BufferRequest>& requests);

// Bytes alive at each time step (aligned as the plan places them); no plan is smaller than the most.
std::vector<size_t> live_bytes(const std::vector<BufferRequest>& requests);

}  // namespace et
