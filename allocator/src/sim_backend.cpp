// sim_backend.cpp: the simulated device (see sim_backend.h).
#include <cachealloc/errors.h>
#include <cachealloc/sim_backend.h>

#include <algorithm>
#include <string>

namespace cachealloc {

std::string_view to_string(SimCall call) noexcept {
  switch (call) {
    case SimCall::reserve: return "reserve";
    case SimCall::create_physical: return "create_physical";
    case SimCall::map: return "map";
    case SimCall::unmap: return "unmap";
    case SimCall::record_event: return "record_event";
    case SimCall::query_event: return "query_event";
    case SimCall::synchronize_event: return "synchronize_event";
  }
  return "?";
}

SimBackend::SimBackend(SimOptions options) : options_(options) {
  // Devices share one unified address space on a real machine: give each simulated device its
  // own 1 TiB window so that pointers of different devices never collide.
  if (options_.device < 0 || options_.device > 63) {
    throw ConfigError("simulated device index must be in 0..63, got " + std::to_string(options_.device));
  }
  bump_ += static_cast<std::uintptr_t>(options_.device) << 40;
  va_bump_ += static_cast<std::uintptr_t>(options_.device) << 40;
  if (options_.granularity == 0 || (options_.granularity & (options_.granularity - 1)) != 0) {
    throw ConfigError("simulated granularity must be a power of two, got " +
                      std::to_string(options_.granularity));
  }
  attach(*this);
}

SimBackend::~SimBackend() = default;

std::size_t SimBackend::free_memory() const {
  return held_bytes() >= options_.capacity ? 0 : options_.capacity - held_bytes();
}

std::optional<SimFault> SimBackend::count_call(SimCall kind) {
  ++calls_;
  if (fail_at_ != 0 && calls_ == fail_at_) {
    fail_at_ = 0;
    ++injected_;
    return fail_at_fault_;
  }
  if (fail_next_ && fail_next_->first == kind) {
    const SimFault f = fail_next_->second;
    fail_next_.reset();
    ++injected_;
    return f;
  }
  if (fail_always_ && fail_always_->first == kind) {
    ++injected_;
    return fail_always_->second;
  }
  return std::nullopt;
}

void SimBackend::maybe_throw(SimCall kind) {
  if (count_call(kind)) {
    throw DeviceError("simulated device: injected failure in " + std::string(to_string(kind)) +
                      " (call " + std::to_string(calls_) + ")");
  }
}

void SimBackend::fail_call(std::uint64_t k, SimFault fault) {
  fail_at_ = k == 0 ? 0 : calls_ + k;
  fail_at_fault_ = fault;
}

void SimBackend::script_reservations(std::vector<std::pair<std::size_t, std::uintptr_t>> script) {
  for (const auto& [bytes, addr] : script) {
    bump_ = std::max(bump_, round_up(addr + bytes, 2 * kMiB));
  }
  script_ = std::move(script);
  script_next_ = 0;
}

void SimBackend::fail_next(SimCall kind, SimFault fault) { fail_next_ = {{kind, fault}}; }

void SimBackend::fail_always(SimCall kind, SimFault fault) { fail_always_ = {{kind, fault}}; }

void SimBackend::clear_faults() noexcept {
  fail_at_ = 0;
  fail_next_.reset();
  fail_always_.reset();
}

std::uintptr_t SimBackend::take_range(std::map<std::uintptr_t, std::size_t>& free_ranges,
                                      std::uintptr_t& bump, std::size_t bytes,
                                      std::size_t alignment) {
  // First fit among ranges given back, so addresses are reused deterministically.
  for (auto it = free_ranges.begin(); it != free_ranges.end(); ++it) {
    if (it->second >= bytes) {
      const std::uintptr_t addr = it->first;
      const std::size_t rest = it->second - bytes;
      free_ranges.erase(it);
      if (rest > 0) {
        free_ranges.emplace(addr + bytes, rest);
      }
      return addr;
    }
  }
  const std::uintptr_t addr = bump;
  bump += round_up(bytes, alignment);
  return addr;
}

namespace {
void give_back_range(std::map<std::uintptr_t, std::size_t>& free_ranges, std::uintptr_t addr,
                     std::size_t bytes) {
  auto [it, inserted] = free_ranges.emplace(addr, bytes);
  (void)inserted;
  // Coalesce with neighbours.
  if (auto next = std::next(it); next != free_ranges.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_ranges.erase(next);
  }
  if (it != free_ranges.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_ranges.erase(it);
    }
  }
}
}  // namespace

