// errors.h: the typed errors cachealloc raises (RMM-style small hierarchy).
//
//   Error                 base of everything we throw
//   ├── OutOfMemory       the device (or the configured limit) cannot hold the request
//   ├── ConfigError       a bad CACHEALLOC_CONF key or value
//   ├── UsageError        caller misuse: double free, foreign pointer, wrong device
//   ├── DeviceError       a device call failed for a reason other than out-of-memory
//   └── InvariantError    check_invariants() found corrupted allocator state
//
// Deallocation paths never throw OutOfMemory; UsageError is thrown *before* any state changes,
// so a rejected call leaves the allocator exactly as it was.
#pragma once

#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>

namespace cachealloc {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class OutOfMemory : public Error {
 public:
  explicit OutOfMemory(const std::string& what, std::uint64_t requested_bytes = 0)
      : Error(what), requested_bytes_(requested_bytes) {}
  [[nodiscard]] std::uint64_t requested_bytes() const noexcept { return requested_bytes_; }

 private:
  std::uint64_t requested_bytes_;
};

class ConfigError : public Error {
 public:
  using Error::Error;
};

class UsageError : public Error {
 public:
  using Error::Error;
};

class DeviceError : public Error {
 public:
  explicit DeviceError(const std::string& what, int code = 0) : Error(what), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

class InvariantError : public Error {
 public:
  using Error::Error;
};

}  // namespace cachealloc

/// Throws cachealloc::InvariantError naming the file, line and the broken condition.
#define CACHEALLOC_CHECK_INVARIANT(cond, msg)                                                     \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      throw ::cachealloc::InvariantError(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                                         ": invariant '" #cond "' broken: " + (msg));             \
    }                                                                                             \
  } while (false)
