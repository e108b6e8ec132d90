// defrag.h: policy `defrag`, defragmenting best-fit on CUDA virtual memory.
//
// Blocks are packed (512-byte aligned) into a large reserved virtual address range; physical
// memory backs it in pages of the device granularity (2 MiB on the H200), created in chunks
// (a growth creates about 16 physical handles, mapped with one access call) so that growing by
// a gigabyte costs a few dozen device calls and not a thousand. A page is mapped while any live byte
// lies on it; pages at the edges of blocks are shared by their neighbours. When memory would
// otherwise grow, the chunks lying wholly under free holes are unmapped and mapped where they
// are needed ("stitching", GMLake, ASPLOS 2024), so holes never cost physical memory for long.
// reserved_bytes() is the physical memory held, and all of it is mapped between calls.
//
// Placement (all searches O(log n) in size-ordered sets):
//   1. best fit among the stream's own free *mapped* holes: no device call at all;
//   2. otherwise best fit among free *unmapped* holes (each with its usable mapped neighbours)
//      of the stream's own address ranges (stream_ranges: Note [Address ranges of their own for
//      streams], defrag_grow.cpp), mapping the pages the block needs there: new physical pages
//      while the policy holds less than (1 + grow_slack) x the peak live bytes; else another
//      stream's safe hole that fits; else pages taken from free holes (oldest first); else,
//      after waiting for its own stream, its recently freed pages; else new pages (Note [Where
//      new pages come from], defrag_grow.cpp).
// Requests up to small_size go to a second address range, so small long-lived tensors do not
// pin the pages of large holes (Note [Which requests are small]). Only pages wholly inside a
// free hole move, so peak reserved is about max((1 + grow_slack) x peak live bytes, peak live
// bytes + the partly used pages at the edges of free holes): 1.010 / 1.008 / 1.012 of peak
// requested on the shared traces (gpt2, resnet50, two-stream MLP).
//
// Settings (CACHEALLOC_CONF, e.g. "policy:defrag,grow_slack:0.005,va_reserve_gb:512"):
//   va_reserve_gb     virtual address space reserved per range, in GiB (default: twice the
//                     device memory); another range is reserved whenever one is full
//   grow_slack        how far physical memory may grow beyond the peak live bytes before free
//                     pages are moved instead of new ones created (fraction, default 0.01; 0
//                     moves the most pages and holds the least memory)
//   max_grow_slack    how far the slack may rise when pages keep moving, step after step
//                     (default 0.2; equal to grow_slack: never rises); a raise is undone after
//                     quiet (Note [Slack that adapts to moves], Note [A time budget for moves],
//                     Note [A raise that comes back], defrag_grow.cpp)
//   small_size        requests up to this size go to their own address range, so that small
//                     long-lived tensors do not pin the pages of large holes (bytes, default
//                     1MB; 0 = one range for all sizes) (Note [Which requests are small])
//   move_budget       the share of elapsed time that growths which move pages (or wait for a
//                     stream to move them) may take before the slack rises (default 0.02; 1 =
//                     never on time)
//   wait_for_streams  before creating physical memory beyond the slack, wait for the allocating
//                     stream's events so that pages it freed recently can move (default True)
//   move_pending      instead of that wait, move those pages at once and unmap their old
//                     addresses once the stream's queued work is done, where the backend can
//                     (cuda_vmm with background_unmap, the simulated device) (default False;
//                     Note [Moving pages a stream still uses], background_unmapper.h)
//   pending_on_waits  switch to move_pending for good once waiting for the stream has put the
//                     moves over move_budget (waits more than three tenths of their time)
//                     (default True; Note [Waits that switch to moving pending], defrag_grow.cpp)
//   avoid_queued_unmaps  place a block that needs pages mapped past unmapped holes whose
//                     unmap still waits for a stream's work (pages moved pending), or above
//                     such unmaps in the same hole, instead of waiting for that work there
//                     (default True; Note [Placing away from queued unmaps], defrag_grow.cpp)
//   max_chunk_mb      the largest physical handle created, in MiB (default 1024; rounded down
//                     to whole pages; the page size, 2 on the H200, gives one handle per page:
//                     every page can move alone, but each costs its own cuMemCreate and cuMemMap)
//                     (Note [Chunks], defrag_grow.cpp)
//   keep_small_mb     freed blocks up to 1 MiB (and small_size) kept, unmerged, for a request of
//                     the same size on the same stream, up to this many MiB in all: a faster
//                     pair for about 0.2-0.5% more peak memory (default 0: off) (Note [Recently
//                     freed small blocks in defrag], defrag.cpp)
//   stream_ranges     each stream (the first eight; later ones share the eighth's) places the
//                     large blocks that need pages mapped in address ranges of its own, as
//                     PyTorch's expandable segments keep one range per stream; pages still move
//                     between the ranges (default True; Note [Address ranges of their own for
//                     streams], defrag_grow.cpp)
//   slack_counts_parked  measure the slack against the peak of all live bytes, frees the front
//                     end parks for other streams included, as before session 32 (default False:
//                     against the peak of the bytes the program holds; Note [Frees in flight and
//                     the slack], defrag_grow.cpp)
//   top_at_limit      once moves went over move_budget with the slack at max_grow_slack, place
//                     growths at the top of their address range instead of in the best-fitting
//                     hole, so that the layout settles and the moves stop (default True; Note
//                     [Growing at the top once moves cost too much at the limit], defrag_grow.cpp)
//   coalesce_map_us   while mapping a handle has lately cost more than this many microseconds
//                     (a moving average; device-to-host copies running make it about 1 ms), a
//                     growth releases the chunks it moved or created and maps their pages as one
//                     new handle instead (default 200; 0: always; 1e9: never) (Note [Coalescing
//                     moved chunks while maps are dear], defrag_grow.cpp)
// The front end's wait_parked_to_grow (allocator.h) holds this policy's growth (hold_growth) while
// it waits for parked frees instead.
//
// Note [Which requests are small]
// Small blocks get an address range of their own because they share pages many to a page and
// many live long (norm weights, biases, library workspaces): among large blocks each could pin
// a page of a large hole. The boundary is PyTorch's, 1 MiB. Two others were measured (session
// 10) and rejected:
//   * 256 KiB: the e2e resnet50 recording's 4,539 short-lived activations of 256 KiB-1 MiB then
//     go to the large range, where they fill the partly used pages at the edges of its holes:
//     replayed 1.014 -> 1.005 of peak requested (resnet50_train 1.008 -> 1.004), on the H200
//     3,314 MiB in every run against 3,322-3,332 (expandable_segments 3,330). But the few
//     long-lived blocks of that size then pin large-range pages: the cuBLAS workspace (one
//     block of 1 MiB made at the first matrix product and kept), in the pipeline and in
//     mlp_two_streams. On the H200 the pipeline moved about 3.5x the pages (median 248 against
//     71 per run) and peaked at a median 3,610 and 3,634 MiB against expandable's 3,598
//     (bench/results/e2e_h200_2026-12-03_session10c_settings.md, ..._session10d_small_size.md);
//     replayed, mlp_two_streams 1.010 -> 1.016 and the e2e pipeline recording 1.189 -> 1.250
//     (the recordings of session 10, made in fresh processes, have the workspace).
//   * a third range for 256 KiB-1 MiB (blocks share pages only with blocks within 4x their
//     size): the resnet50 gain is gone (1.014, resnet50_train 1.008; e2e gpt2 1.004 -> 1.007),
//     since it came from those blocks filling the large holes' edges.
// So the setting stays 1 MiB; small_size:256KB suits jobs without long-lived blocks of that size
// (README, "Two defrag settings").
//
// Note [Physical pages and the streams that used them]
// A page may only be unmapped once the streams that used it finished that work, and a hole
// freed on stream S may be handed to another stream only then too. Frees are stamped with the
// current *epoch*; closing an epoch records one event on each stream that freed something
// during it (one event per stream per epoch, never per page or block). A hole stamped e is
// *safe* once its owner stream's events up to epoch e completed: only the owner matters,
// because every other stream's use finished before the free (policy.h, item 4), and holes of
// different streams merge only when both are safe (or when a new block spans them). Epochs close at every allocation that has
// to grow, and with several streams also every few frees while the policy keeps missing (so
// that streams can reuse each other's holes soon; Note [Epochs on demand], defrag.cpp);
// completions are polled at the same points. The policy waits
// (synchronize_event) only for the stream it allocates for, as PyTorch's expandable segments
// wait before unmapping; it never blocks on another stream's work, except in release_cached()
// (empty_cache and the out-of-memory retry), which waits for every stream. With move_pending it
// need not wait for its own stream either: the pages move at once and their old addresses are
// unmapped after the stream's work (Note [Moving pages a stream still uses]).
// So a stream is used after the frees made on it returned: its epoch's event is recorded at the
// next growth or release_cached(), and the stream must still exist then. PyTorch's streams come
// from its pool and are never destroyed; a stream wrapped with torch.cuda.ExternalStream and
// destroyed right after frees on it would be recorded on after its destruction, which the driver
// does not catch (session 47's GPU suite: a test that destroyed its stream before the allocator
// crashed inside cuStreamWriteValue64 when the allocator's teardown recorded on it).
//
// Stats: the backend counts map/unmap calls and bytes (Stats::num_maps, bytes_mapped, ...);
// DefragPolicy::counters() adds pages created, moved and released, and the stream waits.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/config.h>
#include <cachealloc/policy.h>
#include <cachealloc/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cachealloc {

