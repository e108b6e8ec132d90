// allocator.h: the per-device front end over any policy.
//
// DeviceAllocator is what every entry point (the PyTorch plugin, the LibTorch adapter, the
// replay tool, the tests) talks to. CachingAllocator<P> implements it for a policy P: one
// mutex per device, the pointer -> block map, statistics, deferral of frees that other streams
// may still be using, and the out-of-memory retry chain.
//
// Note [Cross-stream frees]
// A block allocated on stream A and also used on stream B (record_stream) may not be reused
// until B's work queued before the free finished. The front end parks the block in `pending_`
// with one event on each such stream (recorded at its next call: Note [Events shared by a burst
// of parked frees]); the next allocate() (and the retry chain,
// and empty_cache) polls those events and hands the block to the policy only when all of them
// completed. So a policy never sees a block another stream may still touch: policies only ever
// reason about the block's own stream (see policy.h, item 4).
//
// Note [Frees that come back settled]
// A parked block comes back when the other streams are done with it, but its own stream may
// still be running work queued before the free (a compute stream that lags the host while a copy
// stream drains). The policy must then treat the block's memory as in use by that stream, and a
// policy that moves physical pages (defrag) can only move them once an event it records later,
// after even more work, completes: bench/results/defrag_session29_2026-12-05.md found the
// offloading job's growths blocked by such holes. So a parked free also gets one event on the
// block's own stream (shared with its burst: Note [Events shared by a burst of parked frees]),
// and when the block comes back and that event has completed too (queried
// then; waited for when the flush waits anyway), no work on any stream can touch the block, and
// a policy that says so takes it through `deallocate_settled` (policy.h). Without that member,
// or when the event is still pending (or could not be recorded), the block comes back as before.
//
// Note [One query per busy stream]
// Parked frees are kept in the order they were parked, and an event completes only after every
// event recorded before it on the same stream. So when one pass over `pending_` finds an event
// of stream S incomplete, every later event recorded on S is too: the pass stops querying S
// (one cudaEventQuery per busy stream per allocation, as PyTorch's native allocator does,
// instead of one per parked block). A block whose events were re-recorded after a failure sits
// later in the order than its events' age: it is only queried later, never handed out early.
//
// Note [Parked frees by stream]
// That pass still visited every parked free at every allocation, so an allocation cost grew
// with the frees in flight: bench/micro parked/<policy>/<n> took 50 ns with none parked and
// 2.4 us with 1,024 on the development machine, about 2.3 ns per parked free with warm caches
// and far more inside a training step, where each visit misses the cache; an offloading job
// keeps a hundred or more activations parked for its copy stream. So each outstanding event of
// a parked free is also queued on its stream (`waits_`, in recording order), and the poll
// (poll_pending) asks each stream's oldest event, then the next while they completed: one query
// per busy stream per poll and one per completion, and no parked free visited that did not
// complete. A stream leaves `waits_` once its queue is empty, so a poll visits only streams with
// events outstanding (a replay gives every late free a stream of its own). A free whose events all completed goes back to the policy at once and is marked
// `gone` in pending_, which keeps the parking order (a binary search by `seq` finds a free
// from its event) and is compacted once half of it is gone. The passes over pending_ that
// remain (waiting for frees: the retry chain, empty_cache, wait_parked_to_grow; a free whose
// events could not be recorded yet) rebuild the queues afterwards. check_invariants checks that
// the queued events are exactly the ones the parked frees wait for.
//
// Note [Polling parked frees]
// While frees are parked, polling them at every allocation costs one cudaEventQuery per busy
// stream per allocation, and in a two-stream input pipeline something is parked almost all the
// time (the batch handed over with record_stream is freed at the end of the step and its event
// completes about a step later). `event_poll_interval` (CACHEALLOC_CONF, 1-1024) polls at every
// N-th allocation instead; the retry chain still waits for every parked free before it reports
// out-of-memory, so a longer interval can only delay reuse, never fail an allocation.
//
// Note [Events shared by a burst of parked frees]
// Frees behind other streams come in bursts: a job that reduces gradients on a communication
// stream frees them all at once (zero_grad), one that streams weights in frees a layer's at once.
// Recording each free's events at the free cost one cudaEventRecord per stream per free
// (bench/e2e comm_overlap on an H100: 196 records and 203 queries per step; offload_train 215 and
// 586, about 1 ms of its 1.6 ms quiet-step floor). An event recorded later
// on a stream fences all the work an earlier one did and more, so it may stand for the earlier
// one: reuse waits a little longer, never less. So park() records nothing; the burst of parked
// frees stays open until the front end's next call of any other kind (an allocation, a free no
// other stream used, a flush), which records one event per stream the burst's frees wait for
// (other streams and, for settled frees, their own) and shares it among them (`shared_events_`
// counts its holders; the last one destroys it). No allocation can come between a free and that
// record, so nothing could have reused the block earlier. The poll asks a shared event once (the
// last event seen complete is remembered until destroyed). In the replays of the shared, held-out
// and e2e recordings (`--stream-lags`) every peak is unchanged; there each late free has a stream
// of its own, so only the own-stream events are shared: defrag's records per 1,000 allocations
// fell 300 -> 266 (comm_overlap), 608 -> 541 (offload_train), 434 -> 328 (stream_weights). On
// the recorded jobs' own streams, the late frees of comm_overlap fall into 32 bursts (1,519
// frees), stream_weights' into 96 (384), offload_train's into 1,069 (1,565). On an H100
// (bench/results/defrag_session39_2026-12-06.md, two hosts): comm_overlap 194 -> 8 records per
// step and 313-341 -> 127-143 us per step in event calls (its quiet steps 0.62 -> 0.50% of the
// step); stream_weights 64 -> 32 records; offload_train 214 -> 177, its time in event calls
// unchanged: its queries (one per busy stream per allocation) are most of it. The price: the
// first allocation after a burst records its events and polls at once, so on an idle device it
// may see them complete only at a later poll; no peak moved in those runs.
// The contract this adds: a stream a freed block was used on (record_stream) must stay valid
// until the front end's next call, not only until the free. PyTorch asks as much of external
// streams (torch.cuda.ExternalStream: the user keeps the stream alive while it is used), its
// own streams are never destroyed, and its allocator too records such events late while a
// graph is captured; but a job that destroys an external stream right after freeing a block used
// on it, before any other allocator call, sets `share_events:False` (CACHEALLOC_CONF): every
// parked free then records its events at the free, as before session 39.
//
// Note [Reusing a parked free on the stream it waits for]
// A parked free waits for the other streams that used the block; but an allocation on one of
// those streams, S, is ordered after all of S's work queued before the free by the stream
// itself, so it may take the block once every other stream is done with it: the streams other
// than S that used it, and the block's own stream (its event at the free). The job this is for
// offloads activations: forward frees each one once its copy to the host is queued on the copy
// stream, and backward allocates the copy back on that same stream, same size, while the copy
// stream may still be draining forward's copies; then main allocates the gradient of the same
// shape while the block just copied back waits for main. Without this those requests grow memory
// (or move pages between the streams' ranges) while the parked blocks are memory in flight.
// With `reuse_parked` (CACHEALLOC_CONF; on by default since session 40, `reuse_parked:False`
// turns it off) allocate() first looks among the frees parked behind its stream
// (`StreamWaits::sizes`, by block size: sizes in [request, request + 1/32], at most four asked)
// for one whose other events completed; the block becomes a live allocation again, owned by its
// old stream as the policy knows it, with S as a stream that used it (so its next free waits for
// S; find() reports S). The parked free stays in pending_ as `reused`, holding no bytes, until
// its queued events completed (the poll releases them; the flushes release them without
// waiting): the queues need no change. A policy never sees any of it: to the policy the block
// stayed allocated.
// With `reuse_parked_waits` (on by default since session 41; False takes only frees whose other
// streams are done) it also takes a free whose other streams are not done yet, by making S wait
// for their events on the device (stream_wait_event: cudaStreamWaitEvent, the host does not
// block), as a stream-ordered pool does when it reuses memory across streams (cudaMallocAsync's
// internal dependencies); a backend that cannot, or a capture underway, needs the events
// complete. Replayed with each late free waiting for the other stream (cachealloc-replay
// --late-frees-on-other-stream), two offload recordings refused 89% and 94% of the candidates for
// their own stream's event without it. Its GPU test (tests/gpu/test_record_stream.cpp) keeps
// both streams busy and checks that S's later work did not run under the other stream's kernel;
// it raced and passed on every policy in session 41, with events and with host fences.
// On H100s (bench/results/defrag_session40_2026-12-06.md, defrag_session41_2026-12-06.md),
// offload_train, peak device MiB and the share of the step in the allocator, medians:
//   10 steps: without reuse 11,136, 7.09%; completed frees only 10,256-11,212, 5.33-12.90%; with
//             device waits 10,268-11,316, 4.85-7.58% (expandable segments 13,134-13,274)
//   30 steps: without reuse 15,953-16,219, 5.56-5.79%; completed frees only 11,193-12,543,
//             5.19-9.29%; with device waits 12,604-13,347, 2.48-2.96% (expandable 14,744-15,134)
// The waits reuse 53-55 frees per step instead of 12-20. Over 30 steps they held 2.2 GB more
// than completed frees only in session 41's first call (2 runs each: more pages created beyond
// the slack while the copy stream, now ordered after main's work, kept its holes pending), about
// the same across session 40's calls. The other multi-stream jobs reuse few or none and stay
// within their spread.
//
// Note [Waiting for frees in flight instead of growing]
// Parked frees are memory in flight: a job that offloads activations to the host frees each one
// once its copy is queued, and the block comes back only when the copy stream got there. The
// further the host runs ahead of the GPU, the more is in flight, and a policy that grows for
// it keeps that memory (bench/e2e offload_train on the H200: 4.6 GB allocated and 8 GB parked at
// the peak, bench/results/defrag_session31_2026-12-05.md). `wait_parked_to_grow:R`
// (CACHEALLOC_CONF, off by default; a policy with hold_growth(), policy.h: defrag) turns that
// growth into waiting: while the parked bytes exceed R x the allocated bytes, allocate() first
// asks the policy with its growth held (mapped holes only, no page created or moved); when that
// fails it waits for the oldest parked frees until the request's size came back, hands back what
// else completed, and asks again; the policy grows only once the parked bytes fell to the limit
// or nothing is parked. The host then waits for the GPU inside the allocator: memory for time.
// Measured in bench/e2e (peak device MiB, median; allocator share of the step, the waits
// included; step time), bench/results/defrag_session32_2026-12-05.md:
//   offload_train, H200, 4 runs: R = 0: 5,628 vs 15,263 for defrag without it (expandable
//     segments 14,004); 83% of the step in the allocator, nearly all of it waiting (the host had
//     been that far ahead); step 112.6 vs 107.7 ms (expandable 106.4): the GPU idles at times.
//   offload_train, H100, 3 runs: R = 0.5: 8,252 vs 11,316 (expandable 12,654), 29%, step 111.1
//     vs 111.8 ms; R = 1: 10,658, 13%.
//   stream_weights: R = 0 on an H200 5,404 vs 8,102 (50%); R = 0.5 on an H100 5,432 vs 7,974
//     (31%); steps within the spread. The pipeline and comm_overlap: unchanged (their growths
//     find nothing parked beyond the limit, or never wait).
// So it is a setting for jobs that are short of memory, not a default: the acceptance bar of 1%
// of the step inside the allocator counts the waits. How much is in flight follows how fast the
// allocator grows (bench/results/defrag_session38_2026-12-06.md): offload_train over 30 steps on
// an H100 held less in flight under defrag with expandable segments' growth (a handle per 20 MiB,
// each its own access call while the copies run) than under defrag's few large handles (12.2-12.5
// GB active against 14.5): a slow growth holds the host back while the copy stream drains, as
// these waits do, and costs as much (13% of the step).
//
// Note [Cheap statistics on the fast path]
// A cached alloc+free pair is a few dozen instructions of real work, and keeping five PyTorch
// statistics (current, peak, cumulative each) was a quarter of it (cachealloc-micro, pair/512 on
// the 2-core machine: 35 -> 26 ns without them). So the front end keeps three tallies
// (allocated bytes, requested bytes, allocations) that write current and peak per increase and
// derive the cumulative increases (Tally), and derives `active` (allocated + frees parked for
// other streams) instead of keeping it: it equals allocated while nothing is parked, so its
// peak is max(allocated's peak, the highest allocated + parked seen while something was
// parked). stats() assembles the usual Stats (snapshot()); check_invariants compares both with
// the pointer map and pending_.
//
// Note [The step memo]
// Inside a training step each call finds the CPU caches cold, so what it costs is the cache
// lines it touches: about 30 data and 55 code lines for a defrag pair through the pointer map,
// the tallies and the B+tree, 0.66 us per pair on the H200 (ResNet-50, 3.4% of its step). But a
// training loop repeats itself: ResNet-50's 2,424 calls per step come back in the same order,
// with the same sizes, and defrag (deterministic) puts them at the same addresses. So:
//   * Learning (step_memo.h, MemoLearner). One allocation in 8, by a hash of address, size and
//     stream, looks up how many calls ago the same call was made; when 16 of them agree on a
//     distance P, the learner keeps the last P calls in a ring and counts the calls in a row that
//     equal the call P before them (address, size, block size, stream), on one stream, with no
//     device mapping call (BackendCounters::mapping_calls) and no free parked behind another
//     stream. A difference restarts the count, not the ring (defrag's layout takes a few steps
//     to settle); 2P differing calls or 8P calls without success and it watches again. At P in
//     a row, and a policy whose placement depends only on the calls (placement_repeats():
//     defrag with one stream and no recent lists), the memo takes over with the ring.
//   * Serving. allocate() and deallocate() compare the call with the next one of the period; if
//     it is the same, they return (or accept) the period's address and step on: no policy, no
//     pointer map, no tallies (about 3 lines; cachealloc-cold-replay, e2e ResNet-50 recording,
//     1 MiB evicted between calls: 150 ns per pair against 368 without the memo).
//   * Why it is safe. Two consecutive equal periods W1, W2 of a valid run leave every address
//     live exactly when it was one period earlier (an address's calls alternate alloc/free; if
//     W1 began with its free, it was live before W1; the same calls in W2 need it live before
//     W2, so W1 ended with its allocation...), so the live blocks, and by induction every prefix
//     of later periods, are what they were at the same point of W2: every address the memo hands
//     out was free then and is free now. No page was mapped or unmapped during W2 nor since (the
//     memo makes no device call), so it is still mapped; one stream means stream order alone
//     makes reuse safe. (Only W2 need be quiet: the addresses served are W2's.)
//   * Catching up (memo_sync). Whenever something needs the true state (check_invariants, find,
//     segments, reset_peak_stats, reset_accumulated_stats) the calls served are applied: whole
//     periods only to the cumulative statistics (a period ends where it began; one is tallied
//     for the peaks), the rest one by one through the real path. The policy, with the same live
//     blocks and pages as when it executed W2, places them where it did then; memo_apply checks
//     that every address agrees and throws InvariantError otherwise (the tests drive a twin with
//     step_memo:False through the same calls and compare every address and statistic). Then the
//     memo goes on. stats() needs no catching up: it tallies the served calls on copies.
//   * Leaving. A call that differs from the period, record_stream, empty_cache,
//     set_memory_fraction or an observer: catch up, stop serving and learn again. So a double
//     free or a foreign pointer meets the normal checks.
// On the H200 (bench/results/e2e_h200_2026-12-03_session11c.md, ..._session11d.md): ResNet-50's
// allocator time 663 -> 200 and 1,040 -> 274 us per step (3.25% -> 1.04%, 3.46% -> 1.05%; a step
// served costs 0.6-0.9%; the memo starts at the third measured step, once defrag's layout has
// settled and one period matched). Learning costs nothing measurable on jobs that never repeat
// (GPT-2 0.96% against 0.94%, 0.92% against 0.89%); two streams are never served. The memo holds
// at most 2 x 32,768 calls of 32 bytes (ring and period, 2 MiB) and a 128 KiB table per device.
// `step_memo:False` (CACHEALLOC_CONF) turns it off; a policy without placement_repeats() refuses
// step_memo:True.
//
// Note [Learning only while placement can repeat]
// The memo serves only a policy whose placement repeats (placement_repeats(): defrag with one
// stream), and a policy that said no once says no for good (defrag never forgets a stream). Yet
// the learner went on watching such jobs: every eighth allocation looked up its table and, when
// a candidate period turned up, every call went into the ring, only to be refused at the end.
// So the first call the learner is shown after the policy said no stops the learning for the
// allocator's life, on a flag that sits with the hot fields (memo_enabled_, with the cold state,
// stays for the settings and the statistics). cachealloc-cold-replay on the e2e pipeline
// recording (two streams; 4 MiB evicted between calls; this 2-core VM, medians of 3 and 5 runs):
// an allocation cost 1,053 ns against 934 with step_memo:False before, 1,016 against 1,040 after.
//
// Note [Retry chain on out-of-memory]
// 1. policy.allocate()                       -- cached block, or a new device reservation
// 2. flush_pending(wait=true)                -- wait for parked cross-stream frees, retry
// 3. policy.release_cached()                 -- give wholly free reservations back, retry
// 4. throw OutOfMemory with requested/capacity/free/allocated/reserved-but-unallocated + hint
// Each step is a separate member (try_allocate, flush_pending, release_and_retry), tested on its
// own in tests/core.
//
// Note [Pool attributes in the stats]
// For a policy that takes its memory from a stream-ordered pool (policy async: it has
// pool_calls()) stats() also reads the pool's own attributes
// (Stats::pool), under the same lock as everything else, so one snapshot is consistent:
//   * reserved_bytes.current == pool reserved_mem_current, and reserved_bytes.peak ==
//     reserved_mem_high: the policy reads the attribute lazily, stats() reads both first, and
//     reset_peak_stats() resets the pool's high watermarks with the front end's peaks (Note
//     [Reserved bytes read lazily], async.h).
//   * active_bytes.current + front_cache_bytes <= used_mem_current <= reserved_mem_current:
//     every byte the policy took from the pool is live, parked for another stream, or in its
//     front cache; the driver may round a request up, and counts a freed block as used until the
//     free is known complete, so `used` may exceed that sum while frees are in flight.
//   * Once every block is freed, the streams synchronised and empty_cache() ran, both
//     used_mem_current and front_cache_bytes are 0.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/config.h>
#include <cachealloc/errors.h>
#include <cachealloc/hot_pages.h>
#include <cachealloc/pointer_map.h>
#include <cachealloc/policy.h>
#include <cachealloc/spin_mutex.h>
#include <cachealloc/stats.h>
#include <cachealloc/step_memo.h>
#include <cachealloc/types.h>

