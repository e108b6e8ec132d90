// fuzz_entry.cpp: the fuzz target bodies (see fuzz_entry.h), shared by the libFuzzer
// executables (tests/fuzz/fuzz_*.cpp) and the regression test (tests/trace/test_fuzz_regressions.cpp).
//
// Note [What counts as a finding]
// An input may be refused only with the error type the API documents: trace::TraceError for
// snapshot bytes (decoding limits must keep std::bad_alloc out, so bad_alloc is a finding),
// ConfigError for configuration text, OutOfMemory inside a replay (replay::run counts it).
// Anything else escaping, a round trip that changes the data, or an InvariantError from
// check_invariants() aborts the process with a message naming the target and the check, which
// libFuzzer reports as a crash and Catch2 as a failed test run.
#include "fuzz_entry.h"

#include <cachealloc/allocator.h>
#include <cachealloc/config.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/sim_backend.h>
#include <cachealloc/trace/pickle.h>
#include <cachealloc/trace/snapshot.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <typeinfo>
#include <vector>

// replay.h comes with cachealloc_replay_lib (CACHEALLOC_BUILD_BENCH=ON); without it the replay
// target is a no-op.
#if __has_include("replay.h")
#include "replay.h"
#define CACHEALLOC_FUZZ_HAS_REPLAY 1
#else
#define CACHEALLOC_FUZZ_HAS_REPLAY 0
#endif
// Private to cachealloc_core, but the in-memory decompressor is exactly what read_snapshot()
// runs on a .xz file; going through a temporary file would only slow the fuzzer down.
#include "../../allocator/src/trace/xz.h"

namespace cachealloc::fuzz {
namespace {

constexpr std::size_t kSimCapacity = std::size_t{1} << 30;
/// The config target's device: small enough that a few allocations (sizes in
/// exercise_allocator, up to 300 MiB) run it out of memory and that the invariant checks,
/// which walk every mapped page, stay cheap (Note [Work per fuzz input]).
constexpr std::size_t kConfigSimCapacity = std::size_t{256} << 20;

[[noreturn]] void finding(const char* target, const std::string& what) {
#ifdef CACHEALLOC_FUZZ_THROW_FINDINGS
  throw FuzzFinding{std::string(target) + ": " + what};
#else
  std::fprintf(stderr, "\n==== cachealloc fuzz finding (%s): %s\n", target, what.c_str());
  std::fflush(stderr);
  std::abort();
#endif
}

/// Runs `body`; the documented error type `Allowed` means "input refused", everything else is
/// a finding.
template <typename Allowed, typename F>
bool refused_with(const char* target, const char* step, F&& body) {
  try {
    body();
    return false;
  } catch (const Allowed&) {
    return true;
  } catch (const FuzzFinding&) {
    throw;
  } catch (const std::exception& e) {
    finding(target, std::string(step) + ": unexpected " + typeid(e).name() + ": " + e.what());
  } catch (...) {
    finding(target, std::string(step) + ": unexpected non-std exception");
  }
}

std::span<const std::byte> as_bytes(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const std::byte*>(data), size};
}

bool same_double(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

/// Snapshot equality where a NaN threshold equals itself (Snapshot::operator== says NaN != NaN).
std::string snapshot_difference(const trace::Snapshot& a, const trace::Snapshot& b) {
  if (a.events.size() != b.events.size()) {
    return "event count " + std::to_string(a.events.size()) + " -> " + std::to_string(b.events.size());
  }
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    if (!(a.events[i] == b.events[i])) return "event " + std::to_string(i) + " differs";
  }
  if (a.device_count != b.device_count) {
    return "device_count " + std::to_string(a.device_count) + " -> " + std::to_string(b.device_count);
  }
  if (!(a.segments == b.segments)) return "segments differ";
  const trace::AllocatorSettings& x = a.settings;
  const trace::AllocatorSettings& y = b.settings;
  if (x.present != y.present) return "settings.present differs";
  if (x.conf_string != y.conf_string) return "settings.conf_string differs";
  if (x.max_split_size != y.max_split_size) return "settings.max_split_size differs";
  if (!same_double(x.garbage_collection_threshold, y.garbage_collection_threshold)) {
    return "settings.garbage_collection_threshold differs";
  }
  if (x.expandable_segments != y.expandable_segments) return "settings.expandable_segments differs";
  if (x.roundup_power2_divisions != y.roundup_power2_divisions) {
    return "settings.roundup_power2_divisions differ";
  }
  return {};
}

/// snapshot_from_value on the decoded pickle (together: parse_snapshot), then
/// write_snapshot_pickle -> parse_snapshot must give the same snapshot.
void snapshot_checks(const trace::Value& value, std::size_t pickle_bytes) {
  trace::Snapshot snapshot;
  if (refused_with<trace::TraceError>("snapshot", "snapshot_from_value", [&] {
        snapshot = trace::snapshot_from_value(value, "<fuzz>", pickle_bytes);
      })) {
    return;
  }
  std::string written;
  trace::Snapshot again;
  try {
    written = trace::write_snapshot_pickle(snapshot);
    again = trace::parse_snapshot(
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(written.data()), written.size()),
        "<fuzz round trip>");
  } catch (const std::exception& e) {
    finding("snapshot", std::string("round trip of an accepted snapshot threw ") +
                            typeid(e).name() + ": " + e.what());
  }
  if (const std::string diff = snapshot_difference(snapshot, again); !diff.empty()) {
    finding("snapshot", "write_snapshot_pickle -> parse_snapshot changed the snapshot: " + diff);
  }
}

