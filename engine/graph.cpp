#include "engine/graph.h"

namespace et {

int Graph::add_value(Value v) {
  ET_CHECK(find_value(v.name) < 0, "duplicate value name ", v.name);
  values_.push_back(std::move(v));
  return int(values_.size()) - 1;
}

int Graph::add_node(std::string name, std::unique_ptr<Op> op, std::vector<int> inputs, Value output,
                    std::vector<Value> aux) {
  const int node_id = int(nodes_.size());
  for (int in : inputs) {
    ET_CHECK(in >= 0 && in < num_values(), "node ", name, " reads unknown value ", in);
    values_[size_t(in)].consumers.push_back(node_id);
  }
  Node n;
  n.name = name;
  n.seed_index = node_id;
  n.op = std::move(op);
  n.inputs = std::move(inputs);
  for (Value& a : aux) {
    a.kind = ValueKind::Aux;
    a.producer = node_id;
    n.aux.push_back(add_value(std::move(a)));
  }
  output.producer = node_id;
  output.kind = ValueKind::Activation;
  n.output = add_value(std::move(output));
  nodes_.push_back(std::move(n));
  return nodes_.back().output;
}

int Graph::add_aux(int node, Value aux) {
  ET_CHECK(node >= 0 && node < num_nodes(), "add_aux: node ", node);
  aux.kind = ValueKind::Aux;
  aux.producer = node;
  const int id = add_value(std::move(aux));
  nodes_[size_t(node)].aux.push_back(id);
  return id;
}

int Graph::find_value(const std::string& name) const {
  for (size_t i = 0; i < values_.size(); ++i)
    if (values_[i].name == name) return int(i);
  return -1;
}

std::vector<int> Graph::params() const {
  std::vector<int> out;
  for (size_t i = 0; i < values_.size(); ++i)
    if (values_[i].kind == ValueKind::Param) out.push_back(int(i));
  return out;
}

std::vector<int> Graph::buffers() const {
  std::vector<int> out;
  for (size_t i = 0; i < values_.size(); ++i)
    if (values_[i].kind == ValueKind::Buffer) out.push_back(int(i));
  return out;
}

}  // namespace et
