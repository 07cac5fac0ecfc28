// Memory budget planner (engine/budget.h): calibration, prediction, search.
#include "engine/budget.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "engine/check.h"
#include "engine/host_view.h"
#include "memory/uss.h"

namespace et {

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kMB = 1048576.0;

// What calibration measured (per value id / node index of the graph).
struct Calibration {
  std::vector<double> forward_s;   // per node, per step
  std::vector<double> nonzero;     // per value: measured fraction (values stored with a bitmap), else 1
  double overhead_bytes = 0;
};

// What a budget bounds on `backend`: the process's USS where the backend's memory is the host's,
// else the device's memory in use as its driver reports it (a GPU: cudaMemGetInfo; on a Jetson,
// system memory the GPU holds, which the process's USS does not show).
bool budgets_device(Backend& backend) {
  size_t used = 0, total = 0;
  return backend.memory().usage(&used, &total);
}
size_t device_used(Backend& backend) {
  size_t used = 0, total = 0;
  ET_CHECK(backend.memory().usage(&used, &total), "the backend's memory reports no usage");
  return used;
}
const char* measure_name(bool device) { return device ? "device memory" : "USS"; }

void synthetic_batch(Executor& ex, uint64_t seed) {
  Graph& g = ex.graph();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const Tensor x = ex.value(g.image_input), y = ex.value(g.label_input);
  const HostView xv(ex.backend(), x, HostView::Write), yv(ex.backend(), y, HostView::Write);
  for (int64_t i = 0; i < x.numel(); ++i) xv.f32()[i] = normal(rng);
  const int64_t classes = g.value(g.logits).shape[1];
  for (int64_t i = 0; i < y.numel(); ++i) yv.i32()[i] = int32_t(rng() % uint64_t(classes));
}

// Runs the graph in `format` with every segment of `every` layers recomputed (bitmap_int4: 0, it
// recomputes the BN inputs its own way), records its measurements.
void calibrate(Graph& g, Backend& backend, const QuantOptions& quant, const BudgetOptions& o, StashFormat format,
               int every, const std::function<void(Executor&)>& init, Calibration* cal, std::vector<double>* seconds) {
  StashOptions lean;
  lean.format = format;
  lean.checkpoint_every = every;
  // The budget is one of USS (or of the device's memory): without it there is nothing to plan against.
  const bool device = budgets_device(backend);
  // A device allocates its stash region whole: the bitmap entries' rooms start at half and are
  // fitted after each step, as in training (the worst case may not fit where a budget is needed).
  if (device) lean.first_room = 0.5;
  const std::optional<size_t> before = device ? std::optional<size_t>(device_used(backend)) : read_uss_bytes();
  if (!before)
    user_error("memory.budget_mb: the process USS cannot be read (/proc/self/smaps_rollup and /proc/self/smaps are "
               "unavailable), so a USS budget cannot be planned; leave memory.budget_mb at 0");
  Executor ex(g, backend, lean, quant);
  init(ex);
  synthetic_batch(ex, o.seed);
  const int64_t n = g.batch_size();
  UssPeak uss;
  auto step = [&] {
    uss.begin_step();
    ex.forward(n, true);
    uss.phase();
    ex.backward();
    if (device) ex.fit_stash_room();  // (a step that outgrew its room measured the same work)
    uss.phase();
    uss.end_step();
  };
  step();  // warm-up: first-touch page faults, kernel selection
  ex.set_timing(true);
  ex.stash().reset_peak();
  for (int s = 0; s < o.calibration_steps; ++s) step();
  const double k = 1.0 / o.calibration_steps;
  if (cal->forward_s.empty()) {
    cal->forward_s.assign(size_t(g.num_nodes()), 0.0);
    for (int i = 0; i < g.num_nodes(); ++i) cal->forward_s[size_t(i)] = ex.forward_seconds()[size_t(i)] * k;
    cal->nonzero.assign(size_t(g.num_values()), 1.0);
    // USS the step adds beyond the arena and the stash region (thread stacks, per-thread
    // scratch, the allocator's own pages): their resident pages are subtracted as they are, the
    // prediction counts both whole (a plan may touch pages this one did not). On a device, what
    // its memory holds beyond them after the steps (the backend's scratch, cuDNN's and cuBLAS's
    // workspaces, the codec's buffers: kept from the first step on).
    const double after = device ? double(device_used(backend)) : double(uss.peak().value_or(0));
    cal->overhead_bytes = std::max(0.0, after - double(*before) - double(ex.arena_resident_bytes()) -
                                            double(ex.stash().region_resident_bytes()));
  }
  seconds->assign(size_t(g.num_values()), 0.0);
  for (const SavedValue& sv : ex.stash().saved()) {
    const StashRecord& r = ex.stash().record(sv.value);
    (*seconds)[size_t(sv.value)] = r.seconds * k;
    // Bitmaps (masks included) counted their non-zeros; dense values keep 1.
    const bool bitmap = !sv.full || stash_encoding_info(stash_format_info(sv.format).full).bitmap;
    if (bitmap && r.numel > 0 && r.nonzero >= 0) cal->nonzero[size_t(sv.value)] = double(r.nonzero) / double(r.numel);
  }
}

// A candidate: per saved value its format (absent = dense_fp32), the segment length and flags.
struct Candidate {
  std::map<int, StashFormat> format;
  int every = 1;
  std::vector<uint8_t> segments;
  // memory.recompute_stack_outputs: fused BN -> ReLU stack outputs computed by their readers (not
  // with segments, which choose what is kept themselves). Predicted free: the readers apply BN and
  // ReLU to x as they stage it (docs/fusion-log.md measures even steps).
  bool stack_outputs = false;
};

struct Estimate {
  double bytes = 0, arena = 0, stash = 0;  // predicted step USS and its arena and stash parts
  double seconds = 0, recompute_s = 0;     // predicted extra time per step, of which recomputation
};

class Search {
 public:
  Search(Graph& g, Backend& b, const QuantOptions& q, const Calibration& cal, double headroom)
      : g_(g), backend_(b), quant_(q), cal_(cal), headroom_(headroom) {}

