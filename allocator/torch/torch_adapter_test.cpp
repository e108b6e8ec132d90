// torch_adapter_test.cpp: what can be checked of libcachealloc_torch.so without a GPU.
//
// 1. The capture guard (capture_guard_backend.h) over the simulated backend, alone and under a
//    real policy: no event call and no device free while a capture is underway, and the parked
//    work completes once it ended.
// 2. install(): refuses a bad configuration with a message naming the problem, installs into
//    both places PyTorch reads (no CUDA call is made), refuses a different configuration
//    afterwards; the adapter's name, version, and unsupported methods. The GPU behaviour is in
//    tools/tests/test_torch_adapter.py.
// 3. The timing wrapper (timed_allocator.h), installed through time_native_install() around a
//    fake CUDAAllocator that hands out host memory and counts its calls: every timed path is
//    forwarded, counted and timed, DataPtrs free through the inner allocator's own deleter (two
//    kinds of it, as PyTorch's native allocator has), recordStream sees the inner deleter, and
//    the other methods forward. The GPU behaviour is in tools/tests/test_time_native.py.
#include "capture_guard_backend.h"

#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/sim_backend.h>
#include <cachealloc/torch/install.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>

using cachealloc::torch_adapter::CaptureGuardBackend;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

TEST_CASE("capture guard: no event call or device free during a capture", "[torch][capture]") {
  std::atomic<int> captures{0};
  auto sim = std::make_unique<cachealloc::SimBackend>(cachealloc::SimOptions{});
  cachealloc::SimBackend& inner = *sim;
  CaptureGuardBackend guard(std::move(sim), captures);

  captures = 1;
  const cachealloc::EventId deferred = guard.record_event(7);
  CHECK(inner.live_events() == 0);  // nothing recorded on the device
  CHECK_FALSE(guard.query_event(deferred));
  CHECK_THROWS_AS(guard.synchronize_event(deferred), cachealloc::DeviceError);
  void* block = guard.reserve(4 * cachealloc::kMiB);
  REQUIRE(block != nullptr);
  guard.release(block, 4 * cachealloc::kMiB);
  CHECK(guard.deferred_releases() == 1);
  CHECK(inner.held_bytes() == 4 * cachealloc::kMiB);  // cudaFree waits for the capture's end

  captures = 0;
  inner.set_auto_complete(true);
  CHECK(guard.query_event(deferred));  // recorded now, on stream 7, and complete
  CHECK(guard.deferred_releases() == 0);
  CHECK(inner.held_bytes() == 0);
  guard.destroy_event(deferred);
  CHECK(inner.live_events() == 0);
}

TEST_CASE("capture guard: a cross-stream free stays parked through a capture", "[torch][capture]") {
  std::atomic<int> captures{0};
  cachealloc::SimOptions options;
  options.auto_complete_events = true;
  auto guard = std::make_unique<CaptureGuardBackend>(std::make_unique<cachealloc::SimBackend>(options), captures);
  cachealloc::Config config;
  auto allocator = cachealloc::make_allocator("size_class", std::move(guard), config);

  void* p = allocator->allocate(1 * cachealloc::kMiB, 1);
  allocator->record_stream(p, 2);
  captures = 1;
  allocator->deallocate(p);
  CHECK(allocator->pending_frees() == 1);
  void* q = allocator->allocate(1 * cachealloc::kMiB, 1);
  CHECK(q != p);  // the parked block is not reused while stream 2 may still use it
  CHECK(allocator->pending_frees() == 1);
  allocator->deallocate(q);

  captures = 0;
  void* r = allocator->allocate(1 * cachealloc::kMiB, 1);  // polls: the late event completed
  CHECK(allocator->pending_frees() == 0);
  allocator->deallocate(r);
  allocator->check_invariants();
  allocator->empty_cache();
  CHECK(allocator->stats().reserved_bytes.current == 0);
}

