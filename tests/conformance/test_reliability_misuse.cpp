// test_reliability_misuse.cpp: caller misuse has a defined outcome and changes nothing (issue 10).
//
// test_conformance.cpp already covers: double free of a plain block, a stack pointer, an
// interior pointer at +512, record_stream on a freed pointer, size 0, and SIZE_MAX / 2^63 /
// 2^48+1 / 2^47. test_multi_device.cpp covers freeing on a device that was never used. This file
// covers the rest: misuse around parked (cross-stream) frees and cached blocks, interior
// pointers at every odd offset, record_stream misuse, the 2^48 boundary and sizes just above the
// device, 1-byte blocks, bad memory fractions, and multi-device misuse where both devices live.
// After each misuse: the typed error, a message naming the problem, check_invariants(), and the
// statistics unchanged (except the usage_errors / num_ooms counters).
#include "../support.h"

#include <cachealloc/errors.h>
#include <cachealloc/multi_device.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

using namespace cachealloc;

namespace {

void require_same(const Stats& a, const Stats& b) {
  test::check_same_stats(a, b);
  CHECK(a.num_device_alloc == b.num_device_alloc);
  CHECK(a.num_device_free == b.num_device_free);
}

// A macro, not a variable: Catch's combined matchers keep pointers to their parts.
#define UNKNOWN_FREE                                                           \
  (Catch::Contains("free of pointer") && Catch::Contains("not a live allocation") && \
   Catch::Contains("Nothing was changed"))

}  // namespace

TEST_CASE("misuse: freeing a block twice while its first free is parked on another stream",
          "[reliability][misuse]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = cachealloc::test::make_sim_allocator(policy);
  void* keep = a->allocate(3 * kMiB, 0);
  void* p = a->allocate(6 * kMiB, 0);
  a->record_stream(p, 9);
  a->deallocate(p);  // parked: stream 9 may still use it
  REQUIRE(a->pending_frees() == 1);
  const Stats before = a->stats();
  CHECK_THROWS_WITH(a->deallocate(p), UNKNOWN_FREE);
  CHECK_THROWS_WITH(a->record_stream(p, 4), Catch::Contains("record_stream of pointer") &&
                                                Catch::Contains("Nothing was changed"));
  CHECK(a->pending_frees() == 1);
  CHECK(!a->find(p));
  require_same(a->stats(), before);
  CHECK(a->stats().usage_errors == before.usage_errors + 2);
  a->check_invariants();
  // The parked free still completes normally.
  sim->complete_all();
  a->empty_cache();
  CHECK(a->pending_frees() == 0);
  CHECK(a->stats().active_bytes.current == a->stats().allocated_bytes.current);
  a->deallocate(keep);
  a->check_invariants();
  a->empty_cache();
  CHECK(sim->held_bytes() == 0);
}

TEST_CASE("misuse: freeing a cached block and interior pointers at odd offsets",
          "[reliability][misuse]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = cachealloc::test::make_sim_allocator(policy);
  void* small = a->allocate(1000, 0);
  void* large = a->allocate(20 * kMiB + 3, 0);
  void* cached = a->allocate(4 * kMiB, 0);
  a->deallocate(cached);  // now in the cache, not live
  const auto info_small = a->find(small);
  const auto info_large = a->find(large);
  REQUIRE(info_small);
  REQUIRE(info_large);
  const Stats before = a->stats();
  std::uint64_t errors = 0;
  CHECK_THROWS_WITH(a->deallocate(cached), UNKNOWN_FREE);
  ++errors;
  for (void* base : {small, large}) {
    const std::size_t block = base == small ? info_small->block_size : info_large->block_size;
    for (std::size_t off : {std::size_t{1}, std::size_t{7}, std::size_t{511}, block / 2, block - 1}) {
      INFO("offset " << off << " of a block of " << block);
      void* interior = static_cast<char*>(base) + off;
      if (a->find(interior)) {
        continue;  // another live block starts here (cannot happen for these offsets, but safe)
      }
      CHECK_THROWS_WITH(a->deallocate(interior), UNKNOWN_FREE);
      CHECK_THROWS_AS(a->record_stream(interior, 5), UsageError);
      errors += 2;
    }
  }
  // One byte before a live block.
  CHECK_THROWS_AS(a->deallocate(static_cast<char*>(large) - 1), UsageError);
  ++errors;
  require_same(a->stats(), before);
  CHECK(a->stats().usage_errors == before.usage_errors + errors);
  a->check_invariants();
  CHECK(a->find(small)->requested == 1000);
  CHECK(a->find(large)->requested == 20 * kMiB + 3);
  a->deallocate(small);
  a->deallocate(large);
  a->check_invariants();
  CHECK(a->stats().allocated_bytes.current == 0);
}