  StashOptions options(const Candidate& c) const {
    StashOptions o;
    for (const auto& [id, f] : c.format) o.layers.emplace_back(g_.value(id).name, f);
    o.checkpoint_every = c.every;
    o.segments = c.segments;
    o.recompute_stack_outputs = c.stack_outputs;
    return o;
  }

  // A candidate planned, not run: its predicted step USS (bytes) and extra time per step
  // (seconds: the formats' pack and decode, the recomputed nodes' forward).
  Estimate estimate(const Candidate& c) {
    const Executor ex(g_, backend_, options(c), quant_, Executor::PlanOnly{});  // (a device may not hold it)
    std::vector<size_t> bytes(size_t(g_.num_values()), 0);
    for (const SavedValue& sv : ex.stash().saved()) {
      if (sv.recomputed) continue;  // nothing kept: its readers compute it
      const StashFormatInfo& f = stash_format_info(sv.format);
      const StashEncoding enc = sv.full ? f.full : f.mask;
      if (enc == StashEncoding::ZeroCopy) continue;  // in the arena
      int64_t kept = sv.numel;
      if (stash_encoding_info(enc).bitmap)
        kept = std::min<int64_t>(sv.numel, int64_t(std::ceil((cal_.nonzero[size_t(sv.value)] + headroom_) * double(sv.numel))));
      bytes[size_t(sv.value)] = Arena::align_up(stash_encoding_bytes(enc, sv.numel, kept));
    }
    // The stash's top, replayed: pushes go on top; a pop from below the top leaves a hole that is
    // reclaimed once everything above it is popped (Stash::pop).
    std::vector<std::pair<int, size_t>> stack;  // value, end offset
    size_t top = 0, peak = 0;
    for (const Executor::StashEvent& e : ex.stash_schedule()) {
      if (e.push) {
        if (bytes[size_t(e.value)] == 0) continue;
        top += bytes[size_t(e.value)];
        stack.emplace_back(e.value, top);
        peak = std::max(peak, top);
      } else {
        auto it = std::find_if(stack.begin(), stack.end(), [&](const auto& s) { return s.first == e.value; });
        if (it == stack.end()) continue;
        stack.erase(it);
        top = stack.empty() ? 0 : stack.back().second;
      }
    }
    Estimate e;
    e.arena = double(ex.memory().total);
    e.stash = double(peak);
    e.bytes = e.arena + e.stash + cal_.overhead_bytes;
    for (int n = 0; n < g_.num_nodes(); ++n)
      if (ex.reruns(n)) e.recompute_s += cal_.forward_s[size_t(n)];
    e.seconds = e.recompute_s;
    for (const auto& [id, f] : c.format) e.seconds += format_cost(id, f);
    return e;
  }

