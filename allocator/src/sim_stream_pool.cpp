// sim_stream_pool.cpp: the simulated stream-ordered pool (see sim_stream_pool.h for the model).
#include <cachealloc/errors.h>
#include <cachealloc/sim_backend.h>
#include <cachealloc/sim_stream_pool.h>

#include <algorithm>
#include <string>

namespace cachealloc {

// The simulated device disappears with the pool (SimBackend owns it): nothing to give back.
SimStreamPool::~SimStreamPool() = default;

std::uint64_t SimStreamPool::mark_stream(StreamId stream) noexcept {
  // A marker in the stream's order, as if an event were recorded there: complete_stream, tick
  // and synchronize_event complete it like any event; no Event object, no device call counted.
  const std::uint64_t position = ++sim_.stream_recorded_[stream];
  if (sim_.options_.auto_complete_events && !sim_.held_.contains(stream)) {
    sim_.stream_completed_upto_[stream] = position;
  }
  return position;
}

bool SimStreamPool::reusable_by(const Piece& p, StreamId stream) const {
  for (const FreeMark& m : p.marks) {
    if (m.stream == stream) {
      continue;  // stream order
    }
    if (options_.reuse_follow_event_dependencies) {
      if (auto w = waits_.find(stream); w != waits_.end()) {
        if (auto s = w->second.find(m.stream); s != w->second.end() && s->second >= m.position) {
          continue;
        }
      }
    }
    if (options_.reuse_allow_opportunistic && sim_.stream_completed(m.stream) >= m.position) {
      continue;
    }
    return false;
  }
  return true;
}

void SimStreamPool::settle(std::vector<FreeMark>& marks) const {
  if (options_.reuse_allow_opportunistic) {
    std::erase_if(marks, [&](const FreeMark& m) { return sim_.stream_completed(m.stream) >= m.position; });
  }
}

bool SimStreamPool::frees_completed(const Piece& p) const {
  return std::all_of(p.marks.begin(), p.marks.end(), [&](const FreeMark& m) {
    return sim_.stream_completed(m.stream) >= m.position;
  });
}

std::map<std::uintptr_t, SimStreamPool::Piece>::iterator SimStreamPool::find_fit(std::size_t bytes,
                                                                                 StreamId stream,
                                                                                 bool any) {
  for (auto it = free_.lower_bound({bytes, 0}); it != free_.end(); ++it) {
    auto piece = pieces_.find(it->second);
    if (any || reusable_by(piece->second, stream)) {
      return piece;
    }
  }
  return pieces_.end();
}

void* SimStreamPool::take(std::map<std::uintptr_t, Piece>::iterator it, std::size_t bytes) {
  Piece& p = it->second;
  free_.erase({p.size, it->first});
  if (p.size > bytes) {  // split: the rest stays free with the same marks
    Piece rest{p.size - bytes, p.chunk, true, p.marks};
    const std::uintptr_t rest_addr = it->first + bytes;
    free_.emplace(rest.size, rest_addr);
    pieces_.emplace(rest_addr, std::move(rest));
    p.size = bytes;
  }
  p.free = false;
  p.marks.clear();
  used_ += bytes;
  used_high_ = std::max(used_high_, used_);
  return reinterpret_cast<void*>(it->first);
}

bool SimStreamPool::grow(std::size_t bytes) {
  const std::size_t page = std::max<std::size_t>(2 * kMiB, vm_.granularity());
  const std::size_t size = bytes <= kChunk ? round_up(kChunk, page) : round_up(bytes, page);
  const std::uintptr_t va = vm_.reserve_address(size);
  PhysicalHandle handle = 0;
  try {
    handle = vm_.create_physical(size);
    if (handle == 0) {
      vm_.free_address(va, size);
      return false;
    }
    vm_.map(va, size, handle);
  } catch (...) {
    if (handle != 0) {
      vm_.release_physical(handle, size);
    }
    vm_.free_address(va, size);
    throw;
  }
  chunks_.emplace(va, Chunk{size, handle});
  pieces_.emplace(va, Piece{size, va, true, {}});
  free_.emplace(size, va);
  reserved_ += size;
  reserved_high_ = std::max(reserved_high_, reserved_);
  return true;
}

void* SimStreamPool::allocate_async(std::size_t bytes, StreamId stream) {
  sim_.charge(sim_.call_costs().pool_op_ns);  // Note [Simulated time]: with model_call_costs only
  const std::size_t rounded = round_up(std::max<std::size_t>(bytes, 1), kAlignment);
  if (rounded < bytes) {
    return nullptr;  // wrapped: no device has that much
  }
  if (auto it = find_fit(rounded, stream, false); it != pieces_.end()) {
    ++allocate_calls_;
    return take(it, rounded);
  }
  if (grow(rounded)) {
    ++allocate_calls_;
    return take(find_fit(rounded, stream, false), rounded);
  }
  if (options_.reuse_allow_internal_dependencies) {
    if (auto it = find_fit(rounded, stream, true); it != pieces_.end()) {
      for (const FreeMark& m : it->second.marks) {
        if (m.stream != stream) {
          std::uint64_t& pos = waits_[stream][m.stream];
          pos = std::max(pos, m.position);
        }
      }
      ++internal_dependencies_;
      ++allocate_calls_;
      return take(it, rounded);
    }
  }
  return nullptr;
}

void SimStreamPool::free_async(void* ptr, StreamId stream) noexcept {
  sim_.charge(sim_.call_costs().pool_op_ns);
  auto it = pieces_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == pieces_.end() || it->second.free) {
    ++foreign_frees_;
    return;
  }
  ++free_calls_;
  Piece& p = it->second;
  used_ -= p.size;
  p.free = true;
  p.marks.push_back({stream, mark_stream(stream)});
  settle(p.marks);
  // Coalescing unions the marks: the merged piece is reusable where both halves were.
  auto merge_marks = [this](std::vector<FreeMark>& into, std::vector<FreeMark>& from) {
    settle(into);
    settle(from);
    for (const FreeMark& m : from) {
      auto same = std::find_if(into.begin(), into.end(),
                               [&](const FreeMark& x) { return x.stream == m.stream; });
      if (same == into.end()) {
        into.push_back(m);
      } else {
        same->position = std::max(same->position, m.position);
      }
    }
  };
  // Coalesce with the free neighbours inside the same chunk.
  if (auto next = std::next(it); next != pieces_.end() && next->second.free &&
                                 next->second.chunk == p.chunk) {
    free_.erase({next->second.size, next->first});
    p.size += next->second.size;
    merge_marks(p.marks, next->second.marks);
    pieces_.erase(next);
  }
  if (it != pieces_.begin()) {
    if (auto prev = std::prev(it); prev->second.free && prev->second.chunk == p.chunk) {
      free_.erase({prev->second.size, prev->first});
      prev->second.size += p.size;
      merge_marks(prev->second.marks, p.marks);
      pieces_.erase(it);
      it = prev;
    }
  }
  free_.emplace(it->second.size, it->first);
  // Release threshold (model: applied here, not at the host's synchronisation points).
  if (reserved_ - used_ > options_.release_threshold) {
    release_free_chunks(used_ + static_cast<std::size_t>(options_.release_threshold));
  }
}

