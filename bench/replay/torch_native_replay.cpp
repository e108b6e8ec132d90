// torch_native_replay.cpp: PyTorch's own CUDA caching allocator as a replay row, through
// LibTorch (libc10_cuda): raw_alloc_with_stream / raw_delete, recordStream for deferred frees.
// The only file of the replay that sees a PyTorch header (built with CACHEALLOC_TORCH_ENABLED).
//
// Outside Python nobody initialises the allocator (torch.cuda's lazy init calls
// CUDACachingAllocator::init(device_count)), so the target does; init() only adds devices it
// has not seen, so calling it again is harmless. The allocator runs with whatever
// PYTORCH_CUDA_ALLOC_CONF says (default: PyTorch's defaults), not with the trace's settings.
#include "cuda_replay.h"

#include <cachealloc/errors.h>

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

namespace cachealloc::replay {
namespace {

namespace ca = c10::cuda::CUDACachingAllocator;

class TorchNativeTarget final : public CudaTarget {
 public:
  explicit TorchNativeTarget(int gpu) : device_(static_cast<c10::DeviceIndex>(gpu)) {
    c10::cuda::set_device(device_);
    ca::init(static_cast<int>(c10::cuda::device_count()));
    ca::emptyCache();
    ca::resetPeakStats(device_);
    ca::resetAccumulatedStats(device_);
  }

  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    try {
      return ca::raw_alloc_with_stream(bytes, stream);
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;
    }
  }
  void deallocate(void* ptr, cudaStream_t /*stream*/) override { ca::raw_delete(ptr); }
  void free_deferred(void* ptr, cudaStream_t /*stream*/, cudaStream_t other) override {
    // A non-owning DataPtr naming the block: what Tensor.record_stream passes.
    const c10::DataPtr data(ptr, c10::Device(c10::DeviceType::CUDA, device_));
    ca::recordStream(data, c10::cuda::getStreamFromExternal(other, device_));
    ca::raw_delete(ptr);
  }
  void finish(CudaResult& r) override {
    const c10::CachingDeviceAllocator::DeviceStats s = ca::getDeviceStats(device_);
    constexpr auto kAll = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    r.base.peak_reserved = static_cast<std::uint64_t>(s.reserved_bytes[kAll].peak);
    r.base.peak_allocated = static_cast<std::uint64_t>(s.allocated_bytes[kAll].peak);
    r.base.peak_requested = static_cast<std::uint64_t>(s.requested_bytes[kAll].peak);
    r.base.device_reserve_calls = static_cast<std::uint64_t>(s.num_device_alloc);
    r.base.device_release_calls = static_cast<std::uint64_t>(s.num_device_free);
    r.device_calls = r.base.device_reserve_calls + r.base.device_release_calls;
    ca::emptyCache();
  }

 private:
  c10::DeviceIndex device_;
};

}  // namespace

std::unique_ptr<CudaTarget> make_torch_native_target(int gpu, std::string& backend_name) {
  try {
    auto target = std::make_unique<TorchNativeTarget>(gpu);
    backend_name = "PyTorch " + ca::name() + " allocator (libc10_cuda)";
    return target;
  } catch (const c10::Error& e) {
    throw DeviceError(std::string("PyTorch's CUDA allocator: ") + e.what_without_backtrace());
  }
}

}  // namespace cachealloc::replay
