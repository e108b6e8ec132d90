// sim_backend.h: a simulated device for GPU-free tests and replays.
//
// Deterministic fake address space (the same calls give the same addresses on every machine),
// a capacity, fake streams and events that complete only when the caller says so, a
// simulated virtual-memory twin that models address ranges and physical pages exactly, and
// fault injection (fail the k-th device call, or the next call of a kind).
//
// Note [Simulated events]
// An event recorded on a stream is pending until one of:
//   complete_stream(s)  -- all work on s so far finished (what a test says after a "kernel")
//   complete_all()      -- the device went idle
//   tick()              -- everything not on a held stream finished
//   set_auto_complete(true) -- events on streams that are not held are complete as soon as they
//                          are recorded: the device "keeps up" except where the caller says a
//                          stream is still busy (hold_stream / release_stream). Replays run so,
//                          as a training job's GPU finishes each step's work within the step, and
//                          the trace says which frees waited for another stream (record_stream).
//                          With SimOptions::event_lag_ns, "as soon as" becomes that long after
//                          recording on the simulated clock, and synchronize_event() moves the
//                          clock to the completion (a wait costs host time, as on a real GPU);
//                          SimOptions::stream_lag gives a stream a lag of its own (Note [Each
//                          stream's own lag])
// synchronize_event() completes the event (and everything before it on its stream), as a real
// cudaEventSynchronize would return only once that work finished. release() completes every
// stream, because cudaFree synchronizes the whole device before it returns (VMM unmap does not).
//
// Note [Simulated time]
// clock_ns() is the simulated device's clock. It moves only when the driver says so
// (advance_clock_to: replays pass the trace's time_us, the host time at which PyTorch's
// allocator saw each call in the recorded run) and, with SimOptions::model_call_costs, by the
// median cost measured on an H200 (../shared/traces/README.md) of each call made: reserve 90 us,
// release 90 us, create_physical 13.6 us, release_physical 13.6 us, map 55 us per handle mapped
// (cuMemMap + cuMemSetAccess), unmap 3 us per mapping removed, 0.725 us per stream-ordered
// pool allocate_async or free_async (half a warm pair); SimCallCosts holds them, and
// cachealloc-replay --call-cost sets others (another GPU's, or a sensitivity check). The unmap
// figure is what cuda_vmm's default, background_unmap, costs the allocating thread (2-3 us per
// call on the H200 in bench/e2e: the call is queued, and cuMemUnmap itself, 27 us median, 90-500
// us under load, runs on the backend's thread); it was 27 us until session 23, which made
// replays charge the policy's time budget ten times what the GPU charges it (bench/results/
// defrag_session23_2026-12-04.md). Charged costs add up and delay
// every later driver time, as calls on a real device would. Waiting for an event costs nothing:
// the model cannot know how far the GPU is behind. Without either, the clock stands still, so
// unit tests see no time pass.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/sim_stream_pool.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace cachealloc {

/// The device calls the simulator counts and can fail.
enum class SimCall : std::uint8_t {
  reserve,
  create_physical,
  map,
  unmap,
  record_event,
  query_event,
  synchronize_event,
};
std::string_view to_string(SimCall call) noexcept;

/// How an injected fault shows itself.
enum class SimFault : std::uint8_t {
  out_of_memory,  ///< reserve/create_physical find no memory (other calls: device_error)
  device_error,   ///< the call throws DeviceError
};

/// What each device call costs the host on the simulated clock, with SimOptions::model_call_costs
/// (Note [Simulated time]). The defaults are the H200's; cachealloc-replay --call-cost sets others.
struct SimCallCosts {
  std::uint64_t reserve_ns = 90'000;           ///< cudaMalloc (native's segments)
  std::uint64_t release_ns = 90'000;           ///< cudaFree
  std::uint64_t create_ns = 13'600;            ///< cuMemCreate, per handle
  std::uint64_t release_physical_ns = 13'600;  ///< cuMemRelease, per handle
  std::uint64_t map_ns = 55'000;               ///< cuMemMap + cuMemSetAccess, per handle mapped
  std::uint64_t unmap_ns = 3'000;              ///< per mapping removed (background_unmap's share)
  /// VirtualMemory::unmap_now, per mapping removed: cuMemUnmap on the allocating thread, 21-34 us
  /// per handle on an H100, idle or under device-to-host copies (session 36's probe).
  std::uint64_t unmap_now_ns = 25'000;
  /// A stream-ordered allocate_async or free_async: half of a warm cudaMallocAsync +
  /// cudaFreeAsync pair on an H200 (1.45 us).
  std::uint64_t pool_op_ns = 725;
};

