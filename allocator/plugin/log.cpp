// log.cpp: the only translation unit that includes spdlog (header-only, hidden; see log.h).
#include "log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <array>
#include <memory>

namespace cachealloc::plugin {
namespace {

spdlog::level::level_enum to_spdlog(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::trace: return spdlog::level::trace;
    case LogLevel::debug: return spdlog::level::debug;
    case LogLevel::info: return spdlog::level::info;
    case LogLevel::warn: return spdlog::level::warn;
    case LogLevel::error: return spdlog::level::err;
    case LogLevel::off: return spdlog::level::off;
  }
  return spdlog::level::warn;
}

/// Our own logger, never registered in spdlog's registry (another spdlog copy in the process
/// could share a name with it). Leaked on purpose: frees during interpreter shutdown may log
/// after static destructors ran.
spdlog::logger& logger() {
  static spdlog::logger* instance = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    auto* l = new spdlog::logger("cachealloc", std::move(sink));
    l->set_pattern("[cachealloc] [%l] %v");
    l->set_level(spdlog::level::warn);
    l->flush_on(spdlog::level::warn);
    return l;
  }();
  return *instance;
}

}  // namespace

bool parse_log_level(std::string_view text, LogLevel& out) noexcept {
  static constexpr std::array<std::pair<std::string_view, LogLevel>, 7> kLevels{{
      {"trace", LogLevel::trace},
      {"debug", LogLevel::debug},
      {"info", LogLevel::info},
      {"warn", LogLevel::warn},
      {"warning", LogLevel::warn},
      {"error", LogLevel::error},
      {"off", LogLevel::off},
  }};
  for (const auto& [name, level] : kLevels) {
    if (text == name) {
      out = level;
      return true;
    }
  }
  return false;
}

void set_log_level(LogLevel level) noexcept {
  try {
    logger().set_level(to_spdlog(level));
  } catch (...) {  // NOLINT(bugprone-empty-catch): logging must never fail the caller
  }
}

void log(LogLevel level, std::string_view message) noexcept {
  try {
    logger().log(to_spdlog(level), "{}", message);
  } catch (...) {  // NOLINT(bugprone-empty-catch): logging must never fail the caller
  }
}

}  // namespace cachealloc::plugin
