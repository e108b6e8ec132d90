// cuda_replay.cpp: the trace on the real GPU for our policies, PyTorch's allocator and
// cudaMallocAsync (see cuda_replay.h, Note [Replaying on the GPU]).
#include "cuda_replay.h"

#include <cachealloc/cuda/factory.h>
#include <cachealloc/cuda/streams.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <limits>

namespace cachealloc::replay {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw DeviceError(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" +
                          cudaGetErrorString(e) + ")",
                      static_cast<int>(e));
  }
}

std::uint64_t device_used_bytes() {
  std::size_t free_b = 0;
  std::size_t total_b = 0;
  cuda_check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return total_b - free_b;
}

Latency summarize(std::vector<std::uint32_t>& ns) {
  Latency l;
  l.count = ns.size();
  if (ns.empty()) {
    return l;
  }
  for (std::uint32_t v : ns) {
    l.total_ns += v;
  }
  std::sort(ns.begin(), ns.end());
  auto at = [&](double q) {
    const auto i = static_cast<std::size_t>(q * static_cast<double>(ns.size() - 1) + 0.5);
    return static_cast<double>(ns[std::min(i, ns.size() - 1)]);
  };
  l.p50_ns = at(0.50);
  l.p90_ns = at(0.90);
  l.p99_ns = at(0.99);
  l.max_ns = static_cast<double>(ns.back());
  return l;
}

// ---- our policies ----
class PolicyTarget final : public CudaTarget {
 public:
  explicit PolicyTarget(std::unique_ptr<DeviceAllocator> a) : a_(std::move(a)) {}

  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    try {
      return a_->allocate(bytes, to_stream_id(stream));
    } catch (const OutOfMemory&) {
      return nullptr;
    }
  }
  void deallocate(void* ptr, cudaStream_t /*stream*/) override { a_->deallocate(ptr); }
  void free_deferred(void* ptr, cudaStream_t /*stream*/, cudaStream_t other) override {
    a_->record_stream(ptr, to_stream_id(other));
    a_->deallocate(ptr);
  }
  bool reservations_changed() override {
    const BackendCounters& c = a_->backend().counters();
    const std::uint64_t n = c.reserve_calls + c.release_calls + c.physical_creates +
                            c.physical_releases + c.map_calls + c.unmap_calls;
    const bool changed = n != last_;
    last_ = n;
    return changed;
  }
  void check_invariants() override { a_->check_invariants(); }
  void finish(CudaResult& r) override {
    const Stats s = a_->stats();
    r.base.peak_reserved = static_cast<std::uint64_t>(s.reserved_bytes.peak);
    r.base.peak_allocated = static_cast<std::uint64_t>(s.allocated_bytes.peak);
    r.base.peak_requested = static_cast<std::uint64_t>(s.requested_bytes.peak);
    const BackendCounters& c = a_->backend().counters();
    r.base.device_reserve_calls = c.reserve_calls + c.physical_creates;
    r.base.device_release_calls = c.release_calls + c.physical_releases;
    r.base.map_calls = c.map_calls;
    r.base.unmap_calls = c.unmap_calls;
    r.base.mapped_bytes = c.mapped_bytes;
    r.device_calls = r.base.device_reserve_calls + r.base.device_release_calls + c.map_calls +
                     c.unmap_calls;
    a_->empty_cache();
    a_.reset();
  }

 private:
  std::unique_ptr<DeviceAllocator> a_;
  std::uint64_t last_ = 0;
};