void* SimBackend::do_reserve(std::size_t bytes) {
  if (auto fault = count_call(SimCall::reserve)) {
    if (*fault == SimFault::device_error) {
      throw DeviceError("simulated device: injected failure in reserve (call " +
                        std::to_string(calls_) + ")");
    }
    return nullptr;
  }
  if (bytes == 0 || bytes > free_memory()) {
    return nullptr;
  }
  const std::size_t rounded = round_up(bytes, 2 * kMiB);
  if (script_next_ < script_.size()) {
    const std::uintptr_t scripted = script_[script_next_].second;
    bool usable = script_[script_next_].first == bytes && scripted != 0 && scripted % 512 == 0 &&
                  scripted <= ~std::uintptr_t{0} - rounded;
    // A recorded address may only be handed out again if it overlaps no live reservation (a
    // hostile or inconsistent trace can name the same address twice).
    for (auto it = reservations_.begin(); usable && it != reservations_.end(); ++it) {
      usable = it->first + it->second <= scripted || scripted + rounded <= it->first;
    }
    if (usable) {
      const std::uintptr_t addr = script_[script_next_++].second;
      // Carve the range out of the ranges given back earlier, if it lies in one.
      auto it = free_ranges_.upper_bound(addr);
      if (it != free_ranges_.begin() && std::prev(it)->first + std::prev(it)->second > addr) {
        --it;
        const std::uintptr_t start = it->first;
        const std::size_t len = it->second;
        free_ranges_.erase(it);
        if (addr > start) {
          free_ranges_.emplace(start, addr - start);
        }
        if (start + len > addr + rounded) {
          free_ranges_.emplace(addr + rounded, start + len - (addr + rounded));
        }
      }
      reservations_.emplace(addr, rounded);
      charge(options_.costs.reserve_ns);
      return reinterpret_cast<void*>(addr);
    }
    script_.clear();  // the run differs from the recording: back to our own placement
    script_next_ = 0;
    free_ranges_.clear();
  }
  const std::uintptr_t addr = take_range(free_ranges_, bump_, rounded, 2 * kMiB);
  reservations_.emplace(addr, rounded);
  charge(options_.costs.reserve_ns);
  return reinterpret_cast<void*>(addr);
}

void SimBackend::do_release(void* ptr, std::size_t /*bytes*/) noexcept {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = reservations_.find(addr);
  if (it == reservations_.end()) {
    return;  // tests check live_reservations(); a foreign release shows up there
  }
  give_back_range(free_ranges_, addr, it->second);
  reservations_.erase(it);
  // cudaFree synchronizes the device before it returns: all queued work has finished.
  complete_all();
  charge(options_.costs.release_ns);
}

std::uintptr_t SimBackend::reserve_address(std::size_t bytes) {
  if (bytes == 0 || bytes % options_.granularity != 0) {
    throw DeviceError("simulated device: reserve_address size " + std::to_string(bytes) +
                      " is not a positive multiple of the granularity");
  }
  const std::uintptr_t va = take_range(free_va_ranges_, va_bump_, bytes, options_.granularity);
  va_reservations_.emplace(va, bytes);
  return va;
}

void SimBackend::free_address(std::uintptr_t va, std::size_t bytes) noexcept {
  settle_unmaps(va, bytes);  // the range's deferred unmaps run first (the caller waits)
  auto it = va_reservations_.find(va);
  if (it == va_reservations_.end()) {
    return;
  }
  give_back_range(free_va_ranges_, va, bytes);
  va_reservations_.erase(it);
}

