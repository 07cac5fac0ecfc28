// Bitmap codec ([bitmap]): every compiled path and the threaded dispatch against the scalar
// reference, bit for bit; special values; FP16 rounding; pruning; sizes.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "memory/bitmap.h"
#include "memory/stored_reader.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

using namespace et::bitmap;

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

std::vector<const Impl*> impls() {
  std::vector<const Impl*> v{&scalar_impl()};
  for (const Impl* i : {&avx2_impl(), &avx512_impl(), &neon_impl()})
    if (i->available) v.push_back(i);
  return v;
}

struct Encoded {
  std::vector<uint64_t> bits;
  std::vector<uint8_t> values;
  int64_t nnz = 0;
};

// Scalar reference encoding. Buffers get guard bytes past the exact size, checked afterwards.
constexpr uint8_t kGuard = 0xA5;
constexpr size_t kGuardBytes = 64;

Encoded encode_ref(const std::vector<float>& x, float thr, ValueType t) {
  Encoded e;
  const int64_t n = int64_t(x.size());
  e.bits.assign(size_t(num_words(n)) + 1, 0);
  e.values.assign(size_t(n) * 4 + 8, 0);
  e.nnz = scalar_impl().pack(x.data(), n, thr, e.bits.data(), e.values.data(), t);
  e.bits.resize(size_t(num_words(n)));
  e.values.resize(size_t(e.nnz) * size_t(value_bytes(t)));
  return e;
}

bool guards_ok(const std::vector<uint8_t>& buf, size_t used) {
  for (size_t i = used; i < buf.size(); ++i)
    if (buf[i] != kGuard) return false;
  return true;
}

// Encodes x with every path (one-pass pack, make_bits + pack_values) and the dispatching
// functions; all must equal the reference, write nothing past the exact size, and decode to the
// reference's decoding.
void check_all_paths(const std::vector<float>& x, float thr, ValueType t) {
  const int64_t n = int64_t(x.size());
  const Encoded ref = encode_ref(x, thr, t);
  REQUIRE(ref.nnz == count_nonzero(x.data(), n, thr));
  REQUIRE(ref.nnz == popcount(ref.bits.data(), n));
  if (n % 64) REQUIRE((ref.bits.back() >> (n % 64)) == 0);  // bits past n are zero
  std::vector<float> ref_out(x.size(), -1.f);
  scalar_impl().unpack(ref.bits.data(), ref.values.data(), n, t, ref_out.data());

  const size_t vbytes = size_t(ref.nnz) * size_t(value_bytes(t));
  auto check = [&](const char* what, auto&& run_pack) {
    INFO(what << " n=" << n << " thr=" << thr << " type=" << int(t));
    std::vector<uint64_t> bits(size_t(num_words(n)) + 1, ~uint64_t(0));
    std::vector<uint8_t> values(vbytes + kGuardBytes, kGuard);
    const int64_t nnz = run_pack(bits.data(), values.data());
    REQUIRE(nnz == ref.nnz);
    REQUIRE(bits.back() == ~uint64_t(0));
    bits.pop_back();
    REQUIRE(bits == ref.bits);
    REQUIRE(guards_ok(values, vbytes));
    REQUIRE(std::memcmp(values.data(), ref.values.data(), vbytes) == 0);
  };
  for (const Impl* k : impls()) {
    check(k->name, [&](uint64_t* b, void* v) { return k->pack(x.data(), n, thr, b, v, t); });
    check(k->name, [&](uint64_t* b, void* v) {
      const int64_t c = k->make_bits(x.data(), n, thr, b);
      k->pack_values(x.data(), b, n, v, t);
      return c;
    });
    std::vector<float> out(x.size() + 16, -7.f);
    k->unpack(ref.bits.data(), ref.values.data(), n, t, out.data());
    for (size_t i = x.size(); i < out.size(); ++i) REQUIRE(bits_of(out[i]) == bits_of(-7.f));
    out.resize(x.size());
    INFO("unpack " << k->name << " n=" << n);
    REQUIRE(same_bits(out, ref_out));
  }
  for (int threads : {1, 2, 3}) {
    set_threads(threads);
    check("dispatch pack", [&](uint64_t* b, void* v) { return pack(x.data(), n, thr, b, v, t); });
    check("dispatch make_bits+pack_values", [&](uint64_t* b, void* v) {
      const int64_t c = make_bits(x.data(), n, thr, b);
      pack_values(x.data(), b, n, v, t);
      return c;
    });
    std::vector<float> out(x.size(), -7.f);
    unpack(ref.bits.data(), ref.values.data(), n, t, out.data());
    REQUIRE(same_bits(out, ref_out));
  }
  set_threads(0);
}

