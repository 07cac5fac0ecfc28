// The checkpoint loader (engine/train/checkpoint.cpp, load_checkpoint_bytes) against a tiny model
// (conv 1x1 + BN + ReLU + pool + linear: a checkpoint of 900 bytes). Input: a mode byte, then the
// file; mode bit 0 set: the target appends the right CRC-32 to the bytes, so that mutations get
// past the checksum to the header and tensor table checks.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "backends/backend.h"
#include "engine/check.h"
#include "engine/executor.h"
#include "engine/init.h"
#include "engine/train/checkpoint.h"
#include "fuzz/fuzz_util.h"
#include "fuzz/tiny_model.h"
#include "layers/layers.h"

namespace {

using Tiny = et::fuzz::TinyModel;

Tiny* g_model;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_model = new Tiny;
  const std::string seeds = et::fuzz::seed_dir();
  if (!seeds.empty()) {
    const std::string path = seeds + "/tiny.ckpt.tmp-seed";
    et::save_checkpoint(path, *g_model->ex, {"tiny", 3, 40, 7, 0.25, 0.5, 1});
    std::FILE* f = std::fopen(path.c_str(), "rb");
    std::string bytes;
    for (int c; (c = std::fgetc(f)) != EOF;) bytes += char(c);
    std::fclose(f);
    std::remove(path.c_str());
    et::fuzz::write_file(seeds + "/valid", std::string(1, '\0') + bytes);
    et::fuzz::write_file(seeds + "/valid_crc_fixed", std::string(1, '\1') + bytes.substr(0, bytes.size() - 4));
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::vector<char> file(reinterpret_cast<const char*>(data) + 1, reinterpret_cast<const char*>(data) + size);
  if (data[0] & 1) {
    const uint32_t crc = et::crc32_update(0, file.data(), file.size());
    const char* c = reinterpret_cast<const char*>(&crc);
    file.insert(file.end(), c, c + 4);
  }
  try {
    et::load_checkpoint_bytes(file.data(), file.size(), "fuzz.ckpt", *g_model->ex, "tiny");
  } catch (const et::UserError&) {
  }
  return 0;
}
