#include "engine/init.h"

#include <cmath>
#include <random>

#include "engine/executor.h"
#include "engine/host_view.h"

namespace et {

static uint64_t hash_name(const std::string& s) {  // FNV-1a
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

void init_parameters(Executor& ex, uint64_t seed) {
  const Graph& g = ex.graph();
  for (int id = 0; id < g.num_values(); ++id) {
    const Value& v = g.value(id);
    if (v.kind != ValueKind::Param && v.kind != ValueKind::Buffer) continue;
    Tensor t = ex.value(id);
    const HostView view(ex.backend(), t, HostView::Write);
    float* p = view.f32();
    const int64_t n = t.numel();
    std::mt19937_64 rng(seed ^ hash_name(v.name));
    switch (v.init) {
      case ParamInit::None:
      case ParamInit::Zeros:
        for (int64_t i = 0; i < n; ++i) p[i] = 0.f;
        break;
      case ParamInit::Ones:
        for (int64_t i = 0; i < n; ++i) p[i] = 1.f;
        break;
      case ParamInit::KaimingNormalFanOut: {
        std::normal_distribution<float> d(0.f, std::sqrt(2.f / float(v.init_fan)));
        for (int64_t i = 0; i < n; ++i) p[i] = d(rng);
        break;
      }
      case ParamInit::UniformFanIn: {
        const float b = 1.f / std::sqrt(float(v.init_fan));
        std::uniform_real_distribution<float> d(-b, b);
        for (int64_t i = 0; i < n; ++i) p[i] = d(rng);
        break;
      }
    }
    if (v.kind == ValueKind::Param && !v.frozen)  // frozen ones have no optimizer state
      for (int s = 0; s < 1; ++s) {
        Tensor m = ex.opt_slot(id, s);
        ex.backend().fill(m, 0.f);
      }
  }
}

}  // namespace et
