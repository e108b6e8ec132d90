// async.h: policy `async`, a size-class front cache over a stream-ordered pool (cudaMallocAsync).
//
// The device's own pool (backend.stream_ordered(): a private cudaMemPool_t on CUDA, the
// simulated pool of sim_stream_pool.h in CPU tests and replays) does placement, cross-stream
// reuse and trimming. In front of it sits a per-stream cache of freed blocks: small requests
// (<= 1 MiB) rounded to size_class's classes and carved from slabs (Note [Small blocks from
// slabs]); larger ones rounded to 512 B and, up to `async_cache_max_block` (default 1 MiB, so by
// default none), kept in exact-size LIFO lists, up to `async_cache_mb` bytes in all (default 32;
// 0 disables the cache, the slabs and the recent FIFO). A large free first waits on its
// stream's FIFO of recent frees (Note [Recently freed large blocks in async]). A cached pair
// never calls the pool (a warm cudaMallocAsync+cudaFreeAsync pair costs 1.45 us on an H200; a
// cache hit costs tens of nanoseconds).
//
// Note [A small front cache]
// Memory in the front cache is memory the pool cannot hand to another size. With 256 MiB of
// blocks of any size cached, replays on the H200 held 1.066 / 1.167 / 1.300 x the live peak
// where raw cudaMallocAsync held 1.052 / 1.072 / 1.144 (gpt2 / resnet50 / mlp traces). Small
// blocks are most of the calls of a training step and little of its memory, so only they are
// cached, and the cache is capped at 32 MiB: a peak at most that much above the pool's own.
//
// Note [Small blocks from slabs]
// Measured on the H200 (bench/e2e, session 3), even a 4 MiB cache of blocks up to 64 KiB raised
// the peak 1.2-1.6% above raw cudaMallocAsync (gpt2), and the 32 MiB default 2.4%: the pool
// places small allocations inside larger chunks, so a few cached small blocks scattered over
// many chunks keep all of them from serving a large request; the cost is chunks, not the
// cached bytes. So small requests (<= 1 MiB) now come from 2 MiB slabs that the policy takes
// from the pool (one allocate_async each, on the requesting stream) and carves in size classes,
// as size_class does: small blocks are packed into few slabs, and a slab goes back to the pool
// (free_async on its stream) as soon as its last block is freed, unless it is the stream's
// slab being carved. A freed small block waits on its stream's class list and is reused only by
// that stream (Note [Stream order in the front cache]); the front end hands the policy a block
// only once every other stream that used it is done (record_stream), on the stream it was
// allocated on. async_small_slabs:False goes back to the exact-size cache below for them;
// async_cache_mb:0 turns both off (every block from the pool).
//
// Note [Recently freed large blocks in async]
// A training step frees and re-requests the same large sizes over and over, and every one of
// them was a pool round trip (allocate_async + free_async: two driver calls, 1.45 us a pair on
// the H200, plus the reserved-bytes read after the allocation). As in size_class (Note [Recently
// freed large blocks], size_class.h), a freed large block first goes to its stream's short FIFO
// of recent frees (`async_recent_blocks`, default 4); a request of exactly its size on that
// stream takes it back without a driver call. The oldest entry goes to the pool when a new one
// arrives, and the whole FIFO goes to the pool (free_async on the stream, so the memory is the
// stream's again at once) as soon as that stream's large request misses, before it calls
// allocate_async: the pool never grows while the requesting stream holds recent blocks, so the
// FIFO does not raise the peak the way a large cache did (Note [A small front cache]).
// The FIFO serves single-stream jobs only: once a second stream allocates, every FIFO goes to
// the pool and large frees go straight there again. Held back on one stream's FIFO, a block is
// out of reach of the pool's cross-stream reuse (event dependencies, opportunistic reuse); on
// the H200 e2e pipeline workload (two streams, record_stream) the FIFO, flushed for every
// stream at every miss, raised allocator time per step from 406 to 612 us and the peak from
// 3,526 to 3,622 MiB (medians of 5 runs, bench/results/e2e_h200_2026-12-02_session5a.md).
// On single-stream resnet50 it cut allocator time by 8% and 19% in two runs (1,726 against
// 1,870 and 1,540 against 1,901 us/step, session5a and session5c); on gpt2, whose shapes change
// every step, the two runs disagreed in sign (-4%, +8%): noise.
//
// Note [Stream order in the front cache]
// A cached block is reused only by the stream it was freed on (stream order makes that safe
// at once). Blocks for other streams come from the pool, whose reuse rules
// (async_reuse_follow_event_dependencies, async_reuse_allow_opportunistic,
// async_reuse_allow_internal_dependencies) decide when memory freed on one stream may serve
// another; the policy never synchronises the device to move memory across streams.
//
// Note [Out of memory in async]
// On a failed allocate_async the whole front cache goes back to the pool (free_async on each
// block's stream) and the allocation is retried once; then an empty Block lets the front end
// run its retry chain, whose release_cached() waits for the streams the policy freed on
// (one event each) and trims the pool to zero.
//
// Note [Reserved bytes read lazily]
// The front end keeps reserved_bytes current after every call, and the policy used to read the
// pool's cudaMemPoolAttrReservedMemCurrent after every allocate_async to give it the figure:
// one more driver call on every pool allocation (34 per step of the e2e pipeline workload, next
// to its 67 pool calls). Measured afterwards it is cheap (cachealloc-micro-cuda
// pool_reserved_read: 0.037 us hot, bench/results/gpu_bench_h200_2026-12-03_session9a_pool_calls.md),
// so this saves little time (about 1 us per pipeline step); it stays because nothing inside the
// policy needs the figure, and reading it where it is looked at keeps the hot path free of
// driver calls that decide nothing. The figure is read only when someone looks: the front
// end's stats(), check_invariants() and reset_peak_stats(), its retry chain before the
// out-of-memory message, and release_cached() after its trim. The peak
// comes from the pool's own high watermark (cudaMemPoolAttrReservedMemHigh), which sees every
// growth, also those between two reads, and also when async_release_threshold lets the driver
// shrink the pool at synchronisations; reset_peak_stats() resets it (the driver accepts 0:
// back to the current value) with the front end's peaks, so reserved_bytes.peak equals the
// pool's reserved_mem_high at every stats(). Between two reads, the front end's internal figure
// may lag the pool; no decision rests on it.
//
// Note [Time in the pool's calls]
// Each allocate_async and free_async is timed with the backend's clock (steady_clock on CUDA,
// two reads of ~20 ns around a call of 0.7-1.2 us hot, several us inside a training step), and
// stats report the sum (pool.ns beside pool.calls). The e2e tables then split cachealloc:async's
// time into the driver's share, which cudaMallocAsync pays as well for every large block, and
// our own (lock, pointer map, front cache, statistics). On the simulated device the clock is
// the simulation's: pool.ns is 0, or 0.725 us per call with SimOptions::model_call_costs.
//
// Config keys: async_cache_mb, async_cache_max_block, async_small_slabs, async_recent_blocks, and the pool's async_release_threshold and async_reuse_* keys,
// which the policy forwards to the pool (set_pool_options) when present.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/config.h>
#include <cachealloc/policy.h>
#include <cachealloc/stream_ordered.h>
#include <cachealloc/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace cachealloc {

