// defrag_grow.cpp: policy `defrag` when no mapped hole fits: where the block goes in unmapped
// address space, where its pages come from (new, or moved from free holes), and giving pages
// back (release_cached).
//
// Note [Where new pages come from]
// When no mapped hole of its own stream fits, a block goes to the best-fitting unmapped hole,
// extended by the usable mapped holes on either side (so the partly used pages at the edges of
// holes fill up). The pages it lacks come, in this order, from
//   1. new physical pages, while the policy holds less than the peak of live bytes so far plus
//      grow_slack x the peak of the bytes the program held (Note [Frees in flight and the slack]:
//      live bytes less the frees parked for other streams; measured against peaks, not the
//      current bytes, the slack bounds the peak exactly as well but moves fewer pages in phases
//      below it);
//   2. instead of any page: another stream's safe mapped hole that fits (Note [Stream affinity]);
//   3. the whole free pages of safe mapped holes, oldest hole first (the "age list"), unmapped in
//      one call per hole and mapped under the new block ("stitching");
//      but not from the other kind's range when this range lent it pages below the peak: then
//      new pages beyond the slack (Note [Pages that come back]);
//   4. after waiting for the allocating stream's oldest epochs that free enough of its own recent
//      holes (wait_for_streams; never another stream's), those pages; with move_pending (or once
//      such waits put the moves over their budget: Note [Waits that switch to moving pending]),
//      where the backend unmaps after a stream, those pages at once, their old addresses
//      unmapped when the stream's work is done (Note [Moving pages a stream still uses],
//      background_unmapper.h);
//   5. new physical pages (first, when the free mapped hole on the right holds pages, placed to
//      end with it: Note [A block that ends with the free pages above it]), or nothing (the
//      front end's retry chain takes over).
// Only pages entirely inside a free hole move; a page shared with a live block stays. So
// physical memory grows beyond the slack only while every page held carries live bytes or
// belongs to a hole that cannot move yet, which bounds the peak by about peak live + max(slack x
// peak held, partly used edge pages).
//
// Note [Frees in flight and the slack]
// A block freed while another stream still uses it (record_stream) stays live for the policy
// until the front end hands it back (Note [Cross-stream frees], allocator.h). In a job that
// offloads activations to the host on a copy stream, those frees in flight are most of the
// policy's live bytes at the peak: bench/e2e offload_train held 4.6 GB allocated and 7-8 GB
// parked on the H200, so a slack raised to 0.2 by the time budget granted 2.4 GB beyond a peak
// that was two thirds memory in flight (its H200 runs peaked 9-10% above expandable segments,
// bench/results/defrag_session31_2026-12-05.md). The slack is there for the layout of the blocks
// the program holds, so it is measured against the peak of those (live bytes less the parked
// ones; the front end reports the parked bytes through note_parked), while the peak itself still
// counts them: the policy may hold up to peak live + slack x peak held. A job that parks nothing
// behaves as before. Measured in bench/e2e (peak device MiB, median; allocator share of the step)
// against the earlier base (slack_counts_parked:True): offload_train on an H200 13,224 vs
// 15,263 (expandable segments 14,004; 4 runs each), 18.2% vs 14.0%; on an H100 10,372 vs 11,316
// (expandable 12,654; 3 runs), 12.6% vs 10.6%, and on another H100 10,537 vs 10,904 (expandable
// 12,884; 4 runs; 16 more runs of the new base on three H100 hosts: 15 below every expandable run
// of their call); pipeline, stream_weights, comm_overlap on the H100 within their spread (3,535
// vs 3,531; 7,974 vs 7,974; 13,361 vs 13,406). Replayed over the development set (five lags,
// --stream-lags) the mean moved 1.1968 -> 1.1979, lower on 10 pairs and higher on 7, all of them
// offload_train and stream_weights recordings, whose replays keep the recorded host's pace and
// cannot show how the GPU's pace moves with the layout
// (bench/results/defrag_session32_2026-12-05.md).
//
// Note [Chunks]
// Page by page, growing by 1 GiB cost 512 cuMemCreate and 512 cuMemMap + cuMemSetAccess calls
// (about 35 ms on the H200), and a training job with changing shapes grows for many steps. So a
// growth of n pages creates about kChunksPerGrowth chunks of n / kChunksPerGrowth pages (at
// least one page, at most max_chunk_mb), one physical handle each, and maps them as one run with
// one access call. The page table records the handle at every page, so ranges, edges and holes
// keep their page granularity; but the driver unmaps only whole mappings, so a chunk moves only
// as a whole, when it lies wholly inside a free hole. A chunk that a live block touches stays,
// so the chunk size trades device calls for memory. Measured on the simulated device (peak
// reserved / peak requested; creates):
//   one chunk per growth         gpt2 1.010 (591),  random sizes on 8 streams 1.24, KV caches 1.052
//   kChunksPerGrowth = 8         gpt2 1.010 (1639), KV caches 1.022
//   kChunksPerGrowth = 16        gpt2 1.010 (2620), random 8 streams and KV caches as per page
//   one handle per page          gpt2 1.010 (11569)
// Every device call costs about the same whatever the handle's size, up to a few pages (H200,
// bench/results/gpu_bench_h200_2026-12-03_session7_vmm.md, cachealloc-micro-cuda vmm_*): cuMemCreate
// + cuMemRelease 20 us for 1 page, 25 us for 4, 48 us for 16; cuMemMap + cuMemSetAccess +
// cuMemUnmap 33 us for 1 page, 37 us for 4; but mapping 16 one-page handles as one run costs
// 551 us (34 us per handle). Growths of fewer than 32 pages made one-page chunks, so moving or
// creating them cost ~54 us per page. So chunks have at least kMinChunkPages pages (a smaller
// growth is one chunk). Measured with the e2e recordings (bench/e2e, tools/scripts/
// record_e2e_traces.py) and the shared traces, one-page minimum -> two (peak reserved / peak
// requested; creates + maps):
//   e2e pipeline   1.243 (739 + 1523) -> 1.243 (536 + 926); moves end 8 steps earlier
//   e2e resnet50   1.013 (1203 + 1257) -> 1.014 (765 + 814)
//   e2e gpt2       1.004 (1897 + 2027) -> 1.004 (1092 + 1181)
//   mlp_two_streams 1.010 (894 + 1105) -> 1.010 (675 + 805); gpt2_train_varlen 1.010 (2620 + 3005)
//   -> 1.010 (1813 + 2080); resnet50_train 1.008 -> 1.008 (1228 + 1246 -> 774 + 784)
// A minimum of 4 pages halved the calls again but cost 1.016 on e2e resnet50, 1.010 on e2e gpt2
// and 1.028 on the growing-KV-caches pattern of tests/policies/test_defrag.cpp; 8 pages, 1.21
// on its random sizes on eight streams.
// Session 30's probe (bench/results/defrag_session30_2026-12-05.md) located that per-handle
// cost: it is cuMemSetAccess, not cuMemMap (1 us), and device-to-host copies running meanwhile
// raise it to about 1 ms per handle (the offloading job of bench/e2e). Growths in about 8 or 4
// chunks instead of 16 cut the maps + unmaps of the development set by 30% / 53% but raised its
// mean peak reserved / peak requested 1.1907 -> 1.1987 / 1.2057: kept at 16.
// Session 31 made growths use 4 chunks only while the measured map time exceeded 150 us per
// handle (inert at the replay's costs). On the H100's offload_train it mapped 19.2 handles per
// step instead of 26.1, but each cost 340 us instead of 249: under device-to-host copies the
// access call grows with the handle's pages, so the map time per step stayed (6,531 vs 6,493 us)
// and the change was reverted (bench/results/defrag_session31_2026-12-05.md).
// A moved chunk may be larger than the pages a placement lacks: it is taken only when the
// unmapped hole has room for it, and its extra pages join the fresh mapped hole there (they
// were free and stay free: no memory is added).
//
// Note [Chunks once the slack rose]
// A slack raised by Note [Slack that adapts to moves] is memory the job is allowed to hold beyond
// its peak because moving pages cost it too much time; the job then fills it growth by growth
// as its layout spreads (the e2e pipeline recording: seven growths of 5-128 pages at a slack of
// 0.25, 168 device calls, until it held 1.24x its peak). Chunks sized only by the growth make
// such small growths cost two calls per two pages, though the pages they pin are the very
// memory the raise granted. So once the slack rose by d over grow_slack, a chunk holds at least
// d x peak live bytes / kChunksPerGrowth: the raise's pages come in about as many chunks as one
// growth of them would. A job that never raised its slack keeps its chunks (and its memory);
// one raised to 0.02 (the e2e gpt2 recording) made the same chunks as before.
//
// Note [Pages that come back]
// Small requests have their own address range (small_size), and pages move between the two
// kinds of range like any others. In a training step the small range peaks early, at a low live
// set (the start of the forward pass), and the large range at the step's peak. When the slack
// does not cover both, the small range takes free pages from the large range's holes and the
// large range takes them back at the peak, at every step: two or more growths that move pages,
// and a layout that differs from the step before, so the step memo (allocator.h) cannot serve
// the step. The e2e resnet50 recording (bench/e2e) did this from its second step until the time
// budget (below) raised the slack in its fourth, 4-7 pages each way.
// So a growth below the peak of live bytes does not take pages from the other kind's range when
// that range got them from this one in the last move between kinds, itself below the peak: it
// creates what it lacks and the slack rises by that much (a return raise). The pages stay where
// both kinds need them once per step. A move at a new peak is not counted as lending: moving
// pages there keeps the peak low, and counting it (so that pages lent at a peak were never taken
// back either) raised the GPT-2 trace of ../shared/traces, whose shapes change at every step and
// which reaches new peaks often, from 1.010 to 1.023 of its live peak (replayed), through 43
// raises (bench/results/defrag_time_experiments_2026-12-03_session12.md has the variants). Return
// raises add up to at most grow_slack, so this costs at most as much memory again as the slack
// itself; beyond that the pages move and the time budget decides. Replayed (peak reserved /
// peak requested): e2e resnet50 1.014 -> 1.014 (one raise of 6 pages; its calls repeat one step
// earlier: the step memo served 94,538 of its 107,730 calls instead of 92,114), every other
// recording and shared trace unchanged.
//
// Note [Address ranges of their own for streams]
// PyTorch's expandable segments keep an address range per stream. defrag kept one per kind, so a
// side stream's block that needed pages mapped landed among the main stream's blocks. In the
// two-stream pipeline of bench/e2e the side stream makes the next batch (five blocks of batch x
// 16 KiB, 8-64 MiB) and hands two of them to the main stream with record_stream: they live for
// a step, and their holes, the side stream's and pending for the main stream's work, keep the
// main stream's holes on either side from merging. Replayed without moves (grow_slack:1, the
// 304-step recording, peak reserved / peak requested) defrag held 1.371x its live peak,
// expandable segments 1.238.
// So with stream_ranges (the default) the first kStreamRanges stream classes each place the large
// blocks that need pages mapped in ranges of their own (later classes share the last one's): the
// unmapped holes are indexed by kind and that class (IndexKey::unmapped_bucket), and a new range
// is reserved for a class that has none with room. Nothing else changes: a stream still takes
// the best fit among its own mapped holes wherever they are, another stream's safe hole when the
// slack is short (find_other), and pages move between the ranges like any others (steal() walks
// the age list of every range). Small blocks share one range: they pack many to a page. Eight
// classes: more streams than the jobs measured allocate on (two), while each range reserves
// va_reserve_gb of addresses (twice the device memory by default: eight ranges of an H200 are
// 2.3 TB of the GPU's 128 TB or more of virtual addresses, and no memory).
// Replayed (session 26, bench/results/defrag_session26_2026-12-05.md): the pipeline without moves
// 1.371 -> 1.271, and with the default settings at a slack limit of 0.2 (Note [A time budget for
// moves]) 1.200-1.201 at GPU lags of 0-100 ms against 1.201-1.231 with one range, with fewer
// device calls at every lag (1,139-1,894 maps + unmaps in all against 1,584-2,504). Over the
// development set (23 recordings x 5 lags), against one range at the same limit, every other
// recording replays to the same peak;
// the one cost is mlp_two_streams of ../shared/traces at 5 and 10 ms, 1.013 -> 1.031: its side
// stream's range grows three times at the main stream's peak while every hole of the main
// stream is pending (its work runs 5 ms behind), and creates the 28 pages it lacks beyond the
// slack (8 growths beyond the slack, 60 pages, against 6 and 36 with one range; expandable
// segments: 1.069 there). The main stream's blocks alone still replay above
// expandable segments without moves (1.188 against 1.151): ranges remove the interleaving, not
// best fit's own fragmentation.
//
// Note [Placing away from queued unmaps]
// Pages that moved from a hole its stream's work may still use are unmapped only when that work
// is done (move_pending, Note [Moving pages a stream still uses]); on cuda_vmm every unmap runs
// on the backend's thread a little later. Until then the old range is an unmapped hole like any
// other, and a map into it must wait for the unmap. In a serving job whose host runs far ahead of
// the GPU that wait is long and frequent: the best-fitting unmapped hole for the next large
// block is, most of the time, the range its pages just left (the e2e llm_serve workload on the
// H200 with move_pending: allocations blocked 35 ms per 2.4 s step on maps into such ranges,
// maps 139 us each against 36 without it). The wait counts against the time budget and raises
// the slack, so memory grows: replayed with the simulated GPU 100 ms behind the host, llm_serve
// held 1.082x its live peak with move_pending, 1.132 without, against 1.032 for expandable
// segments.
// With avoid_queued_unmaps, placement asks the backend whether an unmap still waiting for a
// stream's work lies over the pages it would map (VirtualMemory::queued_unmap_end) and passes
// such a hole over for the next fit, up to kQueuedSkips of them. When every fit has one, it
// takes the first of them whose room above its queued unmaps holds the block alone (the pages go
// from the first page above them; the hole's part below stays unmapped: address space, no
// memory), and only when none has such room the first fit, whose map waits as before. A plain
// unmap waiting its turn on cuda_vmm's thread does not count (it runs within a few hundred
// microseconds): the first version of this rule (6eaed44) counted those too, so on the H200 it
// passed best fits over for waits of no consequence, and the simulated device, which has no such
// thread, could not show it. Since session 20 the hint means the same on both backends
// (BackgroundUnmapper::end_behind_stream_work).
// The room above came in session 23: unmapped holes merge, so the pages a growth moved pending
// from the top of the mapped range join the big unmapped hole above it, and a later block that
// fits only there waited for them. Replayed with the GPU 100 ms behind the host, the held-out
// llm_serve recording (recordings_b) had a growth wait 100 ms so, charged as moves: the slack
// rose to 0.12 and it held 1.078x its live peak; placed above them, 1.017 (with unmaps charged
// 3 us, Note [Simulated time] in sim_backend.h; with the former 27 us this wait did not arise
// there). The counter is DefragCounters::placed_above_queued.
// Measured (bench/results/defrag_queued_unmaps_2026-12-04_session19.md):
//   H200, llm_serve (peak device memory, 2 runs): move_pending + this 10,960 / 10,966 MiB,
//   17-39 ms per step in the allocator; expandable segments 11,162 / 11,170; the default
//   11,826 / 11,830 (56-57 ms per step; an earlier call, binaries 8c87318, whose default
//   path this setting leaves as it was)
//   H200, e2e gpt2, first version: 17,656 / 17,718 MiB with move_pending + this, 17,614 /
//   17,600 with this alone, against 17,572 in every earlier run of the default and expandable's
//   17,578-17,580: passing the best fit over spreads a training step's layout
//   H200, this version with move_pending (bench/results/e2e_h200_2026-12-04_s20{a,b}.md, 3 runs
//   each): gpt2 17,572-17,574 (the default 17,572); llm_serve 10,958 / 10,960 / 11,434 (the
//   default 11,626 / 11,142 / 11,032, expandable 11,162 in every run); vit_ckpt 3,420-3,444
//   (default 3,432-3,446, expandable 3,458); but llm_generate 3,692-3,710 (default 3,672-3,678,
//   expandable 3,668) and the pipeline 3,552-3,632 (default 3,556-3,638)
//   replayed, development set at GPU lags 0 / 2 / 100 / 400 ms (bench/validation/devset.py, 88
//   pairs, peak reserved / peak requested): move_pending alone mean 1.0418, 58 pairs at most
//   1.02; with this 1.0386, 60 (llm_serve at 100 ms 1.082 -> 1.025); e2e gpt2 1.004 -> 1.008
//   at 2 ms, above expandable's 1.005
// With move_pending always on, it wins on llm_serve in most runs, but not in every one, and
// loses on llm_generate. Since session 20 it is on by default: it acts only on pages moved
// pending, which the default does only once waits for the stream proved costly (Note [Waits
// that switch to moving pending]), in serving jobs.
//
// Note [A block that ends with the free pages above it]
// A block goes to the bottom of its unmapped hole (extended by the usable mapped hole on the
// left), and the free mapped hole on the right, when it has whole pages, keeps them: they are
// its neighbour's, not movable (steal()). When the growth then still lacks pages after steps 1-4
// of Note [Where new pages come from], it would create them beyond the slack while those pages
// lie free beside it. The held-out llm_serve recording (recordings_b) does this at the peak of
// its largest batches: a 262 MB key/value cache placed at the bottom of a 394 MB unmapped hole
// whose right neighbour held 103 free pages, and 103 pages created (replayed at lag 0 with
// unmaps charged 3 us, 802 pages created beyond the slack over 13 growths while 828 lay beside
// the placements: 1.075x its live peak, expandable segments 1.035).
// So when a growth is about to create pages beyond the slack and its hole's right neighbour is a
// free mapped hole of the allocating stream with whole pages, it places the block to end where
// that neighbour ends, if that maps fewer pages: its pages go at the top of the unmapped hole
// (the gathered ones, and only the missing rest created), the hole's part below stays unmapped.
// Only then: session 22 tried the same placement whenever it needed fewer pages (bench/results/
// defrag_session22_2026-12-04.md, section 8), which moved the serving recordings several percent
// either way; and only the stream's own neighbour: with another stream's safe hole too, the
// random sizes on eight streams of tests/policies/test_defrag.cpp rose from 1.101 to 1.111 of
// their live peak (Note [Stream affinity]). Replayed (session 23, bench/results/
// defrag_session23_2026-12-04.md): that recording 1.075 -> 1.028. The counter is
// DefragCounters::placed_at_top.
//
// Note [Failures while growing]
// Pages are gathered first (created, or unmapped from holes, which leaves consistent unmapped
// holes behind), then mapped as one run, all or nothing. If gathering or mapping fails, the
// gathered pages are released. Either way the ranges, indexes and page table agree and mapped
// bytes equal held bytes.
#include <cachealloc/errors.h>

