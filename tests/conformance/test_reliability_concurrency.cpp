// test_reliability_concurrency.cpp: many threads on ONE DeviceAllocator (issue 10).
//
// Eight threads allocate (1 B .. 64 MiB, on their own stream and sometimes a shared one),
// record_stream onto other threads' streams, hand some blocks to other threads to free, free,
// and now and then call empty_cache / check_invariants / stats / find concurrently. A shared,
// mutex-protected shadow keeps every live block with the tag of its owner: an allocation that
// overlaps a live block, or a free that finds another tag at its address, fails the test.
// Between phases (all threads joined) the test checks the invariants and the statistics, and
// drives the simulated device itself (complete_all): SimBackend is not thread-safe, so the test
// touches it directly only while no thread runs; every other call goes through the front end's
// mutex. Meant to be run under ThreadSanitizer too (CACHEALLOC_SANITIZER=thread).
#include "../support.h"

#include <cachealloc/errors.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

using namespace cachealloc;

namespace {

constexpr int kThreads = 8;
constexpr StreamId kSharedStream = 1;
constexpr StreamId kThreadStreamBase = 100;

int ops_per_thread_per_phase() {
  if (const char* env = std::getenv("CACHEALLOC_STRESS_OPS")) {
    return std::atoi(env);
  }
  return 3000;
}

/// Live blocks by address with the tag of the allocation that owns them.
class Shadow {
 public:
  struct Live {
    std::size_t size;
    std::uint64_t tag;
  };

  /// False when [addr, addr+size) overlaps a live block.
  bool insert(std::uintptr_t addr, std::size_t size, std::uint64_t tag) {
    std::lock_guard lock(mutex_);
    auto next = live_.lower_bound(addr);
    if (next != live_.end() && next->first < addr + size) {
      return false;
    }
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size > addr) {
        return false;
      }
    }
    live_.emplace(addr, Live{size, tag});
    return true;
  }

  /// Removes the block; false when the block at `addr` is missing or carries another tag.
  bool erase(std::uintptr_t addr, std::uint64_t tag) {
    std::lock_guard lock(mutex_);
    auto it = live_.find(addr);
    if (it == live_.end() || it->second.tag != tag) {
      return false;
    }
    live_.erase(it);
    return true;
  }

  [[nodiscard]] std::size_t size() const {
    std::lock_guard lock(mutex_);
    return live_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, Live> live_;
};

struct Held {
  void* ptr;
  std::uint64_t tag;
};

/// Blocks handed from one thread to another (freed by whoever takes them).
class Exchange {
 public:
  void put(Held h) {
    std::lock_guard lock(mutex_);
    blocks_.push_back(h);
  }
  bool take(Held& out) {
    std::lock_guard lock(mutex_);
    if (blocks_.empty()) {
      return false;
    }
    out = blocks_.back();
    blocks_.pop_back();
    return true;
  }

 private:
  std::mutex mutex_;
  std::vector<Held> blocks_;
};

std::size_t random_size(std::mt19937_64& rng) {
  // Log-uniform over 1 B .. 64 MiB, so tiny, small and large pools all see traffic.
  const int bits = static_cast<int>(rng() % 27);  // 2^0 .. 2^26 (64 MiB)
  const std::size_t hi = std::size_t{1} << bits;
  return std::max<std::size_t>(1, hi / 2 + rng() % (hi / 2 + 1));
}

struct Counters {
  std::atomic<std::uint64_t> allocs{0};
  std::atomic<std::uint64_t> ooms{0};
  std::atomic<std::uint64_t> overlaps{0};
  std::atomic<std::uint64_t> tag_mismatches{0};
  std::atomic<std::uint64_t> bad_info{0};
  std::atomic<std::uint64_t> unexpected{0};
  std::atomic<std::uint64_t> invariant_failures{0};
  std::atomic<std::uint64_t> empty_caches{0};
  std::atomic<std::uint64_t> cross_thread_frees{0};
};

void free_block(DeviceAllocator& a, Shadow& shadow, Counters& c, const Held& h) {
  // Out of the shadow first: once deallocate() returns, another thread may get this address.
  if (!shadow.erase(reinterpret_cast<std::uintptr_t>(h.ptr), h.tag)) {
    ++c.tag_mismatches;
  }
  try {
    a.deallocate(h.ptr);
  } catch (...) {
    ++c.unexpected;
  }
}

