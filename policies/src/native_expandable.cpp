// native_expandable.cpp: expandable segments for policy `native` (expandable_segments:True).
//
// Note [Expandable segments]
// Instead of one device reservation per large request, PyTorch keeps one address range per
// (stream, pool), reserved once for 1 1/8 of the device memory, and backs it with physical pages
// on demand: 2 MiB pages for the small pool, 20 MiB pages for the large pool (one cuMemCreate and
// one cuMemMap per page). A range's blocks are free-and-mapped, allocated, or unmapped (whole
// pages with no memory behind them). Growth maps the lowest unmapped pages that, together with
// the free block in front of them, fit the request, and logs one segment_map entry for each
// growth step with the bytes it mapped. On release, every whole page inside a free block is
// unmapped (one segment_unmap entry per free block), and a range with nothing mapped left is given
// back. Reserved bytes are the mapped bytes.
#include <cachealloc/errors.h>

#include <algorithm>
#include <exception>

#include "native_detail.h"

namespace cachealloc::native_detail {

/// PyTorch's find_expandable_block: the lowest-addressed place of this stream's pool where free
/// and unmapped blocks together hold `size` bytes, else a new address range.
Block* Core::find_expandable_block(Pool& pool, std::size_t size, StreamId stream) {
  for (auto it = pool.unmapped.lower_bound(SizeKey{stream, 0, 0});
       it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
    Block* candidate = *it;
    if (candidate->prev != nullptr && !candidate->prev->allocated) {
      candidate = candidate->prev;  // the free block right before the hole grows into it
    }
    std::size_t room = 0;
    for (const Block* b = candidate; room < size && b != nullptr && !b->allocated; b = b->next) {
      room += b->size;
    }
    if (room >= size) {
      return candidate;
    }
  }
  const std::size_t page = pool.small ? kSmallBuffer : kLargeBuffer;
  const std::size_t total = backend_.total_memory();
  const std::size_t range = (total + total / 8 + page - 1) / page * page;
  const std::uintptr_t va = vm_->reserve_address(range);
  Segment* segment = nullptr;
  Block* block = nullptr;
  try {
    segment = add_segment(va, range, stream, pool);
    block = arena_.make();
    segment->expandable = true;
    segment->page_size = page;
    block->addr = va;
    block->size = range;
    block->stream = stream;
    block->segment = segment;
    block->pool = &pool;
    block->mapped = false;
    segment->head = block;
    pool.unmapped.insert(block);
  } catch (...) {
    if (block != nullptr) {
      arena_.destroy(block);
    }
    if (segment != nullptr) {
      remove_segment(segment);
    }
    vm_->free_address(va, range);
    throw;
  }
  return block;
}

/// PyTorch's map_block: backs the pages covering the first `size` bytes of unmapped `to_map` with
/// memory; the mapped front merges with free mapped neighbours and is cached. False when the
/// device has no memory for all of them (nothing changes then).
bool Core::map_block(Block* to_map, std::size_t size) {
  Segment& s = *to_map->segment;
  const std::size_t page = s.page_size;
  const std::size_t offset = to_map->addr - s.addr;
  const std::size_t begin = offset / page;
  const std::size_t end = (offset + size + page - 1) / page;
  if (begin == end) {
    return false;
  }
  if (s.pages.size() < end) {
    s.pages.resize(end, 0);
  }
  std::size_t created = begin;
  std::size_t mapped = begin;
  try {
    for (; created < end; ++created) {
      const PhysicalHandle h = vm_->create_physical(page);
      if (h == 0) {
        break;
      }
      s.pages[created] = h;
    }
    if (created == end) {
      for (; mapped < end; ++mapped) {
        vm_->map(s.addr + mapped * page, page, s.pages[mapped]);
      }
    }
  } catch (...) {
    for (std::size_t i = begin; i < mapped; ++i) {
      try {
        vm_->unmap(s.addr + i * page, page);
      } catch (...) {  // NOLINT(bugprone-empty-catch): best effort while failing already
      }
    }
    for (std::size_t i = begin; i < created; ++i) {
      vm_->release_physical(s.pages[i], page);
      s.pages[i] = 0;
    }
    throw;
  }
  if (created != end) {  // out of memory: give back what this step created
    for (std::size_t i = begin; i < created; ++i) {
      vm_->release_physical(s.pages[i], page);
      s.pages[i] = 0;
    }
    return false;
  }
  const std::size_t bytes = (end - begin) * page;
  s.mapped_bytes += bytes;
  reserved_ += bytes;
  ++counters_.maps;
  record(SegmentEvent::map, bytes, s.addr + begin * page, s.stream);

  Pool& pool = *to_map->pool;
  pool.unmapped.erase(to_map);
  to_map->mapped = true;
  if (bytes < to_map->size) {
    Block* rest = arena_.make();
    rest->addr = to_map->addr + bytes;
    rest->size = to_map->size - bytes;
    rest->stream = to_map->stream;
    rest->segment = to_map->segment;
    rest->pool = to_map->pool;
    rest->mapped = false;
    rest->prev = to_map;
    rest->next = to_map->next;
    if (rest->next != nullptr) {
      rest->next->prev = rest;
    }
    to_map->next = rest;
    to_map->size = bytes;
    pool.unmapped.insert(rest);
  }
  try_merge(to_map, to_map->prev);
  try_merge(to_map, to_map->next);
  cache(to_map);
  return true;
}

/// PyTorch's try_allocate_expandable_block: grows a segment until a free mapped block of `size`
/// bytes exists there, and takes that block out of the pool (not yet split).
Block* Core::try_allocate_expandable_block(Pool& pool, std::size_t size, StreamId stream) {
  Block* candidate = find_expandable_block(pool, size, stream);
  // candidate: unmapped [-> free -> ...], or free -> unmapped [-> ...], with room for `size`.
  if (!candidate->mapped && !map_block(candidate, std::min(candidate->size, size))) {
    return nullptr;
  }
  while (candidate->size < size) {
    Block* next = candidate->next;  // unmapped: free mapped neighbours are always merged
    if (next == nullptr) {
      return nullptr;  // a request larger than a whole address range (1 1/8 of the device)
    }
    if (!map_block(next, std::min(size - candidate->size, next->size))) {
      return nullptr;
    }
    candidate = next;  // map_block merged the old candidate into it
  }
  uncache(candidate);
  return candidate;
}

/// PyTorch's unmap_block: unmaps every whole page inside free mapped `block`; the partial pages
/// at either end stay mapped as free blocks of their own.
void Core::unmap_block(Block* block) {
  Segment& s = *block->segment;
  const std::size_t page = s.page_size;
  const std::size_t offset = block->addr - s.addr;
  const std::size_t begin = (offset + page - 1) / page;
  std::size_t end = (offset + block->size) / page;
  if (begin >= end) {
    return;
  }
  reserve_spares(2, 1);
  std::exception_ptr failure;
  for (std::size_t i = begin; i < end; ++i) {
    try {
      vm_->unmap(s.addr + i * page, page);
    } catch (...) {  // keep what was unmapped so far consistent, then report
      failure = std::current_exception();
      end = i;
      break;
    }
    vm_->release_physical(s.pages[i], page);
    s.pages[i] = 0;
  }
  if (begin < end) {
    const std::uintptr_t first = s.addr + begin * page;
    const std::size_t bytes = (end - begin) * page;
    uncache(block);
    if (first > block->addr) {  // prev? -> before -> block
      Block* before = arena_.make();
      before->addr = block->addr;
      before->size = first - block->addr;
      before->stream = block->stream;
      before->segment = block->segment;
      before->pool = block->pool;
      before->prev = block->prev;
      before->next = block;
      if (before->prev != nullptr) {
        before->prev->next = before;
      } else {
        s.head = before;
      }
      block->prev = before;
      cache(before);
    }
    const std::size_t after_size = block->addr + block->size - (first + bytes);
    if (after_size > 0) {  // block -> after -> next?
      Block* after = arena_.make();
      after->addr = first + bytes;
      after->size = after_size;
      after->stream = block->stream;
      after->segment = block->segment;
      after->pool = block->pool;
      after->prev = block;
      after->next = block->next;
      if (after->next != nullptr) {
        after->next->prev = after;
      }
      block->next = after;
      cache(after);
    }
    block->addr = first;
    block->size = bytes;
    block->mapped = false;
    try_merge(block, block->prev);
    try_merge(block, block->next);
    block->pool->unmapped.insert(block);
    s.mapped_bytes -= bytes;
    reserved_ -= bytes;
    ++counters_.unmaps;
    record(SegmentEvent::unmap, bytes, first, s.stream);
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
}

/// Gives an expandable segment's address range back once a single unmapped block covers it.
void Core::release_expandable_segment(Block* block) noexcept {
  Segment* segment = block->segment;
  block->pool->unmapped.erase(block);
  vm_->free_address(segment->addr, segment->size);
  arena_.destroy(block);
  remove_segment(segment);
}

void Core::check_expandable_segment(const Segment& s) const {
  const std::size_t page = s.page_size;
  CACHEALLOC_CHECK_INVARIANT(page > 0 && s.size % page == 0, "expandable segment without pages");
  std::size_t mapped_pages = 0;
  for (PhysicalHandle h : s.pages) {
    mapped_pages += h != 0 ? 1 : 0;
  }
  CACHEALLOC_CHECK_INVARIANT(mapped_pages * page == s.mapped_bytes, "mapped byte count is wrong");
  auto page_mapped = [&](std::size_t i) { return i < s.pages.size() && s.pages[i] != 0; };
  for (const Block* b = s.head; b != nullptr; b = b->next) {
    const std::size_t offset = b->addr - s.addr;
    if (!b->mapped) {
      CACHEALLOC_CHECK_INVARIANT(offset % page == 0 && b->size % page == 0,
                                 "unmapped block not aligned to pages");
      const std::size_t last = std::min(s.pages.size(), (offset + b->size) / page);
      for (std::size_t i = offset / page; i < last; ++i) {
        CACHEALLOC_CHECK_INVARIANT(!page_mapped(i), "page under an unmapped block is mapped");
      }
    } else {
      for (std::size_t i = offset / page; i < (offset + b->size + page - 1) / page; ++i) {
        CACHEALLOC_CHECK_INVARIANT(page_mapped(i), "page under a mapped block is not mapped");
      }
    }
  }
}

void Core::release_everything() noexcept {
  for (auto& segment : segments_) {
    if (segment->expandable) {
      for (std::size_t i = 0; i < segment->pages.size(); ++i) {
        if (segment->pages[i] != 0) {
          try {
            vm_->unmap(segment->addr + i * segment->page_size, segment->page_size);
          } catch (...) {  // NOLINT(bugprone-empty-catch): destructor, give back what we can
          }
          vm_->release_physical(segment->pages[i], segment->page_size);
        }
      }
      vm_->free_address(segment->addr, segment->size);
    } else {
      backend_.release(reinterpret_cast<void*>(segment->addr), segment->size);
    }
  }
  segments_.clear();
  reserved_ = 0;
}

}  // namespace cachealloc::native_detail
