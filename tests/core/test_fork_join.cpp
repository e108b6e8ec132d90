// Tests of ForkJoin (fork_join.h; backend cuda_vmm's map_threads): every task runs exactly once
// per run, tasks run at once on the workers, exceptions reach the caller after all tasks
// returned, and a pool without (working) threads still runs everything. Run under TSan in CI
// (tools/run_tests.sh).
#include <cachealloc/fork_join.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

using cachealloc::ForkJoin;

namespace {
/// Counts, per index, how often run() called the task.
std::vector<int> counts_of(ForkJoin& pool, std::size_t n) {
  std::vector<std::atomic<int>> calls(n);
  pool.run(n, [&](std::size_t i) { calls[i].fetch_add(1); });
  std::vector<int> out;
  for (auto& c : calls) {
    out.push_back(c.load());
  }
  return out;
}
}  // namespace

TEST_CASE("fork_join runs every task exactly once, whatever the pool and the count", "[fork_join]") {
  for (std::size_t workers : {0, 1, 3, 8}) {
    ForkJoin pool(workers);
    for (std::size_t n : {0, 1, 2, 5, 17}) {
      CAPTURE(workers, n);
      CHECK(counts_of(pool, n) == std::vector<int>(n, 1));
    }
  }
}

TEST_CASE("fork_join: many runs in a row each see their own tasks only", "[fork_join]") {
  // A worker that wakes for one run after it ended must not take a task of the next one with
  // the earlier run's task (each run's task writes to its own vector).
  ForkJoin pool(3);
  for (int round = 0; round < 2000; ++round) {
    const std::size_t n = 1 + static_cast<std::size_t>(round % 5);
    std::vector<int> seen(n, 0);
    std::mutex m;
    pool.run(n, [&](std::size_t i) {
      std::lock_guard lock(m);
      ++seen[i];
    });
    REQUIRE(seen == std::vector<int>(n, 1));
  }
}

TEST_CASE("fork_join runs the tasks at once on its workers", "[fork_join]") {
  // n tasks that each wait until all n have started: they finish only if n run at the same
  // time (the wait gives up after 10 s, so a pool that ran them one by one fails instead of
  // hanging).
  constexpr std::size_t kWorkers = 3;
  ForkJoin pool(kWorkers);
  const std::size_t n = kWorkers + 1;
  std::mutex m;
  std::condition_variable cv;
  std::size_t arrived = 0;
  std::atomic<int> met{0};
  pool.run(n, [&](std::size_t) {
    std::unique_lock lock(m);
    ++arrived;
    cv.notify_all();
    if (cv.wait_for(lock, std::chrono::seconds(10), [&] { return arrived == n; })) {
      met.fetch_add(1);
    }
  });
  CHECK(met.load() == static_cast<int>(n));
  CHECK(pool.started() == kWorkers);
  CHECK(pool.tasks_on_workers() == kWorkers);
}

TEST_CASE("fork_join rethrows a task's exception after every task returned", "[fork_join]") {
  ForkJoin pool(2);
  std::vector<std::atomic<int>> calls(6);
  CHECK_THROWS_WITH(pool.run(6,
                             [&](std::size_t i) {
                               calls[i].fetch_add(1);
                               if (i == 2 || i == 4) {
                                 throw std::runtime_error("task failed");
                               }
                             }),
                    "task failed");
  for (auto& c : calls) {
    CHECK(c.load() == 1);
  }
  // The pool is usable afterwards, and the error does not come back.
  CHECK(counts_of(pool, 4) == std::vector<int>(4, 1));
}

TEST_CASE("fork_join without threads, or with workers whose start fails, runs all on the caller",
          "[fork_join]") {
  SECTION("no workers: nothing starts") {
    ForkJoin pool(0);
    const auto caller = std::this_thread::get_id();
    bool all_here = true;
    pool.run(5, [&](std::size_t) { all_here = all_here && std::this_thread::get_id() == caller; });
    CHECK(all_here);
    CHECK(pool.started() == 0);
    CHECK(pool.tasks_on_workers() == 0);
  }
  SECTION("every worker's init throws") {
    ForkJoin pool(3, [] { throw std::runtime_error("no device"); });
    CHECK(counts_of(pool, 7) == std::vector<int>(7, 1));
    CHECK(pool.tasks_on_workers() == 0);
  }
  SECTION("threads start at the first run with more than one task, not before") {
    ForkJoin pool(2);
    CHECK(pool.started() == 0);
    CHECK(counts_of(pool, 1) == std::vector<int>{1});
    CHECK(pool.started() == 0);
    CHECK(counts_of(pool, 2) == std::vector<int>(2, 1));
    CHECK(pool.started() == 2);
  }
}
