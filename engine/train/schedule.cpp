#include "engine/train/schedule.h"

#include <algorithm>
#include <cmath>

namespace et {

float learning_rate(const TrainConfig& t, double epoch, double total) {
  const ScheduleConfig& s = t.schedule;
  const double base = t.lr;
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

float learning_rate(const TrainConfig& t, const QuantConfig& q, double epoch) {
  if (q.fnt_epochs <= 0) return learning_rate(t, epoch);
  const double main = t.epochs - q.fnt_epochs;
  if (epoch < main) return learning_rate(t, epoch, main);
  const double low = learning_rate(t, main, main), peak = q.fnt_peak_lr;
  const double u = std::min(1.0, (epoch - main) / q.fnt_epochs);  // 0 .. 1 over the FNT steps
  return float(low + (peak - low) * (1.0 - std::abs(2.0 * u - 1.0)));
}

}  // namespace et
