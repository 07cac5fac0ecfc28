#include "engine/train/progress.h"

#include <unistd.h>

namespace et {

Progress::Progress(FILE* out) : out_(out), tty_(isatty(fileno(out)) != 0) {}

std::string format_duration(double s) {
  char buf[32];
  const long t = long(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof(buf), "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else if (t >= 60) std::snprintf(buf, sizeof(buf), "%ldm%02lds", t / 60, t % 60);
  else std::snprintf(buf, sizeof(buf), "%lds", t);
  return buf;
}

void Progress::step(const StepStatus& s) {
  char buf[256], uss[32];
  if (s.uss_mb >= 0) std::snprintf(uss, sizeof(uss), "%.0f MB", s.uss_mb);
  else std::snprintf(uss, sizeof(uss), "unavailable");
  std::snprintf(buf, sizeof(buf), "epoch %d/%d step %lld/%lld loss %.4f acc %.3f lr %.4g %.0f img/s ETA %s USS %s",
                s.epoch, s.epochs, (long long)s.step, (long long)s.steps, s.loss, s.acc, s.lr, s.img_per_s,
                format_duration(s.eta_s).c_str(), uss);
  if (tty_) {
    std::fprintf(out_, "\r\033[K%s", buf);
    live_ = true;
  } else if (s.step % plain_every_ == 0 || s.step == s.steps) {
    std::fprintf(out_, "%s\n", buf);
  }
  std::fflush(out_);
}

void Progress::line(const std::string& text) {
  if (live_) std::fprintf(out_, "\r\033[K");
  live_ = false;
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

}  // namespace et
