// snapshot.cpp: PyTorch memory snapshot reader (file -> xz -> decode_pickle -> Snapshot) and
// writer (Snapshot -> Value -> encode_pickle -> file). See snapshot.h.
#include "cachealloc/trace/snapshot.h"

#include <array>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdio>
#include <cstring>
#include <memory>

#include "xz.h"

namespace cachealloc::trace {

namespace {

constexpr std::array<std::string_view, 10> kActionNames = {
    "alloc",       "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap",  "snapshot",       "oom",           "other"};

constexpr std::string_view kSchemaHint =
    "expected the dict that torch.cuda.memory._snapshot() returns (save one with "
    "torch.cuda.memory._dump_snapshot(\"file.pickle\"))";

[[noreturn]] void schema_error(std::string_view source, std::string_view path,
                               std::string_view what) {
  std::string msg(source);
  msg += ": ";
  msg += path;
  msg += ": ";
  msg += what;
  msg += ". ";
  msg += kSchemaHint;
  throw TraceError(msg);
}

/// Where a value sits, formatted only when an error needs it: "device_traces[0][12]['size']".
struct Where {
  std::string_view source;
  std::string_view list;  // "device_traces", "segments", "allocator_settings" or ""
  std::size_t outer = SIZE_MAX;
  std::size_t inner = SIZE_MAX;

  [[nodiscard]] std::string path(std::string_view key = {}) const {
    std::string p = list.empty() ? std::string("the top-level dict") : std::string(list);
    if (outer != SIZE_MAX) p += "[" + std::to_string(outer) + "]";
    if (inner != SIZE_MAX) p += "[" + std::to_string(inner) + "]";
    if (!key.empty()) {
      p += "['";
      p += key;
      p += "']";
    }
    return p;
  }
  [[noreturn]] void fail(std::string_view key, std::string_view what) const {
    schema_error(source, path(key), what);
  }
  [[noreturn]] void wrong_type(std::string_view key, std::string_view expected,
                               const Value& v) const {
    std::string what = "expected ";
    what += expected;
    what += ", got ";
    what += v.type_name();
    if (!v.is_none()) what += " " + v.repr();
    fail(key, what);
  }
};

/// An int as uint64, negative values wrapping (pointers that PyTorch cast to int64).
std::uint64_t wrapping_u64(const Value& v, const Where& w, std::string_view key) {
  if (v.kind() == Value::Kind::integer) return static_cast<std::uint64_t>(v.as_int());
  if (v.kind() == Value::Kind::unsigned_integer) return v.as_uint();
  w.wrong_type(key, "int", v);
}

std::uint64_t non_negative(const Value& v, const Where& w, std::string_view key) {
  if (v.kind() == Value::Kind::integer) {
    if (v.as_int() < 0) w.fail(key, "must not be negative, got " + v.repr());
    return static_cast<std::uint64_t>(v.as_int());
  }
  if (v.kind() == Value::Kind::unsigned_integer) return v.as_uint();
  w.wrong_type(key, "int", v);
}

std::int64_t int64(const Value& v, const Where& w, std::string_view key) {
  if (v.kind() == Value::Kind::integer) return v.as_int();
  w.wrong_type(key, "int in the int64 range", v);
}

const std::vector<Value>& list_of(const Value& v, const Where& w, std::string_view key) {
  if (!v.is_list()) w.wrong_type(key, "list", v);
  return v.as_list();
}

const Dict& dict_of(const Value& v, const Where& w, std::string_view key = {}) {
  if (!v.is_dict()) w.wrong_type(key, "dict", v);
  return v.as_dict();
}

void read_events(const Value& traces, std::string_view source, std::uint64_t input_bytes,
                 Snapshot& out) {
  const Where top{source, "", SIZE_MAX, SIZE_MAX};
  const auto& devices = list_of(traces, top, "device_traces");
  if (devices.size() > static_cast<std::size_t>(INT_MAX)) {
    top.fail("device_traces", "holds " + std::to_string(devices.size()) + " devices");
  }
  std::uint64_t total = 0;
  for (std::size_t d = 0; d < devices.size(); ++d) {
    total += list_of(devices[d], Where{source, "device_traces", d, SIZE_MAX}, {}).size();
  }
  // Each entry costs at least one byte of pickle unless lists are shared through the memo,
  // which only a hostile file does: bound the work by the input size.
  if (total > input_bytes) {
    top.fail("device_traces",
             "holds " + std::to_string(total) + " entries but the pickle has only " +
                 std::to_string(input_bytes) +
                 " bytes: its lists are shared many times (a corrupt or hostile file)");
  }
  out.device_count = devices.size();
  out.events.reserve(static_cast<std::size_t>(total));

  enum Field : unsigned { kAction = 1, kAddr = 2, kSize = 4, kStream = 8 };
  for (std::size_t d = 0; d < devices.size(); ++d) {
    const auto& entries = devices[d].as_list();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const Where w{source, "device_traces", d, i};
      const Dict& entry = dict_of(entries[i], w);
      TraceEvent ev;
      ev.device = static_cast<int>(d);
      unsigned seen = 0;
      for (const auto& [k, v] : entry) {
        if (!k.is_str()) continue;
        const std::string& key = k.as_str();
        if (key == "action") {
          if (!v.is_str()) w.wrong_type(key, "str", v);
          ev.action = action_from_string(v.as_str());
          seen |= kAction;
        } else if (key == "addr") {
          ev.addr = wrapping_u64(v, w, key);
          seen |= kAddr;
        } else if (key == "size") {
          ev.size = non_negative(v, w, key);
          seen |= kSize;
        } else if (key == "stream") {
          ev.stream = wrapping_u64(v, w, key);
          seen |= kStream;
        } else if (key == "time_us") {
          ev.time_us = int64(v, w, key);
        }
      }
      if (seen != (kAction | kAddr | kSize | kStream)) {
        const char* missing = (seen & kAction) == 0 ? "action"
                              : (seen & kAddr) == 0 ? "addr"
                              : (seen & kSize) == 0 ? "size"
                                                    : "stream";
        w.fail({}, std::string("the entry has no '") + missing + "' key");
      }
      out.events.push_back(ev);
    }
  }
}

void read_segments(const Value& segments, std::string_view source, std::uint64_t input_bytes,
                   Snapshot& out) {
  const Where top{source, "", SIZE_MAX, SIZE_MAX};
  const auto& list = list_of(segments, top, "segments");
  if (list.size() > input_bytes) {
    top.fail("segments",
             "holds more entries than the pickle has bytes (a corrupt or hostile file)");
  }
  out.segments.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    const Where w{source, "segments", i, SIZE_MAX};
    const Dict& seg = dict_of(list[i], w);
    SegmentInfo info;
    const Value* device = seg.find("device");
    const Value* address = seg.find("address");
    const Value* total_size = seg.find("total_size");
    if (device == nullptr) w.fail({}, "the segment has no 'device' key");
    if (address == nullptr) w.fail({}, "the segment has no 'address' key");
    if (total_size == nullptr) w.fail({}, "the segment has no 'total_size' key");
    const std::uint64_t dev = non_negative(*device, w, "device");
    if (dev > static_cast<std::uint64_t>(INT_MAX)) w.fail("device", "is out of range");
    info.device = static_cast<int>(dev);
    info.address = wrapping_u64(*address, w, "address");
    info.total_size = non_negative(*total_size, w, "total_size");
    if (const Value* v = seg.find("allocated_size"))
      info.allocated_size = non_negative(*v, w, "allocated_size");
    if (const Value* v = seg.find("stream")) info.stream = wrapping_u64(*v, w, "stream");
    if (const Value* v = seg.find("segment_type")) {
      if (!v->is_str()) w.wrong_type("segment_type", "str", *v);
      info.segment_type = v->as_str();
    }
    if (const Value* v = seg.find("is_expandable")) {
      if (!v->is_bool()) w.wrong_type("is_expandable", "bool", *v);
      info.is_expandable = v->as_bool();
    }
    out.segments.push_back(std::move(info));
  }
}

