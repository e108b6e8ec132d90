// plot.cpp: a dependency-free SVG line chart (see plot.h).
#include "plot.h"

#include <cachealloc/errors.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <cmath>
#include <sstream>

namespace cachealloc::replay {
namespace {

constexpr double kWidth = 1100;
constexpr double kHeight = 560;
constexpr double kLeft = 80;
constexpr double kRight = 230;
constexpr double kTop = 50;
constexpr double kBottom = 60;
const char* const kColors[] = {"#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"};

struct Series {
  std::string label;
  std::string color;
  bool dashed;
  std::vector<std::pair<double, double>> points;  // (fraction of trace, bytes)
};

}  // namespace

void write_plot(const std::string& path, const PreparedTrace& trace,
                const std::vector<PolicyResult>& results) {
  std::vector<Series> series;
  // Recorded native reservations, as a step curve over trace position.
  if (!trace.segments.empty()) {
    Series s{"recorded (PyTorch native)", "#000000", false, {{0.0, 0.0}}};
    double reserved = 0;
    for (const SegmentEntry& e : trace.segments) {
      const double x = static_cast<double>(e.trace_index) / static_cast<double>(trace.trace_events);
      s.points.emplace_back(x, reserved);
      const bool grow = e.action == trace::Action::segment_alloc || e.action == trace::Action::segment_map;
      reserved += grow ? static_cast<double>(e.size) : -static_cast<double>(e.size);
      s.points.emplace_back(x, reserved);
    }
    s.points.emplace_back(1.0, reserved);
    series.push_back(std::move(s));
  }
  std::size_t color = 0;
  const PolicyResult* with_samples = nullptr;
  for (const PolicyResult& r : results) {
    if (r.samples.empty()) {
      continue;
    }
    with_samples = &r;
    Series s{r.name + " reserved", kColors[color++ % 7], false, {}};
    for (const Sample& p : r.samples) {
      s.points.emplace_back(static_cast<double>(p.op_index) / static_cast<double>(trace.ops.size()),
                            static_cast<double>(p.reserved));
    }
    series.push_back(std::move(s));
  }
  if (with_samples != nullptr) {
    Series s{"live (requested) bytes", "#7f7f7f", true, {}};
    for (const Sample& p : with_samples->samples) {
      s.points.emplace_back(static_cast<double>(p.op_index) / static_cast<double>(trace.ops.size()),
                            static_cast<double>(p.requested));
    }
    series.push_back(std::move(s));
  }
  double ymax = 1;
  for (const Series& s : series) {
    for (const auto& [x, y] : s.points) {
      ymax = std::max(ymax, y);
    }
  }
  const double gib = 1024.0 * 1024.0 * 1024.0;
  // A "nice" axis top in GiB.
  double top = ymax / gib;
  double step = 1;
  for (double c : {0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0}) {
    step = c;
    if (top / c <= 8) {
      break;
    }
  }
  top = std::ceil(top / step) * step;
  const double pw = kWidth - kLeft - kRight;
  const double ph = kHeight - kTop - kBottom;
  auto X = [&](double f) { return kLeft + f * pw; };
  auto Y = [&](double bytes) { return kTop + ph - (bytes / gib) / top * ph; };

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kLeft << "\" y=\"28\" font-size=\"16\">" << trace.name
      << ": reserved device memory per policy (simulated replay)</text>\n";
  for (double g = 0; g <= top + 1e-9; g += step) {
    const double y = Y(g * gib);
    svg << "<line x1=\"" << kLeft << "\" y1=\"" << y << "\" x2=\"" << kLeft + pw << "\" y2=\"" << y
        << "\" stroke=\"#e0e0e0\"/>\n<text x=\"" << kLeft - 8 << "\" y=\"" << y + 4
        << "\" text-anchor=\"end\">" << g << "</text>\n";
  }
  for (int i = 0; i <= 10; ++i) {
    const double x = X(i / 10.0);
    svg << "<text x=\"" << x << "\" y=\"" << kTop + ph + 18 << "\" text-anchor=\"middle\">" << i * 10
        << "%</text>\n";
  }
  svg << "<text x=\"" << kLeft + pw / 2 << "\" y=\"" << kHeight - 15
      << "\" text-anchor=\"middle\">position in the trace</text>\n"
      << "<text transform=\"rotate(-90)\" x=\"" << -(kTop + ph / 2) << "\" y=\"22\" text-anchor=\"middle\">GiB</text>\n"
      << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"none\" stroke=\"#444\"/>\n";
  double legend_y = kTop + 10;
  for (const Series& s : series) {
    svg << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.5\""
        << (s.dashed ? " stroke-dasharray=\"5,3\"" : "") << " points=\"";
    for (const auto& [x, y] : s.points) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", X(x), Y(y));
      svg << buf;
    }
    svg << "\"/>\n";
    svg << "<line x1=\"" << kLeft + pw + 12 << "\" y1=\"" << legend_y << "\" x2=\"" << kLeft + pw + 36
        << "\" y2=\"" << legend_y << "\" stroke=\"" << s.color << "\" stroke-width=\"2\""
        << (s.dashed ? " stroke-dasharray=\"5,3\"" : "") << "/>\n<text x=\"" << kLeft + pw + 42
        << "\" y=\"" << legend_y + 4 << "\">" << s.label << "</text>\n";
    legend_y += 20;
  }
  svg << "</svg>\n";

  std::ofstream out(path);
  if (!out) {
    throw Error("cannot write plot file '" + path + "'");
  }
  const bool html = path.size() > 5 && path.substr(path.size() - 5) == ".html";
  if (html) {
    out << "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>" << trace.name
        << "</title></head><body>\n" << svg.str() << "</body></html>\n";
  } else {
    out << svg.str();
  }
}

}  // namespace cachealloc::replay
