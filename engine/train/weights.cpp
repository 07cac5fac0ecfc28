#include "engine/train/weights.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>

#include "engine/check.h"
#include "engine/executor.h"
#include "engine/io/safetensors.h"
#include "engine/train/checkpoint.h"

namespace et {
namespace {

// A tensor of the file, whichever format it came from.
struct FileTensor {
  std::vector<int64_t> shape;
  std::function<void(float*)> read;  // numel floats
};

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::vector<int64_t> shape_vec(const Shape& s) { return std::vector<int64_t>(s.d, s.d + s.ndim); }

bool is_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[8] = {};
  in.read(magic, 8);
  return in && std::memcmp(magic, "EDGETRN1", 8) == 0;
}

// Up to `max` names, then how many more.
std::string name_list(const std::vector<std::string>& names, size_t max = 12) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < max; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > max) out += fmt(" and ", names.size() - max, " more");
  return out;
}

}  // namespace

WeightsReport load_weights(const std::string& path, Executor& ex) {
  const Graph& g = ex.graph();
  // The file's tensors. Both readers validate sizes against the file before reading.
  std::map<std::string, FileTensor> file;
  std::unique_ptr<SafetensorsFile> st;
  std::vector<CheckpointTensor> ckpt;
  int ignored_counters = 0;
  if (is_checkpoint(path)) {
    ckpt = read_checkpoint_tensors(path, nullptr);
    for (const CheckpointTensor& t : ckpt)
      file[t.name] = {t.shape, [&t](float* out) { std::memcpy(out, t.values.data(), t.values.size() * 4); }};
  } else {
    st = std::make_unique<SafetensorsFile>(path);
    for (const SafetensorsEntry& e : st->entries()) {
      const std::string suffix = ".num_batches_tracked";
      if (e.name.size() > suffix.size() && e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        ++ignored_counters;
        continue;
      }
      file[e.name] = {e.shape, [&st, &e](float* out) { st->read_f32(e, out); }};
    }
  }

  // The classifier: the linear layer producing the logits (its weight and bias).
  std::vector<std::string> head;
  std::string head_layer;
  if (g.logits >= 0 && g.value(g.logits).producer >= 0) {
    const Node& n = g.node(g.value(g.logits).producer);
    head_layer = n.name;
    for (int v : n.inputs)
      if (g.value(v).kind == ValueKind::Param) head.push_back(g.value(v).name);
  }
  auto in_head = [&](const std::string& name) { return std::find(head.begin(), head.end(), name) != head.end(); };

  std::vector<int> model_ids = g.params();
  for (int b : g.buffers()) model_ids.push_back(b);
  std::vector<std::string> missing, unexpected, mismatched;
  std::vector<std::string> mismatched_names;
  for (int id : model_ids) {
    const Value& v = g.value(id);
    auto it = file.find(v.name);
    if (it == file.end()) missing.push_back(v.name);
    else if (it->second.shape != shape_vec(v.shape)) {
      mismatched.push_back(v.name + " (file " + shape_str(it->second.shape) + ", model " + v.shape.str() + ")");
      mismatched_names.push_back(v.name);
    }
  }
  for (const auto& [name, _] : file)
    if (g.find_value(name) < 0 || (g.value(g.find_value(name)).kind != ValueKind::Param &&
                                   g.value(g.find_value(name)).kind != ValueKind::Buffer))
      unexpected.push_back(name);

  // Head swap: only the classifier differs, and in its output size (the number of classes).
  bool head_swap = false;
  if (missing.empty() && unexpected.empty() && !mismatched_names.empty() && !head.empty()) {
    head_swap = true;
    for (const std::string& n : mismatched_names) head_swap &= in_head(n);
    const Value& w = g.value(g.find_value(head[0]));
    const auto& fw = file.at(head[0]).shape;
    head_swap &= fw.size() == size_t(w.shape.ndim) && fw.size() == 2 && fw[0] != w.shape[0] && fw[1] == w.shape[1];
  }
  if (!(missing.empty() && unexpected.empty() && mismatched.empty()) && !head_swap) {
    std::string msg = fmt("weights file '", path, "' does not fit the model:");
    if (!missing.empty()) msg += fmt(" missing ", missing.size(), ": ", name_list(missing), ";");
    if (!unexpected.empty()) msg += fmt(" unexpected ", unexpected.size(), ": ", name_list(unexpected), ";");
    if (!mismatched.empty()) msg += fmt(" shape mismatch ", mismatched.size(), ": ", name_list(mismatched), ";");
    bool shortcut_names = false;
    for (const auto* list : {&missing, &unexpected})
      for (const std::string& n : *list) shortcut_names |= n.find(".shortcut.") != std::string::npos;
    if (shortcut_names) msg += " (the shortcut tensors differ: see model.shortcut, A or B)";
    else if (!mismatched.empty() && !head.empty())
      msg += " (only a classifier with another number of classes can be swapped: model.num_classes)";
    user_error(msg);
  }

  // Everything matches: read into a staging copy first, check it is finite, then write.
  WeightsReport r;
  std::vector<std::pair<int, std::vector<float>>> staged;
  for (int id : model_ids) {
    const Value& v = g.value(id);
    if (head_swap && in_head(v.name)) continue;
    std::vector<float> buf(size_t(v.shape.numel()));
    file.at(v.name).read(buf.data());
    for (float x : buf)
      if (!std::isfinite(x)) user_error("weights file '", path, "': tensor '", v.name, "' holds a non-finite value");
    staged.emplace_back(id, std::move(buf));
  }
  for (auto& [id, buf] : staged) {
    Tensor t = ex.value(id);
    ex.backend().copy_from_host(buf.data(), t);
  }
  r.loaded = int(staged.size());
  r.head_swapped = head_swap;
  r.lines.push_back(fmt("weights: ", r.loaded, " tensors from ", path,
                        ignored_counters ? fmt(" (", ignored_counters, " BN num_batches_tracked counters ignored)") : ""));
  if (head_swap) {
    const auto& fw = file.at(head[0]).shape;
    r.lines.push_back(fmt("weights: head swap: the file's classifier '", head_layer, "' has ", fw[0],
                          " classes, the model ", g.value(g.find_value(head[0])).shape[0],
                          " (model.num_classes): ", name_list(head), " initialised anew"));
  }
  return r;
}

}  // namespace et
