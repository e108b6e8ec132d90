// micro_cuda.cpp: the micro benchmarks on the REAL GPU, each of our policies on its CUDA backend
// side by side with PyTorch's own allocator (through LibTorch, when built with it) and with
// cudaMallocAsync, in one run:
//
//   pair/<alloc>/<bytes>   a cached alloc+free pair of one size on the legacy default stream
//   random/<alloc>         random free+alloc over 1,000 live blocks of 512 B - 32 MiB (the same
//                          pre-generated sequence for every allocator)
//   threads/<alloc>        alloc+free pairs from 1, 2, 4, 8 threads, each on its own stream
//
// <alloc> is a registered policy, torch_native (raw_alloc_with_stream / raw_delete) or
// cudaMallocAsync (the device's default pool, release threshold UINT64_MAX). The search cost as
// free holes grow (holes/...) runs on the simulated backend in cachealloc-micro.
//
// Each benchmark reports the median of 5 repetitions; at the end one line per benchmark says
// "RATIO <family>: torch_native <t> us / <fastest policy> <t> us = <n>x". --smoke runs a few
// iterations of each (ctest); without a GPU the program prints SKIP and exits 77.
// --summary-md=FILE also writes the medians and ratios as Markdown.
#include <cachealloc/cuda/factory.h>
#include <cachealloc/cuda/streams.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>

#include <benchmark/benchmark.h>

#include <cuda_runtime_api.h>

#ifdef CACHEALLOC_MICRO_WITH_TORCH
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using namespace cachealloc;

namespace {

constexpr const char* kTorch = "torch_native";
constexpr const char* kAsync = "cudaMallocAsync";
constexpr int kMaxThreads = 8;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
}

/// One allocator under test, behind the same two calls. Thread-safe.
class Alloc {
 public:
  virtual ~Alloc() = default;
  virtual void* allocate(std::size_t bytes, cudaStream_t stream) = 0;
  virtual void deallocate(void* p, cudaStream_t stream) = 0;
};

class PolicyAlloc final : public Alloc {
 public:
  explicit PolicyAlloc(const std::string& policy) {
    const PolicyInfo* info = find_policy(policy);
    std::string_view kind = "runtime";
    if (info != nullptr && info->backend == BackendNeed::virtual_memory) {
      kind = "virtual_memory";
    } else if (info != nullptr && info->backend == BackendNeed::stream_ordered) {
      kind = "stream_ordered";
    }
    Config c;
    a_ = make_allocator(policy, make_cuda_backend(kind, 0, c), c);
  }
  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    return a_->allocate(bytes, to_stream_id(stream));
  }
  void deallocate(void* p, cudaStream_t /*stream*/) override { a_->deallocate(p); }

 private:
  std::unique_ptr<DeviceAllocator> a_;
};

class AsyncAlloc final : public Alloc {
 public:
  AsyncAlloc() {
    cuda_check(cudaDeviceGetDefaultMemPool(&pool_, 0), "cudaDeviceGetDefaultMemPool");
    std::uint64_t keep = std::numeric_limits<std::uint64_t>::max();
    cuda_check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
  }
  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    void* p = nullptr;
    cuda_check(cudaMallocAsync(&p, bytes, stream), "cudaMallocAsync");
    return p;
  }
  void deallocate(void* p, cudaStream_t stream) override { cuda_check(cudaFreeAsync(p, stream), "cudaFreeAsync"); }

 private:
  cudaMemPool_t pool_ = nullptr;
};

#ifdef CACHEALLOC_MICRO_WITH_TORCH
class TorchAlloc final : public Alloc {
 public:
  TorchAlloc() {
    c10::cuda::set_device(0);
    // Outside Python nobody initialises PyTorch's allocator; init() only adds unseen devices.
    c10::cuda::CUDACachingAllocator::init(static_cast<int>(c10::cuda::device_count()));
  }
  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream);
  }
  void deallocate(void* p, cudaStream_t /*stream*/) override { c10::cuda::CUDACachingAllocator::raw_delete(p); }
};
#endif

// One allocator per name for the whole run (built on first use, kept warm).
std::map<std::string, std::unique_ptr<Alloc>>& allocators() {
  static std::map<std::string, std::unique_ptr<Alloc>> m;
  return m;
}
std::mutex g_alloc_mutex;

