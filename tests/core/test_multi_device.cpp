// test_multi_device.cpp: several simulated devices behind one MultiDeviceAllocator.
#include "../support.h"

#include <cachealloc/errors.h>
#include <cachealloc/multi_device.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <thread>

using namespace cachealloc;

namespace {

MultiDeviceAllocator make_devices(const std::string& policy, int count) {
  return MultiDeviceAllocator(count, [policy](int device) {
    SimOptions o;
    o.device = device;
    o.capacity = static_cast<std::size_t>(device + 1) * kGiB;  // each device a different size
    Config c;
    return make_allocator(policy, std::make_unique<SimBackend>(o), c);
  });
}

}  // namespace

TEST_CASE("multi-device: allocations go to the device the caller names", "[multi_device]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto m = make_devices(policy, 4);
  CHECK(m.created(2) == nullptr);  // lazy
  void* p2 = m.allocate(100 * kMiB, 2, 0);
  void* p0 = m.allocate(10 * kMiB, 0, 0);
  CHECK(m.created(1) == nullptr);
  CHECK(m.owner(p2) == 2);
  CHECK(m.owner(p0) == 0);
  CHECK(m.stats(2).allocated_bytes.current >= static_cast<std::int64_t>(100 * kMiB));
  CHECK(m.stats(0).requested_bytes.current == static_cast<std::int64_t>(10 * kMiB));
  CHECK(m.stats(1).allocated_bytes.current == 0);
  CHECK(m.device(2).backend().device() == 2);
  m.deallocate(p2, 2);
  m.deallocate(p0);
  CHECK(m.stats(2).allocated_bytes.current == 0);
  CHECK_THROWS_AS(m.allocate(1, 4, 0), UsageError);
  CHECK_THROWS_AS(m.allocate(1, -1, 0), UsageError);
}

TEST_CASE("multi-device: per-device limits and out-of-memory", "[multi_device]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto m = make_devices(policy, 3);
  // Device 0 holds 1 GiB, device 2 holds 3 GiB: 2 GiB fits only on device 2.
  CHECK_THROWS_AS(m.allocate(2 * kGiB, 0, 0), OutOfMemory);
  void* p = m.allocate(2 * kGiB, 2, 0);
  CHECK(m.stats(0).num_ooms == 1);
  CHECK(m.stats(2).num_ooms == 0);
  m.device(1).set_memory_fraction(0.5);  // 1 GiB of device 1's 2 GiB
  CHECK_THROWS_AS(m.allocate(1536 * kMiB, 1, 0), OutOfMemory);
  CHECK(m.device(2).memory_fraction() == 1.0);
  m.deallocate(p, 2);
}

TEST_CASE("multi-device: empty_cache is per device", "[multi_device]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto m = make_devices(policy, 2);
  m.deallocate(m.allocate(50 * kMiB, 0, 0), 0);
  m.deallocate(m.allocate(50 * kMiB, 1, 0), 1);
  CHECK(m.stats(0).reserved_bytes.current > 0);
  CHECK(m.stats(1).reserved_bytes.current > 0);
  m.empty_cache(0);
  CHECK(m.stats(0).reserved_bytes.current == 0);
  CHECK(m.stats(1).reserved_bytes.current > 0);
  m.empty_cache_all();
  CHECK(m.stats(1).reserved_bytes.current == 0);
}

TEST_CASE("multi-device: a pointer freed on the wrong device is rejected, nothing changes",
          "[multi_device][misuse]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto m = make_devices(policy, 2);
  void* p = m.allocate(4096, 1, 0);
  const Stats before = m.stats(1);
  CHECK_THROWS_WITH(m.deallocate(p, 0), Catch::Contains("belongs to device 1") &&
                                            Catch::Contains("freed on device 0"));
  CHECK(m.stats(1).allocated_bytes.current == before.allocated_bytes.current);
  CHECK(m.owner(p) == 1);
  m.deallocate(p, 1);
  CHECK_THROWS_WITH(m.deallocate(p, 1), Catch::Contains("not a live allocation of any device"));
  CHECK_THROWS_AS(m.deallocate(p), UsageError);
  m.device(0).check_invariants();
  m.device(1).check_invariants();
}

TEST_CASE("multi-device: threads allocate on every device and free from other threads",
          "[multi_device][threads]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto m = make_devices(policy, 4);
  constexpr int kThreads = 8;
  constexpr int kPerThread = 2000;
  std::vector<std::vector<std::pair<void*, int>>> made(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const int d = (t + i) % 4;
        made[static_cast<std::size_t>(t)].emplace_back(
            m.allocate(512 + static_cast<std::size_t>((i * 7919) % 65536), d,
                       static_cast<StreamId>(t)),
            d);
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  threads.clear();
  // Free every block from a different thread than the one that allocated it.
  std::atomic<int> wrong_owner{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (auto [p, d] : made[static_cast<std::size_t>((t + 1) % kThreads)]) {
        if (m.owner(p) != d) {
          ++wrong_owner;
        }
        m.deallocate(p, d);
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  CHECK(wrong_owner == 0);
  for (int d = 0; d < 4; ++d) {
    CHECK(m.stats(d).allocated_bytes.current == 0);
    CHECK(m.stats(d).allocation.allocated == kThreads * kPerThread / 4);
    m.device(d).check_invariants();
  }
}