// ---- raw cudaMallocAsync on the device's default pool ----
class MallocAsyncTarget final : public CudaTarget {
 public:
  explicit MallocAsyncTarget(int gpu) {
    cuda_check(cudaDeviceGetDefaultMemPool(&pool_, gpu), "cudaDeviceGetDefaultMemPool");
    cuda_check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &old_threshold_),
          "cudaMemPoolGetAttribute");
    std::uint64_t keep = std::numeric_limits<std::uint64_t>::max();
    cuda_check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
    std::uint64_t zero = 0;  // resets the high watermark to the current value
    cuda_check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero), "cudaMemPoolSetAttribute");
    cuda_check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~MallocAsyncTarget() override {
    (void)cudaEventDestroy(event_);
    (void)cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &old_threshold_);
  }
  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    if (bytes == 0) {
      return nullptr;
    }
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, bytes, stream);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    cuda_check(e, "cudaMallocAsync");
    ++calls_;
    return p;
  }
  void deallocate(void* ptr, cudaStream_t stream) override {
    cuda_check(cudaFreeAsync(ptr, stream), "cudaFreeAsync");
    ++calls_;
  }
  void free_deferred(void* ptr, cudaStream_t stream, cudaStream_t other) override {
    // As PyTorch's cudaMallocAsync backend does for recordStream: the free waits for `other`.
    cuda_check(cudaEventRecord(event_, other), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
    deallocate(ptr, stream);
  }
  void finish(CudaResult& r) override {
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::uint64_t high = 0;
    cuda_check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &high), "cudaMemPoolGetAttribute");
    std::uint64_t used_high = 0;
    cuda_check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &used_high), "cudaMemPoolGetAttribute");
    r.base.peak_reserved = high;
    r.base.peak_allocated = used_high;
    r.device_calls = calls_;
    cuda_check(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
  }

 private:
  cudaMemPool_t pool_ = nullptr;
  std::uint64_t old_threshold_ = 0;
  cudaEvent_t event_ = nullptr;
  std::uint64_t calls_ = 0;
};

std::string with_commas(std::uint64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) {
    s.insert(static_cast<std::size_t>(i), ",");
  }
  return s;
}

nlohmann::json latency_json(const Latency& l) {
  return {{"count", l.count}, {"p50", l.p50_ns}, {"p90", l.p90_ns}, {"p99", l.p99_ns},
          {"max", l.max_ns},  {"total", l.total_ns}};
}

}  // namespace

TraceStreams::TraceStreams(const PreparedTrace& trace, int gpu) {
  cuda_check(cudaSetDevice(gpu), "cudaSetDevice");
  auto make = [this]() {
    cudaStream_t s = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    created_.push_back(s);
    return s;
  };
  for (const Op& op : trace.ops) {
    if (op.kind == OpKind::alloc && !streams_.contains(op.stream)) {
      streams_[op.stream] = op.stream == 0 ? cudaStream_t{nullptr} : make();
    }
  }
  other_ = make();
}

TraceStreams::~TraceStreams() {
  (void)cudaDeviceSynchronize();
  for (cudaStream_t s : created_) {
    (void)cudaStreamDestroy(s);
  }
}

