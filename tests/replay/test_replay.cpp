// test_replay.cpp: replays of the bundled real traces (recorded figures, every policy's
// invariants, the native model's fidelity to the recorded reservations).
#include "../support.h"

#include <replay.h>

#include <cachealloc/trace/snapshot.h>

#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <string_view>
#include <utility>

using namespace cachealloc;

namespace {

struct Expected {
  const char* file;
  std::uint64_t recorded_peak;
  std::uint64_t peak_requested;
};

const Expected kTraces[] = {
    {"gpt2_train_varlen.pickle.xz", 28'705'816'576ull, 24'021'788'080ull},
    {"resnet50_train.pickle.xz", 3'594'518'528ull, 3'192'592'912ull},
    {"mlp_two_streams.pickle.xz", 3'458'203'648ull, 2'786'721'796ull},
    {"resnet50_train_expandable.pickle.xz", 3'225'419'776ull, 3'192'592'912ull},
};

/// The snapshot at `path`, read and prepared once per test run.
const replay::PreparedTrace& prepared_at(const std::string& path, const std::string& name) {
  static std::map<std::string, replay::PreparedTrace> cache;
  auto it = cache.find(path);
  if (it == cache.end()) {
    it = cache.emplace(path, replay::prepare(trace::read_snapshot(path), name)).first;
  }
  return it->second;
}

/// A bundled trace (tests/data/traces).
const replay::PreparedTrace& prepared(const std::string& file) {
  return prepared_at(std::string(CACHEALLOC_TRACE_DIR) + "/" + file, file);
}

/// The recording at `path` replayed under defrag with settings `a`, then `b`; both must run.
std::pair<replay::PolicyResult, replay::PolicyResult> defrag_a_b(const std::string& path,
                                                                 const std::string& name,
                                                                 const replay::ReplayOptions& opts,
                                                                 const std::string& a,
                                                                 const std::string& b) {
  const replay::PreparedTrace& t = prepared_at(path, name);
  std::pair<replay::PolicyResult, replay::PolicyResult> r{replay::run(t, "defrag", a, opts),
                                                          replay::run(t, "defrag", b, opts)};
  REQUIRE(r.first.error.empty());
  REQUIRE(r.second.error.empty());
  return r;
}

#ifdef CACHEALLOC_HAS_NATIVE
/// The native model replays `t` with the trace's own settings and makes exactly the device
/// reservations of the recorded run, to its peak.
void check_native_matches(const replay::PreparedTrace& t, std::uint64_t recorded_peak) {
  replay::ReplayOptions opts;
  opts.check_fidelity = true;
  const replay::PolicyResult r = replay::run(t, "native", replay::native_conf_from_settings(t.settings), opts);
  REQUIRE(r.fidelity);
  INFO(r.fidelity->detail);
  CHECK_FALSE(r.fidelity->first_divergence_event);
  CHECK(r.fidelity->model_segments == r.fidelity->recorded_segments);
  CHECK(r.peak_reserved == recorded_peak);
}
#endif

}  // namespace

TEST_CASE("replay: the recorded native curve and peak requested bytes match PyTorch's figures",
          "[replay]") {
  for (const Expected& e : kTraces) {
    INFO(e.file);
    const replay::PreparedTrace& t = prepared(e.file);
    CHECK(t.recorded_peak_reserved == e.recorded_peak);
    CHECK(t.peak_requested == e.peak_requested);
    CHECK(t.unmatched_frees == 0);
  }
}

TEST_CASE("replay: every policy replays every bundled trace with its invariants intact",
          "[replay]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  for (const Expected& e : kTraces) {
    INFO(e.file << " policy " << policy);
    replay::ReplayOptions opts;
    opts.check_every = 997;  // a prime, so checks land on every kind of operation
    const replay::PolicyResult r = replay::run(prepared(e.file), policy, "", opts);
    CHECK(r.error.empty());
    CHECK(r.failed_allocations == 0);
    CHECK(r.peak_requested == e.peak_requested);
    CHECK(r.peak_reserved >= e.peak_requested);
  }
}

