// test_backends.cpp: the CUDA backends on their own: cudaMalloc, host fences and pooled events
// (cuda_runtime), map/unmap round trips and granularity (cuda_vmm), the private memory pool
// and its attributes (cuda_async), and the factory.
#include "gpu_test_util.h"
#include "kernels.h"

#include <cachealloc/cuda/async_backend.h>
#include <cachealloc/cuda/runtime_backend.h>
#include <cachealloc/cuda/vmm_backend.h>
#include <cachealloc/errors.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace cachealloc::gpu_test {
namespace {

constexpr std::uint64_t kSeed = 0xBACC;

int current_device() {
  int d = -1;
  GPU_REQUIRE_OK(cudaGetDevice(&d));
  return d;
}

bool is_hopper_h100_or_h200(int device) {
  const std::string name = cuda_device_name(device);
  return name.find("H200") != std::string::npos || name.find("H100") != std::string::npos;
}

/// CACHEALLOC_HOST_FENCES set to `value` (nullptr: unset) for the scope, restored after: a
/// backend reads it at its first record, so a section that tests fences or events sets it around
/// that record, and a run of the whole suite under CACHEALLOC_HOST_FENCES=1 keeps fences in the
/// sections that do not.
/// Sets (or, with nullptr, removes) an environment variable for its scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* was = std::getenv(name_);
    had_ = was != nullptr;
    saved_ = had_ ? was : "";
    if (value != nullptr) {
      ::setenv(name_, value, 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, saved_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string saved_;
};

/// CACHEALLOC_HOST_FENCES for its scope (Note [Host fences instead of events]).
class ScopedFencesEnv : public ScopedEnv {
 public:
  explicit ScopedFencesEnv(const char* value) : ScopedEnv("CACHEALLOC_HOST_FENCES", value) {}
};

}  // namespace

// Runs without a device too (ctest cuda_factory_without_device): the lists of CACHEALLOC_CONF keys
// are what the plugin's validation accepts, so they must match what each backend reads. They were
// checked in the GPU-only case below until session 52 found one of those checks stale on its
// first GPU run; here they run in every CI build.
TEST_CASE("factory: every backend kind reads exactly the keys it lists", "[factory][nogpu]") {
  const std::vector<std::string_view> kinds = cuda_backend_kinds();
  CHECK(kinds == std::vector<std::string_view>{"runtime", "virtual_memory", "stream_ordered"});
  CHECK(cuda_backend_config_keys("stream_ordered") == CudaAsyncBackend::config_keys());
  CHECK(cuda_backend_config_keys("virtual_memory") == CudaVmmBackend::config_keys());
  // cuda_runtime has one key (Note [Watching events by default on virtual memory]).
  CHECK(cuda_backend_config_keys("runtime") == std::vector<std::string_view>{"event_thread"});
  for (std::string_view kind : kinds) {
    const std::vector<std::string_view> keys = cuda_backend_config_keys(kind);
    CAPTURE(kind);
    // Note [Watching events by default on virtual memory]: every kind takes event_thread.
    CHECK(std::find(keys.begin(), keys.end(), "event_thread") != keys.end());
    for (std::string_view key : keys) {
      CAPTURE(key);
      // A listed key is read: a value no key accepts is refused, as the plugin refuses it.
      Config bad = Config::parse(std::string(key) + ":?");
      CHECK_THROWS_AS(check_cuda_backend_config(kind, bad), ConfigError);
    }
    // A key that is not listed is left unread, for Config::finish to report.
    Config other = Config::parse("no_such_key:1,event_thread:poll");
    CHECK_NOTHROW(check_cuda_backend_config(kind, other));
    CHECK_THROWS_AS(other.finish("test", keys), ConfigError);
    Config good = Config::parse("event_thread:off");
    CHECK_NOTHROW(check_cuda_backend_config(kind, good));
    CHECK_NOTHROW(good.finish("test", keys));
  }
  Config none;
  CHECK_THROWS_AS(check_cuda_backend_config("bogus", none), ConfigError);
  CHECK_THROWS_WITH(check_cuda_backend_config("bogus", none),
                    Catch::Contains("unknown CUDA backend kind 'bogus'; valid kinds: runtime, virtual_memory, "
                                    "stream_ordered"));
  CHECK(cuda_backend_config_keys("bogus").empty());
}

TEST_CASE("factory and device queries", "[gpu][factory]") {
  CHECK(cuda_device_count() >= 1);
  const std::string name = cuda_device_name(test_device());
  CHECK_FALSE(name.empty());
  Config config;
  CHECK_THROWS_AS(make_cuda_backend("bogus", test_device(), config), ConfigError);
  CHECK(make_cuda_backend("runtime", test_device(), config)->name() == "cuda_runtime");
  CHECK(make_cuda_backend("virtual_memory", test_device(), config)->name() == "cuda_vmm");
  CHECK(make_cuda_backend("stream_ordered", test_device(), config)->name() == "cuda_async");
  CHECK_THROWS_AS(make_cuda_backend("runtime", cuda_device_count(), config), DeviceError);
}

TEST_CASE("cuda_runtime: cudaMalloc, out of memory, pooled events", "[gpu][runtime]") {
  const int before = current_device();
  CudaRuntimeBackend backend(test_device());
  CHECK(current_device() == before);
  CHECK(backend.total_memory() > 0);
  CHECK(backend.free_memory() <= backend.total_memory());
  TestStream s;

  SECTION("reserve/release round trip") {
    void* p = backend.reserve(3 * kMiB);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 512 == 0);
    CHECK(backend.held_bytes() == 3 * kMiB);
    GPU_REQUIRE_OK(launch_fill(p, 3 * kMiB, 1, kSeed, s.get()));
    DeviceCounter mismatches;
    GPU_REQUIRE_OK(launch_verify(p, 3 * kMiB, 1, kSeed, mismatches.get(), s.get()));
    CHECK(mismatches.read() == 0);
    backend.release(p, 3 * kMiB);
    CHECK(backend.held_bytes() == 0);
    CHECK(backend.counters().reserve_calls == 1);
    CHECK(backend.counters().release_calls == 1);
  }