TEST_CASE("misuse: record_stream on nullptr, on the block's own stream, and repeated",
          "[reliability][misuse]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = cachealloc::test::make_sim_allocator(policy);
  const Stats before = a->stats();
  // nullptr is never live: record_stream must reject it (PointerMap used to "find" key 0 in an
  // empty slot and record the stream there), and find() must not report it.
  CHECK_THROWS_WITH(a->record_stream(nullptr, 1), Catch::Contains("not a live allocation"));
  CHECK(!a->find(nullptr));
  require_same(a->stats(), before);
  a->check_invariants();
  // Own stream and repeats are harmless: the free is immediate when only the own stream was used.
  void* p = a->allocate(2 * kMiB, 3);
  a->record_stream(p, 3);
  a->deallocate(p);
  CHECK(a->pending_frees() == 0);
  void* q = a->allocate(2 * kMiB, 3);
  for (int i = 0; i < 10; ++i) {
    a->record_stream(q, 4);
  }
  a->deallocate(q);
  CHECK(a->pending_frees() == 1);
  sim->complete_stream(4);
  a->empty_cache();
  CHECK(a->pending_frees() == 0);
  CHECK(sim->live_events() == 0);  // one event per stream, destroyed once it completed
  a->check_invariants();
}

TEST_CASE("misuse: sizes of 1 byte, just under/at/over 2^48, and just over the device",
          "[reliability][misuse]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  SimOptions opts;
  opts.capacity = 1 * kGiB;
  auto [sim, a] = cachealloc::test::make_sim_allocator(policy, opts);

  // 1 byte: a real, aligned block that accounts 1 requested byte.
  void* one = a->allocate(1, 0);
  REQUIRE(one != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(one) % 512 == 0);
  CHECK(a->find(one)->requested == 1);
  CHECK(a->find(one)->block_size >= 1);
  CHECK(a->stats().requested_bytes.current == 1);
  void* two = a->allocate(1, 0);
  CHECK(two != one);
  a->deallocate(two);

  const Stats before = a->stats();
  std::uint64_t ooms = 0;
  for (std::size_t size :
       {kMaxRequestBytes, kMaxRequestBytes - 1, kMaxRequestBytes - 511, kMaxRequestBytes / 2 + 1,
        std::size_t{1} << 40, opts.capacity + 1, opts.capacity + 512, 2 * opts.capacity,
        std::numeric_limits<std::size_t>::max() / 2, std::numeric_limits<std::size_t>::max() - 1}) {
    INFO("size " << size);
    try {
      (void)a->allocate(size, 0);
      FAIL_CHECK("expected OutOfMemory");
    } catch (const OutOfMemory& e) {
      const std::string msg = e.what();
      CHECK(msg.find("out of memory") != std::string::npos);
      CHECK(msg.find("Tried to allocate") != std::string::npos);
      CHECK(e.requested_bytes() == size);
      ++ooms;
    }
    a->check_invariants();
  }
  const Stats after = a->stats();
  CHECK(after.num_ooms == before.num_ooms + ooms);
  CHECK(after.allocated_bytes.current == before.allocated_bytes.current);
  CHECK(after.requested_bytes.current == before.requested_bytes.current);
  CHECK(after.allocation.current == before.allocation.current);
  CHECK(after.allocated_bytes.peak == before.allocated_bytes.peak);
  // A failed huge request may release cached memory (the retry chain), never take more.
  CHECK(after.reserved_bytes.current <= before.reserved_bytes.current);
  CHECK(sim->held_bytes() <= opts.capacity);
  // Still usable, and a request of nearly the whole (now empty apart from `one`) device works
  // after empty_cache for at least one policy-independent size: half the device.
  void* half = a->allocate(opts.capacity / 2, 0);
  CHECK(half != nullptr);
  a->deallocate(half);
  a->deallocate(one);
  a->check_invariants();
  sim->complete_all();
  a->empty_cache();
  CHECK(sim->held_bytes() == 0);
}

