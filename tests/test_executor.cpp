// Executor invariants: the lifetime memory plan never lets two live buffers share memory (the planner
// on random requests, and the executor's actual arena layout on real models), a step is
// deterministic, and an evaluation forward of a partial batch equals the first rows of a full one.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/executor.h"
#include "backends/cpu/cpu_backend.h"
#include "engine/init.h"
#include "layers/layers.h"
#include "memory/arena.h"
#include "tests/counted_memory.h"
#include "memory/planner.h"
#include "models/models.h"

using namespace et;

namespace {

bool time_overlap(const BufferRequest& a, const BufferRequest& b) { return a.first <= b.last && b.first <= a.last; }

// Every invariant of a plan: alignment, bounds, no shared (time, address) pair, accounting.
void check_plan(const std::vector<BufferRequest>& req, const MemoryPlan& plan) {
  REQUIRE(plan.offsets.size() == req.size());
  size_t sum = 0;
  int t_max = 0;
  for (size_t i = 0; i < req.size(); ++i) {
    const size_t bytes = Arena::align_up(req[i].bytes);
    sum += bytes;
    t_max = std::max(t_max, req[i].last);
    INFO("request " << i << ": " << req[i].bytes << " B, [" << req[i].first << ", " << req[i].last << "] at "
                    << plan.offsets[i]);
    CHECK(plan.offsets[i] % Arena::kAlign == 0);
    if (bytes) CHECK(plan.offsets[i] + bytes <= plan.total_bytes);
  }
  CHECK(plan.sum_bytes == sum);
  CHECK(plan.total_bytes <= plan.sum_bytes);
  size_t overlaps = 0;
  for (size_t i = 0; i < req.size(); ++i)
    for (size_t j = i + 1; j < req.size(); ++j) {
      const size_t bi = Arena::align_up(req[i].bytes), bj = Arena::align_up(req[j].bytes);
      if (!bi || !bj || !time_overlap(req[i], req[j])) continue;
      const bool disjoint = plan.offsets[i] + bi <= plan.offsets[j] || plan.offsets[j] + bj <= plan.offsets[i];
      if (!disjoint) {
        ++overlaps;
        FAIL_CHECK("requests " << i << " and " << j << " are alive together and share memory: [" << plan.offsets[i]
                               << ", +" << bi << ") and [" << plan.offsets[j] << ", +" << bj << ")");
      }
    }
  CHECK(overlaps == 0);
  // No plan can use less than the peak of simultaneously live bytes.
  size_t peak = 0;
  for (int t = 0; t <= t_max; ++t) {
    size_t live = 0;
    for (const BufferRequest& r : req)
      if (r.first <= t && t <= r.last) live += Arena::align_up(r.bytes);
    peak = std::max(peak, live);
  }
  CHECK(plan.total_bytes >= peak);
}

}  // namespace

TEST_CASE("planner: buffers alive at the same time never share memory", "[executor][planner]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + int(rng() % 60), horizon = 1 + int(rng() % 40);
    std::vector<BufferRequest> req(static_cast<size_t>(n));
    for (BufferRequest& r : req) {
      switch (rng() % 4) {  // sizes: aligned, odd, zero, large
        case 0: r.bytes = 64 * (1 + rng() % 32); break;
        case 1: r.bytes = 1 + rng() % 5000; break;
        case 2: r.bytes = trial % 3 == 0 ? 0 : 1 + rng() % 100; break;
        default: r.bytes = 1 + rng() % 200000; break;
      }
      r.first = int(rng() % uint32_t(horizon));
      r.last = r.first + int(rng() % uint32_t(horizon / 2 + 1));
    }
    if (trial % 10 == 0 && n > 2) req[1] = req[0];  // identical requests
    INFO("trial " << trial);
    check_plan(req, plan_memory(req));
  }
}

TEST_CASE("planner: reuse where lifetimes are disjoint, none where all overlap", "[executor][planner]") {
  std::vector<BufferRequest> seq, all;
  size_t biggest = 0, sum = 0;
  for (int i = 0; i < 20; ++i) {
    const size_t b = size_t(100 + 37 * ((i * 7) % 20));
    seq.push_back({b, i, i});
    all.push_back({b, 0, 5});
    biggest = std::max(biggest, Arena::align_up(b));
    sum += Arena::align_up(b);
  }
  const MemoryPlan ps = plan_memory(seq), pa = plan_memory(all);
  check_plan(seq, ps);
  check_plan(all, pa);
  CHECK(ps.total_bytes == biggest);
  CHECK(pa.total_bytes == sum);
  CHECK(plan_memory({}).total_bytes == 0);
}