PhysicalHandle SimBackend::do_create_physical(std::size_t bytes) {
  if (auto fault = count_call(SimCall::create_physical)) {
    if (*fault == SimFault::device_error) {
      throw DeviceError("simulated device: injected failure in create_physical (call " +
                        std::to_string(calls_) + ")");
    }
    return 0;
  }
  if (bytes == 0 || bytes % options_.granularity != 0) {
    throw DeviceError("simulated device: create_physical size " + std::to_string(bytes) +
                      " is not a positive multiple of the granularity");
  }
  if (bytes > free_memory()) {
    return 0;
  }
  const PhysicalHandle h = next_handle_++;
  physical_.emplace(h, Physical{bytes, 0});
  charge(options_.costs.create_ns);
  return h;
}

void SimBackend::do_release_physical(PhysicalHandle handle, std::size_t /*bytes*/) noexcept {
  settle_unmaps(0, 0, /*all=*/true);  // as the CUDA backend: memory is freed once unmapped
  physical_.erase(handle);
  charge(options_.costs.release_physical_ns);
}

void SimBackend::do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) {
  maybe_throw(SimCall::map);
  settle_unmaps(va, bytes);  // a deferred unmap of this range runs first (the caller waits)
  auto ph = physical_.find(handle);
  if (ph == physical_.end() || ph->second.bytes != bytes) {
    throw DeviceError("simulated device: map of an unknown handle or with a size other than the "
                      "handle's");
  }
  if (va % options_.granularity != 0) {
    throw DeviceError("simulated device: map address is not aligned to the granularity");
  }
  // The range must lie inside one address reservation and overlap no mapping.
  auto res = va_reservations_.upper_bound(va);
  if (res == va_reservations_.begin() || std::prev(res)->first + std::prev(res)->second < va + bytes) {
    throw DeviceError("simulated device: map outside any reserved address range");
  }
  auto next = mappings_.lower_bound(va);
  if (next != mappings_.end() && next->first < va + bytes) {
    throw DeviceError("simulated device: map over an existing mapping");
  }
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.first > va) {
      throw DeviceError("simulated device: map over an existing mapping");
    }
  }
  mappings_.emplace(va, std::make_pair(bytes, handle));
  ++ph->second.mappings;
  mapped_now_ += bytes;
  charge(options_.costs.map_ns);
}

void SimBackend::check_unmap_range(std::uintptr_t va, std::size_t bytes) const {
  // Whole mappings covering exactly [va, va+bytes).
  std::uintptr_t cur = va;
  const std::uintptr_t end = va + bytes;
  auto it = mappings_.find(va);
  if (it == mappings_.end()) {
    throw DeviceError("simulated device: unmap of an address that starts no mapping");
  }
  while (cur < end) {
    if (it == mappings_.end() || it->first != cur || cur + it->second.first > end) {
      throw DeviceError("simulated device: unmap range does not cover whole mappings");
    }
    cur += it->second.first;
    ++it;
  }
}

void SimBackend::remove_mappings(std::uintptr_t va, std::size_t bytes) noexcept {
  const std::uintptr_t end = va + bytes;
  for (auto m = mappings_.find(va); m != mappings_.end() && m->first < end;) {
    if (auto ph = physical_.find(m->second.second); ph != physical_.end()) {
      --ph->second.mappings;
    }
    mapped_now_ -= m->second.first;
    m = mappings_.erase(m);
  }
}

void SimBackend::do_unmap(std::uintptr_t va, std::size_t bytes) {
  maybe_throw(SimCall::unmap);
  settle_unmaps();
  check_unmap_range(va, bytes);
  charge_unmap(va, bytes, options_.costs.unmap_ns);
  remove_mappings(va, bytes);
}

void SimBackend::do_unmap_now(std::uintptr_t va, std::size_t bytes) {
  maybe_throw(SimCall::unmap);
  settle_unmaps(va, bytes);
  check_unmap_range(va, bytes);
  charge_unmap(va, bytes, options_.costs.unmap_now_ns);
  remove_mappings(va, bytes);
}