struct SimOptions {
  int device = 0;
  std::size_t capacity = std::size_t{143771} * kMiB;  ///< an H200's cudaMemGetInfo total
  std::size_t granularity = 2 * kMiB;                 ///< VMM page size
  bool auto_complete_events = false;  ///< Note [Simulated events]
  /// stream_wait_event() queues waits (Note [Simulated stream waits]); false: it answers false,
  /// as a device that cannot (tests of the callers' other path).
  bool stream_waits = true;
  /// Advance clock_ns() by an H200's median cost of each device call (Note [Simulated time]).
  bool model_call_costs = false;
  SimCallCosts costs{};  ///< what model_call_costs charges
  /// With auto_complete_events: an event completes this long (on clock_ns()) after it was
  /// recorded instead of at once, as a GPU finishes work some time after the host queued it
  /// (Note [Simulated events]).
  std::uint64_t event_lag_ns = 0;
  /// With auto_complete_events: how far behind the host each stream's work is, when it differs
  /// from event_lag_ns (Note [Each stream's own lag]): called with the stream and the clock when
  /// an event is recorded; no value means event_lag_ns. Events on one stream still complete in
  /// the order they were recorded.
  std::function<std::optional<std::uint64_t>(StreamId, std::uint64_t clock_ns)> stream_lag{};
  /// unmap_after() keeps the mapping until the work the stream had queued completes, without
  /// waiting (as backend cuda_vmm with background_unmap: Note [Moving pages a stream still
  /// uses], background_unmapper.h); a map into the range, releasing physical memory or an
  /// address range first waits for it (the clock moves as for synchronize_event). False: the
  /// waiting default of VirtualMemory.
  bool unmap_after_streams = true;
  /// Queries that answer late, as the CUDA backends' under event_thread:poll (Note [The
  /// record thread watches its events], record_thread.h): with N > 0, query_event() answers what
  /// a watcher saw at its last look, and it looks once every N calls of query_event() (each
  /// event it finds complete then stays so).
  std::uint32_t query_lag_calls = 0;
  /// The same by time: the watcher looks at a query_event() once this long (on clock_ns()) has
  /// passed since its last look, as the record thread polls every 50-100 us
  /// (cachealloc-replay --query-lag-us).
  std::uint64_t query_look_ns = 0;
};

// Note [Simulated stream waits]
// stream_wait_event(S, E) is cudaStreamWaitEvent: S's work queued from then on runs after the work
// E fences. The simulator keeps (E, S's event count at the call) for S; an event recorded on S
// later completes only when its own condition holds and E completed too (recursively: E's stream
// may wait as well); a synchronize on it waits for E first. Both walks visit each event once: a
// query remembers the events it found not complete (pending_in_query), a wait marks each event it
// waited for settled (session 42: two streams that wait on each other's events, as device-side
// reuse of parked frees makes them, gave the unmemoized walks exponentially many paths and a test
// of 8 threads on one allocator ran for minutes instead of a second). E stays in the event table,
// past its destroy_event if need be (uncounted by live_events()), until it completed and the wait
// was dropped: a stream's completed waits are dropped at its next wait or query. release_stream
// keeps a released stream's waits for all its later events (its sequence numbers restart).
class SimBackend final : public DeviceBackend, private VirtualMemory {
 public:
  explicit SimBackend(SimOptions options = {});
  ~SimBackend() override;

  [[nodiscard]] std::string_view name() const noexcept override { return "sim"; }
  [[nodiscard]] int device() const noexcept override { return options_.device; }
  [[nodiscard]] std::size_t total_memory() const override { return options_.capacity; }
  [[nodiscard]] std::size_t free_memory() const override;