#include "defrag_engine.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace cachealloc::detail {

// ============================================================================ growth

std::uintptr_t DefragEngine::start_in(const Node* hole, std::uint32_t cls) const noexcept {
  return usable(hole->prev, cls) ? hole->prev->addr : hole->addr;
}

bool DefragEngine::waits_for_unmap(const Node* hole, std::uintptr_t start,
                                   std::size_t size) const noexcept {
  // The pages mapped for a block from `start` are [hole, window_end).
  const std::uintptr_t window_end = std::clamp(page_up(start + size), hole->addr, hole->end());
  return settings_.avoid_queued_unmaps && window_end > hole->addr &&
         vm_.queued_unmap_end(hole->addr, window_end - hole->addr) != 0;
}

std::uintptr_t DefragEngine::above_unmaps(const Node* hole, std::size_t size) const noexcept {
  const std::uintptr_t at = page_up(vm_.queued_unmap_end(hole->addr, hole->size));
  return at > hole->addr && at + size <= hole->end() &&
                 vm_.queued_unmap_end(at, page_up(at + size) - at) == 0
             ? at
             : 0;
}

Node* DefragEngine::largest_unmapped(std::uint32_t kind, std::uint32_t cls) const {
  // The last key of the bucket in the index's (bucket, size, address) order. It is the top of an
  // address range, above its last mapped page: the rest of a range of va_reserve_gb, where the
  // holes that pages left are far smaller.
  const std::uint64_t bucket = IndexKey::unmapped_bucket(kind, home_of(kind, cls));
  auto it = unmapped_.lower_bound(IndexKey{IndexKey::rank_of(bucket + 1, 0), 0, nullptr});
  if (it == unmapped_.begin() || (--it)->bucket() != bucket) {
    return nullptr;
  }
  return it->node;
}

