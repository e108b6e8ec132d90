// test_conformance.cpp: the contract every registered policy keeps, on the simulated device.
#include "../support.h"

#include <cachealloc/errors.h>

#include <catch2/catch.hpp>

#include <random>

using namespace cachealloc;
using cachealloc::test::make_sim_allocator;
using cachealloc::test::OverlapTracker;

TEST_CASE("conformance: zero bytes gives nullptr and frees as a no-op", "[conformance]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = make_sim_allocator(policy);
  CHECK(a->allocate(0, 0) == nullptr);
  a->deallocate(nullptr);
  CHECK(a->stats().allocation.current == 0);
  a->check_invariants();
}

TEST_CASE("conformance: alignment and no overlap across sizes", "[conformance]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = make_sim_allocator(policy);
  OverlapTracker live;
  std::vector<std::pair<void*, std::size_t>> ptrs;
  for (std::size_t size : {1ul, 511ul, 512ul, 513ul, 4096ul, 1ul << 20, (1ul << 20) + 1, 3ul << 20,
                           10ul << 20, (10ul << 20) + 7, 64ul << 20, 300ul << 20}) {
    for (int i = 0; i < 3; ++i) {
      void* p = a->allocate(size, 0);
      REQUIRE(p != nullptr);
      CHECK(reinterpret_cast<std::uintptr_t>(p) % 512 == 0);
      auto info = a->find(p);
      REQUIRE(info);
      CHECK(info->block_size >= size);
      CHECK(live.add(p, info->block_size));
      ptrs.emplace_back(p, size);
      a->check_invariants();
    }
  }
  std::size_t requested = 0;
  for (auto& [p, s] : ptrs) {
    requested += s;
  }
  CHECK(a->stats().requested_bytes.current == static_cast<std::int64_t>(requested));
  for (auto& [p, s] : ptrs) {
    a->deallocate(p);
    a->check_invariants();
  }
}

TEST_CASE("conformance: same-stream reuse needs no new device memory", "[conformance]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = make_sim_allocator(policy);
  for (std::size_t size : {4096ul, 2ul << 20, 50ul << 20}) {
    void* p = a->allocate(size, 7);
    a->deallocate(p);
    const auto reserves = sim->counters().reserve_calls + sim->counters().physical_creates;
    void* q = a->allocate(size, 7);
    CHECK(sim->counters().reserve_calls + sim->counters().physical_creates == reserves);
    a->deallocate(q);
    a->check_invariants();
  }
}

TEST_CASE("conformance: a block used on another stream is not reused before its event",
          "[conformance]") {
  // PyTorch's rule, which reuse_parked:False keeps; with reuse_parked (the default) s2 may take
  // the block in its own order, after waiting for s1 on the device (test_core, test_randomized).
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = make_sim_allocator(policy, SimOptions{}, "reuse_parked:False");
  const StreamId s1 = 1;
  const StreamId s2 = 2;
  for (std::size_t size : {4096ul, 8ul << 20, 64ul << 20}) {
    void* p = a->allocate(size, s1);
    a->record_stream(p, s2);  // a kernel on s2 still uses p
    a->deallocate(p);
    CHECK(a->pending_frees() == 1);
    // Until s2's work completes, no allocation on any stream may return memory overlapping p.
    std::vector<void*> others;
    for (int i = 0; i < 4; ++i) {
      for (StreamId s : {s1, s2}) {
        void* q = a->allocate(size, s);
        const auto qa = reinterpret_cast<std::uintptr_t>(q);
        const auto pa = reinterpret_cast<std::uintptr_t>(p);
        CHECK((qa + size <= pa || pa + size <= qa));
        others.push_back(q);
        a->check_invariants();
      }
    }
    for (void* q : others) {
      a->deallocate(q);
    }
    sim->complete_stream(s2);
    void* r = a->allocate(size, s1);  // polls events: p comes back to the policy
    CHECK(a->pending_frees() == 0);
    a->deallocate(r);
    a->empty_cache();
    a->check_invariants();
  }
}

TEST_CASE("conformance: a block freed on one stream is reused on another only after its event",
          "[conformance]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = make_sim_allocator(policy);
  // Work on stream 1 is never completed: nothing freed on stream 1 may be handed to stream 2.
  for (std::size_t size : {2048ul, 4ul << 20, 40ul << 20}) {
    void* p = a->allocate(size, 1);
    const auto info = a->find(p);
    a->deallocate(p);
    for (int i = 0; i < 3; ++i) {
      void* q = a->allocate(size, 2);
      const auto qa = reinterpret_cast<std::uintptr_t>(q);
      const auto pa = reinterpret_cast<std::uintptr_t>(p);
      CHECK((qa + size <= pa || pa + info->block_size <= qa));
      a->deallocate(q);
    }
    a->check_invariants();
  }
}

