// test_reliability_faults.cpp: fault-injection sweep over a real trace (issue 10).
//
// The bundled two-stream MLP trace is replayed once per policy to count the device calls it
// makes (SimBackend::device_calls()); then, for every k from 1 to that count, a fresh allocator
// replays the whole trace with the k-th device call failing (alternately as out-of-memory and as
// a device error). An allocation may fail with OutOfMemory or DeviceError, nothing else; every
// other call must succeed; after the fault the rest of the trace must be served (at most a few
// failed allocations); the invariants must hold right after the fault and at the end; and once
// everything is freed, the device idle and the cache emptied, nothing may stay reserved.
// The ops are driven here (as bench/replay/replay.cpp does) because the test needs the
// SimBackend before the replay starts.
#include "../support.h"

#include <replay.h>

#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/sim_backend.h>
#include <cachealloc/trace/snapshot.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace cachealloc;

namespace {


const replay::PreparedTrace& mlp_trace() {
  static const replay::PreparedTrace t = [] {
    const auto snapshot =
        trace::read_snapshot(std::string(CACHEALLOC_TRACE_DIR) + "/mlp_two_streams.pickle.xz");
    return replay::prepare(snapshot, "mlp_two_streams");
  }();
  return t;
}

struct Outcome {
  std::uint64_t failed_oom = 0;
  std::uint64_t failed_device = 0;
  std::uint64_t failed_after_fault = 0;  // allocations that failed after the fault fired
  std::uint64_t injected = 0;
  std::uint64_t device_calls = 0;
  std::string unexpected;  // a throw where none is allowed, or an invariant broken
};

/// Replays `t` on a fresh allocator; with k != 0 the k-th device call fails with `fault`.
Outcome replay_with_fault(const replay::PreparedTrace& t, const std::string& policy,
                          std::uint64_t k, SimFault fault) {
  Outcome out;
  SimOptions opts;
  opts.device = t.device;
  auto [sim, a] = cachealloc::test::make_sim_allocator(policy, opts);
  if (k != 0) {
    sim->fail_call(k, fault);
  }
  replay::Player player(t, *a, *sim);
  bool fault_seen = false;
  auto note_fault = [&](std::size_t i) {
    if (!fault_seen && sim->injected_faults() != 0) {
      fault_seen = true;
      try {
        a->check_invariants();
      } catch (const std::exception& e) {
        out.unexpected = "invariant after the fault at op " + std::to_string(i) + ": " + e.what();
      }
    }
  };
  for (std::size_t i = 0; i < t.ops.size() && out.unexpected.empty(); ++i) {
    const replay::Op& op = t.ops[i];
    const bool before = fault_seen;
    try {
      try {
        player.apply(op);
      } catch (const OutOfMemory&) {
        if (op.kind != replay::OpKind::alloc) {
          throw;  // only allocations may fail
        }
        ++out.failed_oom;
        out.failed_after_fault += before ? 1 : 0;
      } catch (const DeviceError&) {
        if (op.kind != replay::OpKind::alloc) {
          throw;
        }
        ++out.failed_device;
        out.failed_after_fault += before ? 1 : 0;
      }
    } catch (const std::exception& e) {
      out.unexpected = "op " + std::to_string(i) + " (kind " +
                       std::to_string(static_cast<int>(op.kind)) + ") threw: " + e.what();
    }
    note_fault(i);
  }
  if (!out.unexpected.empty()) {
    return out;
  }
  out.device_calls = sim->device_calls();
  out.injected = sim->injected_faults();
  try {
    a->check_invariants();
    player.finish();
    sim->complete_all();
    a->empty_cache();
    a->check_invariants();
    const Stats s = a->stats();
    if (s.allocated_bytes.current != 0 || s.requested_bytes.current != 0 ||
        s.active_bytes.current != 0 || s.reserved_bytes.current != 0 || a->pending_frees() != 0) {
      out.unexpected = "stats not back to zero at the end";
    } else if (sim->held_bytes() != 0 || sim->live_reservations() != 0 ||
               sim->live_physical() != 0 || sim->mapped_bytes_now() != 0) {
      out.unexpected = "device memory leaked: held " + std::to_string(sim->held_bytes()) +
                       " B, reservations " + std::to_string(sim->live_reservations()) +
                       ", physical " + std::to_string(sim->live_physical());
    }
  } catch (const std::exception& e) {
    out.unexpected = std::string("clean-up threw: ") + e.what();
  }
  return out;
}

}  // namespace

