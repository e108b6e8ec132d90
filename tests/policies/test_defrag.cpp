// test_defrag.cpp: policy `defrag` on the simulated device: packing, page moves, stream safety
// (checked by an oracle backend that knows what each stream's queued work touches), settings,
// failures, adversarial patterns and fixed-seed randomized sequences checked after every step.
#include <cachealloc/allocator.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/defrag.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/sim_backend.h>

// The engine's private header, for its index key (Note [One word ranks a hole]).
#include "defrag_engine.h"  // policies/src is on the include path of cachealloc_tests

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <sstream>
#include <vector>

using namespace cachealloc;

namespace {

constexpr std::size_t MiB = kMiB;

#ifndef CACHEALLOC_CHECK_LEVEL
#define CACHEALLOC_CHECK_LEVEL 2
#endif

DefragSettings settings_from(const std::string& text) {
  Config config = Config::parse(text);
  DefragSettings s = DefragPolicy::parse_settings(config);
  config.finish("defrag", DefragPolicy::config_keys());
  return s;
}

std::uintptr_t addr_of(const Block& b) { return reinterpret_cast<std::uintptr_t>(b.ptr); }

bool overlap(std::uintptr_t a, std::size_t an, std::uintptr_t b, std::size_t bn) {
  return a < b + bn && b < a + an;
}

/// The front end with defrag's default settings on a simulated device whose events complete as
/// soon as they are recorded.
struct SimFrontEnd {
  SimFrontEnd() : SimFrontEnd(std::make_unique<SimBackend>(SimOptions{.auto_complete_events = true})) {}
  explicit SimFrontEnd(std::unique_ptr<SimBackend> backend)
      : sim(backend.get()), allocator(std::move(backend), config) {}
  Config config;
  SimBackend* sim;
  CachingAllocator<DefragPolicy> allocator;
};

/// A backend without virtual memory (cudaMalloc only).
class RuntimeOnlyBackend final : public DeviceBackend {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "runtime-only"; }
  [[nodiscard]] int device() const noexcept override { return 0; }
  [[nodiscard]] std::size_t total_memory() const override { return kGiB; }
  [[nodiscard]] std::size_t free_memory() const override { return kGiB; }
  [[nodiscard]] EventId record_event(StreamId) override { return 1; }
  [[nodiscard]] bool query_event(EventId) override { return true; }
  void synchronize_event(EventId) override {}
  void destroy_event(EventId) noexcept override {}

 private:
  [[nodiscard]] void* do_reserve(std::size_t) override { return nullptr; }
  void do_release(void*, std::size_t) noexcept override {}
};

/// The stream-use oracle. Memory calls go to an inner SimBackend (which checks the mapping
/// rules); streams are modelled here: the test says which address ranges each stream's queued
/// work touches (use) and when a stream's work finished (complete). An event recorded on a
/// stream completes once the work queued before it did; waiting for an event finishes that
/// work (as cudaEventSynchronize returns only then). Unmapping a range that unfinished work
/// touches is recorded as a violation; the test checks new blocks against the same uses.
class OracleBackend final : public DeviceBackend, private VirtualMemory {
 public:
  explicit OracleBackend(std::size_t capacity)
      : inner_(SimOptions{.capacity = capacity, .granularity = 2 * MiB}), vm_(*inner_.virtual_memory()) {
    attach(*this);
  }

  [[nodiscard]] std::string_view name() const noexcept override { return "oracle"; }
  [[nodiscard]] int device() const noexcept override { return 0; }
  [[nodiscard]] std::size_t total_memory() const override { return inner_.total_memory(); }
  [[nodiscard]] std::uint64_t clock_ns() const noexcept override { return inner_.clock_ns(); }
  [[nodiscard]] std::size_t free_memory() const override { return inner_.free_memory(); }
  [[nodiscard]] VirtualMemory* virtual_memory() noexcept override { return this; }

  [[nodiscard]] EventId record_event(StreamId stream) override {
    maybe_fail();
    const EventId id = next_event_++;
    events_[id] = {stream, submitted_[stream]};
    return id;
  }
  [[nodiscard]] bool query_event(EventId event) override {
    maybe_fail();
    const auto& [stream, seq] = events_.at(event);
    return completed_[stream] >= seq;
  }
  void synchronize_event(EventId event) override {
    maybe_fail();
    const auto& [stream, seq] = events_.at(event);
    completed_[stream] = std::max(completed_[stream], seq);
    ++waits_;
  }
  void destroy_event(EventId event) noexcept override { events_.erase(event); }

  /// Work queued on `stream` now touches [va, va + bytes).
  void use(StreamId stream, std::uintptr_t va, std::size_t bytes) {
    uses_.push_back({stream, ++submitted_[stream], va, bytes});
  }
  /// All work queued on `stream` so far finished.
  void complete(StreamId stream) { completed_[stream] = submitted_[stream]; }
  /// True when unfinished work (of a stream other than `except`, unless `any`) touches
  /// [va, va + bytes).
  [[nodiscard]] bool busy(std::uintptr_t va, std::size_t bytes, StreamId except, bool any) const {
    for (const Use& u : uses_) {
      if ((any || u.stream != except) && u.seq > completed(u.stream) &&
          overlap(u.va, u.bytes, va, bytes)) {
        return true;
      }
    }
    return false;
  }
  [[nodiscard]] std::uint64_t completed(StreamId stream) const {
    auto it = completed_.find(stream);
    return it == completed_.end() ? 0 : it->second;
  }
  /// Forgets finished work (keeps the checks fast).
  void prune() {
    std::erase_if(uses_, [&](const Use& u) { return u.seq <= completed_[u.stream]; });
  }
  /// The next device event call throws DeviceError (fault injection for event calls).
  void fail_next_event_call() { fail_event_ = true; }
  void clear_faults() {
    fail_event_ = false;
    inner_.clear_faults();
  }

  [[nodiscard]] SimBackend& inner() noexcept { return inner_; }
  [[nodiscard]] const std::vector<std::string>& violations() const noexcept { return violations_; }
  [[nodiscard]] std::uint64_t waits() const noexcept { return waits_; }

 private:
  struct Use {
    StreamId stream;
    std::uint64_t seq;
    std::uintptr_t va;
    std::size_t bytes;
  };
  void maybe_fail() {
    if (fail_event_) {
      fail_event_ = false;
      throw DeviceError("oracle: injected event failure");
    }
  }
  [[nodiscard]] void* do_reserve(std::size_t) override { return nullptr; }
  void do_release(void*, std::size_t) noexcept override {}
  [[nodiscard]] std::size_t granularity() const noexcept override { return vm_.granularity(); }
  [[nodiscard]] std::uintptr_t reserve_address(std::size_t bytes) override {
    return vm_.reserve_address(bytes);
  }
  void free_address(std::uintptr_t va, std::size_t bytes) noexcept override {
    vm_.free_address(va, bytes);
  }
  [[nodiscard]] PhysicalHandle do_create_physical(std::size_t bytes) override {
    return vm_.create_physical(bytes);
  }
  void do_release_physical(PhysicalHandle handle, std::size_t bytes) noexcept override {
    vm_.release_physical(handle, bytes);
  }
  void do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) override {
    vm_.map(va, bytes, handle);
  }
  void do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces) override {
    vm_.map_run(va, pieces);
  }
  void do_unmap(std::uintptr_t va, std::size_t bytes) override {
    if (busy(va, bytes, 0, /*any=*/true)) {
      violations_.push_back("unmapped [" + std::to_string(va) + ", +" + std::to_string(bytes) +
                            ") while a stream's work on it was unfinished");
    }
    vm_.unmap(va, bytes);
  }

  SimBackend inner_;
  VirtualMemory& vm_;
  std::map<EventId, std::pair<StreamId, std::uint64_t>> events_;
  std::map<StreamId, std::uint64_t> submitted_;
  std::map<StreamId, std::uint64_t> completed_;
  std::vector<Use> uses_;
  std::vector<std::string> violations_;
  EventId next_event_ = 1;
  std::uint64_t waits_ = 0;
  bool fail_event_ = false;
};

/// The front end over defrag on the stream-use oracle, with `conf` (CACHEALLOC_CONF text).
struct OracleFrontEnd {
  explicit OracleFrontEnd(const std::string& conf, std::size_t capacity = 4 * kGiB)
      : OracleFrontEnd(std::make_unique<OracleBackend>(capacity), Config::parse(conf)) {}
  OracleBackend& oracle;
  CachingAllocator<DefragPolicy> a;

  /// Allocates `bytes` on `own`, uses them there and on `other` (record_stream) and frees them:
  /// the front end parks the block until `other` completes. Returns its address.
  std::uintptr_t park(std::size_t bytes, StreamId own, StreamId other) {
    void* p = a.allocate(bytes, own);
    const auto va = reinterpret_cast<std::uintptr_t>(p);
    oracle.use(own, va, bytes);
    a.record_stream(p, other);
    oracle.use(other, va, bytes);
    a.deallocate(p);
    return va;
  }

 private:
  OracleFrontEnd(std::unique_ptr<OracleBackend> owned, Config config)
      : oracle(*owned), a(std::move(owned), config) {}
};

/// A policy on its own simulated device (no front end), checked after every call.
struct Fixture {
  explicit Fixture(const std::string& conf = "", std::size_t capacity = 8 * kGiB,
                   bool auto_complete = true, bool unmap_after_streams = true)
      : sim(sim_options(capacity, auto_complete, unmap_after_streams)),
        policy(sim, settings_from(conf)) {}
  static SimOptions sim_options(std::size_t capacity, bool auto_complete, bool unmap_after_streams) {
    SimOptions o{0, capacity, 2 * MiB, auto_complete};
    o.unmap_after_streams = unmap_after_streams;
    return o;
  }
  Block alloc(std::size_t bytes, StreamId stream = 0) {
    Block b = policy.allocate(bytes, stream);
    check();
    if (b) {
      CHECK(sim.is_mapped(addr_of(b), b.size));
    }
    return b;
  }
  void free(Block b, StreamId stream = 0) {
    policy.deallocate(b, stream);
    check();
  }
  void check() const {
    policy.check_invariants();
    // Pages moved from a hole the stream may still use stay mapped at their old address too
    // until its work is done (Note [Moving pages a stream still uses]).
    CHECK(sim.mapped_bytes_now() - sim.pending_unmap_bytes() == policy.reserved_bytes());
  }
  [[nodiscard]] std::size_t free_holes() const {
    std::size_t n = 0;
    policy.visit_segments([&](const SegmentView& s) {
      for (const BlockView& b : s.blocks) {
        n += b.allocated ? 0 : 1;
      }
    });
    return n;
  }
  SimBackend sim;
  DefragPolicy policy;
};

/// The oracle's counterpart of Fixture: every free first queues work on the block's stream.
struct OracleFixture {
  explicit OracleFixture(const std::string& conf = "grow_slack:0", std::size_t capacity = 4 * kGiB)
      : backend(capacity), policy(backend, settings_from(conf)) {}
  Block alloc(std::size_t bytes, StreamId stream) {
    Block b = policy.allocate(bytes, stream);
    if (b) {
      INFO("block of " << bytes << " on stream " << stream);
      CHECK_FALSE(backend.busy(addr_of(b), b.size, stream, /*any=*/false));
      CHECK(backend.inner().is_mapped(addr_of(b), b.size));
    }
    check();
    return b;
  }
  /// A kernel on `stream` uses the block, then the block is freed (still in use).
  void use_and_free(Block b, StreamId stream) {
    backend.use(stream, addr_of(b), b.size);
    policy.deallocate(b, stream);
    check();
  }
  void check() const {
    policy.check_invariants();
    CHECK(backend.violations().empty());
  }
  OracleBackend backend;
  DefragPolicy policy;
};

/// Peak reserved / peak requested of a workload run through the front end on a simulated device
/// whose streams keep up (tick() between operations, as the replay does).
struct Ratio {
  double value;
  std::uint64_t maps;
};

class Workload {
 public:
  /// `host_ns_per_call` > 0: the simulated clock runs, each call taking that long on the host,
  /// and device calls cost what they cost on an H200 (Note [Simulated time], sim_backend.h).
  /// `gpu_lag_ns` > 0: the GPU finishes each stream's work that long after the host queued it
  /// (SimOptions::event_lag_ns), so waiting for a stream costs host time.
  explicit Workload(const std::string& conf = "", std::uint64_t host_ns_per_call = 0,
                    std::uint64_t gpu_lag_ns = 0)
      : config_(Config::parse(conf)),
        // Designated: positional, the lag once initialized the call costs that SimOptions
        // gained before event_lag_ns (session 23), and the test of the GPU lag ran with none.
        allocator_(std::make_unique<SimBackend>(SimOptions{.device = 0,
                                                           .capacity = 64 * kGiB,
                                                           .granularity = 2 * MiB,
                                                           .auto_complete_events = gpu_lag_ns != 0,
                                                           .model_call_costs = host_ns_per_call != 0,
                                                           .event_lag_ns = gpu_lag_ns}),
                   config_),
        host_ns_per_call_(host_ns_per_call) {
    sim_ = static_cast<SimBackend*>(&allocator_.backend());
  }
  void* alloc(std::size_t bytes, StreamId stream = 0) {
    advance();
    sim_->tick();
    void* p = allocator_.allocate(bytes, stream);
    sizes_[p] = bytes;
    requested_ += bytes;
    peak_requested_ = std::max(peak_requested_, requested_);
    step();
    return p;
  }
  void free(void* p) {
    advance();
    sim_->tick();
    requested_ -= sizes_.at(p);
    sizes_.erase(p);
    allocator_.deallocate(p);
    step();
  }
  [[nodiscard]] Ratio ratio() const {
    const Stats s = allocator_.stats();
    return {static_cast<double>(s.reserved_bytes.peak) / static_cast<double>(peak_requested_),
            s.num_maps};
  }
  [[nodiscard]] std::uint64_t maps() const { return allocator_.stats().num_maps; }
  /// The block is also used on `stream` (torch's record_stream): its free waits for that work.
  void record(void* p, StreamId stream) { allocator_.record_stream(p, stream); }
  CachingAllocator<DefragPolicy>& allocator() { return allocator_; }
  /// The host does something else for `ns` (with a running clock): no allocator call.
  void idle(std::uint64_t ns) {
    host_ns_ += ns;
    sim_->advance_clock_to(host_ns_);
  }

