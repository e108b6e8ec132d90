// micro.cpp: Google Benchmark micro benchmarks of the allocator's own cost, per policy.
//
//   pair/<policy>/<bytes>     a cached alloc+free pair of one size on one stream
//   random/<policy>           random free+alloc over 1,000 live blocks of 512 B - 32 MiB
//   holes/<policy>/<holes>    alloc+free of sizes that fit no hole exactly, with N free holes
//                             cached, 32 sizes in turn so that no recently-freed FIFO serves them
//                             (best-fit search cost must stay flat as holes grow: O(log n))
//   threads/<policy>          alloc+free pairs from 1, 2, 4, 8 threads on one allocator
//   parked/<policy>/<n>       a cached 64 KiB alloc+free pair on stream 0 while n frees wait,
//                             parked, for a busy stream 1 (record_stream), as an offloading job's
//                             activations wait for its copy stream: every allocation polls them,
//                             so this shows what the poll costs as the parked frees grow (it must
//                             stay flat: Note [Parked frees by stream], allocator.h)
//   cold/<policy>             a cached 64 KiB alloc+free pair after the CPU caches were flushed
//                             (32 MiB of other data touched, untimed): what a call costs inside
//                             a training step, where kernel launches and autograd run between
//                             allocator calls (Note [Cold calls])
//
// Note [Cold calls]
// In the e2e runs on the H200 every one of our policies spent 0.3-0.4 us per allocator call
// inside resnet50's training step (cachealloc:size_class: 770 us per step for 1,212 pairs, with
// no device call at all), 3-4x what pair/ measures with warm caches. cold/ measures the other
// extreme, every line the pair touches coming from memory (manual timing of the pair alone; the
// flush is outside the measurement): on the 2-core development machine a 64 KiB pair took
// 3.2 us (size_class), 3.5 (native), 4.1 (async) and 4.9 (defrag) cold against 43-73 ns warm,
// that is 40-60 cache lines from memory per pair. That count is what makes calls costly inside
// a training step, and what a cheaper front end has to bring down.
//
// Run with --smoke (a ctest target does) for a tiny run that only proves they still work.
#include <cachealloc/policies/registry.h>
#include <cachealloc/sim_backend.h>

#include <benchmark/benchmark.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace cachealloc;

namespace {

std::unique_ptr<DeviceAllocator> make(const std::string& policy) {
  SimOptions o;
  o.auto_complete_events = true;
  o.capacity = std::size_t{1} << 40;  // simulated: room for 64k holes of a few MiB
  Config c;
  return make_allocator(policy, std::make_unique<SimBackend>(o), c);
}

void pair(benchmark::State& state, const std::string& policy) {
  auto a = make(policy);
  const auto bytes = static_cast<std::size_t>(state.range(0));
  a->deallocate(a->allocate(bytes, 0));  // warm the cache
  for (auto _ : state) {
    void* p = a->allocate(bytes, 0);
    benchmark::DoNotOptimize(std::as_const(p));  // const overload: the "+m" form handed back the address of p under GCC 12 + ASan
    a->deallocate(p);
  }
}

void random_pattern(benchmark::State& state, const std::string& policy) {
  auto a = make(policy);
  std::mt19937_64 rng(1);
  auto size = [&] { return std::size_t{512} << (rng() % 17); };  // 512 B .. 32 MiB
  std::vector<void*> live(1000);
  for (void*& p : live) {
    p = a->allocate(size(), 0);
  }
  std::vector<std::size_t> sizes(4096);
  std::vector<std::size_t> picks(4096);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    sizes[i] = size();
    picks[i] = rng() % live.size();
  }
  std::size_t i = 0;
  for (auto _ : state) {
    const std::size_t k = picks[i & 4095];
    a->deallocate(live[k]);
    live[k] = a->allocate(sizes[i & 4095], 0);
    ++i;
  }
  for (void* p : live) {
    a->deallocate(p);
  }
}

void holes(benchmark::State& state, const std::string& policy) {
  auto a = make(policy);
  const auto n = static_cast<std::size_t>(state.range(0));
  // 2n blocks of distinct large sizes; freeing every other one leaves n holes that cannot merge.
  std::vector<void*> blocks;
  for (std::size_t i = 0; i < 2 * n; ++i) {
    blocks.push_back(a->allocate((2 << 20) + (i % 1024) * 4096, 0));
  }
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    a->deallocate(blocks[i]);
  }
  // Probe sizes that fit no hole exactly (holes are even multiples of 4 KiB above 2 MiB) and
  // rotate through more sizes than any policy's recently-freed FIFO holds (at most 16), so every
  // request misses that FIFO and searches the free set (a single repeated size measured the
  // FIFO, not the search, for size_class and async).
  std::array<std::size_t, 32> probes{};
  for (std::size_t k = 0; k < probes.size(); ++k) {
    probes[k] = (2 << 20) + (301 + 22 * k) * 4096;
  }
  std::size_t k = 0;
  for (auto _ : state) {
    void* p = a->allocate(probes[k++ & 31], 0);
    benchmark::DoNotOptimize(std::as_const(p));  // const overload: the "+m" form handed back the address of p under GCC 12 + ASan
    a->deallocate(p);
  }
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    a->deallocate(blocks[i]);
  }
}

