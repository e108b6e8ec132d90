// runtime.h: the plugin's process-wide state, free of any PyTorch header.
//
// One Runtime per process (created on first use, never destroyed: frees arrive during
// interpreter shutdown, after static destructors would have run). It holds the parsed
// CACHEALLOC_CONF, one DeviceAllocator per device (created lazily and thread-safely on the
// device's first use), the allocator-time counters, and the trace recorder. entry_points.cpp
// turns these C++ calls (which throw cachealloc::Error subclasses) into the C ABI: PyTorch
// errors in the LibTorch plugin, return codes in the torch-free C API library.
//
// Note [Which backend]
// The policy's registry entry says what it needs (BackendNeed); the runtime asks
// make_cuda_backend() for that kind. For GPU-free tests of the C API, the environment variable
// CACHEALLOC_PLUGIN_BACKEND=sim puts the simulated backend underneath instead (events complete
// at once; CACHEALLOC_PLUGIN_SIM_DEVICES devices, default 1, of CACHEALLOC_PLUGIN_SIM_CAPACITY_MB
// each, default an H200's 143771 MiB). It is not a CACHEALLOC_CONF key on purpose: it is not a
// setting anyone should ship.
//
// Note [Config validation]
// validate_config() checks CACHEALLOC_CONF without touching a device: key names against the
// front end's, the policy's and its CUDA backend's keys (Config::finish lists the valid ones),
// then values by building the policy over a simulated backend (stream-ordered policies are
// checked by name only, and their backend's values by CudaAsyncOptions::from_config; the
// virtual-memory backend's by CudaVmmOptions::from_config). The
// runtime runs the same validation when it starts, so a bad key fails at CUDA initialisation
// (the plugin's init hook) or at enable(), never at some later allocation.
#pragma once

#include "recorder.h"
#include "tick_clock.h"

#include <cachealloc/allocator.h>
#include <cachealloc/config.h>
#include <cachealloc/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

namespace cachealloc::plugin {

/// Front-end settings taken from CACHEALLOC_CONF (registry.h: front_end_config_keys()).
struct FrontEndSettings {
  std::string policy = "size_class";
  std::string backend_kind = "runtime";  ///< make_cuda_backend kind the policy needs
  bool timing = true;                    ///< count ns inside alloc/free (`timing:False` turns off)
  std::optional<std::string> record_path;  ///< `record:PATH`; "%p" becomes the process id
  std::size_t record_max_entries = 0;      ///< 0 = unlimited
  std::string log_level = "warn";
  /// `full:True`: the Python package installs the LibTorch adapter (libcachealloc_torch.so)
  /// instead of the pluggable allocator. The runtime itself ignores it.
  bool full = false;
};

/// What an embedding front end (the LibTorch adapter) adds to every device allocator the
/// runtime creates. Both are optional; set them with Runtime::configure() before first use.
struct RuntimeHooks {
  /// Wraps the backend of a policy that does not need a stream-ordered backend (the adapter puts
  /// its CUDA-graph-capture guard there), before the recording adaptor.
  std::function<std::unique_ptr<DeviceBackend>(std::unique_ptr<DeviceBackend>)> wrap_backend;
  /// Called, besides the recorder, for every front-end event, under the allocator's lock.
  std::function<void(int device, AllocatorEvent event, std::uintptr_t addr, std::size_t size,
                     StreamId stream)>
      observer;
};

/// Parses and checks `text` (Note [Config validation]); throws ConfigError. Never touches a device.
FrontEndSettings validate_config(std::string_view text);

/// The segment holding `ptr` among `allocator`'s (its length in `*size`), or, for a policy that
/// cannot list segments, the live block itself; nullptr when `ptr` is not in `allocator`.
void* find_base_allocation(const DeviceAllocator& allocator, const void* ptr, std::size_t* size);

/// Settings that may help after an out-of-memory error under `settings` (for the message).
std::string out_of_memory_advice(const FrontEndSettings& settings, const std::string& conf_text);

class Runtime {
 public:
  /// The process's runtime; the first call reads CACHEALLOC_CONF (or what configure() set) and validates it (throws
  /// ConfigError, and a later call tries again). Thread-safe.
  static Runtime& get();
  /// Makes the runtime, when it is created, use `conf_text` instead of the environment variable
  /// CACHEALLOC_CONF, and `hooks`. Validates `conf_text` at once (ConfigError) without touching
  /// a device; throws UsageError once the runtime exists. Thread-safe.
  static void configure(std::string conf_text, RuntimeHooks hooks);
  /// The runtime if it was created already, else nullptr. Never throws.
  static Runtime* existing() noexcept;

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // ---- the allocation hooks (throw cachealloc::Error subclasses) ----
  [[nodiscard]] void* allocate(std::size_t bytes, int device, StreamId stream);
  /// Throws UsageError for a pointer that is not a live allocation (nothing changes then).
  void deallocate(void* ptr, int device);
  void record_stream(void* ptr, StreamId stream);
  /// The segment holding `ptr` (its base and, in `size`, its length). Throws UsageError.
  void* base_allocation(void* ptr, std::size_t* size);
  void set_memory_fraction(double fraction, int device);
  /// empty_cache on `device`, or on every device in use when device < 0.
  void empty_cache(int device);
  void reset_peak(int device);
  void reset_accumulated(int device);
  void check_invariants(int device);