void read_settings(const Value& value, std::string_view source, AllocatorSettings& out) {
  const Where w{source, "allocator_settings", SIZE_MAX, SIZE_MAX};
  const Dict& settings =
      dict_of(value, Where{source, "", SIZE_MAX, SIZE_MAX}, "allocator_settings");
  out.present = !settings.empty();
  if (const Value* v = settings.find("PYTORCH_CUDA_ALLOC_CONF"); v != nullptr && !v->is_none()) {
    if (!v->is_str()) w.wrong_type("PYTORCH_CUDA_ALLOC_CONF", "str", *v);
    out.conf_string = v->as_str();
  }
  if (const Value* v = settings.find("max_split_size"))
    out.max_split_size = int64(*v, w, "max_split_size");
  if (const Value* v = settings.find("garbage_collection_threshold")) {
    if (!v->is_float() && !v->is_int()) w.wrong_type("garbage_collection_threshold", "float", *v);
    out.garbage_collection_threshold = v->as_float();
  }
  if (const Value* v = settings.find("expandable_segments")) {
    if (!v->is_bool()) w.wrong_type("expandable_segments", "bool", *v);
    out.expandable_segments = v->as_bool();
  }
  if (const Value* v = settings.find("roundup_power2_divisions")) {
    const Dict& divisions = dict_of(*v, w, "roundup_power2_divisions");
    out.roundup_power2_divisions.reserve(divisions.size());
    for (const auto& [key, count] : divisions) {
      std::uint64_t interval = 0;
      if (key.is_str()) {  // PyTorch writes the MiB interval as a string: "1", "2", ... "32768"
        const std::string& text = key.as_str();
        const auto r = std::from_chars(text.data(), text.data() + text.size(), interval);
        if (text.empty() || r.ec != std::errc{} || r.ptr != text.data() + text.size()) {
          w.fail("roundup_power2_divisions", "has the key " + key.repr() + ", not a number of MiB");
        }
      } else {
        interval = non_negative(key, w, "roundup_power2_divisions");
      }
      out.roundup_power2_divisions.emplace_back(interval,
                                                non_negative(count, w, "roundup_power2_divisions"));
    }
  }
}