  SECTION("out of memory returns nullptr and clears the runtime's error") {
    CHECK(backend.reserve(backend.total_memory() + kGiB) == nullptr);
    CHECK(backend.counters().failed_reserves == 1);
    CHECK(cudaGetLastError() == cudaSuccess);
    void* p = backend.reserve(kMiB);
    CHECK(p != nullptr);
    backend.release(p, kMiB);
  }

  SECTION("limit: reserve beyond it returns nullptr without calling the device") {
    backend.set_limit(8 * kMiB);
    CHECK(backend.reserve(16 * kMiB) == nullptr);
    void* p = backend.reserve(8 * kMiB);
    CHECK(p != nullptr);
    backend.release(p, 8 * kMiB);
  }

  SECTION("host fences (CACHEALLOC_HOST_FENCES=1): pending while the stream is busy, reached after; no CUDA event") {
    // Note [Host fences instead of events]: H100/H200 support 64-bit stream memory operations.
    GPU_REQUIRE_OK(launch_spin(cycles_for_ms(20), s.get()));
    const EventId ev = [&] {
      const ScopedFencesEnv fences("1");
      return backend.record_event(s.id());
    }();
    if (is_hopper_h100_or_h200(test_device())) {
      REQUIRE(backend.event_pool().fences_enabled());
    }
    std::printf("cuda_runtime: record_event gives %s\n", CudaEventPool::is_fence(ev) ? "host fences" : "CUDA events");
    CHECK_FALSE(backend.query_event(ev));
    CHECK(cudaGetLastError() == cudaSuccess);
    backend.synchronize_event(ev);
    CHECK(backend.query_event(ev));
    backend.destroy_event(ev);
    // In stream order: a later fence of a busy stream is not reached before it runs, an earlier
    // one of another stream is independent of it.
    TestStream other;
    GPU_REQUIRE_OK(launch_spin(cycles_for_ms(20), s.get()));
    const EventId busy = backend.record_event(s.id());
    const EventId idle = backend.record_event(other.id());
    GPU_REQUIRE_OK(cudaStreamSynchronize(other.get()));
    CHECK(backend.query_event(idle));
    CHECK_FALSE(backend.query_event(busy));
    backend.synchronize_event(busy);
    CHECK(backend.query_event(busy));
    std::vector<EventId> many;
    for (int i = 0; i < 40; ++i) {
      many.push_back(backend.record_event(i % 2 == 0 ? s.id() : StreamId{0}));
    }
    for (EventId e : many) {
      backend.synchronize_event(e);
      CHECK(backend.query_event(e));
      backend.destroy_event(e);
    }
    // From a thread that made no runtime call yet, as PyTorch's autograd threads do: the driver
    // API needs the context bound first (CUDA_ERROR_INVALID_CONTEXT in an e2e run otherwise).
    EventId from_thread = 0;
    std::string thread_error;
    std::thread t([&] {
      try {
        from_thread = backend.record_event(s.id());
      } catch (const std::exception& e) {
        thread_error = e.what();
      }
    });
    t.join();
    CHECK(thread_error.empty());
    if (from_thread != 0) {
      backend.synchronize_event(from_thread);
      CHECK(backend.query_event(from_thread));
      backend.destroy_event(from_thread);
    }
    if (backend.event_pool().fences_enabled()) {
      CHECK(backend.event_pool().created() == 0);
    }
  }

