// Stash: where activations saved for backward live between a node's forward and its backward.
// Ops only declare what they need (Op::saves(): every element, or only the > 0 mask); the executor
// pushes a value once, after the forward of its first saving consumer, and pops it after that
// consumer's backward (the last reader), so pushes and pops are LIFO and the stash is a stack
// (recomputation pushes a segment's values again above ones it kept; see Stash::pop).
//
// Formats (per value; memory.stash globally, memory.layers per layer) and the encodings they
// store: memory/stash_format.h. The executor applies a global bitmap format / auto only to values with zeros by construction
// (ReLU outputs...); others keep the dense format of the same precision (executor_plan.cpp).
// A value only ever read as a mask (a ReLU output nobody else saves) is stored as its bitmap
// alone in every format; the ReLU backward reads that bitmap as its mask.
// bitmap_int4 stores the INT4 codes a quantized layer computed from the value (pushed with them)
// behind the value's bitmap, which a mask reads too; those codes are only read as stored.
// Activation pruning (prune_threshold > 0) is a property of the stored values only: a mask is
// always the exact > 0 mask of the forward value. A value stored in a bitmap format with pruned
// values and also read as a mask keeps its exact mask beside the encoding (n / 8 bytes more).
// Everything except dense_fp32 copies into the stash's own region, so the forward buffer dies
// after its last forward reader. Full reads decode into an executor-planned f32 buffer, or, for
// kernels that say they can, read the storage as it is (get_stored; memory/stored_reader.h).
//
// Fixed layout (a codec that defers_counts(): a GPU, where each count read back would wait for the
// device): every entry takes its worst case in the region, so no push waits for a count, and a
// recorded step (engine/step_replay.h) may hold bitmap formats. The counts stay in the codec's
// memory, one slot per saved value, until settle() reads them all back at once and replays the
// step's pushes and pops (log_) with the bytes each would have taken packed: records and peaks
// are the numbers the compact layout gives (the CPU's).
// Room: a GPU allocates the whole region (no page is left untouched), so the fixed layout sizes it
// from what the entries took. Until fit(), each entry whose size follows its count (bitmap values,
// INT4 codes) takes its worst case, or configure()'s first_room share of it; fit() gives each room
// for the most it has kept so far plus a headroom, and reallocates the region to the peak the
// last step reaches with those rooms.
// The codec writes no more than an entry's room; a push that kept more shows when its count is
// settled (overflowed()): that step's backward read values that were not there, so the caller
// runs it again after fit() made more room (the trainer: engine/train/trainer.cpp).
#pragma once
#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "engine/kernel_types.h"
#include "engine/tensor.h"
#include "memory/arena.h"
#include "memory/stash_codec.h"
#include "memory/stash_format.h"

