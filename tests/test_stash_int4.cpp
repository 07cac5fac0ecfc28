// memory.stash = bitmap_int4 (docs/quant.md): the bitmap + 4-bit code codec (reference and fast
// path), the stash entry (round trip, the ReLU mask from its bitmap), the integer kernels on stored
// codes, recomputed BN inputs equal to the forward's, and training bit-identical to a dense stash.
#include <catch2/catch.hpp>

#include <cstring>
#include <tuple>

#include "memory/bitmap.h"
#include "memory/code_bitmap.h"
#include "memory/stored_codes.h"
#include "quant/codes.h"
#include "tests/test_util.h"
#include "tests/tiny_training.h"

using namespace et;

namespace {

uint32_t lcg(uint32_t& s) { return s = s * 1664525u + 1013904223u; }

// n inputs with about `zeros` percent zeros and codes to match (0 where the input is 0; the codes
// of kept inputs may be 0 too, as small values round to 0).
struct Sample {
  std::vector<float> x;
  std::vector<int8_t> codes;
};
Sample sample(int64_t n, int zeros, bool is_signed, uint32_t seed) {
  Sample s{std::vector<float>(size_t(n)), std::vector<int8_t>(size_t(n))};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t r = lcg(seed) >> 8;
    if (int(r % 100) < zeros) continue;
    const int c = is_signed ? int((r >> 7) % 15) - 7 : int((r >> 7) % 16);
    s.codes[size_t(i)] = int8_t(c);
    s.x[size_t(i)] = c == 0 ? 0.01f : float(c) * 0.5f;
  }
  return s;
}

std::vector<uint8_t> encoded(const Sample& s, int64_t n) {
  std::vector<uint8_t> buf(code_bitmap::encoded_bytes(n, n), 0xAB);
  code_bitmap::encode(s.x.data(), s.codes.data(), n, 0.f, buf.data());
  return buf;
}

}  // namespace

TEST_CASE("bitmap_int4 codec round trips: signed and unsigned, odd lengths, all-zero, dense, any range",
          "[stash][int4]") {
  const int64_t big = bitmap::kParallelMinElements + 4096 * 3 + 77;  // threaded encode
  for (int64_t n : {int64_t(1), int64_t(31), int64_t(33), int64_t(64), int64_t(95), int64_t(4095), int64_t(4096),
                    int64_t(4097), int64_t(3 * 4096 + 77), big})
    for (int zeros : {0, 50, 93, 100})
      for (bool is_signed : {false, true}) {
        INFO("n " << n << " zeros " << zeros << "% signed " << is_signed);
        const Sample s = sample(n, zeros, is_signed, uint32_t(n * 7 + zeros));
        const std::vector<uint8_t> buf = encoded(s, n);
        int64_t kept = 0;
        for (float v : s.x) kept += v != 0.f;
        CHECK(code_bitmap::encode(s.x.data(), s.codes.data(), n, 0.f, std::vector<uint8_t>(buf.size()).data()) == kept);
        std::vector<int8_t> out(size_t(n), 99);
        code_bitmap::decode(buf.data(), n, is_signed, 0, n, out.data());
        CHECK(out == s.codes);
        // Pieces starting anywhere (mid-word, mid-block) decode like the whole.
        uint32_t seed = 5;
        for (int t = 0; t < 20; ++t) {
          const int64_t b = int64_t(lcg(seed) % uint32_t(n)), c = int64_t(lcg(seed) % uint32_t(n - b + 1));
          std::vector<int8_t> piece(size_t(c) + 1, 99);
          code_bitmap::decode(buf.data(), n, is_signed, b, c, piece.data());
          CHECK(std::equal(piece.begin(), piece.end() - 1, s.codes.begin() + b));
          CHECK(piece.back() == 99);  // nothing past the piece
        }
      }
  // The size: 1 bit per element, 4 per kept one, the directory.
  CHECK(code_bitmap::encoded_bytes(4096 * 4, 4096 * 2) == 4096 * 4 / 8 + 4 * 8 + 4096 + 2);
}