  [[nodiscard]] EventId record_event(StreamId stream) override;
  [[nodiscard]] bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void destroy_event(EventId event) noexcept override;
  /// Note [Simulated stream waits]: the events recorded on `stream` from now on complete only
  /// once `event` has too.
  [[nodiscard]] bool stream_wait_event(StreamId stream, EventId event) override;

  [[nodiscard]] VirtualMemory* virtual_memory() noexcept override { return this; }
  /// The simulated stream-ordered pool (sim_stream_pool.h); it reserves through virtual_memory().
  [[nodiscard]] SimStreamPool* stream_ordered() noexcept override { return &pool_; }

  // ---- driving the fake device ----
  void complete_stream(StreamId stream);
  void complete_all();
  void tick();
  void hold_stream(StreamId stream);
  /// Un-holds `stream`, completes its events and forgets it (replays use one stream per delayed free).
  void release_stream(StreamId stream);
  void set_auto_complete(bool on) noexcept { options_.auto_complete_events = on; }
  /// Note [Simulated time]: the driver's time is now `ns`; the clock reads that plus the cost
  /// of every call charged so far (never less than it read before).
  void advance_clock_to(std::uint64_t ns) noexcept {
    clock_ns_ = std::max(clock_ns_, ns + charged_ns_);
  }
  [[nodiscard]] std::uint64_t clock_ns() const noexcept override { return clock_ns_; }
  /// The modelled cost of every device call made so far (0 without model_call_costs).
  [[nodiscard]] std::uint64_t charged_ns() const noexcept { return charged_ns_; }
  [[nodiscard]] const SimCallCosts& call_costs() const noexcept { return options_.costs; }
  [[nodiscard]] std::size_t pending_events() const;
  /// Events recorded and not destroyed (an event a stream still waits for is kept past its
  /// destruction, uncounted: Note [Simulated stream waits]).
  [[nodiscard]] std::size_t live_events() const noexcept { return events_.size() - waited_destroyed_; }
  /// Whether `stream` waits (stream_wait_event) for an event of `other` recorded after the first
  /// `after` events of `other`, and not yet complete: its later work follows that work of `other`.
  [[nodiscard]] bool stream_waits_for(StreamId stream, StreamId other, std::uint64_t after) const;
  /// Events recorded on `stream` so far, and how many of them completed (in stream order).
  [[nodiscard]] std::uint64_t stream_recorded(StreamId stream) const;
  [[nodiscard]] std::uint64_t stream_completed(StreamId stream) const;

  // ---- recorded addresses ----
  /// Replays a recorded run's reservation addresses: while the sizes agree, the i-th reserve()
  /// returns script[i].second for a request of script[i].first bytes, so a policy whose choices
  /// depend on address order (best-fit ties) decides as it did on the recorded device. At the
  /// first reserve() of another size the script is dropped and placement continues above every
  /// scripted address.
  void script_reservations(std::vector<std::pair<std::size_t, std::uintptr_t>> script);

  // ---- fault injection ----
  /// The k-th counted device call from now (1 = the next one) fails with `fault`.
  void fail_call(std::uint64_t k, SimFault fault = SimFault::out_of_memory);
  /// The next call of `kind` fails with `fault`.
  void fail_next(SimCall kind, SimFault fault = SimFault::out_of_memory);
  /// Every call of `kind` fails with `fault` until clear_faults(): a device that rejects one
  /// kind of call for good (a driver without a feature, a lost context).
  void fail_always(SimCall kind, SimFault fault = SimFault::device_error);
  void clear_faults() noexcept;
  /// Counted device calls so far (all SimCall kinds).
  [[nodiscard]] std::uint64_t device_calls() const noexcept { return calls_; }
  [[nodiscard]] std::uint64_t injected_faults() const noexcept { return injected_; }

