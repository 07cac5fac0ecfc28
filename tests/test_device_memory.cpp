// The device-aware core's memory (memory/device_memory.h): the arena and the stash region are one
// allocation each from the backend's DeviceMemory, page releases and residency go through it, and
// the host's implementation behaves as USS measurement needs (zeroed pages, released pages zero).
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "backends/backend.h"
#include "memory/arena.h"
#include "memory/stash.h"

using namespace et;

namespace {

// The host's memory, counting what goes through it.
struct CountingMemory final : DeviceMemory {
  int allocations = 0, deallocations = 0, releases = 0;
  size_t allocated = 0, released = 0;
  Device device() const override { return host_memory().device(); }
  size_t granularity() const override { return host_memory().granularity(); }
  void* allocate(size_t bytes) override {
    ++allocations;
    allocated += bytes;
    return host_memory().allocate(bytes);
  }
  void deallocate(void* p, size_t bytes) override {
    ++deallocations;
    host_memory().deallocate(p, bytes);
  }
  void release(void* p, size_t bytes) override {
    ++releases;
    released += bytes;
    host_memory().release(p, bytes);
  }
  size_t resident_bytes(const void* p, size_t bytes) const override { return host_memory().resident_bytes(p, bytes); }
};

}  // namespace

TEST_CASE("host memory: zeroed pages, released pages read zero and leave the resident set", "[memory]") {
  DeviceMemory& m = host_memory();
  CHECK(m.device() == Device::CPU);
  const size_t page = m.granularity(), bytes = 16 * page;
  REQUIRE(page >= 4096);
  char* p = static_cast<char*>(m.allocate(bytes));
  REQUIRE(p != nullptr);
  CHECK(m.resident_bytes(p, bytes) == 0);  // nothing touched yet
  CHECK(std::vector<char>(p, p + bytes) == std::vector<char>(bytes, 0));
  std::memset(p, 7, bytes);
  CHECK(m.resident_bytes(p, bytes) == bytes);
  // Only whole pages inside the range go: [page / 2, 5.5 pages) releases pages 1..4.
  m.release(p + page / 2, 5 * page);
  CHECK(m.resident_bytes(p, bytes) == bytes - 4 * page);
  CHECK(p[page / 2] == 7);
  CHECK(p[page] == 0);
  CHECK(p[5 * page - 1] == 0);
  CHECK(p[5 * page] == 7);
  m.deallocate(p, bytes);
}

TEST_CASE("the arena and the stash region come from the given memory, one allocation each", "[memory]") {
  CountingMemory mem;
  {
    Arena a;
    a.reserve(3 * mem.granularity() + 1, "a test arena", mem);
    CHECK(mem.allocations == 1);
    CHECK(a.size() == 4 * mem.granularity());  // rounded up to the granularity
    CHECK(a.device() == Device::CPU);
    std::memset(a.at(0), 1, a.size());
    CHECK(a.resident_bytes() == a.size());
    a.release(mem.granularity(), 2 * mem.granularity());
    CHECK(mem.releases == 1);
    CHECK(a.resident_bytes() == 2 * mem.granularity());
  }
  CHECK(mem.deallocations == 1);

  CountingMemory region;
  {
    Stash s;
    std::vector<SavedValue> saved(2);
    saved[0].value = 0, saved[0].numel = 5000, saved[0].full = true, saved[0].format = StashFormat::BitmapF32;
    saved[1].value = 1, saved[1].numel = 3000, saved[1].full = true, saved[1].format = StashFormat::DenseF16;
    s.configure(saved, 2, 0.f, false, region);
    CHECK(region.allocations == 1);
    CHECK(region.allocated >= 5000 * 4 + 3000 * 2);
  }
  CHECK(region.deallocations == 1);
}

TEST_CASE("the CPU backend's memory is the host's", "[memory]") {
  const std::unique_ptr<Backend> be = make_cpu_backend();
  CHECK(&be->memory() == &host_memory());
}
