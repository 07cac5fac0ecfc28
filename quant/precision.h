// Per-layer precision policy: the one place where conv / linear forward operands and the output
// gradient may be quantized (LUQ: INT4 forward, FP4 gradients; later issue). FP32 is the identity:
// it returns the tensor it was given, no copy.
#pragma once
#include "engine/tensor.h"

namespace et {

struct Node;

enum class Operand : uint8_t { Input, Weight, OutputGrad };

class PrecisionPolicy {
 public:
  virtual ~PrecisionPolicy() = default;
  virtual const char* name() const = 0;
  // Returns the operand the kernel should use for `node` (may be `t` itself).
  virtual Tensor apply(const Node& node, Operand which, const Tensor& t) = 0;
  // True if apply() always returns its operand unchanged: kernels may then read saved tensors in
  // the stash's encodings (Op::reads_stored), which apply() never sees.
  virtual bool identity() const { return false; }
};

class Fp32Policy final : public PrecisionPolicy {
 public:
  const char* name() const override { return "fp32"; }
  Tensor apply(const Node&, Operand, const Tensor& t) override { return t; }
  bool identity() const override { return true; }
};

}  // namespace et
