// Small helpers shared by the Catch2 tests.
#pragma once
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>

#include "engine/check.h"

// A test that cannot run here (no data set at its path, a feature this build lacks) says why and
// returns: ctest reports it as skipped, not passed (SKIP_REGULAR_EXPRESSION in tests/CMakeLists.txt),
// so a run without the data (a worktree elsewhere, a cross build under qemu) cannot look complete.
#define ET_SKIP(why)            \
  do {                          \
    WARN("SKIPPED: " << why);   \
    return;                     \
  } while (0)

namespace et::test {

// AddressSanitizer's shadow pages and freed-memory quarantine move the USS by tens of MB, so tests
// whose assertions are margins of measured memory keep those margins to native builds.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

// A fresh folder under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    const auto tick = std::chrono::steady_clock::now().time_since_epoch().count();
    path = std::filesystem::temp_directory_path() / ("edgetrain_test_" + std::to_string(::getpid()) + "_" +
                                                     std::to_string(tick) + "_" + std::to_string(++counter));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// The message of the UserError `f` throws, or "" if it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace et::test
