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

/// Bytes -> trace::parse_snapshot (and the xz path when the input starts with the xz magic),
/// then the pickle and snapshot round trips. Only trace::TraceError may escape the library.
void fuzz_snapshot_one(const std::uint8_t* data, std::size_t size);

/// Bytes as CACHEALLOC_CONF text -> Config::parse, the typed getters, to_string() round trip,
/// and make_allocator() for every registered policy on a small simulated device.
void fuzz_config_one(const std::uint8_t* data, std::size_t size);

/// Bytes -> parse_snapshot -> replay::prepare -> replay::run for every registered policy on a
/// 1 GiB simulated device, with check_invariants() after every operation.
void fuzz_replay_one(const std::uint8_t* data, std::size_t size);

/// Traces with more operations than this are skipped by fuzz_replay_one (exec speed).
inline constexpr std::size_t kMaxReplayOps = 20000;

/// Dispatch by target name ("snapshot", "config", "replay"); false for an unknown name.
bool fuzz_run_one(std::string_view target, const std::uint8_t* data, std::size_t size);

}  // namespace cachealloc::fuzz
