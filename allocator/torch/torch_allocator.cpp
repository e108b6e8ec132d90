// torch_allocator.cpp: the c10 CUDAAllocator methods over the plugin runtime (torch_allocator.h).
#include "torch_allocator.h"

#include "log.h"
#include "runtime.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cachealloc/cuda/streams.h>
#include <cachealloc/errors.h>
#include <cachealloc/record_thread.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace cachealloc::torch_adapter {
namespace {

std::atomic<TorchAllocator*> g_instance{nullptr};

// What the allocator observer (on_event, called inside allocate/deallocate on this thread)
// attaches to the trace entries of the call in progress.
thread_local std::shared_ptr<c10::GatheredContext> t_context;
thread_local c10::MempoolId_t t_pool{0, 0};

class CallScope {
 public:
  CallScope(std::shared_ptr<c10::GatheredContext> context, c10::MempoolId_t pool) noexcept {
    t_context = std::move(context);
    t_pool = pool;
  }
  ~CallScope() {
    t_context.reset();
    t_pool = {0, 0};
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
};

void delete_through_adapter(void* ptr) {
  if (TorchAllocator* a = TorchAllocator::instance()) {
    a->free(ptr);
  }
}

StreamId to_id(cudaStream_t stream) noexcept {
  return static_cast<StreamId>(reinterpret_cast<std::uintptr_t>(stream));
}

bool is_default_pool(c10::MempoolId_t id) noexcept { return id.first == 0 && id.second == 0; }

std::string pool_text(c10::MempoolId_t id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

[[noreturn]] void unsupported(const char* method, const char* what) {
  C10_THROW_ERROR(Error, std::string("cachealloc does not support ") + method + " (" + what +
                             "); use PyTorch's own CUDA allocator (do not install cachealloc) for this");
}

void add(c10::CachingAllocator::Stat& to, const cachealloc::Stat& from) noexcept {
  to.current += from.current;
  to.peak += from.peak;
  to.allocated += from.allocated;
  to.freed += from.freed;
}

constexpr auto kAggregate = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);

/// One of our segments as PyTorch's SegmentInfo; blocks in address order, gaps shown inactive
/// (PyTorch computes each block's address by adding up the sizes before it).
cca::SegmentInfo to_segment_info(const CoreAllocator& allocator, const SegmentView& seg, int device,
                                 c10::MempoolId_t pool, bool expandable) {
  cca::SegmentInfo info;
  info.device = static_cast<c10::DeviceIndex>(device);
  info.address = seg.address;
  info.total_size = seg.size;
  info.stream = reinterpret_cast<void*>(static_cast<std::uintptr_t>(seg.stream));
  info.is_large = !seg.small_pool;
  info.is_expandable = expandable;
  info.owner_private_pool_id = pool;
  std::vector<BlockView> blocks = seg.blocks;
  std::sort(blocks.begin(), blocks.end(),
            [](const BlockView& a, const BlockView& b) { return a.address < b.address; });
  std::uintptr_t cursor = seg.address;
  auto add_inactive = [&](std::size_t size) {
    cca::BlockInfo gap;
    gap.size = size;
    info.blocks.push_back(gap);
  };
  for (const BlockView& b : blocks) {
    if (b.address < cursor || b.address + b.size > seg.address + seg.size) {
      continue;  // overlapping or outside: not drawable
    }
    if (b.address > cursor) {
      add_inactive(b.address - cursor);
    }
    cca::BlockInfo block;
    block.size = b.size;
    block.allocated = b.allocated;
    block.active = b.allocated;
    if (b.allocated) {
      const auto live = allocator.find(reinterpret_cast<const void*>(b.address));
      block.requested_size = live ? live->requested : b.size;
      info.allocated_size += b.size;
      info.active_size += b.size;
      info.requested_size += block.requested_size;
    }
    info.blocks.push_back(std::move(block));
    cursor = b.address + b.size;
  }
  if (cursor < seg.address + seg.size) {
    add_inactive(seg.address + seg.size - cursor);
  }
  return info;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Set-up

TorchAllocator::TorchAllocator(std::string conf_text) : conf_text_(std::move(conf_text)) {}

TorchAllocator::~TorchAllocator() = default;

TorchAllocator* TorchAllocator::instance() noexcept { return g_instance.load(std::memory_order_acquire); }

void TorchAllocator::set_instance(TorchAllocator* allocator) noexcept {
  g_instance.store(allocator, std::memory_order_release);
}

plugin::Runtime& TorchAllocator::runtime() {
  try {
    return plugin::Runtime::get();
  } catch (const cachealloc::Error& e) {
    C10_THROW_ERROR(Error, e.what());
  }
}

void TorchAllocator::on_event(int device, AllocatorEvent event, std::uintptr_t addr, std::size_t size,
                              StreamId stream) noexcept {
  history_.record(device, event, addr, size, stream, t_pool, t_context);
}

void TorchAllocator::init(int device_count) {
  plugin::Runtime& rt = runtime();
  if (device_count != rt.device_count()) {
    plugin::log_warn("PyTorch sees " + std::to_string(device_count) + " device(s), cachealloc " +
                     std::to_string(rt.device_count()));
  }
  initialized_.store(true, std::memory_order_release);
}

bool TorchAllocator::initialized() { return initialized_.load(std::memory_order_acquire); }

void TorchAllocator::enable(bool value) { enabled_.store(value, std::memory_order_release); }

bool TorchAllocator::isEnabled() const { return enabled_.load(std::memory_order_acquire); }

std::string TorchAllocator::name() { return "cachealloc"; }

// ---------------------------------------------------------------------------------------------
// Allocation and free

c10::DataPtr TorchAllocator::allocate(size_t nbytes) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  void* ptr = malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  return {ptr, ptr, &delete_through_adapter, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr TorchAllocator::raw_deleter() const { return &delete_through_adapter; }

void* TorchAllocator::raw_alloc(size_t nbytes) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* TorchAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  return malloc(nbytes, c10::cuda::current_device(), stream);
}

void TorchAllocator::raw_delete(void* ptr) { free(ptr); }

TorchAllocator::Pool* TorchAllocator::routed_pool(int device, cudaStream_t stream) {
  std::lock_guard lock(pools_mutex_);
  for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {  // newest first, as PyTorch
    if (it->device == device && it->filter(stream)) {
      Pool& pool = *pools_.at({device, it->id});
      pool.live_blocks.fetch_add(1, std::memory_order_relaxed);  // keeps it alive until registered
      return &pool;
    }
  }
  return nullptr;
}

void* TorchAllocator::malloc(std::size_t bytes, int device, cudaStream_t stream) {
  if (bytes == 0) {
    return nullptr;
  }
  plugin::Runtime& rt = runtime();
  Pool* pool = captures_underway_.load(std::memory_order_acquire) > 0 ? routed_pool(device, stream) : nullptr;
  CoreAllocator* target = nullptr;
  void* ptr = nullptr;
  try {
    CallScope scope(history_.gather(/*free=*/false), pool != nullptr ? pool->id : c10::MempoolId_t{0, 0});
    if (pool != nullptr) {
      target = pool->allocator.get();
      ptr = target->allocate(bytes, to_id(stream));
    } else {
      target = &rt.allocator(device);
      ptr = rt.allocate(bytes, device, to_id(stream));
    }
    if (ptr == nullptr) {
      throw OutOfMemory("cachealloc: the policy returned no memory for " + std::to_string(bytes) + " bytes",
                        bytes);
    }
    std::lock_guard lock(owners_mutex_);
    owners_.emplace(ptr, Owner{target, pool, device});
  } catch (...) {
    if (ptr != nullptr) {  // owners_.emplace failed (host memory): give the block back
      try {
        target->deallocate(ptr);
      } catch (...) {  // NOLINT(bugprone-empty-catch): nothing more can be done
      }
    }
    if (pool != nullptr && pool->live_blocks.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lock(pools_mutex_);
      collect_idle_pools();
    }
    try {
      throw;
    } catch (const OutOfMemory& e) {
      if (target == nullptr) {
        C10_THROW_ERROR(Error, e.what());
      }
      raise_out_of_memory(device, *target, e.what());
    } catch (const cachealloc::Error& e) {
      C10_THROW_ERROR(Error, e.what());
    }
  }
  return ptr;
}

void TorchAllocator::raise_out_of_memory(int device, const CoreAllocator& allocator, const std::string& what) {
  const Stats stats = allocator.stats();
  std::size_t total = 0;
  std::size_t free_bytes = 0;
  try {
    DeviceBackend& backend = const_cast<CoreAllocator&>(allocator).backend();
    total = backend.total_memory();
    free_bytes = backend.free_memory();
  } catch (...) {  // NOLINT(bugprone-empty-catch): the observers get zeros
  }
  std::vector<cca::OutOfMemoryObserver> observers;
  {
    std::lock_guard lock(observers_mutex_);
    observers = oom_observers_;
  }
  for (const auto& observer : observers) {
    observer(device, static_cast<std::size_t>(stats.allocated_bytes.current), total, free_bytes);
  }
  std::string message = what;
  if (plugin::Runtime* rt = plugin::Runtime::existing()) {
    message += plugin::out_of_memory_advice(rt->settings(), rt->conf_text());
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  throw std::logic_error("unreachable");  // TORCH_CHECK_WITH(false) always throws
}

std::optional<TorchAllocator::Owner> TorchAllocator::owner_of(const void* ptr) const {
  std::lock_guard lock(owners_mutex_);
  const auto it = owners_.find(const_cast<void*>(ptr));
  if (it == owners_.end()) {
    return std::nullopt;
  }
  return it->second;
}

void TorchAllocator::free(void* ptr) noexcept {
  if (ptr == nullptr) {
    return;
  }
  Owner owner{};
  {
    std::lock_guard lock(owners_mutex_);
    const auto it = owners_.find(ptr);
    if (it == owners_.end()) {
      plugin::log_error("cachealloc: free of a pointer it did not hand out (double free?); ignored");
      return;
    }
    owner = it->second;
    owners_.erase(it);
  }
  try {
    CallScope scope(history_.gather(/*free=*/true), owner.pool != nullptr ? owner.pool->id : c10::MempoolId_t{0, 0});
    if (owner.pool == nullptr) {
      plugin::Runtime::get().deallocate(ptr, owner.device);
    } else {
      owner.allocator->deallocate(ptr);
    }
  } catch (const std::exception& e) {
    plugin::log_error(std::string(e.what()) + " (the free was ignored)");
  }
  if (owner.pool != nullptr && owner.pool->live_blocks.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    try {
      std::lock_guard lock(pools_mutex_);
      collect_idle_pools();
    } catch (const std::exception& e) {
      plugin::log_error(std::string("releasing an unused private pool failed: ") + e.what());
    }
  }
}

void TorchAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  void* p = ptr.get();
  if (p == nullptr || ptr.get_deleter() != &delete_through_adapter) {
    return;  // not ours (e.g. from_blob): nothing to track, as PyTorch's allocator
  }
  const auto owner = owner_of(p);
  if (!owner) {
    return;
  }
  try {
    owner->allocator->record_stream(p, to_id(stream.stream()));
  } catch (const cachealloc::Error& e) {
    C10_THROW_ERROR(Error, e.what());
  }
}

void* TorchAllocator::getBaseAllocation(void* ptr, size_t* size) {
  const auto owner = owner_of(ptr);
  TORCH_CHECK(owner.has_value(), "cachealloc: getBaseAllocation(", ptr, "): not a live allocation of cachealloc");
  void* base = plugin::find_base_allocation(*owner->allocator, ptr, size);
  TORCH_CHECK(base != nullptr, "cachealloc: getBaseAllocation(", ptr, "): no segment holds it");
  return base;
}

// ---------------------------------------------------------------------------------------------
// Private pools (Note [Private pools])

TorchAllocator::Pool& TorchAllocator::pool_create_or_incref(int device, c10::MempoolId_t id) {
  auto it = pools_.find({device, id});
  if (it != pools_.end()) {
    ++it->second->use_count;
    return *it->second;
  }
  auto pool = std::make_unique<Pool>();
  pool->id = id;
  pool->device = device;
  pool->use_count = 1;
  try {
    pool->allocator = runtime().create_allocator(device);
    if (const auto f = fractions_.find(device); f != fractions_.end()) {
      pool->allocator->set_memory_fraction(f->second);
    }
  } catch (const cachealloc::Error& e) {
    C10_THROW_ERROR(Error, e.what());
  }
  plugin::log_info("device " + std::to_string(device) + ": private pool " + pool_text(id) + " created");
  return *pools_.emplace(PoolKey{device, id}, std::move(pool)).first->second;
}

void TorchAllocator::collect_idle_pools() {
  if (captures_underway_.load(std::memory_order_acquire) > 0) {
    return;  // destroying frees memory (cudaFree): after the capture
  }
  for (auto it = pools_.begin(); it != pools_.end();) {
    Pool& pool = *it->second;
    if (pool.use_count == 0 && pool.live_blocks.load(std::memory_order_acquire) == 0) {
      plugin::log_info("device " + std::to_string(pool.device) + ": private pool " + pool_text(pool.id) +
                       " released");
      it = pools_.erase(it);
    } else {
      ++it;
    }
  }
}

void TorchAllocator::beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                         std::function<bool(cudaStream_t)> filter) {
  plugin::Runtime& rt = runtime();
  TORCH_CHECK(rt.settings().backend_kind != "stream_ordered", "cachealloc: policy:", rt.settings().policy,
              " (a stream-ordered cudaMallocAsync pool) does not support CUDA graph capture or "
              "torch.cuda.use_mem_pool (beginAllocateToPool); use policy:size_class, defrag or native for "
              "CUDA graphs and torch.compile(mode=\"reduce-overhead\")");
  std::lock_guard lock(pools_mutex_);
  for (const Route& r : routes_) {
    TORCH_CHECK(!(r.device == device && r.id == mempool_id), "beginAllocateToPool: already recording to mempool_id ",
                pool_text(mempool_id));
  }
  pool_create_or_incref(device, mempool_id);
  routes_.push_back(Route{device, mempool_id, std::move(filter)});
  captures_underway_.fetch_add(1, std::memory_order_acq_rel);
  // The capture guard posts no record from now on; those already posted are recorded before
  // PyTorch begins the capture (Note [Event records on a thread of their own]), and no record
  // thread queries an event until it ended (Note [The record thread watches its events]).
  drain_record_threads();
  pause_record_thread_polls();
}

void TorchAllocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  std::lock_guard lock(pools_mutex_);
  const auto it = std::find_if(routes_.begin(), routes_.end(),
                               [&](const Route& r) { return r.device == device && r.id == mempool_id; });
  TORCH_CHECK(it != routes_.end(), "endAllocateToPool: not currently recording to mempool_id ", pool_text(mempool_id));
  routes_.erase(it);
  captures_underway_.fetch_sub(1, std::memory_order_acq_rel);
  resume_record_thread_polls();  // one per beginAllocateToPool's pause
  collect_idle_pools();
}

void TorchAllocator::releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  std::lock_guard lock(pools_mutex_);
  const auto it = pools_.find({device, mempool_id});
  TORCH_CHECK(it != pools_.end(), "releasePool: no private pool ", pool_text(mempool_id), " on device ",
              static_cast<int>(device));
  TORCH_CHECK(it->second->use_count > 0, "releasePool: pool ", pool_text(mempool_id), " is not in use");
  --it->second->use_count;
  collect_idle_pools();
}

