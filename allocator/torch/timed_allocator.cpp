// timed_allocator.cpp: the forwarding, timing CUDAAllocator of timed_allocator.h.
//
// Note [What PyTorch's deleters do]
// Checked for PyTorch 2.11.0 (the build this adapter targets) in the disassembly of its
// libc10_cuda.so, and in the source of c10/cuda/CUDACachingAllocator.cpp and
// CUDAMallocAsyncAllocator.cpp (pytorch/pytorch, the NativeCachingAllocator and
// CudaMallocAsyncAllocator classes):
// - native (also with expandable segments): allocate() returns {p, p, deleter, device} with
//   context == data pointer; the deleter is Native::local_raw_delete, which frees through the
//   static Native::allocator (NativeCachingAllocator::free(p): the block map, then the device
//   allocator), never through the global `allocator` pointer, so our wrapper is not re-entered.
//   With PYTORCH_NO_CUDA_MEMORY_CACHING=1 or after enable(false) the deleter is uncached_delete
//   (cudaFree); raw_delete(p) checks the same two conditions at free time, so it agrees with the
//   DataPtr's deleter only while they do not change between allocation and free. recordStream()
//   returns at once unless ptr.get_deleter() == &local_raw_delete.
// - cudaMallocAsync: allocate() returns {p, p, &CudaMallocAsync::local_raw_delete, device};
//   local_raw_delete and raw_delete both tail-call the same freeAsync(p). recordStream() looks
//   the pointer up and does not look at the deleter.
// Hence the wrapper calls the DataPtr's own deleter (exact in every case above) and puts it back
// for recordStream (needed for native).
#include "timed_allocator.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <utility>

namespace cachealloc::torch_adapter {
namespace {

std::atomic<TimedAllocator*> g_instance{nullptr};

/// Adds the ticks since construction to `ticks`, and one to `calls`, when the scope ends,
/// exception or not (as the runtime's ChargeTicks does for cachealloc's own allocator_ns).
class TimedCall {
 public:
  TimedCall(const plugin::TickClock& clock, std::atomic<std::uint64_t>& ticks,
            std::atomic<std::uint64_t>& calls) noexcept
      : clock_(clock), ticks_(ticks), calls_(calls), start_(clock.now()) {}
  ~TimedCall() {
    ticks_.fetch_add(clock_.now() - start_, std::memory_order_relaxed);
    calls_.fetch_add(1, std::memory_order_relaxed);
  }
  TimedCall(const TimedCall&) = delete;
  TimedCall& operator=(const TimedCall&) = delete;

 private:
  const plugin::TickClock& clock_;
  std::atomic<std::uint64_t>& ticks_;
  std::atomic<std::uint64_t>& calls_;
  std::uint64_t start_;
};

/// The DataPtr deleter for inner deleter slot `Slot` (Note [Timing another allocator's frees]).
template <std::size_t Slot>
void timed_delete(void* context) {
  if (TimedAllocator* timed = TimedAllocator::instance()) {
    timed->timed_inner_delete(Slot, context);
  }
}

template <std::size_t... Slots>
constexpr std::array<c10::DeleterFnPtr, sizeof...(Slots)> make_trampolines(std::index_sequence<Slots...>) {
  return {&timed_delete<Slots>...};
}

constexpr auto kTrampolines = make_trampolines(std::make_index_sequence<TimedAllocator::kMaxInnerDeleters>{});

/// A DataPtr that shows `ptr` with another deleter and owns nothing: its context is released
/// before it is destroyed, whatever the call made with it does.
class DataPtrView {
 public:
  DataPtrView(const c10::DataPtr& ptr, c10::DeleterFnPtr deleter)
      : view_(ptr.get(), ptr.get_context(), deleter, ptr.device()) {}
  ~DataPtrView() { (void)view_.release_context(); }
  DataPtrView(const DataPtrView&) = delete;
  DataPtrView& operator=(const DataPtrView&) = delete;
  [[nodiscard]] const c10::DataPtr& get() const noexcept { return view_; }