  double format_cost(int id, StashFormat f) const {
    switch (f) {
      case StashFormat::DenseF32: return 0;
      case StashFormat::BitmapF32: return exact_s_[size_t(id)];
      case StashFormat::BitmapI4: return codes_s_[size_t(id)];
      default: return lossy_s_[size_t(id)];
    }
  }

  std::vector<double> exact_s_, lossy_s_, codes_s_;

 private:
  Graph& g_;
  Backend& backend_;
  const QuantOptions& quant_;
  const Calibration& cal_;
  double headroom_;
};

struct Move {
  int value = -1;    // a format move, or
  int segment = -1;  // a segment recomputed
  StashFormat to = StashFormat::DenseF32;
  bool lossy = false;
  double gain = 0, seconds = 0;  // against the current plan: predicted bytes saved, time added
};

struct Outcome {
  Candidate c;
  Estimate e;
};

// Greedy from the fastest plan with segments of `every` layers. Each pass weighs every move not
// yet made against the current plan (a move's saving depends on the others: a buffer kept in place
// may stop setting the peak only once another one is gone) and makes them in order of time per
// byte saved, exact ones first, keeping each only if the prediction falls. Passes repeat until the
// budget is met or nothing more helps. `largest_first` orders by bytes saved alone: the way to the
// smallest plan when the cheapest order gets stuck above the budget.
// `codes` (the values a bitmap_int4 save may keep as INT4 codes, empty for none): those moves too;
// they exclude recomputed segments (the codes recompute BN inputs their own way), so a search
// with codes has `every` = 0 and no segments.
Outcome search(Search& s, const std::vector<SavedValue>& saved, const std::vector<uint8_t>& sparse,
               const std::vector<uint8_t>& codes, int every, int num_segments, bool stack_outputs, double budget,
               bool lossy, bool largest_first) {
  Candidate c;
  c.every = every;
  c.stack_outputs = stack_outputs;
  c.segments.assign(size_t(num_segments), 0);
  std::vector<Move> todo;
  for (const SavedValue& sv : saved) {
    if (!sv.full || sparse[size_t(sv.value)]) todo.push_back(Move{sv.value, -1, StashFormat::BitmapF32, false});
    if (!codes.empty() && codes[size_t(sv.value)]) todo.push_back(Move{sv.value, -1, StashFormat::BitmapI4, false});
    if (lossy && sv.full)
      todo.push_back(Move{sv.value, -1, sparse[size_t(sv.value)] ? StashFormat::BitmapF16 : StashFormat::DenseF16, true});
  }
  for (int i = 0; i < num_segments; ++i) todo.push_back(Move{-1, i, StashFormat::DenseF32, false});
  auto apply = [](Candidate t, const Move& m) {
    if (m.value >= 0) t.format[m.value] = m.to;
    else t.segments[size_t(m.segment)] = 1;
    return t;
  };
  Estimate cur = s.estimate(c);
  for (bool lossy_pass : {false, true}) {
    if (lossy_pass && !lossy) break;
    for (bool progress = true; progress && cur.bytes > budget;) {
      progress = false;
      std::vector<Move> moves;
      for (Move m : todo) {
        if (m.lossy != lossy_pass) continue;
        if (m.value >= 0 && c.format.count(m.value) && c.format.at(m.value) == m.to) continue;
        if (m.segment >= 0 && c.segments[size_t(m.segment)]) continue;
        const Estimate e = s.estimate(apply(c, m));
        m.gain = cur.bytes - e.bytes;
        m.seconds = e.seconds - cur.seconds;
        if (m.gain > 0) moves.push_back(m);
      }
      std::sort(moves.begin(), moves.end(), [&](const Move& a, const Move& b) {
        if (largest_first) return a.gain > b.gain;
        return std::max(a.seconds, 0.0) / a.gain < std::max(b.seconds, 0.0) / b.gain;
      });
      for (const Move& m : moves) {
        if (cur.bytes <= budget) break;
        const Candidate t = apply(c, m);
        const Estimate e = s.estimate(t);
        if (e.bytes < cur.bytes) c = t, cur = e, progress = true;
      }
    }
  }
  return Outcome{c, cur};
}

std::string mb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MB", bytes / kMB);
  return buf;
}

}  // namespace

