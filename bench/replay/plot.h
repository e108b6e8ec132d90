// plot.h: an SVG (or HTML-wrapped SVG) chart of reserved and live bytes over a replay.
#pragma once

#include "replay.h"

#include <string>
#include <vector>

namespace cachealloc::replay {

/// Draws every policy's reserved bytes, the live requested bytes and the recorded native curve
/// on one chart. `.html` wraps the SVG in a page; anything else is written as SVG.
void write_plot(const std::string& path, const PreparedTrace& trace,
                const std::vector<PolicyResult>& results);

}  // namespace cachealloc::replay
