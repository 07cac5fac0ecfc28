// Internals of the JPEG decoder (engine/data/jpeg_decode.h), shared by its files, each following
// one part of libjpeg-turbo 2.1 (the file names in brackets):
//   jpeg_markers.cpp  markers and tables, scan headers [jdmarker.c, jdinput.c]
//   jpeg_huffman.cpp  bit reader and Huffman tables [jdhuff.c / jdhuff.h]
//   jpeg_scan.cpp     decoding scans: sequential, progressive, restarts [jdhuff.c, jdphuff.c]
//   jpeg_idct.cpp     the islow inverse DCT [jidctint.c, jidctint-sse2/avx2.asm]
//   jpeg_output.cpp   upsampling, colour conversion, the whole decode [jdsample.c, jdcolor.c]
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/check.h"
#include "engine/data/jpeg_decode.h"

namespace et::jpeg_detail {

constexpr int kMaxComponents = 3;  // gray or 3-component colour; other counts go to stb_image
constexpr int kMaxBlocksInMcu = 10;  // libjpeg's D_MAX_BLOCKS_IN_MCU
constexpr int kLookaheadBits = 9;

// Zigzag index -> natural (row-major) index, with libjpeg's 16 extra entries (jutils.c): corrupt
// data can push the index past 63, and libjpeg then stores into coefficient 63.
extern const uint8_t kNaturalOrder[64 + 16];

// A Huffman table as a DHT segment defines it: code counts per length 1..16, symbols.
struct HuffmanSpec {
  bool defined = false;
  uint8_t counts[17] = {};
  uint8_t symbols[256] = {};
};

// Decoding tables of one Huffman table (libjpeg's d_derived_tbl), plus a combined table for AC
// coefficients whose code and value bits fit in kLookaheadBits.
struct HuffmanTable {
  int32_t maxcode[18];    // largest code of each length, -1 if none; [17] ends the search
  int32_t valoffset[18];  // symbol index of a code of each length = code + valoffset
  uint8_t symbols[256];
  uint16_t lookup[1 << kLookaheadBits];  // (length << 8) | symbol for short codes, 0 otherwise
  int32_t ac_fast[1 << kLookaheadBits];  // value * 65536 + run * 256 + bits used, 0 if not fast
  // What the tables were built from (rebuilding is skipped when a file repeats them).
  bool built = false, built_dc = false;
  uint8_t source[17 + 256];
};

// Builds `t` from `spec` as jpeg_make_d_derived_tbl does, with its checks. Returns an error
// message ("" if fine).
const char* build_huffman_table(const HuffmanSpec& spec, bool dc, HuffmanTable& t);
// Annex K's tables, which libjpeg-turbo uses for table 0 / 1 when a file has no DHT (Motion JPEG).
void standard_huffman_spec(bool dc, int slot, HuffmanSpec& spec);

// The file as libjpeg's data source sees it: a read position and a marker read but not yet
// processed (cinfo->unread_marker).
struct Source {
  const uint8_t* data = nullptr;
  size_t size = 0, pos = 0;
  int unread_marker = 0;

  // jdmarker.c next_marker: skips to the next marker (FF xx, xx neither 00 nor FF) and sets
  // unread_marker. False at the end of the file.
  bool next_marker();
};

// Entropy-coded bits as libjpeg reads them (jpeg_fill_bit_buffer): bytes up to the next marker,
// FF 00 (also FF FF .. 00) read as FF. Past a marker or the end of the file it reads zero bits
// and remembers whether any were consumed: libjpeg's "insufficient data" (at a marker) or a
// truncated file (at the end).
class BitReader {
 public:
  // Starts reading at src's position (after a scan header or a restart marker).
  void start(Source* src) {
    src_ = src;
    buf_ = 0;
    count_ = 0;
    padding_ = 0;
    exhausted_ = src->unread_marker != 0;
    at_eof_ = false;
  }
  void ensure(int n) {  // n <= 57
    if (count_ < n) refill();
  }
  uint32_t peek(int n) const { return uint32_t(buf_ >> (64 - n)); }  // 1 <= n <= 32
  void skip(int n) {
    buf_ <<= n;
    count_ -= n;
  }
  int bits(int n) {  // n <= 16, after ensure
    const int v = int(peek(n));
    skip(n);
    return v;
  }
  // Zero bits past the data were consumed (sticky until start()).
  bool overran() const { return count_ < padding_; }
  bool at_eof() const { return at_eof_; }

 private:
  void refill();

