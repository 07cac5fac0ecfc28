// JPEG markers and tables, read as libjpeg-turbo 2.1 reads them (jdmarker.c, jdinput.c,
// jdapimin.c): the same segments accepted, the same ones fatal, the same quirks (a DQT or DHT
// longer than its tables reads on, component ids made unique, the colour space guessed from
// JFIF / Adobe markers and component ids). Where libjpeg would wait for more data at the end of
// the file, PIL reports a truncated file: the read functions return false there.
#include <algorithm>
#include <cstring>

#include "engine/data/jpeg_internal.h"

namespace et {
namespace jd = jpeg_detail;

namespace {

std::string hex2(int v) {
  static const char* digits = "0123456789ABCDEF";
  return std::string{digits[(v >> 4) & 15], digits[v & 15]};
}

}  // namespace

bool jd::Source::next_marker() {
  for (;;) {
    while (pos < size && data[pos] != 0xFF) ++pos;  // garbage (libjpeg warns)
    do {
      if (++pos >= size) return false;
    } while (data[pos] == 0xFF);  // fill bytes
    const int c = data[pos++];
    if (c != 0) {
      unread_marker = c;
      return true;
    }
    // FF 00: a stuffed byte of entropy-coded data, skipped like garbage.
  }
}

void JpegDecoder::Impl::corrupt(const std::string& what) const { user_error(name, ": corrupt JPEG: ", what); }

void JpegDecoder::Impl::truncated(const char* where) const {
  user_error(name, ": JPEG file truncated (", where, "; ", src.size, " bytes)");
}

void JpegDecoder::Impl::reset(const uint8_t* data, size_t size, const std::string& file) {
  name = file;
  src = jd::Source{data, size, 2, 0};  // after SOI
  for (int i = 0; i < 4; ++i) dc_specs[i].defined = ac_specs[i].defined = quant_defined[i] = false;
  restart_interval = 0;
  saw_jfif = saw_adobe = saw_sof = progressive = header_read = smoothing_skipped = false;
  adobe_transform = 0;
  width = height = ncomp = 0;
}

bool JpegDecoder::Impl::read_u8(int& v) {
  if (src.pos >= src.size) return false;
  v = src.data[src.pos++];
  return true;
}

bool JpegDecoder::Impl::read_u16(int& v) {
  if (src.size - src.pos < 2) return false;
  v = src.data[src.pos] << 8 | src.data[src.pos + 1];
  src.pos += 2;
  return true;
}

bool JpegDecoder::Impl::skip_bytes(long n) {
  if (n <= 0) return true;
  if (size_t(n) > src.size - src.pos) return false;
  src.pos += size_t(n);
  return true;
}

// COM, DNL and uninteresting APPn (skip_variable): a length below 2 skips nothing.
bool JpegDecoder::Impl::skip_segment() {
  int len;
  return read_u16(len) && skip_bytes(len - 2);
}

void JpegDecoder::Impl::unsupported(const std::string& kind) const {
  user_error(name, ": a JPEG of a kind edgetrain does not decode (", kind,
             "); it decodes Huffman-coded sequential and progressive JPEGs with 8-bit samples, gray, YCbCr "
             "or RGB. Convert the file, e.g. with PIL: Image.open(f).convert(\"RGB\").save(f)");
}

void JpegDecoder::Impl::read_header() {
  const int m = read_markers(false);
  if (m == 0xD9) corrupt("EOI marker before any image data");
  header_read = true;  // at SOS
}

int JpegDecoder::Impl::read_markers(bool eof_ends) {
  for (;;) {
    if (src.unread_marker == 0 && !src.next_marker()) {
      if (eof_ends) return jd::kEndOfFile;
      truncated("no EOI marker");
    }
    const int m = src.unread_marker;
    bool ok = true;  // false: the file ends inside the segment
    switch (m) {
      case 0xC0: case 0xC1: case 0xC2: case 0xC9: case 0xCA:  // Huffman / arithmetic, sequential / progressive
        ok = read_sof(m);
        break;
      case 0xC3: case 0xC5: case 0xC6: case 0xC7: case 0xC8: case 0xCB: case 0xCD: case 0xCE: case 0xCF:
        if (saw_sof) corrupt("an unsupported second frame header (SOF)");
        unsupported("lossless or hierarchical, frame marker 0xFF" + hex2(m));  // libjpeg fails too
      case 0xDA:
        if (!saw_sof) corrupt("a scan (SOS) before the frame header (SOF)");
        return m;
      case 0xD9: return m;
      case 0xC4: ok = read_dht(); break;
      case 0xDB: ok = read_dqt(); break;
      case 0xDD: ok = read_dri(); break;
      case 0xCC: ok = read_dac(); break;
      case 0xFE: case 0xDC: ok = skip_segment(); break;  // COM, DNL (ignored)
      case 0xD0: case 0xD1: case 0xD2: case 0xD3: case 0xD4: case 0xD5: case 0xD6: case 0xD7: case 0x01:
        break;  // RSTn, TEM: no segment
      case 0xD8: corrupt("a second SOI marker");
      default:
        if (m >= 0xE0 && m <= 0xEF) {
          ok = read_app();
          break;
        }
        corrupt("unknown marker 0xFF" + hex2(m) + " at byte " + std::to_string(src.pos - 2));
    }
    if (!ok) {
      if (eof_ends) return jd::kEndOfFile;
      truncated(("in the segment of marker 0xFF" + hex2(m)).c_str());
    }
    src.unread_marker = 0;
  }
}

// SOF (get_sof and jdinput.c initial_setup), its checks in libjpeg's order (a second SOF is an
// error only once its first fields are read). A frame of a kind this decoder leaves aside is a
// UserError naming the kind.
bool JpegDecoder::Impl::read_sof(int marker) {
  int len, precision, h, w, n;
  if (!read_u16(len) || !read_u8(precision) || !read_u16(h) || !read_u16(w) || !read_u8(n)) return false;
  if (saw_sof) corrupt("a second frame header (SOF)");
  // Arithmetic coding, 12-bit samples, CMYK / YCCK and 2-component frames. (stb_image decoded
  // CMYK once; its 2.27 reads out of bounds on corrupt entropy-coded data: no JPEG reaches it.)
  if (marker == 0xC9 || marker == 0xCA) unsupported("arithmetic coding");
  if (precision != 8) unsupported(fmt(precision, "-bit samples"));
  if (n != 1 && n != 3) unsupported(fmt(n, " components", n == 4 ? ": CMYK or YCCK" : ""));
  if (h <= 0 || w <= 0) corrupt(fmt("frame header says ", w, "x", h, " pixels"));
  if (len - 8 != n * 3) corrupt(fmt("frame header (SOF) length ", len, " for ", n, " components"));
  if (w > 65500 || h > 65500) corrupt(fmt(w, "x", h, " pixels, libjpeg's limit is 65500"));
  for (int i = 0; i < n; ++i) {
    int id, hv, tq;
    if (!read_u8(id) || !read_u8(hv) || !read_u8(tq)) return false;
    comp[i] = Component();
    comp[i].id = id;
    comp[i].h = hv >> 4;
    comp[i].v = hv & 15;
    comp[i].quant_slot = tq;
  }
  width = w;
  height = h;
  ncomp = n;
  progressive = marker == 0xC2;
  saw_sof = true;
  setup_frame();
  return true;
}

// Sampling geometry (initial_setup) and the checks libjpeg makes before decoding: sampling
// factors 1..4 and integral upsampling ratios (jdsample.c jinit_upsampler).
void JpegDecoder::Impl::setup_frame() {
  max_h = max_v = 1;
  for (int c = 0; c < ncomp; ++c) {
    if (comp[c].h < 1 || comp[c].h > 4 || comp[c].v < 1 || comp[c].v > 4)
      corrupt(fmt("component ", c, " has sampling factors ", comp[c].h, "x", comp[c].v, " (1 to 4 allowed)"));
    max_h = std::max(max_h, comp[c].h);
    max_v = std::max(max_v, comp[c].v);
  }
  for (int c = 0; c < ncomp; ++c)
    if (max_h % comp[c].h != 0 || max_v % comp[c].v != 0)
      corrupt(fmt("component ", c, " sampling ", comp[c].h, "x", comp[c].v, " against ", max_h, "x", max_v,
                  ": fractional upsampling, which libjpeg does not do"));
  mcus_x = (width + 8 * max_h - 1) / (8 * max_h);
  mcus_y = (height + 8 * max_v - 1) / (8 * max_v);
  for (int c = 0; c < ncomp; ++c) {
    Component& k = comp[c];
    k.width = int((int64_t(width) * k.h + max_h - 1) / max_h);
    k.height = int((int64_t(height) * k.v + max_v - 1) / max_v);
    k.blocks_w = (k.width + 7) / 8;
    k.blocks_h = (k.height + 7) / 8;
    k.padded_blocks_w = mcus_x * k.h;
    k.padded_blocks_h = mcus_y * k.v;
  }
}

// DHT (get_dht): tables while the segment's length lasts.
bool JpegDecoder::Impl::read_dht() {
  int len;
  if (!read_u16(len)) return false;
  long left = len - 2;
  while (left > 16) {
    int index;
    if (!read_u8(index)) return false;
    jd::HuffmanSpec spec;
    int count = 0;
    for (int i = 1; i <= 16; ++i) {
      int b;
      if (!read_u8(b)) return false;
      spec.counts[i] = uint8_t(b);
      count += b;
    }
    left -= 17;
    if (count > 256 || count > left)
      corrupt(fmt("Huffman table (DHT) declares ", count, " codes, ", std::min<long>(left, 256), " possible"));
    for (int i = 0; i < count; ++i) {
      int b;
      if (!read_u8(b)) return false;
      spec.symbols[i] = uint8_t(b);
    }
    left -= count;
    const bool ac = index & 0x10;
    const int slot = ac ? index - 0x10 : index;
    if (slot < 0 || slot >= 4) corrupt(fmt("Huffman table index ", index));
    spec.defined = true;
    (ac ? ac_specs : dc_specs)[slot] = spec;
  }
  if (left != 0) corrupt("Huffman table segment (DHT) length does not match its tables");
  return true;
}

// DQT (get_dqt): 8- or 16-bit tables in zigzag order while the length lasts.
bool JpegDecoder::Impl::read_dqt() {
  int len;
  if (!read_u16(len)) return false;
  long left = len - 2;
  while (left > 0) {
    int n;
    if (!read_u8(n)) return false;
    const int precision = n >> 4, slot = n & 15;
    if (slot >= 4) corrupt(fmt("quantisation table index ", slot));
    for (int i = 0; i < 64; ++i) {
      int q;
      if (!(precision ? read_u16(q) : read_u8(q))) return false;
      quant_tables[slot][jd::kNaturalOrder[i]] = uint16_t(q);
    }
    quant_defined[slot] = true;
    left -= 65 + (precision ? 64 : 0);
  }
  if (left != 0) corrupt("quantisation table segment (DQT) length does not match its tables");
  return true;
}

bool JpegDecoder::Impl::read_dri() {
  int len, interval;
  if (!read_u16(len)) return false;
  if (len != 4) corrupt(fmt("restart interval segment (DRI) of length ", len));
  if (!read_u16(interval)) return false;
  restart_interval = interval;
  return true;
}

// DAC (get_dac): arithmetic-coding conditioning, unused by Huffman frames but checked by libjpeg.
bool JpegDecoder::Impl::read_dac() {
  int len;
  if (!read_u16(len)) return false;
  long left = len - 2;
  while (left > 0) {
    int index, value;
    if (!read_u8(index) || !read_u8(value)) return false;
    left -= 2;
    if (index >= 32) corrupt(fmt("arithmetic conditioning table index ", index));
    if (index < 16 && (value & 15) > (value >> 4)) corrupt("arithmetic conditioning value (DAC)");
  }
  if (left != 0) corrupt("arithmetic conditioning segment (DAC) length");
  return true;
}

// APPn: APP0 "JFIF" and APP14 "Adobe" decide the colour space (get_interesting_appn: the first
// 14 bytes examined), the others are skipped.
bool JpegDecoder::Impl::read_app() {
  const int m = src.unread_marker;
  int len;
  if (!read_u16(len)) return false;
  long left = len - 2;
  if (m != 0xE0 && m != 0xEE) return skip_bytes(left);
  const long n = std::max(0L, std::min(left, 14L));
  if (size_t(n) > src.size - src.pos) return false;
  const uint8_t* b = src.data + src.pos;
  src.pos += size_t(n);
  if (m == 0xE0 && n >= 14 && std::memcmp(b, "JFIF\0", 5) == 0) saw_jfif = true;
  if (m == 0xEE && n >= 12 && std::memcmp(b, "Adobe", 5) == 0) {
    saw_adobe = true;
    adobe_transform = b[11];
  }
  return skip_bytes(left - n);
}

// SOS (get_sos), then what jdinput.c checks for each scan: MCU size, the quantisation tables
// (latched at a component's first scan), the progression parameters (jdphuff.c).
void JpegDecoder::Impl::read_scan_header() {
  int len, n;
  if (!read_u16(len) || !read_u8(n)) truncated("in a scan header");
  if (len != n * 2 + 6 || n < 1 || n > 4) corrupt(fmt("scan header (SOS) of length ", len, " for ", n, " components"));
  scan.count = n;
  for (int i = 0; i < n; ++i) {
    int id, tables;
    if (!read_u8(id) || !read_u8(tables)) truncated("in a scan header");
    // libjpeg-turbo 2.1 takes the first component with this id whose index (in the frame) is at
    // least the scan position (it tests cur_comp_info[ci], a per-scan-position array, with the
    // frame index), and rejects one named twice: found by trying all id orders on djpeg.
    int c = i;
    while (c < ncomp && comp[c].id != id) ++c;
    for (int j = 0; j < i && c < ncomp; ++j)
      if (scan.comp[j] == c) c = ncomp;
    if (c == ncomp) corrupt(fmt("scan names component id ", id, ", which the frame lacks (or lists before this position)"));
    scan.comp[i] = c;
    comp[c].dc_slot = tables >> 4;
    comp[c].ac_slot = tables & 15;
  }
  int ss, se, a;
  if (!read_u8(ss) || !read_u8(se) || !read_u8(a)) truncated("in a scan header");
  scan.ss = ss;
  scan.se = se;
  scan.ah = a >> 4;
  scan.al = a & 15;
  next_restart_num = 0;
  src.unread_marker = 0;

  if (n > 1) {
    int blocks = 0;
    for (int i = 0; i < n; ++i) blocks += comp[scan.comp[i]].h * comp[scan.comp[i]].v;
    if (blocks > jd::kMaxBlocksInMcu) corrupt(fmt("an MCU of ", blocks, " blocks (libjpeg allows 10)"));
  }
  for (int i = 0; i < n; ++i) {
    Component& k = comp[scan.comp[i]];
    if (k.quant_latched) continue;
    if (k.quant_slot >= 4 || !quant_defined[k.quant_slot])
      corrupt(fmt("component ", scan.comp[i], " uses quantisation table ", k.quant_slot, ", which is not defined"));
    // libjpeg's ISLOW_MULT_TYPE is a 16-bit short: a 16-bit table entry above 32767 wraps.
    for (int j = 0; j < 64; ++j) k.quant[j] = int16_t(quant_tables[k.quant_slot][j]);
    k.quant_latched = true;
  }
  if (progressive) {
    const bool dc = scan.ss == 0;
    const bool bad = dc ? scan.se != 0 : (scan.ss > scan.se || scan.se > 63 || n != 1);
    if (bad || (scan.ah != 0 && scan.al != scan.ah - 1) || scan.al > 13)
      corrupt(fmt("progressive scan parameters Ss=", scan.ss, " Se=", scan.se, " Ah=", scan.ah, " Al=", scan.al));
  }
}

}  // namespace et