/// Counts the nodes of `value` as a tree (shared containers once per reference), stopping once
/// `budget` is used up; false when the tree is larger than the budget.
bool tree_fits(const trace::Value& value, std::uint64_t& budget) {
  if (budget == 0) return false;
  --budget;
  if (value.is_sequence()) {
    for (const trace::Value& item : value.as_sequence()) {
      if (!tree_fits(item, budget)) return false;
    }
  } else if (value.is_dict()) {
    for (const auto& [k, v] : value.as_dict()) {
      if (!tree_fits(k, budget) || !tree_fits(v, budget)) return false;
    }
  }
  return true;
}

/// decode_pickle, then encode_pickle -> decode_pickle must give an equal Value; then the
/// snapshot checks on the same value (the pickle is decoded once: Note [Work per fuzz input]).
///
/// encode_pickle memoizes only short strings, so a value whose containers are shared through
/// the memo (hostile_shared_device_traces.pickle: 42 KB) is written out as its full tree, which
/// can be exponentially large; such values skip the round trip (limit: 1M tree nodes).
void pickle_and_snapshot_checks(std::span<const std::byte> pickle) {
  trace::DecodeOptions options;
  options.source_name = "<fuzz>";
  options.max_value_bytes = kMaxFuzzValueBytes;
  trace::Value value;
  if (refused_with<trace::TraceError>("snapshot", "decode_pickle",
                                      [&] { value = trace::decode_pickle(pickle, options); })) {
    return;
  }
  snapshot_checks(value, pickle.size());
  if (std::uint64_t budget = 1'000'000; !tree_fits(value, budget)) {
    return;
  }
  try {
    const std::string encoded = trace::encode_pickle(value);
    const trace::Value again = trace::decode_pickle(
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(encoded.data()), encoded.size()),
        options);
    if (!(again == value)) {
      finding("snapshot", "encode_pickle -> decode_pickle changed the value: " + value.repr() +
                              " -> " + again.repr());
    }
  } catch (const std::exception& e) {
    finding("snapshot", std::string("pickle round trip of a decoded value threw ") +
                            typeid(e).name() + ": " + e.what());
  }
}

// ---- config helpers ----

