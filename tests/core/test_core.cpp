// test_core.cpp: config parser, pointer map, simulated backend, and the front end's retry chain.
#include "../support.h"

#include <cachealloc/config.h>
#include <cachealloc/errors.h>
#include <cachealloc/pointer_map.h>
#include <cachealloc/spin_mutex.h>
#include <cachealloc/policies/defrag.h>
#include <cachealloc/policies/size_class.h>

#include <catch2/catch.hpp>

#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

using namespace cachealloc;

TEST_CASE("config: PYTORCH_CUDA_ALLOC_CONF syntax", "[config]") {
  Config c = Config::parse(
      "policy:native, max_split_size_mb:256,roundup_power2_divisions:[256:1,512:2,>:4],"
      "garbage_collection_threshold:0.6,expandable_segments:True");
  CHECK(c.policy() == "native");
  CHECK(c.take_bytes("max_split_size_mb") == 256 * kMiB);
  auto list = c.take_list("roundup_power2_divisions");
  REQUIRE(list);
  REQUIRE(list->size() == 3);
  CHECK((*list)[2].first == ">");
  CHECK((*list)[2].second == "4");
  CHECK(c.take_double("garbage_collection_threshold", 0.0, 1.0) == Approx(0.6));
  CHECK(c.take_bool("expandable_segments") == true);
  (void)c.take_string("policy");
  CHECK_NOTHROW(c.finish("policy native", {}));
  CHECK(Config::parse(c.to_string()).entries() == c.entries());
}

TEST_CASE("config: errors are clear", "[config]") {
  CHECK_THROWS_WITH(Config::parse("policy"), Catch::Contains("has no ':'"));
  CHECK_THROWS_WITH(Config::parse("a:1,a:2"), Catch::Contains("given twice"));
  CHECK_THROWS_WITH(Config::parse("x:[1,2"), Catch::Contains("never closed"));
  CHECK_THROWS_WITH(Config::parse("x:1]"), Catch::Contains("unbalanced"));
  CHECK_THROWS_WITH(Config::parse("x:"), Catch::Contains("empty value"));
  Config c = Config::parse("flag:maybe,n:12x,size:3TB,frac:nan");
  CHECK_THROWS_WITH(c.take_bool("flag"), Catch::Contains("expects True or False"));
  CHECK_THROWS_WITH(c.take_int("n", 0, 100), Catch::Contains("expects an integer"));
  CHECK_THROWS_WITH(c.take_bytes("size"), Catch::Contains("unknown unit"));
  CHECK_THROWS_WITH(c.take_double("frac", 0, 1), Catch::Contains("expects a number"));
  Config d = Config::parse("polcy:size_class");
  CHECK_THROWS_WITH(d.finish("policy size_class", {"policy"}),
                    Catch::Contains("unknown key 'polcy'") && Catch::Contains("valid keys: policy"));
  Config e = Config::parse("policy:nope");
  CHECK_THROWS_WITH(make_allocator("nope", std::make_unique<SimBackend>(), e),
                    Catch::Contains("unknown policy 'nope'") && Catch::Contains("size_class"));
}

TEST_CASE("config: one number parser for settings and command-line numbers", "[config]") {
  CHECK(parse_finite_double("0.25") == 0.25);
  CHECK(parse_finite_double("1e-3") == 1e-3);
  CHECK(parse_finite_double("-2") == -2.0);
  for (const char* bad : {"", "abc", "1.5x", "0.2 ", "inf", "-inf", "nan", "1e999"}) {
    INFO(bad);
    CHECK_FALSE(parse_finite_double(bad).has_value());
  }
}

TEST_CASE("pointer map agrees with std::unordered_map under random churn", "[core]") {
  PointerMap<int> map;
  std::unordered_map<std::uintptr_t, int> ref;
  std::mt19937_64 rng(7);
  std::vector<std::uintptr_t> keys;
  for (int i = 0; i < 200000; ++i) {
    if (keys.empty() || rng() % 2 == 0) {
      const std::uintptr_t k = (rng() % 100000 + 1) * 512;
      if (ref.count(k) != 0U) {
        continue;
      }
      map.insert(k, i);
      ref[k] = i;
      keys.push_back(k);
    } else {
      const std::size_t j = rng() % keys.size();
      if (rng() % 2 == 0) {
        CHECK(map.erase(keys[j]));
      } else {
        int taken = -1;
        CHECK(map.take(keys[j], taken));
        CHECK(taken == ref[keys[j]]);
      }
      ref.erase(keys[j]);
      keys[j] = keys.back();
      keys.pop_back();
    }
  }
  CHECK(map.size() == ref.size());
  for (const auto& [k, v] : ref) {
    const int* found = map.find(k);
    REQUIRE(found != nullptr);
    CHECK(*found == v);
  }
  CHECK(map.find(512 * 100001) == nullptr);
  int untouched = 42;
  CHECK_FALSE(map.take(512 * 100001, untouched));
  CHECK_FALSE(map.take(0, untouched));
  CHECK(untouched == 42);
}