#include <algorithm>
#include <array>
#include <concepts>
#include <deque>
#include <cstddef>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cachealloc {

/// What a live allocation looks like from outside (for getBaseAllocation, snapshots, tests).
struct AllocationInfo {
  void* ptr = nullptr;
  std::size_t requested = 0;
  std::size_t block_size = 0;
  StreamId stream = 0;
};

/// Something the front end tells observers (trace recording, memory_viz history).
enum class AllocatorEvent : std::uint8_t { alloc, free_requested, free_completed, oom };
using AllocatorObserver =
    std::function<void(AllocatorEvent, std::uintptr_t addr, std::size_t size, StreamId stream)>;

/// One device's allocator, whatever the policy. Thread-safe.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;

  /// A block of at least `bytes` usable on `stream`. bytes == 0 returns nullptr.
  /// Throws OutOfMemory (after the retry chain) or DeviceError.
  [[nodiscard]] virtual void* allocate(std::size_t bytes, StreamId stream) = 0;
  /// Frees `ptr` (nullptr: no-op). Throws UsageError, before changing anything, when `ptr` is
  /// not a live allocation of this allocator (double free, foreign pointer).
  virtual void deallocate(void* ptr) = 0;
  /// `ptr` is also used on `stream`: its free waits for work queued there (Note [Cross-stream frees]).
  virtual void record_stream(void* ptr, StreamId stream) = 0;
  /// Waits for parked frees and returns every wholly free reservation to the device.
  virtual void empty_cache() = 0;
  /// Limits reserved memory to fraction * total device memory (PyTorch semantics).
  virtual void set_memory_fraction(double fraction) = 0;
  [[nodiscard]] virtual double memory_fraction() const = 0;

  [[nodiscard]] virtual Stats stats() const = 0;
  virtual void reset_peak_stats() = 0;
  virtual void reset_accumulated_stats() = 0;
  /// Throws InvariantError when the policy or the front end is inconsistent.
  virtual void check_invariants() const = 0;
  [[nodiscard]] virtual std::optional<AllocationInfo> find(const void* ptr) const = 0;
  /// Live allocations, parked frees and cached blocks as segments (empty if the policy cannot).
  [[nodiscard]] virtual std::vector<SegmentView> segments() const = 0;
  /// Number of frees parked waiting for other streams.
  [[nodiscard]] virtual std::size_t pending_frees() const = 0;
  virtual void set_observer(AllocatorObserver observer) = 0;

  /// What the policy can tell about its decisions, as a JSON object ("{}" when nothing): policy
  /// defrag gives its slack's history (Note [A history of the slack]).
  [[nodiscard]] virtual std::string policy_report_json() const { return "{}"; }

  [[nodiscard]] virtual std::string_view policy_name() const noexcept = 0;
  [[nodiscard]] virtual DeviceBackend& backend() noexcept = 0;
  [[nodiscard]] virtual int device() const noexcept = 0;
};

/// Builds the out-of-memory message (PyTorch style) shared by every front end.
std::string out_of_memory_message(int device, std::string_view policy, std::size_t requested,
                                  const DeviceBackend& backend, const Stats& stats,
                                  std::string_view hint);

/// Requests above this (256 TiB) are refused as out-of-memory before any policy sees them.
inline constexpr std::size_t kMaxRequestBytes = std::size_t{1} << 48;

// Note [Slow paths out of line]
// Inside a training step each allocator call finds its code cold too (Note [Hot fields first]):
// what it costs is the cache lines it executes. Errors, the observer, parking and the retry
// chain, inlined into allocate() and deallocate(), spread their fast paths over more lines
// (cachegrind, resnet50 with the caches evicted before every call: 8.2 code lines per free,
// 5.5 per alloc). Out of line and marked cold, they leave the fast paths contiguous.
#if defined(__GNUC__)
#define CACHEALLOC_SLOW_PATH __attribute__((noinline, cold))
#else
#define CACHEALLOC_SLOW_PATH
#endif