// Expected decoding of one element by the format's definition.
float expected_f32(float x, float thr) {
  const uint32_t a = bits_of(x) & 0x7FFFFFFFu;
  if (a == 0) return 0.f;
  if (thr > 0 && !std::isnan(x) && std::fabs(x) < thr) return 0.f;
  return x;
}

std::vector<float> random_tensor(int64_t n, double nonzero, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n), 0.f);
  for (auto& v : x) v = u(rng) < nonzero ? g(rng) : 0.f;
  return x;
}

}  // namespace

TEST_CASE("bitmap sizes", "[bitmap]") {
  CHECK(num_words(0) == 0);
  CHECK(num_words(1) == 1);
  CHECK(num_words(64) == 1);
  CHECK(num_words(65) == 2);
  CHECK(bitmap_bytes(0, 0, ValueType::F32) == 0);
  CHECK(bitmap_bytes(1, 1, ValueType::F32) == 12);
  CHECK(bitmap_bytes(65, 10, ValueType::F32) == 16 + 40);
  CHECK(bitmap_bytes(65, 10, ValueType::F16) == 16 + 20);
  // Paper (Table 1): 16 x 3 x 224 x 224 at 50 % non-zeros: n / 8 + 4 nnz bytes = 4.88 MB.
  const int64_t n = 16 * 3 * 224 * 224;
  CHECK(bitmap_bytes(n, n / 2, ValueType::F32) == size_t(n / 8 + 4 * (n / 2)));
  CHECK(std::fabs(bitmap_bytes(n, n / 2, ValueType::F32) / 1048576.0 - 4.88) < 0.005);
  CHECK(bitmap_bytes(n, 0, ValueType::F32) * 32 == size_t(n) * 4);  // 96.88 % smaller
  INFO("path " << simd_path());
  CHECK(best_impl().available);
}

TEST_CASE("bitmap round trips at awkward lengths", "[bitmap]") {
  for (int64_t n : {0, 1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 1000, 4097}) {
    for (double nz : {0.0, 0.1, 0.5, 0.9, 1.0}) {
      const auto x = random_tensor(n, nz, uint64_t(n * 131 + int64_t(nz * 10)));
      for (ValueType t : {ValueType::F32, ValueType::F16}) check_all_paths(x, 0.f, t);
    }
  }
}

TEST_CASE("bitmap all zeros and no zeros", "[bitmap]") {
  for (int64_t n : {1, 64, 65, 1000}) {
    std::vector<float> zeros(size_t(n), 0.f), ones(size_t(n), 1.5f);
    const Encoded ez = encode_ref(zeros, 0.f, ValueType::F32);
    CHECK(ez.nnz == 0);
    for (uint64_t w : ez.bits) CHECK(w == 0);
    const Encoded eo = encode_ref(ones, 0.f, ValueType::F32);
    CHECK(eo.nnz == n);
    check_all_paths(zeros, 0.f, ValueType::F32);
    check_all_paths(ones, 0.f, ValueType::F32);
    check_all_paths(ones, 0.f, ValueType::F16);
  }
}

TEST_CASE("bitmap random sparsity 0-100 % and large tensors", "[bitmap]") {
  for (int pct = 0; pct <= 100; pct += 5) {
    const auto x = random_tensor(10007, pct / 100.0, uint64_t(pct));
    check_all_paths(x, 0.f, ValueType::F32);
    check_all_paths(x, 0.f, ValueType::F16);
  }
  const int64_t big = (int64_t(1) << 20) + 3;  // above the threading threshold, not a multiple of 64
  for (double nz : {0.0, 0.3, 1.0}) {
    const auto x = random_tensor(big, nz, 99);
    check_all_paths(x, 0.f, ValueType::F32);
    check_all_paths(x, 0.f, ValueType::F16);
    check_all_paths(x, 0.5f, ValueType::F32);
  }
}

