// The fine-tuning policy (config section `finetune`, docs/finetune.md): which parameters train.
// Freezing happens on the graph before it is planned: a frozen parameter gets no gradient buffer
// and no optimizer state, and the executor's planner (engine/executor_plan.cpp) drops every
// backward computation and every saved activation no trained parameter needs.
//
// "Blocks or layers" for last:N: a residual block (layer3.1, layers.7: its name's first two parts
// when the second is a number), else a layer with parameters together with the BN right after
// it (conv1 + bn1, VGG's features.0 + features.1). The classifier is the head.
#include <fnmatch.h>

#include <algorithm>
#include <map>

#include "models/models.h"

namespace et {
namespace {

bool is_index(const std::string& s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos; }

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  size_t b = 0;
  for (size_t e; (e = s.find('.', b)) != std::string::npos; b = e + 1) parts.push_back(s.substr(b, e - b));
  parts.push_back(s.substr(b));
  return parts;
}

struct Layer {
  int node;
  std::string unit;
  std::vector<int> params;
};

}  // namespace

void apply_finetune(Graph& g, const FinetuneSpec& f) {
  // Layers (nodes with parameters) in order, and the unit each belongs to.
  std::vector<Layer> layers;
  std::map<int, size_t> layer_of_node;
  for (int n = 0; n < g.num_nodes(); ++n) {
    const Node& node = g.node(n);
    Layer l{n, node.name, {}};
    for (int v : node.inputs)
      if (g.value(v).kind == ValueKind::Param) l.params.push_back(v);
    if (l.params.empty()) continue;
    const std::vector<std::string> parts = split(node.name);
    if (parts.size() >= 3 && is_index(parts[1]) && parts[0] != "features") {
      l.unit = parts[0] + "." + parts[1];
    } else if (node.op->op_class() == OpClass::Normalize) {
      const int producer = g.value(node.inputs[0]).producer;
      if (auto it = layer_of_node.find(producer); it != layer_of_node.end()) l.unit = layers[it->second].unit;
    }
    layer_of_node[n] = layers.size();
    layers.push_back(l);
  }
  const int head_node = g.logits >= 0 ? g.value(g.logits).producer : -1;
  ET_CHECK(layer_of_node.count(head_node), "the logits must come from a layer with parameters");
  const std::string head = layers[layer_of_node[head_node]].unit;
  std::vector<std::string> units;  // in order, the head excluded
  for (const Layer& l : layers)
    if (l.unit != head && std::find(units.begin(), units.end(), l.unit) == units.end()) units.push_back(l.unit);

  std::vector<uint8_t> train(layers.size(), 0);
  const std::vector<std::string>& t = f.trainable;
  const bool keyword = t.size() == 1 && (t[0] == "all" || t[0] == "head" || t[0].rfind("last:", 0) == 0);
  if (keyword && t[0] == "all") {
    std::fill(train.begin(), train.end(), 1);
  } else if (keyword) {
    const size_t last = t[0] == "head" ? 0 : size_t(std::stoi(t[0].substr(5)));
    if (last > units.size())
      user_error("config key 'finetune.trainable' = \"", t[0], "\": the model has only ", units.size(),
                 " blocks or layers before its head");
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto pos = std::find(units.begin(), units.end(), layers[i].unit) - units.begin();
      train[i] = layers[i].unit == head || size_t(pos) >= units.size() - last;
    }
  } else {
    for (const std::string& pattern : t) {
      bool matched = false;
      for (size_t i = 0; i < layers.size(); ++i) {
        bool m = fnmatch(pattern.c_str(), g.node(layers[i].node).name.c_str(), 0) == 0 ||
                 fnmatch(pattern.c_str(), layers[i].unit.c_str(), 0) == 0;
        for (int p : layers[i].params) m |= fnmatch(pattern.c_str(), g.value(p).name.c_str(), 0) == 0;
        train[i] |= m;
        matched |= m;
      }
      if (!matched)
        user_error("config key 'finetune.trainable': pattern '", pattern, "' matches no layer or parameter of the model");
    }
  }
  // A layer trains whole; BN parameters stay fixed under finetune.bn = frozen (set by the builder).
  for (size_t i = 0; i < layers.size(); ++i)
    for (int p : layers[i].params) g.value(p).frozen = g.value(p).frozen || !train[i];
}

}  // namespace et
