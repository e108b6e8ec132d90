// xz.cpp: liblzma wrappers for *.pickle.xz snapshots; see xz.h.
#include "xz.h"

#include <lzma.h>

#include <algorithm>
#include <string>

#include "cachealloc/trace/pickle.h"

namespace cachealloc::trace::detail {

namespace {

/// liblzma may need this much memory to decode (xz -9 needs 65 MiB; this leaves room, and
/// refuses a header that asks for gigabytes).
constexpr std::uint64_t kDecoderMemoryLimit = std::uint64_t{1} << 30;
/// Output produced per lzma_code() call, so progress is reported regularly.
constexpr std::size_t kChunk = std::size_t{16} << 20;

std::string lzma_reason(lzma_ret ret) {
  switch (ret) {
    case LZMA_MEM_ERROR:
      return "liblzma could not allocate memory";
    case LZMA_MEMLIMIT_ERROR:
      return "the stream needs more than " + std::to_string(kDecoderMemoryLimit >> 20) +
             " MiB of decoder memory";
    case LZMA_FORMAT_ERROR:
      return "the data is not in the .xz format";
    case LZMA_OPTIONS_ERROR:
      return "the stream uses unsupported compression options";
    case LZMA_DATA_ERROR:
      return "the compressed data is corrupt";
    case LZMA_BUF_ERROR:
      return "the compressed data ends too early (the file is truncated)";
    default:
      return "liblzma error " + std::to_string(static_cast<int>(ret));
  }
}

struct StreamGuard {
  lzma_stream* stream;
  ~StreamGuard() { lzma_end(stream); }
};

}  // namespace

bool has_xz_magic(std::span<const std::byte> data) noexcept {
  static constexpr unsigned char kMagic[6] = {0xFD, 0x37, 0x7A, 0x58, 0x5A, 0x00};
  if (data.size() < sizeof kMagic) return false;
  return std::equal(
      std::begin(kMagic), std::end(kMagic), data.begin(),
      [](unsigned char m, std::byte b) { return m == static_cast<unsigned char>(b); });
}

std::vector<std::byte> xz_decompress(std::span<const std::byte> input,
                                     std::uint64_t max_output_bytes, std::string_view source_name,
                                     const std::function<void(double)>& progress) {
  lzma_stream stream = LZMA_STREAM_INIT;
  const lzma_ret init = lzma_stream_decoder(&stream, kDecoderMemoryLimit, LZMA_CONCATENATED);
  if (init != LZMA_OK) {
    throw TraceError(std::string(source_name) +
                     ": cannot start the xz decoder: " + lzma_reason(init));
  }
  StreamGuard guard{&stream};

  // Grow the output geometrically, but never past max_output_bytes + 1: one byte beyond the cap
  // proves the cap is exceeded without allocating more.
  const std::uint64_t hard_cap =
      max_output_bytes == UINT64_MAX ? max_output_bytes : max_output_bytes + 1;
  std::vector<std::byte> out;
  out.resize(static_cast<std::size_t>(
      std::min<std::uint64_t>(hard_cap, std::max<std::uint64_t>(input.size() * 8, 1 << 20))));

  stream.next_in = reinterpret_cast<const std::uint8_t*>(input.data());
  stream.avail_in = input.size();
  for (;;) {
    if (stream.total_out == out.size()) {
      if (out.size() >= hard_cap) break;
      out.resize(static_cast<std::size_t>(std::min<std::uint64_t>(hard_cap, out.size() * 2)));
    }
    const std::size_t room = out.size() - static_cast<std::size_t>(stream.total_out);
    stream.next_out = reinterpret_cast<std::uint8_t*>(out.data()) + stream.total_out;
    stream.avail_out = std::min(room, kChunk);
    const lzma_ret ret = lzma_code(&stream, LZMA_FINISH);
    if (progress && !input.empty()) {
      progress(static_cast<double>(stream.total_in) / static_cast<double>(input.size()));
    }
    if (ret == LZMA_STREAM_END) break;
    if (ret != LZMA_OK) {
      throw TraceError(std::string(source_name) + ": compressed byte " +
                           std::to_string(stream.total_in) + ": cannot decompress: " +
                           lzma_reason(ret) + ". Copy the file again, or check it with `xz -t`",
                       stream.total_in);
    }
  }
  if (stream.total_out > max_output_bytes) {
    throw TraceError(std::string(source_name) + ": decompresses to more than " +
                     std::to_string(max_output_bytes) +
                     " bytes, the configured cap (ReadOptions::max_decompressed_bytes); "
                     "if the snapshot is genuine, raise the cap, otherwise this is an xz bomb");
  }
  out.resize(static_cast<std::size_t>(stream.total_out));
  return out;
}

std::vector<std::byte> xz_compress(std::span<const std::byte> input, std::string_view source_name) {
  std::vector<std::byte> out(lzma_stream_buffer_bound(input.size()));
  std::size_t written = 0;
  const lzma_ret ret = lzma_easy_buffer_encode(
      6, LZMA_CHECK_CRC64, nullptr, reinterpret_cast<const std::uint8_t*>(input.data()),
      input.size(), reinterpret_cast<std::uint8_t*>(out.data()), &written, out.size());
  if (ret != LZMA_OK) {
    throw TraceError(std::string(source_name) + ": xz compression failed: " + lzma_reason(ret));
  }
  out.resize(written);
  return out;
}

}  // namespace cachealloc::trace::detail
