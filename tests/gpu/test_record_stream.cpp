// test_record_stream.cpp: record_stream safety on the real device, for every policy.
//
// Block A is allocated on s1 and used by a long kernel on s2: the kernel writes its own pattern
// into A, spins ~50 ms, then re-reads A and counts words that changed. Meanwhile the host calls
// record_stream(A, s2), frees A, and at once allocates blocks of A's size on s1 and overwrites
// them with a different pattern from s1. If the allocator handed A out again before s2 was done
// with it, the s2 kernel sees its data changed (mismatches > 0, wrong checksum).
#include "gpu_test_util.h"
#include "kernels.h"

#include <cachealloc/errors.h>

#include <cstdio>

namespace cachealloc::gpu_test {
namespace {

/// s1 fills `a` (pattern 1), then a kernel on s2, queued after that fill, writes pattern 2 into
/// `a`, spins ~50 ms and re-reads it: `mismatches` counts the words another stream changed
/// meanwhile, `checksum` what it read.
struct HeldOnS2 {
  /// Counters only; start() launches. DeviceCounter synchronizes the device when it is made, so
  /// a test that keeps two streams busy makes every HeldOnS2 before it starts the first.
  HeldOnS2() { GPU_REQUIRE_OK(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming)); }
  HeldOnS2(void* a, std::size_t bytes, std::uint64_t seed, const TestStream& s1, const TestStream& s2)
      : HeldOnS2() {
    start(a, bytes, seed, s1, s2);
  }
  void start(void* a, std::size_t bytes, std::uint64_t seed, const TestStream& s1, const TestStream& s2) {
    GPU_REQUIRE_OK(launch_fill(a, bytes, 1, seed, s1.get()));  // s1's own use of A
    GPU_REQUIRE_OK(cudaEventRecord(filled, s1.get()));
    GPU_REQUIRE_OK(cudaStreamWaitEvent(s2.get(), filled, 0));
    GPU_REQUIRE_OK(launch_hold_and_check(a, bytes, 2, seed, cycles_for_ms(50), multiprocessor_count(),
                                         mismatches.get(), checksum.get(), s2.get()));
  }
  ~HeldOnS2() { (void)cudaEventDestroy(filled); }
  HeldOnS2(const HeldOnS2&) = delete;
  HeldOnS2& operator=(const HeldOnS2&) = delete;

  cudaEvent_t filled = nullptr;
  DeviceCounter mismatches;
  DeviceCounter checksum;
};

}  // namespace

TEST_CASE("record_stream keeps a block from reuse while the other stream uses it",
          "[gpu][record_stream]") {
  const std::string policy = GENERATE(from_range(gpu_policy_names()));
  CAPTURE(policy);
  TestStream s1;
  TestStream s2;
  auto alloc = make_gpu_allocator(policy);
  constexpr std::uint64_t kSeed = 77;
  constexpr int kReallocations = 8;

  for (const std::size_t bytes : {std::size_t{64} * kKiB, 8 * kMiB}) {
    INFO("bytes " << bytes);
    void* a = alloc->allocate(bytes, s1.id());
    const HeldOnS2 held(a, bytes, kSeed, s1, s2);
    alloc->record_stream(a, s2.id());
    alloc->deallocate(a);
    CHECK(alloc->pending_frees() == 1);

    bool reused_while_busy = false;
    std::vector<void*> later;
    for (int i = 0; i < kReallocations; ++i) {
      void* b = alloc->allocate(bytes, s1.id());
      const cudaError_t s2_state = cudaStreamQuery(s2.get());
      (void)cudaGetLastError();
      if (b == a && s2_state == cudaErrorNotReady) {
        reused_while_busy = true;
      }
      GPU_REQUIRE_OK(launch_fill(b, bytes, 100 + static_cast<std::uint64_t>(i), kSeed, s1.get()));
      later.push_back(b);
    }
    const cudaError_t s2_after = cudaStreamQuery(s2.get());
    (void)cudaGetLastError();
    if (s2_after != cudaErrorNotReady) {
      WARN("s2's kernel finished before the reallocations did; the test did not race");
    }
    CHECK_FALSE(reused_while_busy);

    GPU_REQUIRE_OK(cudaStreamSynchronize(s2.get()));
    GPU_REQUIRE_OK(cudaStreamSynchronize(s1.get()));
    CHECK(held.mismatches.read() == 0);
    CHECK(held.checksum.read() == expected_checksum(bytes, 2, kSeed));

    DeviceCounter later_mismatches;
    for (int i = 0; i < kReallocations; ++i) {
      GPU_REQUIRE_OK(launch_verify(later[i], bytes, 100 + static_cast<std::uint64_t>(i), kSeed,
                                   later_mismatches.get(), s1.get()));
    }
    CHECK(later_mismatches.read() == 0);
    for (void* b : later) {
      alloc->deallocate(b);
    }
    // s2 finished: the parked free completes at the next allocation (or empty_cache).
    void* c = alloc->allocate(bytes, s1.id());
    CHECK(alloc->pending_frees() == 0);
    alloc->deallocate(c);
  }
  alloc->check_invariants();
  alloc->empty_cache();
  const Stats s = alloc->stats();
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.active_bytes.current == 0);
  CHECK(s.reserved_bytes.current == 0);
}

