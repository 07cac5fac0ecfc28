// Graph: values (tensors with a role) and nodes (an op reading values and writing one output).
// Built once from the model config by op builders (layers/*.cpp) that check shapes and wire nodes;
// executed later, forward in node order and backward in reverse (engine/executor.h).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/op.h"
#include "engine/tensor.h"

namespace et {

enum class ValueKind : uint8_t {
  Input,       // fed by the data loader each step (images, labels)
  Param,       // weights: persistent; trained ones (not frozen) have a gradient and optimizer state
  Buffer,      // persistent state without gradient (BN running statistics)
  Activation,  // produced by a node in forward; planned by lifetime
  Aux,         // produced by a node in forward for its own backward (BN batch mean/invstd), or for
               // a later node's forward (Value::forward_only)
};

enum class ParamInit : uint8_t { None, Zeros, Ones, KaimingNormalFanOut, UniformFanIn };

struct Value {
  std::string name;
  Shape shape;           // for batched values, d[0] is the maximum batch the graph was built for
  DType dtype = DType::F32;
  ValueKind kind = ValueKind::Activation;
  bool batched = false;  // d[0] is the batch dimension
  bool needs_grad = false;
  bool frozen = false;   // Param kept fixed by the fine-tuning policy (models/freeze.cpp)
  ParamInit init = ParamInit::None;
  int64_t init_fan = 0;  // fan used by the initializer
  int producer = -1;     // node index, -1 for inputs / params / buffers
  std::vector<int> consumers;
  // An Aux value read by later nodes' first forward only, not by its producer's backward (a conv's
  // per-plane sums for the fused BN stack after it): it dies after its last reader. Not written or
  // read by a recompute, which comes after that.
  bool forward_only = false;
  // An Aux value its readers write in their backward for its producer's backward (the sums of the
  // first backward sweep that a conv's data gradient takes for the fused stack before it:
  // FusedGrads::dz_sums): it lives from its first reader's backward to its producer's, not in the
  // forward, whose buffers may share its bytes.
  bool backward_only = false;
};

struct Node {
  std::string name;
  std::unique_ptr<Op> op;
  std::vector<int> inputs;  // value ids; op-specific order (e.g. conv: x, w, b)
  std::vector<int> aux;     // per-node forward state for backward (Aux values)
  int output = -1;
  // Seeds the node's stochastic ops (OpContext::seed): its index in the graph as built, kept when
  // fusion rewrites the graph, so fused and unfused runs draw the same numbers.
  int seed_index = -1;
};

class Graph {
 public:
  int add_value(Value v);
  // Wires a node; checks inputs exist. Returns the output value id.
  int add_node(std::string name, std::unique_ptr<Op> op, std::vector<int> inputs, Value output,
               std::vector<Value> aux = {});
  // Adds an aux value to node `node` (after the ones it was built with). Returns its value id.
  int add_aux(int node, Value aux);

  const Value& value(int id) const { return values_.at(size_t(id)); }
  Value& value(int id) { return values_.at(size_t(id)); }
  const Node& node(int id) const { return nodes_.at(size_t(id)); }
  Node& node(int id) { return nodes_.at(size_t(id)); }
  int num_values() const { return int(values_.size()); }
  int num_nodes() const { return int(nodes_.size()); }
  const std::vector<Node>& nodes() const { return nodes_; }

  int find_value(const std::string& name) const;  // -1 if absent

  std::vector<int> params() const;   // in creation order, frozen ones included
  std::vector<int> buffers() const;
  int batch_size() const { return batch_; }
  void set_batch_size(int n) { batch_ = n; }

  // Options op builders read while the model is built (from the config).
  struct BuildOptions {
    bool double_mask_bn = false;  // memory.double_mask_bn: BN output and gradient masked by x's zeros
    bool frozen_bn = false;       // finetune.bn = frozen: BN normalises with its running statistics
  } build;

  // Marked by the model builder.
  int image_input = -1, label_input = -1, logits = -1, loss = -1;

 private:
  std::vector<Value> values_;
  std::vector<Node> nodes_;
  int batch_ = 0;
};

}  // namespace et