TEST_CASE("bitmap special values are bit-exact in FP32", "[bitmap]") {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = {0.f,
                          -0.f,
                          1.f,
                          -1.f,
                          inf,
                          -inf,
                          from_bits(0x7FC00000u),  // quiet NaN
                          from_bits(0xFFC12345u),  // negative quiet NaN with payload
                          from_bits(0x7F800001u),  // signalling NaN, smallest payload
                          from_bits(0x7FA5A5A5u),  // signalling NaN with payload
                          from_bits(0x00000001u),  // smallest denormal
                          from_bits(0x80000001u),
                          from_bits(0x007FFFFFu),  // largest denormal
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max()};
  // Repeat at every offset within a 64-element word and past it.
  std::vector<float> big;
  for (int r = 0; r < 13; ++r) big.insert(big.end(), x.begin(), x.end());
  big.push_back(-0.f);
  check_all_paths(big, 0.f, ValueType::F32);
  check_all_paths(big, 0.f, ValueType::F16);

  const int64_t n = int64_t(big.size());
  std::vector<uint64_t> bits(size_t(num_words(n)));
  std::vector<float> values(big.size()), out(big.size());
  const int64_t nnz = pack(big.data(), n, 0.f, bits.data(), values.data(), ValueType::F32);
  unpack(bits.data(), values.data(), n, ValueType::F32, out.data());
  int64_t expect_nnz = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool zero = (bits_of(big[size_t(i)]) & 0x7FFFFFFFu) == 0;
    expect_nnz += !zero;
    INFO("element " << i << " bits " << std::hex << bits_of(big[size_t(i)]));
    CHECK(((bits[size_t(i / 64)] >> (i % 64)) & 1) == uint64_t(!zero));
    // -0.0 decodes as +0.0; everything else, NaN payloads included, is bit-exact.
    CHECK(bits_of(out[size_t(i)]) == (zero ? 0u : bits_of(big[size_t(i)])));
  }
  CHECK(nnz == expect_nnz);
}

TEST_CASE("bitmap pruning", "[bitmap]") {
  const float inf = std::numeric_limits<float>::infinity();
  for (float thr : {0.01f, 0.05f, 0.1f, 1.f}) {
    auto x = random_tensor(5003, 0.8, 7);
    x[0] = thr;             // exactly at the threshold: kept
    x[1] = -thr;            // kept
    x[2] = std::nextafter(thr, 0.f);  // just below: pruned
    x[3] = -x[2];
    x[4] = from_bits(0x7FC00001u);  // NaN is kept
    x[5] = -inf;
    x[6] = from_bits(0x00000010u);  // denormal: pruned
    check_all_paths(x, thr, ValueType::F32);
    check_all_paths(x, thr, ValueType::F16);
    const int64_t n = int64_t(x.size());
    std::vector<uint64_t> bits(size_t(num_words(n)));
    std::vector<float> values(x.size()), out(x.size());
    const int64_t nnz = pack(x.data(), n, thr, bits.data(), values.data(), ValueType::F32);
    unpack(bits.data(), values.data(), n, ValueType::F32, out.data());
    int64_t expect = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float e = expected_f32(x[size_t(i)], thr);
      expect += bits_of(e) != 0;
      REQUIRE(bits_of(out[size_t(i)]) == bits_of(e));
    }
    CHECK(nnz == expect);
    CHECK(count_nonzero(x.data(), n, thr) == expect);
  }
}

TEST_CASE("bitmap FP16 values", "[bitmap]") {
  // Every half converts to float and back exactly (NaNs: quiet, payload kept).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(uint16_t(h));
    const bool nan = (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu);
    INFO("half " << std::hex << h);
    REQUIRE(f32_to_f16(f) == (nan ? uint16_t(h | 0x200u) : uint16_t(h)));
  }
  CHECK(f32_to_f16(1.f) == 0x3C00);
  CHECK(f32_to_f16(65504.f) == 0x7BFF);
  CHECK(f32_to_f16(65519.99f) == 0x7BFF);
  CHECK(f32_to_f16(65520.f) == 0x7C00);  // tie rounds to even: up to inf
  CHECK(f32_to_f16(1e6f) == 0x7C00);
  CHECK(f32_to_f16(-1e6f) == 0xFC00);
  CHECK(f32_to_f16(std::numeric_limits<float>::infinity()) == 0x7C00);
  // Ties to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  CHECK(f32_to_f16(1.f + std::ldexp(1.f, -11)) == 0x3C00);
  CHECK(f32_to_f16(1.f + 3 * std::ldexp(1.f, -11)) == 0x3C02);
  CHECK(f32_to_f16(std::ldexp(1.f, -24)) == 0x0001);   // smallest half denormal
  CHECK(f32_to_f16(std::ldexp(1.f, -25)) == 0x0000);   // tie to even: 0
  CHECK(f32_to_f16(std::ldexp(3.f, -26)) == 0x0001);   // 0.75 ulp: up
  CHECK(f32_to_f16(std::ldexp(1.f, -14)) == 0x0400);   // smallest normal
  CHECK(f32_to_f16(-0.f) == 0x8000);

  // Against F16C (what the SIMD paths use), on random bit patterns and near-halfway values.