// Ten equal buffers where at most three are ever alive at once; placed largest (or largest area)
// first, they fragment into four slots. Taken from LUQ ResNet-20's plan with the bitmap_int4 stash
// (32 MB planned where 24 of these 8 MB buffers' bytes were alive at once).
TEST_CASE("planner: a plan reaches the bytes alive at once where greedy by size fragments", "[executor][planner]") {
  const size_t s = 1 << 20;
  const std::vector<BufferRequest> req = {{s, 0, 4},   {s, 1, 2},   {s, 99, 101}, {s, 2, 3},  {s, 3, 4},
                                          {s, 95, 97}, {s, 4, 8},   {s, 97, 106}, {s, 98, 102}, {s, 89, 98}};
  const MemoryPlan p = plan_memory(req);
  check_plan(req, p);
  CHECK(p.total_bytes == 3 * s);
}

namespace {

// The executor's real layout: from the graph and the ops' declared saves, the interval over which each
// buffer must hold its contents (forward of node n at time n, backward at 2 * nodes - 1 - n), and the
// address range the executor gave it. Persistent buffers (params, grads, optimizer slots, inputs, BN
// buffers) are alive throughout.
struct Region {
  std::string what;
  const char* lo;
  const char* hi;
  int first, last;
  int grad_group = -1;  // activation gradients: the value whose gradient buffer they share in place
};

// Gradients meant to share memory (Op::grad_in_place), the rule written out again here: a node
// whose backward hands its output gradient to several inputs (add) shares it with all of them
// when it is each one's last consumer; a member's producer may then chain its own input into the
// buffer only if its backward comes after every other member's producer and consumers. Then, as
// before, an input whose only consumer declares grad_in_place shares its output's gradient (one
// input per node). Follow the links to the root.
int grad_group(const Graph& g, const Backend& backend, int id) {
  const int nv = g.num_values();
  std::vector<int> parent(size_t(nv), -1);
  std::vector<bool> no_chain(size_t(nv), false);
  auto shareable = [&](const Node& c, size_t i) {
    const Value& in = g.value(c.inputs[i]);
    return in.kind == ValueKind::Activation && in.needs_grad &&
           in.shape.numel() == g.value(c.output).shape.numel() && c.op->grad_in_place(int(i), backend);
  };
  for (int n = 0; n < g.num_nodes(); ++n) {
    const Node& c = g.node(n);
    std::vector<int> members;
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      const Value& in = g.value(c.inputs[i]);
      bool last = true;
      for (int k : in.consumers) last = last && k <= n;
      bool seen = false;
      for (int m : members) seen = seen || m == c.inputs[i];
      if (shareable(c, i) && last && !seen) members.push_back(c.inputs[i]);
    }
    if (members.size() < 2) continue;
    for (int u : members) {
      parent[size_t(u)] = c.output;
      for (int w : members)
        if (w != u) {
          bool after = g.value(u).producer < g.value(w).producer;
          for (int k : g.value(w).consumers) after = after && g.value(u).producer < k;
          if (!after) no_chain[size_t(u)] = true;
        }
    }
  }
  for (int n = 0; n < g.num_nodes(); ++n) {
    const Node& c = g.node(n);
    if (no_chain[size_t(c.output)]) continue;
    for (size_t i = 0; i < c.inputs.size(); ++i)
      if (shareable(c, i) && g.value(c.inputs[i]).consumers.size() == 1 && parent[size_t(c.inputs[i])] < 0) {
        parent[size_t(c.inputs[i])] = c.output;
        break;
      }
  }
  while (parent[size_t(id)] >= 0) id = parent[size_t(id)];
  return id;
}