/// Progress of one phase mapped onto [base, base + span] of the caller's scale.
std::function<void(double)> scaled(const std::function<void(double)>& progress, double base,
                                   double span) {
  if (!progress) return {};
  return [&progress, base, span](double f) { progress(base + span * f); };
}

Snapshot parse_with_progress(std::span<const std::byte> pickle_bytes, std::string_view source_name,
                             std::function<void(double)> progress) {
  DecodeOptions options;
  options.source_name = source_name;
  options.progress = std::move(progress);
  const Value root = decode_pickle(pickle_bytes, options);
  return snapshot_from_value(root, source_name, pickle_bytes.size());
}

/// Throws "<file>: <what>: <strerror(errno)><hint>", reading errno before anything else runs.
[[noreturn]] void throw_io_error(const std::string& file, std::string_view what,
                                 std::string_view hint = {}) {
  const std::string reason = std::strerror(errno);
  std::string msg = file;
  msg += ": ";
  msg += what;
  msg += ": ";
  msg += reason;
  msg += hint;
  throw TraceError(msg);
}

struct FileCloser {
  void operator()(std::FILE* f) const noexcept { std::fclose(f); }
};

}  // namespace

std::string_view to_string(Action action) noexcept {
  const auto i = static_cast<std::size_t>(action);
  return i < kActionNames.size() ? kActionNames[i] : "other";
}

Action action_from_string(std::string_view name) noexcept {
  for (std::size_t i = 0; i + 1 < kActionNames.size(); ++i) {
    if (kActionNames[i] == name) return static_cast<Action>(i);
  }
  return Action::other;
}

Snapshot snapshot_from_value(const Value& root, std::string_view source_name,
                             std::uint64_t input_bytes) {
  const Where top{source_name, "", SIZE_MAX, SIZE_MAX};
  if (!root.is_dict()) {
    schema_error(source_name, "the top level",
                 "expected dict, got " + std::string(root.type_name()) + " " + root.repr());
  }
  const Dict& dict = root.as_dict();
  Snapshot out;
  const Value* traces = dict.find("device_traces");
  if (traces == nullptr) top.fail({}, "there is no 'device_traces' key");
  read_events(*traces, source_name, input_bytes, out);
  if (const Value* segments = dict.find("segments"))
    read_segments(*segments, source_name, input_bytes, out);
  if (const Value* settings = dict.find("allocator_settings"))
    read_settings(*settings, source_name, out.settings);
  return out;
}

Snapshot parse_snapshot(std::span<const std::byte> pickle_bytes, std::string_view source_name) {
  return parse_with_progress(pickle_bytes, source_name, {});
}

namespace {
/// The file's bytes, xz-decompressed when it starts with the xz magic (decompression progress
/// goes to [0, 0.5] of options.progress).
std::vector<std::byte> load_file(const std::filesystem::path& file, const ReadOptions& options,
                                 bool& compressed) {
  const std::string name = file.string();
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(name.c_str(), "rb"));
  if (!f) throw_io_error(name, "cannot open", ". Check the path");
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(file, ec);
  if (ec) throw TraceError(name + ": cannot read its size: " + ec.message());
  if (size > options.max_decompressed_bytes) {
    throw TraceError(
        name + ": is " + std::to_string(size) + " bytes, more than the cap of " +
        std::to_string(options.max_decompressed_bytes) +
        " (ReadOptions::max_decompressed_bytes); raise the cap if the file is genuine");
  }
  std::vector<std::byte> data(static_cast<std::size_t>(size));
  if (size > 0 && std::fread(data.data(), 1, data.size(), f.get()) != data.size()) {
    if (std::ferror(f.get())) throw_io_error(name, "cannot read");
    throw TraceError(name + ": cannot read: the file shrank while being read");
  }
  compressed = detail::has_xz_magic(data);
  if (!compressed) return data;
  return detail::xz_decompress(data, options.max_decompressed_bytes, name,
                               scaled(options.progress, 0.0, 0.5));
}
}  // namespace

