// defrag_check.cpp: policy `defrag`'s invariant checks and snapshots (segments, breakdown),
// all O(ranges + mapped pages).
#include <cachealloc/errors.h>

#include "defrag_engine.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace cachealloc::detail {

// ============================================================================ inspection

void DefragEngine::check_invariants() const {
  std::size_t live = 0;
  std::size_t live_blocks = 0;
  std::size_t kept = 0;  // Note [Recently freed small blocks in defrag]
  std::size_t kept_blocks = 0;
  std::size_t mapped_nodes = 0;
  std::size_t unmapped_nodes = 0;
  std::size_t age_nodes = 0;
  std::vector<PhysicalHandle> handles;
  for (const auto& a : arenas_) {
    CACHEALLOC_CHECK_INVARIANT(a->head != nullptr && a->head->prev == nullptr, "arena without head");
    // Note [Address ranges of their own for streams]: only large ranges belong to a stream.
    CACHEALLOC_CHECK_INVARIANT(
        a->home < kStreamRanges && (a->home == 0 || (settings_.stream_ranges && a->kind == kLarge)),
        "address range of a stream where ranges are shared");
    std::uintptr_t cursor = a->base;
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      // Built only when a check fails (the macro evaluates its message lazily).
      const auto where = [n] { return " at " + std::to_string(n->addr); };
      CACHEALLOC_CHECK_INVARIANT(n->arena == a.get(), "range in the wrong arena" + where());
      CACHEALLOC_CHECK_INVARIANT(n->addr == cursor, "gap or overlap between ranges" + where());
      CACHEALLOC_CHECK_INVARIANT(n->size > 0 && n->size % kAlignment == 0 && n->addr % kAlignment == 0,
                                 "range not 512-byte aligned or empty" + where());
      CACHEALLOC_CHECK_INVARIANT(n->next == nullptr || n->next->prev == n, "broken links" + where());
      CACHEALLOC_CHECK_INVARIANT(n->stamp <= epoch_, "stamp from the future" + where());
      const bool unmapped = n->state == State::unmapped_free;
      switch (n->state) {
        case State::live:
          live += n->size;
          ++live_blocks;
          CACHEALLOC_CHECK_INVARIANT(!n->indexed && !n->in_age, "live block in a free index" + where());
          break;
        case State::cached:
          kept += n->size;
          ++kept_blocks;
          CACHEALLOC_CHECK_INVARIANT(!n->indexed && !n->in_age, "kept block in a free index" + where());
          CACHEALLOC_CHECK_INVARIANT(n->size <= recent_max_ && n->cls < streams_.size(),
                                     "kept block too large or of an unknown stream" + where());
          break;
        case State::mapped_free: {
          ++mapped_nodes;
          CACHEALLOC_CHECK_INVARIANT(n->indexed, "mapped hole missing from the index" + where());
          CACHEALLOC_CHECK_INVARIANT(n->cls < streams_.size(), "hole of an unknown stream" + where());
          if (n->next != nullptr && n->next->state == State::mapped_free) {
            CACHEALLOC_CHECK_INVARIANT(n->cls != n->next->cls,
                                       "unmerged mapped holes of one stream" + where());
          }
          CACHEALLOC_CHECK_INVARIANT(n->in_age == (whole_pages(n) > 0),
                                     "age list disagrees with the hole's whole pages" + where());
          break;
        }
        case State::unmapped_free:
          ++unmapped_nodes;
          CACHEALLOC_CHECK_INVARIANT(n->indexed, "unmapped hole missing from the index" + where());
          CACHEALLOC_CHECK_INVARIANT(n->addr % page_ == 0 && n->size % page_ == 0,
                                     "unmapped hole not page aligned" + where());
          CACHEALLOC_CHECK_INVARIANT(n->next == nullptr || n->next->state != State::unmapped_free,
                                     "unmerged unmapped holes" + where());
          CACHEALLOC_CHECK_INVARIANT(!n->in_age, "unmapped hole in the age list" + where());
          break;
        case State::dead:
          CACHEALLOC_CHECK_INVARIANT(false, "recycled node still linked" + where());
      }
      CACHEALLOC_CHECK_INVARIANT(n->kind == a->kind, "node's kind differs from its arena's" + where());
      if (n->indexed) {
        const IndexKey k = n->indexed_key();
        CACHEALLOC_CHECK_INVARIANT(k.size() == n->size && k.addr == n->addr,
                                   "index key out of date" + where());
        const auto entry = index_of(n).find(k);
        CACHEALLOC_CHECK_INVARIANT(entry != index_of(n).end() && entry->node == n,
                                   "indexed hole not found under its key" + where());
        const IndexKey expected = key_of(n);
        CACHEALLOC_CHECK_INVARIANT(k.bucket() == expected.bucket(), "index bucket out of date" + where());
      }
      // Pages: mapped exactly outside unmapped holes.
      for (std::uintptr_t p = page_down(n->addr); p < n->end(); p += page_) {
        const std::size_t i = page_index(*a, p);
        const PhysicalHandle h = i < a->pages.size() ? a->pages[i] : 0;
        if (unmapped) {
          CACHEALLOC_CHECK_INVARIANT(h == 0, "page mapped inside an unmapped hole" + where());
          if (i >= a->pages.size()) {
            break;  // beyond the highest page ever mapped: all unmapped
          }
        } else {
          CACHEALLOC_CHECK_INVARIANT(h != 0, "page under a block or mapped hole is unmapped" + where());
          if (p >= n->addr) {  // count each page once: at the range where it starts
            handles.push_back(h);
          }
        }
      }
      cursor = n->end();
    }
    CACHEALLOC_CHECK_INVARIANT(cursor == a->base + a->size, "ranges do not cover their arena");
  }
  for (const Node* n = age_head_; n != nullptr; n = n->age_next) {
    ++age_nodes;
    CACHEALLOC_CHECK_INVARIANT(n->in_age && n->state == State::mapped_free, "age list holds a non-hole");
    CACHEALLOC_CHECK_INVARIANT(n->age_next != nullptr || n == age_tail_, "age list tail wrong");
  }
  std::size_t in_age = 0;
  for (const auto& a : arenas_) {
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      in_age += n->in_age ? 1 : 0;
    }
  }
  CACHEALLOC_CHECK_INVARIANT(age_nodes == in_age, "age list length disagrees with its members");
  // A node marked deferred is listed (the mark keeps it from being listed twice).
  std::size_t flagged = 0;
  for (const auto& a : arenas_) {
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      flagged += n->deferred ? 1 : 0;
      CACHEALLOC_CHECK_INVARIANT(!n->deferred || std::find(deferred_.begin(), deferred_.end(), n) != deferred_.end(),
                                 "a node marked deferred is not in the deferred list");
    }
  }
  CACHEALLOC_CHECK_INVARIANT(flagged <= deferred_.size(), "more nodes marked deferred than listed");
  for (const Index* index : {&mapped_, &unmapped_}) {
    try {
      index->check();
    } catch (const std::logic_error& e) {
      throw InvariantError(std::string("defrag: a free index is broken: ") + e.what());
    }
  }
  CACHEALLOC_CHECK_INVARIANT(mapped_nodes == mapped_.size(), "stale entries in the mapped index");
  CACHEALLOC_CHECK_INVARIANT(unmapped_nodes == unmapped_.size(), "stale entries in the unmapped index");
  CACHEALLOC_CHECK_INVARIANT(live == live_bytes_ && live_blocks == live_blocks_,
                             "live bytes disagree with the blocks");
  // Note [Recently freed small blocks in defrag]: every kept block is on its own stream's list
  // for its size, once.
  std::size_t listed = 0;
  std::size_t listed_bytes = 0;
  for (std::uint32_t cls = 0; cls < streams_.size(); ++cls) {
    if (!streams_[cls].recent) {
      continue;
    }
    for (std::size_t i = 0; i < kRecentSlots; ++i) {
      for (const Node* n = streams_[cls].recent[i]; n != nullptr; n = n->age_next) {
        CACHEALLOC_CHECK_INVARIANT(n->state == State::cached && n->cls == cls && n->size / kAlignment == i,
                                   "a recent list holds a block that is not kept there");
        CACHEALLOC_CHECK_INVARIANT(++listed <= kept_blocks, "a recent list is longer than the kept blocks");
        listed_bytes += n->size;
      }
    }
  }
  CACHEALLOC_CHECK_INVARIANT(listed == kept_blocks && listed_bytes == kept && kept == recent_bytes_ &&
                                 kept_blocks == recent_blocks_ && recent_bytes_ <= settings_.keep_small_bytes,
                             "kept bytes disagree with the recent lists");
  CACHEALLOC_CHECK_INVARIANT(peak_live_ >= live_bytes_, "peak live bytes below the live bytes");
  // `handles` lists the handle of every mapped page in address order: each chunk must appear as
  // one run (mapped once, whole), and the chunks mapped must be every chunk held.
  std::vector<PhysicalHandle> runs;
  for (std::size_t i = 0; i < handles.size(); ++i) {
    if (i == 0 || handles[i] != handles[i - 1]) {
      runs.push_back(handles[i]);
    }
  }
  std::sort(runs.begin(), runs.end());
  CACHEALLOC_CHECK_INVARIANT(std::adjacent_find(runs.begin(), runs.end()) == runs.end(),
                             "a physical chunk is mapped twice (or in pieces)");
  CACHEALLOC_CHECK_INVARIANT(runs.size() == held_chunks_,
                             "mapped chunks (" + std::to_string(runs.size()) +
                                 ") differ from the chunks held (" + std::to_string(held_chunks_) + ")");
  CACHEALLOC_CHECK_INVARIANT(handles.size() == held_pages_,
                             "mapped pages (" + std::to_string(handles.size()) +
                                 ") differ from the pages held (" + std::to_string(held_pages_) + ")");
  CACHEALLOC_CHECK_INVARIANT(vm_.physical_bytes() >= reserved_bytes(),
                             "the policy reports more physical memory than the backend holds");
  CACHEALLOC_CHECK_INVARIANT(unsafe_unmaps_ == 0,
                             "a page was unmapped while a stream use recorded on it was unfinished");
  std::size_t dirty = 0;
  for (const StreamState& st : streams_) {
    std::uint64_t last = 0;
    for (const Fence& f : st.fences) {
      CACHEALLOC_CHECK_INVARIANT(f.epoch > last && f.epoch < epoch_, "fences out of order");
      last = f.epoch;
    }
    CACHEALLOC_CHECK_INVARIANT(
        st.completed == (st.fences.empty() ? epoch_ - 1 : st.fences.front().epoch - 1),
        "a stream's completed epoch disagrees with its oldest fence");
    dirty += st.dirty ? 1 : 0;
  }
  CACHEALLOC_CHECK_INVARIANT(dirty == dirty_list_.size(), "dirty streams out of step");
}

std::vector<SegmentView> DefragEngine::segments() const {
  std::vector<SegmentView> out;
  for (const auto& a : arenas_) {
    SegmentView* seg = nullptr;
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      if (n->state == State::unmapped_free) {
        seg = nullptr;
        continue;
      }
      if (seg == nullptr) {
        out.push_back(SegmentView{n->addr, 0, 0, a->kind == kSmall, {}});
        seg = &out.back();
      }
      seg->size += n->size;
      seg->blocks.push_back(BlockView{n->addr, n->size, n->state == State::live});
    }
  }
  return out;
}

DefragBreakdown DefragEngine::breakdown() const {
  DefragBreakdown out;
  for (const auto& a : arenas_) {
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      if (n->state == State::live) {
        out.live_bytes += n->size;
        ++out.live_blocks;
      } else if (n->state == State::cached) {
        out.kept_bytes += n->size;
      } else if (n->state == State::mapped_free) {
        const std::size_t whole = whole_pages(n) * page_;
        out.cached_free_bytes += whole;
        out.edge_free_bytes += n->size - whole;
        ++out.free_holes;
      }
    }
  }
  return out;
}

}  // namespace cachealloc::detail
