// Convolution on 4-bit codes (docs/quant.md), exact in integers; the int32 results are scaled
// back to f32 once per element. No im2col and no packing of activations: each pass stages its
// activation-side operand once per chunk of images in the layout the register tiles
// (conv_int_tiles.h) load as vectors, and broadcasts the other operand one word at a time.
//
//   forward        y[k, pos]     = sum_{c, tap} x[c, pos + tap] * w[k, c, tap]
//                  stride 1: x staged zero padded, channels in groups of four [C/4][rows][cols][4];
//                  output rows run over the full padded width (the extra columns are computed
//                  and dropped), so each tap is one constant offset. Other strides: one staged
//                  copy per tap [tap][C/4][P*Q][4].
//   data gradient  dx[c, pos]    = sum_{k, tap} g[k, pos + tap] * w[k, c, flipped tap]
//                  the same tile on g dilated by the stride and padded by R-1-pad.
//   weight grad.   dw[k, c, tap] = sum_{n, pos} x[c, pos*stride + tap] * g[k, pos]
//                  lanes over input channels (x staged per tap column [S][rows][Q/4][C][4]),
//                  words of four positions of g ([P][Q/4][K][4]); threads split the output tiles,
//                  so there are no partial sums to reduce.
// On x86 the vector side is unsigned (vpdpbusd and vpmaddubsw multiply u8 by s8): INT4 codes + 8,
// FP4 codes + 64. The offsets come back out exactly: a padded position holds the offset (the zero
// code), so the correction is offset * (sum of the other operand) per output channel. NEON's
// sdot multiplies signed bytes: no offsets there.
#include <omp.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/carve.h"
#include "backends/cpu/conv_int_tiles.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/igemm.h"
#include "backends/cpu/quantize.h"
#include "memory/stored_codes.h"