  SECTION("events (the default): pending while the stream is busy, done after; reused from the pool") {
    // Recorded on this thread: cuda_runtime's default (event_thread.h).
    CudaRuntimeBackend events_only(test_device());
    GPU_REQUIRE_OK(launch_spin(cycles_for_ms(20), s.get()));
    // Without the variable, also when the suite runs under CACHEALLOC_HOST_FENCES=1 (that run,
    // session 31, failed these checks before the variable was cleared here).
    const EventId ev = [&] {
      const ScopedFencesEnv events(nullptr);
      return events_only.record_event(s.id());
    }();
    CHECK_FALSE(CudaEventPool::is_fence(ev));
    CHECK_FALSE(events_only.event_pool().fences_enabled());
    CHECK_FALSE(events_only.query_event(ev));
    CHECK(cudaGetLastError() == cudaSuccess);  // cudaErrorNotReady was cleared
    events_only.synchronize_event(ev);
    CHECK(events_only.query_event(ev));
    events_only.destroy_event(ev);
    const EventId again = events_only.record_event(s.id());
    CHECK(again == ev);  // from the pool, not a new cudaEventCreate
    CHECK(events_only.event_pool().created() == 1);
    events_only.destroy_event(again);
    std::vector<EventId> many;
    for (int i = 0; i < 40; ++i) {
      many.push_back(events_only.record_event(i % 2 == 0 ? s.id() : StreamId{0}));
    }
    for (EventId e : many) {
      events_only.synchronize_event(e);
      events_only.destroy_event(e);
    }
    CHECK(events_only.event_pool().created() == 40);
    CHECK(events_only.event_pool().idle() == 40);
  }

