// Tests of BackgroundUnmapper (Note [Unmapping off the allocating thread]): the order of the
// unmaps, that a range is never mapped again while its unmap is queued or running, draining,
// and that a failed unmap reaches the caller. Run under TSan in CI (tools/run_tests.sh).
#include <cachealloc/background_unmapper.h>
#include <cachealloc/errors.h>

#include <catch2/catch.hpp>

#include "../gate.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using cachealloc::BackgroundUnmapper;
using cachealloc::DeviceError;

using cachealloc::test::Gate;

TEST_CASE("background unmapper: runs the unmaps in order, on another thread", "[core][unmapper]") {
  std::mutex m;
  std::vector<std::pair<std::uintptr_t, std::size_t>> done;
  std::set<std::thread::id> threads;
  bool initialised = false;
  {
    BackgroundUnmapper u(
        [&](std::uintptr_t va, std::size_t bytes) {
          std::lock_guard lock(m);
          done.emplace_back(va, bytes);
          threads.insert(std::this_thread::get_id());
          return std::string();
        },
        [&] {
          std::lock_guard lock(m);
          initialised = true;
        });
    CHECK(u.pending() == 0);
    u.drain();  // nothing queued: returns at once, starts no thread
    {
      std::lock_guard lock(m);
      CHECK_FALSE(initialised);
    }
    for (std::uintptr_t i = 0; i < 100; ++i) {
      u.post(0x1000 * (i + 1), 0x1000);
    }
    u.drain();
    CHECK(u.pending() == 0);
    CHECK(u.completed() == 100);
    u.post(0x500000, 0x2000);  // left queued: the destructor runs it
  }
  REQUIRE(done.size() == 101);
  for (std::size_t i = 0; i < 100; ++i) {
    CHECK(done[i].first == 0x1000 * (i + 1));
  }
  CHECK(done.back() == std::pair<std::uintptr_t, std::size_t>{0x500000, 0x2000});
  CHECK(initialised);
  REQUIRE(threads.size() == 1);
  CHECK(*threads.begin() != std::this_thread::get_id());
}

TEST_CASE("background unmapper: wait_for blocks only on an overlapping range", "[core][unmapper]") {
  Gate gate;
  std::atomic<bool> unmapped{false};
  BackgroundUnmapper u([&](std::uintptr_t, std::size_t) {
    gate.wait();
    unmapped = true;
    return std::string();
  });
  u.post(0x10000, 0x4000);  // [0x10000, 0x14000), held at the gate
  CHECK(u.pending() == 1);
  // overlaps() says which ranges a wait_for() would block on (placement's hint is the narrower
  // end_behind_stream_work(), tested below).
  CHECK(u.overlaps(0x13000, 0x2000));
  CHECK(u.overlaps(0x10000, 0x4000));
  CHECK_FALSE(u.overlaps(0x14000, 0x1000));
  CHECK_FALSE(u.overlaps(0xF000, 0x1000));
  // Ranges that only touch it do not wait.
  u.wait_for(0x14000, 0x1000);
  u.wait_for(0xF000, 0x1000);
  CHECK_FALSE(unmapped.load());
  // An overlapping one waits until the unmap ran.
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    u.wait_for(0x13000, 0x2000);
    returned = true;
    CHECK(unmapped.load());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(returned.load());  // still blocked: the gate is shut
  gate.open();
  waiter.join();
  CHECK(returned.load());
  u.drain();
  CHECK(u.pending() == 0);
  CHECK_FALSE(u.overlaps(0x13000, 0x2000));
  CHECK(u.blocked_ns() > 0);
}

TEST_CASE("background unmapper: a failed unmap is reported once, by the next call", "[core][unmapper]") {
  // The first unmap waits at a gate until all three are queued: otherwise the failure could
  // be reported by the third post() (also "the next call"), as happened once under a sanitizer.
  Gate gate;
  std::atomic<int> calls{0};
  BackgroundUnmapper u([&](std::uintptr_t va, std::size_t) {
    if (va == 0x1000) {
      gate.wait();
    }
    ++calls;
    return va == 0x2000 ? std::string("CUDA_ERROR_INVALID_VALUE in cuMemUnmap") : std::string();
  });
  u.post(0x1000, 0x1000);
  u.post(0x2000, 0x1000);
  u.post(0x3000, 0x1000);
  gate.open();
  try {
    u.drain();
    FAIL("drain() did not report the failed unmap");
  } catch (const DeviceError& e) {
    CHECK(std::string(e.what()).find("CUDA_ERROR_INVALID_VALUE") != std::string::npos);
    CHECK(std::string(e.what()).find("background unmap") != std::string::npos);
  }
  CHECK(calls.load() == 3);  // the queue went on after the failure
  CHECK_NOTHROW(u.drain());  // reported once
  CHECK_NOTHROW(u.post(0x4000, 0x1000));
  CHECK_NOTHROW(u.drain());
}