namespace et {

namespace {

using cpu::Carve;
using cpu::CarveSize;
using cpu::round_up;

const cpu::IntTileKernels& tiles() {
  const cpu::IntTileKernels* t = nullptr;
  if (cpu::igemm_isa() == cpu::IgemmIsa::Avx512Vnni) t = cpu::int_tiles_vnni();
  if (cpu::igemm_isa() == cpu::IgemmIsa::Avx2) t = cpu::int_tiles_avx2();
  if (cpu::igemm_isa() == cpu::IgemmIsa::NeonDot) t = cpu::int_tiles_neon();
  return t ? *t : *cpu::int_tiles_scalar();
}

// What the staging adds to make the codes unsigned, where the path needs it.
bool signed_codes(DType t) { return t == DType::I4 || t == DType::BitmapI4; }
int x_offset(DType t) { return tiles().unsigned_staged && signed_codes(t) ? 8 : 0; }  // -7..7 -> 1..15
int grad_offset() { return tiles().unsigned_staged ? 64 : 0; }                        // -64..64 -> 0..128
constexpr int64_t kTileWidth = 48;    // positions per conv tile: a multiple of every path's (48, 8, 4)
constexpr int64_t kTileHeight = 8;    // output channels per conv tile (conv_mk of every path)
constexpr int64_t kLanePad = 16;      // weight gradient: channels padded to the widest lane count
// Conv tile passes: a chunk of images stages at most kChunkPositions positions and about
// kStageBytes (L2), and the weights are swept in blocks of about kWeightBlockBytes, so that a
// block stays in L2 while the positions go by (deep layers have megabytes of weights).
constexpr int64_t kChunkPositions = 1024;
constexpr int64_t kStageBytes = 384 << 10;
constexpr int64_t kWeightBlockBytes = 128 << 10;
constexpr int64_t kWgradChunkBytes = 1 << 20;  // weight gradient: staged bytes per chunk

// ---- conv tile passes (forward, data gradient)

struct TilePass {
  int64_t cin = 0, cin4 = 0, cout = 0, coutp = 0;  // channels in (groups of 4) / out (padded)
  int64_t R = 0, S = 0, taps = 0;
  // The source: [cin][hi][wi]; output (p, q) at tap (r, s) reads source row (p * st_h + r - top) /
  // dil_h if that divides (the data gradient reads g dilated by the stride), likewise columns.
  int64_t hi = 0, wi = 0, st_h = 1, st_w = 1, top = 0, left = 0, dil_h = 1, dil_w = 1;
  int64_t pout = 0, qout = 0;  // output rows / columns per image
  // Padded (stride 1 only): one zero-padded copy, output rows run over its full width hs x ws and
  // each tap is one offset. Per tap: a copy of what each tap reads, hs x ws = pout x qout; no
  // wasted positions, so it is the choice for strides and for small maps (where padding is most).
  bool per_tap = false;
  int64_t hs = 0, ws = 0;  // staged rows per image and row width, in positions
  int64_t imgs = 0;        // images per chunk
  int64_t fpos = 0;        // positions computed per chunk (a multiple of kTileWidth)
  int64_t plane = 0;       // positions per staged channel group
  int64_t mblock = 0;      // output channels per sweep over the positions
  int64_t stage_bytes() const { return (per_tap ? taps : 1) * cin4 * plane * 4; }
  int64_t positions(int64_t nb) const { return round_up(nb * hs * ws, kTileWidth); }
};

void finish_pass(TilePass& p, int64_t N) {
  p.cin4 = (p.cin + 3) / 4;
  p.coutp = round_up(p.cout, kTileHeight);
  p.taps = p.R * p.S;
  const int64_t hp = p.pout + p.R - 1, wp = p.qout + p.S - 1;  // the padded copy (stride 1)
  p.per_tap = p.st_h != 1 || p.st_w != 1 || double(hp * wp) > 1.3 * double(p.pout * p.qout);
  p.hs = p.per_tap ? p.pout : hp;
  p.ws = p.per_tap ? p.qout : wp;
  const int64_t image_positions = p.hs * p.ws, position_bytes = (p.per_tap ? p.taps : 1) * p.cin4 * 4;
  const int64_t by_bytes = kStageBytes / (image_positions * position_bytes);
  const int64_t by_positions = kChunkPositions / image_positions;
  const int64_t at_least = (kTileWidth + image_positions - 1) / image_positions;  // one full tile
  p.imgs = std::clamp<int64_t>(std::max(at_least, std::min(by_bytes, by_positions)), 1, std::max<int64_t>(1, N));
  // As many chunks per thread (the threads split the chunks): fewer images per chunk if need be.
  const int64_t threads = cpu_threads(), chunks = round_up((N + p.imgs - 1) / p.imgs, threads);
  p.imgs = std::max<int64_t>(1, (N + chunks - 1) / chunks);
  p.mblock = std::clamp<int64_t>(kWeightBlockBytes / (p.taps * p.cin4 * 4) / kTileHeight * kTileHeight, kTileHeight,
                                 p.coutp);
  p.fpos = p.positions(p.imgs);
  // A tile at the last position reads up to the largest tap offset past it.
  p.plane = p.per_tap ? p.fpos : round_up(p.fpos + (p.R - 1) * p.ws + p.S - 1, 16);
}

TilePass forward_pass(const Conv2dGeom& g) {
  TilePass p;
  p.cin = g.C, p.cout = g.K, p.R = g.R, p.S = g.S;
  p.hi = g.H, p.wi = g.W, p.st_h = g.stride_h, p.st_w = g.stride_w, p.top = g.pad_h, p.left = g.pad_w;
  p.pout = g.P, p.qout = g.Q;
  finish_pass(p, g.N);
  return p;
}

// dx[c, h, w] = sum_{k, r, s} g_dilated[k, h + r - (R-1-pad), w + s - (S-1-pad)] * w[k, c, R-1-r, S-1-s]
TilePass data_pass(const Conv2dGeom& g) {
  TilePass p;
  p.cin = g.K, p.cout = g.C, p.R = g.R, p.S = g.S;
  p.hi = g.P, p.wi = g.Q, p.top = g.R - 1 - g.pad_h, p.left = g.S - 1 - g.pad_w;
  p.dil_h = g.stride_h, p.dil_w = g.stride_w;
  p.pout = g.H, p.qout = g.W;
  finish_pass(p, g.N);
  return p;
}

struct TilePassMemory {
  int32_t* w;       // weight words, panels of kTileHeight output channels (pack_words)
  int8_t* decoded;  // this thread's image of stored input codes (code_rows)
  int32_t* corr;    // [coutp] offset * sum of each output channel's weights
  int64_t* toff;    // [taps] byte offsets
  uint8_t* stage;   // this thread's staging
  int32_t* out;     // this thread's [coutp][fpos] results
};

CarveSize tile_pass_shared(const TilePass& p) {
  CarveSize s;
  return s.add<int32_t>(p.taps * p.cin4 * p.coutp).add<int32_t>(p.coutp).add<int64_t>(p.taps);
}
CarveSize tile_pass_thread(const TilePass& p) {
  CarveSize s;
  return s.add<uint8_t>(p.stage_bytes()).add<int32_t>(p.coutp * p.fpos).add<int8_t>(p.cin * p.hi * p.wi);
}

TilePassMemory carve_shared(const TilePass& p, void* base) {
  Carve cv(base);
  TilePassMemory m{};
  m.w = cv.take<int32_t>(p.taps * p.cin4 * p.coutp);
  m.corr = cv.take<int32_t>(p.coutp);
  m.toff = cv.take<int64_t>(p.taps);
  return m;
}
void carve_thread(const TilePass& p, void* base, TilePassMemory& m) {
  Carve cv(base);
  m.stage = cv.take<uint8_t>(p.stage_bytes());
  m.out = cv.take<int32_t>(p.coutp * p.fpos);
  m.decoded = cv.take<int8_t>(p.cin * p.hi * p.wi);
}

void tap_offsets(const TilePass& p, TilePassMemory& mem) {
  for (int64_t t = 0; t < p.taps; ++t)
    mem.toff[t] = p.per_tap ? t * p.cin4 * p.plane * 4 : ((t / p.S) * p.ws + t % p.S) * 4;
}

// Weight words in tile-height panels, each one contiguous stream for its tile:
// w[((m / 8) * taps * cin4 + t * cin4 + c4) * 8 + m % 8] holds bytes at(m, 4 c4 + j, t), j < 4
// (zero past the channels); corr[m] = offset * the sum of output channel m's bytes. Threads
// split the output channels.
template <class At>
void pack_words(const TilePass& p, At at, int offset, TilePassMemory& mem) {
  const int64_t panel = p.taps * p.cin4 * kTileHeight;
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < p.coutp; ++m) {
    int64_t sum = 0;
    int32_t* wm = mem.w + (m / kTileHeight) * panel + m % kTileHeight;
    for (int64_t t = 0; t < p.taps; ++t)
      for (int64_t c4 = 0; c4 < p.cin4; ++c4) {
        uint8_t b[4] = {0, 0, 0, 0};
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t c = c4 * 4 + j;
          const int8_t v = m < p.cout && c < p.cin ? at(m, c, t) : int8_t(0);
          b[j] = uint8_t(v);
          sum += v;
        }
        std::memcpy(&wm[(t * p.cin4 + c4) * kTileHeight], b, 4);
      }
    mem.corr[m] = int32_t(offset * sum);
  }
}

