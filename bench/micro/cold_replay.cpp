// cold_replay.cpp: cachealloc-cold-replay, what one alloc and one free cost per policy when the
// CPU caches were evicted between allocator calls, measured on the alloc/free sequence of a
// PyTorch memory snapshot (or a synthetic pattern) replayed on the simulated device.
//
//   cachealloc-cold-replay tests/data/traces/resnet50_train.pickle.xz --evict 0,1M,4M --repeat 5
//   cachealloc-cold-replay --synthetic -p size_class -p defrag -c defrag=keep_small_mb:4
//
// Note [Cold replay]
// Inside a PyTorch training step, kernel launches, autograd and Python run between two
// allocator calls and evict the allocator's data and code from the CPU caches, so a call costs
// the cache lines it touches far more than the instructions it runs (bench/results/
// cold_path_footprint_2026-12-03.md; the e2e runs on the H200 measured about 0.3 us per pair
// inside resnet50's step, ten times a hot pair in cachealloc-micro). This program reproduces
// that condition on the CPU alone:
//   1. The snapshot's allocations and frees of one device (the busiest, as cachealloc-replay
//      picks) become a list of operations (replay::prepare). A pass is that list, then frees of
//      every block still live, so every pass starts from the same live set. Frees that waited
//      for another stream (record_stream) are plain frees here: the time of the call is
//      measured, not when the block may be reused. Allocations keep their stream.
//   2. Each row (a policy with its CACHEALLOC_CONF settings) gets a fresh front end,
//      make_allocator(policy, SimBackend, Config) as cachealloc-micro builds it, and runs
//      --warm passes unmeasured and without eviction, to reach the steady state of a training
//      loop (segments reserved, caches filled). The simulated device runs as in
//      cachealloc-replay: its clock follows the trace's time, pass after pass, and charges the
//      H200's cost of each device call (Note [Simulated time]), so a policy that judges its page
//      moves by time (defrag) settles as it does there and on the GPU. (Before session 11 the
//      clock stood still, defrag kept moving pages in every pass, and its figures included that
//      work.)
//   3. In the --passes measured passes, before every call and outside the timed region, it
//      stores to one word per 64-byte line of --evict bytes of other memory, runs 64 KiB of
//      straight-line code (pushes the allocator's code out of a 32 KiB L1i; x86-64 only) and
//      touches the 4 KiB of stack below the loop's frame (PyTorch's caller runs on the same
//      stack, so those lines are warm in a real step). With --evict 0 nothing runs between
//      calls: the hot cost. --evict-pages B also touches one word in each 4 KiB page of B bytes
//      of other memory and jumps once through each 4 KiB page of as many bytes of generated
//      code, both kept out of transparent huge pages: that evicts the data and instruction TLBs
//      as well, as the megabytes of Python, dispatcher and driver code between two allocator
//      calls do in a real step, so that the page walks of a cold call are part of its cost
//      (Note [TLB eviction]).
//   4. Each call is timed alone: rdtsc between lfences on x86-64 (steady_clock elsewhere),
//      minus the smallest cost of an empty measurement; ticks become ns through a calibration
//      against steady_clock over the whole run.
//   5. Every row x evict size runs --repeat times, interleaved (repeat 1 of every row and size,
//      then repeat 2, ...) so that a noisy moment of a shared machine hits every row alike; the
//      table gives the median and the minimum of the per-run means.
// The figures are CPU timings of this machine: the simulated device makes no GPU call, and the
// backends' real device calls are not part of them.
#include "replay.h"

#include <cachealloc/errors.h>
#include <cachealloc/hot_pages.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/sim_backend.h>
#include <cachealloc/trace/snapshot.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

using namespace cachealloc;

