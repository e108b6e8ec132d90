// test_native.cpp: the rules of policy `native` (PyTorch's CUDACachingAllocator), one by one, on
// the simulated device, plus fixed-seed randomized sequences checked after every step.
#include <cachealloc/allocator.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/native.h>
#include <cachealloc/sim_backend.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace cachealloc;

namespace {

constexpr std::size_t MiB = kMiB;

NativeSettings settings_from(const std::string& text) {
  Config config = Config::parse(text);
  NativeSettings s = NativeSettings::from_config(config);
  config.finish("native", NativePolicy::config_keys());
  return s;
}

/// A policy on its own simulated device (no front end), for rule-by-rule tests.
struct Fixture {
  explicit Fixture(const std::string& conf = "", std::size_t capacity = std::size_t{143771} * MiB)
      : backend(SimOptions{.capacity = capacity, .granularity = 2 * MiB, .auto_complete_events = true}),
        policy(backend, settings_from(conf)) {
    policy.set_record_segments(true);
  }
  Block alloc(std::size_t bytes, StreamId stream = 0) {
    Block b = policy.allocate(bytes, stream);
    policy.check_invariants();
    return b;
  }
  void free(Block b, StreamId stream = 0) {
    policy.deallocate(b, stream);
    policy.check_invariants();
  }
  /// Sizes of the reservation changes so far, as "a20M f20M m2M u2M" style text.
  std::string events() const {
    std::string out;
    for (const SegmentEvent& e : policy.segment_events()) {
      out += out.empty() ? "" : " ";
      out += "afmu"[e.kind];
      out += e.size % MiB == 0 ? std::to_string(e.size / MiB) + "M" : std::to_string(e.size);
    }
    return out;
  }
  std::size_t free_blocks() const {
    std::size_t n = 0;
    policy.visit_segments([&](const SegmentView& s) {
      for (const BlockView& b : s.blocks) {
        n += b.allocated ? 0 : 1;
      }
    });
    return n;
  }
  SimBackend backend;
  NativePolicy policy;
};

}  // namespace

TEST_CASE("native: rounding to 512 bytes and power-of-two divisions", "[native]") {
  const NativeSettings plain;
  CHECK(native_round_size(1, plain) == 512);
  CHECK(native_round_size(512, plain) == 512);
  CHECK(native_round_size(513, plain) == 1024);
  CHECK(native_round_size(MiB + 1, plain) == MiB + 512);
  CHECK(native_round_size(3 * MiB + 1, plain) == 3 * MiB + 512);

  const NativeSettings four = settings_from("roundup_power2_divisions:4");
  CHECK(native_round_size(1200, four) == 1536);  // not above 512 * 4: plain rounding
  CHECK(native_round_size(2049, four) == 2560);  // steps of 512 between 2048 and 4096
  CHECK(native_round_size(3 * MiB + 1, four) == 3 * MiB + MiB / 2);
  CHECK(native_round_size(4 * MiB, four) == 4 * MiB);  // powers of two stay
  CHECK(native_round_size(5 * MiB, four) == 5 * MiB);  // already on a step

  // [256:1,512:2,>:4]: up to 512 MiB no rounding, [512 MiB, 1 GiB) halves, above quarters.
  const NativeSettings list = settings_from("roundup_power2_divisions:[256:1,512:2,>:4]");
  CHECK(list.roundup_power2_divisions[0] == 1);
  CHECK(list.roundup_power2_divisions[8] == 1);
  CHECK(list.roundup_power2_divisions[9] == 2);
  CHECK(list.roundup_power2_divisions[10] == 4);
  CHECK(list.roundup_power2_divisions[15] == 4);
  CHECK(native_round_size(300 * MiB + 1, list) == 300 * MiB + 512);
  CHECK(native_round_size(600 * MiB, list) == 768 * MiB);
  CHECK(native_round_size(1536 * MiB, list) == 1536 * MiB);
  CHECK(native_round_size(1536 * MiB + 1, list) == 1792 * MiB);

  // The first interval named also covers the smaller ones; 0 in a list disables rounding.
  const NativeSettings first = settings_from("roundup_power2_divisions:[64:8,256:0]");
  CHECK(first.roundup_power2_divisions[0] == 8);
  CHECK(first.roundup_power2_divisions[6] == 8);
  CHECK(first.roundup_power2_divisions[7] == 0);
  CHECK(first.roundup_power2_divisions[8] == 0);
  CHECK(native_round_size(5000, first) == 5120);  // 8 steps of 512 between 4096 and 8192
}