namespace et {

// One value the stash will hold, as planned by the executor.
struct SavedValue {
  int value = -1;
  int64_t numel = 0;          // at the planned (maximum) batch
  bool full = false;          // some reader needs every element; else only the > 0 mask
  bool mask_read = false;     // some reader reads only its > 0 mask (a ReLU backward)
  StashFormat format = StashFormat::DenseF32;
  Tensor unpack;              // f32 decode buffer for full reads; not planned for zero-copy values
                              // and for values every reader reads as stored (get_stored)
  // Not kept at all (memory.recompute_stack_outputs): the first read of a backward has the
  // recomputer (Stash::set_recomputer) write it into `unpack`; masks read it there too.
  bool recomputed = false;
  // A recomputed value its producer describes as relu(x * scale[c] + shift[c]) of its saved x: a
  // reader that takes DType::AffineRelu computes it as it reads (engine/affine_relu.h).
  bool affine_relu = false;
  // The save is the forward buffer itself (dense_fp32's full saves): it must outlive the backward.
  bool stored_in_place() const {
    if (recomputed) return false;
    const StashFormatInfo& f = stash_format_info(format);
    return (full ? f.full : f.mask) == StashEncoding::ZeroCopy;
  }
};

// What the last push stored for a value (for the memory profile).
struct StashRecord {
  const char* stored_as = "";  // StashEncodingInfo::display: "fp32 (zero copy)", "bits (mask)", ...
  size_t bytes = 0;            // bytes in the stash region (zero-copy: the forward buffer's)
  int64_t numel = 0, nonzero = 0;  // nonzero -1: not counted (zero copy outside a profile)
  bool packed_by_producer = false; // the producing kernel packed the values as it wrote the value
  double seconds = 0;              // packing and decoding it since set_timing(true) (0 when off)
};

class Stash {
 public:
  // Sizes the region for `saved` (worst case: everything pushed at once, as at the end of a
  // forward) and allocates it from `memory` (the backend's); `codec` (the same backend's) encodes
  // and decodes in it. Outside the step.
  // `release_pages`: pages above the top go back to the OS as values are popped.
  // `first_room` (fixed layout; negative: off): until the first fit(), each entry whose size follows
  // its count has room for that share of its elements rather than its worst case, so the region is
  // never the worst case; a first step that keeps more overflows and runs again (overflowed()).
  // `allocate` false: sized, nothing allocated (a plan-only executor's stash, never pushed to).
  void configure(std::vector<SavedValue> saved, int num_values, float prune_threshold, bool release_pages = false,
                 DeviceMemory& memory = host_memory(), StashCodec& codec = host_stash_codec(),
                 double first_room = -1, bool allocate = true);
  // What an out-of-memory error calls the region, when configure() or fit() cannot allocate it (the
  // executor names the largest saved layer and the way out: docs/config.md's memory.budget_mb).
  void set_region_name(std::string what) { region_name_ = std::move(what); }

  // The fixed layout's room (above), after a step and outside the next one: each entry's room is the
  // most it kept in any step so far (since forget_kept()), plus `headroom` of it (and kRoomPad): it
  // only grows, but for the first fit (which replaces the worst case or configure's first_room)
  // and the first after forget_kept();
  // the region becomes the peak the last step's pushes and pops reach with them (its worst case
  // after a step that stopped part way). Returns whether entries moved (layout_generation()
  // changed). Nothing in the compact layout, or with a negative headroom.
  bool fit(double headroom);
  // No fit() yet, or the last one followed a step that stopped part way, or forget_kept() since.
  bool wants_fit() const { return fixed_layout_ && wants_fit_; }
  // The counts so far are forgotten: the next fit() sizes each room from the steps after this call
  // alone, so the region shrinks as the values grow sparser in training (the trainer calls it at
  // each epoch's start); the rooms stay as they are until then.
  void forget_kept() {
    if (!fixed_layout_) return;
    std::fill(most_kept_.begin(), most_kept_.end(), int64_t(-1));
    wants_fit_ = true;
  }
  static constexpr int64_t kRoomPad = 256;  // elements: small values' counts vary most
  // A push of the last step kept more than its room (settles): value_id, else -1.
  int overflowed() const;
  // Changes whenever fit() moves entries: a recorded step (engine/step_replay.h) holds the old places.
  int64_t layout_generation() const { return generation_; }
  void clear();  // drops everything (a new training forward); settles the last step first
  // Drops everything after a pass that threw part way (Executor::recover): its counts settled, no
  // check that a push kept more than its room (that may be why it threw: the caller's fit() then
  // grows the room), and the next fit() sizes the region for every entry at once.
  void abandon();
  // `written`: what the producer wrote at mask_target(value_id) (MaskOut::kept >= 0: the bitmap of t
  // at this stash's prune threshold, with that many set bits; values_written: the values too), so
  // only the rest remains to pack.
  // bitmap_int4 (stores_codes): `codes` are the INT4 codes (I4 / U4, one per element, the scale in
  // Tensor::scale) a quantized layer computed from t; the bitmap is t's.
  void push(int value_id, const Tensor& t, const MaskOut& written = MaskOut{}, const Tensor& codes = Tensor{});
  bool stores_codes(int value_id) const;
  // Where the next push of value_id (numel elements) puts its bitmap if stored with one (bitmap
  // formats, auto, masks), with the prune threshold, and its kept values if stored as bitmap +
  // values; bits = nullptr otherwise.
  MaskOut mask_target(int value_id, int64_t numel) const;
  Tensor get(int value_id);  // every element, f32 (decoded on first use); not for codes
  // The value as stored: F32 (the forward buffer or a copy), F16 / BF16, BitmapF32 / BitmapF16, or
  // the codes BitmapI4 / BitmapU4 with their scale (engine/tensor.h), a view into the stash for
  // kernels that decode as they read. Not for values stored as a mask only.
  Tensor get_stored(int value_id) const;
  // The forward's own f32 buffer where the value is held now, zero copy; else undefined (not
  // pushed, popped, recomputed, or kept in another encoding).
  Tensor held_in_place(int value_id) const;
  MaskView get_mask(int value_id);
  void pop(int value_id);
  // The decode buffer's planned lifetime ends (its last f32 read is done) before the value's pop;
  // a later get() is a planning error and aborts.
  void end_decode(int value_id);
  // For SavedValue::recomputed values: writes value_id (every element, the current batch) into
  // `out`. Set once by the executor, outside the step.
  using Recomputer = std::function<void(int value_id, Tensor& out)>;
  void set_recomputer(Recomputer r) { recomputer_ = std::move(r); }
  bool recomputed(int value_id) const { return info(value_id)->recomputed; }
  bool affine_relu(int value_id) const { return info(value_id)->affine_relu; }

