// test_conformance.cpp: the conformance suite of tests/core, on the real device, for every
// registered policy over the CUDA backend it needs: zero bytes, 512-byte alignment, no overlap
// (checked on addresses, then on the device by filling every live block and verifying it),
// same-stream reuse, cross-stream reuse only after the stream's work finished, stats back to
// zero, and out-of-memory with recovery.
#include "gpu_test_util.h"
#include "kernels.h"

#include <cachealloc/errors.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace cachealloc::gpu_test {
namespace {

constexpr std::uint64_t kSeed = 0x5eed;

void check_all_free(DeviceAllocator& alloc) {
  const Stats s = alloc.stats();
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.requested_bytes.current == 0);
  CHECK(s.active_bytes.current == 0);
  CHECK(s.allocation.current == 0);
  CHECK(s.active.current == 0);
  alloc.check_invariants();
  alloc.empty_cache();
  CHECK(alloc.stats().reserved_bytes.current == 0);
  CHECK(alloc.pending_frees() == 0);
  CHECK(alloc.backend().held_bytes() == 0);
  alloc.check_invariants();
}

std::vector<std::size_t> conformance_sizes() {
  std::vector<std::size_t> sizes = {1,        8,        511,          512,       513,
                                    4096,     65537,    kMiB - 1,     kMiB,      kMiB + 1,
                                    2 * kMiB + 3, 10 * kMiB, 20 * kMiB + 1, 64 * kMiB};
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> log_size(0.0, 25.0);  // 1 B .. 32 MiB, log-uniform
  for (int i = 0; i < 200; ++i) {
    sizes.push_back(static_cast<std::size_t>(std::exp2(log_size(rng))) + 1);
  }
  return sizes;
}

}  // namespace

TEST_CASE("conformance on the real device", "[gpu][conformance]") {
  const std::string policy = GENERATE(from_range(gpu_policy_names()));
  CAPTURE(policy);
  TestStream s;  // before the allocator, so destroyed after it: its teardown may record on s
  auto alloc = make_gpu_allocator(policy);

  SECTION("zero bytes gives nullptr, freeing nullptr is a no-op") {
    CHECK(alloc->allocate(0, s.id()) == nullptr);
    alloc->deallocate(nullptr);
    CHECK(alloc->stats().allocation.current == 0);
    check_all_free(*alloc);
  }

  SECTION("aligned, non-overlapping, usable blocks; stats back to zero") {
    struct Live {
      void* ptr;
      std::size_t bytes;
      std::size_t block;
      std::uint64_t id;
    };
    std::vector<Live> live;
    for (std::size_t bytes : conformance_sizes()) {
      void* p = alloc->allocate(bytes, s.id());
      REQUIRE(p != nullptr);
      INFO("bytes " << bytes << " ptr " << p);
      CHECK(reinterpret_cast<std::uintptr_t>(p) % 512 == 0);
      const auto found = alloc->find(p);
      REQUIRE(found.has_value());
      CHECK(found->requested == bytes);
      CHECK(found->block_size >= bytes);
      live.push_back({p, bytes, found->block_size, live.size()});
      GPU_REQUIRE_OK(launch_fill(p, bytes, live.back().id, kSeed, s.get()));
    }
    alloc->check_invariants();
    const Stats during = alloc->stats();
    CHECK(during.allocation.current == static_cast<std::int64_t>(live.size()));
    CHECK(during.reserved_bytes.current >= during.allocated_bytes.current);

    std::sort(live.begin(), live.end(), [](const Live& a, const Live& b) { return a.ptr < b.ptr; });
    for (std::size_t i = 1; i < live.size(); ++i) {
      const auto prev_end = reinterpret_cast<std::uintptr_t>(live[i - 1].ptr) + live[i - 1].block;
      INFO("block " << live[i - 1].ptr << " (+" << live[i - 1].block << ") overlaps " << live[i].ptr);
      CHECK(prev_end <= reinterpret_cast<std::uintptr_t>(live[i].ptr));
    }
    // Every block still holds its own pattern after all were written: nothing overlapped on
    // the device either, and every byte handed out is backed by memory.
    DeviceCounter mismatches;
    for (const Live& b : live) {
      GPU_REQUIRE_OK(launch_verify(b.ptr, b.bytes, b.id, kSeed, mismatches.get(), s.get()));
    }
    CHECK(mismatches.read() == 0);
    for (const Live& b : live) {
      alloc->deallocate(b.ptr);
    }
    check_all_free(*alloc);
  }

  SECTION("same-stream reuse: a freed block serves the next request of its size at once") {
    for (std::size_t bytes : {std::size_t{4096}, 3 * kMiB, 24 * kMiB}) {
      INFO("bytes " << bytes);
      void* p = alloc->allocate(bytes, s.id());
      GPU_REQUIRE_OK(launch_fill(p, bytes, 1, kSeed, s.get()));
      const auto reserved = alloc->stats().reserved_bytes.current;
      alloc->deallocate(p);
      void* q = alloc->allocate(bytes, s.id());
      // The driver's pool (async) reuses the freed memory without growing but may place the
      // request elsewhere in it (it did, 3 MiB lower, once a freed 3 MiB block had coalesced).
      if (policy != "async") {
        CHECK(q == p);
      }
      CHECK(alloc->stats().reserved_bytes.current == reserved);
      alloc->deallocate(q);
    }
    check_all_free(*alloc);
  }

  SECTION("cross-stream reuse only after the freeing stream's work finished") {
    TestStream other;
    const std::size_t bytes = 6 * kMiB;
    void* p = alloc->allocate(bytes, s.id());
    GPU_REQUIRE_OK(launch_spin(cycles_for_ms(30), s.get()));
    GPU_REQUIRE_OK(launch_fill(p, bytes, 7, kSeed, s.get()));
    alloc->deallocate(p);  // the spin and the fill are still queued on s
    void* q = alloc->allocate(bytes, other.id());
    const cudaError_t s_state = cudaStreamQuery(s.get());
    (void)cudaGetLastError();
    // A stream-ordered pool may hand p to `other` at once, making `other` wait for s itself
    // (cudaMemPoolReuseAllowInternalDependencies); every other policy must not. Either way the
    // verification below fails if s's late fill landed in q.
    const bool stream_ordered = find_policy(policy)->backend == BackendNeed::stream_ordered;
    if (s_state == cudaErrorNotReady) {
      if (!stream_ordered) {
        CHECK(q != p);  // s was still busy: handing p to `other` would race with s's fill
      }
    } else {
      WARN("stream finished before the check; cross-stream reuse not exercised");
    }
    GPU_REQUIRE_OK(launch_fill(q, bytes, 8, kSeed, other.get()));
    DeviceCounter mismatches;
    GPU_REQUIRE_OK(cudaStreamSynchronize(other.get()));
    GPU_REQUIRE_OK(cudaStreamSynchronize(s.get()));
    GPU_REQUIRE_OK(launch_verify(q, bytes, 8, kSeed, mismatches.get(), other.get()));
    CHECK(mismatches.read() == 0);
    alloc->deallocate(q);
    check_all_free(*alloc);
  }
}

