// Decoding scans as libjpeg-turbo 2.1 does (jdhuff.c decode_mcu, jdphuff.c, jdmarker.c
// read_restart_marker / jpeg_resync_to_restart), corrupt data included: once a scan's data runs
// into a marker, the MCU being decoded reads zero bits and the following MCUs up to the next
// restart stay zero ("insufficient data"); restart markers out of sequence are resynchronised by
// libjpeg's rules. Data running into the end of the file is an error (PIL: truncated image).
#include <climits>
#include <cstring>

#include "engine/data/jpeg_internal.h"

namespace et {
namespace jd = jpeg_detail;
using jd::kNaturalOrder;

// Decoding tables for the scan's components (start_pass_huff_decoder / start_pass_phuff_decoder).
void JpegDecoder::Impl::start_scan_tables() {
  auto build = [&](bool dc, int slot) {
    if (slot >= 4 || !(dc ? dc_specs : ac_specs)[slot].defined)
      corrupt(fmt("scan uses ", dc ? "DC" : "AC", " Huffman table ", slot, ", which is not defined"));
    const jd::HuffmanSpec& spec = (dc ? dc_specs : ac_specs)[slot];
    const char* err = jd::build_huffman_table(spec, dc, tables[(dc ? 0 : 4) + slot]);
    if (*err) corrupt(err);
  };
  for (int i = 0; i < scan.count; ++i) {
    const Component& k = comp[scan.comp[i]];
    if (!progressive || (scan.ss == 0 && scan.ah == 0)) build(true, k.dc_slot);
    if (!progressive || scan.ss != 0) build(false, k.ac_slot);
  }
}

void JpegDecoder::Impl::check_overrun() {
  if (!bits.overran()) return;
  if (bits.at_eof()) truncated("inside the entropy-coded data");
  insufficient_data = true;
}

// process_restart + read_restart_marker: the bits left are dropped, the next marker read; the
// expected RSTn is consumed, any other goes through jpeg_resync_to_restart.
void JpegDecoder::Impl::process_restart() {
  if (src.unread_marker == 0 && !src.next_marker()) truncated("looking for a restart marker");
  if (src.unread_marker == 0xD0 + next_restart_num)
    src.unread_marker = 0;
  else
    resync_to_restart();
  next_restart_num = (next_restart_num + 1) & 7;
  for (int& dc : last_dc) dc = 0;
  eobrun = 0;
  restarts_to_go = restart_interval;
  // Still at a marker: the rest of this interval reads zero bits, and stays zero once it has.
  if (src.unread_marker == 0) insufficient_data = false;
  bits.start(&src);
}

// jpeg_resync_to_restart: a restart marker other than the expected one (or another marker).
void JpegDecoder::Impl::resync_to_restart() {
  const int desired = next_restart_num;
  for (;;) {
    const int m = src.unread_marker;
    int action;
    if (m < 0xC0)
      action = 2;  // not a valid marker: look further
    else if (m < 0xD0 || m > 0xD7)
      action = 3;  // a marker that ends the scan: leave it, the interval reads zeros
    else if (m == 0xD0 + ((desired + 1) & 7) || m == 0xD0 + ((desired + 2) & 7))
      action = 3;  // one of the next two restarts: this interval is missing
    else if (m == 0xD0 + ((desired - 1) & 7) || m == 0xD0 + ((desired - 2) & 7))
      action = 2;  // a previous restart: look further
    else
      action = 1;  // the desired one or too far away: take it and go on
    if (action == 1) {
      src.unread_marker = 0;
      return;
    }
    if (action == 3) return;
    if (!src.next_marker()) truncated("looking for a restart marker");
  }
}

void JpegDecoder::Impl::decode_scan(bool one_pass) {
  start_scan_tables();
  if (progressive)
    for (int i = 0; i < scan.count; ++i)
      for (int k = scan.ss; k <= scan.se; ++k) comp[scan.comp[i]].coef_bits[k] = scan.al;
  bits.start(&src);
  insufficient_data = false;
  eobrun = 0;
  restarts_to_go = restart_interval;
  for (int& dc : last_dc) dc = 0;

  // An interleaved scan's MCU holds h x v blocks of each component; otherwise one block, over
  // the blocks that hold samples.
  const bool interleaved = scan.count > 1;
  const Component& first = comp[scan.comp[0]];
  const int cols = interleaved ? mcus_x : first.blocks_w, rows = interleaved ? mcus_y : first.blocks_h;
  int16_t* blocks[jd::kMaxBlocksInMcu];
  int block_scan_comp[jd::kMaxBlocksInMcu], block_x[jd::kMaxBlocksInMcu], block_y[jd::kMaxBlocksInMcu];
  if (one_pass) mcu.resize(size_t(jd::kMaxBlocksInMcu) * 64);
  for (int my = 0; my < rows; ++my)
    for (int mx = 0; mx < cols; ++mx) {
      if (restart_interval && restarts_to_go == 0) process_restart();
      int n = 0;
      for (int i = 0; i < scan.count; ++i) {
        Component& k = comp[scan.comp[i]];
        const int bh = interleaved ? k.v : 1, bw = interleaved ? k.h : 1;
        for (int y = 0; y < bh; ++y)
          for (int x = 0; x < bw; ++x, ++n) {
            block_scan_comp[n] = i;
            block_x[n] = interleaved ? mx * k.h + x : mx;
            block_y[n] = interleaved ? my * k.v + y : my;
            blocks[n] = one_pass ? mcu.data() + size_t(n) * 64 : k.block(block_x[n], block_y[n]);
          }
      }
      if (one_pass) std::memset(mcu.data(), 0, size_t(n) * 64 * sizeof(int16_t));
      if (!insufficient_data) {
        if (!progressive)
          decode_mcu_sequential(blocks, block_scan_comp, n);
        else if (scan.ss == 0)
          scan.ah == 0 ? decode_dc_first(blocks, block_scan_comp, n) : decode_dc_refine(blocks, n);
        else
          scan.ah == 0 ? decode_ac_first(blocks[0]) : decode_ac_refine(blocks[0]);
        check_overrun();
      }
      if (restart_interval) --restarts_to_go;
      if (one_pass)
        for (int b = 0; b < n; ++b) {
          Component& k = comp[scan.comp[block_scan_comp[b]]];
          if (block_x[b] < k.blocks_w && block_y[b] < k.blocks_h)  // libjpeg skips the padding blocks
            jd::idct_islow(blocks[b], k.quant,
                           k.plane.data() + size_t(block_y[b]) * 8 * k.stride() + size_t(block_x[b]) * 8, k.stride());
        }
    }
}

// Sequential (jdhuff.c decode_mcu_slow): DC difference, then run/size-coded AC coefficients.
void JpegDecoder::Impl::decode_mcu_sequential(int16_t* const* blocks, const int* block_comp, int nblocks) {
  jd::BitReader br = bits;  // a local copy the compiler keeps in registers
  for (int b = 0; b < nblocks; ++b) {
    const Component& k = comp[scan.comp[block_comp[b]]];
    const jd::HuffmanTable& dct = tables[k.dc_slot];
    const jd::HuffmanTable& act = tables[4 + k.ac_slot];
    int16_t* block = blocks[b];
    br.ensure(32);
    const int s = jd::decode_symbol(br, dct);
    const int diff = s ? jd::extend(br.bits(s), s) : 0;
    // libjpeg adds in int and stores a short: corrupt data wraps both.
    int& dc = last_dc[block_comp[b]];
    dc = int(uint32_t(dc) + uint32_t(diff));
    block[0] = int16_t(dc);
    for (int i = 1; i < 64; ++i) {
      br.ensure(32);
      const int32_t fast = act.ac_fast[br.peek(jd::kLookaheadBits)];
      if (fast) {
        br.skip(fast & 0xFF);
        i += (fast >> 8) & 0xFF;
        block[kNaturalOrder[i]] = int16_t(fast >> 16);
        continue;
      }
      const int sym = jd::decode_symbol(br, act), run = sym >> 4, size = sym & 15;
      if (size) {
        i += run;
        block[kNaturalOrder[i]] = int16_t(jd::extend(br.bits(size), size));
      } else {
        if (run != 15) break;  // end of block
        i += 15;
      }
    }
  }
  bits = br;
}

// Progressive, first DC scan: differences shifted left by Al.
void JpegDecoder::Impl::decode_dc_first(int16_t* const* blocks, const int* block_comp, int nblocks) {
  for (int b = 0; b < nblocks; ++b) {
    const Component& k = comp[scan.comp[block_comp[b]]];
    bits.ensure(32);
    const int s = jd::decode_symbol(bits, tables[k.dc_slot]);
    const int diff = s ? jd::extend(bits.bits(s), s) : 0;
    int& dc = last_dc[block_comp[b]];
    if ((dc >= 0 && diff > INT_MAX - dc) || (dc < 0 && diff < INT_MIN - dc))
      corrupt("DC coefficient overflow");  // jdphuff.c JERR_BAD_DCT_COEF
    dc += diff;
    blocks[b][0] = int16_t(uint32_t(dc) << scan.al);
  }
}

// Progressive, DC refinement: one bit per block.
void JpegDecoder::Impl::decode_dc_refine(int16_t* const* blocks, int nblocks) {
  for (int b = 0; b < nblocks; ++b) {
    bits.ensure(1);
    if (bits.bits(1)) blocks[b][0] = int16_t(blocks[b][0] | (1 << scan.al));
  }
}

// Progressive, first AC scan of a band: runs, sizes and end-of-band runs (EOBRUN).
void JpegDecoder::Impl::decode_ac_first(int16_t* block) {
  if (eobrun > 0) {
    --eobrun;
    return;
  }
  const jd::HuffmanTable& t = tables[4 + comp[scan.comp[0]].ac_slot];
  for (int i = scan.ss; i <= scan.se; ++i) {
    bits.ensure(32);
    const int sym = jd::decode_symbol(bits, t), run = sym >> 4, size = sym & 15;
    if (size) {
      i += run;
      block[kNaturalOrder[i]] = int16_t(uint32_t(jd::extend(bits.bits(size), size)) << scan.al);
    } else if (run == 15) {
      i += 15;
    } else {
      eobrun = 1 << run;
      if (run) eobrun += bits.bits(run);
      --eobrun;
      break;
    }
  }
}

// Progressive, AC refinement (decode_mcu_AC_refine): new coefficients of +-1 << Al, and a
// correction bit for each coefficient already nonzero that the run passes.
void JpegDecoder::Impl::decode_ac_refine(int16_t* block) {
  const jd::HuffmanTable& t = tables[4 + comp[scan.comp[0]].ac_slot];
  const int p1 = 1 << scan.al, m1 = -p1;
  auto correct = [&](int16_t& c) {
    bits.ensure(1);
    if (bits.bits(1) && (c & p1) == 0) c = int16_t(c >= 0 ? c + p1 : c + m1);
  };
  int i = scan.ss;
  if (eobrun == 0) {
    for (; i <= scan.se; ++i) {
      bits.ensure(32);
      const int sym = jd::decode_symbol(bits, t);
      int run = sym >> 4, value = 0;
      if (sym & 15) {
        value = bits.bits(1) ? p1 : m1;  // the size should be 1 (libjpeg warns, reads one bit)
      } else if (run != 15) {
        eobrun = 1 << run;
        if (run) eobrun += bits.bits(run);
        break;
      }
      do {
        int16_t& c = block[kNaturalOrder[i]];
        if (c != 0)
          correct(c);
        else if (--run < 0)
          break;
        ++i;
      } while (i <= scan.se);
      if (value) block[kNaturalOrder[i]] = int16_t(value);
    }
  }
  if (eobrun > 0) {
    for (; i <= scan.se; ++i) {
      int16_t& c = block[kNaturalOrder[i]];
      if (c != 0) correct(c);
    }
    --eobrun;
  }
}

// jdcoefct.c smoothing_ok: libjpeg smooths blocks when any of the first 10 coefficients (zigzag)
// of a component is still approximate after the last scan, provided every component has DC and
// nonzero quantisers for them.
bool JpegDecoder::Impl::needs_block_smoothing() const {
  if (!progressive) return false;
  bool useful = false;
  for (int c = 0; c < ncomp; ++c) {
    const Component& k = comp[c];
    if (!k.quant_latched || k.coef_bits[0] < 0) return false;
    for (int i = 0; i < 10; ++i)
      if (k.quant[kNaturalOrder[i]] == 0) return false;
    for (int i = 1; i < 10; ++i) useful = useful || k.coef_bits[i] != 0;
  }
  return useful;
}

}  // namespace et
