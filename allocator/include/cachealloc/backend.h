// backend.h: the device-backend contract, the only way a policy reaches a device.
//
// A backend owns one device's raw memory calls, its events and (optionally) its virtual-memory
// calls. Implementations: SimBackend (sim_backend.h: deterministic, GPU-free, fault injection),
// CudaRuntimeBackend (cudaMalloc + events), CudaVmmBackend (cuMemCreate/cuMemMap), and the
// stream-ordered pool backend (cudaMallocAsync on a private cudaMemPool_t).
//
// Note [Why a virtual interface and not a template parameter]
// Every backend call costs microseconds on a real device (cudaMalloc ~90 us, cuMemMap ~55 us,
// cudaEventRecord ~2 us), so one indirect call is noise; policies, whose fast path is a few
// dozen instructions, are the part checked with a C++20 concept and called without virtual
// dispatch by the front end. A virtual backend lets the replay tool pick sim or cuda at run
// time without instantiating every policy for every backend.
//
// Note [Accounting and limits live in the base class]
// The public entry points (reserve, release, create_physical, ...) are non-virtual: they count
// calls and bytes, enforce the memory-fraction limit, and then call the do_* hooks. So every
// backend is counted and limited the same way, and a backend cannot forget either.
#pragma once

#include <cachealloc/stream_ordered.h>
#include <cachealloc/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

namespace cachealloc {

/// Counters every backend keeps (read by stats and the replay table).
struct BackendCounters {
  std::uint64_t reserve_calls = 0;       ///< successful reserve() (cudaMalloc-like) calls
  std::uint64_t release_calls = 0;       ///< release() calls
  std::uint64_t failed_reserves = 0;     ///< reserve()/create_physical() that found no memory
  std::uint64_t physical_creates = 0;    ///< create_physical() successes (cuMemCreate)
  std::uint64_t physical_releases = 0;   ///< release_physical() calls (cuMemRelease)
  std::uint64_t map_calls = 0;           ///< map() calls (cuMemMap + cuMemSetAccess)
  std::uint64_t unmap_calls = 0;         ///< unmap() calls (cuMemUnmap)
  std::uint64_t mapped_bytes = 0;        ///< bytes passed to map(), cumulative
  std::uint64_t unmapped_bytes = 0;      ///< bytes passed to unmap(), cumulative
  std::uint64_t events_recorded = 0;     ///< record_event() calls
  std::uint64_t event_queries = 0;       ///< query_event() calls
  /// Time inside record_event() and query_event() on clock_ns() (the CUDA backends: the host's
  /// steady clock; the simulated device charges events nothing, Note [Simulated time]).
  std::uint64_t event_ns = 0;
  /// Time inside each kind of memory call on clock_ns() (Note [Time in device calls]): the CUDA
  /// backends measure the host's steady clock, the simulated device charges its modelled costs.
  std::uint64_t reserve_ns = 0;           ///< reserve() (cudaMalloc)
  std::uint64_t release_ns = 0;           ///< release() (cudaFree)
  std::uint64_t create_ns = 0;            ///< create_physical() (cuMemCreate)
  std::uint64_t release_physical_ns = 0;  ///< release_physical() (cuMemRelease)
  std::uint64_t map_ns = 0;               ///< map() and map_run() (cuMemMap + cuMemSetAccess)
  std::uint64_t unmap_ns = 0;             ///< unmap() (cuMemUnmap)

