// replay.cpp: turning snapshots into operations and replaying them (see replay.h).
#include "replay.h"

#include <cachealloc/config.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>
#ifdef CACHEALLOC_HAS_NATIVE
#include <cachealloc/policies/native.h>
#endif
#ifdef CACHEALLOC_HAS_DEFRAG
#include <cachealloc/policies/defrag.h>
#endif
#ifdef CACHEALLOC_HAS_ASYNC
#include <cachealloc/policies/async.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <iterator>
#include <string>
#include <unordered_map>
#include <utility>

namespace cachealloc::replay {
namespace {

/// Private streams for deferred frees (Note [Replaying frees]); far from any real cudaStream_t.
constexpr StreamId kDeferredStreamBase = 0xFFFF'0000'0000'0000ull;

bool is_segment_action(trace::Action a) {
  return a == trace::Action::segment_alloc || a == trace::Action::segment_free ||
         a == trace::Action::segment_map || a == trace::Action::segment_unmap;
}

}  // namespace

PreparedTrace prepare(const trace::Snapshot& snapshot, std::string name, std::optional<int> device) {
  PreparedTrace t;
  t.name = std::move(name);
  t.settings = snapshot.settings;
  if (!device) {
    std::vector<std::uint64_t> counts(std::max<std::size_t>(snapshot.device_count, 1), 0);
    for (const trace::TraceEvent& e : snapshot.events) {
      if (e.device >= 0 && static_cast<std::size_t>(e.device) < counts.size()) {
        ++counts[static_cast<std::size_t>(e.device)];
      }
    }
    device = static_cast<int>(std::max_element(counts.begin(), counts.end()) - counts.begin());
  }
  t.device = *device;

  // Pass 1: index the entries of this device.
  std::vector<const trace::TraceEvent*> events;
  events.reserve(snapshot.events.size());
  for (const trace::TraceEvent& e : snapshot.events) {
    if (e.device == *device) {
      events.push_back(&e);
    }
  }
  t.trace_events = events.size();

  // Pass 2: resolve addresses to slots; find which frees were deferred.
  std::unordered_map<std::uint64_t, std::uint32_t> live;  // addr -> slot
  live.reserve(1024);
  std::vector<std::uint64_t> slot_size;
  std::vector<std::int64_t> requested_at;  // slot -> index of its free_requested op
  std::vector<std::uint32_t> slot_stream;  // slot -> index in t.stream_peaks
  std::vector<std::uint64_t> stream_live;  // per index in t.stream_peaks
  std::uint64_t requested = 0;
  std::uint64_t reserved = 0;
  t.ops.reserve(events.size());
  struct Awaiting {
    std::uint32_t slot;
    std::uint64_t requested_us;  // when the tensor died
    std::uint64_t stream;        // the stream that allocated it
  };
  std::unordered_map<std::uint64_t, Awaiting> awaiting;  // addr -> freed, not completed
  struct LagSample {
    std::uint64_t requested_us, completed_us, alloc_stream;
  };
  std::vector<LagSample> lag_samples;  // Note [Each stream's own lag]
  std::uint64_t pending = 0;           // bytes of blocks freed late, not completed yet
  // Note [Simulated time] (sim_backend.h): times relative to the first entry that has one.
  std::int64_t origin = 0;
  for (const trace::TraceEvent* e : events) {
    if (e->time_us > 0) {
      origin = e->time_us;
      break;
    }
  }
  const auto at = [origin](const trace::TraceEvent& e) -> std::uint64_t {
    return e.time_us > origin ? static_cast<std::uint64_t>(e.time_us - origin) : 0;
  };
  for (std::size_t i = 0; i < events.size(); ++i) {
    const trace::TraceEvent& e = *events[i];
    switch (e.action) {
      case trace::Action::alloc: {
        const std::uint32_t slot = t.slots++;
        live[e.addr] = slot;
        slot_size.push_back(e.size);
        requested_at.push_back(-1);
        requested += e.size;
        t.peak_requested = std::max(t.peak_requested, requested);
        t.peak_live_pending = std::max(t.peak_live_pending, requested + pending);
        std::uint32_t k = 0;
        while (k < t.stream_peaks.size() && t.stream_peaks[k].first != e.stream) {
          ++k;  // few streams: a linear search
        }
        if (k == t.stream_peaks.size()) {
          t.stream_peaks.emplace_back(e.stream, 0);
          stream_live.push_back(0);
        }
        slot_stream.push_back(k);
        stream_live[k] += e.size;
        t.stream_peaks[k].second = std::max(t.stream_peaks[k].second, stream_live[k]);
        t.ops.push_back({OpKind::alloc, slot, e.size, e.stream, at(e)});
        break;
      }
      case trace::Action::free_requested: {
        auto it = live.find(e.addr);
        if (it == live.end()) {
          ++t.unmatched_frees;  // allocated before history recording started
          break;
        }
        const std::uint32_t slot = it->second;
        live.erase(it);
        requested -= slot_size[slot];
        stream_live[slot_stream[slot]] -= slot_size[slot];
        // Adjacent free_completed for the same address: an ordinary free.
        const bool immediate = i + 1 < events.size() &&
                               events[i + 1]->action == trace::Action::free_completed &&
                               events[i + 1]->addr == e.addr;
        if (immediate) {
          t.ops.push_back({OpKind::free, slot, 0, 0, at(e)});
          ++i;  // the free_completed is part of this free
        } else {
          t.ops.push_back({OpKind::free_deferred, slot, 0, 0, at(e)});
          awaiting[e.addr] = Awaiting{slot, at(e), t.stream_peaks[slot_stream[slot]].first};
          pending += slot_size[slot];
        }
        break;
      }
      case trace::Action::free_completed: {
        auto it = awaiting.find(e.addr);
        if (it == awaiting.end()) {
          ++t.unmatched_frees;
          break;
        }
        const Awaiting& w = it->second;
        pending -= slot_size[w.slot];
        t.ops.push_back({OpKind::free_completed, w.slot, 0, 0, at(e)});
        lag_samples.push_back({w.requested_us, std::max(at(e), w.requested_us), w.stream});
        awaiting.erase(it);
        break;
      }
      default:
        if (is_segment_action(e.action)) {
          t.segments.push_back({e.action, e.size, i, e.addr});
          if (e.action == trace::Action::segment_alloc || e.action == trace::Action::segment_map) {
            reserved += e.size;
            t.recorded_peak_reserved = std::max(t.recorded_peak_reserved, reserved);
          } else {
            reserved = reserved >= e.size ? reserved - e.size : 0;
          }
        }
        break;
    }
  }
  std::sort(lag_samples.begin(), lag_samples.end(),
            [](const LagSample& a, const LagSample& b) { return a.requested_us < b.requested_us; });
  for (const auto& [stream, peak] : t.stream_peaks) {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> busy;  // (requested, busy until)
    std::uint64_t until = 0;
    for (const LagSample& s : lag_samples) {
      if (s.alloc_stream != stream) {
        until = std::max(until, s.completed_us);
        busy.emplace_back(s.requested_us, until);
      }
    }
    if (!busy.empty()) {
      t.stream_lags.emplace_back(stream, std::move(busy));
    }
  }
  return t;
}

// Note [What keeping streams apart costs]
// PyTorch's caching allocator, with or without expandable segments, keeps a stream's free memory
// for that stream (a block comes back to the stream that allocated it, and only once every other
// stream that used it finished), so at any moment each stream holds at least its own live bytes,
// and over a run at least its own peak: the sum of the streams' peaks, not the peak of their
// sum, bounds what it holds unless it gives cached memory back to the device (at an
// out-of-memory retry). An allocator goes below it only by handing free memory across streams:
// after events show the other stream finished, by moving pages (defrag), or by making one stream
// wait for the other on the GPU (cudaMallocAsync's pools with internal dependencies allowed).
// The replay prints that sum as a floor next to the table. Measured (peak requested = 1):
// mlp_two_streams 1.012, the e2e pipeline recording 1.072 (bench/e2e/recordings); every
// one-stream trace 1.
std::uint64_t stream_peaks_sum(const PreparedTrace& trace) {
  std::uint64_t sum = 0;
  for (const auto& [stream, bytes] : trace.stream_peaks) {
    sum += bytes;
  }
  return sum;
}

std::string skipped_frees_note(const PreparedTrace& trace) {
  if (trace.unmatched_frees == 0) {
    return {};
  }
  return "  note: " + std::to_string(trace.unmatched_frees) +
         " frees of blocks allocated before recording started were skipped\n";
}

namespace {
/// The --call-cost kinds and the SimCallCosts field each sets.
constexpr std::pair<const char*, std::uint64_t SimCallCosts::*> kCallCostFields[] = {
    {"reserve", &SimCallCosts::reserve_ns},
    {"release", &SimCallCosts::release_ns},
    {"create", &SimCallCosts::create_ns},
    {"release_physical", &SimCallCosts::release_physical_ns},
    {"map", &SimCallCosts::map_ns},
    {"unmap", &SimCallCosts::unmap_ns},
    {"unmap_now", &SimCallCosts::unmap_now_ns},
    {"pool_op", &SimCallCosts::pool_op_ns},
};
}  // namespace

std::vector<std::pair<std::string, double>> call_cost_kinds(const SimCallCosts& costs) {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [name, field] : kCallCostFields) {
    out.emplace_back(name, static_cast<double>(costs.*field) / 1000.0);
  }
  return out;
}