BudgetPlan plan_memory_budget(Graph& g, Backend& backend, const QuantOptions& quant, const BudgetOptions& o,
                              const std::function<void(Executor&)>& init) {
  const auto t0 = Clock::now();
  Calibration cal;
  std::vector<double> exact_s, lossy_s, codes_s;
  calibrate(g, backend, quant, o, StashFormat::BitmapF32, 1, init, &cal, &exact_s);
  if (o.lossy) calibrate(g, backend, quant, o, StashFormat::BitmapF16, 1, init, &cal, &lossy_s);

  Search s(g, backend, quant, cal, o.headroom);
  // Saved values and which have zeros by construction: the fastest plan's saves, and what a global
  // bitmap format turns into a bitmap there (the executor's rule, executor_plan.cpp).
  std::vector<SavedValue> saved;
  std::vector<uint8_t> sparse(size_t(g.num_values()), 0);
  {
    StashOptions bitmap;
    bitmap.format = StashFormat::BitmapF32;
    const Executor ex(g, backend, bitmap, quant, Executor::PlanOnly{});
    for (const SavedValue& sv : ex.stash().saved()) {
      if (g.value(sv.value).producer < 0) continue;  // the input batch: kept in place
      saved.push_back(sv);
      sparse[size_t(sv.value)] = sv.full && sv.format == StashFormat::BitmapF32;
    }
  }
  // 4-bit training: the inputs of INT4 layers with a 4-bit backward may be kept as their INT4 codes
  // (bitmap_int4: what auto's plan keeps so, engine/executor_codes.cpp), an exact choice there.
  std::vector<uint8_t> codes;
  if (quant.any()) {
    StashOptions with_codes;
    with_codes.format = StashFormat::Auto;
    const Executor ex(g, backend, with_codes, quant, Executor::PlanOnly{});
    for (const SavedValue& sv : ex.stash().saved())
      if (sv.format == StashFormat::BitmapI4) {
        codes.resize(size_t(g.num_values()), 0);
        codes[size_t(sv.value)] = 1;
      }
    if (!codes.empty()) calibrate(g, backend, quant, o, StashFormat::BitmapI4, 0, init, &cal, &codes_s);
  }
  s.exact_s_ = exact_s;
  s.lossy_s_ = o.lossy ? lossy_s : exact_s;
  s.codes_s_ = codes.empty() ? exact_s : codes_s;
  // Plans aim 1 % under the budget: the USS outside arena and stash moves by about a MB between
  // runs (measured on ResNet-20: 0.7-1.1 MB).
  const double budget = 0.99 * o.budget_mb * kMB;
  Outcome best;
  bool met = false;
  double smallest = INFINITY;
  const double fastest = s.estimate(Candidate{{}, 0, {}}).bytes;
  auto consider = [&](const std::vector<uint8_t>& with_codes, int every, int num_segments, bool stack_outputs) {
    Outcome r = search(s, saved, sparse, with_codes, every, num_segments, stack_outputs, budget, o.lossy, false);
    if (r.e.bytes > budget) {
      const Outcome small =
          search(s, saved, sparse, with_codes, every, num_segments, stack_outputs, budget, o.lossy, true);
      if (small.e.bytes < r.e.bytes) r = small;
    }
    smallest = std::min(smallest, r.e.bytes);
    if (r.e.bytes <= budget &&
        (!met || r.e.seconds < best.e.seconds || (r.e.seconds == best.e.seconds && r.e.bytes < best.e.bytes))) {
      best = r;
      met = true;
    }
  };
  if (!codes.empty()) consider(codes, 0, 0, false);
  for (int every = 1; every <= 3; ++every) {
    const int num_segments = int(Executor::candidate_segments(g, every).size());
    if (num_segments == 0 || (every > 1 && num_segments == int(Executor::candidate_segments(g, every - 1).size())))
      break;
    consider({}, every, num_segments, false);
  }
  // Stack outputs computed by their readers, where the graph has such (fused stacks on this backend).
  {
    StashOptions with;
    with.recompute_stack_outputs = true;
    const Executor ex(g, backend, with, quant, Executor::PlanOnly{});
    bool any = false;
    for (const SavedValue& sv : ex.stash().saved()) any |= sv.recomputed;
    if (any) consider({}, 0, 0, true);
  }
  const bool device = budgets_device(backend);
  if (!met)
    user_error("config key 'memory.budget_mb' = ", o.budget_mb, ": no plan fits the training step in it; the smallest ",
               o.lossy ? "" : "exact ", "plan is predicted at ", mb(smallest), " (the fastest at ", mb(fastest), "; ",
               measure_name(device), " outside arena and stash measured at ", mb(cal.overhead_bytes), ")",
               o.lossy ? "" : "; memory.budget_lossy = true also allows fp16 formats");

  BudgetPlan p;
  p.device = device;
  p.options = s.options(best.c);
  p.budget_mb = o.budget_mb;
  p.predicted_mb = best.e.bytes / kMB;
  p.fastest_mb = fastest / kMB;
  p.overhead_mb = cal.overhead_bytes / kMB;
  p.arena_mb = best.e.arena / kMB;
  p.stash_mb = best.e.stash / kMB;
  p.extra_ms = best.e.seconds * 1e3;
  p.recompute_ms = best.e.recompute_s * 1e3;
  p.segments = int(std::count(best.c.segments.begin(), best.c.segments.end(), 1));
  if (p.segments == 0) p.options.checkpoint_every = 0, p.options.segments.clear();
  const Executor chosen(g, backend, p.options, quant, Executor::PlanOnly{});
  std::vector<uint8_t> recomputed(size_t(g.num_values()), 0);
  for (const SavedValue& sv : chosen.stash().saved()) {
    recomputed[size_t(sv.value)] = sv.recomputed;
    p.stack_outputs += sv.recomputed;
  }
  for (int n = 0; n < g.num_nodes(); ++n) {
    for (int id : chosen.recomputed_by(n)) recomputed[size_t(id)] = 1;
    // Without checkpoint segments, what runs again are the convs of BN inputs kept as codes.
    if (p.segments == 0 && chosen.reruns(n)) ++p.code_segments;
  }
  for (const SavedValue& sv : saved) {
    BudgetTensor t;
    t.name = g.value(sv.value).name;
    auto it = best.c.format.find(sv.value);
    t.format = it == best.c.format.end() ? StashFormat::DenseF32 : it->second;
    t.full = sv.full;
    t.recomputed = recomputed[size_t(sv.value)] != 0;
    t.dense_bytes = size_t(sv.numel) * 4;
    t.nonzero = cal.nonzero[size_t(sv.value)];
    t.ms = s.format_cost(sv.value, t.format) * 1e3;
    p.tensors.push_back(t);
  }
  p.calibration_s = std::chrono::duration<double>(Clock::now() - t0).count();
  return p;
}

