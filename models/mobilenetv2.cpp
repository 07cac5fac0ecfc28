// MobileNetV2 for CIFAR (Sandler et al. 2018, with the usual CIFAR changes: 3x3 stride-1 stem and
// stride 1 in the second stage, so 32x32 inputs end at 4x4). Inverted residual: 1x1 expand + BN +
// ReLU, 3x3 depthwise + BN + ReLU, 1x1 project + BN; residual add when stride is 1 (with a 1x1
// conv + BN shortcut when the channel count changes). ReLU stands in for ReLU6.
#include "layers/layers.h"
#include "models/models.h"

namespace et {
namespace {

int conv_bn(Graph& g, int x, const std::string& p, const std::string& conv, const std::string& bn, int64_t out,
            int64_t k, int64_t stride, int64_t groups) {
  Conv2dOptions o;
  o.out_channels = out;
  o.kernel = k;
  o.stride = stride;
  o.padding = k / 2;
  o.groups = groups;
  return batchnorm2d(g, conv2d(g, x, p + conv, o), p + bn);
}

int inverted_residual(Graph& g, int x, const std::string& p, int64_t expansion, int64_t out, int64_t stride) {
  const int64_t in = g.value(x).shape[1], hidden = in * expansion;
  int y = relu(g, conv_bn(g, x, p, ".conv1", ".bn1", hidden, 1, 1, 1), p + ".relu1");
  y = relu(g, conv_bn(g, y, p, ".conv2", ".bn2", hidden, 3, stride, hidden), p + ".relu2");
  y = conv_bn(g, y, p, ".conv3", ".bn3", out, 1, 1, 1);
  if (stride != 1) return y;
  int shortcut = x;
  if (in != out) shortcut = conv_bn(g, x, p, ".shortcut.0", ".shortcut.1", out, 1, 1, 1);
  return add(g, y, shortcut, p + ".add");
}

}  // namespace

int build_mobilenetv2(Graph& g, int x, int64_t num_classes, float dropout_p) {
  struct Stage { int64_t expansion, out, blocks, stride; };
  const Stage stages[] = {{1, 16, 1, 1}, {6, 24, 2, 1}, {6, 32, 3, 2}, {6, 64, 4, 2},
                          {6, 96, 3, 1}, {6, 160, 3, 2}, {6, 320, 1, 1}};
  int y = relu(g, conv_bn(g, x, "", "conv1", "bn1", 32, 3, 1, 1), "relu1");
  int index = 0;
  for (const Stage& s : stages)
    for (int64_t b = 0; b < s.blocks; ++b)
      y = inverted_residual(g, y, "layers." + std::to_string(index++), s.expansion, s.out, b == 0 ? s.stride : 1);
  y = relu(g, conv_bn(g, y, "", "conv2", "bn2", 1280, 1, 1, 1), "relu2");
  y = global_avgpool(g, y, "avgpool");
  if (dropout_p > 0.f) y = dropout(g, y, "dropout", dropout_p);
  return linear(g, y, "linear", num_classes);
}

}  // namespace et