namespace detail {
class DefragEngine;
}  // namespace detail

/// The settings, after CACHEALLOC_CONF (see the table above).
struct DefragSettings {
  std::size_t va_reserve_bytes = 0;  ///< 0 = twice the device memory
  double grow_slack = 0.01;
  double max_grow_slack = 0.2;  ///< how far the slack may rise when pages keep moving
  double move_budget = 0.02;     ///< share of elapsed time page moves may take before the slack rises
  /// 0 = small requests share the large range (Note [Which requests are small])
  std::size_t small_size = 1 * kMiB;
  bool wait_for_streams = true;
  bool move_pending = false;  ///< Note [Moving pages a stream still uses]
  /// Note [Waits that switch to moving pending] (defrag_grow.cpp)
  bool pending_on_waits = true;
  /// Note [Placing away from queued unmaps] (defrag_grow.cpp)
  bool avoid_queued_unmaps = true;
  std::size_t max_chunk_bytes = 1 * kGiB;  ///< largest physical handle; one page = per-page handles
  std::size_t keep_small_bytes = 0;  ///< freed small blocks kept for reuse at their size (0: none)
  /// Note [Address ranges of their own for streams] (defrag_grow.cpp)
  bool stream_ranges = true;
  /// Note [Frees in flight and the slack] (defrag_grow.cpp): true also scales the slack with
  /// the frees the front end parks for other streams (the policy's behaviour until session 32).
  bool slack_counts_parked = false;
  /// Note [Growing at the top once moves cost too much at the limit] (defrag_grow.cpp).
  bool top_at_limit = true;
  /// Note [Coalescing moved chunks while maps are dear] (defrag_grow.cpp): the moving average
  /// of a handle's map time above which growths coalesce their chunks (0: always).
  std::uint64_t coalesce_map_ns = 200'000;
};