std::vector<std::string> BudgetPlan::summary() const {
  std::vector<std::string> out;
  char buf[320], recompute[96];
  if (code_segments > 0)
    std::snprintf(recompute, sizeof(recompute), "%d BN input%s recomputed from INT4 codes", code_segments,
                  code_segments == 1 ? "" : "s");
  else if (stack_outputs > 0)
    std::snprintf(recompute, sizeof(recompute), "%d fused stack output%s computed by %s readers", stack_outputs,
                  stack_outputs == 1 ? "" : "s", stack_outputs == 1 ? "its" : "their");
  else
    std::snprintf(recompute, sizeof(recompute), "%d segment%s of %d layer%s", segments, segments == 1 ? "" : "s",
                  options.checkpoint_every, options.checkpoint_every == 1 ? "" : "s");
  const char* what = measure_name(device);
  std::snprintf(buf, sizeof(buf),
                "memory budget %.1f MB: predicted step %s %.1f MB (fastest plan %.1f MB), predicted extra time %.2f ms "
                "per step (recompute %.2f ms, %s); planned in %.1f s (%s outside arena and stash: %.1f MB)",
                budget_mb, what, predicted_mb, fastest_mb, extra_ms, recompute_ms, recompute, calibration_s, what,
                overhead_mb);
  out.push_back(buf);
  for (const BudgetTensor& t : tensors) {
    if (t.format == StashFormat::DenseF32 && !t.recomputed) continue;
    std::snprintf(buf, sizeof(buf), "  %-28s %-12s%s %8.2f MB dense, %3.0f%% non-zero, %.2f ms", t.name.c_str(),
                  stash_format_name(t.format), t.recomputed ? " recomputed" : "           ", t.dense_bytes / kMB,
                  100 * t.nonzero, t.ms);
    out.push_back(buf);
  }
  return out;
}