/// Every typed getter on every key of `config`; results must respect the requested bounds.
void exercise_getters(const Config& parsed) {
  Config c = parsed;
  for (const auto& entry : parsed.entries()) {
    const std::string& key = entry.first;
    auto allowed = [](auto&& body) { refused_with<ConfigError>("config", "take_*", body); };
    allowed([&] {
      const auto s = c.take_string(key);
      if (!s || *s != entry.second) finding("config", "take_string('" + key + "') differs from entries()");
    });
    allowed([&] { (void)c.take_bool(key); });
    for (const auto& [lo, hi] : {std::pair<std::int64_t, std::int64_t>{0, 1},
                                 {-1000, 1000},
                                 {std::numeric_limits<std::int64_t>::min(),
                                  std::numeric_limits<std::int64_t>::max()}}) {
      allowed([&, lo = lo, hi = hi] {
        const auto v = c.take_int(key, lo, hi);
        if (!v || *v < lo || *v > hi) finding("config", "take_int('" + key + "') out of bounds");
      });
    }
    for (const auto& [lo, hi] : {std::pair<double, double>{0.0, 1.0}, {-1e300, 1e300}}) {
      allowed([&, lo = lo, hi = hi] {
        const auto v = c.take_double(key, lo, hi);
        if (!v || !(*v >= lo && *v <= hi)) finding("config", "take_double('" + key + "') out of bounds");
      });
    }
    allowed([&] { (void)c.take_bytes(key); });
    allowed([&] {
      const auto list = c.take_list(key);
      if (!list || list->empty()) finding("config", "take_list('" + key + "') returned nothing");
    });
  }
  // Every key was taken: finish() must accept with no valid keys at all.
  try {
    c.finish("fuzz", {});
  } catch (const ConfigError& e) {
    finding("config", std::string("finish() rejected a taken key: ") + e.what());
  }
}

/// A few allocations on a fresh allocator, invariants after each step, everything freed at the end.
void exercise_allocator(DeviceAllocator& allocator, std::uint64_t seed) {
  static constexpr std::size_t kSizes[] = {1,       511,         512,         4096,     1048575,
                                           1 << 20, (1 << 20) + 1, 3 << 20,   10 << 20, (20 << 20) + 7,
                                           64 << 20, 300 << 20};
  std::vector<void*> live;
  for (int i = 0; i < 8; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    const std::size_t bytes = kSizes[(seed >> 33) % std::size(kSizes)];
    const StreamId stream = (seed >> 20) & 1;
    try {
      live.push_back(allocator.allocate(bytes, stream));
    } catch (const OutOfMemory&) {
    }
    allocator.check_invariants();
    if (((seed >> 40) & 3) == 0 && !live.empty()) {
      allocator.deallocate(live.front());
      live.erase(live.begin());
      allocator.check_invariants();
    }
  }
  for (void* p : live) {
    allocator.deallocate(p);
  }
  allocator.check_invariants();
  allocator.empty_cache();
  allocator.check_invariants();
  const Stats s = allocator.stats();
  if (s.allocated_bytes.current != 0 || s.requested_bytes.current != 0) {
    finding("config", "allocated/requested bytes not back to zero after freeing everything");
  }
}

#if CACHEALLOC_FUZZ_HAS_REPLAY
/// Note [Known bugs in campaigns]
/// libFuzzer stops at the first crash, so a known, reported and not yet fixed bug would end
/// every campaign within seconds. The fuzz executables (CACHEALLOC_FUZZ_SKIP_KNOWN_BUGS, set in
/// tests/fuzz/CMakeLists.txt) skip exactly the inputs that reach such a bug; the regression
/// test does not, so regressions/<target>/ keeps failing until the bug is fixed.
bool skip_known_bug([[maybe_unused]] const std::string& policy,
                    [[maybe_unused]] const replay::PreparedTrace& trace) {
#ifdef CACHEALLOC_FUZZ_SKIP_KNOWN_BUGS
  // No open bug to skip: see tests/fuzz/regressions/README.md for the ones found so far.
#endif
  return false;
}
#endif

}  // namespace

void fuzz_snapshot_one(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> input = as_bytes(data, size);
  if (trace::detail::has_xz_magic(input)) {
    std::vector<std::byte> plain;
    if (refused_with<trace::TraceError>("snapshot", "xz_decompress", [&] {
          plain = trace::detail::xz_decompress(input, kMaxFuzzDecompressedBytes, "<fuzz.xz>");
        })) {
      return;
    }
    if (plain.size() > kMaxFuzzDecompressedBytes) {
      finding("snapshot", "xz_decompress exceeded max_output_bytes");
    }
    pickle_and_snapshot_checks(plain);
    return;
  }
  pickle_and_snapshot_checks(input);
}

