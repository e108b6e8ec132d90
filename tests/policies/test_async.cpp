// test_async.cpp: the simulated stream-ordered pool's rules and policy `async`'s front cache.
#include "../support.h"

#include <cachealloc/errors.h>
#include <cachealloc/policies/async.h>
#include <cachealloc/sim_backend.h>
#include <cachealloc/sim_stream_pool.h>

#include <catch2/catch.hpp>

#include <random>
#include <vector>

using namespace cachealloc;

namespace {

SimStreamPool& pool_of(SimBackend& sim) { return *sim.stream_ordered(); }

StreamOrderedOptions only_events() {
  StreamOrderedOptions o;
  o.reuse_allow_opportunistic = false;
  o.reuse_allow_internal_dependencies = false;
  return o;
}

}  // namespace

TEST_CASE("sim pool: same-stream reuse in stream order, no new chunk", "[async][sim_pool]") {
  SimBackend sim;
  SimStreamPool& pool = pool_of(sim);
  pool.set_pool_options(only_events());
  void* p = pool.allocate_async(kMiB, 1);
  REQUIRE(p != nullptr);
  CHECK(pool.chunk_count() == 1);
  CHECK(pool.reserved_current() == SimStreamPool::kChunk);
  CHECK(pool.used_current() == kMiB);
  pool.free_async(p, 1);
  CHECK(pool.used_current() == 0);
  void* q = pool.allocate_async(kMiB, 1);  // stream 1's work is pending: still fine on stream 1
  CHECK(q == p);
  CHECK(pool.chunk_count() == 1);
  pool.free_async(q, 1);
  pool.check_invariants();
}

TEST_CASE("sim pool: cross-stream reuse only after an event dependency", "[async][sim_pool]") {
  SimBackend sim;
  SimStreamPool& pool = pool_of(sim);
  pool.set_pool_options(only_events());
  void* a = pool.allocate_async(kMiB, 1);
  void* b = pool.allocate_async(31 * kMiB, 1);  // fills the first chunk
  REQUIRE(pool.chunk_count() == 1);
  const EventId before = sim.record_event(1);  // recorded before the free: does not cover it
  pool.free_async(a, 1);
  pool.make_stream_wait(2, before);
  void* c = pool.allocate_async(kMiB, 2);
  CHECK(c != a);
  CHECK(pool.chunk_count() == 2);
  sim.complete_all();  // completion alone is not enough without opportunistic reuse
  void* d = pool.allocate_async(kMiB, 2);
  CHECK(d != a);
  const EventId after = sim.record_event(1);
  pool.make_stream_wait(2, after);
  void* e = pool.allocate_async(kMiB, 2);
  CHECK(e == a);
  for (void* p : {b, c, d, e}) {
    pool.free_async(p, 2);
  }
  sim.destroy_event(before);
  sim.destroy_event(after);
  CHECK(pool.internal_dependencies() == 0);
  pool.check_invariants();
}

TEST_CASE("sim pool: opportunistic reuse once the free completed", "[async][sim_pool]") {
  SimBackend sim;
  SimStreamPool& pool = pool_of(sim);
  StreamOrderedOptions o = only_events();
  o.reuse_allow_opportunistic = true;
  pool.set_pool_options(o);
  void* a = pool.allocate_async(kMiB, 1);
  void* b = pool.allocate_async(31 * kMiB, 1);
  pool.free_async(a, 1);
  void* c = pool.allocate_async(kMiB, 2);
  CHECK(c != a);  // stream 1 still busy
  sim.complete_stream(1);
  void* d = pool.allocate_async(kMiB, 2);
  CHECK(d == a);
  for (void* p : {b, c, d}) {
    pool.free_async(p, 2);
  }
  pool.check_invariants();
}

