// `edgetrain export`: a trained checkpoint for other tools (docs/finetune.md).
//   safetensors: parameters and BN buffers by their PyTorch names (scripts/convert_pytorch.py
//     --to-pytorch turns the file into a state_dict; model.weights reads it back).
//   onnx: the inference graph, images in [0, 1] to logits, normalisation inside
//     (engine/io/onnx_export.h). The graph is the engine's own, built from the run's config (the
//     config.json beside the checkpoint, or --config) without fusion, with the checkpoint loaded
//     as `edgetrain eval` loads it.
#include <cstdio>
#include <filesystem>

#include "apps/commands.h"
#include "engine/data/auto.h"
#include "engine/data/dataset.h"
#include "backends/backend.h"
#include "engine/check.h"
#include "engine/config.h"
#include "engine/executor.h"
#include "engine/init.h"
#include "engine/io/onnx_export.h"
#include "engine/io/safetensors.h"
#include "engine/train/checkpoint.h"
#include "engine/train/weights.h"
#include "quant/policy.h"
#include "quant/scales.h"

namespace et::app {
namespace fs = std::filesystem;

namespace {

std::string join(const std::vector<float>& v) {
  std::string s;
  for (float x : v) s += (s.empty() ? "" : ",") + fmt(x);
  return s;
}

std::string mib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MB", double(bytes) / (1 << 20));
  return buf;
}

// FNT (quant.fnt_epochs): layer `node`'s weights as the FNT forward uses them, INT4 codes with
// their SAWB scale, dequantised (layers/quantized.cpp: qops::dequantized_weight), in place.
void to_int4_weights(Executor& ex, int node) {
  const int w = ex.graph().node(node).inputs.at(1);
  Tensor t = ex.value(w);
  Backend& be = ex.backend();
  const TensorStats s = be.tensor_stats(t);
  if (!s.finite) user_error("layer '", ex.graph().node(node).name, "': non-finite weights, nothing to export");
  std::vector<int8_t> codes(size_t(t.numel()));
  Tensor q = Tensor::contiguous(codes.data(), t.shape, DType::I4);
  q.scale = quant::sawb_scale(s, t.numel(), false);
  be.quantize_int4(t, q);
  be.dequantize(q, t);
}

int export_onnx_cmd(const ExportArgs& a) {
  if (!onnx_export_available())
    user_error("cannot export '", a.out, "' as ONNX: this edgetrain was built without ONNX support (CMake option ",
               "EDGETRAIN_ONNX off, or Debian's libonnx-dev and libprotobuf-dev not found: scripts/setup.sh installs ",
               "them, then rebuild). --format safetensors works without it");
  // The graph comes from the run's config: --config, else the config.json of the checkpoint's run folder.
  std::string config = a.config;
  if (config.empty()) {
    if (a.checkpoint.empty())
      user_error("export --format onnx needs --checkpoint FILE (its run folder's config.json builds the model), or "
                 "--config FILE with --set model.weights=FILE");
    config = (fs::path(a.checkpoint).parent_path() / "config.json").string();
    if (!fs::exists(config))
      user_error("no config.json beside checkpoint '", a.checkpoint, "' (", config,
                 "): the ONNX export builds the model from the run's config; give it with --config FILE");
  }
  Config cfg = load_config(config, a.sets);
  if (a.checkpoint.empty() && cfg.weights.empty())
    user_error("export needs weights: --checkpoint FILE, or model.weights (--set model.weights=FILE)");
  if (cfg.memory.double_mask_bn)
    user_error("config '", config, "': memory.double_mask_bn (BN masked by its input's zeros) has no ONNX export");
  // "auto" data keys (a user's config, not a run's config.json, which holds the numbers) resolve
  // as in training: the shape from the data, mean / std over the training split, which the graph
  // then holds as its normalisation.
  if (const std::string line = resolve_data_shape(cfg); !line.empty()) std::printf("%s\n", line.c_str());
  if (cfg.stats_auto()) {
    ImageFolderOptions io;
    io.channels = int(cfg.model.channels);
    io.height = int(cfg.model.height);
    io.width = int(cfg.model.width);
    io.resize = cfg.data.resize;
    auto train = std::make_shared<const Dataset>(load_dataset(cfg.data.format, cfg.data.root, Split::Train, io));
    std::printf("%s\n", resolve_data_stats(cfg, *training_images(train, cfg)).c_str());
  }
  cfg.model.fusion.enabled = false;  // the layers one by one: a fused stack is no ONNX op
  cfg.model.batch = 1;               // the ONNX batch is symbolic; one image's buffers suffice here

  Graph g;
  build_model(g, cfg.model);
  const std::unique_ptr<Backend> backend = make_cpu_backend();
  Executor ex(g, *backend);
  init_parameters(ex, cfg.train.seed);
  int epoch = -1;
  std::vector<std::string> fp32_layers;  // raised by the divergence guard's rollbacks
  std::string source;
  if (!a.checkpoint.empty()) {
    const TrainProgress pr = load_checkpoint(a.checkpoint, ex, cfg.model.name);
    epoch = pr.epoch;
    fp32_layers = pr.fp32_layers;
    source = fmt("checkpoint ", a.checkpoint, " (after epoch ", epoch + 1, ")");
  } else {
    const WeightsReport w = load_weights(cfg.weights, ex);
    for (const std::string& line : w.lines) std::printf("%s\n", line.c_str());
    source = "weights " + cfg.weights;
  }

  // 4-bit models (docs/quant.md): as `edgetrain eval` runs the checkpoint's phase. FNT layers run
  // FP32 activations on INT4 weights: exported exactly so, with the dequantised INT4 weights. INT4
  // forward layers quantize their inputs per batch, which the graph does not: their float
  // weights are exported, and the graph computes in FP32.
  const bool fnt = cfg.quant.fnt_epochs > 0 && epoch >= cfg.train.epochs - cfg.quant.fnt_epochs;
  QuantOptions quant = cfg.quant_options(fnt);
  quant.raise_to_fp32(fp32_layers);
  const std::vector<LayerQuant> lq = resolve_quant(g, quant);
  int int4_weights = 0, int4_forward = 0;
  for (int n = 0; n < g.num_nodes(); ++n) {
    if (lq[size_t(n)].int4_weights_only) {
      to_int4_weights(ex, n);
      ++int4_weights;
    }
    int4_forward += lq[size_t(n)].int4_forward;
  }

  OnnxExportOptions o;
  o.mean = cfg.data.mean;
  o.std = cfg.data.std;
  o.fold_bn = !a.keep_bn;
  o.graph_name = cfg.model.name;
  const Shape in = g.value(g.image_input).shape;
  o.doc = fmt("edgetrain ", cfg.model.name, " from ", source, ". Input 'input': float32 [N, ", in[1], ", ", in[2], ", ",
              in[3], "] pixel values in [0, 1] (RGB), normalised inside the graph with mean [", join(cfg.data.mean),
              "] and std [", join(cfg.data.std), "]. Output 'logits': float32 [N, ", cfg.model.num_classes, "].");
  o.metadata = {{"model", cfg.model.name},
                {"num_classes", std::to_string(cfg.model.num_classes)},
                {"input", fmt("float32 NCHW [N,", in[1], ",", in[2], ",", in[3], "], RGB in [0,1]")},
                {"mean", join(cfg.data.mean)},
                {"std", join(cfg.data.std)},
                {"source", source},
                {"batchnorm", a.keep_bn ? "BatchNormalization nodes" : "folded into the convolutions"}};
  if (int4_weights) o.metadata["quant"] = fmt(int4_weights, " layers with their INT4 weights (FNT), dequantised");
  if (int4_forward) o.metadata["quant"] = fmt(int4_forward, " INT4-forward layers exported in FP32 (float weights)");
  const OnnxExportReport r = export_onnx(g, [&ex](int id) { return ex.value(id); }, o, a.out);

  std::printf("exported %s from %s to %s: ONNX opset %lld (IR %lld), %d nodes, %d BatchNorm%s folded into convs, "
              "%lld weights, %s; checked by onnx::checker and strict shape inference\n",
              cfg.model.name.c_str(), source.c_str(), a.out.c_str(), (long long)r.opset, (long long)r.ir_version,
              r.nodes, r.folded_bn, r.folded_bn == 1 ? "" : "s", (long long)r.weights, mib(r.bytes).c_str());
  std::printf("input 'input' float32 [N, %lld, %lld, %lld] RGB in [0, 1], normalised inside the graph; "
              "output 'logits' float32 [N, %lld]\n",
              (long long)in[1], (long long)in[2], (long long)in[3], (long long)cfg.model.num_classes);
  if (int4_weights)
    std::printf("quant: %d layers export their INT4 weights (FNT, dequantised), as edgetrain eval runs them\n",
                int4_weights);
  if (int4_forward)
    std::printf("note: quant.forward = int4: %d layers quantize their inputs per batch in edgetrain; the ONNX graph runs "
                "them in FP32 with the float weights, so its logits differ from edgetrain eval's\n",
                int4_forward);
  return 0;
}

}  // namespace