TEST_CASE("reliability: a fault at every device call of a real trace is survived",
          "[reliability][faults]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  const replay::PreparedTrace& t = mlp_trace();
  const Outcome clean = replay_with_fault(t, policy, 0, SimFault::out_of_memory);
  REQUIRE(clean.unexpected.empty());
  REQUIRE(clean.failed_oom + clean.failed_device == 0);
  const std::uint64_t calls = clean.device_calls;
  REQUIRE(calls > 0);
  // Every k from 1 to the count. CACHEALLOC_FAULT_STRIDE > 1 subsamples (e.g. for sanitizer
  // builds); the default is the full sweep.
  std::uint64_t stride = 1;
  if (const char* env = std::getenv("CACHEALLOC_FAULT_STRIDE")) {
    stride = std::max<std::uint64_t>(1, std::strtoull(env, nullptr, 10));
  }
  std::uint64_t survived = 0;
  std::uint64_t failed_allocs = 0;
  std::uint64_t max_failed = 0;
  std::uint64_t as_oom = 0;
  std::uint64_t as_device_error = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t k = 1; k <= calls; k += stride) {
    const SimFault fault = k % 2 == 0 ? SimFault::device_error : SimFault::out_of_memory;
    INFO("k " << k << " fault " << (fault == SimFault::device_error ? "device_error" : "oom"));
    const Outcome o = replay_with_fault(t, policy, k, fault);
    if (!o.unexpected.empty()) {
      FAIL_CHECK(o.unexpected);
      continue;
    }
    CHECK(o.injected == 1);
    const std::uint64_t failed = o.failed_oom + o.failed_device;
    // One fault fails at most the allocation it hits (the retry chain absorbs most); a few are
    // allowed, the rest of the trace must be served.
    CHECK(failed <= 3);
    CHECK(o.failed_after_fault <= 2);
    failed_allocs += failed;
    max_failed = std::max(max_failed, failed);
    (fault == SimFault::device_error ? as_device_error : as_oom) += 1;
    ++survived;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WARN("faults " << policy << ": " << survived << " injected faults survived of " << calls
                 << " device calls (stride " << stride << "; " << as_oom << " as out-of-memory, "
                 << as_device_error << " as device error), " << failed_allocs
                 << " allocations failed in all (at most " << max_failed << " per run), "
                 << seconds << " s");
}

TEST_CASE("reliability: fail_next on each kind of device call mid-trace is survived",
          "[reliability][faults]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  const replay::PreparedTrace& t = mlp_trace();
  // Also: several faults in a row (k, k+1, k+2 all fail) at a handful of points of the trace.
  const Outcome clean = replay_with_fault(t, policy, 0, SimFault::out_of_memory);
  REQUIRE(clean.unexpected.empty());
  for (std::uint64_t k : {std::uint64_t{1}, clean.device_calls / 3, clean.device_calls / 2,
                          clean.device_calls - 2}) {
    if (k == 0) {
      continue;
    }
    INFO("burst at k " << k);
    SimOptions opts;
    opts.device = t.device;
    auto [sim, a] = cachealloc::test::make_sim_allocator(policy, opts);
    replay::Player player(t, *a, *sim);
    std::uint64_t failed = 0;
    sim->fail_call(k, SimFault::device_error);
    int burst = 0;
    for (const replay::Op& op : t.ops) {
      if (burst < 3 && sim->injected_faults() > static_cast<std::uint64_t>(burst)) {
        ++burst;
        if (burst < 3) {
          sim->fail_call(1, burst % 2 == 0 ? SimFault::device_error : SimFault::out_of_memory);
        }
      }
      if (op.kind == replay::OpKind::alloc) {
        try {
          player.apply(op);
        } catch (const OutOfMemory&) {
          ++failed;
        } catch (const DeviceError&) {
          ++failed;
        }
      } else {
        REQUIRE_NOTHROW(player.apply(op));
      }
    }
    sim->clear_faults();
    CHECK(failed <= 6);
    REQUIRE_NOTHROW(a->check_invariants());
    player.finish();
    sim->complete_all();
    a->empty_cache();
    REQUIRE_NOTHROW(a->check_invariants());
    CHECK(sim->held_bytes() == 0);
    CHECK(sim->live_reservations() == 0);
    CHECK(sim->live_physical() == 0);
  }
}

TEST_CASE("reliability: a device whose event records always fail gives errors, loses nothing",
          "[reliability][faults]") {
  // Session 47 ran the GPU suite with every event record failing (a fence flag the driver
  // rejects). Each policy must then report errors as DeviceError, keep its invariants, give
  // everything back once the device works again, and survive its teardown while it still fails.
  // (The GPU crash of that run was the test's: it destroyed its stream before the allocator,
  // whose teardown then recorded on it; tests/gpu now declare streams first.)
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  CAPTURE(policy);
  auto backend = std::make_unique<SimBackend>(SimOptions{});
  SimBackend* sim = backend.get();
  Config config;
  auto a = make_allocator(policy, std::move(backend), config);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> log_size(0.0, 25.0);
  std::vector<void*> live;
  int errors = 0;
  sim->fail_always(SimCall::record_event);
  for (int i = 0; i < 200; ++i) {
    try {
      void* p = a->allocate(static_cast<std::size_t>(std::exp2(log_size(rng))) + 1, StreamId{7});
      REQUIRE(p != nullptr);
      live.push_back(p);
    } catch (const DeviceError&) {
      ++errors;
    }
    a->check_invariants();
    if (i % 3 == 2 && !live.empty()) {
      try {
        a->deallocate(live.back());
        live.pop_back();
      } catch (const DeviceError&) {
        ++errors;
      }
      a->check_invariants();
    }
  }
  for (void* p : live) {
    a->deallocate(p);
    a->check_invariants();
  }
  live.clear();
  if (policy == "defrag") {  // it stamps frees on one stream too: its growths need the records
    CHECK(errors > 0);
  }
  sim->clear_faults();
  a->empty_cache();
  a->check_invariants();
  CHECK(a->stats().allocation.current == 0);
  CHECK(a->stats().reserved_bytes.current == 0);
  // Torn down while the records still fail, with blocks live and frees stamped (as a test that
  // failed on the GPU left it): the destructor gives back what it can and does not crash.
  sim->fail_always(SimCall::record_event);
  for (int i = 0; i < 20; ++i) {
    try {
      live.push_back(a->allocate((i + 1) * 3 * kMiB, StreamId{7}));
      if (i % 2 == 1) {
        a->deallocate(live.back());
        live.pop_back();
      }
    } catch (const DeviceError&) {  // NOLINT(bugprone-empty-catch): expected while records fail
    }
  }
  a.reset();
}