  /// Calls that changed which device memory is held or mapped (Note [The step memo]).
  [[nodiscard]] std::uint64_t mapping_calls() const noexcept {
    return reserve_calls + release_calls + physical_creates + physical_releases + map_calls +
           unmap_calls;
  }
};

/// What a backend's own thread did (cuda_vmm's background unmaps: Note [Unmapping off the
/// allocating thread], background_unmapper.h). Read without the caller's lock: the figures are
/// atomics of that thread.
struct BackgroundWork {
  std::uint64_t unmaps = 0;      ///< unmaps the thread ran
  std::uint64_t busy_ns = 0;     ///< time the thread spent in them (no caller waited for it)
  std::uint64_t blocked_ns = 0;  ///< time callers blocked until one finished (inside their calls)
  /// Event records made by the backend's record thread (Note [Event records on a thread of their
  /// own], record_thread.h) and its time in them (not part of any allocator call).
  std::uint64_t event_records = 0;
  std::uint64_t event_ns = 0;
  /// Its queries of the events it watches (Note [The record thread watches its events]) and its
  /// time in them.
  std::uint64_t event_queries = 0;
  std::uint64_t event_query_ns = 0;
};

/// One handle of a run mapped by VirtualMemory::map_run.
struct MapPiece {
  PhysicalHandle handle;
  std::size_t bytes;
};

/// Optional virtual-memory half of a backend (CUDA VMM: cuMemAddressReserve/cuMemCreate/cuMemMap).
/// Preconditions are the driver's: addresses and sizes are multiples of granularity().
class VirtualMemory {
 public:
  virtual ~VirtualMemory() = default;
  /// The physical page size (cuMemGetAllocationGranularity); 2 MiB on the H200.
  [[nodiscard]] virtual std::size_t granularity() const noexcept = 0;
  /// Reserves `bytes` of address space (no memory behind it). Throws DeviceError on failure.
  [[nodiscard]] virtual std::uintptr_t reserve_address(std::size_t bytes) = 0;
  virtual void free_address(std::uintptr_t va, std::size_t bytes) noexcept = 0;
  /// Physical memory of `bytes` (a multiple of granularity). Returns 0 when the device is out of
  /// memory or over the limit; throws DeviceError on other failures.
  [[nodiscard]] PhysicalHandle create_physical(std::size_t bytes);
  void release_physical(PhysicalHandle handle, std::size_t bytes) noexcept;
  /// Maps all of `handle` (of `bytes`) at `va` and makes it readable/writable by the device.
  void map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle);
  /// Maps `handles` back to back from `va` (each all of its `bytes`), all or nothing: on failure
  /// nothing of the run stays mapped and the error propagates. CUDA sets the access of the whole
  /// run in one call (cuMemSetAccess costs about as much for 1 GiB as for one page).
  void map_run(std::uintptr_t va, std::span<const MapPiece> pieces);
  void unmap(std::uintptr_t va, std::size_t bytes);
  /// Unmaps [va, va + bytes) once the work queued on `stream` so far has finished (Note
  /// [Moving pages a stream still uses], background_unmapper.h). Its physical handles may be
  /// mapped at another address at once, for blocks used in `stream`'s order; a later map into
  /// this range waits until the unmap ran. Where unmaps_after_streams() is false this waits for
  /// the stream here (an event recorded and synchronised), then unmaps.
  void unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream);
  /// Unmaps [va, va + bytes) on the calling thread before returning, where unmap() may hand the
  /// work to a thread of the backend (cuda_vmm's background_unmap): for pages no stream uses any
  /// more whose handles are released right after (release_unmapped), so that their memory is
  /// back before new memory is created in their place (Note [Coalescing moved chunks while maps
  /// are dear], defrag_grow.cpp).
  void unmap_now(std::uintptr_t va, std::size_t bytes);
  /// Releases a handle unmapped by unmap_now(), without waiting for unrelated unmaps queued on
  /// the backend's thread (release_physical() waits for them all, so that its memory is back
  /// when it returns). A mapping of the handle still queued elsewhere keeps its memory until it
  /// runs, as the driver frees a handle's memory when its last mapping goes.
  void release_unmapped(PhysicalHandle handle, std::size_t bytes) noexcept;
  /// Time (on the owning backend's clock_ns()) that calls spent waiting for queued unmaps to run
  /// (a map waits for those of its range), summed since construction; 0 where unmaps are never
  /// queued. Lets a policy tell a map's own cost from such waits.
  [[nodiscard]] virtual std::uint64_t unmap_wait_ns() const noexcept { return 0; }
  /// Whether unmap_after() returns without waiting for the stream.
  [[nodiscard]] virtual bool unmaps_after_streams() const noexcept { return false; }
  /// Where unmaps still waiting for a stream's work (unmap_after(), or on cuda_vmm's thread
  /// unmaps queued behind one) overlap [va, va + bytes): the end of the highest such unmap's
  /// range, or 0 when none does. A map that overlaps one now would wait for that work; one at or
  /// above the end would not wait for these. A hint for placement (Note [Placing away from
  /// queued unmaps], defrag_grow.cpp).
  [[nodiscard]] virtual std::uintptr_t queued_unmap_end(std::uintptr_t /*va*/,
                                                        std::size_t /*bytes*/) const noexcept {
    return 0;
  }

  [[nodiscard]] std::size_t physical_bytes() const noexcept { return physical_bytes_; }

 protected:
  friend class DeviceBackend;
  [[nodiscard]] virtual PhysicalHandle do_create_physical(std::size_t bytes) = 0;
  /// `bytes`: the size create_physical() gave it (adaptors pass it on to the wrapped backend).
  virtual void do_release_physical(PhysicalHandle handle, std::size_t bytes) noexcept = 0;
  virtual void do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) = 0;
  virtual void do_unmap(std::uintptr_t va, std::size_t bytes) = 0;
  /// Default: do_map piece by piece, undoing the pieces mapped when one fails.
  virtual void do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces);
  /// Default: do_unmap (which does not return before the pages are unmapped).
  virtual void do_unmap_now(std::uintptr_t va, std::size_t bytes) { do_unmap(va, bytes); }
  /// Default: do_release_physical.
  virtual void do_release_unmapped(PhysicalHandle handle, std::size_t bytes) noexcept {
    do_release_physical(handle, bytes);
  }
  /// Default: waits for `stream` (an event of the owning backend), then do_unmap.
  virtual void do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream);

 private:
  /// release_physical() (`unmapped` false) and release_unmapped(): the call, timed and counted.
  void release_handle(PhysicalHandle handle, std::size_t bytes, bool unmapped) noexcept;

  class DeviceBackend* owner_ = nullptr;
  std::size_t physical_bytes_ = 0;
};

