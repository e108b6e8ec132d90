// test_randomized.cpp: fixed-seed random operation sequences on every policy, with the policy's
// and the front end's invariants checked after every step, plus a shadow model that checks
// what no invariant inside the allocator can see: live blocks never overlap, a block is never
// handed to stream T while a stream other than T may still use it (unless T was made to wait for
// that stream's work on the device: reuse_parked), and every live block of a
// virtual-memory policy lies on mapped pages.
#include "../support.h"

#include <cachealloc/errors.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <map>
#include <random>

using namespace cachealloc;

namespace {

std::uint64_t operations_per_policy() {
  if (const char* env = std::getenv("CACHEALLOC_RANDOM_OPS")) {
    return std::strtoull(env, nullptr, 10);
  }
  return 1'000'000;
}

struct Interval {
  std::uintptr_t addr;
  std::size_t size;
  std::uint64_t events_before;  // events recorded on the stream before the free: one recorded
                                // after it and completed proves the stream is past the free
};

bool overlaps(const Interval& a, std::uintptr_t addr, std::size_t size) {
  return a.addr < addr + size && addr < a.addr + a.size;
}

struct LiveBlock {
  void* ptr;
  std::size_t size;
  StreamId stream;
  std::vector<StreamId> others;
};

std::size_t random_size(std::mt19937_64& rng) {
  switch (rng() % 8) {
    case 0: case 1: case 2: return 1 + rng() % 4096;                  // tiny
    case 3: case 4: return 1 + rng() % (1ul << 20);                     // small
    case 5: case 6: return (1ul << 20) + rng() % (24ul << 20);          // large
    default: return (16ul << 20) + rng() % (200ul << 20);               // huge
  }
}

/// `model_costs`: device calls move the simulated clock (SimOptions::model_call_costs), for
/// settings judged over time. `query_lag`: SimOptions::query_lag_calls.
void run_sequence(const std::string& policy, std::uint64_t seed, std::uint64_t ops,
                  const std::string& conf = "", bool model_costs = false, std::uint32_t query_lag = 0) {
  SimOptions opts;
  opts.capacity = 3 * kGiB;
  opts.model_call_costs = model_costs;
  opts.query_lag_calls = query_lag;
  auto [sim, a] = test::make_sim_allocator(policy, opts, conf);
  std::mt19937_64 rng(seed);
  std::vector<LiveBlock> live;
  cachealloc::test::OverlapTracker tracker;
  // Intervals freed but possibly still in use by work queued on a stream.
  std::map<StreamId, std::vector<Interval>> dirty;
  constexpr StreamId kStreams = 3;
  std::uint64_t ooms = 0;
  std::uint64_t releases = 0;

  for (std::uint64_t step = 0; step < ops; ++step) {
    const unsigned op = static_cast<unsigned>(rng() % 100);
    if (op < 45 || live.empty()) {
      const std::size_t size = random_size(rng);
      const StreamId s = rng() % kStreams;
      void* p = nullptr;
      try {
        p = a->allocate(size, s);
      } catch (const OutOfMemory&) {
        ++ooms;
      }
      if (sim->counters().release_calls != releases) {
        dirty.clear();  // the retry chain released memory: cudaFree synchronized the device
        releases = sim->counters().release_calls;
      }
      if (p != nullptr) {
        const auto info = a->find(p);
        REQUIRE(info);
        const auto addr = reinterpret_cast<std::uintptr_t>(p);
        if (!tracker.add(p, info->block_size)) {
          FAIL("policy " << policy << " seed " << seed << " step " << step
                         << ": block overlaps a live block");
        }
        for (const auto& [stream, intervals] : dirty) {
          if (stream == s) {
            continue;
          }
          for (const Interval& iv : intervals) {
            if (sim->stream_completed(stream) > iv.events_before) {
              continue;  // an event recorded on `stream` after the free has completed
            }
            if (sim->stream_waits_for(s, stream, iv.events_before)) {
              continue;  // s's work waits on the device for `stream`'s work up to after the free
            }
            if (overlaps(iv, addr, info->block_size)) {
              FAIL("policy " << policy << " seed " << seed << " step " << step
                             << ": block handed to stream " << s
                             << " while stream " << stream << " may still use it");
            }
          }
        }
        if (addr >= 0x600000000000 && addr < 0x7f0000000000 &&
            !sim->is_mapped(addr, info->block_size)) {
          FAIL("policy " << policy << " step " << step << ": block on unmapped pages");
        }
        live.push_back({p, info->block_size, s, {}});
      }
    } else if (op < 85) {
      const std::size_t k = rng() % live.size();
      LiveBlock b = live[k];
      live[k] = live.back();
      live.pop_back();
      tracker.remove(b.ptr);
      const auto addr = reinterpret_cast<std::uintptr_t>(b.ptr);
      dirty[b.stream].push_back(Interval{addr, b.size, sim->stream_recorded(b.stream)});
      for (StreamId o : b.others) {
        dirty[o].push_back(Interval{addr, b.size, sim->stream_recorded(o)});
      }
      a->deallocate(b.ptr);
    } else if (op < 92) {
      LiveBlock& b = live[rng() % live.size()];
      const StreamId o = rng() % kStreams;
      a->record_stream(b.ptr, o);
      if (o != b.stream) {
        b.others.push_back(o);
      }
    } else if (op < 98) {
      const StreamId s = rng() % kStreams;
      sim->complete_stream(s);
      dirty.erase(s);
    } else if (op < 99) {
      sim->complete_all();
      dirty.clear();
    } else {
      // empty_cache waits for the events of parked frees, so only those intervals become
      // clean; same-stream frees stay dirty for other streams.
      a->empty_cache();
    }
    if (sim->counters().release_calls != releases) {
      dirty.clear();  // cudaFree synchronized the device (SimBackend models that)
      releases = sim->counters().release_calls;
    }
    a->check_invariants();
  }
  if (conf.find("wait_parked_to_grow:0,") != std::string::npos) {
    // The sequence did what it is here for: growths waited for parked frees.
    CHECK(a->stats().parked_waits > 0);
  }
  if (conf.find("move_budget:0,") != std::string::npos) {
    // Note [Growing at the top once moves cost too much at the limit]: it got there.
    CHECK(a->stats().to_map().at("defrag.placed_top_at_limit") > 0);
  }
  if (conf.find("reuse_parked:True") != std::string::npos) {
    // Note [Reusing a parked free on the stream it waits for]: the sequence reused some, some of
    // them by making the allocating stream wait for another.
    CHECK(a->stats().parked_reuses > 0);
    CHECK(a->stats().parked_reuse_waits > 0);
  }
  if (conf.find("move_pending:True") != std::string::npos) {
    // The sequence did what it is here for: pages left holes their stream may still use.
    CHECK(a->stats().to_map().at("defrag.pages_moved_pending") > 0);
  }
  for (const LiveBlock& b : live) {
    a->deallocate(b.ptr);
  }
  sim->complete_all();
  a->empty_cache();
  a->check_invariants();
  const Stats s = a->stats();
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.active_bytes.current == 0);
  CHECK(s.reserved_bytes.current == 0);
  CHECK(sim->held_bytes() == 0);
  INFO("ooms " << ooms);
}

}  // namespace

