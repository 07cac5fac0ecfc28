// Divergence guard (docs/config.md, train.on_divergence): how a training step sees that the run
// diverged, and, once it has, where the first non-finite value came from.
// Every step pays one compare of the loss (check_loss), one read of the parameter gradients
// before the SGD step (gradients_finite) and the finiteness count the SGD step makes over the
// parameters it writes anyway (Backend::sgd_step); a quantizer that meets a non-finite value
// throws NonFiniteError. Locating runs only after a detection, never per step.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

namespace et {

class Executor;

enum class DivergenceCause : uint8_t {
  None,
  NonFiniteLoss,    // the loss is NaN or infinite
  LossAboveBound,   // finite, above train.divergence_loss
  NonFiniteValue,     // a quantizer met a non-finite input, weight or output gradient (NonFiniteError)
  NonFiniteGradient,  // a parameter gradient is non-finite (the loss can be finite: ReLU maps NaN to 0)
  NonFiniteUpdate,    // finite gradients, but the SGD step wrote a non-finite parameter (an overflow)
};
// "non_finite_loss", "loss_above_bound", "non_finite_value", "non_finite_gradient",
// "non_finite_update" (metrics.jsonl).
const char* divergence_cause_name(DivergenceCause c);

// The per-step check of the loss against train.divergence_loss; None when it is fine.
inline DivergenceCause check_loss(float loss, float bound) {
  if (!std::isfinite(loss)) return DivergenceCause::NonFiniteLoss;
  return loss > bound ? DivergenceCause::LossAboveBound : DivergenceCause::None;
}

// Whether every parameter gradient is finite: one read of them, before the SGD step, so a step
// that fails it still has the parameters it used and locate_in_step can run it again.
bool gradients_finite(Executor& ex);

struct Divergence {
  DivergenceCause cause = DivergenceCause::None;
  int64_t step = 0;    // the training step, 0-based as in the quantizers' messages
  double loss = 0;     // the step's loss (NaN / inf possible), if loss_known
  bool loss_known = false;  // false when the forward stopped before the loss (a quantizer threw)
  float bound = 0;     // train.divergence_loss
  // Where the first non-finite value appeared: the node's name (empty: no non-finite value was
  // found) and what of it, e.g. "its output in the forward".
  std::string layer, where;
  std::string detail;  // a quantizer's message; for a finite step, its largest activation
  std::string describe() const;  // "loss nan (non-finite); first non-finite value: layer '...', ..."
};

// After a detection made while the parameters are still those the step used (the loss check, a
// quantizer's error): runs the step again on the inputs still in the executor (same batch, same
// seeds, so the same values), checking each node's output after its forward; if all are finite,
// its backward, checking the gradients each node writes. The first non-finite one, in execution
// order, is the origin: later nodes only inherit it. Also records the largest activation. Updates
// BN statistics and gradients again: the trainer discards the state after a divergence.
void locate_in_step(Executor& ex, int64_t batch, Divergence& d);
// After the SGD step reported a non-finite parameter (so the step cannot be run again): the first
// parameter, in backward order, whose gradient is non-finite (the origin: a non-finite gradient
// spreads to the layers before it), else the first non-finite parameter (an overflow).
void locate_in_update(const Executor& ex, float lr, Divergence& d);

}  // namespace et