TEST_CASE("install: checks, both registrations, refusals", "[torch][install]") {
  namespace cca = c10::cuda::CUDACachingAllocator;
  CHECK(std::string(cachealloc::torch::built_for_torch_version()) == TORCH_VERSION);
  CHECK(std::string(cachealloc_torch_built_for()) == TORCH_VERSION);
  REQUIRE_FALSE(cachealloc::torch::installed());
  REQUIRE(cca::allocator.load() != nullptr);
  CHECK_FALSE(cca::allocator.load()->initialized());

  SECTION("a bad configuration is refused with the reason, and nothing changes") {
    const std::string message = error_of([] { cachealloc::torch::install("policy:no_such_policy"); });
    CHECK_THAT(message, Catch::Contains("unknown policy 'no_such_policy'"));
    CHECK_THAT(message, Catch::Contains("size_class"));
    CHECK_THAT(error_of([] { cachealloc::torch::install("policy:size_class,bogus_key:1"); }),
               Catch::Contains("bogus_key"));
    char err[512] = {};
    CHECK(cachealloc_torch_install("timing:maybe", err, sizeof err) == -1);
    CHECK_THAT(std::string(err), Catch::Contains("timing"));
    CHECK_FALSE(cachealloc::torch::installed());
    CHECK(cca::allocator.load()->name() != "cachealloc");
  }

  SECTION("installs into both places, once") {
    cachealloc::torch::install("policy:size_class,full:True");
    CHECK(cachealloc::torch::installed());
    CHECK(cachealloc_torch_is_installed() == 1);
    cca::CUDAAllocator* ours = cca::allocator.load();
    CHECK(ours->name() == "cachealloc");
    CHECK(c10::GetAllocator(c10::DeviceType::CUDA) == ours);
    CHECK_FALSE(ours->initialized());  // PyTorch's lazy CUDA initialisation has not run

    cachealloc::torch::install("policy:size_class,full:True");  // same configuration: nothing happens
    CHECK_THAT(error_of([] { cachealloc::torch::install("policy:defrag"); }), Catch::Contains("already installed"));

    // What works before any device is touched.
    const auto stats = ours->getDeviceStats(0);
    CHECK(stats.allocated_bytes[0].current == 0);
    CHECK(stats.reserved_bytes[0].peak == 0);
    CHECK(ours->getPoolUseCount(0, {1, 0}) == 0);
    CHECK(ours->getMemoryFraction(0) == 1.0);
    const auto snap = ours->snapshot({0, 0}, true);
    CHECK(snap.segments.empty());
    CHECK_THAT(snap.config_metadata.last_allocator_settings, Catch::Contains("policy:size_class"));
    CHECK_FALSE(ours->isHistoryEnabled());
    ours->recordHistory(true, nullptr, 100, cca::RecordContext::ALLOC, false, {});
    CHECK(ours->isHistoryEnabled());
    ours->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
    CHECK_FALSE(ours->isHistoryEnabled());
    ours->raw_delete(nullptr);

    // Unsupported methods name themselves.
    CHECK_THAT(error_of([&] { (void)ours->shareIpcHandle(nullptr); }),
               Catch::Contains("cachealloc does not support shareIpcHandle"));
    CHECK_THAT(error_of([&] { (void)ours->getIpcDevPtr("x"); }), Catch::Contains("getIpcDevPtr"));
    // Note [Checkpoints of private pools]: a checkpoint is a token; restoring one names itself.
    CHECK(ours->getCheckpointState(0, {1, 0}) != nullptr);
    CHECK_THAT(error_of([&] { (void)ours->setCheckpointPoolState(0, ours->getCheckpointState(0, {1, 0})); }),
               Catch::Contains("setCheckpointPoolState"));
  }
}

// ---- the timing wrapper ---------------------------------------------------------------------

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

