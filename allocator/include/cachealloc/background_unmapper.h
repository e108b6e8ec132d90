// background_unmapper.h: unmap calls handed to a worker thread, so that the allocating thread
// does not wait for them (used by backend `cuda_vmm`, option background_unmap).
//
// Note [Unmapping off the allocating thread]
// On the H200, cuMemUnmap inside a training job costs 120-430 us per call (the e2e pipeline and
// the held-out llm_serve of bench/validation, bench/results/e2e_h200_2026-12-04_val*.md), against
// 40-50 us for cuMemMap + cuMemSetAccess; in the micro benchmark, with the device idle, the three
// together cost 33 us. Policy defrag unmaps only to move pages: it unmaps a free hole and maps its
// physical handles under a new block at once. The driver lets one physical allocation be mapped
// at several addresses at the same time (virtual aliasing), so the map at the new address need
// not wait for the unmap of the old one: unmap() only queues the range, and a worker thread
// unmaps it. The allocation returns as soon as the new mapping exists.
// What the caller must keep in mind, and this class enforces:
//   - an address range is mapped again only after its queued unmap ran: wait_for() blocks
//     while a queued or running unmap overlaps the range (the backend calls it before every map;
//     it costs an atomic load when nothing is queued);
//   - physical memory is freed by the driver only once every mapping of it is gone, so releasing
//     a handle (cuMemRelease) or an address range first drains the queue: empty_cache and the
//     out-of-memory path then find the memory back on the device, as with a synchronous unmap;
//   - the precondition of unmapping is unchanged (no queued or running work uses the range;
//     Note [Unmapping does not wait for the device], vmm_backend.h): unmapping later is safe
//     whenever unmapping now was.
// A failed background unmap is reported, as DeviceError, by the next call on the allocating
// thread (post, wait_for, drain): the range it named may still be mapped.
//
// Note [Moving pages a stream still uses]
// Policy defrag moves only pages of safe holes: holes whose streams finished the work queued
// before their free. When it lacks pages, it used to wait (synchronize an event) for the
// allocating stream's oldest work that would make enough of that stream's own recent holes safe;
// on the H200 the held-out llm_serve (bench/validation) spent 42 ms of its 60 ms per step in the
// allocator so (bench/results/e2e_h200_2026-12-04_s17b.md). Yet a block for stream S may reuse
// memory that S's queued work still touches, as every caching allocator reuses S's own frees at
// once: S runs the new work after the old. Only the unmap must wait, since the old work reaches
// the memory through the old address. So the caller maps the pages at their new address now and
// queues the old range with a tag (post's `after`: for the CUDA backend an event recorded on S
// then); the worker first waits for the tag (WaitFn: cudaEventSynchronize), then unmaps. The
// allocating thread waits for the stream only when it maps into a range still queued, as above.
// The worker starts on the first post(), not in the constructor, so that a process that forks
// after building a backend (a fork server, as bench/e2e uses) does not lose a thread it had.
// Where no thread can be started (std::system_error), post() unmaps on the caller's thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace cachealloc {

class BackgroundUnmapper {
 public:
  /// Unmaps [va, va + bytes); returns an empty string on success, else what went wrong.
  using UnmapFn = std::function<std::string(std::uintptr_t va, std::size_t bytes)>;
  /// Runs once on the worker thread before its first unmap (e.g. make the device current).
  using ThreadInit = std::function<void()>;
  /// Waits, on the worker, for what post()'s `after` names (non-zero); empty on success.
  using WaitFn = std::function<std::string(std::uint64_t after)>;

  explicit BackgroundUnmapper(UnmapFn unmap, ThreadInit init = {}, WaitFn wait = {});
  /// Runs what is queued, then stops the worker.
  ~BackgroundUnmapper();
  BackgroundUnmapper(const BackgroundUnmapper&) = delete;
  BackgroundUnmapper& operator=(const BackgroundUnmapper&) = delete;

  /// Queues the unmap of [va, va + bytes), to run after WaitFn(after) when `after` is non-zero
  /// (Note [Moving pages a stream still uses]). Throws DeviceError when an earlier one failed.
  void post(std::uintptr_t va, std::size_t bytes, std::uint64_t after = 0);
  /// Blocks while a queued or running unmap overlaps [va, va + bytes). Throws DeviceError when
  /// an earlier unmap failed.
  void wait_for(std::uintptr_t va, std::size_t bytes);
  /// Blocks until nothing is queued or running. Throws DeviceError when an unmap failed.
  void drain();

  /// Whether a queued or running unmap overlaps [va, va + bytes) (wait_for() would block).
  [[nodiscard]] bool overlaps(std::uintptr_t va, std::size_t bytes) const;
  /// Where unmaps overlapping [va, va + bytes) wait for a stream's work: the end of the highest
  /// such range, or 0 when none does. An unmap waits when it has an `after` tag whose wait has
  /// not returned, or is queued behind one (the worker runs the queue in order). A wait_for()
  /// there may block for as long as the stream runs behind the host; an unmap that only waits
  /// its turn costs a few hundred microseconds at most.
  [[nodiscard]] std::uintptr_t end_behind_stream_work(std::uintptr_t va, std::size_t bytes) const;
  /// Unmaps queued or running now.
  [[nodiscard]] std::size_t pending() const noexcept { return pending_.load(std::memory_order_acquire); }
  /// Time the worker spent inside UnmapFn, in nanoseconds (steady clock).
  [[nodiscard]] std::uint64_t busy_ns() const noexcept { return busy_ns_.load(std::memory_order_relaxed); }
  /// Time callers spent blocked in wait_for() and drain(), in nanoseconds.
  [[nodiscard]] std::uint64_t blocked_ns() const noexcept { return blocked_ns_.load(std::memory_order_relaxed); }
  /// Unmaps the worker ran.
  [[nodiscard]] std::uint64_t completed() const noexcept { return completed_.load(std::memory_order_relaxed); }

 private:
  struct Range {
    std::uintptr_t va = 0;
    std::size_t bytes = 0;
    std::uint64_t after = 0;
    [[nodiscard]] bool overlaps(std::uintptr_t a, std::size_t n) const noexcept {
      return bytes != 0 && n != 0 && a < va + bytes && va < a + n;
    }
  };
  void run();
  /// WaitFn for `r.after` (when set), then UnmapFn; the first error's text, or empty.
  /// On the worker (`on_worker`), clears running_waits_ once WaitFn returned.
  std::string execute(const Range& r, bool on_worker);
  [[nodiscard]] bool overlapping_locked(std::uintptr_t va, std::size_t bytes) const noexcept;
  void rethrow_locked();  // throws DeviceError once for a recorded failure

  UnmapFn unmap_;
  ThreadInit init_;
  WaitFn wait_;
  mutable std::mutex mutex_;
  std::condition_variable work_;  // the worker waits for work or stop
  std::condition_variable done_;  // callers wait for unmaps to finish
  std::deque<Range> queue_;
  Range running_;
  bool running_waits_ = false;  // the worker is inside WaitFn for running_.after
  bool stop_ = false;
  std::string failure_;
  std::thread thread_;
  std::atomic<std::size_t> pending_{0};
  std::atomic<std::uint64_t> busy_ns_{0};
  std::atomic<std::uint64_t> blocked_ns_{0};
  std::atomic<std::uint64_t> completed_{0};
};

}  // namespace cachealloc
