// The tiny model the checkpoint and weights fuzz targets load into: conv 1x1 + BN + ReLU + global
// pool + linear (names conv.*, bn.*, fc.*), built and initialised once per fuzzer process.
#pragma once
#include <memory>

#include "backends/backend.h"
#include "engine/executor.h"
#include "engine/init.h"
#include "layers/layers.h"

namespace et::fuzz {

struct TinyModel {
  Graph g;
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<Executor> ex;
  TinyModel() {
    const int x = image_input(g, 1, 1, 4, 4), labels = label_input(g, 1);
    Conv2dOptions o;
    o.out_channels = 2;
    o.kernel = 1;
    const int y = relu(g, batchnorm2d(g, conv2d(g, x, "conv", o), "bn"), "relu");
    const int logits = linear(g, global_avgpool(g, y, "pool"), "fc", 2);
    softmax_cross_entropy(g, logits, labels, "loss");
    ex = std::make_unique<Executor>(g, *be);
    init_parameters(*ex, 1);
  }
};

}  // namespace et::fuzz
