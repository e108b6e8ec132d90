// fork_join.h: a few tasks run at once on worker threads, the caller waiting for all of them
// (used by backend `cuda_vmm`, option map_threads: Note [Access calls from several threads],
// vmm_backend.h).
//
// run(n, task) calls task(0) ... task(n - 1), each exactly once, on the caller and the workers,
// and returns when every one returned. Tasks are claimed one by one under the pool's lock, so a
// worker that wakes late (or never started) leaves its share to the others; the caller claims
// too, so run() finishes even with no worker at all. The threads start at the first run() that
// has more than one task, not in the constructor, so that a process that forks after building
// its allocator (bench/e2e's fork server) does not lose threads it had (as BackgroundUnmapper);
// where no thread can be started (std::system_error), the caller runs every task.
// A task that throws does not stop the others: run() rethrows the first exception once all
// have returned. One run() at a time: callers serialise (the backend runs under the front end's
// lock).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace cachealloc {

class ForkJoin {
 public:
  /// Runs once on each worker thread before its first task (e.g. make the device current). A
  /// worker whose init throws takes no task.
  using ThreadInit = std::function<void()>;

  /// A pool of `workers` threads besides the caller (0: the caller runs everything).
  explicit ForkJoin(std::size_t workers, ThreadInit init = {});
  ~ForkJoin();
  ForkJoin(const ForkJoin&) = delete;
  ForkJoin& operator=(const ForkJoin&) = delete;

  /// Calls task(i) for every i in [0, n) at once on the caller and the workers; returns when all
  /// returned, rethrowing the first exception a task threw.
  template <class Task>
  void run(std::size_t n, Task&& task) {
    run_erased(n, [](void* ctx, std::size_t i) { (*static_cast<std::remove_reference_t<Task>*>(ctx))(i); },
               const_cast<void*>(static_cast<const void*>(&task)));
  }

  [[nodiscard]] std::size_t workers() const noexcept { return workers_; }
  /// Worker threads running now (0 before the first run() with more than one task).
  [[nodiscard]] std::size_t started() const noexcept;
  /// Tasks the workers ran (not the caller), over the pool's life.
  [[nodiscard]] std::uint64_t tasks_on_workers() const noexcept;

 private:
  using Fn = void (*)(void*, std::size_t);
  void run_erased(std::size_t n, Fn fn, void* ctx);
  void start_threads();
  void worker_loop();
  /// Claims the next task of job `generation`; false when it is over or all are claimed.
  bool claim(std::uint64_t generation, std::size_t& index);
  void finish(std::exception_ptr error, bool on_worker);
  /// Runs the tasks of job `generation` this thread can claim, each reported to finish().
  void run_claimed(std::uint64_t generation, Fn fn, void* ctx, bool on_worker);

  const std::size_t workers_;
  ThreadInit init_;
  mutable std::mutex mutex_;
  std::condition_variable go_;    // a new job, or stop
  std::condition_variable done_;  // the job's last task finished
  std::uint64_t generation_ = 0;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::size_t n_ = 0;
  std::size_t next_ = 0;
  std::size_t finished_ = 0;
  std::exception_ptr error_;
  std::uint64_t tasks_on_workers_ = 0;
  bool stop_ = false;
  bool tried_start_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace cachealloc