class AsyncPolicy {
 public:
  static constexpr std::string_view kName = "async";
  static std::vector<std::string_view> config_keys();
  static std::string_view oom_hint() {
    return "The stream-ordered pool could not grow. Lower async_cache_mb, or set "
           "async_release_threshold so that other processes get memory back sooner.";
  }

  /// Throws ConfigError when `backend` has no stream-ordered pool.
  AsyncPolicy(DeviceBackend& backend, Config& config);
  ~AsyncPolicy();
  AsyncPolicy(const AsyncPolicy&) = delete;
  AsyncPolicy& operator=(const AsyncPolicy&) = delete;

  [[nodiscard]] Block allocate(std::size_t bytes, StreamId stream);
  void deallocate(const Block& block, StreamId stream) noexcept;
  std::size_t release_cached();
  [[nodiscard]] std::size_t reserved_bytes() const noexcept { return reserved_; }
  /// Reads the pool's reserved bytes into reserved_bytes() (Note [Reserved bytes read lazily]).
  void refresh_reserved() const noexcept;
  /// The pool's reserved high watermark since it was created or reset_reserved_high().
  [[nodiscard]] std::size_t reserved_high() const noexcept;
  void reset_reserved_high() noexcept;
  void check_invariants() const;

  static constexpr std::size_t kSmallMax = 1 * kMiB;
  /// Most recent large frees kept per stream (Note [Recently freed large blocks in async]).
  static constexpr std::size_t kMaxRecent = 16;
  /// The size a request is rounded to (its cache key).
  [[nodiscard]] static std::size_t rounded_size(std::size_t bytes) noexcept;