std::string budget_plan_json(const BudgetPlan& p) {
  nlohmann::json layers = nlohmann::json::object();
  for (const auto& [name, f] : p.options.layers) layers[name] = stash_format_name(f);
  const nlohmann::json j = {{"budget_mb", p.budget_mb},           {"predicted_mb", p.predicted_mb},
                            {"extra_ms", p.extra_ms},             {"checkpoint_every", p.options.checkpoint_every},
                            {"segments", p.options.segments},     {"layers", layers},
                            {"recompute_stack_outputs", p.options.recompute_stack_outputs},
                            {"measure", measure_name(p.device)}};
  return j.dump(2) + "\n";
}

BudgetPlan read_budget_plan(const std::string& path, const Graph& g) {
  std::ifstream in(path);
  if (!in) user_error("cannot read the memory plan '", path, "'");
  BudgetPlan p;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    p.budget_mb = j.at("budget_mb").get<double>();
    p.predicted_mb = j.at("predicted_mb").get<double>();
    p.extra_ms = j.at("extra_ms").get<double>();
    p.options.checkpoint_every = j.at("checkpoint_every").get<int>();
    p.options.segments = j.at("segments").get<std::vector<uint8_t>>();
    p.options.recompute_stack_outputs = j.value("recompute_stack_outputs", false);  // absent before session 26
    p.device = j.value("measure", std::string("USS")) == measure_name(true);        // absent before session 61
    for (const auto& [name, f] : j.at("layers").items()) {
      StashFormat sf;
      if (!parse_stash_format(f.get<std::string>(), &sf) || sf == StashFormat::Auto)
        user_error("memory plan '", path, "': layer '", name, "' has format ", f.dump(), ", not one the budget plans");
      if (g.find_value(name) < 0) user_error("memory plan '", path, "': no layer '", name, "' in this model");
      p.options.layers.emplace_back(name, sf);
    }
  } catch (const nlohmann::json::exception& e) {
    user_error("memory plan '", path, "' is malformed: ", e.what());
  }
  const size_t candidates = Executor::candidate_segments(g, p.options.checkpoint_every).size();
  if (p.options.checkpoint_every < 0 || p.options.checkpoint_every > 3 ||
      (!p.options.segments.empty() && p.options.segments.size() != candidates))
    user_error("memory plan '", path, "': ", p.options.segments.size(), " segment flags for checkpoint_every = ",
               p.options.checkpoint_every, ", this model has ", candidates, " segments");
  p.segments = int(std::count(p.options.segments.begin(), p.options.segments.end(), 1));
  return p;
}

}  // namespace et
