// torch_adapter_test.cpp: what can be checked of libcachealloc_torch.so without a GPU.
//
// 1. The capture guard (capture_guard_backend.h) over the simulated backend, alone and under a
//    real policy: no event call and no device free while a capture is underway, and the parked
//    work completes once it ended.
// 2. install(): refuses a bad configuration with a message naming the problem, installs into
//    both places PyTorch reads (no CUDA call is made), refuses a different configuration
//    afterwards; the adapter's name, version, and unsupported methods. The GPU behaviour is in
//    tools/tests/test_torch_adapter.py.
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
#include <memory>
#include <string>

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