int cmd_export(const ExportArgs& a) {
  std::string format = a.format;
  if (format.empty()) format = fs::path(a.out).extension() == ".onnx" ? "onnx" : "safetensors";
  if (fs::exists(a.out)) user_error("'", a.out, "' exists; choose another --out");
  // Before any work: the file goes into an existing folder (the writers name any other failure).
  const fs::path dir = fs::path(a.out).parent_path();
  std::error_code ec;
  if (!dir.empty() && !fs::is_directory(dir, ec))
    user_error("cannot write '", a.out, "': '", dir.string(), "' is not a folder");
  if (format == "onnx") return export_onnx_cmd(a);
  if (!a.config.empty() || !a.sets.empty() || a.keep_bn)
    user_error("--config, --set and --keep-bn are for --format onnx; safetensors exports the checkpoint's tensors as they are");
  if (a.checkpoint.empty()) user_error("export --format safetensors needs --checkpoint FILE");
  std::string model;
  const std::vector<CheckpointTensor> tensors = read_checkpoint_tensors(a.checkpoint, &model);
  std::vector<SafetensorsOut> out;
  for (const CheckpointTensor& t : tensors) out.push_back({t.name, t.shape, t.values.data()});
  write_safetensors(a.out, out, {{"format", "pt"}, {"producer", "edgetrain"}, {"model", model}});
  std::printf("exported %zu tensors of %s from %s to %s\n", out.size(), model.c_str(), a.checkpoint.c_str(),
              a.out.c_str());
  return 0;
}

}  // namespace et::app
