// Tests of the bookkeeping regions (Note [Bookkeeping on few pages], hot_pages.h): blocks never
// overlap and keep their contents, alignment, reuse of freed blocks, requests too large for a
// region, the standard allocator on top, and concurrent use. The mode is read once per process
// from CACHEALLOC_HOT_PAGES; the tests run under whichever is set and check what it promises.
#include <cachealloc/hot_pages.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

namespace hot = cachealloc::hot;

namespace {

bool regions_on() { return hot::mode() != hot::Mode::off; }

struct Live {
  unsigned char* p;
  std::size_t bytes;
  std::size_t align;
  unsigned char fill;
};

void fill(const Live& b) { std::memset(b.p, b.fill, b.bytes); }

bool intact(const Live& b) {
  for (std::size_t i = 0; i < b.bytes; ++i) {
    if (b.p[i] != b.fill) {
      return false;
    }
  }
  return true;
}

}  // namespace

TEST_CASE("hot pages: blocks stay aligned and disjoint and keep their contents under random use", "[core][hot_pages]") {
  std::mt19937_64 rng(54);
  const std::size_t aligns[] = {8, 16, 64, 128, 4096};
  std::vector<Live> live;
  std::map<std::uintptr_t, std::uintptr_t> ranges;  // start -> end of every live block
  std::size_t live_bytes = 0;  // kept under 16 MiB: the regions (128 MiB) never run out here
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || (rng() % 3 != 0 && live_bytes < (std::size_t{16} << 20))) {
      // Mostly small (the bookkeeping's nodes), sometimes up to 1.5 MiB (past kMaxBlock).
      std::size_t bytes = rng() % 8 == 0 ? 1 + rng() % (3 * hot::kMaxBlock / 2) : 1 + rng() % 600;
      const std::size_t align = aligns[rng() % std::size(aligns)];
      auto* p = static_cast<unsigned char*>(hot::allocate(bytes, align));
      REQUIRE(p != nullptr);
      REQUIRE(reinterpret_cast<std::uintptr_t>(p) % align == 0);
      const auto start = reinterpret_cast<std::uintptr_t>(p);
      const std::uintptr_t end = start + bytes;
      // No live block overlaps the new one.
      auto next = ranges.lower_bound(start);
      if (next != ranges.end()) {
        REQUIRE(next->first >= end);
      }
      if (next != ranges.begin()) {
        REQUIRE(std::prev(next)->second <= start);
      }
      ranges.emplace(start, end);
      if (bytes > hot::kMaxBlock) {
        REQUIRE_FALSE(hot::owns(p));  // too large for a region: the heap's
      } else if (regions_on()) {
        REQUIRE(hot::owns(p));  // the regions have room for this test's 16 MiB
      }
      live.push_back({p, bytes, align, static_cast<unsigned char>(rng())});
      live_bytes += bytes;
      fill(live.back());
    } else {
      const std::size_t i = rng() % live.size();
      REQUIRE(intact(live[i]));
      live_bytes -= live[i].bytes;
      ranges.erase(reinterpret_cast<std::uintptr_t>(live[i].p));
      hot::deallocate(live[i].p, live[i].bytes, live[i].align);
      live[i] = live.back();
      live.pop_back();
    }
  }
  for (const Live& b : live) {
    REQUIRE(intact(b));
    hot::deallocate(b.p, b.bytes, b.align);
  }
}

TEST_CASE("hot pages: a freed block serves the next request of its size class", "[core][hot_pages]") {
  if (!regions_on()) {
    SUCCEED("CACHEALLOC_HOT_PAGES=off: every request is the heap's");
    return;
  }
  void* a = hot::allocate(100, 8);
  hot::deallocate(a, 100, 8);
  void* b = hot::allocate(120, 16);  // the same 128-byte class
  CHECK(b == a);
  const hot::Usage before = hot::usage();
  void* c = hot::allocate(9000, 8);  // three pages: the 16 KiB class
  const hot::Usage during = hot::usage();
  CHECK(during.bytes_in_use == before.bytes_in_use + 16384);
  CHECK(reinterpret_cast<std::uintptr_t>(c) % 4096 == 0);
  hot::deallocate(c, 9000, 8);
  CHECK(hot::usage().bytes_in_use == before.bytes_in_use);
  hot::deallocate(b, 120, 16);
  const hot::Usage u = hot::usage();
  CHECK(u.regions >= 1);
  CHECK(u.bytes_carved <= u.regions * hot::kRegionBytes);
  CHECK(u.bytes_in_use <= u.bytes_carved);
  if (u.huge_bytes_known) {
    CHECK(u.huge_bytes <= u.regions * hot::kRegionBytes);
  }
}