namespace {

constexpr std::size_t kLineBytes = 64;          // one store per line when evicting
constexpr std::size_t kMaxEvictBytes = std::size_t{1} << 30;
constexpr std::size_t kStackWarmBytes = 4096;

// ---------------------------------------------------------------------------------------------
// The workload: what one pass replays.

struct ColdOp {
  std::uint64_t size;    // alloc: requested bytes
  StreamId stream;       // alloc: stream
  std::uint32_t slot;    // which block (index into the pointer table)
  bool is_alloc;
  std::uint64_t time_ns = 0;  // the trace's time of the call (Note [Simulated time]); 0: none
};

struct Workload {
  std::string name;               // file name of the trace, or "synthetic"
  std::vector<ColdOp> ops;        // one pass
  std::uint32_t slots = 0;
  std::uint64_t allocs = 0;       // per pass (frees per pass are the same number)
  std::uint64_t frees_at_end = 0; // frees of blocks the trace leaves live, at the end of a pass
  std::size_t streams = 0;        // distinct allocating streams
  int device = 0;
  std::uint64_t duration_ns = 0;  // the trace's time from its first to its last call
};

Workload workload_from_trace(const replay::PreparedTrace& trace, std::string name) {
  Workload w;
  w.name = std::move(name);
  w.device = trace.device;
  w.slots = trace.slots;
  std::vector<bool> live(trace.slots, false);
  std::set<StreamId> streams;
  for (const replay::Op& op : trace.ops) {
    switch (op.kind) {
      case replay::OpKind::alloc:
        w.ops.push_back({op.size, op.stream, op.slot, true, op.time_us * 1000});
        live[op.slot] = true;
        streams.insert(op.stream);
        ++w.allocs;
        break;
      case replay::OpKind::free:
      case replay::OpKind::free_deferred:  // Note [Cold replay], step 1
        if (live[op.slot]) {
          w.ops.push_back({0, 0, op.slot, false, op.time_us * 1000});
          live[op.slot] = false;
        }
        break;
      case replay::OpKind::free_completed:
        break;
    }
  }
  w.duration_ns = w.ops.empty() ? 0 : w.ops.back().time_ns;
  for (std::uint32_t slot = 0; slot < trace.slots; ++slot) {
    if (live[slot]) {
      w.ops.push_back({0, 0, slot, false, w.duration_ns});
      ++w.frees_at_end;
    }
  }
  w.streams = streams.size();
  return w;
}

/// 1,000 live blocks of 512 B << [0, 17] (512 B - 64 MiB), then 13,000 times: free a random
/// live block and allocate a new one in its place; then free them all. Fixed seed: every pass
/// and every run replays the same sequence.
Workload synthetic_workload() {
  Workload w;
  w.name = "synthetic";
  std::mt19937_64 rng(1);
  const auto size = [&rng] { return std::uint64_t{512} << (rng() % 18); };
  std::vector<std::uint32_t> live(1000);
  for (std::uint32_t& slot : live) {
    slot = w.slots++;
    w.ops.push_back({size(), 0, slot, true});
  }
  for (int i = 0; i < 13000; ++i) {
    std::uint32_t& slot = live[rng() % live.size()];
    w.ops.push_back({0, 0, slot, false});
    slot = w.slots++;
    w.ops.push_back({size(), 0, slot, true});
  }
  for (const std::uint32_t slot : live) {
    w.ops.push_back({0, 0, slot, false});
  }
  w.allocs = w.slots;
  w.frees_at_end = live.size();
  w.streams = 1;
  return w;
}

// ---------------------------------------------------------------------------------------------
// Parsing.

/// "0", "65536", "64K", "1.5M", "2G" (K/M/G binary; also KB/KiB/MB/MiB/GB/GiB, any case).
std::optional<std::size_t> parse_bytes(std::string_view text) {
  std::size_t i = 0;
  double value = 0;
  bool digits = false;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) != 0) {
    value = value * 10 + (text[i] - '0');
    digits = true;
    ++i;
  }
  if (i < text.size() && text[i] == '.') {
    ++i;
    double scale = 0.1;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) != 0) {
      value += (text[i] - '0') * scale;
      scale /= 10;
      digits = true;
      ++i;
    }
  }
  if (!digits) {
    return std::nullopt;
  }
  std::string unit;
  for (; i < text.size(); ++i) {
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  }
  double multiplier = 1;
  if (unit.empty() || unit == "b") {
    multiplier = 1;
  } else if (unit == "k" || unit == "kb" || unit == "kib") {
    multiplier = 1024.0;
  } else if (unit == "m" || unit == "mb" || unit == "mib") {
    multiplier = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gb" || unit == "gib") {
    multiplier = 1024.0 * 1024 * 1024;
  } else {
    return std::nullopt;
  }
  const double bytes = value * multiplier;
  if (bytes > static_cast<double>(kMaxEvictBytes)) {
    return std::nullopt;
  }
  return static_cast<std::size_t>(bytes);
}

/// 0, 64K, 1M, 1536K, 1000 (the shortest exact form).
std::string short_bytes(std::size_t bytes) {
  if (bytes != 0 && bytes % kMiB == 0) {
    return std::to_string(bytes / kMiB) + "M";
  }
  if (bytes != 0 && bytes % 1024 == 0) {
    return std::to_string(bytes / 1024) + "K";
  }
  return std::to_string(bytes);
}

