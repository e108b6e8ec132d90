// sim_stream_pool.h: a model of the driver's stream-ordered pool (cudaMemPool_t) on SimBackend,
// so the stream-ordered policy runs in CPU tests and replays.
//
// What is modelled (from the CUDA programming guide's "Stream Ordered Memory Allocator" chapter):
//   * Growth: the pool reserves physical memory in chunks of 32 MiB, or of the request rounded
//     up to 2 MiB (the simulated granularity) when larger, through SimBackend's virtual-memory
//     half (reserve_address + create_physical + map), so capacity, the memory-fraction limit,
//     held_bytes() and fault injection apply as for every backend.
//   * Placement: best fit among the free blocks of all chunks (sizes rounded to 512 B), split,
//     coalesced with free neighbours on free; a block never spans two chunks.
//   * Reuse (Note [Stream-ordered reuse in the model]).
//   * Trim: trim_to(keep) unmaps and releases whole free chunks, highest address first, while
//     more than `keep` bytes are reserved; a chunk whose last free has not completed on the
//     simulated device stays (the driver counts such memory as outstanding).
//   * Release threshold: the driver releases unused memory above the threshold when the host
//     synchronises; the model does it at the end of every free_async, for chunks whose frees
//     have completed by then.
//   * Attributes: reserved/used current and high are exact byte counts (used = rounded sizes).
// What is not: the driver's real chunk and placement heuristics, address layout, transitive
// event dependencies (only a direct wait on the freeing stream counts), and whether the driver
// prefers growing the pool to inserting a dependency (the model grows first).
//
// Note [Stream-ordered reuse in the model]
// free_async(p, S) marks a position f in S's order (a marker in SimBackend's per-stream
// sequence, as if an event were recorded there) and keeps (S, f) on the free block. A block
// is handed to stream T when every (S, f) it carries satisfies one of:
//   S == T                                            -- stream order
//   follow_event_dependencies and T waited (make_stream_wait) on an event of S at or after f
//   allow_opportunistic and S's work up to f completed (SimBackend::stream_completed)
// Otherwise, after growing the pool failed, and with allow_internal_dependencies (off by default
// in the model, see options_), the pool
// hands the best-fitting free block to T and records that T now waits on S up to f (counted in
// internal_dependencies()). Coalescing two free blocks merges their (S, f) lists (after dropping
// marks that opportunistic reuse already lets every stream ignore), so a pending free on S can
// keep a whole coalesced piece from other streams until S's work completes: conservative.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/stream_ordered.h>

#include <cstdint>
#include <map>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cachealloc {

class SimBackend;

class SimStreamPool final : public StreamOrderedMemory {
 public:
  static constexpr std::size_t kAlignment = 512;
  static constexpr std::size_t kChunk = 32 * kMiB;

  /// `vm` is `sim`'s virtual-memory half (SimBackend passes itself).
  SimStreamPool(SimBackend& sim, VirtualMemory& vm) noexcept : sim_(sim), vm_(vm) {}
  ~SimStreamPool() override;
  SimStreamPool(const SimStreamPool&) = delete;
  SimStreamPool& operator=(const SimStreamPool&) = delete;

  [[nodiscard]] void* allocate_async(std::size_t bytes, StreamId stream) override;
  void free_async(void* ptr, StreamId stream) noexcept override;
  void make_stream_wait(StreamId waiter, EventId event) override;
  void wait_for_frees(StreamId stream) override;
  void trim_to(std::size_t keep_bytes) override;

  // The four attributes count their reads, as the driver calls they stand for (attribute_reads).
  [[nodiscard]] std::size_t reserved_current() const override { return ++attribute_reads_, reserved_; }
  [[nodiscard]] std::size_t reserved_high() const override { return ++attribute_reads_, reserved_high_; }
  [[nodiscard]] std::size_t used_current() const override { return ++attribute_reads_, used_; }
  [[nodiscard]] std::size_t used_high() const override { return ++attribute_reads_, used_high_; }
  /// Reads of the four attributes so far (cudaMemPoolGetAttribute calls on a real pool).
  [[nodiscard]] std::uint64_t attribute_reads() const noexcept { return attribute_reads_; }
  void reset_high_watermarks() override;
  [[nodiscard]] std::size_t granularity() const noexcept override { return kAlignment; }