TEST_CASE("native: settings are validated as PyTorch validates them", "[native][config]") {
  CHECK_THROWS_AS(settings_from("roundup_power2_divisions:3"), ConfigError);
  CHECK_THROWS_AS(settings_from("roundup_power2_divisions:0"), ConfigError);
  CHECK_THROWS_AS(settings_from("roundup_power2_divisions:[100:2]"), ConfigError);
  CHECK_THROWS_AS(settings_from("roundup_power2_divisions:[256:3]"), ConfigError);
  CHECK_THROWS_AS(settings_from("roundup_power2_divisions:[256:x]"), ConfigError);
  CHECK_THROWS_WITH(settings_from("max_split_size_mb:19"),
                    Catch::Contains("max_split_size_mb too small"));
  CHECK(settings_from("max_split_size_mb:20").max_split_size == 20 * MiB);
  CHECK(settings_from("max_split_size_mb:512").max_split_size == 512 * MiB);
  CHECK_THROWS_AS(settings_from("max_non_split_rounding_mb:10"), ConfigError);
  CHECK_THROWS_AS(settings_from("garbage_collection_threshold:1.0"), ConfigError);
  CHECK_THROWS_AS(settings_from("garbage_collection_threshold:0"), ConfigError);
  CHECK(settings_from("garbage_collection_threshold:0.6").garbage_collection_threshold ==
        Approx(0.6));
  CHECK(settings_from("expandable_segments:True").expandable_segments);
  CHECK_FALSE(settings_from("expandable_segments:False").expandable_segments);
  CHECK_THROWS_AS(settings_from("expandable_segments:maybe"), ConfigError);
  CHECK_THROWS_AS(settings_from("no_such_key:1"), ConfigError);  // finish() names the valid keys
}

TEST_CASE("native: pool choice and reservation sizes", "[native]") {
  CHECK(native_allocation_size(512) == 2 * MiB);
  CHECK(native_allocation_size(MiB) == 2 * MiB);
  CHECK(native_allocation_size(MiB + 512) == 20 * MiB);
  CHECK(native_allocation_size(10 * MiB - 512) == 20 * MiB);
  CHECK(native_allocation_size(10 * MiB) == 10 * MiB);
  CHECK(native_allocation_size(11 * MiB + 512) == 12 * MiB);

  Fixture f;
  Block small = f.alloc(MiB);         // small pool: a 2 MiB reservation
  Block large = f.alloc(MiB + 1);     // large pool: 20 MiB
  Block big = f.alloc(25 * MiB + 7);  // too big for the 19 MiB left: own reservation, 2 MiB units
  CHECK(f.events() == "a2M a20M a26M");
  CHECK(f.policy.reserved_bytes() == 48 * MiB);
  CHECK(f.backend.held_bytes() == 48 * MiB);
  // A second small request is carved from the small reservation, not the large one.
  Block small2 = f.alloc(4096);
  CHECK(f.events() == "a2M a20M a26M");
  CHECK(reinterpret_cast<std::uintptr_t>(small2.ptr) ==
        reinterpret_cast<std::uintptr_t>(small.ptr) + MiB);
  for (Block b : {small, large, big, small2}) {
    f.free(b);
  }
  CHECK(f.policy.cached_bytes() == 48 * MiB);
}

TEST_CASE("native: when the remainder is split off", "[native]") {
  Fixture f;
  // Small pool: any remainder of 512 bytes or more.
  Block a = f.alloc(MiB);
  Block a2 = f.alloc(MiB - 512);  // from the 1 MiB remainder, 512 bytes left over: split
  CHECK(a2.size == MiB - 512);
  Block a3 = f.alloc(512);  // the last 512 bytes
  CHECK(a3.size == 512);
  CHECK(f.events() == "a2M");

  // Large pool: split only when more than 1 MiB remains.
  Block b = f.alloc(19 * MiB);  // 20 MiB reservation, 1 MiB left: not split
  CHECK(b.size == 20 * MiB);
  Block c = f.alloc(5 * MiB);  // new 20 MiB reservation, 15 MiB left: split
  CHECK(c.size == 5 * MiB);
  CHECK(f.policy.cached_bytes() == 15 * MiB);
  Block d = f.alloc(14 * MiB);  // the 15 MiB remainder serves it whole (1 MiB left is not split)
  CHECK(d.size == 15 * MiB);
  CHECK(f.events() == "a2M a20M a20M");
  for (Block x : {a, a2, a3, b, c, d}) {
    f.free(x);
  }
}

