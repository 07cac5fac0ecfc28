#include "engine/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "engine/check.h"
#include "engine/config_reader.h"
#include "memory/stash.h"

namespace et {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using namespace config_detail;

void apply_override(json& j, const std::string& spec, const std::string& source) {
  // Keys and bare-word values become JSON strings, which must be UTF-8 (config.json is written
  // from them; nlohmann::json throws on anything else when dumping).
  try {
    (void)json(spec).dump();
  } catch (const json::type_error&) {
    const std::string shown = json(spec).dump(-1, ' ', false, json::error_handler_t::replace);
    user_error("--set '", shown.substr(1, shown.size() - 2), "': not valid UTF-8");
  }
  const size_t eq = spec.find('=');
  if (eq == std::string::npos || eq == 0) user_error("--set '", spec, "': expected key=value");
  const std::string key = spec.substr(0, eq), text = spec.substr(eq + 1);
  json value;
  try {
    value = json::parse(text);
  } catch (const json::exception&) {  // not JSON, or a number beyond double's range
    value = text;  // bare words are strings: --set model.name=vgg16_bn
  }
  json* node = &j;
  std::stringstream ss(key);
  std::string part, walked;
  std::vector<std::string> parts;
  while (std::getline(ss, part, '.')) parts.push_back(part);
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].empty()) user_error("--set '", spec, "': empty component in key '", key, "'");
    walked += (walked.empty() ? "" : ".") + parts[i];
    if (!node->is_object()) user_error("--set '", spec, "': '", walked, "' is not inside an object");
    if (i + 1 == parts.size()) {
      (*node)[parts[i]] = value;
    } else {
      if (!node->contains(parts[i])) (*node)[parts[i]] = json::object();
      node = &(*node)[parts[i]];
    }
  }
  (void)source;
}

}  // namespace

Config parse_config(const json& j, const std::string& source) {
  Config c;
  c.source = source;
  ObjectReader top(j, "", source);
  parse_model(top, c);
  parse_data(top, c, source);
  parse_train(top, c);
  parse_memory(top, c);
  parse_fusion(top, c);
  parse_finetune(top, c);
  parse_quant(top, c);
  c.model.label_smoothing = c.train.label_smoothing;
  c.model.double_mask_bn = c.memory.double_mask_bn;
  c.model.batch = c.train.batch_size;
  top.finish();
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  if (!in) user_error("cannot open config file '", path, "'");
  std::stringstream buf;
  buf << in.rdbuf();
  return load_config_text(buf.str(), overrides, path);
}

Config load_config_text(const std::string& text, const std::vector<std::string>& overrides, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    user_error(path, ": malformed JSON at byte ", e.byte, ": ", e.what());
  } catch (const json::exception& e) {  // a number beyond double's range
    user_error(path, ": ", e.what());
  }
  for (const auto& o : overrides) apply_override(j, o, path);
  return parse_config(j, path);
}

