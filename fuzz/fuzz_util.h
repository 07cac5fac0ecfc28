// Helpers shared by the libFuzzer targets (fuzz/fuzz_*.cpp, scripts/fuzz.sh).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace et::fuzz {

// EDGETRAIN_FUZZ_SEEDS=DIR: a target that generates its seed corpus writes it to DIR from
// LLVMFuzzerInitialize and exits (how fuzz/corpus/<target>/ was made); empty otherwise.
inline std::string seed_dir() {
  const char* d = std::getenv("EDGETRAIN_FUZZ_SEEDS");
  return d ? d : "";
}

inline void write_file(const std::string& path, const void* data, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data, 1, n, f) != n) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
  std::fclose(f);
}

inline void write_file(const std::string& path, const std::string& s) { write_file(path, s.data(), s.size()); }

}  // namespace et::fuzz