TEST_CASE("native: max_split_size keeps oversize blocks whole and for large requests", "[native]") {
  Fixture f("max_split_size_mb:40");
  Block big = f.alloc(50 * MiB);
  f.free(big);
  // A request under max_split_size never takes an oversize block.
  Block mid = f.alloc(30 * MiB);
  CHECK(f.events() == "a50M a30M");
  // A request at or above it takes the oversize block whole (50 < 45 + 20: little enough waste).
  Block over = f.alloc(45 * MiB);
  CHECK(over.ptr == big.ptr);
  CHECK(over.size == 50 * MiB);
  f.free(over);
  f.free(mid);
  // ... but not when it would waste max_non_split_rounding (20 MiB) or more.
  Block far = f.alloc(41 * MiB);  // 42 MiB rounded; the 50 MiB block is within 20 MiB: taken
  CHECK(far.ptr == big.ptr);
  f.free(far);
  Block other = f.alloc(81 * MiB);
  f.free(other);
  Block wasteful = f.alloc(60 * MiB);  // 82 MiB >= 60 + 20: a new reservation instead
  CHECK(wasteful.ptr != other.ptr);
  CHECK(f.events() == "a50M a30M a82M a60M");
  f.free(wasteful);

  Fixture g("max_split_size_mb:40,max_non_split_rounding_mb:30");
  Block g1 = g.alloc(82 * MiB);
  g.free(g1);
  Block g2 = g.alloc(60 * MiB);  // 82 < 60 + 30: served by the cached block
  CHECK(g2.ptr == g1.ptr);
  g.free(g2);
}

TEST_CASE("native: freed neighbours coalesce", "[native]") {
  Fixture f;
  Block a = f.alloc(2 * MiB);
  Block b = f.alloc(2 * MiB);
  Block c = f.alloc(2 * MiB);
  CHECK(f.events() == "a20M");
  CHECK(f.free_blocks() == 1);  // the 14 MiB tail
  f.free(b);
  CHECK(f.free_blocks() == 2);
  f.free(a);  // merges with b
  CHECK(f.free_blocks() == 2);
  f.free(c);  // merges with a+b and the tail: one whole free segment
  CHECK(f.free_blocks() == 1);
  CHECK(f.policy.release_cached() == 20 * MiB);
  CHECK(f.events() == "a20M f20M");
  CHECK(f.policy.reserved_bytes() == 0);
  CHECK(f.backend.live_reservations() == 0);

  // Best fit: the smallest free block that fits, lowest address among equals.
  Fixture g;
  Block x = g.alloc(4 * MiB);
  Block y = g.alloc(2 * MiB);
  Block z = g.alloc(3 * MiB);
  Block w = g.alloc(2 * MiB);
  g.free(x);
  g.free(z);
  Block fit = g.alloc(3 * MiB);  // the 3 MiB hole, not the 4 MiB one
  CHECK(fit.ptr == z.ptr);
  for (Block v : {y, w, fit}) {
    g.free(v);
  }
}

TEST_CASE("native: each stream has its own free blocks", "[native]") {
  Fixture f;
  Block a = f.alloc(3 * MiB, 1);
  f.free(a, 1);
  Block b = f.alloc(3 * MiB, 2);  // stream 1's cached block is not used on stream 2
  CHECK(f.events() == "a20M a20M");
  Block c = f.alloc(3 * MiB, 1);  // but it is on stream 1
  CHECK(c.ptr == a.ptr);
  f.free(b, 2);
  f.free(c, 1);
  CHECK(f.policy.release_cached() == 40 * MiB);
}

