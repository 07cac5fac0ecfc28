// Models by name (build_model, model_names: engine/model_spec.h, implemented in registry.cpp).
// Each builder appends the network to a graph whose image and label inputs it creates, ending in
// a softmax cross-entropy loss. Layer names follow PyTorch's module paths
// (layer1.0.conv1, ...), so parameters are named like a PyTorch state_dict.
#pragma once
#include <string>
#include <vector>

#include "engine/graph.h"
#include "engine/model_spec.h"

namespace et {

// Family builders; return the logits value id.
int build_cifar_resnet(Graph& g, int x, int depth, int64_t num_classes, char shortcut);  // resnet8..110: 6n+2
int build_resnet18(Graph& g, int x, int64_t num_classes, char shortcut);
int build_vgg(Graph& g, int x, int depth, bool batchnorm, int64_t num_classes, float dropout);
int build_mobilenetv2(Graph& g, int x, int64_t num_classes, float dropout);

// Marks the parameters the fine-tuning policy keeps fixed (Value::frozen); UserError for a policy
// that selects nothing or more blocks than the model has (models/freeze.cpp).
void apply_finetune(Graph& g, const FinetuneSpec& f);

}  // namespace et
