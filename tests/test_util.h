// Small helpers shared by the Catch2 tests.
#pragma once
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>

#include "engine/check.h"

namespace et::test {

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
