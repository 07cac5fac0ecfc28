#include "engine/train/optimizer.h"

#include "engine/config.h"

namespace et {

SgdOptions sgd_options(const TrainConfig& train) {
  SgdOptions o;
  o.momentum = train.momentum;
  o.weight_decay = train.weight_decay;
  o.nesterov = train.nesterov;
  return o;
}

bool sgd_update(Executor& ex, const SgdOptions& options, float lr, bool first_step) {
  ex.backend().sgd_steps_deferred(ex.sgd_slots(), lr, options.momentum, options.weight_decay, options.nesterov,
                                  first_step);
  return ex.backend().sgd_finite();  // one answer for the whole update
}

}  // namespace et