void fuzz_config_one(const std::uint8_t* data, std::size_t size, bool every_policy) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Config parsed;
  if (refused_with<ConfigError>("config", "Config::parse", [&] { parsed = Config::parse(text); })) {
    return;
  }
  // to_string() is canonical and round-trips.
  const std::string canonical = parsed.to_string();
  Config reparsed;
  if (refused_with<ConfigError>("config", "Config::parse(to_string())",
                                [&] { reparsed = Config::parse(canonical); })) {
    finding("config", "to_string() output '" + canonical + "' does not parse");
  }
  if (reparsed.entries() != parsed.entries()) {
    finding("config", "parse(to_string()) differs from the parsed entries: '" + canonical + "'");
  }
  if (reparsed.to_string() != canonical) {
    finding("config", "to_string() is not stable: '" + canonical + "'");
  }
  (void)parsed.policy();

  exercise_getters(parsed);

  // The allocator the text selects (as the plugin would build it) over a small simulated
  // device, or with `every_policy` each registered policy (Note [Work per fuzz input]); a name
  // that is not registered must be refused.
  std::uint64_t seed = 1469598103934665603ull;
  for (std::uint8_t b : std::span<const std::uint8_t>(data, size)) seed = (seed ^ b) * 1099511628211ull;
  std::vector<std::string> names;
  if (every_policy) {
    for (const PolicyInfo& info : registered_policies()) names.emplace_back(info.name);
  } else {
    names.push_back(parsed.policy());
  }
  for (const std::string& name : names) {
    const PolicyInfo* info = find_policy(name);
    Config config = parsed;
    std::unique_ptr<DeviceAllocator> allocator;
    const bool refused = refused_with<ConfigError>("config", "make_allocator", [&] {
      (void)config.take_string("policy");
      SimOptions options;
      options.capacity = kConfigSimCapacity;
      options.auto_complete_events = true;
      allocator = make_allocator(name, std::make_unique<SimBackend>(options), config);
      std::vector<std::string_view> valid = front_end_config_keys();
      if (info != nullptr) {
        for (std::string_view k : info->config_keys()) valid.push_back(k);
      }
      config.finish("policy " + name, valid);
    });
    if (info == nullptr && !refused) {
      finding("config", "policy '" + name + "' is not registered but was not refused");
    }
    if (refused || !allocator) continue;
    try {
      exercise_allocator(*allocator, seed);
    } catch (const std::exception& e) {
      finding("config", "policy " + name + " configured by '" + canonical + "': " +
                            typeid(e).name() + ": " + e.what());
    }
  }
}

void fuzz_replay_one(const std::uint8_t* data, std::size_t size, std::size_t max_events) {
#if CACHEALLOC_FUZZ_HAS_REPLAY
  trace::Snapshot snapshot;
  if (refused_with<trace::TraceError>("replay", "parse_snapshot", [&] {
        snapshot = trace::parse_snapshot(as_bytes(data, size), "<fuzz>");
      })) {
    return;
  }
  if (snapshot.events.size() > max_events) {
    snapshot.events.resize(max_events);  // Note [Work per fuzz input]
  }
  replay::PreparedTrace prepared;
  if (refused_with<trace::TraceError>("replay", "replay::prepare",
                                      [&] { prepared = replay::prepare(snapshot, "fuzz"); })) {
    return;
  }
  replay::ReplayOptions options;
  options.capacity = kSimCapacity;
  options.check_every = 1;
  for (const PolicyInfo& info : registered_policies()) {
    const std::string policy(info.name);
    if (skip_known_bug(policy, prepared)) continue;
    const std::string conf =
        policy == "native" ? replay::native_conf_from_settings(prepared.settings) : std::string();
    refused_with<ConfigError>("replay", ("replay::run policy " + policy).c_str(),
                              [&] { (void)replay::run(prepared, policy, conf, options); });
  }
#else
  (void)data;
  (void)size;
  (void)max_events;
#endif
}

bool fuzz_run_one(std::string_view target, const std::uint8_t* data, std::size_t size,
                  std::size_t max_replay_events, bool every_policy) {
  if (target == "snapshot") {
    fuzz_snapshot_one(data, size);
  } else if (target == "config") {
    fuzz_config_one(data, size, every_policy);
  } else if (target == "replay") {
    fuzz_replay_one(data, size, max_replay_events);
  } else {
    return false;
  }
  return true;
}

}  // namespace cachealloc::fuzz
