// background_unmapper.cpp: see Note [Unmapping off the allocating thread] (background_unmapper.h).
#include <cachealloc/background_unmapper.h>
#include <cachealloc/errors.h>

#include <algorithm>
#include <chrono>
#include <system_error>
#include <utility>

namespace cachealloc {
namespace {

std::uint64_t now_ns() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

/// Adds the time from construction to destruction to `into`.
class Stopwatch {
 public:
  explicit Stopwatch(std::atomic<std::uint64_t>& into) noexcept : into_(into), start_(now_ns()) {}
  ~Stopwatch() { into_.fetch_add(now_ns() - start_, std::memory_order_relaxed); }
  Stopwatch(const Stopwatch&) = delete;
  Stopwatch& operator=(const Stopwatch&) = delete;

 private:
  std::atomic<std::uint64_t>& into_;
  std::uint64_t start_;
};

}  // namespace

BackgroundUnmapper::BackgroundUnmapper(UnmapFn unmap, ThreadInit init, WaitFn wait)
    : unmap_(std::move(unmap)), init_(std::move(init)), wait_(std::move(wait)) {}

BackgroundUnmapper::~BackgroundUnmapper() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_.notify_all();
  if (thread_.joinable()) {
    thread_.join();  // the worker empties the queue before it stops
  }
}

void BackgroundUnmapper::post(std::uintptr_t va, std::size_t bytes, std::uint64_t after) {
  bool started = false;
  {
    std::lock_guard lock(mutex_);
    rethrow_locked();
    started = thread_.joinable();
    if (!started) {
      try {
        thread_ = std::thread([this] { run(); });
        started = true;
      } catch (const std::system_error&) {  // no thread to be had: unmap here, below
      }
    }
    if (started) {
      queue_.push_back(Range{va, bytes, after});
      pending_.fetch_add(1, std::memory_order_release);
    }
  }
  if (started) {
    work_.notify_one();
    return;
  }
  const std::string error = execute(Range{va, bytes, after}, /*on_worker=*/false);
  if (!error.empty()) {
    throw DeviceError("unmap failed: " + error);
  }
  completed_.fetch_add(1, std::memory_order_relaxed);
}

std::string BackgroundUnmapper::execute(const Range& r, bool on_worker) {
  std::string error;
  try {
    if (r.after != 0 && wait_) {
      error = wait_(r.after);  // the stream's work that used the range, first
      if (on_worker) {
        const std::lock_guard lock(mutex_);
        running_waits_ = false;
      }
    }
    std::string unmapped;
    {
      const Stopwatch busy(busy_ns_);
      unmapped = unmap_(r.va, r.bytes);
    }
    if (error.empty()) {
      error = std::move(unmapped);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  return error;
}

bool BackgroundUnmapper::overlaps(std::uintptr_t va, std::size_t bytes) const {
  if (pending() == 0) {
    return false;  // nothing queued or running: no lock taken
  }
  const std::lock_guard lock(mutex_);
  return overlapping_locked(va, bytes);
}

std::uintptr_t BackgroundUnmapper::end_behind_stream_work(std::uintptr_t va,
                                                         std::size_t bytes) const {
  if (pending() == 0) {
    return 0;
  }
  const std::lock_guard lock(mutex_);
  bool waits = running_waits_;
  std::uintptr_t end = 0;
  if (waits && running_.overlaps(va, bytes)) {
    end = running_.va + running_.bytes;
  }
  for (const Range& r : queue_) {
    waits = waits || (r.after != 0 && wait_);
    if (waits && r.overlaps(va, bytes)) {
      end = std::max(end, r.va + r.bytes);
    }
  }
  return end;
}

bool BackgroundUnmapper::overlapping_locked(std::uintptr_t va, std::size_t bytes) const noexcept {
  if (running_.overlaps(va, bytes)) {
    return true;
  }
  for (const Range& r : queue_) {
    if (r.overlaps(va, bytes)) {
      return true;
    }
  }
  return false;
}

void BackgroundUnmapper::rethrow_locked() {
  if (!failure_.empty()) {
    std::string what = std::move(failure_);
    failure_.clear();
    throw DeviceError("a background unmap failed (the range may still be mapped): " + what);
  }
}

void BackgroundUnmapper::wait_for(std::uintptr_t va, std::size_t bytes) {
  if (pending_.load(std::memory_order_acquire) == 0) {
    std::lock_guard lock(mutex_);  // only to report a failure; rare, as the queue was empty
    rethrow_locked();
    return;
  }
  std::unique_lock lock(mutex_);
  if (overlapping_locked(va, bytes)) {
    const Stopwatch blocked(blocked_ns_);
    done_.wait(lock, [&] { return !overlapping_locked(va, bytes); });
  }
  rethrow_locked();
}

void BackgroundUnmapper::drain() {
  std::unique_lock lock(mutex_);
  if (pending_.load(std::memory_order_acquire) != 0) {
    const Stopwatch blocked(blocked_ns_);
    done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }
  rethrow_locked();
}

void BackgroundUnmapper::run() {
  std::string init_error;
  if (init_) {
    try {
      init_();
    } catch (const std::exception& e) {
      init_error = std::string("setting up the unmap thread: ") + e.what();
    }
  }
  std::unique_lock lock(mutex_);
  if (!init_error.empty()) {
    failure_ = std::move(init_error);  // the unmaps still run: the driver may not need it
  }
  for (;;) {
    work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) {
      return;  // stop_, and nothing left to do
    }
    running_ = queue_.front();
    running_waits_ = running_.after != 0 && wait_;
    queue_.pop_front();
    lock.unlock();
    std::string error = execute(running_, /*on_worker=*/true);
    lock.lock();
    if (!error.empty() && failure_.empty()) {
      failure_ = std::move(error);
    }
    running_ = Range{};
    running_waits_ = false;
    completed_.fetch_add(1, std::memory_order_relaxed);
    pending_.fetch_sub(1, std::memory_order_release);
    done_.notify_all();
  }
}

}  // namespace cachealloc