std::vector<Region> live_regions(Executor& ex) {
  const Graph& g = ex.graph();
  const int nn = g.num_nodes();
  const int end = 2 * nn;
  auto bwd = [&](int n) { return 2 * nn - 1 - n; };
  std::vector<Region> out;
  auto add = [&](const std::string& what, const Tensor& t, const Value& v, int first, int last) {
    const char* p = static_cast<const char*>(t.data);
    REQUIRE(p != nullptr);
    out.push_back({what, p, p + size_t(v.shape.numel()) * dtype_size(v.dtype), first, last});
  };
  for (int id = 0; id < g.num_values(); ++id) {
    const Value& v = g.value(id);
    switch (v.kind) {
      case ValueKind::Param:
        add(v.name, ex.value(id), v, 0, end);
        add("grad " + v.name, ex.grad(id), v, 0, end);
        add("momentum " + v.name, ex.opt_slot(id, 0), v, 0, end);
        break;
      case ValueKind::Input:
      case ValueKind::Buffer:
        add(v.name, ex.value(id), v, 0, end);
        break;
      case ValueKind::Aux:
        add(v.name, ex.value(id), v, v.producer, bwd(v.producer));
        break;
      case ValueKind::Activation: {
        int last = v.producer;
        for (int c : v.consumers) {
          last = std::max(last, c);
          const Node& cn = g.node(c);
          // dense_fp32 keeps a full save in place until its backward; a mask-only save is bits.
          for (const SaveSpec& s : cn.op->saves())
            if (s.kind == SaveKind::Full && (s.input < 0 ? cn.output : cn.inputs[size_t(s.input)]) == id)
              last = std::max(last, bwd(c));
        }
        for (const SaveSpec& s : g.node(v.producer).op->saves())
          if (s.kind == SaveKind::Full && s.input < 0) last = std::max(last, bwd(v.producer));
        if (id == g.loss || id == g.logits) last = end;
        add(v.name, ex.value(id), v, v.producer, last);
        if (v.needs_grad) {
          int first = bwd(v.producer);
          for (int c : v.consumers) first = std::min(first, bwd(c));
          add("grad " + v.name, ex.grad(id), v, first, bwd(v.producer));
          out.back().grad_group = grad_group(g, ex.backend(), id);
        }
        break;
      }
    }
  }
  return out;
}

void check_executor_layout(Graph& g) {
  auto be = make_cpu_backend();
  Executor ex(g, *be);
  const std::vector<Region> r = live_regions(ex);
  const char* base = r.front().lo;
  for (const Region& x : r) base = std::min(base, x.lo);
  const MemoryReport& m = ex.memory();
  // Workspace sits at the end of the arena: nothing else may reach into it.
  const char* ws = base + (m.total - m.workspace);
  size_t collisions = 0, checked = 0, shared = 0;
  for (const Region& x : r) {
    INFO(x.what);
    CHECK(x.hi <= ws);
  }
  for (size_t i = 0; i < r.size(); ++i)
    for (size_t j = i + 1; j < r.size(); ++j) {
      const Region &a = r[i], &b = r[j];
      if (a.hi == a.lo || b.hi == b.lo || a.last < b.first || b.last < a.first) continue;
      ++checked;
      if (a.grad_group >= 0 && a.grad_group == b.grad_group) {  // one buffer by design: exactly the same
        ++shared;
        CHECK((a.lo == b.lo && a.hi == b.hi));
        continue;
      }
      if (a.lo < b.hi && b.lo < a.hi) {
        ++collisions;
        FAIL_CHECK(a.what << " [" << a.first << ", " << a.last << "] and " << b.what << " [" << b.first << ", "
                          << b.last << "] are alive together and share memory");
      }
    }
  INFO(r.size() << " buffers, " << checked << " pairs alive together");
  CHECK(checked > 0);
  CHECK(shared > 0);  // relu / BN / add gradients do share in place
  CHECK(collisions == 0);
  // And the plan does reuse memory (else the check above would be vacuous).
  CHECK(m.activations_planned < m.activations_unplanned);
}

void fill_inputs(Executor& ex, uint32_t seed) {
  const Graph& g = ex.graph();
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  Tensor x = ex.value(g.image_input), y = ex.value(g.label_input);
  const int64_t classes = g.value(g.logits).shape[1];
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = d(rng);
  for (int64_t i = 0; i < y.numel(); ++i) y.i32()[i] = int32_t(rng() % uint32_t(classes));
}

ModelSpec small_spec(const std::string& name, int64_t batch, int64_t hw) {
  ModelSpec s;
  s.name = name;
  s.batch = batch;
  s.height = s.width = hw;
  return s;
}

std::vector<float> copy_of(const Tensor& t) { return std::vector<float>(t.f32(), t.f32() + t.numel()); }

}  // namespace

