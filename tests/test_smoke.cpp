#include <catch2/catch.hpp>

#include "engine/executor.h"
#include "engine/init.h"
#include "models/models.h"

using namespace et;

TEST_CASE("resnet20 builds and steps", "[model]") {
  Graph g;
  ModelSpec spec;
  spec.batch = 8;
  build_model(g, spec);
  auto be = make_cpu_backend();
  Executor ex(g, *be);
  init_parameters(ex, 1);
  Tensor x = ex.value(g.image_input);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float((i * 7919) % 255) / 255.f - 0.5f;
  for (int i = 0; i < 8; ++i) ex.value(g.label_input).i32()[i] = i % 10;
  ex.forward(8, true);
  const float l0 = ex.loss();
  CHECK(std::isfinite(l0));
  ex.backward();
}