void SimBackend::do_release_unmapped(PhysicalHandle handle, std::size_t /*bytes*/) noexcept {
  // A mapping elsewhere still waiting for a stream (unmap_after) keeps the memory until it runs,
  // as on the device; the simulator settles it here (a rare case) so that no mapping outlives
  // its handle.
  if (auto ph = physical_.find(handle); ph != physical_.end() && ph->second.mappings > 0) {
    settle_unmaps(0, 0, /*all=*/true);
  }
  physical_.erase(handle);
  charge(options_.costs.release_physical_ns);
}

void SimBackend::charge_unmap(std::uintptr_t va, std::size_t bytes,
                              std::uint64_t per_mapping_ns) noexcept {
  const std::uintptr_t end = va + bytes;
  for (auto m = mappings_.find(va); m != mappings_.end() && m->first < end; ++m) {
    charge(per_mapping_ns);
  }
}

void SimBackend::do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) {
  if (!options_.unmap_after_streams) {
    VirtualMemory::do_unmap_after(va, bytes, stream);
    return;
  }
  maybe_throw(SimCall::unmap);
  settle_unmaps();
  check_unmap_range(va, bytes);
  for (const DeferredUnmap& d : deferred_unmaps_) {
    if (d.overlaps(va, bytes)) {
      throw DeviceError("simulated device: unmap_after of a range already being unmapped");
    }
  }
  // An event of the simulator's own, not counted as a call: where the stream's work stands now.
  const EventId id = new_event(stream);
  // The caller pays for the unmap as for unmap() (Note [Simulated time]): the simulator models
  // every unmap as the allocating thread's cost, whichever thread makes it on a GPU.
  charge_unmap(va, bytes, options_.costs.unmap_ns);
  if (event_done(id)) {
    events_.erase(id);
    remove_mappings(va, bytes);
    return;
  }
  deferred_unmaps_.push_back(DeferredUnmap{va, bytes, id});
}

bool SimBackend::event_done(EventId id) const {
  ++query_gen_;  // a new query: what earlier ones found pending may have completed since
  return done_in_query(events_.at(id));
}

bool SimBackend::done_in_query(const Event& e) const {
  if (e.settled) {
    return true;
  }
  if (e.pending_in_query == query_gen_) {
    return false;  // found not complete earlier in this query (Note [Simulated stream waits])
  }
  auto done = stream_completed_upto_.find(e.stream);
  const bool own = e.done || (done != stream_completed_upto_.end() && e.sequence <= done->second) ||
                   (e.ready_ns != 0 && clock_ns_ >= e.ready_ns);
  e.settled = own && waits_done(e);
  if (!e.settled) {
    e.pending_in_query = query_gen_;
  }
  return e.settled;
}

// Note [Simulated stream waits]
bool SimBackend::waits_done(const Event& e) const {
  auto it = stream_waits_.find(e.stream);
  if (it == stream_waits_.end()) {
    return true;
  }
  for (const StreamWait& w : it->second) {
    if (e.sequence > w.after && !done_in_query(events_.at(w.event))) {
      return false;
    }
  }
  return true;
}

void SimBackend::prune_waits(StreamId stream) {
  auto it = stream_waits_.find(stream);
  if (it == stream_waits_.end()) {
    return;
  }
  std::vector<StreamWait>& waits = it->second;
  for (std::size_t i = 0; i < waits.size();) {
    const EventId ev = waits[i].event;
    if (!event_done(ev)) {
      ++i;
      continue;
    }
    waits[i] = waits.back();
    waits.pop_back();
    if (--waiters_[ev] == 0) {
      waiters_.erase(ev);
      auto e = events_.find(ev);
      if (e != events_.end() && e->second.destroyed) {
        events_.erase(e);
        --waited_destroyed_;
      }
    }
  }
  if (waits.empty()) {
    stream_waits_.erase(it);
  }
}

bool SimBackend::stream_wait_event(StreamId stream, EventId event) {
  auto it = events_.find(event);
  if (it == events_.end() || it->second.destroyed) {
    throw DeviceError("simulated device: stream wait for an unknown event " + std::to_string(event));
  }
  if (!options_.stream_waits) {
    return false;
  }
  prune_waits(stream);
  if (event_done(event)) {
    return true;  // nothing left to wait for
  }
  stream_waits_[stream].push_back(StreamWait{event, stream_recorded_[stream]});
  ++waiters_[event];
  return true;
}