TEST_CASE("spin mutex: mutual exclusion under contention, try_lock, long holds", "[core]") {
  SpinMutex m;
  REQUIRE(m.try_lock());
  CHECK_FALSE(m.try_lock());
  m.unlock();
  // More threads than this machine's cores: waiters spin, yield and nap; the plain (non-atomic)
  // counter comes out exact only if no two threads were ever inside at once (TSan checks too).
  constexpr int kThreads = 8;
  constexpr int kRounds = 20000;
  std::uint64_t counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        std::lock_guard lock(m);
        ++counter;
        if (t == 0 && i % 5000 == 0) {  // now and then a long hold (a device call)
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  CHECK(counter == std::uint64_t{kThreads} * kRounds);
}

TEST_CASE("front end: statistics agree with a plain Stat model under parking and resets", "[core]") {
  // Note [Cheap statistics on the fast path]: the front end derives cumulative figures and the
  // `active` statistics; this drives the textbook version (Stat, every field written on every
  // change) beside it and compares all five statistics after every step.
  auto backend = std::make_unique<SimBackend>(SimOptions{});
  SimBackend* sim = backend.get();
  Config config;
  CachingAllocator<SizeClassPolicy> a(std::move(backend), config);
  Stat allocated, requested, active_bytes, allocation, active;
  struct Parked {
    std::size_t size;
    bool done;
    bool recorded;  // its event exists: Note [Events shared by a burst of parked frees]
  };
  std::vector<Parked> parked;
  std::vector<std::pair<void*, bool>> live;  // pointer, used on stream 2 too
  std::mt19937_64 rng(7);
  sim->hold_stream(2);
  auto burst_ends = [&] {  // any call but a parked free records the burst's events
    for (Parked& p : parked) {
      p.recorded = true;
    }
  };
  auto complete_done = [&] {
    std::erase_if(parked, [&](const Parked& p) {
      if (p.done) {
        active_bytes.decrease(static_cast<std::int64_t>(p.size));
        active.decrease(1);
      }
      return p.done;
    });
  };
  auto same = [](const Stat& x, const Stat& y) {
    return x.current == y.current && x.peak == y.peak && x.allocated == y.allocated && x.freed == y.freed;
  };
  for (int step = 0; step < 20000; ++step) {
    const unsigned op = static_cast<unsigned>(rng() % 100);
    if (op < 45 || live.empty()) {
      const std::size_t bytes = 1 + rng() % (rng() % 2 != 0 ? 4096 : 8 * kMiB);
      burst_ends();
      if (!parked.empty()) {
        complete_done();  // allocate() hands completed parked frees to the policy first
      }
      void* p = a.allocate(bytes, 1);
      const std::size_t size = a.find(p)->block_size;
      allocated.increase(static_cast<std::int64_t>(size));
      requested.increase(static_cast<std::int64_t>(bytes));
      active_bytes.increase(static_cast<std::int64_t>(size));
      allocation.increase(1);
      active.increase(1);
      const bool cross = rng() % 4 == 0;
      if (cross) {
        a.record_stream(p, 2);
      }
      live.emplace_back(p, cross);
    } else if (op < 85) {
      const std::size_t k = rng() % live.size();
      const auto [p, cross] = live[k];
      live[k] = live.back();
      live.pop_back();
      const auto info = *a.find(p);
      a.deallocate(p);
      allocated.decrease(static_cast<std::int64_t>(info.block_size));
      requested.decrease(static_cast<std::int64_t>(info.requested));
      allocation.decrease(1);
      if (cross) {
        parked.push_back({info.block_size, false, false});
      } else {
        burst_ends();
        active_bytes.decrease(static_cast<std::int64_t>(info.block_size));
        active.decrease(1);
      }
    } else if (op < 92) {
      sim->release_stream(2);  // every event recorded on stream 2 so far completes
      sim->hold_stream(2);
      for (Parked& p : parked) {
        p.done = p.done || p.recorded;  // the burst's event comes later, on the held stream
      }
    } else if (op < 96) {
      a.reset_peak_stats();
      for (Stat* st : {&allocated, &requested, &active_bytes, &allocation, &active}) {
        st->reset_peak();
      }
    } else {
      a.reset_accumulated_stats();
      for (Stat* st : {&allocated, &requested, &active_bytes, &allocation, &active}) {
        st->reset_accumulated();
      }
    }
    const Stats s = a.stats();
    REQUIRE(a.pending_frees() == parked.size());
    REQUIRE(same(s.allocated_bytes, allocated));
    REQUIRE(same(s.requested_bytes, requested));
    REQUIRE(same(s.active_bytes, active_bytes));
    REQUIRE(same(s.allocation, allocation));
    REQUIRE(same(s.active, active));
    REQUIRE(s.alloc_calls == static_cast<std::uint64_t>(allocation.allocated));
    REQUIRE(s.free_calls == static_cast<std::uint64_t>(allocation.freed));
  }
  a.check_invariants();
}

TEST_CASE("sim backend: capacity, deterministic addresses, events, faults", "[sim]") {
  SimOptions o;
  o.capacity = 64 * kMiB;
  SimBackend a(o);
  SimBackend b(o);
  void* p1 = a.reserve(10 * kMiB);
  void* p2 = b.reserve(10 * kMiB);
  CHECK(p1 == p2);
  CHECK(a.reserve(60 * kMiB) == nullptr);
  CHECK(a.counters().failed_reserves == 1);
  a.release(p1, 10 * kMiB);
  CHECK(a.held_bytes() == 0);
  CHECK(a.reserve(10 * kMiB) == p1);  // addresses are reused first-fit

  const EventId e1 = a.record_event(5);
  const EventId e2 = a.record_event(6);
  CHECK_FALSE(a.query_event(e1));
  a.complete_stream(5);
  CHECK(a.query_event(e1));
  CHECK_FALSE(a.query_event(e2));
  a.hold_stream(6);
  a.tick();
  CHECK_FALSE(a.query_event(e2));
  a.release_stream(6);
  CHECK(a.query_event(e2));

  a.fail_next(SimCall::reserve);
  CHECK(a.reserve(kMiB) == nullptr);
  a.fail_call(1, SimFault::device_error);
  CHECK_THROWS_AS((void)a.record_event(1), DeviceError);
  CHECK(a.injected_faults() == 2);

  VirtualMemory* vm = a.virtual_memory();
  REQUIRE(vm != nullptr);
  const auto va = vm->reserve_address(8 * kMiB);
  const PhysicalHandle h = vm->create_physical(2 * kMiB);
  vm->map(va, 2 * kMiB, h);
  CHECK(a.is_mapped(va, 2 * kMiB));
  CHECK_FALSE(a.is_mapped(va, 4 * kMiB));
  CHECK_THROWS_AS(vm->map(va, 2 * kMiB, h), DeviceError);  // already mapped there
  vm->unmap(va, 2 * kMiB);
  vm->release_physical(h, 2 * kMiB);
  CHECK(a.counters().map_calls == 1);
  CHECK(a.counters().unmap_calls == 1);
}

TEST_CASE("front end: the retry chain steps", "[core][oom]") {
  SimOptions o;
  o.capacity = 100 * kMiB;
  auto backend = std::make_unique<SimBackend>(o);
  SimBackend* sim = backend.get();
  Config config;
  CachingAllocator<SizeClassPolicy> a(std::move(backend), config);

  SECTION("step 2: parked cross-stream frees are waited for before giving up") {
    void* p = a.allocate(80 * kMiB, 1);
    a.record_stream(p, 2);
    a.deallocate(p);
    CHECK(a.pending_frees() == 1);
    // The cache alone cannot serve 90 MiB; only waiting for stream 2 and releasing can.
    void* q = a.allocate(90 * kMiB, 1);
    CHECK(q != nullptr);
    CHECK(a.pending_frees() == 0);
    CHECK(a.stats().num_alloc_retries == 1);
    CHECK(a.stats().num_sync_all_streams >= 1);
    a.deallocate(q);
  }
  SECTION("step 3: release cached reservations and retry") {
    void* p = a.allocate(60 * kMiB, 1);
    a.deallocate(p);
    void* q = a.allocate(70 * kMiB, 1);
    CHECK(q != nullptr);
    CHECK(sim->counters().release_calls == 1);
    a.deallocate(q);
  }
  SECTION("step 4: OOM message names requested, capacity, allocated, unused") {
    void* p = a.allocate(30 * kMiB, 1);
    CHECK_THROWS_WITH((void)a.allocate(90 * kMiB, 1),
                      Catch::Contains("Tried to allocate 90.00 MiB") &&
                          Catch::Contains("total capacity of 100.00 MiB") &&
                          Catch::Contains("is allocated") &&
                          Catch::Contains("reserved but unallocated"));
    CHECK(a.stats().num_ooms == 1);
    a.deallocate(p);
  }
  SECTION("a failing event record never loses the block") {
    void* p = a.allocate(10 * kMiB, 1);
    a.record_stream(p, 2);
    sim->fail_next(SimCall::record_event, SimFault::device_error);
    a.deallocate(p);  // does not throw: the block stays parked
    CHECK(a.pending_frees() == 1);
    a.check_invariants();
    a.empty_cache();  // records the event again and waits
    CHECK(a.pending_frees() == 0);
  }
  a.check_invariants();
}

TEST_CASE("front end: one event query per busy stream when polling parked frees", "[core]") {
  auto backend = std::make_unique<SimBackend>(SimOptions{});
  SimBackend* sim = backend.get();
  Config config = Config::parse("reuse_parked:False");  // no event on the frees' own stream
  CachingAllocator<SizeClassPolicy> a(std::move(backend), config);
  void* warm = a.allocate(4096, 1);  // the small segment exists: the polls below reserve nothing
  a.deallocate(warm);
  sim->hold_stream(2);
  sim->hold_stream(3);
  for (int i = 0; i < 3; ++i) {  // three frees parked behind stream 2, one behind stream 3
    void* p = a.allocate(kMiB, 1);
    a.record_stream(p, i < 2 ? 2 : 3);
    a.record_stream(p, 2);
    a.deallocate(p);
  }
  REQUIRE(a.pending_frees() == 3);
  // The statistics count what reaches the device: one event per stream a freed block was used
  // on (stream 2 twice on the first two blocks is one stream), recorded at the next call (Note
  // [Events shared by a burst of parked frees]): the second and third allocations above recorded
  // the first two frees' events and each queried stream 2's first event; the third free's two
  // events wait for the next call.
  CHECK(a.stats().num_event_records == 2);
  CHECK(a.stats().num_event_queries == 2);
  const std::uint64_t before = sim->device_calls();
  void* q = a.allocate(4096, 1);
  // The third free's two events are recorded; stream 2's first event is incomplete: its later
  // ones are not queried, stream 3's is.
  CHECK(sim->device_calls() - before == 4);
  CHECK(a.pending_frees() == 3);
  const auto m = a.stats().to_map();
  CHECK(m.at("num_event_records") == 4);
  CHECK(m.at("num_event_queries") == 4);
  CHECK(m.at("event_ns") == 0);  // the simulated device charges events no time
  sim->release_stream(2);
  sim->release_stream(3);
  a.deallocate(q);
  void* r = a.allocate(4096, 1);
  CHECK(a.pending_frees() == 0);
  a.deallocate(r);
  a.check_invariants();
}

TEST_CASE("front end: parked frees come back by stream in any order and failed event calls only delay them", "[core]") {
  // Note [Parked frees by stream]: the poll asks each stream's oldest event; a free comes back
  // once all of its streams are done, whichever stream finishes first; failed event calls only
  // delay it. check_invariants compares the per-stream queues with the parked frees each step.
  auto backend = std::make_unique<SimBackend>(SimOptions{});
  SimBackend* sim = backend.get();
  Config config;
  CachingAllocator<SizeClassPolicy> a(std::move(backend), config);
  void* warm = a.allocate(4096, 1);
  a.deallocate(warm);
  sim->hold_stream(2);
  sim->hold_stream(3);
  auto park = [&](std::initializer_list<StreamId> streams) {
    void* p = a.allocate(kMiB, 1);
    for (StreamId s : streams) {
      a.record_stream(p, s);
    }
    a.deallocate(p);
    a.check_invariants();
    // A free of a block no other stream used ends the burst: the free's events are recorded now,
    // before the streams below are released (Note [Events shared by a burst of parked frees]).
    a.deallocate(a.allocate(64, 1));
    a.check_invariants();
    return p;
  };
  auto poll = [&] {
    a.deallocate(a.allocate(4096, 1));
    a.check_invariants();
  };
  park({2});     // A: behind stream 2
  park({3});     // B: behind stream 3
  park({2, 3});  // C: behind both
  park({3});     // D: behind stream 3
  REQUIRE(a.pending_frees() == 4);

  SECTION("a later stream finishing first gives back its frees, not the others'") {
    sim->release_stream(3);
    poll();
    CHECK(a.pending_frees() == 2);  // B and D back; A and C still wait for stream 2
    CHECK(a.stats().active_bytes.current == 2 * static_cast<std::int64_t>(kMiB));
    sim->release_stream(2);
    poll();
    CHECK(a.pending_frees() == 0);
  }
  SECTION("a failed query counts as not done and is asked again") {
    sim->release_stream(2);
    sim->fail_next(SimCall::query_event, SimFault::device_error);
    poll();  // stream 2's query fails; stream 3 is still busy
    CHECK(a.pending_frees() == 4);
    poll();
    CHECK(a.pending_frees() == 3);  // A: C still waits for stream 3
    sim->release_stream(3);
    poll();
    CHECK(a.pending_frees() == 0);
  }
  SECTION("a free whose event could not be recorded waits until a poll records it") {
    sim->fail_next(SimCall::record_event, SimFault::device_error);
    park({2});  // E: its event on stream 2 is missing
    CHECK(a.pending_frees() == 5);
    sim->release_stream(3);
    poll();  // records E's event (stream 2 is held: pending) and gives back B and D
    CHECK(a.pending_frees() == 3);
    sim->release_stream(2);
    poll();
    CHECK(a.pending_frees() == 0);
  }
  SECTION("waiting for the frees (empty_cache) empties the queues") {
    sim->release_stream(2);
    sim->release_stream(3);
    a.empty_cache();
    a.check_invariants();
    CHECK(a.pending_frees() == 0);
    sim->hold_stream(2);
    park({2});  // parking again after the queues were rebuilt
    poll();
    CHECK(a.pending_frees() == 1);
    sim->release_stream(2);
    poll();
    CHECK(a.pending_frees() == 0);
  }
  CHECK(a.stats().active_bytes.current == 0);
  a.check_invariants();
}

namespace {
// Note [Events shared by a burst of parked frees]: six frees in a row, four used on stream 2,
// one on stream 3, one on both, record nothing until the next call, which records one event per
// stream (and, for a policy that takes settled frees, one on their own stream 1) for all six.
// A poll asks each stream's shared event once; the frees come back by stream; every event is
// destroyed once its last free came back; check_invariants counts each event's holders.
template <typename Policy>
void check_burst_shares_events(std::unique_ptr<SimBackend> backend, Config& config, bool own_events) {
  SimBackend* sim = backend.get();
  CachingAllocator<Policy> a(std::move(backend), config);
  a.deallocate(a.allocate(4096, 1));
  sim->hold_stream(1);
  sim->hold_stream(2);
  sim->hold_stream(3);
  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) {
    blocks.push_back(a.allocate(kMiB, 1));
  }
  for (int i = 0; i < 6; ++i) {
    if (i != 4) {
      a.record_stream(blocks[static_cast<std::size_t>(i)], 2);
    }
    if (i >= 4) {
      a.record_stream(blocks[static_cast<std::size_t>(i)], 3);
    }
  }
  const Stats before = a.stats();
  const std::size_t policy_events = sim->live_events();  // defrag's own (its epochs)
  for (void* b : blocks) {
    a.deallocate(b);
    a.check_invariants();
  }
  CHECK(a.pending_frees() == 6);
  CHECK(a.stats().num_event_records == before.num_event_records);  // the burst is still open
  const std::uint64_t shared = own_events ? 3 : 2;                  // streams 2, 3 (and 1)
  void* q = a.allocate(4096, 1);
  a.check_invariants();
  CHECK(a.stats().num_event_records == before.num_event_records + shared);
  CHECK(sim->live_events() == policy_events + shared);
  CHECK(a.pending_frees() == 6);

  sim->release_stream(2);
  const std::uint64_t queries = a.stats().num_event_queries;
  a.deallocate(a.allocate(4096, 1));
  a.check_invariants();
  CHECK(a.pending_frees() == 2);  // the four used on stream 2 alone; the two on stream 3 wait
  // One query per stream's event, however many frees share it (stream 1's own event, where
  // there is one, asked once for the four that came back); defrag also asks its own events.
  if (!own_events) {
    CHECK(a.stats().num_event_queries - queries == shared);
  }
  sim->release_stream(3);
  sim->release_stream(1);
  a.deallocate(a.allocate(4096, 1));
  a.check_invariants();
  CHECK(a.pending_frees() == 0);
  CHECK(sim->live_events() == policy_events);  // every shared event destroyed
  CHECK(a.stats().active_bytes.current == static_cast<std::int64_t>(a.find(q)->block_size));
  a.deallocate(q);
  a.check_invariants();
}
}  // namespace