// Made with `new`, the front end lives on the allocator's regions (hot::Object, Note
// [Bookkeeping on few pages], hot_pages.h), beside its pointer map and the policy's nodes.
template <Policy P>
class alignas(64) CachingAllocator final : public DeviceAllocator, public hot::Object<CachingAllocator<P>> {
  static constexpr std::uint16_t kDefaultPollInterval = 1;
 public:
  /// Takes ownership of `backend`; the policy takes its keys from `config`.
  CachingAllocator(std::unique_ptr<DeviceBackend> backend, Config& config)
      : backend_(std::move(backend)), policy_(*backend_, config) {
    if (auto v = config.take_int("event_poll_interval", 1, 1024)) {  // Note [Polling parked frees]
      poll_interval_ = static_cast<std::uint16_t>(*v);
    }
    if (auto v = config.take_bool("share_events")) {  // Note [Events shared by a burst of parked frees]
      share_events_ = *v;
    }
    if (auto v = config.take_bool("reuse_parked")) {  // Note [Reusing a parked free on the stream it waits for]
      reuse_parked_ = *v;
    }
    if (auto v = config.take_bool("reuse_parked_waits")) {  // the same Note
      reuse_waits_ = *v;
    }
    if (auto v = config.take_bool("defer_frees")) {  // Note [Frees handed over at the next allocation]
      defer_frees_ = *v;
    }
    // Note [The step memo]: on by default for a policy whose placement is deterministic.
    memo_enabled_ = memo_capable();
    if (auto v = config.take_bool("step_memo")) {
      if (*v && !memo_capable()) {
        throw ConfigError("step_memo:True: policy " + std::string(P::kName) +
                          " does not support the step memo (its placement depends on more than the "
                          "calls: stream-ordered pools, recently freed lists, timing); use defrag");
      }
      memo_enabled_ = *v;
    }
    memo_learning_ = memo_enabled_;
    // Note [Waiting for frees in flight instead of growing]
    if (auto v = config.take_double("wait_parked_to_grow", 0.0, 1024.0)) {
      if (!kHoldsGrowth) {
        throw ConfigError("wait_parked_to_grow: policy " + std::string(P::kName) +
                          " cannot hold back a growth; use defrag");
      }
      wait_parked_ratio_ = *v;
    }
  }

  ~CachingAllocator() override {
    // Give everything back: parked frees complete (the process is done with them), then caches.
    try {
      std::lock_guard lock(mutex_);
      memo_sync();
      flush_pending(/*wait=*/true);
      policy_.release_cached();
    } catch (...) {  // NOLINT(bugprone-empty-catch): destructors must not throw
    }
  }

