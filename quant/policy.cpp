#include "quant/policy.h"

#include <algorithm>

#include "engine/graph.h"

namespace et {

namespace {
const std::pair<ForwardQuant, const char*> kForward[] = {{ForwardQuant::Fp32, "fp32"}, {ForwardQuant::Int4, "int4"}};
const std::pair<BackwardQuant, const char*> kBackward[] = {
    {BackwardQuant::Fp32, "fp32"}, {BackwardQuant::LuqFp4, "luq_fp4"}, {BackwardQuant::Fp4Rdn, "fp4_rdn"}};
}  // namespace

const char* forward_quant_name(ForwardQuant f) {
  for (const auto& [v, n] : kForward)
    if (v == f) return n;
  return "?";
}
const char* backward_quant_name(BackwardQuant b) {
  for (const auto& [v, n] : kBackward)
    if (v == b) return n;
  return "?";
}
bool parse_forward_quant(const std::string& s, ForwardQuant* out) {
  for (const auto& [v, n] : kForward)
    if (s == n) return *out = v, true;
  return false;
}
bool parse_backward_quant(const std::string& s, BackwardQuant* out) {
  for (const auto& [v, n] : kBackward)
    if (s == n) return *out = v, true;
  return false;
}

bool QuantOptions::any() const {
  if (forward != ForwardQuant::Fp32 || backward != BackwardQuant::Fp32) return true;
  for (const Layer& l : layers)
    if (l.forward != ForwardQuant::Fp32 || l.backward != BackwardQuant::Fp32) return true;
  return false;
}

std::vector<LayerQuant> resolve_quant(const Graph& g, const QuantOptions& o) {
  const int nn = g.num_nodes();
  std::vector<LayerQuant> q(static_cast<size_t>(nn));
  std::vector<int> computes;
  for (int n = 0; n < nn; ++n)
    if (g.node(n).op->op_class() == OpClass::Compute) computes.push_back(n);
  auto node_named = [&](const std::string& name, const std::string& key) {
    for (int n : computes)
      if (g.node(n).name == name) return n;
    std::string known;
    for (int n : computes) known += (known.empty() ? "" : ", ") + g.node(n).name;
    user_error("config key '", key, "': no conv / linear layer named '", name, "' in the model (", known, ")");
  };
  // Non-negative by construction: ReLU outputs and what pooling / reshapes make of them.
  std::vector<uint8_t> nonneg(size_t(g.num_values()), 0);
  for (int n = 0; n < nn; ++n) {
    const Node& node = g.node(n);
    nonneg[size_t(node.output)] = node.op->output_nonnegative(!node.inputs.empty() && nonneg[size_t(node.inputs[0])]);
  }
  std::vector<uint8_t> keep(static_cast<size_t>(nn), 0);
  for (const std::string& k : o.keep_fp32) {
    if (computes.empty()) break;
    if (k == "first") keep[size_t(computes.front())] = 1;
    else if (k == "last") keep[size_t(computes.back())] = 1;
    else keep[size_t(node_named(k, "quant.keep_fp32"))] = 1;
  }
  for (int n : computes) {
    LayerQuant& l = q[size_t(n)];
    if (!keep[size_t(n)]) {
      l.int4_forward = o.forward == ForwardQuant::Int4;
      l.backward = o.backward;
    }
    l.input_unsigned = nonneg[size_t(g.node(n).inputs[0])] != 0;
    l.smp = o.smp_samples;
    l.levels = o.grad_magnitudes;
  }
  for (const QuantOptions::Layer& ly : o.layers) {
    LayerQuant& l = q[size_t(node_named(ly.name, "quant.layers." + ly.name))];
    l.int4_forward = ly.forward == ForwardQuant::Int4;
    l.backward = ly.backward;
  }
  if (o.fnt)
    for (int n : computes) {
      LayerQuant& l = q[size_t(n)];
      if (!l.on()) continue;
      l.int4_weights_only = true;
      l.int4_forward = false;
      l.backward = BackwardQuant::Fp32;
    }
  return q;
}

}  // namespace et