void SimStreamPool::make_stream_wait(StreamId waiter, EventId event) {
  auto ev = sim_.events_.find(event);
  if (ev == sim_.events_.end()) {
    throw DeviceError("simulated pool: make_stream_wait on an unknown event " + std::to_string(event));
  }
  if (ev->second.stream == waiter) {
    return;  // a stream always follows its own order
  }
  std::uint64_t& pos = waits_[waiter][ev->second.stream];
  pos = std::max(pos, ev->second.sequence);
}

void SimStreamPool::release_chunk(std::uintptr_t base) noexcept {
  auto c = chunks_.find(base);
  const std::size_t size = c->second.size;
  try {
    vm_.unmap(base, size);
  } catch (...) {  // NOLINT(bugprone-empty-catch): an injected unmap failure leaks the mapping only
  }
  vm_.release_physical(c->second.handle, size);
  vm_.free_address(base, size);
  auto p = pieces_.find(base);
  free_.erase({p->second.size, base});
  pieces_.erase(p);
  chunks_.erase(c);
  reserved_ -= size;
}

void SimStreamPool::release_free_chunks(std::size_t keep_bytes) noexcept {
  std::vector<std::uintptr_t> candidates;  // highest address first
  for (auto c = chunks_.rbegin(); c != chunks_.rend(); ++c) {
    const Piece& p = pieces_.at(c->first);
    if (p.free && p.size == c->second.size && frees_completed(p)) {
      candidates.push_back(c->first);
    }
  }
  for (std::uintptr_t base : candidates) {
    if (reserved_ <= keep_bytes) {
      break;
    }
    release_chunk(base);
  }
}