/// A CUDAAllocator over host memory that counts every call by name. Its DataPtrs free through
/// one of two deleters (cached / uncached, chosen per allocation like PyTorch's native allocator
/// under PYTORCH_NO_CUDA_MEMORY_CACHING), both counted apart from raw_delete.
class FakeAllocator final : public cca::CUDAAllocator {
 public:
  static FakeAllocator* self;

  std::map<std::string, int> calls;
  bool is_initialized = false;
  bool uncached = false;         ///< allocate() hands out the second deleter
  bool context_is_data = true;   ///< false: a DataPtr the wrapper must refuse
  c10::DeleterFnPtr recorded_deleter = nullptr;
  void* recorded_ptr = nullptr;
  int live = 0;

  static void cached_delete(void* p) {
    ++self->calls["cached_delete"];
    self->host_free(p);
  }
  static void uncached_delete(void* p) {
    ++self->calls["uncached_delete"];
    self->host_free(p);
  }
  static void context_delete(void* ctx) {
    ++self->calls["context_delete"];
    self->host_free(*static_cast<void**>(ctx));
    delete static_cast<void**>(ctx);
  }

  void* host_alloc(std::size_t n) {
    if (n == 0) {
      return nullptr;
    }
    ++live;
    return std::malloc(n);
  }
  void host_free(void* p) {
    if (p != nullptr) {
      --live;
      std::free(p);
    }
  }

  c10::DataPtr allocate(size_t n) override {
    ++calls["allocate"];
    void* p = host_alloc(n);
    const c10::Device device(c10::DeviceType::CUDA, 0);
    if (!context_is_data && p != nullptr) {
      return {p, new void*(p), &context_delete, device};
    }
    return {p, p, uncached ? &uncached_delete : &cached_delete, device};
  }
  [[nodiscard]] c10::DeleterFnPtr raw_deleter() const override { return uncached ? &uncached_delete : &cached_delete; }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {}

  bool initialized() override { return is_initialized; }
  void emptyCache(c10::MempoolId_t /*id*/) override { ++calls["emptyCache"]; }
  cca::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    ++calls["getDeviceStats"];
    cca::DeviceStats stats;
    stats.allocated_bytes[0].current = 4200 + device;
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex /*device*/) override { ++calls["resetAccumulatedStats"]; }
  void resetPeakStats(c10::DeviceIndex /*device*/) override { ++calls["resetPeakStats"]; }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex /*device*/) override {  // CUDAAllocator's asks CUDA
    return {1, 2};
  }

  void* raw_alloc(size_t n) override {
    ++calls["raw_alloc"];
    return host_alloc(n);
  }
  void* raw_alloc_with_stream(size_t n, cudaStream_t /*stream*/) override {
    ++calls["raw_alloc_with_stream"];
    return host_alloc(n);
  }
  void raw_delete(void* p) override {
    ++calls["raw_delete"];
    host_free(p);
  }
  void init(int /*device_count*/) override { ++calls["init"]; }
  double getMemoryFraction(c10::DeviceIndex /*device*/) override { return 0.25; }
  void setMemoryFraction(double /*fraction*/, c10::DeviceIndex /*device*/) override { ++calls["setMemoryFraction"]; }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex /*device*/) override { return {}; }
  void enable(bool /*value*/) override { ++calls["enable"]; }
  bool isEnabled() const override { return true; }
  void cacheInfo(c10::DeviceIndex /*device*/, size_t* largest) override { *largest = 77; }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    *size = 1;
    return ptr;
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream /*stream*/) override {
    ++calls["recordStream"];
    recorded_deleter = ptr.get_deleter();
    recorded_ptr = ptr.get();
  }
  cca::SnapshotInfo snapshot(c10::MempoolId_t /*id*/, bool /*include_traces*/) override {
    cca::SnapshotInfo info;
    info.config_metadata.last_allocator_settings = "fake settings";
    return info;
  }
  void beginAllocateToPool(c10::DeviceIndex /*d*/, c10::MempoolId_t /*id*/,
                           std::function<bool(cudaStream_t)> /*filter*/) override {}
  void endAllocateToPool(c10::DeviceIndex /*d*/, c10::MempoolId_t /*id*/) override {}
  void releasePool(c10::DeviceIndex /*d*/, c10::MempoolId_t /*id*/) override {}
  cca::ShareableHandle shareIpcHandle(void* /*ptr*/) override { return {}; }
  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) override { return nullptr; }
  void recordHistory(bool /*enabled*/, cca::CreateContextFn /*recorder*/, size_t /*max_entries*/,
                     cca::RecordContext /*when*/, bool /*clear*/, const std::vector<std::string>& /*skip*/) override {
    ++calls["recordHistory"];
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver /*observer*/) override {}
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker /*tracker*/) override {}
  void enablePeerAccess(c10::DeviceIndex /*dev*/, c10::DeviceIndex /*to*/) override {}
  cudaError_t memcpyAsync(void* /*dst*/, int /*dst_device*/, const void* /*src*/, int /*src_device*/,
                          size_t /*count*/, cudaStream_t /*stream*/, bool /*p2p*/) override {
    return cudaSuccess;
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex /*d*/, c10::MempoolId_t /*id*/) override {
    return nullptr;
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex /*d*/,
                                              std::shared_ptr<cca::AllocatorState> /*state*/) override {
    cca::CheckpointDelta delta;
    void* p = host_alloc(8);
    delta.dataptrs_allocd.emplace_back(p, p, &cached_delete, c10::Device(c10::DeviceType::CUDA, 0));
    return delta;
  }
  std::string name() override { return "fake"; }
};