Alloc& get(const std::string& name) {
  std::lock_guard lock(g_alloc_mutex);
  auto& slot = allocators()[name];
  if (!slot) {
    if (name == kAsync) {
      slot = std::make_unique<AsyncAlloc>();
#ifdef CACHEALLOC_MICRO_WITH_TORCH
    } else if (name == kTorch) {
      slot = std::make_unique<TorchAlloc>();
#endif
    } else {
      slot = std::make_unique<PolicyAlloc>(name);
    }
  }
  return *slot;
}

std::vector<cudaStream_t> g_streams;  // one per thread of threads/...

void pair(benchmark::State& state, const std::string& name) {
  Alloc& a = get(name);
  const auto bytes = static_cast<std::size_t>(state.range(0));
  a.deallocate(a.allocate(bytes, nullptr), nullptr);  // warm the cache
  for (auto _ : state) {
    void* p = a.allocate(bytes, nullptr);
    benchmark::DoNotOptimize(std::as_const(p));  // const overload: the "+m" form handed back the address of p under GCC 12 + ASan
    a.deallocate(p, nullptr);
  }
}

// The random pattern: the same sizes and picks for every allocator.
struct RandomPattern {
  std::vector<std::size_t> initial;
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> picks;
};
const RandomPattern& random_pattern_data() {
  static const RandomPattern r = [] {
    RandomPattern p;
    std::mt19937_64 rng(1);
    auto size = [&] { return std::size_t{512} << (rng() % 17); };  // 512 B .. 32 MiB
    for (int i = 0; i < 1000; ++i) {
      p.initial.push_back(size());
    }
    for (int i = 0; i < 4096; ++i) {
      p.sizes.push_back(size());
      p.picks.push_back(rng() % 1000);
    }
    return p;
  }();
  return r;
}

void random_pattern(benchmark::State& state, const std::string& name) {
  Alloc& a = get(name);
  const RandomPattern& r = random_pattern_data();
  std::vector<void*> live;
  for (std::size_t s : r.initial) {
    live.push_back(a.allocate(s, nullptr));
  }
  std::size_t i = 0;
  for (auto _ : state) {
    const std::size_t k = r.picks[i & 4095];
    a.deallocate(live[k], nullptr);
    live[k] = a.allocate(r.sizes[i & 4095], nullptr);
    ++i;
  }
  for (void* p : live) {
    a.deallocate(p, nullptr);
  }
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

void threads(benchmark::State& state, const std::string& name) {
  Alloc& a = get(name);
  const cudaStream_t s = g_streams[static_cast<std::size_t>(state.thread_index())];
  const std::size_t bytes = 4096 + 512 * static_cast<std::size_t>(state.thread_index());
  for (auto _ : state) {
    void* p = a.allocate(bytes, s);
    benchmark::DoNotOptimize(std::as_const(p));  // const overload: the "+m" form handed back the address of p under GCC 12 + ASan
    a.deallocate(p, s);
  }
}

// ---- medians and ratios, collected from the same run ----
struct Median {
  std::string family;  // e.g. pair/512, random, threads/real_time/threads:2
  std::string alloc;   // e.g. size_class
  double ns;
};
std::vector<Median> g_medians;
std::vector<std::pair<std::string, double>> g_vmm;   // vmm_* benchmarks: (name, ns)
std::vector<std::pair<std::string, double>> g_pool;  // pool_* benchmarks: (name, ns)

double to_ns(double t, benchmark::TimeUnit unit) {
  switch (unit) {
    case benchmark::kNanosecond: return t;
    case benchmark::kMicrosecond: return t * 1e3;
    case benchmark::kMillisecond: return t * 1e6;
    case benchmark::kSecond: return t * 1e9;
  }
  return t;
}

class CollectingReporter final : public benchmark::ConsoleReporter {
 public:
  explicit CollectingReporter(bool all) : all_(all) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      const bool wanted = all_ ? r.run_type == Run::RT_Iteration
                               : (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median");
      if (!wanted || r.error_occurred) {
        continue;
      }
      // "pair/<alloc>/512" -> family "pair/512", alloc "<alloc>"
      const std::string name = r.run_name.str();
      if (name.starts_with("vmm_") || name.starts_with("pool_")) {  // not allocators: tables of their own
        (name.starts_with("vmm_") ? g_vmm : g_pool).emplace_back(name, to_ns(r.GetAdjustedRealTime(), r.time_unit));
        continue;
      }
      const auto a = name.find('/');
      const auto b = name.find('/', a + 1);
      if (a == std::string::npos) {
        continue;
      }
      const std::string alloc = name.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
      const std::string family = name.substr(0, a) + (b == std::string::npos ? "" : name.substr(b));
      g_medians.push_back({family, alloc, to_ns(r.GetAdjustedRealTime(), r.time_unit)});
    }
  }

 private:
  bool all_;
};