TEST_CASE("reuse_parked hands a parked block to the stream it waits for, in that stream's order",
          "[gpu][record_stream]") {
  // Note [Reusing a parked free on the stream it waits for] (allocator.h) on the real device: A
  // is allocated on s1 and used by s2's ~50 ms kernel, then freed (parked behind s2). With s1
  // idle, an allocation of A's size on s2 gets A at once, while s2's kernel still runs; s2's next
  // work (a fill with pattern 3) runs after that kernel, so the kernel sees no change, and A then
  // holds pattern 3. A's next free waits for s2 again: s1 does not get it while s2 is busy.
  const std::string policy = GENERATE(from_range(gpu_policy_names()));
  CAPTURE(policy);
  TestStream s1;
  TestStream s2;
  auto alloc = make_gpu_allocator(policy, "reuse_parked:True");
  constexpr std::uint64_t kSeed = 79;
  constexpr std::size_t bytes = 8 * kMiB;
  void* a = alloc->allocate(bytes, s1.id());
  const HeldOnS2 held(a, bytes, kSeed, s1, s2);
  alloc->record_stream(a, s2.id());
  alloc->deallocate(a);
  REQUIRE(alloc->pending_frees() == 1);
  GPU_REQUIRE_OK(cudaStreamSynchronize(s1.get()));  // A's own stream is done with it
  void* b = alloc->allocate(bytes, s2.id());
  const bool raced = cudaStreamQuery(s2.get()) == cudaErrorNotReady;
  (void)cudaGetLastError();
  if (raced) {  // s2's event was still pending: A could only have come back by reuse
    CHECK(b == a);
    CHECK(alloc->stats().parked_reuses == 1);
  } else {  // e.g. under compute-sanitizer, whose host is slow: A came back the usual way
    WARN("s2's kernel finished before the allocation; the test did not race");
  }
  CHECK(alloc->pending_frees() == 0);
  GPU_REQUIRE_OK(launch_fill(b, bytes, 3, kSeed, s2.get()));
  DeviceCounter filled_after;
  GPU_REQUIRE_OK(launch_verify(b, bytes, 3, kSeed, filled_after.get(), s2.get()));
  // A second long kernel on s2 keeps it busy while b is freed and s1 asks for the same size.
  const HeldOnS2 again(b, bytes, kSeed + 1, s2, s2);
  alloc->deallocate(b);
  void* c = alloc->allocate(bytes, s1.id());
  const bool s2_busy = cudaStreamQuery(s2.get()) == cudaErrorNotReady;
  (void)cudaGetLastError();
  if (s2_busy) {
    CHECK(c != b);
  } else {
    WARN("s2's second kernel finished before s1's allocation; that part did not race");
  }
  GPU_REQUIRE_OK(launch_fill(c, bytes, 4, kSeed, s1.get()));
  GPU_REQUIRE_OK(cudaStreamSynchronize(s2.get()));
  GPU_REQUIRE_OK(cudaStreamSynchronize(s1.get()));
  CHECK(held.mismatches.read() == 0);
  CHECK(held.checksum.read() == expected_checksum(bytes, 2, kSeed));
  CHECK(filled_after.read() == 0);  // s2's fill ran after its kernel, not under it
  CHECK(again.mismatches.read() == 0);
  CHECK(again.checksum.read() == expected_checksum(bytes, 2, kSeed + 1));
  alloc->deallocate(c);
  alloc->check_invariants();
  alloc->empty_cache();
  alloc->check_invariants();
  const Stats st = alloc->stats();
  CHECK(st.allocated_bytes.current == 0);
  CHECK(st.active_bytes.current == 0);
}

