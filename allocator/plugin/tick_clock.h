// tick_clock.h: the cheap clock behind the `allocator_ns` statistic (time spent inside the
// plugin's alloc and free hooks).
//
// Note [Why the TSC and not clock_gettime]
// The hooks run on every tensor allocation, so the clock is read twice per call. On x86-64 with
// an invariant TSC (cpuid 0x80000007, EDX bit 8: constant rate, never stops) `rdtsc` costs about
// 7 ns; clock_gettime(CLOCK_MONOTONIC) through the vDSO costs about 20 ns. Ticks are converted
// to nanoseconds only when the statistic is read: the ratio is measured against steady_clock
// over the whole time since the clock was created (at least 1 ms; the first read waits that
// long if it comes sooner), so no calibration loop runs at start-up. Without an invariant TSC
// (or on other architectures) the clock falls back to clock_gettime and ticks are nanoseconds.
#pragma once

#include <cstdint>
#include <ctime>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define CACHEALLOC_TICK_CLOCK_HAS_TSC 1
#endif

namespace cachealloc::plugin {

class TickClock {
 public:
  /// Detects the invariant TSC and takes the reference point for the conversion.
  TickClock() noexcept;

  /// Ticks since an arbitrary origin (TSC cycles, or nanoseconds when the TSC is not usable).
  [[nodiscard]] std::uint64_t now() const noexcept {
#ifdef CACHEALLOC_TICK_CLOCK_HAS_TSC
    if (use_tsc_) {
      return __rdtsc();
    }
#endif
    return monotonic_ns();
  }

  /// Converts a tick count to nanoseconds (see Note [Why the TSC and not clock_gettime]).
  [[nodiscard]] std::uint64_t to_ns(std::uint64_t ticks) const noexcept;

  /// True when ticks are TSC cycles ("tsc"), false when they are clock_gettime nanoseconds.
  [[nodiscard]] bool uses_tsc() const noexcept { return use_tsc_; }

  [[nodiscard]] static std::uint64_t monotonic_ns() noexcept {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull +
           static_cast<std::uint64_t>(ts.tv_nsec);
  }

 private:
  bool use_tsc_ = false;
  std::uint64_t origin_ticks_ = 0;
  std::uint64_t origin_ns_ = 0;
};

}  // namespace cachealloc::plugin