int TorchAllocator::getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  std::lock_guard lock(pools_mutex_);
  const auto it = pools_.find({device, mempool_id});
  return it == pools_.end() ? 0 : it->second->use_count;
}

void TorchAllocator::createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                        std::shared_ptr<cca::CUDAAllocator> allocator) {
  if (allocator) {
    unsupported("createOrIncrefPool", "torch.cuda.MemPool(allocator=...) with another allocator");
  }
  std::lock_guard lock(pools_mutex_);
  pool_create_or_incref(device, mempool_id);
}

void TorchAllocator::setUseOnOOM(c10::DeviceIndex /*device*/, c10::MempoolId_t /*mempool_id*/, bool use_on_oom) {
  if (use_on_oom) {
    unsupported("setUseOnOOM", "torch.cuda.MemPool(use_on_oom=True)");
  }
}

void TorchAllocator::setNoSplit(c10::DeviceIndex /*device*/, c10::MempoolId_t mempool_id) {
  // A hint: each policy decides about splitting itself.
  plugin::log_info("MemPool(no_split=True) for pool " + pool_text(mempool_id) + ": ignored (the policy decides)");
}

bool TorchAllocator::checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                              const std::unordered_set<void*>& expected_live_allocations) {
  std::unordered_set<void*> live;
  {
    std::lock_guard lock(owners_mutex_);
    for (const auto& [ptr, owner] : owners_) {
      if (owner.pool != nullptr && owner.device == device && owner.pool->id == mempool_id) {
        live.insert(ptr);
      }
    }
  }
  return live == expected_live_allocations;
}

