// An environment variable set for a scope, its earlier value (or its absence) restored at the end:
// a case that picks a backend path (EDGETRAIN_CUDA_CONV, ...) leaves the next case in the same
// process on the path the harness chose (scripts/cuda_emu.sh sets EDGETRAIN_CUDA_CONV=im2col).
#pragma once
#include <cstdlib>
#include <optional>
#include <string>

namespace et::test {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_.c_str(), old_->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  void set(const char* value) { ::setenv(name_.c_str(), value, 1); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace et::test
