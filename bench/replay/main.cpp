// main.cpp: cachealloc-replay, replays PyTorch memory snapshots on every policy side by side.
#include "plot.h"
#include "replay.h"
#ifdef CACHEALLOC_REPLAY_WITH_CUDA
#include "cuda_replay.h"

#include <cachealloc/cuda/factory.h>
#endif

#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/trace/pickle.h>
#include <cachealloc/trace/snapshot.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <unistd.h>

using namespace cachealloc;

namespace {

std::string with_commas(std::uint64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) {
    s.insert(static_cast<std::size_t>(i), ",");
  }
  return s;
}

/// --explain: defrag's slack history (Note [A history of the slack]), one line per event.
void print_history(const replay::PolicyResult& r) {
  const auto mib = [](std::uint64_t b) { return with_commas((b + kMiB / 2) / kMiB); };
  if (r.history.empty()) {
    std::printf("  %s: its slack never moved and no growth created pages beyond it\n", r.name.c_str());
    return;
  }
  std::printf("  %s, the moments that decided what it holds (time on the trace's clock; live / peak "
              "live / reserved MiB, and reserved over the peak):\n", r.name.c_str());
  for (const replay::HistoryEvent& e : r.history) {
    char change[64];
    if (e.pages != 0) {
      std::snprintf(change, sizeof change, "%llu page%s at %.4f", static_cast<unsigned long long>(e.pages),
                    e.pages == 1 ? "" : "s", e.slack_after);
    } else if (e.slack_after != e.slack_before) {
      std::snprintf(change, sizeof change, "%.4f -> %.4f", e.slack_before, e.slack_after);
    } else {
      std::snprintf(change, sizeof change, "at %.4f", e.slack_after);
    }
    const double over = e.peak_live_bytes != 0
                            ? static_cast<double>(e.reserved_bytes) / static_cast<double>(e.peak_live_bytes)
                            : 0.0;
    std::printf("    %9.3f s  %-36s %-20s %s / %s / %s (%.3fx)", e.time_s, e.what.c_str(), change,
                mib(e.live_bytes).c_str(), mib(e.peak_live_bytes).c_str(), mib(e.reserved_bytes).c_str(),
                over);
    if (e.parked_bytes != 0) {
      std::printf(", %s parked", mib(e.parked_bytes).c_str());
    }
    if (e.unsafe_pages != 0) {
      std::printf(", %llu free pages in use (%llu another stream's)",
                  static_cast<unsigned long long>(e.unsafe_pages),
                  static_cast<unsigned long long>(e.unsafe_other_pages));
    }
    std::printf("\n");
  }
  if (r.history_dropped != 0) {
    std::printf("    ... and %llu later events (the policy keeps the first %zu)\n",
                static_cast<unsigned long long>(r.history_dropped), r.history.size());
  }
}

