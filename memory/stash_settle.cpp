// The stash's fixed layout (memory/stash.h): the counts a step left in the codec's memory, read
// back at once and accounted as the compact layout would have placed them; the entries' room.
#include <algorithm>
#include <cmath>

#include "memory/stash.h"

namespace et {

// The logged pushes and pops placed as Stash::push / pop place them, each push taking
// room_of_push(ev) bytes in the region (zero-copy values: their bytes beside it). Calls
// at_each(top, zero_copy) after every push; returns the live bytes (top + zero copy) at the end.
template <class RoomOfPush, class AtEach>
size_t Stash::replay_log(RoomOfPush room_of_push, AtEach at_each) const {
  size_t top = 0, zero_copy = 0;
  packed_.clear();  // reserved at configure(): no allocation between steps
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
    const size_t bytes = room_of_push(ev);
    if (ev.stored == StashEncoding::ZeroCopy) {
      zero_copy += bytes;
      packed_.push_back({ev.value, 0, bytes, true});
    } else {
      top += bytes;
      packed_.push_back({ev.value, top, bytes, false});
    }
    at_each(top, zero_copy);
  }
  return top + zero_copy;
}

void Stash::settle() const {
  if (!unsettled_) return;
  unsettled_ = false;
  // One copy of every slot, where a push left its count in one (dense formats leave none).
  if (std::any_of(log_.begin(), log_.end(), [](const LogEvent& ev) { return ev.in_slot || (ev.sized && ev.room_kept < 0); }))
    codec_->read_back(host_counts_.data(), slots_.at(0), host_counts_.size() * sizeof(int64_t));
  // Each entry with its packed bytes: the compact layout's records and peak.
  logical_live_ = replay_log(
      [&](const LogEvent& ev) -> size_t {
        const size_t i = size_t(index_[size_t(ev.value)]);
        if (ev.sized) {  // the entry's room against what it kept
          const int64_t kept = ev.room_kept < 0 ? host_counts_[i] : ev.room_kept;
          most_kept_[i] = std::max(most_kept_[i], kept);
          if (ev.room >= 0 && kept > ev.room && overflow_value_ < 0) overflow_value_ = ev.value;
        }
        if (ev.stored == StashEncoding::ZeroCopy) return ev.extra_bytes;
        if (ev.stored == StashEncoding::Recomputed) return 0;
        const int64_t kept = ev.in_slot ? host_counts_[i] : ev.nonzero;
        StashRecord& rec = records_[size_t(ev.value)];
        rec.nonzero = kept;
        rec.bytes = ev.extra_bytes + stash_encoding_bytes(ev.stored, ev.numel, kept);
        return Arena::align_up(rec.bytes);
      },
      [&](size_t top, size_t zero_copy) { peak_ = std::max(peak_, top + zero_copy); });
}


int Stash::overflowed() const {
  settle();
  return overflow_value_;
}

bool Stash::fit(double headroom) {
  if (!fixed_layout_ || log_.empty()) return false;
  if (headroom < 0) return wants_fit_ = false;  // every entry keeps its worst case
  settle();
  bool moved = false;
  for (size_t i = 0; i < saved_.size(); ++i) {
    if (most_kept_[i] < 0) continue;  // not sized, or never pushed
    const double want = std::ceil(double(most_kept_[i]) * (1.0 + headroom)) + double(kRoomPad);
    const int64_t room = want >= double(saved_[i].numel) ? saved_[i].numel : int64_t(want);
    // (most_kept_ only grows until forget_kept(): so does the room, but for the fit after that)
    moved = moved || room_[i] != room;
    room_[i] = room;
  }
  overflow_value_ = -1;  // the step runs again with the room it lacked
  // A step that stopped part way (a throw, abandon(); or a fit between its forward and backward:
  // the divergence guard) logged only some pushes or pops: the region holds every entry at once
  // with its new room, as configure() sizes it, never less than it has (entries may be live), and
  // the next whole step fits it.
  const bool whole_step = stack_.empty() && !abandoned_;
  size_t peak = 0;
  if (whole_step) {
    // The last step's pushes and pops with the new slots (settle() above is done with packed_).
    replay_log(
        [&](const LogEvent& ev) -> size_t {
          // (each at its planned batch: a smaller last batch must not shrink the region below it)
          const SavedValue& v = saved_[size_t(index_[size_t(ev.value)])];
          return ev.stored == StashEncoding::ZeroCopy ? 0 : slot_bytes(v, v.numel);
        },
        [&](size_t top, size_t) { peak = std::max(peak, top); });
  } else {
    for (const SavedValue& v : saved_) peak += slot_bytes(v, v.numel);  // all at once, as configure()
    peak = std::max(peak, region_.size());
  }
  wants_fit_ = !whole_step;
  if (region_.size() > 0 && region_.rounded(peak) != region_.size()) {  // (none: nothing kept in it)
    ET_CHECK(stack_.empty() || peak >= region_.size(), "Stash::fit shrinking the region inside a step");
    region_.reallocate(peak, region_name_);
    moved = true;
  }
  if (moved) ++generation_;
  return moved;
}

}  // namespace et