TEST_CASE("replay: a small device makes allocations fail without corrupting anything", "[replay]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  replay::ReplayOptions opts;
  opts.capacity = 2 * kGiB;
  opts.check_every = 101;
  const replay::PolicyResult r = replay::run(prepared("resnet50_train.pickle.xz"), policy, "", opts);
  CHECK(r.failed_allocations > 0);
  CHECK(r.peak_reserved <= 2 * kGiB);
}

#ifdef CACHEALLOC_HAS_NATIVE
TEST_CASE("replay: native makes exactly the recorded device reservations", "[replay][native]") {
  for (const Expected& e : kTraces) {
    INFO(e.file);
    check_native_matches(prepared(e.file), e.recorded_peak);
  }
}
#endif

#if defined(CACHEALLOC_HAS_NATIVE) && defined(CACHEALLOC_HAS_DEFRAG)
TEST_CASE("replay: the e2e recordings: native matches PyTorch's reservations, defrag holds less "
          "than expandable segments", "[replay][native][defrag]") {
  // bench/e2e/recordings (session 10: each workload recorded in a fresh process, so the
  // libraries' first-use allocations are in them). The replayed form of issue 5's end-to-end
  // bar, a guard for changes judged on replays: on the H200 these runs peaked below
  // expandable_segments too (gpt2, resnet50) or level with it by their spread (pipeline).
  // Two models of the GPU: events complete as soon as they are recorded (gpu_lag_us 0, the
  // optimistic extreme), and 2 ms after (the host queues a 10-20 ms step's kernels well ahead of
  // the GPU). Defrag holds less than expandable segments in both, except the two-stream pipeline:
  // there both stop at the same 3,344 MiB (defrag at its largest slack, 0.25). With events closed
  // only on demand (Note [Epochs on demand], defrag.cpp) it was level at lag 0 and below with a
  // lag (1.224 of the live peak against 1.244), where closing them every 8 frees had held 1.189 /
  // 1.274 (bench/results/defrag_time_experiments_2026-12-03_session13.md); since unmaps cost the
  // simulated host 3 us, as cuda_vmm's background unmaps cost the allocating thread (Note
  // [Simulated time], sim_backend.h; session 23), it is level at both lags.
  for (const char* name : {"e2e_gpt2", "e2e_resnet50", "e2e_pipeline"}) {
    INFO(name);
    const auto snapshot =
        trace::read_snapshot(std::string(CACHEALLOC_E2E_RECORDINGS_DIR) + "/" + name + ".pickle.xz");
    const replay::PreparedTrace t = replay::prepare(snapshot, name);
    check_native_matches(t, t.recorded_peak_reserved);
    for (const std::uint64_t lag_us : {0, 2000}) {
      INFO("GPU lag " << lag_us << " us");
      replay::ReplayOptions plain;
      plain.check_every = 997;
      plain.gpu_lag_us = lag_us;
      const replay::PolicyResult expandable =
          replay::run(t, "native", "expandable_segments:True", plain);
      const replay::PolicyResult defrag = replay::run(t, "defrag", "", plain);
      REQUIRE(defrag.error.empty());
      INFO("defrag " << defrag.peak_reserved << ", expandable segments " << expandable.peak_reserved
                     << ", requested " << t.peak_requested);
      CHECK(defrag.failed_allocations == 0);
      if (std::string_view(name) == "e2e_pipeline") {
        CHECK(defrag.peak_reserved <= expandable.peak_reserved);
      } else {
        CHECK(defrag.peak_reserved < expandable.peak_reserved);
      }
    }
  }
}
#endif

