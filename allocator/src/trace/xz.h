// xz.h (private): xz (liblzma) decompression with a cap on the output size, and compression,
// for snapshot files stored as *.pickle.xz.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

namespace cachealloc::trace::detail {

/// True when `data` starts with the xz stream magic FD 37 7A 58 5A 00.
[[nodiscard]] bool has_xz_magic(std::span<const std::byte> data) noexcept;

/// Decompresses a whole .xz file (concatenated streams allowed). Throws TraceError, prefixed
/// with `source_name`, when the data is truncated or corrupt, or when it would decompress to
/// more than `max_output_bytes` (an "xz bomb"). `progress`, if set, gets the fraction of the
/// compressed input consumed (0..1).
[[nodiscard]] std::vector<std::byte> xz_decompress(
    std::span<const std::byte> input, std::uint64_t max_output_bytes, std::string_view source_name,
    const std::function<void(double)>& progress = {});

/// Compresses `input` as one .xz stream (preset 6, CRC64), as `xz` does by default.
[[nodiscard]] std::vector<std::byte> xz_compress(std::span<const std::byte> input,
                                                 std::string_view source_name);

}  // namespace cachealloc::trace::detail