#if defined(__F16C__)
  std::mt19937 rng(3);
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng();
    if (i & 1) u = (u & 0xFFFFE000u) | 0x1000u | (rng() & 1u);  // exactly / just past halfway
    const float f = from_bits(u);
    const uint16_t hw = uint16_t(_mm_extract_epi16(_mm_cvtps_ph(_mm_set1_ps(f), _MM_FROUND_TO_NEAREST_INT), 0));
    INFO("float bits " << std::hex << u);
    REQUIRE(f32_to_f16(f) == hw);
    const float back = _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(short(hw))));
    REQUIRE(bits_of(f16_to_f32(hw)) == bits_of(back));
  }
#endif

  // Through the codec: values decode to the rounded half.
  auto x = random_tensor(3001, 0.6, 11);
  x[0] = 65520.f;
  x[1] = -1e9f;
  x[2] = 1.f + std::ldexp(1.f, -11);
  x[3] = std::ldexp(1.f, -30);  // non-zero, rounds to +0 in FP16: bit set, decodes to 0
  const int64_t n = int64_t(x.size());
  std::vector<uint64_t> bits(size_t(num_words(n)));
  std::vector<uint16_t> values(x.size());
  std::vector<float> out(x.size());
  const int64_t nnz = pack(x.data(), n, 0.f, bits.data(), values.data(), ValueType::F16);
  unpack(bits.data(), values.data(), n, ValueType::F16, out.data());
  CHECK(nnz == count_nonzero(x.data(), n));
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[size_t(i)];
    REQUIRE(bits_of(out[size_t(i)]) == (xi == 0.f ? 0u : bits_of(f16_to_f32(f32_to_f16(xi)))));
  }
  CHECK(std::isinf(out[0]));
  CHECK(std::isinf(out[1]));
  CHECK(out[1] < 0);
  CHECK(out[2] == 1.f);
  CHECK(out[3] == 0.f);
  CHECK((bits[0] & 8u) != 0);
}

TEST_CASE("bitmap ranges decode like the whole tensor from any position", "[bitmap]") {
  // unpack_range and StoredReader (memory/stored_reader.h) against unpack of the whole tensor.
  const int64_t n = 5000;
  for (double nz : {0.0, 0.3, 1.0})
    for (ValueType t : {ValueType::F32, ValueType::F16}) {
      const auto x = random_tensor(n, nz, uint64_t(nz * 100) + 7);
      std::vector<uint64_t> store(static_cast<size_t>(num_words(n) + n));
      uint64_t* bits = store.data();
      void* values = bits + num_words(n);
      pack(x.data(), n, 0.f, bits, values, t);
      std::vector<float> whole(static_cast<size_t>(n)), piece(static_cast<size_t>(n));
      unpack(bits, values, n, t, whole.data());
      for (int64_t begin : {0, 1, 63, 64, 65, 100, 1000, 4999})
        for (int64_t count : {0, 1, 7, 64, 129, 1000}) {
          if (begin + count > n) continue;
          INFO("nz " << nz << " begin " << begin << " count " << count << " f16 " << (t == ValueType::F16));
          std::fill(piece.begin(), piece.end(), 9.f);
          const int64_t next = unpack_range(bits, values, t, begin, count, popcount(bits, begin), piece.data());
          CHECK(next == popcount(bits, begin + count));
          CHECK(std::memcmp(piece.data(), whole.data() + begin, size_t(count) * 4) == 0);
          CHECK(piece[size_t(count)] == 9.f);  // nothing written past the range
        }
      // A reader walking pieces of 49 (not word aligned), then jumping back and forward.
      const et::Tensor enc = et::Tensor::contiguous(store.data(), et::Shape{n},
                                                    t == ValueType::F16 ? et::DType::BitmapF16 : et::DType::BitmapF32);
      et::StoredReader r(enc, piece.data(), 49);
      for (int64_t b : {0, 49, 98, 147, 49, 4900, 4802, 0})
        CHECK(std::memcmp(r.read(b, std::min<int64_t>(49, n - b)), whole.data() + b,
                          size_t(std::min<int64_t>(49, n - b)) * 4) == 0);
      // Caller-held cursors (two interleaved walks) and range counts.
      int64_t ca = r.cursor_at(0), cb = r.cursor_at(2501);
      for (int64_t i = 0; i < 40; ++i) {
        const int64_t a = i * 49, b = 2501 + i * 49;
        CHECK(std::memcmp(r.read_at(a, 49, &ca), whole.data() + a, 49 * 4) == 0);
        CHECK(std::memcmp(r.read_at(b, 49, &cb), whole.data() + b, 49 * 4) == 0);
        CHECK(r.kept(a, 49) == popcount(bits, a + 49) - popcount(bits, a));
        CHECK(r.kept(b, 7) == popcount(bits, b + 7) - popcount(bits, b));
      }
    }
}

