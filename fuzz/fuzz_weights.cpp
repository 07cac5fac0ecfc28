// model.weights (engine/train/weights.cpp, engine/io/safetensors.cpp) against a tiny model: the
// input is the weights file, a safetensors file or (magic EDGETRN1) a checkpoint. Whatever it holds,
// the loader must load it or throw UserError; a loaded file must have left finite values.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "backends/backend.h"
#include "engine/check.h"
#include "engine/executor.h"
#include "engine/init.h"
#include "engine/io/safetensors.h"
#include "engine/train/weights.h"
#include "fuzz/fuzz_util.h"
#include "fuzz/tiny_model.h"
#include "layers/layers.h"

namespace {

struct Tiny : et::fuzz::TinyModel {
  void save(const std::string& path) const {
    std::vector<et::SafetensorsOut> out;
    std::vector<int> ids = g.params();
    for (int b : g.buffers()) ids.push_back(b);
    for (int id : ids) {
      const et::Value& v = g.value(id);
      out.push_back({v.name, std::vector<int64_t>(v.shape.d, v.shape.d + v.shape.ndim), ex->value(id).f32()});
    }
    et::write_safetensors(path, out, {{"format", "pt"}});
  }
};

Tiny* g_model;
std::string g_file;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_model = new Tiny;
  const std::string seeds = et::fuzz::seed_dir();
  if (!seeds.empty()) {
    g_model->save(seeds + "/tiny.safetensors");
    std::exit(0);
  }
  char tmpl[] = "/tmp/edgetrain-fuzz-weights-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  if (fd < 0) std::abort();
  ::close(fd);
  g_file = tmpl;
  std::atexit([] { std::remove(g_file.c_str()); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  et::fuzz::write_file(g_file, data, size);
  try {
    et::load_weights(g_file, *g_model->ex);
    std::vector<int> ids = g_model->g.params();
    for (int b : g_model->g.buffers()) ids.push_back(b);
    for (int id : ids) {
      const et::Tensor t = g_model->ex->value(id);
      for (int64_t i = 0; i < t.numel(); ++i)
        if (!std::isfinite(t.f32()[i])) std::abort();  // the loader promised finite values
    }
  } catch (const et::UserError&) {
  }
  return 0;
}