 private:
  void step() {
    if (CACHEALLOC_CHECK_LEVEL >= 2 || ++steps_ % 64 == 0) {
      allocator_.check_invariants();
    }
  }
  void advance() {
    host_ns_ += host_ns_per_call_;
    sim_->advance_clock_to(host_ns_);
  }
  Config config_;
  CachingAllocator<DefragPolicy> allocator_;
  std::uint64_t host_ns_per_call_ = 0;
  std::uint64_t host_ns_ = 0;
  SimBackend* sim_ = nullptr;
  std::unordered_map<void*, std::size_t> sizes_;
  std::size_t requested_ = 0;
  std::size_t peak_requested_ = 1;
  std::uint64_t steps_ = 0;
};

/// One step of the time-budget tests' workload: 300 small blocks (256 KiB-2.25 MiB), then two
/// large ones whose split of 258 MiB is drawn at random, so pages move at a few growths per
/// step; half the small blocks die mid-step. `alloc` allocates through `w` (and may watch).
template <typename Alloc>
void random_shape_step(Workload& w, std::mt19937_64& rng, Alloc&& alloc) {
  std::vector<void*> acts;
  for (int i = 0; i < 300; ++i) {
    acts.push_back(alloc(256 * kKiB + rng() % (2 * MiB)));
  }
  const std::size_t big = (8 + rng() % 56) * 4 * MiB;
  void* a = alloc(big);
  void* b = alloc(256 * MiB - big + 2 * MiB);
  for (std::size_t i = 0; i < acts.size(); i += 2) {
    w.free(acts[i]);
  }
  w.free(a);
  void* c = alloc(big + 6 * MiB);
  w.free(b);
  w.free(c);
  for (std::size_t i = 1; i < acts.size(); i += 2) {
    w.free(acts[i]);
  }
}

/// Eight 64 MiB weights, then `steps` of random_shape_step (`before_step(step)` first in each),
/// then the weights freed: the job of the time-budget tests.
void random_shape_job(Workload& w, int steps, const std::function<void(int)>& before_step = {}) {
  std::mt19937_64 rng(5);
  std::vector<void*> weights;
  for (int i = 0; i < 8; ++i) {
    weights.push_back(w.alloc(64 * MiB));
  }
  for (int step = 0; step < steps; ++step) {
    if (before_step) {
      before_step(step);
    }
    random_shape_step(w, rng, [&](std::size_t bytes) { return w.alloc(bytes); });
  }
  for (void* p : weights) {
    w.free(p);
  }
}

}  // namespace

// ============================================================================ settings

TEST_CASE("defrag: needs a backend with virtual memory", "[defrag][config]") {
  RuntimeOnlyBackend backend;
  Config config;
  CHECK_THROWS_WITH(DefragPolicy(backend, config),
                    Catch::Contains("policy defrag needs a backend with CUDA virtual memory"));
}

