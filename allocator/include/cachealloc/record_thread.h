// record_thread.h: event records handed to a worker thread, so that the allocating thread does
// not pay the driver call (used by the CUDA backends' event pool, CACHEALLOC_EVENT_THREAD=1).
//
// Note [Event records on a thread of their own]
// A block freed after another stream used it (record_stream) is parked until that stream's work
// queued before the free has run: the front end records an event on each such stream per burst
// of frees (Note [Events shared by a burst of parked frees], allocator.h). On an H100 host a
// cudaEventRecord costs about 4 us of the allocating thread (bench/results/
// defrag_session48_2026-12-07.md): 9-12 us per step of the e2e pipeline (2-3 records per step)
// and 700-850 us per step of offload_train (176-206 records), a third of offload_train's time in
// the allocator.
// The record need not happen inside the free. An event recorded on stream S at any time after
// the free covers all the work queued on S before the free, and more: only later, never unsafe
// (the reasoning of Note [Deferred events during capture], capture_guard_backend.h). So the
// backend hands the record to a worker thread and returns a slot at once; the slot reads "not
// yet" until the worker has recorded its event and the event completed. A caller that needs the
// event recorded now (to wait for it on the host, or to make a stream wait for it) claims the
// slot: when the worker has not taken it yet, the caller records it itself; when the worker is
// recording it, the caller waits for that one call. Each slot is recorded once per post, by
// whichever side claims it first (an atomic compare-and-swap on its state).
// The costs moved, not removed: the worker's driver calls run beside the allocating thread and
// may hold the driver's locks while the training thread launches work. Whether the step gets
// shorter is measured by bench/e2e, not assumed; the worker's calls are counted apart
// (background_event_records, background_event_ns).
// Waking the worker: a futex wake costs the allocating thread about as much as what it saves,
// so the worker, after the queue ran dry, looks again every `poll` for `linger` before it sleeps
// on the futex; a post wakes it only when it sleeps. A training loop posting every few
// milliseconds keeps it awake (a sleep of ~50 us, then a look at two atomics) and never pays a
// wake. The queue is a bounded single-producer ring (the backend's caller serialises posts);
// when it is full, post() returns false and the caller records on its own thread.
// The worker starts on the first post(), not in the constructor, so that a process that forks
// after building a backend (bench/e2e's fork server) does not lose a thread it had; where no
// thread can be started (std::system_error), post() returns false and the caller records.
// CUDA graph capture: an event recorded by the worker on a stream that has begun capturing
// would be a graph node, not a record. The LibTorch adapter drains every worker
// (drain_record_threads) when a capture begins, after which the capture guard stops posting.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include <cachealloc/types.h>

namespace cachealloc {

struct RecordThreadTiming {
  std::chrono::microseconds poll{50};       ///< the dry worker's sleep between looks at the queue
  std::chrono::microseconds linger{20000};  ///< how long it keeps looking before the futex
};

class RecordThread {
 public:
  /// One reusable record: `event` is the backend's event handle, fixed for the slot's life.
  struct Slot {
    enum : std::uint32_t { kIdle, kQueued, kClaimed, kRecorded, kFailed };
    std::uintptr_t event = 0;
    StreamId stream = 0;  // written by the producer before the state becomes kQueued
    std::atomic<std::uint32_t> state{kIdle};
    int error = 0;  // RecordFn's failure code once the state is kFailed
  };
  /// Records `event` on `stream`; 0 on success, else an error code (kept in Slot::error).
  using RecordFn = std::function<int(std::uintptr_t event, StreamId stream)>;
  /// Runs once on the worker thread before its first record (e.g. make the device current).
  using ThreadInit = std::function<void()>;

  using Timing = RecordThreadTiming;

  explicit RecordThread(RecordFn record, ThreadInit init = {}, Timing timing = {});
  /// Records what is queued, then stops the worker.
  ~RecordThread();
  RecordThread(const RecordThread&) = delete;
  RecordThread& operator=(const RecordThread&) = delete;

  /// Queues `slot` (state kQueued, stream set) for the worker. One producer at a time. Returns
  /// false when the queue is full or no worker could be started: the caller then claims the slot
  /// (record_now) itself.
  [[nodiscard]] bool post(Slot& slot) noexcept;
  /// Marks `slot` queued on `stream` and posts it; records it on this thread when post() fails.
  void submit(Slot& slot, StreamId stream) noexcept;
  /// Makes sure `slot`'s event is recorded (kRecorded or kFailed) when this returns: records it
  /// on this thread when the worker has not taken it yet, or waits for the worker's call.
  void record_now(Slot& slot) noexcept;
  /// Takes `slot` back for reuse: a queued record is dropped (its event is not needed any more),
  /// one in the worker's hands is waited for. The queue may still name it; the worker skips it.
  static void abandon(Slot& slot) noexcept;
  /// Blocks until every slot posted so far is recorded. Any thread.
  void drain() noexcept;

  /// Records the worker made, and its time inside RecordFn (steady clock).
  [[nodiscard]] std::uint64_t worker_records() const noexcept { return worker_records_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t worker_ns() const noexcept { return worker_ns_.load(std::memory_order_relaxed); }
  /// Records made by callers (record_now on an unclaimed slot, a full queue).
  [[nodiscard]] std::uint64_t caller_records() const noexcept { return caller_records_.load(std::memory_order_relaxed); }
  /// Futex wakes posts paid for (the worker slept).
  [[nodiscard]] std::uint64_t wakes() const noexcept { return wakes_.load(std::memory_order_relaxed); }

  /// Queue capacity (slots in flight before post() returns false).
  static constexpr std::size_t kCapacity = 1024;

 private:
  void run() noexcept;
  /// Claims `slot` if it is still queued; records it then (returns true).
  bool claim_and_record(Slot& slot, bool on_worker) noexcept;
  bool start() noexcept;
  /// Wakes the worker when it sleeps on the futex; true when it did.
  bool wake_if_sleeping() noexcept;
  /// Returns once `slot` is not in a record call (the worker's or another caller's).
  static void wait_while_claimed(Slot& slot) noexcept;

  RecordFn record_;
  ThreadInit init_;
  Timing timing_;
  std::unique_ptr<Slot*[]> ring_;
  alignas(64) std::atomic<std::uint64_t> tail_{0};  // next index the producer writes
  alignas(64) std::atomic<std::uint64_t> head_{0};  // next index the worker reads
  std::atomic<std::uint32_t> wake_{0};              // futex word: bumped to wake the worker
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stop_{false};
  enum class Started : unsigned char { no, yes, failed };
  Started started_ = Started::no;  // the producer's
  std::thread thread_;
  std::atomic<std::uint64_t> worker_records_{0};
  std::atomic<std::uint64_t> worker_ns_{0};
  std::atomic<std::uint64_t> caller_records_{0};
  std::atomic<std::uint64_t> wakes_{0};
};

/// Every live RecordThread of this process: drains them all (the LibTorch adapter, before a CUDA
/// graph capture begins). Note [Event records on a thread of their own].
void drain_record_threads() noexcept;

}  // namespace cachealloc
