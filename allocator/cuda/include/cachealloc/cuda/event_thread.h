// event_thread.h: who records and watches the CUDA backends' events: the CACHEALLOC_CONF key
// `event_thread` (no CUDA header: the plugin validates the key on machines without a GPU).
//
// Note [Watching events by default on virtual memory]
// `event_thread:poll` (Note [The record thread watches its events], record_thread.h) is the
// default of backend cuda_vmm, so of policy defrag, since session 51; `off` stays the default of
// cuda_runtime and cuda_async, whose policies were not measured with it. The evidence, the same
// binaries side by side in one call (bench/results/defrag_session51_2026-12-07.md):
//   - offload_train over 100 steps on an H200, 24 runs a side: peak device memory median 14,085
//     (poll) against 13,806 MiB (off), the higher in 305 of 576 pairs of runs (a two-sided rank
//     test by permutation: p 0.73); step time 107.35 against 106.94 ms (p 0.62); the allocator's
//     share of the step 2.82% against 3.42% (p 0.005), its quiet steps 0.91-1.02% against
//     1.65-1.83%, its event calls 138-153 against 952-1,058 us a step;
//   - session 50 on an H100, 8 runs a side: peaks median 14,442 against 13,786 MiB (p 0.2);
//   - comm_overlap: steps 173.7 against 181.3 ms on the H200 (4 runs a side), 166.7 against
//     159.0 on an H100 (10 a side, p 0.28): within their spread both times;
//   - the GPU suite, the LibTorch adapter's tests and memcheck passed under poll (session 50).
// What it costs: a thread per device that records the events and asks each stream's oldest
// recorded one about every 50 us while any is outstanding: 1.8-3.0 ms of another core per 106 ms
// step of offload_train (H100 and H200).
// CACHEALLOC_EVENT_THREAD (0|off, 1|records, poll), when set, overrides the key: the e2e
// benchmark's side-by-side runs set it per configuration.
#pragma once

#include <cachealloc/config.h>

#include <optional>
#include <string_view>

namespace cachealloc {

enum class EventThread : unsigned char {
  off,      ///< the allocating thread records and queries every event
  records,  ///< a thread of the pool's own records them (Note [Event records on a thread of
            ///< their own], record_thread.h)
  poll,     ///< that thread also watches them (Note [The record thread watches its events])
};

/// "off", "records" or "poll" (also "0" and "1" for off and records, as the environment variable
/// takes them); nullopt for anything else.
[[nodiscard]] std::optional<EventThread> parse_event_thread(std::string_view text) noexcept;

/// Takes `event_thread` from `config` (`fallback` when absent), then applies
/// CACHEALLOC_EVENT_THREAD when that is set and not empty. Throws ConfigError for a bad value of
/// either, naming where it came from.
[[nodiscard]] EventThread take_event_thread(Config& config, EventThread fallback);

}  // namespace cachealloc
