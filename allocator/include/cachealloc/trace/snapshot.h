// snapshot.h: PyTorch CUDA memory snapshots (torch.cuda.memory._snapshot(), saved by
// _dump_snapshot() or pickle.dump, optionally xz-compressed) as plain C++ data, read safely
// through decode_pickle() and written back in the same format.
//
// What is read (everything else in the snapshot is ignored):
//   snapshot["device_traces"][d][i]  -> TraceEvent (action, addr, size, stream, time_us)
//   snapshot["segments"][i]          -> SegmentInfo (optional key)
//   snapshot["allocator_settings"]   -> AllocatorSettings (optional key)
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cachealloc/trace/pickle.h"

namespace cachealloc::trace {

/// The `action` of a trace entry. Names outside this list read as `other`.
enum class Action : std::uint8_t {
  alloc,           ///< a block handed to the caller; size = the size asked for (not rounded)
  free_requested,  ///< the tensor died
  free_completed,  ///< the allocator may reuse the block (later if another stream used it)
  segment_alloc,   ///< cudaMalloc of a segment
  segment_free,    ///< cudaFree of a segment
  segment_map,     ///< expandable segments: pages mapped
  segment_unmap,   ///< expandable segments: pages unmapped
  snapshot,        ///< a snapshot was taken
  oom,             ///< an allocation failed; addr holds the device's free bytes
  other,
};

/// "alloc", "free_requested", ... ("other" for Action::other).
[[nodiscard]] std::string_view to_string(Action action) noexcept;
/// The inverse of to_string(); unknown names give Action::other.
[[nodiscard]] Action action_from_string(std::string_view name) noexcept;

/// One entry of snapshot["device_traces"][device].
struct TraceEvent {
  Action action = Action::other;
  int device = 0;            ///< index in device_traces
  std::uint64_t addr = 0;    ///< negative values in the file (pointers cast to int64) wrap
  std::uint64_t size = 0;    ///< for alloc: the size the caller asked for (unrounded)
  std::uint64_t stream = 0;  ///< cudaStream_t as an integer, 0 = default stream (wraps like addr)
  std::int64_t time_us = 0;  ///< 0 when the entry has no time_us

  friend bool operator==(const TraceEvent&, const TraceEvent&) = default;
};

/// An element of snapshot["segments"]: one segment's state when the snapshot was taken.
struct SegmentInfo {
  int device = 0;
  std::uint64_t address = 0;
  std::uint64_t total_size = 0;
  std::uint64_t allocated_size = 0;
  std::uint64_t stream = 0;
  std::string segment_type;  ///< "large" or "small"
  bool is_expandable = false;

  friend bool operator==(const SegmentInfo&, const SegmentInfo&) = default;
};

/// snapshot["allocator_settings"]; absent keys keep these defaults.
struct AllocatorSettings {
  /// The snapshot recorded settings (a non-empty allocator_settings dict).
  bool present = false;
  std::string conf_string;           ///< "PYTORCH_CUDA_ALLOC_CONF"
  std::int64_t max_split_size = -1;  ///< bytes, -1 = unlimited
  double garbage_collection_threshold = 0.0;
  bool expandable_segments = false;
  /// (interval in MiB, divisions), in file order. The file's keys are strings ("1", "2", ...).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> roundup_power2_divisions;

  friend bool operator==(const AllocatorSettings&, const AllocatorSettings&) = default;
};

struct Snapshot {
  /// All devices, in file order (device_traces[0] then [1] ...); each device's entries keep
  /// their order.
  std::vector<TraceEvent> events;
  std::size_t device_count = 0;  ///< len(device_traces)
  std::vector<SegmentInfo> segments;
  AllocatorSettings settings;

  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

struct ReadOptions {
  /// Refuse .xz files that decompress to more than this (and plain files larger than it).
  std::uint64_t max_decompressed_bytes = std::uint64_t{4} << 30;
  /// Called with the fraction done (0..1) while reading, decompressing and decoding. Optional.
  std::function<void(double fraction)> progress;
};

/// The plain pickle bytes of a snapshot file: the file itself, or its xz-decompressed content
/// when it starts with the xz magic FD 37 7A 58 5A 00. Errors start with the file name.
[[nodiscard]] std::vector<std::byte> read_pickle_bytes(const std::filesystem::path& file,
                                                       const ReadOptions& options = {});

/// Reads a snapshot file (plain pickle or .xz). Throws TraceError; messages start with the file
/// name and give the byte offset in the decompressed stream, or the path of the bad field.
[[nodiscard]] Snapshot read_snapshot(const std::filesystem::path& file,
                                     const ReadOptions& options = {});

/// Decodes and validates snapshot pickle bytes. `source_name` starts every error message.
[[nodiscard]] Snapshot parse_snapshot(std::span<const std::byte> pickle_bytes,
                                      std::string_view source_name = "<memory>");

/// Validates an already decoded snapshot dict. `input_bytes` (the pickle's size) bounds the
/// number of entries accepted, which defeats lists shared many times through the memo.
[[nodiscard]] Snapshot snapshot_from_value(const Value& root, std::string_view source_name,
                                           std::uint64_t input_bytes);

/// The snapshot as a Python dict: "segments", "device_traces", "allocator_settings" and
/// "external_annotations": []. Entries carry action, addr, size, stream, time_us,
/// compile_context ("N/A") and user_metadata (""). Events go to device_traces[event.device];
/// device_traces has max(device_count, largest device + 1) lists. An absent `settings` is
/// written as an empty dict. Throws TraceError for a negative device index.
[[nodiscard]] Value snapshot_to_value(const Snapshot& snapshot);

/// encode_pickle(snapshot_to_value(snapshot)): what torch.cuda.memory._dump_snapshot() writes,
/// readable by Python's pickle.load and by parse_snapshot().
[[nodiscard]] std::string write_snapshot_pickle(const Snapshot& snapshot);

/// Writes write_snapshot_pickle() to `file`, xz-compressed when the name ends in ".xz".
void write_snapshot(const std::filesystem::path& file, const Snapshot& snapshot);

}  // namespace cachealloc::trace
