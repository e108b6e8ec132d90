// replay.h: replaying a PyTorch memory snapshot on an allocator, policy by policy.
//
// A trace is turned once into compact operations (prepare()), then replayed on a fresh
// allocator per policy. Trace addresses are resolved to slots ahead of time, so the replay
// loop does no hashing of its own.
//
// Note [Replaying frees]
// PyTorch writes `free_requested` when a tensor dies and `free_completed` when the block can be
// reused; the two are adjacent unless another stream still used the block (record_stream).
// For such a deferred free the replay calls record_stream(ptr, S) on a private stream S that the
// simulated device holds busy, frees the block, and lets S finish at `free_completed`: the front
// end then hands the block back at the next allocation, exactly when PyTorch's allocator could
// reuse it. Requested bytes count from `alloc` to `free_requested` (the tensor's lifetime).
//
// Note [Each stream's own lag]
// A GPU runs a stream's work some time after the host queued it, and streams differ: a copy
// stream bound by PCIe, or a compute stream that waits for it, runs tens of milliseconds behind
// while the host goes on. A recording says how far. When a block another stream used is freed,
// PyTorch (and cachealloc's recorder) records an event on that stream and writes free_completed
// once it finds the event complete (at its next allocation), so the work that stream had queued
// by free_requested was done by free_completed, and not much earlier. With
// ReplayOptions::stream_lags (cachealloc-replay --stream-lags) a stream is busy until the latest
// free_completed of the late frees requested before now: an event recorded at time t completes at
// that time if it is later than t (and gpu_lag_us after t if that is later still). A late free of
// a block allocated on stream A speaks for the streams other than A (the trace does not name the
// stream that used the block: with more than two streams every other one takes it). Streams
// without such a free keep gpu_lag_us. The frees the trace shows waiting are still held until
// their own free_completed (Note [Replaying frees]); the lags are for everything else the policy
// waits on: the events of a same-stream free, and whether a page is safe to unmap.
// Checked against cachealloc's own recordings of defrag on an H100 (bench/validation/gpu_runs,
// peak reserved replayed with the policy that ran there, against recorded): offload_train -0.8%
// (-11.6% with no lag), stream_weights +5.4% (-6.6%). Taking a stream's lag as the last late
// free's wait, held until the next one, was worse (+13.5%, +1.6%): after the host waits (each
// step ends with a synchronize) the GPU has caught up, which a held lag ignores. On two H200
// recordings of offload_train under defrag (bench/validation/gpu_runs/h200, session 31) it
// replays +1.6% and -15.4%: the trace's times stay as recorded, so a run whose host queued its
// copies' frees further ahead is not reproduced. With that same policy, on the H200
// recordings of the same jobs (bench/validation/recordings{,_b}), it also gave the H200's verdict
// against expandable segments where no fixed lag did: offload_train above them (3.099 against
// 3.061 at 0 ms), the second stream_weights below (1.575 against 1.596);
// bench/results/defrag_session29_2026-12-05.md.
//
// Note [Late frees on the other stream]
// A snapshot does not say which stream a late free waited for, so the replay gives each one a
// private stream. A job with two streams has only one candidate, the stream that did not allocate
// the block: with ReplayOptions::late_frees_on_other_stream (cachealloc-replay
// --late-frees-on-other-stream, together with --stream-lags) the replay names that stream in
// record_stream and holds no private one. The free then comes back when an event recorded on the
// other stream at the free completes, on that stream's pace (Note [Each stream's own lag]: no
// earlier than its own free_completed), and an allocation on the other stream can see it as what
// it is: a free parked behind its own stream, which reuse_parked may take at once (Note [Reusing
// a parked free on the stream it waits for], allocator.h).
#pragma once

#include <cachealloc/allocator.h>
#include <cachealloc/policies/defrag.h>
#include <cachealloc/sim_backend.h>
#include <cachealloc/trace/snapshot.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cachealloc::replay {

enum class OpKind : std::uint8_t { alloc, free, free_deferred, free_completed };

struct Op {
  OpKind kind;
  std::uint32_t slot;
  std::uint64_t size;    // alloc: requested bytes
  std::uint64_t stream;  // alloc: stream
  std::uint64_t time_us = 0;  // the entry's time_us after the trace's first one (0: none)
};

/// One recorded device reservation of PyTorch's native allocator.
struct SegmentEntry {
  trace::Action action;  // segment_alloc / segment_free / segment_map / segment_unmap
  std::uint64_t size;
  std::uint64_t trace_index;
  std::uint64_t addr = 0;
};