TEST_CASE("executor: buffers alive at the same time never share arena memory", "[executor]") {
  for (const char* model : {"resnet8", "resnet20", "mobilenetv2", "vgg11_bn"}) {
    DYNAMIC_SECTION(model) {
      Graph g;
      ModelSpec s = small_spec(model, 4, 32);
      s.dropout = std::string(model) == "mobilenetv2" ? 0.2f : 0.f;
      build_model(g, s);
      check_executor_layout(g);
    }
  }
}

// The plan's peak as `edgetrain plan` reports it: the buffers listed are the ones alive at that
// step, their sum is the peak, and no plan can be smaller.
TEST_CASE("executor: the activation peak lists what is alive at the plan's busiest step", "[executor]") {
  for (const char* model : {"resnet8", "vgg11_bn"}) {
    for (int every : {0, 1}) {
      DYNAMIC_SECTION(model << " checkpoint_every " << every) {
        Graph g;
        build_model(g, small_spec(model, 4, 32));
        auto be = make_cpu_backend();
        StashOptions o;
        o.checkpoint_every = every;
        Executor ex(g, *be, o);
        const ActivationPeak& p = ex.activation_peak();
        REQUIRE(!p.buffers.empty());
        size_t sum = 0;
        for (const ActivationPeak::Buffer& b : p.buffers) sum += Arena::align_up(b.bytes);
        CHECK(sum == p.alive_bytes);
        CHECK(p.alive_bytes <= ex.memory().activations_planned);
        CHECK(p.alive_bytes >= p.buffers[0].bytes);
        for (size_t i = 1; i < p.buffers.size(); ++i) CHECK(p.buffers[i - 1].bytes >= p.buffers[i].bytes);
        CHECK((p.when.rfind("forward of ", 0) == 0 || p.when.rfind("backward of ", 0) == 0 ||
               p.when.rfind("recompute of ", 0) == 0));
      }
    }
  }
}

// A real plan the six greedy placements leave 2 MB above the bytes alive at once (LUQ ResNet-20, the
// bitmap_int4 stash, recomputation every conv, unfused): the perturbed largest-first rounds reach it.
TEST_CASE("planner: LUQ ResNet-20's recompute plan packs into the bytes alive at once", "[executor][planner]") {
  Config cfg = load_config(std::string(EDGETRAIN_SOURCE_DIR) + "/configs/resnet20_cifar10_luq.json",
                           {"memory.stash=auto", "memory.checkpoint_every=1", "fusion.enabled=false",
                            "data.channels=3", "data.height=32", "data.width=32"});
  Graph g;
  build_model(g, cfg.model);
  auto be = make_cpu_backend();
  Executor ex(g, *be, cfg.stash_options(), cfg.quant_options());
  CHECK(ex.memory().activations_planned == ex.activation_peak().alive_bytes);
}

TEST_CASE("executor: forward + backward twice gives identical loss and gradients", "[executor]") {
  for (const char* model : {"resnet8", "mobilenetv2"}) {
    DYNAMIC_SECTION(model) {
      const ModelSpec spec = [&] {
        ModelSpec s = small_spec(model, 6, 16);
        s.dropout = 0.3f;  // mobilenetv2 has a dropout before the classifier: same step seed, same mask
        s.label_smoothing = 0.1f;
        return s;
      }();
      auto run = [&](Executor& ex) {
        ex.set_step_seed(99);
        ex.forward(spec.batch, true);
        ex.backward();
        std::vector<std::vector<float>> out = {{ex.loss()}};
        for (int p : ex.graph().params()) out.push_back(copy_of(ex.grad(p)));
        return out;
      };
      Graph g;
      build_model(g, spec);
      auto be = make_cpu_backend();
      Executor ex(g, *be);
      init_parameters(ex, 5);
      ex.forward(spec.batch, false);  // sets the batch, so the input views span it
      fill_inputs(ex, 3);
      const auto a = run(ex);
      const auto b = run(ex);  // same executor again (BN running stats moved; training output does not use them)
      Graph g2;
      build_model(g2, spec);
      Executor ex2(g2, *be);
      init_parameters(ex2, 5);
      ex2.forward(spec.batch, false);
      fill_inputs(ex2, 3);
      const auto c = run(ex2);  // a fresh executor
      REQUIRE(std::isfinite(a[0][0]));
      CHECK(a[0][0] == b[0][0]);
      CHECK(a[0][0] == c[0][0]);
      size_t differing = 0;
      for (size_t i = 1; i < a.size(); ++i) differing += (a[i] != b[i]) + (a[i] != c[i]);
      CHECK(differing == 0);
      // Not vacuous: a different dropout seed changes something (mobilenetv2), other inputs do (both).
      fill_inputs(ex, 4);
      CHECK(run(ex)[0][0] != a[0][0]);
    }
  }
}

