// Progress display: on a terminal one live line rewritten in place (epoch, step, loss, accuracy,
// img/s, ETA, memory); otherwise plain lines every `plain_every` steps, for logs.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace et {

struct StepStatus {
  int epoch = 0, epochs = 0;
  int64_t step = 0, steps = 0;
  double loss = 0, acc = 0, img_per_s = 0, eta_s = 0, lr = 0;
  double uss_mb = -1;  // peak USS so far; < 0: unavailable (no /proc)
};

class Progress {
 public:
  explicit Progress(FILE* out = stdout);
  void step(const StepStatus& s);
  void line(const std::string& text);  // a permanent line (clears a live line first)
  bool is_tty() const { return tty_; }

 private:
  FILE* out_;
  bool tty_;
  bool live_ = false;
  int64_t plain_every_ = 50;
};

std::string format_duration(double seconds);  // "1h02m", "3m05s", "12s"

}  // namespace et