  SECTION("record thread (event_thread records or poll): posted records fence the work before them") {
    // Note [Event records on a thread of their own], Note [The record thread watches its events]
    // (record_thread.h).
    const ScopedFencesEnv no_fences(nullptr);
    const bool watches = GENERATE(false, true);
    CAPTURE(watches);
    CudaRuntimeBackend threaded(test_device(), watches ? EventThread::poll : EventThread::records);
    TestStream other;
    GPU_REQUIRE_OK(launch_spin(cycles_for_ms(30), s.get()));
    const EventId ev = threaded.record_event(s.id());
    REQUIRE(CudaEventPool::is_posted(ev));
    CHECK_FALSE(threaded.query_event(ev));  // queued, or recorded behind the spin
    CHECK(cudaGetLastError() == cudaSuccess);
    // A stream made to wait for a posted record waits for the spin (the record is made first).
    REQUIRE(threaded.stream_wait_event(other.id(), ev));
    CHECK(cudaStreamQuery(other.get()) == cudaErrorNotReady);
    (void)cudaGetLastError();
    threaded.synchronize_event(ev);
    CHECK(threaded.query_event(ev));
    GPU_REQUIRE_OK(cudaStreamSynchronize(other.get()));
    threaded.destroy_event(ev);
    // Many records on two streams, most made by the thread (the caller sleeps before it asks).
    GPU_REQUIRE_OK(launch_spin(cycles_for_ms(10), s.get()));
    std::vector<EventId> many;
    for (int i = 0; i < 40; ++i) {
      many.push_back(threaded.record_event(i % 2 == 0 ? s.id() : StreamId{0}));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    for (EventId e : many) {
      threaded.synchronize_event(e);
      CHECK(threaded.query_event(e));
      threaded.destroy_event(e);
    }
    const CudaEventPool& pool = threaded.event_pool();
    std::printf("cuda_runtime: record thread made %llu records (%.1f us each), callers %llu, wakes %llu\n",
                static_cast<unsigned long long>(pool.thread_records()),
                pool.thread_records() != 0 ? static_cast<double>(pool.thread_ns()) / 1e3 / static_cast<double>(pool.thread_records()) : 0.0,
                static_cast<unsigned long long>(pool.thread_caller_records()),
                static_cast<unsigned long long>(pool.thread_wakes()));
    CHECK(pool.thread_records() + pool.thread_caller_records() == 41);
    CHECK(pool.thread_records() >= 30);
    CHECK(threaded.background_work().event_records == pool.thread_records());
    CHECK(threaded.counters().events_recorded == 41);
    CHECK(pool.created() == 0);  // no event of the plain pool: every record was posted
    if (watches) {
      // Behind a spin: "not yet" (from the worker's word, no query of this thread's) until the
      // spin ended, then "done" within a few of the worker's looks, with no wait of ours.
      GPU_REQUIRE_OK(launch_spin(cycles_for_ms(20), s.get()));
      const EventId behind = threaded.record_event(s.id());
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const std::uint64_t queries_before = threaded.background_work().event_queries;
      CHECK_FALSE(threaded.query_event(behind));
      GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
      bool seen = false;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (!seen && std::chrono::steady_clock::now() < until) {
        seen = threaded.query_event(behind);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      CHECK(seen);
      CHECK(threaded.background_work().event_queries > queries_before);
      threaded.destroy_event(behind);
      std::printf("cuda_runtime: the record thread asked %llu queries of the events it watches (%.2f us each)\n",
                  static_cast<unsigned long long>(threaded.background_work().event_queries),
                  static_cast<double>(threaded.background_work().event_query_ns) / 1e3 /
                      static_cast<double>(std::max<std::uint64_t>(1, threaded.background_work().event_queries)));
    } else {
      CHECK(threaded.background_work().event_queries == 0);
    }
  }
  CHECK(current_device() == before);
}

TEST_CASE("cuda_vmm: granularity, map/unmap round trip, remapping keeps data", "[gpu][vmm]") {
  CudaVmmBackend backend(test_device());
  VirtualMemory* vm = backend.virtual_memory();
  REQUIRE(vm != nullptr);
  const std::size_t g = vm->granularity();
  std::printf("cuda_vmm on %s: granularity %s (recommended), %s (minimum)\n",
              cuda_device_name(test_device()).c_str(), format_bytes(g).c_str(),
              format_bytes(backend.minimum_granularity()).c_str());
  REQUIRE(g > 0);
  CHECK(g % backend.minimum_granularity() == 0);
  if (is_hopper_h100_or_h200(test_device())) {
    CHECK(g == 2 * kMiB);
  }
  TestStream s;
  DeviceCounter mismatches;

  const std::uintptr_t va = vm->reserve_address(4 * g);
  REQUIRE(va != 0);
  CHECK(va % g == 0);
  const PhysicalHandle first = vm->create_physical(2 * g);
  const PhysicalHandle second = vm->create_physical(2 * g);
  REQUIRE(first != 0);
  REQUIRE(second != 0);
  CHECK(vm->physical_bytes() == 4 * g);
  CHECK(backend.held_bytes() == 4 * g);
  vm->map(va, 2 * g, first);
  vm->map(va + 2 * g, 2 * g, second);
  auto* base = reinterpret_cast<void*>(va);
  GPU_REQUIRE_OK(launch_fill(base, 4 * g, 1, kSeed, s.get()));
  GPU_REQUIRE_OK(launch_verify(base, 4 * g, 1, kSeed, mismatches.get(), s.get()));
  CHECK(mismatches.read() == 0);

  // Unmap the first half and map its physical memory at a new address: the data moves with it.
  GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
  vm->unmap(va, 2 * g);
  const std::uintptr_t va2 = vm->reserve_address(2 * g);
  vm->map(va2, 2 * g, first);
  GPU_REQUIRE_OK(launch_verify(reinterpret_cast<void*>(va2), 2 * g, 1, kSeed, mismatches.get(), s.get()));
  CHECK(mismatches.read() == 0);
  // ...and back where it was, next to the second half: the whole range reads as before.
  GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
  vm->unmap(va2, 2 * g);
  vm->map(va, 2 * g, first);
  GPU_REQUIRE_OK(launch_verify(base, 4 * g, 1, kSeed, mismatches.get(), s.get()));
  CHECK(mismatches.read() == 0);

  CHECK(backend.counters().map_calls == 4);
  CHECK(backend.counters().unmap_calls == 2);
  CHECK(backend.counters().physical_creates == 2);

  SECTION("out of memory from cuMemCreate returns handle 0") {
    const std::size_t too_much = round_up(backend.total_memory() + kGiB, g);
    CHECK(vm->create_physical(too_much) == 0);
    CHECK(backend.counters().failed_reserves == 1);
    CHECK(cudaGetLastError() == cudaSuccess);
  }
  SECTION("the non-VMM half is cudaMalloc") {
    void* p = backend.reserve(kMiB);
    REQUIRE(p != nullptr);
    backend.release(p, kMiB);
  }

  // One unmap over two adjacent mappings (defrag unmaps runs of pages, one handle each, so).
  GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
  vm->unmap(va, 4 * g);
  vm->release_physical(first, 2 * g);
  vm->release_physical(second, 2 * g);
  vm->free_address(va2, 2 * g);
  vm->free_address(va, 4 * g);
  CHECK(backend.held_bytes() == 0);
  CHECK(vm->physical_bytes() == 0);
}

TEST_CASE("cuda_vmm: background unmap (aliasing while the old mapping goes, waits on reuse)",
          "[gpu][vmm]") {
  // Note [Unmapping off the allocating thread]: unmap() only queues; the handle may be mapped
  // elsewhere at once, and a map into the range being unmapped waits for that unmap.
  for (const bool background : {true, false}) {
    CAPTURE(background);
    CudaVmmBackend backend(test_device(), CudaVmmOptions{background});
    CHECK(backend.options().background_unmap == background);
    VirtualMemory* vm = backend.virtual_memory();
    REQUIRE(vm != nullptr);
    const std::size_t g = vm->granularity();
    TestStream s;
    DeviceCounter mismatches;
    const std::uintptr_t va = vm->reserve_address(4 * g);
    const std::uintptr_t va2 = vm->reserve_address(4 * g);
    const PhysicalHandle a = vm->create_physical(4 * g);
    const PhysicalHandle b = vm->create_physical(4 * g);
    REQUIRE((a != 0 && b != 0));
    vm->map(va, 4 * g, a);
    vm->map(va2, 4 * g, b);
    GPU_REQUIRE_OK(launch_fill(reinterpret_cast<void*>(va), 4 * g, 7, kSeed, s.get()));
    GPU_REQUIRE_OK(launch_fill(reinterpret_cast<void*>(va2), 4 * g, 8, kSeed, s.get()));
    GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
    for (int round = 0; round < 50; ++round) {
      // Swap the two handles between the two ranges, each unmap followed at once by a map of
      // the same range (it must wait) and of the same handle elsewhere (aliasing).
      const bool even = round % 2 == 0;
      vm->unmap(va, 4 * g);
      vm->unmap(va2, 4 * g);
      vm->map(va, 4 * g, even ? b : a);
      vm->map(va2, 4 * g, even ? a : b);
      GPU_REQUIRE_OK(launch_verify(reinterpret_cast<void*>(va), 4 * g, even ? 8 : 7, kSeed,
                                   mismatches.get(), s.get()));
      GPU_REQUIRE_OK(launch_verify(reinterpret_cast<void*>(va2), 4 * g, even ? 7 : 8, kSeed,
                                   mismatches.get(), s.get()));
      GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
    }
    CHECK(mismatches.read() == 0);
    CHECK(backend.counters().unmap_calls == 100);
    vm->unmap(va, 4 * g);
    vm->unmap(va2, 4 * g);
    vm->release_physical(a, 4 * g);  // waits for the queued unmaps
    CHECK(backend.pending_unmaps() == 0);
    const BackgroundWork work = backend.background_work();
    if (background) {
      CHECK(work.unmaps == 102);
      CHECK(work.busy_ns > 0);
      std::printf("cuda_vmm background unmap: %llu unmaps, %.1f us each on the unmap thread, "
                  "callers blocked %.1f us in all\n",
                  static_cast<unsigned long long>(work.unmaps),
                  static_cast<double>(work.busy_ns) / 1e3 / static_cast<double>(work.unmaps),
                  static_cast<double>(work.blocked_ns) / 1e3);
    } else {
      CHECK(work.unmaps == 0);
    }
    vm->release_physical(b, 4 * g);
    vm->free_address(va, 4 * g);
    vm->free_address(va2, 4 * g);
    CHECK(backend.held_bytes() == 0);
  }
  {
    // Note [Moving pages a stream still uses]: unmap_after() right behind queued work that still
    // reads the range; the handle is mapped elsewhere at once and used in the stream's order.
    CudaVmmBackend backend(test_device());
    REQUIRE(backend.unmaps_after_streams());
    VirtualMemory* vm = backend.virtual_memory();
    const std::size_t g = vm->granularity();
    const std::size_t bytes = 64 * g;  // 128 MiB on the H200: the queued kernels take a while
    TestStream s;
    DeviceCounter mismatches;
    const std::uintptr_t va = vm->reserve_address(bytes);
    const std::uintptr_t va2 = vm->reserve_address(bytes);
    const PhysicalHandle h = vm->create_physical(bytes);
    REQUIRE(h != 0);
    vm->map(va, bytes, h);
    for (int round = 0; round < 20; ++round) {
      const std::uintptr_t from = round % 2 == 0 ? va : va2;
      const std::uintptr_t to = round % 2 == 0 ? va2 : va;
      GPU_REQUIRE_OK(launch_fill(reinterpret_cast<void*>(from), bytes, 20 + round, kSeed, s.get()));
      GPU_REQUIRE_OK(launch_verify(reinterpret_cast<void*>(from), bytes, 20 + round, kSeed,
                                   mismatches.get(), s.get()));
      vm->unmap_after(from, bytes, s.id());  // the two kernels above still use `from`
      vm->map(to, bytes, h);                 // at once: no wait for the stream
      GPU_REQUIRE_OK(launch_verify(reinterpret_cast<void*>(to), bytes, 20 + round, kSeed,
                                   mismatches.get(), s.get()));
    }
    GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
    CHECK(mismatches.read() == 0);
    vm->unmap(va, bytes);  // round 19 mapped it at va
    vm->release_physical(h, bytes);
    CHECK(backend.pending_unmaps() == 0);
    CHECK(backend.background_work().unmaps == 21);
    vm->free_address(va, bytes);
    vm->free_address(va2, bytes);
  }
  Config config = Config::parse("background_unmap:False");
  auto made = make_cuda_backend("virtual_memory", test_device(), config);
  CHECK_FALSE(dynamic_cast<CudaVmmBackend&>(*made).options().background_unmap);
  Config bad = Config::parse("background_unmap:sometimes");
  CHECK_THROWS_AS(make_cuda_backend("virtual_memory", test_device(), bad), ConfigError);
  {
    // Note [Watching events by default on virtual memory] (event_thread.h): the record thread
    // watches by default here; event_thread:off records on the caller's thread.
    const ScopedEnv no_variable("CACHEALLOC_EVENT_THREAD", nullptr);
    const ScopedFencesEnv no_fences(nullptr);
    TestStream ts;
    Config defaults = Config::parse("");
    auto watching = make_cuda_backend("virtual_memory", test_device(), defaults);
    CHECK(dynamic_cast<CudaVmmBackend&>(*watching).options().event_thread == EventThread::poll);
    const EventId posted = watching->record_event(ts.id());
    CHECK(CudaEventPool::is_posted(posted));
    watching->synchronize_event(posted);
    CHECK(watching->query_event(posted));
    watching->destroy_event(posted);
    Config off = Config::parse("event_thread:off");
    auto plain = make_cuda_backend("virtual_memory", test_device(), off);
    const EventId own = plain->record_event(ts.id());
    CHECK_FALSE(CudaEventPool::is_posted(own));
    plain->synchronize_event(own);
    plain->destroy_event(own);
    Config typo = Config::parse("event_thread:sometimes");
    CHECK_THROWS_AS(make_cuda_backend("virtual_memory", test_device(), typo), ConfigError);
  }
}

TEST_CASE("cuda_vmm: a run of handles maps in one go, and a failed run leaves nothing mapped",
          "[gpu][vmm]") {
  // Note [Access calls from several threads]: every handle of a run mapped, then one access call
  // over it; the device reads back what it wrote through every page, and a run that fails part
  // way unmaps what it had mapped.
  constexpr std::size_t kHandles = 8;
  CudaVmmBackend backend(test_device());
  VirtualMemory* vm = backend.virtual_memory();
  const std::size_t g = vm->granularity();
  TestStream s;
  DeviceCounter mismatches;
  const std::uintptr_t va = vm->reserve_address(kHandles * g);
  std::vector<MapPiece> pieces;
  for (std::size_t i = 0; i < kHandles; ++i) {
    const PhysicalHandle h = vm->create_physical(g);
    REQUIRE(h != 0);
    pieces.push_back(MapPiece{h, g});
  }
  for (int round = 0; round < 3; ++round) {
    vm->map_run(va, pieces);
    GPU_REQUIRE_OK(launch_fill(reinterpret_cast<void*>(va), kHandles * g, 30 + round, kSeed, s.get()));
    GPU_REQUIRE_OK(launch_verify(reinterpret_cast<void*>(va), kHandles * g, 30 + round, kSeed,
                                 mismatches.get(), s.get()));
    GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
    vm->unmap(va, kHandles * g);
  }
  CHECK(mismatches.read() == 0);
  // The sixth page already mapped: the run fails there, and its first five maps are undone.
  const PhysicalHandle extra = vm->create_physical(g);
  vm->map(va + 5 * g, g, extra);
  CHECK_THROWS_AS(vm->map_run(va, pieces), DeviceError);
  vm->unmap(va + 5 * g, g);
  vm->release_physical(extra, g);
  vm->map_run(va, pieces);  // would fail if a page of the failed run had stayed mapped
  vm->unmap(va, kHandles * g);
  for (const MapPiece& p : pieces) {
    vm->release_physical(p.handle, g);
  }
  vm->free_address(va, kHandles * g);
  CHECK(backend.held_bytes() == 0);
}

TEST_CASE("cuda_async: private pool, stream-ordered allocation, attributes", "[gpu][async]") {
  TestStream s;

  SECTION("defaults keep memory; trim_to releases it; attributes track use") {
    CudaAsyncBackend backend(test_device());
    CHECK(backend.options().release_threshold == std::numeric_limits<std::uint64_t>::max());
    cudaMemPool_t default_pool = nullptr;
    GPU_REQUIRE_OK(cudaDeviceGetDefaultMemPool(&default_pool, test_device()));
    CHECK(backend.pool() != default_pool);

    void* p = backend.allocate_async(64 * kMiB, s.id());
    REQUIRE(p != nullptr);
    CHECK(backend.used_current() >= 64 * kMiB);
    CHECK(backend.reserved_current() >= backend.used_current());
    GPU_REQUIRE_OK(launch_fill(p, 64 * kMiB, 3, kSeed, s.get()));
    DeviceCounter mismatches;
    GPU_REQUIRE_OK(launch_verify(p, 64 * kMiB, 3, kSeed, mismatches.get(), s.get()));
    CHECK(mismatches.read() == 0);
    backend.free_async(p, s.id());
    GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
    CHECK(backend.used_current() == 0);
    CHECK(backend.reserved_current() >= 64 * kMiB);  // threshold UINT64_MAX: kept
    CHECK(backend.used_high() >= 64 * kMiB);
    CHECK(backend.reserved_high() >= 64 * kMiB);
    backend.trim_to(0);
    CHECK(backend.reserved_current() == 0);
    backend.reset_high_watermarks();
    CHECK(backend.reserved_high() == backend.reserved_current());
    CHECK(backend.async_allocations() == 1);
    CHECK(backend.async_frees() == 1);
  }

  SECTION("out of memory and the limit return nullptr") {
    CudaAsyncBackend backend(test_device());
    CHECK(backend.allocate_async(backend.total_memory() + kGiB, s.id()) == nullptr);
    CHECK(cudaGetLastError() == cudaSuccess);
    backend.set_limit(32 * kMiB);
    CHECK(backend.allocate_async(64 * kMiB, s.id()) == nullptr);
    void* p = backend.allocate_async(16 * kMiB, s.id());
    CHECK(p != nullptr);
    backend.free_async(p, s.id());
    CHECK(backend.counters().failed_reserves == 2);
  }

  SECTION("reserve() allocates on the legacy stream and is usable on any stream at once") {
    CudaAsyncBackend backend(test_device());
    void* p = backend.reserve(8 * kMiB);
    REQUIRE(p != nullptr);
    GPU_REQUIRE_OK(launch_fill(p, 8 * kMiB, 4, kSeed, s.get()));
    DeviceCounter mismatches;
    GPU_REQUIRE_OK(launch_verify(p, 8 * kMiB, 4, kSeed, mismatches.get(), s.get()));
    CHECK(mismatches.read() == 0);
    backend.release(p, 8 * kMiB);
    CHECK(backend.used_current() == 0);
  }

  SECTION("make_stream_wait orders one stream after another's event") {
    CudaAsyncBackend backend(test_device());
    TestStream waiter;
    GPU_REQUIRE_OK(launch_spin(cycles_for_ms(20), s.get()));
    const EventId done = backend.record_event(s.id());
    backend.make_stream_wait(waiter.id(), done);
    const EventId after = backend.record_event(waiter.id());
    CHECK_FALSE(backend.query_event(after));
    backend.synchronize_event(after);
    CHECK(backend.query_event(done));
    backend.destroy_event(done);
    backend.destroy_event(after);
  }

  SECTION("settings come from CACHEALLOC_CONF") {
    Config config = Config::parse(
        "async_release_threshold:0,async_reuse_allow_opportunistic:False,"
        "async_reuse_follow_event_dependencies:0,async_reuse_allow_internal_dependencies:false");
    auto made = make_cuda_backend("stream_ordered", test_device(), config);
    config.finish("test", cuda_backend_config_keys("stream_ordered"));
    auto& backend = dynamic_cast<CudaAsyncBackend&>(*made);
    CHECK(backend.options().release_threshold == 0);
    CHECK_FALSE(backend.options().reuse_allow_opportunistic);
    CHECK_FALSE(backend.options().reuse_follow_event_dependencies);
    CHECK_FALSE(backend.options().reuse_allow_internal_dependencies);
    int value = 1;
    GPU_REQUIRE_OK(cudaMemPoolGetAttribute(backend.pool(), cudaMemPoolReuseAllowOpportunistic, &value));
    CHECK(value == 0);
    void* p = backend.allocate_async(32 * kMiB, s.id());
    REQUIRE(p != nullptr);
    backend.free_async(p, s.id());
    GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));  // threshold 0: the pool releases at syncs
    CHECK(backend.reserved_current() == 0);
  }
}

