// What a model is built from (the config's model section), and the model registry's entry points.
// Declared here so that engine/ (config, trainer) needs no models/ header; models/registry.cpp
// implements them, and models/ may include engine/.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace et {

class Graph;

// Depth-first fusion of the layers between convolutions (config section `fusion`, docs/fusion.md).
struct FusionSpec {
  bool enabled = false;
  // fusion.enabled = "auto" (the config's default): on where the backend runs fused stacks (the
  // CPU), off on CUDA; `enabled` holds the resolved value, this the setting (written back as "auto").
  bool automatic = false;
  int64_t tile = 0;                  // channels of one image per tile; 0 = auto (from the cache)
  std::vector<std::string> disable;  // stacks left unfused, by name (their head BN layer)
  int64_t cache_kb = 0;              // cache a tile must fit in; 0 = this core's L2 (sysfs, else CPUID)
  int64_t llc_kb = 0;                // last-level cache, for streaming stores; 0 = sysfs, else CPUID
  // BN's first backward sweep in the data gradient of the conv reading the stack's output, where
  // it can (fusion::StackPlan::sweep1_to_reader); false: every stack sweeps itself (A/B runs).
  // sweep1_in_reader_auto (the config's default, "auto"): in the reader only where the stack's x
  // and y together do not fit the last-level cache (fusion/planner.cpp says why). This struct's
  // own default (tests and tools that build a spec) is the reader wherever it can.
  bool sweep1_in_reader = true;
  bool sweep1_in_reader_auto = false;
  // A BN whose output's only reader is a stack's Add (a projection shortcut's) folded into that
  // stack (FusedStack::side_bn); false: it stays a layer (A/B runs).
  bool fold_side_bn = true;
  // The stacks a backend without the CPU's tiled kernels runs (the CUDA backend,
  // backends/cuda/cuda_batchnorm.cu), over whole tensors: BN -> ReLU [-> max-pool | average pool
  // | global average pool], BN -> add [-> ReLU] (a projection shortcut's BN folded where
  // fold_side_bn), and without a BN ReLU -> pool with windows that do not overlap (VGG without
  // BN); their statistics their own (no producer's sums), both backward sweeps their own, no y
  // bitmap of their own (the stash's mask, or y, gives the last ReLU's). Dropout, and a pool right
  // after a BN, stay layers.
  bool whole_tensors = false;
};

// Which parameters train (config section `finetune`, docs/finetune.md; models/freeze.cpp).
struct FinetuneSpec {
  // "all", "head" (the classifier), "last:N" (the last N blocks or layers and the head), or name
  // patterns (glob: * and ?) selecting layers by their own or their parameters' names.
  std::vector<std::string> trainable = {"all"};
  bool frozen_bn = false;  // finetune.bn = frozen: running statistics, BN parameters fixed
};

struct ModelSpec {
  std::string name = "resnet20";
  int64_t num_classes = 10;
  // ResNets' shortcut where a block changes shape: 'B' a 1x1 conv + BN, 'A' strided subsampling
  // with zero channels, no parameters (He et al.'s CIFAR ResNets and their published weights).
  char shortcut = 'B';
  int64_t channels = 3, height = 32, width = 32;
  int64_t batch = 128;
  float label_smoothing = 0.f;
  float dropout = 0.f;  // before the classifier (VGG, MobileNetV2); 0 = none
  bool double_mask_bn = false;  // memory.double_mask_bn (layers/batchnorm.cpp)
  FusionSpec fusion;            // the config's fusion section, applied by build_model
  FinetuneSpec finetune;        // applied by build_model before fusion
};

// Builds the model into an empty graph, fused as spec.fusion says (fusion/fusion.h); throws
// UserError for an unknown name (listing known ones).
void build_model(Graph& g, const ModelSpec& spec);
std::vector<std::string> model_names();

}  // namespace et