/// --explain: defrag's move budget as it judged it (Note [A history of the time budget]): each
/// window it closed over the budget, and each growth that waited for a stream.
void print_budget(const replay::PolicyResult& r) {
  constexpr std::size_t kShown = 40;  // per list; --json has them all
  const auto ms = [](std::uint64_t ns) { return static_cast<double>(ns) / 1e6; };
  std::size_t within = 0;
  std::size_t shown = 0;
  std::size_t over = 0;
  for (const BudgetWindow& w : r.windows) {
    if (w.verdict == BudgetWindow::Verdict::within) {
      ++within;
      continue;
    }
    ++over;
    if (shown == 0) {
      std::printf("  %s, the move budget's windows over it (open -> close s; growths charged; their time, of "
                  "which waiting, less what quiet time paid; the budget; waits at new peaks, uncharged):\n",
                  r.name.c_str());
    }
    if (shown++ == kShown) {
      continue;
    }
    const std::string_view close = window_close_id(w.close);
    const std::string_view verdict = window_verdict_id(w.verdict);
    std::printf("    %9.3f -> %9.3f s  %2u growths  %8.2f ms (waited %7.2f)  spent %8.2f / allowed %7.2f ms  "
                "%u uncharged waits (%.2f ms)  closed %.*s: %.*s, slack %.4f\n",
                static_cast<double>(w.open_ns) / 1e9, static_cast<double>(w.close_ns) / 1e9, w.growths,
                ms(w.charged_ns), ms(w.waited_ns), ms(w.spent_ns), ms(w.allowed_ns), w.uncharged_waits,
                ms(w.uncharged_wait_ns), static_cast<int>(close.size()), close.data(),
                static_cast<int>(verdict.size()), verdict.data(), w.slack_after);
  }
  if (over > kShown) {
    std::printf("    ... and %zu more over the budget (all in --json as budget_windows)\n", over - kShown);
  }
  std::printf("  %s: %zu windows of the move budget judged, %zu within it, %zu over%s\n", r.name.c_str(),
              r.windows.size(), within, over,
              r.windows_dropped != 0 ? (", and " + std::to_string(r.windows_dropped) + " later ones only counted").c_str()
                                     : "");
  std::uint64_t waited = 0;
  std::uint64_t at_peak_ns = 0;
  std::size_t waiting = 0;
  std::size_t at_peak = 0;
  shown = 0;
  for (const CostlyGrowth& g : r.growths) {
    if (g.waits == 0) {
      continue;
    }
    ++waiting;
    waited += g.waited_ns;
    if (g.new_peak) {
      ++at_peak;
      at_peak_ns += g.waited_ns;
    }
    if (shown == 0) {
      std::printf("  %s, the growths that waited for a stream (end s; waited / whole growth ms; pages moved "
                  "and created):\n", r.name.c_str());
    }
    if (shown++ < kShown) {
      std::printf("    %9.3f s  %u wait%s %8.2f / %8.2f ms  %u moved, %u created, stream %#llx%s%s\n",
                  static_cast<double>(g.time_ns) / 1e9, g.waits, g.waits == 1 ? " " : "s", ms(g.waited_ns),
                  ms(g.took_ns), g.pages_moved, g.pages_created, static_cast<unsigned long long>(g.stream),
                  g.new_peak ? ", at a new peak (uncharged)" : "", g.pending ? ", moving pending" : "");
    }
  }
  if (shown > kShown) {
    std::printf("    ... and %zu more (all in --json as costly_growths)\n", shown - kShown);
  }
  std::printf("  %s: %zu of %zu growths that moved pages or waited waited, %.2f ms in all; %zu of them at a new "
              "peak (%.2f ms)%s\n", r.name.c_str(), waiting, r.growths.size(), ms(waited), at_peak, ms(at_peak_ns),
              r.growths_dropped != 0 ? (", and " + std::to_string(r.growths_dropped) + " later growths only counted").c_str()
                                     : "");
}

