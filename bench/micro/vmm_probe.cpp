// cachealloc-vmm-probe: asks the driver what the virtual-memory calls accept, for the design of
// policy defrag's page moves (bench/results/defrag_floor_2026-12-04_session18.md). It prints one
// line per question, "PROBE <name>: <ok|rejected (CUDA error)> [<median us>]", and exits 0; 77
// when no GPU is visible (the ctest smoke run is then skipped), 1 when a call that must work fails.
//
// The questions:
//   map_at_offset      cuMemMap of one page at a nonzero offset into a 4-page handle. cuda.h
//                      (CUDA 13.0) says both "offset ... must be a multiple of the granularity"
//                      and "Note: currently must be zero"; only the driver can say which holds.
//   alias_whole        the whole handle mapped at a second address while mapped at the first
//                      (what Note [Unmapping off the allocating thread] relies on).
//   alias_piece        one page of the handle mapped at a second address (at an offset) while
//                      the whole handle is mapped at the first.
//   unmap_subrange     cuMemUnmap of one page of a 4-page mapping (documented as invalid).
//   release_mapped     cuMemRelease of a handle that is still mapped (whole, at a second
//                      address), then the unmap (the memory must live until its last mapping
//                      goes). The H200 run of session 19 tried a piece here, which the driver
//                      cannot map (map_at_offset), so that line said nothing about the release.
// With map_at_offset accepted, a chunk (one handle of several pages) could give its free pages
// to another address while a live block pins the rest, at the cost of one map and no unmap.
//
// Note [Mapping behind a stream wait]
// Each page move costs the allocating thread a cuMemMap + cuMemSetAccess (55-70 us on the H200),
// which is what keeps the two-stream pipeline of bench/e2e above 1% of its step
// (bench/results/defrag_session21_2026-12-04.md). A move could instead hand out its address at
// once and have the map made by another thread, if the allocating stream first waits (a
// cuStreamWaitValue64 on a host-mapped word) for that thread to say the pages are mapped: the
// kernels queued behind the wait run only after the map. Whether the driver allows it is what
// these questions ask, each under a 10 s watchdog that releases the stream itself (a map that
// blocks until the waiting stream drains would deadlock the design):
//   map_behind_wait        a kernel queued behind the wait fills pages mapped only after it was
//                          queued, by another thread; a second kernel checks the pattern. "ok"
//                          needs the map to return, the stream to finish without error and no
//                          word to differ. The median is the cost of enqueuing the wait.
//   map_behind_wait_unmap  the same while a third thread unmaps another busy mapping (the
//                          background unmapper's work) at the moment the stream is held.
//   memcpy_before_map      cudaMemcpyAsync (host to device) into pages not yet mapped, queued
//                          behind such a wait on the stream: does the runtime accept the call?
//   memset_before_map      the same with cudaMemsetAsync.
// Added in session 21 after PyTorch, under policy defrag with its maps made this way (the
// bench/e2e pipeline), failed at the first tensor copied to the GPU with cudaErrorInvalidValue:
// the runtime seems to check a copy's pointers when it is queued, not when it runs. These two
// questions ask that directly. On the H200 (session 22, bench/results/
// defrag_session22_2026-12-04.md) both were rejected with cudaErrorInvalidValue when queued, while
// map_behind_wait was ok (4.1 us): the runtime checks copy and memset addresses at enqueue, so
// an allocator must hand out only mapped memory.
// Run last: a kernel that touched unmapped pages would leave the context unusable.
//
// Note [Access behind a stream wait]
// Session 30's probe of Note [Maps while copy engines run] on the H100 found cuMemMap itself
// cheap (1-2 us per handle) and cuMemSetAccess the whole cost of a map: 26 us per handle idle,
// about 1 ms per handle while device-to-host copies run. A move could then map the pages on the
// allocating thread (the address is valid when a copy is queued) and have another thread grant
// the access while the allocating stream waits for it (a cuStreamWaitValue64), if the driver
// allows work to be queued on pages mapped without access. These questions ask it:
//   access_behind_wait     kernels queued behind the wait fill and check pages mapped before
//                          them but granted access only afterwards, by another thread;
//   memcpy_before_access   cudaMemcpyAsync (host to device) into such pages, queued behind the
//                          wait: accepted when queued, and the stream finishes without error?
//   memset_before_access   the same with cudaMemsetAsync.
// Run after the map questions and before the *_before_map ones (a fault leaves the context
// unusable, so what follows would fail too).
// On the H100 (session 30, bench/results/defrag_session30_2026-12-05.md): access_behind_wait ok,
// both copies rejected with cudaErrorInvalidValue when queued. The runtime checks a copy's access
// at enqueue, so an allocator must grant access before it hands the block out.
//
// Note [Maps while copy engines run]
// On the H100 (session 29, bench/results/defrag_session29_2026-12-05.md) defrag's cuMemMap +
// cuMemSetAccess cost 270-400 us per handle mapped in offload_train, whose copy stream streams
// activations to pinned host memory, against 74 us in the two-stream pipeline and 55 us on an
// idle H200. These probes time the map alone (the unmap is not timed): one handle of 1 page, one
// of 16, and 8 one-page handles mapped back to back under one cuMemSetAccess (the policy's
// map_run), first with the device idle, then while another stream runs device-to-host copies of
// 256 MiB into pinned memory back to back, then host-to-device: "PROBE map_<n>p_<load>: ok
// median <us> over <k>" (map_8x1p_<load> for the run), and on a "_parts" line the medians of the
// cuMemMap calls and of the cuMemSetAccess call apart, which tell whether the cost is paid per
// handle or per access call. Only maps made while the copies still ran count under a load.
// On the H100 (session 30, bench/results/vmm_probe_h100_2026-12-05_s30.txt and _s30b.txt):
// cuMemMap 1-2 us per handle; cuMemSetAccess 23-26 us for one page idle, 39-43 us for 16, 203-233
// us for 8 one-page handles, so per handle; while device-to-host copies ran about 1,030 us per
// handle whatever its size, host-to-device 27-67 us.
//
// Note [Creating and releasing while copy engines run]
// A page move maps a handle again (an access call: about 1 ms under device-to-host copies);
// replacing several small free handles by one new handle would instead release them and create
// one. Whether that is cheaper depends on what cuMemRelease and cuMemCreate cost under the same
// copies, which nothing measured yet. create_release_<n>p_<load> times both for a handle of 1 and
// of 16 pages (mapped, granted access and unmapped in between, untimed, as a moved page is):
// "PROBE create_release_<n>p_<load>: cuMemCreate median <us>, cuMemRelease median <us> over <k>".
//
// Note [Unmaps and copies under maps]
// Two more questions for a policy that moves pages while an offloading job copies to the host:
//   per call or per handle, an unmap: map_<n>p_<load>_parts (Note [Maps while copy engines run])
//                         also times the one cuMemUnmap over each run (map_8x1p: 8 handles);
//   copies_with_maps      the time of 3 GiB of device-to-host copies (8 MiB each, one stream,
//                         timed by events on it) alone, then again while this thread maps, grants
//                         access to and unmaps one page over and over: whether access calls hold
//                         the copies back. Session 35's offload_train held more memory in flight
//                         (frees waiting for the copy stream) under defrag than under expandable
//                         segments (bench/results/defrag_session35_2026-12-06.md).
// Answered on an H100 (session 36, bench/results/vmm_probe_h100_2026-12-06_s36.txt): an unmap is
// paid per handle (one call over 8 one-page handles 228-253 us, over one handle of 1 or 16 pages
// 21-34 us, idle or under copies), and access calls do not hold the copies back (3 GiB of 8 MiB
// copies in 59.6 ms alone, 59.8 ms while this thread mapped 56-57 times). Policy defrag then
// coalesces the chunks a growth moves while maps are dear (Note [Coalescing moved chunks while
// maps are dear], policies/src/defrag_grow.cpp).
//
// Note [Which maps wait for the copies]
// Session 30's probe found cuMemSetAccess about 1 ms per handle while device-to-host copies run,
// and in bench/e2e offload_train the maps of policy defrag (243 us per handle on an H100, session
// 32) are most of its time in the allocator. The probe above maps one address over and over, each
// map right after an unmap of the same address, with the same handles: whether the wait belongs
// to an address mapped before (the driver invalidating what the device may still cache of it),
// to a handle mapped before, or to every access call, it cannot tell. Replayed, most of defrag's
// maps go to addresses never mapped before (offload_train recorded on the H200: 1,457 of 2,130;
// the e2e pipeline: 844 of 1,535), so the answer decides whether placing growths in fresh address
// space would make them cheap. And if the wait is per call and not per device, access calls made
// from several threads at once could overlap their waits. These questions ask it, idle and while
// device-to-host copies run (as above; only maps made while the copies still ran count):
//   map_same_va_<load>       one page, one handle, at the address it was just unmapped from
//                            (the question above, kept for a side-by-side figure);
//   map_fresh_va_<load>      the same handle at a new address each time (never mapped before);
//   map_fresh_both_<load>    a new handle (created untimed) at a new address each time: a growth
//                            at the top of the address space;
//   map_old_va_<load>        a new address for each map of a first pass, all unmapped, then 50 ms
//                            later a second pass maps the same addresses again (timed): an address
//                            unmapped long ago;
//   map_8_serial_<load>      8 one-page handles, each mapped and granted access by its own calls,
//                            one after the other on this thread (total of the 8);
//   map_8_threads_<load>     the same 8 at once from 8 threads (wall time from the start of the
//                            first to the end of the last).
// Besides "idle" and "d2h" (copies of 256 MiB), these and the questions above also run under
// "d2h8": device-to-host copies of 8 MiB back to back, nearer an offloading job's, to tell
// whether the cost is per handle or grows with the handle's pages under such copies (session
// 31's offload_train found 4-chunk growths dearer per handle, 340 us against 249).
// Answered on an H100 (session 35, bench/results/vmm_probe_h100_2026-12-06_s35.txt; medians):
// the address does not matter: idle 32.6 / 32.5 / 32.6 / 32.5 us (same, fresh, fresh handle and
// address, old), under 256 MiB copies 1,032 / 1,032 / 1,012 / 1,032 us, under 8 MiB copies the
// same. Threads do not overlap the waits: 8 maps from 8 threads took 619 us idle against 173 in
// series, 8,228 against 8,329 under copies. Under 8 MiB copies one page and 16 pages cost the
// same (1,041 / 1,033 us): per handle, not per page. So policy defrag's fresh_va (maps only at
// fresh addresses) and backend cuda_vmm's map_threads (access calls from several threads) were removed.
//
// Note [Device calls behind a running kernel]
// Session 54 (bench/results/defrag_session54_2026-12-07.md) found the e2e pipeline's steps that
// made a device call 0.56-4.4 ms longer than quiet steps of the same batch size, far more than
// the calls' own 70 us: as if a map, an unmap, a create or a release waited for the work queued
// on the GPU, and the step lost the overlap of host and GPU. behind_kernel asks it directly: a
// spin kernel of about 20 ms is queued (on the legacy default stream, where PyTorch's main stream
// is, then on a non-blocking stream), then this thread times cuMemMap + cuMemSetAccess of a page,
// its cuMemUnmap, and cuMemCreate and cuMemRelease of another, and after each call asks whether
// the kernel still runs (cudaStreamQuery). "PROBE behind_kernel_<stream>: map+access median <us>,
// unmap <us>, create <us>, release <us> over <k>; the kernel still ran after the map <a>/<k>,
// the unmap <b>/<k>, the create <c>/<k>, the release <d>/<k>", and the same calls idle
// (behind_kernel_idle). A call that waits takes about what was left of the 20 ms, and the kernel
// has finished after it. `cachealloc-vmm-probe behind_kernel` asks only this.
#include "../../allocator/cuda/src/driver_api.h"