TEST_CASE("out of memory on the real device", "[gpu][conformance][oom]") {
  const std::string policy = GENERATE(from_range(gpu_policy_names()));
  CAPTURE(policy);
  TestStream s;
  auto alloc = make_gpu_allocator(policy);
  const std::size_t total = alloc->backend().total_memory();

  SECTION("a request larger than the device raises OutOfMemory and the allocator keeps working") {
    try {
      void* p = alloc->allocate(total + kGiB, s.id());
      FAIL("allocated " << format_bytes(total + kGiB) << " on a device of " << format_bytes(total)
                        << " at " << p);
    } catch (const OutOfMemory& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("out of memory") != std::string::npos);
      CHECK(e.requested_bytes() == total + kGiB);
    }
    CHECK(cudaGetLastError() == cudaSuccess);  // the backend cleared the runtime's error
    CHECK(alloc->stats().num_ooms == 1);
    void* p = alloc->allocate(kMiB, s.id());
    REQUIRE(p != nullptr);
    GPU_REQUIRE_OK(launch_fill(p, kMiB, 1, kSeed, s.get()));
    DeviceCounter mismatches;
    GPU_REQUIRE_OK(launch_verify(p, kMiB, 1, kSeed, mismatches.get(), s.get()));
    CHECK(mismatches.read() == 0);
    alloc->deallocate(p);
    check_all_free(*alloc);
  }

  SECTION("filling the device ends in OutOfMemory; freeing everything recovers") {
    const std::size_t chunk = 4 * kGiB;
    std::vector<void*> held;
    bool out_of_memory = false;
    for (std::size_t i = 0; i < total / chunk + 4 && !out_of_memory; ++i) {
      try {
        held.push_back(alloc->allocate(chunk, s.id()));
      } catch (const OutOfMemory& e) {
        out_of_memory = true;
        CHECK(std::string(e.what()).find("out of memory") != std::string::npos);
      }
    }
    CHECK(out_of_memory);
    CHECK(cudaGetLastError() == cudaSuccess);
    alloc->check_invariants();
    INFO("held " << held.size() << " x " << format_bytes(chunk));
    CHECK(held.size() >= 1);
    for (void* p : held) {
      alloc->deallocate(p);
    }
    alloc->empty_cache();
    void* p = alloc->allocate(chunk, s.id());
    REQUIRE(p != nullptr);
    alloc->deallocate(p);
    check_all_free(*alloc);
  }
}

}  // namespace cachealloc::gpu_test