// Note [Growing at the top once moves cost too much at the limit]
// A growth goes to the best-fitting unmapped hole (place_best_fit): usually one that a move just
// emptied among live blocks, whose edge pages it can share. In a job whose shapes change at every
// step that keeps the moves going: the two-stream pipeline of bench/e2e (batch 512-4096 at
// random) moved pages at every step to the end of its 304-step recording at the slack's limit
// (0.2), 166-217 device calls per eighth of the trace in its second half (replayed with
// --stream-lags), and on the H100s 4-6 maps per step, 3.6-9.8% of its step in the allocator,
// while raising the limit to stop the moves would have held more than expandable segments
// (Note [A time budget for moves]). So once a window of moves went over move_budget with the
// slack already at max_grow_slack (the time budget has nothing left to give), growths go to the
// top of their address range instead (place_top: the largest unmapped hole, extended by the
// usable mapped hole below it), until a raise comes back after quiet. Growths then gather above
// the blocks that stay, and the holes below give their free pages to the moves until only
// blocks that stay are left there: the layout settles. Replayed (--stream-lags), the long
// pipeline recording made 0 device calls in its second half against 471 with best fit, at the
// same peak (3,399 MB, 1.200 of its live peak); with maps priced at the H100's 67 us
// (--call-cost map=67) the short recording's last quarter made 14 instead of 128. Over the
// development set (29 recordings x 5 lags) 2 of 145 replays changed (e2e_pipeline at lag 0
// 1.200 -> 1.197, e2e_pipeline_long at 10 ms 1.200 -> 1.201), the mean stayed 1.1979, 124
// below expandable either way; offload_train recorded on the H200 with maps at 243 us (its H100
// cost) placed 130 growths at the top: 13,841 vs 13,877 MB, 1,908 vs 1,849 maps + unmaps
// (bench/results/defrag_session33_2026-12-05.md). top_at_limit:False keeps best fit throughout.
DefragEngine::Placement DefragEngine::place_unmapped(std::uint32_t kind, std::uint32_t cls,
                                                     std::size_t size) const {
  if (top_at_limit()) {  // Note [Growing at the top once moves cost too much at the limit]
    if (const Placement top = place_top(kind, cls, size); top.hole != nullptr) {
      return top;
    }
  }
  return place_best_fit(kind, cls, size);
}

DefragEngine::Placement DefragEngine::place_top(std::uint32_t kind, std::uint32_t cls,
                                                std::size_t size) const {
  Node* hole = largest_unmapped(kind, cls);
  if (hole == nullptr) {
    return {};
  }
  const std::uintptr_t start = start_in(hole, cls);
  if (start + size > hole->end()) {
    return {};
  }
  // Note [Placing away from queued unmaps]: pages that left the range's top pending (their
  // unmap waits for a stream) would make the map wait; the block goes above them instead.
  if (waits_for_unmap(hole, start, size)) {
    const std::uintptr_t at = above_unmaps(hole, size);
    return at != 0 ? Placement{hole, at, true, at, true} : Placement{};
  }
  return Placement{hole, start, false, 0, true};
}

DefragEngine::Placement DefragEngine::place_best_fit(std::uint32_t kind, std::uint32_t cls,
                                                     std::size_t size) const {
  // Usable mapped holes on either side extend an unmapped hole (they are the partly used pages
  // at its edges), so a hole up to two pages smaller than the request may do.
  const std::size_t lowest = size > 2 * page_ ? size - 2 * page_ : 0;
  Placement queued;  // the first fit whose pages would wait for a queued unmap
  Placement above;   // the first such fit with room for the block above its queued unmaps
  int skipped = 0;
  const std::uint64_t bucket = IndexKey::unmapped_bucket(kind, home_of(kind, cls));
  auto it = unmapped_.lower_bound(IndexKey::at_least(bucket, lowest));
  for (int tried = 0; it != unmapped_.end() && it->bucket() == bucket; ++it, ++tried) {
    if (tried == kUnmappedCandidates && it->size() < size) {
      it = unmapped_.lower_bound(IndexKey::at_least(bucket, size));
      if (it == unmapped_.end() || it->bucket() != bucket) {
        break;
      }
    }
    Node* hole = it->node;
    const std::uintptr_t start = start_in(hole, cls);
    const std::uintptr_t limit = usable(hole->next, cls) ? hole->next->end() : hole->end();
    if (start + size <= limit) {
      if (waits_for_unmap(hole, start, size)) {  // Note [Placing away from queued unmaps]
        if (queued.hole == nullptr) {
          queued = Placement{hole, start, true};
        }
        if (above.hole == nullptr) {
          if (const std::uintptr_t at = above_unmaps(hole, size); at != 0) {
            above = Placement{hole, at, true, at};
          }
        }
        if (++skipped < kQueuedSkips) {
          continue;
        }
        break;
      }
      return Placement{hole, start, queued.hole != nullptr};
    }
  }
  return above.hole != nullptr ? above : queued;
}

Node* DefragEngine::grow(std::uint32_t kind, std::uint32_t cls, std::size_t size) {
  Placement where = place_unmapped(kind, cls, size);
  if (where.hole == nullptr) {
    new_arena(kind, size, home_of(kind, cls));  // its one unmapped hole holds the block
    where = place_unmapped(kind, cls, size);
    if (where.hole == nullptr) {
      throw InvariantError("policy defrag: a new address range does not hold the block");
    }
  }
  if (where.passed_queued) {
    ++counters_.placed_past_queued;
  }
  if (where.above != 0) {
    ++counters_.placed_above_queued;
  }
  if (where.top) {
    ++counters_.placed_top_at_limit;
  }
  Node* hole = where.hole;
  std::uintptr_t start = where.start;
  // Pages [lo, window_end) get mapped (more when a moved chunk is larger: Note [Chunks]);
  // beyond the hole the block lies in a mapped hole. lo is the hole's start, or the first page
  // above its queued unmaps.
  const std::uintptr_t lo = where.above != 0 ? where.above : hole->addr;
  const std::uintptr_t window_end = std::clamp(page_up(start + size), lo, hole->end());
  std::size_t count = (window_end - lo) / page_;
  const std::size_t room = (hole->end() - lo) / page_;
  Node* f = nullptr;
  if (count == 0) {
    f = hole->prev;  // the block fits in the usable mapped hole on the left
  } else {
    if (growth_held_) {  // the front end waits for parked frees first (DefragPolicy::hold_growth)
      ++counters_.held_growths;
      return nullptr;
    }
    // Note [Stream affinity]: another stream's safe hole is taken only when the slack does not
    // cover the new pages: it is that stream's cache, and taking it early makes that stream grow.
    if (budget_quiet_ns_ != 0) {
      lower_slack_if_quiet(backend_.clock_ns());
    }
    if (pages_within_slack(size) < count) {
      if (Node* other = find_other(kind, cls, size)) {
        return carve(other, other->addr, size, cls);
      }
    }
    ++counters_.grow_allocations;
    // Note [Coalescing moved chunks while maps are dear]
    coalescing_ = settings_.coalesce_map_ns == 0 ||
                  map_ns_per_handle_ > static_cast<double>(settings_.coalesce_map_ns);
    const std::uint64_t moved_before = counters_.pages_moved;
    const std::uint64_t created_before = counters_.pages_created;
    const std::uint64_t waits_before = counters_.stream_waits;
    const std::uint64_t wait_ns_before = counters_.wait_ns;
    const std::uint64_t started = backend_.clock_ns();
    // Note [A time budget for moves]: a growth to a new peak of live bytes is not churn.
    const bool new_peak = live_bytes_ + size > peak_live_;
    growing_below_peak_ = !new_peak;
    // Note [A block that ends with the free pages above it]: pages beyond the slack wait until
    // the placement is settled.
    const bool may_top = where.above == 0 && usable(hole->next, cls) && hole->next->cls == cls &&
                         whole_pages(hole->next) > 0;
    if (!gather_pages(count, room, size, hole, cls, /*beyond_slack=*/!may_top)) {
      return nullptr;
    }
    bool at_top = false;
    if (may_top && scratch_pages() < count) {
      const Node* right = hole->next;
      const std::uintptr_t lowest = usable(hole->prev, cls) ? hole->prev->addr : hole->addr;
      // (A block that fits in the right neighbour alone is not this case: it maps no page.)
      if (right->end() >= lowest + size && right->end() - size < hole->end()) {
        const std::uintptr_t top_start = right->end() - size;
        const std::uintptr_t top_begin = std::max(page_down(top_start), hole->addr);
        const std::size_t top_count = (hole->end() - top_begin) / page_;
        if (top_count < count &&
            !(settings_.avoid_queued_unmaps &&
              vm_.queued_unmap_end(top_begin, hole->end() - top_begin) != 0)) {
          at_top = true;
          start = top_start;
          count = top_count;
          ++counters_.placed_at_top;
        }
      }
      if (!create_beyond_slack(count, hole, cls)) {
        return nullptr;
      }
    }
    if (coalescing_ && !coalesce_for(hole, lo, at_top, count, start, size)) {
      return nullptr;  // the device cannot hold the pages again (scratch_ released)
    }
    const std::size_t total = scratch_pages();
    Arena& arena = *hole->arena;
    const std::uintptr_t map_at = at_top ? hole->end() - total * page_ : lo;
    const std::size_t first = page_index(arena, map_at);
    Node* below = nullptr;  // the hole's part below map_at, when the pages go above its start
    try {
      if (arena.pages.size() < first + total) {
        arena.pages.resize(first + total, 0);
      }
      if (map_at > hole->addr) {
        below = new_node();
        unmapped_.reserve_total(unmapped_.size() + 1);
      }
    } catch (...) {
      if (below != nullptr) {
        recycle(below);
      }
      release_scratch();
      throw;
    }
    try {
      pieces_.clear();
      for (const Chunk& c : scratch_) {
        pieces_.push_back(MapPiece{c.handle, c.pages * page_});
      }
      // Note [Coalescing moved chunks while maps are dear]: the map's own time, without the
      // wait for unmaps queued in its range (coalescing would not shorten that).
      const std::uint64_t waited_before = vm_.unmap_wait_ns();
      const std::uint64_t map_started = backend_.clock_ns();
      vm_.map_run(map_at, pieces_);  // all or nothing
      const std::uint64_t took = backend_.clock_ns() - map_started;
      const std::uint64_t waited = vm_.unmap_wait_ns() - waited_before;
      note_map_time(took > waited ? took - waited : 0, pieces_.size());
    } catch (...) {
      if (below != nullptr) {
        recycle(below);
      }
      release_scratch();  // nothing got mapped: the hole stays as it was
      throw;
    }
    std::size_t mapped = 0;  // pages
    for (const Chunk& c : scratch_) {
      std::fill_n(arena.pages.begin() + static_cast<std::ptrdiff_t>(first + mapped), c.pages,
                  c.handle);
      mapped += c.pages;
    }
    counters_.pages_mapped += mapped;
    scratch_.clear();
    if (counters_.pages_moved != moved_before || counters_.stream_waits != waits_before) {
      const std::uint64_t now = backend_.clock_ns();
      const std::uint64_t took = now > started ? now - started : 0;
      const std::uint64_t waited = counters_.wait_ns - wait_ns_before;
      const auto waits = static_cast<std::uint32_t>(counters_.stream_waits - waits_before);
      // Note [A history of the time budget]
      note_costly_growth(CostlyGrowth{now, took, waited, waits,
                                      static_cast<std::uint32_t>(counters_.pages_moved - moved_before),
                                      static_cast<std::uint32_t>(counters_.pages_created - created_before),
                                      streams_[cls].id, new_peak, settings_.move_pending || pending_mode_});
      counters_.move_ns += took;  // every costly growth, charged to the budget or not
      if (!new_peak) {
        note_move_time(now, took, waited);
        last_move_ns_ = now;
      } else if (waits != 0 && budget_open_) {
        window_uncharged_waits_ += waits;
        window_uncharged_wait_ns_ += waited;
      }
    }
    f = make_fresh(hole, map_at, map_at + mapped * page_, cls, below);
  }
  if (f->addr > start || f->end() < start + size) {
    throw InvariantError("policy defrag: the mapped hole does not cover its placement");
  }
  return carve(f, start, size, cls);
}