#include <cuda_runtime_api.h>

#if CACHEALLOC_PROBE_KERNELS
#include "../../tests/gpu/kernels.h"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <future>
#include <thread>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using cachealloc::cuda_detail::DriverApi;

std::string error_text(const DriverApi& api, CUresult r) {
  const char* name = nullptr;
  if (api.get_error_name(r, &name) != CUDA_SUCCESS || name == nullptr) {
    return "CUresult " + std::to_string(static_cast<int>(r));
  }
  return name;
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

struct Probe {
  const DriverApi& api;
  CUmemAllocationProp prop{};
  CUmemAccessDesc access{};
  std::size_t page = 0;

  void must(CUresult r, const char* what) {
    if (r != CUDA_SUCCESS) {
      std::printf("FAILED %s: %s\n", what, error_text(api, r).c_str());
      throw std::runtime_error(what);
    }
  }

  // Maps [va, va + bytes) from `offset` of `h` and grants access; returns the result of the map.
  CUresult map(CUdeviceptr va, std::size_t bytes, std::size_t offset, CUmemGenericAllocationHandle h) {
    const CUresult r = api.mem_map(va, bytes, offset, h, 0);
    if (r == CUDA_SUCCESS) {
      must(api.mem_set_access(va, bytes, &access, 1), "cuMemSetAccess");
    }
    return r;
  }

  void report(const char* name, CUresult r, const std::vector<double>& us = {}) {
    std::string line = std::string("PROBE ") + name + ": " +
                       (r == CUDA_SUCCESS ? std::string("ok") : "rejected (" + error_text(api, r) + ")");
    if (!us.empty()) {
      char buf[64];
      std::snprintf(buf, sizeof buf, " median %.1f us over %zu", median(us), us.size());
      line += buf;
    }
    std::printf("%s\n", line.c_str());
  }
};

double since_us(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

/// Device-to-host (or host-to-device) copies queued back to back on a stream of their own, for
/// maps to be timed under; none for "idle". "d2h" and "h2d" copy 256 MiB at a time, "d2h8" 8 MiB
/// (as an offloading job's activations go). `running()` says whether they still run.
class CopyLoad {
 public:
  explicit CopyLoad(const char* load) : idle_(std::string(load) == "idle") {
    if (idle_) {
      return;
    }
    const bool d2h = std::string(load).rfind("d2h", 0) == 0;
    const std::size_t piece = std::string(load) == "d2h8" ? std::size_t{8} << 20 : kBytes;
    if (cudaMalloc(&dev_, kBytes) != cudaSuccess || cudaMallocHost(&host_, kBytes) != cudaSuccess ||
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess) {
      release();  // a constructor that throws runs no destructor
      throw std::runtime_error("no memory or stream for the copy load");
    }
    // About 10 GB of copies, several hundred ms: longer than the maps of one question.
    for (std::size_t done = 0; done < 40 * kBytes; done += piece) {
      const std::size_t at = done % kBytes;
      char* dev = static_cast<char*>(dev_) + at;
      char* host = static_cast<char*>(host_) + at;
      const cudaError_t e = d2h ? cudaMemcpyAsync(host, dev, piece, cudaMemcpyDeviceToHost, stream_)
                                : cudaMemcpyAsync(dev, host, piece, cudaMemcpyHostToDevice, stream_);
      if (e != cudaSuccess) {
        release();
        throw std::runtime_error("cudaMemcpyAsync for the copy load");
      }
    }
  }
  ~CopyLoad() { release(); }
  CopyLoad(const CopyLoad&) = delete;
  CopyLoad& operator=(const CopyLoad&) = delete;
  [[nodiscard]] bool running() const { return idle_ || cudaStreamQuery(stream_) == cudaErrorNotReady; }

 private:
  void release() noexcept {
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
      stream_ = nullptr;
    }
    cudaFree(dev_);
    cudaFreeHost(host_);
    dev_ = host_ = nullptr;
  }
  static constexpr std::size_t kBytes = std::size_t{256} << 20;
  bool idle_;
  void* dev_ = nullptr;
  void* host_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Note [Maps while copy engines run]: `load` is "idle", "d2h" or "h2d".
void map_under_copies(Probe& p, const char* load) {
  // One handle of 1 page, one of 16, and 8 handles of 1 page mapped back to back under one
  // access call (as the policy's map_run does): which call the time goes to, and whether it is
  // paid per handle or per access call.
  struct Case {
    std::size_t handles;
    std::size_t pages;  // per handle
  };
  for (const Case c : {Case{1, 1}, Case{1, 16}, Case{8, 1}}) {
    const std::size_t bytes = c.pages * p.page;
    CUdeviceptr va = 0;
    std::vector<CUmemGenericAllocationHandle> hs(c.handles, 0);
    p.must(p.api.mem_address_reserve(&va, c.handles * bytes, 0, 0, 0), "cuMemAddressReserve");
    for (auto& h : hs) {
      p.must(p.api.mem_create(&h, bytes, &p.prop, 0), "cuMemCreate");
    }
    std::vector<double> total;
    std::vector<double> maps;
    std::vector<double> access;
    std::vector<double> unmaps;
    {
      CopyLoad copies(load);
      for (int i = 0; i < 30; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        for (std::size_t k = 0; k < c.handles; ++k) {
          p.must(p.api.mem_map(va + k * bytes, bytes, 0, hs[k], 0), "cuMemMap");
        }
        const auto t1 = std::chrono::steady_clock::now();
        p.must(p.api.mem_set_access(va, c.handles * bytes, &p.access, 1), "cuMemSetAccess");
        const double t = since_us(t0);
        const auto t2 = std::chrono::steady_clock::now();
        p.must(p.api.mem_unmap(va, c.handles * bytes), "cuMemUnmap");  // one call over the run
        const double u = since_us(t2);
        // Only calls made while the copies still ran count under a load.
        if (copies.running()) {
          total.push_back(t);
          maps.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          access.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
          unmaps.push_back(u);
        }
      }
    }
    char name[64];
    if (c.handles == 1) {
      std::snprintf(name, sizeof name, "map_%zup_%s", c.pages, load);
    } else {
      std::snprintf(name, sizeof name, "map_%zux%zup_%s", c.handles, c.pages, load);
    }
    if (total.empty()) {
      std::printf("PROBE %s: not measured (the copies finished before the first map)\n", name);
    } else {
      p.report(name, CUDA_SUCCESS, total);
      std::printf("PROBE %s_parts: cuMemMap median %.1f us, cuMemSetAccess median %.1f us, "
                  "cuMemUnmap (one call, untimed in the total) median %.1f us\n",
                  name, median(maps), median(access), median(unmaps));
    }
    for (auto h : hs) {
      p.must(p.api.mem_release(h), "cuMemRelease");
    }
    p.must(p.api.mem_address_free(va, c.handles * bytes), "cuMemAddressFree");
  }
}

/// Note [Creating and releasing while copy engines run]: one line per handle size under `load`.
void create_release_under_copies(Probe& p, const char* load) {
  for (const std::size_t pages : {std::size_t{1}, std::size_t{16}}) {
    const std::size_t bytes = pages * p.page;
    CUdeviceptr va = 0;
    p.must(p.api.mem_address_reserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve");
    std::vector<double> create;
    std::vector<double> release;
    {
      CopyLoad copies(load);
      for (int i = 0; i < 30; ++i) {
        CUmemGenericAllocationHandle h = 0;
        const auto t0 = std::chrono::steady_clock::now();
        p.must(p.api.mem_create(&h, bytes, &p.prop, 0), "cuMemCreate");
        const double c = since_us(t0);
        p.must(p.api.mem_map(va, bytes, 0, h, 0), "cuMemMap");
        p.must(p.api.mem_set_access(va, bytes, &p.access, 1), "cuMemSetAccess");
        p.must(p.api.mem_unmap(va, bytes), "cuMemUnmap");
        const auto t1 = std::chrono::steady_clock::now();
        p.must(p.api.mem_release(h), "cuMemRelease");
        const double r = since_us(t1);
        if (copies.running()) {  // only calls made while the copies still ran count
          create.push_back(c);
          release.push_back(r);
        }
      }
    }
    if (create.empty()) {
      std::printf("PROBE create_release_%zup_%s: not measured (the copies finished first)\n", pages, load);
    } else {
      std::printf("PROBE create_release_%zup_%s: cuMemCreate median %.1f us, cuMemRelease median %.1f us over %zu\n",
                  pages, load, median(create), median(release), create.size());
    }
    p.must(p.api.mem_address_free(va, bytes), "cuMemAddressFree");
  }
}

/// Note [Unmaps and copies under maps]: copies_with_maps.
void copies_with_maps(Probe& p) {
  constexpr std::size_t kPiece = std::size_t{8} << 20;
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  constexpr int kPieces = 384;  // 3 GiB
  void* dev = nullptr;
  void* host = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  const auto free_all = [&] {
    if (stream != nullptr) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    for (cudaEvent_t e : {start, stop}) {
      if (e != nullptr) {
        cudaEventDestroy(e);
      }
    }
    cudaFree(dev);
    cudaFreeHost(host);
  };
  if (cudaMalloc(&dev, kBytes) != cudaSuccess || cudaMallocHost(&host, kBytes) != cudaSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    std::printf("PROBE copies_with_maps: not measured (no memory, stream or event)\n");
    free_all();
    return;
  }
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  p.must(p.api.mem_address_reserve(&va, p.page, 0, 0, 0), "cuMemAddressReserve");
  p.must(p.api.mem_create(&h, p.page, &p.prop, 0), "cuMemCreate");
  // The copies' time in ms (negative when a copy or an event could not be queued).
  const auto copy_ms = [&](bool with_maps, int& maps) {
    maps = 0;
    bool queued = cudaEventRecord(start, stream) == cudaSuccess;
    for (int i = 0; queued && i < kPieces; ++i) {
      const std::size_t at = (static_cast<std::size_t>(i) * kPiece) % kBytes;
      queued = cudaMemcpyAsync(static_cast<char*>(host) + at, static_cast<char*>(dev) + at, kPiece,
                               cudaMemcpyDeviceToHost, stream) == cudaSuccess;
    }
    queued = queued && cudaEventRecord(stop, stream) == cudaSuccess;
    while (queued && with_maps && cudaEventQuery(stop) == cudaErrorNotReady) {
      p.must(p.api.mem_map(va, p.page, 0, h, 0), "cuMemMap");
      p.must(p.api.mem_set_access(va, p.page, &p.access, 1), "cuMemSetAccess");
      p.must(p.api.mem_unmap(va, p.page), "cuMemUnmap");
      ++maps;
    }
    float ms = 0;
    if (!queued || cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
      return -1.0;
    }
    return static_cast<double>(ms);
  };
  int maps = 0;
  std::vector<double> alone;
  std::vector<double> with;
  std::vector<int> counts;
  for (int round = 0; round < 3; ++round) {  // interleaved
    alone.push_back(copy_ms(false, maps));
    with.push_back(copy_ms(true, maps));
    counts.push_back(maps);
  }
  if (*std::min_element(alone.begin(), alone.end()) < 0 || *std::min_element(with.begin(), with.end()) < 0) {
    std::printf("PROBE copies_with_maps: not measured (a copy or an event failed: %s)\n",
                cudaGetErrorString(cudaGetLastError()));
  } else {
    std::printf("PROBE copies_with_maps: 3 GiB of 8 MiB device-to-host copies took median %.1f ms alone, "
                "%.1f ms while this thread mapped one page over and over (%d, %d, %d maps)\n",
                median(alone), median(with), counts[0], counts[1], counts[2]);
  }
  p.must(p.api.mem_release(h), "cuMemRelease");
  p.must(p.api.mem_address_free(va, p.page), "cuMemAddressFree");
  free_all();
}

/// Note [Which maps wait for the copies]: one line per question under `load`.
void map_freshness(Probe& p, const char* load) {
  constexpr int kRounds = 30;
  const std::size_t page = p.page;
  const auto line = [&](const char* what, const std::vector<double>& us) {
    const std::string name = std::string(what) + "_" + load;
    if (us.empty()) {
      std::printf("PROBE %s: not measured (the copies finished before the first map)\n", name.c_str());
    } else {
      p.report(name.c_str(), CUDA_SUCCESS, us);
    }
  };
  const auto timed_map = [&](CUdeviceptr va, CUmemGenericAllocationHandle h) {
    const auto t0 = std::chrono::steady_clock::now();
    p.must(p.map(va, page, 0, h), "cuMemMap");
    return since_us(t0);
  };
  // Addresses for every question: 2 x kRounds pages (map_old_va uses the second half).
  CUdeviceptr base = 0;
  p.must(p.api.mem_address_reserve(&base, 2 * kRounds * page, 0, 0, 0), "cuMemAddressReserve");
  CUmemGenericAllocationHandle h = 0;
  p.must(p.api.mem_create(&h, page, &p.prop, 0), "cuMemCreate");
  std::vector<CUmemGenericAllocationHandle> spare(8, 0);
  for (auto& s : spare) {
    p.must(p.api.mem_create(&s, page, &p.prop, 0), "cuMemCreate");
  }
  // kRounds maps of one page under the load, the i-th at at(i) with handle(i), each unmapped
  // after it (then done(handle) runs): the times of the maps made while the copies ran.
  const auto rounds = [&](auto at, auto handle, auto done) {
    CopyLoad copies(load);
    std::vector<double> us;
    for (int i = 0; i < kRounds; ++i) {
      const CUmemGenericAllocationHandle hi = handle();
      const double t = timed_map(at(i), hi);
      if (copies.running()) {
        us.push_back(t);
      }
      p.must(p.api.mem_unmap(at(i), page), "cuMemUnmap");
      done(hi);
    }
    return us;
  };
  const auto same_handle = [&] { return h; };
  const auto keep = [](CUmemGenericAllocationHandle) {};
  line("map_same_va", rounds([&](int) { return base; }, same_handle, keep));
  // A fresh reservation for each of the next two questions, so that "fresh" holds.
  for (const bool new_handle : {false, true}) {
    CUdeviceptr va = 0;
    p.must(p.api.mem_address_reserve(&va, kRounds * page, 0, 0, 0), "cuMemAddressReserve");
    const auto fresh_at = [&](int i) { return va + static_cast<CUdeviceptr>(i) * page; };
    const std::vector<double> us =
        new_handle ? rounds(fresh_at,
                            [&] {
                              CUmemGenericAllocationHandle created = 0;
                              p.must(p.api.mem_create(&created, page, &p.prop, 0), "cuMemCreate");
                              return created;
                            },
                            [&](CUmemGenericAllocationHandle created) {
                              p.must(p.api.mem_release(created), "cuMemRelease");
                            })
                   : rounds(fresh_at, same_handle, keep);
    line(new_handle ? "map_fresh_both" : "map_fresh_va", us);
    p.must(p.api.mem_address_free(va, kRounds * page), "cuMemAddressFree");
  }
  {  // map_old_va: the second half of `base`, mapped once each (untimed), unmapped, then again
    const CUdeviceptr old = base + static_cast<CUdeviceptr>(kRounds) * page;
    const auto old_at = [&](int i) { return old + static_cast<CUdeviceptr>(i) * page; };
    for (int i = 0; i < kRounds; ++i) {
      p.must(p.map(old_at(i), page, 0, h), "cuMemMap");
      p.must(p.api.mem_unmap(old_at(i), page), "cuMemUnmap");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    line("map_old_va", rounds(old_at, same_handle, keep));
  }
  // map_8_serial and map_8_threads: 8 handles at 8 fresh addresses per round.
  for (const bool threads : {false, true}) {
    constexpr int kSets = 10;
    CUdeviceptr va = 0;
    p.must(p.api.mem_address_reserve(&va, kSets * 8 * page, 0, 0, 0), "cuMemAddressReserve");
    CopyLoad copies(load);
    std::vector<double> us;
    for (int r = 0; r < kSets; ++r) {
      const CUdeviceptr at = va + static_cast<CUdeviceptr>(r) * 8 * page;
      const auto t0 = std::chrono::steady_clock::now();
      if (threads) {
        std::vector<std::future<CUresult>> done;
        for (int k = 0; k < 8; ++k) {
          done.push_back(std::async(std::launch::async, [&, k] {
            const CUdeviceptr v = at + static_cast<CUdeviceptr>(k) * page;
            CUresult res = p.api.mem_map(v, page, 0, spare[static_cast<std::size_t>(k)], 0);
            return res == CUDA_SUCCESS ? p.api.mem_set_access(v, page, &p.access, 1) : res;
          }));
        }
        for (auto& f : done) {
          p.must(f.get(), "cuMemMap + cuMemSetAccess (thread)");
        }
      } else {
        for (int k = 0; k < 8; ++k) {
          p.must(p.map(at + static_cast<CUdeviceptr>(k) * page, page, 0, spare[static_cast<std::size_t>(k)]),
                 "cuMemMap");
        }
      }
      const double t = since_us(t0);
      if (copies.running()) {
        us.push_back(t);
      }
      for (int k = 0; k < 8; ++k) {
        p.must(p.api.mem_unmap(at + static_cast<CUdeviceptr>(k) * page, page), "cuMemUnmap");
      }
    }
    line(threads ? "map_8_threads" : "map_8_serial", us);
    p.must(p.api.mem_address_free(va, kSets * 8 * page), "cuMemAddressFree");
  }
  for (auto s : spare) {
    p.must(p.api.mem_release(s), "cuMemRelease");
  }
  p.must(p.api.mem_release(h), "cuMemRelease");
  p.must(p.api.mem_address_free(base, 2 * kRounds * page), "cuMemAddressFree");
}

#if CACHEALLOC_PROBE_KERNELS
// Note [Mapping behind a stream wait]: what both probes below set up. A host word mapped into the
// device's address space, a non-blocking stream held behind cuStreamWaitValue64 on it until
// release() sets the word, and device memory for the check's count of differing words. The
// destructor frees them, unless the stream failed (`stream_failed`): then it may still use them.
struct HeldStream {
  std::uint64_t* flag = nullptr;
  void* dflag = nullptr;
  cudaStream_t stream = nullptr;
  unsigned long long* mismatches = nullptr;
  bool stream_failed = false;

  HeldStream() = default;
  HeldStream(const HeldStream&) = delete;
  HeldStream& operator=(const HeldStream&) = delete;
  ~HeldStream() {
    if (stream_failed) {
      return;
    }
    if (stream != nullptr) {
      cudaStreamDestroy(stream);
    }
    if (mismatches != nullptr) {
      cudaFree(mismatches);
    }
    if (flag != nullptr) {
      cudaFreeHost(flag);
    }
  }
  /// False when a step failed (what was made is freed all the same).
  bool make() {
    if (cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(std::uint64_t), cudaHostAllocMapped) !=
        cudaSuccess) {
      flag = nullptr;
      return false;
    }
    *flag = 0;
    return cudaHostGetDevicePointer(&dflag, flag, 0) == cudaSuccess &&
           cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches) == cudaSuccess &&
           cudaMemset(mismatches, 0, sizeof *mismatches) == cudaSuccess &&
           cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess;
  }
  /// Queues the wait for the word on the stream.
  CUresult hold(const Probe& p) const {
    return p.api.stream_wait_value64(reinterpret_cast<CUstream>(stream),
                                     reinterpret_cast<CUdeviceptr>(dflag), 1,
                                     CU_STREAM_WAIT_VALUE_GEQ);
  }
  /// Sets the word the stream waits on (no cast of a plain integer to std::atomic).
  void release() const { std::atomic_ref<std::uint64_t>(*flag).store(1, std::memory_order_release); }
  /// Waits for the stream; false (and nothing is freed later) when it failed.
  cudaError_t finish() {
    const cudaError_t e = cudaStreamSynchronize(stream);
    stream_failed = e != cudaSuccess;
    return e;
  }
};

// Note [Mapping behind a stream wait]: one round. The stream spins (so the host is ahead of it),
// waits for the word, fills [va, va + bytes) and checks it; only then does another thread map
// the pages and set the word. With `unmap_busy`, a third thread unmaps that (mapped, untouched)
// range at the same moment. Returns the line to print.
std::string map_behind_wait(Probe& p, CUdeviceptr va, std::size_t bytes, CUmemGenericAllocationHandle h,
                            CUdeviceptr busy, std::size_t busy_bytes, bool unmap_busy,
                            std::vector<double>& enqueue_us, bool access_only = false) {
  namespace gt = cachealloc::gpu_test;
  if (p.api.stream_wait_value64 == nullptr) {
    return "rejected (the driver has no cuStreamWaitValue64)";
  }
  HeldStream held;
  if (!held.make()) {
    return "rejected (setup failed)";
  }
  std::string verdict;
  if (access_only) {  // Note [Access behind a stream wait]: mapped here, access granted later
    const CUresult r = p.api.mem_map(va, bytes, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      return "rejected (cuMemMap: " + error_text(p.api, r) + ")";
    }
  }
  gt::launch_spin(2'000'000, held.stream);  // about 1 ms at 2 GHz: the kernels below are queued ahead
  const auto t0 = std::chrono::steady_clock::now();
  const CUresult wr = held.hold(p);
  enqueue_us.push_back(since_us(t0));
  if (wr != CUDA_SUCCESS) {
    verdict = "rejected (cuStreamWaitValue64: " + error_text(p.api, wr) + ")";
  }
  const cudaError_t fl = gt::launch_fill(reinterpret_cast<void*>(va), bytes, 7, 11, held.stream);
  const cudaError_t ve =
      gt::launch_verify(reinterpret_cast<void*>(va), bytes, 7, 11, held.mismatches, held.stream);
  if (verdict.empty() && (fl != cudaSuccess || ve != cudaSuccess)) {
    verdict = std::string("rejected (launch: ") + cudaGetErrorName(fl != cudaSuccess ? fl : ve) + ")";
  }
  std::future<CUresult> unmapper;
  if (unmap_busy) {
    unmapper = std::async(std::launch::async, [&] { return p.api.mem_unmap(busy, busy_bytes); });
  }
  auto mapper = std::async(std::launch::async, [&] {
    const CUresult r = access_only ? p.api.mem_set_access(va, bytes, &p.access, 1) : p.map(va, bytes, 0, h);
    held.release();
    return r;
  });
  const bool returned = mapper.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  if (!returned) {
    held.release();  // release the stream: the map waits for it
    verdict = "rejected (deadlock: the map did not return while the stream waited)";
  }
  const CUresult mr = mapper.get();
  if (verdict.empty() && mr != CUDA_SUCCESS) {
    verdict = std::string(access_only ? "rejected (cuMemSetAccess: " : "rejected (cuMemMap: ") +
              error_text(p.api, mr) + ")";
  }
  if (unmap_busy) {
    const CUresult ur = unmapper.get();
    if (verdict.empty() && ur != CUDA_SUCCESS) {
      verdict = "rejected (cuMemUnmap on the third thread: " + error_text(p.api, ur) + ")";
    }
  }
  const cudaError_t sync = held.finish();
  unsigned long long bad = 0;
  if (sync == cudaSuccess) {
    cudaMemcpy(&bad, held.mismatches, sizeof bad, cudaMemcpyDeviceToHost);
  }
  if (verdict.empty()) {
    if (sync != cudaSuccess) {
      verdict = std::string("rejected (the stream failed: ") + cudaGetErrorName(sync) + ")";
    } else if (bad != 0) {
      verdict = "rejected (" + std::to_string(bad) + " words differ)";
    } else {
      verdict = "ok";
    }
  }
  if (sync == cudaSuccess) {
    p.api.mem_unmap(va, bytes);
  }
  return verdict;
}

// Note [Mapping behind a stream wait]: whether the runtime queues a copy or a memset into pages
// that are mapped only after the call (the stream held behind the wait meanwhile). Returns the line.
std::string copy_before_map(Probe& p, CUdeviceptr va, std::size_t bytes, CUmemGenericAllocationHandle h,
                            bool memset, bool access_only = false) {
  if (p.api.stream_wait_value64 == nullptr) {
    return "rejected (the driver has no cuStreamWaitValue64)";
  }
  HeldStream held;
  if (!held.make()) {
    return "rejected (setup failed)";
  }
  // The copy's source: pinned host memory, freed unless the stream failed (it may still read it).
  void* src = nullptr;
  if (cudaMallocHost(&src, bytes) != cudaSuccess) {
    return "rejected (setup failed)";
  }
  if (access_only) {  // Note [Access behind a stream wait]: mapped, no access yet
    const CUresult r = p.api.mem_map(va, bytes, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      cudaFreeHost(src);
      return "rejected (cuMemMap: " + error_text(p.api, r) + ")";
    }
  }
  const CUresult wr = held.hold(p);
  const cudaError_t queued = memset ? cudaMemsetAsync(reinterpret_cast<void*>(va), 0, bytes, held.stream)
                                    : cudaMemcpyAsync(reinterpret_cast<void*>(va), src, bytes,
                                                      cudaMemcpyHostToDevice, held.stream);
  (void)cudaGetLastError();  // a rejected call leaves its error behind
  const CUresult mr = access_only ? p.api.mem_set_access(va, bytes, &p.access, 1) : p.map(va, bytes, 0, h);
  held.release();
  const cudaError_t sync = held.finish();
  std::string verdict;
  if (wr != CUDA_SUCCESS) {
    verdict = "rejected (cuStreamWaitValue64: " + error_text(p.api, wr) + ")";
  } else if (queued != cudaSuccess) {
    verdict = std::string("rejected (") + cudaGetErrorName(queued) + " when queued)";
  } else if (mr != CUDA_SUCCESS || sync != cudaSuccess) {
    verdict = std::string("rejected (map ") + error_text(p.api, mr) + ", stream " + cudaGetErrorName(sync) + ")";
  } else {
    verdict = "ok";
  }
  if (mr == CUDA_SUCCESS || access_only) {
    p.api.mem_unmap(va, bytes);
  }
  if (sync == cudaSuccess) {
    cudaFreeHost(src);
  }
  return verdict;
}
#endif

}  // namespace

#if CACHEALLOC_PROBE_KERNELS
/// Note [Device calls behind a running kernel]. `load`: "idle" (no kernel), "legacy" (the legacy
/// default stream) or "nonblocking" (a stream of its own).
void calls_behind_kernel(Probe& p, const char* load) {
  const bool idle = std::strcmp(load, "idle") == 0;
  int clock_khz = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0) != cudaSuccess || clock_khz <= 0) {
    clock_khz = 1'500'000;
  }
  const long long cycles = static_cast<long long>(clock_khz) * 20;  // about 20 ms
  cudaStream_t stream = nullptr;  // the legacy default stream
  if (std::strcmp(load, "nonblocking") == 0 && cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::printf("PROBE behind_kernel_%s: not measured (no stream)\n", load);
    return;
  }
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  p.must(p.api.mem_address_reserve(&va, p.page, 0, 0, 0), "cuMemAddressReserve");
  p.must(p.api.mem_create(&h, p.page, &p.prop, 0), "cuMemCreate");
  std::vector<double> map_us;
  std::vector<double> unmap_us;
  std::vector<double> create_us;
  std::vector<double> release_us;
  int running[4] = {0, 0, 0, 0};
  const auto still_running = [&] { return !idle && cudaStreamQuery(stream) == cudaErrorNotReady; };
  constexpr int kRounds = 8;
  bool launched = true;
  for (int round = 0; round < kRounds && launched; ++round) {
    if (!idle) {
      launched = cachealloc::gpu_test::launch_spin(cycles, stream) == cudaSuccess;
      if (!launched) {
        break;
      }
      // The kernel must have started (or be queued) before the calls: give the launch 1 ms.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    auto t0 = std::chrono::steady_clock::now();
    p.must(p.map(va, p.page, 0, h), "cuMemMap");
    map_us.push_back(since_us(t0));
    running[0] += still_running() ? 1 : 0;
    t0 = std::chrono::steady_clock::now();
    p.must(p.api.mem_unmap(va, p.page), "cuMemUnmap");
    unmap_us.push_back(since_us(t0));
    running[1] += still_running() ? 1 : 0;
    CUmemGenericAllocationHandle other = 0;
    t0 = std::chrono::steady_clock::now();
    p.must(p.api.mem_create(&other, p.page, &p.prop, 0), "cuMemCreate");
    create_us.push_back(since_us(t0));
    running[2] += still_running() ? 1 : 0;
    t0 = std::chrono::steady_clock::now();
    p.must(p.api.mem_release(other), "cuMemRelease");
    release_us.push_back(since_us(t0));
    running[3] += still_running() ? 1 : 0;
    if (!idle && cudaStreamSynchronize(stream) != cudaSuccess) {
      launched = false;
    }
  }
  if (map_us.empty() || !launched) {
    std::printf("PROBE behind_kernel_%s: not measured (the spin kernel failed: %s)\n", load,
                cudaGetErrorString(cudaGetLastError()));
  } else if (idle) {
    std::printf("PROBE behind_kernel_idle: map+access median %.1f us, unmap %.1f us, create %.1f us, "
                "release %.1f us over %zu\n",
                median(map_us), median(unmap_us), median(create_us), median(release_us), map_us.size());
  } else {
    std::printf("PROBE behind_kernel_%s: map+access median %.1f us, unmap %.1f us, create %.1f us, "
                "release %.1f us over %zu; the kernel (%.0f ms) still ran after the map %d/%zu, the unmap "
                "%d/%zu, the create %d/%zu, the release %d/%zu\n",
                load, median(map_us), median(unmap_us), median(create_us), median(release_us), map_us.size(),
                static_cast<double>(cycles) / clock_khz, running[0], map_us.size(), running[1], map_us.size(),
                running[2], map_us.size(), running[3], map_us.size());
  }
  p.must(p.api.mem_release(h), "cuMemRelease");
  p.must(p.api.mem_address_free(va, p.page), "cuMemAddressFree");
  if (stream != nullptr) {
    cudaStreamDestroy(stream);
  }
}
#endif