TEST_CASE("sim pool: internal dependencies hand over memory when the pool cannot grow",
          "[async][sim_pool]") {
  SimOptions opts;
  opts.capacity = 32 * kMiB;
  SimBackend sim(opts);
  SimStreamPool& pool = pool_of(sim);
  for (bool internal : {false, true}) {
    StreamOrderedOptions o = only_events();
    o.reuse_allow_internal_dependencies = internal;
    pool.set_pool_options(o);
    void* a = pool.allocate_async(32 * kMiB, 1);
    REQUIRE(a != nullptr);
    pool.free_async(a, 1);
    void* b = pool.allocate_async(32 * kMiB, 2);  // no room to grow; a's free is pending on 1
    if (internal) {
      CHECK(b == a);
      CHECK(pool.internal_dependencies() == 1);
      pool.free_async(b, 2);
    } else {
      CHECK(b == nullptr);
      CHECK(pool.internal_dependencies() == 0);
      CHECK(sim.counters().failed_reserves == 1);
    }
    pool.check_invariants();
  }
}

TEST_CASE("sim pool: trim releases whole free chunks whose frees completed", "[async][sim_pool]") {
  SimBackend sim;
  SimStreamPool& pool = pool_of(sim);
  void* a = pool.allocate_async(40 * kMiB, 1);  // its own 40 MiB chunk
  void* b = pool.allocate_async(kMiB, 1);       // a 32 MiB chunk
  CHECK(pool.reserved_current() == 72 * kMiB);
  CHECK(sim.held_bytes() == 72 * kMiB);
  pool.free_async(a, 1);
  pool.trim_to(0);
  CHECK(pool.reserved_current() == 72 * kMiB);  // a's free has not completed
  sim.complete_stream(1);
  pool.trim_to(0);
  CHECK(pool.reserved_current() == 32 * kMiB);  // b's chunk is in use
  CHECK(sim.held_bytes() == 32 * kMiB);
  pool.free_async(b, 1);
  sim.complete_stream(1);
  pool.trim_to(32 * kMiB);
  CHECK(pool.reserved_current() == 32 * kMiB);  // keep honoured
  pool.trim_to(0);
  CHECK(pool.reserved_current() == 0);
  CHECK(sim.held_bytes() == 0);
  CHECK(sim.mapped_bytes_now() == 0);
  CHECK(pool.reserved_high() == 72 * kMiB);
  pool.reset_high_watermarks();
  CHECK(pool.reserved_high() == 0);
  pool.check_invariants();
}

TEST_CASE("sim pool: release threshold keeps at most that much unused", "[async][sim_pool]") {
  SimOptions opts;
  opts.auto_complete_events = true;  // frees complete at once
  SimBackend sim(opts);
  SimStreamPool& pool = pool_of(sim);
  StreamOrderedOptions o;
  o.release_threshold = 40 * kMiB;
  pool.set_pool_options(o);
  void* a = pool.allocate_async(40 * kMiB, 1);
  void* b = pool.allocate_async(64 * kMiB, 1);
  void* c = pool.allocate_async(kMiB, 1);
  CHECK(pool.reserved_current() == 136 * kMiB);
  pool.free_async(b, 1);  // 64 MiB unused > 40: the 64 MiB chunk goes
  CHECK(pool.reserved_current() == 72 * kMiB);
  pool.free_async(a, 1);  // 71 MiB unused (c's chunk has 31 free): a's chunk goes
  CHECK(pool.reserved_current() == 32 * kMiB);
  pool.free_async(c, 1);  // 32 MiB unused <= 40: kept
  CHECK(pool.reserved_current() == 32 * kMiB);
  CHECK(pool.used_current() == 0);
  CHECK(pool.used_high() == 105 * kMiB);
  pool.check_invariants();
}

TEST_CASE("sim pool: attributes are exact and the limit applies", "[async][sim_pool]") {
  SimOptions opts;
  opts.capacity = kGiB;
  SimBackend sim(opts);
  SimStreamPool& pool = pool_of(sim);
  void* a = pool.allocate_async(1000, 0);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % pool.granularity() == 0);
  CHECK(pool.used_current() == 1024);
  sim.set_limit(100 * kMiB);
  CHECK(pool.allocate_async(80 * kMiB, 0) == nullptr);  // 32 + 80 > 100
  void* b = pool.allocate_async(60 * kMiB, 0);
  CHECK(b != nullptr);
  CHECK(pool.reserved_current() == 92 * kMiB);
  CHECK(sim.held_bytes() == 92 * kMiB);
  pool.free_async(a, 0);
  pool.free_async(b, 0);
  pool.free_async(b, 0);  // double free: ignored and counted
  CHECK(pool.foreign_frees() == 1);
  pool.check_invariants();
}