TEST_CASE("front end: a burst of parked frees records one event per stream at the next call", "[core]") {
  SECTION("size_class: the other streams' events") {
    Config config = Config::parse("reuse_parked:False");  // reuse_parked records the own stream's too
    check_burst_shares_events<SizeClassPolicy>(std::make_unique<SimBackend>(SimOptions{}), config, false);
  }
  SECTION("defrag: and one on the frees' own stream (Note [Frees that come back settled])") {
    SimOptions o;
    o.capacity = std::size_t{1} << 34;
    Config config;
    check_burst_shares_events<DefragPolicy>(std::make_unique<SimBackend>(o), config, true);
  }
}

TEST_CASE("front end: share_events False records a parked free's events at the free", "[core]") {
  auto backend = std::make_unique<SimBackend>(SimOptions{});
  SimBackend* sim = backend.get();
  Config config = Config::parse("share_events:False,reuse_parked:False");
  CachingAllocator<SizeClassPolicy> a(std::move(backend), config);
  config.finish("test", {});  // the front end took the key
  a.deallocate(a.allocate(4096, 1));
  sim->hold_stream(2);
  std::vector<void*> blocks{a.allocate(kMiB, 1), a.allocate(kMiB, 1), a.allocate(kMiB, 1)};
  const std::uint64_t before = a.stats().num_event_records;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    a.record_stream(blocks[i], 2);
    a.deallocate(blocks[i]);
    a.check_invariants();
    CHECK(a.stats().num_event_records == before + i + 1);  // one per free, at the free
  }
  sim->release_stream(2);  // the three events were recorded before: all complete
  a.deallocate(a.allocate(4096, 1));
  CHECK(a.pending_frees() == 0);
  CHECK(sim->live_events() == 0);
  a.check_invariants();
  Config bad = Config::parse("share_events:maybe");
  CHECK_THROWS_AS(CachingAllocator<SizeClassPolicy>(std::make_unique<SimBackend>(SimOptions{}), bad), ConfigError);
}

