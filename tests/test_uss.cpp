// USS measurement (memory/uss.h): the peak over a step sees memory that is mapped, touched and
// released before the step ends (the kernel's high-water mark); without clear_refs the peak falls
// back to phase samples; without /proc there is no figure ("unavailable", JSON null), never 0.
#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/train/curves.h"
#include "engine/train/progress.h"
#include "memory/uss.h"
#include "tests/test_util.h"

using namespace et;

namespace {

// Large against what the process's USS does on its own: when another process of the same binary
// exits (ctest -j), pages the two shared become this one's alone, and USS jumps. A 42 MB jump of
// the ASan build failed a 16 MB margin once (session 35); the margins below are kBytes / 4.
constexpr size_t kBytes = size_t(256) << 20;

// Maps kBytes of fresh anonymous pages and writes every one of them (USS grows by kBytes).
void* touch_mapping() {
  void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(p != MAP_FAILED);
  madvise(p, kBytes, MADV_NOHUGEPAGE);
  std::memset(p, 1, kBytes);
  return p;
}

bool clear_refs_writable() { return access("/proc/self/clear_refs", W_OK) == 0; }

ProcFiles missing_files() {
  ProcFiles f;
  f.smaps_rollup = "/nonexistent/smaps_rollup";
  f.smaps = "/nonexistent/smaps";
  f.status = "/nonexistent/status";
  f.clear_refs = "/nonexistent/clear_refs";
  return f;
}

}  // namespace

TEST_CASE("USS peak over a step includes memory released before the step ends", "[uss]") {
  REQUIRE(read_uss_bytes());
  REQUIRE(clear_refs_writable());  // Linux >= 4.0, the process's own file
  for (const bool unmap : {true, false}) {
    INFO((unmap ? "munmap" : "madvise(MADV_DONTNEED), as memory.release_pages does"));
    UssPeak peak;
    const size_t before = *read_uss_bytes();
    peak.begin_step();
    void* p = touch_mapping();
    if (unmap) munmap(p, kBytes);
    else madvise(p, kBytes, MADV_DONTNEED);
    const size_t end_sample = *read_uss_bytes();
    peak.end_step();
    if (!unmap) munmap(p, kBytes);
    REQUIRE(peak.method() == UssMethod::HighWater);
    // A sample at the end misses the region; the step's peak holds it (less a few pages of the
    // kernel's per-CPU counters and whatever the test itself released meanwhile).
    CHECK(end_sample < before + kBytes / 4);
    CHECK(*peak.last_step() >= before + kBytes - kBytes / 32);
    CHECK(*peak.peak() == *peak.last_step());
  }
}

TEST_CASE("USS peak without clear_refs falls back to phase samples and says so", "[uss]") {
  ProcFiles f;
  f.clear_refs = "/nonexistent/clear_refs";
  UssPeak peak(f);
  const size_t before = *read_uss_bytes();
  // Released between two samples: the fallback cannot see it (the documented limitation).
  peak.begin_step();
  munmap(touch_mapping(), kBytes);
  peak.phase();
  peak.end_step();
  REQUIRE(peak.method() == UssMethod::Samples);
  CHECK(*peak.last_step() < before + kBytes / 4);
  // Alive at a phase boundary: the phase sample keeps it although the end sample is lower.
  peak.begin_step();
  void* p = touch_mapping();
  peak.phase();
  munmap(p, kBytes);
  peak.end_step();
  CHECK(*peak.last_step() >= before + kBytes - kBytes / 32);
  CHECK(std::string(uss_method_name(peak.method())) == "samples after forward / backward / update");
}

TEST_CASE("USS unavailable without /proc: no figure, never 0 MB", "[uss]") {
  const ProcFiles f = missing_files();
  CHECK_FALSE(read_uss_bytes(f).has_value());
  UssPeak peak(f);
  peak.begin_step();
  peak.phase();
  peak.end_step();
  peak.sample();
  CHECK_FALSE(peak.peak().has_value());
  CHECK_FALSE(peak.last_step().has_value());
  CHECK(peak.method() == UssMethod::None);
  CHECK(std::string(uss_method_name(peak.method())) == "unavailable");
  CHECK(uss_mb_or_negative(peak.peak()) < 0);

  // The progress line says so instead of printing a number.
  test::TempDir dir;
  const std::string log = dir.file("log.txt");
  {
    FILE* out = std::fopen(log.c_str(), "w");
    REQUIRE(out);
    Progress progress(out);
    StepStatus s;
    s.epoch = s.epochs = 1;
    s.step = s.steps = 1;
    s.uss_mb = uss_mb_or_negative(peak.peak());
    progress.step(s);
    s.uss_mb = 12.0;
    progress.step(s);
    std::fclose(out);
  }
  std::ifstream in(log);
  std::string first, second;
  std::getline(in, first);
  std::getline(in, second);
  CHECK_THAT(first, Catch::EndsWith("USS unavailable"));
  CHECK_THAT(second, Catch::EndsWith("USS 12 MB"));

  // A metrics record with peak_uss_mb null reads as a missing point (NaN), not as 0.
  {
    std::ofstream m(dir.file("metrics.jsonl"));
    m << R"({"epoch": 1, "train_loss": 2.0, "test_loss": 2.1, "train_acc": 0.2, "test_acc": 0.2, "lr": 0.1, "peak_uss_mb": null})"
      << "\n";
  }
  const RunCurves c = read_run_curves(dir.file("metrics.jsonl"), "run");
  REQUIRE(c.peak_uss_mb.size() == 1);
  CHECK(std::isnan(c.peak_uss_mb[0]));
}
