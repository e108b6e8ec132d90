// factory.cpp: the CUDA backends by name, and device queries (see factory.h).
#include <cachealloc/config.h>
#include <cachealloc/cuda/async_backend.h>
#include <cachealloc/cuda/event_thread.h>
#include <cachealloc/cuda/factory.h>
#include <cachealloc/cuda/runtime_backend.h>
#include <cachealloc/cuda/vmm_backend.h>
#include <cachealloc/errors.h>

#include "cuda_check.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>

namespace cachealloc {

std::optional<EventThread> parse_event_thread(std::string_view text) noexcept {
  if (text == "off" || text == "0") {
    return EventThread::off;
  }
  if (text == "records" || text == "1") {
    return EventThread::records;
  }
  if (text == "poll") {
    return EventThread::poll;
  }
  return std::nullopt;
}

EventThread take_event_thread(Config& config, EventThread fallback) {
  EventThread mode = fallback;
  if (auto v = config.take_string("event_thread")) {
    const auto parsed = parse_event_thread(*v);
    if (!parsed) {
      throw ConfigError("CACHEALLOC_CONF: 'event_thread' expects off, records or poll, got '" + *v + "'");
    }
    mode = *parsed;
  }
  // Note [Watching events by default on virtual memory]: the variable overrides the key.
  if (const char* env = std::getenv("CACHEALLOC_EVENT_THREAD"); env != nullptr && *env != '\0') {
    const auto parsed = parse_event_thread(env);
    if (!parsed) {
      throw ConfigError(std::string("CACHEALLOC_EVENT_THREAD expects 0, off, 1, records or poll, got '") + env +
                        "' (unset it to use CACHEALLOC_CONF's event_thread)");
    }
    mode = *parsed;
  }
  return mode;
}

std::vector<std::string_view> cuda_backend_kinds() {
  return {"runtime", "virtual_memory", "stream_ordered"};
}

std::vector<std::string_view> cuda_backend_config_keys(std::string_view kind) {
  if (kind == "stream_ordered") {
    return CudaAsyncBackend::config_keys();
  }
  if (kind == "virtual_memory") {
    return CudaVmmBackend::config_keys();
  }
  if (kind == "runtime") {
    return {"event_thread"};
  }
  return {};
}

namespace {

/// cuda_runtime's only key (it has no options struct): Note [Watching events by default on
/// virtual memory] keeps it off there.
EventThread runtime_event_thread(Config& config) { return take_event_thread(config, EventThread::off); }

[[noreturn]] void throw_unknown_kind(std::string_view kind) {
  throw ConfigError("unknown CUDA backend kind '" + std::string(kind) +
                    "'; valid kinds: " + join_names(cuda_backend_kinds()));
}

}  // namespace

void check_cuda_backend_config(std::string_view kind, Config& config) {
  if (kind == "runtime") {
    (void)runtime_event_thread(config);
  } else if (kind == "virtual_memory") {
    (void)CudaVmmOptions::from_config(config);
  } else if (kind == "stream_ordered") {
    (void)CudaAsyncOptions::from_config(config);
  } else {
    throw_unknown_kind(kind);
  }
}

std::unique_ptr<DeviceBackend> make_cuda_backend(std::string_view kind, int device, Config& config) {
  if (kind == "runtime") {
    return std::make_unique<CudaRuntimeBackend>(device, runtime_event_thread(config));
  }
  if (kind == "virtual_memory") {
    return std::make_unique<CudaVmmBackend>(device, CudaVmmOptions::from_config(config));
  }
  if (kind == "stream_ordered") {
    return std::make_unique<CudaAsyncBackend>(device, CudaAsyncOptions::from_config(config));
  }
  throw_unknown_kind(kind);
}

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // cudaErrorNoDevice / cudaErrorInsufficientDriver: no GPU here
    return 0;
  }
  return count;
}

std::string cuda_device_name(int device) {
  cudaDeviceProp prop{};
  CACHEALLOC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

}  // namespace cachealloc
