// Which conv / linear layers train in 4 bits and how (docs/quant.md): the `quant` config section
// resolved against a graph into one LayerQuant per node. Backend neutral.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace et {

class Graph;

enum class ForwardQuant : uint8_t { Fp32, Int4 };
enum class BackwardQuant : uint8_t { Fp32, LuqFp4, Fp4Rdn };
const char* forward_quant_name(ForwardQuant f);
const char* backward_quant_name(BackwardQuant b);
bool parse_forward_quant(const std::string& s, ForwardQuant* out);
bool parse_backward_quant(const std::string& s, BackwardQuant* out);

struct QuantOptions {
  ForwardQuant forward = ForwardQuant::Fp32;
  BackwardQuant backward = BackwardQuant::Fp32;
  // Layers that stay FP32 whatever the modes: names, or `first` (the first conv / linear) and
  // `last` (the last one, the classifier). The LUQ convention keeps both.
  std::vector<std::string> keep_fp32 = {"first", "last"};
  struct Layer {
    std::string name;
    ForwardQuant forward = ForwardQuant::Fp32;
    BackwardQuant backward = BackwardQuant::Fp32;
  };
  std::vector<Layer> layers;  // per-layer modes, over the global ones and keep_fp32
  int smp_samples = 1;        // SMP: samples of the gradient quantizer averaged for the weight gradient
  int grad_magnitudes = 7;    // FP4 magnitudes alpha * 2^0 .. 2^(m-1); 7 = strict FP4 [1,3,0]
  // FNT (LUQ's high-precision fine-tuning, quant.fnt_epochs): every layer the modes above quantize
  // keeps only INT4 weights; its inputs and gradients are FP32. FP32 layers stay FP32.
  bool fnt = false;
  bool any() const;
  // The divergence guard's rollbacks (TrainProgress::fp32_layers): these layers FP32 both ways.
  void raise_to_fp32(const std::vector<std::string>& names) {
    for (const std::string& n : names) layers.push_back(Layer{n, ForwardQuant::Fp32, BackwardQuant::Fp32});
  }
};

// What one node does in 4 bits.
struct LayerQuant {
  bool int4_forward = false;                      // x and w as INT4 codes (SAWB, nearest)
  // FNT: only w as INT4 codes (SAWB, nearest, every step); the float kernels read the dequantised
  // codes, x and dL/dy stay FP32, dw (FP32) updates the master weights (straight-through).
  // Exclusive with int4_forward and an FP4 backward.
  bool int4_weights_only = false;
  BackwardQuant backward = BackwardQuant::Fp32;   // dL/dy as FP4 (LUQ or nearest)
  bool input_unsigned = false;                    // x >= 0 by construction: codes 0..15
  int smp = 1, levels = 7;
  bool on() const { return int4_forward || int4_weights_only || backward != BackwardQuant::Fp32; }
};

// One LayerQuant per node of g (off for everything but conv / linear). Unknown layer names in
// keep_fp32 / layers are user errors naming the key.
std::vector<LayerQuant> resolve_quant(const Graph& g, const QuantOptions& o);

}  // namespace et
