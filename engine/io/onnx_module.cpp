// libedgetrain_onnx.so: the ONNX export's graph building and checking (engine/io/onnx_export.h), the
// only code that includes and links ONNX and protobuf; loaded by engine/io/onnx_export.cpp with dlopen
// (engine/io/onnx_module.h). It uses edgetrain's headers' inline code only, not its library: shapes
// are counted and printed here, the file is written by the caller.
#include <onnx/checker.h>
#include <onnx/defs/schema.h>
#include <onnx/onnx_pb.h>
#include <onnx/shape_inference/implementation.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "engine/check.h"
#include "engine/io/onnx_module.h"

namespace et {
namespace {

constexpr int64_t kOpset = 13;
constexpr int64_t kIrVersion = 7;  // the IR of opsets 13 and 14 (onnx/docs/Versioning.md)
constexpr const char* kBatch = "N";

// Shape's out-of-line members live in edgetrain's library, which the module does not link.
int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int i = 0; i < s.ndim; ++i) n *= s.d[i];
  return n;
}
std::string str(const Shape& s) {
  std::string out = "[";
  for (int i = 0; i < s.ndim; ++i) out += (i ? ", " : "") + std::to_string(s.d[i]);
  return out + "]";
}
Shape shape(std::initializer_list<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) s.d[s.ndim++] = d;
  return s;
}

// Builds the ModelProto: values are named after the engine's (a node's output by the node's name,
// params by theirs), so a message or a runtime's profile points at the layer it came from.
class Builder {
 public:
  Builder(const Graph& g, const std::function<Tensor(int)>& value, const OnnxExportOptions& o)
      : g_(g), value_(value), o_(o), names_(size_t(g.num_values())) {
    graph_ = model_.mutable_graph();
  }

  onnx::ModelProto build(OnnxExportReport* report) {
    model_.set_ir_version(kIrVersion);
    model_.set_producer_name("edgetrain");
    model_.set_model_version(1);
    model_.set_doc_string(o_.doc);
    auto* opset = model_.add_opset_import();
    opset->set_domain("");
    opset->set_version(kOpset);
    for (const auto& [k, v] : o_.metadata) {
      auto* p = model_.add_metadata_props();
      p->set_key(k);
      p->set_value(v);
    }
    graph_->set_name(o_.graph_name);

    if (g_.image_input < 0 || g_.logits < 0) user_error("ONNX export: the graph has no image input or no logits");
    const Shape in = g_.value(g_.image_input).shape;
    if (in.ndim != 4) user_error("ONNX export: the image input is ", str(in), ", not NCHW");
    add_io(graph_->add_input(), "input", in);
    names_[size_t(g_.image_input)] = normalisation("input", in[1]);

    folded_.assign(size_t(g_.num_nodes()), 0);
    for (int n = 0; n < g_.num_nodes(); ++n) {
      if (folded_[size_t(n)]) continue;
      node(n);
    }
    const std::string& logits = names_[size_t(g_.logits)];
    ET_CHECK(!logits.empty(), "the logits were not exported");
    if (logits != "logits") emit("Identity", "logits", {logits}, "logits");
    add_io(graph_->add_output(), "logits", g_.value(g_.logits).shape);

    report->opset = kOpset;
    report->ir_version = kIrVersion;
    report->nodes = graph_->node_size();
    report->folded_bn = folded_bn_;
    report->weights = weights_;
    return std::move(model_);
  }

  // The engine's shape of every exported value, by ONNX name (batch first), for the shape check.
  const std::map<std::string, Shape>& expected_shapes() const { return expected_; }

 private:
  using Attr = onnx::AttributeProto;

  void add_io(onnx::ValueInfoProto* v, const std::string& name, const Shape& s) {
    v->set_name(name);
    auto* t = v->mutable_type()->mutable_tensor_type();
    t->set_elem_type(onnx::TensorProto::FLOAT);
    auto* shape = t->mutable_shape();
    for (int i = 0; i < s.ndim; ++i) {
      auto* d = shape->add_dim();
      if (i == 0) d->set_dim_param(kBatch);
      else d->set_dim_value(s[i]);
    }
  }