bool DefragEngine::gather_pages(std::size_t count, std::size_t room, std::size_t size,
                                const Node* hole, std::uint32_t cls, bool beyond_slack) {
  scratch_.clear();
  try {
    create_pages(std::min(count, pages_within_slack(size)));
    // Note [Pages that come back]: pages this range lent to the other kind's range stay there.
    const std::uint32_t kind = hole->arena->kind;
    const bool keep_lent = growing_below_peak_ && lent_below_peak_ && lender_ == kind;
    if (scratch_pages() < count) {
      steal(count - scratch_pages(), room, hole, /*other_kinds=*/!keep_lent);
    }
    if (keep_lent && scratch_pages() < count) {
      const std::size_t lacking = count - scratch_pages();
      const double raised = slack_ + static_cast<double>(lacking * page_) /
                                         static_cast<double>(std::max(peak_live_, page_));
      const double kept = returned_slack_ + (raised - slack_);
      if (raised <= settings_.max_grow_slack && kept <= settings_.grow_slack) {
        returned_slack_ = kept;
        raise_slack_to(SlackEvent::Kind::return_raise, raised);
        ++counters_.return_raises;
        create_pages(lacking);
      }
      if (scratch_pages() < count) {  // at the slack's limit, or the device is full: move after all
        steal(count - scratch_pages(), room, hole, /*other_kinds=*/true);
      }
    }
    if (scratch_pages() < count && settings_.wait_for_streams) {
      if ((settings_.move_pending || pending_mode_) && vm_.unmaps_after_streams()) {
        // Note [Moving pages a stream still uses]: the allocating stream's own recent holes,
        // unmapped once its work is done; nobody waits.
        steal(count - scratch_pages(), room, hole, /*other_kinds=*/true, &cls);
      } else {
        // Wait for the allocating stream only (never block on another stream's work), and only
        // for the oldest epochs that free enough pages.
        const std::uint64_t epoch = epoch_for_pages(count - scratch_pages(), hole, cls);
        if (epoch != 0) {
          wait_until(cls, epoch);
          steal(count - scratch_pages(), room, hole, /*other_kinds=*/true);
        }
      }
    }
  } catch (...) {
    release_scratch();
    throw;
  }
  return !beyond_slack || create_beyond_slack(count, hole, cls);
}

bool DefragEngine::create_beyond_slack(std::size_t count, const Node* hole, std::uint32_t cls) {
  if (scratch_pages() < count) {
    note_beyond_slack(count - scratch_pages(), hole, cls);
    try {
      create_pages(count - scratch_pages());
    } catch (...) {
      release_scratch();
      throw;
    }
  }
  if (scratch_pages() < count) {
    release_scratch();
    return false;
  }
  return true;
}

// Note [Why pages were created beyond the slack]
// When a growth ends up creating pages beyond the slack (step 5 of Note [Where new pages come
// from]), memory grows although free pages may be held elsewhere. To tell why, the policy counts
// the whole free pages of every mapped hole at that moment (O(holes); such growths are rare), by
// the first reason that applies: the hole is the placement's own neighbour (part of the
// placement, never moved: Note [Chunks] and steal()), a stream's queued work may still use it,
// its chunk goes on under a live block or a partly used page (a chunk moves only whole), or none
// of these (then the placement's room, or Note [Pages that come back], kept it). Summed over the
// growths in DefragCounters::stuck_*_pages; cachealloc-replay prints them. Measured this way
// (session 18, bench/results/defrag_floor_2026-12-04_session18.md): on held-out serving
// recordings the free pages beside the placement, and on checkpointed training the partly used
// edge pages of many holes, are what holds memory beyond the slack. The pages not yet safe are
// also counted apart when their hole belongs to another stream than the growth's
// (stuck_unsafe_other_pages): the growth's own stream could take its own with move_pending, but
// another stream's only once that stream's work is done (or if the growth's stream waited for it
// on the GPU).
void DefragEngine::note_beyond_slack(std::size_t pages, const Node* hole, std::uint32_t cls) noexcept {
  ++counters_.beyond_slack_growths;
  counters_.beyond_slack_pages += pages;
  const std::size_t recorded = history_.size();
  note_slack_event(SlackEvent::Kind::beyond_slack, slack_, slack_, pages);
  const std::uint64_t unsafe_before = counters_.stuck_unsafe_pages;
  const std::uint64_t other_before = counters_.stuck_unsafe_other_pages;
  for (const auto& a : arenas_) {
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      const std::size_t whole = n->state == State::mapped_free ? whole_pages(n) : 0;
      if (whole == 0) {
        continue;
      }
      if (n == hole->prev || n == hole->next) {
        counters_.stuck_beside_pages += whole;
        continue;
      }
      if (!safe(n)) {
        counters_.stuck_unsafe_pages += whole;
        if (n->cls != cls) {  // another stream's: only its own work finishing frees them
          counters_.stuck_unsafe_other_pages += whole;
        }
        continue;
      }
      // Only the lowest and the highest chunk of the whole pages can go on beyond them.
      const std::vector<PhysicalHandle>& pg = a->pages;
      const std::size_t first = page_index(*a, page_up(n->addr));
      const std::size_t end = first + whole;
      std::size_t low = 0;
      if (first > 0 && pg[first - 1] == pg[first]) {
        while (first + low < end && pg[first + low] == pg[first]) {
          ++low;
        }
      }
      std::size_t high = 0;
      if (end < pg.size() && pg[end] == pg[end - 1]) {
        while (end - high > first + low && pg[end - 1 - high] == pg[end - 1]) {
          ++high;
        }
      }
      counters_.stuck_pinned_pages += low + high;
      counters_.stuck_other_pages += whole - low - high;
    }
  }
  if (history_.size() > recorded) {  // this growth's own figures in its history entry
    SlackEvent& h = history_.back();
    h.stream = streams_[cls].id;
    h.unsafe_pages = counters_.stuck_unsafe_pages - unsafe_before;
    h.unsafe_other_pages = counters_.stuck_unsafe_other_pages - other_before;
  }
}

std::size_t DefragEngine::scratch_pages() const noexcept {
  std::size_t pages = 0;
  for (const Chunk& c : scratch_) {
    pages += c.pages;
  }
  return pages;
}

std::size_t DefragEngine::pages_within_slack(std::size_t size) const noexcept {
  // Note [Where new pages come from]: the slack is measured against peaks so far, which bounds
  // the peak reserved exactly as well and moves fewer pages below the peak.
  const std::size_t peak = std::max(peak_live_, live_bytes_ + size);
  std::size_t base = peak;
  if (!settings_.slack_counts_parked) {  // Note [Frees in flight and the slack]
    base = std::max(peak_held_, held_bytes() + size);
  }
  const double allowed = static_cast<double>(peak) + slack_ * static_cast<double>(base) -
                         static_cast<double>(reserved_bytes());
  return allowed > 0 ? static_cast<std::size_t>(allowed / static_cast<double>(page_)) : 0;
}

void DefragEngine::create_pages(std::size_t count) {
  // Fail fast when the device (or the memory-fraction limit) cannot hold that many pages: a
  // request larger than the device would otherwise cost device calls before failing, and a
  // page list sized for it could itself exhaust host memory (found by the replay fuzzer).
  const std::size_t limit = backend_.usable_memory();
  const std::size_t room = std::min(backend_.free_memory(),
                                    limit > backend_.held_bytes() ? limit - backend_.held_bytes() : 0);
  if (count == 0 || count > room / page_) {
    return;
  }
  // Note [Chunks]: about kChunksPerGrowth chunks, so that a chunk a live block pins holds at
  // most a small part of the growth that created it. Once the slack rose (Note [Chunks once the
  // slack rose]), chunks hold at least a kChunksPerGrowth-th of what it rose by.
  std::size_t least = kMinChunkPages;
  if (slack_ > settings_.grow_slack) {
    const double raised = (slack_ - settings_.grow_slack) * static_cast<double>(peak_live_);
    least = std::max(least,
                     static_cast<std::size_t>(raised / static_cast<double>(page_)) / kChunksPerGrowth);
  }
  std::size_t chunk = std::clamp<std::size_t>(
      count / kChunksPerGrowth, std::min({least, count, max_chunk_pages_}), max_chunk_pages_);
  if (coalescing_) {  // Note [Coalescing moved chunks while maps are dear]: every handle costs
    chunk = std::min(count, max_chunk_pages_);
  }
  scratch_.reserve(scratch_.size() + (count + chunk - 1) / chunk);
  while (count > 0) {
    std::size_t pages = std::min(count, chunk);
    const PhysicalHandle h = create_chunk(pages);
    if (h == 0) {
      return;
    }
    scratch_.push_back(Chunk{h, pages, /*loose=*/true});
    count -= pages;
  }
}

