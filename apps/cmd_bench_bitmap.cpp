// `edgetrain bench bitmap`: BitTrain's Table 1 (docs/bitmap.md). For the paper's six activation
// shapes at batch 16 and 0 / 25 / 50 / 75 / 100 % non-zeros, the theoretical and the measured
// memory of a dense FP32 tensor and of its bitmap form, and the pack / unpack throughput beside
// memcpy. Measured through the engine's own objects: the dense tensor as dense_fp32 keeps it (the
// forward buffer in an executor Arena), the bitmap as the training step stores it (pushed into a
// real Stash in bitmap_fp32 / bitmap_fp16), each as the resident bytes of its mapping (mincore)
// and as the increase of this process's USS; the stash's copy is read back (Stash::get) and
// compared. The last line of output is one JSON object {"rows": [...]}.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "engine/check.h"
#include "memory/arena.h"
#include "memory/bitmap.h"
#include "memory/stash.h"
#include "memory/uss.h"

namespace et::app {
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr double kMiB = 1048576.0;

// Fresh anonymous pages (no transparent huge pages: USS must move by 4 KiB pages, as planned).
struct Mapping {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Mapping(size_t n) : bytes(std::max<size_t>(n, 1)) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) user_error("bench bitmap: could not map ", bytes, " bytes");
    madvise(p, bytes, MADV_NOHUGEPAGE);
  }
  ~Mapping() { munmap(p, bytes); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

// Exactly k non-zeros at random positions (selection sampling), values in (0, 1] like a ReLU output.
void fill(float* x, int64_t n, int64_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int64_t left = k;
  for (int64_t i = 0; i < n; ++i) {
    if (left > 0 && u(rng) * double(n - i) < double(left)) {
      x[i] = float(1.0 - u(rng) * 0.999);
      --left;
    } else {
      x[i] = 0.f;
    }
  }
}

template <typename F>
double median_seconds(int reps, F&& f) {
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

struct Dims {
  int64_t n, c, h, w;
};

// A tensor held by the engine: the resident bytes of its mapping (mincore) and the USS increase
// while it is held (median of 3 trials; nullopt where USS cannot be read).
struct Held {
  double resident = 0;
  std::optional<double> uss;
  double stored = 0;  // bytes the stash records for it (the encoding, unpadded)
};

std::optional<double> median3(std::vector<double> v) {
  if (v.size() < 3) return std::nullopt;
  std::sort(v.begin(), v.end());
  return v[1];
}

// Dense FP32 as dense_fp32 keeps it: the forward buffer in an executor arena (zero copy).
Held hold_dense(const std::vector<float>& src) {
  const size_t bytes = src.size() * 4;
  Held h;
  std::vector<double> uss;
  for (int trial = 0; trial < 3; ++trial) {
    const auto u0 = read_uss_bytes();
    Arena arena;
    arena.reserve(bytes, "bench bitmap: a dense tensor");
    std::memcpy(arena.at(0), src.data(), bytes);
    const auto u1 = read_uss_bytes();
    h.resident = double(arena.resident_bytes());
    if (u0 && u1) uss.push_back(double(*u1) - double(*u0));
  }
  h.uss = median3(uss);
  h.stored = double(bytes);
  return h;
}

// The tensor pushed into a real Stash planned for it alone (`format`, pages released on pop),
// read back into `decoded` and popped.
Held hold_in_stash(const std::vector<float>& src, const Dims& d, StashFormat format, std::vector<float>& decoded) {
  const Shape shape{d.n, d.c, d.h, d.w};
  Held h;
  std::vector<double> uss;
  for (int trial = 0; trial < 3; ++trial) {
    Stash stash;
    SavedValue sv;
    sv.value = 0;
    sv.numel = shape.numel();
    sv.full = true;
    sv.format = format;
    sv.unpack = Tensor::contiguous(decoded.data(), shape);
    stash.configure({sv}, 1, 0.f, true);
    const auto u0 = read_uss_bytes();
    stash.push(0, Tensor::contiguous(const_cast<float*>(src.data()), shape));
    const auto u1 = read_uss_bytes();
    h.resident = double(stash.region_resident_bytes());
    h.stored = double(stash.record(0).bytes);
    if (u0 && u1) uss.push_back(double(*u1) - double(*u0));
    stash.get(0);  // decodes into `decoded`
    stash.pop(0);
  }
  h.uss = median3(uss);
  return h;
}

json mb_or_null(std::optional<double> b) { return b ? json(*b / kMiB) : json(); }
double improvement(double bitmap, double dense) { return 100.0 * (1.0 - bitmap / dense); }

}  // namespace

int cmd_bench_bitmap(const BenchBitmapArgs& a) {
  using namespace et::bitmap;
  if (a.threads > 0) set_threads(a.threads);
  const ValueType vt = a.fp16 ? ValueType::F16 : ValueType::F32;
  const int vb = value_bytes(vt);
  const std::vector<Dims> shapes = {{16, 3, 224, 224}, {16, 7, 112, 112}, {16, 64, 56, 56},
                                    {16, 128, 28, 28}, {16, 256, 14, 14}, {16, 512, 7, 7}};
  const std::vector<double> fractions = {0.0, 0.25, 0.5, 0.75, 1.0};
  const StashFormat format = a.fp16 ? StashFormat::BitmapF16 : StashFormat::BitmapF32;

  // Warm-up: OpenMP's worker threads (and their stacks) exist before the first measurement.
  {
    std::vector<float> x(size_t(kParallelMinElements) * 2, 1.f), out(x.size());
    std::vector<uint64_t> bits(size_t(num_words(int64_t(x.size()))));
    std::vector<float> vals(x.size());
    pack(x.data(), int64_t(x.size()), 0.f, bits.data(), vals.data(), ValueType::F32);
    unpack(bits.data(), vals.data(), int64_t(x.size()), ValueType::F32, out.data());
  }
  const bool have_uss = read_uss_bytes().has_value();

  std::printf("bitmap codec: %s path, %d threads, %s values, median of %d reps; memory: resident bytes of the "
              "arena (dense) and of a %s stash's mapping, and USS increase%s\n",
              simd_path(), threads(), a.fp16 ? "FP16" : "FP32", a.reps, stash_format_name(format),
              have_uss ? "" : " (USS unavailable: no /proc/self/smaps_rollup or smaps)");
  std::printf("%-16s %5s | %8s %8s %8s | %8s %7s | %8s %7s | %8s %7s | %6s %6s %6s | %6s %6s\n", "shape", "nz%",
              "dense MB", "", "", "bitmap", "improv", "stash", "improv", "bitmap", "improv", "pack", "unpack",
              "memcpy", "pack", "unpack");
  std::printf("%-16s %5s | %8s %8s %8s | %8s %7s | %8s %7s | %8s %7s | %6s %6s %6s | %6s %6s\n", "", "", "theory",
              "arena", "USS", "theory", "%", "resident", "%", "USS", "%", "GB/s", "GB/s", "GB/s", "1 thr", "1 thr");
  json rows = json::array();
  bool all_ok = true;
  double worst_gap = 0, worst_pack_ratio = 1e9;
  for (const Dims& s : shapes) {
    const int64_t n = s.n * s.c * s.h * s.w;
    const size_t dense_bytes = size_t(n) * 4;
    std::vector<float> src(static_cast<size_t>(n), 0.f), decoded(static_cast<size_t>(n), 0.f);
    for (double frac : fractions) {
      const int64_t k = int64_t(std::llround(frac * double(n)));
      fill(src.data(), n, k, a.seed * 1000003u + uint64_t(n) + uint64_t(frac * 100));
      const double theory_dense = double(dense_bytes);
      const double theory_bitmap = double(n) / 8.0 + double(vb) * double(k);  // the paper's M_b

      // Memory, through the engine's own arena and stash.
      const Held dense = hold_dense(src);
      const int64_t nnz = count_nonzero(src.data(), n);
      ET_CHECK(nnz == k, "fill produced ", nnz, " non-zeros, wanted ", k);
      const Held stash = hold_in_stash(src, s, format, decoded);
      if (!a.fp16 && std::memcmp(decoded.data(), src.data(), dense_bytes) != 0)
        user_error("bench bitmap: the stash's copy of ", n, " elements does not read back bit for bit");
      // Throughput of the codec on already-faulted buffers.
      double memcpy_s;
      {
        Mapping m(dense_bytes);
        std::memcpy(m.p, src.data(), dense_bytes);
        memcpy_s = median_seconds(a.reps, [&] { std::memcpy(m.p, src.data(), dense_bytes); });
      }
      double pack_s, unpack_s, pack1_s, unpack1_s;
      {
        Mapping m(bitmap_bytes(n, nnz, vt));
        uint64_t* bits = static_cast<uint64_t*>(m.p);
        void* values = bits + num_words(n);
        const int64_t got = pack(src.data(), n, 0.f, bits, values, vt);
        ET_CHECK(got == nnz, "pack returned ", got, " values, expected ", nnz);
        pack_s = median_seconds(a.reps, [&] { pack(src.data(), n, 0.f, bits, values, vt); });
        Mapping out(dense_bytes);
        unpack(bits, values, n, vt, static_cast<float*>(out.p));  // faults the pages in
        unpack_s = median_seconds(a.reps, [&] { unpack(bits, values, n, vt, static_cast<float*>(out.p)); });
        // The same on one thread (what a loaded machine or a single-core board sees).
        set_threads(1);
        pack1_s = median_seconds(a.reps, [&] { pack(src.data(), n, 0.f, bits, values, vt); });
        unpack1_s = median_seconds(a.reps, [&] { unpack(bits, values, n, vt, static_cast<float*>(out.p)); });
        set_threads(a.threads > 0 ? a.threads : 0);
      }
      const double ti = improvement(theory_bitmap, theory_dense);
      const double mi = improvement(stash.resident, dense.resident);
      // A flag and a plain double rather than std::optional<double>: GCC 12 reports a false
      // -Wmaybe-uninitialized on the optional's value where it is copied into the JSON row.
      const bool has_ui = dense.uss && stash.uss;
      const double ui = has_ui ? improvement(*stash.uss, *dense.uss) : 0.0;
      const double pack_gbps = double(dense_bytes) / pack_s / 1e9, unpack_gbps = double(dense_bytes) / unpack_s / 1e9,
                   memcpy_gbps = double(dense_bytes) / memcpy_s / 1e9;
      const double pack1_gbps = double(dense_bytes) / pack1_s / 1e9, unpack1_gbps = double(dense_bytes) / unpack1_s / 1e9;
      // memcpy runs on one thread: the bandwidth target compares the one-thread pack with it.
      const bool ok =
          std::fabs(mi - ti) <= 2.0 && (!has_ui || std::fabs(ui - ti) <= 2.0) && pack1_gbps >= 0.5 * memcpy_gbps;
      all_ok = all_ok && ok;
      worst_gap = std::max(worst_gap, std::max(std::fabs(mi - ti), has_ui ? std::fabs(ui - ti) : 0.0));
      worst_pack_ratio = std::min(worst_pack_ratio, pack1_gbps / memcpy_gbps);
      char shape[64], dense_uss[16] = "n/a", stash_uss[16] = "n/a", uss_imp[16] = "n/a";
      std::snprintf(shape, sizeof(shape), "%lldx%lldx%lldx%lld", (long long)s.n, (long long)s.c, (long long)s.h,
                    (long long)s.w);
      if (dense.uss) std::snprintf(dense_uss, sizeof(dense_uss), "%.2f", *dense.uss / kMiB);
      if (stash.uss) std::snprintf(stash_uss, sizeof(stash_uss), "%.2f", *stash.uss / kMiB);
      if (has_ui) std::snprintf(uss_imp, sizeof(uss_imp), "%.2f", ui);
      std::printf("%-16s %5.0f | %8.2f %8.2f %8s | %8.2f %7.2f | %8.2f %7.2f | %8s %7s | %6.1f %6.1f %6.1f | %6.1f %6.1f%s\n",
                  shape, frac * 100, theory_dense / kMiB, dense.resident / kMiB, dense_uss, theory_bitmap / kMiB, ti,
                  stash.resident / kMiB, mi, stash_uss, uss_imp, pack_gbps, unpack_gbps, memcpy_gbps, pack1_gbps,
                  unpack1_gbps, ok ? "" : "  <-- off target");
      rows.push_back({{"shape", shape},
                      {"nonzero", frac},
                      {"theory_dense_mb", theory_dense / kMiB},
                      {"theory_bitmap_mb", theory_bitmap / kMiB},
                      {"arena_resident_dense_mb", dense.resident / kMiB},
                      {"stash_stored_mb", stash.stored / kMiB},
                      {"stash_resident_mb", stash.resident / kMiB},
                      {"uss_dense_mb", mb_or_null(dense.uss)},
                      {"uss_stash_mb", mb_or_null(stash.uss)},
                      {"theory_improvement_pct", ti},
                      {"measured_improvement_pct", mi},
                      {"uss_improvement_pct", has_ui ? json(ui) : json()},
                      {"pack_gbps", pack_gbps},
                      {"unpack_gbps", unpack_gbps},
                      {"memcpy_gbps", memcpy_gbps},
                      {"pack_1t_gbps", pack1_gbps},
                      {"unpack_1t_gbps", unpack1_gbps}});
    }
  }
  std::printf("worst |measured - theory| improvement (stash resident, USS): %.2f pp (target <= 2); slowest 1-thread "
              "pack / memcpy: %.2f (target >= 0.5)%s\n",
              worst_gap, worst_pack_ratio, all_ok ? "" : "; some rows off target");
  json j = {{"rows", rows}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace et::app