TEST_CASE("stream-ordered policies: pool attributes agree with the front end's stats",
          "[gpu][async]") {
  const std::vector<std::string> policies = gpu_policy_names(BackendNeed::stream_ordered);
  if (policies.empty()) {
    WARN("no stream-ordered policy is registered yet; nothing to compare");
    return;
  }
  for (const std::string& policy : policies) {
    INFO("policy " << policy);
    TestStream s;  // before the allocator, so destroyed after it
    auto alloc = make_gpu_allocator(policy);
    auto& backend = dynamic_cast<CudaAsyncBackend&>(alloc->backend());
    std::vector<void*> live;
    for (std::size_t bytes : {std::size_t{512}, 3 * kMiB, 40 * kMiB, 100 * kKiB}) {
      live.push_back(alloc->allocate(bytes, s.id()));
    }
    Stats st = alloc->stats();
    CHECK(static_cast<std::uint64_t>(st.reserved_bytes.current) == backend.reserved_current());
    CHECK(backend.used_current() >= static_cast<std::uint64_t>(st.allocated_bytes.current));
    for (void* p : live) {
      alloc->deallocate(p);
    }
    GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
    alloc->empty_cache();
    st = alloc->stats();
    CHECK(st.allocated_bytes.current == 0);
    CHECK(static_cast<std::uint64_t>(st.reserved_bytes.current) == backend.reserved_current());
  }
}

}  // namespace cachealloc::gpu_test