  // ---- inspection for invariant checks ----
  [[nodiscard]] std::size_t live_reservations() const noexcept { return reservations_.size(); }
  [[nodiscard]] std::size_t live_physical() const noexcept { return physical_.size(); }
  [[nodiscard]] std::size_t mapped_bytes_now() const noexcept { return mapped_now_; }
  /// True when [va, va+bytes) lies fully inside mapped pages.
  [[nodiscard]] bool is_mapped(std::uintptr_t va, std::size_t bytes) const;
  /// unmap_after() ranges still mapped because their stream's work has not completed (their
  /// bytes are in mapped_bytes_now()).
  [[nodiscard]] std::size_t pending_unmaps() const noexcept { return deferred_unmaps_.size(); }
  [[nodiscard]] std::size_t pending_unmap_bytes() const noexcept {
    std::size_t n = 0;
    for (const DeferredUnmap& d : deferred_unmaps_) {
      n += d.bytes;
    }
    return n;
  }
  [[nodiscard]] bool unmaps_after_streams() const noexcept override {
    return options_.unmap_after_streams;
  }
  /// The unmap_after() ranges whose stream's work has not completed at the simulated clock.
  [[nodiscard]] std::uintptr_t queued_unmap_end(std::uintptr_t va,
                                                std::size_t bytes) const noexcept override;