std::vector<std::byte> read_pickle_bytes(const std::filesystem::path& file,
                                         const ReadOptions& options) {
  bool compressed = false;
  return load_file(file, options, compressed);
}

Snapshot read_snapshot(const std::filesystem::path& file, const ReadOptions& options) {
  if (options.progress) options.progress(0.0);
  bool compressed = false;
  const std::vector<std::byte> bytes = load_file(file, options, compressed);
  const double base = compressed ? 0.5 : 0.0;
  const std::string source = file.string() + (compressed ? " (decompressed)" : "");
  Snapshot snapshot =
      parse_with_progress(bytes, source, scaled(options.progress, base, 0.95 - base));
  if (options.progress) options.progress(1.0);
  return snapshot;
}

Value snapshot_to_value(const Snapshot& snapshot) {
  std::size_t devices = snapshot.device_count;
  for (std::size_t i = 0; i < snapshot.events.size(); ++i) {
    const int d = snapshot.events[i].device;
    if (d < 0) {
      throw TraceError("write_snapshot: event " + std::to_string(i) +
                       " has the negative device index " + std::to_string(d) +
                       "; give every event its device_traces index");
    }
    devices = std::max(devices, static_cast<std::size_t>(d) + 1);
  }

  // Shared key and constant strings: one node each, memoized once by the encoder.
  const Value k_action("action"), k_addr("addr"), k_size("size"), k_stream("stream"),
      k_time("time_us"), k_context("compile_context"), k_metadata("user_metadata");
  const Value na("N/A"), empty("");
  std::array<Value, kActionNames.size()> actions;
  for (std::size_t i = 0; i < actions.size(); ++i) actions[i] = Value(kActionNames[i]);

  std::vector<std::vector<Value>> per_device(devices);
  for (const TraceEvent& ev : snapshot.events) {
    per_device[static_cast<std::size_t>(ev.device)].push_back(Value::dict(Dict{
        {k_action, actions[static_cast<std::size_t>(ev.action) % actions.size()]},
        {k_addr, Value(ev.addr)},
        {k_size, Value(ev.size)},
        {k_stream, Value(ev.stream)},
        {k_time, Value(ev.time_us)},
        {k_context, na},
        {k_metadata, empty},
    }));
  }
  std::vector<Value> traces;
  traces.reserve(devices);
  for (auto& list : per_device) traces.push_back(Value::list(std::move(list)));

  std::vector<Value> segments;
  segments.reserve(snapshot.segments.size());
  for (const SegmentInfo& s : snapshot.segments) {
    segments.push_back(Value::dict(Dict{
        {"device", Value(s.device)},
        {"address", Value(s.address)},
        {"total_size", Value(s.total_size)},
        {"allocated_size", Value(s.allocated_size)},
        {"stream", Value(s.stream)},
        {"segment_type", Value(s.segment_type)},
        {"is_expandable", Value(s.is_expandable)},
        {"blocks", Value::list({})},
        {"frames", Value::list({})},
    }));
  }

  Dict settings;
  const AllocatorSettings& a = snapshot.settings;
  if (a.present) {
    std::vector<Dict::Item> divisions;
    for (const auto& [interval, count] : a.roundup_power2_divisions) {
      divisions.emplace_back(Value(std::to_string(interval)), Value(count));
    }
    settings = Dict{
        {"PYTORCH_CUDA_ALLOC_CONF", Value(a.conf_string)},
        {"max_split_size", Value(a.max_split_size)},
        {"garbage_collection_threshold", Value(a.garbage_collection_threshold)},
        {"expandable_segments", Value(a.expandable_segments)},
        {"roundup_power2_divisions", Value::dict(Dict(std::move(divisions)))},
    };
  }

  return Value::dict(Dict{
      {"segments", Value::list(std::move(segments))},
      {"device_traces", Value::list(std::move(traces))},
      {"allocator_settings", Value::dict(std::move(settings))},
      {"external_annotations", Value::list({})},
  });
}

std::string write_snapshot_pickle(const Snapshot& snapshot) {
  return encode_pickle(snapshot_to_value(snapshot));
}

void write_snapshot(const std::filesystem::path& file, const Snapshot& snapshot) {
  const std::string name = file.string();
  const std::string pickle = write_snapshot_pickle(snapshot);
  std::vector<std::byte> compressed;
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(pickle.data()),
                                   pickle.size());
  if (file.extension() == ".xz") {
    compressed = detail::xz_compress(bytes, name);
    bytes = compressed;
  }
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(name.c_str(), "wb"));
  if (!f)
    throw_io_error(name, "cannot create", ". Check that the directory exists and is writable");
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f.get()) != bytes.size()) {
    throw_io_error(name, "cannot write");
  }
  if (std::fclose(f.release()) != 0) throw_io_error(name, "cannot write");
}

}  // namespace cachealloc::trace