 private:
  c10::DataPtr view_;
};

}  // namespace

TimedAllocator::TimedAllocator(cca::CUDAAllocator* inner) : inner_(inner) {
  TORCH_CHECK(inner_ != nullptr, "TimedAllocator: no allocator to wrap");
}

TimedAllocator::~TimedAllocator() = default;

TimedAllocator* TimedAllocator::instance() noexcept { return g_instance.load(std::memory_order_acquire); }

void TimedAllocator::set_instance(TimedAllocator* allocator) noexcept {
  g_instance.store(allocator, std::memory_order_release);
}

TimedTotals TimedAllocator::totals() const noexcept {
  TimedTotals t;
  t.alloc_calls = alloc_calls_.load(std::memory_order_relaxed);
  t.free_calls = free_calls_.load(std::memory_order_relaxed);
  t.alloc_ns = clock_.to_ns(alloc_ticks_.load(std::memory_order_relaxed));
  t.free_ns = clock_.to_ns(free_ticks_.load(std::memory_order_relaxed));
  return t;
}

// ---------------------------------------------------------------------------------------------
// Deleters (Note [Timing another allocator's frees])

std::size_t TimedAllocator::slot_of(c10::DeleterFnPtr inner_deleter) const {
  for (std::size_t i = 0; i < kMaxInnerDeleters; ++i) {
    c10::DeleterFnPtr seen = inner_deleters_[i].load(std::memory_order_acquire);
    if (seen == nullptr &&
        inner_deleters_[i].compare_exchange_strong(seen, inner_deleter, std::memory_order_acq_rel)) {
      return i;
    }
    if (seen == inner_deleter) {  // known, or another thread registered it just now
      return i;
    }
  }
  C10_THROW_ERROR(Error, c10::str("cachealloc's timing wrapper: the allocator it wraps ('", inner_->name(),
                                  "') uses more than ", kMaxInnerDeleters,
                                  " different DataPtr deleters; its frees cannot be timed"));
}

std::size_t TimedAllocator::trampoline_slot(c10::DeleterFnPtr deleter) noexcept {
  for (std::size_t i = 0; i < kTrampolines.size(); ++i) {
    if (kTrampolines[i] == deleter) {
      return i;
    }
  }
  return kMaxInnerDeleters;
}

c10::DataPtr TimedAllocator::wrap(c10::DataPtr inner) const {
  if (inner.get() == nullptr) {
    return inner;  // zero bytes: nothing will be freed
  }
  TORCH_CHECK(inner.get_context() == inner.get(), "cachealloc's timing wrapper: the allocator it wraps ('",
              inner_->name(), "') returned a DataPtr whose context is not its data pointer; it keeps state "
              "in the context, so its deleter cannot be replaced and its frees cannot be timed");
  const c10::DeleterFnPtr deleter = kTrampolines[slot_of(inner.get_deleter())];
  const c10::Device device = inner.device();
  void* ptr = inner.release_context();
  return {ptr, ptr, deleter, device};
}

void TimedAllocator::timed_inner_delete(std::size_t slot, void* context) {
  const c10::DeleterFnPtr inner_deleter = inner_deleters_[slot].load(std::memory_order_acquire);
  TimedCall call(clock_, free_ticks_, free_calls_);
  inner_deleter(context);
}

c10::DeleterFnPtr TimedAllocator::raw_deleter() const {
  const c10::DeleterFnPtr inner_deleter = inner_->raw_deleter();
  return inner_deleter == nullptr ? nullptr : kTrampolines[slot_of(inner_deleter)];
}

bool TimedAllocator::is_simple_data_ptr(const c10::DataPtr& data_ptr) const {
  return inner_->is_simple_data_ptr(data_ptr);
}

// ---------------------------------------------------------------------------------------------
// The timed paths

c10::DataPtr TimedAllocator::allocate(size_t nbytes) {
  c10::DataPtr inner;
  {
    TimedCall call(clock_, alloc_ticks_, alloc_calls_);
    inner = inner_->allocate(nbytes);
  }
  return wrap(std::move(inner));  // on failure `inner` frees itself through its own deleter
}

void* TimedAllocator::raw_alloc(size_t nbytes) {
  TimedCall call(clock_, alloc_ticks_, alloc_calls_);
  return inner_->raw_alloc(nbytes);
}

void* TimedAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  TimedCall call(clock_, alloc_ticks_, alloc_calls_);
  return inner_->raw_alloc_with_stream(nbytes, stream);
}

void TimedAllocator::raw_delete(void* ptr) {
  TimedCall call(clock_, free_ticks_, free_calls_);
  inner_->raw_delete(ptr);
}

// ---------------------------------------------------------------------------------------------
// Paths that see DataPtrs: the inner deleter put back, or ours put in

void TimedAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  const std::size_t slot = trampoline_slot(ptr.get_deleter());
  if (slot == kMaxInnerDeleters) {
    inner_->recordStream(ptr, stream);  // not ours (e.g. from_blob, IPC): as it is
    return;
  }
  const DataPtrView view(ptr, inner_deleters_[slot].load(std::memory_order_acquire));
  inner_->recordStream(view.get(), stream);
}

cca::CheckpointDelta TimedAllocator::setCheckpointPoolState(c10::DeviceIndex device,
                                                            std::shared_ptr<cca::AllocatorState> pps) {
  cca::CheckpointDelta delta = inner_->setCheckpointPoolState(device, std::move(pps));
  for (c10::DataPtr& dp : delta.dataptrs_allocd) {
    dp = wrap(std::move(dp));  // storages get these: their frees must be timed like the others
  }
  return delta;
}

