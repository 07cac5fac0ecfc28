// ONNX export (`edgetrain export --format onnx`, docs/finetune.md): a model's inference path, images
// to logits, as an ONNX graph for deployment runtimes (TensorRT on Jetson, ONNX Runtime, OpenCV's
// DNN module), written with Debian's ONNX library (libonnx-dev, protobuf) and checked by it. This
// header includes neither ONNX nor protobuf: they live in a module, libedgetrain_onnx.so, loaded with
// dlopen on the first export (engine/io/onnx_module.h), built where CMake found them (option
// EDGETRAIN_ONNX); otherwise export_onnx throws "built without ONNX support".
//
// The graph (opset 13, IR version 7), walked from the engine's own graph in evaluation mode:
//   input "input": float32 [N, C, H, W] (N symbolic), pixel values in [0, 1], channels as the data
//     loader gives them (RGB);
//   normalisation (x - data.mean) / data.std per channel: Sub + Div with constant initializers;
//   conv2d -> Conv (group = the conv's groups: MobileNetV2's depthwise convs);
//   batchnorm2d -> folded into the conv before it (fold_bn, the default: W' = W s, b' = (b - mean) s
//     + beta with s = gamma / sqrt(var + eps), computed in double), else BatchNormalization
//     (running statistics);
//   relu -> Relu; add -> Add; maxpool2d -> MaxPool; avgpool2d -> AveragePool (count_include_pad);
//   global_avgpool -> GlobalAveragePool + Flatten; flatten -> Flatten; linear -> Gemm (transB);
//   dropout -> nothing (inference); subsample_pad (option-A shortcut) -> Slice (stride) + Pad
//     (zero channels);
//   output "logits": float32 [N, classes].
// Any other op (a fused stack: export builds the graph without fusion) is a UserError naming the
// layer, and so is memory.double_mask_bn (a BN masked by its input's zeros).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/graph.h"

namespace et {

struct OnnxExportOptions {
  std::vector<float> mean, std;  // per input channel (data.mean / data.std); empty: 0 and 1
  bool fold_bn = true;           // BN folded into the conv before it; false: BatchNormalization nodes
  std::string graph_name = "edgetrain";
  std::string doc;                               // the model's doc_string
  std::map<std::string, std::string> metadata;  // the model's metadata_props
};

struct OnnxExportReport {
  int64_t opset = 0, ir_version = 0;
  int nodes = 0;           // ONNX nodes
  int folded_bn = 0;       // BNs folded into a conv
  int64_t weights = 0;     // floats in the initializers (the normalisation's included)
  size_t bytes = 0;        // size of the file written
};

// Whether this build writes ONNX (CMake found libonnx-dev and libprotobuf-dev).
bool onnx_export_available();

// Writes g's inference path (g.image_input to g.logits) to `path`, with `value(id)` giving the
// values of its params and buffers (an executor's, with a checkpoint loaded). Before anything is
// written the model passes onnx::checker::check_model and strict shape inference (what the Python
// checker's full_check runs), whose every inferred shape must equal the engine's; then the file is
// written atomically (a temporary file beside it, fsync, rename: a failure leaves nothing). Throws
// UserError naming the layer or the file.
OnnxExportReport export_onnx(const Graph& g, const std::function<Tensor(int)>& value, const OnnxExportOptions& o,
                             const std::string& path);

// Loads an ONNX file and runs the checker on it: "" when it is valid, else what is wrong.
std::string check_onnx_file(const std::string& path);

}  // namespace et