  Source* src_ = nullptr;
  uint64_t buf_ = 0;  // bits, most significant first
  int count_ = 0;     // bits in buf_
  int padding_ = 0;   // zero bits appended past the data (the last padding_ of count_)
  bool exhausted_ = false, at_eof_ = false;
};

// Huffman-decodes one symbol (jdhuff.h HUFF_DECODE + jpeg_huff_decode). A bit string that is no
// code takes 17 bits and decodes as 0, as in libjpeg. Needs 17 bits ensured.
inline int decode_symbol(BitReader& br, const HuffmanTable& t) {
  const uint16_t e = t.lookup[br.peek(kLookaheadBits)];
  if (e) {
    br.skip(e >> 8);
    return e & 0xFF;
  }
  for (int l = kLookaheadBits + 1; l <= 16; ++l) {
    const int32_t code = int32_t(br.peek(l));
    if (code <= t.maxcode[l]) {
      br.skip(l);
      return t.symbols[(code + t.valoffset[l]) & 0xFF];
    }
  }
  br.skip(17);
  return 0;
}

// jdhuff.h HUFF_EXTEND: the s-bit value r as a signed coefficient.
inline int extend(int r, int s) { return r < (1 << (s - 1)) ? r - (1 << s) + 1 : r; }

// The islow IDCT of one block (coefficients in natural order, libjpeg's 16-bit quantisation
// multipliers) into 8x8 samples at `out`, rows `stride` apart (jpeg_idct.cpp): the decoder's,
// equal to idct_islow_x86_simd.
void idct_islow(const int16_t* coef, const int16_t* quant, uint8_t* out, size_t stride);
// References: libjpeg-turbo's x86 SIMD arithmetic (what PIL on x86-64 runs), and jidctint.c (its
// C code). They differ only on blocks whose coefficients overflow (corrupt data).
void idct_islow_x86_simd(const int16_t* coef, const int16_t* quant, uint8_t* out, size_t stride);
void idct_islow_c(const int16_t* coef, const int16_t* quant, uint8_t* out, size_t stride);

struct Component {
  int id = 0, h = 1, v = 1, quant_slot = 0;  // from SOF
  int dc_slot = 0, ac_slot = 0;              // from the latest scan naming it
  bool quant_latched = false;                // libjpeg copies the table at its first scan
  int16_t quant[64] = {};                    // natural order, as libjpeg's 16-bit multipliers
  int width = 0, height = 0;                 // samples (downsampled_width / _height)
  int blocks_w = 0, blocks_h = 0;            // blocks holding samples (width_in_blocks ...)
  int padded_blocks_w = 0, padded_blocks_h = 0;  // blocks of whole MCUs
  int coef_bits[64];          // progressive: Al of the last scan of each coefficient, -1 before
  std::vector<int16_t> coefs;  // multi-scan files: all blocks, row-major, 64 each
  std::vector<uint8_t> plane;  // samples, padded_blocks_w * 8 per row
  size_t stride() const { return size_t(padded_blocks_w) * 8; }
  int16_t* block(int bx, int by) { return coefs.data() + (size_t(by) * size_t(padded_blocks_w) + size_t(bx)) * 64; }
};

struct Scan {
  int count = 0;
  int comp[4] = {};  // component indexes, scan order
  int ss = 0, se = 63, ah = 0, al = 0;
};

enum class ColorSpace { gray, ycbcr, rgb };

constexpr int kEndOfFile = -1;  // read_markers: the file ended

}  // namespace et::jpeg_detail

namespace et {

struct JpegDecoder::Impl {
  using Component = jpeg_detail::Component;

  // Files, tables, frame.
  std::string name;
  jpeg_detail::Source src;
  jpeg_detail::HuffmanSpec dc_specs[4], ac_specs[4];
  uint16_t quant_tables[4][64];
  bool quant_defined[4] = {};
  int restart_interval = 0;
  bool saw_jfif = false, saw_adobe = false;
  int adobe_transform = 0;
  bool saw_sof = false, progressive = false, header_read = false;
  bool smoothing_skipped = false;  // the last decode: libjpeg would have smoothed blocks
  int width = 0, height = 0, ncomp = 0, max_h = 1, max_v = 1, mcus_x = 0, mcus_y = 0;
  Component comp[jpeg_detail::kMaxComponents];
  jpeg_detail::ColorSpace color = jpeg_detail::ColorSpace::gray;

  // The scan being decoded.
  jpeg_detail::Scan scan;
  jpeg_detail::HuffmanTable tables[8];  // decoding tables: DC slots 0-3, AC slots 4-7
  jpeg_detail::BitReader bits;
  int next_restart_num = 0, restarts_to_go = 0, eobrun = 0;
  int last_dc[4] = {};
  bool insufficient_data = false;
  std::vector<int16_t> mcu;  // one-pass decoding: the blocks of one MCU
  std::vector<uint8_t> rows;  // output: upsampled rows
  std::vector<int32_t> sums;  // output: h2v2 column sums, h2v1 input with its edges

  // jpeg_markers.cpp
  [[noreturn]] void corrupt(const std::string& what) const;
  [[noreturn]] void truncated(const char* where) const;
  [[noreturn]] void unsupported(const std::string& kind) const;
  void reset(const uint8_t* data, size_t size, const std::string& file);
  void read_header();
  int read_markers(bool eof_ends);  // to the next SOS or EOI (its code), or kEndOfFile
  void read_scan_header();          // the SOS segment src is at; sets up `scan`
  bool read_u8(int& v);
  bool read_u16(int& v);
  bool skip_bytes(long n);
  bool read_sof(int marker);
  bool read_dht();
  bool read_dqt();
  bool read_dri();
  bool read_dac();
  bool read_app();
  bool skip_segment();
  void setup_frame();

  // jpeg_scan.cpp
  void decode_scan(bool one_pass);
  void start_scan_tables();
  void process_restart();
  void resync_to_restart();
  void check_overrun();
  void decode_mcu_sequential(int16_t* const* blocks, const int* block_comp, int nblocks);
  void decode_dc_first(int16_t* const* blocks, const int* block_comp, int nblocks);
  void decode_dc_refine(int16_t* const* blocks, int nblocks);
  void decode_ac_first(int16_t* block);
  void decode_ac_refine(int16_t* block);
  bool needs_block_smoothing() const;

  // jpeg_output.cpp
  void idct_all();
  void write_pixels(uint8_t* out);
};

}  // namespace et