// Channels [4 c4, 4 c4 + 4) of one input row (src rows `rstride` apart, `n` values) interleaved
// into dst[4 n] with `offset` added.
void interleave4(const int8_t* src, int64_t rstride, int64_t n, int offset, uint8_t* dst) {
  int64_t w = 0;
#if defined(__SSE2__)
  const __m128i off = _mm_set1_epi8(char(offset));
  for (; w + 16 <= n; w += 16) {
    const __m128i r0 = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + w)), off);
    const __m128i r1 = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + rstride + w)), off);
    const __m128i r2 = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * rstride + w)), off);
    const __m128i r3 = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 3 * rstride + w)), off);
    const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);
    const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
    __m128i* d = reinterpret_cast<__m128i*>(dst + 4 * w);
    _mm_storeu_si128(d, _mm_unpacklo_epi16(lo01, lo23));
    _mm_storeu_si128(d + 1, _mm_unpackhi_epi16(lo01, lo23));
    _mm_storeu_si128(d + 2, _mm_unpacklo_epi16(hi01, hi23));
    _mm_storeu_si128(d + 3, _mm_unpackhi_epi16(hi01, hi23));
  }
#endif
  for (; w < n; ++w)
    for (int64_t j = 0; j < 4; ++j) dst[4 * w + j] = uint8_t(src[j * rstride + w] + offset);
}

// Image i of the chunk into the padded staging: source (h, w) at row top + h * dil_h, column
// left + w * dil_w of image i's block of rows. The rest keeps the offset (set by the caller).
void stage_padded(const TilePass& p, const int8_t* src, int offset, int64_t i, uint8_t* stage) {
  const bool row_inside = p.dil_w == 1 && p.left >= 0 && p.left + p.wi <= p.ws;
  const int64_t plane_in = p.hi * p.wi;
  for (int64_t c4 = 0; c4 < p.cin4; ++c4) {
    const bool whole_group = c4 * 4 + 4 <= p.cin;
    for (int64_t h = 0; h < p.hi; ++h) {
      const int64_t row = p.top + h * p.dil_h;
      if (row < 0 || row >= p.hs) continue;
      uint8_t* dst = stage + (c4 * p.plane + (i * p.hs + row) * p.ws) * 4;
      const int8_t* s = src + (c4 * 4 * p.hi + h) * p.wi;
      if (row_inside && whole_group) {
        interleave4(s, plane_in, p.wi, offset, dst + p.left * 4);
        continue;
      }
      for (int64_t j = 0; j < 4 && c4 * 4 + j < p.cin; ++j)
        for (int64_t w = 0; w < p.wi; ++w) {
          const int64_t col = p.left + w * p.dil_w;
          if (col >= 0 && col < p.ws) dst[col * 4 + j] = uint8_t(s[j * plane_in + w] + offset);
        }
    }
  }
}