void worker(DeviceAllocator& a, Shadow& shadow, Exchange& exchange, Counters& c, int t, int phase,
            int ops) {
  std::mt19937_64 rng(0x5eed0000ull + static_cast<std::uint64_t>(phase) * 1000 +
                      static_cast<std::uint64_t>(t));
  const StreamId own = kThreadStreamBase + static_cast<StreamId>(t);
  std::vector<Held> mine;
  std::uint64_t next_tag = (static_cast<std::uint64_t>(t) << 48) |
                           (static_cast<std::uint64_t>(phase) << 40);
  for (int i = 0; i < ops; ++i) {
    const unsigned r = static_cast<unsigned>(rng() % 1000);
    if (r < 450 || mine.empty()) {
      const std::size_t size = random_size(rng);
      const StreamId stream = rng() % 4 == 0 ? kSharedStream : own;
      void* p = nullptr;
      try {
        p = a.allocate(size, stream);
      } catch (const OutOfMemory&) {
        ++c.ooms;
        continue;
      } catch (...) {
        ++c.unexpected;
        continue;
      }
      ++c.allocs;
      const std::uint64_t tag = ++next_tag;
      const auto info = a.find(p);
      if (!info || info->ptr != p || info->requested != size || info->block_size < size ||
          info->stream != stream || reinterpret_cast<std::uintptr_t>(p) % 512 != 0) {
        ++c.bad_info;
      }
      const std::size_t span = info ? info->block_size : size;
      if (!shadow.insert(reinterpret_cast<std::uintptr_t>(p), span, tag)) {
        ++c.overlaps;
        // Keep going without the shadow entry; the block is still ours to free.
        try {
          a.deallocate(p);
        } catch (...) {
          ++c.unexpected;
        }
        continue;
      }
      mine.push_back({p, tag});
    } else if (r < 550) {
      // record_stream onto one or two other threads' streams (and sometimes the shared one).
      Held& h = mine[rng() % mine.size()];
      try {
        a.record_stream(h.ptr, kThreadStreamBase + static_cast<StreamId>((t + 1 + rng() % 7) % kThreads));
        if (rng() % 3 == 0) {
          a.record_stream(h.ptr, kSharedStream);
        }
      } catch (...) {
        ++c.unexpected;
      }
    } else if (r < 600) {
      // Hand a block to whichever thread takes it next.
      const std::size_t k = rng() % mine.size();
      exchange.put(mine[k]);
      mine[k] = mine.back();
      mine.pop_back();
    } else if (r < 650) {
      Held h{};
      if (exchange.take(h)) {
        free_block(a, shadow, c, h);
        ++c.cross_thread_frees;
      }
    } else if (r < 995) {
      const std::size_t k = rng() % mine.size();
      free_block(a, shadow, c, mine[k]);
      mine[k] = mine.back();
      mine.pop_back();
    } else if (r < 997) {
      try {
        a.empty_cache();
        ++c.empty_caches;
      } catch (...) {
        ++c.unexpected;
      }
    } else {
      try {
        a.check_invariants();
        (void)a.stats();
        (void)a.pending_frees();
        (void)a.segments();
      } catch (const InvariantError&) {
        ++c.invariant_failures;
      } catch (...) {
        ++c.unexpected;
      }
    }
  }
  for (const Held& h : mine) {
    free_block(a, shadow, c, h);
  }
}

}  // namespace

