// fork_join.cpp: see fork_join.h.
#include <cachealloc/fork_join.h>

#include <system_error>
#include <utility>

namespace cachealloc {

ForkJoin::ForkJoin(std::size_t workers, ThreadInit init) : workers_(workers), init_(std::move(init)) {}

ForkJoin::~ForkJoin() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  go_.notify_all();
  for (std::thread& t : threads_) {
    t.join();
  }
}

std::size_t ForkJoin::started() const noexcept {
  std::lock_guard lock(mutex_);
  return threads_.size();
}

std::uint64_t ForkJoin::tasks_on_workers() const noexcept {
  std::lock_guard lock(mutex_);
  return tasks_on_workers_;
}

void ForkJoin::start_threads() {
  tried_start_ = true;
  threads_.reserve(workers_);
  for (std::size_t i = 0; i < workers_; ++i) {
    try {
      threads_.emplace_back([this] { worker_loop(); });
    } catch (const std::system_error&) {  // no more threads: the ones started (or the caller) do it
      break;
    }
  }
}

void ForkJoin::run_erased(std::size_t n, Fn fn, void* ctx) {
  if (n == 0) {
    return;
  }
  if (n > 1 && !tried_start_ && workers_ > 0) {
    start_threads();
  }
  std::uint64_t generation = 0;
  {
    std::lock_guard lock(mutex_);
    fn_ = fn;
    ctx_ = ctx;
    n_ = n;
    next_ = 0;
    finished_ = 0;
    error_ = nullptr;
    generation = ++generation_;
  }
  if (n > 1) {
    go_.notify_all();
  }
  run_claimed(generation, fn, ctx, /*on_worker=*/false);
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return finished_ == n_; });
  if (std::exception_ptr error = std::exchange(error_, nullptr)) {
    lock.unlock();
    std::rethrow_exception(error);
  }
}

bool ForkJoin::claim(std::uint64_t generation, std::size_t& index) {
  std::lock_guard lock(mutex_);
  if (generation != generation_ || next_ >= n_) {
    return false;
  }
  index = next_++;
  return true;
}

void ForkJoin::finish(std::exception_ptr error, bool on_worker) {
  bool last = false;
  {
    std::lock_guard lock(mutex_);
    if (error && !error_) {
      error_ = std::move(error);
    }
    tasks_on_workers_ += on_worker ? 1 : 0;
    last = ++finished_ == n_;
  }
  if (last) {
    done_.notify_all();
  }
}

void ForkJoin::worker_loop() {
  if (init_) {
    try {
      init_();
    } catch (...) {  // this worker takes no task: the caller and the others run them
      return;
    }
  }
  std::uint64_t seen = 0;
  for (;;) {
    Fn fn = nullptr;
    void* ctx = nullptr;
    {
      std::unique_lock lock(mutex_);
      go_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) {
        return;
      }
      seen = generation_;
      fn = fn_;
      ctx = ctx_;
    }
    run_claimed(seen, fn, ctx, /*on_worker=*/true);
  }
}

void ForkJoin::run_claimed(std::uint64_t generation, Fn fn, void* ctx, bool on_worker) {
  std::size_t i = 0;
  while (claim(generation, i)) {
    std::exception_ptr error;
    try {
      fn(ctx, i);
    } catch (...) {
      error = std::current_exception();
    }
    finish(error, on_worker);
  }
}

}  // namespace cachealloc