void apply_call_cost(SimCallCosts& costs, const std::string& spec) {
  const auto eq = spec.find('=');
  const std::string kind = spec.substr(0, eq);
  for (const auto& [name, field] : kCallCostFields) {
    if (kind != name) {
      continue;
    }
    const std::string value = eq == std::string::npos ? std::string() : spec.substr(eq + 1);
    const double us = parse_finite_double(value).value_or(-1);
    // At most an hour per call: beyond that the simulated clock would overflow in a long trace.
    if (!(us >= 0) || us > 3.6e9) {
      throw ConfigError("--call-cost " + spec + ": expected " + kind +
                        "=MICROSECONDS, a number from 0 to 3600000000, e.g. " + kind + "=55");
    }
    costs.*field = static_cast<std::uint64_t>(us * 1000.0 + 0.5);
    return;
  }
  std::string kinds;
  for (const auto& [name, field] : kCallCostFields) {
    kinds += kinds.empty() ? name : std::string(", ") + name;
  }
  throw ConfigError("--call-cost " + spec + ": unknown kind '" + kind +
                    "'; expected KIND=MICROSECONDS with KIND one of " + kinds);
}

std::string native_conf_from_settings(const trace::AllocatorSettings& s) {
  std::string conf;
  if (!s.present) {
    return conf;
  }
  auto add = [&](const std::string& entry) { conf += (conf.empty() ? "" : ",") + entry; };
  if (s.max_split_size > 0 && s.max_split_size != std::numeric_limits<std::int64_t>::max()) {
    add("max_split_size_mb:" + std::to_string(s.max_split_size / static_cast<std::int64_t>(kMiB)));
  }
  if (s.garbage_collection_threshold > 0) {
    add("garbage_collection_threshold:" + std::to_string(s.garbage_collection_threshold));
  }
  if (s.expandable_segments) {
    add("expandable_segments:True");
  }
  // In PyTorch's list form the first interval named also covers every interval below it, so once
  // any entry is non-zero all of them are written, zeros included, to keep their meaning.
  const bool any = std::any_of(s.roundup_power2_divisions.begin(), s.roundup_power2_divisions.end(),
                               [](const auto& e) { return e.second != 0; });
  std::string divisions;
  for (const auto& [interval, div] : s.roundup_power2_divisions) {
    if (any) {
      divisions += (divisions.empty() ? "" : ",") + std::to_string(interval) + ":" + std::to_string(div);
    }
  }
  if (!divisions.empty()) {
    add("roundup_power2_divisions:[" + divisions + "]");
  }
  return conf;
}