PhysicalHandle DefragEngine::create_chunk(std::size_t& pages) {
  PhysicalHandle h = vm_.create_physical(pages * page_);
  // The device may have the memory but not in pieces of that size: halve, down to a page.
  while (h == 0 && pages > 1) {
    pages /= 2;
    h = vm_.create_physical(pages * page_);
  }
  if (h != 0) {
    held_pages_ += pages;
    ++held_chunks_;
    counters_.pages_created += pages;
    ++counters_.chunks_created;
  }
  return h;
}

// Note [Coalescing moved chunks while maps are dear]
// A map costs the allocating thread one cuMemSetAccess per handle mapped, whatever the handle's
// size: on an idle H100 23-47 us, but about 1 ms per handle while device-to-host copies run
// (bench/micro/vmm_probe.cpp, Note [Maps while copy engines run]), as they do all through an
// offloading job's forward pass. A growth that moves pages maps one handle per chunk it moved,
// so bench/e2e offload_train mapped 46.6 handles per step on an H100 at 200 us each, 9.3 ms of
// its 111 ms step (bench/results/e2e_h100_2026-12-06_s36a.md). Session 36's probe answered the
// rest on an H100 (bench/results/vmm_probe_h100_2026-12-06_s36.txt): under the same copies
// cuMemCreate costs 14-17 us, cuMemRelease 18-49 us and cuMemUnmap 23-34 us per handle, and
// the access calls do not hold back the copies themselves (3 GiB in 59.6 ms alone, 59.8 ms
// while a thread mapped a page over and over).
// So while maps are dear a growth coalesces: the chunks it takes from safe holes are unmapped on
// the allocating thread (unmap_now, not queued for the backend's unmap thread), every chunk it
// gathered that is now mapped nowhere (those, and the ones it created) is released, and the
// pages the growth needs are created again as at most three handles (each at most max_chunk_mb),
// which it maps: a few access calls instead of one per chunk, for about 60 us of unmap and
// release per chunk. The three: the pages below those wholly under the block, those, and the
// pages above, so that the block's own pages move as one chunk once it is freed whatever its
// neighbours do (one handle for the whole growth was pinned by them: replayed at 1 ms a map, the
// offload_train recording of session 35 held 16.57 GB that way, 15.90 split, 15.51 without
// coalescing, with 199 / 246 / 1,411 maps). Surplus pages of oversized moved chunks go back. The unmap comes before the release and the release before the create, so the device
// never holds both (a chunk still mapped elsewhere, behind a stream's work, keeps its memory
// until that unmap runs: rare, as such chunks are taken only once the stream finished that
// work). Chunks moved pending (Note [Moving pages a stream still uses]) stay as they are: their
// memory is still in use. New pages then also come as one chunk, not kChunksPerGrowth: the
// chunk size no longer buys cheap moves when every handle mapped costs a millisecond.
// "Dear" is the moving average (weight 1/4 for the newest) of the map time per handle over the
// growths so far (the map's own time: a wait for unmaps queued in its range, VirtualMemory::
// unmap_wait_ns, is not per handle and coalescing would not shorten it), against
// coalesce_map_us (default 200 us: idle maps stay well below, maps under copies far above;
// coalescing costs more than it saves below about 2 x 60 us). On an H100 (bench/results/
// defrag_session36_2026-12-06.md) offload_train then mapped 25 handles per step instead of 38
// (8.5% of its step in the allocator against 9.5%); coalescing always (coalesce_map_us:0) mapped
// 7.5 but waited longer for the copy stream, and held the e2e pipeline above expandable segments
// (3,654 MiB against 3,520 by default), so it is not the default. The simulated
// device charges every map the same (55 us by default), so replays do not coalesce unless a
// --call-cost map= above the setting (or coalesce_map_us:0) asks for it. What it costs: a
// coalesced handle moves only as a whole, so later growths find fewer chunks wholly inside free
// holes, as with larger chunks (Note [Chunks]).
bool DefragEngine::coalesce_for(const Node* hole, std::uintptr_t lo, bool at_top, std::size_t count,
                                std::uintptr_t start, std::size_t size) {
  // The run maps the chunks that stay (moved pending) first, then the new ones; the new pages
  // split where the block's partly covered edge pages begin, so that the pages wholly under the
  // block make a chunk that moves once the block is freed, whatever its neighbours do.
  std::size_t fixed = 0;
  for (const Chunk& c : scratch_) {
    fixed += c.loose ? 0 : c.pages;
  }
  const std::size_t total = std::max(count, fixed);
  const std::uintptr_t run = at_top ? hole->end() - total * page_ : lo;
  const std::uintptr_t fresh = run + fixed * page_;
  const std::uintptr_t fresh_end = run + total * page_;
  const std::uintptr_t inner_lo = std::clamp(page_up(start), fresh, fresh_end);
  const std::uintptr_t inner_hi = std::clamp(page_down(start + size), inner_lo, fresh_end);
  const std::size_t parts[] = {(inner_lo - fresh) / page_, (inner_hi - inner_lo) / page_,
                               (fresh_end - inner_hi) / page_};
  try {
    return coalesce_scratch(parts);
  } catch (...) {
    release_scratch();
    throw;
  }
}

bool DefragEngine::coalesce_scratch(std::span<const std::size_t> parts) {
  std::size_t loose_chunks = 0;
  for (const Chunk& c : scratch_) {
    loose_chunks += c.loose ? 1 : 0;
  }
  std::size_t needed = 0;
  for (const std::size_t p : parts) {
    needed += (p + max_chunk_pages_ - 1) / max_chunk_pages_;
  }
  if (needed >= loose_chunks) {
    return true;
  }
  std::size_t kept = 0;
  for (const Chunk& c : scratch_) {
    if (c.loose) {
      release_chunk(c, /*unmapped=*/true);
      ++counters_.chunks_coalesced;
    } else {
      scratch_[kept++] = c;
    }
  }
  scratch_.resize(kept);
  ++counters_.coalesced_growths;
  for (const std::size_t part : parts) {
    for (std::size_t left = part; left > 0;) {
      std::size_t pages = std::min(left, max_chunk_pages_);
      const PhysicalHandle h = create_chunk(pages);
      if (h == 0) {
        release_scratch();
        return false;
      }
      const Chunk made{h, pages, /*loose=*/true};
      try {
        scratch_.push_back(made);
      } catch (...) {
        release_chunk(made, /*unmapped=*/false);
        throw;
      }
      left -= pages;
    }
  }
  return true;
}

void DefragEngine::note_map_time(std::uint64_t ns, std::size_t handles) noexcept {
  if (handles == 0) {
    return;
  }
  const double per = static_cast<double>(ns) / static_cast<double>(handles);
  map_ns_per_handle_ = map_ns_per_handle_ == 0.0 ? per : map_ns_per_handle_ + (per - map_ns_per_handle_) / 4;
}

void DefragEngine::release_scratch() noexcept {
  for (const Chunk& c : scratch_) {
    release_chunk(c, /*unmapped=*/false);
  }
  scratch_.clear();
}

void DefragEngine::release_chunk(const Chunk& c, bool unmapped) noexcept {
  if (unmapped) {
    vm_.release_unmapped(c.handle, c.pages * page_);
  } else {
    vm_.release_physical(c.handle, c.pages * page_);
  }
  held_pages_ -= c.pages;
  --held_chunks_;
  counters_.pages_released += c.pages;
}

std::uint64_t DefragEngine::epoch_for_pages(std::size_t count, const Node* hole,
                                            std::uint32_t cls) const {
  std::vector<std::pair<std::uint64_t, std::size_t>> pending;  // (stamp, whole pages)
  for (const Node* n = age_head_; n != nullptr; n = n->age_next) {
    if (n != hole->prev && n != hole->next && n->cls == cls && !safe(n)) {
      pending.emplace_back(n->stamp, whole_pages(n));
    }
  }
  if (pending.empty()) {
    return 0;
  }
  std::sort(pending.begin(), pending.end());
  std::size_t pages = 0;
  for (const auto& [stamp, whole] : pending) {
    pages += whole;
    if (pages >= count) {
      return stamp;
    }
  }
  return pending.back().first;  // not enough: take all there is, create the rest
}

std::size_t DefragEngine::steal(std::size_t want, std::size_t room, const Node* hole,
                                bool other_kinds, const std::uint32_t* pending_of) {
  // The hole's own neighbours stay: they are part of the placement (and moving their pages
  // would merge the hole away). With `pending_of`, only that stream class's own holes that are
  // not safe yet: a block for that stream may reuse memory its queued work still touches (the
  // stream runs the new work after the old); another stream may not.
  const StreamId after = pending_of != nullptr ? streams_[*pending_of].id : 0;
  std::size_t taken = 0;
  const std::size_t have = scratch_pages();
  for (Node* n = age_head_; n != nullptr && taken < want;) {
    Node* next = n->age_next;  // take_pages never recycles another age-list node
    const bool other_kind = n->arena->kind != hole->arena->kind;
    const bool movable = pending_of != nullptr ? n->cls == *pending_of && !safe(n)
                                               : safe(n) && (other_kinds || !other_kind);
    if (n != hole->prev && n != hole->next && movable) {
      const std::size_t k =
          take_pages(n, want - taken, room - have - taken, pending_of != nullptr ? &after : nullptr);
      if (k > 0 && other_kind) {
        lender_ = n->arena->kind;  // Note [Pages that come back]
        lent_below_peak_ = growing_below_peak_;
      }
      taken += k;
      counters_.pages_moved += k;
      if (pending_of != nullptr) {
        counters_.pages_moved_pending += k;
      }
    }
    n = next;
  }
  if (taken > 0) {
    note_move();
  }
  return taken;
}

