#include "engine/train/curves.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/check.h"

namespace et {
using json = nlohmann::json;

namespace {

constexpr int kPanelW = 420, kPanelH = 250, kMarginL = 58, kMarginR = 16, kMarginT = 34, kMarginB = 40;
const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// A "nice" tick step (1, 2 or 5 x 10^k) giving about `n` ticks over [lo, hi].
double tick_step(double lo, double hi, int n) {
  const double raw = (hi - lo) / n;
  if (!(raw > 0)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (raw <= m * p) return m * p;
  return 10 * p;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", std::fabs(v) < 1e-12 ? 0.0 : v);
  return buf;
}

struct Series {
  const std::vector<double>* x;
  const std::vector<double>* y;
  const char* color;
  bool dashed;
};

// One panel at (ox, oy): axes, ticks, the series as polylines (and dots, so one epoch shows).
void panel(std::ostringstream& o, int ox, int oy, const std::string& title, const std::vector<Series>& series) {
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const Series& s : series)
    for (size_t i = 0; i < s.y->size(); ++i)
      if (std::isfinite((*s.y)[i])) {
        x0 = std::min(x0, (*s.x)[i]), x1 = std::max(x1, (*s.x)[i]);
        y0 = std::min(y0, (*s.y)[i]), y1 = std::max(y1, (*s.y)[i]);
      }
  const int w = kPanelW - kMarginL - kMarginR, h = kPanelH - kMarginT - kMarginB;
  const int px = ox + kMarginL, py = oy + kMarginT;
  o << "<text x=\"" << px << "\" y=\"" << oy + 20 << "\" font-size=\"13\" font-weight=\"bold\">" << escape(title)
    << "</text>\n";
  o << "<rect x=\"" << px << "\" y=\"" << py << "\" width=\"" << w << "\" height=\"" << h
    << "\" fill=\"none\" stroke=\"#888\"/>\n";
  if (x0 > x1) {
    o << "<text x=\"" << px + 10 << "\" y=\"" << py + h / 2 << "\" font-size=\"11\" fill=\"#888\">no data yet</text>\n";
    return;
  }
  if (x1 - x0 < 1) x0 -= 0.5, x1 += 0.5;
  if (y1 - y0 < 1e-9 * std::max(1.0, std::fabs(y1))) y0 -= 0.5 * std::max(1e-3, std::fabs(y0)), y1 += 0.5 * std::max(1e-3, std::fabs(y1));
  const double ys = tick_step(y0, y1, 5), xs = std::max(1.0, tick_step(x0, x1, 6));
  y0 = std::floor(y0 / ys) * ys, y1 = std::ceil(y1 / ys) * ys;
  auto X = [&](double v) { return px + (v - x0) / (x1 - x0) * w; };
  auto Y = [&](double v) { return py + h - (v - y0) / (y1 - y0) * h; };
  for (double t = y0; t <= y1 + ys * 1e-6; t += ys)
    o << "<line x1=\"" << px << "\" x2=\"" << px + w << "\" y1=\"" << Y(t) << "\" y2=\"" << Y(t)
      << "\" stroke=\"#eee\"/><text x=\"" << px - 4 << "\" y=\"" << Y(t) + 4
      << "\" font-size=\"10\" text-anchor=\"end\">" << num(t) << "</text>\n";
  for (double t = std::ceil(x0 / xs) * xs; t <= x1 + 1e-9; t += xs)
    o << "<text x=\"" << X(t) << "\" y=\"" << py + h + 14 << "\" font-size=\"10\" text-anchor=\"middle\">" << num(t)
      << "</text>\n";
  o << "<text x=\"" << px + w / 2 << "\" y=\"" << py + h + 30 << "\" font-size=\"10\" text-anchor=\"middle\">epoch</text>\n";
  for (const Series& s : series) {
    std::ostringstream pts;
    int n = 0;
    for (size_t i = 0; i < s.y->size(); ++i)
      if (std::isfinite((*s.y)[i])) {
        pts << X((*s.x)[i]) << "," << Y((*s.y)[i]) << " ";
        o << "<circle cx=\"" << X((*s.x)[i]) << "\" cy=\"" << Y((*s.y)[i]) << "\" r=\"2\" fill=\"" << s.color << "\"/>";
        ++n;
      }
    if (n > 1)
      o << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.5\""
        << (s.dashed ? " stroke-dasharray=\"5,3\"" : "") << " points=\"" << pts.str() << "\"/>";
    o << "\n";
  }
}

}  // namespace

RunCurves read_run_curves(const std::string& metrics_path, const std::string& name) {
  std::ifstream in(metrics_path);
  if (!in) user_error("cannot read '", metrics_path, "' (a run folder holds metrics.jsonl)");
  RunCurves r;
  r.name = name;
  for (std::string line; std::getline(in, line);) {
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception&) {
      continue;  // a line cut short by a crash: the next epoch rewrites the file
    }
    if (!j.is_object() || !j.contains("train_loss") || !j.contains("epoch")) continue;  // events
    auto get = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : NAN; };
    r.epoch.push_back(get("epoch"));
    r.train_loss.push_back(get("train_loss"));
    r.test_loss.push_back(get("test_loss"));
    r.train_acc.push_back(get("train_acc"));
    r.test_acc.push_back(get("test_acc"));
    r.lr.push_back(get("lr"));
    r.peak_uss_mb.push_back(get("peak_uss_mb"));
    r.device_mb.push_back(get("device_mb"));
  }
  return r;
}

