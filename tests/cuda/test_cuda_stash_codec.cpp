// The CUDA stash codec (backends/cuda/cuda_stash_codec.h) against the host's, byte for byte: the
// bitmaps, the packed values (fp32 and fp16), the counts, the decoded tensors and the fp16 / bf16
// conversions, on sizes around the word and chunk edges and values that test the keep rule
// (+-0, denormals, NaN with payloads, infinities, values at the prune threshold), and bitmap_int4's
// code bitmap (its bits, directory and nibbles; decoded back to one code a byte).
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backends/cuda/cuda_stash_codec.h"
#include "memory/bitmap.h"
#include "memory/code_bitmap.h"

using namespace et;

namespace {

// A device buffer of `bytes`, zeroed.
struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t b) : bytes(b < 8 ? 8 : b) {
    REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess);
    REQUIRE(cudaMemset(p, 0, bytes) == cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p); }
  template <typename T>
  std::vector<T> read(size_t count) const {
    std::vector<T> out(count);
    REQUIRE(cudaMemcpy(out.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
  template <typename T>
  void write(const std::vector<T>& v) {
    REQUIRE(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
};

std::vector<float> tricky_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) {
    const int kind = int(rng() % 16);
    if (kind < 6) v = 0.f;
    else if (kind == 6) v = -0.f;
    else if (kind == 7) v = std::numeric_limits<float>::denorm_min() * float(rng() % 1000 + 1);
    else if (kind == 8) {
      uint32_t bits = 0x7F800001u | (rng() & 0x007FFFFFu) | (rng() % 2 ? 0x80000000u : 0u);  // NaN, any payload
      std::memcpy(&v, &bits, 4);
    } else if (kind == 9) v = rng() % 2 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
    else if (kind == 10) v = rng() % 2 ? 0.5f : -0.5f;  // at the prune threshold below
    else if (kind == 11) v = u(rng) * 1e-6f;            // fp16 denormals
    else if (kind == 12) v = u(rng) * 70000.f;          // beyond fp16's range
    else v = u(rng);
  }
  return x;
}

}  // namespace

TEST_CASE("cuda: the stash codec writes the host codec's bytes", "[cuda][stash]") {
  const std::unique_ptr<StashCodec> dev = make_cuda_stash_codec(0);
  StashCodec& host = host_stash_codec();
  for (int64_t n : {int64_t(1), int64_t(31), int64_t(63), int64_t(64), int64_t(65), int64_t(255), int64_t(256),
                    int64_t(257), int64_t(1000), int64_t(100003), int64_t(1 << 20) + 37, int64_t(20) * 1000 * 1000 + 5}) {
    const std::vector<float> x = tricky_values(n, uint32_t(n));
    DeviceBuffer dx(size_t(n) * 4);
    dx.write(x);
    const size_t words = size_t(bitmap::num_words(n));
    for (float t : {0.f, 0.5f}) {
      for (bool f16 : {false, true}) {
        INFO("n " << n << ", threshold " << t << ", fp16 " << f16);
        const size_t vb = f16 ? 2 : 4;
        std::vector<uint64_t> hbits(words);
        std::vector<unsigned char> hvals(size_t(n) * vb);
        const int64_t hk = host.pack(x.data(), n, t, hbits.data(), hvals.data(), f16, n, nullptr);
        CHECK(dev->count_nonzero(static_cast<const float*>(dx.p), n, t) == hk);
        DeviceBuffer dbits(words * 8), dvals(size_t(n) * vb);
        CHECK(dev->pack(static_cast<const float*>(dx.p), n, t, static_cast<uint64_t*>(dbits.p), dvals.p, f16, n, nullptr) ==
              hk);
        CHECK(dbits.read<uint64_t>(words) == hbits);
        const std::vector<unsigned char> dv = dvals.read<unsigned char>(size_t(hk) * vb);
        CHECK(std::equal(dv.begin(), dv.end(), hvals.begin()));  // dv: hk values (none: no memcmp of null)
        // make_bits + pack_values on an existing bitmap: the same
        DeviceBuffer dbits2(words * 8), dvals2(size_t(n) * vb);
        // ... its count left on the device (the stash's fixed layout): -1 returned, the count there
        DeviceBuffer dcount(8);
        CHECK(dev->make_bits(static_cast<const float*>(dx.p), n, t, static_cast<uint64_t*>(dbits2.p),
                             static_cast<int64_t*>(dcount.p)) == -1);
        CHECK(dcount.read<int64_t>(1)[0] == hk);
        dev->pack_values(static_cast<const float*>(dx.p), static_cast<uint64_t*>(dbits2.p), n, dvals2.p, f16, n);
        CHECK(dbits2.read<uint64_t>(words) == hbits);
        const std::vector<unsigned char> dv2 = dvals2.read<unsigned char>(size_t(hk) * vb);
        CHECK(std::equal(dv2.begin(), dv2.end(), hvals.begin()));
        // unpack: the host's decoded tensor, bit for bit (NaN payloads included)
        std::vector<float> hy(static_cast<size_t>(n));
        host.unpack(hbits.data(), hvals.data(), n, f16, hy.data());
        DeviceBuffer dy(size_t(n) * 4);
        dev->unpack(static_cast<const uint64_t*>(dbits.p), dvals.p, n, f16, static_cast<float*>(dy.p));
        const std::vector<uint32_t> got = dy.read<uint32_t>(size_t(n));
        CHECK(std::memcmp(got.data(), hy.data(), size_t(n) * 4) == 0);
      }
    }
    for (bool bf16 : {false, true}) {
      INFO("n " << n << ", bf16 " << bf16);
      std::vector<uint16_t> hh(static_cast<size_t>(n));
      host.to_half(x.data(), n, bf16, hh.data());
      DeviceBuffer dh(size_t(n) * 2);
      dev->to_half(static_cast<const float*>(dx.p), n, bf16, static_cast<uint16_t*>(dh.p));
      CHECK(dh.read<uint16_t>(size_t(n)) == hh);
      std::vector<float> hf(static_cast<size_t>(n));
      host.from_half(hh.data(), n, bf16, hf.data());
      DeviceBuffer df(size_t(n) * 4);
      dev->from_half(static_cast<const uint16_t*>(dh.p), n, bf16, static_cast<float*>(df.p));
      const std::vector<uint32_t> got = df.read<uint32_t>(size_t(n));
      CHECK(std::memcmp(got.data(), hf.data(), size_t(n) * 4) == 0);
    }
    // copy
    DeviceBuffer dc(size_t(n) * 4);
    dev->copy(dc.p, dx.p, size_t(n) * 4);
    const std::vector<float> back = dc.read<float>(size_t(n));
    CHECK(std::memcmp(back.data(), x.data(), size_t(n) * 4) == 0);
  }
}

TEST_CASE("cuda: the bitmap_int4 encoding is the host's, byte for byte, and decodes to its codes", "[cuda][stash]") {
  const std::unique_ptr<StashCodec> dev = make_cuda_stash_codec(0);
  StashCodec& host = host_stash_codec();
  // Sizes around the word, the thread's quarter word and the 4096-element block.
  for (int64_t n : {int64_t(1), int64_t(15), int64_t(17), int64_t(63), int64_t(64), int64_t(65), int64_t(4095),
                    int64_t(4096), int64_t(4097), int64_t(3 * 4096 + 100), int64_t(100003), int64_t(1 << 20) + 37}) {
    const std::vector<float> x = tricky_values(n, uint32_t(n) + 7);
    DeviceBuffer dx(size_t(n) * 4);
    dx.write(x);
    std::mt19937 rng{uint32_t(n)};
    for (bool is_signed : {true, false}) {
      std::vector<int8_t> codes(static_cast<size_t>(n));
      for (int8_t& c : codes) c = is_signed ? int8_t(int(rng() % 15) - 7) : int8_t(rng() % 16);
      DeviceBuffer dcodes{size_t(n)};
      dcodes.write(codes);
      for (float t : {0.f, 0.5f}) {
        INFO("n " << n << ", signed " << is_signed << ", threshold " << t);
        const size_t cap = code_bitmap::encoded_bytes(n, n);
        std::vector<uint8_t> he(cap, 0);
        const int64_t hk = host.encode_codes(x.data(), codes.data(), n, t, he.data(), n, nullptr);
        DeviceBuffer de(cap);
        DeviceBuffer dcount(8);
        CHECK(dev->encode_codes(static_cast<const float*>(dx.p), static_cast<const int8_t*>(dcodes.p), n, t, de.p, n,
                                static_cast<int64_t*>(dcount.p)) == -1);
        CHECK(dcount.read<int64_t>(1)[0] == hk);
        // The bytes written: bits, directory, and each block's nibbles up to the last block's end.
        const int64_t words = bitmap::num_words(n), blocks = code_bitmap::num_blocks(n);
        const auto* hbits = reinterpret_cast<const uint64_t*>(he.data());
        const auto* hdir = reinterpret_cast<const int64_t*>(hbits + words);
        int64_t last = 0;
        for (int64_t w = (blocks - 1) * (code_bitmap::kBlock / 64); w < words; ++w)
          last += __builtin_popcountll(hbits[w]);
        const size_t used = size_t(words + blocks) * 8 + size_t(hdir[blocks - 1] + (last + 1) / 2);
        const std::vector<uint8_t> got = de.read<uint8_t>(used);
        CHECK(std::memcmp(got.data(), he.data(), used) == 0);
        // Decoded: the host's decoding, the codes where kept and 0 elsewhere.
        std::vector<int8_t> hd(static_cast<size_t>(n));
        host.decode_codes(he.data(), n, is_signed, hd.data());
        DeviceBuffer dd{size_t(n)};
        dev->decode_codes(de.p, n, is_signed, static_cast<int8_t*>(dd.p));
        CHECK(dd.read<int8_t>(size_t(n)) == hd);
        int64_t differ = 0;
        for (int64_t i = 0; i < n; ++i) {
          const bool kept = (hbits[i / 64] >> (i % 64)) & 1;
          differ += hd[size_t(i)] != (kept ? codes[size_t(i)] : int8_t(0));
        }
        CHECK(differ == 0);
      }
    }
  }
}

TEST_CASE("cuda: the codec keeps within an entry's room, and returns the whole count", "[cuda][stash][room]") {
  // The stash's fixed layout gives each entry room for the most it kept so far (memory/stash.h):
  // a push that keeps more must write nothing past that room (the next entry is there), and
  // leave its whole count, which tells the stash to run the step again. Each buffer holds the
  // worst case and a canary; everything from the room's end on must keep the canary. What it
  // writes is the host's encoding with that room (the bits of what did not fit cleared).
  const std::unique_ptr<StashCodec> dev = make_cuda_stash_codec(0);
  StashCodec& host = host_stash_codec();
  for (int64_t n : {int64_t(1000), int64_t(3 * 4096 + 100), int64_t(1 << 20) + 37}) {
    const std::vector<float> x = tricky_values(n, uint32_t(n) + 3);
    DeviceBuffer dx(size_t(n) * 4);
    dx.write(x);
    const int64_t kept = host.count_nonzero(x.data(), n, 0.f), room = kept / 2;
    std::vector<int8_t> codes(static_cast<size_t>(n));
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = int8_t(int(i % 15) - 7);
    DeviceBuffer dcodes{size_t(n)};
    dcodes.write(codes);
    const size_t words = size_t(bitmap::num_words(n));
    for (int kind = 0; kind < 4; ++kind) {  // pack fp32, pack fp16, pack_values fp32, the INT4 codes
      INFO("n " << n << ", kind " << kind);
      const bool f16 = kind == 1, codes_kind = kind == 3;
      const size_t worst = codes_kind ? code_bitmap::encoded_bytes(n, n) : words * 8 + size_t(n) * (f16 ? 2 : 4);
      const size_t fits = codes_kind ? code_bitmap::encoded_bytes(n, room) : words * 8 + size_t(room) * (f16 ? 2 : 4);
      DeviceBuffer buf(worst + 256), count(8);
      REQUIRE(cudaMemset(buf.p, 0xAB, worst + 256) == cudaSuccess);
      auto* bits = static_cast<uint64_t*>(buf.p);
      auto* slot = static_cast<int64_t*>(count.p);
      if (kind == 3)
        CHECK(dev->encode_codes(static_cast<const float*>(dx.p), static_cast<const int8_t*>(dcodes.p), n, 0.f, buf.p,
                                room, slot) == -1);
      else if (kind == 2) {
        CHECK(dev->make_bits(static_cast<const float*>(dx.p), n, 0.f, bits, slot) == -1);
        dev->pack_values(static_cast<const float*>(dx.p), bits, n, bits + words, false, room);
      } else
        CHECK(dev->pack(static_cast<const float*>(dx.p), n, 0.f, bits, bits + words, f16, room, slot) == -1);
      CHECK(count.read<int64_t>(1)[0] == kept);
      const std::vector<unsigned char> after = buf.read<unsigned char>(worst + 256);
      size_t touched = 0;
      for (size_t i = fits; i < after.size(); ++i) touched += after[i] != 0xAB;
      CHECK(touched == 0);
      // The host codec's encoding with the same room, byte for byte: the first kept elements that
      // fit, the others' bits cleared, so that readers stay within the room (memory/stash_codec.h).
      std::vector<unsigned char> want(worst + 256, 0xAB);
      if (codes_kind) {
        host.encode_codes(x.data(), codes.data(), n, 0.f, want.data(), room, nullptr);
      } else {
        auto* hbits = reinterpret_cast<uint64_t*>(want.data());
        host.pack(x.data(), n, 0.f, hbits, hbits + words, f16, room, nullptr);
      }
      CHECK(std::memcmp(after.data(), want.data(), fits) == 0);
      // ... which decodes there as on the host: nothing read past the room.
      std::vector<unsigned char> back_dev(size_t(n) * 4), back_host(size_t(n) * 4);
      DeviceBuffer out(size_t(n) * 4);
      if (codes_kind) {
        dev->decode_codes(buf.p, n, true, static_cast<int8_t*>(out.p));
        host.decode_codes(want.data(), n, true, reinterpret_cast<int8_t*>(back_host.data()));
        back_dev = out.read<unsigned char>(size_t(n));
        back_host.resize(size_t(n));
      } else {
        dev->unpack(bits, bits + words, n, f16, static_cast<float*>(out.p));
        auto* hbits = reinterpret_cast<const uint64_t*>(want.data());
        host.unpack(hbits, hbits + words, n, f16, reinterpret_cast<float*>(back_host.data()));
        back_dev = out.read<unsigned char>(size_t(n) * 4);
      }
      CHECK(back_dev == back_host);
    }
  }
}
