// cuda_replay.h: `cachealloc-replay --device cuda`: the trace on the real GPU, side by side with
// PyTorch's own allocator and with raw cudaMallocAsync (compiled only with CUDA).
//
// Note [Replaying on the GPU]
// - Streams. Every distinct stream id of the trace becomes a real stream: id 0 (PyTorch's
//   default stream) is the legacy default stream (cudaStreamLegacy, StreamId 0), every other id
//   one cudaStreamCreateWithFlags(cudaStreamNonBlocking) stream, created once for the whole run
//   and shared by every allocator replayed. One more created stream stands for "another stream
//   used the block" (below).
// - Deferred frees (replay.h, Note [Replaying frees]). At `free_deferred` the replay calls
//   record_stream(ptr, S) on that extra stream S and frees: our front end records an event on S
//   and parks the block; PyTorch's allocator does the same (recordStream + raw_delete);
//   cudaMallocAsync makes the block's stream wait for an event on S and frees there. Nothing is
//   queued on S, so the events complete at once, and at `free_completed` there is nothing to do:
//   the allocators' own event polling hands the block back, as in a real program.
// - Latency. Each allocate, free and deferred free is timed alone with std::chrono::steady_clock
//   (vDSO, ~20 ns per reading, included in every row alike); p50/p90/p99/max are per operation.
// - Peak. "peak reserved" is what the allocator itself reports (our stats, PyTorch's
//   reserved_bytes peak, the pool's cudaMemPoolAttrReservedMemHigh). "peak device" is measured:
//   cudaMemGetInfo's used bytes, minus those before the run, sampled every `sample_every`
//   operations and after every operation that changed one of our backends' call counters; it
//   can miss a short peak between samples of PyTorch's and cudaMallocAsync's rows.
// - Isolation. Allocators run one after another; each gives everything back (empty_cache,
//   emptyCache, cudaMemPoolTrimTo(0)) after the device synchronised, before the next starts.
#pragma once

#include "replay.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace cachealloc::replay {

/// Rows that are not our policies.
inline constexpr const char* kTorchNativeRow = "torch_native";
inline constexpr const char* kMallocAsyncRow = "cudaMallocAsync";

struct Latency {
  std::uint64_t count = 0;
  double p50_ns = 0;
  double p90_ns = 0;
  double p99_ns = 0;
  double max_ns = 0;
  double total_ns = 0;
};

struct CudaResult {
  PolicyResult base;                  ///< name, conf, peaks, device calls, failures, seconds
  std::string backend;                ///< what served the memory
  std::uint64_t peak_device_used = 0; ///< cudaMemGetInfo, above the level before the run
  std::uint64_t device_calls = 0;     ///< cudaMalloc/cudaFree/cuMem* (or cudaMallocAsync) calls
  Latency alloc;
  Latency free;
};

struct CudaReplayOptions {
  int gpu = 0;
  std::uint64_t sample_every = 64;  ///< cudaMemGetInfo every N operations
  std::uint64_t check_every = 0;    ///< our policies: check_invariants() every N operations
  std::function<void(double fraction)> progress;
};

/// One allocator under test. Calls come from one thread; `allocate` returns nullptr when the
/// device is out of memory.
class CudaTarget {
 public:
  virtual ~CudaTarget() = default;
  [[nodiscard]] virtual void* allocate(std::size_t bytes, cudaStream_t stream) = 0;
  virtual void deallocate(void* ptr, cudaStream_t stream) = 0;
  /// `ptr` (of `stream`) was also used on `other`: free it so that it waits for `other`.
  virtual void free_deferred(void* ptr, cudaStream_t stream, cudaStream_t other) = 0;
  /// True when the reservations may have changed since the last call (cheap; false: unknown).
  [[nodiscard]] virtual bool reservations_changed() { return false; }
  virtual void check_invariants() {}
  /// After the replay and after every block was freed: fill the peaks and counters of `r`, then
  /// give every byte back to the device.
  virtual void finish(CudaResult& r) = 0;
};

/// The real streams of a trace (Note [Replaying on the GPU]).
class TraceStreams {
 public:
  TraceStreams(const PreparedTrace& trace, int gpu);
  ~TraceStreams();
  TraceStreams(const TraceStreams&) = delete;
  TraceStreams& operator=(const TraceStreams&) = delete;
  [[nodiscard]] cudaStream_t get(std::uint64_t trace_stream) const { return streams_.at(trace_stream); }
  [[nodiscard]] cudaStream_t other() const noexcept { return other_; }
  [[nodiscard]] std::size_t created() const noexcept { return created_.size(); }

 private:
  std::map<std::uint64_t, cudaStream_t> streams_;
  std::vector<cudaStream_t> created_;
  cudaStream_t other_ = nullptr;
};

/// Replays `trace` on `target`; the result is named `name`.
CudaResult replay_on(const PreparedTrace& trace, const TraceStreams& streams, CudaTarget& target,
                     const std::string& name, const CudaReplayOptions& options);

/// Our `policy` on its real backend (configured by `conf`, CACHEALLOC_CONF syntax).
std::unique_ptr<CudaTarget> make_policy_target(const std::string& policy, const std::string& conf,
                                               int gpu, std::string& backend_name);
/// cudaMallocAsync/cudaFreeAsync on the device's default pool, release threshold UINT64_MAX.
std::unique_ptr<CudaTarget> make_malloc_async_target(int gpu);
/// PyTorch's own allocator through LibTorch (torch_native_replay.cpp; only when built with
/// Torch: CACHEALLOC_REPLAY_WITH_TORCH).
std::unique_ptr<CudaTarget> make_torch_native_target(int gpu, std::string& backend_name);

/// What `cachealloc-replay --device cuda` was asked to do.
struct CudaCommand {
  std::string trace_path;
  std::vector<std::string> rows;  ///< our policies, kTorchNativeRow, kMallocAsyncRow
  std::map<std::string, std::string> conf_of;
  std::string json_path;
  int gpu = 0;
  std::uint64_t sample_every = 64;
  std::uint64_t check_every = 0;
  bool progress = false;
};

/// The default rows: every registered policy that is not replay-only, then PyTorch's allocator
/// (when built with Torch) and cudaMallocAsync.
std::vector<std::string> default_cuda_rows();
/// True when the replay was built with the LibTorch comparison row.
bool torch_native_built() noexcept;

/// Replays every row, prints the table, writes the JSON. Returns the exit status.
int run_cuda_command(const PreparedTrace& trace, const CudaCommand& command);

}  // namespace cachealloc::replay
