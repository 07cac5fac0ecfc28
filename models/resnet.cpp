// CIFAR ResNets (He et al. 2016, Sec. 4.2): 3x3 conv 16, three stages of n basic blocks with
// 16/32/64 channels (depth = 6n + 2), global average pooling, linear. Where a block changes shape
// the shortcut is a 1x1 conv + BN ("option B", named shortcut.0 / shortcut.1) or, with
// model.shortcut = A, the paper's parameter-free one: stride-2 subsampling and zero channels
// (as published CIFAR ResNet checkpoints have it); elsewhere it is the identity.
// resnet18: the CIFAR variant of ResNet-18 (3x3 stem, no max-pool, [2,2,2,2] blocks, 64..512).
#include "layers/layers.h"
#include "models/models.h"

namespace et {
namespace {

int conv_bn(Graph& g, int x, const std::string& conv, const std::string& bn, int64_t out, int64_t k, int64_t stride) {
  Conv2dOptions o;
  o.out_channels = out;
  o.kernel = k;
  o.stride = stride;
  o.padding = k / 2;
  return batchnorm2d(g, conv2d(g, x, conv, o), bn);
}

// BasicBlock: relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))
int basic_block(Graph& g, int x, const std::string& p, int64_t out, int64_t stride, char option) {
  const int64_t in = g.value(x).shape[1];
  int y = relu(g, conv_bn(g, x, p + ".conv1", p + ".bn1", out, 3, stride), p + ".relu1");
  y = conv_bn(g, y, p + ".conv2", p + ".bn2", out, 3, 1);
  int shortcut = x;
  if (stride != 1 || in != out)
    shortcut = option == 'A' ? subsample_pad(g, x, p + ".shortcut", out, stride)
                             : conv_bn(g, x, p + ".shortcut.0", p + ".shortcut.1", out, 1, stride);
  return relu(g, add(g, y, shortcut, p + ".add"), p + ".relu2");
}

int head(Graph& g, int x, int64_t num_classes) {
  const int pooled = global_avgpool(g, x, "avgpool");
  return linear(g, pooled, "linear", num_classes);
}

}  // namespace

int build_cifar_resnet(Graph& g, int x, int depth, int64_t num_classes, char shortcut) {
  ET_CHECK((depth - 2) % 6 == 0, "CIFAR ResNet depth must be 6n+2");
  const int n = (depth - 2) / 6;
  int y = relu(g, conv_bn(g, x, "conv1", "bn1", 16, 3, 1), "relu");
  const int64_t widths[3] = {16, 32, 64};
  for (int stage = 0; stage < 3; ++stage)
    for (int b = 0; b < n; ++b)
      y = basic_block(g, y, "layer" + std::to_string(stage + 1) + "." + std::to_string(b), widths[stage],
                      (stage > 0 && b == 0) ? 2 : 1, shortcut);
  return head(g, y, num_classes);
}

int build_resnet18(Graph& g, int x, int64_t num_classes, char shortcut) {
  int y = relu(g, conv_bn(g, x, "conv1", "bn1", 64, 3, 1), "relu");
  const int64_t widths[4] = {64, 128, 256, 512};
  for (int stage = 0; stage < 4; ++stage)
    for (int b = 0; b < 2; ++b)
      y = basic_block(g, y, "layer" + std::to_string(stage + 1) + "." + std::to_string(b), widths[stage],
                      (stage > 0 && b == 0) ? 2 : 1, shortcut);
  return head(g, y, num_classes);
}

}  // namespace et
