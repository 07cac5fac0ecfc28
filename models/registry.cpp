#include <functional>
#include <map>

#include "fusion/fusion.h"
#include "layers/layers.h"
#include "models/models.h"

namespace et {
namespace {

using Builder = std::function<int(Graph&, int, const ModelSpec&)>;

const std::map<std::string, Builder>& registry() {
  static const std::map<std::string, Builder> r = [] {
    std::map<std::string, Builder> m;
    for (int depth : {8, 20, 32, 44, 56, 110})
      m["resnet" + std::to_string(depth)] = [depth](Graph& g, int x, const ModelSpec& s) {
        return build_cifar_resnet(g, x, depth, s.num_classes, s.shortcut);
      };
    m["resnet18"] = [](Graph& g, int x, const ModelSpec& s) { return build_resnet18(g, x, s.num_classes, s.shortcut); };
    for (int depth : {11, 13, 16, 19}) {
      m["vgg" + std::to_string(depth)] = [depth](Graph& g, int x, const ModelSpec& s) {
        return build_vgg(g, x, depth, false, s.num_classes, s.dropout);
      };
      m["vgg" + std::to_string(depth) + "_bn"] = [depth](Graph& g, int x, const ModelSpec& s) {
        return build_vgg(g, x, depth, true, s.num_classes, s.dropout);
      };
    }
    m["mobilenetv2"] = [](Graph& g, int x, const ModelSpec& s) { return build_mobilenetv2(g, x, s.num_classes, s.dropout); };
    return m;
  }();
  return r;
}

}  // namespace

std::vector<std::string> model_names() {
  std::vector<std::string> out;
  for (const auto& [name, _] : registry()) out.push_back(name);
  return out;
}

void build_model(Graph& g, const ModelSpec& spec) {
  auto it = registry().find(spec.name);
  if (it == registry().end()) {
    std::string known;
    for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
    user_error("unknown model '", spec.name, "' (known: ", known, ")");
  }
  if (spec.num_classes < 2) user_error("model.num_classes must be at least 2, got ", spec.num_classes);
  // 0 = data.channels / height / width = "auto", which engine/data/auto.h resolves first.
  ET_CHECK(spec.channels > 0 && spec.height > 0 && spec.width > 0, "build_model: input shape ", spec.channels, "x",
           spec.height, "x", spec.width, " not resolved");
  g.build.double_mask_bn = spec.double_mask_bn;
  g.build.frozen_bn = spec.finetune.frozen_bn;
  const int x = image_input(g, spec.batch, spec.channels, spec.height, spec.width);
  const int labels = label_input(g, spec.batch);
  const int logits = it->second(g, x, spec);
  softmax_cross_entropy(g, logits, labels, "loss", spec.label_smoothing);
  apply_finetune(g, spec.finetune);
  if (spec.fusion.enabled) fusion::apply(g, fusion::plan(g, spec.fusion));
}

}  // namespace et
