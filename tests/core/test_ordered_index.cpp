// test_ordered_index.cpp: the B+tree behind the policies' best-fit searches, against std::set.
#include <cachealloc/ordered_index.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <iterator>
#include <random>
#include <set>
#include <vector>

using namespace cachealloc;

namespace {

/// The shape of the policies' keys: (bucket, size, address) plus a payload outside the order.
struct Key {
  std::uint64_t bucket;
  std::uint64_t size;
  std::uint64_t addr;
  std::uint64_t payload;
  friend bool operator<(const Key& a, const Key& b) noexcept {
    if (a.bucket != b.bucket) {
      return a.bucket < b.bucket;
    }
    if (a.size != b.size) {
      return a.size < b.size;
    }
    return a.addr < b.addr;
  }
};

void expect_same(const OrderedIndex<Key>& index, const std::set<Key>& model) {
  index.check();
  REQUIRE(index.size() == model.size());
  auto it = index.begin();
  for (const Key& k : model) {
    REQUIRE(it != index.end());
    REQUIRE(it->addr == k.addr);
    REQUIRE(it->payload == k.payload);
    ++it;
  }
  REQUIRE(it == index.end());
}

}  // namespace

TEST_CASE("ordered index: random inserts, erases and searches agree with std::set", "[ordered_index]") {
  const std::uint64_t seed = GENERATE(1, 2, 3);
  const std::uint64_t key_space = GENERATE(50, 3000, 40000);
  INFO("seed " << seed << " key space " << key_space);
  std::mt19937_64 rng(seed);
  OrderedIndex<Key> index;
  std::set<Key> model;
  auto random_key = [&] {
    const std::uint64_t v = rng() % key_space;
    return Key{v % 3, (v / 3) % 97 * 512, v * 4096, rng()};
  };
  const int steps = 60000;
  for (int step = 0; step < steps; ++step) {
    const Key k = random_key();
    // Phases: grow, churn, shrink to empty, grow again.
    const int phase = step * 4 / steps;
    const unsigned roll = static_cast<unsigned>(rng() % 100);
    const bool do_insert = phase == 0 ? roll < 80 : phase == 1 ? roll < 50 : phase == 2 ? roll < 10 : roll < 70;
    if (do_insert) {
      const bool fresh = model.insert(k).second;
      REQUIRE(index.insert(k) == fresh);
      if (!fresh) {  // the index kept the first payload, like std::set
        REQUIRE(index.find(k)->payload == model.find(k)->payload);
      }
    } else if (roll % 2 == 0 || model.empty()) {
      REQUIRE(index.erase(k) == (model.erase(k) == 1));
    } else {  // erase through an iterator, and the iterator it hands back
      auto m = model.lower_bound(k);
      auto i = index.lower_bound(k);
      if (m == model.end()) {
        REQUIRE(i == index.end());
      } else {
        REQUIRE(i->addr == m->addr);
        auto mnext = model.erase(m);
        auto inext = index.erase(i);
        if (mnext == model.end()) {
          REQUIRE(inext == index.end());
        } else {
          REQUIRE(inext != index.end());
          REQUIRE(inext->addr == mnext->addr);
        }
      }
    }
    // lower_bound by a probe that may fall between keys, and a step back from it.
    const Key probe{rng() % 3, rng() % 97 * 512 + 1, 0, 0};
    auto m = model.lower_bound(probe);
    auto i = index.lower_bound(probe);
    if (m == model.end()) {
      REQUIRE(i == index.end());
    } else {
      REQUIRE(i != index.end());
      REQUIRE(i->addr == m->addr);
    }
    if (m != model.begin()) {
      --m;
      --i;
      REQUIRE(i->addr == m->addr);
    }
    if (step < 3000 || step % 997 == 0) {
      expect_same(index, model);
    }
  }
  expect_same(index, model);
  // Shrink to nothing: the tree collapses to one empty leaf.
  while (!model.empty()) {
    REQUIRE(index.erase(*model.begin()));
    model.erase(model.begin());
  }
  expect_same(index, model);
  REQUIRE(index.height() == 0);
  REQUIRE(index.begin() == index.end());
}

TEST_CASE("ordered index: sorted and reverse-sorted fills split correctly, depth stays logarithmic",
          "[ordered_index]") {
  for (bool ascending : {true, false}) {
    OrderedIndex<Key> index;
    std::set<Key> model;
    const std::uint64_t n = 70000;
    for (std::uint64_t j = 0; j < n; ++j) {
      const std::uint64_t v = ascending ? j : n - 1 - j;
      const Key k{0, v / 7, v, v};
      REQUIRE(index.insert(k));
      model.insert(k);
    }
    expect_same(index, model);
    CHECK(index.height() <= 4);  // 32-way nodes, at least half full after a sorted fill
    // Erase every other key, then search for each: the neighbour must come back.
    for (std::uint64_t v = 0; v < n; v += 2) {
      REQUIRE(index.erase(Key{0, v / 7, v, 0}));
      model.erase(Key{0, v / 7, v, 0});
    }
    expect_same(index, model);
    for (std::uint64_t v = 0; v + 1 < n; v += 2) {
      auto it = index.lower_bound(Key{0, v / 7, v, 0});
      REQUIRE(it != index.end());
      REQUIRE(it->addr == v + 1);
    }
  }
}

