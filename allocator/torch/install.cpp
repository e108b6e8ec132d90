// install.cpp: cachealloc::torch::install(), time_native_install() (the timing wrapper of
// timed_allocator.h) and the C entry points of libcachealloc_torch.so.
//
// Note [Installing]
// PyTorch reads its CUDA allocator from two places: c10::cuda::CUDACachingAllocator::allocator
// (everything in c10/cuda and ATen's CUDA code, the Python torch.cuda.* memory functions) and
// c10::GetAllocator(kCUDA) (device-generic code such as torch.accelerator). CUDAPluggableAllocator
// only swaps the first; install() sets both. Like PyTorch's changeCurrentAllocator it refuses
// once the current allocator is initialized (CUDA was used): tensors of the old allocator would
// reach our free. The runtime is only configured here, not started: no CUDA call happens before
// PyTorch's own lazy initialisation (so fork() before the first CUDA use still works).
// time_native_install() puts the timing wrapper in the same two places, under the same rule.
#include "cachealloc/torch/install.h"

#include "capture_guard_backend.h"
#include "runtime.h"
#include "timed_allocator.h"
#include "torch_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include <cachealloc/errors.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

namespace cachealloc::torch {
namespace {

using torch_adapter::TimedAllocator;
using torch_adapter::TorchAllocator;

std::mutex g_install_mutex;

/// Above PyTorch's own registration (priority 0), so that a later REGISTER_ALLOCATOR does not
/// take kCUDA back.
constexpr std::uint8_t kAllocatorPriority = 1;

}  // namespace

void install(const std::string& conf) {
  std::lock_guard lock(g_install_mutex);
  auto* current = c10::cuda::CUDACachingAllocator::allocator.load();
  if (TorchAllocator* ours = TorchAllocator::instance()) {
    TORCH_CHECK(ours->conf_text() == conf, "cachealloc::torch::install: cachealloc is already installed with "
                "CACHEALLOC_CONF='", ours->conf_text(), "'; the allocator of a running process cannot be "
                "reconfigured (asked for '", conf, "'). Start a new process.");
    TORCH_CHECK(current == ours, "cachealloc::torch::install: cachealloc was installed, but PyTorch's CUDA "
                "allocator was changed since (now '", current->name(), "')");
    return;
  }
  TORCH_CHECK(current == nullptr || !current->initialized(), "cachealloc::torch::install: PyTorch's CUDA "
              "allocator ('", current->name(), "') is already initialized in this process (CUDA was used), and "
              "an allocator in use cannot be swapped. Install cachealloc right after start-up, before the first "
              "CUDA tensor or any torch.cuda call that initialises CUDA.");
  auto adapter = std::make_unique<TorchAllocator>(conf);
  TorchAllocator* raw = adapter.get();
  plugin::RuntimeHooks hooks;
  hooks.wrap_backend = [raw](std::unique_ptr<DeviceBackend> inner) -> std::unique_ptr<DeviceBackend> {
    // Note [Deferred events during capture] (capture_guard_backend.h): device calls that stay
    // run in relaxed capture mode, through the same CUDA runtime that makes them.
    torch_adapter::CaptureMode mode;
    mode.relax = [] {
      cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
      if (cudaThreadExchangeStreamCaptureMode(&m) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
      }
      return static_cast<int>(m);
    };
    mode.restore = [](int previous) {
      if (previous >= 0) {
        auto m = static_cast<cudaStreamCaptureMode>(previous);
        (void)cudaThreadExchangeStreamCaptureMode(&m);
      }
    };
    return std::make_unique<torch_adapter::CaptureGuardBackend>(std::move(inner), raw->captures_underway(), mode);
  };
  hooks.observer = [raw](int device, AllocatorEvent event, std::uintptr_t addr, std::size_t size, StreamId stream) {
    raw->on_event(device, event, addr, size, stream);
  };
  try {
    plugin::Runtime::configure(conf, std::move(hooks));
  } catch (const cachealloc::Error& e) {
    C10_THROW_ERROR(Error, std::string("cachealloc::torch::install: ") + e.what());
  }
  // Leaked on purpose, like the runtime: DataPtr deleters run during interpreter shutdown.
  TorchAllocator::set_instance(adapter.release());
  c10::cuda::CUDACachingAllocator::allocator.store(raw);
  c10::SetAllocator(c10::DeviceType::CUDA, raw, kAllocatorPriority);
}

bool installed() noexcept { return TorchAllocator::instance() != nullptr; }

void time_native_install() {
  std::lock_guard lock(g_install_mutex);
  auto* current = c10::cuda::CUDACachingAllocator::allocator.load();
  if (TimedAllocator* timed = TimedAllocator::instance()) {
    TORCH_CHECK(current == timed, "cachealloc::torch::time_native_install: the timing wrapper was installed, but "
                "PyTorch's CUDA allocator was changed since (now '", current != nullptr ? current->name() : "none",
                "'); an allocator in use cannot be wrapped again. Start a new process.");
    return;
  }
  TORCH_CHECK(current != nullptr, "cachealloc::torch::time_native_install: PyTorch has no CUDA allocator to time");
  TORCH_CHECK(!current->initialized(), "cachealloc::torch::time_native_install: PyTorch's CUDA allocator ('",
              current->name(), "') is already initialized in this process (CUDA was used), and the tensors it "
              "handed out would be freed around the wrapper. Install the timing wrapper right after start-up, "
              "before the first CUDA tensor or any torch.cuda call that initialises CUDA.");
  // Leaked on purpose, like the adapter: DataPtr deleters run during interpreter shutdown.
  auto* timed = new TimedAllocator(current);
  TimedAllocator::set_instance(timed);  // before any tensor can carry one of its deleters
  c10::cuda::CUDACachingAllocator::allocator.store(timed);
  c10::SetAllocator(c10::DeviceType::CUDA, timed, kAllocatorPriority);
}

bool time_native_installed() noexcept {
  TimedAllocator* timed = TimedAllocator::instance();
  return timed != nullptr && c10::cuda::CUDACachingAllocator::allocator.load() == timed;
}

TimedNativeTotals time_native_totals() noexcept {
  TimedNativeTotals out;
  if (const TimedAllocator* timed = TimedAllocator::instance()) {
    const torch_adapter::TimedTotals t = timed->totals();
    out.alloc_calls = t.alloc_calls;
    out.free_calls = t.free_calls;
    out.alloc_ns = t.alloc_ns;
    out.free_ns = t.free_ns;
  }
  return out;
}

const char* built_for_torch_version() noexcept { return TORCH_VERSION; }

}  // namespace cachealloc::torch