json Config::resolved() const {
  json j;
  j["model"] = {{"name", model.name},       {"num_classes", model.num_classes},
                {"dropout", model.dropout}, {"shortcut", std::string(1, model.shortcut)},
                {"weights", weights}};
  auto or_auto = [](const auto& v, bool is_auto) { return is_auto ? json("auto") : json(v); };
  j["data"] = {{"format", data.format},
               {"root", data.root},
               {"channels", or_auto(model.channels, model.channels == 0)},
               {"height", or_auto(model.height, model.height == 0)},
               {"width", or_auto(model.width, model.width == 0)},
               {"resize", data.resize},
               {"crop_padding", data.crop_padding},
               {"hflip", data.hflip},
               {"mean", or_auto(data.mean, data.mean.empty())},
               {"std", or_auto(data.std, data.std.empty())},
               {"train_subset", data.train_subset},
               {"test_subset", data.test_subset}};
  const ScheduleConfig& s = train.schedule;
  j["train"] = {{"epochs", train.epochs},
                {"batch_size", train.batch_size},
                {"lr", train.lr},
                {"momentum", train.momentum},
                {"nesterov", train.nesterov},
                {"weight_decay", train.weight_decay},
                {"label_smoothing", train.label_smoothing},
                {"seed", train.seed},
                {"threads", train.threads},
                {"device", train.device},
                {"cuda_graph", train.cuda_graph_auto ? json("auto") : json(train.cuda_graph)},
                {"divergence_loss", train.divergence_loss},
                {"on_divergence", train.on_divergence},
                {"divergence_lr_factor", train.divergence_lr_factor},
                {"divergence_max_rollbacks", train.divergence_max_rollbacks},
                {"schedule",
                 {{"type", s.type},
                  {"milestones", s.milestones},
                  {"gamma", s.gamma},
                  {"warmup_epochs", s.warmup_epochs},
                  {"warmup_start_factor", s.warmup_start_factor},
                  {"min_lr", s.min_lr},
                  {"pct_start", s.pct_start},
                  {"div_factor", s.div_factor},
                  {"final_div_factor", s.final_div_factor}}}};
  json layers = json::object();
  for (const auto& [layer, f] : memory.layers) layers[layer] = f;
  j["memory"] = {{"stash", memory.stash}, {"layers", layers}, {"prune_threshold", memory.prune_threshold},
                 {"checkpoint_every", memory.checkpoint_every},
                 {"release_pages", memory.release_pages},
                 {"stash_headroom", memory.stash_headroom},
                 {"double_mask_bn", memory.double_mask_bn},
                 {"recompute_stack_outputs",
                  memory.recompute_stack_outputs_auto ? json("auto") : json(memory.recompute_stack_outputs)},
                 {"budget_mb", memory.budget_mb},
                 {"budget_lossy", memory.budget_lossy}};
  const FusionSpec& f = model.fusion;
  j["fusion"] = {{"enabled", f.automatic ? json("auto") : json(f.enabled)},
                 {"tile", f.tile > 0 ? json(f.tile) : json("auto")},
                 {"disable", f.disable},
                 {"cache_kb", f.cache_kb},
                 {"llc_kb", f.llc_kb},
                 {"sweep1_in_reader", f.sweep1_in_reader_auto ? json("auto") : json(f.sweep1_in_reader)},
                 {"fold_side_bn", f.fold_side_bn}};
  const FinetuneSpec& ftn = model.finetune;
  const bool keyword = ftn.trainable.size() == 1 && (ftn.trainable[0] == "all" || ftn.trainable[0] == "head" ||
                                                     ftn.trainable[0].rfind("last:", 0) == 0);
  j["finetune"] = {{"trainable", keyword ? json(ftn.trainable[0]) : json(ftn.trainable)},
                   {"bn", ftn.frozen_bn ? "frozen" : "train"}};
  json qlayers = json::object();
  for (const auto& [layer, m] : quant.layers) qlayers[layer] = m;
  j["quant"] = {{"forward", quant.forward},         {"backward", quant.backward},
                {"keep_fp32", quant.keep_fp32},     {"layers", qlayers},
                {"smp_samples", quant.smp_samples}, {"fnt_epochs", quant.fnt_epochs},
                {"fnt_peak_lr", quant.fnt_peak_lr},         {"grad_magnitudes", quant.grad_magnitudes}};
  return j;
}

StashOptions Config::stash_options(bool fnt) const {
  // FNT epochs keep no INT4 input codes (their activations are FP32): bitmap_int4 stores what it
  // would store for any f32 value there, bitmap_fp32.
  auto phase = [fnt](StashFormat f) { return fnt && f == StashFormat::BitmapI4 ? StashFormat::BitmapF32 : f; };
  StashOptions o;
  parse_stash_format(memory.stash, &o.format);
  o.format = phase(o.format);
  for (const auto& [layer, f] : memory.layers) {
    StashFormat sf;
    parse_stash_format(f, &sf);
    o.layers.emplace_back(layer, phase(sf));
  }
  o.prune_threshold = memory.prune_threshold;
  o.checkpoint_every = memory.checkpoint_every;
  o.release_pages = memory.release_pages;
  o.room_headroom = memory.stash_headroom;
  // Half of a ReLU's output is positive after a BN; a first step that keeps more runs again.
  o.first_room = memory.stash_headroom >= 0 ? 0.5 : -1;
  o.recompute_stack_outputs = memory.recompute_stack_outputs;
  return o;
}

QuantOptions Config::quant_options(bool fnt) const {
  QuantOptions o;
  o.fnt = fnt;
  parse_forward_quant(quant.forward, &o.forward);
  parse_backward_quant(quant.backward, &o.backward);
  o.keep_fp32 = quant.keep_fp32;
  for (const auto& [layer, m] : quant.layers) {
    QuantOptions::Layer l;
    l.name = layer;
    const size_t slash = m.find('/');
    parse_forward_quant(m.substr(0, slash), &l.forward);
    parse_backward_quant(m.substr(slash + 1), &l.backward);
    o.layers.push_back(l);
  }
  o.smp_samples = quant.smp_samples;
  o.grad_magnitudes = quant.grad_magnitudes;
  return o;
}

}  // namespace et
