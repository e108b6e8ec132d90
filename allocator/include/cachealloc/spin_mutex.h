// spin_mutex.h: the front end's lock (Note [The front end's lock]).
//
// Note [The front end's lock]
// Every allocate and every free takes the device's lock once. With std::mutex that is a locked
// compare-exchange to take it and a locked exchange to give it back (glibc), each about 20
// cycles, plus two calls through the PLT: on the H200 host about a third of a cached
// alloc+free pair. SpinMutex takes the lock with one exchange and gives it back with a plain
// release store. The price is in waiting: a waiter cannot be woken, so it spins (with `pause`)
// for a short while, then yields its core, then sleeps in short naps. That suits this lock: it
// is held for tens of nanoseconds on the common path, and only the rare slow paths (a device
// reservation, waiting for another stream's event in empty_cache or the retry chain) hold it
// for longer, when a waiter's nap costs little next to the holder's device call.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace cachealloc {

class SpinMutex {
 public:
  void lock() noexcept {
    if (!locked_.exchange(true, std::memory_order_acquire)) {
      return;
    }
    lock_slow();
  }
  [[nodiscard]] bool try_lock() noexcept {
    return !locked_.load(std::memory_order_relaxed) && !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  static void relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
  }

  // Out of line, so that lock() stays one exchange inlined into the caller: with the waiting
  // loop inlined into it, lock() was left a call of its own, one more code line per cold call
  // (callgrind, session 24).
#if defined(__GNUC__)
  __attribute__((noinline, cold))
#endif
  void lock_slow() noexcept {
    constexpr unsigned kSpins = 128;    // about a microsecond of `pause`
    constexpr unsigned kYields = 1024;  // then give the core to others
    for (unsigned round = 0;; ++round) {
      while (locked_.load(std::memory_order_relaxed)) {
        if (round < kSpins) {
          relax();
        } else if (round < kSpins + kYields) {
          std::this_thread::yield();
        } else {  // a long hold (a device call, an event wait): nap
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        ++round;
      }
      if (!locked_.exchange(true, std::memory_order_acquire)) {
        return;
      }
    }
  }

  std::atomic<bool> locked_{false};
};

}  // namespace cachealloc