// Note [Slack that adapts to moves]
// Moving pages costs device calls (cuMemUnmap, cuMemMap and cuMemSetAccess: about 80 us on the
// H200 against 0.2 us for an allocation from a mapped hole). A job that repeats its pattern
// stops moving once its layout settles, but one whose live set keeps changing shape (random
// batch sizes, a convolution's workspace that differs from layer to layer) can move pages at
// nearly every step, forever: on the H200 that cost 12-49% of the step time (resnet50 and the
// two-stream pipeline of bench/e2e, grow_slack 0.01). So the policy watches the rate: every
// kMoveWindow growths that moved pages make a window, dense when it spanned fewer than
// kMoveWindow x kAllocationsPerMove allocations; after kDenseWindows dense windows in a row the
// slack doubles (from at least 0.005), up to max_grow_slack. Memory then holds up to that much
// beyond the peak of live bytes, and only in jobs that kept moving. Moves also come in bursts
// while a job reaches a new peak (the first steps; a longer sequence): two dense windows, then a
// sparse one, which leave the slack where it is.
void DefragEngine::note_move() noexcept {
  if (++window_moves_ < kMoveWindow) {
    return;
  }
  dense_windows_ = window_allocations_ < kMoveWindow * kAllocationsPerMove ? dense_windows_ + 1 : 0;
  if (dense_windows_ >= kDenseWindows && slack_ < settings_.max_grow_slack) {
    raise_slack(SlackEvent::Kind::count_raise);
    dense_windows_ = 0;
  }
  window_moves_ = 0;
  window_allocations_ = 0;
}

void DefragEngine::raise_slack(SlackEvent::Kind why, double factor) noexcept {
  raise_slack_to(why, std::min(std::max(factor * slack_, 0.005), settings_.max_grow_slack));
}

void DefragEngine::raise_slack_to(SlackEvent::Kind why, double slack) noexcept {
  note_slack_event(why, slack_, slack);
  slack_ = slack;
  ++counters_.slack_raises;
  counters_.slack = slack_;
}

// Note [A history of the slack]
// What a job holds beyond its live peak is decided at a few moments: when the slack rose (and
// on what evidence), when a raise came back, when waits switched the policy to moving pending,
// and when a growth created pages beyond the slack because the free pages could not move yet.
// The counters say how often; the order and the figures at each moment (time, slack before and
// after, live bytes, their peak, reserved bytes) say why. Sessions 25 and 27 each rebuilt the
// policy with prints to see them (vit_ckpt replayed at 1.142x its live peak because a raise
// granted at a live peak of 2,150 MiB held while the peak rose to 2,796 MiB). So the policy
// keeps them: the first kSlackHistoryLength events (a job's decisive moments come early; later
// ones are only counted), 32 KiB at most, appended on these rare paths only.
// cachealloc-replay --explain prints them.
namespace {
/// Appends `entry` to a diagnostic history that keeps its first `length` entries; later ones,
/// and any the host has no memory for, are only counted (the allocation goes on either way).
template <class T>
void keep_first(std::vector<T>& history, std::uint64_t& dropped, std::size_t length, const T& entry) noexcept {
  if (history.size() >= length) {
    ++dropped;
    return;
  }
  try {
    history.push_back(entry);
  } catch (...) {  // out of host memory
    ++dropped;
  }
}
}  // namespace

void DefragEngine::note_slack_event(SlackEvent::Kind kind, double before, double after,
                                    std::uint64_t pages) noexcept {
  keep_first(history_, history_dropped_, kSlackHistoryLength,
             SlackEvent{kind, backend_.clock_ns(), before, after, live_bytes_, peak_live_, reserved_bytes(),
                        pages, parked_bytes_});
}

// Note [A history of the time budget]
// The slack's history (above) says when the budget raised the slack or switched the policy to
// moving pending, not what the budget saw before: how many growths a window held, how long it
// stayed open, how much of its time was waiting, what the bank paid, and the waits of growths
// at a new peak that no window charges. Session 44 rebuilt the policy with prints to find out
// why offload_train waited 16 times in one step before switching (a window judges waits at the
// stretched pace of its moves and stayed open for its full second). So the policy keeps them:
// every growth that moved pages or waited (CostlyGrowth, the first kGrowthHistoryLength), and
// every window it judged, with why it closed and its verdict (BudgetWindow, the first
// kWindowHistoryLength). Appended on growths that already made device calls, so the cost is
// nothing beside them. cachealloc-replay --explain prints them, policy_report() returns them,
// and bench/e2e/run_e2e.py places them in the job's steps.
void DefragEngine::note_costly_growth(const CostlyGrowth& g) noexcept {
  keep_first(growths_, growths_dropped_, kGrowthHistoryLength, g);
}

void DefragEngine::note_window(BudgetWindow::Close close, BudgetWindow::Verdict verdict,
                               std::uint64_t close_ns, double allowed) noexcept {
  BudgetWindow w;
  w.open_ns = budget_start_ns_;
  w.close_ns = close_ns;
  w.growths = static_cast<std::uint32_t>(budget_moves_);
  w.charged_ns = budget_raw_ns_;
  w.waited_ns = budget_wait_ns_;
  w.spent_ns = budget_spent_ns_;
  w.allowed_ns = static_cast<std::uint64_t>(allowed);
  w.uncharged_waits = window_uncharged_waits_;
  w.uncharged_wait_ns = window_uncharged_wait_ns_;
  w.slack_after = slack_;
  w.close = close;
  w.verdict = verdict;
  keep_first(windows_, windows_dropped_, kWindowHistoryLength, w);
}