TEST_CASE("hot pages: containers and objects on the regions", "[core][hot_pages]") {
  std::vector<std::uint64_t, hot::Allocator<std::uint64_t>> v;
  for (std::uint64_t i = 0; i < 100000; ++i) {  // grows past kMaxBlock: regions, then the heap
    v.push_back(i * 3);
  }
  std::deque<int, hot::Allocator<int>> d;
  for (int i = 0; i < 5000; ++i) {
    d.push_front(i);
  }
  std::uint64_t sum = 0;
  for (std::uint64_t x : v) {
    sum += x;
  }
  CHECK(sum == 3 * (100000ull * 99999ull / 2));
  CHECK(d.front() == 4999);
  CHECK(d.back() == 0);

  struct alignas(64) Node {
    int value;
    explicit Node(int v) : value(v) {}
  };
  hot::Ptr<Node> n = hot::make<Node>(7);
  CHECK(n->value == 7);
  CHECK(reinterpret_cast<std::uintptr_t>(n.get()) % 64 == 0);
  CHECK(hot::owns(n.get()) == regions_on());

  struct Thing : hot::Object<Thing> {
    alignas(64) char bytes[200];
  };
  auto* t = new Thing();
  CHECK(reinterpret_cast<std::uintptr_t>(t) % 64 == 0);
  CHECK(hot::owns(t) == regions_on());
  delete t;
}

namespace {
struct alignas(64) Throws : hot::Object<Throws> {
  char bytes[300];
  explicit Throws(bool fail) {
    if (fail) {
      throw std::runtime_error("constructor failed");
    }
  }
};
struct Plain : hot::Object<Plain> {
  char bytes[100];
  explicit Plain(bool fail) {
    if (fail) {
      throw std::runtime_error("constructor failed");
    }
  }
};
}  // namespace

TEST_CASE("hot pages: an object whose constructor throws gives its block back", "[core][hot_pages]") {
  // Over-aligned (the front end and defrag's engine are alignas(64)) and not: the new-expression
  // must find a matching operator delete (ASan's leak check catches the heap's side, under off).
  const std::size_t before = hot::usage().bytes_in_use;
  for (int i = 0; i < 100; ++i) {
    CHECK_THROWS_AS(new Throws(true), std::runtime_error);
    CHECK_THROWS_AS(new Plain(true), std::runtime_error);
  }
  CHECK(hot::usage().bytes_in_use == before);
  auto* ok = new Throws(false);
  if (regions_on()) {
    CHECK(hot::usage().bytes_in_use == before + 320);  // 300 bytes at 64: five lines
  }
  delete ok;
  CHECK(hot::usage().bytes_in_use == before);
}

TEST_CASE("hot pages: threads allocating and freeing at once", "[core][hot_pages]") {
  auto work = [](std::uint64_t seed, bool* ok) {
    std::mt19937_64 rng(seed);
    std::vector<Live> live;
    for (int step = 0; step < 20000; ++step) {
      if (live.size() < 64 && (live.empty() || rng() % 2 == 0)) {
        const std::size_t bytes = 1 + rng() % 2000;
        auto* p = static_cast<unsigned char*>(hot::allocate(bytes, 64));
        live.push_back({p, bytes, 64, static_cast<unsigned char>(rng())});
        fill(live.back());
      } else {
        const std::size_t i = rng() % live.size();
        *ok = *ok && intact(live[i]);
        hot::deallocate(live[i].p, live[i].bytes, 64);
        live[i] = live.back();
        live.pop_back();
      }
    }
    for (const Live& b : live) {
      *ok = *ok && intact(b);
      hot::deallocate(b.p, b.bytes, 64);
    }
  };
  bool ok1 = true;
  bool ok2 = true;
  std::thread t1(work, 1, &ok1);
  std::thread t2(work, 2, &ok2);
  t1.join();
  t2.join();
  CHECK(ok1);
  CHECK(ok2);
}