// Source coordinate read by output coordinate o at tap offset r, or -1 (padding, dilation hole).
int64_t source_at(int64_t o, int64_t st, int64_t r, int64_t top, int64_t dil, int64_t n) {
  const int64_t u = o * st + r - top;
  if (u < 0 || u % dil) return -1;
  return u / dil < n ? u / dil : -1;
}

// Image i of the chunk into the per-tap staging [tap][cin4][pout * qout][4] (+ offset; the rest
// keeps the offset, set by the caller).
void stage_per_tap(const TilePass& p, const int8_t* src, int offset, int64_t i, uint8_t* stage) {
  const int64_t plane_in = p.hi * p.wi;
  const bool contiguous = p.st_w == 1 && p.dil_w == 1;
  for (int64_t t = 0; t < p.taps; ++t) {
    const int64_t r = t / p.S, s = t % p.S;
    // Output columns [q0, q1) read columns q + s - left inside the source (contiguous case).
    const int64_t q0 = std::clamp<int64_t>(p.left - s, 0, p.qout);
    const int64_t q1 = std::clamp<int64_t>(p.wi + p.left - s, q0, p.qout);
    for (int64_t c4 = 0; c4 < p.cin4; ++c4) {
      const int64_t nc = std::min<int64_t>(4, p.cin - c4 * 4);
      uint8_t* base = stage + ((t * p.cin4 + c4) * p.plane + i * p.pout * p.qout) * 4;
      for (int64_t pp = 0; pp < p.pout; ++pp) {
        const int64_t h = source_at(pp, p.st_h, r, p.top, p.dil_h, p.hi);
        if (h < 0) continue;
        uint8_t* dst = base + pp * p.qout * 4;
        const int8_t* srow = src + (c4 * 4 * p.hi + h) * p.wi;
        if (contiguous && nc == 4) {
          interleave4(srow + q0 + s - p.left, plane_in, q1 - q0, offset, dst + q0 * 4);
          continue;
        }
        for (int64_t q = 0; q < p.qout; ++q) {
          const int64_t w = source_at(q, p.st_w, s, p.left, p.dil_w, p.wi);
          if (w < 0) continue;
          uint8_t b[4] = {uint8_t(offset), uint8_t(offset), uint8_t(offset), uint8_t(offset)};
          for (int64_t j = 0; j < nc; ++j) b[j] = uint8_t(srow[j * plane_in + w] + offset);
          std::memcpy(dst + q * 4, b, 4);
        }
      }
    }
  }
}

// Runs a conv tile pass over the batch: chunks of images split over the threads, each staged,
// multiplied tile by tile and handed to emit(n0, nb, out) (out: [coutp][fpos] int32).
template <class Stage, class Emit>
void run_tile_pass(const TilePass& p, int64_t N, int offset, const TilePassMemory& shared, uint8_t* thread_base,
                   size_t thread_bytes, Stage stage, Emit emit) {
  const cpu::IntTileKernels& k = tiles();
  const int64_t tw = k.conv_nv * k.lanes, chunks = (N + p.imgs - 1) / p.imgs;
#pragma omp parallel
  {
    TilePassMemory m = shared;
    carve_thread(p, thread_base + thread_bytes * size_t(omp_get_thread_num()), m);
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t n0 = ch * p.imgs, nb = std::min(p.imgs, N - n0), fpos = p.positions(nb);
      std::memset(m.stage, offset, size_t(p.stage_bytes()));
      for (int64_t i = 0; i < nb; ++i) stage(n0 + i, i, m);
      for (int64_t mb = 0; mb < p.coutp; mb += p.mblock)
        for (int64_t f0 = 0; f0 < fpos; f0 += tw)
          for (int64_t m0 = mb; m0 < std::min(p.coutp, mb + p.mblock); m0 += k.conv_mk) {
            cpu::ConvTileArgs a;
            a.src = m.stage + f0 * 4, a.plane = p.plane * 4, a.toff = m.toff, a.taps = p.taps, a.c4s = p.cin4;
            a.w = m.w + m0 * p.taps * p.cin4, a.wld = kTileHeight;  // panel m0 / 8 (pack_words)
            a.out = m.out + m0 * p.fpos + f0, a.ldo = p.fpos;
            k.conv(a);
          }
      emit(n0, nb, m.out);
    }
  }
}