/// What the policy did to the device, beyond the backend's own map/unmap counters.
struct DefragCounters {
  std::uint64_t pages_created = 0;   ///< pages of physical memory created
  std::uint64_t recent_hits = 0;     ///< allocations served from a stream's recently freed small blocks
  std::uint64_t recent_flushes = 0;  ///< times those blocks were merged into the holes
  std::uint64_t chunks_created = 0;  ///< create_physical() calls (one chunk of pages each)
  std::uint64_t chunks_moved = 0;    ///< chunks unmapped from a free hole to be mapped elsewhere
  std::uint64_t pages_released = 0;  ///< pages given back (release_cached, failed growth, coalescing)
  /// Note [Coalescing moved chunks while maps are dear] (defrag_grow.cpp): growths that released
  /// the chunks they gathered and created one handle (or a few) in their place, and those chunks.
  std::uint64_t coalesced_growths = 0;
  std::uint64_t chunks_coalesced = 0;
  std::uint64_t pages_mapped = 0;    ///< pages mapped under new blocks
  std::uint64_t pages_moved = 0;     ///< pages unmapped from a free hole to be mapped elsewhere
  /// Of which from the allocating stream's own holes its queued work may still use, unmapped
  /// after that work (Note [Moving pages a stream still uses], background_unmapper.h).
  std::uint64_t pages_moved_pending = 0;
  /// Growths placed past a better-fitting unmapped hole where an unmap had not run yet (or, when
  /// every fit had one, in the first of them): Note [Placing away from queued unmaps].
  std::uint64_t placed_past_queued = 0;
  /// Of which placed in a fitting hole above the unmaps queued in its lower part, instead of
  /// waiting for them (Note [Placing away from queued unmaps]).
  std::uint64_t placed_above_queued = 0;
  /// Growths that placed their block at the top of its unmapped hole, ending with the free
  /// mapped hole above it, because that needed fewer pages beyond the slack (Note [A block that
  /// ends with the free pages above it], defrag_grow.cpp).
  std::uint64_t placed_at_top = 0;
  /// Growths placed at the top of their address range because moves went over the time budget
  /// with the slack at its limit (Note [Growing at the top once moves cost too much at the limit]).
  std::uint64_t placed_top_at_limit = 0;
  std::uint64_t unmap_batches = 0;   ///< unmap() calls (each covers consecutive pages)
  std::uint64_t grow_allocations = 0;  ///< allocations that needed pages mapped
  std::uint64_t events_recorded = 0;   ///< epoch-closing events (one per stream per epoch)
  std::uint64_t stream_waits = 0;      ///< times the policy waited for epoch events
  std::uint64_t address_ranges = 0;    ///< virtual address ranges reserved
  std::uint64_t slack_raises = 0;      ///< times the slack rose (Note [Slack that adapts to moves])
  std::uint64_t budget_raises = 0;     ///< of which on time (Note [A time budget for moves])
  std::uint64_t return_raises = 0;     ///< of which for pages coming back (Note [Pages that come back])
  std::uint64_t slack_returns = 0;     ///< on-time raises undone after quiet (Note [A raise that comes back])
  /// 1 once waits for the allocating stream put a window over the move budget and the policy
  /// moved pending from then on (Note [Waits that switch to moving pending], defrag_grow.cpp).
  std::uint64_t pending_switches = 0;
  /// Growths that created pages beyond the slack because no more could be moved, and the pages
  /// they created; at each, the whole free pages held elsewhere, summed over them, by why they
  /// did not move (Note [Why pages were created beyond the slack], defrag_grow.cpp).
  std::uint64_t beyond_slack_growths = 0;
  std::uint64_t beyond_slack_pages = 0;
  std::uint64_t stuck_unsafe_pages = 0;  ///< in holes a stream's queued work may still use
  std::uint64_t stuck_unsafe_other_pages = 0;  ///< of which in holes of another stream than the growth's
  std::uint64_t stuck_pinned_pages = 0;  ///< in chunks that go on under a live block or an edge page
  std::uint64_t stuck_beside_pages = 0;  ///< in the placement's own mapped neighbours
  std::uint64_t stuck_other_pages = 0;   ///< movable, not taken (room, the other range's pages)
  std::uint64_t held_growths = 0;  ///< page creations refused while the front end held growth
  /// time spent in growths that moved pages or waited, at a new peak or not (the move budget
  /// is charged only those below the peak: Note [A time budget for moves])
  std::uint64_t move_ns = 0;
  /// time waiting for streams (synchronize_event): in those growths, and in release_cached()
  std::uint64_t wait_ns = 0;
  double slack = 0.0;                  ///< the grow slack in force now
};

