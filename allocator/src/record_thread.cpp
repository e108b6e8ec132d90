// record_thread.cpp: see record_thread.h, Note [Event records on a thread of their own].
#include <cachealloc/record_thread.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <system_error>
#include <vector>

namespace cachealloc {

namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::vector<RecordThread*>& registry() {
  static std::vector<RecordThread*> threads;
  return threads;
}

/// Pauses in force (Note [The record thread watches its events]): workers poll only at 0.
std::atomic<int> g_poll_pauses{0};

}  // namespace

RecordThread::RecordThread(RecordFn record, ThreadInit init, Timing timing, QueryFn query)
    : record_(std::move(record)),
      init_(std::move(init)),
      timing_(timing),
      query_(std::move(query)),
      ring_(new Slot*[kCapacity]) {}

RecordThread::~RecordThread() {
  if (started_ != Started::yes) {
    return;
  }
  {
    std::lock_guard lock(registry_mutex());
    auto& r = registry();
    r.erase(std::remove(r.begin(), r.end(), this), r.end());
  }
  stop_.store(true, std::memory_order_seq_cst);
  wake_.fetch_add(1, std::memory_order_release);
  wake_.notify_one();
  thread_.join();
}

bool RecordThread::start() noexcept {
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error&) {
    started_ = Started::failed;
    return false;
  }
  started_ = Started::yes;
  try {
    std::lock_guard lock(registry_mutex());
    registry().push_back(this);
  } catch (...) {  // NOLINT(bugprone-empty-catch): not drained before captures; posts still work
  }
  return true;
}

