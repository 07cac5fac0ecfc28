// The stash's fixed layout (memory/stash.h): the counts a step left in the codec's memory, read
// back at once and accounted as the compact layout would have placed them.
#include <algorithm>

#include "memory/stash.h"

namespace et {

void Stash::settle() const {
  if (!unsettled_) return;
  unsettled_ = false;
  // One copy of every slot, where a push left its count in one (dense formats leave none).
  if (std::any_of(log_.begin(), log_.end(), [](const LogEvent& ev) { return ev.in_slot; }))
    codec_->read_back(host_counts_.data(), slots_.at(0), host_counts_.size() * sizeof(int64_t));
  // Stash::push / pop's placement, with each entry's packed bytes.
  size_t top = 0, zero_copy = 0;
  packed_.clear();
  for (const LogEvent& ev : log_) {
    if (!ev.push) {
      auto it = std::find_if(packed_.rbegin(), packed_.rend(), [&](const Packed& p) { return p.value == ev.value; });
      ET_CHECK(it != packed_.rend(), "stash log: pop of value ", ev.value, " not pushed");
      if (it->zero_copy) zero_copy -= it->bytes;
      packed_.erase(std::next(it).base());
      top = 0;
      for (auto j = packed_.rbegin(); j != packed_.rend(); ++j)
        if (!j->zero_copy) {
          top = j->end;
          break;
        }
      continue;
    }
    if (ev.stored == StashEncoding::ZeroCopy) {
      zero_copy += ev.extra_bytes;
      packed_.push_back({ev.value, 0, ev.extra_bytes, true});
    } else {
      size_t bytes = 0;
      if (ev.stored != StashEncoding::Recomputed) {
        const int64_t kept = ev.in_slot ? host_counts_[size_t(index_[size_t(ev.value)])] : ev.nonzero;
        bytes = ev.extra_bytes + stash_encoding_bytes(ev.stored, ev.numel, kept);
        StashRecord& rec = records_[size_t(ev.value)];
        rec.nonzero = kept;
        rec.bytes = bytes;
      }
      top += Arena::align_up(bytes);
      packed_.push_back({ev.value, top, bytes, false});
    }
    peak_ = std::max(peak_, top + zero_copy);
  }
  logical_live_ = top + zero_copy;
}

}  // namespace et