  onnx::NodeProto* emit(const std::string& op, const std::string& name, const std::vector<std::string>& inputs,
                        const std::string& output) {
    auto* n = graph_->add_node();
    n->set_op_type(op);
    n->set_name(name);
    for (const std::string& i : inputs) n->add_input(i);
    n->add_output(output);
    return n;
  }

  static void ints(onnx::NodeProto* n, const char* name, const std::vector<int64_t>& v) {
    Attr* a = n->add_attribute();
    a->set_name(name);
    a->set_type(Attr::INTS);
    for (int64_t x : v) a->add_ints(x);
  }
  static void integer(onnx::NodeProto* n, const char* name, int64_t v) {
    Attr* a = n->add_attribute();
    a->set_name(name);
    a->set_type(Attr::INT);
    a->set_i(v);
  }
  static void real(onnx::NodeProto* n, const char* name, float v) {
    Attr* a = n->add_attribute();
    a->set_name(name);
    a->set_type(Attr::FLOAT);
    a->set_f(v);
  }

  // A float initializer; returns its name.
  const std::string& initializer(const std::string& name, const std::vector<int64_t>& dims, const float* data) {
    ET_CHECK(initialized_.insert(name).second, "initializer '", name, "' twice");
    auto* t = graph_->add_initializer();
    t->set_name(name);
    t->set_data_type(onnx::TensorProto::FLOAT);
    int64_t n = 1;
    for (int64_t d : dims) {
      t->add_dims(d);
      n *= d;
    }
    t->set_raw_data(data, size_t(n) * sizeof(float));  // little-endian, as ONNX's raw_data is
    weights_ += n;
    return t->name();
  }
  const std::string& int64_initializer(const std::string& name, const std::vector<int64_t>& v) {
    ET_CHECK(initialized_.insert(name).second, "initializer '", name, "' twice");
    auto* t = graph_->add_initializer();
    t->set_name(name);
    t->set_data_type(onnx::TensorProto::INT64);
    t->add_dims(int64_t(v.size()));
    for (int64_t x : v) t->add_int64_data(x);
    return t->name();
  }
  // A param or buffer of the engine's graph as an initializer under its own name.
  const std::string& tensor(int id) {
    const Value& v = g_.value(id);
    if (initialized_.count(v.name)) return v.name;
    const Tensor t = value_(id);
    ET_CHECK(t.defined() && t.dtype == DType::F32 && numel(t.shape) == numel(v.shape), "value '", v.name, "'");
    std::vector<int64_t> dims(v.shape.d, v.shape.d + v.shape.ndim);
    return initializer(v.name, dims, t.f32());
  }
  std::vector<float> values(int id) const {
    const Tensor t = value_(id);
    ET_CHECK(t.defined() && t.dtype == DType::F32 && numel(t.shape) == numel(g_.value(id).shape), "value '",
             g_.value(id).name, "'");
    return std::vector<float>(t.f32(), t.f32() + numel(t.shape));
  }

  // (x - mean) / std per channel; returns the name of the normalised images.
  std::string normalisation(const std::string& x, int64_t C) {
    for (const auto* v : {&o_.mean, &o_.std})
      if (!v->empty() && int64_t(v->size()) != C)
        user_error("ONNX export: ", v->size(), " normalisation values (data.mean / data.std) for ", C, "-channel images");
    std::vector<float> mean(size_t(C), 0.f), std(size_t(C), 1.f);
    if (!o_.mean.empty()) mean = o_.mean;
    if (!o_.std.empty()) std = o_.std;
    bool identity = true;
    for (int64_t c = 0; c < C; ++c) {
      if (!(std[size_t(c)] > 0.f)) user_error("ONNX export: data.std of channel ", c, " is ", std[size_t(c)]);
      identity = identity && mean[size_t(c)] == 0.f && std[size_t(c)] == 1.f;
    }
    if (identity) return x;
    // [C, 1, 1]: broadcast over N, H, W (OpenCV's importer maps a constant of this rank, not of
    // rank 4, to a per-channel scale).
    const std::string& m = initializer("normalize.mean", {C, 1, 1}, mean.data());
    const std::string& s = initializer("normalize.std", {C, 1, 1}, std.data());
    emit("Sub", "normalize.sub", {x, m}, "normalize.centered");
    emit("Div", "normalize.div", {"normalize.centered", s}, "images");
    expected_["normalize.centered"] = expected_["images"] = g_.value(g_.image_input).shape;
    return "images";
  }