 private:
  friend class SimStreamPool;  // marks free positions in stream order, reads events
  // DeviceBackend hooks
  [[nodiscard]] void* do_reserve(std::size_t bytes) override;
  void do_release(void* ptr, std::size_t bytes) noexcept override;
  // VirtualMemory hooks
  [[nodiscard]] std::size_t granularity() const noexcept override { return options_.granularity; }
  [[nodiscard]] std::uintptr_t reserve_address(std::size_t bytes) override;
  void free_address(std::uintptr_t va, std::size_t bytes) noexcept override;
  [[nodiscard]] PhysicalHandle do_create_physical(std::size_t bytes) override;
  void do_release_physical(PhysicalHandle handle, std::size_t bytes) noexcept override;
  void do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) override;
  void do_unmap(std::uintptr_t va, std::size_t bytes) override;
  void do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) override;
  void do_unmap_now(std::uintptr_t va, std::size_t bytes) override;
  [[nodiscard]] std::uint64_t unmap_wait_ns() const noexcept override { return unmap_wait_ns_; }
  void do_release_unmapped(PhysicalHandle handle, std::size_t bytes) noexcept override;
  /// Throws DeviceError unless [va, va+bytes) covers whole mappings exactly.
  void check_unmap_range(std::uintptr_t va, std::size_t bytes) const;
  /// Removes the mappings of [va, va+bytes) (checked) without charging for them.
  void remove_mappings(std::uintptr_t va, std::size_t bytes) noexcept;
  /// Runs the deferred unmaps whose events completed, and (waiting for their events, as
  /// synchronize_event does) those overlapping [va, va+bytes) (`all`: every one).
  void settle_unmaps(std::uintptr_t va = 0, std::size_t bytes = 0, bool all = false);
  [[nodiscard]] bool event_done(EventId id) const;
  /// Records an event on `stream` (auto-completed as options say); not counted, never fails.
  EventId new_event(StreamId stream);
  /// Charges `per_mapping_ns` for each mapping in [va, va+bytes) (Note [Simulated time]).
  void charge_unmap(std::uintptr_t va, std::size_t bytes, std::uint64_t per_mapping_ns) noexcept;

  /// Counts a call; returns the fault to inject, if any.
  std::optional<SimFault> count_call(SimCall kind);
  void maybe_throw(SimCall kind);
  std::uintptr_t take_range(std::map<std::uintptr_t, std::size_t>& free_ranges,
                            std::uintptr_t& bump, std::size_t bytes, std::size_t alignment);

  struct Event {
    StreamId stream;
    std::uint64_t sequence;  // per-stream order
    bool done;
    std::uint64_t ready_ns = 0;  // event_lag_ns: complete once the clock reaches this (0: never)
    bool destroyed = false;      // destroyed while a stream still waits for it
    // event_done() answered true once: it stays true (the clock only moves on, and a later wait
    // of its stream holds only for events recorded after it), so the walk over the waits it
    // depends on (Note [Simulated stream waits]) is not repeated at every query.
    mutable bool settled = false;
    // Within one query (query_gen_), an event already found not complete is not walked again:
    // with two streams waiting on each other the waits form a DAG with many paths, and an
    // unmemoized walk took exponential time (Note [Simulated stream waits]).
    mutable std::uint64_t pending_in_query = 0;
    bool seen = false;  // SimOptions::query_lag_calls / query_look_ns: the watcher saw it complete
  };
  /// Note [Simulated stream waits]: events of the stream with a sequence above `after` also
  /// wait for `event`.
  struct StreamWait {
    EventId event;
    std::uint64_t after;
  };
  [[nodiscard]] bool waits_done(const Event& e) const;
  /// event_done() within the current query (query_gen_): memoizes "not yet" per query.
  [[nodiscard]] bool done_in_query(const Event& e) const;
  void prune_waits(StreamId stream);
  /// The host waits for `e` (the clock moves to when the simulated GPU gets there), as
  /// synchronize_event, without counting a call.
  void wait_until_done(Event& e);

  SimOptions options_;
  std::unordered_map<StreamId, std::uint64_t> stream_ready_ns_;  // SimOptions::stream_lag: last ready_ns
  std::uint64_t clock_ns_ = 0;    // Note [Simulated time]
  mutable std::uint64_t query_gen_ = 0;  // event_done()'s current query (Event::pending_in_query)
  std::uint32_t calls_since_look_ = 0;   // SimOptions::query_lag_calls
  std::uint64_t last_look_ns_ = 0;       // SimOptions::query_look_ns
  std::uint64_t charged_ns_ = 0;  // modelled cost of the calls made so far
  void charge(std::uint64_t ns) noexcept {
    if (options_.model_call_costs) {
      clock_ns_ += ns;
      charged_ns_ += ns;
    }
  }
  // address space: reservations (cudaMalloc) and VMM address ranges live in separate regions
  std::uintptr_t bump_ = 0x7f0000000000;
  std::uintptr_t va_bump_ = 0x600000000000;
  std::map<std::uintptr_t, std::size_t> free_ranges_;
  std::map<std::uintptr_t, std::size_t> free_va_ranges_;
  std::unordered_map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, std::size_t> va_reservations_;
  struct Physical {
    std::size_t bytes;
    int mappings;
  };
  std::uint64_t unmap_wait_ns_ = 0;  // clock time settle_unmaps() waited for streams
  std::unordered_map<PhysicalHandle, Physical> physical_;
  PhysicalHandle next_handle_ = 1;
  std::map<std::uintptr_t, std::pair<std::size_t, PhysicalHandle>> mappings_;  // va -> (bytes, handle)
  std::size_t mapped_now_ = 0;
  struct DeferredUnmap {
    std::uintptr_t va;
    std::size_t bytes;
    EventId event;
    [[nodiscard]] bool overlaps(std::uintptr_t a, std::size_t n) const noexcept {
      return n != 0 && a < va + bytes && va < a + n;
    }
  };
  std::vector<DeferredUnmap> deferred_unmaps_;  // unmap_after(), oldest first
  // events
  std::unordered_map<EventId, Event> events_;
  std::unordered_map<StreamId, std::uint64_t> stream_completed_upto_;  // completed sequence per stream
  std::unordered_map<StreamId, std::uint64_t> stream_recorded_;        // last sequence per stream
  std::unordered_set<StreamId> held_;
  std::unordered_map<StreamId, std::vector<StreamWait>> stream_waits_;  // Note [Simulated stream waits]
  std::unordered_map<EventId, std::uint32_t> waiters_;  // how many StreamWait name each event
  std::size_t waited_destroyed_ = 0;  // events kept past destroy_event for a waiting stream
  EventId next_event_ = 1;
  // scripted reservation addresses
  std::vector<std::pair<std::size_t, std::uintptr_t>> script_;
  std::size_t script_next_ = 0;
  // faults
  std::uint64_t calls_ = 0;
  std::uint64_t fail_at_ = 0;  // absolute call number, 0 = none
  SimFault fail_at_fault_ = SimFault::out_of_memory;
  std::optional<std::pair<SimCall, SimFault>> fail_next_;
  std::optional<std::pair<SimCall, SimFault>> fail_always_;
  std::uint64_t injected_ = 0;
  SimStreamPool pool_{*this, *this};  // last: it refers to the members above
};

}  // namespace cachealloc