// Note [A time budget for moves]
// Counting moves per allocation (above) misses jobs whose steps are long or whose moves are
// few but large. On the H200 (bench/e2e, grow_slack 0.01) the two-stream pipeline moved about
// 250 MB per 14 ms step: 41% of the step inside the allocator, though its 8 moving growths per
// window spanned enough allocations to count as sparse. What the user pays is time, so the
// policy also measures it: the time of every growth that moved pages or waited for a stream,
// on the backend's clock (steady_clock on a GPU; in replays the trace's own times plus the
// modelled cost of each device call: Note [Simulated time], sim_backend.h), against the time
// since the first such growth of the window. Growths to a new peak of live bytes are not
// charged: moving pages there is what keeps the peak low, and a job reaches its peak only so
// often. Moves come in bursts (a few per step), so a window closes only after kMoveWindow moving
// growths and kBudgetMinWindowNs, or after kBudgetMaxWindowNs; if the moves took more than
// move_budget of it, the slack doubles (as above, up to max_grow_slack). A job that settles
// stops moving and never pays. One whose layout keeps changing trades memory for time, up to
// max_grow_slack. That limit was 0.25 until session 26, because the pipeline above, replayed
// from its recording (batch 512-4096 at random), stops moving only at a slack of 0.16-0.25, and
// expandable segments held about 1.24x its live peak on the H200. But over 304 steps
// (bench/e2e/recordings/e2e_pipeline_long.pickle.xz, session 21) that job still moved pages at
// 0.20 and ended at 0.25 holding 1.250-1.266x, above expandable's 1.238, and on the H200 its
// runs that filled the limit peaked above expandable segments (sessions 21-25: in 2 of 11, 3 of
// 10, 7 of 12 runs below; bench/results/defrag_session25_2026-12-05.md). A limit only buys time
// below expandable segments' memory when it is below what they hold, so it is 0.2: with Note
// [Address ranges of their own for streams] the long recording then holds 1.200-1.201x at GPU
// lags of 0-100 ms (0.25: 1.244-1.278 without those ranges, 1.231-1.257 with them), for device
// calls in its steps 9-64 (bench/e2e's measured steps) of 104-484 against 113-680 before
// (bench/results/defrag_session26_2026-12-05.md). The budget is 0.02: replayed (peak
// reserved / peak requested), the two-stream MLP of the shared traces, whose moves cost 1-2% of
// its time, ends at 1.020 with a budget of 0.01 and 1.010 with 0.02 (a rising slack changes its
// layout without stopping its moves), and the GPT-2 trace at 1.020 with 0.005, 1.010 with 0.01.
// Note [How fast the slack rises]
// Doubling once per window, the two-stream pipeline of bench/e2e (moves took about 30% of its
// time at the start) needed 5 windows to reach the slack at which it stops moving; replayed from
// its recording it moved pages until about step 28, while bench/e2e measures steps 5 to 24 of a
// fresh process. Growing the slack by a quarter of how far the window was over its budget
// gets there in one or two windows (replayed: moves end by about step 12, 56 ms moving instead
// of 107), and ends at the same slack for a job that keeps moving; one that was up to 8x over
// still doubles. A factor of f itself (not f / 4) raised the slack too far for jobs only a
// little over: the GPT-2 trace replayed with a GPU that lags 5 ms, 2.5x over, then held 1.025x
// its live peak instead of 1.020; and with f / 2, resnet50 in bench/e2e peaked at 3,330 MiB, as
// expandable_segments did, where doubling had given 3,324 (whether the factor caused those
// 6 MiB was not established).
// Note [New peaks of frees in flight]
// Growths to a new peak of live bytes are not charged, on the premise that a job reaches its
// peak only so often. A job whose memory in flight keeps rising breaks it: offload_train's frees
// parked for the copy stream grow step after step while the host runs ahead, so nearly every
// growth is a new peak and its moves go on uncharged (session 32's e2e: 5.0-9.3 ms of its
// 11.7-15.8 ms per step in the allocator). Session 34 tried sparing only new peaks of the bytes
// the program holds (live less parked; setting charge_parked_peaks): replayed, 858 -> 505 moved
// chunks, but on an H100 (bench/e2e, 30 measured steps, 2 runs each,
// bench/results/e2e_h100_2026-12-06_s35a.md) it changed nothing that counts: 9.8 vs 9.6 moved
// chunks per step, 6.76% vs 6.56% of the step in the allocator, peak 15,899 vs 15,822 MiB. It was
// removed (session 35). The same runs timed expandable segments exactly (+timed): 6.09% of the
// step, so on this job defrag's moves cost about what expandable segments' growth does.
//
// Note [Judging a window before it is full]
// A window of kMoveWindow moving growths lasts longest for the jobs whose growths each move the
// most: the two-stream pipeline of bench/e2e (replayed from its recording) moved 60-130 pages
// per growth at about one such growth per step, 15-25x over its budget, and its second window
// needed 60 ms, in which three more growths moved 62-109 pages each at a slack of 0.076
// (30-48 device calls each) before the slack rose to 0.25. A window of n
// moves (n >= 2) spanning at least kBudgetMinWindowNs therefore closes early when its moves
// would still be over the budget if the window were stretched to kMoveWindow moves at its own
// pace (n - 1 gaps -> kMoveWindow - 1) and the missing moves cost nothing: the full window could
// then come out under the budget only if the job's moves became sparser than they have been.
// A single burst (n = 1) is never judged, and two moves close together count as one gap out of
// seven: the slow host of the time-budget test in tests/policies/test_defrag.cpp (moves a few
// calls apart, once per step) still never raises the slack, as it must not.
void DefragEngine::note_move_time(std::uint64_t now_ns, std::uint64_t spent_ns,
                                  std::uint64_t waited_ns) noexcept {
  const std::uint64_t charged_ns = spent_ns;  // before the bank pays part of it
  if (settings_.move_budget >= 1.0) {
    return;
  }
  // Note [Quiet time pays for a burst]: the budget earned in quiet that no window saw since the
  // last move, banked up to kBudgetBankNs of quiet, pays for this move first.
  const std::uint64_t begun = now_ns - std::min(spent_ns, now_ns);
  if (last_move_ns_ != 0 && begun > last_move_ns_ + kBudgetMaxWindowNs) {
    const std::uint64_t unseen = begun - last_move_ns_ - kBudgetMaxWindowNs;
    bank_ns_ = std::min(bank_ns_ + settings_.move_budget * static_cast<double>(unseen),
                        settings_.move_budget * static_cast<double>(kBudgetBankNs));
  }
  const double paid = std::min(bank_ns_, static_cast<double>(spent_ns));
  bank_ns_ -= paid;
  spent_ns -= static_cast<std::uint64_t>(paid);
  if (!budget_open_) {
    budget_open_ = true;
    budget_start_ns_ = begun;
    budget_spent_ns_ = 0;
    budget_moves_ = 0;
    budget_wait_ns_ = 0;
    budget_raw_ns_ = 0;
    window_uncharged_waits_ = 0;
    window_uncharged_wait_ns_ = 0;
  }
  budget_raw_ns_ += charged_ns;
  budget_wait_ns_ += std::min(waited_ns, charged_ns);
  budget_spent_ns_ += spent_ns;
  ++budget_moves_;
  const std::uint64_t elapsed = now_ns - budget_start_ns_;
  // Note [Judging a window before it is full]: a window of fewer moves closes once its verdict
  // holds even if the moves still missing from it cost nothing and came at its own pace.
  bool over_anyway = false;
  if (budget_moves_ > 1 && budget_moves_ < kMoveWindow && elapsed >= kBudgetMinWindowNs) {
    const double stretched = static_cast<double>(elapsed) * static_cast<double>(kMoveWindow - 1) /
                             static_cast<double>(budget_moves_ - 1);
    over_anyway = static_cast<double>(budget_spent_ns_) > settings_.move_budget * stretched;
  }
  if (!over_anyway && elapsed < kBudgetMaxWindowNs &&
      (budget_moves_ < kMoveWindow || elapsed < kBudgetMinWindowNs)) {
    return;  // moves come in bursts: judge them over several, and over a while
  }
  const double allowed = settings_.move_budget * static_cast<double>(elapsed);
  const bool over_budget = static_cast<double>(budget_spent_ns_) > allowed;
  const BudgetWindow::Close close = over_anyway ? BudgetWindow::Close::early
                                    : elapsed >= kBudgetMinWindowNs && budget_moves_ >= kMoveWindow
                                        ? BudgetWindow::Close::full
                                        : BudgetWindow::Close::aged;
  BudgetWindow::Verdict verdict = over_budget ? BudgetWindow::Verdict::over : BudgetWindow::Verdict::within;
  if (over_budget && !pending_mode_ && settings_.pending_on_waits && settings_.wait_for_streams &&
      vm_.unmaps_after_streams() &&
      10 * budget_wait_ns_ > kPendingWaitTenths * budget_raw_ns_) {
    // Note [Waits that switch to moving pending]: over the budget much of it by waiting for
    // the stream: stop waiting rather than hold more memory.
    pending_mode_ = true;
    counters_.pending_switches = 1;
    note_slack_event(SlackEvent::Kind::pending_switch, slack_, slack_);
    verdict = BudgetWindow::Verdict::switched;
  } else if (over_budget && slack_ < settings_.max_grow_slack) {
    verdict = BudgetWindow::Verdict::raised;
    // Over the budget by a factor f: the slack grows by f / 4 (2 to 16), not by 2 whatever f
    // was. A job far over it reaches the slack that stops its moves within a window or two
    // instead of one doubling per window (Note [How fast the slack rises]).
    const double over = static_cast<double>(budget_spent_ns_) / std::max(allowed, 1.0);
    // Note [A raise that comes back]: the slack before the first raise on time of a run, and
    // at least the quiet after which these moves would have been within the budget.
    if (budget_quiet_ns_ == 0) {
      slack_before_budget_ = slack_;
    }
    raise_slack(SlackEvent::Kind::time_raise, std::clamp(over / 4, 2.0, 16.0));
    ++counters_.budget_raises;
    // (move_budget:0 allows no moves at all: such a raise never comes back.)
    const double quiet = settings_.move_budget > 0
                             ? static_cast<double>(budget_spent_ns_) / settings_.move_budget
                             : std::numeric_limits<double>::infinity();
    const std::uint64_t quiet_ns =
        quiet < 1e18 ? static_cast<std::uint64_t>(quiet) : std::numeric_limits<std::uint64_t>::max();
    budget_quiet_ns_ = std::max({budget_quiet_ns_, kBudgetMaxWindowNs, quiet_ns});
  } else if (over_budget && !over_at_limit_) {
    // Note [Growing at the top once moves cost too much at the limit]
    over_at_limit_ = true;
    note_slack_event(SlackEvent::Kind::top_at_limit, slack_, slack_);
    verdict = BudgetWindow::Verdict::top_at_limit;
  }
  note_window(close, verdict, now_ns, allowed);
  budget_open_ = false;
}

// Note [Waits that switch to moving pending]
// A window over the move budget raises the slack (above). When much of its time went to
// waiting for the allocating stream (wait_for_streams: the pages that stream freed recently move
// only once its work is done), a raise is the wrong answer: the host is far ahead of the GPU, as
// in serving, and every later wait costs as long; the slack grows to pay for waits, not moves.
// Moving those pages at once and unmapping their old range after the stream's work (Note
// [Moving pages a stream still uses]) costs no wait at all. So with pending_on_waits (the
// default), where the backend can unmap after a stream (cuda_vmm with background_unmap, the
// simulated device), the first window over the budget in which waits took more than
// kPendingWaitTenths tenths of the charged time switches the policy to move_pending for the rest
// of its life, instead of raising the slack; a later window over the budget (moves alone) raises
// it as before. Jobs whose waits are short never switch.
// Measured per wait on the H200 (bench/e2e, the default, sessions 17-20): llm_serve 5.2-7.0 ms,
// llm_generate 14-16 ms; the pipeline, vit_ckpt, gpt2 and resnet50 at most 3.5 ms and mostly
// under 0.3 ms (gpt2 and resnet50 none in their measured steps). Why not move_pending always:
// replayed at a 2 ms lag it raised the e2e gpt2 and pipeline recordings above the expandable
// model (1.004 -> 1.008, 1.235 -> 1.250; bench/results/defrag_session20_2026-12-04.md), where
// waits are short and cheap. avoid_queued_unmaps is on by default with it: it only matters once
// pages move pending (no other unmap waits for a stream), and the maps into just-left ranges
// are what made move_pending alone wait (Note [Placing away from queued unmaps]).
// Measured: replayed over the development set (22 recordings x GPU lags 0 / 2 / 100 ms, peak
// reserved / peak requested), mean 1.0443 -> 1.0360, at most 1.02 on 41 -> 48 of 66 pairs,
// below the expandable model on 46 -> 53; nothing changes at lag 0 (waits cost nothing) nor for
// the e2e gpt2 and pipeline recordings at 2 ms; llm_serve at 100 ms 1.132 -> 1.015; higher on 9
// pairs, most of all llm_generate (recordings_b) at 2 ms, 1.020 -> 1.040. On the H200
// (bench/results/e2e_h200_2026-12-04_s20c.md, _s20d.md; peak device memory, the default against
// expandable segments): llm_serve switched in every run, 10,946-10,980 MiB against 11,162, at
// 0.93% of the step in the allocator (1.55-1.80% before); llm_generate switched in 3 of 7 runs,
// 3,634 MiB each time, 3,672-3,678 when it did not, against 3,668; the training workloads never
// switched, so they ran the earlier default's code (gpt2 17,572, resnet50 3,326; vit_ckpt 3,378
// on that host against 3,420-3,446 in the calls before, the time budget's host dependence).
// How much waiting switches (session 22, bench/results/defrag_session22_2026-12-04.md): with
// "more than half" llm_generate's first window over the budget fell on either side by host
// timing: over sessions 20-22 it switched in 8 of 16 runs (3,634 MiB), and those that did not
// had waited 34-42% of their charged time (3,672-3,678 MiB, expandable segments 3,668). At
// three tenths it switched in 6 of 6 H200 runs (3,634 each); llm_serve switched as before
// (10,958-10,980 against 11,162-11,170); gpt2, resnet50, vit_ckpt and the pipeline did not
// switch in those calls (gpt2 17,572 and resnet50 3,326 in every run). vit_ckpt can: its
// default runs waited 26-46% of their charged time over the whole run, and with the threshold
// at 0.3 plus two other changes (no count raises, max_grow_slack 0.22) it switched in 2 of 3
// runs (3,470 and 3,474 MiB; 3,432 where it did not; expandable segments 3,458), within the
// 3,372-3,474 its runs of one code path spread over.
// The pipeline's runs waited 4-25% of their charged time (one run of the default switched even
// at one half; none of 5 did at three tenths). Replayed (development set, 23 recordings x lags
// 0 / 2 / 100 ms) the mean went 1.0456 -> 1.0454: lower on 3 pairs, higher on 1 (recordings_b
// llm_serve at 2 ms, 1.010 -> 1.020, expandable 1.035).
//
// Note [A raise that comes back]
// The time budget judges moves over windows of a few dozen milliseconds, so that a job that
// moves pages at every step (the two-stream pipeline of bench/e2e: 10-15 ms steps, moves in
// each) gets its slack raised within its first steps. A job whose moves come in bursts seconds
// apart looks the same during a burst: the held-out llm_serve recording (bench/validation)
// moves 300-400 pages per growth while it allocates a batch's key/value caches, 10-16 growths
// in 25-40 ms, then nothing for seconds while the batch decodes. Its first burst raised the
// slack from 0.01 to 0.111 and every later batch grew into that slack: 1.111x its live peak
// (replayed; on the H200 12,114 MiB against expandable_segments' 11,162), while its moves took
// 0.4% of its time when the slack was held at 0.01 (1.014).
// Nothing decides better during the first burst (the pipeline's first burst is the same), so
// a raise on time is undone afterwards: once the job has gone without a charged growth (below
// the peak, moving pages or waiting) for as long as the raising window's moves need to fit the
// budget (their time / move_budget: 22 ms of moves, 1.1 s), and at least kBudgetMaxWindowNs,
// the slack returns to what it was before the first raise on time of the run, and the next
// growth moves pages again. Pages created meanwhile stay held (nothing is released); only
// growth beyond them is judged again. A job that keeps moving never goes quiet that long and
// keeps its raise: the pipeline replays exactly as before at every GPU lag. One that settled
// keeps it until it moves again. With Note [Quiet time pays for a burst], later bursts move
// without a raise. Raises by the count of moves (Note [Slack that adapts to moves]) stay: also
// undoing them (tried) brought the replayed unet_train of bench/validation from 1.007 to 1.012
// of its live peak, and on the H200 its defrag runs then peaked 0.5% above expandable_segments
// with steps 14% slower than native's.
//
// Note [Quiet time pays for a burst]
// Windows close at most kBudgetMaxWindowNs after their first move, so a gap between moves
// longer than that is time no window saw. It earns move_budget of itself, banked up to
// kBudgetBankNs of quiet (200 ms of moves at the default budget), and the bank pays for the next
// moves before a window is charged. A burst after seconds of quiet is then judged as the share
// of time it is (llm_serve replayed: 1.111 -> 1.024 of its live peak, 132 ms of moves over
// 40 s). Moves closer together than kBudgetMaxWindowNs earn nothing, so a job that moves at
// every step (the pipeline: moves 10-30 ms apart) is judged exactly as before.
void DefragEngine::lower_slack_if_quiet(std::uint64_t now_ns) noexcept {
  if (now_ns - std::min(now_ns, last_move_ns_) < budget_quiet_ns_) {
    return;
  }
  budget_quiet_ns_ = 0;
  over_at_limit_ = false;  // judged again at the limit, if the slack gets there again
  if (slack_before_budget_ < slack_) {
    note_slack_event(SlackEvent::Kind::returned, slack_, slack_before_budget_);
    slack_ = slack_before_budget_;
    counters_.slack = slack_;
    ++counters_.slack_returns;
  }
}

