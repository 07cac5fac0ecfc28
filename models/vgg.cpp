// CIFAR VGG (Simonyan & Zisserman configurations A/B/D/E): 3x3 convs (+ BN) + ReLU, 2x2 max-pools,
// then flatten [N,512] -> (dropout) -> linear. Without BN the convs have a bias.
#include <vector>

#include "layers/layers.h"
#include "models/models.h"

namespace et {

int build_vgg(Graph& g, int x, int depth, bool batchnorm, int64_t num_classes, float dropout_p) {
  std::vector<int> cfg;  // channel counts, 0 = max-pool
  switch (depth) {
    case 11: cfg = {64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0}; break;
    case 13: cfg = {64, 64, 0, 128, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0}; break;
    case 16: cfg = {64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0}; break;
    case 19: cfg = {64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0, 512, 512, 512, 512, 0}; break;
    default: ET_CHECK(false, "VGG depth ", depth);
  }
  int y = x;
  int index = 0;  // module index inside "features", as in torchvision
  for (int c : cfg) {
    const std::string p = "features." + std::to_string(index);
    if (c == 0) {
      y = maxpool2d(g, y, p, 2, 2);
      index += 1;
      continue;
    }
    Conv2dOptions o;
    o.out_channels = c;
    o.kernel = 3;
    o.padding = 1;
    o.bias = !batchnorm;
    y = conv2d(g, y, p, o);
    if (batchnorm) y = batchnorm2d(g, y, "features." + std::to_string(++index));
    y = relu(g, y, "features." + std::to_string(++index));
    index += 1;
  }
  // A 32x32 input leaves [N,512,1,1]; other sizes are averaged down to 1x1 first.
  const Shape s = g.value(y).shape;
  y = (s[2] == 1 && s[3] == 1) ? flatten(g, y, "flatten") : global_avgpool(g, y, "avgpool");
  if (dropout_p > 0.f) y = dropout(g, y, "dropout", dropout_p);
  return linear(g, y, "classifier", num_classes);
}

}  // namespace et