// ---------------------------------------------------------------------------------------------
// Cache, limits, statistics

std::vector<std::pair<CoreAllocator*, c10::MempoolId_t>> TorchAllocator::allocators_of(int device) {
  std::vector<std::pair<CoreAllocator*, c10::MempoolId_t>> out;
  if (plugin::Runtime* rt = plugin::Runtime::existing()) {
    if (CoreAllocator* a = rt->allocator_if_created(device)) {
      out.emplace_back(a, c10::MempoolId_t{0, 0});
    }
  }
  for (const auto& [key, pool] : pools_) {
    if (key.first == device) {
      out.emplace_back(pool->allocator.get(), pool->id);
    }
  }
  return out;
}

void TorchAllocator::emptyCache(c10::MempoolId_t mempool_id) {
  if (captures_underway_.load(std::memory_order_acquire) > 0) {
    // Releasing memory waits for streams and calls cudaFree, both illegal during a capture.
    plugin::log_warn("torch.cuda.empty_cache() during CUDA graph capture or torch.cuda.use_mem_pool: ignored");
    return;
  }
  try {
    std::lock_guard lock(pools_mutex_);
    if (is_default_pool(mempool_id)) {
      if (plugin::Runtime* rt = plugin::Runtime::existing()) {
        rt->empty_cache(-1);
      }
    }
    for (auto& [key, pool] : pools_) {
      // A pool still in use keeps its cache unless named: a captured graph replays into the
      // blocks it freed during capture.
      if (key.second == mempool_id || (is_default_pool(mempool_id) && pool->use_count == 0)) {
        pool->allocator->empty_cache();
      }
    }
    collect_idle_pools();
  } catch (const cachealloc::Error& e) {
    C10_THROW_ERROR(Error, e.what());
  }
}

