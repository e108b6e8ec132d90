// The front end's step memo (Note [The step memo], allocator.h): a training step's calls,
// once they repeated, are served from the recorded period. The memo must change nothing a
// caller can see but the time: every test runs the same calls through a second allocator with
// step_memo:False and compares addresses and statistics after every call.
#include "../support.h"

#include <cachealloc/allocator.h>
#include <cachealloc/errors.h>
#include <cachealloc/policies/defrag.h>
#include <cachealloc/policies/size_class.h>
#include <cachealloc/sim_backend.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace cachealloc;

namespace {

/// One call of a step: allocate `size` bytes into `slot`, or free `slot`.
struct StepOp {
  bool alloc;
  std::size_t slot;
  std::size_t size;
  StreamId stream = 1;
};

/// A training step's shape: activations allocated in the forward pass and freed in reverse in
/// the backward pass, temporaries freed soon after, and one block that lives across the step's
/// end (allocated last, freed first in the next step, as a loss or a gradient buffer may be).
/// Sizes 512 B - 64 MiB, log-uniform.
std::vector<StepOp> make_step(std::mt19937_64& rng, std::size_t layers, std::size_t first_slot) {
  const auto size = [&rng] {
    const double e = 9.0 + static_cast<double>(rng() % 1700) / 100.0;
    return static_cast<std::size_t>(std::exp2(e)) + rng() % 512;
  };
  std::vector<StepOp> ops;
  const std::size_t carried = first_slot;
  ops.push_back({false, carried, 0});  // run_steps skips it in the first step
  std::size_t slot = first_slot + 1;
  std::vector<std::size_t> saved;
  for (std::size_t l = 0; l < layers; ++l) {
    const std::size_t act = slot++;
    ops.push_back({true, act, size()});
    saved.push_back(act);
    const std::size_t tmp = slot++;
    ops.push_back({true, tmp, size()});
    if (rng() % 2 == 0) {
      const std::size_t tmp2 = slot++;
      ops.push_back({true, tmp2, size()});
      ops.push_back({false, tmp2, 0});
    }
    ops.push_back({false, tmp, 0});
  }
  for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
    const std::size_t grad = slot++;
    ops.push_back({true, grad, size()});
    ops.push_back({false, *it, 0});
    ops.push_back({false, grad, 0});
  }
  ops.push_back({true, carried, size()});
  return ops;
}

/// The same calls into the allocator under test (memo on, the default) and a twin with the
/// memo off; every address and every statistic must agree.
class Twins {
 public:
  explicit Twins(const std::string& conf = "")
      : memo_(make(conf)),
        plain_(make(conf.empty() ? "step_memo:False" : conf + ",step_memo:False")) {}

  void* alloc(std::size_t slot, std::size_t bytes, StreamId stream = 1) {
    void* a = memo_->allocate(bytes, stream);
    void* b = plain_->allocate(bytes, stream);
    REQUIRE(a == b);
    ptrs_[slot] = a;
    return a;
  }
  void free(std::size_t slot) {
    memo_->deallocate(ptrs_.at(slot));
    plain_->deallocate(ptrs_.at(slot));
    ptrs_.erase(slot);
  }
  void run(const StepOp& op) {
    if (op.alloc) {
      alloc(op.slot, op.size, op.stream);
    } else if (ptrs_.count(op.slot) != 0) {  // the carried block exists from the first step on
      free(op.slot);
    }
  }
  /// Statistics agree; read from the memo's allocator without making it catch up.
  void same_stats() const {
    test::check_same_stats(memo_->stats(), plain_->stats());
  }
  void check() const {
    memo_->check_invariants();
    plain_->check_invariants();
  }
  [[nodiscard]] std::int64_t memo(const std::string& name) const {
    return test::policy_counter(memo_->stats(), "memo." + name);
  }
  DeviceAllocator& with_memo() { return *memo_; }
  DeviceAllocator& without() { return *plain_; }
  [[nodiscard]] void* ptr(std::size_t slot) const { return ptrs_.at(slot); }
  [[nodiscard]] const std::map<std::size_t, void*>& live() const { return ptrs_; }

 private:
  static std::unique_ptr<DeviceAllocator> make(const std::string& conf) {
    SimOptions o;
    o.auto_complete_events = true;
    o.model_call_costs = true;  // defrag's moves cost time, so it settles (Note [Simulated time])
    o.capacity = std::size_t{1} << 40;
    Config config = Config::parse(conf);
    auto a =
        std::make_unique<CachingAllocator<DefragPolicy>>(std::make_unique<SimBackend>(o), config);
    config.finish("test", DefragPolicy::config_keys());
    return a;
  }
  std::unique_ptr<DeviceAllocator> memo_;
  std::unique_ptr<DeviceAllocator> plain_;
  std::map<std::size_t, void*> ptrs_;
};

