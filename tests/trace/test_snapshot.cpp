// test_snapshot.cpp: reading the real H200 snapshots in tests/data/traces, validation errors,
// writing and reading back, and hostile or damaged files.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachealloc/trace/snapshot.h"

#ifndef CACHEALLOC_TRACE_DIR
#error "CACHEALLOC_TRACE_DIR must name tests/data/traces (set by CMake)"
#endif

using cachealloc::trace::Action;
using cachealloc::trace::Dict;
using cachealloc::trace::encode_pickle;
using cachealloc::trace::parse_snapshot;
using cachealloc::trace::read_pickle_bytes;
using cachealloc::trace::read_snapshot;
using cachealloc::trace::ReadOptions;
using cachealloc::trace::SegmentInfo;
using cachealloc::trace::Snapshot;
using cachealloc::trace::TraceError;
using cachealloc::trace::TraceEvent;
using cachealloc::trace::Value;
using cachealloc::trace::write_snapshot;
using cachealloc::trace::write_snapshot_pickle;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

namespace {

const std::filesystem::path kTraceDir(CACHEALLOC_TRACE_DIR);
#ifdef CACHEALLOC_TEST_DATA_DIR
const std::filesystem::path kHostileDir = std::filesystem::path(CACHEALLOC_TEST_DATA_DIR) / "hostile";
#else
const std::filesystem::path kHostileDir = kTraceDir.parent_path() / "hostile";
#endif

std::span<const std::byte> span_of(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::size_t count(const Snapshot& s, Action a) {
  return static_cast<std::size_t>(std::count_if(
      s.events.begin(), s.events.end(), [a](const TraceEvent& e) { return e.action == a; }));
}

/// parse_snapshot of an encoded Value; returns the TraceError message.
std::string parse_error(const Value& v) {
  const std::string data = encode_pickle(v);
  try {
    (void)parse_snapshot(span_of(data), "t.pickle");
  } catch (const TraceError& e) {
    return e.what();
  }
  FAIL("parse_snapshot accepted it");
  return {};
}

Value entry(Value action, Value addr, Value size, Value stream) {
  return Value::dict(
      {{"action", action}, {"addr", addr}, {"size", size}, {"stream", stream}, {"time_us", 1}});
}

Value snapshot_with(std::vector<Value> entries) {
  return Value::dict({{"device_traces", Value::list({Value::list(std::move(entries))})}});
}

/// A scratch file removed at scope exit.
struct TempFile {
  std::filesystem::path path;
  explicit TempFile(const std::string& name)
      : path(std::filesystem::temp_directory_path() /
             ("cachealloc_" + std::to_string(::getpid()) + "_" + name)) {}
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

const Snapshot& gpt2() {
  static const Snapshot s = read_snapshot(kTraceDir / "gpt2_train_varlen.pickle.xz");
  return s;
}

}  // namespace

TEST_CASE("snapshot: gpt2_train_varlen has the documented events", "[trace][snapshot]") {
  const Snapshot& s = gpt2();
  CHECK(s.events.size() == 102633);
  CHECK(s.device_count == 1);
  CHECK(count(s, Action::alloc) == 34150);
  CHECK(count(s, Action::free_requested) == 34147);
  CHECK(count(s, Action::free_completed) == 34147);
  CHECK(count(s, Action::segment_alloc) == 189);
  CHECK(count(s, Action::other) == 0);
  CHECK(std::all_of(s.events.begin(), s.events.end(),
                    [](const TraceEvent& e) { return e.device == 0 && e.stream == 0; }));
  CHECK(std::is_sorted(
      s.events.begin(), s.events.end(),
      [](const TraceEvent& a, const TraceEvent& b) { return a.time_us < b.time_us; }));
  CHECK(s.events.front().action == Action::segment_alloc);
  CHECK(s.segments.size() == 189);
  CHECK(s.settings.present);
  CHECK_FALSE(s.settings.expandable_segments);
  CHECK(s.settings.max_split_size == -1);
  CHECK(s.settings.roundup_power2_divisions.size() == 16);
  CHECK(s.settings.roundup_power2_divisions.back().first == 32768);

  // Replaying the segment entries gives PyTorch's reserved peak (README: 28,705,816,576 bytes).
  std::uint64_t reserved = 0;
  std::uint64_t peak = 0;
  for (const TraceEvent& e : s.events) {
    if (e.action == Action::segment_alloc) reserved += e.size;
    if (e.action == Action::segment_free) reserved -= e.size;
    peak = std::max(peak, reserved);
  }
  CHECK(peak == 28705816576ULL);
}

TEST_CASE("snapshot: resnet50_train_expandable maps segments and records its settings",
          "[trace][snapshot]") {
  const Snapshot s = read_snapshot(kTraceDir / "resnet50_train_expandable.pickle.xz");
  CHECK(s.events.size() == 52164);
  CHECK(count(s, Action::segment_map) == 111);
  CHECK(count(s, Action::segment_alloc) == 0);
  CHECK(s.settings.present);
  CHECK(s.settings.expandable_segments);
  CHECK(s.settings.conf_string == "expandable_segments:True");
  REQUIRE_FALSE(s.segments.empty());
  CHECK(s.segments.front().is_expandable);
  std::uint64_t reserved = 0;
  std::uint64_t peak = 0;
  for (const TraceEvent& e : s.events) {
    if (e.action == Action::segment_map) reserved += e.size;
    if (e.action == Action::segment_unmap) reserved -= e.size;
    peak = std::max(peak, reserved);
  }
  CHECK(peak == 3225419776ULL);
}

TEST_CASE("snapshot: mlp_two_streams uses two streams, resnet50_train reads", "[trace][snapshot]") {
  const Snapshot s = read_snapshot(kTraceDir / "mlp_two_streams.pickle.xz");
  CHECK(s.events.size() == 9762);
  std::set<std::uint64_t> streams;
  for (const TraceEvent& e : s.events) streams.insert(e.stream);
  CHECK(streams == std::set<std::uint64_t>{0, 458470720});
  CHECK(read_snapshot(kTraceDir / "resnet50_train.pickle.xz").events.size() == 52171);
}

TEST_CASE("snapshot: write then parse gives the same snapshot", "[trace][snapshot]") {
  const std::string pickle = write_snapshot_pickle(gpt2());
  CHECK(parse_snapshot(span_of(pickle), "roundtrip") == gpt2());

  // Files, plain and xz (a smaller trace: xz at its default preset takes seconds on gpt2).
  const Snapshot s = read_snapshot(kTraceDir / "mlp_two_streams.pickle.xz");
  TempFile plain("roundtrip.pickle");
  TempFile xz("roundtrip.pickle.xz");
  write_snapshot(plain.path, s);
  write_snapshot(xz.path, s);
  CHECK(std::filesystem::file_size(xz.path) < std::filesystem::file_size(plain.path) / 4);
  CHECK(read_snapshot(plain.path) == s);
  CHECK(read_snapshot(xz.path) == s);
}

TEST_CASE("snapshot: a hand-built snapshot with several devices round-trips", "[trace][snapshot]") {
  Snapshot s;
  s.device_count = 3;  // device 1 has no events
  s.events = {
      {Action::segment_alloc, 0, 1 << 20, 1 << 20, 0, 10},
      {Action::alloc, 0, 1 << 20, 512, 0, 11},
      {Action::oom, 0, 0, 1ull << 40, 0, -5},
      {Action::segment_map, 2, 0xFFFF'FFFF'FFFF'0000ull, 2 << 20, 0x8000'0000'0000'0001ull, 12},
      {Action::other, 2, 0, 0, 7, 13},
      {Action::snapshot, 2, 0, 0, 7, 14},
  };
  s.segments.push_back(SegmentInfo{2, 4096, 2 << 20, 512, 7, "large", true});
  s.settings.present = true;
  s.settings.conf_string = "max_split_size_mb:128";
  s.settings.max_split_size = 128 << 20;
  s.settings.garbage_collection_threshold = 0.5;
  s.settings.roundup_power2_divisions = {{1, 4}, {2, 0}};
  CHECK(parse_snapshot(span_of(write_snapshot_pickle(s))) == s);

  Snapshot empty;
  const Snapshot back = parse_snapshot(span_of(write_snapshot_pickle(empty)));
  CHECK(back == empty);
  CHECK_FALSE(back.settings.present);

  Snapshot bad;
  bad.events.push_back({Action::alloc, -1, 0, 0, 0, 0});
  CHECK_THROWS_WITH(write_snapshot_pickle(bad), Contains("negative device index -1"));
}

TEST_CASE("snapshot: unknown actions read as other, extra keys are ignored", "[trace][snapshot]") {
  const Value v = Value::dict({
      {"device_traces", Value::list({Value::list({Value::dict({{"action", "future_action"},
                                                               {"addr", 1},
                                                               {"size", 2},
                                                               {"stream", -1},
                                                               {"frames", Value::list({})}})})})},
      {"something_new", Value::tuple({1, 2})},
  });
  const std::string data = encode_pickle(v);
  const Snapshot s = parse_snapshot(span_of(data));
  REQUIRE(s.events.size() == 1);
  CHECK(s.events[0].action == Action::other);
  CHECK(s.events[0].stream ==
        ~std::uint64_t{0});  // negative ints wrap, as cudaStream_t cast to int64
  CHECK(s.events[0].time_us == 0);
  CHECK(cachealloc::trace::to_string(Action::segment_unmap) == "segment_unmap");
  CHECK(cachealloc::trace::action_from_string("free_completed") == Action::free_completed);
}

TEST_CASE("snapshot: schema errors name the key and the entry", "[trace][snapshot]") {
  CHECK_THAT(parse_error(Value::list({})),
             StartsWith("t.pickle: the top level: expected dict, got list"));
  CHECK_THAT(parse_error(Value::dict({{"segments", Value::list({})}})),
             Contains("t.pickle: the top-level dict: there is no 'device_traces' key"));
  CHECK_THAT(parse_error(Value::dict({{"device_traces", Value::dict({})}})),
             Contains("the top-level dict['device_traces']: expected list, got dict"));
  CHECK_THAT(parse_error(Value::dict({{"device_traces", Value::list({1})}})),
             Contains("device_traces[0]: expected list, got int 1"));
  const Value good = entry("alloc", 1, 2, 0);
  CHECK_THAT(parse_error(snapshot_with({good, "x"})),
             Contains("device_traces[0][1]: expected dict, got str 'x'"));
  CHECK_THAT(parse_error(snapshot_with(
                 {good, good, Value::dict({{"action", "alloc"}, {"size", 1}, {"stream", 0}})})),
             Contains("device_traces[0][2]: the entry has no 'addr' key"));
  CHECK_THAT(parse_error(snapshot_with({good, entry("alloc", 1, -4, 0)})),
             Contains("device_traces[0][1]['size']: must not be negative, got -4"));
  CHECK_THAT(parse_error(snapshot_with({entry("alloc", 1, "big", 0)})),
             Contains("device_traces[0][0]['size']: expected int, got str 'big'"));
  CHECK_THAT(parse_error(snapshot_with({entry(5, 1, 2, 0)})),
             Contains("device_traces[0][0]['action']: expected str"));
  CHECK_THAT(parse_error(snapshot_with({entry("alloc", 1.5, 2, 0)})),
             Contains("['addr']: expected int, got float 1.5"));
  CHECK_THAT(parse_error(Value::dict({{"device_traces", Value::list({})},
                                      {"segments", Value::list({Value::dict({})})}})),
             Contains("segments[0]: the segment has no 'device' key"));
  CHECK_THAT(
      parse_error(Value::dict({{"device_traces", Value::list({})},
                               {"allocator_settings", Value::dict({{"expandable_segments", 1}})}})),
      Contains("allocator_settings['expandable_segments']: expected bool, got int 1"));
  CHECK_THAT(parse_error(Value::dict(
                 {{"device_traces", Value::list({})},
                  {"allocator_settings",
                   Value::dict({{"roundup_power2_divisions", Value::dict({{"x", 1}})}})}})),
             Contains("has the key 'x', not a number of MiB"));
  // Every schema error says what to do.
  CHECK_THAT(parse_error(Value::list({})), Contains("torch.cuda.memory._dump_snapshot"));
}

TEST_CASE("snapshot: the real gpt2 pickle cut at 200 offsets is always a TraceError",
          "[trace][snapshot][hostile]") {
  const std::vector<std::byte> bytes = read_pickle_bytes(kTraceDir / "gpt2_train_varlen.pickle.xz");
  REQUIRE(bytes.size() == 7452390);
  for (int i = 0; i < 200; ++i) {
    const std::size_t cut = bytes.size() * static_cast<std::size_t>(i) / 200;
    INFO("cut at " << cut);
    try {
      (void)parse_snapshot(std::span(bytes).first(cut), "gpt2");
      FAIL("a truncated pickle parsed");
    } catch (const TraceError& e) {
      CHECK_THAT(std::string(e.what()), StartsWith("gpt2: byte "));
      CHECK(e.offset() <= cut);
    }
  }
}

TEST_CASE("snapshot: damaged and hostile files give TraceErrors that start with the file name",
          "[trace][snapshot][hostile]") {
  const auto error_of = [](const std::filesystem::path& file,
                           const ReadOptions& options = {}) -> std::string {
    try {
      (void)read_snapshot(file, options);
    } catch (const TraceError& e) {
      return e.what();
    }
    FAIL("read_snapshot accepted " << file);
    return {};
  };
  const std::string truncated = (kHostileDir / "truncated.pickle.xz").string();
  CHECK_THAT(error_of(truncated),
             StartsWith(truncated + ": compressed byte ") && Contains("truncated"));

  ReadOptions small_cap;
  small_cap.max_decompressed_bytes = 1 << 20;
  const std::string bomb = (kHostileDir / "bomb_64mib.pickle.xz").string();
  CHECK_THAT(error_of(bomb, small_cap),
             StartsWith(bomb + ": decompresses to more than 1048576 bytes") &&
                 Contains("max_decompressed_bytes"));

  const std::string shared = (kHostileDir / "shared_device_traces.pickle").string();
  CHECK_THAT(error_of(shared),
             StartsWith(shared + ": the top-level dict['device_traces']: holds 20000000 entries"));

  const std::string missing = (kHostileDir / "no_such_file.pickle").string();
  CHECK_THAT(error_of(missing), StartsWith(missing + ": cannot open: "));

  for (const auto& item : std::filesystem::directory_iterator(kHostileDir)) {
    const std::string name = item.path().string();
    if (name.ends_with(".py") || name.ends_with("bomb_64mib.pickle.xz")) continue;
    INFO(name);
    CHECK_THAT(error_of(item.path()),
               StartsWith(name + ": ") || StartsWith(name + " (decompressed): "));
  }
  CHECK_FALSE(std::filesystem::exists("/tmp/cachealloc_pwned_" + std::to_string(::getpid())));
}

TEST_CASE("snapshot: read_snapshot reports progress from 0 to 1", "[trace][snapshot]") {
  std::vector<double> seen;
  ReadOptions options;
  options.progress = [&](double f) { seen.push_back(f); };
  (void)read_snapshot(kTraceDir / "mlp_two_streams.pickle.xz", options);
  REQUIRE(seen.size() > 2);
  CHECK(seen.front() == 0.0);
  CHECK(seen.back() == 1.0);
  CHECK(std::is_sorted(seen.begin(), seen.end()));
}