Fidelity compare_segments(const PreparedTrace& trace,
                          const std::vector<std::pair<trace::Action, std::uint64_t>>& model) {
  Fidelity f;
  f.recorded_segments = trace.segments.size();
  f.model_segments = model.size();
  const std::size_t n = std::min(trace.segments.size(), model.size());
  for (std::size_t i = 0; i < n; ++i) {
    const SegmentEntry& r = trace.segments[i];
    if (r.action != model[i].first || r.size != model[i].second) {
      f.first_divergence_event = r.trace_index;
      f.detail = "reservation " + std::to_string(i) + ": recorded " +
                 std::string(trace::to_string(r.action)) + " of " + std::to_string(r.size) +
                 " bytes, model " + std::string(trace::to_string(model[i].first)) + " of " +
                 std::to_string(model[i].second) + " bytes";
      return f;
    }
  }
  if (trace.segments.size() != model.size()) {
    f.first_divergence_event = n < trace.segments.size() ? trace.segments[n].trace_index
                                                         : trace.trace_events;
    f.detail = "the recorded run made " + std::to_string(trace.segments.size()) +
               " reservations, the model " + std::to_string(model.size());
  }
  return f;
}

Player::Player(const PreparedTrace& trace, DeviceAllocator& allocator, SimBackend& sim, bool other_stream)
    : allocator_(allocator), sim_(sim), ptrs_(trace.slots, nullptr), other_stream_(other_stream) {
  if (!other_stream_) {
    return;
  }
  // Note [Late frees on the other stream]
  std::vector<std::uint64_t> seen;
  for (const Op& op : trace.ops) {
    if (op.kind == OpKind::alloc && std::find(seen.begin(), seen.end(), op.stream) == seen.end()) {
      seen.push_back(op.stream);
    }
  }
  if (seen.size() != 2) {
    throw ConfigError("--late-frees-on-other-stream: the trace " + trace.name + " allocates on " +
                      std::to_string(seen.size()) +
                      " stream(s); it needs exactly two (with more, the stream a late free waited "
                      "for is not known): leave the flag out for this trace");
  }
  streams_ = {seen[0], seen[1]};
  slot_stream_.assign(trace.slots, 0);
}