/// One change of the slack, or one growth that created pages beyond it: the policy keeps the
/// first kSlackHistoryLength of them (DefragPolicy::slack_history(); Note [A history of the
/// slack], defrag_grow.cpp), which tell why a job holds what it holds beyond its live peak.
struct SlackEvent {
  enum class Kind : std::uint8_t {
    count_raise,     ///< moves came densely (Note [Slack that adapts to moves])
    time_raise,      ///< moves took more than move_budget (Note [A time budget for moves])
    return_raise,    ///< pages kept where they came back to (Note [Pages that come back])
    returned,        ///< a raise on time undone after quiet (Note [A raise that comes back])
    pending_switch,  ///< waits put moves over the budget (Note [Waits that switch to moving pending])
    /// moves went over the budget with the slack at its limit: growths go to the top from now on
    /// (Note [Growing at the top once moves cost too much at the limit])
    top_at_limit,
    /// a growth created pages beyond the slack (Note [Why pages were created beyond the slack])
    beyond_slack,
  };
  Kind kind = Kind::count_raise;
  /// On the backend's clock (in replays: the trace's own times plus the modelled device calls).
  std::uint64_t time_ns = 0;
  double slack_before = 0.0;
  double slack_after = 0.0;
  std::uint64_t live_bytes = 0;       ///< at the event
  std::uint64_t peak_live_bytes = 0;  ///< the peak of live bytes so far (the slack's base)
  /// Bytes of physical pages held at the event (for beyond_slack: before the growth creates them).
  std::uint64_t reserved_bytes = 0;
  std::uint64_t pages = 0;            ///< beyond_slack: the pages created beyond the slack
  /// Of live_bytes, the frees the front end held parked for other streams' work (note_parked).
  std::uint64_t parked_bytes = 0;
  /// beyond_slack: the stream that grew, and the whole free pages elsewhere that its stream's or
  /// another stream's queued work still used then, and of those another stream's (Note [Why
  /// pages were created beyond the slack]; the counters sum them over the growths).
  StreamId stream = 0;
  std::uint64_t unsafe_pages = 0;
  std::uint64_t unsafe_other_pages = 0;
};
/// How many SlackEvents the policy keeps; later ones are only counted.
inline constexpr std::size_t kSlackHistoryLength = 512;
/// The name of a SlackEvent kind, as cachealloc-replay --explain prints it.
[[nodiscard]] std::string_view slack_event_name(SlackEvent::Kind kind) noexcept;
/// Its identifier in JSON ("count_raise", "time_raise", "return_raise", "returned",
/// "pending_switch", "top_at_limit", "beyond_slack"): DefragPolicy::report_json(),
/// cachealloc-replay --json.
[[nodiscard]] std::string_view slack_event_id(SlackEvent::Kind kind) noexcept;

