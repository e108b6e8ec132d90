// log.h: the plugin's logging, behind a narrow interface so that spdlog stays private.
//
// spdlog (and the fmt it uses) is compiled into log.cpp only, header-only and with hidden
// visibility: the plugin lives inside a Python process that already carries PyTorch's own fmt,
// and nothing of ours may clash with it (STYLE.md, practice 7). Messages go to stderr with the
// prefix "[cachealloc] [level]". The level comes from CACHEALLOC_CONF's `log_level`
// (trace, debug, info, warn, error, off; default warn).
#pragma once

#include <string_view>

namespace cachealloc::plugin {

enum class LogLevel : int { trace = 0, debug, info, warn, error, off };

/// Parses a `log_level` value; returns false (and leaves `out` alone) when it is not a level.
bool parse_log_level(std::string_view text, LogLevel& out) noexcept;
void set_log_level(LogLevel level) noexcept;

void log(LogLevel level, std::string_view message) noexcept;
inline void log_error(std::string_view message) noexcept { log(LogLevel::error, message); }
inline void log_warn(std::string_view message) noexcept { log(LogLevel::warn, message); }
inline void log_info(std::string_view message) noexcept { log(LogLevel::info, message); }
inline void log_debug(std::string_view message) noexcept { log(LogLevel::debug, message); }

}  // namespace cachealloc::plugin

/// Per-allocation tracing: compiled away in Release builds (NDEBUG).
#ifdef NDEBUG
#define CACHEALLOC_PLUGIN_TRACE(message) \
  do {                                   \
  } while (false)
#else
#define CACHEALLOC_PLUGIN_TRACE(message) \
  ::cachealloc::plugin::log(::cachealloc::plugin::LogLevel::trace, (message))
#endif
