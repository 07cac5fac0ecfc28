// ONNX export (engine/io/onnx_export.h): every registry model exports (BN folded; a few also with
// BatchNormalization nodes) and passes ONNX's checker and strict shape inference (shapes equal to
// the engine's); the file on disk checks again; pooling with padding and average pooling (no
// registry model uses them); refusals
// (a fused graph, a double-mask BN, bad normalisation, an unwritable path) are UserErrors that leave
// nothing behind. Running the files in a runtime is the `onnx` ctest (tests/onnx_test.sh).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <map>

#include "engine/io/onnx_export.h"
#include "layers/layers.h"
#include "models/models.h"
#include "tests/test_util.h"

using namespace et;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

using test::TempDir;

// Values for a graph's params and buffers: arbitrary, with positive BN variances.
struct Values {
  std::map<int, std::vector<float>> v;
  explicit Values(const Graph& g) {
    uint32_t s = 12345;
    auto next = [&] { return float((s = s * 1664525u + 1013904223u) >> 8) / float(1 << 24); };
    std::vector<int> ids = g.params();
    for (int b : g.buffers()) ids.push_back(b);
    for (int id : ids) {
      std::vector<float>& x = v[id];
      x.resize(size_t(g.value(id).shape.numel()));
      const bool var = g.value(id).name.find("running_var") != std::string::npos;
      for (float& f : x) f = var ? 0.5f + next() : next() - 0.5f;
    }
  }
  std::function<Tensor(int)> fn(const Graph& g) {
    return [this, &g](int id) { return Tensor::contiguous(v.at(id).data(), g.value(id).shape); };
  }
};

OnnxExportOptions cifar() {
  OnnxExportOptions o;
  o.mean = {0.4914f, 0.4822f, 0.4465f};
  o.std = {0.2470f, 0.2435f, 0.2616f};
  return o;
}

}  // namespace

TEST_CASE("onnx: every registry model exports and passes the checker", "[onnx]") {
  if (!onnx_export_available()) {
    Graph g;
    ModelSpec s;
    s.batch = 2;
    build_model(g, s);
    Values v(g);
    TempDir t;
    REQUIRE_THROWS_WITH(export_onnx(g, v.fn(g), cifar(), t.file("m.onnx")), Contains("built without ONNX support"));
    return;
  }
  TempDir t;
  for (const std::string& name : model_names()) {
    for (char shortcut : {'B', 'A'}) {
      if (shortcut == 'A' && name.rfind("resnet", 0) != 0) continue;
      // BatchNormalization nodes instead of folding: a few models (the rest is the same code).
      const bool some = name == "resnet8" || name == "resnet18" || name == "vgg11_bn" || name == "mobilenetv2";
      for (bool fold : {true, false}) {
        if (!fold && !some) continue;
        INFO(name << " shortcut " << shortcut << (fold ? " folded" : " with BatchNormalization"));
        Graph g;
        ModelSpec s;
        s.name = name;
        s.batch = 2;
        s.shortcut = shortcut;
        s.dropout = 0.2f;
        build_model(g, s);
        Values v(g);
        OnnxExportOptions o = cifar();
        o.fold_bn = fold;
        const std::string path = t.file(name + ".onnx");
        const OnnxExportReport r = export_onnx(g, v.fn(g), o, path);
        CHECK(r.opset == 13);
        CHECK(r.nodes > 0);
        int bns = 0;
        for (const Node& n : g.nodes()) bns += std::string(n.op->type()) == "batchnorm2d";
        CHECK(r.folded_bn == (fold ? bns : 0));
        CHECK(r.bytes == fs::file_size(path));
        CHECK(check_onnx_file(path).empty());
        CHECK_FALSE(fs::exists(path + ".tmp"));
        fs::remove(path);
      }
    }
  }
}

TEST_CASE("onnx: pooling with padding, average pooling, flatten, no normalisation", "[onnx]") {
  if (!onnx_export_available()) ET_SKIP("built without ONNX support");
  Graph g;
  const int x = image_input(g, 2, 3, 15, 15);
  label_input(g, 2);
  Conv2dOptions c;
  c.out_channels = 8;
  c.kernel = 5;
  c.stride = 2;
  c.padding = 2;
  c.bias = true;
  int y = relu(g, conv2d(g, x, "conv", c), "relu");
  y = maxpool2d(g, y, "maxpool", 3, 2, 1);
  y = avgpool2d(g, y, "avgpool", 3, 1, 1);
  y = flatten(g, batchnorm2d(g, y, "bn"), "flatten");  // a BN after a pool: BatchNormalization
  softmax_cross_entropy(g, linear(g, y, "fc", 4), g.label_input, "loss");
  Values v(g);
  TempDir t;
  const OnnxExportReport r = export_onnx(g, v.fn(g), OnnxExportOptions{}, t.file("p.onnx"));
  CHECK(r.folded_bn == 0);
  CHECK(check_onnx_file(t.file("p.onnx")).empty());
}

TEST_CASE("onnx: refusals name the layer or the file and write nothing", "[onnx]") {
  if (!onnx_export_available()) ET_SKIP("built without ONNX support");
  TempDir t;
  const std::string path = t.file("m.onnx");
  {  // a fused graph
    Graph g;
    ModelSpec s;
    s.name = "resnet8";
    s.batch = 2;
    s.fusion.enabled = true;
    build_model(g, s);
    Values v(g);
    REQUIRE_THROWS_WITH(export_onnx(g, v.fn(g), cifar(), path), Contains("fused stack"));
  }
  {  // memory.double_mask_bn
    Graph g;
    ModelSpec s;
    s.name = "resnet8";
    s.batch = 2;
    s.double_mask_bn = true;
    build_model(g, s);
    Values v(g);
    REQUIRE_THROWS_WITH(export_onnx(g, v.fn(g), cifar(), path), Contains("double_mask_bn"));
  }
  Graph g;
  ModelSpec s;
  s.name = "resnet8";
  s.batch = 2;
  build_model(g, s);
  Values v(g);
  OnnxExportOptions bad = cifar();
  bad.mean = {0.5f};
  REQUIRE_THROWS_WITH(export_onnx(g, v.fn(g), bad, path), Contains("1 normalisation values"));
  bad = cifar();
  bad.std[1] = 0.f;
  REQUIRE_THROWS_WITH(export_onnx(g, v.fn(g), bad, path), Contains("data.std of channel 1"));
  const std::string nowhere = t.file("nowhere/m.onnx");
  REQUIRE_THROWS_WITH(export_onnx(g, v.fn(g), cifar(), nowhere), Contains(nowhere));
  CHECK(fs::is_empty(t.path));
  CHECK_THAT(check_onnx_file(t.file("absent.onnx")), !Catch::Matchers::Equals(""));
}