TEST_CASE("async: a front-cache hit makes no pool call", "[async]") {
  auto [sim, a] = test::make_sim_allocator("async", {}, "async_cache_max_block:8MB");
  SimStreamPool& pool = pool_of(*sim);
  for (std::size_t size : {512ul, 100000ul, 8ul << 20}) {
    void* p = a->allocate(size, 3);
    a->deallocate(p);
    const auto allocs = pool.allocate_calls();
    const auto frees = pool.free_calls();
    for (int i = 0; i < 10; ++i) {
      void* q = a->allocate(size, 3);
      CHECK(q == p);
      a->deallocate(q);
    }
    CHECK(pool.allocate_calls() == allocs);
    CHECK(pool.free_calls() == frees);
    void* r = a->allocate(size, 4);  // another stream: not from stream 3's cache
    CHECK(r != p);
    a->deallocate(r);
    a->check_invariants();
  }
}

TEST_CASE("async: async_cache_mb caps the cache, 0 sends every free to the pool", "[async]") {
  auto [sim, a] = test::make_sim_allocator("async", {}, "async_cache_mb:0");
  SimStreamPool& pool = pool_of(*sim);
  void* p = a->allocate(4096, 0);
  a->deallocate(p);
  CHECK(pool.free_calls() == 1);
  auto [sim2, b] = test::make_sim_allocator("async", {}, "async_cache_mb:16,async_cache_max_block:16MB,async_recent_blocks:0");
  void* x = b->allocate(10 * kMiB, 0);
  void* y = b->allocate(10 * kMiB, 0);
  b->deallocate(x);
  b->deallocate(y);  // over 16 MiB: to the pool
  CHECK(pool_of(*sim2).free_calls() == 1);
  b->check_invariants();
  // Without the recent FIFO, blocks over 1 MiB go to the pool.
  auto [sim3, c] = test::make_sim_allocator("async", {}, "async_recent_blocks:0");
  void* big = c->allocate(2 * kMiB, 0);
  void* small = c->allocate(kMiB, 0);
  c->deallocate(big);
  c->deallocate(small);
  CHECK(pool_of(*sim3).free_calls() == 1);
  c->check_invariants();
}

