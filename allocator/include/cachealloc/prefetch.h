// prefetch.h: asking the CPU for cache lines ahead of their use.
//
// Note [Prefetching the lines a call will touch]
// Inside a training step every allocator call finds the CPU caches cold (Note [Hot fields
// first], allocator.h), and most of the lines it touches it reaches one after the other: the
// lock, then the front end's fields, then the policy's, then a B+tree node whose binary search
// reads a line, compares, and only then knows the next line to read. Each is a miss in a chain,
// and the core waits for them one at a time; cold code makes it worse, since the core cannot run
// ahead far enough to find the next load by itself. A prefetch names lines whose addresses are
// already known, so their misses overlap: the front end's own fields before the lock (fixed
// addresses inside the allocator object, nothing read without the lock), the pointer map's home
// slot and, for policy defrag, the engine's fields, its mapped holes' root node and its streams'
// table once the lock is held, and each B+tree node whole before its binary search
// (ordered_index.h; only defrag's indexes). `prefetch:False` (CACHEALLOC_CONF, default True)
// turns all of it off, for side by side measurements. On the development VM
// (cachealloc-cold-replay, e2e pipeline recording, 1-4 MiB evicted between calls) the
// difference was inside the run-to-run noise either way; the GPU hosts decide (results in
// bench/results/defrag_session46_2026-12-07.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace cachealloc {

/// Asks for every cache line of [p, p + bytes) (for writing, to keep in all levels); no effect
/// where the compiler has no prefetch builtin.
inline void prefetch_lines(const void* p, std::size_t bytes) noexcept {
#if defined(__GNUC__)
  const auto* c = static_cast<const char*>(p);
  const auto first = reinterpret_cast<std::uintptr_t>(c) & ~std::uintptr_t{63};
  const auto last = reinterpret_cast<std::uintptr_t>(c) + bytes;
  for (std::uintptr_t line = first; line < last; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 1, 3);
  }
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace cachealloc