// Calls row(i, m, r, src) for every output row: image i of the chunk, channel m, row r, whose
// qout values start at src (out[m][(i * hs + r) * ws]).
template <class Row>
void for_each_output_row(const TilePass& p, int64_t nb, const int32_t* out, Row row) {
  for (int64_t i = 0; i < nb; ++i)
    for (int64_t m = 0; m < p.cout; ++m)
      for (int64_t r = 0; r < p.pout; ++r) row(i, m, r, out + m * p.fpos + (i * p.hs + r) * p.ws);
}

// ---- weight gradient

// Staged in blocks, so that every tile reads two contiguous streams: x as
// [tap column s][16 channels][image][row][q4][16][4] bytes, g as [8 output channels][image][p][q4][8]
// words (a word: four positions).
struct WgradPass {
  int64_t cp = 0, kp = 0;     // channels padded to 16 / output channels padded to 16
  int64_t q4s = 0, rows = 0;  // groups of four output columns; staged input rows per image
  int64_t imgs = 0;           // per chunk
  int64_t x_img = 0;          // bytes of one image in one 16-channel block
  int64_t g_img = 0;          // words of one image in one 8-channel block
  int64_t x_blk(int64_t nb) const { return nb * x_img; }               // a 16-channel block of a chunk
  int64_t x_col(int64_t nb) const { return cp / kLanePad * x_blk(nb); }  // a tap column of a chunk
  int64_t g_blk(int64_t nb) const { return nb * g_img; }
};

WgradPass wgrad_pass(const Conv2dGeom& g) {
  WgradPass w;
  w.cp = round_up(g.C, kLanePad), w.kp = round_up(g.K, kLanePad);
  w.q4s = (g.Q + 3) / 4;
  w.rows = (g.P - 1) * g.stride_h + g.R;
  w.x_img = w.rows * w.q4s * kLanePad * 4;
  w.g_img = g.P * w.q4s * kTileHeight;
  const int64_t per_image = g.S * w.cp / kLanePad * w.x_img + w.kp / kTileHeight * w.g_img * 4;
  w.imgs = std::clamp<int64_t>(kWgradChunkBytes / per_image, 1, std::max<int64_t>(1, g.N));
  return w;
}

CarveSize wgrad_bytes(const Conv2dGeom& g, const WgradPass& w) {
  CarveSize s;
  return s.add<int32_t>(g.R * g.S * w.kp * w.cp)
      .add<int64_t>(w.kp)
      .add<uint8_t>(g.S * w.x_col(w.imgs))
      .add<int32_t>(w.kp / kTileHeight * w.g_blk(w.imgs))
      .add<int8_t>(g.C * g.H * g.W * cpu_threads());  // per thread: an image of stored codes (code_rows)
}

// Four codes (a little-endian word) plus the offset, per byte: 0 for UINT4 codes; 8 for INT4 codes
// -8..7, where b + 8 = (b ^ 8) & 15 in every byte (no carries between bytes).
uint32_t offset_word(uint32_t v, int offset) { return offset ? (v ^ 0x08080808u) & 0x0F0F0F0Fu : v; }