TEST_CASE("async: recently freed large blocks serve their exact size, and go to the pool before "
          "it can grow or a second stream allocates",
          "[async]") {
  auto [sim, a] = test::make_sim_allocator("async");  // async_recent_blocks defaults to 4
  SimStreamPool& pool = pool_of(*sim);
  void* p = a->allocate(8 * kMiB, 0);
  void* q = a->allocate(3 * kMiB, 0);
  a->deallocate(p);
  a->deallocate(q);
  CHECK(pool.free_calls() == 0);
  const auto allocs = pool.allocate_calls();
  for (int i = 0; i < 10; ++i) {  // exact sizes: no pool call
    void* r = a->allocate(8 * kMiB, 0);
    CHECK(r == p);
    a->deallocate(r);
    a->check_invariants();
  }
  CHECK(pool.allocate_calls() == allocs);
  CHECK(pool.free_calls() == 0);
  CHECK(a->stats().pool->front_cache_bytes == 11 * kMiB);

  // A miss gives the FIFO to the pool before it calls allocate_async.
  void* m = a->allocate(5 * kMiB, 0);
  CHECK(pool.free_calls() == 2);
  CHECK(pool.allocate_calls() == allocs + 1);
  CHECK(a->stats().pool->front_cache_bytes == 0);
  a->deallocate(m);

  // A full FIFO gives its oldest block to the pool.
  std::vector<void*> blocks;
  for (std::size_t i = 0; i < 6; ++i) {
    blocks.push_back(a->allocate((20 + i) * kMiB, 0));
  }
  const auto frees = pool.free_calls();  // the 5 MiB block went back at the first of these misses
  CHECK(frees == 3);
  for (void* b : blocks) {
    a->deallocate(b);
  }
  CHECK(pool.free_calls() == frees + 2);
  CHECK(a->stats().pool->front_cache_bytes == (22 + 23 + 24 + 25) * kMiB);
  a->check_invariants();

  // A second stream: every FIFO goes to the pool, and large frees go straight there from now on.
  void* s5 = a->allocate(22 * kMiB, 5);
  CHECK(pool.free_calls() == frees + 2 + 4);
  CHECK(a->stats().pool->front_cache_bytes == 0);
  a->deallocate(s5);
  void* again = a->allocate(7 * kMiB, 0);
  a->deallocate(again);
  CHECK(pool.free_calls() == frees + 2 + 4 + 2);
  a->empty_cache();
  CHECK(pool.used_current() == 0);
  a->check_invariants();

  auto [sim2, off] = test::make_sim_allocator("async", {}, "async_cache_mb:0");  // no caching at all
  void* x = off->allocate(8 * kMiB, 0);
  off->deallocate(x);
  CHECK(pool_of(*sim2).free_calls() == 1);
  CHECK_THROWS_AS(test::make_sim_allocator("async", {}, "async_recent_blocks:17"), ConfigError);
}

TEST_CASE("async: small blocks are carved from per-stream slabs that go back when empty",
          "[async]") {
  SimBackend sim(SimOptions{.capacity = kGiB, .granularity = 2 * kMiB, .auto_complete_events = true});
  Config c;
  AsyncPolicy policy(sim, c);
  SimStreamPool& pool = pool_of(sim);
  // 64 blocks of 64 KiB: two slabs, from two pool calls, not 64.
  std::vector<Block> blocks;
  for (int i = 0; i < 64; ++i) {
    blocks.push_back(policy.allocate(64 * kKiB, 0));
    REQUIRE(blocks.back());
    REQUIRE(blocks.back().cookie != nullptr);
  }
  CHECK(pool.allocate_calls() == 2);
  CHECK(policy.slab_count() == 2);
  policy.check_invariants();
  // Another stream gets its own slab, never stream 0's blocks.
  const Block other = policy.allocate(64 * kKiB, 1);
  CHECK(policy.slab_count() == 3);
  for (const Block& b : blocks) {
    CHECK(b.ptr != other.ptr);
  }
  // Freeing the first slab's 32 blocks gives it back (it is no longer the one being carved);
  // the second, still carved from, stays while empty.
  for (int i = 0; i < 32; ++i) {
    policy.deallocate(blocks[static_cast<std::size_t>(i)], 0);
    policy.check_invariants();
  }
  CHECK(policy.slab_count() == 2);
  CHECK(pool.free_calls() == 1);
  for (int i = 32; i < 64; ++i) {
    policy.deallocate(blocks[static_cast<std::size_t>(i)], 0);
  }
  CHECK(policy.slab_count() == 2);
  CHECK(policy.cached_bytes() == 2 * kMiB + (2 * kMiB - 64 * kKiB));
  // A freed block comes back to its stream without a pool call.
  const auto calls = pool.allocate_calls();
  const Block again = policy.allocate(60 * kKiB, 0);  // the same 64 KiB class
  CHECK(pool.allocate_calls() == calls);
  policy.deallocate(again, 0);
  policy.deallocate(other, 1);
  policy.check_invariants();
  (void)policy.release_cached();
  CHECK(policy.slab_count() == 0);
  CHECK(policy.cached_bytes() == 0);
  CHECK(pool.used_current() == 0);
  // Turned off, small blocks come straight from the pool (or the exact-size cache).
  Config off = Config::parse("async_small_slabs:False");
  AsyncPolicy plain(sim, off);
  const Block b = plain.allocate(64 * kKiB, 0);
  CHECK(b.cookie == nullptr);
  CHECK(plain.slab_count() == 0);
  plain.deallocate(b, 0);
  plain.check_invariants();
}