void cold(benchmark::State& state, const std::string& policy) {
  auto a = make(policy);
  constexpr std::size_t kBytes = 64 * 1024;
  a->deallocate(a->allocate(kBytes, 0));  // warm the cache of the allocator, once
  std::vector<std::uint64_t> other(std::size_t{32} << 17);  // 32 MiB: more than L2, most of L3
  std::uint64_t sum = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < other.size(); i += 8) {  // one word per 64-byte line
      other[i] += ++sum;
    }
    benchmark::ClobberMemory();
    const auto start = std::chrono::steady_clock::now();
    void* p = a->allocate(kBytes, 0);
    benchmark::DoNotOptimize(std::as_const(p));
    a->deallocate(p);
    const auto stop = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(stop - start).count());
  }
  benchmark::DoNotOptimize(sum);
}

void parked(benchmark::State& state, const std::string& policy) {
  SimOptions o;
  o.capacity = std::size_t{1} << 40;
  auto backend = std::make_unique<SimBackend>(o);
  SimBackend& sim = *backend;
  Config c;
  auto a = make_allocator(policy, std::move(backend), c);
  constexpr StreamId kCopy = 1;
  sim.set_auto_complete(true);
  sim.hold_stream(kCopy);  // its work never finishes while the benchmark runs
  const auto n = static_cast<std::size_t>(state.range(0));
  for (std::size_t i = 0; i < n; ++i) {
    void* p = a->allocate((std::size_t{1} << 20) + 4096 * i, 0);
    a->record_stream(p, kCopy);
    a->deallocate(p);  // parked until kCopy's event completes
  }
  if (a->pending_frees() != n) {
    state.SkipWithError("the frees were not parked");
    return;
  }
  constexpr std::size_t kBytes = 64 * 1024;
  a->deallocate(a->allocate(kBytes, 0));
  for (auto _ : state) {
    void* p = a->allocate(kBytes, 0);
    benchmark::DoNotOptimize(std::as_const(p));
    a->deallocate(p);
  }
  sim.release_stream(kCopy);
}

/// One shared allocator per policy, built before any benchmark thread starts (creating it inside
/// the benchmark raced with the other threads' first iterations).
std::map<std::string, std::unique_ptr<DeviceAllocator>>& shared_allocators() {
  static std::map<std::string, std::unique_ptr<DeviceAllocator>> all;
  return all;
}

void threads(benchmark::State& state, const std::string& policy) {
  DeviceAllocator& shared = *shared_allocators().at(policy);
  for (auto _ : state) {
    void* p = shared.allocate(4096 + 512 * static_cast<std::size_t>(state.thread_index()),
                              static_cast<StreamId>(state.thread_index()));
    benchmark::DoNotOptimize(std::as_const(p));  // const overload: the "+m" form handed back the address of p under GCC 12 + ASan
    shared.deallocate(p);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) {
      smoke = true;
    } else {
      args.push_back(argv[i]);
    }
  }
  for (const PolicyInfo& info : registered_policies()) {
    const std::string p(info.name);
    auto* b = benchmark::RegisterBenchmark(("pair/" + p).c_str(), pair, p);
    for (std::int64_t bytes : {512, 65536, 1 << 20, 8 << 20, 64 << 20}) {
      b->Arg(bytes);
    }
    benchmark::RegisterBenchmark(("random/" + p).c_str(), random_pattern, p);
    auto* h = benchmark::RegisterBenchmark(("holes/" + p).c_str(), holes, p);
    for (std::int64_t n : {1000, 4000, 16000, 64000}) {
      if (!smoke || n == 1000) {
        h->Arg(n);
      }
    }
    // A fixed count: the flush (about 2 ms) is not timed, so a minimum time would run for hours.
    benchmark::RegisterBenchmark(("cold/" + p).c_str(), cold, p)->UseManualTime()->Iterations(smoke ? 3 : 1000);
    auto* pk = benchmark::RegisterBenchmark(("parked/" + p).c_str(), parked, p);
    for (std::int64_t n : {0, 16, 128, 1024}) {
      if (!smoke || n == 16) {
        pk->Arg(n);
      }
    }
    shared_allocators()[p] = make(p);
    benchmark::RegisterBenchmark(("threads/" + p).c_str(), threads, p)->ThreadRange(1, 8)->UseRealTime();
    if (smoke) {
      b->Iterations(100);
    }
  }
  if (smoke) {
    static char min_time[] = "--benchmark_min_time=0.001";
    args.push_back(min_time);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
