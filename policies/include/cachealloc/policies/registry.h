// registry.h: every policy by name, and the one place that turns a name into an allocator.
#pragma once

#include <cachealloc/allocator.h>
#include <cachealloc/backend.h>
#include <cachealloc/config.h>

#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace cachealloc {

/// What a policy needs from its backend.
enum class BackendNeed : std::uint8_t {
  runtime,          ///< cudaMalloc/cudaFree + events
  virtual_memory,   ///< CUDA VMM (cuMemCreate/cuMemMap)
  stream_ordered,   ///< a cudaMemPool_t (cudaMallocAsync)
};

/// The backend kind name make_cuda_backend() takes for `need`: "runtime", "virtual_memory" or
/// "stream_ordered".
std::string_view backend_kind(BackendNeed need) noexcept;

struct PolicyInfo {
  std::string_view name;
  std::string_view summary;
  BackendNeed backend;
  bool replay_only;  ///< a model for comparisons (native), not meant for production use
  std::vector<std::string_view> (*config_keys)();
};

/// All registered policies, in the order the replay table shows them.
std::span<const PolicyInfo> registered_policies();
const PolicyInfo* find_policy(std::string_view name);

/// Keys every front end understands besides the policy's own (policy, record, ...).
std::vector<std::string_view> front_end_config_keys();

/// Builds the front end for `policy` over `backend`; the policy takes its keys from `config`.
/// Throws ConfigError for an unknown policy (listing the valid ones) or a bad key/value.
std::unique_ptr<DeviceAllocator> make_allocator(std::string_view policy,
                                                std::unique_ptr<DeviceBackend> backend,
                                                Config& config);

}  // namespace cachealloc