TEST_CASE("async: pool keys are forwarded to the simulated pool", "[async]") {
  auto [sim, a] = test::make_sim_allocator(
      "async", {},
      "async_release_threshold:0,async_reuse_allow_opportunistic:False,"
      "async_reuse_follow_event_dependencies:False,async_reuse_allow_internal_dependencies:False");
  const StreamOrderedOptions o = pool_of(*sim).pool_options();
  CHECK(o.release_threshold == 0);
  CHECK_FALSE(o.reuse_allow_opportunistic);
  CHECK_FALSE(o.reuse_follow_event_dependencies);
  CHECK_FALSE(o.reuse_allow_internal_dependencies);
}

TEST_CASE("async: refuses a backend without a stream-ordered pool", "[async]") {
  struct NoPool final : DeviceBackend {
    std::string_view name() const noexcept override { return "nopool"; }
    int device() const noexcept override { return 0; }
    std::size_t total_memory() const override { return kGiB; }
    std::size_t free_memory() const override { return kGiB; }
    EventId record_event(StreamId) override { return 1; }
    bool query_event(EventId) override { return true; }
    void synchronize_event(EventId) override {}
    void destroy_event(EventId) noexcept override {}
    void* do_reserve(std::size_t) override { return nullptr; }
    void do_release(void*, std::size_t) noexcept override {}
  };
  NoPool backend;
  Config c;
  CHECK_THROWS_AS(AsyncPolicy(backend, c), ConfigError);
}

TEST_CASE("async: out of memory drains the front cache into the pool and retries", "[async]") {
  SimOptions opts;
  opts.capacity = 128 * kMiB;
  SimBackend sim(opts);
  Config c = Config::parse("async_cache_mb:256,async_cache_max_block:64MB");
  AsyncPolicy policy(sim, c);
  SimStreamPool& pool = pool_of(sim);
  std::vector<Block> blocks;
  for (int i = 0; i < 4; ++i) {  // four 32 MiB chunks: the device is full
    blocks.push_back(policy.allocate(30 * kMiB, 0));
    REQUIRE(blocks.back());
  }
  for (const Block& b : blocks) {
    policy.deallocate(b, 0);
  }
  CHECK(policy.cached_bytes() == 120 * kMiB);
  const Block small = policy.allocate(3 * kMiB, 0);  // fits no 2 MiB tail, no room: cache drained
  REQUIRE(small);
  CHECK(policy.cached_bytes() == 0);
  CHECK(pool.free_calls() == 4);
  policy.check_invariants();
  const Block big = policy.allocate(100 * kMiB, 0);  // the pool is fragmented: empty block
  CHECK_FALSE(big);
  policy.deallocate(small, 0);
  CHECK(policy.release_cached() == 128 * kMiB);
  CHECK(sim.held_bytes() == 0);
  const Block again = policy.allocate(100 * kMiB, 0);
  CHECK(again);
  policy.deallocate(again, 0);
  policy.check_invariants();
}

