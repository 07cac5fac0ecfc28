// model.weights: a model's parameters and BN buffers from a file instead of the random
// initialisation: a .safetensors file (scripts/convert_pytorch.py writes one from a PyTorch
// checkpoint; names as in a PyTorch state_dict) or an edgetrain checkpoint (its parameters and
// buffers; optimizer state and progress stay behind). docs/finetune.md.
//
// Matching is by name and shape, and strict: every missing, unexpected or shape-mismatched tensor
// is listed in one error. The one exception is the head swap: if only the classifier (the linear
// layer producing the logits) differs, and in its number of classes, it keeps its fresh
// initialisation and the report says so. PyTorch's BN `num_batches_tracked` counters are ignored
// (edgetrain's BN uses a fixed momentum, as PyTorch's does by default).
#pragma once
#include <string>
#include <vector>

namespace et {

class Executor;

struct WeightsReport {
  std::vector<std::string> lines;  // what was loaded, for the log
  int loaded = 0;                  // tensors taken from the file
  bool head_swapped = false;
};

// Loads `path` into the executor's params and buffers; validates everything before writing any
// value. Throws UserError naming the file and the tensors.
WeightsReport load_weights(const std::string& path, Executor& ex);

}  // namespace et