CudaResult replay_on(const PreparedTrace& trace, const TraceStreams& streams, CudaTarget& target,
                     const std::string& name, const CudaReplayOptions& options) {
  using clock = std::chrono::steady_clock;
  CudaResult r;
  r.base.name = name;
  std::vector<void*> ptrs(trace.slots, nullptr);
  std::vector<cudaStream_t> slot_stream(trace.slots, nullptr);
  std::vector<std::uint32_t> alloc_ns;
  std::vector<std::uint32_t> free_ns;
  alloc_ns.reserve(trace.slots);
  free_ns.reserve(trace.slots);
  auto elapsed = [](clock::time_point a, clock::time_point b) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
    return static_cast<std::uint32_t>(std::min<std::int64_t>(ns, std::numeric_limits<std::uint32_t>::max()));
  };

  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const std::uint64_t baseline = device_used_bytes();
  std::uint64_t peak_used = baseline;
  const std::uint64_t every = std::max<std::uint64_t>(1, options.sample_every);
  (void)target.reservations_changed();

  const std::size_t n = trace.ops.size();
  const auto start = clock::now();
  auto last_progress = start;
  for (std::size_t i = 0; i < n; ++i) {
    const Op& op = trace.ops[i];
    switch (op.kind) {
      case OpKind::alloc: {
        const cudaStream_t s = streams.get(op.stream);
        const auto t0 = clock::now();
        void* p = target.allocate(op.size, s);
        const auto t1 = clock::now();
        alloc_ns.push_back(elapsed(t0, t1));
        if (p == nullptr && op.size != 0) {
          ++r.base.failed_allocations;
        }
        ptrs[op.slot] = p;
        slot_stream[op.slot] = s;
        break;
      }
      case OpKind::free:
      case OpKind::free_deferred: {
        void* p = ptrs[op.slot];
        if (p == nullptr) {
          break;
        }
        const auto t0 = clock::now();
        if (op.kind == OpKind::free) {
          target.deallocate(p, slot_stream[op.slot]);
        } else {
          target.free_deferred(p, slot_stream[op.slot], streams.other());
        }
        const auto t1 = clock::now();
        free_ns.push_back(elapsed(t0, t1));
        ptrs[op.slot] = nullptr;
        break;
      }
      case OpKind::free_completed:
        break;  // the allocators' events hand the block back (Note [Replaying on the GPU])
    }
    if (i % every == 0 || target.reservations_changed()) {
      peak_used = std::max(peak_used, device_used_bytes());
    }
    if (options.check_every != 0 && i % options.check_every == 0) {
      target.check_invariants();
    }
    if ((i & 0x3FFF) == 0x3FFF && options.progress) {
      const auto now = clock::now();
      if (now - last_progress > std::chrono::milliseconds(500)) {
        options.progress(static_cast<double>(i) / static_cast<double>(n));
        last_progress = now;
      }
    }
  }
  const auto stop = clock::now();
  peak_used = std::max(peak_used, device_used_bytes());
  r.base.seconds = std::chrono::duration<double>(stop - start).count();
  r.base.events_per_second = r.base.seconds > 0 ? static_cast<double>(trace.trace_events) / r.base.seconds : 0;
  r.peak_device_used = peak_used - std::min(peak_used, baseline);

  // Blocks still live at the end of the trace: freed untimed, then everything goes back.
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (std::size_t slot = 0; slot < ptrs.size(); ++slot) {
    if (ptrs[slot] != nullptr) {
      target.deallocate(ptrs[slot], slot_stream[slot]);
    }
  }
  target.finish(r);
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  r.alloc = summarize(alloc_ns);
  r.free = summarize(free_ns);
  return r;
}

std::unique_ptr<CudaTarget> make_policy_target(const std::string& policy, const std::string& conf,
                                               int gpu, std::string& backend_name) {
  const PolicyInfo* info = find_policy(policy);
  Config config = Config::parse(conf);
  (void)config.take_string("policy");
  const std::string_view kind = info != nullptr ? backend_kind(info->backend) : "runtime";
  std::unique_ptr<DeviceBackend> backend = make_cuda_backend(kind, gpu, config);
  backend_name = std::string(backend->name());
  std::unique_ptr<DeviceAllocator> allocator = make_allocator(policy, std::move(backend), config);
  std::vector<std::string_view> valid = front_end_config_keys();
  if (info != nullptr) {
    for (std::string_view k : info->config_keys()) {
      valid.push_back(k);
    }
  }
  for (std::string_view k : cuda_backend_config_keys(kind)) {
    valid.push_back(k);
  }
  config.finish("policy " + policy, valid);
  return std::make_unique<PolicyTarget>(std::move(allocator));
}

std::unique_ptr<CudaTarget> make_malloc_async_target(int gpu) {
  return std::make_unique<MallocAsyncTarget>(gpu);
}

bool torch_native_built() noexcept {
#ifdef CACHEALLOC_REPLAY_WITH_TORCH
  return true;
#else
  return false;
#endif
}