  const std::string& in(const Node& n, int i) const {
    const std::string& s = names_[size_t(n.inputs.at(size_t(i)))];
    ET_CHECK(!s.empty(), "layer '", n.name, "': input ", i, " was not exported");
    return s;
  }
  // Names node n's output (and, for a folded BN, that of `alias_of` too) and records its shape.
  const std::string& out(int value, const std::string& name) {
    names_[size_t(value)] = value == g_.logits ? "logits" : name;
    expected_[names_[size_t(value)]] = g_.value(value).shape;
    return names_[size_t(value)];
  }

  // The BN that reads only this conv's output, if it can be folded into the conv.
  int foldable_bn(int conv) const {
    if (!o_.fold_bn) return -1;
    const Value& y = g_.value(g_.node(conv).output);
    if (y.consumers.size() != 1 || y.producer != conv || g_.node(conv).output == g_.logits) return -1;
    const int bn = y.consumers[0];
    const Node& b = g_.node(bn);
    if (std::strcmp(b.op->type(), "batchnorm2d") != 0 || b.inputs[0] != g_.node(conv).output) return -1;
    return b.op->attributes().masked ? -1 : bn;
  }

  void conv(int id, const Node& n) {
    const Conv2dGeom w = n.op->attributes().window;
    const int bn = foldable_bn(id);
    std::vector<std::string> inputs = {in(n, 0)};
    int output = n.output;
    std::string name = n.name;
    if (bn < 0) {
      inputs.push_back(tensor(n.inputs[1]));
      if (n.inputs.size() > 2) inputs.push_back(tensor(n.inputs[2]));
    } else {
      // y = gamma (conv(x) + b - mean) / sqrt(var + eps) + beta = conv(x; W s) + (b - mean) s + beta
      const Node& b = g_.node(bn);
      const double eps = b.op->attributes().eps;
      const std::vector<float> W = values(n.inputs[1]), gamma = values(b.inputs[1]), beta = values(b.inputs[2]),
                               mean = values(b.inputs[3]), var = values(b.inputs[4]);
      const std::vector<float> bias = n.inputs.size() > 2 ? values(n.inputs[2]) : std::vector<float>(gamma.size(), 0.f);
      const size_t K = gamma.size(), per = W.size() / K;
      std::vector<float> Wf(W.size()), bf(K);
      for (size_t k = 0; k < K; ++k) {
        const double s = double(gamma[k]) / std::sqrt(double(var[k]) + eps);
        for (size_t i = 0; i < per; ++i) Wf[k * per + i] = float(double(W[k * per + i]) * s);
        bf[k] = float((double(bias[k]) - double(mean[k])) * s + double(beta[k]));
      }
      const Shape ws = g_.value(n.inputs[1]).shape;
      inputs.push_back(initializer(n.name + ".weight", {ws[0], ws[1], ws[2], ws[3]}, Wf.data()));
      inputs.push_back(initializer(n.name + ".bias", {int64_t(K)}, bf.data()));
      folded_[size_t(bn)] = 1;
      ++folded_bn_;
      output = b.output;
      name = n.name + "+" + b.name;
    }
    onnx::NodeProto* c = emit("Conv", name, inputs, out(output, g_.node(g_.value(output).producer).name));
    ints(c, "kernel_shape", {w.R, w.S});
    ints(c, "strides", {w.stride_h, w.stride_w});
    ints(c, "pads", {w.pad_h, w.pad_w, w.pad_h, w.pad_w});
    ints(c, "dilations", {1, 1});
    integer(c, "group", w.groups);
  }

