#include "engine/step_replay.h"

#include <exception>

namespace et {

StepReplay::StepReplay(Executor& ex, bool enabled, int warmup, bool verified_only) : ex_(ex), warmup_(warmup) {
  if (!enabled) {
    why_not_ = "train.cuda_graph is off";
    return;
  }
  why_not_ = unsupported(ex);
  if (why_not_.empty() && verified_only) why_not_ = unverified(ex);
}

std::string StepReplay::unverified(const Executor& ex) {
  const std::string why = " is recorded only with train.cuda_graph = true until a GPU run has verified it";
  const Graph& g = ex.graph();
  for (int n = 0; n < g.num_nodes(); ++n) {
    if (g.node(n).op->draws_random()) return "dropout ('" + g.node(n).name + "')" + why;
    if (ex.layer_quant(n).on()) return "4-bit training ('" + g.node(n).name + "', its scales on the device)" + why;
  }
  for (const SavedValue& s : ex.stash().saved()) {
    if (s.recomputed) return "recomputation ('" + g.value(s.value).name + "')" + why;
    const StashEncoding enc = s.full ? stash_format_info(s.format).full : stash_format_info(s.format).mask;
    if (enc == StashEncoding::BitmapF32 || enc == StashEncoding::BitmapF16 || stash_encoding_info(enc).codes)
      return std::string(stash_format_name(s.format)) + " ('" + g.value(s.value).name + "')" + why;
  }
  if (ex.memory().recompute_segments > 0) return "recomputation" + why;
  return "";
}

std::string StepReplay::unsupported(const Executor& ex) {
  if (std::string why = ex.backend().capture_unsupported(); !why.empty()) return why;
  const Graph& g = ex.graph();
  for (int n = 0; n < g.num_nodes(); ++n) {
    const Op& op = *g.node(n).op;
    if (op.draws_random() && !ex.backend().replays_draws())
      return "layer '" + g.node(n).name + "' (" + op.type() + ") draws new numbers every step";
    if (ex.layer_quant(n).on() && !ex.backend().quant_scales_in_memory())
      return "layer '" + g.node(n).name + "' is 4-bit, and the " + ex.backend().name() +
             " backend reads its scales back every step";
  }
  // Recomputation (segments, recomputed stack outputs) is host bookkeeping that repeats every step
  // (which views point where, what is pushed again): the recorded kernels are the step's.
  for (const SavedValue& s : ex.stash().saved()) {
    if (s.recomputed) continue;
    const StashFormatInfo& f = stash_format_info(s.format);
    const StashEncoding enc = s.full ? f.full : f.mask;
    // Fixed sizes: a mask alone is n bits (its producer leaves the count out while recording).
    // Bitmaps with values or codes where the stash places each entry in its room and leaves the
    // counts on the device (Stash::fixed_layout); there auto's encoding is the entry's, and
    // bitmap_int4's signedness the layer's.
    const bool fixed = enc == StashEncoding::ZeroCopy || enc == StashEncoding::F16 || enc == StashEncoding::BF16 ||
                       enc == StashEncoding::Mask || (ex.stash().fixed_layout() && stash_encoding_info(enc).bitmap);
    if (!fixed)
      return std::string("value '") + g.value(s.value).name + "' is stored as " + stash_format_name(s.format) +
             (s.full ? "" : " (a mask)") + ", whose size the step reads back";
  }
  return "";
}

bool StepReplay::try_step(int64_t batch) {
  if (!why_not_.empty() || batch != ex_.graph().batch_size() || steps_++ < warmup_) return false;
  Backend& be = ex_.backend();
  // The stash's room grew or was fitted (Stash::fit): its entries moved, so record again; so too
  // where the backend moved memory the record uses, or recorded another step.
  if (recorded_ && (recorded_layout_ != ex_.stash().layout_generation() ||
                    recorded_backend_ != be.record_generation()))
    recorded_ = false;
  if (!recorded_) {
    ex_.stash().settle();  // the last step's counts (fixed layout): no read back while recording
    be.begin_capture();
    std::string failed;
    try {
      ex_.forward(batch, true);
      ex_.backward();
    } catch (const std::exception& e) {  // a call that cannot be recorded (a read back)
      failed = e.what();
    }
    const std::string ended = be.end_capture();
    if (!failed.empty() || !ended.empty()) {
      why_not_ = "recording the step failed: " + (failed.empty() ? ended : failed);
      be.drop_capture();
      ex_.stash().recorded();  // its pushes were recorded, not run: no counts to settle
      ex_.forward(batch, true);  // the recorded work did not run: run it now
      ex_.backward();
      return true;
    }
    ex_.stash().recorded();
    recorded_ = true;
    recorded_layout_ = ex_.stash().layout_generation();
    recorded_backend_ = be.record_generation();
  }
  ex_.stash().settle();  // the last run's counts (fixed layout), before this run overwrites them
  be.replay();
  ex_.replayed(batch);
  return true;
}

}  // namespace et
