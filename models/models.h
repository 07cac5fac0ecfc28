// Models by name. Each builder appends the network to a graph whose image and label inputs it
// creates, ending in a softmax cross-entropy loss. Layer names follow PyTorch's module paths
// (layer1.0.conv1, ...), so parameters are named like a PyTorch state_dict.
#pragma once
#include <string>
#include <vector>

#include "engine/graph.h"

namespace et {

struct ModelSpec {
  std::string name = "resnet20";
  int64_t num_classes = 10;
  int64_t channels = 3, height = 32, width = 32;
  int64_t batch = 128;
  float label_smoothing = 0.f;
  float dropout = 0.f;  // before the classifier (VGG, MobileNetV2); 0 = none
  bool double_mask_bn = false;  // memory.double_mask_bn (layers/batchnorm.cpp)
};

// Builds the model into an empty graph; throws UserError for an unknown name (listing known ones).
void build_model(Graph& g, const ModelSpec& spec);
std::vector<std::string> model_names();

// Family builders; return the logits value id.
int build_cifar_resnet(Graph& g, int x, int depth, int64_t num_classes);  // resnet20..110: 6n+2
int build_resnet18(Graph& g, int x, int64_t num_classes);
int build_vgg(Graph& g, int x, int depth, bool batchnorm, int64_t num_classes, float dropout);
int build_mobilenetv2(Graph& g, int x, int64_t num_classes, float dropout);

}  // namespace et