// ---------------------------------------------------------------------------------------------
// Forwarded as they are

void TimedAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  inner_->copy_data(dest, src, count);
}

bool TimedAllocator::initialized() { return inner_->initialized(); }

void TimedAllocator::emptyCache(c10::MempoolId_t mempool_id) { inner_->emptyCache(mempool_id); }

cca::DeviceStats TimedAllocator::getDeviceStats(c10::DeviceIndex device) { return inner_->getDeviceStats(device); }

void TimedAllocator::resetAccumulatedStats(c10::DeviceIndex device) { inner_->resetAccumulatedStats(device); }

void TimedAllocator::resetPeakStats(c10::DeviceIndex device) { inner_->resetPeakStats(device); }

std::pair<size_t, size_t> TimedAllocator::getMemoryInfo(c10::DeviceIndex device) {
  return inner_->getMemoryInfo(device);
}

void TimedAllocator::init(int device_count) { inner_->init(device_count); }

double TimedAllocator::getMemoryFraction(c10::DeviceIndex device) { return inner_->getMemoryFraction(device); }

void TimedAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  inner_->setMemoryFraction(fraction, device);
}

std::vector<cca::StreamSegmentSize> TimedAllocator::getExpandableSegmentSizes(c10::DeviceIndex device) {
  return inner_->getExpandableSegmentSizes(device);
}

void TimedAllocator::enable(bool value) { inner_->enable(value); }

bool TimedAllocator::isEnabled() const { return inner_->isEnabled(); }

void TimedAllocator::cacheInfo(c10::DeviceIndex device, size_t* largest_block) {
  inner_->cacheInfo(device, largest_block);
}

void* TimedAllocator::getBaseAllocation(void* ptr, size_t* size) { return inner_->getBaseAllocation(ptr, size); }

cca::SnapshotInfo TimedAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  return inner_->snapshot(mempool_id, include_traces);
}

void TimedAllocator::beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                         std::function<bool(cudaStream_t)> filter) {
  inner_->beginAllocateToPool(device, mempool_id, std::move(filter));
}

void TimedAllocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  inner_->endAllocateToPool(device, mempool_id);
}

void TimedAllocator::releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  inner_->releasePool(device, mempool_id);
}

int TimedAllocator::getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  return inner_->getPoolUseCount(device, mempool_id);
}

void TimedAllocator::createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                        std::shared_ptr<cca::CUDAAllocator> allocator) {
  inner_->createOrIncrefPool(device, mempool_id, std::move(allocator));
}

void TimedAllocator::setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) {
  inner_->setUseOnOOM(device, mempool_id, use_on_oom);
}

void TimedAllocator::setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  inner_->setNoSplit(device, mempool_id);
}

bool TimedAllocator::checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                              const std::unordered_set<void*>& expected_live_allocations) {
  return inner_->checkPoolLiveAllocations(device, mempool_id, expected_live_allocations);
}

cca::ShareableHandle TimedAllocator::shareIpcHandle(void* ptr) { return inner_->shareIpcHandle(ptr); }

std::shared_ptr<void> TimedAllocator::getIpcDevPtr(std::string handle) {
  return inner_->getIpcDevPtr(std::move(handle));
}

bool TimedAllocator::isHistoryEnabled() { return inner_->isHistoryEnabled(); }

void TimedAllocator::recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                                   cca::RecordContext when, bool clear_history,
                                   const std::vector<std::string>& skip_actions) {
  inner_->recordHistory(enabled, context_recorder, alloc_trace_max_entries, when, clear_history, skip_actions);
}

void TimedAllocator::recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) {
  inner_->recordAnnotation(md);
}

void TimedAllocator::pushCompileContext(std::string& md) { inner_->pushCompileContext(md); }

void TimedAllocator::popCompileContext() { inner_->popCompileContext(); }

void TimedAllocator::setUserMetadata(const std::string& metadata) { inner_->setUserMetadata(metadata); }

std::string TimedAllocator::getUserMetadata() { return inner_->getUserMetadata(); }

void TimedAllocator::attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) {
  inner_->attachOutOfMemoryObserver(std::move(observer));
}

void TimedAllocator::attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) {
  inner_->attachAllocatorTraceTracker(std::move(tracker));
}

void TimedAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  inner_->enablePeerAccess(dev, dev_to_access);
}

cudaError_t TimedAllocator::memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                                        cudaStream_t stream, bool p2p_enabled) {
  return inner_->memcpyAsync(dst, dst_device, src, src_device, count, stream, p2p_enabled);
}

std::shared_ptr<cca::AllocatorState> TimedAllocator::getCheckpointState(c10::DeviceIndex device,
                                                                        c10::MempoolId_t id) {
  return inner_->getCheckpointState(device, id);
}

std::string TimedAllocator::name() { return inner_->name(); }

}  // namespace cachealloc::torch_adapter