/// One growth that moved pages or waited for a stream: the policy keeps the first
/// kGrowthHistoryLength of them (DefragPolicy::growth_history(); Note [A history of the time
/// budget], defrag_grow.cpp).
struct CostlyGrowth {
  std::uint64_t time_ns = 0;    ///< when it ended, on the backend's clock
  std::uint64_t took_ns = 0;    ///< its whole time: waits, unmaps, creates and maps
  std::uint64_t waited_ns = 0;  ///< of which waiting for streams
  std::uint32_t waits = 0;      ///< stream waits in it
  std::uint32_t pages_moved = 0;
  std::uint32_t pages_created = 0;
  StreamId stream = 0;          ///< the allocating stream
  /// It reached a new peak of live bytes: not charged to the move budget (Note [A time budget
  /// for moves]).
  bool new_peak = false;
  bool pending = false;  ///< the policy moved pending then (Note [Waits that switch to moving pending])
};
inline constexpr std::size_t kGrowthHistoryLength = 4096;

/// One window of the move budget, judged (Note [A time budget for moves], Note [Judging a window
/// before it is full]): the policy keeps the first kWindowHistoryLength of them
/// (DefragPolicy::window_history(); Note [A history of the time budget], defrag_grow.cpp).
struct BudgetWindow {
  enum class Close : std::uint8_t {
    full,   ///< kMoveWindow charged growths over at least kBudgetMinWindowNs
    early,  ///< over the budget even if the growths still missing cost nothing
    aged,   ///< open for kBudgetMaxWindowNs
  };
  enum class Verdict : std::uint8_t {
    within,        ///< within the budget: nothing changes
    raised,        ///< over it: the slack rose (a time_raise in the slack's history)
    switched,      ///< over it, much of it waiting: moving pending from then on
    top_at_limit,  ///< over it at the slack's limit: growths at the top from then on
    over,          ///< over it, with nothing left to change
  };
  std::uint64_t open_ns = 0;   ///< when its first charged growth began
  std::uint64_t close_ns = 0;  ///< when its last one ended
  std::uint32_t growths = 0;   ///< charged growths in it
  std::uint64_t charged_ns = 0;  ///< their time
  std::uint64_t waited_ns = 0;   ///< of which waiting for streams
  std::uint64_t spent_ns = 0;    ///< what the budget counted: charged_ns less what the bank paid
  std::uint64_t allowed_ns = 0;  ///< move_budget x (close_ns - open_ns)
  /// Waits of growths at a new peak of live bytes while it was open (not charged).
  std::uint32_t uncharged_waits = 0;
  std::uint64_t uncharged_wait_ns = 0;
  double slack_after = 0.0;
  Close close = Close::full;
  Verdict verdict = Verdict::within;
};
inline constexpr std::size_t kWindowHistoryLength = 1024;
/// Their identifiers in JSON and in cachealloc-replay --explain ("full", "early", "aged";
/// "within", "raised", "switched", "top_at_limit", "over").
[[nodiscard]] std::string_view window_close_id(BudgetWindow::Close close) noexcept;
[[nodiscard]] std::string_view window_verdict_id(BudgetWindow::Verdict verdict) noexcept;

