// step_memo.h: the front end's step memo (Note [The step memo], allocator.h): the calls a
// training step makes, learnt once they repeat, so that the next steps are served from a
// sequential list instead of the policy.
#pragma once

#include <cachealloc/hot_pages.h>
#include <cachealloc/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace cachealloc {

/// One allocator call as the step memo keeps it: 32 bytes, two to a cache line.
struct MemoOp {
  /// Set in `requested` for a free (no request is that large: kMaxRequestBytes is 2^48).
  static constexpr std::uint64_t kFree = std::uint64_t{1} << 63;

  std::uintptr_t ptr = 0;        ///< the block's address: returned by the allocation, or freed
  std::uint64_t requested = 0;   ///< bytes asked for; for a free kFree | the bytes asked for then
  std::uint64_t block_size = 0;  ///< the block's size, as the policy set it aside
  StreamId stream = 0;           ///< the stream the block was allocated on

  [[nodiscard]] bool is_free() const noexcept { return (requested & kFree) != 0; }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return requested & ~kFree; }
  friend bool operator==(const MemoOp&, const MemoOp&) = default;
};

/// Finds out when the calls the front end executes repeat (Note [The step memo]) in two
/// stages. Watching costs almost nothing: one allocation in kSampleEvery (by a hash of its
/// address, size and stream) looks up where the same call was made last; when kConfident of them
/// found it the same number of calls back, that distance is the candidate period P.
/// Tracking keeps the last P calls in a ring and counts the calls in a row that equal the call
/// P before them, were quiet (no free parked behind another stream, no device mapping call
/// since the call before) and on one stream; at P in a row the last P calls repeated the P
/// before them and the memo takes over with them. A difference only restarts the count (the
/// ring stays), so a job that repeats after an irregular step is served one period later;
/// tracking gives up after kGiveUp periods, or kGiveUpDiffered periods of differing calls,
/// without success. Not thread-safe: the front end
/// calls it under its lock.
class MemoLearner {
 public:
  /// Longest period looked for, in calls (a ResNet-50 training step makes 2,424).
  static constexpr std::uint64_t kMaxPeriod = std::uint64_t{1} << 15;
  /// Tracking goes back to watching after this many periods without success, or once this
  /// many periods' worth of calls differed from the call one period before (a job that does not
  /// repeat stops paying for the ring soon; one whose layout is still settling keeps its ring).
  static constexpr std::uint64_t kGiveUp = 8;
  static constexpr std::uint64_t kGiveUpDiffered = 2;
  /// One address in this many is watched.
  static constexpr std::uint64_t kSampleEvery = 8;
  /// Votes (sampled calls that found their last occurrence that many calls back) a distance
  /// needs within kVoteWindow sampled calls before it is verified as the period.
  static constexpr std::uint32_t kConfident = 16;
  static constexpr std::uint32_t kVoteWindow = 256;

  /// Whether the front end should pass `op` to observe(): always while verifying, else only a
  /// sampled allocation. Inline and cheap: this is on every call's path.
  [[nodiscard]] bool wants(const MemoOp& op) const noexcept {
    return verifying_ || (!op.is_free() && (signature(op) & (kSampleEvery - 1)) == 0);
  }
  /// A call the front end executed (only those wants() asked for). `calls`: the front end's
  /// count of executed calls (allocations + frees); `quiet`: nothing is parked behind another
  /// stream; `mapping_calls`: the backend's count of calls that changed device mappings
  /// (BackendCounters::mapping_calls). True when two equal periods were seen: the memo can
  /// take over with period() (the next call is expected to be its first).
  bool observe(const MemoOp& op, std::uint64_t calls, bool quiet, std::uint64_t mapping_calls);
  /// Drops a verification in progress and the detector's streak (a call that broke the
  /// pattern: one the memo did not expect, record_stream, empty_cache, an observer).
  void restart() noexcept;
  /// The period that repeated, in the order the next calls are expected (valid after observe()
  /// returned true).
  void period_into(std::vector<MemoOp>& out) const;
  [[nodiscard]] bool verifying() const noexcept { return verifying_; }

  /// What tracking saw (statistics: memo.verify_*).
  struct Outcomes {
    std::uint64_t started = 0;      ///< candidate periods tracked
    std::uint64_t differed = 0;     ///< calls that differed from the one a period earlier
    std::uint64_t not_quiet = 0;    ///< calls after a parked free, an observer or a mapping call
    std::uint64_t stream = 0;       ///< calls on another stream than the one before
    std::uint64_t interrupted = 0;  ///< restart() while tracking: the front end saw something else
    std::uint64_t gave_up = 0;      ///< candidates dropped after kGiveUp periods
  };
  [[nodiscard]] const Outcomes& outcomes() const noexcept { return outcomes_; }

  /// A hash of an allocation's address, size and stream: what is sampled and where it is kept.
  [[nodiscard]] static std::uint64_t signature(const MemoOp& op) noexcept {
    std::uint64_t h = static_cast<std::uint64_t>(op.ptr) >> 9;  // blocks are 512-byte aligned
    h = (h ^ op.requested * 0xC2B2AE3D27D4EB4Full) * 0x9E3779B97F4A7C15ull;
    h = (h ^ static_cast<std::uint64_t>(op.stream)) * 0x9E3779B97F4A7C15ull;
    return h >> 16;
  }

 private:
  static constexpr std::size_t kSlots = 4096;  // watched addresses, by hash
  struct Last {
    std::uintptr_t ptr = 0;
    std::uint64_t calls = 0;  // the front end's call count when it was allocated
    std::uint64_t requested = 0;
    StreamId stream = 0;
  };

  bool watch(const MemoOp& op, std::uint64_t calls, std::uint64_t mapping_calls);
  bool track(const MemoOp& op, bool quiet, std::uint64_t mapping_calls);

  struct Vote {
    std::uint64_t distance = 0;
    std::uint32_t count = 0;
  };

  bool verifying_ = false;         // tracking a candidate period
  std::array<Vote, 8> votes_{};    // watching: the distances seen most
  std::uint64_t sampled_ = 0;      // watching: sampled calls seen
  std::uint64_t period_ = 0;       // tracking: the candidate period P
  std::size_t pos_ = 0;            // tracking: ring slot of the call P before the next one
  std::uint64_t filled_ = 0;       // tracking: calls recorded (the ring is full at P)
  std::uint64_t match_ = 0;        // tracking: calls in a row equal to the one P before
  std::uint64_t tracked_ = 0;      // tracking: calls since it began
  std::uint64_t differed_ = 0;     // tracking: calls that differed since it began
  std::uint64_t mapping_seen_ = 0; // tracking: mapping calls at the call before
  StreamId stream_ = 0;            // tracking: the stream of the call before
  std::vector<Last, hot::Allocator<Last>> last_;  // kSlots, allocated at the first sampled call
  std::vector<MemoOp> log_;        // tracking: the ring of the last P calls
  Outcomes outcomes_;
};

}  // namespace cachealloc