/// Runs `steps` repetitions of `step`, comparing after every call.
void run_steps(Twins& t, const std::vector<StepOp>& step, int steps) {
  for (int s = 0; s < steps; ++s) {
    for (const StepOp& op : step) {
      t.run(op);
      t.same_stats();
    }
  }
}

/// Eight steps of `step`, after which the memo serves it (defrag has settled and one period
/// was tracked and matched).
void serve(Twins& t, const std::vector<StepOp>& step) {
  run_steps(t, step, 8);
  REQUIRE(t.memo("entries") == 1);
}

}  // namespace

TEST_CASE("step memo: a repeating step is served from the memo, with the addresses and "
          "statistics the policy gives", "[core][memo]") {
  std::mt19937_64 rng(7);
  const std::vector<StepOp> step = make_step(rng, 40, 1000);
  Twins t;
  void* weights = t.alloc(1, 300 * kMiB);
  run_steps(t, step, 3);
  CHECK(t.memo("served") == 0);  // two equal periods are needed, the first steps grow
  run_steps(t, step, 6);
  CHECK(t.memo("entries") == 1);
  CHECK(t.memo("served") >= static_cast<std::int64_t>(3 * step.size()));
  const std::int64_t replayed = t.memo("replayed");
  t.same_stats();  // statistics do not make the policy catch up
  CHECK(t.memo("replayed") == replayed);
  t.check();  // check_invariants() does, then the memo goes on serving
  CHECK(t.memo("period") == static_cast<std::int64_t>(step.size()));
  const std::int64_t served = t.memo("served");
  run_steps(t, step, 2);
  CHECK(t.memo("served") == served + static_cast<std::int64_t>(2 * step.size()));
  t.free(1);
  CHECK(t.memo("exits") == 1);  // not in the period: the memo leaves
  (void)weights;
  t.check();
}

TEST_CASE("step memo: a call the period does not have, anywhere in the period, leaves the "
          "memo and the policy catches up exactly", "[core][memo]") {
  std::mt19937_64 rng(11);
  const std::vector<StepOp> step = make_step(rng, 30, 1000);
  for (int trial = 0; trial < 12; ++trial) {
    INFO("trial " << trial);
    Twins t;
    serve(t, step);
    // Part of a period, then a different size where the step had another.
    const std::size_t cut = rng() % step.size();
    for (std::size_t i = 0; i < cut; ++i) {
      t.run(step[i]);
      t.same_stats();
    }
    std::vector<StepOp> changed = step;
    for (std::size_t i = cut; i < changed.size(); ++i) {
      if (changed[i].alloc) {
        changed[i].size += 4096;
        break;
      }
    }
    for (std::size_t i = cut; i < changed.size(); ++i) {
      t.run(changed[i]);
      t.same_stats();
    }
    CHECK(t.memo("exits") >= (cut < step.size() ? 1 : 0));
    t.check();
    // The new step becomes the period in its turn.
    run_steps(t, changed, 6);
    t.check();
    CHECK(t.memo("entries") >= 2);
  }
}

TEST_CASE("step memo: queries and misuse in the middle of a period", "[core][memo]") {
  // A step after which defrag holds still (with some steps it moves two chunks every step, and
  // the memo rightly never starts: a period must be quiet).
  std::mt19937_64 rng(7);
  const std::vector<StepOp> step = make_step(rng, 40, 1000);
  Twins t;
  serve(t, step);
  const std::size_t half = step.size() / 2;
  for (std::size_t i = 0; i < half; ++i) {
    t.run(step[i]);
  }
  SECTION("find() and segments() see the blocks the memo handed out") {
    for (const auto& [slot, p] : t.live()) {
      const auto a = t.with_memo().find(p);
      const auto b = t.without().find(p);
      REQUIRE(a.has_value());
      REQUIRE(b.has_value());
      CHECK(a->block_size == b->block_size);
      CHECK(a->requested == b->requested);
    }
    CHECK(t.with_memo().segments().size() == t.without().segments().size());
  }
  SECTION("a pointer that is not ours is refused, and changes nothing") {
    void* foreign = reinterpret_cast<void*>(std::uintptr_t{0x10});
    CHECK_THROWS_AS(t.with_memo().deallocate(foreign), UsageError);
    CHECK_THROWS_AS(t.without().deallocate(foreign), UsageError);
    t.same_stats();
  }
  SECTION("reset_peak_stats() and empty_cache()") {
    t.with_memo().reset_peak_stats();
    t.without().reset_peak_stats();
    t.same_stats();
    t.with_memo().empty_cache();
    t.without().empty_cache();
    t.same_stats();
  }
  SECTION("record_stream() leaves the memo") {
    const auto [slot, p] = *t.live().begin();
    t.with_memo().record_stream(p, 1);
    t.without().record_stream(p, 1);
    CHECK(t.memo("exits") == 1);
  }
  for (std::size_t i = half; i < step.size(); ++i) {
    t.run(step[i]);
    t.same_stats();
  }
  t.check();
  run_steps(t, step, 2);
  t.check();
}