namespace {
// Note [Reusing a parked free on the stream it waits for]: stream 1 allocates, stream 2 uses the
// block (record_stream) and is busy; an allocation of the same size on stream 2 takes the parked
// block at once, one on stream 1 does not; the reused block's free waits for stream 2. When the
// block's own stream (or a third stream that used it) is busy too, stream 2 takes it only with
// reuse_parked_waits, by waiting for that stream on the device (`waits`).
template <typename Policy>
void check_reuse_on_waited_stream(SimOptions o, const std::string& conf, bool count_events) {
  auto backend = std::make_unique<SimBackend>(o);
  SimBackend* sim = backend.get();
  const bool waits = conf.find("reuse_parked_waits:False") == std::string::npos && o.stream_waits;
  Config config = Config::parse("reuse_parked:True" + conf);
  CachingAllocator<Policy> a(std::move(backend), config);
  a.deallocate(a.allocate(4096, 1));
  const std::size_t policy_events = sim->live_events();
  sim->hold_stream(2);
  void* x = a.allocate(kMiB, 1);
  a.record_stream(x, 2);
  a.deallocate(x);
  a.check_invariants();
  REQUIRE(a.pending_frees() == 1);

  void* other_size = a.allocate(2 * kMiB, 2);  // too large for it
  CHECK(other_size != x);
  void* on_own_stream = a.allocate(kMiB, 1);  // stream 2 may still read it: not for stream 1
  CHECK(on_own_stream != x);
  CHECK(a.pending_frees() == 1);
  void* y = a.allocate(kMiB - 1000, 2);  // within 1/32: stream 2's new work follows its old
  a.check_invariants();
  CHECK(y == x);
  CHECK(a.pending_frees() == 0);
  CHECK(a.stats().parked_reuses == 1);
  CHECK(a.stats().parked_reuse_waits == 0);  // stream 1 was done with it
  CHECK(a.find(y)->requested == kMiB - 1000);

  // Its free waits for stream 2 (still busy): stream 1 must not get it back meanwhile.
  a.deallocate(y);
  a.check_invariants();
  CHECK(a.pending_frees() == 1);
  void* z = a.allocate(kMiB, 1);
  CHECK(z != x);
  sim->release_stream(2);
  a.deallocate(a.allocate(4096, 1));  // polls: the reused free's events and the new one's complete
  a.check_invariants();
  CHECK(a.pending_frees() == 0);

  // The block's own stream still busy.
  sim->hold_stream(1);
  sim->hold_stream(2);
  void* w = a.allocate(kMiB, 1);
  const std::uint64_t ones = sim->stream_recorded(1);
  a.record_stream(w, 2);
  a.deallocate(w);
  void* v = a.allocate(kMiB, 2);
  a.check_invariants();
  void* w2 = nullptr;
  if (waits) {  // taken, with stream 2 waiting for stream 1's work at the free
    CHECK(v == w);
    CHECK(a.stats().parked_reuse_waits == 1);
    CHECK(sim->stream_waits_for(2, 1, ones));
    sim->release_stream(2);
    const EventId later = sim->record_event(2);
    CHECK_FALSE(sim->query_event(later));  // stream 2's new work runs after stream 1's
    sim->release_stream(1);
    CHECK(sim->query_event(later));
    sim->destroy_event(later);
    sim->hold_stream(2);
    w2 = a.allocate(kMiB, 2);
  } else {  // not until stream 1 is done
    CHECK(v != w);
    CHECK(a.stats().parked_reuses == 1);
    sim->release_stream(1);
    w2 = a.allocate(kMiB, 2);
    a.check_invariants();
    CHECK(w2 == w);
  }
  // A third stream used it too and is busy.
  sim->hold_stream(3);
  void* u = a.allocate(3 * kMiB, 1);
  a.record_stream(u, 2);
  a.record_stream(u, 3);
  a.deallocate(u);
  void* t = a.allocate(3 * kMiB, 2);
  void* r = nullptr;
  if (waits) {
    CHECK(t == u);
    CHECK(sim->stream_waits_for(2, 3, 0));
    sim->release_stream(3);
    r = a.allocate(3 * kMiB, 2);
  } else {
    CHECK(t != u);
    sim->release_stream(3);
    r = a.allocate(3 * kMiB, 2);
    CHECK(r == u);
  }
  a.check_invariants();
  CHECK(a.stats().parked_reuses == 3);
  CHECK(a.stats().parked_reuse_waits == (waits ? 2U : 0U));

  for (void* p : {other_size, on_own_stream, z, v, w2, t, r}) {
    a.deallocate(p);
  }
  sim->release_stream(2);
  a.empty_cache();  // waits for the parked frees, drops the reused ones' events
  a.check_invariants();
  CHECK(a.pending_frees() == 0);
  if (count_events) {  // not size_class: it keeps an event per stream pool of its own (its epochs)
    CHECK(sim->live_events() == policy_events);  // every event of the front end destroyed
  }
  CHECK(a.stats().active_bytes.current == 0);
  CHECK(a.stats().allocated_bytes.current == 0);
}
}  // namespace