std::vector<std::string> default_cuda_rows() {
  std::vector<std::string> rows;
  for (const PolicyInfo& p : registered_policies()) {
    if (!p.replay_only) {
      rows.emplace_back(p.name);
    }
  }
  if (torch_native_built()) {
    rows.emplace_back(kTorchNativeRow);
  }
  rows.emplace_back(kMallocAsyncRow);
  return rows;
}

int run_cuda_command(const PreparedTrace& trace, const CudaCommand& command) {
  const std::string gpu_name = cuda_device_name(command.gpu);
  std::size_t free_b = 0;
  std::size_t total_b = 0;
  cuda_check(cudaSetDevice(command.gpu), "cudaSetDevice");
  cuda_check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  TraceStreams streams(trace, command.gpu);

  std::vector<CudaResult> results;
  for (const std::string& row : command.rows) {
    CudaReplayOptions opts;
    opts.gpu = command.gpu;
    opts.sample_every = command.sample_every;
    opts.check_every = command.check_every;
    if (command.progress) {
      opts.progress = [&row](double f) { std::fprintf(stderr, "\rreplaying %-16s %5.1f%%", row.c_str(), f * 100); };
    }
    std::string conf;
    if (auto it = command.conf_of.find(row); it != command.conf_of.end()) {
      conf = it->second;
    } else if (row == "native") {
      conf = native_conf_from_settings(trace.settings);
    }
    CudaResult r;
    try {
      std::string backend;
      std::unique_ptr<CudaTarget> target;
      if (row == kMallocAsyncRow) {
        target = make_malloc_async_target(command.gpu);
        backend = "cudaMallocAsync (default pool)";
      } else if (row == kTorchNativeRow) {
        if (!torch_native_built()) {
          throw ConfigError("torch_native: this cachealloc-replay was built without LibTorch");
        }
#ifdef CACHEALLOC_REPLAY_WITH_TORCH
        target = make_torch_native_target(command.gpu, backend);
#endif
      } else {
        target = make_policy_target(row, conf, command.gpu, backend);
      }
      r = replay_on(trace, streams, *target, row, opts);
      r.backend = backend;
    } catch (const ConfigError&) {
      throw;
    } catch (const std::exception& e) {
      r = CudaResult{};
      r.base.name = row;
      r.base.error = e.what();
      (void)cudaDeviceSynchronize();
      (void)cudaGetLastError();
    }
    r.base.conf = conf;
    results.push_back(std::move(r));
    if (command.progress) {
      std::fprintf(stderr, "\r%45s\r", "");
    }
  }

  // The table: the CPU replay's columns, then the GPU's.
  std::printf("trace %s: %s events, %u allocations, device %d, GPU %d: %s (%s), streams: trace stream 0 "
              "-> legacy default stream, %zu created\n",
              trace.name.c_str(), with_commas(trace.trace_events).c_str(), trace.slots, trace.device,
              command.gpu, gpu_name.c_str(), format_bytes(total_b).c_str(), streams.created());
  std::printf("%-16s %16s %16s %7s %8s %8s %7s %7s %6s | %11s %16s | %-27s | %-27s | %8s\n", "policy",
              "peak reserved", "peak device", "ratio", "reserves", "releases", "maps", "unmaps",
              "failed", "dev calls", "events/s", "alloc us p50/p90/p99/max", "free us p50/p90/p99/max",
              "replay s");
  const double req = static_cast<double>(trace.peak_requested);
  if (!trace.segments.empty()) {
    std::printf("%-16s %16s %16s %7.3f\n", "recorded", with_commas(trace.recorded_peak_reserved).c_str(),
                "-", static_cast<double>(trace.recorded_peak_reserved) / req);
  }
  auto lat = [](const Latency& l) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f/%.2f/%.2f/%.0f", l.p50_ns / 1e3, l.p90_ns / 1e3, l.p99_ns / 1e3,
                  l.max_ns / 1e3);
    return std::string(buf);
  };
  for (const CudaResult& r : results) {
    if (!r.base.error.empty()) {
      std::printf("%-16s failed: %s\n", r.base.name.c_str(), r.base.error.c_str());
      continue;
    }
    std::printf("%-16s %16s %16s %7.3f %8llu %8llu %7llu %7llu %6llu | %11llu %16s | %-27s | %-27s | %8.3f\n",
                r.base.name.c_str(), with_commas(r.base.peak_reserved).c_str(),
                with_commas(r.peak_device_used).c_str(), static_cast<double>(r.base.peak_reserved) / req,
                static_cast<unsigned long long>(r.base.device_reserve_calls),
                static_cast<unsigned long long>(r.base.device_release_calls),
                static_cast<unsigned long long>(r.base.map_calls),
                static_cast<unsigned long long>(r.base.unmap_calls),
                static_cast<unsigned long long>(r.base.failed_allocations),
                static_cast<unsigned long long>(r.device_calls),
                with_commas(static_cast<std::uint64_t>(r.base.events_per_second)).c_str(),
                lat(r.alloc).c_str(), lat(r.free).c_str(), r.base.seconds);
  }
  for (const CudaResult& r : results) {
    if (!r.backend.empty()) {
      std::printf("  %s ran on %s%s%s\n", r.base.name.c_str(), r.backend.c_str(),
                  r.base.conf.empty() ? "" : " with CACHEALLOC_CONF=", r.base.conf.c_str());
    }
  }
  std::printf("  peak device: cudaMemGetInfo used bytes above the level before the row, sampled every "
              "%llu operations and after each reservation change of our backends\n",
              static_cast<unsigned long long>(command.sample_every));
  std::fputs(skipped_frees_note(trace).c_str(), stdout);

  if (!command.json_path.empty()) {
    nlohmann::json j;
    j["trace"] = command.trace_path;
    j["events"] = trace.trace_events;
    j["device"] = "cuda";
    j["gpu"] = gpu_name;
    j["gpu_total_bytes"] = total_b;
    j["streams_created"] = streams.created();
    j["recorded"] = {{"peak_reserved_bytes", trace.recorded_peak_reserved},
                     {"segments", trace.segments.size()}};
    j["policies"] = nlohmann::json::array();
    for (const CudaResult& r : results) {
      nlohmann::json p;
      p["name"] = r.base.name;
      p["conf"] = r.base.conf;
      if (!r.base.error.empty()) {
        p["error"] = r.base.error;
      } else {
        p["backend"] = r.backend;
        p["peak_reserved_bytes"] = r.base.peak_reserved;
        p["peak_device_used_bytes"] = r.peak_device_used;
        p["peak_requested_bytes"] = trace.peak_requested;
        p["ratio"] = static_cast<double>(r.base.peak_reserved) / req;
        p["device_reserve_calls"] = r.base.device_reserve_calls;
        p["device_release_calls"] = r.base.device_release_calls;
        p["map_calls"] = r.base.map_calls;
        p["unmap_calls"] = r.base.unmap_calls;
        p["mapped_bytes"] = r.base.mapped_bytes;
        p["device_calls"] = r.device_calls;
        p["failed_allocations"] = r.base.failed_allocations;
        p["events_per_second"] = r.base.events_per_second;
        p["replay_seconds"] = r.base.seconds;
        p["alloc_latency_ns"] = latency_json(r.alloc);
        p["free_latency_ns"] = latency_json(r.free);
      }
      j["policies"].push_back(p);
    }
    std::ofstream out(command.json_path);
    if (!out) {
      throw Error("cannot write --json file '" + command.json_path + "'");
    }
    out << j.dump(2) << "\n";
  }
  for (const CudaResult& r : results) {
    if (!r.base.error.empty()) {
      return 1;
    }
  }
  return 0;
}

}  // namespace cachealloc::replay