TEST_CASE("async: randomized streams, waits and completions keep every invariant",
          "[async][randomized]") {
  for (std::uint64_t seed : {1u, 2u, 3u, 4u}) {
    INFO("seed " << seed);
    std::mt19937_64 rng(seed);
    SimOptions opts;
    opts.capacity = 2 * kGiB;
    auto backend = std::make_unique<SimBackend>(opts);
    SimBackend& sim = *backend;
    Config conf = Config::parse(seed % 2 == 0 ? "async_cache_mb:8" : "async_release_threshold:64MB");
    auto a = make_allocator("async", std::move(backend), conf);
    SimStreamPool& pool = pool_of(sim);
    StreamOrderedOptions o;
    o.reuse_allow_opportunistic = rng() % 2 == 0;
    o.reuse_allow_internal_dependencies = rng() % 2 == 0;
    pool.set_pool_options(o);
    test::OverlapTracker live;
    std::vector<void*> ptrs;
    for (int step = 0; step < 3000; ++step) {
      const auto op = rng() % 10;
      if (op < 5 || ptrs.empty()) {
        const std::size_t size = rng() % 4 == 0 ? 1 + rng() % (48 * kMiB) : 1 + rng() % (64 * kKiB);
        void* p = nullptr;
        try {
          p = a->allocate(size, rng() % 3);
        } catch (const OutOfMemory&) {
          continue;
        }
        REQUIRE(live.add(p, a->find(p)->block_size));
        ptrs.push_back(p);
      } else if (op < 8) {
        const std::size_t k = rng() % ptrs.size();
        if (rng() % 4 == 0) {
          a->record_stream(ptrs[k], 3);
        }
        live.remove(ptrs[k]);
        a->deallocate(ptrs[k]);
        ptrs[k] = ptrs.back();
        ptrs.pop_back();
      } else if (op == 8) {
        const StreamId from = rng() % 4;
        const EventId e = sim.record_event(from);
        pool.make_stream_wait(rng() % 3, e);
        sim.destroy_event(e);
      } else if (rng() % 8 == 0) {
        a->empty_cache();
      } else {
        sim.complete_stream(rng() % 4);
      }
      a->check_invariants();
      REQUIRE(pool.used_current() <= pool.reserved_current());
    }
    for (void* p : ptrs) {
      a->deallocate(p);
    }
    sim.complete_all();
    a->empty_cache();
    CHECK(pool.reserved_current() == 0);
    CHECK(sim.held_bytes() == 0);
    a->check_invariants();
  }
}

TEST_CASE("async: stats carry the pool's attributes, in the relations Note [Pool attributes in the stats] states",
          "[async][stats]") {
  auto [sim, a] = test::make_sim_allocator("async");
  SimStreamPool& pool = pool_of(*sim);
  CHECK_FALSE(test::make_sim_allocator("size_class").allocator->stats().pool.has_value());

  std::vector<void*> ptrs;
  for (std::size_t size : {512ul, 3000ul, 100000ul, 3ul << 20, 40ul << 20}) {
    ptrs.push_back(a->allocate(size, 1));
    ptrs.push_back(a->allocate(size, 2));
  }
  a->deallocate(ptrs[0]);  // into stream 1's front cache
  a->deallocate(ptrs[9]);  // 40 MiB on stream 2: into the cache too (under 256 MiB)
  a->record_stream(ptrs[4], 3);
  a->deallocate(ptrs[4]);  // parked for stream 3
  Stats s = a->stats();
  REQUIRE(s.pool.has_value());
  const Stats::PoolFigures& p = *s.pool;
  CHECK(p.reserved_mem_current == pool.reserved_current());
  CHECK(p.used_mem_current == pool.used_current());
  CHECK(static_cast<std::uint64_t>(s.reserved_bytes.current) == p.reserved_mem_current);
  CHECK(static_cast<std::uint64_t>(s.reserved_bytes.peak) == p.reserved_mem_high);
  CHECK(p.front_cache_bytes > 0);
  CHECK(static_cast<std::uint64_t>(s.active_bytes.current) + p.front_cache_bytes <= p.used_mem_current);
  CHECK(p.used_mem_current <= p.reserved_mem_current);
  CHECK(p.pool_calls == pool.allocate_calls() + pool.free_calls());
  const auto map = s.to_map();
  CHECK(map.at("pool.reserved_mem_current") == static_cast<std::int64_t>(p.reserved_mem_current));
  CHECK(map.at("pool.used_mem_high") == static_cast<std::int64_t>(p.used_mem_high));
  CHECK(map.count("pool.front_cache_bytes") == 1);
  CHECK(map.count("pool.calls") == 1);

  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    if (i != 0 && i != 9 && i != 4) {
      a->deallocate(ptrs[i]);
    }
  }
  sim->complete_all();
  a->empty_cache();
  s = a->stats();
  REQUIRE(s.pool.has_value());
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.pool->front_cache_bytes == 0);
  CHECK(s.pool->used_mem_current == 0);
  CHECK(static_cast<std::uint64_t>(s.reserved_bytes.current) == s.pool->reserved_mem_current);
  a->check_invariants();
}