TEST_CASE("front end: reuse_parked gives a parked free to the stream it waits for", "[core]") {
  SimOptions o;
  o.auto_complete_events = true;  // streams not held are done at once
  o.capacity = std::size_t{1} << 34;
  // With reuse_parked_waits (the default); without it; and with it on a device that cannot wait
  // (as without).
  const int mode = GENERATE(0, 1, 2);
  CAPTURE(mode);
  o.stream_waits = mode != 2;
  const std::string waits = mode == 1 ? ",reuse_parked_waits:False" : "";
  SECTION("size_class") {
    check_reuse_on_waited_stream<SizeClassPolicy>(o, waits, false);
  }
  SECTION("size_class, events recorded at the free") {
    check_reuse_on_waited_stream<SizeClassPolicy>(o, waits + ",share_events:False", false);
  }
  SECTION("defrag") {
    check_reuse_on_waited_stream<DefragPolicy>(o, waits, true);
  }
  SECTION("defrag, events recorded at the free") {
    check_reuse_on_waited_stream<DefragPolicy>(o, waits + ",share_events:False", true);
  }
  SECTION("reuse_parked False turns it off") {
    auto backend = std::make_unique<SimBackend>(o);
    SimBackend* sim = backend.get();
    Config config = Config::parse("reuse_parked:False");
    CachingAllocator<SizeClassPolicy> a(std::move(backend), config);
    config.finish("test", {});  // the front end took the key
    a.deallocate(a.allocate(4096, 1));
    sim->hold_stream(2);
    void* x = a.allocate(kMiB, 1);
    a.record_stream(x, 2);
    a.deallocate(x);
    void* y = a.allocate(kMiB, 2);
    CHECK(y != x);
    CHECK(a.stats().parked_reuses == 0);
    a.deallocate(y);
    sim->release_stream(2);
    a.empty_cache();
    a.check_invariants();
  }
}