struct PreparedTrace {
  std::string name;
  std::uint64_t trace_events = 0;  ///< entries in the trace (all actions)
  std::vector<Op> ops;
  std::uint32_t slots = 0;
  std::vector<SegmentEntry> segments;
  std::uint64_t recorded_peak_reserved = 0;
  std::uint64_t peak_requested = 0;
  /// The peak of requested bytes plus those of blocks freed while another stream still used them
  /// (from free_requested to free_completed): held in the replay whatever the policy does.
  std::uint64_t peak_live_pending = 0;
  /// Each stream's own peak of requested bytes (the blocks it allocated, alive from alloc to
  /// free_requested), in order of the stream's first allocation. Their sum over the peak
  /// requested bytes is the least an allocator that never hands one stream's free memory to
  /// another (without waiting) can hold (Note [What keeping streams apart costs]).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> stream_peaks;  // (stream, bytes)
  /// Per stream, how long it stays busy by the trace's late frees (Note [Each stream's own lag]):
  /// (time_us a free was requested, the latest free_completed of those requested by then), in
  /// order of time, on the trace's clock; streams without a late free are left out.
  std::vector<std::pair<std::uint64_t, std::vector<std::pair<std::uint64_t, std::uint64_t>>>> stream_lags;
  std::uint64_t unmatched_frees = 0;   ///< frees of blocks allocated before recording started
  trace::AllocatorSettings settings;
  int device = 0;
};

/// The sum of `trace.stream_peaks` (equal to peak_requested with one stream).
std::uint64_t stream_peaks_sum(const PreparedTrace& trace);

/// The line printed under a table when prepare() skipped frees of blocks allocated before
/// recording started (newline-terminated); empty when it skipped none.
std::string skipped_frees_note(const PreparedTrace& trace);

/// Builds the operations for one device of `snapshot` (the device with the most entries when
/// `device` is unset). Throws trace::TraceError on inconsistent traces.
PreparedTrace prepare(const trace::Snapshot& snapshot, std::string name,
                      std::optional<int> device = std::nullopt);

/// The CACHEALLOC_CONF entries that reproduce the trace's PyTorch allocator settings.
std::string native_conf_from_settings(const trace::AllocatorSettings& settings);

struct Fidelity {
  std::uint64_t recorded_segments = 0;
  std::uint64_t model_segments = 0;
  std::optional<std::uint64_t> first_divergence_event;  ///< trace index where they differ
  std::string detail;
};

struct Sample {
  std::uint64_t op_index;
  std::uint64_t reserved;
  std::uint64_t requested;
};

/// One moment that decided what defrag holds beyond its live peak: a change of its slack, or a
/// growth that created pages beyond it (SlackEvent, Note [A history of the slack]).
struct HistoryEvent {
  std::string id;    ///< slack_event_id(): "time_raise", "beyond_slack", ...
  std::string what;  ///< slack_event_name(), in words
  double time_s = 0;  ///< on the simulated host's clock (the trace's own times plus modelled calls)
  double slack_before = 0;
  double slack_after = 0;
  std::uint64_t live_bytes = 0;
  std::uint64_t peak_live_bytes = 0;
  std::uint64_t reserved_bytes = 0;
  std::uint64_t pages = 0;  ///< pages created beyond the slack (0 for a change of the slack)
  std::uint64_t parked_bytes = 0;        ///< of live_bytes, frees parked for other streams
  std::uint64_t unsafe_pages = 0;        ///< beyond_slack: free pages still in use by queued work
  std::uint64_t unsafe_other_pages = 0;  ///< of which in another stream's holes
};

/// Device calls made during one slice of the trace's operations (ReplayOptions::phases).
struct Phase {
  std::uint64_t end_op = 0;        ///< the slice is the operations before this index
  std::uint64_t device_calls = 0;  ///< reserves, physical creates, releases, maps and unmaps
  std::uint64_t maps = 0;
  std::uint64_t unmaps = 0;
  std::uint64_t reserved = 0;  ///< reserved bytes at the end of the slice
};

