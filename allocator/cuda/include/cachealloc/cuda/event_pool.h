// event_pool.h: reusable CUDA events for one device, shared by every CUDA backend.
//
// Note [Why a pool of events]
// The front end records an event per other stream on every cross-stream free, and policies
// record one per stream epoch. cudaEventCreate costs a few microseconds and takes a driver
// lock; a recorded-and-completed event can simply be recorded again. So events are created on
// first need (cudaEventDisableTiming: timing events are slower to record), handed out as
// EventId (the cudaEvent_t's address), and returned to an idle list by give_back(); they are
// destroyed only with the pool. The pool never shrinks: its size is the peak number of events
// in flight, typically a few dozen.
//
// Note [Host fences instead of events]
// A freed block that another stream used (record_stream) is polled at the next allocations
// until that stream finished its work: one cudaEventQuery per busy stream per allocation
// (Note [One query per busy stream]). In a two-stream input pipeline something is parked nearly
// all the time, and on the H200 those queries were ~10% of cachealloc:async's time per step
// (event_poll_interval:16 took it from 187 to 170 us). So where the device supports 64-bit
// stream memory operations, record() enqueues cuStreamWriteValue64 of the stream's next
// sequence number into a pinned, mapped host counter for that stream instead of recording an
// event. The write runs after the work queued before it on the stream, like an event
// completing; query() is then a load of the counter (no driver call), synchronize() waits for
// the counter (checking the device for errors now and then), give_back() has nothing to do.
// A fence is an EventId with the top bit set: (1 << 63) | slot << 44 | sequence. Counters
// exist for the first kFenceSlots streams; later streams, devices without stream memory
// operations and a failed host allocation use events as before.
// make_stream_wait (cudaMemPool dependencies) needs a real event: record_event() gives one.
// stream_wait() (reuse_parked_waits, Note [Reusing a parked free on the stream it waits for],
// allocator.h) waits for a fence on the device with cuStreamWaitValue64 (GEQ on its counter);
// session 41's GPU suite ran under CACHEALLOC_HOST_FENCES=1 with the device-wait test racing.
//
// Fences are opt-in (CACHEALLOC_HOST_FENCES=1). Their first run on the H200 found two defects:
// the driver call failed with CUDA_ERROR_INVALID_CONTEXT on PyTorch's autograd threads (the
// runtime binds its context to a thread lazily; record() now binds it), and cudaMemPoolTrimTo
// does not see a fence, so async's empty_cache kept memory (its release now waits with real
// events: StreamOrderedMemory::wait_for_frees). Both fixes then passed on the H200 (session 7:
// the GPU suite's fence section, including a record from a fresh thread; tools/tests/
// test_async_stats.py under CACHEALLOC_HOST_FENCES=1; 27 e2e runs with fences, none failed).
// They stay opt-in because they bought nothing measurable: in the same run (3 interleaved
// repetitions, bench/results/e2e_h200_2026-12-03_session7a.md) cachealloc:async spent 349 us
// per pipeline step with events and 430 with fences, 3,751 and 3,535 on gpt2, 1,580 and 1,517
// on resnet50; defrag 995 / 974 (pipeline), 697 / 707 (resnet50): within the run-to-run spread.
// An event query on a completed event is cheap enough that removing it does not show.
// Measured again on one H100 in session 44 (bench/results/defrag_session44_2026-12-07.md, policy
// defrag, 2-3 interleaved runs per call): fences took the event calls of every job that parks
// many frees down (offload_train 941 -> 510 and 928 -> 565 us per step, comm_overlap 141 -> 67,
// stream_weights 187 -> 140; the pipeline's 15-25 us unchanged) and offload_train's steps without
// a device call from 1.38-1.44% to 1.07-1.16% of the step, with peaks within the spread; but the
// median step was longer under fences on the pipeline (3 calls, +0.6 to +3.5%), comm_overlap
// (+6.4%, one run 11% slower) and stream_weights (+1.4%), shorter only on offload_train. A write
// with its default memory barrier may cost the GPU more than an event; until that is measured
// (e.g. with CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER, whose ordering would need its own proof)
// they stay opt-in.
// Session 47 (bench/results/defrag_session47_2026-12-07.md) tried that flag: it cannot be had.
// cuStreamWriteValue64 resolves to cuStreamWriteValue64_v2 on CUDA 12 and later, and on an H100
// (driver 580, CUDA 13) every write with the flag failed with CUDA_ERROR_INVALID_VALUE, as the
// driver API documents it for the v2 calls. The same call ran events against fences side by
// side again (H100, 2-3 interleaved runs each): median steps comm_overlap 158.4 / 147.9 ms,
// stream_weights 130.2 / 129.6, offload_train (30 steps) 114.9 / 114.3, the pipeline (300
// steps) 5.77 / 5.82; event calls 155 -> 57, 135 -> 108, 763 -> 465 and 13 -> 15 us per step.
// Against session 44 the step times now lean the other way on three of four jobs: no cost of
// fences to the GPU shows beyond the run-to-run spread either way. Still opt-in: what they save
// (0.02-0.3 points of the quiet steps' share on the jobs that park many frees) brings no job under
// issue 5's bar that events leave over it (offload_train's quiet steps 1.14% with events, 1.01%
// with fences).
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/cuda/event_thread.h>
#include <cachealloc/record_thread.h>
#include <cachealloc/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