TEST_CASE("replay: the held-out validation recordings replay on every policy with invariants "
          "intact", "[replay][validation]") {
  // bench/validation/recordings: kinds of job recorded on an H200 that no policy was
  // developed against (inference with growing caches, serving, mixture of experts, a U-Net,
  // checkpointing, an LSTM, torch.compile with and without CUDA graphs). Their figures are
  // benchmarks (bench/validation/replay_table.py); here every policy must replay them without a
  // failed allocation or a broken invariant, and the native model must make the recorded run's
  // reservations. Not cudagraph_mlp's: CUDA graph capture allocates from the graph's private
  // pool, and a snapshot's trace entries do not say which pool an allocation came from, so the
  // model (one pool per stream) places a 16 KiB block captured into a graph in a default-pool
  // segment, where the recorded run made a new 2 MiB one (event 205).
  // recordings_b: the same workloads with seed 1, recorded after the change of session 16
  // (compiled_gpt missing there). offload_train, comm_overlap, stream_weights: three jobs that
  // hand memory between streams (record_stream), recorded in session 28 with both seeds.
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  const std::string set = GENERATE(as<std::string>{}, "recordings", "recordings_b");
  for (const char* name : {"llm_generate", "llm_serve", "moe_train", "unet_train", "vit_ckpt",
                           "lstm_lm", "compiled_gpt", "cudagraph_mlp", "offload_train", "comm_overlap",
                           "stream_weights"}) {
    if (set == "recordings_b" && std::string_view(name) == "compiled_gpt") {
      continue;
    }
    INFO(set << "/" << name << " policy " << policy);
    const replay::PreparedTrace& t = prepared_at(
        std::string(CACHEALLOC_VALIDATION_DIR) + "/" + set + "/" + name + ".pickle.xz", name);
    CHECK(t.unmatched_frees == 0);
    replay::ReplayOptions opts;
    opts.check_every = 997;
    const replay::PolicyResult r = replay::run(t, policy, "", opts);
    CHECK(r.error.empty());
    CHECK(r.failed_allocations == 0);
    CHECK(r.peak_requested == t.peak_requested);
    CHECK(r.peak_reserved >= t.peak_requested);
#ifdef CACHEALLOC_HAS_NATIVE
    if (policy == "native" && std::string_view(name) != "cudagraph_mlp") {
      check_native_matches(t, t.recorded_peak_reserved);
    }
#endif
  }
}

TEST_CASE("replay: once defrag's moves cost too much at the slack's limit, growths at the top "
          "stop them", "[replay][defrag]") {
  // Note [Growing at the top once moves cost too much at the limit] (defrag_grow.cpp): the e2e
  // pipeline over 304 steps, streams kept busy as its late frees show (--stream-lags). With
  // best-fit placement its moves go on at the slack's limit to the end; once a window of them
  // went over the budget there, growths at the top of their range settle the layout. Device
  // calls in the last half of the trace, and the peak, which must not rise.
  replay::ReplayOptions opts;
  opts.check_every = 997;
  opts.stream_lags = true;
  opts.phases = 8;
  const auto late_calls = [](const replay::PolicyResult& r) {
    std::uint64_t n = 0;
    for (std::size_t k = r.phases.size() / 2; k < r.phases.size(); ++k) {
      n += r.phases[k].device_calls;
    }
    return n;
  };
  const auto [top, fit] =
      defrag_a_b(std::string(CACHEALLOC_E2E_RECORDINGS_DIR) + "/e2e_pipeline_long.pickle.xz",
                 "e2e_pipeline_long", opts, "", "top_at_limit:False");
  INFO("top_at_limit: " << late_calls(top) << " late device calls, peak " << top.peak_reserved
                        << "; best fit: " << late_calls(fit) << ", peak " << fit.peak_reserved);
  CHECK(top.detail.find("growths placed at the top of their range") != std::string::npos);
  CHECK(fit.detail.find("growths placed at the top of their range") == std::string::npos);
  CHECK(late_calls(top) * 4 < late_calls(fit));
  CHECK(top.peak_reserved <= fit.peak_reserved);
  CHECK(top.failed_allocations == 0);
}

