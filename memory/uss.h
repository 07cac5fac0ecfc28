// Unique set size (USS) of this process: Private_Clean + Private_Dirty (+ Private_Hugetlb) summed
// from /proc/self/smaps_rollup, or from /proc/self/smaps on kernels without it (Linux < 4.14, e.g.
// Jetson Nano's L4T). Where neither can be read (no /proc) there is no figure: std::nullopt, which
// callers print as "unavailable" and write as JSON null, never as 0 MB.
//
// Peak over a step (UssPeak::begin_step .. end_step). The kernel keeps the RSS high-water mark
// (VmHWM in /proc/self/status), raised whenever RSS is about to fall (munmap, madvise); writing "5"
// to /proc/self/clear_refs (Linux >= 4.0) resets it to the current RSS without walking any page.
// At the end of the step one USS sample and VmRSS, read together, give
//     peak USS = USS_end + (VmHWM - VmRSS_end):
// what RSS came down from its peak was private (the pages a step maps and frees are anonymous;
// libraries and file pages, the shared part, do not move within a step). This sees memory that is
// touched and released between any two samples. Where clear_refs cannot be written, the peak is
// the maximum of samples at the phase boundaries (UssPeak::phase: after the forward, after the
// backward) and at the end of the step; method() says which one a figure comes from.
// The high-water mark is one per process: two UssPeak must not measure overlapping steps.
// Reads go into fixed buffers (no allocation), so a measured training step stays allocation-free.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>

namespace et {

// The proc files read (tests point them at missing files).
struct ProcFiles {
  const char* smaps_rollup = "/proc/self/smaps_rollup";
  const char* smaps = "/proc/self/smaps";
  const char* status = "/proc/self/status";
  const char* clear_refs = "/proc/self/clear_refs";
};

std::optional<size_t> read_uss_bytes(const ProcFiles& files = ProcFiles{});

enum class UssMethod : uint8_t {
  None,       // no figure: USS could not be read
  HighWater,  // every step's peak from the kernel's high-water mark
  Samples,    // some step's peak from samples only (clear_refs not writable)
};
// "high-water mark (VmHWM)", "samples after forward / backward / update", "unavailable".
const char* uss_method_name(UssMethod m);

// The largest USS over the steps (and explicit samples) since reset().
class UssPeak {
 public:
  explicit UssPeak(const ProcFiles& files = ProcFiles{}) : files_(files) {}
  void begin_step();  // resets the kernel's high-water mark where it can
  void phase();       // a phase boundary inside the step: samples only where the mark is unavailable
  void end_step();    // one USS sample, raised by what the high-water mark saw since begin_step()
  void sample();      // an explicit sample outside any step
  void reset();
  std::optional<size_t> peak() const { return peak_; }
  std::optional<size_t> last_step() const { return last_step_; }  // the peak of the last step alone
  UssMethod method() const;

 private:
  void record(size_t bytes, bool high_water);
  ProcFiles files_;
  std::optional<size_t> peak_, last_step_;
  size_t step_max_ = 0;         // the largest phase() sample of this step
  bool in_high_water_ = false;  // begin_step() reset the mark
  bool used_high_water_ = false, used_samples_ = false;
};

// USS in MB as a number, or a negative number for "unavailable" (progress lines, plain structs).
inline double uss_mb_or_negative(std::optional<size_t> b) { return b ? double(*b) / 1048576.0 : -1.0; }

}  // namespace et
