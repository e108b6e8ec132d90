// entry_points.cpp: the C ABI (plugin_api.h) over the Runtime; compiled twice.
//
// With CACHEALLOC_PLUGIN_WITH_TORCH (libcachealloc_plugin.so) the allocation hooks turn our
// errors into PyTorch's: cachealloc::OutOfMemory becomes c10::OutOfMemoryError with advice on
// CACHEALLOC_CONF appended, everything else c10::Error. Without it (libcachealloc_capi.so) the
// hooks catch everything and report through cachealloc_last_error(). This is the only file that
// sees a PyTorch header, and it includes no spdlog (log.h is a plain interface), so PyTorch's
// bundled fmt and ours never meet in one translation unit.
//
// Note [Exceptions inside, a C ABI at the edge]
// Every entry point catches everything. The PyTorch hooks then rethrow a c10 exception, which
// crosses the C frame into PyTorch's C++ caller (CUDAPluggableAllocator::malloc), which is how
// PyTorch's own allocators report failures; Python shows torch.OutOfMemoryError. free never
// throws (PyTorch calls it from DataPtr deleters, inside destructors).
#include "plugin_api.h"

#include "log.h"
#include "runtime.h"

#include <cachealloc/errors.h>
#include <cachealloc/hot_pages.h>
#include <cachealloc/policies/registry.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#ifdef CACHEALLOC_PLUGIN_WITH_TORCH
#include <c10/util/Exception.h>
#endif