  void pool(const Node& n, const char* op) {
    const Conv2dGeom w = n.op->attributes().window;
    onnx::NodeProto* p = emit(op, n.name, {in(n, 0)}, out(n.output, n.name));
    ints(p, "kernel_shape", {w.R, w.S});
    ints(p, "strides", {w.stride_h, w.stride_w});
    ints(p, "pads", {w.pad_h, w.pad_w, w.pad_h, w.pad_w});
    if (std::strcmp(op, "AveragePool") == 0) integer(p, "count_include_pad", 1);  // as avgpool2d divides
  }

  void node(int id) {
    const Node& n = g_.node(id);
    const std::string type = n.op->type();
    const OpClass cls = n.op->op_class();
    if (cls == OpClass::Loss) return;  // training only
    if (type == "conv2d") {
      conv(id, n);
    } else if (type == "batchnorm2d") {
      if (n.op->attributes().masked)
        user_error("layer '", n.name, "': memory.double_mask_bn (BN masked by its input's zeros) has no ONNX export; "
                   "export a model trained without it");
      onnx::NodeProto* b = emit("BatchNormalization", n.name,
                                {in(n, 0), tensor(n.inputs[1]), tensor(n.inputs[2]), tensor(n.inputs[3]), tensor(n.inputs[4])},
                                out(n.output, n.name));
      real(b, "epsilon", n.op->attributes().eps);
    } else if (type == "relu") {
      emit("Relu", n.name, {in(n, 0)}, out(n.output, n.name));
    } else if (type == "add") {
      emit("Add", n.name, {in(n, 0), in(n, 1)}, out(n.output, n.name));
    } else if (type == "maxpool2d") {
      pool(n, "MaxPool");
    } else if (type == "avgpool2d") {
      pool(n, "AveragePool");
    } else if (type == "global_avgpool") {
      // [N, C, H, W] -> [N, C, 1, 1] -> [N, C]
      const Shape s = g_.value(n.output).shape;
      emit("GlobalAveragePool", n.name, {in(n, 0)}, n.name + ".pooled");
      expected_[n.name + ".pooled"] = shape({s[0], s[1], 1, 1});
      integer(emit("Flatten", n.name + ".flatten", {n.name + ".pooled"}, out(n.output, n.name)), "axis", 1);
    } else if (type == "flatten") {
      integer(emit("Flatten", n.name, {in(n, 0)}, out(n.output, n.name)), "axis", 1);
    } else if (type == "linear") {
      std::vector<std::string> inputs = {in(n, 0), tensor(n.inputs[1])};
      if (n.inputs.size() > 2) inputs.push_back(tensor(n.inputs[2]));
      integer(emit("Gemm", n.name, inputs, out(n.output, n.name)), "transB", 1);  // y = x W^T + b
    } else if (type == "dropout") {
      names_[size_t(n.output)] = in(n, 0);  // identity in inference
    } else if (type == "subsample_pad") {
      // x[:, :, ::s, ::s], then (K - C) / 2 zero channels before and the rest after
      const OpAttributes a = n.op->attributes();
      const Shape x = g_.value(n.inputs[0]).shape, y = g_.value(n.output).shape;
      const int64_t before = a.pad_channels, after = y[1] - x[1] - before;
      const std::string sliced = n.name + ".subsampled";
      emit("Slice", n.name + ".slice",
           {in(n, 0), int64_initializer(n.name + ".starts", {0, 0}), int64_initializer(n.name + ".ends", {x[2], x[3]}),
            int64_initializer(n.name + ".axes", {2, 3}), int64_initializer(n.name + ".steps", {a.stride, a.stride})},
           sliced);
      expected_[sliced] = shape({y[0], x[1], y[2], y[3]});
      const float zero = 0.f;
      onnx::NodeProto* p = emit("Pad", n.name + ".pad",
                                {sliced, int64_initializer(n.name + ".pads", {0, before, 0, 0, 0, after, 0, 0}),
                                 initializer(n.name + ".zero", {}, &zero)},
                                out(n.output, n.name));
      Attr* m = p->add_attribute();
      m->set_name("mode");
      m->set_type(Attr::STRING);
      m->set_s("constant");
    } else if (type == "fused_stack") {
      user_error("layer '", n.name, "' is a fused stack (fusion.enabled): export the model built without fusion");
    } else {
      user_error("layer '", n.name, "': op '", type, "' has no ONNX export");
    }
  }