bool SimBackend::stream_waits_for(StreamId stream, StreamId other, std::uint64_t after) const {
  auto it = stream_waits_.find(stream);
  if (it == stream_waits_.end()) {
    return false;
  }
  for (const StreamWait& w : it->second) {
    const Event& e = events_.at(w.event);
    if (e.stream == other && e.sequence > after) {
      return true;
    }
  }
  return false;
}

std::uintptr_t SimBackend::queued_unmap_end(std::uintptr_t va, std::size_t bytes) const noexcept {
  std::uintptr_t end = 0;
  for (const DeferredUnmap& d : deferred_unmaps_) {
    if (d.overlaps(va, bytes) && events_.contains(d.event) && !event_done(d.event)) {
      end = std::max(end, d.va + d.bytes);
    }
  }
  return end;
}

void SimBackend::settle_unmaps(std::uintptr_t va, std::size_t bytes, bool all) {
  for (std::size_t i = 0; i < deferred_unmaps_.size();) {
    const DeferredUnmap d = deferred_unmaps_[i];
    if (!event_done(d.event)) {
      if (!all && !d.overlaps(va, bytes)) {
        ++i;
        continue;
      }
      // The caller waits for the stream, as the CUDA backend's map does (Note [Simulated time]).
      const std::uint64_t before = clock_ns_;
      wait_until_done(events_.at(d.event));
      unmap_wait_ns_ += clock_ns_ - before;
    }
    events_.erase(d.event);
    remove_mappings(d.va, d.bytes);
    deferred_unmaps_.erase(deferred_unmaps_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

bool SimBackend::is_mapped(std::uintptr_t va, std::size_t bytes) const {
  std::uintptr_t cur = va;
  const std::uintptr_t end = va + bytes;
  auto it = mappings_.upper_bound(cur);
  if (it == mappings_.begin()) {
    return false;
  }
  --it;
  while (cur < end) {
    if (it == mappings_.end() || it->first > cur || it->first + it->second.first <= cur) {
      return false;
    }
    cur = it->first + it->second.first;
    ++it;
  }
  return true;
}

EventId SimBackend::record_event(StreamId stream) {
  maybe_throw(SimCall::record_event);
  ++mutable_counters().events_recorded;
  return new_event(stream);
}

EventId SimBackend::new_event(StreamId stream) {
  const std::uint64_t seq = ++stream_recorded_[stream];
  const EventId id = next_event_++;
  Event ev{stream, seq, false};
  if (options_.auto_complete_events && !held_.contains(stream)) {
    if (options_.stream_lag) {
      // Note [Each stream's own lag]: a lag that changes over time; a stream still finishes its
      // work in order, so an event is never ready before the one recorded before it.
      const std::uint64_t lag = options_.stream_lag(stream, clock_ns_).value_or(options_.event_lag_ns);
      std::uint64_t& last = stream_ready_ns_[stream];
      last = std::max(last, clock_ns_ + lag);
      if (last <= clock_ns_) {
        stream_completed_upto_[stream] = seq;
      } else {
        ev.ready_ns = last;
      }
    } else if (options_.event_lag_ns == 0) {
      stream_completed_upto_[stream] = seq;
    } else {
      ev.ready_ns = clock_ns_ + options_.event_lag_ns;
    }
  }
  events_.emplace(id, ev);
  return id;
}

bool SimBackend::query_event(EventId event) {
  maybe_throw(SimCall::query_event);
  ++mutable_counters().event_queries;
  auto it = events_.find(event);
  if (it == events_.end() || it->second.destroyed) {
    throw DeviceError("simulated device: query of an unknown event " + std::to_string(event));
  }
  prune_waits(it->second.stream);
  if (options_.query_lag_calls != 0 || options_.query_look_ns != 0) {  // from the watcher's last look
    const bool by_calls = options_.query_lag_calls != 0 && ++calls_since_look_ >= options_.query_lag_calls;
    const bool by_time = options_.query_look_ns != 0 && clock_ns_ - last_look_ns_ >= options_.query_look_ns;
    if (by_calls || by_time) {
      calls_since_look_ = 0;
      last_look_ns_ = clock_ns_;
      for (auto& [id, ev] : events_) {
        ev.seen = ev.seen || (!ev.destroyed && event_done(id));
      }
    }
    return it->second.seen;
  }
  return event_done(event);
}

std::size_t SimBackend::pending_events() const {
  std::size_t n = 0;
  for (const auto& [id, ev] : events_) {
    auto done = stream_completed_upto_.find(ev.stream);
    if (!ev.done && (done == stream_completed_upto_.end() || done->second < ev.sequence)) {
      ++n;
    }
  }
  return n;
}

void SimBackend::synchronize_event(EventId event) {
  maybe_throw(SimCall::synchronize_event);
  auto it = events_.find(event);
  if (it == events_.end() || it->second.destroyed) {
    throw DeviceError("simulated device: synchronize of an unknown event " + std::to_string(event));
  }
  wait_until_done(it->second);
}

void SimBackend::wait_until_done(Event& e) {
  // A settled event's waits completed: only its own completion below is recorded (cheap), so
  // each walk goes through an event's waits once (Note [Simulated stream waits]).
  if (auto it = stream_waits_.find(e.stream); !e.settled && it != stream_waits_.end()) {
    const std::vector<StreamWait> waits = it->second;  // waiting may prune the list
    for (const StreamWait& w : waits) {
      if (e.sequence > w.after && events_.contains(w.event)) {
        wait_until_done(events_.at(w.event));  // Note [Simulated stream waits]: those come first
      }
    }
  }
  if (e.done) {
    e.settled = true;
    return;
  }
  if (e.ready_ns > clock_ns_ && e.sequence > stream_completed_upto_[e.stream]) {
    // The host waits until the simulated GPU gets there (Note [Simulated time]).
    charged_ns_ += e.ready_ns - clock_ns_;
    clock_ns_ = e.ready_ns;
  }
  e.done = true;
  std::uint64_t& done = stream_completed_upto_[e.stream];
  if (done < e.sequence) {
    done = e.sequence;
  }
  e.settled = true;  // its waits were waited for above: no later walk needs to visit it again
}

void SimBackend::destroy_event(EventId event) noexcept {
  auto it = events_.find(event);
  if (it == events_.end() || it->second.destroyed) {
    return;
  }
  if (waiters_.contains(event)) {  // a stream still waits for it: kept, uncounted
    it->second.destroyed = true;
    ++waited_destroyed_;
    return;
  }
  events_.erase(it);
}

std::uint64_t SimBackend::stream_recorded(StreamId stream) const {
  auto it = stream_recorded_.find(stream);
  return it == stream_recorded_.end() ? 0 : it->second;
}

std::uint64_t SimBackend::stream_completed(StreamId stream) const {
  auto it = stream_completed_upto_.find(stream);
  return it == stream_completed_upto_.end() ? 0 : it->second;
}

void SimBackend::complete_stream(StreamId stream) {
  stream_completed_upto_[stream] = stream_recorded_[stream];
  settle_unmaps();
}

void SimBackend::complete_all() {
  for (auto& [stream, seq] : stream_recorded_) {
    stream_completed_upto_[stream] = seq;
  }
  settle_unmaps();
}

void SimBackend::tick() {
  for (auto& [stream, seq] : stream_recorded_) {
    if (!held_.contains(stream)) {
      stream_completed_upto_[stream] = seq;
    }
  }
  settle_unmaps();
}

void SimBackend::hold_stream(StreamId stream) { held_.insert(stream); }

void SimBackend::release_stream(StreamId stream) {
  held_.erase(stream);
  if (auto w = stream_waits_.find(stream); w != stream_waits_.end()) {
    for (StreamWait& x : w->second) {
      x.after = 0;  // its sequence numbers restart: the waits hold for every later event
    }
  }
  for (auto& [id, ev] : events_) {
    if (ev.stream == stream) {
      ev.done = true;
    }
  }
  settle_unmaps();  // before the stream's sequence numbers are forgotten
  stream_recorded_.erase(stream);
  stream_completed_upto_.erase(stream);
}

}  // namespace cachealloc
