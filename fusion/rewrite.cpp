// Rewriting a graph so that each fused stack is one node (fusion::apply). The new graph is built
// by replaying the old one: values in their old order (so parameters and buffers keep the order
// checkpoints use), each node as it was except that a stack's members become one FusedStackOp at
// the place of its last member (where every input it reads has been produced). The stack's
// intermediate values are not created at all.
#include "fusion/fusion.h"

namespace et {
namespace fusion {

namespace {
Value fresh(const Value& v) {
  Value c = v;
  c.consumers.clear();
  c.producer = -1;
  return c;
}
}  // namespace

void apply(Graph& g, const Plan& p) {
  const int nn = g.num_nodes(), nv = g.num_values();
  std::vector<int> stack_of(size_t(nn), -1);
  std::vector<uint8_t> is_last(size_t(nn), 0);
  for (size_t s = 0; s < p.stacks.size(); ++s) {
    if (!p.stacks[s].fused) continue;
    for (int n : p.stacks[s].nodes) stack_of[size_t(n)] = int(s);
    is_last[size_t(p.stacks[s].nodes.back())] = 1;
  }
  Graph ng;
  ng.build = g.build;
  ng.set_batch_size(g.batch_size());
  std::vector<int> vmap(size_t(nv), -1);
  // Readers taking a stack's first backward sweep (StackPlan::sweep1_to_reader): for the reader's
  // old node id, the stack's mean and the aux value the reader writes the sums to (new value ids).
  struct Sweep1Inputs {
    int mean = -1, sums = -1, x = -1, y_bits = -1;
    bool relu = true;
  };
  std::vector<Sweep1Inputs> sweep1_of(static_cast<size_t>(nn));
  int next_free = 0;
  // Inputs, parameters and buffers created before value `upto`, in their old order.
  auto add_free_values = [&](int upto) {
    for (; next_free < upto; ++next_free)
      if (g.value(next_free).producer < 0) vmap[size_t(next_free)] = ng.add_value(fresh(g.value(next_free)));
  };
  auto mapped = [&](const std::vector<int>& ids) {
    std::vector<int> out;
    for (int id : ids) {
      ET_CHECK(vmap[size_t(id)] >= 0, "fusion rewrite: value ", g.value(id).name, " read before it is made");
      out.push_back(vmap[size_t(id)]);
    }
    return out;
  };
  for (int n = 0; n < nn; ++n) {
    Node& node = g.node(n);
    const int s = stack_of[size_t(n)];
    if (s >= 0 && !is_last[size_t(n)]) continue;
    add_free_values(node.output);
    if (s < 0) {
      std::vector<Value> aux;
      for (int a : node.aux) aux.push_back(fresh(g.value(a)));
      std::vector<int> inputs = mapped(node.inputs);
      const Sweep1Inputs& sw = sweep1_of[size_t(n)];
      if (sw.sums >= 0) {
        TakenSweep1 t;
        t.mean_input = int(inputs.size());
        t.sums_input = t.mean_input + 1;
        t.stack_x = sw.x;
        t.relu = sw.relu;
        if (sw.y_bits >= 0) t.y_bits_input = t.sums_input + 1;
        node.op->take_dz_sums(t);
        inputs.push_back(sw.mean);
        inputs.push_back(sw.sums);
        if (sw.y_bits >= 0) inputs.push_back(sw.y_bits);
      }
      const int out = ng.add_node(node.name, std::move(node.op), std::move(inputs), fresh(g.value(node.output)),
                                  std::move(aux));
      Node& added = ng.node(ng.num_nodes() - 1);
      added.seed_index = node.seed_index;
      vmap[size_t(node.output)] = out;
      for (size_t i = 0; i < node.aux.size(); ++i) vmap[size_t(node.aux[i])] = added.aux[i];
      continue;
    }
    const StackPlan& sp = p.stacks[size_t(s)];
    const Node& head = g.node(sp.nodes.front());
    std::vector<int> inputs = head.inputs;  // x, gamma, beta, running_mean, running_var (BN) or x
    if (sp.side >= 0) inputs.push_back(sp.side);
    std::vector<Value> aux;
    for (int a : head.aux) aux.push_back(fresh(g.value(a)));
    // A folded side BN (FusedStack::side_bn): its gamma, beta and running statistics after x2, its
    // batch statistics (mean, invstd) after the head's.
    const Node* side_bn = sp.stack.side_bn ? &g.node(sp.side_bn_node) : nullptr;
    if (side_bn) {
      ET_CHECK(side_bn->inputs.size() == 5 && side_bn->aux.size() == 2 && head.aux.size() == 2,
               "fusion rewrite: the side BN of ", sp.name);
      inputs.insert(inputs.end(), side_bn->inputs.begin() + 1, side_bn->inputs.end());
      for (int a : side_bn->aux) aux.push_back(fresh(g.value(a)));
    }
    if (!sp.stack.headed_by_bn()) {  // the pass bits, from the forward to the backward
      Value pass;
      pass.name = sp.name + ".pass";
      pass.dtype = DType::U8;
      pass.batched = true;
      pass.shape = Shape{g.batch_size(), sp.stack.C * pass_words_per_plane(sp.stack.stages[0]) * 8};
      aux.push_back(std::move(pass));
    }
    std::vector<std::string> members;
    for (int m : sp.nodes) members.push_back(g.node(m).name);
    std::vector<int> new_inputs = mapped(inputs);
    // BN's statistics from sums the producer of input `of` writes (a conv's epilogue, the stack
    // before): one more input, an aux value of the producer that lives until this forward has read
    // it. Returns that input's index.
    auto sums_from_producer = [&](size_t of, const char* suffix) {
      const int producer = ng.value(new_inputs[of]).producer;
      ET_CHECK(producer >= 0 && ng.node(producer).op->can_write_plane_sums(), "fusion rewrite: sums of ", sp.name,
               suffix);
      ng.node(producer).op->write_plane_sums(int(ng.node(producer).aux.size()));
      Value sums;
      sums.name = sp.name + suffix;
      sums.shape = Shape{2, g.batch_size(), sp.stack.C};
      sums.forward_only = true;
      new_inputs.push_back(ng.add_aux(producer, std::move(sums)));
      return int(new_inputs.size()) - 1;
    };
    const int sums_input = sp.sums_from_producer ? sums_from_producer(0, ".x_sums") : -1;
    // The same for a folded side BN's x2, the input after the head BN's (StackPlan::side_sums_from_producer).
    const int side_sums_input =
        sp.side_sums_from_producer ? sums_from_producer(head.inputs.size(), ".side_x_sums") : -1;
    // BN's second backward sweep handed on to the stack before (StackPlan::sweep_to_producer): its
    // coefficients in an aux value of that stack, which lives until its backward.
    int coef_producer = -1, coef_aux = -1, coef_input = -1;
    if (sp.sweep_to_producer) {
      coef_producer = ng.value(new_inputs[0]).producer;
      ET_CHECK(coef_producer >= 0 && sp.producer_stack >= 0, "fusion rewrite: no stack before ", sp.name);
      Value coef;
      coef.name = sp.name + ".dy_coef";
      coef.shape = Shape{dy_coef_floats(sp.stack.C)};
      coef_aux = int(ng.node(coef_producer).aux.size());
      coef_input = int(new_inputs.size());
      new_inputs.push_back(ng.add_aux(coef_producer, std::move(coef)));
    }
    // BN's first backward sweep done by y's reader (StackPlan::sweep1_to_reader): the sums and the
    // flag in an aux value of this stack, which the reader writes in its backward.
    int dz_sums_aux = -1;
    if (sp.sweep1_to_reader) {
      Value sums;
      sums.name = sp.name + ".dz_sums";
      sums.shape = Shape{dz_sums_floats(g.batch_size(), sp.stack.C)};
      sums.backward_only = true;  // written by the reader's backward, its flag too (Conv2d::backward)
      dz_sums_aux = int(aux.size());
      aux.push_back(std::move(sums));
    }
    // Where the stack ends in an add and a ReLU (y kept, its mask y > 0), y's bitmap for the first
    // sweep, the reader's or its own, written by this forward (planes of whole 64-bit words, as
    // the forward writes them), an aux value of this stack until its backward: the sweep reads 1
    // bit an element for the mask instead of y's float.
    int y_bits_aux = -1;
    const FusedStage& last = sp.stack.last();
    if (sp.y_bits) {
      Value bits;
      bits.name = sp.name + ".y_bits";
      bits.shape = Shape{y_bits_floats(g.batch_size(), sp.stack.C, last.P * last.Q)};
      y_bits_aux = int(aux.size());
      aux.push_back(std::move(bits));
    }
    std::unique_ptr<Op> op = make_fused_op(sp.stack, members, sums_input, dz_sums_aux, y_bits_aux, side_sums_input);
    if (coef_input >= 0)
      hand_sweep_on(*ng.node(coef_producer).op, *op, p.stacks[size_t(sp.producer_stack)].stack, coef_aux, coef_input);
    const int out =
        ng.add_node(sp.name, std::move(op), std::move(new_inputs), fresh(g.value(sp.output)), std::move(aux));
    Node& added = ng.node(ng.num_nodes() - 1);
    // A dropout member draws its mask from its own seed (OpContext::seed): the fused node takes it.
    added.seed_index = head.seed_index;
    for (int m : sp.nodes)
      if (g.node(m).op->fusion_stage().kind == FusedKind::Dropout) added.seed_index = g.node(m).seed_index;
    vmap[size_t(sp.output)] = out;
    for (size_t i = 0; i < head.aux.size(); ++i) vmap[size_t(head.aux[i])] = added.aux[i];
    if (side_bn)
      for (size_t i = 0; i < side_bn->aux.size(); ++i) vmap[size_t(side_bn->aux[i])] = added.aux[head.aux.size() + i];
    if (dz_sums_aux >= 0) {
      ET_CHECK(sp.reader_node > n, "fusion rewrite: the reader of ", sp.name, " comes before it");
      sweep1_of[size_t(sp.reader_node)] = {added.aux[0], added.aux[size_t(dz_sums_aux)], added.inputs[0],
                                           y_bits_aux >= 0 ? added.aux[size_t(y_bits_aux)] : -1,
                                           sp.stack.last().kind == FusedKind::Relu};
    }
  }
  add_free_values(nv);
  auto remap = [&](int id) { return id < 0 ? id : vmap[size_t(id)]; };
  ng.image_input = remap(g.image_input);
  ng.label_input = remap(g.label_input);
  ng.logits = remap(g.logits);
  ng.loss = remap(g.loss);
  g = std::move(ng);
}

}  // namespace fusion
}  // namespace et