  // Bytes held now: the region's top and the zero-copy values (in the fixed layout, as packed, as
  // of the last settle()).
  size_t live_bytes() const { return fixed_layout_ ? logical_live_ : top_ + zero_copy_live_; }
  size_t peak_bytes() const {  // since the last reset_peak()
    settle();
    return peak_;
  }
  void reset_peak() {
    settle();
    peak_ = live_bytes(), region_peak_ = top_;
  }
  // The fixed layout (above): settle() reads the counts back (a wait for the device) and accounts
  // the logged step; records, peaks and clear() call it, and a replay before it overwrites them.
  // recorded(): the logged step was recorded, not run (no counts yet); replayed(): the backend
  // ran it (its pushes and pops are the logged ones, with this run's counts).
  bool fixed_layout() const { return fixed_layout_; }
  void settle() const;
  void recorded() { unsettled_ = false; }
  void replayed() { unsettled_ = fixed_layout_ && !log_.empty(); }
  // The highest the region's top has been since the last reset_peak(): its pages touched, what
  // the stash adds to USS (zero-copy values live in the executor's arena).
  size_t region_peak_bytes() const { return region_peak_; }
  const std::vector<SavedValue>& saved() const { return saved_; }
  size_t region_resident_bytes() const { return region_.resident_bytes(); }
  size_t region_bytes() const { return region_.size(); }
  const StashRecord& record(int value_id) const {
    settle();
    return records_[size_t(value_id)];
  }
  // Wall time spent compressing (push) and decoding (get) while enabled, in seconds.
  void set_timing(bool on) {
    timing_ = on;
    pack_s_ = unpack_s_ = 0;
    for (StashRecord& r : records_) r.seconds = 0;
  }
  // Profilers: count the non-zeros of zero-copy values too (a pass over them; off in training).
  void set_count_zero_copy(bool on) { count_zero_copy_ = on; }
  double pack_seconds() const { return pack_s_; }
  double unpack_seconds() const { return unpack_s_; }