void Player::apply(const Op& op) {
  sim_.advance_clock_to(op.time_us * 1000);  // Note [Simulated time]
  void*& ptr = ptrs_[op.slot];
  switch (op.kind) {
    case OpKind::alloc:
      ptr = nullptr;
      ptr = allocator_.allocate(op.size, op.stream);
      if (other_stream_) {
        slot_stream_[op.slot] = op.stream;
      }
      break;
    case OpKind::free:
      allocator_.deallocate(ptr);
      ptr = nullptr;
      break;
    case OpKind::free_deferred:
      if (ptr != nullptr && other_stream_) {  // Note [Late frees on the other stream]
        const std::uint64_t own = slot_stream_[op.slot];
        allocator_.record_stream(ptr, own == streams_[0] ? streams_[1] : streams_[0]);
        allocator_.deallocate(ptr);
        ptr = nullptr;
      } else if (ptr != nullptr) {
        allocator_.record_stream(ptr, kDeferredStreamBase + op.slot);
        sim_.hold_stream(kDeferredStreamBase + op.slot);
        held_.push_back(op.slot);
        allocator_.deallocate(ptr);
        ptr = nullptr;
      }
      break;
    case OpKind::free_completed:
      if (!other_stream_) {
        sim_.release_stream(kDeferredStreamBase + op.slot);
      }
      break;
  }
}

void Player::finish() {
  for (void*& p : ptrs_) {
    allocator_.deallocate(p);
    p = nullptr;
  }
  for (std::uint32_t slot : held_) {
    sim_.release_stream(kDeferredStreamBase + slot);
  }
  held_.clear();
}