namespace {

using cachealloc::plugin::Runtime;

enum ErrorCode : int { kOk = 0, kOutOfMemory = 1, kConfig = 2, kUsage = 3, kDevice = 4, kOther = 5 };

thread_local std::string t_last_error;
thread_local int t_last_error_code = kOk;
thread_local std::string t_policy_name;

void set_error(int code, std::string_view message) noexcept {
  try {
    t_last_error.assign(message);
  } catch (...) {  // NOLINT(bugprone-empty-catch): out of host memory; the code still says what
  }
  t_last_error_code = code;
}

/// Records the exception being handled as the thread's last error; returns its code.
int remember_current_exception() noexcept {
  try {
    throw;
  } catch (const cachealloc::OutOfMemory& e) {
    set_error(kOutOfMemory, e.what());
  } catch (const cachealloc::ConfigError& e) {
    set_error(kConfig, e.what());
  } catch (const cachealloc::UsageError& e) {
    set_error(kUsage, e.what());
  } catch (const cachealloc::DeviceError& e) {
    set_error(kDevice, e.what());
  } catch (const std::bad_alloc&) {
    set_error(kOther, "cachealloc: out of host memory");
  } catch (const std::exception& e) {
    set_error(kOther, e.what());
  } catch (...) {
    set_error(kOther, "cachealloc: unknown error");
  }
  return t_last_error_code;
}

cachealloc::StreamId stream_id(void* stream) noexcept {
  return static_cast<cachealloc::StreamId>(reinterpret_cast<std::uintptr_t>(stream));
}

/// In the PyTorch plugin: raises the thread's last error as a c10 exception (the hooks call it
/// from their catch blocks). In the C API library: does nothing.
void raise_last_error_for_torch([[maybe_unused]] int code) {
#ifdef CACHEALLOC_PLUGIN_WITH_TORCH
  std::string message = t_last_error;
  if (code == kOutOfMemory) {
    if (Runtime* rt = Runtime::existing()) {
      message += cachealloc::plugin::out_of_memory_advice(rt->settings(), rt->conf_text());
    }
    C10_THROW_ERROR(OutOfMemoryError, message);
  }
  C10_THROW_ERROR(Error, message);
#endif
}

/// Copies `text` to `buf` (snprintf-like) and returns its length.
std::int64_t copy_out(const std::string& text, char* buf, std::size_t len) noexcept {
  if (buf != nullptr && len > 0) {
    const std::size_t n = text.size() < len - 1 ? text.size() : len - 1;
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return static_cast<std::int64_t>(text.size());
}

void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += esc;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

}  // namespace

// ---- CUDAPluggableAllocator hooks -----------------------------------------------------------

extern "C" void* cachealloc_alloc(size_t size, int device, void* stream) {
  try {
    return Runtime::get().allocate(size, device, stream_id(stream));
  } catch (...) {
    const int code = remember_current_exception();
    if (code != kOutOfMemory) {
      cachealloc::plugin::log_error(t_last_error);
    }
    raise_last_error_for_torch(code);
    return nullptr;
  }
}

extern "C" void cachealloc_free(void* ptr, size_t /*size*/, int device, void* /*stream*/) {
  try {
    Runtime::get().deallocate(ptr, device);
  } catch (...) {
    remember_current_exception();
    cachealloc::plugin::log_error(t_last_error + " (the free was ignored)");
  }
}

extern "C" void cachealloc_init(int device_count) {
  try {
    Runtime& rt = Runtime::get();
    if (device_count != rt.device_count()) {
      cachealloc::plugin::log_warn("PyTorch sees " + std::to_string(device_count) + " device(s), cachealloc " +
                                   std::to_string(rt.device_count()));
    }
  } catch (...) {
    const int code = remember_current_exception();
    cachealloc::plugin::log_error(t_last_error);
    raise_last_error_for_torch(code);
  }
}

extern "C" void cachealloc_reset(void) {
  try {
    if (Runtime* rt = Runtime::existing()) {
      rt->empty_cache(-1);
    }
  } catch (...) {
    const int code = remember_current_exception();
    raise_last_error_for_torch(code);
  }
}

extern "C" void cachealloc_set_memory_fraction(double fraction, int device) {
  try {
    Runtime::get().set_memory_fraction(fraction, device);
  } catch (...) {
    const int code = remember_current_exception();
    raise_last_error_for_torch(code);
  }
}

extern "C" void cachealloc_record_stream(void* ptr, void* stream) {
  try {
    Runtime::get().record_stream(ptr, stream_id(stream));
  } catch (...) {
    const int code = remember_current_exception();
    raise_last_error_for_torch(code);
  }
}

extern "C" void* cachealloc_base_alloc(void* ptr, size_t* size) {
  try {
    return Runtime::get().base_allocation(ptr, size);
  } catch (...) {
    const int code = remember_current_exception();
    raise_last_error_for_torch(code);
    return nullptr;
  }
}

// ---- Python package API ----------------------------------------------------------------------

extern "C" int64_t cachealloc_memory_stats_json(int device, char* buf, size_t len) {
  try {
    Runtime& rt = Runtime::get();
    std::string json = "{";
    for (const auto& [key, value] : rt.stats_map(device < 0 ? 0 : device)) {
      if (json.size() > 1) {
        json += ", ";
      }
      append_json_string(json, key);
      json += ": ";
      json += std::to_string(value);
    }
    json += "}";
    return copy_out(json, buf, len);
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" int64_t cachealloc_policy_report_json(int device, char* buf, size_t len) {
  try {
    Runtime& rt = Runtime::get();
    const cachealloc::DeviceAllocator* a = rt.allocator_if_created(device < 0 ? 0 : device);
    return copy_out(a != nullptr ? a->policy_report_json() : std::string("{}"), buf, len);
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

// Note [Bookkeeping on few pages] (hot_pages.h): the regions the allocator's bookkeeping lives on,
// and how much of them the kernel backs with huge pages (read from /proc/self/smaps: a
// diagnostic, too slow for memory_stats).
extern "C" int64_t cachealloc_hot_pages_json(char* buf, size_t len) {
  try {
    const cachealloc::hot::Usage u = cachealloc::hot::usage();
    std::string json = "{\"mode\": ";
    append_json_string(json, cachealloc::hot::mode_name(u.mode));
    json += ", \"regions\": " + std::to_string(u.regions);
    json += ", \"region_bytes\": " + std::to_string(cachealloc::hot::kRegionBytes);
    json += ", \"bytes_in_use\": " + std::to_string(u.bytes_in_use);
    json += ", \"bytes_carved\": " + std::to_string(u.bytes_carved);
    json += ", \"fallback_allocations\": " + std::to_string(u.fallback_allocations);
    json += ", \"huge_bytes\": ";
    json += u.huge_bytes_known ? std::to_string(u.huge_bytes) : std::string("null");
    json += "}";
    return copy_out(json, buf, len);
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" int64_t cachealloc_policies_json(char* buf, size_t len) {
  try {
    std::string json = "[";
    for (const cachealloc::PolicyInfo& p : cachealloc::registered_policies()) {
      if (json.size() > 1) {
        json += ", ";
      }
      json += "{\"name\": ";
      append_json_string(json, p.name);
      json += ", \"summary\": ";
      append_json_string(json, p.summary);
      json += ", \"backend\": ";
      append_json_string(json, cachealloc::backend_kind(p.backend));
      json += ", \"replay_only\": ";
      json += p.replay_only ? "true" : "false";
      json += ", \"config_keys\": [";
      bool first = true;
      for (std::string_view k : p.config_keys()) {
        json += first ? "" : ", ";
        first = false;
        append_json_string(json, k);
      }
      json += "]}";
    }
    json += "]";
    return copy_out(json, buf, len);
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" int cachealloc_reset_peak(int device) {
  try {
    if (Runtime* rt = Runtime::existing()) {
      rt->reset_peak(device);
    }
    return 0;
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" int cachealloc_reset_accumulated(int device) {
  try {
    if (Runtime* rt = Runtime::existing()) {
      rt->reset_accumulated(device);
    }
    return 0;
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" int cachealloc_empty_cache(int device) {
  try {
    if (Runtime* rt = Runtime::existing()) {
      rt->empty_cache(device);
    }
    return 0;
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" int cachealloc_dump_snapshot(const char* path) {
  try {
    if (path == nullptr || *path == '\0') {
      throw cachealloc::UsageError("cachealloc_dump_snapshot: empty path");
    }
    Runtime::get().dump_snapshot(path);
    return 0;
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" uint64_t cachealloc_allocator_ns(int device) {
  try {
    Runtime* rt = Runtime::existing();
    return rt != nullptr ? rt->allocator_ns(device) : 0;
  } catch (...) {
    remember_current_exception();
    return 0;
  }
}

extern "C" int cachealloc_validate_config(const char* conf) {
  try {
    if (conf != nullptr) {
      (void)cachealloc::plugin::validate_config(conf);
      return 0;
    }
    const char* env = std::getenv("CACHEALLOC_CONF");
    try {
      (void)cachealloc::plugin::validate_config(env != nullptr ? env : "");
    } catch (const cachealloc::ConfigError& e) {
      throw cachealloc::ConfigError(std::string(e.what()) + " (from the environment variable CACHEALLOC_CONF)");
    }
    return 0;
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" int cachealloc_check_invariants(int device) {
  try {
    if (Runtime* rt = Runtime::existing()) {
      rt->check_invariants(device);
    }
    return 0;
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" const char* cachealloc_policy_name(void) {
  try {
    if (Runtime* rt = Runtime::existing()) {
      return rt->settings().policy.c_str();
    }
    const char* env = std::getenv("CACHEALLOC_CONF");
    t_policy_name = cachealloc::plugin::validate_config(env != nullptr ? env : "").policy;
    return t_policy_name.c_str();
  } catch (...) {
    remember_current_exception();
    return "";
  }
}

extern "C" int cachealloc_device_count(void) {
  try {
    return Runtime::get().device_count();
  } catch (...) {
    remember_current_exception();
    return -1;
  }
}

extern "C" int cachealloc_is_active(void) { return Runtime::existing() != nullptr ? 1 : 0; }

extern "C" int cachealloc_is_torch_plugin(void) {
#ifdef CACHEALLOC_PLUGIN_WITH_TORCH
  return 1;
#else
  return 0;
#endif
}

extern "C" const char* cachealloc_last_error(void) { return t_last_error.c_str(); }

extern "C" int cachealloc_last_error_code(void) { return t_last_error_code; }

extern "C" void cachealloc_clear_error(void) {
  t_last_error.clear();
  t_last_error_code = kOk;
}

extern "C" const char* cachealloc_version(void) { return CACHEALLOC_PLUGIN_VERSION; }
