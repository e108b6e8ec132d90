// test_size_class.cpp: policy `size_class` on its own simulated device (no front end), for the
// rules the conformance and randomized suites reach only by chance: Note [Recently freed large
// blocks] in size_class.h.
#include <cachealloc/errors.h>
#include <cachealloc/policies/size_class.h>
#include <cachealloc/sim_backend.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <vector>

using namespace cachealloc;

namespace {

constexpr std::size_t MiB = kMiB;

struct Fixture {
  Fixture()
      : backend(SimOptions{.capacity = std::size_t{8} << 30, .granularity = 2 * MiB, .auto_complete_events = true}),
        policy(backend, config) {}
  Block alloc(std::size_t bytes, StreamId stream = 0) {
    Block b = policy.allocate(bytes, stream);
    REQUIRE(b);
    policy.check_invariants();
    return b;
  }
  void free(Block b, StreamId stream = 0) {
    policy.deallocate(b, stream);
    policy.check_invariants();
  }
  Config config;
  SimBackend backend;
  SizeClassPolicy policy;
};

std::uintptr_t addr(const Block& b) { return reinterpret_cast<std::uintptr_t>(b.ptr); }

}  // namespace

TEST_CASE("size_class: a freed large block comes back for the same size without a new segment",
          "[size_class]") {
  Fixture f;
  const Block a = f.alloc(8 * MiB);
  const std::size_t reserved = f.policy.reserved_bytes();
  f.free(a);
  const Block b = f.alloc(8 * MiB);
  CHECK(b.ptr == a.ptr);
  CHECK(f.policy.reserved_bytes() == reserved);
  f.free(b);
  // Everything free: release_cached coalesces the recent block back and returns the segment.
  CHECK(f.policy.release_cached() == reserved);
  CHECK(f.policy.reserved_bytes() == 0);
  f.policy.check_invariants();
}

TEST_CASE("size_class: the oldest recent block leaves the FIFO beside a block being freed",
          "[size_class]") {
  // Five neighbours carved from one 20 MiB segment; four freed fill the FIFO, the fifth free
  // evicts the oldest, whose neighbour is the block being freed: it must not merge with it.
  Fixture f;
  std::vector<Block> blocks;
  for (int i = 0; i < 5; ++i) {
    blocks.push_back(f.alloc(2 * MiB));
  }
  for (int i = 1; i < 5; ++i) {
    CHECK(addr(blocks[static_cast<std::size_t>(i)]) == addr(blocks[0]) + 2 * MiB * static_cast<std::size_t>(i));
  }
  for (int i = 1; i < 5; ++i) {
    f.free(blocks[static_cast<std::size_t>(i)]);
  }
  f.free(blocks[0]);  // evicts blocks[1], whose lower neighbour is blocks[0]
  // A request no recent block fits flushes the FIFO: the segment is one free range again, and
  // the 20 MiB request is served from it without a new segment.
  const std::size_t reserved = f.policy.reserved_bytes();
  const Block whole = f.alloc(20 * MiB - 512);
  CHECK(addr(whole) == addr(blocks[0]));
  CHECK(f.policy.reserved_bytes() == reserved);
  f.free(whole);
  CHECK(f.policy.release_cached() == reserved);
}

TEST_CASE("size_class: recent blocks are shared with other streams after the epoch event",
          "[size_class]") {
  Fixture f;
  const Block a = f.alloc(8 * MiB, /*stream=*/1);
  f.free(a, 1);  // recent on stream 1
  const std::size_t reserved = f.policy.reserved_bytes();
  // Stream 2 misses: the migration flushes stream 1's FIFO and records its event; with the sim's
  // events completing at once, the next miss moves the block to the shared pool.
  const Block b = f.alloc(8 * MiB, 2);
  f.free(b, 2);
  const Block c = f.alloc(8 * MiB, 3);
  CHECK(f.policy.reserved_bytes() == reserved + 20 * MiB);  // stream 2 grew one segment, 3 none
  f.free(c, 3);
  f.policy.check_invariants();
}

TEST_CASE("size_class: random large and small traffic on three streams keeps every invariant",
          "[size_class][randomized]") {
  Fixture f;
  std::mt19937_64 rng(7);
  struct Live {
    Block block;
    StreamId stream;
  };
  std::vector<Live> live;
  for (int step = 0; step < 20000; ++step) {
    if (live.size() < 64 && (live.empty() || rng() % 3 != 0)) {
      // Mostly a handful of repeated large sizes (the FIFO's case), some small and odd ones.
      static constexpr std::size_t kSizes[] = {2 * MiB, 3 * MiB, 8 * MiB, 12 * MiB + 512, 40 * MiB};
      std::size_t bytes = kSizes[rng() % 5];
      if (rng() % 4 == 0) {
        bytes = 1 + rng() % (48 * MiB);
      }
      const StreamId s = rng() % 3;
      live.push_back({f.alloc(bytes, s), s});
    } else {
      const std::size_t k = rng() % live.size();
      // Freed on its own stream, or (as the front end does after record_stream's events) on
      // another.
      const StreamId s = rng() % 8 == 0 ? (live[k].stream + 1) % 3 : live[k].stream;
      f.free(live[k].block, s);
      live[k] = live.back();
      live.pop_back();
    }
    if (step % 5000 == 4999) {
      (void)f.policy.release_cached();
      f.policy.check_invariants();
    }
  }
  for (const Live& l : live) {
    f.free(l.block, l.stream);
  }
  (void)f.policy.release_cached();
  CHECK(f.policy.reserved_bytes() == 0);
}
