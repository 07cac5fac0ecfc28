#include "engine/train/divergence.h"

#include <algorithm>

#include "engine/affine_relu.h"
#include "engine/executor.h"

namespace et {

namespace {

struct Scan {
  bool finite = true;
  float max_abs = 0;
};

// Diagnostics only (after a detection): the backend's own pass, where the tensor lives.
Scan scan(Backend& backend, const Tensor& t) {
  Scan s;
  if (t.dtype != DType::F32 || t.data == nullptr || t.numel() == 0) return s;
  const TensorStats st = backend.tensor_max_abs(t);
  s.finite = st.finite;
  s.max_abs = st.max_abs;
  return s;
}

// Watches a re-run of a step: the first node whose output (forward) or whose written gradients
// (backward) hold a non-finite value, and the largest activation.
class FiniteWatch : public NodeObserver {
 public:
  explicit FiniteWatch(Executor& ex) : ex_(ex) {}
  void after_forward(int n) override {
    if (bad_node >= 0) return;
    // Scales in the backend's memory: a quantizer of this node that met a non-finite operand
    // throws here, as it would have thrown in the node (before its output).
    ex_.check_quant_finite();
    const Node& node = ex_.graph().node(n);
    const Tensor y = ex_.value(node.output);
    if (y.dtype == DType::AffineRelu) {
      // Computed by its readers: no values of its own to scan. It is relu(x * scale + shift) of
      // an input scanned at its producer, so this node turns it non-finite through its
      // coefficients (its parameters and statistics).
      const auto& src = *static_cast<const AffineReluSource*>(y.data);
      const Shape c{y.dim(1)};
      const Device d = ex_.backend().device();
      if (!scan(ex_.backend(), Tensor::contiguous(const_cast<float*>(src.scale), c, DType::F32, d)).finite ||
          !scan(ex_.backend(), Tensor::contiguous(const_cast<float*>(src.shift), c, DType::F32, d)).finite)
        bad_node = n;
      return;
    }
    const Scan s = scan(ex_.backend(), y);
    if (!s.finite) {
      bad_node = n;
      return;
    }
    if (node.output != ex_.graph().loss && s.max_abs >= largest_abs) {
      largest_abs = s.max_abs;
      largest = n;
    }
  }
  void after_backward(int n) override {
    if (bad_node >= 0) return;
    ex_.check_quant_finite();
    // A node runs its backward iff one of its inputs needs a gradient, and then writes all of them.
    for (int id : ex_.graph().node(n).inputs)
      if (ex_.graph().value(id).needs_grad && !scan(ex_.backend(), ex_.grad(id)).finite) {
        bad_node = n;
        bad_grad = id;
        return;
      }
  }
  int bad_node = -1, bad_grad = -1, largest = -1;
  float largest_abs = 0;

 private:
  Executor& ex_;
};

// The node a parameter belongs to (its consumer).
std::string owner(const Graph& g, int param) {
  const Value& v = g.value(param);
  return v.consumers.empty() ? v.name : g.node(v.consumers.front()).name;
}

}  // namespace

bool gradients_finite(Executor& ex) { return ex.backend().all_finite(ex.param_grads()); }

const char* divergence_cause_name(DivergenceCause c) {
  switch (c) {
    case DivergenceCause::None: return "none";
    case DivergenceCause::NonFiniteLoss: return "non_finite_loss";
    case DivergenceCause::LossAboveBound: return "loss_above_bound";
    case DivergenceCause::NonFiniteValue: return "non_finite_value";
    case DivergenceCause::NonFiniteGradient: return "non_finite_gradient";
    case DivergenceCause::NonFiniteUpdate: return "non_finite_update";
  }
  return "?";
}

std::string Divergence::describe() const {
  std::string s;
  switch (cause) {
    case DivergenceCause::None: s = "no divergence"; break;
    case DivergenceCause::NonFiniteLoss: s = fmt("loss ", loss, " (non-finite)"); break;
    case DivergenceCause::LossAboveBound: s = fmt("loss ", loss, " above train.divergence_loss = ", bound); break;
    case DivergenceCause::NonFiniteValue:
      s = loss_known ? fmt("loss ", loss, ", then a quantizer met a non-finite value")
                     : "a quantizer met a non-finite value before the loss";
      break;
    case DivergenceCause::NonFiniteGradient: s = fmt("loss ", loss, ", but a non-finite parameter gradient"); break;
    case DivergenceCause::NonFiniteUpdate:
      s = fmt("loss ", loss, ", then the SGD update made a parameter non-finite");
      break;
  }
  if (!layer.empty()) s += fmt("; first non-finite value: layer '", layer, "', ", where);
  else s += "; layer: none (no non-finite value)";
  if (!detail.empty()) s += fmt(" [", detail, "]");
  return s;
}

void locate_in_step(Executor& ex, int64_t batch, Divergence& d) {
  const Graph& g = ex.graph();
  FiniteWatch w(ex);
  ex.set_observer(&w);
  std::string thrown_layer;
  try {
    ex.forward(batch, true);
    if (w.bad_node < 0) ex.backward();
  } catch (const NonFiniteError& e) {  // a quantizer: the layer that met it, if no node saw one earlier
    thrown_layer = e.layer;
    if (d.detail.empty()) d.detail = e.what();
  } catch (...) {
    ex.set_observer(nullptr);
    throw;
  }
  ex.set_observer(nullptr);
  if (w.bad_node >= 0) {
    const Node& node = g.node(w.bad_node);
    d.layer = node.name;
    if (w.bad_grad < 0) {
      d.where = "its output in the forward";
      for (int id : node.inputs)
        if (g.value(id).kind == ValueKind::Param && !scan(ex.backend(), ex.value(id)).finite)
          d.where += fmt(" (its parameter '", g.value(id).name, "' is non-finite)");
    } else {
      const Value& v = g.value(w.bad_grad);
      d.where = fmt("the gradient of its ", v.kind == ValueKind::Param ? "parameter" : "input", " '", v.name,
                    "' in the backward");
    }
  } else if (!thrown_layer.empty()) {
    d.layer = thrown_layer;
    d.where = "met by its quantizer";
  } else if (d.detail.empty() && w.largest >= 0) {
    d.detail = fmt("every value of the step is finite; the largest activation is the output of layer '",
                   g.node(w.largest).name, "', |x| up to ", w.largest_abs);
  }
}

void locate_in_update(const Executor& ex, float lr, Divergence& d) {
  const Graph& g = ex.graph();
  const std::vector<int>& ps = ex.params();
  // Backward order: parameters are created in forward order.
  for (auto it = ps.rbegin(); it != ps.rend(); ++it)
    if (!scan(ex.backend(), ex.grad(*it)).finite) {
      d.layer = owner(g, *it);
      d.where = fmt("the gradient of its parameter '", g.value(*it).name, "' in the backward");
      return;
    }
  for (int p : ps)
    if (!scan(ex.backend(), ex.value(p)).finite) {
      d.layer = owner(g, p);
      d.where = fmt("its parameter '", g.value(p).name, "', made non-finite by the SGD update (lr ", lr,
                    ") from finite gradients");
      return;
    }
}

}  // namespace et