TEST_CASE("conformance: out-of-memory throws a clear error and leaves the allocator usable",
          "[conformance]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  SimOptions opts;
  opts.capacity = 256 * kMiB;
  auto [sim, a] = make_sim_allocator(policy, opts);
  void* p = a->allocate(100 * kMiB, 0);
  try {
    (void)a->allocate(512 * kMiB, 0);
    FAIL("expected OutOfMemory");
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    CHECK(msg.find("out of memory") != std::string::npos);
    CHECK(msg.find("Tried to allocate 512.00 MiB") != std::string::npos);
    CHECK(msg.find("reserved but unallocated") != std::string::npos);
    CHECK(e.requested_bytes() == 512 * kMiB);
  }
  CHECK(a->stats().num_ooms == 1);
  a->check_invariants();
  void* q = a->allocate(64 * kMiB, 0);  // still usable
  CHECK(q != nullptr);
  a->deallocate(q);
  a->deallocate(p);
  a->check_invariants();
}

TEST_CASE("conformance: cached memory is released and retried before reporting OOM",
          "[conformance]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  SimOptions opts;
  opts.capacity = 256 * kMiB;
  auto [sim, a] = make_sim_allocator(policy, opts);
  // Fill the device with cached 30 MiB blocks, free them, then ask for one big block.
  std::vector<void*> ps;
  for (int i = 0; i < 6; ++i) {
    ps.push_back(a->allocate(30 * kMiB, 0));
  }
  for (void* p : ps) {
    a->deallocate(p);
  }
  void* big = a->allocate(200 * kMiB, 0);
  CHECK(big != nullptr);
  CHECK(a->stats().num_ooms == 0);
  a->deallocate(big);
  a->check_invariants();
}

TEST_CASE("conformance: stats return to zero once everything is freed", "[conformance]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = make_sim_allocator(policy);
  std::mt19937_64 rng(42);
  std::vector<void*> live;
  for (int i = 0; i < 2000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const std::size_t size = rng() % 2 == 0 ? 1 + rng() % (1 << 20) : 1 + rng() % (64ul << 20);
      live.push_back(a->allocate(size, rng() % 2));
    } else {
      const std::size_t k = rng() % live.size();
      a->deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (void* p : live) {
    a->deallocate(p);
  }
  const Stats s = a->stats();
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.requested_bytes.current == 0);
  CHECK(s.active_bytes.current == 0);
  CHECK(s.allocation.current == 0);
  CHECK(s.allocated_bytes.peak > 0);
  sim->complete_all();
  a->empty_cache();
  CHECK(a->stats().reserved_bytes.current == 0);
  CHECK(sim->held_bytes() == 0);
  CHECK(sim->live_reservations() == 0);
  a->check_invariants();
}

TEST_CASE("conformance: double free and foreign pointers are rejected without damage",
          "[conformance][misuse]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = make_sim_allocator(policy);
  void* p = a->allocate(1000, 0);
  void* q = a->allocate(5 * kMiB, 0);
  a->deallocate(p);
  const Stats before = a->stats();
  CHECK_THROWS_AS(a->deallocate(p), UsageError);
  int local = 0;
  CHECK_THROWS_AS(a->deallocate(&local), UsageError);
  CHECK_THROWS_WITH(a->deallocate(static_cast<char*>(q) + 512),
                    Catch::Contains("not a live allocation") && Catch::Contains("Nothing was changed"));
  CHECK_THROWS_AS(a->record_stream(p, 3), UsageError);
  const Stats after = a->stats();
  CHECK(after.allocated_bytes.current == before.allocated_bytes.current);
  CHECK(after.usage_errors == 4);
  a->check_invariants();
  a->deallocate(q);
  a->check_invariants();
}

TEST_CASE("conformance: memory fraction limits reserved memory", "[conformance]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  SimOptions opts;
  opts.capacity = 1 * kGiB;
  auto [sim, a] = make_sim_allocator(policy, opts);
  a->set_memory_fraction(0.25);
  CHECK(a->memory_fraction() == 0.25);
  CHECK_THROWS_AS((void)a->allocate(300 * kMiB, 0), OutOfMemory);
  void* p = a->allocate(200 * kMiB, 0);
  CHECK(sim->held_bytes() <= 256 * kMiB);
  a->deallocate(p);
  CHECK_THROWS_AS(a->set_memory_fraction(1.5), ConfigError);
  a->check_invariants();
}

TEST_CASE("conformance: absurd sizes are out-of-memory, never a wrapped rounding",
          "[conformance][misuse]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  auto [sim, a] = make_sim_allocator(policy);
  for (std::size_t size : {~std::size_t{0}, ~std::size_t{0} - 511, std::size_t{1} << 63,
                           (std::size_t{1} << 48) + 1, std::size_t{1} << 47}) {
    INFO("size " << size);
    CHECK_THROWS_AS((void)a->allocate(size, 0), OutOfMemory);
    a->check_invariants();
  }
  CHECK(a->stats().allocated_bytes.current == 0);
  void* p = a->allocate(1, 0);
  CHECK(p != nullptr);
  a->deallocate(p);
}
