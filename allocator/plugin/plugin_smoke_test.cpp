// plugin_smoke_test.cpp: the C ABI end to end on the simulated backend (no GPU needed).
//
// Built twice: against libcachealloc_capi.so (failures are return codes) and, with
// CACHEALLOC_SMOKE_WITH_TORCH, against libcachealloc_plugin.so, where a failed allocation must
// arrive as c10::OutOfMemoryError naming cachealloc and CACHEALLOC_CONF, exactly what PyTorch's
// CUDAPluggableAllocator turns into torch.OutOfMemoryError. CTest sets
// CACHEALLOC_PLUGIN_BACKEND=sim, a 1 GiB device and CACHEALLOC_CONF.
#include "plugin_api.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#ifdef CACHEALLOC_SMOKE_WITH_TORCH
#include <c10/util/Exception.h>
#endif

namespace {

int g_failures = 0;

#define SMOKE_CHECK(cond)                                                                       \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      std::fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, \
                   #cond, cachealloc_last_error());                                            \
      ++g_failures;                                                                             \
    }                                                                                           \
  } while (false)

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::string stats_json() {
  std::vector<char> buf(256);
  std::int64_t n = cachealloc_memory_stats_json(0, buf.data(), buf.size());
  if (n >= static_cast<std::int64_t>(buf.size())) {
    buf.resize(static_cast<std::size_t>(n) + 1);
    n = cachealloc_memory_stats_json(0, buf.data(), buf.size());
  }
  return n < 0 ? std::string() : std::string(buf.data(), static_cast<std::size_t>(n));
}

/// The integer after "key": in the stats JSON, or -1.
long long stat(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\": ";
  const std::size_t pos = json.find(needle);
  return pos == std::string::npos ? -1 : std::atoll(json.c_str() + pos + needle.size());
}

/// Tries an allocation that must fail with out-of-memory; returns the error text.
std::string expect_out_of_memory(std::size_t bytes) {
#ifdef CACHEALLOC_SMOKE_WITH_TORCH
  try {
    void* p = cachealloc_alloc(bytes, 0, nullptr);
    SMOKE_CHECK(p == nullptr && "the allocation should have thrown");
  } catch (const c10::OutOfMemoryError& e) {
    return e.what();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wrong exception type: %s\n", e.what());
    ++g_failures;
  }
  return {};
#else
  void* p = cachealloc_alloc(bytes, 0, nullptr);
  SMOKE_CHECK(p == nullptr);
  SMOKE_CHECK(cachealloc_last_error_code() == 1);
  return cachealloc_last_error();
#endif
}

}  // namespace

