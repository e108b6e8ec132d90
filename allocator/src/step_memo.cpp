// step_memo.cpp: MemoLearner, the step memo's period detection (Note [The step memo],
// allocator.h).
#include <cachealloc/step_memo.h>

namespace cachealloc {

bool MemoLearner::observe(const MemoOp& op, std::uint64_t calls, bool quiet,
                          std::uint64_t mapping_calls) {
  if (verifying_) {
    return track(op, quiet, mapping_calls);
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
  // A job whose layout changed recently also repeats at multiples of its period: take the
  // shortest distance with votes of its own that divides this one.
  std::uint64_t period = distance;
  for (const Vote& v : votes_) {
    if (v.distance != 0 && v.distance < period && distance % v.distance == 0 &&
        v.count >= kConfident / 4) {
      period = v.distance;
    }
  }
  // Track the candidate: keep the last `period` calls and count the repeated ones.
  log_.resize(period);  // may throw bad_alloc: the front end turns the memo off then
  verifying_ = true;
  period_ = period;
  pos_ = 0;
  filled_ = 0;
  match_ = 0;
  tracked_ = 0;
  differed_ = 0;
  mapping_seen_ = mapping_calls;
  stream_ = op.stream;
  votes_ = {};
  ++outcomes_.started;
  return false;
}

bool MemoLearner::track(const MemoOp& op, bool quiet, std::uint64_t mapping_calls) {
  MemoOp& old = log_[pos_];  // the call one period before this one (once the ring is full)
  if (!quiet || mapping_calls != mapping_seen_) {
    ++outcomes_.not_quiet;
    match_ = 0;
  } else if (op.stream != stream_) {
    ++outcomes_.stream;
    match_ = 0;
  } else if (filled_ < period_) {
    ++filled_;
  } else if (old == op) {
    ++match_;
  } else {
    ++outcomes_.differed;
    ++differed_;
    match_ = 0;
  }
  mapping_seen_ = mapping_calls;
  stream_ = op.stream;
  old = op;
  pos_ = pos_ + 1 == period_ ? 0 : pos_ + 1;
  if (match_ >= period_) {  // the last P calls repeated the P before them
    verifying_ = false;
    return true;
  }
  if (++tracked_ > kGiveUp * period_ || differed_ > kGiveUpDiffered * period_) {
    // Back to watching, the period kept one vote short of tracking again: a job still settling
    // (its layout changing) comes back to it at the next sampled call that repeats at it,
    // rather than to a multiple of it.
    ++outcomes_.gave_up;
    verifying_ = false;
    votes_ = {};
    votes_[0] = Vote{period_, kConfident - 1};
  }
  return false;
}

void MemoLearner::period_into(std::vector<MemoOp>& out) const {
  // The ring's oldest call (at pos_) is the one the next call should repeat.
  out.resize(period_);
  for (std::uint64_t i = 0; i < period_; ++i) {
    out[i] = log_[(pos_ + i) % period_];
  }
}

void MemoLearner::restart() noexcept {
  if (verifying_) {
    ++outcomes_.interrupted;
  }
  verifying_ = false;
  votes_ = {};
}

}  // namespace cachealloc