TEST_CASE("reliability: 8 threads on one allocator keep blocks disjoint and stats exact",
          "[reliability][threads]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  SimOptions opts;
  // Small enough that the retry chain (wait for parked frees, release the cache) runs while
  // other threads hold blocks; large enough that 8 threads x their live blocks fit.
  opts.capacity = 2 * kGiB;
  // Not a structured binding: lambdas below capture `a`, which clang 14 refuses for bindings.
  auto made = cachealloc::test::make_sim_allocator(policy, opts);
  SimBackend* sim = made.sim;
  auto& a = made.allocator;
  Shadow shadow;
  Counters c;
  const int ops = ops_per_thread_per_phase();
  constexpr int kPhases = 3;
  for (int phase = 0; phase < kPhases; ++phase) {
    INFO("phase " << phase);
    Exchange exchange;
    std::vector<std::thread> threads;
    threads.reserve(kThreads);
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] { worker(*a, shadow, exchange, c, t, phase, ops); });
    }
    for (auto& th : threads) {
      th.join();
    }
    // Blocks left in the exchange: free them from this thread.
    Held h{};
    while (exchange.take(h)) {
      free_block(*a, shadow, c, h);
    }
    CHECK(c.overlaps == 0);
    CHECK(c.tag_mismatches == 0);
    CHECK(c.bad_info == 0);
    CHECK(c.unexpected == 0);
    CHECK(c.invariant_failures == 0);
    CHECK(shadow.size() == 0);
    REQUIRE_NOTHROW(a->check_invariants());
    Stats s = a->stats();
    CHECK(s.allocated_bytes.current == 0);
    CHECK(s.requested_bytes.current == 0);
    CHECK(s.allocation.current == 0);
    CHECK(s.usage_errors == 0);
    // Parked cross-stream frees may still be active: no thread runs now, so the test may drive
    // the device itself.
    sim->complete_all();
    a->empty_cache();
    REQUIRE_NOTHROW(a->check_invariants());
    s = a->stats();
    CHECK(a->pending_frees() == 0);
    CHECK(s.active_bytes.current == 0);
    CHECK(s.active.current == 0);
    CHECK(s.reserved_bytes.current == 0);
    CHECK(sim->held_bytes() == 0);
    CHECK(sim->live_reservations() == 0);
    CHECK(sim->live_physical() == 0);
    CHECK(sim->mapped_bytes_now() == 0);
    CHECK(s.alloc_calls == c.allocs.load());
  }
  CHECK(c.allocs > static_cast<std::uint64_t>(kThreads * ops / 4));
  WARN("concurrency " << policy << ": " << c.allocs << " allocations, " << c.ooms
                      << " out-of-memory, " << c.cross_thread_frees << " cross-thread frees, "
                      << c.empty_caches << " concurrent empty_cache");
}

TEST_CASE("reliability: concurrent stats readers and a memory-fraction writer during traffic",
          "[reliability][threads]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  SimOptions opts;
  opts.capacity = 4 * kGiB;
  // Not a structured binding: lambdas below capture `a`, which clang 14 refuses for bindings.
  auto made = cachealloc::test::make_sim_allocator(policy, opts);
  SimBackend* sim = made.sim;
  auto& a = made.allocator;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> bad{0};
  std::atomic<std::uint64_t> unexpected{0};
  std::thread reader([&] {
    while (!stop.load()) {
      const Stats s = a->stats();
      if (s.allocated_bytes.current < 0 || s.requested_bytes.current < 0 ||
          s.requested_bytes.current > s.allocated_bytes.current ||
          s.allocated_bytes.current > s.active_bytes.current ||
          s.active_bytes.current > s.reserved_bytes.current) {
        ++bad;
      }
    }
  });
  std::thread fraction([&] {
    std::mt19937_64 rng(3);
    while (!stop.load()) {
      try {
        a->set_memory_fraction(rng() % 2 == 0 ? 1.0 : 0.75);
        (void)a->memory_fraction();
      } catch (...) {
        ++unexpected;
      }
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 11);
      std::vector<void*> live;
      for (int i = 0; i < 2000; ++i) {
        if (live.size() < 8 && rng() % 2 == 0) {
          try {
            live.push_back(a->allocate(1 + rng() % (48ul << 20), static_cast<StreamId>(t)));
          } catch (const OutOfMemory&) {
          } catch (...) {
            ++unexpected;
          }
        } else if (!live.empty()) {
          try {
            a->deallocate(live.back());
          } catch (...) {
            ++unexpected;
          }
          live.pop_back();
        }
      }
      for (void* p : live) {
        a->deallocate(p);
      }
    });
  }
  for (auto& w : workers) {
    w.join();
  }
  stop = true;
  reader.join();
  fraction.join();
  CHECK(bad == 0);
  CHECK(unexpected == 0);
  a->check_invariants();
  CHECK(a->stats().allocated_bytes.current == 0);
  a->set_memory_fraction(1.0);
  sim->complete_all();
  a->empty_cache();
  CHECK(sim->held_bytes() == 0);
}