TEST_CASE("front end: event_poll_interval polls parked frees at every N-th allocation only",
          "[core]") {
  auto backend = std::make_unique<SimBackend>(SimOptions{});
  SimBackend* sim = backend.get();
  Config config = Config::parse("event_poll_interval:4,reuse_parked:False");
  CachingAllocator<SizeClassPolicy> a(std::move(backend), config);
  config.finish("test", {});  // the front end took the key
  void* warm = a.allocate(4096, 1);
  a.deallocate(warm);
  sim->hold_stream(2);
  void* p = a.allocate(kMiB, 1);
  a.record_stream(p, 2);
  a.deallocate(p);
  REQUIRE(a.pending_frees() == 1);
  // The first allocation after the park records its event (Note [Events shared by a burst of
  // parked frees]); allocations 1-3 query nothing; the 4th queries stream 2's event once.
  std::vector<void*> held;
  for (int i = 1; i <= 8; ++i) {
    const std::uint64_t before = sim->device_calls();
    held.push_back(a.allocate(4096, 1));
    CHECK(sim->device_calls() - before == (i == 1 || i % 4 == 0 ? 1u : 0u));
  }
  sim->release_stream(2);
  for (int i = 1; i <= 3; ++i) {  // completed, but not handed back before the next poll
    held.push_back(a.allocate(4096, 1));
    CHECK(a.pending_frees() == 1);
  }
  held.push_back(a.allocate(4096, 1));
  CHECK(a.pending_frees() == 0);
  for (void* h : held) {
    a.deallocate(h);
  }
  // Out of memory, the retry chain still waits for parked frees whatever the interval.
  sim->hold_stream(2);
  void* big = a.allocate(12 * kMiB, 1);  // a segment of its own
  a.record_stream(big, 2);
  a.deallocate(big);
  sim->set_limit(static_cast<std::size_t>(a.stats().reserved_bytes.current));
  void* again = a.allocate(12 * kMiB, 1);  // no room to grow: the parked block, after a waiting flush
  CHECK(a.pending_frees() == 0);
  CHECK(again == big);
  a.deallocate(again);
  a.check_invariants();
  Config bad = Config::parse("event_poll_interval:0");
  CHECK_THROWS_AS(CachingAllocator<SizeClassPolicy>(std::make_unique<SimBackend>(SimOptions{}), bad), ConfigError);
}