TEST_CASE("misuse: bad memory fractions are rejected and change nothing", "[reliability][misuse]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = cachealloc::test::make_sim_allocator(policy);
  a->set_memory_fraction(0.5);
  const std::size_t limit = sim->limit();
  for (double f : {0.0, -0.25, 1.0000001, std::nan(""), std::numeric_limits<double>::infinity(),
                   -std::numeric_limits<double>::infinity()}) {
    INFO("fraction " << f);
    CHECK_THROWS_WITH(a->set_memory_fraction(f), Catch::Contains("memory fraction must be in (0, 1]"));
    CHECK(a->memory_fraction() == 0.5);
    CHECK(sim->limit() == limit);
  }
  a->check_invariants();
}

TEST_CASE("misuse: multi-device misuse with every device alive changes nothing",
          "[reliability][misuse][multi_device]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  MultiDeviceAllocator m(2, [policy](int device) {
    SimOptions o;
    o.device = device;
    o.capacity = 2 * kGiB;
    Config c;
    return make_allocator(policy, std::make_unique<SimBackend>(o), c);
  });
  void* p0 = m.allocate(3 * kMiB, 0, 0);
  void* p1 = m.allocate(5 * kMiB, 1, 0);
  const Stats b0 = m.stats(0);
  const Stats b1 = m.stats(1);
  // Both devices are live: the pointer of device 1 freed on device 0 (and vice versa).
  CHECK_THROWS_WITH(m.deallocate(p1, 0), Catch::Contains("belongs to device 1") &&
                                             Catch::Contains("freed on device 0") &&
                                             Catch::Contains("Nothing was changed"));
  CHECK_THROWS_WITH(m.deallocate(p0, 1), Catch::Contains("belongs to device 0"));
  // Interior pointer, out-of-range devices, record_stream of a foreign pointer.
  CHECK_THROWS_AS(m.deallocate(static_cast<char*>(p1) + 512, 1), UsageError);
  CHECK_THROWS_AS(m.deallocate(static_cast<char*>(p1) + 512), UsageError);
  CHECK_THROWS_AS(m.deallocate(p0, 2), UsageError);
  CHECK_THROWS_AS(m.deallocate(p0, -1), UsageError);
  int local = 0;
  CHECK_THROWS_WITH(m.record_stream(&local, 3), Catch::Contains("not a live allocation"));
  CHECK_THROWS_AS(m.empty_cache(7), UsageError);
  CHECK(m.owner(nullptr) == -1);
  CHECK_THROWS_AS(m.record_stream(nullptr, 3), UsageError);
  require_same(m.stats(0), b0);
  require_same(m.stats(1), b1);
  m.device(0).check_invariants();
  m.device(1).check_invariants();
  CHECK(m.owner(p0) == 0);
  CHECK(m.owner(p1) == 1);
  // A freed pointer: record_stream and frees on either device are rejected.
  m.deallocate(p1, 1);
  CHECK_THROWS_AS(m.record_stream(p1, 2), UsageError);
  CHECK_THROWS_AS(m.deallocate(p1, 0), UsageError);
  CHECK_THROWS_AS(m.deallocate(p1, 1), UsageError);
  CHECK(m.stats(1).allocated_bytes.current == 0);
  m.deallocate(p0);
  CHECK(m.stats(0).allocated_bytes.current == 0);
  m.device(0).check_invariants();
  m.device(1).check_invariants();
}