std::string us(double ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", ns / 1e3);
  return buf;
}

/// Prints (and returns as Markdown) one RATIO line per family.
std::string report_ratios() {
  std::vector<std::string> families;
  for (const Median& m : g_medians) {
    if (std::find(families.begin(), families.end(), m.family) == families.end()) {
      families.push_back(m.family);
    }
  }
  std::vector<std::string> allocs;
  for (const Median& m : g_medians) {
    if (std::find(allocs.begin(), allocs.end(), m.alloc) == allocs.end()) {
      allocs.push_back(m.alloc);
    }
  }
  std::string md = "| benchmark |";
  for (const std::string& a : allocs) {
    md += " " + a + " (us) |";
  }
  md += " torch_native / fastest ours |\n|---|";
  for (std::size_t i = 0; i < allocs.size(); ++i) {
    md += "---:|";
  }
  md += "---:|\n";
  std::printf("\n");
  for (const std::string& f : families) {
    const Median* torch = nullptr;
    const Median* best = nullptr;
    std::map<std::string, double> row;
    for (const Median& m : g_medians) {
      if (m.family != f) {
        continue;
      }
      row[m.alloc] = m.ns;
      if (m.alloc == kTorch) {
        torch = &m;
      } else if (m.alloc != kAsync && (best == nullptr || m.ns < best->ns)) {
        best = &m;
      }
    }
    md += "| " + f + " |";
    for (const std::string& a : allocs) {
      md += " " + (row.contains(a) ? us(row[a]) : std::string("-")) + " |";
    }
    if (torch != nullptr && best != nullptr && best->ns > 0) {
      const double ratio = torch->ns / best->ns;
      std::printf("RATIO %s: torch_native %s us / %s %s us = %.1fx\n", f.c_str(), us(torch->ns).c_str(),
                  best->alloc.c_str(), us(best->ns).c_str(), ratio);
      char buf[64];
      std::snprintf(buf, sizeof buf, " %.1fx (%s) |\n", ratio, best->alloc.c_str());
      md += buf;
    } else {
      md += " - |\n";
    }
  }
  if (!g_vmm.empty()) {
    md += "\nCUDA virtual-memory calls through our backend (vmm_create/N: cuMemCreate + cuMemRelease of "
          "one handle of N pages; vmm_map/N: cuMemMap + cuMemSetAccess + cuMemUnmap of it; "
          "vmm_map_run/N: N one-page handles mapped as one run, one access call, one unmap)\n\n"
          "| benchmark | us per iteration |\n|---|---:|\n";
    for (const auto& [name, ns] : g_vmm) {
      md += "| " + name + " | " + us(ns) + " |\n";
    }
  }
  if (!g_pool.empty()) {
    md += "\nStream-ordered pool calls through our backend, as policy async and the front end make them "
          "(pool_pair/N: allocate_async + free_async of N MiB on one stream, warm pool; "
          "pool_reserved_read: one cudaMemPoolGetAttribute(ReservedMemCurrent); pool_event: record + query "
          "+ give back one pooled event; pool_stream_wait: an event recorded on one stream and waited for "
          "on another)\n\n| benchmark | us per iteration |\n|---|---:|\n";
    for (const auto& [name, ns] : g_pool) {
      md += "| " + name + " | " + us(ns) + " |\n";
    }
  }
  return md;
}

}  // namespace

