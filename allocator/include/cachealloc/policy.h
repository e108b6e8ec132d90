// policy.h: the policy contract, checked at compile time.
//
// A policy decides where blocks go inside device memory it obtains from a DeviceBackend. It is
// single-threaded (the front end, allocator.h, serialises calls and keeps the pointer map,
// statistics, cross-stream deferral and the out-of-memory retry chain), so its fast path can be
// a few dozen instructions. A policy must supply:
//
//   1. `static constexpr std::string_view kName` and `static std::vector<std::string_view>
//      config_keys()`: its registry name and the CACHEALLOC_CONF keys it accepts.
//   2. A constructor `P(DeviceBackend&, Config&)` that takes its keys from the config.
//   3. `Block allocate(std::size_t bytes, StreamId stream)`: a block of at least `bytes`
//      (bytes > 0), usable on `stream` right now, or an empty Block when it cannot find one
//      without more device memory than the backend gives. It may throw DeviceError; it must
//      leave its state consistent when it does.
//   4. `void deallocate(const Block& block, StreamId stream) noexcept`: `block` (exactly as returned by
//      allocate) is free; `stream` is the stream it was allocated on, and every use of the block
//      on other streams has already completed (the front end guarantees it). The block may be
//      reused on `stream` at once and on other streams only once the work queued on `stream`
//      before this call has finished.
//   5. `std::size_t release_cached()`: returns every wholly free device reservation it can to
//      the backend; returns the bytes released.
//   6. `std::size_t reserved_bytes() const noexcept`: device bytes held now (for VMM policies:
//      physical bytes mapped).
//   7. `void check_invariants() const`: throws InvariantError on any broken invariant
//      (no overlapping blocks, every reserved byte in exactly one block, ...).
//
// Optional: `void visit_segments(F&&) const` for snapshots (see SegmentView);
// `void deallocate_settled(const Block& block, StreamId stream) noexcept`: as deallocate, for a
// block no stream's work can touch any more (its own stream too finished everything queued
// before the free), so its memory may be reused on any stream or unmapped at once (Note [Frees
// that come back settled], allocator.h); `void note_parked(std::size_t bytes) noexcept`: how many
// of the bytes the policy sees live are frees the front end parks for other streams (after
// every change); `void hold_growth(bool held) noexcept`: while held, allocate() creates no device
// memory and returns an empty Block instead (Note [Waiting for frees in flight instead of
// growing], allocator.h).
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/config.h>
#include <cachealloc/types.h>

#include <concepts>
#include <cstddef>
#include <string_view>
#include <vector>

namespace cachealloc {

template <class P>
concept Policy = requires(P& p, const P& cp, std::size_t bytes, StreamId stream, Block block) {
  { P::kName } -> std::convertible_to<std::string_view>;
  { P::config_keys() } -> std::convertible_to<std::vector<std::string_view>>;
  requires std::constructible_from<P, DeviceBackend&, Config&>;
  { p.allocate(bytes, stream) } -> std::same_as<Block>;
  { p.deallocate(block, stream) } noexcept -> std::same_as<void>;
  { p.release_cached() } -> std::same_as<std::size_t>;
  { cp.reserved_bytes() } noexcept -> std::same_as<std::size_t>;
  { cp.check_invariants() } -> std::same_as<void>;
};

/// One block inside a segment, for snapshots and plots.
struct BlockView {
  std::uintptr_t address;
  std::size_t size;
  bool allocated;
};

/// One device reservation (or, for VMM policies, one mapped range) with its blocks.
struct SegmentView {
  std::uintptr_t address;
  std::size_t size;
  StreamId stream;
  bool small_pool;
  std::vector<BlockView> blocks;
};

}  // namespace cachealloc