void SimStreamPool::wait_for_frees(StreamId stream) {
  // As the CUDA pool does it: an event on the stream, waited for (counted as device calls).
  const EventId event = sim_.record_event(stream);
  try {
    sim_.synchronize_event(event);
  } catch (...) {
    sim_.destroy_event(event);
    throw;
  }
  sim_.destroy_event(event);
}

void SimStreamPool::trim_to(std::size_t keep_bytes) { release_free_chunks(keep_bytes); }

void SimStreamPool::reset_high_watermarks() {
  reserved_high_ = reserved_;
  used_high_ = used_;
}

void SimStreamPool::check_invariants() const {
  std::size_t reserved = 0;
  std::size_t used = 0;
  std::size_t free_pieces = 0;
  auto piece = pieces_.begin();
  for (const auto& [base, chunk] : chunks_) {
    reserved += chunk.size;
    CACHEALLOC_CHECK_INVARIANT(sim_.is_mapped(base, chunk.size), "a pool chunk is not mapped");
    std::uintptr_t cur = base;
    bool prev_free = false;
    while (cur < base + chunk.size) {
      CACHEALLOC_CHECK_INVARIANT(piece != pieces_.end() && piece->first == cur,
                                 "pieces do not tile chunk " + std::to_string(base));
      const Piece& p = piece->second;
      CACHEALLOC_CHECK_INVARIANT(p.chunk == base && p.size > 0 && p.size % kAlignment == 0,
                                 "bad piece at " + std::to_string(cur));
      CACHEALLOC_CHECK_INVARIANT(!(prev_free && p.free), "two adjacent free pieces not coalesced");
      CACHEALLOC_CHECK_INVARIANT(p.free == free_.contains({p.size, cur}),
                                 "free set disagrees with piece at " + std::to_string(cur));
      CACHEALLOC_CHECK_INVARIANT(p.free || p.marks.empty(), "a used piece carries free marks");
      if (p.free) {
        ++free_pieces;
      } else {
        used += p.size;
      }
      prev_free = p.free;
      cur += p.size;
      ++piece;
    }
    CACHEALLOC_CHECK_INVARIANT(cur == base + chunk.size, "a piece crosses its chunk's end");
  }
  CACHEALLOC_CHECK_INVARIANT(piece == pieces_.end(), "a piece lies outside every chunk");
  CACHEALLOC_CHECK_INVARIANT(free_pieces == free_.size(), "stale entries in the free set");
  CACHEALLOC_CHECK_INVARIANT(reserved == reserved_, "reserved_current is not the sum of chunks");
  CACHEALLOC_CHECK_INVARIANT(used == used_, "used_current is not the sum of used pieces");
  CACHEALLOC_CHECK_INVARIANT(reserved_high_ >= reserved_ && used_high_ >= used_ && used_ <= reserved_,
                             "watermarks below current values");
}

}  // namespace cachealloc