double TorchAllocator::getMemoryFraction(c10::DeviceIndex device) {
  std::lock_guard lock(pools_mutex_);
  const auto it = fractions_.find(device);
  return it == fractions_.end() ? 1.0 : it->second;
}

void TorchAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  try {
    runtime().set_memory_fraction(fraction, device);
    std::lock_guard lock(pools_mutex_);
    fractions_[device] = fraction;
    for (auto& [key, pool] : pools_) {
      if (key.first == device) {
        pool->allocator->set_memory_fraction(fraction);
      }
    }
  } catch (const cachealloc::Error& e) {
    C10_THROW_ERROR(Error, e.what());
  }
}

std::vector<cca::StreamSegmentSize> TorchAllocator::getExpandableSegmentSizes(c10::DeviceIndex /*device*/) {
  return {};  // no PyTorch expandable segments here (policy:defrag maps its own)
}

void TorchAllocator::cacheInfo(c10::DeviceIndex device, size_t* largest_block) {
  if (*largest_block == 0) {  // an initial guess, as PyTorch's allocator: what the device has free
    CudaDeviceGuard guard(device);
    std::size_t free_bytes = 0;
    std::size_t total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    *largest_block = free_bytes;
  }
  plugin::Runtime* rt = plugin::Runtime::existing();
  CoreAllocator* a = rt != nullptr ? rt->allocator_if_created(device) : nullptr;
  if (a == nullptr) {
    return;
  }
  for (const SegmentView& seg : a->segments()) {
    for (const BlockView& b : seg.blocks) {
      if (!b.allocated) {
        *largest_block = std::max(*largest_block, b.size);
      }
    }
  }
}

