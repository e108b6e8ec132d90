// test_fuzz_regressions.cpp: every stored fuzz input, replayed through the fuzz target bodies.
//
// tests/fuzz/regressions/<target>/ holds inputs that once crashed a fuzzer (named after the bug);
// tests/fuzz/corpus/<target>/ holds the seed corpus. Both go through the same functions the
// libFuzzer executables run (tests/fuzz/fuzz_entry.cpp), so a fixed crash stays fixed in the
// normal suite. Findings are thrown here (CACHEALLOC_FUZZ_THROW_FINDINGS) and reported per file;
// the fuzz executables abort instead. Sanitizer errors still abort the test process.
//
// fuzz_entry.cpp is compiled in here, not listed in tests/CMakeLists.txt, so that the tests'
// file(GLOB test_*.cpp) picks everything up; the fuzz build compiles it into its own library.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#define CACHEALLOC_FUZZ_THROW_FINDINGS 1
#include "../fuzz/fuzz_entry.cpp"  // NOLINT(bugprone-suspicious-include): see above

namespace {

const std::filesystem::path kFuzzDir = std::filesystem::path(CACHEALLOC_TEST_DATA_DIR) / ".." / "fuzz";

std::vector<std::filesystem::path> inputs_in(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(dir)) {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (entry.is_regular_file() && !name.empty() && name.front() != '.') {
        files.push_back(entry.path());
      }
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::uint8_t> read_all(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Runs every file of corpus/<target> and regressions/<target>; returns how many ran.
std::size_t replay_target(const std::string& target) {
  std::size_t ran = 0;
  for (const char* kind : {"regressions", "corpus"}) {
    for (const auto& file : inputs_in(kFuzzDir / kind / target)) {
      INFO("fuzz input " << file.string());
      const std::vector<std::uint8_t> bytes = read_all(file);
      ++ran;
      bool known_target = false;
      try {
        known_target = cachealloc::fuzz::fuzz_run_one(
            target, bytes.data(), bytes.size(), cachealloc::fuzz::kMaxRegressionReplayEvents,
            /*every_policy=*/true);
      } catch (const cachealloc::fuzz::FuzzFinding& f) {
        FAIL_CHECK(f.what);
        continue;
      }
      REQUIRE(known_target);
    }
  }
  return ran;
}

}  // namespace

TEST_CASE("fuzz regressions: snapshot inputs parse or fail with TraceError, round trips hold",
          "[trace][fuzz]") {
  CHECK(replay_target("snapshot") > 0);
}

TEST_CASE("fuzz regressions: config inputs parse or fail with ConfigError on every policy",
          "[trace][fuzz]") {
  CHECK(replay_target("config") > 0);
}

TEST_CASE("fuzz regressions: replay inputs keep every policy's invariants after each op",
          "[trace][fuzz][replay]") {
  CHECK(replay_target("replay") > 0);
}

TEST_CASE("fuzz config dictionary names every policy and every CACHEALLOC_CONF key",
          "[trace][fuzz]") {
  std::ifstream in(kFuzzDir / "config.dict");
  REQUIRE(in.good());
  const std::string dict((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto listed = [&](std::string_view word) {
    return dict.find("\"" + std::string(word) + "\"") != std::string::npos;
  };
  for (std::string_view key : cachealloc::front_end_config_keys()) {
    INFO("tests/fuzz/config.dict must list the key " << std::string(key));
    CHECK(listed(key));
  }
  for (const cachealloc::PolicyInfo& info : cachealloc::registered_policies()) {
    INFO("tests/fuzz/config.dict must list the policy " << std::string(info.name));
    CHECK(listed(info.name));
    for (std::string_view key : info.config_keys()) {
      INFO("tests/fuzz/config.dict must list " << std::string(info.name) << "'s key " << std::string(key));
      CHECK(listed(key));
    }
  }
}