TEST_CASE("bitmap_int4 fast kernels equal the reference byte for byte", "[stash][int4]") {
  const code_bitmap::Impl& ref = code_bitmap::reference_impl();
  const code_bitmap::Impl& fast = code_bitmap::fast_impl();
  if (!fast.available) ET_SKIP("no fast path in this build (AVX-512 VBMI2, AVX2, NEON)");
  for (int64_t count : {int64_t(1), int64_t(32), int64_t(63), int64_t(100), int64_t(4096)})
    for (int zeros : {0, 30, 70, 100})
      for (bool is_signed : {false, true}) {
        INFO("count " << count << " zeros " << zeros << "% signed " << is_signed);
        const Sample s = sample(count, zeros, is_signed, uint32_t(count + zeros));
        std::vector<uint64_t> bits(size_t(bitmap::num_words(count)) + 1);
        const int64_t kept = bitmap::make_bits(s.x.data(), count, 0.f, bits.data());
        std::vector<uint8_t> a(size_t(kept + 1) / 2 + 1, 0x5A), b = a;
        ref.pack(bits.data(), s.codes.data(), count, a.data());
        fast.pack(bits.data(), s.codes.data(), count, b.data());
        CHECK(a == b);
        // Unpack from every start element (odd and even nibbles, word-straddling 32-bit pieces).
        for (int64_t first = 0; first < std::min<int64_t>(count, 70); first += 3) {
          const int64_t nib = bitmap::popcount(bits.data(), first);
          std::vector<int8_t> ra(size_t(count - first)), fb(size_t(count - first));
          ref.unpack(bits.data(), first, a.data(), nib, count - first, is_signed, ra.data());
          fast.unpack(bits.data(), first, a.data(), nib, count - first, is_signed, fb.data());
          CHECK(ra == fb);
          CHECK(std::equal(ra.begin(), ra.end(), s.codes.begin() + first));
        }
      }
}

TEST_CASE("a bitmap_int4 stash entry: codes and scale as stored, the bitmap as the ReLU mask", "[stash][int4]") {
  for (bool is_signed : {false, true}) {
    const Shape shape{3, 5, 7, 9};
    const int64_t n = shape.numel();
    const Sample s = sample(n, 40, is_signed, 17);
    Stash st;
    SavedValue sv;
    sv.value = 0, sv.numel = n, sv.full = true, sv.format = StashFormat::BitmapI4;
    st.configure({sv}, 1, 0.f);
    CHECK(st.stores_codes(0));
    Tensor codes = Tensor::contiguous(const_cast<int8_t*>(s.codes.data()), shape, is_signed ? DType::I4 : DType::U4);
    codes.scale = 0.375f;
    st.push(0, Tensor::contiguous(const_cast<float*>(s.x.data()), shape), MaskOut{}, codes);
    const Tensor stored = st.get_stored(0);
    CHECK(stored.dtype == (is_signed ? DType::BitmapI4 : DType::BitmapU4));
    CHECK(stored.scale == 0.375f);
    CHECK(stored.shape == shape);
    CHECK(std::string(st.record(0).stored_as) == (is_signed ? "bitmap+int4" : "bitmap+uint4"));
    CHECK(st.live_bytes() < size_t(n));  // < 1 byte per element
    std::vector<int8_t> scratch(size_t(2 * 5 * 7 * 9));
    const int8_t* rows = code_rows(stored, 1, 2, scratch.data());
    CHECK(std::equal(rows, rows + 2 * 5 * 7 * 9, s.codes.begin() + 5 * 7 * 9));
    CHECK(code_rows(codes, 1, 2, scratch.data()) == s.codes.data() + 5 * 7 * 9);  // dense: no copy
    const MaskView m = st.get_mask(0);
    REQUIRE(m.bits != nullptr);
    bool same = true;
    for (int64_t i = 0; i < n; ++i) same &= bool((m.bits[i >> 6] >> (i & 63)) & 1) == (s.x[size_t(i)] != 0.f);
    CHECK(same);
    st.pop(0);
    CHECK(st.live_bytes() == 0);
  }
}