  [[nodiscard]] void* allocate(std::size_t bytes, StreamId stream) override {
    if (bytes == 0) {
      return nullptr;
    }
    if (bytes > kMaxRequestBytes) {
      refuse_huge(bytes);
    }
    std::lock_guard lock(mutex_);
    if (deferred_count_ != 0) [[unlikely]] {  // Note [Frees handed over at the next allocation]
      hand_over_deferred();
    }
    if (unrecorded_ != 0) [[unlikely]] {  // Note [Events shared by a burst of parked frees]
      record_burst();
    }
    if (memo_next_ != nullptr) {  // Note [The step memo]
      const MemoOp& e = *memo_next_;
      if (e.requested == bytes && e.stream == stream) {
        memo_advance();
        return reinterpret_cast<void*>(e.ptr);
      }
      memo_leave();
    }
    if ((parked_count_ | reused_count_) != 0 && ++allocs_since_poll_ >= poll_interval_) {  // Note [Polling parked frees]
      poll_pending();
    }
    if (reuse_parked_ && parked_count_ != 0) {  // Note [Reusing a parked free on the stream it waits for]
      if (void* ptr = reuse_parked(bytes, stream)) {
        return ptr;
      }
    }
    Block block;
    try {
      if (parked_count_ != 0 && parked_over_limit()) {
        block = allocate_before_growth(bytes, stream);
      } else {
        block = try_allocate(bytes, stream);
      }
      if (!block) {
        block = retry_allocate(bytes, stream);
      }
    } catch (...) {
      // A DeviceError from the policy (or the retry chain) may come after the policy already
      // changed its reservations: keep reserved_bytes in step before reporting it.
      sync_reserved();
      throw;
    }
    account_allocation(block, bytes, stream);
    if (parked_count_ != 0) {  // active = allocated + parked exceeds allocated only now
      note_active_peak();
    }
    sync_reserved();
    if (observer_) [[unlikely]] {
      notify(AllocatorEvent::alloc, reinterpret_cast<std::uintptr_t>(block.ptr), bytes, stream);
    }
    if (memo_learning_) {  // Note [The step memo]
      const MemoOp op{reinterpret_cast<std::uintptr_t>(block.ptr), bytes, block.size, stream};
      if (learner_.wants(op)) {
        memo_observe(op);
      }
    }
    return block.ptr;
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) {
      return;
    }
    std::lock_guard lock(mutex_);
    const auto key = reinterpret_cast<std::uintptr_t>(ptr);
    if (memo_next_ != nullptr) {  // Note [The step memo]
      const MemoOp& m = *memo_next_;
      if (m.ptr == key && m.is_free()) {
        if (unrecorded_ != 0) [[unlikely]] {
          record_burst();
        }
        memo_advance();
        return;
      }
      memo_leave();
    }
    Entry e;
    if (!map_.take(key, e)) {
      refuse_unknown(ptr, "free");
    }
    if (unrecorded_ != 0 && e.other_streams == nullptr) [[unlikely]] {
      record_burst();  // the burst of parked frees ended (Note [Events shared by a burst of parked frees])
    }
    account_free(e);
    if (observer_) [[unlikely]] {
      notify(AllocatorEvent::free_requested, key, e.requested, e.stream);
    }
    if (e.other_streams == nullptr && defer_frees_ && !memo_learning_ && !observer_) [[unlikely]] {
      // Note [Frees handed over at the next allocation]
      count_freed(e.block);
      deferred_[deferred_count_++] = DeferredFree{e.block, e.stream};
      ++deferred_total_;
      if (deferred_count_ == kDeferredFrees) {
        hand_over_deferred();
      }
      return;
    }
    if (deferred_count_ != 0) [[unlikely]] {  // the policy sees the frees in the order they came
      hand_over_deferred();
    }
    if (e.other_streams == nullptr) {
      complete_free(e.block, e.requested, e.stream);
      if (memo_learning_ && learner_.verifying()) {  // Note [The step memo]
        memo_observe(MemoOp{key, MemoOp::kFree | e.requested, e.block.size, e.stream});
      }
    } else {
      park(std::move(e));
      if (memo_learning_) {
        learner_.restart();  // a free behind another stream's work: not a repeatable call
      }
    }
    sync_reserved();
  }

  void record_stream(void* ptr, StreamId stream) override {
    std::lock_guard lock(mutex_);
    memo_leave();
    Entry* entry = map_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (entry == nullptr) {
      refuse_unknown(ptr, "record_stream");
    }
    if (stream == entry->stream) {
      return;
    }
    if (entry->other_streams == nullptr) {
      entry->other_streams = std::make_unique<std::vector<StreamId>>();
    }
    for (StreamId s : *entry->other_streams) {
      if (s == stream) {
        return;
      }
    }
    entry->other_streams->push_back(stream);
  }

  void empty_cache() override {
    std::lock_guard lock(mutex_);
    hand_over_deferred();
    memo_leave();
    flush_pending(/*wait=*/true);
    policy_.release_cached();
    sync_reserved();
  }

  void set_memory_fraction(double fraction) override {
    if (!(fraction > 0.0 && fraction <= 1.0)) {
      throw ConfigError("memory fraction must be in (0, 1], got " + std::to_string(fraction));
    }
    std::lock_guard lock(mutex_);
    memo_leave();
    fraction_ = fraction;
    backend_->set_limit(static_cast<std::size_t>(fraction * static_cast<double>(backend_->total_memory())));
  }
  [[nodiscard]] double memory_fraction() const override {
    std::lock_guard lock(mutex_);
    return fraction_;
  }

  [[nodiscard]] Stats stats() const override {
    std::lock_guard lock(mutex_);
    const_cast<CachingAllocator*>(this)->hand_over_deferred();  // logically const: same live blocks
    refresh_reserved();
    Stats s = snapshot();
    const BackendCounters& c = backend_->counters();
    s.num_device_alloc = c.reserve_calls + c.physical_creates;
    s.num_device_free = c.release_calls + c.physical_releases;
    s.num_maps = c.map_calls;
    s.num_unmaps = c.unmap_calls;
    s.bytes_mapped = c.mapped_bytes;
    s.bytes_unmapped = c.unmapped_bytes;
    s.num_event_records = c.events_recorded;
    s.num_event_queries = c.event_queries;
    s.event_ns = c.event_ns;
    s.reserve_ns = c.reserve_ns;
    s.release_ns = c.release_ns;
    s.create_ns = c.create_ns;
    s.release_physical_ns = c.release_physical_ns;
    s.map_ns = c.map_ns;
    s.unmap_ns = c.unmap_ns;
    const BackgroundWork bg = backend_->background_work();
    s.background_unmaps = bg.unmaps;
    s.background_unmap_ns = bg.busy_ns;
    s.background_unmap_wait_ns = bg.blocked_ns;
    s.background_event_records = bg.event_records;
    s.background_event_ns = bg.event_ns;
    s.background_event_queries = bg.event_queries;
    s.background_event_query_ns = bg.event_query_ns;
    if constexpr (requires(const P& p) { p.stat_counters(); }) {
      s.policy_counters = policy_.stat_counters();
    }
    if (memo_enabled_ || memo_entries_ != 0) {  // Note [The step memo]
      const auto v = [](std::uint64_t x) { return static_cast<std::int64_t>(x); };
      s.policy_counters.insert(s.policy_counters.end(),
                               {{"memo.served", v(memo_served_total_ + memo_served_)},
                                {"memo.entries", v(memo_entries_)},
                                {"memo.exits", v(memo_exits_)},
                                {"memo.replayed", v(memo_replayed_)},
                                {"memo.period", v(memo_next_ != nullptr ? memo_.size() : 0)},
                                {"memo.verify_started", v(learner_.outcomes().started)},
                                {"memo.verify_differed", v(learner_.outcomes().differed)},
                                {"memo.verify_not_quiet", v(learner_.outcomes().not_quiet)},
                                {"memo.verify_stream", v(learner_.outcomes().stream)},
                                {"memo.verify_interrupted", v(learner_.outcomes().interrupted)},
                                {"memo.verify_gave_up", v(learner_.outcomes().gave_up)}});
    }
    if (defer_frees_) {  // Note [Frees handed over at the next allocation]
      s.policy_counters.emplace_back("front.deferred_frees", static_cast<std::int64_t>(deferred_total_));
    }
    if constexpr (requires(const P& p) { p.pool_calls(); }) {  // the policy lives on the pool
      if (StreamOrderedMemory* pool = backend_->stream_ordered()) {
        s.pool = pool_figures(*pool);  // Note [Pool attributes in the stats]
      }
    }
    return s;
  }
  void reset_peak_stats() override {
    std::lock_guard lock(mutex_);
    memo_sync();  // the peaks restart from the true current figures
    refresh_reserved();
    if constexpr (requires(P& p) { p.reset_reserved_high(); }) {
      policy_.reset_reserved_high();  // Note [Reserved bytes read lazily]
    }
    stats_.reserved_bytes.reset_peak();
    allocated_.reset_peak();
    requested_.reset_peak();
    allocation_.reset_peak();
    active_peak_bytes_ = allocated_.current + parked_bytes_;
    active_peak_count_ = allocation_.current + parked_count_;
  }
  void reset_accumulated_stats() override {
    std::lock_guard lock(mutex_);
    memo_sync();  // the served calls count in the figures being reset
    stats_.reserved_bytes.reset_accumulated();
    allocated_.reset_accumulated();
    requested_.reset_accumulated();
    allocation_.reset_accumulated();
    active_freed_bytes_ = active_freed_count_ = 0;
    stats_.num_alloc_retries = stats_.num_ooms = stats_.num_sync_all_streams = 0;
    stats_.parked_waits = stats_.parked_wait_ns = 0;
    stats_.parked_reuses = stats_.parked_reuse_bytes = stats_.parked_reuse_waits = 0;
  }

  void check_invariants() const override {
    std::lock_guard lock(mutex_);
    const_cast<CachingAllocator*>(this)->memo_sync();  // logically const: same live blocks
    refresh_reserved();
    policy_.check_invariants();
    std::size_t allocated = 0;
    std::size_t requested = 0;
    map_.for_each([&](std::uintptr_t key, const Entry& e) {
      CACHEALLOC_CHECK_INVARIANT(reinterpret_cast<std::uintptr_t>(e.block.ptr) == key,
                                 "pointer map key differs from its block");
      CACHEALLOC_CHECK_INVARIANT(e.block.size >= e.requested, "block smaller than its request");
      allocated += e.block.size;
      requested += e.requested;
    });
    std::size_t parked = 0;
    std::size_t gone = 0;
    std::size_t reused = 0;
    std::vector<std::uintptr_t> parked_ptrs;
    for (const Parked& p : pending_) {
      if (p.gone) {
        ++gone;
        continue;
      }
      if (p.reused) {  // Note [Reusing a parked free on the stream it waits for]
        CACHEALLOC_CHECK_INVARIANT(p.own_event == 0 && p.outstanding != 0,
                                   "a reused parked free holds its own event or no event at all");
        ++reused;
        continue;
      }
      parked += p.block.size;
      const auto key = reinterpret_cast<std::uintptr_t>(p.block.ptr);
      CACHEALLOC_CHECK_INVARIANT(map_.find(key) == nullptr, "a parked free's block is also live");
      parked_ptrs.push_back(key);
    }
    std::sort(parked_ptrs.begin(), parked_ptrs.end());
    CACHEALLOC_CHECK_INVARIANT(std::adjacent_find(parked_ptrs.begin(), parked_ptrs.end()) == parked_ptrs.end(),
                               "a block parked twice");
    CACHEALLOC_CHECK_INVARIANT(reused == reused_count_, "reused parked frees miscounted");
    check_waits(gone);
    CACHEALLOC_CHECK_INVARIANT(static_cast<std::int64_t>(allocated) == allocated_.current,
                               "allocated_bytes stat disagrees with the pointer map");
    CACHEALLOC_CHECK_INVARIANT(static_cast<std::int64_t>(requested) == requested_.current,
                               "requested_bytes stat disagrees with the pointer map");
    CACHEALLOC_CHECK_INVARIANT(static_cast<std::int64_t>(map_.size()) == allocation_.current,
                               "allocation stat disagrees with the pointer map");
    CACHEALLOC_CHECK_INVARIANT(static_cast<std::int64_t>(parked) == parked_bytes_ &&
                                   static_cast<std::int64_t>(pending_.size() - gone - reused) == parked_count_,
                               "parked bytes or count disagree with the parked frees");
    const Stats s = snapshot();
    CACHEALLOC_CHECK_INVARIANT(s.active_bytes.current >= s.allocated_bytes.current &&
                                   s.active_bytes.peak >= s.active_bytes.current &&
                                   s.allocated_bytes.peak >= s.allocated_bytes.current,
                               "active or peak statistics below their current values");
    CACHEALLOC_CHECK_INVARIANT(
        static_cast<std::int64_t>(policy_.reserved_bytes()) == stats_.reserved_bytes.current,
        "reserved_bytes stat disagrees with the policy");
    CACHEALLOC_CHECK_INVARIANT(allocated + parked <= policy_.reserved_bytes(),
                               "more bytes handed out than reserved");
  }

  [[nodiscard]] std::optional<AllocationInfo> find(const void* ptr) const override {
    std::lock_guard lock(mutex_);
    const_cast<CachingAllocator*>(this)->memo_sync();  // logically const: same live blocks
    const Entry* e = map_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (e == nullptr) {
      return std::nullopt;
    }
    const StreamId stream = e->reused ? e->other_streams->front() : e->stream;
    return AllocationInfo{e->block.ptr, e->requested, e->block.size, stream};
  }

  [[nodiscard]] std::vector<SegmentView> segments() const override {
    std::lock_guard lock(mutex_);
    const_cast<CachingAllocator*>(this)->memo_sync();  // logically const: same live blocks
    std::vector<SegmentView> out;
    if constexpr (requires(const P& p) { p.visit_segments([](const SegmentView&) {}); }) {
      policy_.visit_segments([&](const SegmentView& s) { out.push_back(s); });
    }
    return out;
  }

  [[nodiscard]] std::string policy_report_json() const override {
    if constexpr (requires(const P& p) {
                    { p.report_json() } -> std::convertible_to<std::string>;
                  }) {
      std::lock_guard lock(mutex_);
      const_cast<CachingAllocator*>(this)->memo_sync();  // the policy as if it served every call
      return policy_.report_json();
    } else {
      return "{}";
    }
  }

  [[nodiscard]] std::size_t pending_frees() const override {
    std::lock_guard lock(mutex_);
    return static_cast<std::size_t>(parked_count_);
  }

  void set_observer(AllocatorObserver observer) override {
    std::lock_guard lock(mutex_);
    hand_over_deferred();  // an observer sees every call from now on
    memo_leave();  // an observer sees every call: the memo stays off while there is one
    observer_ = std::move(observer);
  }

  [[nodiscard]] std::string_view policy_name() const noexcept override { return P::kName; }
  [[nodiscard]] DeviceBackend& backend() noexcept override { return *backend_; }
  [[nodiscard]] int device() const noexcept override { return backend_->device(); }

  /// The policy itself, for policy-specific tests (not thread-safe: hold no other calls).
  /// Brings the policy up to date with calls the step memo served (Note [The step memo]).
  [[nodiscard]] P& policy() {
    memo_sync();
    return policy_;
  }

  // ---- the retry chain's steps (Note [Retry chain on out-of-memory]); caller holds mutex_ ----
  Block try_allocate(std::size_t bytes, StreamId stream) { return policy_.allocate(bytes, stream); }

  /// Hands parked frees whose events completed to the policy; with `wait`, waits for all.
  /// Without `wait`, one event found incomplete on a stream stops the queries on that stream
  /// for this pass (Note [One query per busy stream]).
  void flush_pending(bool wait) {
    record_burst();
    std::exception_ptr first_error;
    std::size_t kept = 0;
    BusyStreams busy;
    for (std::size_t i = 0; i < pending_.size(); ++i) {
      Parked& p = pending_[i];
      if (p.gone) {
        continue;  // handed back by poll_pending: erased here
      }
      if (p.reused) {
        drop_reused(p);  // its block is live again: its events are not waited for
        continue;
      }
      bool done = false;
      try {
        done = events_done(p, wait, busy);
      } catch (...) {  // a failed query/wait: keep the block parked, report after the loop
        if (!first_error) {
          first_error = std::current_exception();
        }
      }
      if (done) {
        hand_back(p, wait);
      } else {
        if (kept != i) {
          pending_[kept] = std::move(p);
        }
        ++kept;
      }
    }
    pending_.resize(kept);
    gone_ = 0;
    rebuild_waits();
    note_parked_to_policy();
    if (wait) {
      ++stats_.num_sync_all_streams;
      if (first_error) {
        std::rethrow_exception(first_error);
      }
    }
  }

 private:
  struct Entry {
    Block block;
    std::size_t requested;
    StreamId stream;
    /// Null until record_stream names another stream: one pointer keeps the map's slots small
    /// (a free probes one at random among all live blocks).
    std::unique_ptr<std::vector<StreamId>> other_streams;
    /// A parked free taken again on another stream (Note [Reusing a parked free on the stream it
    /// waits for]): `stream` is the policy's (the block's old stream), the allocation's is
    /// (*other_streams)[0], which find() reports.
    bool reused = false;
  };
  struct Parked {
    Block block;
    std::size_t requested;
    StreamId stream;
    std::vector<StreamId> streams;  // the other streams that used the block
    std::vector<EventId> events;    // events[i] recorded on streams[i]; 0 once completed
    bool needs_events;              // some events could not be recorded yet
    EventId own_event = 0;          // on `stream` at the free (Note [Frees that come back settled])
    std::uint64_t seq = 0;          // order of parking: pending_ is sorted by it
    std::uint32_t outstanding = 0;  // events not yet seen complete (kept by poll_pending)
    bool gone = false;              // handed back by poll_pending, not yet erased from pending_
    bool unrecorded = false;        // its events wait for the burst's (record_burst)
    // Taken again by an allocation on a stream it waited for (Note [Reusing a parked free on the
    // stream it waits for]): holds no bytes, only its events until they complete.
    bool reused = false;
  };
  /// An event several parked frees wait for (Note [Events shared by a burst of parked frees]).
  struct SharedEvent {
    EventId event;
    std::uint32_t holders;  // parked frees still holding it
  };
  /// One event of a parked free that has not completed: Note [Parked frees by stream].
  /// Parked frees waiting for one stream, by block size (reuse_parked only): size -> seq.
  using SizeIndex = std::multimap<std::size_t, std::uint64_t>;
  struct Waiting {
    EventId event;
    std::uint64_t seq;   // the parked free's
    std::uint32_t slot;  // its index in the parked free's events
    SizeIndex::iterator by_size{};  // its entry in the stream's `sizes` (reuse_parked only)
  };
  struct StreamWaits {
    StreamId stream;
    std::deque<Waiting> fifo;  // in the order the events were recorded on the stream
    SizeIndex sizes;           // one entry per fifo entry when reuse_parked is on
  };

  /// The pool's attributes and the policy's share of them; nullopt when the device cannot answer
  /// (stats() must not fail because of them). Caller holds mutex_.
  std::optional<Stats::PoolFigures> pool_figures(const StreamOrderedMemory& pool) const {
    Stats::PoolFigures f;
    try {
      f.reserved_mem_current = pool.reserved_current();
      f.reserved_mem_high = pool.reserved_high();
      f.used_mem_current = pool.used_current();
      f.used_mem_high = pool.used_high();
    } catch (...) {
      return std::nullopt;
    }
    if constexpr (requires(const P& p) { p.cached_bytes(); }) {
      f.front_cache_bytes = policy_.cached_bytes();
    }
    f.pool_calls = policy_.pool_calls();
    if constexpr (requires(const P& p) { p.pool_ns(); }) {
      f.pool_ns = policy_.pool_ns();
    }
    return f;
  }

  CACHEALLOC_SLOW_PATH Block retry_allocate(std::size_t bytes, StreamId stream) {
    ++stats_.num_alloc_retries;
    if (parked_count_ != 0) {
      flush_pending(/*wait=*/true);
      if (Block b = try_allocate(bytes, stream)) {
        return b;
      }
    }
    if (policy_.release_cached() > 0) {
      sync_reserved();
      if (Block b = try_allocate(bytes, stream)) {
        return b;
      }
    }
    ++stats_.num_ooms;
    refresh_reserved();
    sync_reserved();
    if (observer_) {
      observer_(AllocatorEvent::oom, 0, bytes, stream);
    }
    std::string_view hint;
    if constexpr (requires { P::oom_hint(); }) {
      hint = P::oom_hint();
    }
    throw OutOfMemory(out_of_memory_message(backend_->device(), P::kName, bytes, *backend_, snapshot(), hint),
                      bytes);
  }

  /// Streams seen with an incomplete event in one flush_pending pass (a few; when full, the
  /// rest are simply queried).
  struct BusyStreams {
    std::array<StreamId, 8> ids{};
    std::size_t count = 0;
    [[nodiscard]] bool contains(StreamId s) const noexcept {
      return std::find(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(count), s) !=
             ids.begin() + static_cast<std::ptrdiff_t>(count);
    }
    void add(StreamId s) noexcept {
      if (count < ids.size()) {
        ids[count++] = s;
      }
    }
  };

  /// True when every stream that used `p` finished; with `wait`, waits for them.
  bool events_done(Parked& p, bool wait, BusyStreams& busy) {
    if (p.needs_events) {
      record_events(p);
      if (p.needs_events) {
        return false;
      }
    }
    for (std::size_t i = 0; i < p.events.size(); ++i) {
      EventId& ev = p.events[i];
      if (ev == 0) {
        continue;
      }
      if (wait) {
        wait_event(ev);
      } else if (busy.contains(p.streams[i])) {
        return false;  // recorded after an event of the same stream that has not completed
      } else if (ev != known_done_) {
        if (!backend_->query_event(ev)) {
          busy.add(p.streams[i]);
          return false;
        }
        known_done_ = ev;
      }
      release_event(ev);
      ev = 0;
    }
    return true;
  }

  /// The policy can refuse to create device memory for a while (policy.h, optional member).
  static constexpr bool kHoldsGrowth = requires(P& q, bool b) { q.hold_growth(b); };

  /// Note [Waiting for frees in flight instead of growing]: while the parked frees are over the
  /// limit, the policy may not grow; waits for the oldest of them, enough bytes at a time, and
  /// tries again; grows only once they are within the limit or none is left.
  CACHEALLOC_SLOW_PATH Block allocate_before_growth(std::size_t bytes, StreamId stream) {
    Block b;
    if constexpr (kHoldsGrowth) {
      struct Held {
        P& p;
        explicit Held(P& q) : p(q) { p.hold_growth(true); }
        ~Held() { p.hold_growth(false); }
        Held(const Held&) = delete;
        Held& operator=(const Held&) = delete;
      };
      std::uint64_t started = 0;
      while (parked_count_ != 0 && parked_over_limit()) {
        {
          Held held(policy_);
          b = try_allocate(bytes, stream);
        }
        if (b) {
          break;
        }
        if (started == 0) {
          started = backend_->clock_ns();
          ++stats_.parked_waits;
        }
        if (flush_oldest(bytes) == 0) {
          break;  // the oldest free's events could not be recorded yet: grow instead
        }
      }
      if (started != 0) {
        stats_.parked_wait_ns += backend_->clock_ns() - started;
      }
    }
    return b ? b : try_allocate(bytes, stream);
  }

  /// Whether the parked frees exceed wait_parked_to_grow x the allocated bytes (never when unset).
  [[nodiscard]] bool parked_over_limit() const noexcept {
    return wait_parked_ratio_ >= 0 &&
           static_cast<double>(parked_bytes_) > wait_parked_ratio_ * static_cast<double>(allocated_.current);
  }

  /// Waits for the oldest parked frees until at least `bytes` came back (or none is left), then
  /// hands back whatever else completed without waiting. Returns how many it waited for.
  std::size_t flush_oldest(std::size_t bytes) {
    record_burst();
    std::size_t back = 0;
    std::size_t i = 0;
    std::size_t waited = 0;
    BusyStreams none;
    try {
      for (; i < pending_.size() && back < bytes; ++i) {
        Parked& p = pending_[i];
        if (p.gone) {
          continue;
        }
        if (p.reused) {
          drop_reused(p);
          continue;
        }
        if (!events_done(p, /*wait=*/true, none)) {
          break;  // its events could not be recorded: it stays parked
        }
        back += p.block.size;
        hand_back(p, /*wait_own=*/false);
        ++waited;
      }
    } catch (...) {  // a failed wait: the blocks handed back so far leave pending_, the rest stay
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(i));
      gone_ = static_cast<std::size_t>(std::count_if(pending_.begin(), pending_.end(),
                                                     [](const Parked& p) { return p.gone; }));
      waits_stale_ = true;  // the next poll passes over pending_ and rebuilds them
      note_parked_to_policy();
      throw;
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(i));
    flush_pending(/*wait=*/false);  // also rebuilds the waits and tells the policy the parked bytes
    return waited;
  }

  /// Note [Reusing a parked free on the stream it waits for]: a free parked behind `stream` whose
  /// block fits `bytes` and whose other streams (its own included) are done with it becomes this
  /// allocation; nullptr when there is none (the caller asks the policy as usual).
  CACHEALLOC_SLOW_PATH void* reuse_parked(std::size_t bytes, StreamId stream) {
    if (waits_stale_) {
      return nullptr;  // the queues wait for a rebuild (a flush): no index to search
    }
    StreamWaits* w = find_waits(stream);
    if (w == nullptr) {
      return nullptr;
    }
    const std::size_t most = bytes + std::max(bytes / 32, std::size_t{511});
    constexpr int kTries = 4;  // candidates asked per allocation: a bounded cost when none fits
    int tries = 0;
    for (auto it = w->sizes.lower_bound(bytes); it != w->sizes.end() && it->first <= most && tries < kTries;
         ++it) {
      Parked& p = parked_by_seq(it->second);
      if (p.reused) {
        continue;  // taken already; its entry leaves with its event
      }
      ++tries;
      if (reusable_on(p, stream)) {
        return take_parked(p, bytes, stream);
      }
    }
    return nullptr;
  }

  /// Whether `stream` may take the parked block: every other stream that may touch it (the other
  /// streams that used it, and its own stream: the event at its free) is done with it, or
  /// `stream` was made to wait for the events of those that are not (stream_wait_event).
  bool reusable_on(Parked& p, StreamId stream) {
    if (p.gone || p.needs_events || p.unrecorded || p.own_event == 0 || p.stream == stream) {
      return false;
    }
    std::array<EventId, 4> busy{};
    std::size_t n = 0;
    auto note = [&](EventId ev) {
      if (event_done(ev)) {
        return true;
      }
      if (n == busy.size()) {
        return false;
      }
      busy[n++] = ev;
      return true;
    };
    for (std::size_t i = 0; i < p.events.size(); ++i) {
      if (p.streams[i] != stream && p.events[i] != 0 && !note(p.events[i])) {
        return false;
      }
    }
    if (!note(p.own_event)) {
      return false;
    }
    if (n != 0 && !reuse_waits_) {
      return false;  // reuse_parked_waits:False: only frees every other stream is done with
    }
    for (std::size_t i = 0; i < n; ++i) {
      bool queued = false;
      try {
        queued = backend_->stream_wait_event(stream, busy[i]);
      } catch (...) {  // NOLINT(bugprone-empty-catch): not reused; waits queued so far only order more
      }
      if (!queued) {
        return false;
      }
    }
    if (n != 0) {
      ++stats_.parked_reuse_waits;
    }
    return true;
  }

  /// The parked free `p` becomes a live allocation of `bytes` on `stream` (reusable_on said so).
  /// To the policy the block never left its old stream; `stream` is a stream that used it, so
  /// its next free waits for `stream`'s work. Returns nullptr, changing nothing, out of host memory.
  void* take_parked(Parked& p, std::size_t bytes, StreamId stream) {
    const auto key = reinterpret_cast<std::uintptr_t>(p.block.ptr);
    try {
      account_entry(Entry{p.block, bytes, p.stream, std::make_unique<std::vector<StreamId>>(1, stream), true});
    } catch (...) {  // bad_alloc: the policy serves this allocation instead
      return nullptr;
    }
    p.reused = true;
    ++reused_count_;
    release_event(p.own_event);
    p.own_event = 0;
    const auto size = static_cast<std::int64_t>(p.block.size);
    parked_bytes_ -= size;
    --parked_count_;
    active_freed_bytes_ += size;  // the parked free ends here (active = allocated + parked)
    ++active_freed_count_;
    ++stats_.parked_reuses;
    stats_.parked_reuse_bytes += static_cast<std::uint64_t>(size);
    note_parked_to_policy();
    if (memo_learning_) {
      learner_.restart();  // depends on the streams' progress: not a repeatable call
    }
    if (observer_) {  // a recording reads a completed free, then an allocation at its address
      notify(AllocatorEvent::free_completed, key, p.requested, p.stream);
      notify(AllocatorEvent::alloc, key, bytes, stream);
    }
    return p.block.ptr;
  }

  /// A reused parked free leaves pending_ (a flush): its events are released, not waited for.
  void drop_reused(Parked& p) noexcept {
    for (EventId& ev : p.events) {
      if (ev != 0) {
        release_event(ev);
        ev = 0;
      }
    }
    p.outstanding = 0;
    p.gone = true;
    --reused_count_;
  }

  /// A parked free whose other streams are done goes to the policy (settled when its own
  /// stream is done too; `wait_own` waits for that). The caller removes it from pending_.
  void hand_back(Parked& p, bool wait_own) {
    parked_bytes_ -= static_cast<std::int64_t>(p.block.size);
    --parked_count_;
    complete_free(p.block, p.requested, p.stream, own_stream_done(p, wait_own));
  }

  /// The policy takes frees that come back settled (policy.h, optional member).
  static constexpr bool kTakesSettled =
      requires(P& q, const Block& b, StreamId s) { q.deallocate_settled(b, s); };

  /// Whether the parked block's own stream finished the work queued before its free; destroys
  /// the event either way (Note [Frees that come back settled]). Never throws.
  bool own_stream_done(Parked& p, bool wait) noexcept {
    if (p.own_event == 0) {
      return false;
    }
    bool done = false;
    if (!wait) {
      done = event_done(p.own_event);
    } else {
      try {
        wait_event(p.own_event);
        done = true;
      } catch (...) {  // NOLINT(bugprone-empty-catch): not known to be done: an ordinary free
      }
    }
    release_event(p.own_event);
    p.own_event = 0;
    return done;
  }

  // Note [Frees handed over at the next allocation]
  // Inside a training step every allocator call finds the caches cold (Note [Hot fields
  // first]), and an allocation and a free each pay for the policy's lines: its index, its nodes,
  // its hot fields. With defer_frees:True (opt-in) a free that needs nothing else (no other
  // stream used the block, no observer, the step memo not learning) only updates the tallies and
  // appends the block here; the next allocation hands the deferred frees to the policy first,
  // while it touches the same lines for its own search, so the policy sees every call in the
  // order it came and places every block exactly where it would have (the tests compare a twin
  // without it call by call). Every other call that reads or changes the policy (stats,
  // empty_cache, queries, invariant checks, a free that parks) hands them over first; so do full
  // lists of kDeferredFrees. Measured on this project's 2-core VM (cachealloc-cold-replay on the
  // e2e pipeline recording, with and without it in one run, 5 interleaved runs, medians; caches
  // evicted before every call; session 45, bench/results/defrag_session45_2026-12-07.md): a defrag
  // pair 486 -> 458 ns with 1 MiB evicted and 2,265 -> 2,001 ns with 4 MiB; size_class 317 -> 328
  // and 1,802 -> 1,578. The free gets cheaper by half, the allocation dearer by a third of that.
  // On a GPU host it did not hold (session 46, H100, bench/e2e pipeline over 300 steps, 5 runs
  // each beside the default over two calls, bench/results/defrag_session46_2026-12-07.md): a step
  // without a device call spent 68.0-73.6 us in the allocator with it and 63.6-71.8 without.
  // Off by default; kept for hosts where the free's lines are what costs.
  struct DeferredFree {
    Block block;
    StreamId stream = 0;
  };
  static constexpr std::size_t kDeferredFrees = 8;
  void hand_over_deferred() noexcept {
    const std::size_t n = deferred_count_;
    deferred_count_ = 0;
    for (std::size_t i = 0; i < n; ++i) {
      policy_.deallocate(deferred_[i].block, deferred_[i].stream);
    }
    if (n != 0) {
      sync_reserved();
    }
  }

  /// A block no longer active: the tallies every completed free updates, deferred or not.
  void count_freed(const Block& block) noexcept {
    active_freed_bytes_ += static_cast<std::int64_t>(block.size);
    ++active_freed_count_;
  }

  void complete_free(const Block& block, std::size_t requested, StreamId stream, bool settled = false) {
    count_freed(block);
    if constexpr (kTakesSettled) {
      if (settled) {
        policy_.deallocate_settled(block, stream);
      } else {
        policy_.deallocate(block, stream);
      }
    } else {
      policy_.deallocate(block, stream);
    }
    if (observer_) [[unlikely]] {
      notify(AllocatorEvent::free_completed, reinterpret_cast<std::uintptr_t>(block.ptr), requested, stream);
    }
  }

  // ---- slow paths, out of line (Note [Slow paths out of line]) ----
  [[noreturn]] CACHEALLOC_SLOW_PATH void refuse_huge(std::size_t bytes) {
    // No device has 2^48 bytes; refusing here also keeps every policy's rounding from
    // wrapping around near 2^64.
    std::lock_guard lock(mutex_);
    ++stats_.num_ooms;
    throw OutOfMemory(out_of_memory_message(backend_->device(), P::kName, bytes, *backend_, snapshot(),
                                            "The request is larger than any GPU's memory."),
                      bytes);
  }
  /// Caller holds mutex_.
  [[noreturn]] CACHEALLOC_SLOW_PATH void refuse_unknown(const void* ptr, std::string_view what) {
    ++stats_.usage_errors;
    throw UsageError(unknown_pointer_message(ptr, what));
  }
  /// Note [Parked frees by stream]: the oldest event of each stream, and the next ones while
  /// they completed; a parked free whose events all completed goes back to the policy. Its one
  /// caller, allocate(), has recorded the open burst's events first (record_burst).
  CACHEALLOC_SLOW_PATH void poll_pending() {
    allocs_since_poll_ = 0;
    if (waits_stale_) {
      flush_pending(/*wait=*/false);
      return;
    }
    bool handed = false;
    bool drained = false;  // a stream's queue emptied: it leaves waits_
    for (StreamWaits& w : waits_) {
      while (!w.fifo.empty()) {
        const Waiting front = w.fifo.front();
        if (!event_done(front.event)) {
          break;  // every later event of this stream was recorded after it
        }
        w.fifo.pop_front();
        if (reuse_parked_) {
          w.sizes.erase(front.by_size);
        }
        Parked& p = parked_by_seq(front.seq);
        release_event(front.event);
        p.events[front.slot] = 0;
        if (--p.outstanding == 0) {
          if (p.reused) {
            --reused_count_;  // its block is live again: nothing to hand back
          } else {
            hand_back(p, /*wait_own=*/false);
            handed = true;
          }
          p.gone = true;
          ++gone_;
        }
      }
      drained = drained || w.fifo.empty();
    }
    if (drained) {  // only streams with events outstanding stay: a poll visits no idle stream
      std::erase_if(waits_, [](const StreamWaits& w) { return w.fifo.empty(); });
    }
    if (gone_ * 2 >= pending_.size() && gone_ != 0) {  // erased in bulk: O(1) per free over time
      erase_gone();
    }
    if (handed) {
      note_parked_to_policy();
    }
  }

  void erase_gone() noexcept {
    std::erase_if(pending_, [](const Parked& p) { return p.gone; });
    gone_ = 0;
  }
  CACHEALLOC_SLOW_PATH void note_active_peak() noexcept {
    active_peak_bytes_ = std::max(active_peak_bytes_, allocated_.current + parked_bytes_);
    active_peak_count_ = std::max(active_peak_count_, allocation_.current + parked_count_);
  }
  CACHEALLOC_SLOW_PATH void notify(AllocatorEvent event, std::uintptr_t ptr, std::size_t bytes,
                                   StreamId stream) {
    observer_(event, ptr, bytes, stream);
  }

  /// Parks a freed block until every other stream that used it is done with it. Never throws:
  /// when an event cannot be recorded, the block stays parked with `needs_events` set and the
  /// next flush records the events again (a waiting flush retries until it succeeds), so a
  /// failing event call costs memory for a while, never safety.
  CACHEALLOC_SLOW_PATH void park(Entry&& e) noexcept {
    Parked p{e.block, e.requested, e.stream, std::move(*e.other_streams), {}, false};
    const auto bytes = static_cast<std::int64_t>(p.block.size);
    p.seq = next_parked_seq_++;
    p.unrecorded = true;  // its events come with the burst's (Note [Events shared by a burst of parked frees])
    pending_.push_back(std::move(p));
    parked_bytes_ += bytes;
    ++parked_count_;
    ++unrecorded_;
    if (!share_events_) {
      record_burst();  // share_events:False: a burst of one, its events recorded at the free
    }
    note_parked_to_policy();
  }

  /// Note [Events shared by a burst of parked frees]: records one event on each stream the
  /// unrecorded parked frees (the newest `unrecorded_` of pending_) wait for, shares it among
  /// them and queues them on their streams. Never throws: a stream whose event cannot be recorded
  /// leaves its frees with `needs_events`, retried one by one at the next flush.
  void record_burst() noexcept {
    if (unrecorded_ == 0) {
      return;
    }
    const std::size_t first = pending_.size() - unrecorded_;
    unrecorded_ = 0;
    struct Shared {
      StreamId stream;
      EventId event;
      std::uint32_t holders;
    };
    std::array<Shared, 8> burst{};  // the burst's streams; a ninth and later get their own events
    std::size_t used = 0;
    // The event on `stream` for one more holder: the burst's, or its own when `burst` is full.
    auto event_on = [&](StreamId stream) noexcept -> EventId {
      for (std::size_t i = 0; i < used; ++i) {
        if (burst[i].stream == stream) {
          if (burst[i].event != 0) {
            ++burst[i].holders;
          }
          return burst[i].event;
        }
      }
      EventId ev = 0;
      try {
        ev = backend_->record_event(stream);
      } catch (...) {  // NOLINT(bugprone-empty-catch): 0: recorded again later
      }
      if (used < burst.size()) {
        burst[used++] = Shared{stream, ev, ev != 0 ? 1U : 0U};
      }
      return ev;
    };
    bool shareable = true;
    try {
      shared_events_.reserve(shared_events_.size() + burst.size());
    } catch (...) {  // bad_alloc: no event is shared, every free records its own
      shareable = false;
    }
    for (std::size_t i = first; i < pending_.size(); ++i) {
      Parked& p = pending_[i];
      p.unrecorded = false;
      if (!shareable) {
        record_events(p);
        if (kTakesSettled || reuse_parked_) {
          try {
            p.own_event = backend_->record_event(p.stream);
          } catch (...) {  // NOLINT(bugprone-empty-catch)
          }
        }
        add_waits(p);
        continue;
      }
      try {
        p.events.reserve(p.streams.size());
      } catch (...) {  // bad_alloc: recorded one by one at the next flush
        p.needs_events = true;
        add_waits(p);
        continue;
      }
      for (const StreamId s : p.streams) {
        const EventId ev = event_on(s);
        if (ev == 0) {
          p.needs_events = true;  // record_events() records this one and the rest later
          break;
        }
        p.events.push_back(ev);
      }
      // Note [Frees that come back settled], Note [Reusing a parked free on the stream it waits for]
      if (kTakesSettled || reuse_parked_) {
        p.own_event = event_on(p.stream);
      }
      add_waits(p);
    }
    for (std::size_t i = 0; i < used; ++i) {
      if (burst[i].holders > 1) {
        shared_events_.push_back(SharedEvent{burst[i].event, burst[i].holders});
      }
    }
  }

  /// Whether `event` completed (a failed query: not yet). Remembers the last event seen done, so
  /// the frees sharing it ask the device once.
  bool event_done(EventId event) noexcept {
    if (event == known_done_) {
      return true;
    }
    bool done = false;
    try {
      done = backend_->query_event(event);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a failed query: as not done, asked again later
    }
    if (done) {
      known_done_ = event;
    }
    return done;
  }

  /// Waits until `event` completed (DeviceError on failure); the frees sharing it wait once.
  void wait_event(EventId event) {
    if (event != known_done_) {
      backend_->synchronize_event(event);
      known_done_ = event;
    }
  }

  /// One holder of `event` is done with it; the last one destroys it.
  void release_event(EventId event) noexcept {
    for (std::size_t i = 0; i < shared_events_.size(); ++i) {
      if (shared_events_[i].event == event) {
        if (--shared_events_[i].holders != 0) {
          return;
        }
        shared_events_[i] = shared_events_.back();
        shared_events_.pop_back();
        break;
      }
    }
    if (event == known_done_) {
      known_done_ = 0;  // the device may hand its id out again
    }
    backend_->destroy_event(event);
  }

  /// Note [Parked frees by stream]: queues the newest parked free's events on their streams.
  void add_waits(Parked& p) noexcept {
    p.outstanding = 0;
    if (p.needs_events || waits_stale_) {
      waits_stale_ = true;
      return;
    }
    try {
      for (std::size_t i = 0; i < p.events.size(); ++i) {
        if (p.events[i] != 0) {
          StreamWaits& w = waits_for(p.streams[i]);
          Waiting q{p.events[i], p.seq, static_cast<std::uint32_t>(i)};
          if (reuse_parked_) {
            q.by_size = w.sizes.emplace(p.block.size, p.seq);
          }
          try {
            w.fifo.push_back(q);
          } catch (...) {
            if (reuse_parked_) {
              w.sizes.erase(q.by_size);
            }
            throw;
          }
          ++p.outstanding;
        }
      }
    } catch (...) {  // bad_alloc: the next poll passes over pending_ and rebuilds the queues
      waits_stale_ = true;
    }
  }

  StreamWaits& waits_for(StreamId stream) {
    if (StreamWaits* w = find_waits(stream)) {
      return *w;
    }
    waits_.push_back(StreamWaits{stream, {}, {}});
    return waits_.back();
  }
  /// The queue of `stream`'s outstanding events, or nullptr when it has none.
  StreamWaits* find_waits(StreamId stream) noexcept {
    for (StreamWaits& w : waits_) {
      if (w.stream == stream) {
        return &w;
      }
    }
    return nullptr;
  }

  /// The queues again from pending_, after a pass over it (flush_pending) changed its events.
  void rebuild_waits() noexcept {
    waits_.clear();
    waits_stale_ = false;
    for (Parked& p : pending_) {
      add_waits(p);
    }
  }

  /// The parked free `seq` (binary search: pending_ is in parking order).
  Parked& parked_by_seq(std::uint64_t seq) noexcept {
    auto it = std::lower_bound(pending_.begin(), pending_.end(), seq,
                               [](const Parked& p, std::uint64_t s) { return p.seq < s; });
    return *it;
  }

  /// Every queued event belongs to a parked free still waiting for it, and every event a parked
  /// free waits for is queued on its stream exactly once (unless the queues wait for a rebuild).
  void check_waits(std::size_t gone) const {
    CACHEALLOC_CHECK_INVARIANT(gone == gone_, "parked frees handed back but not erased miscounted");
    CACHEALLOC_CHECK_INVARIANT(std::is_sorted(pending_.begin(), pending_.end(),
                                              [](const Parked& a, const Parked& b) { return a.seq < b.seq; }),
                               "parked frees out of their parking order");
    for (std::size_t i = 0; i < pending_.size(); ++i) {
      const Parked& p = pending_[i];
      CACHEALLOC_CHECK_INVARIANT(p.unrecorded == (i >= pending_.size() - unrecorded_),
                                 "the parked frees awaiting their burst's events are not the newest ones");
      CACHEALLOC_CHECK_INVARIANT(!p.unrecorded || (p.events.empty() && p.own_event == 0 && !p.gone),
                                 "a parked free awaiting its burst's events already has events");
    }
    // Every event is held by as many parked frees as its count says: one unless it is shared.
    std::map<EventId, std::size_t> holders;
    for (const Parked& p : pending_) {
      for (const EventId ev : p.events) {
        if (ev != 0) {
          ++holders[ev];
        }
      }
      if (p.own_event != 0) {
        ++holders[p.own_event];
      }
    }
    for (const SharedEvent& e : shared_events_) {
      auto it = holders.find(e.event);
      CACHEALLOC_CHECK_INVARIANT(e.event != 0 && it != holders.end() && it->second == e.holders,
                                 "a shared event's holders miscounted");
      it->second = 1;
    }
    CACHEALLOC_CHECK_INVARIANT(std::all_of(holders.begin(), holders.end(), [](const auto& h) { return h.second == 1; }),
                               "an event held by several parked frees is not counted as shared");
    if (waits_stale_) {
      return;
    }
    std::size_t queued = 0;
    for (const StreamWaits& w : waits_) {
      CACHEALLOC_CHECK_INVARIANT(!w.fifo.empty(), "a stream without events outstanding is still polled");
      CACHEALLOC_CHECK_INVARIANT(w.sizes.size() == (reuse_parked_ ? w.fifo.size() : 0),
                                 "the size index of a stream's parked frees differs from its queue");
      for (const Waiting& q : w.fifo) {
        CACHEALLOC_CHECK_INVARIANT(!reuse_parked_ || q.by_size->second == q.seq,
                                   "a queued event's size index entry names another parked free");
      }
      for (const Waiting& q : w.fifo) {
        auto it = std::lower_bound(pending_.begin(), pending_.end(), q.seq,
                                   [](const Parked& p, std::uint64_t s) { return p.seq < s; });
        CACHEALLOC_CHECK_INVARIANT(it != pending_.end() && it->seq == q.seq && !it->gone &&
                                       q.slot < it->events.size() && it->events[q.slot] == q.event &&
                                       q.event != 0 && it->streams[q.slot] == w.stream,
                                   "a queued event of a parked free is not the event it waits for");
        ++queued;
      }
    }
    std::size_t outstanding = 0;
    for (const Parked& p : pending_) {
      if (p.gone) {
        continue;
      }
      const auto left = static_cast<std::size_t>(std::count_if(p.events.begin(), p.events.end(),
                                                               [](EventId e) { return e != 0; }));
      CACHEALLOC_CHECK_INVARIANT(left == p.outstanding, "a parked free's outstanding events miscounted");
      outstanding += left;
    }
    CACHEALLOC_CHECK_INVARIANT(queued == outstanding, "queued events differ from the parked frees' events");
  }

  /// Tells a policy that wants to know how many of its live bytes are parked frees (policy.h).
  void note_parked_to_policy() noexcept {
    if constexpr (requires(P& q, std::size_t n) { q.note_parked(n); }) {
      policy_.note_parked(static_cast<std::size_t>(parked_bytes_));
    }
  }

  void record_events(Parked& p) noexcept {
    p.needs_events = false;
    try {
      p.events.reserve(p.streams.size());
      for (std::size_t i = p.events.size(); i < p.streams.size(); ++i) {
        p.events.push_back(backend_->record_event(p.streams[i]));
      }
    } catch (...) {  // DeviceError or bad_alloc: retried at the next flush
      p.needs_events = true;
    }
  }

  void sync_reserved() const noexcept {
    // Most calls change nothing: leave stats_'s line alone then (Note [Hot fields first]).
    const std::size_t reserved = policy_.reserved_bytes();
    if (reserved != reserved_seen_) {
      reserved_seen_ = reserved;
      stats_.reserved_bytes.set(static_cast<std::int64_t>(reserved));
    }
  }

  /// A policy whose reserved bytes are the device's own figure (policy async: the pool's
  /// attributes) reads them only when someone looks (Note [Reserved bytes read lazily], async.h):
  /// here, before stats are reported or checked. Its peak is the pool's high watermark, which
  /// sees every growth, also those between two reads. Caller holds mutex_.
  void refresh_reserved() const noexcept {
    if constexpr (requires(const P& p) {
                    p.refresh_reserved();
                    { p.reserved_high() } -> std::same_as<std::size_t>;
                  }) {
      policy_.refresh_reserved();
      sync_reserved();
      stats_.reserved_bytes.peak =
          std::max(stats_.reserved_bytes.peak, static_cast<std::int64_t>(policy_.reserved_high()));
    }
  }

  /// The whole statistics: stats_'s cold figures plus the tallies (caller holds mutex_). While
  /// the step memo serves calls, the tallies as if it had applied them (Note [The step memo]):
  /// reading statistics does not make the policy catch up.
  [[nodiscard]] Stats snapshot() const {
    Tally allocated = allocated_;
    Tally requested = requested_;
    Tally allocation = allocation_;
    std::int64_t freed_bytes = active_freed_bytes_;
    std::int64_t freed_count = active_freed_count_;
    if (memo_next_ != nullptr) {
      const std::uint64_t period = memo_.size();
      const std::uint64_t whole = memo_served_ / period;
      memo_tally_periods(whole, allocated, requested, allocation, freed_bytes, freed_count);
      memo_tally(memo_sync_, memo_served_ % period, allocated, requested, allocation, freed_bytes,
                 freed_count);
    }
    Stats s = stats_;
    s.allocated_bytes = allocated.stat();
    s.requested_bytes = requested.stat();
    s.allocation = allocation.stat();
    // Active = allocated + parked; it rises only with allocated (Note [Cheap statistics ...]).
    s.active_bytes = Stat{allocated.current + parked_bytes_,
                          std::max(active_peak_bytes_, allocated.peak), s.allocated_bytes.allocated,
                          freed_bytes};
    s.active = Stat{allocation.current + parked_count_,
                    std::max(active_peak_count_, allocation.peak), s.allocation.allocated,
                    freed_count};
    s.alloc_calls = static_cast<std::uint64_t>(s.allocation.allocated);
    s.free_calls = static_cast<std::uint64_t>(s.allocation.freed);
    return s;
  }

  /// current / peak / cumulative like Stat, with one write fewer per increase: the cumulative
  /// increases are current - base + freed (base: current at the last reset of the cumulative
  /// figures), so an increase writes current and peak only.
  struct Tally {
    std::int64_t current = 0;
    std::int64_t peak = 0;
    std::int64_t freed = 0;
    std::int64_t base = 0;
    void increase(std::int64_t n) noexcept {
      current += n;
      peak = current > peak ? current : peak;
    }
    void decrease(std::int64_t n) noexcept {
      current -= n;
      freed += n;
    }
    void reset_peak() noexcept { peak = current; }
    void reset_accumulated() noexcept {
      base = current;
      freed = 0;
    }
    [[nodiscard]] Stat stat() const noexcept { return Stat{current, peak, current - base + freed, freed}; }
  };

  std::string unknown_pointer_message(const void* ptr, std::string_view what) const;

  /// A block handed out: its pointer-map entry and the tallies (Note [Cheap statistics on the
  /// fast path]). Caller holds mutex_.
  void account_allocation(const Block& block, std::size_t bytes, StreamId stream) {
    account_entry(Entry{block, bytes, stream, nullptr, false});
  }
  /// A new live entry joins the pointer map and the tallies (the map first: nothing changes when
  /// it throws).
  void account_entry(Entry&& e) {
    const auto size = static_cast<std::int64_t>(e.block.size);
    const auto requested = static_cast<std::int64_t>(e.requested);
    map_.insert(reinterpret_cast<std::uintptr_t>(e.block.ptr), std::move(e));
    allocated_.increase(size);
    requested_.increase(requested);
    allocation_.increase(1);
  }
  /// A live block's entry, just taken from the pointer map, leaves the tallies.
  void account_free(const Entry& e) noexcept {
    allocated_.decrease(static_cast<std::int64_t>(e.block.size));
    requested_.decrease(static_cast<std::int64_t>(e.requested));
    allocation_.decrease(1);
  }

  // ---- the step memo (Note [The step memo]); caller holds mutex_ ----
  /// A policy that can say when its placement depends only on the calls (placement_repeats()).
  static constexpr bool memo_capable() noexcept {
    return requires(const P& p) { { p.placement_repeats() } -> std::same_as<bool>; };
  }
  [[nodiscard]] bool memo_placement_repeats() const noexcept {
    if constexpr (memo_capable()) {
      return policy_.placement_repeats();
    } else {
      return false;
    }
  }
  void memo_advance() noexcept {
    ++memo_served_;
    if (++memo_next_ == memo_end_) {
      memo_next_ = memo_.data();
    }
  }
  /// The statistics' side of `count` calls of the period from index `from` (no policy, no map).
  void memo_tally(std::size_t from, std::uint64_t count, Tally& allocated, Tally& requested,
                  Tally& allocation, std::int64_t& freed_bytes,
                  std::int64_t& freed_count) const noexcept {
    const std::size_t period = memo_.size();
    for (std::size_t i = from; count > 0; --count) {
      const MemoOp& op = memo_[i];
      const auto block = static_cast<std::int64_t>(op.block_size);
      const auto bytes = static_cast<std::int64_t>(op.bytes());
      if (op.is_free()) {
        allocated.decrease(block);
        requested.decrease(bytes);
        allocation.decrease(1);
        freed_bytes += block;
        ++freed_count;
      } else {
        allocated.increase(block);
        requested.increase(bytes);
        allocation.increase(1);
      }
      i = i + 1 == period ? 0 : i + 1;
    }
  }
  /// `whole` periods from index memo_sync_: the first tallied call by call (for the peaks), the
  /// others only in the cumulative figures, by what that one freed (a period ends where it
  /// began). Returns the frees in them.
  std::int64_t memo_tally_periods(std::uint64_t whole, Tally& allocated, Tally& requested,
                                  Tally& allocation, std::int64_t& freed_bytes,
                                  std::int64_t& freed_count) const noexcept {
    if (whole == 0) {
      return 0;
    }
    const std::int64_t bytes_before = allocated.freed;
    const std::int64_t requested_before = requested.freed;
    const std::int64_t frees_before = allocation.freed;
    memo_tally(memo_sync_, memo_.size(), allocated, requested, allocation, freed_bytes,
               freed_count);
    const std::int64_t bytes = allocated.freed - bytes_before;
    const std::int64_t requested_bytes = requested.freed - requested_before;
    const std::int64_t frees = allocation.freed - frees_before;
    const auto more = static_cast<std::int64_t>(whole - 1);
    allocated.freed += more * bytes;
    requested.freed += more * requested_bytes;
    allocation.freed += more * frees;
    freed_bytes += more * bytes;
    freed_count += more * frees;
    return static_cast<std::int64_t>(whole) * frees;
  }
  /// After a call went through the policy: tell the learner, and let the memo take over once
  /// the calls repeat. Never throws (out of host memory the memo just stays off).
  CACHEALLOC_SLOW_PATH void memo_observe(const MemoOp& op) noexcept {
    if (!memo_placement_repeats()) {
      // Note [Learning only while placement can repeat]: for good.
      memo_learning_ = false;
      learner_.restart();
      return;
    }
    // Calls executed so far (allocations + frees), from the tallies this call already touched.
    const auto calls = static_cast<std::uint64_t>(allocation_.current + 2 * allocation_.freed);
    const bool quiet = parked_count_ == 0 && !observer_;
    try {
      if (!learner_.observe(op, calls, quiet, backend_->counters().mapping_calls())) {
        return;
      }
      learner_.period_into(memo_);
    } catch (...) {  // bad_alloc
      memo_enabled_ = memo_learning_ = false;
      return;
    }
    memo_sync_ = 0;
    memo_served_ = 0;
    memo_next_ = memo_.data();
    memo_end_ = memo_.data() + memo_.size();
    ++memo_entries_;
  }
  /// Applies the calls the memo served since the last sync to the policy, the pointer map and
  /// the tallies: whole periods only to the cumulative figures (they end where they began), the
  /// rest one by one. The memo keeps serving afterwards.
  CACHEALLOC_SLOW_PATH void memo_sync() {
    hand_over_deferred();  // every caller wants the policy up to date (Note [Frees handed over ...])
    if (memo_next_ == nullptr || memo_served_ == 0) {
      return;
    }
    const std::uint64_t period = memo_.size();
    const std::uint64_t whole = memo_served_ / period;
    // Whole periods end where they began: the statistics only.
    const std::int64_t frees = memo_tally_periods(whole, allocated_, requested_, allocation_,
                                                  active_freed_bytes_, active_freed_count_);
    if constexpr (requires(P& p, std::uint64_t n) { p.note_repeated(n); }) {
      policy_.note_repeated(static_cast<std::uint64_t>(frees));  // as many allocations as frees
    }
    memo_served_total_ += memo_served_;
    std::uint64_t rest = memo_served_ % period;
    memo_served_ = 0;
    std::size_t i = memo_sync_;
    try {
      for (; rest > 0; --rest) {
        memo_apply(memo_[i]);
        ++memo_replayed_;
        i = i + 1 == period ? 0 : i + 1;
      }
    } catch (...) {
      memo_next_ = memo_end_ = nullptr;
      memo_enabled_ = memo_learning_ = false;
      throw;
    }
    memo_sync_ = i;
  }
  /// Syncs and stops serving from the memo; learning starts again.
  void memo_leave() {
    if (memo_next_ != nullptr) {
      memo_sync();
      memo_next_ = memo_end_ = nullptr;
      ++memo_exits_;
    }
    learner_.restart();
  }
  /// One call the memo served, now through the real path. The policy is where it was when the
  /// period was learnt, with the same live blocks, so it places the block where it did then.
  void memo_apply(const MemoOp& op) {
    if (op.is_free()) {
      Entry e;
      if (!map_.take(op.ptr, e)) {
        throw InvariantError("step memo: a repeated free found its block not live");
      }
      account_free(e);
      complete_free(e.block, e.requested, e.stream);
      return;
    }
    const Block b = policy_.allocate(op.bytes(), op.stream);
    if (reinterpret_cast<std::uintptr_t>(b.ptr) != op.ptr || b.size != op.block_size) {
      throw InvariantError("step memo: policy " + std::string(P::kName) +
                           " placed a repeated allocation elsewhere than the first time");
    }
    account_allocation(b, op.bytes(), op.stream);
  }

  // Note [Hot fields first]: inside a training step every allocator call finds the CPU caches
  // cold (kernel launches and autograd ran in between), so what one call touches should sit on
  // few cache lines. The class is line aligned, so the lines are fixed:
  //   line 0   the vptr, the lock, every flag and count an allocation or a free tests first, and
  //            the reserved bytes last seen (sync_reserved);
  //   line 1   the pointer map's header and the observer;
  //   line 2-3 the backend and the policy (defrag's is a pointer), the tallies and the completed
  //            frees' counts;
  //   then the cold state (checked with gdb's `ptype /o` for policy defrag, session 53).
  // As the fields had accumulated, a pair's front end missed on about 12 of this object's lines
  // (deferred_count_, unrecorded_, parked_count_, reused_count_, the observer and the tallies
  // each sat on a line of their own). Session 53 packed them as above: bench/micro/cache_lines.py
  // (callgrind's cache model, one measured pass of cachealloc-cold-replay on the e2e pipeline
  // recording) counts 176.6 -> 170.3 lines missed per defrag pair: 68.7 -> 58.5 of data, 107.8
  // -> 111.9 of code (the code moved). On an H100 host it was
  // not measurable: the pipeline's steps without a device call spent 45.1 and 52.9 us in the
  // allocator against 49.9 and 50.8 with the previous layout, two calls of 3 runs a side over
  // 3,000 steps (bench/results/defrag_session53_2026-12-07.md); there the lines most likely come
  // from L2, where ten of them are worth about 0.05 us.
  // Kept as the documented order; aligning the pointer map's 64-byte slots to lines did not
  // lower the misses in the same cachegrind run and was not kept.
  // Code lines count too: two thirds of a defrag pair's 170. The branches for an
  // observer and for deferred frees (both off unless asked for) are marked [[unlikely]], so the
  // compiler moves them out of the common path: 55.9 -> 53.0 code lines missed per defrag call
  // (cache_lines.py, same recording; the native model's moved 49.5 -> 50.1, the layout's noise).
  mutable SpinMutex mutex_;  // Note [The front end's lock], spin_mutex.h
  // Note [Learning only while placement can repeat]: the learner watches calls (a hot flag: the
  // cold memo_enabled_ below is for the statistics and the settings).
  bool memo_learning_ = false;
  bool defer_frees_ = false;  // Note [Frees handed over at the next allocation]
  // Note [Reusing a parked free on the stream it waits for]
  bool reuse_parked_ = true;                  // CACHEALLOC_CONF reuse_parked
  // Note [Polling parked frees]: 1-1024, and the count never passes it (poll_pending resets it).
  std::uint16_t poll_interval_ = kDefaultPollInterval;
  std::uint16_t allocs_since_poll_ = 0;
  // Note [The step memo]: non-null while the memo serves calls: the call expected next.
  const MemoOp* memo_next_ = nullptr;
  std::size_t deferred_count_ = 0;  // Note [Frees handed over at the next allocation]
  std::size_t unrecorded_ = 0;      // the newest parked frees, events not yet recorded
  std::int64_t parked_count_ = 0;   // in pending_
  std::size_t reused_count_ = 0;    // entries of pending_ reused, not yet gone
  // The policy's reserved bytes when stats_ last took them; mutable, as stats_: a lazily read
  // policy (refresh_reserved) brings both up to date from the const stats().
  mutable std::size_t reserved_seen_ = 0;
  // line 1
  alignas(64) PointerMap<Entry> map_;
  AllocatorObserver observer_;
  // lines 2-3: the policy after the backend it is built on (defrag's policy is a pointer).
  alignas(64) std::unique_ptr<DeviceBackend> backend_;
  P policy_;
  Tally allocated_;
  Tally requested_;
  Tally allocation_;
  std::int64_t active_freed_bytes_ = 0;  // completed frees since the last reset_accumulated
  std::int64_t active_freed_count_ = 0;
  // The cold state; the deferred frees too, off by default (Note [Frees handed over at the next
  // allocation]).
  std::uint64_t deferred_total_ = 0;  // frees deferred so far (stats: front.deferred_frees)
  std::array<DeferredFree, kDeferredFrees> deferred_{};
  bool reuse_waits_ = true;  // CACHEALLOC_CONF reuse_parked_waits (the same Note as reuse_parked_)
  const MemoOp* memo_end_ = nullptr;
  std::uint64_t memo_served_ = 0;  // calls served since the last memo_sync()
  double wait_parked_ratio_ = -1;  // < 0: off (Note [Waiting for frees in flight instead of growing])
  std::vector<Parked> pending_;
  // Note [Parked frees by stream]; a list: its queues' entries hold iterators into `sizes`, which
  // a vector's growth would copy (a deque's move may throw, so the vector copies).
  std::list<StreamWaits> waits_;
  std::uint64_t next_parked_seq_ = 0;
  std::size_t gone_ = 0;       // entries of pending_ handed back by poll_pending, not erased yet
  bool waits_stale_ = false;   // waits_ lacks events (some could not be recorded): rebuild them
  // Note [Events shared by a burst of parked frees]
  bool share_events_ = true;                  // CACHEALLOC_CONF share_events
  std::vector<SharedEvent> shared_events_;   // events held by more than one parked free
  EventId known_done_ = 0;                   // the last event seen complete, still alive
  std::int64_t parked_bytes_ = 0;  // in pending_
  std::int64_t active_peak_bytes_ = 0;  // highest allocated + parked seen while parked > 0
  std::int64_t active_peak_count_ = 0;
  mutable Stats stats_;  // the cold figures; the tallies above come from snapshot()
  double fraction_ = 1.0;
  // The step memo's cold state (Note [The step memo]).
  bool memo_enabled_ = false;
  MemoLearner learner_;
  std::vector<MemoOp> memo_;          // the period being served
  std::size_t memo_sync_ = 0;         // memo_ index up to which the policy saw the calls
  std::uint64_t memo_served_total_ = 0;
  std::uint64_t memo_entries_ = 0;
  std::uint64_t memo_exits_ = 0;
  std::uint64_t memo_replayed_ = 0;
};

std::string unknown_pointer_text(const void* ptr, std::string_view what, int device,
                                 std::string_view policy);

template <Policy P>
std::string CachingAllocator<P>::unknown_pointer_message(const void* ptr, std::string_view what) const {
  return unknown_pointer_text(ptr, what, backend_->device(), P::kName);
}

}  // namespace cachealloc
