// config.cpp: parsing CACHEALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF syntax) and typed getters.
#include <cachealloc/config.h>
#include <cachealloc/errors.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

namespace cachealloc {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())) != 0) {
    s.remove_prefix(1);
  }
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())) != 0) {
    s.remove_suffix(1);
  }
  return s;
}

std::string shown(std::string_view text) { return "'" + std::string(text) + "'"; }

}  // namespace

Config Config::parse(std::string_view text) {
  Config config;
  std::size_t pos = 0;
  const std::string where = "CACHEALLOC_CONF=" + shown(text);
  while (pos <= text.size()) {
    // One entry runs to the next comma outside brackets.
    std::size_t end = pos;
    int depth = 0;
    while (end < text.size() && (text[end] != ',' || depth > 0)) {
      if (text[end] == '[') {
        ++depth;
      } else if (text[end] == ']') {
        if (--depth < 0) {
          throw ConfigError(where + ": unbalanced ']' at character " + std::to_string(end));
        }
      }
      ++end;
    }
    if (depth != 0) {
      throw ConfigError(where + ": '[' at entry starting at character " + std::to_string(pos) +
                        " is never closed");
    }
    const std::string_view entry = trim(text.substr(pos, end - pos));
    if (!entry.empty()) {
      const std::size_t colon = entry.find(':');
      if (colon == std::string_view::npos) {
        throw ConfigError(where + ": entry " + shown(entry) +
                          " has no ':'; write key:value, e.g. policy:size_class");
      }
      const std::string key(trim(entry.substr(0, colon)));
      const std::string value(trim(entry.substr(colon + 1)));
      if (key.empty()) {
        throw ConfigError(where + ": entry " + shown(entry) + " has an empty key");
      }
      if (value.empty()) {
        throw ConfigError(where + ": key " + shown(key) + " has an empty value");
      }
      if (config.find(key) != nullptr) {
        throw ConfigError(where + ": key " + shown(key) + " is given twice");
      }
      config.entries_.emplace_back(key, value);
      config.used_.push_back(false);
    }
    if (end >= text.size()) {
      break;
    }
    pos = end + 1;
  }
  return config;
}

Config Config::from_env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) {
    return {};
  }
  try {
    return parse(value);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) + " (from the environment variable " + name + ")");
  }
}

const std::pair<std::string, std::string>* Config::find(std::string_view key) const {
  for (const auto& e : entries_) {
    if (e.first == key) {
      return &e;
    }
  }
  return nullptr;
}

void Config::mark_used(std::string_view key) {
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].first == key) {
      used_[i] = true;
    }
  }
}

std::string Config::policy(std::string_view fallback) const {
  const auto* e = find("policy");
  return e != nullptr ? e->second : std::string(fallback);
}

bool Config::has(std::string_view key) const { return find(key) != nullptr; }

std::optional<std::string> Config::take_string(std::string_view key) {
  const auto* e = find(key);
  if (e == nullptr) {
    return std::nullopt;
  }
  mark_used(key);
  return e->second;
}

std::optional<bool> Config::take_bool(std::string_view key) {
  const auto* e = find(key);
  if (e == nullptr) {
    return std::nullopt;
  }
  mark_used(key);
  const std::string& v = e->second;
  if (v == "True" || v == "true" || v == "1") {
    return true;
  }
  if (v == "False" || v == "false" || v == "0") {
    return false;
  }
  throw ConfigError("CACHEALLOC_CONF: " + shown(key) + " expects True or False, got " + shown(v));
}

std::optional<std::int64_t> Config::take_int(std::string_view key, std::int64_t min,
                                             std::int64_t max) {
  const auto* e = find(key);
  if (e == nullptr) {
    return std::nullopt;
  }
  mark_used(key);
  const std::string& v = e->second;
  std::int64_t value = 0;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
  if (ec != std::errc{} || ptr != v.data() + v.size()) {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) + " expects an integer, got " + shown(v));
  }
  if (value < min || value > max) {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) + " must be between " + std::to_string(min) +
                      " and " + std::to_string(max) + ", got " + v);
  }
  return value;
}

std::optional<double> parse_finite_double(std::string_view text) {
  const std::string v(text);  // strtod needs the terminating zero
  char* end = nullptr;
  const double value = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(value)) {
    return std::nullopt;
  }
  return value;
}