// ---- the CUDA virtual-memory calls behind policy defrag ------------------------------------
// What a growth or a move costs, by the size of the physical handle: cuMemCreate + cuMemRelease
// of one handle of N pages (vmm_create/N), cuMemMap + cuMemSetAccess + cuMemUnmap of one handle
// of N pages (vmm_map/N), and the same N pages as N one-page handles mapped as one run with one
// access call (vmm_map_run/N: what moving N one-page chunks costs). Through our CUDA VMM
// backend, as the policy calls it. Microseconds per iteration.
VirtualMemory& vmm() {
  static Config config;
  static std::unique_ptr<DeviceBackend> backend = make_cuda_backend("virtual_memory", 0, config);
  VirtualMemory* v = backend->virtual_memory();
  if (v == nullptr) {
    throw std::runtime_error("the virtual_memory backend has no VirtualMemory");
  }
  return *v;
}

void vmm_create(benchmark::State& state) {
  VirtualMemory& v = vmm();
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) * v.granularity();
  for (auto _ : state) {
    const PhysicalHandle h = v.create_physical(bytes);
    if (h == 0) {
      state.SkipWithError("cuMemCreate failed");
      break;
    }
    v.release_physical(h, bytes);
  }
}

void vmm_map(benchmark::State& state) {
  VirtualMemory& v = vmm();
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) * v.granularity();
  const std::uintptr_t va = v.reserve_address(bytes);
  const PhysicalHandle h = v.create_physical(bytes);
  for (auto _ : state) {
    v.map(va, bytes, h);
    v.unmap(va, bytes);
  }
  v.release_physical(h, bytes);
  v.free_address(va, bytes);
}

void vmm_map_run(benchmark::State& state) {
  VirtualMemory& v = vmm();
  const std::size_t pages = static_cast<std::size_t>(state.range(0));
  const std::size_t page = v.granularity();
  const std::uintptr_t va = v.reserve_address(pages * page);
  std::vector<MapPiece> pieces;
  for (std::size_t i = 0; i < pages; ++i) {
    pieces.push_back(MapPiece{v.create_physical(page), page});
  }
  for (auto _ : state) {
    v.map_run(va, pieces);
    v.unmap(va, pages * page);
  }
  for (const MapPiece& p : pieces) {
    v.release_physical(p.handle, page);
  }
  v.free_address(va, pages * page);
}

// ---- the stream-ordered pool calls behind policy async ------------------------------------
// What one driver call of policy async (and of the front end's cross-stream frees) costs, made
// through our CUDA stream-ordered backend exactly as the policy makes them, so that per-step
// allocator times in the e2e tables can be read as "calls x cost".
DeviceBackend& pool_backend() {
  static Config config;
  static std::unique_ptr<DeviceBackend> backend = make_cuda_backend("stream_ordered", 0, config);
  return *backend;
}
StreamOrderedMemory& pool() {
  StreamOrderedMemory* p = pool_backend().stream_ordered();
  if (p == nullptr) {
    throw std::runtime_error("the stream_ordered backend has no pool");
  }
  return *p;
}

void pool_pair(benchmark::State& state) {
  StreamOrderedMemory& p = pool();
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 20;
  const StreamId s = to_stream_id(g_streams[0]);
  for (auto _ : state) {
    void* ptr = p.allocate_async(bytes, s);
    if (ptr == nullptr) {
      state.SkipWithError("allocate_async failed");
      break;
    }
    p.free_async(ptr, s);
  }
}

void pool_reserved_read(benchmark::State& state) {
  StreamOrderedMemory& p = pool();
  std::size_t sum = 0;
  for (auto _ : state) {
    sum += p.reserved_current();
  }
  benchmark::DoNotOptimize(sum);
}

void pool_event(benchmark::State& state) {
  DeviceBackend& b = pool_backend();
  const StreamId s = to_stream_id(g_streams[0]);
  cuda_check(cudaStreamSynchronize(g_streams[0]), "cudaStreamSynchronize");
  for (auto _ : state) {
    const EventId e = b.record_event(s);
    benchmark::DoNotOptimize(b.query_event(e));
    b.destroy_event(e);
  }
}

