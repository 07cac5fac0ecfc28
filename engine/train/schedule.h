// Learning-rate schedules as pure functions of training progress, so a resumed run computes the
// same rates. `epoch` is fractional: epoch e, step i of n -> e + i / n.
#pragma once
#include "engine/config.h"

namespace et {

float learning_rate(const TrainConfig& t, double epoch);

}  // namespace et
