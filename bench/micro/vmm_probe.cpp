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
#include "../../allocator/cuda/src/driver_api.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
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
      std::vector<double> v = us;
      std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
      char buf[64];
      std::snprintf(buf, sizeof buf, " median %.1f us over %zu", v[v.size() / 2], v.size());
      line += buf;
    }
    std::printf("%s\n", line.c_str());
  }
};

double since_us(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main() {
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
    p.must(api.mem_address_free(a, n * p.page), "cuMemAddressFree");
    p.must(api.mem_address_free(b, n * p.page), "cuMemAddressFree");
    return 0;
  } catch (const std::exception& e) {
    std::printf("cachealloc-vmm-probe: %s\n", e.what());
    return 1;
  }
}