// Image i of a chunk of nb: x's codes + offset and g's words into their blocks (padding: the
// offset for x, zeros for g).
void stage_wgrad(const Conv2dGeom& g, const WgradPass& w, int64_t nb, const int8_t* x, const int8_t* gr, int offset,
                 int64_t i, uint8_t* xs, int32_t* gs) {
  const int64_t HW = g.H * g.W, row_bytes = w.q4s * kLanePad * 4;
  for (int64_t s = 0; s < g.S; ++s)
    for (int64_t cb = 0; cb < w.cp / kLanePad; ++cb)
      std::memset(xs + s * w.x_col(nb) + cb * w.x_blk(nb) + i * w.x_img, offset, size_t(w.x_img));
  for (int64_t s = 0; s < g.S; ++s)
    for (int64_t row = 0; row < w.rows; ++row) {
      const int64_t h = row - g.pad_h;
      if (h < 0 || h >= g.H) continue;
      uint8_t* dst_row = xs + s * w.x_col(nb) + i * w.x_img + row * row_bytes;  // + (c / 16) * x_blk + (c % 16) * 4
      const int8_t* src = x + h * g.W;                                            // channel c at + c * HW
      for (int64_t q4 = 0; q4 < w.q4s; ++q4) {
        uint8_t* dst = dst_row + q4 * kLanePad * 4;
        const int64_t col0 = q4 * 4 * g.stride_w + s - g.pad_w;  // byte j reads column col0 + j * stride
        if (g.stride_w == 1 && col0 >= 0 && col0 + 4 <= g.W && q4 * 4 + 4 <= g.Q) {
#if defined(__AVX512F__)
          if (g.C % kLanePad == 0) {  // 16 channels' words in one gather, one 64-byte store
            const __m512i rows16 = _mm512_mullo_epi32(_mm512_set1_epi32(int32_t(HW)),
                                                      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
            for (int64_t cb = 0; cb < g.C / kLanePad; ++cb) {
              // mask_ form with a defined (zero) source and all lanes on: the same gather, without
              // GCC 12's -Wmaybe-uninitialized on the unmasked form's undefined source operand.
              __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), __mmask16(0xFFFF), rows16,
                                                      src + cb * kLanePad * HW + col0, 1);
              if (offset) v = _mm512_and_si512(_mm512_xor_si512(v, _mm512_set1_epi32(0x08080808)), _mm512_set1_epi32(0x0F0F0F0F));
              _mm512_storeu_si512(dst + cb * w.x_blk(nb), v);
            }
            continue;
          }
#endif
          for (int64_t c = 0; c < g.C; ++c) {
            uint32_t v;
            std::memcpy(&v, src + c * HW + col0, 4);
            v = offset_word(v, offset);
            std::memcpy(dst + (c / kLanePad) * w.x_blk(nb) + (c % kLanePad) * 4, &v, 4);
          }
          continue;
        }
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t col = col0 + j * g.stride_w;
          if (q4 * 4 + j >= g.Q || col < 0 || col >= g.W) continue;
          for (int64_t c = 0; c < g.C; ++c)
            dst[(c / kLanePad) * w.x_blk(nb) + (c % kLanePad) * 4 + j] = uint8_t(src[c * HW + col] + offset);
        }
      }
    }
  for (int64_t kb = 0; kb < w.kp / kTileHeight; ++kb)
    std::memset(gs + kb * w.g_blk(nb) + i * w.g_img, 0, sizeof(int32_t) * size_t(w.g_img));
  const int64_t PQ = g.P * g.Q;
  for (int64_t k = 0; k < g.K; ++k) {
    int32_t* gk = gs + (k / kTileHeight) * w.g_blk(nb) + i * w.g_img + k % kTileHeight;
    const int8_t* src = gr + k * PQ;
    if (g.Q % 4 == 0) {  // groups of four positions never straddle rows: word copies
      for (int64_t f4 = 0; f4 < PQ / 4; ++f4) std::memcpy(&gk[f4 * kTileHeight], src + f4 * 4, 4);
      continue;
    }
    for (int64_t p = 0; p < g.P; ++p)
      for (int64_t q = 0; q < g.Q; ++q)
        reinterpret_cast<uint8_t*>(&gk[(p * w.q4s + q / 4) * kTileHeight])[q % 4] = uint8_t(src[p * g.Q + q]);
  }
}

}  // namespace

size_t CpuBackend::conv2d_q_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const {
  if (pass == ConvPass::BackwardWeight) return wgrad_bytes(g, wgrad_pass(g)).bytes;
  const TilePass p = pass == ConvPass::Forward ? forward_pass(g) : data_pass(g);
  return tile_pass_shared(p).bytes + tile_pass_thread(p).bytes * size_t(cpu_threads());
}