std::string curves_svg(const std::vector<RunCurves>& runs, const std::string& title) {
  const int legend_h = 18 * int(runs.size()) + 26;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << 2 * kPanelW << "\" height=\""
    << 2 * kPanelH + 30 + legend_h << "\" font-family=\"sans-serif\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"10\" y=\"20\" font-size=\"15\" font-weight=\"bold\">" << escape(title) << "</text>\n";
  auto series = [&](std::vector<double> RunCurves::*train, std::vector<double> RunCurves::*test) {
    std::vector<Series> s;
    for (size_t i = 0; i < runs.size(); ++i) {
      const char* c = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
      if (train) s.push_back({&runs[i].epoch, &(runs[i].*train), c, true});
      if (test) s.push_back({&runs[i].epoch, &(runs[i].*test), c, false});
    }
    return s;
  };
  panel(o, 0, 30, "loss (train dashed, test solid)", series(&RunCurves::train_loss, &RunCurves::test_loss));
  panel(o, kPanelW, 30, "accuracy (train dashed, test solid)", series(&RunCurves::train_acc, &RunCurves::test_acc));
  panel(o, 0, 30 + kPanelH, "learning rate (end of epoch)", series(nullptr, &RunCurves::lr));
  panel(o, kPanelW, 30 + kPanelH, "peak USS per epoch, MB (GPU memory dashed)",
        series(&RunCurves::device_mb, &RunCurves::peak_uss_mb));
  int y = 2 * kPanelH + 50;
  for (size_t i = 0; i < runs.size(); ++i, y += 18) {
    const char* c = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    const RunCurves& r = runs[i];
    const double best = r.test_acc.empty() ? NAN : *std::max_element(r.test_acc.begin(), r.test_acc.end());
    o << "<rect x=\"12\" y=\"" << y - 10 << "\" width=\"14\" height=\"10\" fill=\"" << c << "\"/><text x=\"32\" y=\""
      << y << "\" font-size=\"12\">" << escape(r.name) << ": " << r.epoch.size() << " epochs"
      << (r.test_acc.empty() ? "" : ", last test acc " + num(std::round(r.test_acc.back() * 1e4) / 1e4) +
                                         ", best " + num(std::round(best * 1e4) / 1e4))
      << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

std::string run_name(const std::string& run_dir) {
  std::string s = run_dir;
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  const size_t slash = s.find_last_of('/');
  return slash == std::string::npos ? s : s.substr(slash + 1);
}

void write_run_curves(const std::string& run_dir, const std::string& title) {
  const std::string path = run_dir + "/curves.svg", tmp = path + ".tmp";
  const std::string svg = curves_svg({read_run_curves(run_dir + "/metrics.jsonl", title)}, title);
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << svg;
    if (!out) user_error("cannot write '", tmp, "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) user_error("cannot write '", path, "'");
}

}  // namespace et