cca::DeviceStats TorchAllocator::getDeviceStats(c10::DeviceIndex device) {
  cca::DeviceStats out;
  out.max_split_size = -1;  // no max_split_size_mb: unlimited, as PyTorch reports it
  std::lock_guard lock(pools_mutex_);
  for (const auto& [allocator, id] : allocators_of(device)) {
    const Stats s = allocator->stats();
    add(out.allocation[kAggregate], s.allocation);
    add(out.active[kAggregate], s.active);
    add(out.allocated_bytes[kAggregate], s.allocated_bytes);
    add(out.reserved_bytes[kAggregate], s.reserved_bytes);
    add(out.active_bytes[kAggregate], s.active_bytes);
    add(out.requested_bytes[kAggregate], s.requested_bytes);
    const auto segments = static_cast<std::int64_t>(s.num_device_alloc) - static_cast<std::int64_t>(s.num_device_free);
    out.segment[kAggregate].current += std::max<std::int64_t>(segments, 0);
    out.segment[kAggregate].allocated += static_cast<std::int64_t>(s.num_device_alloc);
    out.segment[kAggregate].freed += static_cast<std::int64_t>(s.num_device_free);
    out.segment[kAggregate].peak = std::max(out.segment[kAggregate].peak, out.segment[kAggregate].current);
    out.num_alloc_retries += static_cast<std::int64_t>(s.num_alloc_retries);
    out.num_ooms += static_cast<std::int64_t>(s.num_ooms);
    out.num_sync_all_streams += static_cast<std::int64_t>(s.num_sync_all_streams);
    out.num_device_alloc += static_cast<std::int64_t>(s.num_device_alloc);
    out.num_device_free += static_cast<std::int64_t>(s.num_device_free);
  }
  return out;
}

void TorchAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  std::lock_guard lock(pools_mutex_);
  if (plugin::Runtime* rt = plugin::Runtime::existing()) {
    rt->reset_accumulated(device);
  }
  for (auto& [key, pool] : pools_) {
    if (key.first == device) {
      pool->allocator->reset_accumulated_stats();
    }
  }
}

void TorchAllocator::resetPeakStats(c10::DeviceIndex device) {
  std::lock_guard lock(pools_mutex_);
  if (plugin::Runtime* rt = plugin::Runtime::existing()) {
    rt->reset_peak(device);
  }
  for (auto& [key, pool] : pools_) {
    if (key.first == device) {
      pool->allocator->reset_peak_stats();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Snapshots, history, observers

cca::SnapshotInfo TorchAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  cca::SnapshotInfo out;
  plugin::Runtime* rt = plugin::Runtime::existing();
  const int device_count = rt != nullptr ? rt->device_count() : 0;
  const bool expandable = rt != nullptr && rt->settings().backend_kind == "virtual_memory";
  {
    std::lock_guard lock(pools_mutex_);
    for (int d = 0; d < device_count; ++d) {
      for (const auto& [allocator, id] : allocators_of(d)) {
        if (!is_default_pool(mempool_id) && id != mempool_id) {
          continue;
        }
        for (const SegmentView& seg : allocator->segments()) {
          out.segments.push_back(to_segment_info(*allocator, seg, d, id, expandable));
        }
      }
    }
  }
  out.device_traces = include_traces ? history_.traces(static_cast<std::size_t>(device_count))
                                     : std::vector<std::vector<cca::TraceEntry>>(static_cast<std::size_t>(device_count));
  cca::AllocatorConfigInfo& config = out.config_metadata;
  config.garbage_collection_threshold = 0.0;
  config.max_split_size = std::numeric_limits<std::size_t>::max();
  config.pinned_num_register_threads = 1;
  config.expandable_segments = expandable;
  config.release_lock_on_malloc = false;
  config.pinned_use_host_register = false;
  config.graph_capture_record_stream_reuse = false;
  config.last_allocator_settings = "cachealloc:" + conf_text_;
  return out;
}

bool TorchAllocator::isHistoryEnabled() { return history_.enabled(); }

void TorchAllocator::recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                                   cca::RecordContext when, bool clear_history,
                                   const std::vector<std::string>& skip_actions) {
  history_.configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history, skip_actions);
}