std::optional<double> Config::take_double(std::string_view key, double min, double max) {
  const auto* e = find(key);
  if (e == nullptr) {
    return std::nullopt;
  }
  mark_used(key);
  const std::string& v = e->second;
  const std::optional<double> parsed = parse_finite_double(v);
  if (!parsed) {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) + " expects a number, got " + shown(v));
  }
  const double value = *parsed;
  if (value < min || value > max) {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) + " must be between " + std::to_string(min) +
                      " and " + std::to_string(max) + ", got " + v);
  }
  return value;
}

std::optional<std::size_t> Config::take_bytes(std::string_view key) {
  const auto* e = find(key);
  if (e == nullptr) {
    return std::nullopt;
  }
  mark_used(key);
  const std::string& v = e->second;
  std::uint64_t number = 0;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), number);
  if (ec != std::errc{} || ptr == v.data()) {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) +
                      " expects a size such as 512MB, 2GB or a byte count, got " + shown(v));
  }
  std::string unit(ptr, v.data() + v.size());
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  std::uint64_t multiplier = 1;
  const bool mb_key = key.size() > 3 && key.substr(key.size() - 3) == "_mb";
  const bool gb_key = key.size() > 3 && key.substr(key.size() - 3) == "_gb";
  if (unit.empty()) {
    multiplier = mb_key ? (1ull << 20) : gb_key ? (1ull << 30) : 1;
  } else if (unit == "B") {
    multiplier = 1;
  } else if (unit == "KB" || unit == "KIB") {
    multiplier = 1ull << 10;
  } else if (unit == "MB" || unit == "MIB") {
    multiplier = 1ull << 20;
  } else if (unit == "GB" || unit == "GIB") {
    multiplier = 1ull << 30;
  } else {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) + ": unknown unit " + shown(unit) +
                      " (use B, KB, MB or GB)");
  }
  if (number > (~std::uint64_t{0}) / multiplier) {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) + ": " + shown(v) + " is too large");
  }
  return static_cast<std::size_t>(number * multiplier);
}

std::optional<std::vector<std::pair<std::string, std::string>>> Config::take_list(
    std::string_view key) {
  const auto* e = find(key);
  if (e == nullptr) {
    return std::nullopt;
  }
  mark_used(key);
  std::string_view v = e->second;
  std::vector<std::pair<std::string, std::string>> out;
  if (v.empty() || v.front() != '[') {
    out.emplace_back("", std::string(v));
    return out;
  }
  if (v.back() != ']') {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) + ": list " + shown(v) +
                      " must end with ']'");
  }
  v = v.substr(1, v.size() - 2);
  std::size_t pos = 0;
  while (pos <= v.size()) {
    std::size_t end = v.find(',', pos);
    if (end == std::string_view::npos) {
      end = v.size();
    }
    const std::string_view item = trim(v.substr(pos, end - pos));
    if (!item.empty()) {
      const std::size_t colon = item.find(':');
      if (colon == std::string_view::npos) {
        throw ConfigError("CACHEALLOC_CONF: " + shown(key) + ": list item " + shown(item) +
                          " must be key:value, e.g. [256:1,>:4]");
      }
      out.emplace_back(std::string(trim(item.substr(0, colon))),
                       std::string(trim(item.substr(colon + 1))));
    }
    if (end >= v.size()) {
      break;
    }
    pos = end + 1;
  }
  if (out.empty()) {
    throw ConfigError("CACHEALLOC_CONF: " + shown(key) + ": empty list");
  }
  return out;
}

std::string join_names(const std::vector<std::string_view>& names) {
  std::string out;
  for (std::string_view n : names) {
    out += out.empty() ? "" : ", ";
    out += n;
  }
  return out;
}

void Config::finish(std::string_view context,
                    const std::vector<std::string_view>& valid_keys) const {
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (used_[i]) {
      continue;
    }
    throw ConfigError("CACHEALLOC_CONF: unknown key " + shown(entries_[i].first) + " for " +
                      std::string(context) + "; valid keys: " + join_names(valid_keys) +
                      " (see README.md, section Configuration)");
  }
}

std::string Config::to_string() const {
  std::string out;
  for (const auto& [k, v] : entries_) {
    out += out.empty() ? "" : ",";
    out += k + ":" + v;
  }
  return out;
}

}  // namespace cachealloc