namespace {
// The forward on codes; sum1 / sum2 [N, K] (or null): each output plane's sums as BN takes them
// (bn_rows::plane_sums), for each chunk of images right after it is written, while it is in cache.
void forward_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y, Workspace ws,
               float* sum1, float* sum2) {
  ET_CHECK(g.groups == 1 && wq.dtype == DType::I4 && is_input_codes(xq.dtype));
  const TilePass p = forward_pass(g);
  const size_t shared = tile_pass_shared(p).bytes, per_thread = tile_pass_thread(p).bytes;
  ET_CHECK(ws.bytes >= shared + per_thread * size_t(cpu_threads()), "conv int workspace");
  uint8_t* base = static_cast<uint8_t*>(ws.data);
  TilePassMemory mem = carve_shared(p, base);
  const int off = x_offset(xq.dtype);
  const int8_t* w = wq.codes();
  const int64_t RS = g.R * g.S, PQ = g.P * g.Q;
  pack_words(p, [&](int64_t k, int64_t c, int64_t t) { return w[(k * g.C + c) * RS + t]; }, off, mem);
  tap_offsets(p, mem);
  const float scale = xq.host_scale() * wq.host_scale();
  const float* bias = b.defined() ? b.f32() : nullptr;
  float* yd = y.f32();
  run_tile_pass(
      p, g.N, off, mem, base + shared, per_thread,
      [&](int64_t n, int64_t i, const TilePassMemory& m) {
        const int8_t* x = code_rows(xq, n, 1, m.decoded);  // dense codes, or decoded from the stash
        p.per_tap ? stage_per_tap(p, x, off, i, m.stage) : stage_padded(p, x, off, i, m.stage);
      },
      [&](int64_t n0, int64_t nb, const int32_t* out) {
        for_each_output_row(p, nb, out, [&](int64_t i, int64_t k, int64_t r, const int32_t* src) {
          float* dst = yd + ((n0 + i) * g.K + k) * PQ + r * g.Q;
          const int32_t corr = mem.corr[k];
          const float bk = bias ? bias[k] : 0.f;
          for (int64_t q = 0; q < g.Q; ++q) dst[q] = float(src[q] - corr) * scale + bk;
        });
        if (sum1)
          for (int64_t pl = n0 * g.K; pl < (n0 + nb) * g.K; ++pl)
            bn_rows::plane_sums(yd + pl * PQ, PQ, sum1 + pl, sum2 + pl);
      });
}
}  // namespace

void CpuBackend::conv2d_forward_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y,
                                  Workspace ws) {
  forward_q(g, xq, wq, b, y, ws, nullptr, nullptr);
}

void CpuBackend::conv2d_forward_q_sums(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b,
                                       Tensor& y, Tensor& sums, Workspace ws) {
  ET_CHECK(sums.dim(0) == 2 && sums.dim(1) >= g.N && sums.dim(2) == g.K, "conv plane sums into ", sums.shape.str());
  forward_q(g, xq, wq, b, y, ws, sums.f32(), sums.f32() + sums.dim(1) * g.K);
}

void CpuBackend::conv2d_backward_data_q(const Conv2dGeom& g, const Tensor& gq, const Tensor& wq, Tensor& dx,
                                        bool accumulate, Workspace ws) {
  ET_CHECK(g.groups == 1 && wq.dtype == DType::I4 && gq.dtype == DType::F4);
  const TilePass p = data_pass(g);
  const size_t shared = tile_pass_shared(p).bytes, per_thread = tile_pass_thread(p).bytes;
  ET_CHECK(ws.bytes >= shared + per_thread * size_t(cpu_threads()), "conv int workspace");
  uint8_t* base = static_cast<uint8_t*>(ws.data);
  TilePassMemory mem = carve_shared(p, base);
  const int8_t* w = wq.codes();
  const int64_t RS = g.R * g.S, HW = g.H * g.W, KPQ = g.K * g.P * g.Q;
  // Correlation with the flipped kernel: tap t of the data gradient is tap RS-1-t of w.
  const int off = grad_offset();
  pack_words(p, [&](int64_t c, int64_t k, int64_t t) { return w[(k * g.C + c) * RS + RS - 1 - t]; }, off, mem);
  tap_offsets(p, mem);
  const float scale = gq.host_scale() * wq.host_scale();
  float* dxd = dx.f32();
  run_tile_pass(
      p, g.N, off, mem, base + shared, per_thread,
      [&](int64_t n, int64_t i, const TilePassMemory& m) {
        const int8_t* gn = gq.codes() + n * KPQ;
        p.per_tap ? stage_per_tap(p, gn, off, i, m.stage) : stage_padded(p, gn, off, i, m.stage);
      },
      [&](int64_t n0, int64_t nb, const int32_t* out) {
        for_each_output_row(p, nb, out, [&](int64_t i, int64_t c, int64_t r, const int32_t* src) {
          float* dst = dxd + ((n0 + i) * g.C + c) * HW + r * g.W;
          const int32_t corr = mem.corr[c];
          if (accumulate)
            for (int64_t q = 0; q < g.W; ++q) dst[q] = float(src[q] - corr) * scale + dst[q];
          else
            for (int64_t q = 0; q < g.W; ++q) dst[q] = float(src[q] - corr) * scale;
        });
      });
}

