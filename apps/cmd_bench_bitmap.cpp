// `edgetrain bench bitmap`: BitTrain's Table 1 (docs/bitmap.md). For the paper's six activation
// shapes at batch 16 and 0 / 25 / 50 / 75 / 100 % non-zeros, the theoretical and the measured
// memory of a dense FP32 tensor and of its bitmap form, and the pack / unpack throughput beside
// memcpy. Measured = the increase of this process's USS when the tensor is materialised in freshly
// mapped pages (mmap, written, then munmap'ed so the next row starts clean). The last line of
// output is one JSON object {"rows": [...]}.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "engine/check.h"
#include "memory/bitmap.h"
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

// USS increase while `touch` writes a fresh mapping of `bytes` (read before munmap); median of 3.
template <typename F>
double uss_increase(size_t bytes, F&& touch) {
  double d[3];
  for (double& v : d) {
    const size_t u0 = read_uss_bytes();
    Mapping m(bytes);
    touch(m.p);
    v = double(read_uss_bytes()) - double(u0);
  }
  std::sort(d, d + 3);
  return d[1];
}

struct Shape {
  int64_t n, c, h, w;
};

}  // namespace

int cmd_bench_bitmap(const BenchBitmapArgs& a) {
  using namespace et::bitmap;
  if (a.threads > 0) set_threads(a.threads);
  const ValueType vt = a.fp16 ? ValueType::F16 : ValueType::F32;
  const int vb = value_bytes(vt);
  const std::vector<Shape> shapes = {{16, 3, 224, 224}, {16, 7, 112, 112}, {16, 64, 56, 56},
                                     {16, 128, 28, 28}, {16, 256, 14, 14}, {16, 512, 7, 7}};
  const std::vector<double> fractions = {0.0, 0.25, 0.5, 0.75, 1.0};

  // Warm-up: OpenMP's worker threads (and their stacks) exist before the first measurement.
  {
    std::vector<float> x(size_t(kParallelMinElements) * 2, 1.f), out(x.size());
    std::vector<uint64_t> bits(size_t(num_words(int64_t(x.size()))));
    std::vector<float> vals(x.size());
    pack(x.data(), int64_t(x.size()), 0.f, bits.data(), vals.data(), ValueType::F32);
    unpack(bits.data(), vals.data(), int64_t(x.size()), ValueType::F32, out.data());
  }

  std::printf("bitmap codec: %s path, %d threads, %s values, median of %d reps\n", simd_path(), threads(),
              a.fp16 ? "FP16" : "FP32", a.reps);
  std::printf("%-16s %5s | %9s %9s | %9s %7s | %9s %7s | %7s %7s %7s | %7s %7s\n", "shape", "nz%", "dense MB", "measured",
              "bitmap MB", "improv", "measured", "improv", "pack", "unpack", "memcpy", "pack", "unpack");
  std::printf("%-16s %5s | %9s %9s | %9s %7s | %9s %7s | %7s %7s %7s | %7s %7s\n", "", "", "theory", "USS", "theory", "%",
              "USS", "%", "GB/s", "GB/s", "GB/s", "1 thr", "1 thr");
  json rows = json::array();
  bool all_ok = true;
  double worst_gap = 0, worst_pack_ratio = 1e9;
  for (const Shape& s : shapes) {
    const int64_t n = s.n * s.c * s.h * s.w;
    const size_t dense_bytes = size_t(n) * 4;
    std::vector<float> src(static_cast<size_t>(n), 0.f);
    for (double frac : fractions) {
      const int64_t k = int64_t(std::llround(frac * double(n)));
      fill(src.data(), n, k, a.seed * 1000003u + uint64_t(n) + uint64_t(frac * 100));
      const double theory_dense = double(dense_bytes);
      const double theory_bitmap = double(n) / 8.0 + double(vb) * double(k);  // the paper's M_b

      // Dense: the FP32 tensor written into fresh pages.
      double measured_dense, memcpy_s;
      {
        measured_dense = uss_increase(dense_bytes, [&](void* p) { std::memcpy(p, src.data(), dense_bytes); });
        Mapping m(dense_bytes);
        std::memcpy(m.p, src.data(), dense_bytes);
        memcpy_s = median_seconds(a.reps, [&] { std::memcpy(m.p, src.data(), dense_bytes); });
      }
      // Bitmap: bitmap words + exactly nnz packed values, in fresh pages.
      double measured_bitmap, pack_s, unpack_s, pack1_s, unpack1_s;
      {
        const int64_t nnz = count_nonzero(src.data(), n);
        ET_CHECK(nnz == k, "fill produced ", nnz, " non-zeros, wanted ", k);
        measured_bitmap = uss_increase(bitmap_bytes(n, nnz, vt), [&](void* p) {
          uint64_t* bits = static_cast<uint64_t*>(p);
          pack(src.data(), n, 0.f, bits, bits + num_words(n), vt);
        });
        Mapping m(bitmap_bytes(n, nnz, vt));
        uint64_t* bits = static_cast<uint64_t*>(m.p);
        void* values = bits + num_words(n);
        const int64_t got = pack(src.data(), n, 0.f, bits, values, vt);
        ET_CHECK(got == nnz, "pack returned ", got, " values, expected ", nnz);
        pack_s = median_seconds(a.reps, [&] { pack(src.data(), n, 0.f, bits, values, vt); });
        Mapping out(dense_bytes);
        unpack(bits, values, n, vt, static_cast<float*>(out.p));  // faults the pages in
        if (!a.fp16 && std::memcmp(out.p, src.data(), dense_bytes) != 0)
          user_error("bench bitmap: unpack(pack(x)) != x for ", n, " elements");
        unpack_s = median_seconds(a.reps, [&] { unpack(bits, values, n, vt, static_cast<float*>(out.p)); });
        // The same on one thread (what a loaded machine or a single-core board sees).
        set_threads(1);
        pack1_s = median_seconds(a.reps, [&] { pack(src.data(), n, 0.f, bits, values, vt); });
        unpack1_s = median_seconds(a.reps, [&] { unpack(bits, values, n, vt, static_cast<float*>(out.p)); });
        set_threads(a.threads > 0 ? a.threads : 0);
      }
      const double ti = 100.0 * (1.0 - theory_bitmap / theory_dense);
      const double mi = 100.0 * (1.0 - measured_bitmap / measured_dense);
      const double pack_gbps = double(dense_bytes) / pack_s / 1e9, unpack_gbps = double(dense_bytes) / unpack_s / 1e9,
                   memcpy_gbps = double(dense_bytes) / memcpy_s / 1e9;
      const double pack1_gbps = double(dense_bytes) / pack1_s / 1e9, unpack1_gbps = double(dense_bytes) / unpack1_s / 1e9;
      // memcpy runs on one thread: the bandwidth target compares the one-thread pack with it.
      const bool ok = std::fabs(mi - ti) <= 2.0 && pack1_gbps >= 0.5 * memcpy_gbps;
      all_ok = all_ok && ok;
      worst_gap = std::max(worst_gap, std::fabs(mi - ti));
      worst_pack_ratio = std::min(worst_pack_ratio, pack1_gbps / memcpy_gbps);
      char shape[64];
      std::snprintf(shape, sizeof(shape), "%lldx%lldx%lldx%lld", (long long)s.n, (long long)s.c, (long long)s.h,
                    (long long)s.w);
      std::printf("%-16s %5.0f | %9.2f %9.2f | %9.2f %7.2f | %9.2f %7.2f | %7.2f %7.2f %7.2f | %7.2f %7.2f%s\n", shape,
                  frac * 100, theory_dense / kMiB, measured_dense / kMiB, theory_bitmap / kMiB, ti, measured_bitmap / kMiB,
                  mi, pack_gbps, unpack_gbps, memcpy_gbps, pack1_gbps, unpack1_gbps, ok ? "" : "  <-- off target");
      rows.push_back({{"shape", shape},
                      {"nonzero", frac},
                      {"theory_dense_mb", theory_dense / kMiB},
                      {"theory_bitmap_mb", theory_bitmap / kMiB},
                      {"measured_dense_mb", measured_dense / kMiB},
                      {"measured_bitmap_mb", measured_bitmap / kMiB},
                      {"theory_improvement_pct", ti},
                      {"measured_improvement_pct", mi},
                      {"pack_gbps", pack_gbps},
                      {"unpack_gbps", unpack_gbps},
                      {"memcpy_gbps", memcpy_gbps},
                      {"pack_1t_gbps", pack1_gbps},
                      {"unpack_1t_gbps", unpack1_gbps}});
    }
  }
  std::printf("worst |measured - theory| improvement: %.2f pp (target <= 2); slowest 1-thread pack / memcpy: %.2f (target >= 0.5)%s\n",
              worst_gap, worst_pack_ratio, all_ok ? "" : "; some rows off target");
  json j = {{"rows", rows}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace et::app
