// driver_api.cpp: loading the CUDA driver API at run time (Note [Loading the driver API]).
#include "driver_api.h"

#include <cachealloc/errors.h>

#include <dlfcn.h>

#include <cstdio>
#include <string>

namespace cachealloc::cuda_detail {
namespace {

constexpr const char* kLibrary = "libcuda.so.1";
constexpr int kAbiVersion = 12000;  // see Note [Loading the driver API]

std::string unavailable(const std::string& why) {
  return "CUDA driver API not available: " + why +
         "; policy defrag needs a GPU with CUDA virtual memory support";
}

using GetProcAddress = CUresult (*)(const char* symbol, void** pfn, int cuda_version,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult* status);

class Loader {
 public:
  Loader() {
    try {
      load();
      ok_ = true;
    } catch (const DeviceError& e) {
      error_ = e.what();
      code_ = e.code();
    }
  }
  const DriverApi& get() const {
    if (!ok_) {
      throw DeviceError(error_, code_);
    }
    return api_;
  }

 private:
  /// Like resolve(), but a missing symbol leaves `fn` null.
  template <class F>
  void resolve_optional(F& fn, const char* symbol) noexcept {
    try {
      resolve(fn, symbol);
    } catch (const DeviceError&) {
      fn = nullptr;
    }
  }

  template <class F>
  void resolve(F& fn, const char* symbol) {
    void* p = nullptr;
    if (get_proc_ != nullptr) {
      CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      if (get_proc_(symbol, &p, kAbiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
          status != CU_GET_PROC_ADDRESS_SUCCESS) {
        p = nullptr;
      }
    }
    if (p == nullptr) {
      p = dlsym(handle_, symbol);
    }
    if (p == nullptr) {
      throw DeviceError(unavailable(std::string("symbol ") + symbol + " not found in " + kLibrary +
                                    " (driver too old?)"));
    }
    fn = reinterpret_cast<F>(p);
  }

  void load() {
    handle_ = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) {
      const char* why = dlerror();
      throw DeviceError(unavailable(std::string(why != nullptr ? why : "dlopen failed") + " (" +
                                    kLibrary + " not found)"));
    }
    get_proc_ = reinterpret_cast<GetProcAddress>(dlsym(handle_, "cuGetProcAddress_v2"));
    resolve(api_.init, "cuInit");
    resolve(api_.device_get, "cuDeviceGet");
    resolve(api_.device_get_attribute, "cuDeviceGetAttribute");
    resolve(api_.ctx_get_current, "cuCtxGetCurrent");
    resolve(api_.get_error_name, "cuGetErrorName");
    resolve(api_.get_error_string, "cuGetErrorString");
    resolve(api_.mem_address_reserve, "cuMemAddressReserve");
    resolve(api_.mem_address_free, "cuMemAddressFree");
    resolve(api_.mem_create, "cuMemCreate");
    resolve(api_.mem_release, "cuMemRelease");
    resolve(api_.mem_map, "cuMemMap");
    resolve(api_.mem_unmap, "cuMemUnmap");
    resolve(api_.mem_set_access, "cuMemSetAccess");
    resolve(api_.mem_get_allocation_granularity, "cuMemGetAllocationGranularity");
    resolve_optional(api_.stream_write_value64, "cuStreamWriteValue64");
    resolve_optional(api_.stream_wait_value64, "cuStreamWaitValue64");
    const CUresult status = api_.init(0);
    if (status != CUDA_SUCCESS) {
      throw DeviceError(unavailable("cuInit failed with " + describe_code(status)),
                        static_cast<int>(status));
    }
  }

  std::string describe_code(CUresult status) const {
    const char* name = nullptr;
    if (api_.get_error_name != nullptr) {
      api_.get_error_name(status, &name);
    }
    return (name != nullptr ? std::string(name) : "CUresult") + " (" + std::to_string(status) + ")";
  }

  void* handle_ = nullptr;  // never dlclosed: the runtime keeps the driver loaded anyway
  GetProcAddress get_proc_ = nullptr;
  DriverApi api_;
  bool ok_ = false;
  std::string error_;
  int code_ = 0;
};

}  // namespace

const DriverApi& driver_api() {
  static const Loader loader;  // thread-safe one-time initialisation
  return loader.get();
}

std::string describe_driver_error(CUresult error, const char* call, const char* file, int line) {
  const char* name = nullptr;
  const char* text = nullptr;
  try {
    const DriverApi& api = driver_api();
    api.get_error_name(error, &name);
    api.get_error_string(error, &text);
  } catch (const DeviceError&) {  // cannot happen once a driver call ran; keep the numbers
  }
  return std::string("CUDA driver error ") + (name != nullptr ? name : "CUresult") + " (" +
         std::to_string(static_cast<int>(error)) + ": " + (text != nullptr ? text : "?") + ") in " +
         call + " at " + file + ":" + std::to_string(line);
}

void throw_driver_error(CUresult error, const char* call, const char* file, int line) {
  throw DeviceError(describe_driver_error(error, call, file, line), static_cast<int>(error));
}

void warn_driver_error(CUresult error, const char* call, const char* file, int line) noexcept {
  if (error == CUDA_ERROR_DEINITIALIZED) {
    return;  // process exit: the driver is already gone
  }
  try {
    std::fprintf(stderr, "cachealloc: %s (ignored: this path cannot throw)\n",
                 describe_driver_error(error, call, file, line).c_str());
  } catch (...) {  // NOLINT(bugprone-empty-catch)
  }
}

}  // namespace cachealloc::cuda_detail