PolicyResult run(const PreparedTrace& trace, const std::string& policy, const std::string& conf,
                 const ReplayOptions& options) {
  PolicyResult r;
  r.name = policy;
  r.conf = conf;
  SimOptions sim_options;
  sim_options.capacity = options.capacity;
  sim_options.device = trace.device;
  sim_options.auto_complete_events = true;  // Note [Simulated events] (sim_backend.h)
  sim_options.model_call_costs = true;      // Note [Simulated time]
  sim_options.event_lag_ns = options.gpu_lag_us * 1000;
  sim_options.query_look_ns = options.query_lag_us * 1000;
  sim_options.costs = options.call_costs;
  if (options.stream_lags && !trace.stream_lags.empty()) {
    // Note [Each stream's own lag]: busy until the latest completion of the late frees requested
    // by now, and never less than the fixed lag.
    sim_options.stream_lag = [&lags = trace.stream_lags, floor_ns = sim_options.event_lag_ns](
                                 StreamId stream, std::uint64_t clock_ns) -> std::optional<std::uint64_t> {
      for (const auto& [s, busy] : lags) {
        if (s != stream) {
          continue;
        }
        const std::uint64_t now_us = clock_ns / 1000;
        auto it = std::upper_bound(busy.begin(), busy.end(), now_us,
                                   [](std::uint64_t t, const auto& b) { return t < b.first; });
        const std::uint64_t until = it == busy.begin() ? 0 : std::prev(it)->second;
        return std::max(floor_ns, until > now_us ? (until - now_us) * 1000 : 0);
      }
      return std::nullopt;
    };
  }
  auto backend = std::make_unique<SimBackend>(sim_options);
  SimBackend& sim = *backend;
  if (policy == "native") {
    // Best-fit ties in PyTorch's allocator go to the lower address: give the model the recorded
    // run's reservation addresses so it breaks ties as the real device did (until it diverges).
    std::vector<std::pair<std::size_t, std::uintptr_t>> script;
    for (const SegmentEntry& seg : trace.segments) {
      if (seg.action == trace::Action::segment_alloc) {
        script.emplace_back(seg.size, seg.addr);
      }
    }
    sim.script_reservations(std::move(script));
  }
  Config config = Config::parse(conf);
  (void)config.take_string("policy");
  std::unique_ptr<DeviceAllocator> allocator = make_allocator(policy, std::move(backend), config);
  std::vector<std::string_view> valid = front_end_config_keys();
  if (const PolicyInfo* info = find_policy(policy)) {
    for (std::string_view k : info->config_keys()) {
      valid.push_back(k);
    }
  }
  config.finish("policy " + policy, valid);

#ifdef CACHEALLOC_HAS_NATIVE
  NativePolicy* native = nullptr;
  if (options.check_fidelity) {
    if (auto* a = dynamic_cast<CachingAllocator<NativePolicy>*>(allocator.get())) {
      native = &a->policy();
      native->set_record_segments(true);
    }
  }
#endif

  DeviceAllocator& alloc = *allocator;
  Player player(trace, alloc, sim, options.late_frees_on_other_stream);
  const std::size_t n = trace.ops.size();
  const std::size_t sample_every =
      options.plot_points == 0 ? 0 : std::max<std::size_t>(1, n / options.plot_points);
  std::uint64_t requested = 0;
  std::vector<std::uint64_t> slot_sizes;
  if (sample_every != 0) {
    slot_sizes.assign(trace.slots, 0);
  }
  const auto start = std::chrono::steady_clock::now();
  auto last_progress = start;
  for (std::size_t i = 0; i < n; ++i) {
    const Op& op = trace.ops[i];
    try {
      player.apply(op);
    } catch (const OutOfMemory&) {
      ++r.failed_allocations;
    }
    if (sample_every != 0) {
      if (op.kind == OpKind::alloc) {
        slot_sizes[op.slot] = op.size;
        requested += op.size;
      } else if (op.kind == OpKind::free || op.kind == OpKind::free_deferred) {
        requested -= slot_sizes[op.slot];
      }
    }
    if (sample_every != 0 && i % sample_every == 0) {
      r.samples.push_back({i, static_cast<std::uint64_t>(alloc.stats().reserved_bytes.current), requested});
    }
    if (options.check_every != 0 && i % options.check_every == 0) {
      alloc.check_invariants();
    }
    if (options.phases != 0 && (i + 1) * options.phases / n != i * options.phases / n) {
      const BackendCounters& c = sim.counters();
      Phase ph;
      ph.end_op = i + 1;
      ph.maps = c.map_calls;
      ph.unmaps = c.unmap_calls;
      ph.device_calls = c.reserve_calls + c.physical_creates + c.release_calls +
                        c.physical_releases + c.map_calls + c.unmap_calls;
      ph.reserved = static_cast<std::uint64_t>(alloc.stats().reserved_bytes.current);
      r.phases.push_back(ph);  // cumulative here, made per slice below
    }
    if ((i & 0xFFFF) == 0xFFFF && options.progress) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_progress > std::chrono::milliseconds(500)) {
        options.progress(static_cast<double>(i) / static_cast<double>(n));
        last_progress = now;
      }
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  r.seconds = std::chrono::duration<double>(stop - start).count();
  r.events_per_second = r.seconds > 0 ? static_cast<double>(trace.trace_events) / r.seconds : 0;
  r.charged_ns = sim.charged_ns();

  for (std::size_t k = r.phases.size(); k-- > 1;) {
    r.phases[k].device_calls -= r.phases[k - 1].device_calls;
    r.phases[k].maps -= r.phases[k - 1].maps;
    r.phases[k].unmaps -= r.phases[k - 1].unmaps;
  }
  const Stats s = alloc.stats();
  r.peak_reserved = static_cast<std::uint64_t>(s.reserved_bytes.peak);
  r.peak_requested = static_cast<std::uint64_t>(s.requested_bytes.peak);
  r.peak_allocated = static_cast<std::uint64_t>(s.allocated_bytes.peak);
  r.parked_waits = s.parked_waits;  // wait_parked_to_grow (Note [Waiting for frees in flight ...])
  r.parked_reuses = s.parked_reuses;  // reuse_parked (Note [Reusing a parked free on the stream it waits for])
  r.parked_wait_ns = s.parked_wait_ns;
  const BackendCounters& c = sim.counters();
  r.device_reserve_calls = c.reserve_calls + c.physical_creates;
  r.device_release_calls = c.release_calls + c.physical_releases;
  r.map_calls = c.map_calls;
  r.unmap_calls = c.unmap_calls;
  r.mapped_bytes = c.mapped_bytes;
  r.events_recorded = c.events_recorded;
  r.event_queries = c.event_queries;
#ifdef CACHEALLOC_HAS_NATIVE
  if (native != nullptr) {
    std::vector<std::pair<trace::Action, std::uint64_t>> model;
    for (const SegmentEvent& e : native->segment_events()) {
      trace::Action a = trace::Action::segment_alloc;
      switch (e.kind) {
        case SegmentEvent::alloc: a = trace::Action::segment_alloc; break;
        case SegmentEvent::free: a = trace::Action::segment_free; break;
        case SegmentEvent::map: a = trace::Action::segment_map; break;
        case SegmentEvent::unmap: a = trace::Action::segment_unmap; break;
      }
      model.emplace_back(a, e.size);
    }
    r.fidelity = compare_segments(trace, model);
  }
#endif
#ifdef CACHEALLOC_HAS_DEFRAG
  if (auto* a = dynamic_cast<CachingAllocator<DefragPolicy>*>(&alloc)) {
    const DefragCounters d = a->policy().counters();
    char line[400];
    std::snprintf(line, sizeof line,
                  "pages created %llu in %llu chunks, moved %llu in %llu chunks (%llu unmap "
                  "batches), %llu allocations mapped pages, %llu stream waits (%.1f ms), %.1f ms moving, "
                  "slack %.3f (raised %llu times, %llu on time, %llu undone), %llu allocations from recent "
                  "frees (%llu flushes)",
                  static_cast<unsigned long long>(d.pages_created),
                  static_cast<unsigned long long>(d.chunks_created),
                  static_cast<unsigned long long>(d.pages_moved),
                  static_cast<unsigned long long>(d.chunks_moved),
                  static_cast<unsigned long long>(d.unmap_batches),
                  static_cast<unsigned long long>(d.grow_allocations),
                  static_cast<unsigned long long>(d.stream_waits), static_cast<double>(d.wait_ns) / 1e6,
                  static_cast<double>(d.move_ns) / 1e6, d.slack,
                  static_cast<unsigned long long>(d.slack_raises),
                  static_cast<unsigned long long>(d.budget_raises),
                  static_cast<unsigned long long>(d.slack_returns),
                  static_cast<unsigned long long>(d.recent_hits),
                  static_cast<unsigned long long>(d.recent_flushes));
    r.detail = line;
    const std::size_t peak_live = a->policy().peak_live_bytes();
    const std::size_t peak_held = a->policy().peak_held_bytes();
    if (peak_live > peak_held) {  // Note [Frees in flight and the slack]
      const auto mib = [](std::size_t b) { return std::to_string(b / kMiB); };
      r.detail += a->policy().settings().slack_counts_parked
                      ? ", the slack over a peak of " + mib(peak_live) +
                            " MiB live, frees parked for other streams included (held: " + mib(peak_held) +
                            " MiB)"
                      : ", the slack over a peak of " + mib(peak_held) + " MiB held (" + mib(peak_live) +
                            " MiB live with the frees parked for other streams)";
    }
    if (d.held_growths != 0) {  // Note [Waiting for frees in flight instead of growing]
      r.detail += ", " + std::to_string(d.held_growths) +
                  " growths held back while the front end waited for parked frees";
    }
    if (d.pages_moved_pending != 0) {  // move_pending (Note [Moving pages a stream still uses])
      r.detail += ", " + std::to_string(d.pages_moved_pending) +
                  " of the pages moved from holes their stream's work still used";
    }
    if (d.pending_switches != 0) {  // Note [Waits that switch to moving pending]
      r.detail += ", switched to moving pending";
    }
    if (d.placed_past_queued != 0) {  // Note [Placing away from queued unmaps]
      r.detail += ", " + std::to_string(d.placed_past_queued) +
                  " growths placed past a hole whose unmap had not run yet";
    }
    if (d.placed_above_queued != 0) {
      r.detail +=
          " (" + std::to_string(d.placed_above_queued) + " of them above its queued unmaps)";
    }
    if (d.placed_top_at_limit != 0) {  // Note [Growing at the top once moves cost too much at the limit]
      r.detail += ", " + std::to_string(d.placed_top_at_limit) +
                  " growths placed at the top of their range once moves cost too much at the limit";
    }
    if (d.coalesced_growths != 0) {  // Note [Coalescing moved chunks while maps are dear]
      r.detail += ", " + std::to_string(d.coalesced_growths) + " growths coalesced " +
                  std::to_string(d.chunks_coalesced) + " chunks into new handles";
    }
    if (d.placed_at_top != 0) {  // Note [A block that ends with the free pages above it]
      r.detail += ", " + std::to_string(d.placed_at_top) +
                  " growths placed at the top of their hole to use the free pages above it";
    }
    for (const SlackEvent& e : a->policy().slack_history()) {
      r.history.push_back(HistoryEvent{std::string(slack_event_id(e.kind)), std::string(slack_event_name(e.kind)),
                                       static_cast<double>(e.time_ns) / 1e9, e.slack_before, e.slack_after,
                                       e.live_bytes, e.peak_live_bytes, e.reserved_bytes, e.pages,
                                       e.parked_bytes, e.unsafe_pages, e.unsafe_other_pages});
    }
    r.history_dropped = a->policy().slack_events_dropped();
    r.growths = a->policy().growth_history();  // Note [A history of the time budget]
    r.growths_dropped = a->policy().growths_dropped();
    r.windows = a->policy().window_history();
    r.windows_dropped = a->policy().windows_dropped();
    if (d.beyond_slack_growths != 0) {  // Note [Why pages were created beyond the slack]
      const auto num = [](std::uint64_t x) { return std::to_string(x); };
      r.detail += "; " + num(d.beyond_slack_growths) + " growths created " + num(d.beyond_slack_pages) +
                  " pages beyond the slack while whole free pages lay elsewhere (summed over those "
                  "growths): " + num(d.stuck_beside_pages) + " beside the placement, " +
                  num(d.stuck_unsafe_pages) + " not yet safe from their stream's work (" +
                  num(d.stuck_unsafe_other_pages) + " of them another stream's than the growth's), " +
                  num(d.stuck_pinned_pages) + " on chunks a live block pins, " +
                  num(d.stuck_other_pages) + " other";
    }
  }
#endif
#ifdef CACHEALLOC_HAS_ASYNC
  if (s.pool) {
    char line[200];
    std::uint64_t hits = 0;
    if (auto* a = dynamic_cast<CachingAllocator<AsyncPolicy>*>(&alloc)) {
      hits = a->policy().cache_hits();
    }
    std::snprintf(line, sizeof line, "%llu pool calls (allocate_async + free_async), %llu front-cache hits",
                  static_cast<unsigned long long>(s.pool->pool_calls), static_cast<unsigned long long>(hits));
    r.detail = line;
  }
#endif
  if (options.check_every != 0) {
    alloc.check_invariants();
  }
  return r;
}

}  // namespace cachealloc::replay
