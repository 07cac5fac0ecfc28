// JPEG decoder giving exactly the pixels of libjpeg-turbo's default decompression, which is what
// PIL (and so PyTorch's image loaders) returns: the islow integer IDCT, fancy (triangle-filter)
// chroma upsampling, libjpeg's fixed-point YCbCr -> RGB, and its recovery from corrupt
// entropy-coded data (zero-filled segments, restart-marker resynchronisation).
//
// Handles Huffman-coded baseline / extended sequential and progressive JPEGs with 8-bit samples
// and 1 (gray) or 3 (YCbCr or RGB) components, any sampling factors libjpeg accepts. Other kinds
// (arithmetic coding, lossless, hierarchical, 12-bit, CMYK) are a UserError naming the file and
// the kind, as are the files where libjpeg fails (PIL then raises). One difference from libjpeg:
// a progressive file whose scans leave one of the first 10 coefficients unfinished is decoded from
// the coefficients it has, where libjpeg also smooths blocks (do_block_smoothing); complete files,
// which every encoder writes, do not have it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace et {

class JpegDecoder {
 public:
  JpegDecoder();
  ~JpegDecoder();
  JpegDecoder(const JpegDecoder&) = delete;
  JpegDecoder& operator=(const JpegDecoder&) = delete;

  // Reads the markers of `data` (which starts with SOI, FF D8) up to its first scan; UserError
  // naming `name` for a corrupt header or a kind this decoder does not handle (see above).
  // `data` must stay alive until decode() returns.
  void read_header(const uint8_t* data, size_t size, const std::string& name);
  int width() const;
  int height() const;
  int channels() const;  // 1 (gray) or 3 (RGB)
  // Samples per component once the frame is rounded up to whole MCUs: decode() allocates at
  // most 3 bytes (coefficients and samples) for each, per component.
  uint64_t padded_pixels() const;

  // Decodes the image read_header described into `out` (height x width x channels bytes, rows
  // top to bottom, channels interleaved).
  void decode(uint8_t* out);
  // After decode(): true when libjpeg would have smoothed blocks of this file (see above), so its
  // pixels, and PIL's, differ from `out`.
  bool libjpeg_would_smooth() const;

 private:
  struct Impl;  // engine/data/jpeg_internal.h
  std::unique_ptr<Impl> impl_;
};

}  // namespace et