struct PolicyResult {
  std::string name;
  std::string conf;
  std::uint64_t peak_reserved = 0;
  std::uint64_t peak_requested = 0;
  std::uint64_t peak_allocated = 0;
  std::uint64_t device_reserve_calls = 0;
  std::uint64_t device_release_calls = 0;
  std::uint64_t map_calls = 0;
  std::uint64_t unmap_calls = 0;
  /// wait_parked_to_grow: allocations that waited for frees parked behind other streams, and the
  /// simulated time they waited (Note [Waiting for frees in flight instead of growing]).
  std::uint64_t parked_waits = 0;
  std::uint64_t parked_reuses = 0;
  std::uint64_t parked_wait_ns = 0;
  std::uint64_t mapped_bytes = 0;
  /// Events recorded and queried on the simulated device (cross-stream frees, defrag's epochs):
  /// on a GPU each costs about a microsecond of host time, which the simulated clock does not
  /// charge (Note [Simulated time]).
  std::uint64_t events_recorded = 0;
  std::uint64_t event_queries = 0;
  std::uint64_t failed_allocations = 0;
  double seconds = 0;
  double events_per_second = 0;
  /// The simulated host time the policy's device calls cost (SimCallCosts), in nanoseconds.
  std::uint64_t charged_ns = 0;
  std::optional<Fidelity> fidelity;
  std::vector<Sample> samples;  ///< for plots
  std::vector<Phase> phases;    ///< ReplayOptions::phases slices, in order
  std::string error;            ///< non-empty when the policy could not run
  std::string detail;           ///< the policy's own counters, in words (defrag), or empty
  std::vector<HistoryEvent> history;  ///< defrag: its slack's history, in order
  std::uint64_t history_dropped = 0;  ///< events after the first kSlackHistoryLength, only counted
  /// defrag: its growths that moved pages or waited, and its move budget's windows (Note [A
  /// history of the time budget]); times on the simulated host's clock.
  std::vector<CostlyGrowth> growths;
  std::uint64_t growths_dropped = 0;
  std::vector<BudgetWindow> windows;
  std::uint64_t windows_dropped = 0;
};

struct ReplayOptions {
  std::size_t capacity = std::size_t{143771} * kMiB;
  std::size_t plot_points = 0;  ///< samples to keep for plots (0: none)
  bool check_fidelity = false;
  std::function<void(double fraction)> progress;
  /// Runs check_invariants() every N operations (0: never).
  std::uint64_t check_every = 0;
  /// Splits the operations into this many equal slices and counts the device calls of each
  /// (0: none): a policy that settles makes none in the last slices of a repeating job.
  std::uint32_t phases = 0;
  /// How long after the host the simulated GPU finishes the work queued on a stream (0: at
  /// once): SimOptions::event_lag_ns, Note [Simulated events].
  std::uint64_t gpu_lag_us = 0;
  /// Event queries answer from a watcher's look taken at most this long ago (0: at once), as the
  /// CUDA backends' under event_thread:poll: SimOptions::query_look_ns.
  std::uint64_t query_lag_us = 0;
  /// Each stream finishes its work as late as the trace's late frees show (trace.stream_lags;
  /// streams without a sample: gpu_lag_us): Note [Each stream's own lag].
  bool stream_lags = false;
  /// A late free waits for the trace's other stream instead of a private one (traces with two
  /// streams; needs stream_lags for that stream's pace): Note [Late frees on the other stream].
  bool late_frees_on_other_stream = false;
  /// What each device call costs the simulated host (SimOptions::costs; the H200's by default).
  SimCallCosts call_costs{};
};

/// Sets one entry of `costs` from "KIND=MICROSECONDS" (cachealloc-replay --call-cost), KIND one of
/// call_cost_kinds(). Throws ConfigError naming the kinds on anything else.
void apply_call_cost(SimCallCosts& costs, const std::string& spec);
/// The KIND names apply_call_cost() takes, with the value each has in `costs`, in microseconds.
std::vector<std::pair<std::string, double>> call_cost_kinds(const SimCallCosts& costs);

/// Plays a prepared trace's operations, one at a time, on an allocator over a simulated device
/// (Note [Replaying frees]). run() uses it; so do tests that check the allocator between
/// operations or inject faults, so every driver replays frees the same way.
class Player {
 public:
  /// `other_stream`: Note [Late frees on the other stream] (throws ConfigError when the trace
  /// does not have exactly two streams).
  Player(const PreparedTrace& trace, DeviceAllocator& allocator, SimBackend& sim, bool other_stream = false);
  /// Applies `op`. A failed allocation (OutOfMemory, DeviceError) leaves its slot empty and
  /// propagates; later frees of that slot are no-ops.
  void apply(const Op& op);
  /// Frees every block still live when the recording stopped and completes every deferred free
  /// the trace left pending, so the allocator can be checked for leaks.
  void finish();

 private:
  DeviceAllocator& allocator_;
  SimBackend& sim_;
  std::vector<void*> ptrs_;
  std::vector<std::uint32_t> held_;  // slots whose deferred free has not completed
  // Note [Late frees on the other stream]: the two streams, and each live slot's stream.
  bool other_stream_ = false;
  std::array<std::uint64_t, 2> streams_{};
  std::vector<std::uint64_t> slot_stream_;
};

/// Replays `trace` on a fresh simulated device with `policy` configured by `conf`.
PolicyResult run(const PreparedTrace& trace, const std::string& policy, const std::string& conf,
                 const ReplayOptions& options);

/// Compares a model's device reservations with the recorded ones.
Fidelity compare_segments(const PreparedTrace& trace,
                          const std::vector<std::pair<trace::Action, std::uint64_t>>& model);

}  // namespace cachealloc::replay
