// A training step's forward and backward recorded once and replayed (train.cuda_graph; the CUDA
// backend records a CUDA graph): one launch instead of the step's hundreds, whose host-side cost
// otherwise dominates a small model's step on a GPU.
//
// A replay repeats the recorded work with its addresses and arguments, so it is valid while they
// stay as recorded: the same executor (a re-plan makes a new one, and a new StepReplay), the whole
// batch, a training step, and nothing per step in a kernel's arguments or in the layout:
//   - no op that draws random numbers (dropout's seed changes every step), unless the backend's
//     kernels read the step seed from its memory (Backend::replays_draws: CUDA);
//   - every saved value stored at a fixed place: dense_fp32 / fp16 / bf16, masks stored alone, and
//     where the stash has the fixed layout (memory/stash.h: a GPU's) bitmap_fp32 / fp16, the codes
//     of bitmap_int4 and auto (whose encoding each entry's room decides there, not a count);
//   - 4-bit layers only where the backend keeps their scales in its memory
//     (Backend::quant_scales_in_memory: CUDA), so that no scale is read back or passed by value.
// Recomputation is recorded with the rest: its bookkeeping is the same every step. When the
// stash's fixed layout moves its entries (Stash::fit: its room fitted or grown), the next step is
// recorded again.
// The learning rate is not in the record: the optimizer step runs after the replay, so the
// divergence guard checks the loss and gradients before any parameter changes, as without it.
#pragma once
#include <cstdint>
#include <string>

#include "engine/executor.h"

namespace et {

class StepReplay {
 public:
  // `enabled`: train.cuda_graph. The first `warmup` steps run directly (the backend sizes its
  // scratch and measures its conv paths there), the next is recorded and run, the rest replayed.
  // `verified_only` (train.cuda_graph = auto): not what no GPU run has verified yet (unverified).
  StepReplay(Executor& ex, bool enabled, int warmup = 2, bool verified_only = false);
  // Why this executor's training step cannot be replayed, "" if it can.
  static std::string unsupported(const Executor& ex);
  // What this executor's step would record that was written without a GPU to run it (session 56:
  // the bitmap formats' fixed layout, dropout's device seed, recomputation; session 57: 4-bit
  // scales on the device; session 58: auto and bitmap_int4 recorded), "" if nothing.
  static std::string unverified(const Executor& ex);

  // This step's ex.forward(batch, true) and ex.backward(), recorded and run or replayed; false (and
  // nothing done) for a step the caller runs itself: a warm-up step, a batch other than the whole
  // one, or any step where replay is off or unsupported. If recording fails, the step runs
  // directly here (true) and why_not() says why later ones will not be replayed.
  bool try_step(int64_t batch);
  bool replaying() const { return recorded_; }
  // Why steps are not replayed ("" while they are, or will be after the warm-up).
  const std::string& why_not() const { return why_not_; }

 private:
  Executor& ex_;
  int warmup_;
  int64_t steps_ = 0;
  bool recorded_ = false;
  int64_t recorded_layout_ = -1;  // the stash's layout_generation() when recorded
  int64_t recorded_backend_ = -1;  // the backend's record_generation() when recorded
  std::string why_not_;
};

}  // namespace et
