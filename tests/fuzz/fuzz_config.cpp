// fuzz_config.cpp: libFuzzer target: CACHEALLOC_CONF text -> Config::parse, typed getters, to_string() round trip, make_allocator for the policy it selects.
// The body lives in fuzz_entry.cpp so that tests/trace/test_fuzz_regressions.cpp replays the
// same code on the stored corpus and regression inputs.
#include <cstddef>
#include <cstdint>

#include "fuzz_entry.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  cachealloc::fuzz::fuzz_config_one(data, size);
  return 0;
}
