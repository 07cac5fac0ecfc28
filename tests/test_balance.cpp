// The CPU kernels' balanced loops (backends/cpu/balance.h): every item runs exactly once whatever
// the team, a thread that is done takes the rest of a slow one's range, and the weight gradients'
// slots stay within their bounds.
#include <catch2/catch.hpp>

#include <omp.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "backends/cpu/balance.h"
#include "tests/test_util.h"

using namespace et;

namespace {
// Runs [0, n) by chunks of `grain` over a team of `team` threads whose ranges were cut for `owners`;
// returns how many times each item ran.
std::vector<int> run_counts(int64_t n, int64_t grain, int owners, int team) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  for (auto& h : hits) h = 0;
  cpu::StealingRanges ranges(n, grain, owners);
#pragma omp parallel num_threads(team)
  ranges.run([&](int64_t i0, int64_t i1) {
    CHECK(i0 < i1);
    CHECK(i1 - i0 <= grain);
    for (int64_t i = i0; i < i1; ++i) hits[static_cast<size_t>(i)]++;
  });
  std::vector<int> out;
  for (auto& h : hits) out.push_back(h.load());
  return out;
}
}  // namespace

TEST_CASE("balanced loops run every item exactly once, for any team and chunk", "[kernels]") {
  for (const int64_t n : {0, 1, 5, 127, 128, 1000})
    for (const int64_t grain : {1, 3, 16, 2000})
      for (const int owners : {1, 2, 3, 4})
        for (const int team : {1, 2, 4}) {  // a team smaller than the owners leaves ranges to steal
          INFO("n " << n << " grain " << grain << " owners " << owners << " team " << team);
          const std::vector<int> hits = run_counts(n, grain, owners, team);
          for (int64_t i = 0; i < n; ++i) REQUIRE(hits[static_cast<size_t>(i)] == 1);
        }
}

TEST_CASE("a thread done with its own range takes the rest of a slow thread's", "[kernels]") {
  // Thread 0 takes its first item and then stalls until thread 1 is done; thread 1 starts once
  // thread 0 holds that item. So thread 1 runs its own 32 items, then the 31 left of thread 0's
  // range, from the back; a static split would leave them to thread 0. (The waits are bounded, so a
  // broken balance fails the checks instead of hanging.)
  const int64_t n = 64;
  std::vector<int> by(static_cast<size_t>(n), -1);
  cpu::StealingRanges ranges(n, 1, 2);
  std::atomic<int> first_taken{0}, one_done{0};
  auto wait_for = [](const std::atomic<int>& flag) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!flag.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  };
  int team = 0;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    team = omp_get_num_threads();  // (the single's barrier: every thread sees it below)
    const int t = omp_get_thread_num();
    if (team == 2) {
      if (t == 1) wait_for(first_taken);
      ranges.run([&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) by[static_cast<size_t>(i)] = t;
        if (t == 0 && !first_taken.load()) {
          first_taken = 1;
          wait_for(one_done);
        }
      });
      if (t == 1) one_done = 1;
    }
  }
  if (team < 2) ET_SKIP("OpenMP gave this team one thread (OMP_THREAD_LIMIT): nothing to balance");
  CHECK(by[0] == 0);  // thread 0's front
  for (int64_t i = 1; i < n; ++i) {
    INFO("item " << i);
    CHECK(by[static_cast<size_t>(i)] == 1);  // thread 1's own range, and the rest of thread 0's
  }
}

TEST_CASE("weight-gradient slots: four a thread where their partials fit, never fewer than threads",
          "[kernels]") {
  CHECK(cpu::wgrad_slots(128, 2, 9 * 1024) == 8);                      // small partials: 4 a thread
  CHECK(cpu::wgrad_slots(128, 2, cpu::kWgradSlotBytes / 5) == 5);      // as many as fit
  CHECK(cpu::wgrad_slots(128, 2, cpu::kWgradSlotBytes) == 2);          // large: one a thread (static)
  CHECK(cpu::wgrad_slots(3, 2, 1024) == 3);                            // never more than the images
  CHECK(cpu::wgrad_slots(1, 4, 1024) == 1);
}