/// Where the physical memory held goes (DefragPolicy::breakdown(), O(ranges)).
struct DefragBreakdown {
  std::size_t live_bytes = 0;         ///< bytes of live blocks
  std::size_t edge_free_bytes = 0;    ///< free bytes on pages that also carry live bytes
  std::size_t cached_free_bytes = 0;  ///< free bytes on wholly free mapped pages (movable)
  std::size_t free_holes = 0;         ///< mapped free holes
  std::size_t kept_bytes = 0;         ///< freed small blocks kept for reuse at their size
  std::size_t live_blocks = 0;
};

class DefragPolicy {
 public:
  static constexpr std::string_view kName = "defrag";
  static std::vector<std::string_view> config_keys();
  static std::string_view oom_hint() {
    return "policy defrag holds physical pages only under live blocks and at the partly used "
           "edges of free holes; lower grow_slack (CACHEALLOC_CONF) to hold less beyond the "
           "live bytes.";
  }

  /// Throws ConfigError when the backend has no virtual memory or a setting is invalid.
  DefragPolicy(DeviceBackend& backend, Config& config);
  DefragPolicy(DeviceBackend& backend, const DefragSettings& settings);
  ~DefragPolicy();
  DefragPolicy(const DefragPolicy&) = delete;
  DefragPolicy& operator=(const DefragPolicy&) = delete;

  [[nodiscard]] Block allocate(std::size_t bytes, StreamId stream);
  void deallocate(const Block& block, StreamId stream) noexcept;
  /// A free no stream's work can touch any more: its pages may move at once (Note [Frees that
  /// come back settled], allocator.h).
  void deallocate_settled(const Block& block, StreamId stream) noexcept;
  /// The bytes of freed blocks the front end holds back for other streams (still live here).
  void note_parked(std::size_t bytes) noexcept;
  /// While held, allocate() creates no physical memory and moves none: it places blocks in
  /// mapped holes only, else returns an empty block (allocator.h, Note [Waiting for frees in
  /// flight instead of growing]). (Letting a held growth move pages, creating none, was tried
  /// on replays in session 37 and not kept without a GPU run: bench/results/
  /// defrag_session37_soft_hold.patch.)
  void hold_growth(bool held) noexcept;
  /// Waits for every stream that used a free page, then unmaps and releases all wholly free pages.
  std::size_t release_cached();
  [[nodiscard]] std::size_t reserved_bytes() const noexcept;
  /// No overlap, the address ranges tiled exactly by blocks and holes, every page mapped at
  /// most once and mapped exactly when a block or a mapped hole lies on it, mapped bytes ==
  /// reserved bytes, the indexes in step with the ranges, no page unmapped while a stream use
  /// recorded on it was unfinished. O(ranges + pages).
  void check_invariants() const;