void pool_stream_wait(benchmark::State& state) {
  DeviceBackend& b = pool_backend();
  StreamOrderedMemory& p = pool();
  const StreamId producer = to_stream_id(g_streams[0]);
  const StreamId consumer = to_stream_id(g_streams[1]);
  for (auto _ : state) {
    const EventId e = b.record_event(consumer);
    p.make_stream_wait(producer, e);
    b.destroy_event(e);
  }
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

int main(int argc, char** argv) {
  bool smoke = false;
  std::string summary_md;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) {
      smoke = true;
    } else if (std::strncmp(argv[i], "--summary-md=", 13) == 0) {
      summary_md = argv[i] + 13;
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "cachealloc-micro-cuda: micro benchmarks on the real GPU (see micro_cuda.cpp).\n"
          "  --smoke              a few iterations of each benchmark (ctest)\n"
          "  --summary-md=FILE    also write the medians and RATIO lines as Markdown\n"
          "  --benchmark_*        Google Benchmark's flags (e.g. --benchmark_filter=pair/)\n"
          "Exits 77 (skip) when no CUDA GPU is visible.\n");
      return 0;
    } else {
      args.push_back(argv[i]);
    }
  }
  if (cuda_device_count() == 0) {
    std::printf("SKIP: cachealloc-micro-cuda needs a CUDA GPU and none is visible "
                "(no driver or no device)\n");
    return 77;
  }
  try {
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    for (int i = 0; i < kMaxThreads; ++i) {
      cudaStream_t s = nullptr;
      cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      g_streams.push_back(s);
    }
    std::vector<std::string> names;
    for (const PolicyInfo& info : registered_policies()) {
      if (!info.replay_only) {
        names.emplace_back(info.name);
      }
    }
#ifdef CACHEALLOC_MICRO_WITH_TORCH
    names.emplace_back(kTorch);
#endif
    names.emplace_back(kAsync);

    auto tune = [smoke](benchmark::internal::Benchmark* b) {
      b->Unit(benchmark::kMicrosecond);
      if (smoke) {
        b->Iterations(20);
      } else {
        b->MinTime(0.05)->Repetitions(5)->ReportAggregatesOnly(true);
      }
    };
    for (const std::string& n : names) {
      auto* b = benchmark::RegisterBenchmark(("pair/" + n).c_str(), pair, n);
      for (std::int64_t bytes : {512, 65536, 1 << 20, 8 << 20, 64 << 20}) {
        b->Arg(bytes);
      }
      tune(b);
    }
    for (const std::string& n : names) {
      tune(benchmark::RegisterBenchmark(("random/" + n).c_str(), random_pattern, n));
    }
    for (const std::string& n : names) {
      auto* b = benchmark::RegisterBenchmark(("threads/" + n).c_str(), threads, n);
      b->ThreadRange(1, smoke ? 2 : kMaxThreads)->UseRealTime();
      tune(b);
    }

    {
      auto* b = benchmark::RegisterBenchmark("pool_pair", pool_pair);
      for (std::int64_t mib : {1, 8, 64}) {
        b->Arg(mib);
      }
      tune(b);
      tune(benchmark::RegisterBenchmark("pool_reserved_read", pool_reserved_read));
      tune(benchmark::RegisterBenchmark("pool_event", pool_event));
      tune(benchmark::RegisterBenchmark("pool_stream_wait", pool_stream_wait));
    }
    for (auto [name, fn] : {std::pair{"vmm_create", &vmm_create}, std::pair{"vmm_map", &vmm_map},
                            std::pair{"vmm_map_run", &vmm_map_run}}) {
      auto* b = benchmark::RegisterBenchmark(name, fn);
      for (std::int64_t pages : {1, 4, 16, 64}) {
        b->Arg(pages);
      }
      tune(b);
    }

    int n = static_cast<int>(args.size());
    benchmark::Initialize(&n, args.data());
    CollectingReporter reporter(smoke);
    benchmark::RunSpecifiedBenchmarks(&reporter);
    benchmark::Shutdown();
    const std::string md = report_ratios();
    if (!summary_md.empty()) {
      std::ofstream out(summary_md);
      out << "GPU: " << cuda_device_name(0) << "\n\n"
          << (smoke ? "smoke run (single runs, not medians)" : "median of 5 repetitions, microseconds per "
                                                               "alloc+free pair (per iteration per thread for threads/)")
          << "\n\n"
          << md;
    }
    allocators().clear();
    for (cudaStream_t s : g_streams) {
      (void)cudaStreamDestroy(s);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cachealloc-micro-cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