namespace cachealloc {

class DeviceBackend;

/// Pool of cudaEventDisableTiming events on one device. Not thread-safe (the backend's caller
/// serialises calls, see backend.h).
class CudaEventPool {
 public:
  /// Hands record() calls to a thread of their own with `mode` records, and has that thread
  /// watch the events too with poll (event_thread.h; host fences, when on, take precedence).
  explicit CudaEventPool(int device, EventThread mode = EventThread::off) noexcept;
  ~CudaEventPool();
  CudaEventPool(const CudaEventPool&) = delete;
  CudaEventPool& operator=(const CudaEventPool&) = delete;

  /// A host fence on `stream` (Note [Host fences instead of events]), or where fences are not
  /// available an idle (or new) event recorded on it. Throws DeviceError.
  [[nodiscard]] EventId record(StreamId stream);
  /// Always a CUDA event (for cudaStreamWaitEvent). Throws DeviceError.
  [[nodiscard]] EventId record_event(StreamId stream);
  /// True when the work before the event finished (cudaEventQuery). A posted record the thread
  /// watches is answered from its word (Note [The record thread watches its events]). Throws
  /// DeviceError.
  [[nodiscard]] bool query(EventId event);
  /// Makes `stream` wait on the device for the event (cudaStreamWaitEvent) or host fence
  /// (cuStreamWaitValue64 on its counter); false for a fence where the driver lacks that call.
  /// Throws DeviceError.
  [[nodiscard]] bool stream_wait(StreamId stream, EventId event);
  /// Blocks until the event completed (cudaEventSynchronize). Throws DeviceError.
  void synchronize(EventId event);
  /// Makes the event available again. The event need not have completed: re-recording an
  /// event only changes what later queries see, never work already queued.
  void give_back(EventId event) noexcept;

  /// True for an EventId that is a host fence.
  [[nodiscard]] static bool is_fence(EventId id) noexcept { return (id & kFenceBit) != 0; }
  /// True for an EventId whose record was handed to the record thread (Note [Event records on a
  /// thread of their own], record_thread.h).
  [[nodiscard]] static bool is_posted(EventId id) noexcept { return (id & kPostedBit) != 0; }
  /// The record thread's figures (zero without one): records it made and its time in them.
  [[nodiscard]] std::uint64_t thread_records() const noexcept { return thread_ ? thread_->worker_records() : 0; }
  [[nodiscard]] std::uint64_t thread_ns() const noexcept { return thread_ ? thread_->worker_ns() : 0; }
  /// The same as the backends report them (BackgroundWork's event fields; the rest zero).
  [[nodiscard]] BackgroundWork thread_work() const noexcept {
    BackgroundWork work;
    work.event_records = thread_records();
    work.event_ns = thread_ns();
    work.event_queries = thread_ ? thread_->worker_queries() : 0;
    work.event_query_ns = thread_ ? thread_->worker_query_ns() : 0;
    return work;
  }
  [[nodiscard]] std::uint64_t thread_caller_records() const noexcept {
    return thread_ ? thread_->caller_records() : 0;
  }
  [[nodiscard]] std::uint64_t thread_wakes() const noexcept { return thread_ ? thread_->wakes() : 0; }
  /// Whether record() hands out host fences (decided at its first call).
  [[nodiscard]] bool fences_enabled() const noexcept { return fences_ == FenceMode::on; }

