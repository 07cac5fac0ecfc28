// Huffman tables and the entropy-coded bit stream, as libjpeg-turbo's jdhuff.c builds and reads
// them (jpeg_make_d_derived_tbl, jpeg_fill_bit_buffer, jstdhuff.c).
#include <cstring>

#include "engine/data/jpeg_internal.h"

namespace et::jpeg_detail {

const uint8_t kNaturalOrder[64 + 16] = {
    0,  1,  8,  16, 9,  2,  3,  10, 17, 24, 32, 25, 18, 11, 4,  5,  12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13,
    6,  7,  14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59, 52, 45, 38, 31,
    39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
    63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63};  // past the end: libjpeg's guard

namespace {

// ITU T.81 Annex K.3 (the tables every baseline encoder without optimisation writes).
const uint8_t kDcLumaCounts[17] = {0, 0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0};
const uint8_t kDcChromaCounts[17] = {0, 0, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0};
const uint8_t kDcSymbols[12] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
const uint8_t kAcLumaCounts[17] = {0, 0, 2, 1, 3, 3, 2, 4, 3, 5, 5, 4, 4, 0, 0, 1, 0x7d};
const uint8_t kAcLumaSymbols[162] = {
    0x01, 0x02, 0x03, 0x00, 0x04, 0x11, 0x05, 0x12, 0x21, 0x31, 0x41, 0x06, 0x13, 0x51, 0x61, 0x07, 0x22, 0x71,
    0x14, 0x32, 0x81, 0x91, 0xa1, 0x08, 0x23, 0x42, 0xb1, 0xc1, 0x15, 0x52, 0xd1, 0xf0, 0x24, 0x33, 0x62, 0x72,
    0x82, 0x09, 0x0a, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x25, 0x26, 0x27, 0x28, 0x29, 0x2a, 0x34, 0x35, 0x36, 0x37,
    0x38, 0x39, 0x3a, 0x43, 0x44, 0x45, 0x46, 0x47, 0x48, 0x49, 0x4a, 0x53, 0x54, 0x55, 0x56, 0x57, 0x58, 0x59,
    0x5a, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68, 0x69, 0x6a, 0x73, 0x74, 0x75, 0x76, 0x77, 0x78, 0x79, 0x7a, 0x83,
    0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8a, 0x92, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9a, 0xa2, 0xa3,
    0xa4, 0xa5, 0xa6, 0xa7, 0xa8, 0xa9, 0xaa, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6, 0xb7, 0xb8, 0xb9, 0xba, 0xc2, 0xc3,
    0xc4, 0xc5, 0xc6, 0xc7, 0xc8, 0xc9, 0xca, 0xd2, 0xd3, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8, 0xd9, 0xda, 0xe1, 0xe2,
    0xe3, 0xe4, 0xe5, 0xe6, 0xe7, 0xe8, 0xe9, 0xea, 0xf1, 0xf2, 0xf3, 0xf4, 0xf5, 0xf6, 0xf7, 0xf8, 0xf9, 0xfa};
const uint8_t kAcChromaCounts[17] = {0, 0, 2, 1, 2, 4, 4, 3, 4, 7, 5, 4, 4, 0, 1, 2, 0x77};
const uint8_t kAcChromaSymbols[162] = {
    0x00, 0x01, 0x02, 0x03, 0x11, 0x04, 0x05, 0x21, 0x31, 0x06, 0x12, 0x41, 0x51, 0x07, 0x61, 0x71, 0x13, 0x22,
    0x32, 0x81, 0x08, 0x14, 0x42, 0x91, 0xa1, 0xb1, 0xc1, 0x09, 0x23, 0x33, 0x52, 0xf0, 0x15, 0x62, 0x72, 0xd1,
    0x0a, 0x16, 0x24, 0x34, 0xe1, 0x25, 0xf1, 0x17, 0x18, 0x19, 0x1a, 0x26, 0x27, 0x28, 0x29, 0x2a, 0x35, 0x36,
    0x37, 0x38, 0x39, 0x3a, 0x43, 0x44, 0x45, 0x46, 0x47, 0x48, 0x49, 0x4a, 0x53, 0x54, 0x55, 0x56, 0x57, 0x58,
    0x59, 0x5a, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68, 0x69, 0x6a, 0x73, 0x74, 0x75, 0x76, 0x77, 0x78, 0x79, 0x7a,
    0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8a, 0x92, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9a,
    0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8, 0xa9, 0xaa, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6, 0xb7, 0xb8, 0xb9, 0xba,
    0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xc7, 0xc8, 0xc9, 0xca, 0xd2, 0xd3, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8, 0xd9, 0xda,
    0xe2, 0xe3, 0xe4, 0xe5, 0xe6, 0xe7, 0xe8, 0xe9, 0xea, 0xf2, 0xf3, 0xf4, 0xf5, 0xf6, 0xf7, 0xf8, 0xf9, 0xfa};

uint64_t load_be64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = v << 8 | p[i];
  return v;
}

}  // namespace

