// fuzz_replay.cpp: libFuzzer target: snapshot bytes -> replay::prepare -> replay::run per policy with invariant checks after every op.
// The body lives in fuzz_entry.cpp so that tests/trace/test_fuzz_regressions.cpp replays the
// same code on the stored corpus and regression inputs.
#include <cstddef>
#include <cstdint>

#include "fuzz_entry.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  cachealloc::fuzz::fuzz_replay_one(data, size, cachealloc::fuzz::kMaxReplayEvents);
  return 0;
}
