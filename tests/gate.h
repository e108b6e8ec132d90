// gate.h: a gate that test threads wait at until the test opens it (tests of worker threads).
#pragma once

#include <condition_variable>
#include <mutex>

namespace cachealloc::test {

class Gate {
 public:
  /// Blocks until open(); wait_entered() returns once some thread got here.
  void wait() {
    std::unique_lock lock(m_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
  }
  void wait_entered() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void open() {
    {
      std::lock_guard lock(m_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool open_ = false;
};

}  // namespace cachealloc::test
