#include "engine/train/schedule.h"

#include <cmath>

namespace et {

float learning_rate(const TrainConfig& t, double epoch) {
  const ScheduleConfig& s = t.schedule;
  const double base = t.lr, total = t.epochs;
  if (s.type == "onecycle") {
    // Linear rise from lr/div to lr over pct_start, then cosine down to lr/div/final_div.
    const double start = base / s.div_factor, end = start / s.final_div_factor;
    const double rise = s.pct_start * total;
    if (epoch < rise) return float(start + (base - start) * epoch / rise);
    const double f = std::min(1.0, (epoch - rise) / (total - rise));
    return float(end + (base - end) * 0.5 * (1.0 + std::cos(M_PI * f)));
  }
  if (epoch < s.warmup_epochs) {
    const double f = epoch / s.warmup_epochs;
    return float(base * (s.warmup_start_factor + (1.0 - s.warmup_start_factor) * f));
  }
  if (s.type == "cosine") {
    const double f = std::min(1.0, (epoch - s.warmup_epochs) / (total - s.warmup_epochs));
    return float(s.min_lr + (base - s.min_lr) * 0.5 * (1.0 + std::cos(M_PI * f)));
  }
  if (s.type == "multistep") {
    double lr = base;
    for (int m : s.milestones)
      if (epoch >= m) lr *= s.gamma;
    return float(lr);
  }
  return float(base);  // constant
}

}  // namespace et