std::string with_commas(std::uint64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) {
    s.insert(static_cast<std::size_t>(i), ",");
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Rows: a policy and its settings.

struct Row {
  std::string policy;
  std::string conf;  // CACHEALLOC_CONF entries; empty = the policy's defaults
  bool from_conf_option = false;  // a -c row (keeps its settings; see main)
};

/// The front end for `row` on a fresh simulated device, its settings checked as
/// cachealloc-replay checks them (an unknown key or a bad value throws ConfigError).
std::unique_ptr<DeviceAllocator> make_row_allocator(const Row& row) {
  SimOptions options;
  options.auto_complete_events = true;        // Note [Simulated events] (sim_backend.h)
  options.model_call_costs = true;            // as cachealloc-replay: Note [Simulated time]
  options.capacity = std::size_t{1} << 40;    // simulated: no replay runs out of memory
  Config config = Config::parse(row.conf);
  (void)config.take_string("policy");
  std::unique_ptr<DeviceAllocator> allocator =
      make_allocator(row.policy, std::make_unique<SimBackend>(options), config);
  std::vector<std::string_view> valid = front_end_config_keys();
  if (const PolicyInfo* info = find_policy(row.policy)) {
    for (const std::string_view key : info->config_keys()) {
      valid.push_back(key);
    }
  }
  config.finish("policy " + row.policy, valid);
  return allocator;
}

/// Whether the simulated backend offers what `policy` needs (every policy registered today).
bool runs_on_sim(const PolicyInfo& policy) {
  SimBackend sim;
  switch (policy.backend) {
    case BackendNeed::runtime: return true;
    case BackendNeed::virtual_memory: return sim.virtual_memory() != nullptr;
    case BackendNeed::stream_ordered: return sim.stream_ordered() != nullptr;
  }
  return false;
}

std::string registered_names() {
  std::string names;
  for (const PolicyInfo& p : registered_policies()) {
    names += names.empty() ? "" : ", ";
    names += p.name;
  }
  return names;
}

// ---------------------------------------------------------------------------------------------
// The timer (Note [Cold replay], step 4).

#if defined(__x86_64__)
constexpr const char* kTimerName = "rdtsc+lfence";
inline std::uint64_t ticks() noexcept {
  asm volatile("" ::: "memory");
  _mm_lfence();
  const std::uint64_t t = __rdtsc();
  _mm_lfence();
  asm volatile("" ::: "memory");
  return t;
}
#else
constexpr const char* kTimerName = "steady_clock (no rdtsc on this architecture)";
inline std::uint64_t ticks() noexcept {
  asm volatile("" ::: "memory");
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  const auto t = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(now).count());
  asm volatile("" ::: "memory");
  return t;
}
#endif

