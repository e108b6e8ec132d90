// gpu_test_util.cpp: shared helpers of the GPU test suite.
#include "gpu_test_util.h"

#include <cstdlib>
#include <stdexcept>

namespace cachealloc::gpu_test {

int test_device() {
  static const int device = static_cast<int>(env_or("CACHEALLOC_GPU_TEST_DEVICE", 0));
  return device;
}

long env_or(const char* name, long fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    return fallback;
  }
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  return (end != nullptr && *end == '\0') ? value : fallback;
}

std::vector<std::string> gpu_policy_names() {
  std::vector<std::string> names;
  for (const PolicyInfo& p : registered_policies()) {
    names.emplace_back(p.name);
  }
  return names;
}

std::vector<std::string> gpu_policy_names(BackendNeed need) {
  std::vector<std::string> names;
  for (const PolicyInfo& p : registered_policies()) {
    if (p.backend == need) {
      names.emplace_back(p.name);
    }
  }
  return names;
}

std::unique_ptr<DeviceAllocator> make_gpu_allocator(const std::string& policy, std::string_view conf) {
  const PolicyInfo* info = find_policy(policy);
  if (info == nullptr) {
    throw std::invalid_argument("no registered policy " + policy);
  }
  Config config = Config::parse(conf);
  auto backend = make_cuda_backend(backend_kind(info->backend), test_device(), config);
  return make_allocator(policy, std::move(backend), config);
}

TestStream::TestStream() {
  GPU_REQUIRE_OK(cudaSetDevice(test_device()));
  GPU_REQUIRE_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

TestStream::~TestStream() {
  if (stream_ != nullptr) {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
}

DeviceCounter::DeviceCounter() {
  GPU_REQUIRE_OK(cudaMalloc(reinterpret_cast<void**>(&ptr_), sizeof(unsigned long long)));
  reset();
}

DeviceCounter::~DeviceCounter() {
  if (ptr_ != nullptr) {
    (void)cudaFree(ptr_);
  }
}

unsigned long long DeviceCounter::read() const {
  unsigned long long value = 0;
  // Kernels run on non-blocking streams, which the legacy stream does not wait for.
  GPU_REQUIRE_OK(cudaDeviceSynchronize());
  GPU_REQUIRE_OK(cudaMemcpy(&value, ptr_, sizeof value, cudaMemcpyDeviceToHost));
  return value;
}

void DeviceCounter::reset() {
  GPU_REQUIRE_OK(cudaDeviceSynchronize());
  GPU_REQUIRE_OK(cudaMemset(ptr_, 0, sizeof(unsigned long long)));
  GPU_REQUIRE_OK(cudaDeviceSynchronize());
}

long long cycles_for_ms(double ms) {
  int khz = 0;
  GPU_REQUIRE_OK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, test_device()));
  if (khz <= 0) {
    khz = 1980000;  // the H200's peak SM clock, should a driver stop reporting it
  }
  return static_cast<long long>(ms * static_cast<double>(khz));
}

int multiprocessor_count() {
  int sms = 0;
  GPU_REQUIRE_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, test_device()));
  return sms;
}

}  // namespace cachealloc::gpu_test