void CpuBackend::conv2d_backward_weight_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& gq, Tensor& dw,
                                          Tensor& db, bool accumulate, Workspace ws) {
  ET_CHECK(g.groups == 1 && gq.dtype == DType::F4 && is_input_codes(xq.dtype));
  // |sum| <= N * PQ * 15 * 64 (unsigned side <= 15 with its offset) must fit the int32 sums.
  ET_CHECK(double(g.N) * double(g.P * g.Q) * 64.0 * 15.0 < 2147483647.0, "int32 weight-gradient sums could overflow");
  const WgradPass w = wgrad_pass(g);
  ET_CHECK(ws.bytes >= wgrad_bytes(g, w).bytes, "conv int workspace");
  const int64_t RS = g.R * g.S, CHW = g.C * g.H * g.W, KPQ = g.K * g.P * g.Q, PQ = g.P * g.Q;
  Carve cv(ws.data);
  int32_t* acc = cv.take<int32_t>(RS * w.kp * w.cp);  // [tap][kp][cp]
  int64_t* gsum = cv.take<int64_t>(w.kp);
  uint8_t* xs = cv.take<uint8_t>(g.S * w.x_col(w.imgs));
  int32_t* gs = cv.take<int32_t>(w.kp / kTileHeight * w.g_blk(w.imgs));
  int8_t* decoded = cv.take<int8_t>(CHW * cpu_threads());
  const int off = x_offset(xq.dtype);

  // Tiles: (tap, 8 output channels, a block of input channels: the widest the path has).
  const cpu::IntTileKernels& k = tiles();
  cpu::WgradTileFn tile = k.wgrad_1x8;
  int64_t cw = k.lanes;
  if (k.wgrad_2x8 && w.cp % (2 * k.lanes) == 0) tile = k.wgrad_2x8, cw = 2 * k.lanes;
  const int64_t kblocks = w.kp / kTileHeight, cblocks = w.cp / cw, ntiles = RS * kblocks * cblocks;
  const int64_t chunks = (g.N + w.imgs - 1) / w.imgs, row_bytes = w.q4s * kLanePad * 4;
  std::memset(acc, 0, sizeof(int32_t) * size_t(RS * w.kp * w.cp));
#pragma omp parallel
  {
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t n0 = ch * w.imgs, nb = std::min(w.imgs, g.N - n0);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < nb; ++i) {
        const int8_t* x = code_rows(xq, n0 + i, 1, decoded + CHW * omp_get_thread_num());  // dense, or from the stash
        stage_wgrad(g, w, nb, x, gq.codes() + (n0 + i) * KPQ, off, i, xs, gs);
      }
#pragma omp for schedule(static)
      for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t tap = t / (kblocks * cblocks), kb = (t / cblocks) % kblocks, c0 = (t % cblocks) * cw;
        const int64_t r = tap / g.S, s = tap % g.S;
        cpu::WgradTileArgs a;
        a.x = xs + s * w.x_col(nb) + (c0 / kLanePad) * w.x_blk(nb) + (c0 % kLanePad) * 4 + r * row_bytes;
        a.x_img = w.x_img, a.x_row = g.stride_h * row_bytes, a.x_q4 = kLanePad * 4;
        a.x_v = k.lanes == kLanePad ? w.x_blk(nb) : k.lanes * 4;  // the next vector's channels
        a.g = gs + kb * w.g_blk(nb);
        a.g_img = w.g_img, a.g_row = w.q4s * kTileHeight, a.g_q4 = kTileHeight;
        a.imgs = nb, a.rows = g.P, a.q4s = w.q4s;
        a.out = acc + (tap * w.kp + kb * kTileHeight) * w.cp + c0, a.ldo = w.cp;
        tile(a);
      }
    }
    // The sums of g per output channel: the bias gradient and the offset's correction.
#pragma omp for schedule(static)
    for (int64_t kk = 0; kk < g.K; ++kk) {
      int64_t s = 0;
      if (db.defined() || off != 0)
        for (int64_t n = 0; n < g.N; ++n) s += cpu::sum_codes(gq.codes() + n * KPQ + kk * PQ, PQ);
      gsum[kk] = s;
    }
  }
  const float scale = xq.host_scale() * gq.host_scale();
  float* wd = dw.f32();
  for (int64_t kk = 0; kk < g.K; ++kk)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t t = 0; t < RS; ++t) {
        const int64_t v = int64_t(acc[(t * w.kp + kk) * w.cp + c]) - off * gsum[kk];
        float& d = wd[(kk * g.C + c) * RS + t];
        d = float(v) * scale + (accumulate ? d : 0.f);
      }
  if (db.defined())
    for (int64_t kk = 0; kk < g.K; ++kk) db.f32()[kk] = float(gsum[kk]) * gq.host_scale() + (accumulate ? db.f32()[kk] : 0.f);
}

}  // namespace et
