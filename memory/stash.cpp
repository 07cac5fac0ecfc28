#include "memory/stash.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "memory/bitmap.h"
#include "memory/half.h"

namespace et {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const struct { StashFormat f; const char* name; } kFormats[] = {
    {StashFormat::DenseF32, "dense_fp32"}, {StashFormat::DenseF16, "dense_fp16"},
    {StashFormat::DenseBF16, "dense_bf16"}, {StashFormat::BitmapF32, "bitmap_fp32"},
    {StashFormat::BitmapF16, "bitmap_fp16"}, {StashFormat::Auto, "auto"}};

size_t worst_case_bytes(const SavedValue& s) {
  const auto n = s.numel;
  if (s.format == StashFormat::DenseF32) return 0;  // zero copy
  if (!s.full) return size_t(bitmap::num_words(n)) * 8;
  switch (s.format) {
    case StashFormat::DenseF32: return 0;  // zero copy
    case StashFormat::DenseF16:
    case StashFormat::DenseBF16: return size_t(n) * 2;
    case StashFormat::BitmapF16: return bitmap::bitmap_bytes(n, n, bitmap::ValueType::F16);
    case StashFormat::BitmapF32:
    case StashFormat::Auto: return bitmap::bitmap_bytes(n, n, bitmap::ValueType::F32);
  }
  return 0;
}
}  // namespace

const char* stash_format_name(StashFormat f) {
  for (const auto& e : kFormats)
    if (e.f == f) return e.name;
  return "?";
}

bool parse_stash_format(const std::string& s, StashFormat* out) {
  for (const auto& e : kFormats)
    if (s == e.name) {
      *out = e.f;
      return true;
    }
  return false;
}

std::string stash_format_names() {
  std::string out;
  for (const auto& e : kFormats) out += (out.empty() ? "" : ", ") + std::string(e.name);
  return out;
}

void Stash::configure(std::vector<SavedValue> saved, int num_values, float prune_threshold, bool release_pages) {
  saved_ = std::move(saved);
  release_pages_ = release_pages;
  prune_threshold_ = prune_threshold;
  index_.assign(size_t(num_values), -1);
  entries_.assign(size_t(num_values), Entry{});
  records_.assign(size_t(num_values), StashRecord{});
  size_t total = 0;
  for (size_t i = 0; i < saved_.size(); ++i) {
    index_[size_t(saved_[i].value)] = int(i);
    total += Arena::align_up(worst_case_bytes(saved_[i]));
  }
  stack_.clear();
  stack_.reserve(saved_.size());
  if (total > 0) region_.reserve(total, "the activation stash");
  top_ = peak_ = zero_copy_live_ = 0;
}

const SavedValue* Stash::info(int value_id) const {
  const int i = index_[size_t(value_id)];
  ET_CHECK(i >= 0, "value ", value_id, " is not planned for the stash");
  return &saved_[size_t(i)];
}

bool Stash::zero_copy(int value_id) const { return info(value_id)->format == StashFormat::DenseF32; }

void Stash::clear() {
  for (int id : stack_) entries_[size_t(id)] = Entry{};
  stack_.clear();
  top_ = zero_copy_live_ = 0;
}

MaskOut Stash::mask_target(int value_id) const {
  const SavedValue& s = *info(value_id);
  MaskOut m;
  const bool has_bits = s.format == StashFormat::BitmapF32 || s.format == StashFormat::BitmapF16 ||
                        s.format == StashFormat::Auto || (!s.full && s.format != StashFormat::DenseF32);
  if (!has_bits) return m;
  m.bits = static_cast<uint64_t*>(at(top_));
  m.prune_threshold = prune_threshold_;
  return m;
}

void Stash::push(int value_id, const Tensor& t, int64_t bits_kept) {
  const SavedValue& s = *info(value_id);
  Entry& e = entries_[size_t(value_id)];
  ET_CHECK(e.stored == Stored::None, "value ", value_id, " pushed twice");
  const int64_t n = t.numel();
  const float* x = t.f32();
  StashRecord& rec = records_[size_t(value_id)];
  e.view = t;
  e.offset = top_;
  e.decoded = false;
  rec.numel = n;
  if (s.format == StashFormat::DenseF32) {
    e.stored = Stored::ZeroCopy;
    e.bytes = t.nbytes();
    zero_copy_live_ += e.bytes;
    rec.stored_as = "fp32 (zero copy)";
  } else {
    const auto t0 = timing_ ? Clock::now() : Clock::time_point{};
    void* dst = at(top_);
    if (!s.full) {
      e.stored = Stored::Bits;
      e.nonzero = bits_kept >= 0 ? bits_kept : bitmap::make_bits(x, n, prune_threshold_, static_cast<uint64_t*>(dst));
      e.bytes = size_t(bitmap::num_words(n)) * 8;
      rec.stored_as = "bits (mask)";
    } else if (s.format == StashFormat::DenseF16 || s.format == StashFormat::DenseBF16) {
      const bool bf = s.format == StashFormat::DenseBF16;
      bf ? f32_to_bf16(x, n, static_cast<uint16_t*>(dst)) : f32_to_f16(x, n, static_cast<uint16_t*>(dst));
      e.stored = bf ? Stored::DenseBF16 : Stored::DenseF16;
      e.bytes = size_t(n) * 2;
      e.nonzero = n;
      rec.stored_as = bf ? "bf16" : "fp16";
    } else {
      const bool f16 = s.format == StashFormat::BitmapF16;
      const auto vt = f16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32;
      // Only auto needs the count before choosing; pack itself counts (one pass fewer).
      const int64_t kept = bits_kept >= 0 || s.format != StashFormat::Auto ? bits_kept : bitmap::count_nonzero(x, n, prune_threshold_);
      const bool to_dense = s.format == StashFormat::Auto && bitmap::bitmap_bytes(n, kept, vt) >= size_t(n) * 4;
      if (to_dense) {
        std::memcpy(dst, x, size_t(n) * 4);  // dense is smaller: keep an exact copy
        e.stored = Stored::DenseF32;
        e.bytes = size_t(n) * 4;
        e.nonzero = n;
        rec.stored_as = "fp32 (copy)";
      } else {
        uint64_t* bits = static_cast<uint64_t*>(dst);
        void* values = bits + bitmap::num_words(n);
        if (bits_kept >= 0) {  // the producer wrote the bitmap (Backend MaskOut)
          bitmap::pack_values(x, bits, n, values, vt);
          e.nonzero = bits_kept;
        } else {
          e.nonzero = bitmap::pack(x, n, prune_threshold_, bits, values, vt);
        }
        e.stored = f16 ? Stored::BitmapF16 : Stored::BitmapF32;
        e.bytes = bitmap::bitmap_bytes(n, e.nonzero, vt);
        rec.stored_as = f16 ? "bitmap+fp16" : "bitmap+fp32";
      }
    }
    top_ += Arena::align_up(e.bytes);
    ET_CHECK(top_ <= region_.size(), "stash region overflow at value ", value_id);
    if (timing_) pack_s_ += since(t0);
  }
  rec.bytes = e.bytes;
  rec.nonzero = e.stored != Stored::ZeroCopy ? e.nonzero : count_zero_copy_ ? bitmap::count_nonzero(x, n, 0.f) : -1;
  stack_.push_back(value_id);
  peak_ = std::max(peak_, live_bytes());
}