int main() {
  // Configuration checks never touch a device.
  SMOKE_CHECK(cachealloc_validate_config("policy:size_class") == 0);
  SMOKE_CHECK(cachealloc_validate_config("policy:size_class,bogus_key:1") == -1);
  SMOKE_CHECK(std::string(cachealloc_last_error()).find("bogus_key") != std::string::npos);
  SMOKE_CHECK(cachealloc_last_error_code() == 2);
  SMOKE_CHECK(cachealloc_validate_config("policy:no_such_policy") == -1);
  SMOKE_CHECK(std::string(cachealloc_last_error()).find("size_class") != std::string::npos);
  SMOKE_CHECK(cachealloc_validate_config("timing:maybe") == -1);
  // The virtual-memory backend's key: taken by defrag (checked by value), unknown to size_class.
  SMOKE_CHECK(cachealloc_validate_config("policy:defrag,background_unmap:False") == 0);
  SMOKE_CHECK(cachealloc_validate_config("policy:defrag,background_unmap:maybe") == -1);
  SMOKE_CHECK(std::string(cachealloc_last_error()).find("background_unmap") != std::string::npos);
  SMOKE_CHECK(cachealloc_validate_config("policy:size_class,background_unmap:True") == -1);
  // event_thread (event_thread.h): every CUDA backend takes it, checked by value; the variable
  // CACHEALLOC_EVENT_THREAD overrides it and is checked too.
  SMOKE_CHECK(cachealloc_validate_config("policy:defrag,event_thread:off") == 0);
  SMOKE_CHECK(cachealloc_validate_config("policy:size_class,event_thread:records") == 0);
  SMOKE_CHECK(cachealloc_validate_config("policy:async,event_thread:poll") == 0);
  SMOKE_CHECK(cachealloc_validate_config("policy:native,event_thread:1") == 0);
  for (const char* policy : {"defrag", "size_class", "async"}) {
    SMOKE_CHECK(cachealloc_validate_config((std::string("policy:") + policy + ",event_thread:sometimes").c_str()) == -1);
    SMOKE_CHECK(std::string(cachealloc_last_error()).find("'event_thread' expects off, records or poll") !=
                std::string::npos);
  }
  ::setenv("CACHEALLOC_EVENT_THREAD", "always", 1);
  SMOKE_CHECK(cachealloc_validate_config("policy:defrag") == -1);
  SMOKE_CHECK(std::string(cachealloc_last_error()).find("CACHEALLOC_EVENT_THREAD") != std::string::npos);
  ::setenv("CACHEALLOC_EVENT_THREAD", "poll", 1);
  SMOKE_CHECK(cachealloc_validate_config("policy:size_class") == 0);
  ::unsetenv("CACHEALLOC_EVENT_THREAD");
  // map_threads was removed (session 35): an unknown key now, refused by name.
  SMOKE_CHECK(cachealloc_validate_config("policy:defrag,map_threads:4") == -1);
  SMOKE_CHECK(std::string(cachealloc_last_error()).find("map_threads") != std::string::npos);
  SMOKE_CHECK(cachealloc_validate_config(nullptr) == 0);  // CTest's CACHEALLOC_CONF is valid
  SMOKE_CHECK(std::string(cachealloc_policy_name()) == "size_class");
  SMOKE_CHECK(cachealloc_is_active() == 0);

  cachealloc_init(1);
  SMOKE_CHECK(cachealloc_is_active() == 1);
  SMOKE_CHECK(cachealloc_device_count() == 1);

  // Allocate, free, statistics.
  SMOKE_CHECK(cachealloc_alloc(0, 0, nullptr) == nullptr);
  void* a = cachealloc_alloc(3 * kMiB, 0, nullptr);
  void* b = cachealloc_alloc(512, 0, nullptr);
  SMOKE_CHECK(a != nullptr && b != nullptr && a != b);
  std::size_t base_size = 0;
  void* base = cachealloc_base_alloc(static_cast<char*>(a) + 100, &base_size);
  SMOKE_CHECK(base != nullptr && base <= a && base_size >= 3 * kMiB);
  std::string json = stats_json();
  SMOKE_CHECK(stat(json, "allocated_bytes.all.current") >= static_cast<long long>(3 * kMiB + 512));
  SMOKE_CHECK(stat(json, "requested_bytes.all.current") == static_cast<long long>(3 * kMiB + 512));
  SMOKE_CHECK(stat(json, "reserved_bytes.all.current") >= stat(json, "allocated_bytes.all.current"));
  cachealloc_free(a, 3 * kMiB, 0, nullptr);
  cachealloc_free(b, 512, 0, nullptr);
  json = stats_json();
  SMOKE_CHECK(stat(json, "allocated_bytes.all.current") == 0);
  SMOKE_CHECK(stat(json, "allocated_bytes.all.peak") >= static_cast<long long>(3 * kMiB));
  SMOKE_CHECK(stat(json, "allocator_ns") > 0);
  SMOKE_CHECK(cachealloc_allocator_ns(0) > 0);
  {
    // Note [Bookkeeping on few pages]: the front end made above lives on a region (unless
    // CACHEALLOC_HOT_PAGES=off), and the diagnostic says so.
    std::vector<char> hp(512);
    const std::int64_t n = cachealloc_hot_pages_json(hp.data(), hp.size());
    SMOKE_CHECK(n > 0 && n < static_cast<std::int64_t>(hp.size()));
    const std::string text(hp.data(), n > 0 ? static_cast<std::size_t>(n) : 0);
    const char* mode = std::getenv("CACHEALLOC_HOT_PAGES");
    if (mode == nullptr || std::string(mode) != "off") {
      SMOKE_CHECK(stat(text, "regions") >= 1);
      SMOKE_CHECK(stat(text, "bytes_in_use") > 0);
    }
    SMOKE_CHECK(text.find("\"huge_bytes\": ") != std::string::npos);
  }

  // A foreign pointer or a double free is logged and ignored.
  int on_stack = 0;
  cachealloc_clear_error();
  cachealloc_free(&on_stack, 4, 0, nullptr);
  SMOKE_CHECK(cachealloc_last_error_code() == 3);
  cachealloc_free(b, 512, 0, nullptr);
  SMOKE_CHECK(cachealloc_last_error_code() == 3);
  SMOKE_CHECK(stat(stats_json(), "usage_errors") == 2);

  // Out of memory names cachealloc and the setting, and the allocator keeps working after it.
  const std::string oom = expect_out_of_memory(std::size_t{4} << 30);
  SMOKE_CHECK(oom.find("cachealloc") != std::string::npos);
  SMOKE_CHECK(oom.find("out of memory") != std::string::npos);
#ifdef CACHEALLOC_SMOKE_WITH_TORCH
  SMOKE_CHECK(oom.find("CACHEALLOC_CONF") != std::string::npos);
#endif
  SMOKE_CHECK(stat(stats_json(), "num_ooms") == 1);
  void* c = cachealloc_alloc(8 * kMiB, 0, nullptr);
  SMOKE_CHECK(c != nullptr);

  // record_stream: the free waits for the other stream (the simulated events complete at once).
  cachealloc_record_stream(c, reinterpret_cast<void*>(std::uintptr_t{0x1234}));
  cachealloc_free(c, 8 * kMiB, 0, nullptr);
  SMOKE_CHECK(stat(stats_json(), "allocated_bytes.all.current") == 0);

  // Memory fraction: 10% of 1 GiB cannot hold 200 MiB.
  cachealloc_set_memory_fraction(0.1, 0);
  cachealloc_reset();
  (void)expect_out_of_memory(200 * kMiB);
  cachealloc_set_memory_fraction(1.0, 0);
  void* d = cachealloc_alloc(200 * kMiB, 0, nullptr);
  SMOKE_CHECK(d != nullptr);
  cachealloc_free(d, 200 * kMiB, 0, nullptr);

  // empty_cache gives the reservations back.
  SMOKE_CHECK(stat(stats_json(), "reserved_bytes.all.current") > 0);
  SMOKE_CHECK(cachealloc_empty_cache(-1) == 0);
  SMOKE_CHECK(stat(stats_json(), "reserved_bytes.all.current") == 0);
  SMOKE_CHECK(cachealloc_reset_peak(-1) == 0);
  SMOKE_CHECK(stat(stats_json(), "allocated_bytes.all.peak") == 0);
  SMOKE_CHECK(cachealloc_check_invariants(-1) == 0);

  // Snapshots.
  // Per process: plugin.capi_smoke and plugin.torch_smoke run this same code side by side under
  // ctest -j, and one removed the other's file before its existence check.
  const auto path = std::filesystem::temp_directory_path() /
                    ("cachealloc_plugin_smoke_" + std::to_string(::getpid()) + ".pickle");
  void* e = cachealloc_alloc(kMiB, 0, nullptr);
  SMOKE_CHECK(cachealloc_dump_snapshot(path.c_str()) == 0);
  SMOKE_CHECK(std::filesystem::exists(path) && std::filesystem::file_size(path) > 0);
  std::filesystem::remove(path);
  cachealloc_free(e, kMiB, 0, nullptr);
  SMOKE_CHECK(cachealloc_dump_snapshot("/nonexistent-dir/x.pickle") == -1);

  std::vector<char> policies(4096);
  SMOKE_CHECK(cachealloc_policies_json(policies.data(), policies.size()) > 0);
  SMOKE_CHECK(std::string(policies.data()).find("\"size_class\"") != std::string::npos);

  if (g_failures != 0) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("plugin smoke test (%s): all checks passed\n",
              cachealloc_is_torch_plugin() != 0 ? "libcachealloc_plugin.so" : "libcachealloc_capi.so");
  return 0;
}