TEST_CASE("integer conv and linear read stored codes like dense ones", "[stash][int4][conv]") {
  auto be = make_cpu_backend();
  using G = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;  // N C H K R stride
  for (auto [N, C, H, K, R, stride] : {G{3, 16, 8, 8, 3, 1}, G{5, 3, 11, 6, 3, 2}, G{4, 12, 5, 8, 1, 1}, G{2, 7, 9, 5, 1, 2}})
    for (bool is_signed : {false, true}) {
      Conv2dGeom g;
      g.N = N, g.C = C, g.H = g.W = H, g.K = K, g.R = g.S = R, g.stride_h = g.stride_w = stride, g.pad_h = g.pad_w = R / 2;
      g.infer_output();
      const int64_t nx = N * C * H * H, ny = N * K * g.P * g.Q;
      const Sample s = sample(nx, 45, is_signed, uint32_t(nx));
      std::vector<uint8_t> buf = encoded(s, nx);
      std::vector<int8_t> wc(static_cast<size_t>(K * C * R * R)), gc(static_cast<size_t>(ny));
      uint32_t seed = 3;
      for (auto& c : wc) c = int8_t(int(lcg(seed) % 15) - 7);
      for (auto& c : gc) c = quant::fp4_value(int(lcg(seed) & 1), int(lcg(seed) % 8));
      Tensor xq = Tensor::contiguous(const_cast<int8_t*>(s.codes.data()), Shape{N, C, H, H}, is_signed ? DType::I4 : DType::U4);
      Tensor xs = Tensor::contiguous(buf.data(), xq.shape, is_signed ? DType::BitmapI4 : DType::BitmapU4);
      Tensor wq = Tensor::contiguous(wc.data(), Shape{K, C, R, R}, DType::I4);
      Tensor gq = Tensor::contiguous(gc.data(), Shape{N, K, g.P, g.Q}, DType::F4);
      xq.scale = xs.scale = 0.3f, wq.scale = 0.05f, gq.scale = 0.001f;
      size_t wsb = 0;
      for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardWeight}) wsb = std::max(wsb, be->conv2d_q_workspace_bytes(g, p));
      std::vector<uint8_t> wsv(wsb);
      const Workspace ws{wsv.data(), wsb};
      std::vector<float> y1(static_cast<size_t>(ny)), y2(y1), dw1(wc.size()), dw2(wc.size()), db1(static_cast<size_t>(K)), db2(db1);
      Tensor t_y1 = Tensor::contiguous(y1.data(), gq.shape), t_y2 = Tensor::contiguous(y2.data(), gq.shape);
      Tensor t_dw1 = Tensor::contiguous(dw1.data(), wq.shape), t_dw2 = Tensor::contiguous(dw2.data(), wq.shape);
      Tensor t_db1 = Tensor::contiguous(db1.data(), Shape{K}), t_db2 = Tensor::contiguous(db2.data(), Shape{K});
      be->conv2d_forward_q(g, xq, wq, Tensor{}, t_y1, ws);
      be->conv2d_forward_q(g, xs, wq, Tensor{}, t_y2, ws);
      be->conv2d_backward_weight_q(g, xq, gq, t_dw1, t_db1, false, ws);
      be->conv2d_backward_weight_q(g, xs, gq, t_dw2, t_db2, false, ws);
      INFO("N" << N << " C" << C << " " << H << "x" << H << " K" << K << " R" << R << " s" << stride << " signed " << is_signed);
      CHECK(y1 == y2);
      CHECK(dw1 == dw2);
      CHECK(db1 == db2);
    }
  const int64_t N = 6, I = 37, O = 5;
  const Sample s = sample(N * I, 30, false, 9);
  std::vector<uint8_t> buf = encoded(s, N * I);
  std::vector<int8_t> gc(size_t(N * O), 4);
  Tensor xq = Tensor::contiguous(const_cast<int8_t*>(s.codes.data()), Shape{N, I}, DType::U4);
  Tensor xs = Tensor::contiguous(buf.data(), xq.shape, DType::BitmapU4);
  Tensor gq = Tensor::contiguous(gc.data(), Shape{N, O}, DType::F4);
  xq.scale = xs.scale = 0.5f;
  std::vector<uint8_t> wsv(be->linear_q_workspace_bytes(N, I, O));
  std::vector<float> dw1(size_t(O * I)), dw2(size_t(O * I));
  Tensor t1 = Tensor::contiguous(dw1.data(), Shape{O, I}), t2 = Tensor::contiguous(dw2.data(), Shape{O, I}), none;
  be->linear_backward_weight_q(xq, gq, t1, none, false, Workspace{wsv.data(), wsv.size()});
  be->linear_backward_weight_q(xs, gq, t2, none, false, Workspace{wsv.data(), wsv.size()});
  CHECK(dw1 == dw2);
}
