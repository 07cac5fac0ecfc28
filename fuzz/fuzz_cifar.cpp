// The CIFAR-10 binary loader (the test split's test_batch.bin, and batches.meta.txt). Input: a
// flags byte (bit 0: the bytes up to the first NUL are batches.meta.txt; bit 1: the files sit in
// cifar-10-batches-bin/), then the batch file.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "engine/check.h"
#include "engine/data/dataset.h"
#include "fuzz/fuzz_util.h"

namespace fs = std::filesystem;

static std::string g_root;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char tmpl[] = "/tmp/edgetrain-fuzz-cifar-XXXXXX";
  if (!::mkdtemp(tmpl)) std::abort();
  g_root = tmpl;
  std::atexit([] { std::error_code ec; fs::remove_all(g_root, ec); });
  const std::string seeds = et::fuzz::seed_dir();
  if (!seeds.empty()) {
    // Two records (labels 3 and 9), the same with a meta file, and one record nested.
    std::string rec;
    for (int r = 0; r < 2; ++r) {
      rec += char(r ? 9 : 3);
      for (int i = 0; i < 3072; ++i) rec += char((i * 7 + r * 31) & 0xFF);
    }
    std::string meta = "airplane\nautomobile\nbird\ncat\ndeer\ndog\nfrog\nhorse\nship\ntruck\n\n";
    et::fuzz::write_file(seeds + "/two_records", std::string(1, '\0') + rec);
    et::fuzz::write_file(seeds + "/with_meta", std::string(1, '\1') + meta + std::string(1, '\0') + rec);
    et::fuzz::write_file(seeds + "/nested_one_record", std::string(1, '\2') + rec.substr(0, 3073));
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int flags = data[0];
  std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::error_code ec;
  fs::remove_all(g_root + "/cifar-10-batches-bin", ec);
  fs::remove(g_root + "/test_batch.bin", ec);
  fs::remove(g_root + "/batches.meta.txt", ec);
  const std::string dir = (flags & 2) ? g_root + "/cifar-10-batches-bin" : g_root;
  fs::create_directories(dir);
  if (flags & 1) {
    const size_t z = rest.find('\0');
    et::fuzz::write_file(dir + "/batches.meta.txt", rest.substr(0, z));
    rest = z == std::string::npos ? std::string() : rest.substr(z + 1);
  }
  et::fuzz::write_file(dir + "/test_batch.bin", rest);
  try {
    const et::Dataset d = et::load_cifar10_binary(g_root, et::Split::Test);
    if (d.size < 1 || d.pixels.size() != size_t(d.size) * 3072 || d.labels.size() != size_t(d.size) ||
        d.classes.size() != 10)
      std::abort();
    for (int32_t l : d.labels)
      if (l < 0 || l >= 10) std::abort();
  } catch (const et::UserError&) {
  }
  return 0;
}
