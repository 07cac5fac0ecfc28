// A training step after the first allocates nothing: every global operator new is counted (the
// engine's C++ containers), and malloc / calloc / realloc / posix_memalign / aligned_alloc calls
// made from the engine's own objects (Eigen is header-only, so its buffers count too) are
// redirected through the linker's --wrap (see tests/CMakeLists.txt).
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <new>

#include "engine/train/trainer.h"
#include "tests/tiny_training.h"

namespace {
std::atomic<long> g_allocs{0};
std::atomic<bool> g_counting{false};
inline void note() {
  if (g_counting.load(std::memory_order_relaxed)) g_allocs.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

extern "C" {
void* __real_malloc(size_t);
void* __real_calloc(size_t, size_t);
void* __real_realloc(void*, size_t);
int __real_posix_memalign(void**, size_t, size_t);
void* __real_aligned_alloc(size_t, size_t);
void* __wrap_malloc(size_t n) { note(); return __real_malloc(n); }
void* __wrap_calloc(size_t a, size_t b) { note(); return __real_calloc(a, b); }
void* __wrap_realloc(void* p, size_t n) { note(); return __real_realloc(p, n); }
int __wrap_posix_memalign(void** p, size_t a, size_t n) { note(); return __real_posix_memalign(p, a, n); }
void* __wrap_aligned_alloc(size_t a, size_t n) { note(); return __real_aligned_alloc(a, n); }
}

// Not inlined: otherwise GCC sees the malloc inside operator new, or the free inside operator
// delete, at the call sites and reports the pairs new / free (or malloc / delete) as mismatched
// (-Wmismatched-new-delete). As calls, every new meets its own delete.
[[gnu::noinline]] void* operator new(size_t n) {
  note();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void* operator new[](size_t n) { return operator new(n); }
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, size_t) noexcept { std::free(p); }

using namespace et;

static long allocations_in_steps(const std::string& model, int64_t batch, StashFormat stash = StashFormat::DenseF32,
                                 int checkpoint_every = 0, bool release_pages = false, const QuantOptions& quant = {},
                                 bool fused = false, bool recompute_stack_outputs = false) {
  StashOptions opt;
  opt.format = stash;
  opt.recompute_stack_outputs = recompute_stack_outputs;
  opt.checkpoint_every = checkpoint_every;
  opt.release_pages = release_pages;
  FusionSpec fusion;
  fusion.enabled = fused;
  test::TinyTraining t(model, batch, opt, 3, 0, 1, quant, fusion);
  Executor& ex = *t.ex;
  auto step = [&](int s) {
    ex.set_step_seed(uint64_t(s));
    ex.forward(batch, true);
    ex.backward();
    t.sgd(0.01f, s == 0);
    ex.forward(batch / 2, false);  // evaluation with a partial batch, too
  };
  step(0);
  g_allocs = 0;
  g_counting = true;
  step(1);
  step(2);
  g_counting = false;
  return g_allocs.load();
}

TEST_CASE("training steps after the first allocate nothing", "[memory]") {
  // Guard: the counter does see engine allocations.
  g_allocs = 0;
  g_counting = true;
  { std::vector<int> v(10); (void)v; }
  g_counting = false;
  REQUIRE(g_allocs.load() >= 1);

  CHECK(allocations_in_steps("resnet8", 16) == 0);
  CHECK(allocations_in_steps("vgg11_bn", 8) == 0);
  CHECK(allocations_in_steps("mobilenetv2", 4) == 0);
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::BitmapF16) == 0);
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::Auto) == 0);
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::DenseBF16) == 0);
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::BitmapF16, 1, true) == 0);  // recompute, release
  CHECK(allocations_in_steps("mobilenetv2", 4, StashFormat::BitmapF32, 2) == 0);
  // Fused stacks whose outputs the backward recomputes (memory.recompute_stack_outputs).
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::DenseF32, 0, false, {}, true, true) == 0);
  CHECK(allocations_in_steps("vgg11_bn", 8, StashFormat::Auto, 0, false, {}, true, true) == 0);
  // 4-bit training: codes, scales and dequantised copies are planned buffers too.
  QuantOptions luq;
  luq.forward = ForwardQuant::Int4;
  luq.backward = BackwardQuant::LuqFp4;
  luq.smp_samples = 2;
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::DenseF32, 0, false, luq) == 0);
  CHECK(allocations_in_steps("vgg11_bn", 8, StashFormat::BitmapF16, 0, false, luq) == 0);
  CHECK(allocations_in_steps("mobilenetv2", 4, StashFormat::DenseF32, 0, false, luq) == 0);  // depthwise fallback
  // bitmap_int4: codes encoded into and decoded from the stash, BN inputs recomputed.
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::BitmapI4, 0, false, luq) == 0);
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::BitmapI4, 0, true, luq) == 0);  // release pages
  CHECK(allocations_in_steps("vgg11_bn", 8, StashFormat::Auto, 0, false, luq) == 0);
  CHECK(allocations_in_steps("mobilenetv2", 4, StashFormat::BitmapI4, 0, false, luq) == 0);
  QuantOptions fwd_only = luq;
  fwd_only.backward = BackwardQuant::Fp32;
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::BitmapF32, 1, false, fwd_only) == 0);
  // FNT (the trainer's executor for the last quant.fnt_epochs): weight codes and their f32 copies.
  QuantOptions fnt = luq;
  fnt.fnt = true;
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::BitmapF32, 0, false, fnt) == 0);
  CHECK(allocations_in_steps("mobilenetv2", 4, StashFormat::DenseF32, 1, false, fnt) == 0);  // depthwise, recompute
  // Fused stacks (docs/fusion.md): their scratch is the planned workspace.
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::Auto, 0, false, {}, true) == 0);
  CHECK(allocations_in_steps("vgg11_bn", 8, StashFormat::DenseF32, 0, false, {}, true) == 0);
  CHECK(allocations_in_steps("vgg11", 8, StashFormat::Auto, 0, false, {}, true) == 0);  // ReLU + pool stacks
  CHECK(allocations_in_steps("mobilenetv2", 4, StashFormat::BitmapF16, 1, true, {}, true) == 0);
  CHECK(allocations_in_steps("resnet8", 16, StashFormat::BitmapI4, 0, false, luq, true) == 0);
}