 private:
  struct Entry {
    StashEncoding stored = StashEncoding::None;
    size_t offset = 0, bytes = 0;  // the entry in the region: [exact mask] encoding
    size_t slot_bytes = 0;         // what it takes there: align_up(bytes), or its worst case (fixed)
    size_t encoding_offset = 0;    // where the encoding starts (offset, or after the exact mask)
    bool exact_mask = false;       // the exact > 0 mask at offset, apart from pruned values
    int64_t nonzero = 0;
    float scale = 1.f;     // codes: their scale, or where the backend keeps it (Tensor::scale_at)
    const float* scale_at = nullptr;
    Tensor view;           // zero copy: the forward buffer; else shape/dtype of the original
    bool decoded = false;  // unpack buffer holds this step's values
    bool decode_ended = false;  // end_decode: the unpack buffer's planned lifetime is over
  };
  const SavedValue* info(int value_id) const;
  void drop_entries();  // clear() and abandon(): nothing pushed
  // Whether a full save keeps its exact mask apart: pruned values in a bitmap, read as a mask too.
  bool mask_apart(const SavedValue& s) const;
  // What a save of n elements takes in the region, with its exact mask apart: its worst case, or
  // in the fixed layout with at most room_of(..) kept.
  size_t slot_bytes(const SavedValue& s, int64_t n) const;
  // The kept elements an entry of n elements has room for (n: no limit).
  int64_t room_of(const SavedValue& s, int64_t n) const;
  // auto in the fixed layout: whether a push of n elements stores the dense copy, which its room
  // decides (a bitmap with room_of(..) values would take as much); the compact layout counts.
  bool copies(const SavedValue& s, int64_t n) const;
  int64_t* count_slot(int value_id) const;
  void* at(size_t offset) const { return region_.at(offset); }

  std::vector<SavedValue> saved_;
  std::vector<int> index_;  // value id -> index into saved_, -1 if never saved
  std::vector<Entry> entries_;
  mutable std::vector<StashRecord> records_;  // counts in slots: settled when read
  std::vector<int> stack_;  // value ids in push order (LIFO check)
  Arena region_;
  std::string region_name_ = "the activation stash";
  Recomputer recomputer_;
  StashCodec* codec_ = &host_stash_codec();
  float prune_threshold_ = 0.f;
  size_t top_ = 0, region_peak_ = 0, zero_copy_live_ = 0;
  mutable size_t peak_ = 0;

  // The fixed layout's state (stash_settle.cpp). A push's count is known (`nonzero`) or in the
  // value's slot (`in_slot`); `extra_bytes`: the exact mask before the encoding, or a zero-copy
  // value's bytes.
  // `room`: the kept elements the entry had room for (-1: its worst case, or a copy); `room_kept`:
  // what it kept of them when known (auto counts the bitmap's even when it copies), else (-1) in
  // the slot.
  struct LogEvent {
    int value = -1;
    bool push = false, in_slot = false;
    StashEncoding stored = StashEncoding::None;
    int64_t numel = 0, nonzero = -1;
    size_t extra_bytes = 0;
    bool sized = false;  // its size follows its count (bitmap values, codes)
    int64_t room = -1, room_kept = -1;
  };
  template <class RoomOfPush, class AtEach>
  size_t replay_log(RoomOfPush room_of_push, AtEach at_each) const;  // stash_settle.cpp
  struct Packed {  // an entry of the compact layout settle() replays
    int value;
    size_t end, bytes;
    bool zero_copy;
  };
  bool fixed_layout_ = false;
  Arena slots_;                       // one int64 count per saved value (saved_ order), the codec's
  std::vector<LogEvent> log_;         // this step's pushes and pops
  mutable std::vector<int64_t> host_counts_;
  mutable std::vector<Packed> packed_;
  mutable size_t logical_live_ = 0;
  mutable bool unsettled_ = false;
  std::vector<int64_t> room_;               // per saved value (saved_ order): -1 worst case
  mutable std::vector<int64_t> most_kept_;  // the most each has kept since configure (-1: not sized)
  mutable int overflow_value_ = -1;         // the last settled step's first push past its room
  int64_t generation_ = 0;
  bool wants_fit_ = true;
  bool abandoned_ = false;  // abandon() since the last clear(): the log is part of a step
  bool timing_ = false, release_pages_ = false, count_zero_copy_ = false;
  double pack_s_ = 0, unpack_s_ = 0;
};

}  // namespace et
