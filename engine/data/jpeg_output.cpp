// The whole decode (jdapistd.c's order: one-pass for a single interleaved scan, else every scan
// into whole-image coefficients first), then libjpeg-turbo's output stage as PIL leaves it:
// do_fancy_upsampling on (jdsample.c: h2v1 and h2v2 triangle filters when the component is
// more than 2 samples wide, h1v2 always, plain replication otherwise) and jdcolor.c's YCbCr ->
// RGB with its 16-bit fixed-point tables. (libjpeg's merged h2v2 upsampler runs only with fancy
// upsampling off.)
#include <algorithm>
#include <cstring>

#include "engine/data/jpeg_internal.h"

namespace et {
namespace jd = jpeg_detail;

namespace {

// jdcolor.c build_ycc_rgb_table's constants: SCALEBITS 16, FIX(x) = x * 2^16 rounded. Its
// tables hold (FIX(1.402) * (cr - 128) + ONE_HALF) >> 16 and so on; computed here in the loop,
// which the compiler vectorises, rather than looked up.
constexpr int32_t fix16(double x) { return int32_t(x * 65536.0 + 0.5); }
constexpr int32_t kCrR = fix16(1.40200), kCbB = fix16(1.77200), kCrG = fix16(0.71414), kCbG = fix16(0.34414);

inline uint8_t clamp255(int32_t v) { return uint8_t(std::min(255, std::max(0, v))); }

// jdcolor.c ycc_rgb_convert: R = Y + Cr_r_tab[Cr], G = Y + ((Cb_g_tab[Cb] + Cr_g_tab[Cr]) >> 16),
// B = Y + Cb_b_tab[Cb], each clamped by the range-limit table.
void ycc_to_rgb(const uint8_t* __restrict yy, const uint8_t* __restrict cb, const uint8_t* __restrict cr, int w,
                uint8_t* __restrict out) {
  for (int x = 0; x < w; ++x) {
    const int32_t luma = yy[x], b = cb[x] - 128, r = cr[x] - 128;
    out[3 * x] = clamp255(luma + ((kCrR * r + 32768) >> 16));
    out[3 * x + 1] = clamp255(luma + ((-kCbG * b - kCrG * r + 32768) >> 16));
    out[3 * x + 2] = clamp255(luma + ((kCbB * b + 32768) >> 16));
  }
}

// The upsampling loops run over whole chunks of kChunk samples, past the component's width into
// the planes' padding (whole blocks plus kPlaneSlack), so that no scalar remainder loop is left
// once the compiler vectorises them; what lands past the width is never used.
constexpr int kChunk = 16;
constexpr size_t kPlaneSlack = kChunk;
inline int chunked(int w) { return (w + kChunk - 1) / kChunk * kChunk; }

// jdsample.c h2v1_fancy_upsample: each output sample 3/4 of the nearer input, 1/4 of the
// further, rounding alternately down (+1) and up (+2); the end samples are copied, which is what
// the formula gives when an end sample is its own outer neighbour. `ext` holds chunked(w) + 2.
void h2v1_fancy(const uint8_t* __restrict in, int w, int32_t* __restrict ext, uint8_t* __restrict out) {
  const int n = chunked(w);
  for (int i = 0; i < n; ++i) ext[i + 1] = in[i];
  ext[0] = ext[1];
  ext[w + 1] = ext[w];
  for (int i = 0; i < n; ++i) {
    out[2 * i] = uint8_t((ext[i + 1] * 3 + ext[i] + 1) >> 2);
    out[2 * i + 1] = uint8_t((ext[i + 1] * 3 + ext[i + 2] + 2) >> 2);
  }
}

// jdsample.c h2v2_fancy_upsample: 3/4 nearer row + 1/4 further row into column sums, then the
// same horizontally: (3 * this + neighbour + 8) >> 4 on the left, + 7 on the right; the end
// columns count themselves as their outer neighbour ((4 * sum + 8) >> 4 and (4 * sum + 7) >> 4
// in libjpeg). `sums` holds chunked(w) + 2.
void h2v2_fancy(const uint8_t* __restrict near, const uint8_t* __restrict far, int w, int32_t* __restrict sums,
                uint8_t* __restrict out) {
  const int n = chunked(w);
  for (int i = 0; i < n; ++i) sums[i + 1] = near[i] * 3 + far[i];
  sums[0] = sums[1];
  sums[w + 1] = sums[w];
  for (int i = 0; i < n; ++i) {
    out[2 * i] = uint8_t((sums[i + 1] * 3 + sums[i] + 8) >> 4);
    out[2 * i + 1] = uint8_t((sums[i + 1] * 3 + sums[i + 2] + 7) >> 4);
  }
}

// jdsample.c h1v2_fancy_upsample: vertical 3/4 + 1/4, +1 for the upper output row, +2 for the lower.
void h1v2_fancy(const uint8_t* __restrict near, const uint8_t* __restrict far, int w, int bias,
                uint8_t* __restrict out) {
  const int n = chunked(w);
  for (int i = 0; i < n; ++i) out[i] = uint8_t((near[i] * 3 + far[i] + bias) >> 2);
}

}  // namespace

void JpegDecoder::decode(uint8_t* out) {
  Impl& d = *impl_;
  ET_CHECK(d.header_read, "JpegDecoder::decode without a successful read_header");
  d.header_read = false;
  d.read_scan_header();
  // jdinput.c: a file whose first scan lacks a component, or a progressive one, is multi-scan.
  const bool multi_scan = d.progressive || d.scan.count < d.ncomp;
  // jdhuff.c jinit_huff_decoder: a sequential file without tables 0 and 1 gets Annex K's (Motion
  // JPEG leaves them out); progressive ones do not.
  if (!d.progressive)
    for (int slot = 0; slot < 2; ++slot) {
      if (!d.dc_specs[slot].defined) jd::standard_huffman_spec(true, slot, d.dc_specs[slot]);
      if (!d.ac_specs[slot].defined) jd::standard_huffman_spec(false, slot, d.ac_specs[slot]);
    }
  for (int c = 0; c < d.ncomp; ++c) {
    Impl::Component& k = d.comp[c];
    k.plane.resize(k.stride() * size_t(k.padded_blocks_h) * 8 + kPlaneSlack);
    if (multi_scan) k.coefs.assign(size_t(k.padded_blocks_w) * size_t(k.padded_blocks_h) * 64, 0);
    std::fill(k.coef_bits, k.coef_bits + 64, -1);
  }
  if (!multi_scan) {
    d.decode_scan(true);
    // The image is complete: libjpeg reads on to EOI, where a truncated file no longer matters
    // to PIL but a second scan or a corrupt segment does.
    const int m = d.read_markers(true);
    if (m == 0xDA) d.corrupt("a second scan in a single-scan file (libjpeg expects EOI)");
  } else {
    for (;;) {
      d.decode_scan(false);
      const int m = d.read_markers(false);
      if (m == 0xD9) break;
      ET_CHECK(m == 0xDA, m);  // after the frame header, read_markers stops at SOS or EOI only
      d.read_scan_header();
    }
    d.smoothing_skipped = d.needs_block_smoothing();
    d.idct_all();
  }
  d.write_pixels(out);
}

bool JpegDecoder::libjpeg_would_smooth() const { return impl_->smoothing_skipped; }

void JpegDecoder::Impl::idct_all() {
  for (int c = 0; c < ncomp; ++c) {
    Component& k = comp[c];
    for (int by = 0; by < k.blocks_h; ++by)
      for (int bx = 0; bx < k.blocks_w; ++bx)
        jd::idct_islow(k.block(bx, by), k.quant, k.plane.data() + size_t(by) * 8 * k.stride() + size_t(bx) * 8,
                       k.stride());
  }
}

void JpegDecoder::Impl::write_pixels(uint8_t* out) {
  // How each component becomes full size (jdsample.c jinit_upsampler's choice).
  enum class Up { none, h2v1, h1v2, h2v2, replicate };
  Up up[jd::kMaxComponents];
  size_t offset[jd::kMaxComponents], total = 0;
  for (int c = 0; c < ncomp; ++c) {
    const Component& k = comp[c];
    const int hr = max_h / k.h, vr = max_v / k.v;
    up[c] = hr == 1 && vr == 1            ? Up::none
            : hr == 2 && vr == 1 && k.width > 2 ? Up::h2v1
            : hr == 1 && vr == 2                ? Up::h1v2
            : hr == 2 && vr == 2 && k.width > 2 ? Up::h2v2
                                                : Up::replicate;  // h2v1_upsample, h2v2_upsample, int_upsample
    offset[c] = total;
    total += size_t(std::max(k.width * hr, 2 * chunked(k.width))) + 64;  // one upsampled row
  }
  rows.resize(total);
  sums.resize(size_t(chunked(width)) + 2);
  const uint8_t* row[jd::kMaxComponents];
  for (int y = 0; y < height; ++y) {
    for (int c = 0; c < ncomp; ++c) {
      const Component& k = comp[c];
      const uint8_t* plane = k.plane.data();
      const size_t stride = k.stride();
      uint8_t* buf = rows.data() + offset[c];
      // Vertical 2:1: the nearer input row, and the other one of the pair (above for the upper
      // output row, below for the lower), edge rows repeated (jdmainct.c's context rows).
      const int nearer = y >> 1;
      const int further = (y & 1) == 0 ? std::max(nearer - 1, 0) : std::min(nearer + 1, k.height - 1);
      row[c] = buf;
      switch (up[c]) {
        case Up::none: row[c] = plane + size_t(y) * stride; break;
        case Up::h2v1: h2v1_fancy(plane + size_t(y) * stride, k.width, sums.data(), buf); break;
        case Up::h1v2:
          h1v2_fancy(plane + size_t(nearer) * stride, plane + size_t(further) * stride, k.width, (y & 1) + 1, buf);
          break;
        case Up::h2v2:
          h2v2_fancy(plane + size_t(nearer) * stride, plane + size_t(further) * stride, k.width, sums.data(), buf);
          break;
        case Up::replicate: {
          const int hr = max_h / k.h;
          const uint8_t* in = plane + size_t(y / (max_v / k.v)) * stride;
          for (int x = 0; x < k.width * hr; ++x) buf[x] = in[x / hr];
          break;
        }
      }
    }
    uint8_t* o = out + size_t(y) * size_t(width) * size_t(ncomp == 1 ? 1 : 3);
    if (ncomp == 1) {
      std::memcpy(o, row[0], size_t(width));
    } else if (color == jd::ColorSpace::rgb) {
      for (int x = 0; x < width; ++x, o += 3) {
        o[0] = row[0][x];
        o[1] = row[1][x];
        o[2] = row[2][x];
      }
    } else {
      ycc_to_rgb(row[0], row[1], row[2], width, o);
    }
  }
}

// ---- the public class ----

JpegDecoder::JpegDecoder() : impl_(std::make_unique<Impl>()) {}
JpegDecoder::~JpegDecoder() = default;

void JpegDecoder::read_header(const uint8_t* data, size_t size, const std::string& name) {
  ET_CHECK(size >= 2 && data[0] == 0xFF && data[1] == 0xD8, "read_header needs a file starting with SOI");
  Impl& d = *impl_;
  d.reset(data, size, name);
  d.read_header();
  // jdapimin.c default_decompress_parms: JFIF means YCbCr; else an Adobe marker's transform
  // (0: RGB); else component ids 'R' 'G' 'B' mean RGB; else YCbCr.
  if (d.ncomp == 1) {
    d.color = jd::ColorSpace::gray;
  } else if (d.saw_jfif) {
    d.color = jd::ColorSpace::ycbcr;
  } else if (d.saw_adobe) {
    d.color = d.adobe_transform == 0 ? jd::ColorSpace::rgb : jd::ColorSpace::ycbcr;
  } else {
    const bool rgb_ids = d.comp[0].id == 'R' && d.comp[1].id == 'G' && d.comp[2].id == 'B';
    d.color = rgb_ids ? jd::ColorSpace::rgb : jd::ColorSpace::ycbcr;
  }
}

int JpegDecoder::width() const { return impl_->width; }
int JpegDecoder::height() const { return impl_->height; }
int JpegDecoder::channels() const { return impl_->ncomp == 1 ? 1 : 3; }
uint64_t JpegDecoder::padded_pixels() const {
  return uint64_t(impl_->mcus_x) * 8 * uint64_t(impl_->max_h) * uint64_t(impl_->mcus_y) * 8 * uint64_t(impl_->max_v);
}

}  // namespace et