TEST_CASE("ordered index: update between neighbours keeps the order and the structure", "[ordered_index]") {
  OrderedIndex<Key> index;
  std::set<Key> model;
  for (std::uint64_t v = 0; v < 5000; ++v) {
    const Key k{0, v * 10, v, v};
    index.insert(k);
    model.insert(k);
  }
  std::mt19937_64 rng(7);
  for (int step = 0; step < 5000; ++step) {
    const std::uint64_t v = rng() % 5000;
    auto it = index.find(Key{0, v * 10, v, 0});
    REQUIRE(it != index.end());
    // A new size strictly between the neighbours' sizes (sizes are multiples of 10 apart).
    const Key k{0, v * 10 + static_cast<std::uint64_t>(step % 2 == 0 ? 3 : -3), v, rng()};
    if (v == 0 && step % 2 == 1) {
      continue;
    }
    const Key old = *it;
    model.erase(old);
    model.insert(k);
    REQUIRE(index.update(old, k));
    if (step % 101 == 0) {
      expect_same(index, model);
    }
    // Put it back for the next round.
    auto back = index.find(k);
    REQUIRE(back != index.end());
    model.erase(k);
    const Key orig{0, v * 10, v, v};
    model.insert(orig);
    REQUIRE(index.update(k, orig));
  }
  expect_same(index, model);
}

TEST_CASE("ordered index: clear empties the tree and reuses its nodes", "[ordered_index]") {
  OrderedIndex<Key> index;
  for (std::uint64_t v = 0; v < 10000; ++v) {
    index.insert(Key{0, v, v, v});
  }
  index.clear();
  index.check();
  const std::size_t nodes = index.allocated_nodes();
  REQUIRE(index.empty());
  REQUIRE(index.begin() == index.end());
  for (std::uint64_t v = 0; v < 10000; ++v) {
    index.insert(Key{1, v, v, v});
  }
  index.check();
  REQUIRE(index.size() == 10000);
  CHECK(index.allocated_nodes() == nodes);  // the same fill again: every node came from the free lists
  REQUIRE(index.lower_bound(Key{1, 5000, 0, 0})->addr == 5000);
  REQUIRE(index.lower_bound(Key{0, 0, 0, 0})->bucket == 1);
  REQUIRE(index.lower_bound(Key{2, 0, 0, 0}) == index.end());
}

TEST_CASE("ordered index: after reserve_total(size + n), n inserts allocate no node", "[ordered_index]") {
  OrderedIndex<Key> index;
  std::mt19937_64 rng(11);
  for (int round = 0; round < 200; ++round) {
    index.reserve_total(index.size() + 8);
    const std::size_t before = index.allocated_nodes();
    for (int j = 0; j < 8; ++j) {
      const std::uint64_t v = rng();
      index.insert(Key{v % 4, v % 100000, v, 0});
    }
    REQUIRE(index.allocated_nodes() == before);
  }
  index.check();
}

TEST_CASE("ordered index: update re-keys in place or moves the key, like erase + insert", "[ordered_index]") {
  OrderedIndex<Key> index;
  std::set<Key> model;
  std::mt19937_64 rng(5);
  std::vector<Key> keys;
  for (std::uint64_t v = 0; v < 4000; ++v) {
    const Key k{v % 2, rng() % 100000, v, v};
    index.insert(k);
    model.insert(k);
    keys.push_back(k);
  }
  for (int step = 0; step < 40000; ++step) {
    Key& k = keys[rng() % keys.size()];
    Key moved = k;
    // Small moves (the common in-place case) and jumps anywhere, sometimes to the other bucket.
    if (step % 3 == 0) {
      moved.size = rng() % 100000;
      moved.bucket = rng() % 2;
    } else {
      moved.size = k.size + (rng() % 3) - 1;
    }
    moved.payload = rng();
    REQUIRE(index.update(k, moved));
    model.erase(k);
    model.insert(moved);
    k = moved;
    if (step < 2000 || step % 499 == 0) {
      expect_same(index, model);
    }
  }
  expect_same(index, model);
  REQUIRE_FALSE(index.update(Key{7, 0, 0, 0}, Key{7, 1, 1, 1}));
}