// ---- C entry points (for ctypes; everything caught) --------------------------------------------

namespace {

void copy_message(const char* text, char* buf, std::size_t len) noexcept {
  if (buf == nullptr || len == 0) {
    return;
  }
  const std::size_t n = std::min(std::strlen(text), len - 1);
  std::memcpy(buf, text, n);
  buf[n] = '\0';
}

/// Runs `install` for the C entry point `name`: 0, or -1 with the error's message in `err` (at
/// most `len` bytes with the NUL).
template <class F>
int guarded_install(const char* name, char* err, std::size_t len, F&& install) noexcept {
  try {
    install();
    copy_message("", err, len);
    return 0;
  } catch (const c10::Error& e) {
    copy_message(e.what_without_backtrace(), err, len);
  } catch (const std::exception& e) {
    copy_message(e.what(), err, len);
  } catch (...) {
    char text[128];
    std::snprintf(text, sizeof text, "%s: unknown error", name);
    copy_message(text, err, len);
  }
  return -1;
}

}  // namespace

/// Installs the adapter (cachealloc::torch::install). 0 on success; -1 with the message in `err`
/// (at most `len` bytes with the NUL).
extern "C" int cachealloc_torch_install(const char* conf, char* err,
                                                                               std::size_t len) {
  return guarded_install("cachealloc_torch_install", err, len,
                         [&] { cachealloc::torch::install(conf != nullptr ? conf : ""); });
}

/// 1 once installed in this process, else 0.
extern "C" int cachealloc_torch_is_installed(void) {
  return cachealloc::torch::installed() ? 1 : 0;
}

/// The PyTorch version this library was built against, e.g. "2.11.0".
extern "C" const char* cachealloc_torch_built_for(void) {
  return cachealloc::torch::built_for_torch_version();
}

/// cachealloc's own version, e.g. "0.1.0".
extern "C" const char* cachealloc_torch_version(void) {
  return CACHEALLOC_TORCH_VERSION;
}

/// Nanoseconds spent inside the default pools' alloc and free on `device` (0 before start).
extern "C" std::uint64_t cachealloc_torch_allocator_ns(int device) {
  try {
    cachealloc::plugin::Runtime* rt = cachealloc::plugin::Runtime::existing();
    return rt != nullptr ? rt->allocator_ns(device) : 0;
  } catch (...) {
    return 0;
  }
}

/// Installs the timing wrapper around PyTorch's current CUDA allocator
/// (cachealloc::torch::time_native_install). 0 on success; -1 with the message in `err`.
extern "C" int cachealloc_torch_time_native_install(char* err, std::size_t len) {
  return guarded_install("cachealloc_torch_time_native_install", err, len,
                         [] { cachealloc::torch::time_native_install(); });
}

/// 1 while the timing wrapper is PyTorch's CUDA allocator, else 0.
extern "C" int cachealloc_torch_time_native_is_installed(void) {
  return cachealloc::torch::time_native_installed() ? 1 : 0;
}

/// Nanoseconds inside the wrapped allocator's allocation and free paths (0 before installing).
extern "C" std::uint64_t cachealloc_torch_time_native_ns(void) {
  const cachealloc::torch::TimedNativeTotals t = cachealloc::torch::time_native_totals();
  return t.alloc_ns + t.free_ns;
}

extern "C" std::uint64_t cachealloc_torch_time_native_alloc_ns(void) {
  return cachealloc::torch::time_native_totals().alloc_ns;
}

extern "C" std::uint64_t cachealloc_torch_time_native_free_ns(void) {
  return cachealloc::torch::time_native_totals().free_ns;
}

extern "C" std::uint64_t cachealloc_torch_time_native_alloc_calls(void) {
  return cachealloc::torch::time_native_totals().alloc_calls;
}

extern "C" std::uint64_t cachealloc_torch_time_native_free_calls(void) {
  return cachealloc::torch::time_native_totals().free_calls;
}
