// vmm_backend.h: backend `cuda_vmm`: CUDA virtual memory (cuMemAddressReserve, cuMemCreate,
// cuMemMap) for the defragmenting policy, plus everything `cuda_runtime` does.
//
// The driver API is not linked: it is loaded at run time (dlopen("libcuda.so.1") and
// cuGetProcAddress), so the library links against nothing but the runtime, and a machine
// without the driver gets a DeviceError saying so when it builds this backend.
//
// Note [Unmapping does not wait for the device]
// cudaFree waits for all work on the device before it frees; cuMemUnmap and cuMemRelease do
// not: unmapping memory that a queued or running kernel still touches makes that kernel fault.
// So unmap() has the same precondition as the driver call: no work may use the range any more.
// The policy guarantees it (defrag unmaps only pages whose freeing streams' events completed,
// see defrag.h's Note [Physical pages and the streams that used them]; the front end parks
// cross-stream frees until the other streams are done). The backend does not synchronise the
// device itself, because defragmentation unmaps on the allocation path, where waiting for all
// work on the device (other streams' long kernels included) would stall the caller.
// (PyTorch's expandable segments, which have no per-page events, synchronise the stream instead.)
//
// One unmap() may span several adjacent mappings, each of a whole handle (as in the CUDA
// samples' vectorAddMMAP); it must not cut a mapping in two.
//
// With background_unmap (the default), unmap() queues the range and a thread of the backend
// calls cuMemUnmap (Note [Unmapping off the allocating thread], background_unmapper.h); a map
// into a range whose unmap is still queued waits for it, and releasing physical memory or an
// address range waits for all of them. That thread sets its stream-capture mode to relaxed, so
// a CUDA graph captured meanwhile on another thread is not invalidated by its calls.
#pragma once

#include <cachealloc/background_unmapper.h>
#include <cachealloc/backend.h>
#include <cachealloc/config.h>
#include <cachealloc/cuda/event_thread.h>
#include <cachealloc/cuda/runtime_backend.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

namespace cachealloc {

// Note [Access calls from several threads]
// cuMemSetAccess is paid per mapping, not per call or per byte: 23-33 us for one handle on an
// idle H100, about 1 ms per handle while device-to-host copies run (bench/micro/vmm_probe.cpp,
// Note [Maps while copy engines run]). Session 33 gave this backend a setting, map_threads, that
// split a run of handles over several threads, in case the driver let their waits overlap. It
// does not: 8 one-page maps from 8 threads took 619 us on an idle H100 against 173 us in series,
// and 8,228 against 8,329 us under copies (bench/results/vmm_probe_h100_2026-12-06_s35.txt), so
// the setting and its thread pool were removed (session 35). A run of handles is mapped on the
// allocating thread and granted access in one call.

/// Settings of backend `cuda_vmm` from CACHEALLOC_CONF.
struct CudaVmmOptions {
  /// background_unmap:True|False: cuMemUnmap on a thread of the backend (default True).
  bool background_unmap = true;
  /// event_thread:off|records|poll (default poll: Note [Watching events by default on virtual
  /// memory], event_thread.h).
  EventThread event_thread = EventThread::poll;

  /// Takes the keys below from `config`; throws ConfigError for a malformed value.
  static CudaVmmOptions from_config(Config& config);
};

class CudaVmmBackend final : public CudaRuntimeBackend, private VirtualMemory {
 public:
  /// Loads the driver API and checks that `device` supports virtual memory management.
  /// Throws DeviceError ("CUDA driver API not available: ...") when libcuda.so.1 or a symbol is
  /// missing, or when the device lacks VMM support.
  explicit CudaVmmBackend(int device, CudaVmmOptions options = {});
  ~CudaVmmBackend() override;

  /// The CACHEALLOC_CONF keys this backend takes (see CudaVmmOptions::from_config).
  static std::vector<std::string_view> config_keys();
  [[nodiscard]] const CudaVmmOptions& options() const noexcept { return options_; }
  [[nodiscard]] BackgroundWork background_work() const noexcept override;
  /// Unmaps queued for the background thread and not yet done (0 without background_unmap).
  [[nodiscard]] std::size_t pending_unmaps() const noexcept;
  /// With background_unmap: unmap_after() queues the range behind an event recorded on the
  /// stream (Note [Moving pages a stream still uses], background_unmapper.h).
  [[nodiscard]] bool unmaps_after_streams() const noexcept override { return unmapper_ != nullptr; }
  /// Ranges whose background unmap waits for a stream's work: queued by unmap_after(), or
  /// queued behind such an unmap (BackgroundUnmapper::end_behind_stream_work). Plain unmaps
  /// waiting their turn on the thread do not count: they run within a few hundred microseconds.
  [[nodiscard]] std::uintptr_t queued_unmap_end(std::uintptr_t va,
                                                std::size_t bytes) const noexcept override;

  [[nodiscard]] std::string_view name() const noexcept override { return "cuda_vmm"; }
  [[nodiscard]] VirtualMemory* virtual_memory() noexcept override { return this; }

  /// cuMemGetAllocationGranularity(RECOMMENDED) for pinned device memory: 2 MiB on the H200.
  [[nodiscard]] std::size_t granularity() const noexcept override { return granularity_; }
  /// The driver's minimum granularity (for reports; the backend works in granularity()).
  [[nodiscard]] std::size_t minimum_granularity() const noexcept { return minimum_granularity_; }
  [[nodiscard]] std::uintptr_t reserve_address(std::size_t bytes) override;
  void free_address(std::uintptr_t va, std::size_t bytes) noexcept override;

 private:
  [[nodiscard]] PhysicalHandle do_create_physical(std::size_t bytes) override;
  void do_release_physical(PhysicalHandle handle, std::size_t bytes) noexcept override;
  void do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) override;
  void do_unmap(std::uintptr_t va, std::size_t bytes) override;
  void do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces) override;
  void do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) override;
  /// cuMemUnmap on this thread, after any queued unmap of the range (none is expected there).
  void do_unmap_now(std::uintptr_t va, std::size_t bytes) override;
  [[nodiscard]] std::uint64_t unmap_wait_ns() const noexcept override {
    return unmapper_ != nullptr ? unmapper_->blocked_ns() : 0;
  }
  /// cuMemRelease without draining the unmap thread's queue.
  void do_release_unmapped(PhysicalHandle handle, std::size_t bytes) noexcept override;

  /// Waits for every queued unmap (nothing when there is no background thread).
  void drain_unmaps();
  /// Events for unmap_after(), recorded here and waited for (then given back) on the unmap
  /// thread: a free list under its own lock.
  [[nodiscard]] cudaEvent_t take_event();
  void give_event(cudaEvent_t event) noexcept;

  CudaVmmOptions options_;
  std::size_t granularity_ = 0;
  std::size_t minimum_granularity_ = 0;
  std::mutex events_mutex_;
  std::vector<cudaEvent_t> idle_events_;          // declared before unmapper_: outlives it
  std::unique_ptr<BackgroundUnmapper> unmapper_;  // with background_unmap
};

}  // namespace cachealloc