TEST_CASE("sim: the clock runs on the driver's time plus the modelled cost of each call",
          "[core][sim]") {
  SimOptions o;
  o.model_call_costs = true;
  SimBackend sim(o);
  CHECK(sim.clock_ns() == 0);
  sim.advance_clock_to(1'000'000);
  CHECK(sim.clock_ns() == 1'000'000);
  VirtualMemory& vm = *sim.virtual_memory();
  const std::uintptr_t va = vm.reserve_address(4 * kMiB);
  const PhysicalHandle h = vm.create_physical(2 * kMiB);  // 13.6 us
  vm.map(va, 2 * kMiB, h);                                 // 55 us
  vm.unmap(va, 2 * kMiB);                                  // 3 us
  vm.release_physical(h, 2 * kMiB);                        // 13.6 us
  vm.free_address(va, 4 * kMiB);
  CHECK(sim.clock_ns() == 1'000'000 + 13'600 + 55'000 + 3'000 + 13'600);
  // The costs delay every later driver time; the clock never runs backwards.
  sim.advance_clock_to(2'000'000);
  CHECK(sim.clock_ns() == 2'000'000 + 85'200);
  sim.advance_clock_to(0);
  CHECK(sim.clock_ns() == 2'000'000 + 85'200);
  SimBackend still;  // no driver time, no modelled costs: the clock stands still
  const PhysicalHandle g = still.virtual_memory()->create_physical(2 * kMiB);
  still.virtual_memory()->release_physical(g, 2 * kMiB);
  CHECK(still.clock_ns() == 0);
}

TEST_CASE("sim: with a GPU lag, events complete late and a wait costs host time", "[core][sim]") {
  SimOptions o;
  o.auto_complete_events = true;
  o.event_lag_ns = 5'000'000;
  SimBackend sim(o);
  const EventId a = sim.record_event(1);
  CHECK_FALSE(sim.query_event(a));
  sim.advance_clock_to(4'999'999);
  CHECK_FALSE(sim.query_event(a));
  sim.advance_clock_to(5'000'000);
  CHECK(sim.query_event(a));
  const EventId b = sim.record_event(1);  // ready at 10 ms
  sim.synchronize_event(b);
  CHECK(sim.query_event(b));
  CHECK(sim.clock_ns() == 10'000'000);
  sim.advance_clock_to(6'000'000);  // the wait delayed the driver's later times
  CHECK(sim.clock_ns() == 11'000'000);
  // A held stream stays busy however long the clock runs (record_stream in replays).
  sim.hold_stream(2);
  const EventId c = sim.record_event(2);
  sim.advance_clock_to(100'000'000);
  CHECK_FALSE(sim.query_event(c));
  sim.release_stream(2);
  CHECK(sim.query_event(c));
  for (EventId e : {a, b, c}) {
    sim.destroy_event(e);
  }
}

TEST_CASE("sim: a stream's own lag changes over time and its events still complete in order",
          "[core][sim]") {
  // Note [Each stream's own lag]: stream 1 runs 5 ms behind until 10 ms, then 1 ms; stream 2 has
  // no lag of its own and takes event_lag_ns (0: at once).
  SimOptions o;
  o.auto_complete_events = true;
  o.stream_lag = [](StreamId stream, std::uint64_t clock_ns) -> std::optional<std::uint64_t> {
    if (stream != 1) {
      return std::nullopt;
    }
    return clock_ns < 10'000'000 ? 5'000'000 : 1'000'000;
  };
  SimBackend sim(o);
  const EventId a = sim.record_event(1);  // ready at 5 ms
  const EventId other = sim.record_event(2);
  CHECK(sim.query_event(other));
  sim.advance_clock_to(4'999'999);
  CHECK_FALSE(sim.query_event(a));
  sim.advance_clock_to(9'900'000);
  CHECK(sim.query_event(a));
  const EventId b = sim.record_event(1);  // ready at 14.9 ms
  sim.advance_clock_to(10'000'000);
  const EventId c = sim.record_event(1);  // 1 ms lag now, but not before b: 14.9 ms
  sim.advance_clock_to(11'000'000);
  CHECK_FALSE(sim.query_event(c));
  sim.advance_clock_to(14'900'000);
  CHECK(sim.query_event(b));
  CHECK(sim.query_event(c));
  sim.advance_clock_to(20'000'000);
  const EventId d = sim.record_event(1);  // caught up: 1 ms
  sim.advance_clock_to(20'999'999);
  CHECK_FALSE(sim.query_event(d));
  sim.advance_clock_to(21'000'000);
  CHECK(sim.query_event(d));
  for (EventId e : {a, b, c, d, other}) {
    sim.destroy_event(e);
  }
}

TEST_CASE("front end: the time inside each kind of device call, in the stats", "[core]") {
  // The simulated device charges an H200's median cost per call (Note [Simulated time]), so the
  // times the backend measured (Note [Time in device calls]) are exactly those costs.
  SimOptions opts;
  opts.model_call_costs = true;
  {
    auto [sim, a] = test::make_sim_allocator("defrag", opts);
    void* p = a->allocate(64 * kMiB, 0);
    a->deallocate(p);
    a->empty_cache();  // unmaps and releases every page
    const Stats s = a->stats();
    const auto m = s.to_map();
    const BackendCounters& c = sim->counters();
    REQUIRE(c.physical_creates > 0);
    REQUIRE(c.physical_releases > 0);
    CHECK(m.at("create_ns") == static_cast<std::int64_t>(13'600 * c.physical_creates));
    CHECK(m.at("release_physical_ns") == static_cast<std::int64_t>(13'600 * c.physical_releases));
    CHECK(m.at("map_ns") == static_cast<std::int64_t>(55'000 * c.map_calls));
    // 3 us per mapping removed: at least one per unmap call.
    CHECK(m.at("unmap_ns") >= static_cast<std::int64_t>(3'000 * c.unmap_calls));
    CHECK(m.at("unmap_ns") % 3'000 == 0);
    CHECK(m.at("reserve_ns") == 0);
    CHECK(m.at("release_ns") == 0);
  }
  {
    auto [sim, a] = test::make_sim_allocator("size_class", opts);
    void* p = a->allocate(64 * kMiB, 0);
    a->deallocate(p);
    a->empty_cache();
    const auto m = a->stats().to_map();
    const BackendCounters& c = sim->counters();
    REQUIRE(c.reserve_calls > 0);
    REQUIRE(c.release_calls > 0);
    CHECK(m.at("reserve_ns") == static_cast<std::int64_t>(90'000 * c.reserve_calls));
    CHECK(m.at("release_ns") == static_cast<std::int64_t>(90'000 * c.release_calls));
    CHECK(m.at("map_ns") == 0);
  }
}

TEST_CASE("simulated device: queries that answer from a watcher's last look", "[core][sim]") {
  // SimOptions::query_lag_calls / query_look_ns (Note [The record thread watches its events]).
  SECTION("by calls: the watcher looks at every third query") {
    SimOptions o;
    o.auto_complete_events = true;  // complete as soon as recorded
    o.query_lag_calls = 3;
    SimBackend sim(o);
    const EventId e = sim.record_event(1);
    CHECK_FALSE(sim.query_event(e));
    CHECK_FALSE(sim.query_event(e));
    CHECK(sim.query_event(e));  // the third query is a look
    CHECK(sim.query_event(e));  // and it stays seen
    sim.destroy_event(e);
  }
  SECTION("by time: a look once the clock moved on by query_look_ns") {
    SimOptions o;
    o.auto_complete_events = true;
    o.query_look_ns = 100'000;
    SimBackend sim(o);
    sim.advance_clock_to(1'000'000);
    const EventId first = sim.record_event(1);
    CHECK(sim.query_event(first));  // the first look is due at once: 1 ms since the last (at 0)
    const EventId e = sim.record_event(1);
    sim.advance_clock_to(1'050'000);
    CHECK_FALSE(sim.query_event(e));  // 50 us since the last look: the answer is that look's
    sim.advance_clock_to(1'100'000);
    CHECK(sim.query_event(e));  // 100 us: a new look
    sim.destroy_event(first);
    sim.destroy_event(e);
  }
}
