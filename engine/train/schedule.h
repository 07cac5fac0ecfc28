// Learning-rate schedules as pure functions of training progress, so a resumed run computes the
// same rates. `epoch` is fractional: epoch e, step i of n -> e + i / n.
#pragma once
#include "engine/config.h"

namespace et {

// The schedule of train.schedule over `total` epochs (t.epochs in the two-argument form).
float learning_rate(const TrainConfig& t, double epoch, double total);
inline float learning_rate(const TrainConfig& t, double epoch) { return learning_rate(t, epoch, t.epochs); }

// A whole run with FNT (quant.fnt_epochs = F > 0): train.schedule runs over the first epochs - F
// epochs and ends at its final rate there; the F FNT epochs then rise linearly from that final
// rate to quant.fnt_peak_lr at their middle and fall linearly back to it at their end (LUQ Eq. 17,
// a triangle). Without FNT, learning_rate(t, epoch).
float learning_rate(const TrainConfig& t, const QuantConfig& q, double epoch);

}  // namespace et