TEST_CASE("step memo: a double free of a block the memo freed is refused", "[core][memo]") {
  std::mt19937_64 rng(5);
  const std::vector<StepOp> step = make_step(rng, 20, 1000);
  Twins t;
  serve(t, step);
  // Run up to and including the step's first free, then free that block again.
  std::size_t i = 0;
  void* freed = nullptr;
  for (; i < step.size(); ++i) {
    if (!step[i].alloc) {
      freed = t.ptr(step[i].slot);
      t.run(step[i]);
      ++i;
      break;
    }
    t.run(step[i]);
  }
  REQUIRE(freed != nullptr);
  CHECK_THROWS_AS(t.with_memo().deallocate(freed), UsageError);
  CHECK_THROWS_AS(t.without().deallocate(freed), UsageError);
  t.same_stats();
  for (; i < step.size(); ++i) {
    t.run(step[i]);
    t.same_stats();
  }
  t.check();
}

TEST_CASE("step memo: never with two streams, nor for a policy that cannot repeat its placement",
          "[core][memo]") {
  std::mt19937_64 rng(9);
  std::vector<StepOp> step = make_step(rng, 20, 1000);
  for (std::size_t i = 0; i < step.size(); i += 7) {
    step[i].stream = 2;  // some blocks on a second stream
  }
  for (StepOp& op : step) {  // a free keeps its block's stream
    if (!op.alloc) {
      for (const StepOp& a : step) {
        if (a.alloc && a.slot == op.slot) {
          op.stream = a.stream;
        }
      }
    }
  }
  Twins t;
  run_steps(t, step, 10);
  CHECK(t.memo("entries") == 0);
  // Note [Learning only while placement can repeat]: once defrag saw the second stream, the
  // learner stops; it never tracks a candidate period only to be refused at its end.
  CHECK(t.memo("verify_started") == 0);
  t.check();

  // A job that used a second stream once, at its start, and then repeats on one stream: the
  // memo never serves it (defrag keeps the stream), and the learner stops at once.
  Twins once;
  once.alloc(0, 4096, /*stream=*/2);
  once.free(0);
  std::vector<StepOp> single = make_step(rng, 20, 1000);
  run_steps(once, single, 10);
  CHECK(once.memo("entries") == 0);
  CHECK(once.memo("verify_started") == 0);
  once.check();

  Config on = Config::parse("step_memo:True");
  CHECK_THROWS_AS(CachingAllocator<SizeClassPolicy>(std::make_unique<SimBackend>(SimOptions{}), on),
                  ConfigError);
  Config off = Config::parse("");
  CachingAllocator<SizeClassPolicy> sc(std::make_unique<SimBackend>(SimOptions{}), off);
  CHECK(test::policy_counter(sc.stats(), "memo.served") == -1);  // no memo, no counters
}

TEST_CASE("step memo: randomized steps, changes and queries, compared call by call",
          "[core][memo][randomized]") {
  const std::uint64_t seed = GENERATE(1u, 2u, 3u, 4u, 5u, 6u);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<StepOp> step = make_step(rng, 20 + rng() % 40, 1000);
  Twins t;
  for (int s = 0; s < 40; ++s) {
    if (s % 12 == 11) {  // the job changes shape: a new step from here on
      step = make_step(rng, 20 + rng() % 40, 1000 + 1000 * static_cast<std::size_t>(s));
    }
    const std::size_t query_at = rng() % (step.size() + 1);
    const int query = static_cast<int>(rng() % 5);
    for (std::size_t i = 0; i < step.size(); ++i) {
      if (i == query_at) {
        switch (query) {
          case 0:
            t.check();
            break;
          case 1:
            t.with_memo().reset_peak_stats();
            t.without().reset_peak_stats();
            break;
          case 2:
            if (!t.live().empty()) {
              void* p = t.live().begin()->second;
              CHECK(t.with_memo().find(p)->block_size == t.without().find(p)->block_size);
            }
            break;
          case 3:
            t.with_memo().reset_accumulated_stats();
            t.without().reset_accumulated_stats();
            break;
          default:
            break;  // statistics only
        }
      }
      t.run(step[i]);
      t.same_stats();
    }
  }
  t.check();
  for (const auto& [k, v] : t.with_memo().stats().policy_counters) {
    UNSCOPED_INFO(k << "=" << v);
  }
  CHECK(t.memo("entries") >= 1);
}