  [[nodiscard]] StreamOrderedOptions pool_options() const override { return options_; }
  void set_pool_options(const StreamOrderedOptions& options) override { options_ = options; }

  void check_invariants() const override;

  // ---- inspection for tests ----
  [[nodiscard]] std::uint64_t allocate_calls() const noexcept { return allocate_calls_; }
  [[nodiscard]] std::uint64_t free_calls() const noexcept { return free_calls_; }
  [[nodiscard]] std::uint64_t internal_dependencies() const noexcept { return internal_dependencies_; }
  [[nodiscard]] std::size_t chunk_count() const noexcept { return chunks_.size(); }
  /// free_async calls with a pointer that is not a live allocation of this pool (ignored).
  [[nodiscard]] std::uint64_t foreign_frees() const noexcept { return foreign_frees_; }

 private:
  struct FreeMark {
    StreamId stream;
    std::uint64_t position;  // in SimBackend's per-stream sequence
  };
  struct Piece {
    std::size_t size;
    std::uintptr_t chunk;  // base of the chunk holding it
    bool free;
    std::vector<FreeMark> marks;  // free only: frees it depends on
  };
  struct Chunk {
    std::size_t size;
    PhysicalHandle handle;
  };

  [[nodiscard]] bool reusable_by(const Piece& p, StreamId stream) const;
  [[nodiscard]] bool frees_completed(const Piece& p) const;
  /// Drops marks any stream may ignore (opportunistic reuse of completed frees).
  void settle(std::vector<FreeMark>& marks) const;
  /// Best-fitting free piece of >= bytes that `stream` may take (any free one when `any`).
  std::map<std::uintptr_t, Piece>::iterator find_fit(std::size_t bytes, StreamId stream, bool any);
  void* take(std::map<std::uintptr_t, Piece>::iterator it, std::size_t bytes);
  bool grow(std::size_t bytes);
  void release_chunk(std::uintptr_t base) noexcept;
  /// Releases completed wholly free chunks while reserved > keep_bytes.
  void release_free_chunks(std::size_t keep_bytes) noexcept;
  std::uint64_t mark_stream(StreamId stream) noexcept;

  SimBackend& sim_;
  VirtualMemory& vm_;
  // Internal dependencies off by default here (the driver's default is on): SimBackend has no
  // notion of one stream waiting for another, so the CPU suites' oracles, which judge a
  // cross-stream hand-over by the freeing stream's completion alone, would flag every one.
  // Tests and CACHEALLOC_CONF (async_reuse_allow_internal_dependencies:True) turn it on.
  StreamOrderedOptions options_ = [] {
    StreamOrderedOptions o;
    o.reuse_allow_internal_dependencies = false;
    return o;
  }();
  std::map<std::uintptr_t, Chunk> chunks_;
  std::map<std::uintptr_t, Piece> pieces_;                    // every piece, by address
  std::set<std::pair<std::size_t, std::uintptr_t>> free_;     // free pieces by (size, address)
  std::unordered_map<StreamId, std::unordered_map<StreamId, std::uint64_t>> waits_;  // T -> S -> pos
  std::size_t reserved_ = 0;
  std::size_t reserved_high_ = 0;
  std::size_t used_ = 0;
  std::size_t used_high_ = 0;
  std::uint64_t allocate_calls_ = 0;
  std::uint64_t free_calls_ = 0;
  std::uint64_t internal_dependencies_ = 0;
  std::uint64_t foreign_frees_ = 0;
  mutable std::uint64_t attribute_reads_ = 0;
};

}  // namespace cachealloc