void standard_huffman_spec(bool dc, int slot, HuffmanSpec& spec) {
  ET_CHECK(slot == 0 || slot == 1);
  const uint8_t* counts = dc ? (slot == 0 ? kDcLumaCounts : kDcChromaCounts) : (slot == 0 ? kAcLumaCounts : kAcChromaCounts);
  const uint8_t* symbols = dc ? kDcSymbols : (slot == 0 ? kAcLumaSymbols : kAcChromaSymbols);
  spec = HuffmanSpec();
  int n = 0;
  for (int l = 1; l <= 16; ++l) n += spec.counts[l] = counts[l];
  std::memcpy(spec.symbols, symbols, size_t(n));
  spec.defined = true;
}

const char* build_huffman_table(const HuffmanSpec& spec, bool dc, HuffmanTable& t) {
  uint8_t source[sizeof t.source];
  std::memcpy(source, spec.counts, 17);
  std::memcpy(source + 17, spec.symbols, 256);
  if (t.built && t.built_dc == dc && std::memcmp(source, t.source, sizeof source) == 0) return "";
  t.built = false;

  // Figures C.1 and C.2: code lengths and canonical codes; no code may be all ones.
  uint8_t length[257];
  uint32_t codes[257];
  int n = 0;
  for (int l = 1; l <= 16; ++l) {
    if (n + spec.counts[l] > 256) return "a Huffman table with more than 256 codes";
    for (int i = 0; i < spec.counts[l]; ++i) length[n++] = uint8_t(l);
  }
  length[n] = 0;
  uint32_t code = 0;
  for (int p = 0, bits = length[0]; length[p];) {
    while (length[p] == bits) codes[p++] = code++;
    if (code >= (1u << bits)) return "a Huffman table whose code counts overflow their lengths";
    code <<= 1;
    ++bits;
  }
  if (dc)
    for (int i = 0; i < n; ++i)
      if (spec.symbols[i] > 15) return "a DC Huffman table with a symbol above 15";

  // Figure F.15: the bit-serial decoding tables.
  for (int l = 1, p = 0; l <= 16; ++l) {
    if (spec.counts[l]) {
      t.valoffset[l] = p - int32_t(codes[p]);
      p += spec.counts[l];
      t.maxcode[l] = int32_t(codes[p - 1]);
    } else {
      t.maxcode[l] = -1;
    }
  }
  t.valoffset[17] = 0;
  t.maxcode[17] = 0xFFFFF;
  std::memcpy(t.symbols, spec.symbols, 256);

  // Lookahead: every kLookaheadBits-bit string that starts with a short code.
  std::memset(t.lookup, 0, sizeof t.lookup);
  for (int p = 0; p < n && length[p] <= kLookaheadBits; ++p) {
    const int shift = kLookaheadBits - length[p];
    for (uint32_t c = 0; c < (1u << shift); ++c)
      t.lookup[(codes[p] << shift) | c] = uint16_t(length[p] << 8 | spec.symbols[p]);
  }
  std::memset(t.ac_fast, 0, sizeof t.ac_fast);
  if (!dc)
    for (int look = 0; look < (1 << kLookaheadBits); ++look) {
      const int e = t.lookup[look], len = e >> 8, run = (e >> 4) & 15, size = e & 15;
      if (!e || !size || len + size > kLookaheadBits) continue;
      const int bits = (look >> (kLookaheadBits - len - size)) & ((1 << size) - 1);
      t.ac_fast[look] = extend(bits, size) * 65536 + run * 256 + len + size;
    }
  std::memcpy(t.source, source, sizeof source);
  t.built_dc = dc;
  t.built = true;
  return "";
}

void BitReader::refill() {
  const uint8_t* d = src_->data;
  const size_t size = src_->size;
  while (count_ <= 56) {
    if (!exhausted_) {
      size_t pos = src_->pos;
      if (size - pos >= 8) {  // whole bytes while none is FF
        const uint64_t v = load_be64(d + pos), x = ~v;
        if (((x - 0x0101010101010101ull) & ~x & 0x8080808080808080ull) == 0) {
          const int n = (64 - count_) >> 3;
          buf_ |= (n == 8 ? v : v & ~(~0ull >> (8 * n))) >> count_;
          count_ += 8 * n;
          src_->pos = pos + size_t(n);
          continue;
        }
      }
      if (pos < size && d[pos] != 0xFF) {
        buf_ |= uint64_t(d[pos]) << (56 - count_);
        count_ += 8;
        src_->pos = pos + 1;
        continue;
      }
      if (pos < size) {  // FF: fill bytes, then 00 (a data byte FF) or a marker
        size_t p = pos + 1;
        while (p < size && d[p] == 0xFF) ++p;
        if (p < size && d[p] == 0) {
          buf_ |= uint64_t(0xFF) << (56 - count_);
          count_ += 8;
          src_->pos = p + 1;
          continue;
        }
        if (p < size) src_->unread_marker = d[p];
        src_->pos = p < size ? p + 1 : p;
        at_eof_ = p >= size;
      } else {
        at_eof_ = true;
      }
      exhausted_ = true;
    }
    count_ += 8;  // zero bits
    padding_ += 8;
  }
}

}  // namespace et::jpeg_detail
