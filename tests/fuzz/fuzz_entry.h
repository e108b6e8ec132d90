// fuzz_entry.h: the bodies of the libFuzzer targets, callable from the fuzzers and from Catch2.
//
// Each function takes one input and either returns (the input was handled: accepted, or
// refused with the error type the API documents) or aborts with a message on stderr (a
// finding: an undocumented exception, a broken round trip, a broken invariant). The sanitizers
// report memory errors and undefined behaviour on their own. The fuzz_*.cpp files wrap them in
// LLVMFuzzerTestOneInput; tests/trace/test_fuzz_regressions.cpp replays every stored input
// (tests/fuzz/corpus/<target>/, tests/fuzz/regressions/<target>/) through them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace cachealloc::fuzz {

/// A finding, thrown instead of aborting when CACHEALLOC_FUZZ_THROW_FINDINGS is defined (the
/// regression test does, so that every stored input reports on its own). Deliberately not a
/// std::exception, so that no catch clause in the code under test swallows it.
struct FuzzFinding {
  std::string what;
};

/// Bytes -> decode_pickle -> snapshot_from_value (what trace::parse_snapshot runs), and the xz
/// path when the input starts with the xz magic; then the pickle and snapshot round trips.
/// Only trace::TraceError may escape the library.
void fuzz_snapshot_one(const std::uint8_t* data, std::size_t size);

/// Bytes as CACHEALLOC_CONF text -> Config::parse, the typed getters, to_string() round trip,
/// and make_allocator() for every registered policy on a 256 MiB simulated device.
/// `every_policy`: build every registered policy from the text, not only the one it selects
/// (the regression test does; the fuzz target does not: Note [Work per fuzz input]).
void fuzz_config_one(const std::uint8_t* data, std::size_t size, bool every_policy = false);

/// Bytes -> parse_snapshot -> replay::prepare -> replay::run for every registered policy on a
/// 1 GiB simulated device, with check_invariants() after every operation. Only the first
/// `max_events` trace events are replayed.
void fuzz_replay_one(const std::uint8_t* data, std::size_t size, std::size_t max_events);

/// Note [Work per fuzz input]
/// libFuzzer needs thousands of executions per second to reach a 10M-execution campaign in
/// hours, so each target bounds the work one input can cause, whatever its size:
///  - replay: the first kMaxReplayEvents events of a trace are replayed (a prefix of a recording
///    is a recording that stopped early); every op is still followed by check_invariants() on
///    every policy. Longer traces used to be skipped outright; now their prefix is replayed.
///    256 events (1024 until the 10M campaign): each op's checks walk every block and page, so
///    the work grows faster than the events; at 256 one worker ran 3,100 inputs/s on the seeds
///    (60 s, 2-core machine) against 400-700/s at 1024 with a grown corpus, and the seeds reach
///    5156 edges instead of 5227.
///  - config: the text builds the one allocator it selects (`policy:`, size_class when absent),
///    as the plugin does, instead of every registered policy (4x the work per input); the
///    dictionary names every policy, so the campaign still reaches each of them.
///  - snapshot: xz output is capped at kMaxFuzzDecompressedBytes (the cap logic is the same for
///    1 MiB as for 4 GiB; the 64 MiB bomb in the corpus still hits it) and a decoded value must
///    fit kMaxFuzzValueBytes; the pickle is decoded once and the snapshot built from that value,
///    which is exactly parse_snapshot().
///  - all: run_fuzz.sh / run_campaign.sh pass -max_len: 32 KiB for replay (the 500-event seed
///    traces fit; at 16 KiB they were cut and the seeds reached 150 fewer edges), 16 KiB for
///    snapshot (the larger hostile seeds add 10 edges at 64 KiB), 512 B for configuration text.
///    With 1024 events (vs 256) the seeds reach 5227 edges, as many as replaying them whole;
///    at 256, 5156.
/// The regression test (tests/trace/test_fuzz_regressions.cpp) replays stored inputs whole,
/// up to kMaxRegressionReplayEvents events.
inline constexpr std::size_t kMaxReplayEvents = 256;
inline constexpr std::size_t kMaxRegressionReplayEvents = 20000;
inline constexpr std::uint64_t kMaxFuzzDecompressedBytes = std::uint64_t{1} << 20;
inline constexpr std::uint64_t kMaxFuzzValueBytes = std::uint64_t{16} << 20;

/// Dispatch by target name ("snapshot", "config", "replay"); false for an unknown name.
bool fuzz_run_one(std::string_view target, const std::uint8_t* data, std::size_t size,
                  std::size_t max_replay_events = kMaxReplayEvents, bool every_policy = false);

}  // namespace cachealloc::fuzz