TEST_CASE("executor: evaluation of a partial batch equals the first rows of a full batch", "[executor]") {
  for (const char* model : {"resnet8", "mobilenetv2", "vgg11_bn"}) {
    DYNAMIC_SECTION(model) {
      const int64_t full = 8, part = 3;
      Graph g;
      build_model(g, small_spec(model, full, 32));
      auto be = make_cpu_backend();
      Executor ex(g, *be);
      init_parameters(ex, 11);
      ex.forward(full, false);
      fill_inputs(ex, 21);
      // A few training steps' worth of running statistics, so eval BN is not the identity.
      for (int b : g.buffers()) {
        Tensor t = ex.value(b);
        const bool var = g.value(b).name.find("running_var") != std::string::npos;
        for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = var ? 0.5f + 0.01f * float(i % 50) : 0.02f * float(i % 7 - 3);
      }
      std::vector<std::vector<float>> buffers_before;
      for (int b : g.buffers()) buffers_before.push_back(copy_of(ex.value(b)));

      ex.forward(full, false);
      const Tensor lf = ex.value(g.logits);
      const int64_t K = lf.dim(1);
      REQUIRE(lf.dim(0) == full);
      const std::vector<float> logits_full = copy_of(lf);

      ex.forward(part, false);
      const Tensor lp = ex.value(g.logits);
      REQUIRE(lp.dim(0) == part);
      double max_abs = 0, max_err = 0;
      for (int64_t i = 0; i < part * K; ++i) {
        max_abs = std::max(max_abs, std::fabs(double(logits_full[size_t(i)])));
        max_err = std::max(max_err, std::fabs(double(lp.f32()[i]) - double(logits_full[size_t(i)])));
      }
      INFO("partial vs full logits: max |err| " << max_err << " of max |logit| " << max_abs);
      CHECK(max_abs > 0);
      CHECK(max_err <= 1e-5 * max_abs);  // per-sample computation; only summation blocking may differ
      // The loss is the mean over the partial batch only.
      const Tensor labels = ex.value(g.label_input);
      double total = 0;
      for (int64_t n = 0; n < part; ++n) {
        const float* z = logits_full.data() + n * K;
        double m = -1e30, se = 0;
        for (int64_t k = 0; k < K; ++k) m = std::max(m, double(z[k]));
        for (int64_t k = 0; k < K; ++k) se += std::exp(double(z[k]) - m);
        total += m + std::log(se) - double(z[labels.i32()[n]]);
      }
      CHECK(ex.loss() == Approx(total / double(part)).epsilon(1e-5));
      // Evaluation leaves the BN running statistics alone.
      size_t i = 0;
      for (int b : g.buffers()) CHECK(copy_of(ex.value(b)) == buffers_before[i++]);
    }
  }
}

TEST_CASE("executor: a partial training batch equals a graph built for that batch", "[executor]") {
  const int64_t full = 8, part = 5;
  Graph gf, gp;
  build_model(gf, small_spec("resnet8", full, 16));
  build_model(gp, small_spec("resnet8", part, 16));
  auto be = make_cpu_backend();
  Executor ef(gf, *be), ep(gp, *be);
  init_parameters(ef, 8);
  init_parameters(ep, 8);
  ef.forward(full, false);
  ep.forward(part, false);
  fill_inputs(ef, 9);
  const Tensor xf = ef.value(gf.image_input), xp = ep.value(gp.image_input);
  std::memcpy(xp.f32(), xf.f32(), xp.nbytes());
  std::memcpy(ep.value(gp.label_input).i32(), ef.value(gf.label_input).i32(), size_t(part) * 4);
  ef.forward(part, true);
  ef.backward();
  ep.forward(part, true);
  ep.backward();
  CHECK(ef.loss() == Approx(ep.loss()).epsilon(1e-6));
  const std::vector<int> pf = gf.params(), pp = gp.params();
  REQUIRE(pf.size() == pp.size());
  for (size_t k = 0; k < pf.size(); ++k) {
    const Tensor a = ef.grad(pf[k]), b = ep.grad(pp[k]);
    double max_abs = 0, max_err = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      max_abs = std::max(max_abs, std::fabs(double(b.f32()[i])));
      max_err = std::max(max_err, std::fabs(double(a.f32()[i]) - double(b.f32()[i])));
    }
    INFO(gf.value(pf[k]).name << ": max |err| " << max_err << " of max |grad| " << max_abs);
    CHECK(max_err <= 1e-5 * max_abs);
  }
}