TEST_CASE("defrag: settings come from CACHEALLOC_CONF and are validated", "[defrag][config]") {
  const DefragSettings d = settings_from("");
  CHECK(d.grow_slack == 0.01);
  CHECK(d.small_size == 1 * MiB);  // Note [Which requests are small]
  CHECK(d.wait_for_streams);
  CHECK(d.va_reserve_bytes == 0);
  const DefragSettings s =
      settings_from("va_reserve_gb:0.5,grow_slack:0.005,small_size:64KB,wait_for_streams:False");
  CHECK(s.va_reserve_bytes == 512 * MiB);
  CHECK(s.grow_slack == 0.005);
  CHECK(s.small_size == 64 * kKiB);
  CHECK_FALSE(s.wait_for_streams);
  CHECK(settings_from("small_size:0").small_size == 0);
  CHECK_THROWS_AS(settings_from("grow_slack:2"), ConfigError);
  CHECK_THROWS_AS(settings_from("grow_slack:-0.1"), ConfigError);
  CHECK_THROWS_AS(settings_from("va_reserve_gb:0"), ConfigError);
  CHECK_THROWS_AS(settings_from("small_size:2GB"), ConfigError);
  CHECK_THROWS_AS(settings_from("wait_for_streams:maybe"), ConfigError);
  CHECK_THROWS_WITH(settings_from("grow_slak:0.1"), Catch::Contains("grow_slack"));
  CHECK(d.max_chunk_bytes == kGiB);
  CHECK(settings_from("max_chunk_mb:2").max_chunk_bytes == 2 * MiB);
  CHECK_THROWS_AS(settings_from("max_chunk_mb:0"), ConfigError);
  CHECK(d.max_grow_slack == 0.2);
  CHECK(settings_from("grow_slack:0.3").max_grow_slack == 0.3);  // never below grow_slack
  CHECK(settings_from("max_grow_slack:0.01").max_grow_slack == 0.01);
  CHECK(d.move_budget == 0.02);
  CHECK(d.coalesce_map_ns == 200'000);
  CHECK(settings_from("coalesce_map_us:0").coalesce_map_ns == 0);
  CHECK(settings_from("coalesce_map_us:1.5").coalesce_map_ns == 1'500);
  CHECK_THROWS_AS(settings_from("coalesce_map_us:-1"), ConfigError);
  CHECK_THROWS_AS(settings_from("coalesce_map_us:fast"), ConfigError);
  CHECK(settings_from("move_budget:1").move_budget == 1.0);
  CHECK_THROWS_AS(settings_from("move_budget:-0.1"), ConfigError);
  CHECK_THROWS_AS(settings_from("move_budget:2"), ConfigError);
  CHECK(d.keep_small_bytes == 0);
  CHECK(settings_from("keep_small_mb:32").keep_small_bytes == 32 * MiB);
  CHECK_THROWS_AS(settings_from("keep_small_mb:-1"), ConfigError);
  CHECK_FALSE(d.move_pending);
  CHECK(settings_from("move_pending:True").move_pending);
  CHECK_THROWS_AS(settings_from("move_pending:often"), ConfigError);
  CHECK(d.pending_on_waits);
  CHECK_FALSE(settings_from("pending_on_waits:False").pending_on_waits);
  CHECK_THROWS_AS(settings_from("pending_on_waits:sometimes"), ConfigError);
  CHECK(d.avoid_queued_unmaps);
  CHECK_FALSE(settings_from("avoid_queued_unmaps:False").avoid_queued_unmaps);
  CHECK_THROWS_AS(settings_from("avoid_queued_unmaps:2"), ConfigError);
  CHECK(d.stream_ranges);
  CHECK_FALSE(settings_from("stream_ranges:False").stream_ranges);
  CHECK_THROWS_AS(settings_from("stream_ranges:own"), ConfigError);
  CHECK_FALSE(d.slack_counts_parked);  // Note [Frees in flight and the slack]
  CHECK(settings_from("slack_counts_parked:True").slack_counts_parked);
  CHECK_THROWS_AS(settings_from("slack_counts_parked:parked"), ConfigError);
  CHECK(d.top_at_limit);  // Note [Growing at the top once moves cost too much at the limit]
  CHECK_FALSE(settings_from("top_at_limit:False").top_at_limit);
  CHECK_THROWS_AS(settings_from("top_at_limit:top"), ConfigError);
  const auto keys = DefragPolicy::config_keys();
  CHECK(keys.size() == 15);
}

TEST_CASE("defrag: keep_small_mb keeps freed small blocks for their stream and size",
          "[defrag][keep_small]") {
  Fixture f("keep_small_mb:1");
  const Block a = f.alloc(4096, 7);
  const Block b = f.alloc(4096, 7);
  const Block s9 = f.alloc(4096, 9);
  f.free(s9, 9);
  f.free(a, 7);
  CHECK(f.policy.breakdown().kept_bytes == 2 * 4096);
  CHECK(f.free_holes() >= 2);  // the front end's view: a kept block is free
  // Each stream gets back its own block of that size, without a search.
  const std::uint64_t hits = f.policy.counters().recent_hits;
  const Block other = f.alloc(4096, 9);
  CHECK(other.ptr == s9.ptr);
  const Block again = f.alloc(4096, 7);
  CHECK(again.ptr == a.ptr);
  CHECK(f.policy.counters().recent_hits == hits + 2);
  CHECK(f.policy.breakdown().kept_bytes == 0);
  const Block bigger = f.alloc(8192, 7);
  // No more than keep_small_mb stays kept: the rest is freed as usual.
  std::vector<Block> many;
  for (int i = 0; i < 300; ++i) {
    many.push_back(f.alloc(8 * kKiB, 7));
  }
  for (const Block& m : many) {
    f.free(m, 7);
  }
  CHECK(f.policy.breakdown().kept_bytes <= MiB);
  CHECK(f.policy.breakdown().kept_bytes > 0);
  // A request that would make memory grow first merges every kept block.
  const std::uint64_t flushes = f.policy.counters().recent_flushes;
  const Block large = f.alloc(64 * MiB, 7);
  CHECK(f.policy.counters().recent_flushes == flushes + 1);
  CHECK(f.policy.breakdown().kept_bytes == 0);
  for (const Block& x : {b, other, bigger, again, large}) {
    f.free(x, x.ptr == other.ptr ? 9 : 7);
  }
  CHECK(f.policy.release_cached() > 0);
  CHECK(f.policy.breakdown().kept_bytes == 0);
  CHECK(f.policy.reserved_bytes() == 0);
}

TEST_CASE("defrag: a growth creates about sixteen chunks, mapped as one run", "[defrag]") {
  SECTION("default: 64 MiB in 16 chunks of two pages") {
    Fixture f;
    const Block b = f.alloc(64 * MiB);
    CHECK(f.policy.counters().pages_created == 32);
    CHECK(f.policy.counters().chunks_created == 16);
    CHECK(f.sim.counters().map_calls == 16);
    f.free(b);
    CHECK(f.policy.release_cached() == 64 * MiB);
    f.check();
    CHECK(f.sim.live_physical() == 0);
  }
  SECTION("max_chunk_mb at the page size: one handle per page") {
    Fixture f("max_chunk_mb:2");
    const Block b = f.alloc(64 * MiB);
    CHECK(f.policy.counters().chunks_created == 32);
    f.free(b);
    f.check();
  }
  SECTION("a chunk moves whole, only when no live byte lies on it") {
    Fixture f("grow_slack:0");
    const Block a = f.alloc(64 * MiB);  // 16 chunks of 2 pages
    const Block keep = f.alloc(3 * MiB);  // shares a's last page... and pins nothing of a's
    f.free(a);
    f.sim.complete_all();
    const std::uint64_t moved = f.policy.counters().chunks_moved;
    const Block big = f.alloc(100 * MiB);  // needs pages beyond the slack: a's chunks move
    CHECK(f.policy.counters().chunks_moved > moved);
    f.check();
    f.free(big);
    f.free(keep);
    f.check();
  }
}

// Note [Coalescing moved chunks while maps are dear] (defrag_grow.cpp).
TEST_CASE("defrag: while maps are dear, a growth maps the chunks it gathered as one new handle",
          "[defrag][coalesce]") {
  SECTION("forced (coalesce_map_us:0): five moved chunks become one, the surplus goes back") {
    // The device holds exactly the ten blocks: the new handle can only be created once the
    // moved chunks are unmapped and released, never beside them.
    Fixture f("grow_slack:0,coalesce_map_us:0", 200 * MiB);
    std::vector<Block> blocks;
    for (int i = 0; i < 10; ++i) {
      blocks.push_back(f.alloc(20 * MiB));  // each growth makes one chunk of 10 pages
    }
    CHECK(f.policy.counters().chunks_created == 10);
    CHECK(f.policy.reserved_bytes() == 200 * MiB);
    for (int i = 0; i < 10; i += 2) {
      f.free(blocks[i]);  // five free holes of one chunk each; their stream is done (auto_complete)
    }
    const DefragCounters before = f.policy.counters();
    const std::uint64_t maps_before = f.sim.counters().map_calls;
    const Block big = f.alloc(90 * MiB);
    REQUIRE(big);
    const DefragCounters after = f.policy.counters();
    CHECK(after.chunks_moved - before.chunks_moved == 5);
    CHECK(after.chunks_coalesced - before.chunks_coalesced == 5);
    CHECK(after.coalesced_growths - before.coalesced_growths == 1);
    CHECK(f.sim.counters().map_calls - maps_before == 1);  // one handle of 45 pages
    CHECK(f.policy.reserved_bytes() == 190 * MiB);  // the five pages nobody needs went back
    CHECK(f.sim.held_bytes() == 190 * MiB);
    CHECK(f.sim.live_physical() == 6);  // the five blocks' chunks and the new one
    f.free(big);
    for (int i = 1; i < 10; i += 2) {
      f.free(blocks[i]);
    }
    f.policy.release_cached();
    f.check();
    CHECK(f.sim.live_physical() == 0);
  }
  SECTION("by cost: the simulated device's maps at 1 ms each turn it on, at 55 us they do not") {
    const bool dear = GENERATE(true, false);
    CAPTURE(dear);
    SimOptions o{0, 8 * kGiB, 2 * MiB, /*auto_complete_events=*/true};
    o.model_call_costs = true;
    o.costs.map_ns = dear ? 1'000'000 : 55'000;
    SimBackend sim(o);
    DefragPolicy policy(sim, settings_from("grow_slack:0"));
    std::vector<Block> blocks;
    for (int i = 0; i < 10; ++i) {
      blocks.push_back(policy.allocate(20 * MiB, 0));
    }
    for (int i = 0; i < 10; i += 2) {
      policy.deallocate(blocks[i], 0);
    }
    const std::uint64_t maps_before = sim.counters().map_calls;
    const Block big = policy.allocate(90 * MiB, 0);
    REQUIRE(big);
    policy.check_invariants();
    CHECK((policy.counters().coalesced_growths > 0) == dear);
    // Cheap maps: every moved chunk (five per 20 MiB block) mapped on its own.
    CHECK((sim.counters().map_calls - maps_before == 1) == dear);
    policy.deallocate(big, 0);
    for (int i = 1; i < 10; i += 2) {
      policy.deallocate(blocks[i], 0);
    }
    policy.release_cached();
    policy.check_invariants();
    CHECK(sim.live_physical() == 0);
  }
}

TEST_CASE("defrag: a growth beyond the slack counts the free pages that could not move, and why",
          "[defrag]") {
  // Note [Why pages were created beyond the slack].
  Fixture f("grow_slack:0");
  const Block x = f.alloc(64 * MiB);  // 16 chunks of two pages at [0, 64 MiB)
  const Block z = f.alloc(2 * MiB);   // [64, 66 MiB): the hole below it ends on a chunk's end
  REQUIRE(addr_of(z) == addr_of(x) + 64 * MiB);
  f.free(x);
  const Block y = f.alloc(2 * MiB);  // the first page of chunk 0: its second page cannot move
  REQUIRE(addr_of(y) == addr_of(x));
  CHECK(f.policy.counters().beyond_slack_growths == 0);
  // 100 MiB: 19 pages within the slack (peak live 104 MiB, 66 held), 30 moved (chunks 1-15),
  // and the last one created beyond the slack while chunk 0's free page stays under y's chunk.
  const Block big = f.alloc(100 * MiB);
  const DefragCounters c = f.policy.counters();
  CHECK(c.pages_moved == 30);
  CHECK(c.beyond_slack_growths == 1);
  CHECK(c.beyond_slack_pages == 1);
  CHECK(c.stuck_pinned_pages == 1);
  CHECK(c.stuck_beside_pages == 0);
  CHECK(c.stuck_unsafe_pages == 0);
  CHECK(c.stuck_other_pages == 0);
  f.free(big);
  f.free(y);
  f.free(z);
  f.check();
}

// ============================================================================ placement

TEST_CASE("defrag: blocks are packed and share the pages at their edges", "[defrag]") {
  Fixture f;
  std::vector<Block> blocks;
  std::size_t total = 0;
  for (int i = 0; i < 5; ++i) {
    blocks.push_back(f.alloc(3 * MiB + 512));
    total += 3 * MiB + 512;
    if (i > 0) {
      CHECK(addr_of(blocks[i]) == addr_of(blocks[i - 1]) + blocks[i - 1].size);  // packed
    }
  }
  CHECK(f.policy.reserved_bytes() == round_up(total, 2 * MiB));  // 8 pages, not 5 x 2 pages
  CHECK(f.policy.live_bytes() == total);
  for (const Block& b : blocks) {
    f.free(b);
  }
  CHECK(f.free_holes() == 1);  // coalesced back into one hole
}

TEST_CASE("defrag: small requests share pages in their own address range", "[defrag]") {
  Fixture f;
  const Block big = f.alloc(5 * MiB);
  std::vector<Block> small;
  for (int i = 0; i < 1000; ++i) {
    small.push_back(f.alloc(1000));
    CHECK(small.back().size == 1024);
    CHECK(addr_of(small.back()) % 512 == 0);
  }
  CHECK(f.policy.reserved_bytes() == 3 * 2 * MiB + 2 * MiB);  // 3 pages + 1 page for 1000 x 1 KiB
  for (const Block& b : small) {
    CHECK_FALSE(overlap(addr_of(b), b.size, addr_of(big) & ~(2 * MiB - 1), 6 * MiB));
  }
  // With small_size:0 every size shares one range.
  Fixture g("small_size:0");
  const Block a = g.alloc(3 * MiB);
  const Block b = g.alloc(1000);
  CHECK(addr_of(b) == addr_of(a) + a.size);
  CHECK(g.policy.reserved_bytes() == 2 * 2 * MiB);
}

TEST_CASE("defrag: a cross-stream free whose own stream also finished comes back settled, one "
          "whose own stream is still busy is never handed to another stream", "[defrag][streams]") {
  // Note [Frees that come back settled] (allocator.h), through the front end over the stream-use
  // oracle. A 40 MiB block of stream 1, used by kernels on streams 1 and 2 (record_stream), is
  // freed; stream 2 finishes. Then stream 3 asks for 40 MiB with no slack: the freed block's
  // memory is all there is without growing.
  const bool own_done = GENERATE(true, false);
  CAPTURE(own_done);
  OracleFrontEnd f("grow_slack:0");
  OracleBackend& oracle = f.oracle;
  CachingAllocator<DefragPolicy>& a = f.a;
  void* keep = a.allocate(20 * MiB, 1);
  const std::uintptr_t va = f.park(40 * MiB, 1, 2);
  CHECK(a.pending_frees() == 1);
  oracle.complete(2);
  if (own_done) {
    oracle.complete(1);
  }
  const std::int64_t reserved = a.stats().reserved_bytes.current;
  void* q = a.allocate(40 * MiB, 3);  // polls the parked free first
  CHECK(a.pending_frees() == 0);
  const auto qa = reinterpret_cast<std::uintptr_t>(q);
  CHECK_FALSE(oracle.busy(qa, 40 * MiB, 3, /*any=*/false));  // nothing else still uses it
  CHECK(oracle.violations().empty());
  if (own_done) {
    // Settled: every stream is done with it, so stream 3 takes that memory as it is.
    CHECK(a.stats().reserved_bytes.current == reserved);
    CHECK(a.policy().counters().pages_created == static_cast<std::uint64_t>(reserved) / (2 * MiB));
  } else {
    // Stream 1's kernel may still run on it: stream 3 gets other memory.
    CHECK_FALSE(overlap(qa, 40 * MiB, va, 40 * MiB));
    CHECK(a.stats().reserved_bytes.current > reserved);
  }
  a.check_invariants();
  oracle.complete(1);
  oracle.complete(3);
  a.deallocate(q);
  a.deallocate(keep);
  a.check_invariants();
  CHECK(oracle.violations().empty());
}

TEST_CASE("defrag: pages under free holes move where memory is needed", "[defrag]") {
  // The frees are this stream's and its work is not done (auto_complete off). With move_pending
  // and a backend that unmaps after the stream (the simulated device's default, as cuda_vmm's)
  // the pages move at once and their old mappings go when the stream's work is done (Note
  // [Moving pages a stream still uses]); without, the policy waits for the stream once.
  const bool after_streams = GENERATE(true, false);
  CAPTURE(after_streams);
  Fixture f("grow_slack:0,move_pending:True", 8 * kGiB, /*auto_complete=*/false, after_streams);
  std::vector<Block> blocks;
  for (int i = 0; i < 10; ++i) {
    blocks.push_back(f.alloc(20 * MiB));
  }
  CHECK(f.policy.reserved_bytes() == 200 * MiB);
  for (int i = 0; i < 10; i += 2) {
    f.free(blocks[i]);  // five holes of 20 MiB, no hole fits 90 MiB
  }
  const DefragCounters before = f.policy.counters();
  const Block big = f.alloc(90 * MiB);
  REQUIRE(big);
  const DefragCounters after = f.policy.counters();
  CHECK(after.pages_moved - before.pages_moved >= 40);
  CHECK(after.pages_created - before.pages_created <= 5);
  CHECK(f.policy.reserved_bytes() <= 200 * MiB);  // peak live is 190 MiB: no growth
  if (after_streams) {
    CHECK(after.stream_waits == before.stream_waits);
    CHECK(after.pages_moved_pending - before.pages_moved_pending ==
          after.pages_moved - before.pages_moved);
    CHECK(f.sim.pending_unmaps() == 5);  // mapped twice until the stream gets there
    f.sim.complete_stream(0);
    CHECK(f.sim.pending_unmaps() == 0);
    f.check();
  } else {
    CHECK(after.stream_waits - before.stream_waits == 1);  // the frees were this stream's: one wait
    CHECK(after.pages_moved_pending == 0);
  }
  CHECK(f.sim.counters().unmap_calls == 5);  // one unmap call per hole
  // The same counters reach the front end's stats (memory_stats() in PyTorch) as defrag.*.
  std::map<std::string, std::int64_t> m;
  for (const auto& [k, v] : f.policy.stat_counters()) {
    m[k] = v;
  }
  CHECK(m.at("defrag.pages_moved") == static_cast<std::int64_t>(after.pages_moved));
  CHECK(m.at("defrag.chunks_moved") == static_cast<std::int64_t>(after.chunks_moved));
  CHECK(m.at("defrag.stream_waits") == static_cast<std::int64_t>(after.stream_waits));
  CHECK(m.at("defrag.pages_created") == static_cast<std::int64_t>(after.pages_created));
  CHECK(m.at("defrag.move_ns") == static_cast<std::int64_t>(after.move_ns));
  CHECK(m.at("defrag.wait_ns") == static_cast<std::int64_t>(after.wait_ns));
  CHECK(m.at("defrag.slack_ppm") == 0);
  CHECK(m.at("defrag.return_raises") == 0);
  CHECK(m.at("defrag.slack_returns") == 0);
  CHECK(m.at("defrag.pages_moved_pending") == static_cast<std::int64_t>(after.pages_moved_pending));
  CHECK(m.at("defrag.beyond_slack_pages") == static_cast<std::int64_t>(after.beyond_slack_pages));
  CHECK(m.at("defrag.stuck_pinned_pages") == static_cast<std::int64_t>(after.stuck_pinned_pages));
  CHECK(m.at("defrag.placed_past_queued") == static_cast<std::int64_t>(after.placed_past_queued));
  CHECK(m.at("defrag.placed_above_queued") == static_cast<std::int64_t>(after.placed_above_queued));
  CHECK(m.at("defrag.placed_at_top") == static_cast<std::int64_t>(after.placed_at_top));
  CHECK(m.at("defrag.placed_top_at_limit") == 0);  // the slack never reached its limit here
  CHECK(m.at("defrag.pending_switches") == 0);  // move_pending was set, not switched to
  CHECK(m.at("defrag.held_growths") == 0);      // no front end held its growth
  CHECK(m.at("defrag.coalesced_growths") == 0);  // maps are not dear here
  CHECK(m.at("defrag.stuck_unsafe_other_pages") == static_cast<std::int64_t>(after.stuck_unsafe_other_pages));
  CHECK(m.size() == 31);
}

TEST_CASE("defrag: a growth is placed away from a range whose unmap still waits for its stream",
          "[defrag]") {
  // Note [Placing away from queued unmaps]: pages moved from holes the stream's work may still
  // use leave unmapped holes whose unmaps wait for that work; a map into one would wait too.
  // Opt-in: without avoid_queued_unmaps the 20 MiB block below goes into one of them.
  const bool avoid = GENERATE(true, false);
  CAPTURE(avoid);
  Fixture f(std::string("grow_slack:0,move_pending:True,avoid_queued_unmaps:") + (avoid ? "True" : "False"),
            8 * kGiB, /*auto_complete=*/false);
  std::vector<Block> blocks;
  for (int i = 0; i < 10; ++i) {
    blocks.push_back(f.alloc(20 * MiB));
  }
  std::vector<std::pair<std::uintptr_t, std::size_t>> freed;
  for (int i = 0; i < 10; i += 2) {
    freed.emplace_back(addr_of(blocks[i]), blocks[i].size);
    f.free(blocks[i]);
  }
  const Block big = f.alloc(90 * MiB);  // moves the five holes' pages, their unmaps queued
  REQUIRE(big);
  REQUIRE(f.sim.pending_unmaps() == 5);
  for (const auto& [va, bytes] : freed) {
    CHECK(f.sim.queued_unmap_end(va, bytes) == va + bytes);
  }
  // 20 MiB more: the five unmapped 20 MiB holes fit it best, but each still waits for the stream.
  const DefragCounters before = f.policy.counters();
  const Block next = f.alloc(20 * MiB);
  REQUIRE(next);
  if (!avoid) {
    CHECK(f.policy.counters().placed_past_queued == before.placed_past_queued);
    const auto in_freed = [&](std::uintptr_t a) {
      return std::any_of(freed.begin(), freed.end(),
                         [&](const auto& r) { return overlap(a, next.size, r.first, r.second); });
    };
    CHECK(in_freed(addr_of(next)));  // the best fit, whose unmap ran first (the map waited)
    f.free(next);
    return;
  }
  CHECK(f.policy.counters().placed_past_queued == before.placed_past_queued + 1);
  for (const auto& [va, bytes] : freed) {
    // No map waited for (and so ran) one of them.
    CHECK(f.sim.queued_unmap_end(va, bytes) == va + bytes);
    CHECK_FALSE(overlap(addr_of(next), next.size, va, bytes));
  }
  f.sim.complete_stream(0);
  CHECK(f.sim.pending_unmaps() == 0);
  for (const auto& [va, bytes] : freed) {
    CHECK(f.sim.queued_unmap_end(va, bytes) == 0);
  }
  // Once the unmaps ran, those holes are fits like any other.
  const Block again = f.alloc(20 * MiB);
  REQUIRE(again);
  CHECK(f.policy.counters().placed_past_queued == before.placed_past_queued + 1);
  f.check();
}

TEST_CASE("defrag: the front end's stats carry the policy's counters as defrag.*", "[defrag]") {
  Workload w;
  void* a = w.alloc(20 * MiB);
  void* b = w.alloc(20 * MiB);
  w.free(a);
  const std::map<std::string, std::int64_t> m = w.allocator().stats().to_map();
  const DefragCounters c = w.allocator().policy().counters();
  CHECK(m.at("defrag.pages_created") == static_cast<std::int64_t>(c.pages_created));
  CHECK(m.at("defrag.pages_created") > 0);
  CHECK(m.at("defrag.grow_allocations") == static_cast<std::int64_t>(c.grow_allocations));
  CHECK(m.at("defrag.slack_ppm") == 10'000);  // the default grow_slack, 0.01
  CHECK(m.count("num_maps") == 1);            // beside the front end's own keys
  w.free(b);
}

TEST_CASE("defrag: grow_slack lets memory grow before pages move", "[defrag]") {
  Fixture f("grow_slack:0.5");
  const Block a = f.alloc(20 * MiB);
  const Block b = f.alloc(20 * MiB);
  f.free(a);
  const Block c = f.alloc(30 * MiB);  // peak live 50 MiB allows 75 MiB: no page moves
  CHECK(f.policy.counters().pages_moved == 0);
  CHECK(f.policy.reserved_bytes() == 70 * MiB);
  f.free(b);
  f.free(c);
}

TEST_CASE("defrag: a repeating training loop maps nothing in steady state", "[defrag]") {
  Workload w;
  std::mt19937_64 rng(7);
  std::vector<std::size_t> shapes;
  for (int i = 0; i < 60; ++i) {
    shapes.push_back(512 + rng() % (48 * MiB));
  }
  std::vector<void*> params;
  for (int i = 0; i < 20; ++i) {
    params.push_back(w.alloc(shapes[i] / 4 + 4096));
  }
  std::uint64_t maps_after_warmup = 0;
  for (int step = 0; step < 12; ++step) {
    std::vector<void*> acts;
    for (std::size_t s : shapes) {
      acts.push_back(w.alloc(s));
      if (acts.size() % 7 == 0) {
        w.free(w.alloc(s * 2));  // a temporary
      }
    }
    while (!acts.empty()) {  // backward: gradients appear as activations die
      void* g = w.alloc(shapes[acts.size() % shapes.size()] / 3 + 512);
      w.free(acts.back());
      acts.pop_back();
      w.free(g);
    }
    if (step == 2) {
      maps_after_warmup = w.maps();
    }
  }
  CHECK(w.maps() == maps_after_warmup);
  CHECK(w.ratio().value <= 1.02);
  for (void* p : params) {
    w.free(p);
  }
}

TEST_CASE("defrag: with two streams, epochs close while the policy misses and stop once it "
          "settles", "[defrag][streams]") {
  // Note [Epochs on demand] (defrag.cpp): a loop of two streams that finds every block in a
  // mapped hole records no event; the first miss after that closes epochs again.
  SimFrontEnd f;
  CachingAllocator<DefragPolicy>& a = f.allocator;
  SimBackend* sim = f.sim;
  const StreamId main_stream = 1;
  const StreamId side = 2;
  const auto step = [&](std::size_t batch_mib) {
    void* input = a.allocate(batch_mib * MiB, side);  // the next batch, made on the side stream
    std::vector<void*> acts;
    for (int layer = 0; layer < 12; ++layer) {
      acts.push_back(a.allocate((batch_mib + static_cast<std::size_t>(layer % 3)) * MiB, main_stream));
    }
    a.deallocate(input);
    while (!acts.empty()) {
      a.deallocate(acts.back());
      acts.pop_back();
    }
  };
  const auto events = [&] { return sim->counters().events_recorded; };
  for (int i = 0; i < 4; ++i) {
    step(8);
  }
  const std::uint64_t settled = events();
  const std::uint64_t maps = a.stats().num_maps;
  for (int i = 0; i < 20; ++i) {
    step(8);
  }
  CHECK(a.stats().num_maps == maps);  // no miss: every block found a mapped hole...
  CHECK(events() == settled);         // ...and no epoch closed
  step(20);                           // larger batches miss
  step(20);
  CHECK(a.stats().num_maps > maps);
  CHECK(events() >= settled + 2);     // the miss closed one, then every 8 frees closed one more
  a.check_invariants();
}

// ============================================================================ streams

TEST_CASE("defrag: pages a busy stream may still use are never unmapped or handed out",
          "[defrag][streams]") {
  OracleFixture f;
  const StreamId s1 = 1;
  const StreamId s2 = 2;
  Block a = f.alloc(40 * MiB, s1);
  f.use_and_free(a, s1);  // a kernel on s1 still reads the hole

  // s2 must not get a's memory (its address range or its pages) while s1 is busy.
  Block b = f.alloc(40 * MiB, s2);
  REQUIRE(b);
  CHECK_FALSE(overlap(addr_of(a), a.size, addr_of(b), b.size));
  CHECK(f.policy.counters().pages_moved == 0);
  CHECK(f.backend.waits() == 0);  // never blocks on another stream's work
  CHECK(f.policy.reserved_bytes() == 80 * MiB);

  // Once s1 finished, its hole serves s2 without new memory.
  f.backend.complete(s1);
  Block c = f.alloc(40 * MiB, s2);
  CHECK(addr_of(c) == addr_of(a));
  CHECK(f.policy.reserved_bytes() == 80 * MiB);
  f.use_and_free(b, s2);
  f.use_and_free(c, s2);
}

TEST_CASE("defrag: each stream places its growths in address ranges of its own",
          "[defrag][streams]") {
  // Note [Address ranges of their own for streams]: a side stream's block does not land between
  // the main stream's blocks, so the main stream's holes stay whole; pages still move between
  // the ranges.
  const bool own = GENERATE(true, false);
  INFO((own ? "stream_ranges:True" : "stream_ranges:False"));
  OracleFixture f(own ? "grow_slack:0" : "grow_slack:0,stream_ranges:False");
  const StreamId main = 1;
  const StreamId side = 2;
  Block a = f.alloc(40 * MiB, main);
  Block x = f.alloc(30 * MiB, side);
  Block b = f.alloc(40 * MiB, main);
  const auto inside = [](const Block& blk, std::uintptr_t lo, std::uintptr_t hi) {
    return addr_of(blk) >= lo && addr_of(blk) + blk.size <= hi;
  };
  if (own) {
    CHECK(addr_of(b) == addr_of(a) + a.size);
    CHECK_FALSE(inside(x, addr_of(a), addr_of(b) + b.size));
  } else {
    CHECK(addr_of(x) == addr_of(a) + a.size);  // one range: x between a and b
    CHECK(addr_of(b) == addr_of(x) + x.size);
  }
  CHECK(f.policy.reserved_bytes() == 110 * MiB);
  // x's pages serve the main stream once the side stream is done with them: a block too large
  // for x's hole moves its pages (grow_slack 0: no new memory below the peak).
  f.use_and_free(x, side);
  Block tiny = f.alloc(64 * kKiB, side);  // a miss: the epoch of x's free closes
  f.backend.complete(side);
  const std::uint64_t moved = f.policy.counters().pages_moved;
  Block c = f.alloc(34 * MiB, main);  // a new peak of 114 MiB: 2 pages new, the rest x's
  REQUIRE(c);
  CHECK(f.policy.counters().pages_moved - moved >= 14);  // whole chunks of x's 15 pages
  CHECK(f.policy.reserved_bytes() == 114 * MiB + 2 * MiB);  // with tiny's small-range page
  if (own) {
    CHECK(addr_of(c) == addr_of(b) + b.size);  // in the main stream's range, after b
  }
  f.use_and_free(tiny, side);
  f.use_and_free(a, main);
  f.use_and_free(b, main);
  f.use_and_free(c, main);
}

TEST_CASE("defrag: streams after the eighth share the eighth's address ranges", "[defrag][streams]") {
  OracleFixture f("grow_slack:1");  // new pages for every growth: nothing moves
  std::vector<std::pair<Block, StreamId>> blocks;
  for (StreamId s = 1; s <= cachealloc::detail::kStreamRanges + 1; ++s) {  // classes 0 to 8
    blocks.emplace_back(f.alloc(4 * MiB, s), s);
  }
  // Classes 0-7 each start a range of their own (8 GiB of addresses apart here); class 8's
  // block follows class 7's in the last one.
  for (std::size_t i = 1; i < cachealloc::detail::kStreamRanges; ++i) {
    const std::uintptr_t lo = std::min(addr_of(blocks[i].first), addr_of(blocks[i - 1].first));
    const std::uintptr_t hi = std::max(addr_of(blocks[i].first), addr_of(blocks[i - 1].first));
    CHECK(hi - lo >= kGiB);
  }
  const Block& seventh = blocks[cachealloc::detail::kStreamRanges - 1].first;
  CHECK(addr_of(blocks.back().first) == addr_of(seventh) + seventh.size);
  for (auto& [blk, s] : blocks) {
    f.use_and_free(blk, s);
  }
}

TEST_CASE("defrag: a stream reuses its own holes at once and waits only for itself",
          "[defrag][streams]") {
  // One address range for all streams, so that stream 4's block lies right after the hole and
  // the bigger block cannot simply extend it (with stream_ranges it would, moving nothing).
  OracleFixture f("grow_slack:0,stream_ranges:False");
  const StreamId s = 3;
  Block a = f.alloc(30 * MiB, s);
  f.use_and_free(a, s);
  Block b = f.alloc(30 * MiB, s);  // same stream: stream order makes reuse safe at once
  CHECK(addr_of(b) == addr_of(a));
  CHECK(f.backend.waits() == 0);
  f.use_and_free(b, s);
  // A bigger block needs b's pages moved: that waits for s (once), never for other streams.
  Block other = f.alloc(10 * MiB, 4);
  f.backend.use(4, addr_of(other), other.size);  // stream 4 stays busy throughout
  Block c = f.alloc(36 * MiB, s);
  REQUIRE(c);
  CHECK(f.policy.counters().pages_moved >= 14);
  CHECK(f.backend.waits() == 1);
  CHECK(f.policy.counters().stream_waits == 1);
  f.use_and_free(c, s);
  f.use_and_free(other, 4);
}

TEST_CASE("defrag: a hole next to unmapped space grows in place", "[defrag][streams]") {
  OracleFixture f;
  Block a = f.alloc(30 * MiB, 3);
  f.use_and_free(a, 3);
  Block c = f.alloc(36 * MiB, 3);  // the hole plus three new pages after it
  CHECK(addr_of(c) == addr_of(a));
  CHECK(f.policy.reserved_bytes() == 36 * MiB);
  CHECK(f.backend.waits() == 0);
  f.use_and_free(c, 3);
}

TEST_CASE("defrag: wait_for_streams:False grows instead of waiting", "[defrag][streams]") {
  OracleFixture f("grow_slack:0,wait_for_streams:False");
  Block a = f.alloc(30 * MiB, 3);
  Block d = f.alloc(2 * MiB, 3);  // keeps a's hole from growing in place
  f.use_and_free(a, 3);
  Block c = f.alloc(36 * MiB, 3);
  CHECK(f.backend.waits() == 0);
  CHECK(f.policy.counters().pages_moved == 0);
  CHECK(f.policy.reserved_bytes() == 68 * MiB);
  f.use_and_free(c, 3);
  f.use_and_free(d, 3);
}

TEST_CASE("defrag: pages not yet safe are counted apart when another stream holds them",
          "[defrag][streams]") {
  // Note [Why pages were created beyond the slack]: a's hole is still in use by stream 3's work.
  OracleFixture f("grow_slack:0,wait_for_streams:False");
  Block a = f.alloc(30 * MiB, 3);
  Block d = f.alloc(2 * MiB, 3);  // keeps a's hole from growing in place
  f.use_and_free(a, 3);
  // The growth on stream 3 (a's own) or on stream 5 (another): only then are a's pages another
  // stream's.
  const StreamId s = GENERATE(StreamId{3}, StreamId{5});
  INFO("growth on stream " << s);
  Block c = f.alloc(36 * MiB, s);
  const DefragCounters k = f.policy.counters();
  CHECK(k.beyond_slack_growths == 1);
  CHECK(k.stuck_unsafe_pages >= 14);
  const std::uint64_t other = s == 3 ? 0 : k.stuck_unsafe_pages;
  CHECK(k.stuck_unsafe_other_pages == other);
  const SlackEvent& h = f.policy.slack_history().back();  // the growth's own figures
  CHECK(h.kind == SlackEvent::Kind::beyond_slack);
  CHECK(h.stream == s);
  CHECK(h.unsafe_pages == k.stuck_unsafe_pages);
  CHECK(h.unsafe_other_pages == other);
  f.use_and_free(c, s);
  f.use_and_free(d, 3);
}

TEST_CASE("defrag: release_cached waits for every stream and gives all free pages back",
          "[defrag][streams]") {
  OracleFixture f("");
  std::vector<Block> keep;
  for (StreamId s = 1; s <= 4; ++s) {
    keep.push_back(f.alloc(3 * MiB, s));
    f.use_and_free(f.alloc(25 * MiB, s), s);
  }
  CHECK(f.policy.reserved_bytes() > 100 * MiB);
  const std::size_t released = f.policy.release_cached();
  f.check();
  CHECK(released > 90 * MiB);
  CHECK(f.policy.reserved_bytes() <= round_up(4 * 3 * MiB, 2 * MiB) + 4 * 2 * MiB);
  for (std::size_t i = 0; i < keep.size(); ++i) {
    f.use_and_free(keep[i], i + 1);
  }
  CHECK(f.policy.release_cached() > 0);
  CHECK(f.policy.reserved_bytes() == 0);
  CHECK(f.backend.inner().live_physical() == 0);
  CHECK(f.backend.inner().mapped_bytes_now() == 0);
  f.check();
}

// ============================================================================ failures

TEST_CASE("defrag: failures while mapping, unmapping or recording leave a consistent state",
          "[defrag][faults]") {
  SECTION("map fails") {
    Fixture f;
    f.sim.fail_next(SimCall::map, SimFault::device_error);
    CHECK_THROWS_AS(f.policy.allocate(9 * MiB, 0), DeviceError);
    f.check();
    const Block b = f.alloc(9 * MiB);
    CHECK(b);
    f.free(b);
  }
  SECTION("a later map of the run fails: nothing stays mapped, the pages are released") {
    Fixture f;
    // The address range, three creates (chunks of 2, 2 and 1 pages: kMinChunkPages), one map,
    // then the second map fails.
    f.sim.fail_call(6, SimFault::device_error);
    CHECK_THROWS_AS(f.policy.allocate(9 * MiB, 0), DeviceError);
    f.check();
    CHECK(f.sim.live_physical() == 0);
    CHECK(f.policy.reserved_bytes() == 0);
    const Block b = f.alloc(9 * MiB);
    f.free(b);
  }
  SECTION("create fails with a device error") {
    Fixture f;
    f.sim.fail_call(3, SimFault::device_error);
    CHECK_THROWS_AS(f.policy.allocate(9 * MiB, 0), DeviceError);
    f.check();
    CHECK(f.sim.live_physical() == 0);
  }
  SECTION("physical memory runs out") {
    Fixture f("", 64 * MiB);
    const Block a = f.alloc(40 * MiB);
    const Block b = f.policy.allocate(40 * MiB, 0);  // 80 MiB > 64 MiB
    CHECK_FALSE(b);
    f.check();
    f.free(a);
    const Block c = f.alloc(60 * MiB);  // a's hole and new pages after it
    CHECK(c);
    f.free(c);
  }
  SECTION("unmap fails while pages move") {
    Fixture f("grow_slack:0");
    std::vector<Block> blocks;
    for (int i = 0; i < 6; ++i) {
      blocks.push_back(f.alloc(10 * MiB));
    }
    f.free(blocks[0]);
    f.free(blocks[2]);
    f.free(blocks[4]);
    f.sim.fail_next(SimCall::unmap, SimFault::device_error);
    CHECK_THROWS_AS(f.policy.allocate(24 * MiB, 0), DeviceError);
    f.check();
    const Block b = f.alloc(24 * MiB);
    CHECK(b);
    f.free(b);
  }
  SECTION("an event cannot be recorded") {
    OracleFixture f;
    Block a = f.alloc(10 * MiB, 1);
    f.use_and_free(a, 1);
    f.backend.fail_next_event_call();
    CHECK_THROWS_AS(f.policy.allocate(30 * MiB, 2), DeviceError);
    f.check();
    Block b = f.alloc(30 * MiB, 2);
    CHECK(b);
    f.use_and_free(b, 2);
  }
}

TEST_CASE("defrag: through the front end, out of memory moves cached pages before failing",
          "[defrag][oom]") {
  Config config;
  CachingAllocator<DefragPolicy> a(
      std::make_unique<SimBackend>(SimOptions{.capacity = 256 * MiB, .granularity = 2 * MiB}), config);
  std::vector<void*> ps;
  for (int i = 0; i < 12; ++i) {
    ps.push_back(a.allocate(20 * MiB, i % 2));
  }
  for (void* p : ps) {
    a.deallocate(p);
  }
  void* big = a.allocate(230 * MiB, 0);  // needs the pages of both streams' holes
  CHECK(big != nullptr);
  CHECK(a.stats().num_ooms == 0);
  a.check_invariants();
  CHECK_THROWS_AS((void)a.allocate(64 * MiB, 1), OutOfMemory);
  a.check_invariants();
  a.deallocate(big);
  a.empty_cache();
  CHECK(a.stats().reserved_bytes.current == 0);
}

// ============================================================================ address space

TEST_CASE("defrag: another address range is reserved when one is full", "[defrag]") {
  Fixture f("va_reserve_gb:0.0625");  // 64 MiB ranges
  std::vector<Block> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(f.alloc(20 * MiB));
  }
  const Block huge = f.alloc(100 * MiB);  // larger than a range: a range of its own
  CHECK(f.policy.counters().address_ranges >= 4);
  f.free(huge);
  for (const Block& b : blocks) {
    f.free(b);
  }
  f.policy.release_cached();
  f.check();
  CHECK(f.policy.reserved_bytes() == 0);
}

TEST_CASE("defrag: segments are the mapped runs with their blocks", "[defrag]") {
  Fixture f("grow_slack:0");
  const Block a = f.alloc(3 * MiB);
  const Block b = f.alloc(5 * MiB);
  std::vector<SegmentView> segs;
  f.policy.visit_segments([&](const SegmentView& s) { segs.push_back(s); });
  REQUIRE(segs.size() == 1);
  CHECK(segs[0].address == addr_of(a));
  CHECK(segs[0].size == 8 * MiB);
  REQUIRE(segs[0].blocks.size() == 2);
  CHECK(segs[0].blocks[0].allocated);
  CHECK(segs[0].blocks[1].size == b.size);
  f.free(a);
  f.free(b);
  f.policy.release_cached();
  segs.clear();
  f.policy.visit_segments([&](const SegmentView& s) { segs.push_back(s); });
  CHECK(segs.empty());
}

TEST_CASE("defrag: destruction gives every page and address range back", "[defrag]") {
  SimBackend sim(SimOptions{.capacity = kGiB, .granularity = 2 * MiB});
  {
    DefragPolicy policy(sim, DefragSettings{});
    (void)policy.allocate(10 * MiB, 0);
    (void)policy.allocate(100, 1);
    CHECK(sim.live_physical() > 0);
  }
  CHECK(sim.live_physical() == 0);
  CHECK(sim.mapped_bytes_now() == 0);
  CHECK(sim.held_bytes() == 0);
  CHECK(sim.live_events() == 0);
}

TEST_CASE("defrag: a request beyond 1 PiB is refused and leaves the policy intact", "[defrag][index]") {
  // Note [One word ranks a hole]: the key holds a hole's size in 43 bits of 512-byte units. The
  // front end refuses such requests before any policy sees them (kMaxRequestBytes); the policy
  // refuses them too, for a caller that uses it directly. Before the bound, 2^52 + 4 KiB spilled
  // into the bucket's bits and a range reserved for it outgrew its key.
  SimBackend sim(SimOptions{.capacity = kGiB, .granularity = 2 * MiB});
  DefragPolicy policy(sim, DefragSettings{});
  const Block small = policy.allocate(3 * MiB, 0);
  REQUIRE(small);
  for (const std::size_t huge : {(std::size_t{1} << 50) + 512, (std::size_t{1} << 52) + 4096,
                                 (std::size_t{1} << 62) - 512}) {
    CHECK_FALSE(policy.allocate(huge, 0));
    CHECK_FALSE(policy.allocate(huge, 1));
    policy.check_invariants();
  }
  policy.deallocate(small, 0);
  policy.check_invariants();
  const Block again = policy.allocate(3 * MiB, 0);
  CHECK(again.ptr == small.ptr);
  policy.deallocate(again, 0);
}

// ============================================================================ regressions

TEST_CASE("defrag regression: the part of a hole left of moved pages keeps its owner",
          "[defrag][regression]") {
  // take_pages() once gave the right remainder of a hole the owner and stamp of the unmapped
  // part (stream class 0, epoch 0), which put it next to a hole of class 0 unmerged. The streams
  // share one range here (stream_ranges:False), so that their blocks lie side by side, as they
  // still do in small ranges, beyond the eighth stream and where one stream took another's hole.
  OracleFixture f("grow_slack:0,stream_ranges:False");
  f.use_and_free(f.alloc(1000, 9), 9);  // stream 9 becomes class 0 (small range)
  Block x = f.alloc(5 * MiB, 7);        // stream 7 is class 1: x at the start of the range
  Block y = f.alloc(1536 * kKiB, 9);    // right after x, sharing x's last page
  REQUIRE(addr_of(y) == addr_of(x) + x.size);
  f.use_and_free(x, 7);
  f.use_and_free(y, 9);
  const std::uint64_t moved = f.policy.counters().pages_moved;
  Block big = f.alloc(12 * MiB, 7);  // moves x's whole chunks after waiting for stream 7
  CHECK(f.policy.counters().pages_moved > moved);
  f.use_and_free(big, 7);
}

TEST_CASE("defrag regression: holes kept apart by two busy streams merge once both finished",
          "[defrag][regression]") {
  // process_deferred() once dropped the pairs that were not mergeable yet, so they never merged.
  // All growth from new pages (no hole moves); the streams share one range (as in the test above).
  OracleFixture f("grow_slack:1,stream_ranges:False");
  Block x = f.alloc(5 * MiB, 7);
  Block y = f.alloc(3 * MiB, 9);
  REQUIRE(addr_of(y) == addr_of(x) + x.size);
  Block z = f.alloc(4 * MiB, 11);
  f.use_and_free(x, 7);
  f.use_and_free(y, 9);  // x and y: pending on different streams, kept apart
  std::vector<Block> g;
  g.push_back(f.alloc(64 * MiB, 11));  // a miss closes the epoch of x's and y's frees
  f.use_and_free(z, 11);
  g.push_back(f.alloc(64 * MiB, 11));  // a miss closes the epoch of z's free
  f.backend.complete(11);
  g.push_back(f.alloc(64 * MiB, 11));  // an epoch completes on stream 11; x, y still pending
  f.backend.complete(7);
  f.backend.complete(9);
  g.push_back(f.alloc(64 * MiB, 11));  // x and y are safe now: they merge
  std::size_t spans = 0;
  f.policy.visit_segments([&](const SegmentView& s) {
    for (const BlockView& b : s.blocks) {
      spans += !b.allocated && b.address <= addr_of(x) && addr_of(y) + y.size <= b.address + b.size;
    }
  });
  CHECK(spans == 1);
  for (const Block& b : g) {
    f.use_and_free(b, 11);
  }
}

TEST_CASE("defrag regression: a stream's free next to another stream's hole is deferred once",
          "[defrag][regression]") {
  // Each free of a block carved next to another stream's hole deferred the pair again, so the
  // list grew by one entry per free: past kDeferredLimit every allocation closed an epoch (an
  // event) and walked the whole list (45-60 us per pair in threads/ on the H200).
  SimFrontEnd f;
  CachingAllocator<DefragPolicy>& a = f.allocator;
  SimBackend* sim = f.sim;
  std::mt19937_64 rng(1);
  auto size = [&] { return std::size_t{512} << (rng() % 17); };
  std::vector<void*> live;
  for (int i = 0; i < 300; ++i) {
    live.push_back(a.allocate(size(), 0));
  }
  for (int i = 0; i < 20000; ++i) {
    const std::size_t k = rng() % live.size();
    a.deallocate(live[k]);
    live[k] = a.allocate(size(), 0);
  }
  for (void* p : live) {
    a.deallocate(p);
  }
  for (int round = 0; round < 3; ++round) {
    const std::uint64_t before = sim->device_calls();
    for (int i = 0; i < 8000; ++i) {
      a.deallocate(a.allocate(4096, 11));
    }
    // At most one epoch (an event and its query) per kEpochFrees frees (none once the policy
    // stops missing: Note [Epochs on demand]): at most 2000 calls, not 16000.
    CHECK(sim->device_calls() - before <= 2100);
    a.check_invariants();
  }
}

// ============================================================================ adversarial patterns

namespace {
std::uint64_t fixed_moves = 0;  // chunks moved by the KV-cache pattern at a fixed slack
}  // namespace

TEST_CASE("defrag: adversarial patterns stay within 2% of the live peak", "[defrag][patterns]") {
  std::mt19937_64 rng(11);
  SECTION("alternating large and small, the large die, then larger requests") {
    Workload w;
    std::vector<void*> keep;
    for (int round = 0; round < 4; ++round) {
      std::vector<void*> big;
      for (int i = 0; i < 150; ++i) {
        big.push_back(w.alloc(MiB + rng() % (12 * MiB)));
        keep.push_back(w.alloc(512 + rng() % 32768));
      }
      for (void* p : big) {
        w.free(p);
      }
      std::vector<void*> bigger;
      for (int i = 0; i < 30; ++i) {
        bigger.push_back(w.alloc(16 * MiB + rng() % (48 * MiB)));
      }
      for (void* p : bigger) {
        w.free(p);
      }
    }
    CHECK(w.ratio().value <= 1.02);
    for (void* p : keep) {
      w.free(p);
    }
  }
  SECTION("sawtooth: the live set grows to a peak, then everything dies") {
    Workload w;
    for (int round = 0; round < 8; ++round) {
      std::vector<void*> live;
      const int n = 100 + static_cast<int>(rng() % 100);
      for (int i = 0; i < n; ++i) {
        live.push_back(w.alloc(4096 + rng() % (96 * MiB)));
      }
      std::shuffle(live.begin(), live.end(), rng);
      for (void* p : live) {
        w.free(p);
      }
    }
    CHECK(w.ratio().value <= 1.02);
  }
  SECTION("growing KV caches: each grows by reallocation, sequences come and go") {
    // Pages move at nearly every step here. With the slack held at grow_slack the peak stays
    // within 2%; by default the slack rises (Note [Slack that adapts to moves]) and moves
    // mostly stop, for at most max_grow_slack more memory.
    const bool fixed = GENERATE(true, false);
    INFO((fixed ? "max_grow_slack:0.01" : "default settings"));
    Workload w(fixed ? "max_grow_slack:0.01" : "");
    struct Seq {
      void* cache;
      std::size_t size;
      int left;
    };
    std::vector<Seq> seqs;
    std::vector<void*> weights;
    for (int i = 0; i < 10; ++i) {
      weights.push_back(w.alloc(64 * MiB));
    }
    for (int step = 0; step < 600; ++step) {
      if (seqs.size() < 24 && rng() % 3 == 0) {
        const std::size_t size = (1 + rng() % 32) * 256 * kKiB;
        seqs.push_back({w.alloc(size), size, 20 + static_cast<int>(rng() % 200)});
      }
      void* act = w.alloc(MiB * (1 + seqs.size() / 2) + 512);
      for (Seq& s : seqs) {
        if (--s.left % 8 == 0) {
          const std::size_t grown = s.size + 4 * MiB;
          void* bigger = w.alloc(grown);
          w.free(s.cache);
          s.cache = bigger;
          s.size = grown;
        }
      }
      w.free(act);
      for (std::size_t i = 0; i < seqs.size();) {
        if (seqs[i].left <= 0) {
          w.free(seqs[i].cache);
          seqs[i] = seqs.back();
          seqs.pop_back();
        } else {
          ++i;
        }
      }
    }
    const DefragCounters c = w.allocator().policy().counters();
    if (fixed) {
      CHECK(w.ratio().value <= 1.02);
      CHECK(c.slack_raises == 0);
      fixed_moves = c.chunks_moved;
    } else {
      CHECK(w.ratio().value <= 1.0 + w.allocator().policy().settings().max_grow_slack + 0.01);
      CHECK(c.slack_raises >= 1);
      CHECK(c.chunks_moved * 2 < fixed_moves);  // most moves went away
    }
    for (Seq& s : seqs) {
      w.free(s.cache);
    }
    for (void* p : weights) {
      w.free(p);
    }
  }
  SECTION("many streams: random sizes on eight streams") {
    Workload w;
    std::vector<void*> live;
    for (int i = 0; i < 6000; ++i) {
      if (!live.empty() && (live.size() > 200 || rng() % 100 < 49)) {
        const std::size_t k = rng() % live.size();
        w.free(live[k]);
        live[k] = live.back();
        live.pop_back();
      } else {
        const double exponent = 9.0 + static_cast<double>(rng() % 1700) / 100.0;
        live.push_back(w.alloc(static_cast<std::size_t>(std::exp2(exponent)), rng() % 8));
      }
    }
    // Random frees of random sizes leave many holes whose edge pages cannot move, and a hole
    // another stream freed moments ago can neither merge nor move: the policy never blocks on
    // another stream's work (1.101 measured here with chunks of at least two pages, 1.075 with
    // one-page chunks: Note [Chunks]; 1.029 with the same requests on one stream).
    CHECK(w.ratio().value <= 1.11);
    for (void* p : live) {
      w.free(p);
    }
  }
}

namespace {
/// The two-stream input pipeline of bench/e2e in miniature: a side stream makes each next batch
/// (random rows, blocks of rows x 16 KiB; two of them kept and handed to the main stream with
/// record_stream), the main stream's activations follow the batch, its gradients are fixed.
/// `after_step(step)` runs at the end of every step. Frees everything it made.
void producer_pipeline(Workload& w, int steps, const std::function<void(int)>& after_step = {}) {
  std::mt19937_64 rng(11);
  const StreamId main = 0;
  const StreamId side = 7;
  const auto rows_bytes = [](std::size_t rows) { return rows * 16 * kKiB; };
  std::vector<void*> weights;
  for (int i = 0; i < 6; ++i) {
    weights.push_back(w.alloc(static_cast<std::size_t>(64 + 32 * (i % 3)) * MiB, main));
  }
  const auto produce = [&]() {
    const std::size_t n = rows_bytes(512 + rng() % 3585);
    void* raw = w.alloc(n, side);
    void* noise = w.alloc(n, side);
    void* x = w.alloc(n, side);
    w.free(noise);
    w.free(raw);
    void* tmp = w.alloc(n, side);
    void* y = w.alloc(n, side);
    w.free(tmp);
    return std::pair{std::pair{x, y}, n};
  };
  auto next = produce();
  for (int step = 0; step < steps; ++step) {
    const auto [batch, n] = next;
    w.record(batch.first, main);
    w.record(batch.second, main);
    next = produce();
    std::vector<void*> acts;
    for (int layer = 0; layer < 4; ++layer) {
      acts.push_back(w.alloc(n * (layer % 2 == 0 ? 1 : 2), main));
    }
    std::vector<void*> grads;
    for (int i = 0; i < 6; ++i) {
      grads.push_back(w.alloc(static_cast<std::size_t>(64 + 32 * (i % 3)) * MiB, main));
    }
    for (auto it = acts.rbegin(); it != acts.rend(); ++it) {
      w.free(*it);
    }
    for (void* g : grads) {
      w.free(g);
    }
    w.free(batch.first);
    w.free(batch.second);
    w.idle(3'000'000);  // the rest of the step
    if (after_step) {
      after_step(step);
    }
  }
  w.allocator().check_invariants();
  w.free(next.first.first);
  w.free(next.first.second);
  for (void* p : weights) {
    w.free(p);
  }
}
}  // namespace

TEST_CASE("defrag: a producer stream that hands batches over stays within the slack's limit",
          "[defrag][patterns][streams]") {
  // Pages move at nearly every step, so the time budget raises the slack; peak reserved stays
  // within max_grow_slack (0.2) of the live peak, with or without a range per stream, with the
  // GPU keeping up or 2 ms behind. Invariants are checked along the way (Workload::step()).
  const bool own = GENERATE(true, false);
  const std::uint64_t lag = GENERATE(std::uint64_t{0}, std::uint64_t{2'000'000});
  INFO((own ? "stream_ranges:True" : "stream_ranges:False") << ", GPU " << lag << " ns behind");
  Workload w(own ? "" : "stream_ranges:False", 2'000, lag);
  producer_pipeline(w, 200);
  const double limit = w.allocator().policy().settings().max_grow_slack;
  CHECK(limit == 0.2);
  CHECK(w.ratio().value <= 1.0 + limit + 0.01);
  CHECK(w.allocator().policy().counters().pages_moved > 0);  // it did have to move pages
}

// ============================================================================ randomized

namespace {

void run_oracle_sequence(std::uint64_t seed, std::uint64_t steps, bool faults, bool coalesce = false) {
  // Every third seed keeps freed small blocks (Note [Recently freed small blocks in defrag]).
  // `coalesce`: every growth coalesces its chunks (Note [Coalescing moved chunks while maps are
  // dear]), unmapping them with unmap_now and releasing them before it creates their pages again.
  OracleFixture f(std::string(seed % 3 == 2   ? "grow_slack:0.01,keep_small_mb:4"
                              : seed % 2 == 0 ? "grow_slack:0"
                                              : "grow_slack:0.01,small_size:64KB") +
                      (coalesce ? ",coalesce_map_us:0" : ""),
                  768 * MiB);
  std::mt19937_64 rng(seed);
  struct Live {
    Block block;
    StreamId stream;
  };
  std::vector<Live> live;
  std::map<std::uintptr_t, std::size_t> tracker;
  constexpr StreamId kStreams = 3;
  const auto random_size = [&]() -> std::size_t {
    switch (rng() % 6) {
      case 0: case 1: return 1 + rng() % 8192;
      case 2: return 1 + rng() % MiB;
      case 3: case 4: return MiB + rng() % (16 * MiB);
      default: return 16 * MiB + rng() % (96 * MiB);
    }
  };
  for (std::uint64_t step = 0; step < steps; ++step) {
    INFO("seed " << seed << " step " << step);
    const unsigned op = static_cast<unsigned>(rng() % 100);
    if (faults && rng() % 50 == 0) {
      const SimCall kinds[] = {SimCall::create_physical, SimCall::map, SimCall::unmap};
      const SimCall kind = kinds[rng() % 3];
      const SimFault fault = rng() % 2 == 0 ? SimFault::device_error : SimFault::out_of_memory;
      f.backend.inner().fail_next(kind, fault);
      if (rng() % 4 == 0) {
        f.backend.fail_next_event_call();
      }
    }
    if (op < 50 || live.empty()) {
      const StreamId s = rng() % kStreams;
      Block b;
      try {
        // Not `b = f.alloc(...)`: GCC 12 -O2 then builds the result in b and drops b's
        // initialisation, so b keeps a stale block when the call throws.
        const Block got = f.alloc(random_size(), s);
        b = got;
      } catch (const DeviceError&) {
        CHECK_FALSE(b);
        REQUIRE(faults);
        f.check();
      }
      f.backend.clear_faults();
      if (b) {
        auto next = tracker.lower_bound(addr_of(b));
        REQUIRE((next == tracker.end() || next->first >= addr_of(b) + b.size));
        REQUIRE((next == tracker.begin() ||
                 std::prev(next)->first + std::prev(next)->second <= addr_of(b)));
        tracker.emplace(addr_of(b), b.size);
        live.push_back({b, s});
      }
    } else if (op < 88) {
      const std::size_t k = rng() % live.size();
      const Live l = live[k];
      live[k] = live.back();
      live.pop_back();
      tracker.erase(addr_of(l.block));
      f.use_and_free(l.block, l.stream);
    } else if (op < 97) {
      f.backend.complete(rng() % kStreams);
      f.backend.prune();
    } else if (op < 99) {
      try {
        f.policy.release_cached();
      } catch (const DeviceError&) {
        REQUIRE(faults);
      }
      f.backend.clear_faults();
      f.check();
    } else {
      // A kernel on a live block's stream (makes its pages busy beyond its free).
      const Live& l = live[rng() % live.size()];
      f.backend.use(l.stream, addr_of(l.block), l.block.size);
    }
    REQUIRE(f.backend.violations().empty());
  }
  for (const Live& l : live) {
    f.use_and_free(l.block, l.stream);
  }
  for (StreamId s = 0; s < kStreams; ++s) {
    f.backend.complete(s);
  }
  f.policy.release_cached();
  f.check();
  CHECK(f.policy.reserved_bytes() == 0);
  CHECK(f.backend.inner().live_physical() == 0);
}

}  // namespace

TEST_CASE("defrag: the slack rises when moving pages takes more than move_budget of the time",
          "[defrag][patterns]") {
  // One shape of large blocks per step, drawn at random, over a steady set of small ones: pages
  // move at a few growths per step, far fewer than one per kAllocationsPerMove allocations, so
  // only the time decides (Note [A time budget for moves]). With a host that spends 2 us per
  // call, the moves (milliseconds each, at an H200's cost per map and unmap) take most of the
  // time; with 20 ms per call they take almost none.
  const bool fast_host = GENERATE(true, false);
  INFO((fast_host ? "2 us per call" : "20 ms per call"));
  Workload w("max_grow_slack:0.25", fast_host ? 2'000 : 20'000'000);
  random_shape_job(w, 120);
  const DefragCounters c = w.allocator().policy().counters();
  INFO("chunks moved " << c.chunks_moved << ", move time " << c.move_ns / 1000000 << " ms, slack "
                       << c.slack << ", raises " << c.slack_raises << " (" << c.budget_raises
                       << " on time)");
  CHECK(c.chunks_moved > 0);
  if (fast_host) {
    CHECK(c.budget_raises >= 1);
    CHECK(c.slack > 0.01);
  } else {
    CHECK(c.budget_raises == 0);
  }
}

TEST_CASE("defrag: moves over the budget by waiting for the stream switch to moving pending, "
          "moves alone raise the slack", "[defrag][patterns]") {
  // Note [Waits that switch to moving pending] (defrag_grow.cpp). The workload of the test above
  // on a fast host (2 us per call). With a GPU that finishes each stream's work as it is queued,
  // nothing waits: the moves alone go over the budget and the slack rises. With a GPU 20 ms
  // behind the host, the pages a growth lacks are in holes the stream's queued work still uses:
  // waiting for them costs most of the time, and the policy switches to moving them at once
  // (their old addresses unmapped after the stream) instead of raising the slack for the waits
  // (the moves alone later raise it, as with the GPU keeping up). With pending_on_waits:False it
  // keeps waiting.
  const auto run = [](std::uint64_t lag_ns, const std::string& conf) {
    Workload w(conf, 2'000, lag_ns);
    random_shape_job(w, 60);
    return w.allocator().policy().counters();
  };
  const auto show = [](const DefragCounters& c) {
    std::ostringstream o;
    o << c.stream_waits << " waits (" << c.wait_ns / 1000000 << " of " << c.move_ns / 1000000
      << " ms), " << c.pending_switches << " switch, " << c.pages_moved_pending
      << " pages moved pending, " << c.budget_raises << " raises on time, slack " << c.slack;
    return o.str();
  };
  const DefragCounters keeping_up = run(0, "max_grow_slack:0.25");
  const DefragCounters behind = run(20'000'000, "max_grow_slack:0.25");
  const DefragCounters waiting = run(20'000'000, "max_grow_slack:0.25,pending_on_waits:False");
  INFO("GPU keeps up: " << show(keeping_up));
  INFO("GPU 20 ms behind: " << show(behind));
  INFO("GPU 20 ms behind, pending_on_waits:False: " << show(waiting));
  CHECK(keeping_up.wait_ns == 0);
  CHECK(keeping_up.pending_switches == 0);
  CHECK(keeping_up.budget_raises >= 1);
  CHECK(behind.pending_switches == 1);
  CHECK(behind.pages_moved_pending > 0);
  CHECK(waiting.pending_switches == 0);
  CHECK(waiting.pages_moved_pending == 0);
  CHECK(waiting.stream_waits > behind.stream_waits);
  CHECK(waiting.wait_ns > behind.wait_ns);
}

TEST_CASE("defrag: moves in bursts seconds apart are paid by the quiet time, and a raise they "
          "caused comes back", "[defrag][patterns]") {
  // The workload of the test above on a fast host (2 us per call, so moves take most of the
  // time while they happen). Back to back, the budget raises the slack and keeps it. In bursts
  // of three steps with 5 s of quiet after each (a server decoding a batch between the
  // allocations of two batches), the moves take under 1% of the time: Note [Quiet time pays for
  // a burst] lets the bursts move pages without a raise on time. Back to back for 30 steps and
  // then in bursts: the raises of the first part come back after the first quiet (Note [A raise
  // that comes back]) and the rest moves pages again.
  const auto run = [](int busy_steps, const std::string& conf = "max_grow_slack:0.25") {
    Workload w(conf, 2'000);
    random_shape_job(w, 120, [&](int step) {
      if (step >= busy_steps && step % 3 == 0) {
        w.idle(5'000'000'000);
      }
    });
    return std::pair{w.allocator().policy().counters(), w.ratio().value};
  };
  const auto [busy, busy_peak] = run(120);
  const auto [quiet, quiet_peak] = run(0);
  const auto [later, later_peak] = run(30);
  const auto show = [](const DefragCounters& c, double peak) {
    std::ostringstream o;
    o << "slack " << c.slack << ", " << c.budget_raises << " raises on time, " << c.slack_returns
      << " undone, peak " << peak << ", " << c.chunks_moved << " chunks moved";
    return o.str();
  };
  INFO("back to back: " << show(busy, busy_peak));
  INFO("in bursts: " << show(quiet, quiet_peak));
  INFO("back to back, then in bursts: " << show(later, later_peak));
  CHECK(busy.budget_raises >= 1);
  CHECK(busy.slack > 0.1);
  CHECK(busy.slack_returns == 0);
  CHECK(quiet.budget_raises == 0);
  CHECK(quiet.chunks_moved > busy.chunks_moved);
  CHECK(quiet.slack < busy.slack);
  CHECK(quiet_peak < busy_peak);
  CHECK(later.budget_raises >= 1);
  CHECK(later.slack_returns >= 1);
  CHECK(later.slack < busy.slack);
  CHECK(later.chunks_moved > busy.chunks_moved);
  // move_budget:0 allows no moves: its raises never come back (and nothing divides by zero).
  const auto [none, none_peak] = run(30, "max_grow_slack:0.25,move_budget:0");
  INFO("move_budget:0: " << show(none, none_peak));
  CHECK(none.budget_raises >= 1);
  CHECK(none.slack_returns == 0);
}

namespace {
/// Note [A history of the slack]: the history agrees with the counters and tells the slack's
/// whole path: it starts at grow_slack, each event starts where the one before ended, raises
/// raise it, returns lower it, and it ends at the slack in force.
void check_history(CachingAllocator<DefragPolicy>& a) {
  const DefragPolicy& p = a.policy();
  const DefragCounters c = p.counters();
  const std::vector<SlackEvent>& h = p.slack_history();
  REQUIRE(p.slack_events_dropped() == 0);
  std::uint64_t raises = 0, on_time = 0, returns_kept = 0, undone = 0, switches = 0, beyond = 0,
                beyond_pages = 0;
  double slack = p.settings().grow_slack;
  std::uint64_t last_ns = 0;
  for (const SlackEvent& e : h) {
    INFO(slack_event_name(e.kind) << " at " << e.time_ns << " ns: " << e.slack_before << " -> "
                                  << e.slack_after);
    CHECK(e.time_ns >= last_ns);
    CHECK(e.slack_before == slack);
    CHECK(e.peak_live_bytes >= e.live_bytes);
    switch (e.kind) {
      case SlackEvent::Kind::count_raise:
      case SlackEvent::Kind::time_raise:
      case SlackEvent::Kind::return_raise:
        ++raises;
        on_time += e.kind == SlackEvent::Kind::time_raise ? 1 : 0;
        returns_kept += e.kind == SlackEvent::Kind::return_raise ? 1 : 0;
        CHECK(e.slack_after > e.slack_before);
        break;
      case SlackEvent::Kind::returned:
        ++undone;
        CHECK(e.slack_after < e.slack_before);
        break;
      case SlackEvent::Kind::pending_switch:
        ++switches;
        CHECK(e.slack_after == e.slack_before);
        break;
      case SlackEvent::Kind::top_at_limit:  // at the limit, and it stays there
        CHECK(e.slack_before == p.settings().max_grow_slack);
        CHECK(e.slack_after == e.slack_before);
        break;
      case SlackEvent::Kind::beyond_slack:
        ++beyond;
        beyond_pages += e.pages;
        CHECK(e.pages > 0);
        CHECK(e.slack_after == e.slack_before);
        break;
    }
    slack = e.slack_after;
    last_ns = e.time_ns;
  }
  CHECK(slack == c.slack);
  CHECK(raises == c.slack_raises);
  CHECK(on_time == c.budget_raises);
  CHECK(returns_kept == c.return_raises);
  CHECK(undone == c.slack_returns);
  CHECK(switches == c.pending_switches);
  CHECK(beyond == c.beyond_slack_growths);
  CHECK(beyond_pages == c.beyond_slack_pages);
}

/// Note [A history of the time budget]: every costly growth and every window judged is kept
/// (none dropped here), and they agree with the counters and the slack's history: the growths'
/// waits and moved pages add up to the counters, each window's verdict matches its figures, and
/// the windows over the budget are the raises on time, the switch and the move to the top.
void check_budget_history(CachingAllocator<DefragPolicy>& a) {
  const DefragPolicy& p = a.policy();
  const DefragCounters c = p.counters();
  REQUIRE(p.growths_dropped() == 0);
  REQUIRE(p.windows_dropped() == 0);
  std::uint64_t waits = 0, waited_ns = 0, took_ns = 0, moved = 0, last_ns = 0, charged_growths = 0;
  for (const CostlyGrowth& g : p.growth_history()) {
    CHECK(g.time_ns >= last_ns);
    CHECK((g.waits != 0 || g.pages_moved != 0));
    CHECK(g.waited_ns <= g.took_ns);
    waits += g.waits;
    waited_ns += g.waited_ns;
    took_ns += g.took_ns;
    moved += g.pages_moved;
    charged_growths += g.new_peak ? 0 : 1;
    last_ns = g.time_ns;
  }
  CHECK(waits == c.stream_waits);
  CHECK(waited_ns == c.wait_ns);
  // move_ns is every costly growth's time, at a new peak too (the waits are part of it).
  CHECK(took_ns == c.move_ns);
  CHECK(c.wait_ns <= c.move_ns);
  CHECK(moved == c.pages_moved);
  std::uint64_t raised = 0, switched = 0, top = 0, in_windows = 0;
  last_ns = 0;
  for (const BudgetWindow& w : p.window_history()) {
    INFO("window " << w.open_ns << " -> " << w.close_ns << " ns: " << w.growths << " growths, spent "
                   << w.spent_ns << " of " << w.charged_ns << " ns, allowed " << w.allowed_ns << ", "
                   << window_close_id(w.close) << ", " << window_verdict_id(w.verdict));
    CHECK(w.open_ns >= last_ns);
    CHECK(w.close_ns >= w.open_ns);
    CHECK(w.growths >= 1);
    CHECK(w.waited_ns <= w.charged_ns);
    CHECK(w.spent_ns <= w.charged_ns);
    const double allowed = p.settings().move_budget * static_cast<double>(w.close_ns - w.open_ns);
    CHECK(static_cast<double>(w.allowed_ns) == Approx(allowed).margin(1.0));
    if (w.verdict == BudgetWindow::Verdict::within) {
      CHECK(static_cast<double>(w.spent_ns) <= allowed);
    } else {
      CHECK(static_cast<double>(w.spent_ns) > allowed);
    }
    raised += w.verdict == BudgetWindow::Verdict::raised ? 1 : 0;
    switched += w.verdict == BudgetWindow::Verdict::switched ? 1 : 0;
    top += w.verdict == BudgetWindow::Verdict::top_at_limit ? 1 : 0;
    in_windows += w.growths;
    last_ns = w.close_ns;
  }
  CHECK(raised == c.budget_raises);
  CHECK(switched == c.pending_switches);
  std::uint64_t top_events = 0;
  for (const SlackEvent& e : p.slack_history()) {
    top_events += e.kind == SlackEvent::Kind::top_at_limit ? 1 : 0;
  }
  CHECK(top == top_events);
  // Each charged growth falls in one window, except those of the window still open.
  CHECK(in_windows <= charged_growths);
  CHECK(charged_growths - in_windows < 8);
}
}  // namespace

TEST_CASE("defrag: the slack's history tells its whole path, in step with the counters",
          "[defrag][patterns]") {
  // Back to back for 30 steps, then in bursts (the test above): raises on time, a return after
  // the first quiet; and a GPU 2 ms behind a fast host, which switches to moving pending.
  {
    Workload w("max_grow_slack:0.25", 2'000);
    random_shape_job(w, 120, [&](int step) {
      if (step >= 30 && step % 3 == 0) {
        w.idle(5'000'000'000);
      }
    });
    const DefragCounters c = w.allocator().policy().counters();
    REQUIRE(c.budget_raises >= 1);
    REQUIRE(c.slack_returns >= 1);
    check_history(w.allocator());
    check_budget_history(w.allocator());
  }
  {
    Workload w("", 2'000, 2'000'000);
    random_shape_job(w, 60, [](int) {});
    check_history(w.allocator());
    check_budget_history(w.allocator());
    const DefragCounters c = w.allocator().policy().counters();
    INFO(c.stream_waits << " waits, " << c.pending_switches << " switches");
    CHECK(c.stream_waits > 0);  // the budget history above saw waits, not only moves
  }
}

TEST_CASE("defrag: the slack's history keeps its first events and counts the rest", "[defrag]") {
  // With no slack at all, blocks of 3 MiB + 512 B held one after another each end on a page
  // that the next one shares: most growths create a page beyond the slack.
  Workload w("grow_slack:0,max_grow_slack:0");
  std::vector<void*> held;
  for (int i = 0; i < 1200; ++i) {
    held.push_back(w.alloc(3 * MiB + 512));
  }
  const DefragPolicy& p = w.allocator().policy();
  const DefragCounters c = p.counters();
  INFO(c.beyond_slack_growths << " growths beyond the slack");
  REQUIRE(c.beyond_slack_growths > kSlackHistoryLength);
  CHECK(p.slack_history().size() == kSlackHistoryLength);
  CHECK(p.slack_history().size() + p.slack_events_dropped() ==
        c.beyond_slack_growths + c.slack_raises + c.slack_returns + c.pending_switches);
  for (void* b : held) {
    w.free(b);
  }
}

TEST_CASE("defrag: pages the small and large ranges trade back and forth at every step stay put",
          "[defrag][patterns]") {
  // Note [Pages that come back] (defrag_grow.cpp). Each step first holds small blocks (their own
  // address range) at a low live set, frees them, then reaches the peak with large blocks. From
  // the second step the small range lacks pages and takes them from the large range's free holes
  // below the peak; at the peak the large range lacks them. Taking them back would repeat both
  // moves at every step (the simulated clock stands still here, so the time budget never
  // judges them); instead the large range creates what it lacks, once, and the slack rises by
  // it, as long as such raises add up to at most grow_slack. Beyond that, the pages move.
  const bool within = GENERATE(true, false);
  const std::size_t small_blocks = within ? 12 : 48;  // 1 MiB each: 1.2% or 4.8% of the peak
  INFO(small_blocks << " MiB of small blocks per step");
  Workload w;
  std::vector<void*> params;
  for (int i = 0; i < 8; ++i) {
    params.push_back(w.alloc(64 * MiB));
  }
  std::uint64_t maps_after_warmup = 0;
  for (int step = 0; step < 12; ++step) {
    std::vector<void*> blocks;
    for (std::size_t i = 0; i < small_blocks; ++i) {
      blocks.push_back(w.alloc(MiB));
    }
    for (void* p : blocks) {
      w.free(p);
    }
    blocks.clear();
    for (int i = 0; i < 24; ++i) {
      blocks.push_back(w.alloc(20 * MiB + 4096));
    }
    for (void* p : blocks) {
      w.free(p);
    }
    if (step == 2) {
      maps_after_warmup = w.maps();
    }
  }
  const DefragCounters c = w.allocator().policy().counters();
  INFO("pages moved " << c.pages_moved << ", slack " << c.slack << ", raises " << c.slack_raises
                      << " (" << c.return_raises << " for pages coming back), ratio "
                      << w.ratio().value);
  CHECK(c.pages_moved > 0);  // the small range did take pages from the large one
  if (within) {
    CHECK(c.return_raises == 1);
    CHECK(w.maps() == maps_after_warmup);  // nothing moves once the large range created its own
    CHECK(w.ratio().value <= 1.02);
  } else {
    // Keeping 4.8% would add more than grow_slack: pages keep moving (until the slack rises
    // on the move rate, Note [Slack that adapts to moves]).
    CHECK(w.maps() > maps_after_warmup);
  }
  for (void* p : params) {
    w.free(p);
  }
}

TEST_CASE("defrag: far over the time budget, the slack rises before a window is full and then "
          "chunks grow with it", "[defrag][patterns]") {
  // The workload of the test above; moves take most of the time. Note [Judging a window before
  // it is full]: the first raise comes before kMoveWindow growths moved pages. Note [Chunks once
  // the slack rose]: afterwards a created chunk holds at least (slack - grow_slack) x peak live
  // / kChunksPerGrowth pages (or the whole growth, when that is smaller).
  // The engine's constants (policies/src/defrag_engine.h, private to the policy).
  constexpr std::uint64_t kChunksPerGrowth = 16;
  constexpr std::uint64_t kMoveWindow = 8;
  // 50 us per call: steps of about 30 ms. The first raise then came after 9 moving growths
  // when windows were judged only when full, after 3 with the early verdict.
  Workload w("max_grow_slack:0.25", 50'000);
  std::mt19937_64 rng(5);
  std::vector<void*> weights;
  for (int i = 0; i < 8; ++i) {
    weights.push_back(w.alloc(64 * MiB));
  }
  std::uint64_t moving_growths = 0;
  std::uint64_t moving_growths_at_raise = 0;
  std::uint64_t growths_after_raise = 0;
  std::size_t peak_live = 0;
  const auto alloc = [&](std::size_t bytes) {
    const DefragCounters before = w.allocator().policy().counters();
    void* p = w.alloc(bytes);
    const DefragCounters after = w.allocator().policy().counters();
    peak_live = std::max(peak_live, w.allocator().policy().live_bytes());
    if (after.pages_moved > before.pages_moved) {
      ++moving_growths;
    }
    if (after.budget_raises > 0 && before.budget_raises == 0) {
      moving_growths_at_raise = moving_growths;
    }
    const std::uint64_t chunks = after.chunks_created - before.chunks_created;
    const std::uint64_t pages = after.pages_created - before.pages_created;
    if (chunks > 0 && before.slack > 0.01) {
      ++growths_after_raise;
      const auto least = static_cast<std::uint64_t>((before.slack - 0.01) *
                                                    static_cast<double>(peak_live) /
                                                    static_cast<double>(2 * MiB)) /
                         kChunksPerGrowth;
      const std::uint64_t chunk = std::max<std::uint64_t>(std::min(least, pages), 1);
      INFO("growth of " << pages << " pages in " << chunks << " chunks, slack " << before.slack
                        << ", least " << least);
      CHECK(chunks <= (pages + chunk - 1) / chunk);
    }
    return p;
  };
  for (int step = 0; step < 60; ++step) {
    random_shape_step(w, rng, alloc);
  }
  const DefragCounters c = w.allocator().policy().counters();
  INFO("moving growths " << moving_growths << ", at the first raise on time "
                         << moving_growths_at_raise << ", growths that created pages after a raise "
                         << growths_after_raise << ", slack " << c.slack);
  REQUIRE(c.budget_raises >= 1);
  CHECK(moving_growths_at_raise >= 2);
  CHECK(moving_growths_at_raise < kMoveWindow);
  CHECK(growths_after_raise > 0);
  for (void* p : weights) {
    w.free(p);
  }
}

namespace {

/// An offloading job's steps through the front end (Note [Frees in flight and the slack]): each
/// step allocates activations on stream 1 and frees them after handing them to a copy stream
/// (record_stream 2), which finishes only every few activations; some stay live for the step's
/// backward pass. Returns the peak reserved bytes; checks the invariants after every call and
/// that no block is handed out while another stream may still use it.
struct OffloadRun {
  std::size_t peak_reserved = 0;
  std::size_t peak_live = 0;  // policy's view: allocated + parked
  std::size_t peak_held = 0;  // allocated only
  double slack = 0;
  std::uint64_t parked_waits = 0;
};

OffloadRun run_offload_steps(const std::string& conf, std::uint64_t seed) {
  OracleFrontEnd f(conf, 8 * kGiB);
  OracleBackend& oracle = f.oracle;
  CachingAllocator<DefragPolicy>& a = f.a;
  std::mt19937_64 rng(seed);
  OffloadRun run;
  const auto note = [&] {
    a.check_invariants();
    REQUIRE(oracle.violations().empty());
    const Stats st = a.stats();
    run.peak_reserved = std::max(run.peak_reserved, static_cast<std::size_t>(st.reserved_bytes.current));
    run.peak_held = std::max(run.peak_held, static_cast<std::size_t>(st.allocated_bytes.current));
    run.peak_live = std::max(run.peak_live, a.policy().live_bytes());
  };
  for (int step = 0; step < 12; ++step) {
    std::vector<void*> kept;
    for (int i = 0; i < 32; ++i) {
      const std::size_t size = (2 + rng() % 126) * MiB;
      void* p = a.allocate(size, 1);
      const auto va = reinterpret_cast<std::uintptr_t>(p);
      oracle.use(1, va, size);
      note();
      if (rng() % 8 == 0) {
        kept.push_back(p);
        continue;
      }
      a.record_stream(p, 2);  // the copy to the host
      oracle.use(2, va, size);
      a.deallocate(p);
      note();
      if (i % 8 == 7) {
        oracle.complete(2);  // the copy stream caught up with the copies queued so far
      }
      if (i % 3 == 2) {
        oracle.complete(1);
      }
    }
    for (void* p : kept) {
      a.deallocate(p);
      note();
    }
  }
  oracle.complete(1);
  oracle.complete(2);
  a.empty_cache();
  a.check_invariants();
  run.slack = a.policy().counters().slack;
  run.parked_waits = a.stats().parked_waits;
  return run;
}

}  // namespace

TEST_CASE("defrag: the slack is measured against the bytes the program holds, not its frees in "
          "flight", "[defrag][streams]") {
  // Note [Frees in flight and the slack]. Slack fixed at 0.5. Stream 1 allocates four 100 MiB
  // activations, hands each to the copy stream and frees it (parked), with a small kept block
  // after each, then keeps a 100 MiB block: 506 MiB live, 400 of them parked, 106 held. Both
  // streams finish; the four 100 MiB holes come back apart. A 150 MiB request fits none of them.
  // Measured over all live bytes (peak 506 MiB) the slack covers its 75 pages with new ones; over
  // the held bytes (peak 106, 256 with the request) it allows 0.5 x 256 = 128 MiB of new pages,
  // and the rest moves from the holes.
  const bool counts_parked = GENERATE(false, true);
  CAPTURE(counts_parked);
  OracleFrontEnd f(std::string("grow_slack:0.5,max_grow_slack:0.5,move_budget:1,small_size:0,"
                               "slack_counts_parked:") +
                   (counts_parked ? "True" : "False"));
  OracleBackend& oracle = f.oracle;
  CachingAllocator<DefragPolicy>& a = f.a;
  std::vector<void*> kept;
  for (int i = 0; i < 4; ++i) {
    f.park(100 * MiB, 1, 2);
    kept.push_back(a.allocate(2 * MiB, 1));
  }
  kept.push_back(a.allocate(100 * MiB, 1));
  REQUIRE(a.pending_frees() == 4);
  const std::int64_t before = a.stats().reserved_bytes.current;
  CHECK(before >= static_cast<std::int64_t>(506 * MiB));
  CHECK(before <= static_cast<std::int64_t>(508 * MiB));  // a chunk rounded up to two pages
  oracle.complete(1);
  oracle.complete(2);
  const DefragCounters c0 = a.policy().counters();
  void* q = a.allocate(150 * MiB, 1);
  CHECK(a.pending_frees() == 0);
  const DefragCounters c1 = a.policy().counters();
  const std::int64_t after = a.stats().reserved_bytes.current;
  if (counts_parked) {
    CHECK(after == before + static_cast<std::int64_t>(150 * MiB));
    CHECK(c1.pages_moved == c0.pages_moved);
  } else {
    CHECK(after == before + static_cast<std::int64_t>(128 * MiB));
    CHECK(c1.pages_moved - c0.pages_moved == 11);
  }
  CHECK(oracle.violations().empty());
  a.deallocate(q);
  for (void* k : kept) {
    a.deallocate(k);
  }
  a.check_invariants();
  // An offloading job's steps keep every invariant and the stream oracle either way.
  const OffloadRun run = run_offload_steps(counts_parked ? "slack_counts_parked:True" : "", 3);
  CHECK(run.peak_live > 2 * run.peak_held);
}

TEST_CASE("defrag: wait_parked_to_grow waits for frees in flight instead of growing",
          "[defrag][streams][core]") {
  // Note [Waiting for frees in flight instead of growing] (allocator.h).
  SECTION("a request the parked free covers waits for it and takes its memory") {
    OracleFrontEnd f("grow_slack:0,wait_parked_to_grow:0");
    OracleBackend& oracle = f.oracle;
    CachingAllocator<DefragPolicy>& a = f.a;
    const std::uintptr_t va = f.park(64 * MiB, 1, 2);
    REQUIRE(a.pending_frees() == 1);
    const std::int64_t reserved = a.stats().reserved_bytes.current;
    void* q = a.allocate(64 * MiB, 1);  // stream 2 is busy: without the setting, a growth
    CHECK(reinterpret_cast<std::uintptr_t>(q) == va);
    CHECK(a.pending_frees() == 0);
    CHECK(a.stats().reserved_bytes.current == reserved);
    CHECK(a.stats().parked_waits == 1);
    CHECK(a.policy().counters().held_growths == 1);
    a.reset_accumulated_stats();
    CHECK(a.stats().parked_waits == 0);
    CHECK(a.stats().parked_wait_ns == 0);
    CHECK_FALSE(oracle.busy(reinterpret_cast<std::uintptr_t>(q), 64 * MiB, 1, /*any=*/false));
    CHECK(oracle.violations().empty());
    a.deallocate(q);
    a.check_invariants();
  }
  SECTION("without the setting, or with parked bytes within R x allocated, the policy grows") {
    const std::string conf = GENERATE(std::string(""), std::string("wait_parked_to_grow:1"));
    CAPTURE(conf);
    OracleFrontEnd f("grow_slack:0" + (conf.empty() ? "" : "," + conf));
    CachingAllocator<DefragPolicy>& a = f.a;
    void* live = a.allocate(128 * MiB, 1);  // allocated 128 MiB against 64 MiB parked
    f.park(64 * MiB, 1, 2);
    const std::int64_t reserved = a.stats().reserved_bytes.current;
    void* q = a.allocate(64 * MiB, 1);
    CHECK(a.pending_frees() == 1);
    CHECK(a.stats().reserved_bytes.current > reserved);
    CHECK(a.stats().parked_waits == 0);
    a.deallocate(q);
    a.deallocate(live);
    a.check_invariants();
  }
  SECTION("an offloading job holds about its allocated peak") {
    const OffloadRun waits = run_offload_steps("wait_parked_to_grow:0", 7);
    const OffloadRun grows = run_offload_steps("", 7);
    INFO("peak reserved " << waits.peak_reserved / MiB << " MiB vs " << grows.peak_reserved / MiB
                          << " MiB; peak held " << waits.peak_held / MiB);
    CHECK(waits.parked_waits > 0);
    CHECK(grows.parked_waits == 0);
    CHECK(waits.peak_reserved < grows.peak_reserved);
  }
  SECTION("settings") {
    Config bad = Config::parse("wait_parked_to_grow:-1");
    CHECK_THROWS_AS(CachingAllocator<DefragPolicy>(std::make_unique<OracleBackend>(kGiB), bad), ConfigError);
    Config other = Config::parse("wait_parked_to_grow:0");
    CHECK_THROWS_WITH(make_allocator("size_class", std::make_unique<SimBackend>(SimOptions{}), other),
                      Catch::Contains("cannot hold back a growth"));
  }
}

TEST_CASE("defrag: randomized sequences keep every invariant and the stream oracle happy",
          "[defrag][random]") {
  const std::uint64_t steps = CACHEALLOC_CHECK_LEVEL >= 3 ? 50000 : 10000;
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    run_oracle_sequence(seed, steps, /*faults=*/false);
  }
  for (std::uint64_t seed = 5; seed <= 6; ++seed) {
    run_oracle_sequence(seed, steps, /*faults=*/false, /*coalesce=*/true);
  }
}

TEST_CASE("defrag: randomized sequences with injected device failures", "[defrag][random][faults]") {
  const std::uint64_t steps = CACHEALLOC_CHECK_LEVEL >= 3 ? 50000 : 10000;
  for (std::uint64_t seed = 101; seed <= 104; ++seed) {
    run_oracle_sequence(seed, steps, /*faults=*/true);
  }
  for (std::uint64_t seed = 105; seed <= 106; ++seed) {
    run_oracle_sequence(seed, steps, /*faults=*/true, /*coalesce=*/true);
  }
}

TEST_CASE("defrag: the packed index key orders as (bucket, size, address)", "[defrag][index]") {
  // Note [One word ranks a hole]: rank = bucket << 43 | size / 512, compared with the address
  // as one 128-bit number. Against the three fields compared in turn, on random keys that share
  // buckets and sizes often, at the extremes of both fields too.
  using cachealloc::detail::IndexKey;
  using cachealloc::detail::kAlignment;
  using cachealloc::detail::kMaxClasses;
  std::mt19937_64 rng(24);
  const std::uint64_t top_size = (std::uint64_t{1} << 43) - 1;  // in 512-byte units
  const auto pick = [&]() {
    const std::uint32_t kind = static_cast<std::uint32_t>(rng() % 2);
    const std::uint32_t cls = rng() % 4 == 0 ? kMaxClasses - 1 : static_cast<std::uint32_t>(rng() % 3);
    const std::uint64_t units = rng() % 4 == 0 ? top_size - rng() % 2 : rng() % 5;
    const std::uintptr_t addr = rng() % 4 == 0 ? ~std::uintptr_t{0} - rng() % 2 * 512 : rng() % 3 * 512;
    return std::tuple{IndexKey::mapped_bucket(kind, cls), units * kAlignment, addr};
  };
  for (int i = 0; i < 20000; ++i) {
    const auto a = pick();
    const auto b = pick();
    const IndexKey ka{IndexKey::rank_of(std::get<0>(a), std::get<1>(a)), std::get<2>(a), nullptr};
    const IndexKey kb{IndexKey::rank_of(std::get<0>(b), std::get<1>(b)), std::get<2>(b), nullptr};
    REQUIRE(ka.bucket() == std::get<0>(a));
    REQUIRE(ka.size() == std::get<1>(a));
    REQUIRE((ka < kb) == (a < b));
  }
  // A search key for any size (not a multiple of 512) finds the first hole at least that large.
  const std::uint64_t bucket = IndexKey::mapped_bucket(1, 7);
  const IndexKey hole{IndexKey::rank_of(bucket, 2 * kAlignment), 0, nullptr};
  CHECK_FALSE(hole < IndexKey::at_least(bucket, 2 * kAlignment));
  CHECK_FALSE(hole < IndexKey::at_least(bucket, kAlignment + 1));
  CHECK(hole < IndexKey::at_least(bucket, 2 * kAlignment + 1));
  // Unmapped buckets (the kind and the stream class whose range it is) sort apart from each
  // other, and differ for every kind and class.
  CHECK(IndexKey::at_least(IndexKey::unmapped_bucket(0, 0), top_size * kAlignment) <
        IndexKey::at_least(IndexKey::unmapped_bucket(1, 0), 0));
  CHECK(IndexKey::at_least(IndexKey::unmapped_bucket(1, 0), top_size * kAlignment) <
        IndexKey::at_least(IndexKey::unmapped_bucket(0, 1), 0));
  std::set<std::uint64_t> buckets;
  for (std::uint32_t home = 0; home < detail::kStreamRanges; ++home) {
    for (std::uint32_t kind = 0; kind < 2; ++kind) {
      buckets.insert(IndexKey::unmapped_bucket(kind, home));
    }
  }
  CHECK(buckets.size() == 2 * detail::kStreamRanges);
}