std::size_t parse_capacity(const std::string& text) {
  Config c = Config::parse("capacity:" + text);
  return *c.take_bytes("capacity");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cachealloc-replay: replays a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot, "
      "plain or .xz) on a simulated device (or, with --device cuda, on the real GPU) for each allocator policy and prints peak reserved "
      "memory, fragmentation and speed side by side, with the reservations PyTorch's own "
      "allocator made in the recorded run as the first row; on the simulated device, for a trace with "
      "several streams, "
      "also each stream's own peak of requested bytes and their sum, the least an allocator "
      "holds that keeps each stream's free memory for that stream."};
  std::string trace_path;
  std::vector<std::string> policies;
  std::vector<std::string> confs;
  std::string capacity_text = "143771MB";
  std::string json_path;
  std::string plot_path;
  std::string device_kind = "sim";
  int device = -1;
  bool quiet = false;
  bool explain = false;
  bool list = false;
  std::uint64_t check_every = 0;
  std::uint32_t phases = 0;
  std::uint64_t gpu_lag_us = 0;
  std::uint64_t query_lag_us = 0;
  bool stream_lags = false;
  bool late_other = false;
  std::vector<std::string> call_costs;
  int gpu = 0;
  std::uint64_t sample_every = 64;
  app.add_option("trace", trace_path, "the snapshot file (.pickle or .pickle.xz)");
  app.add_option("--policy,-p", policies,
                 "policy to replay (repeatable; default: every registered policy; with --device cuda: every "
                 "policy that is not replay-only, then torch_native and cudaMallocAsync, which are "
                 "also valid names there)")
      ->allow_extra_args(false);  // one name per -p: `-p defrag trace.pickle` keeps the trace
  app.add_option("--conf,-c", confs,
                 "CACHEALLOC_CONF settings for a policy, as POLICY=KEY:VALUE,... e.g. "
                 "native=expandable_segments:True (repeatable; 'native' defaults to the settings "
                 "recorded in the trace)")
      ->allow_extra_args(false);
  app.add_option("--capacity", capacity_text,
                 "simulated device memory, e.g. 80GB or 143771MB (default: an H200, 143771MB; --device sim only)");
  app.add_option("--json", json_path, "write the results as JSON to this file");
  app.add_option("--plot", plot_path,
                 "draw reserved and live bytes over the trace for every policy (.svg or .html)");
  app.add_option("--device", device_kind,
                 "sim (default): the simulated device; cuda: the real GPU (our policies on their "
                 "CUDA backends, PyTorch's own allocator through LibTorch as torch_native, and "
                 "cudaMallocAsync), with per-operation latency p50/p90/p99/max and the peak seen "
                 "by cudaMemGetInfo; exits 2 when no GPU is visible")
      ->check(CLI::IsMember({"sim", "cuda"}));
  app.add_option("--gpu", gpu, "with --device cuda: which CUDA device to use (default 0)");
  app.add_option("--sample-every", sample_every,
                 "with --device cuda: read cudaMemGetInfo every N operations for the measured peak "
                 "(default 64; also after every reservation change of our backends)");
  app.add_option("--trace-device", device, "which device of the snapshot to replay (default: busiest)");
  app.add_option("--check-every", check_every,
                 "run the allocator's invariant checks every N operations (slow; 0 = off)");
  app.add_option("--phases", phases,
                 "also print, per policy, the device calls (reserves, creates, releases, maps, "
                 "unmaps) made in each of N equal slices of the trace's operations: a policy that "
                 "settles makes none once a repeating job reached its steady state (default 0: off)");
  app.add_flag("--explain", explain,
               "also print, for defrag, the moments that decided what it holds beyond the live "
               "peak, in order: each raise of its slack (and why), each raise undone, the switch "
               "to moving pending, and each growth that created pages beyond the slack, with the "
               "time, the slack, the live bytes, their peak and the reserved bytes then (the "
               "first 512; also in --json as slack_history); then its move budget's windows that "
               "went over it (growths charged, their time and waits, what the budget allowed, the "
               "verdict) and the growths that waited for a stream (the first 40 of each; in --json "
               "all the policy kept, as budget_windows and costly_growths)");
  app.add_option("--gpu-lag-us", gpu_lag_us,
                 "simulated device: the GPU finishes the work queued on a stream this many "
                 "microseconds (of the trace's own clock) after the host queued it, so events "
                 "complete late and waiting for one costs host time (default 0: at once)");
  app.add_option("--query-lag-us", query_lag_us,
                 "simulated device: event queries answer from a watcher's look taken at most this "
                 "many microseconds (simulated clock) ago, as the CUDA backends' under "
                 "event_thread:poll, defrag's default on a GPU (default 0: queries answer at once)");
  CLI::Option* lags_flag = app.add_flag("--stream-lags", stream_lags,
               "simulated device: a stream stays busy as long as the trace's late frees "
               "(record_stream) show its work ran behind the host, on top of --gpu-lag-us (Note "
               "[Each stream's own lag]); for jobs that hand memory between streams");
  app.add_flag("--late-frees-on-other-stream", late_other,
               "with --stream-lags, on a trace with two streams: a late free waits for the stream "
               "that did not allocate the block (the only one that can have used it) instead of a "
               "private stream, so an allocation on that stream sees the free parked behind it, "
               "as reuse_parked needs (Note [Late frees on the other stream]); the summary then "
               "also prints event queries per 1,000 allocations, comparable to a GPU run's")
      ->needs(lags_flag);
  std::string cost_help =
      "simulated device: what one device call costs the host, as KIND=MICROSECONDS (repeatable), "
      "for another GPU's measured costs or to check how much a result depends on them; KIND and "
      "default (an H200's median: Note [Simulated time]):";
  for (const auto& [kind, us] : replay::call_cost_kinds(SimCallCosts{})) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s=%g", kind.c_str(), us);
    cost_help += buf;
  }
  cost_help += " (create/release_physical/map per handle, unmap per mapping removed off the "
               "allocating thread, unmap_now per mapping removed on it (defrag's coalescing), "
               "pool_op per stream-ordered allocate or free)";
  app.add_option("--call-cost", call_costs, cost_help)->allow_extra_args(false);
  app.add_flag("--quiet,-q", quiet, "no progress output on stderr");
  app.add_flag("--list-policies", list, "list the registered policies and exit");
  CLI11_PARSE(app, argc, argv);

  if (list) {
    for (const PolicyInfo& p : registered_policies()) {
      std::printf("%-12s %s%s\n", std::string(p.name).c_str(), std::string(p.summary).c_str(),
                  p.replay_only ? " (replay only)" : "");
    }
    return 0;
  }
  if (trace_path.empty()) {
    std::cerr << "cachealloc-replay: no trace given. Usage: cachealloc-replay TRACE [--policy NAME]... "
                 "(see --help)\n";
    return 2;
  }
  const bool progress = !quiet && isatty(STDERR_FILENO) != 0;
  const bool on_gpu = device_kind == "cuda";
  if (on_gpu) {
#ifdef CACHEALLOC_REPLAY_WITH_CUDA
    if (cuda_device_count() <= gpu) {
      std::cerr << "cachealloc-replay: --device cuda: no CUDA GPU " << gpu
                << " is visible (found " << cuda_device_count()
                << " devices; no driver or no GPU here); use --device sim\n";
      return 2;
    }
    if (!plot_path.empty()) {
      std::cerr << "cachealloc-replay: --plot is not supported with --device cuda\n";
      return 2;
    }
#else
    std::cerr << "cachealloc-replay: --device cuda: this build has no CUDA support "
                 "(configure with the CUDA toolkit); use --device sim\n";
    return 2;
#endif
  }

  try {
    std::size_t capacity = parse_capacity(capacity_text);
    SimCallCosts costs;
    for (const std::string& c : call_costs) {
      replay::apply_call_cost(costs, c);
    }
    if (on_gpu && !call_costs.empty()) {
      throw ConfigError("--call-cost applies to the simulated device only (--device sim); on the "
                        "GPU every call costs what it costs");
    }
    if (policies.empty() && !on_gpu) {
      for (const PolicyInfo& p : registered_policies()) {
        policies.emplace_back(p.name);
      }
    }
#ifdef CACHEALLOC_REPLAY_WITH_CUDA
    if (policies.empty() && on_gpu) {
      policies = replay::default_cuda_rows();
    }
#endif
    for (const std::string& p : policies) {
      if (on_gpu && (p == "torch_native" || p == "cudaMallocAsync")) {
        continue;
      }
      if (find_policy(p) == nullptr) {
        Config dummy;
        (void)make_allocator(p, std::make_unique<SimBackend>(), dummy);  // throws a clear error
      }
    }
    std::map<std::string, std::string> conf_of;
    for (const std::string& c : confs) {
      const auto eq = c.find('=');
      if (eq == std::string::npos) {
        throw ConfigError("--conf expects POLICY=KEY:VALUE,..., got '" + c + "'");
      }
      conf_of[c.substr(0, eq)] = c.substr(eq + 1);
    }

    trace::ReadOptions read_options;
    if (progress) {
      read_options.progress = [](double f) { std::fprintf(stderr, "\rreading trace %5.1f%%", f * 100); };
    }
    const trace::Snapshot snapshot = trace::read_snapshot(trace_path, read_options);
    if (progress) {
      std::fprintf(stderr, "\r%30s\r", "");
    }
    std::string name = trace_path.substr(trace_path.find_last_of('/') + 1);
    const replay::PreparedTrace prepared =
        replay::prepare(snapshot, name, device >= 0 ? std::optional<int>(device) : std::nullopt);
#ifdef CACHEALLOC_REPLAY_WITH_CUDA
    if (on_gpu) {
      replay::CudaCommand command;
      command.trace_path = trace_path;
      command.rows = policies;
      command.conf_of = conf_of;
      command.json_path = json_path;
      command.gpu = gpu;
      command.sample_every = sample_every;
      command.check_every = check_every;
      command.progress = progress;
      return replay::run_cuda_command(prepared, command);
    }
#endif

    std::vector<replay::PolicyResult> results;
    for (const std::string& p : policies) {
      replay::ReplayOptions opts;
      opts.capacity = capacity;
      opts.check_every = check_every;
      opts.plot_points = plot_path.empty() ? 0 : 2000;
      opts.phases = phases;
      opts.gpu_lag_us = gpu_lag_us;
      opts.query_lag_us = query_lag_us;
      opts.stream_lags = stream_lags;
      opts.late_frees_on_other_stream = late_other;
      opts.call_costs = costs;
      std::string conf;
      if (auto it = conf_of.find(p); it != conf_of.end()) {
        conf = it->second;
      } else if (p == "native") {
        conf = replay::native_conf_from_settings(prepared.settings);
        opts.check_fidelity = !prepared.segments.empty();
      }
      if (progress) {
        opts.progress = [&p](double f) {
          std::fprintf(stderr, "\rreplaying %-12s %5.1f%%", p.c_str(), f * 100);
        };
      }
      try {
        results.push_back(replay::run(prepared, p, conf, opts));
      } catch (const ConfigError&) {
        throw;
      } catch (const Error& e) {
        replay::PolicyResult failed;
        failed.name = p;
        failed.conf = conf;
        failed.error = e.what();
        results.push_back(failed);
      }
      if (progress) {
        std::fprintf(stderr, "\r%40s\r", "");
      }
    }

    // The table.
    std::printf("trace %s: %s events, %u allocations, device %d, simulated capacity %s\n",
                name.c_str(), with_commas(prepared.trace_events).c_str(), prepared.slots,
                prepared.device, format_bytes(capacity).c_str());
    if (!call_costs.empty()) {
      std::printf("simulated call costs (us):");
      const auto defaults = replay::call_cost_kinds(SimCallCosts{});
      const auto used = replay::call_cost_kinds(costs);
      for (std::size_t i = 0; i < used.size(); ++i) {
        std::printf(" %s %g%s", used[i].first.c_str(), used[i].second,
                    used[i].second != defaults[i].second ? " (set)" : "");
      }
      std::printf("\n");
    }
    std::printf("%-11s %18s %18s %7s %9s %9s %8s %8s %7s %12s\n", "policy", "peak reserved",
                "peak requested", "ratio", "reserves", "releases", "maps", "unmaps", "failed",
                "events/s");
    const double req = static_cast<double>(prepared.peak_requested);
    if (!prepared.segments.empty()) {
      std::printf("%-11s %18s %18s %7.3f %9s %9s %8s %8s %7s %12s\n", "recorded",
                  with_commas(prepared.recorded_peak_reserved).c_str(),
                  with_commas(prepared.peak_requested).c_str(),
                  static_cast<double>(prepared.recorded_peak_reserved) / req, "-", "-", "-", "-", "-", "-");
    }
    for (const replay::PolicyResult& r : results) {
      if (!r.error.empty()) {
        std::printf("%-11s failed: %s\n", r.name.c_str(), r.error.c_str());
        continue;
      }
      std::printf("%-11s %18s %18s %7.3f %9llu %9llu %8llu %8llu %7llu %12s\n", r.name.c_str(),
                  with_commas(r.peak_reserved).c_str(), with_commas(prepared.peak_requested).c_str(),
                  static_cast<double>(r.peak_reserved) / req,
                  static_cast<unsigned long long>(r.device_reserve_calls),
                  static_cast<unsigned long long>(r.device_release_calls),
                  static_cast<unsigned long long>(r.map_calls),
                  static_cast<unsigned long long>(r.unmap_calls),
                  static_cast<unsigned long long>(r.failed_allocations),
                  with_commas(static_cast<std::uint64_t>(r.events_per_second)).c_str());
    }
    for (const replay::PolicyResult& r : results) {
      if (!r.conf.empty()) {
        std::printf("  %s ran with CACHEALLOC_CONF=%s\n", r.name.c_str(), r.conf.c_str());
      }
      if (!r.detail.empty()) {
        std::printf("  %s: %s\n", r.name.c_str(), r.detail.c_str());
      }
      if (r.fidelity) {
        const replay::Fidelity& f = *r.fidelity;
        if (!f.first_divergence_event) {
          std::printf("  fidelity: %s made the same %llu device reservations as the recorded run "
                      "(MATCH)\n", r.name.c_str(), static_cast<unsigned long long>(f.model_segments));
        } else {
          std::printf("  fidelity: %s DIVERGES from the recorded run at trace event %llu: %s "
                      "(recorded %llu reservations, model %llu)\n",
                      r.name.c_str(), static_cast<unsigned long long>(*f.first_divergence_event),
                      f.detail.c_str(), static_cast<unsigned long long>(f.recorded_segments),
                      static_cast<unsigned long long>(f.model_segments));
        }
      }
    }
    if (explain) {
      for (const replay::PolicyResult& r : results) {
        if (r.error.empty() && r.name.rfind("defrag", 0) == 0) {
          print_history(r);
          print_budget(r);
        }
      }
    }
    if (phases != 0) {
      std::printf("device calls per 1/%u of the operations (reserves + creates + releases + maps + "
                  "unmaps; maps/unmaps in brackets where any):\n", phases);
      for (const replay::PolicyResult& r : results) {
        if (!r.error.empty()) {
          continue;
        }
        std::printf("  %-11s", r.name.c_str());
        for (const replay::Phase& ph : r.phases) {
          if (ph.maps + ph.unmaps != 0) {
            std::printf(" %llu[%llu/%llu]", static_cast<unsigned long long>(ph.device_calls),
                        static_cast<unsigned long long>(ph.maps),
                        static_cast<unsigned long long>(ph.unmaps));
          } else {
            std::printf(" %llu", static_cast<unsigned long long>(ph.device_calls));
          }
        }
        std::printf("\n");
      }
    }
    if (prepared.stream_peaks.size() > 1) {
      // Note [What keeping streams apart costs] (replay.cpp).
      std::printf("streams: %zu; each one's own peak of requested bytes:", prepared.stream_peaks.size());
      for (const auto& [stream, bytes] : prepared.stream_peaks) {
        std::printf(" %s (stream %#llx)", with_commas(bytes).c_str(),
                    static_cast<unsigned long long>(stream));
      }
      std::printf("\n  their sum is %.3fx the peak requested: the least an allocator holds that keeps "
                  "each stream's free memory for that stream\n",
                  static_cast<double>(replay::stream_peaks_sum(prepared)) / req);
      // What the frees handed between streams and defrag's epochs cost in events: on a GPU about
      // a microsecond of host time each, which the simulated clock does not charge. Queries are
      // printed only with --late-frees-on-other-stream: otherwise the replay gives every late free
      // a stream of its own (Player::apply), so it queries once per parked block where a GPU
      // job's front end queries once per busy stream. With it, two of session 42's GPU
      // recordings replay with queries within 11% of what their jobs made on the GPU, records
      // within 26% (h100_s42 offload_train_r2: 1,975 queries and 648 records per 1,000
      // allocations against 1,776 and 627 in bench/e2e; pipeline304_defrag_r1: 104 and 49 against
      // 108 and 66; bench/results/defrag_session43_2026-12-06.md).
      const double allocs = static_cast<double>(std::max<std::uint32_t>(prepared.slots, 1));
      auto per_thousand = [&](const char* what, auto count) {
        std::printf("%s per 1,000 allocations:", what);
        for (const replay::PolicyResult& r : results) {
          if (r.error.empty()) {
            std::printf(" %s %.0f", r.name.c_str(), 1000.0 * static_cast<double>(count(r)) / allocs);
          }
        }
        std::printf("\n");
      };
      per_thousand("events recorded", [](const replay::PolicyResult& r) { return r.events_recorded; });
      if (late_other) {
        per_thousand("event queries", [](const replay::PolicyResult& r) { return r.event_queries; });
      }
    }
    if (prepared.peak_live_pending > prepared.peak_requested) {
      std::printf("live + pending: peak %s bytes, %.3fx the peak requested: blocks freed while another "
                  "stream still used them stay unusable until their free_completed, so no policy "
                  "replayed here holds less\n",
                  with_commas(prepared.peak_live_pending).c_str(),
                  static_cast<double>(prepared.peak_live_pending) / req);
    }
    if (stream_lags) {
      if (prepared.stream_lags.empty()) {
        std::printf("stream lags: the trace has no late free to sample them from; every stream "
                    "lags %llu us\n", static_cast<unsigned long long>(gpu_lag_us));
      }
      for (const auto& [stream, busy] : prepared.stream_lags) {
        std::vector<std::uint64_t> ahead;  // how far each late free's completion was ahead of it
        for (const auto& [requested, until] : busy) {
          ahead.push_back(until - requested);
        }
        std::sort(ahead.begin(), ahead.end());
        std::printf("stream %#llx busy by %zu late frees of other streams' blocks (Note [Each stream's own "
                    "lag]): behind the host by a median %.1f ms, 90th percentile %.1f ms, most %.1f ms\n",
                    static_cast<unsigned long long>(stream), ahead.size(),
                    static_cast<double>(ahead[ahead.size() / 2]) / 1000,
                    static_cast<double>(ahead[ahead.size() * 9 / 10]) / 1000,
                    static_cast<double>(ahead.back()) / 1000);
      }
    }
    std::fputs(replay::skipped_frees_note(prepared).c_str(), stdout);

    if (!json_path.empty()) {
      nlohmann::json j;
      j["trace"] = trace_path;
      j["events"] = prepared.trace_events;
      j["capacity_bytes"] = capacity;
      j["call_costs_us"] = nlohmann::json::object();
      for (const auto& [kind, us] : replay::call_cost_kinds(costs)) {
        j["call_costs_us"][kind] = us;
      }
      j["recorded"] = {{"peak_reserved_bytes", prepared.recorded_peak_reserved},
                       {"segments", prepared.segments.size()}};
      j["peak_requested_bytes"] = prepared.peak_requested;
      j["stream_peaks"] = nlohmann::json::array();
      for (const auto& [stream, bytes] : prepared.stream_peaks) {
        j["stream_peaks"].push_back({{"stream", stream}, {"peak_requested_bytes", bytes}});
      }
      j["stream_peaks_sum_bytes"] = replay::stream_peaks_sum(prepared);
      j["peak_live_pending_bytes"] = prepared.peak_live_pending;
      j["stream_lags"] = stream_lags;
      j["late_frees_on_other_stream"] = late_other;
      j["policies"] = nlohmann::json::array();
      for (const replay::PolicyResult& r : results) {
        nlohmann::json p;
        p["name"] = r.name;
        p["conf"] = r.conf;
        if (!r.error.empty()) {
          p["error"] = r.error;
        } else {
          p["peak_reserved_bytes"] = r.peak_reserved;
          p["peak_requested_bytes"] = prepared.peak_requested;
          p["ratio"] = static_cast<double>(r.peak_reserved) / req;
          p["device_reserve_calls"] = r.device_reserve_calls;
          p["device_release_calls"] = r.device_release_calls;
          p["map_calls"] = r.map_calls;
          p["unmap_calls"] = r.unmap_calls;
          p["parked_waits"] = r.parked_waits;
          p["parked_reuses"] = r.parked_reuses;
          p["parked_wait_ns"] = r.parked_wait_ns;
          p["mapped_bytes"] = r.mapped_bytes;
          p["events_recorded"] = r.events_recorded;
          // Per parked block and poll unless late_frees_on_other_stream (see the summary above).
          p["event_queries"] = r.event_queries;
          p["failed_allocations"] = r.failed_allocations;
          p["events_per_second"] = r.events_per_second;
          p["simulated_call_ns"] = r.charged_ns;  // what its device calls cost the simulated host
          p["replay_seconds"] = r.seconds;
          if (!r.detail.empty()) {
            p["detail"] = r.detail;
          }
          if (explain && r.name.rfind("defrag", 0) == 0) {
            p["slack_history"] = nlohmann::json::array();
            for (const replay::HistoryEvent& e : r.history) {
              p["slack_history"].push_back({{"event", e.id}, {"label", e.what}, {"time_s", e.time_s},
                                            {"slack_before", e.slack_before}, {"slack_after", e.slack_after},
                                            {"live_bytes", e.live_bytes},
                                            {"peak_live_bytes", e.peak_live_bytes},
                                            {"reserved_bytes", e.reserved_bytes}, {"pages", e.pages},
                                            {"parked_bytes", e.parked_bytes}, {"unsafe_pages", e.unsafe_pages},
                                            {"unsafe_other_pages", e.unsafe_other_pages}});
            }
            p["slack_history_dropped"] = r.history_dropped;
            // Note [A history of the time budget]
            p["costly_growths"] = nlohmann::json::array();
            for (const CostlyGrowth& g : r.growths) {
              p["costly_growths"].push_back({{"time_s", static_cast<double>(g.time_ns) / 1e9}, {"took_ns", g.took_ns},
                                             {"waited_ns", g.waited_ns}, {"waits", g.waits},
                                             {"pages_moved", g.pages_moved}, {"pages_created", g.pages_created},
                                             {"stream", g.stream}, {"new_peak", g.new_peak}, {"pending", g.pending}});
            }
            p["costly_growths_dropped"] = r.growths_dropped;
            p["budget_windows"] = nlohmann::json::array();
            for (const BudgetWindow& w : r.windows) {
              p["budget_windows"].push_back({{"open_s", static_cast<double>(w.open_ns) / 1e9},
                                             {"close_s", static_cast<double>(w.close_ns) / 1e9},
                                             {"growths", w.growths}, {"charged_ns", w.charged_ns},
                                             {"waited_ns", w.waited_ns}, {"spent_ns", w.spent_ns},
                                             {"allowed_ns", w.allowed_ns}, {"uncharged_waits", w.uncharged_waits},
                                             {"uncharged_wait_ns", w.uncharged_wait_ns},
                                             {"slack_after", w.slack_after},
                                             {"close", std::string(window_close_id(w.close))},
                                             {"verdict", std::string(window_verdict_id(w.verdict))}});
            }
            p["budget_windows_dropped"] = r.windows_dropped;
          }
          if (!r.phases.empty()) {
            p["phases"] = nlohmann::json::array();
            for (const replay::Phase& ph : r.phases) {
              p["phases"].push_back({{"end_op", ph.end_op}, {"device_calls", ph.device_calls},
                                     {"maps", ph.maps}, {"unmaps", ph.unmaps},
                                     {"reserved_bytes", ph.reserved}});
            }
          }
        }
        if (r.fidelity) {
          p["fidelity"] = {{"recorded_segments", r.fidelity->recorded_segments},
                           {"model_segments", r.fidelity->model_segments},
                           {"first_divergence_event",
                            r.fidelity->first_divergence_event
                                ? nlohmann::json(*r.fidelity->first_divergence_event)
                                : nlohmann::json(nullptr)}};
        }
        j["policies"].push_back(p);
      }
      std::ofstream out(json_path);
      if (!out) {
        throw Error("cannot write --json file '" + json_path + "'");
      }
      out << j.dump(2) << "\n";
    }
    if (!plot_path.empty()) {
      replay::write_plot(plot_path, prepared, results);
      std::printf("  plot written to %s\n", plot_path.c_str());
    }
    for (const replay::PolicyResult& r : results) {
      if (!r.error.empty()) {
        return 1;
      }
    }
    return 0;
  } catch (const trace::TraceError& e) {
    std::cerr << "cachealloc-replay: cannot read the trace: " << e.what() << "\n";
    return 3;
  } catch (const ConfigError& e) {
    std::cerr << "cachealloc-replay: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "cachealloc-replay: " << e.what() << "\n";
    return 1;
  }
}
