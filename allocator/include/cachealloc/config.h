// config.h: CACHEALLOC_CONF, in PYTORCH_CUDA_ALLOC_CONF syntax.
//
//   CACHEALLOC_CONF="policy:native,max_split_size_mb:256,roundup_power2_divisions:[256:1,>:4]"
//
// Entries are `key:value` separated by commas; a value may be a bracketed list whose own commas
// do not split entries. Keys are case-sensitive, whitespace around keys and values is ignored.
// Every consumer (the front end, then the chosen policy) takes the keys it understands with the
// typed getters below; `finish()` then rejects whatever nobody took, naming the valid keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cachealloc {

/// The whole of `text` as a finite number (strtod's syntax), or nullopt: the one number parser
/// of Config::take_double and the command-line options that take numbers.
[[nodiscard]] std::optional<double> parse_finite_double(std::string_view text);

/// `names` as "a, b, c": the list of valid names an error message gives (valid keys, kinds).
[[nodiscard]] std::string join_names(const std::vector<std::string_view>& names);

class Config {
 public:
  Config() = default;
  /// Parses `text`; throws ConfigError on a syntax error or a repeated key.
  static Config parse(std::string_view text);
  /// Parses the environment variable `name` (empty config when unset).
  static Config from_env(const char* name = "CACHEALLOC_CONF");

  /// The policy name (`policy:` key), or `fallback` when absent.
  [[nodiscard]] std::string policy(std::string_view fallback = "size_class") const;

  [[nodiscard]] bool has(std::string_view key) const;
  /// Typed getters: they mark the key as used; a malformed value throws ConfigError.
  std::optional<std::string> take_string(std::string_view key);
  std::optional<bool> take_bool(std::string_view key);  ///< True/False/true/false/1/0
  std::optional<std::int64_t> take_int(std::string_view key, std::int64_t min, std::int64_t max);
  std::optional<double> take_double(std::string_view key, double min, double max);
  /// A size with optional unit: 1048576, 512KB, 64MB, 2GB (binary multiples), or the key's
  /// own unit when the key ends in `_mb` (value in MiB, as PyTorch's max_split_size_mb).
  std::optional<std::size_t> take_bytes(std::string_view key);
  /// A bracketed list `[a:b,c:d]` (or a single scalar, returned as one entry with empty key).
  std::optional<std::vector<std::pair<std::string, std::string>>> take_list(std::string_view key);

  /// Throws ConfigError listing any key nobody took, with the valid keys for `policy`.
  void finish(std::string_view context, const std::vector<std::string_view>& valid_keys) const;

  [[nodiscard]] const std::vector<std::pair<std::string, std::string>>& entries() const noexcept {
    return entries_;
  }
  /// Canonical text form (round-trips through parse()).
  [[nodiscard]] std::string to_string() const;

 private:
  const std::pair<std::string, std::string>* find(std::string_view key) const;
  void mark_used(std::string_view key);

  std::vector<std::pair<std::string, std::string>> entries_;
  std::vector<bool> used_;
};

}  // namespace cachealloc
