// defer_frees:True (Note [Frees handed over at the next allocation], allocator.h): a free that
// needs nothing else is handed to the policy by the next allocation. It must change nothing a
// caller can see but the time: every test runs the same calls through a twin without it and
// compares every address, and the statistics and invariants every few calls (not after every
// call: reading them hands the deferred frees over, and the lists should fill up in between).
#include "../support.h"

#include <cachealloc/allocator.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>
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

struct Twins {
  Twins(const std::string& policy, const std::string& conf) {
    const auto make = [&](const std::string& c) {
      SimOptions o;
      o.auto_complete_events = true;
      o.model_call_costs = true;
      o.capacity = std::size_t{1} << 36;  // 64 GiB
      return test::make_sim_allocator(policy, o, c).allocator;
    };
    deferring = make(conf.empty() ? "defer_frees:True" : conf + ",defer_frees:True");
    plain = make(conf);
  }
  std::unique_ptr<DeviceAllocator> deferring;
  std::unique_ptr<DeviceAllocator> plain;
};

/// Random calls on three streams (sizes 512 B - 96 MiB, log-uniform; some blocks also used on
/// another stream, so their frees park), with an empty_cache now and then.
void run_random(Twins& t, std::uint64_t seed, int calls) {
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  std::map<void*, void*> twin;  // deferring's pointer -> plain's (they must be equal)
  for (int i = 0; i < calls; ++i) {
    INFO("call " << i << " of seed " << seed);
    const std::uint64_t r = rng() % 100;
    const StreamId stream = 1 + rng() % 3;
    if (r < 52 || live.empty()) {
      const double e = 9.0 + static_cast<double>(rng() % 1800) / 100.0;
      const auto bytes = static_cast<std::size_t>(std::exp2(e)) + rng() % 512;
      void* a = t.deferring->allocate(bytes, stream);
      void* b = t.plain->allocate(bytes, stream);
      REQUIRE(a == b);
      if (rng() % 8 == 0) {
        const StreamId other = 1 + rng() % 3;
        t.deferring->record_stream(a, other);
        t.plain->record_stream(b, other);
      }
      live.push_back(a);
    } else if (r < 98) {
      const std::size_t k = rng() % live.size();
      t.deferring->deallocate(live[k]);
      t.plain->deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
    } else {
      t.deferring->empty_cache();
      t.plain->empty_cache();
    }
    if (i % 37 == 36) {
      test::check_same_stats(t.deferring->stats(), t.plain->stats());
      t.deferring->check_invariants();
      t.plain->check_invariants();
    }
  }
  for (void* p : live) {
    t.deferring->deallocate(p);
    t.plain->deallocate(p);
  }
  test::check_same_stats(t.deferring->stats(), t.plain->stats());
  t.deferring->check_invariants();
}

}  // namespace

TEST_CASE("defer_frees: every address, statistic and invariant as without it, for every policy "
          "on the simulated device", "[core][defer_frees]") {
  const std::string policy = GENERATE(as<std::string>{}, "defrag", "size_class", "native", "async");
  // defrag without the step memo too: while the memo learns, frees are not deferred.
  const std::string conf = GENERATE(as<std::string>{}, "", "step_memo:False");
  if (!conf.empty() && policy != "defrag") {
    return;
  }
  INFO(policy << " " << conf);
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    Twins t(policy, conf);
    run_random(t, seed, 3000);
    const std::int64_t deferred = test::policy_counter(t.deferring->stats(), "front.deferred_frees");
    INFO(deferred << " frees deferred");
    CHECK(deferred > 0);  // the twins did differ in how they got there
    CHECK(test::policy_counter(t.plain->stats(), "front.deferred_frees") == -1);
  }
}

TEST_CASE("defer_frees: a double free and a foreign pointer are refused as without it, and the "
          "deferred frees still reach the policy", "[core][defer_frees]") {
  Twins t("defrag", "step_memo:False");
  void* a = t.deferring->allocate(4 * kMiB, 1);
  void* b = t.deferring->allocate(8 * kMiB, 1);
  t.deferring->deallocate(a);  // deferred
  CHECK_THROWS_AS(t.deferring->deallocate(a), UsageError);
  int on_host = 0;
  CHECK_THROWS_AS(t.deferring->deallocate(&on_host), UsageError);
  CHECK(t.deferring->find(a) == std::nullopt);
  CHECK(t.deferring->find(b).has_value());
  t.deferring->deallocate(b);
  const Stats s = t.deferring->stats();
  CHECK(s.allocated_bytes.current == 0);
  CHECK(test::policy_counter(s, "front.deferred_frees") == 2);
  t.deferring->check_invariants();
  t.deferring->empty_cache();
  CHECK(t.deferring->stats().reserved_bytes.current == 0);
}

TEST_CASE("defer_frees: the setting is checked like any other", "[core][defer_frees][config]") {
  SimOptions o;
  CHECK_THROWS_AS(test::make_sim_allocator("defrag", o, "defer_frees:maybe"), ConfigError);
  CHECK_NOTHROW(test::make_sim_allocator("size_class", o, "defer_frees:False"));
}
