// install.h: cachealloc as LibTorch's CUDA caching allocator (libcachealloc_torch.so).
//
// Unlike the pluggable allocator (libcachealloc_plugin.so through
// torch.cuda.memory.CUDAPluggableAllocator, which has allocate/free and little else), this
// library implements the whole c10::cuda::CUDACachingAllocator::CUDAAllocator interface, so
// PyTorch's own API works unchanged on top of cachealloc: torch.cuda.memory_stats(),
// memory_summary(), max_memory_reserved(), reset_peak_memory_stats(), empty_cache(),
// torch.cuda.memory._snapshot() / _record_memory_history() / _dump_snapshot(), record_stream(),
// CUDA graph capture (torch.cuda.graph, torch.compile(mode="reduce-overhead")) and
// torch.cuda.MemPool / use_mem_pool. See allocator/torch/README section in the top README.md.
//
// Not supported (they raise c10::Error naming the method): CUDA IPC (shareIpcHandle,
// getIpcDevPtr: sending CUDA tensors between processes), allocator checkpointing
// (getCheckpointState, setCheckpointPoolState), MemPool(allocator=...) and use_on_oom pools.
//
// The same library can also time PyTorch's own allocator instead of replacing it:
// time_native_install() wraps whatever CUDA allocator PyTorch has in a forwarding wrapper whose
// allocation and free paths are timed like cachealloc's (`allocator_ns`), so the two compare.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

/// Exported from libcachealloc_torch.so (built with hidden visibility; exports.map lists these).
#define CACHEALLOC_TORCH_API __attribute__((visibility("default")))

namespace cachealloc::torch {

/// Makes cachealloc the CUDA allocator of this process (c10::cuda::CUDACachingAllocator::allocator
/// and c10::GetAllocator(kCUDA)), configured by `conf` (CACHEALLOC_CONF syntax, e.g.
/// "policy:defrag"; empty: the default policy). Must run before CUDA is first used.
///
/// Throws c10::Error when `conf` is invalid (the message names the bad key or value), when the
/// current allocator is already initialized (CUDA was used), or when cachealloc was installed
/// before with a different `conf`. Installing again with the same `conf` does nothing.
/// Thread-safe. The device allocators are created lazily, at PyTorch's CUDA initialisation.
CACHEALLOC_TORCH_API void install(const std::string& conf);

/// True once install() succeeded in this process.
[[nodiscard]] CACHEALLOC_TORCH_API bool installed() noexcept;

/// The PyTorch version this library was compiled against ("2.11.0"); it must be loaded into
/// exactly that version (the allocator interface is C++ and changes between releases).
[[nodiscard]] CACHEALLOC_TORCH_API const char* built_for_torch_version() noexcept;

// ---- timing PyTorch's own allocator (timed_allocator.h) ----

/// What the timing wrapper counted since it was installed, over every device: calls of
/// allocate/raw_alloc/raw_alloc_with_stream (zero-byte ones included) and frees (DataPtr deleters
/// and raw_delete), and the time spent inside them, measured as cachealloc measures its own
/// `allocator_ns` (the TSC).
struct TimedNativeTotals {
  std::uint64_t alloc_calls = 0;
  std::uint64_t free_calls = 0;
  std::uint64_t alloc_ns = 0;
  std::uint64_t free_ns = 0;
};

/// Wraps the CUDA allocator PyTorch has now (its native caching allocator, with or without
/// expandable segments, cudaMallocAsync, or cachealloc's adapter if install() ran first) in a
/// wrapper that forwards every call and times the allocation and free paths, and installs the
/// wrapper in both places install() does. Must run before CUDA is first used.
///
/// Throws c10::Error when the current allocator is already initialized (CUDA was used), or when
/// the wrapper was installed before and PyTorch's allocator was changed since. Installing again
/// while the wrapper is in place does nothing. Thread-safe.
CACHEALLOC_TORCH_API void time_native_install();

/// True while the timing wrapper is PyTorch's CUDA allocator.
[[nodiscard]] CACHEALLOC_TORCH_API bool time_native_installed() noexcept;

/// The wrapper's counters (zeros before time_native_install()).
[[nodiscard]] CACHEALLOC_TORCH_API TimedNativeTotals time_native_totals() noexcept;

}  // namespace cachealloc::torch

// ---- the C entry points (for ctypes: cachealloc.enable(full=True) in tools/cachealloc) ----
extern "C" {
/// install(conf); 0 on success, -1 with the message in `err` (at most `len` bytes with the NUL).
CACHEALLOC_TORCH_API int cachealloc_torch_install(const char* conf, char* err, std::size_t len);
/// 1 once installed in this process, else 0.
CACHEALLOC_TORCH_API int cachealloc_torch_is_installed(void);
/// built_for_torch_version().
CACHEALLOC_TORCH_API const char* cachealloc_torch_built_for(void);
/// cachealloc's version ("0.1.0").
CACHEALLOC_TORCH_API const char* cachealloc_torch_version(void);
/// Nanoseconds spent inside the default pools' alloc and free on `device` (0 before CUDA starts).
CACHEALLOC_TORCH_API std::uint64_t cachealloc_torch_allocator_ns(int device);
/// time_native_install(); 0 on success, -1 with the message in `err` (at most `len` bytes with the NUL).
CACHEALLOC_TORCH_API int cachealloc_torch_time_native_install(char* err, std::size_t len);
/// 1 while the timing wrapper is PyTorch's CUDA allocator, else 0.
CACHEALLOC_TORCH_API int cachealloc_torch_time_native_is_installed(void);
/// Nanoseconds inside the wrapped allocator's allocation and free paths so far (alloc + free).
CACHEALLOC_TORCH_API std::uint64_t cachealloc_torch_time_native_ns(void);
/// The allocation part of cachealloc_torch_time_native_ns().
CACHEALLOC_TORCH_API std::uint64_t cachealloc_torch_time_native_alloc_ns(void);
/// The free part of cachealloc_torch_time_native_ns().
CACHEALLOC_TORCH_API std::uint64_t cachealloc_torch_time_native_free_ns(void);
/// Allocation calls the wrapper timed so far.
CACHEALLOC_TORCH_API std::uint64_t cachealloc_torch_time_native_alloc_calls(void);
/// Frees the wrapper timed so far.
CACHEALLOC_TORCH_API std::uint64_t cachealloc_torch_time_native_free_calls(void);
}