TEST_CASE("background unmapper: a range is never mapped over while its unmap is pending",
          "[core][unmapper]") {
  // A fake device: which pages are mapped. The caller maps pages (after wait_for, as the CUDA
  // backend does) and queues unmaps; mapping a page that is still mapped is the defect the
  // unmapper prevents (cuMemMap would fail: CUDA_ERROR_INVALID_VALUE on a mapped range).
  constexpr std::size_t kPages = 64;
  constexpr std::uintptr_t kPage = 0x200000;
  std::mutex m;
  std::vector<bool> mapped(kPages, false);
  std::atomic<int> bad_unmaps{0};
  std::mt19937 slow(7);
  BackgroundUnmapper u([&](std::uintptr_t va, std::size_t bytes) {
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 50)(slow)));
    std::lock_guard lock(m);
    for (std::uintptr_t p = va / kPage; p < (va + bytes) / kPage; ++p) {
      if (!mapped[p]) {
        ++bad_unmaps;
      }
      mapped[p] = false;
    }
    return std::string();
  });
  std::mt19937 rng(42);
  std::vector<bool> ours(kPages, false);  // what the caller believes: mapped and not yet unmapped
  int double_maps = 0;
  for (int step = 0; step < 5000; ++step) {
    const std::size_t first = std::uniform_int_distribution<std::size_t>(0, kPages - 1)(rng);
    const std::size_t count = std::uniform_int_distribution<std::size_t>(1, std::min<std::size_t>(8, kPages - first))(rng);
    bool all_mapped = true;
    bool none_mapped = true;
    for (std::size_t p = first; p < first + count; ++p) {
      all_mapped = all_mapped && ours[p];
      none_mapped = none_mapped && !ours[p];
    }
    if (none_mapped) {
      u.wait_for(first * kPage, count * kPage);
      std::lock_guard lock(m);
      for (std::size_t p = first; p < first + count; ++p) {
        double_maps += mapped[p] ? 1 : 0;
        mapped[p] = true;
        ours[p] = true;
      }
    } else if (all_mapped) {
      for (std::size_t p = first; p < first + count; ++p) {
        ours[p] = false;
      }
      u.post(first * kPage, count * kPage);
    }
  }
  u.drain();
  CHECK(double_maps == 0);
  CHECK(bad_unmaps.load() == 0);
  std::lock_guard lock(m);
  for (std::size_t p = 0; p < kPages; ++p) {
    CHECK(mapped[p] == ours[p]);
  }
  CHECK(u.completed() > 100);
}

TEST_CASE("background unmapper: end_behind_stream_work gives where the ranges that wait for a "
          "stream end",
          "[core][unmapper]") {
  // Placement's hint (Note [Placing away from queued unmaps], defrag_grow.cpp): an unmap tagged
  // with a stream's work, or queued behind one, may keep a map waiting as long as the stream
  // runs; a plain unmap waiting its turn does not.
  Gate first_unmap;
  Gate stream_work;
  std::mutex m;
  std::vector<std::string> order;
  BackgroundUnmapper u(
      [&](std::uintptr_t va, std::size_t) {
        if (va == 0x1000) {
          first_unmap.wait();
        }
        std::lock_guard lock(m);
        order.push_back("unmap " + std::to_string(va));
        return std::string();
      },
      {},
      [&](std::uint64_t after) {
        stream_work.wait();
        std::lock_guard lock(m);
        order.push_back("wait " + std::to_string(after));
        return std::string();
      });
  u.post(0x1000, 0x1000);     // running, held in its unmap
  u.post(0x2000, 0x1000);     // queued, waits only its turn
  u.post(0x3000, 0x1000, 7);  // waits for the stream's work
  u.post(0x4000, 0x1000);     // queued behind it
  for (std::uintptr_t va : {0x1000U, 0x2000U, 0x3000U, 0x4000U}) {
    CHECK(u.overlaps(va, 0x1000));
  }
  CHECK(u.end_behind_stream_work(0x1000, 0x1000) == 0);
  CHECK(u.end_behind_stream_work(0x2000, 0x1000) == 0);
  CHECK(u.end_behind_stream_work(0x3000, 0x1000) == 0x4000);
  CHECK(u.end_behind_stream_work(0x3800, 0x1000) == 0x5000);  // overlaps both: the higher end
  CHECK(u.end_behind_stream_work(0x4000, 0x1000) == 0x5000);
  CHECK(u.end_behind_stream_work(0x1000, 0x4000) == 0x5000);  // the plain unmaps do not count
  CHECK(u.end_behind_stream_work(0x5000, 0x1000) == 0);
  CHECK(u.end_behind_stream_work(0x1000, 0x2000) == 0);
  first_unmap.open();
  // The worker reaches the tagged range and waits there for the stream.
  for (int i = 0; i < 2000 && u.completed() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(u.completed() == 2);
  CHECK_FALSE(u.overlaps(0x2000, 0x1000));
  CHECK(u.end_behind_stream_work(0x3000, 0x1000) == 0x4000);  // running, still inside the wait
  CHECK(u.end_behind_stream_work(0x4000, 0x1000) == 0x5000);
  stream_work.open();
  u.drain();
  CHECK(u.end_behind_stream_work(0x3000, 0x2000) == 0);
  std::lock_guard lock(m);
  CHECK(order == std::vector<std::string>{"unmap 4096", "unmap 8192", "wait 7", "unmap 12288",
                                          "unmap 16384"});
}
