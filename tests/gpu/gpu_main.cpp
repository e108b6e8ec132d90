// gpu_main.cpp: entry point of cachealloc_gpu_tests. Without a CUDA device it prints SKIPPED and
// exits 77 (CTest's SKIP_RETURN_CODE for gpu_suite), so a GPU-less CI run reports "skipped",
// never "passed" and never "failed". The one exception: run with the single argument "[nogpu]",
// it runs the test cases so tagged (they need no device: the CUDA factory's configuration
// checks) with or without one (ctest cuda_factory_without_device).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cachealloc/cuda/factory.h>
#include <cachealloc/types.h>

#include "gpu_test_util.h"

#include <cstdio>
#include <exception>
#include <string>

#include <cuda_runtime_api.h>

int main(int argc, char** argv) {
  bool listing = false;  // --list-tests, --help, ... work without a GPU
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    listing = listing || arg.rfind("--list", 0) == 0 || arg == "-l" || arg == "-t" || arg == "-h" ||
              arg == "--help" || arg == "-?";
  }
  if (listing || (argc == 2 && std::string(argv[1]) == "[nogpu]")) {
    return Catch::Session().run(argc, argv);
  }
  if (cachealloc::cuda_device_count() == 0) {
    std::puts("SKIPPED: no CUDA device found; GPU tests need an NVIDIA GPU (run them on the device machine)");
    return 77;
  }
  const int device = cachealloc::gpu_test::test_device();
  int driver = 0;
  int runtime = 0;
  (void)cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  (void)cudaSetDevice(device);
  (void)cudaMemGetInfo(&free_bytes, &total_bytes);
  std::string name = "?";
  try {
    name = cachealloc::cuda_device_name(device);
  } catch (const std::exception& e) {
    std::printf("cannot read the device name: %s\n", e.what());
  }
  std::printf("cachealloc GPU tests on device %d: %s, %s total, %s free; driver %d, runtime %d\n",
              device, name.c_str(),
              cachealloc::format_bytes(total_bytes).c_str(), cachealloc::format_bytes(free_bytes).c_str(),
              driver, runtime);
  std::fflush(stdout);
  return Catch::Session().run(argc, argv);
}
