// record_thread.h: event records handed to a worker thread, so that the allocating thread does
// not pay the driver call (used by the CUDA backends' event pool under event_thread:records or
// poll, cuda/event_thread.h).
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
//
// Note [The record thread watches its events]
// With the records off the allocating thread, its event calls are the queries. On an H100
// (bench/results/defrag_session50_2026-12-07.md) offload_train's allocating thread still spent
// 600-760 us a step in event calls with the worker recording (710-950 with its own records): about
// 550 queries a step, dearer than beside its own records (probably waiting for the driver's lock
// while the worker records), so the thread saved 110-200 us of a step though it took 410-1,430 us
// of records over. Given a QueryFn, the worker also watches the events it recorded: after each pass
// over the queue, and every `poll` while any is watched, it asks each stream's oldest watched
// event, then the next while they completed (events of one stream complete in order: Note [One
// query per busy stream], allocator.h), and publishes the answer in the slot (`watch`: the post's
// generation and kWatched or kDone). A caller's query of a watched slot reads that word and calls
// nothing: "not yet" may be one poll late, which only delays a reuse. A slot recorded by a caller,
// or one the worker gave up on (a failed query, no room in its list), is not watched: the caller
// asks the device itself. Each submit bumps the slot's generation, so an answer about an earlier
// post of a reused slot never stands for the current one (the worker checks the generation before
// it asks and stores the answer under the generation it asked about).
// Captures: in the default global mode a cudaEventQuery on any thread invalidates a capture, so
// pause_record_thread_polls() (the LibTorch adapter, when a capture begins) stops every worker's
// queries and returns once none is in one; resume_record_thread_polls() (when the last capture
// ended) lets them go on. A worker checks the pause count after announcing its poll (`polling_`),
// and the pauser checks `polling_` after raising the count, both sequentially consistent: one of
// the two sees the other.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

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
    /// The worker's word on the current post's completion (Note [The record thread watches its
    /// events]).
    enum Watch : std::uint64_t { kUnwatched = 0, kWatched = 1, kDone = 2 };
    std::uintptr_t event = 0;
    StreamId stream = 0;  // written by the producer before the state becomes kQueued
    std::atomic<std::uint32_t> state{kIdle};
    int error = 0;  // RecordFn's failure code once the state is kFailed
    std::atomic<std::uint64_t> generation{0};  // bumped by each submit (the producer's)
    std::atomic<std::uint64_t> watch{0};       // the worker's: generation << 2 | Watch

    /// For the producer, once the state is kRecorded: kDone when the worker saw this post's
    /// event complete, kWatched when it had not at its last look, kUnwatched when it does not
    /// watch this post (ask the device).
    [[nodiscard]] Watch completion() const noexcept {
      const std::uint64_t w = watch.load(std::memory_order_acquire);
      return (w >> 2) == generation.load(std::memory_order_relaxed) ? static_cast<Watch>(w & 3) : kUnwatched;
    }
    /// For the producer, once it waited for the current post's event itself. The worker may
    /// still store its own answer after this: kDone too, or kUnwatched (a failed query), which
    /// only makes the producer ask the device.
    void mark_done() noexcept {
      watch.store(generation.load(std::memory_order_relaxed) << 2 | kDone, std::memory_order_release);
    }
  };
  /// Records `event` on `stream`; 0 on success, else an error code (kept in Slot::error).
  using RecordFn = std::function<int(std::uintptr_t event, StreamId stream)>;
  /// Asks whether `event` completed: 1 yes, 0 not yet, anything else a failure (the worker stops
  /// watching it; the caller asks again itself and sees the error).
  using QueryFn = std::function<int(std::uintptr_t event)>;
  /// Runs once on the worker thread before its first record (e.g. make the device current).
  using ThreadInit = std::function<void()>;

  using Timing = RecordThreadTiming;

  /// With `query`, the worker also watches the events it recorded (Note [The record thread
  /// watches its events]).
  explicit RecordThread(RecordFn record, ThreadInit init = {}, Timing timing = {}, QueryFn query = {});
  /// Records what is queued, then stops the worker.
  ~RecordThread();
  RecordThread(const RecordThread&) = delete;
  RecordThread& operator=(const RecordThread&) = delete;

  /// Queues `slot` (state kQueued, stream set) for the worker. One producer at a time; a slot
  /// ever posted must outlive the RecordThread (a watching worker looks at it until it stops).
  /// Returns false when the queue is full or no worker could be started: the caller then claims
  /// the slot (record_now) itself.
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
  /// The worker's queries of watched events, and its time inside QueryFn.
  [[nodiscard]] std::uint64_t worker_queries() const noexcept { return worker_queries_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t worker_query_ns() const noexcept { return worker_query_ns_.load(std::memory_order_relaxed); }
  /// Whether this thread watches its events (it was given a QueryFn).
  [[nodiscard]] bool watches() const noexcept { return static_cast<bool>(query_); }

  /// Queue capacity (slots in flight before post() returns false).
  static constexpr std::size_t kCapacity = 1024;

 private:
  void run() noexcept;
  /// Claims `slot` if it is still queued; records it then (returns true).
  bool claim_and_record(Slot& slot, bool on_worker) noexcept;
  /// The worker's: adds a slot it is recording to the watch lists; false when there is no room.
  bool watch(Slot& slot, std::uint64_t generation) noexcept;
  /// The worker's: one pass over the watched events, unless polls are paused.
  void poll_watched() noexcept;
  bool start() noexcept;
  /// Wakes the worker when it sleeps on the futex; true when it did.
  bool wake_if_sleeping() noexcept;
  /// Returns once `slot` is not in a record call (the worker's or another caller's).
  static void wait_while_claimed(Slot& slot) noexcept;

  RecordFn record_;
  ThreadInit init_;
  Timing timing_;
  QueryFn query_;
  struct Watched {
    Slot* slot;
    std::uint64_t generation;
  };
  struct StreamWatch {
    StreamId stream;
    std::deque<Watched> fifo;  // in recording order
  };
  std::vector<StreamWatch> watched_;  // the worker's
  std::size_t watched_count_ = 0;     // the worker's
  alignas(64) std::atomic<bool> polling_{false};
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
  std::atomic<std::uint64_t> worker_queries_{0};
  std::atomic<std::uint64_t> worker_query_ns_{0};

  friend void pause_record_thread_polls() noexcept;
};

/// Every live RecordThread of this process: drains them all (the LibTorch adapter, before a CUDA
/// graph capture begins). Note [Event records on a thread of their own].
void drain_record_threads() noexcept;
/// Stops every record thread's queries of watched events (now and for threads started later)
/// and returns once none is inside one; resume_record_thread_polls() undoes one pause. The
/// LibTorch adapter, around CUDA graph captures (Note [The record thread watches its events]).
void pause_record_thread_polls() noexcept;
void resume_record_thread_polls() noexcept;

}  // namespace cachealloc
