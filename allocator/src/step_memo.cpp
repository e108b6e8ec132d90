// step_memo.cpp: MemoLearner, the step memo's period detection (Note [The step memo],
// allocator.h).
#include <cachealloc/step_memo.h>

namespace cachealloc {

bool MemoLearner::observe(const MemoOp& op, std::uint64_t calls, bool quiet,
                          std::uint64_t mapping_calls) {
  if (verifying_) {
    return verify(op, quiet, mapping_calls);
  }
  return watch(op, calls, mapping_calls);
}

bool MemoLearner::watch(const MemoOp& op, std::uint64_t calls, std::uint64_t mapping_calls) {
  if (last_.empty()) {
    last_.resize(kSlots);
  }
  Last& last = last_[(signature(op) >> 32) & (kSlots - 1)];
  const std::uint64_t distance =
      last.ptr == op.ptr && last.requested == op.requested && last.stream == op.stream
          ? calls - last.calls
          : 0;
  last = Last{op.ptr, calls, op.requested, op.stream};
  if (++sampled_ % kVoteWindow == 0) {
    votes_ = {};  // the counts of the last kVoteWindow sampled calls only
  }
  if (distance == 0 || distance > kMaxPeriod) {
    return false;
  }
  // One vote for this distance (a block reused several times per period votes for shorter
  // ones too; the period is the distance that comes up most).
  Vote* vote = &votes_[0];
  for (Vote& v : votes_) {
    if (v.distance == distance) {
      vote = &v;
      break;
    }
    if (v.count < vote->count) {
      vote = &v;
    }
  }
  if (vote->distance != distance) {
    *vote = Vote{distance, 0};
  }
  if (++vote->count < kConfident) {
    return false;
  }
  // Record the next `distance` calls exactly, then compare the ones after them.
  verifying_ = true;
  comparing_ = false;
  period_ = distance;
  pos_ = 0;
  mapping_at_start_ = mapping_calls;
  log_.resize(period_);  // may throw bad_alloc: the front end turns the memo off then
  votes_ = {};
  ++outcomes_.started;
  return false;
}

bool MemoLearner::verify(const MemoOp& op, bool quiet, std::uint64_t mapping_calls) {
  const bool first = !comparing_ && pos_ == 0;  // fixes the stream of the whole period
  const bool same = quiet && mapping_calls == mapping_at_start_ &&
                    (first || op.stream == log_[0].stream) && (!comparing_ || log_[pos_] == op);
  if (!same) {
    if (!quiet || mapping_calls != mapping_at_start_) {
      ++outcomes_.not_quiet;
    } else if (!first && op.stream != log_[0].stream) {
      ++outcomes_.stream;
    } else {
      ++outcomes_.differed;
      outcomes_.differed_at = pos_;
    }
    verifying_ = false;
    comparing_ = false;
    votes_ = {};
    return false;
  }
  if (!comparing_) {
    log_[pos_] = op;
    if (++pos_ == period_) {
      comparing_ = true;
      pos_ = 0;
    }
    return false;
  }
  if (++pos_ < period_) {
    return false;
  }
  verifying_ = false;  // done: the period repeated exactly
  return true;
}

void MemoLearner::restart() noexcept {
  if (verifying_) {
    ++outcomes_.interrupted;
  }
  verifying_ = false;
  comparing_ = false;
  votes_ = {};
}

}  // namespace cachealloc