// Executor::PlanOnly (the budget's candidates): the plan of the executor that allocates, its
// report, saves and stash schedule, with nothing allocated, and no step.
TEST_CASE("executor: a plan-only executor plans what the allocated one does, holding nothing", "[executor]") {
  auto be = make_cpu_backend();
  Graph g;
  ModelSpec s = small_spec("resnet8", 4, 32);
  s.fusion.enabled = true;
  build_model(g, s);
  StashOptions so;
  so.format = StashFormat::BitmapF32;
  so.recompute_stack_outputs = true;
  const Executor real(g, *be, so), planned(g, *be, so, QuantOptions{}, Executor::PlanOnly{});
  CHECK(planned.memory().total == real.memory().total);
  CHECK(planned.memory().activations_planned == real.memory().activations_planned);
  CHECK(planned.memory().unpack == real.memory().unpack);
  CHECK(planned.stash().region_bytes() == real.stash().region_bytes());
  REQUIRE(planned.stash().saved().size() == real.stash().saved().size());
  for (size_t i = 0; i < real.stash().saved().size(); ++i) {
    CHECK(planned.stash().saved()[i].value == real.stash().saved()[i].value);
    CHECK(planned.stash().saved()[i].format == real.stash().saved()[i].format);
    CHECK(planned.stash().saved()[i].affine_relu == real.stash().saved()[i].affine_relu);
  }
  const auto a = real.stash_schedule(), b = planned.stash_schedule();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK((a[i].push == b[i].push && a[i].value == b[i].value));
  CHECK(planned.arena_resident_bytes() == 0);
  CHECK(planned.value(g.image_input).data == nullptr);  // views of nothing (a step aborts: ET_CHECK)
  CHECK(real.value(g.image_input).data != nullptr);
}

namespace {
// The CPU backend with a memory that refuses what would take it past `cap` bytes.
class CappedCpuBackend : public CpuBackend {
 public:
  explicit CappedCpuBackend(size_t cap) : memory_(cap) {}
  DeviceMemory& memory() override { return memory_; }

 private:
  test::CountedHostMemory memory_;
};
}  // namespace

TEST_CASE("executor: out of memory for the stash names its largest layer and memory.budget_mb", "[executor]") {
  Graph g;
  build_model(g, small_spec("resnet8", 4, 32));
  StashOptions so;
  so.format = StashFormat::BitmapF32;
  auto be = make_cpu_backend();
  const Executor planned(g, *be, so, QuantOptions{}, Executor::PlanOnly{});
  const size_t arena = planned.memory().total, region = planned.stash().region_bytes();
  REQUIRE(region > 0);
  const size_t page = host_memory().granularity(), rounded_arena = (arena + page - 1) / page * page;
  // Room for the arena but not for the stash region: the stash's message.
  CappedCpuBackend small(rounded_arena + region / 2);
  CHECK_THROWS_WITH(Executor(g, small, so), Catch::Contains("out of memory: could not allocate") &&
                                                Catch::Contains("the activation stash (") &&
                                                Catch::Contains("the largest, layer '") &&
                                                Catch::Contains("memory.budget_mb"));
  // Room for neither: the arena's, naming its largest buffer.
  CappedCpuBackend tiny(rounded_arena / 2);
  CHECK_THROWS_WITH(Executor(g, tiny, so), Catch::Contains("for the training step of this model") &&
                                               Catch::Contains("its largest buffer is layer '") &&
                                               Catch::Contains("memory.budget_mb"));
  // With the room for both it builds.
  CappedCpuBackend enough(rounded_arena + region + (64 << 20));
  CHECK_NOTHROW(Executor(g, enough, so));
}