TEST_CASE("reuse_parked_waits makes the stream wait on the device for the block's own stream",
          "[gpu][record_stream]") {
  // Note [Reusing a parked free on the stream it waits for]: A's own stream s1 runs a ~50 ms
  // kernel on A; A is also used on s2 (record_stream), which is busy with a ~50 ms kernel of its
  // own (on another block, C), and freed: parked behind s2. An allocation of A's size on s2 takes
  // A while s1's kernel still runs, by making s2 wait for s1's event (cudaStreamWaitEvent): s2's
  // fill of A (pattern 3) runs after s1's kernel, which therefore sees no change. (With s2 idle
  // the free would come back through the poll instead, to s1's pool.)
  const std::string policy = GENERATE(from_range(gpu_policy_names()));
  CAPTURE(policy);
  TestStream s1;
  TestStream s2;
  auto alloc = make_gpu_allocator(policy, "reuse_parked_waits:True");
  constexpr std::uint64_t kSeed = 80;
  constexpr std::size_t bytes = 8 * kMiB;
  void* c = alloc->allocate(bytes / 2, s2.id());
  void* a = alloc->allocate(bytes, s1.id());
  // Both made before either kernel starts: making one synchronizes the device (DeviceCounter),
  // which in session 41's first run let s2's kernel finish before s1's began, so s2 was idle.
  HeldOnS2 busy;
  HeldOnS2 held;
  busy.start(c, bytes / 2, kSeed + 1, s2, s2);  // keeps s2 busy: A stays parked
  held.start(a, bytes, kSeed, s1, s1);          // the fill and the long kernel, both on s1
  alloc->record_stream(a, s2.id());
  alloc->deallocate(a);
  void* b = alloc->allocate(bytes, s2.id());
  const bool s1_busy = cudaStreamQuery(s1.get()) == cudaErrorNotReady;
  const bool s2_busy = cudaStreamQuery(s2.get()) == cudaErrorNotReady;
  (void)cudaGetLastError();
  if (s1_busy && s2_busy) {  // A was parked and only a device-side wait lets s2 have it
    CHECK(b == a);
    CHECK(alloc->stats().parked_reuses == 1);
    CHECK(alloc->stats().parked_reuse_waits == 1);
  } else {
    WARN("the test did not race: s1 " << (s1_busy ? "busy" : "idle") << ", s2 "
                                      << (s2_busy ? "busy" : "idle") << " after the allocation");
  }
  GPU_REQUIRE_OK(launch_fill(b, bytes, 3, kSeed, s2.get()));
  DeviceCounter filled_after;
  GPU_REQUIRE_OK(launch_verify(b, bytes, 3, kSeed, filled_after.get(), s2.get()));
  GPU_REQUIRE_OK(cudaStreamSynchronize(s2.get()));
  GPU_REQUIRE_OK(cudaStreamSynchronize(s1.get()));
  CHECK(held.mismatches.read() == 0);  // s2's fill did not run under s1's kernel
  CHECK(held.checksum.read() == expected_checksum(bytes, 2, kSeed));
  CHECK(filled_after.read() == 0);
  CHECK(busy.mismatches.read() == 0);
  alloc->deallocate(b);
  alloc->deallocate(c);
  alloc->empty_cache();
  alloc->check_invariants();
  CHECK(alloc->stats().allocated_bytes.current == 0);
  CHECK(alloc->stats().active_bytes.current == 0);
}

TEST_CASE("defrag with wait_parked_to_grow waits for the other stream instead of growing",
          "[gpu][record_stream][defrag]") {
  // Note [Waiting for frees in flight instead of growing] (allocator.h) on the real device: A is
  // all the memory defrag holds; a kernel on s2 uses it for ~50 ms; A is freed (parked). The next
  // request of A's size on s1 cannot be served without growing, so the front end waits for s2's
  // event: it returns A itself, after s2's kernel finished, and nothing grew.
  TestStream s1;
  TestStream s2;
  auto alloc = make_gpu_allocator("defrag", "grow_slack:0,wait_parked_to_grow:0");
  constexpr std::uint64_t kSeed = 78;
  constexpr std::size_t bytes = 8 * kMiB;
  void* a = alloc->allocate(bytes, s1.id());
  const HeldOnS2 held(a, bytes, kSeed, s1, s2);
  alloc->record_stream(a, s2.id());
  alloc->deallocate(a);
  REQUIRE(alloc->pending_frees() == 1);
  const bool raced = cudaStreamQuery(s2.get()) == cudaErrorNotReady;
  (void)cudaGetLastError();
  const std::int64_t reserved = alloc->stats().reserved_bytes.current;
  void* b = alloc->allocate(bytes, s1.id());
  const cudaError_t s2_state = cudaStreamQuery(s2.get());
  (void)cudaGetLastError();
  CHECK(s2_state == cudaSuccess);  // the allocation returned only after s2's kernel finished
  CHECK(b == a);
  CHECK(alloc->pending_frees() == 0);
  CHECK(alloc->stats().reserved_bytes.current == reserved);
  if (raced) {
    CHECK(alloc->stats().parked_waits == 1);
  } else {
    WARN("s2's kernel finished before the allocation; the test did not wait");
  }
  GPU_REQUIRE_OK(launch_fill(b, bytes, 3, kSeed, s1.get()));
  GPU_REQUIRE_OK(cudaStreamSynchronize(s1.get()));
  GPU_REQUIRE_OK(cudaStreamSynchronize(s2.get()));
  CHECK(held.mismatches.read() == 0);
  CHECK(held.checksum.read() == expected_checksum(bytes, 2, kSeed));
  DeviceCounter later;
  GPU_REQUIRE_OK(launch_verify(b, bytes, 3, kSeed, later.get(), s1.get()));
  CHECK(later.read() == 0);
  alloc->deallocate(b);
  alloc->check_invariants();
  alloc->empty_cache();
  CHECK(alloc->stats().reserved_bytes.current == 0);
}

}  // namespace cachealloc::gpu_test
