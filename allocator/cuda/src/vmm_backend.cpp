// vmm_backend.cpp: backend `cuda_vmm` (see vmm_backend.h).
#include <cachealloc/cuda/streams.h>
#include <cachealloc/cuda/vmm_backend.h>
#include <cachealloc/errors.h>

#include "cuda_check.h"
#include "driver_api.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <span>
#include <string>

namespace cachealloc {
namespace {

/// Loads the driver API before the runtime backend initialises the device, so that a machine
/// without the driver hears about the driver API (what the VMM backend needs) first.
int with_driver_api(int device) {
  (void)cuda_detail::driver_api();
  return device;
}

CUmemAllocationProp pinned_on(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

CUdeviceptr to_cu(std::uintptr_t va) noexcept { return static_cast<CUdeviceptr>(va); }

/// Maps `pieces` back to back from `va`, then grants the device access to all of them in one
/// call. Returns the first failure (CUDA_SUCCESS if none) and sets `mapped` to the bytes left
/// mapped from `va` (the caller unmaps them when anything failed).
CUresult map_and_grant(std::uintptr_t va, std::span<const MapPiece> pieces, int device,
                       std::size_t& mapped) {
  const cuda_detail::DriverApi& api = cuda_detail::driver_api();
  mapped = 0;
  for (const MapPiece& p : pieces) {
    const CUresult status =
        api.mem_map(to_cu(va + mapped), p.bytes, 0, static_cast<CUmemGenericAllocationHandle>(p.handle), 0);
    if (status != CUDA_SUCCESS) {
      return status;
    }
    mapped += p.bytes;
  }
  if (mapped == 0) {
    return CUDA_SUCCESS;
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return api.mem_set_access(to_cu(va), mapped, &access, 1);
}

}  // namespace

CudaVmmOptions CudaVmmOptions::from_config(Config& config) {
  CudaVmmOptions o;
  if (auto v = config.take_bool("background_unmap")) {
    o.background_unmap = *v;
  }
  o.event_thread = take_event_thread(config, o.event_thread);
  return o;
}

std::vector<std::string_view> CudaVmmBackend::config_keys() { return {"background_unmap", "event_thread"}; }

CudaVmmBackend::CudaVmmBackend(int device, CudaVmmOptions options)
    : CudaRuntimeBackend(with_driver_api(device), options.event_thread), options_(options) {
  // The runtime initialised the primary context (CudaRuntimeBackend's constructor called
  // cudaFree(nullptr) on the device); the driver calls below run in it.
  const cuda_detail::DriverApi& api = cuda_detail::driver_api();
  CudaDeviceGuard guard(device, /*force=*/true);
  CUcontext context = nullptr;
  CACHEALLOC_CU_CHECK(api.ctx_get_current(&context));
  if (context == nullptr) {
    throw DeviceError("CUDA device " + std::to_string(device) +
                      ": no current context after cudaSetDevice (driver/runtime mismatch?)");
  }
  CUdevice cu_device = 0;
  CACHEALLOC_CU_CHECK(api.device_get(&cu_device, device));
  int supported = 0;
  CACHEALLOC_CU_CHECK(api.device_get_attribute(
      &supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu_device));
  if (supported == 0) {
    throw DeviceError("CUDA device " + std::to_string(device) +
                      " does not support virtual memory management (cuMemCreate/cuMemMap); "
                      "policy defrag needs a GPU with CUDA virtual memory support");
  }
  const CUmemAllocationProp prop = pinned_on(device);
  CACHEALLOC_CU_CHECK(api.mem_get_allocation_granularity(&granularity_, &prop,
                                                         CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  CACHEALLOC_CU_CHECK(api.mem_get_allocation_granularity(&minimum_granularity_, &prop,
                                                         CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  attach(*this);
  if (options_.background_unmap) {
    // Note [Unmapping off the allocating thread] (background_unmapper.h).
    unmapper_ = std::make_unique<BackgroundUnmapper>(
        [](std::uintptr_t va, std::size_t bytes) -> std::string {
          const CUresult status = cuda_detail::driver_api().mem_unmap(to_cu(va), bytes);
          return status == CUDA_SUCCESS
                     ? std::string()
                     : cuda_detail::describe_driver_error(status, "cuMemUnmap", __FILE__, __LINE__);
        },
        cuda_detail::backend_thread_init(device),
        [this](std::uint64_t after) -> std::string {
          // Note [Moving pages a stream still uses]: the stream's work that used the range.
          auto* event = reinterpret_cast<cudaEvent_t>(static_cast<std::uintptr_t>(after));
          const cudaError_t status = cudaEventSynchronize(event);
          give_event(event);
          return status == cudaSuccess ? std::string()
                                       : std::string("cudaEventSynchronize before cuMemUnmap: ") +
                                             cudaGetErrorName(status) + " (" +
                                             cudaGetErrorString(status) + ")";
        });
  }
}

CudaVmmBackend::~CudaVmmBackend() {
  try {
    drain_unmaps();
  } catch (const Error& e) {
    cuda_detail::warn_exception(__func__, e);
  }
  unmapper_.reset();  // joins the thread while the driver state it uses is still there
  for (cudaEvent_t e : idle_events_) {
    CACHEALLOC_CUDA_WARN(cudaEventDestroy(e));
  }
}

cudaEvent_t CudaVmmBackend::take_event() {
  {
    std::lock_guard lock(events_mutex_);
    if (!idle_events_.empty()) {
      cudaEvent_t e = idle_events_.back();
      idle_events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  CACHEALLOC_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void CudaVmmBackend::give_event(cudaEvent_t event) noexcept {
  try {
    std::lock_guard lock(events_mutex_);
    idle_events_.push_back(event);
  } catch (...) {
    CACHEALLOC_CUDA_WARN(cudaEventDestroy(event));
  }
}

void CudaVmmBackend::do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) {
  if (unmapper_ == nullptr) {
    VirtualMemory::do_unmap_after(va, bytes, stream);
    return;
  }
  CudaDeviceGuard guard(device(), /*force=*/true);
  cudaEvent_t event = take_event();
  const cudaError_t status = cudaEventRecord(event, to_cuda_stream(stream));
  if (status != cudaSuccess) {
    give_event(event);
    CACHEALLOC_CUDA_CHECK(status);
  }
  try {
    unmapper_->post(va, bytes, static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(event)));
  } catch (...) {
    give_event(event);
    throw;
  }
}

BackgroundWork CudaVmmBackend::background_work() const noexcept {
  BackgroundWork work = CudaRuntimeBackend::background_work();  // the event pool's record thread
  if (unmapper_ != nullptr) {
    work.unmaps = unmapper_->completed();
    work.busy_ns = unmapper_->busy_ns();
    work.blocked_ns = unmapper_->blocked_ns();
  }
  return work;
}

std::size_t CudaVmmBackend::pending_unmaps() const noexcept {
  return unmapper_ != nullptr ? unmapper_->pending() : 0;
}

std::uintptr_t CudaVmmBackend::queued_unmap_end(std::uintptr_t va,
                                                std::size_t bytes) const noexcept {
  try {
    return unmapper_ != nullptr ? unmapper_->end_behind_stream_work(va, bytes) : 0;
  } catch (...) {  // a failed lock: only a hint, the map waits as before
    return 0;
  }
}

void CudaVmmBackend::drain_unmaps() {
  if (unmapper_ != nullptr) {
    unmapper_->drain();
  }
}

std::uintptr_t CudaVmmBackend::reserve_address(std::size_t bytes) {
  const cuda_detail::DriverApi& api = cuda_detail::driver_api();
  CudaDeviceGuard guard(device(), /*force=*/true);
  CUdeviceptr va = 0;
  CACHEALLOC_CU_CHECK(api.mem_address_reserve(&va, bytes, granularity_, 0, 0));
  return static_cast<std::uintptr_t>(va);
}

void CudaVmmBackend::free_address(std::uintptr_t va, std::size_t bytes) noexcept {
  try {
    drain_unmaps();  // the range's mappings must be gone before it is freed
    const cuda_detail::DriverApi& api = cuda_detail::driver_api();
    CudaDeviceGuard guard(device(), /*force=*/true);
    CACHEALLOC_CU_WARN(api.mem_address_free(to_cu(va), bytes));
  } catch (const Error& e) {
    cuda_detail::warn_exception(__func__, e);
  }
}

PhysicalHandle CudaVmmBackend::do_create_physical(std::size_t bytes) {
  const cuda_detail::DriverApi& api = cuda_detail::driver_api();
  CudaDeviceGuard guard(device(), /*force=*/true);
  const CUmemAllocationProp prop = pinned_on(device());
  CUmemGenericAllocationHandle handle = 0;
  const CUresult status = api.mem_create(&handle, bytes, &prop, 0);
  if (status == CUDA_ERROR_OUT_OF_MEMORY) {
    return 0;  // the retry chain runs (driver errors are not sticky and have no "last error")
  }
  CACHEALLOC_CU_CHECK(status);
  if (handle == 0) {
    throw DeviceError("cuMemCreate returned handle 0, which cachealloc reserves for 'no memory'");
  }
  return static_cast<PhysicalHandle>(handle);
}

void CudaVmmBackend::do_release_physical(PhysicalHandle handle, std::size_t bytes) noexcept {
  try {
    // The driver frees the memory once its last mapping is gone: wait for queued unmaps, so
    // that the memory is back on the device when this returns (empty_cache, out of memory).
    drain_unmaps();
  } catch (const Error& e) {
    cuda_detail::warn_exception(__func__, e);
    return;
  }
  do_release_unmapped(handle, bytes);
}

void CudaVmmBackend::do_release_unmapped(PhysicalHandle handle, std::size_t /*bytes*/) noexcept {
  try {
    const cuda_detail::DriverApi& api = cuda_detail::driver_api();
    CudaDeviceGuard guard(device(), /*force=*/true);
    CACHEALLOC_CU_WARN(api.mem_release(static_cast<CUmemGenericAllocationHandle>(handle)));
  } catch (const Error& e) {
    cuda_detail::warn_exception(__func__, e);
  }
}

void CudaVmmBackend::do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) {
  const MapPiece piece{handle, bytes};
  do_map_run(va, std::span<const MapPiece>(&piece, 1));
}

void CudaVmmBackend::do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces) {
  if (pieces.empty()) {
    return;
  }
  if (unmapper_ != nullptr) {
    std::size_t total = 0;
    for (const MapPiece& p : pieces) {
      total += p.bytes;
    }
    unmapper_->wait_for(va, total);  // a queued unmap of this range runs first
  }
  CudaDeviceGuard guard(device(), /*force=*/true);
  // Note [Access calls from several threads] (vmm_backend.h): every handle mapped, then one
  // access call over the run.
  std::size_t mapped = 0;
  const CUresult status = map_and_grant(va, pieces, device(), mapped);
  if (status != CUDA_SUCCESS) {
    if (mapped > 0) {  // leave the range as we found it
      CACHEALLOC_CU_WARN(cuda_detail::driver_api().mem_unmap(to_cu(va), mapped));
    }
    CACHEALLOC_CU_CHECK(status);
  }
}

void CudaVmmBackend::do_unmap_now(std::uintptr_t va, std::size_t bytes) {
  if (unmapper_ != nullptr) {
    unmapper_->wait_for(va, bytes);
  }
  const cuda_detail::DriverApi& api = cuda_detail::driver_api();
  CudaDeviceGuard guard(device(), /*force=*/true);
  CACHEALLOC_CU_CHECK(api.mem_unmap(to_cu(va), bytes));
}

// Note [Unmapping does not wait for the device] in vmm_backend.h.
void CudaVmmBackend::do_unmap(std::uintptr_t va, std::size_t bytes) {
  if (unmapper_ != nullptr) {
    unmapper_->post(va, bytes);  // Note [Unmapping off the allocating thread]
    return;
  }
  const cuda_detail::DriverApi& api = cuda_detail::driver_api();
  CudaDeviceGuard guard(device(), /*force=*/true);
  CACHEALLOC_CU_CHECK(api.mem_unmap(to_cu(va), bytes));
}

}  // namespace cachealloc