/// The smallest number of ticks an empty measurement takes: subtracted from every call.
std::uint64_t timer_overhead_ticks() {
  std::uint64_t best = ~std::uint64_t{0};
  for (int i = 0; i < 2000; ++i) {
    const std::uint64_t start = ticks();
    best = std::min(best, ticks() - start);
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// The eviction between calls (Note [Cold replay], step 3).

#if defined(__x86_64__) && defined(__ELF__)
// 64 KiB of code, one jump per 64-byte line: running it evicts the allocator's code from a
// 32 KiB L1i, as PyTorch's own code does between two allocator calls.
asm(R"(
  .pushsection .text
  .p2align 6
  .globl cachealloc_cold_icache_flush
  .hidden cachealloc_cold_icache_flush
  .type cachealloc_cold_icache_flush, @function
cachealloc_cold_icache_flush:
  .rept 1024
  jmp 1f
  .p2align 6
1:
  .endr
  ret
  .size cachealloc_cold_icache_flush, .-cachealloc_cold_icache_flush
  .popsection
)");
extern "C" void cachealloc_cold_icache_flush();
constexpr bool kHaveIcacheFlush = true;
#else
constexpr bool kHaveIcacheFlush = false;
#endif

/// Touches the stack below the caller's frame, where the allocator's frames will be.
[[gnu::noinline]] void warm_stack() {
  volatile char buf[kStackWarmBytes];
  for (std::size_t i = 0; i < sizeof buf; i += kLineBytes) {
    buf[i] = 0;
  }
}

// Note [TLB eviction]
// The line eviction above leaves the TLBs mostly warm: 4 MiB of stores touch 1,024 pages and the
// L1i flush 16, while the second-level TLB of a current x86 core holds 1,536-3,072 entries. In a
// training step the code between two allocator calls spans megabytes, so a cold call also pays a
// page walk for most of the pages it touches (on a virtual machine a two-dimensional one). With
// --evict-pages B, before every measured call one word of each 4 KiB page of a B-byte buffer is
// written and a chain of jumps, one per 4 KiB page of a B-byte executable mapping, is run. Both
// mappings are madvise(MADV_NOHUGEPAGE): in huge pages they would take a few TLB entries and
// evict nothing. Where an executable anonymous mapping is refused, only data pages are touched
// and the header says so.
class PageToucher {
 public:
  PageToucher() = default;
  PageToucher(const PageToucher&) = delete;
  PageToucher& operator=(const PageToucher&) = delete;
  ~PageToucher() {
    if (data_ != nullptr) {
      munmap(data_, bytes_);
    }
    if (code_ != nullptr) {
      munmap(code_, bytes_);
    }
  }

  /// Maps `bytes` (a multiple of 4 KiB, at least one page) of data and of code; false and a
  /// reason where the data mapping fails.
  bool map(std::size_t bytes, std::string& why) {
    bytes_ = bytes;
    pages_ = bytes / kPage;
    void* d = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (d == MAP_FAILED) {
      why = "mmap of " + std::to_string(bytes) + " bytes for --evict-pages failed";
      return false;
    }
    data_ = static_cast<unsigned char*>(d);
#if defined(MADV_NOHUGEPAGE)
    madvise(data_, bytes, MADV_NOHUGEPAGE);
#endif
    for (std::size_t p = 0; p < pages_; ++p) {
      data_[p * kPage] = 1;  // fault every page in now, not in the first measured call
    }
#if defined(__x86_64__)
    void* c = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (c == MAP_FAILED) {
      why = "no executable mapping (mmap failed): data pages only";
      return true;
    }
    auto* code = static_cast<unsigned char*>(c);
#if defined(MADV_NOHUGEPAGE)
    madvise(code, bytes, MADV_NOHUGEPAGE);
#endif
    for (std::size_t p = 0; p + 1 < pages_; ++p) {  // jmp rel32 to the start of the next page
      unsigned char* at = code + p * kPage;
      const auto rel = static_cast<std::int32_t>(kPage - 5);
      at[0] = 0xE9;
      std::memcpy(at + 1, &rel, sizeof rel);
    }
    code[(pages_ - 1) * kPage] = 0xC3;  // ret
    if (mprotect(code, bytes, PROT_READ | PROT_EXEC) != 0) {
      munmap(code, bytes);
      why = "no executable mapping (mprotect PROT_EXEC refused): data pages only";
      return true;
    }
    code_ = code;
#else
    why = "no generated code on this architecture: data pages only";
#endif
    return true;
  }

  [[nodiscard]] bool active() const noexcept { return pages_ != 0; }
  [[nodiscard]] bool code() const noexcept { return code_ != nullptr; }

  [[gnu::noinline]] void run() noexcept {
    for (std::size_t p = 0; p < pages_; ++p) {
      data_[p * kPage] += 1;
    }
    asm volatile("" ::: "memory");
    if (code_ != nullptr) {
      reinterpret_cast<void (*)()>(code_)();
    }
  }

  static constexpr std::size_t kPage = 4096;

 private:
  unsigned char* data_ = nullptr;
  unsigned char* code_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t pages_ = 0;
};

class Evictor {
 public:
  Evictor(std::size_t max_bytes, bool icache_flush, PageToucher& pages)
      : words_(std::max<std::size_t>(max_bytes / sizeof(std::uint64_t), 1), 0),
        icache_flush_(icache_flush && kHaveIcacheFlush),
        pages_(pages) {}

  void set_bytes(std::size_t bytes) noexcept { lines_ = bytes / kLineBytes; }
  [[nodiscard]] bool active() const noexcept { return lines_ != 0; }
  [[nodiscard]] bool icache_flush() const noexcept { return icache_flush_; }

  /// Untimed, before a measured call: the TLB eviction (--evict-pages), one store per line of
  /// the evict window, the L1i flush, the stack re-warmed.
  [[gnu::noinline]] void run() noexcept {
    if (pages_.active()) {
      pages_.run();
    }
    std::uint64_t* word = words_.data();
    constexpr std::size_t stride = kLineBytes / sizeof(std::uint64_t);
    for (std::size_t i = 0; i < lines_; ++i) {
      word[i * stride] += 1;
    }
    asm volatile("" ::: "memory");
#if defined(__x86_64__) && defined(__ELF__)
    if (icache_flush_) {
      cachealloc_cold_icache_flush();
    }
#endif
    warm_stack();
  }

 private:
  std::vector<std::uint64_t> words_;
  std::size_t lines_ = 0;
  bool icache_flush_;
  PageToucher& pages_;
};

// ---------------------------------------------------------------------------------------------
// One run: a fresh allocator, warm passes, measured passes.

// Out of line, so that a profile (perf, callgrind --toggle-collect='*measured_alloc*') finds the
// measured calls apart from the driver.
[[gnu::noinline]] void* measured_alloc(DeviceAllocator& allocator, std::size_t bytes, StreamId stream) {
  return allocator.allocate(bytes, stream);
}
[[gnu::noinline]] void measured_free(DeviceAllocator& allocator, void* ptr) {
  allocator.deallocate(ptr);
}

struct RunTicks {
  double alloc = 0;  // ticks per call, timer overhead subtracted
  double free = 0;
};

RunTicks run_once(const Row& row, const Workload& w, int warm, int passes, Evictor& evictor,
                  std::uint64_t overhead) {
  const std::unique_ptr<DeviceAllocator> owner = make_row_allocator(row);
  DeviceAllocator& allocator = *owner;
  // Note [Simulated time] (sim_backend.h): the device's clock follows the trace's, pass after
  // pass, as in cachealloc-replay, so that a policy judging its moves by time (defrag) settles
  // as it does there. Untimed.
  auto* sim = dynamic_cast<SimBackend*>(&allocator.backend());
  std::uint64_t pass_origin = 0;
  const auto follow_clock = [&](const ColdOp& op) {
    if (sim != nullptr) {
      sim->advance_clock_to(pass_origin + op.time_ns);
    }
  };
  std::vector<void*> ptrs(w.slots, nullptr);
  for (int p = 0; p < warm; ++p, pass_origin += w.duration_ns + 1) {
    for (const ColdOp& op : w.ops) {
      follow_clock(op);
      if (op.is_alloc) {
        ptrs[op.slot] = allocator.allocate(op.size, op.stream);
      } else {
        allocator.deallocate(ptrs[op.slot]);
        ptrs[op.slot] = nullptr;
      }
    }
  }
  const bool evict = evictor.active();
  std::int64_t alloc_ticks = 0;
  std::int64_t free_ticks = 0;
  for (int p = 0; p < passes; ++p, pass_origin += w.duration_ns + 1) {
    for (const ColdOp& op : w.ops) {
      follow_clock(op);
      if (evict) {
        evictor.run();
      }
      if (op.is_alloc) {
        const std::uint64_t start = ticks();
        void* ptr = measured_alloc(allocator, op.size, op.stream);
        alloc_ticks += static_cast<std::int64_t>(ticks() - start);
        ptrs[op.slot] = ptr;
      } else {
        void* ptr = ptrs[op.slot];
        const std::uint64_t start = ticks();
        measured_free(allocator, ptr);
        free_ticks += static_cast<std::int64_t>(ticks() - start);
        ptrs[op.slot] = nullptr;
      }
    }
  }
  const double calls = static_cast<double>(w.allocs) * passes;  // as many frees as allocs
  RunTicks r;
  r.alloc = static_cast<double>(alloc_ticks) / calls - static_cast<double>(overhead);
  r.free = static_cast<double>(free_ticks) / calls - static_cast<double>(overhead);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Reporting.

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double minimum(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

/// The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled ("always", "madvise",
/// "never"), or "unknown".
std::string thp_mode() {
  std::string text;
  if (std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled"); in) {
    std::getline(in, text);
  }
  const auto open = text.find('[');
  const auto close = text.find(']', open);
  if (open == std::string::npos || close == std::string::npos) {
    return "unknown";
  }
  return text.substr(open + 1, close - open - 1);
}

/// "AMD EPYC 7B13 (L1d 32K, L1i 32K, L2 1024K, L3 32768K), 2 CPUs" from /proc and /sys, as far
/// as they are readable.
std::string describe_cpu() {
  std::string model = "unknown CPU";
  if (std::ifstream in("/proc/cpuinfo"); in) {
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("model name", 0) == 0 || line.rfind("Model", 0) == 0) {
        const auto colon = line.find(':');
        if (colon != std::string::npos && colon + 2 <= line.size()) {
          model = line.substr(colon + 2);
          break;
        }
      }
    }
  }
  std::string caches;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::string level;
    std::string type;
    std::string size;
    std::ifstream(dir + "level") >> level;
    std::ifstream(dir + "type") >> type;
    std::ifstream(dir + "size") >> size;
    if (level.empty() || size.empty()) {
      break;
    }
    std::string name = "L" + level;
    if (type == "Data") {
      name += "d";
    } else if (type == "Instruction") {
      name += "i";
    }
    caches += (caches.empty() ? "" : ", ") + name + " " + size;
  }
  std::string text = model;
  if (!caches.empty()) {
    text += " (" + caches + ")";
  }
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  if (cpus > 0) {
    text += ", " + std::to_string(cpus) + " CPUs";
  }
  return text;
}

struct Cell {  // one row x evict size, over the repeats (ns)
  std::vector<double> alloc;
  std::vector<double> free;
  std::vector<double> pair;
  std::string error;
};

nlohmann::json stats_json(const std::vector<double>& v) {
  return {{"median", median(v)}, {"min", minimum(v)}, {"runs", v}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cachealloc-cold-replay: what one alloc and one free cost per policy when the CPU caches "
      "were evicted between allocator calls, as inside a PyTorch training step. Replays the "
      "alloc/free sequence of a PyTorch memory snapshot (or --synthetic) through the front end "
      "on the simulated device; before every measured call (untimed) it touches --evict bytes of "
      "other memory, runs 64 KiB of code (L1i flush, x86-64) and re-warms the stack; each call "
      "is timed alone (rdtsc+lfence on x86-64, steady_clock elsewhere), timer overhead "
      "subtracted. The figures are CPU timings of this machine."};
  std::string trace_path;
  bool synthetic = false;
  std::vector<std::string> policy_names;
  std::vector<std::string> confs;
  std::vector<std::string> evict_texts;
  int warm = 2;
  int passes = 3;
  int repeat = 3;
  bool no_iflush = false;
  std::string evict_pages_text = "0";
  std::string json_path;
  bool quiet = false;
  auto* trace_opt = app.add_option(
      "trace,--trace", trace_path,
      "the snapshot to replay (torch.cuda.memory._dump_snapshot, .pickle or .pickle.xz); its "
      "busiest device's allocations and frees make one pass");
  app.add_flag("--synthetic", synthetic,
               "replay a synthetic pattern instead of a trace: 1,000 live blocks of 512 B - 64 MiB "
               "(powers of two), 13,000 random free+alloc pairs, then free all (fixed seed)")
      ->excludes(trace_opt);
  app.add_option("--policy,-p", policy_names,
                 "policy to measure with its default settings (repeatable; default: every "
                 "registered policy that runs on the simulated backend); as in cachealloc-replay, "
                 "'native' runs with the allocator settings recorded in the trace")
      ->allow_extra_args(false);
  app.add_option("--conf,-c", confs,
                 "an extra row: a policy with CACHEALLOC_CONF settings, as POLICY=KEY:VALUE,... "
                 "(cachealloc-replay's syntax), e.g. defrag=keep_small_mb:4 (repeatable; each -c is "
                 "one more row beside the default-settings rows, so one policy can be measured "
                 "with several settings)")
      ->allow_extra_args(false);
  app.add_option("--evict", evict_texts,
                 "bytes of other memory touched (one store per 64-byte line) before every measured "
                 "call, with an optional K, M or G suffix (binary); repeatable or a comma list, "
                 "one set of rows per size; 0 = nothing runs between calls (hot caches) "
                 "(default: 0,1M)")
      ->delimiter(',')
      ->allow_extra_args(false);
  app.add_option("--warm", warm,
                 "unmeasured passes without eviction before the measured ones, per run: the steady "
                 "state of a training loop (default 2)")
      ->check(CLI::Range(0, 1000));
  app.add_option("--passes", passes, "measured passes per run (default 3)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--repeat", repeat,
                 "runs per row and evict size, interleaved across rows and sizes; the table shows "
                 "the median and the minimum of the runs' means (default 3)")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--no-iflush", no_iflush,
               "do not run the 64 KiB of code (the L1i flush) before each call; only data is evicted");
  app.add_option("--evict-pages", evict_pages_text,
                 "with every evict size above 0, also touch one word in each 4 KiB page of this "
                 "many bytes of other memory and jump through each 4 KiB page of as much generated "
                 "code (x86-64), outside huge pages: evicts the data and instruction TLBs, as a "
                 "real step does (Note [TLB eviction]); K, M or G suffix; e.g. 32M (default 0: off)")
      ->allow_extra_args(false);
  app.add_option("--json", json_path, "also write the results, every run included, as JSON to this file");
  app.add_flag("--quiet,-q", quiet, "no progress on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints the help, or the error and a hint
    return rc == 0 ? 0 : 2;
  }

  const auto fail = [](const std::string& message) {
    std::cerr << "cachealloc-cold-replay: " << message << "\n";
    return 2;
  };
  if (trace_path.empty() && !synthetic) {
    return fail("no trace given. Usage: cachealloc-cold-replay TRACE [-p POLICY]... "
                "[--evict 0,1M]..., or --synthetic (see --help)");
  }

  // The evict sizes, in the order given, each once.
  if (evict_texts.empty()) {
    evict_texts = {"0", "1M"};
  }
  std::vector<std::size_t> evicts;
  for (const std::string& text : evict_texts) {
    const std::optional<std::size_t> bytes = parse_bytes(text);
    if (!bytes) {
      return fail("--evict: '" + text + "' is not a byte count of at most 1G (examples: 0, 65536, "
                  "64K, 1M, 4M)");
    }
    if (std::find(evicts.begin(), evicts.end(), *bytes) == evicts.end()) {
      evicts.push_back(*bytes);
    }
  }

  const std::optional<std::size_t> evict_pages = parse_bytes(evict_pages_text);
  if (!evict_pages) {
    return fail("--evict-pages: '" + evict_pages_text + "' is not a byte count of at most 1G "
                "(examples: 0, 8M, 32M)");
  }
  PageToucher pages;
  std::string pages_note;
  if (*evict_pages >= PageToucher::kPage &&
      !pages.map(*evict_pages / PageToucher::kPage * PageToucher::kPage, pages_note)) {
    return fail("--evict-pages: " + pages_note);
  }

  // The rows; every one is built once here, so that a bad name or setting stops before any work.
  std::vector<Row> rows;
  if (policy_names.empty()) {
    for (const PolicyInfo& p : registered_policies()) {
      if (runs_on_sim(p)) {
        rows.push_back({std::string(p.name), ""});
      }
    }
  }
  for (const std::string& name : policy_names) {
    if (find_policy(name) == nullptr) {
      return fail("unknown policy '" + name + "'; registered policies: " + registered_names());
    }
    if (std::none_of(rows.begin(), rows.end(), [&name](const Row& r) { return r.policy == name; })) {
      rows.push_back({name, ""});
    }
  }
  for (const std::string& c : confs) {
    const auto eq = c.find('=');
    if (eq == std::string::npos || eq == 0) {
      return fail("--conf expects POLICY=KEY:VALUE,..., got '" + c + "'");
    }
    const std::string name = c.substr(0, eq);
    if (find_policy(name) == nullptr) {
      return fail("--conf " + c + ": unknown policy '" + name + "'; registered policies: " +
                  registered_names());
    }
    rows.push_back({name, c.substr(eq + 1), true});
  }
  const auto check_rows = [&rows]() -> std::optional<std::string> {
    try {
      for (const Row& row : rows) {
        (void)make_row_allocator(row);
      }
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::nullopt;
  };
  if (const std::optional<std::string> error = check_rows()) {
    return fail(*error);
  }

  Workload workload;
  try {
    if (synthetic) {
      workload = synthetic_workload();
    } else {
      const trace::Snapshot snapshot = trace::read_snapshot(trace_path);
      const std::string name = trace_path.substr(trace_path.find_last_of('/') + 1);
      workload = workload_from_trace(replay::prepare(snapshot, name), name);
      // As in cachealloc-replay: the native model runs with the settings the trace recorded.
      for (Row& row : rows) {
        if (row.policy == "native" && !row.from_conf_option) {
          row.conf = replay::native_conf_from_settings(snapshot.settings);
        }
      }
    }
  } catch (const trace::TraceError& e) {
    return fail(std::string("cannot read the trace: ") + e.what());
  } catch (const std::exception& e) {
    return fail(std::string("cannot read the trace '") + trace_path + "': " + e.what());
  }
  if (const std::optional<std::string> error = check_rows()) {  // native's recorded settings
    return fail(*error);
  }
  if (workload.allocs == 0) {
    return fail("the trace '" + trace_path + "' has no allocations on device " +
                std::to_string(workload.device));
  }

  std::ofstream json_out;
  if (!json_path.empty()) {
    json_out.open(json_path);
    if (!json_out) {
      return fail("cannot write --json file '" + json_path + "'");
    }
  }

  // Measure: repeat-major, so that every row and size sees the same moments of the machine.
  const auto clock_start = std::chrono::steady_clock::now();
  const std::uint64_t ticks_start = ticks();
  const std::uint64_t overhead = timer_overhead_ticks();
  Evictor evictor(*std::max_element(evicts.begin(), evicts.end()), !no_iflush, pages);
  // Per row and evict size; ticks until the calibration below turns them into ns.
  std::vector<std::vector<Cell>> cells(rows.size(), std::vector<Cell>(evicts.size()));
  const bool progress = !quiet && isatty(STDERR_FILENO) != 0;
  const std::size_t total_runs = static_cast<std::size_t>(repeat) * rows.size() * evicts.size();
  std::size_t done = 0;
  for (int r = 0; r < repeat; ++r) {
    for (std::size_t e = 0; e < evicts.size(); ++e) {
      evictor.set_bytes(evicts[e]);
      for (std::size_t i = 0; i < rows.size(); ++i) {
        Cell& cell = cells[i][e];
        ++done;
        if (progress) {
          std::fprintf(stderr, "\rrun %zu/%zu: %-11s evict %-6s repeat %d/%d   ", done, total_runs,
                       rows[i].policy.c_str(), short_bytes(evicts[e]).c_str(), r + 1, repeat);
        }
        if (!cell.error.empty()) {
          continue;
        }
        try {
          const RunTicks t = run_once(rows[i], workload, warm, passes, evictor, overhead);
          cell.alloc.push_back(t.alloc);
          cell.free.push_back(t.free);
        } catch (const std::exception& ex) {
          cell.error = ex.what();
        }
      }
    }
  }
  if (progress) {
    std::fprintf(stderr, "\r%60s\r", "");
  }
  // Calibrate ticks against steady_clock over the whole run (at least 100 ms of it).
  while (std::chrono::steady_clock::now() - clock_start < std::chrono::milliseconds(100)) {
  }
  const std::uint64_t ticks_end = ticks();
  const double elapsed_ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - clock_start).count();
  const double ns_per_tick = elapsed_ns / static_cast<double>(ticks_end - ticks_start);
  for (std::vector<Cell>& row_cells : cells) {
    for (Cell& cell : row_cells) {
      for (std::size_t k = 0; k < cell.alloc.size(); ++k) {
        cell.alloc[k] *= ns_per_tick;
        cell.free[k] *= ns_per_tick;
        cell.pair.push_back(cell.alloc[k] + cell.free[k]);
      }
    }
  }

  // The table. Note [Bookkeeping on few pages] (hot_pages.h): where the rows' bookkeeping lived,
  // read once (it parses /proc/self/smaps) for the header and the JSON.
  const std::string cpu = describe_cpu();
  const hot::Usage bookkeeping = hot::usage();
  const std::string thp = thp_mode();
  std::printf("cachealloc-cold-replay on %s\n", cpu.c_str());
  if (synthetic) {
    std::printf("workload synthetic: %s allocs and %s frees per pass (%s of them at the end of "
                "the pass), 1 stream\n",
                with_commas(workload.allocs).c_str(), with_commas(workload.allocs).c_str(),
                with_commas(workload.frees_at_end).c_str());
  } else {
    std::printf("trace %s, device %d: %s allocs and %s frees per pass (%s of them at the end of "
                "the pass, for blocks the trace leaves live), %zu stream%s\n",
                workload.name.c_str(), workload.device, with_commas(workload.allocs).c_str(),
                with_commas(workload.allocs).c_str(), with_commas(workload.frees_at_end).c_str(),
                workload.streams, workload.streams == 1 ? "" : "s");
  }
  std::printf("runs: a fresh allocator each, %d warm pass%s (no eviction), then %d measured; "
              "%d run%s per row and evict size, interleaved\n",
              warm, warm == 1 ? "" : "es", passes, repeat, repeat == 1 ? "" : "s");
  std::printf("eviction before every measured call (evict > 0), untimed: one store per 64-byte line "
              "of the evict bytes%s, 4 KiB of stack re-warmed\n",
              evictor.icache_flush() ? ", 64 KiB of code run (L1i)"
                                     : (no_iflush ? " (no L1i flush: --no-iflush)"
                                                  : " (no L1i flush on this architecture)"));
  if (pages.active()) {
    std::printf("TLB eviction (--evict-pages %s): one store per 4 KiB page of %s of data%s%s%s; "
                "transparent huge pages on this machine: %s\n",
                evict_pages_text.c_str(), short_bytes(*evict_pages).c_str(),
                pages.code() ? ", one jump per 4 KiB page of as much code" : "",
                pages_note.empty() ? "" : " -- ", pages_note.c_str(), thp.c_str());
  }
#if defined(__x86_64__)
  std::printf("timer: %s, TSC %.3f GHz, overhead %.1f ns per measurement (subtracted)\n",
              kTimerName, 1.0 / ns_per_tick, static_cast<double>(overhead) * ns_per_tick);
#else
  std::printf("timer: %s, overhead %.1f ns per measurement (subtracted)\n", kTimerName,
              static_cast<double>(overhead) * ns_per_tick);
#endif
  std::printf("bookkeeping (CACHEALLOC_HOT_PAGES=%s): %zu region%s of 2 MiB, %s on huge pages\n",
              hot::mode_name(bookkeeping.mode), bookkeeping.regions, bookkeeping.regions == 1 ? "" : "s",
              bookkeeping.huge_bytes_known ? short_bytes(bookkeeping.huge_bytes).c_str() : "unknown");
  std::printf("note: CPU timings of this machine (simulated device, no GPU call); ns per call, "
              "median and min of the runs' means\n");
  std::size_t conf_width = 6;
  for (const Row& row : rows) {
    conf_width = std::max(conf_width, row.conf.size());
  }
  const int cw = static_cast<int>(conf_width);
  std::printf("%-11s %-*s %6s %17s %17s %17s\n", "", cw, "", "", "alloc ns", "free ns", "pair ns");
  std::printf("%-11s %-*s %6s %8s %8s %8s %8s %8s %8s\n", "policy", cw, "config", "evict",
              "median", "min", "median", "min", "median", "min");
  bool any_failed = false;
  for (std::size_t e = 0; e < evicts.size(); ++e) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Cell& cell = cells[i][e];
      const std::string conf = rows[i].conf.empty() ? "-" : rows[i].conf;
      if (!cell.error.empty() || cell.alloc.empty()) {
        std::printf("%-11s %-*s %6s failed: %s\n", rows[i].policy.c_str(), cw, conf.c_str(),
                    short_bytes(evicts[e]).c_str(), cell.error.c_str());
        any_failed = true;
        continue;
      }
      std::printf("%-11s %-*s %6s %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f\n", rows[i].policy.c_str(), cw,
                  conf.c_str(), short_bytes(evicts[e]).c_str(), median(cell.alloc),
                  minimum(cell.alloc), median(cell.free), minimum(cell.free), median(cell.pair),
                  minimum(cell.pair));
    }
  }

  if (!json_path.empty()) {
    nlohmann::json j;
    j["cpu"] = cpu;
    j["workload"] = synthetic ? std::string("synthetic") : trace_path;
    j["device"] = workload.device;
    j["allocs_per_pass"] = workload.allocs;
    j["frees_per_pass"] = workload.allocs;
    j["frees_at_end_of_pass"] = workload.frees_at_end;
    j["warm_passes"] = warm;
    j["measured_passes"] = passes;
    j["repeat"] = repeat;
    j["icache_flush"] = evictor.icache_flush();
    j["evict_pages_bytes"] = pages.active() ? *evict_pages : 0;
    j["evict_pages_code"] = pages.code();
    j["transparent_hugepage"] = thp;
    j["hot_pages"] = {{"mode", hot::mode_name(bookkeeping.mode)},
                      {"regions", bookkeeping.regions},
                      {"huge_bytes", bookkeeping.huge_bytes_known ? nlohmann::json(bookkeeping.huge_bytes)
                                                                  : nlohmann::json()}};
    j["timer"] = kTimerName;
    j["ns_per_tick"] = ns_per_tick;
    j["timer_overhead_ns"] = static_cast<double>(overhead) * ns_per_tick;
    j["rows"] = nlohmann::json::array();
    for (std::size_t e = 0; e < evicts.size(); ++e) {
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Cell& cell = cells[i][e];
        nlohmann::json row = {{"policy", rows[i].policy}, {"conf", rows[i].conf},
                              {"evict_bytes", evicts[e]}};
        if (!cell.error.empty() || cell.alloc.empty()) {
          row["error"] = cell.error;
        } else {
          row["alloc_ns"] = stats_json(cell.alloc);
          row["free_ns"] = stats_json(cell.free);
          row["pair_ns"] = stats_json(cell.pair);
        }
        j["rows"].push_back(row);
      }
    }
    json_out << j.dump(2) << "\n";
    json_out.close();
    if (!json_out) {
      return fail("cannot write --json file '" + json_path + "'");
    }
  }
  return any_failed ? 1 : 0;
}