int main(int argc, char** argv) {
  const bool only_behind_kernel = argc > 1 && std::strcmp(argv[1], "behind_kernel") == 0;
  if (argc > 1 && !only_behind_kernel) {
    std::printf("usage: cachealloc-vmm-probe [behind_kernel]\n"
                "  without an argument: every question (see the notes in bench/micro/vmm_probe.cpp)\n"
                "  behind_kernel: only Note [Device calls behind a running kernel]\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cachealloc-vmm-probe: no GPU visible, nothing probed (skipped)\n");
    return 77;
  }
  try {
    cudaSetDevice(0);
    cudaFree(nullptr);  // the primary context, as the backends make it
    const DriverApi& api = cachealloc::cuda_detail::driver_api();
    Probe p{api};
    p.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.prop.location.id = 0;
    p.access.location = p.prop.location;
    p.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    p.must(api.mem_get_allocation_granularity(&p.page, &p.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
           "cuMemGetAllocationGranularity");
    std::printf("granularity %zu bytes\n", p.page);
    if (only_behind_kernel) {
#if CACHEALLOC_PROBE_KERNELS
      for (const char* load : {"idle", "legacy", "nonblocking"}) {
        calls_behind_kernel(p, load);
      }
#else
      std::printf("PROBE behind_kernel: not built (the GPU test kernels were not configured)\n");
#endif
      return 0;
    }
    const std::size_t n = 4;
    CUdeviceptr a = 0;
    CUdeviceptr b = 0;
    p.must(api.mem_address_reserve(&a, n * p.page, 0, 0, 0), "cuMemAddressReserve");
    p.must(api.mem_address_reserve(&b, n * p.page, 0, 0, 0), "cuMemAddressReserve");
    CUmemGenericAllocationHandle h = 0;
    p.must(api.mem_create(&h, n * p.page, &p.prop, 0), "cuMemCreate");

    // map_at_offset: the last page of the handle alone, at b.
    {
      std::vector<double> us;
      CUresult r = CUDA_SUCCESS;
      for (int i = 0; i < 20 && r == CUDA_SUCCESS; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        r = p.map(b, p.page, (n - 1) * p.page, h);
        if (r == CUDA_SUCCESS) {
          us.push_back(since_us(t0));
          p.must(api.mem_unmap(b, p.page), "cuMemUnmap");
        }
      }
      p.report("map_at_offset", r, us);
    }
    // alias_whole and alias_piece: the whole handle at a, then again at b / a piece of it at b.
    p.must(p.map(a, n * p.page, 0, h), "cuMemMap (whole handle)");
    {
      const CUresult r = p.map(b, n * p.page, 0, h);
      p.report("alias_whole", r);
      if (r == CUDA_SUCCESS) {
        p.must(api.mem_unmap(b, n * p.page), "cuMemUnmap (alias)");
      }
    }
    {
      const CUresult r = p.map(b + p.page, p.page, 2 * p.page, h);
      p.report("alias_piece", r);
      if (r == CUDA_SUCCESS) {
        p.must(api.mem_unmap(b + p.page, p.page), "cuMemUnmap (piece)");
      }
    }
    // unmap_subrange: one page of the whole mapping at a.
    {
      const CUresult r = api.mem_unmap(a + p.page, p.page);
      p.report("unmap_subrange", r);
    }
    p.must(api.mem_unmap(a, n * p.page), "cuMemUnmap (whole)");
    // release_mapped: the whole handle mapped at b, released, then unmapped.
    {
      p.must(p.map(b, n * p.page, 0, h), "cuMemMap (whole handle, for release_mapped)");
      const CUresult rel = api.mem_release(h);
      p.report("release_mapped", rel);
      p.must(api.mem_unmap(b, n * p.page), "cuMemUnmap (after release)");
      if (rel != CUDA_SUCCESS) {
        p.must(api.mem_release(h), "cuMemRelease");
      }
    }
    // Note [Maps while copy engines run]
    for (const char* load : {"idle", "d2h", "h2d", "d2h8"}) {
      map_under_copies(p, load);
    }
    // Note [Creating and releasing while copy engines run]
    for (const char* load : {"idle", "d2h8"}) {
      create_release_under_copies(p, load);
    }
    // Note [Unmaps and copies under maps]
    copies_with_maps(p);
    // Note [Which maps wait for the copies]
    for (const char* load : {"idle", "d2h", "d2h8"}) {
      map_freshness(p, load);
    }
#if CACHEALLOC_PROBE_KERNELS
    // Note [Device calls behind a running kernel]
    for (const char* load : {"idle", "legacy", "nonblocking"}) {
      calls_behind_kernel(p, load);
    }
    // Note [Mapping behind a stream wait]: 16 pages, a fresh handle, five rounds each.
    {
      const std::size_t m = 16;
      CUdeviceptr c = 0;
      CUdeviceptr busy = 0;
      CUmemGenericAllocationHandle hc = 0;
      CUmemGenericAllocationHandle hb = 0;
      p.must(api.mem_address_reserve(&c, m * p.page, 0, 0, 0), "cuMemAddressReserve");
      p.must(api.mem_address_reserve(&busy, m * p.page, 0, 0, 0), "cuMemAddressReserve");
      p.must(api.mem_create(&hc, m * p.page, &p.prop, 0), "cuMemCreate");
      p.must(api.mem_create(&hb, m * p.page, &p.prop, 0), "cuMemCreate");
      for (const bool with_unmap : {false, true}) {
        std::vector<double> us;
        std::string verdict = "ok";
        for (int round = 0; round < 5 && verdict == "ok"; ++round) {
          if (with_unmap) {
            p.must(p.map(busy, m * p.page, 0, hb), "cuMemMap (busy)");
          }
          verdict = map_behind_wait(p, c, m * p.page, hc, busy, m * p.page, with_unmap, us);
        }
        std::printf("PROBE %s: %s median %.1f us over %zu (enqueuing the wait)\n",
                    with_unmap ? "map_behind_wait_unmap" : "map_behind_wait", verdict.c_str(),
                    us.empty() ? 0.0 : median(us), us.size());
        if (verdict != "ok") {
          break;  // the context may be unusable now
        }
      }
      // Note [Access behind a stream wait]: the same with the pages mapped at once and only
      // the access granted by the other thread (kernels first, then the copy and the memset).
      {
        std::vector<double> us;
        std::string verdict = "ok";
        for (int round = 0; round < 5 && verdict == "ok"; ++round) {
          verdict = map_behind_wait(p, c, m * p.page, hc, busy, m * p.page, false, us, /*access_only=*/true);
        }
        std::printf("PROBE access_behind_wait: %s\n", verdict.c_str());
        if (verdict == "ok") {
          for (const bool memset : {false, true}) {
            std::printf("PROBE %s: %s\n", memset ? "memset_before_access" : "memcpy_before_access",
                        copy_before_map(p, c, m * p.page, hc, memset, /*access_only=*/true).c_str());
          }
        }
      }
      for (const bool memset : {false, true}) {
        std::printf("PROBE %s: %s\n", memset ? "memset_before_map" : "memcpy_before_map",
                    copy_before_map(p, c, m * p.page, hc, memset).c_str());
      }
    }
#else
    std::printf("PROBE map_behind_wait: not built (the GPU test kernels were not configured)\n");
#endif
    p.must(api.mem_address_free(a, n * p.page), "cuMemAddressFree");
    p.must(api.mem_address_free(b, n * p.page), "cuMemAddressFree");
    return 0;
  } catch (const std::exception& e) {
    std::printf("cachealloc-vmm-probe: %s\n", e.what());
    return 1;
  }
}