Tensor Stash::get(int value_id) {
  Entry& e = entries_[size_t(value_id)];
  ET_CHECK(e.stored != Stored::None && e.stored != Stored::Bits, "value ", value_id, " not saved in full");
  if (e.stored == Stored::ZeroCopy) return e.view;
  const SavedValue& s = *info(value_id);
  const int64_t n = e.view.numel();
  ET_CHECK(s.unpack.defined(), "value ", value_id, " has no decode buffer: planned for reads as stored only");
  Tensor out = s.unpack;
  out.shape = e.view.shape;  // the current batch
  if (!e.decoded) {
    const auto t0 = timing_ ? Clock::now() : Clock::time_point{};
    const void* src = at(e.offset);
    float* y = out.f32();
    switch (e.stored) {
      case Stored::DenseF32: std::memcpy(y, src, size_t(n) * 4); break;
      case Stored::DenseF16: f16_to_f32(static_cast<const uint16_t*>(src), n, y); break;
      case Stored::DenseBF16: bf16_to_f32(static_cast<const uint16_t*>(src), n, y); break;
      case Stored::BitmapF32:
      case Stored::BitmapF16: {
        const auto* bits = static_cast<const uint64_t*>(src);
        bitmap::unpack(bits, bits + bitmap::num_words(n), n,
                       e.stored == Stored::BitmapF16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32, y);
        break;
      }
      default: ET_CHECK(false, "unreachable");
    }
    e.decoded = true;
    if (timing_) unpack_s_ += since(t0);
  }
  return out;
}

Tensor Stash::get_stored(int value_id) const {
  const Entry& e = entries_[size_t(value_id)];
  DType t = DType::F32;
  switch (e.stored) {
    case Stored::ZeroCopy: return e.view;
    case Stored::DenseF32: t = DType::F32; break;
    case Stored::DenseF16: t = DType::F16; break;
    case Stored::DenseBF16: t = DType::BF16; break;
    case Stored::BitmapF32: t = DType::BitmapF32; break;
    case Stored::BitmapF16: t = DType::BitmapF16; break;
    case Stored::None:
    case Stored::Bits: ET_CHECK(false, "value ", value_id, " not saved in full");
  }
  return Tensor::contiguous(at(e.offset), e.view.shape, t);
}

MaskView Stash::get_mask(int value_id) {
  Entry& e = entries_[size_t(value_id)];
  MaskView m;
  m.numel = e.view.numel();
  switch (e.stored) {
    case Stored::Bits:
    case Stored::BitmapF32:
    case Stored::BitmapF16: m.bits = static_cast<const uint64_t*>(at(e.offset)); break;
    case Stored::DenseF32: m.dense = get_stored(value_id); break;  // the copy itself
    default: m.dense = get(value_id);
  }
  return m;
}

void Stash::pop(int value_id) {
  // Pops are LIFO except under recomputation, where a segment's recomputed values are pushed above
  // values it kept from the forward. A value popped from below the top leaves a hole that is
  // reclaimed when everything above it has been popped.
  auto it = std::find(stack_.rbegin(), stack_.rend(), value_id);
  ET_CHECK(it != stack_.rend(), "stash pop of value ", value_id, " that was not pushed");
  Entry& e = entries_[size_t(value_id)];
  if (e.stored == Stored::ZeroCopy) zero_copy_live_ -= e.bytes;
  e = Entry{};
  stack_.erase(std::next(it).base());
  const size_t old_top = top_;
  top_ = 0;
  for (auto j = stack_.rbegin(); j != stack_.rend(); ++j) {
    const Entry& f = entries_[size_t(*j)];
    if (f.stored != Stored::ZeroCopy) {
      top_ = f.offset + Arena::align_up(f.bytes);
      break;
    }
  }
  if (release_pages_ && top_ < old_top) region_.release(top_, old_top - top_);
}

}  // namespace et
