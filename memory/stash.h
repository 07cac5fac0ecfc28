// Stash: where activations saved for backward live between a node's forward and its backward.
// Ops only declare what they need (Op::saves(): a full tensor or a > 0 mask); the executor pushes
// after forward, reads in backward, pops after the last reader. The storage format is the stash's
// business: DenseStash keeps the forward buffer itself (zero copy); compressed stashes (bitmap,
// FP16, 4-bit) copy into their own region so the forward buffer can die early.
#pragma once
#include <vector>

#include "backends/backend.h"
#include "engine/op.h"

namespace et {

class Stash {
 public:
  virtual ~Stash() = default;
  // True if a saved tensor stays in its forward buffer: the planner must then keep that buffer
  // alive until the last backward that reads it.
  virtual bool keeps_forward_buffer() const = 0;
  virtual void reset(int num_values) = 0;  // sizes the bookkeeping (outside the step)
  virtual void clear() = 0;                 // drops everything saved (a new training forward)
  // A value saved by several consumers is pushed once per consumer and stored once.
  virtual void push(int value_id, SaveKind kind, const Tensor& t) = 0;
  virtual Tensor get(int value_id) const = 0;
  virtual MaskView get_mask(int value_id) const = 0;
  virtual void pop(int value_id) = 0;
};

class DenseStash final : public Stash {
 public:
  bool keeps_forward_buffer() const override { return true; }
  void reset(int num_values) override;
  void clear() override;
  void push(int value_id, SaveKind kind, const Tensor& t) override;
  Tensor get(int value_id) const override;
  MaskView get_mask(int value_id) const override;
  void pop(int value_id) override;

 private:
  std::vector<Tensor> saved_;
  std::vector<int> refs_;
};

}  // namespace et