  const Graph& g_;
  const std::function<Tensor(int)>& value_;
  const OnnxExportOptions& o_;
  onnx::ModelProto model_;
  onnx::GraphProto* graph_ = nullptr;
  std::vector<std::string> names_;  // ONNX name of each engine value ("" = not exported)
  std::vector<uint8_t> folded_;     // BN nodes folded into their conv
  std::set<std::string> initialized_;
  std::map<std::string, Shape> expected_;
  int folded_bn_ = 0;
  int64_t weights_ = 0;
};

std::string shape_str(const onnx::TensorShapeProto& s) {
  std::string out = "[";
  for (int i = 0; i < s.dim_size(); ++i) {
    if (i) out += ", ";
    out += s.dim(i).has_dim_value() ? std::to_string(s.dim(i).dim_value()) : s.dim(i).dim_param();
  }
  return out + "]";
}

// ONNX's checker, then strict shape inference on a copy: every value's inferred shape must be the
// engine's (batch symbolic). Returns what is wrong, "" if nothing.
std::string verify(const onnx::ModelProto& model, const std::map<std::string, Shape>& expected) {
  try {
    onnx::checker::check_model(model);
    onnx::ModelProto inferred = model;
    onnx::shape_inference::InferShapes(inferred, onnx::OpSchemaRegistry::Instance(),
                                       onnx::ShapeInferenceOptions(/*check_type=*/true, /*strict=*/1, false));
    std::map<std::string, const onnx::ValueInfoProto*> infos;
    for (const auto& v : inferred.graph().value_info()) infos[v.name()] = &v;
    for (const auto& v : inferred.graph().output()) infos[v.name()] = &v;
    for (const auto& [name, s] : expected) {
      const auto it = infos.find(name);
      if (it == infos.end() || !it->second->type().tensor_type().has_shape())
        return "shape inference gave no shape for '" + name + "'";
      const onnx::TensorShapeProto& is = it->second->type().tensor_type().shape();
      bool same = is.dim_size() == s.ndim && is.dim(0).dim_param() == kBatch;
      for (int i = 1; same && i < s.ndim; ++i) same = is.dim(i).has_dim_value() && is.dim(i).dim_value() == s[i];
      if (!same) return "'" + name + "' has the shape " + shape_str(is) + " in ONNX, " + str(s) + " in edgetrain";
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace
}  // namespace et

using namespace et;

extern "C" __attribute__((visibility("default"))) int edgetrain_onnx_abi() { return onnx_module::kAbi; }

extern "C" __attribute__((visibility("default"))) void edgetrain_onnx_build(const onnx_module::BuildArgs* a,
                                                                            onnx_module::BuildResult* r) {
  try {
    GOOGLE_PROTOBUF_VERIFY_VERSION;
    const std::string& path = *a->path;
    Builder b(*a->graph, *a->value, *a->options);
    const onnx::ModelProto model = b.build(&r->report);
    const std::string problem = verify(model, b.expected_shapes());
    if (!problem.empty())
      user_error("the ONNX graph of '", path, "' fails ONNX's checks (nothing written; an edgetrain bug, please ",
                 "report): ", problem);
    if (model.ByteSizeLong() > size_t(INT_MAX))
      user_error("cannot write '", path, "': the model is ", model.ByteSizeLong() >> 20,
                 " MB, over protobuf's 2 GB (ONNX external data is not supported)");
    if (!model.SerializeToString(&r->bytes)) user_error("cannot serialise the ONNX model for '", path, "'");
  } catch (const std::bad_alloc&) {
    r->error = "out of memory while building the ONNX model of '" + *a->path + "'";
  } catch (const std::exception& e) {  // UserError, and whatever ONNX or protobuf throw
    r->error = e.what();
  }
  if (!r->error.empty()) r->bytes.clear();
}

extern "C" __attribute__((visibility("default"))) void edgetrain_onnx_check_file(const char* path, std::string* error) {
  try {
    onnx::checker::check_model(std::string(path));
  } catch (const std::exception& e) {
    *error = e.what();
  }
}
