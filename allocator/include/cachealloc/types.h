// types.h: the small vocabulary shared by every layer (streams, events, blocks, sizes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cachealloc {

/// A CUDA stream as an integer (`cudaStream_t` cast to uintptr_t); 0 is the legacy default stream.
using StreamId = std::uint64_t;
/// An opaque handle to a recorded device event, owned by the backend that recorded it.
using EventId = std::uint64_t;
/// An opaque handle to a physical memory allocation (CUDA VMM `CUmemGenericAllocationHandle`).
using PhysicalHandle = std::uint64_t;

inline constexpr std::size_t kKiB = std::size_t{1} << 10;
inline constexpr std::size_t kMiB = std::size_t{1} << 20;
inline constexpr std::size_t kGiB = std::size_t{1} << 30;

/// What a policy hands out: the address, the bytes it set aside (>= the request), and an opaque
/// cookie the policy may use to find its own bookkeeping again in O(1) on free.
struct Block {
  void* ptr = nullptr;
  std::size_t size = 0;
  void* cookie = nullptr;

  [[nodiscard]] explicit operator bool() const noexcept { return ptr != nullptr; }
};

[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t multiple) noexcept {
  return (n + multiple - 1) / multiple * multiple;
}

/// "1.50 GiB"-style text for messages and tables.
std::string format_bytes(std::uint64_t bytes);

}  // namespace cachealloc