TEST_CASE("native: out of memory frees cached blocks and retries", "[native][oom]") {
  SECTION("release every cached block") {
    Fixture f("", 100 * MiB);
    Block a = f.alloc(60 * MiB, 1);
    f.free(a, 1);
    Block b = f.alloc(60 * MiB, 2);  // no room until stream 1's cached 60 MiB goes back
    REQUIRE(b);
    CHECK(f.events() == "a60M f60M a60M");
    CHECK(f.policy.counters().full_releases == 1);
    CHECK(f.policy.counters().alloc_retries == 1);
    f.free(b, 2);
  }
  SECTION("release oversize blocks first when max_split_size is set") {
    Fixture f("max_split_size_mb:40", 100 * MiB);
    Block a = f.alloc(50 * MiB);
    Block b = f.alloc(45 * MiB);    // 46 MiB
    Block keep = f.alloc(2 * MiB);  // 20 MiB would not fit: 96 + 20 > 100
    CHECK_FALSE(keep);              // ... even after releasing: a and b are live
    f.free(a);
    f.free(b);
    Block c = f.alloc(60 * MiB);  // frees the largest oversize blocks (50, then 46), not all
    REQUIRE(c);
    CHECK(f.events() == "a50M a46M f50M f46M a60M");
    CHECK(f.policy.counters().oversize_releases == 1);
    CHECK(f.policy.counters().full_releases == 1);  // from the failed 2 MiB request only
    f.free(c);
  }
  SECTION("a split reservation in use stays; the front end raises OutOfMemory") {
    Config none;
    CachingAllocator<NativePolicy> alloc(std::make_unique<SimBackend>(SimOptions{.capacity = 100 * MiB}),
                                         none);
    void* p = alloc.allocate(5 * MiB, 0);  // 20 MiB reservation, split
    void* q = alloc.allocate(30 * MiB, 0);
    alloc.deallocate(q);
    CHECK_THROWS_AS(alloc.allocate(90 * MiB, 0), OutOfMemory);
    CHECK(alloc.policy().reserved_bytes() == 20 * MiB);  // the cached 30 MiB went back
    alloc.check_invariants();
    alloc.deallocate(p);
  }
}

TEST_CASE("native: garbage collection frees the oldest cached reservations", "[native][gc]") {
  // 100 MiB usable, threshold 0.5: above 50 MiB reserved, a new reservation first frees cached
  // whole reservations at least as old as the average (in get_free_block calls).
  Fixture f("garbage_collection_threshold:0.5", 100 * MiB);
  Block a = f.alloc(20 * MiB);  // large-pool lookup 1
  Block b = f.alloc(20 * MiB);  // 2
  f.free(a);                    // a cached at age 0
  Block y = f.alloc(25 * MiB);  // 3: no fit; 40 MiB reserved is under 50: no collection
  f.free(b);                    // b cached; a is one lookup older
  Block d = f.alloc(30 * MiB);  // 4: no fit, 66 > 50 reserved: GC frees a (age 2 >= 1.5) only
  REQUIRE(d);
  CHECK(f.events() == "a20M a20M a26M f20M a30M");
  CHECK(f.policy.counters().gc_runs == 1);
  CHECK(f.policy.reserved_bytes() == 76 * MiB);
  Block e = f.alloc(20 * MiB);  // b is still cached
  CHECK(e.ptr == b.ptr);
  for (Block x : {y, d, e}) {
    f.free(x);
  }

  Fixture off("", 100 * MiB);  // without a threshold, nothing is collected
  Block first = off.alloc(20 * MiB);
  off.free(first);
  Block second = off.alloc(30 * MiB);
  CHECK(off.events() == "a20M a30M");
  off.free(second);
}