// The trainer's step adds the divergence guard's checks (loss, gradients, update) to the above.
static long allocations_in_trainer_steps(const nlohmann::json& quant) {
  auto data = std::make_shared<Dataset>();
  data->size = 16;
  data->channels = 3;
  data->height = data->width = 32;
  data->pixels.assign(size_t(16) * 3072, 0);
  for (size_t i = 0; i < data->pixels.size(); ++i) data->pixels[i] = uint8_t(i * 2654435761u >> 24);
  data->labels.assign(16, 0);
  for (int i = 0; i < 16; ++i) data->labels[size_t(i)] = i % 10;
  const Config cfg = parse_config({{"model", {{"name", "resnet8"}}},
                                   {"data", {{"format", "cifar10_binary"}, {"root", "x"}}},
                                   {"train", {{"batch_size", 16}, {"threads", 2}}},
                                   {"quant", quant}},
                                  "<test>");
  Trainer t(cfg, data, data);
  REQUIRE(t.train_step(16, 0.05f));
  g_allocs = 0;
  g_counting = true;
  const bool ok = t.train_step(16, 0.05f) && t.train_step(16, 0.05f);
  g_counting = false;
  REQUIRE(ok);
  return g_allocs.load();
}

TEST_CASE("the trainer's guarded steps allocate nothing", "[memory][divergence]") {
  CHECK(allocations_in_trainer_steps(nlohmann::json::object()) == 0);
  CHECK(allocations_in_trainer_steps({{"forward", "int4"}, {"backward", "luq_fp4"}}) == 0);
}