TEST_CASE("replay: GPU runs of jobs that hand memory between streams replay to their recorded "
          "peaks", "[replay][validation]") {
  // bench/validation/gpu_runs (record.log there): offload_train and stream_weights recorded on an
  // H100 under PyTorch's allocator, with and without expandable segments, and under cachealloc's
  // defrag by its own recorder; offload_train also on an H200 (gpu_runs/h200). Their frees wait
  // for another stream for tens of milliseconds.
  // The native model, with the settings each recording names, must make exactly its recorded
  // reservations to its recorded peak (expandable segments included); the defrag recordings'
  // mapped pages must add up to the peak the plugin itself reported in that run (record.log),
  // and every policy must replay all nine with invariants intact.
  struct Run {
    const char* file;
    std::uint64_t recorded_peak;  // as the run printed it
  };
  const Run runs[] = {
      {"native/offload_train", 21'699'231'744ull},     {"native/stream_weights", 8'430'551'040ull},
      {"expandable/offload_train", 13'027'508'224ull}, {"expandable/stream_weights", 8'432'648'192ull},
      {"defrag/offload_train", 11'450'449'920ull},     {"defrag/stream_weights", 7'975'469'056ull},
      // gpu_runs/h200 (session 31): offload_train on an H200, where defrag peaked above
      // expandable segments in the e2e benchmark; defrag recorded twice.
      {"h200/expandable/offload_train", 14'390'657'024ull},
      {"h200/defrag/offload_train", 15'118'368'768ull},
      {"h200/defrag_b/offload_train", 16'244'539'392ull},
  };
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  for (const Run& run : runs) {
    INFO(run.file << " policy " << policy);
    const replay::PreparedTrace& t = prepared_at(
        std::string(CACHEALLOC_VALIDATION_DIR) + "/gpu_runs/" + run.file + ".pickle.xz", run.file);
    CHECK(t.unmatched_frees == 0);
    CHECK(t.recorded_peak_reserved == run.recorded_peak);
    CHECK(t.peak_live_pending > t.peak_requested);  // frees that waited for the other stream
    replay::ReplayOptions opts;
    opts.check_every = 997;
    opts.stream_lags = true;
    const replay::PolicyResult r = replay::run(t, policy, "", opts);
    CHECK(r.error.empty());
    CHECK(r.failed_allocations == 0);
    CHECK(r.peak_reserved >= t.peak_live_pending);
    if (policy == "defrag") {  // Note [Frees in flight and the slack]: the detail names both peaks
      INFO(r.detail);
      CHECK(r.detail.find("MiB live with the frees parked for other streams") != std::string::npos);
    }
#ifdef CACHEALLOC_HAS_NATIVE
    if (policy == "native" && std::string_view(run.file).find("defrag") == std::string_view::npos) {
      check_native_matches(t, run.recorded_peak);
    }
#endif
  }
}

TEST_CASE("replay: the note on skipped frees, printed under the sim and the GPU tables",
          "[replay]") {
  replay::PreparedTrace t;
  CHECK(replay::skipped_frees_note(t).empty());
  t.unmatched_frees = 3;
  CHECK(replay::skipped_frees_note(t) ==
        "  note: 3 frees of blocks allocated before recording started were skipped\n");
}

TEST_CASE("replay: native settings are taken from the trace", "[replay]") {
  trace::AllocatorSettings s;
  s.present = true;
  s.expandable_segments = true;
  s.max_split_size = 256 * static_cast<std::int64_t>(kMiB);
  s.garbage_collection_threshold = 0.5;
  s.roundup_power2_divisions = {{256, 1}, {512, 0}, {1024, 4}};
  CHECK(replay::native_conf_from_settings(s) ==
        "max_split_size_mb:256,garbage_collection_threshold:0.500000,expandable_segments:True,"
        "roundup_power2_divisions:[256:1,512:0,1024:4]");
}

TEST_CASE("replay: --phases splits the device calls into slices that add up to the totals",
          "[replay]") {
  const std::string policy = GENERATE(from_range(cachealloc::test::policy_names()));
  INFO("policy " << policy);
  const replay::PreparedTrace& t = prepared("mlp_two_streams.pickle.xz");
  replay::ReplayOptions opts;
  opts.phases = 7;
  const replay::PolicyResult r = replay::run(t, policy, "", opts);
  REQUIRE(r.phases.size() == 7);
  std::uint64_t calls = 0;
  std::uint64_t maps = 0;
  std::uint64_t unmaps = 0;
  for (std::size_t k = 0; k < r.phases.size(); ++k) {
    calls += r.phases[k].device_calls;
    maps += r.phases[k].maps;
    unmaps += r.phases[k].unmaps;
    if (k > 0) {
      CHECK(r.phases[k].end_op > r.phases[k - 1].end_op);
    }
  }
  CHECK(r.phases.back().end_op == t.ops.size());
  CHECK(maps == r.map_calls);
  CHECK(unmaps == r.unmap_calls);
  CHECK(calls == r.device_reserve_calls + r.device_release_calls + r.map_calls + r.unmap_calls);
  CHECK(r.phases.back().reserved <= r.peak_reserved);
}

TEST_CASE("replay: --call-cost sets what a simulated device call costs, and rejects anything else",
          "[replay]") {
  SimCallCosts c;
  replay::apply_call_cost(c, "map=65");
  replay::apply_call_cost(c, "unmap=27.5");
  replay::apply_call_cost(c, "pool_op=0");
  CHECK(c.map_ns == 65'000);
  CHECK(c.unmap_ns == 27'500);
  CHECK(c.pool_op_ns == 0);
  CHECK(c.create_ns == SimCallCosts{}.create_ns);  // the others keep the H200's
  for (const char* bad :
       {"map", "map=", "map=x", "map=-1", "map=5us", "map=1e20", "=5", "maps=5"}) {
    INFO(bad);
    CHECK_THROWS_AS(replay::apply_call_cost(c, bad), ConfigError);
  }
  try {
    replay::apply_call_cost(c, "mapp=3");
    FAIL("an unknown kind was accepted");
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    CHECK(what.find("unknown kind 'mapp'") != std::string::npos);
    CHECK(what.find("map, unmap") != std::string::npos);  // names the kinds
  }
  CHECK(c.map_ns == 65'000);  // a rejected spec changes nothing
  const auto kinds = replay::call_cost_kinds(c);
  REQUIRE(kinds.size() == 8);
  CHECK(kinds[4] == std::pair<std::string, double>{"map", 65.0});
  // A replay charges them: the same trace, its stream-ordered pool calls ten times dearer
  // (policy async), costs the simulated host more.
  const replay::PreparedTrace& t = prepared("gpt2_train_varlen.pickle.xz");
  replay::ReplayOptions opts;
  const replay::PolicyResult usual = replay::run(t, "async", "", opts);
  opts.call_costs.pool_op_ns = 10 * SimCallCosts{}.pool_op_ns;
  const replay::PolicyResult dear = replay::run(t, "async", "", opts);
  REQUIRE(usual.error.empty());
  REQUIRE(dear.error.empty());
  CHECK(usual.charged_ns > 0);
  CHECK(dear.charged_ns > usual.charged_ns);
}

#ifdef CACHEALLOC_HAS_DEFRAG
TEST_CASE("replay: defrag reports its counters, and a lagging GPU makes its waits cost time",
          "[replay][defrag]") {
  const replay::PreparedTrace& t = prepared("gpt2_train_varlen.pickle.xz");
  replay::ReplayOptions opts;
  const replay::PolicyResult at_once = replay::run(t, "defrag", "", opts);
  opts.gpu_lag_us = 5000;
  const replay::PolicyResult lagging = replay::run(t, "defrag", "", opts);
  CHECK(at_once.detail.find("pages created") != std::string::npos);
  CHECK(at_once.detail.find("ms moving") != std::string::npos);
  // The time spent moving (waits included) is read back from the detail line.
  const auto moving_ms = [](const std::string& d) {
    const auto end = d.find(" ms moving");
    REQUIRE(end != std::string::npos);
    const auto start = d.rfind(' ', end - 1);
    return std::stod(d.substr(start + 1, end - start - 1));
  };
  const auto waiting_ms = [](const std::string& d) {  // "N stream waits (X ms)"
    const auto at = d.find(" stream waits (");
    REQUIRE(at != std::string::npos);
    return std::stod(d.substr(at + 15));
  };
  INFO(at_once.detail << "\n" << lagging.detail);
  CHECK(moving_ms(lagging.detail) > moving_ms(at_once.detail));
  CHECK(waiting_ms(lagging.detail) > waiting_ms(at_once.detail));
  CHECK(static_cast<double>(lagging.peak_reserved) / static_cast<double>(t.peak_requested) <= 1.02);
  // move_pending (Note [Moving pages a stream still uses]): the same lag, no wait; the pages
  // that left holes their stream still used are named.
  const replay::PolicyResult pending = replay::run(t, "defrag", "move_pending:True", opts);
  INFO(pending.detail);
  CHECK(pending.detail.find(" 0 stream waits (0.0 ms)") != std::string::npos);
  CHECK(pending.detail.find("holes their stream's work still used") != std::string::npos);
  CHECK(static_cast<double>(pending.peak_reserved) / static_cast<double>(t.peak_requested) <= 1.02);
}
#endif

#if defined(CACHEALLOC_HAS_NATIVE) && defined(CACHEALLOC_HAS_DEFRAG)
TEST_CASE("replay: defrag stops waiting for a stream that runs far behind, not for one close by",
          "[replay][defrag]") {
  // Note [Waits that switch to moving pending] (defrag_grow.cpp): the held-out serving recording
  // with the GPU 100 ms behind the host spends its move budget waiting for its stream; the
  // policy then moves those pages pending instead of raising the slack. With the switch off it
  // raises the slack and holds far more. The e2e GPT-2 recording with a 2 ms lag never switches.
  const auto serve = trace::read_snapshot(std::string(CACHEALLOC_VALIDATION_DIR) +
                                          "/recordings/llm_serve.pickle.xz");
  const replay::PreparedTrace t = replay::prepare(serve, "llm_serve");
  replay::ReplayOptions opts;
  opts.gpu_lag_us = 100'000;
  opts.check_every = 997;
  const replay::PolicyResult switched = replay::run(t, "defrag", "", opts);
  const replay::PolicyResult waiting = replay::run(t, "defrag", "pending_on_waits:False", opts);
  REQUIRE(switched.error.empty());
  REQUIRE(waiting.error.empty());
  INFO(switched.detail << "\n" << waiting.detail);
  CHECK(switched.detail.find("switched to moving pending") != std::string::npos);
  CHECK(waiting.detail.find("switched to moving pending") == std::string::npos);
  const auto ratio = [&](const replay::PolicyResult& r) {
    return static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_requested);
  };
  // Below expandable segments on the same replay (1.032 of the live peak). It was within issue
  // 5's 1.02 too until session 22 (1.015); since unmaps cost the simulated host 3 us (Note
  // [Simulated time], sim_backend.h) it holds 1.0204.
  const replay::PolicyResult expandable =
      replay::run(t, "native", "expandable_segments:True", opts);
  CHECK(switched.peak_reserved < expandable.peak_reserved);
  CHECK(ratio(switched) + 0.05 < ratio(waiting));

  const auto gpt2 = trace::read_snapshot(std::string(CACHEALLOC_E2E_RECORDINGS_DIR) + "/e2e_gpt2.pickle.xz");
  const replay::PreparedTrace g = replay::prepare(gpt2, "e2e_gpt2");
  opts.gpu_lag_us = 2'000;
  const replay::PolicyResult training = replay::run(g, "defrag", "", opts);
  INFO(training.detail);
  CHECK(training.detail.find("switched to moving pending") == std::string::npos);
}
#endif

#if defined(CACHEALLOC_HAS_NATIVE) && defined(CACHEALLOC_HAS_DEFRAG)
TEST_CASE("replay: defrag places growths above queued unmaps and at the top of a hole, on the "
          "held-out serving recording", "[replay][defrag]") {
  // recordings_b/llm_serve (bench/validation), the recording these rules were found on
  // (bench/results/defrag_session23_2026-12-04.md). Note [Placing away from queued unmaps]: with
  // the GPU 100 ms behind, a growth whose every fit had an unmap queued behind the stream waited
  // 100 ms for it, the time budget charged that as moves and raised the slack (1.078 of the live
  // peak); placed above those unmaps in the same hole it does not wait (1.017). Note [A block that
  // ends with the free pages above it] (defrag_grow.cpp): with the GPU keeping up, growths that
  // would create pages beyond the slack while the free hole above held them created them anyway
  // (1.075); ending the block with that hole, 1.028. Expandable segments: 1.035.
  const auto serve = trace::read_snapshot(std::string(CACHEALLOC_VALIDATION_DIR) +
                                          "/recordings_b/llm_serve.pickle.xz");
  const replay::PreparedTrace t = replay::prepare(serve, "llm_serve");
  const auto ratio = [&](const replay::PolicyResult& r) {
    return static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_requested);
  };
  replay::ReplayOptions opts;
  opts.check_every = 997;
  opts.gpu_lag_us = 100'000;
  const replay::PolicyResult lagging = replay::run(t, "defrag", "", opts);
  REQUIRE(lagging.error.empty());
  INFO(lagging.detail);
  CHECK(lagging.detail.find("of them above its queued unmaps") != std::string::npos);
  CHECK(ratio(lagging) <= 1.02);
  opts.gpu_lag_us = 0;
  const replay::PolicyResult keeping_up = replay::run(t, "defrag", "", opts);
  const replay::PolicyResult expandable =
      replay::run(t, "native", "expandable_segments:True", opts);
  REQUIRE(keeping_up.error.empty());
  INFO(keeping_up.detail);
  CHECK(keeping_up.detail.find("at the top of their hole") != std::string::npos);
  CHECK(keeping_up.peak_reserved < expandable.peak_reserved);
}
#endif

TEST_CASE("replay: each stream's own peak of requested bytes, and their sum", "[replay]") {
  // Stream 1 peaks at 100 bytes, stream 2 at 130 bytes, never together: the peak of the sum is
  // 150 (both streams' first blocks), the sum of the peaks 230.
  trace::Snapshot s;
  s.device_count = 1;
  using trace::Action;
  const auto ev = [](Action a, std::uint64_t addr, std::uint64_t size, std::uint64_t stream) {
    trace::TraceEvent e;
    e.action = a;
    e.addr = addr;
    e.size = size;
    e.stream = stream;
    return e;
  };
  s.events = {
      ev(Action::alloc, 0x1000, 100, 1),
      ev(Action::alloc, 0x2000, 50, 2),
      ev(Action::free_requested, 0x1000, 100, 1),
      ev(Action::free_completed, 0x1000, 100, 1),
      ev(Action::alloc, 0x3000, 80, 2),
      ev(Action::alloc, 0x4000, 10, 1),
      ev(Action::free_requested, 0x2000, 50, 2),  // deferred: requested bytes end here
      ev(Action::alloc, 0x5000, 60, 1),
      ev(Action::free_completed, 0x2000, 50, 2),
  };
  for (std::size_t i = 0; i < s.events.size(); ++i) {
    s.events[i].time_us = static_cast<std::int64_t>(1000 * (i + 1));  // 1 ms apart from 1 ms
  }
  const replay::PreparedTrace t = replay::prepare(s, "two streams");
  CHECK(t.peak_requested == 150);
  // When 0x5000 comes, 0x2000 (50 bytes) is freed but its free has not completed: 150 + 50.
  CHECK(t.peak_live_pending == 200);
  // Note [Each stream's own lag]: 0x2000, stream 2's, was freed at 7 ms and completed at 9 ms
  // (6 and 8 ms on the trace's clock, which starts at its first entry): stream 1, the other one,
  // was busy until 8 ms; stream 2 has no late free of another stream's block.
  REQUIRE(t.stream_lags.size() == 1);
  CHECK(t.stream_lags[0].first == 1);
  CHECK(t.stream_lags[0].second == std::vector<std::pair<std::uint64_t, std::uint64_t>>{{6000, 8000}});
  REQUIRE(t.stream_peaks.size() == 2);
  CHECK(t.stream_peaks[0] == std::pair<std::uint64_t, std::uint64_t>{1, 100});
  CHECK(t.stream_peaks[1] == std::pair<std::uint64_t, std::uint64_t>{2, 130});
  CHECK(replay::stream_peaks_sum(t) == 230);

  // The bundled traces: a one-stream trace's only stream peaks at the trace's peak; with two
  // streams each peaks at most there and together at least there (mlp_two_streams: 1.012x).
  for (const Expected& e : kTraces) {
    INFO(e.file);
    const replay::PreparedTrace& p = prepared(e.file);
    REQUIRE_FALSE(p.stream_peaks.empty());
    for (const auto& [stream, bytes] : p.stream_peaks) {
      CHECK(bytes <= p.peak_requested);
    }
    if (p.stream_peaks.size() == 1) {
      CHECK(replay::stream_peaks_sum(p) == p.peak_requested);
    } else {
      CHECK(replay::stream_peaks_sum(p) >= p.peak_requested);
    }
  }
  const replay::PreparedTrace& mlp = prepared("mlp_two_streams.pickle.xz");
  REQUIRE(mlp.stream_peaks.size() == 2);
  CHECK(replay::stream_peaks_sum(mlp) == 2'820'276'228ull);
}