TEST_CASE("native: expandable segments grow in pages and unmap on release",
          "[native][expandable]") {
  Fixture f("expandable_segments:True");
  Block a = f.alloc(5 * MiB);  // large pool: one 20 MiB page
  CHECK(f.events() == "m20M");
  Block b = f.alloc(30 * MiB);  // 15 MiB free at the end + one more page
  CHECK(f.events() == "m20M m20M");
  CHECK(reinterpret_cast<std::uintptr_t>(b.ptr) ==
        reinterpret_cast<std::uintptr_t>(a.ptr) + 5 * MiB);
  Block s = f.alloc(1000);  // small pool: its own range, 2 MiB pages
  CHECK(f.events() == "m20M m20M m2M");
  CHECK(f.policy.reserved_bytes() == 42 * MiB);
  CHECK(f.backend.mapped_bytes_now() == 42 * MiB);
  CHECK(f.policy.segment_count() == 2);

  // Freeing b leaves [a 5][free 35] + unmapped; release unmaps the whole pages inside free blocks
  // only: page [20, 40) MiB. The small range keeps its page: s lives there.
  f.free(b);
  f.policy.release_cached();
  f.policy.check_invariants();
  CHECK(f.events() == "m20M m20M m2M u20M");
  CHECK(f.policy.reserved_bytes() == 22 * MiB);
  // Growth refills the lowest hole, joined to the free block before it.
  Block d = f.alloc(25 * MiB);
  CHECK(reinterpret_cast<std::uintptr_t>(d.ptr) ==
        reinterpret_cast<std::uintptr_t>(a.ptr) + 5 * MiB);
  CHECK(f.events() == "m20M m20M m2M u20M m20M");
  // Blocks split down to 512 bytes in expandable segments, whatever the pool.
  Block c = f.alloc(5 * MiB - 512 * 3);
  CHECK(c.size == 5 * MiB - 1536);
  for (Block x : {a, c, d, s}) {
    f.free(x);
  }
  f.policy.release_cached();
  CHECK(f.events() == "m20M m20M m2M u20M m20M u40M u2M");
  CHECK(f.policy.reserved_bytes() == 0);
  CHECK(f.policy.segment_count() == 0);
  CHECK(f.backend.mapped_bytes_now() == 0);
  CHECK(f.backend.live_physical() == 0);
}

TEST_CASE("native: expandable best fit prefers blocks that cannot grow", "[native][expandable]") {
  Fixture f("expandable_segments:True");
  Block p1 = f.alloc(2 * MiB);
  Block gap = f.alloc(15 * MiB);
  Block p2 = f.alloc(2 * MiB);
  Block t = f.alloc(10 * MiB);  // grows the segment: [p1 2][gap 15][p2 2][t 10][free 11] + unmapped
  CHECK(f.events() == "m20M m20M");
  f.free(gap);
  // A 6 MiB request fits the 11 MiB tail and the 15 MiB hole; the tail, which could grow into
  // the unmapped pages after it, is kept for growth.
  Block c = f.alloc(6 * MiB);
  CHECK(c.ptr == gap.ptr);
  for (Block x : {p1, p2, t, c}) {
    f.free(x);
  }
}

TEST_CASE("native: failures while mapping leave a consistent state",
          "[native][expandable][faults]") {
  Fixture f("expandable_segments:True", 200 * MiB);
  f.backend.fail_next(SimCall::create_physical);  // out of memory once: the retry chain recovers
  Block a = f.alloc(30 * MiB);
  REQUIRE(a);
  CHECK(f.policy.counters().alloc_retries == 1);
  f.backend.fail_next(SimCall::map, SimFault::device_error);
  CHECK_THROWS_AS(f.alloc(100 * MiB), DeviceError);
  f.policy.check_invariants();
  CHECK(f.policy.reserved_bytes() == f.backend.mapped_bytes_now());
  Block too_big = f.alloc(300 * MiB);  // beyond the device: fails after releasing the cache
  CHECK_FALSE(too_big);
  f.free(a);
  f.policy.release_cached();
  CHECK(f.backend.live_physical() == 0);
}

TEST_CASE("native: snapshots list reservations and mapped ranges with their blocks", "[native]") {
  Fixture f;
  Block a = f.alloc(3 * MiB);
  Block b = f.alloc(100);
  std::vector<SegmentView> seen;
  f.policy.visit_segments([&](const SegmentView& s) { seen.push_back(s); });
  REQUIRE(seen.size() == 2);
  for (const SegmentView& s : seen) {
    REQUIRE(s.blocks.size() == 2);  // the allocation and the free rest
    CHECK(s.blocks[0].allocated);
    CHECK_FALSE(s.blocks[1].allocated);
    CHECK(s.size == (s.small_pool ? 2 * MiB : 20 * MiB));
  }
  f.free(a);
  f.free(b);

  Fixture g("expandable_segments:True");
  Block c = g.alloc(5 * MiB);
  Block d = g.alloc(30 * MiB);
  g.free(c);
  seen.clear();
  g.policy.visit_segments([&](const SegmentView& s) { seen.push_back(s); });
  REQUIRE(seen.size() == 1);  // only the mapped 40 MiB, not the reserved address range
  CHECK(seen[0].size == 40 * MiB);
  CHECK(seen[0].blocks.size() == 3);
  g.free(d);
}