std::size_t DefragEngine::take_pages(Node* n, std::size_t want, std::size_t room,
                                     const StreamId* after_stream) {
  // Note [Chunks]: whole chunks only. The pages taken are one run [cut, hi) at the top of the
  // hole's whole pages, below the chunks at the top that cannot move (one going on into the
  // partly used page above, or one larger than `room`), which stay mapped with that page.
  const std::uintptr_t lo = page_up(n->addr);
  std::uintptr_t hi = page_down(n->end());
  if (hi <= lo || want == 0) {
    return 0;
  }
  const Arena& a = *n->arena;
  // The chunk that holds the page below `at`: [first, last] page indexes.
  const auto chunk_below = [&](std::uintptr_t at) {
    const std::size_t last = page_index(a, at) - 1;
    std::size_t first = last;
    while (first > 0 && a.pages[first - 1] == a.pages[last]) {
      --first;
    }
    return std::pair{first, last};
  };
  for (bool at_top = true; hi > lo; at_top = false) {
    const auto [first, last] = chunk_below(hi);
    const bool goes_on = at_top && last + 1 < a.pages.size() && a.pages[last + 1] == a.pages[last];
    if (!goes_on && last - first + 1 <= room) {
      break;
    }
    hi = a.base + first * page_;
  }
  std::uintptr_t cut = hi;
  std::size_t k = 0;
  std::size_t chunks = 0;
  while (cut > lo && k < want) {
    const auto [first, last] = chunk_below(cut);
    const std::size_t len = last - first + 1;
    if (a.base + first * page_ < lo || len > room - k) {
      break;  // the chunk goes on below the hole, or is larger than the placement has room for
    }
    cut = a.base + first * page_;
    k += len;
    ++chunks;
  }
  if (k == 0) {
    return 0;
  }
  if (!safe(n) && after_stream == nullptr) {
    ++unsafe_unmaps_;  // never: callers check; check_invariants() reports it
  }
  const std::uintptr_t old_end = n->end();
  const std::uint32_t owner = n->cls;  // n may turn into the unmapped part below
  const bool loose = coalescing_ && after_stream == nullptr;
  const std::uint64_t stamp = n->stamp;
  // What can fail comes first (host allocations, then the device call); after the unmap only
  // re-linking and re-keying remain, which cannot fail.
  Node* right = nullptr;  // [hi, old_end): what stays mapped at the top
  Node* mid = nullptr;    // [cut, hi): becomes unmapped (n itself when nothing is left below)
  try {
    if (hi < old_end) {
      right = new_node();
      right->same_range_as(*n);
      right->addr = hi;
      right->size = old_end - hi;
      right->state = State::mapped_free;
      right->cls = owner;
      right->stamp = stamp;
      index_put(right);
    }
    if (cut > n->addr) {
      mid = new_node();
      mid->same_range_as(*n);
      mid->addr = cut;
      mid->size = hi - cut;
      mid->state = State::unmapped_free;
      index_put(mid);
    }
    scratch_.reserve(scratch_.size() + chunks);
    if (after_stream != nullptr) {
      vm_.unmap_after(cut, k * page_, *after_stream);  // Note [Moving pages a stream still uses]
    } else if (loose) {  // Note [Coalescing moved chunks while maps are dear]
      vm_.unmap_now(cut, k * page_);
    } else {
      vm_.unmap(cut, k * page_);
    }
  } catch (...) {
    for (Node* x : {right, mid}) {
      if (x != nullptr) {
        index_remove(x);
        recycle(x);
      }
    }
    throw;
  }
  ++counters_.unmap_batches;
  counters_.chunks_moved += chunks;
  Arena& arena = *n->arena;
  for (std::size_t i = page_index(arena, cut), end = i + k; i < end;) {
    const PhysicalHandle h = arena.pages[i];
    std::size_t j = i;
    while (j < end && arena.pages[j] == h) {
      arena.pages[j++] = 0;
    }
    scratch_.push_back(Chunk{h, j - i, loose});
    i = j;
  }
  if (mid == nullptr) {
    // Nothing of n stays below the unmapped pages: n becomes them.
    index_remove(n);
    age_remove(n);
    n->state = State::unmapped_free;
    n->size = hi - cut;
    n->cls = 0;
    n->stamp = 0;
    mid = n;
  } else {
    link_after(n, mid);
    n->size = cut - n->addr;
    index_put(n);  // re-key: no allocation
    age_update(n);
  }
  if (right != nullptr) {
    link_after(mid, right);
    age_update(right);  // it holds whole pages when chunks at the top could not move
  }
  merge_around(mid, 0);  // joins unmapped neighbours; indexes mid (re-key or insert)
  return k;
}

Node* DefragEngine::make_fresh(Node* hole, std::uintptr_t begin, std::uintptr_t end,
                               std::uint32_t cls, Node* below) {
  if (below != nullptr) {
    below->addr = hole->addr;
    below->size = begin - hole->addr;
    below->state = State::unmapped_free;
    link_before(hole, below);
    hole->addr = begin;
    hole->size -= below->size;
    index_put(below);  // cannot allocate: grow() reserved room for it
  }
  Node* f = nullptr;
  if (end < hole->end()) {
    f = new_node();
    f->addr = hole->addr;
    f->size = end - hole->addr;
    link_before(hole, f);
    hole->addr = end;
    hole->size -= f->size;
    index_put(hole);
  } else {
    index_remove(hole);
    f = hole;
  }
  f->state = State::mapped_free;
  f->cls = cls;
  f->stamp = 0;
  return merge_around(f, cls, /*for_owner=*/true);
}

// ============================================================================ release

std::size_t DefragEngine::release_cached() {
  coalescing_ = false;  // its pages go back to the device: unmapped the usual way
  flush_recent();
  wait_all();
  // Every hole is safe now: merge all neighbours the streams kept apart.
  for (const auto& a : arenas_) {
    for (Node* n = a->head; n != nullptr; n = n->next) {
      if (n->state == State::mapped_free && n->next != nullptr &&
          n->next->state == State::mapped_free) {
        n = merge_around(n, n->cls);
      }
    }
  }
  for (Node* n : deferred_) {
    n->deferred = false;
  }
  deferred_.clear();
  std::size_t released = 0;
  scratch_.clear();
  constexpr std::size_t kAll = std::numeric_limits<std::size_t>::max();
  for (Node* n = age_head_; n != nullptr;) {
    Node* next = n->age_next;
    try {
      take_pages(n, kAll, kAll);
    } catch (...) {
      released += scratch_pages();
      release_scratch();
      throw;
    }
    released += scratch_pages();
    release_scratch();
    n = next;
  }
  return released * page_;
}

}  // namespace cachealloc::detail