  /// Events created so far (live in the pool, idle or handed out).
  [[nodiscard]] std::size_t created() const noexcept { return all_.size(); }
  /// Events ready to be handed out without a cudaEventCreate.
  [[nodiscard]] std::size_t idle() const noexcept { return idle_.size(); }

  [[nodiscard]] static cudaEvent_t to_event(EventId id) noexcept {
    return reinterpret_cast<cudaEvent_t>(static_cast<std::uintptr_t>(id));
  }
  [[nodiscard]] static EventId to_id(cudaEvent_t event) noexcept {
    return static_cast<EventId>(reinterpret_cast<std::uintptr_t>(event));
  }

 private:
  static constexpr EventId kFenceBit = EventId{1} << 63;
  static constexpr EventId kPostedBit = EventId{1} << 62;  // | a RecordThread::Slot's address
  static constexpr unsigned kSlotShift = 44;
  static constexpr EventId kSequenceMask = (EventId{1} << kSlotShift) - 1;
  static constexpr std::size_t kFenceSlots = 256;
  enum class FenceMode : unsigned char { unknown, on, off };

  bool init_fences() noexcept;
  /// The counter slot of `stream`, adding one; kFenceSlots when all are taken.
  std::size_t fence_slot(StreamId stream);
  [[nodiscard]] bool fence_reached(EventId id) const noexcept;
  void wait_fence(EventId id);

  /// A slot of the record thread with its own event (created on first need), idle or new.
  RecordThread::Slot& take_slot();
  [[nodiscard]] static RecordThread::Slot& slot_of(EventId id) noexcept {
    return *reinterpret_cast<RecordThread::Slot*>(static_cast<std::uintptr_t>(id & ~kPostedBit));
  }
  /// Throws DeviceError for a slot whose record failed.
  static void check_recorded(const RecordThread::Slot& slot);
  /// The event of posted `id`, recorded by the time this returns (by this thread when the record
  /// thread has not taken it yet). Throws DeviceError when the record failed.
  cudaEvent_t record_posted_now(EventId id);

  int device_;
  bool thread_wanted_ = false;
  bool thread_watches_ = false;  // event_thread poll
  std::vector<std::unique_ptr<RecordThread::Slot>> slots_;  // every slot (each owns its event)
  std::vector<RecordThread::Slot*> idle_slots_;
  std::unique_ptr<RecordThread> thread_;  // started by the first record() that wants it
  std::vector<cudaEvent_t> all_;
  std::vector<cudaEvent_t> idle_;
  FenceMode fences_ = FenceMode::unknown;
  std::uint64_t* counters_ = nullptr;     // kFenceSlots, pinned and mapped; written by the GPU
  std::uint64_t counters_device_ = 0;     // their device address (CUdeviceptr)
  std::vector<StreamId> fence_streams_;   // slot -> stream
  std::vector<std::uint64_t> issued_;     // slot -> last sequence enqueued

 public:
  /// The device address of `id`'s counter and the sequence it waits for (for cuStreamWaitValue64).
  [[nodiscard]] std::uint64_t fence_address(EventId id) const noexcept {
    return counters_device_ + ((id & ~kFenceBit) >> kSlotShift) * sizeof(std::uint64_t);
  }
  [[nodiscard]] static std::uint64_t fence_sequence(EventId id) noexcept { return id & kSequenceMask; }
};

/// pool.record(stream), counted (BackendCounters::events_recorded) and timed (event_ns, on
/// backend.clock_ns(): two clock reads, about 40 ns against the microsecond or so of the driver
/// call) in `backend`'s counters: the CUDA backends' record_event().
[[nodiscard]] EventId record_counted(CudaEventPool& pool, DeviceBackend& backend, StreamId stream);
/// pool.query(event), counted (event_queries) and timed likewise: their query_event().
[[nodiscard]] bool query_counted(CudaEventPool& pool, DeviceBackend& backend, EventId event);

}  // namespace cachealloc
