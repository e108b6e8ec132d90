// main.cpp: a LibTorch program with cachealloc as its CUDA allocator (the sample of allocator/torch).
//
// Installs the adapter before anything touches CUDA (cachealloc::torch::install, configured by
// CACHEALLOC_CONF, default "policy:defrag"), trains a small MLP for a few steps, and prints
// PyTorch's own view of the allocator (getDeviceStats), which under cachealloc comes from
// cachealloc. Exit codes: 0 success, 1 failure, 77 no CUDA device (skipped, as ctest counts it).
#include <cachealloc/torch/install.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

void print_stats(const char* when) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  const auto& allocated = stats.allocated_bytes[0];
  const auto& reserved = stats.reserved_bytes[0];
  std::printf("%-22s allocated %8.2f MiB (peak %8.2f)  reserved %8.2f MiB (peak %8.2f)  allocations %lld\n", when,
              static_cast<double>(allocated.current) / kMiB, static_cast<double>(allocated.peak) / kMiB,
              static_cast<double>(reserved.current) / kMiB, static_cast<double>(reserved.peak) / kMiB,
              static_cast<long long>(stats.allocation[0].allocated));
}

int run() {
  const char* env = std::getenv("CACHEALLOC_CONF");
  const std::string conf = env != nullptr && *env != '\0' ? env : "policy:defrag";
  cachealloc::torch::install(conf);  // before the first CUDA call
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "libtorch_app: no CUDA device visible; skipped\n");
    return 77;
  }
  const std::string allocator = c10::cuda::CUDACachingAllocator::name();
  std::printf("libtorch_app: PyTorch %s, CUDA allocator '%s', CACHEALLOC_CONF='%s'\n",
              cachealloc::torch::built_for_torch_version(), allocator.c_str(), conf.c_str());
  if (allocator != "cachealloc") {
    std::fprintf(stderr, "libtorch_app: the allocator was not installed\n");
    return 1;
  }

  torch::manual_seed(0);
  const torch::Device device(torch::kCUDA, 0);
  torch::nn::Sequential model(torch::nn::Linear(512, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                              torch::nn::ReLU(), torch::nn::Linear(2048, 10));
  model->to(device);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  const auto inputs = torch::randn({256, 512}, device);
  const auto targets = torch::randint(0, 10, {256}, torch::TensorOptions().dtype(torch::kLong).device(device));
  float first_loss = 0.0F;
  float last_loss = 0.0F;
  for (int step = 0; step < 20; ++step) {
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(inputs), targets);
    loss.backward();
    optimizer.step();
    last_loss = loss.item<float>();
    if (step == 0) {
      first_loss = last_loss;
    }
  }
  torch::cuda::synchronize();
  std::printf("loss %.4f -> %.4f after 20 steps\n", first_loss, last_loss);
  print_stats("after training:");

  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  const bool sane = stats.allocated_bytes[0].current > 0 && stats.reserved_bytes[0].current >= stats.allocated_bytes[0].current &&
                    stats.allocated_bytes[0].peak >= stats.allocated_bytes[0].current && last_loss < first_loss;
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  print_stats("after empty_cache:");
  if (!sane) {
    std::fprintf(stderr, "libtorch_app: implausible statistics or no learning\n");
    return 1;
  }
  std::printf("libtorch_app: OK\n");
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_app: %s\n", e.what());
    return 1;
  }
}