bool RecordThread::post(Slot& slot) noexcept {
  if (started_ == Started::no) {
    start();
  }
  if (started_ != Started::yes) {
    return false;
  }
  const std::uint64_t t = tail_.load(std::memory_order_relaxed);
  if (t - head_.load(std::memory_order_acquire) >= kCapacity) {
    return false;
  }
  ring_[t % kCapacity] = &slot;
  tail_.store(t + 1, std::memory_order_release);
  // Pairs with the worker's fence between `sleeping_ = true` and its last look at tail_: one of
  // the two sees the other's store (Note [Event records on a thread of their own]).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (wake_if_sleeping()) {
    wakes_.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

bool RecordThread::wake_if_sleeping() noexcept {
  if (!sleeping_.load(std::memory_order_relaxed) || !sleeping_.exchange(false, std::memory_order_acq_rel)) {
    return false;
  }
  wake_.fetch_add(1, std::memory_order_release);
  wake_.notify_one();
  return true;
}

void RecordThread::submit(Slot& slot, StreamId stream) noexcept {
  slot.generation.fetch_add(1, std::memory_order_relaxed);  // published by the kQueued store
  slot.stream = stream;
  slot.error = 0;
  slot.state.store(Slot::kQueued, std::memory_order_release);
  if (!post(slot)) {
    record_now(slot);
  }
}

bool RecordThread::claim_and_record(Slot& slot, bool on_worker) noexcept {
  std::uint32_t expected = Slot::kQueued;
  if (!slot.state.compare_exchange_strong(expected, Slot::kClaimed, std::memory_order_acq_rel,
                                          std::memory_order_acquire)) {
    return false;
  }
  const auto started = on_worker ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  int rc = -1;
  try {
    rc = record_(slot.event, slot.stream);
  } catch (...) {  // NOLINT(bugprone-empty-catch): rc stays -1, the slot fails
  }
  slot.error = rc;
  if (rc == 0 && on_worker && query_) {
    // Stable while claimed: the producer bumps it only in submit(), after abandon() waited.
    const std::uint64_t generation = slot.generation.load(std::memory_order_relaxed);
    if (watch(slot, generation)) {
      slot.watch.store(generation << 2 | Slot::kWatched, std::memory_order_relaxed);  // published below
    }
  }
  slot.state.store(rc == 0 ? Slot::kRecorded : Slot::kFailed, std::memory_order_release);
  slot.state.notify_all();  // a caller in record_now() or abandon() may wait for this one
  if (on_worker) {
    const auto took = std::chrono::steady_clock::now() - started;
    worker_ns_.fetch_add(static_cast<std::uint64_t>(std::chrono::nanoseconds(took).count()),
                         std::memory_order_relaxed);
    worker_records_.fetch_add(1, std::memory_order_relaxed);
  } else {
    caller_records_.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

void RecordThread::record_now(Slot& slot) noexcept {
  if (claim_and_record(slot, /*on_worker=*/false)) {
    return;
  }
  wait_while_claimed(slot);
}

void RecordThread::wait_while_claimed(Slot& slot) noexcept {
  while (slot.state.load(std::memory_order_acquire) == Slot::kClaimed) {  // inside its record call
    slot.state.wait(Slot::kClaimed, std::memory_order_acquire);
  }
}

void RecordThread::abandon(Slot& slot) noexcept {
  std::uint32_t s = Slot::kQueued;
  if (slot.state.compare_exchange_strong(s, Slot::kIdle, std::memory_order_acq_rel, std::memory_order_acquire)) {
    return;  // never recorded: the worker will find it idle and skip it
  }
  wait_while_claimed(slot);
}

void RecordThread::drain() noexcept {
  const std::uint64_t target = tail_.load(std::memory_order_acquire);
  while (head_.load(std::memory_order_acquire) < target) {
    wake_if_sleeping();
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

bool RecordThread::watch(Slot& slot, std::uint64_t generation) noexcept {
  try {
    auto it = std::find_if(watched_.begin(), watched_.end(),
                           [&](const StreamWatch& w) { return w.stream == slot.stream; });
    if (it == watched_.end()) {
      watched_.push_back(StreamWatch{slot.stream, {}});
      it = std::prev(watched_.end());
    }
    it->fifo.push_back(Watched{&slot, generation});
  } catch (...) {  // bad_alloc: not watched, its caller asks the device
    return false;
  }
  ++watched_count_;
  return true;
}

void RecordThread::poll_watched() noexcept {
  polling_.store(true, std::memory_order_seq_cst);
  if (g_poll_pauses.load(std::memory_order_seq_cst) != 0) {
    polling_.store(false, std::memory_order_release);
    return;
  }
  const auto started = std::chrono::steady_clock::now();
  std::uint64_t queries = 0;
  for (StreamWatch& w : watched_) {
    while (!w.fifo.empty()) {
      const Watched entry = w.fifo.front();
      Slot& slot = *entry.slot;
      // A slot taken back (and maybe posted again) since: its answer is not wanted any more.
      if (slot.generation.load(std::memory_order_acquire) != entry.generation ||
          slot.state.load(std::memory_order_acquire) != Slot::kRecorded) {
        w.fifo.pop_front();
        --watched_count_;
        continue;
      }
      int rc = -1;
      try {
        rc = query_(slot.event);
      } catch (...) {  // NOLINT(bugprone-empty-catch): rc stays -1, the slot is not watched any more
      }
      ++queries;
      if (rc == 0) {
        break;  // every later event of this stream is not complete either
      }
      // Complete; or failed: the caller asks itself and sees the error.
      slot.watch.store(entry.generation << 2 | (rc == 1 ? Slot::kDone : Slot::kUnwatched), std::memory_order_release);
      w.fifo.pop_front();
      --watched_count_;
    }
  }
  polling_.store(false, std::memory_order_release);
  if (watched_count_ == 0 && watched_.size() > 32) {
    watched_.clear();  // streams come and go (external streams): keep the list to the live ones
  }
  if (queries != 0) {
    const auto took = std::chrono::steady_clock::now() - started;
    worker_query_ns_.fetch_add(static_cast<std::uint64_t>(std::chrono::nanoseconds(took).count()),
                               std::memory_order_relaxed);
    worker_queries_.fetch_add(queries, std::memory_order_relaxed);
  }
}

void RecordThread::run() noexcept {
  if (init_) {
    try {
      init_();
    } catch (...) {  // NOLINT(bugprone-empty-catch): each record then reports its own failure
    }
  }
  std::uint64_t head = head_.load(std::memory_order_relaxed);
  for (;;) {
    while (head < tail_.load(std::memory_order_acquire)) {
      Slot* slot = ring_[head % kCapacity];
      claim_and_record(*slot, /*on_worker=*/true);  // skipped when claimed, recorded or dropped
      head_.store(++head, std::memory_order_release);
    }
    if (stop_.load(std::memory_order_acquire)) {
      return;
    }
    if (watched_count_ != 0) {
      poll_watched();
    }
    if (watched_count_ != 0) {  // watching: look at both every `poll`, never sleep
      std::this_thread::sleep_for(timing_.poll);
      continue;
    }
    // Dry: look again every `poll` for `linger` before sleeping on the futex.
    const auto until = std::chrono::steady_clock::now() + timing_.linger;
    bool more = false;
    while (!more && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(timing_.poll);
      more = head < tail_.load(std::memory_order_acquire) || stop_.load(std::memory_order_acquire);
    }
    if (more) {
      continue;
    }
    const std::uint32_t seen = wake_.load(std::memory_order_acquire);
    sleeping_.store(true, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (head < tail_.load(std::memory_order_relaxed) || stop_.load(std::memory_order_relaxed)) {
      sleeping_.store(false, std::memory_order_relaxed);
      continue;
    }
    wake_.wait(seen, std::memory_order_acquire);
    sleeping_.store(false, std::memory_order_relaxed);
  }
}

void drain_record_threads() noexcept {
  std::lock_guard lock(registry_mutex());
  for (RecordThread* t : registry()) {
    t->drain();
  }
}

void pause_record_thread_polls() noexcept {
  g_poll_pauses.fetch_add(1, std::memory_order_seq_cst);
  std::lock_guard lock(registry_mutex());
  for (RecordThread* t : registry()) {
    while (t->polling_.load(std::memory_order_seq_cst)) {  // inside a pass that began before the pause
      std::this_thread::yield();
    }
  }
}

void resume_record_thread_polls() noexcept {
  g_poll_pauses.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace cachealloc