  template <class F>
  void visit_segments(F&& f) const {
    for (const SegmentView& s : segment_views()) {
      f(s);
    }
  }

  [[nodiscard]] DefragCounters counters() const noexcept;
  /// counters() as "defrag.<name>" for the front end's stats (memory_stats() in PyTorch):
  /// pages_created, chunks_created, pages_moved, chunks_moved, unmap_batches,
  /// grow_allocations, stream_waits, wait_ns, move_ns, slack_raises, budget_raises, return_raises,
  /// slack_returns, recent_hits, slack_ppm (the slack in force, in millionths).
  [[nodiscard]] std::vector<std::pair<std::string, std::int64_t>> stat_counters() const;
  [[nodiscard]] const DefragSettings& settings() const noexcept;
  /// Sum of the (512-byte rounded) sizes of live blocks.
  [[nodiscard]] std::size_t live_bytes() const noexcept;
  /// The peaks the slack is measured against (Note [Frees in flight and the slack]): of the live
  /// bytes, frees parked for other streams included, and of the bytes the program held.
  [[nodiscard]] std::size_t peak_live_bytes() const noexcept;
  [[nodiscard]] std::size_t peak_held_bytes() const noexcept;
  /// reserved_bytes() split into live, edge and cached bytes.
  [[nodiscard]] DefragBreakdown breakdown() const;
  /// True while placement depends only on the calls (one stream seen, no recently freed lists):
  /// the front end's step memo may serve repeated calls (Note [The step memo], allocator.h).
  /// Once false, false for good (a stream seen stays in the classes): the front end stops
  /// learning then (Note [Learning only while placement can repeat], allocator.h).
  [[nodiscard]] bool placement_repeats() const noexcept;
  /// The step memo served `allocations` allocations (whole periods) without calling allocate():
  /// they count towards the moves' density as if it had (Note [Slack that adapts to moves]).
  void note_repeated(std::uint64_t allocations) noexcept;

  /// The first kSlackHistoryLength changes of the slack and growths beyond it, in order, and how
  /// many came after them (Note [A history of the slack], defrag_grow.cpp).
  [[nodiscard]] const std::vector<SlackEvent>& slack_history() const noexcept;
  [[nodiscard]] std::uint64_t slack_events_dropped() const noexcept;
  /// Note [A history of the time budget]: the growths that moved pages or waited, and the move
  /// budget's windows with their verdicts (the first kGrowthHistoryLength / kWindowHistoryLength;
  /// later ones only counted).
  [[nodiscard]] const std::vector<CostlyGrowth>& growth_history() const noexcept;
  [[nodiscard]] std::uint64_t growths_dropped() const noexcept;
  [[nodiscard]] const std::vector<BudgetWindow>& window_history() const noexcept;
  [[nodiscard]] std::uint64_t windows_dropped() const noexcept;
  /// {"slack_history": [{"event": "time_raise", "time_ns": ..., "slack_before": ..., ...}, ...],
  /// "slack_history_dropped": n, "growths": [{"time_ns": ..., "took_ns": ..., "waited_ns": ...,
  /// ...}, ...], "growths_dropped": n, "windows": [{"open_ns": ..., "verdict": "raised", ...},
  /// ...], "windows_dropped": n}: the front end's policy_report_json().
  [[nodiscard]] std::string report_json() const;

  /// Parses the keys of config_keys() from `config` (marking them used).
  static DefragSettings parse_settings(Config& config);

 private:
  /// One segment per maximal run of mapped pages.
  [[nodiscard]] std::vector<SegmentView> segment_views() const;

  std::unique_ptr<detail::DefragEngine> engine_;
};

static_assert(Policy<DefragPolicy>);

}  // namespace cachealloc