TEST_CASE("randomized operation sequences keep every invariant", "[randomized]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  const std::uint64_t total = operations_per_policy();
  const std::uint64_t seeds = 4;
  for (std::uint64_t seed = 1; seed <= seeds; ++seed) {
    INFO("policy " << policy << " seed " << seed);
    run_sequence(policy, seed, total / seeds);
  }
}

TEST_CASE("randomized operation sequences keep every invariant: defrag moving pages a stream "
          "still uses", "[randomized][defrag]") {
  // Note [Moving pages a stream still uses]: pages leave a stream's pending holes at once and
  // their old mappings go when the simulated stream completes (complete_stream above).
  const std::uint64_t total = operations_per_policy();
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    INFO("seed " << seed);
    run_sequence("defrag", seed, total / 4, "move_pending:True,grow_slack:0");
  }
}

TEST_CASE("randomized operation sequences keep every invariant: defrag waiting for parked frees "
          "instead of growing", "[randomized][defrag]") {
  // Note [Waiting for frees in flight instead of growing] (allocator.h), and the slack over all
  // live bytes (Note [Frees in flight and the slack], defrag_grow.cpp).
  const std::uint64_t total = operations_per_policy();
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    INFO("seed " << seed);
    // Seed 3 with device calls costing simulated time (the time budget at work).
    run_sequence("defrag", seed, total / 4,
                 seed % 2 == 0 ? "wait_parked_to_grow:0,grow_slack:0"
                 : seed == 3   ? "wait_parked_to_grow:0.5"
                               : "wait_parked_to_grow:0.5,slack_counts_parked:True",
                 /*model_costs=*/seed == 3);
  }
}

TEST_CASE("randomized operation sequences keep every invariant: defrag growing at the top of its "
          "ranges", "[randomized][defrag]") {
  // Note [Growing at the top once moves cost too much at the limit]: the slack held at its limit
  // and no time allowed for moves (device calls cost simulated time), so the first window of
  // moves turns placement to the top.
  const std::uint64_t total = operations_per_policy();
  for (std::uint64_t seed = 2; seed <= 4; seed += 2) {
    INFO("seed " << seed);
    run_sequence("defrag", seed, total / 4, "move_budget:0,max_grow_slack:0.01", /*model_costs=*/true);
  }
}

TEST_CASE("randomized operation sequences keep every invariant: queries that answer late", "[randomized]") {
  // Note [The record thread watches its events] (record_thread.h): query_event answers from a
  // look taken every 5th query, as under event_thread:poll; late answers only delay.
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  const std::uint64_t total = operations_per_policy();
  for (std::uint64_t seed = 1; seed <= 2; ++seed) {
    INFO("policy " << policy << " seed " << seed);
    run_sequence(policy, seed, total / 8, "", /*model_costs=*/false, /*query_lag=*/5);
  }
}

TEST_CASE("randomized operation sequences keep every invariant: parked frees reused on the stream "
          "they wait for", "[randomized]") {
  // Note [Reusing a parked free on the stream it waits for] (allocator.h): the shadow model
  // fails the run if a reused block was still in use by any stream but the allocating one.
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  const std::uint64_t total = operations_per_policy();
  for (std::uint64_t seed = 1; seed <= 2; ++seed) {
    INFO("policy " << policy << " seed " << seed);
    run_sequence(policy, seed, total / 8, "reuse_parked:True,reuse_parked_waits:True");
  }
}
