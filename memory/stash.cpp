#include "memory/stash.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "memory/bitmap.h"

namespace et {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

void Stash::configure(std::vector<SavedValue> saved, int num_values, float prune_threshold, bool release_pages,
                      DeviceMemory& memory, StashCodec& codec, double first_room, bool allocate) {
  saved_ = std::move(saved);
  codec_ = &codec;
  release_pages_ = release_pages;
  prune_threshold_ = prune_threshold;
  index_.assign(size_t(num_values), -1);
  entries_.assign(size_t(num_values), Entry{});
  records_.assign(size_t(num_values), StashRecord{});
  fixed_layout_ = codec.defers_counts();
  room_.assign(saved_.size(), -1);
  most_kept_.assign(saved_.size(), -1);
  size_t total = 0;
  int64_t largest = 0;
  for (size_t i = 0; i < saved_.size(); ++i) {
    const SavedValue& s = saved_[i];
    largest = std::max(largest, s.numel);
    index_[size_t(s.value)] = int(i);
    const bool sized = !s.recomputed && s.full && stash_encoding_info(stash_format_info(s.format).full).bitmap;
    if (fixed_layout_ && first_room >= 0 && sized)
      room_[i] = std::min(s.numel, int64_t(std::ceil(double(s.numel) * first_room)) + kRoomPad);
    total += slot_bytes(s, s.numel);
  }
  stack_.clear();
  stack_.reserve(saved_.size());
  if (total > 0 && allocate) region_.reserve(total, region_name_, memory);
  if (total > 0 && !allocate) region_.plan(total, memory);
  if (allocate) codec.reserve(largest);
  top_ = peak_ = region_peak_ = zero_copy_live_ = logical_live_ = 0;
  log_.clear();
  unsettled_ = false;
  overflow_value_ = -1;
  wants_fit_ = true;
  ++generation_;
  if (fixed_layout_ && !saved_.empty()) {
    if (allocate) slots_.reserve(saved_.size() * sizeof(int64_t), "the stash's counts", memory);
    host_counts_.assign(saved_.size(), 0);
    log_.reserve(4 * saved_.size());  // pushes and pops, recomputed values pushed again
    packed_.reserve(2 * saved_.size());
  }
}

int64_t Stash::room_of(const SavedValue& s, int64_t n) const {
  const int64_t room = room_[size_t(&s - saved_.data())];
  return room < 0 ? n : std::min(room, n);
}

size_t Stash::slot_bytes(const SavedValue& s, int64_t n) const {
  if (s.recomputed) return 0;
  if (copies(s, n)) return Arena::align_up(stash_encoding_bytes(stash_format_info(s.format).full_alt, n, n));
  size_t bytes = Arena::align_up(stash_room_bytes(s.format, n, s.full, room_of(s, n)));
  if (mask_apart(s)) bytes += Arena::align_up(size_t(bitmap::num_words(n)) * 8);
  return bytes;
}

int64_t* Stash::count_slot(int value_id) const {
  return fixed_layout_ ? static_cast<int64_t*>(slots_.at(size_t(index_[size_t(value_id)]) * sizeof(int64_t)))
                       : nullptr;
}

const SavedValue* Stash::info(int value_id) const {
  const int i = index_[size_t(value_id)];
  ET_CHECK(i >= 0, "value ", value_id, " is not planned for the stash");
  return &saved_[size_t(i)];
}

bool Stash::mask_apart(const SavedValue& s) const {
  return !s.recomputed && prune_threshold_ > 0.f && s.full && s.mask_read && stash_format_has_bitmap(s.format, true);
}

bool Stash::stores_codes(int value_id) const {
  const SavedValue& s = *info(value_id);
  return s.full && stash_encoding_info(stash_format_info(s.format).full).codes;
}

void Stash::clear() {
  settle();
  ET_CHECK(overflow_value_ < 0, "the stash's last step kept more of value ", overflow_value_,
           " than its room, and no fit() followed: its backward read values that were not stored");
  log_.clear();
  abandoned_ = false;
  drop_entries();
}

void Stash::abandon() {
  settle();
  abandoned_ = fixed_layout_ && !log_.empty();
  if (!abandoned_) log_.clear();  // (kept for fit(): the counts it saw, its overflow)
  drop_entries();
}

void Stash::drop_entries() {
  for (int id : stack_) entries_[size_t(id)] = Entry{};
  stack_.clear();
  top_ = zero_copy_live_ = 0;
}

bool Stash::copies(const SavedValue& s, int64_t n) const {
  if (!fixed_layout_ || !s.full || s.recomputed) return false;
  const StashFormatInfo& f = stash_format_info(s.format);
  if (f.full_alt == f.full || stash_encoding_info(f.full_alt).codes) return false;  // no count decides
  // (a bitmap with pruned values keeps the exact mask beside it; a copy is its own)
  const size_t mask = mask_apart(s) ? size_t(bitmap::num_words(n)) * 8 : 0;
  return mask + stash_encoding_bytes(f.full, n, room_of(s, n)) >= stash_encoding_bytes(f.full_alt, n, n);
}

MaskOut Stash::mask_target(int value_id, int64_t numel) const {
  const SavedValue& s = *info(value_id);
  MaskOut m;
  if (s.recomputed || !stash_format_has_bitmap(s.format, s.full) || copies(s, numel)) return m;
  m.bits = static_cast<uint64_t*>(at(top_));
  m.kept_slot = count_slot(value_id);
  // Pruned bits only where they select stored values and no mask is read from them.
  m.prune_threshold = s.full && !mask_apart(s) ? prune_threshold_ : 0.f;
  // The values follow the bitmap (push's layout) unless an exact mask goes first (mask_apart).
  const StashEncoding enc = s.full ? stash_format_info(s.format).full : stash_format_info(s.format).mask;
  // (Not where the room is less than n: the codec's pack_values keeps within it.)
  if ((enc == StashEncoding::BitmapF32 || enc == StashEncoding::BitmapF16) && !mask_apart(s) &&
      room_of(s, numel) >= numel) {
    m.values = m.bits + bitmap::num_words(numel);
    m.values_f16 = enc == StashEncoding::BitmapF16;
  }
  return m;
}

void Stash::push(int value_id, const Tensor& t, const MaskOut& written, const Tensor& codes) {
  int64_t bits_kept = written.kept;
  // The producer wrote the bitmap: its count is bits_kept, or in the value's slot (fixed layout).
  bool bits_written = bits_kept >= 0 || written.kept_in_slot;
  const SavedValue& s = *info(value_id);
  const StashFormatInfo& format = stash_format_info(s.format);
  const int64_t n = t.numel();
  const bool fixed_copy = copies(s, n);  // auto in the fixed layout: its room chose the copy
  Entry& e = entries_[size_t(value_id)];
  ET_CHECK(e.stored == StashEncoding::None, "value ", value_id, " pushed twice");
  // (a recomputed value may have no f32 forward buffer: its readers computed it, DType::AffineRelu)
  const float* x = s.recomputed ? nullptr : t.f32();
  StashRecord& rec = records_[size_t(value_id)];
  int64_t* const slot = count_slot(value_id);  // fixed layout: where deferred counts go
  bool in_slot = false;                       // this push's count is there
  const int64_t room = fixed_layout_ ? room_of(s, n) : n;  // kept elements the entry has room for
  bool sized = false;                          // its size follows its count
  int64_t room_kept = -1;                      // ... which is this, or in the slot
  e.view = t;
  e.offset = e.encoding_offset = top_;
  e.decoded = false;
  e.exact_mask = false;
  rec.numel = n;
  rec.packed_by_producer = false;
  StashEncoding enc = s.recomputed ? StashEncoding::Recomputed : s.full ? format.full : format.mask;
  size_t mask_bytes = 0;
  if (enc == StashEncoding::Recomputed) {
    e.bytes = 0;
    e.nonzero = -1;
  } else if (enc == StashEncoding::ZeroCopy) {
    e.bytes = t.nbytes();
    zero_copy_live_ += e.bytes;
  } else {
    if (timing_) codec_->synchronize();  // (the work before is not this value's)
    const auto t0 = timing_ ? Clock::now() : Clock::time_point{};
    if (mask_apart(s) && !fixed_copy) {  // (a copy is its own exact mask)
      // The exact mask first (the producer may have written it: mask_target), then the encoding
      // with pruned values, whose own bitmap the pack below computes (and counts, into the slot).
      mask_bytes = Arena::align_up(size_t(bitmap::num_words(n)) * 8);
      if (!bits_written) codec_->make_bits(x, n, 0.f, static_cast<uint64_t*>(at(top_)), slot);
      bits_kept = -1;
      bits_written = false;
      e.exact_mask = true;
      e.encoding_offset = top_ + mask_bytes;
    }
    void* dst = at(e.encoding_offset);
    if (enc == StashEncoding::Mask) {  // exact: pruning concerns stored values, a mask has none
      if (bits_written)
        e.nonzero = bits_kept, in_slot = written.kept_in_slot;
      else
        e.nonzero = codec_->make_bits(x, n, 0.f, static_cast<uint64_t*>(dst), slot), in_slot = e.nonzero < 0;
    } else if (stash_encoding_info(enc).codes) {
      ET_CHECK(codes.numel() == n && (codes.dtype == DType::I4 || codes.dtype == DType::U4) && !bits_written,
               "value ", value_id, " (bitmap_int4) pushed without its codes");
      enc = codes.dtype == DType::U4 ? StashEncoding::BitmapU4 : StashEncoding::BitmapI4;
      e.nonzero = codec_->encode_codes(x, codes.codes(), n, prune_threshold_, dst, room, slot);
      in_slot = e.nonzero < 0;
      sized = true, room_kept = e.nonzero;
      e.scale = codes.scale;
      e.scale_at = codes.scale_at;
    } else if (enc == StashEncoding::F16 || enc == StashEncoding::BF16) {
      const bool bf = enc == StashEncoding::BF16;
      codec_->to_half(x, n, bf, static_cast<uint16_t*>(dst));
      e.nonzero = n;
    } else {
      const bool f16 = enc == StashEncoding::BitmapF16;
      // auto has two encodings to choose from. The compact layout chooses per push, by a count
      // (pack itself counts, one pass fewer); the fixed layout per entry, by its room (copies()),
      // so that no push waits for a count and a step with auto can be recorded.
      bool copy = fixed_copy;
      if (format.full_alt != format.full && !fixed_layout_) {
        if (!(bits_kept >= 0)) bits_kept = codec_->count_nonzero(x, n, prune_threshold_);
        copy = stash_encoding_bytes(enc, n, bits_kept) >= stash_encoding_bytes(format.full_alt, n, n);
      }
      if (copy) {
        enc = format.full_alt;  // CopyF32: dense is smaller, keep an exact copy (its own mask)
        mask_bytes = 0;
        e.exact_mask = false;
        e.encoding_offset = top_;
        dst = at(top_);
        codec_->copy(dst, x, size_t(n) * 4);
        e.nonzero = n;
        // What a bitmap would keep, for the room (fit() may choose the bitmap again): in the slot
        // where the producer wrote it or the codec leaves it (fixed layout).
        sized = true;
        room_kept = fixed_layout_ ? codec_->make_bits(x, n, prune_threshold_, nullptr, slot) : bits_kept;
      } else {
        uint64_t* bits = static_cast<uint64_t*>(dst);
        void* values = bits + bitmap::num_words(n);
        if (bits_written) {  // the producer wrote the bitmap (Backend MaskOut), maybe the values
          ET_CHECK(!written.values_written || (written.values == values && written.values_f16 == f16),
                   "value ", value_id, ": values packed elsewhere");
          if (!written.values_written) codec_->pack_values(x, bits, n, values, f16, room);
          rec.packed_by_producer = written.values_written;
          e.nonzero = bits_kept;
          in_slot = bits_kept < 0;  // (auto counted above)
        } else {
          e.nonzero = codec_->pack(x, n, prune_threshold_, bits, values, f16, room, slot);
          in_slot = e.nonzero < 0;
        }
        sized = true, room_kept = e.nonzero;
      }
    }
    e.bytes = in_slot ? 0 : mask_bytes + stash_encoding_bytes(enc, n, e.nonzero);  // in a slot: settle()
    if (timing_) {
      codec_->synchronize();
      const double dt = since(t0);
      pack_s_ += dt;
      rec.seconds += dt;
    }
  }
  if (enc != StashEncoding::ZeroCopy) {
    e.slot_bytes = fixed_layout_ ? slot_bytes(s, n) : Arena::align_up(e.bytes);
    top_ += e.slot_bytes;
    ET_CHECK(top_ <= region_.size(), "stash region overflow at value ", value_id);
  }
  e.stored = enc;
  rec.stored_as = stash_encoding_info(enc).display;
  rec.bytes = e.bytes;
  rec.nonzero = enc == StashEncoding::Recomputed ? -1
                : enc != StashEncoding::ZeroCopy ? e.nonzero
                : count_zero_copy_ ? codec_->count_nonzero(x, n, 0.f) : -1;
  stack_.push_back(value_id);
  region_peak_ = std::max(region_peak_, top_);
  if (!fixed_layout_) {
    peak_ = std::max(peak_, live_bytes());
    return;
  }
  LogEvent ev;
  ev.value = value_id;
  ev.push = true;
  ev.in_slot = in_slot;
  ev.stored = enc;
  ev.numel = n;
  ev.nonzero = e.nonzero;
  ev.extra_bytes = enc == StashEncoding::ZeroCopy ? e.bytes : mask_bytes;
  ev.sized = sized;
  ev.room = sized && room < n && enc != StashEncoding::CopyF32 ? room : -1;  // (a copy keeps everything)
  ev.room_kept = room_kept;
  log_.push_back(ev);
  unsettled_ = true;
}

Tensor Stash::get(int value_id) {
  Entry& e = entries_[size_t(value_id)];
  ET_CHECK(stash_encoding_info(e.stored).every_element, "value ", value_id, " not saved in full");
  ET_CHECK(!stash_encoding_info(e.stored).codes, "value ", value_id, " is stored as codes: read it as stored");
  if (e.stored == StashEncoding::ZeroCopy) return e.view;
  const SavedValue& s = *info(value_id);
  const int64_t n = e.view.numel();
  ET_CHECK(s.unpack.defined(), "value ", value_id, " has no decode buffer: planned for reads as stored only");
  ET_CHECK(!e.decode_ended, "value ", value_id, " decoded after its decode buffer's planned end");
  Tensor out = s.unpack;
  out.shape = e.view.shape;  // the current batch
  if (!e.decoded) {
    if (timing_) codec_->synchronize();  // (the work before is not this value's)
    const auto t0 = timing_ ? Clock::now() : Clock::time_point{};
    const void* src = at(e.encoding_offset);
    float* y = out.f32();
    switch (e.stored) {
      case StashEncoding::Recomputed:
        ET_CHECK(recomputer_ != nullptr, "value ", value_id, ": recomputed, but no recomputer set");
        recomputer_(value_id, out);
        break;
      case StashEncoding::CopyF32: codec_->copy(y, src, size_t(n) * 4); break;
      case StashEncoding::F16: codec_->from_half(static_cast<const uint16_t*>(src), n, false, y); break;
      case StashEncoding::BF16: codec_->from_half(static_cast<const uint16_t*>(src), n, true, y); break;
      case StashEncoding::BitmapF32:
      case StashEncoding::BitmapF16: {
        const auto* bits = static_cast<const uint64_t*>(src);
        codec_->unpack(bits, bits + bitmap::num_words(n), n, e.stored == StashEncoding::BitmapF16, y);
        break;
      }
      default: ET_CHECK(false, "unreachable");
    }
    e.decoded = true;
    if (timing_) {
      codec_->synchronize();
      const double dt = since(t0);
      unpack_s_ += dt;
      records_[size_t(value_id)].seconds += dt;
    }
  }
  return out;
}

Tensor Stash::get_stored(int value_id) const {
  const Entry& e = entries_[size_t(value_id)];
  const StashEncodingInfo& info = stash_encoding_info(e.stored);
  ET_CHECK(info.every_element, "value ", value_id, " not saved in full");
  ET_CHECK(e.stored != StashEncoding::Recomputed, "value ", value_id, " is recomputed: read it through get()");
  if (e.stored == StashEncoding::ZeroCopy) return e.view;
  Tensor t = Tensor::contiguous(at(e.encoding_offset), e.view.shape, info.dtype);
  t.scale = e.scale;
  t.scale_at = e.scale_at;
  return t;
}

Tensor Stash::held_in_place(int value_id) const {
  if (value_id < 0 || size_t(value_id) >= entries_.size()) return Tensor{};
  const Entry& e = entries_[size_t(value_id)];
  return e.stored == StashEncoding::ZeroCopy && e.view.dtype == DType::F32 ? e.view : Tensor{};
}

MaskView Stash::get_mask(int value_id) {
  Entry& e = entries_[size_t(value_id)];
  MaskView m;
  m.numel = e.view.numel();
  // The bitmap or the f32 values as they are (stash_mask_dtypes); other encodings decode.
  const StashEncodingInfo& info = stash_encoding_info(e.stored);
  if (e.stored == StashEncoding::Recomputed)
    m.dense = get(value_id);  // its first reader's backward recomputed it already
  else if (e.exact_mask)
    m.bits = static_cast<const uint64_t*>(at(e.offset));
  else if (info.bitmap)  // no pruned values, or none stored: the encoding's bitmap is exact
    m.bits = static_cast<const uint64_t*>(at(e.encoding_offset));
  else if (info.every_element && info.dtype == DType::F32)
    m.dense = get_stored(value_id);  // the forward buffer or the copy itself
  else
    m.dense = get(value_id);
  return m;
}

void Stash::end_decode(int value_id) {
  Entry& e = entries_[size_t(value_id)];
  e.decoded = false;
  e.decode_ended = true;
}

void Stash::pop(int value_id) {
  // Pops are LIFO except under recomputation, where a segment's recomputed values are pushed above
  // values it kept from the forward. A value popped from below the top leaves a hole that is
  // reclaimed when everything above it has been popped.
  auto it = std::find(stack_.rbegin(), stack_.rend(), value_id);
  ET_CHECK(it != stack_.rend(), "stash pop of value ", value_id, " that was not pushed");
  Entry& e = entries_[size_t(value_id)];
  if (e.stored == StashEncoding::ZeroCopy) zero_copy_live_ -= e.bytes;
  e = Entry{};
  stack_.erase(std::next(it).base());
  if (fixed_layout_) {
    LogEvent ev;
    ev.value = value_id;
    log_.push_back(ev);
  }
  const size_t old_top = top_;
  top_ = 0;
  for (auto j = stack_.rbegin(); j != stack_.rend(); ++j) {
    const Entry& f = entries_[size_t(*j)];
    if (f.stored != StashEncoding::ZeroCopy) {
      top_ = f.offset + f.slot_bytes;
      break;
    }
  }
  if (release_pages_ && top_ < old_top) region_.release(top_, old_top - top_);
}

}  // namespace et