/// One device's memory and event calls. Not thread-safe: the front end serialises calls.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  DeviceBackend() = default;
  DeviceBackend(const DeviceBackend&) = delete;
  DeviceBackend& operator=(const DeviceBackend&) = delete;

  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
  [[nodiscard]] virtual int device() const noexcept = 0;

  // ---- memory (cudaMalloc / cudaFree) ----
  /// Returns nullptr when the device is out of memory or the limit would be exceeded;
  /// throws DeviceError for any other failure.
  [[nodiscard]] void* reserve(std::size_t bytes);
  void release(void* ptr, std::size_t bytes) noexcept;

  /// Total device memory (cudaMemGetInfo's total) and what the device reports free now.
  [[nodiscard]] virtual std::size_t total_memory() const = 0;
  [[nodiscard]] virtual std::size_t free_memory() const = 0;

  // ---- streams and events ----
  /// Records an event on `stream` (from a pool; cheap to call often). Throws DeviceError.
  [[nodiscard]] virtual EventId record_event(StreamId stream) = 0;
  /// True when all work on the stream before the event has finished. Throws DeviceError.
  /// Under event_thread:poll (defrag's default) the CUDA backends' "not yet" may be up to a look
  /// of their record thread late (Note [The record thread watches its events], record_thread.h).
  [[nodiscard]] virtual bool query_event(EventId event) = 0;
  /// Blocks until the event completed. Throws DeviceError.
  virtual void synchronize_event(EventId event) = 0;
  /// Returns the event to the pool.
  virtual void destroy_event(EventId event) noexcept = 0;
  /// Makes the work queued on `stream` from now on wait for `event` (cudaStreamWaitEvent) without
  /// blocking the host; the event may be destroyed right after. False when this backend cannot
  /// (the caller then waits for the event to complete instead). Throws DeviceError.
  [[nodiscard]] virtual bool stream_wait_event(StreamId /*stream*/, EventId /*event*/) { return false; }

  /// Monotonic time in nanoseconds, for policies that budget the time their device calls take
  /// (defrag: Note [A time budget for moves]). Real backends: std::chrono::steady_clock; the
  /// simulated device: its own clock (Note [Simulated time], sim_backend.h).
  [[nodiscard]] virtual std::uint64_t clock_ns() const noexcept;

  /// The virtual-memory half, or nullptr when this backend has none.
  [[nodiscard]] virtual VirtualMemory* virtual_memory() noexcept { return nullptr; }
  /// The stream-ordered pool (stream_ordered.h), or nullptr when this backend has none.
  [[nodiscard]] virtual StreamOrderedMemory* stream_ordered() noexcept { return nullptr; }
  /// Work done on the backend's own thread (adaptors report their wrapped backend's).
  [[nodiscard]] virtual BackgroundWork background_work() const noexcept { return {}; }

  // ---- limits and counters (not virtual: Note [Accounting and limits live in the base class]) ----
  /// Upper bound on reserved + physical bytes; default: unlimited (the device decides).
  void set_limit(std::size_t bytes) noexcept { limit_ = bytes; }
  [[nodiscard]] std::size_t limit() const noexcept { return limit_; }
  /// The limit, or the device total when no limit is set: the memory policies may plan with.
  [[nodiscard]] std::size_t usable_memory() const {
    return limit_ == kNoLimit ? total_memory() : limit_;
  }
  /// Bytes currently held through reserve() plus VirtualMemory::create_physical().
  [[nodiscard]] std::size_t held_bytes() const noexcept { return held_bytes_; }
  [[nodiscard]] const BackendCounters& counters() const noexcept { return counters_; }
  BackendCounters& mutable_counters() noexcept { return counters_; }

  static constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();

 protected:
  [[nodiscard]] virtual void* do_reserve(std::size_t bytes) = 0;
  virtual void do_release(void* ptr, std::size_t bytes) noexcept = 0;
  /// Backends with virtual memory call this once from their constructor.
  void attach(VirtualMemory& vm) noexcept { vm.owner_ = this; }

 private:
  friend class VirtualMemory;
  [[nodiscard]] bool within_limit(std::size_t more) const noexcept {
    return limit_ == kNoLimit || (held_bytes_ <= limit_ && more <= limit_ - held_bytes_);
  }

  std::size_t limit_ = kNoLimit;
  std::size_t held_bytes_ = 0;
  BackendCounters counters_;
};

namespace detail {
/// Adds the time from its construction to its destruction, on `backend`'s clock_ns(), to `into`
/// (one of its BackendCounters' *_ns figures): the backend's memory calls (Note [Time in device
/// calls], backend.cpp) and the CUDA backends' event calls (record_counted, query_counted).
class TimedCall {
 public:
  TimedCall(const DeviceBackend& backend, std::uint64_t& into) noexcept
      : backend_(backend), into_(into), start_(backend.clock_ns()) {}
  ~TimedCall() {
    const std::uint64_t now = backend_.clock_ns();
    into_ += now > start_ ? now - start_ : 0;
  }
  TimedCall(const TimedCall&) = delete;
  TimedCall& operator=(const TimedCall&) = delete;

 private:
  const DeviceBackend& backend_;
  std::uint64_t& into_;
  std::uint64_t start_;
};
}  // namespace detail

}  // namespace cachealloc