  // ---- statistics and snapshots ----
  /// Stats::to_map() plus alloc_ns, free_ns and allocator_ns (zeros for an unused device).
  [[nodiscard]] std::map<std::string, std::int64_t> stats_map(int device);
  [[nodiscard]] std::uint64_t allocator_ns(int device);
  /// Writes the recorded trace (empty when recording is off) and the current segments as a
  /// PyTorch snapshot; `.xz` names are compressed. Throws trace::TraceError.
  void dump_snapshot(const std::string& path);
  /// Writes the snapshot to the `record:` path if recording (at exit). Never throws.
  void write_recording_at_exit() noexcept;

  [[nodiscard]] const FrontEndSettings& settings() const noexcept { return settings_; }
  [[nodiscard]] const std::string& conf_text() const noexcept { return conf_text_; }
  [[nodiscard]] int device_count() const noexcept { return device_count_; }
  [[nodiscard]] bool recording() const noexcept { return recorder_ != nullptr; }
  /// The allocator of `device` if it was created, else nullptr.
  [[nodiscard]] DeviceAllocator* allocator_if_created(int device) const noexcept;
  /// The allocator of `device`, created on first use. Throws like allocate().
  [[nodiscard]] DeviceAllocator& allocator(int device);
  /// A new allocator for `device` with the runtime's policy, backend, recording and hooks, not
  /// managed by the runtime (the LibTorch adapter's private pools). Throws like allocate().
  [[nodiscard]] std::unique_ptr<DeviceAllocator> create_allocator(int device);

 private:
  struct DeviceSlot {
    std::mutex create_mutex;
    std::atomic<DeviceAllocator*> allocator{nullptr};
    std::unique_ptr<DeviceAllocator> owner;
    std::atomic<std::uint64_t> alloc_ticks{0};
    std::atomic<std::uint64_t> free_ticks{0};
  };

  Runtime(std::string conf_text, FrontEndSettings settings, RuntimeHooks hooks);

  DeviceSlot& slot(int device) const;
  DeviceAllocator* owner_of(const void* ptr) const noexcept;

  std::string conf_text_;
  FrontEndSettings settings_;
  RuntimeHooks hooks_;
  int device_count_ = 0;
  std::unique_ptr<DeviceSlot[]> slots_;
  TickClock clock_;
  std::unique_ptr<Recorder> recorder_;
  std::string record_path_;  ///< record_path with %p substituted
  std::mutex dump_mutex_;
};

}  // namespace cachealloc::plugin