namespace {
// A run with its own arithmetic, distinct per channel through the coefficients.
void test_affine_relu_run(const float* x, const float* scale, const float* shift, int64_t channels, int64_t plane,
                          int64_t begin, int64_t count, float* y) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t c = (begin + i) / plane % channels;
    const float v = std::fma(x[i], scale[c], shift[c]);
    y[i] = v > 0.f ? v : 0.f;
  }
}
}  // namespace

TEST_CASE("a stored reader computes relu(affine) of a stored x piece by piece", "[bitmap][stash]") {
  // DType::AffineRelu (engine/affine_relu.h): pieces of y = relu(x * scale[c] + shift[c]) from x as
  // the stash keeps it, against the same computed over the whole decoded x. Pieces start and end
  // inside planes and cross channels and images, so a wrong channel or offset changes the values.
  const int64_t N = 3, C = 5, H = 7, W = 9, HW = H * W, n = N * C * HW;
  const auto x = random_tensor(n, 0.7, 11);
  std::vector<float> scale(C), shift(C);
  for (int64_t c = 0; c < C; ++c) {
    scale[size_t(c)] = 0.5f + 0.37f * float(c);
    shift[size_t(c)] = 0.1f * float(c) - 0.2f;
  }
  for (int enc = 0; enc < 3; ++enc) {  // f32, f16, bitmap + f32
    std::vector<uint64_t> store(static_cast<size_t>(num_words(n) + n));
    std::vector<float> decoded(static_cast<size_t>(n));
    et::Tensor xs;
    if (enc == 0) {
      decoded = x;
      xs = et::Tensor::contiguous(decoded.data(), et::Shape{N, C, H, W});
    } else if (enc == 1) {
      auto* h = reinterpret_cast<uint16_t*>(store.data());
      for (int64_t i = 0; i < n; ++i) {
        h[i] = f32_to_f16(x[size_t(i)]);
        decoded[size_t(i)] = f16_to_f32(h[i]);
      }
      xs = et::Tensor::contiguous(store.data(), et::Shape{N, C, H, W}, et::DType::F16);
    } else {
      pack(x.data(), n, 0.f, store.data(), store.data() + num_words(n), ValueType::F32);
      unpack(store.data(), store.data() + num_words(n), n, ValueType::F32, decoded.data());
      xs = et::Tensor::contiguous(store.data(), et::Shape{N, C, H, W}, et::DType::BitmapF32);
    }
    std::vector<float> whole(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const size_t c = size_t(i / HW % C);
      const float v = std::fma(decoded[size_t(i)], scale[c], shift[c]);
      whole[size_t(i)] = v > 0.f ? v : 0.f;
    }
    et::AffineReluSource src;
    src.x = xs;
    src.scale = scale.data();
    src.shift = shift.data();
    src.run = test_affine_relu_run;
    const et::Tensor y = et::affine_relu_tensor(src);
    CHECK(y.dtype == et::DType::AffineRelu);
    const int64_t cap = 3 * HW;
    std::vector<float> scratch(static_cast<size_t>(cap + 1), 9.f);
    et::StoredReader r(y, scratch.data(), cap);
    for (auto [b, count] : std::vector<std::pair<int64_t, int64_t>>{
             {0, HW}, {HW, 2 * HW}, {5, 100}, {HW * C - 3, 10}, {n - cap, cap}, {40, 1}, {0, cap}}) {
      INFO("encoding " << enc << " piece " << b << " +" << count);
      CHECK(std::memcmp(r.read(b, count), whole.data() + b, size_t(count) * 4) == 0);
      CHECK(scratch[size_t(cap)] == 9.f);  // nothing past the scratch
    }
    // Caller-held cursors count x's stored values; planes of two channels interleaved.
    int64_t ca = r.cursor_at(0), cb = r.cursor_at(HW);
    for (int64_t k = 0; k < N; ++k) {
      const int64_t a = (k * C) * HW, b = (k * C + 1) * HW;
      CHECK(std::memcmp(r.read_at(a, HW, &ca), whole.data() + a, size_t(HW) * 4) == 0);
      CHECK(std::memcmp(r.read_at(b, HW, &cb), whole.data() + b, size_t(HW) * 4) == 0);
      ca = r.cursor_at(a + C * HW);
      cb = r.cursor_at(b + C * HW);
    }
  }
}