TEST_CASE("native: segment events are recorded only when asked", "[native]") {
  SimBackend backend;
  NativePolicy policy(backend, NativeSettings{});
  Block a = policy.allocate(100, 0);
  CHECK(policy.segment_events().empty());
  policy.set_record_segments(true);
  Block b = policy.allocate(50 * MiB, 0);
  REQUIRE(policy.segment_events().size() == 1);
  CHECK(policy.segment_events()[0].kind == SegmentEvent::alloc);
  CHECK(policy.segment_events()[0].size == 50 * MiB);
  CHECK(policy.segment_events()[0].addr == reinterpret_cast<std::uintptr_t>(b.ptr));
  policy.clear_segment_events();
  CHECK(policy.segment_events().empty());
  policy.deallocate(a, 0);
  policy.deallocate(b, 0);
}

namespace {

/// Random allocations and frees on three streams through the front end, with invariants checked
/// after every step and no two live blocks overlapping.
void random_run(const std::string& conf, std::uint32_t seed, std::size_t capacity, int steps) {
  Config config = Config::parse(conf);
  CachingAllocator<NativePolicy> alloc(std::make_unique<SimBackend>(SimOptions{.capacity = capacity}),
                                       config);
  std::mt19937 rng(seed);
  struct Live {
    void* ptr;
    std::size_t bytes;
  };
  std::vector<Live> live;
  std::map<std::uintptr_t, std::size_t> ranges;
  auto size_of = [&]() -> std::size_t {
    switch (rng() % 6) {
      case 0:
        return 1 + rng() % 4096;
      case 1:
        return 1 + rng() % MiB;
      case 2:
        return MiB + rng() % (9 * MiB);
      case 3:
        return 10 * MiB + rng() % (40 * MiB);
      case 4:
        return (1 + rng() % 8) * 2 * MiB;  // exact multiples: equal-size ties
      default:
        return 100 * MiB + rng() % (200 * MiB);
    }
  };
  for (int step = 0; step < steps; ++step) {
    const unsigned op = rng() % 100;
    if (op < 50 || live.empty()) {
      const std::size_t bytes = size_of();
      const StreamId stream = rng() % 3;
      try {
        void* p = alloc.allocate(bytes, stream);
        const auto addr = reinterpret_cast<std::uintptr_t>(p);
        auto next = ranges.lower_bound(addr);
        REQUIRE((next == ranges.end() || next->first >= addr + bytes));
        if (next != ranges.begin()) {
          auto prev = std::prev(next);
          REQUIRE(prev->first + prev->second <= addr);
        }
        ranges.emplace(addr, bytes);
        live.push_back({p, bytes});
      } catch (const OutOfMemory&) {  // expected under the small capacity
      }
    } else if (op < 97) {
      const std::size_t i = rng() % live.size();
      ranges.erase(reinterpret_cast<std::uintptr_t>(live[i].ptr));
      alloc.deallocate(live[i].ptr);
      live[i] = live.back();
      live.pop_back();
    } else {
      alloc.empty_cache();
    }
    alloc.check_invariants();
    REQUIRE(alloc.policy().reserved_bytes() <= alloc.backend().held_bytes());
  }
  for (const Live& l : live) {
    alloc.deallocate(l.ptr);
  }
  alloc.empty_cache();
  alloc.check_invariants();
  CHECK(alloc.policy().reserved_bytes() == 0);
  CHECK(alloc.backend().held_bytes() == 0);
}

}  // namespace

TEST_CASE("native: randomized sequences keep every invariant", "[native][random]") {
  const std::size_t capacity = 2 * kGiB;
  SECTION("defaults") { random_run("", 1, capacity, 3000); }
  SECTION("max_split_size and divisions") {
    random_run("max_split_size_mb:64,roundup_power2_divisions:[1:2,64:4,>:8]", 2, capacity, 3000);
  }
  SECTION("garbage collection") {
    random_run("garbage_collection_threshold:0.3", 3, capacity, 3000);
  }
  SECTION("expandable segments") { random_run("expandable_segments:True", 4, capacity, 3000); }
  SECTION("expandable with max_split_size") {
    random_run("expandable_segments:True,max_split_size_mb:100", 5, capacity, 3000);
  }
}