TEST_CASE("async: the pool's reserved bytes are read when someone looks, and stats still agree with the pool",
          "[async][stats]") {
  // Note [Reserved bytes read lazily]. Release threshold 0: the simulated pool gives a free
  // chunk back at once, so the pool also shrinks between two reads; the peak must still be seen.
  auto [sim, a] = test::make_sim_allocator("async", {}, "async_release_threshold:0");
  SimStreamPool& pool = pool_of(*sim);
  const std::uint64_t reads_before = pool.attribute_reads();
  std::vector<void*> ptrs;
  for (int i = 0; i < 50; ++i) {
    ptrs.push_back(a->allocate((3 + i % 5) * kMiB, 1));  // large blocks: every one from the pool
  }
  std::size_t high = pool.reserved_high();
  const std::uint64_t reads_after = pool.attribute_reads() - 1;  // less the read just made
  CHECK(reads_after == reads_before);  // 50 pool allocations, no attribute read
  for (void* p : ptrs) {
    a->deallocate(p);
  }
  sim->complete_all();
  void* small = a->allocate(40 * kMiB, 1);  // after the pool shrank: below the earlier peak
  Stats s = a->stats();
  CHECK(static_cast<std::uint64_t>(s.reserved_bytes.current) == pool.reserved_current());
  CHECK(static_cast<std::uint64_t>(s.reserved_bytes.peak) == pool.reserved_high());
  CHECK(static_cast<std::size_t>(s.reserved_bytes.peak) >= high);
  CHECK(s.reserved_bytes.peak > s.reserved_bytes.current);
  a->check_invariants();

  a->reset_peak_stats();  // resets the pool's high watermark with the front end's peak
  s = a->stats();
  CHECK(s.reserved_bytes.peak == s.reserved_bytes.current);
  CHECK(pool.reserved_high() == pool.reserved_current());
  void* big = a->allocate(200 * kMiB, 1);
  a->deallocate(big);
  sim->complete_all();
  s = a->stats();
  high = pool.reserved_high();
  CHECK(static_cast<std::size_t>(s.reserved_bytes.peak) == high);
  CHECK(high >= 240 * kMiB);
  a->deallocate(small);
  a->check_invariants();
}

TEST_CASE("async: stats time the pool's calls by the backend's clock (Note [Time in the pool's calls])",
          "[async][stats]") {
  SimOptions o;
  o.model_call_costs = true;  // every pool call moves the simulated clock by costs.pool_op_ns
  auto [sim, a] = test::make_sim_allocator("async", o);
  std::vector<void*> ptrs;
  for (int i = 0; i < 20; ++i) {
    ptrs.push_back(a->allocate((2 + i) * kMiB, i % 2));  // large: from the pool
    ptrs.push_back(a->allocate(4096, i % 2));             // small: a slab now and then
  }
  for (void* p : ptrs) {
    a->deallocate(p);
  }
  const Stats s = a->stats();
  REQUIRE(s.pool.has_value());
  CHECK(s.pool->pool_calls >= 40);
  // Each call costs costs.pool_op_ns, and a call that grows the pool also its physical pages'
  // creation and mapping; nothing else in this sequence moves the clock.
  CHECK(s.pool->pool_ns >= s.pool->pool_calls * SimCallCosts{}.pool_op_ns);
  CHECK(s.pool->pool_ns == sim->clock_ns());
  CHECK(s.to_map().at("pool.ns") == static_cast<std::int64_t>(s.pool->pool_ns));
  // Without the cost model the simulated clock stands still: nothing is charged.
  auto [sim2, b] = test::make_sim_allocator("async");
  b->deallocate(b->allocate(8 * kMiB, 0));
  CHECK(b->stats().pool->pool_ns == 0);
  CHECK(b->stats().pool->pool_calls >= 1);
}