FakeAllocator* FakeAllocator::self = nullptr;

cachealloc::torch::TimedNativeTotals totals() { return cachealloc::torch::time_native_totals(); }

/// Installs the timing wrapper around `fake` through the C entry point the first time (checking
/// the refusal first) and puts the same wrapper back in place on later calls (Catch2 runs a test
/// case once per SECTION; an installed wrapper is never destroyed).
cca::CUDAAllocator* timed_over(FakeAllocator& fake) {
  static cca::CUDAAllocator* timed = nullptr;
  if (timed != nullptr) {
    cca::allocator.store(timed);
    c10::SetAllocator(c10::DeviceType::CUDA, timed, 1);
    return timed;
  }
  char err[512] = {};
  CHECK(cachealloc_torch_time_native_is_installed() == 0);
  CHECK(cachealloc_torch_time_native_ns() == 0);
  CHECK(totals().alloc_calls == 0);

  // Refused while the allocator is in use; nothing changes.
  fake.is_initialized = true;
  cca::allocator.store(&fake);
  CHECK(cachealloc_torch_time_native_install(err, sizeof err) == -1);
  CHECK_THAT(std::string(err), Catch::Contains("('fake') is already initialized"));
  CHECK(cca::allocator.load() == &fake);
  CHECK(cachealloc_torch_time_native_is_installed() == 0);

  fake.is_initialized = false;
  REQUIRE(cachealloc_torch_time_native_install(err, sizeof err) == 0);
  CHECK(std::string(err).empty());
  timed = cca::allocator.load();
  REQUIRE(timed != &fake);
  CHECK(c10::GetAllocator(c10::DeviceType::CUDA) == timed);
  CHECK(cachealloc_torch_time_native_is_installed() == 1);
  CHECK(cachealloc_torch_time_native_install(err, sizeof err) == 0);  // in place already: nothing happens
  CHECK(cca::allocator.load() == timed);
  return timed;
}

}  // namespace