void TorchAllocator::attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) {
  std::lock_guard lock(observers_mutex_);
  oom_observers_.push_back(std::move(observer));
}

void TorchAllocator::attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) {
  history_.attach_tracker(std::move(tracker));
}

// ---------------------------------------------------------------------------------------------
// Copies and peers

void TorchAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

void TorchAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  CudaDeviceGuard guard(dev);
  const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // already on: clear the sticky error
    return;
  }
  C10_CUDA_CHECK(err);
}

cudaError_t TorchAllocator::memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                                        cudaStream_t stream, bool p2p_enabled) {
  if (p2p_enabled || dst_device == src_device) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  // Virtual-memory segments (policy:defrag) are only reachable from another device this way.
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
}

// ---------------------------------------------------------------------------------------------
// Not supported

cca::ShareableHandle TorchAllocator::shareIpcHandle(void* /*ptr*/) {
  unsupported("shareIpcHandle", "CUDA IPC: sharing CUDA tensors with another process");
}

std::shared_ptr<void> TorchAllocator::getIpcDevPtr(std::string /*handle*/) {
  unsupported("getIpcDevPtr", "CUDA IPC: opening a CUDA tensor of another process");
}

namespace {
/// What getCheckpointState hands out (Note [Checkpoints of private pools]).
struct UnrestorableCheckpoint final : cca::AllocatorState {};
}  // namespace

// Note [Checkpoints of private pools]
// CUDA graph trees (torch.compile(mode="reduce-overhead")) take a checkpoint of the graph pool
// after recording every graph, and restore one only when they start recording a new path from
// a node already replayed. cachealloc cannot restore a pool's state, so the checkpoint it hands
// out is a token, and restoring it (setCheckpointPoolState) fails with a message that says so:
// models whose graphs follow one path per function run; a tree that branches stops with that
// error instead of running on a wrong pool state.
std::shared_ptr<cca::AllocatorState> TorchAllocator::getCheckpointState(c10::DeviceIndex /*device*/,
                                                                        c10::MempoolId_t /*id*/) {
  return std::make_shared<UnrestorableCheckpoint>();
}

cca::CheckpointDelta TorchAllocator::setCheckpointPoolState(c10::DeviceIndex /*device*/,
                                                            std::shared_ptr<cca::AllocatorState> /*pps*/) {
  unsupported("setCheckpointPoolState",
              "restoring a checkpoint of a CUDA graph pool (CUDA graph trees recording a new path, "
              "Note [Checkpoints of private pools]); set torch._inductor.config.triton.cudagraph_trees = False "
              "to use CUDA graphs without trees");
}

}  // namespace cachealloc::torch_adapter