  // ---- inspection for tests ----
  /// Bytes the policy holds from the pool beyond the blocks it handed out: the exact-size cache
  /// and the free parts of its slabs.
  [[nodiscard]] std::size_t cached_bytes() const noexcept {
    return cached_bytes_ + recent_bytes_ + (slab_bytes_ - small_live_bytes_);
  }
  [[nodiscard]] std::size_t slab_count() const noexcept { return slabs_.size(); }
  [[nodiscard]] std::size_t cache_limit() const noexcept { return cache_limit_; }
  [[nodiscard]] std::uint64_t cache_hits() const noexcept { return cache_hits_; }
  /// allocate_async + free_async calls so far (each one a driver call on CUDA).
  [[nodiscard]] std::uint64_t pool_calls() const noexcept { return pool_calls_; }
  /// Time inside those calls, by the backend's clock (Note [Time in the pool's calls]).
  [[nodiscard]] std::uint64_t pool_ns() const noexcept { return pool_ns_; }

 private:
  static constexpr std::size_t kSlabBytes = 2 * kMiB;
  /// Note [Small blocks from slabs]
  struct Slab {
    std::uintptr_t base = 0;
    std::size_t carved = 0;         // bytes carved so far (bump pointer)
    std::size_t carved_blocks = 0;  // blocks carved so far
    std::size_t live = 0;           // carved blocks not on a free list
    StreamId stream = 0;
  };
  struct StreamCache {
    StreamId stream;
    std::unordered_map<std::size_t, std::vector<void*>> by_size;  // LIFO per rounded size
    std::unordered_map<std::size_t, std::vector<std::pair<void*, Slab*>>> small_free;  // per class
    Slab* carving = nullptr;  // the slab new small blocks are carved from
    /// Note [Recently freed large blocks in async]: oldest first.
    std::array<std::pair<void*, std::size_t>, kMaxRecent> recent{};
    std::size_t recent_count = 0;
  };

  /// The stream's cache, created on first use.
  StreamCache& cache(StreamId stream);
  /// The stream's cache, or nullptr when it has none yet.
  StreamCache* find_cache(StreamId stream) noexcept;
  [[nodiscard]] bool from_slab(std::size_t size) const noexcept {
    return slabs_enabled_ && cache_limit_ > 0 && size <= kSmallMax;
  }
  Block allocate_small(std::size_t size, StreamId stream);
  Slab* new_slab(StreamId stream);
  void free_small(Block block) noexcept;
  /// Takes the slab's blocks off its stream's lists and gives it back to the pool.
  void release_slab(Slab* slab) noexcept;
  /// Every slab with no live block goes back to the pool.
  void release_empty_slabs() noexcept;
  /// Takes the FIFO's i-th block off it (the later ones move up) and returns it.
  void* remove_recent(StreamCache& c, std::size_t i) noexcept;
  /// The stream's recent block of exactly `size`, taken off its FIFO; nullptr when none.
  void* take_recent(StreamCache& c, std::size_t size) noexcept;
  void push_recent(StreamCache& c, void* ptr, std::size_t size) noexcept;
  /// Gives every block on the stream's FIFO to the pool.
  void flush_recent(StreamCache& c) noexcept;
  /// flush_recent on every stream.
  void drain_recent() noexcept;
  /// Returns every cached block (exact-size cache and recent FIFOs) to the pool.
  void drain_cache() noexcept;
  /// allocate_async, counted and timed; nullptr when the pool cannot grow.
  [[nodiscard]] void* pool_allocate(std::size_t bytes, StreamId stream);
  void free_to_pool(void* ptr, StreamId stream) noexcept;
  class PoolCallTimer;

  DeviceBackend& backend_;
  StreamOrderedMemory& pool_;
  std::size_t cache_limit_ = 32 * kMiB;
  std::size_t cache_max_block_ = kSmallMax;
  std::vector<std::unique_ptr<StreamCache>> caches_;  // few streams: linear search
  StreamCache* last_cache_ = nullptr;
  std::vector<StreamId> freed_on_;  // streams with free_async calls since the last sync
  bool slabs_enabled_ = true;
  std::vector<std::unique_ptr<Slab>> slabs_;
  std::size_t slab_bytes_ = 0;       // kSlabBytes per slab held
  std::size_t small_live_bytes_ = 0;  // blocks handed out from slabs
  std::size_t cached_bytes_ = 0;
  std::size_t recent_limit_ = 4;   // async_recent_blocks
  std::size_t recent_bytes_ = 0;   // blocks on the recent FIFOs
  std::size_t live_bytes_ = 0;  // blocks handed out straight from the pool or the exact-size cache
  // The pool's reserved_current when last read (Note [Reserved bytes read lazily]); mutable: the
  // front end refreshes it from its const stats() and check_invariants().
  mutable std::size_t reserved_ = 0;
  std::uint64_t cache_hits_ = 0;
  std::uint64_t pool_calls_ = 0;
  std::uint64_t pool_ns_ = 0;
};

static_assert(Policy<AsyncPolicy>);

}  // namespace cachealloc