TEST_CASE("timing wrapper: forwards, counts and times PyTorch's allocator", "[torch][timed]") {
  // The wrapper keeps a pointer to the allocator it wraps and is never destroyed: so is the fake.
  static FakeAllocator fake;
  FakeAllocator::self = &fake;
  fake.calls.clear();
  cca::CUDAAllocator* const original = cca::allocator.load();
  c10::Allocator* const original_generic = c10::GetAllocator(c10::DeviceType::CUDA);
  cca::CUDAAllocator* const timed = timed_over(fake);
  const cachealloc::torch::TimedNativeTotals start = totals();

  SECTION("allocate: the inner DataPtr's pointer and device, freed through its own deleter, timed") {
    {
      c10::DataPtr a = timed->allocate(100);
      CHECK(fake.calls["allocate"] == 1);
      REQUIRE(a.get() != nullptr);
      CHECK(a.get_context() == a.get());
      CHECK(a.device() == c10::Device(c10::DeviceType::CUDA, 0));
      CHECK(a.get_deleter() != &FakeAllocator::cached_delete);  // ours, so that the free is seen
      CHECK(timed->is_simple_data_ptr(a));
      CHECK(fake.live == 1);
      CHECK(totals().alloc_calls == start.alloc_calls + 1);
      CHECK(totals().free_calls == start.free_calls);
    }
    CHECK(fake.calls["cached_delete"] == 1);
    CHECK(fake.calls["raw_delete"] == 0);
    CHECK(fake.live == 0);
    CHECK(totals().free_calls == start.free_calls + 1);

    // A second kind of deleter (PyTorch's uncached_delete) gets a slot of its own.
    fake.uncached = true;
    c10::DataPtr b = timed->allocate(10);
    fake.uncached = false;
    c10::DataPtr c = timed->allocate(10);
    CHECK(b.get_deleter() != c.get_deleter());
    b.clear();
    CHECK(fake.calls["uncached_delete"] == 1);
    c.clear();
    CHECK(fake.calls["cached_delete"] == 2);
    CHECK(totals().alloc_calls == start.alloc_calls + 3);
    CHECK(totals().free_calls == start.free_calls + 3);

    // Zero bytes: forwarded as it is, counted, nothing to free.
    {
      c10::DataPtr z = timed->allocate(0);
      CHECK(z.get() == nullptr);
      CHECK(fake.calls["allocate"] == 4);
    }
    CHECK(totals().alloc_calls == start.alloc_calls + 4);
    CHECK(totals().free_calls == start.free_calls + 3);
    CHECK(fake.live == 0);
    CHECK(totals().alloc_ns > start.alloc_ns);
    CHECK(totals().free_ns > start.free_ns);
    // Three reads, each converting ticks to ns at its own moment (TickClock::to_ns): equal but
    // for the rounding of the conversion.
    const auto sum =
        static_cast<double>(cachealloc_torch_time_native_alloc_ns() + cachealloc_torch_time_native_free_ns());
    CHECK(static_cast<double>(cachealloc_torch_time_native_ns()) == Approx(sum).margin(4.0));
  }

  SECTION("raw_alloc, raw_alloc_with_stream, raw_delete and raw_deleter") {
    const auto& before = start;
    void* p = timed->raw_alloc(64);
    void* q = timed->raw_alloc_with_stream(64, nullptr);
    CHECK(fake.calls["raw_alloc"] == 1);
    CHECK(fake.calls["raw_alloc_with_stream"] == 1);
    timed->raw_delete(p);
    timed->raw_delete(q);
    CHECK(fake.calls["raw_delete"] == 2);
    CHECK(fake.live == 0);
    CHECK(totals().alloc_calls == before.alloc_calls + 2);
    CHECK(totals().free_calls == before.free_calls + 2);
    CHECK(cachealloc_torch_time_native_alloc_calls() == totals().alloc_calls);
    CHECK(cachealloc_torch_time_native_free_calls() == totals().free_calls);
    CHECK(totals().alloc_ns > before.alloc_ns);
    CHECK(totals().free_ns > before.free_ns);

    // c10::Allocator::raw_allocate / raw_deallocate: allocate() and raw_deleter() together.
    const int deletes = fake.calls["cached_delete"];
    void* r = timed->raw_allocate(32);
    CHECK(timed->raw_deleter() != &FakeAllocator::cached_delete);
    timed->raw_deallocate(r);
    CHECK(fake.calls["cached_delete"] == deletes + 1);
    CHECK(totals().free_calls == before.free_calls + 3);
    CHECK(fake.live == 0);
  }

  SECTION("recordStream sees the inner deleter; a DataPtr not ours is passed on as it is") {
    const c10::cuda::CUDAStream stream(c10::cuda::CUDAStream::UNCHECKED,
                                       c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, 0), 3));
    c10::DataPtr a = timed->allocate(16);
    timed->recordStream(a, stream);
    CHECK(fake.calls["recordStream"] == 1);
    CHECK(fake.recorded_ptr == a.get());
    CHECK(fake.recorded_deleter == &FakeAllocator::cached_delete);
    CHECK(fake.live == 1);  // the view owned nothing
    static_cast<c10::DeviceAllocator*>(timed)->recordStream(a, c10::Stream(stream));  // the c10::Stream overload
    CHECK(fake.calls["recordStream"] == 2);
    a.clear();
    CHECK(fake.live == 0);

    int blob = 0;
    const c10::DataPtr foreign(&blob, c10::Device(c10::DeviceType::CUDA, 0));
    timed->recordStream(foreign, stream);
    CHECK(fake.recorded_ptr == &blob);
    CHECK(fake.recorded_deleter == foreign.get_deleter());
  }

  SECTION("the other methods forward") {
    timed->emptyCache({0, 0});
    CHECK(fake.calls["emptyCache"] == 1);
    CHECK(timed->getDeviceStats(1).allocated_bytes[0].current == 4201);
    timed->resetAccumulatedStats(0);
    timed->resetPeakStats(0);
    CHECK(fake.calls["resetAccumulatedStats"] == 1);
    CHECK(fake.calls["resetPeakStats"] == 1);
    CHECK(timed->name() == "fake");
    CHECK(timed->getMemoryInfo(0) == std::pair<size_t, size_t>{1, 2});
    CHECK_FALSE(timed->initialized());
    timed->init(2);
    CHECK(fake.calls["init"] == 1);
    CHECK(timed->getMemoryFraction(0) == 0.25);
    timed->setMemoryFraction(0.5, 0);
    CHECK(fake.calls["setMemoryFraction"] == 1);
    std::size_t largest = 0;
    timed->cacheInfo(0, &largest);
    CHECK(largest == 77);
    CHECK(timed->snapshot({0, 0}, false).config_metadata.last_allocator_settings == "fake settings");
    timed->recordHistory(true, nullptr, 10, cca::RecordContext::ALLOC, false, {});
    CHECK(fake.calls["recordHistory"] == 1);
    CHECK(timed->getCheckpointState(0, {1, 0}) == nullptr);
    // A restored checkpoint's DataPtrs are re-wrapped: their frees are timed like the others.
    const auto before = totals();
    cca::CheckpointDelta delta = timed->setCheckpointPoolState(0, nullptr);
    REQUIRE(delta.dataptrs_allocd.size() == 1);
    CHECK(delta.dataptrs_allocd[0].get_deleter() == timed->raw_deleter());
    delta.dataptrs_allocd.clear();
    CHECK(totals().free_calls == before.free_calls + 1);
    CHECK(fake.live == 0);
  }

  SECTION("an allocator that keeps state in the DataPtr context is refused, not mis-freed") {
    fake.context_is_data = false;
    CHECK_THAT(error_of([&] { (void)timed->allocate(8); }), Catch::Contains("context is not its data pointer"));
    fake.context_is_data = true;
    CHECK(fake.calls["context_delete"] == 1);  // the inner DataPtr freed itself
    CHECK(fake.live == 0);
  }

  // Give PyTorch's allocator back to the other test cases (the wrapper stays allocated).
  cca::allocator.store(original);
  c10::SetAllocator(c10::DeviceType::CUDA, original_generic, 1);
  CHECK(cachealloc_torch_time_native_is_installed() == 0);
}
