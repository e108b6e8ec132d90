// tick_clock.cpp: invariant-TSC detection and the lazy ticks -> nanoseconds conversion.
#include "tick_clock.h"

#ifdef CACHEALLOC_TICK_CLOCK_HAS_TSC
#include <cpuid.h>
#endif

namespace cachealloc::plugin {
namespace {

bool has_invariant_tsc() noexcept {
#ifdef CACHEALLOC_TICK_CLOCK_HAS_TSC
  unsigned eax = 0;
  unsigned ebx = 0;
  unsigned ecx = 0;
  unsigned edx = 0;
  if (__get_cpuid(0x80000000u, &eax, &ebx, &ecx, &edx) == 0 || eax < 0x80000007u) {
    return false;
  }
  if (__get_cpuid(0x80000007u, &eax, &ebx, &ecx, &edx) == 0) {
    return false;
  }
  return (edx & (1u << 8)) != 0;
#else
  return false;
#endif
}

constexpr std::uint64_t kMinCalibrationNs = 1'000'000;  // 1 ms

}  // namespace

TickClock::TickClock() noexcept : use_tsc_(has_invariant_tsc()) {
  origin_ns_ = monotonic_ns();
  origin_ticks_ = now();
}

std::uint64_t TickClock::to_ns(std::uint64_t ticks) const noexcept {
  if (!use_tsc_) {
    return ticks;
  }
  std::uint64_t elapsed_ns = monotonic_ns() - origin_ns_;
  std::uint64_t elapsed_ticks = now() - origin_ticks_;
  while (elapsed_ns < kMinCalibrationNs || elapsed_ticks == 0) {  // only right after start-up
    elapsed_ns = monotonic_ns() - origin_ns_;
    elapsed_ticks = now() - origin_ticks_;
  }
  const long double ns_per_tick =
      static_cast<long double>(elapsed_ns) / static_cast<long double>(elapsed_ticks);
  return static_cast<std::uint64_t>(static_cast<long double>(ticks) * ns_per_tick);
}

}  // namespace cachealloc::plugin
