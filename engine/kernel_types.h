// Backend-neutral types that kernels, ops and the stash pass around: scratch memory and the
// ReLU-style masks a backward reads or a forward writes. Here rather than in backends/backend.h
// so that memory/ (the stash) needs no backend header.
#pragma once
#include <cstddef>
#include <cstdint>

#include "engine/tensor.h"
#include "quant/codes.h"

namespace et {

struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// A mask for ReLU-style backward passes: element i is "on" if dense[i] > 0, or, when the stash keeps
// a bitmap, if bit i of `bits` is set. Exactly one of the two is set.
struct MaskView {
  Tensor dense;
  const uint64_t* bits = nullptr;
  int64_t numel = 0;
};

// A dropout node's mask seed this step, mix64(step ^ node) (quant/codes.h), in its two parts: a
// backend may read `step` from its own memory (Backend::set_step_seed), so that a recorded step's
// kernels draw the masks of the step replayed (engine/step_replay.h).
struct DropoutSeed {
  uint64_t step = 0;  // the executor's step seed
  uint64_t node = 0;  // the node's own part: mix64(its seed index + 1)
};

// Where an FP4 quantizer's stochastic rounding takes its bits (LUQ): the node's seed this step, as
// dropout's (a backend may read `seed.step` from its own memory, so a replayed step rounds with
// its own bits), and the SMP sample.
struct QuantDraw {
  DropoutSeed seed;
  int sample = 0;
  ET_HOST_DEVICE quant::RngKey key_for(uint64_t step) const {
    return quant::rng_key(quant::mix64(step ^ seed.node), sample);
  }
  quant::RngKey key() const { return key_for(seed.step); }
};

// Where a forward kernel may write its output's bitmap (memory/bitmap.h layout and keep rule,
// with activation pruning at `prune_threshold`) while it writes the output: the stash then only
// packs the values. The kernel sets `kept` to the number of set bits; -1 = not written.
// `values` (the stash keeps the output as bitmap + values, f32 or `values_f16`): where the kept
// values go, in order, right after the bitmap; a kernel that packs them as it writes the output
// sets `values_written`, and the stash reads nothing of the output then.
struct MaskOut {
  uint64_t* bits = nullptr;
  float prune_threshold = 0.f;
  int64_t kept = -1;
  // The stash's fixed layout (memory/stash.h): where a producer whose count would cost a wait for
  // the device (a GPU's) leaves it, in the backend's memory, instead of `kept`; it sets
  // kept_in_slot then.
  int64_t* kept_slot = nullptr;
  bool kept_in_slot = false;
  void* values = nullptr;
  bool values_f16 = false;
  bool values_written = false;
};

}  // namespace et
