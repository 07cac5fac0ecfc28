// Graph inputs and the helpers every builder uses.
#include "layers/layers.h"

namespace et {

Value activation(const std::string& name, const Shape& s) {
  Value v;
  v.name = name;
  v.shape = s;
  v.batched = true;
  return v;
}

int add_param(Graph& g, const std::string& name, const Shape& s, ParamInit init, int64_t fan) {
  Value v;
  v.name = name;
  v.shape = s;
  v.kind = ValueKind::Param;
  v.init = init;
  v.init_fan = fan;
  v.needs_grad = true;
  return g.add_value(std::move(v));
}

int image_input(Graph& g, int64_t batch, int64_t channels, int64_t height, int64_t width) {
  Value v = activation("images", Shape{batch, channels, height, width});
  v.kind = ValueKind::Input;
  g.set_batch_size(int(batch));
  g.image_input = g.add_value(std::move(v));
  return g.image_input;
}

int label_input(Graph& g, int64_t batch) {
  Value v = activation("labels", Shape{batch});
  v.kind = ValueKind::Input;
  v.dtype = DType::I32;
  g.label_input = g.add_value(std::move(v));
  return g.label_input;
}

}  // namespace et
